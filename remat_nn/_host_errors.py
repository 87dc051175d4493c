"""Errors raised from a host callback that read well under ``jax.jit``.

A run-time check (``rn.invertible``'s refusals, a reversible stack's ``fallback="error"``)
raises from a ``jax.debug.callback``. Eagerly the exception itself reaches the caller. Under
``jit``, XLA turns it into a ``JaxRuntimeError`` whose text is ``INTERNAL: CpuCallback error
calling callback:`` and then the exception as nanobind formats it: the stack, from the frame
that raised it up to the caller's first line, then ``NotInvertibleError: <message>``.
:func:`raise_from_callback` raises from a finished generator's frame, which links to no caller,
so that stack is one line and the message (what failed, where, the fix) is in the first lines;
and JAX's log of the failed callback (the same text again, before it) is dropped for
:class:`~remat_nn.errors.NotInvertibleError`. (This relies on how the binding formats the stack
and on CPython's generator frames: the tests that read the first lines of such an error fail
if an upgrade changes either.)
"""

from __future__ import annotations

import logging
from collections.abc import Generator

from remat_nn.errors import NotInvertibleError

__all__ = ["raise_from_callback"]


def raise_from_callback(error: BaseException) -> None:
    """Raises ``error`` from a frame with no caller (call it inside a host callback)."""
    refusal = _refuse()
    next(refusal)
    refusal.send(error)


def _refuse() -> Generator[None, BaseException, None]:
    """Raises the exception sent to it from its own frame."""
    raise (yield)


class _NoCallbackLog(logging.Filter):
    """Drops JAX's log of a host callback that raised :class:`NotInvertibleError`: the error
    reaches the caller anyway, and the log printed its whole text before it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], NotInvertibleError))


logging.getLogger("jax._src.debugging").addFilter(_NoCallbackLog())
