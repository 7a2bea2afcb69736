"""tools/gpu_check.py's preparation and carried install, dry-run on the CPU at tiny shapes: the
folder --prepare makes (wheels, data, carry.json), its wheels installed beside this Python's
packages (a torch wheel refused), the summary JSON rewritten after every stage with each
scheme's step ratio to Pre-LN, and the loud line when fla-core or liger-kernel is missing on CUDA.
Run: python -m pytest tests/test_gpu_check.py -q"""

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_train import data_dir  # noqa: E402,F401  (the tiny corpus fixture)
from tools import gpu_check  # noqa: E402


def wheel(folder, name, version='0.1'):
    """A minimal pure-Python wheel of one module `name` holding VALUE = 7."""
    path = folder / f'{name}-{version}-py3-none-any.whl'
    info = f'{name}-{version}.dist-info'
    with zipfile.ZipFile(path, 'w') as z:
        z.writestr(f'{name}.py', 'VALUE = 7\n')
        z.writestr(f'{info}/METADATA', f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
        z.writestr(f'{info}/WHEEL', 'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n')
        z.writestr(f'{info}/RECORD', '')
    return path


@pytest.mark.slow
def test_prepare_then_carry_then_every_stage_in_the_summary(data_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv('PYTHONPATH', os.environ.get('PYTHONPATH', ''))  # the carried install extends it
    src = tmp_path / 'src'
    src.mkdir()
    req = tmp_path / 'req.txt'
    req.write_text(f"{wheel(src, 'gpucheck_probe')}\n")
    carry = tmp_path / 'carry'
    made = gpu_check.prepare(str(carry), str(req), str(data_dir))
    assert made['wheels'] == ['gpucheck_probe-0.1-py3-none-any.whl']
    wheel(carry / 'wheels', 'torch', '9.9')  # a torch wheel put beside them: never installed
    assert sorted(p.name for p in (carry / 'data').iterdir()) == ['meta.json', 'train.bin', 'val.bin']
    assert json.loads((carry / 'carry.json').read_text()) == made

    out = tmp_path / 'gpu.jsonl'
    gpu_check.main(['--tiny', '--device=cpu', '--fast=True', '--steps=2', f'--carry={carry}', '--schemes=hc',
                    f'--out={out}'])
    summary = json.loads((tmp_path / 'gpu.summary.json').read_text())
    assert summary['done'] and summary['warnings'] == []
    st = summary['stages']
    assert list(st) == ['install', 'env', 'headline', 'preln', 'reads', 'scheme hc']
    assert all(v['status'] == 'ok' for v in st.values()), {k: v.get('tail') for k, v in st.items()}
    assert st['install']['result']['refused'] == ['torch-9.9-py3-none-any.whl']  # never over the machine's torch
    site = Path(st['install']['result']['site'])
    assert (site / 'gpucheck_probe.py').exists() and not (site / 'torch').exists()
    pre = st['preln']['result']
    assert pre['headline_step_vs_preln'] == pytest.approx(pre['tokens_per_s'] / st['headline']['result']['tokens_per_s'])
    assert st['scheme hc']['result']['step_vs_preln'] == pytest.approx(pre['tokens_per_s'] /
                                                                    st['scheme hc']['result']['tokens_per_s'])
    for name in ('headline', 'preln', 'scheme hc'):
        assert f'--data_dir={carry / "data"}' in st[name]['result']['args']  # the carried data
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        dict(stage=k, **v) for k, v in st.items()]  # the summary holds each stage as its line said
    reads = st['reads']['result']['reads']
    assert set(reads['attnres depth reads, 6 reads']) == {'plain', 'attnres_group_torch'}
    assert set(reads['blockattnres depth reads, 6 reads']) == {'plain', 'blockattnres_group_torch'}
    assert set(reads['moda blocks, 3 blocks, micro-batch 2']) == {'plain', 'moda_depth_cache'}
    assert all(isinstance(ms, float) for row in reads.values() for ms in row.values())  # each form ran


def test_missing_kernels_are_said_loudly(tmp_path):
    env = dict(packages=dict(fla=None, liger_kernel='0.8.5'))
    lines = gpu_check.missing_kernels(env, 'cuda')
    assert len(lines) == 1 and lines[0].startswith('fla-core is not importable') and 'torch forms' in lines[0]
    assert gpu_check.missing_kernels(env, 'cpu') == [] and gpu_check.missing_kernels(None, 'cuda') == []
    report = gpu_check.Report(str(tmp_path / 'x.jsonl'))
    report.warn(lines[0])
    assert json.loads((tmp_path / 'x.summary.json').read_text())['warnings'] == lines
    assert (tmp_path / 'x.md').read_text().startswith('**WARNING: fla-core')
    report.add(dict(stage='env', status='ok', seconds=1.0, result={'a': 1}), ['## env'])  # each stage: at once
    assert json.loads((tmp_path / 'x.summary.json').read_text())['stages'] == {
        'env': dict(status='ok', seconds=1.0, result={'a': 1})}


def test_prepare_fails_in_one_line(tmp_path):
    req = tmp_path / 'req.txt'
    req.write_text(f"{tmp_path / 'absent-0.1-py3-none-any.whl'}\n")
    with pytest.raises(RuntimeError, match='pip download'):
        gpu_check.prepare(str(tmp_path / 'c'), str(req), str(tmp_path))
