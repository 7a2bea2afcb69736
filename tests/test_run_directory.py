"""
The run directory (checkpoint.py and train.py's out_dir) under the faults it guards against,
each staged for real: the checkpoint seal (a flipped byte or a cut-off file refused in one
line by train.py's resume, probe.py, sample.py and convert.py), the best state (never a NaN,
diverged or damaged one), writes cut short (kill -9 mid-checkpoint, a full disk, the file-size
limit) and the temp files they leave, one run per out_dir (the lock, two train.py racing),
resume (summary.json, RNG state, settings, fast paths), Ctrl-C and SIGTERM (to train.py and to
study/sweep.py), and untrusted files: no code runs from a file a user loads (train.py, probe.py,
sample.py and tools/convert.py in every direction are given files that run a command when
unpickled; each must run nothing and say so in one line naming the global).

Faults are injected by running train.py through runpy in a process whose library functions
(torch.save, clip_grad_norm_, ...) the test has patched first (train.py has no test hooks).
Run: python -m pytest tests/test_run_directory.py -q"""

import builtins
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import resource
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import checkpoint
from model import GPT, GPTConfig
from test_train import (TINY, data_dir, lines, load, metrics, one_line_error, train,  # noqa: F401 (fixture)
                        train_injected, val_rows)
from tools import convert
from tools.untrusted import RefusedGlobal, pickle_globals

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS='1')


# -----------------------------------------------------------------------------
# the checkpoint seal: written, verified, refused in one line


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
# the best state: never a NaN, diverged or damaged one


def test_a_run_that_only_gets_worse_keeps_its_start_in_ckpt_best(data_dir, tmp_path):
    """--learning_rate=10 diverges at once: the best state is iteration 0's. ckpt_best.pt holds
    it (evaluated again from that file: the same loss), and every line that names it says
    iteration 0."""
    out = tmp_path / 'run'
    r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=4', '--eval_interval=2',
              '--learning_rate=10', '--grad_clip=1')
    vals = [(m['iter'], m['val_loss']) for m in metrics(out) if 'val_loss' in m]
    assert vals[0][0] == 0 and min(v for _, v in vals) == vals[0][1] < vals[-1][1]  # worse than the start
    best = load(out / 'ckpt_best.pt')
    assert best['iter_num'] == 0 and best['val_loss'] == vals[0][1] and best['best_iter'] == 0
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['best_iter'] == 0 and summary['best_ckpt'].endswith('ckpt_best.pt')
    said = [line for line in r.stdout.splitlines() if 'ckpt_best.pt' in line]
    assert len(said) >= 2 and all('(iteration 0,' in line for line in said), said
    assert lines(r.stdout, 'done:') and 'ckpt_best.pt' in lines(r.stdout, 'done:')[0]
    again = tmp_path / 'again'  # the kept file is the start: evaluated on its own, the same loss
    again.mkdir()
    (again / 'ckpt.pt').write_bytes((out / 'ckpt_best.pt').read_bytes())
    r = train(f'--out_dir={again}', '--init_from=resume', '--eval_only=True')
    assert f"val loss {vals[0][1]:.4f}" in r.stdout


# the validation loss of the n-th evaluation onwards (1-based) replaced: x + {add}, or NaN
EVAL_LOSS_FROM = """
import torch, model
_lhl, _evals, _last = model.lm_head_loss, [0], [None]
def _eval_loss(*a, **k):
    logits, loss = _lhl(*a, **k)
    if torch.is_grad_enabled():
        _last[0] = None
        return logits, loss
    if _last[0] is None:  # the first batch of an evaluation
        _evals[0] += 1
        _last[0] = 1
    if _evals[0] >= {n}:
        return logits, (loss * float('nan') if {add!r} == 'nan' else loss + {add})
    return logits, loss
model.lm_head_loss = _eval_loss
"""


def test_nan_validation_loss_never_replaces_the_good_checkpoint(data_dir, tmp_path):
    out = tmp_path / 'run'
    r = train_injected(EVAL_LOSS_FROM.format(n=3, add='nan'), *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                       '--max_iters=8', '--eval_interval=2')  # evaluations at 0, 2, 4: the third is NaN
    one_line_error(r, 'non-finite validation loss nan', 'at iteration 4', f'last good {out}/ckpt.pt')
    assert load(out / 'ckpt.pt')['iter_num'] == 2


def test_divergence_warns_and_keeps_the_best_checkpoint(data_dir, tmp_path):
    """From the 4th evaluation (iteration 6) on the validation loss jumps by 50 nats: one
    warning line per evaluation, ckpt_best.pt keeps the lowest-loss state, ckpt.pt the latest."""
    out = tmp_path / 'run'
    r = train_injected(EVAL_LOSS_FROM.format(n=4, add=50.0), *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                       '--max_iters=8', '--eval_interval=2', '--learning_rate=3e-3')
    assert r.returncode == 0, r.stderr[-2000:]
    vals = dict(val_rows(out))
    assert vals[6] > 40 and vals[8] > 40 and vals[4] < vals[2] < vals[0]
    warnings = [line for line in r.stdout.splitlines() if line.startswith('warning: val loss')]
    assert len(warnings) == 2 and 'ckpt_best.pt' in warnings[0]
    best, last = load(out / 'ckpt_best.pt'), load(out / 'ckpt.pt')
    assert best['iter_num'] == 4 and best['val_loss'] == vals[4] and last['iter_num'] == 8
    assert not torch.equal(best['model']['lm_head.weight'], last['model']['lm_head.weight'])
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['best_val_loss'] == vals[4] and summary['best_ckpt'].endswith('ckpt_best.pt')
    assert 'the best state is in ckpt_best.pt' in r.stdout


# after the n-th torch.save (1-based) has returned: damage out_dir/ckpt_best.pt ({how})
DAMAGE_BEST_AFTER = """
import os, torch
_save, _calls = torch.save, [0]
def _save_then_damage(obj, f, *a, **k):
    _save(obj, f, *a, **k)
    _calls[0] += 1
    if _calls[0] == {n}:
        best = os.path.join({out!r}, 'ckpt_best.pt')  # iteration 0's own file (no ckpt.pt then)
        if {how!r} == 'sealed':  # whole and sealed, but its pickle holds what the allow-list refuses
            import checkpoint, datetime
            _save({{'model': {{'w': datetime.date(2020, 1, 1)}}, 'model_args': {{}}}}, best)
            checkpoint.seal(best)
            return
        data = bytearray(open(best, 'rb').read())
        if {how!r} == 'truncate':
            data = data[:len(data) // 2]
        else:
            data[len(data) // 3] ^= 0x01
        open(best, 'wb').write(bytes(data))
torch.save = _save_then_damage
"""


@pytest.mark.parametrize('how', ['truncate', 'flip', 'sealed'])
def test_a_best_state_damaged_mid_run_is_said_and_never_named_the_best(how, data_dir, tmp_path):
    """--learning_rate=10 diverges at once, so the best state stays iteration 0's ckpt_best.pt,
    which is damaged once iteration 2's checkpoint is written (cut, a flipped byte, or whole and
    sealed but unpicklable): one warning line, once, naming ckpt.pt with its iteration and
    validation loss as what is usable; summary.json and the done line name no best checkpoint."""
    out = tmp_path / 'run'
    r = train_injected(DAMAGE_BEST_AFTER.format(n=2, out=str(out), how=how), *TINY, f'--data_dir={data_dir}',
                       f'--out_dir={out}', '--max_iters=4', '--eval_interval=2', '--learning_rate=10', '--grad_clip=1')
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [(m['iter'], m['val_loss']) for m in metrics(out) if 'val_loss' in m]
    assert min(rows, key=lambda t: t[1])[0] == 0  # the best state is the start's
    said = lines(r.stdout, 'warning: the best state')
    assert len(said) == 1 and 'ckpt_best.pt' in said[0] and 'lost' in said[0], r.stdout
    assert {'truncate': 'truncated', 'flip': 'does not match the sha256',
            'sealed': 'holds code or unknown classes (datetime.date)'}[how] in said[0]
    # said at the first divergence warning after the damage, when ckpt.pt is iteration 2's
    assert f"what is usable is {out}/ckpt.pt (iteration 2, val loss {dict(rows)[2]:.4f}), a later state, not the " \
        "best" in said[0], said[0]
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['best_ckpt'] is None and summary['best_iter'] == 0
    [done] = lines(r.stdout, 'done:')
    assert 'the best state is in' not in done and 'lost' in done


# -----------------------------------------------------------------------------
# writes cut short (kill -9, a full disk, the file-size limit) and the temp files they leave


# kill -9 while the checkpoint of iteration {it} is half written
KILL_MID_SAVE = """
import os, signal, torch
_save = torch.save
def _killing_save(obj, f, *a, **k):
    if isinstance(f, str) and os.path.basename(f).startswith('ckpt.pt.') and obj.get('iter_num') == {it}:
        with open(f, 'wb') as g:
            g.write(b'PK' + bytes(5000))
            g.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(obj, f, *a, **k)
torch.save = _killing_save
"""


def test_kill_9_mid_checkpoint_leaves_a_temp_file_the_next_run_removes(data_dir, tmp_path):
    """The killed writer's ckpt.pt.<pid>.tmp is removed by the resume, with one line; ckpt.pt of
    iteration 2 was never touched. A temp file whose pid now names a live process (a reused pid:
    here the test's own) is removed as well: the resume holds the run's lock, so no live
    process of the run writes there."""
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=6', '--eval_interval=2']
    r = train_injected(KILL_MID_SAVE.format(it=4), *args)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    [dead] = list(out.glob('ckpt.pt.*.tmp'))
    assert dead.stat().st_size == 5002 and load(out / 'ckpt.pt')['iter_num'] == 2
    reused = out / f'ckpt.pt.{os.getpid()}.tmp'
    reused.write_bytes(b'partial')
    r = train(*args, '--init_from=resume')
    said = lines(r.stdout, 'removed ')
    assert len(said) == 1 and dead.name in said[0] and reused.name in said[0] and 'killed' in said[0], r.stdout
    assert not lines(r.stdout, 'note: kept')
    assert not list(out.glob('*.tmp'))
    assert load(out / 'ckpt.pt')['iter_num'] == 6 and json.loads((out / 'summary.json').read_text())['finished']


# a signal to this process during the n-th optimizer step (1-based: iteration n - 1)
SIGNAL_AT_STEP = """
import os, signal, torch
_clip, _calls = torch.nn.utils.clip_grad_norm_, [0]
def _clip_then_signal(*a, **k):
    _calls[0] += 1
    if _calls[0] == {n}:
        os.kill(os.getpid(), signal.{sig})
    return _clip(*a, **k)
torch.nn.utils.clip_grad_norm_ = _clip_then_signal
"""


def test_scratch_rerun_after_a_kill_before_the_first_checkpoint_keeps_one_history(data_dir, tmp_path):
    """kill -9 at iteration 3, before any ckpt.pt: the same command again starts anew; the dead
    run's rows go to metrics_old1.jsonl (one line says so) and metrics.jsonl holds one row per
    iteration, the new run's. Killed again (at iteration 2), the third start puts the second
    dead run's rows in metrics_old2.jsonl and leaves metrics_old1.jsonl as it was."""
    args = [*TINY, f'--data_dir={data_dir}', '--max_iters=6', '--eval_interval=100']
    out = tmp_path / 'run'

    def old(k):
        return [json.loads(x)['iter'] for x in (out / f'metrics_old{k}.jsonl').read_text().splitlines()]

    r = train_injected(SIGNAL_AT_STEP.format(n=4, sig='SIGKILL'), *args, f'--out_dir={out}')
    assert r.returncode == -signal.SIGKILL and not (out / 'ckpt.pt').exists()
    dead = [m['iter'] for m in metrics(out)]
    assert dead == [0, 1, 2, 3]  # the evaluation at 0, then iterations 1..3
    r = train_injected(SIGNAL_AT_STEP.format(n=3, sig='SIGKILL'), *args, f'--out_dir={out}')
    assert r.returncode == -signal.SIGKILL and not (out / 'ckpt.pt').exists()
    said = lines(r.stdout, 'note: ')
    assert len(said) == 1 and 'metrics_old1.jsonl' in said[0] and 'no checkpoint' in said[0], r.stdout
    assert old(1) == dead and [m['iter'] for m in metrics(out)] == [0, 1, 2]
    r = train(*args, f'--out_dir={out}')
    said = lines(r.stdout, 'note: ')
    assert len(said) == 1 and 'metrics_old2.jsonl' in said[0] and 'no checkpoint' in said[0], r.stdout
    assert [m['iter'] for m in metrics(out)] == [0, 1, 2, 3, 4, 5, 6, 6]  # val 0, train 1..6, val 6
    assert old(1) == dead and old(2) == [0, 1, 2]
    assert sorted(p.name for p in out.glob('metrics*.jsonl')) == ['metrics.jsonl', 'metrics_old1.jsonl',
                                                                   'metrics_old2.jsonl']


# a full disk: the n-th torch.save writes a part of the file, then fails as a full disk does
DISK_FULL_AT = """
import errno, torch
_save, _calls = torch.save, [0]
def _full_save(obj, f, *a, **k):
    _calls[0] += 1
    if _calls[0] == {n}:
        g = open(f, 'wb') if isinstance(f, str) else f
        g.write(b'PK' + bytes(4000))
        g.flush()
        raise OSError(errno.ENOSPC, 'No space left on device')
    return _save(obj, f, *a, **k)
torch.save = _full_save
"""


def test_disk_full_mid_checkpoint_keeps_the_last_one_and_leaves_no_temp_file(data_dir, tmp_path):
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=6', '--eval_interval=2']
    r = train_injected(DISK_FULL_AT.format(n=3), *args)  # saves: best at 0, 2, then 4 fails
    one_line_error(r, f'cannot write {out}/ckpt.pt: the disk is full', 'MB free', 'MB needed',
                   f'{out}/ckpt.pt (the last complete checkpoint) is kept')
    assert 'Traceback' not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ['ckpt.pt', 'ckpt_best.pt', 'metrics.jsonl', 'train.lock']  # no temp
    assert load(out / 'ckpt.pt')['iter_num'] == 2
    train(*args, '--init_from=resume')  # the resume works
    assert json.loads((out / 'summary.json').read_text())['iter'] == 6


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
# one run per out_dir: the lock


def test_a_second_run_on_a_live_out_dir_is_refused(data_dir, tmp_path):
    """While another process holds out_dir/train.lock, train.py (scratch or resume) refuses in
    one line naming it, and writes nothing; once released, the run goes ahead."""
    out = tmp_path / 'run'
    out.mkdir()
    with open(out / 'train.lock', 'w') as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write('4242\n')
        f.flush()
        for mode in ('scratch', 'resume'):
            r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=1', f'--init_from={mode}',
                      check=False)
            one_line_error(r, f'{out} is in use by another train.py (pid 4242')
        assert sorted(p.name for p in out.iterdir()) == ['train.lock']
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=1')
    assert (out / 'ckpt.pt').exists() and (out / 'train.lock').read_text().strip().isdigit()


def racer(args, ready, go):
    """A real train.py process that imports torch, says it is ready, then waits for `go` (so
    that two of them reach the out_dir lock within milliseconds of each other)."""
    code = (f"import os, runpy, sys, time, torch\nsys.argv = ['train.py'] + {list(args)!r}\n"
            f"open({str(ready)!r}, 'w').close()\n"
            f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.002)\n"
            f"runpy.run_path('train.py', run_name='__main__')\n")
    return subprocess.Popen([sys.executable, '-c', code], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS='1'))


def test_two_train_py_racing_for_one_out_dir_one_proceeds_one_is_refused(data_dir, tmp_path):
    """Two train.py released at the same moment on one out_dir: exactly one trains, the other is
    refused in one line naming the winner's pid. A third started while the winner runs is
    refused too (the lock is held for the whole run, not only at the start)."""
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=100000', '--eval_interval=50']
    go = tmp_path / 'go'
    procs = [racer(args, tmp_path / f'ready{i}', go) for i in range(2)]
    deadline = time.time() + 120
    while not all((tmp_path / f'ready{i}').exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    go.touch()
    deadline = time.time() + 60  # the loser stops at the lock, within seconds
    try:
        while all(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.05)
        loser = next(i for i, p in enumerate(procs) if p.poll() is not None)
        winner = procs[1 - loser]
        _, err = procs[loser].communicate(timeout=60)
        assert procs[loser].returncode == 1, err[-2000:]
        lines_ = err.strip().splitlines()
        assert len(lines_) == 1 and f'is in use by another train.py (pid {winner.pid}' in lines_[0], err
        while not (out / 'metrics.jsonl').exists() and winner.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert winner.poll() is None  # still training
        third = train(*args, check=False)
        one_line_error(third, f'is in use by another train.py (pid {winner.pid}')
        assert winner.poll() is None
        winner.send_signal(signal.SIGINT)
        stdout, stderr = winner.communicate(timeout=60)
        assert winner.returncode == 130 and 'Traceback' not in stderr, stderr[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    iters = [m['iter'] for m in metrics(out) if 'train_loss' in m]
    assert iters == list(range(1, len(iters) + 1))  # one writer: one history


# -----------------------------------------------------------------------------
# resume


def test_a_run_killed_before_summary_json_is_completed_by_a_resume(data_dir, tmp_path):
    """Also the nanoGPT way of resuming: no settings but out_dir, the rest from the checkpoint
    (block_size=32 here; the default 1024 would not fit the model)."""
    out = tmp_path / 'run'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=4', '--eval_interval=2')
    done = json.loads((out / 'summary.json').read_text())
    rows = (out / 'metrics.jsonl').read_text()
    (out / 'summary.json').unlink()  # killed after the final checkpoint
    r = train(f'--out_dir={out}', '--init_from=resume')
    again = json.loads((out / 'summary.json').read_text())
    assert {k for k in done if again[k] != done[k]} == {'config'}
    # the same settings, but those of the invocation (which the command line gave differently)
    assert {k for k in done['config'] if again['config'][k] != done['config'][k]} == {'init_from', 'compile'}
    assert (out / 'metrics.jsonl').read_text() == rows
    one_line_error(train(f'--out_dir={out}', '--init_from=resume', check=False), 'the run is finished')
    r = train(f'--out_dir={out}', '--init_from=resume', '--eval_only=True')
    assert f"val loss {done['val_loss']:.4f}" in r.stdout


def test_resume_restores_the_rng_state(data_dir, tmp_path):
    """The resumed process continues the checkpoint's torch RNG stream, not a fresh one from
    the seed: the checkpoint's state is replaced by a marked one (seed 999) before the resume,
    and the next checkpoint carries it on (training draws nothing from torch's RNG)."""
    out = tmp_path / 'run'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=4', '--eval_interval=2', '--stop_iter=1')
    ck = load(out / 'ckpt.pt')
    marked = torch.Generator().manual_seed(999).get_state()
    assert not torch.equal(marked, ck['rng']['torch'])
    ck['rng']['torch'] = marked
    checkpoint.save_checkpoint(str(out / 'ckpt.pt'), ck)
    train(f'--out_dir={out}', '--init_from=resume', '--stop_iter=2')
    assert torch.equal(load(out / 'ckpt.pt')['rng']['torch'], marked)


def test_a_config_file_setting_a_default_is_checked_on_resume(data_dir, tmp_path):
    """residual = 'preln' (the default) in a config file resumed on an AttnRes checkpoint:
    refused, not silently run as the checkpoint's AttnRes (nor as Pre-LN)."""
    out = tmp_path / 'run'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--residual=attnres', '--max_iters=1',
          '--eval_interval=1')
    cfg = tmp_path / 'preln.py'
    cfg.write_text("residual = 'preln'\nn_layer = 12\n")
    one_line_error(train(str(cfg), f'--out_dir={out}', '--init_from=resume', '--max_iters=2', check=False),
                   "differs from the checkpoint's", '--out_dir')
    cfg.write_text("residual = 'attnres'\n")  # agrees: the run goes on
    train(str(cfg), f'--out_dir={out}', '--init_from=resume', '--max_iters=2')
    assert load(out / 'ckpt.pt')['iter_num'] == 2


def test_a_resume_with_other_fast_paths_says_so_in_one_note(data_dir, tmp_path):
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--residual=attnres', '--max_iters=3',
            '--eval_interval=1']
    train(*args, '--fast=True', '--stop_iter=1')  # attnres_group_torch runs on the CPU
    r = train(*args, '--init_from=resume', '--fast=True', '--stop_iter=2')
    assert not lines(r.stdout, 'note: the fast paths')  # the same paths: no note
    r = train(*args, '--init_from=resume', '--fast=False')
    [said] = lines(r.stdout, 'note: the fast paths')
    assert "(none) differ from the checkpoint's run's (attnres_group_torch)" in said
    assert 'bit-identically' in said


# -----------------------------------------------------------------------------
# Ctrl-C and SIGTERM


def test_ctrl_c_prints_one_line_and_keeps_the_checkpoint(data_dir, tmp_path):
    import signal
    import time
    out = tmp_path / 'int'
    env = dict(os.environ, OMP_NUM_THREADS='1')
    p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                          '--max_iters=100000', '--eval_interval=2'], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (out / 'ckpt.pt').exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr[-2000:]
    assert 'Traceback' not in stderr and 'interrupted at iteration' in stdout and '--init_from=resume' in stdout
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] >= 2  # whole, loadable


def interrupt_line(r):
    assert r.returncode == 130 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    said = lines(r.stdout, 'interrupted')
    assert len(said) == 1, r.stdout
    return said[0]


def test_ctrl_c_says_which_iteration_a_resume_starts_from(data_dir, tmp_path):
    """SIGINT during iteration 14 with checkpoints every 10: the line says a resume starts from
    10 (not 14), and the resume does."""
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=30', '--eval_interval=10']
    line = interrupt_line(train_injected(SIGNAL_AT_STEP.format(n=15, sig='SIGINT'), *args))
    assert line.startswith('interrupted at iteration 14;') and 'starts from iteration 10' in line, line
    assert '4 iterations will run again' in line and '--init_from=resume' in line
    assert load(out / 'ckpt.pt')['iter_num'] == 10
    r = train(*args, '--init_from=resume', '--stop_iter=12')
    assert 'at iteration 10' in lines(r.stdout, 'resumed from')[0]


# SIGINT at a set moment: {where} is 'model' (while the model is built), 'eval' (the first
# evaluation's first batch) or 'save' (the checkpoint write of iteration 4: it completes first)
SIGINT_AT = """
import os, signal, torch, torch.nn.functional as F, model
def _sigint():
    os.kill(os.getpid(), signal.SIGINT)
if {where!r} == 'model':
    _init = model.GPT.__init__
    def _init_sigint(self, *a, **k):
        _init(self, *a, **k)
        _sigint()
    model.GPT.__init__ = _init_sigint
elif {where!r} == 'eval':
    _loss = model.lm_head_loss
    def _loss_sigint(*a, **k):
        if not torch.is_grad_enabled():
            _sigint()
        return _loss(*a, **k)
    model.lm_head_loss = _loss_sigint
else:
    _save = torch.save
    def _save_sigint(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get('iter_num') == 4 and '/ckpt.pt.' in str(f):
            _sigint()
        return _save(obj, f, *a, **k)
    torch.save = _save_sigint
"""


def test_ctrl_c_at_any_moment_is_one_line_that_matches_the_files(data_dir, tmp_path):
    """Before training (the model being built): nothing is left behind. During the first
    evaluation: no checkpoint, nothing to resume. During a checkpoint write: the write ends
    first, and the line names the iteration of the checkpoint on disk."""
    args = [*TINY, f'--data_dir={data_dir}', '--max_iters=8', '--eval_interval=2']
    out = tmp_path / 'model'
    line = interrupt_line(train_injected(SIGINT_AT.format(where='model'), *args, f'--out_dir={out}'))
    assert line.startswith('interrupted before training started') and 'no checkpoint' in line, line
    assert not out.exists()  # the out_dir it created (holding only the lock) is gone
    out = tmp_path / 'eval'
    line = interrupt_line(train_injected(SIGINT_AT.format(where='eval'), *args, f'--out_dir={out}'))
    assert line.startswith('interrupted at iteration 0') and 'nothing to resume' in line, line
    assert not (out / 'ckpt.pt').exists()
    out = tmp_path / 'save'
    line = interrupt_line(train_injected(SIGINT_AT.format(where='save'), *args, f'--out_dir={out}'))
    assert line.startswith('interrupted at iteration 4;') and 'starts from iteration 4' in line, line
    assert load(out / 'ckpt.pt')['iter_num'] == 4 and not list(out.glob('*.tmp'))


# SIGTERM in the middle of a printed line: a stdout whose write() gets the signal right after
# it takes the text of 'iter 4: val loss ...' (the moment a line's newline would follow)
SIGTERM_IN_A_LINE = """
import os, signal, sys
class _Out:
    def __init__(self, f):
        self.f = f
    def write(self, s):
        n = self.f.write(s)
        if s.startswith('iter 4: val loss'):
            os.kill(os.getpid(), signal.SIGTERM)
        return n
    def __getattr__(self, name):
        return getattr(self.f, name)
sys.stdout = _Out(sys.stdout)
"""


def test_sigterm_while_a_line_is_printed_is_a_line_of_its_own(data_dir, tmp_path):
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "run"}', '--max_iters=8', '--eval_interval=4']
    r = train_injected(SIGTERM_IN_A_LINE, *args)
    assert r.returncode == 128 + signal.SIGTERM and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert re.search(r'^iter 4: val loss \d+\.\d+$', r.stdout, re.M), r.stdout[-1000:]
    assert len(lines(r.stdout, 'terminated (SIGTERM) at iteration 4')) == 1, r.stdout[-1000:]


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
            f"sweep.ROOT = {str(root)!r}\nsignal.signal(signal.SIGTERM, sweep.on_signal)\n"
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
# untrusted files: no code runs from a file a user loads


class TouchOnUnpickle:
    """Unpickling it would run a shell command that creates the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_holding_code_is_refused_as_such_and_nothing_runs(tmp_path):
    marker = tmp_path / 'ran'
    path = tmp_path / 'ckpt.pt'
    checkpoint.save_checkpoint(str(path), {'model': TouchOnUnpickle(marker), 'model_args': {}})  # sealed: it verifies
    with pytest.raises(checkpoint.CheckpointError, match=r'holds code or unknown classes \(posix.system\)') as e:
        checkpoint.load_checkpoint(path)
    assert 'truncated' not in str(e.value) and not marker.exists()
    (tmp_path / 'junk.pt').write_bytes(b'not a checkpoint')  # garbage is not called code
    with pytest.raises(checkpoint.CheckpointError, match='cannot be read'):
        checkpoint.load_checkpoint(tmp_path / 'junk.pt', unsealed=True)


class Planted:
    """Unpickles as fn(arg): os.system('touch MARKER') or exec("open('MARKER', 'w')")."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def shell(marker):
    return Planted(os.system, f"touch '{marker}'")


def python(marker):
    return Planted(builtins.exec, f"open({str(marker)!r}, 'w').close()")


def torch_save(obj, path):
    """A torch.save (zip) file holding obj inside a checkpoint-like dict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({'model': {'wte.weight': torch.zeros(2, 2)}, 'model_args': obj, 'iter_num': 0}, path)
    return path


def pickle_dump(obj, path):
    """A plain pickle (protocol 4: a file made with pickle.dump, not torch.save)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, 'wb') as f:
        pickle.dump({'model': {}, 'model_args': obj}, f)
    return path


def assert_live(marker, load):
    """The staged file really runs its command when loaded without an allow-list."""
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        load()
    assert marker.exists(), "the staged pickle did not run: the test would prove nothing"
    marker.unlink()


def run(*args, unsealed=True):
    """The tool on `args`; unsealed: with --allow_unsealed=True, so that the planted file (another
    tool's, without a seal) reaches the unpickler's allow-list, the defence under test."""
    args = args + (('--allow_unsealed=True',) if unsealed else ())
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=300)


def assert_refused(r, marker, name):
    """Nothing ran, a non-zero exit, one error line naming the global, no traceback."""
    assert not marker.exists(), "the file's code ran"
    assert r.returncode != 0
    assert 'Traceback' not in r.stdout + r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), r.stderr
    assert 'holds code or unknown classes' in lines[0] and name in lines[0], lines[0]
    assert 'truncated' not in lines[0] and 'corrupt' not in lines[0] and 'weights_only=False' not in lines[0]


def test_train_resume_refuses_a_checkpoint_holding_code(tmp_path):
    marker, out = tmp_path / 'ran', tmp_path / 'run'
    ckpt = torch_save(shell(marker), out / 'ckpt.pt')
    assert_live(marker, lambda: torch.load(ckpt, weights_only=False))
    r = run('train.py', '--device=cpu', f'--out_dir={out}', '--init_from=resume', unsealed=False)
    assert 'has no seal' in r.stderr and r.stderr.count('\n') == 1 and not marker.exists()  # refused before it
    r = run('train.py', '--device=cpu', f'--out_dir={out}', '--init_from=resume')
    assert_refused(r, marker, 'posix.system')


def test_probe_refuses_a_plain_pickle_holding_code(tmp_path):
    marker = tmp_path / 'ran'
    ckpt = pickle_dump(python(marker), tmp_path / 'ckpt.pt')
    assert_live(marker, lambda: pickle.loads(ckpt.read_bytes()))
    r = run('probe.py', '--ckpt', ckpt, '--device=cpu', f'--out_dir={tmp_path / "probe"}')
    assert_refused(r, marker, 'builtins.exec')


def test_sample_refuses_a_checkpoint_holding_code(tmp_path):
    marker = tmp_path / 'ran'
    ckpt = torch_save(python(marker), tmp_path / 'ckpt.pt')
    assert_live(marker, lambda: torch.load(ckpt, weights_only=False))
    r = run('sample.py', f'--init_from={ckpt}', '--device=cpu', '--max_new_tokens=2')
    assert_refused(r, marker, 'exec')


@pytest.mark.parametrize('damage', ['junk', 'random', 'half'])
def test_damaged_checkpoints_are_not_called_code(tmp_path, damage):
    """torch reports bytes that are no pickle as a weights-only refusal too: those stay
    'truncated', not 'holds code'."""
    from probe import load_model
    path = tmp_path / 'ckpt.pt'
    good = torch_save({'n_layer': 1}, tmp_path / 'good.pt').read_bytes()
    path.write_bytes({'junk': b'not a checkpoint', 'random': bytes(range(256)) * 8,
                      'half': good[:len(good) // 2]}[damage])
    with pytest.raises(ValueError) as e:
        load_model(path)
    assert 'truncated' in str(e.value) and 'holds code' not in str(e.value), str(e.value)


def test_convert_to_hf_refuses_a_checkpoint_holding_code(tmp_path):
    marker = tmp_path / 'ran'
    ckpt = pickle_dump(shell(marker), tmp_path / 'ckpt.pt')
    assert_live(marker, lambda: pickle.loads(ckpt.read_bytes()))
    r = run('tools/convert.py', '--to=hf', ckpt, f'--out={tmp_path / "hf"}')
    assert_refused(r, marker, 'posix.system')
    assert not (tmp_path / 'hf').exists()


LLAMA = {'model_type': 'llama', 'architectures': ['LlamaForCausalLM'], 'hidden_size': 8, 'num_attention_heads': 2,
         'num_hidden_layers': 1, 'intermediate_size': 16, 'vocab_size': 10}


def test_convert_from_hf_refuses_a_bin_holding_code(tmp_path):
    marker, d = tmp_path / 'ran', tmp_path / 'llama'
    d.mkdir()
    (d / 'config.json').write_text(json.dumps(LLAMA))
    torch.save({'model.embed_tokens.weight': torch.zeros(10, 8), 'lm_head.weight': shell(marker)},
               d / 'pytorch_model.bin')
    assert_live(marker, lambda: torch.load(d / 'pytorch_model.bin', weights_only=False))
    r = run('tools/convert.py', '--from=hf', d, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert_refused(r, marker, 'posix.system')
    assert not (tmp_path / 'out').exists()


def test_convert_from_hf_damaged_bin_is_one_line(tmp_path):
    """A truncated pytorch_model.bin: one line naming the file, no advice to load unsafely."""
    d = tmp_path / 'llama'
    d.mkdir()
    (d / 'config.json').write_text(json.dumps(LLAMA))
    buf = io.BytesIO()
    torch.save({'model.embed_tokens.weight': torch.randn(10, 8)}, buf)
    (d / 'pytorch_model.bin').write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    r = run('tools/convert.py', '--from=hf', d, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert r.returncode != 0 and 'Traceback' not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: ') and 'pytorch_model.bin' in lines[0], r.stderr
    assert 'truncated' in lines[0] and 'weights_only' not in lines[0]


def write_study_dir(tmp_path):
    """A study step dir: config.json + model_and_optim/ written by torch.distributed.checkpoint,
    with tensors of several dtypes, an AdamW state and non-tensor entries (as OLMo-core's)."""
    import torch.distributed.checkpoint as dcp
    step = tmp_path / 'run' / 'step10'
    step.mkdir(parents=True)
    (step / 'config.json').write_text('{}')
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    model = {'embeddings.weight': torch.randn(5, 4), 'lm_head.w_out.weight': torch.randn(5, 4).bfloat16(),
             'counts': torch.arange(3), 'half': torch.ones(2, dtype=torch.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        dcp.save({'model': model, 'optim': opt.state_dict(), 'extra': {'note': 'x', 'n': 3}},
                 storage_writer=dcp.FileSystemWriter(str(step / 'model_and_optim')), no_dist=True)
    return step, model


def read_own_metadata(step):
    with open(step / 'model_and_optim' / '.metadata', 'rb') as f:
        return pickle.load(f)  # written by this test: trusted


def write_metadata(step, md):
    with open(step / 'model_and_optim' / '.metadata', 'wb') as f:
        pickle.dump(md, f)


def test_convert_from_olmo_core_refuses_code_in_the_metadata(tmp_path):
    marker = tmp_path / 'ran'
    step, _ = write_study_dir(tmp_path)
    md = read_own_metadata(step)
    md.storage_meta.checkpoint_id = shell(marker)  # a real Metadata with one field that runs a command
    write_metadata(step, md)
    meta = step / 'model_and_optim' / '.metadata'
    assert_live(marker, lambda: pickle.loads(meta.read_bytes()))
    r = run('tools/convert.py', '--from=olmo_core', step.parent, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert_refused(r, marker, 'posix.system')
    assert '.metadata' in r.stderr


def test_convert_from_olmo_core_refuses_code_in_a_shard(tmp_path):
    marker = tmp_path / 'ran'
    step, _ = write_study_dir(tmp_path)
    buf = io.BytesIO()
    torch.save(shell(marker), buf)  # where a tensor should be
    (step / 'model_and_optim' / '__9_0.distcp').write_bytes(buf.getvalue())
    md = read_own_metadata(step)
    for index, info in md.storage_data.items():
        if index.fqn == 'model.embeddings.weight':
            info.relative_path, info.offset, info.length = '__9_0.distcp', 0, len(buf.getvalue())
    write_metadata(step, md)
    assert_live(marker, lambda: torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    r = run('tools/convert.py', '--from=olmo_core', step.parent, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert_refused(r, marker, 'posix.system')


def test_metadata_allow_list_reads_what_torch_writes(tmp_path):
    """Every global of a real torch.distributed.checkpoint .metadata is allowed, and the
    tensors read back exactly."""
    step, model = write_study_dir(tmp_path)
    names = pickle_globals(step / 'model_and_optim' / '.metadata')
    assert 'torch.distributed.checkpoint.metadata.Metadata' in names and 'torch.Size' in names
    for name in names:
        module, _, attr = name.rpartition('.')
        convert._StudyUnpickler(io.BytesIO()).find_class(module, attr)  # raises RefusedGlobal if not allowed
    state, _ = convert.read_distcp(step / 'model_and_optim')
    assert set(state) == set(model)
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in model.items())


@dataclass
class _StorageInfo:
    """OLMo-core's storage record (olmo_core/distributed/checkpoint/filesystem.py): torch's
    fields without transform_descriptors, under OLMo-core's module name."""
    relative_path: str
    offset: int
    length: int


def test_olmo_core_storage_records_are_read_without_olmo_core(tmp_path, monkeypatch):
    step, model = write_study_dir(tmp_path)
    md = read_own_metadata(step)
    module = type(sys)('olmo_core.distributed.checkpoint.filesystem')
    _StorageInfo.__module__ = module.__name__
    module._StorageInfo = _StorageInfo
    md.storage_data = {k: _StorageInfo(v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
    md.storage_meta.checkpoint_id = str(md.storage_meta.checkpoint_id)  # OLMo-core writes a str
    with monkeypatch.context() as m:  # importable while pickling, gone when reading
        for parent in ('olmo_core', 'olmo_core.distributed', 'olmo_core.distributed.checkpoint'):
            m.setitem(sys.modules, parent, type(sys)(parent))
        m.setitem(sys.modules, module.__name__, module)
        write_metadata(step, md)
    assert 'olmo_core' not in sys.modules
    assert 'olmo_core.distributed.checkpoint.filesystem._StorageInfo' in pickle_globals(
        step / 'model_and_optim' / '.metadata')
    state, _ = convert.read_distcp(step / 'model_and_optim')
    assert all(torch.equal(state[k], v) for k, v in model.items())


@pytest.mark.parametrize('module,name', [
    ('posix', 'system'), ('os', 'system'), ('builtins', 'exec'), ('builtins', 'getattr'), ('torch', 'load'),
    ('torch', 'tensor'), ('torch.serialization', 'load'), ('torch.distributed.checkpoint.metadata', 'field'),
    ('collections', 'namedtuple'), ('pathlib', 'Path'), ('olmo_core.train', 'Trainer'), ('subprocess', 'run')])
def test_metadata_unpickler_refuses_every_other_global(module, name):
    with pytest.raises(RefusedGlobal) as e:
        convert._StudyUnpickler(io.BytesIO()).find_class(module, name)
    assert e.value.name == f"{module}.{name}"


def test_metadata_shards_outside_the_directory_are_refused(tmp_path):
    step, _ = write_study_dir(tmp_path)
    md = read_own_metadata(step)
    next(iter(md.storage_data.values())).relative_path = '../../secret.distcp'
    write_metadata(step, md)
    with pytest.raises(ValueError, match="names the shard '../../secret.distcp', not a file of its directory"):
        convert.read_distcp(step / 'model_and_optim')
