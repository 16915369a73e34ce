"""The DLRM proxy's plans: the sharding a run uses, its message sizes, every compute op's
work and A100 time, and the ops of one iteration in order (letters as in config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from proxies.core.grads import Flat, GradSync, Unit
from proxies.core.plan import Collective, Compute, Op, Wait
from proxies.dlrm.config import PRESETS, DLRMConfig
from proxies.dlrm.sharding import owned_shards, slots

# compute=model: the C++ proxy's per-kernel A100 times (us), measured for its configuration
# (dnn-cpp-proxies on 4 GPUs: b = 512, one table per rank). Forward of the bottom MLP, top
# MLP, interaction and embedding lookups; the backward takes 2x, 2x, 1x, 2x (dlrm.cpp).
CPP_US = {"bottom": 341.0, "top": 455.0, "interaction": 209.0, "emb": 95.0}
CPP_BACKWARD = {"bottom": 2.0, "top": 2.0, "interaction": 1.0, "emb": 2.0}
CPP_WORLD = 4
IDS = "int64"  # ids and lengths, as TorchRec's KeyedJaggedTensor (torch.long)


@dataclass(frozen=True)
class Layout:
    """The sharding of a run: "table", "column" (K shards per table) or "row"."""

    kind: str
    columns: int = 1  # K

    def shards(self, cfg: DLRMConfig) -> int:
        """Shards placed round-robin (table / column); row-wise: every rank holds a block."""
        return cfg.tables * self.columns

    def messages(self, cfg: DLRMConfig, world: int) -> dict[str, int]:
        """Elements of each collective on every rank (whole arrays, as the plan's counts)."""
        B, b, NT, D, P = cfg.batch, cfg.batch // world, cfg.tables, cfg.dim, cfg.pooling
        if self.kind == "row":
            return {
                "splits": world * 3,  # per peer: lengths count, ids count, stride (int64)
                "lengths": world * NT * b,  # per peer: NT b bag lengths (int64)
                "ids": b * NT * P,  # sent in all, split by owner as the data falls (int64)
                "reduce_scatter": B * NT * D,  # (B,NT,D) partial sums -> (b,NT,D) each
                "allgather": B * NT * D,  # (b,NT,D) gradients -> (B,NT,D) each
            }
        S = slots(world, self.shards(cfg))
        return {"alltoall": world * S * b * (D // self.columns)}  # (W,S,b,D/K) both ways


TABLE_WISE = Layout("table")


def emb_work(cfg: DLRMConfig, lookups: float) -> float:
    """Adds of `lookups` table-bags of P rows of D for the global batch."""
    return float(lookups * cfg.batch * cfg.pooling * cfg.dim)


def mlp_flops(layers: list[tuple[int, int]], n: int) -> list[float]:
    """Forward FLOPs per layer for n samples: 2 per multiply-add (biases, ReLU not counted)."""
    return [2.0 * n * C * OC for C, OC in layers]


def interaction_flops(cfg: DLRMConfig, n: int) -> float:
    """The (F,F) Gram matrix of n samples, as one batched matmul."""
    return 2.0 * n * cfg.features**2 * cfg.dim


def reference_work() -> dict[str, float]:
    """Forward work of each kind in the configuration the C++ times were measured at."""
    ref = PRESETS["dnn-cpp-proxies"]
    b = ref.batch // CPP_WORLD
    return {
        "bottom": sum(mlp_flops(ref.bottom_layers, b)),
        "top": sum(mlp_flops(ref.top_layers, b)),
        "interaction": interaction_flops(ref, b),
        "emb": emb_work(ref, 1),
    }


def compute_ops(
    cfg: DLRMConfig, world: int, rank: int, times: str, layout: Layout = TABLE_WISE
) -> dict[str, Compute]:
    """Every compute op of one rank, by name, with FLOPs and (times="cpp") A100 seconds."""
    b, ref = cfg.batch // world, reference_work()
    cpp = times == "cpp"

    def op(name: str, kind: str, flops: float, work: float, backward: bool) -> Compute:
        seconds = 0.0
        if cpp:
            factor = CPP_BACKWARD[kind] if backward else 1.0
            seconds = CPP_US[kind] * 1e-6 * factor * work / ref[kind]
        return Compute(name, flops=flops, seconds=seconds)

    if layout.kind == "row":
        # every rank looks up the ids in its rows: 1/W of all B NT P on average (the data
        # decides; the skewed synthetic ids load the first rows' owners more)
        emb = emb_work(cfg, cfg.tables / world)
    else:
        mine = len(owned_shards(rank, world, layout.shards(cfg)))
        emb = emb_work(cfg, mine / layout.columns)
    inter = interaction_flops(cfg, b)
    ops = [
        op("emb forward", "emb", emb, emb, False),
        op("interaction forward", "interaction", inter, inter, False),
        op("interaction backward", "interaction", 2 * inter, inter, True),
        op("emb backward", "emb", emb, emb, True),
        # row-wise: bucketize the b NT P ids by owner (integer work, no FLOPs, no C++ time)
        Compute("emb input"),
    ]
    for mlp, layers in (("bottom", cfg.bottom_layers), ("top", cfg.top_layers)):
        fwd = mlp_flops(layers, b)
        ops.append(op(f"{mlp} forward", mlp, sum(fwd), sum(fwd), False))
        ops += [op(f"{mlp}.{l} backward", mlp, 2 * f, f, True) for l, f in enumerate(fwd)]
    # SGD is not in the C++ proxy's times: zero there; 2 FLOPs per MLP parameter otherwise.
    ops.append(Compute("optimizer", flops=0.0 if cpp else 2.0 * cfg.mlp_params))
    return {o.name: o for o in ops}


def plan_ops(
    cfg: DLRMConfig,
    world: int,
    rank: int,
    schedule: str,
    times: str,
    layout: Layout = TABLE_WISE,
) -> list[Op]:
    c = compute_ops(cfg, world, rank, times, layout)
    comm, overlap = world > 1, schedule == "overlap"
    n = layout.messages(cfg, world)
    mlps = {"top": cfg.top_layers, "bottom": cfg.bottom_layers}
    row = layout.kind == "row"
    fwd_kind, bwd_kind = ("reduce_scatter", "allgather") if row else ("alltoall", "alltoall")
    ops: list[Op] = []
    # The MLPs' gradient sync (core/grads.py), every unit posted on its own (buckets of size
    # 0) as soon as its backward is done. --overlap: a unit and an array per layer, keyed
    # "grad:<mlp>.<l>"; else one per MLP, "grad:<mlp>", after its last layer's backward.
    flats, units = [], []
    for mlp in ("top", "bottom"):  # backward order
        sizes = DLRMConfig.layer_params(mlps[mlp])
        parts = [(f"{mlp}.{l}", sizes[l]) for l in reversed(range(len(sizes)))]
        for name, size in parts if overlap else [(mlp, sum(sizes))]:
            flats.append(Flat(f"grad:{name}", "dp", size, whole=True, req=name))
            units.append(Unit(name, ((f"grad:{name}", 0, size),)))
    sync = GradSync("buckets", flats if comm else [], units, bucket=0)

    def emb_exchange(buf: str, kind: str) -> None:
        """The pooled bags (forward) or their gradients (backward)."""
        if comm:
            ops.append(Collective(kind, "emb", buf, n[kind], req=buf if overlap else ""))

    def backward(mlp: str) -> None:
        sizes = DLRMConfig.layer_params(mlps[mlp])
        for l in reversed(range(len(sizes))):
            ops.append(c[f"{mlp}.{l} backward"])
            ops.extend(sync.after([f"{mlp}.{l}"]))  # --overlap: this layer's gradients are final
        ops.extend(sync.after([mlp]))  # else the whole MLP's

    # forward
    if row:
        # TorchRec's input dist: the splits first (they size the ids' buffers), then the
        # lengths and the ids together, both waited before the lookups.
        ops.append(c["emb input"])
        if comm:
            cat = "emb_input"
            ops.append(Collective("alltoall", "emb", "emb_splits", n["splits"], IDS, category=cat))
            for buf, kind, key in (
                ("emb_lengths", "alltoall", "lengths"),
                ("emb_ids", "alltoallv", "ids"),
            ):
                ops.append(Collective(kind, "emb", buf, n[key], IDS, req=buf, category=cat))
            ops += [Wait("emb_lengths"), Wait("emb_ids")]
    ops.append(c["emb forward"])
    emb_exchange("emb_fwd", fwd_kind)
    ops.append(c["bottom forward"])
    if comm and overlap:
        ops.append(Wait("emb_fwd"))
    ops += [c["interaction forward"], c["top forward"]]
    # backward
    backward("top")
    ops.append(c["interaction backward"])
    if overlap:
        emb_exchange("emb_bwd", bwd_kind)
    backward("bottom")
    if comm and overlap:
        ops.append(Wait("emb_bwd"))
    if not overlap:
        emb_exchange("emb_bwd", bwd_kind)
    ops.append(c["emb backward"])
    return ops + sync.end(optimizer=c["optimizer"])
