"""
The fast paths (fast/) against the plain methods of residuals.py they replace, driven by
fast.FAST_PATHS: every fast path on random inputs, in fp64, fp32 and under bf16 autocast,
forward and backward (every input and parameter gradient), eager and under torch.compile;
the start-up guard (`fast.setup`) against edits of the plain code; and train.py refusing an
edited residuals.py with --fast=True. CPU; the CUDA-only paths skip without CUDA or their
package.

    python -m pytest tests/test_fast.py -q
"""

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import fast  # noqa: E402
import residuals  # noqa: E402
from fast import moda, streams  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

MODES = ('fp64', 'fp32', 'bf16')  # bf16: fp32 weights, the inputs the model gives under bf16 autocast
TOL = {'fp64': 1e-10, 'fp32': 1e-4, 'bf16': 2e-2}  # max error relative to the largest plain entry
B, T, D, N_SRC, M, S = 2, 5, 32, 4, 4, 3       # batch, tokens, width, AttnRes sources, streams, MoDA slots


def scheme_of(path):
    """The registry name whose model runs `path`'s plain method (the class or a subclass)."""
    names = {residuals.AttnRes: 'attnres', residuals.BlockAttnRes: 'blockattnres', residuals.MHC: 'mhc',
             residuals.MultiStream: 'hc', residuals.HC: 'hc', residuals.MoDA: 'moda'}
    return names[path.scheme]


def make(residual, dtype=torch.float32, device='cpu', n_layer=2, **kw):
    """A tiny model (GQA: 4 query heads, 2 key/value heads) with every parameter random."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_embd=D, n_head=4, n_kv_head=2,
                          residual=residual, **kw))
    fast.randomise(model)
    return model.to(device=device, dtype=dtype)


def randn(*shape, dtype, device, g, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)


def path_inputs(res, method, mode, device, model=None):
    """(args, leaves) for `res.<method>(*args)`: random inputs in the dtypes the model hands the
    method in `mode`, and the tensors whose gradients are compared (inputs and parameters; a
    block-level method's: also its backbone block's, `model.blocks[b]`); `model` (res's), for the
    methods that call its blocks."""
    g = torch.Generator().manual_seed(1)
    wide = torch.float64 if mode == 'fp64' else torch.float32
    low = torch.bfloat16 if mode == 'bf16' else wide

    def t(*shape, dtype=wide, scale=1.0):
        return randn(*shape, dtype=dtype, device=device, g=g, scale=scale).requires_grad_()

    if method == 'read':  # the fp32 embedding, then the sublayer outputs (bf16 under autocast)
        mixer = res.layers[0].mlp_mix
        sources = [t(B, T, D, dtype=wide if i == 0 else low, scale=0.5 + i) for i in range(N_SRC)]
        return (sources, mixer), [*sources, mixer.query, mixer.key_norm.weight]
    if method == 'read_at':  # Block AttnRes: the embedding and frozen block sums, all fp32 (the
        # embedding's dtype), and the running sum P; read k = 3 (blocks of 2: not a boundary)
        mixer = res.layers[1].mlp_mix
        sources = tuple(t(B, T, D, scale=0.5 + i) for i in range(N_SRC - 1))
        partial = t(B, T, D, scale=2.0)
        return (sources, partial, 3, mixer, 1, 1), [*sources, partial, mixer.query, mixer.key_norm.weight]
    if method == 'block' and isinstance(res, residuals.MoDA):  # position 1: reads 2 depth slots, writes 2
        x, hd = t(B, T, D), D // 4
        K = tuple(t(B, 2, T, hd, dtype=low, scale=2.0) for _ in range(2)) + (torch.zeros(B, 2, T, hd, dtype=wide),) * 2
        V = tuple(t(B, 2, T, hd, dtype=low) for _ in range(2)) + (torch.zeros(B, 2, T, hd, dtype=wide),) * 2
        return ((x, K, V, 1), 0, model.blocks[0], (model.rope_cos[:T], model.rope_sin[:T])), \
            [x, *K[:2], *V[:2], *res.parameters(), *model.blocks[0].parameters()]
    if method == 'block':  # Block AttnRes's block 0 on the embedding: its MLP read is fused with P + f
        x = t(B, T, D)
        return (res.begin(x), 0, model.blocks[0], (model.rope_cos[:T], model.rope_sin[:T])), \
            [x, *res.parameters(), *model.blocks[0].parameters()]
    if method == 'coefficients':  # the streams stay fp32: the routing runs with autocast off
        route = res.layers[0].mlp_route
        H = t(B, T, M, D)
        return (H, route), [H, *route.parameters()]
    if method == 'read_streams':
        H, r = t(B, T, M, D), t(B, T, M)
        return (H, r), [H, r]
    if method == 'write_streams':
        H, Mx, w, y = t(B, T, M, D), t(B, T, M, M, scale=0.5), t(B, T, M), t(B, T, D)
        return (H, Mx, w, y), [H, Mx, w, y]
    if method == 'block':  # a whole block: the state it reads, block 0 of 2 (its last step plans block 1's read)
        b, layer = 0, model.blocks[0]
        rope = (model.rope_cos[:T], model.rope_sin[:T])
        params = [*res.parameters(), *layer.parameters()]
        H = t(B, T, M, D)
        return (H, b, layer, rope), [H, *params]
    if method == 'attention':  # q, k, v after RoPE and the depth slots, in the branch's dtype
        hd = D // 4
        q, k, v = t(B, 4, T, hd, dtype=low, scale=2.0), t(B, 2, T, hd, dtype=low, scale=2.0), t(B, 2, T, hd, dtype=low)
        dk, dv = t(B, 2, T, S, hd, dtype=low, scale=2.0), t(B, 2, T, S, hd, dtype=low)
        return (q, k, v, dk, dv), [q, k, v, dk, dv]
    raise KeyError(f"no random inputs for {method}: add them here to test its fast path")


# the multi-stream routing runs with autocast off (MultiStream.sublayer), on fp32 streams
ROUTING = {'coefficients', 'read_streams', 'write_streams'}


def outputs(out):
    """The float tensors of a method's output (read_at: the sources, P, z)."""
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def forward_backward(fn, res, args, leaves, mode, device, which, autocast_off=False, trained=0):
    """Outputs and gradients of a fixed random weighting of the outputs (which='all') or of
    the output number `trained` alone ('first': AttnRes training reads z only, so no gradient
    reaches a)."""
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mode == 'bf16'):
        with residuals.no_autocast(args[0]) if autocast_off else contextlib.nullcontext():
            out = fn(res, *args)
    outs = outputs(out)
    g = torch.Generator().manual_seed(2)
    used = outs if which == 'all' else [out[trained] if isinstance(out, tuple) else out]
    loss = sum((o.double() * randn(*o.shape, dtype=torch.float64, device=device, g=g)).sum() for o in used)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def rel_err(have, want, floor=1e-30):
    """The largest error relative to the largest entry of `want` (at least `floor`)."""
    return ((have.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(floor)).item()


def available(path):
    return torch.cuda.is_available() and fast.available(path, 'cuda') if path.cuda_only else True


def configs(path):
    """The scheme options the fast path maps exactly (mHC: both Sinkhorn orders; Block AttnRes:
    one block of all 4 sublayers, so that block 0's MLP read is fused with its running sum)."""
    options = [{'mhc_sinkhorn': 'liger'}, {'mhc_sinkhorn': 'plain'}] if path.scheme is residuals.MHC else \
        [{'attnres_blocks': 1}] if path.scheme is residuals.BlockAttnRes else [{}]
    return [kw for kw in options if path.applies(GPTConfig(residual=scheme_of(path), **kw))]


CASES = [pytest.param(p, kw, id=f"{p.name}-{'-'.join(map(str, kw.values())) or 'default'}")
         for p in fast.FAST_PATHS for kw in configs(p)]


@pytest.mark.parametrize('compiled', [False, True], ids=['eager', 'compiled'])
@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('path,cfg_kw', CASES)
def test_fast_path_matches_the_plain_method(path, cfg_kw, mode, compiled):
    """Outputs (shape, dtype, values) and every gradient of the fast path against the plain
    method, on a model with random parameters, eager or with the fast path compiled."""
    if not available(path):
        pytest.skip(f"{path.name} needs CUDA and {path.package}")
    if path.cuda_only and mode == 'fp64':
        pytest.skip("the CUDA kernels run fp32 and bf16")
    device = 'cuda' if path.cuda_only else 'cpu'
    model = make(scheme_of(path), torch.float64 if mode == 'fp64' else torch.float32, device, **cfg_kw)
    res = model.residual
    if path.method == 'block':
        model.rope_cos, model.rope_sin = (r.to(model.lm_head.weight.dtype) for r in (model.rope_cos, model.rope_sin))
    plain = getattr(type(res), path.method)
    impl = path.impl
    if compiled:
        torch._dynamo.reset()
        impl = torch.compile(path.impl, backend='aot_eager')
    off = path.method in ROUTING
    tol = TOL[mode] if not (path.cuda_only and mode == 'fp32') else 2e-3  # what fast.check allows on CUDA
    for which in ('all', 'first'):
        args, leaves = path_inputs(res, path.method, mode, device, model)
        want_out, want_grads = forward_backward(plain, res, args, leaves, mode, device, which, off, path.output)
        have_out, have_grads = forward_backward(impl, res, args, leaves, mode, device, which, off, path.output)
        assert len(have_out) == len(want_out)
        for i, (have, want) in enumerate(zip(have_out, want_out)):
            assert have.shape == want.shape and have.dtype == want.dtype, f"output {i}"
            assert rel_err(have, want) <= tol, f"output {i}: relative error {rel_err(have, want):.1e}"
        # each gradient relative to its largest entry, floored at 1e-3 of the largest gradient entry of
        # all, as fast.check: a gate's gradient small by cancellation (mHC's alpha_res: ~1e-19 of the
        # others once the Sinkhorn rounds converge) carries the rounding of its larger terms
        floor = 1e-3 * max(w.double().abs().max().item() for w in want_grads if w is not None)
        for i, (have, want) in enumerate(zip(have_grads, want_grads)):
            if have is None or want is None:  # an input the used outputs do not reach: None, or zeros once compiled
                other = want if have is None else have
                assert other is None or not other.any(), f"gradient {i} ({which}): present in one form only"
                continue
            assert have.dtype == want.dtype, f"gradient {i} ({which})"
            err = rel_err(have, want, floor)
            assert err <= tol, f"gradient {i} ({which}): relative error {err:.1e}"


def test_every_fast_path_has_inputs_and_replaces_a_plain_method():
    for p in fast.FAST_PATHS:
        assert callable(getattr(p.scheme, p.method, None)), p.name
        model = make(scheme_of(p), **(configs(p) or [{}])[0])
        path_inputs(model.residual, p.method, 'fp32', 'cpu', model)  # raises KeyError for a method without inputs


@pytest.mark.parametrize('order,eps', [('liger', residuals.LIGER_SINKHORN_EPS), ('plain', 0.0), ('liger', 1e-2)])
@pytest.mark.parametrize('iters', [1, 2, 20])
def test_torch_sinkhorn_matches_the_plain_one(order, eps, iters):
    """The Sinkhorn rounds of the fused stream steps (fast.streams.sinkhorn_steps, and their
    backward by `sinkhorn_backward` from the recorded history) against residuals.sinkhorn and
    its autograd, fp64, on logits wide enough (+-20) that eps and the order both matter."""
    g = torch.Generator().manual_seed(3)
    z = (20 * torch.randn(3, 5, M, M, generator=g, dtype=torch.float64)).requires_grad_()
    w = torch.randn(3, 5, M, M, generator=g, dtype=torch.float64)
    spec = streams.Spec('mhc', M, 1e-6, iters, order, eps)
    want = residuals.sinkhorn(z, iters, order, eps)
    have, steps = streams.sinkhorn_steps(z.detach(), spec)
    torch.testing.assert_close(have, want, rtol=1e-12, atol=1e-14)
    gw, = torch.autograd.grad((want * w).sum(), z)
    torch.testing.assert_close(streams.sinkhorn_backward(steps, w, spec), gw, rtol=1e-10, atol=1e-12)


def test_moda_sdpa_bf16_corrects_the_rounded_shift():
    """Under bf16 autocast, on scores that bf16 holds exactly (small integers, hd = 16) and large
    enough (up to ~16) that lse rounds coarsely, with depth and sequence weights of one size:
    the null-key form is as close to fp64 as the plain code (both round only q / sqrt(hd) and
    the output). Without the shift's rounding correction, or with lse in bf16: 1.6x the error."""
    from fast.moda import sdpa_attention
    g = torch.Generator().manual_seed(0)
    Bq, H, Hkv, Tq, hd, Sq = 2, 4, 2, 64, 16, 6

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=g).float()
    q = ints(Bq, H, Tq, hd)
    own = q.view(Bq, Hkv, 2, Tq, hd)[:, :, 0]            # a query's own key and depth keys score high
    k, dk = ints(Bq, Hkv, Tq, hd) + own, ints(Bq, Hkv, Tq, Sq, hd) + own.unsqueeze(3)
    v, dv = torch.randn(Bq, Hkv, Tq, hd, generator=g), torch.randn(Bq, Hkv, Tq, Sq, hd, generator=g)
    bf = [t.bfloat16() for t in (q, k, v, dk, dv)]
    ref = residuals.MoDA.attention(None, *[t.double() for t in bf])

    def err(fn):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            y = fn(None, *bf)
        assert y.dtype == torch.bfloat16
        return ((y.double() - ref).norm() / ref.norm()).item()
    plain = err(residuals.MoDA.attention)   # 0.0028 (measured)
    assert plain < 0.004
    assert err(sdpa_attention) < 1.1 * plain


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_moda_causal_attention_with_its_logsumexp_on_explicit_scores_equals_the_flash_kernel(dtype):
    """fast.moda.causal_lse's explicit-scores form (CUDA in fp32 / fp64, where no flash kernel runs)
    against the CPU's flash kernel: o and lse forward; backward given another output y and
    logsumexp (the joint softmax's: lse_seq + 0.7, y = 0.6 o + noise), dq, dk and dv equal, and
    equal to an independent hand-written form (P = exp(s - lse), dS = P (dy . v - dy . y))."""
    from fast.moda import causal_lse, causal_lse_backward
    g = torch.Generator().manual_seed(1)
    q, k, v, dy, noise = (torch.randn(2, 3, 11, 8, generator=g, dtype=dtype) for _ in range(5))
    scale = 8 ** -0.5
    o, lse, how = causal_lse(q, k, v, scale, kernel='cpu')
    o_m, lse_m, how_m = causal_lse(q, k, v, scale, kernel='math')
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o_m, o, **tol)
    torch.testing.assert_close(lse_m, lse, **tol)
    y, lse_j = 0.6 * o + 0.1 * noise, lse + 0.7
    flash = causal_lse_backward(dy, q, k, v, y, lse_j, scale, how)
    math_ = causal_lse_backward(dy, q, k, v, y, lse_j, scale, how_m)
    s = (q @ k.transpose(-1, -2)) * scale + torch.full((11, 11), float('-inf'), dtype=dtype).triu(1)
    P = torch.exp(s - lse_j.unsqueeze(-1))
    dS = P * (dy @ v.transpose(-1, -2) - (dy * y).sum(-1, keepdim=True))
    hand = (dS @ k * scale, dS.transpose(-1, -2) @ q * scale, P.transpose(-1, -2) @ dy)
    for a, b, c in zip(flash, math_, hand):
        torch.testing.assert_close(b, a, **tol)
        torch.testing.assert_close(c, a, **tol)


class Outputs(TorchDispatchMode):
    """Records (dtype, numel) of every tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(t.dtype, t.numel()) for t in (out if isinstance(out, (tuple, list)) else [out])
                      if isinstance(t, torch.Tensor)]
        return out


def test_moda_sdpa_makes_no_fp32_copy_of_the_depth_slots():
    """Under bf16 autocast the fast path makes no fp32 tensor as large as the depth keys
    (B, H_kv, T, S, hd), forward or backward: it reads them in bf16, as the plain code does."""
    from fast.moda import sdpa_attention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g).bfloat16().requires_grad_()
    k, v = [torch.randn(2, 2, 16, 8, generator=g).bfloat16().requires_grad_() for _ in range(2)]
    dk, dv = [torch.randn(2, 2, 16, 6, 8, generator=g).bfloat16().requires_grad_() for _ in range(2)]
    with Outputs() as mode:
        with torch.autocast('cpu', dtype=torch.bfloat16):
            y = sdpa_attention(None, q, k, v, dk, dv)
        y.float().sum().backward()
    assert not [n for dtype, n in mode.made if dtype == torch.float32 and n >= dk.numel()]
    assert dk.grad.dtype == torch.bfloat16


# -----------------------------------------------------------------------------
# the start-up guard

def hot_mix(self, V, mixer):
    """AttnRes.mix with a softmax temperature of 0.5: an edit a fast read would hide."""
    V = V.to(torch.promote_types(V.dtype, torch.float32))
    with residuals.no_autocast(V):
        keys = F.rms_norm(V, (V.size(-1),), mixer.key_norm.weight.to(V.dtype), mixer.key_norm.eps)
        a = torch.softmax(keys @ mixer.query.to(V.dtype) / 0.5, dim=0)
        z = torch.einsum('nbt,nbtd->btd', a, V)
    return z, a


def one_round_fewer(monkeypatch):
    plain = residuals.sinkhorn
    monkeypatch.setattr(residuals, 'sinkhorn', lambda z, iters, order, eps, rounds=None:
                        plain(z, max(iters - 1, 1), order, eps, rounds))


def mix_transposed(monkeypatch):
    plain = residuals.MultiStream.write_streams
    monkeypatch.setattr(residuals.MultiStream, 'write_streams',
                        lambda self, H, Mx, w, y: plain(self, H, Mx.transpose(-1, -2), w, y))


def read_mean(self, H, A_m):
    """MultiStream.read_streams as a mean over the streams instead of their sum."""
    return torch.einsum('bts,btsd->btd', A_m, H) / H.size(-2)


def hc_linear(self, H, route):
    """HC.coefficients without the tanh: linear dynamic coefficients."""
    H_bar = F.rms_norm(H, (H.size(-1),), eps=1e-8)
    A = route.static_alpha + route.alpha_scale * (H_bar @ route.dynamic_alpha)
    beta = route.static_beta + route.beta_scale * (H_bar @ route.dynamic_beta)
    return A[..., 0].contiguous(), A[..., 1:].contiguous(), beta


def mhc_post_halved(monkeypatch):
    """MHC.coefficients with H_post = sigmoid(.), not 2 sigmoid(.)."""
    plain = residuals.MHC.coefficients
    monkeypatch.setattr(residuals.MHC, 'coefficients', lambda self, H, route: (
        lambda c: (c[0], c[1], c[2] / 2))(plain(self, H, route)))


MODA_ATTENTION, MODA_BLOCK = residuals.MoDA.attention, residuals.MoDA.block  # the plain methods, before any edit


def moda_hot_depth(self, q, k, v, depth_k, depth_v):
    """MoDA.attention with the depth keys doubled: a temperature of 0.5 on the depth scores."""
    return MODA_ATTENTION(self, q, k, v, 2 * depth_k, depth_v)


def moda_no_ffn_slot(self, state, b, layer, rope):
    """MoDA.block whose FFN-input slot (2p + 1) is written as zero: depth_kv unused."""
    h, K, V, p = MODA_BLOCK(self, state, b, layer, rope)
    j = 2 * p - 1
    return h, residuals.put_slot(K, j, torch.zeros_like(K[j])), residuals.put_slot(V, j, torch.zeros_like(V[j])), p


def read_halved(self, sources, mixer):
    """AttnRes.read with its output halved: an edit of the replaced method itself."""
    z, a = residuals.AttnRes.mix(self, torch.stack(sources), mixer)
    return 0.5 * z, a


def read_at_no_freeze(self, sources, partial, k, mixer, b, j):
    """BlockAttnRes.read_at that never freezes P: an edit of Block AttnRes's own read."""
    z, a = self.read(sources if partial is None else sources + (partial,), mixer)
    return sources, partial, z, self.boundary(k)


EDITS = [  # (scheme, edit, the fast path that must refuse it, the plain method it replaces, what was edited)
    ('attnres', lambda mp: mp.setattr(residuals.AttnRes, 'mix', hot_mix), 'attnres_group_torch', 'AttnRes.read',
     'AttnRes.mix'),
    ('attnres', lambda mp: mp.setattr(residuals.AttnRes, 'read', read_halved), 'attnres_group_torch', 'AttnRes.read',
     'AttnRes.read'),
    ('blockattnres', lambda mp: mp.setattr(residuals.AttnRes, 'mix', hot_mix), 'blockattnres_group_torch',
     'BlockAttnRes.read_at', 'AttnRes.mix'),
    ('blockattnres', lambda mp: mp.setattr(residuals.BlockAttnRes, 'read_at', read_at_no_freeze),
     'blockattnres_group_torch', 'BlockAttnRes.read_at', 'BlockAttnRes.read_at'),
    ('mhc', one_round_fewer, 'mhc_streams_torch', 'MHC.block', 'sinkhorn'),
    ('mhc', mhc_post_halved, 'mhc_streams_torch', 'MHC.block', 'MHC.coefficients'),
    ('mhc', mix_transposed, 'mhc_streams_torch', 'MHC.block', 'MultiStream.write_streams'),
    ('hc', mix_transposed, 'hc_streams_torch', 'HC.block', 'MultiStream.write_streams'),
    ('hc', lambda mp: mp.setattr(residuals.MultiStream, 'read_streams', read_mean), 'hc_streams_torch', 'HC.block',
     'MultiStream.read_streams'),
    ('hc', lambda mp: mp.setattr(residuals.HC, 'coefficients', hc_linear), 'hc_streams_torch', 'HC.block',
     'HC.coefficients'),
    ('moda', lambda mp: mp.setattr(residuals.MoDA, 'attention', moda_hot_depth), 'moda_depth_cache', 'MoDA.block',
     'MoDA.attention'),
    ('moda', lambda mp: mp.setattr(residuals.MoDA, 'block', moda_no_ffn_slot), 'moda_depth_cache', 'MoDA.block',
     'MoDA.block'),
]


def logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]


@pytest.mark.parametrize('residual,edit,name,method,edited', EDITS, ids=[e[0] + '-' + e[2] for e in EDITS])
def test_the_guard_refuses_an_edit_the_fast_path_would_hide(residual, edit, name, method, edited, monkeypatch):
    """The guard's one line names the fast path, the method it replaces and the plain method
    that was edited (a student edits AttnRes.mix, which the replaced AttnRes.read calls)."""
    model = make(residual, torch.float64)  # fp64: a converged Sinkhorn moves the loss by ~1e-7 only
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    before = logits(model, idx)
    edit(monkeypatch)
    with pytest.raises(fast.FastPathMismatch) as e:
        fast.setup(model, True, 'cpu')
    msg = str(e.value)
    assert name in msg and f"residuals.{method}" in msg and '--fast=False' in msg and '\n' not in msg
    assert f"residuals.py's {edited} was edited" in msg, msg  # the edited method, and only it
    assert not any(k in vars(model.residual) for k in ('read', 'read_at', 'block'))
    assert fast.setup(model, False, 'cpu') == []
    assert rel_err(logits(model, idx), before) > 1e-7  # with fast off the edit is what runs


@pytest.mark.parametrize('compiled', [False, True], ids=['eager', 'compiled'])
@pytest.mark.parametrize('residual,edit,name,method,edited', EDITS, ids=[e[0] + '-' + e[4] for e in EDITS])
def test_an_edit_the_fast_path_replaces_trains_with_fast_paths_off(residual, edit, name, method, edited, compiled,
                                                                   monkeypatch):
    """A student's edit of a method a fast path replaces (AttnRes.mix, AttnRes.read,
    BlockAttnRes.read_at; MultiStream.read_streams / write_streams, HC.coefficients,
    MHC.coefficients, the Sinkhorn function), with fast paths off: the edited code is what trains,
    eagerly and compiled (regional, aot_eager): a training step's loss and the gradients of block
    1's routing parameters move off the unedited model's."""
    torch._dynamo.reset()
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))

    def step():  # mHC in 3 Sinkhorn rounds: at 20 the rounds have converged and one fewer moves the loss ~1e-6
        model = make(residual, **({'mhc_sinkhorn_iters': 3} if residual == 'mhc' else {}))
        if compiled:
            model.compile(backend='aot_eager')
        assert fast.setup(model, False, 'cpu') == []
        loss = model(idx, idx)[1]
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.residual.layers[1].parameters()
                                       if p.grad is not None])
    before, g_before = step()
    edit(monkeypatch)
    after, g_after = step()
    assert abs(after - before) > 1e-6 and not torch.allclose(g_after, g_before)


@pytest.mark.parametrize('residual,cfg_kw,names', [
    ('attnres', {}, ['attnres_group_torch']),
    ('blockattnres', {}, ['blockattnres_group_torch', 'blockattnres_sum_torch']),
    ('hc', {}, ['hc_streams_torch']),
    ('mhc', {}, ['mhc_streams_torch']),
    ('mhc', {'mhc_sinkhorn': 'plain'}, ['mhc_streams_torch']),
    ('moda', {}, ['moda_depth_cache', 'moda_sdpa']),
    ('preln', {}, []),
])
def test_setup_enables_the_fast_paths_and_keeps_the_step(residual, cfg_kw, names):
    """fast.setup on the CPU (guard on): the paths that apply, put in place, and the same loss and
    gradients as the plain model, in fp32 and under bf16 autocast; 'auto' is off on the CPU."""
    model = make(residual, **cfg_kw)
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    assert fast.setup(model, 'auto', 'cpu') == []

    def step(bf16):
        model.zero_grad(set_to_none=True)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=bf16):
            loss = model(idx, idx)[1]
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    plain = [step(False), step(True)]
    paths = fast.setup(model, True, 'cpu')
    assert [p.name for p in paths] == names
    for p in paths:
        assert getattr(model.residual, p.method).__func__ is p.impl
    assert fast.describe(paths).startswith('fast paths: ' + (names[0] if names else 'off'))
    for want, have, tol in zip(plain, [step(False), step(True)], (1e-4, 2e-2)):
        floor = 1e-3 * max(t.abs().max().item() for t in want)  # as fast.check: small-by-cancellation gradients
        for a, b in zip(have, want):
            assert (a - b).abs().max().item() <= tol * max(b.abs().max().item(), floor)
    fast.disable(model)
    assert not any(p.method in vars(model.residual) for p in fast.FAST_PATHS)


def test_resolve():
    assert fast.resolve('auto', 'cpu') is False and fast.resolve('auto', 'cuda') is True
    assert fast.resolve('True', 'cpu') is True and fast.resolve(False, 'cuda') is False
    with pytest.raises(ValueError, match='fast must be'):
        fast.resolve('yes', 'cpu')


# -----------------------------------------------------------------------------
# train.py on an edited copy of the repository

TINY = ['--device=cpu', '--compile=False', '--residual=attnres', '--n_layer=2', '--n_embd=32', '--n_head=2',
        '--block_size=32', '--batch_size=4', '--gradient_accumulation_steps=1', '--log_interval=1',
        '--eval_iters=1', '--max_iters=4', '--eval_interval=4', '--learning_rate=1e-2']
PLAIN_SOFTMAX = 'a = torch.softmax(keys @ mixer.query.to(V.dtype), dim=0)'


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A byte-level corpus: a repeated short text with some noise."""
    d = tmp_path_factory.mktemp('data')
    rng = np.random.default_rng(0)
    text = np.frombuffer(b'the quick brown fox jumps over the lazy dog. ' * 200, dtype=np.uint8).astype(np.uint16)
    tokens = np.where(rng.random(text.size) < 0.05, rng.integers(0, 256, size=text.size, dtype=np.uint16), text)
    tokens[:8000].tofile(d / 'train.bin')
    tokens[8000:].tofile(d / 'val.bin')
    (d / 'meta.json').write_text(json.dumps({'vocab_size': 257, 'tokenizer': 'byte'}))
    return d


def copy_repo(dst):
    files = subprocess.run(['git', 'ls-files'], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)
    return dst


def train(repo, *args):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, 'train.py', *TINY, *args], cwd=repo, capture_output=True, text=True,
                          env=env, timeout=300)


def train_losses(out):
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    return [r['train_loss'] for r in rows if 'train_loss' in r]


def test_train_refuses_an_edited_read_with_fast_on(data_dir, tmp_path):
    """An edit of AttnRes.mix (softmax temperature 0.5) in a copy of the repository: train.py
    --fast=True stops at start-up with one line naming the fast path and --fast=False; with
    --fast=False the edited code trains, and its losses differ from the unedited copy's."""
    repo = copy_repo(tmp_path / 'repo')
    data = f'--data_dir={data_dir}'
    r = train(repo, data, f'--out_dir={tmp_path / "base"}', '--fast=False')
    assert r.returncode == 0, r.stderr[-3000:]
    base = train_losses(tmp_path / 'base')
    text = (repo / 'residuals.py').read_text()
    assert text.count(PLAIN_SOFTMAX) == 1
    (repo / 'residuals.py').write_text(text.replace(PLAIN_SOFTMAX, PLAIN_SOFTMAX.replace('), dim=0)', ') / 0.5, dim=0)')))

    r = train(repo, data, f'--out_dir={tmp_path / "fast"}', '--fast=True')
    assert r.returncode != 0
    named = [line for line in (r.stdout + r.stderr).splitlines() if 'attnres_group_torch' in line]
    assert len(named) == 1 and '--fast=False' in named[0] and 'AttnRes.read' in named[0], r.stderr[-3000:]
    assert 'AttnRes.mix' in named[0]  # the method the edit is in
    assert 'Traceback' not in r.stderr

    r = train(repo, data, f'--out_dir={tmp_path / "plain"}', '--fast=False')
    assert r.returncode == 0, r.stderr[-3000:]
    edited = train_losses(tmp_path / 'plain')
    assert len(edited) == len(base) == 4
    assert edited[0] == pytest.approx(base[0], abs=1e-6)  # zero queries at init: the temperature has no effect yet
    assert abs(edited[-1] - base[-1]) > 1e-4


# -----------------------------------------------------------------------------
# the guard's own faults: each test plants a fast path the guard must refuse

def planted(name, method, impl, scheme=residuals.AttnRes):
    return fast.FastPath(name, scheme, method, impl, 'planted')


def read_scaled(self, sources, mixer):
    """AttnRes.read with z off by 1e-4 relative: inside fp32's reach, far outside fp64's."""
    z, a = residuals.AttnRes.read(self, sources, mixer)
    return z * (1 + 1e-4), a


class GradScaled(torch.autograd.Function):
    """Identity forward; the gradient times 1.01."""

    @staticmethod
    def forward(ctx, z):
        return z.view_as(z)

    @staticmethod
    def backward(ctx, g):
        return 1.01 * g


def read_backward_wrong(self, sources, mixer):
    """AttnRes.read with the exact forward and a gradient 1% too large."""
    z, a = residuals.AttnRes.read(self, sources, mixer)
    return GradScaled.apply(z), a


def read_rounded_under_autocast(self, sources, mixer):
    """The grouped read, z rounded to bf16 whenever autocast is on: exact in fp64 and fp32."""
    z, a = fast.depth_read.read(fast.depth_read.TorchOps)(self, sources, mixer)
    return (z.bfloat16().float() if torch.is_autocast_enabled(z.device.type) else z), a


def moda_bf16_softmax(self, q, k, v, depth_k, depth_v):
    """MoDA.attention on SDPA with the depth scores' lse and softmax in q's dtype (bf16 under
    autocast, where the plain code takes its softmax in fp32) and the rounded shift uncorrected."""
    B, H, T, hd = q.shape
    Hkv, scale = k.size(1), hd ** -0.5
    d = torch.einsum('bkgtd,bktsd->bkgts', q.view(B, Hkv, H // Hkv, T, hd), depth_k) * scale
    lse = torch.logsumexp(d, dim=-1).reshape(B, H, T)                               # bf16
    y_dep = torch.einsum('bkgts,bktsd->bkgtd', torch.softmax(d, dim=-1), depth_v).reshape(B, H, T, hd)
    q1 = F.pad(torch.cat((q, (-lse / scale).to(q.dtype).unsqueeze(-1)), dim=-1), (0, 0, 1, 0))
    k1 = F.pad(torch.cat((k, k.new_ones(B, Hkv, T, 1)), dim=-1), (0, 0, 1, 0))
    v1 = F.pad(v, (0, 1, 1, 0)) + F.pad(v.new_ones(1, 1, 1, 1), (hd, 0, 0, T))
    o = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, scale=scale, enable_gqa=H != Hkv)[:, :, 1:]
    return (o[..., :hd] + o[..., hd:] * y_dep).to(q.dtype)


def test_the_guard_refuses_an_error_of_1e_4():
    """fp64 twin: a read 1e-4 off is refused (the tolerance is 1e-9, not 1e-3)."""
    with pytest.raises(fast.FastPathMismatch, match=r'planted_scaled .*relative error .* > 1e-09'):
        fast.check(make('attnres'), [planted('planted_scaled', 'read', read_scaled)], 'cpu')


def test_the_guard_refuses_a_wrong_backward():
    """The forward exact, the gradient 1% off: refused on a gradient, not on the logits."""
    with pytest.raises(fast.FastPathMismatch) as e:
        fast.check(make('attnres'), [planted('planted_backward', 'read', read_backward_wrong)], 'cpu')
    assert 'planted_backward' in str(e.value) and '(logits:' not in str(e.value)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_the_guard_refuses_rounding_the_plain_code_does_not_do(dtype):
    """Under the run's autocast: a read that rounds its output (the plain read keeps fp32) and a
    MoDA attention whose depth softmax runs in bf16 are refused, each in one line; both pass the
    fp64 twin, and the real fast paths pass under the same autocast."""
    model = make('attnres')
    bad = planted('planted_round', 'read', read_rounded_under_autocast)
    fast.check(model, [bad], 'cpu')                          # fp64: exact
    with pytest.raises(fast.FastPathMismatch, match=r'planted_round .* autocast: output 0 is .* from fp64'):
        fast.check(model, [bad], 'cpu', torch.bfloat16)
    model = make('moda')
    bad = planted('planted_moda', 'attention', moda_bf16_softmax, residuals.MoDA)
    fast.check(model, [bad], 'cpu')
    with pytest.raises(fast.FastPathMismatch) as e:
        fast.check(model, [bad], 'cpu', dtype)
    assert 'planted_moda' in str(e.value) and 'logsumexp' in str(e.value) and '\n' not in str(e.value)
    for residual in ('attnres', 'blockattnres', 'mhc', 'hc', 'moda'):
        model = make(residual)
        assert fast.setup(model, True, 'cpu', dtype=dtype)


def test_the_twin_reads_every_branch_of_every_scheme():
    """The start-up twin runs each scheme's every branch: Block AttnRes reads a partial sum
    (blocks of 2 sublayers) beside at least two frozen block sums; MoDA reads the depth slots
    of both kinds (attention k/v, depth_kv) of at least two earlier blocks; GQA as configured."""
    for residual in ('attnres', 'blockattnres', 'hc', 'mhc', 'moda'):
        cfg = fast.twin_config(GPTConfig(residual=residual, n_layer=12, n_embd=96, n_head=6, n_kv_head=2))
        assert cfg.n_layer >= 3 and cfg.n_kv_head == 2 and cfg.n_head == 6, residual
    twin = GPT(fast.twin_config(GPTConfig(residual='blockattnres', n_layer=12, attnres_blocks=8)))
    idx = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), twin.residual.trace() as tape:
        twin(idx)
    reads = [(int(r['current']), r['weights'].size(0)) for r in tape]
    assert any(cur >= 0 for cur, _ in reads)                        # a partial sum is read
    assert any(cur >= 3 for cur, n in reads)                        # beside the embedding and 2 block sums
    depth_slots = []
    twin = GPT(fast.twin_config(GPTConfig(residual='moda', n_layer=12)))
    plain = residuals.MoDA.attention
    twin.residual.attention = lambda q, k, v, dk, dv: depth_slots.append(dk.size(3)) or plain(twin.residual, q, k, v,
                                                                                             dk, dv)
    with torch.no_grad():
        twin(idx)
    assert max(depth_slots) >= 4


@pytest.mark.parametrize('residual,cfg_kw,names', [
    ('attnres', {}, ['attnres_group_triton']),
    ('blockattnres', {}, ['blockattnres_group_triton', 'blockattnres_sum_triton']),
    ('hc', {}, ['hc_streams_triton']),
    ('mhc', {}, ['mhc_streams_triton']),
    ('mhc', {'mhc_sinkhorn': 'plain'}, ['mhc_streams_triton']),
    ('moda', {}, ['moda_depth_cache_triton', 'moda_sdpa']),
])
def test_the_cuda_kernel_is_preferred_where_two_paths_apply(residual, cfg_kw, names, monkeypatch):
    """With CUDA and both packages (faked), select takes the kernel over the torch form of the
    same method; on the CPU, with the packages, the torch forms."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: object() if name in ('triton', 'liger_kernel')
                        else real(name, *a))
    model = make(residual, **cfg_kw)
    assert [p.name for p in fast.select(model, 'cuda')] == names
    assert all(not p.cuda_only for p in fast.select(model, 'cpu'))


def test_fla_launch_configs_are_pinned(tmp_path, monkeypatch):
    """fla-core's three attnres kernels each have a launch config in fast/fla_configs/default in
    the form fla 0.6 reads (with Triton >= 3.5.1: kwargs, num_warps, num_stages, num_ctas), so
    its autotuner never runs; a device's own folder wins where measured."""
    from fast import attnres
    for k in attnres.FLA_KERNELS:
        cfg = json.loads((attnres.FLA_CONFIGS / 'default' / f'{k}.json').read_text())
        assert cfg['kernel_name'] == k
        assert set(cfg['default_config']) == {'kwargs', 'num_warps', 'num_stages', 'num_ctas'}
    assert sorted(p.stem for p in (attnres.FLA_CONFIGS / 'default').glob('*.json')) == sorted(attnres.FLA_KERNELS)
    assert attnres.fla_config_dir('NVIDIA H200') == attnres.FLA_CONFIGS / 'default'
    monkeypatch.setattr(attnres, 'FLA_CONFIGS', tmp_path)
    (tmp_path / 'NVIDIA_H200').mkdir()
    assert attnres.fla_config_dir('NVIDIA H200') == tmp_path / 'NVIDIA_H200'


def test_cast_once_gives_each_read_the_gradient_of_its_own_cast():
    """fla_read's one cast per source (fast.attnres.cast_once): three reads of one fp32 source
    through one bf16 copy give the source the gradient of three separate casts (sum of
    the three, by hand: 2 + 3 + 5 per entry) and one cast forward; a copy made without grad
    (an eval pass) or before an in-place change of the source is not handed out again."""
    from fast.attnres import cast_once
    v = torch.randn(4, 6, dtype=torch.float32, requires_grad=True)
    reads = [cast_once(v, torch.bfloat16) for _ in range(3)]
    assert all(r is reads[0] for r in reads) and reads[0].dtype == torch.bfloat16
    torch.testing.assert_close(reads[0].float(), v.detach().bfloat16().float(), rtol=0, atol=0)
    sum((r.float() * c).sum() for r, c in zip(reads, (2.0, 3.0, 5.0))).backward()
    torch.testing.assert_close(v.grad, torch.full_like(v, 10.0), rtol=0, atol=0)
    assert cast_once(v, torch.float32) is v
    w = torch.randn(3, dtype=torch.float32, requires_grad=True)
    with torch.no_grad():
        cast_once(w, torch.bfloat16)
    again = cast_once(w, torch.bfloat16)
    assert again.requires_grad
    again.float().sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(3), rtol=0, atol=0)
    u = torch.ones(3)
    first = cast_once(u, torch.bfloat16)
    u.mul_(2)
    torch.testing.assert_close(cast_once(u, torch.bfloat16).float(), torch.full((3,), 2.0), rtol=0, atol=0)
    assert first.float().eq(1).all()


def test_the_checked_code_is_the_plain_code():
    """fast.CHECKED_CODE holds the fingerprint of every plain method a fast path stands in for, as
    residuals.py has it: after a deliberate change of the plain code its line must be updated
    (`python -c "import fast; print(fast.current_code())"`), or the guard would name the wrong edit."""
    assert fast.current_code() == {k: fast.CHECKED_CODE.get(k) for k in fast.current_code()}


# -----------------------------------------------------------------------------
# the block-level fast paths in other orders, and planted errors the guard must refuse

def torch_block_paths():
    return {p.scheme: p for p in fast.FAST_PATHS if p.method == 'block' and not p.cuda_only}


@pytest.mark.parametrize('residual', ['hc', 'mhc', 'moda'])
def test_the_fused_blocks_follow_any_order(residual):
    """A probe's orders on the fp64 model, fast block against the plain one: blocks swapped (a step
    that planned the next read is not read: the next call makes its own; MoDA's last block, without
    depth_kv, at position 0: its FFN slot stays the zero begin made), a block skipped, and one state
    continued twice (the planned read is used by the first continuation that asks for it, the other
    computes its own; MoDA: the second continuation copies the slots into a cache of its own);
    logits and every gradient to 1e-10."""
    model = make(residual, torch.float64, n_layer=3)
    path = torch_block_paths()[type(model.residual)]
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))

    def run(fast_on):
        if fast_on:
            fast.enable(model, [path])
        try:
            model.zero_grad(set_to_none=True)
            outs = [model(idx, order=[2, 0, 1])[0], model(idx, order=[0, 1, 2], skip=(1,))[0]]
            res = model.residual
            state = res.begin(model.wte(idx))
            state = res.block(state, 0, model.blocks[0], (model.rope_cos[:12], model.rope_sin[:12]))
            rope = (model.rope_cos[:12], model.rope_sin[:12])
            a = res.block(state, 1, model.blocks[1], rope)
            b = res.block(state, 2, model.blocks[2], rope)          # the same state, continued again
            a = res.block(a, 2, model.blocks[2], rope)              # the first continuation, after the second
            outs += [model.head(res.end(a)), model.head(res.end(b))]
            sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs).backward()
            return [o.detach() for o in outs] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
        finally:
            fast.disable(model)
    want, have = run(False), run(True)
    assert len(want) == len(have)
    for a, b in zip(have, want):
        assert rel_err(a, b) <= 1e-10


def planted_ops(ops, old, new):
    """A copy of the class `ops` with the line `old` of its source replaced by `new` (a planted error)."""
    import inspect
    import textwrap
    src = textwrap.dedent(inspect.getsource(ops))
    assert src.count(old) == 1, old
    scope = dict(vars(sys.modules[ops.__module__]))
    exec(compile(src.replace(old, new), f'<planted {ops.__name__}>', 'exec'), scope)
    return scope[ops.__name__]


def test_the_guard_refuses_a_stream_gradient_missing_one_use():
    """The torch form of the stream steps with the read's share of the streams' gradient dropped
    (A_m (x) dx, one of the three uses of the streams): refused on the fp64 twin, in one line."""
    from fast import streams as st
    bad = planted_ops(st.TorchOps, "G += A_m.unsqueeze(-1) * dx.unsqueeze(-2)", "pass")
    for residual in ('hc', 'mhc'):
        model = make(residual)
        path = planted('planted_streams', 'block', st.block(bad), type(model.residual))
        with pytest.raises(fast.FastPathMismatch, match=r'planted_streams .*relative error') as e:
            fast.check(model, [path], 'cpu')
        assert '\n' not in str(e.value) and 'logits' not in str(e.value)  # the forward is exact: a gradient


def planted_moda(old, new):
    """fast/moda.py's cached_block with the line `old` of the module replaced by `new` (a planted error)."""
    import inspect
    from fast import moda
    src = inspect.getsource(moda)
    assert src.count(old) == 1, old
    scope = {'__name__': 'planted_moda'}
    exec(compile(src.replace(old, new), '<planted fast/moda.py>', 'exec'), scope)
    return planted('planted_moda', 'block', scope['cached_block'], residuals.MoDA)


@pytest.mark.parametrize('old,new,forward', [
    ("K = cache.K.view(N, -1, hd)[:, :S].to(q.dtype)", "K = cache.K.view(N, -1, hd)[:, 1:S + 1].to(q.dtype)", True),
    ("cache.K[:, :, :, j0 + i].copy_(slots[2 * i])", "cache.K[:, :, :, j0 + i].copy_(slots[2 * i - 2 * (j0 > 0)])",
     True),
    ("v = torch.bmm(self.A[:, r, j:j + n].transpose(1, 2).to(self.GY.dtype), self.GY[:, r])",
     "v = 1.01 * torch.bmm(self.A[:, r, j:j + n].transpose(1, 2).to(self.GY.dtype), self.GY[:, r])", False),
    ("g = grads[j0 + i][c]", "g = grads[max(j0 + i - 1, j0)][c]", False),
    ("a.mul_(_per_token(w, Hkv).unsqueeze(-1))", "pass", False),
], ids=['moda-depth-keys-read-one-slot-late', 'moda-a-key-slot-off-by-one', 'moda-depth-value-gradient-1.01x',
        'moda-slot-gradient-off-by-one', 'moda-depth-weights-not-joint'])
def test_the_guard_refuses_a_depth_cache_error(old, new, forward):
    """MoDA's depth cache with a planted error: a block reading the keys one slot late, a key written
    into the slot of the one before, the depth values' gradient 1% too large, a slot handed the
    gradient of the one before, the depth weights the backward uses left relative to the depth
    part's softmax (not the joint one's): refused on the fp64 twin in one line, on the logits when the forward is wrong,
    on a gradient (not the logits) when only the backward is."""
    model = make('moda')
    path = planted_moda(old, new)
    with pytest.raises(fast.FastPathMismatch, match=r'planted_moda .*relative error') as e:
        fast.check(model, [path], 'cpu')
    assert '\n' not in str(e.value) and ('logits' in str(e.value)) == forward, str(e.value)


def test_moda_depth_cache_state_holds_the_plain_blocks_slots():
    """After each block on the depth cache the state is the plain block's: h, and K and V tuples of
    2L slots whose entries equal the plain ones (the block's k and v in slot 2p, depth_kv's in
    2p + 1, zeros beyond), fp64, L = 4."""
    model = make('moda', n_layer=4).double()
    res, rope = model.residual, (model.rope_cos[:12], model.rope_sin[:12])
    x = torch.randn(B, 12, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    plain, have = res.begin(x), res.begin(x)
    for b, layer in enumerate(model.blocks):
        plain = residuals.MoDA.block(res, plain, b, layer, rope)
        have = moda.cached_block(res, have, b, layer, rope)
        assert len(have[1]) == len(have[2]) == 2 * 4 and have[3] == plain[3] == b + 1
        torch.testing.assert_close(have[0], plain[0])
        for j in range(8):
            torch.testing.assert_close(have[1][j], plain[1][j])
            torch.testing.assert_close(have[2][j], plain[2][j])


def test_moda_depth_cache_keeps_each_slot_once():
    """What autograd keeps for the backward (saved-tensor hooks, each storage once, weights
    excluded), fp32, L = 6: the plain blocks keep their stacks of the depth keys and values,
    sum_p 2p = L (L - 1) = 30 slots each; the depth cache keeps its 2L = 12 slots of each once,
    plus the readers' scaled queries and softmax weights (L G = 6 rows of hd and 2L floats a
    token and key/value head). The fast step keeps at least the 2 x (30 - 12) slots less, minus
    those two buffers."""
    L, Tn = 6, 12
    model = make('moda', n_layer=L)
    path = torch_block_paths()[residuals.MoDA]
    idx = torch.randint(0, 64, (B, Tn), generator=torch.Generator().manual_seed(3))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def kept(fast_on):
        storages = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                storages[ptr] = t.untyped_storage().nbytes()
            return t
        if fast_on:
            fast.enable(model, [path])
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(idx, idx)[1]
            loss.backward()
        finally:
            fast.disable(model)
        return sum(storages.values())
    plain, have = kept(False), kept(True)
    hd, Hkv = D // 4, 2
    slot = B * Hkv * Tn * hd * 4                                           # one slot of K or V, bytes
    rows = B * Hkv * Tn * L * (4 // Hkv) * (hd + 2 * L) * 4                # the queries' and weights' buffers
    assert plain >= 2 * L * (L - 1) * slot                                  # the plain blocks keep their stacks
    assert have <= plain - 2 * (L * (L - 1) - 2 * L) * slot + rows, (have, plain)


@pytest.mark.parametrize('first', ['blocks.3.attn.wq.weight', 'residual.layers.1.depth_kv.weight'])
def test_moda_depth_cache_gradient_after_a_partial_backward(first):
    """Two backward passes over one graph (fp64, L = 4): a first `autograd.grad` that reaches only
    part of the model (the last block's query weights: its depth read's backward runs, no slot's
    writer does; block 1's depth_kv: the reads of positions 2 and 3 and the writers of slots 2 .. 5,
    not the first writer), then `loss.backward()`. Every gradient of the second pass equals the plain
    model's: a slot's gradient sums only the reads whose backward ran in its own pass, not again
    those of the first (which would double the depth slots' gradient)."""
    model = make('moda', dtype=torch.float64, n_layer=4)
    path = torch_block_paths()[residuals.MoDA]
    idx = torch.randint(0, 64, (B, 8), generator=torch.Generator().manual_seed(3))
    params = dict(model.named_parameters())

    def grads(fast_on):
        model.zero_grad(set_to_none=True)
        if fast_on:
            fast.enable(model, [path])
        try:
            loss = model(idx, idx)[1]
            torch.autograd.grad(loss, [params[first]], retain_graph=True)
            loss.backward()
        finally:
            fast.disable(model)
        return {n: p.grad.clone() for n, p in params.items()}
    want, have = grads(False), grads(True)
    for n, w in want.items():
        err = ((have[n] - w).abs().max() / w.abs().max()).item()
        assert err < 1e-10, f"{n}: relative error {err:.1e}"


def test_the_guard_refuses_sinkhorn_rounds_in_bf16(monkeypatch):
    """mHC's stream steps with each Sinkhorn normalisation rounded to bf16 (the rounds stay fp32 in the
    plain code: bf16 breaks the doubly-stochastic constraint): refused on the fp64 twin and, where the
    rounds are not what a twin in fp32 would notice, under bf16 autocast."""
    from fast import streams as st
    import inspect
    import textwrap
    src = textwrap.dedent(inspect.getsource(st.sinkhorn_steps)).replace(
        "            P = P / s\n", "            P = (P / s).bfloat16().to(P.dtype)\n")
    scope = dict(vars(st))
    exec(compile(src, '<planted sinkhorn_steps>', 'exec'), scope)
    monkeypatch.setattr(st, 'sinkhorn_steps', scope['sinkhorn_steps'])
    model = make('mhc')
    path = torch_block_paths()[residuals.MHC]
    with pytest.raises(fast.FastPathMismatch, match=r'mhc_streams_torch .*relative error'):
        fast.check(model, [path], 'cpu')
    with pytest.raises(fast.FastPathMismatch, match=r'mhc_streams_torch .*bfloat16 autocast'):
        fast.check_autocast(model, [path], 'cpu', torch.bfloat16)


# -----------------------------------------------------------------------------
# the guard at its boundaries: NaN and inf, just past each tolerance, a low-precision softmax,
# gains and queries that a twin of ones would hide

def read_times(factor):
    """AttnRes.read with z times `factor` (nan, inf, or 1 + a relative error)."""
    def read(self, sources, mixer):
        z, a = residuals.AttnRes.read(self, sources, mixer)
        return z * factor, a
    return read


@pytest.mark.parametrize('value', [float('nan'), float('inf')])
def test_the_guard_refuses_a_fast_path_that_returns_nan_or_inf(value):
    """A NaN error compares False with everything: `err > tol` would let it through, `not err <=
    tol` does not. Under autocast too."""
    bad = planted('planted_nan', 'read', read_times(value))
    with pytest.raises(fast.FastPathMismatch, match='planted_nan'):
        fast.check(make('attnres'), [bad], 'cpu')
    with pytest.raises(fast.FastPathMismatch, match='planted_nan'):
        fast.check_autocast(make('attnres'), [bad], 'cpu', torch.bfloat16)


def read_plus(eps):
    """AttnRes.read with eps times z rolled by one channel added (a scale change alone would be
    undone by the norm that reads z)."""
    def read(self, sources, mixer):
        z, a = residuals.AttnRes.read(self, sources, mixer)
        return z + eps * z.roll(1, -1), a
    return read


def test_the_fp64_tolerance_refuses_an_error_just_above_it():
    """eps = 1e-10 added to z is a relative error of 2e-9 to 1e-8 on the twin's worst tensor:
    refused, the tolerance being 1e-9 in fp64 (a tolerance 10x looser would take it). (Below that,
    any change to the read's arithmetic leaves ~3e-9 on the embedding's gradient, which is small
    by cancellation: the just-inside side is the relative floor's test below.)"""
    with pytest.raises(fast.FastPathMismatch, match=r'planted_1e-10 .*relative error [2-9]\.\de-09 > 1e-09'):
        fast.check(make('attnres'), [planted('planted_1e-10', 'read', read_plus(1e-10))], 'cpu')


def read_query_gradient_off(rel):
    """AttnRes.read exact, but the gradient of block 2's MLP read query (whose largest entry is
    ~1% of the largest gradient on the twin) off by `rel` relative to itself."""
    def read(self, sources, mixer):
        if mixer is self.layers[2].mlp_mix and torch.is_grad_enabled():
            mixer.query.register_hook(lambda g: g * (1 + rel))
        return residuals.AttnRes.read(self, sources, mixer)
    return read


def test_the_relative_floor_does_not_hide_an_error_in_a_small_gradient():
    """Each tensor's error is relative to its own largest entry, floored at 1e-3 of the largest
    of all (the twin's: this query's gradient is ~1.4e-2 of it, above the floor): 3e-9 on it is
    refused, 5e-10 taken. A floor 100x looser (1e-1) would divide the error by ~7 and take 3e-9."""
    model = make('attnres')
    with pytest.raises(fast.FastPathMismatch, match=r'layers\.2\.mlp_mix\.query'):
        fast.check(model, [planted('planted_query', 'read', read_query_gradient_off(3e-9))], 'cpu')
    fast.check(model, [planted('planted_query', 'read', read_query_gradient_off(5e-10))], 'cpu')


def read_plains_error_times(m):
    """Under autocast: AttnRes.read whose output (and so its gradients) is m times the plain
    read's own distance from its fp64 value: z64 + m (z - z64), z64 the read in fp64 on the
    same parameters (reparametrised as float64 views, so the gradients flow to them)."""
    from torch.nn.utils.stateless import _reparametrize_module

    def read(self, sources, mixer):
        z, a = residuals.AttnRes.read(self, sources, mixer)
        if not torch.is_autocast_enabled(z.device.type):
            return z, a
        with torch.autocast(z.device.type, enabled=False), \
                _reparametrize_module(self, {n: p.double() for n, p in self.named_parameters()}):
            z64, _ = residuals.AttnRes.read(self, [s.double() for s in sources], mixer)
        return (z64 + m * (z.double() - z64)).to(z.dtype), a
    return read


def test_the_autocast_factor_refuses_just_above_3x_and_takes_2x():
    """Under bf16 autocast a fast path may be 3x as far from fp64 as the plain method (+ 1e-5):
    5x is refused, 2x taken; a factor of 30 would take 5x."""
    model = make('attnres')
    with pytest.raises(fast.FastPathMismatch, match=r'planted_5x .* \(allowed 3x'):
        fast.check_autocast(model, [planted('planted_5x', 'read', read_plains_error_times(5.0))], 'cpu',
                            torch.bfloat16)
    fast.check_autocast(model, [planted('planted_2x', 'read', read_plains_error_times(2.0))], 'cpu', torch.bfloat16)


def read_with_a_bf16_softmax(self, sources, mixer):
    """AttnRes.read, exact, that also runs a softmax on a bf16 tensor (no gradient through it)."""
    z, a = residuals.AttnRes.read(self, sources, mixer)
    return z + 0 * torch.softmax(z.detach().bfloat16(), dim=-1).float(), a


def test_a_softmax_in_bf16_the_plain_read_does_not_run_is_refused():
    """Its output and gradients are exact: only the watched normalisers (NORMALISERS: '_softmax')
    refuse it, in one line naming the op."""
    with pytest.raises(fast.FastPathMismatch, match=r'planted_softmax .*runs _softmax in bfloat16'):
        fast.check_autocast(make('attnres'), [planted('planted_softmax', 'read', read_with_a_bf16_softmax)], 'cpu',
                            torch.bfloat16)


def read_with_abs(name):
    """AttnRes.read with the mixer's parameter `name` (the key norm's gains, the pseudo-query)
    replaced by its absolute value: the same on a twin whose gains and queries are 1."""
    from torch.nn.utils.stateless import _reparametrize_module

    def read(self, sources, mixer):
        with _reparametrize_module(mixer, {name: mixer.get_parameter(name).abs()}):
            return residuals.AttnRes.read(self, sources, mixer)
    return read


@pytest.mark.parametrize('name', ['key_norm.weight', 'query'])
def test_the_twin_draws_gains_and_queries_at_random(name):
    """randomise draws every parameter, the 1-D ones (gains, pseudo-queries) included: a fast
    path that took |gain| or |query| agrees with the plain read on a twin of ones, not on this one."""
    twin = GPT(fast.twin_config(make('attnres').config))
    fast.randomise(twin)
    assert (twin.residual.layers[1].mlp_mix.get_parameter(name) < 0).any()
    with pytest.raises(fast.FastPathMismatch, match='planted_abs'):
        fast.check(make('attnres'), [planted('planted_abs', 'read', read_with_abs(name))], 'cpu')


def read_rounded_to_bf16(self, sources, mixer):
    """AttnRes.read whose output is rounded to bf16 under autocast, as fla's kernel writes it."""
    z, a = residuals.AttnRes.read(self, sources, mixer)
    return (z.bfloat16().float() if torch.is_autocast_enabled(z.device.type) else z), a


def test_a_declared_rounding_is_held_against_the_plain_read_rounded_the_same():
    """A fast path declared in_run_dtype (fla's: reads and writes in the run's dtype) is compared
    with the plain read given and giving bf16-rounded tensors, and one bf16 ulp beside the 3x:
    the read rounded to bf16 passes so; the same path undeclared is refused."""
    decl = fast.FastPath('planted_declared', residuals.AttnRes, 'read', read_rounded_to_bf16, 'planted',
                         in_run_dtype=True)
    fast.check_autocast(make('attnres'), [decl], 'cpu', torch.bfloat16)
    with pytest.raises(fast.FastPathMismatch, match='planted_undeclared'):
        fast.check_autocast(make('attnres'), [planted('planted_undeclared', 'read', read_rounded_to_bf16)], 'cpu',
                            torch.bfloat16)


def test_resolve_reads_the_strings_a_command_line_gives():
    assert [fast.resolve(s, 'cpu') for s in ('False', 'false', 'True', 'true', 'auto')] == [False, False, True, True,
                                                                                             False]
    assert fast.resolve('auto', 'cuda') is True
    assert fast.describe([]) == 'fast paths: off (the plain code of residuals.py)'
    p = fast.FAST_PATHS[1]
    assert fast.describe([p]) == f'fast paths: {p.name} ({p.runs}) - checked against residuals.py'


def gate_gradient_off(c, largest):
    """MultiStream.block, plain, with c x `largest` added to the gradient of block 0's first H_res
    gate (mHC's attn_route.alpha_res), a gradient that is zero but for rounding on the twin: its
    streams are all the embedding, and H_res's columns sum to 1."""
    def block(self, H, b, layer, rope):
        if b == 0 and torch.is_grad_enabled():
            def once(g):  # this replay's gradient only: the plain method's, replayed after it, stay as they are
                handle.remove()
                return g + c * largest
            handle = self.layers[0].attn_route.alpha_res.register_hook(once)
        return residuals.MultiStream.block(self, H, b, layer, rope)
    return block


def test_the_autocast_guard_holds_a_gradient_zero_but_for_rounding_to_the_largest_entry():
    """Under bf16 autocast each gradient's norm is floored at 1e-3 of the largest gradient entry
    (per entry): on a 16-head mHC twin (the 400M model's heads) the first H_res gate's gradient is
    zero but for rounding, and the fused stream steps, which round it elsewhere than the plain
    code, are taken (with no floor they are refused: 12 times the gradient's own size from fp64
    where the plain code is 1.5 times); an error of 1e-3 of the largest entry on it is refused,
    1e-9 taken."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=128, n_head=16, residual='mhc'))
    fast.check_autocast(model, [torch_block_paths()[residuals.MHC]], 'cpu', torch.bfloat16)
    twin = GPT(fast.twin_config(model.config))  # the guard's twin, tokens and gradients (fp32 here)
    fast.randomise(twin)
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    largest = max(g.abs().max().item() for args, on in fast._calls(twin, 'block', idx, torch.bfloat16)
                  for g in fast._replay(residuals.MultiStream.block, twin.residual, args, on, torch.bfloat16)[1]
                  if g is not None)
    with pytest.raises(fast.FastPathMismatch, match=r'planted_gate .*gradient 9 '):
        fast.check_autocast(model, [planted('planted_gate', 'block', gate_gradient_off(1e-3, largest),
                                            residuals.MHC)], 'cpu', torch.bfloat16)
    fast.check_autocast(model, [planted('planted_gate', 'block', gate_gradient_off(1e-9, largest),
                                        residuals.MHC)], 'cpu', torch.bfloat16)
