"""bench.py's --suite=gpu (run at toy shapes on the CPU, as on a GPU it runs at 400M) and
--suite=compile (its table and argument checks; a real cold compile takes minutes).
Run: python -m pytest tests/test_bench_gpu.py -q"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402


def test_gpu_suite_runs_at_tiny_shapes(tmp_path):
    out = tmp_path / 'gpu.json'
    bench.main(['--suite=gpu', '--tiny=True', '--device=cpu', '--gpu_steps=1', '--threads=1', f'--out={out}'])
    res = json.loads(out.read_text())
    assert res['suite'] == 'gpu' and res['environment']['torch'] == torch.__version__
    assert list(res['schemes']) == list(bench.GPU_SCHEMES)
    assert res['schemes']['preln']['step_vs_preln'] == 1.0
    for name, row in res['schemes'].items():
        assert row['fit_batch'] == 4 and row['predicted_peak_bytes'] > 0  # tiny models: the cap, 4, fits
    assert res['attnres_l32_30_steps']['finite'] and res['attnres_l32_30_steps']['batch'] == 4
    assert res['preln_l16']['tokens_per_s'] > 0 and res['preln_l16']['mfu'] is None  # no known peak on a CPU
    assert 'MATH' in res['moda_attention']['backends_null_key']
    md = (tmp_path / 'gpu.md').read_text()
    assert md == res['table'] + '\n'
    assert all(f'| {name} |' in md for name in bench.GPU_SCHEMES)


def test_compile_table_ratios_and_missing_cells():
    rows = [dict(scheme='preln', n_layer=4, compile_cpu_s=50.0, step_ms=10.0, cpu_vs_preln=1.0, step_vs_preln=1.0),
            dict(scheme='attnres', n_layer=4, compile_cpu_s=65.0, step_ms=11.0, cpu_vs_preln=1.3, step_vs_preln=1.1),
            dict(scheme='preln', n_layer=8, compile_cpu_s=70.0, step_ms=20.0, cpu_vs_preln=1.0, step_vs_preln=1.0)]
    lines = bench.format_compile_table(rows).splitlines()
    assert lines[2] == '| preln | 50 (1.00×) | 1.00 | 70 (1.00×) | 1.00 |'
    assert lines[3] == '| attnres | 65 (1.30×) | 1.10 | not measured | – |'


@pytest.mark.parametrize('argv, msg', [
    (['--suite=fast'], "suite='fast'"),
    (['--suite=compile', '--compile_layers=4,x'], 'compile_layers'),
    (['--suite=compile', '--compile_schemes=preln,nope'], 'unknown scheme(s) nope'),
])
def test_suite_arguments_are_checked(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert msg in str(e.value)
