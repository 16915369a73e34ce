"""GPT-3 proxy under mpiexec on 4 and 8 ranks: real tensor x pipeline x data (x expert)
parallel training equals the unsharded model, --check verifies every message and
collective in every compute mode, bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest
from launch import mpirun

from .test_model import MOE, MOE_DROPLESS, emulate, reference

pytestmark = pytest.mark.mpi  # every test here starts MPI

TINY = ["--model", "gpt3-tiny", "--seq-len", "32", "--iters", "2", "--warmup", "0", "--quiet"]


def run(tmp_path, ranks: int, *args: str) -> dict:
    out = tmp_path / f"r{ranks}.json"
    r = mpirun(
        ranks, "proxies.gpt3", *args, *TINY, "--json", str(out), "--timeout", "120", timeout=300
    )
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_4_ranks_tp2_pp2_train_like_one_process(tmp_path):
    want, _ = reference(4, 4)
    got = run(
        tmp_path,
        4,
        "4",
        "2",
        "--tp",
        "2",
        "--micro-batches",
        "4",
        "--compute",
        "real",
        "--lr",
        "1e-3",
        "--check",
    )
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["grid"] == {"order": "pp-tp-dp", "pp": 2, "tp": 2, "dp": 1}
    act = 32 * 64 * 4  # B*T*C floats
    assert got["bytes"]["pp_send"] == [4 * act] * 4
    assert got["bytes"]["tp_allreduce"][0] == (1 + 2 * 4) * 4 * act  # embedding + 2 layers x 4
    assert {"compute", "pp", "tp_allreduce", "embed_allreduce", "idle"} <= set(got["breakdown_s"])


def test_8_ranks_sequence_parallel_interleaved_train_like_one_process(tmp_path):
    want, _ = reference(4, 8)
    got = run(
        tmp_path,
        8,
        "4",
        "2",
        "--tp",
        "2",
        "--micro-batches",
        "4",
        "--compute",
        "real",
        "--lr",
        "1e-3",
        "--sequence-parallel",
        "--virtual-stages",
        "2",
        "--order",
        "megatron",
    )
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["config"]["schedule"] == "interleaved" and got["config"]["dp"] == 2
    assert {"tp_allgather", "tp_reduce_scatter", "dp_allreduce"} <= set(got["breakdown_s"])


def test_8_ranks_moe_expert_parallel_trains_like_one_process(tmp_path):
    want, _ = emulate([*MOE, "--micro-batches", "8"], 1)
    got = run(
        tmp_path,
        8,
        "2",
        "2",
        "--tp",
        "2",
        "--micro-batches",
        "4",
        "--compute",
        "real",
        "--lr",
        "1e-3",
        "--moe-experts",
        "4",
        "--capacity-factor",
        "1",
        "--check",
    )
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["config"]["ep"] == 2 and "ep_alltoall" in got["breakdown_s"]


@pytest.mark.parametrize(
    "stages,m,extra", [("2", "4", []), ("1", "2", ["--ep", "2"])], ids=["tp2-pp2", "tp2-ep2"]
)
def test_4_ranks_moe_sequence_parallel_trains_like_one_process(tmp_path, stages, m, extra):
    # Megatron's MoE layout with TP: sequence parallel, tokens A2A over ep and AG/RS over
    # tp around the experts. Capacity factor 2 = E / k: nothing drops (test_gpt3_model).
    want, _ = emulate([*MOE_DROPLESS, "--micro-batches", "4"], 1)
    argv = ["2", stages, "--tp", "2", "--micro-batches", m, "--compute", "real"]
    argv += ["--lr", "1e-3", "--moe-experts", "4", "--capacity-factor", "2"]
    got = run(tmp_path, 4, *argv, "--sequence-parallel", *extra, "--check")
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["config"]["sequence_parallel"] and got["config"]["ep"] == (2 if extra else 1)
    assert {"tp_allgather", "tp_reduce_scatter"} <= set(got["breakdown_s"])
    assert ("ep_alltoall" in got["breakdown_s"]) == bool(extra)
    if not extra:
        # stage 0 (embedding, layer 0), per micro-batch: AG of ln1 and the MoE tokens
        # (2 ranks x E 4 x capacity ceil(2 * 2 * 16 / 4) = 16 x C 64 = 8192 floats)
        # forward; backward the tokens' gradients, proj's d out, ln1 again, the
        # embedding's d: 4 x B*T*C (2048) + 2 x 8192 floats, 4 micro-batches
        assert got["bytes"]["tp_allgather"][0] == 4 * 4 * (4 * 2048 + 2 * 8192)


@pytest.mark.parametrize("compute", ["none", "model"])
def test_comm_only_modes_check_every_message(tmp_path, compute):
    got = run(
        tmp_path,
        8,
        "4",
        "2",
        "--tp",
        "2",
        "--micro-batches",
        "4",
        "--compute",
        compute,
        "--moe-experts",
        "4",
        "--check",
        "--inflight-buckets",
        "1",
    )
    assert "loss" not in got and len(got["iter_time_s"]) == 2
    assert {"ep_alltoall", "tp_allreduce", "dp_allreduce", "pp"} <= set(got["breakdown_s"])


def test_comm_only_moe_sequence_parallel_checks_every_message(tmp_path):
    # compute none: the pooled buffers hold --check's patterns through every A2A, AG, RS
    argv = ["2", "1", "--tp", "2", "--ep", "2", "--moe-experts", "4", "--sequence-parallel"]
    got = run(tmp_path, 4, *argv, "--micro-batches", "2", "--compute", "none", "--check")
    assert "loss" not in got and len(got["iter_time_s"]) == 2
    assert {"ep_alltoall", "tp_allgather", "tp_reduce_scatter"} <= set(got["breakdown_s"])


CASES = [
    (8, ["96", "2", "--tp", "5"], "--tp 5 does not divide gpt3-175b's 96 attention heads"),
    (6, ["8", "2", "--tp", "2"], "world size 6 is not dp * tp * pp"),
    (8, ["8", "2", "--moe-experts", "6", "--ep", "4"], "--moe-experts 6 cannot be spread"),
    (4, ["12", "2", "--virtual-stages", "4"], "--virtual-stages 4 does not divide the 6 layers"),
]


@pytest.mark.parametrize("ranks,args,words", CASES, ids=[c[2][:24] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(ranks, args, words):
    r = mpirun(ranks, "proxies.gpt3", *args, "--timeout", "20", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("proxies.gpt3: error: "), r.stderr
    assert words in lines[0] and r.stdout == ""
