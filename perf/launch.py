"""
The one place where the project's own Triton kernels (fast/) are launched.

    launch('fast.depth_kernels', 'phase1_fwd', grid, reads=('src', 'u'), writes=('z1', 'lse'),
           num_warps=8, src=(v0, v1), u=u, z1=z1, lse=lse, N=n, D=d, BD=1024)

runs the @triton.jit function `phase1_fwd` of module fast.depth_kernels (imported on first use,
so that everything else in fast/ imports without Triton) on `grid` with the keyword arguments.
`reads` and `writes` name the tensor arguments (a tuple argument names all its tensors) the
kernel reads and writes in full (`also_read`: written tensors it reads too, the buffers it adds
into): they are what the step count of perf/step.py charges for the launch. While a `Recorder` is active (the count,
under fake tensors, with no Triton and no GPU) a launch is recorded by each, not run.

tools/kernels.py records the launches of a training step at a shape this way and compiles each
kernel variant they use for sm_80 and sm_90, without a GPU.
"""

import importlib

import torch

_RECORDERS = []  # the active recorders (perf/step.py's count, tools/kernels.py)


class Recorder:
    """Records launches instead of running them: `record(name, reads, writes, flops)` is called
    per launch with the tensors read and written, and `seen(module, kernel, args, options)` (if
    given) with the launch itself. A context manager."""

    def __init__(self, record, seen=None):
        self.record, self.seen = record, seen

    def __enter__(self):
        _RECORDERS.append(self)
        return self

    def __exit__(self, *exc):
        _RECORDERS.remove(self)


def tensors(args, names):
    """The tensors of the arguments `names` (a tuple argument: each of its tensors)."""
    out = []
    for n in names:
        a = args[n]
        out.extend(t for t in (a if isinstance(a, (tuple, list)) else (a,)) if isinstance(t, torch.Tensor))
    return out


def launch(module, kernel, grid, reads, writes, also_read=(), reread=(), flops=0, num_warps=4, num_stages=1,
           maxnreg=None, **args):
    """Runs kernel `kernel` of `module` on `grid` (a tuple) with `args`, or records it (module
    docstring). also_read: tensors among the written ones that the kernel also reads (it adds
    into them). reread: names of arguments the kernel reads a second time (a second pass over
    them), charged again. flops: the kernel's floating-point operations (for the step count).
    Every name in reads/writes/reread must be an argument (an assert: the count must see what the
    kernel touches). maxnreg: the registers a thread may use (ptxas otherwise caps some 8-warp
    kernels at 128 and spills)."""
    assert all(n in args for n in (*reads, *writes, *reread)), \
        f"{kernel}: reads/writes name an argument it is not given"
    if _RECORDERS:
        options = dict(num_warps=num_warps, num_stages=num_stages, **({'maxnreg': maxnreg} if maxnreg else {}))
        again = [t.detach() for t in tensors(args, reread)]  # other objects: not merged with the first read
        for r in _RECORDERS:
            r.record(f"{module.rpartition('.')[2]}.{kernel}", tensors(args, reads) + list(also_read) + again,
                     tensors(args, writes), flops)
            if r.seen is not None:
                r.seen(module, kernel, args, options)
        return
    fn = getattr(importlib.import_module(module), kernel)
    fn[grid](**args, num_warps=num_warps, num_stages=num_stages, **({'maxnreg': maxnreg} if maxnreg else {}))
