"""
MoDA (residuals.py MoDA, MoDALayer): the attention of each block reads its sequence keys and
the depth keys of earlier blocks in one joint softmax (checked against a loop over batch, head
and query, with GQA), in fp32 whatever the input dtype; the depth cache (masked depth is
Pre-LN, block 0 is plain attention, one slot per earlier block, skipped blocks leave zero
slots). The whole-model cases (causality, orders, training, checkpoints) are in
tests/test_single_stream.py, parametrized with the single-stream schemes.

    python -m pytest tests/test_moda.py -q
"""

import math

import pytest
import torch
import torch.nn.functional as F

from residuals import MoDA
from single_stream_models import close, make, randomize_scheme, tokens


# -----------------------------------------------------------------------------
# the joint softmax over sequence and depth keys


def naive_depth_attention(q, k, v, dk, dv):
    """Loop over batch, head and query token: one softmax over [k_0..k_t, dk_0..dk_{S-1}]."""
    B, H, T, hd = q.shape
    G = H // k.size(1)
    y = torch.zeros_like(q)
    for b in range(B):
        for i in range(H):
            g = i // G
            for t in range(T):
                keys = torch.cat([k[b, g, :t + 1], dk[b, g, t]])  # (t + 1 + S, hd)
                vals = torch.cat([v[b, g, :t + 1], dv[b, g, t]])
                w = torch.softmax(keys @ q[b, i, t] / math.sqrt(hd), dim=0)
                y[b, i, t] = w @ vals
    return y


def depth_inputs(B, H, Hkv, T, S, hd, seed=0, dtype=torch.float32):
    """q (B, H, T, hd), k, v (B, H_kv, T, hd), depth_k, depth_v (B, H_kv, T, S, hd)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g, dtype=dtype)
    k, v = torch.randn(2, B, Hkv, T, hd, generator=g, dtype=dtype)
    dk, dv = torch.randn(2, B, Hkv, T, S, hd, generator=g, dtype=dtype)
    return q, k, v, dk, dv


@pytest.mark.parametrize('H,Hkv,S', [(4, 4, 3), (4, 2, 2), (4, 1, 5), (2, 1, 1)])
def test_moda_attention_is_one_joint_softmax(H, Hkv, S):
    """MoDA.attention against a loop over batch, head and query with GQA (query head i
    reads key/value head i // (H / H_kv)), and its gradients against the loop's (fp64)."""
    inputs = [t.double().requires_grad_() for t in depth_inputs(2, H, Hkv, 6, S, 8)]
    y = MoDA.attention(None, *inputs)
    naive = naive_depth_attention(*inputs)
    torch.testing.assert_close(y, naive, rtol=1e-10, atol=1e-12)
    w = torch.randn_like(y)
    ours = torch.autograd.grad((y * w).sum(), inputs)
    ref = torch.autograd.grad((naive * w).sum(), inputs)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_moda_attention_without_depth_mass_is_causal_attention():
    """Depth keys with scores -inf-like (far below the sequence scores) leave plain causal
    attention; a depth key aligned with the query takes the mass to its value."""
    q, k, v, dk, dv = depth_inputs(2, 4, 2, 6, 2, 8, seed=3)
    far = -1e4 * q.view(2, 2, 2, 6, 8)[:, :, 0].unsqueeze(3).expand(-1, -1, -1, 2, -1)  # (B, H_kv, T, S, hd)
    q = q.view(2, 2, 2, 6, 8)
    q = q[:, :, :1].expand(-1, -1, 2, -1, -1).reshape(2, 4, 6, 8)  # both heads of a group share q
    y = MoDA.attention(None, q, k, v, far, dv)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    near = -far
    y = MoDA.attention(None, q, k, v, near, dv)
    torch.testing.assert_close(y, dv.mean(3).repeat_interleave(2, dim=1), rtol=1e-4, atol=1e-4)


def test_moda_attention_keeps_the_dtype_and_softmax_in_fp32():
    """bf16 inputs give a bf16 output close to the fp32 result (the softmax runs in fp32)."""
    inputs = depth_inputs(2, 4, 2, 32, 4, 16, seed=2)
    ref = MoDA.attention(None, *inputs)
    y = MoDA.attention(None, *[t.bfloat16() for t in inputs])
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()) < 0.02


# -----------------------------------------------------------------------------
# the depth cache: slots, masking, skipped blocks


def moda(L=3, use_depth=True, **kw):
    model = make('moda', L=L, d=32, H=4, kv=2, **kw)
    model.residual.use_depth = use_depth
    return model


def test_moda_masked_depth_is_preln_and_block0_is_plain():
    idx = tokens()
    pre = randomize_scheme(make('preln', L=3, d=32, H=4, kv=2, seed=7))
    masked, full = moda(use_depth=False, seed=8), moda(seed=8)
    for m in (masked, full):
        missing, unexpected = m.load_state_dict(pre.state_dict(), strict=False)
        assert sorted(missing) == ['residual.layers.0.depth_kv.weight', 'residual.layers.1.depth_kv.weight']
        assert not unexpected
    with torch.no_grad():
        assert close(masked(idx)[0], pre(idx)[0])
        rec_pre, rec_full = [], []
        pre.hidden(idx, record=rec_pre)
        full.hidden(idx, record=rec_full)
        assert close(rec_full[1][0], rec_pre[1][0])      # block 0: plain causal attention
        assert not close(rec_full[2][0], rec_pre[2][0])  # block 1 reads block 0's depth slots


def test_moda_depth_slots():
    model = moda(L=3)
    res, idx = model.residual, tokens()
    T = idx.size(1)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    with torch.no_grad():
        x = model.wte(idx)
        s0 = res.begin(x)
        assert all(torch.equal(z, torch.zeros_like(z)) for z in s0[1] + s0[2]) and len(s0[1]) == 6
        s1 = res.block(s0, 0, model.blocks[0], rope)
        _, k, v = model.blocks[0].attn.qkv(res.layers[0].attn_norm(x))  # before RoPE
        assert torch.equal(s1[1][0], k) and torch.equal(s1[2][0], v)
        h_mid = x + model.blocks[0].attn(res.layers[0].attn_norm(x), rope)
        kv = res.layers[0].depth_kv(res.layers[0].mlp_norm(h_mid))    # (B, T, 2 * kv_dim)
        dk, dv = kv.view(*kv.shape[:2], 2, 2, -1).unbind(2)             # (B, T, H_kv, hd)
        assert close(s1[1][1], dk.transpose(1, 2)) and close(s1[2][1], dv.transpose(1, 2))
        assert all(torch.all(z == 0) for z in s1[1][2:])
        # the prefix state is never modified: continuing it twice gives the same result
        saved = [z.clone() for z in s1[1] + s1[2]] + [s1[0].clone()]
        s2a = res.block(s1, 1, model.blocks[1], rope)
        res.skip(s1, 1)
        s2b = res.block(s1, 1, model.blocks[1], rope)
        assert all(torch.equal(a, b) for a, b in zip(saved, list(s1[1] + s1[2]) + [s1[0]]))
        assert torch.equal(s2a[0], s2b[0])
        assert torch.all(s0[1][0] == 0)  # the shared zero slot stayed zero
        # the last block has no W_kv: its FFN slot stays zero
        s3 = res.block(s2a, 2, model.blocks[2], rope)
        assert torch.all(s3[1][5] == 0) and not torch.all(s3[1][4] == 0)
        with pytest.raises(ValueError, match='at most n_layer'):
            res.block(s3, 0, model.blocks[0], rope)


def test_moda_skip_leaves_zero_slots_that_take_mass():
    model = randomize_scheme(moda(L=3))
    res, idx = model.residual, tokens()
    T = idx.size(1)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    with torch.no_grad():
        s = res.skip(res.begin(model.wte(idx)), 0)
        s = res.block(s, 1, model.blocks[1], rope)
        assert torch.all(s[1][0] == 0) and torch.all(s[1][1] == 0) and torch.all(s[2][0] == 0)
        assert not torch.all(s[1][2] == 0) and not torch.all(s[1][3] == 0)
        # skipped (two zero slots with mass exp(0)) != dropped (no slots), for block 0 and 1
        for b in (0, 1):
            kept = tuple(i for i in range(3) if i != b)
            assert not close(model(idx, skip={b})[0], model(idx, order=kept)[0])
        # without depth attention, skip and drop are the same (the difference is the slots)
        res.use_depth = False
        assert close(model(idx, skip={1})[0], model(idx, order=(0, 2))[0])
