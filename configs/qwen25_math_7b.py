"""KL-Atomic GPPO on Qwen2.5-Math-7B with real math data, for a TPU v5p-64 slice or an 8-GPU host.

  python -m gppo_jax.train --config=configs/qwen25_math_7b.py:v5p64 \
      --config.model.path=/data/models/Qwen2.5-Math-7B \
      --config.data.train_path=/data/math/train.jsonl
  python -m gppo_jax.plan --config=configs/qwen25_math_7b.py:gpu8 --platform=h200

The argument picks the hardware variant (v5p64 | gpu8; default v5p64) plus config_lib's own
options (smoke, ...), e.g. `:gpu8,smoke`. Paths are placeholders: see launch/README.md.
"""

from gppo_jax import config_lib


def get_config(arg=None):
  # Qwen2.5-Math has a 4096-token context
  return config_lib.real_run(
    arg,
    preset="qwen2.5-7b",
    path="/data/models/Qwen2.5-Math-7B",
    max_prompt_tokens=512,
    max_new_tokens=3072,
  )
