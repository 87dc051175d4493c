"""``plan_for_budget``: named phases over one planning session (see :mod:`remat_nn.planner`).

Calibrate (compile no remat, every name recomputed, each name saved alone), build the cost
model, search the solver's Pareto front compiling candidates until one fits, then choose among
the compiled plans that fit (timed when the arguments are concrete), or fall back on a variant.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from remat_nn._memory import format_bytes, memory_report
from remat_nn._peak import explain_later
from remat_nn._plan import ACTIONS, Plan, names_in_jaxpr
from remat_nn._policies import check_takes_policy
from remat_nn.errors import PlanError
from remat_nn.planner import _measure
from remat_nn.planner._budget import parse_budget
from remat_nn.planner._report import PlanReport, Tried, _short
from remat_nn.planner._solver import Candidate, NameCost, _corrected, _predict, solve

__all__ = ["check_allow", "plan_for_budget"]


_INVERT = (
    "plan_for_budget: 'invert' is not a per-name choice the planner can make for a fixed model: "
    "reconstructing a value from a block's output needs the block itself to be invertible "
    "(additive couplings, rn.invertible), which changes the model. Fix: drop 'invert' from "
    "`allow`, and build the reversible variant (nn.ReversibleSequence, the transformer's "
    "reversible=true) to compare it with rn.compare_policies."
)
Variants = Mapping[str, tuple[Callable[..., Any], Sequence[Any]]]


def plan_for_budget(
    fn: Callable[..., Any],
    *args: Any,
    budget: str | int | float,
    allow: Sequence[str] = ACTIONS,
    host_bandwidth: float = 16e9,
    flops_per_second: float | None = None,
    memory_bandwidth: float | None = None,
    measure: bool | None = None,
    shortlist: int = 6,
    rounds: int = 15,
    max_attempts: int = 6,
    log: Callable[[str], None] | None = None,
    variants: Variants | None = None,
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
    _refuse_tracers(args)
    check_takes_policy(fn, "plan_for_budget")
    allow, notes = _allowed_actions(allow)
    s = _Session(fn, args, _tagged_names(fn, args), allow, log or (lambda _: None))
    by_name, alone = _calibrate(s, budget, variants)
    flops_rate = _cost_model(s, by_name, alone, flops_per_second, memory_bandwidth, host_bandwidth)
    _search(s, max_attempts=max_attempts, shortlist=shortlist)
    fits = _fitting(s)
    if not fits and variants:
        return _variant_report(s, variants, flops_rate, notes)
    if not fits:
        least = min(s.temps[p] for p in s.compiled if s.allowed(p))
        raise PlanError(
            f"plan_for_budget: no plan with actions {tuple(s.allow)} fits "
            f"{format_bytes(s.budget_bytes)}; the least compiled is {format_bytes(least)} "
            f"({least} B). Fix: raise the budget, or allow more actions."
        )
    measure = _measure._is_concrete(args) if measure is None else measure
    fits, timed = _race(s, fits, measure=measure, shortlist=shortlist, rounds=rounds)
    return _report(s, fits[0], timed, notes)


def _refuse_tracers(args: Sequence[Any]) -> None:
    # Under jit (or grad, vmap) the arguments are tracers: nothing can be compiled or timed.
    if traced := _measure._tracers(args):
        raise TypeError(
            f"plan_for_budget: an argument is a tracer ({type(traced[0]).__name__}): it was "
            "called inside jax.jit, grad or vmap, but it compiles and times the gradient itself, "
            "so it needs concrete arrays or jax.ShapeDtypeStruct. Fix: call it outside the "
            "transformation, once, and pass report.plan (a value) into the jitted function."
        )


@dataclass
class _Session:
    """What one :func:`plan_for_budget` call builds up and its phases share: the function, the
    names it tags, every plan compiled so far, and the cost model once it is built."""

    fn: Callable[..., Any]
    args: Sequence[Any]
    found: list[str]  # the names fn tags, sorted
    allow: tuple[str, ...]
    say: Callable[[str], None]
    compiled: dict[Plan, Any] = field(default_factory=dict)
    temps: dict[Plan, int] = field(default_factory=dict)  # each compiled plan's temp, read once
    # The prediction made before compiling, per searched plan.
    predicted: dict[Plan, int] = field(default_factory=dict)
    costs: list[NameCost] = field(default_factory=list)
    no_remat: int = 0  # temp bytes without remat
    budget_bytes: int = 0
    floor: int = 0  # temp bytes with every name recomputed
    least_plan: Plan = field(default_factory=Plan)  # least temp among the calibration compiles
    least: int = 0
    front: list[Candidate] = field(default_factory=list)
    exact: bool = True

    def plan_of(self, actions: dict[str, str]) -> Plan:
        """The plan taking ``actions[name]`` for each name (recompute for a name not given)."""

        def names(action: str) -> tuple[str, ...]:
            return tuple(n for n in self.found if actions.get(n, "recompute") == action)

        return Plan(save=names("save"), offload=names("offload"), recompute=names("recompute"))

    @property
    def save_all(self) -> Plan:
        return self.plan_of(dict.fromkeys(self.found, "save"))

    def compile(self, the_plan: Plan) -> int:
        """Temp bytes of ``the_plan``, compiled on first use."""
        if the_plan not in self.compiled:
            t0 = time.perf_counter()
            self.compiled[the_plan] = _measure._compile(self.fn, self.args, the_plan)
            self.temps[the_plan] = _measure._temp(self.compiled[the_plan])
            self.say(
                f"  compiled {_short(the_plan)}: temp {format_bytes(self.temps[the_plan])} "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        return self.temps[the_plan]

    def corrected(self, the_plan: Plan) -> int:
        """Temp bytes the model predicts for ``the_plan``, corrected by the compiles so far."""
        return _corrected(self.costs, self.floor, self.temps, the_plan)

    def search(self, the_plan: Plan) -> int:
        """Compiles ``the_plan``, recording the prediction made before."""
        self.predicted[the_plan] = self.corrected(the_plan)
        return self.compile(the_plan)

    def seconds(self, the_plan: Plan) -> float:
        """Modeled time of a plan: each name's time under the plan's action for it."""
        return sum(
            {a: t for a, _, t in c.options()}.get(the_plan.action(c.name), 0.0) for c in self.costs
        )

    def allowed(self, the_plan: Plan) -> bool:
        return all(the_plan.action(n) in self.allow for n in self.found)

    def tried(self, timed: Mapping[Plan, float]) -> tuple[Tried, ...]:
        """Every plan of ``fn`` compiled, in order."""
        return tuple(
            Tried(p, self.temps[p], self.seconds(p), timed.get(p), self.predicted.get(p))
            for p in self.compiled
        )


def check_allow(allow: Any) -> tuple[str, ...]:
    """``allow``, the actions a plan may use, checked: a list or tuple holding ``'save'`` and
    any of ``'offload'``, ``'recompute'`` (:data:`remat_nn._plan.ACTIONS`). The one check of it,
    the planner's and the trainer's (``remat.allow``).

    Raises:
      PlanError: naming the value and the fix (``'invert'``: the reversible model instead).

    >>> from remat_nn.planner import check_allow
    >>> check_allow(["save", "recompute"])
    ('save', 'recompute')
    """
    if isinstance(allow, list | tuple) and "invert" in allow:
        raise PlanError(_INVERT)
    if not isinstance(allow, list | tuple) or "save" not in allow or not set(allow) <= set(ACTIONS):
        raise PlanError(
            f"plan_for_budget: `allow` must list 'save' and any of 'offload', 'recompute', got "
            f"{allow!r}. Fix: e.g. allow=['save', 'recompute'] (offload too where a device has "
            "host memory)."
        )
    return tuple(allow)


def _allowed_actions(allow: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    # The actions to plan with, and a note per action left out.
    allow = check_allow(allow)
    notes = []
    if "offload" in allow and jax.default_backend() == "cpu":
        allow = tuple(a for a in allow if a != "offload")
        notes.append("offload left out: the cpu backend has one memory, an offloaded value stays.")
    return tuple(allow), notes


def _tagged_names(fn: Callable[..., Any], args: Sequence[Any]) -> list[str]:
    probe = functools.partial(fn, policy=Plan())  # recompute everything: just to find the names
    found = sorted(set(names_in_jaxpr(jax.make_jaxpr(probe)(*args).jaxpr)))
    if not found:
        raise PlanError(
            "plan_for_budget: `fn` tags no activation with rn.name, so there is nothing to plan. "
            "Fix: tag the activations (rn.name(x, 'mlp_hidden')) inside the remat'd body."
        )
    return found


def _calibrate(
    s: _Session, budget: str | int | float, variants: Variants | None
) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Compiles no remat, every name recomputed and each name saved alone; returns each name's
    saved residuals (bytes, count) and the temp bytes with only it saved."""
    s.say(f"planning {len(s.found)} names: {', '.join(s.found)}")
    s.no_remat = _measure._temp(_measure._compile(s.fn, s.args, "none"))
    s.budget_bytes = parse_budget(budget, reference_bytes=s.no_remat)
    s.floor = s.compile(s.plan_of({}))
    by_name = memory_report(functools.partial(s.fn, policy=s.save_all), *s.args).by_name()
    # A name that is no residual even when every name is saved changes nothing: no compile.
    alone = {n: s.compile(s.plan_of({n: "save"})) if n in by_name else s.floor for n in s.found}
    s.least_plan = min(s.temps, key=s.temps.__getitem__)
    s.least = s.temps[s.least_plan]
    if s.budget_bytes < s.least and "recompute" in s.allow and not variants:
        raise PlanError(
            f"plan_for_budget: budget {format_bytes(s.budget_bytes)} is below the least temp "
            f"memory of any plan compiled, {format_bytes(s.least)} ({s.least} B, "
            f"{_short(s.least_plan)}; every name recomputed: {format_bytes(s.floor)}, no remat: "
            f"{format_bytes(s.no_remat)}). Fix: "
            f"raise the budget to at least {s.least} B, or reduce the batch.{_unordered_hint(s)}"
        )
    return by_name, alone


#: Recomputing every name saves less than this fraction of no remat's temp memory: remat is not
#: taking effect (the hint below says the usual reason).
_NO_SAVING = 0.05


def _unordered_hint(s: _Session) -> str:
    """Where recomputing every name saves (almost) nothing, the usual reason and its fix."""
    if s.no_remat <= 0 or s.floor < (1 - _NO_SAVING) * s.no_remat:
        return ""
    return (
        f" Recomputing every name holds {format_bytes(s.floor)} against no remat's "
        f"{format_bytes(s.no_remat)}: remat is not taking effect. The usual reason: remat'd "
        "blocks in an unrolled Python loop, whose recomputations XLA:CPU (whatever prevent_cse "
        "says) runs as soon as their inputs exist, at the start of the backward pass. Fix: "
        "scan the blocks (rn.remat_scan, rnn.remat_scan, rnnx.remat_scan, or flax's scan over "
        "the remat'd block), or call each through rnn.tied_remat / rnnx.tied_remat, which orders "
        "its recomputation after the incoming cotangent."
    )


def _rates(
    s: _Session, flops_per_second: float | None, memory_bandwidth: float | None
) -> tuple[float, float]:
    # (FLOP/s, bytes/s): measured where not given.
    if flops_per_second is None or memory_bandwidth is None:
        measured_flops, measured_bandwidth = _measure._measured_rates()
        flops_rate = flops_per_second or measured_flops
        mem_rate = memory_bandwidth or measured_bandwidth
        source = "measured"
    else:
        flops_rate, mem_rate, source = flops_per_second, memory_bandwidth, "given"
    s.say(
        f"  recompute at {flops_rate / 1e9:.3g} GFLOP/s, saved bytes at {mem_rate / 1e9:.3g} GB/s"
        f" ({source})"
    )
    return flops_rate, mem_rate


def _cost_model(
    s: _Session,
    by_name: dict[str, dict[str, int]],
    alone: dict[str, int],
    flops_per_second: float | None,
    memory_bandwidth: float | None,
    host_bandwidth: float,
) -> float:
    """Fills ``s.costs``, one :class:`NameCost` per name; returns the recompute FLOP/s."""
    flops_rate, mem_rate = _rates(s, flops_per_second, memory_bandwidth)
    base_flops = _measure._grad_flops(s.fn, s.args, s.save_all)
    for n in s.found:
        nbytes = by_name.get(n, {}).get("bytes", 0)
        delta = alone[n] - s.floor  # what saving n alone does to the temp bytes
        but_n = s.plan_of(dict.fromkeys(s.found, "save") | {n: "recompute"})
        extra = max(0, _measure._grad_flops(s.fn, s.args, but_n) - base_flops)
        s.costs.append(
            NameCost(
                name=n,
                nbytes=nbytes,
                count=by_name.get(n, {}).get("count", 0),
                recompute_seconds=extra / flops_rate if "recompute" in s.allow else None,
                offload_seconds=2 * nbytes / host_bandwidth if "offload" in s.allow else None,
                save_seconds=2 * nbytes / mem_rate,
                weight=max(nbytes, delta),
                reduction=max(0, nbytes - delta),
                recompute_flops=extra,
            )
        )
    return flops_rate


def _search(s: _Session, *, max_attempts: int, shortlist: int) -> None:
    """Solves, then compiles the fastest candidate the corrected model fits, until one fits.

    The knapsack proposes (its Pareto front over the additive model); the model corrected by the
    compiles so far decides what to compile, and learns from each compile.
    """
    _, front, s.exact = solve(s.costs, s.budget_bytes - s.floor)
    s.front = front
    by_time = [s.plan_of(dict(p.actions)) for p in sorted(front, key=lambda p: p.seconds)]

    def next_fitting() -> Plan | None:
        return next(
            (p for p in by_time if p not in s.compiled and s.corrected(p) <= s.budget_bytes), None
        )

    for _ in range(max_attempts):
        if (the_plan := next_fitting()) is None or s.search(the_plan) <= s.budget_bytes:
            break
    # The next fastest candidates predicted to fit, so that the choice is not the model's alone.
    for _ in range(max(shortlist - 1, 0)):
        if (the_plan := next_fitting()) is None:
            break
        s.search(the_plan)


def _fitting(s: _Session) -> list[Plan]:
    # The compiled plans that fit, fastest modeled first.
    if not any(s.allowed(p) for p in s.compiled):  # e.g. recompute not allowed and nothing solved
        s.compile(s.save_all)
    return sorted(
        (p for p in s.compiled if s.allowed(p) and s.temps[p] <= s.budget_bytes),
        key=lambda p: (s.seconds(p), s.temps[p]),
    )


def _race(
    s: _Session, fits: list[Plan], *, measure: bool, shortlist: int, rounds: int
) -> tuple[list[Plan], dict[Plan, float]]:
    # The fastest-modeled fitting plans timed when ``measure``: fastest measured first.
    timed: dict[Plan, float] = {}
    if measure and len(fits) > 1 and shortlist > 1:
        s.say(f"  timing the {min(shortlist, len(fits))} fastest-modeled plans that fit")
        t0 = time.perf_counter()
        executables = {p: s.compiled[p] for p in fits[:shortlist]}
        timed, ran = _measure._time(executables, s.args, rounds=rounds)
        fits = sorted(timed, key=timed.__getitem__)
        s.say(
            f"  timed in {ran} rounds ({time.perf_counter() - t0:.0f} s): "
            + ", ".join(f"{_short(p)} {timed[p]:.3f}x" for p in fits)
        )
    return fits, timed


def _report(s: _Session, chosen: Plan, timed: dict[Plan, float], notes: list[str]) -> PlanReport:
    return PlanReport(
        plan=chosen,
        costs=tuple(s.costs),
        budget_bytes=s.budget_bytes,
        predicted_temp_bytes=s.predicted.get(chosen, s.floor + _predict(s.costs, chosen)),
        compiled_temp_bytes=s.temps[chosen],
        compiled_host_temp_bytes=_measure._host_temp(s.compiled[chosen]),
        no_remat_temp_bytes=s.no_remat,
        min_temp_bytes=s.least,
        floor_temp_bytes=s.floor,
        front=tuple(s.front),
        exact=s.exact,
        tried=s.tried(timed),
        measured=bool(timed),
        notes=tuple(notes),
        explain_peak=_explainer(s.fn, s.args, chosen),
    )


def _variant_report(
    s: _Session, variants: Variants, flops_rate: float, notes: list[str]
) -> PlanReport:
    """No plan of ``fn`` fits: the fastest variant that fits under the least-memory plan."""
    chosen, variant_tried = _measure._variants(
        variants,
        s.least_plan,
        s.budget_bytes,
        s.fn,
        s.args,
        flops_rate,
        s.seconds(s.least_plan),
        s.say,
    )
    least = min([s.least] + [t.temp_bytes for t in variant_tried])
    if chosen is None:
        raise PlanError(
            f"plan_for_budget: budget {format_bytes(s.budget_bytes)} is below the least temp "
            f"memory of any plan compiled, {format_bytes(least)} ({least} B), variants "
            f"{', '.join(variants)} included. Fix: raise the budget to at least {least} B, "
            f"or reduce the batch.{_unordered_hint(s)}"
        )
    label, the_plan = chosen
    chosen_tried = next(t for t in variant_tried if t.variant == label)
    return PlanReport(
        plan=the_plan,
        costs=tuple(s.costs),
        budget_bytes=s.budget_bytes,
        predicted_temp_bytes=chosen_tried.temp_bytes,
        compiled_temp_bytes=chosen_tried.temp_bytes,
        no_remat_temp_bytes=s.no_remat,
        min_temp_bytes=least,
        floor_temp_bytes=s.floor,
        front=tuple(s.front),
        exact=s.exact,
        tried=s.tried({}) + tuple(variant_tried),
        measured=False,
        notes=(
            *notes,
            f"no plan of fn fits: variant {label!r} chosen (fastest modeled that fits).",
        ),
        variant=label,
        explain_peak=_explainer(*variants[label], the_plan),
    )


def _explainer(fn: Callable[..., Any], args: Sequence[Any], chosen: Plan) -> Callable[[], Any]:
    # The gradient _compile compiles, explained once, on first use (arrays held as shapes).
    grad = jax.grad(functools.partial(fn, policy=chosen))
    return functools.cache(explain_later(grad, args, {}, None))
