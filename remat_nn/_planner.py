"""Memory-budget planner: pick save / offload / recompute per named activation under a budget.

The cost model comes from the function itself, measured by compiling it:
  - bytes a name keeps when saved: its residuals under a plan that saves every name
    (:func:`remat_nn.memory_report`; a scan's stack counts every layer);
  - what saving it does to XLA's temp bytes: one compile per name that saves only that name.
    Saved stacks add up, but saving a name also shrinks the working set of the backward pass's
    recomputation, and those shrinkages overlap (the peak is a max, not a sum). So a set ``S`` of
    kept names is predicted at ``floor + sum(stack[n] for n in S) - max(reduction[n] for n in S)``,
    where ``floor`` is the temp with every name recomputed and ``reduction[n]`` comes from the
    single-name compile. (On the transformer benchmark, saving only ``mlp_in`` compiles 31 MiB
    *below* recomputing everything: a model that is affine in saved bytes cannot see that.)
  - time: recomputing a name costs its extra FLOPs (gradient FLOPs with every name but this one
    saved, minus with every name saved; from the jaxpr) at ``flops_per_second``; saving it costs
    writing and reading its bytes at ``memory_bandwidth``; offloading costs ``2 * bytes /
    host_bandwidth``.
The budget bounds device bytes (XLA's ``temp_size_in_bytes``); XLA counts an offloaded value's
host bytes apart (``host_temp_size_in_bytes``, in ``PlanReport.compiled_host_temp_bytes``). A CPU
backend has one memory: no host bytes, and offload is left out.
For each candidate largest reduction the rest is a knapsack over names (device bytes against
time), solved exactly by a Pareto sweep for small problems and greedily beyond: its Pareto front
is the set of candidates. Saving names together interacts in ways no single-name compile shows,
so the additive prediction is corrected by its error at the nearest compiled plan (fewest bytes
of names acting differently, then most kept names shared): a compiled plan measures the
interactions of its names. The fastest candidate whose corrected prediction fits is compiled,
again until one fits, and the next fastest predicted to fit are compiled too; each compile
records the prediction made before it (``Tried.predicted_bytes``, ``PlanReport.
prediction_error``). Every compiled plan that fits stays a candidate. With concrete arguments,
the fastest-modeled few are then raced (shuffled rounds, clearly slower ones dropping out) and
the fastest measured wins: on XLA:CPU, saving cheap-to-recompute activations can cost more time
than recomputing them, which no FLOP count shows, and the candidates differ by less than one
step's timing noise.

References:
  Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost.
  Jain et al. 2020, Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization.
  PyTorch ``torch._functorch.config.activation_memory_budget`` (a knapsack over recomputation).
"""

from __future__ import annotations

import functools
import operator
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from remat_nn._flops import jaxpr_flops
from remat_nn._jax_internals import core
from remat_nn._memory import format_bytes, memory_report
from remat_nn._peak import PeakReport, explain_later
from remat_nn._plan import Plan, names_in_jaxpr
from remat_nn._timing import timing_rounds
from remat_nn.errors import PlanError

__all__ = [
    "Candidate",
    "NameCost",
    "PlanReport",
    "Tried",
    "parse_budget",
    "plan_for_budget",
    "solve",
]

_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}
_ACTIONS = ("save", "offload", "recompute")
# Per name, its options as NameCost.options() gives them: (action, device bytes, seconds).
_Options = list[tuple[str, list[tuple[str, int, float]]]]


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
    transformer, saving ``out_proj`` alone lowers the temp by 24 MiB more than its stack, but
    saving it with ``context`` and the q / k / v projections lowers it by nothing (140.20 MiB
    compiled, 116.17 MiB by the additive model). A compiled plan measures the interaction among
    its names, and a plan that differs from it in a few small names mostly shares it; so the
    model's error at the compiled plan nearest to ``the_plan`` (least bytes of the names whose
    action differs; among as near ones, the one keeping the most of its kept names: they carry
    the interactions) is added to the additive estimate. The calibration compiles have no error.
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


# --- measuring a function ---------------------------------------------------------------------


@functools.cache
def _measured_rates() -> tuple[float, float]:
    # (FLOP/s of a dense float32 matmul, bytes/s of an elementwise pass over 32 MiB) on the
    # default device: the least of 15 times after warm-up (a shared machine only ever slows a
    # run down, and a median of a few let one slow spell reshape the whole cost model).
    def least_seconds(f, x):  # noqa: ANN001, ANN202
        f(x).block_until_ready()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    a = jnp.ones((512, 512), jnp.float32)
    v = jnp.ones((8 * 2**20,), jnp.float32)  # 32 MiB, read once and written once
    flops = 2 * 512**3 / least_seconds(jax.jit(lambda x: x @ x), a)
    return flops, 2 * v.nbytes / least_seconds(jax.jit(lambda x: x * 2 + 1), v)


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
        lines += ["", "Pareto front (predicted bytes above the floor -> modeled seconds):"]
        lines += [f"  {format_bytes(p.nbytes):>12}  {p.seconds:.3g} s" for p in self.front]
        if (peak := self.peak()) is not None:
            lines += [
                "",
                f"largest temp buffers at the chosen plan's peak (rn.explain_peak; peak "
                f"{format_bytes(peak.peak_bytes)}, schedule index {peak.peak_index}):",
                peak.top(8, temp_only=True),
            ]
        return "\n".join(lines)


def _short(the_plan: Plan) -> str:
    # "save [a, b] offload [c]": the kept names (every other name is recomputed).
    moved = f" offload [{', '.join(the_plan.offload)}]" if the_plan.offload else ""
    return f"save [{', '.join(the_plan.save)}]{moved}"


def _grad_flops(fn: Callable[..., Any], args: Sequence[Any], the_plan: Plan) -> int:
    loss = functools.partial(fn, policy=the_plan)
    return jaxpr_flops(jax.make_jaxpr(jax.grad(loss))(*args).jaxpr)


def _compile(fn: Callable[..., Any], args: Sequence[Any], policy: Any) -> Any:
    return jax.jit(jax.grad(functools.partial(fn, policy=policy))).lower(*args).compile()


def _temp(compiled: Any) -> int:
    # Device bytes: what the budget bounds (an offloaded value's host bytes are counted apart).
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _host_temp(compiled: Any) -> int:
    return int(getattr(compiled.memory_analysis(), "host_temp_size_in_bytes", 0))


def _is_concrete(args: Sequence[Any]) -> bool:
    leaves = jax.tree.leaves(args)
    return all(isinstance(x, jax.Array) and not isinstance(x, core.Tracer) for x in leaves)


def _time(
    executables: dict[Any, Any],
    args: Sequence[Any],
    rounds: int,
    *,
    min_rounds: int = 5,
    margin: float = 0.02,
) -> tuple[dict[Any, float], int]:
    """Races ``executables`` on ``args``; returns each one's time relative to the winner's, and
    the number of rounds run.

    Single step times on a shared machine vary by 30%, and close plans differ by a few percent, so
    every round runs each remaining candidate once, in a fresh random order (no candidate always
    runs first), and candidates are compared within a round (a slow spell spanning the round
    cancels). From ``min_rounds`` on, a candidate is dropped once it is slower than the leader in
    3 of 4 rounds and by more than ``margin`` in median; the race ends when one is left or after
    ``rounds`` rounds. The leader has the least median over rounds of its time over the round's
    fastest; a ratio is the median over the rounds both ran of a candidate's time over the
    winner's.
    """
    times: dict[Any, list[float]] = {}
    ran = 0
    alive = list(executables)

    def leader(alive: list[Any]) -> Any:
        best = [min(times[k][i] for k in alive) for i in range(ran)]
        return min(alive, key=lambda k: statistics.median(map(operator.truediv, times[k], best)))

    def ratio(k: Any, ref: Any) -> float:  # over the rounds both ran (k may have dropped out)
        return statistics.median(map(operator.truediv, times[k], times[ref]))

    def clearly_slower(k: Any, lead: Any) -> bool:
        slower = sum(map(operator.gt, times[k], times[lead]))
        return ratio(k, lead) > 1 + margin and slower >= 0.75 * ran

    def keep(samples: dict[Any, list[float]], running: list[Any], rounds_run: int) -> list[Any]:
        nonlocal times, ran, alive
        times, ran = samples, rounds_run
        if ran >= min_rounds:
            lead = leader(running)
            running = [k for k in running if not clearly_slower(k, lead)]
        alive = running
        return alive

    fns = {k: functools.partial(ex, *args) for k, ex in executables.items()}
    # The clock is looked up here, per call, so that a test can replace this module's `time`.
    times, ran = timing_rounds(fns, rounds=rounds, keep=keep, clock=lambda: time.perf_counter())
    lead = leader(alive) if ran else alive[0]
    return {k: ratio(k, lead) if times[k] else 1.0 for k in executables}, ran


def _variants(
    variants: Mapping[str, tuple[Callable[..., Any], Sequence[Any]]],
    the_plan: Plan,
    budget_bytes: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    flops_rate: float,
    plan_seconds: float,
    say: Callable[[str], None],
) -> tuple[tuple[str, Plan] | None, list[Tried]]:
    """Compiles each variant under ``the_plan``; the fastest modeled one that fits, and all.

    A variant's modeled time is the plan's, plus its extra gradient FLOPs over ``fn``'s (the
    forward passes nesting repeats, a reversible backward's reconstruction) at ``flops_rate``.
    """
    base = _grad_flops(fn, args, the_plan)
    tried = []
    for label, (variant_fn, variant_args) in variants.items():
        t0 = time.perf_counter()
        temp = _temp(_compile(variant_fn, variant_args, the_plan))
        extra = max(0, _grad_flops(variant_fn, variant_args, the_plan) - base)
        tried.append(Tried(the_plan, temp, plan_seconds + extra / flops_rate, variant=label))
        say(
            f"  compiled variant {label} with {_short(the_plan)}: temp {format_bytes(temp)} "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    fitting = [t for t in tried if t.temp_bytes <= budget_bytes]
    if not fitting:
        return None, tried
    best = min(fitting, key=lambda t: (t.model_seconds, t.temp_bytes))
    return (str(best.variant), the_plan), tried


_INVERT = (
    "plan_for_budget: 'invert' is not a per-name choice the planner can make for a fixed model: "
    "reconstructing a value from a block's output needs the block itself to be invertible "
    "(additive couplings, rn.invertible), which changes the model. Fix: drop 'invert' from "
    "`allow`, and build the reversible variant (nn.ReversibleSequence, the transformer's "
    "reversible=true) to compare it with rn.compare_policies."
)


def plan_for_budget(
    fn: Callable[..., Any],
    *args: Any,
    budget: str | int | float,
    allow: Sequence[str] = ("save", "offload", "recompute"),
    host_bandwidth: float = 16e9,
    flops_per_second: float | None = None,
    memory_bandwidth: float | None = None,
    measure: bool | None = None,
    shortlist: int = 6,
    rounds: int = 15,
    max_attempts: int = 6,
    log: Callable[[str], None] | None = None,
    variants: Mapping[str, tuple[Callable[..., Any], Sequence[Any]]] | None = None,
) -> PlanReport:
    """Finds the fastest plan whose compiled temp memory fits ``budget``.

    Args:
      fn: ``fn(*args, policy=p)`` returns a scalar loss and applies ``p`` where it remats; ``p``
        is a :class:`remat_nn.Plan` or ``"none"`` (no remat), both of which ``nn.remat``,
        ``rn.checkpoint`` and ``rn.policy`` accept, and a model can take as its plan. Its
        activations are tagged with ``rn.name``.
      *args: the arguments of ``fn``; the gradient is taken with respect to the first. Arrays,
        or ``jax.ShapeDtypeStruct`` to plan without running anything.
      budget: bound on XLA's (device) temp bytes of ``jax.grad(fn)``: ``"2GiB"``, bytes, or a
        fraction of the no-remat temp memory (``0.5``). Host bytes of offloaded values are
        counted apart, not against it.
      allow: actions the planner may use among ``save``, ``offload``, ``recompute``. On a CPU
        backend offload is left out: there is one memory, so an offloaded value stays put.
      host_bandwidth: bytes per second to host and back, for offload (CPU cannot measure it).
      flops_per_second: recompute speed; measured with a dense matmul when None.
      memory_bandwidth: bytes per second to write and read a saved value; measured with an
        elementwise pass when None.
      measure: time the ``shortlist`` fastest-modeled plans that fit (every compiled plan that
        fits counts, the single-name calibration compiles too) and choose the fastest measured;
        None: when every argument is a concrete array.
      shortlist: how many plans to time, and how many fitting plans to compile from the front.
      rounds: most timing rounds; each runs every candidate still in the race once, and
        candidates clearly slower than the leader drop out from the fifth round on.
      max_attempts: candidates compiled until one fits, before settling for the compiled plans
        (each compile corrects the memory model's predictions of the next).
      log: called with a line per compile / timing (progress), e.g. ``print``.
      variants: other forms of the same model to fall back on when no plan of ``fn`` fits:
        label -> ``(variant_fn, variant_args)``, called as ``fn`` is (``policy=`` a plan):
        e.g. a nested :func:`remat_nn.remat_scan` (``levels``, ``carry_policy``), a split of
        the layers, or the reversible form with its own parameters. They cost extra passes
        (a forward per nesting level, reconstruction), so each is compiled once, under the
        least-memory plan of ``fn`` compiled, only when no plan of ``fn`` fits; the fastest
        that fits (by grad FLOPs at ``flops_per_second``) is chosen.

    Returns:
      A :class:`PlanReport`; ``report.plan`` is the plan, ``report.variant`` the variant's
      label when one was chosen (None: ``fn`` itself).

    Raises:
      PlanError: no named activation in ``fn``, an unknown action (or ``invert``), or a budget
        below the least temp memory of every plan compiled (the message states it).

    >>> import jax, remat_nn as rn
    >>> from remat_nn import _demo
    >>> params = _demo.init(jax.random.key(0), depth=4, width=16, hidden=64)
    >>> x = jax.numpy.ones((8, 16))
    >>> report = rn.plan_for_budget(_demo.loss, params, x, budget=0.6, flops_per_second=1e9,
    ...                             memory_bandwidth=1e9)
    >>> report.compiled_temp_bytes <= report.budget_bytes
    True
    """
    if "invert" in allow:
        raise PlanError(_INVERT)
    bad = [a for a in allow if a not in _ACTIONS]
    if bad or "save" not in allow:
        raise PlanError(
            f"plan_for_budget: `allow` must include 'save' and only {_ACTIONS}, got {tuple(allow)}."
        )
    say = log or (lambda _: None)
    notes = []
    if "offload" in allow and jax.default_backend() == "cpu":
        allow = tuple(a for a in allow if a != "offload")
        notes.append("offload left out: the cpu backend has one memory, an offloaded value stays.")
    probe = functools.partial(fn, policy=Plan())  # recompute everything: just to find the names
    found = sorted(set(names_in_jaxpr(jax.make_jaxpr(probe)(*args).jaxpr)))
    if not found:
        raise PlanError(
            "plan_for_budget: `fn` tags no activation with rn.name, so there is nothing to plan. "
            "Fix: tag the activations (rn.name(x, 'mlp_hidden')) inside the remat'd body."
        )

    def plan_of(actions: dict[str, str]) -> Plan:
        def names(action: str) -> tuple[str, ...]:
            return tuple(n for n in found if actions.get(n, "recompute") == action)

        return Plan(save=names("save"), offload=names("offload"), recompute=names("recompute"))

    compiled: dict[Plan, Any] = {}
    temps: dict[Plan, int] = {}  # each compiled plan's temp bytes, read once

    def compile_plan(the_plan: Plan) -> int:
        if the_plan not in compiled:
            t0 = time.perf_counter()
            compiled[the_plan] = _compile(fn, args, the_plan)
            temps[the_plan] = _temp(compiled[the_plan])
            say(
                f"  compiled {_short(the_plan)}: temp {format_bytes(temps[the_plan])} "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        return temps[the_plan]

    # --- calibration: no remat, every name recomputed, each name saved alone ---
    say(f"planning {len(found)} names: {', '.join(found)}")
    no_remat = _temp(_compile(fn, args, "none"))
    budget_bytes = parse_budget(budget, reference_bytes=no_remat)
    floor = compile_plan(plan_of({}))
    save_all = plan_of(dict.fromkeys(found, "save"))
    by_name = memory_report(functools.partial(fn, policy=save_all), *args).by_name()
    # A name that is no residual even when every name is saved changes nothing: no compile.
    alone = {n: compile_plan(plan_of({n: "save"})) if n in by_name else floor for n in found}
    least_plan = min(temps, key=temps.__getitem__)
    least = temps[least_plan]
    if budget_bytes < least and "recompute" in allow and not variants:
        raise PlanError(
            f"plan_for_budget: budget {format_bytes(budget_bytes)} is below the least temp "
            f"memory of any plan compiled, {format_bytes(least)} ({least} B, "
            f"{_short(least_plan)}; every name recomputed: {format_bytes(floor)}, no remat: "
            f"{format_bytes(no_remat)}). Fix: "
            f"raise the budget to at least {least} B, or reduce the batch."
        )

    # --- cost model ---
    if flops_per_second is None or memory_bandwidth is None:  # measure what is not given
        measured_flops, measured_bandwidth = _measured_rates()
        flops_rate = flops_per_second or measured_flops
        mem_rate = memory_bandwidth or measured_bandwidth
        source = "measured"
    else:
        flops_rate, mem_rate, source = flops_per_second, memory_bandwidth, "given"
    say(
        f"  recompute at {flops_rate / 1e9:.3g} GFLOP/s, saved bytes at {mem_rate / 1e9:.3g} GB/s"
        f" ({source})"
    )
    base_flops = _grad_flops(fn, args, save_all)
    costs = []
    for n in found:
        nbytes = by_name.get(n, {}).get("bytes", 0)
        delta = alone[n] - floor  # what saving n alone does to the temp bytes
        but_n = plan_of(dict.fromkeys(found, "save") | {n: "recompute"})
        extra = max(0, _grad_flops(fn, args, but_n) - base_flops)
        costs.append(
            NameCost(
                name=n,
                nbytes=nbytes,
                count=by_name.get(n, {}).get("count", 0),
                recompute_seconds=extra / flops_rate if "recompute" in allow else None,
                offload_seconds=2 * nbytes / host_bandwidth if "offload" in allow else None,
                save_seconds=2 * nbytes / mem_rate,
                weight=max(nbytes, delta),
                reduction=max(0, nbytes - delta),
                recompute_flops=extra,
            )
        )

    def seconds(the_plan: Plan) -> float:
        # Modeled time of a plan: each name's time under the plan's action for it.
        return sum(
            {a: t for a, _, t in c.options()}.get(the_plan.action(c.name), 0.0) for c in costs
        )

    def allowed(the_plan: Plan) -> bool:
        return all(the_plan.action(n) in allow for n in found)

    # --- solve, then compile the fastest candidate the corrected model fits, until one fits ---
    # The knapsack proposes (its Pareto front over the additive model); the model corrected by
    # the compiles so far (_corrected) decides what to compile, and learns from each compile.
    predicted: dict[Plan, int] = {}  # the prediction made before compiling, per searched plan

    def corrected(the_plan: Plan) -> int:
        return _corrected(costs, floor, temps, the_plan)

    def search(the_plan: Plan) -> int:
        predicted[the_plan] = corrected(the_plan)
        return compile_plan(the_plan)

    _, front, exact = solve(costs, budget_bytes - floor)
    by_time = [plan_of(dict(p.actions)) for p in sorted(front, key=lambda p: p.seconds)]

    def next_fitting() -> Plan | None:
        return next(
            (p for p in by_time if p not in compiled and corrected(p) <= budget_bytes), None
        )

    for _ in range(max_attempts):
        if (the_plan := next_fitting()) is None or search(the_plan) <= budget_bytes:
            break
    # The next fastest candidates predicted to fit, so that the choice is not the model's alone.
    for _ in range(max(shortlist - 1, 0)):
        if (the_plan := next_fitting()) is None:
            break
        search(the_plan)

    # --- choose among the compiled plans that fit ---
    if not any(allowed(p) for p in compiled):  # e.g. recompute not allowed and nothing solved
        compile_plan(save_all)
    fits = sorted(
        (p for p in compiled if allowed(p) and temps[p] <= budget_bytes),
        key=lambda p: (seconds(p), temps[p]),
    )
    chosen_variant: tuple[str, Plan] | None = None
    variant_tried: list[Tried] = []
    if not fits and variants:
        chosen_variant, variant_tried = _variants(
            variants, least_plan, budget_bytes, fn, args, flops_rate, seconds(least_plan), say
        )
        if chosen_variant is None:
            least = min([least] + [t.temp_bytes for t in variant_tried])
            raise PlanError(
                f"plan_for_budget: budget {format_bytes(budget_bytes)} is below the least temp "
                f"memory of any plan compiled, {format_bytes(least)} ({least} B), variants "
                f"{', '.join(variants)} included. Fix: raise the budget to at least {least} B, "
                "or reduce the batch."
            )
    if chosen_variant is not None:
        label, the_plan = chosen_variant
        chosen_tried = next(t for t in variant_tried if t.variant == label)
        tried = tuple(
            Tried(p, temps[p], seconds(p), None, predicted.get(p)) for p in compiled
        ) + tuple(variant_tried)
        return PlanReport(
            plan=the_plan,
            costs=tuple(costs),
            budget_bytes=budget_bytes,
            predicted_temp_bytes=chosen_tried.temp_bytes,
            compiled_temp_bytes=chosen_tried.temp_bytes,
            no_remat_temp_bytes=no_remat,
            min_temp_bytes=min(least, *(t.temp_bytes for t in variant_tried)),
            floor_temp_bytes=floor,
            front=tuple(front),
            exact=exact,
            tried=tried,
            measured=False,
            notes=(
                *notes,
                f"no plan of fn fits: variant {label!r} chosen (fastest modeled that fits).",
            ),
            variant=label,
            explain_peak=_explainer(*(variants or {})[label], the_plan),
        )
    if not fits:
        least = min(temps[p] for p in compiled if allowed(p))
        raise PlanError(
            f"plan_for_budget: no plan with actions {tuple(allow)} fits "
            f"{format_bytes(budget_bytes)}; the least compiled is {format_bytes(least)} "
            f"({least} B). Fix: raise the budget, or allow more actions."
        )
    measure = _is_concrete(args) if measure is None else measure
    timed: dict[Plan, float] = {}
    if measure and len(fits) > 1 and shortlist > 1:
        say(f"  timing the {min(shortlist, len(fits))} fastest-modeled plans that fit")
        t0 = time.perf_counter()
        timed, ran = _time({p: compiled[p] for p in fits[:shortlist]}, args, rounds=rounds)
        fits = sorted(timed, key=timed.__getitem__)
        say(
            f"  timed in {ran} rounds ({time.perf_counter() - t0:.0f} s): "
            + ", ".join(f"{_short(p)} {timed[p]:.3f}x" for p in fits)
        )
    chosen = fits[0]
    tried = tuple(Tried(p, temps[p], seconds(p), timed.get(p), predicted.get(p)) for p in compiled)
    return PlanReport(
        plan=chosen,
        costs=tuple(costs),
        budget_bytes=budget_bytes,
        predicted_temp_bytes=predicted.get(chosen, floor + _predict(costs, chosen)),
        compiled_temp_bytes=temps[chosen],
        compiled_host_temp_bytes=_host_temp(compiled[chosen]),
        no_remat_temp_bytes=no_remat,
        min_temp_bytes=least,
        floor_temp_bytes=floor,
        front=tuple(front),
        exact=exact,
        tried=tried,
        measured=bool(timed),
        notes=tuple(notes),
        explain_peak=_explainer(fn, args, chosen),
    )


def _explainer(fn: Callable[..., Any], args: Sequence[Any], chosen: Plan) -> Callable[[], Any]:
    # The gradient _compile compiles, explained once, on first use (arrays held as shapes).
    grad = jax.grad(functools.partial(fn, policy=chosen))
    return functools.cache(explain_later(grad, args, {}, None))
