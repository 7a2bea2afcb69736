"""train.py under the faults that used to lose work or hide it, each injected for real: kill -9
in the middle of a checkpoint write, a scratch re-run after a kill before the first checkpoint,
a run whose best state is its start, token ids past the vocabulary in train.bin, Ctrl-C at
set moments, two train.py processes racing for one out_dir, and the micro-batches the loader
really yields under --auto_batch. Each test checks what the next run, the files or the one
line a user sees must show.

Faults are injected as in test_train_faults.py: train.py runs through runpy in a process whose
library functions (torch.save, clip_grad_norm_, ...) the test has patched first.
Run: python -m pytest tests/test_faults.py -q"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from test_train import TINY, data_dir, metrics, one_line_error, train  # noqa: F401 (fixture)
from test_train_faults import train_injected

REPO = Path(__file__).resolve().parents[1]


def load(path):
    return torch.load(path, weights_only=True)


def lines(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


# -----------------------------------------------------------------------------
# kill -9 mid-write, and the scratch re-run after a kill

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


# -----------------------------------------------------------------------------
# the best state, and the data check


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
    assert len(said) >= 2 and all('(iteration 0)' in line for line in said), said
    assert lines(r.stdout, 'done:') and 'ckpt_best.pt' in lines(r.stdout, 'done:')[0]
    again = tmp_path / 'again'  # the kept file is the start: evaluated on its own, the same loss
    again.mkdir()
    (again / 'ckpt.pt').write_bytes((out / 'ckpt_best.pt').read_bytes())
    r = train(f'--out_dir={again}', '--init_from=resume', '--eval_only=True')
    assert f"val loss {vals[0][1]:.4f}" in r.stdout


def test_token_ids_past_the_vocabulary_in_train_bin_are_found_up_front_with_meta_json(data_dir, tmp_path):
    """meta.json says 257, train.bin holds id 300 in its last chunk: one line before the model
    is built, not an IndexError mid-run; nothing is written."""
    bad = tmp_path / 'bad'
    bad.mkdir()
    for f in ('val.bin', 'meta.json'):
        (bad / f).write_bytes((data_dir / f).read_bytes())
    ids = np.fromfile(data_dir / 'train.bin', dtype=np.uint16)
    ids[-3] = 300
    ids.tofile(bad / 'train.bin')
    r = train(*TINY, f'--data_dir={bad}', f'--out_dir={tmp_path / "out"}', '--max_iters=2', check=False)
    one_line_error(r, 'train.bin holds token id 300', 'vocab_size=257')
    assert 'model:' not in r.stdout and not (tmp_path / 'out').exists()

# -----------------------------------------------------------------------------
# Ctrl-C


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

# -----------------------------------------------------------------------------
# two runs, one out_dir


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
# auto_batch: the sequences the model sees per optimizer step

# every training forward's batch size, and the sequences seen per optimizer step, into $BATCH_LOG
COUNT_BATCHES = """
import atexit, json, os, torch, model
_forward, _sizes, _steps, _seen = model.GPT.forward, [], [], [0]
def _counting_forward(self, idx, *a, **k):
    if not torch.is_grad_enabled() and not _steps:  # the first evaluation: what came before was set-up
        _sizes.clear()
        _seen[0] = 0
    if torch.is_grad_enabled():
        _sizes.append(idx.size(0))
        _seen[0] += idx.size(0)
    return _forward(self, idx, *a, **k)
model.GPT.forward = _counting_forward
_clip = torch.nn.utils.clip_grad_norm_
def _step(*a, **k):
    _steps.append(_seen[0])
    _seen[0] = 0
    return _clip(*a, **k)
torch.nn.utils.clip_grad_norm_ = _step
atexit.register(lambda: open(os.environ['BATCH_LOG'], 'w').write(json.dumps({'sizes': _sizes, 'steps': _steps})))
"""


def test_auto_batch_keeps_the_global_batch_in_the_batches_the_model_sees(data_dir, tmp_path, monkeypatch):
    """16 sequences per step asked as 16 x 1, with a memory budget that fits about 5: every
    optimizer step still trains on exactly 16 sequences, in micro-batches of the size the plan
    printed (counted at the model's forward, not read from the plan)."""
    from model import GPT, GPTConfig
    from plan import memory as memory_plan
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=257)
    torch.manual_seed(1337)
    mem = memory_plan.train_memory(cfg, 16, 32, model=GPT(cfg))
    per_seq = mem['per_sequence']
    budget_gib = (mem['total'] - 16 * per_seq + 5.2 * per_seq) / memory_plan.AUTO_BATCH_FILL / 2**30
    log = tmp_path / 'batches.json'
    monkeypatch.setenv('BATCH_LOG', str(log))
    r = train_injected(COUNT_BATCHES, '--device=cpu', '--compile=False', '--n_layer=2', '--n_embd=32', '--n_head=2',
                       '--block_size=32', '--log_interval=1', '--eval_iters=1', '--max_iters=3', '--eval_interval=3',
                       f'--data_dir={data_dir}', f'--out_dir={tmp_path / "o"}', '--batch_size=16',
                       '--gradient_accumulation_steps=1', '--auto_batch=True', f'--memory_gib={budget_gib!r}')
    assert r.returncode == 0, r.stderr[-2000:]
    [plan] = lines(r.stdout, 'auto_batch: ')
    micro, accum = (int(w.strip(',')) for w in plan.split()[2::2])
    assert micro < 16 and micro * accum == 16, plan  # the plan changed the micro-batch
    seen = json.loads(log.read_text())
    assert seen['steps'] == [16, 16, 16]
    assert seen['sizes'] == [micro] * (3 * accum)
