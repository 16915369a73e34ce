"""When the predictor's waiting ranks see what they wait for (a mixin of predict._Predictor).

A spinning wait sees a message the moment it arrives. A yielding one (waiting.py: a test,
then a sleep that doubles up to 1 ms) sees it at its next test, and MPI takes the next step
of a collective it runs only inside a test. MPICH also takes in one arriving message per
test: a message for an op its rank has not posted yet (MPI's unexpected queue) takes one of
the wait's tests (the machine's oversubscribed.unexpected of them, fitted by calibrate:
0.6 - 1.3 for MPICH here, 0 for Open MPI). While MPI moves messages of a collective it runs
for the rank, that moves them a test later (the step they belong to is seen one test
later); while nothing of it moves, it takes the next free test, which delays a step only
if that is the test the step would have been seen at.
"""

from __future__ import annotations

from proxies.core.waiting import SPIN_FIRST, yield_sees

TEST_AFTER = 1e-9  # seconds: asks for the test after one (a backed-off wait's are 20 us+ apart)


class WaitSim:
    """The waits' half of predict._Predictor (it uses the predictor's state: topo, blocked,
    taken, unexpected, moving, owed)."""

    def _unexpected(self, r: int, t: float) -> None:
        """A message for an op rank r has not posted arrives at t. If r is in a yielding
        wait, MPI there spends tests on it (oversubscribed.unexpected of them) instead of
        on the collectives it runs for r: owed by r's next step while MPI moves some of
        their messages (`moving`), else the first free tests from t (_test). Measured with
        4 ranks on 2 cores, MPICH: 8 tiny messages sent to a rank inside a 16 MiB
        all-to-all's wait held it 7 - 9 ms, the 8 one-millisecond tests of its backed-off
        wait. A rank at work takes them in at its next MPI call, at no cost modelled."""
        since = self.blocked.get(r)
        if since is None or t - since <= SPIN_FIRST:  # at work, or testing back to back
            return
        began, taken, part = self.taken.get(r, (None, None, None))
        if began != since:
            taken, part = set(), [0.0]
            self.taken[r] = (since, taken, part)
        part[0] += self.unexpected
        test = self._seen(since, t)
        while part[0] >= 1.0 - 1e-9:  # whole tests, the first free ones from t on
            part[0] -= 1.0
            if self.moving[r]:  # MPI moving a collective's messages: they move a test later
                self.owed[r] += 1
                continue
            test = self._free(since, test, taken)
            taken.add(test)

    def _test(self, r: int, since: float, ready: float) -> float:
        """The test of rank r's wait (begun at `since`) that takes a collective's step
        ready at `ready`: the first one no unexpected message took, then as many later as
        the tests they took while its messages moved (_unexpected)."""
        test = self._seen(since, ready)
        began, taken, _ = self.taken.get(r, (None, None, None))
        taken = taken if began == since else ()
        test = self._free(since, test, taken)
        while self.owed[r]:  # tests unexpected messages took while this step was in flight
            self.owed[r] -= 1
            test = self._free(since, self._seen(since, test + TEST_AFTER), taken)
        return test

    def _free(self, since: float, test: float, taken) -> float:
        """`test` of the wait begun at `since`, or the first later one not in `taken`."""
        while test in taken:
            test = self._seen(since, test + TEST_AFTER)
        return test

    def _seen(self, began: float, ready: float) -> float:
        """When a wait that began at `began` sees what was ready at `ready`: at once, or
        with yielding waits at its next test (waiting.yield_sees)."""
        if not self.topo.yielding or ready <= began:
            return ready
        return began + yield_sees(ready - began, self.topo.wake)
