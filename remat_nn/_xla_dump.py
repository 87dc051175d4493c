"""Reading XLA's debug dump: the buffer assignment (with its dataflow), the live ranges and the
optimized HLO's instructions with their metadata (op name, source frames), as
:func:`remat_nn.explain_peak` needs them. Text formats of XLA:CPU in jaxlib 0.10; a line this
parser does not read raises ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
class Value:
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
class Allocation:
    index: int
    size: int
    kind: str  # "argument", "output", "temp", "constant", "thread-local"
    parameter: int | None
    color: int
    values: list[Value]


def parse_assignment(text: str) -> list[Allocation]:
    allocs: list[Allocation] = []
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
                Allocation(
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
                Value(
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


def parse_live_range(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
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


def parse_values(text: str) -> _Flow:
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


def backward_reads(flow: _Flow, code: _Hlo) -> frozenset[int]:
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
class Meta:
    op_name: str
    frames: tuple[tuple[str, int], ...]  # innermost first
    operands: tuple[str, ...] = ()
    body: str = ""  # a while loop's body computation
    calls: str = ""  # a fusion's computation


_NO_META = Meta("", ())


@dataclass(frozen=True)
class _Hlo:
    """What the optimized HLO says of its instructions, by name."""

    metas: Mapping[str, Meta]  # instruction -> its metadata
    roots: Mapping[str, str]  # computation -> its root instruction
    carries: Mapping[str, set[str]]  # instruction -> the loops whose result it holds
    backward: Mapping[str, tuple[str, ...]]  # instruction -> its backward origins


def parse_hlo(text: str) -> _Hlo:
    """The optimized HLO's instructions: metadata, roots, loop carries (:func:`_carries`) and
    backward origins (:func:`_backward_origins`)."""
    files: dict[int, str] = {}
    locs: dict[int, tuple[int, int]] = {}
    frames: dict[int, tuple[int, int]] = {}
    section, computation = "", ""
    metas: dict[str, Meta] = {}
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
            metas[name] = Meta(
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
    metas: dict[str, Meta], parent: Mapping[str, str], loops: Mapping[str, str]
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
    metas: Mapping[str, Meta],
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
    metas: Mapping[str, Meta], members: Mapping[str, Sequence[str]]
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


def source_of(meta: Meta | None) -> str:
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


def dtype_and_dims(shape: str) -> tuple[str, tuple[int, ...]] | None:
    m = re.match(r"^(\w+)\[([\d,]*)\]", shape)
    if not m:
        return None
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    return _DTYPES.get(m.group(1), m.group(1)), dims
