"""Remat policies by name: one registry, one resolver with a did-you-mean error.

Every policy in ``jax.checkpoint_policies`` resolves by its own name, plus short aliases. A
policy is a callable value (``policy(prim, *avals, **params) -> bool | pe.Saveable | ...``), so
callables pass through unchanged; plans (:mod:`remat_nn._plan`) compile to one. What remat
wrappers check at first trace: a name policy's names (read as a plan), and whether a callable of
the user's own saves anything (:func:`watched_body`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax

from remat_nn._jax_internals import (
    SaveAnyNamesButThese,
    SaveOnlyTheseNames,
    is_jax_policy,
    pe,
    remat3_honours,
    remat3_on,
    sub_jaxprs,
)
from remat_nn._plan import Plan, as_plan, current_trace_eqns, names_in_jaxpr, plan
from remat_nn.errors import PolicyError, did_you_mean

__all__ = ["ALIASES", "NO_REMAT", "POLICIES", "Policy", "policy"]

Policy = Callable[..., Any]

_cp = jax.checkpoint_policies
_OFFLOAD_DEFAULTS = {"offload_src": "device", "offload_dst": "pinned_host"}


class _Entry(NamedTuple):
    obj: Callable[..., Any]
    factory: bool  # True: called with the user's arguments to make the policy
    doc: str


def _offload_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    # JAX's offload factories take keyword-only src/dst; default them to device -> pinned_host.
    def make(*args: Any, **kwargs: Any) -> Policy:
        return fn(*args, **{**_OFFLOAD_DEFAULTS, **kwargs})

    return make


def _save_from_both(policy_1: Any, policy_2: Any) -> Policy:
    return _cp.save_from_both_policies(policy(policy_1), policy(policy_2))


def _save_anything_except(*names: str) -> Policy:
    if names:
        warnings.warn(
            "rn.policy('save_anything_except_these_names', ...): in JAX 0.10 this policy saves "
            f"every value, the names {names} included (its body is `return True`). To recompute "
            "those names, use rn.plan({'recompute': [...], 'default': 'save'}) or "
            "'save_any_names_but_these'.",
            UserWarning,
            stacklevel=3,
        )
    return _cp.save_anything_except_these_names(*names)


#: name -> entry. The single table of every policy remat_nn resolves by name.
POLICIES: Mapping[str, _Entry] = MappingProxyType(
    {
        "everything_saveable": _Entry(_cp.everything_saveable, False, "save every value"),
        "nothing_saveable": _Entry(_cp.nothing_saveable, False, "save only the inputs"),
        "dots_saveable": _Entry(_cp.dots_saveable, False, "save every dot_general output"),
        "checkpoint_dots": _Entry(_cp.checkpoint_dots, False, "same as dots_saveable"),
        "dots_with_no_batch_dims_saveable": _Entry(
            _cp.dots_with_no_batch_dims_saveable, False, "save dots without batch dimensions"
        ),
        "checkpoint_dots_with_no_batch_dims": _Entry(
            _cp.checkpoint_dots_with_no_batch_dims, False, "same as dots_with_no_batch_dims"
        ),
        "save_only_these_names": _Entry(
            _cp.save_only_these_names, True, "(*names): save only these named values"
        ),
        "save_any_names_but_these": _Entry(
            _cp.save_any_names_but_these, True, "(*names): save named values except these"
        ),
        "save_anything_except_these_names": _Entry(
            _save_anything_except, True, "(*names): JAX 0.10 saves everything (see warning)"
        ),
        "save_from_both_policies": _Entry(
            _save_from_both, True, "(p1, p2): save what either policy saves; names resolve"
        ),
        "save_and_offload_only_these_names": _Entry(
            _offload_factory(_cp.save_and_offload_only_these_names),
            True,
            "(names_which_can_be_saved=, names_which_can_be_offloaded=): save or offload these",
        ),
        "offload_dot_with_no_batch_dims": _Entry(
            _offload_factory(_cp.offload_dot_with_no_batch_dims),
            True,
            "(): offload dots without batch dimensions to pinned host memory",
        ),
    }
)

#: short alias -> registry name.
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "full": "nothing_saveable",
        "dots": "dots_saveable",
        "dots_no_batch": "dots_with_no_batch_dims_saveable",
    }
)


#: The one spelling of "no remat" across remat_nn, the models, the planner and the trainer: no
#: wrapper at all. ``rn.checkpoint``, ``nn.remat`` and ``rnnx.remat`` given it return their target
#: unchanged; it is no policy (a wrapper that saves every value is ``everything_saveable``).
NO_REMAT = "none"

_NOT_A_POLICY = (
    "rn.policy('none'): 'none' means no remat wrapper at all, so it is no policy. Fix: to run "
    "without remat, pass policy='none' to rn.checkpoint / nn.remat / rnnx.remat (they then "
    "return the function or class unwrapped) or do not wrap; to wrap and save every value, "
    "rn.policy('everything_saveable'); to recompute everything, rn.policy('full')."
)


def _unknown(spec: str) -> PolicyError:
    valid = sorted([*POLICIES, *ALIASES])
    hint = did_you_mean(spec, valid)
    return PolicyError(
        f"rn.policy: unknown policy name {spec!r}.{hint} Valid names: {', '.join(valid)}; "
        "or a plan string such as 'save=query_proj;offload=mlp_hidden'."
    )


def policy(spec: Any, *args: Any, **kwargs: Any) -> Policy | None:
    """Resolves a policy name, alias, plan or callable to a JAX remat policy.

    The names of a policy a name factory made (``save_only_these_names``,
    ``save_any_names_but_these``, ``save_and_offload_only_these_names``, and
    ``save_from_both_policies`` of two of them), by this function or by
    ``jax.checkpoint_policies`` itself, are checked as a plan's are when ``rn.checkpoint``,
    ``nn.remat`` or ``rnnx.remat`` first trace the body; a callable of your own that saves nothing
    there warns once (:func:`watched_body`).

    Args:
      spec: one of
        - a name in ``jax.checkpoint_policies`` (e.g. ``"dots_with_no_batch_dims_saveable"``);
          factories (``"save_only_these_names"``, ...) take their arguments as ``*args`` /
          ``**kwargs``; the offload ones default to ``offload_src="device"``,
          ``offload_dst="pinned_host"``;
        - an alias: ``full`` (recompute everything), ``dots``, ``dots_no_batch``
          (``"none"`` is no policy: it means no remat wrapper, see :data:`NO_REMAT`);
        - a :class:`remat_nn.Plan`, a plan mapping or a plan string (see :func:`remat_nn.plan`);
        - a callable, returned unchanged; ``None``, returned unchanged (JAX's default).

      *args: arguments of a factory policy.
      **kwargs: keyword arguments of a factory policy.

    Returns:
      A callable usable as ``jax.checkpoint(..., policy=...)``, or ``None``.

    Raises:
      PolicyError: an unknown name (with the closest valid one), ``"none"`` (no remat: no
        policy), or arguments given to a policy that takes none.
      TypeError: a factory name without its arguments, or a value of another type.

    >>> import remat_nn as rn
    >>> rn.policy("dots") is rn.policy("dots_saveable")
    True
    >>> p = rn.policy("save_only_these_names", "mlp_hidden")  # names checked when traced
    >>> import jax, jax.numpy as jnp
    >>> f = rn.checkpoint(lambda x: jnp.sin(rn.name(x, "mlp_hiden")).sum(), policy=p)
    >>> jax.grad(f)(1.0)
    Traceback (most recent call last):
    ...
    remat_nn.errors.PlanError: plan names ['mlp_hidden'] never occur in <lambda>, ...
    >>> rn.policy("dots_savable")
    Traceback (most recent call last):
    ...
    remat_nn.errors.PolicyError: rn.policy: unknown policy name 'dots_savable'. Did you mean ...
    """
    if spec is None or (callable(spec) and not isinstance(spec, str | Plan)):
        if args or kwargs:
            raise PolicyError(
                f"rn.policy: arguments {args or ''}{kwargs or ''} were given with a callable or "
                "None policy, which takes none. Fix: call the factory yourself, or pass its name."
            )
        return spec
    if isinstance(spec, Plan | Mapping) or (isinstance(spec, str) and "=" in spec):
        if args or kwargs:
            raise PolicyError("rn.policy: a plan takes no extra arguments; put them in the plan.")
        return plan(spec).to_policy()
    if not isinstance(spec, str):
        hint = (
            " A list is not a plan: write a mapping such as {'save': [...]} or rn.plan(save=[...])."
            if isinstance(spec, list | tuple)
            else ""
        )
        raise TypeError(
            f"rn.policy: argument `spec` must be a policy name, a plan or a callable, got "
            f"{type(spec).__name__} {spec!r}.{hint} Fix: rn.policy('dots_saveable')."
        )
    if spec == NO_REMAT:
        raise PolicyError(_NOT_A_POLICY)
    key = ALIASES.get(spec, spec)
    if key not in POLICIES:
        raise _unknown(spec)
    entry = POLICIES[key]
    if not entry.factory:
        if args or kwargs:
            raise PolicyError(
                f"rn.policy({spec!r}) takes no arguments, got {args or ''}{kwargs or ''}. "
                f"Fix: rn.policy({spec!r})."
            )
        return entry.obj
    if not args and not kwargs and key != "offload_dot_with_no_batch_dims":
        raise TypeError(
            f"rn.policy({spec!r}) is a policy factory and needs arguments "
            f"{entry.doc.split(':')[0]}. Fix: rn.policy({spec!r}, 'mlp_hidden', ...), "
            "or use rn.plan for names."
        )
    return entry.obj(*args, **kwargs)


_SAVES_NOTHING = """\
{where}: the callable `policy` {policy} saves nothing in {body} at its first trace (it answers \
recompute for every operation), so the backward pass recomputes everything, as with \
policy='full'. remat_nn cannot read what a policy of your own means; a name-based one with a \
misspelled name does exactly this (names that occur: {names}). Fix: for names, \
rn.plan(save=[...]) or jax.checkpoint_policies.save_only_these_names(...) (their names are \
checked); to recompute everything, policy='full'."""


def is_custom(policy: Any) -> bool:
    """Whether ``policy`` is a callable neither JAX nor remat_nn made: one whose choices
    remat_nn cannot read, watched by :func:`watched_body`."""
    if not callable(policy) or is_jax_policy(policy):
        return False
    return not str(getattr(policy, "__module__", "")).startswith("remat_nn.")


def watched_body(fn: Callable[..., Any], policy: Any, where: str, body: str) -> Callable[..., Any]:
    """``fn``, warning at its first trace inside a remat when ``policy`` saves none of its values.

    At that trace (only once per wrapper) the policy is asked about every equation of the body,
    as JAX asks it when differentiating (``policy(primitive, *avals, **params)``); if it answers
    recompute for all of them, a UserWarning says so. A policy that raises here is left to JAX.
    """
    first = True

    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        nonlocal first
        out = fn(*args, **kwargs)
        eqns = current_trace_eqns() if first else None
        if eqns is not None:
            first = False
            try:
                saves = _saves_any(policy, eqns)
            except Exception:  # JAX raises its own error when it asks the policy
                saves = True
            if not saves:
                names = sorted(set(names_in_jaxpr(None, eqns))) or "none"
                text = _SAVES_NOTHING.format(
                    where=where, policy=_label(policy), body=body, names=names
                )
                warnings.warn(text, UserWarning, stacklevel=2)
        return out

    return watched


def _saves_any(policy: Any, eqns: Sequence[Any]) -> bool:
    for eqn in eqns:
        choice = pe.ensure_enum(policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params))
        if not isinstance(choice, pe.RecomputeType):
            return True
        if any(_saves_any(policy, sub.eqns) for sub in sub_jaxprs(eqn)):
            return True
    return False


def _label(policy: Any) -> str:
    name = getattr(policy, "__qualname__", None)
    return f"{name!r}" if name else repr(policy)


_REMAT3 = """\
{where}: JAX's `jax_remat3` upgrade flag is on, and its remat applies only `nothing_saveable`,
the `dots` policies and name lists (`save_only_these_names`, plans that save or recompute names);
with {what} it would silently recompute everything. Fix: a plan of names with save / recompute
only (rn.plan(save=[...])), or turn the flag off (jax.config.update("jax_remat3", False))."""


def for_remat3(spec: Any, resolved: Any, where: str) -> Any:
    """The policy to hand ``jax.checkpoint``: ``resolved``, or, when the ``jax_remat3`` flag is
    on, the equivalent policy JAX's new remat honours (a plan of names becomes a name list).

    Raises:
      PolicyError: ``jax_remat3`` is on and the policy has no equivalent it applies (an
        offloading plan, ``everything_saveable``, a custom callable): never a silent no-op.
    """
    if not remat3_on() or remat3_honours(resolved):
        return resolved
    the_plan = as_plan(spec)
    if the_plan is not None and not the_plan.offload:
        # Unnamed values are recomputed by a plan and by both name-list classes alike.
        if the_plan.default == "recompute":
            return SaveOnlyTheseNames(frozenset(the_plan.save))
        return SaveAnyNamesButThese(frozenset(the_plan.recompute))
    what = f"the plan {the_plan} (it offloads)" if the_plan is not None else f"policy {spec!r}"
    raise PolicyError(_REMAT3.format(where=where, what=what))


def check_takes_policy(fn: Callable[..., Any], who: str) -> None:
    """Raises ``TypeError`` at ``who``'s boundary if ``fn`` cannot be called with ``policy=``.

    The functions that measure a loss under several plans call ``fn(*args, policy=p)``; without
    this check a loss written without that keyword fails as Python's bare "unexpected keyword
    argument" from deep inside them. Callables whose signature cannot be read pass.
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.name == "policy" or p.kind is p.VAR_KEYWORD for p in params):
        return
    name = getattr(fn, "__name__", repr(fn))
    raise TypeError(
        f"{who}: fn {name!r} takes no `policy` keyword, but it is called as "
        "fn(*args, policy=p) with each plan it measures. Fix: add the keyword and pass it on "
        'where the model remats: def loss(params, x, *, policy="none"): ... '
        "rnn.remat(Block, policy=policy) (or rn.checkpoint(f, policy=policy))."
    )
