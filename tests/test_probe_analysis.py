"""
Tests of probes/analysis.py (Jacobian deviation, usefulness, token collapse, LM pruning) on
tiny random models, against cases whose answer is known by hand and against brute force.
Run: python -m pytest tests/test_probe_analysis.py -q
"""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint  # noqa: E402
import probe  # noqa: E402
from probes import analysis as pa  # noqa: E402
import residuals  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from small_models import move_off_init, small_model, small_tokens  # noqa: E402
import test_probe  # noqa: E402  (the tiny-model helpers the probe tests share)
from test_probe import V, T, randomize_scheme, windows, zero_blocks  # noqa: E402,F401

SCHEMES = ['preln', 'sandwich', 'lns', 'deepnorm', 'keel', 'hc', 'mhc', 'attnres', 'blockattnres', 'moda']


def tiny(residual='preln', n_layer=3, seed=0, **kw):
    return test_probe.tiny(residual, n_layer=n_layer, seed=seed, **kw)


class LinearScheme(residuals.Residual):
    """A test scheme whose block b is the affine map h -> h A_b + c_b (the backbone unused)."""

    def __init__(self, cfg, seed=0):
        super().__init__(cfg)
        g = torch.Generator().manual_seed(seed)
        d = cfg.n_embd
        self.A = torch.eye(d) + 0.3 * torch.randn(cfg.n_layer, d, d, generator=g) / math.sqrt(d)
        self.c = 0.1 * torch.randn(cfg.n_layer, d, generator=g)

    def block(self, h, b, layer, rope):
        return h @ self.A[b] + self.c[b]


def with_scheme(model, scheme):
    model.residual = scheme
    return model

# -----------------------------------------------------------------------------
# the depth-state slot


@pytest.mark.parametrize('scheme', SCHEMES)
def test_set_probe_round_trip_every_scheme(scheme):
    model = randomize_scheme(tiny(scheme))
    res = model.residual
    states = probe.clean_states(model, windows(2))
    for st in states:
        z = torch.randn_like(probe.flat(res.probe(st)))
        assert torch.equal(probe.flat(res.probe(pa.set_probe(res, st, z))), z)


def test_residual_without_slot_is_refused():
    model = tiny('resdual')
    with pytest.raises(ValueError, match='computes its depth state'):
        pa.jacobian_deviation(model, windows(1))

# -----------------------------------------------------------------------------
# Jacobian deviation


def _brute_mean_jacobian(model, idx, b):
    """(1/N) sum_p sum_q dz_{b+1,q}/dz_{b,p} by torch.autograd.functional.jacobian of the whole
    (B, T, D) -> (B, T, D) map."""
    res = model.residual
    st = probe.clean_states(model, idx)[b]
    z0 = probe.flat(res.probe(st)).detach()
    rope = (model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)])
    f = lambda z: probe.flat(res.probe(res.block(pa.set_probe(res, st, z), b, model.blocks[b], rope)))
    J = torch.autograd.functional.jacobian(f, z0)  # (B, T, D, B, T, D)
    B, Tn, D = z0.shape
    return J.reshape(B * Tn, D, B * Tn, D).sum((0, 2)).double() / (B * Tn)  # (D_out, D_in)


@pytest.mark.parametrize('scheme', ['preln', 'hc', 'attnres'])
def test_jacobian_exact_matches_brute_force(scheme):
    model = randomize_scheme(tiny(scheme, n_layer=2))
    w = windows(2, t=6)
    r = pa.jacobian_deviation(model, w, batch_size=1, n_probes=0)
    for b in range(2):
        M = _brute_mean_jacobian(model, w, b)
        want = torch.linalg.matrix_norm(M - torch.eye(len(M), dtype=M.dtype)).item() / math.sqrt(len(M))
        assert r['deviation'][b] == pytest.approx(want, rel=1e-5)
    assert r['exact'] and r['se'] == [0.0, 0.0]


def test_jacobian_identity_block_is_zero_and_linear_block_exact():
    model = zero_blocks(tiny('preln'), [1])  # block 1 is the identity
    r = pa.jacobian_deviation(model, windows(2), n_probes=8)
    assert r['deviation'][1] == pytest.approx(0.0, abs=1e-6) and r['se'][1] == pytest.approx(0.0, abs=1e-6)
    assert r['deviation'][0] > 0.01
    # a linear block h -> h A + c has J = A^T at every token: ||A - I||_F / sqrt(d) exactly
    lin = with_scheme(tiny('preln'), LinearScheme(tiny('preln').config))
    r = pa.jacobian_deviation(lin, windows(2), n_probes=0)
    for b in range(3):
        want = torch.linalg.matrix_norm(lin.residual.A[b] - torch.eye(16)).item() / 4.0
        assert r['deviation'][b] == pytest.approx(want, rel=1e-5)


def test_jacobian_random_probes_estimate_within_their_error():
    model = randomize_scheme(tiny('hc'))
    w = windows(2)
    exact = pa.jacobian_deviation(model, w, n_probes=0)['deviation']
    est = pa.jacobian_deviation(model, w, n_probes=64, seed=3)
    for b in range(3):
        assert abs(est['deviation'][b] - exact[b]) < 4 * est['se'][b] + 1e-9
        assert 0 < est['se'][b] < 0.2 * exact[b]
    assert est['dim'] == 4 * 16  # HC: m * d

def exact_jacobians(model, idx):
    """J_l = d mean_q(z_{l+1, q}) / d u for z_l + u at every position (D x D), by autograd."""
    Z, T = [], idx.size(1)
    rec = []
    with torch.no_grad():
        model.hidden(idx, record=rec)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    for b in range(model.config.n_layer):
        z = rec[b][0].detach()
        Z.append(torch.autograd.functional.jacobian(
            lambda u: model.residual.block(z + u, b, model.blocks[b], rope).mean((0, 1)), torch.zeros(z.size(-1))))
    return [J.double() for J in Z]


def test_jacobian_deviation_and_its_standard_error_from_the_exact_jacobian(monkeypatch):
    """Exact mode: ||J - I||_F / sqrt(D) with s.e. 0. Probe mode: the probes the estimator drew
    (read at torch.autograd.grad) and the exact J give r_k = ||(J^T - I) v_k||^2; the deviation is
    sqrt(mean r / D), its s.e. std(r, n-1) / sqrt(k) / (2 sqrt(D mean r)) (delta method)."""
    model = move_off_init(small_model('preln', L=2, d=8))
    idx = small_tokens(B=2, T=6)
    Js = exact_jacobians(model, idx)
    D = Js[0].size(0)
    r = pa.jacobian_deviation(model, idx, n_probes=0)
    want = [((J - torch.eye(D, dtype=torch.float64)).norm() / math.sqrt(D)).item() for J in Js]
    assert r['exact'] and r['se'] == [0.0, 0.0] and r['deviation'] == pytest.approx(want, rel=1e-4)
    seen, grad = [], torch.autograd.grad

    def spy(out, inp, v, **kw):
        seen.append(v[0, 0].detach().double().clone())
        return grad(out, inp, v, **kw)
    monkeypatch.setattr(torch.autograd, 'grad', spy)
    K = 5
    r = pa.jacobian_deviation(model, idx, batch_size=4, n_probes=K, seed=3)
    monkeypatch.undo()
    assert len(seen) == 2 * K  # one batch: block 0's K probes, then block 1's
    for b, J in enumerate(Js):
        V = torch.stack(seen[b * K:(b + 1) * K])  # (K, D) of +-1
        assert set(V.abs().flatten().tolist()) == {1.0}
        rk = ((V @ J - V) ** 2).sum(-1)  # (J^T - I) v = J^T v - v; rows of V @ J are (J^T v)^T
        F2 = rk.mean()
        assert r['deviation'][b] == pytest.approx(math.sqrt(F2 / D), rel=1e-4)
        se = (rk.std(correction=1) / math.sqrt(K) / (2 * math.sqrt(F2 * D))).item()
        assert r['se'][b] == pytest.approx(se, rel=1e-3), b


def test_jacobian_standard_error_matches_the_spread_over_seeds():
    """The s.e. is what it claims: over 60 probe seeds the deviation estimates scatter by about
    the mean reported s.e. (4 probes each), and centre on the exact value."""
    model = move_off_init(small_model('preln', L=1, d=8))
    idx = small_tokens(B=1, T=6)
    exact = pa.jacobian_deviation(model, idx, n_probes=0)['deviation'][0]
    runs = [pa.jacobian_deviation(model, idx, n_probes=4, seed=s) for s in range(60)]
    dev = np.array([x['deviation'][0] for x in runs])
    se = np.mean([x['se'][0] for x in runs])
    assert 0.6 < dev.std(ddof=1) / se < 1.6, (dev.std(ddof=1), se)
    assert abs(dev.mean() - exact) < 3 * dev.std(ddof=1) / math.sqrt(len(dev)) + 0.02 * exact


# -----------------------------------------------------------------------------
# usefulness


def test_usefulness_linear_blocks_give_ratio_one():
    lin = with_scheme(tiny('preln'), LinearScheme(tiny('preln').config))
    r = pa.usefulness(lin, windows(4))
    assert r['loss_ratio'] == pytest.approx([1.0] * 3, abs=1e-5)
    assert r['score'] == 0 and r['fit_r2'] == pytest.approx([1.0] * 3, abs=1e-6)


def test_usefulness_counts_blocks_above_threshold():
    model = randomize_scheme(tiny('attnres'))
    r = pa.usefulness(model, windows(4), threshold=0.0)
    ratios = np.array(r['loss_ratio'])
    assert r['significant'] == [bool(x > 1.0) for x in ratios]
    assert r['linear_loss'] == pytest.approx(list(ratios * r['loss']))
    r2 = pa.usefulness(model, windows(4), threshold=10.0)
    assert r2['n_significant'] == 0 and r2['loss_ratio'] == pytest.approx(r['loss_ratio'])
    # the clean loss is the model's own
    _, loss = model(windows(4)[:, :-1], windows(4)[:, 1:])
    assert r['loss'] == pytest.approx(loss.item(), rel=1e-5)


def test_usefulness_replacement_of_identity_block_is_exact():
    model = zero_blocks(tiny('preln'), [0])
    r = pa.usefulness(model, windows(4))
    assert r['loss_ratio'][0] == pytest.approx(1.0, abs=1e-5)

def states_of(model, idx):
    rec = []
    with torch.no_grad():
        model.hidden(idx, record=rec)
    return [z.flatten(0, 1).double() for z, _ in rec]  # L+1 of (N, D)


@torch.no_grad()
def test_usefulness_fit_and_loss_equal_a_centred_least_squares_by_hand():
    """Embeddings of mean zero over the windows' tokens and branches 5x their init scale, so that
    block 0's output has a mean its input lacks: an affine fit and a linear one differ. R^2
    (1 - SS_res / SS_tot about the mean) and the loss with block b replaced by the fit equal a
    fit on centred states, b = mean(Y) - mean(X) W, continued through the later blocks by hand."""
    model = small_model('preln', L=3)
    idx = small_tokens(B=3, T=12)
    model.wte.weight.sub_(model.wte(idx).mean((0, 1)))
    for blk in model.blocks:
        blk.attn.wo.weight.mul_(5)
        blk.mlp.w_down.weight.mul_(5)
    r = pa.usefulness(model, idx, batch_size=2)
    Z, (B, T), L = states_of(model, idx), idx.shape, 3
    rope = (model.rope_cos[:T], model.rope_sin[:T])

    def loss(h):
        return F.cross_entropy(model.head(h)[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten()).item()
    assert r['loss'] == pytest.approx(loss(model.hidden(idx)), rel=1e-5)
    for b in range(L):
        X, Y = Z[b], Z[b + 1]
        Xm, Ym = X.mean(0), Y.mean(0)
        W = torch.linalg.lstsq(X - Xm, Y - Ym, driver='gelsd').solution
        pred = (X - Xm) @ W + Ym
        r2 = 1 - ((pred - Y) ** 2).sum() / ((Y - Ym) ** 2).sum()
        assert r['fit_r2'][b] == pytest.approx(r2.item(), rel=1e-6, abs=1e-9), b
        h = pred.float().view(B, T, -1)
        for k in range(b + 1, L):
            h = model.residual.block(h, k, model.blocks[k], rope)
        assert r['linear_loss'][b] == pytest.approx(loss(h), rel=1e-5), b
        assert r['loss_ratio'][b] == pytest.approx(r['linear_loss'][b] / r['loss'], rel=1e-9)


# -----------------------------------------------------------------------------
# token collapse


def test_sval_metrics_hand_cases():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(20, 20, generator=g, dtype=torch.float64))
    # k equal singular values: stable rank = erank = k, L1/L2 = sqrt(k)
    Q8, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    H = 3.0 * Q[:, :4] @ Q8[:, :4].T  # (20, 8), rank 4, singular values all 3
    m = pa.sval_metrics(H)
    for key, want in (('stable_rank', 4.0), ('erank', 4.0), ('l1_l2', 2.0)):
        assert m[key].item() == pytest.approx(want, rel=1e-9), key
    # rank one: 1
    u = torch.randn(20, 1, generator=g, dtype=torch.float64)
    m = pa.sval_metrics(u @ torch.randn(1, 8, generator=g, dtype=torch.float64))
    assert [m[k].item() for k in ('stable_rank', 'erank', 'l1_l2')] == pytest.approx([1, 1, 1])
    # singular values (2, 1): stable rank 5/4, erank = exp(H(4/5, 1/5)), L1/L2 = 3/sqrt(5)
    H = torch.diag(torch.tensor([2.0, 1.0], dtype=torch.float64))
    m = pa.sval_metrics(H)
    p = np.array([0.8, 0.2])
    assert m['stable_rank'].item() == pytest.approx(1.25)
    assert m['erank'].item() == pytest.approx(math.exp(-(p * np.log(p)).sum()))
    assert m['l1_l2'].item() == pytest.approx(3 / math.sqrt(5))
    # any rank-k matrix: stable rank, erank <= k, L1/L2 <= sqrt(k)
    for k in (1, 2, 5):
        H = torch.randn(30, k, generator=g, dtype=torch.float64) @ torch.randn(k, 12, generator=g, dtype=torch.float64)
        m = pa.sval_metrics(H)
        assert m['stable_rank'].item() <= k + 1e-9 and m['erank'].item() <= k + 1e-9
        assert m['l1_l2'].item() <= math.sqrt(k) + 1e-9
    assert pa.sval_metrics(torch.zeros(5, 3))['erank'].item() == 1.0


def test_token_collapse_matches_per_window_svd():
    model = randomize_scheme(tiny('hc'))
    w = windows(3)
    r = pa.token_collapse(model, w, batch_size=2)
    rec = []
    model.hidden(w, record=rec)
    for l, (z, _) in enumerate(rec):
        Z = probe.flat(z)
        want = np.mean([pa.sval_metrics(Z[i])['erank'].item() for i in range(3)])
        assert r['erank'][l] == pytest.approx(want)
    assert r['max_rank'] == min(T, 4 * 16) and len(r['stable_rank']) == 4
    # z_0 of HC is m copies of the embedding: the same spectrum as the embedding, times sqrt(m)
    emb = model.wte(w)
    assert r['erank'][0] == pytest.approx(np.mean([pa.sval_metrics(emb[i])['erank'].item() for i in range(3)]))

# -----------------------------------------------------------------------------
# LM pruning


def test_prune_lm_matches_skipped_forward():
    model = randomize_scheme(tiny('attnres'))
    w = windows(4)
    r = pa.prune_lm(model, w, batch_size=3)
    _, loss = model(w[:, :-1], w[:, 1:])
    assert r['loss'] == pytest.approx(loss.item(), rel=1e-5)
    for b in range(3):
        logits, _ = model(w, skip=(b,))
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), w[:, 1:].reshape(-1)).item()
        assert r['loss_skip'][b] == pytest.approx(ce, rel=1e-5)
        assert r['delta'][b] == pytest.approx(ce - loss.item(), abs=1e-5)
    zero = pa.prune_lm(zero_blocks(tiny('preln'), [2]), w)
    assert zero['delta'][2] == pytest.approx(0.0, abs=1e-6) and zero['se'][2] == pytest.approx(0.0, abs=1e-6)

def test_prune_lm_error_bar_is_the_paired_standard_error_over_windows():
    """5 windows, each scored alone by a plain forward with and without block b: the s.e. of
    the loss increase is the sample s.e. (n - 1) of the per-window increases, the window being
    the unit (not the token, and not the unpaired s.e. of the two losses)."""
    model = randomize_scheme(tiny('preln', n_layer=3))
    with torch.no_grad():  # larger weights: skipping a block changes the loss by different amounts
        for p in model.parameters():
            p.mul_(3)
    w = windows(5)
    r = pa.prune_lm(model, w, batch_size=2)
    assert r['n_windows'] == 5 and r['n_tokens'] == 5 * (T - 1)

    def window_losses(skip):
        with torch.no_grad():
            logits, _ = model(w, skip=skip)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), w[:, 1:], reduction='none')
        return ce.mean(1).double().numpy()                          # (5,) mean CE of each window

    clean = window_losses(())
    gaps = []
    for b in range(3):
        skipped = window_losses((b,))
        d = skipped - clean
        se = math.sqrt(((d - d.mean()) ** 2).sum() / 4 / 5)
        assert se > 0.01 and r['se'][b] == pytest.approx(se, rel=1e-4), b
        assert r['delta'][b] == pytest.approx(d.mean(), rel=1e-4, abs=1e-6)
        unpaired = math.sqrt((skipped.var(ddof=1) + clean.var(ddof=1)) / 5)
        gaps.append(abs(unpaired - se) / se)
    assert max(gaps) > 0.5  # the pairing matters here


# -----------------------------------------------------------------------------
# through probe.py's interface


def test_registered_in_probe_metrics(tmp_path):
    data = np.random.default_rng(0).integers(0, V, 4000).astype(np.uint16)
    (tmp_path / 'val.bin').write_bytes(data.tobytes())
    model = tiny('hc')
    ckpt = tmp_path / 'run' / 'ckpt.pt'
    ckpt.parent.mkdir()
    checkpoint.save_checkpoint(str(ckpt), {'model': model.state_dict(), 'model_args': model.config.__dict__,
                                           'config': {}, 'iter_num': 1})
    out = probe.main([f'--ckpt={ckpt}', f'--val_bin={tmp_path / "val.bin"}', '--metrics=jacobian,usefulness,'
                      'token_collapse,prune_lm,logit_lens', '--n_windows=2', '--seq_len=8', '--jacobian_probes=4'])
    for m, fig in (('jacobian', 'jacobian'), ('usefulness', 'usefulness'), ('token_collapse', 'token_collapse'),
                   ('prune_lm', 'prune')):
        assert m in out and (ckpt.parent / 'probe' / f'{fig}.png').exists(), m
    assert out['jacobian']['n_probes'] == 4 and len(out['usefulness']['loss_ratio']) == 3
    saved = probe.load_results(ckpt.parent / 'probe' / 'probe.json')
    assert saved['token_collapse']['erank'] == pytest.approx(out['token_collapse']['erank'])

# -----------------------------------------------------------------------------
# figures


def test_figures_scales_and_labels():
    from probes import plots as pp
    L = 4
    late = {'R_causal': 0.0, 'R_perm': 0.0, 'causal_threshold': 0.45, 'perm_threshold': 0.15, 'start': 1,
            'n_pairs': 6}
    C = np.full((L, L), np.nan)
    C[np.triu_indices(L, 1)] = 0.2
    C_big = C.copy()
    C_big[1, 2] = 7.0  # an AttnRes-like C(s, s+1) far above the cap
    one = pp.plot_causal([{'label': 'a', 'causal': {'C': C}, 'late_pairs': late}])
    two = pp.plot_causal([{'label': 'a', 'causal': {'C': C}, 'late_pairs': late},
                          {'label': 'b', 'causal': {'C': C_big}, 'late_pairs': late}])
    ims = [im for f in (one, two) for ax in f.axes for im in ax.get_images()]
    # the data's whole range, shared by the panels side by side; the threshold at the middle colour
    assert [im.get_clim()[1] for im in ims] == [pytest.approx(1.01 * 0.45), 7.0, 7.0]
    assert all(im.norm.vcenter == 0.45 and im.get_clim()[0] == 0 for im in ims)
    n = ims[-1].norm
    assert n(7.0) == 1.0 and n(0.45) == 0.5 and n(0.2) < 0.5  # 7 is not clipped to a cap
    titles = [ax.get_title() for ax in two.axes if ax.get_images()]
    assert 'max 7.00' in titles[1]
    bars = [ax for ax in two.axes if not ax.get_images()]
    assert all(ax.get_ylabel() for ax in bars)  # every colour bar says what it shows
    assert any('late pairs' in t.get_text() for ax in two.axes if ax.get_legend() for t in ax.get_legend().get_texts())
    # R bars all zero: the axis starts at 0
    fig = pp.plot_late_pairs([{'label': 'a', 'late_pairs': late}])
    assert fig.axes[0].get_ylim()[0] == 0
    # HC path weights: the readout row (m = 4 times a sublayer's scale) gets its own colour scale
    W = np.tril(np.full((2 * L + 1, 2 * L + 1), 1.0))
    W[np.triu_indices(2 * L + 1, 1)] = np.nan
    W[-1, :] = 4.0
    fig = pp.plot_path_weights([{'label': 'hc', 'path_weights': {'W': W, 'kind': 'hc'}}])
    ims = [ax.get_images()[0] for ax in fig.axes if ax.get_images()]
    assert ims[0].get_array().shape == (2 * L, 2 * L + 1) and ims[0].get_clim()[1] < 2
    assert ims[1].get_array().shape == (1, 2 * L + 1) and ims[1].get_clim()[1] > 3
    # Pre-LN: a fixed 0..1 scale, not 1..2
    U = np.tril(np.ones((2 * L + 1, 2 * L + 1)))
    fig = pp.plot_path_weights([{'label': 'p', 'path_weights': {'W': U, 'kind': 'unit'}}])
    assert [ax.get_images()[0].get_clim() for ax in fig.axes if ax.get_images()] == [(0.0, 1.0)] * 2
    # angular: no empty column for the last state
    S = np.full((L, L + 1), np.nan)
    for n in range(1, L + 1):
        S[n - 1, :L + 1 - n] = 0.1 * n
    fig = pp.plot_angular([{'label': 'a', 'angular': {'subsequent': S}}])
    assert fig.axes[0].get_images()[0].get_array().shape == (L, L)
    # LogitLens: every panel has a legend; byte models are labelled per byte
    ll = {'kl': [1, 0.5, 0], 'ce': [3, 2, 1.5], 'top5': [0.2, 0.6, 1]}
    fig = pp.plot_logit_lens([{'label': 'a', 'logit_lens': ll, 'tokenizer': 'byte'}])
    assert all(ax.get_legend() is not None for ax in fig.axes) and 'byte' in fig.axes[1].get_ylabel()
    # pruning: error bars on both panels
    blocks = [{'block': b, 'acc_norm': 0.3, 'delta_acc_norm': 0.01 * b, 'se_delta_acc_norm': 0.02} for b in range(L)]
    r = {'label': 'a', 'prune': {'blocks': blocks, 'baseline': {'acc_norm': 0.3}, 'n': 500},
         'prune_lm': {'loss': 2.0, 'delta': [0.1] * L, 'se': [0.01] * L, 'n_windows': 16}}
    fig = pp.plot_prune([r])
    assert len(fig.axes) == 2 and all(ax.containers for ax in fig.axes)


@pytest.mark.parametrize('scheme', SCHEMES)
def test_every_analysis_runs_for_every_scheme(scheme):
    model = randomize_scheme(tiny(scheme, n_layer=2))
    w = windows(2, t=8)
    j = pa.jacobian_deviation(model, w, n_probes=2)
    u = pa.usefulness(model, w)
    t = pa.token_collapse(model, w)
    p = pa.prune_lm(model, w)
    assert len(j['deviation']) == len(u['loss_ratio']) == len(p['delta']) == 2 and len(t['erank']) == 3
    assert all(np.isfinite(j['deviation'])) and all(np.isfinite(u['loss_ratio'])) and all(x > 0 for x in t['erank'])
