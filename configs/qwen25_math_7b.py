"""GPPO on Qwen2.5-Math-7B with the math recipe's data, for a TPU v5p-64 slice or an 8-GPU host.

  python -m gppo_jax.train --config=configs/qwen25_math_7b.py:v5p64,cell=kl_atomic
  python -m gppo_jax.train --config=configs/qwen25_math_7b.py:gpu8,cell=dapo
  python -m gppo_jax.plan --config=configs/qwen25_math_7b.py:gpu8 --platform=h200
  python -m gppo_jax.evaluate --config=configs/qwen25_math_7b.py:gpu8   # the base model itself
  python -m gppo_jax.plan --config=configs/qwen25_math_7b.py:v5e8_lora --platform=v5e   # LoRA
  python -m gppo_jax.plan --config=configs/qwen25_math_7b.py:gpu1_lora --platform=h100

The argument: the hardware variant (v5p64 | gpu8, or with rank-64 LoRA on a bf16 base
v5e8_lora | gpu1_lora; default v5p64), `cell=NAME` (any of the 12
grid cells, e.g. kl_atomic, tv_mc, chi2_binary, or a preset: ppo, grpo, dapo, dapo_kl, dppo,
dppo_kl, ripo; default kl_atomic) and `smoke`, e.g. `:gpu8,cell=tv_atomic,smoke`. Trained on
DAPO-Math-17k, evaluated on MATH-500, AIME 2024/2025, AMC 2023, Minerva Math and OlympiadBench;
the files are where `python -m gppo_jax.prepare_data NAME --out /data/{train,eval}/NAME.jsonl`
writes them, the model under /data/models (see launch/README.md).

Answers are read from the last \boxed{} (reward.answer_format="boxed"), which is what the prompts
ask for: prepare_data removes DAPO-Math-17k's own `Answer:`-line wrapper, so training and the six
benchmarks share one instruction. DAPO's format is `--config.reward.answer_format=answer_line`
(its instruction then replaces the \boxed{} one, in training and evaluation alike).
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
