"""Differential fuzz: random coupling programs, rn.invertible gradients against jax.grad.

Each example draws a program of 1..8 couplings ``a' = combine(a, side(b)); a, b = b, a'`` built
from the registered inverse rules (add, sub, mul / div by a known factor, exp, log, expm1,
asinh, neg, reshape, transpose, rev, split, concatenate, ...), with random shapes, a bfloat16
side computation now and then, calls wrapped in ``jit`` / ``checkpoint``, extra outputs, a
``lax.scan`` form, and a random statement order (any topological order of the program's
statements). The gradient must match plain autodiff to a float32 relative error (max-abs scaled
by the reference's max-abs) of 1e-5; at these ordinary magnitudes no run-time check may refuse
(tests/invertible/test_invertible_magnitudes.py covers the extremes, where refusing is the right
answer).
The outputs of a coupling program determine its data inputs, so the walk must keep none of them.

Hypothesis is not derandomized: a failure prints the falsifying program and a
``@reproduce_failure`` blob to replay it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import remat_nn as rn
from tests.gradients import rel_err


def report_shape(report) -> tuple:
    """``report`` without statement positions or source lines: which primitives are inverted,
    recomputed or only differentiated (with the operands rebuilt), what is stored and checked.
    A program and any reordering of its statements must have the same shape."""
    entries = sorted((e.primitive, e.path, e.detail) for e in report.entries)
    checked = sorted((prim, reason) for prim, _, reason in report.checked)
    return entries, report.stored_inputs, report.data_inputs, checked


def _softscale(s):
    return 1.5 + 0.5 * jnp.tanh(s)  # in [1, 2]: a well-conditioned known factor


def _swap_halves(a):
    lo, hi = jnp.split(a, 2, axis=1)
    return jnp.concatenate([hi, lo], axis=1)


def _permute(a):
    b, d = a.shape
    return a.T.reshape(b, d)


COMBINE = {
    "add": lambda a, s: a + s,
    "sub": lambda a, s: a - s,
    "rsub": lambda a, s: s - a,
    "scale": lambda a, s: a * _softscale(s),
    "divide": lambda a, s: a / _softscale(s),
    "affine": lambda a, s: a * jnp.exp(0.5 * jnp.tanh(s)) + s,
    "neg": lambda a, s: -a + s,
    "asinh": lambda a, s: jnp.arcsinh(a) + s,
    "logexp": lambda a, s: jnp.log(jnp.exp(a) + 0.1 * jax.nn.sigmoid(s)),
    "expm1": lambda a, s: jnp.expm1(0.25 * a) + s,
    "flip": lambda a, s: jnp.flip(a, 1) + s,
    "permute": lambda a, s: _permute(a) + s,
    "halves": lambda a, s: _swap_halves(a) * 2.0 + s,
    # a traced scalar factor: the same (array, scalar) mul as `* 2.0` above, but the scalar is
    # a variable, not a literal (a VJP cache keyed without that mixes the two up)
    "gain": lambda a, s: a * _softscale(s[0, 0]) + s,
}
SIDE = {
    "tanh_dot": lambda b, w: jnp.tanh(b @ w),
    "sin": lambda b, w: 0.5 * jnp.sin(b * w[0][None]),
    "bf16": lambda b, w: jnp.tanh(b.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(
        jnp.float32
    ),
}
WRAP = {
    "plain": lambda f: f,
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
}


@st.composite
def programs(draw):
    depth = draw(st.integers(1, 8))
    layers = [
        (
            draw(st.sampled_from(sorted(COMBINE))),
            draw(st.sampled_from(sorted(SIDE))),
            draw(st.sampled_from(sorted(WRAP))),
            draw(st.booleans()),  # also return 0.5 * a' as an extra output
        )
        for _ in range(depth)
    ]
    return {
        "batch": draw(st.sampled_from([1, 3])),
        "width": draw(st.sampled_from([2, 4, 6])),
        "layers": layers,
        "scan": draw(st.booleans()),
        # one priority per statement: ready statements run in priority order
        "order": draw(st.lists(st.integers(0, 99), min_size=3 * depth, max_size=3 * depth)),
    }


def _unrolled(spec):
    """The program as a function of (x1, x2, ws), its statements in a random valid order."""
    layers, order = spec["layers"], spec["order"]

    def program(x1, x2, ws):
        # statements: side_l needs b_l; combine_l needs a_l and side_l; extra_l needs a'_l
        env = {("a", 0): x1, ("b", 0): x2}
        outs = []
        pending = []
        for i, (comb, side, wrap, extra) in enumerate(layers):
            pending.append(("side", i, side, wrap))
            pending.append(("combine", i, comb, wrap))
            if extra:
                pending.append(("extra", i, None, None))

        def ready(stmt):
            kind, i = stmt[0], stmt[1]
            if kind == "side":
                return ("b", i) in env
            if kind == "combine":
                return ("a", i) in env and ("s", i) in env
            return ("b", i + 1) in env

        while pending:
            candidates = [k for k, s in enumerate(pending) if ready(s)]
            k = min(candidates, key=lambda c: (order[c % len(order)], c))
            kind, i, name, wrap = pending.pop(k)
            if kind == "side":
                env["s", i] = SIDE[name](env["b", i], ws[i])
            elif kind == "combine":
                new = WRAP[wrap](COMBINE[name])(env["a", i], env["s", i])
                env["a", i + 1], env["b", i + 1] = env["b", i], new
            else:
                outs.append(0.5 * env["b", i + 1])
        n = len(layers)
        return (env["a", n], env["b", n], *outs)

    return program


def _scanned(spec, loop=False):
    """One coupling scanned over the layers' weights; ``loop``: the same iterations as a Python
    loop. With a bfloat16 side, XLA rounds differently by compilation context (jax.grad of the
    scan, of the loop, jitted or op by op: up to 7.5e-3 apart, measured), so the fuzz accepts
    the walk within that spread of either."""
    comb, side, wrap, _ = spec["layers"][0]

    def body(carry, w):
        a, b = carry
        return (b, WRAP[wrap](COMBINE[comb])(a, SIDE[side](b, w))), 0.5 * b

    def program(x1, x2, ws):
        if loop:
            carry, ys = (x1, x2), []
            for w in ws:
                carry, y = body(carry, w)
                ys.append(y)
            return (*carry, jnp.stack(ys))
        (a, b), ys = lax.scan(body, (x1, x2), ws)
        return a, b, ys

    return program


def _loss(f):
    return lambda *args: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(f(*args)))


# 15 programs in the suite (each compiles two gradients), the same 15 on every run: drawn at
# random they could hit the known false refusal pinned below (long runs met it once in 900
# programs; once, a 15-program run). A long run (REMAT_NN_FUZZ_EXAMPLES=300 or more) draws new
# programs each time. Every combine form is also run deterministically below.
_LONG_RUN = "REMAT_NN_FUZZ_EXAMPLES" in os.environ


@settings(
    max_examples=int(os.environ.get("REMAT_NN_FUZZ_EXAMPLES", "15")),
    deadline=None,
    database=None,
    derandomize=not _LONG_RUN,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(spec=programs(), seed=st.integers(0, 2**16))
def test_random_coupling_programs_match_autodiff(spec, seed):
    _check_program(spec, seed)


def _check_program(spec, seed):
    program = _scanned(spec) if spec["scan"] else _unrolled(spec)
    depth, b, d = len(spec["layers"]), spec["batch"], spec["width"]
    # Drawn with NumPy: an eager jax.random draw compiles a program per shape.
    rng = np.random.default_rng(seed)
    x1, x2 = (jnp.asarray(rng.standard_normal((b, d)), jnp.float32) for _ in range(2))
    ws = jnp.asarray(0.5 * rng.standard_normal((depth, d, d)) / np.sqrt(d), jnp.float32)
    inv = rn.invertible(program)
    report = rn.inversion_report(inv, x1, x2, ws)
    assert report.invertible, str(report)  # x1, x2 are rebuilt from the outputs, not kept
    if not spec["scan"]:  # the same derivations as in the program's reference statement order
        reference = _unrolled({**spec, "order": [0] * len(spec["order"])})
        twin = rn.inversion_report(rn.invertible(reference), x1, x2, ws)
        assert report_shape(report) == report_shape(twin), f"{report}\n{twin}"

    # Under jit: one compile per gradient instead of one per primitive run op by op.
    def grad(f):
        return jax.block_until_ready(jax.jit(jax.grad(_loss(f), argnums=(0, 1, 2)))(x1, x2, ws))

    want = grad(program)
    # Ordinary magnitudes (values and branch scales O(1)): no run-time check may refuse (refusing
    # is for lost information; tests/invertible/test_invertible_magnitudes.py fuzzes the extremes).
    got = grad(inv)
    assert all(np.isfinite(np.asarray(g)).all() for g in got), got
    err, bar = rel_err(got, want), 1e-5
    if spec["scan"] and err > bar:  # autodiff's own spread (bfloat16 roundings; see _scanned)
        loop = grad(_scanned(spec, loop=True))
        err, bar = min(err, rel_err(got, loop)), max(bar, rel_err(want, loop))
    assert err <= bar, f"gradient rel err {err:.2e} > {bar:.2e}\n{report}"


#: Found by a long run (seed 9581): ordinary magnitudes, refused although the walk's gradient
#: equals jax.grad's (8.3e-9 with rtol=1e-3). The last layer rebuilds a = log(exp(B) - c) with
#: the subtraction's error half an ulp of max|exp(B)| = 126 for both elements: relative to
#: a_1's own exp (0.6) it is large, and the error summary (one absolute and one relative
#: scalar per value) applies it to a_0 too, where exp is steep (126): the derivative check of
#: `exp` then sees a 1.3e-5 change against a 1e-5 tolerance. It was a strict xfail until the
#: derivative checks moved to DERIVATIVE_SLACK * rtol (then 2.5e-4, now 1e-2: _errors.py);
#: a summary that keeps each element's error relative to exp(a) would be the sharper fix.
_STEEP_EXP_BESIDE_A_FLAT_ONE = {
    "batch": 1,
    "width": 2,
    "layers": [
        ("affine", "bf16", "checkpoint", False),
        ("add", "bf16", "checkpoint", False),
        ("flip", "bf16", "checkpoint", False),
        ("add", "bf16", "checkpoint", False),
        ("add", "sin", "checkpoint", False),
        ("add", "sin", "checkpoint", False),
        ("logexp", "sin", "checkpoint", False),
    ],
    "scan": False,
    "order": [0] * 21,
}


def test_a_steep_exp_beside_a_flat_one_is_not_refused():
    _check_program(_STEEP_EXP_BESIDE_A_FLAT_ONE, 9581)


def test_a_bfloat16_scan_body_matches_autodiff_of_its_loop():
    """A fuzz case: the walk equals jax.grad of the loop up to float32 summation order. jax.grad
    of the lax.scan may round differently in bfloat16 (XLA's bfloat16 roundings depend on the
    compiled context and the CPU: on some it differs by 1e-4 and more, on others by nothing), so
    against the scan only a bfloat16 bound holds: a few units in the last place per layer."""
    spec = {"batch": 1, "width": 4, "layers": [("add", "bf16", "checkpoint", False)] * 3}
    spec.update(scan=True, order=[0] * 9)
    rng = np.random.default_rng(0)
    x1, x2 = (jnp.asarray(rng.standard_normal((1, 4)), jnp.float32) for _ in range(2))
    ws = jnp.asarray(0.25 * rng.standard_normal((3, 4, 4)), jnp.float32)

    def grad(f):
        return jax.jit(jax.grad(_loss(f), argnums=(0, 1, 2)))(x1, x2, ws)

    got = grad(rn.invertible(_scanned(spec)))
    assert rel_err(got, grad(_scanned(spec, loop=True))) <= 1e-6
    scan_err = rel_err(got, grad(_scanned(spec)))
    print(f"walk vs jax.grad of the scan: {scan_err:.3g}")
    assert scan_err <= 2 * len(spec["layers"]) * float(jnp.finfo(jnp.bfloat16).eps)


@pytest.mark.parametrize("comb", sorted(COMBINE))
def test_every_combine_form_is_inverted(comb):
    """Each building block of the fuzz is inverted (the outputs determine its inputs)."""
    spec = {
        "batch": 3,
        "width": 4,
        "layers": [(comb, "tanh_dot", "plain", False)] * 2,
        "scan": False,
        "order": [0] * 6,
    }
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 4))
    ws = 0.1 * jnp.ones((2, 4, 4))
    report = rn.inversion_report(_unrolled(spec), x, -x, ws)
    assert report.invertible, str(report)
