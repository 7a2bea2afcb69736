"""
The mini study's figures (docs/mini.md), drawn from a results dict (study/mini.py collect) and
its findings rows:

    plot_loss(results, rows, 'loss_vs_ratio.png')     # loss against depth; the paired loss findings
    plot_probes(results, rows, 'probes.png', 15)      # the L = 8 probe numbers; the paired probe findings
    plot_ladder(results, ladder, 'ladder.png')        # each gap to Pre-LN against tokens per parameter

Bars are 95% Student t-intervals over seeds; the paper's effects are drawn on this study's
scale two ways, as a fraction of loss and in nats per byte (mini.paper_here).
"""

from study import families, stats
from study.results import _plt, _scheme_color

PAPER_MARKS = (('F', 'x', "the paper's effect as a fraction of loss"),
               ('B', '+', "the paper's effect in nats per byte"))


def _finished(runs):
    return [r for r in runs if r['status'] == 'finished' and r['val_loss'] is not None]


def _t_interval(vals):
    """(mean, half-width of the 95% Student interval, n) of a list; half-width None below 2 values."""
    t = stats.t_test(vals)
    return t['mean'], (None if t['hi'] is None else t['hi'] - t['mean']), t['n']


def plot_loss(results, rows, path):
    """
    Two panels. Left: validation loss against depth L (log axis) per scheme, the mean over
    seeds with its 95% t-interval (unpaired: the spread of single runs) and a dot per seed.
    Right: the paired loss findings (rows: mini.findings()'s), mean with its 95% t-interval, and
    the paper's effect on this scale where it has one: as a fraction of loss (x) and in nats per
    byte (+). Writes a PNG to path.
    """
    plt = _plt()
    done = _finished(results['runs'])
    if not done:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw=dict(width_ratios=(1, 1.25)))
    schemes = [s for s in families.MINI_SCHEMES if any(r['scheme'] == s for r in done)]
    for j, s in enumerate(schemes):
        Ls = sorted({r['L'] for r in done if r['scheme'] == s})
        shift = 2 ** (0.04 * (j - (len(schemes) - 1) / 2))  # a small offset per scheme: bars stay apart
        pts = []
        for L in Ls:
            vals = [r['val_loss'] for r in done if r['scheme'] == s and r['L'] == L]
            m, h, n = _t_interval(vals)
            pts.append((L * shift, m, h, n))
            ax.plot([L * shift] * n, vals, '.', color=_scheme_color(s), ms=3, alpha=0.5)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], '-', color=_scheme_color(s), label=s)
        for x, m, h, n in pts:
            ax.errorbar(x, m, yerr=h, fmt='o', color=_scheme_color(s), capsize=3)
            ax.annotate(f"{n}", (x, m), textcoords='offset points', xytext=(4, -9), fontsize=6, color=_scheme_color(s))
    ax.set_xscale('log', base=2)
    Ls = sorted({r['L'] for r in done})
    first = {L: next(r for r in done if r['L'] == L) for L in Ls}
    ax.set_xticks(Ls, [f"L = {L}\nd = {first[L]['d']}\nd/L = {first[L]['ratio']:.0f}" for L in Ls], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel('depth L (log scale, base 2); the backbone grows with L (title)')
    ax.set_ylabel('validation loss (nats / byte)')
    ax.set_title('loss per run shape: mean over seeds, bars = 95% t-interval\n'
                 '(unpaired), dots = single seeds, small numbers = seeds', fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    loss_rows = [r for r in rows if r['statistic'].startswith(('loss', 'depth cost'))]
    marked = [i for i, r in enumerate(loss_rows) if r['here']]
    for i, r in enumerate(loss_rows):
        y = len(loss_rows) - 1 - i
        if r['mean'] is not None:
            h = None if r['hi'] is None else r['hi'] - r['mean']
            bx.errorbar(r['mean'], y, xerr=h, fmt='o', color='k', capsize=3)
        for key, mark, label in PAPER_MARKS:  # one legend entry each, on the first marked row
            if r['here'] and r['here'].get(key) is not None:
                bx.plot(r['here'][key], y, mark, color='C3', ms=8, mew=2, label=label if i == marked[0] else None)
    bx.axvline(0, color='gray', lw=0.8)
    bx.set_yticks(range(len(loss_rows)), [_fill(f"{r['finding']} (n = {r['n']})", 52)
                                          for r in reversed(loss_rows)], fontsize=6.5)
    bx.set_xlabel('paired difference in validation loss (nats / byte); < 0: lower loss')
    bx.set_title('paired loss findings: mean over seeds, bars = 95% t-interval\n(per row, before Holm\'s correction)', fontsize=9)
    bx.grid(axis='x', alpha=0.3)
    if marked:
        bx.legend(fontsize=7, loc='lower right')
    sizes = sorted({(r['L'], r['backbone'], r['total']) for r in done})
    fig.suptitle(f"mini-DepthBench: byte-level text, {results['tokens_per_backbone_param']:g} tokens per backbone "
                 f"parameter; backbone {sizes[0][1] / 1e6:.2f}-{sizes[-1][1] / 1e6:.2f}M, Pre-LN total "
                 f"{sizes[0][2] / 1e6:.2f}-{sizes[-1][2] / 1e6:.2f}M parameters across L", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fill(text, width):
    import textwrap
    return textwrap.fill(text, width)


def plot_probes(results, rows, path, n_late):
    """
    Top: the deepest models' probe numbers per scheme, bars = mean over seeds with its 95%
    t-interval (unpaired), dots = seeds; n_late: the late pairs at that depth. Bottom: the
    paired probe findings (rows: mini.findings()'s) against Pre-LN, mean with its 95% t-interval. No paper marks: the paper
    measures 400M models at L = 32 (erank across its shapes), not comparable to these models.
    """
    plt = _plt()
    pr = results['probes']
    L = results['deepest']
    panels = [('R_causal', f'late pairs with causal score > 0.45\n(of {n_late} at L = {L})',
               'share of late pairs'),
              ('R_perm', f'late pairs with permutation score > 0.15\n(of {n_late} at L = {L})',
               'share of late pairs'),
              ('prune_late', 'drop one late block\n(mean over blocks l >= L/4)', 'held-out loss added (nats / byte)'),
              ('erank', 'effective rank of the composed residual map\n(at most m = 4; 4 = identity init)',
               'effective rank')]
    fig = plt.figure(figsize=(17, 8.6), layout='constrained')
    top, bottom = fig.subfigures(2, 1, height_ratios=(1, 0.85))
    axd = dict(zip('0123', top.subplots(1, 4)))
    axd.update(zip('RP', bottom.subplots(1, 2)))
    for j, (key, title, ylabel) in enumerate(panels):
        ax = axd[str(j)]
        schemes = [s for s in families.MINI_SCHEMES if any(v.get(key) is not None for v in pr.get(s, {}).values())]
        for i, s in enumerate(schemes):
            vals = [v[key] for v in pr[s].values() if v.get(key) is not None]
            m, h, n = _t_interval(vals)
            ax.bar(i, m, color=_scheme_color(s), alpha=0.7, yerr=h or 0, capsize=4)
            ax.plot([i] * n, vals, 'k.', ms=4)
        if key.startswith('R_'):
            ax.set_ylim(0, 1)  # a share; an interval reaching past [0, 1] is cut at the frame
        ax.set_xticks(range(len(schemes)), [f"{s}\n(n = {len(pr[s])})" for s in schemes], fontsize=7, rotation=30)
        ax.set_title(title, fontsize=8.5)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(axis='y', alpha=0.3)
    for name, pick, xlabel in (('R', lambda r: r['statistic'].startswith('R_'),
                                'paired difference in the share of late pairs (scheme minus Pre-LN)'),
                               ('P', lambda r: r['statistic'].startswith('held-out'),
                                'paired difference in held-out loss added (nats / byte; scheme minus Pre-LN)')):
        ax = axd[name]
        mine = [r for r in rows if pick(r)]
        for i, r in enumerate(mine):
            y = len(mine) - 1 - i
            if r['mean'] is not None:
                ax.errorbar(r['mean'], y, xerr=None if r['hi'] is None else r['hi'] - r['mean'], fmt='o', color='k',
                            capsize=3)
        ax.axvline(0, color='gray', lw=0.8)
        ax.set_ylim(-0.6, len(mine) - 0.4)
        ax.set_yticks(range(len(mine)), [_fill(f"{r['finding']} (n = {r['n']})", 48) for r in reversed(mine)],
                      fontsize=7)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_title('paired findings: mean over seeds, bars = 95% t-interval', fontsize=8.5)
        ax.grid(axis='x', alpha=0.3)
    deep = [r for r in _finished(results['runs']) if r['L'] == L]
    scale = f" (backbone {deep[0]['backbone'] / 1e6:.2f}M parameters" if deep else " ("
    fig.suptitle(f"mini-DepthBench probes of the L = {L} models{scale}, byte-level text, "
                 f"{results['tokens_per_backbone_param']:g} tokens per backbone parameter). Top: mean over seeds with "
                 f"its 95% t-interval (unpaired), dots = single seeds. Bottom: the paired findings", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)




def plot_ladder(points, path, title=''):
    """
    The training-length ladder: each scheme's gap to Pre-LN at the deepest shape (left) and
    Pre-LN's depth cost (right) against tokens per backbone parameter (log axis). points:
    mini.ladder_points()'s {panel: {scheme: [(tokens per parameter, per-seed values, paper
    effect as a fraction of loss, in nats per byte)]}}. Per rung: the mean over seeds with its
    95% t-interval, the number of seeds beside it; the paper's effect on this scale as a line
    per scheme, solid as a fraction of loss (it follows each rung's Pre-LN loss), dashed in
    nats per byte. Writes a PNG to path.
    """
    plt = _plt()
    panels = [p for p in points if points[p]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        schemes = list(points[panel])
        for j, s in enumerate(schemes):
            color = _scheme_color(s)
            shift = 2 ** (0.03 * (j - (len(schemes) - 1) / 2))  # a small offset per scheme: bars stay apart
            pts = sorted(points[panel][s])
            xs, ms = [], []
            for tpp, vals, _, _ in pts:
                t = stats.t_test(vals)
                if t['mean'] is None:
                    continue
                x = tpp * shift
                xs.append(x)
                ms.append(t['mean'])
                ax.errorbar(x, t['mean'], yerr=None if t['hi'] is None else t['hi'] - t['mean'], fmt='o', color=color,
                            capsize=4)
                ax.plot([x] * len(stats.values(vals)), stats.values(vals), '.', color=color, ms=3, alpha=0.5)
                ax.annotate(f"{t['n']}", (x, t['mean']), textcoords='offset points', xytext=(5, -10), fontsize=7,
                            color=color)
            ax.plot(xs, ms, '-', color=color, lw=1, label=f"{s}: ours, mean ± 95% t-interval")
            rungs = [p[0] for p in pts]
            ax.plot(rungs, [p[2] for p in pts], '-', color=color, lw=2, alpha=0.45,
                    label=f"{s}: the paper's effect as a fraction of loss")
            ax.plot(rungs, [p[3] for p in pts], '--', color=color, lw=1.5, alpha=0.45,
                    label=f"{s}: the paper's effect in nats per byte")
        ax.axhline(0, color='gray', lw=0.8)
        ax.set_xscale('log', base=2)
        ticks = sorted({p[0] for s in points[panel] for p in points[panel][s]})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
        ax.set_xlabel('tokens per backbone parameter (log scale; the paper trains ≈20)')
        ax.set_ylabel('paired difference in validation loss (nats / byte)')
        ax.set_title(panel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
