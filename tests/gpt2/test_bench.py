"""python -m proxies.gpt2.bench on a tiny model: sane numbers, bad input, agreement with torch."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from proxies.gpt2 import bench

pytestmark = pytest.mark.slow  # subprocess runs of benchmarks/gpt2_step.py

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [
    "--model",
    "gpt2-tiny",
    "--layers",
    "2",
    "--shapes",
    "2x16",
    "--steps",
    "2",
    "--warmup",
    "1",
]


def run_bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpt2_step.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """One tiny run for the tests below, side by side with torch where it is installed."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = [*TINY, "--shapes", "2x16,1x8", "--json", str(out)]
    if importlib.util.find_spec("torch") is not None:
        args.append("--torch")
    r = run_bench(*args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MFU" in r.stdout and "BLAS threads" in r.stdout
    return json.loads(out.read_text())


def test_tiny_run_reports_sane_numbers(tiny):
    assert tiny["config"]["layers"] == 2 and tiny["machine"]["blas_threads"] >= 1
    recs = tiny["results"]
    assert [(x["B"], x["T"]) for x in recs] == [(2, 16), (1, 8)]
    for x in recs:
        assert 0 < x["ms_min"] <= x["ms_per_step"] <= x["ms_max"]
        assert x["tokens_per_s"] == pytest.approx(x["B"] * x["T"] / x["ms_per_step"] * 1e3)
        assert x["matmul_gflops"] > 0 and 0 < x["mfu"] < 1.5
        assert x["peak_rss_mb"] > 0 and math.isfinite(x["memory_ratio"]) and x["memory_ratio"] > 0
        assert x["memory_bound_mb"] > x["state_mb"] > 0
        assert len(x["losses"]) == 3 and all(math.isfinite(v) for v in x["losses"])


def test_torch_agrees(tiny):
    pytest.importorskip("torch")
    for x in tiny["results"]:
        assert x["loss_rel_diff"] <= bench.LOSS_TOL
        assert x["grad_rel_diff"] <= bench.GRAD_TOL
        assert x["loss_rel_diff_last"] <= bench.LOSS_TOL_LAST
        assert x["torch_ms_per_step"] > 0 and x["ratio_vs_torch"] > 0
        assert len(x["torch_losses"]) == len(x["losses"])
        # the BLAS comparison: the same mix's FLOPs at each rate, and the derived ratio
        assert x["gemm_ms"] * x["matmul_gflops"] == pytest.approx(
            x["torch_gemm_ms"] * x["torch_matmul_gflops"]
        )
        swapped = x["ms_per_step"] - x["gemm_ms"] + x["torch_gemm_ms"]
        assert x["ratio_at_torch_blas"] == pytest.approx(swapped / x["torch_ms_per_step"])


def test_flops_and_gemm_mix_cover_the_model():
    m = bench.build(bench.PRESETS["gpt2-tiny"].with_layers(1), 2, 16, 0)
    total = sum(g[1] for g in bench.step_gemms(m.cfg, 2, 16))
    assert total == pytest.approx(3 * m.flops_forward())


@pytest.mark.parametrize(
    "args,words",
    [
        (["--shapes", "4x"], ["--shapes 4x", "BxT"]),
        (["--shapes", "0x64"], ["--shapes 0x64"]),
        (["--shapes", "1x2048"], ["T = 2048", "context of 1024"]),
        (["--steps", "0"], ["--steps", "positive integer"]),
        (["--model", "gpt5"], ["--model", "invalid choice"]),
        (["--json", "/no/such/dir/out.json"], ["no such directory"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
    r = run_bench(*args, timeout=30)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("proxies.gpt2.bench: error: "), r.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert r.stdout == ""


def test_memory_child_imports_no_torch():
    r = subprocess.run(
        [sys.executable, "-m", "proxies.gpt2.bench", "--memory-child", "2x16", *TINY[:4]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout)
    assert mem["torch_loaded"] is False and mem["peak_rss_mb"] > mem["state_mb"] > 0


def test_torch_default_adamw_trains_the_same(tmp_path):
    """--torch-adamw default: PyTorch's AdamW without flags; the same losses."""
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    r = run_bench(
        *TINY, "--shapes", "1x8", "--torch", "--torch-adamw", "default", "--json", str(out)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert got["config"]["torch_adamw"] == "default"
    x = got["results"][0]
    assert x["loss_rel_diff"] <= bench.LOSS_TOL and x["loss_rel_diff_last"] <= bench.LOSS_TOL_LAST
