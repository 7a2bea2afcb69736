"""
Fast paths: drop-in replacements for plain pieces of residuals.py, same inputs and outputs,
behind one setting, `fast` = 'auto' | True | False ('auto': on for CUDA, off on the CPU), in
train.py, probe.py, sample.py and bench.py. Off, the plain code of residuals.py is all that
runs. On, each fast path below that applies replaces its plain method on the model's scheme,
after `check` has run a tiny twin of the model once plain and once fast: a student's edit
to residuals.py that a fast path would hide stops the run at start-up, in one line.

| fast path          | replaces (residuals.py)                 | applies            | runs                                  |
|--------------------|-----------------------------------------|--------------------|---------------------------------------|
| attnres_read_fla   | AttnRes.read (Full and Block AttnRes)    | CUDA, fla-core     | fla.ops.attnres.fused_attnres         |
| attnres_read_torch | AttnRes.read                             | no fla-core        | fast/attnres.py DepthRead (hand-written backward) |
| mhc_coeffs_liger   | MHC.coefficients (projection, Sinkhorn)  | CUDA, liger-kernel, mhc_sinkhorn='liger' | liger_mhc_coeffs |
| mhc_coeffs_torch   | MHC.coefficients                         | no liger-kernel    | fast/streams.py SinkhornRounds        |
| hc_coeffs_torch    | HC.coefficients                          | any device         | fast/hc.py HCProjection (no H_bar)    |
| streams_read_liger | MultiStream.read_streams (HC, mHC)       | CUDA, liger-kernel | liger_mhc_pre                         |
| streams_write_liger| MultiStream.write_streams (HC, mHC)      | CUDA, liger-kernel | liger_mhc_post_res                    |
| streams_write_torch| MultiStream.write_streams                | no liger-kernel    | one contiguous batched matmul-add     |
| moda_sdpa          | MoDA.attention (joint softmax)           | any device         | fast/moda.py: null key on fused SDPA  |

Where both forms of a piece apply, the first listed wins. Without fla-core or liger-kernel a
CUDA run uses the torch forms of the same rows. Measured (fast / plain step time, same
process, interleaved; `python bench.py --suite=fast`; docs/performance.md has the table with
its machine): on a 2-core CPU, eager, the step takes 0.56x the plain one for Full AttnRes
and 0.68x for Block AttnRes (attnres_read_torch), 0.92x for mHC (coefficients and stream
write), 0.96x for MoDA, and 0.99x for HC (coefficients and stream write: no win on the CPU). The
CUDA kernels and the torch forms on CUDA are not yet measured here (tools/gpu_check.py times
each read plain and fast; docs/gpu.md); fla-core's and Liger's are the kernels the study
trains with.

    import fast
    paths = fast.setup(model, 'auto', device)   # -> the FastPaths in use (checked), [] when off
"""

import importlib.util
from dataclasses import dataclass, replace
from typing import Callable

import torch

import residuals
from fast import attnres, hc, moda, streams
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


FAST_PATHS = [
    FastPath('attnres_read_fla', residuals.AttnRes, 'read', attnres.fla_read, 'fla fused_attnres',
             cuda_only=True, package='fla'),
    FastPath('attnres_read_torch', residuals.AttnRes, 'read', attnres.torch_read, 'DepthRead (torch)'),
    FastPath('mhc_coeffs_liger', residuals.MHC, 'coefficients', streams.liger_coefficients, 'liger_mhc_coeffs',
             cuda_only=True, package='liger_kernel', applies=lambda cfg: cfg.mhc_sinkhorn == 'liger'),
    FastPath('mhc_coeffs_torch', residuals.MHC, 'coefficients', streams.torch_mhc_coefficients,
             'SinkhornRounds (torch)'),
    FastPath('hc_coeffs_torch', residuals.HC, 'coefficients', hc.torch_hc_coefficients, 'HCProjection (torch)'),
    FastPath('streams_read_liger', residuals.MultiStream, 'read_streams', streams.liger_read, 'liger_mhc_pre',
             cuda_only=True, package='liger_kernel'),
    FastPath('streams_write_liger', residuals.MultiStream, 'write_streams', streams.liger_write,
             'liger_mhc_post_res', cuda_only=True, package='liger_kernel'),
    FastPath('streams_write_torch', residuals.MultiStream, 'write_streams', streams.torch_write,
             'batched matmul-add (torch)'),
    FastPath('moda_sdpa', residuals.MoDA, 'attention', moda.sdpa_attention, 'null key on SDPA'),
]


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
    for p in FAST_PATHS:
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


def check(model, paths, device):
    """The start-up guard: a twin of `model` (`twin_config`, random weights; fp64 on the CPU,
    fp32 on CUDA) runs a training step plain and then with each fast path alone; logits and
    every gradient must agree to 1e-9 relative (fp64) or 2e-3 (fp32). Raises
    FastPathMismatch naming the fast path and the plain method otherwise."""
    device = torch.device(device)
    dtype, tol = (torch.float64, 1e-9) if device.type == 'cpu' else (torch.float32, 2e-3)
    twin = GPT(twin_config(model.config)).to(device=device, dtype=dtype)
    randomise(twin)
    idx = torch.randint(0, twin.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    plain = _run(twin, idx)
    for p in paths:
        enable(twin, [p])
        try:
            got = _run(twin, idx)
        finally:
            disable(twin)
        if [n for n, _ in got] != [n for n, _ in plain]:
            raise FastPathMismatch(f"fast path {p.name} ({p.runs}) leaves other parameters without gradient than "
                                   f"residuals.{p.scheme.__name__}.{p.method}: run with --fast=False")
        # each tensor's error relative to its largest entry, floored at 1e-3 of the largest of all
        # (a gradient that is small by cancellation carries the rounding of its larger terms)
        floor = 1e-3 * max(t.abs().max().item() for _, t in plain)
        for (n, want), (_, have) in zip(plain, got):
            err = (have - want).abs().max().item() / max(want.abs().max().item(), floor)
            if not err <= tol:
                raise FastPathMismatch(
                    f"fast path {p.name} ({p.runs}) disagrees with residuals.{p.scheme.__name__}.{p.method} "
                    f"on the start-up twin ({n}: relative error {err:.1e} > {tol:.0e}); if you edited that "
                    f"method, run with --fast=False so that your code is what runs")


def setup(model, setting, device, guard=True):
    """Resolves `setting` for `device`, puts the fast paths that apply in place (after the
    start-up `check` unless guard=False) and returns them ([] when off)."""
    if not resolve(setting, device):
        return []
    paths = select(model, device)
    if guard and paths:
        check(model, paths, device)
    enable(model, paths)
    return paths


def describe(paths):
    """One line for the run's log: which fast paths are on."""
    if not paths:
        return "fast paths: off (the plain code of residuals.py)"
    return "fast paths: " + ", ".join(f"{p.name} ({p.runs})" for p in paths) + " - checked against residuals.py"
