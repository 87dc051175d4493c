"""Analysis: which values the reverse walk can know, and how, by one monotone closure.

From what the backward pass holds (the outputs and the inputs it keeps), recomputation
(operands known -> outputs known) and inversion (outputs known -> operands rebuilt) are applied
to a least fixpoint, the same whatever the statement order; each value records its derivation
for the walk, and the fewest inputs are kept. The rules, the order of preference and the choice
of kept inputs: remat_nn/invertible/README.md, section 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax.extend.core.primitives as prims
import numpy as np

from remat_nn._jax_internals import core
from remat_nn.invertible._equation_rules import (
    Assessment,
    EquationRule,
    linked,
    outputs_read,
    rules_of,
)
from remat_nn.invertible._jaxpr import dce, display, is_float, is_var, nbytes, where
from remat_nn.invertible._primitive_rules import DEFAULT_RTOL
from remat_nn.invertible._walk import Derivation, build_schedule

stop_gradient_p = prims.stop_gradient_p


_ADDITIVE = frozenset({"add", "sub", "add_any"})


def _rank(eqn: core.JaxprEqn, verdict: Assessment) -> int:
    """How well an inversion is conditioned, best first: 0 exact for every value (nothing to
    check at run time); 1 checked at run time, with an error relative to the rebuilt value or
    the output (mul, div, exp, log, a body walk...); 2 additive (add, sub: the output's
    rounding is relative to the other operand, which can dwarf the rebuilt one)."""
    checked = verdict.lossy is not None or verdict.bounded is not None
    if not checked and (verdict.sub is None or not verdict.sub.checked):
        return 0
    return 2 if eqn.primitive.name in _ADDITIVE else 1


def _plain(v: Any) -> str:
    """A short, deterministic text for an equation parameter (bodies by their size)."""
    if isinstance(v, core.ClosedJaxpr):
        v = v.jaxpr
    if isinstance(v, core.Jaxpr):
        return f"jaxpr{len(v.eqns)}"
    if isinstance(v, tuple | list):
        return "(" + ",".join(map(_plain, v)) + ")"
    if isinstance(v, bool | int | float | complex | str | type(None)):
        return repr(v)
    if isinstance(v, np.dtype):
        return str(v)
    return getattr(v, "__name__", type(v).__name__)


def _params_text(params: dict) -> str:
    return ",".join(f"{k}={_plain(params[k])}" for k in sorted(params))


class Analysis:
    """The closure of one jaxpr (constvars already turned into leading invars).

    Attributes:
      known: every value the walk can know, with its derivation.
      kept: input positions the forward pass stores (residuals): given ones excluded.
      needs_vjp: per equation, whether a nonzero cotangent can reach a float operand of it.
      lossy: why some inversion needs a run-time check, or None.
      failure: why the closure misses a needed value, or None.
    """

    def __init__(
        self,
        jaxpr: core.Jaxpr,
        known_in: Sequence[bool],
        known_out: Sequence[bool],
        *,
        keep_inputs: bool,
        lossy_ok: bool,
        cache: dict,
        constants: int = 0,
        declared: Sequence[int] | None = None,
        diff_in: Sequence[bool] | None = None,
        rtol: float = DEFAULT_RTOL,
    ):
        self.jaxpr, self.eqns = jaxpr, jaxpr.eqns
        self.rtol = rtol
        self.known_in, self.known_out = tuple(known_in), tuple(known_out)
        self.lossy_ok, self.cache = lossy_ok, cache
        self.rules: list[EquationRule | None]
        self.rules, self.no_inverse = rules_of(jaxpr)  # no_inverse: slices in no tiling, why
        self.producer = {v: i for i, e in enumerate(self.eqns) for v in e.outvars if is_var(v)}
        self.touching: dict[core.Var, list[int]] = {}  # var -> equations reading or writing it
        for i, (e, rule) in enumerate(zip(self.eqns, self.rules, strict=True)):
            reads = () if rule is None else outputs_read(rule, e)  # a tiling: all its slices
            for a in dict.fromkeys(a for a in (*e.invars, *e.outvars, *reads) if is_var(a)):
                self.touching.setdefault(a, []).append(i)
        self.verdicts: dict[tuple[int, tuple[int, ...]], Assessment] = {}
        self._digests: list[str] | None = None
        self.varying = self._varying(diff_in)
        self.needs_vjp = self._needs_vjp()
        self.required = {
            a for i, e in enumerate(self.eqns) if self.needs_vjp[i] for a in e.invars if is_var(a)
        }
        self.kept: tuple[int, ...] = ()
        self.data_kept: tuple[int, ...] = ()
        self.undetermined: tuple[int, ...] = ()  # kept inputs a strict rn.invertible refuses
        self.blocked: str | None = None  # the equation that stops the walk without them
        self.lossy: str | None = None
        self.checked = False  # some inversion runs a run-time check (guard or bound)
        self.failure: str | None = None
        self._schedules: dict[tuple[bool, bool], Any] = {}
        self._run(keep_inputs, constants, declared)

    # --- the closure ----------------------------------------------------------------------------

    def _varying(self, diff_in: Sequence[bool] | None) -> set[core.Var]:
        """Float values that carry a tangent: they depend on a differentiated input other than
        through ``stop_gradient`` (a closed-over constant, ``stop_gradient(x)`` do not)."""
        invars = self.jaxpr.invars
        diff = diff_in if diff_in is not None else (True,) * len(invars)
        varying = {v for v, d in zip(invars, diff, strict=True) if d and is_float(v.aval)}
        for e in self.eqns:
            if e.primitive is not stop_gradient_p and any(
                is_var(a) and a in varying for a in e.invars
            ):
                varying.update(v for v in e.outvars if is_var(v) and is_float(v.aval))
        return varying

    def active(self, i: int) -> tuple[int, ...]:
        """The operand positions of equation ``i`` that get a cotangent."""
        return tuple(
            p for p, a in enumerate(self.eqns[i].invars) if is_var(a) and a in self.varying
        )

    def _needs_vjp(self) -> list[bool]:
        reach = {v for v in self.jaxpr.outvars if is_var(v) and is_float(v.aval)}
        out = [False] * len(self.eqns)
        for i in reversed(range(len(self.eqns))):
            e = self.eqns[i]
            floats = [a for a in e.invars if is_var(a) and a in self.varying]
            if floats and any(is_var(v) and v in reach for v in e.outvars):
                out[i] = True
                reach.update(floats)
        return out

    def _forward(self, i: int, known: dict) -> list[core.Var]:
        """Recomputes equation ``i``'s unknown outputs if its operands are all known."""
        eqn = self.eqns[i]
        new = [v for v in eqn.outvars if is_var(v) and v not in known]
        if not new or not all(a in known for a in eqn.invars if is_var(a)):
            return []
        d = Derivation("forward", i)
        known.update((v, d) for v in new)
        return new

    def _candidate(self, i: int, known: dict) -> tuple | None:
        """Equation ``i``'s inversion as a heap entry ``(rank, digest, i, unknown)``, or None
        (an output unknown, nothing to rebuild, or no rule for these operands)."""
        eqn, rule = self.eqns[i], self.rules[i]
        if rule is None or not all(is_var(v) and v in known for v in outputs_read(rule, eqn)):
            return None  # no rule, a dropped output, or an unknown output
        unknown = tuple(p for p, a in enumerate(eqn.invars) if is_var(a) and a not in known)
        if not unknown:
            return None
        verdict = self._verdict(i, rule, unknown)
        if verdict.reason is not None:
            return None
        return (_rank(eqn, verdict), self._digest(i), i, unknown)

    def _verdict(self, i: int, rule: EquationRule, unknown: tuple[int, ...]) -> Assessment:
        """``rule``'s verdict on rebuilding ``unknown`` of equation ``i`` (cached)."""
        key = (i, unknown)
        if key not in self.verdicts:
            eqn = self.eqns[i]
            values = [eqn.invars[p] for p in unknown]
            if len(set(values)) != len(values):
                verdict = Assessment(
                    "the same unknown value is several of its operands (like x * x), so its "
                    "output does not determine it"
                )
            else:
                verdict = rule.assess(self, eqn, unknown)
            if verdict.reason is None and verdict.lossy is not None and not self.lossy_ok:
                verdict = dataclasses.replace(
                    verdict, reason=f"its inverse is not exact for every value ({verdict.lossy})"
                )
            self.verdicts[key] = verdict
        return self.verdicts[key]

    def _close(self, known: dict, start: Sequence[int]) -> None:
        """Extends ``known`` to the fixpoint: every recomputation first, then the best-ranked
        inversion (see :func:`_rank`; ties by the equation's structural digest), repeated.

        Forward derivations are unique (a value has one producer) and inversions are taken in
        an order that depends only on the program's dataflow, never on its statement order, so
        a program and any reordering of its statements get the same derivations (up to
        statements that are exact copies of each other, whose choice does not matter)."""
        queue, queued = deque(start), set(start)
        heap: list[tuple] = []
        while True:
            while queue:
                i = queue.popleft()
                queued.discard(i)
                new = self._forward(i, known)
                if not new:
                    entry = self._candidate(i, known)
                    if entry is not None:
                        heapq.heappush(heap, entry)
                    continue
                for v in new:
                    for j in self.touching.get(v, ()):
                        if j not in queued:
                            queued.add(j)
                            queue.append(j)
            new = []
            while heap and not new:
                _, _, i, unknown = heapq.heappop(heap)
                holes = tuple(p for p in unknown if self.eqns[i].invars[p] not in known)
                if holes != unknown:  # stale: a later entry for the remaining holes exists
                    continue
                d = Derivation("inverse", i, unknown, self.verdicts[i, unknown])
                new = [self.eqns[i].invars[p] for p in unknown]
                known.update((v, d) for v in new)
            if not new:
                return
            queue.extend(j for v in new for j in self.touching.get(v, ()) if j not in queued)
            queued.update(queue)

    def _digest(self, i: int) -> str:
        """A digest of equation ``i`` and the dataflow behind its operands (input positions,
        primitives, parameters), independent of statement order and stable across processes."""
        if self._digests is None:
            names: dict[core.Var, str] = {v: f"in{p}" for p, v in enumerate(self.jaxpr.invars)}
            self._digests = []
            for e in self.eqns:
                ops = ",".join(
                    names.get(a, "?") if is_var(a) else f"{a}:{a.aval}" for a in e.invars
                )
                text = f"{e.primitive.name}[{_params_text(e.params)}]({ops})"
                digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
                self._digests.append(digest)
                for k, v in enumerate(e.outvars):
                    names[v] = f"{digest}.{k}"
        return self._digests[i]

    def _touching_all(self, vs) -> list[int]:
        return sorted({j for v in vs for j in self.touching.get(v, ())}, reverse=True)

    def _run(self, keep_inputs: bool, constants: int, declared: Sequence[int] | None) -> None:
        invars = self.jaxpr.invars
        given = Derivation("given")
        known: dict[core.Var, Derivation] = {}
        known.update((v, given) for v, k in zip(invars, self.known_in, strict=True) if k)
        known.update(
            (v, given)
            for v, k in zip(self.jaxpr.outvars, self.known_out, strict=True)
            if k and is_var(v)
        )
        wanted = set(self.required)
        if not keep_inputs:  # a body: the caller wants its unknown inputs back
            wanted.update(v for v, k in zip(invars, self.known_in, strict=True) if not k)
        kept: list[int] = []
        if keep_inputs:
            reach = linked(self.jaxpr)
            for p, v in enumerate(invars):
                if v in known or v not in self.touching:
                    continue
                # declared weights, or (inferred) inputs no rule could ever rebuild
                if p < constants or (v not in reach if declared is None else p in declared):
                    kept.append(p)
                    known[v] = given
        self.must_keep = tuple(kept)  # weights and constants
        self._close(known, list(reversed(range(len(self.eqns)))))
        first_missing = wanted - known.keys()
        while keep_inputs and not wanted <= known.keys():
            best = None
            for p, v in enumerate(invars):
                if v in known or v not in self.touching:
                    continue
                trial = dict(known)
                trial[v] = given
                self._close(trial, self._touching_all([v]))
                score = (-len(wanted & trial.keys()), nbytes(v.aval), p)
                if best is None or score < best[0]:
                    best = (score, p, trial)
            if best is None:
                break
            kept.append(best[1])
            known = best[2]
        if len(kept) > len(self.must_keep):
            # Inputs were kept: derive again from what is given (the trials closed from
            # partial sets). The same set, derivations independent of the keeping order.
            known = {v: d for v, d in known.items() if d.kind == "given"}
            self._close(known, list(reversed(range(len(self.eqns)))))
        self.known, self.kept = known, tuple(sorted(kept))
        missing = wanted - known.keys()
        if missing:
            self.failure = self._why(missing)
            return
        self.data_kept = self._data_kept()
        if declared is None:  # constants are kept, never data
            self.undetermined = tuple(p for p in self.data_kept if p >= constants)
        else:
            self.undetermined = tuple(p for p in self.kept if p not in self.must_keep)
        if self.undetermined:
            self.blocked = self._chain_break(invars[self.undetermined[0]]) or self._why(
                first_missing or {invars[self.undetermined[0]]}
            )
        self.lossy = next(
            (
                d.assessment.lossy
                for d in known.values()
                if d.assessment is not None and d.assessment.lossy is not None  # inversions
            ),
            None,
        )
        self.checked = any(
            d.assessment is not None
            and (d.assessment.lossy or d.assessment.bounded or d.assessment.sub is not None)
            for d in known.values()
        )

    def _data_kept(self) -> tuple[int, ...]:
        """Kept inputs that are data, not weights: none of the values recomputed from them is a
        known operand of an inversion (a weight's ``F(x2)`` helps rebuild ``x1``; ``x1`` hidden
        by ``sin(x1 + F(x2))``, or ``x`` in ``exp(x) * x``, only feeds VJPs). Report only."""
        helpers = set()  # known operands of the inversions
        consumers: dict[core.Var, list[int]] = {}
        for d in set(self.known.values()):
            if d.kind == "inverse":
                eqn = self.eqns[d.eqn]
                helpers.update(
                    a for p, a in enumerate(eqn.invars) if is_var(a) and p not in d.unknown
                )
            elif d.kind == "forward":
                for a in self.eqns[d.eqn].invars:
                    if is_var(a):
                        consumers.setdefault(a, []).append(d.eqn)
        data = []
        for p in self.kept:
            seen, stack = set(), [self.jaxpr.invars[p]]
            while stack and not (seen & helpers):
                v = stack.pop()
                if v in seen:
                    continue
                seen.add(v)
                for i in consumers.get(v, ()):
                    stack.extend(w for w in self.eqns[i].outvars if is_var(w))
            if not seen & helpers:
                data.append(p)
        return tuple(data)

    def _why(self, missing: set) -> str:
        """Why the latest equation needing a missing value cannot get it."""
        for i in reversed(range(len(self.eqns))):
            eqn = self.eqns[i]
            if not any(is_var(a) and a in missing for a in (*eqn.invars, *eqn.outvars)):
                continue
            reasons = [a.reason for (j, _), a in self.verdicts.items() if j == i and a.reason]
            if reasons:
                reason = reasons[0]
            elif self.rules[i] is None:
                reason = self.no_inverse.get(i, f"`{eqn.primitive.name}` has no registered inverse")
            else:
                reason = "its outputs are not all known"
            return f"`{display(eqn)}` at {where(eqn)}: {reason}"
        p = next(p for p, v in enumerate(self.jaxpr.invars) if v in missing)
        return f"operand {p} does not reach any output"

    def _chain_break(self, v: core.Var) -> str | None:
        """Where the chain from input ``v`` to the outputs stops being invertible: the first
        equation (in program order) on its paths that no rule can undo in that operand (None:
        every equation on the way has a rule for it)."""
        cone = {v}
        for i, eqn in enumerate(self.eqns):
            pos = [p for p, a in enumerate(eqn.invars) if is_var(a) and a in cone]
            if not pos:
                continue
            rule = self.rules[i]
            if rule is None:
                why = self.no_inverse.get(i, f"`{eqn.primitive.name}` has no inverse")
                return f"`{display(eqn)}` at {where(eqn)}: {why}"
            if not any(rule.reconstructs(eqn, p) for p in pos):
                return f"`{display(eqn)}` at {where(eqn)}: its rule cannot rebuild operand {pos}"
            cone.update(w for w in eqn.outvars if is_var(w))
        return None

    # --- nested bodies --------------------------------------------------------------------------

    def nested(self, jaxpr: core.Jaxpr, known_in, known_out) -> Analysis | str:
        """The analysis of a call's or scan's body (no inputs kept), or why it fails; cached."""
        key = (id(jaxpr), tuple(known_in), tuple(known_out), self.lossy_ok, self.rtol)
        if key not in self.cache:
            live = dce(jaxpr, known_out)
            sub = Analysis(
                live,
                known_in,
                known_out,
                keep_inputs=False,
                lossy_ok=self.lossy_ok,
                cache=self.cache,
                rtol=self.rtol,
            )
            self.cache[key] = (jaxpr, sub.failure or sub)  # holds jaxpr: its id() stays unique
        return self.cache[key][1]

    def schedule(self, want_cts: bool, want_inputs: bool):
        """The walk over this analysis (built once per kind): with cotangents, and/or
        rebuilding the unknown inputs."""
        key = (want_cts, want_inputs)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(self, want_cts, want_inputs)
        return self._schedules[key]


def analyze(
    jaxpr: core.Jaxpr,
    *,
    lossy_ok: bool,
    num_constants: int = 0,
    declared: Sequence[int] | None = None,
    diff_in: Sequence[bool] | None = None,
    rtol: float = DEFAULT_RTOL,
) -> Analysis:
    """The top-level analysis: every input may be kept, every output is known.

    The first ``num_constants`` inputs are closed-over constants: always kept (they cost
    nothing), never rebuilt. ``declared``: the input positions declared known (weights), or
    None to infer them. ``diff_in``: which inputs are differentiated (default all).
    """
    return Analysis(
        jaxpr,
        (False,) * len(jaxpr.invars),
        (True,) * len(jaxpr.outvars),
        keep_inputs=True,
        lossy_ok=lossy_ok,
        cache={},
        constants=num_constants,
        declared=declared,
        diff_in=diff_in,
        rtol=rtol,
    )
