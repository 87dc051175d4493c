"""``ReversibleSequence``: a stack of couplings whose backward stores no activations.

The module is a thin wrapper over :func:`remat_nn.reversible_scan`: it initializes ``depth``
copies of a coupling with parameters stacked on a leading axis (one ``jax.vmap`` of the
coupling's ``init``), and at apply time runs ``coupling.apply`` on one layer's slice of the
variables inside ``lax.scan``. The same template runs in the forward pass and in the backward's
reconstruction, with the same per-layer PRNG keys (the layer index folded into the module's
key), so dropout masks match.

Variables (``L = depth``): ``params/layers`` holds the coupling's parameter tree with every leaf
stacked to ``(L, ...)``; any other collection the coupling creates (``batch_stats``) is stacked
the same way under ``<collection>/layers``.

References:
  Gomez et al. (2017). The Reversible Residual Network: Backpropagation Without Storing
  Activations. NeurIPS. https://arxiv.org/abs/1707.04585
  Kitaev et al. (2020). Reformer: The Efficient Transformer. ICLR.
  https://arxiv.org/abs/2001.04451
  MemCNN (Van de Leemput et al. 2019). https://github.com/silvandeleemput/memcnn
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp

from remat_nn._coupling import ReversibleBlock, coupling_block
from remat_nn._halves import merge_halves, split_halves
from remat_nn._reversible import inverse_scan, plain_scan, reversible_scan
from remat_nn.nn._coupling import Coupling

__all__ = ["ReversibleSequence", "coupling_layer"]

_VARIABLE = "layers"


def _residual(
    template: fnn.Module, method: str, kwargs: dict[str, Any], state_cols: Sequence[str]
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """One layer's ``(params, consts, x) -> (out, new_consts)`` through ``template.apply``."""

    def fn(params: Any, consts: Any, x: Any) -> tuple[Any, Any]:
        variables = {"params": params, **consts["state"]}
        # Non-parameter collections are always mutable here, so training-mode BatchNorm can
        # run; the caller decides whether the updates are kept (forward) or dropped (backward).
        out = template.apply(
            variables,
            x,
            method=method,
            rngs=consts["rngs"],
            mutable=list(state_cols) or False,
            **kwargs,
        )
        if not state_cols:
            return out, consts
        out, updates = out
        return out, {"state": {**consts["state"], **updates}, "rngs": consts["rngs"]}

    return fn


def _block(
    template: fnn.Module, kwargs: dict[str, Any], state_cols: Sequence[str], compute_dtype: Any
) -> ReversibleBlock:
    if isinstance(template, Coupling):
        return coupling_block(
            _residual(template, "apply_f", kwargs, state_cols),
            _residual(template, "apply_g", kwargs, state_cols),
            combine=template.combine,
            uncombine=template.uncombine,
            compute_dtype=compute_dtype,
        )
    # Any module with forward / inverse: correct, but the backward runs the inverse and then
    # the forward again under jax.vjp (5/3 of stored-activation FLOPs instead of 4/3).
    forward = _residual(template, "forward", kwargs, state_cols)
    inverse = _residual(template, "inverse", kwargs, state_cols)
    return ReversibleBlock(forward, lambda p, c, y: inverse(p, c, y)[0])


def coupling_layer(
    coupling: Coupling,
    *,
    compute_dtype: Any = None,
    state_collections: Sequence[str] = (),
    **kwargs: Any,
) -> ReversibleBlock:
    """One layer of a :class:`ReversibleSequence` of ``coupling``, as the sequence runs it.

    For a caller that scans the layers itself (e.g. :func:`remat_nn.fused_update_step`'s
    ``backward_fn``): ``forward`` / ``inverse`` / the fused ``backward`` over one layer's
    parameters, with F and G computing in ``compute_dtype`` (None: the stream's dtype). Without
    ``state_collections`` the ``consts`` arguments are ignored (pass None); with them,
    ``consts`` is one layer's variables of those collections (``{"batch_stats": ...}``), and
    ``forward`` returns the updated ones (training-mode BatchNorm's running averages), as the
    sequence's forward pass does; ``inverse`` and ``backward`` run with ``consts`` and drop
    their updates. No random numbers (dropout) are drawn.

    Args:
      coupling: the layer, an :class:`AdditiveCoupling` / :class:`AffineCoupling`.
      compute_dtype: the dtype F and G receive their inputs in (the sequence's, under
        ``recon_dtype``: the input's dtype).
      state_collections: the non-parameter collections F and G read and update, e.g.
        ``("batch_stats",)``.
      **kwargs: static keyword arguments for F and G (e.g. ``train=True``).
    """
    if not isinstance(coupling, Coupling):
        raise TypeError(
            f"coupling_layer: `coupling` must be a coupling module, got "
            f"{type(coupling).__name__}. Fix: nn.AdditiveCoupling(F(), G())."
        )
    cols = list(state_collections)
    block = _block(coupling.copy(parent=None), kwargs, cols, compute_dtype)
    backward = block.backward
    assert backward is not None  # a coupling's block has its fused backward

    def consts(state: Any) -> dict[str, Any]:
        return {"state": state if cols else {}, "rngs": {}}

    def forward(p: Any, state: Any, x: Any) -> tuple[Any, Any]:
        y, new = block.forward(p, consts(state), x)
        return y, new["state"] if cols else state

    return ReversibleBlock(
        forward,
        lambda p, state, y: block.inverse(p, consts(state), y),
        lambda p, state, y, dy: backward(p, consts(state), y, dy),
    )


class ReversibleSequence(fnn.Module):
    """``depth`` reversible couplings in one scan, with a backward that reconstructs activations.

    Parameters are stacked (leading axis ``depth``) and the layers run in one ``lax.scan``, so
    the stack compiles once. With ``reversible=True`` the gradient is a ``jax.custom_vjp`` whose
    forward saves only the output (plus parameters), and whose backward reconstructs each
    block's input from its output (``coupling.inverse``) and takes the block's VJP there:
    activation memory is flat in depth, at 4/3 of the matmul FLOPs of a stored-activation
    gradient for couplings.

    Inputs and outputs are a pair ``(x1, x2)`` or one array split on (and merged back on) its
    last axis, as for the couplings. Keyword arguments of ``__call__`` (e.g. ``train=True``)
    must be static Python values; they are passed to F and G.

    Dropout: the module draws one key per stream in ``rng_names`` and folds in the layer index,
    so layer ``i`` sees the same key in the forward pass and in the reconstruction.
    BatchNorm: collections other than ``params`` are stacked per layer; in training mode the
    running averages are updated once, by the forward pass (apply with
    ``mutable=["batch_stats"]``); the backward recomputes F and G with the same batch
    statistics and discards their updates. At eval (``use_running_average=True``) the running
    averages are used and nothing needs to be mutable.

    Attributes:
      coupling: the layer template, an :class:`AdditiveCoupling` / :class:`AffineCoupling`
        (any module with ``forward`` / ``inverse`` methods also works, with a 5/3-FLOP
        backward). Its variables are created by this module, stacked.
      depth: number of layers.
      anchor_every: store the block input every ``anchor_every`` layers so reconstruction drift
        accumulates over at most that many layers (costs ``depth / anchor_every - 1`` stored
        inputs); must divide ``depth``. ``None``: store nothing but the output.
      recon_dtype: carry the residual stream between layers, and reconstruct, in this dtype
        (e.g. ``jnp.float32``) while F and G compute in the input's dtype (e.g. bfloat16). The
        output is cast back to the input's dtype.
      reversible: ``False`` gives the same network (same variables, keys, results) with plain
        autodiff through the scan, storing every layer's activations: the baseline.
      rng_names: PRNG streams handed to the layers (one key per layer, folded from the
        module's key of that stream).
      unroll: ``unroll`` of the scans over layers (forward, backward, inverse), see
        :func:`remat_nn.reversible_scan`: a positive int or ``True``; ``None`` (default):
        ``True`` on CPU if the coupling convolves, else ``1`` (the faster on each backend:
        benchmarks/results/revnet.md, "Unrolled reversible stacks"). Speed and compile time
        only: the same variables, results and stored activations.
      drift_rtol: the largest relative drift a rebuilt layer input may have, measured in the
        backward against random projections of the true input kept by the forward
        (:func:`remat_nn.reversible_scan`; ``None``: 2048 times the epsilon of the narrowest
        float the stream or the coupling computes in: float32 2.4e-4, bfloat16 0.1, raised
        for an ill-conditioned stack: see :func:`remat_nn.reversible_scan`).
      fallback: a layer whose rebuilt input drifted further: ``"error"`` (default) raises
        :class:`remat_nn.NotInvertibleError`; ``"recompute"`` recomputes its input from the
        nearest kept value (the stack's input or an anchor; more temporary memory); ``"none"``
        checks nothing.

    >>> import jax, jax.numpy as jnp, flax.linen as fnn, remat_nn as rn
    >>> from remat_nn import nn
    >>> dense = lambda: fnn.Dense(4, kernel_init=fnn.initializers.normal(0.1))  # small updates
    >>> stack = nn.ReversibleSequence(nn.AdditiveCoupling(dense(), dense()), depth=6)
    >>> x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)           # halves (2, 4) and (2, 4)
    >>> variables = jax.jit(stack.init)(jax.random.key(0), x)
    >>> variables["params"]["layers"]["f"]["kernel"].shape      # stacked: (depth, 4, 4)
    (6, 4, 4)
    >>> def loss(params, module=stack):
    ...     return jnp.sum(module.apply({"params": params}, x) ** 2)
    >>> grads = jax.jit(jax.grad(loss))(variables["params"])   # reconstructs, stores nothing
    >>> plain = stack.copy(reversible=False)                   # same network, plain autodiff
    >>> ref = jax.jit(jax.grad(lambda p: loss(p, plain)))(variables["params"])
    >>> rn.relative_error(grads, ref) < 1e-5                    # max|a - b| / max|b| per leaf
    True

    References:
      Gomez et al. (2017), The Reversible Residual Network; Kitaev et al. (2020), Reformer: The
      Efficient Transformer; MemCNN (Van de Leemput et al. 2019).
    """

    coupling: fnn.Module
    depth: int
    anchor_every: int | None = None
    recon_dtype: Any = None
    reversible: bool = True
    rng_names: Sequence[str] = ("dropout",)
    unroll: int | bool | None = None
    drift_rtol: float | None = None
    fallback: str = "error"

    # --- helpers ----------------------------------------------------------------------------------

    def _check(self, kwargs: dict[str, Any]) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(
                f"ReversibleSequence: `depth` must be a positive int, got {self.depth!r}. "
                "Fix: ReversibleSequence(coupling, depth=8)."
            )
        for method in ("forward", "inverse"):
            if not callable(getattr(self.coupling, method, None)):
                raise TypeError(
                    f"ReversibleSequence: `coupling` must be a flax module with `forward` and "
                    f"`inverse` methods, got {type(self.coupling).__name__}. Fix: "
                    "nn.AdditiveCoupling(F(), G()) or nn.AffineCoupling(F(), G())."
                )
        for key, value in kwargs.items():
            if isinstance(value, jax.Array):
                raise TypeError(
                    f"ReversibleSequence: keyword argument {key}= must be a static Python value "
                    f"(it is passed to every layer as a constant), got an array {value!r}. Fix: "
                    "pass flags such as train=True as Python bools; pass arrays inside x."
                )

    def _template(self) -> fnn.Module:
        # An unbound deep copy: applied on explicit per-layer variables, never bound to self.
        return self.coupling.copy(parent=None)

    def _layer_rngs(self) -> dict[str, jax.Array]:
        rngs = {}
        layers = jnp.arange(self.depth)
        for stream in self.rng_names:
            # make_rng falls back to the "params" stream (at init), as flax does.
            if self.has_rng(stream) or self.has_rng("params"):
                key = self.make_rng(stream)
                rngs[stream] = jax.vmap(lambda i, k=key: jax.random.fold_in(k, i))(layers)
        return rngs

    def _layer_variables(
        self, template: fnn.Module, x: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        if not self.has_variable("params", _VARIABLE):
            keys = jax.random.split(self.make_rng("params"), self.depth)
            stacked = jax.vmap(
                lambda k: template.init({"params": k}, x, method="forward", **kwargs)
            )(keys)
            self.param(_VARIABLE, lambda _: stacked["params"])
            for col, value in stacked.items():
                if col != "params":
                    self.variable(col, _VARIABLE, lambda v=value: v)
        params = self.get_variable("params", _VARIABLE)
        state = {
            col: self.get_variable(col, _VARIABLE)
            for col in self.variables
            if col != "params" and self.has_variable(col, _VARIABLE)
        }
        sizes = {leaf.shape[0] for leaf in jax.tree.leaves((params, state))}
        if sizes and sizes != {self.depth}:
            raise ValueError(
                f"ReversibleSequence: the stacked variables have leading sizes {sorted(sizes)}, "
                f"but depth={self.depth}. Fix: re-initialize the variables for this depth."
            )
        return params, state

    def _run(self, x: Any, kwargs: dict[str, Any], *, inverse: bool) -> Any:
        self._check(kwargs)
        template = self._template()
        is_coupling = isinstance(template, Coupling)
        pair, was_array = split_halves(x) if is_coupling else (x, False)
        params, state = self._layer_variables(template, pair, kwargs)
        dtypes = {a.dtype for a in jax.tree.leaves(pair)}
        compute_dtype = jnp.result_type(*dtypes) if self.recon_dtype is not None else None
        block = _block(template, kwargs, list(state), compute_dtype)
        consts = {"state": state, "rngs": self._layer_rngs()}
        if inverse:
            out = inverse_scan(
                block, params, pair, consts, recon_dtype=self.recon_dtype, unroll=self.unroll
            )
        else:
            if self.reversible:
                out, new_consts = reversible_scan(
                    block,
                    params,
                    pair,
                    consts,
                    anchor_every=self.anchor_every,
                    recon_dtype=self.recon_dtype,
                    unroll=self.unroll,
                    drift_rtol=self.drift_rtol,
                    fallback=self.fallback,
                )
            else:
                out, new_consts = plain_scan(
                    block, params, pair, consts, recon_dtype=self.recon_dtype, unroll=self.unroll
                )
            # flax semantics: BatchNorm does not update its averages during init.
            if not self.is_initializing():
                for col in state:
                    if self.is_mutable_collection(col):
                        self.put_variable(col, _VARIABLE, new_consts["state"][col])
        return merge_halves(out, was_array) if is_coupling else out

    # --- public -----------------------------------------------------------------------------------

    @fnn.compact
    def forward(self, x: Any, **kwargs: Any) -> Any:
        """Applies the ``depth`` layers; creates the stacked variables at init.

        Args:
          x: a pair ``(x1, x2)`` or one array split in halves on its last axis.
          **kwargs: static keyword arguments for F and G (e.g. ``train=True``).

        Returns:
          The output of the last layer, in the form of ``x``.
        """
        return self._run(x, kwargs, inverse=False)

    def inverse(self, y: Any, **kwargs: Any) -> Any:
        """Reconstructs the input of :meth:`forward` from its output (layers in reverse).

        Uses the same per-layer keys as :meth:`forward` when given the same ``rngs``. Needs
        existing variables (it does not initialize).

        Args:
          y: an output of :meth:`forward`.
          **kwargs: the keyword arguments given to :meth:`forward`.

        Returns:
          ``x`` with ``forward(x) == y`` up to reconstruction round-off.
        """
        return self._run(y, kwargs, inverse=True)

    def __call__(self, x: Any, **kwargs: Any) -> Any:
        """Same as :meth:`forward`."""
        return self.forward(x, **kwargs)
