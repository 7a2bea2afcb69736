"""
What depth costs (paper Sec. 4.4, Appendix D, Fig. 11; docs/cost.md): analytic forward
FLOPs, KV-cache bytes and parameter counts of every residual scheme, a cross-check of
the FLOP formulas against torch.utils.flop_counter.FlopCounterMode, and measured
prefill latency / peak memory / device-hours per 1B tokens.

    python cost.py                                     # main family, 10 schemes, analytic table
    python cost.py --schemes=preln,attnres,hc --shapes=16x1216,70x640
    python cost.py --family=onepointsix --seq_len=2048
    python cost.py --measure --device=cuda --batch=8   # + measured prefill (bf16 on GPU)
    python cost.py --measure --device=cpu --shapes=2x64 --seq_len=64 --batch=1 --iters=2
    python cost.py --memory=config/attnres_L32.py       # a config's training-memory plan (plan/memory.py)
    python cost.py --kv_cache --shapes=4x128 --seq_len=64 --new_tokens=64   # the KV cache measured

It prints a table (scheme, L, d, d/L, params, prefill TFLOPs/sequence, ΔF/F, KV cache
and, with --measure, latency, tokens/s, peak memory, device-hours per 1B prefill tokens)
and writes <out>/cost.json and a Fig. 11-style <out>/cost.png (one line per scheme
against d/L; a validation-loss panel too when <results> or out/<family>/results.json exists).

Conventions (one multiply-add = 2 FLOPs; norms, RoPE, softmax, residual adds and other
elementwise work are not counted, as in the paper):
  - the table's prefill FLOPs use the study's convention, which reproduces its "3.0 ->
    4.4 TFLOPs per sequence" (Sec. 4.4, Fig. 11; docs/cost.md): causal attention 2T²d per layer (half of
    the T×T score and value products) and the LM head on the last position only;
  - flop_check() counts what the code executes: the full T×T attention (4T²d) and the
    LM head on all T positions;
  - KV cache: keys and values of every layer for a T-token sequence, bf16 (2 bytes), the
    same for every scheme (what model.KVCache holds); MB = 1e6 bytes, GB = 1e9 bytes. MoDA's
    prefill also holds a per-token depth buffer (2L slots), which no decoder keeps
    (kv_cache_bytes(..., residual='moda', prefill=True));
  - Block AttnRes: the table uses the paper's Appendix D source count; the model reads
    N - 1 = 7 sources fewer (blockattnres_sources, appendix_d=False);
  - a scheme registered in residuals.RESIDUALS without closed forms here (one you
    added) gets its parameters counted on its model and its ΔF measured with
    FlopCounterMode against Pre-LN (counted_params, measured_extra_flops);
  - measured prefill: blocks on all T tokens, LM head on the last position, median of
    synchronised passes; peak memory = CUDA max_memory_allocated, or on the CPU the
    peak RSS of a fresh subprocess per config above its RSS before the model was built.
"""

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing

import torch

from configurator import finite_float
from model import GPT, GPTConfig, ffn_hidden_size

# the main family's shapes (paper Table 3), used when study/families.py is not importable
MAIN_SHAPES = ((16, 1216), (20, 1120), (24, 1024), (28, 960), (32, 896), (42, 800), (70, 640))
# the ten schemes of the study (Table 1), in table order, and the classic extra rows
STUDY_SCHEMES = ('preln', 'sandwich', 'lns', 'deepnorm', 'keel', 'hc', 'mhc', 'attnres', 'blockattnres', 'moda')
EXTRA_SCHEMES = ('postln', 'rezero', 'layerscale', 'resdual')
# schemes whose wiring is only norms, gains and adds: no matrix products beyond the backbone
ELEMENTWISE_SCHEMES = ('preln', 'sandwich', 'lns', 'deepnorm', 'keel', 'postln', 'rezero', 'layerscale', 'resdual')
# terms of extra_flop_terms() that are per-token weighted sums, dot products or outer
# products over a handful of streams / sources: an implementation may write them as
# broadcast multiplies and sums, which FlopCounterMode (it counts matrix products) does not
# see. The other terms ('dynamic', 'depth_kv_proj') are projections and must be matmuls.
BROADCAST_TERMS = ('read', 'mix', 'write', 'depth_scores', 'depth_values')

# -----------------------------------------------------------------------------
# analytic FLOPs (paper Sec. 4.4, Appendix D)


def _heads(n_embd, n_head, n_kv_head):
    """(head_dim, n_kv_head) after checking the head layout; raises ValueError."""
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    if n_embd % n_head or n_head % n_kv_head:
        raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head} and n_head by "
                         f"n_kv_head={n_kv_head}: pick a head layout as in GPTConfig")
    return n_embd // n_head, n_kv_head


def blockattnres_sources(n_layer, attnres_blocks=8, appendix_d=True):
    """
    Number of sources each Block AttnRes read mixes: a list of 2L ints, the reads of
    sublayers k = 1..2L-1 (0-based; block 0's attention reads the embedding directly)
    and the final aggregator last. N = attnres_blocks blocks of S = 2L / N sublayers.

    appendix_d=True, the paper's count (Appendix D): sublayer k reads the
      embedding, the floor(k / S) completed blocks and the running partial sum,
      2 + floor(k / S) sources; the final aggregator 1 + N. floor(k / S) is computed as
      floor(k N / 2L), so S need not be an integer (L = 42, 70).
    appendix_d=False, what residuals.BlockAttnRes reads (paper Appendix A): at a boundary
      (k a multiple of S) the partial sum has just been frozen and is empty, so it is not
      a source: 1 + floor(k / S) + [k mod S != 0]. N - 1 sources fewer in all; S = 1 gives
      Full AttnRes's L(2L+3). N is capped at 2L and must divide 2L, as in the model.
    Raises ValueError for attnres_blocks < 1, or (appendix_d=False) N not dividing 2L.
    """
    L2 = 2 * n_layer
    if attnres_blocks < 1:
        raise ValueError(f"attnres_blocks must be >= 1, got {attnres_blocks}")
    if appendix_d:
        return [2 + (k * attnres_blocks) // L2 for k in range(1, L2)] + [1 + attnres_blocks]
    n_blocks = min(attnres_blocks, L2)
    if L2 % n_blocks:
        raise ValueError(f"2*n_layer = {L2} sublayers are not divisible by attnres_blocks = {attnres_blocks}: "
                         f"use appendix_d=True or a divisor of {L2}")
    S = L2 // n_blocks
    return [1 + k // S + (k % S != 0) for k in range(1, L2)] + [1 + n_blocks]


def extra_flop_terms(residual, n_layer, n_embd, seq_len, *, n_head=16, n_kv_head=None,
                     hc_streams=4, attnres_blocks=8, appendix_d=True, ffn_hidden=None):
    """
    The extra forward FLOPs of a residual scheme over Pre-LN for one sequence of T =
    seq_len tokens, split into named terms (dict name -> FLOPs; empty for schemes with
    no extra matrix work). One multiply-add = 2 FLOPs; per token, per sublayer:

    HC (m streams, H in R^{m x d}; paper Appendix A): the dynamic coefficients tanh(H̄ W),
      W in R^{d x (m+1)}, and tanh(H̄ w_beta), w_beta in R^d: 2·m·d·(m+2) ('dynamic');
      the branch input x = A_m^T H: 2md ('read'); the stream mix A_r^T H: 2m²d ('mix');
      the write beta ⊗ f: 2md ('write'). Sum 4·m·d·(m+2) per sublayer, so
          ΔF_HC = 2L · T · 4md(m+2) = 8·m·(m+2)·T·d·L = 192·T·d·L at m = 4.
    mHC: the projection x'φ, φ in R^{md x (m²+2m)}: 2·md·(m²+2m) ('dynamic'); read
      2md, mix 2m²d, write 2md as HC. Sum 2md(m+1)(m+2) per sublayer, so
          ΔF_mHC = 4·m·(m+1)·(m+2)·T·d·L = 480·T·d·L at m = 4
      (Sinkhorn's 20 iterations on the m x m matrix are elementwise and O(m²), not ∝ d).
    Full AttnRes: a read over n sources costs 2nd for the logits w^T v_i (RMSNorm_key
      folds into 1/rms scalars) and 2nd for the weighted sum ('depth_scores',
      'depth_values'). Sublayer k = 1..2L-1 reads k+1 sources, the final aggregator
      2L+1, in all Σn = L(2L+3):
          ΔF_Full = 4·T·d·L·(2L+3).
    Block AttnRes: the same with the sources of blockattnres_sources() (Appendix D):
          ΔF_Block = 4Td·[Σ_{k=1}^{2L-1} (2 + floor(k/S)) + attnres_blocks + 1],  S = 2L/8;
      appendix_d=False counts the sources residuals.BlockAttnRes actually reads, which
      is 4Td·(attnres_blocks - 1) less (see blockattnres_sources).
    MoDA (paper Appendix A): attention of block b >= 1 also scores each query against the 2b
      depth slots of its own token and mixes their values: 2·(2b)·d FLOPs each
      (all H query heads, GQA or not), so Σ_{b=1}^{L-1} 8bd = 4·d·L(L-1) per token
      ('depth_scores' + 'depth_values', 2·T·d·L(L-1) each); and the depth K/V projection
      W_kv in R^{2·n_kv·hd x d} of the FFN input on blocks 0..L-2 ('depth_kv_proj'):
      (L-1) · 2·T·d·2·n_kv·hd. In all, with n_kv·hd = d for MHA:
          ΔF_MoDA = 4·T·d·(L-1)·(L + n_kv·hd) = 4·T·d·(L-1)·(L+d) (MHA).
      Slot 2b (block b's own k, v) reuses the attention projections: no extra FLOPs.
    Pre-LN, Sandwich, LNS, DeepNorm, KEEL, Post-LN, ReZero, LayerScale, ResiDual: only
      norms, gains, scalings and adds, which are not counted: no terms (ΔF = 0).
    Any other scheme registered in residuals.RESIDUALS (no closed form here): one term,
      'measured' = measured_extra_flops() of a model of this shape (ffn_hidden None =
      the default SwiGLU width), which counts matrix products only.

    Units: FLOPs (int). Raises ValueError for an unregistered scheme or a bad head layout.
    """
    T, d, L = seq_len, n_embd, n_layer
    hd, n_kv = _heads(n_embd, n_head, n_kv_head)
    m = hc_streams
    if residual in ELEMENTWISE_SCHEMES:
        return {}
    if residual == 'hc':
        per = 2 * L * T  # sublayer-tokens
        return dict(dynamic=per * 2 * m * d * (m + 2), read=per * 2 * m * d, mix=per * 2 * m * m * d,
                    write=per * 2 * m * d)
    if residual == 'mhc':
        per = 2 * L * T
        return dict(dynamic=per * 2 * m * d * (m * m + 2 * m), read=per * 2 * m * d, mix=per * 2 * m * m * d,
                    write=per * 2 * m * d)
    if residual in ('attnres', 'blockattnres'):
        n = L * (2 * L + 3) if residual == 'attnres' else sum(blockattnres_sources(L, attnres_blocks, appendix_d))
        return dict(depth_scores=2 * T * d * n, depth_values=2 * T * d * n)
    if residual == 'moda':
        slots = L * (L - 1)  # Σ_{b=1}^{L-1} 2b depth slots read per token
        return dict(depth_scores=2 * T * d * slots, depth_values=2 * T * d * slots,
                    depth_kv_proj=(L - 1) * 2 * T * d * 2 * n_kv * hd)
    # a scheme without a closed form here (e.g. one you added to residuals.RESIDUALS):
    # count what its model executes, minus Pre-LN of the same shape
    from residuals import RESIDUALS
    if residual not in RESIDUALS:
        raise ValueError(f"unknown residual scheme {residual!r}; registered in residuals.RESIDUALS: "
                         f"{', '.join(RESIDUALS)}")
    cfg = GPTConfig(residual=residual, n_layer=L, n_embd=d, n_head=n_head, n_kv_head=n_kv_head,
                    ffn_hidden=ffn_hidden, hc_streams=hc_streams, attnres_blocks=attnres_blocks,
                    vocab_size=64, block_size=T)  # the LM head cancels in the difference
    return dict(measured=measured_extra_flops(cfg, T))


def extra_flops(residual, n_layer, n_embd, seq_len, **kw):
    """
    ΔF of a scheme over Pre-LN: forward FLOPs of one T-token sequence (paper Sec. 4.4,
    Appendix D): HC 192·T·d·L, mHC 480·T·d·L (m = 4), Full AttnRes 4·T·d·L·(2L+3),
    Block AttnRes 4Td·[Σ_{k=1}^{2L-1}(2 + floor(k/b)) + 9] (b = 2L/8), MoDA
    4·T·d·(L-1)·(L + n_kv·hd), every other scheme 0 (norms and elementwise work are not
    counted). The sum of extra_flop_terms(), whose docstring derives every term.
    Keywords: n_head, n_kv_head, hc_streams, attnres_blocks, appendix_d. Units: FLOPs.
    """
    return sum(extra_flop_terms(residual, n_layer, n_embd, seq_len, **kw).values())


def forward_flops(n_layer, n_embd, seq_len, *, residual='preln', ffn_hidden=None, n_head=16, n_kv_head=None,
                  vocab_size=50280, logits='last', attention='causal', **scheme_opts):
    """
    Forward FLOPs of one sequence of T = seq_len tokens (paper Sec. 4.4; one multiply-add =
    2 FLOPs; norms, RoPE, softmax and elementwise work not counted):

        F = L · (F_proj + 6·T·d·d_ff + F_attn) + F_head + ΔF_scheme

    F_proj = 2·T·d·d (q) + 2·T·d·d (o) + 2 · 2·T·d·(n_kv·hd) (k, v), i.e. 8Td² for MHA;
    6·T·d·d_ff: the three SwiGLU matrices;
    F_attn = 2T²d for attention='causal' (half the T×T score and value products, the
      paper's count) or 4T²d for 'full' (the whole T×T matrix, what a dense kernel or
      FlopCounterMode under SDPBackend.MATH computes); d = H·hd for GQA too;
    F_head = 2·T·d·V for logits='all', 2·d·V for 'last' (prefill of a generation);
    ΔF_scheme = extra_flops(residual, ...), with scheme_opts (hc_streams, attnres_blocks,
      appendix_d).

    For MHA causal: F = L·(8Td² + 6T·d·d_ff + 2T²d) + F_head + ΔF. The defaults
    (logits='last', attention='causal', T = 4096) are the study's prefill convention
    (Fig. 11; docs/cost.md): Full AttnRes L16/d1216 -> 2.99e12, L70/d640 -> 4.43e12.
    ffn_hidden None = 16·ceil(8d/3 / 16). Units: FLOPs (int).
    Raises ValueError for a bad logits/attention value, head layout or scheme.
    """
    if logits not in ('all', 'last'):
        raise ValueError(f"logits={logits!r}: use 'all' (LM head on every position) or 'last'")
    if attention not in ('causal', 'full'):
        raise ValueError(f"attention={attention!r}: use 'causal' (2T²d) or 'full' (4T²d)")
    T, d, L, V = seq_len, n_embd, n_layer, vocab_size
    d_ff = ffn_hidden_size(d) if ffn_hidden is None else ffn_hidden
    hd, n_kv = _heads(d, n_head, n_kv_head)
    proj = 2 * T * d * d * 2 + 2 * T * d * (n_kv * hd) * 2
    attn = (2 if attention == 'causal' else 4) * T * T * d
    head = 2 * d * V * (T if logits == 'all' else 1)
    extra = extra_flops(residual, L, d, T, n_head=n_head, n_kv_head=n_kv_head, ffn_hidden=ffn_hidden, **scheme_opts)
    return L * (proj + 6 * T * d * d_ff + attn) + head + extra


def _scheme_opts(cfg):
    return dict(hc_streams=cfg.hc_streams, attnres_blocks=cfg.attnres_blocks)


def config_flops(cfg, seq_len, **kw):
    """forward_flops() for a GPTConfig (its scheme, shape and scheme options); kw: logits, attention."""
    return forward_flops(cfg.n_layer, cfg.n_embd, seq_len, residual=cfg.residual, ffn_hidden=cfg.ffn_hidden,
                         n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, vocab_size=cfg.vocab_size,
                         **_scheme_opts(cfg), **kw)

# -----------------------------------------------------------------------------
# KV cache and parameters


def kv_cache_bytes(n_layer, n_embd, seq_len, *, n_head=16, n_kv_head=None, bytes_per_elem=2, batch=1,
                   residual='preln', prefill=False):
    """
    Bytes of the KV cache of `batch` sequences of T = seq_len tokens (paper Sec. 4.4):

        2 (K and V) · L · T · n_kv · hd · bytes_per_elem · batch

    = 2·L·T·d·2 bytes for MHA in bf16 (L16/d1216, T=4096: 319 MB; L70/d640: 734 MB);
    GQA with n_kv = H/2 halves it. The same for every scheme: the attention's keys and values
    are all that crosses from one token to the next (model.KVCache holds exactly this, tested
    in tests/test_kv_cache.py). The depth reads of AttnRes and Block AttnRes and the stream
    routing of HC and mHC act on one token's own states, and MoDA's depth slots are read only
    by the later blocks of the same token, so they are dead once a token has passed all L
    blocks: a decoder keeps none of them.

    prefill=True adds, for MoDA, the per-token depth buffer that a prefill of T tokens run
    block by block holds at once: 2L slots of a key and a value of n_kv·hd per token (slot 2b
    = block b's attention k, v before RoPE; 2b+1 = the W_kv projection of its FFN input; the
    last slot is never written), 2·2L·T·n_kv·hd·bytes·batch, twice the sequence cache. Working
    memory of the forward, not a cache; other schemes: nothing (their depth state is
    activations, as every scheme's).
    Units: bytes (int). Raises ValueError for a bad head layout.
    """
    hd, n_kv = _heads(n_embd, n_head, n_kv_head)
    seq = 2 * n_layer * seq_len * n_kv * hd * bytes_per_elem * batch
    if residual == 'moda' and prefill:
        seq += 2 * (2 * n_layer) * seq_len * n_kv * hd * bytes_per_elem * batch
    return seq


def param_count(config):
    """
    Closed-form parameter count of GPT(config) (must equal model.num_params()).

    Pre-LN (paper Sec. 2.2): L·(2d² + 2·d·n_kv·hd + 3·d·d_ff + 2d) + 2·V·d + d, i.e.
    L·(4d² + 3·d·d_ff + 2d) + 2Vd + d for MHA (q, k, v, o; SwiGLU; two RMSNorm gains per
    block; untied embedding and LM head; final norm). Per scheme ΔN (paper Appendix A; docs/schemes.md's table):
      Sandwich  +2Ld             an output RMSNorm per sublayer
      LNS, DeepNorm, Post-LN     0 (1/sqrt(l) is a constant; LayerNorm without bias has d gains)
      KEEL      +(2L-1)d          an outer norm on every sublayer but block 0's attention
      HC        +2L·[m(m+1) + d(m+1) + 1 + m + d + 1]   static [A_m|A_r], W, s_alpha, static beta, w_beta, s_beta
      mHC       +2L·[md(m²+2m) + (m²+2m) + 3]         phi, bias b, three scalar gates
      Full / Block AttnRes  +4Ld  a pseudo-query and a key-norm gain (d each) per read, 2L reads
      MoDA      +(L-1)·2·d·n_kv·hd   W_kv on blocks 0..L-2
      ReZero    -2Ld + 2L         no norms, one scalar gate per sublayer
      LayerScale +2Ld             a per-channel gain per sublayer
      ResiDual  +d                one extra final norm (of the Pre-LN-style dual stream)
    m = config.hc_streams. Any other scheme registered in residuals.RESIDUALS: counted on
    its instantiated model (counted_params). Returns an int; raises ValueError for a
    scheme that is not registered.
    """
    c = config
    L, d, V, d_ff = c.n_layer, c.n_embd, c.vocab_size, c.ffn_hidden
    hd, n_kv = _heads(d, c.n_head, c.n_kv_head)
    base = L * (2 * d * d + 2 * d * n_kv * hd + 3 * d * d_ff + 2 * d) + 2 * V * d + d
    m = c.hc_streams
    delta = {
        'preln': 0, 'lns': 0, 'deepnorm': 0, 'postln': 0,
        'sandwich': 2 * L * d,
        'keel': (2 * L - 1) * d,
        'hc': 2 * L * (m * (m + 1) + d * (m + 1) + 1 + m + d + 1),
        'mhc': 2 * L * (m * d * (m * m + 2 * m) + (m * m + 2 * m) + 3),
        'attnres': 4 * L * d, 'blockattnres': 4 * L * d,
        'moda': (L - 1) * 2 * d * n_kv * hd,
        'rezero': -2 * L * d + 2 * L,
        'layerscale': 2 * L * d,
        'resdual': d,
    }
    if c.residual not in delta:
        from residuals import RESIDUALS
        if c.residual not in RESIDUALS:
            raise ValueError(f"param_count: no closed form for scheme {c.residual!r} and it is not registered "
                             f"in residuals.RESIDUALS ({', '.join(RESIDUALS)})")
        return counted_params(c)  # a scheme without a closed form: count its model
    return base + delta[c.residual]


def counted_params(config):
    """Parameters of GPT(config) counted on the instantiated model, built on the meta
    device (no memory, no arithmetic). param_count() uses it for a scheme it has no closed
    form for; for the others the two agree (tested). Returns an int."""
    with torch.device('meta'):
        return GPT(config).num_params()

# -----------------------------------------------------------------------------
# cross-check against torch.utils.flop_counter


def _mv_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    """aten.mv (n, k) @ (k,): 2nk FLOPs (FlopCounterMode has no formula for it)."""
    return 2 * a_shape[0] * a_shape[1]


def _addmv_flops(bias_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1]


def _dot_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0]


def _addcmul_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    """aten.addcmul z + a * b: one multiply-add (2 FLOPs) per output element."""
    return 2 * math.prod(out_shape)


def _count_forward(cfg, seq_len, batch=1, device='meta'):
    """FlopCounterMode over one no-grad forward of GPT(cfg) on (batch, seq_len) token ids,
    attention under the MATH SDPA kernel; see flop_check for the convention. Returns the counter."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    aten = torch.ops.aten
    with torch.device(device):
        model = GPT(cfg)
        idx = torch.zeros(batch, seq_len, dtype=torch.long)
    counter = FlopCounterMode(display=False, custom_mapping={
        aten.mv: _mv_flops, aten.addmv: _addmv_flops, aten.dot: _dot_flops, aten.addcmul: _addcmul_flops})
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(idx)
    return counter


def measured_extra_flops(config, seq_len):
    """
    ΔF of config's scheme over Pre-LN, measured: FlopCounterMode's count of one forward
    of a seq_len-token sequence of GPT(config) minus that of the Pre-LN model of the same
    shape, both on the meta device (no memory, no arithmetic) with the flop_check
    convention. What extra_flop_terms() uses for a scheme without a closed form.

    It counts matrix products (mm, bmm, mv, dot, addcmul, einsums that contract), so it
    equals the closed form where a scheme's extra work is all matrix products (the plain
    Full/Block AttnRes and MoDA reads, and 0 for the norm-and-gain schemes: tested), and
    misses products written as broadcast multiply-and-sum (HC/mHC's write beta ⊗ f, 2md
    per token and sublayer, is not seen). Units: FLOPs (int).
    Raises ValueError if the scheme cannot run on the meta device.
    """
    from residuals import RESIDUALS
    cfg = GPTConfig(**{**config.__dict__, 'block_size': max(config.block_size, seq_len)})
    key = (RESIDUALS.get(cfg.residual), seq_len, tuple(sorted(cfg.__dict__.items())))
    if key not in _MEASURED:  # a table asks for the same shape several times; each count builds two models
        _MEASURED[key] = _measure_extra_flops(cfg, seq_len)
    return _MEASURED[key]


_MEASURED = {}  # (scheme class, seq_len, config items) -> measured ΔF


def _measure_extra_flops(cfg, seq_len):
    try:
        scheme = _count_forward(cfg, seq_len).get_total_flops()
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(f"cannot count the FLOPs of scheme {cfg.residual!r} on the meta device "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                         f"add a closed form to cost.extra_flop_terms") from None
    base = _count_forward(GPTConfig(**{**cfg.__dict__, 'residual': 'preln'}), seq_len).get_total_flops()
    return scheme - base


def flop_check(config, seq_len, batch=1, device='meta'):
    """
    Counts the FLOPs of one forward pass of GPT(config) on `batch` sequences of seq_len
    tokens with torch.utils.flop_counter.FlopCounterMode, and the analytic count
    batch · forward_flops(..., attention='full', logits='all', appendix_d=False).

    Convention, so that both count the same things:
      - the model is built on `device` (default 'meta': no memory, no arithmetic) and
        run under torch.no_grad();
      - attention runs under sdpa_kernel(SDPBackend.MATH): it is then two bmm's over
        the full T×T matrix (4T²d per layer; GQA's k, v are expanded to all H heads),
        which FlopCounterMode sees. With the default CPU kernel it sees no attention;
      - aten.mv / addmv / dot / addcmul get formulas (2 FLOPs per multiply-add):
        FlopCounterMode counts only mm/bmm-like ops, while AttnRes's logits v_i · w are
        matrix-vector products and its weighted sum may be an addcmul loop; einsums with
        a contraction become bmm and are counted;
      - the LM head runs on all T positions (logits='all');
      - Block AttnRes sources are counted as the model reads them (appendix_d=False),
        N - 1 fewer than the paper's Appendix D count.
    What it still cannot see: plain elementwise products, including broadcast weighted
    sums and outer products (e.g. the HC/mHC write beta ⊗ f, written as
    w[..., None] * y[..., None, :]), which the analytic count includes as multiply-adds
    (the BROADCAST_TERMS of extra_flop_terms). Norms, RoPE and softmax are counted by neither.

    Returns dict(counted=int, analytic=int, missing=analytic - counted, by_op={op: FLOPs},
    terms=extra_flop_terms scaled by batch). Units: FLOPs.
    """
    cfg = GPTConfig(**{**config.__dict__, 'block_size': max(config.block_size, seq_len)})
    counter = _count_forward(cfg, seq_len, batch, device)
    counted = counter.get_total_flops()
    analytic = batch * config_flops(cfg, seq_len, attention='full', logits='all', appendix_d=False)
    terms = {k: batch * v for k, v in extra_flop_terms(cfg.residual, cfg.n_layer, cfg.n_embd, seq_len,
                                                        n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                                                        ffn_hidden=cfg.ffn_hidden, appendix_d=False,
                                                        **_scheme_opts(cfg)).items()}
    by_op = {str(k).removeprefix('aten.'): v for k, v in counter.get_flop_counts().get('Global', {}).items()}
    return dict(counted=counted, analytic=analytic, missing=analytic - counted, by_op=by_op, terms=terms)

# -----------------------------------------------------------------------------
# measured prefill (Fig. 11; docs/cost.md)


def _rss_bytes():
    """Current resident set size of this process (bytes), from /proc; None where unavailable."""
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError, IndexError):
        return None


def _peak_rss_bytes():
    """Peak resident set size of this process so far (bytes): ru_maxrss is KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == 'darwin' else peak * 1024


def _measure_one(cfg_kw, batch, seq_len, device, dtype, warmup, iters, seed=0):
    """Builds one model and times its prefill; see measure_prefill. Returns a dict."""
    device = torch.device(device)
    rss0 = _rss_bytes() if device.type == 'cpu' else None  # before the model exists
    torch.manual_seed(seed)
    cfg = GPTConfig(**cfg_kw, block_size=seq_len)
    with torch.device(device):
        model = GPT(cfg)
    for prm in model.parameters():  # weights in dtype; buffers (RoPE tables) stay fp32
        prm.data = prm.data.to(getattr(torch, dtype))
    model.eval()
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=dtype != 'float32')
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)

    def prefill():
        with torch.inference_mode(), autocast:
            h = model.hidden(idx)                   # (B, T, d)
            return model.head(h[:, -1:, :])        # (B, 1, V): the next-token logits only

    for _ in range(warmup):
        prefill()
    sync()
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        prefill()
        sync()
        times.append(time.perf_counter() - t0)
    if device.type == 'cuda':
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _peak_rss_bytes() - rss0 if rss0 is not None else None
    latency = statistics.median(times)
    tokens = batch * seq_len
    return dict(scheme=cfg.residual, L=cfg.n_layer, d=cfg.n_embd, batch=batch, seq_len=seq_len,
                device=str(device), dtype=dtype, params=model.num_params(), latency_s=latency,
                tokens_per_s=tokens / latency, peak_mem_bytes=peak,
                hours_per_1B=latency / tokens * 1e9 / 3600, times_s=times)


def measure_prefill(schemes, shapes, batch=8, seq_len=4096, device='cuda', dtype=None, warmup=3, iters=10,
                    **config_kw):
    """
    Measured prefill cost (Fig. 11; docs/cost.md) of every (scheme, shape).

    schemes: scheme names (registered in residuals.RESIDUALS); shapes: (L, d) pairs or
    (L, d, dict of extra GPTConfig keys, e.g. n_kv_head); config_kw: GPTConfig keys for
    every model (vocab_size, n_head, ...). Each model gets random weights and a random
    (batch, seq_len) batch of token ids; a pass is the prefill of a generation: the
    blocks on all T tokens and the LM head on the last position only, under
    torch.inference_mode(), weights in `dtype` (default bfloat16 on CUDA, float32 on CPU)
    with autocast. `warmup` passes, then `iters` timed ones, each synchronised.

    Returns a list of dicts (one per scheme x shape, in that order) with
      latency_s      median wall time of the timed passes (s)
      tokens_per_s   batch · T / latency_s
      peak_mem_bytes CUDA: torch.cuda.max_memory_allocated after a reset that follows the
                     warm-up (weights + activations of a pass). CPU: the peak RSS of a
                     fresh process (each config runs in its own spawned subprocess, since
                     ru_maxrss never decreases) minus its RSS before the model was built,
                     i.e. weights + the largest working set, incl. model construction.
      hours_per_1B   device-hours per 1B prefill tokens = latency_s / (batch·T) · 1e9 / 3600
    plus scheme, L, d, batch, seq_len, device, dtype, params, times_s; a config that runs
    out of GPU memory gets error='OOM' and None values.
    Raises ValueError for an unknown scheme or device.
    """
    from residuals import RESIDUALS
    bad = [s for s in schemes if s not in RESIDUALS]
    if bad:
        raise ValueError(f"cannot measure {', '.join(bad)}: not in residuals.RESIDUALS ({', '.join(RESIDUALS)})")
    device = torch.device(device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError("device=cuda but no GPU is available: use --device=cpu")
    if device.type not in ('cuda', 'cpu'):
        raise ValueError(f"device {device}: measure on 'cuda' or 'cpu'")
    if warmup < 0 or iters < 1:
        raise ValueError(f"warmup={warmup}, iters={iters}: need warmup >= 0 and iters >= 1")
    dtype = dtype or ('bfloat16' if device.type == 'cuda' else 'float32')
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype {dtype!r}: use bfloat16, float16 or float32")
    out = []
    for scheme, shape in itertools.product(schemes, shapes):
        L, d, extra = (*shape, {}) if len(shape) == 2 else shape
        kw = dict(config_kw, **extra, residual=scheme, n_layer=L, n_embd=d)
        args = (kw, batch, seq_len, str(device), dtype, warmup, iters)
        if device.type == 'cpu':  # a fresh process per config: ru_maxrss is a per-process high-water mark
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn')) as pool:
                out.append(pool.submit(_measure_one, *args).result())
            continue
        try:
            out.append(_measure_one(*args))
        except torch.cuda.OutOfMemoryError:
            out.append(dict(scheme=scheme, L=L, d=d, batch=batch, seq_len=seq_len, device=str(device), dtype=dtype,
                            latency_s=None, tokens_per_s=None, peak_mem_bytes=None, hours_per_1B=None, error='OOM'))
        torch.cuda.empty_cache()
    return out

def measure_kv_cache(schemes, shapes, prompt_len=64, new_tokens=64, device='cpu', dtype=None, rounds=3,
                     **config_kw):
    """
    The KV cache of generation measured (model.KVCache, sample.py; docs/cost.md), per
    (scheme, shape): a batch-1 model with random weights (fast.randomise), block_size =
    prompt_len + new_tokens, weights fp32 under `dtype` autocast (default bfloat16 on CUDA,
    float32 on the CPU).
      cache_bytes    KVCache.nbytes() after the prompt and new_tokens single-token steps;
      formula_bytes  kv_cache_bytes of the same shape, length and dtype (they must agree);
      tokens_per_s   new_tokens / seconds of sample.generate, greedy, with the cache and
                     recomputing the context (kv_cache=False), the two interleaved in
                     `rounds` rounds after one warm-up round; the median of each;
      speedup        the median over rounds of the round's recompute time / cache time;
      same_tokens    the two wrote the same tokens in every round.
    shapes: (L, d) or (L, d, extra GPTConfig keys, e.g. n_kv_head); config_kw: GPTConfig keys
    for every model (vocab_size, n_head, ...). Raises ValueError for an unknown scheme or device.
    """
    import fast
    from model import KVCache
    from residuals import RESIDUALS
    from sample import generate
    bad = [s for s in schemes if s not in RESIDUALS]
    if bad:
        raise ValueError(f"cannot measure {', '.join(bad)}: not in residuals.RESIDUALS ({', '.join(RESIDUALS)})")
    device = torch.device(device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError("device=cuda but no GPU is available: use --device=cpu")
    if prompt_len < 1 or new_tokens < 1 or rounds < 1:
        raise ValueError(f"prompt_len={prompt_len}, new_tokens={new_tokens}, rounds={rounds}: each must be >= 1")
    dtype = dtype or ('bfloat16' if device.type == 'cuda' else 'float32')
    autocast = torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=dtype != 'float32')
    out = []
    for scheme, shape in itertools.product(schemes, shapes):
        L, d, extra = (*shape, {}) if len(shape) == 2 else shape
        cfg = GPTConfig(**{**config_kw, **extra}, residual=scheme, n_layer=L, n_embd=d,
                        block_size=prompt_len + new_tokens)
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg).eval()
        fast.randomise(model)
        idx = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device,
                            generator=torch.Generator(device=device).manual_seed(0))
        cache = KVCache(L)
        with torch.no_grad(), autocast:
            model.hidden(idx, cache=cache)
            for t in range(new_tokens):
                model.hidden(idx[:, t % prompt_len:t % prompt_len + 1], cache=cache)
        times, same = {True: [], False: []}, True
        for r in range(rounds + 1):  # round 0 warms up
            outs = {}
            for kv in (True, False):
                with autocast:
                    if device.type == 'cuda':
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    outs[kv] = generate(model, idx, new_tokens, temperature=0, kv_cache=kv).tolist()  # syncs
                    if r:
                        times[kv].append(time.perf_counter() - t0)
            same = same and outs[True] == outs[False]
        out.append(dict(scheme=scheme, L=L, d=d, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, prompt_len=prompt_len,
                        new_tokens=new_tokens, tokens=cache.pos, device=str(device), dtype=dtype,
                        cache_bytes=cache.nbytes(),
                        formula_bytes=kv_cache_bytes(L, d, cache.pos, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                                                     bytes_per_elem=getattr(torch, dtype).itemsize, residual=scheme),
                        tokens_per_s_cache=new_tokens / statistics.median(times[True]),
                        tokens_per_s_recompute=new_tokens / statistics.median(times[False]),
                        speedup=statistics.median(b / a for a, b in zip(times[True], times[False])),
                        same_tokens=same))
    return out


def format_kv_table(rows):
    """measure_kv_cache's rows as a markdown table."""
    lines = ['| scheme | L | d | heads q/kv | tokens | cache bytes (measured) | kv_cache_bytes | tokens/s cache | '
             'tokens/s recompute | speed-up | same tokens |', '|' + '---|' * 11]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['L']} | {r['d']} | {r['n_head']}/{r['n_kv_head']} | {r['tokens']} | "
                     f"{r['cache_bytes']:,} | {r['formula_bytes']:,} | {r['tokens_per_s_cache']:,.0f} | "
                     f"{r['tokens_per_s_recompute']:,.0f} | {r['speedup']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    return '\n'.join(lines)

# -----------------------------------------------------------------------------
# tables, figure, CLI


def family_shapes(family):
    """[(L, d, extra GPTConfig keys)], config keys shared by the family (vocab_size, n_head)
    for a family of study/families.py; the built-in main shapes if it is missing.
    Raises ValueError for an unknown family."""
    try:
        from study import families
    except ImportError:
        if family != 'main':
            raise ValueError(f"family {family!r} needs study/families.py; without it only 'main' is known")
        return [(L, d, {}) for L, d in MAIN_SHAPES], {}
    if family not in families.FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of: {', '.join(families.FAMILIES)}")
    fam = families.FAMILIES[family]
    fields = set(GPTConfig.__dataclass_fields__)
    shapes = list(dict.fromkeys((s.L, s.d, tuple(sorted((k, v) for k, v in s.extra.items() if k in fields)))
                                for s in fam.shapes))  # cross-scale may repeat a shape
    return [(L, d, dict(extra)) for L, d, extra in shapes], dict(vocab_size=fam.vocab_size, n_head=fam.n_head)


def cost_rows(schemes, shapes, seq_len=4096, logits='last', attention='causal', **config_kw):
    """
    The analytic table: one dict per (shape, scheme) with scheme, L, d, ratio (d/L),
    params (param_count), flops (forward_flops of one sequence, study convention by
    default), extra_flops, extra_pct (100·ΔF / F_Pre-LN of the same shape), kv_bytes
    (kv_cache_bytes, bf16, one sequence). shapes: (L, d) or (L, d, extra config keys).
    """
    rows = []
    for shape in shapes:
        L, d, extra = (*shape, {}) if len(shape) == 2 else shape
        for scheme in schemes:
            cfg = GPTConfig(**{**config_kw, **extra}, residual=scheme, n_layer=L, n_embd=d, block_size=seq_len)
            flops = config_flops(cfg, seq_len, logits=logits, attention=attention)
            dF = extra_flops(scheme, L, d, seq_len, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                             ffn_hidden=cfg.ffn_hidden, **_scheme_opts(cfg))
            rows.append(dict(scheme=scheme, L=L, d=d, ratio=d / L, seq_len=seq_len, n_head=cfg.n_head,
                             n_kv_head=cfg.n_kv_head,
                             ffn_hidden=cfg.ffn_hidden, params=param_count(cfg), flops=flops, extra_flops=dF,
                             extra_pct=100 * dF / (flops - dF),
                             kv_bytes=kv_cache_bytes(L, d, seq_len, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                                                     residual=scheme)))
    return rows


def _num(x, digits=2):
    """x with `digits` decimals if that shows >= 3 significant digits, else with 3 significant digits."""
    return f"{x:.{digits}f}" if abs(x) >= 10 ** (2 - digits) or x == 0 else f"{x:.3g}"


def format_table(rows):
    """The cost table as text (a markdown table); measured columns when rows carry them."""
    measured = any(r.get('latency_s') is not None or r.get('error') for r in rows)
    head = ['scheme', 'L', 'd', 'd/L', 'params (M)', 'prefill TFLOPs/seq', 'ΔF/F %', 'KV cache (MB)']
    if measured:
        head += ['latency (ms)', 'tokens/s', 'peak mem (GB)', 'hours / 1B tok']
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '|'.join('---' for _ in head) + '|']
    for r in rows:
        cells = [r['scheme'], str(r['L']), str(r['d']), f"{r['ratio']:.2f}", f"{r['params'] / 1e6:.2f}",
                 _num(r['flops'] / 1e12), f"{r['extra_pct']:.2f}", _num(r['kv_bytes'] / 1e6, 0)]
        if measured:
            if r.get('latency_s') is None:
                cells += [r.get('error', '-')] + ['-'] * 3
            else:
                peak = r['peak_mem_bytes']
                cells += [f"{r['latency_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                          '-' if peak is None else f"{peak / 1e9:.2f}", f"{r['hours_per_1B']:.3f}"]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def format_pivot(rows):
    """Prefill TFLOPs per sequence as a shape x scheme markdown table, with the KV cache (MB),
    the same for every scheme (2·L·T·n_kv·hd·2 bytes)."""
    schemes = list(dict.fromkeys(r['scheme'] for r in rows))
    shapes = list(dict.fromkeys((r['L'], r['d']) for r in rows))
    cell = {(r['scheme'], r['L'], r['d']): r for r in rows}
    lines = ['| L | d | d/L | ' + ' | '.join(schemes) + ' | KV cache (MB) |', '|' + '---|' * (len(schemes) + 4)]
    for L, d in shapes:
        r0 = cell[(schemes[0], L, d)]
        kv = kv_cache_bytes(L, d, r0['seq_len'], n_head=r0['n_head'], n_kv_head=r0['n_kv_head'])
        lines.append(f"| {L} | {d} | {d / L:.2f} | " + ' | '.join(_num(cell[(s, L, d)]['flops'] / 1e12, 3)
                                                             for s in schemes) + f" | {_num(kv / 1e6, 0)} |")
    return '\n'.join(lines)


def read_losses(path):
    """{(scheme, L, d): val_loss} from a results file: a list of {scheme, n_layer, n_embd,
    val_loss} or study/sweep.py's {"runs": [{scheme, L, d, val_loss}]}; rows without a loss
    are skipped. Raises FileNotFoundError / ValueError with the fix."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"results file {path} not found: run `python study/sweep.py family=...` or drop --results")
    with open(path) as f:
        data = json.load(f)
    rows = data.get('runs') if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of runs or {{'runs': [...]}}")
    out = {}
    for r in rows:
        L, d = r.get('n_layer', r.get('L')), r.get('n_embd', r.get('d'))
        if r.get('val_loss') is not None and None not in (r.get('scheme'), L, d):
            out[(r['scheme'], int(L), int(d))] = float(r['val_loss'])
    return out


def plot(rows, path, losses=None, title=''):
    """Fig. 11-style figure: prefill TFLOPs/sequence and KV cache vs d/L, and when measured
    peak memory and device-hours per 1B tokens, and when given validation loss; one line
    per scheme. Writes `path` (png)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = [('flops', 1e12, 'prefill TFLOPs / sequence'), ('kv_bytes', 1e6, 'KV cache (MB)')]
    if any(r.get('latency_s') is not None for r in rows):
        panels += [('peak_mem_bytes', 1e9, 'peak memory (GB)'), ('hours_per_1B', 1, 'device-hours / 1B prefill tokens')]
    if losses:
        rows = [dict(r, val_loss=losses.get((r['scheme'], r['L'], r['d']))) for r in rows]
        panels.append(('val_loss', 1, 'validation loss (nats)'))
    panels = [p for p in panels if any(r.get(p[0]) is not None for r in rows)]  # no empty panel
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    schemes = list(dict.fromkeys(r['scheme'] for r in rows))
    ticks = sorted({(r['ratio'], r['L']) for r in rows})
    styles = itertools.cycle(itertools.product(('-', '--', ':'), 'osd^v'))  # schemes that coincide stay visible
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    style = {s: (*next(styles), colors[i % len(colors)]) for i, s in enumerate(schemes)}  # one colour per scheme
    for ax, (key, scale, label) in zip(axes.flat, panels):
        for s in schemes:
            mine = sorted((r for r in rows if r['scheme'] == s and r.get(key) is not None), key=lambda r: r['ratio'])
            if not mine:
                continue
            x, y = [r['ratio'] for r in mine], [r[key] / scale for r in mine]
            ax.plot(x, y, linestyle=style[s][0], marker=style[s][1], color=style[s][2], ms=3, label=s)
            if key == 'hours_per_1B' and all(r.get('times_s') for r in mine):
                # the spread of the timed passes (min .. max), scaled like the median
                lo = [y_ * min(r['times_s']) / r['latency_s'] for y_, r in zip(y, mine)]
                hi = [y_ * max(r['times_s']) / r['latency_s'] for y_, r in zip(y, mine)]
                ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]], fmt='none', color=style[s][2],
                            capsize=2, lw=0.8)
        ax.set_xscale('log')
        ax.set_xticks([x for x, _ in ticks], [f"{x:.0f}\nL={L}" for x, L in ticks], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel('d / L (log scale)')
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == 'hours_per_1B':
            n = min((len(r['times_s']) for r in rows if r.get('times_s')), default=0)
            ax.set_title(f"median of {n} timed passes, bars min-max" + (" (few passes: noisy)" if n < 5 else ""),
                         fontsize=7)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _parse_shapes(text):
    """'16x1216,32x896' -> [(16, 1216), (32, 896)]; raises ValueError (one line) for anything
    that is not a comma-separated list of LxD pairs of positive integers."""
    shapes = []
    for item in filter(None, (i.strip() for i in text.split(','))):  # a trailing comma is harmless
        parts = item.lower().split('x')
        try:
            L, d = (int(x) for x in parts)
            assert L > 0 and d > 0
        except (ValueError, AssertionError):  # not two parts, not integers, or not positive
            raise ValueError(f"--shapes={text}: {item!r} is not an LxD pair of positive integers; "
                             f"write e.g. --shapes=16x1216,32x896") from None
        shapes.append((L, d))
    return shapes


def main(argv=None):
    p = argparse.ArgumentParser(description="Analytic and measured cost of depth (paper Sec. 4.4, Appendix D, Fig. 11).")
    p.add_argument('--schemes', default=','.join(STUDY_SCHEMES), help='comma-separated scheme names')
    p.add_argument('--family', default='main', help='experiment family of study/families.py (its shapes)')
    p.add_argument('--shapes', default=None, help='LxD pairs instead of the family shapes, e.g. 16x1216,32x896')
    p.add_argument('--seq_len', type=int, default=4096, help='prefill length T')
    p.add_argument('--logits', default='last', choices=('last', 'all'), help='LM head positions in the FLOPs')
    p.add_argument('--attention', default='causal', choices=('causal', 'full'), help='attention FLOP convention')
    p.add_argument('--measure', action='store_true', help='also time the prefill')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--dtype', default=None, help='default: bfloat16 on cuda, float32 on cpu')
    p.add_argument('--batch', type=int, default=8, help='sequences per measured prefill')
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--iters', type=int, default=10)
    p.add_argument('--results', default=None,
                   help='results.json with val_loss (default: out/<family>/results.json if present)')
    p.add_argument('--out', default='out/cost', help='output folder for cost.json and cost.png')
    p.add_argument('--kv_cache', action='store_true',
                   help='instead: the KV cache measured against kv_cache_bytes, and generation with and without '
                        'it (a prompt of --seq_len tokens, then --new_tokens, --iters rounds)')
    p.add_argument('--new_tokens', type=int, default=64, help='with --kv_cache: tokens generated per round')
    p.add_argument('--n_head', type=int, default=None, help='query heads (default: the family\'s)')
    p.add_argument('--n_kv_head', type=int, default=None, help='key/value heads (GQA; default: n_head)')
    p.add_argument('--memory', default=None, metavar='CONFIG',
                   help='instead: the predicted peak training memory of a train.py config at its micro-batch')
    p.add_argument('--budget_gib', type=finite_float, default=None,
                   help='with --memory: the micro-batch that fits this many GiB (as train.py --auto_batch=True)')
    p.add_argument('--compiled', choices=('True', 'False'), default=None,
                   help="with --memory: plan the model under GPT.compile_regions (default: the config's compile, "
                        "on if it leaves that to train.py)")
    p.add_argument('--fast', default=None,
                   help="with --memory: fast paths 'auto' (on for CUDA), True or False (default: the config's, "
                        "else 'auto'); on a CPU, --fast=True --dtype=bfloat16 plans a GPU run")
    args = p.parse_args(argv)
    if args.memory:
        from plan.memory import memory_main
        try:
            memory_main(args.memory, args.device, args.dtype or ('bfloat16' if args.device.startswith('cuda')
                                                                  else 'float32'), args.budget_gib,
                        None if args.compiled is None else args.compiled == 'True', args.fast)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        schemes = [s for s in args.schemes.split(',') if s]
        from residuals import RESIDUALS
        known = list(dict.fromkeys(STUDY_SCHEMES + EXTRA_SCHEMES + tuple(RESIDUALS)))
        bad = [s for s in schemes if s not in known]
        if bad:
            raise ValueError(f"unknown scheme {', '.join(bad)}; choose from: {', '.join(known)}")
        if args.seq_len < 1 or args.batch < 1:
            raise ValueError("--seq_len and --batch must be >= 1")
        shapes, config_kw = family_shapes(args.family)
        if args.shapes:
            by_shape = {(L, d): extra for L, d, extra in shapes}
            shapes = [(L, d, by_shape.get((L, d), {})) for L, d in _parse_shapes(args.shapes)]
        config_kw.update({k: getattr(args, k) for k in ('n_head', 'n_kv_head') if getattr(args, k) is not None})
        if args.kv_cache:
            rows = measure_kv_cache(schemes, shapes, args.seq_len, args.new_tokens, args.device, args.dtype,
                                    args.iters, **config_kw)
            r0 = rows[0]
            print(f"KV cache: a prompt of {r0['prompt_len']} tokens, then {r0['new_tokens']} greedy tokens, batch 1, "
                  f"{r0['device']}, {r0['dtype']}, {torch.get_num_threads()} threads; median of {args.iters} rounds")
            print(format_kv_table(rows))
            return 0
        rows = cost_rows(schemes, shapes, args.seq_len, args.logits, args.attention, **config_kw)
        if args.measure:
            measured = measure_prefill(schemes, shapes, args.batch, args.seq_len, args.device, args.dtype,
                                       args.warmup, args.iters, **config_kw)
            by_key = {(m['scheme'], m['L'], m['d']): m for m in measured}
            rows = [dict(r, **{k: v for k, v in by_key[(r['scheme'], r['L'], r['d'])].items()
                               if k not in ('scheme', 'L', 'd', 'params')}) for r in rows]
        results = args.results or os.path.join('out', args.family, 'results.json')
        losses = read_losses(results) if args.results or os.path.exists(results) else None
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    convention = (f"T={args.seq_len}, attention {args.attention} "
                  f"({'2' if args.attention == 'causal' else '4'}T²d), LM head on "
                  f"{'the last position' if args.logits == 'last' else 'all positions'}, KV bf16 for one sequence"
                  + (f"; measured: {rows[0]['device']}, {rows[0]['dtype']}, batch {rows[0]['batch']}"
                     if args.measure and rows else ''))  # as measure_prefill resolved them
    print(f"cost of depth, family {args.family}: {convention}")
    print(format_table(rows))
    print(f"\nprefill TFLOPs per sequence by shape ({convention}):")
    print(format_pivot(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'cost.json'), 'w') as f:
        json.dump(dict(family=args.family, seq_len=args.seq_len, logits=args.logits, attention=args.attention,
                       convention=convention, command='python cost.py ' + ' '.join(argv if argv is not None
                                                                                   else sys.argv[1:]),
                       rows=rows), f, indent=1)
    what = (f"shapes {args.shapes}" if args.shapes else f"family {args.family}")
    plot(rows, os.path.join(args.out, 'cost.png'), losses, title=f"{what}: {convention}")
    print(f"wrote {os.path.join(args.out, 'cost.json')} and cost.png")
    return 0


if __name__ == '__main__':
    sys.exit(main())
