"""python -m proxies calibrate: measure this allocation, write a machine file.

    mpiexec -n 4 python -m proxies calibrate -o machine.yaml [--quick] [--ranks-per-node R]

main.py runs it (nodes, what is measured how, the file); measure.py holds the
measurements, each a collective over the world, so the predictor's own checks can call
them too (allreduce_measurements: seconds per allreduce, per algorithm and size).
"""

from proxies.calibrate.measure import allreduce_measurements, fit_hockney

__all__ = ["allreduce_measurements", "fit_hockney"]
