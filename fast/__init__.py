"""
Fast paths: drop-in replacements for plain pieces of residuals.py, same inputs and outputs,
behind one setting, `fast` = 'auto' | True | False ('auto': on for CUDA, off on the CPU), in
train.py, probe.py, sample.py and bench.py. Off, the plain code of residuals.py is all that
runs. On, each fast path below that applies replaces its plain method on the model's scheme,
after `check` has run a tiny twin of the model once plain and once fast (fp64 on the CPU,
fp32 on CUDA) and, under the run's bf16 / fp16 autocast, held each fast path against the
plain method's own rounding: a student's edit to residuals.py that a fast path would hide,
or a fast path that rounds where the plain code does not, stops the run at start-up, in one
line.

| fast path                 | replaces (residuals.py)          | applies             | runs                                 |
|---------------------------|----------------------------------|---------------------|--------------------------------------|
| attnres_group_triton      | AttnRes.read (Full AttnRes)      | CUDA, triton        | fast/depth_read.py on depth_kernels  |
| blockattnres_group_triton | BlockAttnRes.read_at             | CUDA, triton        | the same                             |
| blockattnres_sum_triton   | BlockAttnRes.block (P + f, read) | CUDA, triton        | the same, the running sum fused      |
| attnres_group_torch       | AttnRes.read                     | any device          | fast/depth_read.py TorchOps          |
| blockattnres_group_torch  | BlockAttnRes.read_at             | any device          | the same                             |
| blockattnres_sum_torch    | BlockAttnRes.block               | any device          | the same                             |
| hc_streams_triton         | MultiStream.block (HC)           | CUDA, triton        | fast/streams.py on stream_kernels    |
| mhc_streams_triton        | MultiStream.block (mHC)          | CUDA, triton        | the same                             |
| hc_streams_torch          | MultiStream.block (HC)           | any device          | fast/streams.py TorchOps             |
| mhc_streams_torch         | MultiStream.block (mHC)          | any device          | the same                             |
| moda_depth_cache_triton   | MoDA.block (depth slots, softmax)| CUDA, triton        | fast/moda.py on moda_kernels         |
| moda_depth_cache          | MoDA.block (depth slots, softmax)| any device          | fast/moda.py TorchOps: one cache, read in place |
| moda_sdpa                 | MoDA.attention (joint softmax)   | any device          | fast/moda.py: null key on fused SDPA |

Where both forms of a piece apply, the first listed wins. Without Triton or liger-kernel a
CUDA run uses the torch forms of the same rows. The grouped AttnRes read (fast/depth_read.py)
reads each source once per group of 8 reads, where fla-core's kernel (`FLA_READ`, the study's,
kept to measure against) reads every source at every read. Measured (fast / plain step time,
same process, interleaved; `python bench.py --suite=fast`; docs/performance.md has the table
with its machine): on a 2-core CPU, eager, the step takes 0.45x the plain one for Full AttnRes
and 0.69x for Block AttnRes (the torch forms), 0.77x for MoDA, and 1.05x for mHC and 1.10x for
HC (the fused stream steps' torch form: no win on the CPU). The CUDA
kernels and the torch forms on CUDA are not yet measured (tools/gpu_check.py times each against
the plain code; docs/gpu.md); `bench.py --suite=step` estimates them.

    import fast
    paths = fast.setup(model, 'auto', device, dtype=torch.bfloat16)  # -> the FastPaths in use (checked), [] when off
"""

import ast
import copy
import hashlib
import importlib.util
import inspect
import textwrap
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import residuals
from fast import attnres, depth_read, moda, streams
from model import GPT


@dataclass(frozen=True)
class FastPath:
    name: str
    scheme: type                 # residuals class whose method is replaced (and its subclasses)
    method: str                  # the plain method's name
    impl: Callable               # the fast form: same signature, self first
    runs: str                    # what runs, for messages
    cuda_only: bool = False
    package: str | None = None   # a module it needs ('fla', 'liger_kernel')
    applies: Callable = lambda cfg: True  # the scheme options it maps exactly
    in_run_dtype: bool = False   # reads and writes in the run's autocast dtype: a declared rounding (check_autocast)
    output: int = 0              # the output that training differentiates (check_autocast weights its gradient)
    extreme: tuple | None = None # (what, fn(twin)): a regime the plain code is exact in that the guard also checks


@torch.no_grad()
def _large_scores(twin):
    """Every AttnRes pseudo-query 40x: depth scores of +-100, where exp overflows fp32 unless a
    softmax subtracts its running max."""
    for name, p in twin.named_parameters():
        if name.endswith('_mix.query'):
            p.mul_(40)


LARGE_SCORES = ('depth scores of +-100', _large_scores)


def full_attnres(cfg):
    """AttnRes.read's grouped form serves Full AttnRes; Block AttnRes's is its read_at's."""
    return not issubclass(residuals.RESIDUALS[cfg.residual], residuals.BlockAttnRes)


FAST_PATHS = [
    FastPath('attnres_group_triton', residuals.AttnRes, 'read', depth_read.read(depth_read.TritonOps),
             'grouped depth read (Triton)', cuda_only=True, package='triton', applies=full_attnres,
             extreme=LARGE_SCORES),
    FastPath('blockattnres_group_triton', residuals.BlockAttnRes, 'read_at', depth_read.read_at(depth_read.TritonOps),
             'grouped depth read (Triton)', cuda_only=True, package='triton', output=2, extreme=LARGE_SCORES),
    FastPath('blockattnres_sum_triton', residuals.BlockAttnRes, 'block', depth_read.block(depth_read.TritonOps),
             'running sum fused with the grouped read (Triton)', cuda_only=True, package='triton', output=3,
             extreme=LARGE_SCORES),
    FastPath('attnres_group_torch', residuals.AttnRes, 'read', depth_read.read(depth_read.TorchOps),
             'grouped depth read (torch)', applies=full_attnres, extreme=LARGE_SCORES),
    FastPath('blockattnres_group_torch', residuals.BlockAttnRes, 'read_at', depth_read.read_at(depth_read.TorchOps),
             'grouped depth read (torch)', output=2, extreme=LARGE_SCORES),
    FastPath('blockattnres_sum_torch', residuals.BlockAttnRes, 'block', depth_read.block(depth_read.TorchOps),
             'running sum fused with the grouped read (torch)', output=3, extreme=LARGE_SCORES),
    FastPath('hc_streams_triton', residuals.HC, 'block', streams.block(streams.TritonOps),
             'fused stream steps (Triton)', cuda_only=True, package='triton'),
    FastPath('mhc_streams_triton', residuals.MHC, 'block', streams.block(streams.TritonOps),
             'fused stream steps (Triton)', cuda_only=True, package='triton'),
    FastPath('hc_streams_torch', residuals.HC, 'block', streams.block(streams.TorchOps), 'fused stream steps (torch)'),
    FastPath('mhc_streams_torch', residuals.MHC, 'block', streams.block(streams.TorchOps), 'fused stream steps (torch)'),
    FastPath('moda_depth_cache_triton', residuals.MoDA, 'block', moda.cached_block_triton,
             'depth slots written once into one cache, read in place (Triton); flash attention merged by logsumexp',
             cuda_only=True, package='triton'),
    FastPath('moda_depth_cache', residuals.MoDA, 'block', moda.cached_block,
             'depth slots written once into one cache, read in place (torch); flash attention merged by logsumexp'),
    FastPath('moda_sdpa', residuals.MoDA, 'attention', moda.sdpa_attention, 'null key on SDPA'),
]


# Liger's mHC ops (liger-kernel, the study's default mHC backend): the published kernels the fused
# stream steps are measured against (tools/gpu_check.py, `bench.py --suite=step`), not selected by
# `select`: they read the streams once per piece (coefficients, read, write) and autograd sums the
# streams' gradient over those uses, where the steps read them once each way (fast/streams.py).
LIGER_PATHS = [
    FastPath('mhc_coeffs_liger', residuals.MHC, 'coefficients', streams.liger_coefficients, 'liger_mhc_coeffs',
             cuda_only=True, package='liger_kernel', applies=lambda cfg: cfg.mhc_sinkhorn == 'liger'),
    FastPath('streams_read_liger', residuals.MultiStream, 'read_streams', streams.liger_read, 'liger_mhc_pre',
             cuda_only=True, package='liger_kernel'),
    FastPath('streams_write_liger', residuals.MultiStream, 'write_streams', streams.liger_write,
             'liger_mhc_post_res', cuda_only=True, package='liger_kernel'),
]


# fla-core's per-read AttnRes kernel: the published kernel the grouped read is measured against
# (tools/gpu_check.py, `bench.py --suite=step`), not selected by `select`: the grouped read
# reads each source once per group where it reads every source at every read (fast/attnres.py).
FLA_READ = FastPath('attnres_read_fla', residuals.AttnRes, 'read', attnres.fla_read, 'fla fused_attnres',
                    cuda_only=True, package='fla', in_run_dtype=True)


class FastPathMismatch(RuntimeError):
    """A fast path disagrees with the plain code it replaces (its message is one line)."""


def resolve(setting, device):
    """The `fast` setting ('auto', True, False, or their strings) -> bool for `device`
    ('auto': on for CUDA only). Raises ValueError for anything else."""
    if setting in ('auto', None):
        return torch.device(device).type == 'cuda'
    if setting in (True, 'True', 'true', 1):
        return True
    if setting in (False, 'False', 'false', 0):
        return False
    raise ValueError(f"fast must be 'auto', True or False, got {setting!r}")


def available(path, device):
    """Whether `path` can run on `device`: its device kind and its package."""
    if path.cuda_only and torch.device(device).type != 'cuda':
        return False
    return path.package is None or importlib.util.find_spec(path.package) is not None


def select(model, device):
    """The fast paths for this model on `device`: per plain method, the first that applies."""
    res, chosen = model.residual, {}
    for p in FAST_PATHS:
        if isinstance(res, p.scheme) and p.method not in chosen and p.applies(model.config) \
                and available(p, device):
            chosen[p.method] = p
    return list(chosen.values())


def enable(model, paths):
    """Puts each fast path in place of its plain method on model.residual (an instance
    attribute; `disable` removes them)."""
    for p in paths:
        setattr(model.residual, p.method, p.impl.__get__(model.residual))


def disable(model):
    for p in FAST_PATHS + LIGER_PATHS + [FLA_READ]:
        model.residual.__dict__.pop(p.method, None)


def twin_config(cfg):
    """The config of the start-up twin: same scheme and options, 4 blocks, head_dim 8, a
    64-token vocabulary; Block AttnRes in 4 blocks of 2 sublayers (so partial sums are read)."""
    return replace(cfg, n_layer=4, n_embd=8 * cfg.n_head, ffn_hidden=None, vocab_size=64, block_size=16,
                   attnres_blocks=4)


@torch.no_grad()
def randomise(model, seed=0):
    """Every parameter drawn afresh (the zero and near-identity inits would hide an edit)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        scale = 0.5 if p.dim() < 2 else p.size(-1) ** -0.5
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)


def _run(model, idx):
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, idx)
    loss.backward()
    return [('logits', logits.detach())] + [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]


def _plain_function(label):
    """The function of residuals.py a plain_code label names ('AttnRes.mix', 'sinkhorn'), or None."""
    owner, _, name = label.rpartition('.')
    fn = getattr(getattr(residuals, owner, None), name, None) if owner else getattr(residuals, name, None)
    return fn if callable(fn) and not isinstance(fn, type) else None


def plain_code(path):
    """The plain code a fast path stands in for, as a student would edit it: its method and,
    read from the source, every method of the scheme (`self.name`) and function of
    residuals.py (`name`) it uses, in turn. -> e.g. ['AttnRes.read', 'AttnRes.mix', 'no_autocast']."""
    found, todo = [], [f"self.{path.method}"]
    while todo:
        ref = todo.pop(0)
        if ref.startswith('self.'):
            owner = next((c for c in path.scheme.__mro__ if ref[5:] in vars(c)), None)
            label, fn = (f"{owner.__name__}.{ref[5:]}", getattr(owner, ref[5:])) if owner else (None, None)
        else:
            label, fn = ref, getattr(residuals, ref)
        if label is None or label in found or not callable(fn) or isinstance(fn, type):
            continue
        found.append(label)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):  # no source to read (a lambda, a builtin)
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == 'self':
                todo.append(f"self.{node.attr}")
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in vars(residuals):
                todo.append(node.id)
    return found


def fingerprint(label):
    """12 hex digits of the code of plain function `label` (its syntax tree without docstring,
    name or decorators: comments and formatting do not count), or None when it has no source
    (a lambda put in its place)."""
    fn = _plain_function(label)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = tree.body[1:] if tree.body and isinstance(tree.body[0], ast.Expr) and \
        isinstance(tree.body[0].value, ast.Constant) and isinstance(tree.body[0].value.value, str) else tree.body
    code = ast.dump(tree.args, annotate_fields=False) + ''.join(ast.dump(node, annotate_fields=False) for node in body)
    return hashlib.sha256(code.encode()).hexdigest()[:12]


def edited(path):
    """The plain code of `path` that differs from the code its fast path was checked against
    (CHECKED_CODE): the methods a student edited. [] when none was."""
    return [label for label in plain_code(path) if fingerprint(label) != CHECKED_CODE.get(label)]


def _refusal(p, what):
    """The guard's one line for fast path p, which disagrees with the plain code in `what`."""
    changed = edited(p)
    if changed:
        return (f"--fast=True refused: residuals.py's {', '.join(changed)} {'was' if len(changed) == 1 else 'were'} "
                f"edited, and fast path {p.name} ({p.runs}, in place of residuals.{p.scheme.__name__}.{p.method}) "
                f"computes the code it was checked against ({what}); run with --fast=False so that your edit "
                f"is what runs")
    return (f"fast path {p.name} ({p.runs}) disagrees with residuals.{p.scheme.__name__}.{p.method} ({what}; "
            f"residuals.py: {', '.join(plain_code(p))}); run with --fast=False")


def check(model, paths, device, dtype=None, twin_dtype=None):
    """The start-up guard: a twin of `model` (`twin_config`, random weights; fp64 on the CPU,
    fp32 on CUDA, or `twin_dtype`) runs a training step plain and then with each fast path alone;
    logits and every gradient must agree to 1e-9 relative (fp64) or 2e-3 (fp32); a fast path with
    an `extreme` regime is held against the plain code in it too, on a second twin. With `dtype`
    bf16 or fp16 (the run's autocast) each fast path is then also held against the plain method
    under that autocast (`check_autocast`). Raises FastPathMismatch naming the fast path and the
    plain code it replaces (`plain_code`), and the plain code that was edited, otherwise."""
    device = torch.device(device)
    twin_dtype = twin_dtype or (torch.float64 if device.type == 'cpu' else torch.float32)
    tol = 1e-9 if twin_dtype == torch.float64 else 2e-3
    twin = GPT(twin_config(model.config)).to(device=device, dtype=twin_dtype)
    randomise(twin)
    idx = torch.randint(0, twin.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    plain, extremes = _run(twin, idx), {}
    for p in paths:
        _compare(p, twin, idx, plain, tol, "start-up twin")
        if p.extreme is not None:
            if p.extreme not in extremes:
                x = copy.deepcopy(twin)
                p.extreme[1](x)
                extremes[p.extreme] = (x, _run(x, idx))
            x, want = extremes[p.extreme]
            _compare(p, x, idx, want, tol, f"start-up twin with {p.extreme[0]}")
    if dtype in LOW_PRECISION:
        check_autocast(model, paths, device, dtype)


def _compare(p, twin, idx, plain, tol, where):
    """Fast path p on `twin` against the plain step's [(name, logits or gradient)] `plain`."""
    enable(twin, [p])
    try:
        got = _run(twin, idx)
    finally:
        disable(twin)
    if [n for n, _ in got] != [n for n, _ in plain]:
        raise FastPathMismatch(_refusal(p, f"it leaves other parameters without gradient on the {where}"))
    # each tensor's error relative to its largest entry, floored at 1e-3 of the largest of all
    # (a gradient that is small by cancellation carries the rounding of its larger terms)
    floor = 1e-3 * max(t.abs().max().item() for _, t in plain)
    for (n, want), (_, have) in zip(plain, got):
        err = (have - want).abs().max().item() / max(want.abs().max().item(), floor)
        if not err <= tol:  # NaN fails too
            raise FastPathMismatch(_refusal(p, f"{where}, {n}: relative error {err:.1e} > {tol:.0e}"))


# ---- the guard under the run's autocast ----------------------------------------

LOW_PRECISION = (torch.bfloat16, torch.float16)
AUTOCAST_FACTOR, AUTOCAST_FLOOR = 3.0, 1e-5  # fast error <= 3 x plain's own + 1e-5 (relative, to fp64)
GRADIENT_FLOOR = 1e-3  # a gradient's norm is floored at this of the largest gradient entry, per entry (as `check`)
# the ops whose rounding decides a softmax or a norm: what the plain code keeps in fp32 under autocast
NORMALISERS = frozenset({'_softmax', '_log_softmax', 'logsumexp', 'exp', 'expm1', 'log', 'log1p', 'rsqrt', 'sqrt',
                         'reciprocal', 'sigmoid', 'rms_norm', '_fused_rms_norm', '_softmax_backward_data',
                         '_log_softmax_backward_data', 'sigmoid_backward'})


class LowPrecisionOps(TorchDispatchMode):
    """Records the NORMALISERS that run on a bf16 / fp16 tensor (after autocast's casts)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in NORMALISERS and any(isinstance(a, torch.Tensor) and a.dtype in LOW_PRECISION for a in args):
            self.ops.add(name)
        return func(*args, **(kwargs or {}))


def _calls(twin, method, idx, dtype):
    """[(args, autocast on)] of every call of the plain `method` in a forward of `twin` under
    `dtype` autocast: the inputs the model hands it, and whether autocast was on inside."""
    res, kind = twin.residual, idx.device.type
    plain, calls = getattr(type(res), method), []

    def record(self, *args):
        calls.append((args, torch.is_autocast_enabled(kind)))
        return plain(self, *args)
    setattr(res, method, record.__get__(res))
    try:
        with torch.no_grad(), torch.autocast(kind, dtype=dtype):
            twin(idx, idx)
    finally:
        res.__dict__.pop(method, None)
    return calls


def _replay(fn, res, args, on, dtype, to=None, modules=None, output=0):
    """fn(res, *args) under `dtype` autocast (if `on`) on fresh leaves of args (float tensors cast
    to `to`; submodules of the twin mapped through `modules`), gradient of a fixed random
    weighting of its output number `output` (what training reads) -> (its float tensor outputs,
    gradients of the tensor inputs, of res's parameters and of a module argument's (a block-level
    path's backbone block; None: unused), normalisers run in low precision)."""
    leaves = []

    def leaf(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            leaves.append(a.detach().to(to or a.dtype).requires_grad_())
            return leaves[-1]
        if isinstance(a, (list, tuple)):
            items = [leaf(b) for b in a]
            return type(a)(*items) if hasattr(a, '_fields') else type(a)(items)  # a NamedTuple state too
        return modules.get(id(a), a) if modules and isinstance(a, torch.nn.Module) else a
    args = [leaf(a) for a in args]
    # the scheme's parameters and those of a backbone block handed to the method (a block-level path)
    params = list(res.parameters()) + [q for a in args if isinstance(a, torch.nn.Module) for q in a.parameters()]
    with LowPrecisionOps() as ops:
        with torch.autocast(leaves[0].device.type, dtype=dtype, enabled=on):
            out = fn(res, *args)
        out = list(out) if isinstance(out, tuple) else [out]
        g = torch.Generator().manual_seed(2)
        w = torch.randn(out[output].shape, generator=g, dtype=torch.float64).to(out[output].device)
        grads = torch.autograd.grad((out[output].double() * w).sum(), leaves + params, allow_unused=True)
    floats = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return [o.detach() for o in floats], list(grads), ops.ops


NUDGES = 4  # samples of the plain method's rounding on moved inputs, besides the one on the inputs


def _nudged(args, seed, dtype=None):
    """args with every float tensor t moved to t (1 +- 2^-8) (a random sign per entry drawn from
    `seed`: about one ulp of bf16, so that a low-precision rounding of it falls elsewhere), rounded
    to `dtype` if given."""
    g = torch.Generator().manual_seed(seed)

    def move(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            sign = (torch.randint(0, 2, a.shape, generator=g) * 2 - 1).to(device=a.device, dtype=torch.float64)
            t = (a.double() * (1 + sign * 2.0 ** -8)).to(a.dtype)
            return t if dtype is None else t.to(dtype)
        if isinstance(a, (list, tuple)):
            items = [move(b) for b in a]
            return type(a)(*items) if hasattr(a, '_fields') else type(a)(items)  # a NamedTuple state too
        return a
    return [move(a) for a in args]


def check_autocast(model, paths, device, dtype):
    """Each fast path against its plain method under the run's autocast `dtype`, on the inputs
    the start-up twin (fp32 weights, `dtype` autocast) hands the plain method: every output and
    every gradient of the fast path must be within 3x the plain method's own distance to an fp64
    reference (+ 1e-5), relative (summed over the calls), and the fast path may run no
    softmax, exp, log or norm (NORMALISERS) in `dtype` that the plain method does not. A fast
    path that rounds where the plain code does not is refused: FastPathMismatch. A path
    declared `in_run_dtype` (fla's kernel: one dtype for all sources and its output) is given
    the plain method's inputs and outputs rounded to `dtype` and one ulp of `dtype` beside the
    3x (its fp32 exactness is the fp32 twin's to check). The plain method's distance is the largest
    of 1 + NUDGES samples of its rounding: on the inputs, and on the inputs moved by about one ulp of
    `dtype` (`_nudged`), each against its own fp64 reference: a gradient small by cancellation (a
    gate's, summed over every token) carries a rounding noise that one sample can underrate ten
    times, and a fast path that rounds as finely, only elsewhere, would be refused on it. A
    gradient is measured relative to its own norm floored at 1e-3 of the largest gradient entry
    of all (per entry), as `check`'s fp32 twin: a gradient that is zero but for rounding (mHC's
    first H_res gate, whose streams are all the embedding and whose columns sum to 1) has no
    digits for the 3x to compare."""
    device = torch.device(device)
    twin = GPT(twin_config(model.config)).to(device=device, dtype=torch.float32)
    randomise(twin)
    res = twin.residual
    ref = copy.deepcopy(res).to(torch.float64)
    modules = {id(m): ref.get_submodule(n) for n, m in res.named_modules()}
    blocks = copy.deepcopy(twin.blocks).to(torch.float64)  # the branches a block-level fast path calls
    modules.update({id(m): blocks.get_submodule(n) for n, m in twin.blocks.named_modules()})
    idx = torch.randint(0, twin.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    low = str(dtype).removeprefix('torch.')
    for p in paths:
        plain = getattr(type(res), p.method)
        where = f"fast path {p.name} ({p.runs}) against residuals.{p.scheme.__name__}.{p.method} under {low} autocast"
        sums, largest = {}, 0.0
        for args, on in _calls(twin, p.method, idx, dtype):
            if p.in_run_dtype:  # its declared rounding: the plain method and fp64 read the same inputs
                args = [[t.to(dtype) for t in a] if isinstance(a, (list, tuple)) else
                        a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            want_out, want_grads, _ = _replay(plain, ref, args, False, dtype, torch.float64, modules, p.output)
            base_out, base_grads, base_ops = _replay(plain, res, args, on, dtype, output=p.output)
            if p.in_run_dtype:  # and the plain method's outputs are rounded as the fast path's are
                base_out = [o.to(dtype).to(o.dtype) for o in base_out]
            have_out, have_grads, have_ops = _replay(p.impl, res, args, on, dtype, output=p.output)
            samples = []  # (outputs, gradients) of the plain method and of fp64 on moved inputs
            for seed in range(NUDGES):
                moved = _nudged(args, seed, dtype if p.in_run_dtype else None)
                w_out, w_grads, _ = _replay(plain, ref, moved, False, dtype, torch.float64, modules, p.output)
                b_out, b_grads, _ = _replay(plain, res, moved, on, dtype, output=p.output)
                if p.in_run_dtype:
                    b_out = [o.to(dtype).to(o.dtype) for o in b_out]
                samples.append((w_out + w_grads, b_out + b_grads))
            extra = sorted(have_ops - base_ops)
            if extra:
                raise FastPathMismatch(f"{where}: runs {', '.join(extra)} in {low} where the plain method does not; "
                                       f"run with --fast=False or --dtype=float32")
            names = [f"output {i}" for i in range(len(want_out))] + [f"gradient {i}" for i in range(len(want_grads))]
            for k, (name, want, base, have) in enumerate(zip(names, want_out + want_grads, base_out + base_grads,
                                                             have_out + have_grads)):
                if (base is None) != (have is None):
                    raise FastPathMismatch(f"{where}: {name} is computed by one form only; run with --fast=False")
                if want is None or base is None:
                    continue
                want = want.double()
                e = sums.setdefault(name, [0.0, 0.0, 0] + [[0.0, 0.0] for _ in range(1 + NUDGES)])
                e[0] += (have.double() - want).square().sum().item()
                e[1] += want.square().sum().item()
                e[2] += want.numel()
                if name.startswith('gradient'):
                    largest = max(largest, want.abs().max().item())
                for (w, b), acc in zip([(want, base)] + [(w[k].double(), b[k]) for w, b in samples], e[3:]):
                    acc[0] += (b.double() - w).square().sum().item()
                    acc[1] += w.square().sum().item()
        floor = torch.finfo(dtype).eps if p.in_run_dtype else AUTOCAST_FLOOR
        for name, (e_fast, norm, numel, *plains) in sums.items():
            # per entry, at least GRADIENT_FLOOR of the largest gradient entry (each sample's norm too)
            least = (GRADIENT_FLOOR * largest) ** 2 * numel if name.startswith('gradient') else 0.0
            fast_err = (e_fast / max(norm, least, 1e-300)) ** 0.5
            plain_err = max((e / max(n, least, 1e-300)) ** 0.5 for e, n in plains)
            if not fast_err <= AUTOCAST_FACTOR * plain_err + floor:
                raise FastPathMismatch(
                    f"{where}: {name} is {fast_err:.1e} from fp64 where the plain method is {plain_err:.1e} "
                    f"(allowed {AUTOCAST_FACTOR:g}x + {floor:.0e}); run with --fast=False or --dtype=float32")


def setup(model, setting, device, guard=True, dtype=None):
    """Resolves `setting` for `device`, puts the fast paths that apply in place (after the
    start-up `check`, under the run's autocast `dtype` too when it is bf16 / fp16, unless
    guard=False) and returns them ([] when off)."""
    if not resolve(setting, device):
        return []
    paths = select(model, device)
    if guard and paths:
        check(model, paths, device, dtype)
    enable(model, paths)
    return paths


def describe(paths):
    """One line for the run's log: which fast paths are on."""
    if not paths:
        return "fast paths: off (the plain code of residuals.py)"
    return "fast paths: " + ", ".join(f"{p.name} ({p.runs})" for p in paths) + " - checked against residuals.py"


# The plain code each fast path was last checked against (`fingerprint` of every label of
# `plain_code`): when the guard refuses, the labels whose code differs are the edit it names.
# tests/test_fast.py fails when this table and residuals.py part ways; after changing a plain
# method on purpose, make its fast paths compute the new code, then update its line here
# (`python -c "import fast; print(fast.current_code())"`).
CHECKED_CODE = {
    'AttnRes.read': 'b4e3dc1b2774', 'AttnRes.mix': '2d570f090332', 'no_autocast': '0ba5bf60b5f3',
    'BlockAttnRes.read_at': '4333cb12b75d', 'BlockAttnRes.boundary': '1d5c91b87103',
    'Residual.record': '238965e20163', 'BlockAttnRes.block': 'f832495a3410', 'AttnRes.attn_input': '3aad509f8066',
    'rms_norm_eps': 'fdf3bfeee96e', 'MHC.coefficients': '0d330215714b', 'sinkhorn': '0753b2593d6f',
    'MHC.sinkhorn_rounds': '8b3588bc5fa7', 'sinkhorn_rounds': '8b3588bc5fa7', 'sinkhorn_round': '0c8a96a9f001',
    'HC.coefficients': '0eb74f874b89', 'MultiStream.read_streams': 'c5ffc4ba25bf',
    'MultiStream.write_streams': '77d316b0ddba', 'MoDA.attention': 'e782425acffc', 'MoDA.block': '331e0a62fa4f', 'put_slot': '1a7252383f43',
    'MultiStream.block': 'f56dedabd706', 'MultiStream.sublayer': '407cc669e821',
}


def current_code():
    """{label: fingerprint} of the plain code of every fast path as residuals.py has it now."""
    return {label: fingerprint(label) for p in FAST_PATHS for label in plain_code(p)}
