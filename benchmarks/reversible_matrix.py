"""``python -m benchmarks.reversible_matrix [--mechanism invertible]``: one mechanism's half
of the canonical-stacks matrix, its ``lax.scan`` cells only (issue #44).

The same cells, data, programs and counts as ``benchmarks/invertible_matrix.py`` (its module
docstring), for ``rn.reversible_scan`` (the default) or ``rn.invertible`` alone: 288 cells,
about 13 minutes on 2 CPU cores for the reversible stacks and 8 for ``rn.invertible``, against
15 minutes to an hour for the whole matrix (both mechanisms and the unrolled forms). Prints
the counts and every false refusal.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import invertible_matrix as m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mechanism", choices=("reversible", "invertible"), default="reversible")
    mechanism = parser.parse_args().mechanism
    run = m._reversible if mechanism == "reversible" else m._invertible
    axes, rows, start = m.AXES, [], time.perf_counter()
    for coupling, width, depth, ln, dtype in itertools.product(
        axes["coupling"], axes["width"], axes["depth"], axes["ln"], axes["dtype"]
    ):
        stack = m.Stack(coupling, width, depth, "scan", ln, dtype)
        refs, programs = m._reference(stack, axes["scale"]), m._Programs(stack)
        for scale in axes["scale"]:
            args = [jnp.asarray(a, jnp.float32) for a in m._data(stack, scale)]
            own = m._attempt(programs["plain"], args, refs[scale])[1]
            rows.append((m.label(stack, scale), own, run(programs, args, refs[scale])))
        print(f"{len(rows)} cells, {time.perf_counter() - start:.0f}s", file=sys.stderr)
    refused = [(n, own, o) for n, own, o in rows if o.status.startswith("refused")]
    false = [(n, own, o) for n, own, o in refused if m._le(o.unchecked, m.FALSE * own)]
    accepted = [(n, own, o) for n, own, o in rows if o.status == "accepted"]
    silent = [r for r in accepted if m._gt(r[2].err, m.SILENT * r[1])]
    worst = max(accepted, key=lambda r: (r[2].err or 0.0) / r[1])
    command = "python -m benchmarks.reversible_matrix --mechanism " + mechanism
    print(f"Command: `{command}` (jax {jax.__version__}, CPU)\n")
    print(f"- cells: {len(rows)}; accepted {len(accepted)}, refused {len(refused)}")
    noisy = sum(own >= m.NOISY for _, own, _ in false)
    print(f"- false refusals: {len(false)} ({noisy} where jax.grad's own error >= {m.NOISY})")
    print(f"- silent errors (accepted, > {m.SILENT}x jax.grad's own): {len(silent)}")
    print(f"- worst accepted: {(worst[2].err or 0.0) / worst[1]:.1f}x at {worst[0]}")
    for name, own, o in false:
        print(f"  - false refusal: {name}: jax.grad {own:.1e}, unchecked {o.unchecked:.1e}")


if __name__ == "__main__":
    main()
