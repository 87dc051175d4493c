"""Memory-budget planner: pick save / offload / recompute per named activation under a budget.

The cost model comes from the function itself:
  - bytes each name costs when saved: the residuals of a plan that saves every name
    (:func:`remat_nn.memory_report`), times their count (scan stacks count per layer);
  - extra FLOPs to recompute a name: FLOPs of the gradient when every name but this one is saved,
    minus those when every name is saved (counted from the jaxpr, scans times their length);
  - offload time: the bytes go to host and back, ``2 * bytes / host_bandwidth``.
Each unsaved name takes its cheaper alternative (offload or recompute, by time), so the choice is
a 0/1 knapsack over names: device bytes against time. It is solved exactly by a Pareto sweep for
small problems and greedily (by time saved per byte) beyond. XLA's temp bytes are predicted from
two compiles (nothing saved, everything saved); the winner is compiled and checked against the
budget, and the capacity is tightened and the solve retried until it fits.

References:
  Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost.
  Jain et al. 2020, Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization.
  PyTorch ``torch._functorch.config.activation_memory_budget`` (a knapsack over recomputation).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from remat_nn._flops import jaxpr_flops
from remat_nn._memory import compiled_memory, format_bytes, memory_report
from remat_nn._plan import Plan, names_in_jaxpr
from remat_nn.errors import PlanError

__all__ = [
    "Candidate",
    "NameCost",
    "PlanReport",
    "parse_budget",
    "plan_for_budget",
    "solve",
]

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6,
          "GB": 10**9}  # fmt: skip
_ACTIONS = ("save", "offload", "recompute")


def parse_budget(spec: str | int | float, *, reference_bytes: int | None = None) -> int:
    """Bytes from ``"2GiB"``, ``"512 MiB"``, ``1e9``, or a fraction such as ``0.5`` / ``"50%"``.

    Args:
      spec: bytes with a unit (B, KiB, MiB, GiB, KB, MB, GB), a whole number of bytes, or a
        fraction of ``reference_bytes`` (a float in (0, 1] or a percentage string).
      reference_bytes: what a fraction is a fraction of (the no-remat memory).

    >>> from remat_nn import parse_budget
    >>> parse_budget("2GiB"), parse_budget("1.5 KiB"), parse_budget(0.5, reference_bytes=100)
    (2147483648, 1536, 50)
    """
    fraction: float | None = None
    if isinstance(spec, bool):
        raise TypeError(f"budget: expected bytes or a fraction, got {spec!r}.")
    if isinstance(spec, int | float):
        if 0 < spec <= 1 and isinstance(spec, float):
            fraction = float(spec)
        elif spec > 1:
            return int(spec)
    elif isinstance(spec, str):
        text = spec.strip()
        if m := re.fullmatch(r"([0-9.]+(?:[eE][0-9]+)?)\s*%", text):
            fraction = float(m.group(1)) / 100
        elif m := re.fullmatch(r"([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)", text):
            value, unit = float(m.group(1)), m.group(2).upper()
            if unit in _UNITS and (unit or value > 1):
                return int(value * _UNITS[unit])
            if not unit and 0 < value <= 1:
                fraction = value
    if fraction is None:
        raise ValueError(
            f"budget: cannot read {spec!r}. Fix: bytes with a unit ('2GiB', '512MiB', '100KB'), "
            "a whole number of bytes, or a fraction of the no-remat memory (0.5 or '50%')."
        )
    if reference_bytes is None:
        raise ValueError(f"budget {spec!r} is a fraction, but no reference memory was given.")
    return int(fraction * reference_bytes)


# --- the solver -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NameCost:
    """What one named activation costs under each action.

    Attributes:
      name: the activation name.
      nbytes: device bytes if saved (all occurrences).
      count: how many residuals carry the name.
      recompute_seconds: time to recompute it (None: recompute not allowed).
      offload_seconds: time to move it to host and back (None: offload not allowed).
      recompute_flops: the extra FLOPs behind ``recompute_seconds``.
    """

    name: str
    nbytes: int
    count: int = 1
    recompute_seconds: float | None = 0.0
    offload_seconds: float | None = None
    recompute_flops: int = 0

    def alternative(self) -> tuple[str, float] | None:
        """The cheaper way not to keep it on device: (action, seconds), or None."""
        options = [
            (t, a)
            for a, t in (("recompute", self.recompute_seconds), ("offload", self.offload_seconds))
            if t is not None
        ]
        if not options:
            return None
        t, a = min(options)
        return a, t


@dataclass(frozen=True)
class Candidate:
    """One point of the Pareto front: device bytes of saved names, and the time paid."""

    nbytes: int
    seconds: float
    actions: tuple[tuple[str, str], ...]  # (name, action)


def _pareto(points: list[Candidate]) -> list[Candidate]:
    # Sorted by bytes; keep a point only if it is strictly faster than every cheaper one.
    points.sort(key=lambda c: (c.nbytes, c.seconds))
    front: list[Candidate] = []
    for c in points:
        if not front or c.seconds < front[-1].seconds - 1e-15:
            front.append(c)
    return front


def solve(
    costs: Sequence[NameCost], capacity: int, *, max_states: int = 20_000
) -> tuple[Candidate | None, list[Candidate], bool]:
    """Chooses an action per name: saved bytes <= ``capacity`` at the least time.

    Args:
      costs: one :class:`NameCost` per name.
      capacity: device bytes available for saved names.
      max_states: Pareto-front size beyond which the exact sweep gives way to greedy.

    Returns:
      ``(best, front, exact)``: the cheapest feasible candidate (None if none fits), the Pareto
      front of bytes against time over every candidate considered, and whether it is exact.
    """
    front = [Candidate(0, 0.0, ())]
    exact = True
    for c in costs:
        alt = c.alternative()
        nxt = [Candidate(p.nbytes + c.nbytes, p.seconds, (*p.actions, (c.name, "save")))
               for p in front]  # fmt: skip
        if alt is not None:
            nxt += [Candidate(p.nbytes, p.seconds + alt[1], (*p.actions, (c.name, alt[0])))
                    for p in front]  # fmt: skip
        front = _pareto(nxt)
        if len(front) > max_states:
            exact = False
            break
    if not exact:
        front = _greedy_front(costs)
    feasible = [p for p in front if p.nbytes <= capacity]
    best = min(feasible, key=lambda p: (p.seconds, p.nbytes)) if feasible else None
    return best, front, exact


def _greedy_front(costs: Sequence[NameCost]) -> list[Candidate]:
    # Start from nothing saved; save names in order of time saved per byte.
    actions = {}
    for c in costs:
        alt = c.alternative()
        actions[c.name] = ("save", 0.0) if alt is None else alt
    base = [c for c in costs if c.alternative() is None]
    nbytes = sum(c.nbytes for c in base)
    seconds = sum(t for _, t in actions.values())
    order = sorted(
        (c for c in costs if c.alternative() is not None),
        key=lambda c: -actions[c.name][1] / max(c.nbytes, 1),
    )
    points = [Candidate(nbytes, seconds, tuple((n, a) for n, (a, _) in actions.items()))]
    for c in order:
        nbytes += c.nbytes
        seconds -= actions[c.name][1]
        actions[c.name] = ("save", 0.0)
        points.append(Candidate(nbytes, seconds, tuple((n, a) for n, (a, _) in actions.items())))
    return _pareto(points)


# --- measuring a function ---------------------------------------------------------------------


@functools.cache
def _measured_flops_per_second() -> float:
    # A dense float32 matmul on the default device, median of 5 after warm-up.
    a = jnp.ones((512, 512), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * 512**3 / sorted(times)[2]


@dataclass(frozen=True)
class PlanReport:
    """What :func:`plan_for_budget` chose, and why.

    Attributes:
      plan: the chosen plan (the same type as a hand-written one).
      costs: per-name costs of the model.
      budget_bytes: the budget on XLA's compiled temp bytes.
      predicted_temp_bytes: the cost model's prediction for ``plan``.
      compiled_temp_bytes: XLA's temp bytes for ``plan`` (the confirmation compile).
      no_remat_temp_bytes / min_temp_bytes: the two ends (everything saved / nothing saved).
      front: Pareto front (saved bytes, seconds) over the candidates considered.
      exact: the solve was exact.
      attempts: solves until the compiled plan fit.
    """

    plan: Plan
    costs: tuple[NameCost, ...]
    budget_bytes: int
    predicted_temp_bytes: int
    compiled_temp_bytes: int
    no_remat_temp_bytes: int
    min_temp_bytes: int
    front: tuple[Candidate, ...]
    exact: bool
    attempts: int

    def __str__(self) -> str:
        lines = [
            f"plan: {self.plan}",
            f"budget {format_bytes(self.budget_bytes)}: compiled temp "
            f"{format_bytes(self.compiled_temp_bytes)} (predicted "
            f"{format_bytes(self.predicted_temp_bytes)}; range "
            f"{format_bytes(self.min_temp_bytes)} .. {format_bytes(self.no_remat_temp_bytes)}); "
            f"{'exact' if self.exact else 'greedy'} solve, {self.attempts} attempt(s)",
            "",
            "| name | count | bytes | recompute FLOPs | action |",
            "|---|--:|--:|--:|---|",
        ]
        for c in self.costs:
            lines.append(
                f"| {c.name} | {c.count} | {format_bytes(c.nbytes)} | {c.recompute_flops:.3g} | "
                f"{self.plan.action(c.name)} |"
            )
        lines += ["", "Pareto front (saved bytes -> extra seconds):"]
        lines += [f"  {format_bytes(p.nbytes):>12}  {p.seconds:.3g} s" for p in self.front]
        return "\n".join(lines)


def _grad_flops(fn: Callable[..., Any], args: Sequence[Any], the_plan: Plan) -> int:
    loss = functools.partial(fn, policy=the_plan)
    return jaxpr_flops(jax.make_jaxpr(jax.grad(loss))(*args).jaxpr)


def _temp(fn: Callable[..., Any], args: Sequence[Any], policy: Any) -> int:
    loss = functools.partial(fn, policy=policy)
    return compiled_memory(jax.grad(loss), *args).temp_size_in_bytes


def plan_for_budget(
    fn: Callable[..., Any],
    *args: Any,
    budget: str | int | float,
    allow: Sequence[str] = ("save", "offload", "recompute"),
    host_bandwidth: float = 16e9,
    flops_per_second: float | None = None,
    max_attempts: int = 6,
) -> PlanReport:
    """Finds the fastest plan whose compiled temp memory fits ``budget``.

    Args:
      fn: ``fn(*args, policy=p)`` returns a scalar loss and applies ``p`` where it remats; ``p``
        is a :class:`remat_nn.Plan` or ``"none"`` (no remat), both of which ``nn.remat``,
        ``rn.checkpoint`` and ``rn.policy`` accept, and a model can take as its plan. Its
        activations are tagged with ``rn.name``.
      *args: the arguments of ``fn``; the gradient is taken with respect to the first.
      budget: bound on XLA's temp bytes of ``jax.grad(fn)``: ``"2GiB"``, bytes, or a fraction
        of the no-remat temp memory (``0.5``).
      allow: actions the planner may use among ``save``, ``offload``, ``recompute``
        (``invert`` is done by reversible layers, not per name).
      host_bandwidth: bytes per second to host and back, for offload (CPU cannot measure it).
      flops_per_second: recompute speed; measured with a dense matmul when None.
      max_attempts: solves with a tightened capacity before giving up.

    Returns:
      A :class:`PlanReport`; ``report.plan`` is the plan.

    Raises:
      PlanError: no named activation in ``fn``, an unknown action, or a budget below the least
        memory any plan reaches (the message states that minimum).

    >>> import jax, remat_nn as rn
    >>> from remat_nn import _demo
    >>> params = _demo.init(jax.random.key(0), depth=4, width=16, hidden=64)
    >>> x = jax.numpy.ones((8, 16))
    >>> report = rn.plan_for_budget(_demo.loss, params, x, budget=0.6, flops_per_second=1e9)
    >>> report.compiled_temp_bytes <= report.budget_bytes
    True
    """
    bad = [a for a in allow if a not in (*_ACTIONS, "invert")]
    if bad or "save" not in allow:
        raise PlanError(
            f"plan_for_budget: `allow` must include 'save' and only {_ACTIONS}, got {tuple(allow)}."
        )
    probe = functools.partial(fn, policy=Plan())  # recompute everything: just to find the names
    found = sorted(set(names_in_jaxpr(jax.make_jaxpr(probe)(*args).jaxpr)))
    if not found:
        raise PlanError(
            "plan_for_budget: `fn` tags no activation with rn.name, so there is nothing to plan. "
            "Fix: tag the activations (rn.name(x, 'mlp_hidden')) inside the remat'd body."
        )
    save_all, save_none = Plan(save=tuple(found)), Plan(recompute=tuple(found))
    no_remat = _temp(fn, args, "none")
    temp_all, temp_none = _temp(fn, args, save_all), _temp(fn, args, save_none)
    budget_bytes = parse_budget(budget, reference_bytes=no_remat)
    if budget_bytes < temp_none:
        raise PlanError(
            f"plan_for_budget: budget {format_bytes(budget_bytes)} is below the least temp "
            f"memory any plan reaches, {format_bytes(temp_none)} ({temp_none} B, every name "
            f"recomputed; no remat needs {format_bytes(no_remat)}). Fix: raise the budget to at "
            f"least {temp_none} B, or reduce the batch."
        )
    # --- cost model ---
    flops_rate = flops_per_second or _measured_flops_per_second()
    by_name = memory_report(functools.partial(fn, policy=save_all), *args).by_name()
    base_flops = _grad_flops(fn, args, save_all)
    costs = []
    for n in found:
        nbytes = by_name.get(n, {}).get("bytes", 0)
        extra = max(0, _grad_flops(fn, args, Plan(save=tuple(m for m in found if m != n)))
                    - base_flops)  # fmt: skip
        costs.append(
            NameCost(
                name=n,
                nbytes=nbytes,
                count=by_name.get(n, {}).get("count", 0),
                recompute_seconds=extra / flops_rate if "recompute" in allow else None,
                offload_seconds=2 * nbytes / host_bandwidth if "offload" in allow else None,
                recompute_flops=extra,
            )
        )
    total = sum(c.nbytes for c in costs)
    slope = (temp_all - temp_none) / total if total and temp_all > temp_none else 1.0

    # --- solve, confirm by compiling, tighten ---
    def report(the_plan, predicted, compiled, front, exact, attempts):  # noqa: ANN001, ANN202
        return PlanReport(the_plan, tuple(costs), budget_bytes, predicted, compiled, no_remat,
                          temp_none, front, exact, attempts)  # fmt: skip

    capacity = int((budget_bytes - temp_none) / slope)
    for attempt in range(1, max_attempts + 1):
        best, front, exact = solve(costs, capacity)
        if best is None:
            break
        chosen = dict(best.actions)
        the_plan = Plan(
            save=tuple(n for n in found if chosen[n] == "save"),
            offload=tuple(n for n in found if chosen[n] == "offload"),
            recompute=tuple(n for n in found if chosen[n] == "recompute"),
        )
        compiled = _temp(fn, args, the_plan)
        if compiled <= budget_bytes:
            predicted = int(temp_none + slope * best.nbytes)
            return report(the_plan, predicted, compiled, tuple(front), exact, attempt)
        # Over budget: shrink the capacity by the overshoot (at least one byte) and solve again.
        capacity = min(best.nbytes - 1, capacity - int((compiled - budget_bytes) / slope) - 1)
    if temp_none <= budget_bytes:
        # Every tightened solve still overshot (XLA's temp is not affine in the saved bytes),
        # but recomputing every name was compiled above and fits: return it, not an error.
        return report(save_none, temp_none, temp_none, tuple(front), exact, max_attempts)
    raise PlanError(
        f"plan_for_budget: no plan found within {format_bytes(budget_bytes)} after "
        f"{max_attempts} attempts; the least temp memory any plan reaches is "
        f"{format_bytes(temp_none)} ({temp_none} B). Fix: raise the budget."
    )
