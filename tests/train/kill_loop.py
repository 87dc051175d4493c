"""Random SIGKILLs of ``python -m train``, each followed by the same command, against one
uninterrupted run: ``python -m tests.train.kill_loop --kills 20 [--seed 0]``. Not part of the suite.

A run (the fault tests' tiny MLP on digits: 40 steps, a checkpoint every 4, ``keep=1``, the best
by eval loss kept too, asynchronous saves) is killed ``--kills-per-run`` times, then run to its
end; then a new run directory starts, until ``--kills`` kills have landed. Each kill is one of:

- ``timed``: SIGKILL from this process a random moment after the child's n-th log line (during
  training, an asynchronous save, its manifest or the pruning of older steps);
- ``startup``: SIGKILL a random moment after the child compiled its step (restore, the
  metrics.jsonl rewrite, the first steps);
- every other start, a fault point (train/faults.py) in turn: a save point at a checkpoint step
  still ahead, ``during_restore`` / ``during_metrics_rewrite`` at the step it resumes from
  (a save point instead when there is nothing to resume yet).

After each run finishes, its last checkpoint must be bitwise equal to the uninterrupted run's,
its metrics.jsonl equal line by line (timing fields aside), and the steps kept the same.
Exits 0 when every run matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from tests.train.test_faults import TIMING, assert_bitwise_equal, saved
from tests.train.test_faults import argv as fault_argv
from tests.trainer_cli import launch, shared_compilation_cache
from train.faults import KILL_POINTS

STEPS, EVERY = 40, 4
EXTRA = (
    f"train.steps={STEPS}",
    f"checkpoint.every={EVERY}",
    "checkpoint.keep=1",
    "checkpoint.keep_best=1",
    "checkpoint.best_metric=eval_loss",
    "train.eval_every=8",
    "train.eval_batches=2",
)


def argv(run_dir: Path) -> list[str]:
    return fault_argv(run_dir, *EXTRA)  # later overrides win


def start(run_dir: Path, fault: str | None = None) -> tuple[subprocess.Popen, queue.Queue]:
    env = {"REMAT_NN_FAULT": fault} if fault else None
    proc = launch(argv(run_dir), register="tests.train.tiny_models:register_fault_mlp", env=env)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def wait_for(lines: queue.Queue, predicate, out: list[str]) -> bool:
    # Reads lines until one matches (True) or the child's output ends (False). The end stays
    # in the queue, so a later read (finish) sees it too instead of waiting forever.
    while (line := lines.get()) is not None:
        out.append(line)
        if predicate(line):
            return True
    lines.put(None)
    return False


def finish(proc: subprocess.Popen, lines: queue.Queue, out: list[str]) -> int:
    wait_for(lines, lambda _: False, out)
    return proc.wait(timeout=300)


def resumable_step(run_dir: Path) -> int:
    # The newest step with a manifest (what the next start resumes from), 0 if none.
    ckpts = run_dir / "checkpoints"
    done = [
        int(p.name) for p in ckpts.glob("*") if p.name.isdigit() and (p / "manifest.json").exists()
    ]
    return max(done, default=0)


FAULTS = (*KILL_POINTS, "during_metrics_rewrite")


def one_attempt(run_dir: Path, rng: random.Random, n: int) -> tuple[str, int, str]:
    """Starts the run once (the ``n``-th start) and kills it one way: (kind, exit code, output).

    Every other start is killed at a fault point, each point in turn; the others are killed
    from outside at a random moment.
    """
    resume = resumable_step(run_dir)
    out: list[str] = []
    if n % 2:
        point = FAULTS[(n // 2) % len(FAULTS)]
        if point in ("during_restore", "during_metrics_rewrite") and not resume:
            point = rng.choice(KILL_POINTS[:-1])  # nothing to restore yet: a save point
        if point in ("during_restore", "during_metrics_rewrite"):
            at = resume  # the step this start restores (its lines past it are trimmed)
        else:
            at = rng.choice([s for s in range(EVERY, STEPS + 1, EVERY) if s > resume])
        kind = f"{point}@{at}"
        proc, lines = start(run_dir, fault=kind)
        return kind, finish(proc, lines, out), "".join(out)
    kind = rng.choice(["timed", "timed", "startup"])
    proc, lines = start(run_dir)
    if kind == "startup":
        ready = wait_for(lines, lambda line: line.startswith("donation:"), out)
        delay = rng.uniform(0.0, 0.4)
    else:
        nth = rng.randint(1, max(1, STEPS - resume))
        seen = [0]

        def nth_step(line: str) -> bool:
            seen[0] += line.startswith("step ")
            return seen[0] >= nth

        ready = wait_for(lines, nth_step, out)
        delay = rng.uniform(0.0, 0.05)
    if ready:
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    return kind, finish(proc, lines, out), "".join(out)


def metric_lines(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]


def kept_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.train.kill_loop", description=__doc__)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kills-per-run",
        type=int,
        default=6,
        help="then the run is finished, and a new one starts",
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill_loop_"))
    t0 = time.perf_counter()
    kinds: Counter[str] = Counter()
    failures: list[str] = []
    with shared_compilation_cache(str(work / "jax_cache")):
        reference = work / "reference"
        proc, lines = start(reference)
        out: list[str] = []
        code = finish(proc, lines, out)
        if code != 0:
            print("".join(out))
            return 1
        ref_arrays, ref_metrics = saved(reference, STEPS), metric_lines(reference)
        print(f"reference: {STEPS} steps, checkpoints kept {kept_steps(reference)}", flush=True)
        kills, runs, starts = 0, 0, 0
        while kills < args.kills:
            runs += 1
            run_dir = work / f"run{runs}"
            attempts, run_kills = 0, 0
            while True:
                attempts += 1
                if kills >= args.kills or run_kills >= args.kills_per_run:  # run it to its end
                    proc, lines = start(run_dir)
                    out = []
                    kind, code, out_text = "none", finish(proc, lines, out), ""
                    out_text = "".join(out)
                else:
                    starts += 1
                    kind, code, out_text = one_attempt(run_dir, rng, starts)
                if code == -signal.SIGKILL:
                    kills += 1
                    run_kills += 1
                    kinds[kind.split("@")[0]] += 1
                    now = resumable_step(run_dir)
                    print(
                        f"  run {runs} kill {kills}: {kind} (resumable step now {now})", flush=True
                    )
                    continue
                if code != 0:
                    failures.append(f"run {runs}: exit {code} after {kind}:\n{out_text}")
                break
            if code != 0:
                break
            problems = []
            try:
                assert_bitwise_equal(saved(run_dir, STEPS), ref_arrays)
            except AssertionError as e:
                problems.append(f"final checkpoint differs: {e}")
            if metric_lines(run_dir) != ref_metrics:
                problems.append("metrics.jsonl differs from the uninterrupted run's")
            if kept_steps(run_dir) != kept_steps(reference):
                problems.append(f"kept steps {kept_steps(run_dir)} != {kept_steps(reference)}")
            aside = sorted(
                p.name for p in (run_dir / "checkpoints").iterdir() if "corrupt" in p.name
            )
            status = "; ".join(problems) or "bitwise equal, metrics equal, same steps kept"
            print(
                f"run {runs}: finished after {attempts} starts: {status}; set aside {aside}",
                flush=True,
            )
            failures += [f"run {runs}: {p}" for p in problems]
    print(
        f"{kills} SIGKILLs over {runs} runs in {time.perf_counter() - t0:.0f} s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    )
    for f in failures:
        print("FAILED:", f)
    if not failures:
        shutil.rmtree(work)
    else:
        print(f"kept {work}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
