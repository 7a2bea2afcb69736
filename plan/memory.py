"""
The training-memory plan (docs/gpu.md): what a training micro-step of a GPT needs, measured on
small probes and extrapolated to the run's shape, and the micro-batch that fits. train.py's
planner and --auto_batch use it; `python cost.py --memory=CONFIG` prints it for a config file.
"""

import contextlib
import math
import os
import re
import sys
import time

from dataclasses import replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fast as fastpath
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# what a training micro-step keeps: instruments


def saved_storages(own):
    """(seen, pack): `pack`, a saved_tensors_hooks pack hook, records in `seen` {data_ptr: bytes}
    each storage autograd saves that is not in `own` (the weights), once however many views."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    return seen, pack


def saved_activation_bytes(model, idx, targets, ctx=None):
    """Bytes autograd keeps for backward after one forward pass of `model(idx, targets)`:
    the sum of nbytes of the unique storages of the saved tensors, parameters and buffers
    excluded (torch.autograd.graph.saved_tensors_hooks). Views of one storage count once,
    so tensors that are alive anyway (a residual stream saved by two ops) count once too.
    Autocast's low-precision copies of the weights are not parameters: they count."""
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen, pack = saved_storages(own)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx or contextlib.nullcontext():
        _, loss = model(idx, targets)
    del loss
    return sum(seen.values())


class LiveBytes(TorchDispatchMode):
    """While active, follows every tensor storage that an op creates (through weak references):
    `live` = the bytes of those still alive, `peak` = the most at any op boundary. Storages
    whose data pointer is in `exclude` (weights, gradients) are not counted; views of one
    storage count once. It sees the backward too (the autograd engine runs its ops under the
    same mode), on any device; temporaries inside a single op are not seen. It costs a scan of
    the live storages per op that allocates: about 20x a training step of the 400M model on a
    CPU (step_bytes uses the CUDA allocator's counters instead on a GPU)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.exclude, self.refs, self.live, self.peak = set(exclude), {}, 0, 0  # refs: data pointer -> (ref, bytes)
        self.timeline = []  # `live` after every op that allocated, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.update(out)
        return out

    def update(self, out=None):
        """Adds the storages `out` creates, after forgetting those freed since then. An op that
        creates none is skipped: until the next one the bytes alive can only fall, and the
        peak stays. out=None: forget the freed ones now (an exact `live`)."""
        expired = torch.UntypedStorage._expired  # StorageWeakRef.expired without two Python calls
        new = {}
        for t in tree_leaves(out) if out is not None else ():
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                p, seen = s.data_ptr(), self.refs.get(s.data_ptr())
                if s.nbytes() and p not in self.exclude and (seen is None or expired(seen[0].cdata)):
                    new[p] = s  # (an address is reused once its storage is freed)
        if out is not None and not new:
            return
        self.refs = {p: x for p, x in self.refs.items() if not expired(x[0].cdata)}
        self.refs.update({p: (StorageWeakRef(s), s.nbytes()) for p, s in new.items()})
        self.live = sum(n for _, n in self.refs.values())
        self.peak = max(self.peak, self.live)
        self.timeline.append(self.live)


class AllocatedBytes(TorchDispatchMode):
    """LiveBytes' counterpart on CUDA, from the caching allocator's counters: after every op,
    the most bytes allocated during it (`timeline`, so a kernel's own workspace counts), `peak`
    the most of all, `live` the bytes allocated now; all above what was allocated at the start."""

    def __init__(self, device):
        super().__init__()
        self.dev, self.timeline, self.peak = device, [], 0
        torch.cuda.synchronize(device)
        self.base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.update()
        return out

    def update(self, out=None):
        most = torch.cuda.max_memory_allocated(self.dev) - self.base  # the allocator counts at launch: no sync
        torch.cuda.reset_peak_memory_stats(self.dev)
        self.live = torch.cuda.memory_allocated(self.dev) - self.base
        self.peak = max(self.peak, most)
        self.timeline.append(most)


def step_bytes(model, idx, ctx=None):
    """One training micro-step of `model` on idx (B, T) (targets = idx): the forward under
    `ctx` (autocast or None), then the backward, as train.py runs it. Call it with every
    gradient allocated (as on a later micro-step of gradient accumulation): gradients are
    then accumulated in place and not counted. Returns bytes above the weights and gradients:
      saved     what autograd keeps for backward (saved_activation_bytes' count)
      live      alive when the forward has returned and autocast has exited
      peak      the most alive at any moment of forward and backward
      timeline  the bytes alive after each op (`LiveBytes`, or `AllocatedBytes` on CUDA)"""
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())
           + [p.grad for p in model.parameters() if p.grad is not None]}
    seen, pack = saved_storages(own)

    tracker = AllocatedBytes(idx.device) if idx.device.type == 'cuda' else LiveBytes(own)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx or contextlib.nullcontext():
            loss = model(idx, idx)[1]  # the logits are dropped, as train.py drops them
        tracker.update()
        live = tracker.live
        loss.backward()
        del loss
    return dict(saved=sum(seen.values()), live=live, peak=tracker.peak, timeline=tracker.timeline)


# -----------------------------------------------------------------------------
# from the probes to the run's shape


def fit_bytes(points):
    """Fits bytes(B, T) = c0 + c1 T + c2 T² + B (c3 + c4 T + c5 T²) to measurements
    {(B, T): bytes} at two batch sizes and three lengths (least squares; exact when the bytes
    have this form, as tensor sizes do): c0 grows with neither (autocast's weight copies),
    c1, c2 with the sequence only (a causal mask shared by the batch), c3 + c4 T + c5 T² is one
    sequence's share (c3: a fixed number of extra positions, e.g. MoDA's null key; c5: an
    explicit T x T score matrix, e.g. MoDA's plain attention). With fewer distinct lengths the
    T² terms (then the T terms) are left out. Returns (c0, c1, c2, c3, c4, c5) as floats; with
    a sequence of K numbers per shape (a timeline), a (6, K) array, one fit per column."""
    import numpy as np
    n_T = len({T for _, T in points})
    use = np.array([True, n_T >= 2, n_T >= 3, n_T >= 2, True, n_T >= 3])
    A = np.array([[1, T, T * T, B, B * T, B * T * T] for B, T in points], dtype=np.float64)[:, use]
    Y = np.array(list(points.values()), dtype=np.float64)
    c = np.zeros((6,) + Y.shape[1:])
    c[use] = np.linalg.lstsq(A, Y, rcond=None)[0]
    return tuple(c.tolist()) if Y.ndim == 1 else c


def fit_at(c, T):
    """The parts of a `fit_bytes` fit at length T: (fixed, the sequence-only part, one sequence's part)."""
    return c[0], c[1] * T + c[2] * T * T, c[3] + c[4] * T + c[5] * T * T


def fit_value(c, B, T):
    """A `fit_bytes` fit at batch B, length T (an array for a fit of timelines)."""
    fixed, seq_only, per_seq = fit_at(c, T)
    return fixed + seq_only + B * per_seq


def fast_paths_of(model):
    """The fast paths (fast.FAST_PATHS) enabled on `model`'s scheme."""
    on = vars(model.residual)
    return [p for p in fastpath.FAST_PATHS if getattr(on.get(p.method), '__func__', None) is p.impl]


PARTITION_BACKEND = 'aot_eager_decomp_partition'  # inductor's forward/backward partition, no code generated


def compiled_saved_bytes(cfg, device, ctx, paths, shapes):
    """saved_activation_bytes of GPT(cfg) with `paths` (fast paths) on, its regions compiled as
    GPT.compile_regions does, at each (B, T) of `shapes`: what the compiled model keeps for
    backward. The regions are compiled with PARTITION_BACKEND: inductor's decompositions and
    min-cut partition (which tensors to save, which to recompute in the backward) without
    generating code, every size dynamic (one trace serves all shapes). Builds its own model on
    `device`, then torch._dynamo.reset(): the process's compiled code is cleared, so call it
    before compiling the model that trains. Returns {(B, T): bytes}."""
    with torch.device(device):
        probe = GPT(cfg)
    fastpath.enable(probe, paths)
    probe.compile_regions(backend=PARTITION_BACKEND)
    g = torch.Generator().manual_seed(0)
    try:
        with torch._dynamo.config.patch(assume_static_by_default=False):
            return {(B, T): saved_activation_bytes(probe, x, x, ctx) for B, T in shapes
                    for x in [torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device)]}
    finally:
        del probe
        torch._dynamo.reset()


PROBE_TOKENS = {'cuda': 64, 'cpu': 32}  # the probes run 1, 2 and 3 x this many tokens (at most block_size):
                                        # longer on CUDA, whose allocator rounds every block to 512 bytes
PROBE_BATCHES = (2, 3)  # ... at these batch sizes (2, not 1: compilation treats a size of 1 apart)


def probe_shapes(block_size, probe_tokens=PROBE_TOKENS['cpu']):
    """The (B, T) of the probes: PROBE_BATCHES x three lengths t, 2t, 3t, t = min(probe_tokens,
    block_size // 3) (fewer distinct lengths for block_size < 3)."""
    t = max(1, min(probe_tokens, block_size // 3))
    lengths = sorted({min(k * t, block_size) for k in (1, 2, 3)})
    return [(B, T) for B in PROBE_BATCHES for T in lengths]


def train_memory(cfg, batch, seq_len, device='cpu', dtype='float32', probe_tokens=None, model=None,
                 fast=None, compiled=False):
    """Predicted peak training memory (bytes) of GPTConfig `cfg` at micro-batch `batch` x
    `seq_len` tokens, fp32 weights and AdamW, with `dtype` autocast, as the run executes the
    model: the plain code of residuals.py or the fast paths in use (`fast`), eager or with
    GPT.compile_regions (`compiled`). A dict:
      params         4 N   fp32 weights
      grads          4 N   (alive through the backward of every micro-step after the first)
      adamw          8 N   exp_avg, exp_avg_sq
      weight_copies  autocast's low-precision copies of the weights that autograd keeps:
                     once per forward whatever the batch (2 bytes per weight of every Linear in
                     bf16, 0 in fp32)
      activations    the other bytes autograd keeps for backward at this batch and length
      backward       the most the step holds at once beyond those (the logits' gradient, the
                     gradients of the depth sources waiting for their producer, a read's
                     workspace, a weight's gradient before it is added; measured on the eager
                     model: the large ones live outside the compiled regions)
      total          their sum: the predicted peak
      per_sequence   what one more sequence in the micro-batch adds
      predict        a function: micro-batch B -> the predicted total at B (auto_batch's plan)
    weight_copies, activations and backward are measured, not derived per scheme: `step_bytes`
    runs training micro-steps of the model on `device` at the shapes of `probe_shapes` (2 x 3
    small (B, T); probe_tokens None = PROBE_TOKENS of the device), and
    `fit_bytes` fits bytes = c0 + c1 T + c2 T² + B (c3 + c4 T + c5 T²) to what they saved
    and to the bytes alive after each of their ops, which the prediction extrapolates: what
    does not grow with the batch (the weight copies) counts once, an explicit T x T score
    matrix (MoDA's plain attention) grows as T², and the peak is the most over the ops at the
    planned shape (at small shapes a weight's gradient may hold it, at large ones the logits').
    With compiled=True the saved bytes come from `compiled_saved_bytes` (inductor's partition,
    which recomputes cheap ops instead of saving them; it resets torch._dynamo).
    `model`: a GPT of this config on `device` to probe (its gradients are restored after);
    its own fast paths count, and `fast`, if given, must name the same. Without `model` one
    is built, with `fast` on: a list of fast.FastPath (fast.setup's result) or a `fast`
    setting (fast.select's choice for the device, unchecked); None = off.
    tests/test_memory.py checks the prediction against measured bytes, every scheme, fp32 and
    bf16 autocast, fast off and on, within 10%."""
    if model is None:
        dev = torch.device(device)
        with torch.device(dev):
            model = GPT(cfg)
        paths = fast if isinstance(fast, (list, tuple)) else \
            fastpath.select(model, dev) if fast is not None and fastpath.resolve(fast, dev) else []
        fastpath.enable(model, paths)
    else:
        dev = next(model.parameters()).device
        paths = fast_paths_of(model)
        if fast is not None and isinstance(fast, (list, tuple)) and {p.name for p in fast} != {p.name for p in paths}:
            raise ValueError(f"train_memory: fast={[p.name for p in fast]} but the model runs "
                             f"{[p.name for p in paths]}")
    n = model.num_params()
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    ctx = None if ptdtype == torch.float32 else torch.autocast(device_type=dev.type, dtype=ptdtype)
    shapes = probe_shapes(cfg.block_size, probe_tokens or PROBE_TOKENS.get(dev.type, PROBE_TOKENS['cpu']))
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():  # allocated, as on a later micro-step: the backward adds in place
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    try:
        probes = {(B, T): step_bytes(model, torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(dev), ctx)
                  for B, T in shapes}
    finally:
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad
    eager = fit_bytes({s: m['saved'] for s, m in probes.items()})
    saved = fit_bytes(compiled_saved_bytes(cfg, dev, ctx, paths, shapes)) if compiled else eager
    timelines = {s: m['timeline'] for s, m in probes.items()}
    if len({len(t) for t in timelines.values()}) == 1:
        # every probe ran the same ops: the bytes alive after op k are one fit each, and the peak
        # at any shape is the most of them there (a different op may hold it at another shape)
        ops = fit_bytes(timelines)
        peak = lambda B: float(fit_value(ops, B, seq_len).max())  # noqa: E731
    else:  # the ops differ with the shape (a size-dependent kernel choice): the peaks' fit
        peak_fit = fit_bytes({s: m['peak'] for s, m in probes.items()})
        peak = lambda B: fit_value(peak_fit, B, seq_len)  # noqa: E731

    def parts(B):
        return dict(params=4 * n, grads=4 * n, adamw=8 * n, weight_copies=round(saved[0]),
                    activations=round(fit_value(saved, B, seq_len) - saved[0]),
                    backward=round(peak(B) - fit_value(eager, B, seq_len)))

    def predict(B):
        """The predicted peak (bytes) at micro-batch B, same seq_len."""
        return sum(parts(B).values())
    out = parts(batch)
    out['total'] = sum(out.values())
    out['per_sequence'] = predict(batch + 1) - out['total']
    out['predict'] = predict
    return out


def probe_depths(cfg):
    """Three depths L, 2L, 3L below cfg.n_layer at which GPT(cfg) is the same scheme (it builds, and
    its notes read as the full depth's with their numbers aside: "4 blocks of 2 sublayers" is
    "4 blocks of 8" at another depth, while Block AttnRes in blocks of one sublayer says it is Full
    AttnRes), the smallest such L; None when 3L reaches cfg.n_layer (probe the model itself).
    Built on the meta device."""
    def notes(L):
        try:
            with torch.device('meta'):
                return [re.sub(r'[0-9][0-9,]*', 'N', line) for line in GPT(replace(cfg, n_layer=L)).residual.notes()]
        except ValueError:
            return None
    full = notes(cfg.n_layer)
    step = next((L for L in range(1, cfg.n_layer // 3 + 1) if notes(L) == full and notes(2 * L) == full
                 and notes(3 * L) == full), None)
    return None if step is None or 3 * step >= cfg.n_layer else (step, 2 * step, 3 * step)


def train_memory_by_depth(cfg, batch, seq_len, device='cpu', dtype='float32', fast=None, compiled=False,
                          depths=None):
    """train_memory of GPTConfig `cfg` measured on three shallower copies (probe_depths: L, 2L, 3L
    blocks) and extrapolated to cfg.n_layer: each part that is not 16 bytes per parameter
    (autocast's weight copies, the activations and the backward's peak at each micro-batch) is
    fitted as a + b L + c L² (exact for bytes that grow with depth as a block's activations do,
    or as the square of it, as the depth sources every AttnRes or MoDA block reads); the
    parameters are counted on the meta device. The probes then hold three shallow models, not
    the full one: the plan of a model too large to probe whole. Same dict as train_memory."""
    import numpy as np
    depths = depths or probe_depths(cfg)
    plans = {L: train_memory(replace(cfg, n_layer=L), batch, seq_len, device, dtype, fast=fast, compiled=compiled)
             for L in depths}
    with torch.device('meta'):
        n = GPT(cfg).num_params()
    at = lambda ys: float(np.polyval(np.polyfit(list(depths), ys, 2), cfg.n_layer))  # noqa: E731

    def rest(L, B):  # what the plan at depth L holds at micro-batch B beyond 16 bytes per parameter
        return plans[L]['predict'](B) - 4 * plans[L]['params']

    def predict(B):
        """The predicted peak (bytes) at micro-batch B, same seq_len."""
        return 16 * n + at([rest(L, B) for L in depths])
    out = dict(params=4 * n, grads=4 * n, adamw=8 * n,
               **{k: round(at([plans[L][k] for L in depths])) for k in ('weight_copies', 'activations', 'backward')})
    out['total'] = sum(out.values())
    out['per_sequence'] = predict(batch + 1) - predict(batch)
    out['predict'] = predict
    return out


# -----------------------------------------------------------------------------
# the plan against the device's memory: the micro-batch that fits, and the lines train.py prints

AUTO_BATCH_FILL = 0.9  # auto_batch plans for this share of the device's memory (allocator slack, CUDA context)
# a run stops before its first step when its plan passes this share of the memory: all of a GPU's (the plan
# is within 10% there, and a CUDA out-of-memory error still ends in one line), 90% of what a CPU has free (the
# kernel's OOM killer ends a process without a word, and the probes do not see malloc's overhead or an
# op's internal temporaries; measured, the plan is within 2% of the peak RSS of an eager CPU step)
RUN_FILL = {'cuda': 1.0, 'cpu': AUTO_BATCH_FILL}
HOST_LIMIT = 1 << 60  # a cgroup or rlimit at or above this (2^63 - 4096 in cgroup v1) means no limit


def _read(path):
    """The stripped text of a small file, or None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_free(root='/sys/fs/cgroup', cgroups='/proc/self/cgroup'):
    """(bytes, path) the memory cgroups of this process still allow: the least over the process's
    cgroup and its parents of limit - (usage - inactive file pages, which the kernel reclaims
    first), cgroup v2 (memory.max, memory.current) or v1 (memory.limit_in_bytes,
    memory.usage_in_bytes), found from `cgroups` (the process's cgroup paths) under `root`;
    (None, None) without a limit."""
    best = (None, None)
    for line in (_read(cgroups) or '').splitlines():
        if line.count(':') < 2:
            continue
        _, controllers, path = line.split(':', 2)
        if controllers == '':  # v2: one unified hierarchy
            base, files, inactive = root, ('memory.max', 'memory.current'), 'inactive_file'
        elif 'memory' in controllers.split(','):
            base, files, inactive = os.path.join(root, 'memory'), ('memory.limit_in_bytes',
                                                                   'memory.usage_in_bytes'), 'total_inactive_file'
        else:
            continue
        parts = [q for q in path.split('/') if q]
        for k in range(len(parts), -1, -1):  # the process's own cgroup first, then its parents
            d = os.path.join(base, *parts[:k])
            limit, used = (_read(os.path.join(d, f)) for f in files)
            if not (limit and used and limit.isdigit() and used.isdigit()) or int(limit) >= HOST_LIMIT:
                continue  # no such cgroup here (a namespace shows its root only), or 'max'
            stat = dict(ln.split() for ln in (_read(os.path.join(d, 'memory.stat')) or '').splitlines()
                        if len(ln.split()) == 2)
            free = int(limit) - max(0, int(used) - int(stat.get(inactive, 0)))
            if best[0] is None or free < best[0]:
                best = (max(0, free), os.path.join(d, files[0]))
    return best


def cpu_free_bytes():
    """(bytes, what limits them) this process may still allocate on the CPU, now: the least of
      - MemAvailable of /proc/meminfo (what the kernel can give without swapping),
      - the memory cgroup's limit less its working set (`_cgroup_free`: containers, SLURM),
      - the address-space limit (RLIMIT_AS: ulimit -v, prlimit --as) less the process's size
        (VmSize of /proc/self/status): an allocation past it fails.
    (None, None) where none of them can be read (not Linux)."""
    import resource
    found = []
    meminfo = dict(ln.split(':', 1) for ln in (_read('/proc/meminfo') or '').splitlines() if ':' in ln)
    if 'MemAvailable' in meminfo:
        found.append((int(meminfo['MemAvailable'].split()[0]) * 1024, 'MemAvailable of /proc/meminfo'))
    cgroup, where = _cgroup_free()
    if cgroup is not None:
        found.append((cgroup, f"the cgroup limit {where} less its usage"))
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    status = dict(ln.split(':', 1) for ln in (_read('/proc/self/status') or '').splitlines() if ':' in ln)
    if soft != resource.RLIM_INFINITY and soft < HOST_LIMIT and 'VmSize' in status:
        size = int(status['VmSize'].split()[0]) * 1024
        found.append((max(0, soft - size), "the address-space limit RLIMIT_AS less this process's size"))
    return min(found) if found else (None, None)


def device_memory(device, model=None):
    """(bytes, what they are) the run's plan is held against, comparable to train_memory's total:
      cuda  the device's total memory (the weights already there are part of the plan);
      cpu   `cpu_free_bytes` shared by this machine's processes (torchrun's LOCAL_WORLD_SIZE),
            plus the bytes `model`'s weights and buffers already hold (the plan counts them, the
            free memory no longer does).
    (None, None) for another device (mps), or a CPU whose free memory cannot be read."""
    dev = torch.device(device)
    if dev.type == 'cuda':
        return torch.cuda.get_device_properties(dev).total_memory, f"{device}'s total memory"
    if dev.type != 'cpu':
        return None, None
    free, what = cpu_free_bytes()
    if free is None:
        return None, None
    procs = int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    held = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers())) if model is not None else 0
    return free // procs + held, what + (f", shared by {procs} processes" if procs > 1 else '')


def fit_message(mem, batch, seq_len, accum, device_bytes, what, fill, processes=1):
    """None when the plan `mem` (train_memory's, at micro-batch `batch` x `seq_len`) fits `fill`
    of `device_bytes`; else the one line train.py stops with: the planned and available bytes, what
    the available bytes are (`what`), and the fix: --auto_batch=True, or the --batch_size and
    --gradient_accumulation_steps it would pick (AUTO_BATCH_FILL of device_bytes; accum: this
    process's steps, the command line's are `processes` times as many)."""
    if mem['total'] <= fill * device_bytes:
        return None
    g = lambda b: f"{b / 2**30:.1f} GiB ({b:,.0f} bytes)"  # noqa: E731
    try:
        b, steps = auto_micro_batch(batch * accum, mem['predict'], AUTO_BATCH_FILL * device_bytes)
        fix = (f"rerun with --auto_batch=True (the largest micro-batch that fits, same global batch) or "
               f"--batch_size={b} --gradient_accumulation_steps={steps * processes}")
    except ValueError:
        fix = "even a micro-batch of 1 sequence does not fit: use a shorter --block_size or a smaller model"
    share = f"{fill:.0%} of " if fill < 1 else ''
    return (f"the run does not fit in memory: its plan needs {g(mem['total'])} at micro-batch {batch} x {seq_len} "
            f"tokens, more than {share}the {g(device_bytes)} available ({what}); {fix}")


def auto_micro_batch(sequences, predict, budget):
    """The largest micro-batch B dividing `sequences` (per process per optimizer step:
    batch_size x gradient_accumulation_steps) with predict(B) <= budget bytes, and the
    accumulation steps sequences / B that keep the global batch. Returns (B, steps).
    Raises ValueError when even B = 1 does not fit."""
    for b in sorted((b for b in range(1, sequences + 1) if sequences % b == 0), reverse=True):
        if predict(b) <= budget:
            return b, sequences // b
    raise ValueError(f"even a micro-batch of 1 sequence needs {predict(1) / 2**30:.1f} GiB, more than the "
                     f"{budget / 2**30:.1f} GiB available: use a smaller model, shorter block_size, or FSDP")


def hold_static(cfg, device, memory_gib=None):
    """(bytes, what they are) of the memory train.py's plan is held against (--memory_gib, else
    `device_memory`), once the run's static bytes, 16 per parameter (fp32 weights, gradients,
    AdamW's two moments; counted on the meta device: nothing is allocated), have been held
    against them: before the model is built and probed at full width. Raises ValueError (the
    one line) when those alone pass the share of the memory a run may fill (RUN_FILL)."""
    with torch.device('meta'):
        n = GPT(cfg).num_params()
    dev = torch.device(device)
    device_bytes, what = (memory_gib * 2**30, f"--memory_gib={memory_gib:g}") if memory_gib else device_memory(dev)
    fill = RUN_FILL.get(dev.type, AUTO_BATCH_FILL)
    if device_bytes is not None and 16 * n > fill * device_bytes:
        share = f"{fill:.0%} of " if fill < 1 else ''
        raise ValueError(f"the run does not fit in memory: its {n:,} parameters alone need {16 * n / 2**30:.1f} GiB "
                         f"(16 bytes each: weights, gradients and AdamW's moments), more than {share}the "
                         f"{device_bytes / 2**30:.1f} GiB available ({what}); use a smaller model, FSDP under "
                         f"torchrun, or a machine with more memory")
    return device_bytes, what


def plan_run(model, paths, batch, seq_len, accum, world_size, dtype, compiled, device_bytes, what, auto_batch,
             say=print):
    """train.py's plan: `train_memory` of `model` (its fast paths `paths`; `compiled`: inductor's
    partition), said in one line (`say`), then held against `device_bytes` (`hold_static`'s):
    the micro-batch that fits with auto_batch, else the one line the run stops with when it does
    not fit. Returns (micro-batch, gradient_accumulation_steps of this process); raises ValueError."""
    dev = next(model.parameters()).device
    if auto_batch and device_bytes is None:
        raise ValueError(f"auto_batch=True needs the device's memory, which {dev.type} does not report: give "
                         f"--memory_gib=...")
    t = time.time()
    depths = probe_depths(model.config)  # a deep model: three shallow copies probed, not the model itself
    if depths:
        mem = train_memory_by_depth(model.config, batch, seq_len, dev, dtype, fast=paths, compiled=compiled,
                                    depths=depths)
    else:
        mem = train_memory(model.config, batch, seq_len, dev, dtype, model=model, fast=paths, compiled=compiled)
    say(format_memory(mem, device_bytes, what) + f" [probed in {time.time() - t:.0f} s"
        + (f" at depths {', '.join(map(str, depths))}, extrapolated]" if depths else "]"))
    if auto_batch:
        batch, accum = auto_micro_batch(batch * accum, mem['predict'], AUTO_BATCH_FILL * device_bytes)
        say(f"auto_batch: micro-batch {batch}, gradient_accumulation_steps {accum}")
    elif device_bytes is not None:  # stop now, not mid-step (on the CPU: under the kernel's OOM killer, silently)
        msg = fit_message(mem, batch, seq_len, accum, device_bytes, what,
                          RUN_FILL.get(dev.type, AUTO_BATCH_FILL), world_size)
        if msg:
            raise ValueError(msg)
    return batch, accum


def out_of_memory(exc):
    """(the out-of-memory error in exc or in its chain of causes, whether compilation raised it):
    torch.compile wraps what its backend raises (BackendCompilerFailed.inner_exception); (None,
    False) for another error."""
    compiling, seen = False, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        compiling = compiling or type(exc).__module__.startswith(('torch._dynamo', 'torch._inductor'))
        if isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and any(
                w in str(exc).lower() for w in ('out of memory', "can't allocate memory"))):  # CUDA's, the CPU's
            return exc, compiling
        exc = getattr(exc, 'inner_exception', None) or exc.__cause__ or exc.__context__
    return None, False


def oom_hook(run, default=sys.excepthook):
    """A sys.excepthook (train.py's): an out-of-memory error (`out_of_memory`) is one line,
    `oom_message` of run() = (shape with residual, n_layer, n_embd; micro-batch; seq_len; global
    accumulation) and the command line's config file; any other error goes to `default`."""
    def hook(kind, value, tb):
        oom, compiling = out_of_memory(value)
        if oom is None:
            return default(kind, value, tb)
        config_file = next((a for a in sys.argv[1:] if not a.startswith('--')), None)
        msg = oom_message(*run(), 'compiling' if compiling else None, config_file)
        print(f"error: {msg}", file=sys.stderr, flush=True)
    return hook


def oom_message(cfg, batch, seq_len, accum, where=None, config_file=None):
    """The one line train.py prints for an out-of-memory error: the config (file and shape),
    where it ran out (e.g. 'compiling'), its micro-batch and the options that fix it."""
    name = f"{config_file} ({cfg.residual} L={cfg.n_layer} d={cfg.n_embd})" if config_file else \
        f"{cfg.residual} L={cfg.n_layer} d={cfg.n_embd}"
    fix = (f"rerun with --auto_batch=True (the largest micro-batch that fits, same global batch), or "
           f"--batch_size={batch // 2} --gradient_accumulation_steps={accum * 2}" if batch > 1 else
           "even one sequence does not fit: use --fsdp=True under torchrun, a shorter --block_size or a smaller model")
    return (f"out of memory{f' while {where}' if where else ''}: {name} at micro-batch {batch} x {seq_len} tokens "
            f"(gradient_accumulation_steps={accum}); {fix}")


def format_memory(mem, device_bytes=None, what='device'):
    """One line: the predicted peak and its parts in GiB, and the device's memory if given (`what`
    it is: device_memory's phrase)."""
    g = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    line = (f"predicted peak training memory {g(mem['total'])} GiB = weights {g(mem['params'])} + grads "
            f"{g(mem['grads'])} + AdamW {g(mem['adamw'])} + activations {g(mem['activations'])}"
            + (f" + autocast weight copies {g(mem['weight_copies'])}" if mem.get('weight_copies') else '')
            + f" + backward {g(mem['backward'])}")
    return line + (f" ({what}: {g(device_bytes)} GiB)" if device_bytes else '')


# -----------------------------------------------------------------------------
# python cost.py --memory=CONFIG


def memory_main(path, device='cpu', dtype='float32', budget_gib=None, compiled=None, fast=None):
    """cost.py --memory=CONFIG: prints the predicted peak of a train.py config file (its
    model, batch_size, gradient_accumulation_steps and block_size; train.py's defaults for
    what it leaves out, vocab 50280 unless it sets vocab_size) at its micro-batch, and with
    budget_gib the micro-batch train.py --auto_batch=True --memory_gib=budget_gib would
    choose (it fills AUTO_BATCH_FILL of the memory, as train.py does). The probes run on
    `device` under `dtype` autocast. compiled: with GPT.compile_regions; None = the config's
    `compile`, else on (train.py compiles on CUDA, where this is for). fast: the fast paths,
    a `fast` setting resolved for `device` ('auto': on for CUDA); None = the config's, else
    'auto'. On a CPU, --dtype=bfloat16 --fast=True plans a GPU run (the torch forms of the fast
    paths stand in for the CUDA kernels). Returns train_memory's dict."""
    from dataclasses import fields
    if budget_gib is not None and budget_gib <= 0:  # before the probe, not after it
        raise ValueError(f"--budget_gib={budget_gib:g}: give the device's memory in GiB, > 0")
    if not os.path.isfile(path):
        raise ValueError(f"config file {path} not found")
    ns = dict(batch_size=8, block_size=1024, gradient_accumulation_steps=8, vocab_size=None, compile=None,
              fast='auto')
    try:
        with open(path, 'rb') as f:
            source = f.read().decode('utf-8')
        exec(compile(source, path, 'exec'), {}, ns)
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {e.start}): a config file is Python source") \
            from None
    except Exception as e:  # a config file is Python: a mistake in it is the user's, one line
        raise ValueError(f"config file {path} failed: {type(e).__name__}: {e}") from None
    names = {f.name for f in fields(GPTConfig)}
    kw = {k: v for k, v in ns.items() if k in names and v is not None}
    # counts are whole numbers >= 1, other numbers finite: an inf or a nan would reach a shape or a loop bound
    counts = {'batch_size', 'block_size', 'gradient_accumulation_steps'} | \
        {f.name for f in fields(GPTConfig) if f.type in (int, int | None)}
    for k, v in [(k, ns[k]) for k in ('batch_size', 'block_size', 'gradient_accumulation_steps')] + list(kw.items()):
        if k in counts and (type(v) is not int or v < 1):
            raise ValueError(f"config file {path}: {k} = {v!r} must be a whole number >= 1")
        if type(v) is float and not math.isfinite(v):
            raise ValueError(f"config file {path}: {k} = {v!r} is not a finite number")
    kw.setdefault('vocab_size', 50280)
    try:
        cfg = GPTConfig(**kw)
    except TypeError as e:  # e.g. n_layer = "a": GPTConfig's checks compare numbers
        raise ValueError(f"config file {path}: a model setting has the wrong type ({e})") from None
    setting = ns['fast'] if fast is None else fast
    try:
        on = fastpath.resolve(setting, device)
    except ValueError as e:
        raise ValueError(f"--fast: {e}") from None
    B, T = ns['batch_size'], ns['block_size']
    compiled = (ns['compile'] is not False) if compiled is None else compiled
    with torch.device(device):
        model = GPT(cfg)
    print(f"{path}: {cfg.residual} L={cfg.n_layer} d={cfg.n_embd}, micro-batch {B} x {T} tokens, "
          f"{model.num_params():,} parameters; probed on {device} ({dtype}, fast paths {'on' if on else 'off'}, "
          f"{'compiled regions' if compiled else 'eager'})")
    try:
        paths = fastpath.setup(model, on, device)
    except fastpath.FastPathMismatch as e:
        raise ValueError(str(e)) from None
    depths = probe_depths(cfg)  # as train.py plans: a deep model through three shallow copies
    mem = train_memory_by_depth(cfg, B, T, device, dtype, fast=paths, compiled=compiled, depths=depths) if depths \
        else train_memory(cfg, B, T, device, dtype, model=model, fast=paths, compiled=compiled)
    print(format_memory(mem))
    if budget_gib is not None:
        b, acc = auto_micro_batch(B * ns['gradient_accumulation_steps'], mem['predict'],
                                  AUTO_BATCH_FILL * budget_gib * 2**30)
        print(f"in {budget_gib:g} GiB: micro-batch {b}, gradient_accumulation_steps {acc} (global batch unchanged)")
        mem['auto'] = (b, acc)
    return mem
