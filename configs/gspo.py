"""GSPO as a GPPO cell (settings: gppo_jax/algorithm/presets.py, docs/math.md#gspo).

python -m gppo_jax.train --config=configs/gspo.py[:smoke]

PPO's clip (eps 3e-4 below, 4e-4 above) on each response's length-normalised sequence ratio
exp(mean_t log r_t) instead of each token's ratio (loss.ratio_level="sequence"), and GRPO's
per-sequence token mean. The tiny clip range is the published one for long LLM responses; on the
built-in task's short answers a sequence ratio leaves it sooner, so its radius is a sweep axis
(`python -m gppo_jax.sweep --cells gspo --scales ...`).
"""

from gppo_jax import config_lib


def get_config(arg=None):
  return config_lib.preset("gspo", arg)
