"""Every signal is a line: SIGTERM and Ctrl-C (SIGINT) sent by a real `kill` to a real train.py or
study/sweep.py at the moments the other tests do not reach: while the libraries load (before
the settings are read), while the sweep probes, while it writes its results. Each gives one
line, exit status 128 + the signal, no traceback, and leaves no half-written file.
(Training and checkpointing moments: tests/test_run_directory.py.)
Run: python -m pytest tests/test_signals.py -q"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS='1')


def catches(pid, signum):
    """Whether process pid has a handler installed for signum (SigCgt of /proc/<pid>/status)."""
    try:
        status = Path(f'/proc/{pid}/status').read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith('SigCgt:')), 16)
    return bool(mask >> (signum - 1) & 1)


def signal_when(p, ready, signum, seconds=120):
    """Sends signum to p once ready() holds (polled every 5 ms); returns (stdout, stderr)."""
    t0 = time.time()
    try:
        while not ready():
            assert p.poll() is None, p.communicate()
            assert time.time() - t0 < seconds, 'the moment never came'
            time.sleep(0.005)
        p.send_signal(signum)
        return p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()


def one_line(text, start):
    said = [line for line in text.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith(start), text
    return said[0]


def imports_done(p):
    """Whether train.py has finished importing torch (its settings are being read)."""
    maps = Path(f'/proc/{p.pid}/maps')
    try:
        return 'libtorch_cpu' in maps.read_text()
    except OSError:
        return False


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_train_py_signalled_while_its_libraries_load_says_one_line(signum, tmp_path):
    """The signal arrives once the start-up handler is in place and before torch has loaded:
    one line saying nothing was written, exit 128 + signum, no out_dir made. Without the handler
    (installed before the heavy imports) SIGTERM killed it silently and Ctrl-C was a traceback."""
    out = tmp_path / 'run'
    p = subprocess.Popen([sys.executable, 'train.py', '--device=cpu', f'--out_dir={out}'], cwd=REPO, env=ENV,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # SIGTERM's handler is the start-up one (Python's own start-up already catches SIGINT)
    stdout, stderr = signal_when(p, lambda: catches(p.pid, signal.SIGTERM) and not imports_done(p), signum)
    assert p.returncode == 128 + signum, (stdout, stderr)
    what = 'interrupted' if signum == signal.SIGINT else 'terminated (SIGTERM)'
    assert one_line(stdout, what).endswith('while starting: nothing was written; run the same command again')
    assert stderr.strip() == '' and not out.exists()


def fake_checkout(tmp_path, probe_py=None):
    """A checkout for the sweep (sweep.ROOT): the generated configs, data files, and the mini
    family's preln L = 8 run finished at its planned length (so a sweep skips its training)."""
    from study import families
    root = tmp_path / 'root'
    families.write_configs(root=root)
    (root / 'data' / 'fineweb_edu_byte').mkdir(parents=True)
    (root / 'data' / 'fineweb_edu_byte' / 'train.bin').write_bytes(b'')
    (root / 'train.py').write_text("raise SystemExit('not run here')\n")
    sys.path.insert(0, str(REPO / 'tests'))
    from test_sweep import _write_summary
    _write_summary(root, 'out/mini/preln_L8', 1.5)
    if probe_py:
        (root / 'probe.py').write_text(probe_py)
    return root


def sweep_process(root, args, before=''):
    """study/sweep.py's main in a process of its own, with its signal handlers as the script
    installs them, over the checkout `root`; `before`: Python run first (a patch)."""
    code = (f"import signal, sys\nsys.path.insert(0, {str(REPO)!r})\nfrom study import sweep\n{before}\n"
            f"sweep.ROOT = {str(root)!r}\nsignal.signal(signal.SIGINT, sweep.on_signal)\n"
            f"signal.signal(signal.SIGTERM, sweep.on_signal)\nsys.exit(sweep.main({args!r}))\n")
    return subprocess.Popen([sys.executable, '-c', code], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# a probe.py that says it has started, then works (sleeps) until it is ended
SLOW_PROBE = """import os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, 'probing.pid.tmp'), 'w') as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(here, 'probing.pid.tmp'), os.path.join(here, 'probing.pid'))  # whole when it appears
time.sleep(120)
"""


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_the_sweep_signalled_while_it_probes_ends_the_probe_and_says_one_line(signum, tmp_path):
    """The mini sweep has nothing to train and runs probe.py on its L = 8 run; the signal then
    ends that probe.py (sent on as SIGTERM) and the sweep says in one line that it stopped while
    probing. Before, only the training phase was guarded: a traceback here."""
    root = fake_checkout(tmp_path, SLOW_PROBE)
    p = sweep_process(root, ['family=mini', 'schemes=preln', 'shapes=8'])
    stdout, stderr = signal_when(p, lambda: (root / 'probing.pid').exists(), signum)
    assert p.returncode == 128 + signum and 'Traceback' not in stderr, stderr
    what = 'interrupted' if signum == signal.SIGINT else 'terminated (SIGTERM)'
    assert 'while probing' in one_line(stderr, what)
    pid = int((root / 'probing.pid').read_text())
    assert not Path(f'/proc/{pid}').exists()  # the probe ended with the sweep, not left running


# the n-th write of a JSON file by the sweep first sends the sweep a SIGTERM, then writes
SIGNAL_WHILE_WRITING = """
import os, signal, checkpoint
_write = checkpoint.write_json
def _signalled_write(path, obj):
    os.kill(os.getpid(), signal.SIGTERM)
    return _write(path, obj)
checkpoint.write_json = _signalled_write
"""


def test_the_sweep_signalled_while_it_writes_its_results_writes_them_whole(tmp_path):
    """SIGTERM while the mini study's study.json is being written: the writing ends (the file is
    whole JSON), then the sweep stops with one line and 143. Before, the signal raised mid-write."""
    root = fake_checkout(tmp_path)
    p = sweep_process(root, ['family=mini', 'schemes=preln', 'shapes=8', 'probe=False'], SIGNAL_WHILE_WRITING)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 143 and 'Traceback' not in stderr, stderr
    assert 'while collecting: the results were written whole first' in one_line(
        '\n'.join(line for line in stderr.splitlines() if not line.startswith('warning:')), 'terminated (SIGTERM)')
    study = json.loads((root / 'out' / 'mini' / 'study.json').read_text())
    assert isinstance(study, dict) and not list((root / 'out' / 'mini').glob('*.tmp'))


def test_the_sweep_signalled_while_its_libraries_load_says_one_line(tmp_path):
    """`python study/sweep.py` gets SIGTERM before its imports are done: one line, 143."""
    p = subprocess.Popen([sys.executable, 'study/sweep.py', 'family=mini', 'run=print'], cwd=REPO, env=ENV, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = signal_when(p, lambda: catches(p.pid, signal.SIGTERM) and not imports_done(p), signal.SIGTERM)
    assert p.returncode == 143 and 'Traceback' not in stderr, (stdout, stderr)
    one_line(stdout + stderr, 'terminated (SIGTERM) while starting')
