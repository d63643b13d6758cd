"""GPPO on Qwen3-30B-A3B (a mixture of experts: 128 experts, 8 per token, 3.3B of 30.5B
parameters active) with the math recipe's data, for a TPU v5p-64 slice or an 8-GPU host.

  python -m gppo_jax.train --config=configs/qwen3_30b_a3b.py:v5p64,cell=kl_atomic
  python -m gppo_jax.plan --config=configs/qwen3_30b_a3b.py:v5p64
  python -m gppo_jax.plan --config=configs/qwen3_30b_a3b.py:gpu8 --platform=h200

The argument: the hardware variant (v5p64 | gpu8; default v5p64), `cell=NAME` (a grid cell such as
kl_atomic or a preset such as dapo; default kl_atomic) and `smoke`, e.g. `:gpu8,cell=ripo,smoke`.
Data and evaluation as configs/qwen25_math_7b.py; paths are placeholders: see launch/README.md.

Expert parallelism: the 128 experts split over 8 devices (mesh.expert), the rest FSDP over 4
(v5p64: 32 chips) or over 1 (gpu8); the batch splits over both. Routing replay is on
(rollout.routing_replay: the update reuses the sampler's experts, so routing flips between the
sampler and the trainer do not distort pi / mu; moe/routing_flips logs how many there would be);
the router's load-balancing loss is logged (moe/aux_loss) but not trained on
(model.moe.aux_loss_coef 0).
"""

from gppo_jax import config_lib

# Per hardware variant: FSDP x expert parallelism (the LoRA variants keep real_run's FSDP mesh).
MESHES = {"v5p64": dict(fsdp=4, expert=8), "gpu8": dict(fsdp=1, expert=8)}


def get_config(arg=None):
  # Qwen3 has a 40k context; responses get 4k
  c = config_lib.real_run(
    arg,
    preset="qwen3-30b-a3b",
    path="/data/models/Qwen3-30B-A3B",
    max_prompt_tokens=1024,
    max_new_tokens=4096,
  )
  variant = next((k for k in config_lib.REAL_RUN_VARIANTS if k in (arg or "")), "v5p64")
  if variant in MESHES:
    c.mesh.update(dict(data=1, tensor=1, **MESHES[variant]))
  c.rollout.routing_replay = True
  return c
