"""Supervised warm start of the built-in policy, so that RL starts with signal.

The tiny policy is trained with cross-entropy on (prompt, answer) pairs of the built-in task and
stopped as soon as its greedy held-out accuracy reaches a threshold (checked every `eval_every`
steps: supervised accuracy jumps steeply). The result is cached on disk, keyed by everything that
determines it, so later runs start in seconds. No weights or data from elsewhere are involved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time

import jax
import numpy as np
import optax
from flax import nnx

from gppo_jax.data.envs import BuiltinEnv
from gppo_jax.models import sharding
from gppo_jax.trainer import checkpointing, policy_eval, train_step

CACHE_VERSION = 1


def _cache_key(env: BuiltinEnv, model_cfg, ws_cfg, seed: int) -> str:
  desc = {
    "version": CACHE_VERSION,
    "task": repr(dataclasses.replace(env.task, description="")),  # the problems, not the prose
    # Whether the layers are scanned or unrolled is how they compile, not what they learn (and
    # leaving it out keeps the caches written before the field existed).
    "model": {k: v for k, v in dataclasses.asdict(model_cfg).items() if k != "scan_layers"},
    "warmstart": {
      k: ws_cfg[k]
      for k in ("target_accuracy", "max_steps", "eval_every", "eval_size", "batch_size", "lr")
    },
    # The schedule's fields only where they differ from plain Adam at lr, so that the entries
    # cached before the fields existed keep their keys.
    **({"schedule": _schedule(ws_cfg)} if _schedule(ws_cfg) != _PLAIN else {}),
    # The supervised rows are padded to the env's response length: a policy trained at another
    # length is another policy (the key leaves it out at the task's own length, as before).
    **(
      {"max_new_tokens": env.max_new_tokens}
      if env.max_new_tokens != env.task.max_answer_len + 1
      else {}
    ),
    "seed": seed,
  }
  blob = json.dumps(desc, sort_keys=True, default=str).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


def supervised_batch(env: BuiltinEnv, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
  """Teacher-forcing arrays for BOS + prompt + answer + EOS, loss on the answer and EOS (the
  answer: the problem's worked solution where it has one, word tasks)."""
  tok = env.tokenizer
  problems = env.task.sample(rng, n, split="train")
  length = env.max_prompt_len + env.max_new_tokens
  tokens = np.full((n, length), tok.pad_id, np.int32)
  attn = np.zeros((n, length), bool)
  loss_mask = np.zeros((n, length), bool)
  for i, p in enumerate(problems):
    prompt = tok.encode(p.prompt, add_bos=True)
    answer = tok.encode(p.solution or p.answer) + [tok.eos_id]
    start = env.max_prompt_len - len(prompt)  # Left-pad prompts exactly as the sampler sees them.
    seq = prompt + answer
    tokens[i, start : start + len(seq)] = seq
    attn[i, start : start + len(seq)] = True
    loss_mask[i, env.max_prompt_len : env.max_prompt_len + len(answer)] = True
  positions = np.maximum(np.cumsum(attn, axis=1) - 1, 0).astype(np.int32)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "positions": positions[:, :-1],
    "attn": attn[:, :-1],
    "loss_mask": loss_mask[:, 1:],
  }


_PLAIN = (0, 1.0, None, 0.0)  # (warmup_steps, final_lr_fraction, decay_steps, clip_norm)


def _schedule(ws_cfg) -> tuple[int, float, int | None, float]:
  """(warmup_steps, final_lr_fraction, decay_steps or None without decay, clip_norm)."""
  frac = float(ws_cfg.get("final_lr_fraction", 1.0))
  decay = int(ws_cfg.get("decay_steps", 1)) if frac != 1.0 else None
  return int(ws_cfg.get("warmup_steps", 0)), frac, decay, float(ws_cfg.get("clip_norm", 0.0))


def make_optimizer(lr: float, schedule=_PLAIN) -> optax.GradientTransformation:
  """Adam at lr, or with `schedule` (see _schedule) a linear warmup, a cosine decay to
  lr * final_lr_fraction at decay_steps and clipping of the gradient's global norm."""
  warmup, frac, decay, clip = schedule
  if (warmup, frac, clip) == (0, 1.0, 0.0):
    return optax.adam(lr)  # exactly the recipe of the entries cached before the schedule
  if decay is None:
    rate = optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
    )
  else:
    rate = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(decay, warmup + 1), lr * frac)
  tx = optax.adam(rate)
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip > 0 else tx


@sharding.reuse
def _sft(graphdef, lr: float, schedule=_PLAIN):
  """Adam, its init as one program (not one eager op per leaf shape) and the supervised step;
  the same functions for the next warm start of this shape in the process."""
  tx = make_optimizer(lr, schedule)
  return tx, jax.jit(tx.init), train_step.make_sft_step(graphdef, tx)


def _judge(info: dict, ws_cfg) -> dict:
  """info with the target and whether it was missed; a miss is logged as a warning."""
  info = {**info, "target_accuracy": float(ws_cfg.target_accuracy)}
  info["missed_target"] = bool(info["accuracy"] < ws_cfg.target_accuracy)
  if info["missed_target"] and jax.process_index() == 0:  # one report per run, as the summary
    logging.getLogger("gppo_jax").warning(
      "warm start MISSED its target: held-out greedy accuracy %.3f < %.2f after %d supervised "
      "steps (warmstart.max_steps=%d). RL starts from this weaker policy; the run's summary "
      "records warm_start.missed_target, and `python -m gppo_jax.sweep` reports its seed apart.",
      info["accuracy"],
      info["target_accuracy"],
      info["steps"],
      ws_cfg.max_steps,
    )
  return info


def _everywhere(flag: bool) -> bool:
  """Whether `flag` holds on every process of the run (the flag itself on one process)."""
  return sharding.global_max(0 if flag else 1) == 0


def warm_start(
  graphdef: nnx.GraphDef, params, env: BuiltinEnv, model_cfg, ws_cfg, *, seed: int, log=print
):
  """Returns (params, info) after supervised training to ws_cfg.target_accuracy (or max_steps).

  info: accuracy (held-out greedy), steps, seconds, loss, target_accuracy and missed_target (the
  accuracy ended below the target: warned here, recorded in the run's summary)."""
  cache_dir = os.path.expanduser(ws_cfg.cache_dir) if ws_cfg.cache_dir else ""
  path = os.path.join(cache_dir, _cache_key(env, model_cfg, ws_cfg, seed)) if cache_dir else ""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  # The processes of a multi-host run use the cached entry only if every one of them has it and
  # reads it: one loading while another trains would run other collectives and hang (hosts keep
  # their own ~/.cache, and a host that ran alone before has an entry the others lack).
  if _everywhere(bool(path) and os.path.isdir(path)):
    restored, info = None, None
    try:
      mngr = checkpointing.make_manager(path, max_to_keep=1)
      _, restored, info = checkpointing.restore_latest(mngr, abstract)
    except Exception as e:  # A broken cache entry is rebuilt, never trusted.
      logging.warning("warm-start cache %s unreadable (%s); retraining", path, e)
    if restored is None:  # broken, or no complete save in it (a killed run's): rebuilt
      shutil.rmtree(path, ignore_errors=True)
    if _everywhere(restored is not None):
      log(
        f"warm start: loaded cached policy from {path} (held-out accuracy "
        f"{info['accuracy']:.3f} after {info['steps']} supervised steps)"
      )
      return restored, _judge(info, ws_cfg)
    if restored is not None:
      log(f"warm start: the cache entry {path} is not readable on every process; retraining")

  tx, init, step_fn = _sft(graphdef, ws_cfg.lr, _schedule(ws_cfg))
  opt_state = init(params)
  rng = np.random.default_rng([seed, 7])
  eval_prompts = env.eval_prompts()[: ws_cfg.eval_size]

  t0 = time.time()
  acc, steps, loss = 0.0, 0, float("nan")
  key = jax.random.PRNGKey(seed)
  for steps in range(1, ws_cfg.max_steps + 1):
    batch = supervised_batch(env, rng, ws_cfg.batch_size)
    params, opt_state, loss = step_fn(params, opt_state, batch)
    if steps % ws_cfg.eval_every == 0 or steps == ws_cfg.max_steps:
      acc = policy_eval.evaluate_policy(graphdef, params, env, key, k=0, prompts=eval_prompts)[
        "eval/accuracy"
      ]
      log(
        f"warm start: step {steps:4d}  loss {float(loss):.3f}  held-out greedy accuracy "
        f"{acc:.3f} (target {ws_cfg.target_accuracy:.2f})"
      )
      if acc >= ws_cfg.target_accuracy:
        break
  info = {
    "accuracy": float(acc),
    "steps": int(steps),
    "seconds": time.time() - t0,
    "loss": float(loss),
  }
  info = _judge(info, ws_cfg)
  if not path:
    return params, info
  # Saved only where no process holds the entry (a save into a folder that some processes already
  # hold would not take the same collective steps on all of them).
  if not _everywhere(not os.path.isdir(path)):
    logging.warning(
      "warm start: not cached at %s (an entry appeared there during training, or another "
      "process holds one); continuing with this policy",
      path,
    )
    return params, info
  try:
    mngr = checkpointing.make_manager(path, max_to_keep=1)
    checkpointing.save(mngr, steps, params, info, wait=True)
    log(f"warm start: cached at {path}")
  except Exception as e:  # e.g. a parallel run cached the same entry first: train on regardless
    logging.warning("warm start: not cached at %s (%s); continuing with this policy", path, e)
  return params, info
