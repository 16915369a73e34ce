"""Context-parallel attention (transformer/cp.py, cp_kernels.py), N ranks simulated in one
process: every split x family at N = 2 and 4 gives the unsplit attention's out and dqkv
(fast.attention_forward / _backward) to 1e-5 relative in float32, the collectives between
the ranks done in memory on the kernels' own send buffers; the new backwards against
finite differences (float64); the causal work per rank against hand arithmetic; bad
shapes raise one-line ValueErrors.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from gradcheck import check, numgrad, rand
from launch import ROOT

from proxies.transformer import cp
from proxies.transformer import cp_kernels as K
from proxies.transformer import fast as F

B, T, C, NH = 2, 32, 16, 4
RTOL = 1e-5
CASES = [(s, n) for s in cp.SPLITS for n in (2, 4)]


def r(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


def close(name: str, got, want) -> None:
    assert got.shape == want.shape, name
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= RTOL, f"{name}: relative error {err:.3g} > {RTOL}"


def unsplit(qkv: np.ndarray, dout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out, att = np.empty(dout.shape, qkv.dtype), np.empty((B, NH, T, T), qkv.dtype)
    F.attention_forward(out, att, qkv, NH)
    dqkv = np.empty_like(qkv)
    F.attention_backward(dqkv, dout, qkv, att, NH, fresh=True)
    return out, dqkv


def assemble(parts: list[np.ndarray], pos: list[np.ndarray]) -> np.ndarray:
    whole = np.empty((B, T, parts[0].shape[-1]), parts[0].dtype)
    for p, x in zip(pos, parts, strict=True):
        whole[:, p] = x
    return whole


def kv_blocks(local: list[np.ndarray]) -> list[np.ndarray]:
    kvs = []
    for x in local:
        kvs.append(np.empty((B, x.shape[1], 2 * C), x.dtype))
        assert K.kv_pack(kvs[-1], x) == B * x.shape[1] * 2 * C
    return kvs


# ----------------------------------------------------------------------------------------
# the three families, N ranks in a loop


def run_allgather(local, douts, pos, block):
    N, Tl = len(pos), T // len(pos)
    recv = np.stack(kv_blocks(local))  # the all-gather: every rank gets every block
    kv = np.empty((B, T, 2 * C), np.float32)
    K.place(kv, recv, pos)
    outs, dqkvs, sends = [], [], []
    for i in range(N):
        out = np.empty((B, Tl, C), np.float32)
        att = np.empty(K.att_size(pos[i], B, NH, block), np.float32)
        K.allgather_forward(out, att, local[i], kv, pos[i], NH, block)
        dqkv, dkv = np.empty_like(local[i]), np.empty((B, T, 2 * C), np.float32)
        K.allgather_backward(dqkv, dkv, douts[i], local[i], kv, att, pos[i], NH, block, True)
        send = np.empty((N, B, Tl, 2 * C), np.float32)
        assert K.take(send, dkv, pos) == B * Tl * 2 * C
        outs.append(out)
        dqkvs.append(dqkv)
        sends.append(send)
    for i in range(N):  # the reduce-scatter: rank i gets the sum of every rank's block i
        K.kv_unpack_add(dqkvs[i], sum(s[i] for s in sends), fresh=True)
    return outs, dqkvs


def run_ring(local, douts, pos):
    N = len(pos)
    kvs = kv_blocks(local)
    outs, lses = [], []
    for i in range(N):  # step s: rank i holds rank (i - s)'s block
        out, lse = np.empty((B, T // N, C), np.float32), np.empty((B, NH, T // N), np.float32)
        ob, lb = np.empty_like(out), np.empty_like(lse)
        for s in range(N):
            j = (i - s) % N
            o, l = (out, lse) if s == 0 else (ob, lb)
            did = K.ring_forward_block(o, l, local[i], pos[i], kvs[j], pos[j], NH)
            assert did == (pos[j][0] <= pos[i][-1])  # some key at or before some query
            if s:
                K.ring_merge(out, lse, ob, lb)
        outs.append(out)
        lses.append(lse)
    deltas = [np.empty_like(l) for l in lses]
    for i in range(N):
        K.ring_delta(deltas[i], douts[i], outs[i], NH)
    dqkvs = [np.empty_like(x) for x in local]
    travelling = [np.empty((B, T // N, 2 * C), np.float32) for _ in range(N)]  # dkv by owner
    for s in range(N):  # a block's dkv goes round with it, starting at its owner (s = 0)
        for i in range(N):
            j = (i - s) % N
            K.ring_backward_block(
                dqkvs[i], travelling[j], douts[i], local[i], pos[i], kvs[j], pos[j],
                lses[i], deltas[i], NH, dq_fresh=s == 0, fresh=s == 0,
            )  # fmt: skip
    for i in range(N):
        K.kv_unpack_add(dqkvs[i], travelling[i], fresh=True)
    return outs, dqkvs


def all_to_all(sends: list[np.ndarray]) -> list[np.ndarray]:
    """Rank j receives block j of every rank's send buffer, in rank order."""
    return [np.stack([s[j] for s in sends]) for j in range(len(sends))]


def run_ulysses(local, douts, pos):
    N, Tl, H = len(pos), T // len(pos), NH // len(pos)
    sends = [np.empty((N, B, Tl, 3 * C // N), np.float32) for _ in range(N)]
    for i in range(N):
        assert K.ulysses_pack(sends[i], local[i], N, 3) == B * Tl * 3 * C // N
    heads, atts, outh = [], [], []
    for recv in all_to_all(sends):  # rank j: the j-th NH/N heads, every token
        qkvh = np.empty((B, T, 3 * C // N), np.float32)
        K.place(qkvh, recv, pos)
        o, att = np.empty((B, T, C // N), np.float32), np.empty((B, H, T, T), np.float32)
        F.attention_forward(o, att, qkvh, H)
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
        F.attention_backward(dqkvh, douth, heads[j], atts[j], H, fresh=True)
        back.append(np.empty((N, B, Tl, 3 * C // N), np.float32))
        K.take(back[-1], dqkvh, pos)
    dqkvs = []
    for recv in all_to_all(back):
        dqkvs.append(np.empty((B, Tl, 3 * C), np.float32))
        K.ulysses_unpack(dqkvs[-1], recv, 3)
    return outs, dqkvs


@pytest.mark.parametrize("family", cp.FAMILIES)
@pytest.mark.parametrize("split,N", CASES)
def test_family_equals_unsplit(family, split, N):
    cp.validate_family(family, split, N, T, NH)
    qkv, dout = r(B, T, 3 * C, seed=1), r(B, T, C, seed=2)
    want_out, want_dqkv = unsplit(qkv, dout)
    pos = cp.positions(split, N, T)
    local = [np.ascontiguousarray(qkv[:, p]) for p in pos]
    douts = [np.ascontiguousarray(dout[:, p]) for p in pos]
    if family == "allgather":  # blocks of 3 queries: several per rank, a ragged last one
        outs, dqkvs = run_allgather(local, douts, pos, block=3)
    elif family == "ring":
        outs, dqkvs = run_ring(local, douts, pos)
    else:
        outs, dqkvs = run_ulysses(local, douts, pos)
    close(f"{family} {split} N={N} out", assemble(outs, pos), want_out)
    close(f"{family} {split} N={N} dqkv", assemble(dqkvs, pos), want_dqkv)


def test_allgather_block_sizes():
    """One block per rank, one query per block, and the default: the same result."""
    qkv, dout = r(B, T, 3 * C, seed=3), r(B, T, C, seed=4)
    want_out, want_dqkv = unsplit(qkv, dout)
    pos = cp.positions("zigzag", 2, T)
    local = [np.ascontiguousarray(qkv[:, p]) for p in pos]
    douts = [np.ascontiguousarray(dout[:, p]) for p in pos]
    for block in (T, 1, K.BLOCK_Q):
        outs, dqkvs = run_allgather(local, douts, pos, block)
        close(f"block {block} out", assemble(outs, pos), want_out)
        close(f"block {block} dqkv", assemble(dqkvs, pos), want_dqkv)


# ----------------------------------------------------------------------------------------
# fresh: written, or added to


def test_backwards_accumulate_unless_fresh():
    pos = cp.positions("interleaved", 2, T)
    local = [r(B, T // 2, 3 * C, seed=5 + i) for i in range(2)]
    do = r(B, T // 2, C, seed=7)
    kv = r(B, T, 2 * C, seed=8)
    att = np.empty(K.att_size(pos[1], B, NH, 4), np.float32)
    K.allgather_forward(np.empty((B, T // 2, C), np.float32), att, local[1], kv, pos[1], NH, 4)
    args = (do, local[1], kv, att, pos[1], NH, 4)
    dq, dkv = np.full_like(local[1], np.nan), np.full_like(kv, np.nan)
    K.allgather_backward(dq, dkv, *args, fresh=True)
    dq2, dkv2 = np.ones_like(local[1]), np.ones_like(kv)
    K.allgather_backward(dq2, dkv2, *args)
    close("allgather dq +=", dq2[..., :C], 1 + dq[..., :C])
    assert np.all(dq2[..., C:] == 1)  # k | v of the local dqkv: untouched
    close("allgather dkv +=", dkv2, 1 + dkv)
    assert np.all(dkv[:, pos[1][-1] + 1 :] == 0)  # fresh: zeros past the last query

    # the ring: rank 1's queries, rank 0's block
    kv0 = r(B, T // 2, 2 * C, seed=9)
    out, lse = np.empty((B, T // 2, C), np.float32), np.empty((B, NH, T // 2), np.float32)
    K.ring_forward_block(out, lse, local[1], pos[1], kv0, pos[0], NH)
    delta = np.empty_like(lse)
    K.ring_delta(delta, do, out, NH)
    rargs = (do, local[1], pos[1], kv0, pos[0], lse, delta, NH)
    dq, dkv = np.full_like(local[1], np.nan), np.full_like(kv0, np.nan)
    K.ring_backward_block(dq, dkv, *rargs, dq_fresh=True, fresh=True)
    dq2, dkv2 = np.ones_like(local[1]), np.ones_like(kv0)
    K.ring_backward_block(dq2, dkv2, *rargs)
    close("ring dq +=", dq2[..., :C], 1 + dq[..., :C])
    close("ring dkv +=", dkv2, 1 + dkv)


# ----------------------------------------------------------------------------------------
# finite differences, float64


def test_allgather_backward_gradcheck():
    T8, C8, H = 8, 8, 2
    pos = cp.positions("zigzag", 2, T8)[1]  # positions 2, 3, 4, 5
    qkv, kv, do = rand(1, 4, 3 * C8, seed=1), rand(1, T8, 2 * C8, seed=2), rand(1, 4, C8, seed=3)
    out, att = np.empty((1, 4, C8)), np.empty(K.att_size(pos, 1, H, 3))

    def loss() -> float:
        K.allgather_forward(out, att, qkv, kv, pos, H, 3)
        return float((out * do).sum())

    loss()
    dqkv, dkv = np.zeros_like(qkv), np.empty_like(kv)
    K.allgather_backward(dqkv, dkv, do, qkv, kv, att, pos, H, 3, fresh=True)
    check("allgather dqkv", dqkv, numgrad(loss, qkv))  # k | v of qkv unused: both 0
    check("allgather dkv", dkv, numgrad(loss, kv))


def test_ring_backward_gradcheck():
    """Rank 1 of zigzag N=2, T=8 (positions 2..5) over both blocks, merged: the gradient of
    the merged attention w.r.t. its queries and both blocks' keys and values."""
    T8, C8, H = 8, 8, 2
    pos = cp.positions("zigzag", 2, T8)
    qkv, do = rand(1, 4, 3 * C8, seed=4), rand(1, 4, C8, seed=5)
    kvs = [rand(1, 4, 2 * C8, seed=6 + j) for j in range(2)]
    out, lse = np.empty((1, 4, C8)), np.empty((1, H, 4))
    ob, lb = np.empty_like(out), np.empty_like(lse)

    def loss() -> float:
        K.ring_forward_block(out, lse, qkv, pos[1], kvs[1], pos[1], H)
        K.ring_forward_block(ob, lb, qkv, pos[1], kvs[0], pos[0], H)
        K.ring_merge(out, lse, ob, lb)
        return float((out * do).sum())

    loss()
    delta = np.empty_like(lse)
    K.ring_delta(delta, do, out, H)
    dqkv = np.zeros_like(qkv)
    dkvs = [np.empty_like(kv) for kv in kvs]
    for j in (1, 0):
        K.ring_backward_block(
            dqkv, dkvs[j], do, qkv, pos[1], kvs[j], pos[j], lse, delta, H, fresh=True
        )
    check("ring dqkv", dqkv, numgrad(loss, qkv))
    for j in (0, 1):
        check(f"ring dkv block {j}", dkvs[j], numgrad(loss, kvs[j]))


def test_ring_merge_of_nothing():
    """A block no query sees merges as nothing: out and lse unchanged, no NaN."""
    out, lse = r(1, 2, C, seed=1), r(1, NH, 2, seed=2)
    ob, lb = np.empty_like(out), np.empty_like(lse)
    qkv, kv = r(1, 2, 3 * C, seed=3), r(1, 2, 2 * C, seed=4)
    assert not K.ring_forward_block(ob, lb, qkv, np.array([0, 1]), kv, np.array([2, 3]), NH)
    want = out.copy(), lse.copy()
    K.ring_merge(out, lse, ob, lb)
    np.testing.assert_allclose(out, want[0], rtol=1e-6)
    np.testing.assert_allclose(lse, want[1], rtol=1e-6)


# ----------------------------------------------------------------------------------------
# splits and work


@pytest.mark.parametrize("split,N", [*CASES, ("zigzag", 8), ("interleaved", 3)])
def test_positions_partition_and_work_sums(split, N):
    T = 48 if N == 3 else 64
    pos = cp.positions(split, N, T)
    assert all(len(p) == T // N and np.all(np.diff(p) > 0) for p in pos)
    assert sorted(np.concatenate(pos).tolist()) == list(range(T))
    assert sum(cp.work(split, N, T)) == T * (T + 1) // 2


def test_work_by_hand():
    # contiguous, N=4, T=1024: rank i holds 256 i .. 256 i + 255, query p sees p + 1 keys
    w = cp.work("contiguous", 4, 1024)
    assert w == [256 * 256 * i + 256 * 257 // 2 for i in range(4)]
    mean = 1024 * 1025 / 2 / 4
    assert w[-1] / mean == pytest.approx(229504 / 131200)  # 1.749: about (2N-1)/N = 1.75
    # interleaved: rank i holds i + 4j, j < 256: 256 (i + 1) + 4 * 256 * 255 / 2
    assert cp.work("interleaved", 4, 1024) == [256 * (i + 1) + 2 * 256 * 255 for i in range(4)]
    # zigzag: chunks of 128, rank i holds i and 7 - i: (8 chunks' worth) / 4, equal
    assert cp.work("zigzag", 4, 1024) == [1024 * 1025 // 8] * 4
    ratios = [x for x, _ in cp.imbalance(cp.work("zigzag", 4, 1024))]
    assert ratios == [1.0] * 4
    assert [round(x, 3) for x, _ in cp.imbalance(w)] == [0.251, 0.75, 1.25, 1.749]
    assert cp.attention_flops(10, C=768, B=2) == (4 * 2 * 768 * 10, 8 * 2 * 768 * 10)


def test_computed_pairs():
    pos = np.arange(4, 8)
    assert cp.computed_pairs(pos, 2) == 2 * 6 + 2 * 8
    assert cp.computed_pairs(pos, 1) == cp.causal_pairs(pos) == 5 + 6 + 7 + 8
    assert cp.computed_pairs(pos, 3) == 3 * 7 + 1 * 8  # a ragged last block
    p = cp.positions("interleaved", 4, 64)[2]
    assert K.att_size(p, 2, 3, 5) == 2 * 3 * cp.computed_pairs(p, 5)
    assert K.att_size(p, 2, 3) == 2 * 3 * cp.computed_pairs(p, K.BLOCK_Q)


@pytest.mark.parametrize(
    "args,words",
    [
        (("zigzag", 4, 12), "not a multiple of 8"),
        (("contiguous", 4, 10), "not a multiple of 4"),
        (("interleaved", 3, 64), "not a multiple of 3"),
        (("spiral", 2, 64), "unknown context-parallel split"),
        (("contiguous", 0, 64), "N >= 1"),
    ],
)
def test_bad_splits_raise_one_line(args, words):
    with pytest.raises(ValueError, match=words) as e:
        cp.positions(*args)
    assert "\n" not in str(e.value)


def test_bad_family_raises():
    with pytest.raises(ValueError, match="multiple of the 3"):
        cp.validate_family("ulysses", "interleaved", 3, 48, 4)
    with pytest.raises(ValueError, match="unknown context-parallel family"):
        cp.validate_family("tree", "zigzag", 2, 64, 4)
    cp.validate_family("ring", "interleaved", 3, 48, 4)  # heads only matter to Ulysses


# ----------------------------------------------------------------------------------------
# the benchmark


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(ROOT, "benchmarks", "cp_balance.py")
    spec = importlib.util.spec_from_file_location("cp_balance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_runs(bench, capsys):
    assert bench.main(["--model", "gpt2-tiny", "--seq-len", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for split in cp.SPLITS:
        assert split in out
    assert "T=64" in out and "(2N-1)/N" in out


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--seq-len", "100"], "not a multiple of 8"),
        (["--cp", "3", "--seq-len", "63"], "not a multiple of 6"),
        (["--model", "gpt9"], "unknown model"),
    ],
)
def test_benchmark_bad_input(bench, capsys, argv, words):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
