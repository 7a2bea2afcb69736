"""
The fast paths' real Triton kernels, without a GPU: fla-core's fused_attnres and Liger's mHC
ops run under Triton's interpreter on CPU tensors (tests/interpreter_run.py, in a process of
its own), through fast/'s entry points, against the plain methods of residuals.py: fp32,
forward and backward. They need triton, fla-core, liger-kernel and einops
(requirements-interpret.txt), importable here or installed into <repo>/.interpret by
`.ci/run`; without them the module skips, in one line.

    pip install --no-deps --target .interpret -r requirements-interpret.txt
    python -m pytest tests/test_kernels_interpreted.py -q
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / '.interpret'  # where .ci/run installs requirements-interpret.txt
PACKAGES = ('triton', 'fla', 'liger_kernel', 'einops')


def kernel_path():
    """The PYTHONPATH entry that provides PACKAGES ('' when this environment has them), or None."""
    if all(importlib.util.find_spec(p) is not None for p in PACKAGES):
        return ''
    if all((TARGET / p).is_dir() for p in PACKAGES):
        return str(TARGET)
    return None


PATH = kernel_path()
pytestmark = [pytest.mark.slow,  # ~45 s: the interpreter runs every kernel launch in numpy
              pytest.mark.skipif(PATH is None, reason="the interpreted kernels need requirements-interpret.txt: pip "
                                                      "install --no-deps --target .interpret -r requirements-interpret.txt")]

# forward and gradients, max error relative to the largest plain entry (fp32; measured <= 1e-6)
TOL = 1e-5


CASES = {  # case: (outputs, gradients) compared
    'fla_read': (2, 7),            # z, a; 5 sources, pseudo-query, key gain
    'fla_read_2': (2, 4),          # Block AttnRes's smallest read: the embedding and one partial sum
    'liger_coefficients': (3, 6),  # pre, H_res, post; H, phi, bias, 3 gates
    'liger_read': (1, 2),
    'liger_write': (1, 4),
}


def test_kernels_match_the_plain_methods():
    """One process for all cases (importing triton and interpreting the first launch dominate);
    then the start-up guard under bf16 autocast given each kernel: none refused, and fla's bf16
    output refused when its rounding is not declared."""
    env = dict(os.environ, TRITON_INTERPRET='1', OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join(p for p in (PATH, str(REPO), os.environ.get('PYTHONPATH')) if p))
    r = subprocess.run([sys.executable, str(REPO / 'tests' / 'interpreter_run.py')], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row['case']: row for row in map(json.loads, filter(lambda ln: ln.startswith('{'), r.stdout.splitlines()))}
    assert set(rows) == set(CASES) | {'guard_bf16'}
    guard = rows['guard_bf16']['outputs']  # the guard under bf16 autocast: accepts every kernel as it is
    assert {k: v for k, v in guard.items() if k != 'attnres/undeclared' and v is not None} == {}
    assert len(guard) == 5 and 'output 0 is' in guard['attnres/undeclared']  # fla's bf16 output, undeclared
    for case, (n_outputs, n_grads) in CASES.items():
        row = rows[case]
        assert len(row['outputs']) == n_outputs and len(row['grads']) == n_grads, case
        for kind in ('outputs', 'grads'):
            for i, e in enumerate(row[kind]):
                assert e <= TOL, f"{case} {kind} {i}: relative error {e:.1e}"
