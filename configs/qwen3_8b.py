"""KL-Atomic GPPO on Qwen3-8B with real math data, for a TPU v5p-64 slice or an 8-GPU host.

  python -m gppo_jax.train --config=configs/qwen3_8b.py:v5p64 \
      --config.model.path=/data/models/Qwen3-8B \
      --config.data.train_path=/data/math/train.jsonl
  python -m gppo_jax.plan --config=configs/qwen3_8b.py:gpu8 --platform=h200

The argument picks the hardware variant (v5p64 | gpu8; default v5p64) plus config_lib's own
options (smoke, ...), e.g. `:gpu8,smoke`. Paths are placeholders: see launch/README.md.
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
