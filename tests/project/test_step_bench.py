"""benchmarks/gpt2_step.py on tiny models: sane numbers, bad input, agreement with torch; its
model side (benchmarks/step_shard.py: the StageShard at tp = pp = 1) against hand
arithmetic, and a padded vocabulary (GPT-3 presets) against the unpadded model."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpt2_step.py")
TINY = [
    "--preset",
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


def _load():
    """benchmarks/gpt2_step.py as a module (it puts benchmarks/ on sys.path for its parts)."""
    spec = importlib.util.spec_from_file_location("bench_gpt2_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load()
import step_report  # noqa: E402  (benchmarks/, on sys.path since the load above)
import step_shard  # noqa: E402

pytestmark = pytest.mark.slow  # subprocess runs of benchmarks/gpt2_step.py


def run_bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """One tiny run for the tests below, side by side with torch where it is installed."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = [*TINY, "--shapes", "2x16,1x8", "--json", str(out)]
    if importlib.util.find_spec("torch") is not None:
        args.append("--torch")
    r = run_bench(*args, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MFU" in r.stdout and "BLAS threads" in r.stdout
    return json.loads(out.read_text())


def test_tiny_run_reports_sane_numbers(tiny):
    assert tiny["config"]["layers"] == 2 and tiny["machine"]["blas_threads"] >= 1
    assert tiny["config"]["padded_vocab_size"] == tiny["config"]["vocab_size"] == 50257
    recs = tiny["results"]
    assert [(x["B"], x["T"]) for x in recs] == [(2, 16), (1, 8)]
    for x in recs:
        assert 0 < x["ms_min"] <= x["ms_per_step"] <= x["ms_max"]
        assert x["tokens_per_s"] == pytest.approx(x["B"] * x["T"] / x["ms_per_step"] * 1e3)
        assert x["matmul_gflops"] > 0 and 0 < x["mfu"] < 1.5
        assert x["peak_rss_mb"] > 0 and math.isfinite(x["memory_ratio"]) and x["memory_ratio"] > 0
        assert x["memory_bound_mb"] > x["state_mb"] > 0
        assert len(x["losses"]) == 3 and all(math.isfinite(v) for v in x["losses"])
        assert x["losses"][0] == pytest.approx(math.log(50257), rel=0.05)  # untrained: ~ln V


def test_torch_agrees(tiny):
    pytest.importorskip("torch")
    for x in tiny["results"]:
        assert x["loss_rel_diff"] <= step_report.LOSS_TOL
        assert x["grad_rel_diff"] <= step_report.GRAD_TOL
        assert x["loss_rel_diff_last"] <= step_report.LOSS_TOL_LAST
        assert x["torch_ms_per_step"] > 0 and x["ratio_vs_torch"] > 0
        assert len(x["torch_losses"]) == len(x["losses"])
        # the BLAS comparison: the same mix's FLOPs at each rate, and the derived ratio
        assert x["gemm_ms"] * x["matmul_gflops"] == pytest.approx(
            x["torch_gemm_ms"] * x["torch_matmul_gflops"]
        )
        swapped = x["ms_per_step"] - x["gemm_ms"] + x["torch_gemm_ms"]
        assert x["ratio_at_torch_blas"] == pytest.approx(swapped / x["torch_ms_per_step"])


def test_torch_agrees_on_a_padded_vocabulary(tmp_path):
    """gpt3-tiny: the shard's wte has Vp = 50304 rows, the reference V = 50257."""
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    r = run_bench(
        *TINY[2:], "--preset", "gpt3-tiny", "--shapes", "1x8", "--torch", "--json", str(out)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert got["config"]["padded_vocab_size"] == 50304
    x = got["results"][0]
    assert x["loss_rel_diff"] <= step_report.LOSS_TOL and x["grad_rel_diff"] <= step_report.GRAD_TOL


@pytest.mark.parametrize("preset,vocab", [("gpt2-tiny", 50257), ("gpt3-tiny", 50304)])
def test_model_flops_by_hand_and_the_gemm_mix(preset, vocab):
    """The plan's FLOPs: 3 x (L (24 N C^2 + 4 B T^2 C) + 2 N C Vp); the GEMM mix multiplies
    the real V rows only, so it is 3 x 2 N C (Vp - V) short of them for GPT-3 presets."""
    B, T, L, C, V = 2, 16, 1, 64, 50257
    m = step_shard.Step(step_shard.PRESETS[preset].with_layers(L), B, T, 0)
    assert m.S.vocab == vocab and m.S.tp == m.S.pp == 1
    N = B * T
    want = 3.0 * (L * (24 * N * C * C + 4 * B * T * T * C) + 2 * N * C * vocab)
    assert m.model_flops() == want
    gemms = step_report.step_gemms(m.S.cfg, B, T, m.shard.keeps_logits)
    assert sum(g[1] for g in gemms) == pytest.approx(want - 6.0 * N * C * (vocab - V))


def test_padding_changes_nothing():
    """gpt3-tiny and gpt2-tiny have the same widths and weights; the padded vocabulary of the
    first leaves its loss and gradients as the unpadded model's, padding rows without one."""
    B, T = 2, 16
    steps = [
        step_shard.Step(step_shard.PRESETS[p].with_layers(2), B, T, 0)
        for p in ("gpt2-tiny", "gpt3-tiny")
    ]
    x, y = step_shard.tokens(steps[0].S.cfg, B, T, 1, 0)[0]
    losses = [s.forward_backward(x, y) for s in steps]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    g2, g3 = steps[0].grads(), steps[1].grads()
    V = 50257
    assert not g3["wte"][V:].any()
    for name, g in g2.items():
        theirs = g3[name][:V] if name == "wte" else g3[name]
        if name == "wpe":  # GPT-3's context is 128 rows, GPT-2's 1024; T = 16 get one
            assert not g[T:].any() and not theirs[T:].any()
            g, theirs = g[:T], theirs[:T]
        np.testing.assert_allclose(theirs, g, rtol=1e-4, atol=1e-6 * np.abs(g).max(), err_msg=name)


def test_compare_grads_finds_a_wrong_tensor_and_a_padding_gradient():
    m = step_shard.Step(step_shard.PRESETS["gpt3-tiny"].with_layers(1), 1, 8, 0)
    m.forward_backward(*step_shard.tokens(m.S.cfg, 1, 8, 1, 0)[0])
    V = m.S.cfg.vocab_size

    def ref(grads):  # what torch_reference's named() gives: .grad.numpy() per tensor
        wrap = lambda a: SimpleNamespace(grad=SimpleNamespace(numpy=lambda: a))  # noqa: E731
        return SimpleNamespace(named=lambda: {n: wrap(g) for n, g in grads.items()})

    same = {n: (g[:V] if n == "wte" else g).copy() for n, g in m.grads().items()}
    assert step_shard.compare_grads(m, ref(same))["grad_rel_diff"] == 0.0
    same["h.0.mlp.c_fc.weight"][3, 5] += 1.0
    got = step_shard.compare_grads(m, ref(same))
    assert got["grad_worst_tensor"] == "h.0.mlp.c_fc.weight" and got["grad_rel_diff"] > 1e-3
    same["h.0.mlp.c_fc.weight"][3, 5] -= 1.0
    m.grads()["wte"][V + 1, 0] = 1e-3
    got = step_shard.compare_grads(m, ref(same))
    assert got == {"grad_rel_diff": math.inf, "grad_worst_tensor": "wte padding"}


def test_saved_bytes_are_the_memory_model_of_the_shard():
    """What the forward keeps, read off the arrays, equals transformer/memory.py's count of
    them."""
    from proxies.transformer.memory import saved_state

    m = step_shard.Step(step_shard.PRESETS["gpt2-tiny"].with_layers(2), 2, 16, 0)
    m.forward(*step_shard.tokens(m.S.cfg, 2, 16, 1, 0)[0])
    assert m.saved_bytes() == saved_state(m.S, m.chunk)


@pytest.mark.parametrize(
    "args,words",
    [
        (["--shapes", "4x"], ["--shapes 4x", "BxT"]),
        (["--shapes", "0x64"], ["--shapes 0x64"]),
        (["--shapes", "1x2048"], ["T = 2048", "context of 1024"]),
        (["--preset", "gpt3-tiny", "--shapes", "1x256"], ["T = 256", "context of 128"]),
        (["--steps", "0"], ["--steps", "positive integer"]),
        (["--preset", "gpt5"], ["--preset", "invalid choice"]),
        (["--model", "gpt5"], ["--preset", "invalid choice"]),
        (["--json", "/no/such/dir/out.json"], ["no such directory"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
    r = run_bench(*args, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpt2_step.py: error: "), r.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert r.stdout == ""


def test_torch_missing_is_one_line_and_exit_2():
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here")
    r = run_bench(*TINY, "--torch", timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("gpt2_step.py: error: --torch needs")


def test_memory_child_imports_no_torch():
    r = run_bench("--memory-child", "2x16", *TINY[:4])
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout)
    assert mem["torch_loaded"] is False and mem["peak_rss_mb"] > mem["state_mb"] > 0
    assert mem["acts_mb"] > 0


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
    assert x["loss_rel_diff"] <= step_report.LOSS_TOL
    assert x["loss_rel_diff_last"] <= step_report.LOSS_TOL_LAST
