"""The staged GPU check (tools/gpu_check.py) at tiny shapes on the CPU,
as on a GPU it runs at 400M: every stage appends its line when it ends; a stage cut short by
its time limit leaves the earlier lines whole and the later stages run; and bench.py's
--suite=compile table and argument checks (a real cold compile takes minutes).
Run: python -m pytest tests/test_bench_gpu.py -q"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402
from test_train import data_dir  # noqa: E402,F401  (the tiny corpus fixture)
from tools import gpu_check  # noqa: E402


def stages(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_gpu_check_runs_every_stage_at_tiny_shapes(data_dir, tmp_path):  # noqa: F811
    """tools/gpu_check.py --tiny (fast paths on, as on a GPU): env, the headline train.py run,
    Pre-LN, the reads and one other scheme, each a line of the JSONL (and a paragraph of the
    .md) with what it measured."""
    out = tmp_path / 'gpu.jsonl'
    rows = gpu_check.main(['--tiny', '--device=cpu', '--fast=True', '--steps=3', '--schemes=hc', f'--out={out}',
                           f'--data_dir={data_dir}'])
    got = stages(out)
    assert got == json.loads(json.dumps(rows))
    assert [r['stage'] for r in got] == ['env', 'headline', 'preln', 'reads', 'scheme hc']
    assert all(r['status'] == 'ok' for r in got), [(r['stage'], r.get('tail')) for r in got]
    env = got[0]['result']
    assert env['torch'] == torch.__version__ and env['torch_ok'] and env['peak_flops'] is None
    assert set(env['packages']) >= {'fla', 'liger_kernel', 'triton'} and env['imports']['fast'] == 'ok'
    assert env['fast_paths']['attnres'] == ['attnres_group_torch']  # --fast=True on the CPU: the torch forms
    head = got[1]['result']
    assert head['config'] == 'config/attnres_L32.py' and head['steps_done'] == 3
    assert 'checked against residuals.py' in head['fast_paths']  # the start-up guard ran and passed
    assert head['tokens_per_s'] > 0 and head['mfu'] is None and head['first_step_s'] >= 0
    assert got[2]['result']['attnres_vs_preln_tokens_per_s'] > 0
    reads = got[3]['result']['reads']
    assert set(reads['attnres depth reads, 6 reads']) == {'plain', 'attnres_group_torch'}
    assert all(isinstance(ms, float) for row in reads.values() for ms in row.values())
    md = (tmp_path / 'gpu.md').read_text()
    assert md.count('## ') == 5 and 'AttnRes / Pre-LN tokens/s' in md


@pytest.mark.slow
def test_a_stage_cut_short_keeps_what_came_before(data_dir, tmp_path):  # noqa: F811
    """The Pre-LN stage gets 1 s: it is killed (process group and all) and recorded as 'timeout'
    with its last lines; the env and headline lines written before it are whole, and the next
    stages still run. A budget spent before a stage skips it, in one line each."""
    out = tmp_path / 'gpu.jsonl'
    gpu_check.main(['--tiny', '--device=cpu', '--fast=True', '--steps=2', f'--out={out}', f'--data_dir={data_dir}',
                    '--limits=preln=1', '--schemes=hc', '--budget=10000'])
    got = stages(out)
    assert [(r['stage'], r['status']) for r in got] == [('env', 'ok'), ('headline', 'ok'), ('preln', 'timeout'),
                                                        ('reads', 'ok'), ('scheme hc', 'ok')]
    assert got[2]['seconds'] < 10 and 'tail' in got[2] and got[1]['result']['steps_done'] == 2
    assert out.with_suffix('.md').read_text().count('## preln (config/preln_L32.py): timeout') == 1
    out2 = tmp_path / 'spent.jsonl'
    gpu_check.main(['--tiny', '--device=cpu', '--steps=2', f'--out={out2}', f'--data_dir={data_dir}',
                    '--schemes=hc', '--budget=0.5'])
    got = stages(out2)
    assert got[0]['stage'] == 'env' and got[0]['status'] in ('timeout', 'ok')
    assert got[1:] == [dict(stage=s, status='skipped', seconds=0, result=None)
                       for s in ('headline', 'preln', 'reads', 'scheme hc')]


def test_stage_limits_are_checked(capsys):
    assert gpu_check.parse_limits('headline=200,preln=100') == {'headline': 200.0, 'preln': 100.0}
    with pytest.raises(ValueError, match='stages are'):
        gpu_check.parse_limits('compile=10')
    with pytest.raises(SystemExit):
        gpu_check.main(['--limits=nope=1'])
    assert 'stages are' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(['--steps=1'])
    assert '--steps must be >= 2' in capsys.readouterr().err


def test_compile_table_ratios_and_missing_cells():
    rows = [dict(scheme='preln', n_layer=4, compile_cpu_s=50.0, step_ms=10.0, cpu_vs_preln=1.0, step_vs_preln=1.0),
            dict(scheme='attnres', n_layer=4, compile_cpu_s=65.0, step_ms=11.0, cpu_vs_preln=1.3, step_vs_preln=1.1),
            dict(scheme='preln', n_layer=8, compile_cpu_s=70.0, step_ms=20.0, cpu_vs_preln=1.0, step_vs_preln=1.0)]
    lines = bench.format_compile_table(rows).splitlines()
    assert lines[2] == '| preln | 50 (1.00×) | 1.00 | 70 (1.00×) | 1.00 |'
    assert lines[3] == '| attnres | 65 (1.30×) | 1.10 | not measured | – |'


@pytest.mark.parametrize('argv, msg', [
    (['--suite=nope'], "suite='nope'"),
    (['--suite=gpu'], 'the GPU check is tools/gpu_check.py'),  # one entry point per tool
    (['--suite=compile', '--compile_layers=4,x'], 'compile_layers'),
    (['--suite=compile', '--compile_schemes=preln,nope'], 'unknown scheme(s) nope'),
])
def test_suite_arguments_are_checked(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert msg in str(e.value)
