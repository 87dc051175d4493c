"""Timing rounds: the one way remat_nn and its benchmarks time functions against each other.

Single step times on a shared machine vary by tens of percent while the things compared differ
by a few, so functions are never timed one after the other. Each round runs every function once
(or a fixed number of times), in a fresh random order, so that none always runs first or after
the same neighbour, and functions are compared within a round: a slow spell of the machine that
spans a round slows every function in it alike and cancels in their ratio.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import jax

K = TypeVar("K", bound=Hashable)


def timing_rounds(
    fns: Mapping[K, Callable[[], Any]],
    *,
    rounds: int,
    warmup: int = 1,
    min_seconds: float = 0.0,
    shuffle: bool = True,
    seed: int = 0,
    keep: Callable[[dict[K, list[float]], list[K], int], list[K]] | None = None,
    clock: Callable[[], float] | None = None,
) -> tuple[dict[K, list[float]], int]:
    """Seconds per call of each ``fns[k]()`` in each of up to ``rounds`` interleaved rounds.

    Args:
      fns: the functions to compare, each called with no arguments; outputs are blocked on.
      rounds: most rounds; each times every function still in the race once.
      warmup: untimed calls of each function first (compiles and first-call costs).
      min_seconds: a function faster than this is called repeatedly within its slot (the count
        fixed once, from one timed call after warm-up) so that millisecond steps are not lost in
        timer resolution; its sample is the time per call.
      shuffle: run each round in a fresh random order (seeded by ``seed``).
      keep: called after each round as ``keep(samples, alive, rounds_run)``; returns the
        functions that stay in the race (the rest keep the samples they have). The rounds stop
        early when at most one is left.
      clock: seconds, ``time.perf_counter`` by default.

    Returns:
      ``(samples, rounds_run)``: per function, its time per call in each round it ran.

    >>> samples, ran = timing_rounds({"a": lambda: 1, "b": lambda: 2}, rounds=3)
    >>> ran, [len(v) for v in samples.values()]
    (3, [3, 3])
    """
    now = clock or time.perf_counter
    reps: dict[K, int] = {}
    for k, fn in fns.items():
        for _ in range(warmup):
            jax.block_until_ready(fn())
        reps[k] = 1
        if min_seconds > 0:
            t0 = now()
            jax.block_until_ready(fn())
            reps[k] = max(1, int(min_seconds / max(now() - t0, 1e-6)))
    samples: dict[K, list[float]] = {k: [] for k in fns}
    alive = list(fns)
    rng = random.Random(seed)
    ran = 0
    while ran < rounds and (len(alive) > 1 or (keep is None and alive)):
        for k in rng.sample(alive, len(alive)) if shuffle else list(alive):
            t0 = now()
            out = None
            for _ in range(reps[k]):
                out = fns[k]()
            jax.block_until_ready(out)
            samples[k].append((now() - t0) / reps[k])
        ran += 1
        if keep is not None:
            alive = keep(samples, alive, ran)
    return samples, ran
