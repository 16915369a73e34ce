import numpy as np
import pytest

from proxies.transformer.data import DataError, Synthetic, TokenFile, batch, write_token_file


def test_synthetic_samples_depend_only_on_seed_and_index():
    a, b = Synthetic(0, 50257, 16), Synthetic(0, 50257, 16)
    assert np.array_equal(a.sample(7), b.sample(7))
    assert not np.array_equal(a.sample(7), a.sample(8))
    assert not np.array_equal(a.sample(7), Synthetic(1, 50257, 16).sample(7))
    x, y = batch(a, 10, 3)
    assert x.shape == y.shape == (3, 16)
    assert np.array_equal(x[1, 1:], y[1, :-1])  # targets are inputs shifted by one
    assert x.max() < 50257 and x.min() >= 0


def test_token_file_windows(tmp_path):
    path = str(tmp_path / "t.bin")
    write_token_file(path, np.arange(100) % 50)
    f = TokenFile(path, vocab=50, T=8)
    assert f.windows == 99 // 8
    assert np.array_equal(f.sample(0), np.arange(9))
    assert np.array_equal(f.sample(1), np.arange(8, 17))
    assert np.array_equal(f.sample(f.windows), f.sample(0))  # wraps around


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: p.write_bytes(b"\0" * 2048), "not an llm.c token file"),
        (lambda p: write_token_file(str(p), np.arange(5)), "fewer than one sample"),
        (lambda p: write_token_file(str(p), np.array([1, 2, 60000] * 10)), "outside the model"),
    ],
)
def test_bad_token_files(tmp_path, make, message):
    path = tmp_path / "bad.bin"
    make(path)
    with pytest.raises(DataError, match=message):
        TokenFile(str(path), vocab=50257, T=8)


def test_truncated_token_file(tmp_path):
    path = tmp_path / "cut.bin"
    write_token_file(str(path), np.arange(100))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="header says 100 tokens"):
        TokenFile(str(path), vocab=50257, T=8)
