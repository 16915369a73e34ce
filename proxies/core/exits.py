"""The exit statuses every entry point keeps (the README lists them for users and scripts).

A sweep, a batch script or a test tells these apart by status alone, so each has one meaning
and every path that ends a run uses the constant, never a bare number.
"""

OK = 0
FAILED = 1  # an unexpected error (a bug): its traceback, printed once
USAGE = 2  # bad input: one line on stderr, before any long work
STALLED = 3  # the watchdog: a rank made no progress for --timeout seconds
CHECK = 4  # --check found a corrupted message or collective result
RANK_DIED = 5  # a rank ended mid-run (killed, crashed, --kill-rank): fail-stop
DIVERGED = 6  # a real run's loss became NaN or infinite
INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report it

MEANING = {
    OK: "ok",
    FAILED: "failed (unexpected error)",
    USAGE: "bad input",
    STALLED: "no progress (watchdog)",
    CHECK: "--check found corruption",
    RANK_DIED: "a rank died",
    DIVERGED: "loss not finite",
    INTERRUPTED: "interrupted",
}
