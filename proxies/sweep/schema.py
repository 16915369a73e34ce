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
Bounds keep a mistake from exploding: at most MAX_POINTS points and MAX_REPEAT repeats; the
file itself is read by yamlfile (size, UTF-8, duplicate keys, nesting) and expressions are
bounded by expr.
A point is (proxy, ranks, resolved args, repeat index); its identity for resuming is the
canonical JSON of those four (and, for a predicted point, of the machine model).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace

from proxies.core.cli import PREDICT_DETAILS
from proxies.sweep import expr, machines, yamlfile
from proxies.sweep.launchers import template
from proxies.sweep.proxyargs import installed, lookup, proxies

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
MAX_POINTS = 10_000  # points of one sweep, skipped ones included
MAX_REPEAT = 1_000
MAX_TIMEOUT = 365 * 86400.0  # seconds: a year; finite, so --sbatch can add them up
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PROXY_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # a POSIX environment variable name
SBATCH_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")  # a long option of sbatch, no dashes
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
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
        data = yamlfile.read(path)
    except yamlfile.LoadError as e:
        raise SweepError(str(e)) from None
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
    try:
        template(launcher)
    except ValueError as e:
        fail("launcher", str(e))
    sbatch = get(data, "sbatch", dict, {}, fail)
    for k, v in sbatch.items():
        if not isinstance(k, str) or not scalar(v) or isinstance(v, bool) or v is None:
            fail(f"sbatch.{k}", "expected option: value, e.g. partition: debug")
        if not SBATCH_RE.match(k):
            fail(f"sbatch.{k}", "expected a long option of sbatch without dashes, e.g. partition")
        # Each becomes a line `#SBATCH --k=v` of the script: a newline would add a line.
        if CONTROL_RE.search(str(v)):
            fail(f"sbatch.{k}", f"{v!r}: a value may not hold a newline or control character")

    defaults = {k: data[k] for k in RUN_KEYS if k in data}
    if "runs" in data:
        runs = data["runs"]
        if not isinstance(runs, list) or not runs:
            fail("runs", f"expected a non-empty list of runs, got {kind(runs)}")
        if len(runs) > MAX_POINTS:
            fail("runs", f"{len(runs)} runs: a sweep may have at most {MAX_POINTS} points")
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
    count_points(parsed, fail)
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
    if not installed(proxy):
        known = proxies()
        close = difflib.get_close_matches(proxy, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        fail(where, f"no proxy {proxy!r} ({hint}proxies: {', '.join(known)})")

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
            if not ENV_RE.match(k):
                fail(
                    f"{prefix}.{k}",
                    "not a variable name (letters, digits and _, not first a digit)",
                )
            env[k] = str(v)

    skip: list[Rule] = []
    for src, prefix in ((defaults, "skip"), (own, f"{at}skip")):
        skip += parse_rules(src.get("skip", []), prefix, fail)

    repeat = value("repeat", int, 1)
    if not 1 <= repeat <= MAX_REPEAT:
        fail(pick("repeat")[1], f"expected 1 to {MAX_REPEAT} repeats, got {repeat}")
    timeout = value("timeout", (int, float), DEFAULT_TIMEOUT)
    if not 0 < timeout <= MAX_TIMEOUT:  # nan and inf fail too
        fail(
            pick("timeout")[1],
            f"expected a positive number of seconds up to {MAX_TIMEOUT:.0f} (a year), "
            f"got {timeout}",
        )
    label = value("label", str, proxy)
    if CONTROL_RE.search(label):
        fail(pick("label")[1], f"{label!r}: a label may not hold a newline or control character")
    scaling = value("scaling", str, "strong")
    if scaling not in ("strong", "weak"):
        fail(pick("scaling")[1], f"expected strong or weak, got {scaling!r}")
    machine = machine_spec(path, at, defaults, own, pick, value, fail)
    if predict_ranks and machine is None:
        fail(pwhere, "predicting needs a machine model: add machine: FILE (configs/machines/)")
    return Run(
        key=key,
        label=label,
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


def count_points(runs: list[Run], fail) -> None:
    """Refuse a sweep of more than MAX_POINTS points before any is made: the count is
    arithmetic on the list lengths (YAML aliases can make a small file a huge product)."""
    total = 0
    for r in runs:
        combos = math.prod(len(v) if isinstance(v, tuple) else 1 for _, v, _ in r.args)
        n = combos * (len(r.ranks) * r.repeat + len(r.predict_ranks))
        total += n
        if total > MAX_POINTS:
            what = (
                f"{combos} argument combinations x ({len(r.ranks)} rank counts x "
                f"{r.repeat} repeats + {len(r.predict_ranks)} predicted)"
            )
            more = "" if total == n else f", {total} in all"
            fail(
                r.key or "args", f"{n} points ({what}{more}): a sweep may have at most {MAX_POINTS}"
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


# -- expansion (proxies/sweep/expansion.py) --------------------------------------------------


def expand(sweep: Sweep, proxy_args=lookup) -> list[Point]:
    """Every point of the sweep, in order (see expansion.expand)."""
    from proxies.sweep import expansion  # it builds on this module's types

    return expansion.expand(sweep, proxy_args)
