"""Paired statistics of seed runs: Student's t-test on per-seed gaps, its p-value and 95% interval.

``compare`` and ``compare-join`` report a gap between two variants paired by seed (same start, same
batches). With n seeds the per-seed gaps d_1..d_n give mean m, sample std s and t = m / (s / sqrt(n)) with
n - 1 degrees of freedom; the two-sided p-value is P(|T| >= |t|) and the 95% confidence interval is
m ± t_{0.975, n-1} s / sqrt(n). A gap is *resolved* at p < 0.05. With three seeds that needs |t| > 4.30,
not the |t| > 2 of "two standard errors" (p about 0.18). Where a gap is not resolved, the interval says
what it rules out: no difference larger than max(|lower|, |upper|) at 95%.

The Student-t distribution is computed here (regularized incomplete beta by Lentz's continued fraction)
so that ``compare-join`` stays a fraction of a second; tests check it against scipy.
"""
from __future__ import annotations

import math
import statistics

__all__ = ["paired_t", "t_two_sided_p", "t_quantile", "ALPHA", "verdict"]

#: significance level of "resolved"
ALPHA = 0.05


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's T with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's T with ``df`` degrees of freedom (bisection)."""
    lo, hi = 0.0, 1e4
    target = 2.0 * (1.0 - q)  # the two-sided tail beyond the quantile
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_two_sided_p(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def paired_t(gaps: list[float]) -> dict:
    """Student's t-test of per-seed gaps against 0: ``{"n", "mean", "std", "t", "df", "p", "ci95": [lo, hi]}``
    (t, p and the interval are None below two seeds; a zero spread gives p 0 unless the mean is 0 too)."""
    n = len(gaps)
    mean = statistics.fmean(gaps) if gaps else float("nan")
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "t": None, "df": None, "p": None, "ci95": None}
    std = statistics.stdev(gaps)
    se = std / math.sqrt(n)
    df = n - 1
    if se == 0.0:
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    else:
        t = mean / se
    half = t_quantile(0.975, df) * se
    return {"n": n, "mean": mean, "std": std, "t": t, "df": df, "p": t_two_sided_p(t, df),
            "ci95": [mean - half, mean + half]}


def verdict(test: dict, scale: float = 100.0, unit: str = "%") -> str:
    """``resolved (p = 0.012)``, or where not: ``not resolved (p = 0.31): no difference larger than 0.84%
    at 95%``; ``n/a (1 seed)`` for one seed."""
    if test["p"] is None:
        return f"n/a ({test['n']} seed)"
    p = test["p"]
    ptxt = f"p = {p:.3f}" if p >= 0.001 else "p < 0.001"
    if p < ALPHA:
        return f"resolved ({ptxt})"
    bound = max(abs(test["ci95"][0]), abs(test["ci95"][1])) * scale
    return f"not resolved ({ptxt}): no difference larger than {bound:.2f}{unit} at 95%"
