"""``rn.custom_ivjp``: a function with a user-given inverse-and-VJP rule."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_nn import _named_axes
from remat_nn.errors import NotInvertibleError
from remat_nn.invertible._primitive_rules import tolerance

__all__ = ["custom_ivjp"]


_WRONG_RULE = """\
rn.invertible: the rule of rn.custom_ivjp({name}) fails its check. {found}
rn.invertible checks each custom_ivjp rule the first time it traces it, at random inputs of the
traced shapes ({shapes}), because the walk trusts the rule: a wrong one would give a silently
wrong gradient. `g.check(*args)` runs the same check at your own inputs."""


class _IVJPBwd:
    """The bwd of one ``custom_ivjp`` call; ``rn.invertible`` recognises it in the jaxpr."""

    is_custom_ivjp = True  # how _equation_rules.ivjp_bwd recognises it

    def __init__(
        self,
        owner: custom_ivjp,
        rule: Callable,
        in_tree: Any,
        known_mask: list[bool],
        store: dict,
    ):
        self.owner, self.rule, self.in_tree = owner, rule, in_tree
        self.known_mask, self.store = known_mask, store

    def apply(self, xs: list[Any], ys: list[Any], dys: list[Any]):
        """Calls the user rule on flat values; ``None`` marks inputs to reconstruct. ``dys``
        are arrays, never None (zeros where no cotangent is wanted): the rule's contract."""
        unflat = jax.tree_util.tree_unflatten
        out_tree = self.store["out_tree"]
        x_tree = unflat(self.in_tree, xs)
        result = self.rule(x_tree, unflat(out_tree, ys), unflat(out_tree, dys))
        name = getattr(self.rule, "__name__", "ivjp")
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"rn.custom_ivjp: the rule {name} must return a pair (xs, dxs), got "
                f"{type(result).__name__}."
            )
        new_xs = self.in_tree.flatten_up_to(result[0])
        dxs = [None] * len(xs) if result[1] is None else self.in_tree.flatten_up_to(result[1])
        for k, (x, new) in enumerate(zip(xs, new_xs, strict=True)):
            if x is None and new is None:
                raise TypeError(
                    f"rn.custom_ivjp: the rule {name} returned None for input leaf {k}, which "
                    "it was asked to reconstruct (it was passed as None)."
                )
        return [x if x is not None else n for x, n in zip(xs, new_xs, strict=True)], list(dxs)

    def verify(self, in_avals: list[Any], out_avals: list[Any]) -> None:
        """Runs the owner's :meth:`custom_ivjp.check` once per input signature, at random inputs
        of ``in_avals`` (``rn.invertible`` does, the first time it traces the rule).

        The inputs are uniform in [0.5, 1.5] (in the domain of ``log``, ``sqrt``, division),
        drawn by NumPy from a fixed seed, and the check is evaluated eagerly even under
        ``jit``. The tolerance is for a wrong rule, not for rounding: 1e-3 of the reference's
        scale (the 8-ulp floor of a 16-bit dtype if larger). Skipped where it cannot run: a
        non-float input or output (no cotangent to compare), or a function that reads a traced
        value it closes over or a named axis.
        """
        key = (self.in_tree, tuple(in_avals))
        if key in self.owner.verified:
            return
        self.owner.verified.add(key)
        if not all(jnp.issubdtype(a.dtype, jnp.inexact) for a in (*in_avals, *out_avals)):
            return
        rng = np.random.default_rng(0)
        leaves = [
            rng.uniform(0.5, 1.5, a.shape).astype(a.dtype)
            if jnp.issubdtype(a.dtype, jnp.floating)
            else (rng.uniform(0.5, 1.5, a.shape) + 1j * rng.uniform(0.5, 1.5, a.shape)).astype(
                a.dtype
            )
            for a in in_avals
        ]
        args = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        tol = max(1e-3, *(tolerance(0.0, a.dtype) for a in in_avals))
        try:
            with jax.ensure_compile_time_eval():
                self.owner.check(*args, rtol=tol, atol=tol / 10)
        except NotInvertibleError as e:
            shapes = ", ".join(a.str_short(short_dtypes=True) for a in in_avals)
            name = getattr(self.owner.fun, "__name__", "fun")
            raise NotInvertibleError(
                _WRONG_RULE.format(name=name, shapes=shapes, found=e)
            ) from None
        except (jax.errors.JAXTypeError, NameError):
            return  # a traced closure or a named axis: nothing concrete to check

    def __call__(self, res, dys):
        ys, known, types = res
        it = iter(known)
        xs = [next(it) if k else None for k in self.known_mask]
        return tuple(_named_axes.cotangents_like(self.apply(xs, list(ys), list(dys))[1], types))


class custom_ivjp:  # noqa: N801  (lower case, like jax.custom_vjp)
    """Gives a function an explicit inverse-and-VJP rule: the backward reconstructs its inputs.

    ``g = rn.custom_ivjp(h); g.defivjp(ivjp)`` with ``ivjp(xs, ys, dys) -> (xs, dxs)``: given the
    outputs ``ys`` and their cotangents ``dys``, the rule returns the inputs ``xs`` and their
    cotangents ``dxs``. ``xs`` is the tuple of positional arguments with every leaf to
    reconstruct passed as ``None`` (leaves of ``known_argnums`` arguments are given). ``dys`` is
    always given, arrays shaped as ``ys`` (zeros where ``rn.invertible`` only needs the inputs
    rebuilt: the ``dxs`` then returned are unused, and XLA drops their computation); the rule
    may return ``None`` for ``dxs``, meaning zero.

    The contract: the rule returns the inputs ``h`` was called with (every leaf it was asked
    for) and, for any ``dys``, the cotangents ``vjp(h)(dys)``; ``dys`` is never None, so the
    rule need not test for it.

    On its own, ``g`` differentiates with the rule, storing only its outputs (and the
    ``known_argnums`` arguments). Inside ``rn.invertible``, the reverse walk uses the rule
    instead of tracing into ``h``, and trusts it: so the first time ``rn.invertible`` traces a
    call of ``g`` (once per input signature) it runs :meth:`check` at random inputs of the
    traced shapes and dtypes (uniform in [0.5, 1.5], a tolerance of 1e-3 of the scale), and a
    wrong rule raises :class:`NotInvertibleError` naming it instead of giving a wrong gradient.
    Works under ``jax.jit`` (the old ``jax.custom_ivjp`` did not: jax#8686), ``vmap`` and
    ``grad``.

    Args:
      fun: the function, taking positional array (pytree) arguments.
      known_argnums: positions of arguments the rule needs as values (weights); they are
        stored, never reconstructed.

    Returns:
      A callable with ``fun``'s signature; register the rule with ``.defivjp(ivjp)`` before
      calling it.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> double = rn.custom_ivjp(lambda x: 2.0 * x)
    >>> _ = double.defivjp(lambda xs, ys, dys: ((ys / 2.0,), (2.0 * dys,)))
    >>> jax.jit(jax.grad(lambda x: double(x).sum()))(jnp.ones(2))
    Array([2., 2.], dtype=float32)

    References:
      JAX's removed ``jax.custom_ivjp`` (``defivjp``, jax#8686); Gomez et al. 2017 (RevNet).
    """

    def __init__(self, fun: Callable, *, known_argnums: Sequence[int] = ()):
        if not callable(fun):
            raise TypeError(
                f"rn.custom_ivjp: argument `fun` must be callable, got {type(fun).__name__}."
            )
        functools.update_wrapper(self, fun)
        self.fun, self.known_argnums = fun, tuple(known_argnums)
        self.ivjp: Callable | None = None
        self.verified: set = set()  # input signatures rn.invertible has checked the rule at

    def defivjp(self, ivjp: Callable) -> Callable:
        """Sets the rule ``ivjp(xs, ys, dys) -> (xs, dxs)``; returns it (usable as decorator)."""
        if not callable(ivjp):
            raise TypeError(
                f"rn.custom_ivjp.defivjp: argument `ivjp` must be callable, got "
                f"{type(ivjp).__name__}."
            )
        self.ivjp, self.verified = ivjp, set()
        return ivjp

    def check(self, *args: Any, rtol: float = 1e-5, atol: float = 1e-6) -> float:
        """Round-trips the rule at ``args`` before you train on it; returns the max error.

        Runs ``fun`` forward, asks the rule to reconstruct the inputs from the outputs (with
        all-ones output cotangents), and compares the inputs with ``args`` and the cotangents
        with plain autodiff of ``fun``.

        Raises:
          NotInvertibleError: a reconstructed input or a cotangent differs beyond
            ``atol + rtol * |reference|``; the message names the leaf and the error.

        >>> import jax.numpy as jnp, remat_nn as rn
        >>> double = rn.custom_ivjp(lambda x: 2.0 * x)
        >>> _ = double.defivjp(lambda xs, ys, dys: ((ys / 3.0,), (2.0 * dys,)))  # wrong inverse
        >>> double.check(jnp.ones(3))
        Traceback (most recent call last):
        ...
        remat_nn.errors.NotInvertibleError: rn.custom_ivjp(<lambda>).check: ... off by ...
        """
        name = getattr(self.fun, "__name__", "fun")
        if self.ivjp is None:
            raise TypeError(f"rn.custom_ivjp({name}).check: no rule defined; call defivjp first.")
        ys, vjp = jax.vjp(self.fun, *args)
        dys = jax.tree.map(jnp.ones_like, ys)
        want_dxs = vjp(dys)
        known = {k % len(args) for k in self.known_argnums}
        xs_in = tuple(
            a if i in known else jax.tree.map(lambda _: None, a) for i, a in enumerate(args)
        )
        xs, dxs = self.ivjp(xs_in, ys, dys)
        worst = 0.0
        for what, got, want in (("reconstructed input", xs, args), ("cotangent", dxs, want_dxs)):
            got_leaves = jax.tree_util.tree_leaves(got)
            want_leaves = jax.tree_util.tree_leaves(want)
            for k, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
                err = float(jnp.max(jnp.abs(jnp.asarray(g) - w)))
                worst = max(worst, err)
                if err > atol + rtol * float(jnp.max(jnp.abs(w))):
                    raise NotInvertibleError(
                        f"rn.custom_ivjp({name}).check: the rule's {what} leaf {k} is off by "
                        f"{err:.3g} (atol {atol}, rtol {rtol}). Fix the rule "
                        f"{getattr(self.ivjp, '__name__', 'ivjp')}: it must return the inputs "
                        "fun was called with and their cotangents."
                    )
        return worst

    def __call__(self, *args: Any) -> Any:
        name, rule = getattr(self.fun, "__name__", "fun"), self.ivjp
        if rule is None:
            raise TypeError(
                f"rn.custom_ivjp({name}): no rule defined. Fix: g.defivjp(ivjp) with "
                "ivjp(xs, ys, dys) -> (xs, dxs) before calling g."
            )
        bad = [k for k in self.known_argnums if not -len(args) <= k < len(args)]
        if bad:
            raise ValueError(
                f"rn.custom_ivjp({name}): known_argnums {bad} out of range for {len(args)} "
                "positional arguments."
            )
        known = {k % len(args) for k in self.known_argnums}
        known_mask = [i in known for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
        leaves, in_tree = jax.tree_util.tree_flatten(args)
        store: dict[str, Any] = {}

        def flat_fun(*xs):
            out, store["out_tree"] = jax.tree_util.tree_flatten(
                self.fun(*jax.tree_util.tree_unflatten(in_tree, xs))
            )
            return out

        def fwd(*xs):
            ys = flat_fun(*xs)
            known = [x for x, k in zip(xs, known_mask, strict=True) if k]
            return ys, (ys, known, _named_axes.type_witness(list(xs)))

        run = jax.custom_vjp(flat_fun)
        run.defvjp(fwd, _IVJPBwd(self, rule, in_tree, known_mask, store))
        outs = run(*leaves)
        return jax.tree_util.tree_unflatten(store["out_tree"], outs)
