"""
The residual schemes of DepthBench (paper Table 1, Appendix A; docs/schemes.md): one class
each, one registry `RESIDUALS` (name -> class) that `GPTConfig.residual` selects from.

Every scheme here is plain PyTorch, written as its docstring equation, and this code is
what trains, evaluates and is probed. With fast paths on (`--fast`, on by default on CUDA)
fast/ swaps a few of the methods below for fused kernels of the same inputs and outputs,
after checking them against these at start-up (fast/__init__.py has the table).

A scheme owns the wiring between the 2L branches of the backbone (model.py holds the
branches without norms): its norms, its extra parameters, its state (one residual
stream, m streams, or the history of sources), its readout and where the final norm goes.
The interface every scheme implements (`Residual`):

    state = begin(x)                     x: token embedding (B, T, d)
    state = block(state, b, layer, rope) run block b: layer.attn(x, rope), layer.mlp(x)
    state = skip(state, b)               the study's "skip block b" rule (docs/probes.md, skip rule)
    h     = end(state)                   the readout state: (B, T, d), or HC/mHC's streams (B, T, m, d)
    y     = readout(h, norm_f)           (B, T, d), the LM head's input: the final RMSNorm applied
                                         where the scheme applies it (default norm_f(h))
    probe(state), lens(state)            the depth state z_l and the LogitLens readout r_l
                                         after the blocks run so far (docs/probes.md)
    unit_paths                           True when every residual add has weight 1 (probe.py's
                                         path weights; schemes with coefficients trace them)

Parameters of block b live in `self.layers[b]` and are looked up by b, never by the
position in the order, so when a diagnostic swaps two blocks each block's weights travel
with it (docs/probes.md, swap rule). States are never modified in place: a diagnostic may
keep the state after a shared prefix of blocks and continue it several times.

Per-sublayer coefficients (HC/mHC read/mix/write weights, AttnRes depth-softmax weights)
are recorded while a `trace()` is active:

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


class RMSNorm(nn.Module):
    """y = g * x / sqrt(mean(x^2) + eps) over the last dim; gain g (d) initialised to 1."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight.to(x.dtype), self.eps)

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def extra_repr(self):
        return f"{self.weight.numel()}, eps={self.eps:g}"


def no_autocast(x):
    """Autocast off on x's device: routing math runs in the dtype it is given (fp32)."""
    return contextlib.nullcontext() if x.device.type == 'meta' else torch.autocast(x.device.type, enabled=False)


class Residual(nn.Module):
    """Base class of the schemes. Subclasses implement begin/block/end and may override
    skip/probe/lens. The default state is one residual stream h (B, T, d)."""

    peak_lr = 2e-3  # the study's peak learning rate for this scheme (paper Sec. 2.3, Table 4)
    unit_paths = False  # True: every residual add has weight 1, the explicit path weights of
                        # Pre-LN (paper Fig. 7); otherwise probe.py reads them from a trace
                        # ('weights' or 'read'/'mix'/'write') or refuses the metric
    regions = {}        # methods that GPT.compile_regions compiles on their own, besides the
                        # backbone's branches: name -> [(argument, dim)] of the dims that grow with
                        # depth, so that one compile serves every block

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tape = None  # list while trace() is active, else None
        self.final_norm_eps = cfg.norm_eps  # eps of the model's final RMSNorm (norm_f), which readout applies

    def init_weights(self, model):
        """(Re)initialises every parameter of the scheme; may rescale the backbone's
        weights (`model.blocks`). Called last by GPT.init_weights. Default: every norm gain 1."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.reset_parameters()

    def no_weight_decay(self):
        """Names (relative to this module) of the parameters exempt from weight decay
        (the study's exemptions: HC/mHC static routing). Default: none."""
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

    def readout(self, h, norm):
        """The LM head's input (B, T, d) from a readout state h: the final RMSNorm `norm`
        (the model's norm_f) applied where this scheme applies it. Default: norm(h)."""
        return norm(h)

    def probe(self, state):
        return state

    def lens(self, state):
        return state

    def notes(self):
        """Lines for the start of a run (train.py prints them): settings with which this
        scheme computes what another scheme does. Default: none."""
        return []

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
    branch function. probe = lens = h (docs/probes.md, depth states: residual family)."""

    def sublayer(self, h, b, j, f):
        raise NotImplementedError

    def block(self, h, b, layer, rope):
        h = self.sublayer(h, b, 0, lambda x: layer.attn(x, rope))
        return self.sublayer(h, b, 1, layer.mlp)


# -----------------------------------------------------------------------------
# Pre-LN

class PreLN(SingleStream):
    """Pre-LN (Xiong et al. 2020, arXiv 2002.04745), the baseline of the paper's Table 1:

        h <- h + F(RMSNorm(h))

    for every sublayer. No parameters beyond one RMSNorm gain per sublayer."""

    unit_paths = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = nn.ModuleList([PreNormLayer(cfg) for _ in range(cfg.n_layer)])

    def sublayer(self, h, b, j, f):
        norm = (self.layers[b].attn_norm, self.layers[b].mlp_norm)[j]
        return h + f(norm(h))


# -----------------------------------------------------------------------------
# Attention Residuals

def rms_norm_eps(x, norm, eps):
    """RMSNorm of x (B, T, d) with the gain of `norm` (an RMSNorm) but epsilon `eps`."""
    return F.rms_norm(x, (x.size(-1),), norm.weight.to(x.dtype), eps)


class DepthMixer(nn.Module):
    """The parameters of one AttnRes read: a pseudo-query w (d, zero init) and a key-norm
    gain g (d, init 1, eps cfg.attnres_eps)."""

    def __init__(self, cfg):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(cfg.n_embd))
        self.key_norm = RMSNorm(cfg.n_embd, cfg.attnres_eps)


class AttnResLayer(PreNormLayer):
    """Block b of AttnRes: the two pre-norms, the mixer that reads the MLP input, and the
    mixer that reads block b's *output*: the input of block b+1's attention, or, for the
    last block, the final aggregator. (Block 0's attention reads the embedding directly,
    so every read has exactly one owner and a swap moves a block's MLP-side and
    output-side mixers with it, as the swap rule of docs/probes.md says.) Each norm's eps is
    the one it is used with: mlp_norm cfg.attnres_eps; attn_norm cfg.norm_eps in block 0,
    which reads the embedding alone, cfg.attnres_eps in the others (`AttnRes.attn_input`)."""

    def __init__(self, cfg, b):
        super().__init__(cfg)
        self.attn_norm.eps = cfg.norm_eps if b == 0 else cfg.attnres_eps
        self.mlp_norm.eps = cfg.attnres_eps
        self.mlp_mix = DepthMixer(cfg)
        self.out_mix = DepthMixer(cfg)


class AttnRes(Residual):
    """Full Attention Residuals (arXiv 2603.15031; paper Appendix A).

    Sources v_0 = token embedding, v_{k+1} = raw output of sublayer k. Sublayer k reads

        z_k = sum_{i<=k} a_ki v_i,  a_k = softmax_i(w_k . RMSNorm_key,k(v_i)),   f_k = F_k(RMSNorm_pre,k(z_k))

    (`read`) with a zero-initialised pseudo-query w_k (d): at init every read is the mean of
    its sources, whose RMSNorm equals Pre-LN's (up to eps). Block 0's attention reads
    RMSNorm(v_0) and has no depth parameters; a final aggregator mixes all 2L+1 sources
    into the input of the final RMSNorm. Extra parameters: 2d per read, 4Ld in all.
    Epsilons as in the study's code: the key norms, the RMSNorm_pre on each read's result and
    the final norm use cfg.attnres_eps (1e-5); block 0's attention norm keeps cfg.norm_eps.

    State: (sources, mix), mix = the raw depth mix the next block's attention reads (probe
    and lens state z_l). Skip rule (docs/probes.md): a skipped block adds no sources, and
    the next read is the identity on the newest source (unlike the study's code, skipping
    block 0 does not put the embedding into the bank twice).
    """

    regions = {'mix': [(0, 0)]}  # V (n, B, T, d): n grows with depth

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = nn.ModuleList([AttnResLayer(cfg, b) for b in range(cfg.n_layer)])
        self.final_norm_eps = cfg.attnres_eps  # the study fuses the final norm into the last read

    def init_weights(self, model):
        super().init_weights(model)
        for layer in self.layers:  # the zero init that makes every first read a uniform mean
            nn.init.zeros_(layer.mlp_mix.query)
            nn.init.zeros_(layer.out_mix.query)

    def read(self, sources, mixer):
        """The depth read of one sublayer: sources n x (B, T, d) -> (z, a), see `mix`."""
        return self.mix(torch.stack(sources), mixer)

    def mix(self, V, mixer):
        """z = sum_i a_i v_i, a = softmax_i(w . RMSNorm_key(v_i)): V (n, B, T, d) -> z (B, T, d),
        a (n, B, T), both fp32 (fp64 for fp64 sources), under autocast too."""
        V = V.to(torch.promote_types(V.dtype, torch.float32))
        with no_autocast(V):
            keys = F.rms_norm(V, (V.size(-1),), mixer.key_norm.weight.to(V.dtype), mixer.key_norm.eps)
            a = torch.softmax(keys @ mixer.query.to(V.dtype), dim=0)             # (n, B, T), over depth
            z = torch.einsum('nbt,nbtd->btd', a, V)                              # (B, T, d)
        return z, a

    def attn_input(self, p, mix, embedding_only):
        """The attention input of a block with parameters p: its attn_norm's gain on the
        embedding alone (the study's block 0, eps cfg.norm_eps), else on a read's result
        (eps attnres_eps). In the model's order these are attn_norm's own eps; a block run
        out of its place (a swap) keeps the eps of the place it runs in."""
        eps = self.cfg.norm_eps if embedding_only else self.cfg.attnres_eps
        return p.attn_norm(mix) if p.attn_norm.eps == eps else rms_norm_eps(mix, p.attn_norm, eps)

    def begin(self, x):
        return (x,), x

    def block(self, state, b, layer, rope):
        sources, mix = state
        p = self.layers[b]
        sources = sources + (layer.attn(self.attn_input(p, mix, len(sources) == 1), rope),)
        z, a = self.read(sources, p.mlp_mix)
        self.record(b, 1, weights=a)
        sources = sources + (layer.mlp(p.mlp_norm(z)),)
        mix, a = self.read(sources, p.out_mix)
        self.record(b + 1, 0, weights=a)  # the read of the next block's attention (or the final one)
        return sources, mix

    def skip(self, state, b):
        sources, _ = state
        return sources, sources[-1]

    def end(self, state):
        return state[1]

    def probe(self, state):
        return state[1]

    def lens(self, state):
        return state[1]


class BlockState(NamedTuple):
    """State of Block AttnRes between blocks (never modified in place)."""
    sources: tuple                # v_0 = embedding, then the frozen block sums, each (B, T, d)
    partial: torch.Tensor | None  # running sum of the current AttnRes block's outputs (None: empty)
    k: int                        # 0-based index of the next sublayer, the one that reads `mix`
    mix: torch.Tensor             # the raw depth mix sublayer k reads (B, T, d)
    boundary: bool                # whether that read is at an AttnRes-block boundary


class BlockAttnRes(AttnRes):
    """Block Attention Residuals (arXiv 2603.15031; paper Table 1, Appendix A).

    As Full AttnRes (same parameters, same `read`), but the sources are block sums. The 2L
    sublayers form cfg.attnres_blocks AttnRes blocks of S = 2L / attnres_blocks sublayers.
    At sublayer k with k % S == 0 and k > 0 (`boundary`, the one place of the rule) the running
    partial sum P is frozen as a new source before sublayer k's input is computed; sublayer k's
    output starts the next P:

        z_k = sum_i a_ki v_i over v in [embedding, frozen block sums..., P if non-empty],
        f_k = F_k(RMSNorm_pre,k(z_k)),   P <- P + f_k

    The final aggregator reads the same way at k = 2L. S = 1 is Full AttnRes. With
    2L < attnres_blocks every sublayer is its own block; otherwise 2L must be a multiple.
    Boundaries are positions in the run (k counts the sublayers run or skipped so far), so a
    swapped block uses the boundaries of the place it runs in (docs/probes.md, swap rule).

    probe z_l: the raw mix of block l's attention read when that read is a boundary, else
    the running partial sum. lens: that raw mix, for every block. Trace per read: `weights`
    (n_sources, B, T) and `current` (index of P among the sources, -1 if not among them).
    Skip (docs/probes.md, skip rule, adapted): the skipped block adds nothing and passes P
    through; boundaries inside it still freeze P; if the next read is a boundary it is the
    identity on the newest source, otherwise the usual mix over the unchanged sources.
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

    def notes(self):
        """One start-up line with the block size, e.g. "Block AttnRes: 2 blocks of 4 sublayers"
        (train.py prints it), and what the scheme is when S = 1 or S = 2L."""
        n_sub, S = 2 * self.cfg.n_layer, self.group_size
        if S == 1:
            return [f"Block AttnRes with attnres_blocks={self.cfg.attnres_blocks} and 2L = {n_sub} sublayers "
                    f"is Full AttnRes: {n_sub} blocks of 1 sublayer, every source a sublayer output (blocks of "
                    f"several sublayers: attnres_blocks a divisor of {n_sub} below {n_sub})"]
        if S == n_sub:
            return [f"Block AttnRes with attnres_blocks={self.cfg.attnres_blocks}: one block holds all {n_sub} "
                    f"sublayers, so every read sees only the embedding and the running sum"]
        return [f"Block AttnRes: {n_sub // S} blocks of {S} sublayers (attnres_blocks={self.cfg.attnres_blocks}, "
                f"2L = {n_sub})"]

    def boundary(self, k):
        """Whether sublayer k's read is at an AttnRes-block boundary: the running sum P is frozen
        as a source before that read. k: the 0-based index of the sublayer in the run (k = 2L is
        the final aggregator), as in `read_at`. The one place of the rule; `read_at` and `skip`
        both ask it, so an edit here moves the read and the probes' skip rule together."""
        return k % self.group_size == 0

    def read_at(self, sources, partial, k, mixer, b, j):
        """The input of sublayer k (recorded as block b, sublayer j): freezes P at a boundary,
        then reads the embedding, the frozen blocks and P. -> (sources, partial, z, boundary)."""
        boundary = self.boundary(k)
        if boundary and partial is not None:
            sources, partial = sources + (partial,), None
        current = -1 if partial is None else len(sources)
        z, a = self.read(sources if partial is None else sources + (partial,), mixer)
        if self.tape is not None:
            self.record(b, j, weights=a, current=torch.tensor(current))
        return sources, partial, z, boundary

    def begin(self, x):
        return BlockState((x,), None, 0, x, True)

    def block(self, state, b, layer, rope):
        sources, partial, k, mix, _ = state
        p = self.layers[b]
        f = layer.attn(self.attn_input(p, mix, len(sources) == 1 and partial is None), rope)
        partial = f.to(sources[0].dtype) if partial is None else partial + f  # sums in the embedding's dtype
        sources, partial, z, _ = self.read_at(sources, partial, k + 1, p.mlp_mix, b, 1)
        f = layer.mlp(p.mlp_norm(z))
        partial = f.to(sources[0].dtype) if partial is None else partial + f
        # the read of the next block's attention, or the final aggregator (recorded as block b+1)
        sources, partial, mix, boundary = self.read_at(sources, partial, k + 2, p.out_mix, b + 1, 0)
        return BlockState(sources, partial, k + 2, mix, boundary)

    def skip(self, state, b):
        sources, partial, k, _, _ = state
        if self.boundary(k + 1) and partial is not None:  # a boundary at the skipped MLP still freezes P
            sources, partial = sources + (partial,), None
        if self.boundary(k + 2):  # next-output rule: identity on the newest source
            if partial is not None:
                sources = sources + (partial,)
            return BlockState(sources, None, k + 2, sources[-1], True)
        sources, partial, mix, boundary = self.read_at(sources, partial, k + 2, self.layers[b].out_mix, b + 1, 0)
        return BlockState(sources, partial, k + 2, mix, boundary)

    def end(self, state):
        return state.mix

    def probe(self, state):
        return state.mix if state.boundary or state.partial is None else state.partial

    def lens(self, state):
        return state.mix


# ---- Hyper-Connections -------------------------------------------------------
# HC and mHC: m residual streams, read / mixed / written by per-token coefficients.

class RoutedLayer(PreNormLayer):
    """Block b of HC/mHC: the two pre-norms and the routing parameters of its attention
    (`attn_route`) and MLP (`mlp_route`) sublayers."""

    def __init__(self, cfg, route):
        super().__init__(cfg)
        self.attn_route = route(cfg)
        self.mlp_route = route(cfg)


class MultiStream(Residual):
    """Base of the m-stream schemes (HC, mHC). State: H (B, T, m, d), m = cfg.hc_streams.

    Per sublayer the subclass computes, per token, from the streams (`coefficients`) the
    read vector A_m (m), the mixing matrix A_r (m x m) and the write vector beta (m), the
    HC paper's names (mHC's H_pre, H_res, H_post), and then

        x = A_m^T H  = sum_s A_m[s] H[s]                                (`read_streams`)
        y = F(RMSNorm(x))
        H' = A_r^T H + beta (x) y:  H'[t] = sum_s A_r[s, t] H[s] + beta[t] y   (`write_streams`)

    (RMSNorm = the sublayer's attn_norm / mlp_norm; A_r^T H is the mix of the streams). The
    routing runs in fp32 with autocast off (the streams are fp32, as Pre-LN's residual
    stream); only the branch F runs under autocast. The embedding is copied into every
    stream. end = the streams H, and `readout` applies the final RMSNorm as cfg.hc_readout says
    ('auto' = the study's code, `default_readout`):
      'norm_sum': sum_s RMSNorm_f(H[s])  (HC: the study's Transformer.forward, collapse 'sum')
      'sum':      RMSNorm_f(sum_s H[s])  (the HC paper's text)
      'mean':     RMSNorm_f(mean_s H[s]) (mHC: the study's Liger backend, collapse 'mean')
    lens = the streams, decoded by `readout` (its KL to the output is 0 after the last block);
    probe = the streams concatenated (B, T, m d); skip = identity on all streams. Trace per
    sublayer: read A_m (B, T, m), mix A_r (B, T, m, m), write beta (B, T, m).
    """

    default_readout = 'sum'  # what hc_readout='auto' means for the subclass (the study's code)

    def __init__(self, cfg, route):
        super().__init__(cfg)
        if cfg.hc_streams < 1:
            raise ValueError(f"hc_streams must be >= 1, got {cfg.hc_streams}")
        if cfg.hc_readout not in ('auto', 'norm_sum', 'sum', 'mean'):
            raise ValueError(f"hc_readout must be 'auto', 'norm_sum', 'sum' or 'mean', got {cfg.hc_readout!r}")
        self.m = cfg.hc_streams
        self.readout_mode = self.default_readout if cfg.hc_readout == 'auto' else cfg.hc_readout
        self.layers = nn.ModuleList([RoutedLayer(cfg, route) for _ in range(cfg.n_layer)])

    def routes(self):
        """(k, route) for every sublayer, k = 2b + j the 0-based sublayer index."""
        for b, p in enumerate(self.layers):
            yield 2 * b, p.attn_route
            yield 2 * b + 1, p.mlp_route

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        if self.cfg.hc_out_init_scale:  # the study's scale_output_init_by_sqrt_n
            for blk in model.blocks:
                blk.attn.wo.weight.div_(math.sqrt(self.m))
                blk.mlp.w_down.weight.div_(math.sqrt(self.m))

    def coefficients(self, H, route):
        """H (B, T, m, d) fp32, the sublayer's routing parameters `route` -> A_m (B, T, m),
        A_r (B, T, m, m), beta (B, T, m), fp32."""
        raise NotImplementedError

    def read_streams(self, H, A_m):
        """x = A_m^T H = sum_s A_m[s] H[s]: (B, T, m, d), (B, T, m) -> (B, T, d)."""
        return torch.einsum('bts,btsd->btd', A_m, H)

    def write_streams(self, H, A_r, beta, y):
        """H' = A_r^T H + beta (x) y, H'[t] = sum_s A_r[s, t] H[s] + beta[t] y:
        (B, T, m, d), (B, T, m, m), (B, T, m), (B, T, d) -> (B, T, m, d)."""
        return torch.einsum('btsu,btsd->btud', A_r, H) + beta.unsqueeze(-1) * y.unsqueeze(-2)

    def sublayer(self, H, b, j, route, norm, f):
        with no_autocast(H):
            A_m, A_r, beta = self.coefficients(H, route)
            x = self.read_streams(H, A_m)                           # (B, T, d)
        self.record(b, j, read=A_m, mix=A_r, write=beta)
        y = f(norm(x))                                              # the branch, under autocast if on
        with no_autocast(H):
            return self.write_streams(H, A_r, beta, y.to(H.dtype))  # (B, T, m, d)

    def begin(self, x):
        return x.unsqueeze(-2).repeat(1, 1, self.m, 1)  # (B, T, m, d), m copies of the embedding

    def block(self, H, b, layer, rope):
        p = self.layers[b]
        H = self.sublayer(H, b, 0, p.attn_route, p.attn_norm, lambda x: layer.attn(x, rope))
        return self.sublayer(H, b, 1, p.mlp_route, p.mlp_norm, layer.mlp)

    def reduce(self, H):
        """The study's reduce_residual_streams: (B, T, m, d) -> (B, T, d), mean or sum."""
        return H.mean(-2) if self.readout_mode == 'mean' else H.sum(-2)

    @property
    def readout_weight(self):
        """Each stream's weight in the readout before the final norm (path weights, probe.py):
        1/m when `reduce` averages the streams, else 1."""
        return 1.0 / self.m if self.readout_mode == 'mean' else 1.0

    def readout(self, H, norm):
        assert H.dim() == 4 and H.size(-2) == self.m, "a multi-stream readout state is (B, T, m, d)"
        if self.readout_mode == 'norm_sum':
            return norm(H).sum(-2)                             # (B, T, d)
        return norm(self.reduce(H))

    def probe(self, H):
        return H.flatten(-2)                                   # (B, T, m d)


class HCRoute(nn.Module):
    """Routing parameters of one HC sublayer (HC's equations): static_alpha (m, m+1), the
    static [A_m | A_r], and static_beta (m); the dynamic projections dynamic_alpha (d, m+1)
    and dynamic_beta (d); the scalar scales alpha_scale, beta_scale."""

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
    """Hyper-Connections (Zhu et al., arXiv 2409.19606, dynamic variant; paper Appendix A).

    m streams H (B, T, m, d). Sublayer k, with H_bar = RMS(H) per stream (no weight, eps 1e-8),
    the paper's W_alpha = dynamic_alpha, s_alpha = alpha_scale (and so for beta):

        [A_m | A_r] = static_alpha + alpha_scale * tanh(H_bar dynamic_alpha)   (m, m+1) per token
        beta        = static_beta  + beta_scale  * tanh(H_bar dynamic_beta)    (m)         (`coefficients`)
        x = A_m^T H                                                                        (`read_streams`)
        f = F(RMSNorm(x))
        H' = A_r^T H + beta (x) f                                                          (`write_streams`)

    read_streams and write_streams are MultiStream's (shared with mHC). The coefficients
    come from the normalised streams but multiply the raw ones. To change beta for HC alone,
    change the beta that HC.coefficients returns (e.g. `beta = 0.5 * (route.static_beta + ...)`):
    it is computed here and only applied in write_streams, which mHC runs too, so an edit
    there changes mHC's H_post as well. (With --fast, start-up checks the fast form of
    HC.coefficients against the edited one and stops in one line: run --fast=False.) Init: A_m = one-hot
    e_{k mod m} (k = 2b + j), A_r = I, beta = 1, dynamic_alpha = dynamic_beta = 0,
    alpha_scale = beta_scale = 0.01, and (cfg.hc_out_init_scale, the study's default) attention-out
    and SwiGLU-down init divided by sqrt(m): every stream then equals Pre-LN's h with the same
    (rescaled) backbone. Extra parameters per sublayer: (m+2)(m+d) + 2. Weight decay: static_alpha
    and static_beta are exempt (the study's hyper_connections_common.py). A_r is applied (one
    public version of the code computed it and dropped it). Readout: 'norm_sum' by default.
    """

    default_readout = 'norm_sum'  # the study's Transformer.forward (collapse 'sum')

    def __init__(self, cfg):
        super().__init__(cfg, HCRoute)

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        m = self.m
        for k, route in self.routes():
            route.static_alpha.zero_()
            route.static_alpha[k % m, 0] = 1.0                  # A_m: read stream k mod m
            route.static_alpha[:, 1:] = torch.eye(m)            # A_r: identity
            route.static_beta.fill_(1.0)
            route.dynamic_alpha.zero_()
            route.dynamic_beta.zero_()
            route.alpha_scale.fill_(0.01)
            route.beta_scale.fill_(0.01)

    def no_weight_decay(self):
        return {f'layers.{b}.{s}_route.{n}' for b in range(len(self.layers))
                for s in ('attn', 'mlp') for n in ('static_alpha', 'static_beta')}

    def coefficients(self, H, route):
        H_bar = F.rms_norm(H, (H.size(-1),), eps=1e-8)                                     # (B, T, m, d)
        A = route.static_alpha + route.alpha_scale * torch.tanh(H_bar @ route.dynamic_alpha)  # (B, T, m, m+1)
        beta = route.static_beta + route.beta_scale * torch.tanh(H_bar @ route.dynamic_beta)  # (B, T, m)
        A_m, A_r = A[..., 0].contiguous(), A[..., 1:].contiguous()  # contiguous: the CPU batched matmul's fast path
        return A_m, A_r, beta


class MHCRoute(nn.Module):
    """Routing parameters of one mHC sublayer: projection phi (m d, m^2 + 2m) and bias
    (m^2 + 2m), columns [pre (m) | post (m) | res (m^2, row-major (in, out))], and the
    scalar gates alpha_pre, alpha_post, alpha_res."""

    def __init__(self, cfg):
        super().__init__()
        m, d = cfg.hc_streams, cfg.n_embd
        self.phi = nn.Parameter(torch.zeros(m * d, m * m + 2 * m))
        self.bias = nn.Parameter(torch.zeros(m * m + 2 * m))
        self.alpha_pre = nn.Parameter(torch.tensor(0.01))
        self.alpha_post = nn.Parameter(torch.tensor(0.01))
        self.alpha_res = nn.Parameter(torch.tensor(0.01))


LIGER_SINKHORN_EPS = 1e-6  # liger_kernel's mHC sinkhorn_eps (the study's default backend)


def sinkhorn(logits, iters, order='liger', eps=LIGER_SINKHORN_EPS, rounds=None):
    """Sinkhorn-Knopp: exp(logits) (..., m_in, m_out) -> an approximately doubly stochastic
    P (mHC, arXiv 2512.24880), `iters` rounds of two normalisations: round 1 here, rounds
    2..iters in `sinkhorn_rounds`, a loop over one `sinkhorn_round` (the whole algorithm is
    these three functions, one below the other).
    order 'liger' (the study's default backend, liger_kernel ops/mhc.py, which stores H_res
        (out, in)): the sums over inputs (per output) first, over outputs (per input) last;
    order 'plain' (its PyTorch backend's sinkhorn_log): over outputs first, inputs last.
    eps > 0 (liger_kernel's, with order 'liger'): a stable softmax first, then eps added to
    every entry and every denominator; eps = 0 (the PyTorch backend's): the first round in
    the log domain, so that no sum is ever 0 whatever the logits' range.
    rounds: what runs rounds 2..iters, (P, n, first, last, eps) -> P; default
    `sinkhorn_rounds` (MHC passes its compiled region, MHC.sinkhorn_rounds).
    Raises ValueError for iters not an int >= 1, an unknown order or eps < 0."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"Sinkhorn needs an int number of rounds >= 1, got {iters!r}")
    if order not in ('liger', 'plain') or not eps >= 0:
        raise ValueError(f"Sinkhorn order must be 'liger' or 'plain' and eps >= 0, got {order!r}, {eps!r}")
    first, last = (-2, -1) if order == 'liger' else (-1, -2)
    if eps > 0:                                                # round 1
        P = torch.softmax(logits, dim=first) + eps
        P = P / (P.sum(last, keepdim=True) + eps)
    else:
        P = torch.softmax(torch.log_softmax(logits, dim=first), dim=last)
    return (rounds or sinkhorn_rounds)(P, iters - 1, first, last, eps)  # rounds 2..iters


def sinkhorn_rounds(P, n, first, last, eps):
    """n Sinkhorn rounds on P (..., m, m), each a normalisation over dim `first`, then `last`."""
    for _ in range(n):
        P = sinkhorn_round(P, first, last, eps)
    return P


# torch.compile builds one round and calls it n times; unrolled, inductor fuses all rounds
# into one large kernel that takes longer to compile than a whole Pre-LN block. Eagerly this
# is a plain call.
@torch.compiler.nested_compile_region
def sinkhorn_round(P, first, last, eps):
    """One Sinkhorn round on P (..., m, m): normalise over dim `first`, then over `last`."""
    P = P / (P.sum(first, keepdim=True) + eps)
    return P / (P.sum(last, keepdim=True) + eps)


class MHC(MultiStream):
    """Manifold-Constrained Hyper-Connections (DeepSeek, arXiv 2512.24880; paper Appendix A).

    m streams H (B, T, m, d). Sublayer k, with x' = RMS(vec H) (one statistic over all m d
    numbers, no weight, eps cfg.norm_eps) and [l_pre | l_post | l_res] = x' phi (no tanh):

        H_pre  = sigmoid(alpha_pre * l_pre + b_pre)                  (m)
        H_post = 2 sigmoid(alpha_post * l_post + b_post)             (m)
        H_res  = Sinkhorn(alpha_res * mat(l_res) + b_res)            (m x m), cfg.mhc_sinkhorn_iters rounds
        u = sum_i H_pre[i] H[i]                                      (`read_streams`)
        f = F(RMSNorm(u))
        H'[j] = sum_i H_res[i, j] H[i] + H_post[j] f                 (`write_streams`)

    `coefficients` computes H_pre, H_res, H_post; read_streams and write_streams are
    MultiStream's, which names them as HC does (A_m = H_pre, A_r = H_res, beta = H_post).
    H_res[i, j] is the weight of old stream i in new stream j, stored (in, out); mat(l_res)
    and b_res fill it row-major. Sinkhorn order cfg.mhc_sinkhorn: 'liger' (default, the
    study's backend) or 'plain' (its PyTorch backend), see `sinkhorn`; docs/fidelity.md has
    how far they differ. Readout 'auto': the mean of the streams, then the final RMSNorm.
    Init cfg.mhc_init, all with b_pre = +8 on stream k mod m and -8 elsewhere, b_post = 0,
    gates 0.01: 'gap8' (default, the study's newest code): phi = 0, b_res 0 on the diagonal
    and -8 off it; 'gap8_diag8' (its earlier code): b_res +8 / -8; 'uniform': phi ~ N(0, 0.02^2),
    b = 0. Extra parameters per sublayer: (m d + 1)(m^2 + 2m) + 3. Weight decay: phi decays; the
    bias and the three gates are exempt. The study keeps phi and the streams in bf16; here
    weights are fp32 and the routing runs in fp32.
    """

    default_readout = 'mean'  # the study's Liger backend, collapse 'auto'
    # GPT.compile_regions compiles Sinkhorn rounds 2..iters (many tiny ops eagerly); the projection,
    # gates and first normalisation stay eager: compiled, they would add kernels to compile.
    regions = {'sinkhorn_rounds': []}
    sinkhorn_rounds = staticmethod(sinkhorn_rounds)  # the region: an attribute, so that it can be compiled

    def __init__(self, cfg):
        if cfg.mhc_init not in ('gap8', 'gap8_diag8', 'uniform'):
            raise ValueError(f"mhc_init must be 'gap8', 'gap8_diag8' or 'uniform', got {cfg.mhc_init!r}")
        if cfg.mhc_sinkhorn not in ('liger', 'plain'):
            raise ValueError(f"mhc_sinkhorn must be 'liger' or 'plain', got {cfg.mhc_sinkhorn!r}")
        if isinstance(cfg.mhc_sinkhorn_iters, bool) or not isinstance(cfg.mhc_sinkhorn_iters, int) \
                or cfg.mhc_sinkhorn_iters < 1:
            raise ValueError(f"mhc_sinkhorn_iters must be an int >= 1, got {cfg.mhc_sinkhorn_iters!r}")
        super().__init__(cfg, MHCRoute)

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        m = self.m
        for k, route in self.routes():
            for g in (route.alpha_pre, route.alpha_post, route.alpha_res):
                g.fill_(0.01)
            route.bias.zero_()
            if self.cfg.mhc_init in ('gap8', 'gap8_diag8'):
                route.phi.zero_()
                b_pre, b_res = route.bias[:m], route.bias[2 * m:].view(m, m)
                b_pre.fill_(-8.0)
                b_pre[k % m] = 8.0
                b_res.fill_(-8.0).fill_diagonal_(0.0 if self.cfg.mhc_init == 'gap8' else 8.0)
            else:
                nn.init.normal_(route.phi, std=0.02)

    def no_weight_decay(self):
        return {f'layers.{b}.{s}_route.{n}' for b in range(len(self.layers)) for s in ('attn', 'mlp')
                for n in ('bias', 'alpha_pre', 'alpha_post', 'alpha_res')}

    def coefficients(self, H, route):
        B, T, m, d = H.shape
        x_norm = F.rms_norm(H.reshape(B, T, m * d), (m * d,), eps=self.cfg.norm_eps)  # x' = RMS(vec H)
        l_pre, l_post, l_res = (x_norm @ route.phi).split([m, m, m * m], dim=-1)      # x' phi
        b_pre, b_post, b_res = route.bias.split([m, m, m * m])
        H_pre = torch.sigmoid(route.alpha_pre * l_pre + b_pre)                        # (B, T, m)
        H_post = 2 * torch.sigmoid(route.alpha_post * l_post + b_post)                # (B, T, m)
        order = self.cfg.mhc_sinkhorn                                                 # 'liger' with eps, or 'plain'
        H_res = sinkhorn((route.alpha_res * l_res + b_res).view(B, T, m, m), self.cfg.mhc_sinkhorn_iters, order,
                         LIGER_SINKHORN_EPS if order == 'liger' else 0.0, rounds=self.sinkhorn_rounds)
        return H_pre, H_res, H_post                                                   # A_m, A_r, beta


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
    """Sandwich-LN (CogView, arXiv 2105.13290; the study's Peri-LN block), paper Table 1:

        h <- h + RMSNorm_out(F(RMSNorm_in(h)))

    One extra RMSNorm (gain 1) on every sublayer's output and none on the embedding:
    +2Ld parameters over Pre-LN."""

    unit_paths = True  # the sublayer's output, RMSNorm_out(F), is added with weight 1

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = per_block(cfg, norm=rmsnorm, out_norm=rmsnorm)

    def sublayer(self, h, b, j, f):
        p = self.layers[b]
        return h + p.get('out_norm', j)(f(p.get('norm', j)(h)))


class LNS(PreLN):
    """LayerNorm Scaling ("The Curse of Depth in LLMs", arXiv 2502.05795), paper Table 1:

        h <- h + F(RMSNorm(h) / sqrt(b + 1))

    for both sublayers of block b (0-based, so the divisor is the root of the 1-based
    index). The factor is a constant of block b, not a parameter; it travels with the
    block when an order moves it (docs/probes.md, swap rule, as in the study's release). The final norm is
    unscaled. No parameters beyond Pre-LN's: with L = 1 it is Pre-LN."""

    peak_lr = 1e-2  # paper Table 4
    unit_paths = True  # the factor scales the branch's input; the add keeps weight 1

    def sublayer(self, h, b, j, f):
        scale = 1.0 / math.sqrt(b + 1)
        return super().sublayer(h, b, j, lambda x: f(x * scale))


class PostLN(SingleStream):
    """Post-LN (Vaswani et al. 2017, arXiv 1706.03762), a classic beyond the paper's ten (docs/schemes.md):

        h <- LN(alpha * h + F(h)),   alpha = 1, LN = RMSNorm

    The block norms (attn_post_norm, mlp_post_norm) follow the residual add, so every
    block output is normalised and is the probe and lens state (docs/probes.md, depth states). The
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
    """DeepNorm (DeepNet, arXiv 2203.00555, Eq. of §3; reference microsoft/torchscale), paper Table 1:

        h <- LN(alpha * h + F(h)),   alpha = (2L)^(1/4)

    Post-LN with an up-weighted residual; LN is LayerNorm without bias (gain only, so the
    same parameter count as Pre-LN). Init (`init_weights`): the value and output
    projections of attention and all three SwiGLU matrices are multiplied by
    beta = (8L)^(-1/4) after the default init, so their std is beta * init_std; the query
    and key projections keep init_std."""

    peak_lr = 1e-3  # paper Table 4: at 2e-3 it diverged in the study

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
    """KEEL ("Post-LayerNorm Is Back", arXiv 2601.19895), paper Table 1:

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
    pre-norm variant (paper Appendix A). Pre-LN residual adds,

        h <- h + Attn_depth(RMSNorm(h)),   h <- h + MLP(RMSNorm(h)),

    where the attention of the block at position p also attends, in the same softmax, to
    the 2p depth slots of the same token (`attention`), both score sets scaled by 1/sqrt(hd).
    A per-token depth cache of 2L slots (B, H_kv, T, hd), zero-filled when created:
      slot 2p   = the block's own attention key and value, W_k x and W_v x (before RoPE);
      slot 2p+1 = W_kv RMSNorm(h), the block's FFN input through depth_kv, on blocks 0..L-2.
    Extra parameters (L - 1) * 2d * H_kv * hd. Position 0 reads no depth slots: plain causal
    attention. Slots are positional (p = blocks run or skipped so far), as in the study,
    where swaps exchange weights and positions stay.

    State (h, depth K, depth V, p); K and V are tuples of 2L slots, a write replaces a
    slot's reference (never in place). probe = lens = h. Skip rule (docs/probes.md): a
    skipped block leaves h unchanged and writes nothing into its two slots, which stay zero
    and still take softmax mass exp(q . 0) = 1 with a zero value. use_depth=False masks out
    every depth score: the model is then Pre-LN with unused W_kv (equivalence tests, ablations).
    KV cache (model.KVCache): only the sequence keys and values, as Pre-LN. A token's depth
    slots are read only by its own later blocks, so a generation step builds them afresh for
    its new tokens (begin) and drops them after the last block; the cached tokens' slots are
    never needed again (cost.kv_cache_bytes; prefill=True counts the slots of a prefill)."""

    unit_paths = True  # Pre-LN's adds: the depth attention is inside the attention branch
    regions = {'attention': [(3, 3), (4, 3)]}  # depth_k, depth_v (B, H_kv, T, S, hd): S grows

    def __init__(self, cfg, use_depth=True):
        super().__init__(cfg)
        self.use_depth = use_depth
        self.layers = nn.ModuleList([MoDALayer(cfg, b < cfg.n_layer - 1) for b in range(cfg.n_layer)])

    def notes(self):
        """With one block MoDA has no depth: the block reads no slots and writes none."""
        if self.cfg.n_layer == 1:
            return ["MoDA with n_layer=1: its one block reads no depth slots (plain causal attention)"]
        return []

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        std = self.cfg.init_std
        for p in self.layers:
            if p.depth_kv is not None:  # like every backbone Linear
                nn.init.trunc_normal_(p.depth_kv.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def attention(self, q, k, v, depth_k, depth_v):
        """One softmax over the causal sequence keys and the S depth keys of the same token:
            a_t = softmax([q_t . k_s, s <= t | q_t . K_depth[t, j], j < S] / sqrt(hd)),
            y_t = sum_s a_ts v_s + sum_j a_tj V_depth[t, j].
        q (B, H, T, hd) and k (B, H_kv, Tk, hd) after RoPE, v (B, H_kv, Tk, hd), Tk >= T: the
        queries are the last T of the Tk sequence positions (Tk = T but in cached generation,
        where k and v start with the cached tokens'); depth_k and depth_v (B, H_kv, T, S, hd),
        S >= 1, the query tokens' own; query head i reads key/value head i // (H / H_kv).
        Returns y (B, H, T, hd). The scores are an explicit (Tk + S)-column matrix per query."""
        B, H, T, hd = q.shape
        Hkv, Tk = k.size(1), k.size(2)
        q = q.view(B, Hkv, H // Hkv, T, hd) * hd ** -0.5                         # (B, H_kv, G, T, hd)
        seq = q @ k.unsqueeze(2).transpose(-1, -2)                                # (B, H_kv, G, T, Tk)
        seq = seq.masked_fill(~torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T), float('-inf'))
        dep = torch.einsum('bkgtd,bktsd->bkgts', q, depth_k)                     # (B, H_kv, G, T, S)
        scores = torch.cat((seq, dep), dim=-1)                                    # (B, H_kv, G, T, Tk + S)
        a = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), dim=-1).to(q.dtype)
        a_seq, a_dep = a.split([Tk, dep.size(-1)], dim=-1)
        y = a_seq.contiguous() @ v.unsqueeze(2) + torch.einsum('bkgts,bktsd->bkgtd', a_dep, depth_v)
        return y.reshape(B, H, T, hd)

    def begin(self, x):
        cfg = self.cfg
        B, T, _ = x.shape
        zero = x.new_zeros(B, cfg.n_kv_head, T, cfg.n_embd // cfg.n_head)  # (B, H_kv, T, hd)
        slots = (zero,) * (2 * cfg.n_layer)
        return x, slots, slots, 0

    def block(self, state, b, layer, rope):
        h, K, V, p = state
        if 2 * p + 2 > len(K):
            raise ValueError(f"MoDA's depth cache has {len(K)} slots: an order may run or skip "
                             f"at most n_layer={self.cfg.n_layer} blocks")
        B, T, _ = h.shape
        attn, prm = layer.attn, self.layers[b]
        q, k, v = attn.qkv(prm.attn_norm(h))  # (B, H, T, hd), (B, H_kv, T, hd) x2, before RoPE
        qr, kr = attn.rotate(q, rope), attn.rotate(k, rope)
        ks, vs = attn.context(kr, v)          # the sequence's keys, values: kr, v; in generation after the cached ones
        S = 2 * p if self.use_depth else 0    # the depth slots this block reads
        if S == 0:
            y = attn.attend(qr, ks, vs)       # plain causal attention
        elif ks.size(2) == qr.size(2):
            y = self.attention(qr, ks, vs, torch.stack(K[:S], dim=3), torch.stack(V[:S], dim=3))
        else:  # queries after cached keys: the plain method (fast paths and the compiled region take T x T)
            y = type(self).attention(self, qr, ks, vs, torch.stack(K[:S], dim=3), torch.stack(V[:S], dim=3))
        h = h + attn.out(y)
        K, V = put_slot(K, 2 * p, k), put_slot(V, 2 * p, v)
        x = prm.mlp_norm(h)
        if prm.depth_kv is not None:
            dk, dv = prm.depth_kv(x).view(B, T, 2, K[0].size(1), -1).permute(2, 0, 3, 1, 4)  # 2x (B, H_kv, T, hd)
            K, V = put_slot(K, 2 * p + 1, dk), put_slot(V, 2 * p + 1, dv)
        return h + layer.mlp(x), K, V, p + 1

    def skip(self, state, b):
        h, K, V, p = state
        if 2 * p + 2 > len(K):
            raise ValueError(f"MoDA's depth cache has {len(K)} slots: an order may run or skip "
                             f"at most n_layer={self.cfg.n_layer} blocks")
        return h, K, V, p + 1

    def end(self, state):
        return state[0]

    def probe(self, state):
        return state[0]

    def lens(self, state):
        return state[0]


def put_slot(slots, i, t):
    """A copy of the tuple `slots` with slot i replaced by t (the cache is never mutated)."""
    return slots[:i] + (t,) + slots[i + 1:]


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
