"""Slices that tile their operand rebuild it together (remat_nn/invertible/_tiling.py, #44).

A coupling's input is often split with slices (``x[:, :8], x[:, 8:]``) or RealNVP / Glow masks
(``x[:, ::2], x[:, 1::2]``) rather than ``jnp.split``: separate ``slice`` equations, none of which
determines ``x``. Guarantees tested: such a set (contiguous or strided, on any axis, of equal
reshapes, three pieces, a subset of the slices) is inverted, stores nothing but the weights and
gives ``jax.grad``'s gradient; the operand is rebuilt bit for bit in every dtype; slices with a gap
or an overlap are refused with the count of elements at fault (or recomputed from the kept input
with ``fallback="recompute"``); a wrong assembly is caught by the gradient comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from remat_nn.invertible import _tiling
from tests.gradients import rel_err

B, W = 4, 16  # batch, width of the coupling's input


def _stack(split, merge, depth=2):
    """Couplings over the pieces ``split(x * (1.5 + tanh(s)))``: each piece gets ``tanh`` of
    the others' update, weights ``ws[layer][piece]`` of shape (width of the others, width of
    the piece). The backward rebuilds ``x * (1.5 + tanh(s))`` from the pieces, then ``x`` from
    it, and the gradient of ``s`` depends on that ``x`` (as in test_invertible_rules.py): a
    wrong assembly gives a wrong gradient."""

    def f(x, ws, s):
        parts = list(split(x * (1.5 + jnp.tanh(s))))
        for layer in range(depth):
            for j in range(len(parts)):
                others = jnp.concatenate([p for k, p in enumerate(parts) if k != j], axis=-1)
                parts[j] = parts[j] + jnp.tanh(others @ ws[layer][j])
        return merge(parts)

    return f


def _weights(split, x, depth=2, seed=0):
    widths = [p.shape[-1] for p in split(x)]
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), depth * len(widths)))
    return [
        [0.3 * jax.random.normal(next(keys), (sum(widths) - w, w)) for w in widths]
        for _ in range(depth)
    ]


def _rows(x):
    """Axis 0 brought to the last axis, so the pieces' features are what the coupling mixes."""
    return x.T


# name -> (the input's shape, split); the pieces are joined back with concatenate on axis -1
TILINGS = {
    "contiguous_last_axis": ((B, W), lambda x: (x[:, :8], x[:, 8:])),
    "strided_last_axis": ((B, W), lambda x: (x[:, ::2], x[:, 1::2])),
    "contiguous_axis_0": ((W, B), lambda x: (_rows(x[:8]), _rows(x[8:]))),
    "strided_axis_0": ((W, B), lambda x: (_rows(x[::2]), _rows(x[1::2]))),
    "three_pieces": ((B, W), lambda x: (x[:, :4], x[:, 4:10], x[:, 10:])),
    "contiguous_and_strided": ((B, W), lambda x: (x[:, :8], x[:, 8::2], x[:, 9::2])),
    "after_reshape": ((B, W), lambda x: (x.reshape(B, 8, 2)[..., 0], x.reshape(B, 8, 2)[..., 1])),
    "after_transpose": ((W, B), lambda x: (x.T[:, 1::2], x.T[:, ::2])),
}


def _case(name):
    shape, split = TILINGS[name]
    x = jax.random.normal(jax.random.PRNGKey(1), shape)
    f = _stack(split, lambda parts: jnp.concatenate(parts, axis=-1))
    return f, (x, _weights(split, x), 0.5 * jnp.cos(x))


def _loss(f):
    return lambda *args: jnp.sum(jnp.sin(f(*args)))


def _grad(f):
    return jax.grad(_loss(f), argnums=(0, 1, 2))


@pytest.mark.parametrize("name", sorted(TILINGS))
def test_tiling_slices_are_inverted_and_gradients_match(name):
    f, args = _case(name)
    report = rn.inversion_report(rn.invertible(f), *args)
    assert report.invertible, str(report)  # x is rebuilt: only the weights are stored
    ws = args[1]
    assert [n for n, _ in report.stored_inputs] == [
        f"args[1][{i}][{j}]" for i in range(len(ws)) for j in range(len(ws[0]))
    ] + ["args[2]"]
    assert any("slices that tile it" in e.detail for e in report.entries), str(report)
    want = _grad(f)(*args)
    for transform in (lambda g: g, jax.jit):
        assert rel_err(transform(_grad(rn.invertible(f)))(*args), want) <= 1e-5


def test_a_wrongly_assembled_operand_is_caught(monkeypatch):
    """Mutation check: pieces put back in the wrong places (each tiling's first two swapped)
    give a wrong gradient, so the comparison above sees the assembly."""
    assemble = _tiling.assemble

    def swapped(shape, slices, pieces):
        pieces = list(pieces)
        if len(pieces) > 1 and pieces[0].shape == pieces[1].shape:
            pieces[0], pieces[1] = pieces[1], pieces[0]
        return assemble(shape, slices, pieces)

    monkeypatch.setattr(_tiling, "assemble", swapped)
    for name in ("contiguous_last_axis", "strided_axis_0"):
        f, args = _case(name)
        assert rel_err(_grad(rn.invertible(f))(*args), _grad(f)(*args)) > 1e-2


@pytest.mark.parametrize(
    "x",
    [
        np.array([[0.0, -0.0, np.nan, -np.inf, 1e-45, 3.0, -2.5, 7.0]] * 3, np.float32),
        np.arange(24, dtype=np.int32).reshape(3, 8) - 12,
        np.arange(24, dtype=np.uint8).reshape(3, 8),
        (np.arange(24).reshape(3, 8) % 3 == 0),
        np.array([[0.0, -0.0, 1.5, -3.0, 65504.0, 6e-8, -1.0, 2.0]] * 3, jnp.bfloat16),
    ],
    ids=["float32_specials", "int32", "uint8", "bool", "bfloat16"],
)
def test_the_operand_is_rebuilt_bit_for_bit_in_every_dtype(x):
    """Pure data movement: -0.0 stays -0.0 and NaN stays NaN (an assembly that adds zeros
    would turn -0.0 into 0.0), integers and bools come back unchanged."""
    for split in (
        lambda x: (x[:, 1::2], x[:, ::2]),
        lambda x: (x[1:], x[:1]),
        lambda x: (x[:, :3], x[:, 3::2], x[:, 4::2]),
    ):
        (rebuilt,), _ = rn.invertible(split).reconstruct(jnp.asarray(x))
        np.testing.assert_array_equal(
            np.asarray(rebuilt).view(np.uint8), np.asarray(jnp.asarray(x)).view(np.uint8)
        )


def test_a_slice_beside_a_tiling_does_not_stop_it():
    """``x[:, 4:12]`` overlaps both halves (so the slices together do not tile ``x``); the
    halves alone do, and rebuild ``x`` for the VJP of ``tanh`` at ``x[:, 4:12]``."""

    def f(x, s):
        x = x * (1.5 + jnp.tanh(s))
        return 2.0 * x[:, :8], x[:, 8:] + 1.0, jnp.tanh(x[:, 4:12])

    x = jax.random.normal(jax.random.PRNGKey(2), (B, W))
    args = (x, jnp.cos(x))
    assert rn.inversion_report(rn.invertible(f), *args).invertible
    loss = lambda g: lambda *a: sum(jnp.sum(jnp.sin(y)) for y in g(*a))  # noqa: E731
    got = jax.grad(loss(rn.invertible(f)), argnums=(0, 1))(*args)
    assert rel_err(got, jax.grad(loss(f), argnums=(0, 1))(*args)) <= 1e-5


@pytest.mark.parametrize(
    ("split", "fault"),
    [
        (lambda x: (x[:, :7], x[:, 8:]), "of its 64 elements, 4 are in none"),
        (lambda x: (x[:, :9], x[:, 8:]), "of its 64 elements, 4 are in more than one"),
        (lambda x: (x[:, ::2], x[:, 1::4]), "of its 64 elements, 16 are in none"),
        (lambda x: (x[:, ::2], x[:, 1:12:2], x[:, 11::2]), "4 are in more than one"),
    ],
    ids=["gap", "overlap", "strided_gap", "strided_overlap"],
)
def test_slices_that_do_not_tile_are_refused_or_recomputed(split, fault):
    f = _stack(split, lambda parts: jnp.concatenate(parts, axis=-1), depth=1)
    x = jax.random.normal(jax.random.PRNGKey(3), (B, W))
    args = (x, _weights(split, x, depth=1), jnp.cos(x))
    with pytest.raises(rn.NotInvertibleError, match="`slice` at .*a slice holds only part") as e:
        rn.invertible(f)(*args)
    assert fault in str(e.value) and "x[:, ::2] and x[:, 1::2]" in str(e.value)
    # With fallback="recompute" the operand is kept and the slices recomputed from it.
    got = _grad(rn.invertible(f, fallback="recompute"))(*args)
    assert rel_err(got, _grad(f)(*args)) <= 1e-5
