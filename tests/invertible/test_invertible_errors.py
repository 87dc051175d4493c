"""The errors rebuilt values carry into the backward walk (remat_nn/invertible/_errors.py).

Issue #29: an inversion within its own bound can still give a wrong gradient when what the walk
computes from the rebuilt value cancels or is steep (program 22 of the magnitude fuzz, float16:
34% off autodiff, silently). The walk now carries each derived value's error and checks the
derivatives it takes at such values. These tests pin the estimates and show the check is what
refuses the silent case.
"""

from __future__ import annotations

import logging

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from remat_nn.invertible import _errors
from remat_nn.invertible._primitive_rules import DEFAULT_RTOL
from tests.gradients import rel_err
from tests.invertible.test_invertible_magnitudes import _program, verdict


def _eqn(f, *args, prim):
    """The first equation of ``f``'s jaxpr whose primitive is ``prim``."""
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    return next(e for e in jaxpr.eqns if e.primitive is prim)


def _err(a):
    """An error of ``a`` in every element, known only in absolute terms."""
    a = jnp.float32(a)
    return a, jnp.float32(jnp.inf), jnp.float32(0.0)


def test_without_the_derivative_check_program_22_is_silently_wrong_again(monkeypatch):
    """The mutation: the derivative check returns nothing to check; program 22 (refused in
    test_invertible_magnitudes) is then a silent mismatch, so the check is what refuses it."""
    program, _, args, dtype, _ = _program(2, 22)
    monkeypatch.setattr(_errors, "derivative_excess", lambda *a, **k: None)
    assert verdict(program, args, dtype)[0] == "mismatch"


def test_a_contraction_carries_the_root_sum_square_of_its_columns():
    """``x @ w`` with every element of x off by at most e: the estimate is e times the largest
    column 2-norm of w (errors of distinct elements independent), not the worst case sum |w|."""
    x = jnp.ones((2, 3))
    w = jnp.asarray([[3.0, 1.0], [4.0, -1.0], [0.0, 1.0]])
    eqn = _eqn(lambda x, w: x @ w, x, w, prim=prims.dot_general_p)
    (err,) = _errors.forward(eqn, [x, w], [x @ w], [_err(1e-3), None], lambda e: None)
    assert float(err[0]) == pytest.approx(1e-3 * 5.0)  # column (3, 4, 0): norm 5, sum |w| 7


def test_one_error_in_every_element_summarizes_as_its_broadcast():
    """A contraction's error, the same in every output element, is summarized from one
    reduction of the output (``uniform``): bit for bit what ``summarize`` makes of its
    broadcast, for errors 0, tiny, huge, inf and NaN and outputs with zeros, infs and NaNs,
    magnitudes log-uniform over float32's range, and an empty one. (Normal errors: a
    subnormal one may read 0 through the broadcast's reduction, as XLA:CPU flushes them.)"""
    rng = np.random.default_rng(0)
    mags = np.exp(rng.uniform(np.log(1e-38), np.log(1e38), (5, 8))).astype(np.float32)
    outputs = [mags, np.zeros((2, 3), np.float32), np.zeros((0, 4), np.float32)]
    outputs += [np.where(mags > 1, np.float32(bad), -mags) for bad in (0, np.inf, np.nan)]
    floor = jnp.float32(1e-7)
    for y in map(jnp.asarray, outputs):
        for part in (0.0, 1e-37, 1e-6, 3.0, 1e38, np.inf, np.nan):
            part = jnp.float32(part)
            want = _errors.summarize(jnp.broadcast_to(part, y.shape), y, floor)
            got = _errors.uniform(part, y, floor)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w, err_msg=f"part {part}, y {y.shape}")


def test_a_sum_over_n_terms_grows_the_error_by_sqrt_n():
    x = jnp.ones((4, 16))
    eqn = _eqn(lambda x: jnp.sum(x, axis=1), x, prim=prims.reduce_sum_p)
    (err,) = _errors.forward(eqn, [x], [jnp.sum(x, axis=1)], [_err(1e-3)], lambda e: None)
    assert float(err[0]) == pytest.approx(1e-3 * 4.0)


def test_an_elementwise_function_scales_each_element_by_its_slope():
    """exp keeps a relative error: its small elements stay precise (the relative part), so a
    ``log`` of it is not refused for the error its largest element carries."""
    x = jnp.asarray([-10.0, 0.0, 10.0])
    eqn = _eqn(jnp.exp, x, prim=prims.exp_p)
    (err,) = _errors.forward(eqn, [x], [jnp.exp(x)], [_err(1e-6)], lambda e: None)
    a, r, _ = err
    assert float(a) == pytest.approx(1e-6 * np.exp(10.0), rel=1e-5)  # the largest slope
    assert float(r) == pytest.approx(1e-6, rel=1e-5)  # relative to each element
    per = _errors.spread(err, jnp.exp(x))
    assert float(per[0]) == pytest.approx(1e-6 * np.exp(-10.0), rel=1e-5)


def test_an_inversion_passes_on_the_error_of_what_it_subtracts():
    """a = y - b with b off by e: a is off by e too (first order, through the inverse rule)."""
    got = _errors.linearized(
        lambda y, b: [y - b], [jnp.ones(3), jnp.full(3, 0.5)], [None, _err(2e-4)], [jnp.ones(3)]
    )
    assert float(got[0][0]) == pytest.approx(2e-4)


def test_a_wide_ranging_log_of_a_rebuilt_exp_is_not_refused():
    """The fuzz's logexp case (seed 512): ``log`` of values from 0.4 to 16, rebuilt by ``exp``
    with an error relative to each element. Carried as one absolute error (that of the largest
    element) it refused; with the relative part: no refusal, and the gradient matches autodiff."""

    def f(x1, x2, w):
        y2 = x2 + jnp.tanh(x1 @ w)
        return jnp.log(jnp.exp(x1) + 0.1 * jax.nn.sigmoid(y2 @ w)), y2

    x1 = jnp.linspace(-1.0, 2.75, 8).reshape(2, 4)
    x2 = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    w = 0.3 * jnp.eye(4)

    def loss(g):
        return lambda *a: sum(jnp.sum(jnp.sin(y)) for y in g(*a))

    got = jax.jit(jax.grad(loss(rn.invertible(f)), argnums=(0, 1, 2)))(x1, x2, w)
    want = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(x1, x2, w)
    assert rel_err(got, want) <= 1e-5


def test_a_16_bit_value_sets_the_tolerance_of_what_is_computed_from_it():
    """A float32 value computed through bfloat16 is held to bfloat16's tolerance, not float32's:
    the floor travels with the error."""
    x = jnp.ones(3, jnp.float32)
    floor = _errors.rounding(x.astype(jnp.bfloat16))
    assert floor is not None and float(floor[2]) == pytest.approx(8 * 2.0**-7)
    assert _errors.rounding(x) is None
    err = _errors.add(_err(1e-2), floor)  # 1% of the scale: too much for float32, fine here
    assert float(_errors.value_excess(err, x, 1e-5)) == 0.0
    assert float(_errors.value_excess(_err(1e-2), x, 1e-5)) == pytest.approx(1e-2)


def _coupling(carry, w):
    a, b = carry
    return (b, a + jnp.tanh(100.0 * (b @ w))), None


def test_a_scan_carries_the_errors_from_iteration_to_iteration(monkeypatch):
    """The error a rebuilt carry takes from one iteration's subtraction (streams near 1000,
    rounded to 6e-5) reaches the next iteration's ``tanh(100 * (b0 - b1))``, whose argument
    cancels to ~0.4: by the bound alone, its derivative check refuses. With the scan's errors
    not carried across iterations (the mutation), the check is blind there and passes.

    Measured, the stack is accepted, as its unrolled twin is: the forward pass sketches the
    values of the scan's body at every iteration (_scan_sketch; outside a scan, _sketch), and
    ``a + t - t`` with ``|t|`` far below ``|a|`` gives ``a`` back exactly, a measured drift of 0.
    The gradient is autodiff's (within the tolerance: the walk recomputes
    ``tanh(100 * ...)``, which XLA may fuse otherwise)."""
    from remat_nn.invertible import _equation_rules, _vjp

    x1 = jnp.asarray([[1000.1234, 1000.1271]], jnp.float32)
    x2 = jnp.asarray([[999.8765, 999.8802]], jnp.float32)
    ws = jnp.stack([jnp.asarray([[1.0, 1.0], [-1.0, -1.0]])] * 3)

    def scanned(x1, x2, ws):
        return jax.lax.scan(_coupling, (x1, x2), ws)[0]

    def unrolled(x1, x2, ws):
        carry = (x1, x2)
        for i in range(ws.shape[0]):
            carry = _coupling(carry, ws[i])[0]
        return carry

    def grad(f):
        loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in f(*a))  # noqa: E731
        return jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(x1, x2, ws))

    want = grad(unrolled)
    assert rel_err(grad(rn.invertible(unrolled)), want) <= DEFAULT_RTOL
    assert rel_err(grad(rn.invertible(scanned)), want) <= DEFAULT_RTOL
    monkeypatch.setattr(_vjp, "sketched_scans", lambda schedule: [])  # the bound alone
    refused = (rn.NotInvertibleError, jax.errors.JaxRuntimeError)
    with pytest.raises(refused, match="the derivative of `tanh`"):
        grad(rn.invertible(scanned))
    monkeypatch.setattr(_equation_rules._ScanErrors, "of", classmethod(lambda cls, *a: None))
    grad(rn.invertible(scanned))  # not refused: nothing reached the check


def _gated(x, w):  # a mask computed from a weight: where it is 0, rebuilding x is refused
    return x * (w > 0).astype(x.dtype) + 1.0


def _refusal(train_step, args, caplog):
    """The text of the refusal ``train_step(*args)`` raises, and JAX's callback log records."""
    with caplog.at_level(logging.DEBUG), pytest.raises(Exception) as e:
        jax.block_until_ready(train_step(*args))
    assert isinstance(e.value, rn.NotInvertibleError | jax.errors.JaxRuntimeError), e.value
    return str(e.value), [r for r in caplog.records if "callback failed" in r.getMessage()]


@pytest.mark.parametrize("jit", [False, True])
def test_a_run_time_refusal_reads_well_under_jit(jit, caplog):
    """Under jit a refusal used to reach the user as ``INTERNAL: CpuCallback error calling
    callback: Traceback ...`` with the whole stack before the NotInvertibleError, after JAX had
    logged "jax.debug.callback failed" and the same text. Now the refusal is in the first
    lines, once; in a jitted train step (value_and_grad, an update) as in a plain grad."""
    x = jnp.linspace(-1.0, 1.0, 8)
    gate = jnp.where(jnp.arange(8) % 2 == 0, -1.0, 1.0)
    inv = rn.invertible(_gated)

    def step(x, g):
        loss, (dx, dg) = jax.value_and_grad(
            lambda x, g: jnp.sum(jnp.sin(inv(x, g))), argnums=(0, 1)
        )(x, g)
        return x - 0.1 * dx, g - 0.1 * dg, loss

    text, logged = _refusal(jax.jit(step) if jit else step, (x, gate), caplog)
    lines = text.splitlines()
    head = "\n".join(lines[:3])
    assert "NotInvertibleError" in head or not jit, text  # eagerly: the exception itself
    assert "rebuilding an operand of `mul` at" in head and "test_invertible_errors.py:" in head
    assert "Fix:" in "\n".join(lines[:6]), text
    assert not logged, [r.getMessage() for r in logged]


def test_a_derivative_refusal_reads_well_under_jit(caplog, monkeypatch):
    """The other run-time refusal (an error carried into a derivative), from the scan of
    test_a_scan_carries_the_errors_from_iteration_to_iteration judged by its bound alone
    (the per-iteration sketches off), read the same way."""
    from remat_nn.invertible import _vjp

    monkeypatch.setattr(_vjp, "sketched_scans", lambda schedule: [])
    x1 = jnp.asarray([[1000.1234, 1000.1271]], jnp.float32)
    x2 = jnp.asarray([[999.8765, 999.8802]], jnp.float32)
    ws = jnp.stack([jnp.asarray([[1.0, 1.0], [-1.0, -1.0]])] * 3)
    scanned = rn.invertible(lambda x1, x2, ws: jax.lax.scan(_coupling, (x1, x2), ws)[0])
    loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in scanned(*a))  # noqa: E731
    text, logged = _refusal(jax.jit(jax.grad(loss, argnums=(0, 1))), (x1, x2, ws), caplog)
    lines = text.splitlines()
    assert "NotInvertibleError: rn.invertible: the derivative of `tanh` at" in "\n".join(lines[:3])
    assert "Fix:" in "\n".join(lines[:6]) and not logged, text
