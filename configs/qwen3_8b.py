"""KL-Atomic GPPO on Qwen3-8B with real math data, for a TPU v5p-64 slice or an 8-GPU host.

  python -m gppo_jax.train --config=configs/qwen3_8b.py:v5p64 \
      --config.model.path=/data/models/Qwen3-8B \
      --config.data.train_path=/data/math/train.jsonl
  python -m gppo_jax.plan --config=configs/qwen3_8b.py:gpu8 --platform=h200

The argument picks the hardware variant (v5p64 | gpu8; default v5p64) plus config_lib's own
options (smoke, ...), e.g. `:gpu8,smoke`. Paths are placeholders: see launch/README.md.
"""

from gppo_jax import config_lib

VARIANTS = {
  # v5p-64 = 32 chips (95 GiB HBM each): FSDP over all chips; 8.2B fp32 master weights + Adam
  # are ~3.1 GiB per chip, leaving room for 1024 x 5k-token rollouts.
  "v5p64": dict(mesh=dict(data=1, fsdp=32, tensor=1), prompts=128, micro=1),
  # One host with 8 GPUs (H100 80 GiB / H200 141 GiB): FSDP over the 8 GPUs.
  "gpu8": dict(mesh=dict(data=1, fsdp=8, tensor=1), prompts=64, micro=4),
}


def get_config(arg=None):
  args = config_lib.parse_arg(arg)
  names = [k for k in args if k in VARIANTS] or ["v5p64"]
  if len(names) > 1:
    raise ValueError(f"pick one hardware variant, got {names}; valid: {sorted(VARIANTS)}")
  v = VARIANTS[names[0]]
  c = config_lib.cell("kl", "atomic", arg)
  c.model.preset = "qwen3-8b"  # same shapes; used by gppo_jax.plan when model.path is absent
  c.model.path = "/data/models/Qwen3-8B"
  c.model.dtype = "bfloat16"  # compute; master weights and Adam moments stay float32
  c.model.param_dtype = "float32"
  c.model.export_hf = True
  c.warmstart.enabled = False
  c.data.train_path = "/data/math/train.jsonl"
  c.data.eval_path = "/data/math/test.jsonl"
  c.data.kind = "math"
  c.data.max_prompt_tokens = 1024  # Qwen3 has a 40k context; responses get 4k
  c.data.verifier_workers = 16
  c.rollout.prompts_per_iter = v["prompts"]
  c.rollout.group_size = 8
  c.rollout.max_new_tokens = 4096
  c.rollout.temperature = 1.0
  c.train.epochs = 1
  c.train.minibatches = 8  # mini-batches after the first are off-policy: the trust region acts
  c.train.microbatches = v["micro"]
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.iterations = 500
  c.eval.every = 25
  c.eval.num_problems = 500
  c.eval.k = 4
  c.checkpoint.every = 25
  c.checkpoint.keep = 2
  for axis, size in v["mesh"].items():
    c.mesh[axis] = size
  if "smoke" in args:  # keep the real model, shrink everything else
    c.rollout.max_new_tokens = 64
    c.eval.num_problems = 16
    c.train.microbatches = 1
  return c
