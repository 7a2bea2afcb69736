"""
Figures of probe.py, laid out like the paper's (arXiv 2609.32534, Figs. 4-10). Every function
takes a list of probe results (one dict per model, as probe.py writes to probe.json) and
returns a matplotlib Figure, or None when no model has that metric; one model gives one
panel, several give side-by-side heatmaps, overlaid curves or grouped bars.

    import probe, probe_plots
    probe_plots.plot_all([probe.load_results('out/preln_L32/probe/probe.json'),
                          probe.load_results('out/hc_L32/probe/probe.json')], 'out/compare')
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


def _with(results, metric):
    return [r for r in results if r.get(metric) is not None]


def plot_angular(results):
    """Angular distance (Eq. 2, Fig. 5 style): x = start state l (0 = embedding), y = offset n
    with large n at the top, colour = d(l, l+n); viridis_r with each model's own min/max."""
    rs = _with(results, 'angular')
    if not rs:
        return None
    fig, axes = _panels(len(rs))
    for ax, r in zip(axes, rs):
        S = np.asarray(r['angular']['subsequent'], dtype=float)  # (L, L+1), row n-1
        L = S.shape[0]
        finite = S[np.isfinite(S)]
        im = ax.imshow(np.ma.masked_invalid(S), origin='lower', cmap=_cmap('viridis_r'), aspect='auto',
                       extent=(-0.5, L + 0.5, 0.5, L + 0.5), vmin=finite.min(), vmax=finite.max())
        fig.colorbar(im, ax=ax, label='angular distance')
        _integer_ticks(ax)
        ax.set(xlabel='start layer l (0 = embedding)', ylabel='offset n', title=f"{r['label']}: d(l, l+n)")
    fig.tight_layout()
    return fig


def _score_heatmaps(rs, metric, key, title, xlabel, ylabel, ratio_key, threshold_key):
    # one colour scale for all panels, capped at twice the R threshold so that a single
    # outlier does not turn every other cell black
    fig, axes = _panels(len(rs))
    top = max(np.nanmax(np.asarray(r[metric][key], dtype=float), initial=0.0) for r in rs)
    thr = (rs[0].get('late_pairs') or {}).get(threshold_key)
    vmax = min(top, 2 * thr) if thr else top
    for ax, r in zip(axes, rs):
        M = np.asarray(r[metric][key], dtype=float)
        im = ax.imshow(np.ma.masked_invalid(M), cmap=_cmap('magma'), vmin=0, vmax=vmax if vmax > 0 else 1)
        fig.colorbar(im, ax=ax, extend='max' if top > vmax else 'neither')
        _integer_ticks(ax)
        late = r.get('late_pairs') or {}
        if late.get('start') is not None:  # rows at or below the line form the late pairs
            ax.axhline(late['start'] - 0.5, color='cyan', lw=1, ls='--')
        ratio = late.get(ratio_key)
        suffix = '' if ratio is None else f"  ({ratio_key} = {100 * ratio:.1f}%)"
        ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{r['label']}: {title}{suffix}")
    fig.tight_layout()
    return fig


def plot_causal(results):
    """Causal score C(s, l) (Eq. 3): y = skipped block s, x = downstream block l; one colour
    scale shared by all panels (capped at 2x the R_causal threshold); dashed line: the late
    pairs (Eq. 5) lie below it."""
    rs = _with(results, 'causal')
    return _score_heatmaps(rs, 'causal', 'C', 'C(s, l)', 'downstream block l', 'skipped block s',
                           'R_causal', 'causal_threshold') if rs else None


def plot_permutation(results):
    """Permutation score P(i, j) (Eq. 4): y = first swapped block i, x = second j; shared scale."""
    rs = _with(results, 'permutation')
    return _score_heatmaps(rs, 'permutation', 'P', 'P(i, j)', 'block j', 'block i', 'R_perm',
                           'perm_threshold') if rs else None


def plot_late_pairs(results):
    """R_causal and R_perm (Eqs. 6, 8) as grouped bars, one bar per model, in percent."""
    rs = _with(results, 'late_pairs')
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(rs), 3.6))
    names, w = ['R_causal', 'R_perm'], 0.8 / len(rs)
    for k, r in enumerate(rs):
        vals = [r['late_pairs'][n] for n in names]               # None: not measured (n/a), not 0
        bars = ax.bar(np.arange(2) + (k - (len(rs) - 1) / 2) * w, [100 * (v or 0) for v in vals], w,
                      label=r['label'])
        ax.bar_label(bars, labels=['n/a' if v is None else f"{100 * v:.1f}" for v in vals], fontsize=7)
    lp = rs[0]['late_pairs']
    ax.set_xticks(range(2), [f"R_causal (C > {lp['causal_threshold']})", f"R_perm (P > {lp['perm_threshold']})"])
    ax.set(ylabel='% of late pairs', title='late-layer interdependence')
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_path_weights(results):
    """Explicit residual-path weights (Fig. 7): y = reader (sublayer input, 'out' = readout),
    x = source (embedding, sublayer outputs); each panel has its own colour scale."""
    rs = _with(results, 'path_weights')
    if not rs:
        return None
    fig, axes = _panels(len(rs), 4.6, 4.2)
    for ax, r in zip(axes, rs):
        W = np.asarray(r['path_weights']['W'], dtype=float)
        L = (W.shape[0] - 1) // 2
        finite = W[np.isfinite(W)]
        lo, hi = (finite.min(), finite.max()) if finite.size else (0, 1)
        im = ax.imshow(np.ma.masked_invalid(W), cmap=_cmap('viridis'), vmin=lo, vmax=hi if hi > lo else lo + 1)
        fig.colorbar(im, ax=ax)
        src, rdr = _sublayer_labels(L)
        step = max(1, (2 * L + 1) // 12)  # at most ~12 tick labels per axis
        ax.set_xticks(range(0, 2 * L + 1, step), src[::step], rotation=90, fontsize=7)
        ax.set_yticks(range(0, 2 * L + 1, step), rdr[::step], fontsize=7)
        ax.set(xlabel='source', ylabel='reader', title=f"{r['label']} ({r['path_weights']['kind']})")
    fig.tight_layout()
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
        ax.set(xlabel='reader sublayer (last = readout)', ylabel='mean depth-softmax weight', ylim=(0, 1),
               title=f"{r['label']}: dead segment {bw['dead_sublayers']} sublayers")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_prune(results):
    """Single-block pruning (Fig. 8 left): change of ARC-Easy acc_norm when block l is skipped."""
    rs = _with(results, 'prune')
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for r in rs:
        p = r['prune']
        ax.plot([b['block'] for b in p['blocks']], [100 * b['delta_acc_norm'] for b in p['blocks']], '-o', ms=3,
                label=f"{r['label']} (full {100 * p['baseline']['acc_norm']:.1f}%)")
    ax.axhline(0, color='grey', lw=0.8)
    ax.set(xlabel='skipped block l', ylabel='delta ARC-Easy acc_norm (points)', title='single-layer pruning')
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_logit_lens(results):
    """LogitLens (Fig. 8 right): KL(p_final || p_l) in nats and the early-exit CE per depth state."""
    rs = _with(results, 'logit_lens')
    if not rs:
        return None
    fig, axes = _panels(2, 4.6, 3.6)
    for r in rs:
        ll = r['logit_lens']
        axes[0].plot(range(len(ll['kl'])), ll['kl'], '-o', ms=3, label=r['label'])
        axes[1].plot(range(len(ll['ce'])), ll['ce'], '-o', ms=3, label=r['label'])
    axes[0].set(xlabel='layer l (0 = embedding)', ylabel='KL(p_final || p_l) [nats]', title='LogitLens')
    axes[1].set(xlabel='layer l (0 = embedding)', ylabel='early-exit CE [nats]', title='early exit')
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


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
    """Domain NLL (Fig. 4): nats per answer token per category (unweighted mean of its two
    tasks), one bar per model; a category with no prepared task is left out."""
    rs = _with(results, 'domain_nll')
    if not rs:
        return None
    cats = [c for c in rs[0]['domain_nll']['categories']]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(cats), 3.6))
    w = 0.8 / len(rs)
    for k, r in enumerate(rs):
        vals = [r['domain_nll']['categories'][c]['nll'] for c in cats]
        bars = ax.bar(np.arange(len(cats)) + (k - (len(rs) - 1) / 2) * w,
                      [np.nan if v is None else v for v in vals], w, label=r['label'])
        ax.bar_label(bars, fmt='%.2f', fontsize=7)
    ax.set_xticks(range(len(cats)), cats)
    ax.set(ylabel='NLL [nats / answer token]', title='domain NLL (category = mean of its tasks)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


PLOTS = {'angular': plot_angular, 'causal': plot_causal, 'permutation': plot_permutation,
         'late_pairs': plot_late_pairs, 'path_weights': plot_path_weights, 'block_weights': plot_block_weights,
         'prune': plot_prune, 'logit_lens': plot_logit_lens, 'propagation': plot_propagation,
         'domain_nll': plot_domain_nll}


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
