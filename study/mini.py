"""
Mini-DepthBench, answered (docs/mini.md): the study's questions at CPU scale, with seeds,
every probe on the deepest models, and each finding beside the paper's number.

    python study/mini.py --train                  # trains and probes the planned runs (PLAN), then reports
    python study/mini.py --train --seed=3,5       # a share of the plan (also --schemes, --shapes)
    python study/mini.py --train --rung=5         # the training-length ladder's second rung (RUNG_ROWS)
    python study/mini.py                          # probe what is missing, collect, tables, figures, docs/mini.md
    python study/mini.py --results=docs/mini/results.json   # tables from a results file, figures to out/mini

The sweep is paired: seed k gives every scheme, shape and rung the same data order (train.py's
loader is seeded by the run's seed alone) and the same held-out windows, so depth costs,
scheme differences and changes between rungs are taken within each seed and their mean and
standard error are over seeds. The test of a finding: a two-sided paired t-test at 5% with
n - 1 degrees of freedom on its per-seed values, Holm's correction over the tested rows of its
rung's table, the paper's effect on this scale as a fraction of loss and in nats per byte, and
the verdicts of study/stats.py (docs/mini.md states the rules and the contrasts).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, when run as a script
import checkpoint  # noqa: E402
from study import families, stats  # noqa: E402
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


def planned(seeds=None, schemes=None, shapes=None, tpp=None):
    """The (seed, scheme, L) of a rung's plan, seed by seed, keeping only the seed indices,
    schemes and depths given (None = all): PLAN for the first rung (tpp None), RUNG_SEEDS of the
    family of a further rung (tpp: its tokens per backbone parameter, a key of
    families.MINI_RUNGS)."""
    family = rung_family(tpp)
    have = {(r.scheme, r.L) for r in families.runs(family)}
    plan = PLAN if family == 'mini' else ((RUNG_SEEDS, families.HEADLINE, families.MINI_RUNG_DEPTHS),)
    out = [(k, s, L) for ks, ss, Ls in plan for k in ks for s in ss for L in Ls
           if (s, L) in have and (seeds is None or k in seeds) and (schemes is None or s in schemes)
           and (shapes is None or L in shapes)]
    return sorted(dict.fromkeys(out), key=lambda t: t[0])


def rung_family(tpp=None):
    """The family of a rung: 'mini' for the first (None or 2.5), families.MINI_RUNGS[tpp] for a
    further one. Raises ValueError naming the rungs for any other."""
    if tpp is None or tpp == families.MINI_TOKENS_PER_PARAM:
        return 'mini'
    if tpp not in families.MINI_RUNGS:
        raise ValueError(f"no rung at {tpp:g} tokens per parameter; the ladder has "
                         f"{', '.join(f'{t:g}' for t in (families.MINI_TOKENS_PER_PARAM, *families.MINI_RUNGS))}")
    return families.MINI_RUNGS[tpp]


def train_run(k, scheme, L, root=ROOT, family='mini'):
    """Trains (or resumes) one planned run of a family, seed index k, through study/sweep.py in
    its own process (sweep.py reports the mini study itself, so it is not imported here).
    Returns the failures, [(name, reason)] or []."""
    cmd = [sys.executable, os.path.join('study', 'sweep.py'), f'family={family}', f'schemes={scheme}', f'shapes={L}',
           f'seed={k}', f'seeds={k + 1}', 'probe=False']
    return [] if run_command(cmd, root) == 0 else [(f"{family}/{scheme}_L{L}_seed{k}", 'study/sweep.py failed')]


def train(seeds=None, schemes=None, shapes=None, probe=True, root=ROOT, tpp=None):
    """Trains the planned runs of a rung (finished ones skipped, interrupted ones resumed:
    study/sweep.py), seed by seed, the deepest shape first (it serves every probe row and the
    deepest-shape rows). On the first rung it probes each L = DEEPEST model (and each Block
    AttnRes model, for its read weights) as soon as it finishes; a further rung has no probe
    rows. Returns the failures."""
    family = rung_family(tpp)
    todo = planned(seeds, schemes, shapes, tpp)
    failures = []
    for k in dict.fromkeys(t[0] for t in todo):
        for L in sorted({L for kk, _, L in todo if kk == k}, reverse=True):
            for s in [s for kk, s, LL in todo if kk == k and LL == L]:
                failures += train_run(k, s, L, root, family)
                if probe and family == 'mini' and (L == DEEPEST or s == 'blockattnres'):
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


def _collect_runs(family, plan, prior_runs, root, seeds, where):
    """One row per planned run of a family (plan: {(scheme, L, seed)}) from out/, with
    'wall_s', 'machine' and 'commits' where study/sweep.py timed it; an unfinished one from
    prior_runs when they hold it finished. A run of another length is not the planned run: one
    warning line (naming `where`, the results file, when its row is kept). Returns (rows, the
    (scheme, L, seed) of runs of another length)."""
    old = {(r['scheme'], r['L'], r.get('seed', 0)): r for r in prior_runs if r.get('status') == 'finished'}
    other, rows = set(), []
    for r in read_all(family, root, seeds):
        key = (r['scheme'], r['L'], r['seed'])
        if r['status'] == 'other_length':
            print(f"warning: {r['out_dir']} {r['other_length']}: left out"
                  + (f" ({where}'s row kept)" if key in old else ''), file=sys.stderr)
            other.add(key)
        if key not in plan:
            continue
        if r['status'] != 'finished' and key in old:
            r = old[key]
        else:
            t = _read(os.path.join(root, r['out_dir'], 'wall_time.json')) or {}
            r = dict(r, wall_s=t.get('wall_s'), machine=t.get('machine'), commits=t.get('commits'))
        rows.append(r)
    return rows, other


def collect(root=ROOT, seeds=N_SEEDS, prior=None):
    """{'runs': one row per planned run of the first rung (sweep.read_result's, with 'seed', and
    'wall_s', 'machine' and 'commits' where study/sweep.py timed it), 'probes': {scheme: {seed:
    summary}} of the L = DEEPEST models, 'low_use': {L: {seed: low-use sublayers}} of Block
    AttnRes's shallower models, 'rungs': {tokens per parameter: {'family', 'tokens_per_backbone_param',
    'runs'}} of every further rung, the budget and the deepest L} from the out/ directories. A
    run or probe that out/ lacks is taken from `prior` (a results dict; default the committed
    RESULTS), so a fresh checkout that trains only some seeds keeps the rest. Every planned seed
    is read, whatever `seeds`; a run that finished at another length than its config's
    max_iters (a short trial in the study's out_dir) is not the planned run: one warning line,
    and the prior's row and probes stand."""
    if prior is None:
        prior = _read(os.path.join(root, RESULTS))
    prior = prior if is_results(prior) else {'runs': [], 'probes': {}}
    plan = {(s, L, k) for k, s, L in planned()}
    seeds = max(seeds, N_SEEDS)
    rows, other = _collect_runs('mini', plan, prior['runs'], root, seeds, RESULTS)
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
    rungs = {}
    for tpp, family in families.MINI_RUNGS.items():
        had = (prior.get('rungs') or {}).get(f"{tpp:g}") or {}
        plan = {(s, L, k) for k, s, L in planned(tpp=tpp)}
        runs, _ = _collect_runs(family, plan, had.get('runs') or [], root, len(RUNG_SEEDS), RESULTS)
        rungs[f"{tpp:g}"] = {'family': family, 'tokens_per_backbone_param': tpp, 'runs': runs}
    return {'family': 'mini', 'tokens_per_backbone_param': families.MINI_TOKENS_PER_PARAM,
            'deepest': DEEPEST, 'runs': rows, 'probes': probes, 'low_use': low_use, 'rungs': rungs}


# The paper's loss effects are in nats per GPT-2 token of its data; this study's losses are in nats
# per byte. The sample's bytes per GPT-2 token (data/sample/SOURCES.md: 3,094,132 byte tokens,
# 653,670 GPT-2 tokens, one end-of-text per document in each) converts one into the other.
BYTES_PER_TOKEN = 3_094_132 / 653_670  # 4.733
SCALINGS = {'F': 'fraction of loss', 'B': 'nats per byte'}


def paper_here(effect, paper_loss, our_loss):
    """
    The paper's loss effect (nats per token) on this study's scale, two ways: {'F': as a
    fraction of the paper's Pre-LN loss at that shape (paper_loss), times our Pre-LN mean loss
    at the matching shape (our_loss; None if we have none); 'B': in nats per byte, the effect
    over BYTES_PER_TOKEN}.
    """
    return {'F': None if our_loss is None else effect / paper_loss * our_loss, 'B': effect / BYTES_PER_TOKEN}


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


def _losses(runs):
    """{(scheme, L, seed): validation loss} of the finished runs of a results list."""
    return {(r['scheme'], r['L'], r.get('seed', 0)): r['val_loss'] for r in runs
            if r['status'] == 'finished' and r['val_loss'] is not None}


def _minus(a, b):
    return None if a is None or b is None else a - b


def _row(finding, paper, vals, paper_sign, statistic, here=None, untestable=None, note='', kind='effect', towards=()):
    """One findings row before Holm: the t_test fields, the exact tests, the paper's size on this
    scale under each scaling ('here', {F, B} or None) and the interval's size() against each."""
    t = stats.t_test(vals)
    if untestable:
        t.update(t=None, p=None, lo=None, hi=None)
    sizes = {k: stats.size(t['lo'], t['hi'], v) for k, v in (here or {}).items()}
    return dict(finding=finding, paper=paper, paper_sign=paper_sign, statistic=statistic, here=here, sizes=sizes,
                size=stats.agreed_size(list(sizes.values())) if here else None, note=untestable or note,
                testable=not untestable, kind=kind, towards=list(towards), **t,
                **(stats.exact_tests(vals) if not untestable else dict(perm_p=None, sign_p=None, min_p=None)))


def _judge(rows):
    """Holm over the tested rows of one family, then each row's verdict and power: 'detectable',
    the smallest mean its t-test finds with 80% power at Holm's first-step level ALPHA / m
    (its level when no other row passes), from its own s.d. and n."""
    adj, _, level = stats.holm([r['p'] for r in rows])
    m = sum(r['p'] is not None for r in rows)
    for r, a, lv in zip(rows, adj, level):
        r.update(p_holm=a, holm_level=lv, family_size=m,
                 detectable=stats.detectable(r['sd'], r['n'], stats.ALPHA / m) if m and r['testable'] else None)
        if not r['testable']:
            r['verdict'] = stats.NOT_TESTABLE
        elif r['kind'] == 'change':
            r['verdict'] = stats.change_verdict(r, a, r['towards'])
        else:
            r['verdict'] = stats.verdict(r, a, r['paper_sign'], list(r['sizes'].values()))
    return rows


def findings(results):
    """
    The first rung's rows (2.5 tokens per backbone parameter): dicts with finding, paper (the
    paper's number as text), here (the paper's effect on this scale, {F, B}: paper_here; None
    where it gives no size or the measure is on another scale, as the late-pair shares of these
    shallow models are), sizes and size, paper_sign, the t_test and exact_tests fields, p_holm,
    holm_level, detectable, verdict, statistic and note. Holm runs over the tested rows of this
    table, the family stated before seeds 3-7.
    """
    loss = _losses(results['runs'])
    seeds = sorted({k for (_, _, k) in loss} | {int(k) for v in results['probes'].values() for k in v})
    pr = results['probes']
    P = PAPER
    rows = []

    def here(effect, paper_L, L):
        return paper_here(effect, P[f'loss_L{paper_L}']['preln'], _mean([loss.get(('preln', L, k)) for k in seeds]))

    def add(*a, **kw):
        rows.append(_row(*a, **kw))

    def depth_cost(s, k, L1, L2):
        return _minus(loss.get((s, L2, k)), loss.get((s, L1, k)))

    cost = {s: P['loss_L32'][s] - P['loss_L16'][s] for s in ('preln', 'attnres', 'hc')}
    for (L1, L2), tag in ((CONTRAST, ''), (MATCHED, ', d/L-matched')):
        add(f"Pre-LN: extra depth costs loss (L {L1} -> {L2}{tag}; paper 16 -> 32)", f"{cost['preln']:+.3f}",
            [depth_cost('preln', k, L1, L2) for k in seeds], +1, 'loss at the deeper shape minus the shallower, per seed',
            here(cost['preln'], 16, L1))
        for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
            d = cost[s] - cost['preln']
            add(f"{name} turns depth into lower loss than Pre-LN (L {L1} -> {L2}{tag})", f"{d:+.3f}",
                [_minus(depth_cost(s, k, L1, L2), depth_cost('preln', k, L1, L2)) for k in seeds], -1,
                "depth cost minus Pre-LN's, paired by seed", here(d, 16, L1))
    L = CONTRAST[1]
    for s, name in (('attnres', 'Full AttnRes'), ('hc', 'HC')):
        d = P['loss_L32'][s] - P['loss_L32']['preln']
        add(f"{name} below Pre-LN at the deepest shape (L {L}; paper 32)", f"{d:+.3f}",
            [_minus(loss.get((s, L, k)), loss.get(('preln', L, k))) for k in seeds], -1,
            'loss difference, paired by seed', here(d, 32, L))

    def probe(s, k, key):
        return pr.get(s, {}).get(str(k), {}).get(key)

    def probe_diff(key, a, b):
        return [_minus(probe(a, k, key), probe(b, k, key)) for k in seeds]
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
    return _judge(rows)


NAMES = {'preln': 'Pre-LN', 'attnres': 'Full AttnRes', 'hc': 'HC'}


def rung_findings(results, tpp):
    """
    The rows of a further rung of the ladder (RUNG_ROWS, stated before its runs), `tpp` tokens
    per backbone parameter: Pre-LN's depth cost L = 4 -> 8 and each scheme's gap to Pre-LN at
    L = 8 at the rung, beside the paper's size; and each gap's change from the first rung (2.5)
    to this one, paired by seed, judged toward or away from the paper's size by the first
    rung's size() of the same seeds (stats.toward). Holm over these rows, a family of its own.
    Rows as findings()'s; [] when results hold no such rung. Until every seed of RUNG_SEEDS has
    finished, every row is stats.INTERIM: its mean and interval shown, no p, no size verdict.
    """
    rung = (results.get('rungs') or {}).get(f"{tpp:g}")
    if not rung:
        return []
    first, loss = _losses(results['runs']), _losses(rung['runs'])
    if not loss:
        return []
    seeds = sorted({k for (_, _, k) in loss})
    P, (L1, L2) = PAPER, CONTRAST
    tag = f"{tpp:g} tokens per parameter"

    def pre(table, L, ks):
        return _mean([table.get(('preln', L, k)) for k in ks])

    def gap(table, s, k):
        return _minus(table.get((s, L2, k)), table.get(('preln', L2, k)))
    rows = []
    for kind, s in RUNG_ROWS:
        d = P['loss_L32'][s] - P['loss_L32']['preln']
        if kind == 'depth_cost':
            c = P['loss_L32'][s] - P['loss_L16'][s]
            rows.append(_row(f"{NAMES[s]}: extra depth costs loss (L {L1} -> {L2}; paper 16 -> 32), {tag}",
                             f"{c:+.3f}", [_minus(loss.get((s, L2, k)), loss.get((s, L1, k))) for k in seeds], +1,
                             'loss at the deeper shape minus the shallower, per seed',
                             paper_here(c, P['loss_L16']['preln'], pre(loss, L1, seeds))))
        elif kind == 'gap':
            rows.append(_row(f"{NAMES[s]} below Pre-LN at the deepest shape (L {L2}; paper 32), {tag}", f"{d:+.3f}",
                             [gap(loss, s, k) for k in seeds], -1, 'loss difference, paired by seed',
                             paper_here(d, P['loss_L32']['preln'], pre(loss, L2, seeds))))
        else:  # gap_change: the first rung's gap of the same seeds sets which way is toward the paper
            both = [k for k in seeds if gap(loss, s, k) is not None and gap(first, s, k) is not None]
            before = stats.t_test([gap(first, s, k) for k in both])
            at = paper_here(d, P['loss_L32']['preln'], pre(first, L2, both))
            sizes = {x: stats.size(before['lo'], before['hi'], at[x]) for x in at}
            rows.append(_row(f"{NAMES[s]}'s gap to Pre-LN at L {L2}: change from "
                             f"{families.MINI_TOKENS_PER_PARAM:g} to {tag}", f"{d:+.3f} at ≈20",
                             [_minus(gap(loss, s, k), gap(first, s, k)) for k in both], 0,
                             'gap at this rung minus at the first, paired by seed', kind='change',
                             towards=[stats.toward(sizes[x], -1) for x in at],
                             note='' if before['mean'] is None else
                             f"first rung, these seeds: {before['mean']:+.3f}, " + ', '.join(
                                 f"{v or 'no size'} ({SCALINGS[x]})" for x, v in sizes.items())))
    rows = _judge(rows)
    if set(seeds) != set(RUNG_SEEDS):  # the rows were stated for these seeds: fewer are no test
        for r in rows:
            r.update(verdict=stats.INTERIM, p=None, p_holm=None, size=None,
                     note='; '.join(x for x in (f"{len(seeds)} of the {len(RUNG_SEEDS)} seeds stated",
                                                r.get('note')) if x))
    return rows


def ladder(results):
    """{tokens per parameter: rows} of every further rung the results hold (rung_findings)."""
    return {float(t): rung_findings(results, float(t)) for t in sorted(results.get('rungs') or {}, key=float)}


def per_scheme(results):
    """Per scheme: the mean ± se over seeds of every probe summary number (a second table)."""
    out = {}
    for s, by_seed in results['probes'].items():
        keys = sorted({k for v in by_seed.values() for k in v})
        out[s] = {key: stats.paired([v.get(key) for v in by_seed.values()]) for key in keys}
    return out


def _fmt(m, se, n, pct=False):
    if m is None:
        return '–'
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:+.3f}" if abs(x) < 10 else f"{x:+.1f}")
    return f(m) + (f" ± {f(se).lstrip('+')}" if se is not None else '') + f" ({n})"


def _p(p):
    return '–' if p is None else f"{p:.3f}" if p >= 0.001 else f"{p:.0e}"


def _unit(r):
    """A number formatter for a row: shares of late pairs in percent, the rest in their unit."""
    return (lambda x: f"{100 * x:+.1f}%") if 'R_' in r['statistic'] else (lambda x: f"{x:+.3f}")


def format_findings(rows):
    """A findings table as markdown: the paper's effect on this scale as a fraction of loss /
    in nats per byte, the 95% interval's size against each, and the smallest mean the row
    detects with 80% power at Holm's first-step level."""
    lines = ["| finding | paper | paper here: fraction of loss / nats per byte | ours: mean ± s.e. (seeds) "
             "| 95% interval | size against the paper (F / B) | p | p, Holm | detectable (80% power) | verdict "
             "| statistic | note |", "|---" * 12 + "|"]
    for r in rows:
        f = _unit(r)
        ci = '–' if r['lo'] is None else f"[{f(r['lo'])}, {f(r['hi'])}]"
        here = '–' if not r['here'] else ' / '.join('–' if r['here'][k] is None else f(r['here'][k]) for k in SCALINGS)
        size = '–' if not r['sizes'] else ' / '.join(r['sizes'][k] or '–' for k in SCALINGS)
        det = '–' if r['detectable'] is None else f(r['detectable']).lstrip('+')
        lines.append(f"| {r['finding']} | {r['paper']} | {here} | {_fmt(r['mean'], r['se'], r['n'], 'R_' in r['statistic'])} "
                     f"| {ci} | {size} | {_p(r['p'])} | {_p(r.get('p_holm'))} | {det} | {r['verdict']} "
                     f"| {r['statistic']} | {r['note'] or ''} |")
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


def _seed_groups(runs, label=''):
    """Lines naming which seeds every (scheme, L) cell of `runs` has, grouped by identical seed
    sets, then the planned runs not finished."""
    cells, missing = {}, {}
    for r in runs:
        if r['status'] == 'finished' and r['val_loss'] is not None:
            cells.setdefault((r['scheme'], r['L']), set()).add(r.get('seed', 0))
        else:
            missing.setdefault((r['scheme'], r['L']), []).append(r.get('seed', 0))
    groups = {}
    for (s, L), ks in sorted(cells.items(), key=lambda kv: (families.MINI_SCHEMES.index(kv[0][0]), kv[0][1])):
        groups.setdefault(tuple(sorted(ks)), []).append(f"{s} L = {L}")
    lines = [f"- {label}{len(ks)} seed{'s' if len(ks) > 1 else ''} ({_seed_list(ks)}): {', '.join(c)}"
             for ks, c in sorted(groups.items(), key=lambda kv: -len(kv[0]))]
    if missing:
        lines.append(f"- {label}planned, not finished ({sum(map(len, missing.values()))} runs): " + ', '.join(
            f"{s} L = {L} seeds {_seed_list(ks)}" for (s, L), ks in missing.items()))
    return lines


def format_seeds(results):
    """Which seeds every (scheme, L) cell of every rung has, and which models were probed."""
    lines = _seed_groups(results['runs'], f"{results['tokens_per_backbone_param']:g} tokens per parameter, ")
    probed = {s: sorted(int(k) for k in v) for s, v in results['probes'].items()}
    lines.append(f"- probes at L = {results['deepest']}: " + '; '.join(
        f"{s} seeds {_seed_list(probed[s])}" for s in families.MINI_SCHEMES if s in probed))
    for L, v in (results.get('low_use') or {}).items():
        lines.append(f"- Block AttnRes's read weights (block_weights) at L = {L}: seeds {_seed_list(sorted(map(int, v)))}")
    for rung in (results.get('rungs') or {}).values():
        lines += _seed_groups(rung['runs'], f"{rung['tokens_per_backbone_param']:g} tokens per parameter, ")
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
            m, se, n = stats.paired([r['val_loss'] for r in done if r['scheme'] == s and r['L'] == L])
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


def _robustness(r):
    """The row's exact tests against its Holm level: do they reach it without normality?"""
    reach = [name for name, p in (('the permutation test', r['perm_p']), ('the sign test', r['sign_p']))
             if p is not None and p <= r['holm_level']]
    head = (f"without normality: sign-flip permutation p {_p(r['perm_p'])}, sign test p {_p(r['sign_p'])} "
            f"(neither can go below {_p(r['min_p'])} with {r['n']} seeds), against this row's Holm level "
            f"{r['holm_level']:.4f}: ")
    if len(reach) == 2:
        return head + "both reach it"
    if reach:
        return head + f"only {reach[0]} reaches it"
    return head + "neither reaches it" + (", nor could at this n" if r['min_p'] > r['holm_level'] else '') + \
        "; the verdict rests on the t-test's normal model"


def _power(r):
    """The row's smallest detectable mean, and its multiple of the paper's size on each scale."""
    if r['detectable'] is None:
        if r['n'] < 2 or not r['testable']:
            return ''
        return (f"; power: undefined (every seed the same), and no sign-based test can pass at n = {r['n']}"
                if r['min_p'] is not None and r['min_p'] > stats.ALPHA / r['family_size'] else
                "; power: undefined (every seed the same)")
    f = _unit(r)
    times = [f"{r['detectable'] / abs(v):.1f}×" for v in (r['here'] or {}).values() if v]
    return (f"; detectable with 80% power: {f(r['detectable']).lstrip('+')}"
            + (f" ({' / '.join(times)} the paper's size, F / B)" if len(times) == 2 else ''))


def format_verdicts(rows):
    """The findings grouped by verdict, one line per row (its mean, Holm p and power), and for
    each row that passes its robustness without normality."""
    tested = sum(r['p'] is not None for r in rows)
    lines = [f"Of {len(rows)} rows, {tested} are tested (Holm over {tested}):"]
    for v in stats.VERDICTS:
        mine = [r for r in rows if r['verdict'] == v]
        if not mine:
            continue
        lines.append(f"- **{v}** ({len(mine)}):")
        for r in mine:
            if v == stats.NOT_TESTABLE:
                lines.append(f"  - {r['finding']}: {r['note']}")
                continue
            size = '' if not r['size'] else f"; size {r['size']} under both scalings" if r['size'] != 'scalings disagree' \
                else "; no size verdict, the scalings disagree (" + ', '.join(
                    f"{SCALINGS[k]}: {r['sizes'][k]}" for k in SCALINGS) + ")"
            lines.append(f"  - {r['finding']}: {_fmt(r['mean'], r['se'], r['n'], 'R_' in r['statistic'])}, "
                         f"p (Holm) {_p(r.get('p_holm'))}{size}{_power(r)}")
            if v in stats.PASSING:
                lines.append(f"    - {_robustness(r)}")
    return "\n".join(lines)


def _all_runs(results):
    """(tokens per parameter, row) of every finished run of every rung."""
    out = [(results['tokens_per_backbone_param'], r) for r in _finished(results)]
    for rung in (results.get('rungs') or {}).values():
        out += [(rung['tokens_per_backbone_param'], r) for r in rung['runs']
                if r['status'] == 'finished' and r['val_loss'] is not None]
    return out


def format_timing(results):
    """The recorded wall time, machine and code version of the runs that have them, per rung."""
    done = _all_runs(results)
    timed = [(t, r) for t, r in done if r.get('wall_s')]
    if not timed:
        return f"- no run carries a recorded wall time ({len(done)} finished runs)"
    lines = []
    for tpp, L in sorted({(t, r['L']) for t, r in timed}):
        w = [r['wall_s'] / 60 for t, r in timed if (t, r['L']) == (tpp, L)]
        span = f"{min(w):.0f}" if round(min(w)) == round(max(w)) else f"{min(w):.0f}–{max(w):.0f}"
        lines.append(f"- {tpp:g} tokens per parameter, L = {L}: {len(w)} timed run{'s' if len(w) > 1 else ''}, {span} "
                     f"minutes of wall time each ({next(r['iter'] for t, r in timed if (t, r['L']) == (tpp, L))} steps)")
    machines = sorted({(m.get('cpu'), m.get('cpus'), m.get('threads'), m.get('platform'))
                       for m in (r.get('machine') or {} for _, r in timed)}, key=str)
    for cpu, cpus, threads, plat in machines:
        lines.append(f"- machine: {cpu}, {cpus} logical CPUs, OMP_NUM_THREADS={threads} per run, {plat}")
    lines.append(f"- total {sum(r['wall_s'] for _, r in timed) / 3600:.1f} process-hours over {len(timed)} runs; "
                 f"{len(done) - len(timed)} finished runs carry no recorded wall time")
    for tpp in sorted({t for t, _ in done}):
        mine = [r for t, r in done if t == tpp]
        commits = sorted({c for r in mine for c in r.get('commits') or []})
        if commits:  # the code that trained them (sweep.code_version at each launch)
            n = sum(bool(r.get('commits')) for r in mine)
            lines.append(f"- code at {tpp:g} tokens per parameter: {len(commits)} commit{'s' if len(commits) > 1 else ''} "
                         f"({', '.join(commits)}) over the {n} runs that record one; {len(mine) - n} record none")
        else:
            lines.append(f"- code at {tpp:g} tokens per parameter: none of its {len(mine)} runs records a commit")
    return "\n".join(lines)


def format_ladder_loss(results):
    """Validation loss of Pre-LN, Full AttnRes and HC per rung and depth: mean ± s.e. (seeds)."""
    lines = ["| tokens per parameter | L (d/L) | " + " | ".join(families.HEADLINE) + " |",
             "|---" * (len(families.HEADLINE) + 2) + "|"]
    done = _all_runs(results)
    for tpp, L in sorted({(t, r['L']) for t, r in done if r['L'] in families.MINI_RUNG_DEPTHS}):
        ratio = next(r['ratio'] for t, r in done if r['L'] == L)
        cells = []
        for s in families.HEADLINE:
            m, se, n = stats.paired([r['val_loss'] for t, r in done if (t, r['scheme'], r['L']) == (tpp, s, L)])
            cells.append('–' if m is None else f"{m:.3f}" + ('' if se is None else f" ± {se:.3f}") + f" ({n})")
        lines.append(f"| {tpp:g} | {L} ({ratio:.0f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_differences(results):
    """Every paired difference of loss the rungs allow, tested or not: each scheme's depth cost
    (loss at the deeper shape minus the shallower) and its gap to Pre-LN at each depth, mean
    [95% t-interval] (seeds), the gaps also as a share of Pre-LN's loss; the paper's Fig. 2
    values below the table."""
    rungs = [(results['tokens_per_backbone_param'], _losses(results['runs']))]
    rungs += [(r['tokens_per_backbone_param'], _losses(r['runs'])) for r in (results.get('rungs') or {}).values()]
    schemes = [s for s in families.MINI_SCHEMES if any(s == key[0] for _, loss in rungs for key in loss)]
    lines = ["| tokens per parameter | difference | " + " | ".join(schemes) + " |", "|---" * (len(schemes) + 2) + "|"]

    def cell(vals, ref=None):  # ref: Pre-LN's loss per seed, for the share (over the same seeds)
        t = stats.t_test(vals)
        if t['mean'] is None:
            return '–'
        ci = '' if t['lo'] is None else f" [{t['lo']:+.3f}, {t['hi']:+.3f}]"
        share = '' if ref is None else \
            f", {100 * t['mean'] / _mean([r for v, r in zip(vals, ref) if v is not None]):+.1f}%"
        return f"{t['mean']:+.3f}{ci} ({t['n']}){share}"
    for tpp, loss in rungs:
        if not loss:
            continue
        seeds = sorted({k for (_, _, k) in loss})
        Ls = sorted({L for (_, L, _) in loss})
        for L1, L2 in zip(Ls, Ls[1:]):
            lines.append(f"| {tpp:g} | depth cost, L {L1} → {L2} | " + " | ".join(
                cell([_minus(loss.get((s, L2, k)), loss.get((s, L1, k))) for k in seeds]) for s in schemes) + " |")
        for L in Ls:
            ref = [loss.get(('preln', L, k)) for k in seeds]
            lines.append(f"| {tpp:g} | minus Pre-LN at L = {L} (share of its loss) | " + " | ".join(
                '–' if s == 'preln' else cell([_minus(loss.get((s, L, k)), loss.get(('preln', L, k))) for k in seeds], ref)
                for s in schemes) + " |")
    P = PAPER
    lines += ["", "The paper (Fig. 2, 400M parameters, ≈20 tokens per parameter, nats per GPT-2 token): depth cost "
              "L 16 → 32 " + ", ".join(f"{NAMES[s]} {P['loss_L32'][s] - P['loss_L16'][s]:+.3f}" for s in NAMES)
              + "; minus Pre-LN " + "; ".join(
                  f"at L = {L} " + ", ".join(f"{NAMES[s]} {P[f'loss_L{L}'][s] - P[f'loss_L{L}']['preln']:+.3f} "
                                           f"({100 * (P[f'loss_L{L}'][s] / P[f'loss_L{L}']['preln'] - 1):+.1f}%)"
                                           for s in ('attnres', 'hc')) for L in (16, 32))
              + "; Block AttnRes's and mHC's curves are flat or non-monotone."]
    return "\n".join(lines)


def format_ladder(results):
    """Each further rung's findings table and verdicts (a Holm family of its own)."""
    out = []
    for tpp, rows in ladder(results).items():
        if not rows:
            continue
        out += [f"**{tpp:g} tokens per backbone parameter** (the rows stated before its runs):", "",
                format_findings(rows), "", format_verdicts(rows), ""]
    return "\n".join(out).rstrip() or "- no further rung has results yet"


def doc_blocks(results):
    """{block name: markdown} for docs/mini.md, all generated from `results`."""
    rows = findings(results)
    return {'seeds': format_seeds(results), 'loss': format_loss(results), 'confounds': format_confounds(results),
            'findings': format_findings(rows), 'verdicts': format_verdicts(rows),
            'probes': format_probes(results), 'timing': format_timing(results),
            'differences': format_differences(results), 'ladder_loss': format_ladder_loss(results),
            'ladder': format_ladder(results)}


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


def ladder_points(results):
    """The ladder figure's data: {panel title: {scheme: [(tokens per parameter, per-seed values,
    the paper's effect as a fraction of loss, in nats per byte)]}} for each scheme's gap to
    Pre-LN at L = DEEPEST and Pre-LN's depth cost L = 4 -> 8, over the seeds every rung has
    (paired across rungs). Empty panels when no further rung has a finished run."""
    rungs = [(results['tokens_per_backbone_param'], _losses(results['runs']))]
    rungs += [(r['tokens_per_backbone_param'], _losses(r['runs'])) for r in (results.get('rungs') or {}).values()]
    rungs = [(t, loss) for t, loss in rungs if loss]
    L1, L2 = CONTRAST
    gap_title = f"gap to Pre-LN at L = {L2} (scheme minus Pre-LN; paper L = 32)"
    cost_title = f"Pre-LN's depth cost, L = {L1} -> {L2} (paper L = 16 -> 32)"
    out = {gap_title: {}, cost_title: {}}
    if len(rungs) < 2:
        return out
    seeds = sorted(set.intersection(*({k for (_, _, k) in loss} for _, loss in rungs)))
    P = PAPER
    for tpp, loss in sorted(rungs):
        def pre(L):
            return _mean([loss.get(('preln', L, k)) for k in seeds])
        for s in ('attnres', 'hc'):
            here = paper_here(P['loss_L32'][s] - P['loss_L32']['preln'], P['loss_L32']['preln'], pre(L2))
            vals = [_minus(loss.get((s, L2, k)), loss.get(('preln', L2, k))) for k in seeds]
            out[gap_title].setdefault(s, []).append((tpp, vals, here['F'], here['B']))
        here = paper_here(P['loss_L32']['preln'] - P['loss_L16']['preln'], P['loss_L16']['preln'], pre(L1))
        vals = [_minus(loss.get(('preln', L2, k)), loss.get(('preln', L1, k))) for k in seeds]
        out[cost_title].setdefault('preln', []).append((tpp, vals, here['F'], here['B']))
    return out


def report(results, out_dir, wrote=()):
    """Prints the loss, findings and probe tables and each further rung's, writes the figures
    into out_dir, then one 'wrote' line for each file of `wrote` (written before) and each
    figure."""
    from study import mini_plots
    os.makedirs(out_dir, exist_ok=True)
    rows = findings(results)
    for text in (format_loss(results), format_findings(rows), format_verdicts(rows), format_probes(results),
                 format_ladder_loss(results), format_ladder(results)):
        print(text + "\n")
    figures = [os.path.join(out_dir, name) for name in ('loss_vs_ratio.png', 'probes.png', 'ladder.png')]
    mini_plots.plot_loss(results, rows, figures[0])
    if results['probes']:
        mini_plots.plot_probes(results, rows, figures[1], late_pairs(results['deepest']))
    points = ladder_points(results)
    seeds = {len(stats.values(v)) for panel in points.values() for pts in panel.values() for _, v, _, _ in pts}
    mini_plots.plot_ladder(points, figures[2], "mini-DepthBench's training-length ladder: ≈0.8M-parameter backbone, "
                           f"byte-level text; the seeds both rungs have ({', '.join(map(str, sorted(seeds)))} per point), "
                           "paired across rungs" + ("" if seeds <= {len(RUNG_SEEDS)} else
                                                    f"; interim: {len(RUNG_SEEDS)} seeds stated, not tested"))
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
    p.add_argument('--rung', default=None, help="with --train: the rung of the training-length ladder, in tokens "
                                                "per backbone parameter (2.5, the first, by default; "
                                                f"{', '.join(f'{t:g}' for t in families.MINI_RUNGS)})")
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
        if not a.train and (a.seed or a.schemes or a.shapes or a.rung):
            print("error: --rung, --seed, --schemes and --shapes choose runs to train: use them with --train",
                  file=sys.stderr)
            return 2
        if a.train:
            try:
                tpp = None if a.rung is None else float(a.rung)
                rung_family(tpp)
            except ValueError as e:
                print(f"error: --rung={a.rung}: {e if 'rung' in str(e) else 'give tokens per parameter, e.g. 5'}",
                      file=sys.stderr)
                return 2
            try:
                pick = [None if x is None else [y.strip() for y in x.split(',') if y.strip()]
                        for x in (a.seed, a.schemes, a.shapes)]
                seeds, shapes = [None if x is None else {int(y) for y in x} for x in (pick[0], pick[2])]
            except ValueError:
                print("error: --seed and --shapes take comma-separated integers, e.g. --seed=3,5 --shapes=4,8",
                      file=sys.stderr)
                return 2
            if not planned(seeds, pick[1], shapes, tpp):
                asked = ', '.join(f"{n} {v}" for n, v in (('seed', a.seed), ('scheme', a.schemes), ('L', a.shapes)) if v)
                plan = planned(tpp=tpp)
                print(f"error: no planned run at {families.MINI_TOKENS_PER_PARAM if tpp is None else tpp:g} tokens per parameter "
                      f"has {asked} (study/mini.py: seeds {_seed_list({k for k, _, _ in plan})}, schemes "
                      f"{', '.join(dict.fromkeys(s for _, s, _ in plan))}, L {', '.join(map(str, sorted({L for _, _, L in plan})))})",
                      file=sys.stderr)
                return 2
            failures = train(seeds, pick[1], shapes, a.probe, tpp=tpp)
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
