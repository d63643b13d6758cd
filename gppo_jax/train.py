"""GPPO training: the main entry point.

  python -m gppo_jax.train --config=configs/kl_atomic.py [--workdir=DIR] [--config.loss.delta=...]

Each iteration samples prompts, generates `group_size` responses per prompt with the KV-cached
sampler (keeping the behaviour log-probs), scores them, computes group-relative advantages and runs
one jitted update of epochs x mini-batches over that rollout batch (updates after the first are
off-policy: that is where the trust region acts). The Python loop only logs, evaluates and saves.

Rerunning the same command resumes from the newest readable checkpoint, replaying exactly what an
uninterrupted run would have done. SIGTERM or Ctrl-C stops the run at the next iteration boundary
with a checkpoint of the iterations completed (gppo_jax/interrupts.py); a non-finite state is never
saved; one trainer at a time holds a workdir (experiment.WorkdirLock).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from gppo_jax import (
  advantages,
  checkpointing,
  config_lib,
  envs,
  experiment,
  interrupts,
  metric_writers,
  policy_eval,
  sampler,
  sharding,
  train_step,
)

log = logging.getLogger("gppo_jax")


# --- One iteration's pieces ---------------------------------------------------------------------


def collect_rollout(
  config, env, sample_fn, params, key, sampling, *, prompt_len, pad_id, use_topk=False
):
  """Prompts -> responses -> rewards -> advantages: the host-side rollout batch and its metrics.

  Returns (batch, metrics): batch holds the arrays `train_step.make_update_fn` documents (numpy,
  every row of the global batch), metrics the reward, length and advantage figures."""
  r = config.rollout
  resp_len = sampling.max_new_tokens
  prompts = env.train_prompts(r.prompts_per_iter)
  rep = [p for p in prompts for _ in range(r.group_size)]
  p_tok, p_mask = sampler.left_pad([p.token_ids for p in rep], pad_id=pad_id, length=prompt_len)
  out = sample_fn(params, p_tok, p_mask, key, sampling)
  texts = policy_eval.decode_responses(env.tokenizer, out.tokens, out.mask, sampling.stop_ids)
  correct, valid, reward_metrics = env.score(texts, rep)
  rewards, shaping_metrics = envs.shape_rewards(
    correct,
    texts,
    out.lengths,
    max_len=resp_len,
    overlong_buffer=config.reward.overlong_buffer,
    format_coef=config.reward.format_coef,
  )
  reward_metrics.update(shaping_metrics)
  rewards_g = rewards.reshape(r.prompts_per_iter, r.group_size)
  valid_g = valid.reshape(rewards_g.shape)
  # Invalid scores (infrastructure errors) take their group's mean: zero advantage, masked.
  group_mean = np.nanmean(np.where(valid_g, rewards_g, np.nan), axis=1, keepdims=True)
  rewards_g = np.where(valid_g, rewards_g, np.nan_to_num(group_mean))
  adv_kwargs = {}
  if config.advantage.name in ("grpo", "batch_std"):
    adv_kwargs = dict(eps=config.advantage.eps, ddof=config.advantage.ddof)
  adv, adv_metrics = advantages.compute(config.advantage.name, rewards_g, **adv_kwargs)
  seq_keep = valid_g.copy()
  if config.advantage.filter_zero_signal:
    seq_keep &= np.asarray(advantages.signal_mask(rewards_g))[:, None]
  batch = train_step.build_sequences(p_tok, p_mask, out.tokens, out.mask)
  batch.update(
    logq=out.logprobs,
    mask=out.mask & seq_keep.reshape(-1)[:, None],
    adv=np.asarray(adv, np.float32).reshape(-1),
  )
  if use_topk:
    batch.update(topk_logq=out.topk_logprobs, topk_ids=out.topk_ids)
  metrics = {
    "reward/mean": float(np.mean(rewards)),
    "reward/correct_mean": float(np.mean(correct)),
    "reward/std": float(np.std(rewards)),
    "response/length_mean": float(np.mean(out.lengths)),
    "response/truncated_frac": float(np.mean(out.lengths >= resp_len)),
    **{k: float(v) for k, v in adv_metrics.items()},
    **reward_metrics,
  }
  return batch, metrics


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [
    jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


class NonFiniteError(FloatingPointError):
  """The update produced NaN or inf; the state of that iteration was not saved."""


def check_finite(state, metrics: dict[str, float], adv: np.ndarray, *, iteration: int, newest: Any):
  """Raises NonFiniteError naming what went non-finite and the likely cause, before any save."""
  bad = [
    k for k in ("loss/total", "optim/grad_norm") if k in metrics and not np.isfinite(metrics[k])
  ]
  if not bool(_all_finite(state.params)):
    bad.append("parameters")
  if not bool(_all_finite(state.opt_state)):
    bad.append("optimizer state")
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


def _train(config, workdir, checkpoint_dir, signals, stack) -> dict[str, Any]:
  t_start = time.time()
  is_main = jax.process_index() == 0
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  log.info("resolved config:\n%s", config)
  writer = None

  def say(text: str) -> None:
    log.debug(text)
    if writer is not None:
      writer.print(text)
    elif is_main:
      print(text, file=sys.stderr, flush=True)

  # --- Checkpoints first: a resume skips the warm start ------------------------------------------
  mngr = checkpointing.make_manager(checkpoint_dir, max_to_keep=config.checkpoint.keep)
  stack.callback(mngr.close)  # every exit path lets pending writes complete
  resuming = mngr.latest_step() is not None

  # --- Policy, environment, optimizer -----------------------------------------------------------
  mesh = sharding.make_mesh(config.mesh)
  # The KL penalty's reference is the initial policy, so a resume rebuilds it (deterministically).
  need_init = not resuming or config.loss.kl_coef > 0
  graphdef, init_params, model_cfg, env, warm_info = experiment.build_policy(
    config, say, mesh=mesh, warm_start=need_init
  )
  stack.callback(env.close)
  stop_ids = tuple(model_cfg.eos_token_ids)
  pad_id = model_cfg.pad_token_id
  tx = train_step.optimizer_from_config(config)
  state_sh, state = experiment.init_state(init_params, tx, mesh)
  sampling = experiment.sampling_params(config, env, stop_ids=stop_ids, pad_id=pad_id)
  resp_len = sampling.max_new_tokens
  prompt_len = env.max_prompt_len
  spec = train_step.update_spec_from_config(config, prompt_len, resp_len)
  update_fn = train_step.make_update_fn(graphdef, tx, spec)
  logprob_fn = train_step.make_logprob_fn(
    graphdef, prompt_len=prompt_len, temperature=config.rollout.temperature
  )
  # A copy: the update donates the state's buffers.
  ref_params = jax.tree.map(jnp.copy, state.params) if config.loss.kl_coef > 0 else None
  r = config.rollout
  mesh_sampler = sampler.MeshSampler(graphdef, state_sh.params)  # rollouts and evals
  rows = sharding.process_rows(r.prompts_per_iter * r.group_size, mesh)  # this host's rows

  def to_devices(batch):
    return sharding.shard_batch(jax.tree.map(lambda x: x[rows], batch), mesh)

  update = sharded_logprobs = None  # compiled on the first batch, whose shapes they need
  base_key = jax.random.PRNGKey(config.seed)

  def run_eval(params) -> dict[str, float]:
    return experiment.evaluate(
      config, graphdef, params, env, max_new_tokens=resp_len, sample_fn=mesh_sampler
    )

  # --- Resume, or evaluate the initial policy ---------------------------------------------------
  restored_step, restored, meta = checkpointing.restore_latest(
    mngr, sharding.abstract_like(state, state_sh)
  )
  history: dict[str, Any] = {"warm_start": warm_info}
  start_iter = 0
  if restored is not None:
    state = restored
    start_iter = int(meta["iteration"])
    env.restore(meta["env"])
    history = meta.get("history", history)
    say(f"resumed from {mngr.directory} at iteration {start_iter}/{config.iterations}")
  else:
    say("evaluating the initial policy ...")
    history["initial_eval"] = run_eval(state.params)
    say("initial policy: " + _fmt(history["initial_eval"]))

  # Logs past the restored step belong to iterations that are about to be replayed.
  writer = metric_writers.MetricWriter(
    workdir,
    total_steps=config.iterations,
    initial_step=start_iter,
    resume_step=start_iter if restored is not None else -1,
  )
  stack.callback(writer.close)
  if restored is None:
    writer.write(0, history["initial_eval"])
  newest = restored_step  # the newest checkpoint on disk

  def save(iteration: int, wait: bool = False) -> None:
    nonlocal newest
    meta = {
      "iteration": iteration,
      "env": env.state(),
      "history": history,
      "config": config.to_json_best_effort(),
    }
    checkpointing.save(mngr, iteration, state, meta, wait=wait)
    newest = iteration

  # --- The loop: from here a stop signal only sets a flag ----------------------------------------
  signals.arm()
  done = start_iter
  last_eval = history.get("last_eval", history.get("initial_eval", {}))
  preempted = False
  for iteration in range(start_iter, config.iterations):
    if signals.should_stop():
      preempted = True
      break
    t0 = time.time()
    key = jax.random.fold_in(base_key, iteration)
    batch, metrics = collect_rollout(
      config,
      env,
      mesh_sampler,
      state.params,
      jax.random.fold_in(key, 0),
      sampling,
      prompt_len=prompt_len,
      pad_id=pad_id,
      use_topk=spec.use_topk,
    )
    t_rollout = time.time() - t0
    if ref_params is not None:
      batch["ref_logp"] = np.zeros_like(batch["logq"])  # filled below; fixes the key set
    if update is None:
      batch_sh = sharding.batch_shardings(batch, mesh)
      update = sharding.jit_update(update_fn, state_sh, batch_sh)
      sharded_logprobs = sharding.jit_logprobs(logprob_fn, state_sh.params, batch_sh)
    if r.recompute_logprobs or ref_params is not None:
      batch_dev = to_devices(batch)
      if r.recompute_logprobs:
        batch["logq"] = sharding.to_host(sharded_logprobs(state.params, batch_dev))
      if ref_params is not None:
        batch["ref_logp"] = sharding.to_host(sharded_logprobs(ref_params, batch_dev))
    t1 = time.time()
    state, upd = update(state, to_devices(batch), jax.random.fold_in(key, 1))
    metrics.update(train_step.summarize_update_metrics(jax.device_get(upd)))
    metrics.update(
      {
        "time/rollout_s": t_rollout,
        "time/update_s": time.time() - t1,
        "time/iteration_s": time.time() - t0,
        "optim/steps": float(state.step),
      }
    )
    check_finite(state, metrics, batch["adv"], iteration=iteration + 1, newest=newest)
    done = iteration + 1
    if done % config.eval.every == 0 or done == config.iterations:
      last_eval = run_eval(state.params)
      history["last_eval"] = last_eval
      history.setdefault("evals", []).append({"iteration": done, **last_eval})
      metrics.update(last_eval)
      say(f"iteration {done}: " + _fmt(last_eval))
    if done % config.log_every == 0:
      writer.write(done, metrics)
    writer.advance()
    if done % config.checkpoint.every == 0 or done == config.iterations:
      save(done)

  if preempted:
    if newest != done:
      say(f"saving iteration {done} before exiting ...")
      save(done, wait=True)
    mngr.wait_until_finished()
    writer.flush()
    return {
      "workdir": workdir,
      "preempted": True,
      "iterations_done": done,
      "signal": signals.received,
      "checkpoints": str(mngr.directory),
    }
  mngr.wait_until_finished()
  writer.close()

  if config.model.export_hf and config.model.path is not None:
    from gppo_jax import hf_checkpoint

    params = sharding.to_host(state.params)  # collective on multi-host: every process calls it
    if is_main:
      out_dir = os.path.join(workdir, "hf_export")
      hf_checkpoint.save_model(nnx.merge(graphdef, params), out_dir, source=config.model.path)
      say(f"exported the trained policy to {out_dir}")
  summary = {
    "workdir": workdir,
    "preempted": False,
    "iterations": config.iterations,
    "iterations_done": done,
    "seconds": time.time() - t_start,
    "warm_start": history.get("warm_start", warm_info),
    "initial_eval": history.get("initial_eval", {}),
    "final_eval": last_eval,
    "metrics_file": os.path.join(workdir, "metrics.jsonl"),
    "checkpoints": str(mngr.directory),
  }
  if is_main:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2, default=str)
    _print_summary(summary, config)
  return summary


def _fmt(metrics: dict[str, float]) -> str:
  """'accuracy 0.31  pass@4 0.48  level1/accuracy 0.09 ...': overall figures first."""
  names = [(k.split("/", 1)[-1], v) for k, v in metrics.items()]
  names.sort(key=lambda kv: "/" in kv[0])
  return "  ".join(f"{k} {v:.3f}" for k, v in names)


def _print_summary(s: dict[str, Any], config) -> None:
  before = s["initial_eval"].get("eval/accuracy", float("nan"))
  after = s["final_eval"].get("eval/accuracy", float("nan"))
  lines = [
    "",
    f"GPPO {config.loss.divergence}-{config.loss.estimator} finished {s['iterations']} iterations "
    f"in {s['seconds']:.0f} s",
    f"  held-out greedy accuracy: {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} "
    "points)",
  ]
  for key in s["final_eval"]:
    if key != "eval/accuracy" and key in s["initial_eval"]:
      lines.append(f"  {key}: {s['initial_eval'][key]:.3f} -> {s['final_eval'][key]:.3f}")
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

  experiment.quiet_libraries(flags.FLAGS)
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
