"""Per-rank memory of the ResNet proxy, from the arrays its runtime allocates (core/memory.py
adds MPI's scratch, wire staging and the interpreter).

Real/replay compute (model.ResNetModel): parameters, gradients and momentum (flat float32),
and what the forward keeps for the backward: per conv its batch norm's normalised output,
its ReLU output where it has one, its im2col matrix where it is not the input itself (k > 1
or stride 2); per block its output; the stem's max-pool argmax (int64). The backward's
largest transient is one conv's input-gradient columns plus its padded input gradient
(the stem's excepted: it computes none).
Model/none compute: the flat gradient array (or the C++ presets' bucket buffers) only.
"""

from __future__ import annotations

from proxies.core import memory
from proxies.core.plan import Collective, Plan
from proxies.resnet.config import ResNetConfig

F32, I64 = 4, 8


def _cols(c, B: int) -> int:
    """Elements of a conv's saved im2col matrix (0: it is the input array itself)."""
    if c.k == 1 and c.stride == 1:
        return 0
    return B * c.cin * c.k * c.k * c.h * c.w


def estimate(
    cfg: ResNetConfig | None, B: int, mode: str, plan: Plan, shard: int = 0
) -> dict[str, int]:
    """Bytes per part of one rank under --compute `mode` (cfg None: a C++ preset; shard:
    FSDP's shard group size, 0 without)."""
    if shard:
        return _fsdp(cfg, B, mode, plan, shard)
    bufs = sum(op.count for op in plan.ops if isinstance(op, Collective) and op.buf != "grads")
    grads_synced = any(isinstance(op, Collective) for op in plan.ops)
    if cfg is None or mode not in ("real", "replay"):
        n = cfg.num_params if cfg is not None and grads_synced else 0
        # Span / per-tensor keys name slices of the one flat array
        bufs = 0 if cfg is not None else bufs
        return memory.complete({"gradients": F32 * n, "buffers": F32 * bufs}, plan)
    return memory.complete(
        {
            "parameters": F32 * 2 * cfg.num_params,  # the weights and the momentum buffer
            "gradients": F32 * cfg.num_params,
            **_compute_parts(cfg, B),
        },
        plan,
    )


def _fsdp(cfg: ResNetConfig, B: int, mode: str, plan: Plan, n: int) -> dict[str, int]:
    """FSDP (resnet/fsdp.py ResNetShards): parameters the shards, their momentum and the
    most units gathered at once (in use and prefetched); gradients the reduced shards and
    the most unsharded ones resident at once. Model/none compute: the engine's zero slots
    (two gathers, two reduce-scatters, the HSDP shard) instead of the model's arrays."""
    from proxies.resnet.fsdp import gathered_peak, grads_peak, shard_units

    units = [u for u, _, _ in shard_units(cfg, n)]
    shards = sum(u.shard(n) for u in units)
    largest = max(u.padded(n) for u in units)
    if mode not in ("real", "replay"):
        rshard = max(u.shard(n) for u in units) if "hsdp" in plan.groups else 0
        return memory.complete({"buffers": F32 * (4 * largest + rshard)}, plan)
    return memory.complete(
        {
            "parameters": F32 * (2 * shards + gathered_peak(plan, units, n)),
            "gradients": F32 * (shards + grads_peak(plan, units, n)),
            **_compute_parts(cfg, B),
        },
        plan,
    )


def _compute_parts(cfg: ResNetConfig, B: int) -> dict[str, int]:
    """Activations, workspace and BLAS of the real compute (see the module doc)."""
    acts = 0
    for c in cfg.layers:
        out = B * c.cout * c.h * c.w
        relu = not c.name.endswith(("conv3", "downsample"))
        acts += out * (2 if relu else 1) + _cols(c, B)
        if c.name.endswith("conv3"):
            acts += out  # the block's output
    stem = cfg.layers[0]
    pooled = B * stem.cout * ((stem.h + 1) // 2) ** 2
    # the stem's backward makes no input gradient: no columns, no padded gradient
    work = max(2 * max(_cols(c, B), B * c.cin * c.h * c.w * c.stride**2) for c in cfg.layers[1:])
    return {
        "activations": F32 * acts + I64 * pooled,
        "workspace": F32 * (work + 2 * B * 3 * cfg.image_size**2),  # + the images
        "blas": memory.blas_workspace(),
    }
