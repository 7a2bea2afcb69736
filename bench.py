"""
What each residual scheme costs in wall-clock time and memory on this machine
(paper Sec. 4.4, Fig. 11), measured in ONE run against two references:

  (a) Pre-LN, the study's baseline, built by model.py like every scheme;
  (b) `PlainGPT`, the same pre-norm transformer written here as plainly as possible
      (RMSNorm, RoPE, attention, SwiGLU; no scheme machinery). It has exactly Pre-LN's
      parameters and, given the same weights, Pre-LN's loss (tests/test_bench.py), so
      "Pre-LN vs plain" is the price of the scheme interface itself.

    python bench.py --schemes=preln,attnres,hc --n_layer=8 --n_embd=128 --n_head=4 \\
        --block_size=256 --batch_size=8 --vocab_size=257 --device=cpu --compile=False --steps=20 --warmup=5
    python bench.py --schemes=all --device=cuda --compile=True     # every registered scheme, bf16 autocast
    python bench.py --schemes=preln,attnres --n_layer=32 --batch_size=4 --steps=0   # memory only
    python bench.py --hc_package=True ...   # also time the PyPI hyper-connections package in PlainGPT
    python bench.py --threads=1 ...         # one torch thread: on a CPU shared with other jobs, two
                                            # OpenMP threads on two busy cores are slow and erratic
    python bench.py --suite=fast --schemes=attnres,hc,mhc,moda ...   # each scheme fast / plain (fast/)
    python bench.py --suite=compile ...     # cold-cache compile time of the training step against depth
    python bench.py --suite=step            # the 400M micro-step's kernels, bytes, FLOPs and estimated
                                            # H100/H200/A100 time, counted without a GPU (perf/step.py)
    python tools/gpu_check.py               # the staged GPU check (docs/gpu.md), a tool of its own

For every scheme: training-step time (forward + backward + AdamW step), prefill
throughput (no_grad forward, tokens/s), MFU (CUDA only: model.estimate_mfu; None on the
CPU), memory, and ΔF/F from cost.py; ratios against Pre-LN and against PlainGPT, and a
PASS/FAIL against the time budget

    t_scheme / t_PreLN <= TARGETS[scheme]     (HC, mHC: 1.3; Full and Block AttnRes: 1.25)
    t_scheme / t_PreLN <= (1 + ΔF/F) x 1.10   (every other scheme)
    t_PreLN / t_plain <= 1.0                  (Pre-LN)

Memory: on CUDA the peak allocated during one training step above what was allocated
before it (`torch.cuda.max_memory_allocated`); on every device the bytes of the unique
storages autograd saves for backward in one forward pass (`saved_activation_bytes`), a
deterministic proxy of activation memory, taken on the eager model also with --compile=True
(the CPU allocator is not tracked). --compile=True compiles each GPT as train.py does
(GPT.compile_regions: every block's sublayers and the scheme's regions) and PlainGPT whole;
--fast puts the fast paths of fast/ in place as train.py does (checked at start-up).

Timing discipline (as in modded-nanogpt): all models are built and warmed up (and
compiled, with --compile=True) on the exact shapes first; then model and optimizer state
are reset, and `rounds` rounds run each scheme's timed steps in turn, rotating the order
every round (ABC, BCA, CAB, ...) so that background load hits every scheme alike. A ratio
is the median over rounds of the per-round ratio; CUDA is synchronised at every timing
boundary. The table's last lines give the run's noise (half the interquartile range of
the per-round ratios): a verdict that close to its target is not settled by the run.
With --compile=True, graphs compiled after warm-up are counted as recompiles (target 0).
Results, with the command, versions and hardware, go to `out` as JSON.
"""

import json
import os
import platform
import statistics
import sys
import time
import types
import uuid
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

import cost
import fast as fastpath
from plan.memory import saved_activation_bytes
from configurator import ConfigError, comments_from_source, configure
from model import GPT, GPTConfig, estimate_mfu
from residuals import RESIDUALS

# -----------------------------------------------------------------------------
# default config values (python bench.py --help lists them)
schemes = 'preln,attnres'  # comma-separated keys of residuals.RESIDUALS, or 'all'; Pre-LN is always added
n_layer = 8  # L blocks
n_embd = 128  # d
n_head = 4  # query heads
n_kv_head = None  # key/value heads (GQA); None = n_head
block_size = 256  # sequence length T of every measured batch
batch_size = 8  # sequences per batch B
vocab_size = 257  # byte-level vocabulary (256 bytes + end of text)
hc_streams = 4  # HC/mHC streams m
attnres_blocks = 8  # Block AttnRes blocks
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu' or 'cuda'
dtype = None  # None = bfloat16 autocast on CUDA, float32 elsewhere; 'float32', 'bfloat16', 'float16'
compile = False  # compile every model (GPT.compile_regions, as train.py; PlainGPT whole); recompiles after warm-up are reported
fast = 'auto'  # fast paths (fast/): 'auto' = on for CUDA, off on the CPU; True; False = the plain code of residuals.py
steps = 20  # timed training steps (and prefill passes) per model, spread over the rounds (rounded up to a multiple of them); 0 = memory only
warmup = 5  # untimed training steps (and prefill passes) per model before timing
rounds = 5  # interleaved timing rounds; ratios are medians over rounds
hc_package = False  # also time PlainGPT with the PyPI hyper-connections package (4 streams), if installed
learning_rate = 3e-4  # AdamW learning rate of the timed steps (does not affect the timing)
threads = 0  # torch CPU threads; 0 = torch's default (one per core). 1 is steadier on a shared machine
seed = 1337
out = 'out/bench.json'  # results as JSON; '' = do not write
suite = 'bench'  # 'bench': the timing table above; 'fast': each scheme with fast paths on / off; 'compile': cold compile time vs depth
compile_layers = '4,8,16,32'  # --suite=compile: the depths L to compile each scheme at
compile_schemes = 'preln,attnres,blockattnres,hc,mhc,moda'  # --suite=compile: schemes, each at every depth
compile_steps = 5  # --suite=compile: timed compiled training steps after the first (compiling) one
compile_repeats = 1  # --suite=compile: rounds of cold compiles per depth; rows give the medians
step_config = 'config/preln_L32.py'  # --suite=step: the shape (L, d, heads, T, micro-batch, V) of this config file, flags given above override it; '' = the flags
step_schemes = 'preln,attnres,blockattnres,hc,mhc,moda'  # --suite=step: schemes to count (Pre-LN always)
step_fast = 'cuda'  # --suite=step: fast paths as 'cuda' selects them with Triton (and each AttnRes scheme again on fla-core's read, HC and mHC on Liger's ops), 'cuda_fla' (fla-core's read only), 'cuda_liger' (Liger's ops only), 'cuda_torch' (fast/'s torch forms), or 'off'

# Time budget per scheme against Pre-LN: HC/mHC (m streams) and (Block) AttnRes (depth
# attention over all earlier sublayers) have flat bounds; every other scheme, MoDA included,
# may cost its extra FLOPs (ΔF/F from cost.py) plus 10%.
TARGETS = {'hc': 1.3, 'mhc': 1.3, 'attnres': 1.25, 'blockattnres': 1.25}  # flat bounds x Pre-LN
SINGLE_STREAM_TARGET = 1.10  # every other scheme: (1 + ΔF/F) x 1.10 x Pre-LN
PRELN_VS_PLAIN_TARGET = 1.0
HC_PACKAGE_VERSION = '0.4.11'

# -----------------------------------------------------------------------------
# the plain baseline


def rope_tables(T, head_dim, theta):
    """cos, sin (T, head_dim/2) of RoPE."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope(x, cos, sin):
    """Rotates the halves (x1, x2) of x (B, H, T, hd) by the position angle, in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class PlainBlock(nn.Module):
    """x <- x + Attn(RMSNorm(x)); x <- x + SwiGLU(RMSNorm(x)). Optionally the two residual
    adds are hyper-connections of the PyPI package: hc = (attn_hc, mlp_hc)."""

    def __init__(self, cfg, hc=None):
        super().__init__()
        d, hd = cfg.n_embd, cfg.n_embd // cfg.n_head
        self.H, self.Hkv, self.hd = cfg.n_head, cfg.n_kv_head, hd
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=cfg.norm_eps), nn.RMSNorm(d, eps=cfg.norm_eps)
        self.wq, self.wo = nn.Linear(d, self.H * hd, bias=False), nn.Linear(self.H * hd, d, bias=False)
        self.wk, self.wv = nn.Linear(d, self.Hkv * hd, bias=False), nn.Linear(d, self.Hkv * hd, bias=False)
        self.w_gate, self.w_up = nn.Linear(d, cfg.ffn_hidden, bias=False), nn.Linear(d, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, d, bias=False)
        self.hc = nn.ModuleList(hc) if hc is not None else None

    def attn(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.H, self.hd).transpose(1, 2)     # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.Hkv, self.hd).transpose(1, 2)   # (B, Hkv, T, hd)
        v = self.wv(x).view(B, T, self.Hkv, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True,
                                           enable_gqa=self.Hkv != self.H)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def mlp(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    def forward(self, x, cos, sin):
        if self.hc is None:
            x = x + self.attn(self.attn_norm(x), cos, sin)
            return x + self.mlp(self.mlp_norm(x))
        branch_in, add = self.hc[0](x)                   # x: (B*m, T, d), branch_in: (B, T, d)
        x = add(self.attn(self.attn_norm(branch_in), cos, sin))
        branch_in, add = self.hc[1](x)
        return add(self.mlp(self.mlp_norm(branch_in)))


class PlainGPT(nn.Module):
    """The named baseline of bench.py's "Pre-LN vs plain" comparison (the cost of the scheme
    interface, docs/performance.md), not a model to train (train.py trains model.GPT).
    A pre-norm GPT with the backbone of model.py (paper Sec. 2.2) and nothing else: the
    same parameters as GPT(cfg) with residual='preln' (state_dict names map by
    `plain_state_dict`). forward(idx, targets) -> (logits (B, T, V), mean cross-entropy in
    nats or None), as GPT. hc_streams > 0 wires the PyPI hyper-connections package (one
    HyperConnections per sublayer; streams expanded after the embedding, summed before
    the final norm)."""

    def __init__(self, cfg, hc_streams=0):
        super().__init__()
        self.config = cfg
        hc = [None] * cfg.n_layer
        self.expand = self.reduce = nn.Identity()
        if hc_streams:
            from hyper_connections import get_init_and_expand_reduce_stream_functions
            make, self.expand, self.reduce = get_init_and_expand_reduce_stream_functions(hc_streams)
            hc = [(make(dim=cfg.n_embd, layer_index=2 * b), make(dim=cfg.n_embd, layer_index=2 * b + 1))
                  for b in range(cfg.n_layer)]
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList([PlainBlock(cfg, hc[b]) for b in range(cfg.n_layer)])
        self.norm_f = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.block_size, cfg.n_embd // cfg.n_head, cfg.rope_theta)
        self.register_buffer('cos', cos, persistent=False)
        self.register_buffer('sin', sin, persistent=False)
        std = cfg.init_std
        for m in self.modules():  # the package's routing parameters keep their own init
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=std, a=-3 * std, b=3 * std)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len):
        """PaLM's training FLOPs per token, 6N + 12*L*d*T (N without the embedding), as GPT."""
        n = self.num_params() - self.wte.weight.numel()
        return 6 * n + 12 * self.config.n_layer * self.config.n_embd * seq_len

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.expand(self.wte(idx))
        for block in self.blocks:
            x = block(x, self.cos[:T], self.sin[:T])
        logits = self.lm_head(self.norm_f(self.reduce(x)))
        loss = None if targets is None else F.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                            targets.reshape(-1), ignore_index=-1)
        return logits, loss


def plain_state_dict(gpt_state):
    """A Pre-LN GPT's state_dict renamed for PlainGPT: blocks.b.attn.wq -> blocks.b.wq,
    blocks.b.mlp.w_up -> blocks.b.w_up, residual.layers.b.attn_norm -> blocks.b.attn_norm.
    Raises KeyError for a key that has no place in PlainGPT (not a Pre-LN state)."""
    out = {}
    for k, v in gpt_state.items():
        parts = k.split('.')
        if parts[0] in ('wte', 'norm_f', 'lm_head'):
            out[k] = v
        elif parts[0] == 'blocks' and parts[2] in ('attn', 'mlp'):
            out['.'.join(['blocks', parts[1]] + parts[3:])] = v
        elif parts[:2] == ['residual', 'layers'] and parts[3] in ('attn_norm', 'mlp_norm'):
            out['.'.join(['blocks'] + parts[2:])] = v
        else:
            raise KeyError(f"{k} has no place in PlainGPT: plain_state_dict maps Pre-LN models only")
    return out

# -----------------------------------------------------------------------------
# measurements


def flop_ratio(cfg, seq_len):
    """ΔF/F of cfg's scheme from cost.py (extra_flops / Pre-LN forward_flops, LM head on all
    positions, causal attention), or None for a scheme cost.py has no formula for."""
    kw = dict(n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, hc_streams=cfg.hc_streams,
              attnres_blocks=cfg.attnres_blocks)
    try:
        extra = cost.extra_flops(cfg.residual, cfg.n_layer, cfg.n_embd, seq_len, **kw)
    except ValueError:  # unknown scheme (a new one added to residuals.py only)
        return None
    base = cost.forward_flops(cfg.n_layer, cfg.n_embd, seq_len, residual='preln', ffn_hidden=cfg.ffn_hidden,
                              vocab_size=cfg.vocab_size, logits='all', attention='causal', **kw)
    return extra / base


def time_target(name, dff):
    """The step-time bound of a row, x Pre-LN: a flat bound for the multi-stream and
    depth-attention schemes (TARGETS), (1 + ΔF/F) x 1.10 for every other scheme."""
    if name in TARGETS:
        return TARGETS[name]
    return (1 + (dff or 0.0)) * SINGLE_STREAM_TARGET


class Entry:
    """One timed model: its (possibly compiled) callable, optimizer, and measurements."""

    def __init__(self, name, kind, model, fn, opt, cfg):
        self.name, self.kind, self.model, self.fn, self.opt, self.cfg = name, kind, model, fn, opt, cfg
        self.train_s, self.prefill_s = [], []   # per-round seconds per step / per pass
        self.recompiles, self.graph_breaks_warmup, self.graphs_warmup = 0, 0, 0
        self.saved_bytes = self.cuda_peak_bytes = None
        self.init_model = {k: v.clone() for k, v in model.state_dict().items()}
        self.init_opt = opt.state_dict()

    def reset(self):
        """Back to the initial weights and an empty optimizer state (in place: compiled code stays valid)."""
        self.model.load_state_dict(self.init_model)
        self.opt.load_state_dict(self.init_opt)
        self.opt.zero_grad(set_to_none=True)


def sync(dev):
    if dev.type == 'cuda':
        torch.cuda.synchronize(dev)


def graph_counts():
    """(graphs compiled so far, graph breaks so far), from torch._dynamo's counters."""
    from torch._dynamo.utils import counters
    return counters['stats']['unique_graphs'], sum(counters['graph_break'].values())


def steps_per_round(steps, rounds):
    """Timed steps of each model in each round: steps spread over the rounds, rounded up, so
    that at least `steps` are timed (0 = memory only)."""
    return -(-steps // rounds)


def run(names, cfg_kw, dev, dtype_name, compile_, steps, warmup, rounds, hc_pkg, lr, seed_, log=None, fast_setting=False):
    """Builds the schemes `names` (Pre-LN first), PlainGPT and, with hc_pkg, the package's HC in
    PlainGPT; measures memory, warms up (compiles) and times them in interleaved rounds.
    cfg_kw: GPTConfig fields plus batch_size. Returns one dict per model (the JSON rows):
    times in ms (median over rounds, and per round), tokens/s, bytes, ratios, targets."""
    log = log or (lambda *a: print(*a, flush=True))  # progress lines, unbuffered even into a file
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype_name]
    ctx = nullcontext() if dtype_name == 'float32' else torch.autocast(device_type=dev.type, dtype=ptdtype)
    B, T = cfg_kw['batch_size'], cfg_kw['block_size']
    gcfg = {k: v for k, v in cfg_kw.items() if k != 'batch_size'}
    g = torch.Generator().manual_seed(seed_)
    idx = torch.randint(0, gcfg['vocab_size'], (B, T + 1), generator=g)
    x, y = idx[:, :-1].contiguous().to(dev), idx[:, 1:].contiguous().to(dev)

    entries = []
    if compile_:  # every GPT shares GPT.forward's code: one cache entry per model and grad mode
        import torch._dynamo.config as dynamo_config
        for limit in ('recompile_limit', 'cache_size_limit', 'accumulated_recompile_limit',
                      'accumulated_cache_size_limit'):
            if hasattr(dynamo_config, limit):
                setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 4 * (len(names) + 2)))

    def add(name, kind, model, cfg):
        model.to(dev)
        fn = model
        if isinstance(model, GPT):  # as train.py runs it: its fast paths, its compiled regions
            fastpath.setup(model, fast_setting, dev)
            if compile_:
                model.compile_regions()
        elif compile_:
            fn = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=dev.type == 'cuda')
        entries.append(Entry(name, kind, model, fn, opt, cfg))

    for name in names:
        torch.manual_seed(seed_)
        cfg = GPTConfig(**gcfg, residual=name)
        add(name, 'scheme', GPT(cfg), cfg)
    torch.manual_seed(seed_)
    plain_cfg = GPTConfig(**gcfg)
    add('plain', 'plain', PlainGPT(plain_cfg), plain_cfg)
    byname = {e.name: e for e in entries}
    assert byname['plain'].model.num_params() == byname['preln'].model.num_params(), \
        "PlainGPT must have exactly Pre-LN's parameters"
    if hc_pkg:
        from importlib.metadata import PackageNotFoundError, version
        try:
            pkg_version = version('hyper-connections')
        except PackageNotFoundError:
            pkg_version = None
        if pkg_version is None:
            log(f"hc_package: hyper-connections is not installed (pip install hyper-connections=="
                f"{HC_PACKAGE_VERSION}); skipping it")
        else:
            if pkg_version != HC_PACKAGE_VERSION:
                log(f"hc_package: hyper-connections {pkg_version} installed; the reference is {HC_PACKAGE_VERSION}")
            torch.manual_seed(seed_)
            add('hc_package', 'package', PlainGPT(plain_cfg, hc_streams=gcfg.get('hc_streams', 4)), plain_cfg)

    def train_step(e):
        with ctx:
            _, loss = e.fn(x, y)
        loss.backward()
        e.opt.step()
        e.opt.zero_grad(set_to_none=True)

    def prefill(e):
        with torch.no_grad(), ctx:
            e.fn(x)

    # memory (eager, deterministic) and warm-up / compilation on the exact shapes
    for e in entries:
        e.saved_bytes = saved_activation_bytes(e.model, x, y, ctx)
        g0, b0 = graph_counts() if compile_ else (0, 0)
        t0 = time.perf_counter()
        for _ in range(max(warmup, 1 if compile_ else 0)):
            train_step(e)
            prefill(e)
        sync(dev)
        if compile_:
            g1, b1 = graph_counts()
            e.graphs_warmup, e.graph_breaks_warmup = g1 - g0, b1 - b0
        log(f"warm-up {e.name:>14}: {time.perf_counter() - t0:7.1f} s, {e.saved_bytes / 2**20:8.1f} MiB saved")
        if dev.type == 'cuda':
            e.reset()
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
            train_step(e)
            sync(dev)
            e.cuda_peak_bytes = torch.cuda.max_memory_allocated(dev) - before
        e.reset()

    # interleaved timing rounds
    per_round = steps_per_round(steps, rounds)
    for r in range(rounds if steps else 0):
        order = entries[r % len(entries):] + entries[:r % len(entries)]
        for phase, fn, store in (('train', train_step, 'train_s'), ('prefill', prefill, 'prefill_s')):
            for e in order:
                g0 = graph_counts()[0] if compile_ else 0
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(per_round):
                    fn(e)
                sync(dev)
                getattr(e, store).append((time.perf_counter() - t0) / per_round)
                if compile_:
                    e.recompiles += graph_counts()[0] - g0
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{e.name} {e.train_s[-1] * 1e3:.0f}" for e in entries)
            + " ms/step")

    # results
    def paired(e, ref, store):
        """Median over rounds of the per-round time ratio e / ref."""
        a, b = getattr(e, store), getattr(ref, store)
        return statistics.median(x / y for x, y in zip(a, b)) if a else None

    def spread(e, ref, store):
        """Half the interquartile range of the per-round ratios e / ref: the run's noise."""
        ratios = [x / y for x, y in zip(getattr(e, store), getattr(ref, store))]
        if len(ratios) < 2:
            return None
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        return (q3 - q1) / 2

    preln, plain = byname['preln'], byname['plain']
    rows = []
    for e in entries:
        dff = flop_ratio(e.cfg, T) if e.kind == 'scheme' else None
        row = dict(name=e.name, kind=e.kind, params=e.model.num_params(), delta_f_over_f=dff,
                   train_ms=statistics.median(e.train_s) * 1e3 if e.train_s else None,
                   prefill_ms=statistics.median(e.prefill_s) * 1e3 if e.prefill_s else None,
                   train_ms_rounds=[t * 1e3 for t in e.train_s], prefill_ms_rounds=[t * 1e3 for t in e.prefill_s],
                   saved_bytes=e.saved_bytes, cuda_peak_bytes=e.cuda_peak_bytes,
                   mem_vs_preln=e.saved_bytes / preln.saved_bytes,
                   train_vs_preln=paired(e, preln, 'train_s'), train_vs_plain=paired(e, plain, 'train_s'),
                   prefill_vs_preln=paired(e, preln, 'prefill_s'), prefill_vs_plain=paired(e, plain, 'prefill_s'))
        row['train_tokens_per_s'] = B * T / row['train_ms'] * 1e3 if row['train_ms'] else None
        row['prefill_tokens_per_s'] = B * T / row['prefill_ms'] * 1e3 if row['prefill_ms'] else None
        row['mfu'] = estimate_mfu(e.model, row['train_tokens_per_s'], T, dev) if row['train_ms'] else None
        if compile_:
            row.update(graphs_warmup=e.graphs_warmup, graph_breaks_warmup=e.graph_breaks_warmup,
                       recompiles=e.recompiles)
        # the budget: schemes against Pre-LN, Pre-LN against the plain GPT
        if e.name == 'preln':
            row.update(target=PRELN_VS_PLAIN_TARGET, target_vs='plain')
        elif e.kind == 'scheme':
            row.update(target=time_target(e.name, dff), target_vs='preln')
        if 'target' in row and row['train_ms']:
            ref = 'plain' if e.name == 'preln' else 'preln'
            row['pass_train'] = row[f'train_vs_{ref}'] <= row['target']
            row['pass_prefill'] = row[f'prefill_vs_{ref}'] <= row['target']
            row['train_ratio_noise'] = spread(e, byname[ref], 'train_s')
            row['prefill_ratio_noise'] = spread(e, byname[ref], 'prefill_s')
        if e.kind == 'package' and 'hc' in byname and row['train_ms']:
            row['hc_vs_package_train'] = paired(byname['hc'], e, 'train_s')
            row['hc_vs_package_prefill'] = paired(byname['hc'], e, 'prefill_s')
        rows.append(row)
    return rows


def format_table(rows, device_type):
    """The results as a fixed-width text table (ratios are medians of per-round ratios)."""
    mem = 'saved MiB' if device_type != 'cuda' else 'step MiB'
    head = (f"{'scheme':>13} {'params':>9} {'ΔF/F':>6} {'step ms':>8} {'xPreLN':>6} {'xplain':>6} "
            f"{'prefill tok/s':>13} {'xPreLN':>6} {'xplain':>6} {mem:>9} {'xPreLN':>6} {'MFU':>5} "
            f"{'target':>12} {'train':>5} {'prefill':>7}")
    lines = [head, '-' * len(head)]
    def f(v, spec):  # a number, or '-' in the same width
        return format(v, spec) if v is not None else '-'.rjust(int(spec.split('.')[0].strip(',') or 0))
    for r in rows:
        mib = (r['cuda_peak_bytes'] if device_type == 'cuda' else r['saved_bytes']) / 2**20
        target = '-' if 'target' not in r else f"{r['target']:.3f}x {r['target_vs']}"
        def verdict(kind):  # PASS, FAIL, or FAIL? when over the target by less than the row's noise
            if f'pass_{kind}' not in r:
                return '-'
            if r[f'pass_{kind}']:
                return 'PASS'
            ratio, noise = r[f"{kind}_vs_{r['target_vs']}"], r[f'{kind}_ratio_noise']
            return 'FAIL?' if noise is not None and ratio / r['target'] - 1 <= noise else 'FAIL'
        lines.append(f"{r['name']:>13} {r['params']:>9,} {f(r['delta_f_over_f'], '6.1%')} {f(r['train_ms'], '8.1f')} "
                     f"{f(r['train_vs_preln'], '6.3f')} {f(r['train_vs_plain'], '6.3f')} "
                     f"{f(r['prefill_tokens_per_s'], '13,.0f')} {f(r['prefill_vs_preln'], '6.3f')} "
                     f"{f(r['prefill_vs_plain'], '6.3f')} {mib:9.1f} {r['mem_vs_preln']:6.3f} "
                     f"{f(r['mfu'], '5.1%')} {target:>12} {verdict('train'):>5} {verdict('prefill'):>7}")
        if 'recompiles' in r:
            lines[-1] += f"  graphs {r['graphs_warmup']}, breaks {r['graph_breaks_warmup']}, recompiles {r['recompiles']}"
    for r in rows:
        if 'hc_vs_package_train' in r:
            lines.append(f"our HC / hyper-connections {HC_PACKAGE_VERSION}: training step "
                         f"{r['hc_vs_package_train']:.3f}x, prefill {r['hc_vs_package_prefill']:.3f}x")
    lines.append("ratios: time of the row / time of Pre-LN (xPreLN) or of PlainGPT (xplain), median over rounds; "
                 "'xPreLN' under memory: " + ("CUDA peak" if device_type == 'cuda' else "saved-activation bytes")
                 + " ratio; target applies to time (Pre-LN against plain, others against Pre-LN)")
    noise = [r[k] for r in rows for k in ('train_ratio_noise', 'prefill_ratio_noise') if r.get(k) is not None]
    if noise:
        lines.append(f"noise: half the interquartile range of the per-round ratios is {statistics.median(noise):.1%} "
                     f"(median over rows; max {max(noise):.1%}); FAIL? = over its target by less than that row's "
                     f"noise: a toss-up that this run does not settle")
    elif any('pass_train' in r for r in rows):
        lines.append("noise: unknown with fewer than 2 rounds; these verdicts are not settled (use --rounds=5 or more)")
    return '\n'.join(lines)


def environment(dev):
    """Versions and hardware of this run."""
    env = dict(python=platform.python_version(), torch=torch.__version__, platform=platform.platform(),
               processor=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
               torch_threads=torch.get_num_threads(), argv=sys.argv)
    if dev.type == 'cuda':
        env['gpu'] = torch.cuda.get_device_name(dev)
    return env


# -----------------------------------------------------------------------------
# --suite=fast: each scheme's training step with its fast paths on against the plain code


def fast_suite(names, cfg_kw, dev, dtype_name, compile_, steps, warmup, rounds, lr, seed_, log=print):
    """For each scheme of `names` that has fast paths on `dev` (fast.select), two models of the
    same weights, one plain (residuals.py) and one with the fast paths (after fast.check),
    timed in interleaved rounds (order alternating). Returns one row per scheme: paths,
    plain_ms, fast_ms (medians over rounds of the training step: forward + backward + AdamW),
    fast_vs_plain (median of the per-round ratios) and noise (half their interquartile range).
    Schemes without a fast path on `dev` are left out (a line says so)."""
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype_name]
    ctx = nullcontext() if dtype_name == 'float32' else torch.autocast(device_type=dev.type, dtype=ptdtype)
    B, T = cfg_kw['batch_size'], cfg_kw['block_size']
    gcfg = {k: v for k, v in cfg_kw.items() if k != 'batch_size'}
    idx = torch.randint(0, gcfg['vocab_size'], (B, T + 1), generator=torch.Generator().manual_seed(seed_)).to(dev)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    rows = []
    for name in names:
        pair = []
        for on in (False, True):
            torch.manual_seed(seed_)
            model = GPT(GPTConfig(**gcfg, residual=name)).to(dev)
            paths = fastpath.setup(model, on, dev)
            if compile_:
                model.compile_regions()
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=dev.type == 'cuda')
            pair.append((model, opt, paths))
        paths = pair[1][2]
        if not paths:
            log(f"{name:>13}: no fast path on {dev.type}")
            continue

        def step(model, opt):
            with ctx:
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for model, opt, _ in pair:
            for _ in range(max(warmup, 1)):
                step(model, opt)
        times = ([], [])
        per_round = steps_per_round(steps, rounds)
        for r in range(rounds):
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                model, opt, _ = pair[k]
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(per_round):
                    step(model, opt)
                sync(dev)
                times[k].append((time.perf_counter() - t0) / per_round)
        ratios = [f / p for p, f in zip(*times)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else None
        row = dict(scheme=name, paths=[p.name for p in paths], plain_ms=statistics.median(times[0]) * 1e3,
                   fast_ms=statistics.median(times[1]) * 1e3, fast_vs_plain=statistics.median(ratios),
                   noise=(q[2] - q[0]) / 2 if q else None)
        rows.append(row)
        log(f"{name:>13}: plain {row['plain_ms']:8.1f} ms, fast {row['fast_ms']:8.1f} ms, fast/plain "
            f"{row['fast_vs_plain']:.2f}" + (f" ± {row['noise']:.2f}" if row['noise'] is not None else '')
            + f"  ({', '.join(row['paths'])})")
    return rows


def format_fast_table(rows):
    """Markdown: one row per scheme, its fast paths and the training step fast / plain."""
    lines = ['| scheme | fast paths | plain ms | fast ms | fast / plain |', '|---|---|---|---|---|']
    for r in rows:
        noise = f" ± {r['noise']:.2f}" if r['noise'] is not None else ''
        lines.append(f"| {r['scheme']} | {', '.join(r['paths'])} | {r['plain_ms']:.1f} | {r['fast_ms']:.1f} | "
                     f"{r['fast_vs_plain']:.2f}{noise} |")
    return '\n'.join(lines)


# -----------------------------------------------------------------------------
# --suite=compile: cold compile time of the training step against depth


def cpu_seconds():
    """CPU seconds (user + system) of this process and of its finished children (the C++
    compiler inductor runs): on a machine shared with other jobs, the compile cost that
    wall-clock time would blur."""
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def compile_one(cfg_kw, batch, dtype_name, dev, steps, seed_=1337, fast_setting=False):
    """Compiles one training step (forward + backward + AdamW) of GPT(**cfg_kw) as train.py
    does (its fast paths per `fast_setting`, then GPT.compile_regions) and times it. Run in a fresh process with a fresh inductor cache
    (`compile_suite` does) for a cold-cache number. Returns a dict: compile_s (wall seconds
    of the first step), compile_cpu_s (CPU seconds of it, compiler children included),
    step_ms (median of `steps` later steps), graphs, graph_breaks, recompiles (graphs
    compiled after the first step)."""
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype_name]
    ctx = nullcontext() if dtype_name == 'float32' else torch.autocast(device_type=dev.type, dtype=ptdtype)
    torch.manual_seed(seed_)
    cfg = GPTConfig(**cfg_kw)
    model = GPT(cfg).to(dev)
    fastpath.setup(model, fast_setting, dev)
    model.compile_regions()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == 'cuda')
    fn = model
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=dev)

    def step():
        with ctx:
            _, loss = fn(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    c0, t0 = cpu_seconds(), time.perf_counter()
    step()
    sync(dev)
    res = dict(compile_s=time.perf_counter() - t0, compile_cpu_s=cpu_seconds() - c0)
    res['graphs'], res['graph_breaks'] = graph_counts()
    times = []
    for _ in range(max(steps, 1) + 1):  # one untimed step, then the timed ones
        t0 = time.perf_counter()
        loss = step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    res['step_ms'] = statistics.median(times[1:]) * 1e3
    res['recompiles'] = graph_counts()[0] - res['graphs']
    res['loss_finite'] = bool(torch.isfinite(loss).item())
    return res


def compile_suite(schemes_, layers, cfg_kw, batch, dtype_name, dev, steps, threads_, log=print, fast_setting=False,
                  repeats=1):
    """`compile_one` for every scheme at every depth, each in a fresh Python process with a
    fresh, empty inductor cache (TORCHINDUCTOR_CACHE_DIR) and compiling in-process
    (TORCHINDUCTOR_COMPILE_THREADS=1, so compile_cpu_s counts the compiler). Depth-major
    order (every scheme at L = 4, then at 8, ...), so a run cut short still has whole rows.
    `repeats` rounds per depth, each round every scheme once, Pre-LN first: a scheme's ratio
    is against Pre-LN in the same round, and a row gives the medians over rounds (a cold
    compile on a shared machine varies by ±10%; the ratios of a round vary less).
    Returns rows {scheme, n_layer, ...compile_one's dict (medians; graphs, breaks and
    recompiles the largest), cpu_vs_preln, step_vs_preln, cpu_vs_preln_rounds, repeats}."""
    import subprocess
    import tempfile
    if repeats < 1:
        raise ValueError(f"compile_repeats={repeats}: compile each scheme at least once")
    rows = []
    for L in layers:
        runs = {name: [] for name in schemes_}
        for rnd in range(repeats):
            ref = None
            for name in schemes_:
                kw = {**cfg_kw, 'n_layer': L, 'residual': name}
                code = (f"import json, torch, bench; torch.set_num_threads({threads_ or 1}); "
                        f"print('RESULT', json.dumps(bench.compile_one({kw!r}, {batch}, {dtype_name!r}, "
                        f"torch.device({str(dev)!r}), {steps}, fast_setting={fast_setting!r})))")
                with tempfile.TemporaryDirectory(prefix='inductor_cold_') as cache:
                    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': cache, 'TORCHINDUCTOR_COMPILE_THREADS': '1',
                           'OMP_NUM_THREADS': str(threads_ or 1)}
                    p = subprocess.run([sys.executable, '-c', code], cwd=os.path.dirname(os.path.abspath(__file__)),
                                       env=env, capture_output=True, text=True)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith('RESULT ')]
                if p.returncode or not lines:
                    raise RuntimeError(f"compiling {name} at L={L} failed:\n{p.stderr[-3000:]}")
                run = json.loads(lines[-1][len('RESULT '):])
                ref = run if name == 'preln' else ref
                if ref is not None:
                    run['cpu_vs_preln'] = run['compile_cpu_s'] / ref['compile_cpu_s']
                    run['step_vs_preln'] = run['step_ms'] / ref['step_ms']
                runs[name].append(run)
                log(f"L={L:>3} {name:>13}" + (f" (round {rnd + 1}/{repeats})" if repeats > 1 else '')
                    + f": compile {run['compile_s']:7.1f} s wall, {run['compile_cpu_s']:7.1f} s CPU"
                    + (f" ({run['cpu_vs_preln']:.2f}x Pre-LN)" if 'cpu_vs_preln' in run else '')
                    + f", step {run['step_ms']:8.1f} ms" + (f" ({run['step_vs_preln']:.2f}x)" if 'step_vs_preln' in run else '')
                    + f", graphs {run['graphs']}, breaks {run['graph_breaks']}, recompiles {run['recompiles']}")
        for name in schemes_:
            rs = runs[name]
            row = dict(scheme=name, n_layer=L, repeats=len(rs), loss_finite=all(r['loss_finite'] for r in rs))
            for k in ('compile_s', 'compile_cpu_s', 'step_ms', 'cpu_vs_preln', 'step_vs_preln'):
                if k in rs[0]:
                    row[k] = statistics.median(r[k] for r in rs)
            for k in ('graphs', 'graph_breaks', 'recompiles'):
                row[k] = max(r[k] for r in rs)
            if 'cpu_vs_preln' in rs[0]:
                row['cpu_vs_preln_rounds'] = [r['cpu_vs_preln'] for r in rs]
            rows.append(row)
    return rows


def format_compile_table(rows):
    """Markdown: CPU seconds to compile the training step, one row per scheme, one column
    per depth, each 'seconds (x Pre-LN)' (with several rounds: the median, then the rounds'
    range), and the compiled step time x Pre-LN."""
    layers = sorted({r['n_layer'] for r in rows})
    names = list(dict.fromkeys(r['scheme'] for r in rows))
    at = {(r['scheme'], r['n_layer']): r for r in rows}
    head = '| scheme | ' + ' | '.join(f'L = {L}: compile CPU s (× Pre-LN) | step × Pre-LN' for L in layers) + ' |'
    lines = [head, '|---|' + '---|---|' * len(layers)]
    for n in names:
        cells = []
        for L in layers:
            r = at.get((n, L))
            if r is None:
                cells += ['not measured', '–']
                continue
            ratio = f" ({r['cpu_vs_preln']:.2f}×)" if 'cpu_vs_preln' in r else ''
            if r.get('repeats', 1) > 1 and r['scheme'] != 'preln':
                lo, hi = min(r['cpu_vs_preln_rounds']), max(r['cpu_vs_preln_rounds'])
                ratio = f" ({r['cpu_vs_preln']:.2f}×, {lo:.2f}–{hi:.2f})"
            cells += [f"{r['compile_cpu_s']:.0f}{ratio}", f"{r['step_vs_preln']:.2f}" if 'step_vs_preln' in r else '–']
        lines.append(f'| {n} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def write_json(path, obj):
    """Writes obj as JSON atomically (a temp file of this process's own, fsync, rename): two
    processes writing one path at once leave one whole file, never a mix or a stray temp file."""
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, 'x') as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def step_suite(o, c):
    """--suite=step: perf/step.py's count of one micro-step per scheme under fake tensors, and
    its time estimate on H100 / H200 / A100. Raises ValueError for a bad setting."""
    from perf import step
    keys = ('n_layer', 'n_embd', 'n_head', 'n_kv_head', 'block_size', 'batch_size', 'vocab_size')
    # the config file's shape, and every one of these flags given a value other than its default
    shape = step.shape_of(o.step_config) if o.step_config else {}
    shape.update({k: getattr(o, k) for k in keys if k not in shape or getattr(o, k) != globals()[k]})
    batch, seq_len = shape.pop('batch_size'), shape['block_size']
    names = [s.strip() for s in o.step_schemes.split(',') if s.strip()]
    unknown = [s for s in names if s not in RESIDUALS]
    if unknown:
        raise ValueError(f"unknown scheme(s) {', '.join(unknown)} in step_schemes; registered: {', '.join(RESIDUALS)}")
    if o.step_fast not in ('cuda', 'cuda_fla', 'cuda_liger', 'cuda_torch', 'off'):
        raise ValueError(f"step_fast={o.step_fast!r}: use 'cuda', 'cuda_fla', 'cuda_liger', 'cuda_torch' or 'off'")
    cfg_kw = dict(shape, hc_streams=o.hc_streams, attnres_blocks=o.attnres_blocks)
    GPTConfig(**cfg_kw)  # validates the shape
    print(f"bench --suite=step: L={shape['n_layer']} d={shape['n_embd']} heads={shape['n_head']} micro-batch "
          f"{batch} x {seq_len}, V={shape['vocab_size']}, bf16 autocast, fast paths '{o.step_fast}'; estimated, "
          f"CPU fake-tensor count, no GPU measured")
    counts = step.run(names, cfg_kw, batch, seq_len, o.step_fast)
    table = step.format_table(counts)
    print(table)
    print(f"time: Pre-LN's model FLOPs at {step.PRELN_MFU:.0%} MFU, plus a scheme's ops minus Pre-LN's, each "
          f"max(FLOPs / (peak x {step.PRELN_MFU}), bytes / (bandwidth x eta_b)) + launch; eta_b {step.BW_EFF[1]}, "
          f"launch {step.LAUNCH_S[1] * 1e6:.0f} us (range: eta_b {step.BW_EFF[0]}-{step.BW_EFF[2]}, launch "
          f"{step.LAUNCH_S[0] * 1e6:.0f}-{step.LAUNCH_S[2] * 1e6:.0f} us); memory: saved activations + 16 bytes "
          f"a parameter (fp32 weights, gradients, AdamW)")
    for s in counts:
        if s != 'preln':
            top = ', '.join(f"{n} {k:+,} kernels {b / 1e9:+,.0f} GB" for n, k, b in step.top_ops(counts[s], counts['preln'], 4))
            print(f"  {s} over Pre-LN: {top}")
    h200 = step.estimate(counts, step.SPECS['H200'])
    for s in counts:
        if s + step.FLA in counts:
            (ms, r, _, _), (ms_fla, r_fla, _, _) = h200[s], h200[s + step.FLA]
            print(f"  {s}: the grouped read's step {ms:.0f} ms ({r:.2f}x Pre-LN) against {ms_fla:.0f} ms "
                  f"({r_fla:.2f}x) on fla-core's per-read kernel, H200, estimated: {ms_fla - ms:.0f} ms less")
        if s + step.LIGER in counts:
            (ms, r, _, _), (ms_lg, r_lg, _, _) = h200[s], h200[s + step.LIGER]
            print(f"  {s}: the fused stream steps' step {ms:.0f} ms ({r:.2f}x Pre-LN) against {ms_lg:.0f} ms "
                  f"({r_lg:.2f}x) on Liger's mHC ops, H200, estimated: {ms_lg - ms:.0f} ms less")
    if o.out:
        write_json(o.out, dict(suite='step', config=c, shape=shape, batch=batch, counts=step.summary(counts),
                               table=table, environment=environment(torch.device('cpu'))))
        print(f"wrote {o.out}")
    return counts


def main(argv=None):
    """Parses `--key=value` overrides of the config above (configurator.py), runs the
    benchmark, prints the table, writes `out`; returns the result rows. User errors exit
    with a one-line message. The module's defaults are never modified."""
    keys = [k for k, v in globals().items() if not k.startswith('_') and k.islower()
            and isinstance(v, (int, float, bool, str, type(None)))]
    c = {k: globals()[k] for k in keys}
    try:
        configure(c, keys, sys.argv[1:] if argv is None else argv, help_text=comments_from_source(__file__),
                  none_types={'n_kv_head': int, 'dtype': str, 'fast': (str, bool)})
        o = types.SimpleNamespace(**c)
        if o.suite == 'step':
            return step_suite(o, c)
        if o.suite not in ('bench', 'fast', 'compile'):
            raise ValueError(f"suite={o.suite!r}: use 'bench', 'fast', 'compile' or 'step' (the GPU check is "
                             f"tools/gpu_check.py)")
        fastpath.resolve(o.fast, 'cpu')  # a bad setting is one line now, not mid-run
        if o.compile_steps < 1:
            raise ValueError(f"compile_steps={o.compile_steps}: time at least one step")
        if o.compile_repeats < 1:
            raise ValueError(f"compile_repeats={o.compile_repeats}: compile each scheme at least once")
        if o.suite == 'compile':
            for v in o.compile_layers.split(','):
                if not v.strip().isdigit() or int(v) < 1:
                    raise ValueError(f"compile_layers={o.compile_layers!r}: give depths >= 1, e.g. 4,8,16,32")
            bad = [s for s in o.compile_schemes.split(',') if s.strip() and s.strip() not in RESIDUALS]
            if bad:
                raise ValueError(f"unknown scheme(s) {', '.join(bad)} in compile_schemes; registered: {', '.join(RESIDUALS)}")
        names = list(RESIDUALS) if o.schemes == 'all' else [s.strip() for s in o.schemes.split(',') if s.strip()]
        unknown = [s for s in names if s not in RESIDUALS]
        if unknown:
            raise ValueError(f"unknown scheme(s) {', '.join(unknown)}; registered: {', '.join(RESIDUALS)}")
        names = ['preln'] + [s for s in dict.fromkeys(names) if s != 'preln']
        dev = torch.device(o.device)
        if dev.type == 'cuda' and not torch.cuda.is_available():
            raise ValueError(f"device={o.device!r} but CUDA is not available here: use --device=cpu")
        dt = o.dtype or ('bfloat16' if dev.type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32')
        if dt not in ('float32', 'bfloat16', 'float16'):
            raise ValueError(f"dtype={dt!r}: use float32, bfloat16 or float16")
        for key, low in (('steps', 0), ('warmup', 0), ('threads', 0), ('rounds', 1), ('batch_size', 1)):
            if getattr(o, key) < low:
                raise ValueError(f"{key}={getattr(o, key)} must be >= {low}")
        if o.steps and o.steps < o.rounds:
            raise ValueError(f"steps={o.steps} < rounds={o.rounds}: every round needs a step; "
                             f"raise --steps or lower --rounds")
        cfg_kw = dict(n_layer=o.n_layer, n_embd=o.n_embd, n_head=o.n_head, n_kv_head=o.n_kv_head,
                      block_size=o.block_size, vocab_size=o.vocab_size, hc_streams=o.hc_streams,
                      attnres_blocks=o.attnres_blocks, batch_size=o.batch_size)
        shape = GPTConfig(**{k: v for k, v in cfg_kw.items() if k != 'batch_size'})  # validates the shape
        with torch.device('meta'):  # each scheme checks its own settings (hc_streams, attnres_blocks) now, not mid-run
            for name in names:
                RESIDUALS[name](GPTConfig(**{**vars(shape), 'residual': name}))
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    if o.threads:
        torch.set_num_threads(o.threads)
    if o.suite == 'compile':
        layers = [int(v) for v in o.compile_layers.split(',') if v.strip()]
        cnames = [s.strip() for s in o.compile_schemes.split(',') if s.strip()]
        cnames = ['preln'] + [s for s in dict.fromkeys(cnames) if s != 'preln']
        print(f"bench --suite=compile: {', '.join(cnames)} at L = {', '.join(map(str, layers))}, d={o.n_embd} "
              f"T={o.block_size} B={o.batch_size} on {dev} ({dt}, fast={o.fast}), GPT.compile_regions, "
              f"cold inductor cache per compile" + (f", medians of {o.compile_repeats} rounds" if o.compile_repeats > 1 else ''))
        ckw = {k: v for k, v in cfg_kw.items() if k != 'batch_size'}
        rows = compile_suite(cnames, layers, ckw, o.batch_size, dt, dev, o.compile_steps, o.threads,
                             fast_setting=o.fast, repeats=o.compile_repeats)
        print(format_compile_table(rows))
        if o.out:
            write_json(o.out, dict(suite='compile', config=c, dtype=dt, environment=environment(dev), rows=rows,
                                   table=format_compile_table(rows)))
            print(f"wrote {o.out}")
        return rows
    if o.suite == 'fast':
        fnames = [s for s in names if s != 'preln']  # Pre-LN has no fast path
        print(f"bench --suite=fast: {', '.join(fnames)} on {dev} ({dt}, compile={o.compile}), L={o.n_layer} "
              f"d={o.n_embd} T={o.block_size} B={o.batch_size}, {o.rounds} rounds")
        rows = fast_suite(fnames, cfg_kw, dev, dt, o.compile, o.steps or o.rounds, o.warmup, o.rounds,
                          o.learning_rate, o.seed)
        print(format_fast_table(rows))
        if o.out:
            write_json(o.out, dict(suite='fast', config=c, dtype=dt, environment=environment(dev), rows=rows,
                                   table=format_fast_table(rows)))
            print(f"wrote {o.out}")
        return rows
    nt, n_step = torch.get_num_threads(), steps_per_round(o.steps, o.rounds)
    print(f"bench: {', '.join(names)} + plain on {dev} ({dt}, compile={o.compile}, fast={o.fast}, {nt} "
          f"CPU thread{'s' if nt != 1 else ''}), L={o.n_layer} d={o.n_embd} T={o.block_size} B={o.batch_size} V={o.vocab_size}, "
          + (f"{o.rounds} rounds of {n_step} timed step{'s' if n_step != 1 else ''}, {o.warmup} warm-up"
             if n_step else "memory only (steps=0)"))
    rows = run(names, cfg_kw, dev, dt, o.compile, o.steps, o.warmup, o.rounds, o.hc_package, o.learning_rate, o.seed,
               fast_setting=o.fast)
    print(format_table(rows, dev.type))
    if dev.type != 'cuda':
        print("memory: bytes autograd saves for backward in one forward pass of the eager model, also "
              "with --compile=True (the CPU allocator is not tracked); MFU needs a known accelerator peak")
    if o.out:
        os.makedirs(os.path.dirname(o.out) or '.', exist_ok=True)
        with open(o.out, 'w') as f:
            json.dump(dict(config=c, dtype=dt, environment=environment(dev), rows=rows), f, indent=1)
        print(f"wrote {o.out}")
    return rows


if __name__ == '__main__':
    main()
