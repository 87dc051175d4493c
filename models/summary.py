"""Summarizes a registered model: parameters, FLOPs per example and memory under its remat policy.

Usage::

  python -m models.summary --list
  python -m models.summary revnet38
  python -m models.summary transformer n_layers=4 d_model=256 max_len=256 remat=save_qkv_proj
  python -m models.summary resnet164 --batch 128 --no-compile

Options are ``key=value`` pairs read as YAML values (``scan_layers=false``, ``width=0.5``,
``custom_plan={save: [query_proj]}``) and validated by the model's schema. Prints:

- parameters (counted with ``jax.eval_shape``: nothing is allocated);
- matmul FLOPs per example of one forward pass, counted from the jaxpr by
  :func:`remat_nn.matmul_flops` (``dot_general`` and convolutions, ``2 * multiply-adds``; a
  ``lax.scan`` body counts ``length`` times);
- the residuals the backward pass keeps (:func:`remat_nn.memory_report`), grouped by name;
- XLA's compiled memory of ``jax.jit(jax.grad(loss))`` (:func:`remat_nn.compiled_memory`),
  unless ``--no-compile``.

Exit status 2, with a one-line message, for an unknown model or a bad option.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import yaml

import models
import remat_nn as rn
from models._registry import load_builtin
from remat_nn import format_bytes
from remat_nn._jax_internals import saved_residuals

__all__ = ["count_params", "example_batch", "loss_fn", "main"]


# --- measurements -----------------------------------------------------------------------------


def count_params(tree: Any) -> int:
    """Number of scalars in a pytree of arrays or ``ShapeDtypeStruct``s."""
    return sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(tree))


def example_batch(spec: models.ModelSpec, opts: pydantic.BaseModel, batch: int) -> jax.Array:
    """A zero batch of the shape the model takes (images or tokens), from its options."""
    if spec.task == "classify":
        size = getattr(opts, "image_size", 32)
        return jnp.zeros((batch, size, size, getattr(opts, "in_channels", 3)), jnp.float32)
    return jnp.zeros((batch, getattr(opts, "max_len", 128)), jnp.int32)


def loss_fn(module: Any, spec: models.ModelSpec, variables: Any) -> Callable[..., jax.Array]:
    """``loss(params, batch)``: mean cross-entropy in training mode (labels all zero)."""
    state = {k: v for k, v in variables.items() if k != "params"}
    rngs = {"dropout": jax.random.key(0)}

    def loss(params: Any, x: jax.Array) -> jax.Array:
        out = module.apply({"params": params, **state}, x, train=True, rngs=rngs, mutable=True)
        logits = out[0].astype(jnp.float32)  # (B, classes) or (B, T, V)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return loss


# --- command line -----------------------------------------------------------------------------


class UsageError(Exception):
    """A bad command line: printed as one line, exit status 2."""


def _parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"option {pair!r} is not key=value (e.g. n_layers=4).")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise UsageError(f"option {key}: cannot read value {value!r}: {e}") from None
    return out


def _validate(name: str, overrides: dict[str, Any]) -> tuple[models.ModelSpec, Any]:
    try:
        spec = models.get(name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        opts = spec.options.model_validate(overrides)
    except pydantic.ValidationError as e:
        errs = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '(options)'}: "
            f"{err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        raise UsageError(f"{name}: bad options: {errs}") from None
    return spec, opts


def _as_written(opts: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    # The validated options, with the remat plan as written: the options schemas resolve
    # `remat` (and the transformer's `custom_plan`) into the plan the model is built with.
    shown = ("remat", "custom_plan")
    return {k: overrides.get(k) if k in shown else v for k, v in opts.model_dump().items()}


def _list() -> str:
    load_builtin()
    width = max(map(len, models.REGISTRY))
    return "\n".join(
        f"{n:<{width}}  {s.task:<8}  {s.doc}" for n, s in sorted(models.REGISTRY.items())
    )


def summarize(name: str, overrides: dict[str, Any], *, batch: int, compile: bool) -> str:
    """The report printed by the command line, as a string."""
    spec, opts = _validate(name, overrides)
    module = spec.build(**dict(opts))  # as models.build does: a resolved remat plan stays a Plan
    x = example_batch(spec, opts, batch)
    variables = jax.eval_shape(lambda: module.init(jax.random.key(0), x, train=False))
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    forward = lambda p, x: module.apply({"params": p, **state}, x, train=False)
    flops = rn.matmul_flops(forward, params, x) / batch
    loss = loss_fn(module, spec, variables)
    lines = [
        f"model      {name}  ({spec.doc})",
        f"options    {_as_written(opts, overrides)}",
        f"input      {x.dtype}{list(x.shape)}",
        f"params     {count_params(params):,}  ({count_params(params) / 1e6:.3f}M)",
        f"FLOPs      {flops / 1e6:,.2f} MFLOPs per example (matmul + conv, forward, counted)",
        "",
        _residual_report(loss, params, x),
    ]
    if compile:
        mem = rn.compiled_memory(jax.grad(loss), params, x)
        lines += ["", "XLA compiled memory of jax.jit(jax.grad(loss)):", str(mem)]
    return "\n".join(lines)


def _itemsize(dtype: Any) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key: two uint32
    return np.dtype(dtype).itemsize


def _residual_report(loss: Callable[..., Any], params: Any, x: jax.Array) -> str:
    try:
        return str(rn.memory_report(loss, params, x))
    except Exception as e:  # noqa: BLE001 -- report the totals rather than nothing
        res = saved_residuals(loss, params, x)
        total = sum(math.prod(a.shape) * _itemsize(a.dtype) for a, _ in res)
        return (
            f"residuals  {len(res)} values, {format_bytes(total)} (jax saved_residuals; "
            f"rn.memory_report failed: {type(e).__name__}: {e})"
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m models.summary",
        description="Parameters, FLOPs per example and activation memory of a registered model.",
        epilog="Example: python -m models.summary transformer n_layers=2 remat=save_qkv_proj",
    )
    p.add_argument("name", nargs="?", help="registered model name (see --list)")
    p.add_argument("options", nargs="*", help="model options as key=value (YAML values)")
    p.add_argument("--list", action="store_true", help="list the registered models and exit")
    p.add_argument("--batch", type=int, default=2, help="batch size of the example (default 2)")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="skip XLA's compiled memory analysis (the slow part for deep models)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.list:
            print(_list())
            return 0
        if args.name is None:
            raise UsageError("give a model name (python -m models.summary --list shows them).")
        if args.batch < 1:
            raise UsageError(f"--batch must be a positive integer, got {args.batch}.")
        overrides = _parse_overrides(args.options)
        print(summarize(args.name, overrides, batch=args.batch, compile=args.compile))
    except UsageError as e:
        print(f"models.summary: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
