"""Per-rank memory of a GPT rank (gpt2 and gpt3), from the shapes its runtime allocates
(runtime.py; core/memory.py adds MPI's scratch, wire staging and the interpreter).

Real/replay compute (model.StageShard): the tensor-parallel shard of the stage's dense and
expert parameters, their gradients and AdamW moments (of this rank's block only under
ZeRO-1), one saved state per (micro-batch, chunk) in flight in the schedule, the backward's
scratch, the collective buffers and one buffer per pipeline message. MoE's per-piece
temporaries (moe.py) are not modelled beyond the dispatch buffers. Model/none compute: the
BufferPool of the plan (no parameters; for GPT-3 twice the largest message, not the
gradients; GPT-2's buckets are not limited in flight, each one its own buffer).

Context parallelism (cpshard.py): every activation is of the rank's T/cp tokens, and the
attention core's state is the family's: the gathered k|v and the blocks' softmax
(allgather), one kept k|v block and the log-sum-exp (ring), the whole sequence's
head-sharded qkv and softmax (alltoall); the cp messages' buffers are added.
"""

from __future__ import annotations

from dataclasses import replace

from proxies.core import memory
from proxies.core.plan import Collective, Plan, block_range
from proxies.core.schedules import SCHEDULES
from proxies.transformer import cp as cpsplit
from proxies.transformer import cp_kernels, fast
from proxies.transformer.kernels import CLASSIFIER_CHUNK
from proxies.transformer.layout import Layout
from proxies.transformer.runtime import BufferPool
from proxies.transformer.setup import Chunk, Setup

F32 = 4


def keeps_logits(S: Setup) -> bool:
    """StageShard.keeps_logits: the head keeps its slice's (N, V/tp) probabilities."""
    return S.N * (S.vocab // S.tp) * F32 <= fast.DLOGITS_BUDGET


def saved_state(S: Setup, ch: Chunk) -> int:
    """Bytes of StageShard._alloc for one chunk: its input and residual gradient, per layer
    the sequence-shard (B,Ts,*: ln1, res2, ln2, res3 and 4 statistics) and full-sequence
    (B,T,*/tp: qkv, atty, and fch, fch_gelu of a dense MLP) tensors, the local heads'
    softmax, the head's statistics, and its kept probabilities and max (N, V/tp + 1)."""
    B, T, Ts, C, tp, cfg = S.B, S.T, S.Ts, S.cfg.n_embd, S.tp, S.cfg
    stats = 1 if cfg.rmsnorm else 2  # per norm and token: rstd (and mean)
    layer = B * (4 * Ts * C + 2 * stats * Ts + T * cfg.qkv_rows // tp + T * C // tp)
    layer += B * (S.cfg.n_head // tp) * T * T
    if not S.moe:  # fch and its activation: 4C/tp each, or SwiGLU's 2F/tp and F/tp
        layer += B * T * cfg.mlp_mats * cfg.mlp_hidden // tp
    head = B * (Ts * C + stats * Ts + T) if ch.head else 0
    if ch.head and keeps_logits(S):
        head += S.N * (S.vocab // tp + 1)
    return F32 * (2 * B * Ts * C + len(ch.layers) * layer + head)


def weight_temps(S: Setup, head: bool) -> int:
    """Elements of the kernels' kept weight-gradient temporaries (fast.dw_temp_elems): one
    per weight shard shape."""
    C, tp, cfg = S.cfg.n_embd, S.tp, S.cfg
    shapes = {(cfg.qkv_rows // tp, C), (C, C // tp)}
    F = (S.moe.ffn_hidden if S.moe else cfg.mlp_hidden) // tp
    shapes |= {(2 * F if cfg.gated else F, C), (C, F)}  # fc (SwiGLU: [gate; up]), fcproj
    if head:
        shapes.add((S.vocab // tp, C))
    return sum(fast.dw_temp_elems(shape) for shape in shapes)


def live_states(S: Setup, stage: int) -> list[int]:
    """The most (micro-batch, chunk) states in flight at once, per chunk (interleaved
    schedules hold different counts of each chunk)."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in SCHEDULES[S.schedule](S.pp, S.m, stage, S.v):
        live[a.chunk] = live.get(a.chunk, 0) + (1 if a.kind == "F" else -1)
        peak[a.chunk] = max(peak.get(a.chunk, 0), live[a.chunk])
    return [peak.get(c, 0) for c in range(S.v)]


def cp_parts(S: Setup, stage: int) -> tuple[int, int, int]:
    """Context parallelism, elements: (per layer: the family's attention state in place of
    the (B, NH/tp, T/cp, T/cp) softmax; the backward's score gradient likewise; the cp
    buffers). Sized for the largest rank's (the contiguous split's last)."""
    B, T, n, C, tp = S.B, S.T, S.cp, S.cfg.n_embd, S.tp
    # a token's k|v: 2C/tp, GQA's 2 KVH hs / tp
    Tl, NHl, kvw = S.Tc, S.cfg.n_head // tp, 2 * S.cfg.kv_width // tp
    kv = B * Tl * kvw
    if S.cp_comm == "allgather":
        att = max(cp_kernels.att_size(p, B, NHl) for p in cpsplit.positions(S.cp_split, n, T))
        scores = B * NHl * cp_kernels.BLOCK_Q * T  # one block's (dP) at a time
        return B * T * kvw + att, scores + B * T * kvw, 2 * n * kv
    if S.cp_comm == "ring":
        return kv + B * NHl * Tl, B * NHl * Tl * Tl + 2 * kv + 2 * B * Tl * C // tp, 4 * kv
    W = S.cfg.qkv_rows  # 3C; GQA's (NH + 2 KVH) hs
    att = B * (NHl // n) * T * T + B * T * W // tp // n
    return att, B * (NHl // n) * T * T + B * T * (W + C) // tp // n, B * Tl * (W + C) // tp


def real_parts(S: Setup, stage: int, dp_rank: int = 0, plan: Plan | None = None) -> dict[str, int]:
    if S.cp > 1:  # the rank's T/cp tokens, the attention core's state replaced
        Sl = replace(S, T=S.Tc, cp=1)
        parts = real_parts(Sl, stage, dp_rank, plan)  # FSDP: the plan's gathered units
        layer, work, bufs = cp_parts(S, stage)
        B, NHl, Tl = S.B, S.cfg.n_head // S.tp, S.Tc
        layers = sum(
            k * len(ch.layers)
            for k, ch in zip(live_states(S, stage), S.chunks(stage), strict=False)
        )
        parts["activations"] += F32 * layers * (layer - B * NHl * Tl * Tl)
        parts["workspace"] += F32 * (work - B * NHl * Tl * Tl)
        parts["buffers"] += F32 * bufs
        return parts
    lay = Layout(S, stage)
    n = lay.dense_size + lay.expert_size
    held = n  # AdamW's moments: of everything, or (ZeRO-1) of this rank's dense block
    if S.zero and S.dp > 1:
        lo, hi = block_range(lay.dense_size, S.dp, dp_rank)
        held = hi - lo
    chunks = S.chunks(stage)
    counts = live_states(S, stage)
    acts = sum(k * saved_state(S, ch) for k, ch in zip(counts, chunks, strict=False))
    B, T, C, tp = S.B, S.T, S.cfg.n_embd, S.tp
    # backward scratch (dfch, dfch_gelu, datty, dqkv, partial), the attention backward's
    # score gradient (B, NH/tp, T, T), and the head's logit chunk when it does not keep them
    cfg = S.cfg
    mlp = cfg.mlp_mats * cfg.mlp_hidden // tp  # 8C/tp; SwiGLU's d[gate; up] and dact 3F/tp
    work = B * T * (mlp + C // tp + cfg.qkv_rows // tp + (C if S.sp else 0))
    work += B * (S.cfg.n_head // tp) * T * T
    if any(ch.head for ch in chunks) and not keeps_logits(S):
        rows = max(1, min(S.N, CLASSIFIER_CHUNK // max(1, S.vocab // tp)))
        work += rows * (S.vocab // tp)
    work += weight_temps(S, any(ch.head for ch in chunks))
    moe = S.moe
    dispatch = (tp if S.sp else 1) * moe.experts * moe.capacity(S.Ns) * C if moe else 0
    bufs = S.N * C + tp * 3 * S.N + dispatch + (lay.sp_size if S.sp else 0)
    if S.fsdp:
        return {**fsdp_parts(S, lay, plan), "activations": acts, "workspace": F32 * work,
                "blas": memory.blas_workspace(), "buffers": F32 * bufs}  # fmt: skip
    return {
        "parameters": F32 * n,
        "gradients": F32 * n,
        "optimizer": 2 * F32 * held,
        "activations": acts,
        "workspace": F32 * work,
        "blas": memory.blas_workspace(),
        "buffers": F32 * bufs,
    }


def fsdp_parts(S: Setup, lay: Layout, plan: Plan) -> dict[str, int]:
    """FSDP (transformer/fsdp.py ShardedParams), bytes, from the units and the rank's plan:
    parameters are this rank's shards (1/n of the padded units) and the most units gathered
    at once (fsdp.resident_peaks: the one in use, the one prefetched and the one the model
    finishes in the next piece, so up to three layers, and the embedding's units for a
    whole pass where the stage holds them); gradients the unsharded ones resident at once
    (one micro-batch: those of the units between their backward and the save of their
    reduced block; several: all of them, no_sync) and the reduced shards; AdamW's moments
    of the shards. Units whose size is not a multiple of n (padded) add two gather slots
    and two reduce-scatter slots of the largest such."""
    from proxies.transformer.fsdp import (
        FSDP_INFLIGHT,
        SLOTS,
        resident_peaks,
        shard_units,
        slot_elements,
    )

    units = [u for u, _, _ in shard_units(lay) if u.size]
    shards = sum(u.shard(S.fsdp) for u in units)
    slot = slot_elements(units, S.fsdp)
    gathered, grads = resident_peaks(plan, units, S.fsdp, S.m)
    # sequence parallelism: the shards' layernorm elements packed for their tp sum
    sp = sum(op.count for op in plan.ops if isinstance(op, Collective) and op.buf == "fsdp_sp")
    return {
        "parameters": F32 * (shards + gathered + SLOTS * slot),
        "gradients": F32 * (grads + shards + FSDP_INFLIGHT * slot + sp),
        "optimizer": 2 * F32 * shards,
    }


def estimate(S: Setup, stage: int, dp_rank: int, mode: str, plan: Plan) -> dict[str, int]:
    """Bytes per part of one rank of `stage` (replica dp_rank) under --compute `mode`."""
    if mode in ("real", "replay"):
        parts = real_parts(S, stage, dp_rank, plan)
        # StageShard.message, one per key; the sent activation is the saved layer output
        parts["buffers"] += memory.p2p_buffers(plan, ("act_in", "grad_out", "grad_in"))
        return memory.complete(parts, plan)
    return memory.complete({"buffers": BufferPool(plan, S.inflight).nbytes}, plan)
