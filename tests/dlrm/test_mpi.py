"""DLRM proxy under mpiexec: 1, 2 and 4 ranks train alike, --check, the breakdown's exposed
and hidden communication, compute model and replay."""

import json
import statistics

import pytest
from launch import mpirun

pytestmark = pytest.mark.mpi  # every test here starts MPI

TINY = ["--model", "dlrm-tiny", "--iters", "3", "--warmup", "0", "--quiet"]


def run(tmp_path, ranks, *extra):
    out = tmp_path / f"r{ranks}-{len(list(tmp_path.iterdir()))}.json"
    r = mpirun(ranks, "proxies.dlrm", *TINY, "--json", str(out), *extra, timeout=240)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), 1)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run(tmp_path_factory.mktemp("four"), 4)


@pytest.mark.parametrize("ranks", [2, 4])
def test_same_global_batch_same_loss(tmp_path, one_rank, four_ranks, ranks):
    ref = one_rank["loss"]
    assert len(ref) == 3 and ref[2] < ref[0]
    got = run(tmp_path, 2) if ranks == 2 else four_ranks
    assert got["config"]["global_batch"] == 32 and got["config"]["local_batch"] == 32 // ranks
    assert got["loss"] == pytest.approx(ref, rel=1e-4)
    # every rank moves the same bytes: 4 tables over `ranks`, (W,S,b,D) both ways
    S = -(-4 // ranks)
    assert got["bytes"]["emb_alltoall"] == [2 * ranks * S * (32 // ranks) * 8 * 4] * ranks
    assert got["bytes"]["dp_allreduce"] == [4 * (136 + 144 + 304 + 136 + 9)] * ranks


def test_breakdown_separates_exposed_from_hidden(four_ranks):
    got = four_ranks
    for key in ("proxy", "config", "world_size", "grid", "mpi", "iter_time_s", "breakdown_s"):
        assert key in got
    assert got["proxy"] == "dlrm" and got["grid"] == {"order": "dp", "dp": 4}
    cats = set(got["breakdown_s"])
    assert {"compute", "emb_alltoall", "emb_alltoall_hidden"} <= cats
    assert {"dp_allreduce", "dp_allreduce_hidden"} <= cats
    # exposed parts are within the iteration; hidden ones are reported beside it
    for i, total in enumerate(got["iter_time_s"]):
        exposed = sum(v[i] for c, v in got["breakdown_max_s"].items() if not c.endswith("_hidden"))
        assert exposed >= 0.5 * total


def test_cpp_schedule_trains_the_same(tmp_path, one_rank):
    got = run(tmp_path, 2, "--schedule", "cpp")
    assert got["loss"] == pytest.approx(one_rank["loss"], rel=1e-4)
    assert "idle" in got["breakdown_s"]  # blocking all-to-alls: waiting for peers is measured


@pytest.mark.parametrize("ranks,compute", [(4, "real"), (2, "none"), (2, "replay")])
def test_check_verifies_every_collective(tmp_path, ranks, compute):
    got = run(tmp_path, ranks, "--check", "--compute", compute)
    assert got["config"]["check"] is True
    assert ("loss" in got) == (compute == "real")
    if compute == "replay":
        assert "emb forward/0" in got["replay_s"]


def test_compute_model_sleeps_the_cpp_proxy_times(tmp_path):
    """dnn-cpp-proxies on 4 ranks: 3,091 us of A100 compute per iteration (dlrm.cpp's sleeps)."""
    r = mpirun(4, "proxies.dlrm", "--compute", "model", "--iters", "2", "--warmup", "1",
               "--json", str(tmp_path / "m.json"), timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "m.json").read_text())
    assert got["config"]["model"] == "dnn-cpp-proxies" and "loss" not in got
    assert got["bytes"]["emb_alltoall"] == [2 * 262144 * 4] * 4
    assert statistics.fmean(got["breakdown_s"]["compute"]) >= 3.091e-3  # a sleep is never shorter
    assert "embedding all-to-all" in r.stdout and "time per iteration" in r.stdout


SHARDED = {"row": ["--sharding", "row"], "column": ["--sharding", "column", "--column-shards", "2"]}


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("sharding", sorted(SHARDED))
def test_sharded_tables_train_like_whole_tables(tmp_path, one_rank, sharding, ranks):
    """Row-wise and column-wise under MPI, --check on every collective: the losses of one
    rank holding whole tables, to float32 rounding (partial sums meet in another order)."""
    got = run(tmp_path, ranks, *SHARDED[sharding], "--check")
    assert got["config"]["sharding"] == sharding and got["config"]["check"] is True
    assert got["loss"] == pytest.approx(one_rank["loss"], rel=1e-5)
    if ranks == 1:
        assert got["bytes"] == {}
    elif sharding == "row":  # (B,NT,D) = 32 x 4 x 8 floats; splits, lengths, ids in int64
        assert got["bytes"]["emb_reduce_scatter"] == [32 * 4 * 8 * 4] * ranks
        assert got["bytes"]["emb_allgather"] == [32 * 4 * 8 * 4] * ranks
        b = 32 // ranks
        ids = [8 * (ranks * 3 + ranks * 4 * b + b * 4 * 2)] * ranks
        assert got["bytes"]["emb_input"] == ids
    else:  # 8 shards of 4 columns: (W, 8/W, b, 4) both ways
        assert got["bytes"]["emb_alltoall"] == [2 * 8 * 32 * 4 * 4 // ranks] * ranks


@pytest.mark.parametrize("compute", ["none", "replay"])
def test_row_wise_without_real_compute(tmp_path, compute):
    """The ids all-to-allv sized from the data when no rank bucketized any ids."""
    got = run(tmp_path, 4, "--sharding", "row", "--check", "--compute", compute)
    assert "loss" not in got and got["bytes"]["emb_input"][0] > 0
