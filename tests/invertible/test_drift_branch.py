"""The drift check's conditional branch runs only when a value drifted.

A branch that is computed and then discarded gives the right answer at many times the cost:
XLA's loop-invariant code motion once hoisted the recompute branch (a forward replay of the
whole stack) out of the loop that runs it zero or one times, so it ran at every layer of the
backward with no layer drifted (19x the step time of the dense depth-64 stack). These tests
count the branch's executions with a host callback that XLA is free to hoist
(``jax.pure_callback`` is not side-effecting), which is what the hoisted code did.

Run: python -m pytest tests/invertible/test_drift_branch.py -q -p no:xdist
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from remat_nn import _drift
from tests.gradients import rel_err


class Counter:
    """``probe(x)``: zeros shaped as ``x`` from a pure host callback that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def _host(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        return np.zeros_like(x)

    def probe(self, x: jax.Array) -> jax.Array:
        x = jax.lax.stop_gradient(x)
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(self._host, shape, x, vmap_method="expand_dims")


@pytest.mark.parametrize("pred, calls", [(False, 0), (True, 1)])
def test_the_branch_runs_only_when_its_predicate_holds(pred, calls):
    count = Counter()

    def branch(a):
        return (a + count.probe(a)) @ a

    f = jax.jit(lambda p, a: _drift.when(p, branch, (a,), jnp.zeros_like(a)))
    a = jnp.arange(16.0).reshape(4, 4) / 16
    out = f(jnp.bool_(pred), a)
    assert count.calls == calls
    assert rel_err(out, a @ a if pred else jnp.zeros_like(a)) < 1e-6


def test_under_vmap_the_branch_runs_once_if_some_element_needs_it_and_never_else():
    count = Counter()

    def branch(a):
        return jnp.sin(a + count.probe(a))

    f = jax.jit(jax.vmap(lambda p, a: _drift.when(p, branch, (a,), jnp.zeros_like(a))))
    a = jnp.linspace(0.1, 1.0, 12).reshape(3, 4)
    jax.block_until_ready(f(jnp.zeros(3, bool), a))
    assert count.calls == 0
    out = f(jnp.array([False, True, False]), a)
    assert count.calls == 1
    want = jnp.zeros_like(a).at[1].set(jnp.sin(a[1]))
    assert rel_err(out, want) < 1e-6


def test_the_vjp_of_a_branch_not_taken_runs_nothing():
    count = Counter()

    def branch(a):
        return jnp.sum(jnp.sin(a + count.probe(a)))

    def loss(a, p):
        return _drift.when(p, branch, (a,), jnp.sum(a))

    g = jax.jit(jax.grad(loss))
    a = jnp.linspace(0.1, 1.0, 8)
    assert rel_err(g(a, jnp.bool_(False)), jnp.ones_like(a)) < 1e-6
    assert count.calls == 0
    assert rel_err(g(a, jnp.bool_(True)), jnp.cos(a)) < 1e-6
    assert count.calls >= 1  # its VJP (the forward value is unused: XLA may drop it)


def _stack_grad_calls(fallback: str, depth: int = 6) -> tuple[int, tuple]:
    count = Counter()

    def branch(p, c, x):
        return jnp.tanh(x @ p) + count.probe(x), c

    block = rn.coupling_block(
        lambda p, c, x: branch(p[0], c, x), lambda p, c, x: branch(p[1], c, x)
    )
    keys = jax.random.split(jax.random.key(0), 4)
    params = tuple(0.3 * jax.random.normal(k, (depth, 8, 8)) for k in keys[:2])
    x = tuple(jax.random.normal(k, (4, 8)) for k in keys[2:])

    def loss(params, x):
        y = rn.reversible_scan(block, params, x, fallback=fallback)[0]
        return sum(jnp.sum(jnp.sin(v)) for v in y)

    grads = jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1)))(params, x))
    return count.calls, grads


def test_a_stack_that_does_not_drift_runs_its_recompute_branch_at_no_layer():
    rn.drift_recomputes(reset=True)
    plain_calls, plain = _stack_grad_calls("none")
    calls, grads = _stack_grad_calls("recompute")
    assert rn.drift_recomputes(reset=True) == {}
    # The same branch evaluations as with no check: the forward, and the rebuild in the
    # backward; a hoisted recompute branch adds a forward replay of the stack per layer.
    assert calls == plain_calls, (calls, plain_calls)
    assert rel_err(grads, plain) < 1e-6
