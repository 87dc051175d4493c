"""The data sources: one table of what each ``data.source`` reads and which models it fits.

The schema (the values of ``data.source``, their ``--help`` text, which need ``data.path``, which
are token data), the registry check (a source must fit the model's task) and ``train.data``'s
loaders (one per row, tested) all read this table. It imports nothing from the project, so every
part of it may import the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DATA_SOURCES", "DataSource", "Task", "sources_fitting"]

#: What a model computes, and so what data it takes (see ``models``).
Task = Literal["classify", "lm", "regress"]


@dataclass(frozen=True)
class DataSource:
    """One value of ``data.source``.

    Attributes:
      name: the value.
      tasks: the model tasks its data fits: ``classify`` (images and labels), ``lm`` (a token
        stream), ``regress`` (float features and targets).
      needs_path: it reads ``data.path`` (a file or directory); the others are embedded.
      description: what it reads, as ``--help`` shows it.
    """

    name: str
    tasks: tuple[Task, ...]
    needs_path: bool
    description: str

    @property
    def token_data(self) -> bool:
        """Token data only: the image options (``data.augment``, ``data.normalize``) do not apply.

        >>> DATA_SOURCES["text"].token_data, DATA_SOURCES["synthetic"].token_data
        (True, False)
        """
        return self.tasks == ("lm",)


#: Every source by name, in the order ``--help`` lists them.
DATA_SOURCES: dict[str, DataSource] = {
    s.name: s
    for s in (
        DataSource(
            "digits",
            tasks=("classify",),
            needs_path=False,
            description="scikit-learn's bundled 8x8 digits (embedded default)",
        ),
        DataSource(
            "cifar10",
            tasks=("classify",),
            needs_path=True,
            description="a CIFAR-10 python-pickle directory",
        ),
        DataSource(
            "mnist",
            tasks=("classify",),
            needs_path=True,
            description="a directory of MNIST IDX files",
        ),
        DataSource(
            "npz",
            tasks=("classify", "regress"),
            needs_path=True,
            description="arrays x_train/y_train[/x_test/y_test]",
        ),
        DataSource(
            "text",
            tasks=("lm",),
            needs_path=True,
            description="a plain text file (byte-level LM)",
        ),
        DataSource(
            "corpus",
            tasks=("lm",),
            needs_path=False,
            description="the Python docs text shipped with every Python (byte-level LM)",
        ),
        DataSource(
            "tokens",
            tasks=("lm",),
            needs_path=True,
            description="a flat binary file of token ids, memory-mapped (LM, see data.tokens)",
        ),
        DataSource(
            "synthetic",
            tasks=("classify", "lm", "regress"),
            needs_path=False,
            description="random data",
        ),
    )
}


def sources_fitting(task: str) -> list[str]:
    """The names of the sources whose data fits a model of ``task``, in table order.

    >>> sources_fitting("regress")
    ['npz', 'synthetic']
    """
    return [name for name, s in DATA_SOURCES.items() if task in s.tasks]
