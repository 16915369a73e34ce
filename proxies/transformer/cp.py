"""Context (sequence) parallelism: how T tokens are split over N ranks, and the causal
attention work each rank's queries then carry. Pure functions of (split, N, T); the
kernels that compute a rank's share are in cp_kernels.py.

Letters as in config.py: B batch, T time (the whole sequence), C channels, NH heads,
hs = C / NH; N the context-parallel ranks, Tl = T / N the tokens a rank holds.

Splits (rank i of N; positions are each rank's token positions, ascending):
- contiguous: [i T/N, (i+1) T/N). With causal attention a query at p sees p + 1 keys, so
  the last rank does about (2N-1)/N of the mean work, the first about 1/N.
- interleaved: token t on rank t mod N (positions i, i+N, i+2N, ...). Rank i + 1 has T/N
  pairs more than rank i (a few in T); the embedding looks positions up through the table.
- zigzag: 2N chunks of T/(2N); rank i holds chunks i and 2N-1-i (Megatron-LM's context
  parallelism): an early chunk and a late one, exactly balanced.

The plans (plan.py) use the same splits: pair_matrix / work_shares share the whole
sequence's attention-core FLOPs out by the causal work between query and key blocks, and
reduce_group(s) name the groups of --cp-grad-reduce reduce. The real compute (cpshard.py)
reads each rank's tokens at `positions`.

Work is counted in (query, key) pairs with key <= query, per batch row and head. FLOPs
follow from it (2 per multiply-add, as config.stage_flops): the forward's QK^T and AV take
hs multiply-adds each per pair and head, 4 C FLOPs per pair over the NH heads; the
backward's four matmuls (dV, dP, dQ, dK) twice that.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SPLITS = ("contiguous", "interleaved", "zigzag")
# --cp-comm: what attention exchanges per layer (the plans' names of the three families)
COMMS = ("allgather", "ring", "alltoall")
GRAD_REDUCES = ("allreduce", "reduce", "reduce-scatter")
RING_TAG = 0  # the ring's messages: pipeline tags are 1..32767, and its peers differ anyway
# How attention reaches the other ranks' keys (cp_kernels.py): all-gather of kv, kv blocks
# round a ring, all-to-all to head shards (Ulysses).
FAMILIES = ("allgather", "ring", "ulysses")


def validate(split: str, N: int, T: int) -> None:
    """ValueError (one line, for the front end's exit 2) unless T tokens split over N ranks."""
    if split not in SPLITS:
        raise ValueError(f"unknown context-parallel split {split!r}; one of {', '.join(SPLITS)}")
    if N < 1 or T < 1:
        raise ValueError(
            f"context parallelism needs N >= 1 ranks and T >= 1 tokens, got N={N}, T={T}"
        )
    # zigzag cuts the sequence in 2N chunks, the others in N parts
    parts = 2 * N if split == "zigzag" else N
    if T % parts:
        raise ValueError(
            f"sequence length {T} is not a multiple of {parts}"
            f" ({'2 x ' if split == 'zigzag' else ''}{N} context-parallel ranks, {split} split)"
        )


def validate_family(family: str, split: str, N: int, T: int, NH: int) -> None:
    """validate(split, N, T), and ValueError unless `family` can run it: Ulysses gives each
    rank NH/N whole heads."""
    if family not in FAMILIES:
        raise ValueError(
            f"unknown context-parallel family {family!r}; one of {', '.join(FAMILIES)}"
        )
    validate(split, N, T)
    if family == "ulysses" and NH % N:
        raise ValueError(
            f"Ulysses needs the {NH} heads to be a multiple of the {N} context-parallel ranks"
        )


def positions(split: str, N: int, T: int) -> list[np.ndarray]:
    """Each rank's token positions (int64, ascending, T/N of them); together a permutation
    of range(T)."""
    validate(split, N, T)
    Tl = T // N
    if split == "contiguous":
        return [np.arange(i * Tl, (i + 1) * Tl, dtype=np.int64) for i in range(N)]
    if split == "interleaved":
        return [np.arange(i, T, N, dtype=np.int64) for i in range(N)]
    c = T // (2 * N)  # zigzag: chunks i and 2N-1-i
    return [
        np.concatenate(
            [np.arange(i * c, (i + 1) * c), np.arange((2 * N - 1 - i) * c, (2 * N - i) * c)]
        ).astype(np.int64)
        for i in range(N)
    ]


def causal_pairs(pos: np.ndarray) -> int:
    """(query, key) pairs with key <= query for queries at `pos`: query p sees p + 1 keys."""
    return int(np.sum(np.asarray(pos, dtype=np.int64) + 1))


def computed_pairs(pos: np.ndarray, block: int) -> int:
    """Pairs the all-gather kernels compute: queries in blocks of `block` rows, each block
    against every key up to its last position (the pairs past a query's own position inside
    its block are masked, computed and thrown away)."""
    pos = np.asarray(pos, dtype=np.int64)
    last = pos[np.minimum(np.arange(block - 1, len(pos) + block - 1, block), len(pos) - 1)]
    rows = np.diff(np.append(np.arange(0, len(pos), block), len(pos)))
    return int(np.sum(rows * (last + 1)))


def work(split: str, N: int, T: int) -> list[int]:
    """Causal pairs per rank (per batch row and head); they sum to T (T+1) / 2."""
    return [causal_pairs(p) for p in positions(split, N, T)]


def attention_flops(pairs: int, C: int, B: int = 1) -> tuple[int, int]:
    """(forward, backward) FLOPs of causal attention over `pairs` (query, key) pairs per
    batch row and head, 2 per multiply-add: forward QK^T and AV, 2 hs each per pair and
    head (4 C per pair over the NH heads); backward dV, dP, dQ and dK, twice that. The
    softmax's elementwise work is not counted (as config.stage_flops does not)."""
    fwd = 4 * B * C * pairs
    return fwd, 2 * fwd


def imbalance(values: list[float]) -> list[tuple[float, float]]:
    """Per rank (value / mean, idle = max - value): how far each rank is from the mean,
    and how long it waits for the slowest at the next collective."""
    mean, top = sum(values) / len(values), max(values)
    return [(v / mean if mean else 0.0, top - v) for v in values]


# ----------------------------------------------------------------------------------------
# the plans' arithmetic (plan.py): work between query and key blocks, reduce groups


@lru_cache(maxsize=64)
def pair_matrix(T: int, n: int, split: str) -> np.ndarray:
    """(n, n) int64: [q, k] = the (query, key) pairs with key position <= query position,
    queries on rank q, keys on rank k. Sums to T (T + 1) / 2; row q sums to
    causal_pairs(positions(split, n, T)[q])."""
    pos = positions(split, n, T)
    out = np.zeros((n, n), dtype=np.int64)
    for k in range(n):
        for q in range(n):
            # keys of rank k at or before each query of rank q
            out[q, k] = int(np.searchsorted(pos[k], pos[q], side="right").sum())
    return out


def work_shares(T: int, n: int, split: str) -> np.ndarray:
    """(n, n) float: pair_matrix as fractions of the whole sequence's pairs. The plans share
    the whole sequence's attention-core FLOPs (setup.layer_flops: 4BT^2C, the causal mask
    not discounted, as at cp 1) out in these proportions, so cp 1 and cp n total the same
    work and contiguous's last rank does (2n-1)/n of the mean."""
    pairs = pair_matrix(T, n, split)
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
