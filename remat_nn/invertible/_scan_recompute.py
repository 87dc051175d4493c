"""``fallback="recompute"`` at run time inside a scan: an iteration whose rebuilt values fail a
check is recomputed from the scan's first carry instead of raising.

``ScanRule`` undoes a ``scan`` by a reverse scan that rebuilds each iteration's carry from the
next one. With ``rn.invertible(f, fallback="recompute")`` the forward pass also keeps, for each
``scan`` at the top level of ``f`` whose body's walk runs checks, the carry it starts from (the
*anchor*: one carry, whatever the length). Where an iteration's checks fail (a bound, or a
derivative taken at values that drifted), that iteration's results are replaced: its input
carry is computed forward from the anchor through the iterations before it
(:func:`remat_nn._drift.replay`: a scan over every iteration that keeps the carry from the
wanted one on, so memory stays one iteration's), and its cotangents are plain autodiff's of the
body at that carry. The iterations before it are then rebuilt from an exact carry. The replay
runs only where a check failed (:func:`remat_nn._drift.when`) and costs the scan's length in
body forwards each time; ``rn.drift_recomputes()`` counts it ("rn.invertible scan iteration k"),
or, traced inside ``rn.report_drift_to``, the backward pass does (:func:`remat_nn._drift.tally`).

Only when every per-iteration input (``xs``) is known to the walk (weights): a rebuilt ``xs``
has nothing to replay from. A check that fails outside such a scan still raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_nn import _drift
from remat_nn._jax_internals import core
from remat_nn.invertible._jaxpr import eval_jaxpr, is_float, open_jaxpr, zeros_ct

_FAILED = (
    "a value the backward pass rebuilt there failed its check (its rounding bound, or a "
    "derivative taken at it moved past rn.invertible's tolerance)",
    "a wider dtype in the branches, normalized branches or rn.invertible(f, rtol=...) make it "
    "rarer",
)


def _recomputed(k: Any) -> None:
    _drift.recomputed(f"rn.invertible scan iteration {int(k)}", _FAILED)


def _filled(cts: Sequence[Any], outs: Sequence[Any]) -> list:
    """``cts`` with zero cotangents where None (float0 for integer outputs)."""
    return [zeros_ct(core.typeof(o)) if c is None else c for c, o in zip(cts, outs, strict=True)]


def _floats(cts: Sequence[Any], values: Sequence[Any]) -> list:
    """``cts`` with None for the values that carry no cotangent (integers, keys)."""
    return [c if is_float(core.typeof(v)) else None for c, v in zip(cts, values, strict=True)]


def iteration(
    eqn: core.JaxprEqn, consts: Sequence[Any], xs: Sequence[Any], callback: bool = True
) -> Callable:
    """``recompute(anchor, k, ct_carry, ct_ys) -> (carry, carry_cts, const_cts, x_cts)``: the
    input carry of the iteration at ``xs`` index ``k`` of the scan ``eqn`` (with ``consts`` and
    ``xs``, all known), computed forward from ``anchor`` (the scan's first carry), and the
    cotangents of the carry, ``consts`` and that iteration's ``xs`` from the carry's and ys'
    cotangents ``ct_carry``, ``ct_ys`` (None where a value carries none). ``callback``: count
    each recompute on the host (else the caller counts them: :func:`remat_nn._drift.tally`)."""
    params = eqn.params
    num_carry, length, reverse = params["num_carry"], params["length"], params["reverse"]
    inner, body_consts = open_jaxpr(params["jaxpr"])

    def body(c: Sequence[Any], h: Sequence[Any], x: Sequence[Any]) -> tuple[list, list]:
        outs = eval_jaxpr(inner, [*body_consts, *c, *h, *x])[0]
        return outs[:num_carry], outs[num_carry:]

    def step(j: Any) -> Any:
        """The ``xs`` index forward step ``j`` runs (and the step that runs index ``j``)."""
        return length - 1 - j if reverse else j

    def layer(j: Any, h: list) -> list:
        return body(consts, h, [a[step(j)] for a in xs])[0]

    def recompute(anchor: Sequence[Any], k: Any, ct_carry: Sequence[Any], ct_ys: Sequence[Any]):
        if callback:
            jax.debug.callback(_recomputed, k)
        carry = _drift.replay(layer, list(anchor), length, step(k))
        x = [a[k] for a in xs]
        outs, pull = jax.vjp(body, list(consts), carry, x)
        d_consts, d_carry, d_x = pull((_filled(ct_carry, outs[0]), _filled(ct_ys, outs[1])))
        return carry, _floats(d_carry, carry), _floats(d_consts, consts), _floats(d_x, x)

    return recompute


def prepare(
    eqn: core.JaxprEqn, consts: Sequence[Any], xs: Sequence[Any], usable: bool
) -> tuple[Callable | None, list | None, Any]:
    """``(recompute, tally, count)`` for the scan ``eqn``: :func:`iteration` if ``usable``
    (else None); the :func:`remat_nn._drift.tally` it counts into (None: host callbacks) and
    the count's initial value, an int32 zero where it counts so (else None)."""
    if not usable:
        return None, None, None
    tally = _drift.current_tally()
    count = None if tally is None else jnp.zeros((), jnp.int32)
    return iteration(eqn, consts, xs, callback=tally is None), tally, count


def counted(tally: list | None, count: Any) -> None:
    """Adds a scan's ``count`` of recomputed iterations to ``tally`` (from :func:`prepare`;
    None: counted by host callbacks), for a backward that reports to a probe."""
    if tally is not None and count is not None:
        tally.append(count)


def where_failed(
    code: Any, recompute: Callable, args: tuple, walked: tuple, errs: Sequence[Any] | None
) -> tuple[tuple, Any]:
    """``(results, errs)``: the walk's ``walked`` ``(carry, carry_cts, const_cts, x_cts)`` and
    the carry's ``errs`` where the iteration's check ``code`` is 0; else ``recompute(*args)``
    (of the same types) and the errors of an exact carry. The recompute runs only then."""
    bad = code != 0
    return _drift.when(bad, recompute, args, walked), _exact_where(bad, errs)


def _exact_where(bad: Any, errs: Sequence[Any] | None) -> Any:
    """The carry's errors (``_errors``) with their absolute and relative parts zero where
    ``bad`` (the carry was recomputed: exact), the floor kept."""
    if errs is None:
        return None
    zero = jnp.zeros((), jnp.float32)
    return [
        None if e is None else (jnp.where(bad, zero, e[0]), jnp.where(bad, zero, e[1]), e[2])
        for e in errs
    ]
