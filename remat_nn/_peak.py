"""What is live at XLA's peak: the buffers of a compiled program, by category, name and source line.

:func:`explain_peak` compiles a function as :func:`remat_nn.compiled_memory` does, with XLA's
debug dump switched on for that one compile, and reads XLA's buffer assignment (with its
dataflow), live ranges and optimized HLO: the bytes and live ranges are XLA's own (``peak_bytes``
equals temp + argument + output - alias of its memory analysis), the category, checkpoint name
and source line of each buffer are attributed from XLA's op metadata and dataflow. What is
exact, what is attributed, and where it applies (scans, sharded programs, host memory):
docs/library.md, "The peak explainer in detail".
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

__all__ = ["Buffer", "PeakReport", "explain_peak"]

FRAGMENTATION = "fragmentation"
CATEGORIES = (
    "argument",
    "output",
    "saved residual",
    "recomputed",
    "gradient",
    "transient",
    FRAGMENTATION,
)


@dataclass(frozen=True)
class Buffer:
    """One buffer counted at the peak.

    Attributes:
      value: XLA's HLO value (``instruction{shape index}``), or the allocation for an argument,
        an output or the fragmentation row.
      nbytes: bytes it adds to the peak (an aliased value's bytes count once).
      shape: its HLO shape, e.g. ``f32[8,128]``.
      category: ``argument: <role>``, ``output``, ``recomputed`` (a value JAX's remat recomputes
        in the backward pass), ``gradient`` (any other value of the backward pass), ``saved
        residual`` (any other value the backward pass reads), ``transient`` or
        ``fragmentation``.
      name: the ``checkpoint_name``, the argument's pytree path, or None.
      source: ``file:line`` of the defining instruction's innermost frame, or "".
      op_name: XLA's op_name metadata (JAX's name stack).
      live: its live range ``(start, end)`` in the flattened schedule (inclusive).
      holds: for an output allocation, the category of the value in it at the peak (a
        backward temp XLA places in an output buffer before the output is written), else "".
    """

    value: str
    nbytes: int
    shape: str
    category: str
    name: str | None
    source: str
    op_name: str
    live: tuple[int, int]
    holds: str = ""

    @property
    def label(self) -> str:
        """The name, else the op (last part of op_name), else the value."""
        if self.name:
            return self.name
        return f"({self.op_name.rsplit('/', 1)[-1] or self.value})"


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
        return _rows(("value", "shape", "bytes", "category", "name", "source"), rows)

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
            _table("buffers at the peak by category", "category", self.by_category()),
            "",
            _table("by name", "name", self.by_name()),
            "",
            _table("by source", "source", self.by_source()),
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
        _atomic(data, json.dumps(self.timeline_json()).encode())
        _atomic(png, buf.getvalue())
        return data

    def timeline_figure(self, title: str = "") -> Any:
        """The timeline as a matplotlib ``Figure``: live bytes over XLA's schedule, stacked by
        category, the peak index dashed and XLA's peak dotted."""
        return _figure(self, title)


def _atomic(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _figure(report: PeakReport, title: str) -> Any:
    from matplotlib.figure import Figure

    mib = 1024 * 1024
    cats = [c for c in report.timeline if any(report.timeline[c])]
    xs = range(len(report.schedule))
    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    ax.stackplot(xs, *[[v / mib for v in report.timeline[c]] for c in cats], labels=cats)
    ax.axvline(report.peak_index, color="k", linestyle="--", linewidth=1)
    ax.axhline(report.compiled.peak_bytes / mib, color="r", linestyle=":", linewidth=1)
    ax.annotate(
        f"peak {format_bytes(report.peak_bytes)} at {report.peak_index}"
        f" (XLA: {format_bytes(report.compiled.peak_bytes)}, dotted)",
        (report.peak_index, report.compiled.peak_bytes / mib),
        xytext=(5, -12),
        textcoords="offset points",
        fontsize=8,
    )
    ax.set_xlabel("XLA schedule index (flattened: loop bodies at the loop's place)")
    ax.set_ylabel("live MiB")
    ax.set_title(title or "live bytes over XLA's schedule")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    return fig


def _rows(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
    return "\n".join([line(head), *(line(r) for r in rows)])


def _table(title: str, key: str, groups: Mapping[str, Mapping[str, Any]]) -> str:
    def shapes(s: set[str]) -> str:
        s2 = sorted(s)
        return ", ".join(s2[:3]) + (f" +{len(s2) - 3}" if len(s2) > 3 else "")

    rows = [
        (k, shapes(g["shapes"]), str(g["count"]), format_bytes(g["bytes"]))
        for k, g in groups.items()
    ]
    return f"{title}:\n" + _rows((key, "shape", "count", "bytes"), rows)


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


# --- reading XLA's dump -----------------------------------------------------------------------

_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(
    r"^ value: <(\d+) (\S+?)(\{[\d,]*\})?( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$"
)
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_DTYPES = {
    "pred": "bool",
    "s8": "int8",
    "s16": "int16",
    "s32": "int32",
    "s64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
}


@dataclass
class _Value:
    id: int  # XLA's value id (the same in the buffer assignment and its values file)
    key: str  # instruction{index}
    instruction: str
    size: int
    offset: int
    shape: str
    allocation: int
    start: int = 0
    end: int = -1


@dataclass
class _Allocation:
    index: int
    size: int
    kind: str  # "argument", "output", "temp", "constant", "thread-local"
    parameter: int | None
    color: int
    values: list[_Value]


def _parse_assignment(text: str) -> list[_Allocation]:
    allocs: list[_Allocation] = []
    for line in text.splitlines():
        if m := _ALLOC.match(line):
            flags = m.group(3)
            param = re.search(r"parameter (\d+)", flags)
            color = re.search(r"color (\d+)", flags)
            if param:
                kind = "argument"
            elif "constant" in flags:
                kind = "constant"
            elif "thread-local" in flags:
                kind = "thread-local"
            elif "maybe-live-out" in flags:
                kind = "output"
            else:
                kind = "temp"
            allocs.append(
                _Allocation(
                    int(m.group(1)),
                    int(m.group(2)),
                    kind,
                    int(param.group(1)) if param else None,
                    int(color.group(1)) if color else 0,
                    [],
                )
            )
        elif (m := _VALUE.match(line)) and allocs:
            a = allocs[-1]
            instr, index = m.group(2), m.group(3) or "{}"
            a.values.append(
                _Value(
                    int(m.group(1)),
                    instr + index,
                    instr,
                    int(m.group(5)),
                    int(m.group(6)),
                    m.group(7),
                    a.index,
                )
            )
        elif line.startswith("Total bytes used") or line.startswith("Used values"):
            break
    return allocs


def _parse_live_range(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    schedule: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("InstructionSequence"):
            section = "seq"
        elif s.startswith("BufferLiveRange"):
            section = "range"
        elif s.startswith("Live ranges at") or not line.startswith("    "):
            section = ""
        elif section == "seq":
            schedule.append(s.split(":", 1)[1])
        elif section == "range":
            key, span = s.rsplit(":", 1)
            a, b = span.split("-")
            ranges[key] = (int(a), int(b))
    return schedule, ranges


@dataclass(frozen=True)
class _Flow:
    """XLA's dataflow over the program's values (its buffer-assignment values file), by id."""

    positions: Mapping[int, tuple[tuple[str, str], ...]]  # (instruction, shape index) holding it
    users: Mapping[int, tuple[str, ...]]  # the instructions reading it


_USED = re.compile(r"^<(\d+) ")


def _parse_values(text: str) -> _Flow:
    """XLA's ``*-buffer-assignment-values.txt``: each value's positions and uses."""
    positions: dict[int, list[tuple[str, str]]] = {}
    users: dict[int, list[str]] = {}
    value, section = -1, ""
    for line in text.splitlines():
        if m := _USED.match(line):
            value = int(m.group(1))
            positions[value], users[value] = [], []
        elif line.startswith("  ") and value >= 0 and line.strip() != "(none)":
            if section == "positions":  # "  tuple.3 {1}", or "  dot" for shape index {}
                instruction, _, index = line.strip().partition(" ")
                positions[value].append((instruction, index or "{}"))
            elif section == "uses":  # "  while.3, operand 0 {3}"
                users[value].append(line.strip().split(",", 1)[0])
        else:
            section = line.strip().rstrip(":")
    return _Flow(
        {v: tuple(p) for v, p in positions.items()}, {v: tuple(u) for v, u in users.items()}
    )


def _backward_reads(flow: _Flow, code: _Hlo) -> frozenset[int]:
    """The ids of the values whose buffer the backward pass reads.

    A value is read by the backward pass when an instruction of it (``code.backward``) uses it,
    wherever XLA schedules that use; a loop's carry is one buffer per tuple index
    (:func:`_carries`), read when any of its values is: the stack a forward scan fills is a
    residual inside the loop too, not only once the loop returns it.
    """
    group = {v: v for v in flow.positions}  # union-find over the values sharing a carry

    def find(v: int) -> int:
        while group[v] != v:
            group[v] = group[group[v]]
            v = group[v]
        return v

    slots: dict[tuple[str, str], int] = {}
    for v, held in flow.positions.items():
        for instruction, index in held:
            for carrier in code.carries.get(instruction, ()):
                first = slots.setdefault((carrier, index), v)
                group[find(v)] = find(first)
    read = {find(v) for v, users in flow.users.items() if any(code.backward.get(u) for u in users)}
    return frozenset(v for v in flow.positions if find(v) in read)


@dataclass(frozen=True)
class _Meta:
    op_name: str
    frames: tuple[tuple[str, int], ...]  # innermost first
    operands: tuple[str, ...] = ()
    body: str = ""  # a while loop's body computation
    calls: str = ""  # a fusion's computation


_NO_META = _Meta("", ())


@dataclass(frozen=True)
class _Hlo:
    """What the optimized HLO says of its instructions, by name."""

    metas: Mapping[str, _Meta]  # instruction -> its metadata
    roots: Mapping[str, str]  # computation -> its root instruction
    carries: Mapping[str, set[str]]  # instruction -> the loops whose result it holds
    backward: Mapping[str, tuple[str, ...]]  # instruction -> its backward origins


def _parse_hlo(text: str) -> _Hlo:
    """The optimized HLO's instructions: metadata, roots, loop carries (:func:`_carries`) and
    backward origins (:func:`_backward_origins`)."""
    files: dict[int, str] = {}
    locs: dict[int, tuple[int, int]] = {}
    frames: dict[int, tuple[int, int]] = {}
    section, computation = "", ""
    metas: dict[str, _Meta] = {}
    roots: dict[str, str] = {}
    parent: dict[str, str] = {}  # instruction -> its computation
    loops: dict[str, str] = {}  # a while's body / condition computation -> the while
    branches: dict[str, str] = {}  # a conditional's branch computation -> the conditional
    params: dict[str, list[str]] = {}  # computation -> its parameter instructions
    for line in text.splitlines():
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        if not s:
            section = ""
            continue
        if section:
            _read_stack_table(section, s, files, locs, frames)
        elif s.endswith("{") and (h := _COMPUTATION.match(s)):
            computation = h.group(1)
        elif m := _INSTR.match(line):
            name, rest = m.group(1), m.group(2)
            if s.startswith("ROOT "):
                roots[computation] = name
            body = rest.split("metadata={", 1)
            meta_text = body[1].split("}", 1)[0] if len(body) > 1 else ""
            operands = tuple(re.findall(r"%([\w.\-]+)", body[0]))
            loop = re.search(r"\bbody=%?([\w.\-]+)", rest)
            cond = re.search(r"\bcondition=%?([\w.\-]+)", rest)
            if loop:
                loops[loop.group(1)] = name
            if cond:
                loops[cond.group(1)] = name
            for branch in _branches(rest):
                branches[branch] = name
            if re.search(r"\bparameter\(\d+\)", body[0]):
                params.setdefault(computation, []).append(name)
            parent[name] = computation
            fusion = re.search(r"\bcalls=%?([\w.\-]+)", rest)
            metas[name] = _Meta(
                _op_name(meta_text),
                _frames(meta_text, frames, locs, files),
                operands,
                loop.group(1) if loop else "",
                fusion.group(1) if fusion else "",
            )
    _inherit_loop_metadata(metas, parent, loops)
    members: dict[str, list[str]] = {}
    for name, where in parent.items():
        members.setdefault(where, []).append(name)
    return _Hlo(
        metas,
        roots,
        _carries(metas, roots, loops, branches, params),
        _backward_origins(metas, members),
    )


def _read_stack_table(
    section: str,
    s: str,
    files: dict[int, str],
    locs: dict[int, tuple[int, int]],
    frames: dict[int, tuple[int, int]],
) -> None:
    # One line of the dump's FileNames / FileLocations / StackFrames tables.
    if section == "FileNames":
        i, name = s.split(" ", 1)
        files[int(i)] = json.loads(name)
    elif section == "FileLocations":
        i = int(s.split(" ", 1)[0])
        f = re.search(r"file_name_id=(\d+)", s)
        ln = re.search(r"\bline=(\d+)", s)
        if f and ln:
            locs[i] = (int(f.group(1)), int(ln.group(1)))
    elif section == "StackFrames":
        i = int(s.split(" ", 1)[0])
        loc = re.search(r"file_location_id=(\d+)", s)
        up = re.search(r"parent_frame_id=(\d+)", s)
        frames[i] = (int(loc.group(1)) if loc else 0, int(up.group(1)) if up else 0)


def _inherit_loop_metadata(
    metas: dict[str, _Meta], parent: Mapping[str, str], loops: Mapping[str, str]
) -> None:
    # A loop body's parameters, tuples and their elements carry no metadata: they are the
    # loop's carry, so they take the loop's op_name and source line (nested loops outward).
    for name, meta in metas.items():
        seen, where = set(), parent.get(name, "")
        while not meta.op_name and where in loops and where not in seen:
            seen.add(where)
            outer = metas[loops[where]]
            meta = dataclasses.replace(meta, op_name=outer.op_name, frames=outer.frames)
            where = parent.get(loops[where], "")
        metas[name] = meta


def _branches(rest: str) -> list[str]:
    listed = re.search(r"\bbranch_computations=\{([^}]*)\}", rest)
    names = re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else []
    return names + re.findall(r"\b(?:true|false)_computation=%?([\w.\-]+)", rest)


def _carries(
    metas: Mapping[str, _Meta],
    roots: Mapping[str, str],
    loops: Mapping[str, str],
    branches: Mapping[str, str],
    params: Mapping[str, Sequence[str]],
) -> dict[str, set[str]]:
    """Instruction -> the whiles and conditionals whose result it holds, tuple index for tuple
    index in one buffer: a while's initial value, its body's and condition's parameters and its
    body's result; a conditional's branch results; the while or conditional itself."""
    carries: dict[str, set[str]] = {}
    for where, w in loops.items():
        holders = [*params.get(where, ()), w]
        if metas[w].body == where and where in roots:
            holders.append(roots[where])
        if metas[w].operands:
            holders.append(metas[w].operands[0])
        for h in holders:
            carries.setdefault(h, set()).add(w)
    for where, c in branches.items():
        for h in ([roots[where]] if where in roots else []) + [c]:
            carries.setdefault(h, set()).add(c)
    return carries


def _backward_origins(
    metas: Mapping[str, _Meta], members: Mapping[str, Sequence[str]]
) -> dict[str, tuple[str, ...]]:
    """Instruction -> the op_names of the backward pass its value comes from (empty: not a
    value of the backward pass).

    An instruction of the backward pass has ``transpose(`` in its name stack. One XLA made
    itself (a copy, a layout change, a fusion whose root has no metadata) belongs to the backward
    pass when an instruction it fuses (``members`` of the computation it calls) or one of its
    operands does.
    """
    origins: dict[str, tuple[str, ...]] = {}

    def of(instruction: str) -> tuple[str, ...]:
        if instruction not in origins:
            origins[instruction] = ()  # an operand cycle adds nothing
            meta = metas.get(instruction) or _NO_META
            if meta.op_name:
                origins[instruction] = (meta.op_name,) if "transpose(" in meta.op_name else ()
            else:
                fused = (metas[i].op_name for i in members.get(meta.calls, ()))
                found = [op for op in fused if "transpose(" in op]
                found += [op for o in meta.operands if o in metas for op in of(o)]
                origins[instruction] = tuple(dict.fromkeys(found))
        return origins[instruction]

    for instruction in metas:
        of(instruction)
    return origins


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")


def _op_name(meta: str) -> str:
    op = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
    return re.sub(r"\\(.)", r"\1", op.group(1)) if op else ""


def _frames(
    meta: str,
    frames: Mapping[int, tuple[int, int]],
    locs: Mapping[int, tuple[int, int]],
    files: Mapping[int, str],
) -> tuple[tuple[str, int], ...]:
    """(file, line) of the instruction's stack, innermost first."""
    chain: list[tuple[str, int]] = []
    if sf := re.search(r"stack_frame_id=(\d+)", meta):
        fid, seen = int(sf.group(1)), set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            if loc in locs:
                file_id, ln = locs[loc]
                chain.append((files.get(file_id, "?"), ln))
            fid = parent
    elif (f := re.search(r'source_file="([^"]*)"', meta)) and (
        ln := re.search(r"source_line=(\d+)", meta)
    ):
        chain.append((f.group(1), int(ln.group(1))))
    return tuple(chain)


def _source(meta: _Meta | None) -> str:
    if meta is None or not meta.frames:
        return ""
    file, line = meta.frames[0]
    return f"{_short(file)}:{line}"


def _short(file: str) -> str:
    # An installed package from its import path, else relative to the working directory when
    # inside it, else the last two path components.
    if "site-packages" + os.sep in file:
        return file.rsplit("site-packages" + os.sep, 1)[1]
    cwd = os.getcwd() + os.sep
    if file.startswith(cwd):
        return file[len(cwd) :]
    return os.sep.join(file.split(os.sep)[-2:])


def _dims(shape: str) -> tuple[str, tuple[int, ...]] | None:
    m = re.match(r"^(\w+)\[([\d,]*)\]", shape)
    if not m:
        return None
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    return _DTYPES.get(m.group(1), m.group(1)), dims


def _name_of(
    v: _Value,
    metas: Mapping[str, _Meta],
    roots: Mapping[str, str],
    names: Mapping[tuple[str, int], list[_Name]],
) -> str | None:
    """The checkpoint name of a value: a name equation on a line of its stack with its dtype,
    its shape (or one layer's shape) and the primitive producing the named value. A loop's
    carry element is looked up where the loop body produces it: the body's root operand and
    that instruction's operands."""
    parsed = _dims(v.shape)
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
    allocs = _parse_assignment(assignment)
    schedule, ranges = _parse_live_range(live_range)
    code = _parse_hlo(hlo)
    end_of_program = max(len(schedule) - 1, 0)
    saved = _backward_reads(_parse_values(values), code)
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

    metas: Mapping[str, _Meta]  # instruction -> its metadata
    roots: Mapping[str, str]  # computation -> its root instruction
    names: Mapping[tuple[str, int], list[_Name]]  # (file, line) -> the names tagged there
    end: int  # the last schedule index
    backward: Mapping[str, tuple[str, ...]]  # instruction -> its backward origins
    saved: frozenset[int]  # ids of the values whose buffer the backward pass reads

    def category(self, v: _Value) -> str:
        if ops := self.backward.get(v.instruction):
            recomputed = all("rematted_computation" in op for op in ops)
            return "recomputed" if recomputed else "gradient"
        return "saved residual" if v.id in self.saved else "transient"

    def buffer(self, v: _Value | None, nbytes: int, category: str, allocation: int) -> Buffer:
        return _buffer(v, nbytes, category, self.metas, self.roots, self.names, allocation)


def _timeline(
    device: Sequence[_Allocation], temps: Sequence[_Allocation], cats: Mapping[str, str], n: int
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
    a: _Allocation, peak: int, cats: Mapping[str, str], program: _Program
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


def _argument_buffer(a: _Allocation, program: _Program) -> Buffer:
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
    a: _Allocation, peak: int, cats: Mapping[str, str], program: _Program
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


def _is_path(meta: _Meta | None) -> bool:
    return meta is not None and bool(meta.op_name) and not meta.op_name.startswith("jit(")


def _donated(a: _Allocation) -> bool:
    # An argument allocation that also holds an output value: the donated buffer is reused.
    return (
        any(v.instruction != a.values[0].instruction for v in a.values[1:]) if a.values else False
    )


def _union(live: Sequence[_Value]) -> list[tuple[_Value, int]]:
    """Each live value with the bytes it adds to the union of their slices (values sharing a
    slice at a live-range boundary, aliases of one buffer, count once)."""
    out, covered = [], 0
    for v in sorted(live, key=lambda v: (v.offset, -v.size, v.key)):
        lo, hi = max(v.offset, covered), v.offset + v.size
        if hi > lo:
            out.append((v, hi - lo))
            covered = hi
    return out


def _union_at(a: _Allocation, t: int) -> list[tuple[_Value, int]]:
    return _union([v for v in a.values if v.start <= t <= v.end])


def _sweep(a: _Allocation, length: int):
    """``_union_at(a, t)`` for every ``t`` in ``range(length)``, in one pass over the values."""
    by_start = sorted(a.values, key=lambda v: v.start)
    live: list[_Value] = []
    i = 0
    for t in range(length):
        while i < len(by_start) and by_start[i].start <= t:
            live.append(by_start[i])
            i += 1
        live = [v for v in live if v.end >= t]
        yield _union(live)


def _buffer(
    v: _Value | None,
    nbytes: int,
    category: str,
    metas: Mapping[str, _Meta],
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
        _source(meta),
        meta.op_name if meta else "",
        (v.start, v.end),
    )


def _strip_layout(shape: str) -> str:
    # A tuple's buffer is its index table (a pointer per element): name it, not its elements.
    return "(tuple)" if shape.startswith("(") else re.sub(r"\{[^}]*\}", "", shape)
