"""GPPO training: the main entry point.

  python -m gppo_jax.train --config=configs/kl_atomic.py [--workdir=DIR] [--config.loss.delta=...]

Each iteration samples prompts, generates `group_size` responses per prompt with the KV-cached
sampler (keeping the behaviour log-probs), scores them, computes group-relative advantages and runs
one jitted update of epochs x mini-batches over that rollout batch (updates after the first are
off-policy: that is where the trust region acts). The Python loop only logs, evaluates and saves.

Rerunning the same command resumes from the newest readable checkpoint, replaying exactly what an
uninterrupted run would have done. SIGTERM or Ctrl-C stops the run at the next iteration boundary
with a checkpoint of the iterations completed (trainer/interrupts.py); a non-finite state is never
saved; one trainer at a time holds a workdir (experiment.WorkdirLock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from gppo_jax import config_lib, errors, files
from gppo_jax.algorithm import correction
from gppo_jax.generation import continuous, sampler, stream
from gppo_jax.models import partitioning, sharding
from gppo_jax.research import diagnostics
from gppo_jax.trainer import (
  async_rollout,
  checkpointing,
  experiment,
  interrupts,
  metric_writers,
  rollout,
  stream_rollout,
  train_step,
)

log = logging.getLogger("gppo_jax")


# --- Checks -------------------------------------------------------------------------------------


@jax.jit
def _all_finite(*trees) -> list[jax.Array]:
  """For each tree: whether every float leaf is finite (one dispatch and one transfer for all)."""
  out = []
  for tree in trees:
    leaves = jax.tree.leaves(tree)
    ok = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    out.append(jnp.all(jnp.stack(ok)) if ok else jnp.bool_(True))
  return out


class NonFiniteError(FloatingPointError):
  """The update produced NaN or inf; the state of that iteration was not saved."""


def check_finite(state, metrics: dict[str, float], adv: np.ndarray, *, iteration: int, newest: Any):
  """Raises NonFiniteError naming what went non-finite and the likely cause, before any save."""
  bad = [
    k for k in ("loss/total", "optim/grad_norm") if k in metrics and not np.isfinite(metrics[k])
  ]
  params_ok, opt_ok = jax.device_get(_all_finite(state.params, state.opt_state))
  bad += [name for name, ok in (("parameters", params_ok), ("optimizer state", opt_ok)) if not ok]
  if not bad:
    return
  if not np.all(np.isfinite(adv)):
    cause = "the advantages are non-finite: check the reward values and advantage.eps (> 0)"
  else:
    cause = "the update diverged from finite inputs: lower optim.lr or set optim.grad_clip"
  kept = f"the newest checkpoint is step {newest}" if newest is not None else "no checkpoint exists"
  raise NonFiniteError(
    f"non-finite {', '.join(bad)} after iteration {iteration}; this iteration was not saved and "
    f"{kept}. Likely cause: {cause}"
  )


# --- The loop -----------------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains per `config`, writing logs, checkpoints and a summary into `workdir`.

  Returns the summary; `summary["preempted"]` is True when a stop signal ended the run early
  (its checkpoint holds `summary["iterations_done"]` iterations; rerun to resume)."""
  config_lib.validate(config)  # every shape and range check, before any file or model work
  experiment.check_inputs(config)
  if metric_writers.WandbOptions.from_config(config) and jax.process_index() == 0:
    metric_writers.import_wandb()  # a missing package fails now, not after the warm start
  log_dir, checkpoint_dir = experiment.split_workdir(workdir)
  with contextlib.ExitStack() as stack:
    if jax.process_index() == 0:
      stack.enter_context(experiment.WorkdirLock(log_dir))
    signals = stack.enter_context(interrupts.StopSignals())
    try:
      return _train(config, log_dir, checkpoint_dir, signals, stack)
    except interrupts.Interrupted as e:
      print(f"{e.signame} during set-up: nothing new to save", file=sys.stderr, flush=True)
      return {"workdir": log_dir, "preempted": True, "iterations_done": None}


@dataclasses.dataclass
class Run:
  """Everything one training run holds fixed: the policy's structure, the environment, the
  compiled sampler, update and log-prob passes, the checkpoint manager. Built by `_set_up`."""

  config: ml_collections.ConfigDict
  workdir: str
  mngr: Any  # orbax CheckpointManager
  mesh: Any  # the trainer's
  sampler_mesh: Any  # the sampler's: `mesh` itself unless mesh.rollout_devices > 0
  graphdef: Any
  env: Any
  sampling: sampler.SamplingParams
  spec: train_step.UpdateSpec
  sample_fn: sampler.MeshSampler  # rollouts and evaluations, on the sampler's mesh
  param_sync: async_rollout.ParamSync  # the trainer's parameters -> the sampler's policy
  update: Callable  # sharded jit of train_step.make_update_fn
  logprobs: Callable  # sharded jit of train_step.make_logprob_fn
  state_sh: Any  # the TrainState's shardings
  # The KL penalty's reference: the frozen initial policy, with LoRA the base with the adapters
  # off (zero adapters beside the frozen base: no second copy of its weights); or None.
  ref_params: Any
  diagnose: Callable | None  # diagnostics.make_diagnostics_fn, when diagnostics.every > 0
  rows: slice  # this host's rows of the global batch
  newest: int | None = None  # the newest checkpoint on disk
  history: dict = dataclasses.field(default_factory=dict)  # evaluations, kept in checkpoints
  # rollout.staleness = k > 0: the parameters before each of the last k updates, oldest first;
  # iteration t samples with the oldest (theta_{t-k}, theta_0 while t < k). Saved in checkpoints.
  behaviour: list = dataclasses.field(default_factory=list)
  # probe(spec) -> jit(state, batch, rng, radii) -> the update's metrics at radii
  # (delta_low, delta_high) given as an argument, the state not donated (_jit_first_update).
  probe: Callable | None = None
  # rollout.mode="async": the rollout of the next iteration, drawn during this one's update.
  ahead: async_rollout.Ahead | None = None
  # rollout.mode="stream": finished groups from an engine that never drains.
  stream: stream_rollout.Stream | None = None

  @functools.cached_property
  def seed_key(self) -> jax.Array:
    return jax.random.PRNGKey(self.config.seed)  # eagerly: seeds may exceed int32

  def keys(self, iteration: int) -> tuple[jax.Array, jax.Array]:
    """The iteration's (rollout, update) random keys: fold_in(fold_in(PRNGKey(seed), t), 0 / 1)."""
    return _iteration_keys(self.seed_key, iteration)

  def evaluate(self, params, frozen) -> dict[str, float]:
    """The evaluation of the trainable `params` (state.params, beside LoRA's frozen base
    state.frozen), on the sampler's devices."""
    if self.ahead is not None:
      self.ahead.wait()  # the sampler serves one caller at a time
    # A stream holds still meanwhile: the environment scores one caller's responses at a time.
    with self.stream.paused() if self.stream is not None else contextlib.nullcontext():
      return experiment.evaluate(
        self.config,
        self.graphdef,
        self.param_sync(params, frozen, version=-1).policy,
        self.env,
        max_new_tokens=self.sampling.max_new_tokens,
        sample_fn=self.sample_fn,
      )

  def to_devices(self, batch: train_step.Batch) -> train_step.Batch:
    return sharding.shard_batch(jax.tree.map(lambda x: x[self.rows], batch), self.mesh)

  def save(self, iteration: int, state, *, wait: bool = False) -> None:
    meta = {"iteration": iteration}
    if self.stream is not None:  # the draws with prompts not yet taken, and what was taken
      meta["stream"] = self.stream.state()
      meta["env"] = meta["stream"].pop("env")  # (the stream's thread draws from the env)
    else:
      # With a rollout in flight, the environment's state before it drew: a resume redraws it.
      meta["env"] = (self.ahead and self.ahead.env_state()) or self.env.state()
    meta.update(history=self.history, config=self.config.to_json_best_effort())
    extras = {"behaviour": self.behaviour} if self.behaviour else None
    # Without LoRA's frozen base: it is rebuilt from model.path or the warm start.
    checkpointing.save(self.mngr, iteration, state.saved(), meta, wait=wait, extras=extras)
    self.newest = iteration


def _set_up(
  config, workdir: str | None, checkpoint_dir: str | None, stack: contextlib.ExitStack
) -> tuple[Run, Any]:
  """The run and its initial state: checkpoints first (a resume skips the warm start), then the
  policy, the environment, the optimizer and the compiled functions, on the configured mesh.
  checkpoint_dir None: no checkpoint manager (run.mngr None), a fresh start."""
  mngr = None  # no checkpoint_dir: nothing is saved or restored (first_update)
  if checkpoint_dir is not None:
    mngr = checkpointing.make_manager(checkpoint_dir, max_to_keep=config.checkpoint.keep)
    stack.callback(mngr.close)  # every exit path lets pending writes complete
  resuming = mngr is not None and mngr.latest_step() is not None
  mode = config.rollout.get("mode", "sync")
  if jax.process_count() > 1 and mode == "stream":
    raise errors.ConfigError(
      "rollout.mode='stream' runs on one process for now: each host's stream would hand its "
      "update other groups at other times (on a multi-host run use rollout.mode='async' with "
      "mesh.rollout_devices > 0)"
    )
  if jax.process_count() > 1 and mode == "async" and not config.mesh.get("rollout_devices"):
    raise errors.ConfigError(
      f"rollout.mode='async' on {jax.process_count()} processes needs mesh.rollout_devices > 0: "
      "a rollout on the trainer's mesh would run its collectives beside the update's, in an "
      "order that may differ from host to host; with sampling devices of its own each host "
      "samples its share alone"
    )
  mesh, sampler_mesh = sharding.make_meshes(config.mesh)
  # The KL penalty's reference is the initial policy, so a resume rebuilds it (deterministically).
  need_init = not resuming or config.loss.kl_coef > 0
  graphdef, init_params, model_cfg, env, warm_info = experiment.build_policy(
    config, log.info, mesh=mesh, warm_start=need_init
  )
  stack.callback(env.close)
  tx = train_step.optimizer_from_config(config)
  state_sh, state = experiment.init_state(init_params, tx, mesh)
  sampling = experiment.sampling_params(
    config, env, stop_ids=tuple(model_cfg.eos_token_ids), pad_id=model_cfg.pad_token_id
  )
  spec = train_step.update_spec_from_config(
    config, env.max_prompt_len, sampling.max_new_tokens, model_cfg
  )
  sharding.check_experts(model_cfg, mesh.shape)
  if sampler_mesh is not mesh:
    sharding.check_experts(model_cfg, sampler_mesh.shape)
  # The batch's structure (which optional fields it carries) fixes the compiled functions.
  r = config.rollout
  batch = train_step.abstract_batch(
    r.prompts_per_iter * r.group_size, spec.prompt_len, sampling.max_new_tokens, spec,
    sampling.num_topk,
  )  # fmt: skip
  batch_sh = sharding.batch_shardings(batch, mesh)
  options = sharding.update_compiler_options(
    config.model.get("cpu_matmul", "auto"), model_cfg.hidden_size, mesh.devices.flat[0].platform
  )
  update = _jit_update(graphdef, tx, spec, state_sh, batch_sh, options)
  probe = functools.partial(_jit_first_update, graphdef, tx, state_sh=state_sh, batch_sh=batch_sh)
  _check_group_split(config, spec, mesh)
  split = sampler_mesh is not mesh
  sampler_sh = state_sh.policy()
  if split:
    sampler_sh = partitioning.state_shardings(state.policy(), sampler_mesh)
  sample_fn = experiment.sample_fn(config, graphdef, sampler_sh, sampler_mesh)
  # The continuous engine casts the policy to the compute dtype anyway: move it cast.
  dtype = model_cfg.compute_dtype if isinstance(sample_fn, continuous.EngineSampler) else None
  if split and jax.process_count() > 1:  # each host samples its share on its own devices
    sample_fn = async_rollout.HostShare(sample_fn)
  run = Run(
    config=config,
    workdir=workdir,
    mngr=mngr,
    mesh=mesh,
    sampler_mesh=sampler_mesh,
    graphdef=graphdef,
    env=env,
    sampling=sampling,
    spec=spec,
    sample_fn=sample_fn,
    param_sync=async_rollout.ParamSync(state, sampler_mesh if split else None, dtype),
    update=update,
    logprobs=_jit_logprobs(graphdef, spec, state_sh.policy(), batch_sh),
    state_sh=state_sh,
    ref_params=_reference(state) if spec.use_ref_logp else None,
    rows=sharding.process_rows(r.prompts_per_iter * r.group_size, mesh),
    diagnose=_diagnostics_fn(config, graphdef, spec),
    history={"warm_start": warm_info},
    probe=functools.partial(probe, compiler_options=options),
  )
  if r.staleness:  # one copy of the initial policy stands for theta_{t-k}, t < k
    run.behaviour = [jax.tree.map(jnp.copy, state.params)] * r.staleness
  if r.get("mode", "sync") == "async":
    run.ahead = async_rollout.Ahead()
    stack.callback(run.ahead.close)  # before the environment closes: the rollout scores in it
  if r.get("mode", "sync") == "stream":
    run.stream = _stream(run)
    stack.callback(run.stream.close)  # before the environment closes: the stream scores in it
  return run, state


def _stream(run: Run) -> stream_rollout.Stream:
  """The rollout stream of rollout.mode="stream", on the sampler's devices (not started)."""
  config = run.config
  engine = stream.StreamEngine(
    run.graphdef,
    run.sampling,
    experiment.engine_config(config, run.sampler_mesh),
    group_size=config.rollout.group_size,
    # Places for the prompts outstanding and those whose groups are being handed out.
    capacity=2 * stream_rollout.capacity(config),
    prompt_len=run.spec.prompt_len,
    key=jax.random.fold_in(run.seed_key, stream_rollout.STREAM_KEY),
    mesh=run.sampler_mesh,
  )
  return stream_rollout.Stream(
    config, run.env, engine, run.sampling, prompt_len=run.spec.prompt_len,
    pad_id=run.sampling.pad_id, use_topk=run.spec.use_topk, device=_sampler_device(run),
  )  # fmt: skip


def _publish(run: Run, state, version: int) -> None:
  """The policy after `version` updates, to the stream's engine: moved to the sampler's devices,
  or on a shared mesh a copy (the next update donates the state's own buffers)."""
  params = state.params
  if not run.param_sync.split:
    params = jax.tree.map(jnp.copy, params)
  run.stream.publish(run.param_sync(params, state.frozen, version=version).policy, version)


def _reference(state: train_step.TrainState) -> Any:
  """The KL reference's parameters: a copy of the initial policy (the update donates the state's
  buffers), or with LoRA zero adapters, to be merged with the frozen base when used."""
  if state.frozen is None:
    return jax.tree.map(jnp.copy, state.params)
  return jax.tree.map(jnp.zeros_like, state.params)


# The compiled functions of a run, reused by the next run of the same shapes in this process.
@sharding.reuse
def _jit_update(
  graphdef, tx, spec: train_step.UpdateSpec, state_sh, batch_sh, compiler_options=None
) -> Callable:
  update_fn = train_step.make_update_fn(graphdef, tx, spec)
  return sharding.jit_update(update_fn, state_sh, batch_sh, compiler_options=compiler_options)


# The first-update probe runs each program a few times, so on CPU it compiles without LLVM's
# optimisation passes (as the tests do): a shorter compile of the same operations, each run slower.
PROBE_CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@sharding.reuse
def _jit_first_update(
  graphdef, tx, spec: train_step.UpdateSpec, *, state_sh, batch_sh, compiler_options=None
) -> Callable:
  """jit(state, batch, rng, radii) -> the metrics of the update of `spec` (make_update_fn, as
  `_jit_update` compiles it) with the loss's (delta_low, delta_high) replaced by `radii`, a
  float32 [2] argument: one program serves every radius. The state is not donated and the new
  state not returned, so each call starts from the same state (first_update)."""
  mesh = jax.tree.leaves(state_sh)[0].mesh
  rep = sharding.replicated(mesh)

  def metrics(state, batch, rng, radii):
    loss = spec.loss.replace(delta_low=radii[0], delta_high=radii[1])
    update_fn = train_step.make_update_fn(graphdef, tx, dataclasses.replace(spec, loss=loss))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # for constrain_batch inside
      return update_fn(state, batch, rng)[1]

  return jax.jit(
    metrics,
    in_shardings=(state_sh, batch_sh, rep, rep),
    out_shardings=rep,
    compiler_options={**(compiler_options or {}), **PROBE_CPU_COMPILER_OPTIONS}
    if mesh.devices.flat[0].platform == "cpu"
    else compiler_options,
  )


@sharding.reuse
def _jit_logprobs(graphdef, spec: train_step.UpdateSpec, params_sh, batch_sh) -> Callable:
  logprob_fn = train_step.make_logprob_fn(
    graphdef, prompt_len=spec.prompt_len, temperature=spec.temperature, group_size=spec.group_size
  )
  return sharding.jit_logprobs(logprob_fn, params_sh, batch_sh)


def _check_group_split(config, spec: train_step.UpdateSpec, mesh) -> None:
  """Warns when the shared-prompt update cannot spread its groups over the batch devices."""
  devices = mesh.shape["data"] * mesh.shape["fsdp"]
  groups = config.rollout.prompts_per_iter // (spec.minibatches * spec.microbatches)
  if spec.group_size > 1 and groups % devices:
    log.warning(
      "train.shuffle='groups': a micro-batch holds %d groups, which do not split over the %d "
      "data x fsdp devices (the update packs each group into one row), so every device computes "
      "all of them; set train.shuffle='rows' or a multiple of %d groups per micro-batch",
      groups, devices, devices,
    )  # fmt: skip


_make_diagnostics_fn = sharding.reuse(diagnostics.make_diagnostics_fn)


def _diagnostics_fn(config, graphdef, spec: train_step.UpdateSpec) -> Callable | None:
  d = config.diagnostics
  if not d.every:
    return None
  return _make_diagnostics_fn(
    graphdef,
    prompt_len=spec.prompt_len,
    temperature=spec.temperature,
    loss_config=spec.loss,
    divergences=tuple(d.divergences),
    chunk_size=d.chunk_size,
  )


@jax.jit  # one dispatch: eagerly, each of these random ops is dispatched alone
def _iteration_keys(seed_key, iteration):
  key = jax.random.fold_in(seed_key, iteration)
  return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def _correct_mismatch(r, batch: train_step.Batch, sampled: np.ndarray, metrics: dict):
  """The batch anchored on the trainer's log-probs (batch.logq) with `rollout.correction` applied
  for the sampler's (`sampled`), which drew the tokens; logs mismatch/* and correction/*."""
  metrics.update(
    correction.mismatch_metrics(batch.logq, sampled, batch.mask, r.get("mismatch_threshold", 0.1))
  )
  mask, weight, corr = correction.correct(
    batch.logq,
    sampled,
    batch.mask,
    method=r.get("correction", "none"),
    level=r.get("correction_level", "token"),
    cap=r.get("correction_cap", 2.0),
  )
  metrics.update(corr)
  return batch.replace(mask=mask, is_weight=weight if weight is not None else batch.is_weight)


def _sampler_key(run: Run, iteration: int) -> jax.Array:
  """The iteration's rollout key, on the sampler's devices (its folds then run there, not queued
  behind an update on the trainer's)."""
  key = run.keys(iteration)[0]
  if run.sampler_mesh is run.mesh:
    return key
  return jax.device_put(key, sharding.replicated(run.sampler_mesh))


def _sampler_device(run: Run):
  """A sampler device of this process where sampling has its own devices, else None."""
  mine = [d for d in run.sampler_mesh.devices.flat if d.process_index == jax.process_index()]
  return mine[0] if run.sampler_mesh is not run.mesh and mine else None


def _on_sampler(run: Run):
  """The rollout's own small computations (advantages, key folds) on a sampler device."""
  device = _sampler_device(run)
  return contextlib.nullcontext() if device is None else jax.default_device(device)


def _draw(run: Run, iteration: int, moved: async_rollout.Moved, key: jax.Array):
  """The rollout of `iteration` (rollout.collect) by the policy `moved`, on the sampler's
  devices; with rollout.mode="async" on the rollout thread. Returns (host batch, metrics)."""
  t0 = time.perf_counter()
  metrics = {}
  if run.param_sync.split:
    metrics = {"async/sync_s": moved.wait(), "async/sync_gib": moved.gib}
  with _on_sampler(run):
    batch, rollout_metrics = rollout.collect(
      run.config,
      run.env,
      run.sample_fn,
      moved.policy,
      key,
      run.sampling,
      prompt_len=run.spec.prompt_len,
      pad_id=run.sampling.pad_id,
      use_topk=run.spec.use_topk,
    )
  metrics.update(rollout_metrics)
  metrics["rollout/policy_version"] = float(moved.version)
  metrics["time/rollout_s"] = time.perf_counter() - t0
  return batch, metrics


def _behaviour_version(run: Run, iteration: int) -> int:
  """How many updates the policy that draws `iteration`'s rollout has had."""
  return max(iteration - run.config.rollout.staleness, 0)


def _draw_ahead(run: Run, iteration: int, behaviour, frozen) -> None:
  """Starts the rollout of `iteration` on the rollout thread, by the trainable parameters
  `behaviour`. Call it before dispatching the update it runs beside: the parameter move and the
  key are dispatched here, ahead of that update on the trainer's devices."""
  moved = run.param_sync(behaviour, frozen, version=_behaviour_version(run, iteration))
  key = _sampler_key(run, iteration)
  draw = functools.partial(_draw, run, iteration, moved, key)
  run.ahead.submit(iteration, draw, env_state=run.env.state())


def _prepare(run: Run, state, batch: train_step.Batch, metrics: dict):
  """The batch the update trains on, from the rollout's: the optional trim and log-prob passes
  (on the trainer's devices)."""
  bucket = run.config.train.get("trim_bucket", 0)
  if bucket:  # cut the columns that are padding in every row (a multiple of the bucket)
    # Every process cuts its rows alike.
    extent = sharding.global_max(train_step.response_extent(batch, run.spec.prompt_len))
    keep = -(-extent // bucket) * bucket
    batch = train_step.trim_responses(batch, run.spec.prompt_len, keep)
    metrics["rollout/update_columns"] = batch.logq.shape[1]
  if run.config.rollout.recompute_logprobs or run.ref_params is not None:
    if run.ref_params is not None:
      batch = batch.replace(ref_logp=np.zeros_like(batch.logq))  # the structure compiled for
    if run.spec.is_weight:
      batch = batch.replace(is_weight=np.ones_like(batch.logq))  # the structure compiled for
    on_devices = run.to_devices(batch)
    if run.config.rollout.recompute_logprobs:
      # The anchor pi_old: the learner at the start of this update, by the trainer's forward
      # pass. On-policy that is the behaviour itself (the gap is the two programs' numerics);
      # with stale rollouts the trust region is centred on the learner (decoupled PPO) and
      # rollout.correction weighs by pi_old / mu for the lag as well (docs/math.md).
      sampled = batch.logq
      logq = run.logprobs(state.policy(), on_devices)
      batch = batch.replace(logq=sharding.to_host(logq))
      batch = _correct_mismatch(run.config.rollout, batch, sampled, metrics)
    if run.ref_params is not None:
      ref_logp = run.logprobs(state.policy(run.ref_params), on_devices)
      batch = batch.replace(ref_logp=sharding.to_host(ref_logp))
  return batch


def _update_batch(run: Run, state, iteration: int):
  """The host-side batch the update of `iteration` trains on: the rollout (drawn now, or taken
  from the rollout thread) with the optional trim and log-prob passes. Returns (batch, metrics,
  behaviour parameters, (t0, t1, t2): the start, the rollout's end and the log-prob passes' end)."""
  t0 = time.perf_counter()
  # The behaviour policy: the learner itself, or with rollout.staleness = k the learner k updates
  # ago (as in asynchronous RL, where samples arrive from a policy that has since moved on).
  behaviour = run.behaviour[0] if run.behaviour else state.params
  drawn = run.ahead.take(iteration) if run.ahead is not None else None
  if run.stream is not None:  # finished groups, each token drawn by some recent policy
    batch, metrics = run.stream.take(iteration)
    metrics["async/wait_s"] = time.perf_counter() - t0
  elif drawn is not None:
    batch, metrics = drawn
    metrics["async/wait_s"] = time.perf_counter() - t0  # the update waited for the sampler
  else:
    moved = run.param_sync(behaviour, state.frozen, version=_behaviour_version(run, iteration))
    batch, metrics = _draw(run, iteration, moved, _sampler_key(run, iteration))
  t1 = time.perf_counter()
  batch = _prepare(run, state, batch, metrics)
  return batch, metrics, behaviour, (t0, t1, time.perf_counter())


def _iteration(run: Run, state, iteration: int) -> tuple[Any, dict[str, float]]:
  """One RL iteration: rollout, the optional log-prob passes, the update, the finiteness check.
  Returns the new state and the iteration's metrics (time/* for each phase)."""
  # time/rollout_s is the rollout's own (with rollout.mode="async" it ran beside the last update).
  batch, metrics, behaviour, (_, t1, t2) = _update_batch(run, state, iteration)
  _, update_key = run.keys(iteration)
  on_devices = run.to_devices(batch)
  every = run.config.diagnostics.every
  diagnose = run.diagnose is not None and (iteration + 1) % every == 0
  # The update donates the state's buffers: keep what outlives it (the pre-update parameters are
  # the behaviour of iteration t + k; the diagnostics compare against this iteration's behaviour).
  before = jax.tree.map(jnp.copy, state.params) if run.behaviour else None
  if run.ahead is not None and iteration + 1 < run.config.iterations:
    # The next rollout's policy, theta_{t+1-k}, is the oldest one the update leaves behind.
    _draw_ahead(run, iteration + 1, (run.behaviour[1:] + [before])[0], state.frozen)
  if diagnose and not run.behaviour:
    behaviour = jax.tree.map(jnp.copy, state.params)
  if diagnose and run.behaviour:
    # Stale rollouts: the learner already differs from the behaviour before its first step. The
    # same figures at the start of the update, as diag_start/... (on-policy they are all zero).
    start = jax.device_get(run.diagnose(state.policy(behaviour), state.policy(), on_devices))
    metrics.update({"diag_start/" + k.split("/", 1)[1]: v for k, v in start.items()})
  state, upd = run.update(state, on_devices, update_key)
  if run.stream is not None:  # loaded by the engine between two chunks, once it has landed
    _publish(run, state, iteration + 1)
  if run.behaviour:
    run.behaviour = run.behaviour[1:] + [before]
  metrics.update(train_step.summarize_update_metrics(jax.device_get(upd)))
  t3 = time.perf_counter()
  check_finite(state, metrics, batch.adv, iteration=iteration + 1, newest=run.newest)
  if diagnose:
    # The policy after the update against the one that sampled the batch, on the batch's tokens.
    metrics.update(
      jax.device_get(run.diagnose(state.policy(behaviour), state.policy(), on_devices))
    )
    metrics["time/diagnostics_s"] = time.perf_counter() - t3
  metrics.update(
    {
      "rollout/behaviour_lag": metrics.get(
        "rollout/lag_mean", float(min(run.config.rollout.staleness, iteration))
      ),
      "optim/steps": float(state.step),
      "time/logprobs_s": t2 - t1,
      "time/update_s": t3 - t2,
    }
  )
  return state, metrics


# --- The first update at any radius (the sweep's equal_mask calibration) ------------------------


class FirstUpdate:
  """A fresh run's first update, repeatable under any loss (built by `first_update`).

  The run is set up as train_and_evaluate sets it up (the same warm start, environment, prompts
  and random keys; no workdir, checkpoints or evaluation) and the rollout batch of iteration 1 is
  drawn once (with `batches` = k > 1, those of iterations 1..k, each from the initial policy;
  `batch_metrics`: their rollout/* figures). `metrics(loss)` runs the update on each batch from
  the initial state with its iteration's update key under `loss` (a LossConfig that needs the
  same batch fields as the config's) and returns the summary (`summarize_update_metrics`:
  trust/masked_frac and the rest), as the run would log it for iteration 1 with that loss (k > 1:
  the mean over the batches). Nothing is donated, so every call starts from the same state; one
  program is compiled per loss apart from its radii (`_jit_first_update`)."""

  def __init__(self, run: Run, state, batches: list[train_step.Batch], batch_metrics: list[dict]):
    self.run, self.state = run, state
    self.batches = [run.to_devices(b) for b in batches]
    self.keys = [run.keys(i)[1] for i in range(len(batches))]
    self.batch_metrics = _mean_metrics(batch_metrics)

  def metrics(self, loss) -> dict[str, float]:
    spec = dataclasses.replace(self.run.spec, loss=loss.replace(delta_low=1.0, delta_high=None))
    if (spec.use_topk, spec.use_ref_logp) != (self.run.spec.use_topk, self.run.spec.use_ref_logp):
      raise ValueError(
        f"loss {loss} needs other batch fields (top-K, reference log-probs) than the config's "
        f"loss {self.run.spec.loss}: set up the first update with its config"
      )
    update = self.run.probe(spec)
    radii = jnp.asarray([float(r) for r in loss.radii], jnp.float32)
    out = [
      update(self.state, b, key, radii) for b, key in zip(self.batches, self.keys, strict=True)
    ]
    return _mean_metrics([train_step.summarize_update_metrics(m) for m in jax.device_get(out)])


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
  if len(rows) == 1:
    return rows[0]
  return {k: float(np.mean([r[k] for r in rows if k in r])) for k in rows[0]}


@contextlib.contextmanager
def first_update(config: ml_collections.ConfigDict, batches: int = 1):
  """The first update of a fresh run of `config`, as a `FirstUpdate` over `batches` rollout
  batches (a context manager: the environment's workers are closed at its end)."""
  if batches < 1:
    raise ValueError(f"batches must be >= 1, got {batches}")
  config_lib.validate(config)
  experiment.check_inputs(config)
  with contextlib.ExitStack() as stack:
    run, state = _set_up(config, None, None, stack)
    drawn = [_update_batch(run, state, i)[:2] for i in range(batches)]
    yield FirstUpdate(run, state, [b for b, _ in drawn], [m for _, m in drawn])


class _ProfileWindow:
  """Traces iterations [start, start + count) (numbered from 1, as the log counts them) with the
  JAX profiler into <workdir>/profile (config.profile; start 0 = off): a TensorBoard profile
  (`tensorboard --logdir <workdir>/profile`) and a Perfetto trace (perfetto_trace.json.gz, for
  ui.perfetto.dev) of the device's kernels, the host's ops and the Python calls in between. With
  several processes each writes its own folder, process_<index>."""

  def __init__(self, profile: ml_collections.ConfigDict | None, workdir: str):
    self.start = int(profile.start) if profile else 0
    self.stop_after = self.start + int(profile.iterations) - 1 if profile else 0
    self.folder = os.path.join(workdir, "profile")
    if jax.process_count() > 1:
      self.folder = os.path.join(self.folder, f"process_{jax.process_index()}")
    self.tracing = False

  def begin(self, iteration: int) -> None:
    if self.start and iteration == self.start:
      log.info("profiling iterations %d-%d into %s", self.start, self.stop_after, self.folder)
      try:
        jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
      except Exception as e:  # noqa: BLE001 (e.g. another trace running): training goes on
        log.warning("profile: the trace did not start (%s); training goes on without it", e)
        return
      self.tracing = True

  def end(self, iteration: int) -> None:
    if self.tracing and iteration >= self.stop_after:
      self.close()

  def close(self) -> None:
    """Stops a trace that is running (at the window's end, or when the run stops inside it)."""
    if self.tracing:
      self.tracing = False
      jax.profiler.stop_trace()
      log.info(
        "profile written: tensorboard --logdir %s (or its perfetto_trace.json.gz)", self.folder
      )


def _train(config, workdir, checkpoint_dir, signals, stack) -> dict[str, Any]:
  t_start = time.time()
  if jax.process_index() == 0:
    files.write_atomic(
      os.path.join(workdir, experiment.RUN_CONFIG),
      config.to_json_best_effort(indent=2, sort_keys=True),
    )
  log.info("resolved config:\n%s", config)
  run, state = _set_up(config, workdir, checkpoint_dir, stack)
  abstract = sharding.abstract_like(state.saved(), run.state_sh.saved())
  extras = None
  if run.behaviour:
    extras = {"behaviour": [abstract.params] * len(run.behaviour)}
  restored_step, restored, meta = checkpointing.restore_latest(run.mngr, abstract, extras=extras)
  start = 0
  if restored is not None:
    if extras:
      restored, run.behaviour = restored["state"], list(restored["behaviour"])
    state, start, run.newest = (
      restored.with_frozen(state.frozen),
      int(meta["iteration"]),
      restored_step,
    )
    run.env.restore(meta["env"])
    if run.stream is not None:
      run.stream.restore(meta.get("stream"))
    run.history = meta.get("history", run.history)
    log.info("resumed from %s at iteration %d/%d", run.mngr.directory, start, config.iterations)
  else:
    log.info("evaluating the initial policy ...")
    run.history["initial_eval"] = run.evaluate(state.params, state.frozen)
    log.info("initial policy: %s", _fmt(run.history["initial_eval"]))
  # Logs past the restored step belong to iterations that are about to be replayed.
  writer = stack.enter_context(
    metric_writers.MetricWriter(
      workdir,
      total_steps=config.iterations,
      initial_step=start,
      resume_step=start if restored is not None else -1,
      wandb=metric_writers.WandbOptions.from_config(config),
    )
  )
  stack.enter_context(writer.redirect_logging(log))
  if restored is None:
    writer.write(0, run.history["initial_eval"])
  # Logged once, with the run's first iteration (a resumed run logged them before).
  param_counts = _param_counts(state) if restored is None else {}
  if run.stream is not None:
    _publish(run, state, start)
    run.stream.start()

  profile = _ProfileWindow(config.get("profile"), workdir)
  stack.callback(profile.close)

  # --- The loop: from here a stop signal only sets a flag ----------------------------------------
  signals.arm()
  done, io_s = start, 0.0
  for iteration in range(start, config.iterations):
    if signals.should_stop():
      break
    profile.begin(iteration + 1)
    t0 = time.perf_counter()
    state, metrics = _iteration(run, state, iteration)
    metrics.update(param_counts)
    param_counts = {}
    done = iteration + 1
    if done % config.eval.every == 0 or done == config.iterations:
      t_eval = time.perf_counter()
      run.history["last_eval"] = last = run.evaluate(state.params, state.frozen)
      run.history.setdefault("evals", []).append({"iteration": done, **last})
      metrics.update(last, **{"time/eval_s": time.perf_counter() - t_eval})
      log.info("iteration %d: %s", done, _fmt(last))
    metrics["time/io_s"] = io_s  # the previous iteration's logging and checkpoint calls
    metrics["time/iteration_s"] = time.perf_counter() - t0 + io_s
    t_io = time.perf_counter()
    if done % config.log_every == 0:
      writer.write(done, metrics)
      if "diag/ratio_hist" in metrics:
        writer.histogram(done, "diag/log_ratio", diagnostics.tensorboard_histogram(metrics))
    writer.advance()
    if done % config.checkpoint.every == 0 or done == config.iterations:
      run.save(done, state)
    io_s = time.perf_counter() - t_io
    profile.end(done)

  if done < config.iterations:  # stopped by a signal
    if run.newest != done:
      log.info("saving iteration %d before exiting ...", done)
      run.save(done, state, wait=True)
    run.mngr.wait_until_finished()
    writer.flush()
    return {
      "workdir": workdir,
      "preempted": True,
      "iterations_done": done,
      "signal": signals.received,
      "checkpoints": str(run.mngr.directory),
    }
  run.mngr.wait_until_finished()
  writer.close()
  if config.model.export_hf and config.model.path is not None:
    _export_hf(run, state)
  return _finish(run, t_start, done)


def _param_counts(state: train_step.TrainState) -> dict[str, float]:
  """params/trainable (what the optimizer updates: with LoRA the adapters) and params/total."""
  count = lambda tree: float(sum(x.size for x in jax.tree.leaves(tree)))
  trainable = count(state.params)
  return {"params/trainable": trainable, "params/total": trainable + count(state.frozen)}


def _export_hf(run: Run, state) -> None:
  from gppo_jax.models import hf_checkpoint

  params = sharding.to_host(state.policy())  # collective on multi-host: every process calls it
  if jax.process_index() == 0:
    out_dir = os.path.join(run.workdir, "hf_export")
    model = nnx.merge(run.graphdef, params)
    source = run.config.model.path
    hf_checkpoint.save_model(model, out_dir, source=source)  # LoRA: the adapters merged in
    log.info("exported the trained policy to %s", out_dir)
    if model.cfg.lora_rank:
      adapter_dir = os.path.join(run.workdir, "peft_adapter")
      hf_checkpoint.save_peft_adapter(model, adapter_dir, base_model=source)
      log.info("exported the LoRA adapters (PEFT format) to %s", adapter_dir)


def _finish(run: Run, t_start: float, done: int) -> dict[str, Any]:
  """The summary (returned, written to summary.json and printed by process 0)."""
  h = run.history
  summary = {
    "workdir": run.workdir,
    "preempted": False,
    "iterations": run.config.iterations,
    "iterations_done": done,
    "seconds": time.time() - t_start,
    "warm_start": h.get("warm_start", {}),
    "initial_eval": h.get("initial_eval", {}),
    "final_eval": h.get("last_eval", h.get("initial_eval", {})),
    "metrics_file": os.path.join(run.workdir, "metrics.jsonl"),
    "checkpoints": str(run.mngr.directory),
  }
  if jax.process_index() == 0:
    # Atomic: `sweep` takes a summary.json as the sign of a finished run.
    with files.atomic_write(os.path.join(run.workdir, "summary.json")) as f:
      json.dump(summary, f, indent=2, default=str)
    _print_summary(summary, run.config)
  return summary


def _fmt(metrics: dict[str, float]) -> str:
  """'accuracy 0.31±0.02  pass@4 0.48±0.02  level1/accuracy 0.09 ...': overall figures first,
  each with its standard error (the `<key>_se` entry) when there is one."""
  parts = []
  for key, v in metrics.items():
    if key.endswith("_se"):
      continue
    name = key.split("/", 1)[-1]
    se = metrics.get(key + "_se")
    parts.append((name, f"{name} {v:.3f}" + (f"±{se:.3f}" if se is not None else "")))
  parts.sort(key=lambda p: "/" in p[0])
  return "  ".join(text for _, text in parts)


def _gain_verdict(gain: float, se0: float | None, se1: float | None) -> str:
  """A line for a run whose held-out accuracy did not clearly rise: within two standard errors of
  the start (the two evaluations' errors combined as if independent), or clearly below it. Empty
  when it rose beyond that, or when there are no standard errors (no evaluation)."""
  if se0 is None or se1 is None or not np.isfinite(gain):
    return ""
  noise = 2.0 * float(np.hypot(se0, se1))
  if gain > noise:
    return ""
  band = f"{100 * noise:.1f} points, two standard errors"
  what = f"no clear gain: within {band}"
  if gain < -noise:
    what = f"below the start by more than {band}"
  return (
    f"({what}. One run's outcome varies with its seed and, on the built-in tasks, its warm start "
    "(README 'The default run'); compare algorithms over several seeds: python -m gppo_jax.sweep)"
  )


def _missed_start_line(info: dict[str, Any]) -> str:
  """A warning for a run whose supervised warm start ended below its target ('' otherwise)."""
  if not info.get("missed_target"):
    return ""
  return (
    f"WARNING: the warm start missed its target (held-out accuracy {info['accuracy']:.3f} < "
    f"{info['target_accuracy']:.2f} after {info['steps']} supervised steps): this run did not "
    "start from the intended policy (summary.json: warm_start.missed_target)"
  )


def _print_summary(s: dict[str, Any], config) -> None:
  before, after = s["initial_eval"], s["final_eval"]
  acc0, acc1 = before.get("eval/accuracy", float("nan")), after.get("eval/accuracy", float("nan"))
  lines = [
    "",
    f"GPPO {config.loss.divergence}-{config.loss.estimator} finished {s['iterations']} iterations "
    f"in {s['seconds']:.0f} s",
    f"  held-out greedy accuracy: {acc0:.3f} -> {acc1:.3f} ({100 * (acc1 - acc0):+.1f} points)",
  ]
  se0, se1 = before.get("eval/accuracy_se"), after.get("eval/accuracy_se")
  if verdict := _gain_verdict(acc1 - acc0, se0, se1):
    lines.append(f"  {verdict}")
  if line := _missed_start_line(s.get("warm_start") or {}):
    lines.append(f"  {line}")
  for key in after:
    if key != "eval/accuracy" and key in before and not key.endswith("_se"):
      lines.append(f"  {key}: {before[key]:.3f} -> {after[key]:.3f}")
  lines += [
    f"  metrics:     {s['metrics_file']} (TensorBoard: {s['workdir']}/tensorboard)",
    f"  checkpoints: {s['checkpoints']}",
    f"  summary:     {s['workdir']}/summary.json",
  ]
  print("\n".join(lines), flush=True)


def main(argv):
  del argv
  from absl import flags
  from ml_collections import config_flags

  experiment.keep_cpu_memory()  # before anything starts a JAX backend
  experiment.quiet_libraries(flags.FLAGS)
  experiment.use_compilation_cache()
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  summary = train_and_evaluate(
    flags.FLAGS.config, flags.FLAGS.workdir or experiment.default_workdir(path)
  )
  if summary["preempted"]:
    done = summary["iterations_done"]
    where = "during set-up" if done is None else f"after iteration {done}"
    print(f"preempted {where}; rerun the same command to resume", flush=True)


if __name__ == "__main__":
  from absl import flags
  from ml_collections import config_flags

  from gppo_jax import cli

  sharding.maybe_initialize_distributed()  # before the config file runs any jax code
  config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py[:arg]).")
  flags.DEFINE_string("workdir", None, "Run folder (default ./workdirs/<config name>).")
  flags.mark_flags_as_required(["config"])
  cli.run(main)
