"""The canonical-stacks matrix (#44): does each rebuilding mechanism refuse, recompute or accept,
and how far is the gradient it gives from float64, next to jax.grad's own float32 error?

A cell is a coupling stack ``y1 = combine(x1, F(x2)); y2 = combine(x2, G(y1))`` (``combine``:
``rn.additive_combine`` or ``rn.affine_combine``; ``F(x) = tanh(LN(x) @ W)`` or
``tanh(x @ W)``, LN without parameters; ``W`` of std ``scale / sqrt(fan_in)``), over the axes
of :data:`AXES`. The branch is one function, the same for every mechanism:

- ``invertible``: ``rn.invertible`` over the whole stack (``known_argnums``: the weights), the
  stack a Python loop or a ``lax.scan`` over blocks;
- ``reversible``: ``rn.reversible_scan`` of ``rn.coupling_block`` over the same branches
  (what ``nn.ReversibleSequence`` runs). It is always a scan: its "loop" is ``unroll=True``,
  its "scan" ``unroll=1``.

bf16 cells compute the branch in bfloat16 (input and weights cast in the branch) while the
residual stream stays float32 (``recon_dtype=jnp.float32`` for the reversible stack). Every
gradient (of ``sum(y1 * c1) + sum(y2 * c2)``, ``c`` fixed random, with respect to ``x1``,
``x2`` and the weights) is compared with the float64 gradient of the same math
(``jax.enable_x64``, no bf16 casts, the scan form) by ``rn.relative_error``; "jax.grad's error"
is plain ``jax.grad`` of the cell's own function (its loop form and dtype) against the same
reference. The weight scale is data, not structure: one compiled program serves the three.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

import remat_nn as rn

AXES = {
    "coupling": ("additive", "affine"),
    "width": (16, 64, 256),
    "depth": (2, 8, 32, 64),
    "loop": ("loop", "scan"),
    "scale": ("lecun", "he", "2he"),
    "ln": (False, True),
    "dtype": ("f32", "bf16"),
}
#: Weight std times sqrt(fan_in): LeCun, He, twice He.
SCALES = {"lecun": 1.0, "he": math.sqrt(2.0), "2he": 2 * math.sqrt(2.0)}
#: The quick subset (tests/benchmarks): additive, one width, two depths, the scan, one scale,
#: float32.
QUICK = {
    "coupling": ("additive",),
    "width": (16,),
    "depth": (2, 8),
    "loop": ("scan",),
    "scale": ("lecun",),
    "dtype": ("f32",),
}
#: A full run measures every cell of the scan form and the Python loop (for the reversible
#: stack: unroll=True) only at these (width, depth): compiling rn.invertible's walk over an
#: unrolled stack, and jax.grad of it, grows with depth (seconds per program at depth 8, more
#: than the machine's memory at depth 64 on a shared 2-core machine).
LOOPED = {(16, 2), (16, 8)}
BATCH = 8
#: rn.invertible's tolerance for the second run of a refused cell: the error it would give.
LOOSE_RTOL = 0.5
#: A refusal or recompute is false where the unchecked error is within this many times
#: jax.grad's own; an accepted gradient is a silent error past SILENT times.
FALSE, SILENT = 10, 100
#: A cell whose jax.grad is off float64 by this much has no meaningful gradient to match.
NOISY = 1e-2
COMBINE = {
    "additive": (rn.additive_combine, rn.additive_uncombine),
    "affine": (rn.affine_combine, rn.affine_uncombine),
}


@dataclass(frozen=True)
class Stack:
    """What compiles: a cell without its weight scale."""

    coupling: str
    width: int
    depth: int
    loop: str
    ln: bool
    dtype: str  # "f32", "bf16" (branch) or "f64" (the reference)


@dataclass
class Outcome:
    """One mechanism in one cell; errors are rn.relative_error against float64."""

    status: str  # accepted | recomputed | refused (trace) | refused (run) | exception: ...
    err: float | None = None  # the mechanism's default setting
    unchecked: float | None = None  # reversible: fallback="none"; invertible: LOOSE_RTOL
    recomputed: float | None = None  # refused: the error with fallback="recompute"
    recompute_status: str = ""  # that run's status (refused again: no error)
    recomputes: int = 0  # that run's recompute count (all layers or scan iterations)
    layers: int = 0  # distinct layers (iterations) recomputed


@dataclass
class Cell:
    stack: Stack
    scale: str
    jax_err: float
    outcomes: dict[str, Outcome]  # mechanism -> outcome


# --- the stack, written once ------------------------------------------------------------------


def _layer_norm(x: jax.Array) -> jax.Array:
    m = jnp.mean(x, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(jnp.mean(jnp.square(x - m), -1, keepdims=True) + 1e-5)


def _branch(s: Stack) -> Callable[[jax.Array, jax.Array], jax.Array]:
    def branch(w: jax.Array, x: jax.Array) -> jax.Array:
        if s.dtype == "bf16":
            x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        return jnp.tanh((_layer_norm(x) if s.ln else x) @ w)

    return branch


def _stack_fn(s: Stack) -> Callable:
    """``(x1, x2, wf, wg) -> (y1, y2)``, ``wf`` / ``wg`` stacked ``(depth, half, out)``."""
    branch, combine = _branch(s), COMBINE[s.coupling][0]

    def block(x1, x2, wf, wg):
        x1 = combine(x1, branch(wf, x2))
        return x1, combine(x2, branch(wg, x1))

    def loop(x1, x2, wf, wg):
        for i in range(s.depth):
            x1, x2 = block(x1, x2, wf[i], wg[i])
        return x1, x2

    def scan(x1, x2, wf, wg):
        return jax.lax.scan(lambda h, w: (block(*h, *w), None), (x1, x2), (wf, wg))[0]

    return loop if s.loop == "loop" else scan


def _reversible_fn(s: Stack, fallback: str) -> Callable:
    branch, (combine, uncombine) = _branch(s), COMBINE[s.coupling]
    block = rn.coupling_block(
        lambda p, c, x: (branch(p[0], x), c),
        lambda p, c, x: (branch(p[1], x), c),
        combine=combine,
        uncombine=uncombine,
    )
    unroll = True if s.loop == "loop" else 1

    def stack(x1, x2, wf, wg):
        return rn.reversible_scan(
            block, (wf, wg), (x1, x2), recon_dtype=jnp.float32, unroll=unroll, fallback=fallback
        )[0]

    return stack


def _grad(stack: Callable) -> Callable:
    def loss(x1, x2, wf, wg, c1, c2):
        y1, y2 = stack(x1, x2, wf, wg)
        return jnp.sum(y1 * c1) + jnp.sum(y2 * c2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _data(s: Stack, scale: str) -> list[np.ndarray]:
    """``x1, x2, wf, wg, c1, c2``: float64 arrays holding float32 values (the same inputs for
    the float32 programs and the float64 reference); the scales share their draws."""
    rng = np.random.default_rng([s.width, s.depth, AXES["coupling"].index(s.coupling)])
    half = s.width // 2
    out = half if s.coupling == "additive" else s.width  # affine: log-scale and shift
    x1, x2, c1, c2 = (rng.standard_normal((BATCH, half)) for _ in range(4))
    std = SCALES[scale] / math.sqrt(half)
    wf, wg = (std * rng.standard_normal((s.depth, half, out)) for _ in range(2))
    return [a.astype(np.float32).astype(np.float64) for a in (x1, x2, wf, wg, c1, c2)]


# --- measuring --------------------------------------------------------------------------------

PROGRAMS: dict[str, Callable[[Stack], Callable]] = {
    "plain": _stack_fn,
    "invertible": lambda s: rn.invertible(_stack_fn(s), known_argnums=(2, 3)),
    "loose": lambda s: rn.invertible(_stack_fn(s), known_argnums=(2, 3), rtol=LOOSE_RTOL),
    "inv_recompute": lambda s: rn.invertible(
        _stack_fn(s), known_argnums=(2, 3), fallback="recompute"
    ),
    "error": lambda s: _reversible_fn(s, "error"),
    "recompute": lambda s: _reversible_fn(s, "recompute"),
    "none": lambda s: _reversible_fn(s, "none"),
}


class _Programs:
    """A stack's jitted gradients by :data:`PROGRAMS` name, built on first use (the scales
    share them; ``loose`` and the recomputing ones are built only for a refused cell)."""

    def __init__(self, s: Stack) -> None:
        self.stack, self.built = s, {}

    def __getitem__(self, name: str) -> Callable:
        if name not in self.built:
            self.built[name] = _grad(PROGRAMS[name](self.stack))
        return self.built[name]


def _reference(s: Stack, scales: tuple[str, ...]) -> dict[str, list[np.ndarray]]:
    """The float64 gradient of ``s``'s math (the scan form, no bf16 casts), by scale."""
    with jax.enable_x64(True):
        grad = _grad(_stack_fn(replace(s, loop="scan", dtype="f64")))
        return {sc: [np.asarray(g) for g in grad(*map(jnp.asarray, _data(s, sc)))] for sc in scales}


def _refusal(e: Exception) -> str | None:
    if isinstance(e, rn.NotInvertibleError):
        return "refused (trace)"
    # A run-time refusal is raised in a host callback and reaches us as XLA's runtime error.
    return "refused (run)" if "NotInvertibleError" in str(e) else None


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _attempt(grad: Callable, args: list, ref: list) -> tuple[str, float | None]:
    """``(status, error)`` of one gradient: accepted, refused, or the exception it raised."""
    try:
        # A refusal in a host callback is logged with its traceback by JAX before it is raised.
        with _quiet("jax._src.debugging"):
            got = jax.block_until_ready(grad(*args))
    except Exception as e:  # noqa: BLE001 -- a cell records its failure; the matrix goes on
        first = (str(e).splitlines() or [""])[0][:100]
        return _refusal(e) or f"exception: {type(e).__name__}: {first}", None
    return "accepted", rn.relative_error(got, ref)


def _recompute(out: Outcome, grad: Callable, args: list, ref: list) -> None:
    """Runs a refused cell again with fallback="recompute": its status, error and counts."""
    rn.drift_recomputes(reset=True)
    with _quiet("remat_nn"):  # the first recompute's log line
        out.recompute_status, out.recomputed = _attempt(grad, args, ref)
    counts = rn.drift_recomputes(reset=True)  # read after block_until_ready (_attempt)
    out.recomputes, out.layers = sum(counts.values()), len(counts)


def _invertible(programs: _Programs, args: list, ref: list) -> Outcome:
    out = Outcome(*_attempt(programs["invertible"], args, ref))
    if out.status.startswith("refused"):
        out.unchecked = _attempt(programs["loose"], args, ref)[1]
        _recompute(out, programs["inv_recompute"], args, ref)
    return out


def _reversible(programs: _Programs, args: list, ref: list) -> Outcome:
    out = Outcome(*_attempt(programs["error"], args, ref))
    out.unchecked = _attempt(programs["none"], args, ref)[1]
    if out.status.startswith("refused"):
        _recompute(out, programs["recompute"], args, ref)
    return out


def _cell(programs: _Programs, scale: str, ref: list) -> Cell:
    args = [jnp.asarray(a, jnp.float32) for a in _data(programs.stack, scale)]
    jax_err = _attempt(programs["plain"], args, ref)[1]
    outcomes = {
        "invertible": _invertible(programs, args, ref),
        "reversible": _reversible(programs, args, ref),
    }
    return Cell(programs.stack, scale, math.nan if jax_err is None else jax_err, outcomes)


def axes_of(quick: bool) -> dict[str, tuple]:
    return {**AXES, **QUICK} if quick else AXES


def groups(quick: bool) -> Iterator[Stack]:
    """The float64 stacks of the run (one reference program each), in order."""
    axes = axes_of(quick)
    for coupling in axes["coupling"]:
        for width in axes["width"]:
            for depth in axes["depth"]:
                for ln in axes["ln"]:
                    yield Stack(coupling, width, depth, "scan", ln, "f64")


def measure(quick: bool, log: Callable[[str], None] = lambda _: None) -> list[Cell]:
    axes, cells, start = axes_of(quick), [], time.perf_counter()
    for base in groups(quick):
        refs = _reference(base, axes["scale"])
        looped = quick or (base.width, base.depth) in LOOPED
        for loop in axes["loop"] if looped else ("scan",):
            for dtype in axes["dtype"]:
                programs = _Programs(replace(base, loop=loop, dtype=dtype))
                cells += [_cell(programs, sc, refs[sc]) for sc in axes["scale"]]
        log(f"{label(base)}: {len(cells)} cells, {time.perf_counter() - start:.0f}s")
        jax.clear_caches()  # the next stacks share no program with these
    return cells


def label(s: Stack, scale: str = "") -> str:
    ln = "LN" if s.ln else "no LN"
    return f"{s.coupling} w{s.width} d{s.depth} {s.loop} {scale} {ln} {s.dtype}".replace("  ", " ")


# --- reading ----------------------------------------------------------------------------------

MECHANISMS = ("invertible", "reversible")
UNCHECKED = {"invertible": f"rtol={LOOSE_RTOL}", "reversible": 'fallback="none"'}


def _ratio(err: float | None, jax_err: float) -> float | None:
    """``err`` in units of jax.grad's own error (None if either is missing or 0)."""
    if err is None or not jax_err > 0 or not math.isfinite(jax_err):
        return None
    return err / jax_err


def _flagged(c: Cell, o: Outcome) -> bool:
    return o.status.startswith("refused")


def summary(cells: list[Cell]) -> tuple[list[str], int, int]:
    """The summary lines, the count of false refusals / recomputes and of silent errors."""
    rows = [(c, m, c.outcomes[m]) for c in cells for m in MECHANISMS]
    false = [
        r for r in rows if _flagged(r[0], r[2]) and _le(_ratio(r[2].unchecked, r[0].jax_err), FALSE)
    ]
    unknown = [
        r for r in rows if _flagged(r[0], r[2]) and _ratio(r[2].unchecked, r[0].jax_err) is None
    ]
    silent = [
        r for r in rows if r[2].status == "accepted" and _gt(_ratio(r[2].err, r[0].jax_err), SILENT)
    ]
    noisy = [r for r in false if not r[0].jax_err < NOISY]
    futile = [
        r
        for r in rows
        if _flagged(r[0], r[2]) and _gt(_ratio(r[2].recomputed, r[0].jax_err), SILENT)
    ]
    again = [r for r in rows if r[2].recompute_status.startswith("refused")]
    ran = [r for r in rows if r[2].recomputes > 0]
    lines = [f"- {m}: {_counts(cells, m)}" for m in MECHANISMS]
    lines += [
        f"- **false refusals** (refused, yet the unchecked gradient's "
        f"error is <= {FALSE}x jax.grad's own): **{len(false)}**"
        + _by_mechanism(false)
        + f"; {len(noisy)} of them where jax.grad's own error is >= {NOISY:g} (its gradient "
        f"no better; mostly bfloat16 branches and chaotic stacks): {_by_mechanism(noisy)[2:-1]}"
        + f"; {len(unknown)} more refused cells have no unchecked error (refused again at "
        f"rtol={LOOSE_RTOL}, or at trace time): n/a",
        f"- **silent errors** (accepted, error > {SILENT}x jax.grad's own): **{len(silent)}**"
        + _by_mechanism(silent),
        f'- refused cells whose gradient with fallback="recompute" is still '
        f"> {SILENT}x jax.grad's own error: {len(futile)}" + _by_mechanism(futile),
        f'- refused cells refused again with fallback="recompute": {len(again)}'
        + _by_mechanism(again)
        + " (rn.invertible recomputes at run time only inside a `lax.scan`; the Python loop's "
        "failed checks still raise)",
        f'- refused cells that recomputed at run time with fallback="recompute": {len(ran)}'
        + _by_mechanism(ran)
        + " (a refused rn.invertible cell that recomputed nothing kept inputs at trace time "
        'instead: fallback="recompute" uses no inversion a value can destroy, such as the '
        "affine couplings' division)",
    ]
    lines += _worst(rows)
    lines += [f"  - silent: {_row_text(r)}" for r in silent[:20]]
    lines += [f"  - recompute did not help: {_row_text(r, 'recomputed')}" for r in futile[:20]]
    return lines, len(false), len(silent)


def _le(x: float | None, bound: float) -> bool:
    return x is not None and x <= bound


def _gt(x: float | None, bound: float) -> bool:
    return x is not None and not x <= bound  # nan: a non-finite gradient is past every bound


def _counts(cells: list[Cell], m: str) -> str:
    statuses: dict[str, int] = {}
    for c in cells:
        key = c.outcomes[m].status.split(":")[0]
        statuses[key] = statuses.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))


def _by_mechanism(rows: list) -> str:
    parts = [f"{m} {sum(r[1] == m for r in rows)}" for m in MECHANISMS]
    return f" ({', '.join(parts)})"


def _row_text(r: tuple, attr: str = "err") -> str:
    c, m, o = r
    err = getattr(o, attr)
    ratio = _ratio(err, c.jax_err)
    return f"{m}, {label(c.stack, c.scale)}: {_e(err)} ({_x(ratio)} jax.grad's {_e(c.jax_err)})"


def _worst(rows: list) -> list[str]:
    """The worst ratio to jax.grad's own error per mechanism and status, and unchecked."""
    lines = ["- worst ratios to jax.grad's own error:"]
    for m in MECHANISMS:
        for status, attr in (("accepted", "err"), ("refused", "recomputed"), (None, "unchecked")):
            picked = [
                (_ratio(getattr(o, attr), c.jax_err), c)
                for c, mm, o in rows
                if mm == m and (status is None or o.status.startswith(status))
            ]
            picked = [(x, c) for x, c in picked if x is not None]
            if not picked:
                continue
            x, c = max(picked, key=lambda p: math.inf if math.isnan(p[0]) else p[0])
            what = {"accepted": "accepted cells", "refused": 'refused cells, fallback="recompute"'}
            what = what.get(status or "", f"unchecked ({UNCHECKED[m]})")
            lines.append(f"  - {m}, {what}: {_x(x)} at {label(c.stack, c.scale)}")
    return lines


def _e(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}x"


def _status(o: Outcome) -> str:
    return o.status


def _recompute_text(o: Outcome, unit: str) -> str:
    if o.recompute_status.startswith("refused"):
        return o.recompute_status
    if o.recomputed is None:
        return "—"
    return f"{_e(o.recomputed)} ({o.recomputes} in {o.layers} {unit})"


def table(cells: list[Cell]) -> list[str]:
    head = (
        "| coupling | width | depth | loop | scale | LN | branch | jax.grad err "
        f"| rn.invertible | err | err rtol={LOOSE_RTOL} | err recompute (recomputes) "
        "| reversible | err | err none | err recompute (recomputes) |"
    )
    lines = [head, "|---|--:|--:|---|---|---|---|--:|---|--:|--:|--:|---|--:|--:|--:|"]
    for c in cells:
        s, inv, rev = c.stack, c.outcomes["invertible"], c.outcomes["reversible"]
        lines.append(
            f"| {s.coupling} | {s.width} | {s.depth} | {s.loop} | {c.scale} | "
            f"{'LN' if s.ln else '—'} | {s.dtype} | {_e(c.jax_err)} | {_status(inv)} | "
            f"{_e(inv.err)} | {_e(inv.unchecked)} | {_recompute_text(inv, 'iterations')} | "
            f"{_status(rev)} | {_e(rev.err)} | {_e(rev.unchecked)} | "
            f"{_recompute_text(rev, 'layers')} |"
        )
    return lines


def section(quick: bool) -> tuple[str, int, int]:
    """The results section: what ran, the summary lines and the table; and the two counts."""
    start = time.perf_counter()
    cells = measure(quick, log=lambda line: print(f"[matrix] {line}", file=sys.stderr, flush=True))
    seconds = time.perf_counter() - start
    lines, false, silent = summary(cells)
    axes = axes_of(quick)
    ran = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in axes.items())
    looped = (
        ""
        if quick
        else " The Python loop (reversible: `unroll=True`) only at (width, depth) "
        f"{', '.join(map(str, sorted(LOOPED)))}; every other cell is the `lax.scan` form "
        "(reversible: `unroll=1`)."
    )
    text = [
        "## The canonical-stacks matrix (#44)",
        "",
        f"Reproduce: `python -m benchmarks invertible{' --quick' if quick else ''}`. "
        f"{len(cells)} cells x 2 mechanisms in {seconds / 60:.1f} min; axes: {ran}.{looped} "
        "A cell's errors are `rn.relative_error` against the float64 gradient of the same math; "
        "jax.grad's err is plain `jax.grad` of the cell's own function (bf16 branches included). "
        "rn.invertible runs with its defaults (`known_argnums` the weights); a refused cell is "
        f"run again at `rtol={LOOSE_RTOL}` for the error it would give, and with "
        'fallback="recompute" (scan iterations recomputed at run time, counted by '
        "`rn.drift_recomputes()`). The reversible stack "
        'runs with its default fallback="error" and again with fallback="none" (reconstruction '
        'alone); a refused cell runs a third time with fallback="recompute" (its error, and '
        "`rn.drift_recomputes()`: recomputes over every layer and call, in how many layers). "
        "Module docstring of `benchmarks/invertible_matrix.py`: the stack, the branch, the data.",
        "",
        *lines,
        "",
        *table(cells),
    ]
    return "\n".join(text), false, silent
