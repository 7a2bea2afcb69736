"""
The residual schemes of DepthBench (DESIGN §4, schemes.md): one class each, one
registry `RESIDUALS` (name -> class) that `GPTConfig.residual` selects from.

A scheme owns the wiring between the 2L branches of the backbone (model.py holds the
branches without norms): its norms, its extra parameters, its state (one residual
stream, m streams, or the history of sources), and its readout before the final norm.

The interface every scheme implements (`Residual`):

    state = begin(x)                     x: token embedding (B, T, d)
    state = block(state, b, layer, rope) run block b: layer.attn(x, rope), layer.mlp(x)
    state = skip(state, b)               the study's "skip block b" rule (probes.md §2)
    h     = end(state)                   (B, T, d), goes into the final RMSNorm + LM head
    probe(state), lens(state)            the depth state z_l and the LogitLens readout r_l
                                         after the blocks run so far (probes.md §0, §5)

Parameters of block b live in `self.layers[b]` (and are looked up by b, never by the
position in the order), so when a diagnostic swaps two blocks, each block's weights,
norms and routing parameters travel with it (probes.md §3).

States are never modified in place: a diagnostic may keep the state after a shared
prefix of blocks and continue it several times (probe.py).

Per-sublayer coefficients (HC/mHC read/mix/write weights, AttnRes depth-softmax
weights) are recorded while a `trace()` is active:

    with model.residual.trace() as tape:
        model(idx)
    tape  # list of dicts, one per sublayer: {'block': b, 'sublayer': 0|1, ...tensors}
"""

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import RMSNorm, apply_rope


class Residual(nn.Module):
    """Base class of the schemes. Subclasses implement begin/block/end and may override
    skip/probe/lens. The default state is one residual stream h (B, T, d)."""

    peak_lr = 2e-3  # the study's peak learning rate for this scheme (DESIGN §6)

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tape = None  # list while trace() is active, else None

    def init_weights(self, model):
        """(Re)initialises every parameter of the scheme; may rescale the backbone's
        weights (`model.blocks`). Called last by GPT.init_weights. Default: every norm gain
        of the scheme is 1."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.reset_parameters()

    def no_weight_decay(self):
        """Names (relative to this module) of matrix-shaped parameters that must not be
        weight-decayed. Vectors and scalars are never decayed."""
        return set()

    def begin(self, x):
        return x

    def block(self, state, b, layer, rope):
        raise NotImplementedError

    def skip(self, state, b):
        """Skip block b: by default the block is the identity (its output equals its input)."""
        return state

    def end(self, state):
        return state

    def probe(self, state):
        return state

    def lens(self, state):
        return state

    @contextlib.contextmanager
    def trace(self):
        """Records per-sublayer coefficients (detached) into a list while active."""
        self.tape = []
        try:
            yield self.tape
        finally:
            self.tape = None

    def record(self, b, j, **tensors):
        if self.tape is not None:
            self.tape.append({'block': b, 'sublayer': j, **{k: v.detach() for k, v in tensors.items()}})


class PreNormLayer(nn.Module):
    """The pre-norms of one block: attn_norm and mlp_norm (RMSNorm, gain 1)."""

    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)


class SingleStream(Residual):
    """A scheme with one residual stream h (B, T, d) whose two sublayers differ only in
    the update rule `sublayer(h, b, j, f)`, j = 0 for attention, 1 for the MLP, f the
    branch function. probe = lens = h (probes.md §0, residual family)."""

    def sublayer(self, h, b, j, f):
        raise NotImplementedError

    def block(self, h, b, layer, rope):
        h = self.sublayer(h, b, 0, lambda x: layer.attn(x, rope))
        return self.sublayer(h, b, 1, layer.mlp)


# -----------------------------------------------------------------------------
# Pre-LN

class PreLN(SingleStream):
    """Pre-LN (Xiong et al. 2020, arXiv 2002.04745), the baseline of DESIGN §4:

        h <- h + F(RMSNorm(h))

    for every sublayer. No parameters beyond one RMSNorm gain per sublayer."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = nn.ModuleList([PreNormLayer(cfg) for _ in range(cfg.n_layer)])

    def sublayer(self, h, b, j, f):
        norm = (self.layers[b].attn_norm, self.layers[b].mlp_norm)[j]
        return h + f(norm(h))


# -----------------------------------------------------------------------------
# Attention Residuals

def inv_rms(v, eps):
    """1 / sqrt(mean(v^2) + eps) over the last dim, in fp32: v (B, T, d) -> (B, T, 1)."""
    return torch.rsqrt(v.float().pow(2).mean(-1, keepdim=True) + eps)


def _promoted_dtype(tensors):
    """The dtype of a sum of `tensors` under type promotion (fp32 when an fp32 embedding
    is mixed with bf16 sublayer outputs)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class DepthMixFunction(torch.autograd.Function):
    """The AttnRes read of `depth_mix` with a hand-written backward (arXiv 2603.15031;
    schemes.md "Full AttnRes", cost notes). Call as

        z, a = DepthMixFunction.apply(query, key_gain, *sources, *inv_rmses)

    Why: autograd on the plain formula (`depth_mix_reference`) saves a stacked copy of
    all n sources at every read, O(n B T d) bytes per read and O(L^2 B T d) per forward
    pass, which ran out of memory in public ports. This saves only the n dot products
    r (n, B, T) per token and references to the sources and their 1/rms (alive anyway:
    they are earlier sublayers' outputs, kept in the AttnRes state); backward recomputes
    the softmax weights a from them, a cheap (n, B, T) op. Every sum over sources is a
    loop over the n tensors, never an (n, B, T, d) stack: on the CPU that is also the
    fastest form (tiny batched matmuls are slow there), and torch.compile fuses the loops
    of a read into a few kernels (whole-model compile: one graph, the varying n of the
    reads is unrolled, no recompiles).

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
        dtype = _promoted_dtype(sources)
        acc = torch.promote_types(dtype, torch.float32)                         # fp32 (fp64 in gradcheck)
        u = query.to(acc) * key_gain.to(acc)                                    # (d,)
        r = torch.stack([v.to(acc) @ u for v in sources])                       # (n, B, T)
        s = torch.cat(inv_rmses, dim=-1).to(acc).movedim(-1, 0)                 # (n, B, T)
        a = torch.softmax(r * s, dim=0)                                         # (n, B, T)
        z = torch.zeros(sources[0].shape, dtype=acc, device=sources[0].device)  # (B, T, d)
        for i, v in enumerate(sources):  # in place: one buffer, not n fresh (B, T, d) allocations
            z.addcmul_(a[i].unsqueeze(-1), v)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(query, key_gain, r, *sources, *inv_rmses)
        return z.to(dtype), a

    @staticmethod
    @torch.autograd.function.once_differentiable  # r is saved, not recomputed: no double backward
    def backward(ctx, gz, ga):
        query, key_gain, r, *tensors = ctx.saved_tensors
        n = len(tensors) // 2
        sources, inv_rmses = tensors[:n], tensors[n:]
        need_w, need_g = ctx.needs_input_grad[:2]
        need_v, need_s = ctx.needs_input_grad[2:2 + n], ctx.needs_input_grad[2 + n:]
        acc = r.dtype
        u = query.to(acc) * key_gain.to(acc)                                    # (d,)
        s = torch.cat(inv_rmses, dim=-1).to(acc).movedim(-1, 0)                 # (n, B, T)
        a = torch.softmax(r * s, dim=0)                                         # (n, B, T), as in forward
        gz = torch.zeros(sources[0].shape, dtype=acc, device=r.device) if gz is None else gz.to(acc)
        p = torch.stack([torch.linalg.vecdot(v.to(acc), gz) for v in sources])  # (n, B, T)
        if ga is not None:
            p = p + ga
        ge = a * (p - (a * p).sum(0, keepdim=True))                             # (n, B, T)
        c = ge * s                                                              # (n, B, T), reaches r
        gv = [(a[i].unsqueeze(-1) * gz).addcmul_(c[i].unsqueeze(-1), u).to(v.dtype) if need_v[i] else None
              for i, v in enumerate(sources)]                                   # n x (B, T, d)
        gs = [(ge[i] * r[i]).unsqueeze(-1).to(inv_rmses[i].dtype) if need_s[i] else None
              for i in range(n)]                                                # n x (B, T, 1)
        gw = gg = None
        if need_w or need_g:
            d = u.numel()
            gu = sum(v.reshape(-1, d).to(acc).t() @ c[i].reshape(-1) for i, v in enumerate(sources))  # (d,)
            gw = (gu * key_gain.to(acc)).to(query.dtype) if need_w else None
            gg = (gu * query.to(acc)).to(key_gain.dtype) if need_g else None
        return (gw, gg, *gv, *gs)


def depth_mix_reference(sources, inv_rmses, query, key_gain):
    """`depth_mix` written as the plain formula, left to autograd: stacks the sources,
    (n, B, T, d), and autograd keeps that stack for backward at every read. The reference
    that tests check DepthMixFunction against; same arguments and returns as depth_mix."""
    V = torch.stack(sources)                                   # (n, B, T, d)
    acc = torch.promote_types(V.dtype, torch.float32)
    s = torch.stack(inv_rmses).squeeze(-1).to(acc)             # (n, B, T)
    logits = (V @ (query * key_gain).to(V.dtype)).to(acc) * s  # (n, B, T)
    a = torch.softmax(logits, dim=0)                           # (n, B, T)
    z = torch.einsum('nbt,nbtd->btd', a.to(V.dtype), V)        # (B, T, d)
    return z, a


def depth_mix(sources, inv_rmses, query, key_gain):
    """Depth attention of AttnRes (arXiv 2603.15031; DESIGN §4):

        e_i = w^T RMSNorm_key(v_i) = (v_i . (w * g)) / rms(v_i),   a = softmax_i(e),   z = sum_i a_i v_i

    sources: n >= 1 tensors v_i (B, T, d); inv_rmses: their 1/rms (B, T, 1), computed once
    per source; query w and key-norm gain g: (d,). No 1/sqrt(d), temperature 1; logits,
    softmax and the sum in fp32. Scoring with v . (w * g) never materialises the
    normalised keys, and the backward (DepthMixFunction) keeps no stacked copy of the
    sources: saved memory per read is n fp32 numbers per token, not n copies of (B, T, d).
    Gradients flow into the sources, their 1/rms, w and g.
    Returns z (B, T, d) in the sources' (promoted) dtype and the weights a (n, B, T) in fp32.
    Raises ValueError if the lists are empty or differ in length."""
    if not sources or len(sources) != len(inv_rmses):
        raise ValueError(f"depth_mix needs at least one source and one 1/rms per source; got "
                         f"{len(sources)} sources and {len(inv_rmses)} 1/rms tensors")
    return DepthMixFunction.apply(query, key_gain, *sources, *inv_rmses)


class DepthMixer(nn.Module):
    """One AttnRes read: a pseudo-query w (d, zero init) and a key-norm gain g (d, init 1)."""

    def __init__(self, cfg):
        super().__init__()
        self.eps = cfg.norm_eps
        self.query = nn.Parameter(torch.zeros(cfg.n_embd))
        self.key_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)

    def forward(self, sources, inv_rmses):
        return depth_mix(sources, inv_rmses, self.query, self.key_norm.weight)


class AttnResLayer(PreNormLayer):
    """Block b of AttnRes: the two pre-norms, the mixer that reads the MLP input, and the
    mixer that reads block b's *output*: the input of block b+1's attention, or, for the
    last block, the final aggregator. (Block 0's attention reads the embedding directly,
    so every read has exactly one owner and a swap moves a block's MLP-side and
    output-side mixers with it, as in probes.md §3.)"""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.mlp_mix = DepthMixer(cfg)
        self.out_mix = DepthMixer(cfg)


class AttnRes(Residual):
    """Full Attention Residuals (arXiv 2603.15031; schemes.md "Full AttnRes").

    Sources v_0 = token embedding, v_{k+1} = raw output of sublayer k. Sublayer k reads

        z_k = sum_{i<=k} a_ki v_i,  a_k = softmax_i(w_k^T RMSNorm_key,k(v_i)),   f_k = F_k(RMSNorm_pre,k(z_k))

    with a zero-initialised pseudo-query w_k (d): at init every read is the mean of its
    sources, whose RMSNorm equals Pre-LN's (up to eps). Block 0's attention reads
    RMSNorm(v_0) and has no depth parameters; a final aggregator mixes all 2L+1 sources
    into the input of the final RMSNorm. Extra parameters: 2d per read, 4Ld in all.

    State: (sources, their 1/rms, mix) where mix is the raw depth mix the next block's
    attention reads: probe and lens state z_l (probes.md §0, §5).
    Skip rule (probes.md §2): a skipped block adds no sources, and the next read is the
    identity on the newest source. Unlike the study's code, skipping block 0 does not put
    the embedding into the bank twice.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = nn.ModuleList([AttnResLayer(cfg) for _ in range(cfg.n_layer)])

    def init_weights(self, model):
        super().init_weights(model)
        for layer in self.layers:  # the zero init that makes every first read a uniform mean
            nn.init.zeros_(layer.mlp_mix.query)
            nn.init.zeros_(layer.out_mix.query)

    def begin(self, x):
        return (x,), (inv_rms(x, self.cfg.norm_eps),), x

    def block(self, state, b, layer, rope):
        sources, inv_rmses, mix = state
        p = self.layers[b]
        f = layer.attn(p.attn_norm(mix), rope)
        sources, inv_rmses = sources + (f,), inv_rmses + (inv_rms(f, self.cfg.norm_eps),)
        z, a = p.mlp_mix(sources, inv_rmses)
        self.record(b, 1, weights=a)
        f = layer.mlp(p.mlp_norm(z))
        sources, inv_rmses = sources + (f,), inv_rmses + (inv_rms(f, self.cfg.norm_eps),)
        mix, a = p.out_mix(sources, inv_rmses)
        self.record(b + 1, 0, weights=a)  # the read of the next block's attention (or the final one)
        return sources, inv_rmses, mix

    def skip(self, state, b):
        sources, inv_rmses, _ = state
        return sources, inv_rmses, sources[-1]

    def end(self, state):
        return state[2]

    def probe(self, state):
        return state[2]

    def lens(self, state):
        return state[2]


# ---- Hyper-Connections -------------------------------------------------------
# HC and mHC: m residual streams, read / mixed / written by per-token coefficients.

def no_autocast(x):
    """Context in which autocast is off on x's device, so that routing math runs in the
    dtype its inputs are given in (the streams' dtype, or fp32 where a scheme casts).
    The 'meta' device (shape-only runs, e.g. cost.flop_check) has no autocast to turn off."""
    if x.device.type == 'meta':
        return contextlib.nullcontext()
    return torch.autocast(device_type=x.device.type, enabled=False)


def sinkhorn(logits, iters):
    """Sinkhorn-Knopp projection of exp(logits) towards a doubly stochastic matrix (mHC,
    arXiv 2512.24880): `iters` rounds of row then column normalisation.

    logits: (..., m, m), any float dtype, finite. Returns P (..., m, m), fp32 (fp64 for fp64
    logits), non-negative, with columns summing to 1 (the last step) and rows approximately:
    Sinkhorn converges at a rate set by the spread of the logits, and 20 rounds reach 1e-3
    for logits within about +-2 of a row/column rescaling, not for arbitrary ones.
    Numerics, autocast off: the first round runs in the log domain (log_softmax over rows,
    softmax over columns), which leaves every row and column sum in [1/m^2, m] whatever the
    logits' range (+-50 included); the other rounds divide by sums that are therefore never
    small, and entries too small for fp32 underflow to 0 harmlessly.
    Under torch.compile the later rounds keep P's row and column scalings instead
    (`sinkhorn_scalings`): the same iterate up to rounding.
    Raises ValueError for non-square logits or iters < 1."""
    if logits.dim() < 2 or logits.size(-1) != logits.size(-2):
        raise ValueError(f"sinkhorn needs square (..., m, m) logits, got shape {tuple(logits.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn needs iters >= 1, got {iters} (mhc_sinkhorn_iters)")
    return sinkhorn_leading(logits.movedim((-2, -1), (0, 1)), iters).movedim((0, 1), (-2, -1))


def sinkhorn_leading(logits, iters):
    """`sinkhorn` on matrices laid out along the two leading dims: (m, m, ...) -> (m, m, ...).
    The row and column sums then add whole vectors of tokens, several times faster on CPU
    than reducing over two trailing dims of size m."""
    with no_autocast(logits):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)).contiguous()  # fp32 (fp64 stays)
        P = torch.softmax(torch.log_softmax(z, dim=1), dim=0)  # round 1 in the log domain
        if iters == 1:
            return P
        if torch.compiler.is_compiling():
            return sinkhorn_scalings(P, iters - 1)
        return SinkhornRounds.apply(P, iters - 1)


def sinkhorn_scalings(P, iters):
    """`iters` rounds of Sinkhorn on P (m, m, ...) > 0 kept as diag(r) P diag(c): per round
    r = 1 / (P c) over rows, then c = 1 / (P^T r) over columns; returns diag(r) P diag(c),
    the numbers `SinkhornRounds` gives, up to rounding. Used under torch.compile, where each
    round is then two small reductions of the one P (fwd + bwd at m = 4, B T = 2048, one
    CPU thread: 1.7 ms against 2.6 ms for the rounds on P); eagerly it is the slower one
    (7.4 ms against 4.1 ms)."""
    c = torch.ones_like(P[0])                                  # (m, ...) column scalings
    for _ in range(iters):
        r = 1 / (P * c.unsqueeze(0)).sum(1)                    # (m, ...) row scalings
        c = 1 / (P * r.unsqueeze(1)).sum(0)
    return P * r.unsqueeze(1) * c.unsqueeze(0)


class SinkhornRounds(torch.autograd.Function):
    """`iters` rounds of P <- P / rowsum(P), P <- P / colsum(P) on P (m, m, ...) > 0, with
    a hand-written backward (per step y = P / s: dP = (dy - sum(dy * y)) / s) that keeps
    the gradient in the (m, m, ...) layout; autograd's would run 4 x iters small ops on
    whatever layout the incoming gradient has."""

    @staticmethod
    def forward(ctx, P, iters):
        steps = []
        for _ in range(iters):
            for dim in (1, 0):                                 # rows, then columns
                s = P.sum(dim, keepdim=True)
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
        return g, None


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


class RoutedLayer(PreNormLayer):
    """Block b of HC/mHC: the two pre-norms and the routing parameters of its attention
    (`attn_route`) and MLP (`mlp_route`) sublayers."""

    def __init__(self, cfg, route):
        super().__init__(cfg)
        self.attn_route = route(cfg)
        self.mlp_route = route(cfg)


class MultiStream(Residual):
    """Base of the m-stream schemes (HC, mHC). State: H (B, T, m, d), m = cfg.hc_streams.

    Per sublayer the subclass computes, per token, a read vector r (m), a mixing matrix
    M (m x m) and a write vector w (m) from the streams, and then

        x = sum_s r[s] H[s],   y = F(RMSNorm(x)),   H'[t] = sum_s M[s, t] H[s] + w[t] y

    (RMSNorm = the sublayer's ordinary pre-norm attn_norm / mlp_norm). Read and mix are one
    batched matmul [r | M]^T H (under torch.compile: the same product written as a broadcast
    multiply summed over the streams, which inductor fuses into one pass). The embedding is
    copied into every stream; the readout is the sum of the streams. probe = the m streams concatenated (B, T, m d), lens = their
    sum (B, T, d) (probes.md §0, §5); skip = identity on all streams, no mixing and no
    write (probes.md §2). Trace per sublayer: read r (B, T, m), mix M (B, T, m, m) with
    new stream t = sum_s M[s, t] H[s], write w (B, T, m).

    The routing runs with autocast off, in the streams' dtype (fp32 under bf16 autocast,
    as Pre-LN's residual stream is); only the branch F runs under autocast.
    """

    def __init__(self, cfg, route):
        super().__init__(cfg)
        if cfg.hc_streams < 1:
            raise ValueError(f"hc_streams must be >= 1, got {cfg.hc_streams}")
        self.m = cfg.hc_streams
        self.layers = nn.ModuleList([RoutedLayer(cfg, route) for _ in range(cfg.n_layer)])

    def routes(self):
        """(k, route) for every sublayer, k = 2b + j the 0-based sublayer index."""
        for b, p in enumerate(self.layers):
            yield 2 * b, p.attn_route
            yield 2 * b + 1, p.mlp_route

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        if self.cfg.hc_out_init_scale:  # the study's config: the m streams each receive the branch output
            for blk in model.blocks:
                blk.attn.wo.weight.div_(math.sqrt(self.m))
                blk.mlp.w_down.weight.div_(math.sqrt(self.m))

    def coefficients(self, H, route):
        """H (B, T, m, d) -> C = [r | M] (B, T, m, m+1) and w (B, T, m)."""
        raise NotImplementedError

    def sublayer(self, H, b, j, route, norm, f):
        C, w = self.coefficients(H, route)                      # (B, T, m, m+1), (B, T, m)
        self.record(b, j, read=C[..., 0], mix=C[..., 1:], write=w)
        with no_autocast(H):
            if torch.compiler.is_compiling():
                # inductor fuses the broadcast product and its sum over s into one pass over H
                # (0.94x the HC step time of the bmm, compiled); eagerly it would build a
                # (B, T, m, m+1, d) temporary
                xm = (C.unsqueeze(-1) * H.to(C.dtype).unsqueeze(-2)).sum(-3)  # (B, T, m+1, d)
            else:
                Ct = C.transpose(-1, -2).contiguous()            # (B, T, m+1, m); contiguous: bmm's fast path
                xm = Ct @ H.to(C.dtype)                          # (B, T, m+1, d)
            x, mixed = xm.split([1, self.m], dim=-2)             # (B, T, 1 | m, d)
        y = f(norm(x.squeeze(-2).to(H.dtype)))                   # (B, T, d)
        return torch.addcmul(mixed, w.unsqueeze(-1), y.unsqueeze(-2)).to(H.dtype)  # (B, T, m, d)

    def begin(self, x):
        return x.unsqueeze(-2).repeat(1, 1, self.m, 1)        # (B, T, m, d), m copies of the embedding

    def block(self, H, b, layer, rope):
        p = self.layers[b]
        H = self.sublayer(H, b, 0, p.attn_route, p.attn_norm, lambda x: layer.attn(x, rope))
        return self.sublayer(H, b, 1, p.mlp_route, p.mlp_norm, layer.mlp)

    def end(self, H):
        return H.sum(-2)                                        # (B, T, d)

    def probe(self, H):
        return H.flatten(-2)                                    # (B, T, m d)

    def lens(self, H):
        return H.sum(-2)                                        # (B, T, d)


class HCRoute(nn.Module):
    """Routing parameters of one HC sublayer: static [A_m | A_r] (m, m+1) and beta (m),
    dynamic projections W (d, m+1) and w_beta (d), scalar scales s_alpha, s_beta."""

    def __init__(self, cfg):
        super().__init__()
        m, d = cfg.hc_streams, cfg.n_embd
        self.static_alpha = nn.Parameter(torch.zeros(m, m + 1))
        self.static_beta = nn.Parameter(torch.ones(m))
        self.dynamic_alpha = nn.Parameter(torch.zeros(d, m + 1))
        self.dynamic_beta = nn.Parameter(torch.zeros(d))
        self.alpha_scale = nn.Parameter(torch.tensor(0.01))
        self.beta_scale = nn.Parameter(torch.tensor(0.01))


class HC(MultiStream):
    """Hyper-Connections (Zhu et al., arXiv 2409.19606, dynamic variant; schemes.md "HC").

    m streams H (B, T, m, d). Sublayer k, with H_bar = RMS(H) per stream (no weight, eps 1e-8):

        [A_m | A_r] = static_alpha + s_alpha * tanh(H_bar W)      (m, m+1) per token
        beta        = static_beta  + s_beta  * tanh(H_bar w_beta) (m)
        x = A_m^T H,   f = F(RMSNorm(x)),   H' = A_r^T H + beta (x) f

    The coefficients come from the normalised streams but multiply the raw ones; W and
    w_beta are one fused (d, m+2) projection. Init: A_m = one-hot e_{k mod m} (k = 2b + j,
    chosen from the block index so that it travels with the block on a swap), A_r = I,
    beta = 1, W = w_beta = 0, s_alpha = s_beta = 0.01: every stream then equals Pre-LN's h,
    and the summed readout m h equals it after the final RMSNorm. Optional
    (cfg.hc_out_init_scale, the study's config): attention-out and SwiGLU-down init / sqrt(m).
    Extra parameters per sublayer: m(m+1) + d(m+1) + 1 + m + d + 1 = (m+2)(m+d) + 2.
    Weight decay: the static routing parameters are exempt, the dynamic projections decay.

    Differences from the study's code: A_r is applied (one public version of
    `hyper_connections.py` computed it and dropped it, probes.md §7; the later one applies
    it, as here); the routing runs in the streams' dtype with autocast off, so under bf16
    autocast the streams stay fp32 (the study's einsum would run in bf16 there).
    """

    def __init__(self, cfg):
        super().__init__(cfg, HCRoute)

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        m = self.m
        for k, r in self.routes():
            r.static_alpha.zero_()
            r.static_alpha[k % m, 0] = 1.0                      # A_m: read stream k mod m
            r.static_alpha[:, 1:] = torch.eye(m)                # A_r: identity
            r.static_beta.fill_(1.0)
            r.dynamic_alpha.zero_()
            r.dynamic_beta.zero_()
            r.alpha_scale.fill_(0.01)
            r.beta_scale.fill_(0.01)

    def no_weight_decay(self):
        return {f'layers.{b}.{s}_route.{n}' for b in range(len(self.layers))
                for s in ('attn', 'mlp') for n in ('static_alpha', 'static_beta')}

    def coefficients(self, H, r):
        B, T, m, d = H.shape
        with no_autocast(H):
            Wt = torch.cat([r.dynamic_alpha.t(), r.dynamic_beta.unsqueeze(0)]).to(H.dtype)  # [W | w_beta]^T (m+2, d)
            dyn = torch.tanh(NormedProjection.apply(H, Wt, 1e-8))  # tanh(H_bar [W | w_beta]) (m+2, B, T, m)
            C = r.static_alpha + r.alpha_scale * dyn[:m + 1].permute(1, 2, 3, 0)  # (B, T, m, m+1) = [A_m | A_r]
            w = r.static_beta + r.beta_scale * dyn[m + 1]                            # (B, T, m)
        return C.to(H.dtype), w.to(H.dtype)


class MHCRoute(nn.Module):
    """Routing parameters of one mHC sublayer: projection phi (m d, m^2 + 2m) and bias
    (m^2 + 2m), columns [pre (m) | post (m) | res (m^2, row-major)], and the scalar gates
    alpha_pre, alpha_post, alpha_res."""

    def __init__(self, cfg):
        super().__init__()
        m, d = cfg.hc_streams, cfg.n_embd
        self.phi = nn.Parameter(torch.zeros(m * d, m * m + 2 * m))
        self.bias = nn.Parameter(torch.zeros(m * m + 2 * m))
        self.alpha_pre = nn.Parameter(torch.tensor(0.01))
        self.alpha_post = nn.Parameter(torch.tensor(0.01))
        self.alpha_res = nn.Parameter(torch.tensor(0.01))


class MHC(MultiStream):
    """Manifold-Constrained Hyper-Connections (DeepSeek, arXiv 2512.24880; schemes.md "mHC").

    m streams H (B, T, m, d). Sublayer k, with x' = RMS(vec H) (one statistic over all m d
    numbers, no weight, eps cfg.norm_eps) and [l_pre | l_post | l_res] = x' phi (no tanh):

        H_pre  = sigmoid(alpha_pre * l_pre + b_pre)                  (m)
        H_post = 2 sigmoid(alpha_post * l_post + b_post)             (m)
        H_res  = Sinkhorn(alpha_res * mat(l_res) + b_res)            (m x m), cfg.mhc_sinkhorn_iters rounds
        u = sum_i H_pre[i] H[i],  f = F(RMSNorm(u)),  H'[j] = sum_i H_res[i, j] H[i] + H_post[j] f

    All routing math (RMS, projection, gates, Sinkhorn, the read and mix) in fp32 with
    autocast off. Readout: sum of the streams (the mean would be identical after the final
    RMSNorm, up to its eps). Init cfg.mhc_init: 'gap8' (the study's text): phi = 0,
    b_pre = +8 on stream k mod m and -8 elsewhere, b_res = +8 on the diagonal and -8 off
    it, b_post = 0, so H_res ~ I, H_post = 1; or 'uniform': phi ~ N(0, 0.02^2), b = 0
    (H_res ~ uniform, H_pre ~ 0.5, H_post ~ 1). Gates 0.01. Extra parameters per sublayer:
    (m d + 1)(m^2 + 2m) + 3. Weight decay: phi decays, biases and gates do not.

    Differences from the study's code: its default (Liger) backend puts the bias inside
    the gate, Sinkhorn(alpha_res (x' phi_res + b_res)), and its plain-PyTorch backend puts
    a tanh on x' phi; we follow the paper's alpha x' phi + b (the same under the uniform
    init, where b = 0, up to that tanh). The eps of RMS(vec H) is cfg.norm_eps (1e-6, the
    Liger backend's; the PyTorch backend uses 1e-8). Sinkhorn: same row-then-column
    rounds, first round in the log domain (`sinkhorn`).
    """

    def __init__(self, cfg):
        if cfg.mhc_init not in ('gap8', 'uniform'):
            raise ValueError(f"mhc_init must be 'gap8' or 'uniform', got {cfg.mhc_init!r}")
        if cfg.mhc_sinkhorn_iters < 1:
            raise ValueError(f"mhc_sinkhorn_iters must be >= 1, got {cfg.mhc_sinkhorn_iters}")
        super().__init__(cfg, MHCRoute)

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        m = self.m
        for k, r in self.routes():
            for g in (r.alpha_pre, r.alpha_post, r.alpha_res):
                g.fill_(0.01)
            r.bias.zero_()
            if self.cfg.mhc_init == 'gap8':
                r.phi.zero_()
                b_pre, b_res = r.bias[:m], r.bias[2 * m:].view(m, m)
                b_pre.fill_(-8.0)
                b_pre[k % m] = 8.0
                b_res.fill_(-8.0).fill_diagonal_(8.0)
            else:
                nn.init.normal_(r.phi, std=0.02)

    def no_weight_decay(self):
        return {f'layers.{b}.{s}_route.bias' for b in range(len(self.layers)) for s in ('attn', 'mlp')}

    def coefficients(self, H, r):
        B, T, m, d = H.shape
        with no_autocast(H):
            x = H.float().reshape(B, T, m * d)                                       # vec(H) per token
            logits = NormedProjection.apply(x, r.phi.t().float(), self.cfg.norm_eps)  # x' phi (m^2 + 2m, B, T)
            gate = torch.cat([r.alpha_pre.expand(m), r.alpha_post.expand(m), r.alpha_res.expand(m * m)])
            logits = logits * gate.float().view(-1, 1, 1) + r.bias.float().view(-1, 1, 1)   # alpha x' phi + b
            pre, post, res = logits.split([m, m, m * m])
            H_res = sinkhorn_leading(res.view(m, m, B, T), self.cfg.mhc_sinkhorn_iters)  # (m, m, B, T)
            C = torch.cat([torch.sigmoid(pre).unsqueeze(1), H_res], dim=1)          # (m, m+1, B, T): [H_pre | H_res]
        return C.permute(2, 3, 0, 1), 2 * torch.sigmoid(post).permute(1, 2, 0)    # (B, T, m, m+1), (B, T, m) fp32


# ---- Block AttnRes -----------------------------------------------------------

class BlockState(NamedTuple):
    """State of Block AttnRes between blocks (never modified in place)."""
    sources: tuple            # v_0 = embedding, then the frozen block sums, each (B, T, d)
    inv_rmses: tuple          # their 1/rms (B, T, 1), computed once per source
    partial: torch.Tensor | None  # running sum of the current AttnRes block's outputs (None: empty)
    k: int                    # 0-based index of the next sublayer, the one that reads `mix`
    mix: torch.Tensor         # the raw depth mix sublayer k reads (B, T, d)
    boundary: bool            # whether that read is at an AttnRes-block boundary


class BlockAttnRes(AttnRes):
    """Block Attention Residuals (arXiv 2603.15031; DESIGN §4, schemes.md "Block AttnRes").

    As Full AttnRes (same parameters: a zero-init pseudo-query and a key-norm gain per
    read, same `depth_mix`), but the sources are block sums. The 2L sublayers form
    cfg.attnres_blocks AttnRes blocks of S = 2L / attnres_blocks sublayers. At sublayer k
    with k % S == 0 and k > 0 the running partial sum P (every output added since the last
    boundary) is frozen as a new source before sublayer k's input is computed; sublayer
    k's own output then starts the next partial sum. Sublayer k reads

        z_k = sum_i a_ki v_i over v in [embedding, frozen block sums..., P if non-empty],
        f_k = F_k(RMSNorm_pre,k(z_k)),   P <- P + f_k

    and the final aggregator reads the same way at k = 2L (always a boundary). S = 1 is
    exactly Full AttnRes. With fewer sublayers than attnres_blocks (2L < attnres_blocks,
    tiny test models) every sublayer is its own block (S = 1); otherwise 2L must be a
    multiple of attnres_blocks. Partial sums accumulate in the embedding's dtype (fp32
    under autocast, as Pre-LN's residual stream).

    Boundaries are positions in the run: k counts the sublayers of the blocks run or
    skipped so far, so a swapped block uses the boundaries of the place it runs in (the
    architecture stays fixed, probes.md §3) and a dropped block shifts later positions.

    probe z_l (probes.md §0): the raw mix of block l's attention read when that read is
    a boundary, else the running partial sum (the plain block output; the mix if the
    partial sum is empty, which only a skip can cause). lens: the raw mix of block l's
    attention read, for every block (probes.md §5). Trace per read: `weights`
    (n_sources, B, T) and `current` (index of P among the sources, -1 if not among them).

    Skip (probes.md §2, adapted): the skipped block adds nothing and passes P through;
    the boundaries inside it still freeze P. If the next read is a boundary it becomes
    the identity on the newest source (the next-output rule); otherwise it is the usual
    mix (with the skipped block's output-side mixer, which in the study's layout is the
    next block's input mixer) over the unchanged sources. With S = 1 this is Full
    AttnRes's skip rule exactly.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        n_sub = 2 * cfg.n_layer
        if cfg.attnres_blocks < 1:
            raise ValueError(f"attnres_blocks must be >= 1, got {cfg.attnres_blocks}")
        n_blocks = min(cfg.attnres_blocks, n_sub)
        if n_sub % n_blocks:
            raise ValueError(f"Block AttnRes needs 2*n_layer = {n_sub} sublayers divisible by "
                             f"attnres_blocks = {cfg.attnres_blocks}: choose attnres_blocks among "
                             f"{[n for n in range(1, n_sub + 1) if n_sub % n == 0]}")
        self.group_size = n_sub // n_blocks  # S, sublayers per AttnRes block

    def freeze(self, sources, inv_rmses, partial):
        """Appends the partial sum (if any) to the sources as a frozen block."""
        if partial is None:
            return sources, inv_rmses
        return sources + (partial,), inv_rmses + (inv_rms(partial, self.cfg.norm_eps),)

    def read(self, sources, inv_rmses, partial, k, mixer, b, j):
        """The input of sublayer k (recorded as block b, sublayer j): freezes P at a
        boundary, then mixes the embedding, the frozen blocks and P (if non-empty).
        Returns (sources, inv_rmses, partial, z (B, T, d), boundary)."""
        boundary = k % self.group_size == 0
        if boundary:
            sources, inv_rmses = self.freeze(sources, inv_rmses, partial)
            partial = None
        if partial is None:
            z, a = mixer(sources, inv_rmses)
            current = -1
        else:
            z, a = mixer(sources + (partial,), inv_rmses + (inv_rms(partial, self.cfg.norm_eps),))
            current = len(sources)
        if self.tape is not None:
            self.record(b, j, weights=a, current=torch.tensor(current))
        return sources, inv_rmses, partial, z, boundary

    def accumulate(self, sources, partial, f):
        return f.to(sources[0].dtype) if partial is None else partial + f

    def begin(self, x):
        return BlockState((x,), (inv_rms(x, self.cfg.norm_eps),), None, 0, x, True)

    def block(self, state, b, layer, rope):
        sources, inv_rmses, partial, k, mix, _ = state
        p = self.layers[b]
        partial = self.accumulate(sources, partial, layer.attn(p.attn_norm(mix), rope))
        sources, inv_rmses, partial, z, _ = self.read(sources, inv_rmses, partial, k + 1, p.mlp_mix, b, 1)
        partial = self.accumulate(sources, partial, layer.mlp(p.mlp_norm(z)))
        # the read of the next block's attention, or the final aggregator (recorded as block b+1)
        sources, inv_rmses, partial, mix, boundary = self.read(sources, inv_rmses, partial, k + 2,
                                                               p.out_mix, b + 1, 0)
        return BlockState(sources, inv_rmses, partial, k + 2, mix, boundary)

    def skip(self, state, b):
        sources, inv_rmses, partial, k, _, _ = state
        if (k + 1) % self.group_size == 0:  # a boundary at the skipped MLP's position still freezes P
            sources, inv_rmses = self.freeze(sources, inv_rmses, partial)
            partial = None
        if (k + 2) % self.group_size == 0:  # next-output rule: identity on the newest source
            sources, inv_rmses = self.freeze(sources, inv_rmses, partial)
            return BlockState(sources, inv_rmses, None, k + 2, sources[-1], True)
        sources, inv_rmses, partial, mix, boundary = self.read(sources, inv_rmses, partial, k + 2,
                                                               self.layers[b].out_mix, b + 1, 0)
        return BlockState(sources, inv_rmses, partial, k + 2, mix, boundary)

    def end(self, state):
        return state.mix

    def probe(self, state):
        return state.mix if state.boundary or state.partial is None else state.partial

    def lens(self, state):
        return state.mix


# ---- single-stream schemes ---------------------------------------------------
# Sandwich-LN, LNS, DeepNorm, KEEL and the classic variants Post-LN, ReZero, LayerScale,
# ResiDual. Every one keeps one residual stream; a skipped block is the identity.

SIDES = ('attn', 'mlp')  # sublayer j = 0, 1


def rmsnorm(cfg):
    """A fresh RMSNorm of width d with the config's eps (gain 1)."""
    return RMSNorm(cfg.n_embd, cfg.norm_eps)


class SublayerParams(nn.Module):
    """The parameters of one block of a single-stream scheme: for every keyword
    `name=make`, one `make(cfg)` per sublayer, registered as attn_<name> and mlp_<name>.
    `norm=rmsnorm` gives attn_norm / mlp_norm, the names of Pre-LN's pre-norms, so Pre-LN
    weights load into a scheme with `load_state_dict(strict=False)`. A part set to None
    afterwards is absent (KEEL block 0's outer attention norm)."""

    def __init__(self, cfg, **parts):
        super().__init__()
        for name, make in parts.items():
            for side in SIDES:
                setattr(self, f'{side}_{name}', make(cfg))

    def get(self, name, j):
        """The part `name` of sublayer j (0 attention, 1 MLP), or None."""
        return getattr(self, f'{SIDES[j]}_{name}')


def per_block(cfg, **parts):
    """self.layers of a single-stream scheme: n_layer SublayerParams(cfg, **parts)."""
    return nn.ModuleList([SublayerParams(cfg, **parts) for _ in range(cfg.n_layer)])


class Sandwich(SingleStream):
    """Sandwich-LN (CogView, arXiv 2105.13290; the study's Peri-LN block), DESIGN §4:

        h <- h + RMSNorm_out(F(RMSNorm_in(h)))

    One extra RMSNorm (gain 1) on every sublayer's output and none on the embedding:
    +2Ld parameters over Pre-LN."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = per_block(cfg, norm=rmsnorm, out_norm=rmsnorm)

    def sublayer(self, h, b, j, f):
        p = self.layers[b]
        return h + p.get('out_norm', j)(f(p.get('norm', j)(h)))


class LNS(PreLN):
    """LayerNorm Scaling ("The Curse of Depth in LLMs", arXiv 2502.05795), DESIGN §4:

        h <- h + F(RMSNorm(h) / sqrt(b + 1))

    for both sublayers of block b (0-based, so the divisor is the root of the 1-based
    index). The factor is a constant of block b, not a parameter; it travels with the
    block when an order moves it (probes.md §3, the study's release). The final norm is
    unscaled. No parameters beyond Pre-LN's: with L = 1 it is Pre-LN."""

    peak_lr = 1e-2  # DESIGN §6

    def sublayer(self, h, b, j, f):
        scale = 1.0 / math.sqrt(b + 1)
        return super().sublayer(h, b, j, lambda x: f(x * scale))


class PostLN(SingleStream):
    """Post-LN (Vaswani et al. 2017, arXiv 1706.03762), schemes.md "beyond the ten":

        h <- LN(alpha * h + F(h)),   alpha = 1, LN = RMSNorm

    The block norms (attn_post_norm, mlp_post_norm) follow the residual add, so every
    block output is normalised and is the probe and lens state (probes.md §0). The
    embedding enters block 0 unnormalised; the final RMSNorm stays. Same parameter count
    as Pre-LN. Subclasses change `alpha` and `make_norm` (DeepNorm)."""

    alpha = 1.0

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = per_block(cfg, post_norm=self.make_norm)

    @staticmethod
    def make_norm(cfg):
        return rmsnorm(cfg)

    def sublayer(self, h, b, j, f):
        return self.layers[b].get('post_norm', j)(self.alpha * h + f(h))


class DeepNorm(PostLN):
    """DeepNorm (DeepNet, arXiv 2203.00555, Eq. of §3; reference microsoft/torchscale), DESIGN §4:

        h <- LN(alpha * h + F(h)),   alpha = (2L)^(1/4)

    Post-LN with an up-weighted residual; LN is LayerNorm without bias (gain only, so the
    same parameter count as Pre-LN). Init (`init_weights`): the value and output
    projections of attention and all three SwiGLU matrices are multiplied by
    beta = (8L)^(-1/4) after the default init, so their std is beta * init_std; the query
    and key projections keep init_std."""

    peak_lr = 1e-3  # DESIGN §6: at 2e-3 it diverged in the study

    def __init__(self, cfg):
        super().__init__(cfg)
        self.alpha = (2 * cfg.n_layer) ** 0.25
        self.beta = (8 * cfg.n_layer) ** -0.25

    @staticmethod
    def make_norm(cfg):
        return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=False)

    @torch.no_grad()
    def init_weights(self, model):
        """Resets the norms and scales the freshly initialised backbone by beta: call it only
        right after the backbone init, as GPT.init_weights does (twice would give beta^2)."""
        super().init_weights(model)
        for blk in model.blocks:
            for lin in (blk.attn.wv, blk.attn.wo, blk.mlp.w_gate, blk.mlp.w_up, blk.mlp.w_down):
                lin.weight.mul_(self.beta)


class KEEL(SingleStream):
    """KEEL ("Post-LayerNorm Is Back", arXiv 2601.19895), DESIGN §4:

        h <- RMSNorm_out(alpha * h + F(RMSNorm_in(h))),   alpha = 2L (the number of sublayers)

    Block 0 is special: its attention is plain Pre-LN, h <- h + F(RMSNorm_in(h)) (no outer
    norm), and its MLP has the outer norm with alpha = 1. Extra parameters: an outer norm
    on every sublayer but block 0's attention, +(2L - 1)d over Pre-LN.
    Unlike the study's code, where the special form belongs to position 0 and a swap
    exchanges only tensors of equal shape, block 0's form travels with block 0 when an
    order moves it (every parameter and constant of a block is looked up by its index)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.alpha = 2.0 * cfg.n_layer
        self.layers = per_block(cfg, norm=rmsnorm, out_norm=rmsnorm)
        self.layers[0].attn_out_norm = None  # block 0's attention: plain Pre-LN

    def sublayer(self, h, b, j, f):
        p = self.layers[b]
        y = f(p.get('norm', j)(h))
        out_norm = p.get('out_norm', j)
        if out_norm is None:
            return h + y
        return out_norm((1.0 if b == 0 else self.alpha) * h + y)


class ReZero(SingleStream):
    """ReZero (Bachlechner et al. 2020, arXiv 2003.04887):

        h <- h + g * F(h),   g a scalar per sublayer (attn_gate, mlp_gate), initialised to 0

    No norms inside the blocks (the final RMSNorm stays), so at init the model is the
    identity on the embedding: logits = lm_head(norm_f(wte(idx))). Parameters: 2L gates
    instead of Pre-LN's 2L norm gains, 2L - 2Ld over Pre-LN."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = per_block(cfg, gate=lambda cfg: nn.Parameter(torch.zeros(())))

    @torch.no_grad()
    def init_weights(self, model):
        for g in self.parameters():  # the gates are the only parameters
            g.zero_()

    def sublayer(self, h, b, j, f):
        return h + self.layers[b].get('gate', j) * f(h)


class LayerScale(SingleStream):
    """LayerScale (CaiT, Touvron et al. 2021, arXiv 2103.17239, Eq. 4):

        h <- h + gamma ⊙ F(RMSNorm(h)),   gamma in R^d per sublayer (attn_scale, mlp_scale)

    gamma initialised to cfg.layerscale_init (1e-4): at init each block is close to the
    identity; with gamma = 1 it is Pre-LN. +2Ld parameters over Pre-LN."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = per_block(cfg, norm=rmsnorm, scale=lambda cfg: nn.Parameter(torch.ones(cfg.n_embd)))

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        for p in self.layers:
            for j in range(2):
                p.get('scale', j).fill_(self.cfg.layerscale_init)

    def sublayer(self, h, b, j, f):
        p = self.layers[b]
        return h + p.get('scale', j) * f(p.get('norm', j)(h))


class ResiDual(SingleStream):
    """ResiDual (Xie et al. 2023, arXiv 2304.14802, "Pre-Post-LN"): a Post-LN stream a and
    a dual stream s fed by the same branch outputs,

        y = F(a),   a <- LN(a + y),   s <- s + y             (every sublayer)
        readout h = a + LN_dual(s)                            (then the final RMSNorm, LM head)

    Both streams start from the embedding (as in the reference code, microsoft/ResiDual);
    the branches read the normalised Post-LN stream, with no pre-norm; LN = RMSNorm here
    (LayerNorm in the paper). Parameters: Post-LN's norms plus LN_dual, +d over Pre-LN.
    State (a, s); a skipped block leaves both unchanged. probe = lens = the readout
    a + LN_dual(s), what the head would read if the network stopped there."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = per_block(cfg, post_norm=rmsnorm)
        self.dual_norm = rmsnorm(cfg)

    def begin(self, x):
        return x, x

    def sublayer(self, state, b, j, f):
        a, s = state
        y = f(a)
        return self.layers[b].get('post_norm', j)(a + y), s + y

    def end(self, state):
        a, s = state
        return a + self.dual_norm(s)

    def probe(self, state):
        return self.end(state)

    def lens(self, state):
        return self.end(state)


# ---- MoDA --------------------------------------------------------------------

class DepthReadFunction(torch.autograd.Function):
    """The depth half of MoDA's joint softmax, with a hand-written backward. Call as

        y, lse = DepthReadFunction.apply(q, scale, *depth_k, *depth_v)

    q: (B, H_kv, G, T, hd) (query heads grouped by their key/value head); depth_k[j],
    depth_v[j]: S >= 1 slots (B, H_kv, T, hd). With scores d_j = scale * q . K_j and
    a = softmax_j(d) (fp32):
        y = sum_j a_j V_j  (B, H_kv, G, T, hd),   lse = log sum_j exp(d_j)  (B, H_kv, G, T) fp32.
    Why by hand: autograd on a stacked (B, H_kv, T, S, hd) copy of the slots keeps that copy
    for the backward at every block, O(L^2 B T d) bytes per pass, and per-token
    (1 x hd)(hd x S) products run as slow batched matmuls. Here every sum over slots is a
    loop over the S tensors (alive anyway: they are the depth cache), and the backward
    saves only a (S numbers per query) and references. With incoming gy, glse and
    p_j = gy . V_j:  gd_j = a_j (p_j - sum_i a_i p_i + glse),
        gq = scale sum_j gd_j K_j,  gK_j = scale sum_G gd_j q,  gV_j = sum_G a_j gy."""

    @staticmethod
    def forward(ctx, q, scale, *slots):
        S = len(slots) // 2
        K, V = slots[:S], slots[S:]
        acc = torch.promote_types(q.dtype, torch.float32)
        qa = q.to(acc)                                                                       # scores in fp32 (no-op for fp32)
        d = torch.stack([torch.linalg.vecdot(qa, Kj.unsqueeze(2).to(acc)) for Kj in K]) * scale  # (S, B, H_kv, G, T)
        lse = torch.logsumexp(d, dim=0)                                                     # (B, H_kv, G, T)
        a = torch.exp(d - lse)                                                              # (S, B, H_kv, G, T)
        y = torch.zeros(q.shape, dtype=acc, device=q.device)
        for j, Vj in enumerate(V):  # in place: one buffer, not S fresh (B, H_kv, G, T, hd) tensors
            y.addcmul_(a[j].unsqueeze(-1), Vj.unsqueeze(2))
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
        acc, G = a.dtype, q.size(2)
        group_sum = (lambda t: t.squeeze(2)) if G == 1 else (lambda t: t.sum(2))  # over the query heads of a K/V head
        if gy is None:
            p = torch.zeros_like(a)
        else:
            gy = gy.to(acc)
            p = torch.stack([torch.linalg.vecdot(gy, Vj.unsqueeze(2).to(acc)) for Vj in V])  # (S, B, H_kv, G, T)
        gd = p - (a * p).sum(0, keepdim=True)
        if glse is not None:
            gd = gd + glse
        gd = a * gd * ctx.scale                                                              # (S, B, H_kv, G, T)
        gq = torch.zeros(q.shape, dtype=acc, device=q.device)
        for j, Kj in enumerate(K):
            gq.addcmul_(gd[j].unsqueeze(-1), Kj.unsqueeze(2))
        gK = [group_sum(gd[j].unsqueeze(-1) * q).to(Kj.dtype) for j, Kj in enumerate(K)]
        gV = [group_sum(a[j].unsqueeze(-1) * gy).to(Vj.dtype) if gy is not None else None for j, Vj in enumerate(V)]
        return (gq.to(q.dtype), None, *gK, *gV)


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


def depth_attention(q, k, v, depth_k, depth_v, method=None):
    """The joint sequence-and-depth attention of MoDA (arXiv 2603.15619; schemes.md "MoDA"):

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
    Raises ValueError for an unknown method, or 'flash_cpu' off the CPU or without the kernel.
    `depth_attention_reference` is the same function written as the plain formula."""
    B, H, T, hd = q.shape
    Hkv, S = k.size(1), len(depth_k)
    assert len(depth_v) == S and H % Hkv == 0
    cpu_flash = q.device.type == 'cpu' and _CPU_FLASH is not None
    if method is None:  # the CPU kernel wherever SDPA itself would pick it (not under sdpa_kernel(MATH))
        method = 'flash_cpu' if cpu_flash and flash_backend_enabled() else 'null_key'
    if method not in ('flash_cpu', 'null_key') or (method == 'flash_cpu' and not cpu_flash):
        raise ValueError(f"depth_attention: method must be 'flash_cpu' (CPU only) or 'null_key', "
                         f"got {method!r} on {q.device.type}")
    gqa = H != Hkv
    if S == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    scale = hd ** -0.5
    y_dep, lse = DepthReadFunction.apply(q.view(B, Hkv, H // Hkv, T, hd), scale, *depth_k, *depth_v)
    y_dep, lse = y_dep.view(B, H, T, hd), lse.view(B, H, T)
    if method == 'null_key':
        return merge_null_key(q, k, v, y_dep, lse, scale)
    if gqa:  # the kernel has no GQA: repeat each key/value head for its H / H_kv query heads
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    return MergeDepthFunction.apply(q, k, v, y_dep, lse, scale)


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
    O(B H T (T + S)); what tests check `depth_attention` against."""
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


def put_slot(slots, i, t):
    """A copy of the tuple `slots` with slot i replaced by t (the cache is never mutated)."""
    return slots[:i] + (t,) + slots[i + 1:]


class MoDALayer(PreNormLayer):
    """Block b of MoDA: the two pre-norms and, on blocks 0..L-2, depth_kv = W_kv
    (d -> 2 * H_kv * hd, no bias), which writes [K; V] of the block's FFN input into the
    depth cache. The last block has none: its slot would never be read."""

    def __init__(self, cfg, has_depth_kv):
        super().__init__(cfg)
        kv_dim = cfg.n_kv_head * (cfg.n_embd // cfg.n_head)
        self.depth_kv = nn.Linear(cfg.n_embd, 2 * kv_dim, bias=False) if has_depth_kv else None


class MoDA(Residual):
    """Mixture-of-Depths Attention (arXiv 2603.15619; reference hustvl/MoDA), the study's
    pre-norm variant (schemes.md "MoDA"). Pre-LN residual adds,

        h <- h + Attn_depth(RMSNorm(h)),   h <- h + MLP(RMSNorm(h)),

    where the attention of the block at position p also attends, in the same softmax, to
    the 2p depth slots of the same token (`depth_attention`), both score sets scaled by
    1/sqrt(hd). A per-token depth cache of 2L slots, zero-filled when created:
      slot 2p   = the block's own attention key and value, W_k x and W_v x (before RoPE);
      slot 2p+1 = W_kv RMSNorm(h), the block's FFN input (the mlp_norm output) through
                  depth_kv, on blocks 0..L-2. Extra parameters (L - 1) * 2d * H_kv * hd.
    The block at position 0 has no depth slots to read: plain causal attention.
    Slots are positional (p = blocks run or skipped so far; p = b in the default order),
    as in the study where swaps exchange weights and positions stay. Block L-1 has no
    W_kv: if an order runs it before the end, its FFN slot stays zero.

    State (h, depth K, depth V, p): the depth cache, K and V, is a tuple of 2L slots
    (B, H_kv, T, hd) allocated once as one shared zero tensor; a write replaces a slot's
    reference (no copy, no per-block concatenation) and never modifies a tensor in place, so
    prefix states can be reused and autograd's saved slots stay valid. A read loops over
    the slots (`DepthReadFunction`). probe = lens = h (probes.md §0).
    Skip rule (probes.md §2): a skipped block leaves h unchanged and writes nothing into
    its two slots, which stay zero and still take softmax mass exp(q . 0) = 1 with a zero
    value (a skipped block differs from a dropped one, which takes no slots).
    use_depth=False (constructor argument or attribute) masks out every depth score:
    the model is then Pre-LN with unused W_kv (equivalence tests, ablations)."""

    def __init__(self, cfg, use_depth=True):
        super().__init__(cfg)
        self.use_depth = use_depth
        self.layers = nn.ModuleList([MoDALayer(cfg, b < cfg.n_layer - 1) for b in range(cfg.n_layer)])

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        std = self.cfg.init_std
        for p in self.layers:
            if p.depth_kv is not None:  # like every backbone Linear
                nn.init.trunc_normal_(p.depth_kv.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def begin(self, x):
        cfg = self.cfg
        B, T, _ = x.shape
        zero = x.new_zeros(B, cfg.n_kv_head, T, cfg.n_embd // cfg.n_head)  # (B, H_kv, T, hd)
        slots = (zero,) * (2 * cfg.n_layer)
        return x, slots, slots, 0

    def _next(self, state):
        h, K, V, p = state
        if 2 * p + 2 > len(K):
            raise ValueError(f"MoDA's depth cache has {len(K)} slots: an order may run or skip "
                             f"at most n_layer={self.cfg.n_layer} blocks")
        return h, K, V, p

    def block(self, state, b, layer, rope):
        h, K, V, p = self._next(state)
        B, T, _ = h.shape
        cfg, attn, prm = self.cfg, layer.attn, self.layers[b]
        q, k, v = attn.qkv(prm.attn_norm(h))  # (B, H, T, hd), (B, H_kv, T, hd) x2, before RoPE
        S = 2 * p if self.use_depth else 0    # the depth slots this block reads
        cos, sin = rope
        y = depth_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, K[:S], V[:S])
        h = h + attn.out(y)
        K, V = put_slot(K, 2 * p, k), put_slot(V, 2 * p, v)
        x = prm.mlp_norm(h)
        if prm.depth_kv is not None:
            dk, dv = prm.depth_kv(x).view(B, T, 2, cfg.n_kv_head, -1).permute(2, 0, 3, 1, 4)  # 2x (B, H_kv, T, hd)
            K, V = put_slot(K, 2 * p + 1, dk), put_slot(V, 2 * p + 1, dv)
        return h + layer.mlp(x), K, V, p + 1

    def skip(self, state, b):
        h, K, V, p = self._next(state)
        return h, K, V, p + 1

    def end(self, state):
        return state[0]

    def probe(self, state):
        return state[0]

    def lens(self, state):
        return state[0]


# -----------------------------------------------------------------------------

RESIDUALS = {
    'preln': PreLN,
    'attnres': AttnRes,
    'hc': HC,
    'mhc': MHC,
    'blockattnres': BlockAttnRes,
    'sandwich': Sandwich,
    'lns': LNS,
    'deepnorm': DeepNorm,
    'keel': KEEL,
    'moda': MoDA,
    'postln': PostLN,
    'rezero': ReZero,
    'layerscale': LayerScale,
    'resdual': ResiDual,
}
