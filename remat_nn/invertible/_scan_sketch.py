"""Per-iteration sketches inside a scan: the measured drift of a scanned stack's rebuilt values.

The walk undoes a ``scan`` by a reverse scan that walks its body once per iteration
(``ScanRule``), carrying each rebuilt value's error bound through the body's equations and from
iteration to iteration. Bounds compound far faster than the real error (#44: the canonical
coupling stack as a ``lax.scan`` was refused from depth 8, and from depth 2 with LayerNorm in
the branches). So, as it does for the values of the walked function itself (:func:`sketched`),
the forward pass keeps at every iteration a sketch of each body value the body's walk derives
from a rebuilt one (``_sketch``: ``max|x|`` and ``K`` int32 projections: ``K + 1`` numbers per
value and iteration; by ``_sketch``'s grid projection, which makes no ``(K, n)`` transient), and
the reverse scan gives that iteration's sketches to the body's walk, which caps each rebuilt
value's error by the drift measured against its sketch.

Only scans at the top level of the walked function are sketched (a scan in a scan's body keeps
its bounds); a scan whose body has no checked inversion has no bound to cap and runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_nn._jax_internals import core
from remat_nn.invertible import _sketch
from remat_nn.invertible._jaxpr import eval_jaxpr, is_var, open_jaxpr

#: A scan's per-iteration sketches: ``(tops (length, m), projections (length, m, K))`` of the
#: ``m`` body values its walk reads them for, in ``sketched`` order.
ScanSketches = tuple[Any, Any]


def forward(
    eqn: core.JaxprEqn, body: Any, values: Sequence[Any], ins: Sequence[Any]
) -> tuple[list, ScanSketches]:
    """The scan ``eqn`` run on ``ins`` with its body's jaxpr ``body`` (the body analysis's: the
    same variables), and the sketches of the body's ``values`` at every iteration."""
    params = eqn.params
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    _, body_consts = open_jaxpr(params["jaxpr"])
    consts = list(ins[:num_consts])
    carry, xs = list(ins[num_consts : num_consts + num_carry]), list(ins[num_consts + num_carry :])

    def step(carry, x):
        outs, found = eval_jaxpr(body, [*body_consts, *consts, *carry, *x], values)
        sketches = [_sketch.sketch(v) for v in found]
        tops = jnp.stack([t for t, _ in sketches])
        projections = jnp.stack([p for _, p in sketches])
        return list(outs[:num_carry]), (list(outs[num_carry:]), (tops, projections))

    carry, (ys, (tops, projections)) = jax.lax.scan(
        step,
        carry,
        xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return carry + ys, (tops, projections)


def per_iteration(
    sketches: ScanSketches | None, body: Any, want_cts: bool
) -> tuple[Any, Callable[[Any], dict | None]]:
    """For ``ScanRule``'s reverse scan over the body analysis ``body`` (with cotangents if
    ``want_cts``): what it scans over (``(tops, projections)``, or None without sketches), and
    the function that reads one iteration's slice of it as the body's walk reads sketches
    (value -> sketch; None without)."""
    if sketches is None:
        return None, lambda _: None
    read = values(body, want_cts)

    def at_iteration(sk: Any) -> dict:
        tops, projections = sk  # (m,), (m, K)
        return {v: (tops[k], projections[k]) for k, v in enumerate(read)}

    return sketches, at_iteration


def sketched(schedule: Any) -> list:
    """The values the forward pass sketches for the walk ``schedule`` (a ``WalkSchedule``;
    ``_sketch``): every real float value it derives from a rebuilt one (those may carry an
    error), in schedule order."""
    analysis = schedule.analysis
    tainted: dict = {}  # an ordered set
    for step in schedule.steps:
        eqn = analysis.eqns[step.eqn]
        if step.action == "forward":
            if any(is_var(a) and a in tainted for a in eqn.invars):
                tainted.update((v, None) for v in eqn.outvars if is_var(v))
        elif step.action in ("inverse", "fused"):
            assert step.derivation is not None  # an inverse step has its derivation
            unknown = step.derivation.unknown
            tainted.update(
                (a, None) for p, a in enumerate(eqn.invars) if p in unknown and is_var(a)
            )
    return [v for v in tainted if analysis.known[v].kind != "given" and _sketch.sketchable(v.aval)]


def values(body: Any, want_cts: bool) -> list:
    """The values of a scan's body analysis ``body`` sketched at every iteration: those its
    walk (``ScanRule``: rebuilding the inputs, with cotangents if ``want_cts``) derives from
    rebuilt ones."""
    return sketched(body.schedule(want_cts, True))
