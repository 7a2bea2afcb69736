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


def case_guard_bf16():
    """fast.check_autocast, the start-up guard under bf16 autocast, given each CUDA kernel path on
    its scheme's twin: {scheme/path: None if accepted, else the refusal}; and fla's path without
    its declared rounding (in_run_dtype), which the guard must refuse."""
    out = {}
    kernels = {p.name: p for p in fast.FAST_PATHS if p.cuda_only}
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


CASES = {'fla_read': case_fla_read, 'fla_read_2': lambda: case_fla_read(2), 'liger_coefficients': case_liger_coefficients,
         'liger_read': case_liger_read, 'liger_write': case_liger_write, 'guard_bf16': case_guard_bf16}

if __name__ == '__main__':
    torch.set_num_threads(1)
    for name in sys.argv[1:] or CASES:
        t0 = time.perf_counter()
        outputs, grads = CASES[name]()
        print(json.dumps(dict(case=name, outputs=outputs, grads=grads, seconds=round(time.perf_counter() - t0, 1))),
              flush=True)
