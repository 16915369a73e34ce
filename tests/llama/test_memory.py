"""LLaMA's memory estimate (transformer/memory.py): the saved state by hand (GQA's qkv,
SwiGLU's [gate | up] and activation, RMSNorm's one statistic), and within 25% of a real
run's measured peak (tests/core/test_memory.py's probe)."""

from __future__ import annotations

import json
import sys

import pytest
from core.test_memory import PROBE, SHORT
from launch import mpiexec, run

from proxies.core import exits, memory
from proxies.llama.proxy import make_job, parser
from proxies.transformer.memory import saved_state, weight_temps
from proxies.transformer.state import LayerActs


def test_saved_state_by_hand():
    j = make_job(parser().parse_args(["4", "1", "--model", "llama-tiny", "--tp", "2"]), 2)
    S = j.setup
    B, T, C, F, tp = 1, 128, 64, 160, 2
    qkv = (4 + 2 * 2) * 16 // tp  # (NH + 2 KVH) hs / tp
    layer = B * (4 * T * C + 2 * T + T * qkv + T * C // tp) + B * (4 // tp) * T * T
    layer += B * T * (2 * F + F) // tp  # [gate | up] and silu(gate) * up
    head = B * (T * C + T + T) + S.N * (S.vocab // tp + 1)
    (ch,) = S.chunks(0)
    assert saved_state(S, ch) == 4 * (2 * B * T * C + 4 * layer + head)
    assert weight_temps(S, True) > 0
    # the shard allocates what the estimate counts
    from proxies.transformer.llama_model import LlamaShard

    st = LlamaShard(S, 0)._alloc(0)
    a = st.layers[0]
    fields = [getattr(a, f) for f in LayerActs.__dataclass_fields__]
    held = sum(x.size for x in fields if hasattr(x, "size"))
    assert 4 * held == 4 * layer


@pytest.mark.mpi
def test_estimate_within_25_percent_of_measured_peak():
    argv = ["llama", "--model", "llama-tiny", "--micro-batch", "64", *SHORT]
    r = run([mpiexec(), "-n", "1", sys.executable, "-c", PROBE, *argv], timeout=120)
    assert r.returncode == exits.OK, r.stderr
    got = json.loads(r.stdout.split("MEMORY ", 1)[1])
    est = got["est"]
    measured = got["peak"] - got["base"]
    estimated = memory.total(est) - est["baseline"]
    assert 0.75 <= measured / estimated <= 1.25, (measured >> 20, estimated >> 20, est)
