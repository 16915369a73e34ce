"""The ResNet model: torchvision's parameter counts, the whole backward against finite
differences, flat gradient ranges in backward order, seeded samples."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check

from proxies.resnet.config import CPP_PRESETS, PRESETS, ResNetConfig
from proxies.resnet.model import ResNetModel, batch, reference_losses, sample

# A model small enough for finite differences in float64: 16x16 images, 2 blocks in stage 1
# (an identity shortcut), projections on every stage, 3 classes.
SMALL = ResNetConfig("small", (2, 1), (2, 3), 4, image_size=16, classes=3, batch=3)


def test_parameter_counts_are_torchvision():
    assert PRESETS["resnet50"].num_params == 25_557_032
    assert PRESETS["resnet152"].num_params == 60_192_808
    assert len(PRESETS["resnet50"].tensors) == 161  # as the C++ proxy's per-tensor list
    # the C++ ResNet-50's 25,559,081 gradients: the same net with 1001 classes (TensorFlow's)
    assert CPP_PRESETS["dnn-cpp-proxies-resnet50"].model.num_params == 25_559_081
    assert sum(CPP_PRESETS["dnn-cpp-proxies-resnet50"].sizes) == 25_559_081
    assert sum(CPP_PRESETS["dnn-cpp-proxies-resnet152"].sizes) == 60_192_808


def test_resnet50_forward_flops():
    # 4.09 G multiply-adds per 224x224 image (the figure usually quoted for ResNet-50 v1.5)
    assert sum(PRESETS["resnet50"].forward_flops(1).values()) == pytest.approx(8.18e9, rel=1e-3)


def test_pieces_own_contiguous_ranges_in_backward_order():
    m = ResNetModel(SMALL)
    ranges = [m.piece_range(p) for p in reversed(m.pieces())]
    assert ranges[0][0] == 0 and ranges[-1][1] == m.params.size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_whole_backward_against_finite_differences():
    m = ResNetModel(SMALL, seed=3, dtype=np.float64)
    images, labels = batch(SMALL, 0, 0, 3, np.float64)
    m.forward_backward(images, labels)
    got = m.grads.copy()
    rng = np.random.default_rng(0)
    # two entries of every tensor (38), batch-norm ones included
    idx = [lo + int(rng.integers(hi - lo)) for lo, hi in m.offsets.values() for _ in range(2)]
    want = []
    for i in idx:
        old = m.params[i]
        vals = []
        for e in (1e-5, -1e-5):
            m.params[i] = old + e
            vals.append(m.forward_backward(images, labels))
            m.cache.clear()
        m.params[i] = old
        want.append((vals[0] - vals[1]) / 2e-5)
    check("model gradient", got[idx], np.array(want), atol=1e-6, rtol=1e-4)


def test_samples_are_seeded_per_index():
    a, la = sample(PRESETS["resnet-tiny"], 0, 5)
    b, lb = batch(PRESETS["resnet-tiny"], 0, 4, 2)
    assert np.array_equal(a, b[1]) and la == lb[1]
    assert not np.array_equal(a, b[0])


def test_reference_trains():
    losses = reference_losses(PRESETS["resnet-tiny"], 2, 2, 4, lr=0.02)
    assert losses[-1] < losses[0]
