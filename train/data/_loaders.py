"""One loader per data source (the rows of ``train.config.DATA_SOURCES``), and :func:`load`.

Every loader reads its source into host memory as a :class:`Dataset` (``tokens`` is
memory-mapped); nothing downloads.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np

from train.config import Data, Task
from train.data._dataset import Dataset, normalize_per_channel
from train.errors import SetupError

__all__ = [
    "LOADERS",
    "load",
    "load_cifar10",
    "load_corpus",
    "load_digits",
    "load_mnist",
    "load_npz",
    "load_synthetic",
    "load_text",
    "load_tokens",
    "read_idx",
]


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
    try:
        archive = np.load(cfg.path or "")
    except ValueError as e:  # not a zip archive: numpy takes it for a pickle, which it refuses
        raise SetupError(
            f"data.path={cfg.path!r} (data.source=npz) is not an .npz archive: {e} Fix: the "
            "path of a file written by np.savez(path, x_train=..., y_train=...)."
        ) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):  # one .npy array
        raise SetupError(
            f"data.path={cfg.path!r} (data.source=npz) holds one array (.npy), not named arrays. "
            "Fix: np.savez(path, x_train=..., y_train=...) (optionally x_test=, y_test=)."
        )
    with archive as f:
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


Loader = Callable[[Data, Task], Dataset]


def _reading(read: Callable[..., Dataset], *, takes_task: bool = False) -> Loader:
    """``read`` as a loader whose unreadable ``data.path`` is a SetupError naming the fix.

    ``takes_task``: ``read(cfg, task)`` (a source of several kinds of data); else ``read(cfg)``.
    """

    @functools.wraps(read)
    def loader(cfg: Data, task: Task) -> Dataset:
        try:
            return read(cfg, task) if takes_task else read(cfg)
        except (OSError, UnicodeDecodeError) as e:  # a path that is missing, unreadable or binary
            raise SetupError(
                f"data.path={cfg.path!r} (data.source={cfg.source}) cannot be read: "
                f"{type(e).__name__}: {e}. Fix: the path of an existing, readable "
                f"{cfg.source} file (text: UTF-8)."
            ) from None

    return loader


#: The loader of each source, keyed as ``train.config.DATA_SOURCES`` (a test holds them equal).
LOADERS: dict[str, Loader] = {
    "digits": _reading(load_digits),
    "cifar10": _reading(load_cifar10),
    "mnist": _reading(load_mnist),
    "npz": _reading(load_npz, takes_task=True),  # images, or a table (regress)
    "text": _reading(load_text),
    "corpus": _reading(load_corpus),
    "tokens": _reading(load_tokens),
    "synthetic": load_synthetic,  # reads no file; images, a table or tokens by the task
}


def load(cfg: Data, *, task: Task) -> Dataset:
    """Loads the configured source for a model of ``task`` (normalized if configured)."""
    ds = LOADERS[cfg.source](cfg, task)
    if cfg.normalize == "per_channel":
        if ds.task != "classify":
            raise SetupError(
                f"data.normalize={cfg.normalize!r} applies to images; {ds.name} is not. "
                "Fix: data.normalize=none."
            )
        ds = normalize_per_channel(ds)
    return ds
