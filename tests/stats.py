"""Pearson's chi-square tests for the statistical tests of speculative decoding (chapter 13): the distribution
function, a goodness-of-fit test of counts against known probabilities, and a two-sample test of homogeneity.

Written out here rather than imported from SciPy, which the project does not depend on; ``chi2_sf`` is checked
against the standard table in ``tests/test_spec_accept.py``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping

#: Pearson's rule for the chi-square approximation: every bin is expected at least this many times.
MIN_EXPECTED = 5


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with ``df`` degrees of freedom: the regularised upper incomplete gamma function
    Q(df / 2, x / 2), by its power series below a + 1 and by its continued fraction (modified Lentz) above, as in
    Numerical Recipes (section 6.2)."""
    a, z = df / 2, x / 2
    if z <= 0:
        return 1.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:
        term = total = 1 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi2_pvalue(counts: Counter, probs: Mapping[Hashable, float], draws: int) -> float:
    """Pearson's test of ``counts`` (outcome -> count) against ``probs`` (outcome -> probability). An outcome of
    probability 0 must never be seen. Outcomes expected fewer than ``MIN_EXPECTED`` times are pooled into one bin;
    the degrees of freedom are the bins minus one."""
    impossible = [o for o in counts if probs.get(o, 0.0) <= 0]
    assert not impossible, f"drew outcomes of probability 0: {impossible}"
    bins, pooled_o, pooled_e = [], 0, 0.0
    for outcome, p in probs.items():
        if p <= 0:
            continue
        if draws * p >= MIN_EXPECTED:
            bins.append((counts.get(outcome, 0), draws * p))
        else:
            pooled_o, pooled_e = pooled_o + counts.get(outcome, 0), pooled_e + draws * p
    if pooled_e > 0:
        bins.append((pooled_o, pooled_e))
    if len(bins) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in bins)
    return chi2_sf(stat, len(bins) - 1)


def homogeneity_bins(a: Counter, b: Counter) -> list[tuple[int, int]]:
    """The 2 x k table of two samples' counts, (count in ``a``, count in ``b``) per bin: one bin per outcome
    whose expected count in each sample, under the hypothesis that both come from one distribution, is at least
    ``MIN_EXPECTED``; the rarer outcomes pooled into one more bin (dropped, rare itself, into the smallest)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    smaller = min(n_a, n_b)
    total = n_a + n_b
    bins, pooled = [], [0, 0]
    for outcome in sorted(set(a) | set(b), key=lambda o: (-(a[o] + b[o]), repr(o))):
        both = a[outcome] + b[outcome]
        if both * smaller / total >= MIN_EXPECTED:
            bins.append((a[outcome], b[outcome]))
        else:
            pooled = [pooled[0] + a[outcome], pooled[1] + b[outcome]]
    if sum(pooled) * smaller / total >= MIN_EXPECTED or not bins:
        bins.append((pooled[0], pooled[1]))
    elif sum(pooled):
        last = bins.pop()
        bins.append((last[0] + pooled[0], last[1] + pooled[1]))
    return bins


def homogeneity_pvalue(a: Counter, b: Counter) -> float:
    """Pearson's two-sample test that ``a`` and ``b`` (outcome -> count) were drawn from the same distribution:
    the chi-square statistic of their 2 x k table (:func:`homogeneity_bins`) on k - 1 degrees of freedom."""
    bins = homogeneity_bins(a, b)
    if len(bins) < 2:
        return 1.0
    n_a, n_b = sum(x for x, _ in bins), sum(y for _, y in bins)
    total = n_a + n_b
    stat = 0.0
    for x, y in bins:
        both = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = n * both / total
            stat += (observed - expected) ** 2 / expected
    return chi2_sf(stat, len(bins) - 1)


__all__ = ["MIN_EXPECTED", "chi2_pvalue", "chi2_sf", "homogeneity_bins", "homogeneity_pvalue"]
