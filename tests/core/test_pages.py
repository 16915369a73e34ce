"""proxies.core.pages: zeroed buffers on huge-page-advised memory, carved without overlap,
aligned, given back when unused; PROXIES_HUGE_PAGES=off gives plain np.zeros."""

import gc

import ml_dtypes
import numpy as np
import pytest

from proxies.core import pages


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def test_zeros_has_the_shape_dtype_and_zeros_asked_for():
    for shape, dtype in [(5, np.float32), ((3, 4), np.int64), ((2, 3, 5), ml_dtypes.bfloat16),
                         (0, np.float32), ((1 << 20) + 3, np.float32)]:  # fmt: skip
        a = pages.zeros(shape, dtype)
        want = np.zeros(shape, dtype)
        assert a.shape == want.shape and a.dtype == want.dtype
        assert a.flags.c_contiguous and a.flags.writeable
        assert not a.any()


def test_buffers_never_overlap_and_are_aligned():
    sizes = [1, 7, 63, 64, 4095, 4096, 10_000, (1 << 20) + 1, 5 << 20, 3, 2 << 20]
    bufs = [pages.zeros(n, np.uint8) for n in sizes]
    for k, b in enumerate(bufs):
        b[...] = k + 1
    for k, b in enumerate(bufs):
        assert (b == k + 1).all(), k  # nothing later written over it
        addr = b.ctypes.data
        align = pages.HUGE if b.nbytes >= pages.OWN else 4096 if b.nbytes >= 4096 else 64
        assert addr % align == 0, (b.nbytes, addr % align)
    spans = sorted((b.ctypes.data, b.ctypes.data + b.nbytes) for b in bufs)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


def test_small_buffers_share_a_mapping_that_goes_when_they_do():
    a, b = pages.zeros(100, np.float32), pages.zeros(100, np.float32)
    assert 0 < b.ctypes.data - a.ctypes.data < 4096  # carved side by side
    whole = pages._carver.whole
    assert whole is not None and whole() is not None
    del a, b
    gc.collect()
    assert whole() is None  # the last buffer gone: the chunk is unmapped
    c = pages.zeros(10, np.float32)  # and a new one is made
    assert not c.any() and pages._carver.whole() is not None


def test_off_is_plain_numpy(monkeypatch):
    monkeypatch.setenv("PROXIES_HUGE_PAGES", "off")
    assert not pages.enabled()
    a = pages.zeros((4, 4), np.float32)
    assert a.flags.owndata and not a.any()
    monkeypatch.setenv("PROXIES_HUGE_PAGES", "on")
    assert pages.enabled() == hasattr(__import__("mmap"), "MADV_HUGEPAGE")


@pytest.mark.skipif(_thp() == "never" or pages.huge_bytes() is None, reason="no THP here")
def test_written_buffers_land_on_huge_pages():
    before = pages.huge_bytes()
    big = pages.zeros(8 << 20, np.uint8)
    big[...] = 1
    assert pages.huge_bytes() - before >= 6 << 20  # the kernel may leave a page or two small
    small = [pages.zeros(1000, np.float32) for _ in range(600)]  # 2.3 MiB in all
    for s in small:
        s[...] = 2
    # carved together they take a couple of huge pages, not one each
    assert pages.huge_bytes() - before < (8 << 20) + (8 << 20)


def _carved(a: np.ndarray) -> bool:
    """Whether a's memory is one of pages' mappings (its base chain ends at an mmap)."""
    import mmap

    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)


def _plan_buffers(plan, get) -> list[np.ndarray]:
    """Every buffer a plan's messages and collectives use, through the runtime's `get`."""
    from proxies.core.plan import Collective

    out = [get(m.buf, m.mb, m.chunk) for _, m, _ in plan.messages()]
    out += [get(op.buf, op.mb, 0) for op in plan.ops if isinstance(op, Collective)]
    return out


def test_proxies_communicate_from_pages_buffers():
    """Every buffer a run communicates from, for one plan of each runtime kind: the
    transformer family's pool (model/none), CosmoFlow's and DLRM's runtimes; and the
    engine's wire and our algorithms' receive buffers."""
    from proxies.core.collectives.common import scratch
    from proxies.core.wire import Staging
    from proxies.cosmoflow import proxy as cosmoflow
    from proxies.dlrm import proxy as dlrm
    from proxies.gpt3 import proxy as gpt3
    from proxies.transformer.runtime import BufferPool

    assert not _carved(np.zeros(1 << 20, np.float32))  # what the check tells apart
    job = gpt3.make_job(gpt3.parser().parse_args(["4", "2", "--tp", "2", "--dry-run"]), 8)
    plan = job.plan(job.grid.rank_of(pp=1))
    pool = BufferPool(plan, job.setup.inflight)
    assert all(map(_carved, _plan_buffers(plan, lambda b, mb, c: pool.get(b, mb))))

    job = cosmoflow.make_job(cosmoflow.parser().parse_args(["--shards", "2", "--dry-run"]), 4)
    rt = job.runtime(1, None, {}, "none")
    assert rt.bufs and all(map(_carved, rt.bufs.values()))

    args = dlrm.parser().parse_args(["--model", "dlrm-tiny", "--dry-run"])
    job = dlrm.make_job(args, 2)
    rt = job.runtime(1, None, {}, "none")
    got = _plan_buffers(job.plan(1), rt.buffer)
    assert got and all(map(_carved, got))

    assert _carved(Staging().narrow(np.zeros(8, np.float32), np.dtype(np.float16)))
    assert _carved(scratch(1000, np.float32, slot=7))
