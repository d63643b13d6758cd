"""What a training run and an evaluation both set up: the workdir, the policy and its state.

  workdir:  default_workdir, split_workdir (local logs vs. checkpoint storage), WorkdirLock,
            read_run_config (the config.json a run saved)
  policy:   build_policy (built-in task + tiny warm-started policy, or a Hugging Face folder)
  state:    init_state (TrainState on the mesh), abstract_state (its shapes, for restores)
  sampling: sampling_params (the rollout's decoding settings)
  commands: quiet_libraries (console logging), use_compilation_cache (compiled programs on disk),
            keep_cpu_memory (no fresh pages for every step's scratch on CPU)

Nothing here trains or evaluates; train.py and evaluate.py compose these.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gppo_jax import config_lib
from gppo_jax.data import envs
from gppo_jax.errors import ConfigError, MissingFileError, UserError
from gppo_jax.generation import continuous, sampler
from gppo_jax.models import architectures, sharding
from gppo_jax.models import lora as lora_lib
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import policy_eval, train_step

log = logging.getLogger("gppo_jax")

LOCK_NAME = "lock"
# The commands' persistent compilation cache: a folder, or "off" (use_compilation_cache).
XLA_CACHE_ENV = "GPPO_XLA_CACHE"
XLA_CACHE_DEFAULT = "~/.cache/gppo_jax/xla"
# How the commands treat host memory on a CPU backend (keep_cpu_memory): "keep" or "release".
CPU_MEMORY_ENV = "GPPO_CPU_MEMORY"
CPU_MEMORY_CHOICES = ("keep", "release")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


# --- Workdir ------------------------------------------------------------------------------------


def default_workdir(config_path: str | None) -> str:
  """./workdirs/<config file name>[_<arg>] for `--config=configs/kl_atomic.py[:arg]`."""
  name = "run"
  if config_path:
    path, _, arg = str(config_path).partition(":")
    name = os.path.splitext(os.path.basename(path))[0] + (f"_{arg}" if arg else "")
  return os.path.join("workdirs", name.replace(",", "_").replace("=", "-"))


def split_workdir(workdir: str) -> tuple[str, str]:
  """(local folder for logs and summaries, checkpoint directory) of a workdir.

  A local path holds both. A storage URL (gs://bucket/run, shared by every host of a slice) holds
  the checkpoints; logs then go to ./workdirs/<run name> on each host.
  """
  if "://" in workdir:
    return os.path.abspath(os.path.join("workdirs", workdir.rstrip("/").rsplit("/", 1)[-1])), (
      workdir.rstrip("/") + "/checkpoints"
    )
  local = os.path.abspath(os.path.expanduser(workdir))
  return local, os.path.join(local, "checkpoints")


RUN_CONFIG = "config.json"  # the resolved config, written by train at the start of every run


def read_run_config(workdir: str):
  """The config a training run saved in its workdir (RUN_CONFIG, in split_workdir's local
  folder), as a ConfigDict: what `python -m gppo_jax.evaluate --workdir=RUN` evaluates with when
  no --config is given."""
  path = os.path.join(split_workdir(workdir)[0], RUN_CONFIG)
  if not os.path.isfile(path):
    raise MissingFileError(
      f"--workdir={workdir!r} has no {RUN_CONFIG} ({path}), which train writes when a run "
      "starts: give the run's config file with --config=CONFIG_FILE"
    )
  try:
    with open(path) as f:
      saved = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise ConfigError(f"{path}: not a config written by train ({e})") from None
  try:
    return config_lib.from_saved(saved)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None


class WorkdirBusyError(UserError):
  """Another live process holds the workdir."""


class WorkdirLock:
  """An exclusive lock on a run's local folder, held for the life of a training run.

  `<workdir>/lock` records the owner's pid, host and command. The lock itself is an OS file lock
  (flock), which the kernel drops when its process dies however it dies, so a lock file left by a
  crashed or killed run is stale by construction: it is taken over with a warning naming the old
  owner. A second live trainer on the same folder gets `WorkdirBusyError`.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_NAME)
    self._fd: int | None = None

  def acquire(self) -> WorkdirLock:
    import fcntl

    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      owner = _read_owner(fd)
      os.close(fd)
      raise WorkdirBusyError(
        f"workdir {os.path.dirname(self.path)} is in use by {owner}; wait for that run to end, "
        "stop it, or pass another --workdir"
      ) from None
    old = _read_owner(fd)
    if old != "an unknown process":
      log.warning("taking over the stale lock of %s (that process is gone)", old)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    owner = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "since": time.time(),
      "command": " ".join(sys.argv),
    }
    os.write(fd, json.dumps(owner).encode())
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    with contextlib.suppress(OSError):
      os.ftruncate(self._fd, 0)  # an empty lock file: nobody to warn about next time
    os.close(self._fd)  # drops the flock
    self._fd = None

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _read_owner(fd: int) -> str:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    info = json.loads(os.read(fd, 4096).decode() or "{}")
    return f"pid {info['pid']} on host {info['host']} ({info.get('command', '?')})"
  except (OSError, ValueError, KeyError, TypeError):
    return "an unknown process"


# --- Policy -------------------------------------------------------------------------------------


def check_inputs(config) -> None:
  """What a run reads can be read: data files come with model.path (its tokenizer renders
  them), and the model folder and data files the config names exist (storage URLs are not
  checked here). Called by train and evaluate after `config_lib.validate` and before anything
  is written, so a typo in a path fails in a second, not after a 7B model has loaded.
  (`validate` allows data files without a model: `plan` sizes an update from them.)"""
  if config.data.train_path is not None and config.model.path is None:
    raise ConfigError(
      "data.train_path is set but model.path is not: data files need the model's tokenizer"
    )
  paths = [("model.path", config.model.path, os.path.isdir)]
  paths.append(("data.train_path", config.data.train_path, os.path.exists))
  if config.data.eval_path:
    paths += [
      (f"data.eval_path ({name})", path, os.path.exists)
      for name, path in envs.parse_eval_paths(config.data.eval_path)
    ]
  for field, path, exists in paths:
    if path is not None and "://" not in path and not exists(os.path.expanduser(path)):
      what = "folder" if exists is os.path.isdir else "file"
      raise MissingFileError(f"{field}={path!r}: no such {what}")


def build_policy(config, say=print, mesh=None, *, warm_start: bool = True):
  """(graphdef, params, model_cfg, env, info) for the config: built-in task or HF folder + data.

  With `mesh`, Hugging Face weights go straight to their sharded layout as they are read. With
  `warm_start=False` the built-in policy keeps its random init (a restore replaces it anyway),
  except with LoRA, whose frozen base a restore does not replace."""
  overrides = config_lib.model_overrides(config)
  if config.model.path is not None:
    from gppo_jax.models import hf_checkpoint

    model, tokenizer = hf_checkpoint.load_pretrained(
      config.model.path, mesh=mesh, lora_seed=config.seed, **overrides
    )
    env = envs.make_env(config, tokenizer)
    graphdef, params = nnx.split(model)
    _say_lora(model.cfg, params, say)
    return graphdef, params, model.cfg, env, {}
  env = envs.make_env(config)
  tok = env.tokenizer
  # The built-in policy's vocabulary is exactly the task's characters.
  cfg = architectures.get(
    config.model.preset,
    vocab_size=tok.vocab_size,
    bos_token_id=tok.bos_id,
    eos_token_ids=tok.eos_ids,
    pad_token_id=tok.pad_id,
    **overrides,
  )
  # The initial policy's seed (init and warm start); None = config.seed. Fixing it while seed
  # varies repeats RL from one starting policy (`python -m gppo_jax.sweep --start shared` does).
  init_seed = config.warmstart.get("seed")
  init_seed = config.seed if init_seed is None else int(init_seed)
  # With LoRA the base model is built and warm-started alone (the warm start trains all of it,
  # and its cache is shared with full fine-tuning runs); the adapters are added afterwards.
  base_cfg = cfg.without_lora()
  model = model_lib.create(base_cfg, init_seed)
  graphdef, params = nnx.split(model)
  say(f"policy: architecture {config.model.preset!r}, {model_lib.param_count(model):,} parameters")
  info = {}
  # LoRA's base is in no checkpoint: a restore replaces only the adapters, so the base is always
  # warm-started (from the warm start's cache after the first time).
  if config.warmstart.enabled and (warm_start or cfg.lora_rank):
    from gppo_jax.trainer import warmstart

    params, info = warmstart.warm_start(
      graphdef, params, env, base_cfg, config.warmstart, seed=init_seed, log=say
    )
  if cfg.lora_rank:
    graphdef, params = model_lib.with_lora(cfg, params, config.seed)
    _say_lora(cfg, params, say)
  return graphdef, params, cfg, env, info


def _say_lora(cfg, params, say) -> None:
  if cfg.lora_rank:
    adapters, _ = lora_lib.split_lora(params)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    say(
      f"LoRA: rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g} on {', '.join(cfg.lora_weights)}: "
      f"{count(adapters):,} trained of {count(params):,} parameters"
    )


def sampling_params(config, env, *, stop_ids, pad_id) -> sampler.SamplingParams:
  """Rollout sampling settings; responses never exceed what the environment can score."""
  r = config.rollout
  return sampler.SamplingParams(
    max_new_tokens=min(r.max_new_tokens, env.max_new_tokens),
    temperature=r.temperature,
    top_p=r.top_p,
    top_k=r.top_k,
    stop_ids=tuple(stop_ids),
    pad_id=pad_id,
    num_topk=r.num_topk,
    logprobs_mode=train_step.LOGPROBS_MODES[r.get("logprobs_mode", "full")],
    record_experts=bool(r.get("routing_replay", False)),
  )


def evaluate(
  config, graphdef, params, env, *, max_new_tokens: int, sample_fn, report: bool = False
):
  """The config's evaluation protocol (config.eval: `policy_eval.EvalSettings.from_config`) of
  `params` on env's held-out set: the trainer's periodic evals and the evaluate command score
  alike. max_new_tokens: the rollout's response length (eval.max_new_tokens=None uses it).

  Returns the flat metrics the trainer logs, or with `report=True` the `pass_at_k.EvalReport`
  (None without eval prompts)."""
  settings = policy_eval.EvalSettings.from_config(
    config.eval, max_new_tokens=max_new_tokens, run_seed=config.seed
  )
  result = policy_eval.evaluate_benchmarks(graphdef, params, env, settings, sample_fn=sample_fn)
  if report:
    return result
  return {} if result is None else result.metrics()


# --- State --------------------------------------------------------------------------------------


def _fresh_state(params, tx) -> train_step.TrainState:
  """The TrainState of a policy state: with LoRA adapters (`lora.split_lora`) only they
  are trained and get optimizer state; the base is kept frozen beside them."""
  params, frozen = lora_lib.split_lora(params)
  return train_step.TrainState(
    params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32), frozen=frozen
  )


def init_state(params, tx, mesh) -> tuple[Any, train_step.TrainState]:
  """(state shardings, TrainState on the mesh) with fresh optimizer state for `params`.

  The optimizer state is created in place beside the parameters: a policy whose Adam moments do
  not fit on one device never lands on one."""
  state_sh = sharding.state_shardings(jax.eval_shape(lambda p: _fresh_state(p, tx), params), mesh)
  params = jax.device_put(params, state_sh.policy())
  return state_sh, _jit_init(tx, state_sh)(params)


@sharding.reuse
def _jit_init(tx, state_sh) -> Any:
  return jax.jit(lambda p: _fresh_state(p, tx), out_shardings=state_sh, donate_argnums=0)


def abstract_state(params, tx, mesh) -> Any:
  """The shapes, dtypes and mesh shardings of what a checkpoint of a TrainState of `params`
  holds (`TrainState.saved`): what a checkpoint restore needs."""
  state = jax.eval_shape(lambda p: _fresh_state(p, tx), params)
  return sharding.abstract_like(state.saved(), sharding.state_shardings(state, mesh).saved())


def quiet_libraries(flag_values) -> None:
  """Console logging of a command: gppo_jax's own messages as plain lines on stderr (process 0;
  INFO, or DEBUG under --verbosity >= 1), other libraries' (Orbax and JAX log every checkpoint
  step at INFO) at WARNING and up unless --verbosity is given.

  absl rewrites an unset --verbosity to INFO once flags are parsed, so `present` (given on the
  command line), not `using_default_value`, says whether the user asked for a level.
  """
  from absl import logging as absl_logging

  verbosity = flag_values["verbosity"]
  if not verbosity.present:
    absl_logging.set_verbosity(absl_logging.WARNING)
  if not any(getattr(h, "_gppo_console", False) for h in log.handlers):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._gppo_console = True
    log.addHandler(handler)
  log.propagate = False  # not a second time through absl's handler
  if jax.process_index() != 0:
    log.setLevel(logging.WARNING)
  else:
    log.setLevel(logging.DEBUG if verbosity.present and verbosity.value >= 1 else logging.INFO)


def use_compilation_cache() -> str | None:
  """Turns on JAX's persistent compilation cache for this process; returns its folder or None.

  Programs that take at least a second to compile (the update, the sampler, the warm-start and
  evaluation steps) are kept on disk, keyed by the program, the JAX version and the compile
  options, so a second run of the same shapes (a resume, another seed or cell of a sweep, the
  evaluate command after training) loads them instead of compiling again. The folder is
  $GPPO_XLA_CACHE (default ~/.cache/gppo_jax/xla, at most 2 GiB, least recently used entries
  dropped first); GPPO_XLA_CACHE=off turns it off. A cache the user configured through JAX itself
  (JAX_COMPILATION_CACHE_DIR) is left as it is.
  """
  configured = jax.config.jax_compilation_cache_dir
  if configured:
    return configured
  choice = config_lib.cache_folder(XLA_CACHE_ENV, XLA_CACHE_DEFAULT)
  if not choice:
    return None
  path = choice if "://" in choice else os.path.abspath(os.path.expanduser(choice))
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  if jax.config.jax_compilation_cache_max_size < 0:  # unbounded: bound the user's disk use
    jax.config.update("jax_compilation_cache_max_size", 2 << 30)
  return path


def keep_cpu_memory() -> bool:
  """On a CPU backend with glibc: each compiled program's scratch memory is reused from call to
  call instead of mapped afresh; True when set up so, False where nothing was changed.

  XLA's CPU runtime allocates one scratch buffer per call of a program, as large as the
  program's temporaries. By default the call runs on a worker thread, whose malloc arena cannot
  hold more than 64 MiB, and glibc maps a block that large with mmap and unmaps it when freed:
  every call then page-faults its whole scratch in again (tens of thousands of faults, system
  time on every step). Here the calls run on the calling thread (synchronous dispatch; the
  trainer waits for each result anyway) and glibc serves large blocks from its main heap and
  keeps freed memory for reuse (mallopt M_MMAP_MAX = 0, M_TRIM_THRESHOLD = 2^31 - 1). The price:
  freed memory stays with the process (up to 2 GiB of it at the heap's top) instead of going
  back to the system.

  Process-wide, so only the commands call it (train, evaluate, benchmarks/train_step.py,
  sampler.py and iteration.py), first thing, before any JAX backend exists.
  $GPPO_CPU_MEMORY=release leaves glibc's and JAX's defaults. Nothing changes on GPU or TPU
  backends, or where the C library is not glibc.
  Earns its place: benchmarks/train_step.py tiny shape ~1.4x against "release".
  """
  choice = os.environ.get(CPU_MEMORY_ENV, "keep").strip().lower() or "keep"
  if choice not in CPU_MEMORY_CHOICES:
    raise UserError(
      f"{CPU_MEMORY_ENV}={os.environ[CPU_MEMORY_ENV]!r}; valid: {', '.join(CPU_MEMORY_CHOICES)}"
    )
  libc = _glibc()
  if choice == "release" or libc is None:
    return False
  # Read when JAX creates its CPU client, so it must come first; harmless if it never does.
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  # Finding the backend starts JAX's, before quiet_libraries: keep its INFO lines about absent
  # plugins ("Unable to initialize backend 'tpu'") off the console, as the commands do.
  bridge = logging.getLogger("jax._src.xla_bridge")
  level = bridge.level
  bridge.setLevel(max(level, logging.WARNING))
  try:
    platform = jax.default_backend()
  finally:
    bridge.setLevel(level)
  if platform != "cpu":
    return False
  ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
  ok = libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1 and ok
  if not ok:
    log.warning("%s: glibc's mallopt refused the settings; its defaults stay", CPU_MEMORY_ENV)
  return ok


def _glibc():
  """The process's glibc (ctypes), or None under another C library (macOS, musl)."""
  import ctypes
  import platform

  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return None
  try:
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None
  except OSError:
    return None


def sample_fn(config, graphdef, param_shardings, mesh):
  """The sampler of rollouts and evaluations (`rollout.engine`): the fixed-batch `MeshSampler`,
  or continuous batching on the mesh's batch shards; "auto" picks continuous batching from
  `continuous.AUTO_MIN_NEW_TOKENS` new tokens on (`continuous.engine_for`)."""
  r = config.rollout
  if continuous.engine_for(r.get("engine", "auto"), r.max_new_tokens) == "fixed":
    return sampler.MeshSampler(graphdef, param_shardings)
  return continuous.EngineSampler(graphdef, engine_config(config, mesh), mesh)


def engine_config(config, mesh) -> continuous.EngineConfig:
  """The continuous engine's settings (`rollout.*`) on the mesh's batch shards; rollout.slots 0:
  a slot for every row of a rollout."""
  r = config.rollout
  shards = sharding.batch_shards(mesh)
  by_memory = bool(r.get("kv_memory_gib") or r.get("kv_memory_fraction"))
  # A multi-host run's sampler on this process's own devices samples its share of the prompts
  # (`async_rollout.HostShare`).
  prompts = r.prompts_per_iter
  if jax.process_count() > 1 and not sharding.spans_processes(mesh):
    prompts = -(-prompts // jax.process_count())
  # 0: every row of a rollout, or with the pool given by memory as many as it holds (each call's
  # `continuous.EngineSampler.slots_for`).
  slots = r.slots or (0 if by_memory else -(-prompts * r.group_size // shards) * shards)
  if slots % shards:
    raise ConfigError(
      f"rollout.slots={slots} must be a multiple of the mesh's {shards} batch shards "
      f"({dict(mesh.shape)}): each shard decodes its own share of the slots"
    )
  return continuous.EngineConfig(
    slots=slots, page_size=r.page_size, num_pages=r.kv_pages or None, chunk=r.decode_chunk,
    attention=r.get("paged_attention", "auto"), kv_memory_gib=r.get("kv_memory_gib") or None,
    kv_memory_fraction=r.get("kv_memory_fraction") or None,
  )  # fmt: skip
