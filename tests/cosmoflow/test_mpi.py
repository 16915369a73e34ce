"""CosmoFlow proxy under mpiexec: spatial and data-parallel layouts train like one process,
--check verifies every message in every compute mode, the breakdown separates exposed from
hidden allreduce time, bad input is one line and exit 2."""

import json

import pytest
from launch import mpirun

pytestmark = pytest.mark.mpi  # every test here starts MPI

PROG = "proxies.cosmoflow"
# Global batch 2 in every layout: 1 replica of 2 samples or 2 replicas of 1.
# A large learning rate: later losses then depend strongly on the gradients.
TINY = ["--model", "cosmoflow-tiny", "--global-batch", "2", "--lr", "0.01"]
TINY += ["--iters", "3", "--warmup", "0"]


def run(tmp_path, ranks, *args, timeout=180):
    out = tmp_path / f"r{ranks}-{abs(hash(args))}.json"
    r = mpirun(ranks, PROG, *TINY, "--quiet", "--json", str(out), *args, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), 1, "--shards", "1")


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """8 ranks: 2 data-parallel replicas x 2x2 spatial shards."""
    return run(tmp_path_factory.mktemp("eight"), 8, "--shards", "4", timeout=240)


# 4 shards (2x2) split dense1's 6 columns 2, 2, 1, 1: Allgatherv / Reduce_scatter.
@pytest.mark.parametrize(
    "ranks,shards,dense", [(2, "2", "split"), (4, "4", "split"), (4, "4", "replicate")]
)
def test_spatial_shards_train_like_one_process(tmp_path, reference, ranks, shards, dense):
    got = run(tmp_path, ranks, "--shards", shards, "--dense", dense, "--check")
    assert got["config"]["sp"] == ranks and got["config"]["global_batch"] == 2
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-4)


def test_eight_shards_2x4_train_like_one_process(tmp_path, reference):
    """8 spatial shards, dense 16-6-4 split unevenly (dense1 on 6 shards, dense2 on 4: some
    gathered blocks are empty), every message verified."""
    got = run(tmp_path, 8, "--shards", "2x4", "--check", timeout=240)
    assert got["grid"] == {"order": "sp-dp", "sp": 8, "dp": 1}
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-4)


def test_eight_ranks_spatial_x_data_train_like_one_process(reference, eight):
    assert eight["grid"] == {"order": "sp-dp", "sp": 4, "dp": 2}
    assert eight["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    assert len(reference["loss"]) == 3


def test_breakdown_separates_exposed_and_hidden(eight):
    cats = set(eight["breakdown_s"])
    for kind in ("conv_allreduce", "dense_allreduce"):  # non-blocking: both parts
        assert {kind, kind + "_hidden"} <= cats
    assert {"compute", "data", "halo", "sp_allgather", "sp_reduce_scatter", "idle"} <= cats
    # Bytes per rank per iteration: conv weights 27*Ci*Co + Co per layer, over every rank.
    conv = sum(27 * ci * co + co for ci, co in [(4, 4), (4, 8), (8, 16)])
    assert eight["bytes"]["conv_allreduce"] == [4 * conv] * 8
    assert all(n > 0 for n in eight["bytes"]["halo_send"])


@pytest.mark.parametrize(
    "ranks,compute", [(4, "real"), (2, "replay"), (2, "model"), (2, "none")], ids=str
)
def test_check_verifies_every_message(tmp_path, ranks, compute):
    got = run(tmp_path, ranks, "--shards", "2", "--check", "--compute", compute)
    assert got["config"]["check"] is True
    assert ("loss" in got) == (compute == "real")


def test_check_at_the_cpp_proxy_sizes(tmp_path):
    out = tmp_path / "cpp.json"
    r = mpirun(
        4,
        PROG,
        "--model",
        "dnn-cpp-proxies",
        "--compute",
        "none",
        "--check",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--quiet",
        "--json",
        str(out),
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    # Forward 2 faces x (2,097,152 + 1,048,576 + 524,288 + 262,144) floats, backward the
    # same faces of the output gradients (131,072 ... 1,048,576).
    fwd, bwd = 2 * 3_932_160, 2 * (131_072 + 262_144 + 524_288 + 1_048_576)
    assert got["bytes"]["halo_send"] == [4 * (fwd + bwd)] * 4


def test_check_catches_a_corrupted_halo():
    r = mpirun(
        2,
        PROG,
        *TINY,
        "--shards",
        "2",
        "--check",
        timeout=60,
        env={"PROXIES_FAULT": "corrupt:0"},
    )
    assert r.returncode != 0
    # the first message: conv0's input halo
    assert "--check: rank 1 received conv0.x.from_w mb 0 from rank 0" in r.stderr


BAD = [
    (3, ["--shards", "2"], "world size 3 is not a multiple of --shards 2"),
    (4, ["--shards", "8x1", "--dry-run", "--world-size", "8"], "H = 32 split 8 ways is 4"),
    (4, ["--shards", "2", "--global-batch", "3"], "--global-batch 3 is not divisible by the 2"),
    (2, ["--shards", "two"], "--shards: expected a count like 4"),
    (2, ["--model", "dnn-cpp-proxies", "--compute", "real"], "--compute real needs"),
    (2, ["--model", "dnn-cpp-proxies", "--dense", "replicate"], "--dense replicate needs"),
]


@pytest.mark.parametrize("ranks,args,words", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_input_is_one_line_and_exit_2(ranks, args, words):
    r = mpirun(ranks, PROG, *args, "--timeout", "20", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{PROG}: error: ") and words in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
