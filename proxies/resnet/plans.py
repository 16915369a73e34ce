"""ResNet plans: one data-parallel rank's iteration as data, for the torchvision models and
for the C++ proxies' (spcl/DNN-cpp-proxies) fixed messages.

Model presets (the pieces: "stem", each bottleneck block "layerS.J", "head" = average pool,
fc and the loss):

    data                                  (real compute only: the replica's synthetic images)
    bcast                                 (--broadcast-buffers: rank 0's batch-norm buffers)
    stem, blocks, head forward
    head, blocks (last first), stem backward, each followed by the gradient allreduces it
                                          closes (--grad-sync buckets: core/grads.py)
    wait for them (fused / per-tensor: the allreduces now), optimizer

C++ presets, their order exactly: resnet50.cpp six blocking MPI_Allreduces after the
backward (it computes nothing); resnet152.cpp the forward, then ten times a tenth of the
backward followed by that bucket's MPI_Iallreduce, and MPI_Waitall.
"""

from __future__ import annotations

from proxies.core.grads import Flat, GradSync, Unit
from proxies.core.plan import Collective, Compute, Op, Wait
from proxies.resnet.config import CppPreset, ResNetConfig


def pieces(cfg: ResNetConfig) -> list[str]:
    return ["stem", *cfg.block_names(), "head"]


def backward_tensors(cfg: ResNetConfig) -> list[tuple[str, int]]:
    """(name, elements) in the flat gradient array's order: backward (torchvision's
    parameters() reversed, as DDP buckets them)."""
    return list(reversed(cfg.tensors))


def piece_of(tensor: str) -> str:
    """The plan piece whose backward completes a parameter tensor's gradient."""
    if tensor.startswith(("conv1.", "bn1.")):
        return "stem"
    if tensor.startswith("fc."):
        return "head"
    return ".".join(tensor.split(".")[:2])


def piece_units(cfg: ResNetConfig) -> dict[str, list[Unit]]:
    """Per piece, one gradient unit per parameter tensor (its [lo, hi) in the flat array,
    the model's layout): buckets close at tensor boundaries, as DDP's (not only between
    blocks), but are posted once the piece's backward op is done."""
    out: dict[str, list[Unit]] = {}
    lo = 0
    for name, n in backward_tensors(cfg):
        out.setdefault(piece_of(name), []).append(Unit(name, (("grads", lo, lo + n),)))
        lo += n
    return out


def piece_ranges(cfg: ResNetConfig) -> dict[str, tuple[int, int]]:
    """Each piece's [lo, hi) in the flat gradients."""
    return {p: (us[0].ranges[0][1], us[-1].ranges[0][2]) for p, us in piece_units(cfg).items()}


def model_ops(
    cfg: ResNetConfig,
    B: int,
    dp: int,
    policy: str,
    bucket: int,
    real: bool,
    broadcast_buffers: bool = False,
    fixed: tuple[int, ...] = (),
) -> list[Op]:
    """One rank's iteration for a torchvision model (see the module doc). `fixed`: bucket
    sizes given (a C++ proxy's, ending at tensor boundaries: cpp_buckets), each posted once
    the backward has completed its last tensor, instead of buckets closed at `bucket`."""
    fwd = cfg.forward_flops(B)
    names = pieces(cfg)
    ops: list[Op] = [Compute("data", category="data")] if real else []
    if broadcast_buffers and dp > 1:
        # DDP's broadcast_buffers: before each forward, rank 0's batch-norm buffers to every
        # replica, coalesced per dtype (running mean and var; num_batches_tracked)
        ops.append(Collective("bcast", "dp", "bn_stats", 2 * cfg.bn_channels, category="dp_bcast"))
        ops.append(
            Collective("bcast", "dp", "bn_counts", len(cfg.layers), "int64", category="dp_bcast")
        )
    ops += [Compute(f"{p}.forward", flops=fwd[p]) for p in names]
    n = cfg.num_params
    per_piece = piece_units(cfg)
    flats = []
    if dp > 1:
        tensors = tuple((f"grad:{t}", c) for t, c in backward_tensors(cfg))
        flats.append(Flat("grads", "dp", n, "dp_allreduce", tensors=tensors, req="bucket{n}"))
    units = [u for p in reversed(names) for u in per_piece[p]]
    if fixed:  # one unit per given bucket, keyed by its last tensor: each its own bucket
        units, bucket = cpp_buckets(units, fixed), 0
    sync = GradSync(policy, flats, units, bucket=bucket)
    for p in reversed(names):
        # the stem's backward has no input gradient (the image): its weight gradient only
        ops.append(Compute(f"{p}.backward", flops=fwd[p] if p == "stem" else 2 * fwd[p]))
        ops += sync.after([u.key for u in per_piece[p]])
    # SGD with momentum and weight decay: about 5 operations per parameter
    return ops + sync.end(optimizer=Compute("optimizer", flops=5.0 * n))


def tensor_bounded(cfg: ResNetConfig, sizes: tuple[int, ...]) -> bool:
    """Whether consecutive buckets of these sizes end at tensor boundaries of cfg's
    gradients in backward order (and cover them exactly)."""
    ends, cum = set(), 0
    for _, n in backward_tensors(cfg):
        cum += n
        ends.add(cum)
    cum = 0
    for n in sizes:
        cum += n
        if cum not in ends:
            return False
    return cum == cfg.num_params


def cpp_buckets(units: list[Unit], sizes: tuple[int, ...]) -> list[Unit]:
    """The per-tensor units (backward order) regrouped into one unit per given size, keyed by
    the key of its last tensor (tensor_bounded must hold)."""
    out, i = [], 0
    for n in sizes:
        lo, got = units[i].ranges[0][1], 0
        while got < n:
            got += units[i].size
            i += 1
        out.append(Unit(units[i - 1].key, (("grads", lo, lo + n),)))
    return out


def cpp_ops(pre: CppPreset, B: int, forward_us: float, backward_us: float, dp: int) -> list[Op]:
    """The C++ proxy's iteration. Times in us (its usleep arguments); where it sleeps nothing
    (resnet50.cpp) the compute ops carry the model's FLOPs for --compute model."""
    fwd = sum(pre.model.forward_flops(B).values())
    k = len(pre.sizes)
    ops: list[Op] = [Compute("forward", flops=fwd, seconds=forward_us * 1e-6)]
    if pre.blocking:
        ops.append(Compute("backward", flops=2 * fwd, seconds=k * backward_us * 1e-6))
        if dp > 1:
            ops += [Collective("allreduce", "dp", f"bucket{i}", n) for i, n in enumerate(pre.sizes)]
        return ops
    for i, n in enumerate(pre.sizes):
        ops.append(Compute(f"backward{i}", flops=2 * fwd / k, seconds=backward_us * 1e-6))
        if dp > 1:
            ops.append(Collective("allreduce", "dp", f"bucket{i}", n, req=f"bucket{i}"))
    if dp > 1:
        ops += [Wait(f"bucket{i}") for i in range(k)]
    return ops
