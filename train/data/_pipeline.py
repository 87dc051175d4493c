"""Training and evaluation batches through a grain pipeline, and the crop-and-flip augmentation.

Each training batch is a function of ``(seed, step)``, so grain's iterator state is just the next
step and a resumed run sees exactly the batches the uninterrupted run would.
"""

from __future__ import annotations

import functools
from typing import Any

import grain
import numpy as np

from train.data._dataset import Dataset
from train.errors import SetupError

__all__ = ["CROP_PAD", "Batches", "check_batch", "crop_flip", "eval_batches", "train_pipeline"]

#: Pixels of padding around each image before the random crop (RevNet / ResNet on CIFAR).
CROP_PAD = 4


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
