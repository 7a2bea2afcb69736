"""Pieces whose bugs used to pass the suite, each checked against an independent computation:
AttnRes's and Block AttnRes's skip rule (a loop over sublayers written from the docstrings),
HC / mHC routing-scale init (the study's 0.01, also after a re-init on the meta device, and the
coefficient formula), the usefulness score's centring (a centred least-squares fit and the
replaced block's loss computed by hand), the Jacobian estimator's standard error (the exact
Jacobian, the probes the estimator drew, and the spread over seeds), sampling's vocabulary
padding mask (a model whose padding ids are the most likely) and ARC-Easy's tie-break (hand-
worked ties).
Run: python -m pytest tests/test_planted.py -q"""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sample  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from probes import analysis, evals  # noqa: E402

EPS = 1e-6


def make(residual, L=3, d=16, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=L, n_embd=d, n_head=2, norm_eps=EPS,
                         residual=residual, **kw)).eval()


@torch.no_grad()
def randomize_scheme(model, seed=1):
    """Every scheme parameter moved off its init (zero queries would make every read a mean)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.residual.parameters():
        p.copy_((1 if p.dim() == 1 and (p == 1).all() else 0) + 0.5 * torch.randn(p.shape, generator=g))
    return model


def tokens(B=2, T=12, seed=0, vocab=64):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

# -----------------------------------------------------------------------------
# AttnRes / Block AttnRes skip rule


def depth_read(V, mixer, eps):
    """z = sum_i a_i v_i, a = softmax_i(w . RMSNorm_key(v_i)), one source at a time."""
    logits = torch.stack([(rms(v, mixer.key_norm.weight, eps) * mixer.query).sum(-1) for v in V])  # (n, B, T)
    a = torch.exp(logits - logits.max(0).values)
    a = a / a.sum(0)
    return sum(a[i].unsqueeze(-1) * v for i, v in enumerate(V))


def reference_attnres(model, idx, skip):
    """Full AttnRes from its docstring: sources v_0 = embedding, then every sublayer's output;
    a skipped block adds no source and the next read is the newest source itself. Returns the
    raw mix after each block (L of (B, T, d))."""
    cfg, res, T = model.config, model.residual, idx.size(1)
    rope, eps = (model.rope_cos[:T], model.rope_sin[:T]), cfg.attnres_eps
    V = [model.wte(idx)]
    mix, mixes = V[0], []
    for b in range(cfg.n_layer):
        p, blk = res.layers[b], model.blocks[b]
        if b in skip:
            mix = V[-1]
        else:
            V.append(blk.attn(rms(mix, p.attn_norm.weight, cfg.norm_eps if len(V) == 1 else eps), rope))
            V.append(blk.mlp(rms(depth_read(V, p.mlp_mix, eps), p.mlp_norm.weight, eps)))
            mix = depth_read(V, p.out_mix, eps)
        mixes.append(mix)
    return mixes


def reference_block_attnres(model, idx, skip):
    """Block AttnRes from its docstring, one sublayer k at a time: at k % S == 0 (k > 0) the
    running sum P is frozen as a source before the read; a skipped block adds nothing, still
    freezes P at a boundary inside it, and if the next read is a boundary it is the newest
    source itself. Returns the raw mix after each block."""
    cfg, res, T = model.config, model.residual, idx.size(1)
    rope, eps, S = (model.rope_cos[:T], model.rope_sin[:T]), cfg.attnres_eps, res.group_size
    src, P, mixes = [model.wte(idx)], [None], []

    def freeze(k):
        if k % S == 0 and P[0] is not None:
            src.append(P[0])
            P[0] = None

    def bank():
        return src + ([P[0]] if P[0] is not None else [])

    def add(f):
        P[0] = f if P[0] is None else P[0] + f

    mix = src[0]
    for b in range(cfg.n_layer):
        p, blk, k = res.layers[b], model.blocks[b], 2 * b
        if b in skip:
            freeze(k + 1)
            if (k + 2) % S == 0:
                freeze(k + 2)
                mix = src[-1]
            else:
                mix = depth_read(bank(), p.out_mix, eps)
        else:
            first = len(src) == 1 and P[0] is None
            add(blk.attn(rms(mix, p.attn_norm.weight, cfg.norm_eps if first else eps), rope))
            freeze(k + 1)
            add(blk.mlp(rms(depth_read(bank(), p.mlp_mix, eps), p.mlp_norm.weight, eps)))
            freeze(k + 2)
            mix = depth_read(bank(), p.out_mix, eps)
        mixes.append(mix)
    return mixes


SKIPS = [(), (0,), (1,), (2,), (0, 2), (0, 1, 2)]


@pytest.mark.parametrize('residual,blocks', [('attnres', 8), ('blockattnres', 2), ('blockattnres', 3)])
@torch.no_grad()
def test_attnres_skip_rule_against_a_loop_over_sublayers(residual, blocks):
    """Every single skip and two multiple ones; Block AttnRes with S = 3 (a boundary inside a
    skipped block) and S = 2 (boundaries at every block's attention)."""
    model = randomize_scheme(make(residual, attnres_blocks=blocks))
    ref = reference_block_attnres if residual == 'blockattnres' else reference_attnres
    idx = tokens()
    for skip in SKIPS:
        rec = []
        h = model.hidden(idx, skip=set(skip), record=rec)
        want = ref(model, idx, set(skip))
        for b, (got, exp) in enumerate(zip([lens for _, lens in rec[1:]], want)):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5, msg=f"skip {skip}, after block {b}")
        torch.testing.assert_close(h, want[-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model.hidden(idx, skip={1}), model.hidden(idx, order=(0, 2)), atol=1e-4)

# -----------------------------------------------------------------------------
# HC / mHC routing scales


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
    moved = randomize_scheme(GPT(cfg))
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


@torch.no_grad()
def test_hc_coefficients_move_by_at_most_the_scale_times_tanh():
    """With the projections W, w_beta non-zero, HC's coefficients are static + 0.01 tanh(H_bar W):
    at init they never move more than 0.01 from the one-hot read, identity mix and unit write."""
    model = make('hc', L=2)
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
# usefulness: a centred least-squares fit


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
    model = make('preln', L=3)
    idx = tokens(B=3, T=12)
    model.wte.weight.sub_(model.wte(idx).mean((0, 1)))
    for blk in model.blocks:
        blk.attn.wo.weight.mul_(5)
        blk.mlp.w_down.weight.mul_(5)
    r = analysis.usefulness(model, idx, batch_size=2)
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
# Jacobian deviation: the estimator's standard error


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
    model = randomize_scheme(make('preln', L=2, d=8))
    idx = tokens(B=2, T=6)
    Js = exact_jacobians(model, idx)
    D = Js[0].size(0)
    r = analysis.jacobian_deviation(model, idx, n_probes=0)
    want = [((J - torch.eye(D, dtype=torch.float64)).norm() / math.sqrt(D)).item() for J in Js]
    assert r['exact'] and r['se'] == [0.0, 0.0] and r['deviation'] == pytest.approx(want, rel=1e-4)
    seen, grad = [], torch.autograd.grad

    def spy(out, inp, v, **kw):
        seen.append(v[0, 0].detach().double().clone())
        return grad(out, inp, v, **kw)
    monkeypatch.setattr(torch.autograd, 'grad', spy)
    K = 5
    r = analysis.jacobian_deviation(model, idx, batch_size=4, n_probes=K, seed=3)
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
    model = randomize_scheme(make('preln', L=1, d=8))
    idx = tokens(B=1, T=6)
    exact = analysis.jacobian_deviation(model, idx, n_probes=0)['deviation'][0]
    runs = [analysis.jacobian_deviation(model, idx, n_probes=4, seed=s) for s in range(60)]
    dev = np.array([x['deviation'][0] for x in runs])
    se = np.mean([x['se'][0] for x in runs])
    assert 0.6 < dev.std(ddof=1) / se < 1.6, (dev.std(ddof=1), se)
    assert abs(dev.mean() - exact) < 3 * dev.std(ddof=1) / math.sqrt(len(dev)) + 0.02 * exact

# -----------------------------------------------------------------------------
# sampling: the vocabulary padding mask


class FixedLogits(torch.nn.Module):
    """A 'model' whose next-token logits are always `logits` (V,), whatever the context."""

    def __init__(self, logits, block_size=8):
        super().__init__()
        self.logits = logits
        self.config = type('cfg', (), {'block_size': block_size})()

    def hidden(self, idx):
        return torch.zeros(idx.size(0), idx.size(1), 1)

    def head(self, h):
        return self.logits.expand(h.size(0), h.size(1), -1).clone()


def test_padding_ids_are_never_chosen_even_when_most_likely():
    """Ids 10..15 are padding (n_vocab = 10) and get the largest logits. Greedy picks the best
    real id; top_k = 3 draws only among the 3 best real ids, with the softmax's frequencies;
    top_k = 0 draws only real ids."""
    logits = torch.tensor([0.0, 2.0, -1.0, 1.5, 0.3, 1.8, -2.0, 0.0, 0.5, -0.5] + [9.0] * 6)
    model, n = FixedLogits(logits), 10
    x = torch.zeros(1, 1, dtype=torch.long)
    assert sample.generate(model, x, 5, temperature=0, n_vocab=n)[0, 1:].tolist() == [1] * 5
    gen = torch.Generator().manual_seed(0)
    drawn = sample.generate(model, x.expand(400, 1), 1, temperature=1.0, top_k=3, n_vocab=n, generator=gen)[:, 1]
    top3 = [1, 5, 3]  # the three largest real logits: 2.0, 1.8, 1.5
    assert set(drawn.tolist()) == set(top3)
    p = torch.softmax(logits[top3], 0)
    freq = torch.tensor([(drawn == i).float().mean().item() for i in top3])
    assert (freq - p).abs().max() < 4 * math.sqrt(0.25 / 400)
    drawn = sample.generate(model, x.expand(400, 1), 1, temperature=2.0, top_k=0, n_vocab=n, generator=gen)[:, 1]
    assert drawn.max() < n and len(set(drawn.tolist())) >= 8


def test_sample_py_masks_the_padding_rows_of_a_real_checkpoint(tmp_path):
    """A byte-level model (257 real ids) with 300 embedding rows whose padding rows dominate
    every logit: greedy decoding through sample.main writes only real ids (here id 0, the
    largest real logit, each step); without the mask it would pick a padding row and fail."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():  # real rows 0; padding rows +u, -u, +u, ...: one of them is > 0 for any state
        model.lm_head.weight.zero_()
        u = torch.randn(16)
        model.lm_head.weight[257:] = torch.tensor([(-1.0) ** i for i in range(43)])[:, None] * u
    ckpt = tmp_path / 'ckpt.pt'
    torch.save({'model': model.state_dict(), 'model_args': dict(model.config.__dict__), 'iter_num': 0,
                'config': {'dataset': 'nowhere'}, 'tokenizer': 'byte'}, ckpt)
    [text] = sample.main([f'--init_from={ckpt}', '--device=cpu', '--start=ab', '--num_samples=1',
                          '--max_new_tokens=6', '--temperature=0'])
    assert text == 'ab' + '\x00' * 6

# -----------------------------------------------------------------------------
# ARC-Easy: ties go to the first choice


class ByteEnc:
    eot = 256

    def encode(self, text):
        return list(text.encode('utf-8'))


def test_arc_ties_go_to_the_first_choice():
    """A uniform model: every continuation token has log-prob -ln 257, so a choice of n
    characters (plus the leading space) scores -(n + 1) ln 257, -(n + 1)/n ln 257 per character.
    acc picks the shortest, acc_norm the longest; equal lengths tie exactly, and the first wins."""
    items = [{'prompt': 'Q: a?\nAnswer:', 'choices': ['ab', 'cd', 'ef'], 'gold': 2},
             {'prompt': 'Q: b?\nAnswer:', 'choices': ['abc', 'de', 'fg'], 'gold': 2},
             {'prompt': 'Q: c?\nAnswer:', 'choices': ['x', 'yyy', 'zzz'], 'gold': 1}]
    r = evals.arc_easy_accuracy(lambda idx: torch.zeros(*idx.shape, 257), ByteEnc(), items, batch_size=2)
    lp = -math.log(257)
    assert r['logprobs'] == [pytest.approx([(len(c) + 1) * lp for c in it['choices']]) for it in items]
    assert r['pred'] == [0, 1, 0] and r['pred_norm'] == [0, 0, 1]
    assert r['acc'] == pytest.approx(0.0) and r['acc_norm'] == pytest.approx(1 / 3)
    for it, lps, p, pn in zip(items, r['logprobs'], r['pred'], r['pred_norm']):  # numpy's argmax: the first
        assert p == int(np.argmax(lps)) and pn == int(np.argmax([v / len(c) for v, c in zip(lps, it['choices'])]))
