"""
The numerical core of the schemes that need more than a residual add: AttnRes's depth
softmax, HC/mHC's normed routing projection and mHC's Sinkhorn projection, and MoDA's
joint sequence-and-depth attention (paper Table 1, Appendix A; docs/schemes.md). residuals.py wires them
into the schemes; this file is only the math, on plain tensors.

Each operation has its formula, shapes and dtypes in its docstring, and most come in two
forms: the plain formula left to autograd (`*_reference`, what the tests check against)
and a fast form with a hand-written backward (a torch.autograd.Function), written so
that no (n, B, T, d) stack of sources or slots is kept for the backward, and so that
torch.compile traces it into one graph. The depth reads whose sources accumulate with
depth (AttnRes, Block AttnRes, MoDA) are opaque ops under torch.compile instead, so that
the compiled graph grows linearly in L ("the depth reads as opaque ops" below); on the CPU in
fp32 the AttnRes ops run the fused loops of depth_kernels.cpp (`fused_kernels`). Why each form
is what it is, and what it measured against the alternatives, is in its docstring;
docs/performance.md and docs/gpu.md have the whole-model numbers.
"""

import contextlib
import numbers

import torch
import torch.nn.functional as F


# ---- Attention Residuals: depth softmax --------------------------------------

def _promoted_dtype(tensors):
    """The dtype of a sum of `tensors` under type promotion (fp32 when an fp32 embedding
    is mixed with bf16 sublayer outputs)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class DepthMixFunction(torch.autograd.Function):
    """The AttnRes read of `depth_mix` with a hand-written backward (arXiv 2603.15031;
    paper Appendix A; memory: docs/performance.md). Call as

        z, a = DepthMixFunction.apply(query, key_gain, *sources, *inv_rmses)

    Why: autograd on the plain formula (`depth_mix_reference`) saves a stacked copy of
    all n sources at every read, O(n B T d) bytes per read and O(L^2 B T d) per forward
    pass, which ran out of memory in public ports. This saves only the n dot products
    r (n, B, T) per token and references to the sources and their 1/rms (alive anyway:
    they are earlier sublayers' outputs, kept in the AttnRes state); backward recomputes
    the softmax weights a from them, a cheap (n, B, T) op. Every sum over sources is
    batched over a stack only while that stack is small enough to stay in cache, else a
    loop of in-place ops over the n tensors (`stack_if_small`); no stack is kept for the
    backward. Under torch.compile `depth_mix`
    calls the opaque `depth_mix_op` instead (unless UNROLL_DEPTH_READS, when inductor
    traces and fuses these loops, at a compile time that grows as L^2).

    Logits, softmax and the sum z are accumulated in fp32 (fp64 for fp64 inputs); z is
    returned in the sources' promoted dtype. With e_i = r_i s_i, r_i = v_i . u, u = w * g,
    a = softmax(e), z = sum_i a_i v_i, and incoming gradients gz, ga:
        p_i  = gz . v_i + ga_i                    (gradient reaching a_i)
        ge_i = a_i (p_i - sum_j a_j p_j)           (softmax backward)
        gv_i = a_i gz + ge_i s_i u,  gs_i = ge_i r_i,  gu = sum_{i,b,t} ge_i s_i v_i,
        gw = gu * g,  gg = gu * w."""

    @staticmethod
    def forward(ctx, query, key_gain, *tensors):
        n = len(tensors) // 2
        sources, inv_rmses = tensors[:n], tensors[n:]
        # fp32 CPU: depth_kernels.cpp. (Training steps read through depth_mix_op on a route, whose
        # backward op runs the fused backward; this Function trains only under UNROLL_DEPTH_READS.)
        out = fused_mix_forward(sources, inv_rmses, query, key_gain)
        z, a, r = out if out is not None else mix_forward(sources, inv_rmses, query, key_gain)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(query, key_gain, r, *sources, *inv_rmses)
        return z.to(_promoted_dtype(sources)), a

    @staticmethod
    @torch.autograd.function.once_differentiable  # r is saved, not recomputed: no double backward
    def backward(ctx, gz, ga):
        query, key_gain, r, *tensors = ctx.saved_tensors
        n = len(tensors) // 2
        sources, inv_rmses = tensors[:n], tensors[n:]
        need_w, need_g = ctx.needs_input_grad[:2]
        need_v, need_s = ctx.needs_input_grad[2:2 + n], ctx.needs_input_grad[2 + n:]
        gz = torch.zeros(sources[0].shape, dtype=r.dtype, device=r.device) if gz is None else gz.to(r.dtype)
        u, a, ge, c, gu = mix_backward_terms(gz, ga, query, key_gain, r, sources, inv_rmses, need_w or need_g)
        gv = [(a[i].unsqueeze(-1) * gz).addcmul_(c[i].unsqueeze(-1), u).to(v.dtype) if need_v[i] else None
              for i, v in enumerate(sources)]                                   # n x (B, T, d)
        gs = [(ge[i] * r[i]).unsqueeze(-1).to(inv_rmses[i].dtype) if need_s[i] else None
              for i in range(n)]                                                # n x (B, T, 1)
        gw = (gu * key_gain.to(r.dtype)).to(query.dtype) if need_w else None
        gg = (gu * query.to(r.dtype)).to(key_gain.dtype) if need_g else None
        return (gw, gg, *gv, *gs)


def fused_mix_forward(sources, inv_rmses, query, key_gain):
    """DepthMixFunction's forward in the fused loop of depth_kernels.cpp: (z (B, T, d),
    a, r (n, B, T)) fp32, or None when the read is not all fp32 CPU tensors the kernel
    takes (`fused_read`; the caller then runs `mix_forward`, the same formulas)."""
    kernels, shape = fused_read(sources[0]), sources[0].shape
    if kernels is None:
        return None
    try:
        z, a, r = kernels.mix_forward(list(sources), list(inv_rmses), query * key_gain)  # (N, d), (n, N), (n, N)
    except RuntimeError:  # a tensor the kernel does not take (see fused_read)
        return None
    return z.view(shape), a.view(-1, *shape[:2]), r.view(-1, *shape[:2])


STACK_BYTES = 4 << 20  # a read stacks its sources for batched ops when the stack takes at most this


def stack_if_small(tensors, dtype):
    """tensors stacked on a new first dim in `dtype`, (n, ...), if that takes at most
    STACK_BYTES (it stays in the CPU's cache), else None: the read then loops over them,
    one in-place op per source, and makes no (n, ...) temporary. On a 2-core CPU the
    batched ops were 2x faster per read than the loop at 33 sources of (4, 64, 64); a
    stack of 33 sources of (8, 128, 256), 35 MB, made the forward 9x slower than the loop."""
    if len(tensors) * tensors[0].numel() * dtype.itemsize > STACK_BYTES:
        return None
    return torch.stack(tensors).to(dtype)


def mix_forward(sources, inv_rmses, query, key_gain):
    """DepthMixFunction's forward formulas: (z (B, T, d), a, r (n, B, T)), all in the
    accumulation dtype (fp32, or fp64 for fp64 inputs); sums over sources as batched ops
    over a small stack, or one in-place add per source (`stack_if_small`)."""
    with no_autocast(query):  # fp32 math, as documented, also under autocast
        acc = torch.promote_types(_promoted_dtype(sources), torch.float32)          # fp32 (fp64 in gradcheck)
        u = query.to(acc) * key_gain.to(acc)                                        # (d,)
        V = stack_if_small(sources, acc)                                            # (n, B, T, d) or None
        r = V @ u if V is not None else torch.stack([v.to(acc) @ u for v in sources])  # (n, B, T)
        s = torch.cat(inv_rmses, dim=-1).to(acc).movedim(-1, 0)                     # (n, B, T)
        a = torch.softmax(r * s, dim=0)                                             # (n, B, T)
        if V is not None:
            return (a.unsqueeze(-1) * V).sum(0), a, r
        z = torch.zeros(sources[0].shape, dtype=acc, device=sources[0].device)      # (B, T, d)
        for i, v in enumerate(sources):
            z.addcmul_(a[i].unsqueeze(-1), v)
        return z, a, r


def mix_backward_terms(gz, ga, query, key_gain, r, sources, inv_rmses, need_gu=True):
    """The backward of DepthMixFunction up to the per-source gradients: (u (d,), a, ge, c
    (n, B, T), gu (d,) or None), with gz (B, T, d) in r's dtype and ga (n, B, T) or None;
    formulas in DepthMixFunction's docstring. gv_i = a_i gz + c_i u and gs_i = ge_i r_i."""
    with no_autocast(query):  # fp32 math, as documented, also under autocast
        acc, d = r.dtype, gz.size(-1)
        u = query.to(acc) * key_gain.to(acc)                                        # (d,)
        s = torch.cat(inv_rmses, dim=-1).to(acc).movedim(-1, 0)                     # (n, B, T)
        a = torch.softmax(r * s, dim=0)                                             # (n, B, T), as in forward
        V = stack_if_small(sources, acc)                                            # (n, B, T, d) or None
        p = (torch.linalg.vecdot(V, gz) if V is not None else
             torch.stack([torch.linalg.vecdot(v.to(acc), gz) for v in sources]))    # (n, B, T)
        if ga is not None:
            p = p + ga
        ge = a * (p - (a * p).sum(0, keepdim=True))                                 # (n, B, T)
        c = ge * s                                                                  # (n, B, T), reaches r
        gu = None
        if need_gu and V is not None:
            gu = c.reshape(-1) @ V.reshape(-1, d)                                   # (d,)
        elif need_gu:
            gu = torch.zeros(d, dtype=acc, device=r.device)
            for i, v in enumerate(sources):
                gu.addmv_(v.reshape(-1, d).to(acc).t(), c[i].reshape(-1))           # (d,)
        return u, a, ge, c, gu


def check_depth_mix_args(sources, inv_rmses, query, key_gain):
    """Raises ValueError unless `depth_mix` can take these: n >= 1 sources of one shape
    (B, T, d), n 1/rms tensors (B, T, 1), query and key gain (d,)."""
    if not sources or len(sources) != len(inv_rmses):
        raise ValueError(f"depth_mix needs at least one source and one 1/rms per source; got "
                         f"{len(sources)} sources and {len(inv_rmses)} 1/rms tensors")
    shape = sources[0].shape
    if len(shape) != 3:
        raise ValueError(f"depth_mix: sources must be (B, T, d), got shape {tuple(shape)}")
    for name, ts, want in (('source', sources, shape), ('1/rms', inv_rmses, shape[:2] + (1,))):
        for i, t in enumerate(ts):
            if t.shape != want:
                raise ValueError(f"depth_mix: {name} {i} has shape {tuple(t.shape)}, expected {tuple(want)}")
    for name, t in (('query', query), ('key gain', key_gain)):
        if t.shape != shape[2:]:
            raise ValueError(f"depth_mix: {name} has shape {tuple(t.shape)}, expected ({shape[2]},)")


def depth_mix_reference(sources, inv_rmses, query, key_gain):
    """`depth_mix` written as the plain formula, left to autograd: stacks the sources,
    (n, B, T, d), and autograd keeps that stack for backward at every read. The reference
    that tests check DepthMixFunction against; same arguments, returns and errors as depth_mix."""
    check_depth_mix_args(sources, inv_rmses, query, key_gain)
    V = torch.stack(sources)                                   # (n, B, T, d)
    acc = torch.promote_types(V.dtype, torch.float32)
    s = torch.stack(inv_rmses).squeeze(-1).to(acc)             # (n, B, T)
    logits = (V @ (query * key_gain).to(V.dtype)).to(acc) * s  # (n, B, T)
    a = torch.softmax(logits, dim=0)                           # (n, B, T)
    z = torch.einsum('nbt,nbtd->btd', a.to(V.dtype), V)        # (B, T, d)
    return z, a


def depth_mix(sources, inv_rmses, query, key_gain, route=None, routed=None):
    """Depth attention of AttnRes (arXiv 2603.15031; paper Table 1, Appendix A):

        e_i = w^T RMSNorm_key(v_i) = (v_i . (w * g)) / rms(v_i),   a = softmax_i(e),   z = sum_i a_i v_i

    sources: n >= 1 tensors v_i (B, T, d); inv_rmses: their 1/rms (B, T, 1), computed once
    per source; query w and key-norm gain g: (d,). No 1/sqrt(d), temperature 1; logits,
    softmax and the sum in fp32. Scoring with v . (w * g) never materialises the
    normalised keys, and the backward (DepthMixFunction) keeps no stacked copy of the
    sources: saved memory per read is n fp32 numbers per token, not n copies of (B, T, d).
    Gradients flow into the sources, their 1/rms, w and g.
    Returns z (B, T, d) in the sources' (promoted) dtype and the weights a (n, B, T) in fp32.
    route: None (eager), or under torch.compile the `open_route` on whose slots 0..routed-1
    the first `routed` sources (default: all) were put (`route_write`): the read is then one
    opaque op, `a` carries no gradient, and the route after the read is returned third
    (z, a, route): later writes and reads must take that one.
    Raises ValueError if the lists are empty or differ in length, or for a shape that
    does not fit the above."""
    check_depth_mix_args(sources, inv_rmses, query, key_gain)
    if route is None:
        return DepthMixFunction.apply(query, key_gain, *sources, *inv_rmses)
    z, a, _, route = depth_mix_op(list(sources), list(inv_rmses), query, key_gain, route,
                                  len(sources) if routed is None else routed)
    return z, a, route


# ---- Under torch.compile: the depth reads as opaque ops -----------------------
#
# Whole-model torch.compile traces the Python loops of DepthMixFunction and DepthReadFunction:
# read k of Full AttnRes has k + 1 sources, so the graph holds O(L^2) source terms, the
# backward sums every source's gradient over all later reads (O(L^2) more adds), and
# inductor compiles a kernel for each distinct n: compile time grew as L^2 (docs/gpu.md).
# Under torch.compile the reads are therefore custom ops (torch.library), one node per
# read whatever n, that run the same formulas as the Functions eagerly inside (for AttnRes on
# the CPU in fp32, the fused loops of depth_kernels.cpp), and the sources' gradients travel
# along a *route* instead of one autograd edge per (read, source) pair:
#   - a route stands for N slots (slot i = source i); its value is never read (it is a
#     zero-stride zero tensor, no memory), only its gradient (N, B, T, width) is used;
#   - a read takes the route that covers its sources and returns a new one, which the
#     next writes and reads take: the routes form one chain through the forward pass;
#   - in the backward one gradient buffer runs down that chain: each read adds its
#     sources' gradients into their slots *in place* (only the slots it read), and
#     `route_write(route, i, *tensors)`, which put source i on the route, hands slot i to
#     the tensors and passes the buffer on.
# Autograd then sees one fixed-shape gradient per route and no per-source sums, and the
# compiled graph grows as O(L); inductor turns the functional form of the in-place adds
# back into one buffer. Eager AttnRes training steps take a route too (open_route's
# `eager`: the in-place adds beat autograd's per-source sums there as well); eager MoDA
# and evaluation (no route) run the same formulas through the Functions.
# UNROLL_DEPTH_READS = True restores the traced loops (and no route anywhere).

UNROLL_DEPTH_READS = False  # True: torch.compile traces the reads' loops (inductor fuses them; compile time O(L^2))
FUSED_CPU_READS = True  # False: the AttnRes reads on CPU (eager and compiled) run their torch form, not depth_kernels.cpp

_kernels = {}  # the built extension (or None: it did not build), built once per process


def fused_kernels():
    """The fused CPU loops of the AttnRes read (depth_kernels.cpp, forward and backward in
    fp32), built on first use with torch.utils.cpp_extension (about a minute, then cached
    under ~/.cache/torch_extensions), or None when FUSED_CPU_READS is off or the build
    failed (one warning; the reads then run their torch form, same results)."""
    if not FUSED_CPU_READS:
        return None
    if 'ext' not in _kernels:
        import os, sys, threading, warnings
        from torch.utils import cpp_extension
        cap = torch.backends.cpu.get_cpu_capability()  # the build is specific to the CPU's vector unit
        simd = ['-mavx2', '-mfma'] if cap in ('AVX2', 'AVX512') else []
        # a cached build loads in a second; a first build takes up to a minute: say so, once
        notice = threading.Timer(3.0, lambda: print(
            "ops: building depth_kernels.cpp (the fused CPU AttnRes reads), once per machine; "
            "about a minute", file=sys.stderr, flush=True))
        notice.start()
        try:
            _kernels['ext'] = cpp_extension.load(
                name=f'depthbench_kernels_{cap.lower()}',
                sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)), 'depth_kernels.cpp')],
                extra_cflags=['-O3', '-fopenmp', '-fno-math-errno'] + simd, extra_ldflags=['-fopenmp'])
        except Exception as e:  # no compiler, no ninja, ...: the torch form is the same math
            warnings.warn(f"ops: depth_kernels.cpp did not build ({type(e).__name__}: {str(e)[:200]}); "
                          "the AttnRes reads on CPU use their torch form (same results, slower)")
            _kernels['ext'] = None
        finally:
            notice.cancel()
    return _kernels['ext']


def fused_read(like):
    """The fused CPU kernels for a read whose first source is `like`, if it is an fp32 CPU
    tensor (the kernels' only dtype; bf16 under autocast, fp64 in gradcheck and GPU tensors
    run the torch form), else None. The kernels check every other tensor themselves and
    raise RuntimeError, before writing anything, for one they cannot take (not contiguous,
    another dtype or size): the caller then runs the torch form. None while torch.compile
    traces (DepthMixFunction under UNROLL_DEPTH_READS: inductor fuses its torch form; the
    opaque ops run outside the trace and take the kernels)."""
    if torch.compiler.is_compiling() or like.device.type != 'cpu' or like.dtype != torch.float32:
        return None
    return fused_kernels()


def check_read_lists(sources, inv_rmses, routed):
    """Raises ValueError unless a depth_mix op can take these lists: n >= 1 sources, as many
    1/rms tensors, 0 <= routed <= n. (O(1): `depth_mix` has checked the shapes; the kernels
    check them again, and the torch form's stack refuses unequal ones.)"""
    n = len(sources)
    if n == 0 or len(inv_rmses) != n or not 0 <= routed <= n:
        raise ValueError(f"depth_mix op: need n >= 1 sources, as many 1/rms tensors and 0 <= routed <= n; got "
                         f"{n} sources, {len(inv_rmses)} 1/rms tensors, routed={routed}")


def open_route(like, n_slots, width, eager=False):
    """A route for `n_slots` slots of shape like.shape[:-1] + (width,) in fp32 (fp64 for
    fp64), or None where the reads take their sources' gradients through autograd
    directly: with UNROLL_DEPTH_READS, and outside torch.compile unless `eager` (then
    while grad is enabled: evaluation has no gradient to route). The AttnRes schemes
    pass eager=True: one buffer added into in place beats autograd's sum of a gradient per
    (read, source) pair in eager mode too (docs/performance.md); MoDA's reads do not gain."""
    if UNROLL_DEPTH_READS or not (torch.compiler.is_compiling() or (eager and torch.is_grad_enabled())):
        return None
    acc = torch.promote_types(like.dtype, torch.float32)
    return like.new_zeros((), dtype=acc).expand(n_slots, *like.shape[:-1], width)


class RouteWrite(torch.autograd.Function):
    """Puts `tensors` (each (...) + (w_j,), concatenated along the last dim to fill one slot)
    on slot k of a route. Forward: a new route (the value does not matter); backward:
    the route's gradient g goes on to the earlier route, g[k] split along the last dim to
    the tensors (cast to their dtypes)."""

    @staticmethod
    def forward(ctx, route, k, *tensors):
        ctx.k, ctx.sizes, ctx.dtypes = k, [t.size(-1) for t in tensors], [t.dtype for t in tensors]
        return route.new_zeros(()).expand(route.shape)

    @staticmethod
    def backward(ctx, g):
        parts = route_slot(g, ctx.k).split(ctx.sizes, dim=-1)
        return (g, None, *(p.to(dt) for p, dt in zip(parts, ctx.dtypes)))


def route_write(route, k, *tensors):
    """`RouteWrite` of tensors on slot k, or None (no route: outside torch.compile). Under
    no_grad (evaluation, inference) the same route: there is no gradient to route, and
    torch.compile does not trace the Function's forward there (a graph break per block)."""
    if route is None:
        return None
    assert 0 <= k < route.size(0) and sum(t.size(-1) for t in tensors) == route.size(-1)
    if not torch.is_grad_enabled():
        return route
    return RouteWrite.apply(route, k, *tensors)


@torch.library.custom_op('depthbench::route_slot', mutates_args=())
def route_slot(g: torch.Tensor, k: int) -> torch.Tensor:
    """g[k], a copy. An op of its own so that the slot's offset is an argument, not a
    constant compiled into a different kernel for every slot."""
    return g[k].clone()


@route_slot.register_fake
def _(g, k):
    return g.new_empty(g.shape[1:])


def route_after(route):
    """A new route of the same shape, the output of a read (whose value, as every route's, is never read)."""
    return route.new_zeros(()).expand(route.shape)


@torch.library.custom_op('depthbench::depth_mix', mutates_args=())
def depth_mix_op(sources: list[torch.Tensor], inv_rmses: list[torch.Tensor], query: torch.Tensor,
                 key_gain: torch.Tensor, route: torch.Tensor, routed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The read of DepthMixFunction as one opaque op: (z, a, r, the route after the read).
    Sources i < routed sit on route slots i; their gradients (and their 1/rms's) come back
    through the route, width d + 1; the rest (Block AttnRes's partial sum) get theirs as
    usual. Inside, the same formulas as DepthMixFunction: the fused CPU loop of
    depth_kernels.cpp for fp32 CPU tensors (`fused_read`), else `mix_forward`."""
    check_read_lists(sources, inv_rmses, routed)
    out = fused_mix_forward(sources, inv_rmses, query, key_gain)
    z, a, r = out if out is not None else mix_forward(sources, inv_rmses, query, key_gain)
    return z.to(_promoted_dtype(sources)), a, r, route_after(route)


@depth_mix_op.register_fake
def _(sources, inv_rmses, query, key_gain, route, routed):
    dtype = _promoted_dtype(sources)
    v, n = sources[0], len(sources)
    acc = torch.promote_types(dtype, torch.float32)
    return (v.new_empty(v.shape, dtype=dtype), v.new_empty((n,) + v.shape[:2], dtype=acc),
            v.new_empty((n,) + v.shape[:2], dtype=acc), route_after(route))


@torch.library.custom_op('depthbench::depth_mix_backward', mutates_args=('g',))
def depth_mix_backward_op(g: torch.Tensor, gz: torch.Tensor, query: torch.Tensor, key_gain: torch.Tensor,
                          r: torch.Tensor, sources: list[torch.Tensor], inv_rmses: list[torch.Tensor],
                          routed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of DepthMixFunction (formulas in its docstring) as one opaque op. Adds
    source i's [gv_i, gs_i] into slot i of g, the route's gradient (N, B, T, d + 1) fp32,
    in place for i < routed (only the slots read are touched); returns (gw, gg, and the
    [gv_i, gs_i] of the sources i >= routed stacked, (n - routed, B, T, d + 1) fp32).
    (A mutating op may not return a list of tensors, hence the stack.) fp32 CPU tensors run
    the fused loop of depth_kernels.cpp (`fused_read`), the rest the torch form below."""
    check_read_lists(sources, inv_rmses, routed)
    n, d, acc = len(sources), gz.size(-1), r.dtype
    kernels = fused_read(sources[0])
    if kernels is not None:
        try:
            gu, rest = kernels.mix_backward(g, gz, query * key_gain, r, sources, inv_rmses, routed)
            return gu * key_gain, gu * query, rest.view(-1, *g.shape[1:])
        except RuntimeError:  # raised before g is touched: the torch form below
            pass
    with no_autocast(query):
        gz = gz.to(acc)
        u, a, ge, c, gu = mix_backward_terms(gz, None, query, key_gain, r, sources, inv_rmses)
        k = routed  # slot i += [gv_i, gs_i] = [a_i gz + c_i u, ge_i r_i], all k slots in one op each
        g[:k, ..., :d].addcmul_(a[:k].unsqueeze(-1), gz).addcmul_(c[:k].unsqueeze(-1), u)
        g[:k, ..., d] += ge[:k] * r[:k]
        rest = g.new_empty((0,) + g.shape[1:]) if k == n else torch.cat(
            [(a[k:].unsqueeze(-1) * gz).addcmul_(c[k:].unsqueeze(-1), u), (ge[k:] * r[k:]).unsqueeze(-1)],
            dim=-1)                                                                   # (n - k, B, T, d + 1)
    return (gu * key_gain.to(acc)).to(query.dtype), (gu * query.to(acc)).to(key_gain.dtype), rest


@depth_mix_backward_op.register_fake
def _(g, gz, query, key_gain, r, sources, inv_rmses, routed):
    return (torch.empty_like(query), torch.empty_like(key_gain),
            g.new_empty((len(sources) - routed,) + g.shape[1:]))


def route_grad(g, ctx):
    """The incoming gradient of a read's output route, which the read's backward adds to in
    place: zeros (N, ...) fp32 when nothing after the read used the route (the last read),
    a dense copy if it came as a broadcast (a zero-stride tensor cannot be written)."""
    if g is None:
        return torch.zeros(ctx.route_shape, dtype=ctx.route_dtype, device=ctx.route_device)
    return g.contiguous()


def _save_route(ctx, route):
    ctx.route_shape, ctx.route_dtype, ctx.route_device = route.shape, route.dtype, route.device


def _depth_mix_setup(ctx, inputs, output):
    sources, inv_rmses, query, key_gain, route, routed = inputs
    ctx.n, ctx.routed = len(sources), routed
    _save_route(ctx, route)
    ctx.save_for_backward(query, key_gain, output[2], *sources, *inv_rmses)
    ctx.mark_non_differentiable(output[1], output[2])  # a is for traces only; r is saved


def _depth_mix_op_backward(ctx, gz, ga, gr, groute):
    query, key_gain, r, *tensors = ctx.saved_tensors
    n, k = ctx.n, ctx.routed
    gz = torch.zeros_like(tensors[0]) if gz is None else gz.contiguous()  # the fused kernel takes contiguous rows
    groute = route_grad(groute, ctx)  # the later reads' sum: this read adds its own to it, in place
    gw, gg, rest = depth_mix_backward_op(groute, gz, query, key_gain, r, tensors[:n], tensors[n:], k)
    d = gz.size(-1)
    gv = [None] * k + [g[..., :d].to(v.dtype) for g, v in zip(rest, tensors[k:n])]
    gs = [None] * k + [g[..., d:].to(t.dtype) for g, t in zip(rest, tensors[n + k:])]
    return gv, gs, gw, gg, groute, None


depth_mix_op.register_autograd(_depth_mix_op_backward, setup_context=_depth_mix_setup)


@torch.library.custom_op('depthbench::depth_read', mutates_args=())
def depth_read_op(q: torch.Tensor, depth_k: list[torch.Tensor], depth_v: list[torch.Tensor], scale: float,
                  route: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The read of DepthReadFunction as one opaque op (the same formulas, `read_forward`):
    (y, lse, a, the route after the read). Slot j's key and value sit on route slot j,
    width 2 hd ([K_j, V_j])."""
    y, lse, a = read_forward(q, depth_k, depth_v, scale)
    return y.to(q.dtype), lse, a, route_after(route)


@depth_read_op.register_fake
def _(q, depth_k, depth_v, scale, route):
    acc = torch.promote_types(q.dtype, torch.float32)
    return (torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=acc),
            q.new_empty((len(depth_k),) + q.shape[:-1], dtype=acc), route_after(route))


@torch.library.custom_op('depthbench::depth_read_backward', mutates_args=('g',))
def depth_read_backward_op(g: torch.Tensor, gy: torch.Tensor, glse: torch.Tensor, q: torch.Tensor, a: torch.Tensor,
                           depth_k: list[torch.Tensor], depth_v: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The backward of DepthReadFunction (formulas in its docstring) as one opaque op. Adds
    [gK_j, gV_j] into slot j < S of g, the route's gradient (N, B, H_kv, T, 2 hd) fp32, in
    place; returns gq."""
    hd = q.size(-1)
    gy, gd, gq = read_backward_terms(gy, glse, q, a, depth_k, depth_v, scale)
    for j in range(len(depth_k)):
        gk, gv = slot_grads(j, q, a, gd, gy)
        g[j, ..., :hd] += gk
        g[j, ..., hd:] += gv
    return gq.to(q.dtype)


@depth_read_backward_op.register_fake
def _(g, gy, glse, q, a, depth_k, depth_v, scale):
    return torch.empty_like(q)


def _depth_read_setup(ctx, inputs, output):
    q, depth_k, depth_v, scale, route = inputs
    ctx.S, ctx.scale = len(depth_k), scale
    _save_route(ctx, route)
    ctx.save_for_backward(q, output[2], *depth_k, *depth_v)
    ctx.mark_non_differentiable(output[2])


def _depth_read_op_backward(ctx, gy, glse, ga, groute):
    q, a, *slots = ctx.saved_tensors
    S = ctx.S
    gy = torch.zeros_like(q) if gy is None else gy
    glse = torch.zeros_like(a[0]) if glse is None else glse
    groute = route_grad(groute, ctx)
    gq = depth_read_backward_op(groute, gy, glse, q, a, slots[:S], slots[S:], ctx.scale)
    return gq, [None] * S, [None] * S, None, groute


depth_read_op.register_autograd(_depth_read_op_backward, setup_context=_depth_read_setup)


# ---- Hyper-Connections: routing projection, Sinkhorn -------------------------

def no_autocast(x):
    """Context in which autocast is off on x's device, so that routing math runs in the
    dtype its inputs are given in (the streams' dtype, or fp32 where a scheme casts).
    The 'meta' device (shape-only runs, e.g. cost.flop_check) has no autocast to turn off."""
    if x.device.type == 'meta':
        return contextlib.nullcontext()
    return torch.autocast(device_type=x.device.type, enabled=False)


def sinkhorn(logits, iters, eps=0.0):
    """Sinkhorn-Knopp projection of exp(logits) towards a doubly stochastic matrix (mHC,
    arXiv 2512.24880): `iters` rounds of row then column normalisation.

    logits: (..., m, m), any float dtype, finite. Returns P (..., m, m), fp32 (fp64 for fp64
    logits), non-negative, with columns summing to 1 (the last step; 1 - O(eps) with eps)
    and rows approximately: Sinkhorn converges at a rate set by the spread of the logits,
    and 20 rounds reach 1e-3 for logits within about +-2 of a row/column rescaling, not
    for arbitrary ones.
    eps = 0: the first round runs in the log domain (log_softmax over rows, softmax over
    columns), which leaves every row and column sum in [1/m^2, m] whatever the logits'
    range (+-50 included); the other rounds divide by sums that are therefore never small,
    and entries too small for fp32 underflow to 0 harmlessly.
    eps > 0: liger_kernel's mHC Sinkhorn (ops/mhc.py, _mhc_split_sinkhorn_fwd_kernel): a
    stable softmax over rows, eps added to every entry, then every division is by
    (sum + eps): P <- softmax_row(z) + eps, P <- P / (colsum + eps), then iters - 1 rounds
    of P <- P / (rowsum + eps), P <- P / (colsum + eps). The eps floor keeps every sum
    >= eps, and lifts entries that would be ~0 to ~eps (which matters for logits with a
    spread of tens).
    Autocast off throughout. Under torch.compile the later rounds keep P's row and column
    scalings instead (`sinkhorn_scalings`): the same iterate up to rounding.
    Raises ValueError for non-square logits, iters not an integer >= 1, or eps < 0."""
    if logits.dim() < 2 or logits.size(-1) != logits.size(-2):
        raise ValueError(f"sinkhorn needs square (..., m, m) logits, got shape {tuple(logits.shape)}")
    return sinkhorn_leading(logits.movedim((-2, -1), (0, 1)), iters, eps).movedim((0, 1), (-2, -1))


def check_sinkhorn_iters(iters, name='iters'):
    """iters as an int; raises ValueError, naming it `name`, unless it is an integer >= 1
    (bool and float are not)."""
    if isinstance(iters, bool) or not isinstance(iters, numbers.Integral) or iters < 1:
        raise ValueError(f"{name} must be an int >= 1 (the number of Sinkhorn rounds), got {iters!r}")
    return int(iters)


def sinkhorn_leading(logits, iters, eps=0.0):
    """`sinkhorn` on matrices laid out along the two leading dims: (m, m, ...) -> (m, m, ...).
    The row and column sums then add whole vectors of tokens, several times faster on CPU
    than reducing over two trailing dims of size m. Raises ValueError as `sinkhorn` does."""
    if logits.dim() < 2 or logits.size(0) != logits.size(1):
        raise ValueError(f"sinkhorn_leading needs square (m, m, ...) logits, got shape {tuple(logits.shape)}")
    iters = check_sinkhorn_iters(iters)
    if not eps >= 0:
        raise ValueError(f"sinkhorn eps must be >= 0, got {eps!r}")
    eps = float(eps)
    with no_autocast(logits):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)).contiguous()  # fp32 (fp64 stays)
        if eps == 0:
            P = torch.softmax(torch.log_softmax(z, dim=1), dim=0)  # round 1 in the log domain
        else:  # liger_kernel's first round: stable row softmax, + eps, column division by (sum + eps)
            P = torch.softmax(z, dim=1) + eps
            P = P / (P.sum(0, keepdim=True) + eps)
        if iters == 1:
            return P
        if torch.compiler.is_compiling():
            return sinkhorn_scalings(P, iters - 1, eps)
        return SinkhornRounds.apply(P, iters - 1, eps)


@torch.compiler.nested_compile_region  # traced and compiled once, reused by every sublayer
def sinkhorn_scalings(P, iters, eps=0.0):
    """`iters` rounds of Sinkhorn on P (m, m, ...) > 0 kept as diag(r) P diag(c): per round
    r <- r / (r (P c) + eps) over rows, then c <- c / (c (P^T r) + eps) over columns (with
    eps = 0: r = 1 / (P c), c = 1 / (P^T r)); returns diag(r) P diag(c), the numbers
    `SinkhornRounds` gives, up to rounding. Used under torch.compile, where each
    round is then two small reductions of the one P (fwd + bwd at m = 4, B T = 2048, one
    CPU thread: 1.7 ms against 2.6 ms for the rounds on P); eagerly it is the slower one
    (7.4 ms against 4.1 ms). A nested compile region: torch.compile compiles the unrolled
    rounds once for all 2L sublayers instead of once per sublayer (mHC at L = 8 on a 2-core
    CPU, cold cache: 147 s to compile the training step instead of 389 s, same step time);
    outside torch.compile the decorator does nothing."""
    r = torch.ones_like(P[:, 0])                               # (m, ...) row scalings
    c = torch.ones_like(P[0])                                  # (m, ...) column scalings
    for _ in range(iters):
        if eps == 0:
            r = 1 / (P * c.unsqueeze(0)).sum(1)
            c = 1 / (P * r.unsqueeze(1)).sum(0)
        else:
            r = r / (r * (P * c.unsqueeze(0)).sum(1) + eps)
            c = c / (c * (P * r.unsqueeze(1)).sum(0) + eps)
    return P * r.unsqueeze(1) * c.unsqueeze(0)


class SinkhornRounds(torch.autograd.Function):
    """`iters` rounds of P <- P / (rowsum(P) + eps), P <- P / (colsum(P) + eps) on P
    (m, m, ...) > 0, with a hand-written backward (per step y = P / s, s = sum + eps:
    dP = (dy - sum(dy * y)) / s) that keeps the gradient in the (m, m, ...) layout;
    autograd's would run 4 x iters small ops on whatever layout the incoming gradient has."""

    @staticmethod
    def forward(ctx, P, iters, eps=0.0):
        steps = []
        for _ in range(iters):
            for dim in (1, 0):                                 # rows, then columns
                s = P.sum(dim, keepdim=True)
                if eps:
                    s = s + eps
                P = P / s
                steps += [P, s]
        ctx.save_for_backward(*steps)
        return P

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous()
        steps = ctx.saved_tensors
        for i in reversed(range(0, len(steps), 2)):
            y, s = steps[i], steps[i + 1]
            dim = 1 if i % 4 == 0 else 0
            g = (g - (g * y).sum(dim, keepdim=True)) / s
        return g, None, None


class NormedProjection(torch.autograd.Function):
    """P = Wt RMS(x)^T for every row x of X, RMS(x) = x / sqrt(mean(x^2) + eps) (no weight):
    X (..., n), Wt (c, n) -> P (c, ...), coefficient-major (each coefficient a contiguous row
    of tokens; a (tokens, n) @ (n, c) product with so few columns is several times slower
    on CPU). Call as NormedProjection.apply(X, Wt, eps). The HC/mHC routing projection:
    tanh(H_bar W) reads it per stream, mHC's x' phi per token.

    Hand-written backward (autograd's keeps extra (..., n)-sized temporaries and writes
    the gradient of X twice): with Q = Wt x^T and s = 1/rms(x), P = Q s and
        gQ = gP s,   gx = gQ^T Wt - (sum_c gP Q) s^3 x / n,   gWt = gQ X."""

    @staticmethod
    def forward(ctx, X, Wt, eps):
        n = X.size(-1)
        X2 = X.reshape(-1, n)                                  # (N, n)
        s = torch.rsqrt(torch.linalg.vector_norm(X2, dim=-1).square() / n + eps)  # (N,) 1/rms
        Q = Wt @ X2.t()                                        # (c, N)
        ctx.save_for_backward(X, Wt, Q, s)
        return (Q * s).view(-1, *X.shape[:-1])

    @staticmethod
    def backward(ctx, gP):
        X, Wt, Q, s = ctx.saved_tensors
        n = X.size(-1)
        X2 = X.reshape(-1, n)
        gP = gP.reshape(Q.shape)
        gQ = gP * s                                            # (c, N)
        gX = gWt = None
        if ctx.needs_input_grad[0]:
            gX = gQ.t() @ Wt                                   # (N, n)
            gX.addcmul_(X2, (-(gP * Q).sum(0) * s.pow(3) / n).unsqueeze(-1))
            gX = gX.view(X.shape)
        if ctx.needs_input_grad[1]:
            gWt = gQ @ X2                                      # (c, n)
        return gX, gWt, None


# ---- MoDA: joint sequence-and-depth attention --------------------------------

class DepthReadFunction(torch.autograd.Function):
    """The depth half of MoDA's joint softmax, with a hand-written backward. Call as

        y, lse = DepthReadFunction.apply(q, scale, *depth_k, *depth_v)

    q: (B, H_kv, G, T, hd) (query heads grouped by their key/value head); depth_k[j],
    depth_v[j]: S >= 1 slots (B, H_kv, T, hd). With scores d_j = scale * q . K_j and
    a = softmax_j(d) (fp32):
        y = sum_j a_j V_j  (B, H_kv, G, T, hd),   lse = log sum_j exp(d_j)  (B, H_kv, G, T) fp32.
    Why by hand: autograd on a stacked (B, H_kv, T, S, hd) copy of the slots keeps that copy
    for the backward at every block, O(L^2 B T d) bytes per pass, and per-token
    (1 x hd)(hd x S) products run as slow batched matmuls. Here every sum over slots is
    batched over a small stack or a loop over the S tensors (`stack_if_small`; the slots
    are alive anyway: they are the depth cache), and the backward
    saves only a (S numbers per query) and references. With incoming gy, glse and
    p_j = gy . V_j:  gd_j = a_j (p_j - sum_i a_i p_i + glse),
        gq = scale sum_j gd_j K_j,  gK_j = scale sum_G gd_j q,  gV_j = sum_G a_j gy."""

    @staticmethod
    def forward(ctx, q, scale, *slots):
        S = len(slots) // 2
        y, lse, a = read_forward(q, slots[:S], slots[S:], scale)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, a, *slots)
        return y.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, glse):
        q, a, *slots = ctx.saved_tensors
        S = len(slots) // 2
        K, V = slots[:S], slots[S:]
        gy, gd, gq = read_backward_terms(gy, glse, q, a, K, V, ctx.scale)
        grads = [slot_grads(j, q, a, gd, gy) for j in range(S)]
        gK = [gk.to(Kj.dtype) for (gk, _), Kj in zip(grads, K)]
        gV = [gv.to(Vj.dtype) if gv is not None else None for (_, gv), Vj in zip(grads, V)]
        return (gq.to(q.dtype), None, *gK, *gV)


def read_forward(q, K, V, scale):
    """DepthReadFunction's forward formulas: (y (B, H_kv, G, T, hd), lse (B, H_kv, G, T),
    a (S, B, H_kv, G, T)), in fp32 (fp64 for fp64). The sum over slots is one in-place add
    per slot into one buffer, not S fresh (B, H_kv, G, T, hd) tensors."""
    with no_autocast(q):  # fp32 math, as documented, also under autocast
        acc = torch.promote_types(q.dtype, torch.float32)
        qa = q.to(acc)                                                                       # scores in fp32 (no-op for fp32)
        Ks, Vs = stack_if_small(K, acc), stack_if_small(V, acc)                             # (S, B, H_kv, T, hd) or None
        d = (torch.linalg.vecdot(qa, Ks.unsqueeze(3)) if Ks is not None else
             torch.stack([torch.linalg.vecdot(qa, Kj.unsqueeze(2).to(acc)) for Kj in K])) * scale  # (S, B, H_kv, G, T)
        lse = torch.logsumexp(d, dim=0)                                                     # (B, H_kv, G, T)
        a = torch.exp(d - lse)                                                              # (S, B, H_kv, G, T)
        if Vs is not None:
            return (a.unsqueeze(-1) * Vs.unsqueeze(3)).sum(0), lse, a
        y = torch.zeros(q.shape, dtype=acc, device=q.device)
        for j, Vj in enumerate(V):
            y.addcmul_(a[j].unsqueeze(-1), Vj.unsqueeze(2))
        return y, lse, a


def read_backward_terms(gy, glse, q, a, K, V, scale):
    """The backward of DepthReadFunction up to the slots' gradients: (gy in a's dtype or
    None, gd (S, B, H_kv, G, T), gq in a's dtype); formulas in DepthReadFunction's docstring.
    gK_j = group_sum(gd_j q) and gV_j = group_sum(a_j gy)."""
    with no_autocast(q):  # fp32 math, as documented, also under autocast
        acc = a.dtype
        if gy is None:
            p = torch.zeros_like(a)
        else:
            gy = gy.to(acc)
            Vs = stack_if_small(V, acc)                                                     # (S, B, H_kv, T, hd) or None
            p = (torch.linalg.vecdot(gy, Vs.unsqueeze(3)) if Vs is not None else
                 torch.stack([torch.linalg.vecdot(gy, Vj.unsqueeze(2).to(acc)) for Vj in V]))  # (S, B, H_kv, G, T)
        gd = p - (a * p).sum(0, keepdim=True)
        if glse is not None:
            gd = gd + glse
        gd = a * gd * scale                                                                  # (S, B, H_kv, G, T)
        Ks = stack_if_small(K, acc)
        if Ks is not None:
            return gy, gd, (gd.unsqueeze(-1) * Ks.unsqueeze(3)).sum(0)
        gq = torch.zeros(q.shape, dtype=acc, device=q.device)
        for j, Kj in enumerate(K):
            gq.addcmul_(gd[j].unsqueeze(-1), Kj.unsqueeze(2))
        return gy, gd, gq


def group_sum(t):
    """t (B, H_kv, G, T, hd) summed over the G query heads of each key/value head."""
    return t.squeeze(2) if t.size(2) == 1 else t.sum(2)


def slot_grads(j, q, a, gd, gy):
    """Depth slot j's key and value gradients (B, H_kv, T, hd), in a's dtype:
    gK_j = sum_G gd_j q and gV_j = sum_G a_j gy (None without gy)."""
    with no_autocast(q):
        gk = group_sum(gd[j].unsqueeze(-1) * q.to(a.dtype))
        return gk, (group_sum(a[j].unsqueeze(-1) * gy) if gy is not None else None)


# the fused CPU attention kernel that also returns the log-sum-exp of each query's scores
# (None if this torch build lacks it: depth_attention then uses the portable null-key form)
_CPU_FLASH = getattr(torch.ops.aten, '_scaled_dot_product_flash_attention_for_cpu', None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, '_scaled_dot_product_flash_attention_for_cpu_backward', None)


@torch.compiler.assume_constant_result  # a Python bool: torch.compile takes its value when it traces
def flash_backend_enabled():
    """Whether SDPA may use its flash kernels here (False inside sdpa_kernel(SDPBackend.MATH))."""
    return torch.backends.cuda.flash_sdp_enabled()


class MergeDepthFunction(torch.autograd.Function):
    """MoDA's joint softmax on the CPU: fused causal attention over the sequence keys, merged
    with the depth read by the two partial softmaxes' log-sum-exps. Call as

        y = MergeDepthFunction.apply(q, k, v, y_dep, lse_dep, scale)

    q, k, v: (B, H, T, hd) (key/value heads already repeated for GQA); y_dep (B, H, T, hd)
    and lse_dep (B, H, T) fp32 from `DepthReadFunction`. With (o, lse) the kernel's output and
    log-sum-exp over the causal keys and alpha = sigmoid(lse - lse_dep) (the sequence keys'
    share of the joint softmax mass, fp32):  y = alpha o + (1 - alpha) y_dep.
    Backward, with incoming gy: the kernel's own backward given grad_out = alpha gy and
    out = y (not o): the kernel's row term sum(grad_out * out) then equals
    alpha gy . o - glse with glse = alpha (1 - alpha) gy . (o - y_dep), the gradient reaching
    lse, so q, k, v get the exact gradient through both o and lse. And
    g y_dep = (1 - alpha) gy,  g lse_dep = -(1 - alpha) gy . (y - y_dep)  (= -glse)."""

    @staticmethod
    def forward(ctx, q, k, v, y_dep, lse_dep, scale):
        o, lse = _CPU_FLASH(q, k, v, 0.0, True, scale=scale)                 # (B, H, T, hd), (B, H, T)
        alpha = torch.sigmoid(lse.to(lse_dep.dtype) - lse_dep).unsqueeze(-1)  # (B, H, T, 1) fp32
        y = torch.lerp(y_dep.to(alpha.dtype), o.to(alpha.dtype), alpha).to(q.dtype)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, y, lse, alpha, y_dep)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        q, k, v, y, lse, alpha, y_dep = ctx.saved_tensors
        gy = gy.to(alpha.dtype)
        gq, gk, gv = _CPU_FLASH_BACKWARD((alpha * gy).to(q.dtype), q, k, v, y, lse, 0.0, True, scale=ctx.scale)
        g_y_dep = ((1 - alpha) * gy).to(y_dep.dtype)
        g_lse_dep = -(1 - alpha).squeeze(-1) * torch.linalg.vecdot(gy, (y - y_dep).to(alpha.dtype))
        return gq, gk, gv, g_y_dep, g_lse_dep, None


def depth_attention(q, k, v, depth_k, depth_v, method=None, route=None):
    """The joint sequence-and-depth attention of MoDA (arXiv 2603.15619; paper Appendix A; docs/schemes.md):

        a_t = softmax([q_t . k_s, s <= t  |  q_t . K_depth[t, j], j < S] / sqrt(hd))
        y_t = sum_{s<=t} a_ts v_s + sum_{j<S} a_tj V_depth[t, j]

    ONE softmax over the causal sequence keys and the S depth keys of the same token,
    computed exactly without an explicit (T x (T + S)) score matrix. The depth part
    collapses into one key per query: logit lse_t = log sum_j exp(d_tj) (fp32) and value
    y_dep,t = softmax(d_t) . V_depth[t] (`DepthReadFunction`). The sequence part runs in a
    fused attention kernel; the two are merged in one of two exact ways (`method`):
      'flash_cpu' (the CPU default, unless sdpa_kernel has turned the flash backend off, as
        cost.flop_check does to count attention): the CPU kernel also returns each
        query's log-sum-exp over its causal keys, and the partial results are merged by
        their masses (`MergeDepthFunction`, hand-written backward through the kernel's own);
      'null_key' (every other device; portable, public API only; `merge_null_key`):
        shifting query t's sequence scores by -lse_t through one extra head dimension
        (q' = [q, -lse / scale], k' = [k, 1]) and prepending a null key (score 0, value
        e_hd) that every query sees (a dummy query at position 0 keeps the causal mask
        square) lets fused `F.scaled_dot_product_attention` give o_t = sum_s a_ts v_s and o_t[hd] = a_t,null
        (the total depth weight), so y_t = o_t[:hd] + o_t[hd] * y_dep,t. It costs one more
        key, query and head dimension per block (a MoDA training step 6-10% slower on a
        2-core CPU), and the shift is stored in q's dtype: the exact correction for its
        rounding keeps bf16 outputs as close as plain bf16 attention's, whatever lse is.
    q: (B, H, T, hd) after RoPE; k: (B, H_kv, T, hd) after RoPE; v: (B, H_kv, T, hd);
    depth_k, depth_v: sequences of S >= 0 slots (B, H_kv, T, hd) (S = 0: plain causal
    attention). GQA: query head i reads key/value head i // (H / H_kv). Returns y (B, H, T, hd).
    route: None (eager), or under torch.compile the `open_route` whose slots 0..S-1 hold the
    depth slots ([K_j, V_j], `route_write`): the depth read is then one opaque op, and
    (y, the route after the read) is returned (S = 0: the same route).
    Raises ValueError for shapes that do not fit the above, an unknown method, or
    'flash_cpu' off the CPU or without the kernel.
    `depth_attention_reference` is the same function written as the plain formula."""
    check_depth_attention_args(q, k, v, depth_k, depth_v)
    B, H, T, hd = q.shape
    Hkv, S = k.size(1), len(depth_k)
    cpu_flash = q.device.type == 'cpu' and _CPU_FLASH is not None
    if method is None:  # the CPU kernel wherever SDPA itself would pick it (not under sdpa_kernel(MATH))
        method = 'flash_cpu' if cpu_flash and flash_backend_enabled() else 'null_key'
    if method not in ('flash_cpu', 'null_key') or (method == 'flash_cpu' and not cpu_flash):
        raise ValueError(f"depth_attention: method must be 'flash_cpu' (CPU only) or 'null_key', "
                         f"got {method!r} on {q.device.type}")
    gqa = H != Hkv
    if S == 0:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return y if route is None else (y, route)
    scale = hd ** -0.5
    q5 = q.view(B, Hkv, H // Hkv, T, hd)
    if route is None:
        y_dep, lse = DepthReadFunction.apply(q5, scale, *depth_k, *depth_v)
    else:
        y_dep, lse, _, route = depth_read_op(q5, list(depth_k), list(depth_v), scale, route)
    y_dep, lse = y_dep.view(B, H, T, hd), lse.view(B, H, T)
    if method == 'null_key':
        y = merge_null_key(q, k, v, y_dep, lse, scale)
    else:
        if gqa:  # the kernel has no GQA: repeat each key/value head for its H / H_kv query heads
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        y = MergeDepthFunction.apply(q, k, v, y_dep, lse, scale)
    return y if route is None else (y, route)


def check_depth_attention_args(q, k, v, depth_k, depth_v):
    """Raises ValueError unless `depth_attention` can take these: q (B, H, T, hd), k and v
    (B, H_kv, T, hd) with H a multiple of H_kv >= 1, and as many depth keys as depth values,
    each (B, H_kv, T, hd)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"depth_attention: q, k, v must be 4-d (B, heads, T, hd), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, hd = q.shape
    Hkv = k.size(1)
    if k.shape != v.shape or Hkv < 1 or H % Hkv or k.shape != (B, Hkv, T, hd):
        raise ValueError(f"depth_attention: k and v must be (B, H_kv, T, hd) = ({B}, H_kv, {T}, {hd}) "
                         f"with H_kv dividing H = {H}; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if len(depth_k) != len(depth_v):
        raise ValueError(f"depth_attention: {len(depth_k)} depth keys but {len(depth_v)} depth values")
    for name, slots in (('key', depth_k), ('value', depth_v)):
        for j, t in enumerate(slots):
            if t.shape != k.shape:
                raise ValueError(f"depth_attention: depth {name} {j} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(k.shape)} like k")


def merge_null_key(q, k, v, y_dep, lse, scale):
    """The 'null_key' merge of `depth_attention`: fused causal SDPA over a null key (score
    0, value e_hd) and the sequence keys, whose scores are shifted by -lse through one
    extra head dimension; the null key's weight is the depth part's share of the joint softmax.
    q: (B, H, T, hd); k, v: (B, H_kv, T, hd); y_dep (B, H, T, hd) and lse (B, H, T) fp32
    from `DepthReadFunction`. Returns y (B, H, T, hd) in q's dtype."""
    B, H, T, hd = q.shape
    Hkv = k.size(1)
    shift = (-lse / scale).to(q.dtype)                                               # (B, H, T), in q's dtype
    # position 0 of keys and queries: the null key, and a dummy query whose output is dropped
    q1 = F.pad(torch.cat((q, shift.unsqueeze(-1)), dim=-1), (0, 0, 1, 0))             # (B, H, 1 + T, hd + 1)
    k1 = F.pad(torch.cat((k, k.new_ones(B, Hkv, T, 1)), dim=-1), (0, 0, 1, 0))       # (B, H_kv, 1 + T, hd + 1)
    v1 = F.pad(v, (0, 1, 1, 0)) + F.pad(v.new_ones(1, 1, 1, 1), (hd, 0, 0, T))      # (B, H_kv, 1 + T, hd + 1), null value e_hd
    o = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, scale=scale, enable_gqa=H != Hkv)[:, :, 1:]  # (B, H, T, hd + 1)
    if shift.dtype == lse.dtype:  # fp32/fp64: the shift is lse up to the last bit
        return o[..., :hd] + o[..., hd:] * y_dep
    # bf16/fp16: the kernel shifted by the rounded -shift * scale, not by lse: with
    # r = exp(lse + shift * scale) (1 +- 2^-8 |lse| in bf16) the depth mass is r * o_null out of 1 + (r - 1) o_null
    r = torch.exp(lse + shift.to(lse.dtype) * scale).unsqueeze(-1)                   # (B, H, T, 1), fp32
    null = o[..., hd:].to(r.dtype)                                                    # (B, H, T, 1)
    return ((o[..., :hd] + (r * null) * y_dep) / (1 + (r - 1) * null)).to(q.dtype)


def depth_attention_reference(q, k, v, depth_k, depth_v):
    """`depth_attention` as the plain formula, left to autograd: an explicit fp32 score
    matrix (B, H, T, T + S) over the causal keys and the stacked depth keys. Memory
    O(B H T (T + S)); what tests check `depth_attention` against. Raises as it does."""
    check_depth_attention_args(q, k, v, depth_k, depth_v)
    B, H, T, hd = q.shape
    Hkv, S = k.size(1), len(depth_k)
    dk = torch.stack(list(depth_k), dim=3) if S else k.new_zeros(B, Hkv, T, 0, hd)   # (B, H_kv, T, S, hd)
    dv = torch.stack(list(depth_v), dim=3) if S else v.new_zeros(B, Hkv, T, 0, hd)
    q = q.reshape(B, Hkv, H // Hkv, T, hd) * hd ** -0.5                # (B, Hkv, G, T, hd)
    seq = q @ k.unsqueeze(2).transpose(-1, -2)                         # (B, Hkv, G, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    seq = seq.masked_fill(~causal, float('-inf'))
    dep = torch.einsum('bkgtd,bktsd->bkgts', q, dk)                    # (B, Hkv, G, T, S)
    a = torch.softmax(torch.cat((seq, dep), dim=-1).float(), dim=-1).to(q.dtype)
    y = a[..., :T] @ v.unsqueeze(2) + torch.einsum('bkgts,bktsd->bkgtd', a[..., T:], dv)
    return y.reshape(B, H, T, hd)
