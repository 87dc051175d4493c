"""``rn.invertible`` under ``rn.report_drift_to(probe)`` (issue #44: one check, one report for
every reconstruction path): a failed check is counted in the probe's cotangent instead of
raised, a recomputed scan iteration is counted there instead of by a host callback, so a step
that differentiates it holds no callback (JAX's persistent compilation cache refuses those).
The counts are held against what the host callbacks report for the same program, under jit,
vmap and shard_map."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import remat_nn as rn
from benchmarks import invertible_matrix as matrix
from remat_nn.invertible import _errors
from tests.gradients import counts_agree
from tests.invertible.test_invertible_recompute import (
    CHAOTIC,
    _every_derivative_moved,
    scan_stack,
)

#: The small stack's depth (tests.invertible.test_invertible_recompute.scan_stack) for the
#: exact counts: every derivative check made to fail (the mock), so every iteration is
#: recomputed.
DEPTH = 6


def _args(stack: matrix.Stack, scale: str) -> list[jax.Array]:
    return [jnp.asarray(a, jnp.float32) for a in matrix._data(stack, scale)]


def _loss(fn, c1, c2):
    def loss(x1, x2, wf, wg):
        y1, y2 = fn(x1, x2, wf, wg)
        return jnp.sum(y1 * c1) + jnp.sum(y2 * c2)

    return loss


def _probed(fn, c1, c2):
    def loss(x1, x2, wf, wg, probe):
        with rn.report_drift_to(probe) as sink:
            out = _loss(fn, c1, c2)(x1, x2, wf, wg)
        assert sink.used
        return out

    return loss


def _probe() -> jax.Array:
    return jnp.zeros((len(rn.DRIFT_REPORT_FIELDS),), jnp.float32)


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_the_probe_counts_what_the_host_callbacks_report(fallback):
    """(Catches a failed check dropped under the probe, a recompute counted on the host only,
    and a probed program that still stages a callback.)"""
    *args, c1, c2 = _args(CHAOTIC, "2he")
    # At a fixed tolerance (an explicit rtol, 10x margin: test_invertible_recompute.CHAOTIC):
    # the default accepts this chaotic stack.
    fn = rn.invertible(
        matrix._stack_fn(CHAOTIC), known_argnums=(2, 3), fallback=fallback, rtol=1e-6
    )
    host = jax.jit(jax.grad(_loss(fn, c1, c2), argnums=(0, 1, 2, 3)))
    rn.drift_recomputes(reset=True)
    try:
        jax.block_until_ready(host(*args))
        refused = False
    except jax.errors.JaxRuntimeError as e:
        assert "NotInvertibleError" in str(e)
        refused = True
    recomputed = sum(rn.drift_recomputes(reset=True).values())
    probed = jax.jit(jax.grad(_probed(fn, c1, c2), argnums=(0, 1, 2, 3, 4)))
    *g, counts = probed(*args, _probe())
    print(f"{fallback}: host refused {refused}, recomputed {recomputed}; probe {counts.tolist()}")
    assert int(counts[0]) == int(refused) == int(fallback == "error")
    assert counts_agree(int(counts[1]), recomputed)
    assert "callback" in host.lower(*args).as_text()
    assert "callback" not in probed.lower(*args, _probe()).as_text()
    if fallback == "recompute":  # the recomputed gradient, as exact as plain autodiff's
        assert recomputed > 0
        want = matrix._reference(replace(CHAOTIC, dtype="f64"), ("2he",))["2he"]
        own = rn.relative_error(matrix._grad(matrix._stack_fn(CHAOTIC))(*args, c1, c2), want)
        assert rn.relative_error(g, want) <= 10 * own


def _small(reverse: bool = False):
    f, (*args, c1, c2) = scan_stack(DEPTH, reverse)
    fn = rn.invertible(f, known_argnums=(2, 3), fallback="recompute")
    return fn, f, args, c1, c2


@pytest.mark.parametrize("reverse", [False, True])
def test_every_iteration_recomputed_is_counted_once(reverse):
    """(Catches a count per scan instead of per iteration, or of iterations that passed.)"""
    fn, f, args, c1, c2 = _small(reverse)
    with mock.patch.object(_errors, "derivative_excess", _every_derivative_moved):
        *g, counts = jax.jit(jax.grad(_probed(fn, c1, c2), argnums=(0, 1, 2, 3, 4)))(
            *args, _probe()
        )
    plain = jax.grad(_loss(f, c1, c2), argnums=(0, 1, 2, 3))(*args)
    assert counts.tolist() == [0.0, float(DEPTH)]
    assert rn.relative_error(g, plain) <= 1e-5


def test_nothing_fails_nothing_is_counted():
    fn, f, args, c1, c2 = _small()
    *g, counts = jax.jit(jax.grad(_probed(fn, c1, c2), argnums=(0, 1, 2, 3, 4)))(*args, _probe())
    plain = jax.grad(_loss(f, c1, c2), argnums=(0, 1, 2, 3))(*args)
    assert counts.tolist() == [0.0, 0.0]
    assert rn.relative_error(g, plain) <= 1e-5


def test_under_vmap_each_example_gets_its_own_counts():
    """Per-example gradients: each example's probe cotangent is its own run's count. (Catches a
    count summed over the batch, or taken once for it.)"""
    fn, _, (x1, x2, wf, wg), c1, c2 = _small()
    per_example = jax.vmap(
        jax.grad(_probed(fn, c1, c2), argnums=4), in_axes=(0, 0, None, None, None)
    )
    with mock.patch.object(_errors, "derivative_excess", _every_derivative_moved):
        counts = jax.jit(per_example)(jnp.stack([x1, -x1]), jnp.stack([x2, x2]), wf, wg, _probe())
    assert counts.tolist() == [[0.0, float(DEPTH)]] * 2


def test_under_shard_map_a_replicated_probe_sums_the_devices_counts():
    """Batch split over 2 devices, weights and probe replicated: the probe's cotangent is the
    sum of both devices' counts. (Catches a probe cotangent left per device: a type error, or
    one device's count.)"""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    fn, _, args, c1, c2 = _small()

    def local(x1, x2, wf, wg, c1, c2, probe):
        def loss(*a):
            return jax.lax.psum(_probed(fn, c1, c2)(*a), "data")

        return jax.grad(loss, argnums=4)(x1, x2, wf, wg, probe)

    specs = (P("data"), P("data"), P(), P(), P("data"), P("data"), P())
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())
    with mock.patch.object(_errors, "derivative_excess", _every_derivative_moved):
        counts = jax.jit(sharded)(*args, c1, c2, _probe())
    assert counts.tolist() == [0.0, 2.0 * DEPTH]
