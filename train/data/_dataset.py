"""The examples of a run in host memory (:class:`Dataset`), and their per-channel normalization."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from train.config import Task

__all__ = ["Dataset", "normalize_per_channel"]


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
