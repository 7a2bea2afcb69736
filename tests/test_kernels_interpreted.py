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


def interpret(*cases):
    """{case: row} of tests/interpreter_run.py run on `cases` in a process of its own."""
    env = dict(os.environ, TRITON_INTERPRET='1', OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join(p for p in (PATH, str(REPO), os.environ.get('PYTHONPATH')) if p))
    r = subprocess.run([sys.executable, str(REPO / 'tests' / 'interpreter_run.py'), *cases], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row['case']: row for row in map(json.loads, filter(lambda ln: ln.startswith('{'), r.stdout.splitlines()))}
    assert set(rows) == set(cases)
    return rows


# The grouped AttnRes read's kernels (fast/depth_kernels.py) over all 8 reads of a 4-block model:
# outputs z (and a), gradients of the 9 sources and of the 8 pseudo-queries and 8 key gains
DEPTH = [f'depth_{s}_G{g}_fp32' for s in ('attnres', 'blockattnres', 'blockattnres_sum') for g in (1, 3, 8)] + \
    [f'depth_{s}_G3_bf16' for s in ('attnres', 'blockattnres', 'blockattnres_sum')] + \
    [f'depth_{s}_G8_chain' for s in ('attnres', 'blockattnres', 'blockattnres_sum')] + ['depth_attnres_G3_weights']
BIG = ['depth_attnres_G3_big', 'depth_blockattnres_G3_big']
AUTOCAST_FACTOR, AUTOCAST_FLOOR = 3.0, 1e-5  # as the start-up guard: fast <= 3x plain's distance to fp64 + 1e-5


@pytest.mark.parametrize('scheme', ['attnres', 'blockattnres', 'blockattnres_sum'])
def test_grouped_read_kernels_match_the_plain_read(scheme):
    """Each case: every output and gradient of the kernels within 3x the plain read's own distance
    to fp64 (+ 1e-5), the start-up guard's rule: groups of 1, 3 and 8 reads (8 reads: 3 is no
    divisor), fp32 sources and (groups of 3) bf16 ones, reads independent of each other (an
    order the grouped read must not rely on) and chained as in the model, the weights' own
    gradient (a loss on a); Block AttnRes's running sum fused with the read after it
    (blockattnres_sum: BlockAttnRes.block's fast form, sum_phase2_fwd and finish_bwd's second
    output). Pseudo-queries 40x (scores of +-100, where an online softmax without its running
    max overflows fp32): finite, and within 30x the plain read's distance to fp64 (+ 1e-4): so
    peaked a softmax leaves each weight's gradient a tiny difference p - c, which the grouped
    read forms from two dot products (gz . v and gz . z) where the plain read forms c from the
    same p's, ~sqrt(d) times the plain read's rounding (measured 14x at d = 24)."""
    cases = [c for c in DEPTH + BIG if c.startswith(f'depth_{scheme}_G')]
    rows = interpret(*cases)
    for case in cases:
        row = rows[case]
        outputs = 16 if case.endswith('weights') else 8
        assert len(row['outputs']) == outputs and len(row['grads']) == 9 + 16, case
        for kind in ('outputs', 'grads'):
            for i, (fast, plain) in enumerate(row[kind]):
                factor, floor = (30.0, 1e-4) if case in BIG else (AUTOCAST_FACTOR, AUTOCAST_FLOOR)
                assert fast <= factor * plain + floor, \
                    f"{case} {kind} {i}: {fast:.1e} from fp64 where the plain read is {plain:.1e}"


def test_the_guard_passes_the_grouped_read_kernels():
    """fast.check on the Triton paths under the interpreter: the fp32 twin (CUDA's 2e-3) and the
    twin under bf16 autocast accept both as they are."""
    assert interpret('guard_depth')['guard_depth']['outputs'] == {
        'attnres_group_triton': None, 'blockattnres_group_triton': None, 'blockattnres_sum_triton': None}


def test_kernels_match_the_plain_methods():
    """One process for all cases (importing triton and interpreting the first launch dominate);
    then the start-up guard under bf16 autocast given each kernel: none refused, and fla's bf16
    output refused when its rounding is not declared."""
    rows = interpret(*CASES, 'guard_bf16')
    guard = rows['guard_bf16']['outputs']  # the guard under bf16 autocast: accepts every kernel as it is
    assert {k: v for k, v in guard.items() if k != 'attnres/undeclared' and v is not None} == {}
    assert len(guard) == 5 and 'output 0 is' in guard['attnres/undeclared']  # fla's bf16 output, undeclared
    for case, (n_outputs, n_grads) in CASES.items():
        row = rows[case]
        assert len(row['outputs']) == n_outputs and len(row['grads']) == n_grads, case
        for kind in ('outputs', 'grads'):
            for i, e in enumerate(row[kind]):
                assert e <= TOL, f"{case} {kind} {i}: relative error {e:.1e}"


# The fused stream steps of HC and mHC (fast/stream_kernels.py), each over a whole tiny model: the
# loss and every parameter's gradient
STREAMS = {'hc': ['streams_hc_fp32', 'streams_hc_bf16', 'streams_hc_m3'],
           'mhc': ['streams_mhc_fp32', 'streams_mhc_bf16', 'streams_mhc_m3', 'streams_mhc_plain'],
           # MoDA's depth cache (fast/moda_kernels.py): reads of 2, 4 and 6 slots, hd = 10, G = 1 and 2
           'moda': ['moda_fp32', 'moda_bf16', 'moda_gqa_fp32', 'moda_gqa_bf16', 'moda_fp16']}


def within_rule(row):
    """Whether every output and gradient of a whole-model case is within 3x the plain code's own
    distance to fp64 (+ 1e-5), the start-up guard's rule."""
    return all(fast <= AUTOCAST_FACTOR * plain + AUTOCAST_FLOOR for fast, plain in row['outputs'] + row['grads'])


@pytest.mark.parametrize('scheme', list(STREAMS))
def test_fused_kernels_match_the_plain_block(scheme):
    """The kernels in place of MultiStream.block (HC, mHC), forward and every gradient (each
    parameter's, so the streams' through them) within 3x the plain block's own distance to fp64
    (+ 1e-5): fp32 and bf16 autocast; d = 24 (blocks of 32 lanes: masked), N = 10 tokens (HC's
    backward programs over a remainder, mHC's blocks of 64 tokens: partial), m = 3 streams (one of
    4 lanes masked), mHC's both Sinkhorn orders; a 3-block model (the first read, the steps that
    plan the next block's read, the last write alone). MoDA: its depth cache's kernels in place of
    MoDA.block, a 4-block model (reads of 2, 4 and 6 slots: tiles with masked slots), hd = 10 (6
    of 16 features masked), one and two query heads a key/value head, fp32, bf16 and fp16 autocast."""
    rows = interpret(*STREAMS[scheme])
    for case, row in rows.items():
        assert len(row['outputs']) == 1 and len(row['grads']) > 20, case
        for kind in ('outputs', 'grads'):
            for i, (fast, plain) in enumerate(row[kind]):
                assert fast <= AUTOCAST_FACTOR * plain + AUTOCAST_FLOOR, \
                    f"{case} {kind} {i}: {fast:.1e} from fp64 where the plain block is {plain:.1e}"


@pytest.mark.parametrize('case,schemes', [('guard_streams', ('hc', 'mhc')), ('guard_moda', ('moda',))])
def test_the_guard_passes_the_fused_kernels(case, schemes):
    """fast.check on the Triton paths of HC, mHC and MoDA under the interpreter: the fp32 twin
    (CUDA's 2e-3) and the twin under bf16 autocast accept them as they are."""
    assert interpret(case)[case]['outputs'] == {s: None for s in schemes}


@pytest.mark.parametrize('plant', ['stream_gradient_missing_a_use', 'sinkhorn_rounds_in_bf16', 'moda_weights_not_joint',
                                   'moda_score_gradient_without_D'])
def test_a_planted_kernel_error_is_refused_and_fails(plant):
    """One line of a kernel changed (the read's share of the streams' gradient dropped; each Sinkhorn
    normalisation rounded to bf16; MoDA's depth weights kept relative to the depth part, not the
    joint softmax; dy . y dropped from MoDA's depth score gradient): the start-up guard
    refuses the path in one line naming it, and the comparison against the plain block fails."""
    row = interpret(f'planted_{plant}')[f'planted_{plant}']['outputs']
    name = {'stream_gradient_missing_a_use': 'hc_streams_triton', 'sinkhorn_rounds_in_bf16': 'mhc_streams_triton',
            'moda_weights_not_joint': 'moda_depth_cache_triton',
            'moda_score_gradient_without_D': 'moda_depth_cache_triton'}[plant]
    assert row['verdict'] is not None and name in row['verdict'] and '\n' not in row['verdict']
    assert not within_rule(row)
