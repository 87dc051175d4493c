"""What ``ScanRule``'s reverse scan carries besides the values (``_equation_rules``): its first
cotangents (zeros where the caller wants none) and the errors of the walk's rebuilt values
(``_errors``), the carry's from iteration to iteration, the constants', xs' and ys' the same at
every iteration.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from remat_nn._jax_internals import core
from remat_nn.invertible._jaxpr import is_float


def _initial_cts(couts, carry_avals, ys, const_avals):
    """The reverse scan's first cotangents of the carry, the ys and the consts (zeros where
    none; all None when no cotangent is wanted)."""
    if couts is None:
        return None, None, None
    num_carry = len(carry_avals)
    ct_carry = [_ct_or_zeros(c, a) for c, a in zip(couts[:num_carry], carry_avals, strict=True)]
    ct_ys = [_ct_or_zeros(c, core.typeof(y)) for c, y in zip(couts[num_carry:], ys, strict=True)]
    return ct_carry, ct_ys, [_ct_or_zeros(None, a) for a in const_avals]


def _ct_or_zeros(c, aval):
    if not is_float(aval):
        return None
    return c if c is not None else jnp.zeros(aval.shape, aval.dtype)


def _split_cts(cts, groups):
    """A body walk's input cotangents (after the body's own constants) split by ``groups`` of
    avals (consts, carry, xs), zeros where None for floats (None for the others)."""
    out, start = [], 0
    for avals in groups:
        part = cts[start : start + len(avals)]
        out.append([_ct_or_zeros(c, a) for c, a in zip(part, avals, strict=True)])
        start += len(avals)
    return out


def _as_err(e, aval):
    """A float carry's error as a scan can carry it (zeros where exact)."""
    if not is_float(aval):
        return None
    return (jnp.zeros((), jnp.float32),) * 3 if e is None else e


@dataclasses.dataclass
class _ScanErrors:
    """The errors a reverse scan carries (see ``_errors``): the carry's go from iteration to
    iteration; the consts', xs' and ys' are the same for every iteration (their largest)."""

    consts: list
    carry0: list
    xs: list
    ys: list
    carry_avals: list
    xs_known: list

    @classmethod
    def of(cls, errs, checked, num_consts, num_carry, carry_avals, xs_known):
        """Tracked only if an inversion in the body is checked or a known value carries one."""
        if errs is None or not (checked or any(e is not None for e in (*errs[0], *errs[1]))):
            return None
        ins, outs = errs
        return cls(
            consts=list(ins[:num_consts]),
            carry0=[_as_err(e, a) for e, a in zip(outs[:num_carry], carry_avals, strict=True)],
            xs=[
                e if k else None
                for e, k in zip(ins[num_consts + num_carry :], xs_known, strict=True)
            ],
            ys=list(outs[num_carry:]),
            carry_avals=carry_avals,
            xs_known=xs_known,
        )

    def inner(self, err_c, num_body_consts):
        """The body walk's errors, (inputs, outputs), at an iteration."""
        num_carry = len(self.carry_avals)
        ins = [None] * num_body_consts + self.consts + [None] * num_carry + self.xs
        return ins, list(err_c) + self.ys

    def split(self, new_errs, xs_avals):
        """(the next carry's errors, this iteration's rebuilt xs' errors)."""
        num_consts, num_carry = len(self.consts), len(self.carry_avals)
        carry = new_errs[num_consts : num_consts + num_carry]
        xs = new_errs[num_consts + num_carry :]
        new_c = [_as_err(e, a) for e, a in zip(carry, self.carry_avals, strict=True)]
        x_err = [
            None if k else _as_err(e, a)
            for e, a, k in zip(xs, xs_avals, self.xs_known, strict=True)
        ]
        return new_c, x_err

    def result(self, err_c, x_err):
        """The scan's operands' errors: a rebuilt xs carries its largest over the iterations."""
        stacked = [None if e is None else tuple(jnp.max(p) for p in e) for e in x_err]
        return [None] * len(self.consts) + list(err_c) + stacked
