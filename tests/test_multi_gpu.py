"""Multi-GPU correctness and cost, on the CPU: FSDP2 gathers each weight once per forward and
once per backward, also for MoDA, which calls the attention's projections one by one; with DDP
and compiled regions no scheme-sized tensor crosses a graph split; the MFU table's peak per
device name, and no MFU for a name it does not know. The two-process runs use gloo under
torchrun and tests/dist_record.py, which counts FSDP's all-gathers and DDPOptimizer's splits.
Run: python -m pytest tests/test_multi_gpu.py -q"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'tests'))

import model  # noqa: E402
from test_train import TINY, data_dir, metrics, train, train_losses  # noqa: E402,F401


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


@pytest.mark.parametrize('name, peak', [
    ('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H100 NVL', 835e12),
    ('NVIDIA H200', 989e12), ('NVIDIA H200 NVL', 835e12), ('NVIDIA GH200 480GB', 989e12),
    ('NVIDIA A100-SXM4-80GB', 312e12), ('NVIDIA A100 80GB PCIe', 312e12), ('NVIDIA B200', 2250e12),
    ('NVIDIA L40S', 362e12), ('NVIDIA L4', 121e12), ('NVIDIA A10', 125e12),
    ('NVIDIA GB200', None), ('NVIDIA A10G', None), ('NVIDIA H20', None), ('Tesla V100-SXM2-32GB', None),
    ('NVIDIA RTX PRO 6000 Blackwell', None), ('Some Future GPU', None),
])
def test_mfu_peak_per_device_name(name, peak, monkeypatch):
    """The dense bf16 peak of each name (a variant before its family: H100 PCIe is not an
    H100 SXM, GB200 is not a B200), and None, hence no MFU, for one the table does not know."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: name)
    assert model.peak_flops('cuda') == peak
    gpt = model.GPT(model.GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    mfu = model.estimate_mfu(gpt, 1e6, 16, 'cuda')
    assert (mfu is None) == (peak is None)
    if peak:
        assert mfu == pytest.approx(gpt.flops_per_token(16) * 1e6 / peak)
    assert model.peak_flops('cpu') is None
