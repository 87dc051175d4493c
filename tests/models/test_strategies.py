"""Nested checkpointed scans in the models (issue #16 item 5): ResNet ``scan_levels`` and the
transformer's ``scan_levels``.

Each runs the stacked layers through ``rn.remat_scan``: the gradient (and a ResNet's BatchNorm
update) equals plain autodiff's on small, well-conditioned shapes; the variables are exactly those
of ``scan_units`` / ``scan_layers`` (same tree, same initial values); the nested schedule is what
runs (its custom VJP is in the step's jaxpr); bad values are refused naming the option and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pydantic
import pytest

import models
from models import resnet as R
from tests.gradients import random_variables, rel_err

# Stage 1 has 4 identical units after its downsampling one: lengths (2, 2) at 2 levels, and a
# remainder chunk at 3 levels; stages 0 and 2 have one scanned unit each.
ARCH = R.Arch((2, 5, 2), (16, 16, 32), 8, bottleneck=True)
TOL = 1e-5  # float32, max-scaled
FULL, SAVE_CONV = R.REMAT_PRESETS["full"], R.REMAT_PRESETS["save_conv_out"]


def _images(batch=4, size=8):
    return jax.random.uniform(jax.random.key(1), (batch, size, size, 3))


def _cnn_loss(module):
    labels = jnp.arange(4) % 10

    def loss(params, batch_stats, images):
        variables = {"params": params, "batch_stats": batch_stats}
        logits, updates = module.apply(variables, images, train=True, mutable=["batch_stats"])
        logp = jax.nn.log_softmax(logits)  # (B, classes)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1)), updates

    return loss


def _small(tree):
    # Well-conditioned: kernels at half the He scale keep 14 BN-ReLU-conv layers tame.
    return jax.tree.map(lambda a: a * 0.5 if a.ndim >= 2 else a, tree)


@pytest.fixture(scope="module")
def plain():
    """The unscanned ResNet: its variables and its gradient step's output (the reference)."""
    module = R.ResNet(ARCH)
    # NumPy values of init's shapes (kernels N(0, 1/(4 fan_in))): no init compile.
    shapes = jax.eval_shape(module.init, jax.random.key(0), _images())
    variables = random_variables(shapes, kernel_scale=0.5)
    step = jax.jit(jax.grad(_cnn_loss(module), has_aux=True))
    return variables, step(variables["params"], variables["batch_stats"], _images())


@pytest.mark.parametrize(
    ("levels", "plan"), [(2, FULL), (3, SAVE_CONV)], ids=["levels2-full", "levels3-save_conv_out"]
)
def test_resnet_nested_scan_gradient_equals_plain_autodiff(plain, levels, plan):
    variables, (want, want_updates) = plain
    module = R.ResNet(ARCH, remat=plan, scan_units=True, scan_levels=levels)
    to_scan = lambda t: R.convert_units(t, ARCH, scanned=True)  # noqa: E731
    loss = _cnn_loss(module)
    step = jax.jit(jax.grad(loss, has_aux=True))
    grads, updates = step(
        to_scan(variables["params"]), to_scan(variables["batch_stats"]), _images()
    )
    assert rel_err(grads, to_scan(want)) <= TOL
    # BatchNorm running averages updated once per unit, by the forward pass, as plain autodiff.
    assert rel_err(updates["batch_stats"], to_scan(want_updates["batch_stats"])) <= TOL
    # The nested schedule runs (rn.remat_scan's custom VJP), not nn.scan.
    args = (to_scan(variables["params"]), to_scan(variables["batch_stats"]), _images())
    assert "custom_vjp_call" in str(jax.make_jaxpr(loss)(*args))


def test_resnet_nested_scan_variables_are_scan_units_and_eval_matches():
    x = _images()
    scan = R.ResNet(ARCH, scan_units=True)
    nested = R.ResNet(ARCH, scan_units=True, scan_levels=2)
    v_scan, v_nested = (jax.jit(m.init)(jax.random.key(0), x) for m in (scan, nested))
    assert jax.tree.structure(v_nested) == jax.tree.structure(v_scan)
    assert rel_err(v_nested, v_scan) == 0.0  # init runs nn.scan itself: the same values
    v = _small(v_scan)
    assert rel_err(jax.jit(nested.apply)(v, x), jax.jit(scan.apply)(v, x)) <= TOL  # train=False


def test_resnet_scan_levels_refused_naming_the_option():
    with pytest.raises(pydantic.ValidationError, match=r"resnet164: option scan_levels=2 .*Fix: "):
        models.build("resnet164", scan_levels=2)  # scan_units off
    with pytest.raises(pydantic.ValidationError, match="scan_levels"):
        models.build("resnet32", scan_units=True, scan_levels=0)
    x = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"ResNet: scan_levels must be an int >= 1.*got int 0"):
        jax.eval_shape(R.ResNet(ARCH, scan_units=True, scan_levels=0).init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"ResNet: scan_levels=2 .*Fix: set scan_units=True"):
        jax.eval_shape(R.ResNet(ARCH, scan_levels=2).init, jax.random.key(0), x)


# --- transformer --------------------------------------------------------------------------------

LM = dict(vocab_size=32, d_model=16, n_heads=2, n_layers=5, max_len=8)


def _tokens():
    return jax.random.randint(jax.random.key(1), (2, 9), 0, 32)  # (B, T + 1)


def _lm_loss(module):
    def loss(params, tokens):
        logits = module.apply({"params": params}, tokens[:, :-1])  # (B, T, V)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return loss


def test_transformer_nested_scan_gradient_and_parameters():
    tokens = _tokens()
    ref = models.build("transformer", remat="none", **LM)
    params = jax.jit(ref.init)(jax.random.key(0), tokens[:, :-1])["params"]
    want = jax.jit(jax.grad(_lm_loss(ref)))(params, tokens)
    for remat in ("full", "save_dot_except_mlp"):
        module = models.build("transformer", remat=remat, scan_levels=2, **LM)
        mine = jax.jit(module.init)(jax.random.key(0), tokens[:, :-1])["params"]
        assert jax.tree.structure(mine) == jax.tree.structure(params)
        assert rel_err(mine, params) == 0.0  # nn.scan's parameters, values included
        loss = _lm_loss(module)
        # Floor 1e-2: the key biases' exact gradient is 0 (softmax ignores them), round-off only.
        assert rel_err(jax.jit(jax.grad(loss))(params, tokens), want, floor=1e-2) <= TOL, remat
        assert "custom_vjp_call" in str(jax.make_jaxpr(loss)(params, tokens))


@pytest.mark.parametrize("levels", [1, 2])
def test_transformer_nested_scan_honours_remat_none(levels):
    # remat=none with scan_levels ran `full` while the dry run printed "remat plan: none". Now
    # each block runs without remat: plain autodiff's gradient, and no remat of the block
    # in the gradient's program; with one level, a checkpointed scan of plain blocks is no remat
    # at all, so it keeps every block's residuals: more temp memory than `full`.
    tokens = _tokens()
    ref = models.build("transformer", remat="none", **LM)
    params = jax.jit(ref.init)(jax.random.key(0), tokens[:, :-1])["params"]
    want = jax.jit(jax.grad(_lm_loss(ref)))(params, tokens)
    temp, remats = {}, {}
    for remat in ("none", "full"):
        module = models.build("transformer", remat=remat, scan_levels=levels, **LM)
        grad = jax.jit(jax.grad(_lm_loss(module)))
        assert rel_err(grad(params, tokens), want, floor=1e-2) <= TOL, remat
        temp[remat] = grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
        remats[remat] = str(jax.make_jaxpr(grad)(params, tokens)).count("remat2[")
    print(f"levels {levels}: temp bytes {temp}, remat equations {remats}")
    assert remats["none"] == 0 < remats["full"]
    if levels == 1:
        assert temp["none"] > temp["full"]


@pytest.mark.parametrize("levels", [1, 2])
def test_resnet_nested_scan_honours_remat_none(plain, levels):
    # remat=none with scan_levels ran `full` in the ResNet (the module's None became `full`
    # there; the registry refused an explicit `none`). Now, as in the transformer, each unit
    # runs without remat: plain autodiff's gradient and BatchNorm update, no remat in the
    # gradient's program; with one level that is no remat at all: more temp memory than `full`.
    variables, (want, want_updates) = plain
    to_scan = lambda t: R.convert_units(t, ARCH, scanned=True)  # noqa: E731
    args = (to_scan(variables["params"]), to_scan(variables["batch_stats"]), _images())
    temp, remats = {}, {}
    for name, plan in (("none", None), ("full", FULL)):
        module = R.ResNet(ARCH, remat=plan, scan_units=True, scan_levels=levels)
        step = jax.jit(jax.grad(_cnn_loss(module), has_aux=True))
        temp[name] = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
        remats[name] = str(jax.make_jaxpr(step)(*args)).count("remat2[")
        if name == "none":
            grads, updates = step(*args)
            assert rel_err(grads, to_scan(want)) <= TOL
            assert rel_err(updates["batch_stats"], to_scan(want_updates["batch_stats"])) <= TOL
    print(f"levels {levels}: temp bytes {temp}, remat equations {remats}")
    assert remats["none"] == 0 < remats["full"]
    if levels == 1:
        assert temp["none"] > temp["full"]
    # Through the registry: `none` is what the build gets; unset, the nested scan's `full`.
    options = dict(scan_units=True, scan_levels=levels)
    assert models.build("resnet32", remat="none", **options).remat is None
    assert models.build("resnet32", **options).remat == FULL


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(scan_levels=2, scan_layers=False), r"scan_levels=2 .*scan_layers=false\. Fix: "),
        (dict(scan_levels=2, reversible=True), r"scan_levels=2 .*reversible=true .*Fix: "),
        (dict(scan_levels=2, dropout=0.1), r"scan_levels=2 with dropout=0\.1.*Fix: dropout=0"),
        (dict(scan_levels=0), "scan_levels"),
    ],
)
def test_transformer_scan_levels_refused_naming_the_option(options, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        models.build("transformer", **options)
