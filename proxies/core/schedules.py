"""Pipeline schedules as data: for each stage, the ordered list of its actions.

Letters used here: pp pipeline stages (ranks in one pipeline), m micro-batches per iteration,
v model chunks per rank (virtual stages; v = 1 without interleaving), s the stage (0..pp-1).
Model chunk c on stage s is virtual stage c*pp + s, so the model runs through virtual stages
0 .. v*pp-1: stage 0, 1, .., pp-1, then back to stage 0 with its chunk 1, and so on.

An Action is one forward (F) or backward (B) of one micro-batch through one model chunk.
Printed as torch.distributed.pipelining does: "F3" is the forward of micro-batch 3, "1B2"
the backward of micro-batch 2 through model chunk 1 (chunk 0 is not printed).

    >>> " ".join(map(str, one_f_one_b(pp=4, m=8, stage=2)))
    'F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7'

The communication each action implies (receive the input before a forward, send the output
after it ...) is not part of a schedule: pipeline.py derives it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward
    mb: int  # micro-batch
    chunk: int = 0  # model chunk (virtual stage) on this rank, for interleaved schedules

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"Action kind must be 'F' or 'B', got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.chunk or ''}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of str(): "F3" -> Action("F", 3), "1B2" -> Action("B", 2, chunk=1)."""
        match = re.fullmatch(r"(\d*)([FB])(\d+)", text.strip())
        if not match:
            raise ValueError(f"cannot parse action {text!r}: expected e.g. 'F3' or '1B2'")
        chunk, kind, mb = match.groups()
        return cls(kind, int(mb), int(chunk or 0))


def parse_actions(text: str) -> list[Action]:
    """ "F0 F1 B0" -> [Action("F", 0), Action("F", 1), Action("B", 0)]."""
    return [Action.parse(word) for word in text.split()]


def _check_args(pp: int, m: int, stage: int, v: int) -> None:
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"need pp >= 1, m >= 1, v >= 1, got pp = {pp}, m = {m}, v = {v}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage = {stage} is not in 0..pp-1 = 0..{pp - 1}")


def gpipe(pp: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """All forwards F0..F(m-1), then all backwards B0..B(m-1): the C++ proxies' order.

    Backwards run in the order the micro-batches went forward, as the C++ proxy does.
    """
    _check_args(pp, m, stage, v)
    if v != 1:
        raise ValueError(f"gpipe has one model chunk per rank: v must be 1, got v = {v}")
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(pp: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """PipeDream-flush / Megatron 1F1B: at most pp - stage micro-batches in flight."""
    _check_args(pp, m, stage, v)
    if v != 1:
        raise ValueError(f"1f1b has one model chunk per rank: v must be 1, got v = {v}")
    warmup = min(pp - stage - 1, m)
    # warm-up: fill the pipeline downstream of this stage
    actions = [Action("F", i) for i in range(warmup)]
    # steady 1F1B: each forward is followed by the backward of the oldest micro-batch in flight
    for i in range(m - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    # cool-down: drain the backwards still in flight
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions


def interleaved_1f1b(pp: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """Megatron-LM's interleaved 1F1B with v model chunks per rank.

    Forwards go through the chunks in groups of pp micro-batches: the k-th forward of a stage
    is chunk (k mod v*pp) // pp, micro-batch (k // v*pp)*pp + k mod pp; backwards take the
    chunks in reverse order. Warm-up runs (pp - s - 1)*2 + (v - 1)*pp forwards (at most m*v),
    then steady 1F1B pairs (forward k + warm-up, backward k), then the cool-down backwards.
    (Older Megatron releases also ran all forwards first whenever m == pp; newer ones, and
    this function, use the formula above for every m.) v = 1 is plain 1F1B, as in Megatron,
    which uses the non-interleaved schedule without virtual stages.
    """
    _check_args(pp, m, stage, v)
    if v == 1:
        return one_f_one_b(pp, m, stage)
    if m % pp:
        raise ValueError(
            f"interleaved schedule needs micro-batches m = {m} to be a multiple of pp = {pp}"
        )
    total = m * v

    def action(kind: str, k: int) -> Action:
        group, k_in_group = divmod(k, pp * v)
        chunk, i = divmod(k_in_group, pp)
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, group * pp + i, chunk)

    warmup = interleaved_warmup(pp, m, stage, v)
    # warm-up
    actions = [action("F", k) for k in range(warmup)]
    # steady 1F1B
    for k in range(total - warmup):
        actions += [action("F", warmup + k), action("B", k)]
    # cool-down
    actions += [action("B", k) for k in range(total - warmup, total)]
    return actions


def interleaved_warmup(pp: int, m: int, stage: int, v: int) -> int:
    """Warm-up forwards (before the steady pairs) of Megatron's interleaved schedule, <= m*v."""
    return min((pp - stage - 1) * 2 + (v - 1) * pp, m * v)


Schedule = Callable[..., list[Action]]  # fn(pp, m, stage, v=1) -> actions of that stage

SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
}


def format_grid(columns: dict[str, Sequence[str]], max_steps: int = 200) -> str:
    """A Step x Rank table: one column per rank (header -> its actions), one row per step.

    Past max_steps rows only the last max_steps are shown.
    """
    names = list(columns)
    depth = max((len(c) for c in columns.values()), default=0)
    first = max(0, depth - max_steps)
    width = max([len(n) for n in names] + [len(a) for c in columns.values() for a in c] + [2])
    lines = ["Step | " + " ".join(n.ljust(width) for n in names)]
    if first:
        lines.append(f"({first} earlier steps not shown)")
    for step in range(first, depth):
        cells = [(c[step] if step < len(c) else "").ljust(width) for c in columns.values()]
        lines.append(f"{step:4d} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def validate_schedule(per_stage: list[list[Action]], m: int, v: int = 1) -> None:
    """Check each stage runs every (chunk, mb) forward and backward once, F before B.

    Raises ValueError listing every problem, followed by the Step x Rank grid.
    """
    problems = []
    for stage, actions in enumerate(per_stage):
        done: dict[tuple[str, int, int], int] = {}
        for step, a in enumerate(actions):
            where = f"stage {stage} step {step} {a}"
            if not (0 <= a.chunk < v and 0 <= a.mb < m):
                problems.append(f"{where}: chunk must be in 0..{v - 1} and mb in 0..{m - 1}")
                continue
            if (a.kind, a.chunk, a.mb) in done:
                problems.append(f"{where}: repeats step {done[a.kind, a.chunk, a.mb]}")
                continue
            if a.kind == "B" and ("F", a.chunk, a.mb) not in done:
                problems.append(f"{where}: backward before its forward")
            done[a.kind, a.chunk, a.mb] = step
        missing = [
            str(Action(kind, mb, chunk))
            for chunk in range(v)
            for kind in "FB"
            for mb in range(m)
            if (kind, chunk, mb) not in done
        ]
        if missing:
            problems.append(f"stage {stage}: missing {' '.join(missing)}")
    if problems:
        grid = format_grid(
            {f"Rank {s}": [str(a) for a in acts] for s, acts in enumerate(per_stage)}
        )
        raise ValueError("invalid schedule:\n  " + "\n  ".join(problems) + "\n" + grid)


def bubble_fraction(pp: int, m: int, v: int = 1) -> float:
    """Pipeline bubble time relative to the ideal (bubble-free) time: (pp-1) / (v*m).

    Ideal time is m forward+backward passes of one stage. With 1F1B or GPipe the bubble is
    (pp-1) passes, so the iteration takes (m + pp - 1)/m of ideal; interleaving divides the
    bubble by v (Narayanan et al. 2021). As a fraction of the whole iteration it is
    b / (1 + b) = (pp-1) / (v*m + pp-1), the familiar (p-1)/(m+p-1) for v = 1.
    """
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"need pp >= 1, m >= 1, v >= 1, got pp = {pp}, m = {m}, v = {v}")
    return (pp - 1) / (v * m)
