"""Reference models: shapes, parameter counts against the papers, remat presets (same loss and
gradients, exactly the promised residuals), reversible gradients, RematBlock, the summary CLI."""

from __future__ import annotations

import functools
import math
import re

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

import models
import remat_nn as rn
from models import resnet as rs
from models import revnet as rv
from models import summary
from models import transformer as tr
from models import transformer_layers as tl
from remat_nn import nn
from tests.gradients import random_variables, rel_err

# --- helpers ----------------------------------------------------------------------------------


def n_params(tree) -> int:
    return sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(tree))


def max_rel_err(a, b) -> float:
    """:func:`tests.gradients.rel_err`, each leaf's scale floored at 1% of the largest leaf's: a
    leaf whose exact gradient is zero (the key bias: softmax ignores it) holds only round-off."""
    return rel_err(a, b, floor=1e-2)


def named_residuals(fn, *args) -> dict[str, set[str]]:
    """action ('saved' / 'offloaded') -> activation names among the residuals of fn's VJP."""
    out: dict[str, set[str]] = {"saved": set(), "offloaded": set()}
    for r in rn.memory_report(fn, *args).residuals:
        if r.kind == "named":
            out[r.action].add(r.name)
    return out


# --- transformer ------------------------------------------------------------------------------

TINY_LM = dict(vocab_size=17, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_len=8)
DROPOUT = dict(TINY_LM, dropout=0.2)  # train mode: every preset must recompute the same masks


def lm_loss(module, tokens, *, train=False):
    # An "rbg" key: dropout bits from XLA's RngBitGenerator compile in half the time of
    # threefry on CPU; the masks are as deterministic (recomputation must reproduce them).
    rngs = {"dropout": jax.random.key(3, impl="rbg")}

    def loss(params):
        logits = module.apply({"params": params}, tokens[:, :-1], train=train, rngs=rngs)
        # logits: (B, T-1, V)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return loss


def unstack(params, n_layers):
    """Scan parameters (layer axis first under 'blocks') -> unrolled ('blocks_i')."""
    out = {k: v for k, v in params.items() if k != "blocks"}
    for i in range(n_layers):
        out[f"blocks_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
    return out


def shapes(module, x, **kw):
    """(variables, output) as ShapeDtypeStructs: traced only, nothing compiled."""
    variables = jax.eval_shape(module.init, jax.random.key(0), x)
    return variables, jax.eval_shape(lambda v, x: module.apply(v, x, **kw), variables, x)


def test_transformer_shapes_and_registry():
    assert models.get("transformer").task == "lm"
    tokens = jnp.zeros((3, 5), jnp.int32)
    out_shape = (3, 5, TINY_LM["vocab_size"])
    variables, out = shapes(models.build("transformer", **TINY_LM), tokens)
    assert out.shape == out_shape and out.dtype == jnp.float32
    blocks = variables["params"]["blocks"]
    assert blocks["attention"]["attn"]["query"]["kernel"].shape == (2, 16, 2, 8)  # (L, D, H, K)
    rot = models.build("transformer", **TINY_LM, position="rotary", scan_layers=False)
    v, out = shapes(rot, tokens)
    assert "wpe" not in v["params"] and "blocks_1" in v["params"] and out.shape == out_shape
    rev = models.build("transformer", **TINY_LM, reversible=True, dtype="bfloat16")
    v, out = shapes(rev, tokens)
    assert v["params"]["blocks"]["layers"]["g"]["fc_in"]["kernel"].shape == (2, 16, 32)
    assert out.shape == out_shape and out.dtype == jnp.float32


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"remat": "minimall"}, "minimal"),
        ({"remat": "custom"}, "custom_plan"),
        ({"d_model": 10, "n_heads": 3}, "divisible"),
        ({"n_layer": 2}, "n_layer"),
        ({"reversible": True, "remat": "minimal"}, "reversible"),
        (
            {"remat": "custom", "custom_plan": {"save": ["query_proj"], "offload": ["query_proj"]}},
            "query_proj",
        ),
    ],
)
def test_transformer_options_rejected(bad, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        models.build("transformer", **bad)


PRESETS = [*tr.REMAT_PRESETS, "custom"]
CUSTOM = {"save": ["attention_scores"], "offload": ["mlp_hidden"], "recompute": ["context"]}


def _preset_kwargs(preset):
    return {"remat": preset, "custom_plan": CUSTOM if preset == "custom" else None}


@pytest.fixture(scope="module")
def lm_data():
    """Tokens, parameters, and (loss, grads) of the scanned model under every preset.

    One jit for all presets: XLA:CPU compiles it in about the time of three separate ones.
    """
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, TINY_LM["vocab_size"])
    built = {p: models.build("transformer", **DROPOUT, **_preset_kwargs(p)) for p in PRESETS}
    params = random_variables(jax.eval_shape(built["none"].init, jax.random.key(0), tokens))
    params = params["params"]
    losses = {p: jax.value_and_grad(lm_loss(m, tokens, train=True)) for p, m in built.items()}
    results = jax.jit(lambda params: {p: f(params) for p, f in losses.items()})(params)
    return tokens, params, results


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_same_loss_and_grads_and_promised_residuals(preset, lm_data):
    tokens, params, results = lm_data
    (want_loss, want_grads), (loss, grads) = results["none"], results[preset]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert max_rel_err(grads, want_grads) < 1e-5

    # Residual names, on the unrolled model (inside a scan they are outputs of the scan).
    kw = dict(DROPOUT, scan_layers=False, **_preset_kwargs(preset))
    unrolled = lm_loss(models.build("transformer", **kw), tokens, train=True)
    got = named_residuals(unrolled, unstack(params, TINY_LM["n_layers"]))
    plan = tr.remat_plan(preset, CUSTOM if preset == "custom" else None)
    if plan is None:  # no remat: autodiff keeps the named values its backward reads
        assert got["saved"] >= {"query_proj", "key_proj", "value_proj", "context"}
    else:
        assert got == {"saved": set(plan.save), "offloaded": set(plan.offload)}, preset


def test_transformer_takes_a_plan_as_its_remat_option():
    plan = rn.plan(CUSTOM)
    m = models.build("transformer", **TINY_LM, remat=plan)
    assert m.remat is plan  # the object itself, not a copy made from its mapping
    assert m == models.build("transformer", **TINY_LM, **_preset_kwargs("custom"))
    assert models.get("transformer").remat_presets is tr.REMAT_PRESETS
    with pytest.raises(pydantic.ValidationError, match="custom_plan is only read"):
        models.build("transformer", **TINY_LM, remat=plan, custom_plan=CUSTOM)
    with pytest.raises(pydantic.ValidationError, match=r"remat=<plan save=attention_scores"):
        models.build("transformer", **TINY_LM, remat=plan, reversible=True)
    with pytest.raises(pydantic.ValidationError, match=r"1 validation error[\s\S]*remat_nn.Plan"):
        models.build("transformer", **TINY_LM, remat=3)  # one message, not one per union member


# Inside a block, the matmul outputs (dot_general) each policy keeps, by their scope in the block:
# `dots` keeps all seven (the attention einsums included), `dots_no_batch` those without batch
# dimensions (the weight matmuls).
_WEIGHT_DOTS = ["attention/attn/" + p for p in ("query", "key", "value", "out")] + ["mlp/fc_in"]
_ATTENTION_DOTS = ["attention/attn/bthk,bshk->bhts", "attention/attn/bhts,bshk->bthk"]
KEPT_DOTS = {"dots": _WEIGHT_DOTS + _ATTENTION_DOTS, "dots_no_batch": _WEIGHT_DOTS}


@pytest.mark.parametrize("policy", list(KEPT_DOTS))
def test_transformer_takes_remat_nn_policy_names(policy):
    # `remat=dots` was "unknown remat preset" on the transformer, while nn.remat and a
    # model.module took it. Now the name reaches nn.remat: the gradient is no remat's, and each
    # block saves exactly the matmul outputs the policy keeps.
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, TINY_LM["vocab_size"])
    plain = models.build("transformer", **TINY_LM, remat="none")
    params = random_variables(jax.eval_shape(plain.init, jax.random.key(0), tokens))["params"]
    module = models.build("transformer", **TINY_LM, remat=policy)
    assert module.remat == policy
    grads = [jax.jit(jax.grad(lm_loss(m, tokens)))(params) for m in (module, plain)]
    assert max_rel_err(*grads) < 1e-5
    # Residuals on the unrolled model (inside a scan they are outputs of the scan).
    unrolled = models.build("transformer", **TINY_LM, remat=policy, scan_layers=False)
    report = rn.memory_report(lm_loss(unrolled, tokens), unstack(params, TINY_LM["n_layers"]))
    inside = [
        (m.group(1), r.primitive)
        for r in report.residuals
        if (m := re.search(r"/blocks_\d+/(.+)", r.scope))
    ]
    want = [(scope, "dot_general") for scope in KEPT_DOTS[policy]] * TINY_LM["n_layers"]
    assert sorted(inside) == sorted(want)


@pytest.mark.parametrize("name", ["transformer", "resnet32", "revnet38", "nnx_revnet"])
def test_every_model_takes_the_librarys_policy_names(name):
    # One vocabulary: every name and alias rn.policy resolves without arguments is a remat
    # value of every model (a model's own preset of the same spelling, `full`, wins), as it is
    # for a model.module; a misspelling names the closest preset or policy.
    spec = models.get(name)
    policies = [n for n, e in rn.POLICIES.items() if not e.factory] + list(rn.ALIASES)
    for policy in policies:
        got = spec.options.model_validate({"remat": policy}).remat
        assert got == spec.remat_presets.get(policy, policy), policy
    assert set(models.MODULE_REMAT_PRESETS) == {"none", *policies}
    with pytest.raises(pydantic.ValidationError, match=r"unknown remat preset 'dot'\. Did you"):
        spec.options.model_validate({"remat": "dot"})


@pytest.mark.parametrize("name", ["revnet38", "revnet", "resnet32", "resnet110"])
def test_image_models_refuse_a_plan_that_would_do_nothing_naming_the_model_and_the_option(name):
    # Image models take plans on their `conv_out` activations; a name they never produce, or an
    # unknown preset, is refused at build with the model, the option and the fix named.
    assert models.build(name, remat="save_conv_out") != models.build(name, remat="none")
    with pytest.raises(pydantic.ValidationError, match=f"{name}: option remat=<plan save=x") as e:
        models.build(name, remat=rn.plan({"save": ["x"]}))
    assert "never produces" in str(e.value) and "['conv_out']" in str(e.value)
    with pytest.raises(pydantic.ValidationError, match=f"{name}: unknown remat preset 'fulll'"):
        models.build(name, remat="fulll")


@pytest.mark.parametrize("preset", ["qkv_proj_offloaded", "minimal_offloaded"])
def test_offload_presets_lower_to_host_memory(preset, lm_data):
    # The CPU run (same gradients) is in the preset test above. XLA:CPU has one memory, and
    # JAX lowers device_put to a memory kind as a no-op on CPU (jax/_src/dispatch.py registers
    # the placement annotation for tpu and gpu only), so the CPU program text carries no host
    # placement. The traced program does (device_put to MemorySpace.Host), and so does the
    # same program lowered for TPU, which jax.export can do from this CPU machine.
    tokens, params, *_ = lm_data
    loss = lm_loss(models.build("transformer", **TINY_LM, remat=preset), tokens)
    grad = jax.jit(jax.grad(loss))
    assert "MemorySpace.Host" in str(jax.make_jaxpr(grad)(params))
    text = jax.export.export(grad, platforms=["tpu"])(params).mlir_module()
    assert "annotate_device_placement" in text and "pinned_host" in text


def test_reversible_transformer_grads_equal_plain_autodiff():
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, TINY_LM["vocab_size"])
    rev = models.build("transformer", **dict(TINY_LM, n_layers=3), reversible=True, dropout=0.1)
    params = random_variables(jax.eval_shape(rev.init, jax.random.key(0), tokens))["params"]
    plain = rev.clone(reconstruct=False)
    both = jax.jit(lambda p: [jax.grad(lm_loss(m, tokens, train=True))(p) for m in (rev, plain)])
    got, want = both(params)
    assert max_rel_err(got, want) < 1e-4


def _rope_by_complex_rotation(x):
    """RoPE as RoFormer writes it (Su et al. 2021, eq. 34), independently of models.transformer:
    channel pair (j, j + K/2) is the complex number x_j + i x_{j+K/2}, multiplied at position t
    by exp(i t theta_j) with theta_j = 10000^(-j / (K/2)). x (B, T, H, K)."""
    _, t, _, k = x.shape
    half = k // 2
    z = jax.lax.complex(x[..., :half], x[..., half:])  # (B, T, H, K/2)
    theta = 10_000.0 ** (-jnp.arange(half) / half)  # (K/2,)
    turn = jnp.exp(1j * jnp.arange(t)[:, None] * theta[None, :])  # (T, K/2)
    z = z * turn[None, :, None, :].astype(z.dtype)
    return jnp.concatenate([z.real, z.imag], axis=-1)  # (B, T, H, K)


def test_rotary_positions_rotate_by_position_and_depend_only_on_offsets():
    x = jax.random.normal(jax.random.key(0), (2, 6, 2, 8))  # (B, T, H, K)
    assert rel_err(tl._rotary(x), _rope_by_complex_rotation(x)) < 1e-6
    assert rel_err(tl._rotary(x)[:, 0], x[:, 0]) == 0.0  # position 0: no rotation
    # The same query and key at every position: scores depend on s - t only.
    q = jnp.broadcast_to(x[:, :1], x.shape)
    k = jnp.broadcast_to(x[:, 1:2], x.shape)
    scores = jnp.einsum("bthk,bshk->bhts", tl._rotary(q), tl._rotary(k))  # (B, H, T, T)
    assert rel_err(scores[..., 1:, 1:], scores[..., :-1, :-1]) < 1e-5
    assert rel_err(scores[..., :, 1:], scores[..., :, :-1]) > 1e-2  # ...but on the offset


def _independent_attention(p, x, rotate=lambda q: q):
    """Causal self-attention written out in jnp, in the dtype of ``x`` throughout."""

    def proj(name):
        return jnp.einsum("btd,dhk->bthk", x, p[name]["kernel"]) + p[name]["bias"][None, None]

    q, k = rotate(proj("query")), rotate(proj("key"))  # (B, T, H, K)
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(q.shape[-1])
    t = x.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], scores, -jnp.inf)
    ctx = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, axis=-1), proj("value"))
    return jnp.einsum("bthk,hkd->btd", ctx, p["out"]["kernel"]) + p["out"]["bias"][None, None]


def test_rotary_attention_values_and_gradients_match_an_independent_computation():
    attn = tl.CausalSelfAttention(n_heads=2, rotary=True)
    x = 0.5 * jax.random.normal(jax.random.key(1), (2, 6, 16))  # (B, T, D)
    params = attn.init(jax.random.key(2), x)["params"]
    independent = lambda p, x: _independent_attention(p, x, _rope_by_complex_rotation)

    def loss(f):
        return lambda p, x: jnp.sum(jnp.sin(f(p, x)))

    ours = lambda p, x: attn.apply({"params": p}, x)
    assert rel_err(ours(params, x), independent(params, x)) < 1e-5
    got = jax.grad(loss(ours), argnums=(0, 1))(params, x)
    want = jax.grad(loss(independent), argnums=(0, 1))(params, x)
    # The key bias gets an exact gradient of 0 (softmax ignores a per-query constant) but the
    # rotation makes it position-dependent: it is a real gradient here.
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    learned = tl.CausalSelfAttention(n_heads=2, rotary=False)
    plain = jax.grad(loss(lambda p, x: learned.apply({"params": p}, x)), argnums=(0, 1))(params, x)
    assert rel_err(plain, want) > 1e-2  # the rotation is seen by the comparison


def test_float64_attention_computes_its_softmax_in_float64():
    """The softmax runs in at least float32: bf16 widened, float64 kept (it was cast to float32
    whatever the dtype, so a float64 model agreed with float64 math to ~1e-7 only)."""
    with jax.enable_x64(True):
        attn = tl.CausalSelfAttention(n_heads=2, dtype=jnp.float64)
        x = jax.random.normal(jax.random.key(1), (2, 6, 16), jnp.float64)
        params = attn.init(jax.random.key(2), x)["params"]
        got = attn.apply({"params": params}, x)
        assert got.dtype == jnp.float64
        assert rel_err(got, _independent_attention(params, x)) < 1e-13


# --- RevNet and ResNet -----------------------------------------------------------------------

#: RevNet paper (Gomez et al. 2017), Table 1, CIFAR-10 column.
PAPER_PARAMS = {
    "resnet32": 0.46e6,
    "resnet110": 1.73e6,
    "resnet164": 1.70e6,
    "revnet38": 0.46e6,
    "revnet110": 1.73e6,
    "revnet164": 1.75e6,
}


@pytest.mark.parametrize("name", PAPER_PARAMS)
def test_parameter_counts_match_the_paper(name):
    module = models.build(name, num_classes=10)
    x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    variables, out = shapes(module, x)
    count = n_params(variables["params"])
    assert abs(count - PAPER_PARAMS[name]) / PAPER_PARAMS[name] < 0.03, (name, count)
    assert out.shape == (2, 10) and out.dtype == jnp.float32


def test_image_model_registry_and_options():
    assert models.get("revnet164").task == "classify"
    assert models.build("revnet", depth=110).arch == rv.ARCHS["revnet110"]
    assert models.build("resnet164").arch.bottleneck
    m = models.build("revnet38", width=0.5, num_classes=3, dtype="bfloat16", anchor_every=2)
    assert m.arch.widths == (16, 32, 56) and m.num_classes == 3
    x = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
    v, out = shapes(m, x)
    assert out.shape == (2, 3) and out.dtype == jnp.float32
    assert v["params"]["stage0"]["layers"]["f"]["conv0"]["kernel"].dtype == jnp.float32
    for bad in [{"depth": 50}, {"width": 0}, {"reversible": "maybe"}, {"anchor_every": 0}]:
        with pytest.raises(pydantic.ValidationError):
            models.build("revnet", **bad)
    with pytest.raises(pydantic.ValidationError, match="depth"):
        models.build("resnet32", depth=110)  # the named variant fixes its depth
    assert [rv._anchor(4, d) for d in (9, 8, 3, 2)] == [3, 4, 3, 2]


# Stage 0: 2 reversible units; stages 1 and 2: one non-reversible downsampling unit each.
TINY_REVNET = rv.Arch((2, 1, 1), (8, 16, 16), 8, bottleneck=False)


@pytest.fixture(scope="module")
def revnet_steps():
    """(loss, batch_stats, grads) of the reversible and the plain RevNet, train and eval mode,
    from one jit (one XLA:CPU compile instead of four)."""
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
    rev = rv.RevNet(TINY_REVNET, num_classes=5)
    variables = random_variables(jax.eval_shape(rev.init, jax.random.key(0), x))

    def step(module, train):
        def loss(params):
            v = {"params": params, "batch_stats": variables["batch_stats"]}
            logits, updates = module.apply(v, x, train=train, mutable=["batch_stats"])
            return jnp.mean(jax.nn.log_softmax(logits)[:, 0]), updates["batch_stats"]

        return jax.value_and_grad(loss, has_aux=True)

    modules = {"reversible": rev, "plain": rev.clone(reversible=False)}
    steps = {(k, t): step(m, t) for k, m in modules.items() for t in (True, False)}
    results = jax.jit(lambda p: {k: f(p) for k, f in steps.items()})(variables["params"])
    return x, variables, results


@pytest.mark.parametrize("train", [True, False])
def test_revnet_grads_equal_plain_autodiff_with_batchnorm(train, revnet_steps):
    x, variables, results = revnet_steps
    (loss, stats), grads = results["reversible", train]
    (want_loss, want_stats), want = results["plain", train]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert max_rel_err(grads, want) < 1e-4
    # Running averages: updated once per step, by the forward pass, in training mode only.
    assert rel_err(stats, want_stats) < 1e-6  # per leaf, max-scaled (tests/gradients.py)
    old = variables["batch_stats"]["stage0"]["layers"]["f"]["bn0"]["mean"]
    new = stats["stage0"]["layers"]["f"]["bn0"]["mean"]
    assert bool(jnp.any(new != old)) == train
    if train:  # one momentum step: new = 0.9 old + 0.1 batch_mean (of layer 0's F input)
        stem = rv._conv(TINY_REVNET.stem, 3, 1, jnp.float32, "stem")
        x2 = stem.apply({"params": variables["params"]["stem"]}, x)[..., 4:]  # (B, H, W, 4)
        batch_mean = jnp.mean(x2, axis=(0, 1, 2))
        np.testing.assert_allclose(new[0], 0.9 * old[0] + 0.1 * batch_mean, rtol=1e-5, atol=1e-6)


# --- RematBlock -------------------------------------------------------------------------------


class _MLP(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        h = rn.name(jnp.tanh(fnn.Dense(8, name="up")(x)), "mlp_hidden")
        return fnn.Dense(x.shape[-1], name="down")(h)


def test_remat_block_param_tree_stable_and_grads_equal():
    x = jax.random.normal(jax.random.key(0), (2, 4))
    policies = [
        "full",
        "none",
        "dots_saveable",
        rn.plan({"save": ["mlp_hidden"]}),
        {"offload": ["mlp_hidden"]},
    ]
    blocks = [nn.RematBlock(_MLP(), policy=p, pre_norm=True) for p in policies]
    trees = [jax.eval_shape(b.init, jax.random.key(0), x) for b in blocks]
    assert all(t == trees[0] for t in trees)
    assert sorted(trees[0]["params"]) == ["body", "norm"]
    variables = random_variables(trees[0])

    def grads(block):
        return jax.jit(jax.grad(lambda v: jnp.sum(block.apply(v, x) ** 2)))(variables)

    want = grads(_Ref())
    for block in blocks[::2]:  # full, dots_saveable, offload plan
        assert max_rel_err(grads(block), want) < 1e-5


class _Ref(fnn.Module):
    """The RematBlock body without remat, same parameter names."""

    @fnn.compact
    def __call__(self, x):
        return x + _MLP(name="body")(fnn.LayerNorm(name="norm")(x))


def test_remat_block_saves_what_the_plan_says_and_tags_residual_body():
    x = jax.random.normal(jax.random.key(0), (2, 4))
    block = nn.RematBlock(_MLP(), policy={"save": ["mlp_hidden"]})
    v = block.init(jax.random.key(0), x)
    got = named_residuals(lambda v: jnp.sum(block.apply(v, x) ** 2), v)
    assert got == {"saved": {"mlp_hidden"}, "offloaded": set()}
    names = rn.Plan().check(lambda v: block.apply(v, x), v)
    assert rn.names.RESIDUAL_BODY in names


def test_remat_block_in_scan():
    x = jax.random.normal(jax.random.key(0), (2, 4))
    Stack = fnn.scan(
        nn.RematBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    stack = Stack(_MLP(), policy="full", carry=True, prevent_cse=False)
    v = random_variables(jax.eval_shape(stack.init, jax.random.key(0), x, None))
    assert v["params"]["body"]["up"]["kernel"].shape == (3, 4, 8)

    def unrolled(v):
        y = x
        for i in range(3):
            layer = jax.tree.map(lambda a, i=i: a[i], v)
            y = y + _MLP().apply({"params": layer["params"]["body"]}, y)
        return jnp.sum(y**2)

    g = jax.jit(jax.grad(lambda v: jnp.sum(stack.apply(v, x, None)[0] ** 2)))(v)
    assert max_rel_err(g, jax.jit(jax.grad(unrolled))(v)) < 1e-5


# --- summary CLI ------------------------------------------------------------------------------


def test_summary_list_and_errors(capsys):
    assert summary.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "transformer" in out
    assert summary.main(["transfomer"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "transformer" in err
    assert summary.main(["transformer", "n_layers=-1"]) == 2
    assert "n_layers" in capsys.readouterr().err
    assert summary.main(["transformer", "bogus"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_summary_transformer(capsys):
    args = ["transformer", "n_layers=2", "d_model=16", "n_heads=2", "max_len=8", "vocab_size=11"]
    assert summary.main([*args, "remat=save_qkv_proj", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "params" in out and "FLOPs" in out and "temp" in out


def test_flop_counter_counts_scan_length():
    w = jnp.ones((5, 4, 4))
    f = lambda x: jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0]
    assert rn.matmul_flops(f, jnp.ones((2, 4))) == 5 * 2 * 2 * 4 * 4


# --- JAX's upgrade flags ------------------------------------------------------------------------

_FULL = rn.plan({"default": "recompute"})
# Every model family at a tiny size (name -> (constructor, input shape)): the CNNs are their
# registered classes on a 3-stage arch, with the downsampling / residual units rematerialized
# (``rnn.tied_remat``'s custom_vjp: the registry's default for a RevNet, ``remat: full`` for a
# ResNet).
FLAG_MODELS = {
    "resnet": (
        lambda: rs.ResNet(rv.Arch((1, 1, 1), (4, 8, 8), 4, False), 3, remat=_FULL),
        (2, 8, 8, 3),
    ),
    "revnet": (lambda: rv.RevNet(TINY_REVNET.scaled(0.5), 3, remat=_FULL), (2, 8, 8, 3)),
    "nnx_revnet": (
        lambda: models.build("nnx_revnet", width=4, depth=1, num_classes=3),
        (2, 8, 8, 1),
    ),
    "transformer": (lambda: models.build("transformer", **TINY_LM), (2, 8)),
    "transformer_reversible": (
        lambda: models.build("transformer", **TINY_LM, reversible=True),
        (2, 8),
    ),
}


def _train_step(name: str, upgrade_flags: bool):
    """Init and one jitted SGD step of FLAG_MODELS[name] (the step as the trainer's: variables,
    batch and dropout key are arguments) with JAX's upgrade flags on or off: (loss, gradients,
    new variables), computed."""
    flags = ("jax_remat3", "jax_custom_vjp3")
    before = {flag: getattr(jax.config, flag) for flag in flags}
    for flag in flags:
        jax.config.update(flag, upgrade_flags)
    try:
        make, shape = FLAG_MODELS[name]
        model = make()
        lm = name.startswith("transformer")
        if lm:
            x = jax.random.randint(jax.random.key(1), shape, 0, TINY_LM["vocab_size"])
        else:
            x = jax.random.normal(jax.random.key(1), shape)
        variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), x)

        @jax.jit
        def step(variables, x, key):
            def loss(params):
                v = {**variables, "params": params}
                out, upd = model.apply(
                    v, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
                )
                return jnp.mean(jax.nn.log_softmax(out)[..., 0]), {**variables, **upd}

            (value, new), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
            new["params"] = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads)
            return value, grads, new

        return step(variables, x, jax.random.key(2))
    finally:
        for flag, value in before.items():
            jax.config.update(flag, value)


@pytest.mark.parametrize("name", list(FLAG_MODELS))
def test_every_model_trains_a_step_with_the_same_gradient_under_jax_upgrade_flags(name):
    """Init and one compiled SGD step under ``jax_remat3`` + ``jax_custom_vjp3`` give the
    gradients and updated variables of JAX's defaults.

    Under jax_custom_vjp3 a custom_vjp may not close over a tracer: the CNNs' rematerialized
    units pass their BatchNorm statistics to flax's custom_vjp as inputs. Under jax_remat3 a
    checkpoint_name inside a vmap (the reversible transformer's layers are initialised with
    nn.vmap) needs the batching rule remat_nn._jax_internals registers.
    """
    value, grads, new = _train_step(name, upgrade_flags=False)
    value_up, grads_up, new_up = _train_step(name, upgrade_flags=True)
    assert jax.tree.structure(new_up) == jax.tree.structure(new)
    assert abs(float(value_up - value)) <= 1e-6 * abs(float(value))
    assert rel_err(grads_up, grads) <= 1e-5
    assert rel_err(new_up, new) <= 1e-5  # the BatchNorm statistics included
