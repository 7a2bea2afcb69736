"""train.py under faults: each test injects one (a NaN gradient with a finite loss, a
diverging validation loss, a second run on a live out_dir, a full disk mid-checkpoint, a
kill between the final checkpoint and summary.json, damaged data or checkpoints) and
checks that no good state is lost and the run says what happened in one line. Also the
pieces of train.py that a run's numbers depend on, checked against hand formulas: the LR
schedule, gradient clipping, gradient accumulation, the loader's rank offset and position.

Faults are injected by running train.py through runpy with one library function patched
(the patch is the test's; train.py has no test hooks).
Run: python -m pytest tests/test_train_faults.py -q"""

import ast
import fcntl
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from data.loader import TokenLoader, open_tokens
from test_train import TINY, data_dir, metrics, one_line_error, train, train_losses  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]


def train_injected(inject, *args):
    """Runs train.py with `inject` (Python source, run first in the same process) patching a library."""
    code = (f"import runpy, sys\nsys.argv = ['train.py'] + {list(args)!r}\n{textwrap.dedent(inject)}\n"
            f"runpy.run_path('train.py', run_name='__main__')\n")
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=600)


def load(path):
    return torch.load(path, weights_only=True)


def all_finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def val_rows(out):
    return [(m['iter'], m['val_loss']) for m in metrics(out) if 'val_loss' in m]


# NaN gradients on the n-th optimizer step (1-based), with the loss left finite
NAN_GRAD_AT = """
import torch
_clip, _calls = torch.nn.utils.clip_grad_norm_, [0]
def _nan_clip(params, *a, **k):
    params = list(params)
    _calls[0] += 1
    if _calls[0] == {n}:
        params[0].grad.fill_(float('nan'))
    return _clip(params, *a, **k)
torch.nn.utils.clip_grad_norm_ = _nan_clip
"""

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


def test_nan_gradient_with_finite_loss_is_never_applied_or_checkpointed(data_dir, tmp_path):
    """The 4th step (iteration 3) gets NaN gradients just before the evaluation at 4: the
    step is refused, ckpt.pt stays the good one of iteration 2, the diagnostic state is finite."""
    out = tmp_path / 'run'
    r = train_injected(NAN_GRAD_AT.format(n=4), *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                       '--max_iters=8', '--eval_interval=2')
    one_line_error(r, 'non-finite gradient norm nan', 'at iteration 3', 'the update was not applied',
                   f'resume from the last good {out}/ckpt.pt')
    good = load(out / 'ckpt.pt')
    assert good['iter_num'] == 2 and all_finite(good['model'])
    diag = load(out / 'ckpt_nonfinite.pt')
    assert diag['iter_num'] == 3 and all_finite(diag['model'])


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
    torch.save(ck, out / 'ckpt.pt')
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


def test_damaged_data_and_checkpoints_give_one_line_errors(data_dir, tmp_path):
    def copy_data(name, **files):
        d = tmp_path / name
        d.mkdir()
        for f in ('train.bin', 'val.bin', 'meta.json'):
            (d / f).write_bytes(files[f] if f in files else (data_dir / f).read_bytes())
        return d
    run = lambda d, *a: train(*TINY, f'--data_dir={d}', f'--out_dir={tmp_path / "o" / d.name}', *a, check=False)
    one_line_error(run(copy_data('empty', **{'train.bin': b''})), 'train.bin is empty')
    one_line_error(run(copy_data('odd', **{'val.bin': (data_dir / 'val.bin').read_bytes()[:-1]})),
                   'val.bin has an odd number of bytes')
    one_line_error(run(copy_data('garbled', **{'meta.json': b'{"vocab_size": 25'})), 'meta.json is not valid JSON')
    one_line_error(run(copy_data('list', **{'meta.json': b'[257]'})), 'meta.json is not a JSON object')
    nometa = copy_data('nometa')
    (nometa / 'meta.json').unlink()  # byte-level data: 50280 (GPT-2) would be a silent guess
    one_line_error(run(nometa), f'{nometa}/meta.json not found', '--vocab_size')
    ids = np.fromfile(data_dir / 'train.bin', dtype=np.uint16)
    ids[-5] = 400  # past --vocab_size=300, in train.bin only: found before training, not mid-run
    ids.tofile(nometa / 'train.bin')
    one_line_error(run(nometa, '--vocab_size=300'), 'train.bin holds token id 400', 'vocab_size=300')
    assert list((tmp_path / 'o').iterdir()) == []  # a failed start leaves no out_dir, lock or metrics.jsonl
    out = tmp_path / 'ck'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=1', '--eval_interval=1')
    good = load(out / 'ckpt.pt')
    resume = [f'--out_dir={out}', '--init_from=resume', '--max_iters=2']
    torch.save({k: v for k, v in good.items() if k != 'loader'}, out / 'ckpt.pt')
    one_line_error(train(*resume, check=False), 'ckpt.pt lacks loader')
    torch.save([1, 2], out / 'ckpt.pt')
    one_line_error(train(*resume, check=False), 'ckpt.pt lacks model, model_args')
    torch.save(dict(good, model_args=dict(good['model_args'], residual='attnres'),
                    config=dict(good['config'], residual='attnres')), out / 'ckpt.pt')
    one_line_error(train(*resume, check=False), "do not fit its model_args (residual='attnres'")


def test_settings_checked_up_front(data_dir, tmp_path):
    one_line_error(train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path}', '--dist_timeout=0', check=False),
                   'dist_timeout=0 must be > 0')

# -----------------------------------------------------------------------------
# the numbers a run depends on, against hand formulas


def hand_lr(it, peak, warmup, max_iters, floor):
    """Linear warmup from peak/(warmup+1) (never 0) to peak, then cosine to floor x peak (paper Sec. 2.3)."""
    if it < warmup:
        return peak * (it + 1) / (warmup + 1)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (it - warmup) / (max_iters - warmup))))


def test_lr_schedule_and_gradient_clipping_in_a_run(data_dir, tmp_path):
    """The lr logged at every iteration equals the hand formula (warmup 3 of 12 iterations,
    cosine to 10% of peak: 0.1 x peak at the end, never 0); a clip at 1e-12 leaves Adam's
    update ~1e-6 of the lr (|g| << eps), so the validation loss stays where it started."""
    out = tmp_path / 'run'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=12', '--eval_interval=12',
          '--warmup_iters=3', '--learning_rate=1e-2', '--grad_clip=1e-12', '--weight_decay=0')
    rows = [m for m in metrics(out) if 'train_loss' in m]
    assert [m['iter'] for m in rows] == list(range(1, 13))
    for m in rows:  # row of iteration i+1 holds the lr of step i
        assert m['lr'] == pytest.approx(hand_lr(m['iter'] - 1, 1e-2, 3, 12, 0.1), rel=1e-12)
    assert rows[0]['lr'] == pytest.approx(2.5e-3) and rows[3]['lr'] == pytest.approx(1e-2)
    final = [m for m in metrics(out) if 'val_loss' in m][-1]
    assert final['iter'] == 12 and final['lr'] == pytest.approx(1e-3)  # the floor, 10% of the peak
    (v0, v12) = [v for _, v in val_rows(out)]
    assert abs(v12 - v0) < 1e-3, (v0, v12)  # clipped to nothing: no learning


# the fp16 loss scaler switched on where train.py runs fp32 (the CPU): losses scaled by 2^16
SCALER_ON = """
import torch
_Scaler = torch.amp.GradScaler
torch.amp.GradScaler = lambda device='cuda', enabled=True, **k: _Scaler(device, init_scale=2.0**16, enabled=True)
"""


def test_fp16_loss_scaling_is_taken_off_before_clipping(data_dir, tmp_path):
    """With the fp16 loss scaler on (scale 2^16, exact in fp32), the gradients are unscaled
    before they are clipped and logged: the gradient norms, per-block norms and losses equal a
    run without scaling (clipped at 0.05, below every norm here). Clipping the scaled gradients
    would log norms 2^16 times larger and shrink every update by 2^16."""
    common = [*TINY, f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=100', '--grad_clip=0.05',
              '--learning_rate=1e-2']
    train(*common, f'--out_dir={tmp_path / "plain"}')
    r = train_injected(SCALER_ON, *common, f'--out_dir={tmp_path / "scaled"}')
    assert r.returncode == 0, r.stderr[-2000:]
    assert load(tmp_path / 'scaled' / 'ckpt.pt')['scaler']['scale'] == 2.0**16  # the scaler was on
    plain, scaled = ([m for m in metrics(tmp_path / run) if 'train_loss' in m] for run in ('plain', 'scaled'))
    assert [m['iter'] for m in scaled] == [1, 2, 3, 4]
    assert all(m['grad_norm'] > 0.05 for m in plain)  # the clip binds at every step
    for a, b in zip(plain, scaled):
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=1e-5)
        assert b['block_grad_norm'] == pytest.approx(a['block_grad_norm'], rel=1e-5)
        assert b['train_loss'] == pytest.approx(a['train_loss'], rel=1e-6)
    assert abs(plain[-1]['train_loss'] - plain[0]['train_loss']) > 1e-2  # the updates moved the loss


def test_gradient_accumulation_equals_the_large_batch(data_dir, tmp_path):
    """2 micro-steps of 4 sequences == 1 step of 8 (the same 8 chunks, the mean of two equal-
    size means): the same training losses (to fp32 rounding), iteration by iteration."""
    common = [a for a in TINY if not a.startswith(('--batch_size', '--gradient_accumulation_steps'))]
    common += [f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=100']
    train(*common, f'--out_dir={tmp_path / "acc"}', '--batch_size=4', '--gradient_accumulation_steps=2')
    train(*common, f'--out_dir={tmp_path / "big"}', '--batch_size=8', '--gradient_accumulation_steps=1')
    acc, big = train_losses(tmp_path / 'acc'), train_losses(tmp_path / 'big')
    assert [i for i, _ in acc] == [1, 2, 3, 4]
    np.testing.assert_allclose([l for _, l in acc], [l for _, l in big], rtol=2e-5)
    assert abs(acc[-1][1] - acc[0][1]) > 1e-3  # the weights moved: the comparison covers the updates


def train_defs(*names, **namespace):
    """The named top-level functions / classes of train.py, defined in a namespace of their own
    (train.py is a script: importing it would run it)."""
    tree = ast.parse((REPO / 'train.py').read_text())
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert sorted(n.name for n in nodes) == sorted(names)

    def fail(msg):
        raise SystemExit(f"error: {msg}")
    g = {'np': np, 'torch': torch, 'os': os, 'math': math, 'fail': fail, 'device_type': 'cpu', 'device': 'cpu',
         **namespace}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), 'train.py', 'exec'), g)
    return g


def test_lr_schedule_function_at_hand_computed_iterations():
    g = train_defs('get_lr', learning_rate=2.0, warmup_iters=10, max_iters=110, min_lr_frac=0.1)
    for it in (0, 1, 5, 9, 10, 11, 35, 60, 85, 109, 110, 200):
        assert g['get_lr'](it) == pytest.approx(hand_lr(min(it, 110), 2.0, 10, 110, 0.1), rel=1e-12), it
    assert g['get_lr'](0) == pytest.approx(2.0 / 11)  # warmup does not start at 0
    assert g['get_lr'](60) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # half-way: the mean of peak and floor
    assert g['get_lr'](110) == pytest.approx(0.2)  # the floor is 10% of the peak, not 0
    g = train_defs('get_lr', learning_rate=1.0, warmup_iters=0, max_iters=4, min_lr_frac=0.0)
    assert [g['get_lr'](i) for i in range(5)] == pytest.approx([1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5,
                                                                0.5 - 0.5 * math.cos(math.pi / 4), 0.0])


@pytest.fixture()
def tokens(tmp_path):
    """A token file whose chunk i (of T+1 = 4 tokens) starts with the id i: ids name chunks."""
    path = tmp_path / 'tok.bin'
    np.repeat(np.arange(64, dtype=np.uint16), 4).tofile(path)
    return str(path)


def chunks_of(loader, n):
    return [loader.next_batch()[0][:, 0].tolist() for _ in range(n)]


def test_loader_rank_offset_splits_each_micro_step_between_processes(tokens):
    """Rank r of 2 takes the r-th half of the job's micro-step: together the two ranks see the
    chunks one process sees in two micro-steps, in the same order, over an epoch boundary."""
    TL = TokenLoader
    one = chunks_of(TL(tokens, 2, 3, rank=0, world=1, seed=5), 40)  # 64 chunks: 32 steps an epoch
    r0 = chunks_of(TL(tokens, 2, 3, rank=0, world=2, seed=5), 20)
    r1 = chunks_of(TL(tokens, 2, 3, rank=1, world=2, seed=5), 20)
    assert [c for a, b in zip(r0, r1) for c in (a, b)] == one
    assert sorted(sum(one[:32], [])) == list(range(64))  # one epoch: every chunk once
    assert sorted(sum(one[32:], [])) != sum(one[32:], [])  # a shuffle, not file order


def test_loader_position_resumes_on_another_process_count(tokens):
    """A state saved by 1 process after 3 micro-steps, loaded by 2 (or the other way round):
    the job continues with exactly the chunks an uninterrupted single process sees next."""
    TL = TokenLoader
    ref = chunks_of(TL(tokens, 2, 3, world=1, seed=1), 14)
    single = TL(tokens, 2, 3, world=1, seed=1)
    chunks_of(single, 4)
    state = single.state_dict()
    ranks = [TL(tokens, 2, 3, rank=r, world=2, seed=1) for r in (0, 1)]
    for ld in ranks:
        ld.load_state_dict(state)
    got = [c for step in zip(*(chunks_of(ld, 4) for ld in ranks)) for c in step]
    assert got == ref[4:12]
    back = TL(tokens, 2, 3, world=1, seed=1)
    back.load_state_dict(ranks[0].state_dict())  # 2 processes -> 1
    assert chunks_of(back, 2) == ref[12:14]


def test_empty_or_odd_token_files_are_refused(tmp_path):
    (tmp_path / 'e.bin').write_bytes(b'')
    (tmp_path / 'o.bin').write_bytes(b'abc')
    with pytest.raises(SystemExit, match='is empty'):
        open_tokens(str(tmp_path / 'e.bin'))
    with pytest.raises(SystemExit, match='odd number of bytes'):
        open_tokens(str(tmp_path / 'o.bin'))
