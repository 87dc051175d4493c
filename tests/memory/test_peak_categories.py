"""rn.explain_peak's categories, each held to a program whose answer is known by construction.

The bytes of a peak report are XLA's own (tests/memory/test_peak.py); the labels are the
report's reading of them: a value of the backward pass is a ``gradient`` unless it is a forward
value the backward recomputes (``recomputed``); a forward value the backward pass reads is a
``saved residual``, wherever XLA schedules that read, any other a ``transient``; arguments are
named by their pytree path, outputs are outputs. The main program is a scanned two-layer MLP
whose values have distinct shapes, so each label can be checked on the value it must be:

- ``f32[L, B, H]``: the stack of the hidden activation ``wide`` (or of its tanh), saved by the
  scan under no remat and under ``save=wide``, absent under ``nothing_saveable``;
- ``f32[B, H]``: one layer's hidden activation, recomputed in the backward pass under any remat
  (under ``save=wide`` its tanh), never recomputed without remat;
- ``f32[L, D, H]`` / ``f32[L, H, D]``: the parameters (arguments) and their gradients (outputs).

Labels are checked over the whole schedule (``PeakReport.timeline``) where the peak's own
buffers depend on XLA's schedule, and on the peak's buffers where the value must be live there.
The programs after it each hold one rule: a checkpointed block's recomputed value, a forward
value nothing reads back, a residual read while the forward pass still runs, a residual made
inside a cond branch, a scan's residual stack inside the loop that fills it, values XLA computes
from cotangents through instructions of its own, donated arguments.
"""

import jax
import jax.numpy as jnp
import pytest

import remat_nn as rn

L, B, D, H = 3, 64, 8, 128  # layers, batch, width, hidden width: every shape below distinct
PARAMS = {
    "up": jax.ShapeDtypeStruct((L, D, H), jnp.float32),
    "down": jax.ShapeDtypeStruct((L, H, D), jnp.float32),
}
X = jax.ShapeDtypeStruct((B, D), jnp.float32)
ONE_HIDDEN = B * H * 4  # bytes of one layer's hidden activation


def _loss(params, x, policy=None):
    def body(h, w):
        z = rn.name(h @ w["up"], "wide")  # (B, H)
        return jnp.tanh(z) @ w["down"], None  # (B, D)

    step = body if policy is None else jax.checkpoint(body, policy=policy)
    h, _ = jax.lax.scan(step, x, params)
    return jnp.sum(h**2)


def _explain(policy):
    return rn.explain_peak(jax.grad(lambda p, x: _loss(p, x, policy)), PARAMS, X)


def _labels(report) -> set[tuple[str, str, str | None]]:
    return {(b.shape, b.category, b.name) for b in report.buffers}


def _most(report, category: str) -> int:
    return max(report.timeline[category], default=0)


def _arguments(report) -> set[tuple[str, str, str | None]]:
    return {(b.shape, b.category, b.name) for b in report.buffers if b.category.startswith("arg")}


def _expected_arguments(params_role: str) -> set[tuple[str, str, str]]:
    # The parameters by pytree path (in the role given), and x.
    return {
        (f"f32[{L},{D},{H}]", params_role, "p['up']"),
        (f"f32[{L},{H},{D}]", params_role, "p['down']"),
        (f"f32[{B},{D}]", "argument: x", "x"),
    }


STACK, HIDDEN = f"f32[{L},{B},{H}]", f"f32[{B},{H}]"


def test_without_remat_nothing_is_recomputed_and_the_hidden_stack_is_saved():
    r = _explain(None)
    assert _most(r, "recomputed") == 0, str(r)  # no remat: the backward recomputes nothing
    assert _most(r, "gradient") > 0, str(r)
    saved = [b for b in r.buffers if b.shape == STACK]
    assert saved and all(b.category == "saved residual" for b in saved), str(r)


def test_under_nothing_saveable_each_layers_hidden_value_is_recomputed():
    r = _explain(rn.policy("nothing_saveable"))
    assert _most(r, "recomputed") >= ONE_HIDDEN, str(r)
    assert not [b for b in r.buffers if b.shape == STACK], str(r)  # no hidden stack kept
    assert ONE_HIDDEN * L > _most(r, "saved residual") > 0, str(r)  # the carries only


def test_a_saved_name_is_a_named_residual_and_what_it_feeds_is_recomputed():
    r = _explain(rn.policy("save=wide"))
    assert (STACK, "saved residual", "wide") in _labels(r), str(r)
    assert _most(r, "recomputed") >= ONE_HIDDEN, str(r)  # tanh(wide), from the saved wide


@pytest.mark.parametrize("policy", [None, "nothing_saveable"], ids=["no_remat", "nothing"])
def test_arguments_are_named_by_pytree_path_and_the_gradients_are_outputs(policy):
    r = _explain(None if policy is None else rn.policy(policy))
    assert _arguments(r) == _expected_arguments("argument: p"), str(r)
    outputs = {b.shape for b in r.buffers if b.category == "output"}
    assert {f"f32[{L},{D},{H}]", f"f32[{L},{H},{D}]"} <= outputs, str(r)


def test_a_forward_pass_alone_holds_transients_only():
    r = rn.explain_peak(_loss, PARAMS, X)
    temps = {b.category for b in r.buffers if b.category not in ("fragmentation", "output")}
    assert {c for c in temps if not c.startswith("argument")} == {"transient"}, str(r)
    assert (HIDDEN, "transient", "wide") in _labels(r), str(r)
    assert all(_most(r, c) == 0 for c in ("saved residual", "recomputed", "gradient")), str(r)


def test_the_last_forward_value_the_backward_reads_is_a_saved_residual():
    # grad drops the loss's sum, so the forward pass ends with exp(x @ w), and the backward
    # reads it (d/dw sum(exp(x @ w)) = x.T @ exp(x @ w)): a residual, whichever instruction
    # XLA schedules last.
    w, x = jax.ShapeDtypeStruct((D, H), jnp.float32), jax.ShapeDtypeStruct((B, D), jnp.float32)
    r = rn.explain_peak(jax.grad(lambda w, x: jnp.sum(jnp.exp(x @ w))), w, x)
    saved, transient = r.timeline["saved residual"], r.timeline["transient"]
    assert max(saved) >= ONE_HIDDEN and _most(r, "recomputed") == 0, str(r)
    # Where XLA materialises x @ w apart from its exp, that value is read by exp only: a
    # transient, and the residual (its exp) is made after it and lives on.
    first = next((t for t, n in enumerate(transient) if n >= ONE_HIDDEN), None)
    if first is not None:
        assert max(saved[first + 1 :], default=0) >= ONE_HIDDEN, str(r)


# --- one rule each ------------------------------------------------------------------------------

K = 16  # the head's width: (B, H) stays the one largest shape of the programs below


def _features_head(w, x, e, c, remat):
    # A frozen feature map (x, e are not differentiated) under a trainable head w: the gradient
    # w.r.t. w is features.T @ c, so the backward reads the (B, H) features.
    def block(w, x, e):
        return jnp.tanh(x @ e) @ w  # (B, H) @ (H, K)

    if remat:
        block = jax.checkpoint(block, policy=rn.policy("nothing_saveable"))
    return jnp.sum(block(w, x, e) * c)


def _explain_features(remat: bool) -> rn.PeakReport:
    shapes = [(H, K), (B, D), (D, H), (B, K)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return rn.explain_peak(jax.grad(lambda *a: _features_head(*a, remat)), *args)


def test_a_checkpointed_blocks_recomputed_value_is_the_largest_buffer_at_the_peak():
    # grad needs no primal output, and nothing_saveable keeps no residual: the forward pass
    # computes nothing, the backward pass recomputes the features, and they are the peak.
    r = _explain_features(remat=True)
    temps = [b for b in r.buffers if b.category in ("recomputed", "gradient", "transient")]
    most = max(b.nbytes for b in temps)
    largest = {(b.shape, b.category) for b in temps if b.nbytes == most}
    assert most == ONE_HIDDEN and largest == {(HIDDEN, "recomputed")}, str(r)
    assert _most(r, "saved residual") < ONE_HIDDEN and _most(r, "transient") < ONE_HIDDEN, str(r)


def test_without_the_checkpoint_the_same_features_are_saved_not_recomputed():
    r = _explain_features(remat=False)
    assert _most(r, "recomputed") == 0 and _most(r, "saved residual") >= ONE_HIDDEN, str(r)
    forward = {b.category for b in r.buffers if b.shape == HIDDEN}
    assert forward and forward <= {"saved residual", "transient"}, str(r)


def test_a_forward_value_the_backward_never_reads_is_a_transient():
    # d/dw of sum(w**2) * m reads m, a scalar: the (B, H) values m is made from are read by
    # the forward pass alone, and they are the peak.
    def loss(w, x, y):
        return jnp.sum(w**2) * jnp.max(jnp.sort(x @ y, axis=0)[-1])

    shapes = [(D,), (B, D), (D, H)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    r = rn.explain_peak(jax.grad(loss), *args)
    assert (HIDDEN, "transient", None) in _labels(r), str(r)
    assert {b.category for b in r.buffers if b.shape == HIDDEN} == {"transient"}, str(r)
    assert _most(r, "saved residual") < ONE_HIDDEN, str(r)


def test_a_residual_read_while_the_forward_pass_still_runs_is_a_saved_residual():
    # Two independent terms: XLA may run the first term's backward (which reads cos(x @ w1),
    # (B, 4H)) before the second term's forward is done. Read by the backward, it is a residual.
    def loss(w1, w2, x, y):
        return jnp.sum(jnp.sin(x @ w1)) + jnp.sum(jnp.cos(jnp.sort(y @ w2, axis=0)))

    shapes = [(D, 4 * H), (16, 96), (B, D), (48, 16)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    r = rn.explain_peak(jax.grad(loss, argnums=(0, 1)), *args)
    assert _most(r, "saved residual") >= 4 * ONE_HIDDEN, str(r)


def test_a_residual_made_inside_a_cond_branch_is_a_saved_residual():
    # The branch's result is the conditional's result buffer, which the backward reads: inside
    # the branch that makes it, it is already the residual.
    def loss(w, x):
        branches = (jnp.sin, lambda z: jnp.exp(z) * 2.0)  # residual: cos(z), or exp(z) * 2
        return jnp.sum(jax.lax.cond(x[0, 0] > 0, *branches, x @ w))

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(D, H), (B, D)]]
    r = rn.explain_peak(jax.grad(loss), *args)
    assert "saved residual" in {b.category for b in r.buffers if b.shape == HIDDEN}, str(r)


def _frozen_features(params, x, policy):
    # Each layer adds a head over frozen features of its input: the forward pass holds one
    # layer's features at a time, as the backward does, so the peak can fall inside either loop.
    def body(h, w):
        a = jax.lax.stop_gradient(jnp.tanh(h @ w["up"]))  # (B, H)
        return h + a @ w["down"], None

    h, _ = jax.lax.scan(jax.checkpoint(body, policy=policy), x, params)
    return jnp.sum(h**2)


@pytest.mark.parametrize("loss", [_loss, _frozen_features], ids=["mlp", "frozen_features"])
def test_the_stack_a_scan_saves_is_a_saved_residual_in_either_loop(loss):
    # nothing_saveable keeps each layer's input, (L, B, D): the forward loop fills the stack, the
    # backward loop reads it. It is live at any peak of either loop, and a residual in both.
    policy = rn.policy("nothing_saveable")
    r = rn.explain_peak(jax.grad(lambda p, x: loss(p, x, policy)), PARAMS, X)
    stacks = {b.category for b in r.buffers if b.shape == f"f32[{L},{B},{D}]"}
    assert stacks == {"saved residual"}, str(r)


def test_the_stack_a_scan_saves_is_a_saved_residual_from_its_first_instruction():
    # Many narrow layers: the stack of their inputs outweighs every forward-only value, so the
    # transient timeline stays below it only if the stack is a residual at every instruction
    # that holds it (zero-filled before the loop, the loop's carry, each layer's update).
    depth, narrow = 16, 8
    params = {
        "up": jax.ShapeDtypeStruct((depth, D, narrow), jnp.float32),
        "down": jax.ShapeDtypeStruct((depth, narrow, D), jnp.float32),
    }
    policy = rn.policy("nothing_saveable")
    r = rn.explain_peak(jax.grad(lambda p, x: _frozen_features(p, x, policy)), params, X)
    stack = depth * B * D * 4
    assert _most(r, "transient") < stack <= _most(r, "saved residual"), str(r)


def test_what_xla_computes_in_a_layout_of_its_own_from_cotangents_is_a_gradient():
    # The kernel's gradient is a convolution of the input with the output's cotangent. XLA may
    # compute it through instructions of its own (layout copies, a convolution in another
    # layout) that carry no op_name: made from cotangents, they are gradients. XLA:CPU computes
    # the kernel's gradient in a layout of its own before transposing it into the output; it is
    # the largest temp value, so it is at the peak.
    n, hw, c, o = 2, 8, 32, 32

    def loss(k, x):
        y = jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(jnp.tanh(y) ** 2)

    k = jax.ShapeDtypeStruct((3, 3, c, o), jnp.float32)
    x = jax.ShapeDtypeStruct((n, hw, hw, c), jnp.float32)
    r = rn.explain_peak(jax.grad(loss), k, x)
    out, dk = n * hw * hw * o * 4, 3 * 3 * c * o * 4  # bytes of y (and its cotangent), of dk
    assert _most(r, "gradient") >= out and _most(r, "saved residual") >= out, str(r)
    assert _most(r, "recomputed") == 0, str(r)
    temps = ("saved residual", "recomputed", "gradient", "transient")
    assert {b.category for b in r.buffers if b.nbytes == dk and b.category in temps} == {
        "gradient"
    }, str(r)


def test_donated_arguments_are_named_by_pytree_path():
    # A donated argument's allocation also holds the output written into it: the argument is
    # still named by its own path.
    def step(p, x):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x))

    r = rn.explain_peak(step, PARAMS, X, jit_kwargs={"donate_argnums": 0})
    assert _arguments(r) == _expected_arguments("argument: p (donated)"), str(r)
