"""Where a rank's parameters live: which shard of which tensor it holds (Megatron's tensor
parallelism, model.py), in two flat arrays (dense, expert) laid out so that a gradient
bucket is one contiguous range."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from proxies.transformer.config import LAYER_TENSORS, layer_shapes, normal
from proxies.transformer.setup import Setup

ATTN_TENSORS = LAYER_TENSORS[:8]  # ln_1, c_attn, c_proj, ln_2: every layer, MoE or not
MLP_TENSORS = LAYER_TENSORS[8:]
# Replicated tensors whose gradient is a partial sum over the sequence shards under sequence
# parallelism (layernorms, row-parallel biases, the MoE router, which routes the shard):
# summed over TP before the optimizer step.
SP_PARTIAL = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_proj.bias",
    "moe.gate.weight",
)


# ----------------------------------------------------------------------------------------
# layout: which shard of which tensor a rank holds, and where in its flat arrays


def shard_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of rank r's shard of a layer tensor (the same for every r)."""
    if name.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias")):
        return (shape[0] // tp, *shape[1:])  # column-parallel: output rows split
    if name.endswith("c_proj.weight"):
        return (shape[0], shape[1] // tp)  # row-parallel: input columns split
    return shape  # replicated: layernorms, row-parallel biases, the MoE gate


def shard(name: str, full: np.ndarray, tp: int, r: int) -> np.ndarray:
    """Rank r's shard of a full tensor. qkv rows are [q; k; v], each split by heads."""
    if name.endswith(("c_attn.weight", "c_attn.bias")):
        C = full.shape[0] // 3
        w = C // tp
        return np.concatenate([full[i * C + r * w : i * C + (r + 1) * w] for i in range(3)])
    if name.endswith(("c_fc.weight", "c_fc.bias")):
        w = full.shape[0] // tp
        return full[r * w : (r + 1) * w]
    if name.endswith("c_proj.weight"):
        w = full.shape[1] // tp
        return full[:, r * w : (r + 1) * w]
    return full


def layer_tensors(S: Setup) -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
    """(dense, expert) tensors of one layer's shard on one rank: names without the "h.{l}."
    prefix. Dense ones are reduced over the data-parallel group, expert ones over the
    expert-data-parallel group."""
    C, tp, moe = S.cfg.n_embd, S.tp, S.moe
    full = layer_shapes(C)
    names = ATTN_TENSORS if moe else LAYER_TENSORS
    dense = [(n, shard_shape(n, full[n], tp)) for n in names]
    expert: list[tuple[str, tuple]] = []
    if moe:
        dense.append(("moe.gate.weight", (moe.experts, C)))
        F = moe.ffn_hidden // tp
        for e in range(moe.local_experts):
            expert += [(f"experts.{e}.c_fc.weight", (F, C)), (f"experts.{e}.c_proj.weight", (C, F))]
    return dense, expert


@dataclass(frozen=True)
class Unit:
    """Parameters whose gradients are complete at the same point of the backward: one layer,
    or the embedding/head tensors ("extra"). Ranges index the flat dense / expert arrays."""

    chunk: int
    layer: int  # -1 for the extra unit
    dense: tuple[int, int]
    expert: tuple[int, int]

    @property
    def size(self) -> int:
        return self.dense[1] - self.dense[0] + self.expert[1] - self.expert[0]


class Layout:
    """Where each tensor of a rank lives in its two flat arrays (dense, expert).

    Per chunk: the extra tensors first (wte shard, wpe, ln_f; on the chunk that finishes them
    last: the embedding chunk, else the head chunk), then its layers bottom to top. A
    gradient bucket, consecutive units in backward order, is then one contiguous range.
    `units` lists each chunk's units in the order its backward completes them.
    """

    def __init__(self, S: Setup, stage: int) -> None:
        C = S.cfg.n_embd
        self.chunks = S.chunks(stage)
        owner = next((ch for ch in self.chunks if ch.embed), None)
        owner = owner or next((ch for ch in self.chunks if ch.head), None)
        self.dense: list[tuple[str, tuple, int]] = []
        self.expert: list[tuple[str, tuple, int]] = []
        self.units: list[Unit] = []
        self.sp_ranges: list[tuple[int, int]] = []
        self.wte: tuple[int, int] | None = None
        d = e = 0
        dense_layer, expert_layer = layer_tensors(S)
        for ch in self.chunks:
            units: list[Unit] = []
            if ch is owner:
                extra = [("wte", (S.vocab // S.tp, C))]
                if any(c.embed for c in self.chunks):
                    extra.append(("wpe", (S.cfg.max_seq_len, C)))
                if any(c.head for c in self.chunks):
                    extra += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
                start = d
                for name, shape in extra:
                    if name == "wte":
                        self.wte = (d, d + math.prod(shape))
                    if name.startswith("ln_f"):
                        self.sp_ranges.append((d, d + math.prod(shape)))
                    self.dense.append((name, shape, d))
                    d += math.prod(shape)
                extra_unit = Unit(ch.index, -1, (start, d), (e, e))
            for l in ch.layers:
                d0, e0 = d, e
                for name, shape in dense_layer:
                    size = math.prod(shape)
                    if name in SP_PARTIAL:
                        self.sp_ranges.append((d, d + size))
                    self.dense.append((f"h.{l}.{name}", shape, d))
                    d += size
                for name, shape in expert_layer:
                    self.expert.append((f"h.{l}.{name}", shape, e))
                    e += math.prod(shape)
                units.append(Unit(ch.index, l, (d0, d), (e0, e)))
            units.reverse()  # backward completes the top layer first
            if ch is owner:
                units.append(extra_unit)
            self.units += units
        self.dense_size, self.expert_size = d, e
        self.sp_size = sum(b - a for a, b in self.sp_ranges)


def init_layer(S: Setup, l: int, seed: int, tp: int, r: int, experts: range) -> dict:
    """Layer l's tensors in full, drawn as proxies.gpt2 draws them, then rank r's shard."""
    C, L = S.cfg.n_embd, S.cfg.n_layer
    proj_std = 0.02 / math.sqrt(2 * L)
    full = layer_shapes(C)
    rng = np.random.default_rng([seed, 1, l])
    out = {}
    names = ATTN_TENSORS if S.moe else LAYER_TENSORS
    for n in names:  # same order and stream as gpt2's StageModel._init_params
        t = np.zeros(full[n])
        if n.startswith("ln_") and n.endswith("weight"):
            t.fill(1.0)
        elif n.endswith("weight"):
            normal(t, rng, proj_std if n.endswith("c_proj.weight") else 0.02)
        out[n] = shard(n, t, tp, r)
    if S.moe:
        F = S.moe.ffn_hidden
        gate = np.zeros((S.moe.experts, C))
        normal(gate, np.random.default_rng([seed, 2, l]), 0.02)
        out["moe.gate.weight"] = gate
        for i, ex in enumerate(experts):
            rng = np.random.default_rng([seed, 3, l, ex])
            fc, proj = np.zeros((F, C)), np.zeros((C, F))
            normal(fc, rng, 0.02)
            normal(proj, rng, proj_std)
            out[f"experts.{i}.c_fc.weight"] = shard("c_fc.weight", fc, tp, r)
            out[f"experts.{i}.c_proj.weight"] = shard("c_proj.weight", proj, tp, r)
    return out
