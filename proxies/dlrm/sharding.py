"""Where the embedding tables live, and what moves so every rank gets its samples' bags.

Letters as in config.py (B, b = B / W, W, NT, R, D, P); K column shards per table.

- table-wise (`TableWise`, K = 1): table t whole on rank t % W, slot t // W; S = ceil(NT/W)
  slots. The owner looks its tables up for the global batch (it reads their ids itself, as
  dlrm_s_pytorch's data loader gives every rank the whole batch's ids) and the pooled bags
  go to the samples' ranks by one all-to-all of (W,S,b,D) (zero padding where a rank has
  fewer than S tables: MPI_Alltoall needs equal blocks); the backward is the reverse.
- column-wise (`TableWise`, K > 1): table t's columns cut into K shards of D/K, placed like
  NT*K tables of width D/K (shard u = t K + k on rank u % W); the all-to-all moves (W,S,b,
  D/K) and the receiver concatenates a table's K shards back into its D columns (TorchRec's
  cw_sharding: shards placed table-wise, outputs all-to-all'd and concatenated).
- row-wise (`RowWise`): table t's rows cut into blocks of ceil(R/W) (TorchRec's block size;
  the last ranks may hold fewer rows or none), rank j owns rows [j bs, (j+1) bs). Every
  rank reads its own b samples' ids of every table and sends each owner the ids in its
  rows, as TorchRec's KJTAllToAll after block bucketization: (1) an all-to-all of the
  splits, 3 int64 per peer (lengths count NT b, ids count, stride b); (2) an all-to-all of
  the lengths, NT b int64 per peer: how many of each sample's P ids of each table fall in
  the peer's rows; (3) an all-to-allv of the ids (int64, local row numbers), b NT P in all,
  split by owner as the data falls. Each rank pools its rows' partial sums for all B
  samples (B,NT,D), and a reduce-scatter sums the W partials and leaves each rank its b
  samples' (b,NT,D). Backward: an all-gather of the (b,NT,D) pooled gradients gives every
  owner the (B,NT,D) gradients, and each applies the sparse update to its own rows.

A layout holds its tables and buffers, runs the embedding compute ops, and hands the
interaction its (b,NT,D) bags (`emb`) and takes back their gradients (`set_grad`).
"""

from __future__ import annotations

import numpy as np

from proxies.core import pages
from proxies.dlrm import kernels as K
from proxies.dlrm.config import DLRMConfig
from proxies.dlrm.data import Synthetic

IDS_DTYPE = np.int64  # TorchRec's KeyedJaggedTensor values and lengths (torch.long)


def init_table(seed: int, t: int, rows: int, D: int, dtype=np.float32) -> np.ndarray:
    """dlrm_s_pytorch's init: uniform in +-sqrt(1/R), drawn per table whichever rank owns it,
    in float32 (tables are large) and then cast, so float64 tables hold the same values.
    Shards are cut from it, so every layout starts from the same model."""
    rng = np.random.default_rng([seed, 3, t])
    table = rng.random((rows, D), dtype=np.float32)
    table *= np.float32(2 * np.sqrt(1.0 / rows))
    table -= np.float32(np.sqrt(1.0 / rows))
    return table.astype(dtype, copy=False)


def owned_shards(rank: int, world: int, shards: int) -> list[int]:
    """Shards (tables, or column shards) of `rank`, in slot order: u = rank + k W for slot k."""
    return list(range(rank, shards, world))


def slots(world: int, shards: int) -> int:
    """S: shard slots per rank in the all-to-all (the most shards any rank holds)."""
    return -(-shards // world)


def row_block(rows: int, world: int) -> int:
    """Rows per rank of a row-wise table: ceil(R / W), TorchRec's block size."""
    return -(-rows // world)


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the rows `rank` owns (empty for the last ranks of a small table)."""
    bs = row_block(rows, world)
    return min(rank * bs, rows), min((rank + 1) * bs, rows)


class TableWise:
    """Whole tables (K = 1) or K column shards per table, placed round-robin."""

    def __init__(
        self,
        cfg: DLRMConfig,
        rank: int,
        world: int,
        data: Synthetic,
        seed: int,
        dtype,
        columns: int = 1,
        tables: bool = True,
    ):
        if cfg.dim % columns:
            raise ValueError(f"{columns} column shards do not divide D = {cfg.dim}")
        self.cfg, self.rank, self.W, self.data, self.K = cfg, rank, world, data, columns
        self.B, self.b, self.Dk = cfg.batch, cfg.batch // world, cfg.dim // columns
        self.NS = cfg.tables * columns  # shards
        self.S = slots(world, self.NS)
        self.owned = owned_shards(rank, world, self.NS)
        self.tables: dict[int, np.ndarray] = {}
        for u in self.owned if tables else ():
            t, k = divmod(u, columns)
            full = init_table(seed, t, cfg.rows[t], cfg.dim, dtype)
            self.tables[u] = np.ascontiguousarray(full[:, k * self.Dk : (k + 1) * self.Dk])
        shape = (world, self.S, self.b, self.Dk)
        self.buffers = {"emb_fwd": pages.zeros(shape, dtype), "emb_bwd": pages.zeros(shape, dtype)}
        self.idx: dict[int, np.ndarray] = {}

    def forward(self, it: int) -> None:
        """emb_fwd (W,S,b,Dk) = the owned shards' bags for the whole global batch."""
        out = self.buffers["emb_fwd"]
        ids = {
            t: self.data.sparse(it * self.B, self.B, t) for t in {u // self.K for u in self.owned}
        }
        pooled = np.empty((self.B, self.Dk), dtype=out.dtype)
        for slot, u in enumerate(self.owned):
            K.embedding_bag_forward(pooled, self.tables[u], ids[u // self.K])
            out[:, slot] = pooled.reshape(self.W, self.b, -1)
        self.idx = ids

    def emb(self) -> np.ndarray:
        """(b,NT,D) after the all-to-all: shard u = t K + k sits in block u % W, slot u // W;
        (b,S,W,Dk) puts it at column u, and a table's K shards are adjacent."""
        got = self.buffers["emb_fwd"].transpose(2, 1, 0, 3).reshape(self.b, self.S * self.W, -1)
        return got[:, : self.NS].reshape(self.b, self.cfg.tables, self.cfg.dim)

    def set_grad(self, demb: np.ndarray) -> None:
        """demb (b,NT,D) -> emb_bwd (W,S,b,Dk) for the reverse all-to-all; padding zero."""
        full = np.zeros((self.b, self.S * self.W, self.Dk), dtype=demb.dtype)
        full[:, : self.NS] = demb.reshape(self.b, self.NS, self.Dk)
        self.buffers["emb_bwd"][...] = full.reshape(self.b, self.S, self.W, -1).transpose(
            2, 1, 0, 3
        )

    def backward(self, lr: float) -> None:
        """emb_bwd (W,S,b,Dk) after the all-to-all: slot k over the blocks is shard k's (B,Dk)
        gradients in global sample order. Sparse SGD."""
        got = self.buffers["emb_bwd"]
        for slot, u in enumerate(self.owned):
            rows, drows = K.embedding_bag_backward(
                got[:, slot].reshape(self.B, -1), self.idx[u // self.K]
            )
            K.embedding_sgd(self.tables[u], rows, drows, lr)


class RowWise:
    """Every table's rows in W blocks, one per rank (see the module docstring)."""

    def __init__(
        self,
        cfg: DLRMConfig,
        rank: int,
        world: int,
        data: Synthetic,
        seed: int,
        dtype,
        tables: bool = True,
    ):
        self.cfg, self.rank, self.W, self.data = cfg, rank, world, data
        self.B, self.b, NT = cfg.batch, cfg.batch // world, cfg.tables
        self.block = np.array([row_block(R, world) for R in cfg.rows], dtype=IDS_DTYPE)
        self.ranges = [row_range(R, world, rank) for R in cfg.rows]
        self.tables: dict[int, np.ndarray] = {}
        for t in range(NT) if tables else ():
            lo, hi = self.ranges[t]
            full = init_table(seed, t, cfg.rows[t], cfg.dim, dtype)
            self.tables[t] = full[lo:hi].copy()
        b, D = self.b, cfg.dim
        self.buffers = {
            "emb_splits": pages.zeros((world, 3), IDS_DTYPE),
            "emb_lengths": pages.zeros((world, NT, b), IDS_DTYPE),
            "emb_ids": pages.zeros(b * NT * cfg.pooling, IDS_DTYPE),  # sent, grouped by owner
            "emb_fwd": pages.zeros((world, b, NT, D), dtype),  # (B,NT,D) partial sums
            "emb_bwd": pages.zeros((world, b, NT, D), dtype),  # (B,NT,D) gradients
        }
        self.scounts = np.zeros(world, IDS_DTYPE)
        self.recv_ids: np.ndarray | None = None  # what the ids all-to-allv brought
        self.exchanged = -1  # the iteration whose ids the all-to-allv brought
        self.bags: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def ids_count(self) -> int:
        return self.b * self.cfg.tables * self.cfg.pooling

    def _bucketize(self, source: int, it: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rank `source`'s b samples of iteration `it`, every table's P ids in (t, s, p)
        order: (owner, local row id, bag key (owner, t, s)) of each, as flat arrays."""
        NT, b = self.cfg.tables, self.b
        g0 = it * self.B + source * b
        ids = np.stack([self.data.sparse(g0, b, t) for t in range(NT)])  # (NT,b,P)
        owner = ids // self.block[:, None, None]
        local = ids - owner * self.block[:, None, None]
        key = (owner * NT + np.arange(NT)[:, None, None]) * b + np.arange(b)[None, :, None]
        return owner.reshape(-1), local.reshape(-1), key.reshape(-1)

    def input(self, it: int) -> None:
        """Bucketize this rank's ids by owner into the splits, lengths and ids buffers."""
        owner, local, key = self._bucketize(self.rank, it)
        order = np.argsort(owner, kind="stable")  # by owner, (t, s, p) order within
        self.buffers["emb_ids"][...] = local[order]
        self.scounts = np.bincount(owner, minlength=self.W)
        NT, b = self.cfg.tables, self.b
        self.buffers["emb_lengths"].reshape(-1)[...] = np.bincount(key, minlength=self.W * NT * b)
        self.buffers["emb_splits"][...] = [(NT * b, n, b) for n in self.scounts]

    def _received_here(self, it: int) -> tuple[np.ndarray, np.ndarray]:
        """What the exchange brings this rank, from the data (every rank's ids are a pure
        function of the sample): lengths (W,NT,b) and ids, for runs without real compute
        (their buffers carry no ids) and replay's calibration (no messages then)."""
        NT, b = self.cfg.tables, self.b
        lengths = np.zeros((self.W, NT, b), IDS_DTYPE)
        ids = []
        for i in range(self.W):
            owner, local, key = self._bucketize(i, it)
            mine = owner == self.rank
            ids.append(local[mine])
            lengths[i] = np.bincount(key[mine] - self.rank * NT * b, minlength=NT * b).reshape(
                NT, b
            )
        return lengths, np.concatenate(ids)

    def alltoallv(self, name: str, it: int, real: bool = True):
        """The ids all-to-allv: (send, per-peer send counts, receive buffer, receive counts).
        With real compute the counts are those bucketized and received in the splits
        all-to-all, as TorchRec sizes its output; otherwise they come from the data."""
        assert name == "emb_ids"
        if real:
            scounts = self.scounts
            rcounts = self.buffers["emb_splits"][:, 1].copy()
        else:
            owner, _, _ = self._bucketize(self.rank, it)
            scounts = np.bincount(owner, minlength=self.W)
            rcounts = np.array(
                [np.count_nonzero(self._bucketize(i, it)[0] == self.rank) for i in range(self.W)]
            )
        self.recv_ids = np.empty(int(rcounts.sum()), IDS_DTYPE)
        self.exchanged = it
        return self.buffers["emb_ids"], scounts, self.recv_ids, rcounts

    def forward(self, it: int) -> None:
        """emb_fwd (W,b,NT,D) = (B,NT,D): for every sample of the global batch, the sum of
        its ids that fall in this rank's rows (zero where none do)."""
        NT, b = self.cfg.tables, self.b
        if self.W == 1:  # nothing was sent: the buffers hold what was bucketized
            lengths, ids = self.buffers["emb_lengths"], self.buffers["emb_ids"]
        elif self.exchanged == it:
            lengths, ids = self.buffers["emb_lengths"], self.recv_ids
        else:  # replay's calibration: the same work on what the exchange would bring
            lengths, ids = self._received_here(it)
        bag = np.repeat(np.arange(self.W * NT * b), lengths.reshape(-1))  # keys (i, t, s)
        table_of = (bag // b) % NT
        sample = (bag // (NT * b)) * b + bag % b  # global sample i b + s
        out = self.buffers["emb_fwd"].reshape(self.B, NT, -1)
        pooled = np.empty((self.B, self.cfg.dim), dtype=out.dtype)
        for t in range(NT):
            sel = np.flatnonzero(table_of == t)
            self.bags[t] = (ids[sel], sample[sel])
            K.embedding_bag_jagged_forward(pooled, self.tables[t], *self.bags[t])
            out[:, t] = pooled

    def emb(self) -> np.ndarray:
        """(b,NT,D): after the reduce-scatter, block `rank` holds this rank's samples' sums."""
        return self.buffers["emb_fwd"][self.rank]

    def set_grad(self, demb: np.ndarray) -> None:
        """This rank's block of the all-gather (the other blocks are overwritten)."""
        self.buffers["emb_bwd"][self.rank] = demb

    def backward(self, lr: float) -> None:
        """emb_bwd = (B,NT,D) gradients after the all-gather: sparse SGD on the own rows."""
        grads = self.buffers["emb_bwd"].reshape(self.B, self.cfg.tables, -1)
        for t, (ids, sample) in self.bags.items():
            rows, drows = K.embedding_bag_jagged_backward(grads[:, t], ids, sample)
            K.embedding_sgd(self.tables[t], rows, drows, lr)
