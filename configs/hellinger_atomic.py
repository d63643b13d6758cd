"""Grid cell hellinger x atomic: base config with default delta f(1 - 0.2) for hellinger.

python -m gppo_jax.train --config=configs/hellinger_atomic.py[:smoke]
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.cell("hellinger", "atomic", arg)
