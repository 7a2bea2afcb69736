"""
Mini-DepthBench's statistics and report (study/mini.py): paired means and their errors,
the verdict rule, the findings taken from the runs and probes of each seed, and the
committed results that docs/mini.md quotes.
Run: python -m pytest tests/test_mini.py -q
"""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from study import families, mini, sweep  # noqa: E402

COMMITTED = ROOT / mini.RESULTS


def test_paired_mean_and_standard_error_by_hand():
    m, se, n = mini.paired([1.0, 2.0, 3.0, None, float('nan')])  # missing seeds are dropped
    assert (m, n) == (2.0, 3)
    assert se == pytest.approx(1.0 / math.sqrt(3))  # sample sd 1, over sqrt(n)
    assert mini.paired([0.5]) == (0.5, None, 1)     # one seed: no error, so nothing is resolved
    assert mini.paired([None]) == (None, None, 0)


@pytest.mark.parametrize('mean, se, sign, want', [
    (0.10, 0.01, +1, 'reproduces'),
    (-0.10, 0.01, -1, 'reproduces'),
    (-0.10, 0.01, +1, 'opposite'),
    (0.019, 0.01, +1, 'not resolved at this scale'),   # within two standard errors
    (0.5, None, +1, 'not resolved at this scale'),     # one seed
    (0.5, 0.0, +1, 'reproduces'),                      # every seed the same
])
def test_verdict(mean, se, sign, want):
    assert mini.verdict(mean, se, sign) == want


def _row(scheme, L, seed, loss):
    return {'scheme': scheme, 'L': L, 'seed': seed, 'status': 'finished', 'val_loss': loss}


def test_findings_pair_the_depth_cost_by_seed():
    # Pre-LN gets worse from L = 4 to 8 by 0.02 + 0.01 k; AttnRes better by 0.03 in every seed.
    # The seeds' offsets (0.1 k) cancel in the paired differences, as they should.
    runs = []
    for k in range(3):
        runs += [_row('preln', 4, k, 2.0 + 0.1 * k), _row('preln', 8, k, 2.02 + 0.11 * k),
                 _row('attnres', 4, k, 1.9 + 0.1 * k), _row('attnres', 8, k, 1.87 + 0.1 * k)]
    rows = {r['finding']: r for r in mini.findings({'runs': runs, 'probes': {}})}
    pre = rows['Pre-LN: extra depth costs loss (L 4 -> 8; paper 16 -> 32)']
    assert pre['mean'] == pytest.approx(0.03) and pre['se'] == pytest.approx(0.01 / math.sqrt(3))
    assert pre['n'] == 3 and pre['verdict'] == 'reproduces'
    att = rows['Full AttnRes turns depth into lower loss than Pre-LN']
    assert att['mean'] == pytest.approx(-0.06) and att['verdict'] == 'reproduces'   # -0.03 - (0.02 + 0.01 k)
    deep = rows['Full AttnRes below Pre-LN at the deepest shape (L 8; paper 32)']
    assert deep['mean'] == pytest.approx(-0.15 - 0.01) and deep['n'] == 3
    hc = rows['HC turns depth into lower loss than Pre-LN']
    assert hc['n'] == 0 and hc['verdict'] == 'not resolved at this scale'          # no HC runs


def test_findings_from_probes_are_paired_by_seed():
    probes = {'hc': {'0': {'erank': 3.0}, '1': {'erank': 3.5}},
              'mhc': {'0': {'erank': 3.9}, '1': {'erank': 4.0}, '2': {'erank': 4.0}},
              'blockattnres': {'0': {'low_use_sublayers': 2}, '1': {'low_use_sublayers': 2}}}
    runs = [_row('preln', 8, k, 2.0) for k in range(3)]
    rows = {r['finding']: r for r in mini.findings({'runs': runs, 'probes': probes})}
    er = rows["HC's composed residual map has a higher effective rank than mHC's (L 8)"]
    assert er['mean'] == pytest.approx((-0.9 - 0.5) / 2) and er['n'] == 2   # seed 2 has no HC probe
    assert er['se'] == pytest.approx(0.2) and er['verdict'] == 'opposite'
    low = rows['Block AttnRes: an early low-use segment (L 8)']
    assert (low['mean'], low['n']) == (1.0, 2)                                # 2 sublayers = 1 layer


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
def test_docs_quote_the_committed_results():
    results = json.loads(COMMITTED.read_text())
    doc = (ROOT / 'docs' / 'mini.md').read_text()
    for line in mini.format_findings(mini.findings(results)).splitlines()[2:]:
        assert line in doc, f"docs/mini.md lacks the finding row {line!r}"
    for line in mini.format_probes(results).splitlines()[2:]:
        assert line in doc, f"docs/mini.md lacks the probe row {line!r}"
    seeds = {r['seed'] for r in results['runs'] if r['status'] == 'finished'}
    assert len(seeds) == 3 and results['tokens_per_backbone_param'] == families.MINI_TOKENS_PER_PARAM


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
