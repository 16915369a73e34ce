"""Per-rank memory of the CosmoFlow proxy, from the shapes its runtime allocates
(core/memory.py adds MPI's scratch, wire staging and the interpreter).

Real/replay compute (model.ShardModel): conv and dense-shard parameters, gradients and SGD
momentum; every layer's activations and their gradients, allocated once (the padded input,
the im2col matrix, the conv output before and after the activation, the pool and its
argmax; for layers after the first the same for the backward); the data step's B whole
sample volumes and the max-pool backward's window temporary. Every mode: one buffer per
message of the plan and the dense layers' whole input and input-gradient buffers; model and
none hold zero gradients in place of the model's.
"""

from __future__ import annotations

import math

from proxies.core import memory
from proxies.core.plan import Plan
from proxies.cosmoflow.config import CosmoFlowConfig, K, Shards

F32 = 4


def activation_elements(cfg: CosmoFlowConfig, shards: Shards, s: int, B: int) -> tuple[int, int]:
    """(float32 elements, int8 argmax bytes) of ShardModel's activation buffers."""
    S = shards.size
    elems = idx = 0
    for l in range(cfg.layers):
        ci, co = cfg.channels(l)
        d, h, w = shards.local(cfg.extent(l))
        N, padded = B * d * h * w, B * (d + 2) * (h + 2) * (w + 2)
        pooled = B * (d // 2) * (h // 2) * (w // 2) * co
        # x_pad, cols, pre, act, dact, dpre, pooled
        elems += padded * ci + N * K**3 * ci + 4 * N * co + pooled
        idx += pooled
        if l:  # dy_pad, dcols, dx
            elems += padded * co + N * K**3 * co + N * ci
    for k in range(len(cfg.dense)):
        i = cfg.dense_io(k)[0]
        lo, hi = cfg.dense_columns(k, S, s)
        elems += 4 * B * (hi - lo) + B * i  # d_pre, d_out, d_dpre, d_dout; d_dinp
    elems += B * cfg.dense[-1]  # target
    return elems, idx


def estimate(
    cfg: CosmoFlowConfig, shards: Shards, s: int, B: int, mode: str, plan: Plan
) -> dict[str, int]:
    """Bytes per part of one rank of shard s under --compute `mode`."""
    S = shards.size
    conv = sum(cfg.conv_params(l) for l in range(cfg.layers))
    dense = sum(cfg.dense_params(k, S, s) for k in range(len(cfg.dense)))
    names = {m.buf: m.count for _, m, _ in plan.messages()}
    whole = sum(2 * B * cfg.dense_io(k)[0] for k in range(len(cfg.dense)))
    parts = {
        "gradients": F32 * (conv + dense),
        "buffers": F32 * (sum(names.values()) + whole),
    }
    if mode in ("real", "replay"):
        elems, idx = activation_elements(cfg, shards, s, B)
        d, h, w = shards.local(cfg.extent(0))
        co = cfg.filters[0]
        parts |= {
            "parameters": F32 * (conv + dense),
            "optimizer": F32 * (conv + dense),  # momentum
            "activations": F32 * elems + idx,
            # B whole volumes (model.sample) at the data step; maxpool_backward's
            # (pooled x 8) window over the largest layer
            "workspace": F32 * max(B * math.prod(cfg.volume) * cfg.in_channels, B * d * h * w * co),
            "blas": memory.blas_workspace(),
        }
    return memory.complete(parts, plan)
