"""
The shared DepthBench backbone (paper Sec. 2.2): a LLaMA-like decoder-only transformer.

Token embedding -> L blocks of (attention, SwiGLU MLP) -> final RMSNorm -> untied LM
head. RMSNorm, RoPE (theta 10000), MHA or GQA through F.scaled_dot_product_attention,
no biases, truncated-normal(0.02) init.

This file knows nothing of any residual scheme. The model holds the 2L *branches*
F_1..F_2L (attention, MLP, attention, MLP, ...) without norms; how they are wired
together (norms, residual adds, streams, depth attention) belongs to the scheme in
`residuals.py`, selected by `GPTConfig.residual`. A forward pass is

    state = scheme.begin(embedding)
    for b in order:  state = scheme.block(state, b, blocks[b], rope)   # or scheme.skip
    h = scheme.end(state)                       # the readout state, (B, T, d) or (B, T, m, d)
    logits = lm_head(scheme.readout(h, norm_f))  # readout: the final norm, (B, T, d); default norm_f(h)

so skipping, swapping or dropping blocks is just another `order` / `skip` for every
scheme alike (the diagnostics of the paper's Sec. 4 use exactly that).

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, residual='attnres'))
    logits, loss = model(idx, targets)        # idx, targets: (B, T) int64
    model.compile()                           # regional: each block's pieces, see compile_regions
    cache = KVCache(model.config.n_layer)     # generation: run the prompt, then one token at a time
    h = model.hidden(prompt, cache=cache); h = model.hidden(next_token, cache=cache)

A whole-model torch.compile(model) would trace all L blocks as one graph and take minutes to
compile at depth; `model.compile()` (= `compile_regions`) compiles each piece once for all
blocks, in seconds, and a plain torch.compile(model) is turned into it, with one warning.
"""

import inspect
import math
import warnings
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from residuals import RESIDUALS, RMSNorm


def ffn_hidden_size(n_embd):
    """SwiGLU hidden width of the study, 16 * ceil(8d/3 / 16) (paper Sec. 2.2)."""
    return 16 * math.ceil(8 * n_embd / 3 / 16)


@dataclass
class GPTConfig:
    # backbone (paper Sec. 2.2)
    vocab_size: int = 50280        # GPT-2 BPE has 50257 tokens; padded to the study's 50280
    block_size: int = 1024         # maximum sequence length T
    n_layer: int = 12              # L blocks = 2L sublayers
    n_head: int = 16               # query heads; head_dim = n_embd / n_head
    n_kv_head: int | None = None   # key/value heads (GQA); None = n_head (MHA)
    n_embd: int = 768              # d, the residual width
    ffn_hidden: int | None = None  # SwiGLU width; None = 16 * ceil(8d/3 / 16)
    norm_eps: float = 1e-6         # RMSNorm epsilon
    rope_theta: float = 10000.0
    init_std: float = 0.02         # truncated normal, cut at +-3 std
    residual: str = 'preln'        # the residual scheme, a key of residuals.RESIDUALS
    # scheme options (ignored by the schemes that do not use them)
    hc_streams: int = 4            # HC / mHC: number of streams m
    hc_out_init_scale: bool = True  # HC / mHC: divide attn-out and MLP-down init by sqrt(m) (the study's)
    hc_readout: str = 'auto'       # HC / mHC readout: 'auto' (the study's code: 'norm_sum' for HC,
                                   # 'mean' for mHC), 'norm_sum' (final norm per stream, then sum),
                                   # 'sum' (sum, then final norm: the HC paper's text), 'mean'
    mhc_sinkhorn_iters: int = 20   # mHC: Sinkhorn-Knopp iterations on the mixing matrix
    mhc_sinkhorn: str = 'liger'    # mHC: Sinkhorn of the study's default backend (liger_kernel:
                                   # per-output sums first, per-input last, eps 1e-6), or 'plain'
                                   # (its PyTorch backend's sinkhorn_log: per-input first, no eps)
    mhc_init: str = 'gap8'         # mHC: 'gap8' (the study's newest: b_res 0 / -8), 'gap8_diag8'
                                   # (its earlier b_res +8 / -8), or 'uniform'
    attnres_blocks: int = 8        # Block AttnRes: number of blocks (block size 2L / this)
    attnres_eps: float = 1e-5      # AttnRes / Block AttnRes: eps of the key norms, of the norm on
                                   # each read's result and of the final norm (the study's 1e-5)
    layerscale_init: float = 1e-4  # LayerScale: initial per-channel gain

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None:
            self.ffn_hidden = ffn_hidden_size(self.n_embd)
        for name in ('vocab_size', 'block_size', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'ffn_hidden'):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                             f"choose n_embd a multiple of n_head (head_dim = n_embd / n_head)")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head_dim = n_embd / n_head = {self.n_embd // self.n_head} must be even for RoPE")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head} (GQA groups)")

    @classmethod
    def from_dict(cls, d):
        """Builds a config from a dict (a checkpoint's model_args), ignoring keys that are not
        config fields. A field that changes the forward pass and that older checkpoints lack
        takes the value those checkpoints were trained with, not today's default:
        hc_readout 'sum', attnres_eps = norm_eps, mhc_sinkhorn 'plain'."""
        names = {f.name for f in fields(cls)}
        legacy = {'hc_readout': 'sum', 'attnres_eps': d.get('norm_eps', cls.norm_eps), 'mhc_sinkhorn': 'plain'}
        return cls(**{**legacy, **{k: v for k, v in d.items() if k in names}})


# -----------------------------------------------------------------------------
# building blocks

def rope_cache(seq_len, head_dim, theta=10000.0, device=None):
    """cos, sin of shape (seq_len, head_dim/2) for rotary position embedding (RoPE)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotates pairs (x_i, x_{i+hd/2}) of x (B, H, T, hd) by the position angle; cos/sin (T, hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    y = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return y.type_as(x)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with RoPE, no biases.

    `qkv`, `rotate`, `context`, `attend` and `out` are exposed separately so that a scheme
    which extends attention (MoDA's depth keys) can reuse the same pieces.
    """

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def qkv(self, x):
        """x (B, T, d) -> q (B, H, T, hd), k and v (B, H_kv, T, hd); no RoPE applied yet."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return q, k, v

    def rotate(self, t, rope):
        """RoPE on q or k (B, heads, T, hd) with rope = (cos, sin) (T, hd/2)."""
        return apply_rope(t, *rope)

    def context(self, k, v, cache=None):
        """The keys (after RoPE) and values this step's queries attend over: k, v themselves
        (B, H_kv, T, hd) in training; with a cache (generation: `KVCache.layer`), the cached
        ones of the earlier tokens followed by these, which the cache keeps (B, H_kv, pos + T, hd)."""
        return (k, v) if cache is None else cache.extend(k, v)

    def attend(self, q, k, v):
        """Causal attention, q (B, H, T, hd) over k, v (B, H_kv, Tk, hd), Tk >= T: the queries
        are the last T of the Tk positions (Tk > T only with cached keys). -> (B, H, T, hd)."""
        T, Tk = q.size(2), k.size(2)
        gqa = self.n_kv_head != self.n_head
        if Tk == T:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # SDPA's is_causal aligns the mask top-left; the new queries sit at the bottom right
        mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)  # (T, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def out(self, y):
        """y (B, H, T, hd) -> (B, T, d) through the output projection."""
        B, H, T, hd = y.shape
        return self.wo(y.transpose(1, 2).reshape(B, T, H * hd))

    def forward(self, x, rope, cache=None):
        q, k, v = self.qkv(x)
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        k, v = self.context(k, v, cache)
        y = self.attend(q, k, v)  # (B, H, T, hd)
        return self.out(y)


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate x) * w_up x), hidden width cfg.ffn_hidden, no biases."""

    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """The two branches of one transformer block, without norms or residual adds:
    attn(x, rope) and mlp(x), both (B, T, d) -> (B, T, d)."""

    def __init__(self, cfg):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)


# -----------------------------------------------------------------------------
# the KV cache of generation

class KVCache:
    """The KV cache of generation (paper Sec. 4.4): for every block b, the keys (after RoPE)
    and values of its attention for the tokens run so far, k[b] and v[b] (B, H_kv, pos, hd),
    in the dtype the attention computed them (bf16 under bf16 autocast): 2·L·pos·H_kv·hd
    elements, cost.kv_cache_bytes.

    Nothing else crosses from one token to the next, in any scheme: every depth read (AttnRes,
    Block AttnRes), stream routing (HC, mHC), norm and gain acts on one token's own states, and
    MoDA's depth slots are read only by the later blocks of the same token (docs/schemes.md,
    the KV cache). So a step runs every block on the new tokens alone, from their embeddings,
    and reads the earlier tokens through the cache (`GPT.hidden(idx, cache=cache)`):

        cache = KVCache(model.config.n_layer)
        h = model.hidden(prompt, cache=cache)     # (B, T, d): fills the cache, pos = T
        h = model.hidden(next_id, cache=cache)    # (B, 1, d): the token at position T, pos = T + 1

    pos plus the new tokens may not exceed block_size (the RoPE table, and the longest context
    the model was trained on). A step that raises leaves the cache unusable.
    """

    def __init__(self, n_layer):
        self.k = [None] * n_layer  # block b's keys (B, H_kv, pos, hd), None until it has run
        self.v = [None] * n_layer
        self.pos = 0               # tokens in the cache: the position of the next one

    def layer(self, b):
        """Block b's share of the cache, what its attention reads and extends."""
        return LayerCache(self, b)

    def extend(self, b, k, v):
        """Appends k, v (B, H_kv, T, hd) of this step's tokens to block b's; returns all of
        them (B, H_kv, pos + T, hd). Never in place: the step before keeps its tensors."""
        if self.k[b] is None:
            assert self.pos == 0, f"block {b} did not run for the {self.pos} cached tokens"
        else:
            assert self.k[b].size(2) == self.pos, f"block {b} ran twice in one step, or not in the last"
            k, v = torch.cat((self.k[b], k), dim=2), torch.cat((self.v[b], v), dim=2)
        self.k[b], self.v[b] = k, v
        return k, v

    def nbytes(self):
        """Bytes the cache holds: the storage under every cached key and value, each counted once."""
        storages = {}
        for t in self.k + self.v:
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


class LayerCache(NamedTuple):
    """Block b's share of a KVCache (Attention.context's `cache`)."""
    cache: KVCache
    b: int

    def extend(self, k, v):
        return self.cache.extend(self.b, k, v)


class CachedAttention:
    """Block b's attention during cached generation, what a scheme is handed as layer.attn:
    the same pieces (qkv, rotate, attend, out, ...), with `context` and the call reading and
    extending block b's cache."""

    def __init__(self, attn, cache):
        self.attn, self.cache = attn, cache

    def __getattr__(self, name):
        return getattr(self.attn, name)

    def context(self, k, v):
        return self.attn.context(k, v, self.cache)

    def __call__(self, x, rope):
        return self.attn(x, rope, self.cache)


class CachedBlock(NamedTuple):
    """Block b as a scheme sees it during cached generation: its MLP, its attention on the cache."""
    attn: CachedAttention
    mlp: nn.Module


# -----------------------------------------------------------------------------
# the model

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        if config.residual not in RESIDUALS:
            raise ValueError(f"unknown residual scheme {config.residual!r}; known: {', '.join(RESIDUALS)}")
        self.config = cfg = config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.residual = RESIDUALS[cfg.residual](cfg)
        self.norm_f = RMSNorm(cfg.n_embd, self.residual.final_norm_eps)  # the scheme's eps (AttnRes: attnres_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # untied from wte
        cos, sin = rope_cache(cfg.block_size, cfg.n_embd // cfg.n_head, cfg.rope_theta)
        self.register_buffer('rope_cos', cos, persistent=False)  # (block_size, hd/2)
        self.register_buffer('rope_sin', sin, persistent=False)
        self.regions_compiled = False  # compile_regions has run (a plain torch.compile(model) runs it once)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every tensor's initial value, in one place (docs/schemes.md, the backbone):
        - wte, lm_head and every Linear of the blocks (wq, wk, wv, wo, w_gate, w_up, w_down):
          normal(0, init_std) truncated at +-3 std; no depth-scaled output init;
        - norm_f gain: 1;
        - then the scheme's own `init_weights(model)`: its norms, gains, queries and
          routing parameters, and any scheme-specific rescaling of the backbone
          (DeepNorm's beta, HC/mHC's 1/sqrt(m) on attention-out and MLP-down). It runs last so that nothing
          overwrites e.g. the zero-initialised AttnRes pseudo-queries.
        Call it again to re-initialise a model; it never touches buffers."""
        std = self.config.init_std
        for w in [self.wte.weight, self.lm_head.weight] + [m.weight for m in self.blocks.modules()
                                                            if isinstance(m, nn.Linear)]:
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
        self.norm_f.reset_parameters()
        self.residual.init_weights(self)
        if self.rope_cos.device.type != 'meta':  # recompute in case the module was moved via to_empty()
            cos, sin = rope_cache(self.config.block_size, self.config.n_embd // self.config.n_head,
                                  self.config.rope_theta, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def compile_regions(self, backend='inductor'):
        """torch.compile the block, not the model: every branch (attention, MLP) and the
        scheme's `regions` are compiled on their own, each once for all blocks, so compile time
        does not grow with depth. A scheme that calls the attention's pieces one by one (MoDA:
        qkv, rotate, its region, out) runs the pieces outside its region eagerly: matmuls and
        reshapes, each of which would cost a compile of its own. A region that a fast path has
        replaced (fast/) stays as it is: the kernel is opaque to the compiler. `backend`:
        torch.compile's (tests use 'aot_eager'). Returns self."""
        for blk in self.blocks:
            blk.attn.compile(backend=backend)
            blk.mlp.compile(backend=backend)
        res = self.residual
        for name, grows in res.regions.items():
            if name not in vars(res):  # not replaced by a fast path
                setattr(res, name, compiled_region(getattr(res, name), grows, backend))
        self.regions_compiled = True
        return self

    def compile(self, backend='inductor'):
        """model.compile() is `compile_regions`: nn.Module.compile would trace the whole model
        as one graph, every block unrolled, and take minutes to compile at depth where the
        regions take seconds (a plain torch.compile(model) gets the regions too, see
        `forward`). Returns self."""
        return self.compile_regions(backend)

    def num_params(self, non_embedding=False):
        """Number of parameters; non_embedding=True leaves out the token embedding
        (a lookup, not a matmul; the LM head is counted since it is a matmul)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def hidden(self, idx, order=None, skip=(), record=None, cache=None):
        """Runs the embedding and the blocks; returns h = scheme.end(state), what `head` reads:
        (B, T, d) for one-stream schemes, the streams (B, T, m, d) for HC / mHC.

        idx: (B, T) int64 token ids, T <= block_size.
        order: block indices to run, in order (default range(n_layer)); dropping a block
            is an order without it, swapping two blocks is an order with them exchanged.
            The parameters of a block travel with its index.
        skip: block indices to *skip* with the scheme's skip rule (docs/probes.md): the block
            keeps its place in the order but contributes nothing.
        record: if a list, (probe_state, lens_state) after the embedding and after each
            block (len(order) + 1 entries) is appended to it (docs/probes.md, depth and lens states).
        cache: a KVCache (generation): idx are the tokens at positions cache.pos .. cache.pos
            + T - 1, after those in the cache, which every block's attention reads and extends;
            cache.pos + T <= block_size. None (training, probes): idx is the whole sequence.
        """
        B, T = idx.shape
        pos = 0 if cache is None else cache.pos
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence length {pos + T} exceeds block_size {self.config.block_size}")
        rope = (self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T])
        res = self.residual
        state = res.begin(self.wte(idx))
        if record is not None:
            record.append((res.probe(state), res.lens(state)))
        for b in (range(self.config.n_layer) if order is None else order):
            blk = self.blocks[b] if cache is None else CachedBlock(CachedAttention(self.blocks[b].attn, cache.layer(b)),
                                                                   self.blocks[b].mlp)
            state = res.skip(state, b) if b in skip else res.block(state, b, blk, rope)
            if record is not None:
                record.append((res.probe(state), res.lens(state)))
        if cache is not None:
            cache.pos += T
        return res.end(state)

    def head(self, h):
        """LM head on a readout state h (`hidden`'s result or a lens state) -> logits (B, T, V):
        lm_head(scheme.readout(h, norm_f)). The scheme applies the final RMSNorm (norm_f's gain)
        because where it goes is part of the scheme: norm_f(h) for most, per stream then summed
        for HC, with AttnRes's eps for AttnRes (residuals.Residual.readout)."""
        return self.lm_head(self.residual.readout(h, self.norm_f))

    def forward(self, idx, targets=None, order=None, skip=()):
        """idx, targets: (B, T) int64 -> logits (B, T, V), loss (mean next-token cross-entropy
        in nats over targets != -1, None without targets). With targets, the head and the loss
        are `lm_head_loss` (the loss in chunks; its logits carry no gradient).
        Under a plain torch.compile(model) this runs `whole_model_compiled` instead."""
        if torch.compiler.is_compiling():  # torch.compile(model) is tracing: all L blocks in one graph
            return whole_model_compiled(self, idx, targets, order, skip)
        h = self.hidden(idx, order, skip)
        if targets is None:
            return self.head(h), None
        x = self.residual.readout(h, self.norm_f)                          # (B, T, d)
        return lm_head_loss(x, self.lm_head.weight, targets)

    # -------------------------------------------------------------------------
    # optimizer and efficiency

    def configure_optimizers(self, weight_decay, learning_rate, betas, eps=1e-8, device_type='cpu',
                             decay_on='all'):
        """AdamW with two groups, decayed (weight_decay) and not (0), chosen by `decay_on`:
        'all' (default, the study's optimizer: one AdamW over every parameter, paper Sec. 2.3):
            every parameter decays (embedding, LM head, linear weights, norm gains, AttnRes
            queries and key gains, MoDA W_kv, HC dynamic projections and scales, mHC phi)
            except those the scheme exempts in `no_weight_decay()` (the study's
            hyper_connections_common.py: HC static_alpha, static_beta; mHC bias and gates);
        'matrices' (nanoGPT's): only parameters with >= 2 dims decay, minus the same exemptions.
        Raises ValueError for another decay_on."""
        if decay_on not in ('all', 'matrices'):
            raise ValueError(f"decay_on must be 'all' (the study's groups) or 'matrices' (nanoGPT's), got {decay_on!r}")
        no_decay = {'residual.' + n for n in self.residual.no_weight_decay()}
        assert no_decay <= {n for n, _ in self.named_parameters()}, "no_weight_decay() names a missing parameter"
        decay, other = [], []
        for n, p in self.named_parameters():
            if p.requires_grad:
                decays = n not in no_decay and (decay_on == 'all' or p.dim() >= 2)
                (decay if decays else other).append(p)
        groups = [{'params': decay, 'weight_decay': weight_decay}, {'params': other, 'weight_decay': 0.0}]
        fused = device_type == 'cuda' and 'fused' in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused)

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12*L*d*T,
        N = parameters excluding the embedding lookup. Full (non-causal) attention is
        counted, as in PaLM; cost.py has the exact per-scheme forward formulas."""
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq_len


LOSS_CHUNK = 2048  # token rows per chunk of lm_head_loss: (2048, V) fp32 logits at a time


def lm_head_loss(x, weight, targets, chunk=LOSS_CHUNK):
    """The LM head and the mean next-token cross-entropy (nats, over targets != -1) without
    the (B, T, V) fp32 logits: x (B, T, d) (the final norm's output), weight (V, d) ->
    logits (B, T, V) in the head's dtype (bf16 under autocast; no gradient flows through
    them), loss (scalar, fp32; fp64 for fp64 x). Equal to F.cross_entropy(logits.float(),
    targets) up to summation order: the same bf16 products and fp32 softmax (fp64 for fp64
    x), computed `chunk` token rows at a time. With gradients on, each chunk's gradients (of
    x, and summed, of weight) are computed at once from its softmax and kept, (B, T, d) and
    (V, d) fp32, instead of the (B, T, V) fp32 log-probabilities the plain loss keeps for its
    backward (the fused linear cross-entropy of Liger-Kernel, arXiv 2410.10989, in torch)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return HeadLoss.apply(x, weight, targets, dtype, chunk)


class HeadLoss(torch.autograd.Function):
    """lm_head_loss's autograd: forward computes the loss and, when grads are needed, the
    gradients; backward scales them by the loss's incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, targets, dtype, chunk):
        B, T, d = x.shape
        rows, t = x.reshape(B * T, d), targets.reshape(B * T)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            acc = torch.promote_types(dtype, torch.float32)                  # the softmax's dtype
            w = weight.to(dtype)                                             # (V, d), once
            logits = rows.new_empty(B * T, w.size(0), dtype=dtype)
            n_valid = (t != -1).sum()
            loss = torch.zeros((), dtype=acc, device=x.device)
            gx = torch.empty_like(rows, dtype=torch.promote_types(x.dtype, torch.float32)) if grads else None
            gw = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if grads else None
            for i in range(0, B * T, chunk):
                xc, tc = rows[i:i + chunk].to(dtype), t[i:i + chunk]
                lc = torch.mm(xc, w.t(), out=logits[i:i + chunk]).to(acc, copy=True)  # (n, V) fp32 (fp64 for fp64)
                valid = tc != -1
                tsafe = tc.clamp(min=0).unsqueeze(1)
                lse = torch.logsumexp(lc, dim=-1)
                loss += ((lse - lc.gather(1, tsafe).squeeze(1)) * valid).sum()
                if grads:  # d loss_sum / d logits = softmax - onehot(target), 0 on ignored rows
                    g = lc.sub_(lse.unsqueeze(1)).exp_()
                    g.scatter_add_(1, tsafe, -torch.ones_like(tsafe, dtype=g.dtype))
                    g = (g * valid.unsqueeze(1)).to(dtype)
                    gx[i:i + chunk] = g @ w
                    gw += (g.t() @ xc).to(gw.dtype)
        ctx.save_for_backward(gx, gw, n_valid)
        ctx.shapes = x.shape, x.dtype, weight.dtype
        ctx.mark_non_differentiable(logits)
        return logits.view(B, T, -1), loss / n_valid

    @staticmethod
    def backward(ctx, _, gloss):
        gx, gw, n_valid = ctx.saved_tensors
        shape, xdt, wdt = ctx.shapes
        s = gloss / n_valid
        return (None if gx is None else (gx * s).to(xdt).view(shape),
                None if gw is None else (gw * s).to(wdt), None, None, None)


@torch.compiler.disable
def whole_model_compiled(model, idx, targets=None, order=None, skip=()):
    """What a plain torch.compile(model) runs: the model's forward with its regions compiled
    (`GPT.compile_regions`, inductor, done once, with one warning that names model.compile()),
    instead of one graph of all L blocks, which takes minutes to compile at depth where the
    regions take seconds (docs/performance.md, compile time against depth). Dynamo does not
    trace into this function (compiler.disable); the regions it calls are compiled on their own."""
    if not model.regions_compiled:
        warnings.warn(f"torch.compile(model) would trace all {model.config.n_layer} blocks as one graph, which "
                      f"takes minutes to compile at depth: compiling each block's pieces instead, as "
                      f"model.compile() does (call model.compile() rather than torch.compile(model))", stacklevel=2)
        model.compile_regions()
    return model.forward(idx, targets, order, skip)


def compiled_region(fn, grows, backend='inductor'):
    """torch.compile(fn), with the dims `grows` = [(argument, dim)] marked dynamic at every
    call: one compile serves every depth, the other dims stay static (faster kernels)."""
    compiled = torch.compile(fn, backend=backend)

    def region(*args):
        for i, dim in grows:
            torch._dynamo.decorators.mark_unbacked(args[i], dim)
        return compiled(*args)
    return region


# Dense bf16 tensor-core peak FLOP/s per accelerator, from the vendors' datasheets, whose "with
# sparsity" figures are halved: NVIDIA H100 SXM 1,979, NVL 1,671, PCIe 1,513 TFLOPS sparse; H200
# SXM 1,979, NVL 1,671; A100 624; B200 (HGX) 4.5 PFLOPS; L40S 733; L40 362; L4 242; A10 250;
# GeForce RTX 4090 330.3 and 3090 142 with FP32 accumulate (the Ada and GA102 whitepapers); AMD
# MI300X 1,307.4 and MI250X 383 dense. The first entry whose key is in torch.cuda.get_device_name()
# wins, so a variant comes before its family ('H100 NVL' before 'H100'). None: a name whose peak
# is not verified here, or that a shorter key would match wrongly (GB200 holds 'B200'): no MFU
# rather than a wrong one, as for every name not listed. CUDA's names: 'NVIDIA H100 80GB HBM3'
# (SXM), 'NVIDIA H100 PCIe', 'NVIDIA H100 NVL', 'NVIDIA H200', 'NVIDIA H200 NVL', 'NVIDIA GH200 480GB'.
PEAK_FLOPS = [  # (substring of the device name, peak FLOP/s or None)
    ('H100 NVL', 835e12), ('H100 PCIe', 756e12), ('H100', 989e12),
    ('H200 NVL', 835e12), ('GH200', 989e12), ('H200', 989e12),
    ('H800 PCIe', 756e12), ('H800', 989e12), ('H20', None),
    ('GB200', None), ('B200', 2250e12), ('B100', None),
    ('A100', 312e12), ('A800', 312e12), ('A10G', None), ('A10', 125e12),
    ('L40S', 362e12), ('L40', 181e12), ('L4', 121e12),
    ('RTX 4090', 165e12), ('RTX 3090', 71e12), ('V100', None),  # V100: no bf16
    ('MI300X', 1307e12), ('MI250X', 383e12),
]


def peak_flops(device):
    """Dense bf16 peak FLOP/s of `device` (torch.device or str), or None when unknown (CPU,
    or an accelerator not in PEAK_FLOPS: better no MFU than a wrong one)."""
    device = torch.device(device)
    if device.type != 'cuda' or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS:
        if key in name:
            return peak
    return None


def estimate_mfu(model, tokens_per_s, seq_len, device, n_devices=1):
    """Model FLOPs utilisation: achieved training FLOP/s / (peak FLOP/s x devices), in [0, 1],
    or None when the device's peak is unknown."""
    peak = peak_flops(device)
    if peak is None:
        return None
    return model.flops_per_token(seq_len) * tokens_per_s / (peak * n_devices)
