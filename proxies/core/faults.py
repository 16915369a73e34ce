"""Faults on purpose: slow ranks, compute noise, slow links and fail-stop, seeded.

What each option does (the README's "Faults on purpose" says the same for users):

- `--slow-rank R:F` (repeatable): every compute op of world rank R takes F times as long.
  Real compute runs the kernel, then sleeps (F - 1) x its measured duration; replay and
  model sleep F x the replayed or modelled time. F >= 1: a real kernel cannot be made
  faster, so "faster devices" are a --device-tflops or machine-file question, not a fault.
- `--jitter DIST`: each compute op's duration, on every rank, becomes duration x factor
  (+ added) with one seeded sample per op: `lognormal:S` (factor exp(S z), median 1),
  `normal:S` or `normal:P%` (factor 1 + S z, at least 0), `uniform:LO-HI` (factor in
  [LO, HI]), `exp:T` (adds an exponential delay of mean T, e.g. `exp:1ms`). Real compute
  cannot shrink: only a factor's excess over 1 (and any added time) is slept.
  The samples come from (--seed, rank, iteration): two runs with the same seed draw the same.
- `--slow-link A-B:F` (repeatable): each point-to-point message between ranks A and B of
  the plan (pipeline sends, halos; either direction) is delivered as if it took F times as
  long: the receiver, once the message is in, holds it for (F - 1) x the transfer time it
  measured (from the message being there to it being received). Collectives (MPI's or ours)
  are not delayed. The hold is booked as `fault_delay`, so categories still add up.
- `--kill-rank R@I` (repeatable): at the start of iteration I (counted from 0, warm-up
  iterations included, as the watchdog's lines count) rank R prints one line and SIGKILLs
  itself: fail-stop, as a node that dies. A real run only.

Parsing checks what one option can check (syntax, factors); `attach` checks the rest
against the job (ranks in the world, the iteration in the run, the compute mode, a link
that carries point-to-point messages) and raises cli.UsageError: one line, exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from proxies.core import cli, units

DELAY = "fault_delay"  # breakdown category of --slow-link holds
DISTRIBUTIONS = ("lognormal", "normal", "uniform", "exp")
# Bounds that keep every sleep a number time.sleep takes (a factor of 1e308 would overflow);
# far beyond them a run only meets its watchdog.
MAX_FACTOR = 1000.0
MAX_SPREAD = 10.0  # lognormal/normal S
MAX_MEAN = 3600.0  # exp:T, seconds
_STREAM = 0x6A177E5  # keeps jitter's random stream apart from any other use of --seed


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{what}: expected a finite number, got {text!r}")
    return value


def _rank(text: str, what: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{what}: expected a rank (0, 1, ...), got {text!r}")
    return int(text)


def _factor(text: str, what: str) -> float:
    f = _number(text, what)
    if not 1 <= f <= MAX_FACTOR:
        raise argparse.ArgumentTypeError(
            f"{what}: the factor must be from 1 (a fault slows) to {MAX_FACTOR:g}, got {text}"
        )
    return f


def parse_slow_rank(text: str) -> tuple[int, float]:
    """'R:F' -> (R, F)."""
    what = f"{text!r}"
    rank, sep, factor = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{what}: expected RANK:FACTOR, e.g. 1:2")
    return _rank(rank, what), _factor(factor, what)


def parse_slow_link(text: str) -> tuple[int, int, float]:
    """'A-B:F' -> (min(A, B), max(A, B), F)."""
    what = f"{text!r}"
    m = re.fullmatch(r"\s*(\S+?)-(\S+?):(\S+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{what}: expected A-B:FACTOR, e.g. 0-1:4")
    a, b = _rank(m.group(1), what), _rank(m.group(2), what)
    if a == b:
        raise argparse.ArgumentTypeError(f"{what}: a link joins two different ranks")
    return min(a, b), max(a, b), _factor(m.group(3), what)


def parse_kill(text: str) -> tuple[int, int]:
    """'R@I' -> (R, I)."""
    what = f"{text!r}"
    rank, sep, it = text.partition("@")
    if not sep or not it.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{what}: expected RANK@ITERATION, e.g. 1@2")
    return _rank(rank, what), int(it)


@dataclass(frozen=True)
class Jitter:
    """A per-op compute perturbation: duration x factor + added."""

    kind: str  # one of DISTRIBUTIONS
    a: float  # lognormal/normal: sigma; uniform: low; exp: mean seconds
    b: float = 0.0  # uniform: high
    text: str = ""

    def sample(self, rng: np.random.Generator) -> tuple[float, float]:
        """(factor, added seconds) for one op."""
        if self.kind == "lognormal":
            return min(MAX_FACTOR, math.exp(self.a * rng.standard_normal())), 0.0
        if self.kind == "normal":
            return min(MAX_FACTOR, max(0.0, 1.0 + self.a * rng.standard_normal())), 0.0
        if self.kind == "uniform":
            return float(rng.uniform(self.a, self.b)), 0.0
        return 1.0, float(rng.exponential(self.a))


def parse_jitter(text: str) -> Jitter:
    kind, sep, value = text.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in DISTRIBUTIONS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected lognormal:S, normal:S (or normal:P%), uniform:LO-HI or exp:T"
        )
    value = value.strip()
    if kind in ("lognormal", "normal"):
        pct = value.endswith("%")
        s = _number(value.removesuffix("%"), f"{text!r}") / (100 if pct else 1)
        if not 0 < s <= MAX_SPREAD:
            raise argparse.ArgumentTypeError(
                f"{text!r}: the spread must be above 0 and at most {MAX_SPREAD:g}"
            )
        return Jitter(kind, s, text=text)
    if kind == "uniform":
        lo, dash, hi = value.partition("-")
        if not dash:
            raise argparse.ArgumentTypeError(f"{text!r}: expected uniform:LO-HI, e.g. 0.9-1.1")
        a, b = _number(lo, f"{text!r}"), _number(hi, f"{text!r}")
        if not 0 <= a < b <= MAX_FACTOR:
            raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= LO < HI <= {MAX_FACTOR:g}")
        return Jitter(kind, a, b, text=text)
    try:
        mean = units.parse_quantity(value, "time")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if mean > MAX_MEAN:
        raise argparse.ArgumentTypeError(f"{text!r}: the mean must be at most {MAX_MEAN:g} s")
    return Jitter(kind, mean, text=text)


def add_faults(p: argparse.ArgumentParser) -> None:
    """The fault-injection options (every proxy, through cli.add_common)."""
    g = p.add_argument_group("faults on purpose (seeded, see the README)")
    g.add_argument(
        "--slow-rank",
        type=parse_slow_rank,
        action="append",
        default=[],
        metavar="R:FACTOR",
        help="world rank R computes FACTOR (>= 1) times slower: real compute sleeps (FACTOR-1) "
        "x each kernel's measured time after it, replay and model sleep FACTOR x their time "
        "(repeatable; not with --compute none)",
    )
    g.add_argument(
        "--jitter",
        type=parse_jitter,
        metavar="DIST",
        help="per compute op noise on every rank, seeded by --seed: lognormal:S (x exp(S z)), "
        "normal:S or normal:P%% (x (1 + S z)), uniform:LO-HI (x U(LO, HI)), exp:T (+ an "
        "exponential delay of mean T, e.g. exp:1ms); real compute only ever gets slower",
    )
    g.add_argument(
        "--slow-link",
        type=parse_slow_link,
        action="append",
        default=[],
        metavar="A-B:FACTOR",
        help="point-to-point messages between ranks A and B (either way) take FACTOR (>= 1) "
        "times as long: the receiver holds each for (FACTOR-1) x its measured transfer, "
        "booked as fault_delay (collectives are not delayed; repeatable)",
    )
    g.add_argument(
        "--kill-rank",
        type=parse_kill,
        action="append",
        default=[],
        metavar="R@ITER",
        help="rank R kills itself (SIGKILL, fail-stop) at the start of iteration ITER, "
        "counted from 0 with warm-up iterations included (repeatable; real runs only)",
    )


@dataclass
class Faults:
    """The faults of a run, for every rank."""

    slow: dict[int, float] = field(default_factory=dict)  # rank -> compute factor
    jitter: Jitter | None = None
    links: dict[tuple[int, int], float] = field(default_factory=dict)  # (lo, hi) -> factor
    kill: dict[int, int] = field(default_factory=dict)  # rank -> iteration
    seed: int = 0
    prog: str = ""

    @property
    def active(self) -> bool:
        return bool(self.slow or self.jitter or self.links or self.kill)

    @property
    def perturbs(self) -> bool:
        """Anything a prediction models (every fault but the kill)."""
        return bool(self.slow or self.jitter or self.links)

    def describe(self) -> str:
        """The header line."""
        parts = [f"rank {r} computes x{f:g}" for r, f in sorted(self.slow.items())]
        if self.jitter:
            parts.append(f"jitter {self.jitter.text} (seed {self.seed})")
        parts += [f"link {a}-{b} x{f:g}" for (a, b), f in sorted(self.links.items())]
        parts += [f"rank {r} killed at iteration {i}" for r, i in sorted(self.kill.items())]
        return "faults on purpose: " + "; ".join(parts)

    def config(self) -> dict:
        """For the JSON's config."""
        return {
            "slow_rank": {str(r): f for r, f in sorted(self.slow.items())},
            "jitter": self.jitter.text if self.jitter else None,
            "slow_link": {f"{a}-{b}": f for (a, b), f in sorted(self.links.items())},
            "kill_rank": {str(r): i for r, i in sorted(self.kill.items())},
            "seed": self.seed,
        }

    def for_rank(self, rank: int) -> RankFaults:
        peers = {b if a == rank else a: f for (a, b), f in self.links.items() if rank in (a, b)}
        return RankFaults(
            rank,
            self.slow.get(rank, 1.0),
            self.jitter,
            peers,
            self.kill.get(rank),
            self.seed,
            self.prog,
        )


class RankFaults:
    """What one rank's engine (or the predictor, for one simulated rank) consults."""

    def __init__(
        self,
        rank: int,
        slow: float,
        jitter: Jitter | None,
        links: dict[int, float],
        kill_at: int | None,
        seed: int,
        prog: str = "",
    ):
        self.rank, self.slow, self.jitter, self.links = rank, slow, jitter, links
        self.kill_at, self.seed, self.prog = kill_at, seed, prog
        self.rng = None
        self.start_iteration(0, kill=False)

    @property
    def touches_compute(self) -> bool:
        return self.slow != 1.0 or self.jitter is not None

    def start_iteration(self, iteration: int, kill: bool = True) -> None:
        """A fresh seeded stream per (seed, rank, iteration): an iteration's samples do not
        depend on how many ops earlier iterations had. Fail-stop here when due."""
        if kill and self.kill_at == iteration:
            where = f"{self.prog}: " if self.prog else ""
            print(
                f"{where}rank {self.rank}: killed on purpose by --kill-rank at iteration "
                f"{iteration}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        if self.jitter is not None:
            self.rng = np.random.default_rng([_STREAM, self.seed, self.rank, iteration])

    def _draw(self) -> tuple[float, float]:
        if self.jitter is None:
            return 1.0, 0.0
        return self.jitter.sample(self.rng)

    def seconds(self, base: float) -> float:
        """Replay/model (and the predictor): the perturbed duration of an op of `base` s."""
        factor, added = self._draw()
        return base * self.slow * factor + added

    def extra(self, measured: float) -> float:
        """Real compute: the sleep owed after a kernel that took `measured` s (a kernel
        cannot be made faster, so only what exceeds it)."""
        factor, added = self._draw()
        return max(0.0, measured * (self.slow * factor - 1.0)) + added

    def hold(self, peer: int, transfer: float) -> float:
        """--slow-link: seconds to hold a message from `peer` that took `transfer` s."""
        f = self.links.get(peer)
        return (f - 1.0) * transfer if f else 0.0

    # -- the engine's hooks (engine.py calls these only with faults given) ----------------
    def compute(self, engine, op) -> None:
        """Run (real) or sleep (replay, model) a Compute op, stretched."""
        if engine.mode == "real":
            t0 = time.perf_counter()
            engine.runtime.compute(op, engine.iteration)
            sleep = self.extra(time.perf_counter() - t0)
        elif engine.mode == "replay":
            sleep = self.seconds(engine.replay.get((op.name, op.chunk), 0.0))
        else:
            sleep = self.seconds(op.model_seconds(engine.rate))
        if sleep > 0:
            time.sleep(sleep)

    def hold_message(self, peer: int, transfer: float) -> float:
        """Hold a received message (sleep) as --slow-link says; the seconds it took."""
        hold = self.hold(peer, transfer)
        if hold <= 0:
            return 0.0
        t0 = time.perf_counter()
        time.sleep(hold)
        return time.perf_counter() - t0


def _once(option: str, pairs: list[tuple]) -> dict:
    """key -> value of a repeatable option; a key given twice is a UsageError."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            name = f"{key[0]}-{key[1]}" if isinstance(key, tuple) else f"rank {key}"
            raise cli.UsageError(f"{option}: {name} is given more than once")
        out[key] = value
    return out


def from_args(args) -> Faults:
    """The Faults the options name (not yet checked against a job)."""
    return Faults(
        slow=_once("--slow-rank", getattr(args, "slow_rank", None) or []),
        jitter=getattr(args, "jitter", None),
        links=_once("--slow-link", [((a, b), f) for a, b, f in args.slow_link or []])
        if getattr(args, "slow_link", None)
        else {},
        kill=_once("--kill-rank", getattr(args, "kill_rank", None) or []),
        seed=getattr(args, "seed", 0) or 0,
    )


def check(faults: Faults, args, world: int, plan: Callable | None = None) -> None:
    """UsageError (one line) for faults that cannot apply to this run."""
    err = cli.UsageError
    if not faults.active:
        return
    for option, ranks in (
        ("--slow-rank", list(faults.slow)),
        ("--slow-link", [r for link in faults.links for r in link]),
        ("--kill-rank", list(faults.kill)),
    ):
        for r in ranks:
            if r >= world:
                raise err(f"{option}: rank {r} is outside the world (ranks 0..{world - 1})")
    if plan is not None:
        for (a, b), f in sorted(faults.links.items()):
            if not any(m.peer == b for _, m, _ in plan(a).messages()):
                raise err(
                    f"--slow-link {a}-{b}:{f:g}: ranks {a} and {b} exchange no point-to-point "
                    f"messages in this plan (the option delays those, not collectives)"
                )
    if faults.kill:
        if args.dry_run:
            raise err("--kill-rank applies to a real run, not to --dry-run (nothing is predicted)")
        total = args.warmup + args.iters
        for r, i in sorted(faults.kill.items()):
            if i >= total:
                raise err(
                    f"--kill-rank {r}@{i}: the run has iterations 0..{total - 1} "
                    f"({args.warmup} warm-up + {args.iters} timed)"
                )
    if (faults.slow or faults.jitter) and args.compute == "none":
        option = "--slow-rank" if faults.slow else "--jitter"
        raise err(f"{option}: --compute none has no compute to slow (use real, replay or model)")
    if faults.perturbs and args.dry_run and getattr(args, "machine", None) is None:
        raise err(
            "--slow-rank, --jitter and --slow-link with --dry-run need --machine FILE "
            "(the prediction is what they change)"
        )


def attach(job, args) -> Faults | None:
    """Check the faults against the job; store them on `args.faults` (None when there are
    none), and with any active in the job's header and config."""
    faults = from_args(args)
    faults.prog = job.prog
    check(faults, args, job.grid.size, job.plan)
    args.faults = faults if faults.active else None
    if args.faults is not None:
        job.header.append(faults.describe())
        job.config["faults"] = faults.config()
    return args.faults


def of(args) -> Faults | None:
    """The attached faults of a run (None without any)."""
    return getattr(args, "faults", None)


def for_engine(args, rank: int) -> RankFaults | None:
    """What this rank's engine consults (None without faults)."""
    faults = of(args)
    return faults.for_rank(rank) if faults is not None else None


def perturbed_cost(
    faults: Faults | None, cost: Callable, how: str, iteration: int
) -> tuple[Callable, str]:
    """The predictor's compute cost, (rank, op) -> seconds, with --slow-rank and --jitter
    applied as in the run's `iteration` (the first timed one: the same seeded samples, drawn
    in the same op order, since the predictor prices each rank's ops once, in order)."""
    if faults is None or not faults.perturbs:
        return cost, how
    ranks: dict[int, RankFaults] = {}

    def perturbed(rank: int, op) -> float:
        rf = ranks.get(rank)
        if rf is None:
            rf = ranks[rank] = faults.for_rank(rank)
            rf.start_iteration(iteration, kill=False)
        return rf.seconds(cost(rank, op)) if rf.touches_compute else cost(rank, op)

    return perturbed, how + "; " + faults.describe()
