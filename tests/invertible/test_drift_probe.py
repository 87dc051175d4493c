"""Drift checks that report to a probe's cotangent (``rn.report_drift_to``), not to the host.

A training step whose reversible stacks report a failed check or a recompute by a host callback
never enters JAX's persistent compilation cache, so it compiles again in every process. Under
``rn.report_drift_to(probe)`` the stacks take ``probe`` as an input of their custom VJP and
return the counts as its cotangent. These tests hold the probe's counts against what the host
callbacks report for the same stacks, the gradient against float64 autodiff, and the lowered
step against holding any callback, under jit, vmap and shard_map.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import remat_nn as rn
from remat_nn import nn
from tests.gradients import counts_agree, rel_err

DEPTH = 24
# An unnormalized linear stack: its forward grows layer by layer, so a rebuilt input drifts
# more the deeper it is (the docs' stack; unchecked, its gradient is off by about 1e2 here).
_COUPLING = nn.AdditiveCoupling(fnn.Dense(16), fnn.Dense(16))
_TIGHT = 2.4e-5  # a tolerance a few layers of this stack pass, and the deepest fail


def _stack(**kw: Any) -> nn.ReversibleSequence:
    return nn.ReversibleSequence(_COUPLING, depth=DEPTH, **kw)


@functools.cache
def _inputs() -> tuple[Any, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (64, 32))
    return _stack().init(jax.random.key(0), x)["params"], x


def _loss(module: fnn.Module):
    return lambda p, x: jnp.mean(module.apply({"params": p}, x))


def _probed(module: fnn.Module):
    def loss(p, x, probe):
        with rn.report_drift_to(probe) as sink:
            out = _loss(module)(p, x)
        assert sink.used
        return out

    return loss


def _probe() -> jax.Array:
    return jnp.zeros((len(rn.DRIFT_REPORT_FIELDS),), jnp.float32)


def _host(module: fnn.Module, p: Any, x: jax.Array) -> tuple[Any, bool, int]:
    """``(grads or None, refused, layers recomputed)`` with the host callbacks."""
    rn.drift_recomputes(reset=True)
    try:
        g = jax.block_until_ready(jax.jit(jax.grad(_loss(module)))(p, x))
    except jax.errors.JaxRuntimeError as e:
        assert "NotInvertibleError" in str(e)
        return None, True, 0
    return g, False, sum(rn.drift_recomputes().values())


def _exact(p: Any, x: jax.Array) -> Any:
    with jax.enable_x64(True):
        f64 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64), t)  # noqa: E731
        return jax.grad(_loss(_stack(reversible=False)))(f64(p), f64(x))


CASES = {
    "error": dict(fallback="error"),
    "error_unrolled": dict(fallback="error", unroll=True),
    "recompute": dict(fallback="recompute", drift_rtol=_TIGHT),
    "recompute_unrolled": dict(fallback="recompute", drift_rtol=_TIGHT, unroll=True),
    "recompute_anchored": dict(fallback="recompute", drift_rtol=_TIGHT, anchor_every=8),
    "none": dict(fallback="none"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_probe_counts_what_the_host_callbacks_report(case):
    module = _stack(**CASES[case])
    p, x = _inputs()
    host, refused, recomputed = _host(module, p, x)
    g, counts = jax.jit(jax.grad(_probed(module), argnums=(0, 2)))(p, x, _probe())
    failed, got = (int(c) for c in counts)
    own = rel_err(jax.grad(_loss(_stack(reversible=False)))(p, x), _exact(p, x))
    print(f"{case}: host refused {refused}, recomputed {recomputed}; probe {counts.tolist()}")
    assert failed == int(refused)  # no error raised under the probe: the count says it
    assert counts_agree(got, recomputed)
    if case.startswith("recompute"):
        assert 0 < got < DEPTH // 2  # a few layers, not every one
        assert rel_err(g, _exact(p, x)) < 100 * own
    if case == "error":
        assert failed == 1  # this stack drifts past the default tolerance
    if host is not None and case != "none":  # the same gradient as the callbacks' program
        assert rel_err(g, host) < 1e-3


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_a_probed_step_holds_no_host_callback(fallback):
    module = _stack(fallback=fallback, drift_rtol=_TIGHT)
    p, x = _inputs()
    probed = jax.jit(jax.grad(_probed(module), argnums=(0, 2))).lower(p, x, _probe()).as_text()
    host = jax.jit(jax.grad(_loss(module))).lower(p, x).as_text()
    assert "callback" in host  # what JAX keeps out of its persistent cache
    assert "callback" not in probed


def test_outside_the_context_nothing_takes_a_probe():
    p, x = _inputs()
    probe = _probe()
    with rn.report_drift_to(probe) as sink:
        jax.eval_shape(_loss(_stack(reversible=False)), p, x)  # no reversible stack runs
    assert not sink.used
    assert rn._drift.current_sink() is None


def test_under_vmap_each_example_gets_its_own_counts():
    # Per-example gradients over two batches (the drifting one, and its reversal scaled by
    # 0.5): the probe's gradient is per example, as every gradient under vmap of grad, and
    # each example's counts are those of its batch run alone.
    module = _stack(fallback="recompute", drift_rtol=_TIGHT)
    p, x = _inputs()
    batches = jnp.stack([x, 0.5 * x[::-1]])
    alone = [_host(module, p, b)[2] for b in batches]
    per_example = jax.vmap(jax.grad(_probed(module), argnums=(0, 2)), in_axes=(None, 0, None))
    g, counts = jax.jit(per_example)(p, batches, _probe())
    print(f"alone {alone}, per example {counts.tolist()}")
    assert counts.shape == (2, 2) and counts[:, 0].tolist() == [0.0, 0.0]
    assert all(counts_agree(int(c), a) for c, a in zip(counts[:, 1], alone, strict=True))
    assert rel_err(jax.tree.map(lambda a: a[0], g), _exact(p, x)) < 1e-2


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_under_shard_map_a_replicated_probe_sums_the_devices_counts(fallback):
    # Batch split over 2 devices, weights and probe replicated: the probe's cotangent is the
    # sum of both devices' counts (with "error", one failed stack on each).
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    module = _stack(fallback=fallback, drift_rtol=_TIGHT)
    p, x = _inputs()
    halves = [_host(module, p, h)[2] for h in jnp.split(x, 2)]

    def local(p, x, probe):
        def loss(p, x, probe):
            return jax.lax.psum(_probed(module)(p, x, probe), "data") / 2

        return jax.grad(loss, argnums=(0, 2))(p, x, probe)

    specs = (P(), P("data"), P())
    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P()))
    g, counts = jax.jit(fn)(p, x, _probe())
    print(f"{fallback}: halves alone {halves}, probe {counts.tolist()}")
    if fallback == "error":
        assert counts.tolist() == [2.0, 0.0]
        return
    assert counts[0] == 0 and counts_agree(int(counts[1]), sum(halves))
    own = rel_err(jax.grad(_loss(_stack(reversible=False)))(p, x), _exact(p, x))
    assert rel_err(g, _exact(p, x)) < 100 * own
