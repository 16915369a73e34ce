"""Per virtual stage, the forward and backward of one micro-batch as a list of items: the
compute pieces of model.py and the tensor-/expert-parallel collectives between them, as
Megatron-LM issues them. proxy.build_plan expands them into each rank's plan."""

from __future__ import annotations

from proxies.core.plan import Collective, Compute
from proxies.transformer.setup import Setup, layer_flops


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
        # Sequence parallel backward splits at the re-gather of a column-parallel input:
        # qkv's backward (2 x 6BTC^2) after it, proj's and attention's before; fc's
        # (2 x 8BTC^2, half the MLP's backward) after it, fcproj's and GELU's before.
        self.f_qkv_bwd = 12.0 * S.B * S.T * C * C / tp
        self.f_head = 2.0 * N * C * S.vocab / tp
        if S.moe:
            moe = S.moe
            cap = moe.capacity(S.Ns)  # per source rank: its sequence shard under SP
            self.f_gate = 2.0 * S.Ns * C * moe.experts
            # tokens an expert gets: cap from each ep rank (and, SP, each tp rank's shard)
            sources = tp if S.sp else 1
            self.f_expert = 4.0 * moe.experts * cap * sources * C * moe.ffn_hidden / tp
            self.moe_count = moe.experts * cap * C  # one rank's dispatch buffer (E, cap, C)
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
        return [("X", "alltoall", "ep", "moe", self.moe_count, "ep_alltoall")]

    def _moe_tp(self, kind: str) -> list[tuple]:
        """MoE with sequence parallelism: the dispatched tokens of every TP rank gathered
        for the TP-sharded experts, their partial outputs reduce-scattered back."""
        n = self.S.tp * self.moe_count
        return [("X", kind, "tp", "moe_tp", n, f"tp_{kind}")]

    def _sp_layer_forward(self, l: int) -> list[tuple]:
        """Sequence parallel: AG ln1 -> attention -> RS; AG ln2 -> MLP -> RS, or the MoE
        dispatch on the shard: gate -> A2A(ep) -> AG(tp) -> experts -> RS(tp) -> A2A(ep)."""
        ag, rs = self._tp("allgather"), self._tp("reduce_scatter")
        items = [("C", f"fwd_ln1:{l}", 0.0, ())] + ag
        items += [("C", f"fwd_attn:{l}", self.f_attn, ())] + rs
        if self.S.moe:
            items += [("C", f"fwd_gate:{l}", self.f_gate, ())] + self._ep()
            items += self._moe_tp("allgather") + [("C", f"fwd_expert:{l}", self.f_expert, ())]
            items += self._moe_tp("reduce_scatter") + self._ep()
            items += [("C", f"fwd_combine:{l}", 0.0, ())]
        else:
            items += [("C", f"fwd_ln2:{l}", 0.0, ())] + ag
            items += [("C", f"fwd_mlp:{l}", self.f_mlp, ())] + rs
        return items

    def _sp_layer_backward(self, ch, l: int) -> list[tuple]:
        """Sequence parallel, Megatron's order: AG d out -> fcproj -> AG ln2 (again, for fc's
        weight gradient) -> fc -> RS -> ln2 -> AG d out -> proj, attention -> AG ln1 (again)
        -> qkv -> RS -> ln1 -> AG d out for the layer below (or the embedding). The first AG
        comes before this layer (the layer above's, or the chunk's start). MoE: the combine
        needs only the shard; then A2A(ep) -> AG(tp) -> experts -> RS(tp) -> A2A(ep)."""
        S, ag, rs = self.S, self._tp("allgather"), self._tp("reduce_scatter")
        if S.moe:
            items = [("C", f"bwd_combine:{l}", 0.0, ())] + self._ep()
            items += self._moe_tp("allgather")
            items += [("C", f"bwd_expert:{l}", 2 * self.f_expert, ())]
            items += self._moe_tp("reduce_scatter") + self._ep()
            items += [("C", f"bwd_gate:{l}", 2 * self.f_gate, ())]
        else:
            items = [("C", f"bwd_fcproj:{l}", self.f_mlp, ())] + ag
            items += [("C", f"bwd_mlp:{l}", self.f_mlp, ())] + rs
        items += [("C", f"bwd_ln2:{l}", 0.0, ())] + ag
        items += [("C", f"bwd_proj:{l}", 2 * self.f_attn - self.f_qkv_bwd, ())] + ag
        items += [("C", f"bwd_attn:{l}", self.f_qkv_bwd, ())] + rs
        last = l == ch.layers[0]
        items += [("C", f"bwd_ln1:{l}", 0.0, (l, -1) if last and not ch.embed else (l,))]
        # d out gathered for the embedding's backward, or for the next dense fcproj's
        if (last and ch.embed) or (not last and not S.moe):
            items += ag
        return items

    def forward(self, ch) -> list[tuple]:
        S, sp, items = self.S, self.S.sp, []
        if ch.embed:
            items += [("C", "fwd_embed", 0.0, ())] + self._ar()  # Megatron: allreduce also with SP
        for l in ch.layers:
            if sp:
                items += self._sp_layer_forward(l)
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
        # Sequence parallel: the d out of the top layer's fcproj is allgathered (a dense
        # MLP's row-parallel backward needs it all; the MoE combine only its shard). The LM
        # head first gathers ln_f's output again for its weight gradient.
        top_ag = self._tp("allgather") if sp and not S.moe else []
        if ch.head:
            if sp:
                items += [("C", "bwd_head_in", 0.0, ())] + self._tp("allgather")
            items += [("C", "bwd_head", 2 * self.f_head, ())]
            items += self._tp("reduce_scatter") if sp else self._ar()
            if sp:
                items += [("C", "bwd_lnf", 0.0, ())] + top_ag
        elif sp:
            items += [("C", "bwd_start", 0.0, ())] + top_ag
        done: tuple = ()  # layers finished by the next compute piece
        for l in reversed(ch.layers):
            if sp:
                items += self._sp_layer_backward(ch, l)
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
