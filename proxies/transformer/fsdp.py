"""FSDP (ZeRO-3) for the GPT family (--fsdp, --fsdp-shard-size): the units, the plan and
the runtime's sharded parameters, over the model-agnostic lowering of core/fsdp.py.

Units, per stage (one model chunk: FSDP refuses virtual stages): each transformer layer
("h.<l>"), the token embedding "wte" (its own unit, so the first and last stage, which
both hold the tied wte, shard it alike and sum the reduced shards over the embedding
group), and "extras": wpe and/or ln_f. Their ranges are the Layout's (GPT-3's order, the
extras first), per tensor-parallel rank: FSDP shards each TP shard over its dp group.

Which piece reads which unit: a layer's pieces are named "<kind>:<l>"; the embedding's and
head's pieces (fwd_embed, fwd_head, fwd_loss, bwd_head, bwd_end of the embedding chunk)
read wte and the extras. The model finishes a layer lazily in the next piece (the MLP's
bias and residual in the next layer's first forward piece, ln_1's backward in the piece
that completes the layer), so a unit stays gathered one compute piece past its last named
one. Gradients are reduce-scattered after the piece that completes the unit
(Piece.completes), only in each chunk's last micro-batch's backward: earlier micro-batches
accumulate the unsharded gradients (FSDP's no_sync), every micro-batch gathers again.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from proxies.core import pages
from proxies.core.fsdp import (
    FSDP,
    GATHER,
    REPLICA_GROUP,
    SCATTER,
    SHARD_GROUP,
    SLOTS,
    ShardUnit,
    Step,
    hsdp_groups,
    release,
)
from proxies.core.grid import ProcessGrid
from proxies.core.pipeline import pipeline_ops
from proxies.core.plan import Collective, Compute, Op, Plan
from proxies.core.schedules import SCHEDULES
from proxies.transformer.layout import Layout
from proxies.transformer.setup import Chunk, Setup

FSDP_INFLIGHT = 2  # reduce-scatters in flight at once (and the runtime's slots for them)
EXTRA_PIECES = frozenset(
    {"fwd_embed", "fwd_lnf", "fwd_head", "fwd_loss", "bwd_head_in", "bwd_head", "bwd_lnf"}
)


def shard_units(layout: Layout) -> list[tuple[ShardUnit, int, int]]:
    """(unit, lo, hi) of the stage's dense flat array, in the layout's backward order: a
    layer "h.<l>"; the extras before the layers (layer -1) as "wte" (leading) and
    "extras" (the rest); an untied LM head's unit after them (layer -2: ln_f, lm_head,
    LLaMA's) as "head"."""
    out: list[tuple[ShardUnit, int, int]] = []
    for u in layout.units:
        lo, hi = u.dense
        if u.layer >= 0:
            out.append((ShardUnit(f"h.{u.layer}", hi - lo), lo, hi))
            continue
        if u.layer == -2:  # after the layers: only an untied head reaches FSDP (LLaMA)
            out.append((ShardUnit("head", hi - lo), lo, hi))
            continue
        if layout.wte is None or layout.wte[0] != lo:
            raise ValueError("FSDP needs the extras first, wte leading (GPT-3's layout)")
        w_lo, w_hi = layout.wte
        out.append((ShardUnit("wte", w_hi - w_lo), w_lo, w_hi))
        if w_hi < hi:
            out.append((ShardUnit("extras", hi - w_hi), w_hi, hi))
    return out


# pieces that read the head's tensors (ln_f, the LM head) and the embedding's
HEAD_PIECES = EXTRA_PIECES - {"fwd_embed"}
EMBED_PIECES = frozenset({"fwd_embed", "bwd_embed"})


def unit_sides(S: Setup, keys: set[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the embedding's units, the head's) of a stage's unit keys: a tied head (GPT, BERT)
    reads the embedding's units, an untied one (LLaMA) its own."""
    extras = tuple(k for k in ("wte", "extras") if k in keys)
    return (extras, extras) if S.cfg.tied else (extras, tuple(k for k in ("head",) if k in keys))


def _units_of(
    name: str, ch: Chunk, sides: tuple[tuple[str, ...], tuple[str, ...]]
) -> tuple[str, ...]:
    """The units a piece reads. sides: (embedding's units, head's units); the same tuple
    for a tied head (GPT, BERT), whose extras every embedding or head piece reads."""
    kind, _, layer = name.partition(":")
    if layer:
        return (f"h.{layer}",)
    embed, head = sides
    if embed == head:
        if kind in EXTRA_PIECES or (kind == "bwd_end" and ch.embed):
            return embed
        return ()
    if kind in EMBED_PIECES or (kind == "bwd_end" and ch.embed):
        return embed
    return head if kind in HEAD_PIECES else ()


def pass_steps(
    items, ops: tuple[Op, ...], ch: Chunk, sides: tuple[tuple[str, ...], tuple[str, ...]]
) -> list[Step]:
    """A pass's ops as Steps: the units each piece reads (kept one compute piece past the
    last piece naming them) and completes (-1: the embedding's side, -2: an untied head's)."""
    from proxies.transformer.plan import Piece

    uses: list[set[str]] = [set() for _ in items]
    done: list[tuple[str, ...]] = [() for _ in items]
    for i, it in enumerate(items):
        if isinstance(it, Piece):
            uses[i].update(_units_of(it.name, ch, sides))
            done[i] = tuple(
                k
                for l in it.completes
                for k in (sides[0] if l == -1 else sides[1] if l < 0 else (f"h.{l}",))
            )
            uses[i].update(done[i])
    pieces = [i for i, it in enumerate(items) if isinstance(it, Piece)]
    last: dict[str, int] = {}
    for i in pieces:
        for k in uses[i]:
            last[k] = i
    for k, i in last.items():  # the next piece finishes what this one left
        nxt = next((p for p in pieces if p > i), None)
        if nxt is not None:
            uses[nxt].add(k)
    return [Step(op, tuple(sorted(uses[i])), done[i]) for i, op in enumerate(ops)]


def fsdp_plan(S: Setup, grid: ProcessGrid, rank: int, schedule: str, pieces) -> Plan:
    """One rank's FSDP iteration: the pipeline schedule, every forward and backward
    expanded into its pieces with the units' gathers, frees and (each chunk's last
    backward) reduce-scatters around them; then the replica allreduces (HSDP), the tied
    embedding's shard summed between the first and last stage, AdamW on the shards."""
    from proxies.transformer.plan import cp_place, groups

    c = grid.coords(rank)
    place = cp_place(S, grid, rank)  # context parallelism: its pieces (dp x cp shard units)
    s = c["pp"]
    chunks = S.chunks(s)
    actions = SCHEDULES[schedule](S.pp, S.m, s, S.v)
    last_mb = {a.chunk: a.mb for a in actions if a.kind == "B"}
    table = shard_units(Layout(S, s))
    sides = unit_sides(S, {u.key for u, _, _ in table})
    g = groups(S, grid, rank)
    dp = g["dp"]
    shard, replica = hsdp_groups(dp, dp.index(rank), S.fsdp)
    g[SHARD_GROUP] = shard
    if len(replica) > 1:
        g[REPLICA_GROUP] = replica
    fs = FSDP([u for u, _, _ in table], S.fsdp, len(replica), FSDP_INFLIGHT)
    steps: dict[tuple[str, int], list[Step]] = {}
    ops: list[Op] = []
    for op in pipeline_ops(actions, s, grid.group("pp", rank), S.v, S.act):
        if not isinstance(op, Compute):
            ops.append(op)
            continue
        ch = chunks[op.chunk]
        expanded = pieces.ops(op.name, ch, op.mb, place)
        key = (op.name, op.chunk)
        if key not in steps:
            if op.name == "forward":
                items = pieces.forward(ch, place)
            else:
                items = pieces.backward(ch, place)
            steps[key] = pass_steps(items, expanded, ch, sides)
        these = [Step(o, st.uses, st.completes) for o, st in zip(expanded, steps[key], strict=True)]
        ops += fs.pass_ops(these, reduce=op.name == "backward" and op.mb == last_mb[op.chunk])
    extra: list[Op] = []
    if "embed" in g:
        count = next(u for u, _, _ in table if u.key == "wte").shard(S.fsdp)
        extra.append(Collective("allreduce", "embed", "fsdp_rshard", count, mb=fs.index["wte"]))
    layout = Layout(S, s)
    if S.sp and layout.sp_size:
        # sequence parallelism: the layernorms' (and row-parallel biases') gradients are
        # partial sums over the tp ranks' sequence shards. Summing over tp commutes with the
        # reduce-scatter over dp, so the reduced shards' elements of those tensors are
        # summed over tp before AdamW (tp ranks share their dp coordinate: the same blocks)
        count = sum(
            b - a for _, a, b in sp_slices(table, layout.sp_ranges, S.fsdp, shard.index(rank))
        )
        extra += [
            Compute("fsdp_sp_pack"),
            Collective("allreduce", "tp", "fsdp_sp", count, category="tp_allreduce"),
            Compute("fsdp_sp_unpack"),
        ]
    return Plan(rank, tuple(ops + fs.end(extra)), g, c)


def sp_slices(
    table: list[tuple[ShardUnit, int, int]], sp_ranges: list[tuple[int, int]], n: int, r: int
) -> list[tuple[int, int, int]]:
    """(unit, lo, hi) of unit i's shard (block r of n) that hold sequence-parallel partial
    gradients (layout.sp_ranges, flat indexes), unit by unit, ascending."""
    out = []
    for i, (u, lo, hi) in enumerate(table):
        k = u.shard(n)
        b_lo, b_hi = lo + r * k, min(lo + (r + 1) * k, hi)
        for a, b in sorted(sp_ranges):
            a, b = max(a, b_lo), min(b, b_hi)
            if a < b:
                out.append((i, a - b_lo, b - b_lo))
    return out


def fsdp_plans(S: Setup, grid: ProcessGrid, schedule: str, pieces):
    @lru_cache(maxsize=1024)
    def plan(rank: int) -> Plan:
        return fsdp_plan(S, grid, rank, schedule, pieces)

    return plan


class ShardedParams:
    """The runtime's FSDP state of one rank (real compute): each unit's parameter shard
    (rank r of its shard group holds block r of the padded unit), its reduced gradient
    shard and AdamW moments. A unit's reduced block is saved into its gradient shard when
    its reduce-scatter slot is reused (the plan waits a slot's collective before it reuses
    the slot), when the shard is asked for (HSDP's replica allreduce, the tied
    embedding's) or at the optimizer.

    The StageShard computes on fixed views of its flat parameter and gradient arrays, which
    are private anonymous memory here (model.py, core/fsdp.py anonymous): a unit exists in
    full only while it is gathered. A unit whose size needs no padding is all-gathered
    straight into its range of the flat array (this rank's shard copied into its block
    first); a padded one (its padding would spill into a neighbour, which may be in use)
    into one of two gather slots, copied into its range by fsdp_unshard. fsdp_reshard gives
    the range's pages back to the OS (core/fsdp.py release: they read as zeros) and fills
    the partial pages at its ends with NaN, so a piece that runs without its gather, or
    with a wrong one, computes on zeros and NaN and spoils the loss. Gradients likewise: an
    unpadded unit is reduce-scattered in place in its range of the flat gradients, given
    back once its block is saved; a padded one is copied into one of two reduce-scatter
    slots and given back then (the next iteration's backward writes them afresh:
    StageShard._fresh). With several micro-batches they accumulate in full until the last
    one's reduce-scatter (FSDP's no_sync)."""

    def __init__(self, S: Setup, model, layout: Layout, shard_rank: int) -> None:
        self.S, self.model, self.n, self.r = S, model, S.fsdp, shard_rank
        self.table = [(u, lo, hi) for u, lo, hi in shard_units(layout) if u.size > 0]
        dt = model.params.dtype
        self.shards, self.grads, self.m, self.v = [], [], [], []
        for u, lo, hi in self.table:
            k = u.shard(self.n)
            block = model.params[lo:hi][self.r * k : (self.r + 1) * k]
            self.shards.append(pages.zeros(k, dt))  # allgathered from
            self.shards[-1][: block.size] = block  # the padding stays zero
            self.grads.append(pages.zeros(k, dt))  # reduce-scattered into
            for arrays in (self.m, self.v):
                arrays.append(np.zeros(k, dtype=dt))
        self.inplace = [u.padded(self.n) == u.size for u, _, _ in self.table]
        big = slot_elements([u for u, _, _ in self.table], self.n)
        self.slots = [pages.zeros(big, dt) for _ in range(SLOTS if big else 0)]
        self.rs_slots = [pages.zeros(big, dt) for _ in range(FSDP_INFLIGHT if big else 0)]
        self.slot_of: dict[int, np.ndarray] = {}  # unit -> the slot its gather went into
        self.landed: set[int] = set()  # units gathered in place, not yet unsharded
        self.rs_held: dict[int, int] = {}  # reduce-scatter slot -> unit not yet saved
        self.t = 0
        self.sp = sp_slices(self.table, layout.sp_ranges, self.n, self.r) if S.sp else []
        self.sp_buf = pages.zeros(sum(b - a for _, a, b in self.sp), dt)
        for i in range(len(self.table)):  # nothing is readable (or resident) before its gather
            self._free(i)

    def _block(self, arr: np.ndarray, i: int) -> np.ndarray:
        k = self.table[i][0].shard(self.n)
        return arr[self.r * k : (self.r + 1) * k]

    def _free(self, i: int) -> None:
        """Unit i's parameters given back: zeros, NaN on the partial pages at its ends."""
        _, lo, hi = self.table[i]
        a, b = release(self.model.params, lo, hi)
        self.model.params[lo:a] = np.nan
        self.model.params[b if b > a else lo : hi] = np.nan

    def buffer(self, name: str, i: int) -> np.ndarray:
        """The buffer a collective runs on, filled as its start needs it: the unit's range
        of the model's array or a gather slot, with this rank's shard in its block (FSDP's
        all-gather copy-in), the unit's reduce-scatter buffer with its gradients (padding
        zero), the reduced block."""
        u, lo, hi = self.table[i]
        P = u.padded(self.n)
        if name.startswith("fsdp_ag"):
            if self.inplace[i]:
                dest = self.model.params[lo:hi]
                self.landed.add(i)
            else:
                dest = self.slot_of[i] = self.slots[int(name[7:])][:P]
            self._block(dest, i)[...] = self.shards[i]
            return dest
        if name == "fsdp_sp":
            return self.sp_buf
        if name == "fsdp_rshard":
            self._save(i)
            return self.grads[i]
        if name.startswith("fsdp_rs"):
            s = int(name[7:])
            held = self.rs_held.pop(s, None)
            if held is not None:  # its reduce-scatter was waited before this one started
                self._save_from(s, held)
            if self.inplace[i]:  # reduced in place: the engine leaves block r at its place
                buf = self.model.grads[lo:hi]
            else:
                buf = self.rs_slots[s][:P]
                buf[: hi - lo] = self.model.grads[lo:hi]
                buf[hi - lo :] = 0
                release(self.model.grads, lo, hi)  # the unsharded gradients are done with
            self.rs_held[s] = i
            return buf
        raise KeyError(name)

    def _save_from(self, s: int, i: int) -> None:
        _, lo, hi = self.table[i]
        if self.inplace[i]:
            self.grads[i][...] = self._block(self.model.grads[lo:hi], i)
            release(self.model.grads, lo, hi)  # the unsharded gradients are done with
        else:
            self.grads[i][...] = self._block(self.rs_slots[s], i)

    def _save(self, i: int) -> None:
        """Unit i's reduced block into its gradient shard, if a slot still holds it."""
        for s, held in list(self.rs_held.items()):
            if held == i:
                self._save_from(s, i)
                del self.rs_held[s]

    def compute(self, name: str, i: int) -> None:
        if name in ("fsdp_sp_pack", "fsdp_sp_unpack"):
            self._sp(name == "fsdp_sp_pack")
            return
        _, lo, hi = self.table[i]
        if name.startswith("fsdp_unshard:"):
            if i in self.landed:  # gathered in place: already there
                self.landed.discard(i)
                return
            slot = self.slot_of.pop(i, None)
            # None: --compute replay times the compute ops alone, with no gather before;
            # zeros then stand in (the same kernels and shapes, finite values)
            self.model.params[lo:hi] = 0 if slot is None else slot[: hi - lo]
        elif name.startswith("fsdp_reshard:"):
            self._free(i)
        else:
            raise ValueError(f"unknown FSDP op {name!r}")

    def _sp(self, pack: bool) -> None:
        """The reduced shards' sequence-parallel elements into sp_buf (pack) or back."""
        at = 0
        for i, a, b in self.sp:
            if pack:
                self._save(i)
                self.sp_buf[at : at + b - a] = self.grads[i][a:b]
            else:
                self.grads[i][a:b] = self.sp_buf[at : at + b - a]
            at += b - a

    def step(self, lr: float, weight_decay: float) -> None:
        """AdamW on each unit's shard with its reduced gradient block (elementwise, so the
        shards together step exactly as the whole array would)."""
        self.t += 1
        adamw = self.model.k.adamw_update
        for i in range(len(self.table)):
            self._save(i)
            g = self.grads[i]
            adamw(self.shards[i], g, self.m[i], self.v[i], self.t, lr, weight_decay=weight_decay)
        self.model.zero_grad()

    @property
    def nbytes(self) -> int:
        """What this state allocates (shards, moments, slots, reduce-scatter buffers, the
        sequence-parallel sum's buffer)."""
        arrays = self.shards + self.grads + self.m + self.v + self.slots + self.rs_slots
        arrays.append(self.sp_buf)
        return sum(a.nbytes for a in arrays)


def slot_elements(units: list[ShardUnit], n: int) -> int:
    """Elements of one gather slot: the largest padded unit that cannot be gathered in place
    (0: every unit is gathered into the model's array)."""
    return max((u.padded(n) for u in units if u.padded(n) != u.size), default=0)


def resident_peaks(plan: Plan, units: list[ShardUnit], n: int, m: int) -> tuple[int, int]:
    """Elements of the most gathered parameters and of the most unsharded gradients one rank
    holds at once, walking its plan as ShardedParams runs it: a unit's parameters from its
    gather's start to its reshard; with one micro-batch its gradients from the unshard that
    precedes its reduce-scatter (the backward that writes them) until they are given back:
    a padded unit's at its reduce-scatter's start, an unpadded one's when its reduced block
    is saved (the next reduce-scatter on its slot, its shard's allreduce, the optimizer);
    with several micro-batches (no_sync) all of them all along."""
    live: dict[int, int] = {}
    gathered = 0
    unshard: dict[int, int] = {}
    start: dict[int, int] = {}  # unit -> the op its gradients appear at
    held: dict[str, int] = {}  # reduce-scatter slot -> unit whose block it holds
    grads: list[tuple[int, int, int]] = []  # (from op, to op, elements)

    def save(key: int, t: int) -> None:
        if key in start:
            grads.append((start.pop(key), t, units[key].size))

    for t, op in enumerate(plan.ops):
        if isinstance(op, Collective) and op.category == GATHER:
            live[op.mb] = units[op.mb].padded(n)
            gathered = max(gathered, sum(live.values()))
        elif isinstance(op, Collective) and op.category == SCATTER:
            if op.buf in held:
                save(held.pop(op.buf), t)
            start[op.mb] = unshard[op.mb]
            if units[op.mb].padded(n) != units[op.mb].size:
                save(op.mb, t)
            else:
                held[op.buf] = op.mb
        elif isinstance(op, Collective) and op.buf == "fsdp_rshard":
            save(op.mb, t)
        elif isinstance(op, Compute) and op.name.startswith("fsdp_reshard:"):
            live.pop(op.mb)
        elif isinstance(op, Compute) and op.name.startswith("fsdp_unshard:"):
            unshard[op.mb] = t
        elif isinstance(op, Compute) and op.name == "optimizer":
            for key in list(start):
                save(key, t)
    if m > 1:
        return gathered, sum(u.size for u in units)
    events = sorted([(a, k) for a, _, k in grads] + [(b, -k) for _, b, k in grads])
    now = peak = 0
    for _, k in events:  # at one op, what is given back goes before what appears
        now += k
        peak = max(peak, now)
    return gathered, peak


def fsdp_text(S: Setup) -> str:
    """The gradient sync, as the headers word it."""
    dp, over = S.dp * S.cp, f"dp {S.dp}" + (f" x cp {S.cp}" if S.cp > 1 else "")
    if S.fsdp == dp:
        return f"FSDP (ZeRO-3) over {over}"
    return f"HSDP: sharded over {S.fsdp} ranks, replicated over {dp // S.fsdp}"
