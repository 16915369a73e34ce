"""The runtime of one GPT rank (GPT-2 and GPT-3 alike): the buffers the engine sends and the
compute it runs, over a StageShard (model.py) for real compute, over a BufferPool for
compute model/none (no parameters: every message a view into a few reusable arrays).

Buffers by the names the plans give them (transformer/plan.py):
- pipeline messages "act_in", "act_out", "grad_out", "grad_in" per (micro-batch, chunk);
- GPT-2: the flat gradients "grads" (fused, ZeRO-1's reduce-scatter), a bucket
  Span("grads", lo, hi), one tensor's "grad:<name>" (per-tensor, the tied "grad:wte"), and
  "params" (ZeRO-1's allgather); offsets as config.stage_layout (Setup.param_order);
- GPT-3: bucket k of the dense / expert gradients ("dpgrad" | "edpgrad", k), "wte_grad", and
  the tensor-/expert-parallel buffers "tp", "ce", "moe", "moe_tp", "moe_dscore", "sp_grads";
- context parallelism: "cp_kv", "cp_dkv" (allgather), the ring's "cp_kv_out" ... "cp_dkv_in",
  "cp_qkv", "cp_out" (alltoall): the StageShard's (cpshard.py cp_buffer).

With --cp, each cp rank reads the same samples as the others of its replica, the columns at
its positions (cp.positions); its loss is its tokens' mean, the gradient scaled by 1/cp more
(the weight gradients are summed over dp x cp), and the reported loss, the mean over the
ranks that report one, is the whole sequence's.

Compute: GPT-3's pieces ("fwd_attn:3" ...), "sp_pack", "sp_unpack"; GPT-2's whole-stage
"forward", "backward", "backward:<piece>" (whole.py); "optimizer": AdamW (ZeRO-1: on this
rank's block of the flat gradients, Setup.zero).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from proxies.core import pages
from proxies.core.plan import P2P, Collective, Compute, Plan, Span, block_range
from proxies.transformer.data import batch
from proxies.transformer.layout import Layout
from proxies.transformer.plan import reductions
from proxies.transformer.setup import Setup


class BufferPool:
    """Reusable buffers for compute model/none: no parameters, every message a view into a
    few arrays, each sized by the largest message that uses it (found in the plan):
    one per pipeline direction, one for all blocking collectives (they never overlap), and
    one per in-flight gradient bucket (the plan waits before reusing one; inflight 0: one
    per bucket)."""

    P2P_SLOTS = ("act_in", "act_out", "grad_out", "grad_in")

    def __init__(self, plan: Plan, inflight: int):
        self.slot_of: dict[tuple[Any, int], str] = {}
        size: dict[str, int] = defaultdict(int)
        self.p2p = set(self.P2P_SLOTS)  # and the context-parallel ring's (cp_kv_in ...)
        posted = 0
        for op in plan.ops:
            if isinstance(op, P2P):
                for msg in op.sends + op.recvs:
                    size[msg.buf] = max(size[msg.buf], msg.count)
                    self.p2p.add(msg.buf)
            elif isinstance(op, Collective):
                if isinstance(op.buf, str) and op.buf.startswith("fsdp"):
                    # FSDP (core/fsdp.py): its gather and reduce-scatter slots are named;
                    # each unit's reduced shard is its own (held until the optimizer)
                    slot = f"{op.buf}{op.mb}" if op.buf == "fsdp_rshard" else op.buf
                    self.slot_of[(op.buf, op.mb)] = slot
                    size[slot] = max(size[slot], op.count)
                    continue
                if op.req:
                    slot = f"grad{posted % inflight if inflight else posted}"
                    posted += 1
                else:
                    slot = "grad0" if op.buf == "wte_grad" else "coll"
                self.slot_of[(op.buf, op.mb)] = slot
                size[slot] = max(size[slot], op.count)
        self.size = dict(size)
        self.arrays: dict[str, np.ndarray] = {}

    @property
    def nbytes(self) -> int:
        return 4 * sum(self.size.values())

    def slot(self, name, mb: int) -> str:
        """The array a message or collective on (name, micro-batch) uses."""
        return name if name in self.p2p else self.slot_of[(name, mb)]

    def get(self, name, mb: int, count: int | None = None) -> np.ndarray:
        slot = self.slot(name, mb)
        arr = self.arrays.get(slot)
        if arr is None:  # zeros: pages appear as messages touch them
            arr = self.arrays[slot] = pages.zeros(self.size[slot], np.float32)
        return arr if count is None else arr[:count]


class Runtime:
    """Buffers and compute of one rank: a StageShard for real/replay compute, a BufferPool
    for model/none. dp_rank: the rank's replica (its samples; ZeRO-1's block)."""

    Shard: type | None = None  # the real compute's class: model.StageShard unless set (BERT)

    def __init__(
        self,
        S: Setup,
        plan: Plan,
        stage: int,
        tp_rank: int,
        ep_rank: int,
        dp_rank: int,
        source,
        mode: str,
    ):
        self.S, self.plan, self.dp_rank, self.source = S, plan, dp_rank, source
        self.counts = {(op.buf, op.mb): op.count for op in plan.ops if isinstance(op, Collective)}
        # the context-parallel ring's messages (the pipeline's are S.act)
        self.counts.update({(m.buf, m.mb): m.count for _, m, _ in plan.messages()})
        self.model = self.pool = self.fsdp = None
        self.layout = Layout(S, stage)
        self.tensors = {n: (o, o + int(np.prod(s))) for n, s, o in self.layout.dense}
        self.ranges: dict[tuple[str, int], tuple[int, int]] = {}  # GPT-3's buckets, on demand
        # ZeRO-1: AdamW on this rank's block of the flat buffer (the plan reduce-scatters
        # the gradients into it and allgathers the parameters from it).
        self.part = None
        if S.zero and S.dp > 1:
            self.part = slice(*block_range(self.layout.dense_size, S.dp, dp_rank))
        if mode in ("real", "replay"):
            from proxies.transformer.model import StageShard

            if S.cfg.gated:  # LLaMA's layer (llama_model.py)
                from proxies.transformer.llama_model import LlamaShard as StageShard

            cp_rank = plan.coords.get("cp", 0)
            self.model = (self.Shard or StageShard)(
                S, stage, tp_rank, ep_rank, seed=S.seed, cp_rank=cp_rank
            )
            # the DP (x CP) sum: the global mean's gradient
            self.model.loss_scale = 1.0 / (S.m * S.dp * S.cp)
            self.model.batch = self._batch
            if S.fsdp:  # ZeRO-3: the shards, gathered into the model per unit (fsdp.py)
                from proxies.transformer.fsdp import ShardedParams

                shard = plan.groups["fsdp"]  # dp (x cp) ranks, HSDP's consecutive N of them
                self.fsdp = ShardedParams(S, self.model, self.layout, shard.index(plan.rank))
        else:
            self.pool = BufferPool(plan, S.inflight)
        self.iteration = 0
        self.loss_sum, self.loss_count = 0.0, 0

    def buffer(self, name, mb: int, chunk: int) -> np.ndarray:
        model = self.model
        if model is None:
            count = self.S.act if name in BufferPool.P2P_SLOTS else self.counts[(name, mb)]
            return self.pool.get(name, mb, count)
        if self.fsdp is not None and isinstance(name, str) and name.startswith("fsdp"):
            return self.fsdp.buffer(name, mb)
        if isinstance(name, Span):  # a GPT-2 bucket: a flat range of the gradients
            return model.grads[name.lo : name.hi]
        if name in BufferPool.P2P_SLOTS:
            return model.message(name, mb, chunk)
        if name in ("grads", "params"):
            return model.grads if name == "grads" else model.params
        if name.startswith("grad:"):  # one parameter tensor's gradient, e.g. "grad:wte"
            lo, hi = self.tensors[name[5:]]
            return model.grads[lo:hi]
        if name in ("dpgrad", "edpgrad"):
            lo, hi = self._bucket(name, mb)
            return (model.grads if name == "dpgrad" else model.egrads)[lo:hi]
        if name.startswith("cp_"):
            return model.cp_buffer(name)
        if name == "wte_grad":
            lo, hi = self.layout.wte
            return model.grads[lo:hi]
        return {
            "tp": model.tp_buf,
            "ce": model.ce_buf,
            "moe": model.moe_buf,
            "moe_tp": model.moe_all,
            "moe_dscore": model.dscore_buf,
            "sp_grads": model.sp_buf,
        }[name]

    def _bucket(self, name: str, k: int) -> tuple[int, int]:
        """GPT-3's bucket k: the range of the dense / expert gradients its units cover."""
        if not self.ranges:
            for i, (_, units, _) in enumerate(reductions(self.S, self.layout)):
                lo_d, hi_d = min(u.dense[0] for u in units), max(u.dense[1] for u in units)
                lo_e, hi_e = min(u.expert[0] for u in units), max(u.expert[1] for u in units)
                self.ranges[("dpgrad", i)] = (lo_d, hi_d)
                self.ranges[("edpgrad", i)] = (lo_e, hi_e)
        return self.ranges[(name, k)]

    def _batch(self, mb: int):
        S = self.S
        g = (self.iteration * S.dp + self.dp_rank) * S.m * S.B + mb * S.B
        tokens, targets = batch(self.source, g, S.B)
        if S.cp > 1:  # this cp rank's tokens of the samples
            pos = self.model.pos
            return np.ascontiguousarray(tokens[:, pos]), np.ascontiguousarray(targets[:, pos])
        return tokens, targets

    def _loss(self, loss: float | None) -> None:
        if loss is not None:
            self.loss_sum += loss
            self.loss_count += 1

    def compute(self, op: Compute, iteration: int) -> None:
        model, name = self.model, op.name
        self.iteration = iteration
        if self.fsdp is not None and (name == "optimizer" or name.startswith("fsdp_")):
            if name == "optimizer":
                self.fsdp.step(self.S.lr, self.S.weight_decay)
            else:
                self.fsdp.compute(name, op.mb)
        elif name == "optimizer":
            model.step(self.S.lr, self.S.weight_decay, self.part)
        elif name == "forward":
            self._loss(model.forward(op.mb, op.chunk))
        elif name == "backward":
            model.backward(op.mb, op.chunk)
        elif name.startswith("backward:"):  # one GPT-2 piece, e.g. "backward:h.3"
            model.backward_piece(name[9:], op.mb, op.chunk)
        elif name == "sp_pack":
            model.sp_pack()
        elif name == "sp_unpack":
            model.sp_unpack()
        else:
            self._loss(model.compute(name, op.mb, op.chunk))

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        out = (self.loss_sum, self.loss_count)
        self.loss_sum, self.loss_count = 0.0, 0
        return out
