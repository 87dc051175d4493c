"""Measuring a function for the planner: compiles, temp bytes, gradient FLOPs, the host's rates,
and a race between compiled plans."""

from __future__ import annotations

import functools
import operator
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_nn._flops import jaxpr_flops
from remat_nn._jax_internals import core
from remat_nn._memory import format_bytes
from remat_nn._plan import Plan
from remat_nn._timing import timing_rounds
from remat_nn.planner._report import Tried, _short


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


def _tracers(args: Sequence[Any]) -> list[Any]:
    """The leaves of ``args`` that are tracers (the planner was called under a transformation)."""
    return [x for x in jax.tree.leaves(args) if isinstance(x, core.Tracer)]


def _is_concrete(args: Sequence[Any]) -> bool:
    leaves = jax.tree.leaves(args)
    return all(isinstance(x, jax.Array) for x in leaves) and not _tracers(args)


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

    Single step times on a shared machine vary more than close plans differ, so every round
    runs each remaining candidate once, in a fresh random order (no candidate always runs
    first), and candidates are compared within a round (a slow spell spanning the round
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
