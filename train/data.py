"""Data sets, and training batches through a grain pipeline.

:func:`load` reads a configured source into host memory (:class:`Dataset`; ``tokens`` is
memory-mapped); :class:`Batches` / :func:`train_pipeline` make the training batches with grain,
each a function of ``(seed, step)``, so grain's iterator state is just the next step and a
resumed run sees exactly the batches the uninterrupted run would. The sources, normalization,
augmentation and the multi-process split: docs/trainer.md, "Train on your data".

>>> ds = load(Data(source="synthetic", synthetic={"num_examples": 10, "image_shape": (2, 2, 1)}),
...           task="classify")
>>> it = Batches(ds, global_batch=4, seed=0)
>>> first = next(it)["x"]; first.shape, it.get_state()
((4, 2, 2, 1), {'next_index': 1})
>>> np.array_equal(next(Batches(ds, global_batch=4, seed=0))["x"], first)
True
>>> it.close()
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import pickle
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import grain
import numpy as np

from train.config import Data
from train.errors import SetupError

__all__ = [
    "Batches",
    "Dataset",
    "check_batch",
    "crop_flip",
    "eval_batches",
    "load",
    "read_idx",
    "train_pipeline",
]

Task = Literal["classify", "lm", "regress"]

#: Pixels of padding around each image before the random crop (RevNet / ResNet on CIFAR).
CROP_PAD = 4


@dataclass(frozen=True)
class Dataset:
    """Train and test examples (in host memory, or memory-mapped for ``tokens``).

    Attributes:
      task: ``"classify"`` (images and labels), ``"lm"`` (a token stream) or ``"regress"``
        (float features (N, F) and float targets (N, K)).
      train_x: classify: (N, H, W, C) float32; lm: (N_tokens,) integer token ids (int32, or the
        file's dtype when memory-mapped).
      train_y: classify: (N,) int32; lm: None.
      test_x: as ``train_x``, the held-out split.
      test_y: as ``train_y``.
      num_classes: classify: number of classes; lm: None.
      vocab_size: lm: number of token ids; classify: None.
      seq_len: lm: tokens per example (each example is seq_len + 1 tokens: inputs and targets).
      name: where it came from, for logs.
      num_outputs: regress: targets per example (K); otherwise None.
      black: classify: (C,) float32, the value of a black pixel after normalization (what
        :func:`crop_flip` pads with); zeros without normalization.
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
    num_outputs: int | None = None
    black: np.ndarray | None = None

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
            # Only these windows are read (from the page cache, for a memory-mapped file).
            windows = np.stack([x[i * t : i * t + t + 1] for i in idx]).astype(np.int32)
            return {"x": windows[:, :-1], "y": windows[:, 1:]}  # (B, T) each
        y = self.train_y if split == "train" else self.test_y
        assert y is not None
        return {"x": x[idx], "y": y[idx]}

    def example_batch(self, batch_size: int) -> dict[str, np.ndarray]:
        """A batch of the right shapes and dtypes (the first examples), for init and tracing."""
        return self.examples(np.arange(batch_size) % self.num_examples("train"))


# --- training batches ---------------------------------------------------------------------------


def crop_flip(
    x: np.ndarray, offsets: np.ndarray, flips: np.ndarray, *, fill: np.ndarray | None = None
) -> np.ndarray:
    """Pads each image by :data:`CROP_PAD`, crops it back at ``offsets`` and flips where asked.

    Args:
      x: (B, H, W, C) images.
      offsets: (B, 2) int, the crop's top-left corner in the padded image, each in
        ``[0, 2 * CROP_PAD]`` (``CROP_PAD, CROP_PAD`` is the original image).
      flips: (B,) bool, flip left-right.
      fill: (C,) value of the padding (default 0).

    Returns:
      (B, H, W, C) images of ``x``'s dtype.

    References:
      He et al. 2016 (ResNet) Section 4.2, followed by Gomez et al. 2017 (RevNet) for CIFAR.

    >>> x = np.arange(4.0).reshape(1, 2, 2, 1)
    >>> crop_flip(x, np.array([[CROP_PAD, CROP_PAD]]), np.array([True]))[0, ..., 0]
    array([[1., 0.],
           [3., 2.]])
    >>> crop_flip(x, np.array([[CROP_PAD + 1, CROP_PAD]]), np.array([False]))[0, ..., 0]
    array([[2., 3.],
           [0., 0.]])
    """
    b, h, w, c = x.shape
    p = CROP_PAD
    padded = np.empty((b, h + 2 * p, w + 2 * p, c), x.dtype)  # (B, H + 2p, W + 2p, C)
    padded[...] = 0 if fill is None else fill
    padded[:, p : p + h, p : p + w] = x
    rows = offsets[:, 0, None] + np.arange(h)  # (B, H)
    cols = offsets[:, 1, None] + np.arange(w)  # (B, W)
    cols = np.where(flips[:, None], cols[:, ::-1], cols)
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def _draw_crop_flip(ids: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    # The whole global batch's draws, so a row's crop does not depend on the process count.
    n = len(ids)
    offsets = rng.integers(0, 2 * CROP_PAD + 1, (n, 2))  # (B, 2)
    return {"ids": ids, "offsets": offsets, "flips": rng.random(n) < 0.5}


def _local_rows(step: dict[str, np.ndarray], *, rows: slice) -> dict[str, np.ndarray]:
    return {k: v[rows] for k, v in step.items()}


def _read(step: dict[str, np.ndarray], *, dataset: Dataset) -> dict[str, np.ndarray]:
    batch = dataset.examples(step["ids"])
    if "offsets" in step:
        batch["x"] = crop_flip(batch["x"], step["offsets"], step["flips"], fill=dataset.black)
    return batch


def check_batch(dataset: Dataset, global_batch: int, process_count: int) -> None:
    """Raises SetupError unless ``global_batch`` fits the training split and the processes."""
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


def train_pipeline(
    dataset: Dataset,
    *,
    global_batch: int,
    seed: int,
    augment: str = "none",
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """The endless grain dataset of this process's training batches, one element per step.

    Element ``s`` is step ``s``'s batch: epoch ``e = s // (N // global_batch)`` visits the N
    example ids in grain's ``shuffle`` order keyed by ``(seed, e)``; each step takes the next
    ``global_batch`` of them (the remainder of an epoch is dropped); ``crop_flip`` augmentation
    is drawn for the whole global batch from an rng keyed by ``(seed, s)``. Only then does the
    index shard over processes: process ``p`` keeps rows ``[p * B / P, (p + 1) * B / P)`` of the
    step's ids and draws and reads only those examples. So the global batch of every step is the
    same whatever the number of processes (a checkpoint resumes on another process count, and a
    2-process run trains like a 1-process run). grain's own ``ShardByJaxProcess`` /
    ``ShardOptions`` shard the ids before the shuffle (each process shuffles its own contiguous
    shard), which would make the global batches, and so the trained model, depend on the
    process count.

    Args:
      dataset: the examples.
      global_batch: batch size over all processes and devices.
      seed: keys the shuffles and the augmentation.
      augment: ``"none"`` or ``"crop_flip"`` (images only).
      process_index: this process's index.
      process_count: number of processes.

    Raises:
      SetupError: fewer examples than one global batch, a batch that does not split over the
        processes, or augmentation of token data.
    """
    n = dataset.num_examples("train")
    check_batch(dataset, global_batch, process_count)
    if augment != "none" and dataset.task != "classify":
        raise SetupError(
            f"data.augment={augment!r} applies to images; {dataset.name} is not. Fix: "
            "data.augment=none."
        )
    rows = slice(
        process_index * global_batch // process_count,
        (process_index + 1) * global_batch // process_count,
    )
    ids = (
        grain.MapDataset.range(n)
        .seed(seed)
        .shuffle()  # epoch e is reshuffled (grain keys each epoch's permutation by seed + e)
        .batch(global_batch, drop_remainder=True)  # (B,) example ids per step
        .repeat()  # endless: element s is step s
    )
    if augment == "crop_flip":
        steps = ids.random_map(_draw_crop_flip)  # rng keyed by (seed, step)
    else:
        steps = ids.map(lambda b: {"ids": b})
    local = steps.map(functools.partial(_local_rows, rows=rows))  # this process's rows
    return local.map(functools.partial(_read, dataset=dataset))


class Batches:
    """This process's training batches: a grain iterator over :func:`train_pipeline`.

    ``read_threads`` grain threads read (and augment) up to ``prefetch`` batches ahead of the
    step. :meth:`get_state` is grain's iterator state (``{"next_index": steps consumed}``, the same
    on every process); a new ``Batches`` given it continues with the very next batch.

    Args:
      dataset: the examples.
      global_batch: batch size over all processes and devices.
      seed: keys the shuffles and the augmentation.
      augment: ``"none"`` or ``"crop_flip"``.
      state: a :meth:`get_state` to resume from (restore it from a checkpoint).
      process_index: this process's index.
      process_count: number of processes.
      prefetch: batches read ahead (0: read in ``next``).
      read_threads: threads reading them.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch: int,
        seed: int,
        augment: str = "none",
        state: dict[str, Any] | None = None,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 2,
        read_threads: int = 1,
    ):
        pipeline = train_pipeline(
            dataset,
            global_batch=global_batch,
            seed=seed,
            augment=augment,
            process_index=process_index,
            process_count=process_count,
        )
        self.steps_per_epoch = dataset.num_examples("train") // global_batch
        options = grain.ReadOptions(
            num_threads=read_threads if prefetch else 0, prefetch_buffer_size=prefetch
        )
        self._it = iter(pipeline.to_iter_dataset(options))
        if state is not None:
            self._it.set_state(state)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """grain's iterator state (JSON): what a checkpoint stores to resume the data exactly."""
        return self._it.get_state()

    @property
    def position(self) -> int:
        """Batches consumed (steps taken)."""
        return int(self._it.get_state()["next_index"])

    @property
    def epoch(self) -> float:
        return self.position / self.steps_per_epoch

    def close(self) -> None:
        """Stops the prefetch threads."""
        self._it.close()


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
            "data_batch_1..5 and test_batch (the cifar-10-batches-py folder). Fix: download "
            "the python version (cifar-10-python.tar.gz) from "
            "https://www.cs.toronto.edu/~kriz/cifar.html once and unpack it (nothing downloads "
            "at run time), or point data.path at the unpacked folder."
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


def load_npz(cfg: Data, task: Task = "classify") -> Dataset:
    """``.npz`` with x_train, y_train and optionally x_test, y_test (else split by seed).

    Images and integer labels, or for ``task="regress"`` float features (N, F) and targets
    (N,) or (N, K).
    """
    with np.load(cfg.path or "") as f:
        keys = set(f.files)
        if not {"x_train", "y_train"} <= keys:
            raise SetupError(
                f"data.path={cfg.path!r} holds {sorted(keys)}; expected arrays x_train, y_train "
                "(and optionally x_test, y_test)."
            )
        features = (lambda a: a) if task == "regress" else _images
        xtr, ytr = features(f["x_train"]), f["y_train"]
        if {"x_test", "y_test"} <= keys:
            xte, yte = features(f["x_test"]), f["y_test"]
        else:
            xtr, ytr, xte, yte = _split(xtr, ytr, cfg.test_fraction, cfg.split_seed)
    name = f"npz:{Path(cfg.path or '').name}"
    if task == "regress":
        return _regression(name, xtr, ytr, xte, yte)
    return _classify(name, xtr, ytr, xte, yte)


def _token_splits(tokens: np.ndarray, cfg: Data, *, vocab_size: int, name: str) -> Dataset:
    # The last test_fraction of the tokens is held out; it must hold one window.
    cut = int(len(tokens) * (1 - cfg.test_fraction))
    train, test = tokens[:cut], tokens[cut:]
    if (len(test) - 1) // cfg.seq_len < 1:
        raise SetupError(
            f"data: {name} holds {len(tokens)} tokens; the test split is shorter than one window "
            f"of data.seq_len={cfg.seq_len}. Fix: more tokens or a smaller seq_len."
        )
    return Dataset(
        "lm", train, None, test, None, vocab_size=vocab_size, seq_len=cfg.seq_len, name=name
    )


def _tokens(text: str, cfg: Data, name: str) -> Dataset:
    # UTF-8 bytes as tokens (vocab 256): stable across files and Python versions.
    data = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return _token_splits(data, cfg, vocab_size=256, name=name)


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
    if task == "regress":
        return _synthetic_regression(cfg)
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


def _synthetic_regression(cfg: Data) -> Dataset:
    # Features ~ N(0, 1) and targets x @ w + 0.1 noise with w ~ N(0, 1/F): learnable, and the
    # noise floor of the mean squared error is 0.01.
    s = cfg.synthetic
    rng = np.random.default_rng(cfg.split_seed)
    n = s.num_examples + max(1, round(s.num_examples * cfg.test_fraction))
    x = rng.standard_normal((n, s.features), dtype=np.float32)
    w = rng.standard_normal((s.features, s.outputs), dtype=np.float32) / np.sqrt(s.features)
    y = (x @ w + 0.1 * rng.standard_normal((n, s.outputs))).astype(np.float32)
    tr, te = slice(0, s.num_examples), slice(s.num_examples, n)
    return _regression("synthetic", x[tr], y[tr], x[te], y[te])


def _regression(name, xtr, ytr, xte, yte) -> Dataset:
    # Tabular: features (N, F) float32, targets (N, K) float32.
    def table(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float32).reshape(len(a), -1)

    xtr, xte, ytr, yte = table(xtr), table(xte), table(ytr), table(yte)
    return Dataset("regress", xtr, ytr, xte, yte, name=name, num_outputs=ytr.shape[1])


def load_tokens(cfg: Data) -> Dataset:
    """A flat binary file of token ids (``data.tokens.dtype``, no header), memory-mapped.

    Nothing is read here but the pages a vocabulary scan touches (only when
    ``data.tokens.vocab_size`` is unset); batches read their windows when they are drawn. The
    last ``test_fraction`` of the tokens is held out.
    """
    path = Path(cfg.path or "")
    dtype = np.dtype(cfg.tokens.dtype)
    size = path.stat().st_size if path.is_file() else -1
    if size < 0 or size % dtype.itemsize:
        what = "does not exist" if size < 0 else f"holds {size} bytes, not a multiple of {dtype}"
        raise SetupError(
            f"data.path={str(path)!r} {what}. Fix: data.path is a flat file of "
            f"{cfg.tokens.dtype} token ids (e.g. np.asarray(ids, np.{dtype}).tofile(path)); "
            "data.tokens.dtype must be the dtype it was written with."
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")  # (N_tokens,), on disk
    vocab = cfg.tokens.vocab_size
    if vocab is None:
        chunk = 1 << 24  # a streaming max: 16M tokens of memory at a time
        vocab = 1 + max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
    return _token_splits(tokens, cfg, vocab_size=vocab, name=f"tokens:{path}")


def normalize_per_channel(ds: Dataset) -> Dataset:
    """Both splits minus the training split's per-channel mean, over its standard deviation.

    >>> x = np.stack([np.zeros((2, 2)), np.ones((2, 2))])[..., None].astype(np.float32)
    >>> ds = normalize_per_channel(Dataset("classify", x, np.zeros(2), x, np.zeros(2)))
    >>> ds.train_x[:, 0, 0, 0], ds.black
    (array([-1.,  1.], dtype=float32), array([-1.], dtype=float32))
    """
    x = ds.train_x
    mean = x.mean(axis=(0, 1, 2), dtype=np.float64)  # (C,)
    std = x.std(axis=(0, 1, 2), dtype=np.float64)  # (C,)
    std = np.where(std > 0, std, 1.0)  # a constant channel stays constant (0), not NaN
    scale = lambda a: ((a - mean) / std).astype(np.float32)
    return replace(ds, train_x=scale(x), test_x=scale(ds.test_x), black=scale(np.zeros_like(mean)))


def load(cfg: Data, *, task: Task) -> Dataset:
    """Loads the configured source for a model of ``task`` (normalized if configured)."""
    if cfg.source == "synthetic":
        ds = load_synthetic(cfg, task)
    elif cfg.source == "npz":
        ds = load_npz(cfg, task)
    else:
        loader = {
            "digits": load_digits,
            "cifar10": load_cifar10,
            "mnist": load_mnist,
            "npz": load_npz,
            "text": load_text,
            "corpus": load_corpus,
            "tokens": load_tokens,
        }[cfg.source]
        try:
            ds = loader(cfg)
        except (OSError, UnicodeDecodeError) as e:  # a path that is missing, unreadable or binary
            raise SetupError(
                f"data.path={cfg.path!r} (data.source={cfg.source}) cannot be read: "
                f"{type(e).__name__}: {e}. Fix: the path of an existing, readable "
                f"{cfg.source} file (text: UTF-8)."
            ) from None
    if cfg.normalize == "per_channel":
        if ds.task != "classify":
            raise SetupError(
                f"data.normalize={cfg.normalize!r} applies to images; {ds.name} is not. "
                "Fix: data.normalize=none."
            )
        ds = normalize_per_channel(ds)
    return ds
