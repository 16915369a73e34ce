"""FSDP / ZeRO-3 for the ResNet proxy (--fsdp): core/fsdp.py's lowering over the plan pieces.

Units: the stem, each bottleneck block, the head (fc) - PyTorch FSDP's usual wrapping of a
torchvision ResNet (fully_shard / an auto-wrap policy on each Bottleneck, the root holding
conv1/bn1 and fc). Per block rather than per stage: a stage of ResNet-152 holds up to 36
blocks (layer3: 27 M parameters, 45% of the model), so gathering a stage would hold most
of the model at once; a block is at most 6 M (layer4.0), and blocks are also the plan's
compute pieces, so each gather's prefetch overlaps exactly one piece's compute.

The flat arrays (model.layout with pad n) give each unit a range padded to a multiple of
the shard group's size n: rank r's shard is block r of it, and the all-gathers and
reduce-scatters run in place on that range (no gather slots). Batch-norm running
statistics are buffers, not parameters: each replica keeps its own (or rank 0's are
broadcast, --broadcast-buffers), never sharded.
"""

from __future__ import annotations

import numpy as np

from proxies.core import pages
from proxies.core.fsdp import (
    FSDP,
    GATHER,
    REPLICA_GROUP,
    SCATTER,
    SHARD_GROUP,
    ShardUnit,
    Step,
    hsdp_groups,
    release,
)
from proxies.core.plan import Collective, Compute, Op, Plan
from proxies.resnet.config import ResNetConfig

INFLIGHT = 2  # reduce-scatters in flight at once


def shard_units(cfg: ResNetConfig, n: int) -> list[tuple[ShardUnit, int, int]]:
    """(unit, lo, hi) per plan piece in forward order (stem, blocks, head): its range of
    the flat arrays laid out for shard size n (model.layout), hi - lo its unpadded size."""
    from proxies.resnet.model import layout
    from proxies.resnet.plans import piece_of, pieces

    offsets, _ = layout(cfg, n)
    spans: dict[str, list[int]] = {}
    for name, (lo, hi) in offsets.items():
        s = spans.setdefault(piece_of(name), [lo, hi])
        s[0], s[1] = min(s[0], lo), max(s[1], hi)
    return [(ShardUnit(p, spans[p][1] - spans[p][0]), *spans[p]) for p in pieces(cfg)]


def fsdp_plan(
    cfg: ResNetConfig, B: int, dp: int, shard: int, rank: int, real: bool, bcast: bool
) -> Plan:
    """Rank `rank`'s FSDP iteration: data, the buffers' broadcast (bcast), the forward with
    each unit gathered before its piece (one ahead), the backward gathering again, each
    unit's gradients reduce-scattered after its backward piece (HSDP: the reduced shard
    allreduced over the replicas), SGD on the shards."""
    from proxies.resnet.plans import pieces

    fwd = cfg.forward_flops(B)
    names = pieces(cfg)
    units = [u for u, _, _ in shard_units(cfg, shard)]
    shard_g, replica_g = hsdp_groups(range(dp), rank, shard)
    groups = {"dp": tuple(range(dp)), SHARD_GROUP: shard_g}
    if len(replica_g) > 1:
        groups[REPLICA_GROUP] = replica_g
    fs = FSDP(units, shard, len(replica_g), INFLIGHT)
    ops: list[Op] = [Compute("data", category="data")] if real else []
    if bcast:  # rank 0's batch-norm buffers, as without FSDP (plans.model_ops)
        ops.append(Collective("bcast", "dp", "bn_stats", 2 * cfg.bn_channels, category="dp_bcast"))
        ops.append(
            Collective("bcast", "dp", "bn_counts", len(cfg.layers), "int64", category="dp_bcast")
        )
    ops += fs.pass_ops([Step(Compute(f"{p}.forward", flops=fwd[p]), (p,)) for p in names])
    back = [
        Step(Compute(f"{p}.backward", flops=fwd[p] if p == "stem" else 2 * fwd[p]), (p,), (p,))
        for p in reversed(names)
    ]
    ops += fs.pass_ops(back, reduce=True)
    # SGD with momentum and weight decay on this rank's shards: ~5 operations per element
    ops += fs.end(optimizer=Compute("optimizer", flops=5.0 * fs.shard_elements))
    return Plan(rank, tuple(ops), groups, {"dp": rank})


class ResNetShards:
    """One rank's FSDP state (real compute): each unit's parameter shard (block r of its
    padded range), its reduced gradient shard and momentum. The model computes on fixed
    views of its flat arrays (anonymous memory, model.py pad > 1): a unit's range holds its
    parameters only from its all-gather (in place: this rank's shard copied into its
    block first) to fsdp_reshard, which gives the range's whole pages back (they read as
    zeros) and fills the rest with NaN, so a piece run without its gather, or with a wrong
    one, spoils the loss. Gradients are reduce-scattered in place on the unit's range; the
    reduced block is saved into the gradient shard when the slot's next reduce-scatter
    starts (the plan waited this one before), when HSDP's allreduce asks for the shard, or
    at the optimizer; then the range is given back (and zeroed: the backward adds)."""

    def __init__(
        self, cfg: ResNetConfig, model, shard: int, shard_rank: int, fill: float = np.nan
    ) -> None:
        # fill 0 for --compute replay, which times each piece alone, with no gather before
        self.model, self.n, self.r, self.fill = model, shard, shard_rank, fill
        self.table = shard_units(cfg, shard)
        dt = model.params.dtype
        self.shards, self.grads, self.mom = [], [], []
        for u, lo, _ in self.table:
            k = u.shard(shard)
            self.shards.append(model.params[lo + self.r * k : lo + (self.r + 1) * k].copy())
            self.grads.append(pages.zeros(k, dt))  # reduce-scattered into
            self.mom.append(np.zeros(k, dt))
        self.held: dict[str, int] = {}  # reduce-scatter slot name -> unit not yet saved
        for i in range(len(self.table)):  # nothing readable (or resident) before its gather
            self._free(self.model.params, i, self.fill)

    def _range(self, arr: np.ndarray, i: int) -> np.ndarray:
        u, lo, _ = self.table[i]
        return arr[lo : lo + u.padded(self.n)]

    def _block(self, arr: np.ndarray, i: int) -> np.ndarray:
        k = self.table[i][0].shard(self.n)
        return self._range(arr, i)[self.r * k : (self.r + 1) * k]

    def _free(self, arr: np.ndarray, i: int, fill: float) -> None:
        """Unit i's padded range of arr given back: zeros, `fill` on its partial pages."""
        u, lo, _ = self.table[i]
        hi = lo + u.padded(self.n)
        a, b = release(arr, lo, hi)
        arr[lo:a] = fill
        arr[b if b > a else lo : hi] = fill

    def buffer(self, name: str, i: int) -> np.ndarray:
        if name.startswith("fsdp_ag"):
            self._block(self.model.params, i)[...] = self.shards[i]
            return self._range(self.model.params, i)
        if name == "fsdp_rshard":
            self._save(i)
            return self.grads[i]
        if name.startswith("fsdp_rs"):
            held = self.held.pop(name, None)
            if held is not None:  # waited before this one was posted (core/fsdp.py)
                self._save_from(held)
            self.held[name] = i
            return self._range(self.model.grads, i)  # the padding is zero
        raise KeyError(name)

    def _save_from(self, i: int) -> None:
        self.grads[i][...] = self._block(self.model.grads, i)
        self._free(self.model.grads, i, 0.0)  # the unsharded gradients are done with

    def _save(self, i: int) -> None:
        for slot, held in list(self.held.items()):
            if held == i:
                self._save_from(i)
                del self.held[slot]

    def compute(self, name: str, i: int) -> None:
        if name.startswith("fsdp_unshard:"):
            return  # gathered in place: already there
        if name.startswith("fsdp_reshard:"):
            self._free(self.model.params, i, self.fill)
            return
        raise ValueError(f"unknown FSDP op {name!r}")

    def step(self, lr: float, momentum: float, weight_decay: float, scale: float) -> None:
        """SGD with momentum on each shard (elementwise: the shards together step as the
        whole array would; the padding stays zero)."""
        from proxies.resnet.kernels import sgd_step

        for i in range(len(self.table)):
            self._save(i)
            sgd_step(self.shards[i], self.grads[i], self.mom[i], lr, momentum, weight_decay, scale)


def gathered_peak(plan: Plan, units: list[ShardUnit], n: int) -> int:
    """Elements of the most parameters one rank holds gathered at once: a unit's padded
    range from its all-gather's start to its reshard (the one in use and the prefetched)."""
    live: dict[int, int] = {}
    peak = 0
    for op in plan.ops:
        if isinstance(op, Collective) and op.category == GATHER:
            live[op.mb] = units[op.mb].padded(n)
            peak = max(peak, sum(live.values()))
        elif isinstance(op, Compute) and op.name.startswith("fsdp_reshard:"):
            live.pop(op.mb, None)
    return peak


def grads_peak(plan: Plan, units: list[ShardUnit], n: int) -> int:
    """Elements of the most unsharded gradients resident at once: a unit's from its
    backward until its reduced block is saved (the next reduce-scatter on its slot, its
    HSDP allreduce, the optimizer), as ResNetShards runs the plan."""
    live: dict[int, int] = {}
    held: dict[str, int] = {}
    peak = 0
    for op in plan.ops:
        if isinstance(op, Compute) and op.name.endswith(".backward"):
            i = next(k for k, u in enumerate(units) if u.key == op.name[: -len(".backward")])
            live[i] = units[i].padded(n)
            peak = max(peak, sum(live.values()))
        elif isinstance(op, Collective) and op.category == SCATTER:
            if op.buf in held:
                live.pop(held.pop(op.buf), None)
            held[op.buf] = op.mb
        elif isinstance(op, Collective) and op.buf == "fsdp_rshard":
            live.pop(op.mb, None)
    return peak


def fsdp_text(dp: int, shard: int) -> str:
    if shard == dp:
        return f"FSDP (ZeRO-3) over dp {dp}"
    return f"HSDP: sharded over {shard} ranks, replicated over {dp // shard}"
