"""
A picture of one training run, or several overlaid, from the metrics.jsonl that train.py
writes: train/val loss and learning rate against tokens, and the per-block depth health
train.py logs every log_interval steps (the gradient norm of each block's parameters and
the RMS of each block's output state, as block x step heatmaps, and the ratio of the first
block's gradient norm to the last's). One PNG.

$ python tools/plot.py out/cpu_attnres                      # -> out/cpu_attnres/metrics.png
$ python tools/plot.py out/cpu_preln out/cpu_attnres --out=compare.png

A ratio far above 1 means the early blocks get much larger gradients than the late ones
(the Pre-LN pattern of late blocks that learn little); far below 1, the reverse.
"""

import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np


def read_metrics(path):
    """Rows of a run's metrics.jsonl (path: the file or the run's directory), as dicts in file
    order. A line cut off by a crash mid-write is skipped. Raises FileNotFoundError for a
    missing file, ValueError (naming the file) when it holds no row."""
    if os.path.isdir(path):
        path = os.path.join(path, 'metrics.jsonl')
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: give a run directory of train.py (its out_dir) "
                                f"or a metrics.jsonl file")
    rows = []
    with open(path, encoding='utf-8') as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and 'iter' in row:
                rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no metrics rows (did the run start training?)")
    return rows


def series(rows, key):
    """(tokens, values) of the rows that have `key`, as numpy arrays (values may be 2-D)."""
    sel = [r for r in rows if key in r and r[key] is not None]
    return np.array([r['tokens'] for r in sel], dtype=float), np.array([r[key] for r in sel], dtype=float)


def block_matrix(rows, key):
    """(tokens (S,), matrix (n_blocks, S)) of a per-block key over the S train rows that log it;
    (None, None) if no row does (e.g. a run sharded with FSDP)."""
    sel = [r for r in rows if r.get(key)]
    if not sel:
        return None, None
    n = len(sel[-1][key])
    sel = [r for r in sel if len(r[key]) == n]  # one model per run: all rows have n blocks
    return np.array([r['tokens'] for r in sel], dtype=float), np.array([r[key] for r in sel], dtype=float).T


def _edges(x):
    """Cell edges around the centres x (S,) for pcolormesh: midpoints, extended at both ends."""
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[1:] + x[:-1]) / 2
    return np.concatenate([[2 * x[0] - mid[0]], mid, [2 * x[-1] - mid[-1]]])


def plot_runs(runs, out_path, labels=None):
    """Draw the runs (a list of run directories or metrics.jsonl paths) into one PNG at out_path
    (written to a temporary file and renamed). Returns the matplotlib Figure.
    Raises FileNotFoundError / ValueError as read_metrics."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import EngFormatter

    data = [read_metrics(r) for r in runs]
    labels = labels or [os.path.basename(os.path.normpath(r if os.path.isdir(r) else os.path.dirname(r) or '.'))
                        for r in runs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    n = len(data)
    fig = plt.figure(figsize=(15, 4.2 + 3.2 * n), layout='constrained')
    grid = fig.add_gridspec(1 + n, 6, height_ratios=[1.3] + [1] * n)
    ax_loss, ax_lr, ax_ratio = (fig.add_subplot(grid[0, 2 * i:2 * i + 2]) for i in range(3))

    for i, (rows, label) in enumerate(zip(data, labels)):
        c = colors[i % len(colors)]
        t, train = series(rows, 'train_loss')
        ax_loss.plot(t, train, color=c, alpha=0.45, lw=1, label=f"{label} train")
        t, val = series(rows, 'val_loss')
        if len(t):
            ax_loss.plot(t, val, 'o-', color=c, ms=4, lw=1.8, label=f"{label} val ({val[-1]:.3f})")
        # the training rows' lr (the rate each step used); an evaluation row's is the next step's
        t, lr = series([r for r in rows if 'train_loss' in r] or rows, 'lr')
        ax_lr.plot(t, lr, color=c, label=label)
        t, g = block_matrix(rows, 'block_grad_norm')
        if t is not None:
            ax_ratio.plot(t, g[0] / np.maximum(g[-1], 1e-12), color=c, label=label)
    ax_loss.set(title='loss (nats)', xlabel='tokens', ylabel='cross-entropy')
    ax_lr.set(title='learning rate', xlabel='tokens')
    ax_ratio.set(title='gradient norm: first block / last block', xlabel='tokens', yscale='log')
    ax_ratio.axhline(1.0, color='grey', lw=0.8, ls=':')
    for ax in (ax_loss, ax_lr, ax_ratio):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    if not ax_ratio.has_data():
        ax_ratio.text(0.5, 0.5, 'no per-block statistics logged', ha='center', va='center',
                      transform=ax_ratio.transAxes)

    norms = {}  # one colour scale per statistic, shared by the runs: their heatmaps compare
    for key in ('block_grad_norm', 'block_act_rms'):
        values = np.concatenate([m[m > 0].ravel() for m in (block_matrix(rows, key)[1] for rows in data)
                                 if m is not None] or [np.zeros(0)])
        norms[key] = LogNorm(vmin=values.min(), vmax=values.max()) if values.size and \
            values.max() > values.min() else None
    heatmaps = []
    for i, (rows, label) in enumerate(zip(data, labels)):
        for j, (key, title) in enumerate((('block_grad_norm', 'gradient norm per block'),
                                          ('block_act_rms', 'activation RMS per block (block output)'))):
            ax = fig.add_subplot(grid[1 + i, 3 * j:3 * j + 3])
            t, m = block_matrix(rows, key)
            ax.set(title=f"{label}: {title}", xlabel='tokens', ylabel='block')
            if t is None:
                ax.text(0.5, 0.5, 'not logged', ha='center', va='center', transform=ax.transAxes)
                continue
            heatmaps.append(ax)
            blocks = np.arange(m.shape[0] + 1) - 0.5  # block b is the row centred on b
            mesh = ax.pcolormesh(_edges(t), blocks, np.where(m > 0, m, np.nan), norm=norms[key], cmap='viridis',
                                 shading='flat')
            ax.set_yticks(range(m.shape[0]) if m.shape[0] <= 16 else
                          range(0, m.shape[0], math.ceil(m.shape[0] / 16)))
            fig.colorbar(mesh, ax=ax, pad=0.01)

    for ax in [ax_loss, ax_lr, ax_ratio] + heatmaps:
        ax.xaxis.set_major_formatter(EngFormatter(sep=''))  # 300k, 1.2M tokens

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    # a temporary name of its own, so that two plots of one run never write the same file
    fd, tmp = tempfile.mkstemp(suffix='.png', prefix='.plot-', dir=os.path.dirname(os.path.abspath(out_path)))
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    plt.close(fig)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split('\n\n')[0])
    p.add_argument('runs', nargs='+', metavar='RUN', help="run directories (train.py out_dir) or metrics.jsonl files")
    p.add_argument('--out', default=None,
                   help="PNG to write; default: RUN/metrics.png for one run, runs.png for several")
    p.add_argument('--labels', nargs='+', default=None, help="one legend label per run; default: directory names")
    args = p.parse_args(argv)
    out = args.out or (os.path.join(args.runs[0] if os.path.isdir(args.runs[0]) else
                                    os.path.dirname(args.runs[0]) or '.', 'metrics.png')
                       if len(args.runs) == 1 else 'runs.png')
    if not out.endswith('.png'):
        raise ValueError(f"--out={out}: the figure is a PNG; give a .png path")
    plot_runs(args.runs, out, args.labels)
    print(f"wrote {out}")
    return out


if __name__ == '__main__':
    try:
        main()
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
