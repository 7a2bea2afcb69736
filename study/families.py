"""
The experiment families of DepthBench (paper Tables 2, 3, 7–9; recipe Sec. 2.3, Table 4), each
defined once, here (docs/families.md).

Every run of the study is (family, scheme, L, d, extra config keys). This file holds
the tables, the rules that derive the shapes not listed in our notes and the
pre-training recipe (each scheme's peak learning rate is its class's `peak_lr` in
residuals.py); the config files under config/ are *generated* from it:

    python study/families.py            # print every family's table, (re)write config/
    python study/families.py --check    # only check that config/ matches this file (exit 1 if not)

Families (run names are <scheme>_L<L>; config files in parentheses):
  main            ≈400M total, 7 shapes L=16..70 (config/<scheme>_L<L>.py)      Table 2/3
  fixed_backbone  ≈300M backbone, L in {16,24,32,42,70,84} (config/fixed_backbone/) Table 7
  cross_scale     200/300/400/500M total at d/L ≈ 28, 43, 76
                  (config/cross_scale/<scheme>_<N>M_L<L>.py)                     Tables 8-9
  onepointsix     1.6B, GQA 16/8, d_ff = 3d, LR 5e-4 (config/onepointsix/)       Tables 8-9
  mini            CPU-sized fixed-backbone family on byte-level text (config/mini/)
  mini_tpp5       the same at L = 4, 8, trained twice as long (config/mini_tpp5/)

A run that is the same training run as one of the main family (same scheme and
shape; e.g. fixed_backbone L=24 is main's L=24, d=1024) gets its own config file in
its family's folder but shares main's out_dir, so a sweep trains it once.

    from study.families import runs
    for run in runs('main', schemes=['preln', 'attnres']):
        print(run.name, run.config_path, run.out_dir, run.config['n_embd'])
"""

import math
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, when run as a script
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root: config/, out/
VOCAB_SIZE = 50280  # GPT-2 BPE (50257) padded to the study's 50280 entries (paper Sec. 2.2)
BYTE_VOCAB_SIZE = 257  # 'fineweb_edu_byte': 256 bytes + an end-of-text token

# -----------------------------------------------------------------------------
# schemes; their peak learning rates (the paper's Table 4) are the scheme classes'
# `peak_lr` in residuals.py, the one place they are written

SCHEMES = ('preln', 'sandwich', 'lns', 'deepnorm', 'keel', 'hc', 'mhc', 'attnres', 'blockattnres', 'moda')
HEADLINE = ('preln', 'attnres', 'hc')  # the three schemes of the paper's headline comparison (its abstract)


def peak_lr(scheme):
    """The peak learning rate of a registered scheme: its class's `peak_lr` (residuals.py).
    Raises ValueError for a scheme not in residuals.RESIDUALS."""
    from residuals import RESIDUALS  # read at call time: a scheme registered later counts too
    if scheme not in RESIDUALS:
        raise ValueError(f"unknown scheme {scheme!r}; registered in residuals.RESIDUALS: {', '.join(RESIDUALS)}")
    return RESIDUALS[scheme].peak_lr


def _scheme_lr():
    from residuals import RESIDUALS
    names = SCHEMES + tuple(n for n in RESIDUALS if n not in SCHEMES)  # the study's ten first
    return {n: peak_lr(n) for n in names}


SCHEME_LR = _scheme_lr()  # {scheme: peak LR} of the schemes registered at import, for tables and plot order

# -----------------------------------------------------------------------------
# the pre-training recipe (paper Sec. 2.3, Table 4): one place for every family

BLOCK_SIZE = 2048   # context T
BATCH_SIZE = 16     # micro-batch (sequences) per GPU per forward/backward
GRAD_ACCUM = 32     # global: train.py divides it by the number of GPUs
RECIPE = dict(
    block_size=BLOCK_SIZE,
    batch_size=BATCH_SIZE,
    gradient_accumulation_steps=GRAD_ACCUM,  # 16 x 32 = 512 sequences per step on any number of GPUs
    tokens_per_param=20.0,  # tokens ≈ 20 x parameters (Chinchilla), max_iters derived by train.py
    weight_decay=0.1,
    warmup_frac=0.1,        # linear warmup over 10% of the steps
    min_lr_frac=0.1,        # cosine decay to 10% of the peak
)

# -----------------------------------------------------------------------------
# parameter counts (paper Sec. 2.2, Table 3)

def ffn_hidden(d):
    """SwiGLU hidden width of the study: 16 * ceil(8d/3 / 16) (paper Sec. 2.2). d: int -> int."""
    return 16 * math.ceil(8 * d / 3 / 16)


def backbone_params(L, d, d_ff=None, n_kv_head=None, n_head=16):
    """
    Parameters of the L transformer blocks of a Pre-LN model (paper Sec. 2.2), i.e. the total
    without the embedding, LM head and final norm: L·(attn + 3·d·d_ff + 2d), with
    attn = 2d² (q, o) + 2·d·n_kv·head_dim (k, v), which is 4d² for MHA. This is the
    paper's "backbone" column (Table 3: L=16, d=1216 -> 284M). Other schemes add
    their own few parameters on top (train.py prints the exact count).
    Raises ValueError if d is not divisible by n_head or n_head by n_kv_head.
    """
    d_ff = ffn_hidden(d) if d_ff is None else d_ff
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    if d % n_head or n_head % n_kv_head:
        raise ValueError(f"d={d} must be divisible by n_head={n_head}, and n_head by n_kv_head={n_kv_head}")
    head_dim = d // n_head
    attn = 2 * d * d + 2 * d * n_kv_head * head_dim  # q, o + k, v
    return L * (attn + 3 * d * d_ff + 2 * d)  # + SwiGLU (gate, up, down) + two RMSNorm gains


def param_count_preln(L, d, V=VOCAB_SIZE, d_ff=None, n_kv_head=None, n_head=16):
    """
    Total parameters of a Pre-LN model (paper Sec. 2.2): backbone + 2·V·d (untied embedding
    and LM head) + d (final norm) = L·(4d² + 3·d·d_ff + 2d) + 2Vd + d for MHA.
    Reproduces Table 3's total column (L=24, d=1024 -> 405.41M). Same errors as backbone_params.
    """
    return backbone_params(L, d, d_ff, n_kv_head, n_head) + 2 * V * d + d

# -----------------------------------------------------------------------------
# the rules that derive the shapes our notes do not list

def fixed_backbone_width(L, backbone=300e6, multiple=32):
    """
    Width d for a ≈`backbone`-parameter backbone at depth L (fixed-backbone family,
    Table 7): the multiple of 32 nearest to sqrt(backbone / (12 L)), since a block has
    ≈ 12 d² parameters (4d² attention + 3·d·8d/3 SwiGLU). For 300M and
    L = 16, 24, 32, 42, 70, 84 this gives d = 1248, 1024, 896, 768, 608, 544.
    """
    return multiple * round(math.sqrt(backbone / (12 * L)) / multiple)


def cross_scale_shape(total, ratio, tol=0.05, multiple=32):
    """
    (L, d) of the cross-scale family (docs/families.md) for a target total parameter count and
    width/depth ratio r = d/L. Rule: among all integer L and d a multiple of 32 (so the
    16 heads have an even head_dim, as RoPE needs) whose Pre-LN total
    (param_count_preln) is within `tol` (5%) of the target, take the one whose d/L is
    closest to r in log-ratio; ties go to the smaller |total - target|.
    At 400M it gives exactly the main family's (16, 1216), (24, 1024), (32, 896).
    Raises ValueError if no shape is within tol.
    """
    best = None
    for L in range(1, 257):
        d_ideal = ratio * L  # only widths near r·L can win; skip the rest
        for d in range(max(multiple, multiple * math.floor(d_ideal / multiple / 1.5)),
                       multiple * math.ceil(d_ideal * 1.5 / multiple) + 1, multiple):
            err = param_count_preln(L, d) / total - 1
            if abs(err) > tol:
                continue
            key = (abs(math.log(d / L / ratio)), abs(err))
            if best is None or key < best[0]:
                best = (key, L, d)
    if best is None:
        raise ValueError(f"no (L, d) with total within {tol:.0%} of {total:,.0f} at d/L={ratio}; raise tol")
    return best[1], best[2]


def mini_width(L, backbone, multiple=16):
    """Width of a mini-family shape: the multiple of 16 nearest to sqrt(backbone / (12 L))."""
    return multiple * round(math.sqrt(backbone / (12 * L)) / multiple)

# -----------------------------------------------------------------------------
# families as data

@dataclass(frozen=True)
class Shape:
    L: int
    d: int
    schemes: tuple | None = None  # None = the family's schemes
    extra: dict = field(default_factory=dict)  # config keys beyond the shape, e.g. n_kv_head
    tag: str = ''  # goes into the run name, e.g. '400M' -> preln_400M_L16
    info: dict = field(default_factory=dict)  # what the shape was derived from (for tables, plots)


@dataclass(frozen=True)
class Family:
    name: str
    title: str                    # one line for the config headers and the tables
    shapes: tuple
    schemes: tuple = HEADLINE
    base: dict = field(default_factory=dict)  # config keys shared by every run of the family
    learning_rate: float | None = None  # None = the scheme's peak_lr (residuals.py)
    vocab_size: int = VOCAB_SIZE
    n_head: int = 16


@dataclass(frozen=True)
class Run:
    family: str
    scheme: str
    L: int
    d: int
    name: str           # e.g. 'attnres_L32'
    config_path: str    # relative to the repo root, e.g. 'config/attnres_L32.py'
    out_dir: str        # relative to the repo root, e.g. 'out/main/attnres_L32'
    config: dict        # train.py keys -> values, in the order they are written
    backbone: int       # Pre-LN backbone parameters (backbone_params)
    total: int          # Pre-LN total parameters (param_count_preln)
    info: dict          # shape info (target sizes/ratios), 'shared_with' for a main run reused

    @property
    def ratio(self):
        """Width/depth ratio d/L."""
        return self.d / self.L


MAIN_SHAPES = ((16, 1216), (20, 1120), (24, 1024), (28, 960), (32, 896), (42, 800), (70, 640))
MAIN_DEEP = (42, 70)  # deeper shapes, trained for the headline schemes only

FIXED_BACKBONE_DEPTHS = (16, 24, 32, 42, 70, 84)

CROSS_SCALE_TOTALS = (200e6, 300e6, 400e6, 500e6)
CROSS_SCALE_RATIOS = (28, 43, 76)  # ≈ the main family's L = 32, 24, 16

ONEPOINTSIX_SHAPES = ((28, 2048), (40, 1728), (54, 1504))

# mini-DepthBench: a CPU-sized replica of the fixed-backbone question. The backbone is
# held at that of L=4, d=128 (803,840 parameters); L in {2, 4, 8} gives d = 176, 128,
# 96 (d/L = 88, 32, 12, a span like the main family's 76 -> 9); 4 heads everywhere so
# head_dim = d/4 >= 16. Byte-level text (vocab 257) from the embedded sample (data/sample,
# 2.97M training bytes, so a fresh clone reproduces it), T = 256, float32 on the CPU.
# Budget: MINI_TOKENS_PER_PARAM = 2.5 tokens per backbone parameter (≈2.1M tokens, ≈520
# steps of 4,096 tokens, less than one pass over the sample). Fast paths on (the CPU torch
# forms, checked against residuals.py at every start). Block AttnRes in 4 blocks (the
# study's 8 blocks hold 4-8 sublayers each; 4 blocks give 2 and 4 sublayers at L = 4, 8),
# and not at L = 2, where every block would be one sublayer: Full AttnRes itself.
MINI_DEPTHS = (2, 4, 8)
MINI_BACKBONE = backbone_params(4, 128, n_head=4)
MINI_TOKENS_PER_PARAM = 2.5
MINI_SCHEMES = ('preln', 'attnres', 'blockattnres', 'hc', 'mhc')
MINI_BATCH = dict(block_size=256, batch_size=16, gradient_accumulation_steps=1)  # 4,096 tokens per step
# The training-length ladder: the same shapes, data and recipe trained longer, one family per
# rung (the paper trains ≈20 tokens per parameter). A rung trains the headline schemes at L = 4
# and 8 only: the depth contrast and the deepest shape of the mini study.
MINI_RUNGS = {5.0: 'mini_tpp5'}  # tokens per backbone parameter -> family
MINI_RUNG_DEPTHS = (4, 8)


def _mini_shapes(tokens_per_param=MINI_TOKENS_PER_PARAM, depths=MINI_DEPTHS, schemes=MINI_SCHEMES):
    """The mini shapes at depths L, each trained on tokens_per_param x its backbone (whole steps)."""
    shapes = []
    for L in depths:
        d = mini_width(L, MINI_BACKBONE)
        tokens_per_step = MINI_BATCH['block_size'] * MINI_BATCH['batch_size'] * MINI_BATCH['gradient_accumulation_steps']
        max_iters = round(tokens_per_param * backbone_params(L, d, n_head=4) / tokens_per_step)
        here = schemes if L >= 4 else tuple(x for x in schemes if x != 'blockattnres')
        shapes.append(Shape(L, d, schemes=here, extra=dict(max_iters=max_iters, eval_interval=max_iters // 4)))
    return tuple(shapes)


MINI_BASE = dict(dataset='fineweb_edu_byte', **MINI_BATCH, eval_iters=20, log_interval=10, attnres_blocks=4,
                 device='cpu', dtype='float32', compile=False, fast=True)


def _cross_scale_shapes():
    shapes = []
    for total in CROSS_SCALE_TOTALS:
        for ratio in CROSS_SCALE_RATIOS:
            L, d = cross_scale_shape(total, ratio)
            shapes.append(Shape(L, d, tag=f'{total / 1e6:.0f}M',
                                info=dict(target_total=int(total), target_ratio=ratio)))
    return tuple(shapes)


FAMILIES = {f.name: f for f in (
    Family('main', 'fixed total ≈400M: trade width for depth (Tables 2-3)',
           shapes=tuple(Shape(L, d, schemes=HEADLINE if L in MAIN_DEEP else None) for L, d in MAIN_SHAPES),
           schemes=SCHEMES),
    Family('fixed_backbone', 'fixed backbone ≈300M, embedding/head follow d (Table 7; '
                             'd = multiple of 32 nearest sqrt(300M / 12L))',
           shapes=tuple(Shape(L, fixed_backbone_width(L)) for L in FIXED_BACKBONE_DEPTHS)),
    Family('cross_scale', 'cross-scale: 200M-500M total at d/L ≈ 28, 43, 76 (Tables 8-9; '
                          'rule in families.cross_scale_shape)',
           shapes=_cross_scale_shapes()),
    Family('onepointsix', '1.6B total, GQA 16/8, d_ff = 3d, peak LR 5e-4 for all (Tables 8-9)',
           shapes=tuple(Shape(L, d, extra=dict(n_kv_head=8, ffn_hidden=3 * d)) for L, d in ONEPOINTSIX_SHAPES),
           # same 512-sequence global batch, smaller micro-batch for the 1.6B models' activations
           base=dict(batch_size=4, gradient_accumulation_steps=128),
           learning_rate=5e-4),
    Family('mini', 'CPU fixed backbone ≈0.8M, byte-level text, T=256, '
                   f'{MINI_TOKENS_PER_PARAM:g} tokens per backbone parameter',
           shapes=_mini_shapes(), schemes=MINI_SCHEMES, base=MINI_BASE, vocab_size=BYTE_VOCAB_SIZE, n_head=4),
    *(Family(name, f'CPU fixed backbone ≈0.8M, byte-level text, T=256, {tpp:g} tokens per backbone parameter '
                   '(a rung of the mini training-length ladder)',
             shapes=_mini_shapes(tpp, MINI_RUNG_DEPTHS, HEADLINE), schemes=HEADLINE, base=MINI_BASE,
             vocab_size=BYTE_VOCAB_SIZE, n_head=4) for tpp, name in MINI_RUNGS.items()),
)}

# -----------------------------------------------------------------------------
# runs and their configs

# the order config keys are written in, under nanoGPT's section headers
CONFIG_SECTIONS = (
    ('I/O', ('out_dir', 'eval_interval', 'eval_iters', 'log_interval')),
    ('data', ('dataset', 'block_size', 'batch_size', 'gradient_accumulation_steps')),
    ('model', ('residual', 'n_layer', 'n_embd', 'n_head', 'n_kv_head', 'ffn_hidden', 'attnres_blocks')),
    ('optimizer and schedule', ('learning_rate', 'weight_decay', 'warmup_frac', 'min_lr_frac',
                                'tokens_per_param', 'max_iters')),
    ('system', ('device', 'dtype', 'compile', 'fast')),
)
CONFIG_KEYS = tuple(k for _, keys in CONFIG_SECTIONS for k in keys)


def _make_run(family, shape, scheme):
    fam = FAMILIES[family]
    name = f"{scheme}_{shape.tag}_L{shape.L}" if shape.tag else f"{scheme}_L{shape.L}"
    config_path = f"config/{name}.py" if family == 'main' else f"config/{family}/{name}.py"
    out_dir = f"out/{family}/{name}"
    cfg = dict(RECIPE, dataset='fineweb_edu')
    cfg.update(fam.base)
    cfg.update(residual=scheme, n_layer=shape.L, n_embd=shape.d, n_head=fam.n_head,
               learning_rate=fam.learning_rate or peak_lr(scheme), out_dir=out_dir)
    cfg.update(shape.extra)
    if scheme != 'blockattnres':
        cfg.pop('attnres_blocks', None)  # read by Block AttnRes only
    if 'max_iters' in cfg:  # a fixed step count replaces the tokens-per-parameter rule
        del cfg['tokens_per_param']
    unknown = set(cfg) - set(CONFIG_KEYS)
    assert not unknown, f"family {family}: keys {unknown} are not in CONFIG_KEYS"
    config = {k: cfg[k] for k in CONFIG_KEYS if k in cfg}
    kw = dict(d_ff=config.get('ffn_hidden'), n_kv_head=config.get('n_kv_head'), n_head=fam.n_head)
    return Run(family=family, scheme=scheme, L=shape.L, d=shape.d, name=name, config_path=config_path,
               out_dir=out_dir, config=config, backbone=backbone_params(shape.L, shape.d, **kw),
               total=param_count_preln(shape.L, shape.d, V=fam.vocab_size, **kw), info=dict(shape.info))


def runs(family, schemes=None, shapes=None):
    """
    The runs of a family, in table order (shape by shape, then scheme).

    family: a key of FAMILIES; schemes: iterable of scheme names to keep (None = all of
    the family's); shapes: iterable of depths L to keep (None = all). Returns a list of
    Run. A run identical to a main-family run (same scheme and config apart from
    out_dir) gets main's out_dir and info['shared_with'] = main's config path.
    Raises ValueError for an unknown family, scheme or depth.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of: {', '.join(FAMILIES)}")
    fam = FAMILIES[family]
    all_schemes = list(dict.fromkeys(s for shape in fam.shapes for s in (shape.schemes or fam.schemes)))
    all_depths = sorted({shape.L for shape in fam.shapes})
    if schemes is not None:
        schemes = list(schemes)
        bad = [s for s in schemes if s not in all_schemes]
        if bad:
            raise ValueError(f"family {family} has no scheme {', '.join(bad)}; its schemes: {', '.join(all_schemes)}")
    if shapes is not None:
        shapes = [int(L) for L in shapes]
        bad = [L for L in shapes if L not in all_depths]
        if bad:
            raise ValueError(f"family {family} has no depth L={bad}; its depths: {all_depths}")
    main = {}
    if family != 'main':
        main = {_same_run_key(r): r for r in runs('main')}
    out = []
    for shape in fam.shapes:
        if shapes is not None and shape.L not in shapes:
            continue
        for scheme in shape.schemes or fam.schemes:
            if schemes is not None and scheme not in schemes:
                continue
            run = _make_run(family, shape, scheme)
            twin = main.get(_same_run_key(run))
            if twin is not None:  # the same training run: train once, in main's out_dir
                config = dict(run.config, out_dir=twin.out_dir)
                run = Run(**{**run.__dict__, 'out_dir': twin.out_dir, 'config': config,
                             'info': dict(run.info, shared_with=twin.config_path)})
            out.append(run)
    return out


def _same_run_key(run):
    return tuple(sorted((k, v) for k, v in run.config.items() if k != 'out_dir'))

# -----------------------------------------------------------------------------
# config files

GENERATED_MARK = "# Generated by `python study/families.py`"


def _millions(n):
    """A parameter or token count for humans: 1.61B, 399M, 0.87M."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.0f}M" if n >= 10e6 else f"{n / 1e6:.2f}M"


def _lr(x):
    """A learning rate as written in the paper: 2e-3, 5e-4."""
    return f"{x:.0e}".replace('e-0', 'e-')


def config_text(run):
    """The text of a run's config file: a commented header, then the keys by section."""
    fam = FAMILIES[run.family]
    c = run.config
    n_head, d_ff = c['n_head'], c.get('ffn_hidden') or ffn_hidden(run.d)
    n_kv = c.get('n_kv_head')
    seqs = c['batch_size'] * c['gradient_accumulation_steps']
    tokens_per_step = seqs * c['block_size']
    attn = f"{n_head} heads of {run.d // n_head}" + (f", {n_kv} KV heads (GQA)" if n_kv else "")
    lines = [
        f"# DepthBench {run.family} family: {fam.title}",
        f"# run {run.name}: scheme {run.scheme}, L = {run.L}, d = {run.d}, d/L = {run.ratio:.2f}",
        f"# {attn}, SwiGLU d_ff = {d_ff:,}",
        f"# Pre-LN parameters: backbone {run.backbone:,} ({_millions(run.backbone)}), total {run.total:,} "
        f"({_millions(run.total)}, with embedding + LM head + final norm; the scheme adds a few)",
    ]
    if run.info.get('target_total'):
        lines.append(f"# derived for a {run.info['target_total'] / 1e6:.0f}M total at d/L ≈ {run.info['target_ratio']} "
                     f"(families.cross_scale_shape)")
    if run.info.get('shared_with'):
        lines.append(f"# the same training run as {run.info['shared_with']}: shares its out_dir, trained once")
    lines.append(f"# batch: {c['batch_size']} x {c['gradient_accumulation_steps']} = {seqs} sequences x "
                 f"{c['block_size']} tokens = {tokens_per_step:,} tokens per step"
                 + (f" (≈{tokens_per_step / 1e6:.2f}M)" if tokens_per_step >= 1e6 else ""))
    if 'max_iters' in c:
        tokens = c['max_iters'] * tokens_per_step
        lines.append(f"# {c['max_iters']:,} steps = {tokens / 1e6:.1f}M tokens = "
                     f"{tokens / run.backbone:.1f} tokens per backbone parameter (max_iters set here)")
    else:
        tokens = c['tokens_per_param'] * run.total
        lines.append(f"# {c['tokens_per_param']:g} tokens/param x {_millions(run.total)} = {tokens / 1e9:.2f}B tokens "
                     f"≈ {tokens / tokens_per_step:,.0f} steps (train.py derives max_iters from the exact count)")
    lines.append(f"# peak LR {_lr(c['learning_rate'])}, warmup {c['warmup_frac']:.0%}, cosine to {c['min_lr_frac']:.0%} of peak")
    if c.get('device') == 'cpu':
        lines.append(f"# run: python train.py {run.config_path}")
    else:
        lines.append(f"# run: python train.py {run.config_path}  "
                     f"(8 GPUs: torchrun --standalone --nproc_per_node=8 train.py {run.config_path})")
    lines.append(f"{GENERATED_MARK}; edit the family table there, not this file.")
    for section, keys in CONFIG_SECTIONS:
        present = [k for k in keys if k in c]
        if present:
            lines.append("")
            lines.append(f"# {section}")
            lines.extend(f"{k} = {c[k]!r}" for k in present)
    return "\n".join(lines) + "\n"


def all_runs():
    """Every run of every family, main first (a Run per config file)."""
    return [r for family in FAMILIES for r in runs(family)]


def write_configs(root=ROOT, check=False):
    """
    Write config/<...>.py for every run of every family under `root` (default: the
    repo). With check=True write nothing and return the list of paths whose file is
    missing or differs, plus generated files that no family defines any more (stale).
    Returns the list of paths written (or out of sync).
    """
    expected = {r.config_path: config_text(r) for r in all_runs()}
    changed = []
    for rel, text in expected.items():
        path = os.path.join(root, rel)
        current = open(path).read() if os.path.exists(path) else None
        if current == text:
            continue
        changed.append(rel)
        if not check:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w') as f:
                f.write(text)
    for rel in generated_files(root):
        if rel not in expected:
            changed.append(rel)
            if not check:
                os.remove(os.path.join(root, rel))  # a shape removed from its table
    return changed


def generated_files(root=ROOT):
    """Config files under root/config that carry the 'Generated by' mark (relative paths)."""
    out = []
    for dirpath, _, filenames in os.walk(os.path.join(root, 'config')):
        for fn in sorted(filenames):
            if fn.endswith('.py') and not fn.startswith('cpu_'):  # cpu_*.py are hand-written
                path = os.path.join(dirpath, fn)
                with open(path) as f:
                    if GENERATED_MARK in f.read():
                        out.append(os.path.relpath(path, root).replace(os.sep, '/'))
    return sorted(out)


def format_table(family):
    """The family's shape table as text: L, d, d/L, backbone, total, schemes."""
    rows = [f"{family}: {FAMILIES[family].title}",
            f"  {'name':<12} {'L':>3} {'d':>5} {'d/L':>6} {'backbone':>13} {'total':>15}  schemes"]
    seen = {}
    for r in runs(family):
        key = (r.L, r.d, r.info.get('target_total'))
        seen.setdefault(key, []).append(r)
    for (L, d, target), rs in seen.items():
        r = rs[0]
        label = f"{target / 1e6:.0f}M" if target else ''
        rows.append(f"  {label:<12} {L:>3} {d:>5} {r.ratio:>6.2f} {r.backbone:>13,} {r.total:>15,}  "
                    f"{','.join(x.scheme for x in rs)}")
    return "\n".join(rows)


if __name__ == '__main__':
    usage = ("usage: python study/families.py [--check]\n  prints every family's shapes and parameter counts and "
             "writes their config files under config/;\n  --check writes nothing and fails if a config file "
             "is out of sync with this file")
    if {'-h', '--help'} & set(sys.argv[1:]):
        print(usage)
        sys.exit(0)
    check = '--check' in sys.argv[1:]
    if set(sys.argv[1:]) - {'--check'}:
        sys.exit(f"{usage.splitlines()[0]}   (unknown argument: {' '.join(set(sys.argv[1:]) - {'--check'})})")
    for family in FAMILIES:
        print(format_table(family), end="\n\n")
    changed = write_configs(check=check)
    if check:
        if changed:
            sys.exit(f"{len(changed)} config files out of sync with families.py (e.g. {changed[0]}); "
                     f"run `python study/families.py` to regenerate them")
        print(f"all {len(all_runs())} config files match families.py")
    else:
        print(f"wrote {len(changed)} config files ({len(all_runs())} runs in {len(FAMILIES)} families)")
