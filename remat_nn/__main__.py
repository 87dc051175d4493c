"""``python -m remat_nn``: the memory / compute trade-off of remat policies on a real network.

Compares policies on a 16-layer residual MLP stack (lax.scan, batch 64, width 256, hidden 1024):
saved residuals (what reverse-mode keeps) and XLA's compiled memory of the gradient. CPU note:
offloaded bytes are placed on host in the lowered program, but XLA:CPU has one memory, so the
offload rows show the plan's bookkeeping, not a measured saving.
"""

import argparse
import time

import jax

import remat_nn as rn
from remat_nn import _demo

POLICIES = {
    "no remat": None,
    "dots_saveable": "dots_saveable",
    "save mlp_hidden": "save=mlp_hidden",
    "offload mlp_hidden": "offload=mlp_hidden",
    "nothing_saveable": "nothing_saveable",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m remat_nn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--depth", type=int, default=16, help="layers in the scanned stack")
    parser.add_argument("--batch", type=int, default=64, help="batch size")
    args = parser.parse_args()
    t0 = time.perf_counter()
    params = _demo.init(jax.random.key(0), depth=args.depth)
    x = jax.random.normal(jax.random.key(1), (args.batch, 256))
    table = rn.compare_policies(_demo.loss, (params, x), POLICIES)
    print(f"# remat policies on a {args.depth}-layer scanned MLP, batch {args.batch}\n")
    print(table)
    print(f"\nresiduals of `offload mlp_hidden`:\n{table.reports['offload mlp_hidden']}")
    print(
        f"\n({time.perf_counter() - t0:.1f}s; reproduce: python -m remat_nn "
        f"--depth {args.depth} --batch {args.batch})"
    )


if __name__ == "__main__":
    main()
