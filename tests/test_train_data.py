"""Data sources (embedded; users' formats on fixtures made here) and deterministic batches."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest

from train.config import Data
from train.data import Batches, eval_batches, load, read_idx
from train.errors import SetupError


def test_embedded_digits_are_real_and_split_by_seed():
    ds = load(Data(source="digits"), task="classify")
    assert ds.train_x.shape[1:] == (8, 8, 1) and ds.train_x.dtype == np.float32
    assert len(ds.train_x) + len(ds.test_x) == 1797 and ds.num_classes == 10
    assert 0.0 <= ds.train_x.min() and ds.train_x.max() <= 1.0
    assert set(np.unique(ds.train_y)) == set(range(10))
    again = load(Data(source="digits"), task="classify")
    np.testing.assert_array_equal(ds.test_y, again.test_y)
    other = load(Data(source="digits", split_seed=1), task="classify")
    assert not np.array_equal(ds.test_y, other.test_y)


def test_embedded_corpus_is_byte_level_text():
    ds = load(Data(source="corpus", seq_len=32), task="lm")
    assert ds.vocab_size == 256 and ds.train_x.dtype == np.int32
    assert ds.num_examples("train") > 1000
    batch = ds.examples(np.array([0, 5]))
    assert batch["x"].shape == batch["y"].shape == (2, 32)
    np.testing.assert_array_equal(batch["x"][:, 1:], batch["y"][:, :-1])  # shifted by one


def _write_idx(path, array: np.ndarray, gz: bool):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(raw)


def test_mnist_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 12, dtype=np.uint8)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", images, gz=True)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels, gz=True)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", images[:4], gz=False)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:4], gz=False)
    np.testing.assert_array_equal(read_idx(tmp_path / "t10k-images-idx3-ubyte"), images[:4])
    ds = load(Data(source="mnist", path=str(tmp_path)), task="classify")
    assert ds.train_x.shape == (12, 28, 28, 1) and ds.test_x.shape == (4, 28, 28, 1)
    np.testing.assert_allclose(ds.train_x[..., 0], images / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.train_y, labels)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")


def test_cifar10_pickle_directory(tmp_path):
    rng = np.random.default_rng(0)

    def batch(n):
        return {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": list(rng.integers(0, 10, n)),
        }

    parts = {name: batch(6) for name in ("data_batch_1", "data_batch_2", "test_batch")}
    for name, d in parts.items():
        (tmp_path / name).write_bytes(pickle.dumps(d))
    ds = load(Data(source="cifar10", path=str(tmp_path)), task="classify")
    assert ds.train_x.shape == (12, 32, 32, 3) and ds.test_x.shape == (6, 32, 32, 3)
    # Channel-major rows (R plane, G plane, B plane) become HWC pixels.
    first = parts["data_batch_1"][b"data"][0]
    assert ds.train_x[0, 0, 0, 1] == pytest.approx(first[1024] / 255.0)
    assert list(ds.train_y[:6]) == parts["data_batch_1"][b"labels"]
    with pytest.raises(SetupError, match="not a CIFAR-10"):
        load(Data(source="cifar10", path=str(tmp_path / "missing")), task="classify")


def test_npz_with_and_without_test_split(tmp_path):
    x = np.arange(20 * 4 * 4, dtype=np.uint8).reshape(20, 4, 4)
    y = np.arange(20) % 3
    np.savez(tmp_path / "a.npz", x_train=x, y_train=y, x_test=x[:5], y_test=y[:5])
    ds = load(Data(source="npz", path=str(tmp_path / "a.npz")), task="classify")
    assert ds.train_x.shape == (20, 4, 4, 1) and ds.num_classes == 3 and len(ds.test_y) == 5
    np.savez(tmp_path / "b.npz", x_train=x.astype(np.float32), y_train=y)
    ds = load(Data(source="npz", path=str(tmp_path / "b.npz"), test_fraction=0.25), task="classify")
    assert len(ds.train_x) == 15 and len(ds.test_x) == 5
    np.savez(tmp_path / "c.npz", images=x)
    with pytest.raises(SetupError, match="x_train, y_train"):
        load(Data(source="npz", path=str(tmp_path / "c.npz")), task="classify")


def test_plain_text_file(tmp_path):
    (tmp_path / "t.txt").write_text("héllo world " * 50, encoding="utf-8")
    ds = load(Data(source="text", path=str(tmp_path / "t.txt"), seq_len=8), task="lm")
    assert ds.train_x[:2].tolist() == [ord("h"), 0xC3]  # UTF-8 bytes
    assert ds.num_examples("test") >= 1


def test_synthetic_shapes():
    shape = {"num_examples": 64, "image_shape": (4, 4, 2), "num_classes": 5}
    cfg = Data(source="synthetic", seq_len=16, synthetic=shape)
    img = load(cfg, task="classify")
    assert img.train_x.shape == (64, 4, 4, 2) and img.num_classes == 5
    lm = load(cfg, task="lm")
    assert lm.num_examples("train") == 64 and lm.examples(np.arange(3))["x"].shape == (3, 16)


def test_batches_are_keyed_by_seed_and_epoch_and_resume_exactly():
    ds = load(
        Data(source="synthetic", synthetic={"num_examples": 40, "image_shape": (1, 1, 1)}),
        task="classify",
    )
    ids = lambda b: b["x"].reshape(-1).tolist()  # each example's unique pixel names it
    run = Batches(ds, global_batch=8, seed=3)
    seen = [ids(next(run)) for _ in range(12)]  # 5 batches per epoch: crosses two epochs
    assert sorted(sum(seen[:5], [])) == sorted(ds.train_x.reshape(-1).tolist())
    assert seen[:5] != seen[5:10]  # a new order each epoch
    resumed = Batches(ds, global_batch=8, seed=3, position=7)
    assert [ids(next(resumed)) for _ in range(5)] == seen[7:12]
    assert [ids(next(Batches(ds, global_batch=8, seed=4)))] != seen[:1]
    halves = [
        Batches(ds, global_batch=8, seed=3, process_index=i, process_count=2) for i in range(2)
    ]
    assert ids(next(halves[0])) + ids(next(halves[1])) == seen[0]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        Batches(ds, global_batch=64, seed=0)


def test_eval_batches_pad_and_mask_the_last_batch():
    ds = load(
        Data(
            source="synthetic",
            test_fraction=0.5,
            synthetic={"num_examples": 10, "image_shape": (1, 1, 1)},
        ),
        task="classify",
    )
    batches = list(eval_batches(ds, global_batch=4))
    assert len(batches) == 2 and all(b["x"].shape == (4, 1, 1, 1) for b in batches)
    assert batches[-1]["mask"].tolist() == [1, 0, 0, 0]
    assert sum(b["mask"].sum() for b in batches) == ds.num_examples("test") == 5
