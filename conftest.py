"""Strict test settings shared by the whole suite (STYLE.md habit 11).

- 8 fake CPU devices, so sharding and donation paths run on a laptop or CI.
- ``jax_numpy_rank_promotion="raise"``: implicit rank promotion is a bug in this code base.
- Warnings are errors (pyproject.toml); each ignore there carries its reason.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
