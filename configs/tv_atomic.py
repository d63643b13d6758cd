"""Grid cell tv x atomic: base config with default delta f(1 - 0.2) for tv.

python -m gppo_jax.train --config=configs/tv_atomic.py[:smoke]
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.cell("tv", "atomic", arg)
