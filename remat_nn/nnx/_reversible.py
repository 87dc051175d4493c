"""``ReversibleSequence`` for Flax NNX: a stack of couplings whose backward stores no activations.

A thin layer over the pure core, :func:`remat_nn.reversible_scan`: the layers are built by one
``nnx.vmap`` under ``nnx.split_rngs`` (the layout ``nnx.scan`` takes) and split into parameters
and per-layer state at call time; F and G draw their keys from the layer's stream state before
the call, so the backward's reconstruction replays the forward's dropout masks. How the layers,
the state and the RNG streams are handled: docs/library.md, "Flax NNX".

References:
  Gomez et al. (2017). The Reversible Residual Network: Backpropagation Without Storing
  Activations. NeurIPS. https://arxiv.org/abs/1707.04585
  Kitaev et al. (2020). Reformer: The Efficient Transformer. ICLR.
  https://arxiv.org/abs/2001.04451
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from remat_nn._coupling import ReversibleBlock, coupling_block
from remat_nn._halves import merge_halves, split_halves
from remat_nn._reversible import inverse_scan, plain_scan, reversible_scan
from remat_nn.nnx._coupling import Coupling

__all__ = ["ReversibleSequence", "coupling_layer"]

# How one layer's state is split: parameters (differentiated), then the per-layer constants.
_FILTERS = (nnx.Param, nnx.RngKey, nnx.RngCount, ...)


def _residual(
    graphdef: nnx.GraphDef, method: str, salt: int, kwargs: dict[str, Any]
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """One layer's ``(params, consts, x) -> (out, new_consts)`` through ``graphdef``."""

    def fn(params: Any, consts: Any, x: Any) -> tuple[Any, Any]:
        keys = jax.tree.map(lambda k: jax.random.fold_in(k, salt), consts["keys"])
        layer = nnx.merge(graphdef, params, keys, consts["counts"], consts["rest"], copy=True)
        out = getattr(layer, method)(x, **kwargs)
        rest = nnx.split(layer, *_FILTERS)[-1]  # BatchNorm averages as updated by this call
        return out, {**consts, "rest": rest}

    return fn


def _block(
    graphdef: nnx.GraphDef, layer: Any, kwargs: dict[str, Any], compute_dtype: Any
) -> ReversibleBlock:
    if isinstance(layer, Coupling):
        return coupling_block(
            _residual(graphdef, "apply_f", 0, kwargs),
            _residual(graphdef, "apply_g", 1, kwargs),
            combine=layer.combine,
            uncombine=layer.uncombine,
            compute_dtype=compute_dtype,
        )
    # Any module with forward / inverse: correct, with a 5/3-FLOP backward (inverse, then the
    # forward again under jax.vjp).
    forward = _residual(graphdef, "forward", 0, kwargs)
    inverse = _residual(graphdef, "inverse", 0, kwargs)
    return ReversibleBlock(forward, lambda p, c, y: inverse(p, c, y)[0])


class ReversibleSequence(nnx.Module):
    """``depth`` reversible layers in one scan, with a backward that reconstructs activations.

    The NNX counterpart of :class:`remat_nn.nn.ReversibleSequence` (same options, same core):
    with ``reversible=True`` the gradient is a ``jax.custom_vjp`` whose forward saves only the
    output (plus parameters and per-layer state) and whose backward reconstructs each layer's
    input from its output: activation memory is flat in depth, at 4/3 of the matmul FLOPs of a
    stored-activation gradient for couplings.

    Args:
      make_layer: ``make_layer(rngs) -> layer``, building one layer: an
        :class:`AdditiveCoupling` / :class:`AffineCoupling` (any NNX module with ``forward`` /
        ``inverse`` also works, with a 5/3-FLOP backward). Called once under ``nnx.vmap``.
      depth: number of layers.
      rngs: the ``nnx.Rngs`` the layers are initialized from (split per layer).
      anchor_every: store the layer input every ``anchor_every`` layers (drift control); must
        divide ``depth``. ``None``: store nothing but the output.
      recon_dtype: carry the residual stream, and reconstruct, in this dtype (e.g.
        ``jnp.float32`` while F and G compute in bfloat16).
      reversible: ``False``: the same network (same variables, keys, results) with plain
        autodiff through the scan, storing every layer's activations.
      unroll: ``unroll`` of the scans over layers, see :func:`remat_nn.reversible_scan`.
      drift_rtol, fallback: the backward's measured drift check and what a drifted layer gets
        (``"error"``, ``"recompute"``, ``"none"``), see :func:`remat_nn.reversible_scan`.

    Inputs and outputs are a pair ``(x1, x2)`` or one array split on (and merged back on) its
    last axis. Keyword arguments of ``__call__`` (e.g. ``train=True``) must be static Python
    values; they are passed to F and G. BatchNorm running averages are updated once, by the
    forward pass.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import remat_nn as rn
    >>> from remat_nn import nnx as rnnx
    >>> init = nnx.initializers.normal(0.1)
    >>> dense = lambda rngs: nnx.Linear(4, 4, kernel_init=init, rngs=rngs)
    >>> coupling = lambda rngs: rnnx.AdditiveCoupling(dense(rngs), dense(rngs))
    >>> stack = rnnx.ReversibleSequence(coupling, depth=6, rngs=nnx.Rngs(0))
    >>> stack.layers.f.kernel.shape                             # stacked: (depth, 4, 4)
    (6, 4, 4)
    >>> x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)           # halves (2, 4) and (2, 4)
    >>> loss = lambda m: jnp.sum(m(x) ** 2)
    >>> grads = nnx.jit(nnx.grad(loss))(stack)                  # reconstructs, stores nothing
    >>> stack.reversible = False                                # same network, plain autodiff
    >>> ref = nnx.jit(nnx.grad(loss))(stack)
    >>> rn.relative_error(grads, ref) < 1e-5                    # max|a - b| / max|b| per leaf
    True

    References:
      Gomez et al. (2017), The Reversible Residual Network; Kitaev et al. (2020), Reformer.
    """

    def __init__(
        self,
        make_layer: Callable[[nnx.Rngs], nnx.Module],
        depth: int,
        *,
        rngs: nnx.Rngs,
        anchor_every: int | None = None,
        recon_dtype: Any = None,
        reversible: bool = True,
        unroll: int | bool | None = None,
        drift_rtol: float | None = None,
        fallback: str = "error",
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(
                f"ReversibleSequence: argument `depth` must be a positive int, got {depth!r}. "
                "Fix: ReversibleSequence(make_layer, depth=8, rngs=nnx.Rngs(0))."
            )
        if not callable(make_layer) or isinstance(make_layer, nnx.Module):
            raise TypeError(
                f"ReversibleSequence: argument `make_layer` must be a function rngs -> layer "
                f"(called once per layer under nnx.vmap), got {type(make_layer).__name__}. Fix: "
                "ReversibleSequence(lambda rngs: rnnx.AdditiveCoupling(F(rngs), G(rngs)), ...)."
            )
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"ReversibleSequence: argument `rngs` must be an nnx.Rngs, got "
                f"{type(rngs).__name__}. Fix: rngs=nnx.Rngs(0)."
            )

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> nnx.Module:
            return make_layer(rngs)

        self.layers = create(rngs)
        for method in ("forward", "inverse"):
            if not callable(getattr(self.layers, method, None)):
                raise TypeError(
                    f"ReversibleSequence: `make_layer` must build a module with `forward` and "
                    f"`inverse` methods, got {type(self.layers).__name__}. Fix: "
                    "lambda rngs: rnnx.AdditiveCoupling(F(rngs), G(rngs))."
                )
        self.depth = depth
        self.anchor_every = anchor_every
        self.recon_dtype = recon_dtype
        self.reversible = reversible
        self.unroll = unroll
        self.drift_rtol = drift_rtol
        self.fallback = fallback

    def _run(self, x: Any, kwargs: dict[str, Any], *, inverse: bool) -> Any:
        for key, value in kwargs.items():
            if isinstance(value, jax.Array):
                raise TypeError(
                    f"ReversibleSequence: keyword argument {key}= must be a static Python value "
                    f"(it is passed to every layer as a constant), got an array {value!r}. Fix: "
                    "pass flags such as train=True as Python bools; pass arrays inside x."
                )
        is_coupling = isinstance(self.layers, Coupling)
        pair, was_array = split_halves(x) if is_coupling else (x, False)
        graphdef, params, keys, counts, rest = nnx.split(self.layers, *_FILTERS)
        dtypes = {a.dtype for a in jax.tree.leaves(pair)}
        compute_dtype = jnp.result_type(*dtypes) if self.recon_dtype is not None else None
        block = _block(graphdef, self.layers, kwargs, compute_dtype)
        consts = {"keys": keys, "counts": counts, "rest": rest}
        common = {"recon_dtype": self.recon_dtype, "unroll": self.unroll}
        if inverse:
            out = inverse_scan(block, params, pair, consts, **common)
        else:
            if self.reversible:
                out, new = reversible_scan(
                    block,
                    params,
                    pair,
                    consts,
                    anchor_every=self.anchor_every,
                    drift_rtol=self.drift_rtol,
                    fallback=self.fallback,
                    **common,
                )
            else:
                out, new = plain_scan(block, params, pair, consts, **common)
            new_counts = jax.tree.map(lambda n: n + 1, counts)  # next call: new masks
            nnx.update(self.layers, new_counts, new["rest"])
        return merge_halves(out, was_array) if is_coupling else out

    def forward(self, x: Any, **kwargs: Any) -> Any:
        """Applies the ``depth`` layers.

        Args:
          x: a pair ``(x1, x2)`` or one array split in halves on its last axis.
          **kwargs: static keyword arguments for F and G (e.g. ``train=True``).

        Returns:
          The output of the last layer, in the form of ``x``.
        """
        return self._run(x, kwargs, inverse=False)

    def inverse(self, y: Any, **kwargs: Any) -> Any:
        """Reconstructs the input of :meth:`forward` from its output (layers in reverse).

        Uses the keys the last :meth:`forward` used only if called before it advanced them:
        call it on a copy taken before the forward pass (``nnx.clone``) to check reconstruction
        under dropout; without RNG streams it needs nothing.
        """
        return self._run(y, kwargs, inverse=True)

    def __call__(self, x: Any, **kwargs: Any) -> Any:
        """Same as :meth:`forward`."""
        return self.forward(x, **kwargs)


def coupling_layer(
    sequence: ReversibleSequence, *, compute_dtype: Any = None, **kwargs: Any
) -> ReversibleBlock:
    """One layer of an NNX :class:`ReversibleSequence` of couplings, as the sequence runs it.

    The NNX twin of :func:`remat_nn.nn.coupling_layer`, for a caller that scans the layers
    itself (e.g. :func:`remat_nn.fused_update_stages`): ``forward`` / ``inverse`` / the fused
    ``backward`` of the sequence's own block, over one layer's variables as pure dicts
    (``nnx.to_pure_dict(state)``, the layout ``nnx.bridge.to_linen`` stores) with the layer
    axis removed: ``params`` its ``nnx.Param`` s, ``state`` the others (BatchNorm's averages).
    ``forward`` returns the updated ``state`` (training-mode BatchNorm's running averages), as
    the sequence's forward pass does; ``inverse`` and ``backward`` run with ``state`` and drop
    their updates.

    Args:
      sequence: the sequence (an abstract one from ``nnx.eval_shape`` will do: only its
        structure is read), its layers couplings without RNG streams.
      compute_dtype: the dtype F and G receive their inputs in (the sequence's, under
        ``recon_dtype``: the input's dtype); None: the stream's.
      **kwargs: static keyword arguments for F and G (e.g. ``train=True``).

    Raises:
      TypeError: ``sequence`` is not a ``ReversibleSequence`` of couplings.
      ValueError: its layers hold RNG streams (this block draws no keys).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from remat_nn import nnx as rnnx
    >>> dense = lambda rngs: nnx.Linear(2, 2, rngs=rngs)
    >>> seq = rnnx.ReversibleSequence(
    ...     lambda rngs: rnnx.AdditiveCoupling(dense(rngs), dense(rngs)), 3, rngs=nnx.Rngs(0)
    ... )
    >>> layer = rnnx.coupling_layer(seq)
    >>> params = nnx.to_pure_dict(nnx.state(seq.layers, nnx.Param))  # stacked: (3, ...)
    >>> x = (jnp.ones((1, 2)), jnp.zeros((1, 2)))
    >>> y, _ = jax.lax.scan(lambda h, p: (layer.forward(p, {}, h)[0], None), x, params)
    >>> bool(jnp.allclose(jnp.concatenate(y, -1), seq(jnp.concatenate(x, -1))))
    True
    """
    if not isinstance(sequence, ReversibleSequence) or not isinstance(sequence.layers, Coupling):
        raise TypeError(
            f"coupling_layer: `sequence` must be a ReversibleSequence of couplings, got "
            f"{type(sequence).__name__}. Fix: rnnx.ReversibleSequence(lambda rngs: "
            "rnnx.AdditiveCoupling(F(rngs), G(rngs)), depth, rngs=rngs)."
        )
    graphdef, _, keys, counts, _ = nnx.split(sequence.layers, *_FILTERS)
    if jax.tree.leaves((keys, counts)):
        streams = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(keys)]
        raise ValueError(
            f"coupling_layer: the sequence's layers hold RNG streams {streams}, and this layer "
            "draws no keys (its dropout masks would not be the sequence's). Fix: build F and G "
            "without nnx.Rngs streams (e.g. no Dropout), or call the sequence itself."
        )
    block = _block(graphdef, sequence.layers, kwargs, compute_dtype)
    backward = block.backward
    assert backward is not None  # a coupling's block has its fused backward

    def consts(state: Any) -> dict[str, Any]:
        return {"keys": keys, "counts": counts, "rest": state}

    def forward(p: Any, state: Any, x: Any) -> tuple[Any, Any]:
        y, new = block.forward(p, consts(state), x)
        return y, nnx.to_pure_dict(new["rest"])

    return ReversibleBlock(
        forward,
        lambda p, state, y: block.inverse(p, consts(state), y),
        lambda p, state, y, dy: backward(p, consts(state), y, dy),
    )
