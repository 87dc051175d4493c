"""Data sets, and training batches through a grain pipeline.

:func:`load` reads a configured source into host memory (:class:`Dataset`; ``tokens`` is
memory-mapped); :class:`Batches` / :func:`train_pipeline` make the training batches with grain,
each a function of ``(seed, step)``, so grain's iterator state is just the next step and a
resumed run sees exactly the batches the uninterrupted run would. The sources, normalization,
augmentation and the multi-process split: docs/trainer.md, "Train on your data".

>>> import numpy as np
>>> from train.config import Data
>>> ds = load(Data(source="synthetic", synthetic={"num_examples": 10, "image_shape": (2, 2, 1)}),
...           task="classify")
>>> it = Batches(ds, global_batch=4, seed=0)
>>> first = next(it)["x"]; first.shape, it.get_state()
((4, 2, 2, 1), {'next_index': 1})
>>> np.array_equal(next(Batches(ds, global_batch=4, seed=0))["x"], first)
True
>>> it.close()

The parts, one file each:

- ``_dataset``: :class:`Dataset` (the examples of both splits) and their per-channel
  normalization;
- ``_loaders``: one loader per row of ``train.config.DATA_SOURCES`` (:data:`LOADERS`), and
  :func:`load`;
- ``_pipeline``: the grain pipeline (:func:`train_pipeline`, :class:`Batches`,
  :func:`eval_batches`) and the :func:`crop_flip` augmentation.
"""

from train.data._dataset import Dataset
from train.data._loaders import LOADERS, load, load_npz, read_idx
from train.data._pipeline import (
    CROP_PAD,
    Batches,
    check_batch,
    crop_flip,
    eval_batches,
    train_pipeline,
)

__all__ = [
    "CROP_PAD",
    "LOADERS",
    "Batches",
    "Dataset",
    "check_batch",
    "crop_flip",
    "eval_batches",
    "load",
    "load_npz",
    "read_idx",
    "train_pipeline",
]
