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

    Per chunk, the sections of S.param_order: the extra tensors (wte shard, wpe, ln_f; on
    the chunk that finishes them last: the embedding chunk, else the head chunk) and the
    chunk's layers bottom to top. GPT-3 puts the extras first, so a gradient bucket,
    consecutive units in backward order, is one contiguous range; GPT-2 puts ln_f last
    (config.stage_layout, whose offsets its plans name), and its extras then make two units:
    wte and wpe (layer -1), ln_f (layer -2). `units` lists each chunk's units in the order
    its backward completes them.
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
        self.d = self.e = 0
        dense_layer, expert_layer = layer_tensors(S)
        embed = any(c.embed for c in self.chunks)
        head = any(c.head for c in self.chunks)
        sections = {
            "wte": [("wte", (S.vocab // S.tp, C))],
            "wpe": [("wpe", (S.cfg.max_seq_len, C))] if embed else [],
            "ln_f": [("ln_f.weight", (C,)), ("ln_f.bias", (C,))] if head else [],
        }
        sections |= S.cfg.extra_sections(S.vocab // S.tp, embed, head)
        for ch in self.chunks:
            layers: list[Unit] = []
            e0 = self.e  # the extras hold no expert tensors: an empty range at the chunk's start
            extras: list[tuple[int, int]] = []  # runs of consecutive extra tensors
            for section in S.param_order:
                if section == "layers":
                    layers = [
                        self._layer(ch.index, l, dense_layer, expert_layer) for l in ch.layers
                    ]
                elif ch is owner and sections[section]:
                    start = self.d
                    for name, shape in sections[section]:
                        self._extra(name, shape)
                    if extras and extras[-1][1] == start:
                        extras[-1] = (extras[-1][0], self.d)
                    else:
                        extras.append((start, self.d))
            units = layers[::-1]  # backward completes the top layer first
            if len(extras) == 2:  # GPT-2's order: ln_f completes in the head's backward
                units.insert(0, Unit(ch.index, -2, extras[1], (e0, e0)))
            if extras:
                units.append(Unit(ch.index, -1, extras[0], (e0, e0)))
            self.units += units
        self.dense_size, self.expert_size = self.d, self.e
        self.sp_size = sum(b - a for a, b in self.sp_ranges)

    def _extra(self, name: str, shape: tuple) -> None:
        size = math.prod(shape)
        if name == "wte":
            self.wte = (self.d, self.d + size)
        if name.startswith("ln_f"):
            self.sp_ranges.append((self.d, self.d + size))
        self.dense.append((name, shape, self.d))
        self.d += size

    def _layer(self, chunk: int, l: int, dense_layer: list, expert_layer: list) -> Unit:
        d0, e0 = self.d, self.e
        for name, shape in dense_layer:
            size = math.prod(shape)
            if name in SP_PARTIAL:
                self.sp_ranges.append((self.d, self.d + size))
            self.dense.append((f"h.{l}.{name}", shape, self.d))
            self.d += size
        for name, shape in expert_layer:
            self.expert.append((f"h.{l}.{name}", shape, self.e))
            self.e += math.prod(shape)
        return Unit(chunk, l, (d0, self.d), (e0, self.e))


def init_layer(S: Setup, l: int, seed: int, tp: int, r: int, experts: range) -> dict:
    """Layer l's tensors in full, drawn as proxies.gpt2 draws them, then rank r's shard."""
    C, L = S.cfg.n_embd, S.cfg.n_layer
    proj_std = 0.02 / math.sqrt(2 * L)
    full = layer_shapes(C)
    rng = np.random.default_rng([seed, 1, l])
    out = {}
    names = ATTN_TENSORS if S.moe else LAYER_TENSORS
    for n in names:  # the same order and stream for every tp (and GPT-2)
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
