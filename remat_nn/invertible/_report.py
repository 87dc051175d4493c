"""``rn.inversion_report``: what the walk does with each equation, and what the forward stores."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from remat_nn._jax_internals import core, custom_vjp_bwd, scan_p, sub_jaxprs
from remat_nn.invertible._api import Invertible, _trace
from remat_nn.invertible._jaxpr import aval_str, display, nbytes, where

__all__ = ["InversionEntry", "InversionReport", "inversion_report"]


@dataclasses.dataclass(frozen=True)
class InversionEntry:
    """How the reverse walk handles one equation of the traced function."""

    index: int  # position in the (dead-code-free) jaxpr
    primitive: str
    path: str  # "inverted" | "recomputed" | "known"
    where: str  # source line, "file.py:12 (fn)"
    detail: str


_PATH_TEXT = {
    "inverted": "inverted (operands rebuilt from outputs)",
    "recomputed": "recomputed forward from known values",
    "known": "outputs and operands known: only its VJP runs",
    "idle": "no cotangent reaches it: the backward pass skips it",
}


@dataclasses.dataclass(frozen=True)
class InversionReport:
    """What ``rn.invertible`` does with each equation of a function; ``print`` it to read it."""

    entries: tuple[InversionEntry, ...]
    stored_inputs: tuple[tuple[str, str], ...]  # (input name, "f32[8,8]"): kept, not copied
    data_inputs: tuple[str, ...]  # kept inputs on the data path: the outputs do not determine them
    checked: tuple[tuple[str, str, str], ...]  # (primitive, where, reason): run-time checks
    output_bytes: int  # bytes of the outputs, which every call stores
    notes: tuple[str, ...]  # warnings about the use (per-block calls)

    @property
    def counts(self) -> dict[str, int]:
        """Number of equations per path, e.g. ``{'inverted': 4, 'recomputed': 8}``."""
        out: dict[str, int] = {}
        for path in _PATH_TEXT:
            n = sum(e.path == path for e in self.entries)
            if n:
                out[path] = n
        return out

    @property
    def invertible(self) -> bool:
        """True if the walk keeps only weights and constants: every data input is rebuilt."""
        return not self.data_inputs

    def __str__(self) -> str:
        lines = [
            f"rn.inversion_report: {len(self.entries)} equations; "
            + ", ".join(f"{n} {p}" for p, n in self.counts.items())
        ]
        wp = max([len("primitive")] + [len(e.primitive) for e in self.entries])
        ww = max([len("where")] + [len(e.where) for e in self.entries])
        lines.append(f"  {'#':>4}  {'primitive':<{wp}}  {'path':<10}  {'where':<{ww}}  detail")
        for e in self.entries:
            lines.append(
                f"  {e.index:>4}  {e.primitive:<{wp}}  {e.path:<10}  {e.where:<{ww}}  {e.detail}"
            )
        kept = ", ".join(f"{n} ({s})" for n, s in self.stored_inputs) or "none"
        lines.append(f"stored inputs (kept alive, not copied): {kept}")
        if self.data_inputs:
            lines.append(
                "  of which the outputs do not determine (kept so the walk can recompute): "
                + ", ".join(self.data_inputs)
            )
        lines.append(f"stored outputs: {self.output_bytes:,} B per call; no intermediates")
        for prim, at, reason in self.checked:
            lines.append(f"checked at run time: `{prim}` at {at} ({reason})")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _invertible_calls(jaxpr: core.Jaxpr, times: int, counts: dict[str, int]) -> None:
    """Counts rn.invertible blocks run by ``jaxpr`` (a scan body runs ``length`` times)."""
    for eqn in jaxpr.eqns:
        name = getattr(custom_vjp_bwd(eqn), "invertible_block", None)
        if name is not None:
            counts[name] = counts.get(name, 0) + times
            continue
        inner = times * eqn.params["length"] if eqn.primitive is scan_p else times
        for sub in sub_jaxprs(eqn):
            _invertible_calls(
                sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub, inner, counts
            )


def _per_block_notes(jaxpr: core.Jaxpr) -> tuple[str, ...]:
    counts: dict[str, int] = {}
    _invertible_calls(jaxpr, 1, counts)
    return tuple(
        f"rn.invertible({name}) runs {n} times per call (once per block): each run stores its "
        "outputs, so memory grows with the number of blocks, as without remat. Wrap the whole "
        "stack (or the lax.scan over the blocks) in one rn.invertible instead."
        for name, n in sorted(counts.items())
        if n > 1
    )


def _detail(analysis, index: int, action: str, step) -> str:
    eqn = analysis.eqns[index]
    if action != "inverted":
        return {"recomputed": "operands known", "known": "VJP with known values"}.get(
            action, "not differentiated"
        )
    d = step.derivation
    ops = ", ".join(map(str, d.unknown))
    sub = d.assessment.sub
    if eqn.primitive is scan_p:
        text = f"operand(s) {ops} rebuilt by a reverse scan of its inverted body"
    elif sub is not None:
        text = f"operand(s) {ops} by walking its body ({len(sub.eqns)} equations)"
    elif analysis.rules[index].reads is not None:
        text = f"operand 0 from the {len(analysis.rules[index].reads)} slices that tile it"
    elif display(eqn).startswith("custom_ivjp"):
        text = f"operand(s) {ops} from its custom_ivjp rule"
    else:
        known = [p for p in range(len(eqn.invars)) if p not in d.unknown]
        text = f"operand(s) {ops} reconstructed" + (f"; {known} known" if known else "")
    if step.check:
        a = d.assessment
        text += "; checked at run time (" + "; or ".join(w for w in (a.lossy, a.bounded) if w) + ")"
    return text


def inversion_report(fun: Callable, *args: Any, **kwargs: Any) -> InversionReport:
    """Reports, per equation of ``fun``, whether ``rn.invertible`` inverts or recomputes it.

    Shows which inputs the forward pass keeps (and which of them only because the outputs do
    not determine them), which inversions are checked at run time, and flags an
    ``rn.invertible`` block that ``fun`` runs once per layer (each run stores its outputs).
    Nothing is executed; only ``fun``'s jaxpr is traced.

    Args:
      fun: a function, or an ``rn.invertible`` wrapper (its settings and static arguments
        are used).
      *args: example positional arguments (arrays or ``jax.ShapeDtypeStruct``s), as for the call.
      **kwargs: example keyword arguments.

    Returns:
      An :class:`InversionReport`: ``entries`` (one per equation, program order), ``counts``,
      ``stored_inputs``, ``data_inputs``, ``checked``, ``notes``, ``invertible``; ``print`` it.

    >>> import jax.numpy as jnp, remat_nn as rn
    >>> report = rn.inversion_report(lambda x, w: x + jnp.tanh(w), jnp.ones(3), jnp.ones(3))
    >>> report.counts, report.stored_inputs
    ({'inverted': 1, 'recomputed': 1}, (('args[1]', 'f32[3]'),))

    References:
      Gomez et al. 2017 (RevNet); JAX's removed ``jax.invertible`` (jax#8686).
    """
    if isinstance(fun, Invertible):
        traced = fun.trace(*args, **kwargs)
    else:
        traced = _trace(fun, args, kwargs, lossy_ok=True)
    analysis = traced.analysis
    actions: dict[int, tuple[str, Any]] = {}
    for step in analysis.schedule(True, False).steps:
        if step.action in ("inverse", "fused"):
            actions[step.eqn] = ("inverted", step)
        elif step.action == "forward":
            actions.setdefault(step.eqn, ("recomputed", step))
    entries = []
    for i, eqn in enumerate(analysis.eqns):
        action, step = actions.get(i, ("known" if analysis.needs_vjp[i] else "idle", None))
        entries.append(
            InversionEntry(i, display(eqn), action, where(eqn), _detail(analysis, i, action, step))
        )
    invars = analysis.jaxpr.invars
    lossy = {  # once per equation: the walk may rebuild an operand early and check it then
        s.eqn: s.derivation.assessment.lossy
        for s in analysis.schedule(True, False).steps
        if s.check and s.derivation.assessment.lossy
    }
    checked = tuple(
        (display(analysis.eqns[i]), where(analysis.eqns[i]), reason)
        for i, reason in sorted(lossy.items())
    )
    return InversionReport(
        entries=tuple(entries),
        stored_inputs=tuple((traced.names[p], aval_str(invars[p].aval)) for p in analysis.kept),
        data_inputs=tuple(traced.names[p] for p in analysis.undetermined),
        checked=checked,
        output_bytes=sum(nbytes(v.aval) for v in analysis.jaxpr.outvars),
        notes=_per_block_notes(analysis.jaxpr),
    )
