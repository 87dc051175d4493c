"""Memory plans: per-name save / offload / recompute, as data that compiles to a JAX policy.

A plan speaks of *named* activations only (see :func:`remat_nn.name`): each listed name is saved,
offloaded to host memory or recomputed; names not listed follow ``default``; unnamed
intermediates are always recomputed from what is saved (random bits included, so dropout masks
are recomputed from their keys, never stored). A plan is validated twice: on construction (types,
a name in two lists) and against the traced function (a plan name that never occurs is an error
naming the names that do occur), so a typo can never silently save nothing (jax#23869,
maxtext#4990).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jax
import yaml

from remat_nn._jax_internals import (
    checkpoint_name_of,
    core,
    factory_call,
    name_p,
    pe,
    sub_jaxprs,
)
from remat_nn.errors import PlanError, did_you_mean_each

__all__ = ["ACTIONS", "Plan", "names_in_jaxpr", "plan"]

ACTIONS = ("save", "offload", "recompute")
_DEFAULTS = ("save", "recompute")


@dataclass(frozen=True)
class Plan:
    """A per-name memory plan. Build it with :func:`remat_nn.plan`.

    Attributes:
      save: names kept in device memory for the backward pass.
      offload: names moved to ``offload_dst`` memory in the forward pass, brought back in the
        backward pass.
      recompute: names recomputed in the backward pass (documents intent; also validated).
      default: action for named activations not listed, ``"recompute"`` or ``"save"``.
      offload_src: memory kind offloaded from.
      offload_dst: memory kind offloaded to.
    """

    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    default: Literal["save", "recompute"] = "recompute"
    offload_src: str = "device"
    offload_dst: str = "pinned_host"
    _policy: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for action in ACTIONS:
            names = getattr(self, action)
            if isinstance(names, str) or not isinstance(names, Iterable):
                raise PlanError(
                    f"rn.plan: `{action}` must be a list of activation names, got "
                    f"{type(names).__name__} {names!r}. Fix: {action}: [{names!r}]."
                )
            names = tuple(names)
            object.__setattr__(self, action, names)
            for n in names:
                if not isinstance(n, str) or not n:
                    raise PlanError(
                        f"rn.plan: `{action}` holds {n!r} ({type(n).__name__}); every entry must "
                        "be a non-empty activation name string."
                    )
                if n in seen:
                    where = "twice" if seen[n] == action else f"in both {seen[n]!r} and {action!r}"
                    raise PlanError(
                        f"rn.plan: activation name {n!r} is listed {where}; each name takes "
                        "exactly one action. Fix: keep it in one list."
                    )
                seen[n] = action
        if self.default not in _DEFAULTS:
            raise PlanError(
                f"rn.plan: `default` must be 'save' or 'recompute', got {self.default!r}."
            )
        object.__setattr__(self, "_policy", self._compile())

    # --- queries ----------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the plan lists, in save / offload / recompute order."""
        return self.save + self.offload + self.recompute

    @property
    def saves_nothing(self) -> bool:
        """Whether the plan keeps no value for the backward pass (nothing saved or offloaded,
        the default ``recompute``): a function under it keeps only its inputs.

        >>> import remat_nn as rn
        >>> rn.plan({"default": "recompute"}).saves_nothing, rn.plan({"save": ["q"]}).saves_nothing
        (True, False)
        """
        return not self.save and not self.offload and self.default == "recompute"

    def action(self, name: str) -> str:
        """The action (``save`` / ``offload`` / ``recompute``) this plan takes for ``name``."""
        for action in ACTIONS:
            if name in getattr(self, action):
                return action
        return self.default

    # --- compilation ------------------------------------------------------------------------

    def _compile(self) -> Callable[..., Any]:
        table = {n: self.action(n) for n in self.names}
        offload = pe.Offloadable(src=self.offload_src, dst=self.offload_dst)
        result = {"save": pe.Saveable, "offload": offload, "recompute": pe.Recompute}
        default = result[self.default]

        def plan_policy(prim, *_, **params):
            if prim is name_p:
                action = table.get(params["name"])
                return default if action is None else result[action]
            return pe.Recompute

        plan_policy.__qualname__ = f"plan_policy[{self}]"
        return plan_policy

    def to_policy(self) -> Callable[..., Any]:
        """The JAX policy this plan compiles to (the same object on every call)."""
        assert self._policy is not None
        return self._policy

    # --- validation against a function -----------------------------------------------------

    def check(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> frozenset[str]:
        """Traces ``fn(*args, **kwargs)`` and checks every plan name occurs in it.

        Returns:
          The activation names that occur in ``fn``.

        Raises:
          PlanError: a plan name never occurs; the message lists the names that do.

        >>> import jax.numpy as jnp, remat_nn as rn
        >>> f = lambda x: rn.name(jnp.sin(x), "mlp_hidden").sum()
        >>> sorted(rn.plan({"save": ["mlp_hidden"]}).check(f, jnp.ones(3)))
        ['mlp_hidden']
        >>> rn.plan({"save": ["mlp_hiden"]}).check(f, jnp.ones(3))
        Traceback (most recent call last):
        ...
        remat_nn.errors.PlanError: plan names ['mlp_hiden'] never occur in <lambda>, ...
        """
        jaxpr = jax.make_jaxpr(fn)(*args, **kwargs)
        found = frozenset(names_in_jaxpr(jaxpr.jaxpr))
        self.check_names(found, where=getattr(fn, "__name__", repr(fn)))
        return found

    def check_names(self, found: Iterable[str], *, where: str) -> None:
        """Raises :class:`PlanError` if a plan name is not in ``found`` (the names in ``where``)."""
        found = frozenset(found)
        missing = [n for n in self.names if n not in found]
        if missing:
            hint = did_you_mean_each(missing, found)
            raise PlanError(
                f"plan names {missing} never occur in {where}, so the plan would silently do "
                f"nothing for them. Names that occur: {sorted(found)}.{hint} Fix: correct the "
                "names, or tag the activation with rn.name(x, name)."
            )

    # --- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as the plain mapping :func:`remat_nn.plan` accepts (YAML-ready)."""
        out: dict[str, Any] = {a: list(getattr(self, a)) for a in ACTIONS if getattr(self, a)}
        out["default"] = self.default
        if self.offload_dst != "pinned_host":
            out["offload_dst"] = self.offload_dst
        return out

    def __str__(self) -> str:
        parts = [f"{a}={','.join(getattr(self, a))}" for a in ACTIONS if getattr(self, a)]
        return ";".join([*parts, f"default={self.default}"])


def _from_string(text: str) -> dict[str, Any]:
    # Compact form: "save=a,b;offload=c;recompute=d;default=recompute" (spaces ignored).
    spec: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise PlanError(
                f"rn.plan: cannot read {part!r} in plan string {text!r}; expected key=value "
                "parts joined by ';', e.g. 'save=query_proj,key_proj;offload=mlp_hidden'."
            )
        if key in ACTIONS:
            spec[key] = [v.strip() for v in value.split(",") if v.strip()]
        else:
            spec[key] = value.strip()
    return spec


_KEYS = {*ACTIONS, "default", "offload_src", "offload_dst"}


def plan(spec: Plan | Mapping[str, Any] | str | Path | None = None, **kwargs: Any) -> Plan:
    """Builds a validated :class:`Plan` from a mapping, a compact string, YAML or keywords.

    Args:
      spec: a ``Plan`` (returned as is); a mapping with keys ``save``, ``offload``,
        ``recompute`` (lists of names), ``default`` (``"recompute"`` or ``"save"``), and
        optionally ``offload_src`` / ``offload_dst``; a compact string
        ``"save=a,b;offload=c;default=recompute"``; or a ``Path`` to a YAML file holding the
        mapping (at top level or under a ``remat:`` key).
      **kwargs: the same keys, instead of or on top of ``spec``.

    Returns:
      The plan. ``plan.to_policy()`` is its JAX policy; ``plan.check(fn, *args)`` validates it
      against a function.

    Raises:
      PlanError: unknown keys, non-list values, a name in two lists, a bad ``default``.

    >>> import remat_nn as rn
    >>> p = rn.plan({"save": ["query_proj"], "offload": ["mlp_hidden"], "default": "recompute"})
    >>> str(p)
    'save=query_proj;offload=mlp_hidden;default=recompute'
    >>> rn.plan(str(p)) == p
    True
    """
    if isinstance(spec, Plan) and not kwargs:
        return spec
    if isinstance(spec, Plan):
        mapping: dict[str, Any] = spec.to_dict()
    elif isinstance(spec, Path):
        loaded = yaml.safe_load(spec.read_text())
        if isinstance(loaded, Mapping) and "remat" in loaded:
            loaded = loaded["remat"]
        if not isinstance(loaded, Mapping):
            raise PlanError(f"rn.plan: {spec} holds {type(loaded).__name__}, not a plan mapping.")
        mapping = dict(loaded)
    elif isinstance(spec, str):
        mapping = _from_string(spec)
    elif spec is None:
        mapping = {}
    elif isinstance(spec, Mapping):
        mapping = dict(spec)
    else:
        raise PlanError(
            f"rn.plan: argument `spec` must be a mapping, a plan string or a Path, got "
            f"{type(spec).__name__} {spec!r}. Fix: rn.plan({{'save': ['query_proj']}})."
        )
    mapping.update(kwargs)
    unknown = sorted(set(mapping) - _KEYS, key=str)
    if unknown:
        hint = did_you_mean_each(unknown, sorted(_KEYS))
        raise PlanError(
            f"rn.plan: unknown keys {unknown}; a plan has only {sorted(_KEYS)}.{hint} "
            "Fix: e.g. {'save': [...], 'offload': [...], 'recompute': [...], 'default': ...}."
        )
    for action in ACTIONS:
        if mapping.get(action) is None:
            mapping.pop(action, None)
    return Plan(**mapping)


def as_plan(spec: Any) -> Plan | None:
    """The :class:`Plan` a policy spec denotes, or None (a policy name, another callable, None).

    A Plan, a mapping or a ``"save=..."`` string; or a policy one of ``jax.checkpoint_policies``'
    name factories made, however it was made (``rn.policy("save_only_these_names", "a")`` or
    ``jax.checkpoint_policies.save_only_these_names("a")``): the plan of its names, which remat
    wrappers check against the body as any plan's.

    >>> import jax, remat_nn as rn
    >>> str(as_plan(jax.checkpoint_policies.save_any_names_but_these("mlp_hidden")))
    'recompute=mlp_hidden;default=save'
    """
    if isinstance(spec, Plan):
        return spec
    if isinstance(spec, Mapping) or (isinstance(spec, str) and "=" in spec):
        return plan(spec)
    call = factory_call(spec)
    if call is None:
        return None
    factory, args, kwargs = call
    if factory == "save_from_both_policies":
        a, b = (as_plan(p) for p in args)
        return _either(a, b) if a is not None and b is not None else None
    return _names_plan(factory, args, kwargs)


def _names_plan(factory: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Plan:
    """The plan equal to ``jax.checkpoint_policies.<factory>(*args, **kwargs)`` for the name
    factories: ``save_only_these_names``, ``save_any_names_but_these`` and
    ``save_and_offload_only_these_names``."""
    if factory == "save_only_these_names":
        return plan(save=list(args))
    if factory == "save_any_names_but_these":
        return plan(recompute=list(args), default="save")
    return plan(
        save=list(kwargs.get("names_which_can_be_saved", ())),
        offload=list(kwargs.get("names_which_can_be_offloaded", ())),
        offload_src=kwargs.get("offload_src", "device"),
        offload_dst=kwargs.get("offload_dst", "pinned_host"),
    )


def _either(a: Plan, b: Plan) -> Plan | None:
    # save_from_both_policies of two name policies: a name is saved if either saves it (unnamed
    # values are recomputed by both). JAX's takes boolean policies only: no offloading one.
    if a.offload or b.offload:
        return None
    names = dict.fromkeys(a.names + b.names)
    saved = [n for n in names if "save" in (a.action(n), b.action(n))]
    return plan(
        save=saved,
        recompute=[n for n in names if n not in saved],
        default="save" if "save" in (a.default, b.default) else "recompute",
    )


# --- finding names in traced code -------------------------------------------------------------


def names_in_jaxpr(jaxpr: Any, eqns: Iterable[Any] | None = None) -> Iterator[str]:
    """Yields every activation name bound in ``jaxpr`` (or in ``eqns``), sub-jaxprs included
    (also the ``checkpoint`` bodies and names JAX's ``jax_remat3`` flag stages)."""
    for eqn in jaxpr.eqns if eqns is None else eqns:
        if (n := checkpoint_name_of(eqn)) is not None:
            yield n
        for sub in sub_jaxprs(eqn):
            yield from names_in_jaxpr(getattr(sub, "jaxpr", sub))


def current_trace_eqns() -> list[Any] | None:
    """The equations of the jaxpr being traced right now, or None if not tracing to a jaxpr.

    Used by remat wrappers to check a plan or a policy against the body they are tracing, at
    first use, without tracing it twice. Relies on JAX internals (pinned in requirements.lock);
    returns None rather than guessing if they change.
    """
    trace = getattr(getattr(core, "trace_ctx", None), "trace", None)
    frame = getattr(trace, "frame", None)
    get_eqns = getattr(frame, "get_eqns", None)
    return None if get_eqns is None else list(get_eqns())


def names_in_current_trace() -> frozenset[str] | None:
    """Names bound so far in the jaxpr being traced right now, or None if not tracing to a jaxpr."""
    eqns = current_trace_eqns()
    return None if eqns is None else frozenset(names_in_jaxpr(None, eqns))


def checked_body(fn: Callable[..., Any], the_plan: Plan, where: str) -> Callable[..., Any]:
    """Wraps ``fn`` so that tracing it inside a remat checks ``the_plan``'s names occur in it."""

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        found = names_in_current_trace()
        if found is not None:
            the_plan.check_names(found, where=where)
        return out

    return body
