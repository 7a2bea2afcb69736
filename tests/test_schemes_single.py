"""
Tests of the single-stream residual schemes and MoDA in residuals.py (paper Table 1,
Appendix A; docs/schemes.md): Sandwich-LN, LNS, DeepNorm, KEEL, MoDA, Post-LN, ReZero,
LayerScale, ResiDual.

Parameter counts against closed forms, each scheme's equation against an independent
per-sublayer loop (default, swapped, skipped and dropped orders), equivalences at init,
MoDA's joint softmax and depth cache, causality, short training runs and checkpoint
round trips. CPU only, tiny shapes, well under a minute:

    python -m pytest tests/test_schemes_single.py -q
"""

import io
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS, MoDA  # noqa: E402

SCHEMES = ('sandwich', 'lns', 'deepnorm', 'keel', 'moda', 'postln', 'rezero', 'layerscale', 'resdual')
SINGLE = tuple(s for s in SCHEMES if s != 'moda')  # the ones with a reference loop below
VOCAB = 64
EPS = 1e-6


def make(residual, L=3, d=32, H=4, kv=None, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=L, n_embd=d, n_head=H,
                         n_kv_head=kv, norm_eps=EPS, residual=residual, **kw))


@torch.no_grad()
def randomize_scheme(model, seed=1):
    """Moves every scheme parameter away from its init (gains 1, gates 0, scales 1e-4), so
    that a wrong use of any of them shows in the output."""
    g = torch.Generator().manual_seed(seed)
    for p in model.residual.parameters():
        if p.dim() >= 2:  # MoDA's W_kv: a projection, keep its scale
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def tokens(B=2, T=16, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def close(a, b, atol=1e-5):
    return torch.allclose(a, b, rtol=1e-5, atol=atol)


# -----------------------------------------------------------------------------
# parameter counts: closed-form extra parameters over Pre-LN (docs/schemes.md's table)

def delta_params(residual, L, d, H, kv=None):
    """Extra parameters of a scheme over Pre-LN of the same shape (Pre-LN's blocks hold 2Ld
    norm gains)."""
    kv_dim = (kv or H) * (d // H)
    return {
        'sandwich': 2 * L * d,                 # an output RMSNorm per sublayer
        'lns': 0,                              # a constant factor per block
        'deepnorm': 0,                         # 2L post-LayerNorms (gain only) replace 2L pre-RMSNorms
        'keel': (2 * L - 1) * d,               # outer norm on every sublayer but block 0's attention
        'moda': (L - 1) * 2 * d * kv_dim,      # W_kv (d -> 2 kv_dim) on blocks 0..L-2
        'postln': 0,                           # post-norms replace pre-norms
        'rezero': 2 * L - 2 * L * d,           # 2L scalar gates, no norms in the blocks
        'layerscale': 2 * L * d,               # gamma in R^d per sublayer
        'resdual': d,                          # the dual stream's final norm
    }[residual]


SHAPES = [dict(L=1, d=32, H=2), dict(L=3, d=48, H=4, kv=2), dict(L=4, d=64, H=8, kv=1)]


@pytest.mark.parametrize('residual', SCHEMES)
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: '-'.join(f'{k}{v}' for k, v in s.items()))
def test_param_count_closed_form(residual, shape):
    base = make('preln', **shape).num_params()
    assert make(residual, **shape).num_params() - base == delta_params(residual, **shape)


def test_registry_has_the_schemes():
    assert set(SCHEMES) <= set(RESIDUALS)


# -----------------------------------------------------------------------------
# each scheme's equation, written out independently of residuals.py

def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def layer_norm(x, w):
    x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def reference_hidden(model, idx, order, skip=()):
    """The input of the final norm, one sublayer at a time, from the equations of the paper's Appendix A (docs/schemes.md)."""
    name, L, res = model.config.residual, model.config.n_layer, model.residual
    T = idx.size(1)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    h = a = s = model.wte(idx)
    for b in order:
        if b in skip:
            continue
        blk, prm = model.blocks[b], res.layers[b]
        for j, (side, f) in enumerate((('attn', lambda x: blk.attn(x, rope)), ('mlp', blk.mlp))):
            def part(p):
                m = getattr(prm, f'{side}_{p}')
                return m.weight if hasattr(m, 'weight') else m
            if name == 'sandwich':
                h = h + rms(f(rms(h, part('norm'))), part('out_norm'))
            elif name == 'lns':
                h = h + f(rms(h, part('norm')) / math.sqrt(b + 1))
            elif name == 'postln':
                h = rms(h + f(h), part('post_norm'))
            elif name == 'deepnorm':
                h = layer_norm((2 * L) ** 0.25 * h + f(h), part('post_norm'))
            elif name == 'keel':
                y = f(rms(h, part('norm')))
                if b == 0 and j == 0:
                    h = h + y
                else:
                    h = rms((1 if b == 0 else 2 * L) * h + y, part('out_norm'))
            elif name == 'rezero':
                h = h + part('gate') * f(h)
            elif name == 'layerscale':
                h = h + part('scale') * f(rms(h, part('norm')))
            elif name == 'resdual':
                y = f(a)
                a, s = rms(a + y, part('post_norm')), s + y
    return a + rms(s, res.dual_norm.weight) if name == 'resdual' else h


ORDERS = [  # (order, skip) for L = 3
    ((0, 1, 2), ()),
    ((2, 0, 1), ()),      # permuted: parameters (and LNS's factor, KEEL's block-0 form) travel with b
    ((0, 1, 2), (1,)),    # skip block 1
    ((0, 2), ()),         # drop block 1
    ((1, 0, 2), (0,)),    # swap and skip
]


@pytest.mark.parametrize('residual', SINGLE)
def test_equation_and_orders(residual):
    model = randomize_scheme(make(residual, L=3))
    idx = tokens()
    with torch.no_grad():
        for order, skip in ORDERS:
            got = model.hidden(idx, order=order, skip=skip)
            ref = reference_hidden(model, idx, order, skip)
            assert close(got, ref), f"{residual} {order} skip={skip}: max diff {(got - ref).abs().max():.2e}"
        # and the orders really differ (the test above would not notice a scheme that ignores them)
        assert not close(model.hidden(idx, order=(2, 0, 1)), model.hidden(idx))


# -----------------------------------------------------------------------------
# scheme-specific structure and init

def test_lns_one_layer_is_preln():
    pre, lns = make('preln', L=1, seed=0), make('lns', L=1, seed=1)
    randomize_scheme(pre)
    lns.load_state_dict(pre.state_dict(), strict=False)
    idx = tokens()
    with torch.no_grad():
        assert close(lns(idx)[0], pre(idx)[0])
        # with two blocks the 1/sqrt(2) factor of block 1 must show
        pre2, lns2 = make('preln', L=2), make('lns', L=2, seed=1)
        lns2.load_state_dict(pre2.state_dict(), strict=False)
        assert not close(lns2(idx)[0], pre2(idx)[0])


def trunc_normal_std(std):
    """Std of a normal(0, std) truncated at +-3 std."""
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    mass = math.erf(3 / math.sqrt(2))
    return std * math.sqrt(1 - 6 * phi3 / mass)


def test_deepnorm_init_scales_value_output_and_mlp():
    L = 4
    model = make('deepnorm', L=L, d=64, H=4)
    beta = (8 * L) ** -0.25
    expected = trunc_normal_std(0.02)

    def pooled_std(get):
        return torch.cat([get(blk).flatten() for blk in model.blocks]).std().item()

    for get in (lambda m: m.attn.wq.weight, lambda m: m.attn.wk.weight):
        assert abs(pooled_std(get) / expected - 1) < 0.03
    for get in (lambda m: m.attn.wv.weight, lambda m: m.attn.wo.weight, lambda m: m.mlp.w_gate.weight,
                lambda m: m.mlp.w_up.weight, lambda m: m.mlp.w_down.weight):
        assert abs(pooled_std(get) / (beta * expected) - 1) < 0.03
    assert model.residual.alpha == pytest.approx((2 * L) ** 0.25)
    # the block norms are bias-free LayerNorms with gain 1
    norm = model.residual.layers[0].attn_post_norm
    assert isinstance(norm, torch.nn.LayerNorm) and norm.bias is None and torch.all(norm.weight == 1)
    # re-initialising gives the same scale, not beta^2
    model.init_weights()
    assert abs(pooled_std(lambda m: m.attn.wv.weight) / (beta * expected) - 1) < 0.03


def test_keel_block0_structure():
    L = 3
    model = make('keel', L=L)
    layers = model.residual.layers
    assert layers[0].attn_out_norm is None
    assert all(layers[b].mlp_out_norm is not None for b in range(L))
    assert all(layers[b].attn_out_norm is not None for b in range(1, L))
    keys = model.state_dict().keys()
    assert 'residual.layers.0.attn_out_norm.weight' not in keys
    assert 'residual.layers.1.attn_out_norm.weight' in keys
    assert model.residual.alpha == 2 * L
    # block 0's attention is a plain Pre-LN update: its output is not normalised
    idx = tokens()
    x = model.wte(idx)
    with torch.no_grad():
        T = idx.size(1)
        rope = (model.rope_cos[:T], model.rope_sin[:T])
        h = model.residual.sublayer(x, 0, 0, lambda z: model.blocks[0].attn(z, rope))
        assert close(h, x + model.blocks[0].attn(layers[0].attn_norm(x), rope))
        # block 1's attention output is normalised (RMS 1 with unit gain)
        h1 = model.residual.sublayer(h, 1, 0, lambda z: model.blocks[1].attn(z, rope))
        assert close(h1.pow(2).mean(-1), torch.ones_like(h1[..., 0]), atol=1e-3)


def test_rezero_is_identity_at_init():
    model = make('rezero', L=3)
    assert all(torch.all(p == 0) for p in model.residual.parameters())
    assert not any(isinstance(m, torch.nn.LayerNorm) or type(m).__name__ == 'RMSNorm'
                   for m in model.residual.modules())
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(model(idx)[0], model.lm_head(model.norm_f(model.wte(idx))))


def test_layerscale_init_near_identity_and_gamma_one_is_preln():
    model = make('layerscale', L=3, layerscale_init=1e-4)
    scales = [p for n, p in model.residual.named_parameters() if n.endswith('_scale')]
    assert len(scales) == 6 and all(torch.all(p == 1e-4) for p in scales)
    idx = tokens()
    with torch.no_grad():
        identity = model.lm_head(model.norm_f(model.wte(idx)))
        diff = (model(idx)[0] - identity).abs().max().item()
        assert 0 < diff < 1e-3
        # gamma = 1: exactly Pre-LN with the same weights
        pre = randomize_scheme(make('preln', L=3, seed=3))
        model.load_state_dict(pre.state_dict(), strict=False)
        for p in scales:
            p.fill_(1.0)
        assert close(model(idx)[0], pre(idx)[0])


def test_postln_states_are_normalised_and_resdual_stream_is_postln():
    idx = tokens()
    post = make('postln', L=3)
    rd = make('resdual', L=3, seed=5)
    missing, unexpected = rd.load_state_dict(post.state_dict(), strict=False)
    assert missing == ['residual.dual_norm.weight'] and not unexpected
    with torch.no_grad():
        rec = []
        post.hidden(idx, record=rec)
        for z, _ in rec[1:]:  # every block output is RMS-normalised (gain 1 at init)
            assert close(z.pow(2).mean(-1), torch.ones_like(z[..., 0]), atol=1e-3)
        # ResiDual's Post-LN stream is Post-LN's stream; its readout adds RMSNorm(dual)
        state = rd.residual.begin(rd.wte(idx))
        T = idx.size(1)
        for b in range(3):
            state = rd.residual.block(state, b, rd.blocks[b], (rd.rope_cos[:T], rd.rope_sin[:T]))
        assert close(state[0], rec[-1][0])
        assert close(rd.hidden(idx), state[0] + rd.residual.dual_norm(state[1]))


# -----------------------------------------------------------------------------
# MoDA

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


# -----------------------------------------------------------------------------
# every scheme: causality, orders, training, checkpoints

@pytest.mark.parametrize('residual', SCHEMES)
def test_causal(residual):
    model = randomize_scheme(make(residual, L=3, kv=2))
    idx = tokens(T=16)
    idx2 = idx.clone()
    idx2[:, 9:] = (idx2[:, 9:] + 1 + torch.arange(7)) % VOCAB
    with torch.no_grad():
        a, b = model(idx)[0], model(idx2)[0]
    assert close(a[:, :9], b[:, :9])
    assert not close(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize('residual', SCHEMES)
def test_orders_run(residual):
    model = randomize_scheme(make(residual, L=3, kv=2))
    idx = tokens()
    with torch.no_grad():
        base = model(idx)[0]
        outs = {'swap': model(idx, order=(1, 0, 2))[0], 'skip': model(idx, skip={1})[0],
                'drop': model(idx, order=(0, 2))[0], 'skip-all': model(idx, skip={0, 1, 2})[0]}
        rec = []
        model.hidden(idx, order=(2, 1, 0), skip={1}, record=rec)
    assert len(rec) == 4 and all(torch.isfinite(z).all() and torch.isfinite(r).all() for z, r in rec)
    for name, out in outs.items():
        assert out.shape == base.shape and torch.isfinite(out).all(), name
        assert not close(out, base), name
    assert torch.equal(rec[2][0], rec[1][0])  # a skipped block leaves the probe state unchanged


@pytest.mark.parametrize('residual', SCHEMES)
def test_trains(residual):
    model = make(residual, L=2, d=32, H=2)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95))
    idx = tokens(B=4, T=16, seed=1)
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(50):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not losses:  # every parameter is in the graph (MoDA's W_kv, KEEL's outer norms, ...)
            assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first / 2, f"{residual}: loss {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize('residual', SCHEMES)
def test_checkpoint_round_trip(residual):
    model = randomize_scheme(make(residual, L=3, kv=2))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = make(residual, L=3, kv=2, seed=123)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(fresh(idx)[0], model(idx)[0])
