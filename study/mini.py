"""
Mini-DepthBench, answered (docs/mini.md): the study's questions at CPU scale, with seeds,
every probe on the deepest models, and each finding beside the paper's number.

    python study/sweep.py family=mini seeds=3     # trains the runs, then calls this file's report()
    python study/mini.py                          # probe what is missing, collect, table, figures
    python study/mini.py --results=docs/mini/results.json   # tables from a results file, figures to out/mini

The sweep is paired: seed k gives every scheme and shape the same data order (train.py's
loader is seeded by the run's seed alone) and the same held-out windows, so depth costs and
scheme differences are taken within each seed and their mean and standard error are over
seeds. A finding's verdict: `reproduces` when its paired mean has the paper's sign and is
more than twice its standard error, `opposite` when it has the other sign and is more than
twice its standard error, `not resolved at this scale` otherwise.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, when run as a script
from study import families  # noqa: E402
from study.results import (_scheme_color, _with_loss, format_summary, plot_loss_vs_ratio, read_all,  # noqa: E402
                           run_command, run_status, seed_runs)

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
    out = []
    for run in families.runs('mini', shapes=[DEEPEST]):
        for r in seed_runs(run, root, seeds):
            if run_status(r, root) == 'finished':
                out.append((r.info.get('seed', 0), r))
    return out


def probe_json(run, root=ROOT):
    return os.path.join(root, run.out_dir, 'probe', 'probe.json')


def probe_missing(root=ROOT, seeds=3):
    """Runs probe.py on every deepest checkpoint whose probe.json lacks a metric (probe.py
    keeps what an earlier probe.json holds). Returns the (name, reason) of failures."""
    failures = []
    for k, run in deepest_runs(root, seeds):
        have = _read(probe_json(run, root)) or {}
        todo = [m for m in PROBE_METRICS if m not in have and m not in have.get('skipped', {})]
        if not todo:
            continue
        cmd = [sys.executable, 'probe.py', f'--ckpt={os.path.join(run.out_dir, "ckpt.pt")}',
               f'--metrics={",".join(todo)}', *PROBE_ARGS]
        print(f"probe: {' '.join(cmd[1:])}", flush=True)
        if run_command(cmd, root) != 0:
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
    rows = read_all('mini', root, seeds)
    probes = {}
    for k, run in deepest_runs(root, seeds):
        p = _read(probe_json(run, root))
        if p:
            probes.setdefault(run.scheme, {})[str(k)] = probe_summary(p, run.L)
    return {'family': 'mini', 'tokens_per_backbone_param': families.MINI_TOKENS_PER_PARAM,
            'deepest': DEEPEST, 'runs': rows, 'probes': probes}


def paired(xs):
    """(mean, standard error, n) of per-seed values (None for missing seeds dropped)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    n = len(xs)
    if not n:
        return None, None, 0
    m = sum(xs) / n
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else None
    return m, se, n


def verdict(mean, se, paper_sign):
    if mean is None or se is None:
        return 'not resolved at this scale'
    if abs(mean) <= 2 * se:
        return 'not resolved at this scale'
    return 'reproduces' if (mean > 0) == (paper_sign > 0) else 'opposite'


def findings(results):
    """The table rows: dicts with finding, paper, ours (mean, se, n), verdict, statistic."""
    loss = {}  # (scheme, L, seed) -> val loss
    for r in results['runs']:
        if r['status'] == 'finished' and r['val_loss'] is not None:
            loss[(r['scheme'], r['L'], r.get('seed', 0))] = r['val_loss']
    seeds = sorted({k for (_, _, k) in loss})
    L1, L2 = sorted(families.MINI_DEPTHS)[-2:]  # the last doubling, as the paper's 16 -> 32

    def depth_cost(s, k):
        a, b = loss.get((s, L2, k)), loss.get((s, L1, k))
        return None if a is None or b is None else a - b

    P = PAPER
    cost = {s: P['loss_L32'][s] - P['loss_L16'][s] for s in ('preln', 'attnres', 'hc')}
    rows = []

    def add(finding, paper, values, paper_sign, stat):
        m, se, n = paired(values)
        rows.append(dict(finding=finding, paper=paper, mean=m, se=se, n=n, verdict=verdict(m, se, paper_sign),
                         statistic=stat))

    add(f"Pre-LN: extra depth costs loss (L {L1} -> {L2}; paper 16 -> 32)", f"{cost['preln']:+.3f}",
        [depth_cost('preln', k) for k in seeds], cost['preln'], 'loss(L2) - loss(L1), per seed')
    for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
        d = cost[s] - cost['preln']
        add(f"{name} turns depth into lower loss than Pre-LN", f"{d:+.3f}",
            [None if depth_cost(s, k) is None or depth_cost('preln', k) is None
             else depth_cost(s, k) - depth_cost('preln', k) for k in seeds], d,
            'depth cost minus Pre-LN\'s, paired by seed')
    for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
        d = P['loss_L32'][s] - P['loss_L32']['preln']
        add(f"{name} below Pre-LN at the deepest shape (L {L2}; paper 32)", f"{d:+.3f}",
            [None if loss.get((s, L2, k)) is None or loss.get(('preln', L2, k)) is None
             else loss[(s, L2, k)] - loss[('preln', L2, k)] for k in seeds], d, 'loss difference, paired by seed')
    pr = results['probes']

    def probe_diff(key, a, b):
        return [None if pr.get(a, {}).get(k, {}).get(key) is None or pr.get(b, {}).get(k, {}).get(key) is None
                else pr[a][k][key] - pr[b][k][key] for k in map(str, seeds)]
    for key, label in (('R_causal', 'causal score > 0.45'), ('R_perm', 'permutation score > 0.15')):
        for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
            d = P[key][s] - P[key]['preln']
            add(f"{name}: more late pairs with {label} than Pre-LN (L {L2}; paper 32)",
                f"{P[key][s]:.0%} vs {P[key]['preln']:.0%}", probe_diff(key, s, 'preln'), d,
                f"{key} difference, paired by seed")
    low = [pr.get('blockattnres', {}).get(str(k), {}).get('low_use_sublayers') for k in seeds]
    add(f"Block AttnRes: an early low-use segment (L {L2})", "2 / 5 / 8 layers at L = 16 / 24 / 32",
        [None if x is None else x / 2 for x in low], 1, 'leading layers (sublayers / 2) whose reads put < 0.1 '
        'on the running block sum')
    add(f"HC's composed residual map has a higher effective rank than mHC's (L {L2})",
        "2.53-2.81 vs 1.44-1.65", probe_diff('erank', 'hc', 'mhc'), 1, 'erank difference, paired by seed')
    for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
        add(f"Dropping a late block costs {name} more than Pre-LN (L {L2})", "qualitative (Fig. 8 left)",
            probe_diff('prune_late', s, 'preln'), 1, 'held-out loss added by one dropped late block, paired')
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


def format_findings(rows):
    lines = ["| finding | paper | ours (mean ± s.e., seeds) | verdict | statistic |", "|---|---|---|---|---|"]
    for r in rows:
        pct = 'R_' in r['statistic']
        lines.append(f"| {r['finding']} | {r['paper']} | {_fmt(r['mean'], r['se'], r['n'], pct)} | "
                     f"{r['verdict']} | {r['statistic']} |")
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
    os.makedirs(out_dir, exist_ok=True)
    rows = results['runs']
    print(format_summary(rows))
    print()
    print(format_findings(findings(results)))
    print()
    print(format_probes(results))
    written = [os.path.join(out_dir, 'loss_vs_ratio.png'), os.path.join(out_dir, 'probes.png')]
    plot_loss_vs_ratio([(f"mini: fixed backbone ≈0.8M, byte-level text, "
                         f"{results['tokens_per_backbone_param']:g} tokens per backbone parameter",
                         _with_loss(rows))], written[0])
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
