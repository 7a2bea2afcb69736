"""
docs/new_scheme.md run as written: its code blocks are read from the markdown, the
scheme's class is registered in the running process (residuals.py is not edited), its
check block runs, its train.py and probe.py commands run (on a tiny byte-level corpus,
with a tiny shape appended), cost.py counts its parameters and measures its ΔF, and it
generates the same tokens with and without the KV cache.
Run: python -m pytest tests/test_new_scheme_doc.py -q
"""

import contextlib
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import cost  # noqa: E402
import residuals  # noqa: E402
from model import GPTConfig  # noqa: E402

DOC = REPO / 'docs' / 'new_scheme.md'
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)  # ```lang tag \n code ```
NAME = 'gated'


def blocks():
    """[(lang, tag, code)] of the doc's fenced code blocks, in order."""
    return [(lang, tag.strip(), code) for lang, tag, code in FENCE.findall(DOC.read_text())]


def scheme_code():
    """What the doc adds to residuals.py: its `python residuals.py` blocks, in order."""
    code = [c for lang, tag, c in blocks() if lang == 'python' and tag == 'residuals.py']
    assert len(code) == 2, "the class and its registry line"
    return '\n'.join(code)


def python_blocks():
    return [c for lang, tag, c in blocks() if lang == 'python' and tag != 'residuals.py']


def command(prog):
    """The doc's shell command that runs `prog` (e.g. train.py), as an argument list."""
    found = [shlex.split(line) for lang, _, c in blocks() if lang == 'sh' for line in c.splitlines()
             if line.startswith(f'python {prog}')]
    assert len(found) == 1, f"one `python {prog}` command in {DOC.name}"
    return found[0][2:]


@pytest.fixture
def registered(monkeypatch):
    """The doc's class registered in this process, as if pasted into residuals.py; the
    registry is restored afterwards."""
    monkeypatch.setitem(residuals.RESIDUALS, NAME, None)  # undone (removed) at teardown
    exec(scheme_code(), dict(vars(residuals)))  # the module's names, as inside residuals.py
    cls = residuals.RESIDUALS[NAME]
    assert isinstance(cls, type) and issubclass(cls, residuals.Residual)
    return cls


def run_block(code):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {'__name__': '__doc_block__'})
    return out.getvalue()


def test_check_block_runs(registered):
    """The doc's equivalence check (gated at init == Pre-LN, not after the gates move)."""
    check = python_blocks()[0]
    assert 'gated at init == Pre-LN' in run_block(check)


def test_generation_block_runs(registered):
    """The doc's KV-cache check: the gated scheme generates the same tokens with and without
    the cache, past block_size."""
    generate = python_blocks()[2]
    assert 'generation with the KV cache == recomputing the context' in run_block(generate)


def preln_params(L, d, V, d_ff):
    """Pre-LN's parameter count written out: L·(4d² + 3·d·d_ff + 2d) + 2Vd + d (MHA)."""
    return L * (4 * d * d + 3 * d * d_ff + 2 * d) + 2 * V * d + d


def test_cost_counts_the_new_scheme(registered):
    """cost.py has no closed form for it: the counted parameters equal Pre-LN's + 2Ld
    (one gate vector per sublayer), and the measured ΔF equals the gates' 2d FLOPs per
    token and sublayer, 4·T·d·L, as printed by the doc's cost block."""
    cost_block = python_blocks()[1]
    out = run_block(cost_block)
    L, d, T, V = 4, 128, 128, 50280
    d_ff = 16 * math.ceil(8 * d / 3 / 16)
    n = preln_params(L, d, V, d_ff) + 2 * L * d
    dF = 4 * T * d * L
    assert f"{n:,} parameters" in out and f"ΔF = {dF:,} FLOPs" in out
    assert cost.extra_flop_terms(NAME, L, d, T, n_head=4) == {'measured': dF}  # the fallback, not a formula
    cfg = GPTConfig(n_layer=L, n_embd=d, n_head=4, block_size=T, residual=NAME)
    assert cost.flop_check(cfg, T)['missing'] == 0  # the analytic total then counts what the model runs


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A learnable byte-level corpus (a repeated sentence with 5% noise)."""
    d = tmp_path_factory.mktemp('data')
    rng = np.random.default_rng(0)
    text = np.frombuffer(b'the quick brown fox jumps over the lazy dog. ' * 800, dtype=np.uint8).astype(np.uint16)
    tokens = np.where(rng.random(text.size) < 0.05, rng.integers(0, 256, size=text.size, dtype=np.uint16), text)
    tokens[:30000].tofile(d / 'train.bin')
    tokens[30000:].tofile(d / 'val.bin')
    (d / 'meta.json').write_text(json.dumps({'vocab_size': 257, 'tokenizer': 'byte'}))
    return d


RUNNER = """
import runpy, sys
sys.path.insert(0, {repo!r})
import residuals
exec(open({code!r}).read(), dict(vars(residuals)))  # the doc's class, registered in this process
prog, *args = sys.argv[1:]
sys.argv = [prog, *args]
runpy.run_path({repo!r} + '/' + prog, run_name='__main__')
"""


def run(tmp_path, prog, args):
    """Runs `python prog args` in tmp_path (with the repository's config/ linked in) in a
    process where the doc's scheme is registered; returns stdout + stderr."""
    (tmp_path / 'scheme.py').write_text(scheme_code())
    runner = tmp_path / 'runner.py'
    runner.write_text(RUNNER.format(repo=str(REPO), code=str(tmp_path / 'scheme.py')))
    if not (tmp_path / 'config').exists():
        (tmp_path / 'config').symlink_to(REPO / 'config')
    env = dict(os.environ, OMP_NUM_THREADS='1', MPLBACKEND='Agg')
    r = subprocess.run([sys.executable, str(runner), prog, *args], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, f"{prog} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


# appended to the doc's train command: a tiny shape and corpus, so the test takes seconds
TINY = ['--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=32', '--batch_size=4', '--max_iters=40',
        '--eval_interval=40', '--eval_iters=2', '--log_interval=1']


@pytest.mark.slow  # two subprocesses: about 20 s on an idle 2-core CPU
def test_the_scheme_trains_and_probes(registered, data_dir, tmp_path):
    """The doc's train.py command trains the gated scheme (loss goes down, at the class's
    peak LR) and its probe.py command probes the checkpoint."""
    args = command('train.py')
    out = run(tmp_path, 'train.py', [*args, f'--data_dir={data_dir}', *TINY])
    assert f"{NAME}, L=2, d=32" in out and 'peak lr 0.002' in out
    out_dir = tmp_path / next(a.split('=', 1)[1] for a in args if a.startswith('--out_dir='))
    rows = [json.loads(line) for line in (out_dir / 'metrics.jsonl').read_text().splitlines()]
    val = [r['val_loss'] for r in rows if 'val_loss' in r]
    losses = [r['train_loss'] for r in rows if 'train_loss' in r]
    assert val[0] == pytest.approx(math.log(257), abs=0.3) and val[-1] < val[0] - 0.5
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5

    probe_args = [a if not a.startswith('--seq_len=') else '--seq_len=32' for a in command('probe.py')]
    run(tmp_path, 'probe.py', [*probe_args, '--device=cpu'])
    result = json.loads((out_dir / 'probe' / 'probe.json').read_text())
    for metric in ('angular', 'causal', 'logit_lens'):
        assert metric in result, metric
    C = np.array(result['causal']['C'], dtype=float)
    assert C.shape == (2, 2) and np.isfinite(C[np.triu_indices(2, 1)]).all()
    assert (out_dir / 'probe' / 'angular.png').stat().st_size > 0
