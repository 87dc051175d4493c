"""Reading a memory budget: bytes with a unit, or a fraction of a reference."""

from __future__ import annotations

import re

__all__ = ["parse_budget"]

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


def parse_budget(spec: str | int | float, *, reference_bytes: int | None = None) -> int:
    """Bytes from ``"2GiB"``, ``"512 MiB"``, ``1e9``, or a fraction such as ``0.5`` / ``"50%"``.

    Args:
      spec: bytes with a unit (B, KiB, MiB, GiB, KB, MB, GB), a whole number of bytes (at
        least 64), or a fraction of ``reference_bytes`` (a float in (0, 1] or a percentage
        string, which may exceed 100%). Any other bare number (``1.5``, ``"3"``) is refused:
        it is a fraction above 1 or a size whose unit was left out.
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
            return _bare_bytes(spec, spec)
    elif isinstance(spec, str):
        text = spec.strip()
        if m := re.fullmatch(r"([0-9.]+(?:[eE][0-9]+)?)\s*%", text):
            fraction = float(m.group(1)) / 100
        elif m := re.fullmatch(r"([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)", text):
            value, unit = float(m.group(1)), m.group(2).upper()
            if unit:
                if unit in _UNITS:
                    return int(value * _UNITS[unit])
            elif value > 1:
                return _bare_bytes(value, spec)
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


#: A bare number below this is not taken as bytes: no step fits in it, so it is almost surely a
#: fraction above 1 or a size whose unit was left out.
MIN_BARE_BYTES = 64


def _bare_bytes(value: float, spec: object) -> int:
    """A number with no unit, read as bytes when it is a whole number of at least 64."""
    if value != int(value) or value < MIN_BARE_BYTES:
        raise ValueError(
            f"budget: {spec!r} is neither a fraction (at most 1) nor a plausible number of bytes "
            f"(a whole number of at least {MIN_BARE_BYTES}). Fix: a share of the no-remat memory "
            f"as a percentage ('{value * 100:g}%'), or a size with its unit ('{value:g}GiB', "
            f"'{value:g}MiB')."
        )
    return int(value)
