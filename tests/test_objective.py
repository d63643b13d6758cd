"""The GPPO loss reproduces PPO, DAPO, DPPO and RIPO exactly, aggregates exactly, fails loudly."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from gppo_jax import config_lib
from gppo_jax.algorithm import divergences, estimators, objective, presets

B, T = 8, 24


def batch(seed=0, spread=0.4, bf16=False):
  rng = np.random.default_rng(seed)
  logq = np.log(rng.uniform(0.02, 0.98, (B, T)))
  logp = logq + rng.normal(0, spread, (B, T))
  logp = np.minimum(logp, -1e-6)
  adv = rng.normal(size=(B,))
  mask = np.ones((B, T), bool)
  for i, n in enumerate(rng.integers(1, T, size=B)):
    mask[i, n:] = False
  mask[3] = False  # A sequence with no valid tokens.
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  return jnp.asarray(logp, dtype), jnp.asarray(logq, dtype), jnp.asarray(adv), jnp.asarray(mask)


def ppo_clip_loss(logp, logq, adv, mask, eps_low, eps_high):
  r = jnp.exp(logp - logq)
  a = adv[:, None]
  surr = jnp.minimum(r * a, jnp.clip(r, 1 - eps_low, 1 + eps_high) * a)
  return -jnp.sum(surr * mask) / jnp.sum(mask)


def masked_reference_loss(logp, logq, adv, mask, out):
  """-token-mean((1 - out) r A) with an externally computed out-of-region mask."""
  r = jnp.exp(logp - logq)
  keep = 1.0 - out.astype(jnp.float32)
  return -jnp.sum(keep * r * adv[:, None] * mask) / jnp.sum(mask)


def grad_logp(fn, logp):
  return np.asarray(jax.grad(fn)(logp))


class ReductionsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_tv_mc_is_ppo_clip(self):
    logp, logq, adv, mask = batch(0)
    ours = self.variant(
      lambda lp: objective.policy_loss(lp, logq, adv, mask, presets.get("ppo").loss)[0]
    )
    ref = lambda lp: ppo_clip_loss(lp, logq, adv, mask, 0.2, 0.2)
    np.testing.assert_allclose(grad_logp(ours, logp), grad_logp(ref, logp), rtol=1e-5, atol=1e-8)
    # Some tokens really are clipped on each side, so the test can tell the two apart.
    _, m = objective.policy_loss(logp, logq, adv, mask, presets.get("ppo").loss)
    assert float(m["trust/masked_frac_high"]) > 0.02 and float(m["trust/masked_frac_low"]) > 0.02

  def test_asymmetric_tv_mc_is_dapo_clip_higher(self):
    logp, logq, adv, mask = batch(1)
    ours = lambda lp: objective.policy_loss(lp, logq, adv, mask, presets.get("dapo").loss)[0]
    ref = lambda lp: ppo_clip_loss(lp, logq, adv, mask, 0.2, 0.28)
    np.testing.assert_allclose(grad_logp(ours, logp), grad_logp(ref, logp), rtol=1e-5, atol=1e-8)
    sym = lambda lp: ppo_clip_loss(lp, logq, adv, mask, 0.2, 0.2)
    assert not np.allclose(grad_logp(ours, logp), grad_logp(sym, logp))

  def test_tv_binary_is_dppo_mask(self):
    logp, logq, adv, mask = batch(2, spread=0.6)
    delta = 0.15
    loss = objective.LossConfig(divergence="tv", estimator="binary", delta_low=delta)
    ours = lambda lp: objective.policy_loss(lp, logq, adv, mask, loss)[0]
    p, q = jnp.exp(logp), jnp.exp(logq)
    a = adv[:, None]
    out = ((a > 0) & (p > q) & (jnp.abs(p - q) > delta)) | (
      (a < 0) & (p < q) & (jnp.abs(p - q) > delta)
    )
    assert 0.02 < float(jnp.mean(out[mask])) < 0.9
    ref = lambda lp: masked_reference_loss(lp, logq, adv, mask, out)
    np.testing.assert_allclose(grad_logp(ours, logp), grad_logp(ref, logp), rtol=1e-5, atol=1e-8)

  def test_kl_binary_is_dppo_bernoulli_kl_mask(self):
    logp, logq, adv, mask = batch(3, spread=0.6)
    delta = 0.05
    ours = lambda lp: objective.policy_loss(lp, logq, adv, mask, presets.get("dppo_kl").loss)[0]
    p, q = np.exp(np.asarray(logp, np.float64)), np.exp(np.asarray(logq, np.float64))
    bern_kl = q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))
    a = np.asarray(adv)[:, None]
    out = ((a > 0) & (p > q) & (bern_kl > delta)) | ((a < 0) & (p < q) & (bern_kl > delta))
    # Dr.GRPO-style aggregation: per-sequence sum / T, mean over sequences with tokens.
    r = jnp.exp(logp - logq)
    keep = jnp.asarray(1.0 - out)
    has = jnp.sum(mask, 1) > 0

    def ref(lp):
      r = jnp.exp(lp - logq)
      per_seq = jnp.sum(keep * r * adv[:, None] * mask, 1) / T
      return -jnp.sum(jnp.where(has, per_seq, 0.0)) / jnp.sum(has)

    del r
    np.testing.assert_allclose(grad_logp(ours, logp), grad_logp(ref, logp), rtol=1e-5, atol=1e-8)

  def test_chi2_atomic_is_ripo_bound(self):
    logp, logq, adv, mask = batch(4, spread=0.5)
    delta = 0.05
    ours = lambda lp: objective.policy_loss(lp, logq, adv, mask, presets.get("ripo").loss)[0]
    q = jnp.exp(logq)
    r = jnp.exp(logp - logq)
    bound = jnp.sqrt(delta / q)
    a = adv[:, None]
    out = ((a > 0) & (r > 1 + bound)) | ((a < 0) & (r < 1 - bound))
    assert float(jnp.mean(out[mask])) > 0.01
    ref = lambda lp: masked_reference_loss(lp, logq, adv, mask, out)
    np.testing.assert_allclose(grad_logp(ours, logp), grad_logp(ref, logp), rtol=1e-5, atol=1e-8)

  def test_ratio_cap_and_dual_clip(self):
    logp, logq, adv, mask = batch(5, spread=1.0)
    wide = objective.LossConfig(divergence="tv", estimator="mc", delta_low=10.0)  # nothing is out
    r = jnp.exp(logp - logq)
    a = adv[:, None]
    capped_cfg = wide.replace(ratio_cap=2.0)
    capped = lambda lp: objective.policy_loss(lp, logq, adv, mask, capped_cfg)[0]
    want = -np.minimum(np.asarray(r), 2.0) * np.asarray(a) * np.asarray(mask) / np.sum(mask)
    np.testing.assert_allclose(grad_logp(capped, logp), want, rtol=1e-5, atol=1e-8)
    dual = lambda lp: objective.policy_loss(lp, logq, adv, mask, wide.replace(dual_clip=3.0))[0]
    stopped = np.asarray((a < 0) & (r > 3.0) & mask)
    assert stopped.sum() > 0
    g = grad_logp(dual, logp)
    assert np.all(g[stopped] == 0)
    free = np.asarray(mask) & ~stopped
    want_free = -(np.asarray(r) * np.asarray(a) / np.sum(mask))
    np.testing.assert_allclose(g[free], np.broadcast_to(want_free, g.shape)[free], rtol=1e-5)

  def test_gradient_stopped_only_when_pushing_further_out(self):
    logp, logq, adv, mask = batch(6, spread=1.0)
    for div in ("tv", "kl", "hellinger", "chi2"):
      for est in ("mc", "binary", "atomic"):
        g = grad_logp(
          lambda lp, div=div, est=est: objective.policy_loss(
            lp, logq, adv, mask, objective.LossConfig(divergence=div, estimator=est, delta_low=1e-3)
          )[0],
          logp,
        )
        d = np.asarray(estimators.estimate(div, est, logp, logq))
        r = np.exp(np.asarray(logp - logq))
        a = np.asarray(adv)[:, None] * np.ones_like(r)
        m = np.asarray(mask)
        inside = (d <= 1e-3) | (a * (r - 1) <= 0)
        assert np.all(g[m & inside & (a != 0)] != 0), (div, est)
        assert np.all(g[m & ~inside] == 0), (div, est)
        assert np.all(g[~m] == 0)


class AggregationTest(parameterized.TestCase):
  @parameterized.parameters(*objective.AGGREGATIONS)
  def test_gradient_accumulation_is_exact(self, aggregation):
    logp, logq, adv, mask = batch(7)
    ref_logp = logq + 0.05
    ent = jnp.abs(logp)
    loss_cfg = objective.LossConfig(
      divergence="kl",
      estimator="atomic",
      delta_low=0.01,
      delta_high=0.02,
      aggregation=aggregation,
      max_len=T,
      kl_coef=0.1,
      entropy_coef=0.01,
    )

    def full(lp):
      return objective.policy_loss(lp, logq, adv, mask, loss_cfg, ref_logp=ref_logp, entropy=ent)

    loss, metrics = full(logp)
    grad = jax.grad(lambda lp: full(lp)[0])(logp)
    count = metrics["loss/count"]
    acc_loss, acc_grad = 0.0, jnp.zeros_like(logp)
    for sl in (slice(0, 3), slice(3, 4), slice(4, B)):

      def micro(lp, sl=sl):
        return objective.policy_loss(
          lp,
          logq[sl],
          adv[sl],
          mask[sl],
          loss_cfg,
          normalizer=count,
          ref_logp=ref_logp[sl],
          entropy=ent[sl],
        )[0]

      acc_loss += micro(logp[sl])
      acc_grad = acc_grad.at[sl].set(jax.grad(micro)(logp[sl]))
    np.testing.assert_allclose(float(acc_loss), float(loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(acc_grad), np.asarray(grad), rtol=1e-5, atol=1e-9)

  def test_aggregation_values(self):
    logp, logq, adv, mask = batch(8)
    x = np.asarray(jnp.exp(logp - logq) * adv[:, None])
    m = np.asarray(mask)
    wide = objective.LossConfig(divergence="tv", estimator="mc", delta_low=100.0, max_len=50)
    token_mean = -np.sum(x * m) / m.sum()
    seqs = m.sum(1) > 0
    seq_mean = -np.mean((np.sum(x * m, 1) / np.maximum(m.sum(1), 1))[seqs])
    seq_norm = -np.mean((np.sum(x * m, 1) / 50.0)[seqs])
    for agg, want in (
      ("token-mean", token_mean),
      ("seq-mean-token-mean", seq_mean),
      ("seq-mean-token-sum-norm", seq_norm),
    ):
      got = objective.policy_loss(logp, logq, adv, mask, wide.replace(aggregation=agg))[0]
      np.testing.assert_allclose(float(got), want, rtol=1e-5, err_msg=agg)


class MetricsAndNumericsTest(chex.TestCase):
  def test_metrics(self):
    logp, logq, adv, mask = batch(9, spread=0.6)
    loss, m = objective.policy_loss(
      logp, logq, adv, mask, objective.LossConfig(divergence="kl", estimator="mc", delta_low=0.0231)
    )
    d = np.asarray(estimators.estimate("kl", "mc", logp, logq))[np.asarray(mask)]
    np.testing.assert_allclose(float(m["div/estimate_mean"]), d.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["div/estimate_max"]), d.max(), rtol=1e-6)
    r = np.exp(np.asarray(logp - logq))[np.asarray(mask)]
    np.testing.assert_allclose(float(m["ratio/max"]), r.max(), rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio/min"]), r.min(), rtol=1e-6)
    np.testing.assert_allclose(
      float(m["trust/masked_frac"]),
      float(m["trust/masked_frac_low"]) + float(m["trust/masked_frac_high"]),
      rtol=1e-6,
    )
    assert float(m["loss/count"]) == float(np.sum(mask))
    np.testing.assert_allclose(float(loss), float(m["loss/sum"] / m["loss/count"]), rtol=1e-6)

  def test_at_rollout_nothing_is_masked(self):
    _, logq, adv, mask = batch(10)
    for div in ("tv", "kl", "hellinger", "chi2"):
      for est in ("mc", "binary", "atomic"):
        _, m = objective.policy_loss(
          logq, logq, adv, mask, objective.LossConfig(divergence=div, estimator=est, delta_low=1e-6)
        )
        assert float(m["trust/masked_frac"]) == 0.0

  @chex.variants(with_jit=True, without_jit=True)
  def test_finite_at_extremes_and_bf16(self):
    logp, logq, adv, mask = batch(11, bf16=True)
    logp = logp.at[0, :4].set(jnp.log(jnp.float32(1e-30)).astype(jnp.bfloat16))
    logq = logq.at[1, :4].set(-1e-7)
    for div in ("tv", "kl", "hellinger", "chi2"):
      for est in ("mc", "binary", "atomic"):
        fn = self.variant(
          lambda lp, div=div, est=est: objective.policy_loss(
            lp, logq, adv, mask, objective.LossConfig(divergence=div, estimator=est, delta_low=0.05)
          )[0]
        )
        val, g = jax.value_and_grad(lambda lp, fn=fn: fn(lp).astype(jnp.float32))(logp)
        assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(g, np.float32)))

  def test_topk_estimator_through_the_loss(self):
    rng = np.random.default_rng(12)
    vocab, k = 20, 4
    logits_q = rng.normal(size=(B, T, vocab))
    logits_p = logits_q + 0.3 * rng.normal(size=(B, T, vocab))
    lq_all = jax.nn.log_softmax(jnp.asarray(logits_q, jnp.float32))
    lp_all = jax.nn.log_softmax(jnp.asarray(logits_p, jnp.float32))
    tokens = jnp.asarray(rng.integers(0, vocab, (B, T)))
    take = lambda x, i: jnp.take_along_axis(x, i, axis=-1)
    ids = jnp.argsort(-lq_all, axis=-1)[..., :k]
    _, adv, mask = batch(12)[1:]
    kwargs = dict(
      topk_logp=take(lp_all, ids), topk_logq=take(lq_all, ids), topk_ids=ids, tokens=tokens
    )
    loss, m = objective.policy_loss(
      take(lp_all, tokens[..., None])[..., 0],
      take(lq_all, tokens[..., None])[..., 0],
      adv,
      mask,
      objective.LossConfig(divergence="kl", estimator="topk", delta_low=0.01),
      estimator_kwargs=kwargs,
    )
    assert np.isfinite(float(loss)) and float(m["div/estimate_mean"]) > 0


class ErrorsTest(parameterized.TestCase):
  def test_bad_inputs(self):
    logp, logq, adv, mask = batch(13)
    kw = dict(divergence="kl", estimator="mc", delta_low=0.02)
    cfg = objective.LossConfig(**kw)
    with pytest.raises(ValueError, match="delta_low must be > 0"):
      objective.LossConfig(**{**kw, "delta_low": 0.0})
    with pytest.raises(ValueError, match="delta_high must be > 0"):
      cfg.replace(delta_high=-1.0)
    with pytest.raises(ValueError, match="unknown aggregation"):
      objective.LossConfig(aggregation="mean", **kw)
    with pytest.raises(ValueError, match=r"unknown divergence 'tvd'.*valid names: tv, kl"):
      objective.policy_loss(logp, logq, adv, mask, cfg.replace(divergence="tvd"))
    with pytest.raises(ValueError, match=r"unknown estimator 'mcmc'.*valid names: mc"):
      objective.policy_loss(logp, logq, adv, mask, cfg.replace(estimator="mcmc"))
    with pytest.raises(ValueError, match="must all be \\[batch, tokens\\]"):
      objective.policy_loss(logp, logq[:, :-1], adv, mask, cfg)
    with pytest.raises(ValueError, match="advantages must be"):
      objective.policy_loss(logp, logq, adv[:-1], mask, cfg)
    with pytest.raises(ValueError, match="kl_coef = 0.1 needs ref_logp"):
      objective.policy_loss(logp, logq, adv, mask, cfg.replace(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef = 0.1 needs entropy"):
      objective.policy_loss(logp, logq, adv, mask, cfg.replace(entropy_coef=0.1))
    with pytest.raises(TypeError, match="takes a LossConfig"):
      objective.policy_loss(logp, logq, adv, mask, kw)

  def test_custom_divergence_by_name_in_the_loss(self):
    divergences.register("test_sq_log", lambda t: jnp.log(t) ** 2, overwrite=True)
    logp, logq, adv, mask = batch(14)
    loss, m = objective.policy_loss(
      logp,
      logq,
      adv,
      mask,
      objective.LossConfig(divergence="test_sq_log", estimator="mc", delta_low=0.04),
    )
    l = np.asarray(logp - logq)
    np.testing.assert_allclose(
      float(m["div/estimate_max"]), (l**2)[np.asarray(mask)].max(), rtol=1e-5
    )
    assert np.isfinite(float(loss))


def test_presets_match_the_paper_anchors():
  assert presets.get("ppo").loss.delta_low == 0.1
  dapo = presets.get("dapo").loss
  assert (dapo.delta_low, dapo.delta_high) == (0.1, 0.14)
  dppo = presets.get("dppo")
  assert (dppo.loss.divergence, dppo.loss.estimator, dppo.loss.delta_low) == ("tv", "binary", 0.15)
  assert dppo.advantage == "dr_grpo" and dppo.loss.aggregation == "seq-mean-token-sum-norm"
  assert presets.get("dppo_kl").loss.delta_low == 0.05
  ripo = presets.get("ripo").loss
  assert (ripo.divergence, ripo.estimator, ripo.delta_low) == ("chi2", "atomic", 0.05)
  with pytest.raises(ValueError, match="valid names: ppo"):
    presets.get("trpo")


def test_loss_config_is_one_hashable_value():
  """A LossConfig is a static jit argument; a preset is one; a config's `loss` section has its
  fields, written by use_settings and read back by from_config unchanged."""
  logp, logq, adv, mask = batch(15)
  cfg = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.0231)
  assert cfg == objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.0231)
  assert hash(cfg) == hash(cfg.replace()) and cfg.radii == (0.0231, 0.0231)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.delta_low = 0.1  # type: ignore[misc]
  jitted = jax.jit(objective.policy_loss, static_argnums=4)
  np.testing.assert_allclose(
    jitted(logp, logq, adv, mask, cfg)[0],
    objective.policy_loss(logp, logq, adv, mask, cfg)[0],
    rtol=1e-6,
  )
  fields = {f.name for f in dataclasses.fields(objective.LossConfig)}
  assert set(config_lib.base().loss.keys()) == fields
  for name in presets.names():
    p = presets.get(name)
    c = config_lib.preset(name)
    assert c.advantage.name == p.advantage
    assert objective.LossConfig.from_config(c.loss) == p.loss.replace(delta_high=p.loss.radii[1])
  c = config_lib.cell("kl", "atomic")
  c.loss.kl_coef, c.loss.ratio_cap = 0.05, 2.0
  got = objective.LossConfig.from_config(c.loss, response_len=17)
  assert (got.kl_coef, got.ratio_cap, got.max_len) == (0.05, 2.0, 17)
  assert got.delta_low == presets.default_delta("kl")
