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
