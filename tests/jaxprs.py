"""Reading a jaxpr in tests: every equation, nested bodies included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from remat_nn._jax_internals import sub_jaxprs


def equations(jaxpr: Any, enclosing: tuple[str, ...] = ()) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """``(equation, the primitives of the equations whose bodies hold it)`` for every equation of
    ``jaxpr`` and of its sub-jaxprs (``scan``, ``while``, ``pjit`` bodies ...), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn, enclosing
        for sub in sub_jaxprs(eqn):
            yield from equations(sub, (*enclosing, eqn.primitive.name))
