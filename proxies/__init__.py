"""proxies: communication proxies for distributed deep-learning training.

Importing the package pins BLAS threads per rank before NumPy loads (see core/threads.py).
"""

import sys as _sys

if _sys.argv[:1] == ["-m"]:  # python -m proxies...: Ctrl-C while importing is one line too
    import signal as _signal

    from proxies.core import exits as _exits

    def _interrupted(signum, frame):  # replaced by cli.quiet_interrupts in a moment
        import os

        os._exit(_exits.INTERRUPTED)

    _signal.signal(_signal.SIGINT, _interrupted)

from proxies.core import threads as _threads

_threads.pin_blas_threads()

if _sys.argv[:1] == ["-m"]:
    from proxies.core import cli as _cli

    _cli.quiet_interrupts()

__version__ = "0.1.0"
