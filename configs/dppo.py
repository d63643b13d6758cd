"""DPPO as a GPPO cell (settings: gppo_jax/algorithm/presets.py, docs/math.md#reductions).

python -m gppo_jax.train --config=configs/dppo.py[:smoke]
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.preset("dppo", arg)
