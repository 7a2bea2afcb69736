"""
Every Triton kernel variant of fast/ that a training step at the 400M L = 32 shape launches,
compiled for sm_80 and sm_90 by Triton's own compiler and its bundled ptxas (tools/kernels.py;
no GPU, no driver): none spills, none needs more shared memory or registers than the target
has. And the tool's verdicts themselves: a kernel that spills is reported as spilling (a real
compile), shared memory and registers past the limits are problems. Needs triton
(requirements-interpret.txt, in <repo>/.interpret as `.ci/run` installs it); skips without it.

    python -m pytest tests/test_kernel_build.py -q
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools import kernels  # noqa: E402

TRITON = '' if __import__('importlib').util.find_spec('triton') else \
    str(REPO / '.interpret') if (REPO / '.interpret' / 'triton').is_dir() else None
needs_triton = pytest.mark.skipif(TRITON is None, reason="needs triton: pip install --no-deps --target .interpret "
                                                         "-r requirements-interpret.txt")


def run(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(p for p in (TRITON, str(REPO)) if p))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # ~2 minutes: ~70 variants, two targets each
@needs_triton
def test_every_kernel_variant_builds_for_sm80_and_sm90_without_spills(tmp_path):
    out = tmp_path / 'kernels.json'
    r = run('tools/kernels.py', f'--json={out}')
    rows = json.loads(out.read_text())
    bad = [f"{x['kernel']} {x['variant']} sm_{x['arch']}: {'; '.join(x['problems'])}" for x in rows if x['problems']]
    assert r.returncode == 0 and not bad, bad or r.stderr[-2000:]
    # the variants are the launches of a real step: every kernel, both schemes, both targets
    assert {x['kernel'] for x in rows} == {'phase1_fwd', 'phase2_fwd', 'sum_phase2_fwd', 'contribute_bwd', 'finish_bwd',
                                           'hc_fwd', 'hc_bwd', 'mhc_fwd', 'mhc_bwd', 'mhc_bwd_coef', 'depth_fwd', 'depth_bwd'}
    assert {x['scheme'] for x in rows} == {'attnres', 'blockattnres', 'hc', 'mhc', 'moda'}
    # MoDA's reads of 2 to 62 slots: tiles of 2 to 64 slots, each compiled
    tiles = {int(x['variant'].split('SP=')[1].split()[0]) for x in rows if x['kernel'] == 'depth_fwd'}
    assert tiles == {2, 4, 8, 16, 32, 64}
    assert {x['arch'] for x in rows} == {80, 90}
    assert any('R=8' in x['variant'] for x in rows if x['kernel'] == 'contribute_bwd')  # a full group's backward
    assert all(x['registers'] > 0 for x in rows)


SPILLER = '''
import sys
sys.path.insert(0, {repo!r})
import triton, triton.language as tl
from tools import kernels

@triton.jit
def hungry(x, y, N, BD: tl.constexpr):
    # 32 rows of BD = 256 fp32 lanes live at once in one warp: 256 values a thread, past 255 registers
    offs = tl.arange(0, BD)
    rows = tl.arange(0, 32)
    acc = tl.load(x + rows[:, None] * BD + offs[None, :])
    for i in range(N):
        acc = acc * tl.load(x + i * BD + offs)[None, :] + acc.sum(0)[None, :]
    tl.store(y + rows[:, None] * BD + offs[None, :], acc)

import torch
t = torch.empty(1)
row = kernels.compile_one('__main__', 'hungry', dict(x=t, y=t, N=8, BD=256), dict(num_warps=1, num_stages=1), 90)
print(row['spill_stores'], row['spill_loads'], row['registers'])
'''


@needs_triton
def test_a_kernel_that_spills_is_reported(tmp_path):
    """A real compile of a kernel that needs more registers than a thread has: ptxas spills, the
    tool reads the spill from ptxas's own report, and `problems` names it."""
    script = tmp_path / 'spill.py'
    script.write_text(SPILLER.format(repo=str(REPO)))
    r = run(str(script))
    assert r.returncode == 0, r.stderr[-2000:]
    stores, loads, regs = map(int, r.stdout.split())
    assert stores > 0 and loads > 0 and regs <= 255
    row = dict(arch=90, spill_stores=stores, spill_loads=loads, shared=0, registers=regs, warps=1)
    assert kernels.problems(row) == [f"spills {stores} B stored, {loads} B loaded"]


def test_the_limits_of_each_target():
    """Shared memory: 163 KiB a program on sm_80 (A100), 227 KiB on sm_90 (H100/H200); just inside
    is fine, one byte past is a problem; registers: 255 a thread and 64 Ki per program."""
    ok = dict(spill_stores=0, spill_loads=0, registers=128, warps=8)
    assert kernels.problems(dict(ok, arch=80, shared=166912)) == []
    assert kernels.problems(dict(ok, arch=80, shared=166913)) == ['shared memory 166913 B > 166912 B']
    assert kernels.problems(dict(ok, arch=90, shared=232448)) == []
    assert kernels.problems(dict(ok, arch=90, shared=232449))
    assert kernels.problems(dict(ok, arch=90, shared=0, registers=255, warps=8)) == []  # 255 x 256 = 65,280
    assert kernels.problems(dict(ok, arch=90, shared=0, registers=129, warps=16))       # 129 x 512 > 65,536
    assert kernels.problems(dict(ok, arch=90, shared=0, registers=128, warps=16)) == []
