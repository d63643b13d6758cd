"""The shared base config and its variants; `configs/*.py` are thin files built on these.

`get_config(arg)` in every config file accepts a comma-separated argument string:
  smoke         a seconds-long run of every stage (tests, first try on a new machine)
  task=NAME     another built-in task (see gppo_jax.tasks.TASKS)
Everything else is overridden on the command line: `--config.loss.delta_high=0.05`.
"""

from __future__ import annotations

import ml_collections

from gppo_jax import presets

REQUIRED = {
  "task": ("name",),
  "model": ("preset", "path", "dtype", "param_dtype"),
  "rollout": ("prompts_per_iter", "group_size", "max_new_tokens", "temperature"),
  "loss": ("divergence", "estimator", "delta_low", "delta_high", "aggregation"),
  "advantage": ("name",),
  "optim": ("lr",),
  "train": ("epochs", "minibatches", "microbatches"),
}


def parse_arg(arg: str | None) -> dict[str, str]:
  out = {}
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    key, _, value = part.partition("=")
    out[key] = value or "1"
  return out


def base(arg: str | None = None) -> ml_collections.ConfigDict:
  """The shared base: KL-Atomic on the built-in arithmetic task with a tiny warm-started policy."""
  args = parse_arg(arg)
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.iterations = 400  # RL iterations: rollout + update each.
  c.log_every = 1

  c.task = ml_collections.ConfigDict()
  # Built-in task (gppo_jax.tasks.TASKS), used when data.train_path is None.
  c.task.name = args.get("task", "addsub3")

  # Real data (JSONL / Parquet files); see README "Data files".
  c.data = ml_collections.ConfigDict()
  c.data.train_path = ml_collections.config_dict.placeholder(str)
  c.data.eval_path = ml_collections.config_dict.placeholder(str)
  c.data.kind = "math"  # math | code
  c.data.prompt_field = "prompt"
  c.data.answer_field = "answer"
  c.data.tests_field = "tests"
  c.data.system_prompt = ml_collections.config_dict.placeholder(str)
  c.data.instruction = ml_collections.config_dict.placeholder(str)
  c.data.max_prompt_tokens = 1024
  c.data.verifier_workers = 4
  c.data.verifier_timeout_s = 5.0

  c.model = ml_collections.ConfigDict()
  c.model.preset = "char-tiny"  # used when model.path is None
  c.model.path = ml_collections.config_dict.placeholder(str)  # local Hugging Face folder
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.model.export_hf = False  # also write a Hugging Face folder at the end of training

  # Supervised warm start of the built-in policy (cached; skipped for model.path).
  c.warmstart = ml_collections.ConfigDict()
  c.warmstart.enabled = True
  c.warmstart.target_accuracy = 0.30
  c.warmstart.max_steps = 3000
  c.warmstart.eval_every = 10
  c.warmstart.eval_size = 256
  c.warmstart.batch_size = 128
  c.warmstart.lr = 3e-3
  c.warmstart.cache_dir = "~/.cache/gppo_jax/warmstart"
  # Seed of the initial policy (init + warm start); None = the run's seed.
  c.warmstart.seed = ml_collections.config_dict.placeholder(int)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.prompts_per_iter = 64
  c.rollout.group_size = 8
  c.rollout.max_new_tokens = 8
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.num_topk = 0  # behaviour top-K to store (needed by the "topk" estimator)
  c.rollout.recompute_logprobs = False  # anchor to the rollout log-probs (GPPO.md section 1)

  cell = presets.cell("kl", "atomic")
  c.loss = ml_collections.ConfigDict()
  c.loss.divergence = cell.divergence
  c.loss.estimator = cell.estimator
  # Default radii f(1 - 0.2) match PPO's contraction bound; the paper's own deltas are unknown to
  # us and are a sweep axis.
  c.loss.delta_low = cell.delta_low
  c.loss.delta_high = cell.delta_high
  c.loss.aggregation = "token-mean"
  c.loss.max_len = ml_collections.config_dict.placeholder(int)  # Dr.GRPO normaliser (default R)
  c.loss.ratio_cap = ml_collections.config_dict.placeholder(float)
  c.loss.dual_clip = ml_collections.config_dict.placeholder(float)
  c.loss.kl_coef = 0.0  # penalty to the frozen initial policy (k3)
  c.loss.entropy_coef = 0.0

  # Optional shaping on top of correctness (0 = off): DAPO's soft overlong penalty over the last
  # `overlong_buffer` tokens of rollout.max_new_tokens; + format_coef for an extractable answer.
  c.reward = ml_collections.ConfigDict()
  c.reward.overlong_buffer = 0
  c.reward.format_coef = 0.0

  c.advantage = ml_collections.ConfigDict()
  c.advantage.name = "grpo"  # grpo | dr_grpo | rloo | batch_std
  c.advantage.eps = 1e-6  # grpo: (R - mean) / (std + eps)
  c.advantage.ddof = 1  # grpo: unbiased std
  c.advantage.filter_zero_signal = False  # DAPO dynamic sampling: drop all-equal groups

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 5e-4
  c.optim.schedule = "constant"
  c.optim.warmup_steps = 0
  c.optim.weight_decay = 0.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.grad_clip = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.epochs = 2
  c.train.minibatches = 4
  c.train.microbatches = 1

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 50
  c.eval.num_problems = 512
  c.eval.k = 4  # samples per problem for avg@k / pass@k
  c.eval.temperature = 1.0
  c.eval.top_p = 1.0

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 20
  c.checkpoint.keep = 3

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1

  if "smoke" in args:
    c.iterations = 3
    c.rollout.prompts_per_iter = 8
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 6
    c.train.minibatches = 2
    c.warmstart.max_steps = 30
    c.warmstart.eval_every = 10
    c.warmstart.eval_size = 64
    c.warmstart.batch_size = 64
    c.warmstart.cache_dir = ""  # no cache: smoke runs are self-contained
    c.eval.every = 2
    c.eval.num_problems = 32
    c.eval.k = 2
    c.checkpoint.every = 2
  return c


def use_settings(
  c: ml_collections.ConfigDict, s: presets.LossSettings
) -> ml_collections.ConfigDict:
  """Writes a LossSettings (trust region, aggregation, advantage) into config `c`."""
  c.loss.divergence = s.divergence
  c.loss.estimator = s.estimator
  c.loss.delta_low = s.delta_low
  c.loss.delta_high = s.delta_high
  c.loss.aggregation = s.aggregation
  c.loss.ratio_cap = s.ratio_cap
  c.loss.dual_clip = s.dual_clip
  c.advantage.name = s.advantage
  return c


def cell(divergence: str, estimator: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """A grid cell: the base config with the cell's divergence, estimator and default delta."""
  return use_settings(base(arg), presets.cell(divergence, estimator))


def preset(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """A named algorithm (ppo, dapo, dppo, ripo, ...) on the base config."""
  return use_settings(base(arg), presets.get(name))


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming every missing or invalid field of a config."""
  missing = []
  for section, fields in REQUIRED.items():
    if section not in c:
      missing.append(section)
      continue
    missing += [f"{section}.{f}" for f in fields if f not in c[section]]
  if missing:
    raise ValueError(f"config is missing required fields: {', '.join(missing)}")
  # Names are checked against the registries here, before any compile.
  from gppo_jax import advantages, divergences, estimators, objective

  divergences.get(c.loss.divergence)
  estimators.get(c.loss.estimator)
  advantages.get(c.advantage.name)
  if c.loss.aggregation not in objective.AGGREGATIONS:
    raise ValueError(
      f"loss.aggregation={c.loss.aggregation!r}; valid: {', '.join(objective.AGGREGATIONS)}"
    )
  for name in ("delta_low", "delta_high"):
    if not c.loss[name] > 0:
      raise ValueError(f"loss.{name} must be > 0, got {c.loss[name]}")
  r, u = c.rollout, c.train
  n = r.prompts_per_iter * r.group_size
  if r.group_size < 2:
    raise ValueError("rollout.group_size must be >= 2 for group-relative advantages")
  if n % (u.minibatches * u.microbatches):
    raise ValueError(
      f"rollout.prompts_per_iter * rollout.group_size = {n} must be divisible by "
      f"train.minibatches * train.microbatches = {u.minibatches * u.microbatches}"
    )
  if c.loss.estimator == "topk" and not r.num_topk:
    raise ValueError("loss.estimator='topk' needs rollout.num_topk > 0 (e.g. 20)")
  if c.loss.estimator == "exact":
    raise ValueError("loss.estimator='exact' is a diagnostic, not a trust region for training")
  if c.data.train_path is None and c.model.path is not None:
    raise ValueError("model.path is set but data.train_path is not: a real model needs real data")


# Hardware variants of the real-run configs (configs/qwen25_math_7b.py, configs/qwen3_8b.py).
REAL_RUN_VARIANTS = {
  # v5p-64 = 32 chips (95 GiB HBM each): FSDP over all chips; ~8B fp32 master weights + Adam are
  # ~3 GiB per chip, leaving room for 1024 rollouts of several thousand tokens.
  "v5p64": dict(mesh=dict(data=1, fsdp=32, tensor=1), prompts=128, micro=1),
  # One host with 8 GPUs (H100 80 GiB / H200 141 GiB): FSDP over the 8 GPUs.
  "gpu8": dict(mesh=dict(data=1, fsdp=8, tensor=1), prompts=64, micro=4),
}


def real_run(
  arg: str | None, *, preset: str, path: str, max_prompt_tokens: int, max_new_tokens: int
) -> ml_collections.ConfigDict:
  """KL-Atomic GPPO on a local Hugging Face checkpoint with math data, for a TPU v5p-64 slice or
  an 8-GPU host: `arg` picks the variant (v5p64 | gpu8; default v5p64) plus `smoke` etc."""
  args = parse_arg(arg)
  names = [k for k in args if k in REAL_RUN_VARIANTS] or ["v5p64"]
  if len(names) > 1:
    raise ValueError(f"pick one hardware variant, got {names}; valid: {sorted(REAL_RUN_VARIANTS)}")
  v = REAL_RUN_VARIANTS[names[0]]
  c = cell("kl", "atomic", arg)
  c.model.preset = preset  # same shapes; used by gppo_jax.plan when model.path is absent
  c.model.path = path
  c.model.dtype = "bfloat16"  # compute; master weights and Adam moments stay float32
  c.model.param_dtype = "float32"
  c.model.export_hf = True
  c.warmstart.enabled = False
  c.data.train_path = "/data/math/train.jsonl"
  c.data.eval_path = "/data/math/test.jsonl"
  c.data.kind = "math"
  c.data.max_prompt_tokens = max_prompt_tokens
  c.data.verifier_workers = 16
  c.rollout.prompts_per_iter = v["prompts"]
  c.rollout.group_size = 8
  c.rollout.max_new_tokens = max_new_tokens
  c.rollout.temperature = 1.0
  c.train.epochs = 1
  c.train.minibatches = 8  # mini-batches after the first are off-policy: the trust region acts
  c.train.microbatches = v["micro"]
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.iterations = 500
  c.eval.every = 50
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
