"""The engine's wait for the progress thread's lock is communication, not overhead: while
the thread holds it, it is inside MPI testing the pending requests (MPI moves their data
then, on the rank's core), so the wait is booked to the incomplete pending ops' categories
in proportion to their bytes (a test moves whatever MPI has pending, not only the request
tested). Deterministic: a fake clock, no MPI, no thread."""

import threading
from types import SimpleNamespace

from proxies.core.engine import Engine, IterationTimes


def fake_engine(pending: dict, clock: list[float], progress: bool = True):
    ticks = iter(clock)
    MPI = SimpleNamespace(Wtime=lambda: next(ticks))
    thread = SimpleNamespace(lock=threading.Lock()) if progress else None
    return SimpleNamespace(MPI=MPI, progress=thread, pending=pending)


def entry(category: str, done: float | None = None, nbytes: int = 4) -> list:
    # the pending table's layout: [op, buffer, requests, state, posted, completed, out]
    return [SimpleNamespace(category=category, nbytes=nbytes), None, [], None, 0.0, done, None]


def lock_wait(engine, t: IterationTimes) -> None:
    with Engine._locked(engine, t):
        assert engine.progress is None or engine.progress.lock.locked()


def test_the_wait_is_booked_to_the_incomplete_pending_ops_by_their_bytes():
    # DLRM's case: MLP gradient allreduces posted first, then the 16 MiB all-to-all, whose
    # copies the thread's tests move: most of the wait is the all-to-all's
    pending = {
        "a": entry("emb_alltoall", done=0.5, nbytes=1 << 30),  # completed: MPI moves nothing
        "top": entry("dp_allreduce", nbytes=1 << 20),
        "bwd": entry("emb_alltoall", nbytes=3 << 20),
    }
    t = IterationTimes()
    lock_wait(fake_engine(pending, [1.0, 1.25]), t)
    assert dict(t.seconds) == {"dp_allreduce": 0.0625, "emb_alltoall": 0.1875}


def test_pending_ops_of_no_bytes_share_the_wait_alike():
    t = IterationTimes()
    pending = {"a": entry("x", nbytes=0), "b": entry("y", nbytes=0)}
    lock_wait(fake_engine(pending, [1.0, 1.5]), t)
    assert dict(t.seconds) == {"x": 0.25, "y": 0.25}


def test_nothing_pending_or_no_thread_books_nothing():
    t = IterationTimes()
    lock_wait(fake_engine({"a": entry("x", done=0.1)}, [1.0, 2.0]), t)
    lock_wait(fake_engine({"b": entry("y")}, [], progress=False), t)  # no clock read
    assert dict(t.seconds) == {}
