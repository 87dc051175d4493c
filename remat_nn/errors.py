"""Error classes raised by remat_nn.

Each error names the argument, the value received and the fix. They subclass the builtin
exception a user would catch anyway (``ValueError`` / ``TypeError``), so ``except ValueError``
keeps working.
"""

from __future__ import annotations


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
    """A function given to ``rn.invertible`` contains an operation with no exact inverse.

    The message names the primitive and the source line. Fix: give the function an explicit
    inverse with ``rn.custom_ivjp``, or use ``rn.invertible(f, fallback="recompute")`` /
    remat for the non-invertible part.
    """
