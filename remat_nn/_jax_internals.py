"""Every JAX name remat_nn reads from outside JAX's public API, in one place.

remat_nn walks jaxprs (the invertible walk, plan checks, memory reports, the planner), so it
needs JAX's IR types and a few primitives and helpers that JAX does not export. Each import says
why it is needed and the public alternative where one exists; a JAX upgrade that moves one of
them breaks this file only.

JAX's upgrade flags ``jax_remat3`` and ``jax_custom_vjp3`` (future defaults) stage
``jax.checkpoint``, ``checkpoint_name`` and ``jax.custom_vjp`` as one ``call_hi_primitive``
whose ``_prim`` param is the object that says which: :func:`hi_kind` tells them apart, and
:func:`sub_jaxprs` / :func:`checkpoint_name_of` read them like the classic primitives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend.core.primitives as _public_prims

# core: the IR (Var, Literal, DropVar, Jaxpr, ClosedJaxpr, JaxprEqn, jaxprs_in_params) is public
# in jax.extend.core; remat_nn also needs eval_jaxpr, typeof on tracers, closed_call_p, Tracer and
# the trace context from the same module, so it takes the whole private module once.
# source_info_util: source locations of equations (file:line in errors and reports); not public.
from jax._src import core, source_info_util

# saved_residuals: JAX's list of what a VJP stores; public only as print_saved_residuals.
# RematTraced / CheckpointName: what jax_remat3 stages; DotsSaveable / SaveOnlyTheseNames /
# SaveAnyNamesButThese: the only policy classes jax_remat3 honours, and where the name lists of
# jax.checkpoint_policies' factories are read (factory_call). No public alternative.
from jax._src.ad_checkpoint import (
    CheckpointName,
    DotsSaveable,
    RematTraced,
    SaveAnyNamesButThese,
    SaveOnlyTheseNames,
    saved_residuals,
)

# enable_compilation_cache: the config option as a context manager (jax.config.update is global),
# for persistent_cache_bypassed.
from jax._src.config import enable_compilation_cache

# call_hi_primitive and CustomVJPTraced: what jax_remat3 / jax_custom_vjp3 stage; not public.
from jax._src.hijax import CustomVJPTraced, call_hi_primitive_p

# partial_eval: convert_constvars_jaxpr, dce_rules and the remat policy results (Saveable,
# Recompute, Offloadable); no public alternative.
from jax._src.interpreters import partial_eval as pe

# Not in jax.extend.core.primitives (jnp.split / lax.optimization_barrier bind them).
from jax._src.lax.lax import optimization_barrier_p, split_p

# DeprecatedArg: the default of jax.checkpoint's removed `concrete` parameter; rn.checkpoint has
# the same signature (and so the same sentinel). Not public.
from jax._src.typing import DeprecatedArg

# Public (jax.experimental), here beside the option it goes with: persistent_cache_bypassed.
from jax.experimental.compilation_cache.compilation_cache import reset_cache

# Public: jax.extend.core.primitives.
custom_jvp_call_p = _public_prims.custom_jvp_call_p
custom_vjp_call_p = _public_prims.custom_vjp_call_p
jit_p = _public_prims.jit_p
name_p = _public_prims.name_p
remat_p = _public_prims.remat_p
scan_p = _public_prims.scan_p

__all__ = [
    "CheckpointName",
    "CustomVJPTraced",
    "DeprecatedArg",
    "DotsSaveable",
    "RematTraced",
    "SaveAnyNamesButThese",
    "SaveOnlyTheseNames",
    "call_hi_primitive_p",
    "checkpoint_name_of",
    "core",
    "custom_jvp_call_p",
    "custom_vjp_bwd",
    "custom_vjp_call_p",
    "factory_call",
    "hi_kind",
    "is_jax_policy",
    "jit_p",
    "name_p",
    "optimization_barrier_p",
    "pe",
    "persistent_cache_bypassed",
    "remat3_honours",
    "remat3_on",
    "remat_p",
    "saved_residuals",
    "scan_p",
    "source_info_util",
    "split_p",
    "sub_jaxprs",
]


def _checkpoint_name_batch(self: Any, axis_data: Any, args: Any, dims: Any) -> Any:
    # A name is the identity on its value: the batched value gets the same name, same batch axis.
    del axis_data
    (x,), (dim,) = args, dims
    return CheckpointName(self.name, core.typeof(x))(x), dim


# jax_remat3 stages checkpoint_name as CheckpointName, which has no vmap rule in this JAX: a name
# under vmap (a flax layer stack initialised with nn.vmap, a vmapped loss) fails to trace. The
# rule above gives one; a JAX that defines its own keeps it.
if not any(k in CheckpointName.__dict__ for k in ("batch", "batch_dim_rule")):
    CheckpointName.batch = _checkpoint_name_batch  # pyright: ignore[reportAttributeAccessIssue]


def remat3_on() -> bool:
    """Whether ``jax.checkpoint`` stages JAX's new remat (the ``jax_remat3`` upgrade flag)."""
    # Config options are attributes jax.config sets at run time; its type declares none.
    return bool(jax.config.jax_remat3)  # pyright: ignore[reportAttributeAccessIssue]


def remat3_honours(policy: Any) -> bool:
    """Whether JAX's new remat (``jax_remat3``) applies ``policy`` as the classic one does.

    It recognises only ``nothing_saveable`` (and None), the ``dots`` policies and the two
    name-list classes; any other callable is silently treated as "recompute everything".
    """
    return (
        policy is None
        or isinstance(policy, DotsSaveable | SaveOnlyTheseNames | SaveAnyNamesButThese)
        or policy is jax.checkpoint_policies.nothing_saveable
    )


@contextlib.contextmanager
def persistent_cache_bypassed() -> Iterator[None]:
    """Compiles inside neither read nor write JAX's persistent compilation cache.

    JAX decides once per process whether it uses the cache (at the first compile) and keeps the
    answer, so ``enable_compilation_cache(False)`` alone changes nothing after that compile (a
    warm cache is read) and, before it, turns the cache off for the rest of the process. The
    decision is therefore reset on the way in, taken again with the option off, and reset on the
    way out, to be taken again as configured at the next compile. Another thread compiling
    meanwhile compiles without the cache too.
    """
    reset_cache()
    try:
        with enable_compilation_cache(False):
            yield
    finally:
        reset_cache()


_cp = jax.checkpoint_policies
# Every closure a factory returns shares its function's code object: what tells them apart from
# any other callable. These two keep their arguments only in the closure's cells.
_SAVE_AND_OFFLOAD = _cp.save_and_offload_only_these_names(
    names_which_can_be_saved=(),
    names_which_can_be_offloaded=(),
    offload_src="device",
    offload_dst="pinned_host",
).__code__
_SAVE_FROM_BOTH = _cp.save_from_both_policies(_cp.nothing_saveable, _cp.nothing_saveable).__code__


def factory_call(policy: Any) -> tuple[str, tuple[Any, ...], dict[str, Any]] | None:
    """``(factory, args, kwargs)``: the ``jax.checkpoint_policies`` call that made ``policy``,
    for the factories whose arguments it keeps (``save_only_these_names``,
    ``save_any_names_but_these``, ``save_and_offload_only_these_names``,
    ``save_from_both_policies``); None for any other callable. Names come sorted.
    """
    if isinstance(policy, SaveOnlyTheseNames):
        return "save_only_these_names", tuple(sorted(policy.saveable_names)), {}
    if isinstance(policy, SaveAnyNamesButThese):
        return "save_any_names_but_these", tuple(sorted(policy.names)), {}
    code = getattr(policy, "__code__", None)
    if code is None or code not in (_SAVE_AND_OFFLOAD, _SAVE_FROM_BOTH):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in policy.__closure__), strict=True))
    if code is _SAVE_FROM_BOTH:
        return "save_from_both_policies", (cells["policy_1"], cells["policy_2"]), {}
    return (
        "save_and_offload_only_these_names",
        (),
        {
            "names_which_can_be_saved": sorted(cells["names_which_can_be_saved"]),
            "names_which_can_be_offloaded": sorted(cells["names_which_can_be_offloaded"]),
            "offload_src": cells["offload_src"],
            "offload_dst": cells["offload_dst"],
        },
    )


def is_jax_policy(policy: Any) -> bool:
    """Whether ``policy`` is one of ``jax.checkpoint_policies`` or a factory of it made it."""
    # The module defining jax.checkpoint_policies: every policy and factory closure is made there.
    return getattr(policy, "__module__", None) == SaveOnlyTheseNames.__module__


def hi_kind(eqn: Any) -> str | None:
    """``"remat"``, ``"name"`` or ``"custom_vjp"`` for an equation staged under the upgrade
    flags (a ``call_hi_primitive``), else None."""
    if eqn.primitive is not call_hi_primitive_p:
        return None
    prim = eqn.params["_prim"]
    if isinstance(prim, RematTraced):
        return "remat"
    if isinstance(prim, CheckpointName):
        return "name"
    if isinstance(prim, CustomVJPTraced):
        return "custom_vjp"
    return None


def custom_vjp_bwd(eqn: Any) -> Any:
    """The user's ``bwd`` object of a ``custom_vjp`` equation (either staging), else None."""
    if eqn.primitive is custom_vjp_call_p:
        bwd = eqn.params["bwd"]
        return getattr(bwd, "f", bwd)  # a wrapped function: the callable it wraps
    if hi_kind(eqn) == "custom_vjp":
        return eqn.params["_prim"].bwd
    return None


def checkpoint_name_of(eqn: Any) -> str | None:
    """The activation name a ``checkpoint_name`` equation gives its value, else None."""
    if eqn.primitive is name_p:
        return eqn.params["name"]
    if hi_kind(eqn) == "name":
        return eqn.params["_prim"].name
    return None


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The bodies (open ``Jaxpr``s) an equation runs, the upgrade flags' included."""
    kind = hi_kind(eqn)
    if kind == "remat":
        return [eqn.params["_prim"].jaxpr.jaxpr]
    if kind == "custom_vjp":
        return [eqn.params["_prim"].traced.jaxpr.jaxpr]
    return list(core.jaxprs_in_params(eqn.params))
