"""GPPO code RL on Qwen2.5-Coder-7B-Instruct, for a TPU v5p-64 slice or an 8-GPU host.

  python -m gppo_jax.train --config=configs/qwen25_coder_7b.py:v5p64,cell=kl_atomic
  python -m gppo_jax.plan --config=configs/qwen25_coder_7b.py:gpu8 --platform=h200

The argument: the hardware variant (v5p64 | gpu8; default v5p64), `cell=NAME` (a grid cell such as
kl_atomic or a preset such as dapo; default kl_atomic) and `smoke`. data.kind is "code": rewards
are the fraction of tests passed by the response's ```python block, run in the sandbox
(gppo_jax/rewards/sandbox/: needs root and util-linux on every host). Trained on TACO, evaluated on
LiveCodeBench (release_v5, 2024-08 to 2025-01) and HumanEval+; the files are where
`python -m gppo_jax.prepare_data NAME --out /data/{train,eval}/NAME.jsonl` writes them.
"""

from gppo_jax import config_lib


def get_config(arg=None):
  # Same shapes as Qwen2.5-7B; 32k context. Competitive-programming statements are long.
  return config_lib.real_run(
    arg,
    preset="qwen2.5-7b",
    path="/data/models/Qwen2.5-Coder-7B-Instruct",
    max_prompt_tokens=2048,
    max_new_tokens=4096,
    kind="code",
  )
