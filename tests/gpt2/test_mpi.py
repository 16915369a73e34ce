"""GPT-2 proxy under mpiexec: layouts agree, --check, the watchdog, failures end the job."""

import json

import pytest
from launch import mpirun

from proxies.core import exits

pytestmark = pytest.mark.mpi  # every test here starts MPI

TINY = ["--model", "gpt2-tiny", "--seq-len", "32", "--iters", "3", "--warmup", "0", "--quiet"]


def losses(tmp_path, ranks, layers, stages, mbs, *extra):
    out = tmp_path / f"r{ranks}s{stages}m{mbs}.json"
    r = mpirun(
        ranks,
        "proxies.gpt2",
        str(layers),
        str(stages),
        str(mbs),
        *TINY,
        "--json",
        str(out),
        *extra,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


# (ranks, stages, micro-batches): global batch 8 samples in every layout.
LAYOUTS = [(2, 2, 8), (2, 1, 4), (4, 2, 4), (8, 4, 4)]


def test_every_layout_trains_like_one_process(tmp_path):
    ref = losses(tmp_path, 1, 4, 1, 8)
    assert len(ref["loss"]) == 3 and ref["loss"][2] < ref["loss"][0]
    for ranks, stages, mbs in LAYOUTS:
        got = losses(tmp_path, ranks, 4, stages, mbs)
        assert got["config"]["global_batch"] == 8
        assert got["grid"] == {"order": "pp-dp", "pp": stages, "dp": ranks // stages}
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (ranks, stages)


@pytest.mark.one_mpi
def test_gpipe_and_megatron_order_train_the_same(tmp_path):
    ref = losses(tmp_path, 4, 4, 2, 4)
    for extra in (["--schedule", "gpipe"], ["--order", "megatron"]):
        got = losses(tmp_path, 4, 4, 2, 4, *extra)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), extra


@pytest.mark.parametrize(
    "ranks,stages,extra",
    [
        pytest.param(4, 2, ["--grad-sync", "per-tensor"], marks=pytest.mark.one_mpi),
        (4, 2, ["--zero", "1", "--check"]),
        pytest.param(3, 1, ["--zero", "1", "--micro-batch", "1"], marks=pytest.mark.one_mpi),
    ],
)
def test_gradient_sync_options_train_the_same(tmp_path, ranks, stages, extra):
    """Per-tensor allreduces and ZeRO-1 (with a parameter count that does not divide by 3)
    give the fused allreduce's losses."""
    mbs = 8 // (ranks // stages) if ranks != 3 else 2
    ref = losses(tmp_path, 1, 4, 1, mbs * (ranks // stages))
    got = losses(tmp_path, ranks, 4, stages, mbs, *extra)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    if "--zero" in extra:
        assert {"dp_reduce_scatter", "dp_allgather"} <= set(got["breakdown_s"])


# ring runs under every MPI; the others use the same calls
OTHER_ALGS = ("rhd", "dbtree", "hier", "tree", "naive")


@pytest.mark.parametrize(
    "alg", ["ring", *(pytest.param(a, marks=pytest.mark.one_mpi) for a in OTHER_ALGS)]
)
def test_allreduce_algorithms_train_the_same(tmp_path, alg):
    """Our allreduces over point-to-point (3 data-parallel replicas: not a power of two)."""
    ref = losses(tmp_path, 1, 4, 1, 6)
    got = losses(tmp_path, 3, 4, 1, 2, "--allreduce", alg, "--check")
    assert got["config"]["allreduce"] == alg
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)


def test_results_json_has_the_contract_fields(tmp_path):
    got = losses(tmp_path, 4, 4, 2, 4)
    for key in (
        "proxy",
        "config",
        "world_size",
        "grid",
        "mpi",
        "iter_time_s",
        "breakdown_s",
        "bytes",
        "loss",
    ):
        assert key in got
    assert len(got["iter_time_s"]) == 3
    assert set(got["breakdown_s"]) >= {"compute", "pp", "dp_allreduce", "embed_allreduce", "idle"}
    # Bytes per rank: stage 0 sends 4 activations of B*T*C floats and receives 4 gradients.
    act = 1 * 32 * 64 * 4
    assert got["bytes"]["pp_send"] == [4 * act] * 4
    assert got["bytes"]["pp_recv"] == [4 * act] * 4
    # Every second of an iteration is accounted for (overhead is the remainder, never < 0).
    for i, total in enumerate(got["iter_time_s"]):
        parts = sum(v[i] for v in got["breakdown_max_s"].values())
        assert parts >= 0.5 * total


@pytest.mark.parametrize("compute", ["real", "none", "replay", "model"])
def test_check_verifies_every_message(tmp_path, compute):
    got = losses(tmp_path, 4, 4, 2, 4, "--check", "--compute", compute)
    assert got["config"]["check"] is True
    assert ("loss" in got) == (compute == "real")


def test_check_catches_a_corrupted_message():
    r = mpirun(
        4,
        "proxies.gpt2",
        "4",
        "2",
        "4",
        *TINY,
        "--check",
        timeout=60,
        env={"PROXIES_FAULT": "corrupt:0"},
    )
    assert r.returncode == exits.CHECK, r.stderr
    assert "--check: rank 1 received act_in mb 0 from rank 0" in r.stderr


def test_watchdog_turns_a_stall_into_a_diagnosis():
    r = mpirun(
        2,
        "proxies.gpt2",
        "4",
        "2",
        "4",
        *TINY,
        "--timeout",
        "3",
        timeout=60,
        env={"PROXIES_FAULT": "stall:1"},
    )
    assert r.returncode == exits.STALLED, r.stderr
    # Rank 1 never receives: rank 0 is left waiting for it to take the first activation.
    assert "watchdog: rank 0 made no progress" in r.stderr
    assert "waiting for the receiver(s) to take act_out mb 0 to rank 1" in r.stderr


def test_a_crashing_rank_ends_the_job_with_one_traceback():
    r = mpirun(
        4, "proxies.gpt2", "4", "2", "4", *TINY, timeout=60, env={"PROXIES_FAULT": "crash:3"}
    )
    assert r.returncode == exits.FAILED, r.stderr
    assert "rank 3 failed" in r.stderr
    assert r.stderr.count("Traceback") == 1


@pytest.mark.one_mpi
def test_llmc_token_file_trains_the_same_in_every_layout(tmp_path):
    import numpy as np

    from proxies.transformer.data import write_token_file

    path = tmp_path / "tokens.bin"
    write_token_file(str(path), np.random.default_rng(3).integers(0, 50257, 5000))
    ref = losses(tmp_path, 1, 4, 1, 8, "--data", str(path))
    got = losses(tmp_path, 4, 4, 2, 4, "--data", str(path))
    assert got["config"]["data"] == str(path)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
