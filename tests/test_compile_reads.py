"""
The depth reads under torch.compile (ops.py, "the depth reads as opaque ops"): AttnRes and
MoDA reads become custom ops whose sources' gradients travel along a route, so that the
compiled graph grows linearly in depth. Checked here: the ops' registrations (opcheck),
the routed gradients against the eager autograd Functions in fp64, compiled-vs-eager
gradients of whole models, and the size of the traced forward and backward graphs
against L (quadratic with the reads unrolled, which the last test also shows).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
sys.path.insert(0, os.path.dirname(__file__))
import ops  # noqa: E402
from compile_check import assert_compiled_matches_eager  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from ops import (DepthMixFunction, DepthReadFunction, RouteWrite, depth_mix_backward_op, depth_mix_op,  # noqa: E402
                 depth_read_backward_op, depth_read_op, route_slot)

f64 = dict(dtype=torch.float64)


def mix_inputs(n=4, B=2, T=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = [torch.randn(B, T, d, generator=g, **f64) for _ in range(n)]
    inv = [torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) for v in sources]
    return sources, inv, torch.randn(d, generator=g, **f64), torch.randn(d, generator=g, **f64)


def read_inputs(S=3, B=2, Hkv=2, G=2, T=3, hd=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv, G, T, hd, generator=g, **f64)
    K = [torch.randn(B, Hkv, T, hd, generator=g, **f64) for _ in range(S)]
    V = [torch.randn(B, Hkv, T, hd, generator=g, **f64) for _ in range(S)]
    return q, K, V


def route_for(n_slots, slot_shape):
    return torch.zeros((), **f64).expand(n_slots, *slot_shape)


def test_ops_pass_opcheck():
    """Schema, fake (shape-only) implementations and autograd registration of every op,
    as torch.compile relies on them (the backward ops add into the route's gradient in place)."""
    sources, inv, w, g = mix_inputs()
    sources = [v.requires_grad_() for v in sources]
    route = route_for(6, (2, 3, 9)).requires_grad_()
    torch.library.opcheck(depth_mix_op, (sources, inv, w.requires_grad_(), g.requires_grad_(), route, 3))
    with torch.no_grad():  # the backward ops have no backward of their own
        sources, w, g = [v.detach() for v in sources], w.detach(), g.detach()
        z, a, r, _ = depth_mix_op(sources, inv, w, g, route, 3)
        groute = torch.randn(6, 2, 3, 9, **f64)
        torch.library.opcheck(depth_mix_backward_op, (groute, torch.randn_like(z), w, g, r, sources, inv, 3))
    q, K, V = read_inputs()
    route = route_for(5, (2, 2, 3, 8)).requires_grad_()
    torch.library.opcheck(depth_read_op, (q.requires_grad_(), K, V, 0.5, route))
    with torch.no_grad():
        q = q.detach()
        y, lse, a, _ = depth_read_op(q, K, V, 0.5, route)
        groute = torch.randn(5, 2, 2, 3, 8, **f64)
        torch.library.opcheck(depth_read_backward_op, (groute, torch.randn_like(y), torch.randn_like(lse), q, a, K, V, 0.5))
    torch.library.opcheck(route_slot, (torch.randn(4, 2, 3, **f64), 2))


@pytest.mark.parametrize('routed', [11, 9])
def test_routed_depth_mix_gradients_are_the_functions(routed, read_form):
    """Sources put on a route (one write each, as AttnRes does under compile) and read twice
    by the opaque op, first the first 7 and then all 11, get exactly DepthMixFunction's
    gradients, 1/rms included, in fp64; so do the queries and key gains. The second read's
    contributions reach the sources through the first read, which adds its own to the same
    route gradient in place; N = 13 > 11 slots. With routed = 9 the second read's last two
    sources are not on the route (as Block AttnRes's partial sum) and get their gradients
    directly."""
    sources, _, w, g = mix_inputs(n=11)
    outs = {}
    for routed_ in (False, True):
        vs = [v.clone().requires_grad_() for v in sources]
        ws = [t.clone().requires_grad_() for t in (w, w.flip(0))]
        gs = [t.clone().requires_grad_() for t in (g, g.roll(1))]
        inv = [torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) for v in vs]
        if routed_:
            route = route_for(13, (2, 3, 9))
            for i in range(7):
                route = RouteWrite.apply(route, i, vs[i], inv[i])
            z1, _, route = ops.depth_mix(vs[:7], inv[:7], ws[0], gs[0], route)
            for i in range(7, routed):
                route = RouteWrite.apply(route, i, vs[i], inv[i])
            z2 = ops.depth_mix(vs, inv, ws[1], gs[1], route, routed)[0]
        else:
            z1 = DepthMixFunction.apply(ws[0], gs[0], *vs[:7], *inv[:7])[0]
            z2 = DepthMixFunction.apply(ws[1], gs[1], *vs, *inv)[0]
        (z1.cos().sum() + (z2 * torch.linspace(-1, 2, z2.numel(), **f64).view_as(z2)).sum()).backward()
        outs[routed_] = [t.grad for t in (*vs, *ws, *gs)]
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_routed_depth_read_gradients_are_the_function(read_form):
    """MoDA's depth reads through the opaque op and a route give DepthReadFunction's
    gradients for q and for every slot's key and value (fp64), with lse's gradient too:
    a read of the first 6 slots, then of all S = 11, the second adding into the route
    gradient the first one passes on."""
    q, K, V = read_inputs(S=11)
    outs = {}
    for routed in (False, True):
        qs = [t.clone().requires_grad_() for t in (q, q.flip(-1))]
        Ks = [k.clone().requires_grad_() for k in K]
        Vs = [v.clone().requires_grad_() for v in V]
        if routed:
            route = route_for(12, (2, 2, 3, 8))
            for j in range(6):
                route = RouteWrite.apply(route, j, Ks[j], Vs[j])
            y1, lse1, _, route = depth_read_op(qs[0], Ks[:6], Vs[:6], 0.5, route)
            for j in range(6, 11):
                route = RouteWrite.apply(route, j, Ks[j], Vs[j])
            y, lse, _, _ = depth_read_op(qs[1], Ks, Vs, 0.5, route)
        else:
            y1, lse1 = DepthReadFunction.apply(qs[0], 0.5, *Ks[:6], *Vs[:6])
            y, lse = DepthReadFunction.apply(qs[1], 0.5, *Ks, *Vs)
        (y1.sum() + lse1.exp().sum() + y.sin().sum() + (lse * lse).sum()).backward()
        outs[routed] = [t.grad for t in (*qs, *Ks, *Vs)]
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def randomized(residual, L=3, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=L, n_embd=32, n_head=4, block_size=16, vocab_size=31, residual=residual, **kw))
    with torch.no_grad():
        for n, p in model.residual.named_parameters():
            if 'query' in n or 'depth_kv' in n:
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize('residual,kw', [('attnres', {}), ('blockattnres', {'attnres_blocks': 2}),
                                         ('moda', {'n_kv_head': 2})])
def test_compiled_model_matches_eager(residual, kw):
    """The whole model under torch.compile (aot_eager: traced like inductor, run eagerly):
    one graph, no break, no recompile, and the eager loss and parameter gradients."""
    model = randomized(residual, **kw)
    assert_compiled_matches_eager(model, torch.randint(0, 31, (2, 16)))


def traced_sizes(residual, L):
    """Nodes of the forward and backward graphs torch.compile hands to its compiler."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    sizes = []

    def count(gm, _):
        sizes.append(len(gm.graph.nodes))
        return make_boxed_func(gm.forward)
    torch._dynamo.reset()
    model = randomized(residual, L=L, **({'n_kv_head': 2} if residual == 'moda' else {}))
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=count, bw_compiler=count))
    idx = torch.randint(0, 31, (2, 16))
    fn(idx, idx)[1].backward()
    assert len(sizes) == 2, sizes  # one forward, one backward graph
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize('residual,depths', [('attnres', (1, 2, 3)), ('blockattnres', (2, 3, 4)),
                                             ('moda', (2, 3, 4))])
def test_compiled_graph_grows_linearly_in_depth(residual, depths, monkeypatch):
    """The forward and backward graphs grow by the same number of nodes for every block
    added: each block adds the same work, whatever the number of sources its reads see.
    (MoDA starts at L = 2: at L = 1 its only block reads no depth slots. Block AttnRes
    with 2L <= attnres_blocks = 8 has one sublayer per block: every read freezes a source.) With AttnRes's
    reads unrolled (ops.UNROLL_DEPTH_READS) the growth rises with L, so this test can fail."""
    s = [traced_sizes(residual, L) for L in depths]
    for part in (0, 1):
        assert s[2][part] - s[1][part] == s[1][part] - s[0][part], s
    if residual == 'attnres':
        monkeypatch.setattr(ops, 'UNROLL_DEPTH_READS', True)
        u = [traced_sizes(residual, L) for L in depths]
        assert u[2][1] - u[1][1] > u[1][1] - u[0][1], u


@pytest.mark.slow
@pytest.mark.parametrize('residual,op', [('attnres', 'depth_mix_backward'), ('moda', 'depth_read_backward')])
def test_inductor_keeps_one_route_gradient_buffer(residual, op):
    """With inductor, every read's backward adds into the same route-gradient buffer (the
    in-place adds are not turned into copies of all 2L + 1 slots per read, which would put
    O(L^2) slot traffic back into the step). Read off the generated code: the first argument
    of every call of the backward op is one buffer name."""
    import re
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    model = randomized(residual, L=3, **({'n_kv_head': 2} if residual == 'moda' else {}))
    fn = torch.compile(model)
    idx = torch.randint(0, 31, (2, 16))
    _, codes = run_and_get_code(lambda: fn(idx, idx)[1].backward())
    bufs = re.findall(rf'torch\.ops\.depthbench\.{op}\.default\((\w+),', '\n'.join(codes))
    reads = 6 if residual == 'attnres' else 2  # 2 per AttnRes block; MoDA's blocks 1 and 2 (block 0 reads no slot)
    assert len(bufs) == reads and len(set(bufs)) == 1, bufs
