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
    """An inversion that did not hold: ``rn.invertible``'s backward pass found, at run time,
    that rebuilding an operand lost information (a known factor of 0, ``log`` of an underflowed
    ``exp``), or ``rn.custom_ivjp.check`` found a user rule that does not invert.

    The message names the primitive and the source line. Under ``jax.jit`` it arrives inside a
    ``JaxRuntimeError`` (raised from a host callback). Example of the wrong code and the fix::

        rn.invertible(lambda x, w: x * (w > 0))            # rebuilding x divides by the mask
        rn.invertible(lambda x, w: x * (w > 0), fallback="recompute")   # fix: keep x instead
    """
