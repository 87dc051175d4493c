"""What the planner reports: every plan it compiled (:class:`Tried`) and its choice
(:class:`PlanReport`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from remat_nn._memory import format_bytes
from remat_nn._peak import PeakReport
from remat_nn._plan import Plan
from remat_nn.planner._solver import Candidate, NameCost

__all__ = ["PlanReport", "Tried"]


@dataclass(frozen=True)
class Tried:
    """A plan the planner compiled: its temp bytes, modeled seconds, the memory model's
    prediction of its temp bytes made before it was compiled (None for a calibration compile,
    which the model is built from), and, if timed, its measured time relative to the chosen
    plan's (median over the rounds both ran, paired per round)."""

    plan: Plan
    temp_bytes: int
    model_seconds: float
    measured_ratio: float | None = None
    predicted_bytes: int | None = None
    variant: str | None = None

    @property
    def prediction_error(self) -> float | None:
        """``|predicted - compiled| / compiled``, or None for a calibration compile."""
        if self.predicted_bytes is None:
            return None
        return abs(self.predicted_bytes - self.temp_bytes) / max(self.temp_bytes, 1)


@dataclass(frozen=True)
class PlanReport:
    """What :func:`plan_for_budget` chose, and why.

    Attributes:
      plan: the chosen plan (the same type as a hand-written one).
      costs: per-name costs of the model.
      budget_bytes: the budget on XLA's compiled temp bytes.
      predicted_temp_bytes: the cost model's prediction for ``plan``.
      compiled_temp_bytes: XLA's temp bytes for ``plan``.
      no_remat_temp_bytes: temp bytes with no remat at all.
      min_temp_bytes: the least temp bytes of any plan compiled (a lower bound needs them all).
      floor_temp_bytes: temp bytes with every name recomputed.
      front: Pareto front (predicted bytes above the floor, seconds) over the candidates.
      exact: the solve was exact.
      tried: every plan compiled, in order (the chosen one among them).
      measured: the fastest fitting plans were timed and the fastest measured was chosen.
      notes: what the planner left out and why (e.g. offload on a CPU backend).
      compiled_host_temp_bytes: XLA's host temp bytes for ``plan`` (offloaded values on a GPU /
        TPU backend; 0 on CPU, which has one memory), not counted against the budget.
      variant: the label of the variant chosen (``plan_for_budget(variants=...)``), with
        ``plan`` as its policy; None when ``fn`` itself is.
    """

    plan: Plan
    costs: tuple[NameCost, ...]
    budget_bytes: int
    predicted_temp_bytes: int
    compiled_temp_bytes: int
    no_remat_temp_bytes: int
    min_temp_bytes: int
    floor_temp_bytes: int
    front: tuple[Candidate, ...]
    exact: bool
    tried: tuple[Tried, ...]
    measured: bool
    notes: tuple[str, ...] = ()
    compiled_host_temp_bytes: int = 0
    variant: str | None = None
    explain_peak: Callable[[], PeakReport] | None = field(default=None, compare=False, repr=False)

    def peak(self) -> PeakReport | None:
        """The buffers live at XLA's peak of the chosen plan's gradient (``rn.explain_peak``;
        compiled once more, with XLA's dump, at the first call)."""
        return self.explain_peak() if self.explain_peak is not None else None

    @property
    def prediction_error(self) -> float:
        """The largest error of the memory model over the plans it predicted before compiling
        (0 when every compile was a calibration)."""
        return max((t.prediction_error or 0.0 for t in self.tried), default=0.0)

    def __str__(self) -> str:
        how = "fastest measured of the fitting plans" if self.measured else "fastest modeled"
        lines = [
            f"plan: {self.plan}" + ("" if self.variant is None else f" (variant {self.variant})"),
            f"budget {format_bytes(self.budget_bytes)}: compiled temp "
            f"{format_bytes(self.compiled_temp_bytes)} (predicted "
            f"{format_bytes(self.predicted_temp_bytes)}); every name recomputed "
            f"{format_bytes(self.floor_temp_bytes)}, least compiled "
            f"{format_bytes(self.min_temp_bytes)}, no remat "
            f"{format_bytes(self.no_remat_temp_bytes)}; {'exact' if self.exact else 'greedy'} "
            f"solve, {len(self.tried)} plans compiled, chosen: {how}; memory model error at most "
            f"{self.prediction_error:.1%} over the plans it predicted before compiling",
            *self.notes,
            "",
            "| name | count | bytes | temp if only it is saved | recompute FLOPs | action |",
            "|---|--:|--:|--:|--:|---|",
        ]
        for c in self.costs:
            alone = self.floor_temp_bytes + c.alone
            lines.append(
                f"| {c.name} | {c.count} | {format_bytes(c.nbytes)} | {format_bytes(alone)} | "
                f"{c.recompute_flops:.3g} | {self.plan.action(c.name)} |"
            )
        lines += [
            "",
            "plans compiled (temp, predicted before compiling or 'calibration', modeled s, "
            "measured time / chosen plan's):",
        ]
        for t in self.tried:
            mark = "*" if t.plan == self.plan else " "
            secs = "" if t.measured_ratio is None else f"  {t.measured_ratio:.3f}x"
            pred = (
                "calibration"
                if t.predicted_bytes is None
                else f"{format_bytes(t.predicted_bytes)} ({t.prediction_error:.1%})"
            )
            form = "" if t.variant is None else f"variant {t.variant}: "
            mark = "*" if t.plan == self.plan and t.variant == self.variant else " "
            lines.append(
                f" {mark}{format_bytes(t.temp_bytes):>12}  {pred:>22}  {t.model_seconds:.3g} s"
                f"{secs}  {form}{_short(t.plan)}"
            )
        lines += ["", "Pareto front (predicted temp against the floor -> modeled seconds):"]
        lines += [f"  {_against_floor(p.nbytes):>18}  {p.seconds:.3g} s" for p in self.front]
        return "\n".join(lines + self._peak_lines())

    def _peak_lines(self) -> list[str]:
        # The buffers at the peak, or why they are missing: printing the report never fails
        # because the explainer did (the totals above stand without it).
        try:
            peak = self.peak()
        except Exception as e:
            return [
                "",
                f"(no buffers at the chosen plan's peak: rn.explain_peak failed: "
                f"{type(e).__name__}: {e})",
            ]
        if peak is None:
            return []
        return [
            "",
            f"largest temp buffers at the chosen plan's peak (rn.explain_peak; peak "
            f"{format_bytes(peak.peak_bytes)}, schedule index {peak.peak_index}):",
            peak.top(8, temp_only=True),
        ]


def _against_floor(nbytes: int) -> str:
    # Saving a name can lower XLA's temp below recomputing everything (the floor): say so
    # rather than print a negative size "above" it.
    side = "above" if nbytes >= 0 else "below"
    return f"{format_bytes(abs(nbytes))} {side}"


def _short(the_plan: Plan) -> str:
    # "save [a, b] offload [c]": the kept names (every other name is recomputed).
    moved = f" offload [{', '.join(the_plan.offload)}]" if the_plan.offload else ""
    return f"save [{', '.join(the_plan.save)}]{moved}"
