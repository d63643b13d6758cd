"""One rollout step: prompts -> responses -> rewards -> advantages, as a typed `train_step.Batch`.

  batch, metrics = rollout.collect(config, env, sample_fn, params, key, sampling,
                                   prompt_len=P, pad_id=0, use_topk=False)

A generation round draws `rollout.prompts_per_iter` prompts from the environment, samples
`rollout.group_size` responses for each (`sample_fn`, a `sampler.MeshSampler`, keeps the behaviour
log-probs), scores them (`env.score`: math-verify or the code sandbox) and shapes the rewards
(DAPO's soft overlong penalty, a format bonus). Then, per group of G responses to one prompt:

- invalid scores (an infrastructure error, never the policy's fault) take the group's mean reward,
  so they carry no advantage, and are left out of the loss;
- `advantage.filter_zero_signal`: a group whose rewards are all equal has zero advantage
  everywhere; it is left out of the loss. With `rollout.refill_rounds = n > 0` (DAPO's dynamic
  sampling) up to n further rounds are generated and the batch is filled with groups that carry
  signal, in the order drawn; only if the rounds run out are zero-signal groups kept (masked);
- `reward.overlong_filter`: responses cut off at the length limit (no stop token) keep their
  reward in the group's advantage but are left out of the loss (DAPO's overlong filtering).

The batch always has prompts_per_iter x group_size rows, so the update compiles once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from gppo_jax.algorithm import advantages
from gppo_jax.data import envs
from gppo_jax.generation import sampler
from gppo_jax.trainer import policy_eval, train_step

# One dispatch per round (eagerly, fold_in is three dispatches).
_fold_in = jax.jit(jax.random.fold_in)


@dataclasses.dataclass
class Groups:
  """Responses of `n` prompts x `g` samples, host side, rows grouped by prompt (n * g rows)."""

  prompt_tokens: np.ndarray  # int32 [n*g, P], left-padded
  prompt_mask: np.ndarray  # bool [n*g, P]
  out: sampler.SampleOutput  # numpy fields, [n*g, R]
  correct: np.ndarray  # float32 [n*g]: task reward (1 = correct)
  valid: np.ndarray  # bool [n*g]: the score is real (no infrastructure error)
  rewards: np.ndarray  # float32 [n*g]: after shaping
  truncated: np.ndarray  # bool [n*g]: hit the length limit without a stop token
  group_size: int

  @property
  def num_groups(self) -> int:
    return len(self.rewards) // self.group_size

  def by_group(self, x: np.ndarray) -> np.ndarray:
    return x.reshape(self.num_groups, self.group_size, *x.shape[1:])

  def take(self, groups: np.ndarray) -> Groups:
    """The given groups (indices), in that order."""
    rows = (np.asarray(groups)[:, None] * self.group_size + np.arange(self.group_size)).reshape(-1)
    pick = lambda x: None if x is None else np.asarray(x)[rows]
    return Groups(
      prompt_tokens=self.prompt_tokens[rows],
      prompt_mask=self.prompt_mask[rows],
      out=jax.tree.map(pick, self.out),
      correct=self.correct[rows],
      valid=self.valid[rows],
      rewards=self.rewards[rows],
      truncated=self.truncated[rows],
      group_size=self.group_size,
    )

  @staticmethod
  def concat(parts: Sequence[Groups]) -> Groups:
    if len(parts) == 1:
      return parts[0]
    cat = lambda *xs: None if xs[0] is None else np.concatenate(xs, axis=0)
    return Groups(
      prompt_tokens=cat(*(p.prompt_tokens for p in parts)),
      prompt_mask=cat(*(p.prompt_mask for p in parts)),
      out=jax.tree.map(cat, *(p.out for p in parts)),
      correct=cat(*(p.correct for p in parts)),
      valid=cat(*(p.valid for p in parts)),
      rewards=cat(*(p.rewards for p in parts)),
      truncated=cat(*(p.truncated for p in parts)),
      group_size=parts[0].group_size,
    )


def truncated_rows(out: sampler.SampleOutput, stop_ids: Sequence[int]) -> np.ndarray:
  """bool [B]: responses that filled every slot without ending on a stop token."""
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  full = lengths >= tokens.shape[1]
  last = tokens[:, -1]
  return full & ~np.isin(last, np.asarray(stop_ids, last.dtype))


def generate(
  config, env, sample_fn: Callable, params, key, sampling, *, prompt_len: int, pad_id: int
) -> tuple[Groups, dict[str, float]]:
  """One generation round: prompts_per_iter prompts x group_size responses, scored and shaped.

  Returns (groups, metrics): the reward metrics of env.score and the shaping, and time/* entries
  for sampling and scoring."""
  r = config.rollout
  t0 = time.perf_counter()
  prompts = env.train_prompts(r.prompts_per_iter)
  rep = [p for p in prompts for _ in range(r.group_size)]
  p_tok, p_mask = sampler.left_pad([p.token_ids for p in rep], pad_id=pad_id, length=prompt_len)
  out = jax.tree.map(np.asarray, sample_fn(params, p_tok, p_mask, key, sampling))
  t1 = time.perf_counter()
  groups, metrics = score(config, env, rep, p_tok, p_mask, out, sampling)
  if hasattr(sample_fn, "metrics"):  # the continuous engine's figures (rollout/engine/*)
    metrics.update(sample_fn.metrics())
  metrics["time/sample_s"] = t1 - t0
  metrics["time/reward_s"] = time.perf_counter() - t1
  return groups, metrics


def score(
  config, env, prompts: Sequence, p_tok: np.ndarray, p_mask: np.ndarray, out, sampling
) -> tuple[Groups, dict[str, float]]:
  """Scores and shapes sampled responses (`out`, numpy, one row per entry of `prompts`, in
  groups of rollout.group_size): (groups, env.score's and the shaping's metrics)."""
  texts = policy_eval.decode_responses(env.tokenizer, out.tokens, out.mask, sampling.stop_ids)
  correct, valid, metrics = env.score(texts, prompts)
  rewards, shaping_metrics = envs.shape_rewards(
    correct,
    texts,
    out.lengths,
    max_len=sampling.max_new_tokens,
    overlong_buffer=config.reward.overlong_buffer,
    format_coef=config.reward.format_coef,
    answer_format=config.reward.get("answer_format", "boxed"),
  )
  metrics.update(shaping_metrics)
  groups = Groups(
    prompt_tokens=p_tok,
    prompt_mask=p_mask,
    out=out,
    correct=np.asarray(correct, np.float32),
    valid=np.asarray(valid, bool),
    rewards=np.asarray(rewards, np.float32),
    truncated=truncated_rows(out, sampling.stop_ids),
    group_size=config.rollout.group_size,
  )
  return groups, metrics


def fill_rewards(groups: Groups) -> np.ndarray:
  """float32 [n, g] rewards in which invalid scores take their group's mean of the valid ones."""
  rewards, valid = groups.by_group(groups.rewards), groups.by_group(groups.valid)
  with np.errstate(invalid="ignore"):
    mean = np.nanmean(np.where(valid, rewards, np.nan), axis=1, keepdims=True)
  return np.where(valid, rewards, np.nan_to_num(mean)).astype(np.float32)


# The advantage estimators and the signal test, each one compiled program per batch shape: eager,
# they are a dozen tiny XLA programs, each compiled on first use at every start-up and
# dispatched on its own every iteration. The estimator is passed as the function itself, so a
# name registered again (overwrite=True) compiles the new one.
_signal_mask = jax.jit(advantages.signal_mask)
_advantages = jax.jit(advantages.compute, static_argnums=0, static_argnames=("eps", "ddof"))


def has_signal(groups: Groups) -> np.ndarray:
  """bool [n]: groups whose (filled) rewards are not all equal."""
  return np.asarray(_signal_mask(fill_rewards(groups)))


def collect(
  config,
  env,
  sample_fn: Callable,
  params,
  key: jax.Array,
  sampling: sampler.SamplingParams,
  *,
  prompt_len: int,
  pad_id: int,
  use_topk: bool = False,
) -> tuple[train_step.Batch, dict[str, float]]:
  """Generation round(s) -> the host-side rollout batch (numpy) and its metrics (see the module)."""
  r, a = config.rollout, config.advantage
  need = r.prompts_per_iter
  rounds, metric_rows, signals = [], [], []
  refill = r.refill_rounds if a.filter_zero_signal else 0
  for i in range(1 + refill):
    groups, m = generate(
      config,
      env,
      sample_fn,
      params,
      _fold_in(key, i),
      sampling,
      prompt_len=prompt_len,
      pad_id=pad_id,
    )
    rounds.append(groups)
    metric_rows.append(m)
    signals.append(has_signal(groups))  # per group: each round's once, one shape compiled
    if sum(int(s.sum()) for s in signals) >= need:
      break
  metrics = mean_rows(metric_rows)
  for k in ("time/sample_s", "time/reward_s"):  # totals over the rounds, not means
    metrics[k] = float(sum(m[k] for m in metric_rows))
  metrics["rollout/rounds"] = float(len(rounds))
  return assemble(config, Groups.concat(rounds), np.concatenate(signals), metrics, use_topk)


def assemble(
  config, pool: Groups, signal: np.ndarray, metrics: dict[str, float], use_topk: bool = False
) -> tuple[train_step.Batch, dict[str, float]]:
  """The batch of rollout.prompts_per_iter groups from `pool` (the groups drawn, in order, with
  `signal`: bool per group, `has_signal`) and its metrics (`metrics`, the rounds', updated)."""
  a, need = config.advantage, config.rollout.prompts_per_iter
  if pool.num_groups > need:
    # Groups with signal first, in the order drawn; then zero-signal ones (masked) if short.
    order = np.concatenate([np.flatnonzero(signal), np.flatnonzero(~signal)])[:need]
  else:
    order = np.arange(need)
  batch_groups = pool.take(order)
  kept_signal = signal[order]

  rewards_g = fill_rewards(batch_groups)
  adv_kwargs = {}
  if a.name in ("grpo", "batch_std"):
    adv_kwargs = dict(eps=a.eps, ddof=a.ddof)
  adv, adv_metrics = jax.device_get(_advantages(advantages.get(a.name), rewards_g, **adv_kwargs))
  keep = batch_groups.valid.copy()
  if a.filter_zero_signal:
    keep &= np.repeat(kept_signal, batch_groups.group_size)
  if config.reward.overlong_filter:
    keep &= ~batch_groups.truncated
  out = batch_groups.out
  optional = {}
  if use_topk:
    optional = dict(topk_logq=out.topk_logprobs, topk_ids=out.topk_ids)
  if out.kept_ids is not None:  # logprobs_mode "sampled": the set the update renormalises over
    optional["kept_ids"] = out.kept_ids
  if out.expert_ids is not None:  # rollout.routing_replay: the experts the update reuses
    optional["expert_ids"] = out.expert_ids
  batch = train_step.build_batch(
    batch_groups.prompt_tokens,
    batch_groups.prompt_mask,
    out.tokens,
    out.mask,
    logq=out.logprobs,
    adv=np.asarray(adv, np.float32).reshape(-1),
    loss_mask=out.mask & keep[:, None],
    **optional,
  )
  metrics = dict(metrics)
  metrics.update({k: float(v) for k, v in adv_metrics.items()})
  # The policy's figures over every response drawn (each round is an unbiased sample of it).
  metrics.update(
    {
      "reward/mean": float(np.mean(pool.rewards)),
      "reward/correct_mean": float(np.mean(pool.correct)),
      "reward/std": float(np.std(pool.rewards)),
      "response/length_mean": float(np.mean(pool.out.lengths)),
      "response/truncated_frac": float(np.mean(pool.truncated)),
      "rollout/groups_sampled": float(pool.num_groups),
      "rollout/signal_groups_frac": float(np.mean(kept_signal)),
      "rollout/loss_rows_frac": float(np.mean(keep)),
    }
  )
  if pool.out.entropy is not None and np.any(pool.out.mask):
    # The policy's mean entropy per sampled token (of the tempered distribution drawn from).
    metrics["rollout/entropy"] = float(
      np.sum(np.where(pool.out.mask, pool.out.entropy, 0.0)) / np.sum(pool.out.mask)
    )
  return batch, metrics


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
  """Each metric's mean over the rows that have it."""
  keys = {k for row in rows for k in row}
  return {k: float(np.mean([row[k] for row in rows if k in row])) for k in sorted(keys)}
