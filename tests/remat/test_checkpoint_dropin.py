"""rn.checkpoint is a drop-in for jax.checkpoint: the same parameters, and for every function,
argument form and policy the same values, gradients, saved residuals and program; except that a
name policy naming an activation the function never tags is a PlanError (JAX saves nothing).

"The same program" is the jaxpr of the gradient, printed: it carries the remat equation's policy
and ``prevent_cse``, which values and residuals alone do not show. Where jax.checkpoint 0.10.2
does not apply an option (``static_argnames`` without ``jax_remat3``; a ``static_argnums``
argument passed by keyword, jax#18405) the reference is jax.checkpoint of the function with that
argument bound by ``functools.partial``, which is what a static argument means.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import remat_nn as rn
from remat_nn import nn
from tests.gradients import rel_err

cp = jax.checkpoint_policies


# --- functions under test -------------------------------------------------------------------------


def mlp(x, w1, w2):
    h = checkpoint_name(jnp.tanh(x @ w1), "h")  # (B, H)
    return jnp.sum(checkpoint_name(jnp.sin(h) @ w2, "out") ** 2)  # (B, D) -> ()


def batched(x, w):
    # A dot with a batch dimension next to one without: dots_with_no_batch_dims tells them apart.
    a = jnp.einsum("bij,bjk->bik", x, x)  # (B, D, D), batch dims
    return jnp.sum(jnp.cos(a @ w))  # (B, D, D) @ (D, D): no batch dims


def gated(x, scale, w, act="tanh"):
    # `scale` and `act` drive Python control flow: they must be static.
    y = x @ w
    y = jnp.tanh(y) if act == "tanh" else jax.nn.relu(y)
    return jnp.sum(jnp.sin(y) * 2.0) if scale > 1 else jnp.sum(jnp.sin(y))


def tree_fn(params, x, *, train):
    h = checkpoint_name(jnp.tanh(x @ params["w"] + params["b"]), "h")
    return jnp.sum(jnp.sin(h) * (0.5 if train else 1.0))


KEY = jax.random.key(0)
k1, k2, k3 = jax.random.split(KEY, 3)
X = jax.random.normal(k1, (3, 4))
W1 = jax.random.normal(k2, (4, 5)) / 2
W2 = jax.random.normal(k3, (5, 4)) / 2
XB = jax.random.normal(k1, (2, 4, 4)) / 2
W = jax.random.normal(k2, (4, 4)) / 2
PARAMS = {"w": W, "b": jnp.linspace(-1.0, 1.0, 4).reshape(1, 4)}

POLICIES = {
    "default": None,
    "nothing_saveable": cp.nothing_saveable,
    "everything_saveable": cp.everything_saveable,
    "dots_saveable": cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
    "save_only_these_names": cp.save_only_these_names("h"),
    "save_any_names_but_these": cp.save_any_names_but_these("h"),
    "save_from_both_policies": cp.save_from_both_policies(
        cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names("h")
    ),
}
# The policies whose names rn.checkpoint checks against the function (save_from_both_policies
# with a policy that is not about names goes unchecked).
NAME_LISTS = {"save_only_these_names", "save_any_names_but_these"}
# What JAX's new remat (`jax_remat3`) applies; rn.checkpoint refuses the others under that flag
# (PolicyError, tested in test_remat.py) where jax.checkpoint would silently recompute everything.
REMAT3_POLICIES = {
    "default",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "save_only_these_names",
    "save_any_names_but_these",
}


# --- how two remat'd functions are compared -------------------------------------------------------


def _residuals(fn, *args) -> str:
    # Called through one (*args) signature: under jax_remat3 jax.checkpoint returns a bare
    # partial whose arguments print as args[i], where rn.checkpoint keeps fun's names.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda *args: fn(*args), *args)
    return out.getvalue()


def _grad_program(fn, *args) -> str:
    return str(jax.make_jaxpr(jax.grad(fn, argnums=tuple(range(len(args)))))(*args))


def assert_same(ours, theirs, *args):
    """Same value, gradient, saved residuals and gradient program (``ours`` / ``theirs`` take
    the differentiated arguments only)."""
    v1, g1 = jax.value_and_grad(ours, argnums=tuple(range(len(args))))(*args)
    v2, g2 = jax.value_and_grad(theirs, argnums=tuple(range(len(args))))(*args)
    assert rel_err(v1, v2) <= 1e-6 and rel_err(g1, g2) <= 1e-6, (rel_err(v1, v2), rel_err(g1, g2))
    res1, res2 = _residuals(ours, *args), _residuals(theirs, *args)
    assert res1 == res2, f"ours:\n{res1}\njax:\n{res2}"
    prog1, prog2 = _grad_program(ours, *args), _grad_program(theirs, *args)
    assert prog1 == prog2, f"ours:\n{prog1}\njax:\n{prog2}"


# --- the signature -------------------------------------------------------------------------------


def test_signature_is_jax_checkpoints():
    # Names, order, kinds and defaults: a keyword a new JAX adds (or renames) fails here.
    ours = inspect.signature(rn.checkpoint).parameters
    theirs = inspect.signature(jax.checkpoint).parameters
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        q = ours[name]
        assert q.kind == p.kind, name
        same = q.default == p.default or type(q.default) is type(p.default)  # sentinel objects
        assert same, (name, q.default, p.default)


# A non-default value per jax.checkpoint keyword; a keyword missing here fails the test below.
SAMPLE_KEYWORDS = {
    "prevent_cse": (False, True),
    "policy": cp.dots_saveable,
    "static_argnums": (1,),
    "static_argnames": ("act",),
}


def test_every_jax_keyword_is_accepted_with_jaxs_meaning():
    keywords = [
        n
        for n, p in inspect.signature(jax.checkpoint).parameters.items()
        if p.kind is p.KEYWORD_ONLY and n != "concrete"  # concrete: removed, raises (see errors)
    ]
    assert sorted(keywords) == sorted(SAMPLE_KEYWORDS), "a new jax.checkpoint keyword"
    ours = rn.checkpoint(gated, **SAMPLE_KEYWORDS)
    ref = jax.checkpoint(
        functools.partial(gated, act="relu"),
        prevent_cse=(False, True),
        policy=cp.dots_saveable,
        static_argnums=(1,),
    )
    assert_same(lambda x, w: ours(x, 2.0, w, act="relu"), lambda x, w: ref(x, 2.0, w), X, W)


def test_used_as_jax_checkpoint_is_used():
    @rn.checkpoint
    def bare(x, w1, w2):
        return mlp(x, w1, w2)

    @functools.partial(rn.checkpoint, policy=cp.dots_saveable, prevent_cse=False)
    def configured(x, w1, w2):
        return mlp(x, w1, w2)

    assert bare.__name__ == "bare" and configured.__name__ == "configured"
    assert_same(bare, jax.checkpoint(mlp), X, W1, W2)
    ref = jax.checkpoint(mlp, policy=cp.dots_saveable, prevent_cse=False)
    assert_same(configured, ref, X, W1, W2)
    assert_same(rn.checkpoint(fun=mlp), jax.checkpoint(fun=mlp), X, W1, W2)
    # Like jax.checkpoint, a call without `fun` is an error, not a decorator factory.
    for transform in (jax.checkpoint, rn.checkpoint):
        with pytest.raises(TypeError, match="missing 1 required positional argument: 'fun'"):
            transform(policy=cp.dots_saveable)


# --- policies ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_match_jax(name, jax_upgrade_flags):
    if jax_upgrade_flags != "default" and name not in REMAT3_POLICIES:
        pytest.skip("jax_remat3 ignores this policy; rn.checkpoint raises (test_remat.py)")
    policy = POLICIES[name]
    for fn, args in ((mlp, (X, W1, W2)), (batched, (XB, W))):
        if fn is batched and name in NAME_LISTS:  # `batched` tags no "h": the one difference
            with pytest.raises(rn.PlanError, match=r"\['h'\] never occur in batched"):
                rn.checkpoint(fn, policy=policy)(*args)
            continue
        assert_same(rn.checkpoint(fn, policy=policy), jax.checkpoint(fn, policy=policy), *args)


@pytest.mark.parametrize("name", ["nothing_saveable", "dots_saveable", "everything_saveable"])
def test_policy_names_mean_jaxs_policies(name):
    assert_same(
        rn.checkpoint(batched, policy=name),
        jax.checkpoint(batched, policy=POLICIES[name]),
        XB,
        W,
    )


def test_policies_save_different_residuals():
    # The negative control of the comparisons above: they see a change of policy.
    saved = {
        name: _residuals(jax.checkpoint(mlp, policy=p), X, W1, W2) for name, p in POLICIES.items()
    }
    assert saved["nothing_saveable"] != saved["dots_saveable"] != saved["save_only_these_names"]
    assert saved["save_only_these_names"] != saved["save_any_names_but_these"]


# --- prevent_cse ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prevent_cse, call",
    [
        (True, lambda g, x, w: g(x, w)),
        (False, lambda g, x, w: g(x, w)),
        ((True, False), lambda g, x, w: g(x, w)),
        ([False, True], lambda g, x, w: g(x, w)),
        (({"w": True, "b": False}, False), lambda g, x, w: g({"w": w, "b": x[:1]}, x)),
        # With keyword arguments JAX's prefix is (positional tuple, keyword dict).
        (((False,), {"w": True}), lambda g, x, w: g(x, w=w)),
    ],
    ids=["true", "false", "tuple", "list", "pytree", "keywords"],
)
def test_prevent_cse_forms_match_jax(prevent_cse, call, jax_upgrade_flags):
    def fn(a, w):
        if isinstance(a, dict):
            return jnp.sum(jnp.sin(jnp.tanh(w @ a["w"]) + a["b"]))
        return jnp.sum(jnp.sin(jnp.tanh(a @ w)))

    ours = rn.checkpoint(fn, prevent_cse=prevent_cse)
    theirs = jax.checkpoint(fn, prevent_cse=prevent_cse)
    assert_same(lambda x, w: call(ours, x, w), lambda x, w: call(theirs, x, w), X, W)


def test_prevent_cse_is_seen_by_the_comparison():
    # The negative control: the gradient program shows prevent_cse (values and residuals do not).
    progs = {p: _grad_program(jax.checkpoint(mlp, prevent_cse=p), X, W1, W2) for p in (True, False)}
    assert progs[True] != progs[False]
    per_arg = _grad_program(jax.checkpoint(mlp, prevent_cse=(True, False, True)), X, W1, W2)
    assert per_arg not in progs.values()


def test_prevent_cse_counts_dynamic_arguments_only():
    # As in jax.checkpoint: with a static argument, the per-argument prevent_cse skips it.
    ours = rn.checkpoint(gated, static_argnums=(1, 3), prevent_cse=(False, True))
    theirs = jax.checkpoint(gated, static_argnums=(1, 3), prevent_cse=(False, True))
    assert_same(lambda x, w: ours(x, 2.0, w, "relu"), lambda x, w: theirs(x, 2.0, w, "relu"), X, W)


# --- static arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("static_argnums", [(1, 3), (3, 1), (-3, -1), [1, 3], (1, -1)])
def test_positional_static_argnums_match_jax(static_argnums, jax_upgrade_flags):
    ours = rn.checkpoint(gated, static_argnums=static_argnums, policy=cp.dots_saveable)
    nums = tuple(static_argnums)  # jax.checkpoint 0.10.2 takes a tuple (a list fails at call)
    theirs = jax.checkpoint(gated, static_argnums=nums, policy=cp.dots_saveable)
    for scale, act in ((2.0, "tanh"), (0.5, "relu")):
        assert_same(
            lambda x, w: ours(x, scale, w, act),  # noqa: B023 (used in this iteration)
            lambda x, w: theirs(x, scale, w, act),  # noqa: B023
            X,
            W,
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"static_argnames": ("scale", "act")},
        {"static_argnames": "act", "static_argnums": 1},
        {"static_argnums": (1, 3)},  # static_argnums passed by keyword: jax#18405
    ],
    ids=["names", "name+num", "nums"],
)
@pytest.mark.parametrize(
    "call, call_bound",
    [
        (lambda g, x, w: g(x, 2.0, w, act="relu"), lambda g, x, w: g(x, w)),
        (lambda g, x, w: g(x, scale=2.0, w=w, act="relu"), lambda g, x, w: g(x, w=w)),
        (lambda g, x, w: g(x, 2.0, w, "relu"), lambda g, x, w: g(x, w)),
        (lambda g, x, w: g(x=x, w=w, act="relu", scale=2.0), lambda g, x, w: g(x=x, w=w)),
    ],
    ids=["act-by-name", "all-by-name", "positional", "keywords-only"],
)
def test_static_arguments_however_passed(kwargs, call, call_bound, jax_upgrade_flags):
    # call_bound: the same call without the static arguments (JAX orders keyword arguments
    # after positional ones, so the dynamic ones are passed the same way).
    ours = rn.checkpoint(gated, policy=cp.dots_saveable, **kwargs)
    theirs = jax.checkpoint(lambda x, w: gated(x, 2.0, w, act="relu"), policy=cp.dots_saveable)
    assert_same(lambda x, w: call(ours, x, w), lambda x, w: call_bound(theirs, x, w), X, W)


def test_negative_static_argnums_count_the_positional_arguments_of_the_call(jax_upgrade_flags):
    # As in jax.checkpoint: -2 is the second-to-last argument passed by position (`scale`
    # here), also when a static argument passed by keyword (`act`) comes after it.
    ours = rn.checkpoint(gated, static_argnums=-2, static_argnames="act")
    theirs = jax.checkpoint(lambda x, w: gated(x, 2.0, w, act="relu"))
    assert_same(lambda x, w: ours(x, 2.0, w, act="relu"), theirs, X, W)


def test_static_argnames_by_keyword_match_jax(jax_upgrade_flags):
    # JAX applies static_argnames under jax_remat3 and ignores it without (next test): there the
    # reference binds the value before remat.
    policy = cp.save_only_these_names("h")
    ours = rn.checkpoint(tree_fn, static_argnames="train", policy=policy)
    for train in (True, False):
        if jax_upgrade_flags == "default":
            theirs = jax.checkpoint(functools.partial(tree_fn, train=train), policy=policy)
        else:
            theirs = functools.partial(
                jax.checkpoint(tree_fn, static_argnames="train", policy=policy), train=train
            )
        assert_same(lambda p, x: ours(p, x, train=train), theirs, PARAMS, X)  # noqa: B023


def test_jax_ignores_static_argnames_without_remat3():
    # Why rn.checkpoint moves static keywords itself: JAX 0.10.2 traces them (if this starts
    # failing, JAX applies static_argnames on its own and the workaround can go).
    def gate(x, flag=False):
        return x * 2 if flag else x

    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.grad(jax.checkpoint(gate, static_argnames="flag"))(1.0, flag=True)
    assert jax.grad(rn.checkpoint(gate, static_argnames="flag"))(1.0, flag=True) == 2.0


def test_static_arguments_trace_once_per_value():
    # Hashable static values are cached by value, as jax.checkpoint caches static_argnums.
    def count_traces(transform, call):
        traces = []

        def fn(x, scale):  # a new function each time: JAX's trace cache is keyed on it
            traces.append(scale)
            return x * scale

        g = transform(fn)
        for scale in (2.0, 2.0, 3.0, 2.0):
            call(g, scale)
        return traces

    jax_traces = count_traces(lambda f: jax.checkpoint(f, static_argnums=1), lambda g, s: g(X, s))
    assert jax_traces == [2.0, 3.0]
    by_position = count_traces(lambda f: rn.checkpoint(f, static_argnums=1), lambda g, s: g(X, s))
    by_name = count_traces(
        lambda f: rn.checkpoint(f, static_argnames="scale"), lambda g, s: g(X, scale=s)
    )
    assert by_position == by_name == jax_traces


def test_traced_value_as_a_static_argument_matches_jax():
    # jax.checkpoint closes over a tracer given as a static argument; so does rn.checkpoint.
    def fn(x, s):
        return jnp.sum(jnp.sin(x) * s)

    ours = rn.checkpoint(fn, static_argnames="s")
    theirs = jax.checkpoint(fn, static_argnums=1)
    assert_same(lambda x, s: ours(x, s=s), lambda x, s: theirs(x, s), X, jnp.float32(3.0))


# --- plans and names, through the same comparison -------------------------------------------------


def test_plan_is_the_name_policy_it_compiles_to(jax_upgrade_flags):
    # A plan of names is jax.checkpoint with the name list (rn.policy's own plan policy
    # under the default flags; SaveOnlyTheseNames under jax_remat3): same residuals.
    ours = rn.checkpoint(mlp, policy="save=h")
    theirs = jax.checkpoint(mlp, policy=cp.save_only_these_names("h"))
    assert _residuals(ours, X, W1, W2) == _residuals(theirs, X, W1, W2)
    v1, g1 = jax.value_and_grad(ours, argnums=(0, 1, 2))(X, W1, W2)
    v2, g2 = jax.value_and_grad(theirs, argnums=(0, 1, 2))(X, W1, W2)
    assert rel_err(v1, v2) <= 1e-6 and rel_err(g1, g2) <= 1e-6


# --- nn.checkpoint -------------------------------------------------------------------------------


def test_nn_checkpoint_is_nn_remat_as_in_flax():
    # flax.linen.checkpoint is flax.linen.remat (the Module transform); so is remat_nn.nn's.
    assert fnn.checkpoint is fnn.remat
    assert nn.checkpoint is nn.remat
    assert rn.checkpoint is not nn.checkpoint  # the pure-JAX function is rn.checkpoint

    class Block(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return jnp.sum(jnp.tanh(fnn.Dense(4)(x)))

    ours, theirs = nn.checkpoint(Block)(), fnn.checkpoint(Block)()
    v = theirs.init(KEY, X)
    assert jax.tree.structure(ours.init(KEY, X)) == jax.tree.structure(v)
    assert_same(
        lambda p: ours.apply({"params": p}, X),
        lambda p: theirs.apply({"params": p}, X),
        v["params"],
    )
