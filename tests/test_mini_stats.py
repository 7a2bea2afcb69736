"""
The statistics behind the mini study's verdicts (study/stats.py), each against a hand-worked
case or an independent computation: Student's t, Holm, the exact sign-flip and sign tests,
the power of a row, the size comparison under two scalings and every verdict rule, each rule
also broken on purpose (the case just inside and just past it).
Run: python -m pytest tests/test_mini_stats.py -q
"""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from study import stats  # noqa: E402


def test_paired_mean_and_standard_error_by_hand():
    m, se, n = stats.paired([1.0, 2.0, 3.0, None, float('nan')])  # missing seeds are dropped
    assert (m, n) == (2.0, 3)
    assert se == pytest.approx(1.0 / math.sqrt(3))  # sample sd 1, over sqrt(n)
    assert stats.paired([0.5]) == (0.5, None, 1)     # one seed: no error, so nothing is resolved
    assert stats.paired([None]) == (None, None, 0)


def test_t_test_on_a_hand_worked_sample_where_two_standard_errors_are_not_enough():
    # [1, 3, 5]: mean 3, sample sd 2, s.e. 2 / sqrt(3), t = 3 sqrt(3) / 2 = 2.598 > 2, yet with
    # 2 degrees of freedom the two-sided p is 1 - t / sqrt(t^2 + 2) (Student's t CDF for df = 2,
    # in closed form) = 0.1217 > 0.05, and the 95% interval is mean ± 4.3027 s.e.
    t = stats.t_test([1.0, 3.0, 5.0])
    se = 2 / math.sqrt(3)
    assert t['se'] == pytest.approx(se) and t['sd'] == pytest.approx(2.0) and t['t'] == pytest.approx(3 * math.sqrt(3) / 2)
    assert t['p'] == pytest.approx(1 - t['t'] / math.sqrt(t['t'] ** 2 + 2), rel=1e-9)
    assert t['p'] == pytest.approx(0.1217, abs=1e-4)
    assert (t['lo'], t['hi']) == (pytest.approx(3 - 4.302653 * se, rel=1e-6), pytest.approx(3 + 4.302653 * se, rel=1e-6))
    assert stats.verdict(t, t['p'], +1, ()) == stats.NOT_RESOLVED


def test_t_test_with_the_sample_not_the_population_standard_deviation():
    # [0, 1, 2, 3, 4, 5, 6, 11]: mean 4, sum of squares 84, sample sd sqrt(84 / 7) = sqrt(12), so
    # t = 4 / sqrt(1.5) = 3.266 and p (7 df) = 0.01375; a population sd (/ n) gives t = 3.491,
    # p = 0.0101, and 8 degrees of freedom p = 0.0114, both below the 0.0125 Holm needs of the
    # smallest of four p-values
    t = stats.t_test([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 11.0])
    assert t['t'] == pytest.approx(4 / math.sqrt(1.5)) and t['p'] == pytest.approx(0.01375, abs=1e-5)
    adj, rejected, level = stats.holm([t['p'], 0.5, 0.6, 0.7])
    assert adj[0] == pytest.approx(4 * t['p']) and not rejected[0] and level[0] == 0.0125


def test_an_all_equal_sample_does_not_pass():
    # every seed the same: s.e. 0, so t is undefined; it must not count as infinitely significant
    t = stats.t_test([0.5, 0.5, 0.5])
    assert (t['mean'], t['se'], t['n']) == (0.5, 0.0, 3)
    assert t['p'] is None and t['lo'] is None
    assert stats.verdict(t, None, +1, ['smaller', 'smaller']) == stats.NOT_RESOLVED
    assert stats.t_test([0.5])['p'] is None                            # one seed: no test either
    assert stats.detectable(0.0, 3, 0.05) is None and stats.detectable(1.0, 1, 0.05) is None


def test_holm_on_a_hand_worked_list():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (monotone);
    # the step levels are 0.05 / 4, / 3, / 2, / 1 in that order
    adj, rejected, level = stats.holm([0.01, 0.04, 0.03, 0.005, None])
    assert adj[:4] == [pytest.approx(0.03), pytest.approx(0.06), pytest.approx(0.06), pytest.approx(0.02)]
    assert rejected == [True, False, False, True, False] and adj[4] is None
    assert level == [pytest.approx(0.05 / 3), 0.05, 0.025, 0.0125, None]
    # uncorrected, 0.03 and 0.04 would pass; Bonferroni (x 4) would put 0.01 at 0.04 and 0.03 at 0.12
    assert stats.holm([0.2, 0.9])[:2] == ([pytest.approx(0.4), pytest.approx(0.9)], [False, False])


def _flips(xs):
    """The exact two-sided sign-flip p by enumeration: the share of the 2^n sign patterns whose
    |mean| is at least the observed one."""
    obs = abs(sum(xs))
    hits = sum(abs(sum(s * x for s, x in zip(signs, xs))) >= obs - 1e-12
               for signs in np.array(np.meshgrid(*[[1, -1]] * len(xs))).T.reshape(-1, len(xs)))
    return hits / 2 ** len(xs)


def test_exact_tests_by_hand():
    # [1, 2, 3, -0.5]: of 16 sign patterns, |sum| >= 5.5 for the observed one, all positive (6.5)
    # and their mirrors: p = 4 / 16. Sign test: 3 of 4 positive, two-sided 2 (4 + 1) / 16 = 0.625.
    r = stats.exact_tests([1.0, 2.0, 3.0, -0.5])
    assert r == {'perm_p': pytest.approx(0.25), 'sign_p': pytest.approx(0.625), 'min_p': 1 / 8}
    assert _flips([1.0, 2.0, 3.0, -0.5]) == 0.25
    # every one of 8 seeds the same sign: the smallest p either test can give, 2 / 256
    r = stats.exact_tests([0.1, 0.3, 0.2, 0.5, 0.1, 0.2, 0.4, 0.3])
    assert r['perm_p'] == r['sign_p'] == r['min_p'] == pytest.approx(2 / 256)
    # a zero has no sign: the sign test counts 2 of 2 positive (p = 2 / 4); the flip test keeps it
    r = stats.exact_tests([0.0, 1.0, 2.0])
    assert r['sign_p'] == pytest.approx(0.5) and r['perm_p'] == pytest.approx(_flips([0.0, 1.0, 2.0]))
    assert stats.exact_tests([1.0]) == {'perm_p': None, 'sign_p': None, 'min_p': None}


def test_the_flip_test_agrees_with_enumeration_on_uneven_samples():
    rng = np.random.default_rng(0)
    for _ in range(5):
        xs = list(rng.normal(0.3, 1.0, size=7))
        assert stats.exact_tests(xs)['perm_p'] == pytest.approx(_flips(xs))


def test_detectable_has_the_power_it_states_by_simulation():
    # n = 6 seeds of s.d. 1 at the level 0.01 (two-sided): the critical t with 5 degrees of freedom
    # is 4.032143 (tables); draw 200,000 samples with mean = detectable() and count how often
    # |t| passes it: 80% within sampling error (s.e. 0.0009)
    delta = stats.detectable(1.0, 6, 0.01)
    x = np.random.default_rng(1).normal(delta, 1.0, size=(200_000, 6))
    t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(6))
    assert np.mean(np.abs(t) > 4.032143) == pytest.approx(0.80, abs=0.004)
    # s.d. and the level scale it as they should: twice the s.d., twice the effect; a stricter
    # level, a larger one
    assert stats.detectable(2.0, 6, 0.01) == pytest.approx(2 * delta, rel=1e-6)
    assert stats.detectable(1.0, 6, 0.05 / 14) > delta > stats.detectable(1.0, 6, 0.05)


def test_detectable_at_large_n_is_the_normal_formula():
    # (z_0.975 + z_0.8) sd / sqrt(n) = (1.959964 + 0.841621) / 20 at n = 400; t adds < 1%
    assert stats.detectable(1.0, 400, 0.05) == pytest.approx(2.801585 / 20, rel=0.01)


@pytest.mark.parametrize('lo, hi, paper, want', [
    (-0.14, -0.10, -0.052, 'larger'),     # wholly beyond a negative effect
    (-0.14, -0.052, -0.052, 'matched'),   # the end of the interval counts as inside
    (-0.14, -0.0521, -0.052, 'larger'),   # just past it
    (-0.03, -0.01, -0.04, 'smaller'),     # on the near side
    (-0.04, -0.01, -0.04, 'matched'),
    (0.005, 0.02, 0.015, 'matched'),
    (0.016, 0.02, 0.015, 'larger'),       # a positive effect: beyond is above
    (-0.01, 0.014, 0.015, 'smaller'),
    (None, None, 0.015, None), (0.0, 0.1, None, None),
])
def test_size_against_the_paper(lo, hi, paper, want):
    assert stats.size(lo, hi, paper) == want


def test_one_size_only_where_the_scalings_agree():
    assert stats.agreed_size(['larger', 'larger']) == 'larger'
    assert stats.agreed_size(['smaller', 'matched']) == 'scalings disagree'
    assert stats.agreed_size(['matched', None]) is None and stats.agreed_size([]) is None


SIG = stats.t_test([-0.10, -0.11, -0.12, -0.13])  # p = 1e-4: passes any Holm level here


@pytest.mark.parametrize('sizes, want', [
    (['matched', 'matched'], stats.REPRODUCES),
    (['matched', 'larger'], stats.SIZE_UNSETTLED),      # "reproduces" needs the size under both
    (['larger', 'matched'], stats.SIZE_UNSETTLED),
    (['larger', 'larger'], stats.SIZE_NOT_MATCHED),
    (['smaller', 'smaller'], stats.SIZE_NOT_MATCHED),
    (['larger', 'smaller'], stats.SIZE_UNSETTLED),
    ([], stats.NO_SIZE),                                 # no size on this scale: direction only
])
def test_a_significant_row_in_the_papers_direction(sizes, want):
    assert stats.verdict(SIG, 1e-3, -1, sizes) == want


def test_significance_is_the_holm_adjusted_p_at_the_level():
    assert stats.verdict(SIG, 0.05, -1, ['matched', 'matched']) == stats.REPRODUCES          # at the level: passes
    assert stats.verdict(SIG, 0.0501, -1, ['matched', 'matched']) == stats.NOT_RESOLVED       # just past: does not
    assert stats.verdict(SIG, 0.0501, -1, ['smaller', 'smaller']) == stats.BOUNDED
    assert stats.verdict(SIG, 1e-3, +1, ['matched', 'matched']) == stats.OPPOSITE
    assert stats.verdict(SIG, 1e-3, 0, []) == stats.DIFFERS


@pytest.mark.parametrize('sizes, want', [
    (['smaller', 'smaller'], stats.BOUNDED),
    (['smaller', 'matched'], stats.NOT_RESOLVED),   # one scaling alone does not bound it
    (['matched', 'smaller'], stats.NOT_RESOLVED),
    (['larger', 'larger'], stats.NOT_RESOLVED),
    ([], stats.NOT_RESOLVED),
])
def test_a_row_that_does_not_pass(sizes, want):
    t = stats.t_test([0.001, -0.001, 0.002, 0.0])
    assert stats.verdict(t, 0.5, +1, sizes) == want


def test_toward_the_paper_by_hand():
    # a negative effect (a gap below Pre-LN): larger before means shrinking (+) moves toward it
    assert stats.toward('larger', -1) == 1 and stats.toward('smaller', -1) == -1
    assert stats.toward('larger', +1) == -1 and stats.toward('matched', -1) == 0 and stats.toward(None, -1) is None


@pytest.mark.parametrize('values, p_adj, towards, want', [
    ([0.02, 0.03, 0.025], 0.01, [1, 1], stats.TOWARD),
    ([0.02, 0.03, 0.025], 0.01, [-1, -1], stats.AWAY),
    ([0.02, 0.03, 0.025], 0.01, [-1, 0], stats.AWAY),        # a matched start: any move is away
    ([0.02, 0.03, 0.025], 0.01, [-1, 1], stats.BY_SCALING),
    ([0.02, 0.03, 0.025], 0.01, [1, 0], stats.BY_SCALING),   # toward under one only
    ([-0.02, -0.03, -0.025], 0.01, [-1, -1], stats.TOWARD),
    ([0.02, 0.03, 0.025], 0.0501, [1, 1], stats.NOT_RESOLVED),
])
def test_change_verdict(values, p_adj, towards, want):
    assert stats.change_verdict(stats.t_test(values), p_adj, towards) == want
