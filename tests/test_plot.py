"""tools/plot.py on metrics files the test writes: the figure shows exactly the logged values (the
loss and LR curves, the first/last gradient ratio, the block x step heatmaps), one run or
several, and bad inputs are one line. Run: python -m pytest tests/test_plot.py -q"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools import plot  # noqa: E402


def write_run(path, n_layer=3, steps=(10, 20, 30, 40), scale=1.0, cut_off=True):
    """A metrics.jsonl as train.py writes it: eval rows (val_loss) and train rows with the
    per-block arrays; block b's gradient norm is scale * (b + 1) * step, its RMS 1 + b."""
    rows = [{'iter': 0, 'tokens': 0, 'val_loss': 10.0, 'lr': 0.0}]
    for s in steps:
        rows.append({'iter': s, 'tokens': 100 * s, 'train_loss': 10.0 - s / 10, 'lr': 1e-3 * s, 'grad_norm': 1.0,
                     'block_grad_norm': [scale * (b + 1) * s for b in range(n_layer)],
                     'block_act_rms': [1.0 + b for b in range(n_layer)]})
    rows.append({'iter': steps[-1], 'tokens': 100 * steps[-1], 'val_loss': 6.0, 'lr': 1e-3 * steps[-1]})
    path.mkdir(parents=True, exist_ok=True)
    text = ''.join(json.dumps(r) + '\n' for r in rows) + ('{"iter": 50, "tok' if cut_off else '')  # a crash mid-write
    (path / 'metrics.jsonl').write_text(text)
    return path


def line(ax, label):
    [ln] = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return np.asarray(ln.get_xdata(), float), np.asarray(ln.get_ydata(), float)


def test_one_run_draws_the_logged_values(tmp_path):
    run = write_run(tmp_path / 'cpu_attnres')
    out = tmp_path / 'fig.png'
    fig = plot.plot_runs([str(run)], str(out))
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    loss, lr, ratio = fig.axes[:3]
    x, y = line(loss, 'cpu_attnres train')
    assert np.allclose(x, [1000, 2000, 3000, 4000]) and np.allclose(y, [9, 8, 7, 6])
    x, y = line(loss, 'cpu_attnres val (6.000)')
    assert np.allclose(x, [0, 4000]) and np.allclose(y, [10, 6])
    x, y = line(lr, 'cpu_attnres')
    assert np.allclose(x, [1000, 2000, 3000, 4000]) and np.allclose(y, [.01, .02, .03, .04])  # the training rows'
    x, y = line(ratio, 'cpu_attnres')
    assert np.allclose(y, 1 / 3)  # (1 * s) / (3 * s): first block over last, at every step
    heat = [ax for ax in fig.axes if 'per block' in ax.get_title()]
    assert [ax.get_title() for ax in heat] == ['cpu_attnres: gradient norm per block',
                                               'cpu_attnres: activation RMS per block (block output)']
    grad = heat[0].collections[0].get_array().reshape(3, 4)  # (blocks, steps)
    assert np.allclose(grad, [[(b + 1) * s for s in (10, 20, 30, 40)] for b in range(3)])
    rms = heat[1].collections[0].get_array().reshape(3, 4)
    assert np.allclose(rms, [[1 + b] * 4 for b in range(3)])


def test_several_runs_overlay_and_share_colour_scales(tmp_path):
    a, b = write_run(tmp_path / 'a'), write_run(tmp_path / 'b', n_layer=2, scale=10.0, cut_off=False)
    fig = plot.plot_runs([str(a), str(b / 'metrics.jsonl')], str(tmp_path / 'both.png'), labels=['A', 'B'])
    assert {ln.get_label() for ln in fig.axes[2].get_lines()} >= {'A', 'B'}
    assert np.allclose(line(fig.axes[2], 'B')[1], 1 / 2)
    heat = [ax for ax in fig.axes if 'gradient norm per block' in ax.get_title()]
    assert [ax.get_title().split(':')[0] for ax in heat] == ['A', 'B']
    norms = [ax.collections[0].norm for ax in heat]
    assert norms[0].vmin == norms[1].vmin == 10 and norms[0].vmax == norms[1].vmax == 10 * 2 * 40


def test_cli_default_output_and_one_line_errors(tmp_path):
    run = write_run(tmp_path / 'r')
    r = subprocess.run([sys.executable, 'tools/plot.py', str(run)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (run / 'metrics.png').exists(), r.stderr
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'empty' / 'metrics.jsonl').write_text('')
    for args, words in (([str(tmp_path / 'none')], ['none', 'not found']),
                        ([str(tmp_path / 'empty')], ['no metrics rows']),
                        ([str(run), '--out=fig.pdf'], ['PNG'])):
        with pytest.raises((FileNotFoundError, ValueError)) as e:
            plot.main(args)
        assert all(w in str(e.value) for w in words) and '\n' not in str(e.value)
