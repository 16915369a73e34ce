"""A yielding wait tests the rank's other pending requests in each of its rounds, each with
its own call: one MPI test moves about one step of one pending schedule, so requests left
to a single Testall of the awaited one advance a step per round, one after another
(MPICH 5.0.2, 4 ranks on 2 cores: a 16 MiB all-to-all waited that way with five small
allreduces pending took 49 ms, 16 ms alone). Deterministic: fake requests, no MPI, no
sleeping past the first rounds."""

from types import SimpleNamespace

from proxies.core import waiting
from proxies.core.engine import Engine


class FakeRequest:
    """Completes at its n-th test."""

    def __init__(self, tests: int):
        self.left = tests
        self.tests = 0

    def test(self) -> bool:
        self.tests += 1
        self.left -= 1
        return self.left <= 0


def fake_mpi(log: list):
    def testall(reqs):
        log.append(("test", tuple(id(r) for r in reqs)))
        return all([r.test() for r in reqs])

    def waitall(reqs):
        log.append(("waitall", tuple(id(r) for r in reqs)))

    clock = iter(float(i) for i in range(10_000))
    return SimpleNamespace(
        Request=SimpleNamespace(Testall=testall, Waitall=waitall), Wtime=lambda: next(clock)
    )


def test_a_yielding_wait_calls_others_after_each_test_that_finds_it_not_done(monkeypatch):
    monkeypatch.setattr(waiting, "SPIN_FIRST", 0.0)  # straight to the rounds
    monkeypatch.setattr(waiting.time, "sleep", lambda s: None)
    log = []
    w = waiting.Waiter(fake_mpi(log), "yield")
    mine = FakeRequest(4)
    w.waitall([mine], lambda: log.append(("others",)))
    assert [e[0] for e in log] == ["test", "others"] * 3 + ["test"]  # none after the last


def test_a_spinning_wait_leaves_progress_to_mpi():
    log = []
    w = waiting.Waiter(fake_mpi(log), "spin")
    w.waitall([FakeRequest(4)], lambda: log.append(("others",)))
    assert [e[0] for e in log] == ["waitall"]  # MPI's Waitall polls every schedule itself


def entry(req, done=None) -> list:
    # the engine's pending table: [op, buffer, requests, state, posted, completed, out]
    return [SimpleNamespace(category="dp"), None, [req], None, 0.0, done, None]


def fake_engine(pending: dict, progress: bool):
    log = []
    return SimpleNamespace(
        MPI=fake_mpi(log), pending=pending, progress=object() if progress else None
    ), log


def test_others_tests_each_pending_request_with_its_own_call_and_notes_completion():
    a, b, c = FakeRequest(1), FakeRequest(3), FakeRequest(1)
    pending = {"a": entry(a), "b": entry(b), "c": entry(c, done=0.5)}
    engine, log = fake_engine(pending, progress=False)
    others = Engine._others(engine, locked=False)
    others()
    assert log == [("test", (id(a),)), ("test", (id(b),))]  # c had completed: not tested
    assert pending["a"][5] is not None and pending["b"][5] is None
    others()
    assert [r.tests for r in (a, b, c)] == [1, 2, 0]  # a is done: tested once only
    assert pending["c"][5] == 0.5


def test_no_others_while_the_progress_thread_may_test_them_or_when_none_is_pending():
    pending = {"a": entry(FakeRequest(2))}
    engine, _ = fake_engine(pending, progress=True)
    # MPI forbids two threads completing one request: without the thread's lock, leave them
    assert Engine._others(engine, locked=False) is None
    assert Engine._others(engine, locked=True) is not None  # inside _wait, lock held
    engine, _ = fake_engine({}, progress=False)
    assert Engine._others(engine, locked=False) is None
