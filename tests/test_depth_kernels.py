"""
The fused CPU loops of the AttnRes read (depth_kernels.cpp), which the compiled reads run
for fp32 CPU tensors: forward and backward against the torch form of the same formulas
(ops.mix_forward, and the backward op with the kernels off) and against the plain formula
left to autograd (ops.depth_mix_reference), at shapes that hit the tile edges (a token
count not a multiple of the tile, d not a multiple of 8, one source), with the route
gradient accumulated into in place and a tensor the kernel refuses; and a failed build.
The kernel tests skip where the kernels do not build (no C++ compiler or ninja); the
reads then run the torch form.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
import ops  # noqa: E402

needs_kernels = pytest.mark.skipif(ops.fused_kernels() is None, reason='depth_kernels.cpp did not build here')

SHAPES = [(1, 1, 3, 8), (5, 2, 7, 13), (33, 4, 64, 64), (65, 1, 9, 256),  # (n, B, T, d)
          (3, 2, 300, 64)]  # 600 tokens: two tiles of 256 and a partial one


def inputs(n, B, T, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = [torch.randn(B, T, d, generator=g) * 2 for _ in range(n)]
    inv = [torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) for v in sources]
    return sources, inv, torch.randn(d, generator=g), torch.rand(d, generator=g) + 0.5


def torch_backward(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(ops, 'FUSED_CPU_READS', False)
        return ops.depth_mix_backward_op(*args)


@needs_kernels
@pytest.mark.parametrize('shape', SHAPES)
def test_forward_is_the_formula(shape):
    """z, a and r against the plain formula. z is judged by its error to the fp64 result:
    at most a few times the fp32 formula's own (how they round depends on the CPU's
    vector unit: AVX2 and AVX-512 builds differ in the last bits)."""
    sources, inv, w, g = inputs(*shape)
    n, B, T, d = shape
    z, a, r = ops.fused_kernels().mix_forward(sources, inv, w * g)
    z_ref, a_ref = ops.depth_mix_reference(sources, inv, w, g)
    z_64, _ = ops.depth_mix_reference([v.double() for v in sources], [s.double() for s in inv], w.double(), g.double())
    err, err_ref = (z.view(B, T, d).double() - z_64).abs().max(), (z_ref.double() - z_64).abs().max()
    assert err <= 4 * err_ref + 1e-6, (err, err_ref)
    torch.testing.assert_close(a.view(n, B, T), a_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.view(n, B, T), torch.stack(sources) @ (w * g), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('unrouted', [0, 1])
def test_backward_adds_into_the_route_gradient(shape, unrouted, monkeypatch):
    """Slots 0..routed-1 of g get the sources' gradients added in place (the rest of g is
    untouched); the last `unrouted` sources' come back apart; gw and gg as the torch form.
    Tolerance: the fp32 kernel may be off the fp64 result by at most a few times what the
    fp32 torch form is (the softmax backward's p_i - sum_j a_j p_j cancels)."""
    sources, inv, w, g = inputs(*shape, seed=1)
    n, B, T, d = shape
    routed = n - unrouted
    _, _, r = ops.mix_forward(sources, inv, w, g)
    gz = torch.randn(B, T, d, generator=torch.Generator().manual_seed(2))
    g0 = torch.randn(n + 2, B, T, d + 1, generator=torch.Generator().manual_seed(3))
    g_fused, g_torch = g0.clone(), g0.clone()
    gw, gg, rest = ops.depth_mix_backward_op(g_fused, gz, w, g, r, sources, inv, routed)
    gw_t, gg_t, rest_t = torch_backward(monkeypatch, g_torch, gz, w, g, r, sources, inv, routed)
    f64 = [t.double() for t in (g0, gz, w, g, r)]
    g_64 = f64[0].clone()
    gw_64, gg_64, rest_64 = torch_backward(monkeypatch, g_64, *f64[1:], [v.double() for v in sources],
                                           [s.double() for s in inv], routed)
    for fused, plain, exact in ((g_fused, g_torch, g_64), (rest, rest_t, rest_64), (gw, gw_t, gw_64),
                                (gg, gg_t, gg_64)):
        if exact.numel() == 0:
            continue
        err, err_torch = (fused.double() - exact).abs().max(), (plain.double() - exact).abs().max()
        assert err <= 4 * err_torch + 1e-6, (err, err_torch)
    assert torch.equal(g_fused[routed:], g0[routed:])  # slots not read are not touched


@needs_kernels
def test_backward_is_autograd_of_the_formula():
    """The kernel's gradients against autograd on the plain formula (an independent path):
    the route slots, started at zero, hold [dL/dv_i, dL/ds_i]."""
    sources, inv, w, g = inputs(9, 2, 11, 24, seed=4)
    leaves = [t.clone().requires_grad_() for t in sources + inv + [w, g]]
    vs, ss, wl, gl = leaves[:9], leaves[9:18], leaves[18], leaves[19]
    z, _ = ops.depth_mix_reference(vs, ss, wl, gl)
    gz = torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
    (z * gz).sum().backward()
    _, _, r = ops.mix_forward(sources, inv, w, g)
    route_g = torch.zeros(9, 2, 11, 25)
    gw, gg, _ = ops.depth_mix_backward_op(route_g, gz, w, g, r, sources, inv, 9)
    torch.testing.assert_close(route_g[..., :24], torch.stack([v.grad for v in vs]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(route_g[..., 24:], torch.stack([s.grad for s in ss]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, wl.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gg, gl.grad, rtol=1e-4, atol=1e-5)


@needs_kernels
def test_a_tensor_the_kernel_refuses_runs_the_torch_form(monkeypatch):
    """A non-contiguous source makes the kernel raise before it writes; the ops then run the
    torch form, with the same results, and g holds one read's gradients, not two."""
    sources, inv, w, g = inputs(4, 2, 5, 16, seed=6)
    sources[2] = torch.randn(2, 16, 5).transpose(1, 2)  # (2, 5, 16), not contiguous
    with pytest.raises(RuntimeError, match='contiguous'):
        ops.fused_kernels().mix_forward(sources, inv, w * g)
    route = torch.zeros(()).expand(4, 2, 5, 17)
    z, a, r, _ = ops.depth_mix_op(sources, inv, w, g, route, 4)
    torch.testing.assert_close(z, ops.depth_mix_reference(sources, inv, w, g)[0], rtol=1e-5, atol=1e-5)
    gz = torch.randn(2, 5, 16)
    g1, g2 = torch.zeros(4, 2, 5, 17), torch.zeros(4, 2, 5, 17)
    ops.depth_mix_backward_op(g1, gz, w, g, r, sources, inv, 4)
    torch_backward(monkeypatch, g2, gz, w, g, r, sources, inv, 4)
    torch.testing.assert_close(g1, g2)


@needs_kernels
def test_threads_give_the_same_result(monkeypatch):
    """The tiles split over threads (at::parallel_for): every token's z and route slots are
    the same bits with one thread or two; gu, summed per thread, differs only by rounding
    (both within 1e-4 of the fp64 result, relative to its largest entry)."""
    sources, inv, w, g = inputs(17, 4, 300, 40, seed=7)  # 1200 tokens, 3 tiles of 409
    _, _, r = ops.mix_forward(sources, inv, w, g)
    gz = torch.randn(4, 300, 40, generator=torch.Generator().manual_seed(9))
    out = []
    n = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            z, _, _ = ops.fused_kernels().mix_forward(sources, inv, w * g)
            route_g = torch.zeros(17, 4, 300, 41)
            gu, _ = ops.fused_kernels().mix_backward(route_g, gz, w * g, r, sources, inv, 17)
            out.append((z, route_g, gu))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    gw_64, _, _ = torch_backward(monkeypatch, torch.zeros(17, 4, 300, 41, dtype=torch.float64), gz.double(),
                                 w.double(), g.double(), r.double(), [v.double() for v in sources],
                                 [t.double() for t in inv], 17)
    gu_64 = gw_64 / g.double()
    for _, _, gu in out:
        assert (gu.double() - gu_64).abs().max() <= 1e-4 * gu_64.abs().max()


def test_a_failed_build_warns_once_and_the_reads_run_the_torch_form(monkeypatch):
    """Without a compiler (the build raises), one warning, then None at every call: the ops
    run the torch form and give the formula's result."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError('Ninja is required to load C++ extensions')
    monkeypatch.setattr(cpp_extension, 'load', no_compiler)
    monkeypatch.setattr(ops, '_kernels', {})
    with pytest.warns(UserWarning, match='did not build.*torch form'):
        assert ops.fused_kernels() is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # no second warning
        assert ops.fused_kernels() is None
        sources, inv, w, g = inputs(3, 2, 4, 8, seed=8)
        z, _, _, _ = ops.depth_mix_op(sources, inv, w, g, torch.zeros(()).expand(3, 2, 4, 9), 3)
    torch.testing.assert_close(z, ops.depth_mix_reference(sources, inv, w, g)[0], rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize('case', ['empty', 'fewer 1/rms', 'more 1/rms', 'same numel, other shape', 'd = 0'])
def test_bad_lists_raise_not_crash(case):
    """Each raises RuntimeError before the kernel reads anything (these crashed the process
    when only element counts were checked)."""
    sources, inv, w, g = inputs(3, 2, 8, 16, seed=10)
    u = w * g
    if case == 'empty':
        sources, inv = [], []
    elif case == 'fewer 1/rms':
        inv = inv[:1]
    elif case == 'more 1/rms':
        sources = sources[:1]
    elif case == 'same numel, other shape':
        sources[2] = sources[2].reshape(8, 2, 16).contiguous()
    else:
        sources, inv, u = [torch.zeros(2, 8, 0)] * 3, inv, torch.zeros(0)
    with pytest.raises(RuntimeError, match='depth_kernels'):
        ops.fused_kernels().mix_forward(sources, inv, u)


@pytest.mark.parametrize('n_inv, routed', [(2, 3), (3, 4), (3, -1)])
def test_the_ops_refuse_bad_lists_and_routed(n_inv, routed):
    """The ops check list lengths and routed themselves (O(1)): the torch form would
    broadcast a short 1/rms list or slice with a bad routed and answer wrongly."""
    sources, inv, w, g = inputs(3, 2, 5, 8, seed=11)
    inv = inv[:n_inv]
    with pytest.raises(ValueError, match='routed'):
        ops.depth_mix_op(sources, inv, w, g, torch.zeros(()).expand(3, 2, 5, 9), routed)
    with pytest.raises(ValueError, match='routed'):
        ops.depth_mix_backward_op(torch.zeros(3, 2, 5, 9), torch.zeros(2, 5, 8), w, g, torch.zeros(3, 2, 5),
                                  sources, inv, routed)


class CountingKernels:
    """The built kernels, counting their calls."""

    def __init__(self, ext):
        self.ext, self.calls = ext, []

    def mix_forward(self, *args):
        self.calls.append('forward')
        return self.ext.mix_forward(*args)

    def mix_backward(self, *args):
        self.calls.append('backward')
        return self.ext.mix_backward(*args)


@needs_kernels
def test_eager_read_runs_the_kernels(monkeypatch):
    """The eager DepthMixFunction (no route: evaluation, or UNROLL_DEPTH_READS) runs the
    forward kernel for fp32 CPU tensors and its torch-form backward on the kernel's r: its
    gradients are the plain formula's, judged by error to fp64 against the torch form's,
    with and without a gradient into the weights a."""
    sources, inv, w, g = inputs(7, 2, 33, 24, seed=12)
    gz = torch.randn(2, 33, 24, generator=torch.Generator().manual_seed(13))

    def grads(dtype, fused, use_a=False):
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in sources + inv + [w, g]]
        with monkeypatch.context() as m:
            m.setattr(ops, 'FUSED_CPU_READS', fused)
            z, a = ops.DepthMixFunction.apply(leaves[14], leaves[15], *leaves[:14])
            loss = (z * gz.to(dtype)).sum()
            (loss + (a.sum(-1) ** 2).sum() if use_a else loss).backward()
        return [t.grad.double() for t in leaves]
    counting = CountingKernels(ops.fused_kernels())
    monkeypatch.setitem(ops._kernels, 'ext', counting)
    fused, plain, exact = grads(torch.float32, True), grads(torch.float32, False), grads(torch.float64, False)
    assert counting.calls == ['forward']
    for f, p, e in zip(fused, plain, exact):
        assert (f - e).abs().max() <= 4 * (p - e).abs().max() + 1e-6
    counting.calls.clear()
    fused_a, exact_a = grads(torch.float32, True, use_a=True), grads(torch.float64, False, use_a=True)
    assert counting.calls == ['forward']
    for f, e in zip(fused_a, exact_a):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-5)
