"""
Mini-DepthBench's statistics and report (study/mini.py): paired means and their errors,
the verdict rule, the findings taken from the runs and probes of each seed, and the
committed results that docs/mini.md quotes.
Run: python -m pytest tests/test_mini.py -q
"""

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from study import families, mini, results, sweep  # noqa: E402

COMMITTED = ROOT / mini.RESULTS


def test_paired_mean_and_standard_error_by_hand():
    m, se, n = mini.paired([1.0, 2.0, 3.0, None, float('nan')])  # missing seeds are dropped
    assert (m, n) == (2.0, 3)
    assert se == pytest.approx(1.0 / math.sqrt(3))  # sample sd 1, over sqrt(n)
    assert mini.paired([0.5]) == (0.5, None, 1)     # one seed: no error, so nothing is resolved
    assert mini.paired([None]) == (None, None, 0)


def test_t_test_on_a_hand_worked_sample_where_two_standard_errors_are_not_enough():
    # [1, 3, 5]: mean 3, sample sd 2, s.e. 2 / sqrt(3), t = 3 sqrt(3) / 2 = 2.598 > 2, yet with
    # 2 degrees of freedom the two-sided p is 1 - t / sqrt(t^2 + 2) (Student's t CDF for df = 2,
    # in closed form) = 0.1217 > 0.05, and the 95% interval is mean ± 4.3027 s.e.
    t = mini.t_test([1.0, 3.0, 5.0])
    se = 2 / math.sqrt(3)
    assert t['se'] == pytest.approx(se) and t['t'] == pytest.approx(3 * math.sqrt(3) / 2)
    assert abs(t['mean']) > 2 * t['se']
    assert t['p'] == pytest.approx(1 - t['t'] / math.sqrt(t['t'] ** 2 + 2), rel=1e-9)
    assert t['p'] == pytest.approx(0.1217, abs=1e-4)
    assert (t['lo'], t['hi']) == (pytest.approx(3 - 4.302653 * se, rel=1e-6), pytest.approx(3 + 4.302653 * se, rel=1e-6))
    row = dict(t, p_holm=t['p'])
    assert mini.verdict(row, t['p'], None, +1) == 'not resolved at this scale'


def test_t_test_with_the_sample_not_the_population_standard_deviation():
    # [0, 1, 2, 3, 4, 5, 6, 11]: mean 4, sum of squares 84, sample sd sqrt(84 / 7) = sqrt(12), so
    # t = 4 / sqrt(1.5) = 3.266 and p (7 df) = 0.01375; a population sd (/ n) gives t = 3.491,
    # p = 0.0101, and 8 degrees of freedom p = 0.0114, both below the 0.0125 Holm needs of the
    # smallest of four p-values
    t = mini.t_test([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 11.0])
    assert t['t'] == pytest.approx(4 / math.sqrt(1.5)) and t['p'] == pytest.approx(0.01375, abs=1e-5)
    adj, rejected = mini.holm([t['p'], 0.5, 0.6, 0.7])
    assert adj[0] == pytest.approx(4 * t['p']) and not rejected[0]


def test_an_all_equal_sample_does_not_pass():
    # every seed the same: s.e. 0, so t is undefined; it must not count as infinitely significant
    t = mini.t_test([0.5, 0.5, 0.5])
    assert (t['mean'], t['se'], t['n']) == (0.5, 0.0, 3)
    assert t['p'] is None and t['lo'] is None
    assert mini.verdict(t, None, 0.1, +1) == 'not resolved at this scale'
    assert mini.t_test([0.5])['p'] is None                            # one seed: no test either


def test_holm_on_a_hand_worked_list():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (monotone)
    adj, rejected = mini.holm([0.01, 0.04, 0.03, 0.005, None])
    assert adj[:4] == [pytest.approx(0.03), pytest.approx(0.06), pytest.approx(0.06), pytest.approx(0.02)]
    assert rejected == [True, False, False, True, False] and adj[4] is None
    # uncorrected, 0.03 and 0.04 would pass; Bonferroni (x 4) would put 0.01 at 0.04 and 0.03 at 0.12
    assert mini.holm([0.2, 0.9]) == ([pytest.approx(0.4), pytest.approx(0.9)], [False, False])


@pytest.mark.parametrize('values, p_adj, effect, sign, want', [
    ([0.10, 0.11, 0.12], 0.001, 0.05, +1, 'reproduces'),
    ([-0.10, -0.11, -0.12], 0.001, -0.05, -1, 'reproduces'),
    ([-0.10, -0.11, -0.12], 0.001, 0.05, +1, 'opposite'),
    ([0.10, 0.11, 0.12], 0.001, None, 0, 'differs from the paper'),
    ([0.10, 0.11, 0.12], 0.2, 0.05, +1, 'not resolved at this scale'),      # Holm holds it back
    ([0.001, -0.001, 0.002, 0.0], 0.5, 0.015, +1, "bounded below the paper's size"),  # 95% CI < 0.015
    ([0.001, -0.001, 0.002, 0.0], 0.5, -0.015, -1, "bounded below the paper's size"),
    ([0.001, -0.001, 0.002, 0.0], 0.5, None, +1, 'not resolved at this scale'),  # no size to bound
    ([0.01, -0.01, 0.02, 0.0], 0.5, 0.015, +1, 'not resolved at this scale'),   # the CI reaches 0.015
])
def test_verdict(values, p_adj, effect, sign, want):
    assert mini.verdict(mini.t_test(values), p_adj, effect, sign) == want


def _row(scheme, L, seed, loss):
    return {'scheme': scheme, 'L': L, 'seed': seed, 'status': 'finished', 'val_loss': loss}


def test_findings_pair_the_depth_cost_by_seed_and_correct_for_the_rows():
    # Pre-LN gets worse from L = 4 to 8 by 0.02 + 0.01 k; AttnRes better by 0.03 in every seed.
    # The seeds' offsets (0.1 k) cancel in the paired differences, as they should.
    runs = []
    for k in range(3):
        runs += [_row('preln', 4, k, 2.0 + 0.1 * k), _row('preln', 8, k, 2.02 + 0.11 * k),
                 _row('attnres', 4, k, 1.9 + 0.1 * k), _row('attnres', 8, k, 1.87 + 0.1 * k)]
    rows = mini.findings({'runs': runs, 'probes': {}, 'deepest': 8})
    by = {r['finding']: r for r in rows}
    pre = by['Pre-LN: extra depth costs loss (L 4 -> 8; paper 16 -> 32)']
    assert pre['mean'] == pytest.approx(0.03) and pre['se'] == pytest.approx(0.01 / math.sqrt(3))
    t = 0.03 / (0.01 / math.sqrt(3))
    assert pre['p'] == pytest.approx(1 - t / math.sqrt(t * t + 2))          # 0.035, Student df = 2
    # three tested rows (Pre-LN's cost, AttnRes's cost against it, AttnRes at L 8); Pre-LN's p is
    # the largest, so Holm multiplies it by 1 and it still passes
    assert [r['finding'] for r in rows if r['p'] is not None] == [pre['finding'],
        'Full AttnRes turns depth into lower loss than Pre-LN (L 4 -> 8)',
        'Full AttnRes below Pre-LN at the deepest shape (L 8; paper 32)']
    assert pre['p_holm'] == pytest.approx(pre['p']) and pre['verdict'] == 'reproduces'
    assert pre['paper_effect'] == pytest.approx(0.023 / 2.759 * 2.1)        # scaled by Pre-LN's loss at L 4
    att = by['Full AttnRes turns depth into lower loss than Pre-LN (L 4 -> 8)']
    assert att['mean'] == pytest.approx(-0.06) and att['verdict'] == 'reproduces'   # -0.03 - (0.02 + 0.01 k)
    assert att['p_holm'] == pytest.approx(2 * att['p'])
    deep = by['Full AttnRes below Pre-LN at the deepest shape (L 8; paper 32)']
    assert deep['mean'] == pytest.approx(-0.15 - 0.01) and deep['n'] == 3
    hc = by['HC turns depth into lower loss than Pre-LN (L 4 -> 8)']
    assert hc['n'] == 0 and hc['verdict'] == 'not resolved at this scale'          # no HC runs
    # HC's rows: its depth cost against Pre-LN's and its L 8 difference both have p = 0.035 too;
    # Holm now triples the three tied p-values (ranks 3-5 of 5), and none passes
    runs += [_row('hc', 4, k, 2.0 + 0.1 * k) for k in range(3)]
    runs += [_row('hc', 8, k, 2.02 + 0.11 * k - 0.02 - 0.01 * k - (0.02 + 0.01 * k)) for k in range(3)]
    by = {r['finding']: r for r in mini.findings({'runs': runs, 'probes': {}, 'deepest': 8})}
    pre = by['Pre-LN: extra depth costs loss (L 4 -> 8; paper 16 -> 32)']
    hc = by['HC turns depth into lower loss than Pre-LN (L 4 -> 8)']
    assert pre['p'] < 0.05 and hc['p'] == pytest.approx(pre['p'])
    assert pre['p_holm'] == pytest.approx(3 * pre['p']) and pre['p_holm'] > 0.05
    assert pre['verdict'] == hc['verdict'] == 'not resolved at this scale'


def test_findings_from_probes_are_paired_by_seed():
    probes = {'hc': {'0': {'erank': 3.0}, '1': {'erank': 3.5}},
              'mhc': {'0': {'erank': 3.9}, '1': {'erank': 3.5}, '2': {'erank': 4.0}},
              'blockattnres': {'0': {'low_use_sublayers': 2}, '1': {'low_use_sublayers': 2}}}
    runs = [_row('preln', 8, k, 2.0) for k in range(3)]
    rows = {r['finding']: r for r in mini.findings({'runs': runs, 'probes': probes, 'deepest': 8})}
    er = rows["HC's composed residual map has a higher effective rank than mHC's (L 8)"]
    assert er['mean'] == pytest.approx((-0.9 + 0.0) / 2) and er['n'] == 2   # seed 2 has no HC probe
    assert er['se'] == pytest.approx(0.45) and er['p'] is not None           # mHC's maps moved: tested
    low = rows['Block AttnRes: an early low-use segment that grows with depth (L 8)']
    assert (low['mean'], low['n'], low['se']) == (1.0, 2, 0.0)               # 2 sublayers = 1 layer
    assert low['verdict'] == 'not testable here' and 'one depth (L = 8)' in low['note']
    # probed at L = 4 too (seeds 0-2; seed 2 has no L = 8 probe): the growth, paired by seed, in layers
    low_use = {'4': {'0': 1, '1': 0, '2': 1}}
    rows = {r['finding']: r for r in mini.findings({'runs': runs, 'probes': probes, 'deepest': 8, 'low_use': low_use})}
    low = rows['Block AttnRes: an early low-use segment that grows with depth (L 4 -> 8)']
    assert (low['mean'], low['n']) == (0.75, 2) and low['se'] == pytest.approx(0.25)   # (2-1)/2, (2-0)/2
    assert low['p'] is not None and low['verdict'] == 'not resolved at this scale'
    # mHC's maps still at their identity init (erank within 0.05 of m = 4): no erank verdict
    probes['mhc'] = {k: {'erank': 3.99} for k in '012'}
    rows = {r['finding']: r for r in mini.findings({'runs': runs, 'probes': probes, 'deepest': 8})}
    er = rows["HC's composed residual map has a higher effective rank than mHC's (L 8)"]
    assert er['verdict'] == 'not testable here' and er['p'] is None and 'identity init' in er['note']


def test_late_pairs_by_hand():
    assert mini.late_pairs(8) == 15   # s = 2..6 with t = s+1..7: 5 + 4 + 3 + 2 + 1
    assert mini.late_pairs(4) == 3    # (1, 2), (1, 3), (2, 3)


def test_probe_summary_reads_the_late_blocks():
    L = 4  # late blocks: l >= ceil(L / 4) = 1
    p = {'late_pairs': {'R_causal': 0.25, 'R_perm': 0.5},
         'angular': {'subsequent': [[0.9, 0.2, 0.4, 0.6]]},
         'path_weights': {'W': [[1.0], [0.5, 0.5], [0.7, 0.1, 0.2]]},
         'logit_lens': {'kl': [3.0, 2.0, 1.5, 0.5, 0.0]},
         'prune_lm': {'delta': [5.0, 0.1, 0.2, float('nan')]},
         'propagation': {'erank': {'mean': [2.5], 'lo': [2.4], 'hi': [2.6]}}}
    s = mini.probe_summary(p, L)
    assert s['angular_late'] == pytest.approx(0.4)          # mean of 0.2, 0.4, 0.6; block 0 left out
    assert s['prune_late'] == pytest.approx(0.15)           # NaN dropped, block 0 left out
    assert s['lens_kl_mid'] == 1.5 and s['readout_on_embedding'] == 0.7
    assert (s['erank'], s['erank_lo'], s['erank_hi']) == (2.5, 2.4, 2.6)
    assert (s['R_causal'], s['R_perm']) == (0.25, 0.5)


committed = pytest.mark.skipif(not COMMITTED.exists(), reason=f"{mini.RESULTS} is not committed")


@committed
def test_docs_are_generated_from_the_committed_results():
    results = json.loads(COMMITTED.read_text())
    doc = (ROOT / 'docs' / 'mini.md').read_text()
    assert mini.render_doc(doc, results) == doc, "docs/mini.md's blocks differ from the committed results: " \
        "run python study/mini.py --probe=False"
    for line in mini.format_findings(mini.findings(results)).splitlines()[2:]:
        assert line in doc
    seeds = {r['seed'] for r in results['runs'] if r['status'] == 'finished'}
    assert seeds >= {0, 1, 2} and results['tokens_per_backbone_param'] == families.MINI_TOKENS_PER_PARAM
    planned = {(s, L, k) for k, s, L in mini.planned()}
    assert {(r['scheme'], r['L'], r['seed']) for r in results['runs']} == planned


def test_render_doc_names_a_missing_block():
    with pytest.raises(ValueError, match='begin loss'):
        mini.render_doc("<!-- begin seeds -->\n<!-- end seeds -->\n", {'runs': [], 'probes': {}, 'deepest': 8})


def test_the_plan_and_its_splits():
    assert len(mini.planned()) == 42 + 30 and mini.N_SEEDS == 8
    assert mini.planned(seeds={3}, shapes={8}) == [(3, 'preln', 8), (3, 'attnres', 8), (3, 'hc', 8)]
    assert mini.planned(seeds={1}, schemes=['blockattnres']) == [(1, 'blockattnres', 4), (1, 'blockattnres', 8)]
    assert mini.planned(seeds={4}, schemes=['mhc']) == []       # seeds 3-7 are Pre-LN, Full AttnRes and HC only


def _finish(root, run, loss, wall=None, max_iters=None):
    d = root / run.out_dir
    d.mkdir(parents=True)
    n = max_iters or run.config['max_iters']  # the planned length unless given
    (d / 'summary.json').write_text(json.dumps({'finished': True, 'val_loss': loss, 'iter': n, 'max_iters': n,
                                                'tokens': 2011136, 'n_params': 869760}))
    if wall is not None:
        sweep.record_wall_time(run, str(root), wall)
        sweep.record_wall_time(run, str(root), 1.5)            # a resumed run sums its launches


def test_collect_keeps_the_prior_results_and_adds_out(tmp_path):
    pre4 = next(r for r in families.runs('mini', ['preln'], [4]))
    prior = {'family': 'mini', 'tokens_per_backbone_param': 2.5, 'deepest': 8, 'probes': {'hc': {'0': {'erank': 3.5}}},
             'runs': [dict(results.read_result(pre4, str(tmp_path)), seed=0, status='finished', val_loss=1.75)]}
    _finish(tmp_path, results.seeded(pre4, 3), 1.70, wall=60.0)
    res = mini.collect(str(tmp_path), prior=prior)
    by = {(r['scheme'], r['L'], r['seed']): r for r in res['runs']}
    assert len(res['runs']) == len(mini.planned())
    assert by[('preln', 4, 0)]['val_loss'] == 1.75 and by[('preln', 4, 0)]['status'] == 'finished'   # from prior
    new = by[('preln', 4, 3)]
    assert (new['val_loss'], new['status'], new['iter']) == (1.70, 'finished', 491)                # from out/
    assert new['wall_s'] == 61.5 and new['machine']['cpus'] == os.cpu_count()
    assert by[('hc', 8, 5)]['status'] == 'missing' and res['probes'] == prior['probes']
    assert res['low_use'] == {}


def test_a_short_trial_in_the_study_out_dir_never_replaces_a_planned_run(tmp_path, capsys):
    # `train.py config/mini/preln_L2.py --max_iters=5` writes a finished run into the study's own
    # out_dir; the committed 461-step result must stand, with one line saying why
    pre2 = next(r for r in families.runs('mini', ['preln'], [2]))
    prior = {'family': 'mini', 'tokens_per_backbone_param': 2.5, 'deepest': 8, 'probes': {},
             'runs': [dict(results.read_result(pre2, str(tmp_path)), seed=0, status='finished', val_loss=1.79,
                           max_iters=461)]}
    _finish(tmp_path, pre2, 3.99, max_iters=5)
    by = {(r['scheme'], r['L'], r['seed']): r for r in mini.collect(str(tmp_path), seeds=1, prior=prior)['runs']}
    assert by[('preln', 2, 0)]['val_loss'] == 1.79 and by[('preln', 2, 0)]['max_iters'] == 461
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'max_iters=5, not the planned 461' in err[0]
    assert len(by) == len(mini.planned())        # seeds=1 still collects every planned seed


def test_block_attnres_read_weights_are_probed_and_collected_at_every_depth(tmp_path, monkeypatch):
    runs = {L: next(iter(families.runs('mini', ['blockattnres'], [L]))) for L in (4, 8)}
    for L, run in runs.items():
        _finish(tmp_path, results.seeded(run, 1), 1.7)
    targets = {(k, r.L): m for k, r, m in mini.probe_targets(str(tmp_path), seeds=2)}
    assert targets == {(1, 8): mini.PROBE_METRICS, (1, 4): ('block_weights',)}
    seen = []
    monkeypatch.setattr(mini, 'run_command', lambda cmd, cwd: seen.append(cmd[1:]) or 0)
    assert mini.probe_missing(str(tmp_path), seeds=2) == []
    assert [c for c in seen if 'blockattnres_L4_seed1' in c[1]] == [
        ['probe.py', f"--ckpt={os.path.join('out', 'mini', 'blockattnres_L4_seed1', 'ckpt.pt')}",
         '--metrics=block_weights', *mini.PROBE_ARGS]]
    for L, n, key in ((4, 1, 'low_use_sublayers'), (8, 3, 'dead_sublayers')):  # the L = 8 file from before the rename
        d = tmp_path / results.seeded(runs[L], 1).out_dir / 'probe'
        d.mkdir()
        (d / 'probe.json').write_text(json.dumps({'block_weights': {key: n}}))
    res = mini.collect(str(tmp_path), prior={'runs': [], 'probes': {}, 'deepest': 8, 'tokens_per_backbone_param': 2.5,
                                              'low_use': {'4': {'0': 2}}})
    assert res['low_use'] == {'4': {'0': 2, '1': 1}}                      # the prior's seed 0 kept
    assert res['probes']['blockattnres']['1']['low_use_sublayers'] == 3   # L = 8 with the other probes


@committed
def test_plot_only_on_the_committed_results(tmp_path, monkeypatch, capsys):
    (tmp_path / 'docs' / 'mini').mkdir(parents=True)
    shutil.copy(COMMITTED, tmp_path / mini.RESULTS)
    families.write_configs(root=tmp_path)
    monkeypatch.setattr(sweep, 'ROOT', str(tmp_path))
    assert sweep.main(['family=mini', 'seeds=3', 'plot_only=True']) == 0
    out = capsys.readouterr().out
    assert f"reading the committed {mini.RESULTS}" in out
    assert mini.format_findings(mini.findings(json.loads(COMMITTED.read_text()))) in out
    for name in ('loss_vs_ratio.png', 'probes.png'):
        assert (tmp_path / 'out' / 'mini' / name).stat().st_size > 10_000


@pytest.mark.parametrize('text', ['{}', '[]', '{"runs": []}', 'not json'])
def test_a_results_file_of_the_wrong_shape_is_one_line(tmp_path, capsys, text):
    bad = tmp_path / 'results.json'
    bad.write_text(text)
    assert mini.main([f'--results={bad}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: ') and 'not a mini results.json' in err[0]


@committed
def test_results_flag_draws_into_out_not_over_the_committed_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(mini, 'ROOT', str(tmp_path))
    assert mini.main([f'--results={COMMITTED}']) == 0
    assert (tmp_path / 'out' / 'mini' / 'probes.png').exists()
    assert not (tmp_path / 'docs').exists()


def test_train_goes_seed_by_seed_deepest_first_and_probes_each_deep_model(monkeypatch):
    calls = []
    monkeypatch.setattr(mini, 'train_run', lambda k, s, L, root: calls.append((k, [s], [L])) or [])
    monkeypatch.setattr(mini, 'probe_missing', lambda root, n, only: calls.append(('probe', only)) or [])
    assert mini.train(seeds={4, 3}, schemes=['preln', 'hc']) == []
    assert calls == [(3, ['preln'], [8]), ('probe', {3}), (3, ['hc'], [8]), ('probe', {3}),
                     (3, ['preln'], [4]), (3, ['hc'], [4]),
                     (4, ['preln'], [8]), ('probe', {4}), (4, ['hc'], [8]), ('probe', {4}),
                     (4, ['preln'], [4]), (4, ['hc'], [4])]


def test_seeds_below_one_are_refused_before_anything_is_written(capsys):
    with pytest.raises(SystemExit) as e:
        mini.main(['--seeds=0'])
    assert e.value.code == 2 and '0 is not a positive integer' in capsys.readouterr().err


@pytest.mark.parametrize('args, message', [(['--train', '--seed=x'], 'comma-separated integers'),
                                            (['--train', '--seed=4', '--schemes=mhc'], 'no planned run has seed 4, scheme mhc'),
                                            (['--shapes=4'], 'use them with --train')])
def test_a_bad_training_choice_is_one_line(capsys, args, message):
    assert mini.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: ') and message in err[0]


def test_a_planned_run_trains_through_the_sweep_command(monkeypatch):
    seen = []
    monkeypatch.setattr(mini, 'run_command', lambda cmd, cwd: seen.append(cmd) or 1)
    assert mini.train_run(3, 'hc', 8, root='r') == [('hc_L8_seed3', 'study/sweep.py failed')]
    assert seen[0][1:] == [os.path.join('study', 'sweep.py'), 'family=mini', 'schemes=hc', 'shapes=8',
                           'seed=3', 'seeds=4', 'probe=False']


def test_the_files_written_are_named_after_the_tables(tmp_path, monkeypatch, capsys):
    # a regeneration from the committed rows: the tables first, then one line per file written
    (tmp_path / 'docs' / 'mini').mkdir(parents=True)
    shutil.copy(COMMITTED, tmp_path / mini.RESULTS)
    shutil.copy(ROOT / 'docs' / 'mini.md', tmp_path / 'docs' / 'mini.md')
    monkeypatch.setattr(mini, 'ROOT', str(tmp_path))
    assert mini.main(['--probe=False']) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert [os.path.relpath(x[len('wrote '):], tmp_path) for x in out[-4:]] == [
        mini.RESULTS, os.path.join('docs', 'mini.md'), os.path.join('docs', 'mini', 'loss_vs_ratio.png'),
        os.path.join('docs', 'mini', 'probes.png')]
    assert not any(x.startswith('wrote ') for x in out[:-4]) and '| seeds |' not in out[-5]
    assert json.loads((tmp_path / mini.RESULTS).read_text()) == json.loads(COMMITTED.read_text())
    assert (tmp_path / 'docs' / 'mini.md').read_text() == (ROOT / 'docs' / 'mini.md').read_text()


def test_a_run_of_another_length_is_not_probed_and_warned_about_once(tmp_path, monkeypatch, capsys):
    # `sweep.py family=mini ... extra=--max_iters=5` finishes Block AttnRes L = 4 into the study's
    # out_dir: no probe is spent on it, and the sweep's mini report says so in one line
    run = next(iter(families.runs('mini', ['blockattnres'], [4])))
    _finish(tmp_path, run, 3.9, max_iters=5)
    _finish(tmp_path, results.seeded(run, 1), 1.7)
    assert [(k, r.name) for k, r, _ in mini.probe_targets(str(tmp_path), seeds=2)] == [(1, 'blockattnres_L4_seed1')]
    (tmp_path / 'docs' / 'mini').mkdir(parents=True)
    shutil.copy(COMMITTED, tmp_path / mini.RESULTS)
    families.write_configs(root=tmp_path)
    monkeypatch.setattr(sweep, 'ROOT', str(tmp_path))
    monkeypatch.setattr(mini, 'report', lambda results, out_dir, wrote=(): None)
    assert sweep.main(['family=mini', 'plot_only=True']) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if 'blockattnres_L4 ' in x]
    assert len(err) == 1 and 'finished at max_iters=5, not the planned' in err[0]
    # a shortened run that the plan does not hold (mHC has seeds 0-2) is named too
    _finish(tmp_path, results.seeded(next(iter(families.runs('mini', ['mhc'], [4]))), 5), 3.9, max_iters=5)
    mini.collect(str(tmp_path), seeds=6)
    err = capsys.readouterr().err
    assert 'mhc_L4_seed5 finished at max_iters=5, not the planned' in err


def test_a_rung_of_the_ladder_is_the_first_rung_trained_longer():
    # same shapes, data, batch and recipe; only the length (and the eval interval that follows it)
    for tpp, family in families.MINI_RUNGS.items():
        rung = families.runs(family)
        assert {(r.scheme, r.L) for r in rung} == {(s, L) for s in families.HEADLINE for L in (4, 8)}
        for r in rung:
            first = next(iter(families.runs('mini', [r.scheme], [r.L])))
            assert (r.d, r.backbone, r.total) == (first.d, first.backbone, first.total)
            differ = {k for k in r.config if r.config[k] != first.config[k]}
            assert differ == {'out_dir', 'max_iters', 'eval_interval'}
            tokens = r.config['max_iters'] * 16 * 256
            assert tokens / r.backbone == pytest.approx(tpp, abs=2 * 4096 / r.backbone)   # whole steps
            assert r.out_dir == f"out/{family}/{r.name}" and r.config_path == f"config/{family}/{r.name}.py"
    assert [r.config['max_iters'] for r in families.runs('mini_tpp5', ['preln'])] == [981, 1082]
