"""Data sets and deterministic batching.

Every source is loaded once into host memory as numpy arrays (:class:`Dataset`); nothing is
downloaded at run time. The embedded defaults are real data that every install has:

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), split
  into train/test by a fixed seed.
- ``corpus``: the Python documentation topics shipped in the standard library
  (``pydoc_data.topics``), as UTF-8 bytes (a 256-token character-level LM corpus).

Users' own data comes in standard formats: a CIFAR-10 python-pickle directory, MNIST IDX files,
``.npz`` arrays and plain text files. ``synthetic`` makes random data of a given shape.

Batches are deterministic: example order is a permutation keyed by ``(seed, epoch)``, and the
iterator's only state is its position (batches consumed), which the checkpoint stores, so a
resumed run sees exactly the batches the uninterrupted run would have seen.

>>> ds = load(Data(source="synthetic", synthetic={"num_examples": 10, "image_shape": (2, 2, 1)}),
...           task="classify")
>>> it = Batches(ds, global_batch=4, seed=0)
>>> first = next(it)["x"]; first.shape, it.position
((4, 2, 2, 1), 1)
>>> np.array_equal(next(Batches(ds, global_batch=4, seed=0))["x"], first)
True
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from train.config import Data
from train.errors import SetupError

__all__ = ["Batches", "Dataset", "eval_batches", "load", "read_idx"]

Task = Literal["classify", "lm"]


@dataclass(frozen=True)
class Dataset:
    """Train and test examples in host memory.

    Attributes:
      task: ``"classify"`` (images and labels) or ``"lm"`` (a token stream).
      train_x: classify: (N, H, W, C) float32; lm: (N_tokens,) int32.
      train_y: classify: (N,) int32; lm: None.
      test_x: as ``train_x``, the held-out split.
      test_y: as ``train_y``.
      num_classes: classify: number of classes; lm: None.
      vocab_size: lm: number of token ids; classify: None.
      seq_len: lm: tokens per example (each example is seq_len + 1 tokens: inputs and targets).
      name: where it came from, for logs.
    """

    task: Task
    train_x: np.ndarray
    train_y: np.ndarray | None
    test_x: np.ndarray
    test_y: np.ndarray | None
    num_classes: int | None = None
    vocab_size: int | None = None
    seq_len: int = 0
    name: str = ""

    def num_examples(self, split: str = "train") -> int:
        x = self.train_x if split == "train" else self.test_x
        if self.task == "lm":
            return max(0, (len(x) - 1) // self.seq_len)  # non-overlapping windows
        return len(x)

    def examples(self, idx: np.ndarray, split: str = "train") -> dict[str, np.ndarray]:
        """The examples at ``idx`` as a batch ``{"x": ..., "y": ...}``."""
        x = self.train_x if split == "train" else self.test_x
        if self.task == "lm":
            t = self.seq_len
            windows = np.stack([x[i * t : i * t + t + 1] for i in idx])  # (B, T + 1)
            return {"x": windows[:, :-1], "y": windows[:, 1:]}
        y = self.train_y if split == "train" else self.test_y
        assert y is not None
        return {"x": x[idx], "y": y[idx]}

    def example_batch(self, batch_size: int) -> dict[str, np.ndarray]:
        """A batch of the right shapes and dtypes (the first examples), for init and tracing."""
        return self.examples(np.arange(batch_size) % self.num_examples("train"))


class Batches:
    """Deterministic, resumable iterator over global training batches.

    Epoch ``e`` visits the examples in the order ``default_rng([seed, e]).permutation(N)``,
    ``N // global_batch`` full batches per epoch (the remainder is dropped). In a multi-process
    run each process yields only its rows ``[p * B / P, (p + 1) * B / P)`` of every global batch.

    Args:
      dataset: the examples.
      global_batch: batch size over all processes and devices.
      seed: keys the shuffles.
      position: batches already consumed (restore it from a checkpoint to resume).
      process_index: this process's index.
      process_count: number of processes.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch: int,
        seed: int,
        position: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        n = dataset.num_examples("train")
        if n < global_batch:
            raise SetupError(
                f"data: the training split has {n} examples, fewer than one global batch of "
                f"{global_batch}. Fix: lower data.batch_size (or data.seq_len)."
            )
        if global_batch % process_count:
            raise SetupError(
                f"data: global batch {global_batch} does not split over {process_count} processes."
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.seed = seed
        self.position = position
        self.steps_per_epoch = n // global_batch
        self._local = slice(
            process_index * global_batch // process_count,
            (process_index + 1) * global_batch // process_count,
        )
        self._perm_epoch = -1
        self._perm = np.empty(0, np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.dataset.num_examples("train"))
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        epoch, offset = divmod(self.position, self.steps_per_epoch)
        b = self.global_batch
        idx = self._order(epoch)[offset * b : (offset + 1) * b][self._local]
        self.position += 1
        return self.dataset.examples(idx)

    @property
    def epoch(self) -> float:
        return self.position / self.steps_per_epoch


def eval_batches(
    dataset: Dataset,
    *,
    global_batch: int,
    max_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
):
    """Yields the test split in order as process-local batches with a ``"mask"`` of real rows.

    The last batch is padded (mask 0) so every batch has the compiled shape.
    """
    n = dataset.num_examples("test")
    num = -(-n // global_batch)
    if max_batches is not None:
        num = min(num, max_batches)
    lo = process_index * global_batch // process_count
    hi = (process_index + 1) * global_batch // process_count
    for i in range(num):
        idx = np.arange(i * global_batch, (i + 1) * global_batch)[lo:hi]
        mask = (idx < n).astype(np.float32)
        batch = dataset.examples(np.minimum(idx, n - 1), "test")
        if dataset.task == "lm":
            mask = np.broadcast_to(mask[:, None], batch["y"].shape).copy()
        batch["mask"] = mask
        yield batch


# --- sources ----------------------------------------------------------------------------------


def _split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int):
    perm = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, round(len(x) * fraction))
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _images(x: np.ndarray, scale: float | None = None) -> np.ndarray:
    # (N, H, W) or (N, H, W, C) -> (N, H, W, C) float32 in [0, 1] for integer pixels.
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise SetupError(f"data: images must be (N, H, W) or (N, H, W, C), got shape {x.shape}")
    if scale is None:
        scale = 255.0 if np.issubdtype(x.dtype, np.integer) else 1.0
    return (x.astype(np.float32) / np.float32(scale)).astype(np.float32)


def _labels(y: np.ndarray) -> np.ndarray:
    return np.asarray(y).reshape(-1).astype(np.int32)


def _classify(name, xtr, ytr, xte, yte, num_classes=None) -> Dataset:
    ytr, yte = _labels(ytr), _labels(yte)
    k = num_classes or int(max(ytr.max(), yte.max())) + 1
    return Dataset("classify", xtr, ytr, xte, yte, num_classes=k, name=name)


def _digits_file() -> Path:
    # The CSV scikit-learn ships (what sklearn.datasets.load_digits reads), found without
    # importing sklearn (seconds of imports for 200 KB of data).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(
            "data.source=digits needs scikit-learn (pinned in requirements.lock). Fix: "
            "make setup, or pip install -r requirements.lock."
        )
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"


def load_digits(cfg: Data) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 x 64 pixels in 0..16, then the label)."""
    table = np.loadtxt(_digits_file(), delimiter=",", dtype=np.float32)  # (1797, 65)
    images = table[:, :-1].reshape(-1, 8, 8)
    x = _images(images, scale=16.0)  # (1797, 8, 8, 1) in [0, 1]
    xtr, ytr, xte, yte = _split(x, table[:, -1], cfg.test_fraction, cfg.split_seed)
    return _classify("digits", xtr, ytr, xte, yte, num_classes=10)


def load_cifar10(cfg: Data) -> Dataset:
    """A CIFAR-10 python-pickle directory (``cifar-10-batches-py``): data_batch_1..5, test_batch."""
    root = Path(cfg.path or "")

    def read(name: str) -> tuple[np.ndarray, np.ndarray]:
        with open(root / name, "rb") as f:
            d = pickle.load(f, encoding="bytes")  # the user's own data files
        x = np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return x, np.asarray(d[b"labels"])

    train_files = sorted(p.name for p in root.glob("data_batch_*"))
    if not train_files or not (root / "test_batch").exists():
        raise SetupError(
            f"data.path={str(root)!r} is not a CIFAR-10 python directory: expected "
            "data_batch_1..5 and test_batch (the cifar-10-batches-py folder)."
        )
    parts = [read(n) for n in train_files]
    xtr = _images(np.concatenate([p[0] for p in parts]))
    ytr = np.concatenate([p[1] for p in parts])
    xte, yte = read("test_batch")
    return _classify("cifar10", xtr, ytr, _images(xte), yte, num_classes=10)


_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Reads an IDX file (MNIST's format), optionally gzipped."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise SetupError(f"data: {path} is not an IDX file (bad magic number {raw[:4]!r})")
    ndim = raw[3]
    dims = np.frombuffer(raw, ">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, _IDX_DTYPES[raw[2]], offset=4 + 4 * ndim)
    return data.reshape(tuple(dims)).astype(_IDX_DTYPES[raw[2]].lstrip(">"))


def load_mnist(cfg: Data) -> Dataset:
    """A directory of MNIST IDX files (train-images-idx3-ubyte[.gz], t10k-..., labels)."""
    root = Path(cfg.path or "")

    def find(stem: str) -> Path:
        for cand in (root / stem, root / f"{stem}.gz", root / stem.replace("-idx", ".idx")):
            if cand.exists():
                return cand
        raise SetupError(f"data.path={str(root)!r}: no {stem}[.gz] (MNIST IDX files)")

    xtr = _images(read_idx(find("train-images-idx3-ubyte")))
    ytr = read_idx(find("train-labels-idx1-ubyte"))
    xte = _images(read_idx(find("t10k-images-idx3-ubyte")))
    yte = read_idx(find("t10k-labels-idx1-ubyte"))
    return _classify("mnist", xtr, ytr, xte, yte)


def load_npz(cfg: Data) -> Dataset:
    """``.npz`` with x_train, y_train and optionally x_test, y_test (else split by seed)."""
    with np.load(cfg.path or "") as f:
        keys = set(f.files)
        if not {"x_train", "y_train"} <= keys:
            raise SetupError(
                f"data.path={cfg.path!r} holds {sorted(keys)}; expected arrays x_train, y_train "
                "(and optionally x_test, y_test)."
            )
        xtr, ytr = _images(f["x_train"]), f["y_train"]
        if {"x_test", "y_test"} <= keys:
            xte, yte = _images(f["x_test"]), f["y_test"]
        else:
            xtr, ytr, xte, yte = _split(xtr, ytr, cfg.test_fraction, cfg.split_seed)
    return _classify(f"npz:{Path(cfg.path or '').name}", xtr, ytr, xte, yte)


def _tokens(text: str, cfg: Data, name: str) -> Dataset:
    # UTF-8 bytes as tokens (vocab 256): stable across files and Python versions. The last
    # test_fraction of the text is held out.
    data = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    cut = int(len(data) * (1 - cfg.test_fraction))
    train, test = data[:cut], data[cut:]
    if (len(test) - 1) // cfg.seq_len < 1:
        raise SetupError(
            f"data: {name} holds {len(data)} bytes; the test split is shorter than one window of "
            f"data.seq_len={cfg.seq_len}. Fix: a longer text or a smaller seq_len."
        )
    return Dataset("lm", train, None, test, None, vocab_size=256, seq_len=cfg.seq_len, name=name)


def load_text(cfg: Data) -> Dataset:
    """A plain UTF-8 text file, byte-level tokens."""
    return _tokens(Path(cfg.path or "").read_text(encoding="utf-8"), cfg, f"text:{cfg.path}")


def load_corpus(cfg: Data) -> Dataset:
    """The Python documentation topics of the standard library (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    return _tokens("\n\n".join(topics[k] for k in sorted(topics)), cfg, "pydoc_data.topics")


def load_synthetic(cfg: Data, task: Task) -> Dataset:
    """Random data of the configured shape (for benchmarks; nothing to learn)."""
    s = cfg.synthetic
    rng = np.random.default_rng(cfg.split_seed)
    n_test = max(1, round(s.num_examples * cfg.test_fraction))
    if task == "lm":
        n_tok = (s.num_examples + n_test) * cfg.seq_len + 2
        toks = rng.integers(0, s.vocab_size, n_tok, dtype=np.int32)
        cut = s.num_examples * cfg.seq_len + 1
        return Dataset(
            "lm",
            toks[:cut],
            None,
            toks[cut:],
            None,
            vocab_size=s.vocab_size,
            seq_len=cfg.seq_len,
            name="synthetic",
        )
    n = s.num_examples + n_test
    x = rng.standard_normal((n, *s.image_shape), dtype=np.float32)
    y = rng.integers(0, s.num_classes, n)
    tr, te = slice(0, s.num_examples), slice(s.num_examples, n)
    return _classify("synthetic", x[tr], y[tr], x[te], y[te], num_classes=s.num_classes)


def load(cfg: Data, *, task: Task) -> Dataset:
    """Loads the configured source for a model of ``task``."""
    if cfg.source == "synthetic":
        return load_synthetic(cfg, task)
    loader = {
        "digits": load_digits,
        "cifar10": load_cifar10,
        "mnist": load_mnist,
        "npz": load_npz,
        "text": load_text,
        "corpus": load_corpus,
    }[cfg.source]
    return loader(cfg)
