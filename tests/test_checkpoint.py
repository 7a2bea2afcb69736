"""The run directory (checkpoint.py) under the faults it guards against, each staged for real:
a flipped byte or a cut-off file in a checkpoint (load_checkpoint, probe.py, sample.py), a
best state damaged mid-run, SIGTERM to train.py and to study/sweep.py, temp files a killed
run left (a reused pid, other file names), a resume that changes the fast paths, and the
file-size limit (ulimit -f).
Run: python -m pytest tests/test_checkpoint.py -q"""

import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import checkpoint
from model import GPT, GPTConfig
from test_train import TINY, data_dir, metrics, one_line_error, train  # noqa: F401 (fixture)
from test_train_faults import train_injected

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS='1')


def tiny_checkpoint(path, iter_num=3):
    """A whole train.py-style checkpoint of a tiny Pre-LN model, written by save_checkpoint."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=257)
    torch.manual_seed(0)
    model = GPT(cfg)
    from dataclasses import asdict
    checkpoint.save_checkpoint(str(path), {'model': model.state_dict(), 'model_args': asdict(cfg),
                                           'config': {'tokenizer': 'byte'}, 'tokenizer': 'byte',
                                           'iter_num': iter_num})
    return path


def flip(path, pos):
    data = bytearray(Path(path).read_bytes())
    data[pos] ^= 0x01
    Path(path).write_bytes(bytes(data))


def lines(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]

# -----------------------------------------------------------------------------
# the seal: a sha256 written with the file, checked when it is read


def test_the_seal_is_the_sha256_of_the_bytes_before_it_in_the_zip_comment(tmp_path):
    """Checked with zipfile and hashlib, not with checkpoint.py's reader: the archive comment is
    'sha256:' + the hash of every byte before it, the file is a valid zip, torch.load reads it."""
    path = tiny_checkpoint(tmp_path / 'ckpt.pt')
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        comment = z.comment
    assert comment[:7] == b'sha256:' and data.endswith(comment) and len(comment) == 71
    assert comment[7:].decode() == hashlib.sha256(data[:-71]).hexdigest()
    assert torch.load(path, weights_only=True)['iter_num'] == 3
    assert checkpoint.verify(path) is True and not list(tmp_path.glob('*.tmp'))


@pytest.mark.parametrize('where', ['tensor', 'first', 'zip_end', 'seal_text', 'last'])
def test_one_flipped_byte_anywhere_is_refused_in_one_line(tmp_path, where):
    path = tiny_checkpoint(tmp_path / 'ckpt.pt')
    size = path.stat().st_size
    pos = {'tensor': size // 2, 'first': 0, 'zip_end': size - 71 - 10, 'seal_text': size - 70, 'last': size - 1}[where]
    flip(path, pos)
    with pytest.raises(checkpoint.CheckpointError, match=r'ckpt\.pt does not match the sha256') as e:
        checkpoint.load_checkpoint(path)
    assert '\n' not in str(e.value)


def test_a_cut_off_checkpoint_is_refused_and_the_good_one_beside_it_is_named(tmp_path):
    run = tmp_path / 'run'
    tiny_checkpoint(run / 'ckpt.pt')
    tiny_checkpoint(run / 'ckpt_best.pt', iter_num=1)
    data = (run / 'ckpt.pt').read_bytes()
    (run / 'ckpt.pt').write_bytes(data[:len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match='truncated') as e:
        checkpoint.load_checkpoint(run / 'ckpt.pt')
    assert f"use {run / 'ckpt_best.pt'} instead" in str(e.value)
    flip(run / 'ckpt_best.pt', 1000)  # both damaged: nothing beside it to name
    with pytest.raises(checkpoint.CheckpointError, match='restore a good copy') as e:
        checkpoint.load_checkpoint(run / 'ckpt_best.pt')
    assert 'instead' not in str(e.value)


class Planted:
    """Unpickling it would run a shell command that creates the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_holding_code_is_refused_as_such_and_nothing_runs(tmp_path):
    marker = tmp_path / 'ran'
    path = tmp_path / 'ckpt.pt'
    checkpoint.save_checkpoint(str(path), {'model': Planted(marker), 'model_args': {}})  # sealed: it verifies
    with pytest.raises(checkpoint.CheckpointError, match=r'holds code or unknown classes \(posix.system\)') as e:
        checkpoint.load_checkpoint(path)
    assert 'truncated' not in str(e.value) and not marker.exists()
    (tmp_path / 'junk.pt').write_bytes(b'not a checkpoint')  # garbage is not called code
    with pytest.raises(checkpoint.CheckpointError, match='cannot be read'):
        checkpoint.load_checkpoint(tmp_path / 'junk.pt')


@pytest.mark.parametrize('tool', ['probe', 'sample', 'convert'])
def test_probe_sample_and_convert_refuse_a_flipped_byte_with_one_line(tool, tmp_path):
    run = tmp_path / 'run'
    tiny_checkpoint(run / 'ckpt.pt')
    tiny_checkpoint(run / 'ckpt_best.pt', iter_num=1)
    flip(run / 'ckpt.pt', (run / 'ckpt.pt').stat().st_size // 2)
    args = {'probe': ['probe.py', f'--ckpt={run / "ckpt.pt"}', '--metrics=angular', '--device=cpu',
                      '--n_windows=2', '--seq_len=16', f'--out_dir={tmp_path / "p"}'],
            'sample': ['sample.py', f'--init_from={run / "ckpt.pt"}', '--device=cpu', '--max_new_tokens=2'],
            'convert': ['tools/convert.py', '--to=hf', str(run / 'ckpt.pt'), f'--out={tmp_path / "p"}']}[tool]
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=ENV, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, r.stderr[-2000:]
    assert 'does not match the sha256' in err[0] and f"use {run / 'ckpt_best.pt'} instead" in err[0], err
    assert not (tmp_path / 'p').exists()

def test_a_resume_from_a_flipped_checkpoint_is_refused_naming_the_good_best_state(data_dir, tmp_path):
    """--learning_rate=10 diverges: ckpt_best.pt is iteration 0's own file, ckpt.pt iteration 2's.
    One byte of ckpt.pt flipped: the resume refuses in one line naming ckpt_best.pt."""
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=4', '--eval_interval=2',
            '--learning_rate=10', '--grad_clip=1']
    train(*args, '--stop_iter=2')
    assert checkpoint.load_checkpoint(out / 'ckpt_best.pt')['iter_num'] == 0
    flip(out / 'ckpt.pt', (out / 'ckpt.pt').stat().st_size // 2)
    one_line_error(train(*args, '--init_from=resume', check=False), f'{out}/ckpt.pt does not match the sha256',
                   f"use {out}/ckpt_best.pt instead")

# -----------------------------------------------------------------------------
# a best state damaged mid-run

# after the n-th torch.save (1-based) has returned: damage out_dir/ckpt_best.pt ({how})
DAMAGE_BEST_AFTER = """
import os, torch
_save, _calls = torch.save, [0]
def _save_then_damage(obj, f, *a, **k):
    _save(obj, f, *a, **k)
    _calls[0] += 1
    if _calls[0] == {n}:
        best = os.path.join({out!r}, 'ckpt_best.pt')
        data = bytearray(open(best, 'rb').read())
        if {how!r} == 'truncate':
            data = data[:len(data) // 2]
        else:
            data[len(data) // 3] ^= 0x01
        open(best, 'wb').write(bytes(data))
torch.save = _save_then_damage
"""


@pytest.mark.parametrize('how', ['truncate', 'flip'])
def test_a_best_state_damaged_mid_run_is_said_and_never_named_the_best(how, data_dir, tmp_path):
    """--learning_rate=10 diverges at once, so the best state stays iteration 0's ckpt_best.pt,
    which is damaged once iteration 2's checkpoint is written and never read again by the
    loop: the end of the run says so in one line, and summary.json names no best checkpoint."""
    out = tmp_path / 'run'
    r = train_injected(DAMAGE_BEST_AFTER.format(n=2, out=str(out), how=how), *TINY, f'--data_dir={data_dir}',
                       f'--out_dir={out}', '--max_iters=4', '--eval_interval=2', '--learning_rate=10', '--grad_clip=1')
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [(m['iter'], m['val_loss']) for m in metrics(out) if 'val_loss' in m]
    assert min(rows, key=lambda t: t[1])[0] == 0  # the best state is the start's
    said = lines(r.stdout, 'warning: the best state')
    assert len(said) == 1 and 'ckpt_best.pt' in said[0] and 'lost' in said[0], r.stdout
    assert ('truncated' if how == 'truncate' else 'does not match the sha256') in said[0]
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['best_ckpt'] is None and summary['best_iter'] == 0
    [done] = lines(r.stdout, 'done:')
    assert 'the best state is in' not in done and 'lost' in done

# -----------------------------------------------------------------------------
# SIGTERM


def wait_for(cond, p, seconds=180):
    deadline = time.time() + seconds
    while not cond() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    assert cond(), f"gave up waiting (rc {p.poll()})"


def test_sigterm_says_where_a_resume_starts_and_keeps_the_checkpoint(data_dir, tmp_path):
    """A real train.py process gets SIGTERM after its checkpoint at iteration 4 and some further
    iterations: exit 143, one line naming the iteration a resume starts from, and that is the
    iteration of ckpt.pt (verified) as the process leaves it, never older than one seen before."""
    out = tmp_path / 'run'
    p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                          '--max_iters=100000', '--eval_interval=4'], cwd=REPO, env=ENV, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        trained = lambda: (out / 'metrics.jsonl').exists() and \
            any(m.get('iter', 0) >= 6 and 'train_loss' in m for m in metrics(out))
        wait_for(trained, p)
        seen = checkpoint.load_checkpoint(out / 'ckpt.pt')['iter_num']
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM and 'Traceback' not in stderr, stderr[-2000:]
    [said] = lines(stdout, 'terminated')
    at = int(re.match(r'terminated \(SIGTERM\) at iteration (\d+);', said).group(1))
    # the run may write the next checkpoint between the read above and the signal: the file the
    # process leaves is the one a resume reads, and the line must name its iteration
    resume_from = checkpoint.load_checkpoint(out / 'ckpt.pt')['iter_num']
    assert f'starts from iteration {resume_from}' in said and '--init_from=resume' in said, said
    assert 4 <= seen <= resume_from <= at and resume_from % 4 == 0, (seen, resume_from, at)
    assert not list(out.glob('*.tmp'))


def sigterm_when(p, ready):
    """Sends SIGTERM to process p once ready() holds; returns its (stdout, stderr)."""
    try:
        wait_for(ready, p)
        p.send_signal(signal.SIGTERM)
        return p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_sigterm_to_the_sweep_stops_its_train_py_and_says_where_it_resumes(data_dir, tmp_path):
    """study/sweep.py (its ROOT a fake checkout whose train.py runs the real one) gets SIGTERM
    while a run trains: the run gets it too (its own line), the sweep says in one line which run
    the same command resumes from which iteration, and exits 143."""
    families = __import__('study.families', fromlist=['write_configs'])
    root = tmp_path / 'root'
    families.write_configs(root=root)
    (root / 'data' / 'fineweb_edu_byte').mkdir(parents=True)
    (root / 'data' / 'fineweb_edu_byte' / 'train.bin').write_bytes(b'')
    (root / 'train.py').write_text(f"import runpy, sys\nsys.path.insert(0, {str(REPO)!r})\n"
                                   f"runpy.run_path({str(REPO / 'train.py')!r}, run_name='__main__')\n")
    extra = ','.join([*TINY, f'--data_dir={data_dir}', '--max_iters=100000', '--eval_interval=4', '--residual=preln'])
    code = (f"import signal, sys\nsys.path.insert(0, {str(REPO)!r})\nfrom study import sweep\n"
            f"sweep.ROOT = {str(root)!r}\nsignal.signal(signal.SIGTERM, sweep.on_sigterm)\n"
            f"sys.exit(sweep.main(['family=mini', 'schemes=preln', 'shapes=2', 'probe=False', {'extra=' + extra!r}]))\n")
    p = subprocess.Popen([sys.executable, '-c', code], cwd=REPO, env=ENV, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = root / 'out' / 'mini' / 'preln_L2'
    stdout, stderr = sigterm_when(p, lambda: (out / 'ckpt.pt').exists() and (out / 'metrics.jsonl').exists() and
                                  any(m.get('iter', 0) >= 6 for m in metrics(out)))
    assert p.returncode == 128 + signal.SIGTERM and 'Traceback' not in stderr, stderr[-2000:]
    it = checkpoint.load_checkpoint(out / 'ckpt.pt')['iter_num']
    assert len(lines(stdout, 'terminated (SIGTERM) at iteration')) == 1, stdout[-2000:]  # train.py's line
    [said] = lines(stderr, 'terminated (SIGTERM)')
    assert f'resumes preln_L2 from iteration {it}' in said, stderr

# -----------------------------------------------------------------------------
# temp files a killed run left


def test_every_partial_file_of_the_run_is_removed_whatever_its_pid_now_names(data_dir, tmp_path):
    """With the run's lock held, no other live process writes out_dir: a temp file named after a
    pid that now runs (a reused pid: here this test's own process) is stale as well, and so are
    those of every file the run writes, not only ckpt.pt's. Files that are not the run's stay."""
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=2', '--eval_interval=1']
    train(*args, '--stop_iter=1')
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True,
                          text=True).stdout.strip()
    stale = [f'ckpt.pt.{os.getpid()}.tmp', f'ckpt_best.pt.{dead}.tmp', f'summary.json.{dead}.tmp',
             f'metrics.jsonl.{dead}.tmp', f'ckpt_nonfinite.pt.{os.getpid()}.tmp']
    other = ['notes.txt.123.tmp', f'ckpt.pt.{dead}.tmp.keep', 'ckpt.pt.x.tmp']
    for name in stale + other:
        (out / name).write_bytes(b'partial')
    r = train(*args, '--init_from=resume')
    [said] = lines(r.stdout, 'removed ')
    assert said.startswith('removed 5 partial files') and all(n in said for n in stale), said
    assert not lines(r.stdout, 'note: kept')
    assert sorted(p.name for p in out.iterdir() if p.name in stale + other) == sorted(other)


def test_without_a_lock_a_temp_file_of_a_running_process_is_kept(tmp_path):
    (tmp_path / f'ckpt.pt.{os.getppid()}.tmp').write_bytes(b'x')  # pytest's parent runs
    (tmp_path / 'ckpt.pt.999999999.tmp').write_bytes(b'y')  # no such pid
    said = []
    checkpoint.remove_stale_temp(str(tmp_path), locked=False, say=said.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f'ckpt.pt.{os.getppid()}.tmp']
    assert len(said) == 2 and 'ckpt.pt.999999999.tmp' in said[0] and f'pid {os.getppid()} is running' in said[1]

# -----------------------------------------------------------------------------
# a resume that changes the fast paths; the file-size limit


def test_a_resume_with_other_fast_paths_says_so_in_one_note(data_dir, tmp_path):
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--residual=attnres', '--max_iters=3',
            '--eval_interval=1']
    train(*args, '--fast=True', '--stop_iter=1')  # attnres_read_torch runs on the CPU
    r = train(*args, '--init_from=resume', '--fast=True', '--stop_iter=2')
    assert not lines(r.stdout, 'note: the fast paths')  # the same paths: no note
    r = train(*args, '--init_from=resume', '--fast=False')
    [said] = lines(r.stdout, 'note: the fast paths')
    assert "(none) differ from the checkpoint's run's (attnres_read_torch)" in said
    assert 'bit-identically' in said


def test_the_file_size_limit_is_named_not_the_free_space(data_dir, tmp_path):
    """ulimit -f of 64 KiB (the tiny model's checkpoint is ~0.5 MB): the first checkpoint write
    fails; the line names the limit, not a full disk."""
    out = tmp_path / 'run'
    limit = 64 * 1024

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                        '--max_iters=2', '--eval_interval=1'], cwd=REPO, capture_output=True, text=True, env=ENV,
                       timeout=300, preexec_fn=small_files)
    one_line_error(r, f'cannot write {out}/ckpt_best.pt', 'file-size limit (ulimit -f: 0.1 MB', 'ulimit -f unlimited')
    assert 'disk is full' not in r.stderr and not list(out.glob('*.tmp'))
