"""bfloat16 compute (issue #14): one knob, the models' ``dtype`` option (which
``train.compute_dtype`` sets), gives bfloat16 matmuls with float32 master weights, and float32
reconstruction in reversible stacks.

- Every matmul and convolution of the train loss's gradient reads bfloat16 operands, except the
  classifier / tied LM head, deliberately float32 (3 equations: its forward and the two matmuls
  of its VJP); with ``dtype=float32`` every one is float32. Counted on the jaxpr, scan / remat /
  custom_vjp bodies included, for revnet38, resnet32 and the transformer (scanned, unrolled,
  reversible). Master weights and gradients stay float32. End to end, the trainer's dry run with
  ``train.compute_dtype=bfloat16`` alone prints those counts.
- Reversible stacks carry their residual stream in float32 while F and G compute in bfloat16,
  so the gradient that reconstructs activations matches plain autodiff of the same bfloat16
  model within :data:`RECON_TOL` at every depth; a bfloat16 stream (``recon_dtype=bfloat16``)
  misses it and its error grows with depth, which shows the test would catch one.

Run: python -m pytest tests/models/test_bf16.py -q
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.test_util
import pytest

import models
from models import revnet as rv
from remat_nn._jax_internals import sub_jaxprs
from tests.gradients import random_variables, rel_err
from train import loop
from train.config import load_config
from train.dtypes import matmul_operand_dtypes
from train.state import TrainState, eval_zeros, make_eval_step, make_loss_fn

BF16, F32 = jnp.bfloat16, jnp.float32

LM = dict(vocab_size=32, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_len=8)
FAMILIES = {
    "revnet38": ("revnet38", dict(width=0.25, num_classes=10, image_size=8)),
    "resnet32": ("resnet32", dict(width=0.25, num_classes=10, image_size=8)),
    "transformer-scan": ("transformer", dict(LM, scan_layers=True)),
    "transformer-unrolled": ("transformer", dict(LM, scan_layers=False, remat="minimal")),
    "transformer-reversible": ("transformer", dict(LM, reversible=True, dropout=0.1)),
}
#: Matmuls of the gradient left in float32 on purpose: the head (ResNet/RevNet classifier, the
#: transformer's tied ``embed.attend``), so logits and the loss see float32 features: its
#: forward, and the two matmuls of its VJP (the cotangent of the features and of the weights).
HEAD_FLOAT32_MATMULS = 3

#: Reconstruction vs plain autodiff of the same bfloat16 model, each leaf relative to its largest
#: value (floored at 1% of the largest leaf's: a leaf whose exact gradient is 0, the attention
#: key bias, holds only round-off). A float32 stream measures 0 here (bit-identical); the bound
#: leaves room for a bfloat16 rounding of F's input that another CPU's fusion flips (2^-8).
RECON_TOL = 1e-2
# Reversible units in the deep stack of the reconstruction tests. Both scan their layers (the
# RevNet's stage with unroll=1: unrolled, the default for convolutions on CPU, compile time grows
# with depth and the stream's arithmetic is the same), so depth costs no compile time.
DEEP = {"transformer": 32, "revnet": 32}

_FAST = {"xla_backend_optimization_level": 0}  # tiny programs: compile time dominates


def run(fn: Any, *args: Any) -> Any:
    """``jax.jit(fn)(*args)``, compiled without LLVM optimizations (numerics unaffected)."""
    return jax.jit(fn).lower(*args).compile(_FAST)(*args)


def max_rel_err(got: Any, want: Any) -> float:
    """:func:`tests.gradients.rel_err`, each leaf's scale floored at 1% of the largest leaf's."""
    return rel_err(got, want, floor=1e-2)


def batch_for(name: str, opts: dict[str, Any]) -> dict[str, jax.Array]:
    if models.get(name).task == "classify":
        x = jnp.zeros((2, opts["image_size"], opts["image_size"], 3), F32)
        return {"x": x, "y": jnp.zeros((2,), jnp.int32), "mask": jnp.ones((2,), F32)}
    tokens = jnp.zeros((2, opts["max_len"]), jnp.int32)
    return {"x": tokens, "y": tokens, "mask": jnp.ones(tokens.shape, F32)}


def train_loss_grad(name: str, opts: dict[str, Any], dtype: str, **attrs: Any):
    """(grad of the trainer's loss w.r.t. the float32 master params, its abstract arguments,
    the model, the batch): the model built with ``dtype`` (then ``attrs`` set), the loss casting
    to it, as the trainer does with ``train.compute_dtype``."""
    model = models.build(name, **opts, dtype=dtype)
    model = model.clone(**attrs) if attrs else model
    batch = batch_for(name, opts)
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = jax.eval_shape(lambda: model.init(keys, batch["x"], train=False))
    has_bn = "batch_stats" in variables
    loss_fn = make_loss_fn(model, compute_dtype=jnp.dtype(dtype), has_batch_stats=has_bn)

    def grad(params, batch_stats):
        return jax.grad(lambda p: loss_fn(p, batch_stats, batch, jax.random.key(2))[0])(params)

    return grad, (variables["params"], variables.get("batch_stats", {})), model, batch


# --- one knob: bfloat16 matmuls, float32 master weights -------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_gradient_matmuls_read_bfloat16_but_the_head(family):
    name, opts = FAMILIES[family]
    grad, args, _, _ = train_loss_grad(name, opts, "bfloat16")
    counts = matmul_operand_dtypes(grad, *args)
    # No other key: no float32 matmul outside the head and no mixed "bfloat16 x float32" one.
    assert set(counts) == {"bfloat16", "float32"}, counts
    assert counts["float32"] == HEAD_FLOAT32_MATMULS, counts
    # Every matmul the float32 model runs is still there, and all but the head's went bfloat16.
    grad32, args32, _, _ = train_loss_grad(name, opts, "float32")
    counts32 = matmul_operand_dtypes(grad32, *args32)
    assert counts32 == {"float32": sum(counts.values())}, (counts32, counts)
    # Master weights and the gradient the optimizer reads are float32.
    params, _ = args
    grads = jax.eval_shape(grad, *args)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(F32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(F32)}


@pytest.mark.parametrize("family", ["transformer-scan", "resnet32"])
def test_float64_compute_keeps_its_loss_and_gradient_float64(family):
    """The heads, the softmax and the loss run in at least float32: bfloat16 widened as above,
    float64 kept. Each cast to float32 before, so a float64 run was float32-precise: against
    central differences (step 1e-6: ~1e-9 in float64) the gradient's projection misses by
    4e-2 with the transformer's final norm cast back and 6e-3 with its softmax; with the CNN
    head's cast or the loss's back, the loss is float32. (float64 is for tests: the options
    take float32 and bfloat16, so the model is cloned to it.)"""
    name, opts = FAMILIES[family]
    with jax.enable_x64(True):
        model = models.build(name, **opts).clone(dtype=jnp.float64)
        batch = batch_for(name, opts)
        if "image_size" in opts:  # images and labels that BatchNorm does not flatten
            k = jax.random.split(jax.random.key(3))
            batch["x"] = jax.random.normal(k[0], batch["x"].shape, jnp.float64)
            batch["y"] = jax.random.randint(k[1], batch["y"].shape, 0, opts["num_classes"])
        variables = model.init(jax.random.key(0), batch["x"])
        params, stats = jax.tree.map(
            lambda v: v.astype(jnp.float64), (variables["params"], variables.get("batch_stats", {}))
        )
        loss_fn = make_loss_fn(model, compute_dtype=jnp.float64, has_batch_stats=bool(stats))
        loss = lambda p: loss_fn(p, stats, batch, jax.random.key(2))[0]  # noqa: E731
        assert loss(params).dtype == jnp.float64
        counts = matmul_operand_dtypes(jax.grad(loss), params)
        assert set(counts) == {"float64"}, counts
        jax.test_util.check_grads(
            loss, (params,), order=1, modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6
        )


@pytest.mark.parametrize("family", ["revnet38", "transformer-scan", "transformer-reversible"])
def test_bfloat16_eval_matmuls_read_bfloat16_but_the_head(family):
    name, opts = FAMILIES[family]
    _, (params, stats), model, batch = train_loss_grad(name, opts, "bfloat16")
    eval_step = make_eval_step(model, compute_dtype=BF16, has_batch_stats=bool(stats))
    state = TrainState(jnp.zeros((), jnp.int32), params, None, stats, jnp.zeros(2, jnp.uint32))
    counts = matmul_operand_dtypes(eval_step, state, batch, eval_zeros())
    assert set(counts) == {"bfloat16", "float32"} and counts["float32"] == 1, counts


def test_train_compute_dtype_alone_sets_the_model_dtype(tmp_path):
    # The knob end to end: the trainer's dry run of a registered model (configs/debug.yaml, a
    # 2-layer transformer) with train.compute_dtype=bfloat16 and no model.options.dtype.
    config = Path(__file__).parents[2] / "configs" / "debug.yaml"
    cfg = load_config(config, ["train.compute_dtype=bfloat16", f"run_dir={tmp_path / 'dry'}"])
    assert "dtype" not in cfg.model.options
    lines: list[str] = []
    loop.run(cfg, dry_run=True, out=lines.append)
    prefix = "matmul operand dtypes: {"
    (line,) = [line for line in lines if line.startswith(prefix)]
    counts = dict(item.split(": ") for item in line.removeprefix(prefix).rstrip("}").split(", "))
    assert set(counts) == {"bfloat16", "float32"}, line
    assert int(counts["float32"]) == HEAD_FLOAT32_MATMULS, line


def test_bfloat16_models_keep_float32_params_and_logits():
    for name, opts in FAMILIES.values():
        model = models.build(name, **opts, dtype="bfloat16")
        x = batch_for(name, opts)["x"]
        variables = jax.eval_shape(model.init, jax.random.key(0), x)
        logits = jax.eval_shape(lambda v, x, m=model: m.apply(v, x), variables, x)
        assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(F32)}, name
        assert logits.dtype == F32, name


# --- float32 reconstruction in reversible stacks --------------------------------------------------


def _lm_errors(depth: int, streams: tuple[Any, ...]) -> dict[Any, float]:
    """Per stream dtype: the error of the reconstructing gradient of a bfloat16 reversible
    transformer against plain autodiff of the same model (``reconstruct=False``)."""
    deep, tokens, params = _lm_case()
    base = deep.clone(n_layers=depth)
    params = {**params, "blocks": jax.tree.map(lambda a: a[:depth], params["blocks"])}

    def loss(module, params):
        bf16_params = jax.tree.map(lambda p: p.astype(BF16), params)  # as the trainer's loss
        logits = module.apply({"params": bf16_params}, tokens[:, :-1])  # (B, T-1, V)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    # drift_fallback="none": the reconstruction's own error is measured here (the default check
    # refuses the bfloat16 stream's drift, which is what this measures).
    pairs = [
        [base.clone(recon_dtype=s, reconstruct=r, drift_fallback="none") for r in (True, False)]
        for s in streams
    ]
    return _errors(loss, pairs, params, streams)


@functools.cache
def _lm_case() -> tuple[Any, jax.Array, Any]:
    """(a bfloat16 reversible transformer of DEEP layers, tokens (4, 16), its initial params):
    shallower stacks take its first layers (one init compile)."""
    opts = dict(LM, d_model=32, d_ff=64, max_len=16, n_layers=DEEP["transformer"])
    model = models.build("transformer", **opts, reversible=True, dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, LM["vocab_size"])
    return model, tokens, run(model.init, jax.random.key(0), tokens)["params"]


def _revnet_errors(depth: int, streams: tuple[Any, ...]) -> dict[Any, float]:
    """As :func:`_lm_errors` for a bfloat16 RevNet whose first stage holds ``depth`` reversible
    units, in eval mode (BatchNorm's running averages: a per-channel affine map, so the network
    is well conditioned and the comparison measures reconstruction alone)."""
    arch = rv.Arch((depth, 1, 1), (16, 16, 16), 16, bottleneck=False)
    base = rv.RevNet(arch, num_classes=10, dtype=BF16, unroll=1, drift_fallback="none")
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3)).astype(BF16)
    labels = jnp.arange(4) % 10
    variables = _small_variables(jax.eval_shape(base.init, jax.random.key(0), x))

    def loss(module, params):
        v = {
            "params": jax.tree.map(lambda p: p.astype(BF16), params),
            "batch_stats": variables["batch_stats"],
        }
        logits = module.apply(v, x, train=False)  # (B, 10)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1))

    pairs = [[base.clone(recon_dtype=s, reversible=r) for r in (True, False)] for s in streams]
    return _errors(loss, pairs, variables["params"], streams)


def _errors(loss: Any, pairs: list[list[Any]], params: Any, streams: tuple[Any, ...]):
    # One compiled program for every gradient (compile time dominates these tiny models).
    grads = run(
        lambda p: [[jax.grad(lambda p, m=m: loss(m, p))(p) for m in pair] for pair in pairs], params
    )
    return {s: max_rel_err(rec, plain) for s, (rec, plain) in zip(streams, grads, strict=True)}


def _small_variables(tree: Any) -> Any:
    # Kernels ~ N(0, 0.09 / fan_in): each unit a small update, so the stream neither explodes
    # nor vanishes with depth at eval.
    return random_variables(tree, kernel_scale=0.3)


@pytest.mark.parametrize("family", ["transformer", "revnet"])
def test_float32_stream_reconstructs_as_plain_autodiff_at_any_depth(family):
    errors = _lm_errors if family == "transformer" else _revnet_errors
    deep = errors(DEEP[family], (F32, BF16))
    shallow = errors(2, (BF16,))  # a float32 stream at depth 2: bit-identical as at DEEP
    print(
        f"{family}: reconstructing gradient vs plain autodiff, bfloat16 compute: float32 "
        f"stream {deep[F32]:.3g} at depth {DEEP[family]}; bfloat16 stream {shallow[BF16]:.3g} "
        f"at depth 2, {deep[BF16]:.3g} at depth {DEEP[family]}"
    )
    assert deep[F32] < RECON_TOL
    # The check has teeth: a bfloat16 stream misses the bound already at depth 2, and its error
    # grows with depth.
    assert RECON_TOL < shallow[BF16] < deep[BF16]


def _scan_carry_dtypes(jaxpr: Any, found: set[str]) -> set[str]:
    """Dtypes of the floating loop-carried arrays of every scan in ``jaxpr`` and its bodies
    (scalars, such as the drift check's record of the first drifted layer, are not a stream)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            first = eqn.params["num_consts"]
            for var in eqn.invars[first : first + eqn.params["num_carry"]]:
                if jnp.issubdtype(var.aval.dtype, jnp.floating) and var.aval.ndim > 0:
                    found.add(str(var.aval.dtype))
        for sub in sub_jaxprs(eqn):
            _scan_carry_dtypes(sub, found)
    return found


@pytest.mark.parametrize("family", ["revnet38", "transformer-reversible"])
def test_reversible_stream_is_float32_in_the_train_gradient(family):
    # As the trainer runs them (training mode, its loss): the only scans are the reversible
    # stacks' forward and reconstructing backward, whose carries are the residual stream (and
    # its cotangent). With bfloat16 compute they must be float32; a bfloat16 stream shows.
    name, opts = FAMILIES[family]
    found = {}
    for stream in (F32, BF16):
        grad, args, model, _ = train_loss_grad(name, opts, "bfloat16", recon_dtype=stream)
        assert model.recon_dtype == stream
        found[stream] = _scan_carry_dtypes(jax.make_jaxpr(grad)(*args).jaxpr, set())
    assert found == {F32: {"float32"}, BF16: {"bfloat16"}}, found
