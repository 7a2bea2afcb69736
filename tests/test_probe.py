"""
Tests of probe.py (the diagnostics of the paper's Sec. 4; docs/probes.md) on tiny random models built here.
Also where it would be silently wrong: path weights of a scheme that does not say what its
adds weigh (refused, never drawn as ones), the tokenizer a run is labelled with, and late-pair
ratios over scores that are not finite.
Run: python -m pytest tests/test_probe.py -q
"""

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint  # noqa: E402
import probe  # noqa: E402
import residuals  # noqa: E402
from model import GPT, GPTConfig, RMSNorm  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402

V, T = 64, 12


def tiny(residual='preln', n_layer=4, vocab_size=V, seed=0, block_size=32, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=16,
                    residual=residual, **kw)
    return GPT(cfg).eval()


def randomize_scheme(model, seed=1):
    """Non-trivial scheme parameters (zero-initialised AttnRes queries give uniform weights)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


def zero_blocks(model, blocks=None):
    """Blocks that add nothing: zero attention output and MLP down projections."""
    with torch.no_grad():
        for b in range(model.config.n_layer) if blocks is None else blocks:
            model.blocks[b].attn.wo.weight.zero_()
            model.blocks[b].mlp.w_down.weight.zero_()
    return model


def windows(n=3, t=T, vocab=V, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------
# a toy hyper-connection scheme with static random routing, recorded like HC/mHC

class ToyHC(residuals.Residual):
    """m streams; sublayer k reads x = sum_s a_k[s] H[s], writes H'[t] = sum_s A_k[s, t] H[s] + beta_k[t] f.
    Static coefficients, so per-token path weights equal their mean. Keeps (x, f) when `seen` is a list."""
    m = 3

    def __init__(self, cfg):
        super().__init__(cfg)
        K, m, g = 2 * cfg.n_layer, self.m, torch.Generator().manual_seed(3)
        self.register_buffer('a', torch.rand(K, m, generator=g))
        self.register_buffer('A', torch.rand(K, m, m, generator=g) * 0.6 + 0.2 * torch.eye(m))
        self.register_buffer('beta', torch.rand(K, m, generator=g) + 0.5)
        self.norms = torch.nn.ModuleList([RMSNorm(cfg.n_embd) for _ in range(K)])
        self.seen = None

    def begin(self, x):
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.m, x.size(-1))  # (B, T, m, d)

    def block(self, H, b, layer, rope):
        B, T_ = H.shape[:2]
        for j, f in ((0, lambda x: layer.attn(x, rope)), (1, layer.mlp)):
            k = 2 * b + j
            x = torch.einsum('s,btsd->btd', self.a[k], H)
            out = f(self.norms[k](x))
            H = torch.einsum('st,bnsd->bntd', self.A[k], H) + self.beta[k][:, None] * out.unsqueeze(-2)
            self.record(b, j, read=self.a[k].expand(B, T_, -1), mix=self.A[k].expand(B, T_, -1, -1),
                        write=self.beta[k].expand(B, T_, -1))
            if self.seen is not None:
                self.seen.append((x, out))
        return H

    def end(self, H):
        return H.sum(-2)

    def probe(self, H):
        return H.flatten(-2)

    def lens(self, H):
        return H.sum(-2)


@pytest.fixture
def toyhc(monkeypatch):
    monkeypatch.setitem(residuals.RESIDUALS, 'toyhc', ToyHC)
    return tiny('toyhc', n_layer=2)


ALL_SCHEMES = sorted(residuals.RESIDUALS)

# -----------------------------------------------------------------------------
# pure math

def test_angular_distance_of_parallel_orthogonal_opposite_vectors():
    a = torch.tensor([[1.0, 2.0, -3.0]])
    b_orth = torch.tensor([[3.0, 0.0, 1.0]])
    d = [probe.angular_distance_tokens(a, b).item() for b in (2.5 * a, b_orth, -0.5 * a)]
    assert d == pytest.approx([0.0, 0.5, 1.0], abs=1e-3)


def test_effective_rank_of_identity_and_rank_one():
    for m in (2, 4, 7):
        assert probe.effective_rank(torch.eye(m)).item() == pytest.approx(m, rel=1e-9)
    u, v = torch.randn(5, 1), torch.randn(1, 5)
    assert probe.effective_rank(u @ v).item() == pytest.approx(1.0, abs=1e-6)
    # two equal singular values and one zero -> erank 2
    assert probe.effective_rank(torch.diag(torch.tensor([3.0, 3.0, 0.0]))).item() == pytest.approx(2.0)


def test_uniform_mixing_powers_and_their_erank_fall_towards_one():
    m, eps = 4, 0.3
    U, I = torch.full((m, m), 1.0 / m, dtype=torch.float64), torch.eye(m, dtype=torch.float64)
    A = (1 - eps) * I + eps * U
    eranks = []
    for k in (1, 2, 5, 20, 80):
        Ak = torch.linalg.matrix_power(A, k)
        torch.testing.assert_close(Ak, U + (1 - eps) ** k * (I - U))
        eranks.append(probe.effective_rank(Ak).item())
    assert all(x > y for x, y in zip(eranks, eranks[1:]))
    assert eranks[0] < m and eranks[-1] == pytest.approx(1.0, abs=1e-6)
    assert probe.mean_abs_cosine(torch.linalg.matrix_power(A, 80)).item() == pytest.approx(1.0, abs=1e-9)


def test_mean_abs_cosine_and_spectrum_on_known_matrices():
    assert probe.mean_abs_cosine(torch.eye(3)).item() == pytest.approx(0.0)
    M = torch.tensor([[1.0, 1.0], [0.0, 1.0]])  # columns (1, 0) and (1, 1)
    assert probe.mean_abs_cosine(M).item() == pytest.approx(1 / math.sqrt(2))
    assert probe.mean_abs_cosine(torch.tensor([[1.0, -2.0], [1.0, -2.0]])).item() == pytest.approx(1.0)
    s = probe.normalized_spectrum(torch.diag(torch.tensor([1.0, 4.0, 2.0])))
    assert s.tolist() == pytest.approx([1.0, 0.5, 0.25])


def test_bootstrap_interval_brackets_the_mean_and_shrinks_with_more_units():
    rng = np.random.default_rng(0)
    small, big = rng.normal(size=10), rng.normal(size=1000)
    for x in (small, big):
        mean, lo, hi = probe.bootstrap_ci(x, n_boot=500)
        assert lo < mean < hi and mean == pytest.approx(x.mean())
    assert np.ptp(probe.bootstrap_ci(big, 500)[1:]) < np.ptp(probe.bootstrap_ci(small, 500)[1:])


def test_bootstrap_interval_of_a_hand_worked_sample():
    """Units (0, 0, 3): a resample of 3 with replacement holds k ~ Binomial(3, 1/3) threes, so
    its mean k takes 0, 1, 2, 3 with probabilities 8/27, 12/27, 6/27, 1/27 (cumulative 0.296,
    0.741, 0.963, 1). The 95% percentile interval is (0, 3) (0.963 < 0.975), the 90% one (0, 2)
    (0.741 < 0.95 < 0.963). Resampling 2 units would put 1/9 of the means at 3 (90%: (0, 3));
    one tail of 5% or 10% would put the 95% upper end at 2 or 1."""
    for seed in range(3):
        mean, lo, hi = probe.bootstrap_ci([0.0, 0.0, 3.0], n_boot=4000, seed=seed)
        assert (mean, lo, hi) == (1.0, 0.0, 3.0)
        assert probe.bootstrap_ci([0.0, 0.0, 3.0], n_boot=4000, seed=seed, level=0.90) == (1.0, 0.0, 2.0)
    # rows are the units: a column that is another plus 5 is resampled with it, its ends shift by 5
    x = np.random.default_rng(0).normal(size=(12, 1))
    mean, lo, hi = probe.bootstrap_ci(np.concatenate([x, x + 5.0], 1), n_boot=300, seed=1)
    assert mean[1] - mean[0] == pytest.approx(5.0) and hi[1] - hi[0] == pytest.approx(5.0)
    assert lo[1] - lo[0] == pytest.approx(5.0) and hi[0] - lo[0] > 0.3
    # the seed fixes the resamples: the same seed, the same interval; another, another
    same, other = (probe.bootstrap_ci(x[:, 0], n_boot=300, seed=k)[1] for k in (1, 2))
    assert same == pytest.approx(lo[0], rel=1e-12) and abs(other - same) > 1e-3


def test_paired_standard_error_of_unequal_differences():
    """a - b = (1, 0, 0, 1, -1): mean 0.2, squared deviations 0.64 + 0.04 + 0.04 + 0.64 + 1.44
    = 2.8, sample variance 2.8 / 4 = 0.7, s.e. sqrt(0.7 / 5) = 0.3742 (with n in the variance:
    0.3347; unpaired, sqrt((0.3 + 0.3) / 5) = 0.3464)."""
    a, b = [1, 0, 1, 1, 0], [0, 0, 1, 0, 1]
    assert probe._paired_se(a, b) == pytest.approx(math.sqrt(0.14), rel=1e-12)
    assert probe._paired_se([2.0, 5.0], [1.0, 1.0]) == pytest.approx(1.5)  # d = (1, 4): s = 3 / sqrt(2)
    assert probe._paired_se([3.0, 4.0, 9.0], [2.0, 3.0, 8.0]) == 0.0       # equal differences
    assert math.isnan(probe._paired_se([1.0], [0.0]))


def test_late_pair_set_size_and_ratios():
    pairs = probe.late_pairs(32)
    assert len(pairs) == 276 and min(s for s, _ in pairs) == 8 and max(s for s, _ in pairs) == 30
    assert all(l > s and l <= 31 for s, l in pairs)
    assert len(probe.late_pairs(16)) == sum(15 - s for s in range(4, 15))
    L = 8  # s >= 2: 15 pairs
    C, P = np.zeros((L, L)), np.zeros((L, L))
    C[np.tril_indices(L)] = np.nan
    C[2, 3], C[5, 7], C[0, 1] = 0.46, 0.9, 0.9   # (0, 1) is not a late pair
    C[4, 6] = 0.45                               # not strictly greater
    P[3, 4] = 0.2
    r = probe.late_pair_ratio(C, P)
    assert r['n_pairs'] == 15 and r['n_causal'] == 2 and r['R_causal'] == pytest.approx(2 / 15)
    assert r['R_perm'] == pytest.approx(1 / 15)
    r = probe.late_pair_ratio(C, P, causal_threshold=0.3, start_frac=0.5)  # s >= 4: 6 pairs
    assert r['n_pairs'] == 6 and r['n_causal'] == 2


# -----------------------------------------------------------------------------
# interventions and geometry on tiny models

def test_blocks_that_add_nothing_give_zero_causal_permutation_and_distance():
    model = zero_blocks(tiny('preln'))
    w = windows()
    C = probe.causal_scores(model, w)['C']
    P = probe.permutation_scores(model, w)['P']
    A = probe.angular_distance(model, w)['matrix']
    assert np.isfinite(C).sum() == 6 and np.nanmax(np.abs(C)) < 1e-6
    assert np.isfinite(P).sum() == 6 and np.nanmax(P) < 1e-6
    assert np.nanmax(A) < 2e-3
    # ... whereas a working model gives non-zero scores
    model = tiny('preln')
    assert np.nanmin(probe.causal_scores(model, w)['C']) > 1e-3
    assert np.nanmax(probe.permutation_scores(model, w)['P']) > 0


def test_angular_matrix_layout_matches_direct_computation():
    model = tiny('attnres')
    randomize_scheme(model)
    w = windows()
    r = probe.angular_distance(model, w, batch_size=2)
    rec = []
    model.hidden(w, record=rec)
    z = [p.flatten(2) for p, _ in rec]
    L = 4
    for i, j in ((0, 1), (0, L), (1, 3)):
        assert r['matrix'][i, j] == pytest.approx(probe.angular_distance_tokens(z[i], z[j]).mean().item(), abs=1e-5)
        assert r['subsequent'][j - i - 1, i] == r['matrix'][i, j]
    assert np.isnan(r['matrix'][2, 1]) and np.isnan(r['subsequent'][L - 1, 1]) and r['n_tokens'] == w.numel()


@pytest.mark.parametrize('residual', ALL_SCHEMES)
def test_prefix_reuse_gives_the_same_scores_as_naive_reruns(residual):
    model = randomize_scheme(tiny(residual))
    w = windows(n=3)
    c1, c2 = probe.causal_scores(model, w, batch_size=2), probe.causal_scores(model, w, batch_size=2, reuse=False)
    np.testing.assert_allclose(c1['C'], c2['C'], rtol=1e-5, atol=1e-6)
    p1 = probe.permutation_scores(model, w, batch_size=2)
    p2 = probe.permutation_scores(model, w, batch_size=2, reuse=False)
    np.testing.assert_allclose(p1['loss_swap'], p2['loss_swap'], rtol=1e-5)
    np.testing.assert_allclose(p1['P'], p2['P'], rtol=1e-4, atol=1e-7)
    # the runner's record matches GPT.hidden's for a swap and a skip
    runner, order = probe.PrefixRunner(model), probe.swap_order(4, 1, 3)
    rec_a, rec_b = [], []
    ha = runner.hidden(w, order=order, skip={2}, record=rec_a)
    hb = model.hidden(w, order=order, skip={2}, record=rec_b)
    torch.testing.assert_close(ha, hb)
    assert len(rec_a) == len(rec_b) == 5
    for (pa, la), (pb, lb) in zip(rec_a, rec_b):
        torch.testing.assert_close(pa, pb)
        torch.testing.assert_close(la, lb)


def test_permutation_loss_is_the_token_weighted_cross_entropy():
    """L and L_swap against a direct forward each (fp32 means: rel 1e-5); P against Eq. 4 from
    those two numbers (exact arithmetic on them). P is a difference of two nearly equal losses,
    so it is checked through its parts, not against a second noisy difference."""
    model = tiny('preln')
    w = windows(n=3)
    r = probe.permutation_scores(model, w, batch_size=2, pairs=[(1, 2)])
    _, loss = model(w[:, :-1], targets=w[:, 1:])
    assert r['loss'] == pytest.approx(loss.item(), rel=1e-5)
    _, loss_swap = model(w[:, :-1], targets=w[:, 1:], order=[0, 2, 1, 3])
    assert r['loss_swap'][1, 2] == pytest.approx(loss_swap.item(), rel=1e-5)
    assert r['P'][1, 2] == abs(r['loss_swap'][1, 2] - r['loss']) / r['loss']
    assert np.isfinite(r['P']).sum() == 1
    with pytest.raises(ValueError, match='0 <= i < j'):
        probe.permutation_scores(model, w, pairs=[(2, 1)])


def test_causal_score_is_a_mean_of_per_token_ratios():
    model = tiny('preln', n_layer=3)
    w = windows(n=2)
    C = probe.causal_scores(model, w)['C']
    z = [p.flatten(2) for p, _ in (lambda r: (model.hidden(w, record=r), r)[1])([])]
    zb = [p.flatten(2) for p, _ in (lambda r: (model.hidden(w, skip={0}, record=r), r)[1])([])]
    u, ub = z[2] - z[1], zb[2] - zb[1]
    expected = ((ub - u).norm(dim=-1) / u.norm(dim=-1)).mean().item()
    assert C[0, 1] == pytest.approx(expected, rel=1e-5)
    assert np.isnan(C[0, 0]) and np.isnan(C[2]).all()


@pytest.mark.parametrize('residual', ALL_SCHEMES)
def test_logit_lens_kl_vanishes_at_the_last_layer(residual):
    model = randomize_scheme(tiny(residual))
    r = probe.logit_lens(model, windows(), batch_size=2)
    assert len(r['kl']) == 5 and r['kl'][-1] == pytest.approx(0.0, abs=1e-6) and r['top5'][-1] == pytest.approx(1.0)
    assert min(r['kl'][:-1]) > 0
    _, loss = model(windows()[:, :-1], targets=windows()[:, 1:])
    assert r['ce'][-1] == pytest.approx(loss.item(), rel=1e-5)


# -----------------------------------------------------------------------------
# explicit path weights and propagation

def test_preln_path_weights_are_ones_below_the_diagonal():
    model = tiny('preln')
    W = probe.path_weights(model, windows())['W']
    assert W.shape == (9, 9) and probe.path_weights(model, windows())['kind'] == 'unit'
    assert (W[np.tril_indices(9)] == 1).all() and np.isnan(W[np.triu_indices(9, 1)]).all()


def test_attnres_path_weight_rows_sum_to_one_and_are_uniform_at_init():
    model = tiny('attnres')  # zero pseudo-queries: every read is the mean of its sources
    W = probe.path_weights(model, windows())['W']
    for ell in range(9):
        np.testing.assert_allclose(W[ell, :ell + 1], 1.0 / (ell + 1), rtol=1e-5)
    W = probe.path_weights(randomize_scheme(model), windows(), batch_size=2)['W']
    np.testing.assert_allclose(np.nansum(W, axis=1), 1.0, rtol=1e-5)
    assert np.nanstd(W[8]) > 1e-3 and np.isnan(W[np.triu_indices(9, 1)]).all()


def test_hc_path_weights_of_a_hand_built_trace_equal_the_formula():
    L, m, B, T_ = 2, 3, 2, 3
    g = torch.Generator().manual_seed(0)
    tape = [{'block': k // 2, 'sublayer': k % 2, 'read': torch.rand(B, T_, m, generator=g),
             'mix': torch.rand(B, T_, m, m, generator=g), 'write': torch.rand(B, T_, m, generator=g)}
            for k in range(2 * L)][::-1]  # any order: entries are sorted by (block, sublayer)
    W, n = probe.hc_path_weights(tape, L)
    tape = tape[::-1]
    assert n == B * T_
    for ell in range(2 * L + 1):
        for i in range(-1, ell):  # source i + 1; i = -1 is the embedding
            vals = []
            for b in range(B):
                for t in range(T_):
                    row = torch.ones(m) if i < 0 else tape[i]['write'][b, t]
                    for k in range(i + 1, ell):
                        row = row @ tape[k]['mix'][b, t]
                    read = tape[ell]['read'][b, t] if ell < 2 * L else torch.ones(m)
                    vals.append((row @ read).item())
            assert W[ell, i + 1] == pytest.approx(np.mean(vals), rel=1e-5)
    assert np.isnan(W[0, 1])


def test_hc_path_weights_reconstruct_the_branch_inputs(toyhc):
    w = windows(n=2)
    r = probe.path_weights(toyhc, w)
    assert r['kind'] == 'hc'
    W = r['W']
    toyhc.residual.seen = []
    with torch.no_grad():
        h = toyhc.hidden(w)
    seen, e = toyhc.residual.seen, toyhc.wte(w)
    for ell in range(5):  # x_l = w_{emb->l} e + sum_i w_{i->l} f_i
        x = h if ell == 4 else seen[ell][0]
        rebuilt = W[ell, 0] * e + sum(W[ell, i + 1] * seen[i][1] for i in range(ell))
        torch.testing.assert_close(rebuilt, x, rtol=1e-4, atol=1e-5)


def test_mhc_path_weights_rebuild_its_mean_readout():
    # mHC reads out the mean of its streams: the readout's row must rebuild mean_s H[s] from
    # the embedding and the branch outputs. At init (phi = 0) mHC's coefficients are the same
    # for every token, so token-averaged weights rebuild it exactly.
    model = tiny('mhc', n_layer=2).eval()
    assert model.residual.readout_mode == 'mean'
    w = windows(n=2)
    W = probe.path_weights(model, w)['W']
    outs = []
    for blk in model.blocks:
        for branch in (blk.attn, blk.mlp):
            branch.register_forward_hook(lambda mod, args, out: outs.append(out))
    with torch.no_grad():
        h = model.hidden(w)                                    # (B, T, m, d)
        rebuilt = W[4, 0] * model.wte(w) + sum(W[4, i + 1] * outs[i] for i in range(4))
    torch.testing.assert_close(rebuilt, h.mean(-2), rtol=1e-4, atol=1e-5)
    assert W[4, 0] == pytest.approx(1.0, abs=1e-3)             # the embedding, in every stream, averaged


def test_propagation_stats_use_the_product_in_forward_order(toyhc):
    with torch.no_grad():  # a shear then a squeeze: the order of the product matters
        toyhc.residual.A.copy_(torch.stack([torch.tensor([[1.0, 1, 0], [0, 1, 0], [0, 0, 1]]),
                                            torch.diag(torch.tensor([1.0, 0.1, 1.0])),
                                            torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0]]), torch.eye(3)]))
    A = toyhc.residual.A.double()
    P = A[0] @ A[1] @ A[2] @ A[3]
    P_rev = A[3] @ A[2] @ A[1] @ A[0]
    assert abs(probe.mean_abs_cosine(P).item() - probe.mean_abs_cosine(P_rev).item()) > 0.05
    r = probe.propagation_stats(toyhc, windows(n=4), batch_size=2, n_boot=100)
    assert r['m'] == 3 and r['n_docs'] == 4
    assert r['erank']['mean'] == pytest.approx(probe.effective_rank(P).item(), rel=1e-6)
    assert r['mean_abs_cos']['mean'] == pytest.approx(probe.mean_abs_cosine(P).item(), rel=1e-6)
    assert r['spectrum']['mean'] == pytest.approx(probe.normalized_spectrum(P).tolist(), rel=1e-6)
    with torch.no_grad():
        toyhc.residual.A.copy_(torch.eye(3).expand(4, 3, 3))
    r = probe.propagation_stats(toyhc, windows(n=4), n_boot=50)
    assert r['erank']['mean'] == pytest.approx(3.0) and r['mean_abs_cos']['mean'] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match='HC / mHC'):
        probe.propagation_stats(tiny('preln'), windows())


def test_propagation_stats_average_per_token_statistics_over_windows():
    """HC's mixing matrices depend on the token, so the mean of the per-token erank (1.2 here)
    is far from the erank of the mean product (1.7). Each statistic is computed per token from
    the product of the recorded mixing matrices, averaged per window, and the interval is the
    bootstrap over those window means (the window is the unit, not the token)."""
    model = randomize_scheme(tiny('hc'))
    w = windows(n=6)
    with torch.no_grad(), model.residual.trace() as tape:
        model.hidden(w)
    mixes = [e['mix'].double() for e in sorted(tape, key=lambda e: (e['block'], e['sublayer']))]
    assert len(mixes) == 8
    P = mixes[0]
    for A in mixes[1:]:
        P = P @ A                                                       # (B, T, m, m)
    s = torch.linalg.svdvals(P)
    p = s / s.sum(-1, keepdim=True)
    erank = torch.exp(-(p * p.log()).sum(-1))                          # (B, T)
    cols = P / P.norm(dim=-2, keepdim=True)
    G = (cols.transpose(-1, -2) @ cols).abs()
    cos = (G.sum((-1, -2)) - G.diagonal(dim1=-2, dim2=-1).sum(-1)) / (4 * 3)  # off-diagonal mean
    spec = s / s[..., :1]                                               # (B, T, m)
    assert erank.std() > 0.1 and abs(erank.mean() - probe.effective_rank(P.mean((0, 1)))) > 0.3
    r = probe.propagation_stats(model, w, batch_size=4, n_boot=200, seed=3)
    assert r['n_docs'] == 6 and r['m'] == 4 and r['unit'] == 'window'
    for key, per_token in (('erank', erank), ('mean_abs_cos', cos), ('spectrum', spec)):
        per_window = per_token.mean(1).numpy()                          # (B,) or (B, m)
        _, lo, hi = probe.bootstrap_ci(per_window, n_boot=200, seed=3)
        assert np.array(r[key]['mean']) == pytest.approx(per_window.mean(0), rel=1e-9), key
        assert np.array(r[key]['lo']) == pytest.approx(lo, rel=1e-9), key
        assert np.array(r[key]['hi']) == pytest.approx(hi, rel=1e-9), key
    assert r['erank']['hi'] - r['erank']['lo'] > 0.01


@pytest.mark.skipif('blockattnres' not in residuals.RESIDUALS, reason="Block AttnRes not registered")
def test_block_attnres_weights_are_uniform_at_init():
    # zero pseudo-queries: every read is the mean of its n sources (embedding, frozen blocks, partial sum)
    model = tiny('blockattnres', n_layer=4, attnres_blocks=2)  # 8 sublayers, blocks of 4
    r = probe.block_weights(model, windows())
    for ell, (c, e, ws) in enumerate(zip(r['current'], r['embedding'], r['weights'])):
        if ws:
            assert e == pytest.approx(1 / len(ws), rel=1e-5), ell
            assert np.isnan(c) or c == pytest.approx(1 / len(ws), rel=1e-5)
    assert 4 in r['boundaries'] and not np.isnan(r['current'][5])  # the partial sum restarts after a boundary
    W = probe.path_weights(model, windows())['W']
    assert W[5, 0] == pytest.approx(1 / 3, rel=1e-5)  # reader 5: embedding, block 0, partial sum (sublayer 4)
    assert W[5, 1:5] == pytest.approx([1 / 3] * 4, rel=1e-5) and W[5, 5] == pytest.approx(1 / 3, rel=1e-5)


def test_block_attnres_path_weights_spread_a_block_weight_over_its_sublayers():
    def entry(ell, ws):  # token-constant weights over n sources, (n, B=1, T=2)
        return {'block': ell // 2, 'sublayer': ell % 2, 'weights': torch.tensor(ws)[:, None, None].expand(-1, 1, 2)}
    tape = [entry(1, [0.3, 0.7]), entry(2, [0.6, 0.4]), entry(3, [0.2, 0.5, 0.3]), entry(4, [0.1, 0.1, 0.8])]
    W, n = probe.attnres_path_weights(tape, n_layer=2, block_size=2)
    assert n == 2
    np.testing.assert_allclose(W[3, :4], [0.2, 0.5, 0.5, 0.3])   # block 0 = sublayers 0, 1; partial = 2
    np.testing.assert_allclose(W[4], [0.1, 0.1, 0.1, 0.8, 0.8])   # readout: emb, block 0, block 1
    np.testing.assert_allclose(W[2, :3], [0.6, 0.4, 0.4])
    assert W[0, 0] == 1.0 and np.isnan(W[0, 1:]).all()
    with pytest.raises(ValueError, match='sources'):
        probe.attnres_path_weights([entry(3, [0.5, 0.5])], n_layer=2, block_size=2)


def test_block_weights_need_block_attnres():
    with pytest.raises(ValueError, match='Block AttnRes'):
        probe.block_weights(tiny('attnres'), windows())

# -----------------------------------------------------------------------------
# path weights: from what a scheme does, or refused (a scheme that does not say
# what its adds weigh)

class HalfAdd(residuals.SingleStream):
    """h <- h + 0.5 F(RMSNorm(h)), built the way docs/new_scheme.md builds a scheme."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = residuals.per_block(cfg, norm=residuals.rmsnorm)

    def sublayer(self, h, b, j, f):
        return h + 0.5 * f(self.layers[b].get('norm', j)(h))


class HalfPreLN(residuals.PreLN):
    """The same update under Pre-LN's name: it inherits unit_paths = True without saying it."""

    def sublayer(self, h, b, j, f):
        return super().sublayer(h, b, j, lambda x: 0.5 * f(x))


def branch_sums(model, idx):
    """The path weights checked against the forward pass: the input of every reader (each
    sublayer's pre-norm, the final norm) and the branch outputs v_1..v_2L (v_0 = embedding),
    recorded by hooks. Returns (readers (2L+1, N, d), sources (2L+1, N, d))."""
    readers, sources = [], [model.wte(idx).detach()]
    hooks = [m.register_forward_pre_hook(lambda m, a: readers.append(a[0].detach()))
             for layer in model.residual.layers for m in (layer.attn_norm, layer.mlp_norm)]
    hooks.append(model.norm_f.register_forward_pre_hook(lambda m, a: readers.append(a[0].detach())))
    for blk in model.blocks:
        for m in (blk.attn, blk.mlp):
            hooks.append(m.register_forward_hook(lambda m, a, out: sources.append(out.detach())))
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return torch.stack(readers).flatten(1, 2), torch.stack(sources).flatten(1, 2)


@pytest.mark.parametrize('residual', ['preln', 'lns'])
def test_unit_path_weights_rebuild_every_reader_s_input_from_the_branch_outputs(residual):
    """For a scheme that says its adds weigh 1, sum_i W[l, i] v_i is the input of reader l,
    every token, every reader (v from hooks on the branches, not from the trace)."""
    model = tiny_bytes(residual, n_layer=3)
    with torch.no_grad():
        for p in model.residual.parameters():
            p.mul_(1 + 0.3 * torch.randn(p.shape))
    idx = torch.randint(0, V_BYTES, (2, 6), generator=torch.Generator().manual_seed(1))
    r = probe.path_weights(model, idx)
    assert r['kind'] == 'unit'
    readers, sources = branch_sums(model, idx)
    W = torch.tensor(np.nan_to_num(r['W']), dtype=sources.dtype)
    torch.testing.assert_close(torch.einsum('li,ind->lnd', W, sources), readers, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('scheme', [HalfAdd, HalfPreLN])
def test_path_weights_of_a_scheme_that_does_not_say_are_refused(scheme, tmp_path, monkeypatch, capsys):
    """h + 0.5 F(...): unit weights would not rebuild its readers' inputs (checked), so
    path_weights refuses in one line, and probe.py skips the metric with that line."""
    monkeypatch.setitem(residuals.RESIDUALS, 'halfadd', scheme)
    model = tiny_bytes('halfadd', n_layer=2)
    idx = torch.randint(0, V_BYTES, (2, 6), generator=torch.Generator().manual_seed(1))
    readers, sources = branch_sums(model, idx)
    ones = torch.tril(torch.ones(len(readers), len(sources)))
    assert not torch.allclose(torch.einsum('li,ind->lnd', ones, sources), readers, atol=1e-3)  # not ones
    half = torch.tril(torch.full((len(readers), len(sources)), 0.5))
    half[:, 0] = 1.0  # the embedding is added once, with weight 1
    torch.testing.assert_close(torch.einsum('li,ind->lnd', half, sources), readers, rtol=1e-5, atol=1e-5)
    assert probe.path_weights_kind(model) is None
    with pytest.raises(ValueError) as e:
        probe.path_weights(model, idx)
    assert '\n' not in str(e.value) and 'halfadd' in str(e.value) and 'unit_paths' in str(e.value)
    val = write_data(tmp_path / 'data', tokenizer='byte')
    ckpt = save_ckpt_extra(tmp_path / 'run' / 'ckpt.pt', model)
    res = probe.main([f'--ckpt={ckpt}', f'--val_bin={val}', '--metrics=path_weights', '--n_windows=2',
                      '--seq_len=8', '--device=cpu'])
    assert 'path_weights' not in res and 'unit_paths' in res['skipped']['path_weights']
    said = [line for line in capsys.readouterr().out.splitlines() if 'unit_paths' in line]
    assert len(said) == 1 and said[0].startswith('skipping path_weights:'), said


def test_every_registered_scheme_says_or_traces_its_path_weights_or_is_refused():
    """The kinds of the registry: traced (AttnRes, HC), said (unit adds), or none (post-norm and
    scaled adds: DeepNorm's alpha h, ReZero's and LayerScale's gains, KEEL, ResiDual)."""
    kinds = {name: probe.path_weights_kind(tiny_bytes(name, n_layer=2)) for name in residuals.RESIDUALS}
    assert {n for n, k in kinds.items() if k == 'unit'} == {'preln', 'lns', 'sandwich', 'moda'}
    assert {n for n, k in kinds.items() if k is None} >= {'postln', 'deepnorm', 'rezero', 'layerscale', 'keel',
                                                          'resdual'}
    assert kinds['attnres'] == kinds['blockattnres'] == 'attnres' and kinds['hc'] == kinds['mhc'] == 'hc'


# -----------------------------------------------------------------------------
# ARC-Easy pruning

ARC_ITEMS = [
    {'task': 'arc_easy', 'id': 'q1', 'prompt': 'Question: What falls from clouds?\nAnswer:',
     'choices': ['rain', 'rocks', 'a tall giraffe'], 'gold': 0},
    {'task': 'arc_easy', 'id': 'q2', 'prompt': 'Question: Which is a planet?\nAnswer:',
     'choices': ['Mars', 'the Moon', 'a comet'], 'gold': 0},
    {'task': 'arc_easy', 'id': 'q3', 'prompt': 'Question: What do plants need?\nAnswer:',
     'choices': ['sunlight and water', 'salt', 'noise', 'plastic'], 'gold': 0},
]


def write_arc(eval_dir):
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / 'arc_easy.jsonl').write_text(''.join(json.dumps(it) + '\n' for it in ARC_ITEMS))


def expected_arc(model, enc, items, skip=()):
    """ARC scoring done by hand: sum of continuation log-probs from one full forward per choice."""
    acc = acc_norm = 0
    for it in items:
        lps = []
        for c in it['choices']:
            ctx, cont = enc.encode(it['prompt']), enc.encode(it['prompt'] + ' ' + c)[len(enc.encode(it['prompt'])):]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = model(ids[:, :-1], skip=skip)[0].log_softmax(-1)[0]
            lps.append(sum(logp[len(ctx) - 1 + k, tok].item() for k, tok in enumerate(cont)))
        acc += int(np.argmax(lps) == it['gold'])
        acc_norm += int(np.argmax([lp / len(c) for lp, c in zip(lps, it['choices'])]) == it['gold'])
    return acc / len(items), acc_norm / len(items)


def test_prune_scan_scores_the_arc_fixture_and_a_dead_block_changes_nothing(tmp_path):
    from probes import evals
    write_arc(tmp_path)
    items = evals.load_task('arc_easy', tmp_path)
    enc = get_tokenizer('byte')
    model = zero_blocks(randomize_scheme(tiny('preln', n_layer=3, vocab_size=257, seed=5, block_size=64)), blocks=[1])
    r = probe.prune_scan(model, enc, items, batch_size=3, chunk_items=2)
    assert r['n'] == 3 and len(r['blocks']) == 3
    assert (r['baseline']['acc'], r['baseline']['acc_norm']) == pytest.approx(expected_arc(model, enc, items))
    for b in (0, 2):
        got = r['blocks'][b]
        assert (got['acc'], got['acc_norm']) == pytest.approx(expected_arc(model, enc, items, skip={b}))
        assert got['delta_acc_norm'] == pytest.approx(got['acc_norm'] - r['baseline']['acc_norm'])
    assert r['blocks'][1]['delta_acc'] == 0 and r['blocks'][1]['delta_acc_norm'] == 0
    # the error bar: standard error of the paired per-question difference, 0 for the dead block
    assert r['blocks'][1]['se_delta_acc_norm'] == 0
    base = [expected_arc(model, enc, [it])[1] for it in items]
    for b in (0, 2):
        d = np.array([expected_arc(model, enc, [it], skip={b})[1] for it in items]) - base
        assert r['blocks'][b]['se_delta_acc_norm'] == pytest.approx(d.std(ddof=1) / math.sqrt(len(d)))

def test_prune_scan_error_bar_is_the_paired_standard_error_of_unequal_differences(tmp_path):
    """12 questions on which skipping a block turns some answers right and others wrong: the
    s.e. of each block's change is the sample s.e. (n - 1) of the per-question differences in
    acc_norm, each question scored by hand with and without the block; it is not the unpaired
    s.e. of the two accuracies, which differs here."""
    from probes import evals
    rng = np.random.default_rng(0)
    words = ['rain', 'rocks', 'sun', 'moon', 'water', 'salt', 'tree', 'fish', 'stone', 'air', 'fire', 'ice']
    items = [{'task': 'arc_easy', 'id': f'q{i}', 'prompt': f'Question: q{i}?\nAnswer:',
              'choices': [str(c) for c in rng.choice(words, size=3, replace=False)], 'gold': int(rng.integers(0, 3))}
             for i in range(12)]
    (tmp_path / 'arc_easy.jsonl').write_text(''.join(json.dumps(it) + '\n' for it in items))
    items = evals.load_task('arc_easy', tmp_path)
    enc = get_tokenizer('byte')
    model = randomize_scheme(tiny('preln', n_layer=3, vocab_size=257, seed=1, block_size=64))
    with torch.no_grad():  # larger weights: skipping a block changes some answers
        for p in model.parameters():
            p.mul_(3)
    r = probe.prune_scan(model, enc, items, batch_size=4, chunk_items=5)
    base = np.array([expected_arc(model, enc, [it])[1] for it in items])
    unequal = 0
    for b in range(3):
        right = np.array([expected_arc(model, enc, [it], skip={b})[1] for it in items])
        d = right - base
        unequal += len(set(d)) > 1
        se = math.sqrt(((d - d.mean()) ** 2).sum() / (len(d) - 1) / len(d))
        got = r['blocks'][b]
        assert got['delta_acc_norm'] == pytest.approx(d.mean())
        assert got['se_delta_acc_norm'] == pytest.approx(se, rel=1e-12)
        if len(set(d)) > 1:
            assert abs(se - math.sqrt((right.var(ddof=1) + base.var(ddof=1)) / len(d))) > 0.01
    assert unequal >= 2


# -----------------------------------------------------------------------------
# data, checkpoints and the command line

def write_val(path, n=4000, vocab=V, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16).tofile(path)
    return path


def test_sample_windows_are_reproducible_contiguous_slices(tmp_path):
    val = write_val(tmp_path / 'val.bin')
    data = np.fromfile(val, dtype=np.uint16)
    w = probe.sample_windows(val, 5, 16)
    assert w.shape == (5, 16) and w.dtype == torch.int64
    assert torch.equal(w, probe.sample_windows(val, 5, 16, seed=42))
    assert not torch.equal(w, probe.sample_windows(val, 5, 16, seed=7))
    starts = np.random.default_rng(42).integers(0, len(data) - 16 + 1, size=5)
    for row, s in zip(w, starts):
        assert row.tolist() == data[s:s + 16].tolist()
    with pytest.raises(FileNotFoundError, match='prepare'):
        probe.sample_windows(tmp_path / 'missing.bin', 2, 8)
    with pytest.raises(ValueError, match='seq_len'):
        probe.sample_windows(val, 2, 10_000)


def save_ckpt(path, model, dataset='tinyset'):
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    checkpoint.save_checkpoint(str(path), {'model': model.state_dict(), 'model_args': dict(cfg.__dict__),
                                           'iter_num': 7, 'config': {'dataset': dataset}})
    return path


def test_load_model_round_trip_and_clear_errors(tmp_path):
    model = randomize_scheme(tiny('attnres'))
    path = save_ckpt(tmp_path / 'run' / 'ckpt.pt', model)
    loaded, ckpt = probe.load_model(path)
    w = windows()
    torch.testing.assert_close(loaded(w)[0], model(w)[0])
    assert ckpt['iter_num'] == 7 and 'model' not in ckpt
    with pytest.raises(FileNotFoundError, match='train.py'):
        probe.load_model(tmp_path / 'nope.pt')
    bad = tmp_path / 'truncated.pt'
    bad.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    with pytest.raises(ValueError, match='truncated'):
        probe.load_model(bad)


def make_run(tmp_path, residual):
    model = randomize_scheme(tiny(residual, n_layer=2, vocab_size=257))
    ckpt = save_ckpt(tmp_path / residual / 'ckpt.pt', model)
    return ckpt


def test_cli_end_to_end_writes_json_and_figures(tmp_path, capsys):
    val = write_val(tmp_path / 'data' / 'val.bin', vocab=257)
    (val.parent / 'meta.json').write_text(json.dumps({'tokenizer': 'byte'}))
    write_arc(tmp_path / 'evals')
    (tmp_path / 'evals' / 'gsm8k.jsonl').write_text(json.dumps(  # 40 bytes: longer than the 32-token context
        {'task': 'gsm8k', 'id': 'g1', 'prompt': 'Question: what is 1+1?\nAnswer:', 'answer': ' 2\n#### 2'}) + '\n')
    ckpt = make_run(tmp_path, 'attnres')
    common = [f'--val_bin={val}', f'--eval_dir={tmp_path / "evals"}', '--n_windows=2', '--seq_len=16',
              '--device=cpu', '--n_boot=20']
    res = probe.main([f'--ckpt={ckpt}', '--metrics=all'] + common)
    out = ckpt.parent / 'probe'
    data = json.loads((out / 'probe.json').read_text())
    for key in ('angular', 'causal', 'permutation', 'late_pairs', 'path_weights', 'logit_lens', 'prune', 'domain_nll'):
        assert key in data, key
    assert set(data['skipped']) == {'block_weights', 'propagation'} and res['tokenizer'] == 'byte'
    assert data['prune']['n'] == 3 and data['domain_nll']['tasks']['gsm8k']['n_examples'] == 1
    assert data['causal']['C'][0][0] is None
    assert data['settings']['angular'] == {'n_windows': 2, 'seq_len': 16, 'seed': 42} and data['dtype'] == 'float32'
    for name in ('angular', 'causal', 'permutation', 'late_pairs', 'path_weights', 'prune', 'logit_lens', 'domain_nll'):
        assert (out / f'{name}.png').stat().st_size > 1000, name
    text = capsys.readouterr().out
    assert 'skipping propagation' in text and 'R_causal' in text
    cut = data['domain_nll']['tasks']['gsm8k']['n_truncated']
    assert cut == 1 and "1 examples cut to the model's context" in text
    with pytest.raises(SystemExit) as e:
        probe.main([f'--ckpt={ckpt}', '--metrics=angular,bogus'] + common)
    assert e.value.code == 1 and 'bogus' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe.main([f'--ckpt={tmp_path / "missing.pt"}'] + common)
    assert 'not found' in capsys.readouterr().err
    with pytest.raises(SystemExit):  # bf16 autocast is CUDA-only: no silent fp32 fallback
        probe.main([f'--ckpt={ckpt}', '--metrics=angular', '--dtype=bfloat16'] + common)
    assert 'CUDA only' in capsys.readouterr().err


def test_late_pairs_figure_labels_a_missing_ratio_na_not_zero():
    from probes import plots as probe_plots
    r = {'label': 'a', 'late_pairs': {'R_causal': 0.25, 'R_perm': None, 'causal_threshold': 0.1,
                                      'perm_threshold': 0.1, 'start': 2, 'n_pairs': 3}}
    fig = probe_plots.plot_late_pairs([r])
    assert [t.get_text() for t in fig.axes[0].texts] == ['25.0', 'n/a']


def test_cli_keeps_finished_metrics_and_checks_the_vocabulary(tmp_path, monkeypatch, capsys):
    val = write_val(tmp_path / 'data' / 'val.bin', vocab=257)
    ckpt = make_run(tmp_path, 'preln')
    common = [f'--val_bin={val}', '--tokenizer=byte', '--n_windows=2', '--seq_len=16', '--device=cpu']

    def crash(*args, **kwargs):
        raise RuntimeError('out of memory')
    monkeypatch.setattr(probe, 'logit_lens', crash)
    with pytest.raises(RuntimeError):
        probe.main([f'--ckpt={ckpt}', '--metrics=angular,logit_lens'] + common)
    kept = json.loads((ckpt.parent / 'probe' / 'probe.json').read_text())
    assert 'angular' in kept and 'logit_lens' not in kept         # the finished metric survives the crash
    small = save_ckpt(tmp_path / 'small' / 'ckpt.pt', tiny('preln', n_layer=2, vocab_size=64))
    with pytest.raises(SystemExit):                              # byte data (ids up to 256) into 64 rows
        probe.main([f'--ckpt={small}', '--metrics=angular'] + common)
    assert "past the model's vocab_size 64" in capsys.readouterr().err
    (tmp_path / 'evals').mkdir()
    (tmp_path / 'evals' / 'gsm8k.jsonl').write_text(json.dumps(
        {'task': 'gsm8k', 'id': 'g1', 'prompt': 'Question: 1+1?\nAnswer:', 'answer': ' 2\n#### 2'}) + '\n')
    with pytest.raises(SystemExit):                              # GPT-2 BPE ids into a byte-level model
        probe.main([f'--ckpt={ckpt}', '--metrics=domain_nll', f'--val_bin={val}', '--tokenizer=gpt2',
                    f'--eval_dir={tmp_path / "evals"}', '--device=cpu'])
    assert "more than the model's vocab_size 257" in capsys.readouterr().err
    assert probe.data_dir_for({'config': {'data_dir': '/x/y', 'dataset': 'fineweb_edu'}}) == Path('/x/y')
    other = ckpt.parent / 'ckpt_copy.pt'                         # a second checkpoint of the same run
    other.write_bytes(ckpt.read_bytes())
    assert probe.default_label(other) == 'preln/ckpt_copy' and probe.default_label(ckpt) == 'preln'
    assert probe.default_probe_dir(other) == other.parent / 'probe_ckpt_copy'
    monkeypatch.setattr(probe, 'probe_checkpoint', crash)           # refused before any model is probed
    with pytest.raises(SystemExit):
        probe.main(['--compare', str(ckpt), str(ckpt), '--metrics=angular'] + common)
    assert 'share a label' in capsys.readouterr().err


@pytest.mark.slow
def test_cli_compare_overlays_several_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setitem(residuals.RESIDUALS, 'toyhc', ToyHC)
    val = write_val(tmp_path / 'data' / 'val.bin', vocab=257)
    ckpts = [make_run(tmp_path, r) for r in ('preln', 'attnres', 'toyhc')]
    common = [f'--val_bin={val}', '--tokenizer=byte', f'--eval_dir={tmp_path / "none"}', '--n_windows=2',
              '--seq_len=16', '--device=cpu', '--n_boot=20',
              '--metrics=angular,causal,permutation,propagation,path_weights']
    probe.main([f'--ckpt={ckpts[0]}'] + common)  # the first one from its probe.json
    results = probe.main(['--compare', str(ckpts[0].parent / 'probe' / 'probe.json'), str(ckpts[1]), str(ckpts[2]),
                          f'--out_dir={tmp_path / "cmp"}'] + common)
    assert [r['label'] for r in results] == ['preln', 'attnres', 'toyhc']
    assert np.isnan(results[0]['causal']['C'][0, 0])  # read back from JSON as an array
    for name in ('angular', 'causal', 'permutation', 'late_pairs', 'path_weights', 'propagation'):
        assert (tmp_path / 'cmp' / f'{name}.png').is_file()
    cmp = json.loads((tmp_path / 'cmp' / 'compare.json').read_text())
    assert set(cmp) == {'preln', 'attnres', 'toyhc'} and 'propagation' in cmp['toyhc']


def test_bench_probe_runs_and_reports_identical_scores(capsys):
    from probes import bench as bench_probe
    bench_probe.main(['--n_layer=3', '--n_embd=16', '--n_head=2', '--vocab_size=64', '--n_windows=2',
                      '--seq_len=8', '--device=cpu'])
    out = capsys.readouterr().out
    assert out.count('speed-up') == 2 and out.count('max |diff| 0.0e+00') == 2
    with pytest.raises(SystemExit, match='--scans'):
        bench_probe.main(['--scans=bogus', '--device=cpu'])


def test_figures_for_block_weights_and_domain_nll_from_results(tmp_path):
    from probes import plots as probe_plots
    bw = {'current': [np.nan, 0.05, np.nan, 0.4, 0.6], 'embedding': [1.0, 0.9, 0.5, 0.3, 0.2],
          'frozen': [0.0, 0.05, 0.5, 0.3, 0.2], 'boundaries': [0, 2], 'low_use_sublayers': 1, 'low_use_threshold': 0.1}
    nll = {'categories': {'coding': {'nll': 1.2}, 'stem': {'nll': None}, 'math': {'nll': 0.9}}}
    results = [{'label': 'a', 'block_weights': bw, 'domain_nll': nll}, {'label': 'b', 'domain_nll': nll}]
    paths = probe_plots.plot_all(results, tmp_path)
    assert sorted(p.name for p in paths) == ['block_weights.png', 'domain_nll.png']
    assert all(p.stat().st_size > 1000 for p in paths)
    # a probe.json from before the low-use segment had one name is read, kept and drawn
    old = dict(bw, dead_sublayers=1, dead_threshold=0.1)
    del old['low_use_sublayers'], old['low_use_threshold']
    (tmp_path / 'old').mkdir()
    (tmp_path / 'old' / 'probe.json').write_text(json.dumps({'label': 'old', 'block_weights': old}, default=str)
                                                 .replace('NaN', 'null'))
    back = probe.load_results(tmp_path / 'old' / 'probe.json')
    assert (back['block_weights']['low_use_sublayers'], back['block_weights']['low_use_threshold']) == (1, 0.1)
    assert [p.name for p in probe_plots.plot_all([back], tmp_path / 'old')] == ['block_weights.png']


# -----------------------------------------------------------------------------
# the probe formulas against hand-computed cases (each catches one plausible slip)

def test_permutation_score_is_the_absolute_change_also_when_a_swap_lowers_the_loss():
    model = randomize_scheme(tiny('preln', n_layer=4), seed=3)
    r = probe.permutation_scores(model, windows(n=4), batch_size=2)
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4)]
    lower = [p for p in pairs if r['loss_swap'][p] < r['loss']]
    assert lower and len(lower) < len(pairs)  # both signs occur: the absolute value matters
    for p in pairs:
        assert r['P'][p] == abs(r['loss_swap'][p] - r['loss']) / r['loss'] and r['P'][p] > 0


def test_logit_lens_kl_is_kl_of_the_final_distribution_from_the_lens():
    """KL(p_final || p_l) = sum p_final (log p_final - log p_l), not the reverse KL(p_l || p_final)."""
    model = randomize_scheme(tiny('preln', n_layer=3), seed=2)
    with torch.no_grad():  # peaked distributions: KL is large, and its two directions differ
        model.lm_head.weight.mul_(100)
    w = windows(n=2)
    r = probe.logit_lens(model, w, batch_size=2)
    rec = []
    with torch.no_grad():
        h = model.hidden(w, record=rec)
        logp_f = model.head(h)[:, :-1].float().log_softmax(-1)
        for l, (_, lens) in enumerate(rec[:-1]):
            logp = model.head(lens)[:, :-1].float().log_softmax(-1)
            forward = (logp_f.exp() * (logp_f - logp)).sum(-1).mean().item()
            reverse = (logp.exp() * (logp - logp_f)).sum(-1).mean().item()
            assert abs(forward - reverse) > 0.05 * forward  # the two directions differ here
            assert r['kl'][l] == pytest.approx(forward, rel=1e-3), l


def test_effective_rank_uses_singular_values_not_their_squares():
    # sigma = (3, 1): p = (3/4, 1/4); from sigma^2 it would be (9/10, 1/10)
    p = np.array([0.75, 0.25])
    assert probe.effective_rank(torch.diag(torch.tensor([3.0, 1.0]))).item() == pytest.approx(
        math.exp(-(p * np.log(p)).sum()), rel=1e-12)
    R = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0]
    M = R @ torch.diag(torch.tensor([4.0, 2.0, 1.0, 1.0], dtype=torch.float64)) @ R.T  # rotation-invariant
    p = np.array([4, 2, 1, 1]) / 8
    assert probe.effective_rank(M).item() == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-9)


def test_mean_abs_cosine_is_over_columns():
    # columns (1, 1) and (0, 1e-3): |cos| = 1/sqrt(2); rows (1, 0) and (1, 1e-3): |cos| ~ 1
    M = torch.tensor([[1.0, 0.0], [1.0, 1e-3]])
    assert probe.mean_abs_cosine(M).item() == pytest.approx(1 / math.sqrt(2), rel=1e-9)
    M = torch.tensor([[1.0, -2.0, 0.0], [3.0, 4.0, 0.0], [0.0, 0.0, 5.0]])
    cols = M.double() / M.double().norm(dim=0)
    expected = np.mean([abs((cols[:, a] @ cols[:, b]).item()) for a, b in ((0, 1), (0, 2), (1, 2))])
    assert probe.mean_abs_cosine(M).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize('L,start', [(6, 2), (10, 3), (9, 3), (8, 2), (32, 8), (3, 1)])
def test_late_pairs_start_at_the_ceiling_of_a_quarter(L, start):
    pairs = probe.late_pairs(L)
    assert min(s for s, _ in pairs) == start and len(pairs) == (L - start) * (L - start - 1) // 2
    C = np.zeros((L, L))
    assert probe.late_pair_ratio(C)['start'] == start and probe.late_pair_ratio(C)['n_pairs'] == len(pairs)


def test_bootstrap_interval_is_95_percent_by_default():
    """For 400 standard-normal units the 95% percentile interval of the mean is about
    +-1.96 / sqrt(400) = +-0.098 (a 90% one: +-0.082)."""
    x = np.random.default_rng(1).normal(size=400)
    mean, lo, hi = probe.bootstrap_ci(x, n_boot=4000, seed=0)
    half = (hi - lo) / 2 / (x.std() / math.sqrt(len(x)))
    assert half == pytest.approx(1.96, rel=0.05)
    mean90, lo90, hi90 = probe.bootstrap_ci(x, n_boot=4000, seed=0, level=0.90)
    assert (hi90 - lo90) / 2 / (x.std() / math.sqrt(len(x))) == pytest.approx(1.645, rel=0.05)


def test_held_out_windows_follow_the_documented_draw(tmp_path):
    """docs/probes.md, windows: numpy default_rng(seed), uniform start in [0, n - T], contiguous tokens
    (one file). Token k of the file has id k, so a window names its start."""
    n, T = 5000, 16
    val = tmp_path / 'val.bin'
    np.arange(n, dtype=np.uint16).tofile(val)
    w = probe.sample_windows(val, 7, T, seed=42)
    starts = np.random.default_rng(42).integers(0, n - T + 1, size=7)
    assert w[:, 0].tolist() == starts.tolist()
    assert torch.equal(w, torch.from_numpy(starts[:, None] + np.arange(T)).long())


def test_a_later_probe_run_keeps_the_metrics_it_does_not_recompute(tmp_path, capsys):
    val = write_val(tmp_path / 'data' / 'val.bin', vocab=257)
    ckpt = make_run(tmp_path, 'attnres')
    common = [f'--val_bin={val}', '--tokenizer=byte', '--n_windows=2', '--seq_len=16', '--device=cpu']
    probe.main([f'--ckpt={ckpt}', '--metrics=angular,causal'] + common)
    first = json.loads((ckpt.parent / 'probe' / 'probe.json').read_text())
    probe.main([f'--ckpt={ckpt}', '--metrics=permutation'] + common)
    merged = json.loads((ckpt.parent / 'probe' / 'probe.json').read_text())
    assert merged['angular'] == first['angular'] and merged['causal'] == first['causal'] and 'permutation' in merged
    assert set(merged['settings']) == {'angular', 'causal', 'permutation'}
    assert 'kept angular, causal' in capsys.readouterr().out
    assert (ckpt.parent / 'probe' / 'angular.png').is_file()  # figures of the kept metrics too
    # another checkpoint at the same path (a later iteration): the old results are moved aside
    checkpoint.save_checkpoint(str(ckpt), dict(torch.load(ckpt, weights_only=True), iter_num=9))
    probe.main([f'--ckpt={ckpt}', '--metrics=angular'] + common)
    now = json.loads((ckpt.parent / 'probe' / 'probe.json').read_text())
    assert now['iter_num'] == 9 and 'causal' not in now
    assert json.loads((ckpt.parent / 'probe' / 'probe_iter7.json').read_text()) == merged


def test_compare_writes_only_under_its_out_dir(tmp_path):
    val = write_val(tmp_path / 'data' / 'val.bin', vocab=257)
    ckpts = [make_run(tmp_path / 'runs', r) for r in ('preln', 'attnres')]
    before = sorted(p for p in (tmp_path / 'runs').rglob('*'))
    probe.main(['--compare', *map(str, ckpts), f'--out_dir={tmp_path / "cmp"}', f'--val_bin={val}',
                '--tokenizer=byte', '--n_windows=2', '--seq_len=16', '--device=cpu', '--metrics=angular'])
    assert sorted(p for p in (tmp_path / 'runs').rglob('*')) == before  # the runs' own probe/ untouched
    for label in ('preln', 'attnres'):
        assert json.loads((tmp_path / 'cmp' / label / 'probe.json').read_text())['label'] == label
    assert (tmp_path / 'cmp' / 'compare.json').is_file() and (tmp_path / 'cmp' / 'angular.png').is_file()


def test_held_out_data_or_tokenizer_of_another_tokenizer_is_refused(tmp_path, capsys):
    """A GPT-2 model given byte-level data (ids < 257 fit its embedding) or --tokenizer=byte."""
    model = tiny('preln', n_layer=2, vocab_size=50280)
    own = tmp_path / 'gpt2data'
    own.mkdir()
    (own / 'meta.json').write_text(json.dumps({'tokenizer': 'gpt2', 'vocab_size': 50280}))
    ckpt = save_ckpt(tmp_path / 'run' / 'ckpt.pt', model)
    checkpoint.save_checkpoint(str(ckpt), dict(torch.load(ckpt, weights_only=True), config={'data_dir': str(own)}))
    byte = write_val(tmp_path / 'bytedata' / 'val.bin', vocab=257)
    (byte.parent / 'meta.json').write_text(json.dumps({'tokenizer': 'byte', 'vocab_size': 257}))
    with pytest.raises(SystemExit):
        probe.main([f'--ckpt={ckpt}', f'--val_bin={byte}', '--metrics=angular', '--device=cpu'])
    assert "holds 'byte' tokens" in capsys.readouterr().err
    write_val(own / 'val.bin', vocab=257)
    with pytest.raises(SystemExit):
        probe.main([f'--ckpt={ckpt}', '--tokenizer=byte', '--metrics=angular', '--device=cpu'])
    assert "--tokenizer=byte but the model's data is 'gpt2'" in capsys.readouterr().err
    (own / 'meta.json').unlink()  # nothing recorded: a byte meta.json still disagrees with 50280 rows
    with pytest.raises(SystemExit):
        probe.main([f'--ckpt={ckpt}', f'--val_bin={byte}', '--metrics=angular', '--device=cpu'])
    assert '257-id vocabulary' in capsys.readouterr().err


# -----------------------------------------------------------------------------
# the tokenizer a run is labelled with: the checkpoint's own record wins over a
# meta.json, whose disagreement is one line (byte-level models, V_BYTES = 257)

V_BYTES = 257


def tiny_bytes(residual='preln', n_layer=2, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=V_BYTES, block_size=32, n_layer=n_layer, n_head=2, n_embd=16, residual=residual)).eval()


def save_ckpt_extra(path, model, **extra):
    """A checkpoint in train.py's format (the keys probe.py reads) plus `extra` keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.save_checkpoint(str(path), {'model': model.state_dict(), 'model_args': dict(model.config.__dict__),
                                           'iter_num': 3, 'config': {'dataset': 'nowhere'}, **extra})
    return path


def write_data(d, tokenizer=None, n=3000):
    """d/val.bin of byte-level ids, with a meta.json naming `tokenizer` (none if None)."""
    d.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 256, n).astype(np.uint16).tofile(d / 'val.bin')
    if tokenizer:
        (d / 'meta.json').write_text(json.dumps({'tokenizer': tokenizer}))
    return d / 'val.bin'


ANGULAR = ['--metrics=angular', '--n_windows=2', '--seq_len=8', '--device=cpu']


def notes(text):
    return [line for line in text.splitlines() if line.startswith('note:')]


def test_the_checkpoint_s_recorded_tokenizer_labels_the_results(tmp_path, capsys):
    """A byte-level run (its checkpoint records 'byte') probed on data whose meta.json says
    'gpt2': labelled 'byte', in probe.json too, and one note line names both."""
    val = write_data(tmp_path / 'data', tokenizer='gpt2')
    ckpt = save_ckpt_extra(tmp_path / 'run' / 'ckpt.pt', tiny_bytes(), tokenizer='byte')
    res = probe.main([f'--ckpt={ckpt}', f'--val_bin={val}'] + ANGULAR)
    assert res['tokenizer'] == 'byte'
    assert json.loads((ckpt.parent / 'probe' / 'probe.json').read_text())['tokenizer'] == 'byte'
    out = capsys.readouterr().out
    [note] = notes(out)
    assert str(tmp_path / 'data' / 'meta.json') in note and "'gpt2'" in note and "records 'byte'" in note
    assert 'tokenizer byte' in out  # the first line names it too


def test_the_recorded_tokenizer_wins_over_the_meta_json_of_its_own_data_dir(tmp_path, capsys):
    """Its training data re-prepared since (meta.json now 'gpt2'), held-out data elsewhere
    without a meta.json: 'byte', one note line naming the training data's meta.json."""
    own = tmp_path / 'own'
    write_data(own, tokenizer='gpt2')
    val = write_data(tmp_path / 'elsewhere')
    ckpt = save_ckpt_extra(tmp_path / 'run' / 'ckpt.pt', tiny_bytes(), tokenizer='byte', config={'data_dir': str(own)})
    assert probe.main([f'--ckpt={ckpt}', f'--val_bin={val}'] + ANGULAR)['tokenizer'] == 'byte'
    [note] = notes(capsys.readouterr().out)
    assert str(own / 'meta.json') in note and "records 'byte'" in note


def test_agreeing_or_unrecorded_tokenizers_say_nothing(tmp_path, capsys):
    """No disagreement, no note; a checkpoint recording none takes its data's meta.json."""
    val = write_data(tmp_path / 'data', tokenizer='byte')
    ckpt = save_ckpt_extra(tmp_path / 'run' / 'ckpt.pt', tiny_bytes(), tokenizer='byte')
    assert probe.main([f'--ckpt={ckpt}', f'--val_bin={val}'] + ANGULAR)['tokenizer'] == 'byte'
    bare = save_ckpt_extra(tmp_path / 'bare' / 'ckpt.pt', tiny_bytes())
    assert probe.main([f'--ckpt={bare}', f'--val_bin={val}'] + ANGULAR)['tokenizer'] == 'byte'
    assert notes(capsys.readouterr().out) == []
    assert probe.tokenizer_name_for({'tokenizer': 'byte', 'config': {}, 'model_args': {'vocab_size': 50280}},
                                    val) == 'byte'


# -----------------------------------------------------------------------------
# late-pair ratios with scores that are not finite

def hand_ratio(M, L, threshold):
    """R over S_late = {(s, l): s >= ceil(L/4), l > s}, counting only finite scores: (R, above, counted)."""
    above = counted = 0
    for s in range(math.ceil(L / 4), L):
        for l in range(s + 1, L):
            if math.isfinite(M[s][l]):
                counted += 1
                above += M[s][l] > threshold
    return (above / counted if counted else None), above, counted


@pytest.mark.parametrize('L', [8, 9])
def test_late_pair_ratios_leave_out_non_finite_scores_where_late_pairs_look(L, tmp_path):
    """NaN and inf placed inside S_late (and outside it, where they must change nothing): the
    ratios equal a hand loop over the finite late scores, and the same again after a probe.json
    round trip (which stores inf as null)."""
    rng = np.random.default_rng(L)
    C, P = rng.uniform(0, 1, (L, L)), rng.uniform(0, 0.3, (L, L))
    C[np.tril_indices(L)] = P[np.tril_indices(L)] = np.nan
    s0 = math.ceil(L / 4)
    assert (s0, s0 + 1) in probe.late_pairs(L)
    C[s0, s0 + 1], C[s0 + 1, L - 1], C[L - 3, L - 2] = np.nan, np.inf, 0.9  # two late pairs not finite
    C[0, 1], C[0, L - 1] = np.inf, np.nan                                  # not late pairs
    P[s0, L - 1], P[L - 2, L - 1] = np.nan, np.inf
    r = probe.late_pair_ratio(C, P)
    for name, M, thr in (('causal', C, probe.CAUSAL_THRESHOLD), ('perm', P, probe.PERM_THRESHOLD)):
        R, above, counted = hand_ratio(M, L, thr)
        assert counted == r['n_pairs'] - 2 and r[f'n_{name}_pairs'] == counted
        assert r[f'n_{name}'] == above and r[f'R_{name}'] == pytest.approx(R), name
    probe.write_json({'causal': {'C': C}, 'permutation': {'P': P}}, tmp_path / 'probe.json')
    back = probe.load_results(tmp_path / 'probe.json')
    again = probe.late_pair_ratio(back['causal']['C'], back['permutation']['P'])
    assert {k: again[k] for k in r} == r


def test_late_pair_summary_says_how_many_pairs_a_ratio_is_over(capsys):
    L = 8
    C = np.full((L, L), 0.5)
    C[np.tril_indices(L)] = np.nan
    C[2, 3] = np.nan
    probe._report('late_pairs', probe.late_pair_ratio(C))
    out = capsys.readouterr().out
    assert 'R_causal 100.0% (14 of 15 finite)' in out and 'R_perm n/a' in out


def test_progress_bars_stay_out_of_a_log_file(capsys):
    # probe.py always asks for progress; with stderr redirected to a file (here: captured, not a
    # terminal) a bar's carriage returns would run into the log's lines, so none is drawn
    from probes import evals
    model, w = tiny(n_layer=3), windows(4)
    probe.angular_distance(model, w, batch_size=2, progress=True)        # probes/runs.py's batches
    probe.causal_scores(model, w, batch_size=2, progress=True)
    probe.permutation_scores(model, w, batch_size=2, progress=True)
    evals.continuation_logprobs(lambda idx: torch.zeros(*idx.shape, V), None, [([1, 2], [3])] * 3, batch_size=1,
                                pad_id=0, progress=True)
    err = capsys.readouterr().err
    assert '\r' not in err and '%|' not in err

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    with contextlib.redirect_stderr(Terminal()) as tty:                 # on a terminal they are drawn
        probe.causal_scores(model, w, batch_size=2, progress=True)
    assert 'causal' in tty.getvalue() and '\r' in tty.getvalue()
