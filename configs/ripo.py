"""RIPO as a GPPO cell (settings: gppo_jax/algorithm/presets.py, docs/math.md#reductions).

python -m gppo_jax.train --config=configs/ripo.py[:smoke]
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.preset("ripo", arg)
