"""A GPT-style decoder-only language model whose every activation a remat plan may want is named.

Readable in one sitting, nanoGPT style: token embedding (+ learned positions, or rotary), pre-norm
blocks (causal multi-head attention, then an MLP), a final LayerNorm and a linear head. Each
block tags its activations with the canonical names of :mod:`remat_nn.names`, so a memory plan
(:func:`remat_nn.plan`) can save, offload or recompute them one by one::

  decoder_layer_input -> LN -> query_proj / key_proj / value_proj -> attention_scores (softmax)
    -> context -> out_proj -> (+) -> LN = mlp_in -> mlp_hidden (gelu) -> mlp_out -> (+)

The memory plan is chosen by name from :data:`REMAT_PRESETS` (one dict, each entry documented
once) or among the library's policy names (``dots``, ...), or given per name with
``remat="custom"``. ``scan_layers=True`` runs the blocks with
``nn.scan`` (compiled once; the remat policy applies inside the scan body), ``reversible=True``
stacks them as additive couplings (attention as F, the MLP as G) so depth costs no activation
memory.

Shape legend: B batch, T sequence, D d_model, H heads, K head width (D // H), F d_ff, V vocab.

References:
  Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2).
  Kitaev, Kaiser, Levskaya 2020, "Reformer: The Efficient Transformer" (reversible layers).
  Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pydantic

import remat_nn as rn
from models._spec import (
    LayerStack,
    ModelSpec,
    at_least_float32,
    check_scan_levels,
    fused_unit_plan,
    nested_save_every,
    nesting_holds_fewer,
    remat_name,
)
from models.transformer_layers import MLP, Attention, Block
from remat_nn import names
from remat_nn import nn as rnn

__all__ = [
    "REMAT_PRESETS",
    "Block",
    "Transformer",
    "TransformerOptions",
    "build",
    "layer_stack",
    "remat_plan",
]

_QKV = (names.QUERY_PROJ, names.KEY_PROJ, names.VALUE_PROJ)
# The per-token projections (outputs of the weight matmuls that the backward pass reads). The
# MLP up-projection is named after its gelu (mlp_hidden), so gelu's backward still recomputes it.
_PROJECTIONS = (*_QKV, names.OUT_PROJ, names.MLP_HIDDEN)

#: Remat presets by name (MaxText's vocabulary), each a plan over the names above. ``none`` is
#: plain autodiff (no remat at all). ``custom`` is not here: it is the ``custom_plan`` option.
#:
#: - ``none``: no remat; reverse-mode stores whatever it needs.
#: - ``full``: recompute the whole block in the backward pass; only its input is kept.
#: - ``minimal``: save the per-token projections (q, k, v, out_proj, mlp_hidden); recompute the
#:   O(T^2) attention core, the norms and the MLP up-projection.
#: - ``save_qkv_proj``: save q, k, v only.
#: - ``save_dot_except_mlp``: save the attention projections q, k, v and out_proj, nothing of
#:   the MLP.
#: - ``save_out_proj``: save out_proj only.
#: - ``qkv_proj_offloaded``: offload q, k, v to pinned host memory, recompute the rest.
#: - ``minimal_offloaded``: ``minimal``'s names, offloaded to pinned host memory.
REMAT_PRESETS: Mapping[str, rn.Plan | None] = MappingProxyType(
    {
        "none": None,
        "full": rn.plan({"default": "recompute"}),
        "minimal": rn.plan({"save": list(_PROJECTIONS)}),
        "save_qkv_proj": rn.plan({"save": list(_QKV)}),
        "save_dot_except_mlp": rn.plan({"save": [*_QKV, names.OUT_PROJ]}),
        "save_out_proj": rn.plan({"save": [names.OUT_PROJ]}),
        "qkv_proj_offloaded": rn.plan({"offload": list(_QKV)}),
        "minimal_offloaded": rn.plan({"offload": list(_PROJECTIONS)}),
    }
)


def remat_plan(
    remat: str | rn.Plan, custom_plan: Mapping[str, Any] | None = None
) -> rn.Plan | str | None:
    """The plan a preset name stands for; ``"custom"`` builds ``custom_plan``; a plan is itself;
    a remat_nn policy name (``dots``, ...) is itself, resolved by the library in ``nn.remat``.

    Args:
      remat: a key of :data:`REMAT_PRESETS`, ``"custom"``, a policy name or alias of
        :data:`models._spec.POLICY_NAMES`, or a :class:`remat_nn.Plan`.
      custom_plan: the per-name mapping ``{"save": [...], "offload": [...], "recompute": [...],
        "default": ...}`` used when ``remat == "custom"``.

    Returns:
      The plan, the policy name, or None for ``"none"`` (no remat).

    Raises:
      ValueError: an unknown name, or ``custom`` without ``custom_plan`` (and vice versa).

    >>> remat_plan("save_qkv_proj").save
    ('query_proj', 'key_proj', 'value_proj')
    >>> remat_plan("dots")
    'dots'
    >>> p = rn.plan({"offload": ["mlp_hidden"]})
    >>> remat_plan(p) is p
    True
    """
    if isinstance(remat, rn.Plan):
        if custom_plan is not None:
            raise ValueError(
                f"transformer: custom_plan is only read with remat='custom', got a plan as remat "
                f"({remat}). Fix: drop custom_plan (the plan is the whole of it)."
            )
        return remat
    if remat == "custom":
        if custom_plan is None:
            raise ValueError(
                "transformer: remat='custom' needs the option custom_plan, e.g. "
                "custom_plan={'save': ['query_proj'], 'offload': ['mlp_hidden']}."
            )
        return rn.plan(custom_plan)
    if custom_plan is not None:
        raise ValueError(
            f"transformer: custom_plan is only read with remat='custom', got remat={remat!r}. "
            "Fix: set remat='custom' or drop custom_plan."
        )
    return remat_name(remat, presets=REMAT_PRESETS, model="transformer", also=("custom",))


# --- the model --------------------------------------------------------------------------------


class Transformer(fnn.Module):
    """Decoder-only LM: ``apply(variables, tokens (B, T) int32, train=bool) -> logits (B, T, V)``.

    Attributes:
      vocab_size: V.
      d_model: D.
      n_heads: H (divides D).
      n_layers: number of blocks.
      d_ff: MLP hidden width F.
      max_len: longest sequence (size of the learned position table).
      position: ``"learned"`` (GPT-2) or ``"rotary"`` (RoPE in every attention).
      scan_layers: run the blocks with ``nn.scan`` (parameters stacked on a leading layer axis).
      scan_levels: with ``scan_layers``, run the blocks as a nested checkpointed scan
        (``nn.remat_scan``, :func:`remat_nn.remat_scan`) of that many levels instead of
        ``nn.scan``: about ``levels * n_layers**(1/levels)`` block inputs held instead of
        ``n_layers``, for one more forward pass per level below the outermost. Each block runs
        under ``remat`` (None: no remat, the block's residuals kept while its segment is
        recomputed in the backward; unset, the option is ``full``). Same parameters as
        ``scan_layers`` (a checkpoint moves between the two); no dropout (the nested scan
        draws no random numbers). None: ``nn.scan``.
      remat: the memory plan of each block (a :class:`remat_nn.Plan` or a remat_nn policy
        name such as ``"dots"``), or None for no remat.
      reversible: additive couplings (attention F, MLP G) in a ``nn.ReversibleSequence``.
      reconstruct: with ``reversible``, reconstruct activations in the backward pass; ``False``
        differentiates the same network (same variables) by plain autodiff: the reference.
      dropout: dropout rate (embeddings, attention probabilities, sub-layer outputs).
      dtype: compute dtype: every matmul of the blocks, and the norms' outputs (their
        statistics and the softmax are at least float32); parameters and the logits stay at
        least float32 (float64 compute stays float64 throughout).
      recon_dtype: with ``reversible``, dtype of the residual stream ``(x1, x2)``: attention and
        MLP compute in ``dtype`` and their outputs are added in ``recon_dtype``, so the
        backward's reconstruction is float32 under bfloat16 compute and does not drift with
        depth (``bfloat16`` here is the drifting variant, for tests).
      drift_fallback: with ``reversible``, ``fallback`` of the couplings' stack
        (``nn.ReversibleSequence``): ``"error"``, ``"recompute"`` or ``"none"``.

    >>> import jax, jax.numpy as jnp
    >>> m = Transformer(vocab_size=11, d_model=8, n_heads=2, n_layers=2, d_ff=16, max_len=4)
    >>> tokens = jnp.zeros((2, 4), jnp.int32)
    >>> variables = jax.jit(m.init)(jax.random.key(0), tokens)
    >>> jax.jit(m.apply)(variables, tokens).shape
    (2, 4, 11)
    """

    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    max_len: int
    position: Literal["learned", "rotary"] = "learned"
    scan_layers: bool = True
    scan_levels: int | None = None
    remat: rn.Plan | str | None = REMAT_PRESETS["full"]
    reversible: bool = False
    reconstruct: bool = True
    dropout: float = 0.0
    dtype: Any = jnp.float32
    recon_dtype: Any = jnp.float32
    drift_fallback: str = "error"

    @fnn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        _, t = tokens.shape
        if t > self.max_len:
            raise ValueError(
                f"Transformer: sequence length {t} exceeds max_len={self.max_len}. Fix: build the "
                f"model with max_len>={t} or feed shorter sequences."
            )
        embed = fnn.Embed(self.vocab_size, self.d_model, name="wte")
        x = embed(tokens).astype(self.dtype)  # (B, T, D)
        if self.position == "learned":
            wpe = fnn.Embed(self.max_len, self.d_model, name="wpe")
            x = x + wpe(jnp.arange(t))[None].astype(self.dtype)  # (1, T, D) broadcast over B
        _check_scan_levels(self.scan_levels, self.scan_layers, self.reversible, self.dropout)
        x = fnn.Dropout(self.dropout, deterministic=not train)(x)
        x = self._reversible_stack(x, train) if self.reversible else self._stack(x, train)
        # The head is at least float32 under any compute dtype (3 matmuls of the gradient: D x V
        # per token, small beside the blocks'): logits and the loss see unrounded features.
        x = fnn.LayerNorm(dtype=at_least_float32(self.dtype), name="ln_f")(x)  # (B, T, D)
        return embed.attend(x)  # (B, T, V) float32, tied to the token embedding

    def _stack(self, x: jax.Array, train: bool) -> jax.Array:
        if self.scan_levels is not None:
            # Parameters as nn.scan stacks them; each block under the plan (None: no remat,
            # the block's residuals kept while its segment is recomputed in the backward).
            plan = "none" if self.remat is None else self.remat
            nested = rnn.remat_scan(
                Block, length=self.n_layers, levels=self.scan_levels, policy=plan
            )
            kw = dict(
                n_heads=self.n_heads,
                d_ff=self.d_ff,
                rotary=self.position == "rotary",
                dtype=self.dtype,
                train=train,
            )
            x, _ = nested(**kw, name="blocks")(x)
            return x
        block = Block
        if self.remat is not None:
            # Inside scan the recomputation cannot be CSE'd away, so prevent_cse is not needed.
            block = rnn.remat(Block, policy=self.remat, prevent_cse=not self.scan_layers)
        kw = dict(
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            rotary=self.position == "rotary",
            dropout=self.dropout,
            dtype=self.dtype,
            train=train,
        )
        if self.scan_layers:
            scanned = fnn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=self.n_layers,
            )
            x, _ = scanned(**kw, name="blocks")(x, None)
            return x
        for i in range(self.n_layers):
            x, _ = block(**kw, name=f"blocks_{i}")(x, None)
        return x

    def _reversible_stack(self, x: jax.Array, train: bool) -> jax.Array:
        # Reformer: both halves of the stream start as the embedding; y1 = x1 + Attn(x2),
        # y2 = x2 + MLP(y1). Activations are reconstructed in the backward pass, so depth
        # costs no activation memory (remat plans do not apply: nothing per layer is kept).
        f = Attention(self.n_heads, self.position == "rotary", self.dropout, self.dtype)
        g = MLP(self.d_ff, self.dropout, self.dtype)
        stack = rnn.ReversibleSequence(
            rnn.AdditiveCoupling(f, g),
            depth=self.n_layers,
            recon_dtype=self.recon_dtype,
            reversible=self.reconstruct,
            fallback=self.drift_fallback,
            name="blocks",
        )
        y1, y2 = stack((x, x), train=train)  # (B, T, D) each
        return (y1 + y2) / 2  # (B, T, D)


def _check_scan_levels(levels: Any, scan_layers: bool, reversible: bool, dropout: float) -> None:
    check_scan_levels(levels, "transformer: option ")
    if levels is None:
        return
    if not scan_layers or reversible:
        why = (
            "reversible=true (couplings, not a scan of blocks)"
            if reversible
            else ("scan_layers=false")
        )
        raise ValueError(
            f"transformer: option scan_levels={levels} nests the scan of scan_layers, but "
            f"{why}. Fix: scan_layers=true and reversible=false with scan_levels, or drop "
            "scan_levels."
        )
    if dropout:
        raise ValueError(
            f"transformer: option scan_levels={levels} with dropout={dropout}: the nested scan "
            "draws no random numbers. Fix: dropout=0, or drop scan_levels (nn.scan splits the "
            "dropout key per layer)."
        )


# --- registry ---------------------------------------------------------------------------------


def _default_remat(remat: str | rn.Plan | None, reversible: bool) -> str | rn.Plan:
    # Unset: recompute whole blocks ("full"), or nothing for reversible blocks.
    return remat if remat is not None else ("none" if reversible else "full")


def _shown(remat: str | rn.Plan | None) -> str:
    return f"<plan {remat}>" if isinstance(remat, rn.Plan) else repr(remat)


class TransformerOptions(pydantic.BaseModel):
    """Options of the ``transformer`` model (unknown keys rejected)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    vocab_size: pydantic.PositiveInt = 256
    d_model: pydantic.PositiveInt = 128
    n_heads: pydantic.PositiveInt = 4
    n_layers: pydantic.PositiveInt = 4
    d_ff: pydantic.PositiveInt | None = None
    max_len: pydantic.PositiveInt = 256
    position: Literal["learned", "rotary"] = "learned"
    scan_layers: bool = True
    scan_levels: pydantic.PositiveInt | None = pydantic.Field(
        None,
        description="with scan_layers: the blocks as a nested checkpointed scan "
        "(nn.remat_scan) of this many levels, same parameters; null: nn.scan",
    )
    remat: str | pydantic.InstanceOf[rn.Plan] | None = pydantic.Field(
        None,
        description="a preset of REMAT_PRESETS, a remat_nn policy name or alias (dots, ...), "
        "'custom' (with custom_plan), or a Plan",
    )
    custom_plan: dict[str, Any] | None = None
    reversible: bool = False
    drift_fallback: Literal["error", "recompute", "none"] = pydantic.Field(
        "error",
        description="with reversible: a coupling whose input, rebuilt in the backward pass, "
        "drifted past its measured tolerance: error (NotInvertibleError), recompute (more "
        "temporary memory) or none (no check)",
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    dropout: float = pydantic.Field(0.0, ge=0.0, lt=1.0)

    @pydantic.field_validator("remat", mode="before")
    @classmethod
    def _remat_form(cls, v: Any) -> Any:
        # One message instead of one per member of the union.
        if v is not None and not isinstance(v, str | rn.Plan):
            raise ValueError(
                f"transformer: option remat must be a preset name ({', '.join(REMAT_PRESETS)}), "
                "a remat_nn policy name (dots, ...), 'custom' with custom_plan, or a "
                f"remat_nn.Plan; got {type(v).__name__} {v!r}. "
                "Fix: e.g. remat=rn.plan({'save': ['query_proj']})."
            )
        return v

    @pydantic.model_validator(mode="after")
    def _check(self) -> TransformerOptions:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}. "
                "Fix: choose n_heads dividing d_model."
            )
        if self.position == "rotary" and (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"rotary position embedding needs an even head width, got "
                f"d_model // n_heads = {self.d_model // self.n_heads}."
            )
        if self.reversible and self.remat is not None and self.remat != "none":
            raise ValueError(
                f"remat={_shown(self.remat)} with reversible=true: reversible blocks reconstruct "
                "their activations and keep none per layer, so a remat plan has nothing to act on. "
                "Fix: drop remat (or set remat=none), or set reversible=false."
            )
        plan = remat_plan(_default_remat(self.remat, self.reversible), self.custom_plan)
        # Resolved here, once: build receives the plan ("none": no remat), custom_plan read in it.
        self.remat, self.custom_plan = ("none" if plan is None else plan), None
        _check_scan_levels(self.scan_levels, self.scan_layers, self.reversible, self.dropout)
        return self


def build(
    *,
    vocab_size: int = 256,
    d_model: int = 128,
    n_heads: int = 4,
    n_layers: int = 4,
    d_ff: int | None = None,
    max_len: int = 256,
    position: str = "learned",
    scan_layers: bool = True,
    scan_levels: int | None = None,
    remat: str | rn.Plan | None = None,
    custom_plan: Mapping[str, Any] | None = None,
    reversible: bool = False,
    drift_fallback: str = "error",
    dtype: str = "float32",
    dropout: float = 0.0,
) -> Transformer:
    """Builds a :class:`Transformer` from validated options (see :class:`TransformerOptions`).

    >>> build(d_model=32, n_heads=2, remat="save_qkv_proj").remat.save
    ('query_proj', 'key_proj', 'value_proj')
    >>> build(d_model=32, n_heads=2, remat=rn.plan({"save": ["context"]})).remat.save
    ('context',)
    """
    return Transformer(
        vocab_size=vocab_size,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        d_ff=d_ff or 4 * d_model,
        max_len=max_len,
        position=position,  # type: ignore[arg-type]
        scan_layers=scan_layers,
        scan_levels=scan_levels,
        remat=remat_plan(_default_remat(remat, reversible), custom_plan),
        reversible=reversible,
        drift_fallback=drift_fallback,
        dropout=dropout,
        dtype=jnp.dtype(dtype),
    )


#: What the reversible form sets: couplings instead of the scan (no nesting), and no remat plan
#: (reversible blocks keep nothing per layer: the planner's plan does not apply to them).
_REVERSIBLE = MappingProxyType(
    {"reversible": True, "scan_levels": None, "remat": "none", "custom_plan": None}
)


def variants(options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The transformer's other forms for the budget planner, those valid with ``options``.

    - ``nested``: ``scan_levels: 2``, when the blocks are scanned (``scan_layers``), without
      dropout (the nested scan draws no random numbers) and when nesting holds fewer block
      inputs than the scan (``n_layers`` above 4) and the model is not nested already; same
      parameters.
    - ``reversible``: ``reversible: true`` (Reformer couplings: activation memory independent
      of depth, for one more forward pass in the backward); its own parameters (two halves of
      the stream), dropout allowed (the couplings replay the keys). Not offered when the model
      is reversible already.

    >>> sorted(variants({"n_layers": 9})), sorted(variants({"n_layers": 4, "dropout": 0.1}))
    (['nested', 'reversible'], ['reversible'])
    """
    o = TransformerOptions.model_validate(
        {k: v for k, v in options.items() if k not in ("remat", "custom_plan")}
    )
    out: dict[str, dict[str, Any]] = {}
    if o.reversible:
        return out
    nestable = o.scan_layers and o.scan_levels is None and not o.dropout
    if nestable and nesting_holds_fewer(o.n_layers):
        out["nested"] = {"scan_levels": 2}
    out["reversible"] = dict(_REVERSIBLE)
    return out


def layer_stack(module: Transformer) -> LayerStack:
    """The scanned transformer as embedding, a stack of blocks (``params["blocks"]``) and head.

    The same computation as ``module.apply(variables, tokens, train=True)``, for the optimizer
    update inside the backward pass (:func:`remat_nn.fused_update_step`): each block under the
    model's remat plan (plain under ``full``: the fused step recomputes it from its saved
    input, see :func:`models._spec.fused_unit_plan`); with ``reversible``, each coupling
    (inverted in the backward if ``reconstruct``); with ``scan_levels: 2``, the inputs of every
    k-th block are saved (``save_every``, k the nesting's inner length).

    Raises:
      ValueError: the blocks are not one scan of blocks or couplings (``scan_layers=false``,
        ``scan_levels`` above 2), or dropout draws per-layer random numbers.

    >>> m = Transformer(vocab_size=11, d_model=8, n_heads=2, n_layers=2, d_ff=16, max_len=4)
    >>> tokens = jnp.zeros((2, 4), jnp.int32)
    >>> params = m.init(jax.random.key(0), tokens)["params"]
    >>> parts = layer_stack(m)
    >>> rest = {k: v for k, v in params.items() if k != parts.key}
    >>> h, _ = jax.lax.scan(lambda h, p: (parts.layer(p, h), None), parts.embed(rest, tokens),
    ...                     params[parts.key])
    >>> bool(jnp.array_equal(parts.head(rest, h), m.apply({"params": params}, tokens)))
    True
    """
    o = module
    why = (
        "scan_layers=false (one parameter tree per block, no stack)"
        if not o.scan_layers and not o.reversible
        else f"scan_levels={o.scan_levels} (the fused step nests two levels: save_every)"
        if o.scan_levels is not None and o.scan_levels > 2
        else f"dropout={o.dropout} (nn.scan draws each block's dropout mask)"
        if o.dropout
        else None
    )
    if why is not None:
        raise ValueError(
            f"transformer: the optimizer update inside the backward pass needs the blocks as one "
            f"scan of blocks without dropout, but the model has {why}. Fix: scan_layers=true "
            "(or reversible=true), scan_levels=null or 2, dropout=0."
        )
    wte = fnn.Embed(o.vocab_size, o.d_model)

    def embed(rest: Any, tokens: jax.Array) -> jax.Array:
        _, t = tokens.shape
        x = wte.apply({"params": rest["wte"]}, tokens).astype(o.dtype)  # (B, T, D)
        if o.position == "learned":
            wpe = fnn.Embed(o.max_len, o.d_model).apply({"params": rest["wpe"]}, jnp.arange(t))
            x = x + wpe[None].astype(o.dtype)  # (1, T, D) broadcast over B
        return x

    def head(rest: Any, x: jax.Array) -> jax.Array:
        x = fnn.LayerNorm(dtype=at_least_float32(o.dtype)).apply({"params": rest["ln_f"]}, x)
        return wte.apply({"params": rest["wte"]}, x, method="attend")  # (B, T, V)

    if o.reversible:
        return _reversible_layer_stack(o, embed, head)
    plan = fused_unit_plan(o.remat)
    block_cls = Block if plan is None else rnn.remat(Block, policy=plan, prevent_cse=False)
    block = block_cls(o.n_heads, o.d_ff, o.position == "rotary", 0.0, o.dtype, train=True)

    def layer(params: Any, x: jax.Array) -> jax.Array:
        return block.apply({"params": params}, x)[0]

    save_every = nested_save_every(o.n_layers, o.scan_levels)
    return LayerStack("blocks", embed, layer, head, save_every=save_every)


def _reversible_layer_stack(
    o: Transformer, embed: Callable[..., jax.Array], head: Callable[..., jax.Array]
) -> LayerStack:
    """The couplings of ``reversible=true`` as one layer each, as ``nn.ReversibleSequence`` runs
    them: the stream ``(x1, x2)`` in ``recon_dtype``, attention and MLP in ``dtype``, and the
    coupling's inverse fused with its VJP when ``reconstruct`` (no layer inputs kept)."""
    coupling = rnn.AdditiveCoupling(
        Attention(o.n_heads, o.position == "rotary", 0.0, o.dtype), MLP(o.d_ff, 0.0, o.dtype)
    )
    compute_dtype = None if o.recon_dtype is None else o.dtype
    block = rnn.coupling_layer(coupling, compute_dtype=compute_dtype, train=True)
    stream = o.dtype if o.recon_dtype is None else o.recon_dtype

    def embed_pair(rest: Any, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = embed(rest, tokens).astype(stream)
        return x, x

    def layer(params: Any, h: Any) -> Any:
        return block.forward(params["layers"], None, h)[0]

    def backward(params: Any, y: Any, dy: Any) -> tuple[Any, Any, Any]:
        h, grads, dh = block.backward(params["layers"], None, y, dy)
        return h, {"layers": grads}, dh

    def head_pair(rest: Any, h: Any) -> jax.Array:
        y1, y2 = (y.astype(o.dtype) for y in h)
        return head(rest, (y1 + y2) / 2)

    return LayerStack(
        "blocks",
        embed_pair,
        layer,
        head_pair,
        backward=backward if o.reconstruct else None,
        fallback=o.drift_fallback,
    )


#: The registry's entries of this file (registered at the first models.get).
SPECS: dict[str, ModelSpec] = {
    "transformer": ModelSpec(
        build=build,
        options=TransformerOptions,
        task="lm",
        doc="GPT-style decoder LM with named activations, remat presets, scan and reversible",
        remat_presets=REMAT_PRESETS,
        variants=variants,
        layer_stack=layer_stack,
    ),
}
