"""DAPO as a GPPO cell (settings: gppo_jax/algorithm/presets.py, docs/math.md#reductions).

python -m gppo_jax.train --config=configs/dapo.py[:smoke]

Beside the loss (clip-higher, token-mean), DAPO's dynamic sampling: groups whose rewards are all
equal are dropped and the batch is refilled from up to two extra generation rounds. Its overlong
shaping (reward.overlong_buffer, reward.overlong_filter) matters only for long responses; the
built-in task's are a few tokens.
"""

from gppo_jax import config_lib


def get_config(arg=None):
  c = config_lib.preset("dapo", arg)
  c.advantage.filter_zero_signal = True
  c.rollout.refill_rounds = 2
  return c
