"""bench.py's --suite=gpu (run at toy shapes on the CPU, as on a GPU it runs at 400M) and
--suite=compile (its table and argument checks; a real cold compile takes minutes), and the
compiled depth reads: windows of sources as nested compile regions, the eager gradients.
Run: python -m pytest tests/test_bench_gpu.py -q"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402
import ops  # noqa: E402
from compile_check import assert_compiled_matches_eager  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


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


@pytest.mark.parametrize('n', [1, 3, 4, 5, 8, 9, 11])
def test_chunk_windows_cover_every_source_once(n):
    """Every window has exactly `chunk` sources (n < chunk: one short window) and, skipping
    the first `skip` of each, the windows cover 0..n-1 once, in order."""
    wins = ops.chunk_windows(n, 4)
    covered = [i for start, skip in wins for i in range(start + skip, min(start + 4, n))]
    assert covered == list(range(n))
    assert n < 4 or all(start + 4 <= n for start, _ in wins)


def test_chunked_reads_equal_the_formulas():
    """The compiled forms (float64, windows of 4) against the references, with gradients."""
    torch.manual_seed(0)
    for n in (2, 4, 7, 9):
        src = [torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True) for _ in range(n)]
        inv = [torch.rand(2, 3, 1, dtype=torch.float64) + 0.5 for _ in range(n)]
        w, g = (torch.randn(6, dtype=torch.float64, requires_grad=True) for _ in range(2))
        z, a = ops.depth_mix_chunked(src, inv, w, g, chunk=4)
        z2, a2 = ops.depth_mix_reference(src, inv, w, g)
        torch.testing.assert_close((z, a), (z2, a2))
        for x, y in zip(torch.autograd.grad(z.square().sum(), src + [w, g]),
                        torch.autograd.grad(z2.square().sum(), src + [w, g])):
            torch.testing.assert_close(x, y)
        q = torch.randn(2, 2, 2, 5, 4, dtype=torch.float64)
        K = [torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(n)]
        V = [torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(n)]
        torch.testing.assert_close(ops.depth_read_chunked(q, 0.5, K, V, chunk=4),
                                   ops.DepthReadFunction.apply(q, 0.5, *K, *V))


@pytest.mark.slow
@pytest.mark.parametrize('residual', ['attnres', 'blockattnres', 'moda'])
def test_compiled_depth_reads_one_graph_few_regions(residual, monkeypatch):
    """With windows of 4, a 4-block model's reads (up to 9 sources, 6 depth slots) use full
    and overlapping windows; compiled: one graph, no break, no recompile, eager gradients,
    (the eager forms are DepthMixFunction and DepthReadFunction, so this compares the two forms)."""
    monkeypatch.setattr(ops, 'DEPTH_CHUNK', 4)
    cfg = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=31, residual=residual,
                    attnres_blocks=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():  # non-zero queries: non-uniform depth weights
        for p in model.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    assert_compiled_matches_eager(model, torch.randint(0, 31, (2, 16)), rtol=1e-4, atol=1e-5)
