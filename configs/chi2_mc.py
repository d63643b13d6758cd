"""Grid cell chi2 x mc: base config with default delta f(1 - 0.2) for chi2.

python -m gppo_jax.train --config=configs/chi2_mc.py[:smoke]
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.cell("chi2", "mc", arg)
