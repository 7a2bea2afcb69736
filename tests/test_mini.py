"""
Mini-DepthBench's report (study/mini.py): the findings taken from the runs and probes of
each seed at every rung of the training-length ladder, the plan, the collected results and
the committed results that docs/mini.md quotes (tests/test_mini_stats.py: the statistics).
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
from study import families, mini, results, stats, sweep  # noqa: E402

COMMITTED = ROOT / mini.RESULTS


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
    assert pre['here']['F'] == pytest.approx(0.023 / 2.759 * 2.1)          # scaled by Pre-LN's loss at L 4
    assert pre['here']['B'] == pytest.approx(0.023 * 653_670 / 3_094_132)   # nats per token over bytes per token
    # the 95% interval 0.03 ± 4.303 s.e. = [0.0052, 0.0548] holds +0.0175 (F) but lies above +0.0049 (B):
    # significant in the paper's direction, yet the scalings disagree on the size, so not "reproduces"
    assert pre['lo'] == pytest.approx(0.03 - 4.302653 * 0.01 / math.sqrt(3))
    assert pre['sizes'] == {'F': 'matched', 'B': 'larger'} and pre['size'] == 'scalings disagree'
    assert pre['p_holm'] == pytest.approx(pre['p']) and pre['verdict'] == stats.SIZE_UNSETTLED
    assert pre['holm_level'] == pytest.approx(0.05) and pre['family_size'] == 3
    att = by['Full AttnRes turns depth into lower loss than Pre-LN (L 4 -> 8)']
    assert att['mean'] == pytest.approx(-0.06) and att['verdict'] == stats.SIZE_UNSETTLED  # -0.03 - (0.02 + 0.01 k)
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
    assert pre['verdict'] == hc['verdict'] == stats.NOT_RESOLVED


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
        mini.render_doc("<!-- begin seeds -->\n<!-- end seeds -->\n", {'runs': [], 'probes': {}, 'deepest': 8,
                                                                        'tokens_per_backbone_param': 2.5})


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
    monkeypatch.setattr(mini, 'train_run', lambda k, s, L, root, family: calls.append((k, [s], [L])) or [])
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
                                            (['--train', '--seed=4', '--schemes=mhc'],
                                             'no planned run at 2.5 tokens per parameter has seed 4, scheme mhc'),
                                            (['--train', '--rung=5', '--seed=6'],
                                             'no planned run at 5 tokens per parameter has seed 6'),
                                            (['--train', '--rung=10'], 'no rung at 10 tokens per parameter; the ladder has 2.5, 5'),
                                            (['--train', '--rung=five'], '--rung=five: give tokens per parameter'),
                                            (['--rung=5'], 'use them with --train'),
                                            (['--shapes=4'], 'use them with --train')])
def test_a_bad_training_choice_is_one_line(capsys, args, message):
    assert mini.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: ') and message in err[0]


def test_a_planned_run_trains_through_the_sweep_command(monkeypatch):
    seen = []
    monkeypatch.setattr(mini, 'run_command', lambda cmd, cwd: seen.append(cmd) or 1)
    assert mini.train_run(3, 'hc', 8, root='r') == [('mini/hc_L8_seed3', 'study/sweep.py failed')]
    assert seen[0][1:] == [os.path.join('study', 'sweep.py'), 'family=mini', 'schemes=hc', 'shapes=8',
                           'seed=3', 'seeds=4', 'probe=False']
    assert mini.train_run(0, 'preln', 4, root='r', family='mini_tpp5') == [('mini_tpp5/preln_L4_seed0', 'study/sweep.py failed')]
    assert seen[1][2:4] == ['family=mini_tpp5', 'schemes=preln']


def test_a_rung_trains_its_own_plan_without_probes(monkeypatch):
    calls = []
    monkeypatch.setattr(mini, 'train_run', lambda k, s, L, root, family: calls.append((k, s, L, family)) or [])
    monkeypatch.setattr(mini, 'probe_missing', lambda *a, **kw: pytest.fail('a further rung has no probe rows'))
    assert mini.train(seeds={5}, tpp=5.0) == []
    assert calls == [(5, s, L, 'mini_tpp5') for L in (8, 4) for s in families.HEADLINE]
    assert len(mini.planned(tpp=5.0)) == 36 and {k for k, _, _ in mini.planned(tpp=5.0)} == set(range(6))
    assert mini.planned(tpp=2.5) == mini.planned()   # the first rung by its budget too


def test_the_files_written_are_named_after_the_tables(tmp_path, monkeypatch, capsys):
    # a regeneration from the committed rows: the tables first, then one line per file written
    (tmp_path / 'docs' / 'mini').mkdir(parents=True)
    shutil.copy(COMMITTED, tmp_path / mini.RESULTS)
    shutil.copy(ROOT / 'docs' / 'mini.md', tmp_path / 'docs' / 'mini.md')
    monkeypatch.setattr(mini, 'ROOT', str(tmp_path))
    assert mini.main(['--probe=False']) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    want = [mini.RESULTS, os.path.join('docs', 'mini.md'), os.path.join('docs', 'mini', 'loss_vs_ratio.png'),
            os.path.join('docs', 'mini', 'probes.png')]
    if any(r['status'] == 'finished' for r in json.loads(COMMITTED.read_text())['rungs']['5']['runs']):
        want.append(os.path.join('docs', 'mini', 'ladder.png'))  # drawn once a further rung has a run
    assert [os.path.relpath(x[len('wrote '):], tmp_path) for x in out[-len(want):]] == want
    assert not any(x.startswith('wrote ') for x in out[:-len(want)]) and '| seeds |' not in out[-len(want) - 1]
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


def test_bytes_per_token_of_the_sample_recomputed_with_the_gpt2_tokenizer():
    # the conversion of the paper's nats per token into nats per byte: the sample's UTF-8 bytes and
    # GPT-2 tokens, one end-of-text per document in each
    import gzip
    from data.tokenizer import get_tokenizer
    tok = get_tokenizer('gpt2')
    docs = [json.loads(line)['text'] for line in gzip.open(ROOT / 'data' / 'sample' / 'fineweb_edu_sample.jsonl.gz', 'rt')]
    n_bytes = sum(len(d.encode('utf-8')) + 1 for d in docs)
    n_tokens = sum(len(t) + 1 for t in tok.encode_batch(docs))
    assert (n_bytes, n_tokens) == (3_094_132, 653_670)
    assert mini.BYTES_PER_TOKEN == pytest.approx(n_bytes / n_tokens) == pytest.approx(4.733, abs=5e-4)


def _holm_by_hand(ps):
    """Holm written out afresh: sort, multiply by m - i, running maximum, cap at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, top = {}, 0.0
    for i, j in enumerate(order):
        top = max(top, min(1.0, (len(ps) - i) * ps[j]))
        out[j] = top
    return [out[i] for i in range(len(ps))]


@committed
def test_every_committed_row_recomputed_independently():
    # from results.json alone: the per-seed values, Student's t by its formula, Holm afresh, and the
    # size and verdict rules as docs/mini.md states them
    from scipy.stats import t as student
    res = json.loads(COMMITTED.read_text())
    loss = {(r['scheme'], r['L'], r['seed']): r['val_loss'] for r in res['runs'] if r['status'] == 'finished'}
    pr = res['probes']
    seeds = range(8)

    def d(a, b):
        return [a(k) - b(k) for k in seeds if a(k) is not None and b(k) is not None]
    L = lambda s, n: lambda k: loss.get((s, n, k))                                   # noqa: E731
    cost = lambda s, a, b: lambda k: None if L(s, a)(k) is None or L(s, b)(k) is None else L(s, b)(k) - L(s, a)(k)  # noqa: E731
    probe = lambda s, key: lambda k: pr.get(s, {}).get(str(k), {}).get(key)         # noqa: E731
    values = [d(cost('preln', 4, 8), lambda k: 0.0), d(cost('attnres', 4, 8), cost('preln', 4, 8)),
              d(cost('hc', 4, 8), cost('preln', 4, 8)), d(cost('preln', 2, 4), lambda k: 0.0),
              d(cost('attnres', 2, 4), cost('preln', 2, 4)), d(cost('hc', 2, 4), cost('preln', 2, 4)),
              d(L('attnres', 8), L('preln', 8)), d(L('hc', 8), L('preln', 8))]
    values += [d(probe(s, key), probe('preln', key)) for key in ('R_causal', 'R_perm') for s in ('attnres', 'hc')]
    values += [d(probe(s, 'prune_late'), probe('preln', 'prune_late')) for s in ('attnres', 'hc')]
    rows = [r for r in mini.findings(res) if r['p'] is not None]
    assert len(rows) == len(values) == 14
    ps = []
    for r, v in zip(rows, values):
        n, m = len(v), sum(v) / len(v)
        se = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1) / n)
        ps.append(2 * student.sf(abs(m / se), n - 1))
        assert (r['n'], r['mean'], r['se'], r['p']) == (n, pytest.approx(m), pytest.approx(se), pytest.approx(ps[-1]))
        q = student.ppf(0.975, n - 1)
        assert (r['lo'], r['hi']) == (pytest.approx(m - q * se), pytest.approx(m + q * se))
    for r, a in zip(rows, _holm_by_hand(ps)):
        assert r['p_holm'] == pytest.approx(a)
        sig = a <= 0.05
        if r['here']:  # the two scalings, as docs/mini.md states them
            ref = [loss.get(('preln', 8 if 'deepest' in r['finding'] else 2 if 'L 2 ->' in r['finding'] else 4, k))
                   for k in seeds]
            ref = sum(x for x in ref if x is not None) / sum(x is not None for x in ref)
            paper = float(r['paper'])
            F, B = paper / (2.782 if 'deepest' in r['finding'] else 2.759) * ref, paper / (3_094_132 / 653_670)
            assert r['here'] == {'F': pytest.approx(F), 'B': pytest.approx(B)}
            inside = [r['lo'] <= x <= r['hi'] for x in (F, B)]
            beyond = [(r['hi'] < x) if x < 0 else (r['lo'] > x) for x in (F, B)]
            with_sign = sig and (r['mean'] > 0) == (paper > 0)
            want = ('reproduces' if all(inside) else 'same direction, size not matched'
                    if not any(inside) and len(set(beyond)) == 1 else 'same direction, size unsettled') if with_sign \
                else 'opposite' if sig else "bounded below the paper's size" \
                if not any(inside) and not any(beyond) else 'not resolved at this scale'
        else:
            want = ('differs from the paper' if 'as much as' in r['finding'] else 'same direction, no size to compare') \
                if sig else 'not resolved at this scale'
        assert r['verdict'] == want, r['finding']


def _rung(runs, tpp=5.0):
    return {'5': {'family': 'mini_tpp5', 'tokens_per_backbone_param': tpp, 'runs': runs}}


def test_a_rungs_rows_by_hand():
    # first rung: Pre-LN 2.0 at L = 4 and 8 (seed offsets 0.01 k); HC 0.12 below it at L = 8, Full
    # AttnRes 0.02 below, each with a per-seed wobble. Second rung: every loss 0.1 lower; HC's gap
    # shrinks to 0.08 (+0.04, toward the paper's size under both scalings), Full AttnRes's grows by 0.01.
    wob = [0.004, -0.003, 0.001, -0.002, 0.003, -0.003]
    first, second = [], []
    for k in range(6):
        for L in (4, 8):
            first.append(_row('preln', L, k, 2.0 + 0.01 * k))
            second.append(_row('preln', L, k, 1.9 + 0.01 * k + (0.002 * wob[k] if L == 8 else 0)))
        first += [_row('hc', 8, k, 1.88 + 0.01 * k + wob[k]), _row('attnres', 8, k, 1.98 + 0.01 * k - wob[k])]
        second += [_row('hc', 8, k, 1.82 + 0.01 * k + 0.5 * wob[k]), _row('attnres', 8, k, 1.87 + 0.01 * k - 2 * wob[k])]
    for k in (6, 7):  # seeds the second rung does not have: no part of its rows
        first += [_row('preln', 8, k, 2.0), _row('hc', 8, k, 1.7), _row('attnres', 8, k, 2.1)]
    res = {'runs': first, 'probes': {}, 'deepest': 8, 'tokens_per_backbone_param': 2.5, 'rungs': _rung(second)}
    rows = mini.rung_findings(res, 5.0)
    assert [r['finding'].split(',')[0] for r in rows] == [
        'Pre-LN: extra depth costs loss (L 4 -> 8; paper 16 -> 32)', 'HC below Pre-LN at the deepest shape (L 8; paper 32)',
        'Full AttnRes below Pre-LN at the deepest shape (L 8; paper 32)',
        "HC's gap to Pre-LN at L 8: change from 2.5 to 5 tokens per parameter",
        "Full AttnRes's gap to Pre-LN at L 8: change from 2.5 to 5 tokens per parameter"]
    assert all(r['family_size'] == 5 for r in rows)                       # a Holm family of its own
    cost, hc, att, dhc, datt = rows
    assert cost['mean'] == pytest.approx(0.002 * sum(wob) / 6)
    assert hc['mean'] == pytest.approx(-0.08 + 0.5 * sum(wob) / 6 - 0.002 * sum(wob) / 6)
    assert hc['here']['F'] == pytest.approx(-0.083 / 2.782 * (1.9 + 0.025 + 0.002 * sum(wob) / 6))
    assert hc['verdict'] == stats.SIZE_NOT_MATCHED and hc['sizes'] == {'F': 'larger', 'B': 'larger'}
    assert dhc['mean'] == pytest.approx(0.04 - 0.5 * sum(wob) / 6 - 0.002 * sum(wob) / 6)
    assert dhc['towards'] == [1, 1] and dhc['verdict'] == stats.TOWARD   # larger at 2.5: shrinking is toward
    assert dhc['n'] == 6 and f"first rung, these seeds: {-0.12 + sum(wob) / 6:+.3f}" in dhc['note']
    # Full AttnRes at 2.5: -0.02 against -0.040 (F) and -0.0135 (B): smaller under F, larger under B
    assert datt['towards'] == [-1, 1] and datt['mean'] == pytest.approx(-0.01 - sum(wob) / 6)
    assert datt['verdict'] in (stats.BY_SCALING, stats.NOT_RESOLVED)
    assert datt['verdict'] == (stats.BY_SCALING if datt['p_holm'] <= 0.05 else stats.NOT_RESOLVED)
    assert 'first rung, these seeds: -0.020' in datt['note'] and 'smaller (fraction of loss)' in datt['note']
    # the first rung's own table is untouched by the rung (its family stays as stated)
    assert [r['finding'] for r in mini.findings(res)] == [r['finding'] for r in mini.findings(dict(res, rungs={}))]
    assert mini.rung_findings(dict(res, rungs=_rung([])), 5.0) == [] and mini.ladder(dict(res, rungs={})) == {}
    # five of the six seeds stated: the same numbers, no test (HC's row passed above at six)
    five = mini.rung_findings(dict(res, rungs=_rung([r for r in second if r['seed'] != 5])), 5.0)
    assert [r['verdict'] for r in five] == [stats.INTERIM] * 5
    assert all(r['p'] is None and r['p_holm'] is None and r['size'] is None for r in five)
    assert five[1]['n'] == 5 and five[1]['note'] == '5 of the 6 seeds stated'
    assert mini.format_verdicts(five).startswith('Of 5 rows, 0 are tested')


def test_a_passing_row_carries_its_robustness_and_every_tested_row_its_power():
    # two tested rows, both passing: HC's (the smaller p) meets Holm's level 0.05 / 2, which no
    # sign-based test can reach with 6 seeds (2 / 2^6 = 0.031); Full AttnRes's meets 0.05, which both reach
    runs = []
    for k in range(6):
        runs += [_row('preln', 8, k, 2.0 + 0.01 * k), _row('hc', 8, k, 1.88 + 0.01 * k + 0.001 * (-1) ** k),
                 _row('attnres', 8, k, 1.95 + 0.01 * k + 0.004 * (-1) ** k)]
    text = mini.format_verdicts(mini.findings({'runs': runs, 'probes': {}, 'deepest': 8}))
    lines = text.splitlines()
    hc = next(i for i, x in enumerate(lines) if x.startswith('  - HC below Pre-LN'))
    att = next(i for i, x in enumerate(lines) if x.startswith('  - Full AttnRes below Pre-LN'))
    assert 'detectable with 80% power' in lines[hc] and 'detectable with 80% power' in lines[att]
    assert lines[hc + 1].startswith('    - without normality: sign-flip permutation p 0.031, sign test p 0.031')
    assert lines[hc + 1].endswith("Holm level 0.0250: neither reaches it, nor could at this n; the verdict rests "
                                  "on the t-test's normal model")
    assert lines[att + 1].endswith("Holm level 0.0500: both reach it")
    assert sum('without normality' in x for x in lines) == 2              # the rows that do not pass have none


def test_collect_reads_the_rung_with_its_commit_and_keeps_the_prior(tmp_path):
    run = next(iter(families.runs('mini_tpp5', ['hc'], [8])))
    d = tmp_path / results.seeded(run, 2).out_dir
    d.mkdir(parents=True)
    (d / 'summary.json').write_text(json.dumps({'finished': True, 'val_loss': 1.5, 'iter': 1082, 'max_iters': 1082,
                                                'tokens': 4431872, 'n_params': 945000}))
    sweep.record_wall_time(results.seeded(run, 2), str(tmp_path), 600.0, commit='f80fc5ca117e')
    prior_row = dict(results.read_result(results.seeded(run, 3), str(tmp_path)), seed=3, status='finished', val_loss=1.6)
    prior = {'family': 'mini', 'tokens_per_backbone_param': 2.5, 'deepest': 8, 'probes': {}, 'runs': [],
             'rungs': {'5': {'runs': [prior_row]}}}
    res = mini.collect(str(tmp_path), prior=prior)
    rung = res['rungs']['5']
    assert (rung['family'], rung['tokens_per_backbone_param'], len(rung['runs'])) == ('mini_tpp5', 5.0, 36)
    by = {(r['scheme'], r['L'], r['seed']): r for r in rung['runs']}
    assert (by[('hc', 8, 2)]['val_loss'], by[('hc', 8, 2)]['commits'], by[('hc', 8, 2)]['wall_s']) == \
        (1.5, ['f80fc5ca117e'], 600.0)
    assert by[('hc', 8, 3)]['val_loss'] == 1.6 and by[('preln', 4, 0)]['status'] == 'missing'
    timing = mini.format_timing(res)
    assert '- 5 tokens per parameter, L = 8: 1 timed run, 10 minutes of wall time each (1082 steps)' in timing
    assert '- code at 5 tokens per parameter: 1 commit (f80fc5ca117e) over the 1 runs that record one; 1 record none' \
        in timing


def test_the_ladder_figure_pairs_the_seeds_both_rungs_have(tmp_path):
    wob = lambda s, k: 0.001 * (k % 3) * (s == 'hc')  # noqa: E731
    first = [_row(s, L, k, 2.0 - 0.1 * (s == 'hc') + 0.01 * k + wob(s, k)) for s in families.HEADLINE for L in (4, 8)
             for k in range(8)]
    second = [_row(s, L, k, 1.9 - 0.08 * (s == 'hc') + 0.01 * k + 0.001 * k * k + wob(s, k)) for s in families.HEADLINE
              for L in (4, 8) for k in range(6)]
    res = {'runs': first, 'probes': {}, 'deepest': 8, 'tokens_per_backbone_param': 2.5, 'rungs': _rung(second)}
    points = mini.ladder_points(res)
    gap, cost = points.values()
    assert [(t, len(v)) for t, v, _, _ in gap['hc']] == [(2.5, 6), (5.0, 6)]   # seeds 6 and 7 have no second rung
    assert gap['hc'][0][1] == pytest.approx([-0.1 + 0.001 * (k % 3) for k in range(6)])
    assert gap['hc'][1][1] == pytest.approx([-0.08 + 0.001 * (k % 3) for k in range(6)])
    assert gap['hc'][1][2] == pytest.approx(-0.083 / 2.782 * (1.9 + 0.025 + 0.001 * 55 / 6))    # F follows the rung
    assert gap['hc'][0][3] == gap['hc'][1][3] == pytest.approx(-0.083 / mini.BYTES_PER_TOKEN)  # B does not
    assert list(cost) == ['preln'] and mini.ladder_points(dict(res, rungs={})) == {k: {} for k in points}
    from study import mini_plots
    mini_plots.plot_ladder(points, tmp_path / 'ladder.png')
    assert (tmp_path / 'ladder.png').stat().st_size > 10_000


@committed
def test_every_committed_row_of_the_second_rung_recomputed_independently():
    from scipy.stats import t as student
    res = json.loads(COMMITTED.read_text())
    first = {(r['scheme'], r['L'], r['seed']): r['val_loss'] for r in res['runs'] if r['status'] == 'finished'}
    rung = {(r['scheme'], r['L'], r['seed']): r['val_loss'] for r in res['rungs']['5']['runs'] if r['status'] == 'finished'}
    if not rung:
        pytest.skip("no run of the second rung is committed yet")
    seeds = sorted({k for (_, _, k) in rung})
    gap = lambda table, s, k: table[(s, 8, k)] - table[('preln', 8, k)]   # noqa: E731
    mean = lambda xs: sum(xs) / len(xs)                                    # noqa: E731

    def t(v):
        n, m = len(v), mean(v)
        se = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1) / n)
        q = student.ppf(0.975, n - 1)
        return dict(n=n, mean=m, se=se, p=2 * student.sf(abs(m / se), n - 1), lo=m - q * se, hi=m + q * se)

    def size(r, x):
        return 'matched' if r['lo'] <= x <= r['hi'] else 'larger' if ((r['hi'] < x) if x < 0 else (r['lo'] > x)) else 'smaller'
    bpt = 3_094_132 / 653_670
    pre8 = mean([rung[('preln', 8, k)] for k in seeds])
    want = [t([rung[('preln', 8, k)] - rung[('preln', 4, k)] for k in seeds]),
            t([gap(rung, 'hc', k) for k in seeds]), t([gap(rung, 'attnres', k) for k in seeds]),
            t([gap(rung, 'hc', k) - gap(first, 'hc', k) for k in seeds]),
            t([gap(rung, 'attnres', k) - gap(first, 'attnres', k) for k in seeds])]
    papers = [(0.023 / 2.759 * mean([rung[('preln', 4, k)] for k in seeds]), 0.023 / bpt),
              (-0.083 / 2.782 * pre8, -0.083 / bpt), (-0.064 / 2.782 * pre8, -0.064 / bpt)]
    for w, a in zip(want, _holm_by_hand([w['p'] for w in want])):
        w['holm'] = a
    rows = mini.rung_findings(res, 5.0)
    complete = seeds == list(range(6))  # the seeds its rows were stated for
    for r, w in zip(rows, want):
        assert (r['n'], r['mean'], r['se'], r['lo'], r['hi']) == \
            (w['n'], pytest.approx(w['mean']), pytest.approx(w['se']), pytest.approx(w['lo']), pytest.approx(w['hi']))
        if complete:
            assert (r['p'], r['p_holm']) == (pytest.approx(w['p']), pytest.approx(w['holm']))
        else:  # interim: no test, no verdict
            assert r['p'] is None and r['p_holm'] is None and r['verdict'] == 'interim: fewer seeds than stated, not tested'
    for r, w, (F, B) in zip(rows[:3], want[:3], papers):
        sizes = [size(w, F), size(w, B)]
        assert r['sizes'] == {'F': sizes[0], 'B': sizes[1]}, r['finding']
    if not complete:
        return
    for r, w, (F, B) in zip(rows[:3], want[:3], papers):
        sizes = [size(w, F), size(w, B)]
        sig, with_sign = w['holm'] <= 0.05, (w['mean'] > 0) == (F > 0)
        verdict = ('opposite' if not with_sign else 'reproduces' if sizes == ['matched'] * 2 else
                   'same direction, size unsettled' if sizes[0] != sizes[1] else 'same direction, size not matched') \
            if sig else "bounded below the paper's size" if sizes == ['smaller'] * 2 else 'not resolved at this scale'
        assert r['sizes'] == {'F': sizes[0], 'B': sizes[1]} and r['verdict'] == verdict, r['finding']
    for r, w, s, p in zip(rows[3:], want[3:], ('hc', 'attnres'), (-0.083, -0.064)):
        before = t([gap(first, s, k) for k in seeds])
        ref = mean([first[('preln', 8, k)] for k in seeds])
        toward = [{'larger': 1, 'smaller': -1, 'matched': 0}[size(before, x)] for x in (p / 2.782 * ref, p / bpt)]
        sign = 1 if w['mean'] > 0 else -1
        verdict = 'not resolved at this scale' if w['holm'] > 0.05 else "moves toward the paper's size" \
            if toward == [sign, sign] else "moves away from the paper's size" if sign not in toward \
            else 'moves; toward or away depends on the scaling'
        assert r['towards'] == toward and r['verdict'] == verdict, r['finding']
