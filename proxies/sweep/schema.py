"""Sweep files: load a YAML file, validate every key, expand it into points.

A sweep names a proxy (or several under `runs:`), rank counts and a matrix of arguments:

    name: gpt2-dp                  # results go to results/<name>/
    proxy: gpt2
    ranks: [1, 2, 4]
    args:                          # scalars, or lists that form a Cartesian product
      layers: 4                    # positionals by name: layers, stages, micro_batches
      stages: [1, 2]
      model: gpt2-tiny             # options by long name (seq_len or seq-len)
      micro_batches: "{8 * stages // ranks}"   # an expression over ranks and other args
    skip:
      - divisible: [ranks, stages]         # skipped, with the reason recorded
    repeat: 1
    timeout: 600                   # seconds per point
    launcher: mpiexec              # mpirun, srun, or a template with {ranks} and {command}
    machine: machines/10gbe.yaml   # a machine model: every point also predicts
    predict_ranks: [1024, 4096]    # predicted only (one --dry-run process each), no launch

Every problem is a SweepError "FILE: KEY: problem" (exit 2), raised before anything runs.
A point is (proxy, ranks, resolved args, repeat index); its identity for resuming is the
canonical JSON of those four (and, for a predicted point, of the machine model).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace

import yaml

from proxies.core.cli import PREDICT_DETAILS
from proxies.sweep import expr, machines
from proxies.sweep.proxyargs import ProxyArgs, lookup

RUN_KEYS = {
    "label": "a name for this run in tables (default: the proxy)",
    "proxy": "the proxy module, proxies.<proxy>",
    "ranks": "rank counts, a list of positive integers",
    "args": "the proxy's arguments: scalars or lists (a Cartesian product)",
    "repeat": "times each point runs",
    "timeout": "seconds a point may run before it is killed",
    "env": "environment variables for the launch",
    "skip": "rules skipping points that cannot run",
    "scaling": "strong or weak: how speed-up and efficiency are computed",
    "precheck": "ask the proxy (--dry-run --world-size N) whether each point can run",
    "machine": "a machine model file (configs/machines/*.yaml): every point also predicts",
    "machine_set": "{KEY: VALUE}: what-if changes to the machine file (--machine-set)",
    "ranks_per_node": "ranks per node on the machine model (--ranks-per-node)",
    "predict": "auto, steps or coarse: how the predictor prices collectives (--predict)",
    "predict_ranks": "rank counts only predicted on the machine model, never launched",
}
TOP_KEYS = {
    "name": "the sweep's name: results go to results/<name>/",
    "description": "free text",
    "launcher": "mpiexec, mpirun, srun, or a template with {ranks} and {command}",
    "sbatch": "extra #SBATCH options for --sbatch, e.g. {partition: debug, nodes: 4}",
    "runs": "a list of runs, each with the keys above (top-level values are defaults)",
    **RUN_KEYS,
}
RULES = {
    "divisible": "[a, b]: skip unless a is a multiple of b (names or integers)",
    "require": "an expression that must hold, e.g. 'stages <= layers'",
    "proxy_rejects": "true: skip points the proxy's --dry-run rejects, its message the reason",
}
DEFAULT_TIMEOUT = 1800.0
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PROXY_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
EXPR_RE = re.compile(r"^\{(.+)\}$", re.S)
NOT_INSTALLED = "proxy module not installed"


class SweepError(Exception):
    """Bad sweep file: one message naming the file, the key and the problem; exit 2."""


@dataclass(frozen=True)
class Rule:
    kind: str  # divisible | require | proxy_rejects
    text: str  # the condition that must hold, as an expression ("" for proxy_rejects)
    key: str  # where it was written, for messages

    def reason(self, values: dict[str, object], path: str) -> str | None:
        """Why the point is skipped, or None when the rule lets it run."""
        if self.kind == "proxy_rejects":
            return None  # decided by the proxy itself, see launch.precheck
        try:
            ok = expr.evaluate(self.text, values)
        except expr.ExprError as e:
            raise SweepError(f"{path}: {self.key}: {e}") from None
        if ok:
            return None
        shown = ", ".join(f"{n} = {values[n]}" for n in sorted(expr.names(self.text)))
        return f"needs {self.text} ({shown})"


@dataclass(frozen=True)
class Run:
    key: str  # "runs[1]" or "" (top level), for messages
    label: str
    proxy: str
    ranks: tuple[int, ...]
    args: tuple[tuple[str, object, str], ...]  # (dest, scalar or tuple of scalars, key)
    repeat: int = 1
    timeout: float = DEFAULT_TIMEOUT
    env: tuple[tuple[str, str], ...] = ()
    skip: tuple[Rule, ...] = ()
    scaling: str = "strong"
    precheck: bool = True
    machine: machines.MachineSpec | None = None
    predict_ranks: tuple[int, ...] = ()  # points predicted (a dry run), never launched

    @property
    def skips_rejected(self) -> bool:
        return any(r.kind == "proxy_rejects" for r in self.skip)


@dataclass(frozen=True)
class Sweep:
    path: str
    name: str
    runs: tuple[Run, ...]
    launcher: str = "mpiexec"
    description: str = ""
    sbatch: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Point:
    run: Run
    ranks: int
    args: tuple[tuple[str, object], ...]  # resolved, in file order, dest names
    repeat: int  # 0-based index
    series: tuple[tuple[str, object], ...]  # the arg combination before expressions
    skip: str | None = None  # why a rule skips it
    argv: tuple[str, ...] = field(default=(), compare=False)  # the proxy's own words
    predicted: bool = False  # predict_ranks: a --dry-run on the machine model, no launch

    @property
    def proxy(self) -> str:
        return self.run.proxy

    @property
    def id(self) -> str:
        """Canonical identity: what resuming compares. A predicted point's includes the
        machine model (its file's content, the overrides): change it and it is predicted
        again. A measured point's does not: a new machine file does not repeat a
        measurement (--fresh does)."""
        ident = {
            "proxy": self.proxy,
            "ranks": self.ranks,
            "args": dict(self.args),
            "repeat": self.repeat,
        }
        if self.predicted and self.run.machine is not None:
            ident.update(predicted=True, machine=self.run.machine.identity())
        return canonical(ident)

    @property
    def machine_argv(self) -> tuple[str, ...]:
        return tuple(self.run.machine.argv()) if self.run.machine else ()

    @property
    def series_id(self) -> str:
        return canonical({"label": self.run.label, "args": dict(self.series)})

    def describe(self) -> str:
        words = " ".join(f"{k}={v}" for k, v in self.args)
        rep = f" · repeat {self.repeat + 1}/{self.run.repeat}" if self.run.repeat > 1 else ""
        if self.predicted:
            rep = " · predicted"
        return f"{self.run.label} · {self.ranks} ranks · {words}{rep}"

    def record(self) -> dict:
        """The point as stored in results.jsonl."""
        return {
            "id": self.id,
            "label": self.run.label,
            "proxy": self.proxy,
            "ranks": self.ranks,
            "args": dict(self.args),
            "repeat": self.repeat,
            "series": dict(self.series),
            "series_id": self.series_id,
            "scaling": self.run.scaling,
            **({"predicted": True} if self.predicted else {}),
            **({"machine": self.run.machine.file} if self.run.machine else {}),
        }


def canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


# -- loading and type checks ---------------------------------------------------------------


def load(path: str) -> Sweep:
    """Read and validate a sweep file (types and keys; points come from `expand`)."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise SweepError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SweepError(f"{path}: {where}not valid YAML: {problem}") from None
    return from_dict(data, path)


def from_dict(data: object, path: str) -> Sweep:
    def fail(key: str, problem: str):
        raise SweepError(f"{path}: {key}: {problem}" if key else f"{path}: {problem}")

    if not isinstance(data, dict):
        fail("", "expected a mapping of keys (name, proxy, ranks, args ...)")
    unknown(data, TOP_KEYS, "", fail)
    stem = os.path.splitext(os.path.basename(path))[0]
    name = get(data, "name", str, stem, fail)
    if not NAME_RE.match(name):
        fail("name", f"{name!r}: use letters, digits, '.', '_', '-' (it names a directory)")
    launcher = get(data, "launcher", str, "mpiexec", fail)
    from proxies.sweep.launch import template  # launch imports schema's types

    try:
        template(launcher)
    except ValueError as e:
        fail("launcher", str(e))
    sbatch = get(data, "sbatch", dict, {}, fail)
    for k, v in sbatch.items():
        if not isinstance(k, str) or not scalar(v) or isinstance(v, bool):
            fail(f"sbatch.{k}", "expected option: value, e.g. partition: debug")

    defaults = {k: data[k] for k in RUN_KEYS if k in data}
    if "runs" in data:
        runs = data["runs"]
        if not isinstance(runs, list) or not runs:
            fail("runs", f"expected a non-empty list of runs, got {kind(runs)}")
        entries = []
        for i, r in enumerate(runs):
            if not isinstance(r, dict):
                fail(f"runs[{i}]", f"expected a mapping (proxy, args ...), got {kind(r)}")
            unknown(r, RUN_KEYS, f"runs[{i}].", fail)
            entries.append((f"runs[{i}]", r))
    else:
        entries = [("", {})]
    parsed = [run(key, defaults, r, fail, path) for key, r in entries]
    counts = Counter(r.label for r in parsed)
    for i, r in enumerate(parsed):
        if counts[r.label] > 1:  # two runs of one proxy: number them, unless labelled
            if "label" in entries[i][1] or "label" in defaults:
                fail(f"{r.key}.label", f"{r.label!r} is used by another run (labels name series)")
            parsed[i] = replace(r, label=f"{r.label}#{i}")
    description = get(data, "description", str, "", fail)
    pairs = tuple((str(k), str(v)) for k, v in sbatch.items())
    return Sweep(path, name, tuple(parsed), launcher, description, pairs)


def run(key: str, defaults: dict, own: dict, fail, path: str = "") -> Run:
    """One run: its own keys over the top-level defaults (args and env merge, skip adds)."""
    at = f"{key}." if key else ""

    def pick(k: str):
        if k in own:
            return own, f"{at}{k}"
        return defaults, k

    def value(k, typ, default):
        src, where = pick(k)
        return get(src, k, typ, default, fail, where)

    src, where = pick("proxy")
    if "proxy" not in src:
        fail(f"{at}proxy" if key else "proxy", "missing: which proxy to run (e.g. gpt2)")
    proxy = value("proxy", str, None)
    if not PROXY_RE.match(proxy):
        fail(where, f"{proxy!r} is not a module name (e.g. gpt2, gpt3, cosmoflow, dlrm)")

    src, where = pick("ranks")
    psrc, pwhere = pick("predict_ranks")
    if "ranks" not in src and "predict_ranks" not in psrc:
        fail(f"{at}ranks" if key else "ranks", "missing: the rank counts, e.g. [1, 2, 4]")
    ranks = rank_list(src, "ranks", where, fail)
    predict_ranks = rank_list(psrc, "predict_ranks", pwhere, fail)
    both = sorted(set(ranks) & set(predict_ranks))
    if both:
        fail(
            pwhere,
            f"{both[0]} is in ranks too (a measured point with a machine carries its "
            "prediction already)",
        )

    args: dict[str, tuple[object, str]] = {}
    for src, prefix in ((defaults, "args"), (own, f"{at}args")):
        for k, (v, where) in parse_args(src.get("args", {}), prefix, fail).items():
            args[k] = (v, where)

    env: dict[str, str] = {}
    for src, prefix in ((defaults, "env"), (own, f"{at}env")):
        e = get(src, "env", dict, {}, fail, prefix)
        for k, v in e.items():
            if not isinstance(k, str) or not scalar(v) or isinstance(v, bool) or v is None:
                fail(f"{prefix}.{k}", f"expected a string or number, got {v!r} (quote it)")
            env[k] = str(v)

    skip: list[Rule] = []
    for src, prefix in ((defaults, "skip"), (own, f"{at}skip")):
        skip += parse_rules(src.get("skip", []), prefix, fail)

    repeat = value("repeat", int, 1)
    if repeat < 1:
        fail(pick("repeat")[1], f"expected a positive integer, got {repeat}")
    timeout = value("timeout", (int, float), DEFAULT_TIMEOUT)
    if not timeout > 0:
        fail(pick("timeout")[1], f"expected a positive number of seconds, got {timeout}")
    scaling = value("scaling", str, "strong")
    if scaling not in ("strong", "weak"):
        fail(pick("scaling")[1], f"expected strong or weak, got {scaling!r}")
    machine = machine_spec(path, at, defaults, own, pick, value, fail)
    if predict_ranks and machine is None:
        fail(pwhere, "predicting needs a machine model: add machine: FILE (configs/machines/)")
    return Run(
        key=key,
        label=value("label", str, proxy),
        proxy=proxy,
        ranks=tuple(sorted(ranks)),
        args=tuple((k, v, w) for k, (v, w) in args.items()),
        repeat=repeat,
        timeout=float(timeout),
        env=tuple(env.items()),
        skip=tuple(skip),
        scaling=scaling,
        precheck=value("precheck", bool, True),
        machine=machine,
        predict_ranks=tuple(sorted(predict_ranks)),
    )


def rank_list(src: dict, k: str, where: str, fail) -> list[int]:
    if k not in src:
        return []
    ranks = src[k]
    ranks = ranks if isinstance(ranks, list) else [ranks]
    if not ranks or not all(isinstance(n, int) and not isinstance(n, bool) for n in ranks):
        fail(where, f"expected positive integers, e.g. [1, 2, 4], got {src[k]!r}")
    if min(ranks) < 1:
        fail(where, f"rank counts must be positive, got {min(ranks)}")
    if len(set(ranks)) != len(ranks):
        fail(where, f"a rank count is listed twice: {ranks}")
    return ranks


def machine_spec(path: str, at: str, defaults: dict, own: dict, pick, value, fail):
    """The run's machine model (None without `machine:`); machine_set merges like env."""
    sets: dict[str, tuple[object, str]] = {}
    for src, prefix in ((defaults, "machine_set"), (own, f"{at}machine_set")):
        m = get(src, "machine_set", dict, {}, fail, prefix)
        for k, v in m.items():
            if not isinstance(k, str) or not k:
                fail(prefix, f"expected KEY: VALUE with dotted keys, got {k!r}")
            sets[k] = (v, f"{prefix}.{k}")
    rpn = value("ranks_per_node", int, None)
    if rpn is not None and rpn < 1:
        fail(pick("ranks_per_node")[1], f"expected a positive integer, got {rpn}")
    predict = value("predict", str, None)
    if predict is not None and predict not in PREDICT_DETAILS:
        modes = ", ".join(PREDICT_DETAILS)
        fail(pick("predict")[1], f"expected one of {modes}, got {predict!r}")
    file = value("machine", str, None)
    if file is None:
        for k, given in (("machine_set", sets), ("ranks_per_node", rpn), ("predict", predict)):
            if given:
                where = next(iter(sets.values()))[1] if k == "machine_set" else pick(k)[1]
                fail(where, "goes with machine: FILE (a machine model to predict on)")
        return None
    return machines.spec(
        path,
        file,
        pick("machine")[1],
        sets,
        None if rpn is None else (rpn, pick("ranks_per_node")[1]),
        predict,
        fail,
    )


def parse_args(args: object, prefix: str, fail) -> dict[str, tuple[object, str]]:
    if not isinstance(args, dict):
        fail(prefix, f"expected a mapping of argument: value, got {kind(args)}")
    out: dict[str, tuple[object, str]] = {}
    for k, v in args.items():
        where = f"{prefix}.{k}"
        if not isinstance(k, str):
            fail(where, "argument names are strings (layers, stages, model ...)")
        dest = k.replace("-", "_")
        if dest in out:
            fail(where, f"given twice (as {k!r} and with '_' for '-')")
        if isinstance(v, dict):
            fail(where, 'a mapping is not a value; write expressions in quotes: "{ranks // 2}"')
        values = v if isinstance(v, list) else [v]
        if not values:
            fail(where, "an empty list gives no points")
        for x in values:
            if not scalar(x) or x is None:
                fail(where, f"expected a number, string or true/false (or a list), got {x!r}")
            m = EXPR_RE.match(x) if isinstance(x, str) else None
            if m:
                try:
                    expr.parse(m.group(1))
                except expr.ExprError as e:
                    fail(where, str(e))
        out[dest] = (tuple(values) if isinstance(v, list) else v, where)
    return out


def parse_rules(rules: object, prefix: str, fail) -> list[Rule]:
    if not isinstance(rules, list):
        fail(prefix, f"expected a list of rules ({', '.join(RULES)}), got {kind(rules)}")
    out = []
    for i, r in enumerate(rules):
        where = f"{prefix}[{i}]"
        if not isinstance(r, dict) or len(r) != 1:
            rules_text = "; ".join(f"{k}: {v}" for k, v in RULES.items())
            fail(where, f"expected one rule per item: {rules_text}")
        ((name, v),) = r.items()
        if name not in RULES:
            fail(f"{where}.{name}", f"unknown rule (known: {', '.join(RULES)})")
        if name == "divisible":
            if not (
                isinstance(v, list)
                and len(v) == 2
                and all(
                    (isinstance(x, int) and not isinstance(x, bool))
                    or (isinstance(x, str) and x.isidentifier())
                    for x in v
                )
            ):
                fail(f"{where}.divisible", f"expected [a, b] (names or integers), got {v!r}")
            out.append(Rule("divisible", f"{v[0]} % {v[1]} == 0", f"{where}.divisible"))
        elif name == "require":
            if not isinstance(v, str):
                fail(f"{where}.require", f"expected an expression string, got {v!r}")
            try:
                expr.parse(v)
            except expr.ExprError as e:
                fail(f"{where}.require", str(e))
            out.append(Rule("require", v, f"{where}.require"))
        else:
            if not isinstance(v, bool):
                fail(f"{where}.proxy_rejects", f"expected true or false, got {v!r}")
            if v:
                out.append(Rule("proxy_rejects", "", f"{where}.proxy_rejects"))
    return out


TYPE_WORDS = {str: "a string", int: "an integer", dict: "a mapping", bool: "true or false"}


def get(src: dict, k: str, typ, default, fail, where: str | None = None):
    """src[k] if present (checked against typ; bool is not an integer here), else default."""
    if k not in src:
        return default
    v = src[k]
    types = typ if isinstance(typ, tuple) else (typ,)
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        wanted = "a number" if float in types else TYPE_WORDS[types[0]]
        fail(where or k, f"expected {wanted}, got {kind(v)} ({v!r})")
    return v


def unknown(data: dict, allowed: dict, prefix: str, fail) -> None:
    for k in data:
        if k not in allowed:
            hint = ", ".join(allowed)
            fail(f"{prefix}{k}", f"unknown key (allowed: {hint})")


def scalar(v: object) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def kind(v: object) -> str:
    words = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}
    return "nothing" if v is None else words.get(type(v), f"a {type(v).__name__}")


# -- expansion -----------------------------------------------------------------------------


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
