"""Every registered inverse rule, used where the gradient depends on what it rebuilds.

Each case runs ``f(u, w) = op(u * s(w))`` with ``s(w) = 1.5 + tanh(w)``: the backward pass
rebuilds ``x = u * s(w)`` through ``op``'s inverse rule, then ``u = x / s(w)``, and the gradient
with respect to ``w`` is ``sum(ct * u * s'(w))``, so a wrong rule gives a wrong gradient (and a
wrong reconstruction, which is checked directly too). The mutation test then replaces each rule
in turn with one that returns a wrong value and asserts that its case catches it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import remat_nn as rn
from remat_nn.invertible import _primitive_rules
from remat_nn.invertible._jaxpr import display
from tests.gradients import rel_err

_C = jnp.linspace(0.5, 1.5, 32).reshape(4, 8)  # a known (closed-over) operand


def _bitcast_round_trip(x):
    return (lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32), jnp.float32),)


def _on_bits(x, op):
    """``op`` applied to the int32 bits of x; it must keep the exponent (a finite float)."""
    k = lax.bitcast_convert_type(x, jnp.int32)
    return (lax.bitcast_convert_type(op(k), jnp.float32),)


# name -> (primitive, op, input dtype)
CASES = {
    "add": ("add", lambda x: (x + _C,), jnp.float32),
    "add_any": ("add_any", lambda x: (prims.add_jaxvals_p.bind(_C, x),), jnp.float32),
    "sub_left": ("sub", lambda x: (x - _C,), jnp.float32),
    "sub_right": ("sub", lambda x: (_C - x,), jnp.float32),
    "neg": ("neg", lambda x: (-x,), jnp.float32),
    "mul_known_array": ("mul", lambda x: (x * _C,), jnp.float32),
    "mul_literal": ("mul", lambda x: (3.0 * x,), jnp.float32),
    "div_numerator": ("div", lambda x: (x / _C,), jnp.float32),
    "div_denominator": ("div", lambda x: (_C / x,), jnp.float32),
    "exp": ("exp", lambda x: (jnp.exp(x),), jnp.float32),
    "exp2": ("exp2", lambda x: (jnp.exp2(x),), jnp.float32),
    "expm1": ("expm1", lambda x: (jnp.expm1(x),), jnp.float32),
    "log": ("log", lambda x: (jnp.log(x),), jnp.float32),
    "log1p": ("log1p", lambda x: (jnp.log1p(x),), jnp.float32),
    "sqrt": ("sqrt", lambda x: (jnp.sqrt(x),), jnp.float32),
    "rsqrt": ("rsqrt", lambda x: (lax.rsqrt(x),), jnp.float32),
    "cbrt": ("cbrt", lambda x: (jnp.cbrt(x),), jnp.float32),
    "sinh": ("sinh", lambda x: (jnp.sinh(x),), jnp.float32),
    "asinh": ("asinh", lambda x: (jnp.arcsinh(x),), jnp.float32),
    "copy": ("copy", lambda x: (jnp.array(x, copy=True),), jnp.float32),
    "name": ("name", lambda x: (rn.name(x, "hidden"),), jnp.float32),
    "stop_gradient": ("stop_gradient", lambda x: (lax.stop_gradient(x),), jnp.float32),
    "sharding_constraint": (
        "sharding_constraint",
        lambda x: (lax.with_sharding_constraint(x, SingleDeviceSharding(jax.devices()[0])),),
        jnp.float32,
    ),
    "device_put": ("device_put", lambda x: (jax.device_put(x, jax.devices()[0]),), jnp.float32),
    "optimization_barrier": (
        "optimization_barrier",
        lambda x: (lax.optimization_barrier(x),),
        jnp.float32,
    ),
    "reshape": ("reshape", lambda x: (x.reshape(2, 16),), jnp.float32),
    "reshape_dimensions": (
        "reshape",
        lambda x: (lax.reshape(x, (8, 4), dimensions=(1, 0)),),
        jnp.float32,
    ),
    "squeeze": ("squeeze", lambda x: (jnp.squeeze(x.reshape(1, 4, 8), 0),), jnp.float32),
    "transpose": ("transpose", lambda x: (x.T,), jnp.float32),
    "rev": ("rev", lambda x: (jnp.flip(x, 1),), jnp.float32),
    "broadcast_in_dim": (
        "broadcast_in_dim",
        lambda x: (jnp.broadcast_to(x[:, None, :], (4, 3, 8)),),
        jnp.float32,
    ),
    "concatenate": ("concatenate", lambda x: (jnp.concatenate([_C, x], axis=1),), jnp.float32),
    "split": ("split", lambda x: tuple(jnp.split(x, 2, axis=1)), jnp.float32),
    "pad": ("pad", lambda x: (jnp.pad(x, ((1, 2), (0, 1))),), jnp.float32),
    "convert_element_type": (
        "convert_element_type",
        lambda x: (x.astype(jnp.float32),),
        jnp.bfloat16,
    ),
    "bitcast_convert_type": ("bitcast_convert_type", _bitcast_round_trip, jnp.float32),
    "xor": ("xor", lambda x: _on_bits(x, lambda k: k ^ 0x5A5A5), jnp.float32),
    # ~k ^ ~c == k ^ c: one `not`, and the float stays finite
    "not": ("not", lambda x: _on_bits(x, lambda k: ~k ^ jnp.int32(~0x5A5A5)), jnp.float32),
}


def _block(op):
    def f(u, w):
        return op(u * (1.5 + jnp.tanh(w)))

    return f


def _loss(f):
    def loss(u, w):
        outs = jax.tree.leaves(f(u, w))
        return sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in outs)

    return loss


def _inputs(dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(7))
    u = jax.random.uniform(k1, (4, 8), minval=0.2, maxval=1.0).astype(dtype)
    w = jax.random.normal(k2, (4, 8)).astype(dtype)
    return u, w


def _tolerance(dtype) -> float:
    # float32: round-off only. bfloat16: u = x / s(w) is rebuilt in bfloat16, one rounding of
    # 2**-8 relative, which the gradient inherits.
    return 1e-5 if dtype == jnp.float32 else 2 * float(jnp.finfo(jnp.bfloat16).eps)


def _undone(analysis) -> set[str]:
    """Primitives whose rule the input-rebuilding walk runs, inside called bodies too."""
    names = set()
    for step in analysis.schedule(False, True).steps:
        if step.action == "inverse":
            names.add(display(analysis.eqns[step.eqn]).split("[")[0])
            sub = step.derivation.assessment.sub
            if sub is not None:
                names |= _undone(sub)
    return names


def _errors(name):
    """(reconstruction error, gradient error) of a case, with rn.invertible traced afresh."""
    prim, op, dtype = CASES[name]
    f = _block(op)
    inv = rn.invertible(f)
    u, w = _inputs(dtype)
    report = rn.inversion_report(inv, u, w)
    assert report.invertible, str(report)  # u is rebuilt, not kept
    assert prim in _undone(inv.trace(u, w).analysis), str(report)
    (u_rec, w_rec), _ = inv.reconstruct(u, w)
    recon = rel_err((u_rec, w_rec), (u, w))
    g_inv = jax.grad(_loss(inv), argnums=(0, 1))(u, w)
    g_ref = jax.grad(_loss(f), argnums=(0, 1))(u, w)
    return recon, rel_err(g_inv, g_ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_rebuilds_and_gradient_matches(name, jax_upgrade_flags):
    recon, grad = _errors(name)
    tol = _tolerance(CASES[name][2])
    assert recon <= tol, f"reconstruction rel err {recon:.2e}"
    assert grad <= tol, f"gradient rel err {grad:.2e}"


def test_every_registered_rule_has_a_case():
    covered = {prim for prim, _, _ in CASES.values()} | {"pvary"}  # pvary: needs shard_map, below
    registered = {p.name for p in _primitive_rules.registered()}
    assert registered <= covered, f"rules without a case: {sorted(registered - covered)}"


def _perturbed(rule):
    def inverse(invals, outvals, **params):
        new = list(rule.inverse(invals, outvals, **params))
        for p, v in enumerate(invals):
            if _primitive_rules.is_unknown(v):
                x = new[p]
                if jnp.issubdtype(x.dtype, jnp.inexact):
                    new[p] = (x * 1.5 + 1.0).astype(x.dtype)
                else:
                    new[p] = x + (1 << 23)
        return new

    return dataclasses.replace(rule, inverse=inverse)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_rule_is_caught(name, monkeypatch):
    """Mutation check: the case of each rule fails when that rule returns a wrong value."""
    prim_name = CASES[name][0]
    prim = next(p for p in _primitive_rules.registered() if p.name == prim_name)
    bad = _perturbed(_primitive_rules.lookup(prim))
    monkeypatch.setitem(_primitive_rules._RULES, prim, bad)
    recon, grad = _errors(name)
    assert max(recon, grad) > 100 * _tolerance(CASES[name][2]), (recon, grad)


def test_rule_case_inputs_are_well_conditioned():
    """The cases compare at 1e-5: every operand of the rules stays in a range where the inverse
    is well conditioned (x in [0.1, 2.5])."""
    for dtype in (jnp.float32, jnp.bfloat16):
        u, w = _inputs(dtype)
        x = np.asarray((u * (1.5 + jnp.tanh(w))).astype(jnp.float32))
        assert 0.1 <= x.min() and x.max() <= 2.5


def _pvary_errors():
    """(report, gradient rel err) of a coupling inside shard_map whose weights vary over
    ``model`` and data over ``data``: JAX inserts ``pvary`` to make x1 / x2 vary over ``model``
    before adding them to the branches, so rebuilding x1 / x2 undoes a pvary."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def coupling(w, x1, x2):
        y1 = x1 + jnp.tanh(x2 @ w)
        return y1, x2 + jnp.tanh(y1 @ w)

    def grads(f):
        def local(w, x):
            def loss(w, x):
                y1, y2 = f(w[0], x, 0.5 * x)
                return lax.psum(jnp.sum(jnp.sin(y1)) + jnp.sum(y2**2), ("data", "model"))

            return jax.grad(loss, argnums=(0, 1))(w, x)

        specs = (P("model"), P("data"))
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs))

    w = jnp.stack([0.3 * jnp.eye(3), -0.2 * jnp.eye(3)])
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    with jax.set_mesh(mesh):
        w, x = jax.device_put(w, P("model")), jax.device_put(x, P("data"))
        reports = []

        def probe(w, x):
            reports.append(rn.inversion_report(rn.invertible(coupling), w[0], x, 0.5 * x))
            return w, x

        jax.shard_map(
            probe, mesh=mesh, in_specs=(P("model"), P("data")), out_specs=(P("model"), P("data"))
        )(w, x)
        got, want = grads(rn.invertible(coupling))(w, x), grads(coupling)(w, x)
    return reports[0], rel_err(got, want)


def test_pvary_is_inverted_inside_shard_map():
    report, err = _pvary_errors()
    assert report.invertible and [n for n, _ in report.stored_inputs] == ["args[0]"], str(report)
    assert "pvary" in {e.primitive for e in report.entries if e.path == "inverted"}, str(report)
    assert err <= 1e-5, err


def test_a_wrong_pvary_rule_is_caught(monkeypatch):
    prim = next(p for p in _primitive_rules.registered() if p.name == "pvary")
    monkeypatch.setitem(_primitive_rules._RULES, prim, _perturbed(_primitive_rules.lookup(prim)))
    assert _pvary_errors()[1] > 1e-3
