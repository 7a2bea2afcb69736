"""
Mini-DepthBench, answered (docs/mini.md): the study's questions at CPU scale, with seeds,
every probe on the deepest models, and each finding beside the paper's number.

    python study/mini.py --train                  # trains and probes the planned runs (PLAN), then reports
    python study/mini.py --train --seed=3,5       # a share of the plan (also --schemes, --shapes)
    python study/mini.py                          # probe what is missing, collect, tables, figures, docs/mini.md
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
import checkpoint  # noqa: E402
from study import families  # noqa: E402
from study.results import _scheme_color, read_all, read_result, run_command, seed_runs  # noqa: E402

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
    'mhc_extra_params': 0.012,                                       # mHC's parameters over Pre-LN's, 400M
}


# -----------------------------------------------------------------------------
# the plan: training, and probing the deepest model of every seed

# The study's runs: seeds 0-2 of every scheme and shape, and seeds 3-7 of the three schemes of
# the paper's Fig. 2 at L = 4 and 8, the depth contrast and the probed shape (docs/mini.md).
PLAN = ((range(0, 3), families.MINI_SCHEMES, families.MINI_DEPTHS),
        (range(3, 8), ('preln', 'attnres', 'hc'), (4, 8)))
N_SEEDS = max(k for ks, _, _ in PLAN for k in ks) + 1

# The training-length ladder (docs/mini.md): the first rung is the plan above, 2.5 tokens per
# backbone parameter; each further rung (families.MINI_RUNGS) trains Pre-LN, Full AttnRes and HC
# at L = 4 and 8, seeds 0-5, on one recorded commit. The rows of a rung, stated and committed
# before its first run: (statistic, scheme), each per seed,
#   depth_cost  loss at L = 8 minus at L = 4, at the rung (Pre-LN: does the paper's cost appear?)
#   gap         the scheme's loss minus Pre-LN's at L = 8, at the rung, beside the paper's size
#   gap_change  that gap at the rung minus at 2.5 tokens per parameter, seeds paired across rungs
# tested as every row: two-sided paired t at 5%, Holm over the rung's tested rows (a family of
# its own; the first rung keeps the 14-row family it was stated with).
RUNG_SEEDS = range(0, 6)
RUNG_ROWS = (('depth_cost', 'preln'), ('gap', 'hc'), ('gap', 'attnres'), ('gap_change', 'hc'),
             ('gap_change', 'attnres'))


def planned(seeds=None, schemes=None, shapes=None):
    """The (seed, scheme, L) of PLAN that the mini family has, seed by seed, keeping only the
    seed indices, schemes and depths given (None = all)."""
    have = {(r.scheme, r.L) for r in families.runs('mini')}
    out = [(k, s, L) for ks, ss, Ls in PLAN for k in ks for s in ss for L in Ls
           if (s, L) in have and (seeds is None or k in seeds) and (schemes is None or s in schemes)
           and (shapes is None or L in shapes)]
    return sorted(dict.fromkeys(out), key=lambda t: t[0])


def train_run(k, scheme, L, root=ROOT):
    """Trains (or resumes) one planned run, seed index k, through study/sweep.py in its own
    process (sweep.py reports the mini study itself, so it is not imported here). Returns the
    failures, [(name, reason)] or []."""
    cmd = [sys.executable, os.path.join('study', 'sweep.py'), 'family=mini', f'schemes={scheme}', f'shapes={L}',
           f'seed={k}', f'seeds={k + 1}', 'probe=False']
    return [] if run_command(cmd, root) == 0 else [(f"{scheme}_L{L}_seed{k}", 'study/sweep.py failed')]


def train(seeds=None, schemes=None, shapes=None, probe=True, root=ROOT):
    """Trains the planned runs (finished ones skipped, interrupted ones resumed: study/sweep.py),
    seed by seed, the deepest shape first (it serves every probe row and the deepest-shape
    rows), probing each L = DEEPEST model (and each Block AttnRes model, for its read weights) as
    soon as it finishes. Returns the failures."""
    todo = planned(seeds, schemes, shapes)
    failures = []
    for k in dict.fromkeys(t[0] for t in todo):
        for L in sorted({L for kk, _, L in todo if kk == k}, reverse=True):
            for s in [s for kk, s, LL in todo if kk == k and LL == L]:
                failures += train_run(k, s, L, root)
                if probe and (L == DEEPEST or s == 'blockattnres'):
                    failures += probe_missing(root, N_SEEDS, only={k})
    return failures


def finished_runs(root=ROOT, seeds=3, schemes=None, shapes=None):
    """(seed k, run) for every mini run of these schemes and depths (None = all) that finished
    at its planned length (a run of another length is neither probed nor collected)."""
    out = []
    for run in families.runs('mini', schemes, shapes):
        for r in seed_runs(run, root, seeds):
            if read_result(r, root)['status'] == 'finished':
                out.append((r.info.get('seed', 0), r))
    return out


def deepest_runs(root=ROOT, seeds=3):
    """(seed k, run) for the L = DEEPEST run of every mini scheme and seed that finished."""
    return finished_runs(root, seeds, shapes=[DEEPEST])


def probe_targets(root=ROOT, seeds=3):
    """(seed k, run, metrics): every metric on each L = DEEPEST model, and Block AttnRes's
    read weights on its shallower models (whether the low-use segment grows with depth)."""
    return [(k, r, PROBE_METRICS) for k, r in deepest_runs(root, seeds)] + \
        [(k, r, ('block_weights',)) for k, r in finished_runs(root, seeds, ['blockattnres']) if r.L != DEEPEST]


def probe_json(run, root=ROOT):
    return os.path.join(root, run.out_dir, 'probe', 'probe.json')


def probe_missing(root=ROOT, seeds=3, only=None):
    """Runs probe.py on every checkpoint of probe_targets (of the seed indices in `only`,
    None = all) whose probe.json lacks one of its metrics (probe.py keeps what an earlier
    probe.json holds). Returns the (name, reason) of failures."""
    failures = []
    for k, run, metrics in probe_targets(root, seeds):
        if only is not None and k not in only:
            continue
        have = _read(probe_json(run, root)) or {}
        todo = [m for m in metrics if m not in have and m not in have.get('skipped', {})]
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
        s['low_use_sublayers'] = _low_use(p['block_weights'])
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

def _low_use(bw):
    """The low-use sublayers of a block_weights result (probe files written before the key's
    rename call it 'dead_sublayers')."""
    return bw['low_use_sublayers'] if 'low_use_sublayers' in bw else bw['dead_sublayers']


def collect(root=ROOT, seeds=N_SEEDS, prior=None):
    """{'runs': one row per planned run (sweep.read_result's, with 'seed', and 'wall_s',
    'machine' and 'commits' where study/sweep.py timed it), 'probes': {scheme: {seed: summary}} of the
    L = DEEPEST models, 'low_use': {L: {seed: low-use sublayers}} of Block AttnRes's shallower
    models, the budget and the deepest L} from the out/ directories. A run or probe that out/ lacks is taken from
    `prior` (a results dict; default the committed RESULTS), so a fresh checkout that trains
    only some seeds keeps the rest. Every planned seed is read, whatever `seeds`; a run that
    finished at another length than its config's max_iters (a short trial in the study's
    out_dir) is not the planned run: one warning line, and the prior's row and probes stand."""
    if prior is None:
        prior = _read(os.path.join(root, RESULTS))
    prior = prior if is_results(prior) else {'runs': [], 'probes': {}}
    old = {(r['scheme'], r['L'], r.get('seed', 0)): r for r in prior['runs'] if r.get('status') == 'finished'}
    plan = {(s, L, k) for k, s, L in planned()}
    seeds = max(seeds, N_SEEDS)
    other = set()  # (scheme, L, seed) of runs in out/ that are not the planned run
    rows = []
    for r in read_all('mini', root, seeds):
        key = (r['scheme'], r['L'], r['seed'])
        if r['status'] == 'other_length':
            print(f"warning: {r['out_dir']} {r['other_length']}: left out"
                  + (f" ({RESULTS}'s row kept)" if key in old else ''), file=sys.stderr)
            other.add(key)
        if key not in plan:
            continue
        if r['status'] != 'finished' and key in old:
            r = old[key]
        else:
            t = _read(os.path.join(root, r['out_dir'], 'wall_time.json')) or {}
            r = dict(r, wall_s=t.get('wall_s'), machine=t.get('machine'), commits=t.get('commits'))
        rows.append(r)
    probes = {s: dict(v) for s, v in prior['probes'].items()}
    for k, run in deepest_runs(root, seeds):
        p = _read(probe_json(run, root))
        if p and (run.scheme, run.L, k) in plan - other:
            probes.setdefault(run.scheme, {})[str(k)] = probe_summary(p, run.L)
    probes = {s: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for s, v in probes.items()}
    low_use = {L: dict(v) for L, v in (prior.get('low_use') or {}).items()}
    for k, run in finished_runs(root, seeds, ['blockattnres']):
        p = _read(probe_json(run, root))
        if p and 'block_weights' in p and run.L != DEEPEST and ('blockattnres', run.L, k) in plan - other:
            low_use.setdefault(str(run.L), {})[str(k)] = _low_use(p['block_weights'])
    low_use = {L: dict(sorted(low_use[L].items(), key=lambda kv: int(kv[0]))) for L in sorted(low_use, key=int)}
    return {'family': 'mini', 'tokens_per_backbone_param': families.MINI_TOKENS_PER_PARAM,
            'deepest': DEEPEST, 'runs': rows, 'probes': probes, 'low_use': low_use}


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
    paper's effect on this study's scale, None where it gives no size or the measure is on
    another scale, as the late-pair shares of these shallow models are), paper_sign, the
    t_test fields (mean, se, n, t, p, lo, hi), p_holm, verdict, statistic, and note (why a row
    is not testable, or its unit in late pairs). A loss effect is scaled by the ratio of
    losses: the paper's difference over its Pre-LN loss at the same shape (Fig. 2), times this
    study's Pre-LN mean loss at the matching shape.
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
            [depth_cost('preln', k, L1, L2) for k in seeds], +1, 'loss at the deeper shape minus the shallower, per seed',
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
                f"{key} difference, paired by seed",
                note=f"seeds differ by {', '.join(f'{q:+d}' for q in pairs)} of {n_late} late pairs" if diffs else '')
    low = {int(d): {int(k): n for k, n in v.items()} for d, v in (results.get('low_use') or {}).items()}
    for k in seeds:  # the deepest models' counts are in their probe summaries
        if probe('blockattnres', k, 'low_use_sublayers') is not None:
            low.setdefault(results['deepest'], {})[k] = probe('blockattnres', k, 'low_use_sublayers')
    depths = sorted(d for d in low if low[d])
    if len(depths) > 1:  # growth over the last doubling probed, in layers (two sublayers each)
        d1, d2 = depths[-2:]
        add(f"Block AttnRes: an early low-use segment that grows with depth (L {d1} -> {d2})",
            "2 / 5 / 8 layers at L = 16 / 24 / 32", [(low[d2][k] - low[d1][k]) / 2 if k in low[d1] and k in low[d2]
                                                     else None for k in seeds], +1,
            'growth of the leading layers (sublayers / 2) whose reads put < 0.1 on the running block sum, '
            'paired by seed')
    else:
        add(f"Block AttnRes: an early low-use segment that grows with depth (L {L})",
            "2 / 5 / 8 layers at L = 16 / 24 / 32", [None if low.get(L, {}).get(k) is None else low[L][k] / 2
                                                     for k in seeds], +1,
            'leading layers (sublayers / 2) whose reads put < 0.1 on the running block sum',
            untestable="the claim is growth with depth; probed at " + (f"one depth (L = {depths[0]})" if depths
                                                                       else "no depth"))
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
# docs/mini.md: the blocks between <!-- begin NAME --> and <!-- end NAME --> are written here

def _seed_list(ks):
    """[0, 1, 2, 4] -> '0–2, 4'."""
    out, ks = [], sorted(ks)
    i = 0
    while i < len(ks):
        j = i
        while j + 1 < len(ks) and ks[j + 1] == ks[j] + 1:
            j += 1
        out.append(f"{ks[i]}" if i == j else f"{ks[i]}–{ks[j]}")
        i = j + 1
    return ', '.join(out)


def _finished(results):
    return [r for r in results['runs'] if r['status'] == 'finished' and r['val_loss'] is not None]


def format_seeds(results):
    """Which seeds every (scheme, L) cell has, grouped by identical seed sets."""
    cells = {}
    for r in _finished(results):
        cells.setdefault((r['scheme'], r['L']), set()).add(r.get('seed', 0))
    groups = {}
    for (s, L), ks in sorted(cells.items(), key=lambda kv: (families.MINI_SCHEMES.index(kv[0][0]), kv[0][1])):
        groups.setdefault(tuple(sorted(ks)), []).append(f"{s} L = {L}")
    lines = [f"- {len(ks)} seed{'s' if len(ks) > 1 else ''} ({_seed_list(ks)}): {', '.join(c)}"
             for ks, c in sorted(groups.items(), key=lambda kv: -len(kv[0]))]
    missing = {}
    for r in results['runs']:
        if r['status'] != 'finished':
            missing.setdefault((r['scheme'], r['L']), []).append(r.get('seed', 0))
    if missing:
        lines.append(f"- planned, not finished ({sum(map(len, missing.values()))} runs): " + ', '.join(
            f"{s} L = {L} seeds {_seed_list(ks)}" for (s, L), ks in missing.items()))
    probed = {s: sorted(int(k) for k in v) for s, v in results['probes'].items()}
    lines.append(f"- probes at L = {results['deepest']}: " + '; '.join(
        f"{s} seeds {_seed_list(probed[s])}" for s in families.MINI_SCHEMES if s in probed))
    for L, v in (results.get('low_use') or {}).items():
        lines.append(f"- Block AttnRes's read weights (block_weights) at L = {L}: seeds {_seed_list(sorted(map(int, v)))}")
    return "\n".join(lines)


def format_loss(results):
    """Validation loss per scheme (columns) and depth (rows): mean ± s.e. (seeds)."""
    done = _finished(results)
    schemes = [s for s in families.MINI_SCHEMES if any(r['scheme'] == s for r in done)]
    lines = ["| L (d/L) | " + " | ".join(schemes) + " |", "|---" * (len(schemes) + 1) + "|"]
    for L in sorted({r['L'] for r in done}):
        ratio = next(r['ratio'] for r in done if r['L'] == L)
        cells = []
        for s in schemes:
            m, se, n = paired([r['val_loss'] for r in done if r['scheme'] == s and r['L'] == L])
            cells.append('–' if m is None else f"{m:.3f}" + ('' if se is None else f" ± {se:.3f}") + f" ({n})")
        lines.append(f"| {L} ({ratio:.0f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_confounds(results):
    """What else changes with L: the backbone and tokens, and each scheme's parameters over Pre-LN's."""
    done = _finished(results)
    by = {(r['scheme'], r['L']): r for r in done}
    Ls = sorted({r['L'] for r in done})
    if not Ls:
        return "- no finished run"
    lo, hi = by.get(('preln', Ls[0])), by.get(('preln', Ls[-1]))
    lines = []
    if lo and hi:
        lines.append(f"- **The backbone is not fixed exactly**: {lo['backbone']:,} parameters at L = {Ls[0]}, "
                     f"{hi['backbone']:,} at L = {Ls[-1]} ({hi['backbone'] / lo['backbone'] - 1:+.0%}); the budget "
                     f"is per backbone parameter, so the tokens grow with it ({lo['tokens'] / 1e6:.2f}M → "
                     f"{hi['tokens'] / 1e6:.2f}M, {hi['tokens'] / lo['tokens'] - 1:+.0%}). A depth contrast "
                     f"therefore also compares a larger model trained on more tokens.")
    for s in families.MINI_SCHEMES:
        if s == 'preln':
            continue
        extra = [(L, by[(s, L)]['n_params'] / by[('preln', L)]['n_params'] - 1) for L in Ls
                 if (s, L) in by and ('preln', L) in by and by[(s, L)].get('n_params') and by[('preln', L)].get('n_params')]
        if extra:
            lines.append(f"- {s}: " + ', '.join(f"{e:+.1%} at L = {L}" for L, e in extra) + " parameters over Pre-LN"
                         + (f" (the paper's mHC: {PAPER['mhc_extra_params']:+.1%})" if s == 'mhc' else ''))
    return "\n".join(lines)


def format_verdicts(rows):
    """The findings grouped by verdict, one line per verdict, generated from the rows."""
    tested = sum(r['p'] is not None for r in rows)
    order = ('reproduces', 'opposite', 'differs from the paper', "bounded below the paper's size",
             'not resolved at this scale', 'not testable here')
    lines = [f"Of {len(rows)} rows, {tested} are tested (Holm over {tested}):"]
    for v in order:
        mine = [r for r in rows if r['verdict'] == v]
        if not mine:
            continue
        lines.append(f"- **{v}** ({len(mine)}):")
        for r in mine:
            pct = 'R_' in r['statistic']
            lines.append(f"  - {r['finding']}: " + (r['note'] if v == 'not testable here' else
                         f"{_fmt(r['mean'], r['se'], r['n'], pct)}, p (Holm) {_p(r.get('p_holm'))}"))
    return "\n".join(lines)


def format_timing(results):
    """The recorded wall time, machine and code version of the runs that have them."""
    timed = [r for r in _finished(results) if r.get('wall_s')]
    untimed = len(_finished(results)) - len(timed)
    if not timed:
        return f"- no run carries a recorded wall time ({untimed} finished runs)"
    lines = []
    for L in sorted({r['L'] for r in timed}):
        w = [r['wall_s'] / 60 for r in timed if r['L'] == L]
        span = f"{min(w):.0f}" if round(min(w)) == round(max(w)) else f"{min(w):.0f}–{max(w):.0f}"
        lines.append(f"- L = {L}: {len(w)} timed run{'s' if len(w) > 1 else ''}, {span} minutes of wall time each "
                     f"({next(r['iter'] for r in timed if r['L'] == L)} steps)")
    machines = sorted({(m.get('cpu'), m.get('cpus'), m.get('threads'), m.get('platform'))
                       for m in (r.get('machine') or {} for r in timed)}, key=str)
    for cpu, cpus, threads, plat in machines:
        lines.append(f"- machine: {cpu}, {cpus} logical CPUs, OMP_NUM_THREADS={threads} per run, {plat}")
    lines.append(f"- total {sum(r['wall_s'] for r in timed) / 3600:.1f} process-hours over {len(timed)} runs; "
                 f"{untimed} finished runs carry no recorded wall time")
    versioned = [r for r in _finished(results) if r.get('commits')]
    if versioned:  # the code that trained them (sweep.code_version at each launch)
        commits = sorted({c for r in versioned for c in r['commits']})
        lines.append(f"- code: {len(commits)} commit{'s' if len(commits) > 1 else ''} ({', '.join(commits)}) over the "
                     f"{len(versioned)} runs that record one; {len(_finished(results)) - len(versioned)} record none")
    return "\n".join(lines)


def doc_blocks(results):
    """{block name: markdown} for docs/mini.md, all generated from `results`."""
    rows = findings(results)
    return {'seeds': format_seeds(results), 'loss': format_loss(results), 'confounds': format_confounds(results),
            'findings': format_findings(rows), 'verdicts': format_verdicts(rows),
            'probes': format_probes(results), 'timing': format_timing(results)}


def render_doc(text, results):
    """`text` with every <!-- begin NAME --> ... <!-- end NAME --> block replaced by doc_blocks'.
    Raises ValueError naming a block the text lacks."""
    import re
    for name, body in doc_blocks(results).items():
        pat = re.compile(rf"(<!-- begin {name} -->\n).*?(<!-- end {name} -->)", re.S)
        if not pat.search(text):
            raise ValueError(f"docs/mini.md has no <!-- begin {name} --> ... <!-- end {name} --> block")
        text = pat.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


# -----------------------------------------------------------------------------
# figures

def _t_interval(vals):
    """(mean, half-width of the 95% Student interval, n) of a list; half-width None below 2 values."""
    t = t_test(vals)
    return t['mean'], (None if t['hi'] is None else t['hi'] - t['mean']), t['n']


def plot_loss(results, rows, path):
    """
    Two panels. Left: validation loss against depth L (log axis) per scheme, the mean over
    seeds with its 95% t-interval (unpaired: the spread of single runs) and a dot per seed.
    Right: the paired loss findings (rows: findings()'s), mean with its 95% t-interval, and
    the paper's effect scaled to this loss (x) where it has one. Writes a PNG to path.
    """
    from study.results import _plt
    plt = _plt()
    done = _finished(results)
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
    marked = [i for i, r in enumerate(loss_rows) if r['paper_effect'] is not None]
    for i, r in enumerate(loss_rows):
        y = len(loss_rows) - 1 - i
        if r['mean'] is not None:
            h = None if r['hi'] is None else r['hi'] - r['mean']
            bx.errorbar(r['mean'], y, xerr=h, fmt='o', color='k', capsize=3)
        if r['paper_effect'] is not None:  # one legend entry, on the first marked row
            bx.plot(r['paper_effect'], y, 'x', color='C3', ms=8, mew=2,
                    label="the paper's effect scaled to this loss" if i == marked[0] else None)
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


def plot_probes(results, rows, path):
    """
    Top: the deepest models' probe numbers per scheme, bars = mean over seeds with its 95%
    t-interval (unpaired), dots = seeds. Bottom: the paired probe findings (rows:
    findings()'s) against Pre-LN, mean with its 95% t-interval. No paper marks: the paper
    measures 400M models at L = 32 (erank across its shapes), not comparable to these models.
    """
    from study.results import _plt
    plt = _plt()
    pr = results['probes']
    L = results['deepest']
    panels = [('R_causal', f'late pairs with causal score > 0.45\n(of {late_pairs(L)} at L = {L})',
               'share of late pairs'),
              ('R_perm', f'late pairs with permutation score > 0.15\n(of {late_pairs(L)} at L = {L})',
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
    fig.suptitle(f"mini-DepthBench probes of the L = {L} models. Top: mean over seeds with its 95% t-interval "
                 f"(unpaired), dots = single seeds. Bottom: the paired findings", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results, out_dir, wrote=()):
    """Prints the loss, findings and probe tables, writes the figures into out_dir, then one
    'wrote' line for each file of `wrote` (written before) and each figure."""
    os.makedirs(out_dir, exist_ok=True)
    rows = findings(results)
    for text in (format_loss(results), format_findings(rows), format_verdicts(rows), format_probes(results)):
        print(text + "\n")
    figures = [os.path.join(out_dir, 'loss_vs_ratio.png'), os.path.join(out_dir, 'probes.png')]
    plot_loss(results, rows, figures[0])
    if results['probes']:
        plot_probes(results, rows, figures[1])
    for p in [*wrote, *figures]:
        if os.path.exists(p):
            print(f"wrote {p}")


def positive_int(text):
    """argparse type: an integer >= 1 (argparse turns the ValueError into one line)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--results', help="read this results.json instead of out/mini (e.g. the committed "
                                     f"{RESULTS}); nothing is probed or written but the figures")
    p.add_argument('--seeds', type=positive_int, default=N_SEEDS,
                   help=f"seed indices 0..N-1 to collect and probe; every planned seed is always collected ({N_SEEDS})")
    p.add_argument('--train', action='store_true', help="first train and probe the planned runs (PLAN) that "
                                                          "are not finished, seed by seed")
    p.add_argument('--seed', default=None, help="with --train: only these seed indices, e.g. 3,5,7")
    p.add_argument('--schemes', default=None, help="with --train: only these schemes, e.g. preln,hc")
    p.add_argument('--shapes', default=None, help="with --train: only these depths L, e.g. 4,8")
    p.add_argument('--probe', default=True, type=lambda s: s.lower() == 'true', help="probe what is missing (True)")
    p.add_argument('--out', default=None, help=f"where results.json and the figures go ({os.path.dirname(RESULTS)}; "
                                               "with --results, the figures only, to out/mini)")
    a = p.parse_args(argv)
    failures, wrote = [], []
    if a.results:
        results = _read(a.results)
        if not is_results(results):
            print(f"error: {a.results} is missing or not a mini results.json (a dict with 'runs', "
                  f"'probes', 'tokens_per_backbone_param' and 'deepest')", file=sys.stderr)
            return 2
        a.out = a.out or os.path.join('out', 'mini')  # the committed figures stay as they are
    else:
        if not a.train and (a.seed or a.schemes or a.shapes):
            print("error: --seed, --schemes and --shapes choose runs to train: use them with --train", file=sys.stderr)
            return 2
        if a.train:
            try:
                pick = [None if x is None else [y.strip() for y in x.split(',') if y.strip()]
                        for x in (a.seed, a.schemes, a.shapes)]
                seeds, shapes = [None if x is None else {int(y) for y in x} for x in (pick[0], pick[2])]
            except ValueError:
                print("error: --seed and --shapes take comma-separated integers, e.g. --seed=3,5 --shapes=4,8",
                      file=sys.stderr)
                return 2
            if not planned(seeds, pick[1], shapes):
                asked = ', '.join(f"{n} {v}" for n, v in (('seed', a.seed), ('scheme', a.schemes), ('L', a.shapes)) if v)
                print(f"error: no planned run has {asked} (PLAN in study/mini.py: seeds 0-{N_SEEDS - 1}, schemes "
                      f"{', '.join(families.MINI_SCHEMES)}, L {', '.join(map(str, families.MINI_DEPTHS))})", file=sys.stderr)
                return 2
            failures = train(seeds, pick[1], shapes, a.probe)
        elif a.probe:
            failures = probe_missing(ROOT, a.seeds)
        results = collect(ROOT, a.seeds)
        a.out = a.out or os.path.dirname(RESULTS)
        os.makedirs(os.path.join(ROOT, a.out), exist_ok=True)
        wrote.append(os.path.join(ROOT, a.out, 'results.json'))
        checkpoint.write_json(wrote[-1], results)  # a temp name of its own
        if a.out == os.path.dirname(RESULTS):  # the committed results: docs/mini.md's blocks follow them
            doc = os.path.join(ROOT, 'docs', 'mini.md')
            try:
                with open(doc) as f:
                    text = render_doc(f.read(), results)
            except (OSError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            checkpoint.atomic_write(doc, lambda tmp: checkpoint.write_bytes(tmp, text.encode()))
            wrote.append(doc)
    report(results, os.path.join(ROOT, a.out), wrote)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
