"""Data sources (embedded; users' formats on fixtures made here) and deterministic batches."""

from __future__ import annotations

import gzip
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from train.config import DATA_SOURCES, Data
from train.data import (
    CROP_PAD,
    LOADERS,
    Batches,
    Dataset,
    crop_flip,
    eval_batches,
    load,
    read_idx,
)
from train.errors import SetupError


def test_every_data_source_has_one_loader():
    # train.config.DATA_SOURCES is the one table of sources (the schema's values come from it).
    assert list(LOADERS) == list(DATA_SOURCES)


def test_every_data_source_is_in_the_trainer_docs_table():
    text = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    section = text.split("\n## Train on your data\n")[1].split("\n## ")[0]
    rows = [row.split("|") for row in section.splitlines() if row.startswith("| `")]
    assert set(re.findall(r"`(\w+)`", " ".join(r[1] for r in rows))) == set(DATA_SOURCES)
    for row in rows:  # a file format's row names the tasks its data fits
        names = re.findall(r"`(\w+)`", row[1])
        if len(names) == 1 and DATA_SOURCES[name := names[0]].needs_path:
            assert {t.strip() for t in row[-2].split(",")} == set(DATA_SOURCES[name].tasks), name


def test_embedded_sources_load_the_tasks_the_table_gives():
    for name, source in DATA_SOURCES.items():
        if source.needs_path:
            continue  # the file formats: tested below on fixtures
        for task in source.tasks:
            cfg = Data(source=name, seq_len=16, synthetic={"num_examples": 8})
            assert load(cfg, task=task).task == task, (name, task)


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


@pytest.mark.parametrize("task", ["classify", "regress"])
def test_an_unreadable_npz_path_is_a_setup_error_naming_the_fix(tmp_path, task):
    # Each was a bare numpy traceback (FileNotFoundError, ValueError, AttributeError) before.
    (tmp_path / "t.txt").write_text("not an archive")
    np.save(tmp_path / "one.npy", np.zeros(3))
    cases = {
        "missing.npz": "cannot be read: FileNotFoundError",
        "t.txt": "is not an .npz archive",
        "one.npy": "holds one array",
    }
    for name, says in cases.items():
        with pytest.raises(SetupError, match=says) as e:
            load(Data(source="npz", path=str(tmp_path / name)), task=task)
        assert "Fix:" in str(e.value)


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


def _ids(batch) -> list[float]:
    return batch["x"].reshape(-1).tolist()  # each example's unique pixel names it


def _take(batches: Batches, n: int) -> list:
    try:
        return [next(batches) for _ in range(n)]
    finally:
        batches.close()


def test_batches_are_keyed_by_seed_and_epoch_and_resume_exactly():
    ds = load(
        Data(source="synthetic", synthetic={"num_examples": 40, "image_shape": (1, 1, 1)}),
        task="classify",
    )
    run = Batches(ds, global_batch=8, seed=3)
    seen = [_ids(next(run)) for _ in range(7)]  # 5 batches per epoch: into the second epoch
    state = run.get_state()
    assert state == {"next_index": 7} and run.position == 7 and run.epoch == 7 / 5
    seen += [_ids(b) for b in _take(run, 5)]
    assert sorted(sum(seen[:5], [])) == sorted(ds.train_x.reshape(-1).tolist())
    assert sorted(sum(seen[5:10], [])) == sorted(ds.train_x.reshape(-1).tolist())
    assert seen[:5] != seen[5:10]  # a new order each epoch
    resumed = Batches(ds, global_batch=8, seed=3, state=state, prefetch=0)
    assert [_ids(b) for b in _take(resumed, 5)] == seen[7:12]
    assert _ids(_take(Batches(ds, global_batch=8, seed=4), 1)[0]) != seen[0]
    halves = [
        Batches(ds, global_batch=8, seed=3, process_index=i, process_count=2) for i in range(2)
    ]
    assert _ids(_take(halves[0], 1)[0]) + _ids(_take(halves[1], 1)[0]) == seen[0]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        Batches(ds, global_batch=64, seed=0)


def _is_crop_flip_of(out: np.ndarray, image: np.ndarray) -> bool:
    pad = 2 * CROP_PAD + 1
    return any(
        np.array_equal(crop_flip(image[None], np.array([[i, j]]), np.array([f]))[0], out)
        for i in range(pad)
        for j in range(pad)
        for f in (False, True)
    )


def test_crop_flip_is_drawn_per_seed_and_step_for_the_global_batch():
    # Images 6x6 whose pixels are all distinct (1 .. 36 * N): a crop of another image would show.
    n, side = 12, 6
    x = np.arange(1, n * side * side + 1, dtype=np.float32).reshape(n, side, side, 1)
    ds = Dataset("classify", x, np.arange(n) % 3, x[:4], np.zeros(4), num_classes=3)
    kw = dict(global_batch=4, seed=5, augment="crop_flip")
    plain = _take(Batches(ds, global_batch=4, seed=5), 6)
    run = _take(Batches(ds, **kw), 6)
    for a, p in zip(run, plain, strict=True):
        np.testing.assert_array_equal(a["y"], p["y"])  # the same examples in the same rows,
        for out, image in zip(a["x"], p["x"], strict=True):  # each a crop (and flip) of its own
            assert _is_crop_flip_of(out, image)
    stacked = np.stack([b["x"] for b in run])
    assert not np.array_equal(stacked, np.stack([b["x"] for b in plain]))
    assert (stacked == 0).any()  # some crops reach into the (black) padding
    again = _take(Batches(ds, **kw, state={"next_index": 3}), 3)
    for a, b in zip(again, run[3:], strict=True):
        np.testing.assert_array_equal(a["x"], b["x"])
    other_seed = _take(Batches(ds, **{**kw, "seed": 6}), 1)[0]["x"]
    assert not np.array_equal(other_seed, run[0]["x"])
    halves = [_take(Batches(ds, **kw, process_index=i, process_count=2), 2) for i in range(2)]
    for step in range(2):
        whole = np.concatenate([halves[0][step]["x"], halves[1][step]["x"]])
        np.testing.assert_array_equal(whole, run[step]["x"])
    with pytest.raises(SetupError, match="applies to images"):
        lm = load(Data(source="synthetic", seq_len=4), task="lm")
        Batches(lm, global_batch=4, seed=0, augment="crop_flip")


def test_per_channel_normalization_uses_the_training_split():
    cfg = Data(
        source="synthetic",
        normalize="per_channel",
        synthetic={"num_examples": 64, "image_shape": (3, 3, 2)},
    )
    raw = load(cfg.model_copy(update={"normalize": "none"}), task="classify")
    ds = load(cfg, task="classify")
    mean = raw.train_x.mean(axis=(0, 1, 2), dtype=np.float64)
    std = raw.train_x.std(axis=(0, 1, 2), dtype=np.float64)
    np.testing.assert_allclose(ds.train_x.mean(axis=(0, 1, 2)), 0, atol=1e-6)
    np.testing.assert_allclose(ds.train_x.std(axis=(0, 1, 2)), 1, rtol=1e-5)
    np.testing.assert_allclose(ds.test_x, (raw.test_x - mean) / std, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ds.black, -mean / std, rtol=1e-6)
    assert ds.train_x.dtype == ds.test_x.dtype == np.float32
    with pytest.raises(SetupError, match="applies to images"):
        load(Data(source="synthetic", normalize="per_channel"), task="lm")


def test_token_file_is_memory_mapped_and_read_lazily(tmp_path):
    ids = np.arange(1000, dtype=np.uint16)
    ids[-1] = 4000  # the largest id, in the test split
    ids.tofile(tmp_path / "tok.bin")
    cfg = Data(source="tokens", path=str(tmp_path / "tok.bin"), seq_len=16, test_fraction=0.1)
    ds = load(cfg, task="lm")
    assert isinstance(ds.train_x, np.memmap) and ds.train_x.dtype == np.uint16
    assert ds.vocab_size == 4001 and len(ds.train_x) == 900 and len(ds.test_x) == 100
    batch = ds.examples(np.array([0, 3]))
    assert batch["x"].dtype == np.int32 and batch["x"].shape == (2, 16)
    np.testing.assert_array_equal(batch["x"][1], ids[48:64])
    np.testing.assert_array_equal(batch["y"][1], ids[49:65])
    first = _take(Batches(ds, global_batch=4, seed=0), 1)[0]
    for row in first["x"]:  # a window of the training tokens, at a multiple of seq_len
        assert row[0] % 16 == 0 and row.tolist() == list(range(row[0], row[0] + 16))
    given = load(Data(**{**cfg.model_dump(), "tokens": {"vocab_size": 4096}}), task="lm")
    assert given.vocab_size == 4096
    as_int32 = np.arange(100, dtype=np.int32)
    as_int32.tofile(tmp_path / "i32.bin")
    wide = load(
        Data(source="tokens", path=str(tmp_path / "i32.bin"), seq_len=4, tokens={"dtype": "int32"}),
        task="lm",
    )
    np.testing.assert_array_equal(wide.examples(np.array([1]))["x"][0], [4, 5, 6, 7])
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(SetupError, match="not a multiple of uint16"):
        load(Data(source="tokens", path=str(tmp_path / "odd.bin")), task="lm")


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


def test_a_checkpoint_resumes_from_its_grain_state(tmp_path):
    # The checkpoint and the experiment are stand-ins: the step and grain's iterator state come
    # from the checkpoint's meta.
    from types import SimpleNamespace

    from train import loop

    class FakeCheckpoint:
        directory = tmp_path / "checkpoints"

        def __init__(self, meta):
            self.meta = meta

        def restore_latest(self, abstract, **kwargs):
            return None, self.meta, 2

    exp = SimpleNamespace(abstract=None, is_main=False, say=lambda s: None)
    new = FakeCheckpoint({"step": 2, "data_state": {"next_index": 2}})
    _, resume = loop.restore_or_init(exp, new, allow_dtype_cast=False, allow_config_change=False)
    assert resume == loop.Resume(step=2, data_state={"next_index": 2}, checkpoint=2)
