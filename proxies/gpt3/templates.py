"""Per virtual stage, the forward and backward of one micro-batch as a list of items: the
compute pieces of model.py and the tensor-/expert-parallel collectives between them, as
Megatron-LM issues them. proxy.build_plan expands them into each rank's plan."""

from __future__ import annotations

from proxies.core.plan import Collective, Compute
from proxies.gpt3.config import Setup, layer_flops


class Templates:
    """Per virtual stage: the forward and backward of one micro-batch as items, expanded into
    ops per micro-batch (cached: every rank of a stage shares the op objects).

    Item: ("C", name, flops, done) a compute piece, `done` the layers (-1: the extra unit)
    whose gradients are final after it in a backward; ("X", kind, group, buf, count, cat)
    a blocking collective.
    """

    def __init__(self, S: Setup) -> None:
        self.S = S
        cfg, C, N, tp = S.cfg, S.cfg.n_embd, S.N, S.tp
        attn, mlp = layer_flops(cfg, S.B, S.T)
        self.f_attn, self.f_mlp = attn / tp, mlp / tp
        self.f_head = 2.0 * N * C * S.vocab / tp
        if S.moe:
            moe = S.moe
            self.f_gate = 2.0 * N * C * moe.experts
            self.f_expert = 4.0 * moe.experts * moe.capacity(N) * C * moe.ffn_hidden / tp
        self.tp_count = N * C
        self.cache: dict = {}

    def _tp(self, kind: str) -> list[tuple]:
        if self.S.tp == 1:
            return []
        return [("X", kind, "tp", "tp", self.tp_count, f"tp_{kind}")]

    def _ar(self) -> list[tuple]:
        return self._tp("allreduce")

    def _ep(self) -> list[tuple]:
        S = self.S
        if S.moe.ep == 1:
            return []
        count = S.moe.experts * S.moe.capacity(S.N) * S.cfg.n_embd
        return [("X", "alltoall", "ep", "moe", count, "ep_alltoall")]

    def forward(self, ch) -> list[tuple]:
        S, sp, items = self.S, self.S.sp, []
        if ch.embed:
            items += [("C", "fwd_embed", 0.0, ())] + self._ar()  # Megatron: allreduce also with SP
        for l in ch.layers:
            if sp:
                items += [("C", f"fwd_ln1:{l}", 0.0, ())] + self._tp("allgather")
                items += [("C", f"fwd_attn:{l}", self.f_attn, ())] + self._tp("reduce_scatter")
                items += [("C", f"fwd_ln2:{l}", 0.0, ())] + self._tp("allgather")
                items += [("C", f"fwd_mlp:{l}", self.f_mlp, ())] + self._tp("reduce_scatter")
            elif S.moe:
                items += [("C", f"fwd_attn:{l}", self.f_attn, ())] + self._ar()
                items += [("C", f"fwd_gate:{l}", self.f_gate, ())] + self._ep()
                items += [("C", f"fwd_expert:{l}", self.f_expert, ())] + self._ep()
                items += [("C", f"fwd_combine:{l}", 0.0, ())] + self._ar()
            else:
                items += [("C", f"fwd_attn:{l}", self.f_attn, ())] + self._ar()
                items += [("C", f"fwd_mlp:{l}", self.f_mlp, ())] + self._ar()
        if ch.head:
            if sp:
                items += [("C", "fwd_lnf", 0.0, ())] + self._tp("allgather")
            ce = (
                []
                if S.tp == 1
                else [("X", "allgather", "tp", "ce", S.tp * 3 * S.N, "tp_allgather")]
            )
            items += [("C", "fwd_head", self.f_head, ())] + ce + [("C", "fwd_loss", 0.0, ())]
        else:
            items.append(("C", "fwd_out", 0.0, ()))
        return items

    def backward(self, ch) -> list[tuple]:
        S, sp, items = self.S, self.S.sp, []
        if ch.head:
            items += [("C", "bwd_head", 2 * self.f_head, ())]
            items += self._tp("reduce_scatter") if sp else self._ar()
            if sp:
                items += [("C", "bwd_lnf", 0.0, ())] + self._tp("allgather")
        elif sp:
            items += [("C", "bwd_start", 0.0, ())] + self._tp("allgather")
        done: tuple = ()  # layers finished by the next compute piece
        for l in reversed(ch.layers):
            if sp:
                items += [("C", f"bwd_mlp:{l}", 2 * self.f_mlp, ())] + self._tp("reduce_scatter")
                items += [("C", f"bwd_ln2:{l}", 0.0, ())] + self._tp("allgather")
                items += [("C", f"bwd_attn:{l}", 2 * self.f_attn, ())] + self._tp("reduce_scatter")
                last = l == ch.layers[0]
                done_here = (l, -1) if last and not ch.embed else (l,)
                items += [("C", f"bwd_ln1:{l}", 0.0, done_here)]
                if not last or ch.embed:
                    items += self._tp("allgather")
                continue
            if S.moe:
                items += [("C", f"bwd_combine:{l}", 0.0, done)]
                if S.tp > 1:
                    k = S.moe.top_k
                    items += [("X", "allreduce", "tp", "moe_dscore", S.N * k, "tp_allreduce")]
                items += self._ep() + [("C", f"bwd_expert:{l}", 2 * self.f_expert, ())]
                items += self._ep() + [("C", f"bwd_gate:{l}", 2 * self.f_gate, ())] + self._ar()
            else:
                items += [("C", f"bwd_mlp:{l}", 2 * self.f_mlp, done)] + self._ar()
            items += [("C", f"bwd_attn:{l}", 2 * self.f_attn, ())] + self._ar()
            done = (l,)
        if sp:
            if ch.embed:
                items += [("C", "bwd_embed", 0.0, (-1,))]
        else:
            items += [("C", "bwd_end", 0.0, (*done, -1))]
        return items

    def ops(self, kind: str, ch, mb: int) -> tuple:
        key = (kind, ch.vstage, mb)
        out = self.cache.get(key)
        if out is None:
            items = self.forward(ch) if kind == "forward" else self.backward(ch)
            out = self.cache[key] = tuple(self._op(it, mb, ch.index) for it in items)
        return out

    @staticmethod
    def _op(item: tuple, mb: int, chunk: int):
        if item[0] == "C":
            return Compute(item[1], mb, chunk, item[2])
        _, kind, group, buf, count, cat = item
        return Collective(kind, group, buf, count, mb=mb, category=cat)
