"""train.py end to end on CPU: loss goes down, exact resume, bad inputs, a NaN gradient never
applied, and the numbers a run depends on against hand formulas (LR schedule, gradient
clipping, fp16 loss scaling, accumulation, --auto_batch's batches). train.py is a script, so
each case runs it in a subprocess on a tiny dataset the test writes; the helpers here
(`data_dir`, `train`, `train_injected`, ...) serve the other train.py test files too.
Run: python -m pytest tests/test_train.py -q"""

import ast
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

import checkpoint

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / 'shared' / 'data'
TINY = ['--device=cpu', '--compile=False', '--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=32',
        '--batch_size=4', '--gradient_accumulation_steps=2', '--log_interval=1', '--eval_iters=2']


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A learnable byte-level corpus: a repeated short text with some noise."""
    d = tmp_path_factory.mktemp('data')
    rng = np.random.default_rng(0)
    text = np.frombuffer(b'the quick brown fox jumps over the lazy dog. ' * 800, dtype=np.uint8).astype(np.uint16)
    noise = rng.integers(0, 256, size=text.size, dtype=np.uint16)
    tokens = np.where(rng.random(text.size) < 0.05, noise, text)
    tokens[:30000].tofile(d / 'train.bin')
    tokens[30000:].tofile(d / 'val.bin')
    (d / 'meta.json').write_text(json.dumps({'vocab_size': 257, 'tokenizer': 'byte'}))
    return d


def train(*args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    r = subprocess.run([sys.executable, 'train.py', *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if check and r.returncode:
        raise AssertionError(f"train.py failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


def metrics(out):
    return [json.loads(line) for line in (Path(out) / 'metrics.jsonl').read_text().splitlines()]


def train_losses(out):
    return [(m['iter'], m['train_loss']) for m in metrics(out) if 'train_loss' in m]


def train_injected(inject, *args):
    """Runs train.py with `inject` (Python source, run first in the same process) patching a library."""
    code = (f"import runpy, sys\nsys.argv = ['train.py'] + {list(args)!r}\n{textwrap.dedent(inject)}\n"
            f"runpy.run_path('train.py', run_name='__main__')\n")
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=600)


def load(path):
    return torch.load(path, weights_only=True)


def lines(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


def val_rows(out):
    return [(m['iter'], m['val_loss']) for m in metrics(out) if 'val_loss' in m]


@pytest.mark.parametrize('residual', ['preln', 'attnres'])
def test_thirty_iterations_lower_the_loss(residual, data_dir, tmp_path):
    out = tmp_path / 'out'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', f'--residual={residual}', '--max_iters=30',
          '--eval_interval=30', '--learning_rate=3e-3')
    rows = metrics(out)
    val = [m['val_loss'] for m in rows if 'val_loss' in m]
    assert val[0] == pytest.approx(np.log(257), abs=0.3)  # uniform at init
    assert val[-1] < val[0] - 1.0
    losses = [l for _, l in train_losses(out)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    last = [m for m in rows if 'train_loss' in m][-1]
    for key in ('tokens', 'lr', 'grad_norm', 'dt_ms', 'tokens_per_s', 'mfu', 'block_grad_norm', 'block_act_rms'):
        assert key in last
    assert len(last['block_grad_norm']) == 2 and len(last['block_act_rms']) == 2
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['finished'] and summary['iter'] == 30 and summary['val_loss'] == val[-1]
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert not any(k.startswith('_orig_mod.') for k in ckpt['model'])
    assert ckpt['iter_num'] == 30 and ckpt['model_args']['residual'] == residual


def test_resume_is_bit_identical(data_dir, tmp_path):
    common = [*TINY, f'--data_dir={data_dir}', '--residual=attnres', '--max_iters=16', '--eval_interval=5']
    train(*common, f'--out_dir={tmp_path / "a"}')
    train(*common, f'--out_dir={tmp_path / "b"}', '--stop_iter=5')  # an evaluation is due at 5: after the resume
    assert not (tmp_path / 'b' / 'summary.json').exists()
    assert max(i for i, _ in train_losses(tmp_path / 'b')) == 5
    with open(tmp_path / 'b' / 'metrics.jsonl', 'a') as f:  # a row logged after the checkpoint, then a crash
        f.write(json.dumps({'iter': 8, 'train_loss': 123.0}) + '\n{"iter": 9, "tok')  # ... mid-write
    train(*common, f'--out_dir={tmp_path / "b"}', '--init_from=resume')
    a, b = train_losses(tmp_path / 'a'), train_losses(tmp_path / 'b')
    assert a == b  # exact float equality, every iteration
    va = [m['val_loss'] for m in metrics(tmp_path / 'a') if 'val_loss' in m]
    vb = [m['val_loss'] for m in metrics(tmp_path / 'b') if 'val_loss' in m]
    assert va == vb


def test_tokens_are_counted_step_by_step_across_a_resume_with_another_batch(data_dir, tmp_path):
    # 3 steps of 4 x 2 sequences, then a resume at --batch_size=2: 3 steps of 2 x 2 (T = 32)
    common = [*TINY, f'--data_dir={data_dir}', '--max_iters=6', '--eval_interval=3', f'--out_dir={tmp_path}']
    train(*common, '--stop_iter=3')
    r = train(*common, '--init_from=resume', '--batch_size=2')
    want = 3 * 4 * 2 * 32 + 3 * 2 * 2 * 32
    assert json.loads((tmp_path / 'summary.json').read_text())['tokens'] == want
    rows = {m['iter']: m['tokens'] for m in metrics(tmp_path) if 'train_loss' in m}
    assert (rows[3], rows[4], rows[6]) == (3 * 256, 3 * 256 + 128, want)
    assert f"after {want:,} tokens" in r.stdout


def test_block_attnres_in_blocks_of_one_sublayer_says_it_is_full_attnres(data_dir, tmp_path):
    """2 layers with the default attnres_blocks=8: one start-up line says the run is Full AttnRes."""
    r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "out"}', '--residual=blockattnres',
              '--max_iters=1', '--eval_interval=1')
    said = [line for line in r.stdout.splitlines() if 'is Full AttnRes' in line]
    assert len(said) == 1 and said[0].startswith('note: Block AttnRes with attnres_blocks=8'), r.stdout[-2000:]


def test_gpu_config_on_a_cpu_says_so_up_front(tmp_path):
    r = train('config/attnres_L32.py', '--device=cpu', f'--data_dir={tmp_path / "none"}', check=False)
    note = [line for line in r.stdout.splitlines() if line.startswith('note:')]
    assert len(note) == 1 and 'sized for a GPU' in note[0] and 'about 399M parameters' in note[0]
    assert 'config/cpu_attnres.py' in note[0] and '1,048,576 tokens' in note[0]
    one_line_error(r, 'does not exist')  # the note comes before anything slow (here, the data check)


def one_line_error(r, *needles):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error:'), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs_give_one_line_errors(data_dir, tmp_path):
    one_line_error(train('--n_layr=3', check=False), 'n_layer')
    one_line_error(train('--device=cpu', f'--data_dir={tmp_path}', check=False), 'train.bin', 'prepare')
    r = train('--device=cpu', f'--data_dir={tmp_path}', '--fast=maybe', check=False)  # before the data is looked at
    one_line_error(r, "fast must be 'auto', True or False")
    assert 'train.bin' not in r.stdout + r.stderr
    one_line_error(train('--device=cpu', f'--data_dir={data_dir}', '--n_embd=100', '--n_head=16', check=False),
                   'not divisible by n_head')
    one_line_error(train('--device=cpu', '--dtype=float16', f'--data_dir={data_dir}', check=False), 'float32')
    one_line_error(train(*TINY, f'--data_dir={data_dir}', '--vocab_size=100', check=False),
                   'vocab_size=100 is smaller than the data', '257')
    bare = tmp_path / 'bare'                                    # no meta.json: the held-out ids are checked
    bare.mkdir()
    for f in ('train.bin', 'val.bin'):
        (bare / f).write_bytes((data_dir / f).read_bytes())
    one_line_error(train(*TINY, f'--data_dir={bare}', '--vocab_size=100', check=False), "past the model's vocab_size=100")
    out = tmp_path / 'trunc'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=2', '--eval_interval=1')
    resume = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--init_from=resume']
    one_line_error(train(*resume, '--n_layer=3', check=False), "n_layer=3 differs from the checkpoint's 2")
    r = train(*resume, '--max_iters=3')  # allowed, with a note: the schedule changes
    assert "note: max_iters=3 differs from the checkpoint's run (2)" in r.stdout
    one_line_error(train(*resume, '--max_iters=3', check=False), 'the run is finished')  # no repeated final eval
    one_line_error(train(*resume, '--max_iters=2', check=False), 'max_iters is behind it')  # never ended before
    data = (out / 'ckpt.pt').read_bytes()
    (out / 'ckpt.pt').write_bytes(data[:len(data) // 2])
    one_line_error(train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', check=False),
                   'already holds a run', '--init_from=resume')   # a new run would overwrite it
    one_line_error(train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--init_from=resume', check=False),
                   'truncated', 'another --out_dir')
    one_line_error(train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "none"}', '--init_from=resume',
                         check=False), 'does not exist')


@pytest.mark.parametrize('arg,expect', [('--max_iters=-5', 'max_iters=-5 must be >= 1'),
                                        ('--batch_size=0', 'batch_size=0 must be >= 1'),
                                        ('--eval_interval=0', 'eval_interval=0 must be >= 1'),
                                        ('--log_interval=0', 'log_interval=0 must be >= 1'),
                                        ('--eval_iters=0', 'eval_iters=0 must be >= 1'),
                                        ('--learning_rate=-1', 'learning_rate=-1 must be > 0'),
                                        ('--min_lr_frac=1.5', 'fraction'),
                                        ('--max_iters=3.5', 'max_iters expects int (default None), got 3.5'),  # ran forever
                                        ('--stop_iter=abc', "stop_iter expects int (default None), got 'abc'"),
                                        ('--learning_rate=fast', "learning_rate expects float (default None), got 'fast'"),
                                        ('--vocab_size=abc', "vocab_size expects int (default None), got 'abc'"),
                                        ('--device=gpu', "device='gpu' is not a torch device"),
                                        ('--device=meta', "device='meta' cannot run here"),
                                        ('--decay_on=vectors', "decay_on='vectors'"),
                                        ('--attnres_eps=0', 'attnres_eps=0 must be > 0')])
def test_out_of_range_settings_give_one_line_errors(arg, expect, data_dir, tmp_path):
    """Values that would crash later, or never stop (a negative max_iters), are refused up front."""
    one_line_error(train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path}', arg, check=False), expect)


def test_settings_checked_up_front(data_dir, tmp_path):
    one_line_error(train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path}', '--dist_timeout=0', check=False),
                   'dist_timeout=0 must be > 0')


def test_nonfinite_loss_stops_with_diagnostic_checkpoint(data_dir, tmp_path):
    out = tmp_path / 'nan'
    r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=20', '--learning_rate=1e30',
              '--grad_clip=0', check=False)
    one_line_error(r, 'non-finite', 'learning_rate', 'no checkpoint was written')  # none before iteration 1
    assert (out / 'ckpt_nonfinite.pt').exists()


@pytest.mark.slow
def test_fresh_clone_prepares_the_embedded_sample(tmp_path):
    """A clone with no data: the default data dir is prepared from data/sample/ (one line says
    so), and only the default one; a data_dir the user names must exist."""
    import shutil
    clone = tmp_path / 'clone'
    tracked = subprocess.run(['git', 'ls-files'], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in tracked:  # what a clone has: tracked files only, no prepared data
        if (REPO / f).is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / f, clone / f)
    assert not (clone / 'data' / 'fineweb_edu' / 'train.bin').exists()
    env = dict(os.environ, OMP_NUM_THREADS='1')
    tiny = ['--device=cpu', '--compile=False', '--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=32',
            '--batch_size=2', '--eval_iters=2', '--eval_only=True']

    def run(*args):
        return subprocess.run([sys.executable, 'train.py', *tiny, *args], cwd=clone, capture_output=True,
                              text=True, env=env, timeout=300)
    r = run(f'--out_dir={tmp_path / "out"}')
    assert r.returncode == 0, r.stderr[-2000:]
    said = [line for line in r.stdout.splitlines() if 'embedded sample' in line]
    assert len(said) == 1 and 'fineweb_edu has no train.bin/val.bin' in said[0] and 'gpt2' in said[0]
    meta = json.loads((clone / 'data' / 'fineweb_edu' / 'meta.json').read_text())
    assert meta['tokenizer'] == 'gpt2' and meta['train_docs'] + meta['val_docs'] == 744
    val = float(r.stdout.split('val loss ')[1].split()[0])
    assert val == pytest.approx(np.log(50280), abs=0.3)  # untrained: about uniform over the vocabulary
    r = run('--dataset=fineweb_edu_byte', f'--out_dir={tmp_path / "out"}')  # the byte twin, by its name
    assert r.returncode == 0 and 'byte tokenizer' in r.stdout, r.stderr[-2000:]
    assert json.loads((clone / 'data' / 'fineweb_edu_byte' / 'meta.json').read_text())['vocab_size'] == 257
    for args, words in ((['--dataset=mydata'], ('data/mydata/train.bin not found', '--sample')),
                        ([f'--data_dir={tmp_path / "nowhere"}'], ("data_dir=", "nowhere", 'does not exist'))):
        r = run(*args, f'--out_dir={tmp_path / "out"}')
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
    assert not (clone / 'data' / 'mydata').exists()


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / 'c4_sample_1000.jsonl.gz').exists(), reason='../shared/data not present')
def test_real_web_text(tmp_path):
    """Prepare the real C4 sample with GPT-2 BPE and train a small AttnRes model on it."""
    data = tmp_path / 'c4'
    r = subprocess.run([sys.executable, 'data/fineweb_edu/prepare.py', '--input', str(SHARED / 'c4_sample_1000.jsonl.gz'),
                        '--out_dir', str(data), '--num_proc', '1'], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = tmp_path / 'out'
    train('--device=cpu', '--compile=False', f'--data_dir={data}', f'--out_dir={out}', '--residual=attnres',
          '--n_layer=2', '--n_embd=64', '--n_head=4', '--block_size=64', '--batch_size=8',
          '--gradient_accumulation_steps=1', '--max_iters=60', '--eval_interval=60', '--learning_rate=3e-3', '--eval_iters=4', '--log_interval=10')
    val = [m['val_loss'] for m in metrics(out) if 'val_loss' in m]
    assert val[0] == pytest.approx(np.log(50280), abs=0.3)
    assert val[-1] < val[0] - 2.0  # from ln(50280) = 10.8 to below ~8.8 in 30k tokens


def test_resuming_a_checkpoint_older_than_a_model_field_records_what_it_trains(data_dir, tmp_path):
    """A checkpoint written before mhc_sinkhorn existed was trained with the 'plain' Sinkhorn;
    its resume builds that model (GPTConfig.from_dict) and must record that value, not today's
    default, in the run's config."""
    import torch
    out = tmp_path / 'old'
    train(*TINY, '--residual=mhc', f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=2',
          '--eval_interval=2')
    ck = torch.load(out / 'ckpt.pt', weights_only=True)
    for part in ('model_args', 'config'):
        ck[part].pop('mhc_sinkhorn', None)                     # as an older train.py wrote it
    checkpoint.save_checkpoint(str(out / 'ckpt.pt'), ck)  # sealed, as train.py writes it
    train(*TINY, '--residual=mhc', f'--data_dir={data_dir}', f'--out_dir={out}', '--init_from=resume',
          '--max_iters=3')
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['config']['mhc_sinkhorn'] == 'plain'


# -----------------------------------------------------------------------------
# non-finite gradients are never applied

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


def all_finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


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


# -----------------------------------------------------------------------------
# what a run's numbers depend on, against hand formulas: the LR schedule, gradient
# clipping, fp16 loss scaling, accumulation, the batches of --auto_batch

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
