"""The errors ``python -m train`` reports without a traceback, each carrying its exit code.

Every one names its fix; ``train/__main__.py`` prints it and exits with ``exit_code``. Any other
exception is a bug or an environment failure: exit 1 with its traceback. An invalid config
(:class:`train.config.ConfigError`) exits 2 like :class:`SetupError`.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointUnavailableError",
    "ConfigChangedError",
    "DonationError",
    "DriftError",
    "NonFiniteError",
    "RunLockedError",
    "SetupError",
    "TrainError",
]


class TrainError(Exception):
    """An error of a run that names its fix; ``python -m train`` exits with ``exit_code``."""

    exit_code = 1


class SetupError(TrainError, ValueError):
    """The config validates but cannot run as given (exit 2).

    Example: ``data.batch_size=30`` on 8 devices (30 does not split over them); the fix is a
    multiple of 8 or ``data.batch_size_per_device``.
    """

    exit_code = 2


class NonFiniteError(TrainError, RuntimeError):
    """The loss or gradient became NaN/Inf and ``train.on_nonfinite`` is ``halt`` (exit 3).

    The last checkpoint (saved before the bad step, and only after its steps were checked) is
    kept. Fix: lower ``optim.lr``, add ``optim.clip_norm``, warm up longer, or set
    ``train.on_nonfinite=skip`` to drop the bad updates. Also raised by ``skip`` after
    ``max_consecutive_skips`` bad steps in a row.
    """

    exit_code = 3


class DriftError(TrainError, RuntimeError):
    """A reversible stack's rebuilt activation drifted past its tolerance in a step, with the
    model's drift fallback ``"error"`` (exit 3, like a non-finite step: the gradient is wrong).

    Nothing from that step is saved: the last checkpoint was written before it. Fix (the
    message names the options): anchors (``model.options.anchor_every``), the fallback
    ``"recompute"``, or no reversible layers.
    """

    exit_code = 3


class CheckpointError(TrainError, RuntimeError):
    """No checkpoint can be used as it is: all damaged, a save failed, or it does not fit.

    Exit 4.
    """

    exit_code = 4


class CheckpointUnavailableError(CheckpointError):
    """The storage failed while a checkpoint was read (I/O error, permission, timeout; exit 6).

    Not evidence of damage: nothing is moved aside, so rerunning once the storage is back
    resumes from the same step.
    """

    exit_code = 6


class ConfigChangedError(TrainError, ValueError):
    """The config differs from the one the run directory's checkpoints were trained with.

    Exit 4.
    """

    exit_code = 4


class RunLockedError(TrainError, RuntimeError):
    """Another process is training into the same run directory (exit 5)."""

    exit_code = 5


class DonationError(TrainError, RuntimeError):
    """The train step did not reuse the state's buffers: memory holds two copies of the state.

    Typical causes: a leaf passed twice (two state fields sharing one buffer), an output whose
    sharding or dtype differs from its input (then XLA cannot alias them), a restored array
    whose buffer XLA does not own (re-materialise it with
    :func:`train.donation.rematerialize`, jax#18617). Exit 1.
    """

    exit_code = 1
