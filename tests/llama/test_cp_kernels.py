"""Context-parallel attention with grouped-query heads (cp_kernels.py's KVH, Ulysses'
widths): N ranks simulated in one process, every family at every split gives the unsplit
GQA attention's out and dqkv (llama_kernels.gqa_*) to 1e-5 relative; k,v travel at
2 KVH hs per token, Ulysses' head shards hold NH/N query and KVH/N kv heads."""

from __future__ import annotations

import numpy as np
import pytest

from proxies.transformer import cp
from proxies.transformer import cp_kernels as K
from proxies.transformer import llama_kernels as LK

B, T, NH, KVH, hs = 2, 32, 4, 2, 4
C, KV = NH * hs, 2 * KVH * hs  # q width, a token's k|v
W = C + KV


def r(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


def close(name: str, got, want) -> None:
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= 1e-5, f"{name}: relative error {err:.3g}"


def assemble(parts, pos) -> np.ndarray:
    whole = np.empty((B, T, parts[0].shape[-1]), parts[0].dtype)
    for p, x in zip(pos, parts, strict=True):
        whole[:, p] = x
    return whole


def kv_blocks(local):
    out = []
    for x in local:
        out.append(np.empty((B, x.shape[1], KV), x.dtype))
        assert K.kv_pack(out[-1], x) == B * x.shape[1] * KV
    return out


def run_allgather(local, douts, pos):
    N, Tl = len(pos), T // len(pos)
    kv = np.empty((B, T, KV), np.float32)
    K.place(kv, np.stack(kv_blocks(local)), pos)
    outs, dqkvs, sends = [], [], []
    for i in range(N):
        out = np.empty((B, Tl, C), np.float32)
        att = np.empty(K.att_size(pos[i], B, NH, 3), np.float32)
        K.allgather_forward(out, att, local[i], kv, pos[i], NH, 3, KVH=KVH)
        dqkv, dkv = np.empty_like(local[i]), np.empty((B, T, KV), np.float32)
        K.allgather_backward(dqkv, dkv, douts[i], local[i], kv, att, pos[i], NH, 3, True, KVH)
        send = np.empty((N, B, Tl, KV), np.float32)
        K.take(send, dkv, pos)
        outs.append(out)
        dqkvs.append(dqkv)
        sends.append(send)
    for i in range(N):
        K.kv_unpack_add(dqkvs[i], sum(s[i] for s in sends), fresh=True)
    return outs, dqkvs


def run_ring(local, douts, pos):
    N = len(pos)
    kvs = kv_blocks(local)
    outs, lses = [], []
    for i in range(N):
        out, lse = np.empty((B, T // N, C), np.float32), np.empty((B, NH, T // N), np.float32)
        ob, lb = np.empty_like(out), np.empty_like(lse)
        for s in range(N):
            j = (i - s) % N
            o, l = (out, lse) if s == 0 else (ob, lb)
            K.ring_forward_block(o, l, local[i], pos[i], kvs[j], pos[j], NH, KVH=KVH)
            if s:
                K.ring_merge(out, lse, ob, lb)
        outs.append(out)
        lses.append(lse)
    deltas = [np.empty_like(l) for l in lses]
    for i in range(N):
        K.ring_delta(deltas[i], douts[i], outs[i], NH)
    dqkvs = [np.empty_like(x) for x in local]
    travelling = [np.empty((B, T // N, KV), np.float32) for _ in range(N)]
    for s in range(N):
        for i in range(N):
            j = (i - s) % N
            K.ring_backward_block(
                dqkvs[i], travelling[j], douts[i], local[i], pos[i], kvs[j], pos[j],
                lses[i], deltas[i], NH, dq_fresh=s == 0, fresh=s == 0, KVH=KVH,
            )  # fmt: skip
    for i in range(N):
        K.kv_unpack_add(dqkvs[i], travelling[i], fresh=True)
    return outs, dqkvs


def all_to_all(sends):
    return [np.stack([x[j] for x in sends]) for j in range(len(sends))]


def run_ulysses(local, douts, pos):
    N, Tl = len(pos), T // len(pos)
    widths = (C, KV // 2, KV // 2)
    sends = [np.empty((N, B, Tl, W // N), np.float32) for _ in range(N)]
    for i in range(N):
        assert K.ulysses_pack(sends[i], local[i], N, 3, widths) == B * Tl * W // N
    heads, atts, outh = [], [], []
    for recv in all_to_all(sends):  # rank j: query heads j NH/N.., kv heads j KVH/N..
        qkvh = np.empty((B, T, W // N), np.float32)
        K.place(qkvh, recv, pos)
        o = np.empty((B, T, C // N), np.float32)
        att = np.empty((B, NH // N, T, T), np.float32)
        LK.gqa_forward(o, att, qkvh, NH // N, KVH // N)
        send = np.empty((N, B, Tl, C // N), np.float32)
        K.take(send, o, pos)
        heads.append(qkvh)
        atts.append(att)
        outh.append(send)
    outs = []
    for recv in all_to_all(outh):
        outs.append(np.empty((B, Tl, C), np.float32))
        K.ulysses_unpack(outs[-1], recv, 1)
    dsend = [np.empty((N, B, Tl, C // N), np.float32) for _ in range(N)]
    for i in range(N):
        K.ulysses_pack(dsend[i], douts[i], N, 1)
    back = []
    for j, recv in enumerate(all_to_all(dsend)):
        douth = np.empty((B, T, C // N), np.float32)
        K.place(douth, recv, pos)
        dqkvh = np.empty_like(heads[j])
        LK.gqa_backward(dqkvh, douth, heads[j], atts[j], NH // N, KVH // N, fresh=True)
        back.append(np.empty((N, B, Tl, W // N), np.float32))
        K.take(back[-1], dqkvh, pos)
    dqkvs = []
    for recv in all_to_all(back):
        dqkvs.append(np.empty((B, Tl, W), np.float32))
        K.ulysses_unpack(dqkvs[-1], recv, 3, widths)
    return outs, dqkvs


RUN = {"allgather": run_allgather, "ring": run_ring, "alltoall": run_ulysses}


# Ulysses splits the KVH = 2 kv heads: N = 2 only
CASES = [
    (f, s, n)
    for f in ("allgather", "ring", "alltoall")
    for s in cp.SPLITS
    for n in (2, 4)
    if n <= KVH or f != "alltoall"
]


@pytest.mark.parametrize("family,split,N", CASES)
def test_gqa_family_equals_unsplit(family, split, N):
    qkv, dout = r(B, T, W, seed=1), r(B, T, C, seed=2)
    want_out, att = np.empty((B, T, C), np.float32), np.empty((B, NH, T, T), np.float32)
    LK.gqa_forward(want_out, att, qkv, NH, KVH)
    want_dqkv = np.empty_like(qkv)
    LK.gqa_backward(want_dqkv, dout, qkv, att, NH, KVH, fresh=True)
    pos = cp.positions(split, N, T)
    local = [np.ascontiguousarray(qkv[:, p]) for p in pos]
    douts = [np.ascontiguousarray(dout[:, p]) for p in pos]
    outs, dqkvs = RUN[family](local, douts, pos)
    close(f"{family} {split} N={N} out", assemble(outs, pos), want_out)
    close(f"{family} {split} N={N} dqkv", assemble(dqkvs, pos), want_dqkv)
