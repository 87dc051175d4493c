"""Error classes raised by remat_nn.

Each error names the argument, the value received and the fix. They subclass the builtin
exception a user would catch anyway (``ValueError`` / ``TypeError``), so ``except ValueError``
keeps working. ``closest`` / ``did_you_mean`` / ``did_you_mean_each`` write the "Did you mean"
hint of every message that names a value not among the valid ones.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, valid: Iterable[str]) -> str | None:
    """The valid value closest to ``word`` (:func:`difflib.get_close_matches`), or None."""
    close = difflib.get_close_matches(word, list(valid), n=1)
    return close[0] if close else None


def did_you_mean(word: str, valid: Iterable[str], n: int = 1) -> str:
    """``" Did you mean 'x'?"`` with the valid value closest to ``word`` (up to ``n`` of them,
    ``'x' or 'y'``), or ``""``."""
    close = difflib.get_close_matches(word, list(valid), n=n)
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def did_you_mean_each(words: Iterable[object], valid: Iterable[str]) -> str:
    """``" Did you mean: 'a' -> 'b'?, 'c' -> 'd'?"`` for each of ``words`` (strings only) that
    has a close valid value, or ``""`` when none has."""
    valid = list(valid)
    hints = [
        f"{w!r} -> {c!r}?"
        for w in words
        if isinstance(w, str) and (c := closest(w, valid)) is not None
    ]
    return f" Did you mean: {', '.join(hints)}" if hints else ""


class RematNNError(Exception):
    """Base class of every remat_nn error."""


class PolicyError(RematNNError, ValueError):
    """A remat policy name or specification that remat_nn cannot resolve.

    Example of the wrong code and the fix::

        rn.policy("dots_savable")        # typo: raises PolicyError, did you mean 'dots_saveable'?
        rn.policy("dots_saveable")       # fix
    """


class PlanError(RematNNError, ValueError):
    """A memory plan that is malformed, or that does not match the function it is applied to.

    Example of the wrong code and the fix::

        rn.plan({"save": ["mlp_hidden"], "offload": ["mlp_hidden"]})   # a name in two lists
        rn.plan({"save": ["query_proj"], "offload": ["mlp_hidden"]})   # fix: one action per name
    """


class NotInvertibleError(RematNNError, ValueError):
    """An inversion that did not hold: ``rn.invertible``'s backward pass found, at run time,
    that rebuilding an operand lost information (a known factor of 0, ``log`` of an underflowed
    ``exp``), or ``rn.custom_ivjp.check`` found a user rule that does not invert.

    The message names the primitive, the source line and the fix. Under ``jax.jit`` it arrives
    inside a ``JaxRuntimeError`` (raised from a host callback), whose third line is
    ``NotInvertibleError: rn.invertible: ...``. Example of the wrong code and the fix::

        rn.invertible(lambda x, w: x * (w > 0))            # rebuilding x divides by the mask
        rn.invertible(lambda x, w: x * (w > 0), fallback="recompute")   # fix: keep x instead
    """
