"""The shared base config and its variants; `configs/*.py` are thin files built on these.

`get_config(arg)` in every config file accepts a comma-separated argument string:
  smoke         a seconds-long run of every stage (tests, first try on a new machine)
  task=NAME     another built-in task (see gppo_jax.data.tasks.TASKS), with its run settings
                (TASK_RUNS: the word task `wordchain` needs longer responses and a smaller batch)
(the real-run configs also take a hardware variant, REAL_RUN_VARIANTS, and `cell=NAME`: a grid
cell such as kl_atomic or a preset such as dapo, `algorithm`); any other argument is an error.
Everything else is overridden on the command line: `--config.loss.delta_high=0.05`.
`validate(config)` checks every field's type and range before anything is built.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from gppo_jax import errors
from gppo_jax.algorithm import correction, presets

REQUIRED = {
  "task": ("name",),
  "model": ("preset", "path", "dtype", "param_dtype"),
  "rollout": ("prompts_per_iter", "group_size", "max_new_tokens", "temperature"),
  "loss": ("divergence", "estimator", "delta_low", "delta_high", "aggregation"),
  "advantage": ("name",),
  "optim": ("lr",),
  "train": ("epochs", "minibatches", "microbatches"),
}


# train.shuffle: how each epoch cuts the rollout batch into mini-batches (train_step.UpdateSpec).
SHUFFLES = ("groups", "rows")
# rollout.mode: take turns with the update, draw the next rollout beside it
# (trainer/async_rollout.py), or stream groups from an engine that never drains
# (trainer/stream_rollout.py).
ROLLOUT_MODES = ("sync", "async", "stream")
# Where warm starts are cached unless a config says otherwise: $GPPO_WARMSTART_CACHE, else this.
# A machine's setting, like $GPPO_XLA_CACHE for compiled programs.
WARMSTART_CACHE_ENV = "GPPO_WARMSTART_CACHE"
WARMSTART_CACHE_DEFAULT = "~/.cache/gppo_jax/warmstart"


def cache_folder(env: str, default: str) -> str:
  """A machine's cache folder: $env if set, else `default`; "" (no cache) for a value of off,
  none, false, 0 or nothing."""
  choice = os.environ.get(env, default).strip()
  return "" if choice.lower() in ("", "off", "0", "false", "none") else choice


# Config-file arguments: name -> whether it takes a value (`task=NAME`) or is a switch (`smoke`).
BASE_ARGS: dict[str, bool] = {"smoke": False, "task": True}


def _describe_args(valid: Mapping[str, bool]) -> str:
  return ", ".join(f"{k}=NAME" if takes_value else k for k, takes_value in valid.items())


def parse_arg(arg: str | None, valid: Mapping[str, bool] = BASE_ARGS) -> dict[str, str]:
  """`'smoke,task=add1'` -> {'smoke': '1', 'task': 'add1'}; ConfigError for anything not in
  `valid` (name -> takes a value), so that a typo such as `:smok` is not silently ignored."""
  out = {}
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    key, eq, value = (s.strip() for s in part.partition("="))
    if key not in valid:
      hint = errors.did_you_mean(key, valid)
      where = f" in {arg!r}" if arg.strip() != part else ""
      raise errors.ConfigError(
        f"unknown config argument {key!r}{where}{hint}; valid: {_describe_args(valid)}"
      )
    if valid[key] and not value:
      raise errors.ConfigError(f"config argument {key!r} needs a value: {key}=NAME")
    if not valid[key] and eq:
      raise errors.ConfigError(f"config argument {key!r} takes no value, got {part!r}")
    out[key] = value or "1"
  return out


def _task_arg(args: Mapping[str, str]) -> str:
  from gppo_jax.data import tasks

  name = args.get("task", "addsub3")
  if name not in tasks.TASKS:
    raise errors.unknown_name("built-in task", name, tasks.TASKS, " (config argument task=NAME)")
  return name


# Run settings of the built-in tasks that the default run does not fit, applied by the config
# argument task=NAME (`--config=configs/kl_atomic.py:task=wordchain`). Each task's response length
# (rollout.max_new_tokens = its longest response + the end token) is set for every task that has
# an entry here, with `smoke` too; the rest only without `smoke`, which keeps its own sizes.
# wordchain: responses of about 71 tokens over a 4,123-word vocabulary, many times addsub3's work
# per response; the batch, iterations and evaluations are cut so that its grid of 104 runs fits a
# few hours on a 2-core CPU (docs/verdict.md, "A task where rare tokens matter", has the cost).
TASK_RUNS: dict[str, dict[str, Any]] = {
  "wordchain": {
    "iterations": 60,
    # At the base's 3e-4 a start of the task's first version lost accuracy within 20 iterations,
    # where 1e-4 gained (docs/verdict.md).
    "optim.lr": 1e-4,
    "rollout.prompts_per_iter": 16,
    "eval.every": 20,
    "eval.num_problems": 256,
    "warmstart.batch_size": 32,
    # Greedy accuracy can jump from below the target to near 100% within 50 supervised steps
    # once the copy of each step's operation is learned: checked every 10 steps, not 50.
    "warmstart.eval_every": 10,
    "warmstart.eval_size": 128,
  },
}


def _apply_task_run(c: ml_collections.ConfigDict, smoke: bool) -> None:
  """Writes the run settings of config c's task (TASK_RUNS) into c."""
  from gppo_jax.data import tasks

  name = c.task.name
  if name not in TASK_RUNS:
    return
  c.rollout.max_new_tokens = tasks.get(name).max_answer_len + 1
  if smoke:
    return
  for field, value in TASK_RUNS[name].items():
    section, key = field.split(".") if "." in field else (None, field)
    (c if section is None else c[section])[key] = value


def base(
  arg: str | None = None, *, extra_args: Mapping[str, bool] | None = None
) -> ml_collections.ConfigDict:
  """The shared base: KL-Atomic on the built-in arithmetic task with a tiny warm-started policy.

  `arg` is the config-file argument (BASE_ARGS, plus `extra_args` that the caller handles)."""
  args = parse_arg(arg, {**BASE_ARGS, **(extra_args or {})})
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.iterations = 400  # RL iterations: rollout + update each.
  c.log_every = 1

  c.task = ml_collections.ConfigDict()
  # Built-in task (gppo_jax.data.tasks.TASKS), used when data.train_path is None.
  c.task.name = _task_arg(args)

  c.data = _data_section()
  c.model = _model_section()
  c.warmstart = _warmstart_section()
  c.rollout = _rollout_section()
  c.loss = _loss_section()
  c.reward = _reward_section()
  c.advantage = _advantage_section()
  c.optim = _optim_section()
  c.train = _train_section()
  c.diagnostics = _diagnostics_section()
  c.eval = _eval_section()
  c.checkpoint = _checkpoint_section()
  c.logging = _logging_section()
  c.profile = _profile_section()
  c.mesh = _mesh_section()

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
    c.eval.every = 2
    c.eval.num_problems = 32
    c.eval.k = (2,)
    c.checkpoint.every = 2
  _apply_task_run(c, smoke="smoke" in args)
  return c


def _data_section() -> ml_collections.ConfigDict:
  """The base config's `data` section."""
  # Real data (JSONL / Parquet files); see docs/guide.md "Data files".
  s = ml_collections.ConfigDict()
  s.train_path = ml_collections.config_dict.placeholder(str)
  s.eval_path = ml_collections.config_dict.placeholder(str)
  s.kind = "math"  # math | code
  s.prompt_field = "prompt"
  s.answer_field = "answer"
  s.tests_field = "tests"
  s.system_prompt = ml_collections.config_dict.placeholder(str)
  s.instruction = ml_collections.config_dict.placeholder(str)
  s.max_prompt_tokens = 1024
  s.verifier_workers = 4
  s.verifier_timeout_s = 5.0
  return s


def _model_section() -> ml_collections.ConfigDict:
  """The base config's `model` section."""
  s = ml_collections.ConfigDict()
  s.preset = "char-tiny"  # used when model.path is None
  s.path = ml_collections.config_dict.placeholder(str)  # local Hugging Face folder
  s.dtype = "float32"
  s.param_dtype = "float32"
  # What each layer keeps for the backward pass (architectures.REMAT_CHOICES: auto, none, full,
  # attention, dots; "auto" = `architectures.layer_plan`: on CPU no remat and unrolled layers
  # where that fits, else "attention") and the attention implementation (attention.py: auto,
  # dense, blockwise, cudnn, splash).
  s.remat = "auto"
  s.attention = "auto"
  # The decoder layers scanned (one compiled layer) or unrolled (each layer compiled on its own:
  # a somewhat faster update step for a longer compile; docs/performance.md).
  s.scan_layers = True
  # Which kernels run the update's matrix products on CPU (sharding.CPU_MATMULS): "auto" = XLA's
  # own up to hidden size 128, where they beat the YNNPACK library XLA picks by default;
  # "xla"; "ynnpack" (XLA's default). No effect on GPU and TPU. docs/performance.md.
  s.cpu_matmul = "auto"
  s.export_hf = False  # also write a Hugging Face folder at the end of training
  # LoRA: rank 0 = off (full fine-tuning). With rank r > 0 only adapters A [in, r], B [r, out] on
  # the projections whose names (q, k, v, o, gate, up, down) fully match the regular expression
  # `targets` are trained: y = x W + (alpha / r) dropout(x) A B. The base weights stay frozen
  # (in model.param_dtype) and out of the optimizer state and checkpoints; the KL reference is
  # the base with the adapters off. Export writes the merged model and a PEFT adapter folder.
  # Mixtures of experts (Qwen3-MoE): the weight of the router's load-balancing loss in the loss
  # (0: off; transformers' router_aux_loss_coef is 0.001, for pretraining: an RL fine-tune of a
  # balanced router leaves it off), logged as moe/aux_loss either way; how the experts run
  # (architectures.MOE_DISPATCH: "sorted", or "dense", every expert on every token).
  s.moe = ml_collections.ConfigDict()
  s.moe.aux_loss_coef = 0.0
  s.moe.dispatch = "sorted"
  s.lora = ml_collections.ConfigDict()
  s.lora.rank = 0
  s.lora.alpha = 16.0
  s.lora.targets = "q|k|v|o|gate|up|down"
  s.lora.dropout = 0.0
  return s


def _warmstart_section() -> ml_collections.ConfigDict:
  """The base config's `warmstart` section."""
  # Supervised warm start of the built-in policy (cached; skipped for model.path).
  s = ml_collections.ConfigDict()
  s.enabled = True
  s.target_accuracy = 0.30
  s.max_steps = 3000
  s.eval_every = 10
  s.eval_size = 256
  s.batch_size = 128
  s.lr = 3e-3
  # Optional schedule of the supervised step: linear warmup over warmup_steps, then cosine decay
  # to lr * final_lr_fraction at decay_steps (1.0: constant), gradients clipped to clip_norm
  # (0: none). The defaults are plain Adam at lr; docs/verdict.md ("Warm starts that miss their
  # target") has what 100 / 0.1 / 1.0 (decay_steps 3000) did to the starts of seeds 0-3 and 8-12.
  s.warmup_steps = 0
  s.final_lr_fraction = 1.0
  s.decay_steps = 3000
  s.clip_norm = 0.0
  s.cache_dir = cache_folder(WARMSTART_CACHE_ENV, WARMSTART_CACHE_DEFAULT)
  # Seed of the initial policy (init + warm start); None = the run's seed.
  s.seed = ml_collections.config_dict.placeholder(int)
  return s


def _rollout_section() -> ml_collections.ConfigDict:
  """The base config's `rollout` section."""
  s = ml_collections.ConfigDict()
  s.prompts_per_iter = 64
  s.group_size = 8
  s.max_new_tokens = 8
  s.temperature = 1.0
  s.top_p = 1.0
  s.top_k = 0
  s.num_topk = 0  # behaviour top-K to store (needed by the "topk" estimator)
  # Which distribution the behaviour log-probs (and the current policy's in the update) are of:
  # "full" = softmax(logits / T), "sampled" = the one sampled from, truncated by top_k / top_p and
  # renormalised (the current policy over the behaviour's kept set). docs/guide.md "Training".
  s.logprobs_mode = "full"
  s.recompute_logprobs = False  # anchor to the rollout log-probs (docs/math.md#notation)
  # With recompute_logprobs: how the update corrects for the sampler's log-probs mu differing from
  # the trainer's pi_old (docs/math.md#rollout-correction): "none", "tis" (weight each token's
  # policy term by min(pi_old / mu, C)) or "mis" (drop tokens whose ratio leaves [1/C, C]), per
  # "token" or per "sequence" (the product of the response's ratios). mismatch/* logs the gap:
  # frac_beyond is the share of tokens with |log(pi_old / mu)| > mismatch_threshold.
  # How rollouts and evaluations decode: "fixed" batches, "continuous" batching over a paged KV
  # cache (generation/continuous.py; on a mesh split over the batch shards): `slots` responses
  # decode at once (0: every row of a rollout, or with the pool given by memory as many as it
  # holds at the expected footprint), pages of `page_size` cache slots, a pool of `kv_pages`
  # pages (0: sized by the engine, or from `kv_memory_gib` GiB when > 0, or from
  # `kv_memory_fraction` of the sampler devices' free memory when > 0, as serving engines size
  # theirs; at most one of the three), `decode_chunk` steps per compiled call.
  # cache, or "auto": continuous from continuous.AUTO_MIN_NEW_TOKENS max_new_tokens on.
  # `paged_attention`: how its decode steps attend over the pages: "gather" (any backend),
  # "pallas" (JAX's TPU paged-attention kernel: a bfloat16 cache, run per batch shard; local
  # layers still gather) or "auto" (pallas on TPU where it fits, generation/paged.py).
  s.engine = "auto"
  s.slots = 0
  s.page_size = 16
  s.kv_pages = 0
  s.kv_memory_gib = 0.0
  s.kv_memory_fraction = 0.0
  s.decode_chunk = 32
  s.paged_attention = "auto"
  s.correction = "none"
  s.correction_level = "token"
  s.correction_cap = 2.0
  s.mismatch_threshold = 0.1
  # DAPO's dynamic sampling (with advantage.filter_zero_signal): up to this many extra generation
  # rounds per iteration to fill the batch with groups that carry signal (0 = only mask them).
  s.refill_rounds = 0
  # Stale rollouts, as in asynchronous RL: iteration t samples with the policy of iteration t - k
  # (the initial one while t < k), so even the first update step is off-policy. Keeps k copies of
  # the parameters (saved in checkpoints). 0 = on-policy sampling. docs/guide.md "Training".
  s.staleness = 0
  # Where the rollout runs beside the update: "sync" (take turns: sample, then update) or "async"
  # (needs staleness = k >= 1): the rollout of iteration t + 1 is drawn in the background, with
  # the policy of iteration t + 1 - k, while iteration t updates; the same computation as "sync"
  # with that staleness, so the same metrics. With mesh.rollout_devices > 0 the two run on their
  # own devices; else they share them (the overlap is then the host's scoring and scheduling).
  # "stream": the continuous engine never drains; prompts flow into free slots, each update's
  # weights are loaded between decode chunks (a response may span several policy versions, each
  # token's recorded), and the update takes finished groups as they come, dropping (and counting)
  # those whose oldest token is more than `max_staleness` updates old.
  s.mode = "sync"
  s.max_staleness = 2
  # Mixtures of experts: the sampler records the experts each response token was routed to and
  # the update's forward reuses them (recomputing their weights with the current router), so the
  # ratio pi / mu is not distorted by routing flips; moe/routing_flips logs the share of
  # (token, layer) pairs whose trainer router would have chosen otherwise. Either engine.
  s.routing_replay = False
  return s


def _loss_section() -> ml_collections.ConfigDict:
  """The base config's `loss` section."""
  # The fields of objective.LossConfig, exactly (the trainer reads them with
  # LossConfig.from_config; config files write a preset's with use_settings).
  loss = presets.cell("kl", "atomic").loss
  s = ml_collections.ConfigDict()
  s.divergence = loss.divergence
  s.estimator = loss.estimator
  # Default radii f(1 - 0.2) match PPO's contraction bound; the paper's own deltas are unknown to
  # us and are a sweep axis.
  s.delta_low, s.delta_high = loss.radii
  s.aggregation = loss.aggregation
  s.max_len = ml_collections.config_dict.placeholder(int)  # Dr.GRPO normaliser (default R)
  s.ratio_cap = ml_collections.config_dict.placeholder(float)
  # "sequence": every token uses its response's ratio exp(mean_t log r_t) (GSPO; estimator mc).
  s.ratio_level = "token"
  s.dual_clip = ml_collections.config_dict.placeholder(float)
  s.kl_coef = 0.0  # penalty to the frozen initial policy (k3)
  s.entropy_coef = 0.0
  return s


def _reward_section() -> ml_collections.ConfigDict:
  """The base config's `reward` section."""
  # Optional shaping on top of correctness (0 = off): DAPO's soft overlong penalty over the last
  # `overlong_buffer` tokens of rollout.max_new_tokens; + format_coef for an extractable answer.
  s = ml_collections.ConfigDict()
  s.overlong_buffer = 0
  s.format_coef = 0.0
  s.overlong_filter = False  # DAPO: truncated responses are left out of the loss
  # Where a math response's final answer is read (math_reward.ANSWER_FORMATS): "boxed" (the last
  # \boxed{}), "answer_line" (DAPO's last `Answer: ...` line) or "either" (the box, else the line).
  # With data.instruction None it also picks the prompts' instruction. docs/guide.md "Rewards".
  s.answer_format = "boxed"
  return s


def _advantage_section() -> ml_collections.ConfigDict:
  """The base config's `advantage` section."""
  s = ml_collections.ConfigDict()
  s.name = "grpo"  # grpo | dr_grpo | rloo | batch_std
  s.eps = 1e-6  # grpo: (R - mean) / (std + eps)
  s.ddof = 1  # grpo: unbiased std
  s.filter_zero_signal = False  # DAPO dynamic sampling: drop all-equal groups
  return s


def _optim_section() -> ml_collections.ConfigDict:
  """The base config's `optim` section."""
  s = ml_collections.ConfigDict()
  # 3e-4: the default run improves from every warm start tried; 5e-4 made the trust region
  # matter more but from some warm starts no longer improved: too close to the edge to be the
  # default (docs/performance.md has the runs).
  s.lr = 3e-4
  s.schedule = "constant"
  s.warmup_steps = 0
  s.weight_decay = 0.0
  s.b1 = 0.9
  s.b2 = 0.999
  s.grad_clip = 1.0
  return s


def _train_section() -> ml_collections.ConfigDict:
  """The base config's `train` section."""
  s = ml_collections.ConfigDict()
  s.epochs = 2
  s.minibatches = 4
  s.microbatches = 1
  # How each epoch cuts the rollouts into mini-batches: "groups" shuffles whole groups (each
  # mini- and micro-batch holds complete groups, and the update runs each group's prompt through
  # the model once for its G responses: about half the work on the built-in task), "rows" shuffles
  # single responses. docs/guide.md "Training".
  s.shuffle = "groups"
  # Cut each rollout batch's responses to its longest one, rounded up to a multiple of this many
  # tokens, before the update (0 = keep all rollout.max_new_tokens columns). The columns cut are
  # padding in every row, so nothing changes but the work; each new length compiles the update
  # once (cached on disk). The real-run configs set 0: a 7B update compiles for minutes.
  s.trim_bucket = 1
  return s


def _diagnostics_section() -> ml_collections.ConfigDict:
  """The base config's `diagnostics` section."""
  # The evaluation protocol, separate from the rollout's (docs/guide.md "Evaluation"): greedy
  # accuracy, avg@n and pass@k per benchmark with standard errors, macro-averaged per benchmark
  # kind.
  # Every `every` iterations (0 = off): each per-token estimator against the exact divergence over
  # the full vocabulary on the rollout batch, masked fractions by side and behaviour probability,
  # entropy, a log-ratio histogram (docs/math.md#diagnostics): two extra forward passes, after
  # the update (diag/...) and, with rollout.staleness > 0, also before it (diag_start/...).
  s = ml_collections.ConfigDict()
  s.every = 10
  s.divergences = ()  # extra divergences whose exact value is logged, e.g. ("tv", "kl")
  s.chunk_size = 16  # response positions per [rows, chunk, vocab] logits block
  return s


def _eval_section() -> ml_collections.ConfigDict:
  """The base config's `eval` section."""
  s = ml_collections.ConfigDict()
  s.every = 50
  s.num_problems = 512  # held-out problems of the built-in task (data files: every row)
  s.n = ml_collections.config_dict.placeholder(int)  # samples per problem; None = max(k)
  # pass@k for each k <= n: a list (`--config.eval.k=1,8,16`) or one int (k = 0: none).
  s.k = ml_collections.FieldReference((4,), field_type=object)
  # Evaluation seeds (an int or a list); each repeats the sampled evaluation. None = the run's seed.
  s.seeds = ml_collections.config_dict.placeholder(object)
  s.temperature = 1.0
  s.top_p = 1.0
  s.max_new_tokens = ml_collections.config_dict.placeholder(int)  # None = the rollout's
  s.batch_size = 256  # sequences per sampler call
  return s


def _checkpoint_section() -> ml_collections.ConfigDict:
  """The base config's `checkpoint` section."""
  s = ml_collections.ConfigDict()
  s.every = 20
  s.keep = 3
  return s


def _logging_section() -> ml_collections.ConfigDict:
  """The base config's `logging` section."""
  # Where metrics go besides <workdir>/metrics.jsonl and TensorBoard (trainer/metric_writers.py):
  # with wandb=True, process 0 also logs every scalar, histogram and this config to a Weights &
  # Biases run (`pip install wandb`), which a resumed run continues under the same run id
  # (<workdir>/wandb_run_id.txt). The environment's WANDB_MODE, when set, wins over wandb_mode.
  s = ml_collections.ConfigDict()
  s.wandb = False
  s.wandb_project = "gppo_jax"
  s.wandb_entity = ""  # "" = the account's default entity
  s.wandb_mode = "online"  # online | offline (`wandb sync <workdir>/wandb/...` later)
  return s


def _profile_section() -> ml_collections.ConfigDict:
  """The base config's `profile` section."""
  # Trace `iterations` iterations from iteration `start` (numbered from 1; 0 = off) with the JAX
  # profiler into <workdir>/profile: TensorBoard's profile tab and a Perfetto trace of the
  # device's kernels, the host's ops and the Python calls (docs/performance.md). Iteration 1
  # compiles: start later to see the steady state.
  s = ml_collections.ConfigDict()
  s.start = 0
  s.iterations = 2
  return s


def _mesh_section() -> ml_collections.ConfigDict:
  """The base config's `mesh` section."""
  s = ml_collections.ConfigDict()
  s.data = -1
  s.fsdp = 1
  s.tensor = 1
  # Expert parallelism (mixtures of experts): the experts split over this many devices, which
  # also split the batch; 1 = no expert axis in the mesh. Must divide the model's num_experts.
  s.expert = 1
  # Split device groups: the last `rollout_devices` devices sample (on their own mesh, with the
  # `mesh.rollout` axes) and the rest train; after each update the new parameters move to the
  # sampler (async/sync_s, async/sync_gib). 0: one mesh for both (no parameter moves). On several
  # processes each gives the last rollout_devices / processes of its devices to a sampler of its
  # own, which samples its share of each rollout's prompts.
  s.rollout_devices = 0
  s.rollout = ml_collections.ConfigDict()
  s.rollout.data = -1
  s.rollout.fsdp = 1
  s.rollout.tensor = 1
  s.rollout.expert = 1
  return s


def from_saved(saved: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The config a run saved (train's <workdir>/config.json, parsed), rebuilt on the shared base.

  Each saved value replaces the base's, so a field keeps the base's type where it has one: a
  command-line override of a field saved as None (`--config.eval.n=16`) parses as it does on a
  config file, and JSON's lists come back as the tuples configs hold. A saved field the base
  lacks is kept as saved; a base field the saved config lacks (one added since the run) keeps
  the base's default."""
  if not isinstance(saved, Mapping):
    raise errors.ConfigError(f"a saved config is a JSON object, got {type(saved).__name__}")
  c = base()
  _overlay(c, saved)
  return c


def _tuples(value: Any) -> Any:
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _overlay(c: ml_collections.ConfigDict, saved: Mapping[str, Any]) -> None:
  for key, value in saved.items():
    if isinstance(value, Mapping):
      if not isinstance(c.get(key), ml_collections.ConfigDict):
        with c.ignore_type():
          c[key] = ml_collections.ConfigDict()
      _overlay(c[key], value)
      continue
    try:
      c[key] = _tuples(value)
    except TypeError:  # saved with another type than the base's (a config file's own choice)
      with c.ignore_type():
        c[key] = _tuples(value)


def use_settings(c: ml_collections.ConfigDict, preset: presets.Preset) -> ml_collections.ConfigDict:
  """Writes a preset into config `c`: every field of its LossConfig into `c.loss` (delta_high None
  as delta_low) and its advantage estimator into `c.advantage.name`."""
  loss = preset.loss
  for field in dataclasses.fields(loss):
    c.loss[field.name] = getattr(loss, field.name)
  c.loss.delta_low, c.loss.delta_high = loss.radii
  c.advantage.name = preset.advantage
  return c


def cell(
  divergence: str,
  estimator: str,
  arg: str | None = None,
  *,
  extra_args: Mapping[str, bool] | None = None,
) -> ml_collections.ConfigDict:
  """A grid cell: the base config with the cell's divergence, estimator and default delta."""
  return use_settings(base(arg, extra_args=extra_args), presets.cell(divergence, estimator))


def preset(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """A named algorithm (ppo, dapo, dppo, ripo, ...) on the base config."""
  return use_settings(base(arg), presets.get(name))


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_num(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


# --- Field rules: what each config field may hold, as data (`_field_rules`) -------------------


@dataclasses.dataclass(frozen=True)
class Int:
  """An integer (not a bool) in [lo, hi] (hi=None: no upper bound); None too if none_ok."""

  lo: int
  hi: int | None = None
  none_ok: bool = False

  def want(self, x) -> str | None:
    if x is None and self.none_ok:
      return None
    if _is_int(x) and self.lo <= x and (self.hi is None or x <= self.hi):
      return None
    want = (
      f"an integer >= {self.lo}" if self.hi is None else f"an integer in [{self.lo}, {self.hi}]"
    )
    return want + (" or None" if self.none_ok else "")


@dataclasses.dataclass(frozen=True)
class Range:
  """A real number (not a bool) in a range, closed unless lo_open / hi_open; finite unless
  finite=False; None too if none_ok. NaN fails every range (its comparisons are False).
  note: appended to the message (what the field means)."""

  lo: float
  hi: float | None = None
  lo_open: bool = False
  hi_open: bool = False
  finite: bool = True
  none_ok: bool = False
  note: str = ""

  def want(self, x) -> str | None:
    if x is None and self.none_ok:
      return None
    ok = _is_num(x) and (self.lo < x if self.lo_open else self.lo <= x)
    ok = ok and (self.hi is None or (x < self.hi if self.hi_open else x <= self.hi))
    if ok and (math.isfinite(x) or not self.finite):
      return None
    if self.hi is None:
      want = (
        f"{'a finite' if self.finite else 'a'} number {'>' if self.lo_open else '>='} {self.lo:g}"
      )
    else:
      left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
      want = f"a number in {left}{self.lo:g}, {self.hi:g}{right}"
    return want + (" or None" if self.none_ok else "") + self.note


@dataclasses.dataclass(frozen=True)
class OneOf:
  choices: tuple

  def want(self, x) -> str | None:
    return None if x in self.choices else "one of " + ", ".join(map(str, self.choices))


@dataclasses.dataclass(frozen=True)
class Flag:
  def want(self, x) -> str | None:
    return None if isinstance(x, bool) else "True or False"


@dataclasses.dataclass(frozen=True)
class Text:
  """A string, non-empty unless empty_ok; None too if none_ok."""

  none_ok: bool = False
  empty_ok: bool = False

  def want(self, x) -> str | None:
    if (x is None and self.none_ok) or (isinstance(x, str) and (x or self.empty_ok)):
      return None
    return "a " + ("" if self.empty_ok else "non-empty ") + "string" + " or None" * self.none_ok


@dataclasses.dataclass(frozen=True)
class Satisfies:
  """A value `ok(x)` accepts; `description` says which (for shapes a range cannot say)."""

  ok: Any
  description: str

  def want(self, x) -> str | None:
    return None if self.ok(x) else self.description


def _valid_ks(x) -> bool:
  from gppo_jax.rewards import pass_at_k

  try:
    pass_at_k.normalize_ks(x)
  except ValueError:
    return False
  return True


def _valid_seeds(x) -> bool:
  if x is None or _is_int(x):
    return True
  return (
    isinstance(x, (list, tuple))
    and bool(x)
    and all(_is_int(s) for s in x)
    and len(set(x)) == len(x)
  )


# Sections that configs built before them may lack: their fields are then not checked.
OPTIONAL_SECTIONS = ("profile", "model.lora", "model.moe", "logging")

# logging.wandb_mode: log to the W&B server as the run goes, or only to <workdir>/wandb.
WANDB_MODES = ("online", "offline")
# Characters W&B refuses in a project name.
_WANDB_PROJECT_BANNED = set("/\\#?%:")


def _valid_wandb_project(x) -> bool:
  return isinstance(x, str) and 0 < len(x) <= 128 and not set(x) & _WANDB_PROJECT_BANNED


def _field_rules(c: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  """(field, rule) for every field `validate` checks on its own, in the order it reports them,
  section by section. The choices come from the layers that define them (imported by each
  section, not when a config file imports this module)."""
  return (
    *_run_and_data_rules(),
    *_model_rules(),
    *_warmstart_rules(),
    *_rollout_rules(),
    *_loss_rules(),
    *_reward_and_advantage_rules(c),
    *_optimizer_rules(),
    *_update_eval_and_checkpoint_rules(),
    *_logging_rules(),
  )


def _run_and_data_rules() -> tuple[tuple[str, Any], ...]:
  """The run's own fields and the data files'."""
  return (
    ("seed", Int(-(2**63))),
    ("iterations", Int(1)),
    ("log_every", Int(1)),
    ("data.kind", OneOf(("math", "code"))),
    ("data.train_path", Text(none_ok=True)),
    ("data.eval_path", Text(none_ok=True)),
    ("data.system_prompt", Text(none_ok=True)),
    ("data.instruction", Text(none_ok=True)),
    ("data.prompt_field", Text()),
    ("data.answer_field", Text()),
    ("data.tests_field", Text()),
    ("data.max_prompt_tokens", Int(1)),
    ("data.verifier_workers", Int(1)),
    ("data.verifier_timeout_s", Range(0, lo_open=True)),
  )


def _model_rules() -> tuple[tuple[str, Any], ...]:
  """The policy's fields: dtypes, remat, attention, LoRA, a mixture of experts."""
  from gppo_jax.models import architectures, sharding

  dtypes = OneOf(tuple(architectures.DTYPES))
  return (
    ("model.path", Text(none_ok=True)),
    ("model.dtype", dtypes),
    ("model.param_dtype", dtypes),
    ("model.remat", OneOf(architectures.REMAT_CHOICES)),
    ("model.attention", OneOf(architectures.ATTENTION)),
    ("model.scan_layers", Flag()),
    ("model.cpu_matmul", OneOf(sharding.CPU_MATMULS)),
    ("model.export_hf", Flag()),
    ("model.lora.rank", Int(0)),
    ("model.moe.aux_loss_coef", Range(0)),
    ("model.moe.dispatch", OneOf(architectures.MOE_DISPATCH)),
    ("model.lora.alpha", Range(0, lo_open=True, note=" (the adapters' scale is alpha / rank)")),
    (
      "model.lora.targets",
      Satisfies(
        lambda x: architectures.lora_targets_problem(x) is None,
        "a regular expression fully matching one or more of the projections "
        + ", ".join(architectures.LORA_PROJECTIONS),
      ),
    ),
    ("model.lora.dropout", Range(0, 1, hi_open=True)),
  )


def _warmstart_rules() -> tuple[tuple[str, Any], ...]:
  """The warm start of the built-in policy."""
  return (
    ("warmstart.enabled", Flag()),
    ("warmstart.target_accuracy", Range(0, 1)),
    ("warmstart.max_steps", Int(0)),
    ("warmstart.eval_every", Int(1)),
    ("warmstart.eval_size", Int(1)),
    ("warmstart.batch_size", Int(1)),
    ("warmstart.lr", Range(0, lo_open=True)),
    ("warmstart.warmup_steps", Int(0)),
    ("warmstart.final_lr_fraction", Range(0, 1)),
    ("warmstart.decay_steps", Int(1)),
    ("warmstart.clip_norm", Range(0)),
    ("warmstart.cache_dir", Text(empty_ok=True)),
    ("warmstart.seed", Int(-(2**63), none_ok=True)),
  )


def _rollout_rules() -> tuple[tuple[str, Any], ...]:
  """Sampling, the engine, the rollout correction."""
  from gppo_jax.generation import continuous, paged

  return (
    ("rollout.prompts_per_iter", Int(1)),
    ("rollout.group_size", Int(2)),  # group-relative advantages need two responses per prompt
    ("rollout.max_new_tokens", Int(1)),
    ("rollout.temperature", Range(0, lo_open=True)),
    ("rollout.top_p", Range(0, 1, lo_open=True)),
    ("rollout.top_k", Int(0)),
    ("rollout.num_topk", Int(0)),
    ("rollout.logprobs_mode", OneOf(("full", "sampled"))),
    ("rollout.recompute_logprobs", Flag()),
    ("rollout.engine", OneOf(continuous.ENGINES)),
    ("rollout.slots", Int(0)),
    ("rollout.page_size", Int(1)),
    ("rollout.kv_pages", Int(0)),
    ("rollout.kv_memory_gib", Range(0)),
    ("rollout.kv_memory_fraction", Range(0, 1, note=" (0 = off: the pool's share of free memory)")),
    ("rollout.decode_chunk", Int(1)),
    ("rollout.paged_attention", OneOf(paged.ATTENTION)),
    ("rollout.correction", OneOf(correction.CORRECTIONS)),
    ("rollout.correction_level", OneOf(correction.LEVELS)),
    ("rollout.correction_cap", Range(1, lo_open=True)),
    ("rollout.mismatch_threshold", Range(0, lo_open=True)),
    ("rollout.refill_rounds", Int(0)),
    ("rollout.staleness", Int(0)),
    ("rollout.mode", OneOf(ROLLOUT_MODES)),
    ("rollout.max_staleness", Int(1)),
    ("mesh.rollout_devices", Int(0)),
    ("rollout.routing_replay", Flag()),
  )


def _loss_rules() -> tuple[tuple[str, Any], ...]:
  """The loss: trust-region radii, aggregation, ratio options, coefficients."""
  from gppo_jax.algorithm import objective

  radius = Range(0, lo_open=True, finite=False, note=" (a trust-region radius; inf = none)")
  return (
    ("loss.delta_low", radius),
    ("loss.delta_high", radius),
    ("loss.aggregation", OneOf(objective.AGGREGATIONS)),
    ("loss.max_len", Int(1, none_ok=True)),
    ("loss.ratio_cap", Range(1, none_ok=True, note=" (cap on the importance weight)")),
    ("loss.ratio_level", OneOf(objective.RATIO_LEVELS)),
    ("loss.dual_clip", Range(1, lo_open=True, none_ok=True, note=" (PPO's dual clip, e.g. 3)")),
    ("loss.kl_coef", Range(0)),
    ("loss.entropy_coef", Range(0)),
  )


def _reward_and_advantage_rules(c: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  """Rewards and their shaping (the overlong buffer fits in the longest response), advantages."""
  from gppo_jax.data import tasks
  from gppo_jax.rewards import math_reward

  overlong = []
  if _is_int(c.rollout.max_new_tokens):
    longest = c.rollout.max_new_tokens
    if c.data.train_path is None and c.task.name in tasks.TASKS:  # built-in answers are short
      longest = min(longest, tasks.get(c.task.name).max_answer_len + 1)
    overlong = [("reward.overlong_buffer", Int(0, longest))]
  return (
    ("reward.answer_format", OneOf(tuple(math_reward.ANSWER_FORMATS))),
    ("reward.format_coef", Range(0, note=" (0 = off)")),
    *overlong,
    # Advantages.
    ("advantage.eps", Range(0, lo_open=True, note=" (all-equal groups divide by std + eps)")),
    ("advantage.ddof", OneOf((0, 1))),
    ("advantage.filter_zero_signal", Flag()),
    ("reward.overlong_filter", Flag()),
  )


def _optimizer_rules() -> tuple[tuple[str, Any], ...]:
  return (
    ("optim.lr", Range(0, lo_open=True)),
    ("optim.schedule", OneOf(("constant", "cosine", "linear"))),
    ("optim.warmup_steps", Int(0)),
    ("optim.weight_decay", Range(0)),
    ("optim.b1", Range(0, 1, hi_open=True)),
    ("optim.b2", Range(0, 1, hi_open=True)),
    ("optim.grad_clip", Range(0, none_ok=True, note=" (0 or None = no clipping)")),
  )


def _update_eval_and_checkpoint_rules() -> tuple[tuple[str, Any], ...]:
  """The update's epochs and batches, evaluation, checkpoints, diagnostics, profiling."""
  return (
    ("train.epochs", Int(1)),
    ("train.minibatches", Int(1)),
    ("train.microbatches", Int(1)),
    ("train.shuffle", OneOf(SHUFFLES)),
    ("train.trim_bucket", Int(0)),
    ("eval.every", Int(1)),
    ("eval.num_problems", Int(1)),
    ("eval.n", Int(0, none_ok=True)),
    (
      "eval.k",
      Satisfies(_valid_ks, "an integer >= 0 or a list of integers >= 1 (the k of pass@k)"),
    ),
    (
      "eval.seeds",
      Satisfies(_valid_seeds, "None, an integer or a non-empty list of distinct integers"),
    ),
    ("eval.temperature", Range(0, lo_open=True)),
    ("eval.top_p", Range(0, 1, lo_open=True)),
    ("eval.max_new_tokens", Int(1, none_ok=True)),
    ("eval.batch_size", Int(1)),
    ("checkpoint.every", Int(1)),
    ("diagnostics.every", Int(0)),
    ("diagnostics.chunk_size", Int(1)),
    ("checkpoint.keep", Int(1)),
    ("profile.start", Int(0)),
    ("profile.iterations", Int(1)),
  )


def _logging_rules() -> tuple[tuple[str, Any], ...]:
  return (
    ("logging.wandb", Flag()),
    (
      "logging.wandb_project",
      Satisfies(_valid_wandb_project, "a W&B project name: 1-128 characters, none of / \\ # ? % :"),
    ),
    ("logging.wandb_entity", Text(empty_ok=True)),
    ("logging.wandb_mode", OneOf(WANDB_MODES)),
  )


def _field_problems(c: ml_collections.ConfigDict) -> list[str]:
  """`field=value: must be ...` for each field its rule rejects."""
  problems = []
  for field, rule in _field_rules(c):
    parts = field.split(".")
    value = c
    for depth, part in enumerate(parts):
      if part not in value and ".".join(parts[: depth + 1]) in OPTIONAL_SECTIONS:
        break
      value = value[part]
    else:
      want = rule.want(value)
      if want is not None:
        problems.append(f"{field}={value!r}: must be {want}")
  return problems


def _registry_name(field: str, lookup, name) -> None:
  """Looks `name` up in a registry; the UnknownNameError names the config field."""
  try:
    lookup(name)
  except errors.UnknownNameError as e:
    raise errors.UnknownNameError(
      f"{field}: {e}", kind=e.kind, name=e.name, choices=e.choices
    ) from None
  except errors.ConfigError as e:
    raise errors.ConfigError(f"{field}: {e}") from None


def _check_eval_relations(e: ml_collections.ConfigDict) -> None:
  from gppo_jax.rewards import pass_at_k

  ks = pass_at_k.normalize_ks(e.k)
  if e.n is not None and ks and max(ks) > e.n:
    raise errors.ConfigError(
      f"eval.k={list(ks)} asks for pass@{max(ks)} but eval.n={e.n} samples per problem: set "
      f"eval.n >= {max(ks)} (or eval.n=None: as many as the largest k) or drop k > {e.n}"
    )


def _mesh_problems(mesh, name: str) -> list[str]:
  """Axis sizes >= 1, or -1 for "the rest of the devices" on at most one axis."""
  from gppo_jax.models import sharding

  problems = []
  sizes = {k: v for k, v in mesh.items() if k not in sharding.ROLLOUT_MESH_KEYS}
  for axis, x in sizes.items():
    if not (_is_int(x) and (x >= 1 or x == -1)):
      problems.append(f"{name}.{axis}={x!r}: must be an integer >= 1 or -1 (the remaining devices)")
  if list(sizes.values()).count(-1) > 1:
    problems.append(f"{name}={sizes}: at most one axis may be -1")
  return problems


def validate(c: ml_collections.ConfigDict, *, evaluating: bool = False) -> None:
  """Raises a ConfigError (a ValueError) naming every missing or invalid field of a config.

  Runs before anything is built (warm start, model load, data): names are checked against the
  registries and every numeric field against its valid range (NaN never passes). `evaluating`:
  the config of `python -m gppo_jax.evaluate`, which may evaluate model.path on data.eval_path
  alone (no training data).
  """
  _check_required(c)
  _check_names(c)
  problems = _field_problems(c) + _combination_problems(c)
  if problems:
    raise errors.ConfigError("invalid config: " + "; ".join(problems))
  _check_relations(c, evaluating=evaluating)


def _check_required(c: ml_collections.ConfigDict) -> None:
  """ConfigError naming every missing section and field of REQUIRED."""
  missing = []
  for section, fields in REQUIRED.items():
    if section not in c:
      missing.append(section)
      continue
    missing += [f"{section}.{f}" for f in fields if f not in c[section]]
  if missing:
    raise errors.ConfigError(f"config is missing required fields: {', '.join(missing)}")


def _check_names(c: ml_collections.ConfigDict) -> None:
  """Registry names (divergence, estimator, advantage, task, preset), before any compile."""
  # Names are checked against the registries here, before any compile.
  from gppo_jax.algorithm import advantages, divergences, estimators
  from gppo_jax.data import tasks
  from gppo_jax.models import architectures

  _registry_name("loss.divergence", divergences.get, c.loss.divergence)
  _registry_name("loss.estimator", estimators.get, c.loss.estimator)
  _registry_name("advantage.name", advantages.get, c.advantage.name)
  _registry_name("task.name", tasks.get, c.task.name)
  _registry_name("model.preset", architectures.get, c.model.preset)
  for name in c.diagnostics.divergences:
    _registry_name("diagnostics.divergences", divergences.get, name)


def _combination_problems(c: ml_collections.ConfigDict) -> list[str]:
  """Fields valid on their own that do not go together (rollout, mesh), and the eval paths."""
  from gppo_jax.data import envs

  problems = []
  r = c.rollout
  pool = [f"rollout.{k}={r[k]}" for k in ("kv_pages", "kv_memory_gib", "kv_memory_fraction")
          if r.get(k)]  # fmt: skip
  if len(pool) > 1:
    problems.append(
      f"{' and '.join(pool)}: the pool is sized by one of them (set the other"
      f"{'s' if len(pool) > 2 else ''} to 0)"
    )
  if r.get("paged_attention") == "pallas" and c.model.dtype != "bfloat16":
    problems.append(
      f"rollout.paged_attention='pallas': the kernel rounds keys and values to bfloat16, and "
      f"model.dtype={c.model.dtype!r} keeps a {c.model.dtype} cache (use model.dtype="
      "'bfloat16', or paged_attention 'gather' or 'auto')"
    )
  if r.correction != "none" and r.recompute_logprobs is not True:
    problems.append(
      f"rollout.correction={r.correction!r}: needs rollout.recompute_logprobs=True (it weighs "
      "the sampler's log-probs against the trainer's)"
    )
  if r.get("mode", "sync") == "async" and not r.staleness:
    problems.append(
      "rollout.mode='async' needs rollout.staleness >= 1: the rollout of iteration t + 1 is "
      "drawn while iteration t updates, so it cannot use that update's policy (set "
      "rollout.staleness=1, or rollout.mode='sync')"
    )
  mode = r.get("mode", "sync")
  if mode == "stream" and r.staleness:
    problems.append(
      f"rollout.mode='stream' with rollout.staleness={r.staleness}: a stream's lag is bounded by "
      "rollout.max_staleness, not fixed (set rollout.staleness=0)"
    )
  if mode == "stream" and r.get("engine", "auto") == "fixed":
    problems.append(
      "rollout.mode='stream' runs the continuous engine (it never drains), not fixed batches "
      "(set rollout.engine='continuous' or 'auto')"
    )
  lora = c.model.get("lora")
  if mode != "sync" and lora and lora.rank and not c.mesh.get("rollout_devices"):
    problems.append(
      f"rollout.mode={mode!r} with LoRA (model.lora.rank={lora.rank}) needs "
      "mesh.rollout_devices > 0: on a shared mesh each update donates the frozen base that the "
      "rollout beside it reads"
    )
  problems += _mesh_problems(c.mesh, "mesh")
  if c.mesh.get("rollout_devices"):
    problems += _mesh_problems(c.mesh.get("rollout", {}), "mesh.rollout")
  if isinstance(c.data.eval_path, str):
    try:
      envs.parse_eval_paths(c.data.eval_path)
    except errors.ConfigError as e:
      problems.append(str(e))
  return problems


def _check_relations(c: ml_collections.ConfigDict, *, evaluating: bool) -> None:
  """Relations between fields, each of them valid on its own: batch splits, the loss's needs,
  model and data together."""
  from gppo_jax.algorithm import objective
  from gppo_jax.data import tasks

  r, u = c.rollout, c.train
  n = r.prompts_per_iter * r.group_size
  if n % (u.minibatches * u.microbatches):
    raise errors.ConfigError(
      f"rollout.prompts_per_iter * rollout.group_size = {n} must be divisible by "
      f"train.minibatches * train.microbatches = {u.minibatches * u.microbatches}"
    )
  if u.shuffle == "groups" and r.prompts_per_iter % (u.minibatches * u.microbatches):
    raise errors.ConfigError(
      f"train.shuffle='groups' keeps groups whole: rollout.prompts_per_iter = "
      f"{r.prompts_per_iter} must be divisible by train.minibatches * train.microbatches = "
      f"{u.minibatches * u.microbatches} (or set train.shuffle='rows')"
    )
  if c.get("profile") and c.profile.start > c.iterations:
    raise errors.ConfigError(
      f"profile.start={c.profile.start} is past iterations={c.iterations}: nothing would be "
      "traced (iterations are numbered from 1; 0 = no profile)"
    )
  if r.refill_rounds and not c.advantage.filter_zero_signal:
    raise errors.ConfigError(
      f"rollout.refill_rounds={r.refill_rounds} refills the groups advantage.filter_zero_signal "
      "drops: set advantage.filter_zero_signal=True (DAPO's dynamic sampling) or refill_rounds=0"
    )
  if r.logprobs_mode == "sampled" and r.top_p < 1 and not r.top_k:
    raise errors.ConfigError(
      f"rollout.logprobs_mode='sampled' with rollout.top_p={r.top_p} needs rollout.top_k > 0: "
      "the update renormalises the policy over the set each token was drawn from, recorded as "
      "top_k ids per response token (top-p alone could keep the whole vocabulary); set e.g. "
      "rollout.top_k=64 (top-p then keeps part of the 64 most likely tokens), or use "
      "rollout.logprobs_mode='full'"
    )
  _check_eval_relations(c.eval)
  if c.loss.estimator == "topk" and not r.num_topk:
    raise errors.ConfigError("loss.estimator='topk' needs rollout.num_topk > 0 (e.g. 20)")
  if c.loss.get("ratio_level") == "sequence" and c.loss.estimator != "mc":
    raise errors.ConfigError("loss." + objective.sequence_estimator_problem(c.loss.estimator))
  if c.loss.estimator == "exact":
    raise errors.ConfigError(
      "loss.estimator='exact' is a diagnostic (estimators.estimate over the full vocabulary), "
      "not a trust region for training (use e.g. atomic)"
    )
  eval_only = evaluating and c.model.path is not None  # model.path on eval files, no training
  if eval_only and c.data.eval_path is None:
    raise errors.ConfigError("evaluating model.path needs data.eval_path (NAME=PATH,... or PATH)")
  if c.data.train_path is None and c.model.path is not None and not eval_only:
    raise errors.ConfigError(
      "model.path is set but data.train_path is not: a real model needs real data"
    )
  name = c.task.name
  if c.data.train_path is None and c.model.path is None and name in TASK_RUNS:
    longest = tasks.get(name).max_answer_len + 1
    if r.max_new_tokens < longest:
      raise errors.ConfigError(
        f"rollout.max_new_tokens={r.max_new_tokens} cuts task {name!r}'s responses (up to "
        f"{longest} tokens, the end token included): select the task with the config argument "
        f"task={name} (`--config=configs/base.py:task={name}`), which sets its run, or set "
        f"rollout.max_new_tokens={longest}"
      )
  if c.data.train_path is None and c.data.eval_path is not None and not eval_only:
    raise errors.ConfigError(
      "data.eval_path is set but data.train_path is not: the built-in task has its own eval set"
    )


# The grid's 12 cells by config-file name (configs/{divergence}_{estimator}.py).
GRID_CELLS: dict[str, tuple[str, str]] = {
  f"{d}_{e}": (d, e) for d in ("tv", "kl", "hellinger", "chi2") for e in ("mc", "binary", "atomic")
}


def model_overrides(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """The ModelConfig fields a config sets on any architecture or checkpoint folder."""
  m = c.model
  return dict(
    dtype=m.dtype,
    param_dtype=m.param_dtype,
    remat=m.get("remat", "auto"),
    attention=m.get("attention", "auto"),
    scan_layers=m.get("scan_layers", True),
    **lora_overrides(c),
    **({"moe_dispatch": m.moe.dispatch} if m.get("moe") is not None else {}),
  )


def lora_overrides(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """The ModelConfig LoRA fields of config model.lora (none for configs without the section)."""
  lora = c.model.get("lora")
  if lora is None:
    return {}
  return dict(
    lora_rank=int(lora.rank),
    lora_alpha=float(lora.alpha),
    lora_targets=lora.targets,
    lora_dropout=float(lora.dropout),
  )


def algorithm(name: str) -> presets.Preset:
  """A grid cell (`kl_atomic`, `tv_mc`, ...) or a named preset (`ppo`, `dapo`, `dppo`, ...): what
  the real-run configs' `cell=NAME` argument picks. UnknownNameError with a did-you-mean."""
  if name in GRID_CELLS:
    return presets.cell(*GRID_CELLS[name])
  if name in presets.names():
    return presets.get(name)
  choices = [*GRID_CELLS, *presets.names()]
  hint = errors.did_you_mean(name, choices)
  raise errors.UnknownNameError(
    f"unknown cell {name!r} in config argument cell=NAME{hint}; valid: {', '.join(choices)}",
    kind="cell",
    name=name,
    choices=choices,
  )


# Hardware variants of the real-run configs (configs/qwen25_math_7b.py, configs/qwen3_8b.py,
# configs/qwen25_coder_7b.py).
REAL_RUN_VARIANTS = {
  # v5p-64 = 32 chips (95 GiB HBM each): FSDP over all chips; ~8B fp32 master weights + Adam are
  # ~3 GiB per chip, leaving room for 1024 rollouts of several thousand tokens.
  "v5p64": dict(mesh=dict(data=1, fsdp=32, tensor=1), prompts=128, micro=1),
  # One host with 8 GPUs (H100 80 GiB / H200 141 GiB): FSDP over the 8 GPUs.
  "gpu8": dict(mesh=dict(data=1, fsdp=8, tensor=1), prompts=64, micro=4),
  # LoRA on small hardware (model.lora): rank-64 adapters on every projection, the frozen base in
  # bfloat16. One 8-chip v5e host (16 GiB HBM each, FSDP over the 8) or one 80 GiB GPU; fewer
  # rollouts per iteration, whose KV cache is then what limits them.
  "v5e8_lora": dict(mesh=dict(data=1, fsdp=8, tensor=1), prompts=16, micro=8, lora=64),
  "gpu1_lora": dict(mesh=dict(data=1, fsdp=1, tensor=1), prompts=16, micro=16, lora=64),
}
REAL_RUN_ARGS: dict[str, bool] = {**dict.fromkeys(REAL_RUN_VARIANTS, False), "cell": True}

# The default recipe's data (docs/guide.md "Data files"), where
# `python -m gppo_jax.prepare_data NAME --out /data/{train,eval}/NAME.jsonl` writes it.
# The paper's own benchmark list is not known to us.
DATA_ROOT = "/data"
REAL_RUN_DATA = {
  "math": dict(
    train="dapo_math_17k",
    eval=("math500", "aime24", "aime25", "amc23", "minerva_math", "olympiadbench"),
  ),
  "code": dict(train="taco", eval=("livecodebench", "humaneval_plus")),
}


def eval_path_spec(names, root: str = DATA_ROOT) -> str:
  """`data.eval_path` for prepared benchmarks: 'math500=/data/eval/math500.jsonl,...'."""
  return ",".join(f"{n}={root}/eval/{n}.jsonl" for n in names)


def real_run(
  arg: str | None,
  *,
  preset: str,
  path: str,
  max_prompt_tokens: int,
  max_new_tokens: int,
  kind: str = "math",
) -> ml_collections.ConfigDict:
  """GPPO on a local Hugging Face checkpoint with real data (`kind` math or code), for a TPU
  v5p-64 slice or an 8-GPU host. `arg`: the hardware variant (v5p64 | gpu8; default v5p64), the
  algorithm `cell=NAME` (a grid cell or a preset, default kl_atomic: `algorithm`), and `smoke`."""
  args = parse_arg(arg, {**BASE_ARGS, **REAL_RUN_ARGS})
  names = [k for k in args if k in REAL_RUN_VARIANTS] or ["v5p64"]
  if len(names) > 1:
    raise errors.ConfigError(
      f"pick one hardware variant, got {names} in {arg!r}; valid: {', '.join(REAL_RUN_VARIANTS)}"
    )
  if kind not in REAL_RUN_DATA:
    raise errors.ConfigError(f"real_run kind={kind!r}; valid: {', '.join(REAL_RUN_DATA)}")
  v = REAL_RUN_VARIANTS[names[0]]
  c = use_settings(base(arg, extra_args=REAL_RUN_ARGS), algorithm(args.get("cell", "kl_atomic")))
  c.model.preset = preset  # same shapes; used by gppo_jax.plan when model.path is absent
  c.model.path = path
  c.model.dtype = "bfloat16"  # compute; master weights and Adam moments stay float32
  c.model.param_dtype = "float32"
  c.model.export_hf = True
  c.warmstart.enabled = False
  data = REAL_RUN_DATA[kind]
  c.data.train_path = f"{DATA_ROOT}/train/{data['train']}.jsonl"
  c.data.eval_path = eval_path_spec(data["eval"])
  c.data.kind = kind
  c.data.max_prompt_tokens = max_prompt_tokens
  c.data.verifier_workers = 16
  # The prompts ask for \boxed{} (data.instruction None; prepare_data strips DAPO-Math-17k's
  # `Answer:` wrapper), like every evaluation set; DAPO's own format: answer_format="answer_line".
  c.reward.answer_format = "boxed"
  c.rollout.prompts_per_iter = v["prompts"]
  c.rollout.group_size = 8
  c.rollout.max_new_tokens = max_new_tokens
  c.rollout.temperature = 1.0
  c.train.epochs = 1
  c.train.minibatches = 8  # mini-batches after the first are off-policy: the trust region acts
  c.train.microbatches = v["micro"]
  # Single rows: a micro-batch here holds fewer groups than the mesh has data x fsdp devices, and
  # the shared-prompt update packs a group into one row (train.shuffle "groups" would leave
  # devices idle); a prompt is also a small share of these sequences.
  c.train.shuffle = "rows"
  c.train.trim_bucket = 0
  c.optim.lr = 1e-6
  if v.get("lora"):
    c.model.lora.rank = v["lora"]
    c.model.lora.alpha = 2.0 * v["lora"]
    c.model.param_dtype = "bfloat16"  # the frozen base; the adapters stay float32
    c.optim.lr = 1e-5  # adapters take larger steps than full fine-tuning
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.iterations = 500
  # Periodic evaluation: avg@4 and pass@4 per benchmark at T 0.6, top-p 0.95 (about 15% of the
  # run's generation for the math sets). The paper-grade protocol (n = 16, three seeds) is the
  # evaluate command's job: docs/guide.md "Evaluation".
  c.eval.every = 50
  c.eval.n = 4
  c.eval.k = (1, 4)
  c.eval.temperature = 0.6
  c.eval.top_p = 0.95
  c.eval.batch_size = v["prompts"] * c.rollout.group_size  # what a rollout samples at once
  c.checkpoint.every = 25
  c.checkpoint.keep = 2
  c.diagnostics.every = 20  # two extra forward passes over the rollout batch
  for axis, size in v["mesh"].items():
    c.mesh[axis] = size
  if "smoke" in args:  # keep the real model, shrink everything else
    c.rollout.max_new_tokens = 64
    c.eval.num_problems = 16
    c.eval.n = 2
    c.eval.k = (1, 2)
    c.train.microbatches = 1
  return c
