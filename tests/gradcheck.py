"""What every kernel test shares: a tolerance check and centered finite differences.

Kernels are checked in float64 with a fake loss (out * dout).sum(), as llm.c does.
"""

from __future__ import annotations

import numpy as np


def check(name: str, got, want, atol: float = 1e-7, rtol: float = 1e-6) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    err = np.max(np.abs(got - want) - rtol * np.abs(want), initial=0.0)
    assert err <= atol, f"{name}: max error {err:.3g} beyond atol {atol} + rtol {rtol}"


def numgrad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Centered differences of the scalar f() w.r.t. every entry of x (perturbed in place)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return g


def rand(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return scale * np.random.default_rng([seed, *shape]).standard_normal(shape)
