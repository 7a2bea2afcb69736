"""
The AttnRes depth read in groups of consecutive reads: the two-phase computation of Attention
Residuals (arXiv 2603.15031), a fast form of residuals.AttnRes.read (Full AttnRes) and
residuals.BlockAttnRes.read_at (Block AttnRes) with the same inputs and outputs.

A read k mixes its sources v_i (B, T, d):  z_k = sum_i a_ki v_i,  a_k = softmax_i(e_ki),
e_ki = s_i (v_i . u_k),  s_i = 1/rms(v_i) (the read's key RMSNorm and its eps),  u_k = w_k * g_k
(pseudo-query times key-norm gain). The pseudo-queries are parameters, not activations, so the
P <= G_MAX reads of a group of consecutive sublayers can all be scored against the sources that
exist when the group's first read runs (its *base*) in one pass:

  phase 1 (first read):  for every read p of the group, over the base sources,
                         lse1_p = logsumexp_i e_pi,  z1_p = sum_i exp(e_pi - lse1_p) v_i   (`Phase1`)
  phase 2 (each read):   merge z1_p with the sources newer than the base (*intra*), exactly:
                         lse = logaddexp(lse1_p, logsumexp_j e_pj),
                         z = exp(lse1_p - lse) z1_p + sum_j exp(e_pj - lse) v_j            (`Phase2`)

so each base source is read once per group, not once per read. Backward (DepthRead's formulas,
fast/attnres.py), with gz the incoming gradient of a read:  c = gz . z + sum_i a_i ga_i,
p_i = gz . v_i + ga_i,  ge_i = a_i (p_i - c),  gv_i = a_i gz + ge_i s_i u - ge_i e_i s_i^2 v_i / d,
gu = sum over tokens of ge_i s_i v_i. A read's backward only hands (gz, lse, z) to its group
(`Group.stash`). Each source's gradient is then formed from all of a group's reads of it in one
pass and summed over the groups in one fp32 buffer per source (`Sink`), which reaches autograd
once, through `Gather`: a base source's in the backward of phase 1 (`contribute`), an intra
source's when autograd asks for its gradient, in the same pass that adds the buffer and any
other gradient of it and casts to its dtype (`finish`). Math in fp32 (fp64 for fp64 sources);
every source is read in the dtype it comes in (the fp32 embedding and Block AttnRes's fp32
sums, bf16 sublayer outputs).

`TorchOps` (any device) and `TritonOps` (fast/depth_kernels.py: CUDA, or Triton's interpreter)
are two forms of the same steps; `read(ops)` and `read_at(ops)` give the methods a fast path
puts in place. A read that is not the one its group planned (another block order, a skip rule,
a state continued twice) starts a group of its own: same result, less sharing.
"""

import weakref

import torch

from perf.launch import launch
from residuals import BlockState, no_autocast

G_MAX = 8  # reads per group: the step estimate's best at the 400M L = 32 shape (docs/performance.md)


def task():
    """The id of the backward pass running now (a retained graph run twice has two)."""
    return torch._C._current_graph_task_id()


# ---- the gradient of a source: one buffer for all the groups that read it ------------------

class Sink:
    """The gradient of one source v, summed (in `acc` dtype: fp32, fp64 for fp64 sources) over
    the reads of it that run backward, per backward pass; `groups`: the groups v is an intra
    source of, whose reads' share `finish` forms."""

    def __init__(self, v):
        self.dtype, self.acc = v.dtype, torch.promote_types(v.dtype, torch.float32)
        self.sums = {}    # backward pass -> the sum so far (None once handed on)
        self.groups = []  # (group, key of v in it)

    def _open(self):
        have = self.sums.get(task(), False)
        if have is None:
            raise RuntimeError("grouped depth read: a read ran backward after its source's gradient was handed "
                               "on (an order the grouped read cannot see); run with --fast=False")
        return have

    def add(self, g):
        """Adds g (acc dtype), keeping g itself as the sum when it is the first."""
        have = self._open()
        self.sums[task()] = g if have is False else have.add_(g)

    def slot(self, like):
        """(buffer, holds_a_sum) for a kernel that adds into it or, when it holds none yet,
        writes it (a new empty buffer shaped like `like`)."""
        have = self._open()
        if have is False:
            have = self.sums[task()] = torch.empty(like.shape, dtype=self.acc, device=like.device)
            return have, False
        return have, True

    def finish(self, v, g):
        """v's gradient in its dtype, to hand on: the sum, the shares of the groups v is an
        intra source of (the last one formed in the same pass as the sum), and g (its gradient
        from elsewhere, or None). None if none of these exists. Closes the backward pass."""
        t = task()
        todo = [(grp, key) for grp, key in self.groups if grp.unformed(t, key)]
        for grp, key in todo[:-1]:
            grp.form(t, key, v, self)
        if todo:
            out = todo[-1][0].form(t, todo[-1][1], v, self, final=g)
        else:
            have = self._open()
            out = None if have is False else have.to(self.dtype)
            out = g if out is None else out if g is None else out + g
        self.sums[t] = None
        return out


class Gather(torch.autograd.Function):
    """alias = Gather.apply(sink, v): a view of v that every grouped read reads in v's place.
    Its backward runs after all of them (they are its consumers) and returns `Sink.finish`."""

    @staticmethod
    def forward(ctx, sink, v):
        ctx.sink = sink
        ctx.save_for_backward(v)
        ctx.set_materialize_grads(False)
        return v.view_as(v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        with no_autocast(v):
            return None, ctx.sink.finish(v, g)


class Bank:
    """id -> (v, alias, sink) for the sources read while autograd records, so that every read
    of v reads one alias and adds to one sink (an alias is its own entry). Keeps nothing alive:
    the aliases live in the autograd graph; an entry goes with its alias."""

    def __init__(self):
        self.entries = {}

    def alias(self, v):
        """(alias, sink) of source v; (v, None) when no gradient of v is recorded."""
        if not (torch.is_grad_enabled() and v.requires_grad):
            return v, None
        e = self.entries.get(id(v))
        if e is not None and e[0]() is v and e[1]() is not None:
            return e[1](), e[2]
        sink = Sink(v)
        a = Gather.apply(sink, v)
        for key, t in ((id(v), v), (id(a), a)):
            self.entries[key] = (weakref.ref(t), weakref.ref(a, lambda _, k=key: self.entries.pop(k, None)), sink)
        return a, sink


# ---- a group of reads ------------------------------------------------------------------

class Stashed:
    """What a read's backward hands its group: gz (B, T, d) its incoming gradient, c (B, T) =
    gz . z + a . ga (None until the first pass over its sources forms it), a (n, B, T) its
    weights as the forward computed them (the backward reads them, never recomputes them from
    the scores: exp(e - lse) of scores near 100 would lose 1e-5 of each weight to rounding), ga
    (n, B, T) the weights' own gradient or None, z its output, intra its intra sources."""

    __slots__ = ('gz', 'c', 'a', 'ga', 'z', 'intra')

    def __init__(self, gz, c, a, ga, z, intra):
        self.gz, self.c, self.a, self.ga, self.z, self.intra = gz, c, a, ga, z, intra


class Group:
    """The reads k0 .. k0 + P - 1 of a group: their mixers and u = w g (P, d), the base
    (weak references to the sources as given, for matching later reads; the base sources'
    sinks), which reads have run and what intra sources they read, and per backward pass the
    reads' stash and the u gradients so far. Holds no tensor of the graph (the nodes save
    them): the autograd graph holds the group."""

    def __init__(self, ops, sources, sinks, mixers, k0):
        self.ops, self.mixers, self.k0, self.grad = ops, mixers, k0, torch.is_grad_enabled()
        self.refs = [weakref.ref(v) for v in sources]
        self.sinks = sinks
        self.eps = mixers[0].key_norm.eps
        self.planned = set(range(len(mixers)))  # positions of the reads that have not run
        self.readers = {}   # key of an intra source -> positions that read it, in the order they ran
        self.intra_of = {}  # position -> keys of its intra sources
        self.intra_sinks = {}  # key of an intra source -> its sink
        self.stash = {}     # backward pass -> {position: Stashed}
        self.gu = {}        # backward pass -> the u gradients so far (ops.new_gu's buffer)
        self.reached = {}   # backward pass -> positions given a u gradient
        self.formed = {}    # backward pass -> keys of the intra sources whose share is formed
        self.closed = set() # backward passes whose phase 1 has run

    def matches(self, sources, mixer, k):
        """Whether the read (sources, mixer) at k is one this group planned and has not run."""
        p = k - self.k0
        return (p in self.planned and self.mixers[p] is mixer and self.grad == torch.is_grad_enabled()
                and len(sources) >= len(self.refs) and all(r() is v for r, v in zip(self.refs, sources)))

    def unformed(self, t, key):
        """Whether intra source `key`'s share is still to form in pass t (a read of it stashed)."""
        return (t not in self.closed and key not in self.formed.get(t, ())
                and any(q in self.stash.get(t, {}) for q in self.readers[key]))

    def gu_of(self, t, like):
        """Pass t's buffer of u gradients (allocated on first use, like `like`)."""
        if t not in self.gu:
            self.gu[t] = self.ops.new_gu(len(self.mixers), like)
        return self.gu[t]

    def form(self, t, key, v, sink, final=False):
        """Forms intra source v's share of pass t from the group's stashed reads of it: into
        `sink`, or (final: False, or the gradient of v from elsewhere, or None) as v's whole
        gradient with the sink's sum, in v's dtype, which is returned."""
        stash = self.stash[t]
        pos = [q for q in self.readers[key] if q in stash]
        rows = [self.n0 + self.intra_of[q].index(key) for q in pos]  # v's row in each read's weights
        reads = [stash[q] for q in pos]
        gu = self.gu_of(t, v)
        if final is False:  # into the sink: its sum so far plus the share, in place
            buf, held = sink.slot(v)
            out = self.ops.finish(v, buf if held else None, None, rows, self.U, pos, reads, gu, self.eps, into=buf)
            out = None
        else:
            have = sink._open()
            out = self.ops.finish(v, None if have is False else have, final, rows, self.U, pos, reads, gu, self.eps)
        self.reached.setdefault(t, set()).update(pos)
        self.formed.setdefault(t, set()).add(key)
        return out


class Phase1(torch.autograd.Function):
    """Phase 1 of a group. Inputs: (group, w_0..w_{P-1}, g_0..g_{P-1}, base...); outputs
    z1_0..z1_{P-1} (B, T, d), lse1 (P, B, T), e1 (P, n0, B, T) and a_0 = exp(e1_0 - lse1_0):
    a first read without intra sources returns (z1_0, a_0) as its (z, a)."""

    @staticmethod
    def forward(ctx, group, *args):
        P = len(group.mixers)
        ws, gs, base = args[:P], args[P:2 * P], args[2 * P:]
        acc = torch.promote_types(base[0].dtype, torch.float32)
        with no_autocast(base[0]):
            group.U = (torch.stack(ws).to(acc) * torch.stack(gs).to(acc)).detach()  # (P, d): u of every read
            z1, lse1, e1, a0 = group.ops.phase1(base, group.U, group.eps)
        group.n0 = len(base)
        ctx.group, ctx.P = group, P
        ctx.save_for_backward(*ws, *gs, z1[0], a0, group.U, *base)  # U saved too: kept for the backward
        ctx.set_materialize_grads(False)
        return (*z1, lse1, e1, a0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        group, P = ctx.group, ctx.P
        ops = group.ops
        gz, ga = grads[0], grads[-1]  # the first read's, when it returned (z1_0, a_0) itself
        saved = ctx.saved_tensors
        ws, gs, (z0, a0, _), base = saved[:P], saved[P:2 * P], saved[2 * P:2 * P + 3], saved[2 * P + 3:]
        t = task()
        stash = group.stash.setdefault(t, {})
        with no_autocast(z0):
            if gz is not None or ga is not None:
                gz = torch.zeros_like(z0) if gz is None else gz
                stash[0] = Stashed(gz, None if ga is None else ops.rowdot(gz, z0) + (a0 * ga).sum(0), a0, ga, z0, [])
            # intra sources whose gradient autograd has not asked for yet (an order other than
            # the model's): their share now, while the stash is here
            for key in list(group.readers):
                if group.unformed(t, key):
                    q = next(q for q in group.readers[key] if q in stash)
                    group.form(t, key, stash[q].intra[group.intra_of[q].index(key)], group.intra_sinks[key])
            if stash:
                pos = sorted(stash)
                ops.contribute(base, group.sinks, None, group.U, pos, [stash[p] for p in pos], group.gu_of(t, z0),
                               group.eps)
                group.reached.setdefault(t, set()).update(pos)
        group.closed.add(t)
        reached, gu = group.reached.pop(t, set()), group.gu.pop(t, None)
        group.stash.pop(t, None), group.formed.pop(t, None)
        if not reached:
            return (None,) * (1 + 2 * P + len(base))
        gu = ops.total_gu(gu)  # (P, d)
        gw = (gu * torch.stack(gs).to(gu.dtype)).to(ws[0].dtype)  # u = w g
        gg = (gu * torch.stack(ws).to(gu.dtype)).to(gs[0].dtype)
        return (None, *[gw[p] if p in reached else None for p in range(P)],
                *[gg[p] if p in reached else None for p in range(P)]) + (None,) * len(base)


class Phase2(torch.autograd.Function):
    """Phase 2 of read p of a group: inputs (group, p, z1_p, lse1, e1, intra...) -> (z, a)."""

    @staticmethod
    def forward(ctx, group, p, z1, lse1, e1, *intra):
        with no_autocast(z1):
            z, a, _ = group.ops.phase2(z1, lse1[p], e1[p], intra, group.U[p], group.eps)
        ctx.group, ctx.p = group, p
        ctx.save_for_backward(z, a, *intra)
        ctx.set_materialize_grads(False)
        return z, a

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gz, ga):
        group, p = ctx.group, ctx.p
        z, a, *intra = ctx.saved_tensors
        t = task()
        if t in group.closed or any(key in group.formed.get(t, ()) for key in group.intra_of[p]):
            raise RuntimeError("grouped depth read: a read ran backward after its group's gradients were formed "
                               "(an order the grouped read cannot see); run with --fast=False")
        with no_autocast(z):
            gz = torch.zeros_like(z) if gz is None else gz
            # c = gz . z (+ a . ga) is formed by the first pass over the read's sources that needs it
            c = None if ga is None else group.ops.rowdot(gz, z) + (a * ga).sum(0)
            group.stash.setdefault(t, {})[p] = Stashed(gz, c, a, ga, z, intra)
        return (None,) * (5 + len(intra))


class SumPhase2(torch.autograd.Function):
    """P' = f (cast to `dtype`) or P + f, then phase 2 of read p with P' its one intra source:
    inputs (group, p, dtype, z1_p, lse1, e1, f[, P]) -> (z, a, P'). Backward, with gP' the
    gradient P' gets downstream: P's gradient (gP' + this read's share of P') and f's (the same,
    in f's dtype), from one pass."""

    @staticmethod
    def forward(ctx, group, p, dtype, z1, lse1, e1, f, *prev):
        with no_autocast(z1):
            z, a, P = group.ops.sum_phase2(z1, lse1[p], e1[p], f, prev[0] if prev else None, dtype, group.U[p],
                                           group.eps)
        ctx.group, ctx.p, ctx.prev, ctx.f_dtype = group, p, bool(prev), f.dtype
        ctx.save_for_backward(z, a, P)
        ctx.set_materialize_grads(False)
        return z, a, P

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gz, ga, gP):
        group, p = ctx.group, ctx.p
        z, a, P = ctx.saved_tensors
        t = task()
        if t in group.closed:
            raise RuntimeError("grouped depth read: a read ran backward after its group's gradients were formed "
                               "(an order the grouped read cannot see); run with --fast=False")
        if gz is None and ga is None:  # the read's output reached no loss: the sum alone
            return (None,) * 6 + (None if gP is None else gP.to(ctx.f_dtype),) + ((gP,) if ctx.prev else ())
        with no_autocast(z):
            gz = torch.zeros_like(z) if gz is None else gz
            c = None if ga is None else group.ops.rowdot(gz, z) + (a * ga).sum(0)
            read = group.stash.setdefault(t, {})[p] = Stashed(gz, c, a, ga, z, [P])
            g, g_f = group.ops.finish(P, None, gP, [group.n0], group.U, [p], [read], group.gu_of(t, z), group.eps,
                                      cast=ctx.f_dtype)
            group.reached.setdefault(t, set()).add(p)
        return (None,) * 6 + (g_f,) + ((g,) if ctx.prev else ())


# ---- the read --------------------------------------------------------------------------

_STATE = weakref.WeakKeyDictionary()  # scheme -> {'bank': Bank, 'open': (group, phase 1's outputs) or None}


def read_order(res):
    """The mixers of reads 1 .. 2L in the model's order: read 2b+1 is block b's MLP input
    (mlp_mix), read 2b+2 its output (out_mix; the last one is the final aggregator)."""
    return [m for p in res.layers for m in (p.mlp_mix, p.out_mix)]


def plan(res, mixer, k):
    """The mixers of the group that starts with read k: the reads k, k+1, ... of the model's
    order, at most G_MAX, with the same key-norm eps; Block AttnRes's groups (blocks of two or
    more sublayers) end before the next block boundary, so that the next starts at one. Just
    [mixer] when the read is not read k of the model's order (a probe's other order)."""
    order = read_order(res)
    if not 1 <= k <= len(order) or order[k - 1] is not mixer:
        return [mixer]
    mixers = [mixer]
    boundary = res.boundary if getattr(res, 'group_size', 1) > 1 else None
    for q in range(k + 1, min(len(order), k + G_MAX - 1) + 1):
        if order[q - 1].key_norm.eps != mixer.key_norm.eps or (boundary is not None and boundary(q)):
            break
        mixers.append(order[q - 1])
    return mixers


def state_of(res):
    return _STATE.setdefault(res, {'bank': Bank(), 'open': None})


@torch.compiler.disable  # Python state between reads: never traced
def grouped_read(res, ops, sources, extra, mixer, k):
    """z, a of read k (mixer) over sources + extra: `sources` the ones later reads also hold
    (they only grow), `extra` the read's own (Block AttnRes's running sum P). The open group and
    phase 1's outputs for its reads that have not run are kept here, never on the group (which
    the autograd graph holds: an output kept there would hold its own graph in a cycle)."""
    state = state_of(res)
    bank, open_ = state['bank'], state['open']
    if open_ is None or not open_[0].matches(sources, mixer, k):
        mixers = plan(res, mixer, k)
        base, sinks = zip(*(bank.alias(v) for v in sources))
        group = Group(ops, sources, sinks, mixers, k)
        P = len(mixers)
        out = Phase1.apply(group, *[m.query for m in mixers], *[m.key_norm.weight for m in mixers], *base)
        open_ = state['open'] = (group, dict(enumerate(out[:P])), out[P], out[P + 1], out[P + 2])
    group, pending, lse1, e1, a0 = open_
    p = k - group.k0
    z1 = pending.pop(p)
    group.planned.discard(p)
    if not pending:
        state['open'] = None  # every planned read ran
    intra_raw = tuple(sources[len(group.refs):]) + tuple(extra)
    if p == 0 and not intra_raw:
        return z1, a0
    intra = []
    for v in intra_raw:
        a, sink = bank.alias(v)
        intra.append(a)
        key = id(a)
        if key not in group.readers and sink is not None:
            sink.groups.append((group, key))
            group.intra_sinks[key] = sink
        group.readers.setdefault(key, []).append(p)
    group.intra_of[p] = [id(a) for a in intra]
    return Phase2.apply(group, p, z1, lse1, e1, *intra)


def read(ops):
    """AttnRes.read(sources, mixer) -> (z, a) on grouped reads with `ops`."""
    @torch.compiler.disable
    def grouped(self, sources, mixer):
        return grouped_read(self, ops, sources, (), mixer, len(sources) - 1)
    return grouped


@torch.compiler.disable  # Python state between reads: never traced
def grouped_read_at(self, ops, sources, partial, k, mixer, b, j):
    """BlockAttnRes.read_at's steps with the read grouped, and the running sum P handed back as
    the view its reads read (`Bank`), so that the gradient it gets from the next sum arrives
    where its reads' share is formed, in one pass."""
    boundary = self.boundary(k)
    if boundary and partial is not None:
        sources, partial = sources + (partial,), None
    current = -1 if partial is None else len(sources)
    if partial is not None:
        partial, _ = state_of(self)['bank'].alias(partial)
    z, a = grouped_read(self, ops, sources, () if partial is None else (partial,), mixer, k)
    if self.tape is not None:
        self.record(b, j, weights=a, current=torch.tensor(current))
    return sources, partial, z, boundary


def read_at(ops):
    """BlockAttnRes.read_at(sources, partial, k, mixer, b, j) on grouped reads with `ops`."""
    @torch.compiler.disable
    def grouped(self, sources, partial, k, mixer, b, j):
        return grouped_read_at(self, ops, sources, partial, k, mixer, b, j)
    return grouped


@torch.compiler.disable  # Python state between reads: never traced
def sum_read(self, ops, sources, partial, f, k, mixer, b, j):
    """BlockAttnRes.block's two steps after a sublayer, P <- f (cast to the sources' dtype) or
    P + f, then read_at(k): in one pass (`SumPhase2`) where the read is one its group planned and
    P is its only intra source (no boundary at k); else as two. -> (sources, partial, z)."""
    dtype = sources[0].dtype
    open_ = state_of(self)['open']
    if self.boundary(k) or open_ is None or not open_[0].matches(sources, mixer, k) \
            or len(sources) != len(open_[0].refs):
        partial = f.to(dtype) if partial is None else partial + f
        return grouped_read_at(self, ops, sources, partial, k, mixer, b, j)[:3]
    group, pending, lse1, e1, _ = open_
    p = k - group.k0
    z1 = pending.pop(p)
    group.planned.discard(p)
    if not pending:
        state_of(self)['open'] = None
    group.intra_of[p] = []
    prev = () if partial is None else (partial,)
    z, a, partial = SumPhase2.apply(group, p, dtype, z1, lse1, e1, f, *prev)
    if self.tape is not None:
        self.record(b, j, weights=a, current=torch.tensor(len(sources)))
    return sources, partial, z


def block(ops):
    """BlockAttnRes.block with its running sum and the read after it fused (`sum_read`), the
    reads grouped; everything else as the plain method. Not traced by torch.compile itself (the
    branches it calls stay compiled)."""
    def fused(self, state, b, layer, rope):
        sources, partial, k, mix, _ = state
        p = self.layers[b]
        f = layer.attn(self.attn_input(p, mix, len(sources) == 1 and partial is None), rope)
        sources, partial, z = sum_read(self, ops, sources, partial, f, k + 1, p.mlp_mix, b, 1)
        f = layer.mlp(p.mlp_norm(z))
        sources, partial, mix = sum_read(self, ops, sources, partial, f, k + 2, p.out_mix, b + 1, 0)
        return BlockState(sources, partial, k + 2, mix, self.boundary(k + 2))
    return torch.compiler.disable(fused, recursive=False)


# ---- the steps, in torch -----------------------------------------------------------------

def _rstd(v, eps):
    return torch.rsqrt(v.square().mean(-1) + eps)  # (B, T), 1/rms


def _consecutive(pos):
    """Whether positions `pos` (sorted) are consecutive: rows of U and of the u gradients as a slice."""
    return pos == list(range(pos[0], pos[0] + len(pos)))


class TorchOps:
    """The steps in torch ops, on any device; math in the dtype of U (fp32, or fp64)."""

    @staticmethod
    def phase1(base, U, eps):
        """base n0 x (B, T, d), U (P, d), eps -> z1 P x (B, T, d), lse1 (P, B, T), e1 (P, n0, B, T), a0 (n0, B, T)."""
        acc = U.dtype
        e = torch.stack([(v.to(acc) @ U.t()) * _rstd(v.to(acc), eps).unsqueeze(-1) for v in base])  # (n0, B, T, P)
        e = e.movedim(-1, 0)                                                                    # (P, n0, B, T)
        lse1 = torch.logsumexp(e, dim=1)                                                        # (P, B, T)
        w = torch.exp(e - lse1.unsqueeze(1))
        z1 = [torch.zeros(base[0].shape, dtype=acc, device=U.device) for _ in range(U.size(0))]
        for i, v in enumerate(base):
            for p, z in enumerate(z1):
                z.addcmul_(w[p, i].unsqueeze(-1), v)
        return z1, lse1, e, w[0]

    @staticmethod
    def phase2(z1, lse1, e1, intra, u, eps):
        """z1 (B, T, d), lse1 (B, T), e1 (n0, B, T) of the base, intra m x (B, T, d), u (d,)
        -> z (B, T, d), a (n0 + m, B, T), lse (B, T)."""
        acc = z1.dtype
        e = torch.stack([(v.to(acc) @ u) * _rstd(v.to(acc), eps) for v in intra])              # (m, B, T)
        lse = torch.logaddexp(lse1, torch.logsumexp(e, dim=0))
        z = torch.exp(lse1 - lse).unsqueeze(-1) * z1
        for v, ei in zip(intra, e):
            z.addcmul_(torch.exp(ei - lse).unsqueeze(-1), v)
        return z, torch.exp(torch.cat([e1, e]) - lse), lse

    @staticmethod
    def sum_phase2(z1, lse1, e1, f, prev, dtype, u, eps):
        """P' = f.to(dtype) (prev None) or prev + f, then phase2 with P' the one intra source:
        -> z, a, P'."""
        P = f.to(dtype) if prev is None else prev + f
        z, a, _ = TorchOps.phase2(z1, lse1, e1, (P,), u, eps)
        return z, a, P

    @staticmethod
    def rowdot(x, y):
        return torch.linalg.vecdot(x, y)  # (B, T)

    @staticmethod
    def new_gu(P, like):
        """A zero buffer of the u gradients of P reads."""
        return torch.zeros(P, like.size(-1), dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)

    @staticmethod
    def total_gu(gu):
        return gu

    @staticmethod
    def contribute(sources, sinks, rows, U, pos, reads, gu, eps):
        """Adds to each source's sink (None: not needed) its gradient from the R stashed reads
        `reads` (Stashed, at group positions `pos`) of it, and to gu (the group's u gradients:
        new_gu's, or TritonOps's) theirs. U (P, d) the group's u; rows: source i's row in each
        read's weights (None: row i in all, the base). Forms a read's c where it has none."""
        acc, d = U.dtype, U.size(-1)
        for r in reads:
            if r.c is None:
                r.c = TorchOps.rowdot(r.gz, r.z)
        Ur = U[pos]                                                                             # (R, d)
        gz = torch.stack([r.gz for r in reads], -2)                                             # (B, T, R, d)
        c = torch.stack([r.c for r in reads], -1)                                               # (B, T, R)
        part = torch.zeros_like(Ur)
        for i, (v, sink) in enumerate(zip(sources, sinks)):
            rs = [i] * len(reads) if rows is None else rows[i]
            v = v.to(acc)
            s = _rstd(v, eps).unsqueeze(-1)                                                     # (B, T, 1)
            e = (v @ Ur.t()) * s                                                                # (B, T, R)
            a = torch.stack([r.a[row] for r, row in zip(reads, rs)], -1).to(acc)               # the forward's weights
            p = torch.einsum('btrd,btd->btr', gz, v)
            for j, (r, row) in enumerate(zip(reads, rs)):
                if r.ga is not None:
                    p[..., j] += r.ga[row].to(acc)
            ge = a * (p - c)
            part += torch.einsum('btr,btd->rd', ge * s, v)
            if sink is not None:
                sink.add(torch.einsum('btr,btrd->btd', a, gz) + (ge * s) @ Ur
                         - (s.square() * (ge * e).sum(-1, keepdim=True) / d) * v)
        (gu if gu.dim() == 2 else gu[0]).index_add_(0, torch.tensor(pos, device=gu.device), part.to(gu.dtype))

    @staticmethod
    def finish(v, buf, g, rows, U, pos, reads, gu, eps, into=None, cast=None):
        """v's whole gradient in its dtype: its share from the R reads (as `contribute`, v at
        row rows[r] of read r's weights) plus buf (its sum so far, or None) and g (its gradient
        from elsewhere, or None); the reads' u gradients go to gu. into: an fp32 buffer to
        write the sum to instead (buf itself, or a new one), which is returned. cast: a dtype,
        the sum also in it: -> (sum, sum in cast)."""
        share = _Share()
        TorchOps.contribute((v,), (share,), [rows], U, pos, reads, gu, eps)
        out = share.g if buf is None else share.g + buf
        out = out if g is None else out + g
        out = out.to(v.dtype) if into is None else into.copy_(out)
        return out if cast is None else (out, out.to(cast))


class _Share:
    """A stand-in sink that keeps the one share added to it."""

    def add(self, g):
        self.g = g


# ---- the steps as Triton kernels (fast/depth_kernels.py) ---------------------------------

def _next_pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def _split(sources):
    """(fp32 sources, low-precision sources, their dtype) when the sources are fp32 ones followed
    by ones of a single 16-bit dtype (the embedding, then bf16 sublayer outputs), else None."""
    n32 = 0
    while n32 < len(sources) and sources[n32].dtype == torch.float32:
        n32 += 1
    low = sources[n32:]
    if any(v.dtype != low[0].dtype or v.dtype not in (torch.bfloat16, torch.float16) for v in low):
        return None
    return sources[:n32], low, (low[0].dtype if low else torch.bfloat16)


def _padded(ts, dtype, device):
    """ts (flattened to (N, d)) padded with 1-element tensors to a power-of-2 length (fewer
    compiled variants: the kernels loop over the first n at run time)."""
    flat = [t.reshape(-1, t.size(-1)) if t.dim() > 1 else t for t in ts]
    pad = _next_pow2(len(flat)) - len(flat)
    return tuple(flat) + tuple(torch.empty(1, dtype=dtype, device=device) for _ in range(pad))


def _bd(d):
    return _next_pow2(d)


class TritonOps:
    """The steps as launches of fast/depth_kernels.py (fp32 math; CUDA or Triton's interpreter).
    Sources that are not fp32 ones followed by one 16-bit dtype, fp64, a read's weight gradient
    (ga: a loss on the weights themselves) or a share formed out of the model's order take
    TorchOps' code instead (on the same device)."""

    GU_PROGRAMS = 264  # programs of the backward kernels (2 per SM of an H100): each sums the u gradients
    MAX_SOURCES = 62   # sources per backward launch (flags in int64 masks)

    @staticmethod
    def phase1(base, U, eps):
        split = _split(base)
        if U.dtype != torch.float32 or split is None:
            return TorchOps.phase1(base, U, eps)
        a32, low, ldt = split
        shape, dev = base[0].shape, U.device
        (P, d), n0 = U.shape, len(base)
        N = base[0].numel() // d
        z1 = tuple(torch.empty(shape, dtype=torch.float32, device=dev) for _ in range(P))
        lse1 = torch.empty(P, *shape[:-1], dtype=torch.float32, device=dev)
        e1 = torch.empty(P, n0, *shape[:-1], dtype=torch.float32, device=dev)
        a0 = torch.empty(n0, *shape[:-1], dtype=torch.float32, device=dev)
        launch('fast.depth_kernels', 'phase1_fwd', (N,), reads=('src32', 'src16', 'U'),
               writes=('z1', 'lse1', 'e1', 'a0'), flops=4 * n0 * N * d * P, num_warps=8, maxnreg=255,
               src32=_padded(a32, torch.float32, dev), src16=_padded(low, ldt, dev), n32=len(a32), n16=len(low),
               U=U, z1=tuple(z.view(N, d) for z in z1), lse1=lse1, e1=e1, a0=a0, N=N, D=d, eps=eps,
               P=P, BD=_bd(d))
        return list(z1), lse1, e1, a0

    @staticmethod
    def phase2(z1, lse1, e1, intra, u, eps):
        split = _split(intra)
        if z1.dtype != torch.float32 or split is None:
            return TorchOps.phase2(z1, lse1, e1, intra, u, eps)
        a32, low, ldt = split
        dev, d = z1.device, z1.size(-1)
        N, n0, m = z1.numel() // d, e1.size(0), len(intra)
        z = torch.empty_like(z1)
        a = torch.empty(n0 + m, *z1.shape[:-1], dtype=torch.float32, device=dev)
        lse = torch.empty_like(lse1)
        launch('fast.depth_kernels', 'phase2_fwd', (N,), reads=('z1', 'lse1', 'e1', 'src32', 'src16', 'u'),
               writes=('z', 'a', 'lse'), flops=4 * m * N * d, num_warps=4,
               z1=z1.view(N, d), lse1=lse1, e1=e1, src32=_padded(a32, torch.float32, dev),
               src16=_padded(low, ldt, dev), n32=len(a32), n16=len(low), u=u, z=z.view(N, d), a=a, lse=lse,
               N=N, n0=n0, D=d, eps=eps, BD=_bd(d))
        return z, a, lse

    @staticmethod
    def sum_phase2(z1, lse1, e1, f, prev, dtype, u, eps):
        if z1.dtype != torch.float32 or dtype != torch.float32 or f.dtype not in (torch.float32, torch.bfloat16,
                                                                                   torch.float16):
            return TorchOps.sum_phase2(z1, lse1, e1, f, prev, dtype, u, eps)
        dev, d = z1.device, z1.size(-1)
        N, n0 = z1.numel() // d, e1.size(0)
        z, P = torch.empty_like(z1), torch.empty_like(z1)
        a = torch.empty(n0 + 1, *z1.shape[:-1], dtype=torch.float32, device=dev)
        dummy = torch.empty(1, dtype=torch.float32, device=dev)
        launch('fast.depth_kernels', 'sum_phase2_fwd', (N,), reads=('z1', 'lse1', 'e1', 'f', 'prev', 'u'),
               writes=('z', 'a', 'P'), flops=4 * N * d, num_warps=4,
               z1=z1.view(N, d), lse1=lse1, e1=e1, f=f.reshape(N, d), prev=dummy if prev is None else prev.view(N, d),
               u=u, z=z.view(N, d), a=a, P=P.view(N, d), N=N, n0=n0, D=d, eps=eps, HAS_PREV=prev is not None,
               BD=_bd(d))
        return z, a, P

    @staticmethod
    def rowdot(x, y):
        return torch.linalg.vecdot(x, y)

    @staticmethod
    def new_gu(P, like):
        """The u gradients of P reads, one row block per backward program: (programs, P, d) zeros."""
        N = like.numel() // like.size(-1)
        return torch.zeros(min(N, TritonOps.GU_PROGRAMS), P, like.size(-1), dtype=torch.float32, device=like.device)

    @staticmethod
    def total_gu(gu):
        return gu.sum(0)

    @staticmethod
    def _torch(U, reads):
        return U.dtype != torch.float32 or any(r.ga is not None for r in reads)

    @staticmethod
    def _c(reads, dev):
        """(c (R, N) of the reads, which of them the kernel forms from gz and z)."""
        own = [r.c is None for r in reads]
        c = torch.stack([torch.empty(r.gz.shape[:-1], dtype=torch.float32, device=dev) if o else r.c
                         for r, o in zip(reads, own)])
        return c.view(len(reads), -1), own

    @staticmethod
    def contribute(sources, sinks, rows, U, pos, reads, gu, eps):
        split = _split(sources)
        if rows is not None or split is None or not _consecutive(pos) or TritonOps._torch(U, reads):
            return TorchOps.contribute(sources, sinks, rows, U, pos, reads, gu, eps)
        if len(sources) > TritonOps.MAX_SOURCES:  # the kernel's per-source flags are two int64 masks
            m = TritonOps.MAX_SOURCES
            for i in range(0, len(sources), m):
                chunk = [_rows_from(r, i) for r in reads]
                TritonOps.contribute(sources[i:i + m], sinks[i:i + m], None, U, pos, chunk, gu, eps)
                for r, rc in zip(reads, chunk):
                    r.c = rc.c  # formed by the first chunk
            return
        a32, low, ldt = split
        dev, d, R = U.device, U.size(-1), len(reads)
        N = sources[0].numel() // d
        c, own = TritonOps._c(reads, dev)
        slots = [(None, False) if s is None else s.slot(v) for v, s in zip(sources, sinks)]
        bufs = tuple(b.view(N, d) if b is not None else torch.empty(1, dtype=torch.float32, device=dev)
                     for b, _ in slots)
        dummy = torch.empty(1, dtype=torch.float32, device=dev)
        launch('fast.depth_kernels', 'contribute_bwd', (gu.size(0),),
               reads=('src32', 'src16', 'U', 'gz', 'aw', 'c', 'zs'), writes=('bufs', 'gu'),
               also_read=[b for b, held in slots if held] + [gu], flops=8 * len(sources) * N * d * R,
               num_warps=TritonOps.warps(R), maxnreg=255,
               src32=_padded(a32, torch.float32, dev), src16=_padded(low, ldt, dev), n32=len(a32), n16=len(low),
               U=U, gz=tuple(r.gz.reshape(N, d) for r in reads), aw=tuple(r.a.reshape(-1, N) for r in reads),
               c=c, zs=tuple(r.z.reshape(N, d) if o else dummy for r, o in zip(reads, own)),
               c_mask=sum(1 << i for i, o in enumerate(own) if o), bufs=_pad_tuple(bufs, dev),
               write_mask=sum(1 << i for i, (b, _) in enumerate(slots) if b is not None),
               add_mask=sum(1 << i for i, (_, held) in enumerate(slots) if held),
               gu=gu, row0=pos[0], P=gu.size(1), N=N, D=d, eps=eps, R=R, BD=_bd(d))
        for r, o, ci in zip(reads, own, c):
            if o:
                r.c = ci.view(r.gz.shape[:-1])  # the c the kernel formed

    @staticmethod
    def finish(v, buf, g, rows, U, pos, reads, gu, eps, into=None, cast=None):
        low = (torch.float32, torch.bfloat16, torch.float16)
        if v.dtype not in low or (cast is not None and cast not in low) or not _consecutive(pos) \
                or TritonOps._torch(U, reads):
            return TorchOps.finish(v, buf, g, rows, U, pos, reads, gu, eps, into, cast)
        dev, d, R = U.device, U.size(-1), len(reads)
        N = v.numel() // d
        c, own = TritonOps._c(reads, dev)
        dummy = torch.empty(1, dtype=torch.float32, device=dev)
        out = torch.empty_like(v) if into is None else into  # into: in place of buf, each element read, then written
        out2 = dummy if cast is None else torch.empty(v.shape, dtype=cast, device=dev)
        launch('fast.depth_kernels', 'finish_bwd', (gu.size(0),), reads=('v', 'U', 'gz', 'aw', 'c', 'zs', 'buf', 'g'),
               writes=('out', 'out2', 'gu'), also_read=[gu], flops=8 * N * d * R, num_warps=TritonOps.warps(R),
               maxnreg=255,
               v=v.reshape(N, d), U=U, gz=tuple(r.gz.reshape(N, d) for r in reads),
               aw=tuple(r.a.reshape(-1, N) for r in reads), arow=tuple(rows), c=c,
               zs=tuple(r.z.reshape(N, d) if o else dummy for r, o in zip(reads, own)),
               c_mask=sum(1 << i for i, o in enumerate(own) if o), buf=dummy if buf is None else buf.view(N, d),
               g=dummy if g is None else g.reshape(N, d), out=out.view(N, d), out2=out2.view(-1, d) if cast else out2,
               gu=gu, row0=pos[0], P=gu.size(1), N=N, D=d, eps=eps, R=R, HAS_BUF=buf is not None,
               HAS_G=g is not None, HAS_OUT2=cast is not None, BD=_bd(d))
        for r, o, ci in zip(reads, own, c):
            if o:
                r.c = ci.view(r.gz.shape[:-1])
        return out if cast is None else (out, out2)

    @staticmethod
    def warps(R):
        """Warps of a backward program: its [R, BD] blocks (gz, U, the u gradients) in registers."""
        return 4 if R <= 2 else 8


def _rows_from(r, i):
    """Stashed read r with its weights from row i on (a later chunk of base sources)."""
    return Stashed(r.gz, r.c, r.a[i:], r.ga, r.z, r.intra)


def _pad_tuple(ts, dev):
    pad = _next_pow2(len(ts)) - len(ts)
    return tuple(ts) + tuple(torch.empty(1, dtype=torch.float32, device=dev) for _ in range(pad))
