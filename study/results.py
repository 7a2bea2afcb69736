"""
A family's runs on disk (study/families.py): the seeded copies of a run, their status, one
results row per run and seed, the seeds table (mean ± standard error over seeds) and the
figure of validation loss against shape. study/sweep.py trains the runs and study/mini.py
probes and reports the mini family; both read the runs through this file.
"""

import json
import math
import os
import re
import signal
import subprocess
import textwrap

from study import families

ROOT = families.ROOT  # the repo root; every function takes root= for another checkout
BASE_SEED = 1337  # train.py's default seed: seed index 0 is the run exactly as configured


def seeded(run, k):
    """
    The run trained with seed index k (int >= 0): k = 0 is `run` itself; k > 0 is a copy
    named <name>_seed<k> with out_dir <out_dir>_seed<k> and config seed = 1337 + k (the
    initial weights and the data order change; the config file is the same, the sweep
    passes --seed and --out_dir). Raises ValueError for k < 0.
    """
    if k < 0:
        raise ValueError(f"seed index {k} must be >= 0")
    if k == 0:
        return run
    out_dir = f"{run.out_dir}_seed{k}"
    return families.Run(**{**run.__dict__, 'name': f"{run.name}_seed{k}", 'out_dir': out_dir,
                           'config': dict(run.config, out_dir=out_dir, seed=BASE_SEED + k),
                           'info': dict(run.info, seed=k)})


def run_status(run, root=None):
    """'finished' (summary.json with finished true), 'interrupted' (ckpt.pt) or 'new'."""
    out_dir = os.path.join(root or ROOT, run.out_dir)
    summary = _read_json(os.path.join(out_dir, 'summary.json'))
    if summary is not None and summary.get('finished') is True:
        return 'finished'
    if os.path.exists(os.path.join(out_dir, 'ckpt.pt')):
        return 'interrupted'
    return 'new'


running = []  # the child processes running now: study/sweep.py passes a Ctrl-C or SIGTERM on to them


def run_command(cmd, cwd):
    """Run cmd in cwd with its output streaming to ours; return its exit status. The child ignores
    a terminal's Ctrl-C (the sweep passes it on as SIGTERM: train.py says where it resumes,
    probe.py ends without a traceback); an exception here (the sweep's signal) waits for the child
    to end first, so that its files are whole."""
    child = subprocess.Popen(cmd, cwd=cwd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    running.append(child)
    try:
        return child.wait()
    except BaseException:
        child.wait()
        raise
    finally:
        running.remove(child)


def _read_json(path):
    """The JSON object in a file, or None if it is missing or not valid JSON."""
    try:
        with open(path) as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def _read_metrics(path):
    """The JSON objects of a metrics.jsonl, skipping a torn last line; [] if missing."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue  # a line cut short by an interrupted write
                if isinstance(obj, dict):
                    rows.append(obj)
    except OSError:
        pass
    return rows


def read_result(run, root=None):
    """
    One row of results.json for a run: its shape and Pre-LN parameter counts, and
    from out_dir either summary.json (status 'finished'; 'other_length' when it
    finished at another length than the run's config, e.g. a shortened smoke test in the
    study's out_dir: its numbers are kept but no summary or plot counts it), or the last
    eval of metrics.jsonl (status 'unfinished'; val_loss None if it has not evaluated
    yet), or nothing (status 'missing'). Losses in nats per token; n_params is
    train.py's exact count (None until known); params_M the count used in plots;
    'other_length' says how the length differs (length_mismatch).
    """
    row = dict(name=run.name, family=run.family, scheme=run.scheme, L=run.L, d=run.d, ratio=run.ratio,
               dataset=run.config.get('dataset'),
               backbone=run.backbone, total=run.total, out_dir=run.out_dir, config=run.config_path,
               **{k: v for k, v in run.info.items() if k in ('target_total', 'target_ratio', 'shared_with')})
    out_dir = os.path.join(root or ROOT, run.out_dir)
    summary = _read_json(os.path.join(out_dir, 'summary.json'))
    metrics = _read_metrics(os.path.join(out_dir, 'metrics.jsonl'))
    if summary is not None and summary.get('finished') is True:
        row.update(status='finished', val_loss=summary.get('val_loss'), train_loss=summary.get('train_loss'),
                   iter=summary.get('iter'), max_iters=summary.get('max_iters'),
                   tokens=summary.get('tokens'), n_params=summary.get('n_params'))
        why = length_mismatch(run.config, row)
        if why:
            row.update(status='other_length', other_length=why)
    elif metrics or summary is not None or os.path.exists(os.path.join(out_dir, 'ckpt.pt')):
        evals = [m for m in metrics if m.get('val_loss') is not None]
        train = [m for m in metrics if m.get('train_loss') is not None]
        row.update(status='unfinished', val_loss=evals[-1]['val_loss'] if evals else None,
                   train_loss=train[-1]['train_loss'] if train else None,
                   iter=evals[-1].get('iter') if evals else None,
                   max_iters=None, tokens=evals[-1].get('tokens') if evals else None,
                   n_params=(summary or {}).get('n_params'))
    else:
        row.update(status='missing', val_loss=None, train_loss=None, iter=None, max_iters=None,
                   tokens=None, n_params=None)
    n = row['n_params']
    row['params_M'] = (n if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0 else run.total) / 1e6
    return row


def length_mismatch(config, row):
    """How a finished row's training length differs from its config's, or None: the config's
    max_iters when it fixes one; otherwise tokens_per_param x n_params tokens, to within 1%
    (a --batch_size or --gradient_accumulation_steps override moves where the last step ends).
    train.py's summary.json records max_iters, tokens and n_params; one that lacks what the
    check needs is not taken as the planned run."""
    def count(v):  # a whole number (JSON may write it as 491.0)
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v == int(v)
    planned = config.get('max_iters')
    if planned is not None:
        got = row.get('max_iters')
        if not count(got):
            return f"records max_iters={got!r}, not the planned {planned}"
        return None if got == planned else f"finished at max_iters={got}, not the planned {planned}"
    tpp, n, tokens = config.get('tokens_per_param'), row.get('n_params'), row.get('tokens')
    if tpp is None:
        return None
    if not (count(n) and n > 0 and count(tokens)):
        return f"records n_params={n!r} and tokens={tokens!r}: its token budget cannot be checked"
    if abs(tokens / (tpp * n) - 1) <= 0.01:
        return None
    return f"trained {tokens / n:.3g} tokens per parameter, not the planned {tpp:g}"


def seed_runs(run, root=None, seeds=1):
    """The seeded copies of a run: seed indices 0..seeds-1, and any further <out_dir>_seed<k>
    present on disk, in order (seed 0, the run itself, first)."""
    base = os.path.join(root or ROOT, run.out_dir)
    parent, name = os.path.dirname(base), os.path.basename(base)
    ks = []
    if os.path.isdir(parent):
        for entry in os.listdir(parent):
            m = re.fullmatch(re.escape(name) + r'_seed(\d+)', entry)
            if m and int(m.group(1)) > 0:
                ks.append(int(m.group(1)))
    return [seeded(run, k) for k in sorted(set(ks) | set(range(seeds)))]


def summarize(rows):
    """
    Mean and standard error over seeds of the validation loss of each (scheme, L): rows
    (read_result's, with 'seed') -> list of {scheme, L, d, ratio, params_M, n_seeds, mean, se,
    values, seeds}. Only finished runs count; se = sample std (n - 1) / sqrt(n), None for one
    seed; a shape with no finished seed is left out.
    """
    groups = {}
    for r in rows:
        if r['status'] == 'finished' and r['val_loss'] is not None:
            groups.setdefault((r['scheme'], r['L']), []).append(r)
    out = []
    for (scheme, L), rs in groups.items():
        v = [r['val_loss'] for r in rs]
        n = len(v)
        mean = sum(v) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1) / n) if n > 1 else None
        out.append(dict(scheme=scheme, L=L, d=rs[0]['d'], ratio=rs[0]['ratio'], params_M=rs[0]['params_M'],
                        n_seeds=n, mean=mean, se=se, values=v, seeds=[r.get('seed', 0) for r in rs]))
    return out


def read_all(family, root=None, seeds=1):
    """read_result of every run of a family and of each of its seeds (seed_runs), with 'seed'."""
    return [dict(read_result(r, root), seed=r.info.get('seed', 0))
            for run in families.runs(family) for r in seed_runs(run, root, seeds)]


def format_summary(rows):
    """The seeds table as markdown: one row per depth L (d/L), one column per scheme, each cell
    mean ± s.e. (n seeds) of the validation loss; then, per shape, the difference of every
    scheme to the best one and the depth cost L -> 2L with their standard errors
    (sqrt(se1² + se2²), independent runs), marked * when larger than 2 s.e."""
    summ = summarize(rows)
    if not summ:
        return "no finished run"
    schemes = _schemes_in(summ)
    cell = {(s['scheme'], s['L']): s for s in summ}
    Ls = sorted({s['L'] for s in summ})
    fmt = lambda s: ('–' if s is None else f"{s['mean']:.3f}" + (f" ± {s['se']:.3f}" if s['se'] is not None else '')
                     + f" ({s['n_seeds']})")
    lines = ["| L (d/L) | " + " | ".join(schemes) + " |", "|---" * (len(schemes) + 1) + "|"]
    for L in Ls:
        ratio = next(s['ratio'] for s in summ if s['L'] == L)
        lines.append(f"| {L} ({ratio:.0f}) | " + " | ".join(fmt(cell.get((sc, L))) for sc in schemes) + " |")

    def diff(a, b):  # a - b with its standard error
        if a is None or b is None:
            return None
        se = math.sqrt((a['se'] or 0) ** 2 + (b['se'] or 0) ** 2) if a['se'] is not None and b['se'] is not None else None
        d = a['mean'] - b['mean']
        return f"{d:+.3f}" + ('' if se is None else f" ± {se:.3f}" + (' *' if abs(d) > 2 * se else ''))
    for L1, L2 in zip(Ls, Ls[1:]):
        lines.append(f"| L {L1} → {L2} | " + " | ".join(diff(cell.get((sc, L2)), cell.get((sc, L1))) or '–'
                                                       for sc in schemes) + " |")
    lines.append("")
    for L in Ls:
        have = [cell[(sc, L)] for sc in schemes if (sc, L) in cell]
        best = min(have, key=lambda s: s['mean'])
        parts = [f"{s['scheme']} {diff(s, best)}" for s in have if s is not best]
        lines.append(f"L = {L}: best {best['scheme']}; others " + ", ".join(parts))
    lines.append("(± = standard error over seeds; * = difference larger than 2 standard errors)")
    return "\n".join(lines)


def _plt():
    import matplotlib
    matplotlib.use('Agg')  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def _scheme_color(scheme):
    """A fixed colour per scheme, the same in every panel and figure."""
    order = list(families.SCHEME_LR)
    i = order.index(scheme) if scheme in order else len(order)
    return f"C{i}" if i < 10 else _plt().colormaps['tab20'](2 * (i - 10) + 1)


def _schemes_in(rows):
    order = list(families.SCHEME_LR)
    return sorted(dict.fromkeys(r['scheme'] for r in rows), key=lambda s: order.index(s) if s in order else 99)


def _with_loss(rows):
    """The rows a plot draws: a loss, and trained at the planned length (finished or not yet)."""
    return [r for r in rows if r['val_loss'] is not None and r['status'] != 'other_length']


def _loss_label(rows):
    # byte-level datasets predict bytes, not tokens
    byte = rows and all(str(r.get('dataset', '')).endswith('_byte') for r in rows)
    return 'validation loss (nats / byte)' if byte else 'validation loss (nats / token)'


def plot_loss_vs_ratio(panels, path):
    """
    Validation loss vs d/L (log axis), one line per scheme, one subplot per (title, rows)
    panel. Several seeds of a run: the mean with ± 1 standard-error bars and each seed as a
    small dot; unfinished runs (one seed) drawn hollow; rows as _with_loss keeps them (no run of
    another length). Each shape's Pre-LN parameter count
    is written under its tick. Writes a PNG to path.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.9), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        summ = {(s['scheme'], s['L']): s for s in summarize(rows)}
        schemes = _schemes_in(rows)
        for k, scheme in enumerate(schemes):
            color = _scheme_color(scheme)
            shift = 1 + 0.015 * (k - (len(schemes) - 1) / 2)  # a small x offset per scheme: bars stay apart
            pts = []
            for L in sorted({r['L'] for r in rows if r['scheme'] == scheme}):
                mine = [r for r in rows if r['scheme'] == scheme and r['L'] == L]
                s = summ.get((scheme, L))
                x = mine[0]['ratio'] * shift
                if s is None:  # no finished seed: the latest eval of an unfinished one, if past step 0
                    last = max(mine, key=lambda r: r['iter'] or 0)
                    if last['iter']:
                        pts.append((x, last['val_loss'], None, False))
                else:
                    pts.append((x, s['mean'], s['se'], True))
                    if s['n_seeds'] > 1:
                        ax.plot([x] * s['n_seeds'], s['values'], '.', color=color, ms=3, alpha=0.5)
            if not pts:  # every run of this scheme left out: no legend entry without a point
                continue
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], '-', color=color, label=scheme)
            for x, y, se, done in pts:
                ax.errorbar(x, y, yerr=se, fmt='o', color=color, mfc=color if done else 'white', capsize=3)
        ax.set_xscale('log')
        ratios = sorted({r['ratio'] for r in rows})
        first = {x: next(r for r in rows if r['ratio'] == x) for x in ratios}
        ax.set_xticks(ratios, [f"{x:.0f}\nL={first[x]['L']}\n{_millions_label(first[x]['params_M'])}"
                               for x in ratios], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel('d/L (wide, shallow  ->  right); Pre-LN parameters under each shape')
        ax.set_ylabel(_loss_label(rows))
        ax.set_title(textwrap.fill(title, 64), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    n = max((s['n_seeds'] for (_, rows) in panels for s in summarize(rows)), default=1)
    note = (f"mean of up to {n} seeds, bars ± 1 standard error, dots = single seeds; " if n > 1 else "") + \
        "hollow = unfinished (last eval)"
    fig.suptitle(note, fontsize=8, y=0.01, va='bottom')
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _millions_label(m):
    return f"{m:.0f}M" if m >= 10 else f"{m:.2f}M"


def _budget(rows):
    """' , <x> tokens per backbone parameter (as trained)' from the finished rows, '' if none."""
    per = [r['tokens'] / r['backbone'] for r in rows if r['status'] == 'finished' and r.get('tokens') and r.get('backbone')]
    if not per:
        return ''
    lo, hi = min(per), max(per)
    return f"; trained on {lo:.2g} tokens per backbone parameter" if hi - lo < 0.05 * hi else \
        f"; trained on {lo:.2g}-{hi:.2g} tokens per backbone parameter"


def plot_loss_vs_size(rows, path):
    """
    Validation loss vs total parameters (log axis), one subplot per scheme, one line
    per target d/L (cross-scale family, paper Tables 7–9; docs/families.md). Writes a PNG to path.
    """
    plt = _plt()
    schemes = _schemes_in(rows)
    fig, axes = plt.subplots(1, len(schemes), figsize=(5.5 * len(schemes), 4.5), squeeze=False, sharey=True)
    for ax, scheme in zip(axes[0], schemes):
        mine = [r for r in rows if r['scheme'] == scheme]
        for ratio in sorted({r['target_ratio'] for r in mine}):
            pts = sorted((r for r in mine if r['target_ratio'] == ratio), key=lambda r: r['params_M'])
            color = f"C{families.CROSS_SCALE_RATIOS.index(ratio) % 10}" if ratio in families.CROSS_SCALE_RATIOS else 'k'
            ax.plot([r['params_M'] for r in pts], [r['val_loss'] for r in pts], '-', color=color,
                    label=f"d/L ≈ {ratio}")
            for r in pts:
                done = r['status'] == 'finished'
                ax.plot(r['params_M'], r['val_loss'], 'o', color=color, mfc=color if done else 'white')
        ax.set_xscale('log')
        ax.set_xlabel('total parameters (M)')
        ax.set_title(scheme)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel('validation loss (nats/token)')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
