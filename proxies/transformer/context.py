"""Context parallelism for the plans: which tokens each of the cp ranks holds, the causal
attention work between their blocks, and the groups and messages attention exchanges.

The sequence of T tokens splits over n = cp ranks by its tokens (--cp-split):
- contiguous: rank r holds tokens [r T/n, (r+1) T/n) (the llm.c MPI port's first split);
- interleaved: token t on rank t mod n (the port's fix, an indirection table of positions);
- zigzag: 2n chunks of T/(2n), rank r holds chunks r and 2n-1-r (Megatron-LM's load balance).
With causal attention a query at position p attends to the p+1 keys at positions <= p, so
the attention core's work between the queries of rank q and the keys of rank k is the number
of pairs (p, p') with p' <= p, p on q, p' on k: `causal_pairs`. The plans share the whole
sequence's attention-core FLOPs (transformer/setup.layer_flops: 4BT^2C, the causal mask not
discounted, as at cp 1) out in these proportions, so cp 1 and cp n total the same work and
contiguous's last rank does (2n-1)/n of the mean.

(The kernels' engineer writes the same splits as position arrays in transformer/cp.py; this
module is the plans' own copy of the arithmetic until the two are unified.)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SPLITS = ("contiguous", "interleaved", "zigzag")
COMMS = ("allgather", "ring", "alltoall")
GRAD_REDUCES = ("allreduce", "reduce", "reduce-scatter")
RING_TAG = 0  # the ring's messages: pipeline tags are 1..32767, and its peers differ anyway


def positions(T: int, n: int, split: str, r: int) -> np.ndarray:
    """The sequence positions rank r of n holds, ascending."""
    if split == "contiguous":
        return np.arange(r * T // n, (r + 1) * T // n)
    if split == "interleaved":
        return np.arange(r, T, n)
    if split == "zigzag":
        c = T // (2 * n)
        return np.concatenate(
            [np.arange(r * c, (r + 1) * c), np.arange((2 * n - 1 - r) * c, (2 * n - r) * c)]
        )
    raise ValueError(f"unknown split {split!r}")


@lru_cache(maxsize=64)
def causal_pairs(T: int, n: int, split: str) -> np.ndarray:
    """(n, n) int64: [q, k] = the (query, key) pairs with key position <= query position,
    queries on rank q, keys on rank k. Sums to T (T + 1) / 2."""
    pos = [positions(T, n, split, r) for r in range(n)]
    out = np.zeros((n, n), dtype=np.int64)
    for k in range(n):
        for q in range(n):
            # keys of rank k at or before each query of rank q
            out[q, k] = int(np.searchsorted(pos[k], pos[q], side="right").sum())
    return out


def work_shares(T: int, n: int, split: str) -> np.ndarray:
    """(n, n) float: causal_pairs as fractions of the whole sequence's pairs."""
    pairs = causal_pairs(T, n, split)
    return pairs / pairs.sum()


def reduce_group(n: int, split: str, root: int) -> tuple[int, ...]:
    """--cp-grad-reduce reduce: the cp ranks (root first) whose queries attend to keys of
    `root`, so hold partial sums of its key/value gradients. Contiguous: the root and the
    ranks after it. Interleaved and zigzag: every rank holds tokens after some of the root's,
    so every group is the whole cp group (n reduces of one block each, rotated)."""
    if split == "contiguous":
        return tuple(range(root, n))
    return tuple((root + i) % n for i in range(n))


def reduce_groups(n: int, split: str, r: int) -> list[int]:
    """The roots of the reduces cp rank r takes part in, in the order every rank issues
    them (root 0 first); a group of one rank (contiguous's last) sends nothing and is left
    out."""
    return [i for i in range(n) if r in (g := reduce_group(n, split, i)) and len(g) > 1]
