"""
The statistics behind the mini study's verdicts (docs/mini.md), on per-seed paired values:

    t_test([-0.12, -0.10, ...])        # Student's t against 0: mean, s.e., n, t, p, 95% interval
    holm([0.01, 0.04, None])           # Holm's step-down adjusted p-values, rejections, step levels
    exact_tests(xs)                    # the sign-flip permutation and sign tests (no normality)
    detectable(sd, n, alpha)           # the smallest mean the t-test finds with 80% power
    size(lo, hi, paper)                # the 95% interval against the paper's effect on one scale
    verdict(...), change_verdict(...)  # the words a row may use

Every test is two-sided at ALPHA; scipy.stats does the distributions (t, noncentral t,
binomial, permutations). Values are plain floats; None marks a missing seed or an undefined
result (fewer than two seeds, or every seed the same: s.e. 0, where t has no distribution).
"""

import math

ALPHA = 0.05  # the family-wise error rate of a table of findings (Holm over its tested rows)
POWER = 0.8   # the power at which detectable() states a row's smallest detectable effect

# the verdict words (docs/mini.md states the rules)
REPRODUCES = 'reproduces'
SIZE_NOT_MATCHED = 'same direction, size not matched'
SIZE_UNSETTLED = 'same direction, size unsettled'
NO_SIZE = 'same direction, no size to compare'
OPPOSITE = 'opposite'
DIFFERS = 'differs from the paper'
BOUNDED = "bounded below the paper's size"
NOT_RESOLVED = 'not resolved at this scale'
NOT_TESTABLE = 'not testable here'
INTERIM = 'interim: fewer seeds than stated, not tested'
TOWARD = "moves toward the paper's size"
AWAY = "moves away from the paper's size"
BY_SCALING = 'moves; toward or away depends on the scaling'
VERDICTS = (REPRODUCES, SIZE_NOT_MATCHED, SIZE_UNSETTLED, NO_SIZE, OPPOSITE, DIFFERS, TOWARD, AWAY, BY_SCALING,
            BOUNDED, NOT_RESOLVED, NOT_TESTABLE, INTERIM)
PASSING = (REPRODUCES, SIZE_NOT_MATCHED, SIZE_UNSETTLED, NO_SIZE, OPPOSITE, DIFFERS, TOWARD, AWAY, BY_SCALING)


def values(xs):
    """The finite values of xs (None and NaN, missing seeds, dropped)."""
    return [float(x) for x in xs if x is not None and math.isfinite(x)]


def paired(xs):
    """(mean, standard error, n) of per-seed values: the s.e. is the sample standard deviation
    (n - 1) over sqrt(n) (scipy.stats.sem), None for one seed; (None, None, 0) for none."""
    from scipy import stats
    xs = values(xs)
    if not xs:
        return None, None, 0
    return sum(xs) / len(xs), (float(stats.sem(xs)) if len(xs) > 1 else None), len(xs)


def t_test(xs, alpha=ALPHA):
    """
    A two-sided one-sample Student t-test of per-seed values against 0, n - 1 degrees of
    freedom (scipy.stats.ttest_1samp), with its 1 - alpha confidence interval. Returns
    {mean, se, n, sd, t, p, lo, hi}; t, p, lo, hi are None when the test is undefined (fewer
    than two seeds, or s.e. 0: such a sample must not pass).
    """
    from scipy import stats
    m, se, n = paired(xs)
    out = dict(mean=m, se=se, n=n, sd=None if se is None else se * math.sqrt(n), t=None, p=None, lo=None, hi=None)
    if n < 2 or not se:
        return out
    res = stats.ttest_1samp(values(xs), 0.0)
    ci = res.confidence_interval(1 - alpha)
    out.update(t=float(res.statistic), p=float(res.pvalue), lo=float(ci.low), hi=float(ci.high))
    return out


def holm(ps, alpha=ALPHA):
    """
    Holm's step-down correction (Holm 1979): ps (p-values, None = untested) -> (adjusted p,
    rejected, level) per entry, in the same order, None/False/None for untested ones. The i-th
    smallest of m p-values (i from 1) is compared with the level alpha / (m - i + 1); its
    adjusted p is (m - i + 1) p, made non-decreasing and capped at 1, and it is rejected when
    that is <= alpha (so every smaller p is rejected too).
    """
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    m = len(idx)
    adj, level, run = [None] * len(ps), [None] * len(ps), 0.0
    for rank, i in enumerate(idx):
        run = max(run, min(1.0, (m - rank) * ps[i]))
        adj[i], level[i] = run, alpha / (m - rank)
    return adj, [a is not None and a <= alpha for a in adj], level


def exact_tests(xs):
    """
    Tests that do not assume normality, of per-seed values against 0 (two-sided): the exact
    sign-flip permutation test of the mean (all 2^n flips, scipy.stats.permutation_test) and
    the sign test (scipy.stats.binomtest on the non-zero values). Returns {perm_p, sign_p,
    min_p}; min_p = 2 / 2^n is the smallest p either can give with n seeds. None for n < 2.
    """
    import numpy as np
    from scipy import stats
    xs = values(xs)
    n = len(xs)
    if n < 2:
        return dict(perm_p=None, sign_p=None, min_p=None)
    perm = stats.permutation_test((np.array(xs),), np.mean, permutation_type='samples', n_resamples=np.inf,
                                  alternative='two-sided')
    nonzero = [x for x in xs if x != 0]
    sign = stats.binomtest(sum(x > 0 for x in nonzero), len(nonzero), 0.5).pvalue if nonzero else 1.0
    return dict(perm_p=float(perm.pvalue), sign_p=float(sign), min_p=2 / 2 ** n)


def detectable(sd, n, alpha, power=POWER):
    """
    The smallest true mean |delta| that the two-sided t-test at level `alpha` finds with
    probability `power` from n seeds of standard deviation `sd` (same units as sd): the
    rejection probability is that of the noncentral t with n - 1 degrees of freedom and
    noncentrality delta sqrt(n) / sd (scipy.stats.nct), solved for delta (scipy.optimize.brentq).
    None when undefined (n < 2, or sd 0 or None).
    """
    from scipy import optimize, stats
    if n is None or n < 2 or not sd:
        return None
    df = n - 1
    crit = float(stats.t.ppf(1 - alpha / 2, df))

    def reach(delta):  # rejection probability minus the power asked for
        nc = delta * math.sqrt(n) / sd
        return float(stats.nct.sf(crit, df, nc) + stats.nct.sf(crit, df, -nc)) - power
    hi = sd
    while reach(hi) < 0:
        hi *= 2
    return float(optimize.brentq(reach, 0.0, hi, xtol=1e-12 * sd))


def size(lo, hi, paper):
    """The 95% interval [lo, hi] against the paper's effect on one scale (signed, non-zero):
    'matched' (inside), 'larger' (wholly farther from 0 on the paper's side) or 'smaller'
    (wholly on the near side); None when either is missing."""
    if lo is None or hi is None or not paper:
        return None
    if lo <= paper <= hi:
        return 'matched'
    return 'larger' if (hi < paper if paper < 0 else lo > paper) else 'smaller'


def agreed_size(sizes):
    """One size verdict from those under each scaling: theirs when all agree, 'scalings
    disagree' otherwise, None when any is missing."""
    if not sizes or any(s is None for s in sizes):
        return None
    return sizes[0] if len(set(sizes)) == 1 else 'scalings disagree'


def verdict(test, p_adj, paper_sign, sizes):
    """
    The verdict of a finding beside the paper. test: t_test's dict; p_adj: its Holm-adjusted
    p; paper_sign: +1 / -1 the paper's direction, 0 where it reports no difference; sizes:
    size() under each scaling, () where the paper's number has no size on this scale.
      significant (p_adj <= ALPHA): differs from the paper (paper_sign 0); opposite (against
        its sign); with its sign: reproduces (matched under every scaling), same direction,
        size not matched (larger, or smaller, under every scaling), size unsettled (the
        scalings disagree), no size to compare (no scaling);
      not significant: bounded below the paper's size (smaller under every scaling), else
        not resolved at this scale (an undefined test included).
    """
    agreed = agreed_size(list(sizes))
    if test['p'] is not None and p_adj is not None and p_adj <= ALPHA:
        if paper_sign == 0:
            return DIFFERS
        if (test['mean'] > 0) != (paper_sign > 0):
            return OPPOSITE
        return {None: NO_SIZE, 'matched': REPRODUCES, 'larger': SIZE_NOT_MATCHED, 'smaller': SIZE_NOT_MATCHED,
                'scalings disagree': SIZE_UNSETTLED}[agreed]
    defined = test['p'] is not None and test['lo'] is not None
    return BOUNDED if defined and agreed == 'smaller' and paper_sign != 0 else NOT_RESOLVED


def toward(size_before, paper_sign):
    """The sign of a change that moves a measured effect toward the paper's size, given the
    effect's size() before: -paper_sign when it was larger, +paper_sign when smaller, 0 when it
    matched (any change then moves away), None when unknown."""
    return {'larger': -paper_sign, 'smaller': paper_sign, 'matched': 0}.get(size_before)


def change_verdict(test, p_adj, towards):
    """
    The verdict of a change between two rungs of the study. towards: toward() under each
    scaling. Significant (p_adj <= ALPHA): moves toward the paper's size (the mean's sign is
    toward under every scaling), moves away from it (away under every scaling, a matched
    start counting as away), or moves; toward or away depends on the scaling; otherwise not
    resolved at this scale.
    """
    if test['p'] is None or p_adj is None or p_adj > ALPHA:
        return NOT_RESOLVED
    sign = 1 if test['mean'] > 0 else -1
    if towards and all(t == sign for t in towards):
        return TOWARD
    if towards and all(t is not None and t != sign for t in towards):
        return AWAY
    return BY_SCALING
