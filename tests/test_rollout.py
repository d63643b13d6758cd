"""rollout.collect: the batch it builds, DAPO's dynamic sampling (refill) and overlong filtering.

A scripted environment and sampler stand in for the policy, so each test knows which groups carry
signal, which responses were cut off and which scores failed."""

import jax
import numpy as np
import pytest

from gppo_jax import config_lib
from gppo_jax.data.envs import Prompt
from gppo_jax.generation import sampler
from gppo_jax.trainer import rollout

R = 4  # response slots
STOP = 1


class _Tok:
  def decode(self, ids):
    return " ".join(str(i) for i in ids)


class ScriptedEnv:
  """Prompt i (in draw order) is `kind[i % len(kind)]`: 'all' = every response correct,
  'none' = every one wrong, 'mixed' = the first half correct (signal), 'err' = mixed with one
  invalid score."""

  tokenizer = _Tok()
  max_prompt_len = 3
  max_new_tokens = R

  def __init__(self, kinds):
    self.kinds = kinds
    self.drawn = 0

  def train_prompts(self, n):
    out = []
    for _ in range(n):
      kind = self.kinds[self.drawn % len(self.kinds)]
      out.append(Prompt(token_ids=[5, 6 + self.drawn % 7], gold=kind, text=str(self.drawn)))
      self.drawn += 1
    return out

  def score(self, texts, prompts):
    correct = np.zeros(len(prompts), np.float32)
    valid = np.ones(len(prompts), bool)
    g = len(prompts) // len({id(p) for p in prompts})
    for i, p in enumerate(prompts):
      j = i % g
      correct[i] = {"all": 1.0, "none": 0.0}.get(p.gold, float(j < g // 2))
      if p.gold == "err" and j == 0:
        valid[i] = False
    return correct, valid, {"reward/scored": float(len(prompts))}


def scripted_sampler(truncate_every=0, entropy=False):
  """Responses of length 2 ending with STOP; with truncate_every=k every k-th row fills all R
  slots without a stop token; with entropy, per-token entropies 1 (first token) and 3 (the
  others), 99 past the response (never to be counted)."""

  def sample(params, p_tok, p_mask, key, sampling):
    b = p_tok.shape[0]
    tokens = np.full((b, R), 0, np.int32)
    mask = np.zeros((b, R), bool)
    tokens[:, 0], tokens[:, 1] = 7, STOP
    mask[:, :2] = True
    if truncate_every:
      rows = np.arange(b) % truncate_every == 0
      tokens[rows] = 8
      mask[rows] = True
    lp = np.where(mask, -0.5, 0.0).astype(np.float32)
    ent = None
    if entropy:
      ent = np.where(mask, 3.0, 99.0).astype(np.float32)
      ent[:, 0] = 1.0
    return sampler.SampleOutput(
      tokens=tokens, logprobs=lp, mask=mask, lengths=mask.sum(1), entropy=ent
    )

  return sample


def config(prompts=4, group=4, **overrides):
  c = config_lib.base()
  c.rollout.prompts_per_iter = prompts
  c.rollout.group_size = group
  c.rollout.max_new_tokens = R
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  config_lib.validate(c)
  return c


def collect(c, env, sample_fn=None):
  sampling = sampler.SamplingParams(R, stop_ids=(STOP,))
  return rollout.collect(
    c,
    env,
    sample_fn or scripted_sampler(),
    None,
    jax.random.PRNGKey(0),
    sampling,
    prompt_len=env.max_prompt_len,
    pad_id=0,
  )


def groups_of(batch, g):
  """Per group: whether any of its rows is in the loss."""
  return batch.mask.any(axis=1).reshape(-1, g).any(axis=1)


def test_batch_rows_and_shapes():
  env = ScriptedEnv(["mixed"])
  batch, m = collect(config(), env)
  n = 16
  assert batch.inputs.shape == (n, env.max_prompt_len + R - 1)
  assert batch.logq.shape == batch.mask.shape == (n, R) and batch.adv.shape == (n,)
  # Group-relative advantages: first half of each group correct -> positive, rest negative.
  adv = batch.adv.reshape(4, 4)
  assert np.all(adv[:, :2] > 0) and np.all(adv[:, 2:] < 0)
  np.testing.assert_allclose(adv.sum(axis=1), 0, atol=1e-5)
  assert m["rollout/rounds"] == 1 and m["reward/mean"] == pytest.approx(0.5)
  assert m["time/sample_s"] >= 0 and m["time/reward_s"] >= 0


def test_the_policys_entropy_is_the_mean_over_sampled_tokens():
  env = ScriptedEnv(["mixed"])
  _, m = collect(config(), env, scripted_sampler(truncate_every=4, entropy=True))
  # 16 rows: 4 truncated ones of R tokens (1 + 3 (R - 1)), 12 of 2 tokens (1 + 3).
  total, count = 4 * (1 + 3 * (R - 1)) + 12 * 4, 4 * R + 12 * 2
  assert m["rollout/entropy"] == pytest.approx(total / count)
  _, m = collect(config(), env)  # a sampler that reports no entropy: no figure, no NaN
  assert "rollout/entropy" not in m


def test_zero_signal_groups_are_masked_without_refill():
  env = ScriptedEnv(["all", "mixed", "none", "mixed"])
  c = config(**{"advantage.filter_zero_signal": True})
  batch, m = collect(c, env)
  np.testing.assert_array_equal(groups_of(batch, 4), [False, True, False, True])
  assert m["rollout/rounds"] == 1 and m["rollout/signal_groups_frac"] == 0.5
  assert env.drawn == 4


def test_refill_fills_the_batch_with_signal_groups_in_draw_order():
  env = ScriptedEnv(["all", "mixed", "none", "mixed"])
  c = config(**{"advantage.filter_zero_signal": True, "rollout.refill_rounds": 3})
  batch, m = collect(c, env)
  # Round 1 has 2 signal groups, round 2 two more: the batch is full after two rounds.
  assert m["rollout/rounds"] == 2 and m["rollout/groups_sampled"] == 8 and env.drawn == 8
  assert groups_of(batch, 4).all() and m["rollout/signal_groups_frac"] == 1.0
  # Every group in the batch is a 'mixed' one: half its rows have positive advantage.
  assert np.all((batch.adv.reshape(4, 4) > 0).sum(axis=1) == 2)
  # The policy's reward figure counts every response drawn, not only the kept ones.
  assert m["reward/mean"] == pytest.approx((4 + 0 + 2 + 2) * 2 / 32)


def test_refill_stops_at_the_cap_and_keeps_zero_signal_groups_masked():
  env = ScriptedEnv(["all", "none", "none", "mixed"])  # one signal group per round
  c = config(**{"advantage.filter_zero_signal": True, "rollout.refill_rounds": 2})
  batch, m = collect(c, env)
  assert m["rollout/rounds"] == 3 and env.drawn == 12
  assert groups_of(batch, 4).sum() == 3 and batch.adv.shape == (16,)
  assert m["rollout/signal_groups_frac"] == 0.75


def test_refill_needs_filter_zero_signal():
  with pytest.raises(Exception, match="filter_zero_signal"):
    config(**{"rollout.refill_rounds": 2})


def test_overlong_filter_masks_truncated_responses_but_keeps_their_reward():
  env = ScriptedEnv(["mixed"])
  plain, m0 = collect(config(), env, scripted_sampler(truncate_every=4))
  env = ScriptedEnv(["mixed"])
  c = config(**{"reward.overlong_filter": True})
  filtered, m1 = collect(c, env, scripted_sampler(truncate_every=4))
  truncated = np.arange(16) % 4 == 0
  assert plain.mask[truncated].any() and not filtered.mask[truncated].any()
  np.testing.assert_array_equal(filtered.mask[~truncated], plain.mask[~truncated])
  np.testing.assert_allclose(filtered.adv, plain.adv)  # still counted in the group's baseline
  assert m0["response/truncated_frac"] == m1["response/truncated_frac"] == 0.25


def test_a_stop_token_in_the_last_slot_is_not_truncation():
  out = sampler.SampleOutput(
    tokens=np.array([[7, 7, 7, STOP], [7, 7, 7, 7], [7, STOP, 0, 0]], np.int32),
    logprobs=np.zeros((3, R), np.float32),
    mask=np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], bool),
    lengths=np.array([4, 4, 2]),
  )
  np.testing.assert_array_equal(rollout.truncated_rows(out, (STOP,)), [False, True, False])


def test_invalid_scores_take_the_group_mean_and_leave_the_loss():
  env = ScriptedEnv(["err"])
  batch, _ = collect(config(), env)
  invalid = np.arange(16) % 4 == 0
  assert not batch.mask[invalid].any() and batch.mask[~invalid].any()
  # The invalid row got its group's mean of the valid rewards, (1 + 0 + 0) / 3, so its advantage
  # sits between the correct and the wrong rows'.
  adv = batch.adv.reshape(4, 4)
  assert np.all((adv[:, 0] < adv[:, 1]) & (adv[:, 0] > adv[:, 2]))
