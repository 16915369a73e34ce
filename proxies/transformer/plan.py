"""The GPT plans, written once: per virtual stage the forward and backward of one
micro-batch as typed pieces (the compute pieces of model.py and the tensor-/expert-parallel
collectives between them, as Megatron-LM issues them), each rank's plan built from them
(GPT-3's pieces of the tensor-parallel StageShard; GPT-2's whole stages, whole.py), and the
gradient sync lowered by core/grads.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from proxies.core.grads import Flat, GradSync, Unit
from proxies.core.grid import ProcessGrid
from proxies.core.pipeline import pipeline_ops
from proxies.core.plan import P2P, Collective, Compute, Msg, Op, Plan, Wait
from proxies.core.schedules import SCHEDULES
from proxies.transformer import cp as cpmod
from proxies.transformer.config import GPT2Config, backward_pieces, stage_flops, stage_layout
from proxies.transformer.layout import Layout
from proxies.transformer.layout import Unit as LayoutUnit
from proxies.transformer.setup import Setup, layer_flops


@dataclass(frozen=True)
class Piece:
    """A piece of compute between two collectives: `completes` the layers (-1: the extra
    unit, embedding/head tensors) whose gradients are final after it in a backward."""

    name: str
    flops: float
    completes: tuple[int, ...] = ()


Item = Piece | Collective | P2P | Wait
# A rank's place in its context-parallel group: (cp rank, world rank of cp rank - 1, of + 1);
# None without context parallelism.
CPPlace = tuple[int, int, int] | None


class Pieces:
    """Per virtual stage: the forward and backward of one micro-batch as items (a Piece of
    compute, or a blocking Collective whose micro-batch ops() fills in), expanded into ops
    per micro-batch (cached: every rank of a stage shares the op objects)."""

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
        if S.cp > 1:
            self._cp_flops()
        self.cache: dict = {}

    def _cp_flops(self) -> None:
        """Context parallel: each rank's pieces on its B * T / cp tokens; the attention core
        split into the qkv and output projections around it, and the core's FLOPs (QK^T and
        AV of the whole sequence, as layer_flops counts them) shared out by the split's
        causal work between query and key blocks (cpmod.work_shares)."""
        S, C, tp, Nc = self.S, self.S.cfg.n_embd, self.S.tp, self.S.Nc
        self.f_qkv, self.f_proj = 6.0 * Nc * C * C / tp, 2.0 * Nc * C * C / tp
        self.f_core = 4.0 * S.B * S.T * S.T * C / tp
        self.f_mlp = 16.0 * Nc * C * C / tp
        self.f_qkv_bwd = 2 * self.f_qkv
        self.f_head = 2.0 * Nc * C * S.vocab / tp
        self.shares = cpmod.work_shares(S.T, S.cp, S.cp_split)
        self.tp_count = Nc * C
        self.kv = S.B * S.Tc * 2 * C // tp  # one rank's keys and values (B, T/cp, 2C/tp)

    # -- context parallelism: the attention core and what it exchanges over cp ----------

    def _ring(self, place: CPPlace, name: str, count: int, req: str) -> P2P:
        """One ring step: `count` floats to cp rank + 1, as many from cp rank - 1, posted
        non-blocking as `req` (ops() adds the micro-batch), completed by Wait(req)."""
        _, prev, nxt = place
        return P2P(
            "cp_ring",
            sends=(Msg(nxt, cpmod.RING_TAG, f"{name}_out", 0, count),),
            recvs=(Msg(prev, cpmod.RING_TAG, f"{name}_in", 0, count),),
            category="cp",
            req=req,
        )

    def _cp_forward(self, l: int, place: CPPlace) -> list[Item]:
        """qkv -> [cp exchange] -> attention core -> [cp exchange] -> output projection."""
        S, r, n = self.S, place[0], self.S.cp
        qkv, proj = Piece(f"fwd_qkv:{l}", self.f_qkv), Piece(f"fwd_proj:{l}", self.f_proj)
        work = self.f_core * self.shares[r]  # per key block
        if S.cp_comm == "allgather":
            ag = Collective("allgather", "cp", "cp_kv", n * self.kv, category="cp_allgather")
            return [qkv, ag, Piece(f"fwd_core:{l}", work.sum()), proj]
        if S.cp_comm == "alltoall":
            # Ulysses: (B, T/n, 3C/tp) sequence shards -> (B, T, 3C/(tp n)) head shards and
            # the core's output back; every rank then has all T tokens of its heads, so the
            # causal work is the same on every rank whatever the split.
            C = S.cfg.n_embd // S.tp
            return [
                qkv,
                Collective("alltoall", "cp", "cp_qkv", S.Nc * 3 * C, category="cp_alltoall"),
                Piece(f"fwd_core:{l}", self.f_core / n),
                Collective("alltoall", "cp", "cp_out", S.Nc * C, category="cp_alltoall"),
                proj,
            ]
        # ring: step s computes the key/value block of cp rank r - s; the exchange that
        # brings the next block is posted (non-blocking) before the current block's
        # computation and waited after it (TE's order), so it runs under that computation.
        items: list[Item] = [qkv]
        for s in range(n):
            req = f"cp_ring:{l}:f{s}"
            if s < n - 1:
                items.append(self._ring(place, "cp_kv", self.kv, req))
            items.append(Piece(f"fwd_core{s}:{l}", work[(r - s) % n]))
            if s < n - 1:
                items.append(Wait(req))
        return items + [proj]

    def _cp_backward(self, l: int, place: CPPlace) -> list[Item]:
        """The output projection's backward, the core's with its cp exchanges; the qkv
        projection's backward is the caller's (sequence parallelism gathers before it)."""
        S, r, n = self.S, place[0], self.S.cp
        items: list[Item] = [Piece(f"bwd_proj:{l}", 2 * self.f_proj)]
        work = 2 * self.f_core * self.shares[r]
        if S.cp_comm == "allgather":
            # the gathered keys and values are kept from the forward; their gradients are
            # partial sums on every rank whose queries saw them
            items.append(Piece(f"bwd_core:{l}", work.sum()))
            whole = n * self.kv
            if S.cp_reduce == "allreduce":
                return items + [
                    Collective("allreduce", "cp", "cp_dkv", whole, category="cp_allreduce")
                ]
            if S.cp_reduce == "reduce-scatter":
                return items + [
                    Collective(
                        "reduce_scatter", "cp", "cp_dkv", whole, category="cp_reduce_scatter"
                    )
                ]
            return items + [
                Collective("reduce", f"cp_r{i}", "cp_dkv", self.kv, category="cp_reduce")
                for i in cpmod.reduce_groups(n, S.cp_split, r)
            ]
        if S.cp_comm == "alltoall":
            C = S.cfg.n_embd // S.tp
            return items + [
                Collective("alltoall", "cp", "cp_out", S.Nc * C, category="cp_alltoall"),
                Piece(f"bwd_core:{l}", 2 * self.f_core / n),
                Collective("alltoall", "cp", "cp_qkv", S.Nc * 3 * C, category="cp_alltoall"),
            ]
        # ring, as TransformerEngine's AttnFuncWithCPAndKVP2P.backward: n exchanges, the
        # first the key/value block only, the last the key/value gradient accumulator only,
        # the others both in one message. Step i (< n-1) computes the block of cp rank
        # r-i-1 and its gradient accumulator travels on with it, one step behind, so the
        # owner receives its finished dk/dv at the last exchange and adds its own
        # (diagonal) block, computed last. Each exchange is posted before step i's block
        # computation and waited after it, so it runs under that computation.
        for i in range(n):
            kv, dkv = i < n - 1, i > 0
            name = "cp_kvdkv" if kv and dkv else "cp_kv" if kv else "cp_dkv"
            req = f"cp_ring:{l}:b{i}"
            items.append(self._ring(place, name, (kv + dkv) * self.kv, req))
            src = (r - i - 1) % n if i < n - 1 else r
            items.append(Piece(f"bwd_core{i}:{l}", work[src]))
            items.append(Wait(req))
        return items

    def _attn_forward(self, l: int, place: CPPlace) -> list[Item]:
        if place is None:
            return [Piece(f"fwd_attn:{l}", self.f_attn, ())]
        return self._cp_forward(l, place)

    def _tp(self, kind: str) -> list[Item]:
        if self.S.tp == 1:
            return []
        return [Collective(kind, "tp", "tp", self.tp_count, category=f"tp_{kind}")]

    def _ar(self) -> list[Item]:
        return self._tp("allreduce")

    def _ep(self) -> list[Item]:
        S = self.S
        if S.moe.ep == 1:
            return []
        return [Collective("alltoall", "ep", "moe", self.moe_count, category="ep_alltoall")]

    def _moe_tp(self, kind: str) -> list[Item]:
        """MoE with sequence parallelism: the dispatched tokens of every TP rank gathered
        for the TP-sharded experts, their partial outputs reduce-scattered back."""
        n = self.S.tp * self.moe_count
        return [Collective(kind, "tp", "moe_tp", n, category=f"tp_{kind}")]

    def _sp_layer_forward(self, l: int, place: CPPlace) -> list[Item]:
        """Sequence parallel: AG ln1 -> attention -> RS; AG ln2 -> MLP -> RS, or the MoE
        dispatch on the shard: gate -> A2A(ep) -> AG(tp) -> experts -> RS(tp) -> A2A(ep)."""
        ag, rs = self._tp("allgather"), self._tp("reduce_scatter")
        items = [Piece(f"fwd_ln1:{l}", 0.0, ())] + ag
        items += self._attn_forward(l, place) + rs
        if self.S.moe:
            items += [Piece(f"fwd_gate:{l}", self.f_gate, ())] + self._ep()
            items += self._moe_tp("allgather") + [Piece(f"fwd_expert:{l}", self.f_expert, ())]
            items += self._moe_tp("reduce_scatter") + self._ep()
            items += [Piece(f"fwd_combine:{l}", 0.0, ())]
        else:
            items += [Piece(f"fwd_ln2:{l}", 0.0, ())] + ag
            items += [Piece(f"fwd_mlp:{l}", self.f_mlp, ())] + rs
        return items

    def _sp_layer_backward(self, ch, l: int, place: CPPlace) -> list[Item]:
        """Sequence parallel, Megatron's order: AG d out -> fcproj -> AG ln2 (again, for fc's
        weight gradient) -> fc -> RS -> ln2 -> AG d out -> proj, attention -> AG ln1 (again)
        -> qkv -> RS -> ln1 -> AG d out for the layer below (or the embedding). The first AG
        comes before this layer (the layer above's, or the chunk's start). MoE: the combine
        needs only the shard; then A2A(ep) -> AG(tp) -> experts -> RS(tp) -> A2A(ep)."""
        S, ag, rs = self.S, self._tp("allgather"), self._tp("reduce_scatter")
        if S.moe:
            items = [Piece(f"bwd_combine:{l}", 0.0, ())] + self._ep()
            items += self._moe_tp("allgather")
            items += [Piece(f"bwd_expert:{l}", 2 * self.f_expert, ())]
            items += self._moe_tp("reduce_scatter") + self._ep()
            items += [Piece(f"bwd_gate:{l}", 2 * self.f_gate, ())]
        else:
            items = [Piece(f"bwd_fcproj:{l}", self.f_mlp, ())] + ag
            items += [Piece(f"bwd_mlp:{l}", self.f_mlp, ())] + rs
        items += [Piece(f"bwd_ln2:{l}", 0.0, ())] + ag
        if place is None:
            items += [Piece(f"bwd_proj:{l}", 2 * self.f_attn - self.f_qkv_bwd, ())] + ag
        else:
            items += self._cp_backward(l, place) + ag
        items += [Piece(f"bwd_attn:{l}", self.f_qkv_bwd, ())] + rs
        last = l == ch.layers[0]
        items += [Piece(f"bwd_ln1:{l}", 0.0, (l, -1) if last and not ch.embed else (l,))]
        # d out gathered for the embedding's backward, or for the next dense fcproj's
        if (last and ch.embed) or (not last and not S.moe):
            items += ag
        return items

    def forward(self, ch, place: CPPlace = None) -> list[Item]:
        S, sp, items = self.S, self.S.sp, []
        if ch.embed:
            items += [Piece("fwd_embed", 0.0, ())] + self._ar()  # Megatron: allreduce also with SP
        for l in ch.layers:
            if sp:
                items += self._sp_layer_forward(l, place)
            elif S.moe:
                items += [Piece(f"fwd_attn:{l}", self.f_attn, ())] + self._ar()
                items += [Piece(f"fwd_gate:{l}", self.f_gate, ())] + self._ep()
                items += [Piece(f"fwd_expert:{l}", self.f_expert, ())] + self._ep()
                items += [Piece(f"fwd_combine:{l}", 0.0, ())] + self._ar()
            else:
                items += self._attn_forward(l, place) + self._ar()
                items += [Piece(f"fwd_mlp:{l}", self.f_mlp, ())] + self._ar()
        if ch.head:
            if sp:
                items += [Piece("fwd_lnf", 0.0, ())] + self._tp("allgather")
            ce = (
                []
                if S.tp == 1
                else [Collective("allgather", "tp", "ce", S.tp * 3 * S.Nc, category="tp_allgather")]
            )
            items += [Piece("fwd_head", self.f_head, ())] + ce + [Piece("fwd_loss", 0.0, ())]
        else:
            items.append(Piece("fwd_out", 0.0, ()))
        return items

    def backward(self, ch, place: CPPlace = None) -> list[Item]:
        S, sp, items = self.S, self.S.sp, []
        # Sequence parallel: the d out of the top layer's fcproj is allgathered (a dense
        # MLP's row-parallel backward needs it all; the MoE combine only its shard). The LM
        # head first gathers ln_f's output again for its weight gradient.
        top_ag = self._tp("allgather") if sp and not S.moe else []
        if ch.head:
            if sp:
                items += [Piece("bwd_head_in", 0.0, ())] + self._tp("allgather")
            items += [Piece("bwd_head", 2 * self.f_head, ())]
            items += self._tp("reduce_scatter") if sp else self._ar()
            if sp:
                items += [Piece("bwd_lnf", 0.0, ())] + top_ag
        elif sp:
            items += [Piece("bwd_start", 0.0, ())] + top_ag
        done: tuple[int, ...] = ()  # layers finished by the next compute piece
        for l in reversed(ch.layers):
            if sp:
                items += self._sp_layer_backward(ch, l, place)
                continue
            if S.moe:
                items += [Piece(f"bwd_combine:{l}", 0.0, done)]
                if S.tp > 1:
                    k = S.moe.top_k
                    items += [
                        Collective(
                            "allreduce", "tp", "moe_dscore", S.N * k, category="tp_allreduce"
                        )
                    ]
                items += self._ep() + [Piece(f"bwd_expert:{l}", 2 * self.f_expert, ())]
                items += self._ep() + [Piece(f"bwd_gate:{l}", 2 * self.f_gate, ())] + self._ar()
            else:
                items += [Piece(f"bwd_mlp:{l}", 2 * self.f_mlp, done)] + self._ar()
            if place is None:
                items += [Piece(f"bwd_attn:{l}", 2 * self.f_attn, ())] + self._ar()
            else:
                items += self._cp_backward(l, place)
                items += [Piece(f"bwd_qkv:{l}", 2 * self.f_qkv, ())] + self._ar()
            done = (l,)
        if sp:
            if ch.embed:
                items += [Piece("bwd_embed", 0.0, (-1,))]
        else:
            items += [Piece("bwd_end", 0.0, (*done, -1))]
        return items

    def ops(self, kind: str, ch, mb: int, place: CPPlace = None) -> tuple[Op, ...]:
        key = (kind, ch.vstage, mb, place)
        out = self.cache.get(key)
        if out is None:
            items = self.forward(ch, place) if kind == "forward" else self.backward(ch, place)
            out = self.cache[key] = tuple(self._op(it, mb, ch.index) for it in items)
        return out

    @staticmethod
    def _op(item: Item, mb: int, chunk: int) -> Op:
        if isinstance(item, Piece):
            return Compute(item.name, mb, chunk, item.flops)
        if isinstance(item, P2P):
            return replace(
                item,
                sends=tuple(replace(m, mb=mb, chunk=chunk) for m in item.sends),
                recvs=tuple(replace(m, mb=mb, chunk=chunk) for m in item.recvs),
                req=f"{item.req}:{mb}" if item.req else "",
            )
        if isinstance(item, Wait):
            return replace(item, req=f"{item.req}:{mb}")
        return replace(item, mb=mb)


# ----------------------------------------------------------------------------------------
# GPT-3: the tensor-parallel stage shard


def grad_sync(S: Setup, layout: Layout) -> GradSync:
    """Megatron's overlapped gradient reduction: buckets of whole layers (units) of one
    chunk, dense gradients over dp, expert gradients over edp, at most S.inflight in
    flight; each bucket's buffer is ("dpgrad" | "edpgrad", bucket index)."""
    edp = S.dp // S.moe.ep if S.moe else 1
    flats = []
    if S.dp * S.cp > 1:  # the "dp" group holds the dp x cp ranks of a shard (groups())
        flats.append(Flat("dpgrad", "dp", layout.dense_size, span=False))
    if edp > 1:
        flats.append(Flat("edpgrad", "edp", layout.expert_size, span=False))
    units = [
        Unit(
            (u.chunk, u.layer),
            tuple(r for r in (("dpgrad", *u.dense), ("edpgrad", *u.expert)) if r[2] > r[1]),
            u.chunk,
        )
        for u in layout.units
    ]
    return GradSync("buckets", flats, units, S.bucket, S.inflight)


def reductions(S: Setup, layout: Layout) -> list[tuple[int, list[LayoutUnit], list[Collective]]]:
    """Per bucket: (chunk, layout units, its non-blocking allreduces: dense over dp, experts
    over edp). The runtime reads each bucket's range of the flat arrays from the units."""
    sync = grad_sync(S, layout)
    units = {(u.chunk, u.layer): u for u in layout.units}
    out = []
    for k, b in enumerate(sync.buckets):
        out.append((b.units[0].segment, [units[u.key] for u in b.units], sync.bucket_ops(k)))
    return out


def groups(S: Setup, grid: ProcessGrid, rank: int) -> dict[str, tuple[int, ...]]:
    c = grid.coords(rank)
    pp_ranks = grid.group("pp", rank)
    out = {"pp": pp_ranks, "tp": grid.group("tp", rank)}
    if S.moe:
        # data parallel = every rank with this (tp, pp): the ep x edp block
        out["dp"] = tuple(
            grid.rank_of(**{**c, "ep": e, "dp": d})
            for d in range(grid.degree("dp"))
            for e in range(S.moe.ep)
        )
        out["ep"] = grid.group("ep", rank)
        out["edp"] = grid.group("dp", rank)
    elif S.cp > 1:
        # weight gradients are reduced over cp together with dp: one group of every rank
        # with this (tp, pp), Megatron's data-parallel group "with context parallel"
        out["dp"] = tuple(
            sorted(
                grid.rank_of(**{**c, "cp": k, "dp": d})
                for d in range(grid.degree("dp"))
                for k in range(S.cp)
            )
        )
    else:
        out["dp"] = grid.group("dp", rank)
    if S.cp > 1:
        cp = out["cp"] = grid.group("cp", rank)
        if S.cp_comm == "allgather" and S.cp_reduce == "reduce":
            for i in cpmod.reduce_groups(S.cp, S.cp_split, c["cp"]):
                out[f"cp_r{i}"] = tuple(cp[j] for j in cpmod.reduce_group(S.cp, S.cp_split, i))
    if S.pp > 1 and c["pp"] in (0, S.pp - 1) and not S.layers_only:
        out["embed"] = (pp_ranks[0], pp_ranks[-1])
    return out


def cp_place(S: Setup, grid: ProcessGrid, rank: int) -> CPPlace:
    """(cp rank, world ranks of the previous and next cp rank), or None without cp."""
    if S.cp == 1:
        return None
    g, r = grid.group("cp", rank), grid.coords(rank)["cp"]
    return r, g[(r - 1) % S.cp], g[(r + 1) % S.cp]


def gpt3_plan(S: Setup, grid: ProcessGrid, rank: int, schedule: str, pieces: Pieces) -> Plan:
    """One rank's iteration: the pipeline schedule, every forward and backward expanded into
    its pieces and tensor-/expert-parallel collectives; during each chunk's last backward
    the gradient buckets its pieces complete; then the tied embedding, the sequence-parallel
    layernorm gradients over TP, AdamW."""
    c = grid.coords(rank)
    s = c["pp"]
    chunks = S.chunks(s)
    actions = SCHEDULES[schedule](S.pp, S.m, s, S.v)
    last_mb = {a.chunk: a.mb for a in actions if a.kind == "B"}
    layout = Layout(S, s)
    sync = grad_sync(S, layout)
    place = cp_place(S, grid, rank)
    ops: list[Op] = []
    for op in pipeline_ops(actions, s, grid.group("pp", rank), S.v, S.act):
        if not isinstance(op, Compute):
            ops.append(op)
            continue
        ch = chunks[op.chunk]
        expanded = pieces.ops(op.name, ch, op.mb, place)
        if op.name != "backward" or op.mb != last_mb[op.chunk]:
            ops.extend(expanded)
            continue
        # the last backward of this chunk: post each bucket once its layers are done
        for it, o in zip(pieces.backward(ch, place), expanded, strict=True):
            ops.append(o)
            if isinstance(it, Piece) and it.completes:
                ops += sync.after((op.chunk, layer) for layer in it.completes)
    g = groups(S, grid, rank)
    extra: list[Op] = []
    if "embed" in g:
        extra.append(Collective("allreduce", "embed", "wte_grad", S.vocab // S.tp * S.cfg.n_embd))
    if S.sp and layout.sp_size:
        extra += [
            Compute("sp_pack"),
            Collective("allreduce", "tp", "sp_grads", layout.sp_size, category="tp_allreduce"),
            Compute("sp_unpack"),
        ]
    return Plan(rank, tuple(ops + sync.end(extra)), g, c)


def gpt3_plans(S: Setup, grid: ProcessGrid, schedule: str):
    """plan(rank), cached (the dry run and the runtime ask for the same plans again)."""
    pieces = Pieces(S)
    if S.fsdp:  # FSDP / ZeRO-3: gathers and reduce-scatters per unit (fsdp.py)
        from proxies.transformer.fsdp import fsdp_plans

        return fsdp_plans(S, grid, schedule, pieces)

    @lru_cache(maxsize=1024)
    def plan(rank: int) -> Plan:
        return gpt3_plan(S, grid, rank, schedule, pieces)

    return plan


# ----------------------------------------------------------------------------------------
# GPT-2: whole stages (StageShard's whole.py), pipeline x data parallelism


def gpt2_sync(
    cfg: GPT2Config, layers: range, first: bool, last: bool, dp: int, policy: str, bucket: float
) -> GradSync:
    """GPT-2's data-parallel gradient sync of one stage: the flat buffer "grads" over dp;
    buckets of whole backward pieces (config.backward_pieces), each contiguous range one
    allreduce keyed Span("grads", lo, hi); per tensor "grad:<name>"; ZeRO-1 "params"."""
    layout = stage_layout(cfg, layers, first, last)
    n = sum(math.prod(shape) for _, shape, _ in layout)
    tensors = tuple((f"grad:{name}", math.prod(shape)) for name, shape, _ in layout)
    flats = [Flat("grads", "dp", n, tensors=tensors)] if dp > 1 else []
    units = [
        Unit(i, tuple(("grads", lo, hi) for lo, hi in rs))
        for i, (_, rs) in enumerate(backward_pieces(cfg, layers, first, last))
    ]
    return GradSync(policy, flats, units, bucket)


def gpt2_ops(
    ops: list[Op],
    sync: GradSync,
    last_mb: int,
    cfg: GPT2Config,
    layers: range,
    first: bool,
    last: bool,
    B: int,
    T: int,
) -> list[Op]:
    """`ops` with micro-batch last_mb's backward cut into its pieces, each followed by the
    non-blocking allreduces of the buckets it completes. Each piece's flops are twice its
    forward's (the LM head's, a layer's; the encoder's none), so the pieces add up to the
    unsplit backward."""
    pieces = backward_pieces(cfg, layers, first, last)
    flops = {"head": 2 * stage_flops(cfg, range(0), True, B, T), "embed": 0.0}
    layer = 2 * stage_flops(cfg, range(1), False, B, T)
    out: list[Op] = []
    for op in ops:
        if not (isinstance(op, Compute) and op.name == "backward" and op.mb == last_mb):
            out.append(op)
            continue
        for i, (name, _) in enumerate(pieces):
            out.append(Compute(f"backward:{name}", op.mb, op.chunk, flops.get(name, layer)))
            out += sync.after((i,))
    return out


def gpt2_plan(S: Setup, grid: ProcessGrid, rank: int) -> Plan:
    """One rank's iteration: the pipeline schedule (whole-stage forwards and backwards),
    the gradient sync (buckets overlapping the last micro-batch's backward), the tied
    embedding's allreduce between the first and last stage (Megatron's embedding group,
    before ZeRO-1's reduce-scatter: its shards split wte), AdamW."""
    cfg, split, B, T, pp, dp = S.cfg, S.split, S.B, S.T, S.pp, S.dp
    c = grid.coords(rank)
    s = c["pp"]
    first, last = s == 0, s == pp - 1
    pp_ranks = grid.group("pp", rank)
    g = {"pp": pp_ranks, "dp": grid.group("dp", rank)}
    fwd = stage_flops(cfg, split[s], last, B, T)
    actions = SCHEDULES[S.schedule](pp, S.m, s)
    ops = pipeline_ops(
        actions,
        s,
        pp_ranks,
        1,
        S.act,
        flops=lambda kind, chunk: fwd if kind == "forward" else 2 * fwd,
    )
    sync = gpt2_sync(cfg, split[s], first, last, dp, S.sync, S.bucket)
    if sync.overlaps:
        last_mb = [a.mb for a in actions if a.kind == "B"][-1]
        ops = gpt2_ops(ops, sync, last_mb, cfg, split[s], first, last, B, T)
    extra: list[Op] = []
    if pp > 1 and (first or last):
        g["embed"] = (pp_ranks[0], pp_ranks[-1])
        extra.append(Collective("allreduce", "embed", "grad:wte", cfg.vocab_size * cfg.n_embd))
    return Plan(rank, tuple(ops + sync.end(extra)), g, c)
