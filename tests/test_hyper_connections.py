"""
Hyper-Connections and mHC (residuals.py MultiStream, HC, MHC, sinkhorn; paper Appendix A,
docs/schemes.md): parameter counts against closed forms, each sublayer's read, mix and write
against an explicit per-stream loop, Sinkhorn (doubly stochastic, safe on extreme logits,
Liger-Kernel's eps and order, the training default of 20 iterations), the init (equal to Pre-LN
with the same backbone weights, routing scales 0.01), fp32 routing, the probe hooks (lens,
skip, traces, routing that travels with its block), the optimizer groups, the whole model
(causality, orders, training, checkpoints; with Block AttnRes, whose scheme-specific cases are
in tests/test_attnres.py) and the init values and Sinkhorn of the study's code. CPU only:

    python -m pytest tests/test_hyper_connections.py -q
"""

import ast
import io
import math
from pathlib import Path

import pytest
import torch

import test_study_fidelity as fidelity
from model import GPT, GPTConfig
from multi_stream_models import V, make, max_rel, pair, perturb, tokens
from residuals import sinkhorn
from small_models import move_off_init, small_model, tiny
from test_study_fidelity import D, M, TOL, Study, study_logits, study_weights

REPO = Path(__file__).resolve().parents[1]


SCHEMES = ('hc', 'mhc', 'blockattnres')


# -----------------------------------------------------------------------------
# parameter counts: closed forms (also used by the cost model)


def delta_params(residual, L, d, m):
    """Parameters a scheme adds to Pre-LN at L blocks, width d, m streams."""
    if residual == 'hc':  # per sublayer: static [A_m|A_r], W, s_alpha, static beta, w_beta, s_beta
        return 2 * L * (m * (m + 1) + d * (m + 1) + 1 + m + d + 1)
    if residual == 'mhc':  # per sublayer: phi (md x (m^2+2m)), bias (m^2+2m), three gates
        return 2 * L * ((m * d) * (m * m + 2 * m) + (m * m + 2 * m) + 3)
    if residual == 'blockattnres':  # 2L reads (2L-1 sublayers + final), each a query and a key gain
        return 2 * L * 2 * d
    raise KeyError(residual)


@pytest.mark.parametrize('residual', SCHEMES)
@pytest.mark.parametrize('L,d,m', [(1, 32, 4), (3, 64, 2), (4, 48, 3)])
def test_extra_parameters_match_closed_form(residual, L, d, m):
    base = make('preln', n_layer=L, n_embd=d).num_params()
    model = make(residual, n_layer=L, n_embd=d, hc_streams=m, attnres_blocks=2 * L)
    assert model.num_params() - base == delta_params(residual, L, d, m)


def test_closed_forms_at_m4():
    # the simplified forms quoted in the cost model (12Ld + 52L, 192Ld + 54L, 4Ld) against the
    # parameters the models really add at m = 4 (small L, d), and against cost.param_count at
    # the study's sizes (a config only: no model is built)
    import cost
    forms = {'hc': lambda L, d: 12 * L * d + 52 * L, 'mhc': lambda L, d: 192 * L * d + 54 * L,
             'blockattnres': lambda L, d: 4 * L * d}
    for L, d in [(1, 32), (3, 48)]:
        base = make('preln', n_layer=L, n_embd=d).num_params()
        for residual, form in forms.items():
            model = make(residual, n_layer=L, n_embd=d, hc_streams=4, attnres_blocks=2 * L)
            assert model.num_params() - base == form(L, d), (residual, L, d)
    for L, d in [(16, 1216), (32, 896)]:
        cfg = lambda r: GPTConfig(vocab_size=V, block_size=32, n_layer=L, n_head=16, n_embd=d, residual=r,
                                  hc_streams=4, attnres_blocks=8)
        for residual, form in forms.items():
            assert cost.param_count(cfg(residual)) - cost.param_count(cfg('preln')) == form(L, d), residual


# -----------------------------------------------------------------------------
# the routing algebra, checked against an explicit per-stream loop


@torch.no_grad()
def test_hc_sublayer_matches_explicit_formula():
    model = make('hc', n_layer=1, hc_streams=3)
    perturb(model)
    res, r, norm = model.residual, model.residual.layers[0].attn_route, model.residual.layers[0].attn_norm
    H = torch.randn(2, 5, 3, 64)
    f = torch.nn.Linear(64, 64)
    out = res.sublayer(H, 0, 0, r, norm, f)
    for bt in [(0, 0), (1, 4)]:
        Hs = H[bt]                                                          # (m, d)
        Hbar = Hs / Hs.pow(2).mean(-1, keepdim=True).add(1e-8).sqrt()
        A = r.static_alpha + r.alpha_scale * torch.tanh(Hbar @ r.dynamic_alpha)   # (m, m+1)
        beta = r.static_beta + r.beta_scale * torch.tanh(Hbar @ r.dynamic_beta)   # (m)
        x = sum(A[s, 0] * Hs[s] for s in range(3))
        y = f(norm(x))
        for t in range(3):
            want = sum(A[s, 1 + t] * Hs[s] for s in range(3)) + beta[t] * y
            torch.testing.assert_close(out[bt][t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('mode', ['liger', 'plain'])
@torch.no_grad()
def test_mhc_sublayer_matches_explicit_formula(mode):
    model = make('mhc', n_layer=1, hc_streams=3, mhc_init='uniform', mhc_sinkhorn=mode)
    perturb(model, std=0.05)
    res, r, norm = model.residual, model.residual.layers[0].mlp_route, model.residual.layers[0].mlp_norm
    H = torch.randn(2, 5, 3, 64)
    f = torch.nn.Linear(64, 64)
    out = res.sublayer(H, 0, 1, r, norm, f)
    for bt in [(0, 1), (1, 3)]:
        v = H[bt].flatten()
        xp = v / v.pow(2).mean().add(model.config.norm_eps).sqrt()
        lg = xp @ r.phi
        pre = torch.sigmoid(r.alpha_pre * lg[:3] + r.bias[:3])
        post = 2 * torch.sigmoid(r.alpha_post * lg[3:6] + r.bias[3:6])
        Z = (r.alpha_res * lg[6:].view(3, 3) + r.bias[6:].view(3, 3)).double()   # [i, j]: stream i into j
        if mode == 'plain':   # rows (per input) first, columns (per output) last
            P = torch.exp(Z)
            for _ in range(model.config.mhc_sinkhorn_iters):
                P = P / P.sum(1, keepdim=True)
                P = P / P.sum(0, keepdim=True)
        else:                 # liger_kernel on [j, i]: row softmax + 1e-6, then columns; every sum + 1e-6
            eps, Q = 1e-6, torch.softmax(Z.t(), dim=1) + 1e-6
            Q = Q / (Q.sum(0, keepdim=True) + eps)
            for _ in range(model.config.mhc_sinkhorn_iters - 1):
                Q = Q / (Q.sum(1, keepdim=True) + eps)
                Q = Q / (Q.sum(0, keepdim=True) + eps)
            P = Q.t()
        u = sum(pre[i] * H[bt][i] for i in range(3))
        y = f(norm(u))
        for j in range(3):
            want = sum(P[i, j].float() * H[bt][i] for i in range(3)) + post[j] * y
            torch.testing.assert_close(out[bt][j], want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_hc_residual_mixing_is_applied():
    model = make('hc')
    perturb(model, std=0.1)  # unequal streams, so that mixing them matters
    idx = tokens()
    before = model(idx)[0]
    r = model.residual.layers[1].attn_route
    r.static_alpha[:, 1:] = torch.tensor([[0., 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]])
    assert max_rel(model(idx)[0], before) > 1e-3


@torch.no_grad()
def test_beta_for_hc_alone_is_changed_in_hc_coefficients(monkeypatch):
    """HC's docstring: to change beta for HC alone, change what HC.coefficients returns; an
    edit in MultiStream.write_streams changes mHC too. Staged as a student would: beta x 0.5
    in HC.coefficients moves HC's logits and leaves mHC's bit for bit; the same x 0.5 in
    write_streams moves both."""
    import residuals
    models = {r: make(r) for r in ('hc', 'mhc')}
    for model in models.values():
        perturb(model, std=0.1)
    idx = tokens()
    before = {r: m(idx)[0] for r, m in models.items()}
    coefficients = residuals.HC.coefficients

    def half_beta(self, H, route):
        A_m, A_r, beta = coefficients(self, H, route)
        return A_m, A_r, 0.5 * beta
    with monkeypatch.context() as mp:
        mp.setattr(residuals.HC, 'coefficients', half_beta)
        assert max_rel(models['hc'](idx)[0], before['hc']) > 1e-3
        assert torch.equal(models['mhc'](idx)[0], before['mhc'])
    write = residuals.MultiStream.write_streams
    monkeypatch.setattr(residuals.MultiStream, 'write_streams', lambda self, H, A_r, beta, y: write(self, H, A_r, 0.5 * beta, y))
    assert all(max_rel(m(idx)[0], before[r]) > 1e-3 for r, m in models.items())


@torch.no_grad()
def test_hc_coefficients_move_by_at_most_the_scale_times_tanh():
    """With the projections W, w_beta non-zero, HC's coefficients are static + 0.01 tanh(H_bar W):
    at init they never move more than 0.01 from the one-hot read, identity mix and unit write."""
    model = small_model('hc', L=2)
    res, g = model.residual, torch.Generator().manual_seed(3)
    route = res.layers[1].mlp_route
    route.dynamic_alpha.copy_(torch.randn(route.dynamic_alpha.shape, generator=g))
    route.dynamic_beta.copy_(torch.randn(route.dynamic_beta.shape, generator=g))
    H = torch.randn(2, 5, res.m, 16, generator=g) * 3
    r, M, w = res.coefficients(H, route)
    Hbar = H * torch.rsqrt(H.pow(2).mean(-1, keepdim=True) + 1e-8)
    C = route.static_alpha + 0.01 * torch.tanh(Hbar @ route.dynamic_alpha)  # (B, T, m, m+1)
    torch.testing.assert_close(r, C[..., 0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(M, C[..., 1:], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w, 1 + 0.01 * torch.tanh(Hbar @ route.dynamic_beta), rtol=1e-6, atol=1e-7)
    k = 3  # sublayer 2b + j of block 1, MLP: reads stream 3 mod m
    onehot = torch.zeros(res.m)
    onehot[k % res.m] = 1.0
    assert (r - onehot).abs().max() <= 0.01 and (M - torch.eye(res.m)).abs().max() <= 0.01
    assert 0.005 < (w - 1).abs().max() <= 0.01  # the scale is used, and it is 0.01


# -----------------------------------------------------------------------------
# Sinkhorn


def scaled_logits(n, m=4, seed=0):
    """Logits up to +-50: a core in [-1, 1] plus row and column offsets up to +-24.5. The
    offsets are a diagonal rescaling of exp(logits), which Sinkhorn removes exactly, so the
    core sets the convergence speed and the offsets test the numerics."""
    g = torch.Generator().manual_seed(seed)
    core = torch.rand(n, m, m, generator=g) * 2 - 1
    rows = (torch.rand(n, m, 1, generator=g) * 2 - 1) * 24.5
    cols = (torch.rand(n, 1, m, generator=g) * 2 - 1) * 24.5
    return core + rows + cols


def sinkhorn_fp64(z, iters, order, eps):
    """Sinkhorn written out in fp64 on z (..., in, out). 'plain': exp(z) (max-shifted), then
    rows (per input) / columns (per output) alternately; 'liger' (liger_kernel on the
    transpose (out, in)): softmax over inputs + eps, then per-input sums, every denominator + eps."""
    z = z.double()
    if order == 'plain':
        P = torch.exp(z - z.amax((-1, -2), keepdim=True))
        for _ in range(iters):
            P = P / (P.sum(-1, keepdim=True) + eps)
            P = P / (P.sum(-2, keepdim=True) + eps)
        return P
    P = torch.softmax(z, dim=-2) + eps
    P = P / (P.sum(-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        P = P / (P.sum(-2, keepdim=True) + eps)
        P = P / (P.sum(-1, keepdim=True) + eps)
    return P


@pytest.mark.parametrize('order,eps', [('liger', 1e-6), ('plain', 0.0)])
def test_sinkhorn_is_doubly_stochastic(order, eps):
    z = scaled_logits(2000)
    assert z.abs().max() > 40
    P = sinkhorn(z, 20, order, eps)
    assert P.dtype == torch.float32 and torch.isfinite(P).all() and (P >= 0).all()
    assert (P.sum(-1) - 1).abs().max() < 1e-4
    assert (P.sum(-2) - 1).abs().max() < 1e-4
    torch.testing.assert_close(P.double(), sinkhorn_fp64(z, 20, order, eps), rtol=0, atol=1e-5)


@pytest.mark.parametrize('order,eps', [('liger', 1e-6), ('plain', 0.0)])
def test_sinkhorn_extreme_logits_are_safe_and_match_float64(order, eps):
    # i.i.d. logits in [-50, 50]: far from converged after 20 rounds (the rate depends on the
    # spread of the logits), but finite, non-negative, the last normalised sums exact, and the
    # same iterate as the rounds written out in fp64
    z = (torch.rand(2000, 4, 4, generator=torch.Generator().manual_seed(2)) * 2 - 1) * 50
    P = sinkhorn(z, 20, order, eps)
    assert torch.isfinite(P).all() and (P >= 0).all()
    last = -1 if order == 'liger' else -2
    assert (P.sum(last) - 1).abs().max() < 1e-5
    assert (P.sum(-1 - (last == -1)) - 1).abs().max() > 1e-2  # not converged: the test sees the order
    torch.testing.assert_close(P.double(), sinkhorn_fp64(z, 20, order, eps), rtol=0, atol=1e-5)


def test_sinkhorn_eps_and_order_are_liger_kernel_s():
    # eps > 0: liger_kernel's rounds (fp64), large enough an eps to matter; the order matters too
    z = torch.randn(7, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    P = sinkhorn(z, 5, 'liger', 1e-3)
    assert P.dtype == torch.float64
    torch.testing.assert_close(P, sinkhorn_fp64(z, 5, 'liger', 1e-3), rtol=1e-12, atol=1e-14)
    assert (P - sinkhorn(z, 5, 'liger', 1e-6)).abs().max() > 1e-4
    torch.testing.assert_close(sinkhorn(z, 5, 'plain', 0.0), sinkhorn_fp64(z, 5, 'plain', 0.0),
                               rtol=1e-12, atol=1e-14)
    assert (sinkhorn(z, 5, 'plain', 0.0) - sinkhorn(z, 5, 'liger', 0.0)).abs().max() > 1e-4


def test_mhc_sinkhorn_iterations_default_to_20_in_training():
    """Paper Appendix A, docs/schemes.md: 20 Sinkhorn-Knopp iterations; the training script's default
    (a literal in train.py) and GPTConfig's agree, and the built model uses them."""
    tree = ast.parse((REPO / 'train.py').read_text())
    defaults = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    assert ast.literal_eval(defaults['mhc_sinkhorn_iters']) == 20
    assert GPTConfig().mhc_sinkhorn_iters == 20
    model = tiny('mhc')
    assert model.config.mhc_sinkhorn_iters == 20


# -----------------------------------------------------------------------------
# init: Pre-LN with the same backbone weights, routing scales 0.01


@torch.no_grad()
def test_hc_at_init_is_m_times_preln():
    # All streams stay equal to the h of Pre-LN with the same backbone weights (one-hot read,
    # A_r = I, beta = 1), exact up to fp32 rounding. The default readout (the study's: the
    # final norm on each stream, then the sum) therefore gives m times Pre-LN's logits; the
    # paper's "sum, then norm" gives Pre-LN's logits themselves.
    idx = tokens()
    model, pre = pair('hc')
    assert model.residual.readout_mode == 'norm_sum'
    torch.testing.assert_close(model(idx)[0], 4 * pre(idx)[0], rtol=1e-5, atol=4e-5)
    model, pre = pair('hc', hc_readout='sum')
    torch.testing.assert_close(model(idx)[0], pre(idx)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
@torch.no_grad()
def test_multistream_out_init_scaled_by_sqrt_m_by_default(residual):
    # the study's scale_output_init_by_sqrt_n: the same draws as without it, over sqrt(m)
    a, b = make(residual, hc_streams=4, seed=2), make(residual, hc_streams=4, seed=2, hc_out_init_scale=False)
    for blk_a, blk_b in zip(a.blocks, b.blocks):
        torch.testing.assert_close(blk_a.attn.wo.weight, blk_b.attn.wo.weight / 2, rtol=0, atol=0)
        torch.testing.assert_close(blk_a.mlp.w_down.weight, blk_b.mlp.w_down.weight / 2, rtol=0, atol=0)
        torch.testing.assert_close(blk_a.attn.wq.weight, blk_b.attn.wq.weight, rtol=0, atol=0)


@torch.no_grad()
def test_mhc_gap8_at_init_equals_preln():
    model, pre = pair('mhc', mhc_init='gap8')
    idx = tokens()
    # Tolerance: the sigma(-8) = 3.4e-4 leakage of H_pre into the other streams only rescales
    # u = (sigma(8) + (m-1) sigma(-8)) h while all streams are equal, which RMSNorm removes;
    # H_res's columns sum to 1 (Sinkhorn ends on columns), so each new stream is again h + f,
    # and H_post = 2 sigma(0) = 1. Hence the match is exact up to fp32 rounding, not 1e-3.
    torch.testing.assert_close(model(idx)[0], pre(idx)[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_mhc_uniform_is_preln_only_without_the_dynamic_part():
    model, pre = pair('mhc', mhc_init='uniform')
    idx = tokens()
    ref = pre(idx)[0]
    # With the gates at 0, H_pre = 1/2 (u = (m/2) h, rescaled away by RMSNorm), H_res = 11^T/m
    # (the mean of equal streams is h) and H_post = 1: exactly Pre-LN.
    gates = [p for n, p in model.residual.named_parameters() if '.alpha_' in n]
    for g in gates:
        g.zero_()
    torch.testing.assert_close(model(idx)[0], ref, rtol=1e-5, atol=1e-5)
    # With the default gates 0.01 and phi ~ N(0, 0.02^2), the logits x' phi have std
    # 0.02 sqrt(md) = 0.32, so H_post = 2 sigma(0.01 x' phi) = 1 + O(2e-3) per stream: the streams
    # drift apart by ~0.2% of each branch output per sublayer -- close to Pre-LN, not equal.
    for g in gates:
        g.fill_(0.01)
    err = max_rel(model(idx)[0], ref)
    assert 1e-6 < err < 0.05


def routing_state(model):
    return {k: v.clone() for k, v in model.residual.state_dict().items()}


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
@torch.no_grad()
def test_routing_scales_start_at_the_study_s_0_01_whatever_came_before(residual):
    """HC's s_alpha, s_beta and mHC's three gates are 0.01 after init_weights, on a fresh model,
    after a re-init of a trained one, and on a model built on the meta device (whose memory
    holds garbage until init_weights): init_weights alone sets every routing parameter."""
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_embd=16, n_head=2, residual=residual)
    fresh = routing_state(GPT(cfg))
    names = ('alpha_scale', 'beta_scale') if residual == 'hc' else ('alpha_pre', 'alpha_post', 'alpha_res')
    scales = {k: v for k, v in fresh.items() if k.endswith(names)}
    assert len(scales) == 2 * 2 * len(names) and all(v.item() == pytest.approx(0.01) for v in scales.values())
    moved = move_off_init(GPT(cfg))
    moved.init_weights()
    with torch.device('meta'):
        meta = GPT(cfg)
    meta.to_empty(device='cpu')
    for p in meta.residual.parameters():
        p.fill_(7.0)  # what to_empty leaves is undefined: make it plainly wrong
    meta.init_weights()
    for other in (moved, meta):
        got = routing_state(other)
        for k, v in fresh.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


# -----------------------------------------------------------------------------
# precision


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
def test_routing_runs_in_fp32_under_autocast(residual):
    model = make(residual, mhc_init='uniform')
    with torch.autocast('cpu', dtype=torch.bfloat16), model.residual.trace() as tape:
        rec = []
        h = model.hidden(tokens(), record=rec)
        _, loss = model(tokens(), tokens(seed=2))
    assert torch.isfinite(loss)
    assert h.dtype == torch.float32 and all(p.dtype == torch.float32 for p, _ in rec)  # the streams stay fp32
    for r in tape:
        assert r['mix'].dtype == r['read'].dtype == r['write'].dtype == torch.float32
        if residual == 'mhc':
            assert (r['mix'].sum(-2) - 1).abs().max() < 1e-4


# -----------------------------------------------------------------------------
# probe hooks: lens, skip, traces; routing travels with its block


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
@torch.no_grad()
def test_multistream_probe_lens_and_skip(residual):
    m = 3
    model = make(residual, hc_streams=m)
    perturb(model, std=0.1)
    idx = tokens()
    x = model.wte(idx)
    rec = []
    h = model.hidden(idx, skip=(2,), record=rec)
    probe0, lens0 = rec[0]
    assert probe0.shape == (2, 16, m * 64) and lens0.shape == (2, 16, m, 64) and h.shape == (2, 16, m, 64)
    torch.testing.assert_close(probe0, x.repeat(1, 1, m))  # z_0 = m copies of the embedding
    torch.testing.assert_close(lens0, x.unsqueeze(-2).expand(-1, -1, m, -1))  # lens = the streams
    torch.testing.assert_close(rec[3][0], rec[2][0], rtol=0, atol=0)  # skip = identity on all streams
    torch.testing.assert_close(h, rec[-1][1])  # the head reads the last lens as it reads the output
    # the study's reduce_residual_streams: the sum for HC, the mean for mHC (Liger)
    torch.testing.assert_close(model.residual.reduce(lens0), m * x if residual == 'hc' else x)
    assert (rec[2][0] - rec[1][0]).abs().max() > 1e-3


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
@torch.no_grad()
def test_multistream_trace(residual):
    m, L = 4, 4
    model = make(residual, n_layer=L)
    perturb(model, std=0.05)
    with model.residual.trace() as tape:
        model(tokens())
    assert [(r['block'], r['sublayer']) for r in tape] == [(b, j) for b in range(L) for j in (0, 1)]
    for r in tape:
        assert r['read'].shape == (2, 16, m) and r['write'].shape == (2, 16, m)
        assert r['mix'].shape == (2, 16, m, m)
        assert all(torch.isfinite(r[k]).all() for k in ('read', 'mix', 'write'))
    if residual == 'mhc':  # H_res is (approximately) doubly stochastic, H_post in (0, 2)
        # Liger's order ends on the per-input sums (exact up to its 1e-6 eps); the per-output
        # sums are Sinkhorn's residual after 20 rounds (4e-4 here)
        assert all((r['mix'].sum(-1) - 1).abs().max() < 1e-5 for r in tape)
        assert all((r['mix'].sum(-2) - 1).abs().max() < 1e-3 for r in tape)
        assert all(((r['write'] > 0) & (r['write'] < 2)).all() for r in tape)


@pytest.mark.parametrize('residual', ['hc', 'mhc'])
@torch.no_grad()
def test_routing_travels_with_the_block(residual):
    model = make(residual)  # m = 4
    with model.residual.trace() as tape:
        model(tokens(), order=[1, 0, 2, 3])
    first = tape[0]
    assert (first['block'], first['sublayer']) == (1, 0)
    read = first['read']
    # block 1's attention is sublayer k = 2: it reads stream 2 even when it runs first
    assert (read.argmax(-1) == 2).all()
    assert read[..., 2].min() > 0.99 and read[..., [0, 1, 3]].max() < 1e-3
    # block 0's own attention read (third record) is stream 0
    assert (tape[2]['read'].argmax(-1) == 0).all() and tape[2]['block'] == 0


# -----------------------------------------------------------------------------
# optimizer groups


def test_weight_decay_groups():
    for residual, static, dynamic in [('hc', 'static_alpha', 'dynamic_alpha'), ('mhc', 'bias', 'phi'),
                                      ('hc', 'static_beta', 'alpha_scale'), ('mhc', 'alpha_res', 'phi')]:
        model = make(residual, n_layer=2)
        names = dict(model.residual.named_parameters())
        nwd = model.residual.no_weight_decay()
        assert nwd and nwd <= set(names)
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
        decayed = {id(p) for p in opt.param_groups[0]['params']}
        assert id(names[f'layers.1.mlp_route.{static}']) not in decayed
        assert id(names[f'layers.1.mlp_route.{dynamic}']) in decayed


# -----------------------------------------------------------------------------
# the whole model, HC, mHC and Block AttnRes: causality, orders, training, checkpoints


@pytest.mark.parametrize('residual', SCHEMES)
@torch.no_grad()
def test_causal(residual):
    model = make(residual, attnres_blocks=4)
    perturb(model, std=0.1)
    idx = tokens(T=20)
    idx2 = idx.clone()
    idx2[:, 12] = (idx2[:, 12] + 1) % V
    a, b = model(idx)[0], model(idx2)[0]
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-4


@pytest.mark.parametrize('residual', SCHEMES)
@torch.no_grad()
def test_skip_swap_drop_orders(residual):
    model = make(residual, attnres_blocks=4)
    perturb(model, std=0.1)
    idx = tokens()
    base = model(idx)[0]
    for kw in [{'order': [1, 0, 2, 3]}, {'order': [0, 2, 3]}, {'skip': (1,)}, {'skip': (0, 3)}]:
        rec = []
        h = model.hidden(idx, record=rec, **kw)
        logits = model.head(h)
        assert logits.shape == base.shape and torch.isfinite(logits).all()
        assert max_rel(logits, base) > 1e-4  # each intervention changes the model
        assert len(rec) == len(kw.get('order', range(4))) + 1


@pytest.mark.parametrize('residual', SCHEMES)
def test_trains_and_round_trips(residual):
    model = make(residual, n_layer=2, n_embd=32, attnres_blocks=2, mhc_init='uniform' if residual == 'mhc' else 'gap8')
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95))
    idx, tgt = tokens(B=4, T=16, seed=4), tokens(B=4, T=16, seed=5)
    losses = []
    for _ in range(50):
        _, loss = model(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v and abs(v) < 1e4, losses))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    # the scheme's parameters learn too
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.residual.parameters())

    buf = io.BytesIO()
    torch.save({'model': model.state_dict(), 'config': model.config.__dict__}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    again = GPT(GPTConfig.from_dict(ckpt['config']))
    again.load_state_dict(ckpt['model'])
    model.eval(), again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(idx)[0], model(idx)[0], rtol=0, atol=0)


# -----------------------------------------------------------------------------
# fidelity to the study's code (tests/test_study_fidelity.py holds its transcription)


@pytest.mark.parametrize('scheme', ('hc', 'mhc'))
@torch.no_grad()
def test_multistream_init_values_are_the_study_s(scheme):
    """HC: HyperConnection.reset_parameters (selected stream = layer_index % m with
    layer_index = 2 block_idx + sublayer); mHC: mhc_initialization_test (newest code):
    phi = 0, pre bias +8 / -8, post bias 0, residual bias -8 (1 - I), gates 0.01.
    And scale_output_init_by_sqrt_n on both: attention-out and w2 over sqrt(m)."""
    model = fidelity.make(scheme)
    W = study_weights(model)
    for b in range(fidelity.L):
        for j, conn in enumerate(('attention_hyper_connection', 'feed_forward_hyper_connection')):
            w = lambda n: W[f'blocks.{b}.{conn}.{n}']  # noqa: E731
            sel = (2 * b + j) % M
            if scheme == 'hc':
                static = torch.zeros(M, M + 1)
                static[sel, 0] = 1.0
                static[:, 1:] = torch.eye(M)
                assert torch.equal(w('static_alpha'), static) and torch.equal(w('static_beta'), torch.ones(M))
                assert not w('dynamic_alpha_proj').any() and not w('dynamic_beta_proj').any()
                assert w('dynamic_alpha_scale').item() == w('dynamic_beta_scale').item() == pytest.approx(0.01)
            else:
                pre = torch.full((M,), -8.0)
                pre[sel] = 8.0
                assert torch.count_nonzero(w('phi')) == 0
                assert torch.equal(w('b')[:M], pre) and torch.equal(w('b')[M:2 * M], torch.zeros(M))
                assert torch.equal(w('b')[2 * M:].view(M, M), -8.0 * (1 - torch.eye(M)))
                assert all(w(g).item() == pytest.approx(0.01) for g in ('alpha_pre', 'alpha_post', 'alpha_res'))
    plain = fidelity.make(scheme, hc_out_init_scale=False)  # same draws without the scaling
    for b in range(fidelity.L):
        for n in ('attention.w_out.weight', 'feed_forward.w2.weight'):
            torch.testing.assert_close(W[f'blocks.{b}.{n}'], study_weights(plain)[f'blocks.{b}.{n}'] / math.sqrt(M),
                                       rtol=0, atol=0)
    # the earlier study code's +8 diagonal stays an option
    old = study_weights(fidelity.make('mhc', mhc_init='gap8_diag8'))['blocks.0.attention_hyper_connection.b'][2 * M:]
    assert torch.equal(old.view(M, M), 8.0 * torch.eye(M) - 8.0 * (1 - torch.eye(M)))


@torch.no_grad()
def test_plain_mhc_sinkhorn_is_the_pytorch_backend_s():
    """mhc_sinkhorn='plain' is the study's PyTorch mHC backend: sinkhorn_log (per-input sums
    first, per-output last, no eps) on H_res stored (in, out), as ours."""
    model, idx = fidelity.make('mhc', mhc_sinkhorn='plain'), fidelity.tokens()
    for step in range(2):
        if step:
            fidelity.randomise(model)
        ours, theirs = model(idx)[0], study_logits(model, idx, mhc_backend='plain')
        assert (ours - theirs).abs().max().item() <= TOL
    assert (ours - study_logits(model, idx)).abs().max().item() > 1e-4   # and it is not Liger's


@torch.no_grad()
def test_mhc_h_res_is_liger_kernel_s_on_wide_logits():
    """H_res itself against liger_kernel's Sinkhorn (order and the 1e-6 on entries and
    denominators), with routing parameters wide enough (spread of the logits ~10) that the
    eps floor and the order both change H_res by more than 1e-3."""
    model = fidelity.make('mhc')
    g = torch.Generator().manual_seed(3)
    for n, p in model.residual.named_parameters():
        if '_route.' in n:
            p.copy_(torch.randn(p.shape, generator=g) * 3.0)
    H = torch.randn(2, 5, M, D, generator=g)
    W = study_weights(model)
    for b in range(fidelity.L):
        for side, conn in (('attn', 'attention_hyper_connection'), ('mlp', 'feed_forward_hyper_connection')):
            _, ours, _ = model.residual.coefficients(H, getattr(model.residual.layers[b], f'{side}_route'))  # (B, T, in, out)
            w = lambda n: W[f'blocks.{b}.{conn}.{n}']  # noqa: E731
            flat = H.reshape(2, 5, -1)
            mix = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6) @ w('phi')
            z = (mix[..., 2 * M:] * w('alpha_res') + w('b')[2 * M:]).view(2, 5, M, M)  # (out, in)
            want = Study.liger_sinkhorn(z).transpose(-1, -2)
            assert (ours - want).abs().max().item() <= 1e-5  # fp32 rounding of logits of size ~30
            no_eps = sinkhorn(z.transpose(-1, -2), 20, 'liger', eps=0.0)  # Liger's order, no eps
            assert (ours - no_eps).abs().max().item() > 1e-3
            assert (ours - Study.sinkhorn_log(z.transpose(-1, -2))).abs().max().item() > 1e-3


# -----------------------------------------------------------------------------
# bad input: one clear error

def test_sinkhorn_rejects_bad_input():
    for iters in (0, 2.5, True, torch.tensor(3)):
        with pytest.raises(ValueError, match='rounds'):
            sinkhorn(torch.zeros(4, 4), iters)
    with pytest.raises(ValueError, match='order'):
        sinkhorn(torch.zeros(4, 4), 3, 'sinkhorn_log')
    with pytest.raises(ValueError, match='eps'):
        sinkhorn(torch.zeros(4, 4), 3, 'liger', -1e-6)


@pytest.mark.parametrize('iters', [0, 2.5, 2.0, True])
def test_mhc_rejects_bad_sinkhorn_iters(iters):
    """A bad mhc_sinkhorn_iters is a ValueError when the model is built (2.5 used to fail
    with a TypeError deep in the first forward; True ran one round)."""
    with pytest.raises(ValueError, match='mhc_sinkhorn_iters must be an int >= 1'):
        make('mhc', n_layer=1, n_embd=32, mhc_sinkhorn_iters=iters)
