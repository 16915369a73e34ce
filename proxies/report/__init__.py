"""python -m proxies report DIR: the table, CSV and plots of a sweep's results (the code is
proxies.sweep.report)."""
