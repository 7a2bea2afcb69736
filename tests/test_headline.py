"""The headline command on a fresh clone: `python train.py config/attnres_L32.py` with only the
embedded sample prepares it, says in one line that its validation split is smaller than the
config's evaluation asks for, and evaluates on all of it (here at a tiny width, on the CPU).
Run: python -m pytest tests/test_headline.py -q"""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_headline_config_evaluates_on_the_embedded_sample(tmp_path):
    """The clone's tracked files only (no prepared data): the first line prepares the sample,
    the evaluation line names the 12 sequences of 2,049 tokens and the 50 x 16 asked for, and the
    loss of the untrained model is about ln(50280), a uniform guess over the vocabulary."""
    clone = tmp_path / 'clone'
    files = subprocess.run(['git', 'ls-files'], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / f, clone / f)
    assert not (clone / 'data' / 'fineweb_edu' / 'val.bin').exists()
    r = subprocess.run([sys.executable, 'train.py', 'config/attnres_L32.py', '--device=cpu', '--n_embd=64',
                        '--n_head=4', '--eval_only=True', f'--out_dir={tmp_path / "out"}'], cwd=clone,
                       capture_output=True, text=True, timeout=1200, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert sum('preparing it from the embedded sample' in line for line in out) == 1
    said = [line for line in out if line.startswith('evaluation:')]
    assert len(said) == 1 and 'holds 12 sequences of 2,049 tokens' in said[0] and '50 x 16' in said[0] \
        and 'scores 1 batch of 12 (24,576 tokens)' in said[0], said
    val = float(r.stdout.split('val loss ')[1].split()[0])
    assert val == pytest.approx(math.log(50280), abs=0.3)
