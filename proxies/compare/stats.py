"""The noise criterion of `python -m proxies compare`: a two-sided Mann-Whitney U test on
per-iteration samples, and the verdict in words.

Why this test: it compares the two sets of iteration times without assuming they are
normal (iteration times are skewed: a slow first iteration, a preempted one), and it is
exact for the small samples a proxy run has (5 to 50 iterations). It treats iterations as
independent draws, which they are not quite (a machine that slows down for a while slows
several in a row): the README says so.
"""

from __future__ import annotations

import math
import statistics

ALPHA = 0.05  # a difference is reported when p < ALPHA (95% confidence)
EXACT_MAX = 50  # exact distribution of U when both samples are at most this long, no ties


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def ranks(values: list[float]) -> tuple[list[float], list[int]]:
    """Mid-ranks (1-based, ties share their mean rank) and the sizes of the tie groups."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    ties = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        ties.append(j - i + 1)
        i = j + 1
    return out, ties


def u_distribution(n1: int, n2: int) -> list[int]:
    """How many of the C(n1+n2, n1) orderings give U = 0, 1, ..., n1*n2: the coefficients
    of the Gaussian binomial [n1+n2 choose n1]_q, built as the product over i of
    (1 - q^(n2+i)) / (1 - q^i); each partial product is a polynomial with integer
    coefficients, so the division is exact."""
    poly = [1]
    for i in range(1, n1 + 1):
        m = n2 + i
        grown = poly + [0] * m
        for k in range(len(grown) - 1, m - 1, -1):
            grown[k] -= grown[k - m]
        for k in range(i, len(grown)):  # divide by (1 - q^i)
            grown[k] += grown[k - i]
        poly = grown[: i * n2 + 1]
    return poly


def mann_whitney(a: list[float], b: list[float]) -> tuple[float, float]:
    """(U of a, two-sided p-value): U counts the pairs where a's sample is larger (ties
    half). Exact for small samples without ties, else the normal approximation with the
    tie correction and a continuity correction."""
    n1, n2 = len(a), len(b)
    r, ties = ranks(list(a) + list(b))
    u = sum(r[:n1]) - n1 * (n1 + 1) / 2
    if max(ties) == 1 and max(n1, n2) <= EXACT_MAX:
        counts = u_distribution(n1, n2)
        total = sum(counts)
        k = round(u)
        low = sum(counts[: k + 1]) / total
        high = sum(counts[k:]) / total
        return u, min(1.0, 2 * min(low, high))
    n = n1 + n2
    mu = n1 * n2 / 2
    var = n1 * n2 / 12 * ((n + 1) - sum(t**3 - t for t in ties) / (n * (n - 1)))
    if var <= 0:  # every sample equal
        return u, 1.0
    z = max(0.0, abs(u - mu) - 0.5) / math.sqrt(var)
    return u, math.erfc(z / math.sqrt(2))


def smallest_p(n1: int, n2: int) -> float:
    """The smallest two-sided p any data can give with these sample sizes (no ties)."""
    return min(1.0, 2 / math.comb(n1 + n2, n1))


def compare(a: list[float], b: list[float]) -> dict:
    """A's and B's spreads, the difference and ratio of medians, the test, the verdict."""
    sa, sb = spread(a), spread(b)
    ma, mb = sa["median"], sb["median"]
    _, p = mann_whitney(a, b)
    overlap = not (sa["max"] < sb["min"] or sb["max"] < sa["min"])
    out = {
        "a": sa,
        "b": sb,
        "difference_s": mb - ma,
        "ratio": mb / ma if ma else None,
        "p": p,
        "ranges_overlap": overlap,
    }
    ranges = "ranges overlap" if overlap else "ranges do not overlap"
    if smallest_p(len(a), len(b)) >= ALPHA:
        out["verdict"] = "too few iterations to tell (run more --iters)"
        out["faster"] = None
    elif p < ALPHA and ma != mb:
        change = abs(mb - ma) / ma if ma else math.inf
        word = "faster" if mb < ma else "slower"
        amount = f"{100 * change:.1f}%" if ma else "from zero"
        out["verdict"] = f"B {word} by {amount} (p={p:.2g} < {ALPHA}; {ranges})"
        out["faster"] = "B" if mb < ma else "A"
    else:
        out["verdict"] = f"no difference beyond noise (p={p:.2g}; {ranges})"
        out["faster"] = None
    return out
