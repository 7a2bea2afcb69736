"""
Every Triton kernel variant of fast/ that a training step launches, compiled for the A100
(sm_80) and the H100/H200 (sm_90) with Triton's own compiler and its bundled ptxas: no GPU and
no driver needed. Prints, per kernel, variant and target, the registers per thread, the spill
stores and loads (bytes) and the shared memory per program, against the target's limits, and
exits 1 if any variant spills or needs more shared memory or registers than the target has.

    python tools/kernels.py                                    # the 400M L = 32 shape: Full and Block AttnRes, HC, mHC, MoDA
    python tools/kernels.py --config=config/attnres_L70.py --schemes=attnres --batch_size=4
    python tools/kernels.py --json=out/kernels.json

The variants are the launches themselves: a training micro-step at the config's shape runs under
fake tensors (perf/step.py, fast paths as on CUDA) and perf/launch.py records each launch's
kernel, argument types and options; every distinct one is compiled. Needs triton (the version of
requirements-interpret.txt; `--triton_path=.interpret` when it is installed there).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# per target: max shared memory per program (bytes, the opt-in limit), registers per thread and per SM
LIMITS = {80: dict(shared=166912, regs=255, regfile=65536),   # A100: 163 KiB
          90: dict(shared=232448, regs=255, regfile=65536)}   # H100 / H200: 227 KiB


def _type(x):
    """Triton's signature type of a launch argument (as its JIT specialises it)."""
    import torch
    if isinstance(x, torch.Tensor):
        return '*' + {torch.float32: 'fp32', torch.bfloat16: 'bf16', torch.float16: 'fp16', torch.float64: 'fp64',
                      torch.int64: 'i64', torch.int32: 'i32', torch.bool: 'i1'}[x.dtype]
    if isinstance(x, (tuple, list)):
        return tuple(_type(y) for y in x)
    if isinstance(x, bool):
        return 'i1'
    if isinstance(x, int):
        return 'i32' if -2 ** 31 <= x < 2 ** 31 else 'i64'
    if isinstance(x, float):
        return 'fp32'
    raise TypeError(f"no Triton type for {type(x).__name__}")


def variant(fn, args, options):
    """(signature, constexprs, attrs, key) of a launch of jit function `fn` with `args`: the
    JIT's specialisation (ints equal to 1 become constants; pointers and ints divisible by 16,
    as fresh allocations and the model's widths are, carry that hint)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        x = args[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = 'constexpr', x
        elif isinstance(x, int) and not isinstance(x, bool) and x == 1:
            signature[p.name], constexprs[p.name] = 'constexpr', 1
        else:
            signature[p.name] = _type(x)
            paths = [((i, j), y) for j, y in enumerate(x)] if isinstance(x, (tuple, list)) else [((i,), x)]
            for path, y in paths:
                if not isinstance(y, (int, float)) or (isinstance(y, int) and y % 16 == 0):
                    if not isinstance(y, float):
                        attrs[path] = [['tt.divisibility', 16]]
    key = (fn.__name__, repr(signature), repr(sorted(constexprs.items())), repr(sorted(options.items())))
    return signature, constexprs, attrs, key


def launches(config, schemes, batch_size):
    """{key: (module, kernel, args, options, label)} of every distinct launch of a training micro-step."""
    import importlib
    import perf.step as step
    from perf.launch import Recorder
    from model import GPTConfig
    shape = step.shape_of(config)
    batch = batch_size or shape.pop('batch_size')
    shape.pop('batch_size', None)
    found = {}

    def seen(module, kernel, args, options):
        fn = getattr(importlib.import_module(module), kernel)
        _, _, _, key = variant(fn, args, options)
        found.setdefault(key, (module, kernel, dict(args), options, scheme))

    for scheme in schemes:
        with Recorder(lambda *a: None, seen):
            step.count_step(GPTConfig(**{**shape, 'residual': scheme}), batch, shape['block_size'], 'cuda')
    return found


def ptxas(ptx, arch):
    """(registers, spill store bytes, spill load bytes) of PTX for sm_<arch> by the bundled ptxas -v."""
    from triton.backends.nvidia import compiler as nv
    exe = nv.get_ptxas(arch).path if hasattr(nv, 'get_ptxas') else os.path.join(
        os.path.dirname(nv.__file__), 'bin', 'ptxas')
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'k.ptx')
        with open(path, 'w') as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        r = subprocess.run([exe, '-v', f'--gpu-name={gpu}', path, '-o', os.path.join(d, 'k.cubin')],
                           capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {r.stderr.strip()[-500:]}")
    regs = int(re.search(r'Used (\d+) registers', r.stderr).group(1))
    spill = re.search(r'(\d+) bytes spill stores, (\d+) bytes spill loads', r.stderr)
    return regs, int(spill.group(1)), int(spill.group(2))


def compile_one(module, kernel, args, options, arch):
    """One variant for sm_<arch>: dict(registers, spill_stores, spill_loads, shared, seconds)."""
    import importlib
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(module), kernel)
    signature, constexprs, attrs, _ = variant(fn, args, options)
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget('cuda', arch, 32),
                       options=dict(options))
    regs, stores, loads = ptxas(k.asm['ptx'], arch)
    return dict(registers=regs, spill_stores=stores, spill_loads=loads, shared=k.metadata.shared,
                warps=options['num_warps'], seconds=round(time.perf_counter() - t0, 2))


def describe(args):
    """A short label of a variant's sizes: tuple lengths and the small int constants."""
    parts = []
    for name, x in args.items():
        if isinstance(x, (tuple, list)):
            parts.append(f"{name}[{len(x)}]")
        elif isinstance(x, bool) or (isinstance(x, int) and name.isupper()):
            parts.append(f"{name}={x}")
    return ' '.join(parts)


def problems(row):
    """What is wrong with a compiled variant against its target's limits ([] if nothing)."""
    lim, out = LIMITS[row['arch']], []
    if row['spill_stores'] or row['spill_loads']:
        out.append(f"spills {row['spill_stores']} B stored, {row['spill_loads']} B loaded")
    if row['shared'] > lim['shared']:
        out.append(f"shared memory {row['shared']} B > {lim['shared']} B")
    if row['registers'] > lim['regs'] or row['registers'] * 32 * row['warps'] > lim['regfile']:
        out.append(f"{row['registers']} registers x {32 * row['warps']} threads exceed the register file")
    return out


def report(config, schemes, batch_size=None, archs=(80, 90), log=print):
    """Compiles every variant for every arch; returns the rows (dicts) and logs a table."""
    rows = []
    found = launches(config, schemes, batch_size)
    log(f"{len(found)} kernel variants launched by a training step of {', '.join(schemes)} at {config}")
    log('| kernel | variant | scheme | sm | warps | registers | spills (B) | shared (B) | |')
    log('|---|---|---|---|---|---|---|---|---|')
    for key in sorted(found):
        module, kernel, args, options, scheme = found[key]
        for arch in archs:
            row = dict(kernel=kernel, variant=describe(args), scheme=scheme, arch=arch,
                       **compile_one(module, kernel, args, options, arch))
            row['problems'] = problems(row)
            rows.append(row)
            log(f"| {kernel} | {row['variant']} | {scheme} | {arch} | {row['warps']} | {row['registers']} | "
                f"{row['spill_stores'] + row['spill_loads']} | {row['shared']} | "
                f"{'; '.join(row['problems']) or 'ok'} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--config', default='config/attnres_L32.py', help="train.py config file whose shape is compiled")
    ap.add_argument('--schemes', default='attnres,blockattnres,hc,mhc,moda', help="schemes whose launches are compiled")
    ap.add_argument('--batch_size', type=int, default=None, help="micro-batch (default: the config's)")
    ap.add_argument('--archs', default='80,90', help="compute capabilities to compile for")
    ap.add_argument('--json', default=None, help="also write the rows to this JSON file")
    ap.add_argument('--triton_path', default=None, help="a folder holding triton (e.g. .interpret)")
    a = ap.parse_args(argv)
    if a.triton_path:
        sys.path.insert(0, a.triton_path)
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("tools/kernels.py needs triton: pip install --no-deps --target .interpret "
                 "-r requirements-interpret.txt, then --triton_path=.interpret")
    rows = report(a.config, [s.strip() for s in a.schemes.split(',') if s.strip()], a.batch_size,
                  [int(x) for x in a.archs.split(',')])
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if r['problems']]
    print(f"{len(rows)} compiled, {len(bad)} with problems")
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
