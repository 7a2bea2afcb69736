"""
The residual schemes of DepthBench (paper Table 1, Appendix A; docs/schemes.md): one class each, one
registry `RESIDUALS` (name -> class) that `GPTConfig.residual` selects from.

A scheme owns the wiring between the 2L branches of the backbone (model.py holds the
branches without norms): its norms, its extra parameters, its state (one residual
stream, m streams, or the history of sources), its readout and where the final norm goes.
The math that AttnRes, HC/mHC and MoDA are built on (depth softmax, routing projection,
Sinkhorn, joint depth attention), with its hand-written backwards, is in ops.py.

The interface every scheme implements (`Residual`):

    state = begin(x)                     x: token embedding (B, T, d)
    state = block(state, b, layer, rope) run block b: layer.attn(x, rope), layer.mlp(x)
    state = skip(state, b)               the study's "skip block b" rule (docs/probes.md, skip rule)
    h     = end(state)                   the readout state: (B, T, d), or HC/mHC's streams (B, T, m, d)
    y     = readout(h, norm_f)           (B, T, d), the LM head's input: the final RMSNorm applied
                                         where the scheme applies it (default norm_f(h); HC: on
                                         each stream, then summed, as the study's code does)
    probe(state), lens(state)            the depth state z_l and the LogitLens readout r_l
                                         after the blocks run so far (docs/probes.md, depth and lens states)

Parameters of block b live in `self.layers[b]` (and are looked up by b, never by the
position in the order), so when a diagnostic swaps two blocks, each block's weights,
norms and routing parameters travel with it (docs/probes.md, swap rule).

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

from model import RMSNorm, apply_rope
from ops import (NormedProjection, check_sinkhorn_iters, depth_attention, depth_mix, no_autocast, open_route,
                 route_write, sinkhorn_leading)


class Residual(nn.Module):
    """Base class of the schemes. Subclasses implement begin/block/end and may override
    skip/probe/lens. The default state is one residual stream h (B, T, d)."""

    peak_lr = 2e-3  # the study's peak learning rate for this scheme (paper Sec. 2.3, Table 4)

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

    def route_bytes_per_token(self, compiled=True):
        """Bytes per token of one gradient of this scheme's route, the way its depth reads
        return their sources' gradients (ops.open_route) in a training step under
        torch.compile (compiled=True) or eagerly; 0 for schemes without one there.
        cost.train_memory counts the backward's workspace from it."""
        return 0

    def no_weight_decay(self):
        """Names (relative to this module) of the parameters exempt from weight decay in
        every mode of GPT.configure_optimizers (the study's exemptions: HC/mHC static
        routing). Default: none, every parameter of the scheme decays as in the study."""
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
        """The LM head's input (B, T, d) from a readout state h (`end`'s result, or a `lens`
        state): the final RMSNorm `norm` (the model's norm_f) applied where this scheme
        applies it. Default: norm(h)."""
        return norm(h)

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
    return torch.nn.functional.rms_norm(x, (x.size(-1),), norm.weight.to(x.dtype), eps)


def inv_rms(v, eps):
    """1 / sqrt(mean(v^2) + eps) over the last dim, in fp32: v (B, T, d) -> (B, T, 1)."""
    return torch.rsqrt(v.float().pow(2).mean(-1, keepdim=True) + eps)


class DepthMixer(nn.Module):
    """One AttnRes read: a pseudo-query w (d, zero init) and a key-norm gain g (d, init 1)."""

    def __init__(self, cfg):
        super().__init__()
        self.eps = cfg.attnres_eps
        self.query = nn.Parameter(torch.zeros(cfg.n_embd))
        self.key_norm = RMSNorm(cfg.n_embd, cfg.attnres_eps)  # its eps is the 1/rms the state carries

    def forward(self, sources, inv_rmses, route=None, routed=None):
        """(z, a, the route after the read: None without one), `ops.depth_mix`'s."""
        out = depth_mix(sources, inv_rmses, self.query, self.key_norm.weight, route, routed)
        return out if route is not None else (*out, None)


class AttnResLayer(PreNormLayer):
    """Block b of AttnRes: the two pre-norms, the mixer that reads the MLP input, and the
    mixer that reads block b's *output*: the input of block b+1's attention, or, for the
    last block, the final aggregator. (Block 0's attention reads the embedding directly,
    so every read has exactly one owner and a swap moves a block's MLP-side and
    output-side mixers with it, as the swap rule of docs/probes.md says.)"""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.mlp_mix = DepthMixer(cfg)
        self.out_mix = DepthMixer(cfg)


class AttnRes(Residual):
    """Full Attention Residuals (arXiv 2603.15031; paper Appendix A).

    Sources v_0 = token embedding, v_{k+1} = raw output of sublayer k. Sublayer k reads

        z_k = sum_{i<=k} a_ki v_i,  a_k = softmax_i(w_k^T RMSNorm_key,k(v_i)),   f_k = F_k(RMSNorm_pre,k(z_k))

    with a zero-initialised pseudo-query w_k (d): at init every read is the mean of its
    sources, whose RMSNorm equals Pre-LN's (up to eps). Block 0's attention reads
    RMSNorm(v_0) and has no depth parameters; a final aggregator mixes all 2L+1 sources
    into the input of the final RMSNorm. Extra parameters: 2d per read, 4Ld in all.

    Epsilons, as in the study's code (its fused kernel kernels/attnres.py takes one eps, that
    of the key norm, OLMo-core's RMSNorm default 1e-5): the key norms, the RMSNorm_pre,k on
    each read's result (with the sublayer's own attn_norm / mlp_norm gain) and the final
    norm (with norm_f's gain, `readout`) use cfg.attnres_eps; block 0's attention norm on
    the embedding alone keeps cfg.norm_eps (1e-6). attnres_eps = norm_eps gives one eps.

    State: (sources, their 1/rms, mix, route) where mix is the raw depth mix the next block's
    attention reads (probe and lens state z_l, docs/probes.md, depth and lens states) and
    route is None (no gradient, or ops.UNROLL_DEPTH_READS), else the route of the sources'
    gradients (ops.open_route: source i on slot i), which makes every read one op of the
    compiled graph and, eagerly, adds every read's gradients into one buffer in place.
    Skip rule (docs/probes.md): a skipped block adds no sources, and the next read is the
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

    def route_slots(self):
        """Sources a forward pass can hold: the embedding and the 2L sublayer outputs."""
        return 2 * self.cfg.n_layer + 1

    def route_bytes_per_token(self, compiled=True):
        return self.route_slots() * (self.cfg.n_embd + 1) * 4  # slots of [v_i, 1/rms_i], fp32; eager too

    def begin(self, x):
        sources, inv_rmses, route = self.add_source((), (), open_route(x, self.route_slots(), x.size(-1) + 1, eager=True), x)
        return sources, inv_rmses, x, route

    def attn_input(self, p, mix, embedding_only):
        """The attention input of a block with parameters p: its attn_norm on the embedding
        alone (the study's block 0, eps cfg.norm_eps), else on a read's result (attnres_eps)."""
        return p.attn_norm(mix) if embedding_only else rms_norm_eps(mix, p.attn_norm, self.cfg.attnres_eps)

    def add_source(self, sources, inv_rmses, route, f):
        """Appends source f, its 1/rms and its slot on the route (if any)."""
        s = inv_rms(f, self.cfg.attnres_eps)
        return sources + (f,), inv_rmses + (s,), route_write(route, len(sources), f, s)

    def block(self, state, b, layer, rope):
        sources, inv_rmses, mix, route = state
        p, eps = self.layers[b], self.cfg.attnres_eps
        f = layer.attn(self.attn_input(p, mix, len(sources) == 1), rope)
        sources, inv_rmses, route = self.add_source(sources, inv_rmses, route, f)
        z, a, route = p.mlp_mix(sources, inv_rmses, route)
        self.record(b, 1, weights=a)
        f = layer.mlp(rms_norm_eps(z, p.mlp_norm, eps))
        sources, inv_rmses, route = self.add_source(sources, inv_rmses, route, f)
        mix, a, route = p.out_mix(sources, inv_rmses, route)
        self.record(b + 1, 0, weights=a)  # the read of the next block's attention (or the final one)
        return sources, inv_rmses, mix, route

    def skip(self, state, b):
        sources, inv_rmses, _, route = state
        return sources, inv_rmses, sources[-1], route

    def end(self, state):
        return state[2]

    def readout(self, h, norm):
        return rms_norm_eps(h, norm, self.cfg.attnres_eps)  # the study fuses it into the last read

    def probe(self, state):
        return state[2]

    def lens(self, state):
        return state[2]


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

    Per sublayer the subclass computes, per token, a read vector r (m), a mixing matrix
    M (m x m) and a write vector w (m) from the streams, and then

        x = sum_s r[s] H[s],   y = F(RMSNorm(x)),   H'[t] = sum_s M[s, t] H[s] + w[t] y

    (RMSNorm = the sublayer's ordinary pre-norm attn_norm / mlp_norm). Read and mix are one
    batched matmul [r | M]^T H (under torch.compile: the same product written as a broadcast
    multiply summed over the streams, which inductor fuses into one pass). The embedding is
    copied into every stream. end = the streams H (B, T, m, d), and `readout` applies the
    final RMSNorm as cfg.hc_readout says ('auto' = the study's code, `default_readout`):
      'norm_sum': sum_s RMSNorm_f(H[s])  (HC: the study's Transformer.forward, collapse 'sum',
                  puts lm_head.norm on each stream and sums; the HC paper's text sums first)
      'sum':      RMSNorm_f(sum_s H[s])  (that paper text; equal to 'mean' up to the norm's eps)
      'mean':     RMSNorm_f(mean_s H[s]) (mHC: the study's Liger backend, collapse 'mean')
    lens = the streams too, so LogitLens decodes a depth state exactly as the head decodes
    the last one (its KL to the output is 0 after the last block). The study's analysis
    code (depth_probes.decode_readout) instead decodes RMSNorm_f(reduce(H)), the sum (the
    mean for mHC); for HC that differs from its own readout. probe = the m streams
    concatenated (B, T, m d) (docs/probes.md, depth states); skip = identity on all streams, no mixing
    and no write (docs/probes.md, skip rule). Trace per sublayer: read r (B, T, m), mix M (B, T, m, m) with new
    stream t = sum_s M[s, t] H[s], write w (B, T, m).

    The routing runs with autocast off, in the streams' dtype (fp32 under bf16 autocast,
    as Pre-LN's residual stream is); only the branch F runs under autocast.
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
        if self.cfg.hc_out_init_scale:  # the study's scale_output_init_by_sqrt_n: m streams each receive the branch output
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
        return H                                                # (B, T, m, d), read by `readout`

    def reduce(self, H):
        """The study's reduce_residual_streams: (B, T, m, d) -> (B, T, d), mean or sum."""
        return H.mean(-2) if self.readout_mode == 'mean' else H.sum(-2)

    def readout(self, H, norm):
        assert H.dim() == 4 and H.size(-2) == self.m, "a multi-stream readout state is (B, T, m, d)"
        if self.readout_mode == 'norm_sum':
            return norm(H).sum(-2)                              # (B, T, d)
        return norm(self.reduce(H))

    def probe(self, H):
        return H.flatten(-2)                                    # (B, T, m d)

    def lens(self, H):
        return H                                                # (B, T, m, d), decoded by `readout`


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

    """Hyper-Connections (Zhu et al., arXiv 2409.19606, dynamic variant; paper Appendix A).

    m streams H (B, T, m, d). Sublayer k, with H_bar = RMS(H) per stream (no weight, eps 1e-8):

        [A_m | A_r] = static_alpha + s_alpha * tanh(H_bar W)      (m, m+1) per token
        beta        = static_beta  + s_beta  * tanh(H_bar w_beta) (m)
        x = A_m^T H,   f = F(RMSNorm(x)),   H' = A_r^T H + beta (x) f

    The coefficients come from the normalised streams but multiply the raw ones; W and
    w_beta are one fused (d, m+2) projection. Init: A_m = one-hot e_{k mod m} (k = 2b + j,
    chosen from the block index so that it travels with the block on a swap), A_r = I,
    beta = 1, W = w_beta = 0, s_alpha = s_beta = 0.01, and (cfg.hc_out_init_scale, on by
    default: the study's scale_output_init_by_sqrt_n) attention-out and SwiGLU-down init
    divided by sqrt(m). Every stream then equals the h of Pre-LN run with the same
    (rescaled) backbone weights, so the default readout, the final norm on each stream
    summed, gives m times that Pre-LN model's logits ('sum' readout: exactly its logits).
    Extra parameters per sublayer: m(m+1) + d(m+1) + 1 + m + d + 1 = (m+2)(m+d) + 2.
    Weight decay (the study's hyper_connections_common.py): static_alpha and static_beta
    are exempt; the dynamic projections and the scales s_alpha, s_beta decay.

    Differences from the study's code: A_r is applied (one public version of
    `hyper_connections.py` computed it and dropped it, though the paper's Fig. 10 effective
    ranks below m imply it acted; the later one applies
    it, as here); the study keeps parameters and streams in bf16, here the weights are fp32
    and the routing runs in the streams' dtype with autocast off (fp32 under bf16 autocast).
    Readout: see MultiStream ('norm_sum', the study's code, by default).
    """

    default_readout = 'norm_sum'  # the study's Transformer.forward (collapse 'sum')

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


LIGER_SINKHORN_EPS = 1e-6  # liger_kernel's mHC sinkhorn_eps (LigerHyperConnection's default, the study's)


class MHC(MultiStream):
    """Manifold-Constrained Hyper-Connections (DeepSeek, arXiv 2512.24880; paper Appendix A).

    m streams H (B, T, m, d). Sublayer k, with x' = RMS(vec H) (one statistic over all m d
    numbers, no weight, eps cfg.norm_eps) and [l_pre | l_post | l_res] = x' phi (no tanh):

        H_pre  = sigmoid(alpha_pre * l_pre + b_pre)                  (m)
        H_post = 2 sigmoid(alpha_post * l_post + b_post)             (m)
        H_res  = Sinkhorn(alpha_res * mat(l_res) + b_res)            (m x m), cfg.mhc_sinkhorn_iters rounds
        u = sum_i H_pre[i] H[i],  f = F(RMSNorm(u)),  H'[j] = sum_i H_res[i, j] H[i] + H_post[j] f

    Layout: H_res[i, j] is the weight of old stream i in new stream j, stored (in, out);
    mat(l_res) and b_res fill it row-major, entry (i, j) at 2m + i m + j. Sinkhorn
    (cfg.mhc_sinkhorn):
      'liger' (default; the study's default backend, liger_kernel's mHC kernels, which
          store H_res (out, in) and normalise their rows first, their columns last): here
          the per-output sums (over i, our columns) first and the per-input sums (over j,
          our rows) last, so every old stream's weights sum to 1 exactly; a stable softmax
          for the first step, 1e-6 added to every entry and to every denominator
          (`ops.sinkhorn` with eps, applied to the transpose);
      'plain' (its PyTorch backend, hyper_connections.py sinkhorn_log, which stores H_res
          (in, out)): per-input sums first, per-output sums last, no eps (every new stream
          a convex combination of the old ones).
    The two orders reach the same doubly stochastic limit; after 20 rounds they differ by
    what the rounds leave unconverged. Max |logit change| of 'plain' against 'liger'
    (tests/test_study_fidelity.py's model: L = 3, d = 32, m = 4; docs/fidelity.md): 6e-7
    at the gap-8 init (H_res ~ I; the eps alone), 4.6e-4 once every parameter is moved
    (off-diagonal logits near -8, diagonal ones spread by ~0.3: Sinkhorn on a
    near-diagonal matrix converges slowly), 3e-6 for the 'uniform' init moved the same
    way; logits with a spread of tens change H_res by > 1e-3 (the eps floor and the order).

    All routing math (RMS, projection, gates, Sinkhorn, the read and mix) in fp32 with
    autocast off. Readout (cfg.hc_readout 'auto'): the mean of the streams, then the final
    RMSNorm, as the study's default (Liger) backend with collapse 'auto' does ('sum' differs
    from it only through the norm's eps). Init cfg.mhc_init, all with phi = 0, b_post = 0,
    b_pre = +8 on stream k mod m and -8 elsewhere (k = 2b + j), gates 0.01:
      'gap8' (default; the study's newest code and its mhc_initialization_test):
          b_res = 0 on the diagonal, -8 off it;
      'gap8_diag8' (its earlier code, hyper_connections.py's PyTorch backend): b_res = +8 on
          the diagonal, -8 off it. H_res is near I either way (entries within 1e-3 of I
          with 0 / -8 at m = 4, 4e-7 with +8 / -8), but the Sinkhorn gradient into the
          off-diagonal logits is ~3000x larger with 0 / -8 (relative weight e^-8, not e^-16);
      'uniform': phi ~ N(0, 0.02^2), b = 0 (H_res ~ uniform, H_pre ~ 0.5, H_post ~ 1).
    So H_pre ~ e_{k mod m}, H_res ~ I, H_post = 1 at the gap-8 inits. Extra parameters per
    sublayer: (m d + 1)(m^2 + 2m) + 3. Weight decay (the study's hyper_connections_common.py,
    Liger names b, alpha_*): phi decays; the bias and the three gates are exempt.

    The coefficients are alpha * x' phi + b for every backend of the study: its Liger
    backend computes mix * alpha + b as here, and its mHC runs with tanh=False (the PyTorch
    backend's tanh is HC's). Remaining difference from the study's default (Liger)
    backend: it keeps phi, the other parameters and the streams in bf16 (here fp32 weights,
    routing in fp32 under bf16 autocast). The eps of RMS(vec H) is cfg.norm_eps (1e-6, the
    Liger backend's; its PyTorch backend uses 1e-8). convert.py maps Liger's (out, in)
    phi columns and b onto ours by transposing the H_res block.
    """

    default_readout = 'mean'  # the study's Liger backend, collapse 'auto'

    def __init__(self, cfg):
        if cfg.mhc_init not in ('gap8', 'gap8_diag8', 'uniform'):
            raise ValueError(f"mhc_init must be 'gap8', 'gap8_diag8' or 'uniform', got {cfg.mhc_init!r}")
        if cfg.mhc_sinkhorn not in ('liger', 'plain'):
            raise ValueError(f"mhc_sinkhorn must be 'liger' or 'plain', got {cfg.mhc_sinkhorn!r}")
        check_sinkhorn_iters(cfg.mhc_sinkhorn_iters, 'mhc_sinkhorn_iters')
        super().__init__(cfg, MHCRoute)

    @torch.no_grad()
    def init_weights(self, model):
        super().init_weights(model)
        m = self.m
        for k, r in self.routes():
            for g in (r.alpha_pre, r.alpha_post, r.alpha_res):
                g.fill_(0.01)
            r.bias.zero_()
            if self.cfg.mhc_init in ('gap8', 'gap8_diag8'):
                r.phi.zero_()
                b_pre, b_res = r.bias[:m], r.bias[2 * m:].view(m, m)
                b_pre.fill_(-8.0)
                b_pre[k % m] = 8.0
                b_res.fill_(-8.0).fill_diagonal_(0.0 if self.cfg.mhc_init == 'gap8' else 8.0)
            else:
                nn.init.normal_(r.phi, std=0.02)

    def no_weight_decay(self):
        return {f'layers.{b}.{s}_route.{n}' for b in range(len(self.layers)) for s in ('attn', 'mlp')
                for n in ('bias', 'alpha_pre', 'alpha_post', 'alpha_res')}

    def coefficients(self, H, r):
        B, T, m, d = H.shape
        with no_autocast(H):
            x = H.float().reshape(B, T, m * d)                                       # vec(H) per token
            logits = NormedProjection.apply(x, r.phi.t().float(), self.cfg.norm_eps)  # x' phi (m^2 + 2m, B, T)
            gate = torch.cat([r.alpha_pre.expand(m), r.alpha_post.expand(m), r.alpha_res.expand(m * m)])
            logits = logits * gate.float().view(-1, 1, 1) + r.bias.float().view(-1, 1, 1)   # alpha x' phi + b
            pre, post, res = logits.split([m, m, m * m])
            res, iters = res.view(m, m, B, T), self.cfg.mhc_sinkhorn_iters            # (in, out, B, T)
            if self.cfg.mhc_sinkhorn == 'liger':  # on the (out, in) transpose: per-output sums first
                H_res = sinkhorn_leading(res.transpose(0, 1), iters, LIGER_SINKHORN_EPS).transpose(0, 1)
            else:                                 # per-input sums first, per-output sums last
                H_res = sinkhorn_leading(res, iters)                                  # (m, m, B, T)
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
    route: torch.Tensor | None = None  # under torch.compile: the route of the frozen sources' gradients


class BlockAttnRes(AttnRes):
    """Block Attention Residuals (arXiv 2603.15031; paper Table 1, Appendix A).

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
    architecture stays fixed: docs/probes.md, swap rule) and a dropped block shifts later positions.

    probe z_l (docs/probes.md, depth states): the raw mix of block l's attention read when that read is
    a boundary, else the running partial sum (the plain block output; the mix if the
    partial sum is empty, which only a skip can cause). lens: the raw mix of block l's
    attention read, for every block (docs/probes.md, lens states). Trace per read: `weights`
    (n_sources, B, T) and `current` (index of P among the sources, -1 if not among them).

    Skip (docs/probes.md, skip rule, adapted): the skipped block adds nothing and passes P through;
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

    def route_slots(self):
        return 2 * self.cfg.n_layer // self.group_size + 1  # the embedding and the frozen block sums

    def freeze(self, sources, inv_rmses, partial, route):
        """Appends the partial sum (if any) to the sources as a frozen block (and to the route)."""
        if partial is None:
            return sources, inv_rmses, route
        return self.add_source(sources, inv_rmses, route, partial)

    def read(self, sources, inv_rmses, partial, route, k, mixer, b, j):
        """The input of sublayer k (recorded as block b, sublayer j): freezes P at a
        boundary, then mixes the embedding, the frozen blocks and P (if non-empty).
        Returns (sources, inv_rmses, partial, route, z (B, T, d), boundary)."""
        boundary = k % self.group_size == 0
        if boundary:
            sources, inv_rmses, route = self.freeze(sources, inv_rmses, partial, route)
            partial = None
        if partial is None:
            z, a, route = mixer(sources, inv_rmses, route)
            current = -1
        else:  # P is not on the route: it changes at every sublayer, and is read once
            z, a, route = mixer(sources + (partial,), inv_rmses + (inv_rms(partial, self.cfg.attnres_eps),),
                                route, len(sources))
            current = len(sources)
        if self.tape is not None:
            self.record(b, j, weights=a, current=torch.tensor(current))
        return sources, inv_rmses, partial, route, z, boundary

    def accumulate(self, sources, partial, f):
        return f.to(sources[0].dtype) if partial is None else partial + f

    def begin(self, x):
        sources, inv_rmses, route = self.add_source((), (), open_route(x, self.route_slots(), x.size(-1) + 1, eager=True), x)
        return BlockState(sources, inv_rmses, None, 0, x, True, route)

    def block(self, state, b, layer, rope):
        sources, inv_rmses, partial, k, mix, _, route = state
        p = self.layers[b]
        x = self.attn_input(p, mix, len(sources) == 1 and partial is None)
        partial = self.accumulate(sources, partial, layer.attn(x, rope))
        sources, inv_rmses, partial, route, z, _ = self.read(sources, inv_rmses, partial, route, k + 1, p.mlp_mix, b, 1)
        partial = self.accumulate(sources, partial, layer.mlp(rms_norm_eps(z, p.mlp_norm, self.cfg.attnres_eps)))
        # the read of the next block's attention, or the final aggregator (recorded as block b+1)
        sources, inv_rmses, partial, route, mix, boundary = self.read(sources, inv_rmses, partial, route, k + 2,
                                                                      p.out_mix, b + 1, 0)
        return BlockState(sources, inv_rmses, partial, k + 2, mix, boundary, route)

    def skip(self, state, b):
        sources, inv_rmses, partial, k, _, _, route = state
        if (k + 1) % self.group_size == 0:  # a boundary at the skipped MLP's position still freezes P
            sources, inv_rmses, route = self.freeze(sources, inv_rmses, partial, route)
            partial = None
        if (k + 2) % self.group_size == 0:  # next-output rule: identity on the newest source
            sources, inv_rmses, route = self.freeze(sources, inv_rmses, partial, route)
            return BlockState(sources, inv_rmses, None, k + 2, sources[-1], True, route)
        sources, inv_rmses, partial, route, mix, boundary = self.read(sources, inv_rmses, partial, route, k + 2,
                                                                      self.layers[b].out_mix, b + 1, 0)
        return BlockState(sources, inv_rmses, partial, k + 2, mix, boundary, route)

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
    """Sandwich-LN (CogView, arXiv 2105.13290; the study's Peri-LN block), paper Table 1:

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
    """LayerNorm Scaling ("The Curse of Depth in LLMs", arXiv 2502.05795), paper Table 1:

        h <- h + F(RMSNorm(h) / sqrt(b + 1))

    for both sublayers of block b (0-based, so the divisor is the root of the 1-based
    index). The factor is a constant of block b, not a parameter; it travels with the
    block when an order moves it (docs/probes.md, swap rule, as in the study's release). The final norm is
    unscaled. No parameters beyond Pre-LN's: with L = 1 it is Pre-LN."""

    peak_lr = 1e-2  # paper Table 4

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
    pre-norm variant (paper Appendix A). Pre-LN residual adds,

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

    State (h, depth K, depth V, p, route): the depth cache, K and V, is a tuple of 2L slots
    (B, H_kv, T, hd) allocated once as one shared zero tensor; a write replaces a slot's
    reference (no copy, no per-block concatenation) and never modifies a tensor in place, so
    prefix states can be reused and autograd's saved slots stay valid. A read loops over
    the slots (`ops.DepthReadFunction`); under torch.compile it is one opaque op and the
    slots' gradients come back along `route` (ops.open_route: slot j's [K_j, V_j] on route
    slot j; None in eager). probe = lens = h (docs/probes.md, depth states).
    Skip rule (docs/probes.md): a skipped block leaves h unchanged and writes nothing into
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

    def route_bytes_per_token(self, compiled=True):
        cfg = self.cfg  # 2L slots of [K_j, V_j], (H_kv, 2 hd) per token, fp32; only under torch.compile
        return 0 if not compiled else 2 * cfg.n_layer * cfg.n_kv_head * 2 * (cfg.n_embd // cfg.n_head) * 4

    def begin(self, x):
        cfg = self.cfg
        B, T, _ = x.shape
        zero = x.new_zeros(B, cfg.n_kv_head, T, cfg.n_embd // cfg.n_head)  # (B, H_kv, T, hd)
        slots = (zero,) * (2 * cfg.n_layer)
        return x, slots, slots, 0, open_route(zero, 2 * cfg.n_layer, 2 * zero.size(-1))

    def _next(self, state):
        h, K, V, p, route = state
        if 2 * p + 2 > len(K):
            raise ValueError(f"MoDA's depth cache has {len(K)} slots: an order may run or skip "
                             f"at most n_layer={self.cfg.n_layer} blocks")
        return h, K, V, p, route

    def block(self, state, b, layer, rope):
        h, K, V, p, route = self._next(state)
        B, T, _ = h.shape
        cfg, attn, prm = self.cfg, layer.attn, self.layers[b]
        q, k, v = attn.qkv(prm.attn_norm(h))  # (B, H, T, hd), (B, H_kv, T, hd) x2, before RoPE
        S = 2 * p if self.use_depth else 0    # the depth slots this block reads
        cos, sin = rope
        args = (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, K[:S], V[:S])
        y, route = (depth_attention(*args), None) if route is None else depth_attention(*args, route=route)
        h = h + attn.out(y)
        K, V, route = put_slot(K, 2 * p, k), put_slot(V, 2 * p, v), route_write(route, 2 * p, k, v)
        x = prm.mlp_norm(h)
        if prm.depth_kv is not None:
            dk, dv = prm.depth_kv(x).view(B, T, 2, cfg.n_kv_head, -1).permute(2, 0, 3, 1, 4)  # 2x (B, H_kv, T, hd)
            K, V, route = put_slot(K, 2 * p + 1, dk), put_slot(V, 2 * p + 1, dv), route_write(route, 2 * p + 1, dk, dv)
        return h + layer.mlp(x), K, V, p + 1, route

    def skip(self, state, b):
        h, K, V, p, route = self._next(state)
        return h, K, V, p + 1, route

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
