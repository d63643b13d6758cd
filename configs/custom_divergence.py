"""GPPO with a divergence of your own: Le Cam's triangular discrimination, f(t) = (t-1)^2 / (t+1).

python -m gppo_jax.train --config=configs/custom_divergence.py[:smoke]
"""

from gppo_jax import config_lib
from gppo_jax.algorithm import divergences, presets


def le_cam(t):
  return (t - 1.0) ** 2 / (t + 1.0)


# Registered when the file loads, so "le_cam" then works by name everywhere. Its limits f(0) = 1
# and f(t)/t -> 1 are given (the float32 estimate of the second overflows) and the numerical
# check is skipped, so loading the config runs no JAX (the commands set JAX up after reading it;
# tests/test_readme.py runs the check). overwrite: a process may load this file more than once.
divergences.register(
  "le_cam", le_cam, f_at_zero=1.0, slope_at_inf=1.0, validate=False, overwrite=True
)


def get_config(arg=None):
  # The Atomic estimator at the radius f(1 - 0.2), as the grid's cells use.
  cell = presets.cell("le_cam", "atomic", delta=le_cam(0.8))
  return config_lib.use_settings(config_lib.base(arg), cell)
