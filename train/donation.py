"""Donation: the train step reuses the state's buffers, and this module proves it.

:func:`verify_donation` reads XLA's alias bytes of the compiled step, :func:`check_distinct_buffers`
refuses one buffer at two leaves, :func:`verify_donated_inputs_deleted` checks the first step
consumed its inputs, and :func:`rematerialize` gives restored arrays XLA-owned buffers so the
first step after a restore donates too (jax#18617).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from train.errors import DonationError
from train.sharding import per_device_bytes

__all__ = [
    "ALIASED_LEAVES",
    "check_distinct_buffers",
    "refit",
    "rematerialize",
    "verify_donated_inputs_deleted",
    "verify_donation",
]


ALIASED_LEAVES = """\
train state: leaves {first} and {second} are the same {what}. Donating the state would donate it
twice (XLA fails with 'Attempt to donate the same buffer twice', naming no leaf), and the optimizer
would update the two leaves as independent parameters that drift apart. Typical cause: tied weights
built by reusing one array, e.g. params['head']['kernel'] = params['embed']['embedding'].T or
two dict entries holding one array.
Fix: share the parameter inside the model (one param used in both places, e.g.
flax.linen.Embed.attend for a tied output projection), or give each leaf its own copy
(jnp.copy(x)) if they are meant to be trained separately."""


def _buffer_keys(x: jax.Array) -> list[tuple[str, int]]:
    # The Python object, and each device buffer it holds (two objects can view one buffer).
    keys: list[tuple[str, int]] = [("object", id(x))]
    if x.size == 0:  # empty arrays may share a null buffer; nothing to donate
        return keys
    try:
        for shard in x.addressable_shards:
            keys.append(("buffer", shard.data.unsafe_buffer_pointer()))
    except Exception:  # deleted, or a backend without raw pointers: the object check remains
        pass
    return keys


def check_distinct_buffers(state: Any) -> None:
    """Checks no ``jax.Array`` (nor one device buffer) appears at two leaves of ``state``.

    Run it on the concrete state before the first donated step: aliased leaves make the step
    fail deep in XLA without naming them, or silently untie tied weights.

    Raises:
      DonationError: naming both leaf paths and the fix.

    >>> import jax.numpy as jnp
    >>> w = jnp.ones((2, 2))
    >>> check_distinct_buffers({"embed": w, "head": jnp.copy(w)})
    >>> check_distinct_buffers({"embed": w, "head": w})
    Traceback (most recent call last):
    ...
    train.errors.DonationError: train state: leaves ['embed'] and ['head'] are the same ...Array ...
    """
    seen: dict[tuple[str, int], str] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            continue
        where = jax.tree_util.keystr(path)
        for key in _buffer_keys(leaf):
            if key in seen:
                what = "jax.Array object" if key[0] == "object" else "device buffer"
                raise DonationError(ALIASED_LEAVES.format(first=seen[key], second=where, what=what))
            seen[key] = where


def verify_donation(compiled: Any, state: Any) -> int:
    """Checks XLA aliases every state byte of the compiled step to an output.

    Args:
      compiled: ``jax.jit(step, donate_argnums=0).lower(state, batch).compile()``.
      state: the state (arrays or ``ShapeDtypeStruct`` with shardings).

    Returns:
      The aliased bytes per device (``memory_analysis().alias_size_in_bytes``).

    Raises:
      DonationError: fewer bytes aliased than the state holds on one device, or (for a
        concrete state) one array at two leaves (:func:`check_distinct_buffers`).
    """
    check_distinct_buffers(state)  # a no-op for ShapeDtypeStructs
    analysis = compiled.memory_analysis()
    need = per_device_bytes(state)
    if analysis is None:  # a backend without memory analysis: the deletion check still runs
        return need
    alias = int(analysis.alias_size_in_bytes)
    if alias < need:
        raise DonationError(
            f"train step: XLA aliases {alias} bytes per device but the donated state holds "
            f"{need}; the state is not (fully) donated, so a step keeps two copies of it. "
            "Fix: jit the step with donate_argnums=0 and return every state leaf with its input's "
            "shape, dtype and sharding."
        )
    return alias


def verify_donated_inputs_deleted(old_leaves: list[tuple[Any, jax.Array]]) -> None:
    """Checks every donated input buffer was consumed (``is_deleted()``) by the step."""
    alive = [jax.tree_util.keystr(path) for path, x in old_leaves if not x.is_deleted()]
    if alive:
        shown = ", ".join(alive[:5]) + (f" and {len(alive) - 5} more" if len(alive) > 5 else "")
        raise DonationError(
            f"train step: {len(alive)} donated state buffers were not consumed ({shown}); the "
            "step copied them instead of reusing them. Fix: re-materialise restored arrays "
            "(train.donation.rematerialize) and keep state leaves distinct buffers."
        )


@functools.lru_cache(maxsize=64)  # a few shardings per run; evicting only recompiles
def _copy_fn(sharding: Any, dtype: Any) -> Any:
    # A jitted copy (or cast): its output is a buffer XLA allocated. jnp.copy, because a jitted
    # identity may hand back its input.
    def copy(x: jax.Array) -> jax.Array:
        return jnp.copy(x) if dtype is None else x.astype(dtype)

    return jax.jit(copy, out_shardings=sharding)


def refit(tree: Any, target: Any, *, copy_all: bool) -> Any:
    """``tree`` in the dtypes (and shardings) of ``target``, leaf by leaf.

    Casts each leaf whose dtype differs from its target's (with ``copy_all``, copies every other
    one too) and deletes the leaf it replaces, so the peak is the tree plus one leaf. A leaf
    object found at two paths is deleted after its last copy.
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(target)
    last = {id(x): i for i, x in enumerate(leaves)}
    out = []
    for i, (x, t) in enumerate(zip(leaves, targets, strict=True)):
        dtype = jnp.dtype(t.dtype)
        if x.dtype == dtype and not copy_all:
            out.append(x)
            continue
        out.append(_copy_fn(t.sharding, None if x.dtype == dtype else dtype)(x))
        if isinstance(x, jax.Array) and last[id(x)] == i:
            x.delete()
    return treedef.unflatten(out)


def rematerialize(state: Any, shardings: Any) -> Any:
    """Every leaf of ``state`` in a fresh XLA-owned buffer, so the next step can donate it.

    Restored arrays are not guaranteed to own donatable buffers (jax#18617: the first step after
    a restore kept two copies of the state). Each leaf is copied by a jitted program and then
    deleted before the next one is copied, so the peak is the state plus one leaf, not twice the
    state as a copy of the whole tree at once would be. The leaves of ``state`` are deleted: use
    only the result.

    Args:
      state: a pytree of arrays.
      shardings: a pytree like ``state`` holding the sharding each copy gets.

    Returns:
      A pytree like ``state`` with the same values.

    >>> old = {"w": jnp.ones(3)}
    >>> new = rematerialize(old, {"w": old["w"].sharding})
    >>> old["w"].is_deleted(), new["w"].tolist()
    (True, [1.0, 1.0, 1.0])
    """
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    return refit(state, target, copy_all=True)
