"""
The single-stream schemes of residuals.py (PreLN, Sandwich, LNS, PostLN, DeepNorm, KEEL,
ReZero, LayerScale, ResiDual; paper Table 1, Appendix A; docs/schemes.md): parameter counts
against closed forms, each scheme's equation against an independent per-sublayer loop
(default, swapped, skipped and dropped orders), the init of each scheme, Pre-LN's recorded
states, and the whole model (causality, orders, a short training run, a checkpoint round
trip) for each of them and MoDA. CPU only, tiny shapes:

    python -m pytest tests/test_single_stream.py -q
"""

import io
import math

import pytest
import torch

from model import GPT, GPTConfig
from residuals import RESIDUALS
from single_stream_models import EPS, VOCAB, close, make, randomize_scheme, tokens
from small_models import TINY


SCHEMES = ('sandwich', 'lns', 'deepnorm', 'keel', 'moda', 'postln', 'rezero', 'layerscale', 'resdual')


SINGLE = tuple(s for s in SCHEMES if s != 'moda')  # the ones with a reference loop below


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
# each scheme's equation (Appendix A) against a loop over sublayers, in several orders


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
# init


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


# -----------------------------------------------------------------------------
# probe hooks: the recorded states and the skip rule of Pre-LN


def test_preln_skip_is_identity_block_and_record_states():
    torch.manual_seed(3)
    m = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, 101, (1, 8))
    record = []
    h = m.hidden(idx, record=record)
    torch.testing.assert_close(record[0][0], m.wte(idx))
    torch.testing.assert_close(record[-1][0], h)


# -----------------------------------------------------------------------------
# the whole model, for each scheme above and MoDA: causality, orders, training, checkpoints


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
