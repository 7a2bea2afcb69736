"""
Figures of probe.py, laid out like the paper's (arXiv 2609.32534, Figs. 4-10). Every function
takes a list of probe results (one dict per model, as probe.py writes to probe.json) and
returns a matplotlib Figure, or None when no model has that metric; one model gives one
panel, several give side-by-side heatmaps, overlaid curves or grouped bars.

    import probe
    from probes import plots
    plots.plot_all([probe.load_results('out/main/preln_L32/probe/probe.json'),
                    probe.load_results('out/main/hc_L32/probe/probe.json')], 'out/compare')
"""

from pathlib import Path

import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def _panels(n, width=4.2, height=3.6):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, axes[0]


def _cmap(name):
    return plt.get_cmap(name).with_extremes(bad='white')  # NaN cells (undefined pairs) stay blank


def _sublayer_labels(L):
    # sources: emb, a0, m0, a1, m1, ...; readers: a0, m0, ..., out (the final readout)
    subs = [f"{'am'[k % 2]}{k // 2}" for k in range(2 * L)]
    return ['emb'] + subs, subs + ['out']


def _integer_ticks(ax):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _finish_curves(fig, axes):
    """The common finish of a per-layer curve figure: small titles, integer layer ticks,
    a legend per panel, a tight layout. Returns fig."""
    for ax in axes:
        ax.title.set_fontsize(9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _with(results, metric):
    return [r for r in results if r.get(metric) is not None]


def plot_angular(results):
    """Angular distance (Eq. 2, Fig. 5 style): x = start state l (0 = embedding), y = offset n
    with large n at the top, colour = d(l, l+n); viridis_r with each model's own min/max.
    Start states l = 0..L-1 (the last state L starts no pair)."""
    rs = _with(results, 'angular')
    if not rs:
        return None
    fig, axes = _panels(len(rs))
    for ax, r in zip(axes, rs):
        S = np.asarray(r['angular']['subsequent'], dtype=float)[:, :-1]  # (L, L): start states 0..L-1
        L = S.shape[0]
        finite = S[np.isfinite(S)]
        im = ax.imshow(np.ma.masked_invalid(S), origin='lower', cmap=_cmap('viridis_r'), aspect='auto',
                       extent=(-0.5, L - 0.5, 0.5, L + 0.5), vmin=finite.min(), vmax=finite.max())
        fig.colorbar(im, ax=ax, label="angular distance (this model's range)")
        _integer_ticks(ax)
        ax.set(xlabel='start layer l (0 = embedding)', ylabel='offset n', title=f"{r['label']}: d(l, l+n)")
    fig.tight_layout()
    return fig


def _score_heatmaps(rs, metric, key, title, xlabel, ylabel, ratio_key, threshold_key, symbol, default_thr):
    # one colour scale for all panels, 0 .. the largest score of any model (the data's whole
    # range; the same colour is the same score in every panel), with the R threshold at the
    # middle colour: dark = below it, bright = above it, however large the scores grow
    from matplotlib.colors import TwoSlopeNorm
    fig, axes = _panels(len(rs), 4.6, 3.9)
    thr = (rs[0].get('late_pairs') or {}).get(threshold_key) or default_thr
    tops = [float(np.nanmax(np.asarray(r[metric][key], dtype=float)))
            if np.isfinite(np.asarray(r[metric][key], dtype=float)).any() else 0.0 for r in rs]
    norm = TwoSlopeNorm(vmin=0.0, vcenter=thr, vmax=max(max(tops), 1.01 * thr))
    for ax, r, top in zip(axes, rs, tops):
        M = np.asarray(r[metric][key], dtype=float)
        im = ax.imshow(np.ma.masked_invalid(M), cmap=_cmap('magma'), norm=norm)
        cb = fig.colorbar(im, ax=ax)
        cb.ax.axhline(thr, color='cyan', lw=1.5)
        cb.set_label(f"{symbol} (cyan: threshold {thr:g}, the middle colour)")
        _integer_ticks(ax)
        late = r.get('late_pairs') or {}
        if late.get('start') is not None:  # rows at or below the line form the late pairs
            ax.axhline(late['start'] - 0.5, color='cyan', lw=1, ls='--',
                       label=f"below: late pairs (row ≥ {late['start']} = ⌈L/4⌉)")
            ax.legend(fontsize=6, loc='lower left', framealpha=0.8)
        ratio = late.get(ratio_key)
        rtext = '' if ratio is None else f"{ratio_key} = {100 * ratio:.1f}% ({symbol} > {thr:g}), "
        ax.set_title(f"{r['label']}: {title}\n{rtext}max {top:.2f}", fontsize=9)
        ax.set(xlabel=xlabel, ylabel=ylabel)
    fig.tight_layout()
    return fig


def plot_causal(results):
    """Causal score C(s, l) (Eq. 3): y = skipped block s, x = downstream block l; one colour
    scale for every panel, 0 .. the largest score, the R_causal threshold (0.45) at the middle
    colour (cyan on the colour bar); dashed line: the late pairs (Eq. 5) lie below it."""
    rs = _with(results, 'causal')
    return _score_heatmaps(rs, 'causal', 'C', 'C(s, l)', 'downstream block l', 'skipped block s',
                           'R_causal', 'causal_threshold', 'C', 0.45) if rs else None


def plot_permutation(results):
    """Permutation score P(i, j) (Eq. 4): y = first swapped block i, x = second j; colours as
    plot_causal, the R_perm threshold (0.15) at the middle colour."""
    rs = _with(results, 'permutation')
    return _score_heatmaps(rs, 'permutation', 'P', 'P(i, j)', 'block j', 'block i', 'R_perm',
                           'perm_threshold', 'P', 0.15) if rs else None


def plot_late_pairs(results):
    """R_causal and R_perm (Eqs. 6, 8) as grouped bars, one bar per model, in percent."""
    rs = _with(results, 'late_pairs')
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(3.2 + 0.9 * len(rs), 3.8))
    names, w = ['R_causal', 'R_perm'], 0.8 / len(rs)
    top = 0.0
    for k, r in enumerate(rs):
        vals = [r['late_pairs'][n] for n in names]               # None: not measured (n/a), not 0
        bars = ax.bar(np.arange(2) + (k - (len(rs) - 1) / 2) * w, [100 * (v or 0) for v in vals], w,
                      label=r['label'])
        ax.bar_label(bars, labels=['n/a' if v is None else f"{100 * v:.1f}" for v in vals], fontsize=7)
        top = max([top] + [100 * v for v in vals if v is not None])
    lp = rs[0]['late_pairs']
    ax.set_xticks(range(2), [f"R_causal\n(C > {lp['causal_threshold']})", f"R_perm\n(P > {lp['perm_threshold']})"])
    ax.set_ylim(0, max(10.0, 1.2 * top))  # never below 0; room for the bar labels
    ax.set(ylabel='% of late pairs', title=f"late-layer interdependence\n({lp['n_pairs']} late pairs, s ≥ {lp['start']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


_KIND_TEXT = {'unit': 'every residual add has weight 1', 'attnres': 'depth-softmax weights, rows sum to 1',
              'hc': 'beta_i^T A ... A a_l, per token, averaged'}


def plot_path_weights(results):
    """Explicit residual-path weights (Fig. 7): y = reader (sublayer input), x = source
    (embedding, sublayer outputs). The readout row (the sum of HC's m streams, m times the
    scale of a sublayer read) is drawn separately below each panel, with its own colour bar,
    so that it does not set the sublayer rows' colours. Panels of the same kind share one
    colour scale; the residual family ('unit') is drawn on a fixed 0..1 scale."""
    rs = _with(results, 'path_weights')
    if not rs:
        return None
    fig = plt.figure(figsize=(5.0 * len(rs), 5.4))
    gs = fig.add_gridspec(2, len(rs), height_ratios=[12, 1.4], hspace=0.45)
    Ws = {id(r): np.asarray(r['path_weights']['W'], dtype=float) for r in rs}
    ranges = {}
    for r in rs:  # one (lo, hi) per kind over the sublayer rows, one per kind for the readout
        kind, W = r['path_weights']['kind'], Ws[id(r)]
        for part, M in (('rows', W[:-1]), ('out', W[-1:])):
            f = M[np.isfinite(M)]
            lo, hi = ranges.get((kind, part), (np.inf, -np.inf))
            ranges[(kind, part)] = (min(lo, f.min(initial=np.inf)), max(hi, f.max(initial=-np.inf)))
    for k, r in enumerate(rs):
        kind, W = r['path_weights']['kind'], Ws[id(r)]
        L = (W.shape[0] - 1) // 2
        src, rdr = _sublayer_labels(L)
        step = max(1, (2 * L + 1) // 12)  # at most ~12 tick labels per axis
        ax, axo = fig.add_subplot(gs[0, k]), fig.add_subplot(gs[1, k])
        for a, part, M in ((ax, 'rows', W[:-1]), (axo, 'out', W[-1:])):
            lo, hi = (0.0, 1.0) if kind == 'unit' else ranges[(kind, part)]
            if not hi > lo:
                lo, hi = lo - 0.5, hi + 0.5
            im = a.imshow(np.ma.masked_invalid(M), cmap=_cmap('viridis'), vmin=lo, vmax=hi, aspect='auto')
            cb = fig.colorbar(im, ax=a, pad=0.02)
            cb.set_label('weight' if part == 'rows' else 'readout', fontsize=7)
            cb.ax.tick_params(labelsize=6)
            a.set_xticks(range(0, 2 * L + 1, step), src[::step], rotation=90, fontsize=7)
        ax.set_yticks(range(0, 2 * L, step), rdr[:-1][::step], fontsize=7)
        axo.set_yticks([0], ['out'], fontsize=7)
        axo.set_xlabel('source', fontsize=8)
        ax.set_ylabel('reader (sublayer input)')
        ax.set_title(f"{r['label']}: {kind}\n({_KIND_TEXT.get(kind, kind)})", fontsize=9)
    return fig


def plot_block_weights(results):
    """Block AttnRes (Fig. 9): per reader sublayer, mean weight on the running partial sum, on
    the embedding and on the frozen block sums; dotted lines at block boundaries."""
    rs = _with(results, 'block_weights')
    if not rs:
        return None
    fig, axes = _panels(len(rs), 5.0, 3.4)
    for ax, r in zip(axes, rs):
        bw = r['block_weights']
        x = np.arange(len(bw['current']))
        for key, style in (('current', '-o'), ('embedding', '-s'), ('frozen', '-^')):
            ax.plot(x, np.asarray(bw[key], dtype=float), style, ms=3, label=key)
        for b in bw['boundaries']:
            ax.axvline(b, color='grey', ls=':', lw=0.8)
        n = bw['low_use_sublayers']
        ax.set(xlabel='reader sublayer (last = readout)', ylabel='mean depth-softmax weight', ylim=(0, 1))
        ax.set_title(f"{r['label']}: low-use segment {n} sublayer{'' if n == 1 else 's'}\n"
                     f"(leading readers with < {bw['low_use_threshold']:g} on the running sum)", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_prune(results):
    """Single-block pruning (Fig. 8 left): change of ARC-Easy acc_norm when block l is skipped,
    ± 1 standard error of the paired per-question difference; beside it (prune_lm) the rise of
    the held-out LM loss, ± 1 s.e. over windows."""
    ra, rl = _with(results, 'prune'), _with(results, 'prune_lm')
    if not ra and not rl:
        return None
    fig, axes = _panels(int(bool(ra)) + int(bool(rl)), 5.2, 3.8)
    k = 0
    if ra:
        ax = axes[k]
        k += 1
        for r in ra:
            p = r['prune']
            x = [b['block'] for b in p['blocks']]
            y = [100 * b['delta_acc_norm'] for b in p['blocks']]
            se = [100 * b.get('se_delta_acc_norm', np.nan) for b in p['blocks']]
            ax.errorbar(x, y, yerr=None if np.isnan(se).all() else se, fmt='-o', ms=3, capsize=2,
                        label=f"{r['label']} (full {100 * p['baseline']['acc_norm']:.1f}%)")
        ax.axhline(0, color='grey', lw=0.8)
        ax.set(xlabel='skipped block l', ylabel='Δ ARC-Easy acc_norm (points)',
               title=f"single-layer pruning: ARC-Easy (n = {ra[0]['prune']['n']}, ± 1 s.e.)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    if rl:
        ax = axes[k]
        unit = _loss_unit(rl)
        for r in rl:
            p = r['prune_lm']
            ax.errorbar(range(len(p['delta'])), p['delta'], yerr=p['se'], fmt='-o', ms=3, capsize=2,
                        label=f"{r['label']} (full {p['loss']:.3f})")
        ax.axhline(0, color='grey', lw=0.8)
        ax.set(xlabel='skipped block l', ylabel=f'Δ held-out LM loss ({unit})',
               title=f"single-layer pruning: LM loss ({rl[0]['prune_lm']['n_windows']} windows, ± 1 s.e.)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    for ax in axes:
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def _loss_unit(rs):
    # byte-level models predict bytes: their losses are nats per byte
    return 'nats / byte' if all(r.get('tokenizer') == 'byte' for r in rs) else 'nats / token'


def plot_logit_lens(results):
    """LogitLens (Fig. 8 right): KL(p_final || p_l), the early-exit cross-entropy against the
    true next token, and the top-5 overlap with the final prediction, per depth state."""
    rs = _with(results, 'logit_lens')
    if not rs:
        return None
    unit = _loss_unit(rs).split(' / ')[1]
    fig, axes = _panels(3, 4.4, 3.6)
    for r in rs:
        ll = r['logit_lens']
        for ax, key in zip(axes, ('kl', 'ce', 'top5')):
            if key in ll:
                ax.plot(range(len(ll[key])), ll[key], '-o', ms=3, label=r['label'])
    axes[0].set(ylabel=f'KL(p_final || p_l) [nats / {unit}]', title='LogitLens: KL to the final output')
    axes[1].set(ylabel=f'early-exit CE [nats / {unit}]', title='early exit: CE vs the true next token')
    axes[2].set(ylabel='|top5(p_l) ∩ top5(p_final)| / 5', title='top-5 overlap with the final', ylim=(0, 1.05))
    for ax in axes:
        ax.set_xlabel('layer l (0 = embedding)')
    return _finish_curves(fig, axes)


def plot_propagation(results):
    """HC/mHC propagation (Fig. 10): effective rank and mean |cos| between the columns of the
    mixing product, and its normalised singular spectrum, with 95% bootstrap intervals."""
    rs = _with(results, 'propagation')
    if not rs:
        return None
    fig, axes = _panels(3, 3.8, 3.4)
    for k, key in enumerate(('erank', 'mean_abs_cos')):
        for j, r in enumerate(rs):
            s = r['propagation'][key]
            axes[k].bar(j, s['mean'], 0.6, yerr=[[s['mean'] - s['lo']], [s['hi'] - s['mean']]], capsize=4,
                        label=r['label'])
        axes[k].set_xticks(range(len(rs)), [r['label'] for r in rs], rotation=20, fontsize=7)
        axes[k].set_xlim(-0.8, len(rs) - 0.2)
    m = rs[0]['propagation']['m']
    axes[0].set(ylabel='effective rank of P', title=f'erank (max {m})')
    axes[1].set(ylabel='mean |cos| between columns of P', title='stream similarity')
    for r in rs:
        s = r['propagation']['spectrum']
        j = np.arange(1, len(s['mean']) + 1)
        axes[2].plot(j, s['mean'], '-o', ms=3, label=r['label'])
        axes[2].fill_between(j, s['lo'], s['hi'], alpha=0.25)
    axes[2].set(xlabel='singular value j', ylabel='sigma_j / sigma_max', title='spectrum of P', ylim=(0, 1.05))
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].legend(fontsize=7)
    fig.suptitle(f"mixing product P per token; intervals: bootstrap over {rs[0]['propagation']['unit']}s", fontsize=8)
    fig.tight_layout()
    return fig


def plot_domain_nll(results):
    """Domain NLL (Fig. 4): nats per answer token (byte for byte-level models) per category,
    the unweighted mean of its tasks, one bar per model; a category with only one of its two
    tasks prepared says which; a category with none is left out."""
    rs = _with(results, 'domain_nll')
    if not rs:
        return None
    cats = [c for c in rs[0]['domain_nll']['categories']]
    fig, ax = plt.subplots(figsize=(2.4 + 1.5 * len(cats), 3.8))
    w = 0.8 / len(rs)
    for k, r in enumerate(rs):
        vals = [r['domain_nll']['categories'][c]['nll'] for c in cats]
        bars = ax.bar(np.arange(len(cats)) + (k - (len(rs) - 1) / 2) * w,
                      [np.nan if v is None else v for v in vals], w, label=r['label'])
        ax.bar_label(bars, fmt='%.2f', fontsize=7)
    labels = []
    for c in cats:
        info = rs[0]['domain_nll']['categories'][c]
        labels.append(f"{c}\n({', '.join(info['tasks'])} only)" if info.get('missing') else c)
    ax.set_xticks(range(len(cats)), labels, fontsize=8)
    unit = _loss_unit(rs).split(' / ')[1]
    ax.set(ylabel=f'NLL [nats / answer {unit}]', title='domain NLL (category = mean of its tasks)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_jacobian(results):
    """||J_l - I||_F / sqrt(D) per block (compute_jacobian.py), ± 1 standard error of the
    random-probe estimate (none when exact)."""
    rs = _with(results, 'jacobian')
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    for r in rs:
        j = r['jacobian']
        how = 'exact' if j['exact'] else f"{j['n_probes']} probes"
        ax.errorbar(range(len(j['deviation'])), j['deviation'], yerr=None if j['exact'] else j['se'],
                    fmt='-o', ms=3, capsize=2, label=f"{r['label']} (D = {j['dim']}, {how})")
    ax.set(xlabel='block l', ylabel='||J_l - I||_F / sqrt(D)', ylim=(0, None),
           title='deviation of each block from the identity (± 1 s.e.)')
    return _finish_curves(fig, [ax])


def plot_usefulness(results):
    """Usefulness (compute_usefulness_score.py): LM loss with block l replaced by its best
    affine stand-in, over the model's loss; the dashed line is the significance threshold."""
    rs = _with(results, 'usefulness')
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    for r in rs:
        u = r['usefulness']
        ax.plot(range(len(u['loss_ratio'])), u['loss_ratio'], '-o', ms=3,
                label=f"{r['label']}: {u['n_significant']}/{len(u['loss_ratio'])} significant")
    thr = rs[0]['usefulness']['threshold']
    ax.axhline(1 + thr, color='grey', ls='--', lw=1, label=f'threshold (+{100 * thr:.0f}%)')
    ax.axhline(1, color='grey', lw=0.6)
    ax.set(xlabel='block l replaced by a linear map', ylabel='loss_linear / loss',
           title='usefulness: cost of a linear stand-in for each block')
    return _finish_curves(fig, [ax])


def plot_token_collapse(results):
    """Token collapse (compute_token_collapse.py): stable rank, entropy effective rank and
    L1/L2 ratio of the singular values of each depth state's (T x D) token matrix, averaged
    over windows; dashed: their ceilings min(T, D) (sqrt of it for L1/L2)."""
    rs = _with(results, 'token_collapse')
    if not rs:
        return None
    fig, axes = _panels(3, 4.2, 3.5)
    names = (('stable_rank', 'stable rank  sum s² / max s²', 1), ('erank', 'erank  exp H(s² / sum s²)', 1),
             ('l1_l2', 'L1/L2  sum s / sqrt(sum s²)', 0.5))
    for ax, (key, text, power) in zip(axes, names):
        for r in rs:
            tc = r['token_collapse']
            ax.plot(range(len(tc[key])), tc[key], '-o', ms=3, label=r['label'])
        ceil = rs[0]['token_collapse']['max_rank'] ** power
        ax.set(xlabel='depth state l (0 = embedding)', ylabel=text, ylim=(0, None))
        ax.set_title(f"{text.split('  ')[0]} (ceiling {ceil:.3g})", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


PLOTS = {'angular': plot_angular, 'causal': plot_causal, 'permutation': plot_permutation,
         'late_pairs': plot_late_pairs, 'path_weights': plot_path_weights, 'block_weights': plot_block_weights,
         'prune': plot_prune, 'logit_lens': plot_logit_lens, 'propagation': plot_propagation,
         'domain_nll': plot_domain_nll, 'jacobian': plot_jacobian, 'usefulness': plot_usefulness,
         'token_collapse': plot_token_collapse}


def plot_all(results, out_dir):
    """Writes <name>.png into out_dir for every figure some model has data for; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in PLOTS.items():
        fig = fn(results)
        if fig is not None:
            fig.savefig(out_dir / f'{name}.png', dpi=120)
            plt.close(fig)
            paths.append(out_dir / f'{name}.png')
    return paths
