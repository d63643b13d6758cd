"""GPPO on Qwen3-8B with the math recipe's data, for a TPU v5p-64 slice or an 8-GPU host.

  python -m gppo_jax.train --config=configs/qwen3_8b.py:v5p64,cell=kl_atomic
  python -m gppo_jax.plan --config=configs/qwen3_8b.py:gpu8 --platform=h200

The argument: the hardware variant (v5p64 | gpu8; default v5p64), `cell=NAME` (a grid cell such as
kl_atomic or a preset such as dapo; default kl_atomic) and `smoke`, e.g. `:gpu8,cell=ripo,smoke`.
Data and evaluation as configs/qwen25_math_7b.py; paths are placeholders: see launch/README.md.
"""

from gppo_jax import config_lib


def get_config(arg=None):
  # Qwen3 has a 40k context; responses get 4k
  return config_lib.real_run(
    arg,
    preset="qwen3-8b",
    path="/data/models/Qwen3-8B",
    max_prompt_tokens=1024,
    max_new_tokens=4096,
  )
