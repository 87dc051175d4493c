"""What is live at XLA's peak: the buffers of a compiled program, by category, name and source line.

:func:`explain_peak` compiles a function as :func:`remat_nn.compiled_memory` does, with XLA's
debug dump switched on for that one compile, and reads XLA's buffer assignment (with its
dataflow), live ranges and optimized HLO: the bytes and live ranges are XLA's own (``peak_bytes``
equals temp + argument + output - alias of its memory analysis), the category, checkpoint name
and source line of each buffer are attributed from XLA's op metadata and dataflow. What is
exact, what is attributed, and where it applies (scans, sharded programs, host memory):
docs/library.md, "The peak explainer in detail".

Three modules: this one compiles with the dump and attributes each buffer; the dump's text
formats are read by :mod:`remat_nn._xla_dump`; a buffer (:class:`Buffer`), the report's tables,
figure and durable JSON write are :mod:`remat_nn._peak_report`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from remat_nn._jax_internals import (
    checkpoint_name_of,
    persistent_cache_bypassed,
    source_info_util,
    sub_jaxprs,
)
from remat_nn._memory import CompiledMemory, _from_stats, format_bytes, shapes_of
from remat_nn._peak_report import (
    CATEGORIES,
    FRAGMENTATION,
    Buffer,
    atomic_write,
    figure,
    rows_text,
    table,
)
from remat_nn._xla_dump import (
    Allocation,
    Meta,
    Value,
    backward_reads,
    dtype_and_dims,
    parse_assignment,
    parse_hlo,
    parse_live_range,
    parse_values,
    source_of,
)

__all__ = ["Buffer", "PeakReport", "explain_peak"]


@dataclass(frozen=True)
class PeakReport:
    """The buffers live at XLA's peak and the memory timeline over XLA's schedule.

    Attributes:
      buffers: every buffer counted in ``peak_bytes``, largest first.
      compiled: XLA's memory analysis of the same compile.
      peak_index: the schedule index of the peak; ``schedule[peak_index]`` is its instruction.
      schedule: the flattened instruction sequence (instruction names).
      timeline: category -> bytes at each schedule index (arguments and outputs reserved
        throughout, as XLA counts them; temp values by their live ranges; fragmentation only
        at the peak is known, so it is not in the timeline).
      host_buffers: buffers in host memory (memory space ``S(5)``), counted apart.
    """

    buffers: tuple[Buffer, ...]
    compiled: CompiledMemory
    peak_index: int
    schedule: tuple[str, ...] = field(repr=False)
    timeline: Mapping[str, tuple[int, ...]] = field(repr=False)
    host_buffers: tuple[Buffer, ...] = ()

    @classmethod
    def of(cls, compiled: CompiledMemory) -> PeakReport:
        """The buffers at the peak of what ``rn.compiled_memory`` compiled (compiled again,
        with XLA's dump)."""
        if "call" not in compiled.extra:
            raise ValueError(
                "PeakReport.of: this CompiledMemory was not made by rn.compiled_memory, so it "
                "does not know its function. Fix: call rn.explain_peak(fn, *args) directly."
            )
        fn, args, kwargs, jit_kwargs = compiled.extra["call"]
        return explain_peak(fn, *args, jit_kwargs=jit_kwargs, **kwargs)

    @property
    def peak_bytes(self) -> int:
        """Bytes of every buffer counted at the peak (fragmentation included)."""
        return sum(b.nbytes for b in self.buffers)

    @property
    def difference(self) -> int:
        """``peak_bytes`` minus XLA's temp + argument + output - alias (0 when they agree)."""
        return self.peak_bytes - self.compiled.peak_bytes

    @property
    def peak_instruction(self) -> str:
        """The instruction XLA runs at the peak."""
        return self.schedule[self.peak_index] if self.schedule else ""

    def _group(self, key: Callable[[Buffer], str]) -> dict[str, dict[str, Any]]:
        groups: dict[str, dict[str, Any]] = {}
        for b in self.buffers:
            g = groups.setdefault(key(b), {"count": 0, "bytes": 0, "shapes": set()})
            g["count"] += 1
            g["bytes"] += b.nbytes
            g["shapes"].add(b.shape)
        return dict(sorted(groups.items(), key=lambda kv: -kv[1]["bytes"]))

    def by_category(self) -> dict[str, dict[str, Any]]:
        """category -> {count, bytes, shapes}, largest first."""
        return self._group(lambda b: b.category)

    def by_name(self) -> dict[str, dict[str, Any]]:
        """name (checkpoint name or argument path; else the op) -> {count, bytes, shapes}."""
        return self._group(lambda b: b.label)

    def by_source(self) -> dict[str, dict[str, Any]]:
        """``file:line`` -> {count, bytes, shapes} ("" for arguments and fragmentation)."""
        return self._group(lambda b: b.source or "(no source line)")

    def top(self, n: int = 10, *, temp_only: bool = False) -> str:
        """The ``n`` largest buffers as a table: value, shape, bytes, category, name, source
        (``temp_only``: the temp allocation's values, no arguments, outputs or fragmentation)."""
        keep = [
            b
            for b in self.buffers
            if not temp_only
            or b.category not in ("output", FRAGMENTATION)
            and not b.category.startswith("argument")
        ]
        rows = [
            (b.value, b.shape, format_bytes(b.nbytes), b.category, b.name or "", b.source)
            for b in keep[:n]
        ]
        return rows_text(("value", "shape", "bytes", "category", "name", "source"), rows)

    def __str__(self) -> str:
        agree = (
            "equals XLA's temp + argument + output - alias"
            if self.difference == 0
            else f"differs from XLA's temp + argument + output - alias "
            f"({format_bytes(self.compiled.peak_bytes)}) by {self.difference} B"
        )
        head = (
            f"peak {format_bytes(self.peak_bytes)} ({self.peak_bytes} B, {agree}) at schedule "
            f"index {self.peak_index} of {len(self.schedule)} ({self.peak_instruction})"
        )
        parts = [
            head,
            "",
            table("buffers at the peak by category", "category", self.by_category()),
            "",
            table("by name", "name", self.by_name()),
            "",
            table("by source", "source", self.by_source()),
            "",
            "largest buffers:",
            self.top(),
        ]
        if self.host_buffers:
            host = sum(b.nbytes for b in self.host_buffers)
            parts += ["", f"host memory (not in the peak): {format_bytes(host)}"]
        return "\n".join(parts)

    def timeline_json(self) -> dict[str, Any]:
        """The timeline as plain data: schedule, bytes per category, peak index and bytes."""
        return {
            "schedule": list(self.schedule),
            "bytes": {k: list(v) for k, v in self.timeline.items()},
            "peak_index": self.peak_index,
            "peak_bytes": self.peak_bytes,
            "xla_peak_bytes": self.compiled.peak_bytes,
            "fragmentation_at_peak": sum(
                b.nbytes for b in self.buffers if b.category == FRAGMENTATION
            ),
        }

    def save_timeline(self, png: str | os.PathLike[str], *, title: str = "") -> Path:
        """Writes the timeline plot to ``png`` and its data beside it (same stem, ``.json``).

        Both are written to a temporary file, fsynced and renamed into place. Returns the
        JSON's path.
        """
        png, data = Path(png), Path(png).with_suffix(".json")
        buf = io.BytesIO()
        self.timeline_figure(title).savefig(buf, format="png", dpi=100)
        atomic_write(data, json.dumps(self.timeline_json()).encode())
        atomic_write(png, buf.getvalue())
        return data

    def timeline_figure(self, title: str = "") -> Any:
        """The timeline as a matplotlib ``Figure``: live bytes over XLA's schedule, stacked by
        category, the peak index dashed and XLA's peak dotted."""
        return figure(self, title)


# --- compiling with XLA's dump ----------------------------------------------------------------


def explain_peak(
    fn: Callable[..., Any], *args: Any, jit_kwargs: Mapping[str, Any] | None = None, **kwargs: Any
) -> PeakReport:
    """The buffers live at XLA's peak of ``jax.jit(fn, **jit_kwargs)(*args, **kwargs)``.

    Args:
      fn: the function to compile (e.g. ``jax.grad(loss)`` or a train step).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``; nothing runs).
      jit_kwargs: extra ``jax.jit`` arguments, e.g. ``{"donate_argnums": 0}``.
      **kwargs: keyword arguments of ``fn``.

    Returns:
      A :class:`PeakReport`: ``print`` it for the tables; ``report.peak_bytes`` equals
      ``rn.compiled_memory(...).peak_bytes`` (``report.difference`` is 0), and
      ``report.save_timeline("t.png")`` draws the memory timeline.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> def f(x):
    ...   big = rn.name(jnp.sin(x), "big")
    ...   return jnp.cos(big) * big
    >>> r = rn.explain_peak(f, jnp.ones((256, 256)))
    >>> r.difference, r.peak_bytes == rn.compiled_memory(f, jnp.ones((256, 256))).peak_bytes
    (0, True)
    """
    jitted = jax.jit(fn, **dict(jit_kwargs or {}))
    lowered = jitted.lower(*args, **kwargs)
    with tempfile.TemporaryDirectory(prefix="remat_nn_peak_") as tmp:
        # The persistent cache drops xla_dump_to from its key: a cache hit would dump nothing.
        with persistent_cache_bypassed():
            compiled = lowered.compile(compiler_options={"xla_dump_to": tmp})
        head = re.match(r"HloModule ([^,\s]+)", compiled.as_text() or "")
        module = head.group(1) if head else "*"
        files = _dump_files(Path(tmp), module)
        assignment = files["buffer-assignment"].read_text()
        live_range = files["live-range"].read_text()
        hlo = files["hlo"].read_text()
        values = files["values"].read_text()
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            f"explain_peak: XLA's {jax.default_backend()} backend gives no memory analysis. "
            "Fix: explain on a cpu, gpu or tpu backend."
        )
    names = _checkpoint_names(fn, args, kwargs)
    return _explain(assignment, live_range, hlo, values, _from_stats(stats, float("nan")), names)


def explain_later(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    jit_kwargs: Mapping[str, Any] | None,
) -> Callable[[], PeakReport]:
    """``explain_peak`` of these arguments, deferred; arrays are held as their shapes only."""

    args, kwargs = shapes_of((tuple(args), dict(kwargs)))
    return lambda: explain_peak(fn, *args, jit_kwargs=jit_kwargs, **kwargs)


def _dump_files(tmp: Path, module: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for kind, suffix in (
        ("buffer-assignment", "after_optimizations-buffer-assignment.txt"),
        ("live-range", "after_optimizations-live-range.txt"),
        ("hlo", "after_optimizations.txt"),
        ("values", "after_optimizations-buffer-assignment-values.txt"),
    ):
        paths = sorted(tmp.glob(f"module_*.{module}.*{suffix}"))
        if not paths:
            raise RuntimeError(
                f"explain_peak: XLA wrote no '*{suffix}' for module {module!r} into its dump "
                f"directory (files: {sorted(p.name for p in tmp.iterdir())[:8]}). This backend "
                "or XLA version does not dump its buffer assignment with xla_dump_to. Fix: use "
                "rn.compiled_memory for the totals."
            )
        found[kind] = paths[-1]
    return found


# --- checkpoint names of the traced function --------------------------------------------------


@dataclass(frozen=True)
class _Name:
    name: str
    dtype: str
    shape: tuple[int, ...]
    primitive: str  # what produced the named value ("" for an argument)


def _checkpoint_names(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]):
    """(file, line) -> names whose name equation is on that line (every nested jaxpr)."""
    jaxpr = jax.make_jaxpr(fn)(*args, **kwargs).jaxpr
    out: dict[tuple[str, int], list[_Name]] = {}

    def walk(j: Any) -> None:
        producers = {o: e for e in j.eqns for o in e.outvars}
        for eqn in j.eqns:
            if (name := checkpoint_name_of(eqn)) is not None:
                frame = source_info_util.user_frame(eqn.source_info.traceback)
                aval = eqn.outvars[0].aval
                made_by = producers.get(eqn.invars[0]) if eqn.invars else None
                prim = made_by.primitive.name if made_by is not None else ""
                if frame is not None:
                    key = (frame.file_name, frame.start_line)
                    out.setdefault(key, []).append(
                        _Name(name, str(aval.dtype), tuple(aval.shape), prim)
                    )
            for sub in sub_jaxprs(eqn):
                walk(getattr(sub, "jaxpr", sub))

    walk(jaxpr)
    return out


def _name_of(
    v: Value,
    metas: Mapping[str, Meta],
    roots: Mapping[str, str],
    names: Mapping[tuple[str, int], list[_Name]],
) -> str | None:
    """The checkpoint name of a value: a name equation on a line of its stack with its dtype,
    its shape (or one layer's shape) and the primitive producing the named value. A loop's
    carry element is looked up where the loop body produces it: the body's root operand and
    that instruction's operands."""
    parsed = dtype_and_dims(v.shape)
    meta = metas.get(v.instruction)
    if meta is None or parsed is None:
        return None
    dtype, dims = parsed
    candidates = [meta]
    index = re.fullmatch(r"\{(\d+)\}", v.key[len(v.instruction) :])
    if meta.body and index and (root := metas.get(roots.get(meta.body, ""))):
        k = int(index.group(1))
        if k < len(root.operands) and (producer := metas.get(root.operands[k])):
            candidates += [producer, *(metas[o] for o in producer.operands if o in metas)]
    for m in candidates:
        op = m.op_name.rsplit("/", 1)[-1]
        for frame in m.frames:
            for n in names.get(frame, ()):
                same_op = not n.primitive or n.primitive == op
                if same_op and n.dtype == dtype and (n.shape == dims or n.shape == dims[1:]):
                    return n.name
    return None


def _role(path: str) -> str:
    # optax's states hold their moments as `.mu` / `.nu` (adam) or `.trace` (sgd momentum).
    if "opt_state" in path or re.search(r"\.(mu|nu|trace|count)\b", path):
        return "optimizer state"
    if "params" in path:
        return "params"
    return re.split(r"[.\[]", path, maxsplit=1)[0] or "?"


def _explain(
    assignment: str,
    live_range: str,
    hlo: str,
    values: str,
    compiled: CompiledMemory,
    names: Mapping[tuple[str, int], list[_Name]],
) -> PeakReport:
    allocs = parse_assignment(assignment)
    schedule, ranges = parse_live_range(live_range)
    code = parse_hlo(hlo)
    end_of_program = max(len(schedule) - 1, 0)
    saved = backward_reads(parse_values(values), code)
    program = _Program(code.metas, code.roots, names, end_of_program, code.backward, saved)
    for a in allocs:
        for v in a.values:
            # A value XLA gives no live range (none expected): live for the whole program.
            v.start, v.end = ranges.get(v.key, (0, program.end))
    device = [a for a in allocs if a.color == 0]
    temps = [a for a in device if a.kind == "temp"]
    cats = {v.key: program.category(v) for a in temps for v in a.values}
    timeline, occupied = _timeline(device, temps, cats, len(schedule))
    peak = max(range(len(schedule)), key=lambda t: (occupied[t], -t)) if schedule else 0
    buffers = [b for a in device for b in _buffers_at(a, peak, cats, program)]
    host = [
        program.buffer(v, v.size, "host", a.index)
        for a in allocs
        if a.color != 0 and a.kind not in ("constant", "thread-local")
        for v in a.values
    ]
    buffers.sort(key=lambda b: -b.nbytes)
    return PeakReport(
        tuple(buffers),
        compiled,
        peak,
        tuple(schedule),
        {k: tuple(v) for k, v in timeline.items()},
        tuple(host),
    )


@dataclasses.dataclass(frozen=True)
class _Program:
    """What :func:`_explain` read from XLA's dumps, to name and categorise a value."""

    metas: Mapping[str, Meta]  # instruction -> its metadata
    roots: Mapping[str, str]  # computation -> its root instruction
    names: Mapping[tuple[str, int], list[_Name]]  # (file, line) -> the names tagged there
    end: int  # the last schedule index
    backward: Mapping[str, tuple[str, ...]]  # instruction -> its backward origins
    saved: frozenset[int]  # ids of the values whose buffer the backward pass reads

    def category(self, v: Value) -> str:
        if ops := self.backward.get(v.instruction):
            recomputed = all("rematted_computation" in op for op in ops)
            return "recomputed" if recomputed else "gradient"
        return "saved residual" if v.id in self.saved else "transient"

    def buffer(self, v: Value | None, nbytes: int, category: str, allocation: int) -> Buffer:
        return _buffer(v, nbytes, category, self.metas, self.roots, self.names, allocation)


def _timeline(
    device: Sequence[Allocation], temps: Sequence[Allocation], cats: Mapping[str, str], n: int
) -> tuple[dict[str, list[int]], list[int]]:
    """Bytes occupied at each of the ``n`` schedule indices: by category (arguments and outputs
    whole, temp allocations as the union of their live slices), and of temp allocations in all."""
    timeline = {c: [0] * n for c in CATEGORIES if c != FRAGMENTATION}
    for a in device:
        if a.kind in ("argument", "output"):
            cat = "argument" if a.kind == "argument" else "output"
            timeline[cat] = [x + a.size for x in timeline[cat]]
    occupied = [0] * n
    for a in temps:
        for t, live in enumerate(_sweep(a, n)):
            for v, nbytes in live:
                timeline[cats[v.key]][t] += nbytes
                occupied[t] += nbytes
    return timeline, occupied


def _buffers_at(
    a: Allocation, peak: int, cats: Mapping[str, str], program: _Program
) -> list[Buffer]:
    # The buffers device allocation ``a`` holds at the peak.
    if a.kind == "argument":
        return [_argument_buffer(a, program)]
    if a.kind == "output":
        live = [v for v in a.values if v.start <= peak <= v.end]
        v = live[0] if live else max(a.values, key=lambda x: x.end, default=None)
        b = program.buffer(v, a.size, "output", a.index)
        holds = program.category(live[0]) if live and live[0].end < program.end else ""
        return [dataclasses.replace(b, holds=holds)]
    if a.kind == "temp":
        return _temp_buffers(a, peak, cats, program)
    return []


def _argument_buffer(a: Allocation, program: _Program) -> Buffer:
    # The parameter's own value (JAX names it by its pytree path), not a donated output.
    own = [v for v in a.values if v.start == 0 and _is_path(program.metas.get(v.instruction))]
    v = own[0] if own else (a.values[0] if a.values else None)
    meta = program.metas.get(v.instruction) if v else None
    path = meta.op_name if meta and meta.op_name else f"parameter {a.parameter}"
    role = _role(path) + (" (donated)" if _donated(a) else "")
    return Buffer(
        f"allocation {a.index}",
        a.size,
        _strip_layout(v.shape) if v else "",
        f"argument: {role}",
        path,
        "",
        path,
        (0, program.end),
    )


def _temp_buffers(
    a: Allocation, peak: int, cats: Mapping[str, str], program: _Program
) -> list[Buffer]:
    # The values of temp allocation ``a`` live at the peak, then its unused bytes.
    live = _union_at(a, peak)
    out = [program.buffer(v, nbytes, cats[v.key], a.index) for v, nbytes in live]
    if unused := a.size - sum(nbytes for _, nbytes in live):
        out.append(
            Buffer(
                f"allocation {a.index}",
                unused,
                "",
                FRAGMENTATION,
                None,
                "",
                FRAGMENTATION,
                (peak, peak),
            )
        )
    return out


def _is_path(meta: Meta | None) -> bool:
    return meta is not None and bool(meta.op_name) and not meta.op_name.startswith("jit(")


def _donated(a: Allocation) -> bool:
    # An argument allocation that also holds an output value: the donated buffer is reused.
    return (
        any(v.instruction != a.values[0].instruction for v in a.values[1:]) if a.values else False
    )


def _union(live: Sequence[Value]) -> list[tuple[Value, int]]:
    """Each live value with the bytes it adds to the union of their slices (values sharing a
    slice at a live-range boundary, aliases of one buffer, count once)."""
    out, covered = [], 0
    for v in sorted(live, key=lambda v: (v.offset, -v.size, v.key)):
        lo, hi = max(v.offset, covered), v.offset + v.size
        if hi > lo:
            out.append((v, hi - lo))
            covered = hi
    return out


def _union_at(a: Allocation, t: int) -> list[tuple[Value, int]]:
    return _union([v for v in a.values if v.start <= t <= v.end])


def _sweep(a: Allocation, length: int):
    """``_union_at(a, t)`` for every ``t`` in ``range(length)``, in one pass over the values."""
    by_start = sorted(a.values, key=lambda v: v.start)
    live: list[Value] = []
    i = 0
    for t in range(length):
        while i < len(by_start) and by_start[i].start <= t:
            live.append(by_start[i])
            i += 1
        live = [v for v in live if v.end >= t]
        yield _union(live)


def _buffer(
    v: Value | None,
    nbytes: int,
    category: str,
    metas: Mapping[str, Meta],
    roots: Mapping[str, str],
    names: Mapping[tuple[str, int], list[_Name]],
    allocation: int,
) -> Buffer:
    if v is None:
        return Buffer(f"allocation {allocation}", nbytes, "", category, None, "", "", (0, 0))
    meta = metas.get(v.instruction)
    # A cotangent has its value's shape and line: only forward and recomputed values get names.
    named = category != "gradient"
    return Buffer(
        v.key,
        nbytes,
        _strip_layout(v.shape),
        category,
        _name_of(v, metas, roots, names) if named else None,
        source_of(meta),
        meta.op_name if meta else "",
        (v.start, v.end),
    )


def _strip_layout(shape: str) -> str:
    # A tuple's buffer is its index table (a pointer per element): name it, not its elements.
    return "(tuple)" if shape.startswith("(") else re.sub(r"\{[^}]*\}", "", shape)
