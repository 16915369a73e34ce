"""Golden master of every plan: the plans of every README example and every point of the
sweeps in configs/*.yaml, dumped as data, so a change to what any proxy sends is deliberate.

    python tests/golden.py --update          regenerate every golden (after a deliberate change)
    python tests/golden.py --update NAME...  regenerate these cases only
    python tests/golden.py --list            the cases, with their names and worlds
    python tests/golden.py                   compare every case to its golden (as the test does)

A case is a proxy command line and a world size: `mpiexec -n N python -m proxies.X ARGS` of a
README ```sh block (README sections as tests/project/test_readme.py reads them) is X, ARGS and N;
`--dry-run --world-size N` is X, ARGS and N; a sweep point is its proxy, its own words and
machine options, and its ranks (points a skip rule skips are left out). The job is built as
the proxy's dry run builds it (`make_job(args, world)` from the proxy's parser, after
--machine's defaults; not faults.attach, as faults change no plan), and each
rank's plan, `job.plan(rank)`, as the run executes it (wire dtypes applied), is dumped:

- every op in order, every field of its dataclass (core/plan.py) that is not the field's
  default: kind, name, category, group, buffers, counts, dtypes, tags, micro-batch, chunk,
  flops, known seconds, request names; point-to-point messages with every field;
- the rank's groups and coordinates.

Peers and group members are stored relative to the rank (world rank = rank + value), so
ranks that differ only in their place in the grid (data-parallel replicas, tensor-parallel
shards) share one stored op list. Each distinct op list and group table is stored once under
a content hash; `ranks` lists every dumped rank as [rank, op list hash, group table hash,
coordinates].

Big worlds (more than FULL_OPS ops over all ranks, e.g. GPT-3 at 12,288 ranks) are folded as
the dry run folds them (core/prediction.py): one representative per combination of the
non-folded coordinates, plus the last rank (all coordinates at their highest) in full, so a
change only folded ranks would see is caught there; `folded` names the dimensions and maps
every rank to its representative.

The comparison (tests/project/test_golden.py) names the first differing rank, op and field in one
line. Integers and strings must be equal, of the same type; floats (FLOPs, seconds) to a
relative 1e-12, so a sum reordered by a refactoring does not count as a change of traffic.
IGNORE_REQUEST_NAMES per proxy compares request names (Collective.req, Wait.req) only up to a
consistent renaming (which op a Wait completes still counts); off for every proxy now.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import gzip
import hashlib
import importlib
import json
import math
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
GOLDEN_DIR = os.path.join(TESTS, "golden")
# Run as a script, sys.path starts with tests/: put this checkout's proxies first (not an
# installed copy), and keep tests/ for project/test_readme.
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
if TESTS not in sys.path:
    sys.path.append(TESTS)

from proxies import registry  # noqa: E402  (this checkout's, after the path above)

FORMAT = 1
PROXIES = tuple(registry.PROXIES)  # every registered proxy
# Compare request names only up to a consistent renaming, per proxy. The transformer
# restructure may rename CosmoFlow's requests (and nothing else): turn it on then.
IGNORE_REQUEST_NAMES = {
    "gpt2": False,
    "gpt3": False,
    "llama": False,
    "cosmoflow": False,
    "dlrm": False,
    "bert": False,
    "resnet": False,
}
FULL_OPS = 300_000  # more ops than this over all ranks: dump the folded representatives
FLOAT_REL = 1e-12
# Words of a proxy command that do not reach make_job here: the world comes from the case.
# Words that change no plan: the dry run's own, and the files a run writes (traces).
DROP = {"--dry-run": 0, "--world-size": 1, "--trace": 1, "--chakra": 1}


@dataclass(frozen=True)
class Case:
    proxy: str
    argv: tuple[str, ...]  # the proxy's own words, without DROP's
    world: int
    source: str  # README.md or configs/NAME.yaml

    @property
    def name(self) -> str:
        """File name stem: source, proxy, world, the words (shortened) and a hash of all."""
        src = os.path.splitext(os.path.basename(self.source))[0].lower()
        words = re.sub(r"[^A-Za-z0-9.]+", "_", " ".join(self.argv)).strip("_")[:48]
        key = json.dumps([self.proxy, list(self.argv), self.world])
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        return f"{src}-{self.proxy}-n{self.world}-{words or 'defaults'}-{digest}".rstrip("-")

    @property
    def ignore_request_names(self) -> bool:
        return IGNORE_REQUEST_NAMES.get(self.proxy, False)

    def describe(self) -> dict:
        return {"proxy": self.proxy, "argv": list(self.argv), "world": self.world,
                "source": self.source}  # fmt: skip


# -- the cases ------------------------------------------------------------------------------


def proxy_words(argv: list[str]) -> tuple[str, list[str]] | None:
    """(proxy, words after it) of `python -m proxies.X ...`, `python -m proxies X ...`, or a
    console script `proxies X ...` / `proxies-X ...`."""
    for i, w in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if w == "-m" and nxt.startswith("proxies.") and nxt.split(".", 1)[1] in PROXIES:
            return nxt.split(".", 1)[1], argv[i + 2 :]
        if w == "-m" and nxt == "proxies" and i + 2 < len(argv) and argv[i + 2] in PROXIES:
            return argv[i + 2], argv[i + 3 :]
        if i == 0 or argv[i - 1] != "-m":  # a command word, not a module
            name = os.path.basename(w)
            if name == "proxies" and nxt in PROXIES:
                return nxt, argv[i + 2 :]
            if name.startswith("proxies-") and name.removeprefix("proxies-") in PROXIES:
                return name.removeprefix("proxies-"), argv[i + 1 :]
    return None


# Words after which a command plans nothing (it prints and exits).
NO_PLAN = {"-h", "--help", "--version"}


def case_of(command: str, source: str) -> Case | None:
    """The case of one shell command, None when it runs no proxy of PROXIES."""
    argv = shlex.split(command)
    found = proxy_words(argv)
    if found is None:
        return None
    proxy, words = found
    if NO_PLAN & set(words):
        return None
    world = 1
    if argv[0] in ("mpiexec", "mpirun") and argv[1] in ("-n", "-np"):
        world = int(argv[2])
    kept, i = [], 0
    while i < len(words):
        w = words[i]
        name = w.split("=", 1)[0]
        if name == "--world-size":
            world = int(w.split("=", 1)[1] if "=" in w else words[i + 1])
        if name in DROP:
            i += 1 + (DROP[name] if "=" not in w else 0)
            continue
        kept.append(w)
        i += 1
    return Case(proxy, tuple(kept), world, source)


def readme_cases() -> list[Case]:
    from project import test_readme  # the README's example commands, as that test runs them

    return [c for c in (case_of(cmd, "README.md") for cmd in test_readme.EXAMPLES) if c]


def sweep_cases() -> list[Case]:
    from proxies.sweep.schema import expand, load

    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        rel = os.path.relpath(path, ROOT)
        for p in expand(load(path)):
            if p.skip or p.proxy not in PROXIES:
                continue
            machine = [relative(w) for w in p.machine_argv]
            out.append(Case(p.proxy, (*p.argv, *machine), p.ranks, rel))
    return out


def relative(word: str) -> str:
    """An absolute path inside the checkout, relative to it (goldens move with the tree)."""
    if os.path.isabs(word) and word.startswith(ROOT + os.sep):
        return os.path.relpath(word, ROOT)
    return word


def cases() -> list[Case]:
    """Every case, README first, each (proxy, words, world) once."""
    seen, out = set(), []
    for c in readme_cases() + sweep_cases():
        key = (c.proxy, c.argv, c.world)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# -- building and dumping -----------------------------------------------------------------


def build_job(case: Case):
    """The job exactly as the proxy's dry run builds it."""
    from proxies.core import cli

    module = importlib.import_module(f"proxies.{case.proxy}.proxy")
    cwd = os.getcwd()
    os.chdir(ROOT)  # machine files and data are named relative to the checkout
    try:
        words = [*case.argv, "--dry-run", "--world-size", str(case.world)]
        args = module.parser().parse_args(words)
        cli.use_machine(args)  # as runner.main and gpt3's main: --machine sets defaults
        # Not faults.attach: faults change no plan, and a real run's --slow-rank (a README
        # example) is refused with --dry-run unless there is a machine to predict.
        job = module.make_job(args, case.world)
    finally:
        os.chdir(cwd)
    return job


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, object], ...]:
    """(name, default) of a plan dataclass's fields, once per class: dataclasses.fields per
    op was a third of dumping a plan of 160,000 ops."""
    return tuple((f.name, f.default) for f in dataclasses.fields(cls))


def encode_fields(obj, rank: int) -> dict:
    """Every non-default field of a plan dataclass; peers relative to `rank`."""
    out = {}
    for name, default in _fields(type(obj)):
        v = getattr(obj, name)
        if default is not dataclasses.MISSING and v == default:
            continue
        if isinstance(v, tuple):
            v = [encode_fields(m, rank) for m in v]
            if not v:
                continue
        elif name == "peer":
            v = v - rank
        elif type(v).__name__ == "Span":  # a typed buffer key (core/plan.py): stored as it prints
            v = str(v)
        out[name] = v
    return out


def encode_ops(plan) -> list[dict]:
    return [{"op": type(op).__name__, **encode_fields(op, plan.rank)} for op in plan.ops]


def encode_groups(plan) -> dict:
    return {name: [m - plan.rank for m in members] for name, members in plan.groups.items()}


def digest(obj) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()[:16]


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def dumped_ranks(job, world: int) -> tuple[list[int], dict | None]:
    """The ranks to dump and the folding (None: every rank)."""
    from proxies.core import prediction

    ops0 = len(job.plan(0).ops)
    dims = tuple(d for d in job.fold if job.grid.degree(d) > 1)
    if world * ops0 <= FULL_OPS or not dims:
        return list(range(world)), None
    rep = prediction.representatives(job.grid, dims).tolist()
    ranks = sorted(set(rep) | {world - 1})
    return ranks, {"dims": list(dims), "representative": rep}


def dump(case: Case) -> dict:
    """The case's plans as canonical data (see the module docstring)."""
    job = build_job(case)
    world = case.world
    if job.grid.size != world:
        raise ValueError(f"{case.name}: the grid has {job.grid.size} ranks, not {world}")
    ranks, folded = dumped_ranks(job, world)
    ops: dict[str, list] = {}
    groups: dict[str, dict] = {}
    entries = []
    for r in ranks:
        plan = job.plan(r)
        if plan.rank != r:
            raise ValueError(f"{case.name}: job.plan({r}) is rank {plan.rank}'s plan")
        o, g = encode_ops(plan), encode_groups(plan)
        oid, gid = digest(o), digest(g)
        ops.setdefault(oid, o)
        groups.setdefault(gid, g)
        entries.append([r, oid, gid, dict(plan.coords)])
    return {
        "format": FORMAT,
        "case": case.describe(),
        "world": world,
        "grid": job.grid.describe(),
        "folded": folded,
        "ranks": entries,
        "ops": ops,
        "groups": groups,
    }


def path_of(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"{name}.json.gz")


def write(path: str, data: dict) -> None:
    raw = canonical(data).encode()
    with open(path, "wb") as f:  # mtime 0: the same plans give the same bytes
        with gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as z:
            z.write(raw)


def read(path: str) -> dict:
    with gzip.open(path, "rb") as f:
        return json.loads(f.read())


def case_from_golden(data: dict) -> Case:
    c = data["case"]
    return Case(c["proxy"], tuple(c["argv"]), c["world"], c["source"])


# -- comparing ------------------------------------------------------------------------------


def integrity(golden: dict) -> str | None:
    """A golden whose stored bodies do not match their hashes was edited by hand."""
    for kind in ("ops", "groups"):
        for key, body in golden[kind].items():
            if digest(body) != key:
                return f"{kind} {key} does not match its hash: edited by hand? regenerate it"
    return None


def rename_requests(ops: list[dict]) -> list[dict]:
    """Request names replaced by their order of first appearance (#0, #1 ...)."""
    names: dict[str, str] = {}
    out = []
    for op in ops:
        if "req" in op:
            op = {**op, "req": names.setdefault(op["req"], f"#{len(names)}")}
        out.append(op)
    return out


def first_difference(old, new, where: str = "") -> str | None:
    """`where: golden value vs now` of the first difference, None when equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in list(old) + [k for k in new if k not in old]:
            if k not in new:
                return f"{where}{k}: {short(old[k])} in the golden, absent (default) now"
            if k not in old:
                return f"{where}{k}: absent (default) in the golden, {short(new[k])} now"
            d = first_difference(old[k], new[k], f"{where}{k}.")
            if d:
                return d
        return None
    if isinstance(old, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(old, new, strict=False)):
            d = first_difference(a, b, f"{where.rstrip('.')}[{i}].")
            if d:
                return d
        if len(old) != len(new):
            return f"{where.rstrip('.')}: {len(old)} items in the golden, {len(new)} now"
        return None
    if isinstance(old, float) and isinstance(new, float):
        if math.isclose(old, new, rel_tol=FLOAT_REL, abs_tol=0.0):
            return None
    elif old == new and type(old) is type(new):  # 4096 is not 4096.0, nor 1 True
        return None
    at = f"{where.rstrip('.')}: " if where else ""
    return f"{at}{short(old)} in the golden, {short(new)} now"


def short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


def with_defaults(op: dict) -> dict:
    """An encoded op with the fields it leaves out at their defaults, for messages that say
    `dtype: "float32" in the golden, "bfloat16" now` rather than that a field is absent."""
    from proxies.core import plan

    def filled(cls, d: dict) -> dict:
        out = {f.name: f.default for f in dataclasses.fields(cls)}
        out = {k: v for k, v in out.items() if v is not dataclasses.MISSING}
        return {**out, **d}

    cls = getattr(plan, op["op"], None)
    if not dataclasses.is_dataclass(cls):
        return op
    out = filled(cls, op)
    for side in ("sends", "recvs"):
        if side in out:
            out[side] = [filled(plan.Msg, m) for m in out[side] or []]
    return out


def op_title(op: dict) -> str:
    what = op.get("kind") or op.get("name") or op.get("req", "")
    return f"{op['op']} {what}".strip()


def compare(golden: dict, fresh: dict, ignore_request_names: bool = False) -> str | None:
    """The first difference between a golden and a fresh dump of the same case, one line
    naming the rank, the op and the field; None when the plans are the same."""
    bad = integrity(golden)
    if bad:
        return bad
    for key in ("world", "grid", "folded"):
        d = first_difference(golden[key], fresh[key], f"{key}.")
        if d:
            return d
    old_ranks = [e[0] for e in golden["ranks"]]
    new_ranks = [e[0] for e in fresh["ranks"]]
    if old_ranks != new_ranks:
        return f"dumped ranks: {short(old_ranks)} in the golden, {short(new_ranks)} now"
    for (r, oid, ogid, oc), (_, nid, ngid, nc) in zip(golden["ranks"], fresh["ranks"], strict=True):
        d = first_difference(oc, nc, "coords.")
        if d:
            return f"rank {r}: {d}"
        if oid != nid:
            a, b = golden["ops"][oid], fresh["ops"][nid]
            if ignore_request_names:
                a, b = rename_requests(a), rename_requests(b)
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                d = first_difference(x, y) and first_difference(with_defaults(x), with_defaults(y))
                if d:
                    return f"rank {r}: op {i} ({op_title(x)}): {d}"
            if len(a) != len(b):
                return f"rank {r}: {len(a)} ops in the golden, {len(b)} now"
        if ogid != ngid:
            d = first_difference(golden["groups"][ogid], fresh["groups"][ngid], "groups.")
            if d:
                return f"rank {r}: {d} (members relative to the rank)"
    return None


def check(case: Case) -> str | None:
    """None when the case's plans equal its golden, else one line saying where not."""
    path = path_of(case.name)
    if not os.path.isfile(path):
        return f"{case.name}: no golden ({os.path.relpath(path, ROOT)}): run {REGEN}"
    d = compare(read(path), dump(case), case.ignore_request_names)
    return f"{case.name}: {d}" if d else None


REGEN = "python tests/golden.py --update"


# -- the command line -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/golden.py", description=__doc__.split("\n")[0])
    p.add_argument("--update", action="store_true", help="regenerate the goldens")
    p.add_argument("--list", action="store_true", help="list the cases")
    p.add_argument("names", nargs="*", help="only these cases (default: every case)")
    args = p.parse_args(argv)
    todo = cases()
    if args.names:
        known = {c.name: c for c in todo}
        unknown = [n for n in args.names if n not in known]
        if unknown:
            print(f"golden.py: no case named {unknown[0]} (see --list)", file=sys.stderr)
            return 2
        todo = [known[n] for n in args.names]
    if args.list:
        for c in todo:
            print(f"{c.name}\t{c.source}\t{c.world} ranks\t{c.proxy} {shlex.join(c.argv)}")
        return 0
    failed = 0
    for c in todo:
        t0 = time.perf_counter()
        if args.update:
            os.makedirs(GOLDEN_DIR, exist_ok=True)
            data = dump(c)
            write(path_of(c.name), data)
            what = f"{c.name}: {len(data['ranks'])} ranks, {len(data['ops'])} distinct op lists"
        else:
            problem = check(c)
            failed += problem is not None
            what = problem or f"{c.name}: same"
        print(f"{time.perf_counter() - t0:6.2f} s  {what}", flush=True)
    if args.update:
        stale = {path_of(c.name) for c in cases()}
        for path in sorted(glob.glob(os.path.join(GOLDEN_DIR, "*.json.gz"))):
            if path not in stale:
                print(f"note: {os.path.relpath(path, ROOT)} is no case now (kept: remove it "
                      "if that is deliberate)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
