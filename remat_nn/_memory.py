"""Memory inspection: what reverse-mode saves (by name and source) and what XLA allocates.

- :func:`memory_report`: the residuals ``jax.vjp`` keeps for the backward pass, grouped by
  activation name and by source (module scope and file:line), with the action (saved in device
  memory, or offloaded to host). Its totals equal JAX's ``saved_residuals`` (the list
  ``jax.ad_checkpoint.print_saved_residuals`` prints).
- :func:`compiled_memory`: XLA's compiled memory analysis, with a true peak.
- :func:`compare_policies`: both, for several policies, in one table.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core.primitives as prims

from remat_nn._jax_internals import checkpoint_name_of, core, source_info_util

__all__ = [
    "CompiledMemory",
    "MemoryReport",
    "PolicyComparison",
    "Residual",
    "compare_policies",
    "compiled_memory",
    "format_bytes",
    "memory_report",
]


def format_bytes(n: float) -> str:
    """``n`` bytes as remat_nn's reports print them, in binary units: ``1536`` -> ``'1.50 KiB'``
    (B, KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Residual:
    """One value reverse-mode keeps for the backward pass.

    Attributes:
      name: the activation name (``rn.name``), or None when unnamed.
      kind: ``"named"``, ``"argument"``, ``"output"`` (of an unnamed op), ``"constant"`` or
        ``"literal"``.
      source: where it is produced: ``file:line`` (or the argument's name).
      scope: the name stack at that point (flax module path / ``jax.named_scope``), or "".
      primitive: the producing primitive, or "".
      shape: its shape.
      dtype: its dtype name.
      nbytes: its size in bytes.
      action: ``"saved"`` (device memory) or ``"offloaded"`` (host memory).
    """

    name: str | None
    kind: str
    source: str
    scope: str
    primitive: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    action: str

    @property
    def label(self) -> str:
        """The name, or a description of an unnamed residual."""
        if self.name is not None:
            return self.name
        if self.kind == "argument":
            return f"(argument {self.source})"
        return f"({self.kind} {self.primitive})".replace(" )", ")")


def _bytes(aval: Any) -> int:
    # aval.dtype.itemsize also covers extended dtypes (PRNG keys: key<fry> is 8 bytes).
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def _is_host(aval: Any) -> bool:
    return "host" in str(getattr(aval, "memory_space", "")).lower()


def _residuals(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]):
    flat, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))

    def f_flat(*leaves):
        a, k = jax.tree_util.tree_unflatten(tree, leaves)
        return fn(*a, **k)

    closed, out_shape = jax.make_jaxpr(lambda *xs: jax.vjp(f_flat, *xs), return_shape=True)(*flat)
    jaxpr = closed.jaxpr
    num_res = jax.tree_util.tree_structure(out_shape[1]).num_leaves
    outvars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    # Argument names: the parameter's name, then the path inside it (`params['w_in']`).
    try:
        sig = inspect.signature(fn).parameters.values()
        params = [p.name for p in sig if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    arg_names = []
    for path, _ in jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        top, key = path[0].idx, path[1]
        if top == 0:
            head = params[key.idx] if key.idx < len(params) else f"arg{key.idx}"
        else:
            head = str(key.key)
        arg_names.append(head + jax.tree_util.keystr(path[2:]))
    return jaxpr, outvars, arg_names


def _scope(eqn: Any) -> str:
    scope = str(eqn.source_info.name_stack)
    return "" if scope in ("jvp()", "transpose(jvp())") else scope


def _look_through(jaxpr: Any, v: Any) -> Any:
    # reduce_precision (inserted by remat) and device_put (an offload) carry a value unchanged:
    # describe the value they carry, as JAX's saved_residuals does.
    producers = {o: e for e in jaxpr.eqns for o in e.outvars}
    while (
        not isinstance(v, core.Literal)
        and (e := producers.get(v)) is not None
        and (e.primitive is prims.reduce_precision_p or e.primitive.name == "device_put")
    ):
        v = e.invars[0]
    return v


def _producer(jaxpr: Any, v: Any) -> Any:
    """The equation producing ``v``; for a scan / call output, the one inside its body."""
    eqn = next(e for e in jaxpr.eqns for o in e.outvars if o is v)
    sub = eqn.params.get("jaxpr")
    calls = ("scan", "pjit", "jit", "closed_call", "shard_map")
    if eqn.primitive.name in calls and sub is not None:
        body = getattr(sub, "jaxpr", sub)
        inner = _look_through(body, body.outvars[eqn.outvars.index(v)])
        if not isinstance(inner, core.Literal) and any(inner in e.outvars for e in body.eqns):
            return _producer(body, inner)
    return eqn


def memory_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """The residuals reverse-mode saves for ``fn(*args, **kwargs)``, grouped by name and source.

    Args:
      fn: the function to differentiate (e.g. a loss); every array argument is differentiated.
      *args: its positional arguments (arrays or pytrees).
      **kwargs: its keyword arguments.

    Returns:
      A :class:`MemoryReport`; ``print(report)`` shows the tables.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> def f(x):
    ...   h = rn.name(jnp.sin(x), "mlp_hidden")
    ...   return jnp.sum(h * h)
    >>> r = rn.memory_report(f, jnp.ones(4))
    >>> r.total_bytes, r.by_name()["mlp_hidden"]["count"]
    (32, 1)
    """
    jaxpr, outvars, arg_names = _residuals(fn, args, kwargs)
    invars = {v: i for i, v in enumerate(jaxpr.invars)}
    constvars = set(jaxpr.constvars)
    out: list[Residual] = []
    for v in outvars:
        aval = v.aval
        shape, dtype, nbytes = tuple(aval.shape), str(aval.dtype), _bytes(aval)
        action = "offloaded" if _is_host(aval) else "saved"
        if isinstance(v, core.Literal):
            out.append(Residual(None, "literal", "", "", "", shape, dtype, nbytes, action))
            continue
        v = _look_through(jaxpr, v)
        if isinstance(v, core.Literal):
            out.append(Residual(None, "literal", "", "", "", shape, dtype, nbytes, action))
            continue
        if v in invars:
            src = arg_names[invars[v]]
            out.append(Residual(None, "argument", src, "", "", shape, dtype, nbytes, action))
            continue
        if v in constvars:
            out.append(Residual(None, "constant", "", "", "", shape, dtype, nbytes, action))
            continue
        eqn = _producer(jaxpr, v)
        src = source_info_util.summarize(eqn.source_info)
        scope = _scope(eqn)
        if (res_name := checkpoint_name_of(eqn)) is not None:
            kind, prim = "named", "name"
        else:
            res_name, kind, prim = None, "output", eqn.primitive.name
        out.append(Residual(res_name, kind, src, scope, prim, shape, dtype, nbytes, action))
    return MemoryReport(tuple(out))


@dataclass(frozen=True)
class MemoryReport:
    """Residuals of one function's VJP, with grouped views and totals."""

    residuals: tuple[Residual, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of every residual, saved and offloaded."""
        return sum(r.nbytes for r in self.residuals)

    @property
    def saved_bytes(self) -> int:
        """Bytes kept in device memory."""
        return sum(r.nbytes for r in self.residuals if r.action == "saved")

    @property
    def offloaded_bytes(self) -> int:
        """Bytes moved to host memory."""
        return sum(r.nbytes for r in self.residuals if r.action == "offloaded")

    def _group(self, key: Callable[[Residual], str]) -> dict[str, dict[str, Any]]:
        groups: dict[str, dict[str, Any]] = {}
        for r in self.residuals:
            g = groups.setdefault(
                key(r), {"count": 0, "bytes": 0, "shapes": set(), "dtypes": set(), "actions": set()}
            )
            g["count"] += 1
            g["bytes"] += r.nbytes
            g["shapes"].add(r.shape)
            g["dtypes"].add(r.dtype)
            g["actions"].add(r.action)
        return dict(sorted(groups.items(), key=lambda kv: -kv[1]["bytes"]))

    def by_name(self) -> dict[str, dict[str, Any]]:
        """label -> {count, bytes, shapes, dtypes, actions}; unnamed values by their producer."""
        return self._group(lambda r: r.label)

    def by_source(self) -> dict[str, dict[str, Any]]:
        """``scope | file:line`` -> {count, bytes, shapes, dtypes, actions}."""
        return self._group(_source_key)

    def names(self) -> dict[str, int]:
        """Activation name -> how many residuals carry it (named residuals only)."""
        return {k: g["count"] for k, g in self.by_name().items() if not k.startswith("(")}

    def __str__(self) -> str:
        # The arguments a VJP reads (a model's parameters, most of them) are one row each in
        # by_name() / by_source(); printed, they are one row, naming the largest: the caller
        # holds them anyway.
        args = sorted((r for r in self.residuals if r.kind == "argument"), key=lambda r: -r.nbytes)
        paths = list(dict.fromkeys(r.source for r in args))
        more = f" +{len(paths) - 3}" if len(paths) > 3 else ""
        row = f"(arguments {', '.join(paths[:3])}{more}; held by the caller)"

        def printed(r: Residual, key: str) -> str:
            return row if r.kind == "argument" else key

        names = self._group(lambda r: printed(r, r.label))
        sources = self._group(lambda r: printed(r, _source_key(r)))
        return "\n".join(
            [
                _table("residuals by name", "name", names),
                "",
                _table("residuals by source", "source", sources),
                "",
                f"total {format_bytes(self.total_bytes)} in {len(self.residuals)} residuals: "
                f"saved {format_bytes(self.saved_bytes)}, "
                f"offloaded {format_bytes(self.offloaded_bytes)}",
            ]
        )


def _source_key(r: Residual) -> str:
    return f"{r.scope} | {r.source}" if r.scope else r.source


def _table(title: str, key: str, groups: Mapping[str, Mapping[str, Any]]) -> str:
    def fmt_shapes(shapes: set[tuple[int, ...]]) -> str:
        s = sorted(shapes)
        text = ", ".join(f"({', '.join(map(str, sh))})" for sh in s[:3])
        return text + (f" +{len(s) - 3}" if len(s) > 3 else "")

    rows = [
        (
            k,
            fmt_shapes(g["shapes"]),
            "/".join(sorted(g["dtypes"])),
            str(g["count"]),
            format_bytes(g["bytes"]),
            "/".join(sorted(g["actions"])),
        )
        for k, g in groups.items()
    ]
    head = (key, "shape", "dtype", "count", "bytes", "action")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
    return "\n".join([f"{title}:", line(head), *(line(r) for r in rows)])


# --- XLA's numbers ----------------------------------------------------------------------------


def _xla_name(short: str) -> Any:
    return property(lambda self: getattr(self, short), doc=f"XLA's name of ``{short}``.")


@dataclass(frozen=True)
class CompiledMemory:
    """XLA's compiled memory analysis of one jitted function, in bytes.

    ``temp_bytes`` is XLA's temp (activations, residuals kept for the backward pass and scratch),
    ``argument_bytes`` / ``output_bytes`` the inputs and outputs, ``alias_bytes`` the outputs
    written in place of donated inputs. ``peak_bytes`` is temp + argument + output - alias:
    XLA:CPU's own ``peak_memory_in_bytes`` is not a peak (docs/library.md, "Measuring memory"; the
    tests check ``peak_bytes`` against the buffers live at once, counted by hand). XLA's own
    names (``temp_size_in_bytes``, ...) read the same values.

    The ``host_*`` fields are XLA's counts of the same kinds in host memory (pinned host, where
    an offloaded residual goes on a GPU / TPU backend); the other fields, and ``peak_bytes``,
    count device memory only. XLA:CPU has one memory: its host fields are 0 and an offloaded
    value stays in (and is counted as) device memory.
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int = 0
    host_temp_bytes: int = 0
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_generated_code_bytes: int = 0
    flops: float = float("nan")
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def peak_bytes(self) -> int:
        """Bytes live at once at most: temporaries, arguments and outputs, less donated aliases."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def host_peak_bytes(self) -> int:
        """``peak_bytes`` of host memory: host temp + argument + output - alias."""
        return (
            self.host_temp_bytes
            + self.host_argument_bytes
            + self.host_output_bytes
            - self.host_alias_bytes
        )

    # XLA's names (jax's CompiledMemoryStats), read-only.
    temp_size_in_bytes = _xla_name("temp_bytes")
    argument_size_in_bytes = _xla_name("argument_bytes")
    output_size_in_bytes = _xla_name("output_bytes")
    alias_size_in_bytes = _xla_name("alias_bytes")
    generated_code_size_in_bytes = _xla_name("generated_code_bytes")
    host_temp_size_in_bytes = _xla_name("host_temp_bytes")
    host_argument_size_in_bytes = _xla_name("host_argument_bytes")
    host_output_size_in_bytes = _xla_name("host_output_bytes")
    host_alias_size_in_bytes = _xla_name("host_alias_bytes")
    host_generated_code_size_in_bytes = _xla_name("host_generated_code_bytes")

    def __str__(self) -> str:
        rows = [
            ("temp", self.temp_bytes),
            ("argument", self.argument_bytes),
            ("output", self.output_bytes),
            ("alias", self.alias_bytes),
            ("peak", self.peak_bytes),
        ]
        if self.host_peak_bytes or self.host_temp_bytes:
            rows.append(("host peak", self.host_peak_bytes))
        return "\n".join(f"{k:>9}: {format_bytes(v)}" for k, v in rows)


def compiled_memory(
    fn: Callable[..., Any], *args: Any, jit_kwargs: Mapping[str, Any] | None = None, **kwargs: Any
) -> CompiledMemory:
    """Compiles ``jax.jit(fn, **jit_kwargs)`` for ``args`` and returns XLA's memory analysis.

    Args:
      fn: the function to compile (e.g. ``jax.grad(loss)`` or a train step).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``; nothing runs).
      jit_kwargs: extra ``jax.jit`` arguments, e.g. ``{"donate_argnums": 0}``.
      **kwargs: keyword arguments of ``fn``.

    Returns:
      A :class:`CompiledMemory`, with XLA's FLOP count in ``flops`` (a ``lax.scan`` body counts
      once: multiply by its length). Device and host memory are counted apart (``host_*``
      fields); on a CPU backend there is one memory and the host fields are 0.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> m = rn.compiled_memory(lambda x: x @ x, jnp.ones((64, 64)))
    >>> m.argument_bytes, m.output_bytes, m.temp_bytes == m.temp_size_in_bytes
    (16384, 16384, True)
    """
    compiled = jax.jit(fn, **dict(jit_kwargs or {})).lower(*args, **kwargs).compile()
    m = compiled.memory_analysis()
    if m is None:
        raise NotImplementedError(
            f"compiled_memory: XLA's {jax.default_backend()} backend gives no memory analysis "
            "of a compiled program. Fix: measure on a cpu, gpu or tpu backend."
        )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    out = _from_stats(m, float((cost or {}).get("flops", float("nan"))))
    # What was compiled, as shapes (rn.PeakReport.of compiles it again to explain the peak).
    call = (fn, *shapes_of((args, kwargs)), dict(jit_kwargs or {}))
    return dataclasses.replace(out, extra={**out.extra, "call": call})


def shapes_of(tree: Any) -> Any:
    """``tree`` with its arrays as ``jax.ShapeDtypeStruct`` (a committed array keeps its
    sharding)."""

    # An uncommitted array (jnp.ones) may go to any device: its default device's sharding would
    # pin it there, which a shard_map over several devices inside fn refuses.
    def spec(x: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)

    return jax.tree.map(lambda x: spec(x) if isinstance(x, jax.Array) else x, tree)


def _from_stats(m: Any, flops: float) -> CompiledMemory:
    # XLA's CompiledMemoryStats, field by field (device, then host).
    return CompiledMemory(
        temp_bytes=int(m.temp_size_in_bytes),
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        generated_code_bytes=int(m.generated_code_size_in_bytes),
        host_temp_bytes=int(getattr(m, "host_temp_size_in_bytes", 0)),
        host_argument_bytes=int(getattr(m, "host_argument_size_in_bytes", 0)),
        host_output_bytes=int(getattr(m, "host_output_size_in_bytes", 0)),
        host_alias_bytes=int(getattr(m, "host_alias_size_in_bytes", 0)),
        host_generated_code_bytes=int(getattr(m, "host_generated_code_size_in_bytes", 0)),
        flops=flops,
        extra={"peak_memory_in_bytes": int(getattr(m, "peak_memory_in_bytes", 0))},
    )


# --- side by side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyComparison:
    """One row per policy: its residuals (:class:`MemoryReport`) and XLA's numbers."""

    reports: Mapping[str, MemoryReport]
    compiled: Mapping[str, CompiledMemory]

    def rows(self) -> list[dict[str, Any]]:
        """Plain rows (label, residual bytes/count, temp/peak bytes, flops)."""
        return [
            {
                "policy": label,
                "residual_bytes": self.reports[label].total_bytes,
                "residuals": len(self.reports[label].residuals),
                "offloaded_bytes": self.reports[label].offloaded_bytes,
                "temp_bytes": c.temp_size_in_bytes,
                "peak_bytes": c.peak_bytes,
                "flops": c.flops,
            }
            for label, c in self.compiled.items()
        ]

    def __str__(self) -> str:
        head = "| policy | residuals | residual bytes | offloaded | XLA temp | XLA peak | FLOPs |"
        lines = [head, "|---|--:|--:|--:|--:|--:|--:|"]
        for r in self.rows():
            lines.append(
                f"| {r['policy']} | {r['residuals']} | {format_bytes(r['residual_bytes'])} | "
                f"{format_bytes(r['offloaded_bytes'])} | {format_bytes(r['temp_bytes'])} | "
                f"{format_bytes(r['peak_bytes'])} | {r['flops']:.3g} |"
            )
        return "\n".join(lines)


def compare_policies(
    fn: Callable[..., Any],
    args: Sequence[Any],
    policies: Mapping[str, Any],
    *,
    argnums: int | Sequence[int] = 0,
) -> PolicyComparison:
    """Measures ``fn`` under each policy: saved residuals and XLA's memory of its gradient.

    Args:
      fn: ``fn(*args, policy=p)`` returns a scalar loss, applying ``p`` where it remats (e.g.
        to a ``lax.scan`` body: XLA:CPU undoes remat in unrolled Python loops).
      args: the positional arguments of ``fn``.
      policies: label -> policy (anything :func:`remat_nn.policy` resolves; ``None`` for
        JAX's default, or a label you run without remat by ignoring it in ``fn``).
      argnums: which arguments the gradient is taken with respect to.

    Returns:
      A :class:`PolicyComparison`; ``print`` it for a markdown table.
    """
    from remat_nn._policies import check_takes_policy
    from remat_nn._policies import policy as resolve

    check_takes_policy(fn, "compare_policies")
    reports, compiled = {}, {}
    for label, spec in policies.items():
        loss = functools.partial(fn, policy=resolve(spec))
        reports[label] = memory_report(loss, *args)
        compiled[label] = compiled_memory(jax.grad(loss, argnums=argnums), *args)
    return PolicyComparison(reports, compiled)
