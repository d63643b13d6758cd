"""rollout.logprobs_mode: which distribution mu the trust region is measured against.

"full" anchors to softmax(logits / T) even when top-k / top-p truncate what is sampled; "sampled"
anchors to the truncated renormalised distribution the tokens were really drawn from, with the
current policy renormalised over the same recorded kept set (`sampler` kept_ids,
`train_step.truncate_to_kept`). docs/guide.md "Training" has the user-facing description.

Each test checks the property against a numpy computation from the full-sequence logits, so a
wrong kept set, a wrong normaliser or a mismatch between the sampler and the update fails.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_config
from flax import nnx

from gppo_jax import config_lib, errors, train
from gppo_jax.algorithm import objective
from gppo_jax.generation import sampler
from gppo_jax.models import architectures
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import train_step

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5], [13, 14, 15, 16, 17], [20, 21]]
N = 10  # response tokens
T = 0.5  # a temperature below 1 spreads the tiny model's logits
TOP_K, TOP_P = 8, 0.6


@pytest.fixture(scope="module")
def model():
  return model_lib.Transformer(architectures.get("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
  return sampler.left_pad(PROMPTS, pad_id=0)


def sampling(mode, **kw):
  kw = dict(temperature=T, top_k=TOP_K, top_p=TOP_P) | kw
  return sampler.SamplingParams(max_new_tokens=N, stop_ids=(), pad_id=0, logprobs_mode=mode, **kw)


@pytest.fixture(scope="module")
def outputs(model, prompts):
  """The same draws recorded both ways: "truncated" (config "sampled") and "tempered" ("full")."""
  graphdef, params = nnx.split(model)
  key = jax.random.key(3)
  return {
    mode: jax.device_get(sampler.sample_jit(graphdef, params, *prompts, key, sampling(mode)))
    for mode in ("truncated", "tempered")
  }


@pytest.fixture(scope="module")
def scaled_logits(model, prompts, outputs):
  """float64 logits / T [B, N, V] of every response token's state, from one uncached forward."""
  out = outputs["truncated"]
  tokens = jnp.concatenate([prompts[0], out.tokens], axis=1)
  mask = jnp.concatenate([prompts[1], out.mask], axis=1)
  hidden = model(tokens, model_lib.positions_from_mask(mask), attn_mask=mask).hidden
  logits = np.asarray(model.logits(hidden), np.float64)
  p = prompts[0].shape[1]
  return logits[:, p - 1 : p - 1 + N] / T


def numpy_kept(x, top_k, top_p):
  """The kept ids of top-k then top-p (on the top-k renormalised) by rank, -1 where top-p cuts,
  and the smallest distance of the cumulative mass to top_p (how close the call is)."""
  order = np.argsort(-x, kind="stable")[:top_k]
  probs = np.exp(x[order] - x[order].max())
  probs /= probs.sum()
  before = np.cumsum(probs) - probs
  return np.where(before < top_p, order, -1), np.min(np.abs(before - top_p))


def logsumexp(x):
  return x.max() + np.log(np.sum(np.exp(x - x.max())))


def test_recorded_kept_set_is_top_k_then_top_p(outputs, scaled_logits):
  out = outputs["truncated"]
  assert out.kept_ids.shape == (len(PROMPTS), N, TOP_K) and out.kept_ids.dtype == np.int32
  checked, sizes = 0, set()
  for b in range(len(PROMPTS)):
    for t in range(N):
      want, margin = numpy_kept(scaled_logits[b, t], TOP_K, TOP_P)
      if margin < 1e-4:  # the cached decode's logits differ from these by float rounding
        continue
      np.testing.assert_array_equal(out.kept_ids[b, t], want, err_msg=f"row {b} token {t}")
      assert out.tokens[b, t] in want[want >= 0]  # drawn from its kept set
      checked += 1
      sizes.add(int((want >= 0).sum()))
  assert checked >= 0.9 * len(PROMPTS) * N
  assert min(sizes) < TOP_K, sizes  # top-p cut some sets
  assert outputs["tempered"].kept_ids is None  # "full" records nothing


def test_kept_ids_are_padded_past_the_vocabulary_and_on_finished_rows(model, prompts):
  graphdef, params = nnx.split(model)
  vocab = model.cfg.vocab_size
  stop = tuple(range(3, vocab // 2))  # most rows stop early
  p = sampler.SamplingParams(
    max_new_tokens=N, temperature=T, top_k=vocab + 6, stop_ids=stop, logprobs_mode="truncated"
  )
  out = jax.device_get(sampler.sample_jit(graphdef, params, *prompts, jax.random.key(0), p))
  assert out.kept_ids.shape == (len(PROMPTS), N, vocab + 6)
  live = out.kept_ids[out.mask]
  assert (np.sort(live[:, :vocab], axis=-1) == np.arange(vocab)).all()  # the whole vocabulary
  assert (live[:, vocab:] == -1).all()
  assert (~out.mask).any() and (out.kept_ids[~out.mask] == -1).all()


def test_behaviour_logprobs_are_those_of_the_distribution_sampled_from(outputs, scaled_logits):
  """In "sampled" mode: log of the truncated renormalised distribution; in "full" mode the same
  draws (same law, same key) recorded under softmax(logits / T), lower by exactly log mu(S)."""
  trunc, full = outputs["truncated"], outputs["tempered"]
  np.testing.assert_array_equal(trunc.tokens, full.tokens)
  gaps = []
  for b in range(len(PROMPTS)):
    for t in range(N):
      x, a = scaled_logits[b, t], trunc.tokens[b, t]
      kept = trunc.kept_ids[b, t][trunc.kept_ids[b, t] >= 0]
      log_mass = logsumexp(x[kept]) - logsumexp(x)
      np.testing.assert_allclose(trunc.logprobs[b, t], x[a] - logsumexp(x[kept]), atol=2e-5)
      np.testing.assert_allclose(full.logprobs[b, t], x[a] - logsumexp(x), atol=2e-5)
      gaps.append(-log_mass)
  np.testing.assert_allclose(trunc.logprobs - full.logprobs, np.reshape(gaps, (-1, N)), atol=4e-5)
  assert min(gaps) > 0.1  # "full" misstates the sampling probability of every token


_COMPILED = {}


def compiled(graphdef, prompt_len, kept_width):
  """(update, logprobs) jitted once per kept width: one SGD step on the whole batch at a radius
  of 1e-6 (KL-Atomic), and the log-prob pass of `rollout.recompute_logprobs`."""
  if kept_width not in _COMPILED:
    loss = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=1e-6)
    spec = train_step.UpdateSpec(
      prompt_len=prompt_len, loss=loss, temperature=T, kept_width=kept_width
    )
    _COMPILED[kept_width] = (
      jax.jit(train_step.make_update_fn(graphdef, optax.sgd(1e-3), spec)),
      train_step.make_logprob_fn(graphdef, prompt_len=prompt_len, temperature=T),
    )
  return _COMPILED[kept_width]


def on_policy_update(model, prompts, out, kept_width):
  """One on-policy optimizer step (epochs = minibatches = 1) on the batch of `out`: its metrics
  and the update's own recomputed log-probs of the response tokens."""
  graphdef, params = nnx.split(model)
  optional = {"kept_ids": out.kept_ids} if kept_width else {}
  n = len(PROMPTS)
  batch = train_step.build_batch(
    np.asarray(prompts[0]),
    np.asarray(prompts[1]),
    out.tokens,
    out.mask,
    logq=out.logprobs,
    adv=np.linspace(-1.0, 1.0, n),
    **optional,
  )
  update, logprobs = compiled(graphdef, prompts[0].shape[1], kept_width)
  state = train_step.TrainState(params, optax.sgd(1e-3).init(params), jnp.zeros((), jnp.int32))
  _, metrics = update(state, batch, jax.random.key(0))
  return jax.device_get(metrics), np.asarray(logprobs(params, batch))


@pytest.mark.parametrize("mode", ["truncated", "tempered"])
def test_at_pi_equal_mu_the_update_recomputes_the_behaviour_logprobs(model, prompts, outputs, mode):
  """Each mode's update compares the policy with the record of its own kind: ratio 1 on every
  token, nothing masked even at a radius of 1e-6."""
  out = outputs[mode]
  metrics, recomputed = on_policy_update(model, prompts, out, TOP_K if mode == "truncated" else 0)
  np.testing.assert_allclose(recomputed[out.mask], out.logprobs[out.mask], atol=1e-5)
  assert abs(float(metrics["ratio/max"][0]) - 1) < 1e-4
  assert abs(float(metrics["ratio/min"][0]) - 1) < 1e-4
  assert float(metrics["trust/masked_frac"][0]) == 0.0


def test_truncated_behaviour_against_the_full_policy_is_off_by_the_kept_mass(
  model, prompts, outputs
):
  """The mismatch "sampled" removes: the truncated record against the full policy (no kept set)
  has ratio pi(a) / mu_S(a) = mu(S) < 1 at pi = mu, and a tight region masks tokens for it."""
  metrics, _ = on_policy_update(model, prompts, outputs["truncated"], kept_width=0)
  assert float(metrics["ratio/max"][0]) < 0.9
  assert float(metrics["trust/masked_frac"][0]) > 0.0


def test_truncate_to_kept_matches_numpy_with_finite_gradients():
  rng = np.random.default_rng(0)
  B, R, V, W = 3, 5, 12, 6
  logits = rng.normal(size=(B, R, V)) * 2.0
  kept = np.full((B, R, W), -1, np.int64)
  tokens = np.zeros((B, R), np.int64)
  for b in range(B):
    for t in range(R):
      size = rng.integers(1, W + 1)
      ids = rng.choice(V, size, replace=False)
      slots = rng.choice(W, size, replace=False)  # -1 anywhere, not only at the end
      kept[b, t, slots] = ids
      tokens[b, t] = rng.choice(ids)
  kept[1, 2] = -1  # an empty set: a padding position
  kept[2, 4, :] = -1
  kept[2, 4, 0] = 0  # id 0 kept (the placeholder -1 gathers id 0 too)
  tokens[2, 4] = 0
  topk_ids = rng.integers(0, V, (B, R, 4))
  topk_ids[..., 0] = tokens  # the sampled token is always in its set

  def run(z):
    lp = jax.nn.log_softmax(z, axis=-1)
    take = lambda ids: jnp.take_along_axis(lp, jnp.asarray(ids), axis=-1)
    out, topk = train_step.truncate_to_kept(
      take(tokens[..., None])[..., 0],
      take(np.maximum(kept, 0)),
      jnp.asarray(kept),
      take(topk_ids),
      jnp.asarray(topk_ids),
    )
    return out, topk

  out, topk = jax.device_get(run(jnp.asarray(logits, jnp.float32)))
  for b in range(B):
    for t in range(R):
      lp = logits[b, t] - logsumexp(logits[b, t])
      ids = kept[b, t][kept[b, t] >= 0]
      mass = logsumexp(lp[ids]) if len(ids) else 0.0  # no set: log pi(a) back unchanged
      np.testing.assert_allclose(out[b, t], lp[tokens[b, t]] - mass, atol=1e-5)
      for j, i in enumerate(topk_ids[b, t]):
        if i in ids or not len(ids):
          np.testing.assert_allclose(topk[b, t, j], lp[i] - mass, atol=1e-5)
        else:
          assert topk[b, t, j] == -np.inf

  def loss(z):
    out, topk = run(z)
    return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(topk), topk, 0.0))

  grad = np.asarray(jax.grad(lambda z: jnp.sum(run(z)[0]))(jnp.asarray(logits, jnp.float32)))
  assert np.isfinite(np.asarray(jax.grad(loss)(jnp.asarray(logits, jnp.float32)))).all()
  assert np.isfinite(grad).all()
  for b in range(B):
    for t in range(R):
      ids = kept[b, t][kept[b, t] >= 0]
      if not len(ids):
        continue
      # The renormalised policy does not depend on the logits outside its set.
      outside = np.setdiff1d(np.arange(V), ids)
      assert np.abs(grad[b, t, outside]).max(initial=0.0) < 1e-6
      if len(ids) > 1:
        assert np.abs(grad[b, t, ids]).max() > 1e-3
  # The empty set's gradient is that of log pi(a) itself: d/dz (z_a - logsumexp z).
  p = np.exp(logits[1, 2] - logsumexp(logits[1, 2]))
  np.testing.assert_allclose(grad[1, 2], np.eye(V)[tokens[1, 2]] - p, atol=1e-5)


def test_diagnostics_compare_the_policies_renormalised_over_the_kept_set():
  """diag/* in "sampled" mode: log-probs, entropies and the exact KL(mu_S || pi_S) of the two
  policies restricted to each kept set (the full vocabulary where the set is empty)."""
  from gppo_jax.research import diagnostics

  rng = np.random.default_rng(1)
  V = 7
  zp, zq = rng.normal(size=(2, 2, 3, V)) * 1.5
  kept = np.array([[[0, 3, -1], [5, -1, 1], [-1, -1, -1]], [[6, 2, 4], [0, -1, -1], [1, 2, 3]]])
  targets = np.array([[3, 1, 4], [2, 0, 2]])
  stats = jax.device_get(
    diagnostics.token_stats_from_logits(zp, zq, targets, divergences=("kl",), kept_ids=kept)
  )
  for b in range(2):
    for t in range(3):
      ids = kept[b, t][kept[b, t] >= 0]
      ids = ids if len(ids) else np.arange(V)
      lp = zp[b, t, ids] - logsumexp(zp[b, t, ids])
      lq = zq[b, t, ids] - logsumexp(zq[b, t, ids])
      a = list(ids).index(targets[b, t])
      np.testing.assert_allclose(stats["logp"][b, t], lp[a], atol=1e-5)
      np.testing.assert_allclose(stats["logq"][b, t], lq[a], atol=1e-5)
      np.testing.assert_allclose(stats["entropy"][b, t], -np.sum(np.exp(lp) * lp), atol=1e-5)
      kl = np.sum(np.exp(lq) * (lq - lp))
      np.testing.assert_allclose(stats["exact/kl"][b, t], kl, atol=1e-5)


def test_mesh_sampler_records_the_same_kept_sets(model):
  """The sharded sampler (8 CPU devices, the rollout path) returns the kept ids of the
  single-device one."""
  from gppo_jax.models import partitioning, sharding

  graphdef, params = nnx.split(model)
  mesh = sharding.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
  shardings = partitioning.state_shardings(params, mesh, partitioning.DEFAULT_RULES)
  tokens, mask = sampler.left_pad([p for p in PROMPTS for _ in range(2)], length=8)
  p = sampling("truncated")
  want = jax.device_get(sampler.sample_jit(graphdef, params, tokens, mask, jax.random.key(1), p))
  got = sampler.MeshSampler(graphdef, shardings)(
    jax.device_put(params, shardings), tokens, mask, jax.random.key(1), p, group_size=1
  )
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.kept_ids, want.kept_ids)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-6)


def test_training_in_sampled_mode_runs_end_to_end(tmp_path):
  """Two iterations of the smoke run from a random policy, sampling with top_k = 4 and top-p,
  with the behaviour log-probs recomputed (the kept sets reach the log-prob pass), the topk
  estimator (the behaviour's top-3 of the truncated distribution) and diagnostics every step."""
  c = load_config("kl_atomic.py", "smoke")
  c.warmstart.enabled = False  # a random policy: near-uniform over the task's characters
  c.iterations = 2
  c.eval.every = 2
  c.eval.num_problems = 8
  c.diagnostics.every = 1
  c.rollout.update(top_k=4, top_p=0.9, logprobs_mode="sampled", recompute_logprobs=True)
  c.rollout.num_topk = 3
  c.loss.estimator = "topk"
  config_lib.validate(c)
  summary = train.train_and_evaluate(c, str(tmp_path / "run"))
  assert summary["iterations_done"] == 2
  rows = [json.loads(x) for x in open(os.path.join(tmp_path, "run", "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [0, 1, 2]
  for row in rows[1:]:
    for key in ("loss/total", "optim/grad_norm", "ratio/max", "diag/exact/mean", "diag/topk/mean"):
      assert np.isfinite(row[key]), (key, row[key])
    # Diagnostics measure the truncated distributions the loss compares: the behaviour recomputed
    # over the kept sets is the sampler's record, and the entropy is at most log(top_k) (the full
    # distribution of a random policy over the task's characters has more).
    assert row["diag/behaviour_logq_gap"] < 1e-4
    assert 0 < row["diag/entropy_behaviour"] <= np.log(4) + 1e-5
    assert row["diag/exact/mean"] >= 0
  assert 0.0 <= rows[-1]["eval/accuracy"] <= 1.0


def test_config_errors_for_sampled_mode_are_clear():
  c = load_config("kl_atomic.py", "smoke")
  c.rollout.logprobs_mode = "truncated"  # the sampler's name, not the config's
  with pytest.raises(errors.ConfigError, match=r"rollout.logprobs_mode='truncated': must be one of "
                     "full, sampled"):  # fmt: skip
    config_lib.validate(c)
  c.rollout.logprobs_mode = "sampled"
  c.rollout.top_p = 0.95
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(c)
  msg = str(e.value)
  assert "rollout.top_k" in msg and "rollout.logprobs_mode='full'" in msg and "\n" not in msg
  c.rollout.top_k = 64
  config_lib.validate(c)  # top-p within the top 64
  c.rollout.top_k, c.rollout.top_p = 0, 1.0
  config_lib.validate(c)  # nothing truncated: the two modes agree
  assert train_step.kept_width(c.rollout) == 0
  c.rollout.top_k = 5
  assert train_step.kept_width(c.rollout) == 5
  c.rollout.logprobs_mode = "full"
  assert train_step.kept_width(c.rollout) == 0
