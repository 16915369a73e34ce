"""ProcessGrid: parallel degrees plus a rank order -> coordinates and groups.

The order string names the dimensions from fastest- to slowest-varying, as Megatron-LM's
"tp-cp-ep-dp-pp": ranks = np.arange(world).reshape(slowest ... fastest). Worked example,
8 ranks, pp=2, dp=2, tp=2:

    order "tp-dp-pp" (Megatron)        order "pp-dp-tp"
    rank: 0 1 2 3 4 5 6 7              rank: 0 1 2 3 4 5 6 7
    tp:   0 1 0 1 0 1 0 1              pp:   0 1 0 1 0 1 0 1
    dp:   0 0 1 1 0 0 1 1              dp:   0 0 1 1 0 0 1 1
    pp:   0 0 0 0 1 1 1 1              tp:   0 0 0 0 1 1 1 1
    dp groups: [0 2] [1 3] [4 6] [5 7]

The C++ proxies (spcl/DNN-cpp-proxies) put consecutive ranks on consecutive stages
(stage = rank % stages): that is order "pp-dp", the default here so results compare.
A group along a dimension is every rank that shares all the other coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

DIMS = ("tp", "sp", "cp", "ep", "pp", "dp")
# cp (context parallelism) sits next to the dimensions the C++ proxies order, before dp: its
# per-layer collectives are the heaviest traffic after tp's, so its ranks should be the next
# closest (Megatron-LM's default order is tp-cp-ep-dp-pp). A dimension of degree 1 is not
# in the grid, so neither alias changes a grid without cp.
ORDER_ALIASES = {"cpp": "tp-pp-cp-dp", "megatron": "tp-cp-dp-pp"}


def parse_order(order: str, dims: tuple[str, ...]) -> tuple[str, ...]:
    """Resolve an order string (or alias) to a tuple over exactly `dims`, fastest first.

    Dimensions of the grid missing from the string are appended (slowest); names in the
    string that the grid does not have are dropped only when their degree would be 1.
    """
    names = ORDER_ALIASES.get(order, order).split("-")
    unknown = [n for n in names if n not in DIMS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"rank order {order!r}: expected dimensions from {'/'.join(DIMS)} joined by '-', "
            f"each once (or one of {', '.join(ORDER_ALIASES)})"
        )
    ordered = [n for n in names if n in dims]
    return tuple(ordered + [d for d in dims if d not in ordered])


@dataclass(frozen=True)
class ProcessGrid:
    """Degrees per dimension and a rank order. Pure: no MPI."""

    degrees: tuple[tuple[str, int], ...]  # ((dim, size), ...) in order, fastest first

    @classmethod
    def create(cls, order: str = "pp-dp", **degrees: int) -> ProcessGrid:
        for dim, n in degrees.items():
            if dim not in DIMS:
                raise ValueError(f"unknown parallel dimension {dim!r}")
            if n < 1:
                raise ValueError(f"{dim} = {n}: degrees must be positive")
        dims = parse_order(order, tuple(degrees))
        return cls(tuple((d, degrees[d]) for d in dims))

    @property
    def order(self) -> str:
        return "-".join(d for d, _ in self.degrees)

    @property
    def size(self) -> int:
        return int(np.prod([n for _, n in self.degrees]))

    def degree(self, dim: str) -> int:
        return dict(self.degrees).get(dim, 1)

    @cached_property
    def _ranks(self) -> np.ndarray:
        """World ranks as an array with one axis per dimension, in `degrees` order."""
        shape = [n for _, n in reversed(self.degrees)]
        return np.arange(self.size).reshape(shape).transpose(range(len(shape))[::-1])

    def _axis(self, dim: str) -> int:
        for i, (d, _) in enumerate(self.degrees):
            if d == dim:
                return i
        raise KeyError(f"grid has no dimension {dim!r} (it has {self.order})")

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a grid of {self.size}")
        idx = np.argwhere(self._ranks == rank)[0]
        return {d: int(i) for (d, _), i in zip(self.degrees, idx, strict=True)}

    def rank_of(self, **coords: int) -> int:
        idx = tuple(coords.get(d, 0) for d, _ in self.degrees)
        return int(self._ranks[idx])

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """All groups along `dim`, each listing world ranks in order of their `dim` coordinate."""
        a = np.moveaxis(self._ranks, self._axis(dim), -1)
        return [tuple(int(r) for r in row) for row in a.reshape(-1, a.shape[-1])]

    def group(self, dim: str, rank: int) -> tuple[int, ...]:
        """The group along `dim` that contains `rank`."""
        c = self.coords(rank)
        a = np.moveaxis(self._ranks, self._axis(dim), -1)
        idx = tuple(c[d] for d, _ in self.degrees if d != dim)
        return tuple(int(r) for r in a[idx])

    def describe(self) -> dict:
        return {"order": self.order, **{d: n for d, n in self.degrees}}
