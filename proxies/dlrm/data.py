"""Synthetic click data, deterministic per global sample index.

Sample g of the training stream has dense features, P indices into each table and a label
that depend only on (seed, g), so every layout (1, 2, 4 ... ranks) trains on the same data:
a table's owner draws that table's indices for the whole global batch, a rank draws the
dense features and labels of its own samples, and they agree. Values come from a counter-
based hash (splitmix64) of (seed, stream, g, column), vectorised, with no generator state.

- dense: uniform in [0, 1) (dlrm_s_pytorch's random data);
- indices: R * u^2 rounded down, skewed toward low row ids like the hot rows of click logs;
- label: 1 when a hidden score is positive: the mean over the sample's indices of a fixed
  value in [-1, 1) per (table, row), plus the dense features (centred) against fixed weights
  in [-1, 1). Both parts are learnable, so the loss falls from ln 2 as training works.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1
# Independent streams; table t's indices and row values use stream + t.
DENSE, WEIGHTS, INDICES, ROW_VALUES = (k << 32 for k in range(1, 5))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniform(seed: int, stream: int, keys: np.ndarray, cols: int) -> np.ndarray:
    """(len(keys), cols) float64 in [0, 1), a pure function of (seed, stream, key, column)."""
    key = (seed * GOLDEN + stream) & MASK
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as intended
        base = _mix(np.array([key], dtype=np.uint64))
        x = keys.astype(np.uint64)[:, None] * np.uint64(cols) + np.arange(cols, dtype=np.uint64)
        bits = _mix((x + base) * np.uint64(GOLDEN))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


class Synthetic:
    def __init__(self, seed: int, dense: int, rows: tuple[int, ...], pooling: int):
        self.seed, self.dense_width, self.rows, self.P = seed, dense, rows, pooling
        self.weights = 2 * uniform(seed, WEIGHTS, np.arange(1), dense)[0] - 1

    def dense(self, g0: int, n: int) -> np.ndarray:
        """(n, dense) features of samples g0 .. g0+n-1."""
        return uniform(self.seed, DENSE, np.arange(g0, g0 + n), self.dense_width)

    def sparse(self, g0: int, n: int, t: int) -> np.ndarray:
        """(n, P) int64 row ids into table t."""
        u = uniform(self.seed, INDICES + t, np.arange(g0, g0 + n), self.P)
        return np.minimum((self.rows[t] * u * u).astype(np.int64), self.rows[t] - 1)

    def row_value(self, t: int, rows: np.ndarray) -> np.ndarray:
        """The hidden value in [-1, 1) of each row of table t (any shape)."""
        flat = rows.reshape(-1)
        u = uniform(self.seed, ROW_VALUES + t, flat, 1)[:, 0]
        return (2 * u - 1).reshape(rows.shape)

    def labels(self, g0: int, n: int) -> np.ndarray:
        """(n,) labels in {0, 1} of samples g0 .. g0+n-1."""
        NT = len(self.rows)
        score = sum(self.row_value(t, self.sparse(g0, n, t)).mean(axis=1) for t in range(NT)) / NT
        score = score + (self.dense(g0, n) - 0.5) @ self.weights
        return (score > 0).astype(np.float64)

    def describe(self) -> str:
        return (
            f"synthetic (seed {self.seed}): dense uniform, {self.P} index(es) per table skewed "
            "to low rows, labels from a hidden rule"
        )
