"""``rn.invertible``: trace once per signature, analyse, and wrap the walk in a ``custom_vjp``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.interpreters.ad import JVPTracer

from remat_nn import _drift
from remat_nn._jax_internals import core, pe
from remat_nn.errors import NotInvertibleError
from remat_nn.invertible._analysis import Analysis, analyze
from remat_nn.invertible._equation_rules import verify_custom_rules
from remat_nn.invertible._jaxpr import dce, eval_jaxpr
from remat_nn.invertible._primitive_rules import DEFAULT_RTOL
from remat_nn.invertible._vjp import as_custom_vjp, by_value, run_and_sketch
from remat_nn.invertible._walk import execute, stop_on_failed_check

__all__ = ["Invertible", "invertible"]

_FALLBACKS = ("error", "recompute")


def _is_dynamic(leaf: Any) -> bool:
    # Like jax.jit: arrays and Python scalars are traced; anything else is a static leaf.
    return isinstance(
        leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic | int | float | complex
    )


@dataclasses.dataclass
class Traced:
    """One signature of the function: its jaxpr, the analysis and the differentiable runner."""

    jaxpr: core.Jaxpr  # constvars turned into leading invars, dead code removed
    consts: list[Any]  # values of the hoisted constants (closed-over arrays)
    names: list[str]  # a readable name per jaxpr input
    dyn_index: list[int]  # positions of the traced leaves among the flat arguments
    out_tree: Any
    analysis: Analysis
    run: Callable  # the custom_vjp over (consts, traced leaves)
    reporting: Callable  # the same, with a probe last, reporting to it (report_drift_to)


def _arg_name(path: tuple, positions: Sequence[int] | None) -> str:
    """``args[2]['w']`` / ``kwargs['scale']`` for a leaf of ``(args, kwargs)``; ``positions``
    maps the traced arguments back to the call's positions (static ones left out)."""
    if path[0].idx == 1:
        return "kwargs" + jax.tree_util.keystr(path[1:])
    k = path[1].idx if positions is None else positions[path[1].idx]
    return f"args[{k}]" + jax.tree_util.keystr(path[2:])


def _signature_key(treedef, leaves, dyn_index) -> Any:
    """What a trace depends on: the tree, the static leaves and the types of the traced ones."""
    dyn = set(dyn_index)
    static = tuple(leaf for i, leaf in enumerate(leaves) if i not in dyn)
    types = tuple(jax.typeof(leaves[i]) for i in dyn_index)
    return (treedef, static, types)


_NOT_DETERMINED = """\
rn.invertible({fun}): the outputs do not determine {names}, which the backward pass needs: {why}.
Without them the walk would have to store them (it never stores silently). Fix: declare the
arguments that are weights with known_argnums= / known_argnames=; or rn.invertible(f,
fallback="recompute") to keep {names} and recompute from it (rn.inversion_report lists it under
data_inputs); or give the blocking part an inverse (rn.register_inverse, rn.custom_ivjp)."""


def _is_known_leaf(path: tuple, positions: Sequence[int] | None, known) -> bool:
    """Whether the leaf at ``path`` of ``(args, kwargs)`` belongs to a declared argument."""
    nums, names = known
    if path[0].idx == 1:
        return path[1].key in names
    k = path[1].idx if positions is None else positions[path[1].idx]
    return k in nums


def _trace(
    fun: Callable,
    args: tuple,
    kwargs: dict,
    *,
    lossy_ok: bool,
    positions: Sequence[int] | None = None,
    known: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
    strict: bool = False,
    rtol: float | None = None,
) -> Traced:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in leaves_with_path]
    dyn_index = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
    store = {}

    def flat_fun(*dyn):
        full = list(leaves)
        for i, d in zip(dyn_index, dyn, strict=True):
            full[i] = d
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        out_leaves, store["out_tree"] = jax.tree_util.tree_flatten(fun(*a, **k))
        return out_leaves

    closed = jax.make_jaxpr(flat_fun)(*[leaves[i] for i in dyn_index])
    verify_custom_rules(closed.jaxpr)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    jaxpr = dce(jaxpr, [True] * len(jaxpr.outvars))
    names = [f"closed-over constant {k}" for k in range(len(closed.consts))]
    names += [_arg_name(leaves_with_path[i][0], positions) for i in dyn_index]
    num_consts = len(closed.consts)
    declared = None
    if known is not None:
        declared = list(range(num_consts)) + [
            num_consts + j
            for j, i in enumerate(dyn_index)
            if _is_known_leaf(leaves_with_path[i][0], positions, known)
        ]
    # A concrete closed-over array is a constant: no cotangent flows into it.
    diff_in = [isinstance(c, core.Tracer) for c in closed.consts] + [True] * len(dyn_index)
    analysis = analyze(
        jaxpr,
        lossy_ok=lossy_ok,
        num_constants=num_consts,
        declared=declared,
        diff_in=diff_in,
        rtol=DEFAULT_RTOL if rtol is None else rtol,
    )
    if analysis.failure is not None:  # not expected: every input may be kept
        raise NotInvertibleError(f"rn.invertible: {analysis.failure}")
    if strict and analysis.undetermined:
        raise NotInvertibleError(
            _NOT_DETERMINED.format(
                fun=getattr(fun, "__name__", "?"),
                names=", ".join(names[p] for p in analysis.undetermined),
                why=analysis.blocked,
            )
        )
    run, reporting = (
        as_custom_vjp(analysis, not strict, report, conditioned=rtol is None)
        for report in (False, True)
    )
    out_tree = store["out_tree"]
    return Traced(jaxpr, list(closed.consts), names, dyn_index, out_tree, analysis, run, reporting)


class Invertible:
    """A function whose VJP rebuilds its intermediates from its outputs.

    Made by :func:`invertible`; call it like the wrapped function. Each signature (the static
    arguments, the tree and the types of the array arguments) is traced and analysed once.
    """

    def __init__(
        self,
        fun: Callable,
        fallback: str,
        static_argnums: tuple[int, ...],
        static_argnames: tuple[str, ...],
        named: frozenset[int] = frozenset(),
        known: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
        rtol: float | None = None,
    ):
        functools.update_wrapper(self, fun)
        self.rtol = rtol
        self.fun, self.fallback, self.known = fun, fallback, known
        self._known_named = frozenset() if known is None else _named_positions(fun, known[0])
        self.static_argnums, self.static_argnames = static_argnums, static_argnames
        self._named = named  # static positions that are named parameters (may come by keyword)
        self._cache: dict[Any, Traced] = {}

    def _split(self, args: tuple, kwargs: dict):
        """(dynamic args, dynamic kwargs, a function of those closing over the static ones, the
        static values as a cache key, the call positions of the dynamic args)."""
        n = len(args)
        # A static parameter passed by keyword leaves its position out of range: that is fine.
        bad = [k for k in self.static_argnums if not -n <= k < n and k not in self._named]
        if bad:
            raise ValueError(
                f"{self!r}: static_argnums {bad} out of range for {n} positional arguments. "
                "Fix: pass those arguments positionally, or list them in static_argnames."
            )
        static_pos = {k % n for k in self.static_argnums if -n <= k < n}
        static_args = {i: args[i] for i in static_pos}
        static_kw = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        for where_, value in [*static_args.items(), *static_kw.items()]:
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"{self!r}: static argument {where_!r} must be hashable (it keys the trace "
                    f"cache), got {type(value).__name__}. Fix: pass a tuple instead of a list, or "
                    "make it a traced array argument."
                ) from None
        positions = [i for i in range(n) if i not in static_pos]
        dyn_args = tuple(args[i] for i in positions)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}
        if not static_args and not static_kw:
            return dyn_args, dyn_kwargs, self.fun, (), positions

        def bound(*dyn, **kw):
            it = iter(dyn)
            full = [static_args[i] if i in static_pos else next(it) for i in range(n)]
            return self.fun(*full, **kw, **static_kw)

        static_key = (tuple(sorted(static_args.items())), tuple(sorted(static_kw.items())))
        return dyn_args, dyn_kwargs, bound, static_key, positions

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """The (cached) trace and analysis of this call signature."""
        return self._prepare(args, kwargs)[0]

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[Traced, list[Any], Any]:
        """(the trace of this signature, the flat non-static leaves, their tree)."""
        dyn_args, dyn_kwargs, fun, static_key, positions = self._split(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        dyn_index = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
        try:
            key = (static_key, _signature_key(treedef, leaves, dyn_index))
            hash(key)
        except TypeError:  # an unhashable static leaf: trace every time
            key = None
        if key is not None and key in self._cache:
            return self._cache[key], leaves, treedef
        if self.known is not None:
            n = len(args)
            bad = [k for k in self.known[0] if not -n <= k < n and k not in self._known_named]
            if bad:
                raise ValueError(
                    f"{self!r}: known_argnums {bad} out of range for {n} positional arguments. "
                    "Fix: pass those arguments positionally, or list them in known_argnames."
                )
        known = None
        if self.known is not None:
            n = len(args)
            known = (tuple(k % n for k in self.known[0] if -n <= k < n), self.known[1])
        strict = self.fallback == "error"
        traced = _trace(
            fun,
            dyn_args,
            dyn_kwargs,
            lossy_ok=strict,
            positions=positions,
            known=known,
            strict=strict,
            rtol=self.rtol,
        )
        # Like jax.jit, closed-over arrays are captured at the first trace; a trace that closed
        # over another transformation's tracers is not reused.
        if key is not None and not any(isinstance(c, core.Tracer) for c in traced.consts):
            self._cache[key] = traced
        return traced, leaves, treedef

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        traced, leaves, _ = self._prepare(args, kwargs)
        ins = [*traced.consts, *[leaves[i] for i in traced.dyn_index]]
        if any(isinstance(x, JVPTracer) for x in ins):
            # Forward mode (jax.jvp / jacfwd / linearize) stores nothing for a backward pass:
            # f's own JVP runs (a custom_vjp has no forward mode).
            outs = eval_jaxpr(traced.analysis.jaxpr, ins)[0]
        elif (sink := _drift.current_sink()) is not None and traced.analysis.checked:
            outs = traced.reporting(*ins, sink.take())  # see rn.report_drift_to
        else:
            outs = traced.run(*ins)
        return jax.tree_util.tree_unflatten(traced.out_tree, outs)

    def reconstruct(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Rebuilds the array arguments from the outputs, as the backward pass does.

        Runs ``fun`` forward, then the walk without cotangents, from the outputs and the inputs
        the forward keeps. Compare the result with the arguments to check that ``fun`` really
        is reconstructed (run-time checks apply, as in the backward).

        Returns:
          ``(args, kwargs)`` as passed, static arguments left out, array leaves rebuilt.

        >>> import jax.numpy as jnp, remat_nn as rn
        >>> f = rn.invertible(lambda x, w: (x + jnp.tanh(w)) * 2.0)
        >>> (x, w), _ = f.reconstruct(jnp.arange(3.0), jnp.ones(3))
        >>> x
        Array([0., 1., 2.], dtype=float32)
        """
        traced, leaves, treedef = self._prepare(args, kwargs)
        analysis = traced.analysis
        ins = list(traced.consts) + [leaves[i] for i in traced.dyn_index]
        schedule = analysis.schedule(False, True)
        outs, sketches = run_and_sketch(schedule, ins)
        kept = set(analysis.kept)
        invals = [x if p in kept else None for p, x in enumerate(ins)]
        rebuilt, _, code, _ = execute(
            analysis, invals, outs, None, want_inputs=True, sketches=by_value(schedule, sketches)
        )
        stop_on_failed_check(code)
        for i, x in zip(traced.dyn_index, rebuilt[len(traced.consts) :], strict=True):
            leaves[i] = x
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", repr(self.fun))
        return f"rn.invertible({name}, fallback={self.fallback!r})"


def _named_positions(fun: Callable, nums: Sequence[int]) -> frozenset[int]:
    """The positions among ``nums`` that are named parameters (they may come by keyword)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return frozenset()
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return frozenset(k for k in nums if 0 <= k < n)


def _normalize_argnums(fun: Callable, argnums, argnames, what: str):
    """``(nums, names, named positions)`` with a name also making its position count and
    vice versa, as in ``jax.jit``; ``what`` is ``"static"`` or ``"known"`` (for errors)."""
    return _normalize_static(fun, argnums, argnames, what)


def _normalize_static(fun: Callable, static_argnums, static_argnames, what: str = "static"):
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return nums, names, frozenset()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # As in jax.jit: a static name also makes its position static and vice versa.
    nums = tuple(sorted(set(nums) | {positional.index(n) for n in names if n in positional}))
    names = tuple(sorted(set(names) | {positional[k] for k in nums if 0 <= k < len(positional)}))
    known = {p.name for p in params}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
    unknown = [n for n in names if n not in known]
    if unknown and not takes_kwargs:
        raise ValueError(
            f"rn.invertible: {what}_argnames {unknown} are not parameters of "
            f"{getattr(fun, '__name__', fun)} (it takes {sorted(known)})."
        )
    named = frozenset(k for k in nums if 0 <= k < len(positional))
    return nums, names, named


def invertible(
    fun: Callable | None = None,
    *,
    fallback: str = "error",
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    known_argnums: int | Sequence[int] | None = None,
    known_argnames: str | Sequence[str] | None = None,
    rtol: float | None = None,
) -> Any:
    """Makes ``fun``'s VJP rebuild its intermediates from its outputs instead of storing them.

    The forward pass stores ``fun``'s outputs and the inputs the reverse walk keeps: the ones no
    inverse rule could rebuild (for a coupling ``y1 = x1 + F(x2); y2 = x2 + G(y1)``: ``F``'s and
    ``G``'s weights, which the caller keeps alive anyway) and, only where the outputs do not
    determine everything, the fewest further inputs (``exp(x) * x``: ``x``). It never stores an
    intermediate. The backward pass walks ``fun``'s jaxpr from the last equation to the first,
    rebuilding each equation's operands from its outputs (or recomputing them from known values)
    just before taking that equation's VJP, so a stack of N couplings costs the activation memory
    of one. Gradients equal plain autodiff up to float round-off in the reconstruction.

    Wrap the whole stack once (or a ``lax.scan`` over the blocks): each call stores its outputs,
    so ``rn.invertible(block)`` called per block stores every block's output, like no remat.
    ``rn.inversion_report`` of the calling function flags that use.

    Works under ``jit``, ``vmap``, ``grad``, ``lax.scan`` and ``jax.checkpoint``; takes pytrees,
    several inputs and outputs, keyword arguments, typed PRNG keys and static arguments; arrays
    ``fun`` closes over are hoisted into inputs and get gradients too. Each signature is traced
    and analysed once (closed-over arrays are captured then, as by ``jax.jit``).

    Args:
      fun: the function to invert, mapping arrays (pytrees) to arrays. Its path from inputs
        to outputs should use invertible primitives (add, sub, mul/div by a known value,
        exp/log, reshape, concatenate/split, slices that together hold each element of their
        operand once (``x[:, :8], x[:, 8:]``), ..., ``scan`` of an invertible body, ``custom_ivjp``
        functions, or ones added with ``rn.register_inverse``); side computations (``F(x2)``)
        may use anything. What cannot be inverted is recomputed from kept inputs.
      fallback: how to treat inversions that floating point can break (division by a known
        operand that may hold 0, ``log`` of an ``exp`` that may have underflowed):
        ``"error"`` (default) inverts and checks the values at run time, stopping with an error
        naming the primitive and line if information was lost (never a non-finite gradient);
        ``"recompute"`` never uses them, keeping the input instead and recomputing. Also
        strictness: with ``"error"`` an argument that is not a weight and that the outputs do
        not determine raises :class:`NotInvertibleError` naming the equation that hides it;
        with ``"recompute"`` it is kept. And at run time: with ``"recompute"`` an iteration of a
        top-level ``lax.scan`` whose rebuilt values fail a check is recomputed from the scan's
        first carry, kept by the forward (``rn.drift_recomputes()`` counts it); a failed check
        elsewhere raises with either.
      static_argnums: positions of arguments that are Python values (``train=True``), not
        traced; they must be hashable. As in ``jax.jit``.
      static_argnames: names of such arguments.
      known_argnums: positions of the arguments that are weights (kept, never rebuilt);
        every other argument must then be rebuilt from the outputs (see ``fallback``).
        Default None: weights are inferred (``rn.inversion_report`` shows which).
      known_argnames: names of such arguments.
      rtol: tolerance of every floating inversion's run-time error bound, relative to the
        rebuilt tensor's max |value| (never below 8 ulps of its dtype); exceeding it stops
        the backward with an error naming the primitive and line. A derivative taken at rebuilt
        values is checked at 1000 times ``rtol``. Default None: ``rtol`` 1e-5, and a derivative
        check that fails by less than the function's own conditioning allows is accepted (the
        square root of the epsilon of its narrowest float dtype times its relative condition
        number, measured from the backward's cotangents, at most 100: a chaotic stack, where
        plain autodiff's gradient is as far from exact; docs/invertible.md). A number is never
        raised.

    Returns:
      An :class:`Invertible` callable with ``fun``'s signature, or a decorator if ``fun`` is
      omitted (``@rn.invertible(static_argnames="train")``).

    Raises:
      ValueError: ``fallback`` is not ``"error"`` / ``"recompute"``, a static or known argument
        is out of range or not a parameter, or ``rtol`` is not in (0, 1).
      NotInvertibleError: (at the call) with ``fallback="error"``, an argument that is not a
        weight is not determined by the outputs; or an ``rn.custom_ivjp`` rule ``fun`` calls
        fails its check, run the first time it is traced (see ``rn.custom_ivjp``).
      TypeError: ``fun`` is not callable, or a static argument is not hashable.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> @rn.invertible
    ... def coupling(x1, x2, w):
    ...     y1 = x1 + jnp.tanh(x2 @ w)
    ...     y2 = x2 + jnp.tanh(y1 @ w)
    ...     return y1, y2
    >>> x, w = jnp.ones((2, 3)), 0.1 * jnp.eye(3)
    >>> loss = lambda x1, x2, w: sum(y.sum() for y in coupling(x1, x2, w))
    >>> jax.grad(loss, argnums=(0, 2))(x, x, w)[0].shape
    (2, 3)

    References:
      Gomez et al. 2017, "The Reversible Residual Network: Backpropagation Without Storing
      Activations". JAX's removed ``jax.invertible`` (it handled four primitives, still stored
      its inputs, and could not be jitted with custom rules: jax#8686).
    """
    if fallback not in _FALLBACKS:
        raise ValueError(
            f"rn.invertible: argument `fallback` must be one of {_FALLBACKS}, got {fallback!r}. "
            'Fix: rn.invertible(f, fallback="recompute") to recompute instead of a checked '
            "inversion."
        )
    if fun is None:
        return functools.partial(
            invertible,
            fallback=fallback,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            known_argnums=known_argnums,
            known_argnames=known_argnames,
            rtol=rtol,
        )
    if not callable(fun):
        raise TypeError(
            f"rn.invertible: argument `fun` must be callable, got {type(fun).__name__} {fun!r}."
        )
    nums, names, named = _normalize_static(fun, static_argnums, static_argnames)
    known = None
    if known_argnums is not None or known_argnames is not None:
        knums, knames, _ = _normalize_argnums(
            fun,
            () if known_argnums is None else known_argnums,
            () if known_argnames is None else known_argnames,
            "known",
        )
        known = (knums, knames)
    if rtol is not None and not (isinstance(rtol, int | float) and 0 < rtol < 1):
        raise ValueError(
            f"rn.invertible: argument `rtol` must be None or a number in (0, 1), got {rtol!r}. "
            "Fix: e.g. rtol=1e-5 to accept rebuilt values within 1e-5 of their tensor's max "
            "|value|, or leave it out for the default."
        )
    rtol = None if rtol is None else float(rtol)
    return Invertible(fun, fallback, nums, names, named, known, rtol)
