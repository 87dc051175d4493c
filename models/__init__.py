"""Reference models, by name.

The registry is the contract between ``models`` and ``train``: a name maps to a
:class:`ModelSpec` holding a constructor, the pydantic schema of its options and its task.

Calling conventions (every registered module follows one):
  - ``task="classify"``: ``module.apply(variables, images, train=bool, rngs=...)`` with images
    (B, H, W, C) float32 in [0, 1]-ish, returns logits (B, num_classes). When ``train=True`` and
    the model has BatchNorm, pass ``mutable=["batch_stats"]``.
  - ``task="lm"``: ``module.apply(variables, tokens, train=bool, rngs=...)`` with int32 tokens
    (B, T), returns logits (B, T, vocab_size).
  - ``task="regress"``: ``module.apply(variables, features, train=bool, rngs=...)`` with float32
    features (B, F), returns predictions (B, num_outputs) (tabular data; ``model.module`` only).

Your own model, without editing this package (``model.module`` in a config, see README "Train
your model"): ``model.module: my_package.my_model:build`` names a callable in a module importable
from the working directory or ``PYTHONPATH`` — a function or a ``flax.linen.Module`` class — and
``model.task`` (default ``classify``) its task. The contract, all of it:

  - ``build(**model.options)`` returns a ``flax.linen.Module`` following the calling convention
    of its task above (it may ignore ``train`` and ``rngs``, but must accept ``train``);
  - its keyword parameters are its options: an unknown option is an error, a parameter without
    a default is required, ``**kwargs`` takes anything;
  - parameters named ``num_classes``, ``vocab_size``, ``image_size``, ``in_channels``,
    ``num_outputs`` are filled
    from the data when the config leaves them out, ``dtype`` from ``train.compute_dtype``;
  - a parameter named ``remat`` receives the config's ``remat:``, resolved: ``"none"`` (no
    remat), a policy name or alias (``"full"``, ``"dots"``, ...: :data:`MODULE_REMAT_PRESETS`)
    or a :class:`remat_nn.Plan` (a plan mapping, or the plan ``{policy: auto}`` chose). Hand it
    to ``remat_nn.nn.remat(Block, policy=remat)`` (or ``remat_nn.nnx.remat``), which takes all
    of them (``"none"`` returns ``Block`` itself) and keeps the parameter tree the same whatever
    the value. Without a ``remat`` parameter, ``remat:`` must stay unset;
  - Flax NNX: an ``nnx.Module`` class, or a function with a parameter ``rngs`` returning one,
    is wrapped by ``flax.nnx.bridge.to_linen`` (which passes ``rngs``: not an option); a
    function returning an ``nnx.Module`` it built with keys of its own is refused.

:func:`from_module` turns the reference into a :class:`ModelSpec`; what cannot be used (no colon,
a module that does not import, a missing attribute, something not callable, a non-Module result)
raises :class:`ModuleError` naming ``model.module``, the value and the fix.

>>> spec = from_module("flax.linen:Dense", task="classify")
>>> sorted(spec.options.model_fields)[:3], type(build(spec, features=3)).__name__
(['bias_init', 'dot_general', 'dot_general_cls'], 'Dense')
"""

# --- what a registered model is, and the option readers the models share --------------------
from models._spec import (
    POLICY_NAMES,
    LayerStack,
    ModelSpec,
    StageStacks,
    at_least_float32,
    check_scan_levels,
    nesting_holds_fewer,
    remat_name,
    remat_option,
)

# --- the registry: name -> ModelSpec ------------------------------------------------------------
from models._registry import REGISTRY, build, get, register, resolve_options

# --- your own model (model.module) ---------------------------------------------------------------
from models._from_module import FROM_DATA, MODULE_REMAT_PRESETS, ModuleError, from_module

__all__ = [
    "FROM_DATA",
    "REGISTRY",
    "LayerStack",
    "StageStacks",
    "ModelSpec",
    "MODULE_REMAT_PRESETS",
    "POLICY_NAMES",
    "ModuleError",
    "at_least_float32",
    "build",
    "check_scan_levels",
    "from_module",
    "get",
    "nesting_holds_fewer",
    "register",
    "remat_name",
    "remat_option",
    "resolve_options",
]
