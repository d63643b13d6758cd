"""The rollout/trainer mismatch: its metrics and corrections against plain loops (numpy), the
weighted policy term, and a training run that recomputes, measures and corrects."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config

from gppo_jax import config_lib, errors, train
from gppo_jax.algorithm import correction, objective


def _batch(seed, b=6, t=9, scale=0.8):
  rng = np.random.default_rng(seed)
  logmu = np.log(rng.uniform(0.01, 1.0, (b, t)))
  logq = np.minimum(logmu + rng.normal(0.0, scale, (b, t)), 0.0)
  mask = rng.uniform(size=(b, t)) < 0.8
  mask[0] = False  # a row with no counted token
  logq[~mask] = -np.inf  # padding may hold anything
  return logq, logmu, mask


def _reference(logq, logmu, mask, method, level, cap):
  """The correction written token by token, in probabilities (float64)."""
  b, t = mask.shape
  out_mask = mask.copy()
  weight = np.zeros((b, t))
  for i in range(b):
    seq_rho = 1.0
    for j in range(t):
      if mask[i, j]:
        seq_rho *= math.exp(logq[i, j]) / math.exp(logmu[i, j])
    for j in range(t):
      if not mask[i, j]:
        continue
      rho = seq_rho if level == "sequence" else math.exp(logq[i, j]) / math.exp(logmu[i, j])
      if method == "tis":
        weight[i, j] = min(rho, cap)
      elif method == "mis":
        out_mask[i, j] = 1.0 / cap <= rho <= cap
  return out_mask, weight


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("method", ["tis", "mis"])
@pytest.mark.parametrize("seed", [0, 1])
def test_corrections_match_a_token_by_token_reference(method, level, seed):
  # Sequence ratios multiply ~7 token ratios: smaller steps keep some on each side of [1/C, C].
  scale = 0.8 if level == "token" else 0.2
  logq, logmu, mask = _batch(seed, b=32, scale=scale)
  cap = 1.5
  got_mask, got_w, metrics = correction.correct(
    logq, logmu, mask, method=method, level=level, cap=cap
  )
  want_mask, want_w = _reference(logq, logmu, mask, method, level, cap)
  np.testing.assert_array_equal(got_mask, want_mask)
  if method == "tis":
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6)
    assert got_w.dtype == np.float32 and np.all(np.isfinite(got_w))
    truncated = np.mean([w >= cap * (1 - 1e-9) for w in want_w[mask]])
    assert metrics["correction/truncated_frac"] == pytest.approx(truncated)
    assert 0 < metrics["correction/truncated_frac"] < 1  # the cases exercise both sides
  else:
    assert got_w is None
    dropped = np.sum(mask & ~want_mask) / mask.sum()
    assert metrics["correction/masked_frac"] == pytest.approx(dropped)
    assert 0 < dropped < 1


def test_none_changes_nothing_and_bad_settings_are_named():
  logq, logmu, mask = _batch(0)
  m, w, metrics = correction.correct(logq, logmu, mask, method="none")
  np.testing.assert_array_equal(m, mask)
  assert w is None and metrics == {}
  with pytest.raises(ValueError, match="unknown rollout correction 'is'"):
    correction.correct(logq, logmu, mask, method="is")
  with pytest.raises(ValueError, match="unknown correction level 'seq'"):
    correction.correct(logq, logmu, mask, method="tis", level="seq")
  with pytest.raises(ValueError, match="cap C must be > 1"):
    correction.correct(logq, logmu, mask, method="mis", cap=1.0)


def test_mismatch_metrics_against_numpy():
  logq, logmu, mask = _batch(3)
  got = correction.mismatch_metrics(logq, logmu, mask, threshold=0.5)
  d = np.abs(logq - logmu)[mask]
  seq = [abs(np.sum((logq - logmu)[i][mask[i]])) for i in range(len(mask)) if mask[i].any()]
  assert got["mismatch/abs_log_ratio_mean"] == pytest.approx(d.mean())
  assert got["mismatch/abs_log_ratio_max"] == pytest.approx(d.max())
  assert got["mismatch/frac_beyond"] == pytest.approx(np.mean(d > 0.5))
  assert got["mismatch/seq_abs_log_ratio_mean"] == pytest.approx(np.mean(seq))
  assert got["mismatch/seq_abs_log_ratio_max"] == pytest.approx(np.max(seq))
  zero = correction.mismatch_metrics(logmu, logmu, mask, threshold=0.5)
  assert all(v == 0 for v in zero.values())


def test_token_weight_scales_the_policy_term_and_not_the_kl_penalty():
  rng = np.random.default_rng(0)
  b, t = 4, 7
  logq = jnp.asarray(np.log(rng.uniform(0.05, 1, (b, t))), jnp.float32)
  logp = logq + jnp.asarray(rng.normal(0, 0.3, (b, t)), jnp.float32)
  logp = jnp.minimum(logp, 0.0)
  ref = logq + 0.1
  adv = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
  mask = jnp.asarray(rng.uniform(size=(b, t)) < 0.8)
  w = jnp.asarray(rng.uniform(0.2, 2.0, (b, t)), jnp.float32)
  cfg = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.02)

  def loss(lp, cfg, **kw):
    return objective.policy_loss(lp, logq, kw.pop("adv", adv), mask, cfg, **kw)[0]

  # Without a penalty, a constant weight on the policy term is a weight on the advantage.
  val, grad = jax.value_and_grad(loss)(logp, cfg, token_weight=w)
  val2, grad2 = jax.value_and_grad(loss)(logp, cfg, adv=adv * w)
  np.testing.assert_allclose(val, val2, rtol=1e-5)
  np.testing.assert_allclose(grad, grad2, rtol=1e-5, atol=1e-7)
  # The KL penalty is not weighted: weights of 1 leave the loss as it was, and with the penalty
  # the weighted loss differs from the unweighted one by the policy terms alone.
  kl = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.02, kl_coef=0.5)
  np.testing.assert_allclose(
    loss(logp, kl, ref_logp=ref, token_weight=jnp.ones_like(w)), loss(logp, kl, ref_logp=ref)
  )
  diff = loss(logp, kl, ref_logp=ref, token_weight=w) - loss(logp, kl, ref_logp=ref)
  np.testing.assert_allclose(diff, val - loss(logp, cfg), rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="token_weight must have shape"):
    loss(logp, cfg, token_weight=w[:, :3])


def _smoke(tmp_path, **rollout):
  c = load_config("kl_atomic", "smoke")
  c.iterations = 2
  c.eval.every = 2
  c.eval.num_problems = 8
  c.rollout.update(**rollout)
  config_lib.validate(c)
  train.train_and_evaluate(c, str(tmp_path / "run"))
  return [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]


@pytest.mark.parametrize(
  "rollout",
  [dict(correction="tis", correction_level="sequence"), dict(correction="mis", correction_cap=1.5)],
)
def test_training_measures_and_corrects_the_mismatch(tmp_path, rollout):
  rows = _smoke(tmp_path, recompute_logprobs=True, **rollout)
  for row in rows[1:]:
    # The sampler and the trainer compute the same float32 policy here: their log-probs agree
    # closely, so the correction keeps (almost) every token at full weight.
    assert 0 <= row["mismatch/abs_log_ratio_mean"] < 1e-3, row
    assert row["mismatch/frac_beyond"] == 0.0
    if rollout["correction"] == "tis":
      assert row["correction/weight_mean"] == pytest.approx(1.0, abs=1e-2)
    else:
      assert row["correction/masked_frac"] == 0.0
    assert np.isfinite(row["loss/total"])


def test_correction_without_recomputed_logprobs_is_a_config_error():
  c = load_config("kl_atomic", "smoke")
  c.rollout.correction = "tis"
  with pytest.raises(errors.ConfigError, match="needs rollout.recompute_logprobs=True"):
    config_lib.validate(c)
  c.rollout.recompute_logprobs = True
  c.rollout.correction_level = "row"
  with pytest.raises(errors.ConfigError, match="rollout.correction_level='row': must be one of"):
    config_lib.validate(c)


def test_the_update_weights_each_token_by_the_batch_is_weight():
  """make_update_fn with UpdateSpec(is_weight=True): weights of 0 stop every policy gradient (the
  parameters stay), weights of 2 give the step of doubled advantages (plain SGD)."""
  import optax
  from flax import nnx

  from gppo_jax.data import envs
  from gppo_jax.models import architectures
  from gppo_jax.models import model as model_lib
  from gppo_jax.trainer import train_step

  n = 8
  env = envs.BuiltinEnv("add_rev3", seed=0, eval_size=8)
  cfg = architectures.get("char-tiny", vocab_size=env.tokenizer.vocab_size)
  graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  r = env.max_new_tokens
  p_tok = rng.integers(3, cfg.vocab_size, (n, env.max_prompt_len)).astype(np.int32)
  resp = rng.integers(3, cfg.vocab_size, (n, r)).astype(np.int32)
  adv = rng.normal(size=n).astype(np.float32)
  logq = np.log(rng.uniform(0.05, 0.9, (n, r))).astype(np.float32)
  mask = np.ones((n, r), bool)
  p_mask = np.ones_like(p_tok, bool)
  tx = optax.sgd(1e-2)
  loss = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=1e9)  # no masking

  def step(weight, adv):
    spec = train_step.UpdateSpec(
      prompt_len=env.max_prompt_len, loss=loss, is_weight=weight is not None
    )
    batch = train_step.build_batch(p_tok, p_mask, resp, mask, logq=logq, adv=adv, is_weight=weight)
    update = jax.jit(train_step.make_update_fn(graphdef, tx, spec))
    state = train_step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    return update(state, batch, jax.random.PRNGKey(0))[0].params

  frozen = step(np.zeros((n, r), np.float32), adv)
  for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  doubled = step(np.full((n, r), 2.0, np.float32), adv)
  plain = step(None, 2 * adv)
  for a, b in zip(jax.tree.leaves(doubled), jax.tree.leaves(plain), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_a_mismatched_sampler_is_measured_and_masked_in_training(tmp_path, monkeypatch):
  """The sampler's log-probs perturbed as another engine's might be: mismatch/* sees it, and mis
  drops the tokens beyond the cap from the batch the update receives."""
  real = train._correct_mismatch
  seen = []

  def perturbed(r, batch, sampled, metrics):
    noise = np.random.default_rng(len(seen)).normal(0.0, 0.5, sampled.shape)
    out = real(r, batch, (sampled + noise).astype(np.float32), metrics)
    seen.append((np.asarray(batch.mask).sum(), np.asarray(out.mask).sum(), dict(metrics)))
    return out

  monkeypatch.setattr(train, "_correct_mismatch", perturbed)
  rows = _smoke(tmp_path, recompute_logprobs=True, correction="mis", correction_cap=2.0)
  assert len(seen) == 2
  for (before, after, m), row in zip(seen, rows[1:], strict=True):
    # |N(0, 0.5)| > log 2 for about 17% of the tokens
    assert 0.08 < m["correction/masked_frac"] < 0.3, m
    assert after == pytest.approx(before * (1 - m["correction/masked_frac"]), abs=0.5)
    assert m["mismatch/abs_log_ratio_mean"] == pytest.approx(0.4, rel=0.25)  # E|N(0, .5)|
    assert row["correction/masked_frac"] == pytest.approx(m["correction/masked_frac"])
