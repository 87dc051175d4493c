"""rn.explain_peak's categories, each held to a program whose answer is known by construction.

The bytes of a peak report are XLA's own (tests/memory/test_peak.py); the labels are the
report's reading of them: a value of the backward pass is a ``gradient`` unless it is a forward
value the backward recomputes (``recomputed``), a forward value live across the end of the
forward pass is a ``saved residual``, any other forward value a ``transient``; arguments are
named by their pytree path, outputs are outputs. The program is a scanned two-layer MLP whose
values have distinct shapes, so each label can be checked on the value it must be:

- ``f32[L, B, H]``: the stack of the hidden activation ``wide`` (or of its tanh), saved by the
  scan under no remat and under ``save=wide``, absent under ``nothing_saveable``;
- ``f32[B, H]``: one layer's hidden activation, recomputed in the backward pass under any remat
  (under ``save=wide`` its tanh), never recomputed without remat;
- ``f32[L, D, H]`` / ``f32[L, H, D]``: the parameters (arguments) and their gradients (outputs).

Labels are checked over the whole schedule (``PeakReport.timeline``) where the peak's own
buffers depend on XLA's schedule, and on the peak's buffers where the value must be live there.
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
    args = {(b.shape, b.category, b.name) for b in r.buffers if b.category.startswith("arg")}
    assert args == {
        (f"f32[{L},{D},{H}]", "argument: p", "p['up']"),
        (f"f32[{L},{H},{D}]", "argument: p", "p['down']"),
        (f"f32[{B},{D}]", "argument: x", "x"),
    }, str(r)
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
    # reads it (d/dw sum(exp(x @ w)) = x.T @ exp(x @ w)): kept across the boundary, whichever
    # instruction XLA schedules last. A boundary one instruction early or late mislabels it.
    w, x = jax.ShapeDtypeStruct((D, H), jnp.float32), jax.ShapeDtypeStruct((B, D), jnp.float32)
    r = rn.explain_peak(jax.grad(lambda w, x: jnp.sum(jnp.exp(x @ w))), w, x)
    saved, transient = r.timeline["saved residual"], r.timeline["transient"]
    assert max(saved) >= ONE_HIDDEN and _most(r, "recomputed") == 0, str(r)
    # Where XLA materialises x @ w apart from its exp, that value is read by exp only: a
    # transient, and the residual (its exp) is made after it and lives on.
    first = next((t for t, n in enumerate(transient) if n >= ONE_HIDDEN), None)
    if first is not None:
        assert max(saved[first + 1 :], default=0) >= ONE_HIDDEN, str(r)
