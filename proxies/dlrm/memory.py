"""Per-rank memory of the DLRM proxy, from the shapes its runtime allocates (core/memory.py
adds MPI's scratch, wire staging and the interpreter).

Every mode (DLRMShard, DLRMRuntime): the bottom and top MLPs' parameters and gradients
(replicated, data-parallel), the all-to-all buffers of the layout (sharding.py), and the
MLPs' saved activations. Real/replay compute only: the owned embedding tables (or row
blocks, or column shards), plus, while one is built, the whole table it is cut from
(sharding.init_table draws every table whole, so every layout starts from the same values).
"""

from __future__ import annotations

from proxies.core import memory
from proxies.core.plan import Plan
from proxies.dlrm.config import DLRMConfig
from proxies.dlrm.sharding import owned_shards, row_range, slots

F32 = 4
IDS = 8  # sharding.IDS_DTYPE, int64


def estimate(
    cfg: DLRMConfig, rank: int, world: int, kind: str, columns: int, mode: str, plan: Plan
) -> dict[str, int]:
    """Bytes per part of `rank` under --compute `mode` for sharding `kind`."""
    B, b, NT, D = cfg.batch, cfg.batch // world, cfg.tables, cfg.dim
    mlp = cfg.mlp_params
    if kind == "row":
        bufs = F32 * 2 * world * b * NT * D + IDS * (3 * world + world * NT * b)
        bufs += IDS * 2 * b * NT * cfg.pooling  # the ids sent, and about as many received
        owned = [row_range(R, world, rank) for R in cfg.rows]
        table_elems = sum(hi - lo for lo, hi in owned) * D
        whole = max(cfg.rows) * D
    else:
        K = columns if kind == "column" else 1
        S = slots(world, NT * K)
        bufs = F32 * 2 * world * S * b * (D // K)  # emb_fwd, emb_bwd
        mine = owned_shards(rank, world, NT * K)
        table_elems = sum(cfg.rows[u // K] for u in mine) * (D // K)
        whole = max((cfg.rows[u // K] for u in mine), default=0) * D
    widths = [OC for _, OC in cfg.bottom_layers + cfg.top_layers]
    # saved layer outputs and their gradients (b rows each), the interaction's Z and R and
    # its input gradients
    acts = 2 * b * sum(widths) + b * (cfg.features * D + cfg.interaction + NT * D + D)
    parts = {
        "parameters": F32 * mlp,
        "gradients": F32 * mlp,
        "activations": F32 * acts,
        "buffers": bufs,
    }
    if mode in ("real", "replay"):
        parts["parameters"] += F32 * table_elems
        # the whole table being cut (column / row layouts copy out of it); the pooled bags
        # of the global batch (TableWise.forward); the backward's padded gradient
        parts["workspace"] = F32 * ((whole if kind != "table" else 0) + 2 * B * D)
        parts["blas"] = memory.blas_workspace()
    return memory.complete(parts, plan)
