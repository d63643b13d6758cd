"""CISPO as a GPPO cell (settings: gppo_jax/algorithm/presets.py, docs/math.md#cispo).

python -m gppo_jax.train --config=configs/cispo.py[:smoke]

No token is masked (infinite radius); every token's gradient is weighted by its importance ratio
truncated from above, stop_gradient(min(r, 1.28)) (loss.ratio_cap), as MiniMax-M1's CISPO with no
lower clip.
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.preset("cispo", arg)
