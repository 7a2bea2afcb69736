"""
fla-core's AttnRes depth read, `residuals.AttnRes.read(sources, mixer) -> (z, a)` on
fla.ops.attnres.fused_attnres (arXiv 2603.15031; the study's own kernel derives from it): one
pass over a read's sources forward, two backward, nothing of size n x (B, T, d) kept. CUDA only.

It is not a fast path of `fast` (the grouped read of fast/depth_read.py reads each source once
per group of reads, and sums each source's gradient in one buffer, where this kernel reads every
source at every read and autograd sums the gradients read by read): it is the published kernel
the grouped read is measured against (tools/gpu_check.py, `bench.py --suite=step`), and it runs
under Triton's interpreter in the test suite.
"""

import inspect
import os
import re
from pathlib import Path

import torch


# fla-core's three attnres kernels take their launch configs from here, never from Triton's
# autotuner (which would time every variant, serially, at the first call's shape: minutes on a
# fresh GPU, and at the memory planner's toy shapes). fla_configs/<GPU name>/ where measured,
# else fla_configs/default/ (docs/gpu.md); a user's own FLA_CONFIG_DIR / FLA_CACHE_MODE win.
FLA_CONFIGS = Path(__file__).with_name('fla_configs')
FLA_KERNELS = ('attnres_fwd_kernel', 'attnres_bwd_kernel_dv', 'attnres_bwd_kernel_dqdw')


def fla_config_dir(device_name=None):
    """fla_configs/<device name as fla spells it> if measured there, else fla_configs/default."""
    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
    name = re.sub(r'[^0-9A-Za-z]+', '_', device_name or '').strip('_')
    return FLA_CONFIGS / name if name and (FLA_CONFIGS / name).is_dir() else FLA_CONFIGS / 'default'


def fla_kernel():
    """fla.ops.attnres.fused_attnres, with its launch configs pinned (FLA_CONFIGS). Under Triton's
    interpreter (TRITON_INTERPRET=1: the kernels on CPU tensors, for tests) one narrow shim:
    fla_core 0.6.0 refuses non-CUDA tensors before its launch; that check is taken out."""
    user_mode = 'FLA_CACHE_MODE' in os.environ
    os.environ.setdefault('FLA_CACHE_MODE', 'full')   # exact key, then any key, then default_config
    os.environ.setdefault('FLA_CONFIG_DIR', str(fla_config_dir()))
    from fla.ops.attnres import fused, fused_attnres
    from fla.ops.utils import cache
    if not user_mode and cache.FLA_CACHE_MODE is cache.FlaCacheMode.DISABLED:  # fla imported before us
        cache.FLA_CACHE_MODE = cache.FlaCacheMode.FULL
    if os.environ.get('TRITON_INTERPRET') == '1' and not getattr(fused, 'interpreted', False):
        src = inspect.getsource(fused.fused_attnres_fwd)
        check = '    if not residuals[0].is_cuda:\n        raise ValueError("Triton attnres requires CUDA tensors")\n'
        assert check in src, "fla_core's CUDA check moved: update fast/attnres.py's interpreter shim"
        exec(compile(src.replace(check, ''), fused.__file__, 'exec'), fused.__dict__)
        fused.interpreted = True
    return fused_attnres


def cast_once(v, dtype):
    """v (any shape) in `dtype`, cast once per tensor: the copy is kept on v (for the same
    dtype, grad mode and in-place version of v) and handed to every later read of v, so that
    a source read by n reads costs one cast forward and one backward, not n, and autograd sums
    its n gradients in `dtype` before the one cast back to v's dtype."""
    if v.dtype == dtype or torch.is_inference(v):  # an inference tensor has no version to key on
        return v.to(dtype)
    key = (dtype, torch.is_grad_enabled(), v._version)
    kept = getattr(v, '_cast_once', None)
    if kept is None or kept[0] != key:
        kept = (key, v.to(dtype))
        v._cast_once = kept
    return kept[1]


def fla_read(self, sources, mixer):
    """AttnRes.read on fla-core's kernel: sources n x (B, T, d) -> z (B, T, d), a (n, B, T),
    both fp32. The kernel takes sources of one dtype: under bf16 autocast the fp32 embedding
    (and Block AttnRes's fp32 sums) are read in the sublayer outputs' dtype, as the study keeps
    every source in bf16, each cast once for all the reads of it (`cast_once`). The kernel's
    checkpoint_level=1 (its default): its backward recomputes the mix from the sources in
    fp32; level 0 keeps it in the sources' dtype, a rounding of the query's and the key gain's
    gradients the plain read does not do (the start-up guard under bf16 autocast refuses it)."""
    fused_attnres = fla_kernel()
    dtype = min((v.dtype for v in sources), key=lambda t: t.itemsize)
    z, a = fused_attnres(mixer.query, [cast_once(v, dtype) for v in sources], mixer.key_norm.weight,
                         rms_eps=mixer.key_norm.eps, return_weights=True)
    return z.float(), a.float()
