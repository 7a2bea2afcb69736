"""
Several processes on the CPU (gloo under torchrun): 2 processes x 1 micro-step equal 1 process
x 2 micro-steps (DDP and FSDP); FSDP2 gathers each weight once per forward and once per
backward, also for MoDA, which calls the attention's projections one by one; with DDP and
compiled regions no scheme-sized tensor crosses a graph split (tests/dist_record.py counts
FSDP's all-gathers and DDPOptimizer's splits); W&B logs its rows from rank 0 only.
Run: python -m pytest tests/test_distributed.py -q"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_train import TINY, data_dir, metrics, train, train_losses  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]


# -----------------------------------------------------------------------------
# data parallel: equal to gradient accumulation


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


# -----------------------------------------------------------------------------
# what crosses between processes and compiled regions


def torchrun(args, record, env=None):
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        'tests/dist_record.py', *args], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_NUM_THREADS='1', DIST_RECORD=str(record), **(env or {})))
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(Path(f"{record}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize('residual', ['moda', 'preln'])
def test_fsdp_gathers_each_weight_once_per_forward_and_backward(residual, data_dir, tmp_path):  # noqa: F811
    """One optimizer step (one micro-step per rank) between two evaluations of one batch: three
    forwards and one backward per rank, so every block weight is gathered 4 times; the root's
    weights (embedding, head, the scheme's own) stay gathered from forward to backward: 3. Before
    the attention's four projections were one unit, MoDA's (called as attn.qkv, then attn.out)
    were gathered twice per pass: 8. The losses are those of one process with accumulation."""
    common = [*TINY, f'--data_dir={data_dir}', f'--residual={residual}', '--max_iters=1', '--eval_iters=2']
    runs = torchrun([*common, '--fsdp=True', f'--out_dir={tmp_path / "fsdp"}'], tmp_path / 'rec')
    train(*common, f'--out_dir={tmp_path / "single"}')
    for rec in runs:
        blocks = {k: v for k, v in rec['gathers'].items() if k.startswith('blocks.')}
        assert len(blocks) == 2 * 7 and set(blocks.values()) == {4}, blocks
        assert set(v for k, v in rec['gathers'].items() if k not in blocks) == {3}
    np.testing.assert_allclose([l for _, l in train_losses(tmp_path / 'fsdp')],
                               [l for _, l in train_losses(tmp_path / 'single')], rtol=1e-5)
    val = [[m['val_loss'] for m in metrics(tmp_path / o) if 'val_loss' in m] for o in ('fsdp', 'single')]
    np.testing.assert_allclose(val[0], val[1], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('residual', ['attnres', 'moda'])
def test_ddp_compiled_regions_pass_no_scheme_sized_state_between_splits(residual, data_dir, tmp_path):  # noqa: F811
    """Under DDP, DDPOptimizer cuts each compiled graph at DDP's gradient buckets (made tiny
    here, so that every graph with two or more weights is cut). With regional compilation the
    graphs are the branches and the scheme's regions: what crosses a cut is at most the branch's
    input and two (B, T, d_ff) activations (SwiGLU's gate and up). The scheme's state (AttnRes's
    2L + 1 = 9 sources, MoDA's depth slots) lives between the compiled regions and never crosses
    a cut (compiling the whole model does that: at a late cut every source so far crosses it)."""
    B, T, d, d_ff, L = 4, 32, 32, 96, 4
    recs = torchrun([*TINY, f'--data_dir={data_dir}', f'--residual={residual}', '--compile=True', '--max_iters=2',
                     f'--n_layer={L}', '--eval_iters=1', f'--out_dir={tmp_path / "ddp"}'], tmp_path / 'rec')
    bound = B * T * (d + 2 * d_ff) * 4
    assert (2 * L + 1) * B * T * d * 4 > bound  # the state of the depth reads would not fit under it
    for rec in recs:
        cut = [s for s in rec['splits'] if s['pieces'] > 1]
        assert cut, rec['splits']  # the check is not vacuous: graphs were cut
        assert max(s['largest_crossing'] for s in cut) <= bound, rec['splits']
    losses = train_losses(tmp_path / 'ddp')
    assert len(losses) == 2 and all(np.isfinite(l) for _, l in losses)


# -----------------------------------------------------------------------------
# logging from rank 0


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


def test_wandb_offline_single_process_logs_exactly_the_metrics_rows(data_dir, tmp_path):
    """One process, WANDB_MODE=offline: at every step the W&B history holds exactly the keys of
    that step's metrics.jsonl rows (each block's statistic as its own key, the first/last gradient
    ratio added, the evaluation row's lr left to the training row) with the same values, and no
    step that metrics.jsonl lacks. A row logged twice, dropped, or at another step fails."""
    pytest.importorskip('wandb')
    out = tmp_path / 'wb1'
    env = dict(os.environ, OMP_NUM_THREADS='1', WANDB_MODE='offline', WANDB_SILENT='true')
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                        '--max_iters=3', '--eval_interval=2', '--log_interval=1', '--wandb_log=True'],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = (out / 'wandb').glob('offline-run-*')
    history = read_wandb_history(run)
    expect = {}
    for m in metrics(out):
        row = expect.setdefault(m['iter'], {})
        for k, v in m.items():
            if isinstance(v, list):
                row.update({f'{k}/{b}': x for b, x in enumerate(v)})
            elif v is not None and k != 'iter' and not (k == 'lr' and 'val_loss' in m):
                row[k] = v
        if m.get('block_grad_norm'):
            row['grad_first_last_ratio'] = m['block_grad_norm'][0] / m['block_grad_norm'][-1]
    assert sorted(history) == sorted(expect) == [0, 1, 2, 3]
    for step, row in expect.items():
        logged = {k: v for k, v in history[step].items() if not k.startswith('_')}
        assert sorted(logged) == sorted(row), step
        assert logged == pytest.approx(row), step
