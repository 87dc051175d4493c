"""The error a valid config raises when it does not fit the data, the devices or the machine.

``python -m train`` exits with code 2 for it and for :class:`train.config.ConfigError`, printing
the message (which names the key and the fix) without a traceback. Every other exception is a
bug or an environment failure: exit 1 with its traceback.
"""

from __future__ import annotations

__all__ = ["SetupError"]


class SetupError(ValueError):
    """The config validates but cannot run as given (exit 2).

    Example: ``data.batch_size=30`` on 8 devices (30 does not split over them); the fix is a
    multiple of 8 or ``data.batch_size_per_device``.
    """
