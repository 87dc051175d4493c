"""rn.invertible in floating point and machine integers (issue #29).

Every inversion is exact for the values at hand (integer rules only where they are bijections
modulo 2^n), bounded at run time (floating inverses, against the rebuilt tensor's scale), or
refused: never a silently wrong gradient. Also: strictness (``known_argnums``; a kept data input
is an error unless ``fallback="recompute"``), forward mode, zero-size shapes, loops over values
that carry no cotangent. Each class of failure of the issue has a test here that failed before.

Run: python -m pytest tests/invertible/test_invertible_numerics.py -q -p no:xdist
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import remat_nn as rn
from remat_nn.invertible import _primitive_rules
from remat_nn.invertible._primitive_rules import DEFAULT_RTOL, KINDS
from tests.gradients import rel_err
from tests.invertible.test_invertible_fuzz import report_shape

# A failed run-time check arrives as NotInvertibleError, or (under jit) inside a runtime error.
REFUSED = (rn.NotInvertibleError, jax.errors.JaxRuntimeError)


def _vjp(f, *args):
    """The VJP of ``f`` at ``args`` with cotangents cos(y) (nonzero, different per element)."""
    y, pullback = jax.vjp(f, *args)
    cts = jax.tree.map(lambda v: jnp.cos(v) if jnp.issubdtype(v.dtype, jnp.inexact) else None, y)
    cts = jax.tree.map(
        lambda v, c: c if c is not None else np.zeros(v.shape, jax.dtypes.float0),
        y,
        cts,
        is_leaf=lambda c: c is None,
    )
    return pullback(cts)


def _float_leaves(tree):
    """The float leaves, complex ones as (real, imag) (rel_err compares real values)."""
    out = []
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            out += [jnp.real(x), jnp.imag(x)]
        elif jnp.issubdtype(x.dtype, jnp.inexact):
            out.append(x)
    return out


def _matches(f, *args, tol=1e-5, **kw):
    """rel_err of rn.invertible(f)'s VJP against jax.vjp's (float leaves)."""
    got = _float_leaves(_vjp(rn.invertible(f, **kw), *args))
    want = _float_leaves(_vjp(f, *args))
    return rel_err(got, want) < tol


# --- 1. domains: integer rules only where they are bijections ------------------------------------


def test_unsigned_floor_division_is_not_inverted():
    """`k // 2` rebuilt as 2 * (k // 2) lost k's low bit (err 0.24)."""

    def f(x, k):  # rebuilding x needs sin(k): k must be exact
        return x * jnp.sin(k.astype(jnp.float32)), k // 2

    x, k = jnp.linspace(0.5, 1.5, 4), jnp.array(7, jnp.uint32)  # k is the cheaper to keep
    assert _matches(f, x, k)  # k is kept (it helps rebuild x, like a weight) and recomputed
    report = rn.inversion_report(rn.invertible(f), x, k)
    assert "inverted" not in [e.path for e in report.entries if e.primitive == "div"], str(report)
    assert report.stored_inputs == (("args[1]", "u32[]"),), str(report)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32])
@pytest.mark.parametrize("k", [2**30 + 1, 2**30 + 7])
def test_wrapping_integer_mul_by_an_even_constant_is_not_inverted(dtype, k):
    """`k * 4` with k near 2^30 wraps: k / 4 is not k (err 1.0)."""

    def f(x, k):
        return x * jnp.sin(k.astype(jnp.float32)), k * 4

    x, k = jnp.linspace(0.5, 1.5, 3), jnp.array(k, dtype)
    assert _matches(f, x, k)
    report = rn.inversion_report(rn.invertible(f), x, k)
    assert [n for n, _ in report.stored_inputs] == ["args[1]"], str(report)


def test_an_lcg_state_in_a_scan_carry_is_not_inverted():
    """A uint32 linear-congruential RNG state in a scan carry (err 0.18)."""

    def f(x, s):
        def body(c, _):
            x, s = c
            s = s * jnp.uint32(1664525 * 4) + jnp.uint32(1013904223)
            return (x + (s >> 24).astype(jnp.float32), s), None

        return lax.scan(body, (x, s), length=3)[0]

    x, s = jnp.linspace(0.5, 1.5, 3), jnp.array([12345, 777, 2**31 + 5], jnp.uint32)
    assert _matches(f, x, s, fallback="recompute")
    with pytest.raises(rn.NotInvertibleError, match=r"`scan`"):
        _vjp(rn.invertible(f), x, s)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32, jnp.int8])
def test_wrapping_integer_mul_by_an_odd_constant_is_inverted_exactly(dtype):
    """Multiplying by an odd constant is a bijection modulo 2^n: rebuilt by its inverse."""

    def f(x, k):
        return x * k.astype(jnp.float32), k * 3

    big = np.iinfo(dtype).max - 3
    x, k = jnp.linspace(0.5, 1.5, 3), jnp.array([big, 7, 1], dtype)
    report = rn.inversion_report(rn.invertible(f, known_argnums=()), x, k)
    assert report.invertible and report.stored_inputs == (), str(report)
    assert _matches(f, x, k)
    (_, k_back), _ = rn.invertible(f).reconstruct(x, k)
    np.testing.assert_array_equal(k_back, k)


def test_an_integer_rebuilt_from_a_float_is_rounded_not_truncated():
    """uint8 k / 100: k rebuilt as (k / 100 * 100) truncated to uint8 (err 0.17)."""

    def f(x, k):
        q = k.astype(jnp.float32) / 100.0
        return x * q, q

    x, k = jnp.linspace(0.5, 1.5, 4), jnp.array([53, 59, 105, 255], jnp.uint8)  # k / 100 * 100 < k
    (_, k_back), _ = rn.invertible(f).reconstruct(x, k)
    np.testing.assert_array_equal(k_back, k)
    assert _matches(f, x, k)


@pytest.mark.parametrize("op", [jnp.exp, jnp.sinh])
def test_complex_exp_and_sinh_are_not_inverted(op):
    """The principal branch picks another preimage (err 0.99 / 0.37); exp with a negative real
    part was refused as 'exp underflowed to 0'."""
    z = jnp.array([-2.0 + 4.0j, 0.5 + 4.0j], jnp.complex64)
    assert _matches(op, z, fallback="recompute")
    with pytest.raises(rn.NotInvertibleError, match=f"`{op.__name__}`.*complex64"):
        _vjp(rn.invertible(op), z)


# --- 5. crashes where jax.grad works ------------------------------------------------------------


def test_zero_size_broadcast():
    def f(x):
        return x + 1.0, jnp.broadcast_to(x, (0, 3)) * 2.0

    assert _matches(f, jnp.linspace(0.5, 1.5, 3))


def test_zero_size_operand():
    def f(x, y):
        return jnp.concatenate([x, y]) * 2.0

    assert _matches(f, jnp.zeros((0,)), jnp.linspace(0.5, 1.5, 3))


_C = jnp.linspace(0.5, 1.5, 3)


def _loop(init):
    return lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2.0), (0, init))[1]


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x * 2.0 + _loop(_C),  # a closed-over constant
        lambda x: x * 2.0 + _loop(lax.stop_gradient(x)),
        lambda x: x * 2.0 + jnp.sin(_loop(lax.stop_gradient(x) + _C)),
    ],
    ids=["constant", "stop_gradient", "stop_gradient_plus_constant"],
)
def test_a_while_loop_over_values_without_cotangent(f):
    # x also feeds the loop, so it is kept (fallback="recompute"); the constant is just kept
    x = jnp.linspace(0.5, 1.5, 3)
    assert _matches(f, x, fallback="recompute")
    inv = rn.invertible(f, fallback="recompute")
    got = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(inv(x)))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)
    assert rel_err(got, want) < 1e-6


def test_a_while_loop_over_a_closed_over_constant_is_strictly_invertible():
    f = lambda x: x * 2.0 + _loop(_C)  # noqa: E731
    assert _matches(f, jnp.linspace(0.5, 1.5, 3))
    assert rn.inversion_report(rn.invertible(f), jnp.ones(3)).invertible


def _coupling(x1, x2, w):
    y1 = x1 + jnp.tanh(x2 @ w)
    return y1, x2 + jnp.tanh(y1 @ w)


def test_forward_mode_runs_the_functions_own_jvp():
    x, w = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), 0.3 * jnp.eye(3)
    f = rn.invertible(_coupling)
    out, tangent = jax.jvp(f, (x, x, w), (x, 2 * x, w))
    want_out, want_tangent = jax.jvp(_coupling, (x, x, w), (x, 2 * x, w))
    assert rel_err((out, tangent), (want_out, want_tangent)) < 1e-6
    g = rn.invertible(lambda x: jnp.exp(x) * 2.0)
    assert rel_err(jax.jacfwd(g)(x[0]), jax.jacfwd(lambda x: jnp.exp(x) * 2.0)(x[0])) < 1e-6


def test_rsqrt_of_a_large_finite_value():
    """rsqrt(1e38) was refused (1 / (y * y) underflowed to 1/0) though its gradient is finite."""
    x = jnp.array([1e38, 3e37, 2.0], jnp.float32)
    assert _matches(lax.rsqrt, x)


# --- 3. conditioning-aware, order-free choice ---------------------------------------------------


def _shape(f, *args, **kw):
    """The report of rn.invertible(f) without positions and lines (see report_shape)."""
    return report_shape(rn.inversion_report(rn.invertible(f, **kw), *args))


def _statements(order):
    """x (data) and w (weight) feed four outputs, each of which alone determines x: the
    statements run in ``order``."""
    make = {
        "mul": lambda x, w: x * 3.0,  # bounded, error relative to x
        "add": lambda x, w: x + 1e4 * jnp.tanh(w),  # additive: w's branch dwarfs x
        "radd": lambda x, w: 1e4 * jnp.sin(w) + x,
        "sub": lambda x, w: x - 1e4 * jnp.cos(w),
        "rsub": lambda x, w: 1e4 * jnp.tanh(2 * w) - x,
        "exp": lambda x, w: jnp.exp(x),  # bounded, error relative to x
        "reshape": lambda x, w: x.reshape(2, 2),  # exact
    }

    def f(x, w):
        outs = {name: make[name](x, w) for name in order}
        return tuple(outs[k] for k in sorted(outs))

    return f


def test_a_value_recomputable_from_known_values_is_recomputed_whatever_the_order():
    """``tanh(w)`` is recomputed from the weight, never rebuilt by the subtraction ``z - x``
    (which the second order did before: a bounded inversion instead of an exact recompute)."""
    x, w = jnp.linspace(0.5, 1.5, 4), jnp.linspace(-1.0, 1.0, 4)

    def first(x, w):
        y = x * 3.0
        z = x + jnp.tanh(w)
        return y, z

    def second(x, w):
        z = x + jnp.tanh(w)
        y = x * 3.0
        return y, z

    for f in (first, second):
        paths = {e.primitive: e.path for e in rn.inversion_report(f, x, w).entries}
        assert paths == {"mul": "inverted", "tanh": "recomputed", "add": "known"}, paths
        assert _matches(f, x, w, known_argnums=1)
    assert _shape(first, x, w, known_argnums=1) == _shape(second, x, w, known_argnums=1)


@pytest.mark.parametrize(
    "keep",
    [
        ("mul", "add", "exp", "reshape"),
        ("mul", "add", "exp"),
        *itertools.product(("mul", "exp"), ("add", "radd", "sub", "rsub")),
    ],
)
def test_the_best_conditioned_inversion_wins_in_every_statement_order(keep):
    """Several outputs each determine x: the exact reshape is taken, then a
    relative-error one (mul, exp), never the additive one, whose other operand is 1e4 times x
    (subtracting it would lose x's low digits); every order of the statements gives the same
    report, and the gradient matches autodiff."""
    x, w = jnp.linspace(0.5, 1.5, 4), jnp.linspace(-1.0, 1.0, 4)
    shapes = set()
    for order in itertools.permutations(keep):
        f = _statements(order)
        report = rn.inversion_report(rn.invertible(f, known_argnums=1), x, w)
        inverted = {e.primitive for e in report.entries if e.path == "inverted"}
        assert inverted <= {"reshape", "mul", "exp"} and len(inverted) == 1, str(report)
        if "reshape" in keep:
            assert inverted == {"reshape"}, str(report)
        shapes.add(repr(report_shape(report)))
        assert _matches(f, x, w, known_argnums=1)
    assert len(shapes) == 1, shapes


# --- 4. strictness ------------------------------------------------------------------------------


def test_a_data_input_the_outputs_do_not_determine_is_an_error():
    """The prototype raised; this kept x silently (the report listed it)."""
    f = lambda x: jnp.sin(jnp.exp(x))  # noqa: E731
    x = jnp.linspace(0.5, 1.5, 3)
    with pytest.raises(rn.NotInvertibleError, match=r"args\[0\].*`sin`"):
        rn.invertible(f)(x)
    assert _matches(f, x, fallback="recompute")
    assert rn.inversion_report(rn.invertible(f, fallback="recompute"), x).data_inputs == (
        "args[0]",
    )


def test_known_argnums_declares_the_weights():
    x, w = jnp.linspace(0.5, 1.5, 6).reshape(2, 3), 0.3 * jnp.eye(3)
    assert _matches(_coupling, x, x, w, known_argnums=2)
    assert _matches(_coupling, x, x, w, known_argnames="w")
    # an argument that is not declared known and that the outputs do not determine
    with pytest.raises(rn.NotInvertibleError, match=r"args\[1\].*`sin`"):
        rn.invertible(lambda w, x: jnp.sin(x) + w[:2], known_argnums=0)(w, x)
    # a weight that is not declared is not determined either
    with pytest.raises(rn.NotInvertibleError, match=r"args\[2\].*`dot_general`"):
        rn.invertible(_coupling, known_argnums=())(x, x, w)
    assert _matches(lambda w, x: jnp.sin(x) + w[:2], w, x, known_argnums=0, fallback="recompute")


def test_known_argnums_is_validated():
    with pytest.raises(ValueError, match="known_argnums"):
        rn.invertible(_coupling, known_argnums=5)(jnp.ones(3), jnp.ones(3), jnp.eye(3))
    with pytest.raises(ValueError, match="known_argnames.*'v'"):
        rn.invertible(_coupling, known_argnames="v")


# --- 2. bounded floating inversions -------------------------------------------------------------


def _exact_or_refused(f, *args, tol=1e-5, **kw):
    """rn.invertible(f)'s VJP matches jax.vjp's within ``tol``, or it raises
    NotInvertibleError; returns which ("match" / "refused")."""
    want = _float_leaves(_vjp(f, *args))
    try:
        got = _float_leaves(jax.block_until_ready(_vjp(rn.invertible(f, **kw), *args)))
    except REFUSED as e:
        assert "rn.invertible" in str(e), str(e)
        return "refused"
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in got), got
    err = rel_err(got, want)
    assert err < tol, f"a silently wrong gradient: rel err {err:.3g}"
    return "match"


def _coupling_scaled(scale):
    def f(x1, x2, w):
        y1 = x1 + scale * jnp.tanh(x2 @ w)
        return y1, x2 + jnp.tanh(y1 @ w)

    return f


_X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
_W = 0.5 * jnp.eye(3) + 0.1


@pytest.mark.parametrize(
    "name, f, args, outcome",
    [
        # a coupling branch 1e4 times the stream (err 8e-5 .. 3e-2)
        ("big_branch", _coupling_scaled(1e4), (_X, _X, _W), "refused"),
        ("ordinary_branch", _coupling_scaled(1.0), (_X, _X, _W), "match"),
        # exp(x) near 1 rebuilt by log (x = 1e-5: err 6e-3; 1e-8: NaN)
        ("exp_near_1", lambda x: jnp.exp(x), (jnp.full(3, 1e-5),), "refused"),
        ("exp_at_1e-8", lambda x: jnp.exp(x), (jnp.array([1e-8, 2e-8, 3e-8]),), "refused"),
        ("exp_ordinary", lambda x: jnp.exp(x), (jnp.linspace(-2.0, 2.0, 3),), "match"),
        # a product that underflows although the known factor is normal (err 1.0)
        (
            "mul_underflow",
            lambda x, b: (x * b, b),
            (jnp.full(3, 1e-30), jnp.full(3, 1e-10)),
            "refused",
        ),
        (
            "div_underflow",
            lambda x, b: (x / b, b),
            (jnp.full(3, 1e-30), jnp.full(3, 1e10)),
            "refused",
        ),
        # float16 literals: x * 4 overflows, x * 1e-30 and x / 1e-30 are 0 / inf (NaN)
        ("f16_mul_overflow", lambda x: x * 4.0, (jnp.full(3, 2e4, jnp.float16),), "refused"),
        ("f16_tiny_literal", lambda x: (x * 1e-30, x * 2.0), (jnp.ones(3, jnp.float16),), "match"),
        ("f16_div_tiny_literal", lambda x: x / 1e-30, (jnp.ones(3, jnp.float16),), "refused"),
        # a subnormal known factor in float16 / bfloat16 (float32 ones are flushed on CPU)
        (
            "f16_subnormal_factor",
            lambda x, b: (x * b, b),
            (jnp.ones(3, jnp.float16), jnp.full(3, 1e-6, jnp.float16)),
            "refused",
        ),
        (
            "bf16_subnormal_factor",
            lambda x, b: (x * b, b),
            (jnp.ones(3, jnp.bfloat16), jnp.full(3, 1e-39, jnp.bfloat16)),
            "refused",
        ),
        ("asinh_huge", lambda x: jnp.arcsinh(x), (jnp.array([1e38, 1.0, 2.0]),), "refused"),
        ("log_huge", lambda x: jnp.log(x), (jnp.array([1e38, 1.0, 2.0]),), "refused"),
        ("near_zero_beside_large", lambda x: jnp.exp(x), (jnp.array([1e-9, 1.0, 2.0]),), "match"),
        # the edge of each remaining floating rule's domain
        ("expm1_saturated", lambda x: jnp.expm1(x), (jnp.array([-20.0, -19.0, -18.0]),), "refused"),
        ("exp2_near_1", lambda x: jnp.exp2(x), (jnp.full(3, 1e-6),), "refused"),
        ("log1p_huge", lambda x: jnp.log1p(x), (jnp.array([1e38, 1.0, 2.0]),), "refused"),
        ("sqrt_f16_underflow", lambda x: jnp.sqrt(x), (jnp.full(3, 1e-7, jnp.float16),), "refused"),
        ("cbrt_f16_underflow", lambda x: jnp.cbrt(x), (jnp.full(3, 1e-7, jnp.float16),), "refused"),
        ("sub_big_branch", lambda x, b: (1e5 * jnp.tanh(b) - x, b), (_X, _X), "refused"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_floating_inversions_are_bounded(name, f, args, outcome):
    """Each inversion is checked against the rebuilt tensor's scale (max |value|): refused
    where rounding or underflow lost information, exact (to the float32 bar) elsewhere."""
    tol = 1e-5 if all(a.dtype == jnp.float32 for a in args) else 1e-2
    assert _exact_or_refused(f, *args, tol=tol, rtol=_EDGE_RTOL.get(name, DEFAULT_RTOL)) == outcome


# exp / expm1 / sinh of a float32 log-scale value lose at most u * 88.7 = 5.3e-6 of the rebuilt
# value, within the default rtol: their bounds' edges show at a tighter one.
_EDGE_RTOL = dict.fromkeys(["asinh_huge", "log_huge", "log1p_huge"], 1e-6)


def test_the_tolerance_is_adjustable():
    f, args = _coupling_scaled(300.0), (_X, _X, _W)
    assert _exact_or_refused(f, *args) == "refused"
    assert _exact_or_refused(f, *args, tol=1e-4, rtol=1e-4) == "match"
    with pytest.raises(ValueError, match="rtol"):
        rn.invertible(f, rtol=0.0)


# --- 1. domains, per rule ---------------------------------------------------------------------

_REAL, _INEXACT, _BITS = {"float"}, {"float", "complex"}, {"signed", "unsigned", "bool"}
_ALL, _RING = set(KINDS), {"float", "complex", "signed", "unsigned"}
DOMAINS = {
    **dict.fromkeys(["add", "add_any", "sub", "neg", "mul", "pvary"], _RING),
    "div": _INEXACT,
    **dict.fromkeys(["xor", "not"], _BITS),
    **dict.fromkeys(
        ["exp", "exp2", "expm1", "log", "log1p", "sqrt", "rsqrt", "cbrt", "sinh", "asinh"], _REAL
    ),
    **dict.fromkeys(
        [
            "copy", "name", "stop_gradient", "sharding_constraint", "device_put",
            "optimization_barrier", "reshape", "squeeze", "transpose", "rev", "broadcast_in_dim",
            "concatenate", "split", "pad", "convert_element_type", "bitcast_convert_type",
        ],
        _ALL,
    ),
}  # fmt: skip
_EXAMPLE = {
    "float": jnp.float32,
    "complex": jnp.complex64,
    "signed": jnp.int32,
    "unsigned": jnp.uint32,
    "bool": jnp.bool_,
}


def test_every_rule_states_its_domain():
    """The documented domain of each registered rule (a widened one fails here)."""
    got = {p.name: set(r.kinds) for p, r in _primitive_rules.registered().items()}
    assert got == DOMAINS


@pytest.mark.parametrize("prim", sorted(DOMAINS))
def test_a_rule_is_never_applied_outside_its_domain(prim):
    rule = next(r for p, r in _primitive_rules.registered().items() if p.name == prim)
    if rule.check is not None:  # its check needs the equation's params: covered by programs
        return
    for kind, dtype in _EXAMPLE.items():
        aval = jax.ShapeDtypeStruct((3,), dtype)
        reason = rule.why_not({}, [aval, aval], (0,))
        assert (reason is None) == (kind in DOMAINS[prim]), (kind, reason)


def test_an_integer_factor_must_be_an_odd_constant():
    def f(x, k, c):
        return x * jnp.sin(k.astype(jnp.float32)), k * c

    x, k = jnp.linspace(0.5, 1.5, 3), jnp.array(7, jnp.int32)
    report = rn.inversion_report(f, x, k, jnp.int32(3))  # a traced factor, even if odd
    assert [n for n, _ in report.stored_inputs] == ["args[1]"], str(report)  # k kept, not rebuilt
    rule = _primitive_rules.lookup(jax.extend.core.primitives.mul_p)
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    assert rule.outside_domain([i32, np.int32(3)], (0,)) is None
    assert "odd constant" in rule.outside_domain([i32, np.int32(4)], (0,))
    assert "odd constant" in rule.outside_domain([i32, i32], (0,))
