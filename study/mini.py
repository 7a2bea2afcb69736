"""
Mini-DepthBench, answered (docs/mini.md): the study's questions at CPU scale, with seeds,
every probe on the deepest models, and each finding beside the paper's number.

    python study/sweep.py family=mini seeds=3     # trains the runs, then calls this file's report()
    python study/mini.py                          # probe what is missing, collect, table, figures
    python study/mini.py --results=docs/mini/results.json   # tables from a results file, figures to out/mini

The sweep is paired: seed k gives every scheme and shape the same data order (train.py's
loader is seeded by the run's seed alone) and the same held-out windows, so depth costs and
scheme differences are taken within each seed and their mean and standard error are over
seeds. The test of a finding: a two-sided paired t-test at 5% with n - 1 degrees of freedom on
its per-seed values, Holm's correction over the table's tested rows, and the verdicts of
verdict() (docs/mini.md states the rule and the contrast).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, when run as a script
from study import families  # noqa: E402

ROOT = families.ROOT
RESULTS = os.path.join('docs', 'mini', 'results.json')  # committed with the figures beside it
DEEPEST = max(families.MINI_DEPTHS)
PROBE_METRICS = ('angular', 'causal', 'permutation', 'path_weights', 'logit_lens', 'block_weights',
                 'propagation', 'prune_lm')
PROBE_ARGS = ('--n_windows=16', '--seq_len=256', '--n_boot=1000', '--device=cpu')

# the paper's numbers (arXiv 2609.32534), as its figures give them
PAPER = {
    'loss_L16': {'preln': 2.759, 'attnres': 2.751, 'hc': 2.729},     # Fig. 2, 400M total, L = 16
    'loss_L32': {'preln': 2.782, 'attnres': 2.718, 'hc': 2.699},     # Fig. 2, L = 32
    'R_causal': {'preln': 0.01, 'hc': 0.07, 'attnres': 0.16},        # Fig. 6, L = 32, C > 0.45
    'R_perm': {'preln': 0.08, 'hc': 0.35, 'attnres': 0.46},          # Fig. 6, L = 32, P > 0.15
    'low_use_layers': {16: 2, 24: 5, 32: 8},                         # Fig. 9, Block AttnRes
    'erank': {'hc': (2.53, 2.81), 'mhc': (1.44, 1.65)},              # Fig. 10, range over shapes
}


# -----------------------------------------------------------------------------
# probing the deepest model of every seed

def deepest_runs(root=ROOT, seeds=3):
    """(seed k, run) for the L = DEEPEST run of every mini scheme and seed that finished."""
    from study import sweep
    out = []
    for run in families.runs('mini', shapes=[DEEPEST]):
        for r in sweep.seed_runs(run, root, seeds):
            if sweep.run_status(r, root) == 'finished':
                out.append((r.info.get('seed', 0), r))
    return out


def probe_json(run, root=ROOT):
    return os.path.join(root, run.out_dir, 'probe', 'probe.json')


def probe_missing(root=ROOT, seeds=3):
    """Runs probe.py on every deepest checkpoint whose probe.json lacks a metric (probe.py
    keeps what an earlier probe.json holds). Returns the (name, reason) of failures."""
    from study import sweep
    failures = []
    for k, run in deepest_runs(root, seeds):
        have = _read(probe_json(run, root)) or {}
        todo = [m for m in PROBE_METRICS if m not in have and m not in have.get('skipped', {})]
        if not todo:
            continue
        cmd = [sys.executable, 'probe.py', f'--ckpt={os.path.join(run.out_dir, "ckpt.pt")}',
               f'--metrics={",".join(todo)}', *PROBE_ARGS]
        print(f"probe: {' '.join(cmd[1:])}", flush=True)
        if sweep.run_command(cmd, root) != 0:
            failures.append((run.name, 'probe.py failed'))
    return failures


def is_results(r):
    """Whether `r` (parsed JSON) has the shape `collect` writes."""
    return isinstance(r, dict) and isinstance(r.get('runs'), list) and isinstance(r.get('probes'), dict) \
        and isinstance(r.get('tokens_per_backbone_param'), (int, float)) and isinstance(r.get('deepest'), int)


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def probe_summary(p, L):
    """The numbers the findings use, from one probe.json `p` of an L-block model."""
    s = {}
    lp = p.get('late_pairs') or {}
    s['R_causal'], s['R_perm'] = lp.get('R_causal'), lp.get('R_perm')
    start = math.ceil(L * 0.25)
    if 'angular' in p:  # the mean angular distance between consecutive late blocks, d(l, l+1), l >= L/4
        row = p['angular']['subsequent'][0]
        s['angular_late'] = _mean([row[l] for l in range(start, L)])
    if 'path_weights' in p and 'W' in p['path_weights']:
        s['readout_on_embedding'] = p['path_weights']['W'][-1][0]
    if 'logit_lens' in p:  # KL(final || lens) after the middle block, nats
        s['lens_kl_mid'] = p['logit_lens']['kl'][L // 2]
    if 'block_weights' in p:
        s['low_use_sublayers'] = p['block_weights']['dead_sublayers']
    if 'propagation' in p:
        e = p['propagation']['erank']
        s['erank'], s['erank_lo'], s['erank_hi'] = _scalar(e['mean']), _scalar(e['lo']), _scalar(e['hi'])
    if 'prune_lm' in p:  # held-out loss added by dropping one late block, mean over l >= L/4
        s['prune_late'] = _mean(p['prune_lm']['delta'][start:])
    return s


def _scalar(x):
    return x[0] if isinstance(x, list) else x


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


# -----------------------------------------------------------------------------
# results and findings

def collect(root=ROOT, seeds=3):
    """{'runs': the sweep's rows (one per run and seed), 'probes': {scheme: {seed: summary}},
    'budget', 'machine'} from the out/ directories."""
    from study import sweep
    rows = sweep.read_all('mini', root, seeds)
    probes = {}
    for k, run in deepest_runs(root, seeds):
        p = _read(probe_json(run, root))
        if p:
            probes.setdefault(run.scheme, {})[str(k)] = probe_summary(p, run.L)
    return {'family': 'mini', 'tokens_per_backbone_param': families.MINI_TOKENS_PER_PARAM,
            'deepest': DEEPEST, 'runs': rows, 'probes': probes}


ALPHA = 0.05  # the family-wise error rate of the findings table (Holm over its tested rows)


def paired(xs):
    """(mean, standard error, n) of per-seed values (None for missing seeds dropped); the
    standard error is the sample standard deviation (n - 1) over sqrt(n), None for one seed."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    n = len(xs)
    if not n:
        return None, None, 0
    m = sum(xs) / n
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else None
    return m, se, n


def t_test(xs, alpha=ALPHA):
    """
    The paired test of a finding: a two-sided one-sample t-test of the per-seed values
    against 0, with n - 1 degrees of freedom (Student; scipy.stats.t). Returns a dict with
    mean, se, n, t, p and the 1 - alpha confidence interval lo, hi. p, t, lo and hi are None
    when the test is undefined: fewer than two seeds, or every seed the same (s.e. 0, where
    the t statistic has no distribution; such a sample must not pass).
    """
    from scipy import stats
    m, se, n = paired(xs)
    out = dict(mean=m, se=se, n=n, t=None, p=None, lo=None, hi=None)
    if n < 2 or not se:
        return out
    q = float(stats.t.ppf(1 - alpha / 2, n - 1))
    t = m / se
    out.update(t=t, p=float(2 * stats.t.sf(abs(t), n - 1)), lo=m - q * se, hi=m + q * se)
    return out


def holm(ps, alpha=ALPHA):
    """
    Holm's step-down correction: ps (p-values, None = untested) -> (adjusted p, rejected) per
    entry, in the same order; None/False for untested ones. The i-th smallest of m p-values
    is multiplied by m - i + 1 (i from 1), made non-decreasing and capped at 1; a hypothesis
    is rejected when its adjusted p is <= alpha (Holm 1979).
    """
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    m = len(idx)
    adj, run = [None] * len(ps), 0.0
    for rank, i in enumerate(idx):
        run = max(run, min(1.0, (m - rank) * ps[i]))
        adj[i] = run
    return adj, [a is not None and a <= alpha for a in adj]


def verdict(test, p_adj, paper_effect, paper_sign):
    """
    The verdict of one finding, from its t_test, its Holm-adjusted p and the paper's effect
    on this scale (None when the paper gives no size). paper_sign: +1 / -1 the direction the
    paper reports, 0 when the paper reports no difference. Verdicts:
      reproduces / opposite      adjusted p <= ALPHA, the mean with / against the paper's sign;
      differs from the paper     adjusted p <= ALPHA where the paper reports no difference;
      bounded below the paper's size   not significant, and the 1 - ALPHA interval lies wholly
                                 on the near side of the paper's effect (excludes it);
      not resolved at this scale otherwise (including an undefined test: < 2 seeds, s.e. 0).
    """
    if test['p'] is not None and p_adj is not None and p_adj <= ALPHA:
        if paper_sign == 0:
            return 'differs from the paper'
        return 'reproduces' if (test['mean'] > 0) == (paper_sign > 0) else 'opposite'
    if test['lo'] is not None and paper_effect is not None and paper_sign != 0:
        if (paper_effect > 0 and test['hi'] < paper_effect) or (paper_effect < 0 and test['lo'] > paper_effect):
            return 'bounded below the paper\'s size'
    return 'not resolved at this scale'


def late_pairs(L):
    """The number of late block pairs (s, t), s < t < L, s >= ceil(L / 4) (probes.md): 15 at L = 8."""
    start = math.ceil(L / 4)
    return sum(L - 1 - s for s in range(start, L))


# The contrast, fixed before seeds 3-7 were trained: the last doubling of depth, L = 4 -> 8, is
# set beside the paper's L = 16 -> 32 (the question is what doubling an already deep model
# does; L = 8 is the shape every probe row measures, and L = 2 has no Block AttnRes). Matched
# by width/depth ratio instead, the paper's d/L 76 -> 28 is L = 2 -> 4 here (d/L 88 -> 32):
# those rows follow, tested the same way and counted in the same Holm family.
CONTRAST = (4, 8)
MATCHED = (2, 4)
ERANK_MAX = 4  # m, the streams of HC and mHC: the effective rank of an m x m map is at most m


def findings(results):
    """
    The table rows: dicts with finding, paper (the paper's number as text), paper_effect (the
    paper's effect on this study's scale, None where it gives no size), paper_sign, the
    t_test fields (mean, se, n, t, p, lo, hi), p_holm, verdict, statistic, and note (why a row
    is not testable, or its unit in late pairs). A loss effect is scaled by the ratio of
    losses: the paper's difference over its Pre-LN loss at the same shape (Fig. 2), times this
    study's Pre-LN mean loss at the matching shape; shares of late pairs are compared as they are.
    """
    loss = {}  # (scheme, L, seed) -> val loss
    for r in results['runs']:
        if r['status'] == 'finished' and r['val_loss'] is not None:
            loss[(r['scheme'], r['L'], r.get('seed', 0))] = r['val_loss']
    seeds = sorted({k for (_, _, k) in loss} | {int(k) for v in results['probes'].values() for k in v})
    pr = results['probes']
    P = PAPER
    rows = []

    def minus(a, b):
        return None if a is None or b is None else a - b

    def scaled(effect, paper_L, L):  # the paper's loss effect as a fraction of its Pre-LN loss, on ours
        ref = _mean([loss.get(('preln', L, k)) for k in seeds])
        return None if ref is None else effect / P[f'loss_L{paper_L}']['preln'] * ref

    def add(finding, paper, values, paper_sign, stat, paper_effect=None, untestable=None, note=''):
        t = t_test(values)
        if untestable:
            t.update(t=None, p=None, lo=None, hi=None)
        rows.append(dict(finding=finding, paper=paper, paper_effect=paper_effect, paper_sign=paper_sign,
                         statistic=stat, note=untestable or note, testable=not untestable, **t))

    def depth_cost(s, k, L1, L2):
        return minus(loss.get((s, L2, k)), loss.get((s, L1, k)))

    cost = {s: P['loss_L32'][s] - P['loss_L16'][s] for s in ('preln', 'attnres', 'hc')}
    for (L1, L2), tag in ((CONTRAST, ''), (MATCHED, ', d/L-matched')):
        add(f"Pre-LN: extra depth costs loss (L {L1} -> {L2}{tag}; paper 16 -> 32)", f"{cost['preln']:+.3f}",
            [depth_cost('preln', k, L1, L2) for k in seeds], +1, 'loss(L2) - loss(L1), per seed',
            scaled(cost['preln'], 16, L1))
        for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
            d = cost[s] - cost['preln']
            add(f"{name} turns depth into lower loss than Pre-LN (L {L1} -> {L2}{tag})", f"{d:+.3f}",
                [minus(depth_cost(s, k, L1, L2), depth_cost('preln', k, L1, L2)) for k in seeds], -1,
                "depth cost minus Pre-LN's, paired by seed", scaled(d, 16, L1))
    L = CONTRAST[1]
    for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
        d = P['loss_L32'][s] - P['loss_L32']['preln']
        add(f"{name} below Pre-LN at the deepest shape (L {L}; paper 32)", f"{d:+.3f}",
            [minus(loss.get((s, L, k)), loss.get(('preln', L, k))) for k in seeds], -1,
            'loss difference, paired by seed', scaled(d, 32, L))

    def probe(s, k, key):
        return pr.get(s, {}).get(str(k), {}).get(key)

    def probe_diff(key, a, b):
        return [minus(probe(a, k, key), probe(b, k, key)) for k in seeds]
    n_late = late_pairs(results['deepest'])
    for key, label in (('R_causal', 'causal score > 0.45'), ('R_perm', 'permutation score > 0.15')):
        for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
            diffs = [x for x in probe_diff(key, s, 'preln') if x is not None]
            pairs = sorted(round(x * n_late) for x in diffs)
            add(f"{name}: more late pairs with {label} than Pre-LN (L {L}; paper 32)",
                f"{P[key][s]:.0%} vs {P[key]['preln']:.0%}", probe_diff(key, s, 'preln'), +1,
                f"{key} difference, paired by seed", P[key][s] - P[key]['preln'],
                note=f"seeds differ by {', '.join(f'{q:+d}' for q in pairs)} of {n_late} late pairs" if diffs else '')
    low = [probe('blockattnres', k, 'low_use_sublayers') for k in seeds]
    depths = [results['deepest']] if any(x is not None for x in low) else []
    add(f"Block AttnRes: an early low-use segment that grows with depth (L {L})",
        "2 / 5 / 8 layers at L = 16 / 24 / 32", [None if x is None else x / 2 for x in low], +1,
        'leading layers (sublayers / 2) whose reads put < 0.1 on the running block sum',
        untestable=None if len(depths) > 1 else "the claim is growth with depth; probed at "
        + (f"one depth (L = {depths[0]})" if depths else "no depth"))
    mhc = _mean([probe('mhc', k, 'erank') for k in seeds])
    add(f"HC's composed residual map has a higher effective rank than mHC's (L {L})", "2.53-2.81 vs 1.44-1.65",
        probe_diff('erank', 'hc', 'mhc'), +1, 'erank difference, paired by seed',
        untestable=None if mhc is None or mhc < ERANK_MAX - 0.05 else
        f"mHC's maps are still at their identity init (erank {mhc:.3f} of at most {ERANK_MAX})")
    add(f"Dropping a late block costs Full AttnRes more than Pre-LN (L {L})", "more (Fig. 8 left)",
        probe_diff('prune_late', 'attnres', 'preln'), +1, 'held-out loss added by one dropped late block, paired')
    add(f"Dropping a late block costs HC as much as Pre-LN (L {L})", "as Pre-LN (Fig. 8 left)",
        probe_diff('prune_late', 'hc', 'preln'), 0, 'held-out loss added by one dropped late block, paired')
    adj, _ = holm([r['p'] for r in rows])
    for r, a in zip(rows, adj):
        r['p_holm'] = a
        r['verdict'] = verdict(r, a, r['paper_effect'], r['paper_sign']) if r['testable'] else 'not testable here'
    return rows


def per_scheme(results):
    """Per scheme: the mean ± se over seeds of every probe summary number (a second table)."""
    out = {}
    for s, by_seed in results['probes'].items():
        keys = sorted({k for v in by_seed.values() for k in v})
        out[s] = {key: paired([v.get(key) for v in by_seed.values()]) for key in keys}
    return out


def _fmt(m, se, n, pct=False):
    if m is None:
        return '–'
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:+.3f}" if abs(x) < 10 else f"{x:+.1f}")
    return f(m) + (f" ± {f(se).lstrip('+')}" if se is not None else '') + f" ({n})"


def _p(p):
    return '–' if p is None else f"{p:.3f}" if p >= 0.001 else f"{p:.0e}"


def format_findings(rows):
    """The findings table as markdown; `paper here` is the paper's effect on this study's scale."""
    lines = ["| finding | paper | paper here | ours: mean ± s.e. (seeds) | 95% interval | p | p, Holm | verdict "
             "| statistic | note |", "|---" * 10 + "|"]
    for r in rows:
        pct = 'R_' in r['statistic']
        f = (lambda x: f"{100 * x:+.1f}%") if pct else (lambda x: f"{x:+.3f}")
        ci = '–' if r['lo'] is None else f"[{f(r['lo'])}, {f(r['hi'])}]"
        lines.append(f"| {r['finding']} | {r['paper']} | {'–' if r['paper_effect'] is None else f(r['paper_effect'])} "
                     f"| {_fmt(r['mean'], r['se'], r['n'], pct)} | {ci} | {_p(r['p'])} | {_p(r.get('p_holm'))} "
                     f"| {r['verdict']} | {r['statistic']} | {r['note'] or ''} |")
    return "\n".join(lines)


def format_probes(results):
    table = per_scheme(results)
    cols = [('R_causal', 'R_causal', True), ('R_perm', 'R_perm', True), ('angular_late', 'late d(l, l+1)', False),
            ('lens_kl_mid', 'LogitLens KL at L/2', False), ('readout_on_embedding', 'readout weight on v_0', False),
            ('prune_late', 'drop a late block: +loss', False), ('erank', 'erank', False),
            ('low_use_sublayers', 'low-use sublayers', False)]
    lines = ["| scheme | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for s in families.MINI_SCHEMES:
        if s in table:
            lines.append(f"| {s} | " + " | ".join(_fmt(*table[s].get(k, (None, None, 0)), pct=p)
                                                   for k, _, p in cols) + " |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# figures

def plot_probes(results, path):
    """One figure of the deepest models' probe numbers per scheme: bars = mean over seeds,
    error bars ± 1 s.e., dots = seeds; the paper's values as black ticks where it gives them."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from study.sweep import _scheme_color
    pr = results['probes']
    panels = [('R_causal', 'late pairs with C > 0.45', 'share of late pairs', PAPER['R_causal']),
              ('R_perm', 'late pairs with P > 0.15', 'share of late pairs', PAPER['R_perm']),
              ('prune_late', 'drop one late block', 'held-out loss added (nats/byte)', None),
              ('erank', 'erank of the composed residual map', 'effective rank (m = 4 max)',
               {k: sum(v) / 2 for k, v in PAPER['erank'].items()})]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (key, title, ylabel, paper) in zip(axes, panels):
        schemes = [s for s in families.MINI_SCHEMES if any(v.get(key) is not None for v in pr.get(s, {}).values())]
        for i, s in enumerate(schemes):
            vals = [v[key] for v in pr[s].values() if v.get(key) is not None]
            m, se, n = paired(vals)
            ax.bar(i, m, color=_scheme_color(s), alpha=0.7, yerr=se or 0, capsize=4)
            ax.plot([i] * n, vals, 'k.', ms=4)
            if paper and s in paper:
                ax.plot([i - 0.35, i + 0.35], [paper[s]] * 2, 'k-', lw=2)
        ax.set_xticks(range(len(schemes)), schemes, rotation=30, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(axis='y', alpha=0.3)
    fig.suptitle(f"mini-DepthBench, L = {results['deepest']} models: bars = mean over seeds ± 1 s.e., "
                 f"dots = seeds, black bars = the paper's value at L = 32", fontsize=8, y=0.01, va='bottom')
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results, out_dir):
    """Prints the findings and probe tables and writes the figures into out_dir."""
    from study import sweep
    os.makedirs(out_dir, exist_ok=True)
    rows = results['runs']
    print(sweep.format_summary(rows))
    print()
    print(format_findings(findings(results)))
    print()
    print(format_probes(results))
    written = [os.path.join(out_dir, 'loss_vs_ratio.png'), os.path.join(out_dir, 'probes.png')]
    sweep.plot_loss_vs_ratio([(f"mini: fixed backbone ≈0.8M, byte-level text, "
                               f"{results['tokens_per_backbone_param']:g} tokens per backbone parameter",
                               sweep._with_loss(rows))], written[0])
    if results['probes']:
        plot_probes(results, written[1])
    for p in written:
        if os.path.exists(p):
            print(f"wrote {p}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--results', help="read this results.json instead of out/mini (e.g. the committed "
                                     f"{RESULTS}); nothing is probed or written but the figures")
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--probe', default=True, type=lambda s: s.lower() == 'true', help="probe what is missing (True)")
    p.add_argument('--out', default=None, help=f"where results.json and the figures go ({os.path.dirname(RESULTS)}; "
                                               "with --results, the figures only, to out/mini)")
    a = p.parse_args(argv)
    failures = []
    if a.results:
        results = _read(a.results)
        if not is_results(results):
            print(f"error: {a.results} is missing or not a mini results.json (a dict with 'runs', "
                  f"'probes', 'tokens_per_backbone_param' and 'deepest')", file=sys.stderr)
            return 2
        a.out = a.out or os.path.join('out', 'mini')  # the committed figures stay as they are
    else:
        if a.probe:
            failures = probe_missing(ROOT, a.seeds)
        results = collect(ROOT, a.seeds)
        a.out = a.out or os.path.dirname(RESULTS)
        os.makedirs(os.path.join(ROOT, a.out), exist_ok=True)
        with open(os.path.join(ROOT, a.out, 'results.json'), 'w') as f:
            json.dump(results, f, indent=1)
    report(results, os.path.join(ROOT, a.out))
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
