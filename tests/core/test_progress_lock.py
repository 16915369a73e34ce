"""The engine's wait for the progress thread's lock is communication, not overhead: while
the thread holds it, it is inside MPI testing the pending requests (MPI moves their data
then, on the rank's core), so the wait is booked to the oldest incomplete pending op's
category. Deterministic: a fake clock, no MPI, no thread."""

import threading
from types import SimpleNamespace

from proxies.core.engine import Engine, IterationTimes


def fake_engine(pending: dict, clock: list[float], progress: bool = True):
    ticks = iter(clock)
    MPI = SimpleNamespace(Wtime=lambda: next(ticks))
    thread = SimpleNamespace(lock=threading.Lock()) if progress else None
    return SimpleNamespace(MPI=MPI, progress=thread, pending=pending)


def entry(category: str, done: float | None = None) -> list:
    # the pending table's layout: [op, buffer, requests, state, posted, completed, out]
    return [SimpleNamespace(category=category), None, [], None, 0.0, done, None]


def lock_wait(engine, t: IterationTimes) -> None:
    with Engine._locked(engine, t):
        assert engine.progress is None or engine.progress.lock.locked()


def test_the_wait_is_booked_to_the_oldest_incomplete_pending_op():
    pending = {
        "a": entry("emb_alltoall", done=0.5),
        "b": entry("emb_alltoall_bwd"),
        "c": entry("dp"),
    }
    t = IterationTimes()
    lock_wait(fake_engine(pending, [1.0, 1.25]), t)
    assert dict(t.seconds) == {"emb_alltoall_bwd": 0.25}  # "a" completed: MPI moves nothing


def test_nothing_pending_or_no_thread_books_nothing():
    t = IterationTimes()
    lock_wait(fake_engine({"a": entry("x", done=0.1)}, [1.0, 2.0]), t)
    lock_wait(fake_engine({"b": entry("y")}, [], progress=False), t)  # no clock read
    assert dict(t.seconds) == {}
