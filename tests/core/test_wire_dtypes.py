"""--dtype / --grad-dtype in every proxy: 16-bit activations and parallel traffic halve
those bytes (and only those), gradient reductions follow --grad-dtype, real training in
bf16 stays within a stated tolerance of float32, and --check still verifies every message.

Tolerance: over the first two iterations (the forward from identical weights, then one
update with bf16-reduced gradients) a bf16 run's losses stay within 2e-3 relative of the
float32 run's (bf16 keeps 8 significant bits: 2^-9 = 2e-3 relative rounding per value).
Later the trajectories drift apart as any two bf16/fp32 runs do (CosmoFlow tiny at lr
0.01: 2e-3 at the third iteration).
"""

from __future__ import annotations

import json
import sys

import pytest
from launch import mpirun, run

BF16_RTOL = 2e-3

# (module, arguments, world size, gradient categories, categories mixing float32 buffers)
PROXIES = {
    "gpt2": ("proxies.gpt2", ["8", "2", "4"], 4, {"dp_allreduce", "embed_allreduce"}, set()),
    "gpt2-zero": (
        "proxies.gpt2",
        ["8", "2", "4", "--zero", "1"],
        4,
        {"dp_reduce_scatter", "embed_allreduce"},
        set(),
    ),
    "gpt3": (
        "proxies.gpt3",
        ["4", "2", "--tp", "2", "--model", "gpt3-tiny", "--seq-len", "32"],
        8,
        {"dp_allreduce", "embed_allreduce"},
        {"tp_allgather"},  # the loss statistics stay float32
    ),
    "gpt3-moe": (
        "proxies.gpt3",
        ["4", "2", "--model", "gpt3-tiny", "--seq-len", "32", "--moe-experts", "2", "--ep", "2"],
        8,
        {"dp_allreduce", "edp_allreduce", "embed_allreduce"},
        set(),
    ),
    "cosmoflow": (
        "proxies.cosmoflow",
        ["--model", "cosmoflow-tiny", "--global-batch", "2"],
        8,
        {"conv_allreduce", "dense_allreduce"},
        set(),
    ),
    "dlrm": ("proxies.dlrm", ["--model", "dlrm-tiny"], 4, {"dp_allreduce"}, set()),
}


def dry_bytes(tmp_path, name: str, *extra: str) -> dict[str, list[int]]:
    module, args, world, _, _ = PROXIES[name]
    out = tmp_path / f"{name}{'-'.join(extra)}.json"
    cmd = [sys.executable, "-m", module, *args, "--dry-run", "--world-size", str(world)]
    r = run([*cmd, *extra, "--json", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROXIES))
def test_bf16_halves_the_bytes_of_its_categories(tmp_path, name):
    _, _, _, grads, mixed = PROXIES[name]
    fp32 = dry_bytes(tmp_path, name)
    act = dry_bytes(tmp_path, name, "--dtype", "bf16")
    grad = dry_bytes(tmp_path, name, "--grad-dtype", "bf16")
    assert grads <= set(fp32), sorted(fp32)
    assert set(fp32) - grads, "no activation traffic to halve"
    for c, want in fp32.items():
        half = [n // 2 for n in want]
        if c in grads:
            assert act[c] == want, c
            assert grad[c] == half, c
        elif c in mixed:
            assert all(h <= a <= w for h, a, w in zip(half, act[c], want, strict=True)), c
            assert grad[c] == want, c
        else:
            assert act[c] == half, c
            assert grad[c] == want, c


@pytest.mark.slow
def test_fp16_is_two_bytes_too(tmp_path):
    fp32 = dry_bytes(tmp_path, "gpt2")
    fp16 = dry_bytes(tmp_path, "gpt2", "--dtype", "fp16", "--grad-dtype", "fp16")
    assert fp16 == {c: [n // 2 for n in v] for c, v in fp32.items()}


def measured(tmp_path, ranks: int, module: str, *args: str) -> dict:
    out = tmp_path / "r.json"
    r = mpirun(ranks, module, *args, "--quiet", "--json", str(out), "--timeout", "120", timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


REAL = {
    "gpt2": (4, "proxies.gpt2", ["8", "2", "4", "--iters", "2", "--warmup", "0"]),
    "gpt3-tp2-pp2": (
        4,
        "proxies.gpt3",
        ["4", "2", "--tp", "2", "--model", "gpt3-tiny", "--seq-len", "32", "--compute", "real"],
    ),
    "cosmoflow": (4, "proxies.cosmoflow", ["--model", "cosmoflow-tiny", "--global-batch", "2"]),
    "dlrm": (4, "proxies.dlrm", ["--model", "dlrm-tiny", "--compute", "real"]),
}
for _, _, a in REAL.values():
    a += ["--iters", "1", "--warmup", "1"] if "--iters" not in a else []


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(REAL))
def test_bf16_training_stays_within_tolerance_and_checks(tmp_path, name):
    ranks, module, args = REAL[name]
    want = measured(tmp_path, ranks, module, *args)
    got = measured(
        tmp_path, ranks, module, *args, "--dtype", "bf16", "--grad-dtype", "bf16", "--check"
    )
    assert got["config"]["dtype"] == "bf16" and got["config"]["grad_dtype"] == "bf16"
    assert got["loss"] == pytest.approx(want["loss"], rel=BF16_RTOL)
    # The measured JSON moves half the bytes in every category (gpt3's tp allgather also
    # carries the float32 loss statistics).
    mixed = {"tp_allgather"} if name.startswith("gpt3") else set()
    for c, v in want["bytes"].items():
        if c not in mixed:
            assert got["bytes"][c] == [n // 2 for n in v], c
    assert "dtype_cast" in got["breakdown_s"] and "dtype_cast" not in want["breakdown_s"]


@pytest.mark.mpi
def test_check_catches_a_corrupted_bf16_message():
    r = mpirun(
        4,
        "proxies.gpt2",
        *["4", "2", "4", "--iters", "1", "--warmup", "0", "--dtype", "bf16", "--check"],
        timeout=60,
        env={"PROXIES_FAULT": "corrupt:0"},
    )
    assert r.returncode != 0
    assert "--check: rank 1 received act_in mb 0 from rank 0" in r.stderr


@pytest.mark.mpi
@pytest.mark.parametrize(
    "module", ["proxies.gpt2", "proxies.gpt3", "proxies.cosmoflow", "proxies.dlrm"]
)
@pytest.mark.parametrize("option, value", [("--dtype", "bf8"), ("--grad-dtype", "float64")])
def test_bad_dtype_is_one_line_and_exit_2(module, option, value):
    r = mpirun(2, module, option, value, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and value in lines[0], r.stderr


@pytest.mark.slow
def test_only_bfloat16_runs_import_ml_dtypes():
    # the import alone takes 0.7 - 0.9 s of CPU with NumPy 2.4 (every rank, every launch):
    # a float32 or float16 run never pays it; asking for bfloat16 loads it
    code = (
        "import sys; import numpy as np\n"
        "import proxies.core.runner, proxies.core.check, proxies.gpt2.proxy, proxies.dlrm.proxy\n"
        "from proxies.core import wire\n"
        "assert wire.is_sixteen(np.float16) and not wire.is_sixteen(np.float32)\n"
        "assert not wire.is_sixteen(np.int16) and wire.epsilon(np.float16) == 2**-10\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported without bfloat16'\n"
        "bf = wire.numpy_dtype('bfloat16')\n"
        "assert 'ml_dtypes' in sys.modules and wire.is_sixteen(bf)\n"
        "assert wire.transport(np.zeros(3, bf)).dtype == np.uint16\n"
        "assert wire.epsilon(bf) == 2**-7 and wire.finfo(bf).bits == 16\n"
    )
    r = run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0, r.stderr
