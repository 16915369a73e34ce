"""proxies: communication proxies for distributed deep-learning training.

Importing the package pins BLAS threads per rank before NumPy loads (see core/threads.py).
"""

from proxies.core import threads as _threads

_threads.pin_blas_threads()

__version__ = "0.1.0"
