"""Shared base config: KL-Atomic GPPO on the built-in arithmetic task (see gppo_jax/config_lib.py).

python -m gppo_jax.train --config=configs/base.py[:smoke]
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.base(arg)
