"""rn.invertible / rn.custom_ivjp / rn.register_inverse / rn.inversion_report.

Guarantees tested (STYLE.md habit 10): gradients equal plain autodiff (depth 64, pytrees, argnums,
jit, vmap, scan, checkpoint, closures), residuals and compiled temp memory flat in depth, clear
errors naming the primitive and the source line, custom rules actually used.

Run: python -m pytest tests/test_invertible.py -q -p no:xdist
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.ad_checkpoint import saved_residuals
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

import remat_nn as rn
from remat_nn import _inverse_rules

D, B = 16, 32  # width of one half, batch: small, so depth-64 compiles stay quick on 2 cores
FILE = "test_invertible.py"


# --- helpers ------------------------------------------------------------------------------------


def rel_err(got, want) -> float:
    """Max over leaves of max|got - want| / max|want|."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    return max(
        float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-30))
        for g, w in zip(got, want, strict=True)
    )


def sin_loss(f):
    """A loss with a non-trivial cotangent for every output leaf."""
    return lambda *a, **k: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(f(*a, **k)))


def grads(f, *args, argnums=0, jit=False, **kw):
    """(gradient through rn.invertible(f), gradient by plain autodiff)."""
    g_inv = jax.grad(sin_loss(rn.invertible(f, **kw)), argnums=argnums)
    g_ref = jax.grad(sin_loss(f), argnums=argnums)
    if jit:
        g_inv, g_ref = jax.jit(g_inv), jax.jit(g_ref)
    return g_inv(*args), g_ref(*args)


def stack(x1, x2, ws):
    """N additive couplings, unrolled: ws is a list of 2N (D, D) weights."""
    for i in range(len(ws) // 2):
        x1 = x1 + jnp.tanh(x2 @ ws[2 * i])
        x2 = x2 + jnp.tanh(x1 @ ws[2 * i + 1])
    return x1, x2


def stacked_weights(x1, x2, w):
    """Same stack, weights as one (2N, D, D) array."""
    for i in range(w.shape[0] // 2):
        x1 = x1 + jnp.tanh(x2 @ w[2 * i])
        x2 = x2 + jnp.tanh(x1 @ w[2 * i + 1])
    return x1, x2


def make_stack(n, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    # 0.1 / sqrt(D): every F(x) is a small update, so activations stay O(1) over 64 layers.
    w = 0.1 * jax.random.normal(k[0], (2 * n, D, D)) / np.sqrt(D)
    return jax.random.normal(k[1], (B, D)), jax.random.normal(k[2], (B, D)), list(w)


def coupling(p, w):
    """One coupling on a dict pytree, weights in a dict."""
    y1 = p["a"] + jnp.tanh(p["b"] @ w["f"])
    y2 = p["b"] + jnp.tanh(y1 @ w["g"])
    return {"a": y1, "b": y2}


@pytest.fixture(scope="module")
def small():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(k[0], (4, 8))
    w = {"f": 0.3 * jax.random.normal(k[1], (8, 8)), "g": 0.3 * jax.random.normal(k[2], (8, 8))}
    return {"a": x, "b": jax.random.normal(k[3], (4, 8))}, w


@pytest.fixture(scope="module")
def compiled_stacks():
    """jit(grad) of the N-layer stack, invertible and plain, for N = 8 and 64 (compiled once)."""
    out = {}
    for n in (8, 64):
        args = make_stack(n)
        for name, f in (("invertible", rn.invertible(stack)), ("plain", stack)):
            grad = jax.jit(jax.grad(sin_loss(f), argnums=(0, 1, 2)))
            out[name, n] = (grad.lower(*args).compile(), args)
    return out


# --- gradients equal plain autodiff -----------------------------------------------------------


def test_depth_64_gradients_match_autodiff(compiled_stacks):
    (inv, args), (plain, _) = compiled_stacks["invertible", 64], compiled_stacks["plain", 64]
    err = rel_err(inv(*args), plain(*args))
    print(f"depth 64 float32 gradient rel err: {err:.2e}")
    assert err < 1e-5


def test_values_unchanged(small):
    p, w = small
    got, want = rn.invertible(coupling)(p, w), coupling(p, w)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert rel_err(got, want) == 0.0


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_pytrees_and_argnums(small, argnums):
    g_inv, g_ref = grads(coupling, *small, argnums=argnums)
    assert rel_err(g_inv, g_ref) < 1e-5


def test_jit(small):
    g_inv, g_ref = grads(coupling, *small, argnums=(0, 1), jit=True)
    assert rel_err(g_inv, g_ref) < 1e-5


def test_vmap(small):
    p, w = small
    batched = jax.tree.map(lambda a: jnp.stack([a, 2 * a, -a]), p)

    def per_example(f):
        return lambda p, w: jax.vmap(f, in_axes=(0, None))(p, w)

    g_inv = jax.grad(sin_loss(per_example(rn.invertible(coupling))), argnums=(0, 1))(batched, w)
    g_ref = jax.grad(sin_loss(per_example(coupling)), argnums=(0, 1))(batched, w)
    assert rel_err(g_inv, g_ref) < 1e-5


def _over_layers(layer):
    return lambda p, ws: lax.scan(lambda c, w: (layer(c, w), None), p, ws)[0]


def test_inside_lax_scan(small):
    p, w = small
    ws = jax.tree.map(lambda a: jnp.stack([a, -a, 0.5 * a]), w)
    loss_inv = sin_loss(_over_layers(rn.invertible(coupling)))
    g_inv = jax.jit(jax.grad(loss_inv, argnums=(0, 1)))(p, ws)
    g_ref = jax.grad(sin_loss(_over_layers(coupling)), argnums=(0, 1))(p, ws)
    assert rel_err(g_inv, g_ref) < 1e-5


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_of_invertible_body(small, reverse):
    p, w = small
    ws = jax.tree.map(lambda a: jnp.stack([a, -a, 0.5 * a, a]), w)

    def f(p, ws):  # carry reconstructed per iteration; ys are outputs too
        return lax.scan(lambda c, w: (coupling(c, w), 2.0 * c["a"]), p, ws, reverse=reverse)

    g_inv, g_ref = grads(f, p, ws, argnums=(0, 1))
    assert rel_err(g_inv, g_ref) < 1e-5
    report = rn.inversion_report(f, p, ws)
    assert [e.path for e in report.entries if e.primitive == "scan"] == ["inverted"]
    assert report.stored_inputs == (("args[1]['f']", "f32[4,8,8]"), ("args[1]['g']", "f32[4,8,8]"))


def test_scan_of_invertible_body_memory_flat_in_length():
    def temp(f, length):
        p = {"a": jnp.ones((B, D)), "b": jnp.ones((B, D))}
        ws = {"f": 0.01 * jnp.ones((length, D, D)), "g": -0.01 * jnp.ones((length, D, D))}
        lowered = jax.jit(jax.grad(sin_loss(f), argnums=(0, 1))).lower(p, ws)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    inv, plain = rn.invertible(_over_layers(coupling)), _over_layers(coupling)
    sizes = {(name, n): temp(f, n) for name, f in (("inv", inv), ("plain", plain)) for n in (8, 64)}
    print("scan temp bytes:", sizes)
    assert sizes["inv", 64] == sizes["inv", 8]
    assert sizes["plain", 64] > sizes["plain", 8]


def test_checkpoint_composes(small):
    p, w = small
    g_ref = jax.grad(sin_loss(coupling), argnums=(0, 1))(p, w)
    outside = jax.grad(sin_loss(jax.checkpoint(rn.invertible(coupling))), argnums=(0, 1))(p, w)
    inside = jax.grad(sin_loss(rn.invertible(jax.checkpoint(coupling))), argnums=(0, 1))(p, w)
    jitted_inside = grads(lambda p, w: jax.jit(coupling)(p, w), p, w, argnums=(0, 1))[0]
    for g in (outside, inside, jitted_inside):
        assert rel_err(g, g_ref) < 1e-5


def test_closed_over_arrays_get_gradients(small):
    p, w = small

    def loss(f_of_w, w):
        return sin_loss(f_of_w(w))(p)

    def layer_closing_over(w):  # w is a tracer of the outer grad: hoisted, differentiated
        return lambda p: coupling(p, w)

    g_inv = jax.grad(loss, argnums=1)(lambda w: rn.invertible(layer_closing_over(w)), w)
    g_ref = jax.grad(loss, argnums=1)(layer_closing_over, w)
    assert rel_err(g_inv, g_ref) < 1e-5
    # closing over concrete arrays: gradients w.r.t. the inputs still match
    g_inv, g_ref = grads(lambda p: coupling(p, w), p)
    assert rel_err(g_inv, g_ref) < 1e-5


def test_int_kwargs_and_static_inputs(small):
    p, _ = small

    def f(x, n, *, scale, mode="add"):
        assert mode == "add"  # a static (non-array) leaf stays a Python value
        return x * n.astype(jnp.float32) + jnp.tanh(scale)[None]

    kw = {"scale": jnp.ones(8), "mode": "add"}
    g_inv, g_ref = grads(functools.partial(f, **kw), p["a"], jnp.int32(3))
    assert rel_err(g_inv, g_ref) < 1e-6
    g_inv = jax.grad(lambda s: jnp.sum(rn.invertible(f)(p["a"], jnp.int32(3), scale=s)))(
        kw["scale"]
    )
    g_ref = jax.grad(lambda s: jnp.sum(f(p["a"], jnp.int32(3), scale=s)))(kw["scale"])
    assert rel_err(g_inv, g_ref) < 1e-6


# --- every inverse rule -------------------------------------------------------------------------


@jax.custom_jvp
def _affine_custom_jvp(x):
    return 2.0 * x + 1.0


_affine_custom_jvp.defjvp(lambda p, t: (_affine_custom_jvp(p[0]), 2.0 * t[0]))


@jax.custom_vjp
def _affine_custom_vjp(x):
    return 3.0 * x - 1.0


_affine_custom_vjp.defvjp(lambda x: (_affine_custom_vjp(x), None), lambda _, ct: (3.0 * ct,))

_S = jnp.linspace(0.5, 1.5, 8)  # a known operand (closed-over constant)
RULE_CASES = {
    "add_sub_neg": lambda x: (1.0 - (-(x + _S[None]) - 2.0),),
    "mul_div": lambda x: (x * _S[None] / 3.0, 2.0 / (1.0 + jnp.exp(x))),
    "exp_log": lambda x: (jnp.log(jnp.exp(x) + 2.0),),
    "expm1_log1p": lambda x: (jnp.log1p(jnp.expm1(x) + 2.0),),
    "sqrt_cbrt_sinh": lambda x: (jnp.sqrt(jnp.exp(x)), jnp.cbrt(x) + jnp.sinh(x)),
    "reshape_transpose": lambda x: (x.reshape(2, 2, 8).transpose(2, 0, 1) + 1.0,),
    "squeeze_expand_dims": lambda x: (jnp.squeeze(jnp.expand_dims(x, 0) + 1.0, 0), x[None] * 2.0),
    "broadcast": lambda x: (jnp.broadcast_to(x[:, None, :], (4, 3, 8)) * 2.0,),
    "convert_widening": lambda x: (x.astype(jnp.float32) * 2.0,),  # x is bfloat16
    "concatenate_split": lambda x: tuple(
        jnp.exp(a) for a in jnp.split(jnp.concatenate([x, 2.0 * x], axis=1), 4, axis=1)
    ),
    "copy_rev_pad_name": lambda x: (
        jnp.pad(jnp.flip(rn.name(jnp.array(x, copy=True), "mlp_in"), 1), ((1, 2), (0, 1))) + 1.0,
    ),
    "custom_jvp_custom_vjp": lambda x: (_affine_custom_vjp(_affine_custom_jvp(x)),),
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_inverse_rules(case):
    f = RULE_CASES[case]
    x = jax.random.uniform(jax.random.PRNGKey(3), (4, 8), minval=0.2, maxval=1.0)
    if case == "convert_widening":
        x = x.astype(jnp.bfloat16)
    report = rn.inversion_report(f, x)
    assert report.invertible, str(report)
    assert "inverted" in report.counts
    assert [n for n, _ in report.stored_inputs if n.startswith("args")] == []  # x: rebuilt
    g_inv, g_ref = grads(f, x)
    assert rel_err(g_inv, g_ref) < 1e-5


def test_actnorm_with_logdet_stores_only_parameters(small):
    x = small[0]["a"]

    def actnorm(x, logs, b):  # Glow's actnorm: y = x * exp(logs) + b, with its log-determinant
        return x * jnp.exp(logs)[None] + b[None], 4.0 * jnp.sum(logs)

    args = (x, 0.1 * jnp.ones(8), jnp.ones(8))
    report = rn.inversion_report(actnorm, *args)
    assert report.invertible
    assert [n for n, _ in report.stored_inputs] == ["args[1]", "args[2]"]
    g_inv, g_ref = grads(actnorm, *args, argnums=(0, 1, 2))
    assert rel_err(g_inv, g_ref) < 1e-5


# --- memory: flat in depth ----------------------------------------------------------------------


def _non_argument_residuals(f, *args):
    return [src for _, src in saved_residuals(f, *args) if "from the argument" not in src]


def test_residuals_do_not_grow_with_depth():
    counts = {}
    for n in (8, 64):
        x1, x2, ws = make_stack(n)
        loss = sin_loss(rn.invertible(stack))
        counts["non-argument", n] = len(_non_argument_residuals(loss, x1, x2, ws))
        loss = sin_loss(rn.invertible(stacked_weights))
        counts["all, stacked weights", n] = len(saved_residuals(loss, x1, x2, jnp.stack(ws)))
        counts["plain", n] = len(_non_argument_residuals(sin_loss(stack), x1, x2, ws))
    print("residual counts:", counts)
    assert counts["non-argument", 8] == counts["non-argument", 64]
    assert counts["all, stacked weights", 8] == counts["all, stacked weights", 64]
    assert counts["plain", 64] > counts["plain", 8]  # the baseline does grow


def test_compiled_temp_memory_slope(compiled_stacks):
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, (c, _) in compiled_stacks.items()}
    slope = {name: (temp[name, 64] - temp[name, 8]) / 56 for name in ("invertible", "plain")}
    print(f"temp bytes: {temp}; per-layer slopes: {slope}")
    assert slope["plain"] > 0
    assert slope["invertible"] <= slope["plain"] / 4


# --- errors ---------------------------------------------------------------------------------------


def _sin_on_path(x):
    return jnp.sin(x) + 1.0


def _square(x):
    return x * x


def _resnet(x, w):
    return x + jnp.tanh(x @ w)


def _narrowing(x):
    return x.astype(jnp.bfloat16)


@pytest.mark.parametrize(
    "f, prim, args",
    [
        (_sin_on_path, "sin", (jnp.ones(3),)),
        (_square, "mul", (jnp.ones(3),)),
        (_resnet, "add", (jnp.ones((2, 3)), jnp.eye(3))),
        (_narrowing, "convert_element_type", (jnp.ones(3),)),
    ],
)
def test_not_invertible_names_primitive_and_line(f, prim, args):
    line = f.__code__.co_firstlineno + 1
    with pytest.raises(rn.NotInvertibleError) as info:
        jax.grad(lambda *a: jnp.sum(rn.invertible(f)(*a).astype(jnp.float32)))(*args)
    msg = str(info.value)
    assert f"`{prim}`" in msg and f"{FILE}:{line}" in msg, msg
    assert "custom_ivjp" in msg and 'fallback="recompute"' in msg


def test_not_invertible_inside_scan_body_names_inner_primitive():
    def f(x):
        return lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=3)[0]

    with pytest.raises(rn.NotInvertibleError, match=r"`scan`.*body.*`sin`"):
        rn.invertible(f)(jnp.ones(3))


def test_bad_arguments():
    with pytest.raises(ValueError, match="fallback"):
        rn.invertible(stack, fallback="store")
    with pytest.raises(TypeError, match="callable"):
        rn.invertible(3)
    with pytest.raises(TypeError, match="defivjp"):
        rn.custom_ivjp(lambda x: x)(jnp.ones(2))
    with pytest.raises(TypeError, match="Primitive"):
        rn.register_inverse("exp", lambda i, o: i)


# --- fallback="recompute" and inversion_report -------------------------------------------------


def _one_bad_op(x1, x2, w):
    y1 = x1 + jnp.tanh(x2 @ w)
    z = jnp.sin(y1)  # not invertible: y1 is stored by the fallback, the rest inverted
    y2 = x2 + jnp.tanh(z @ w)
    return 2.0 * z, y2


def test_fallback_recompute_matches_autodiff(small):
    p, w = small
    args = (p["a"], p["b"], w["f"])
    with pytest.raises(rn.NotInvertibleError, match="`sin`"):
        rn.invertible(_one_bad_op)(*args)
    report = rn.inversion_report(_one_bad_op, *args)
    assert not report.invertible
    assert [e.primitive for e in report.entries if e.path == "stored"] == ["sin"]
    assert [s for s, _ in report.stored_values] == ["f32[4,8]"]
    # y1 is stored; z = sin(y1) and 2 * z are recomputed from it; x1 and x2 are inverted
    assert report.counts == {"inverted": 2, "recomputed": 5, "stored": 1}
    for jit in (False, True):
        g_inv, g_ref = grads(_one_bad_op, *args, argnums=(0, 1, 2), jit=jit, fallback="recompute")
        assert rel_err(g_inv, g_ref) < 1e-5


def test_inversion_report_is_readable(small):
    p, w = small
    text = str(rn.inversion_report(rn.invertible(_one_bad_op), p["a"], p["b"], w["f"]))
    print(text)
    assert text.startswith("rn.inversion_report: 8 equations;")
    for word in ("inverted", "recomputed", "stored", "sin", f"{FILE}:", "stored inputs"):
        assert word in text


# --- custom_ivjp ------------------------------------------------------------------------------


def _half_coupling(x1, x2, w):
    return x1 + jnp.tanh(x2 @ w), x2


def _make_custom(scale_cts=1.0):
    calls = []
    g = rn.custom_ivjp(_half_coupling, known_argnums=(2,))

    @g.defivjp
    def ivjp(xs, ys, dys):
        calls.append(1)
        x1, x2, w = xs
        assert x1 is None and x2 is None and w is not None  # only the weight is given
        y1, y2 = ys
        f, pullback = jax.vjp(lambda x2, w: jnp.tanh(x2 @ w), y2, w)
        xs = (y1 - f, y2, w)
        if dys is None:
            return xs, None
        dy1, dy2 = dys
        dx2, dw = pullback(dy1)
        return xs, (scale_cts * dy1, scale_cts * (dy2 + dx2), scale_cts * dw)

    return g, calls


def _two_halves(half):
    def f(x1, x2, w):
        x1, x2 = half(x1, x2, w)
        x2, x1 = half(x2, x1, w)
        return x1, x2

    return f


@pytest.mark.parametrize("jit", [False, True])
def test_custom_ivjp_standalone(small, jit):
    p, w = small
    args = (p["a"], p["b"], w["f"])
    g, calls = _make_custom()
    want = jax.grad(sin_loss(_half_coupling), argnums=(0, 1, 2))(*args)
    grad = jax.grad(sin_loss(g), argnums=(0, 1, 2))
    got = (jax.jit(grad) if jit else grad)(*args)
    assert rel_err(got, want) < 1e-6 and len(calls) == 1
    # the rule, not autodiff, gives the gradient: a rule that doubles cotangents doubles it
    doubled, _ = _make_custom(scale_cts=2.0)
    got2 = jax.grad(sin_loss(doubled), argnums=(0, 1, 2))(*args)
    assert rel_err(got2, jax.tree.map(lambda a: 2 * a, want)) < 1e-6
    # and only its outputs are saved (the weight is an argument anyway)
    residuals = [r for r in _non_argument_residuals(sin_loss(g), *args) if "output of cos" not in r]
    assert len(residuals) == 1 and "output of add" in residuals[0]  # y1 (y2 is the argument x2)


def test_custom_ivjp_vmap(small):
    p, w = small
    g, _ = _make_custom()
    got = jax.vmap(g, in_axes=(0, 0, None))(p["a"][None], p["b"][None], w["f"])
    want = jax.tree.map(lambda a: a[None], _half_coupling(p["a"], p["b"], w["f"]))
    assert rel_err(got, want) < 1e-6
    assert got[0].shape == (1, 4, 8)


def test_custom_ivjp_inside_invertible_uses_its_rule(small):
    p, w = small
    args = (p["a"], p["b"], w["f"])
    g, calls = _make_custom()
    want = jax.grad(sin_loss(_two_halves(_half_coupling)), argnums=(0, 1, 2))(*args)
    got = jax.jit(jax.grad(sin_loss(rn.invertible(_two_halves(g))), argnums=(0, 1, 2)))(*args)
    assert rel_err(got, want) < 1e-5
    assert len(calls) == 2  # one rule call per layer, traced once under jit
    report = rn.inversion_report(_two_halves(g), *args)
    assert [e.primitive for e in report.entries] == ["custom_ivjp[_half_coupling]"] * 2
    doubled, _ = _make_custom(scale_cts=2.0)
    got4 = jax.grad(sin_loss(rn.invertible(_two_halves(doubled))), argnums=0)(*args)
    assert rel_err(got4, 4 * want[0]) < 1e-5  # two layers, each doubling


# --- register_inverse ---------------------------------------------------------------------------


def _make_triple_primitive():
    p = Primitive("test_triple")
    p.def_impl(lambda x: 3.0 * x)
    p.def_abstract_eval(lambda x: x)
    ad.defjvp(p, lambda t, x: 3.0 * t)
    mlir.register_lowering(p, mlir.lower_fun(lambda x: 3.0 * x, multiple_results=False))
    return p


def test_register_inverse_extends_the_registry(small):
    triple_p = _make_triple_primitive()
    x, w = small[0]["a"], small[1]["f"]

    def f(x1, x2):
        return triple_p.bind(x1) + jnp.tanh(x2 @ w), x2

    with pytest.raises(rn.NotInvertibleError, match="`test_triple`"):
        rn.invertible(f)(x, x)
    rn.register_inverse(triple_p, lambda invals, outvals: [outvals[0] / 3.0])
    try:
        assert rn.inversion_report(f, x, x).invertible
        g_inv, g_ref = grads(f, x, 2.0 * x, argnums=(0, 1), jit=True)
        assert rel_err(g_inv, g_ref) < 1e-6
    finally:
        del _inverse_rules._RULES[triple_p]


def test_custom_ivjp_check_catches_a_wrong_user_inverse():
    x = jnp.linspace(0.5, 1.5, 4)
    good = rn.custom_ivjp(lambda x: 2.0 * x)
    good.defivjp(lambda xs, ys, dys: ((ys / 2.0,), (2.0 * dys,)))
    assert good.check(x) < 1e-6
    bad_inverse = rn.custom_ivjp(lambda x: 2.0 * x)
    bad_inverse.defivjp(lambda xs, ys, dys: ((ys / 3.0,), (2.0 * dys,)))
    with pytest.raises(rn.NotInvertibleError, match="reconstructed input leaf 0 is off"):
        bad_inverse.check(x)
    bad_cotangent = rn.custom_ivjp(lambda x: 2.0 * x)
    bad_cotangent.defivjp(lambda xs, ys, dys: ((ys / 2.0,), (dys,)))
    with pytest.raises(rn.NotInvertibleError, match="cotangent leaf 0 is off"):
        bad_cotangent.check(x)
