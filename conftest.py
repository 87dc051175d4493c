"""Strict test settings shared by the whole suite (STYLE.md habit 11).

- 8 fake CPU devices, so sharding and donation paths run on a laptop or CI.
- ``jax_numpy_rank_promotion="raise"``: implicit rank promotion is a bug in this code base.
- Warnings are errors (pyproject.toml); each ignore there carries its reason.
- ``jax_upgrade_flags``: runs a test twice, as JAX is today and with the upgrade flags that
  become its defaults (``jax_remat3``, ``jax_custom_vjp3``).
"""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

_UPGRADE_FLAGS = ("jax_remat3", "jax_custom_vjp3")


@pytest.fixture(params=["default", "remat3+custom_vjp3"])
def jax_upgrade_flags(request):
    """Runs the test with JAX's defaults, then with ``jax_remat3`` and ``jax_custom_vjp3`` on."""
    before = {flag: getattr(jax.config, flag) for flag in _UPGRADE_FLAGS}
    wanted = {flag: request.param != "default" for flag in _UPGRADE_FLAGS}
    _set_flags(wanted)
    try:
        yield request.param
    finally:
        _set_flags(before)


def _set_flags(values: dict[str, bool]) -> None:
    # Both flags are part of JAX's jit key and trace context: nothing traced under one setting
    # is reused under the other, so no cache needs clearing.
    for flag, value in values.items():
        jax.config.update(flag, value)
