"""Context-parallel pieces of StageShard (model.py): each of the cp ranks holds T/cp tokens
of every sequence (cp.positions of --cp-split) and runs the plan's pieces on them.

Every piece outside attention works on the rank's tokens unchanged: StageShard runs on a
Setup whose T is T/cp (the shapes B x T/cp); the embedding adds wpe at each token's TRUE
position and scatters wpe's gradient back to those rows; the data are the samples' columns
at those positions (runtime.py). Attention is the plan's (plan.py _cp_forward / _cp_backward):

    fwd_qkv -> [exchange] -> fwd_core (ring: fwd_core0..n-1) -> [exchange] -> fwd_proj
    bwd_proj -> [exchange] -> bwd_core (ring: bwd_core0..n-1) -> [exchange] -> bwd_qkv
    (sequence parallel: bwd_attn, StageShard's, after the re-gather of ln1)

with the cp_kernels.py kernels of the family (--cp-comm):
- allgather: fwd_qkv packs this rank's k|v into its block of "cp_kv" (the allgather fills
  the others); fwd_core places them in global order (kept for the backward) and runs the
  rank's queries against them; bwd_core leaves every token's partial dk|dv in "cp_dkv",
  block r for rank r, which the plan reduces (allreduce, reduce-scatter, or one reduce per
  root: the runtime hands out block i for the reduce rooted at i, in the plan's order);
  bwd_qkv adds block r to the q gradient.
- ring: kv blocks go round in two buffers (the one sent, the one received; a piece's end
  swaps them: the next exchange sends what the last one received). Forward step s computes
  the block of cp rank r-s and merges (log-sum-exp); the block of r-1 is kept for the
  backward. Backward step i < n-1 computes the block of r-i-1 (received one step before,
  or kept) into a local dk|dv; the next exchange sends it, plus the accumulator received
  with the block (added when the runtime hands out the send buffer: the plan posts the
  exchange straight after the previous wait, with no compute between), so the owner gets
  every other rank's sum at the last exchange and adds its own (diagonal) block, computed
  last. The messages are the plan's: kv, kv|dkv ..., dkv.
- alltoall (Ulysses): qkv to head shards ("cp_qkv"), unsplit causal attention over the
  whole sequence of NH/(tp cp) heads (placed in global order), back to sequence shards
  ("cp_out"); the backward the same way in reverse.
"""

from __future__ import annotations

import numpy as np

from proxies.transformer import cp as cpsplit
from proxies.transformer import cp_kernels as ck
from proxies.transformer.setup import Chunk, Setup
from proxies.transformer.state import ChunkActs, LayerActs

# the plan's cp piece kinds (the ring's numbered: fwd_core3 -> fwd_core, step 3)
PIECES = ("fwd_qkv", "fwd_core", "fwd_proj", "bwd_proj", "bwd_core", "bwd_qkv")


class ContextParallelPieces:
    """Mixed into StageShard. `cp_init` sets it up (cp = None without context parallelism);
    `_cp_piece` runs a cp piece; `cp_buffer` gives the runtime the cp messages' buffers."""

    def cp_init(self, S: Setup, cp_rank: int) -> None:
        """S: the whole-sequence Setup (self.S is the rank's, T/cp tokens)."""
        self.cp = S.cp if S.cp > 1 else None
        if self.cp is None:
            return
        self.cpS, self.cp_rank = S, cp_rank
        self.cp_pos = cpsplit.positions(S.cp_split, S.cp, S.T)
        self.pos = self.cp_pos[cp_rank]
        n, B, Tl, C, tp = S.cp, S.B, S.Tc, S.cfg.n_embd, S.tp
        self.kvW = 2 * S.cfg.kv_width // tp  # a token's k|v on this tp rank (GQA: KVH heads)
        self.cp_kvh = S.cfg.kv_heads // tp  # key/value heads on this tp rank
        self.cp_outw = C // tp // n  # Ulysses: a head shard's attention output per token
        # Ulysses' qkv parts when k, v are narrower than q (GQA), else three equal ones
        kvw = S.cfg.kv_width // tp
        self.cp_widths = None if kvw == C // tp else (C // tp, kvw, kvw)
        kv = B * Tl * self.kvW
        z = np.zeros
        self._cpbuf: dict[str, np.ndarray] = {}
        if S.cp_comm == "allgather":
            self._cpbuf["cp_kv"] = z(n * kv, self.dtype)
            self._cpbuf["cp_dkv"] = z(n * kv, self.dtype)
            self._roots = cpsplit.reduce_groups(n, S.cp_split, cp_rank)
            self._next_root = 0
        elif S.cp_comm == "ring":
            # [kv | dkv] each; a message uses the kv part, both, or the dkv part
            self._ringbuf = [z(2 * kv, self.dtype), z(2 * kv, self.dtype)]
            self._cur = 0
            self._pending: np.ndarray | None = None  # local dk|dv to add at the next send
            self._pending_first = False
        else:
            self._cpbuf["cp_qkv"] = z(B * Tl * S.cfg.qkv_rows // tp, self.dtype)
            self._cpbuf["cp_out"] = z(B * Tl * C // tp, self.dtype)

    # ------------------------------------------------------------------------------------
    # buffers

    def cp_buffer(self, name: str) -> np.ndarray:
        """The array a cp message names (plan.py): flat, the plan's count."""
        if self.cpS.cp_comm != "ring":
            buf = self._cpbuf[name]
            if name == "cp_dkv" and self.cpS.cp_reduce == "reduce":
                # one reduce per root, issued in self._roots' order: root i reduces block i
                i = self._roots[self._next_root % len(self._roots)]
                self._next_root += 1
                return self._blocks_of(buf)[i].reshape(-1)
            return buf
        kvn = self._ringbuf[0].size // 2
        base, _, side = name.rpartition("_")
        arr = self._ringbuf[self._cur if side == "out" else 1 - self._cur]
        if side == "out" and base != "cp_kv" and self._pending is not None:
            self._ring_add(arr[kvn:])
        lo, hi = {"cp_kv": (0, kvn), "cp_kvdkv": (0, 2 * kvn), "cp_dkv": (kvn, 2 * kvn)}[base]
        return arr[lo:hi]

    def _blocks_of(self, flat: np.ndarray, width: int | None = None) -> np.ndarray:
        """flat as (n,B,Tl,width) blocks, block j for / from cp rank j (width: k|v's)."""
        S = self.cpS
        return flat.reshape(S.cp, S.B, S.Tc, width or self.kvW)

    def _ring_add(self, acc: np.ndarray) -> None:
        """The send side of a backward exchange: acc (the accumulator received with the
        block, or nothing yet) += this rank's dk|dv of that block."""
        if self._pending_first:
            acc[...] = self._pending.reshape(-1)
        else:
            acc += self._pending.reshape(-1)
        self._pending = None

    def _ring_kv(self) -> np.ndarray:
        """The k|v block held now (B,Tl,2C/tp): the last exchange's."""
        S = self.S
        return self._ringbuf[self._cur][: self._ringbuf[0].size // 2].reshape(S.B, S.T, -1)

    # ------------------------------------------------------------------------------------
    # saved state

    def _cp_alloc(self, a: LayerActs) -> None:
        """A layer's cp state: the gathered k|v (allgather), the kept block of r-1 and the
        log-sum-exp (ring), the head-sharded qkv of the whole sequence (alltoall)."""
        S, Tl = self.cpS, self.S.T
        B, T, tp = S.B, S.T, S.tp
        e = np.empty
        if S.cp_comm == "allgather":
            a.kv = e((B, T, self.kvW), self.dtype)
            a.att = e(ck.att_size(self.pos, B, self.NHl), self.dtype)
        elif S.cp_comm == "ring":
            a.kv = e((B, Tl, self.kvW), self.dtype)
            a.lse = e((B, self.NHl, Tl), self.dtype)
            a.att = e(0, self.dtype)
        else:
            a.kv = e((B, T, S.cfg.qkv_rows // tp // S.cp), self.dtype)
            a.att = e((B, self.NHl // S.cp, T, T), self.dtype)

    # ------------------------------------------------------------------------------------
    # dispatch

    def _cp_piece(self, kind: str, st: ChunkActs, ch: Chunk, mb: int, l: int) -> bool:
        """Run cp piece `kind` (False: not one); ring steps carry their number."""
        base = kind.rstrip("0123456789")
        if base not in PIECES:
            return False
        step = int(kind[len(base) :]) if len(kind) > len(base) else 0
        getattr(self, "_cp_" + base)(st, ch, mb, l, step)
        return True

    # ------------------------------------------------------------------------------------
    # forward

    def _cp_fwd_qkv(self, st: ChunkActs, ch: Chunk, mb: int, l: int, step: int) -> None:
        """ln1 (unless sequence parallel did it) and the qkv projection of this rank's
        tokens; then what the exchange sends."""
        a, w, p = st.layers[l], self.w, f"h.{l}."
        if self.S.sp:
            ln1 = self._gathered("input")
        else:
            a.inp = self._layer_input(st, ch, mb, l)
            ln1 = a.ln1
            self.k.layernorm_forward(
                ln1, a.ln1_mean, a.ln1_rstd, a.inp, w[p + "ln_1.weight"], w[p + "ln_1.bias"]
            )
        self.k.matmul_forward(a.qkv, ln1, w[p + "attn.c_attn.weight"], w[p + "attn.c_attn.bias"])
        self._cp_rotate(a.qkv)
        comm = self.cpS.cp_comm
        if comm == "allgather":
            ck.kv_pack(self._blocks_of(self._cpbuf["cp_kv"])[self.cp_rank], a.qkv)
        elif comm == "ring":
            ck.kv_pack(self._ring_kv(), a.qkv)
        else:
            W = a.qkv.shape[-1] // self.cp
            blocks = self._blocks_of(self._cpbuf["cp_qkv"], W)
            ck.ulysses_pack(blocks, a.qkv, self.cp, 3, self.cp_widths)

    def _cp_fwd_core(self, st: ChunkActs, ch: Chunk, mb: int, l: int, step: int) -> None:
        a, comm, NH = st.layers[l], self.cpS.cp_comm, self.NHl
        if comm == "allgather":
            ck.place(a.kv, self._blocks_of(self._cpbuf["cp_kv"]), self.cp_pos)
            ck.allgather_forward(a.atty, a.att, a.qkv, a.kv, self.pos, NH, KVH=self.cp_kvh)
        elif comm == "ring":
            src = (self.cp_rank - step) % self.cp
            kv, kpos = self._ring_kv(), self.cp_pos[src]
            if step == 0:
                ck.ring_forward_block(a.atty, a.lse, a.qkv, self.pos, kv, kpos, NH, KVH=self.cp_kvh)
            else:
                out_b = self.scratch("cp_out_b", *a.atty.shape)
                lse_b = self.scratch("cp_lse_b", *a.lse.shape)
                if ck.ring_forward_block(
                    out_b, lse_b, a.qkv, self.pos, kv, kpos, NH, KVH=self.cp_kvh
                ):
                    ck.ring_merge(a.atty, a.lse, out_b, lse_b)
                if step == 1:
                    a.kv[...] = kv  # the block of r-1: the backward's first
            self._cur = 1 - self._cur  # the next exchange sends what this one receives
        else:
            S, n = self.cpS, self.cp
            W = a.kv.shape[-1]
            ck.place(a.kv, self._blocks_of(self._cpbuf["cp_qkv"], W), self.cp_pos)
            y = self.scratch("cp_y", S.B, S.T, self.cp_outw)
            self.k.attention_forward(y, a.att, a.kv, NH // n)
            ck.take(self._blocks_of(self._cpbuf["cp_out"], self.cp_outw), y, self.cp_pos)

    def _cp_fwd_proj(self, st: ChunkActs, ch: Chunk, mb: int, l: int, step: int) -> None:
        """The output projection (row-parallel: a partial sum for the TP reduction)."""
        a = st.layers[l]
        if self.cpS.cp_comm == "alltoall":
            W = a.atty.shape[-1] // self.cp
            ck.ulysses_unpack(a.atty, self._blocks_of(self._cpbuf["cp_out"], W), 1)
        out = self._partial_out()
        self.k.matmul_forward(out, a.atty, self.w[f"h.{l}.attn.c_proj.weight"], None)
        if self.S.sp:
            self._scatter(out)

    # ------------------------------------------------------------------------------------
    # backward

    def _cp_bwd_proj(self, st: ChunkActs, ch: Chunk, mb: int, l: int, step: int) -> None:
        """The output projection's backward into the scratch datty (sequence parallel: on
        the gathered output gradient, then ln1's shard for qkv's re-gather)."""
        S, a, w, g, p = self.S, st.layers[l], self.w, self.g, f"h.{l}.attn."
        if S.sp:
            dout = self._gathered("dout")
        else:
            self._finish_ln2(st, l)
            dout = st.dres
        self._bias_backward(p + "c_proj.bias", st.dres)
        datty = self.scratch("datty", *a.atty.shape)
        wn = p + "c_proj.weight"
        self.k.matmul_backward(datty, g[wn], None, dout, a.atty, w[wn], True, self._fresh(wn))
        if S.sp:
            self._share(a.ln1)
        comm = self.cpS.cp_comm
        if comm == "ring":
            delta = self.scratch("cp_delta", *a.lse.shape)
            ck.ring_delta(delta, datty, a.atty, self.NHl)
            self._ring_kv()[...] = a.kv  # the block of r-1, sent on at the first exchange
        elif comm == "alltoall":
            W = datty.shape[-1] // self.cp
            ck.ulysses_pack(self._blocks_of(self._cpbuf["cp_out"], W), datty, self.cp, 1)

    def _cp_bwd_core(self, st: ChunkActs, ch: Chunk, mb: int, l: int, step: int) -> None:
        S, a, comm, NH = self.cpS, st.layers[l], self.cpS.cp_comm, self.NHl
        datty = self.scratch("datty", *a.atty.shape)
        dqkv = self.scratch("dqkv", *a.qkv.shape)
        if comm == "allgather":
            dkv = self.scratch("cp_dkv_all", *a.kv.shape)
            ck.allgather_backward(
                dqkv, dkv, datty, a.qkv, a.kv, a.att, self.pos, NH, fresh=True, KVH=self.cp_kvh
            )
            ck.take(self._blocks_of(self._cpbuf["cp_dkv"]), dkv, self.cp_pos)
            self._next_root = 0
        elif comm == "ring":
            n, r = self.cp, self.cp_rank
            delta = self.scratch("cp_delta", *a.lse.shape)
            if step < n - 1:  # the block of r-step-1: its dk|dv goes on at the next exchange
                src, kv = (r - step - 1) % n, self._ring_kv()
                local = self.scratch("cp_dkv_local", *kv.shape)
                self._pending, self._pending_first = local, step == 0
            else:  # this rank's own block, last
                src, kv = r, np.ascontiguousarray(a.qkv[..., a.qkv.shape[-1] - self.kvW :])
                local = self.scratch("cp_dkv_own", *kv.shape)
            ck.ring_backward_block(
                dqkv, local, datty, a.qkv, self.pos, kv, self.cp_pos[src], a.lse, delta, NH,
                dq_fresh=step == 0, fresh=True, KVH=self.cp_kvh,
            )  # fmt: skip
            self._cur = 1 - self._cur
        else:
            W = a.kv.shape[-1]
            dy = self.scratch("cp_y", S.B, S.T, self.cp_outw)
            ck.place(dy, self._blocks_of(self._cpbuf["cp_out"], self.cp_outw), self.cp_pos)
            dfull = self.scratch("cp_dqkv_full", *a.kv.shape)
            self.k.attention_backward(dfull, dy, a.kv, a.att, NH // self.cp, fresh=True)
            ck.take(self._blocks_of(self._cpbuf["cp_qkv"], W), dfull, self.cp_pos)

    def _cp_dqkv(self, st: ChunkActs, l: int) -> None:
        """The scratch dqkv completed with what the last exchange brought: this rank's
        tokens' summed dk|dv (allgather, ring), or every head's dqkv (alltoall)."""
        a, comm = st.layers[l], self.cpS.cp_comm
        dqkv = self.scratch("dqkv", *a.qkv.shape)
        if comm == "allgather":
            ck.kv_unpack_add(dqkv, self._blocks_of(self._cpbuf["cp_dkv"])[self.cp_rank], True)
        elif comm == "ring":
            own = self.scratch("cp_dkv_own", *dqkv.shape[:2], self.kvW)
            ck.kv_unpack_add(dqkv, own, True)
            ck.kv_unpack_add(dqkv, self._ring_acc(dqkv.shape[:2]))
        else:
            W = dqkv.shape[-1] // self.cp
            ck.ulysses_unpack(dqkv, self._blocks_of(self._cpbuf["cp_qkv"], W), 3, self.cp_widths)
        self._cp_rotate_back(dqkv)

    def _cp_rotate(self, qkv: np.ndarray) -> None:
        """Rotary embeddings on this rank's q and k at their true positions (LLaMA's shard,
        llama_model.py); GPT's position embedding is added at the input: nothing here."""

    def _cp_rotate_back(self, dqkv: np.ndarray) -> None:
        """The rotation's backward on the complete dq and dk (LLaMA's shard)."""

    def _ring_acc(self, shape: tuple[int, int]) -> np.ndarray:
        """The accumulator the last backward exchange brought: the other ranks' dk|dv of
        this rank's block."""
        kvn = self._ringbuf[0].size // 2
        return self._ringbuf[self._cur][kvn:].reshape(*shape, self.kvW)

    def _cp_bwd_qkv(self, st: ChunkActs, ch: Chunk, mb: int, l: int, step: int) -> None:
        """The qkv projection's backward: partial dln1 into tp_buf for the TP allreduce."""
        self._cp_dqkv(st, l)
        self._attn_in_backward(st, l, st.layers[l].ln1, self._full())

    def _cp_sp_bwd_attn(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """Sequence parallel: the qkv backward on the re-gathered ln1 (sp.py's)."""
        self._cp_dqkv(st, l)
        self._sp_bwd_attn(st, ch, mb, l)

    def _embed_backward(self, st: ChunkActs, ch: Chunk, mb: int, d: np.ndarray) -> None:
        """With cp: wpe's gradient scattered to this rank's positions; wte's rows as the
        tensor-parallel embedding does (head.py). Else head.py's."""
        if self.cp is None:
            return super()._embed_backward(st, ch, mb, d)
        g, C = self.g, self.S.cfg.n_embd
        if self._fresh("wpe"):
            g["wpe"].fill(0)
        g["wpe"][self.pos] += d.sum(axis=0)  # positions are distinct: no add.at needed
        if self._fresh("wte"):
            g["wte"].fill(0)
        local = st.tokens.reshape(-1) - self.lo
        mask = (local >= 0) & (local < self.valid)
        np.add.at(g["wte"], local[mask], d.reshape(-1, C)[mask])
        self._free(mb, ch.index)
