"""remat_nn.invertible: memory-free VJPs that rebuild intermediates from outputs.

The table of contents; the algorithm is explained in README.md beside this file.

- ``_jaxpr``: evaluating and differentiating single equations.
- ``_primitive_rules``: the registry of per-primitive inverses with their exactness guards;
  the rules, registered when this package is imported: ``_arithmetic_rules`` (add, mul, div,
  exp, log, ...) and ``_structural_rules`` (identities, layout, exact dtype changes).
- ``_equation_rules``: the ``EquationRule`` protocol: primitives, calls, scans, custom_ivjp,
  slices that tile their operand; ``_scan_carry``: what a scan's reverse walk carries besides
  the values (first cotangents, errors); ``_scan_sketch``: a scan's per-iteration sketches;
  ``_scan_recompute``: ``fallback="recompute"`` recomputing a failed iteration at run time.
- ``_tiling``: finding the sets of slices that tile their operand, and putting them back.
- ``_analysis``: the monotone closure deciding what the walk knows and which inputs it keeps.
- ``_walk``: the backward walk itself (derivations, schedule and execution, run-time checks).
- ``_api``: ``rn.invertible`` (tracing, static arguments, the per-signature cache).
- ``_custom_ivjp``: ``rn.custom_ivjp``.
- ``_report``: ``rn.inversion_report``.
"""

from remat_nn.invertible._api import Invertible, invertible
from remat_nn.invertible._custom_ivjp import custom_ivjp
from remat_nn.invertible._primitive_rules import Guard, PrimitiveRule, register_inverse
from remat_nn.invertible._report import InversionEntry, InversionReport, inversion_report
from remat_nn.invertible import _arithmetic_rules, _structural_rules  # noqa: F401  (registers)

__all__ = [
    "Guard",
    "InversionEntry",
    "InversionReport",
    "Invertible",
    "PrimitiveRule",
    "custom_ivjp",
    "inversion_report",
    "invertible",
    "register_inverse",
]
