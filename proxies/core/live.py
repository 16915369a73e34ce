"""What rank 0 prints while a run goes: the header first, then set-up phases that take long,
then one line per iteration as it completes (core/runner.py calls it).

Two displays. Where stdout is not a terminal (a pipe, a file, CI, an sbatch log, and every
rank under MPICH's or Open MPI's launcher: report.to_terminal) each line is plain text,
flushed as it is written, so `tail -f` and a launcher's forwarding show it at once. On a
terminal (or with FORCE_COLOR) a rich progress bar is redrawn in place, once per iteration
and at each phase: no refresh thread, so nothing of ours runs while an iteration is timed.
Other ranks print nothing; --quiet prints nothing here (the summary line only, as before).

The numbers of an iteration's line are the run's own: the slowest rank's time (what the
report's time per iteration takes) and the mean loss over the global batch, reduced to
rank 0 after the iteration, between the timed regions (see `reduce_iteration`).
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Sequence

# A set-up phase (building the model, calibrating replay) is named in plain text only once
# it has lasted this long: quick ones leave no line, a long one says what the run waits for.
SLOW_S = 1.0


def mode_for(quiet: bool, rank: int, terminal: bool) -> str:
    """'off' (--quiet, or not rank 0), 'rich' (a terminal) or 'plain'."""
    if quiet or rank != 0:
        return "off"
    return "rich" if terminal else "plain"


def iteration_line(it: int, warmup: int, total: int, seconds: float, loss: float | None) -> str:
    """The plain-text line of iteration `it` (0-based, warm-up first): 1-based of all
    `total` iterations, warm-ups marked; its time; the loss where there is one."""
    tag = " (warm-up)" if it < warmup else ""
    line = f"iteration {it + 1}/{total}{tag}: {seconds:.4f} s (slowest rank)"
    return line + (f" · loss {loss:.6f}" if loss is not None else "")


class Live:
    """Rank 0's running commentary (a no-op in mode 'off'). `out`: a rich console (by
    default report.console()); `slow_s`: see SLOW_S. `MPI` (with `compute`): the run's, for
    the reductions of `iteration`; None prints what `show` is given."""

    def __init__(
        self,
        mode: str,
        warmup: int,
        iters: int,
        out=None,
        slow_s: float = SLOW_S,
        MPI=None,
        compute: str = "",
    ) -> None:
        self.mode, self.warmup, self.total, self.slow_s = mode, warmup, warmup + iters, slow_s
        self.out, self.MPI, self.real = out, MPI, compute == "real"
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._phase: str | None = None  # the phase its timer will name (plain text)
        self._bar = None  # rich Progress and its task, in rich mode once started
        self._task = None
        self._in_phase = False  # the rich bar names a phase
        if mode != "off" and out is None:
            from proxies.core import report

            self.out = report.console()

    @classmethod
    def start(cls, args, MPI, header: list[str]) -> Live:
        """A real run's (every rank makes one): rank 0 prints `header` at once."""
        from proxies.core import report

        rank = MPI.COMM_WORLD.rank
        mode = mode_for(args.quiet, rank, rank == 0 and report.to_terminal())
        quiet = args.quiet  # no line to show: no reduction either
        shown = cls(mode, args.warmup, args.iters, MPI=None if quiet else MPI, compute=args.compute)
        shown.lines(header)
        return shown

    def lines(self, lines: list[str]) -> None:
        """Print lines (the header; the run line, which ends the set-up phases) now."""
        if self.mode == "off":
            return
        self._end_phase()
        for line in lines:
            self.out.print(line)
        self._flush()

    def phase(self, what: str, when: bool = True) -> None:
        """A set-up phase begins (the previous one, if any, ends): plain text names it once
        it has lasted slow_s; the rich bar shows it at once. Nothing unless `when`."""
        if not when:
            return
        self._end_phase(next_phase=True)
        if self.mode == "plain":
            self._phase = what
            self._timer = threading.Timer(self.slow_s, self._say_phase, (what,))
            self._timer.daemon = True
            self._timer.start()
        elif self.mode == "rich":
            self._rich(what).update(self._task, description=what)
            self._bar.refresh()
            self._in_phase = True

    def iteration(self, it: int, seconds: float, loss: Sequence[float], waiter, watchdog) -> None:
        """Collective, on every rank of a real run after iteration `it` (0-based, warm-up
        first): this rank's `seconds` and `loss` ((sum, count)) reduced to rank 0, which
        shows them. Nothing under --quiet (no MPI given)."""
        if self.MPI is None:
            return
        watchdog.beat(f"reducing iteration {it}'s time and loss for the progress line")
        comm = self.MPI.COMM_WORLD
        pair = loss if self.real else None
        slowest, mean = reduce_iteration(self.MPI, comm, waiter, seconds, pair)
        if comm.rank == 0:
            self.show(it, slowest, mean)

    def show(self, it: int, seconds: float, loss: float | None) -> None:
        """Iteration `it` (0-based, warm-up first) completed in `seconds`."""
        self._end_phase()
        if self.mode == "plain":
            with self._lock:
                self.out.print(iteration_line(it, self.warmup, self.total, seconds, loss))
                self._flush()
        elif self.mode == "rich":
            last = f"{seconds:.4f} s (slowest rank)" + (
                f" · loss {loss:.6f}" if loss is not None else ""
            )
            what = "warm-up" if it < self.warmup else "iterations"
            self._rich(what).update(self._task, completed=it + 1, description=what, last=last)
            self._bar.refresh()

    def close(self) -> None:
        """Before the report: end any phase, leave the bar's last state on screen."""
        self._end_phase()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _say_phase(self, what: str) -> None:
        with self._lock:
            if self._phase is what:  # not ended while this timer fired
                self.out.print(f"{what} ...")
                self._flush()

    def _end_phase(self, next_phase: bool = False) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with self._lock:
            self._phase = None
        if self._in_phase and not next_phase and self._bar is not None:
            self._bar.update(self._task, description="running")
            self._bar.refresh()
        self._in_phase = False

    def _flush(self) -> None:
        getattr(self.out, "file", sys.stdout).flush()

    def _rich(self, first: str):
        if self._bar is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[last]}"),
                TimeElapsedColumn(),
                console=self.out,
                auto_refresh=False,  # redrawn by us between iterations, never during one
                redirect_stdout=False,  # others' prints (errors, the watchdog) go as they are
                redirect_stderr=False,
            )
            self._task = self._bar.add_task(first, total=self.total, last="")
            self._bar.start()
            # A run ended by MPI_Abort or os._exit never reaches close(): keep the cursor.
            self.out.show_cursor(True)
            atexit.register(self.close)
        return self._bar


def reduce_iteration(
    MPI, comm, waiter, seconds: float, loss: tuple[float, float] | None
) -> tuple[float | None, float | None]:
    """Collective over `comm`: (the slowest rank's `seconds`, the global mean loss or None)
    on rank 0, (None, None) elsewhere. `loss`: this rank's (sum, count) for real compute.

    Called between iterations, after a rank's timed region and before the barrier that
    starts the next one: every rank waits in that barrier for the slowest anyway, so the two
    small reductions cost no measured time (they lengthen the untimed gap by about one
    barrier). Waited through `waiter`, so oversubscribed ranks yield rather than spin."""
    import numpy as np

    mine = np.array([seconds])
    slowest = np.zeros(1)
    reqs = [comm.Ireduce(mine, slowest, op=MPI.MAX, root=0)]
    if loss is not None:
        pair = np.array(loss, dtype=np.float64)
        total = np.zeros(2)
        reqs.append(comm.Ireduce(pair, total, op=MPI.SUM, root=0))
    waiter.waitall(reqs)
    if comm.rank != 0:
        return None, None
    mean = None
    if loss is not None and total[1] > 0:
        mean = float(total[0] / total[1])
    return float(slowest[0]), mean
