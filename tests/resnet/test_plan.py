"""ResNet plans against hand arithmetic (no MPI): the C++ proxies' sizes, order, blocking
pattern and A100 times; DDP-style buckets; bad input refused before any work."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from proxies.core import cli
from proxies.core.plan import Collective, Compute, Wait
from proxies.core.simulate import simulate
from proxies.resnet.config import CPP_PRESETS, PRESETS
from proxies.resnet.model import ResNetModel
from proxies.resnet.plans import piece_ranges
from proxies.resnet.proxy import make_job, parser


def job(*argv: str, world: int = 4):
    return make_job(parser().parse_args(list(argv)), world)


def ops(*argv: str, world: int = 4):
    return job(*argv, world=world).plan(0).ops


def allreduces(plan_ops):
    return [
        (o.count, bool(o.req))
        for o in plan_ops
        if isinstance(o, Collective) and o.kind == "allreduce"
    ]


def test_cpp_resnet50_six_blocking_allreduces_after_the_backward():
    got = ops("--model", "dnn-cpp-proxies-resnet50")
    # comm_only/resnet50.cpp's msgSize[] with MSGAGG, in its order, all MPI_Allreduce
    assert allreduces(got) == [
        (3_104_745, False),
        (4_461_568, False),
        (4_462_592, False),
        (4_986_880, False),
        (4_468_736, False),
        (4_074_560, False),
    ]
    assert [type(o).__name__ for o in got[:2]] == ["Compute", "Compute"]  # nothing between
    assert not any(isinstance(o, Wait) for o in got)
    assert job("--model", "dnn-cpp-proxies-resnet50").config["compute"] == "none"


def test_cpp_resnet152_ten_buckets_each_after_a_tenth_of_the_backward():
    got = ops("--model", "dnn-cpp-proxies-resnet152")
    sizes = [6511592, 6567936, 5905920, 6113280, 6176256, 6112768, 6176256, 6112768, 5321216,
             5194816]  # fmt: skip
    assert allreduces(got) == [(n, True) for n in sizes]
    assert sum(sizes) == 60_192_808
    # forward 119,000 us; then (backward slice 23,800 us, MPI_Iallreduce) x 10; MPI_Waitall
    assert isinstance(got[0], Compute) and got[0].seconds == pytest.approx(0.119)
    for i in range(10):
        c, a = got[1 + 2 * i], got[2 + 2 * i]
        assert isinstance(c, Compute) and c.seconds == pytest.approx(0.0238)
        assert isinstance(a, Collective) and a.req == f"bucket{i}"
    assert [o.req for o in got[21:]] == [f"bucket{i}" for i in range(10)]
    compute = sum(o.seconds for o in got if isinstance(o, Compute))
    assert compute == pytest.approx(0.119 + 10 * 0.0238)  # 357 ms, the C++ slept time
    assert simulate([job("--model", "dnn-cpp-proxies-resnet152").plan(r) for r in range(4)])


def test_which_cpp_sizes_end_at_tensor_boundaries():
    """ResNet-152's ten buckets end at torchvision's tensors in backward order; ResNet-50's
    six (TensorFlow's order, 1001 classes) do not all."""

    def ends(pre):
        cum, out = 0, set()
        for _, n in reversed(pre.model.tensors):
            cum += n
            out.add(cum)
        return [c in out for c in itertools.accumulate(pre.sizes)]

    assert all(ends(CPP_PRESETS["dnn-cpp-proxies-resnet152"]))
    assert ends(CPP_PRESETS["dnn-cpp-proxies-resnet50"]) == [True, True, False, True, True, True]


@pytest.mark.parametrize(
    "world,batch,fwd_us,bwd_us",
    [(256, 128, 119000, 23800), (512, 64, 63000, 12600), (1024, 32, 36000, 7200),
     (2048, 16, 27667, 5533)],
)  # fmt: skip
def test_cpp_resnet152_scaled_by_world_size(world, batch, fwd_us, bwd_us):
    j = job("--model", "dnn-cpp-proxies-resnet152-scal", world=world)
    assert j.config["batch_per_replica"] == batch and j.config["global_batch"] == 32768
    got = j.plan(0).ops
    compute = sum(o.seconds for o in got if isinstance(o, Compute))
    assert compute == pytest.approx((fwd_us + 10 * bwd_us) * 1e-6)
    assert len(allreduces(got)) == 10


def test_cpp_resnet152_real_compute_posts_its_buckets_as_the_backward_completes_them():
    got = ops("--model", "dnn-cpp-proxies-resnet152", "--compute", "real", "--batch", "2")
    colls = [(i, o) for i, o in enumerate(got) if isinstance(o, Collective)]
    assert [o.count for _, o in colls] == list(CPP_PRESETS["dnn-cpp-proxies-resnet152"].sizes)
    # contiguous slices of the flat gradients, in backward order
    assert [(o.buf.lo, o.buf.hi) for _, o in colls][:2] == [(0, 6_511_592), (6_511_592, 13_079_528)]
    # each right after the backward op completing its last tensor: the first ends with
    # layer4.2 (fc + layer4.2 = 6,511,592), the last with the stem
    assert got[colls[0][0] - 1].name == "layer4.2.backward"
    assert got[colls[-1][0] - 1].name == "stem.backward"
    assert all(o.req for _, o in colls)


def test_buckets_close_at_25_mib_in_backward_order():
    """ResNet-50 at the default 25 MiB (6,553,600 floats), tensors in reverse parameter
    order, a bucket closed once it holds that many."""
    got = allreduces(ops("--model", "resnet50", "--compute", "model"))
    fc = 2048 * 1000 + 1000
    block = 2048 * 512 + 512 * 512 * 9 + 512 * 2048 + 2 * (512 + 512 + 2048)  # layer4.2
    assert fc + block == 6_511_592  # < 6,553,600: layer4.1's bn3 and conv3 join
    first = fc + block + 2 * 2048 + 512 * 2048
    assert got[0] == (first, True) and first == 7_564_264
    assert sum(n for n, _ in got) == 25_557_032 and all(req for _, req in got)
    assert [n for n, _ in got] == [7_564_264, 6_563_840, 7_091_712, 4_337_216]


def test_fused_and_per_tensor_after_the_backward():
    fused = ops("--model", "resnet50", "--compute", "model", "--grad-sync", "fused")
    assert allreduces(fused) == [(25_557_032, False)]
    per = allreduces(ops("--model", "resnet50", "--compute", "model", "--grad-sync", "per-tensor"))
    assert len(per) == 161 and per[0] == (1000, False) and per[-1] == (64 * 3 * 49, False)
    assert not allreduces(ops(world=1))  # one replica: nothing to reduce


def test_batch_norm_buffers_broadcast_before_the_forward():
    """DDP's broadcast_buffers: ResNet-50's 53 batch norms hold 26,560 channels: 53,120
    floats of running mean and var, and 53 int64 counters, from rank 0 before the stem."""
    got = ops("--model", "resnet50", "--compute", "model")
    assert [(o.kind, o.count, o.dtype) for o in got[:2]] == [
        ("bcast", 53_120, "float32"),
        ("bcast", 53, "int64"),
    ]
    assert got[2].name == "stem.forward"
    off = ops("--model", "resnet50", "--compute", "model", "--broadcast-buffers", "off")
    assert not any(isinstance(o, Collective) and o.kind == "bcast" for o in off)
    assert not any(
        isinstance(o, Collective) and o.kind == "bcast" for o in ops("--model", "resnet50", world=1)
    )


def test_plan_ranges_are_the_model_layout():
    cfg = PRESETS["resnet-tiny"]
    m = ResNetModel(cfg)
    assert {p: m.piece_range(p) for p in m.pieces()} == piece_ranges(cfg)


def test_model_compute_is_flops_at_the_device_rate():
    got = ops("--model", "resnet50", "--batch", "1", "--compute", "model")
    fwd = sum(o.flops for o in got if isinstance(o, Compute) and o.name.endswith(".forward"))
    assert fwd == pytest.approx(8.178e9, rel=1e-3)  # 4.09 G multiply-adds per image
    bwd = sum(o.flops for o in got if isinstance(o, Compute) and o.name.endswith(".backward"))
    stem = 2.0 * 64 * 112 * 112 * 3 * 49  # the stem conv: no input gradient
    assert bwd == pytest.approx(2 * fwd - stem)


BAD = [
    (["--model", "dnn-cpp-proxies-resnet50", "--compute", "real"], 4, "--compute real"),
    (["--model", "dnn-cpp-proxies-resnet50", "--compute", "replay"], 4, "--compute replay"),
    (["--model", "dnn-cpp-proxies-resnet152", "--image-size", "64"], 4, "--image-size"),
    (["--model", "dnn-cpp-proxies-resnet152-scal"], 8, "256, 512, 1024, 2048 ranks"),
    (["--model", "dnn-cpp-proxies-resnet152", "--batch", "8"], 4, "for batch 128"),
    (["--model", "dnn-cpp-proxies-resnet50", "--image-size", "64"], 4, "--image-size"),
    (["--model", "dnn-cpp-proxies-resnet50", "--grad-sync", "fused"], 4, "--grad-sync"),
    (["--model", "dnn-cpp-proxies-resnet152", "--broadcast-buffers", "on"], 4, "--broadcast"),
    (["--grad-sync", "fused", "--bucket-mb", "1"], 4, "--bucket-mb needs --grad-sync buckets"),
]


@pytest.mark.parametrize("argv,world,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_refused(argv, world, words):
    with pytest.raises(cli.UsageError, match=words.replace("-", "\\-")):
        job(*argv, world=world)


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "proxies.resnet", "--model", "dnn-cpp-proxies-resnet50",
         "--compute", "real", "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("proxies.resnet: error: --compute real")
