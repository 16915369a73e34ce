"""Expanding a validated sweep into points: runs, then argument combinations (a Cartesian
product), then ranks, then repeats; expressions resolved per point, every value checked
against the proxy's own parser, skip rules applied. schema.count_points has bounded the
number of points before this runs."""

from __future__ import annotations

import itertools

from proxies.sweep import expr
from proxies.sweep.proxyargs import ProxyArgs, lookup
from proxies.sweep.schema import EXPR_RE, NOT_INSTALLED, Point, Run, Sweep, SweepError


def expand(sweep: Sweep, proxy_args=lookup) -> list[Point]:
    """Every point of the sweep, in order: runs, then argument combinations, then ranks,
    then repeats. Arguments are checked against the proxy's parser; rules mark skips."""
    points: list[Point] = []
    seen: dict[str, str] = {}
    for r in sweep.runs:
        try:
            info = proxy_args(r.proxy)
        except ImportError as e:
            where = f"{r.key}.proxy" if r.key else "proxy"
            raise SweepError(f"{sweep.path}: {where}: {e}") from None
        for p in run_points(sweep.path, r, info):
            if p.id in seen:
                raise SweepError(
                    f"{sweep.path}: {r.key or 'args'}: point {p.describe()} is also made by "
                    f"{seen[p.id] or 'the top level'}: each point must be unique"
                )
            seen[p.id] = r.key
            points.append(p)
    return points


def run_points(path: str, r: Run, info: ProxyArgs | None) -> list[Point]:
    def fail(key: str, problem: str):
        raise SweepError(f"{path}: {key}: {problem}")

    dests = [d for d, _, _ in r.args]
    where = {d: w for d, _, w in r.args}
    choices = [v if isinstance(v, tuple) else (v,) for _, v, _ in r.args]
    points = []
    checked: set[tuple[str, str]] = set()
    for combo in itertools.product(*choices):
        series = tuple(zip(dests, combo, strict=True))
        # Measured rank counts, then predicted ones; a prediction is deterministic: one
        # point whatever `repeat` says.
        for ranks, predicted in [(n, False) for n in r.ranks] + [
            (n, True) for n in r.predict_ranks
        ]:
            repeats = 1 if predicted else r.repeat
            if info is None:  # not installed: nothing to check, nothing to resolve
                for i in range(repeats):
                    points.append(
                        Point(r, ranks, series, i, series, NOT_INSTALLED, predicted=predicted)
                    )
                continue
            values = {**info.defaults(), "ranks": ranks}
            literal = {d: v for d, v in series if not is_expr(v)}
            values.update(literal)
            resolved = []
            for d, v in series:
                if is_expr(v):
                    try:
                        v = expr.evaluate(EXPR_RE.match(v).group(1), values)
                    except expr.ExprError as e:
                        fail(where[d], f"at ranks = {ranks}: {e}")
                    if isinstance(v, float) and v.is_integer():
                        v = int(v)
                    values[d] = v
                resolved.append((d, v))
            for d, v in resolved:
                if (d, repr(v)) in checked:
                    continue
                problem = info.check(d, v)
                if problem:
                    shown = f" = {v!r} (at ranks = {ranks})" if is_expr(dict(series)[d]) else ""
                    fail(where[d] + shown, problem)
                checked.add((d, repr(v)))
            args = dict(resolved)
            gap = info.positional_gap(args)
            if gap:
                order = " ".join(info.positionals)
                fail(
                    f"{r.key + '.' if r.key else ''}args",
                    f"{gap} is left out but a later positional is given (they go in order: "
                    f"{order})",
                )
            reason = None
            for rule in r.skip:
                reason = rule.reason(values, path)
                if reason:
                    break
            argv = tuple(info.argv(args))
            for i in range(repeats):
                points.append(Point(r, ranks, tuple(resolved), i, series, reason, argv, predicted))
    return points


def is_expr(v: object) -> bool:
    return isinstance(v, str) and bool(EXPR_RE.match(v))
