"""python -m proxies compare A B: two runs (or two sweeps) compared, per category, with the
noise stated (see command.py)."""
