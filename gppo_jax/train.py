"""GPPO training: the main entry point.

  python -m gppo_jax.train --config=configs/kl_atomic.py [--workdir=DIR] [--config.loss.delta=...]

Each iteration samples prompts, generates `group_size` responses per prompt with the KV-cached
sampler (keeping the behaviour log-probs), scores them, computes group-relative advantages and runs
one jitted update of epochs x mini-batches over that rollout batch (updates after the first are
off-policy: that is where the trust region acts). The Python loop only logs, evaluates and saves.
Rerunning with the same workdir resumes from the latest checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
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
  evaluate,
  metric_writers,
  partitioning,
  sampler,
  sharding,
  train_step,
)
from gppo_jax import model as model_lib

log = logging.getLogger("gppo_jax")


def default_workdir(config_path: str | None) -> str:
  """./workdirs/<config file name>[_<arg>] for `--config=configs/kl_atomic.py[:arg]`."""
  name = "run"
  if config_path:
    path, _, arg = str(config_path).partition(":")
    name = os.path.splitext(os.path.basename(path))[0] + (f"_{arg}" if arg else "")
  return os.path.join("workdirs", name.replace(",", "_").replace("=", "-"))


# --- Model and environment ----------------------------------------------------------------------


def build_policy(config, say=print, mesh=None):
  """(graphdef, params, model_cfg, env, info) for the config: built-in task or HF folder + data.

  With `mesh`, Hugging Face weights go straight to their sharded layout as they are read."""
  overrides = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype)
  if config.model.path is not None:
    from gppo_jax import hf_checkpoint

    if not os.path.isdir(config.model.path):
      raise FileNotFoundError(f"model.path={config.model.path!r} is not a folder")
    model, tokenizer = hf_checkpoint.load_pretrained(config.model.path, mesh=mesh, **overrides)
    env = envs.make_env(config, tokenizer)
    graphdef, params = nnx.split(model)
    return graphdef, params, model.cfg, env, {}
  env = envs.make_env(config)
  tok = env.tokenizer
  # The built-in policy's vocabulary is exactly the task's characters.
  cfg = model_lib.get_preset(
    config.model.preset,
    vocab_size=tok.vocab_size,
    bos_token_id=tok.bos_id,
    eos_token_ids=tok.eos_ids,
    pad_token_id=tok.pad_id,
    **overrides,
  )
  # The initial policy's seed (init and warm start); None = config.seed. Fixing it while seed
  # varies repeats RL from one starting policy (benchmarks/grid.py does).
  init_seed = config.warmstart.get("seed")
  init_seed = config.seed if init_seed is None else int(init_seed)
  model = model_lib.create(cfg, init_seed)
  graphdef, params = nnx.split(model)
  say(f"policy: preset {config.model.preset!r}, {model_lib.param_count(model):,} parameters")
  info = {}
  if config.warmstart.enabled:
    from gppo_jax import warmstart

    params, info = warmstart.warm_start(
      graphdef, params, env, cfg, config.warmstart, seed=init_seed, log=say
    )
  return graphdef, params, cfg, env, info


def _init_state(params, tx, mesh) -> tuple[Any, train_step.TrainState]:
  """(state shardings, TrainState on the mesh) with fresh optimizer state for `params`."""

  def init(p):
    return train_step.TrainState(params=p, opt_state=tx.init(p), step=jnp.zeros((), jnp.int32))

  state_sh = sharding.state_shardings(jax.eval_shape(init, params), mesh)
  params = jax.device_put(params, state_sh.params)
  return state_sh, jax.jit(init, out_shardings=state_sh, donate_argnums=0)(params)


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
  )


def _nan_guard(metrics: dict[str, float], iteration: int) -> None:
  bad = [
    k for k in ("loss/total", "optim/grad_norm") if k in metrics and not np.isfinite(metrics[k])
  ]
  if bad:
    raise FloatingPointError(
      f"non-finite {bad} at iteration {iteration}; the last good checkpoint is kept. Lower "
      "optim.lr or check the data."
    )


class _Preempted(Exception):
  pass


# --- The loop -----------------------------------------------------------------------------------


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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains per `config`, writing logs, checkpoints and a summary into `workdir`."""
  t_start = time.time()
  config_lib.validate(config)
  workdir, checkpoint_dir = split_workdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  is_main = jax.process_index() == 0
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  log.info("resolved config:\n%s", config)

  writer_holder: dict[str, metric_writers.MetricWriter] = {}

  def say(text: str) -> None:
    log.debug(text)
    if "w" in writer_holder:
      writer_holder["w"].print(text)
    elif is_main:
      print(text, file=sys.stderr, flush=True)

  # --- Policy, environment, optimizer -----------------------------------------------------------
  mesh = sharding.make_mesh(config.mesh)
  graphdef, init_params, model_cfg, env, warm_info = build_policy(config, say, mesh=mesh)
  tok = env.tokenizer
  stop_ids = tuple(model_cfg.eos_token_ids)
  pad_id = model_cfg.pad_token_id
  r = config.rollout
  tx = train_step.optimizer_from_config(config)
  # Parameters by the logical-axis rules, the optimizer state created in place beside them (a
  # policy whose Adam moments do not fit on one device never lands on one).
  state_sh, state = _init_state(init_params, tx, mesh)
  sampling = sampling_params(config, env, stop_ids=stop_ids, pad_id=pad_id)
  resp_len = sampling.max_new_tokens
  prompt_len = env.max_prompt_len
  loss_kwargs = train_step.loss_kwargs_from_config(config, resp_len)
  spec = train_step.update_spec_from_config(config, prompt_len)
  update_fn = train_step.make_update_fn(graphdef, tx, spec, loss_kwargs)
  logprob_fn = train_step.make_logprob_fn(
    graphdef, prompt_len=prompt_len, temperature=r.temperature
  )

  # A copy: the update donates the state's buffers.
  ref_params = jax.tree.map(jnp.copy, state.params) if config.loss.kl_coef > 0 else None
  n_rollouts = r.prompts_per_iter * r.group_size
  mesh_sampler = sharding.MeshSampler(graphdef, state_sh.params)  # rollouts and evals
  rows = sharding.process_rows(n_rollouts, mesh)  # this host's slice of every rollout batch

  def to_devices(batch):
    return sharding.shard_batch(jax.tree.map(lambda x: x[rows], batch), mesh)

  update = sharded_logprobs = None  # compiled on the first batch, whose shapes they need

  # --- Checkpoints: resume if the workdir has one ------------------------------------------------
  mngr = checkpointing.make_manager(checkpoint_dir, max_to_keep=config.checkpoint.keep)
  abstract = sharding.abstract_like(state, state_sh)
  start_step, restored, meta = checkpointing.restore_latest(mngr, abstract)
  base_key = jax.random.PRNGKey(config.seed)
  history: dict[str, Any] = {"warm_start": warm_info}
  start_iter = 0
  eval_key = jax.random.fold_in(base_key, 10**9)
  if restored is not None:
    state = restored
    start_iter = int(meta["iteration"])
    env.restore(meta["env"])
    history = meta.get("history", history)
    say(f"resumed from {mngr.directory} at iteration {start_iter}/{config.iterations}")
  else:
    say("evaluating the initial policy ...")
    history["initial_eval"] = evaluate.evaluate_policy(
      graphdef,
      state.params,
      env,
      eval_key,
      k=config.eval.k,
      temperature=config.eval.temperature,
      top_p=config.eval.top_p,
      max_new_tokens=resp_len,
      sample_fn=mesh_sampler,
    )
    say("initial policy: " + _fmt(history["initial_eval"]))

  writer = metric_writers.MetricWriter(
    workdir, total_steps=config.iterations, initial_step=start_iter
  )
  writer_holder["w"] = writer
  if restored is None:
    writer.write(0, history["initial_eval"])

  def save(iteration: int, wait: bool = False) -> None:
    meta = {
      "iteration": iteration,
      "env": env.state(),
      "history": history,
      "config": config.to_json_best_effort(),
    }
    checkpointing.save(mngr, iteration, state, meta, wait=wait)

  def on_sigterm(signum, frame):
    raise _Preempted()

  # Every process: Orbax saves are collective on multi-host slices.
  old_handler = signal.signal(signal.SIGTERM, on_sigterm)
  iteration = start_iter
  last_eval = history.get("last_eval", history.get("initial_eval", {}))
  try:
    for iteration in range(start_iter, config.iterations):
      t0 = time.time()
      key = jax.random.fold_in(base_key, iteration)
      prompts = env.train_prompts(r.prompts_per_iter)
      rep = [p for p in prompts for _ in range(r.group_size)]
      p_tok, p_mask = sampler.left_pad([p.token_ids for p in rep], pad_id=pad_id, length=prompt_len)
      out = mesh_sampler(state.params, p_tok, p_mask, jax.random.fold_in(key, 0), sampling)
      texts = evaluate.decode_responses(tok, out.tokens, out.mask, stop_ids)
      t_rollout = time.time() - t0
      rewards, valid, reward_metrics = env.score(texts, rep)
      correct = rewards
      rewards, shaping_metrics = envs.shape_rewards(
        rewards,
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
      if spec.use_topk:
        batch.update(topk_logq=out.topk_logprobs, topk_ids=out.topk_ids)
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
      upd = train_step.summarize_update_metrics(jax.device_get(upd))
      t_update = time.time() - t1
      metrics = {
        "reward/mean": float(np.mean(rewards)),
        "reward/correct_mean": float(np.mean(correct)),
        "reward/std": float(np.std(rewards)),
        "response/length_mean": float(np.mean(out.lengths)),
        "response/truncated_frac": float(np.mean(out.lengths >= resp_len)),
        "time/rollout_s": t_rollout,
        "time/update_s": t_update,
        "time/iteration_s": time.time() - t0,
        "optim/steps": float(state.step),
        **{k: float(v) for k, v in adv_metrics.items()},
        **reward_metrics,
        **upd,
      }
      _nan_guard(metrics, iteration + 1)
      done = iteration + 1
      if done % config.eval.every == 0 or done == config.iterations:
        last_eval = evaluate.evaluate_policy(
          graphdef,
          state.params,
          env,
          eval_key,
          k=config.eval.k,
          temperature=config.eval.temperature,
          top_p=config.eval.top_p,
          max_new_tokens=resp_len,
          sample_fn=mesh_sampler,
        )
        history["last_eval"] = last_eval
        history.setdefault("evals", []).append({"iteration": done, **last_eval})
        metrics.update(last_eval)
        say(f"iteration {done}: " + _fmt(last_eval))
      if done % config.log_every == 0:
        writer.write(done, metrics)
      writer.advance()
      if done % config.checkpoint.every == 0 or done == config.iterations:
        save(done)
    iteration = config.iterations
  except (_Preempted, KeyboardInterrupt):
    say(f"interrupted: saving a checkpoint at iteration {iteration} before exiting")
    save(iteration, wait=True)
    writer.close()
    env.close()
    raise
  finally:
    if old_handler is not None:
      signal.signal(signal.SIGTERM, old_handler)
  mngr.wait_until_finished()
  writer.close()

  if config.model.export_hf and config.model.path is not None:
    from gppo_jax import hf_checkpoint

    params = sharding.to_host(state.params)  # collective on multi-host: every process calls it
    if is_main:
      out_dir = os.path.join(workdir, "hf_export")
      hf_checkpoint.save_model(nnx.merge(graphdef, params), out_dir, source=config.model.path)
      say(f"exported the trained policy to {out_dir}")
  env.close()
  summary = {
    "workdir": workdir,
    "iterations": config.iterations,
    "seconds": time.time() - t_start,
    "warm_start": warm_info,
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


def evaluate_checkpoint(config, workdir: str, which: str = "latest") -> dict[str, Any]:
  """Evaluates a policy on the config's held-out set(s); returns the report as a dict.

  which: "latest" (the workdir's latest checkpoint), "init" (the initial / warm-started policy),
  the path of another run's workdir, or a Hugging Face folder (e.g. a run's hf_export).
  """
  mesh = sharding.make_mesh(config.mesh)
  graphdef, params, _, env, _ = build_policy(config, say=lambda t: log.info(t), mesh=mesh)
  if which != "init":
    source = workdir if which == "latest" else which
    is_hf = (
      "://" not in source
      and os.path.isdir(source)
      and any(f.endswith(".safetensors") for f in os.listdir(source))
    )  # a run's workdir has a config.json too, but no weights beside it
    if is_hf:
      from gppo_jax import hf_checkpoint

      model = hf_checkpoint.load_model(
        source, mesh=mesh, dtype=config.model.dtype, param_dtype=config.model.param_dtype
      )
      graphdef, params = nnx.split(model)
    else:
      mngr = checkpointing.make_manager(split_workdir(source)[1])
      tx = train_step.optimizer_from_config(config)
      state = jax.eval_shape(
        lambda p: train_step.TrainState(p, tx.init(p), jnp.zeros((), jnp.int32)), params
      )
      # Restored straight onto the mesh: a policy too big for one device never lands on one.
      abstract = sharding.abstract_like(state, sharding.state_shardings(state, mesh))
      _, restored, _ = checkpointing.restore_latest(mngr, abstract)
      if restored is None:
        raise FileNotFoundError(
          f"no checkpoint under {split_workdir(source)[1]} (and no *.safetensors for a Hugging "
          "Face folder); --checkpoint takes latest, init, a run's workdir or an HF folder"
        )
      params = restored.params
  param_sh = partitioning.state_shardings(params, mesh, partitioning.DEFAULT_RULES)
  params = jax.device_put(params, param_sh)
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 10**9)
  max_new = sampling_params(config, env, stop_ids=(), pad_id=0).max_new_tokens
  e = config.eval
  metrics = evaluate.evaluate_policy(
    graphdef,
    params,
    env,
    key,
    k=e.k,
    temperature=e.temperature,
    top_p=e.top_p,
    max_new_tokens=max_new,
    sample_fn=sharding.MeshSampler(graphdef, param_sh),
  )
  env.close()
  return {
    "checkpoint": which,
    "num_problems": len(env.eval_prompts()),
    "decoding": {
      "greedy": True,
      "k": e.k,
      "temperature": e.temperature,
      "top_p": e.top_p,
      "max_new_tokens": max_new,
    },
    **metrics,
  }


def quiet_libraries(flag_values) -> None:
  """Orbax and JAX log every checkpoint step at INFO: show WARNING and up from them, INFO from us.

  absl rewrites an unset --verbosity to INFO once flags are parsed, so `present` (given on the
  command line), not `using_default_value`, says whether the user asked for a level.
  """
  from absl import logging as absl_logging

  if not flag_values["verbosity"].present:
    absl_logging.set_verbosity(absl_logging.WARNING)
    log.setLevel(logging.INFO)  # the resolved config, the policy summary


def main(argv):
  del argv
  from absl import flags
  from ml_collections import config_flags

  quiet_libraries(flags.FLAGS)
  config = flags.FLAGS.config
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  train_and_evaluate(config, flags.FLAGS.workdir or default_workdir(path))


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  sharding.maybe_initialize_distributed()  # before the config file runs any jax code
  config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py[:arg]).")
  flags.DEFINE_string("workdir", None, "Run folder (default ./workdirs/<config name>).")
  flags.mark_flags_as_required(["config"])
  app.run(main)
