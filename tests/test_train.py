"""train.py end to end on CPU: loss goes down, exact resume, DDP == accumulation, bad inputs.
train.py is a script, so each case runs it in a subprocess on a tiny dataset the test writes.
Run: python -m pytest tests/test_train.py -q"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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


@pytest.mark.slow
@pytest.mark.parametrize('sharding', ['--fsdp=False', '--fsdp=True'])
def test_ddp_two_processes_equal_accumulation(sharding, data_dir, tmp_path):
    """2 gloo processes x 1 micro-step == 1 process x 2 micro-steps (same batches, averaged
    gradients), with DDP and with FSDP2 (fully_shard); the validation loss is over the same
    eval_iters batches (3: one rank scores two, the other one)."""
    common = [*TINY, f'--data_dir={data_dir}', '--max_iters=6', '--eval_interval=100', '--eval_iters=3']
    train(*common, f'--out_dir={tmp_path / "single"}')
    env = dict(os.environ, OMP_NUM_THREADS='1')
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        'train.py', *common, sharding, f'--out_dir={tmp_path / "ddp"}'],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    single, ddp = train_losses(tmp_path / 'single'), train_losses(tmp_path / 'ddp')
    assert [i for i, _ in single] == [i for i, _ in ddp]
    np.testing.assert_allclose([l for _, l in ddp], [l for _, l in single], rtol=1e-5)
    assert single[-1][1] < single[0][1]
    val = [[m['val_loss'] for m in metrics(tmp_path / o) if 'val_loss' in m] for o in ('single', 'ddp')]
    assert len(val[0]) == 2                                 # at iteration 0 and 6
    np.testing.assert_allclose(val[1], val[0], rtol=1e-5)


def read_wandb_history(run_dir):
    """The history rows of an offline W&B run: its run-*.wandb file is a LevelDB-style log
    (7-byte file header, then records of crc32, length, type in 32 KiB blocks) of protobuf
    Records. Returns {step: {key: value}}."""
    import struct
    from wandb.proto import wandb_internal_pb2 as pb
    [path] = Path(run_dir).glob('run-*.wandb')
    data, pos, buf, steps = path.read_bytes(), 7, b'', {}
    assert data[:4] == b':W&B'
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
        if length == kind == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b''
            if rec.WhichOneof('record_type') == 'history':
                row = {(i.key or '/'.join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                steps.setdefault(row['_step'], {}).update(row)
    return steps


def test_wandb_offline_logs_the_metrics_rows_from_rank_0_only(data_dir, tmp_path):
    """Under torchrun with 2 processes and WANDB_MODE=offline: one W&B run, whose history at
    step `iter` holds every metrics.jsonl row's values, each block's statistics as its own key."""
    pytest.importorskip('wandb')
    out = tmp_path / 'wb'
    env = dict(os.environ, OMP_NUM_THREADS='1', WANDB_MODE='offline', WANDB_SILENT='true')
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        'train.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=4',
                        '--eval_interval=2', '--log_interval=2', '--wandb_log=True', '--wandb_run_name=tiny'],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((out / 'wandb').glob('offline-run-*'))
    assert len(runs) == 1  # rank 0 only
    history = read_wandb_history(runs[0])
    rows = metrics(out)
    assert sorted(history) == sorted({m['iter'] for m in rows}) == [0, 2, 4]
    for m in rows:
        logged = history[m['iter']]
        for k, v in m.items():
            if isinstance(v, list):
                assert [logged[f'{k}/{b}'] for b in range(len(v))] == pytest.approx(v)
            elif v is not None and k != 'iter' and not (k == 'lr' and 'val_loss' in m):  # train row's lr
                assert logged[k] == pytest.approx(v), k
        if 'block_grad_norm' in m:
            g = m['block_grad_norm']
            assert logged['grad_first_last_ratio'] == pytest.approx(g[0] / g[-1])
    r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "nowb"}', '--max_iters=2', '--eval_interval=2')
    assert not (tmp_path / 'nowb' / 'wandb').exists()  # off by default


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
    torch.save(ck, out / 'ckpt.pt')
    train(*TINY, '--residual=mhc', f'--data_dir={data_dir}', f'--out_dir={out}', '--init_from=resume',
          '--max_iters=3')
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['config']['mhc_sinkhorn'] == 'plain'
