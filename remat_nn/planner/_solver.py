"""The planner's solver: an action per name under a byte capacity, as a knapsack over names.

Pure Python over :class:`NameCost` values (no JAX): the costs come from
:mod:`remat_nn.planner._measure`, the plans it proposes are compiled by
:mod:`remat_nn.planner._plan_for_budget`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remat_nn._plan import Plan

__all__ = ["Candidate", "NameCost", "solve"]

# Per name, its options as NameCost.options() gives them: (action, device bytes, seconds).
_Options = list[tuple[str, list[tuple[str, int, float]]]]


@dataclass(frozen=True)
class NameCost:
    """What one named activation costs under each action.

    Attributes:
      name: the activation name.
      nbytes: device bytes its residuals take when saved (all occurrences).
      count: how many residuals carry the name.
      recompute_seconds: time to recompute it (None: recompute not allowed).
      offload_seconds: time to move it to host and back (None: offload not allowed).
      save_seconds: time to write and read it when saved.
      weight: bytes the temp memory grows by when it is saved (None: ``nbytes``). The single-name
        compile calibrates it: at least ``nbytes``, more if saving it costs more than its bytes.
      reduction: bytes the backward pass's working set shrinks by when the name is kept (saved
        or offloaded) rather than recomputed; reductions of several kept names overlap, so a set
        of kept names takes only the largest.
      recompute_flops: the extra FLOPs behind ``recompute_seconds``.
    """

    name: str
    nbytes: int
    count: int = 1
    recompute_seconds: float | None = 0.0
    offload_seconds: float | None = None
    save_seconds: float = 0.0
    weight: int | None = None
    reduction: int = 0
    recompute_flops: int = 0

    @property
    def save_bytes(self) -> int:
        """Bytes the temp memory grows by when the name is saved (``weight``, else ``nbytes``)."""
        return self.nbytes if self.weight is None else self.weight

    @property
    def alone(self) -> int:
        """Predicted temp change (bytes) when only this name is saved."""
        return self.save_bytes - self.reduction

    def options(self, *, keep: bool = True, drop: bool = True) -> list[tuple[str, int, float]]:
        """``(action, device bytes, seconds)`` for each allowed action; ``keep`` / ``drop``
        select the actions that keep the value (save, offload) / recompute it."""
        out = []
        if drop and self.recompute_seconds is not None:
            out.append(("recompute", 0, self.recompute_seconds))
        if keep:
            out.append(("save", self.save_bytes, self.save_seconds))
            if self.offload_seconds is not None:
                out.append(("offload", 0, self.offload_seconds))
        return out


@dataclass(frozen=True)
class Candidate:
    """One point of the Pareto front: predicted temp bytes above the all-recompute floor (may be
    negative) and the time paid, with the action per name."""

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


def _sweep(options: _Options, base: int, max_states: int) -> list[Candidate] | None:
    # Exact Pareto sweep over each name's options; None when the front outgrows max_states.
    front = [Candidate(base, 0.0, ())]
    for name, opts in options:
        extended = [
            Candidate(p.nbytes + b, p.seconds + t, (*p.actions, (name, a)))
            for p in front
            for a, b, t in opts
        ]
        front = _pareto(extended)
        if len(front) > max_states:
            return None
    return front


def _greedy(options: _Options, base: int) -> list[Candidate]:
    # From each name's lightest option, move names to their fastest option in order of time
    # saved per byte added (moves that save time without adding bytes first).
    choice = {n: min(opts, key=lambda o: (o[1], o[2])) for n, opts in options}
    moves = []
    for n, opts in options:
        fast = min(opts, key=lambda o: (o[2], o[1]))
        gain, extra = choice[n][2] - fast[2], fast[1] - choice[n][1]
        if gain > 0:
            moves.append((-gain / extra if extra > 0 else -float("inf"), n, fast))

    def point() -> Candidate:
        return Candidate(
            base + sum(o[1] for o in choice.values()),
            sum(o[2] for o in choice.values()),
            tuple((n, choice[n][0]) for n, _ in options),
        )

    points = [point()]
    for _, n, fast in sorted(moves):
        choice[n] = fast
        points.append(point())
    return _pareto(points)


def _predict(costs: Sequence[NameCost], the_plan: Plan) -> int:
    # Bytes above the floor that solve() predicts for a plan: saved weights minus the largest
    # reduction among the kept names.
    actions = [(c, the_plan.action(c.name)) for c in costs]
    saved = sum(c.save_bytes for c, a in actions if a == "save")
    return saved - max((max(c.reduction, 0) for c, a in actions if a != "recompute"), default=0)


def _corrected(
    costs: Sequence[NameCost], floor: int, measured: dict[Plan, int], the_plan: Plan
) -> int:
    """Temp bytes predicted for ``the_plan``: the additive model (:func:`_predict`) plus its
    error at the nearest compiled plan.

    Kept names interact in ways the single-name compiles cannot show: on the benchmark
    transformer, saving ``out_proj`` alone lowers the temp by more than its stack, but saving it
    with ``context`` and the q / k / v projections lowers it by nothing, so the additive model
    predicts too little (docs/planner.md; benchmarks/results/planner_interactions.md). A
    compiled plan measures the interaction among its names, and a plan that differs from it in
    a few small names mostly shares it; so the model's error at the compiled plan nearest to
    ``the_plan`` (least bytes of the names whose action differs; among as near ones, the one
    keeping the most of its kept names: they carry the interactions) is added to the additive
    estimate. The calibration compiles have no error.
    """
    estimate = floor + _predict(costs, the_plan)
    kept = {c.name for c in costs if the_plan.action(c.name) != "recompute"}

    def distance(other: Plan) -> tuple[int, int, int]:
        differ = [c for c in costs if other.action(c.name) != the_plan.action(c.name)]
        shared = sum(other.action(n) != "recompute" for n in kept)
        return sum(c.nbytes for c in differ), -shared, len(differ)

    if not measured:
        return estimate
    nearest = min(measured, key=distance)
    return estimate + measured[nearest] - (floor + _predict(costs, nearest))


def solve(
    costs: Sequence[NameCost], capacity: int, *, max_states: int = 20_000
) -> tuple[Candidate | None, list[Candidate], bool]:
    """Chooses an action per name: predicted bytes <= ``capacity`` at the least time.

    A set ``K`` of kept (saved or offloaded) names is predicted at ``sum(weight of saved) -
    max(reduction over K, 0)`` bytes above the floor. For each name ``t`` that could give the
    largest reduction (and for none), ``t`` is kept, names with a larger reduction are
    recomputed, and the rest is a knapsack swept exactly to its Pareto front.

    Args:
      costs: one :class:`NameCost` per name.
      capacity: bytes available above the all-recompute floor (the budget minus the floor; may
        be negative when keeping some name lowers the temp memory).
      max_states: Pareto-front size beyond which the exact sweep gives way to greedy.

    Returns:
      ``(best, front, exact)``: the cheapest feasible candidate (None if none fits), the Pareto
      front of bytes against time over every candidate considered, and whether it is exact.
    """
    groups: list[tuple[int, _Options]] = []
    for top in (None, *costs):
        r = 0 if top is None else max(top.reduction, 0)
        options = []
        for c in costs:
            opts = c.options(keep=max(c.reduction, 0) <= r, drop=c is not top)
            if not opts:
                break
            options.append((c.name, opts))
        else:
            groups.append((-r, options))
    swept = [_sweep(options, base, max_states) for base, options in groups]
    exact = all(f is not None for f in swept)
    if exact:
        fronts = [f for f in swept if f is not None]
    else:
        fronts = [_greedy(options, base) for base, options in groups]
    front = _pareto([p for f in fronts for p in f])
    feasible = [p for p in front if p.nbytes <= capacity]
    best = min(feasible, key=lambda p: (p.seconds, p.nbytes)) if feasible else None
    return best, front, exact
