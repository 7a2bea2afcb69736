"""
The fast paths' real Triton kernels on the CPU, under Triton's interpreter: fla-core's
fused_attnres (fast.attnres.fla_read) and Liger's mHC ops (fast.streams.liger_coefficients,
liger_read, liger_write), each through fast/'s entry point against the plain method of
residuals.py it replaces, fp32, forward and backward. Run by tests/test_kernels_interpreted.py
in a process of its own (TRITON_INTERPRET must be set before triton is imported); prints one
JSON line per case: {case, outputs: [max error relative to the largest plain entry, ...],
grads: [...], seconds}.

    TRITON_INTERPRET=1 python tests/interpreter_run.py [case ...]

Two narrow shims of the interpreter of triton 3.6 (the version requirements-interpret.txt
pins), both about what compiled Triton does and the interpreter does not:
- the loop variable of a plain `range` loop is a Triton scalar in compiled code (the kernels
  call `.to` on it) but a Python int in the interpreter: each such loop's body starts by
  turning it into a scalar tensor;
- a runtime scalar argument is a one-entry numpy array, which numpy >= 2.4 refuses to convert
  with int(): `__index__` takes its `.item()`.
"""

import ast
import copy
import dataclasses
import json
import os
import sys
import time

os.environ['TRITON_INTERPRET'] = '1'
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


class RangeLoopsAsTensors(interpreter.ASTTransformer):
    """The interpreter's rewrite of a kernel, plus: `for i in range(...)` / `tl.range(...)`
    bodies start with i = to_tensor(i), as the compiled kernel sees i (static_range untouched)."""

    def visit_For(self, node):
        self.generic_visit(node)
        f = node.iter.func if isinstance(node.iter, ast.Call) else None
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name == 'range' and isinstance(node.target, ast.Name):
            i = node.target.id
            node.body.insert(0, ast.parse(f"{i} = interpreter_semantic.to_tensor({i}, False)").body[0])
        return node


def patch_lang_tensor(tensor, scope, plain=interpreter._patch_lang_tensor):
    plain(tensor, scope)
    scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data.item()))


interpreter.FunctionRewriter.ast_transformer = RangeLoopsAsTensors()
interpreter._patch_lang_tensor = patch_lang_tensor

import fast  # noqa: E402
import residuals  # noqa: E402
from fast import attnres, streams  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

B, T, D, M = 2, 3, 32, 4  # batch, tokens, width, streams


def rel(have, want):
    return ((have.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def compare(plain, fast_fn, args, leaves, weighted=None):
    """Outputs and gradients (of a fixed random weighting of the first `weighted` outputs, all
    by default) of both forms: ([output errors], [gradient errors])."""
    res = []
    for fn in (plain, fast_fn):
        outs = fn(*args)
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        g = torch.Generator().manual_seed(2)
        loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
                   for o in outs[:weighted])
        res.append(([o.detach() for o in outs], torch.autograd.grad(loss, leaves)))
    (want_o, want_g), (have_o, have_g) = res
    assert all(h.shape == w.shape for h, w in zip(have_o, want_o))
    return [rel(h, w) for h, w in zip(have_o, want_o)], [rel(h, w) for h, w in zip(have_g, want_g)]


def model(residual, **kw):
    m = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=D, n_head=4, residual=residual, **kw))
    fast.randomise(m)
    return m.residual


def leaf(*shape, g, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).float().requires_grad_()


def case_fla_read(n_sources=5):
    """AttnRes.read of n sources (B, T, D): z, a, and the gradients of the sources, the
    pseudo-query and the key norm's gain through z (training reads z only)."""
    res, g = model('attnres'), torch.Generator().manual_seed(1)
    mixer = res.layers[0].mlp_mix
    sources = [leaf(B, T, D, g=g, scale=0.5 + i) for i in range(n_sources)]
    leaves = [*sources, mixer.query, mixer.key_norm.weight]
    return compare(lambda s: type(res).read(res, s, mixer), lambda s: attnres.fla_read(res, s, mixer),
                   (sources,), leaves, weighted=1)


def case_liger_coefficients():
    """MHC.coefficients (mhc_sinkhorn='liger', 20 rounds): pre, H_res, post and the gradients of
    the streams and every routing parameter."""
    res, g = model('mhc'), torch.Generator().manual_seed(1)
    route = res.layers[0].mlp_route
    H = leaf(B, T, M, D, g=g)
    return compare(lambda h: type(res).coefficients(res, h, route), lambda h: streams.liger_coefficients(res, h, route),
                   (H,), [H, *route.parameters()])


def case_liger_read():
    res, g = model('mhc'), torch.Generator().manual_seed(1)
    H, r = leaf(B, T, M, D, g=g), leaf(B, T, M, g=g)
    return compare(lambda *a: type(res).read_streams(res, *a), lambda *a: streams.liger_read(res, *a), (H, r), [H, r])


def case_liger_write():
    res, g = model('hc'), torch.Generator().manual_seed(1)
    H, Mx, w, y = leaf(B, T, M, D, g=g), leaf(B, T, M, M, g=g, scale=0.5), leaf(B, T, M, g=g), leaf(B, T, D, g=g)
    return compare(lambda *a: type(res).write_streams(res, *a), lambda *a: streams.liger_write(res, *a),
                   (H, Mx, w, y), [H, Mx, w, y])


def sum_read_plain(res, sources, partial, f, k, mixer, b, j):
    """BlockAttnRes.block's steps after a sublayer, in the plain code: P <- f or P + f, read_at."""
    partial = f.to(sources[0].dtype) if partial is None else partial + f
    return type(res).read_at(res, sources, partial, k, mixer, b, j)[:3]


def depth_reads(res, read, srcs, dtype, chain, weighted, summed=None):
    """The 2L depth reads of AttnRes scheme `res` in the model's order with the method `read`
    (AttnRes.read's or BlockAttnRes.read_at's signature); srcs: the leaves (x fp32, then a
    source per read in `dtype`; Block AttnRes: a running sum per read, fp32). chain: each read's
    z (cast to dtype) is added to the next read's source, as a sublayer's output would be
    (the model's backward order); else the reads are independent (another order). summed: Block
    AttnRes through BlockAttnRes.block's sum-then-read steps instead, `summed(res, sources, P, f,
    k, mixer, b, j)`, srcs the sublayer outputs f. Returns ([z...] + ([a...] if weighted)), the
    outputs the loss weights."""
    from fast.depth_read import read_order
    order, zs, a_s = read_order(res), [], []
    block = hasattr(res, 'read_at')
    sources, partial, prev = ((srcs[0],), None, None) if block else ([srcs[0]], None, None)
    for k in range(1, len(order) + 1):
        v = srcs[k] if prev is None else srcs[k] + prev.to(srcs[k].dtype)
        if summed is not None:
            sources, partial, z = summed(res, sources, partial, v, k, order[k - 1], k // 2, 1 - k % 2)
        elif block:
            partial = v if partial is None or not chain else partial + v
            sources, partial, z, _ = read(res, sources, partial, k, order[k - 1], k // 2, 1 - k % 2)
        else:
            sources.append(v)
            z, a = read(res, sources, order[k - 1])
            a_s.append(a)
        zs.append(z)
        prev = z if chain else None
    return zs + (a_s if weighted else [])


def case_depth(scheme, G, dtype, chain=False, weighted=False, big=False, summed=False):
    """The grouped depth read on its Triton kernels (fast.depth_read.TritonOps) and the plain read,
    each against the plain read in fp64 on the same inputs, over all 2L = 8 reads of a 4-block
    scheme (d = 24: a block of 32 lanes, 8 masked; N = 5 tokens over 2 backward programs: a
    remainder), groups of G reads: every z (and a) and the gradients of every source,
    pseudo-query and key gain. Returns ([(fast, plain) error of each output], [... each
    gradient]), each error |have - fp64| / |fp64| over the tensor. big: pseudo-queries 40x
    (scores of +-100, where exp overflows fp32 without the running max)."""
    from fast import depth_read as dr
    g = torch.Generator().manual_seed(7)
    low = {'fp32': torch.float32, 'bf16': torch.bfloat16}[dtype]
    res = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_embd=24, n_head=4, residual=scheme,
                        attnres_blocks=4)).residual
    fast.randomise(res)
    if big:
        with torch.no_grad():
            for m in dr.read_order(res):
                m.query.mul_(40)
    srcs = [leaf(1, 5, 24, g=g)] + [(torch.randn(1, 5, 24, generator=g) * (0.5 + k % 3)).to(
        torch.float32 if scheme == 'blockattnres' and not summed else low).requires_grad_() for k in range(1, 9)]
    plain = type(res).read_at if scheme == 'blockattnres' else type(res).read
    fast_read = (dr.read_at if scheme == 'blockattnres' else dr.read)(dr.TritonOps)
    ref = copy.deepcopy(res).double()

    def run(r, fn, leaves):
        params = [p for m in dr.read_order(r) for p in (m.query, m.key_norm.weight)]
        how = None if not summed else sum_read_plain if fn is plain else \
            lambda *a: dr.sum_read(a[0], dr.TritonOps, *a[1:])
        outs = depth_reads(r, fn, leaves, leaves[1].dtype, chain, weighted, how)
        w = torch.Generator().manual_seed(2)
        loss = sum((o.double() * torch.randn(o.shape, generator=w, dtype=torch.float64)).sum() for o in outs)
        return [o.detach() for o in outs], torch.autograd.grad(loss, leaves + params, allow_unused=True)
    dr.G_MAX, programs = G, dr.TritonOps.GU_PROGRAMS
    dr.TritonOps.GU_PROGRAMS = 2
    try:
        want_o, want_g = run(ref, plain, [s.detach().double().requires_grad_() for s in srcs])
        base_o, base_g = run(res, plain, srcs)
        have_o, have_g = run(res, fast_read, srcs)
    finally:
        dr.G_MAX, dr.TritonOps.GU_PROGRAMS = 8, programs
    assert all(h.shape == w.shape and h.dtype == w.dtype for h, w in zip(have_o, base_o))
    assert all((h is None) == (w is None) and (h is None or h.dtype == w.dtype) for h, w in zip(have_g, base_g))

    def err(have, want):
        return ((have.double() - want).norm() / want.norm().clamp_min(1e-300)).item()
    return ([(err(h, w), err(b, w)) for h, b, w in zip(have_o, base_o, want_o)],
            [(err(h, w), err(b, w)) for h, b, w in zip(have_g, base_g, want_g) if w is not None])


def case_streams(scheme, dtype, m=4, programs=3, **kw):
    """The fused stream steps of HC / mHC on their Triton kernels (fast.streams.TritonOps) and the
    plain MultiStream.block, each against the plain model in fp64 on the same weights and tokens:
    a 3-block model (the first sublayer's own read, steps that plan the next block's read, the
    last block's write alone, the MLP step recomputing its input), d = 24 (a block of 32 lanes,
    8 masked), m streams (3: a block of 4 streams, one masked), N = 10 tokens (HC's backward over
    `programs` programs: a remainder; mHC's blocks of 16 tokens: one partial), fp32 or under bf16
    autocast. Returns ([(fast, plain) error of the loss], [... of each parameter's gradient]), each
    as the start-up guard measures it (`_whole_model`: dtype 'fp32', or 'bf16' / 'fp16' autocast)."""
    from fast import streams as st
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_embd=24, n_head=4, residual=scheme, hc_streams=m, **kw)
    saved, st.TritonOps.PROGRAMS = st.TritonOps.PROGRAMS, programs
    try:
        return _whole_model(cfg, lambda res: st.block(st.TritonOps).__get__(res), dtype)
    finally:
        st.TritonOps.PROGRAMS = saved


def case_moda(dtype, n_kv_head=4):
    """MoDA's depth cache on its Triton kernels (fast.moda.TritonOps) and the plain MoDA.block, each
    against the plain model in fp64: a 4-block model (reads of 2, 4 and 6 slots: tiles of 2, 4 and
    8 with masked slots), hd = 10 (a tile of 16 features, 6 masked), N = 10 tokens, G = 1 or 2
    query heads a key/value head, fp32 or under bf16 / fp16 autocast. Returns `_whole_model`'s rows."""
    from fast import moda
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_embd=40, n_head=4, n_kv_head=n_kv_head,
                    residual='moda')
    return _whole_model(cfg, lambda res: moda.cached_block_triton.__get__(res), dtype)


def _whole_model(cfg, fast_block, dtype):
    """([(fast, plain) error of the loss], [... of each parameter's gradient]) of a training step of
    GPT(cfg) with its scheme's block replaced by `fast_block(res)` and plain, against fp64."""
    model = GPT(cfg)
    fast.randomise(model)
    ref = copy.deepcopy(model).double()
    idx = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))

    low = torch.float16 if dtype == 'fp16' else torch.bfloat16

    def run(mdl, fused, autocast):
        if fused:
            mdl.residual.block = fast_block(mdl.residual)
        mdl.zero_grad(set_to_none=True)
        with torch.autocast('cpu', dtype=low, enabled=autocast):
            _, loss = mdl(idx, idx)
        loss.backward()
        mdl.residual.__dict__.pop('block', None)
        return [loss.detach()], [p.grad for p in mdl.parameters()]
    want_o, want_g = run(ref, False, False)
    base_o, base_g = run(model, False, dtype != 'fp32')
    have_o, have_g = run(model, True, dtype != 'fp32')
    # the start-up guard's measure: the largest error relative to the tensor's largest entry, floored
    # at 1e-3 of the largest gradient entry of all (a gate's gradient small by cancellation carries
    # the rounding of its larger terms)
    floor = 1e-3 * max(w.abs().max().item() for w in want_g if w is not None)

    def err(have, want):
        return ((have.double() - want).abs().max() / max(want.abs().max().item(), floor)).item()
    assert [g is None for g in have_g] == [g is None for g in base_g]
    return ([(err(h, w), err(b, w)) for h, b, w in zip(have_o, base_o, want_o)],
            [(err(h, w), err(b, w)) for h, b, w in zip(have_g, base_g, want_g) if w is not None])


def case_guard_depth():
    """The start-up guard given the Triton paths of the grouped read under the interpreter: the
    fp32 twin (as on CUDA: 2e-3) and bf16 autocast; None where accepted, else the refusal."""
    out = {}
    for residual, name in (('attnres', 'attnres_group_triton'), ('blockattnres', 'blockattnres_group_triton'),
                           ('blockattnres', 'blockattnres_sum_triton')):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=D, n_head=4, residual=residual))
        paths = [p for p in fast.FAST_PATHS if p.name == name]
        try:
            fast.check(model, paths, 'cpu', torch.bfloat16, twin_dtype=torch.float32)
            out[name] = None
        except fast.FastPathMismatch as e:
            out[name] = str(e)
    return out, []


def case_guard_bf16():
    """fast.check_autocast, the start-up guard under bf16 autocast, given each CUDA kernel path on
    its scheme's twin: {scheme/path: None if accepted, else the refusal}; and fla's path without
    its declared rounding (in_run_dtype), which the guard must refuse."""
    out = {}
    kernels = {p.name: p for p in fast.FAST_PATHS + fast.LIGER_PATHS + [fast.FLA_READ] if p.cuda_only}
    plan = [('attnres', 'attnres_read_fla'), ('blockattnres', 'attnres_read_fla'), ('mhc', 'streams_read_liger'),
            ('mhc', 'streams_write_liger'), ('attnres', 'undeclared')]  # liger_mhc_coeffs: fp32, and slow here
    for residual, name in plan:
        path = kernels.get(name) or dataclasses.replace(kernels['attnres_read_fla'], in_run_dtype=False)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=D, n_head=4, residual=residual))
        try:
            fast.check_autocast(model, [path], 'cpu', torch.bfloat16)
            out[f'{residual}/{name}'] = None
        except fast.FastPathMismatch as e:
            out[f'{residual}/{name}'] = str(e)
    return out, []


def case_guard_fused(*schemes):
    """The start-up guard given the Triton paths of the fused stream steps under the interpreter:
    the fp32 twin (as on CUDA: 2e-3) and bf16 autocast; None where accepted,
    else the refusal."""
    out = {}
    for residual in schemes:
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=D, n_head=4, n_kv_head=2,
                              residual=residual, mhc_sinkhorn_iters=4))  # 4 rounds: the interpreter's time
        paths = [p for p in fast.FAST_PATHS if p.cuda_only and isinstance(model.residual, p.scheme)]
        try:
            fast.check(model, paths, 'cpu', torch.bfloat16, twin_dtype=torch.float32)
            out[residual] = None
        except fast.FastPathMismatch as e:
            out[residual] = str(e)
    return out, []


# planted errors in the kernels: (module, the source it holds, what is planted in its place, the
# scheme whose guard must refuse it, the comparison that must fail)
PLANTS = {
    # the read's share of the streams' gradient (A_m (x) dx) dropped: one of the streams' uses
    'stream_gradient_missing_a_use': ('fast.stream_kernels', "            G += a_m[:, None] * dxv[None, :]\n", "",
                                      'hc', lambda: case_streams('hc', 'fp32')),
    # MoDA: the depth weights the backward reads left relative to the depth part (not the joint softmax)
    'moda_weights_not_joint': ('fast.moda_kernels', "    tl.store(A + n * s_a + g * s_ar + fs, a * w, mask=ms)\n",
                               "    tl.store(A + n * s_a + g * s_ar + fs, a, mask=ms)\n", 'moda',
                               lambda: case_moda('fp32')),
    # MoDA: D = dy . y dropped from the depth scores' gradient
    'moda_score_gradient_without_D': ('fast.moda_kernels', "    dd = a * (gV - D)\n", "    dd = a * gV\n", 'moda',
                                      lambda: case_moda('fp32')),
    # every Sinkhorn normalisation rounded to bf16, forward and in the backward's recomputation
    'sinkhorn_rounds_in_bf16': ('fast.stream_kernels', "    return tl.where(vm, P / s, 0.0), s\n",
                                "    return tl.where(vm, (P / s).to(tl.bfloat16).to(tl.float32), 0.0), s\n",
                                'mhc', lambda: case_streams('mhc', 'fp32', mhc_sinkhorn_iters=5)),
}


def case_planted(name):
    """Plant PLANTS[name] in its kernel module (the module's source with one line changed, run in
    its place), then: the guard's verdict on the scheme's Triton path (None: accepted, else the
    refusal) and the comparison case's rows (which the suite holds to the same rule as unplanted)."""
    import importlib
    import linecache
    import types
    module, old, new, scheme, compare = PLANTS[name]
    real = importlib.import_module(module)
    src = open(real.__file__).read()
    assert src.count(old) == 1, f"{name}: the planted line is not in {module} once"
    planted = types.ModuleType(module)
    text = src.replace(old, new)
    name_ = f"{real.__file__} (planted {name})"  # the interpreter reads a kernel's source through linecache
    linecache.cache[name_] = (len(text), None, text.splitlines(keepends=True), name_)
    exec(compile(text, name_, 'exec'), planted.__dict__)
    sys.modules[module] = planted
    try:
        verdict = case_guard_fused(scheme)[0][scheme]
        outputs, grads = compare()
    finally:
        sys.modules[module] = real
    return dict(verdict=verdict, outputs=outputs, grads=grads), []


CASES = {'fla_read': case_fla_read, 'fla_read_2': lambda: case_fla_read(2), 'liger_coefficients': case_liger_coefficients,
         'liger_read': case_liger_read, 'liger_write': case_liger_write, 'guard_bf16': case_guard_bf16,
         'guard_depth': case_guard_depth}
for _scheme in ('attnres', 'blockattnres'):  # the grouped read's kernels: groups of 1, 3 and 8 reads
    for _G in (1, 3, 8):
        for _dtype in ('fp32', 'bf16'):
            CASES[f'depth_{_scheme}_G{_G}_{_dtype}'] = lambda a=_scheme, b=_G, c=_dtype: case_depth(a, b, c)
    CASES[f'depth_{_scheme}_G8_chain'] = lambda a=_scheme: case_depth(a, 8, 'fp32', chain=True)
    CASES[f'depth_{_scheme}_G3_big'] = lambda a=_scheme: case_depth(a, 3, 'fp32', chain=True, big=True)
# the fused stream steps' kernels (mHC's Sinkhorn in 5 rounds but in one case: the interpreter runs
# the backward's recomputation, rounds^2 / 2 of them, in numpy)
CASES['streams_hc_fp32'] = lambda: case_streams('hc', 'fp32')
CASES['streams_hc_bf16'] = lambda: case_streams('hc', 'bf16')
CASES['streams_hc_m3'] = lambda: case_streams('hc', 'fp32', m=3)
CASES['streams_mhc_fp32'] = lambda: case_streams('mhc', 'fp32')
CASES['streams_mhc_bf16'] = lambda: case_streams('mhc', 'bf16', mhc_sinkhorn_iters=5)
CASES['streams_mhc_m3'] = lambda: case_streams('mhc', 'fp32', m=3, mhc_sinkhorn_iters=5)
CASES['streams_mhc_plain'] = lambda: case_streams('mhc', 'fp32', mhc_sinkhorn='plain', mhc_sinkhorn_iters=5)
CASES['guard_streams'] = lambda: case_guard_fused('hc', 'mhc')
CASES['moda_fp32'] = lambda: case_moda('fp32')
CASES['moda_bf16'] = lambda: case_moda('bf16')
CASES['moda_gqa_fp32'] = lambda: case_moda('fp32', n_kv_head=2)
CASES['moda_gqa_bf16'] = lambda: case_moda('bf16', n_kv_head=2)
CASES['moda_fp16'] = lambda: case_moda('fp16')
CASES['guard_moda'] = lambda: case_guard_fused('moda')
for _name in PLANTS:
    CASES[f'planted_{_name}'] = lambda a=_name: case_planted(a)
CASES['depth_attnres_G3_weights'] = lambda: case_depth('attnres', 3, 'fp32', weighted=True)
for _G in (1, 3, 8):  # Block AttnRes's running sum fused with the read (sum_phase2_fwd, finish_bwd's cast)
    for _dtype in ('fp32', 'bf16'):
        CASES[f'depth_blockattnres_sum_G{_G}_{_dtype}'] = lambda b=_G, c=_dtype: case_depth(
            'blockattnres', b, c, summed=True)
CASES['depth_blockattnres_sum_G8_chain'] = lambda: case_depth('blockattnres', 8, 'fp32', chain=True, summed=True)

if __name__ == '__main__':
    torch.set_num_threads(1)
    for name in sys.argv[1:] or CASES:
        t0 = time.perf_counter()
        outputs, grads = CASES[name]()
        print(json.dumps(dict(case=name, outputs=outputs, grads=grads, seconds=round(time.perf_counter() - t0, 1))),
              flush=True)
