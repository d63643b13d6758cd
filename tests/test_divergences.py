"""Properties of the math core over many random draws, with and without jit (docs/math.md#tests).

Each test draws a few hundred (pi, mu) categorical pairs of random vocabulary sizes (padding tokens
have probability exactly 0, log-probability -inf) or a few thousand random tokens, runs the code
under `chex.variants` and checks it against float64 numpy references: non-negativity and zero
exactly at pi = mu, the estimators' identities (docs/math.md#estimators), the reductions to PPO,
DPPO and RIPO (docs/math.md#reductions), and finite values and gradients at extreme log-probs and
in bf16 (docs/math.md#numerics).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from gppo_jax.algorithm import estimators, objective

PAPER_DIVS = ("tv", "kl", "hellinger", "chi2")
DIVS = PAPER_DIVS + ("forward_kl", "js", "alpha:0.5")
PER_TOKEN = ("mc", "binary", "atomic")
N, VMAX, K = 384, 16, 3  # pairs per draw, largest vocabulary, top-K buckets

NP_F = {
  "tv": lambda t: 0.5 * np.abs(t - 1),
  "kl": lambda t: t - 1 - np.log(t),
  "hellinger": lambda t: (np.sqrt(t) - 1) ** 2,
  "chi2": lambda t: (t - 1) ** 2,
  "forward_kl": lambda t: t * np.log(t) - t + 1,
  "js": lambda t: t * np.log(t) - (1 + t) * np.log((1 + t) / 2),
  "alpha:0.5": lambda t: 2 * (np.sqrt(t) - 1) ** 2,
}


def draw_pairs(seed):
  """float32 log-probs [N, VMAX] of N (pi, mu) pairs and the vocabulary size of each row.

  Rows mix flat and peaked mu (probabilities from ~1e-13 to ~1), small and large shifts of pi, and
  every eighth row has pi = mu exactly; the columns past a row's vocabulary have probability 0.
  """
  rng = np.random.default_rng(seed)
  vocab = rng.integers(2, VMAX + 1, N)
  vocab[:24] = 2  # two-outcome rows: binary is exact there
  scale = np.exp(rng.uniform(np.log(0.1), np.log(6.0), (N, 1)))
  shift = np.exp(rng.uniform(np.log(0.02), np.log(3.0), (N, 1)))
  shift[::8] = 0.0
  logits_q = rng.normal(size=(N, VMAX)) * scale
  logits_p = logits_q + rng.normal(size=(N, VMAX)) * shift
  pad = np.arange(VMAX) >= vocab[:, None]
  logits_q[pad] = -np.inf
  logits_p[pad] = -np.inf
  logp = jax.nn.log_softmax(jnp.asarray(logits_p, jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(jnp.asarray(logits_q, jnp.float32), axis=-1)
  return logp, logq, vocab


def exact_f64(div, logp, logq):
  """D_f(pi || mu) per row in float64 over the support (0 f(0 / 0) = 0)."""
  p = np.exp(np.asarray(logp, np.float64))
  q = np.exp(np.asarray(logq, np.float64))
  support = q > 0
  with np.errstate(divide="ignore", invalid="ignore"):
    terms = np.where(support, q * NP_F[div](p / np.where(support, q, 1.0)), 0.0)
  return terms.sum(-1)


def topk_inputs(logp, logq):
  """mu's top-K log-probs and ids for every row, with every token of the row as the sampled one."""
  ids = jnp.argsort(-logq, axis=-1)[:, :K]
  take = lambda x: jnp.take_along_axis(x, ids, axis=-1)  # noqa: E731
  expand = lambda x: jnp.broadcast_to(x[:, None, :], (N, VMAX, K))  # noqa: E731
  tokens = jnp.broadcast_to(jnp.arange(VMAX), (N, VMAX))
  return dict(
    topk_logp=expand(take(logp)), topk_logq=expand(take(logq)), topk_ids=expand(ids), tokens=tokens
  )


def le(a, b, rtol=1e-4, atol=1e-6):
  """a <= b up to float32 rounding, elementwise."""
  return np.all(a <= b * (1 + rtol) + atol)


class RandomDistributionsTest(chex.TestCase, parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*DIVS)
  def test_identities_over_random_distributions(self, div):
    with_topk = div in PAPER_DIVS  # (top-K is the slowest to compile: the paper's four only)

    @self.variant
    def estimates(logp, logq, topk):
      out = {e: estimators.estimate(div, e, logp, logq) for e in PER_TOKEN}
      if with_topk:
        out["topk"] = estimators.estimate(div, "topk", logp, logq, **topk)
      return out

    logp, logq, vocab = draw_pairs(0)
    got = estimates(logp, logq, topk_inputs(logp, logq))
    got = {k: np.asarray(v, np.float64) for k, v in got.items()}
    true = exact_f64(div, logp, logq)
    lp, lq = np.asarray(logp, np.float64), np.asarray(logq, np.float64)
    q = np.exp(lq)
    valid = np.arange(VMAX) < vocab[:, None]
    same_row = np.all(lp == lq, axis=-1)
    for name, value in got.items():
      assert np.all(np.isfinite(value)) and np.all(value >= 0), (div, name)

    # Zero exactly where pi = mu, positive elsewhere: the divergence and every estimate.
    assert np.all(true[same_row] == 0) and np.all(true[~same_row] > 0), div
    apart = valid & (np.abs(np.where(valid, lp, 0.0) - np.where(valid, lq, 0.0)) > 1e-3)
    for est in got:
      np.testing.assert_array_equal(got[est][same_row], 0.0, err_msg=est)
      assert np.all(got[est][apart] > 0), (div, est)
    for est in PER_TOKEN:  # a token with p = q = 0 contributes nothing
      np.testing.assert_array_equal(got[est][~valid], 0.0, err_msg=est)

    # mc is unbiased, the atomic terms sum to D_f, and atomic = q * mc token by token.
    np.testing.assert_allclose(np.sum(q * got["mc"], -1), true, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.sum(got["atomic"], -1), true, rtol=1e-4, atol=1e-6)
    # (atol: the alpha family's perspective cancels near r = 1 to ~1e-10 absolute.)
    np.testing.assert_allclose(got["atomic"], q * got["mc"], rtol=1e-4, atol=1e-9)

    # Coarser partitions give less (data processing): atomic <= binary <= topk <= D_f. binary
    # takes 1 - p from log p, which float32 fixes only to ~6e-8 absolute when p is close to 1,
    # while D_f sums the other tokens' own probabilities: hence atol 1e-5 where binary meets D_f.
    assert le(got["atomic"], got["binary"], rtol=1e-5, atol=1e-7), div
    assert le(got["binary"], true[:, None], atol=1e-5), div
    two = (vocab == 2)[:, None] & valid  # two outcomes: binary is the whole divergence
    want = np.broadcast_to(true[:, None], two.shape)[two]
    np.testing.assert_allclose(got["binary"][two], want, rtol=1e-4, atol=1e-5)
    if with_topk:
      assert le(got["binary"][valid], got["topk"][valid], atol=1e-5), div
      assert le(got["topk"], true[:, None]), div
      np.testing.assert_allclose(got["topk"][two], want, rtol=1e-4, atol=1e-6)


# log-probabilities from exactly 1 down to far below the estimators' floor, and an underflow.
EXTREME_LOGPROBS = np.array(
  [0.0, -1e-8, -1e-7, -1e-4, -0.69, -5.0, -30.0, -50.0, -69.0, -80.0, -100.0, -1e4, -np.inf]
)


class ExtremesTest(chex.TestCase, parameterized.TestCase):
  # (the other registered divergences are checked at extremes in float32 by test_estimators.py)
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*PAPER_DIVS)
  def test_finite_values_and_gradients_at_extreme_log_probs(self, div):
    lp, lq = np.meshgrid(EXTREME_LOGPROBS, EXTREME_LOGPROBS)  # log-ratios up to +-1e4 and +-inf
    lp, lq = lp.ravel(), lq.ravel()

    @self.variant
    def values_and_grad(logp, logq):
      def total(a):  # a non-finite gradient of any estimate makes this one non-finite too
        return sum(
          estimators.estimate(div, e, a, logq).astype(jnp.float32).sum() for e in PER_TOKEN
        )

      values = {e: estimators.estimate(div, e, logp, logq) for e in PER_TOKEN}
      return values, jax.grad(total)(logp)

    f32 = values_and_grad(jnp.asarray(lp, jnp.float32), jnp.asarray(lq, jnp.float32))
    bf16_in = (jnp.asarray(lp, jnp.bfloat16), jnp.asarray(lq, jnp.bfloat16))
    bf16 = values_and_grad(*bf16_in)
    rounded = values_and_grad(*(x.astype(jnp.float32) for x in bf16_in))
    for values, grad in (f32, bf16):
      assert np.all(np.isfinite(np.asarray(grad, np.float32))), div
      for est, value in values.items():
        assert value.dtype == jnp.float32  # bf16 inputs are computed in float32
        assert np.all(np.isfinite(value)) and np.all(np.asarray(value) >= 0), (div, est)
    for est in PER_TOKEN:
      np.testing.assert_array_equal(np.asarray(f32[0][est])[lp == lq], 0.0)  # -inf = -inf too
      # The same numbers as float32 on the bf16-rounded inputs.
      np.testing.assert_allclose(
        np.asarray(bf16[0][est]), np.asarray(rounded[0][est]), rtol=1e-6, err_msg=est
      )


def draw_tokens(rng, b=32, t=64):
  """float32 [b, t] log-probs with q from ~1e-30 to 1 - 1e-7, and [b] advantages (some 0)."""
  u = rng.uniform(size=(b, t))
  logq = np.where(
    u < 0.5,
    np.log(rng.uniform(0.01, 0.99, (b, t))),
    np.where(
      u < 0.75,
      np.log1p(-(10.0 ** rng.uniform(-7, -1, (b, t)))),  # q close to 1
      rng.uniform(-69.0, -5.0, (b, t)),  # rare tokens
    ),
  )
  logp = np.minimum(logq + rng.normal(0, 1, (b, t)) * rng.uniform(0.05, 1.5, (b, 1)), 0.0)
  adv = rng.normal(size=b)
  adv[::7] = 0.0
  mask = np.arange(t) < rng.integers(1, t + 1, b)[:, None]
  return (
    jnp.asarray(logp, jnp.float32),
    jnp.asarray(logq, jnp.float32),
    jnp.asarray(adv, jnp.float32),
    jnp.asarray(mask),
  )


class ReductionsOverRandomDrawsTest(chex.TestCase, parameterized.TestCase):
  """The loss's gradient equals -keep * r * A / count with keep given by the known algorithm."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("ppo_tv_mc", "dppo_tv_binary", "ripo_chi2_atomic")
  def test_mask_is_the_known_algorithms(self, cell):
    div, est = {
      "ppo_tv_mc": ("tv", "mc"),
      "dppo_tv_binary": ("tv", "binary"),
      "ripo_chi2_atomic": ("chi2", "atomic"),
    }[cell]

    @self.variant
    def grad(logp, logq, adv, mask, delta_low, delta_high):
      cfg = objective.LossConfig(
        divergence=div, estimator=est, delta_low=delta_low, delta_high=delta_high
      )
      loss = lambda lp: objective.policy_loss(lp, logq, adv, mask, cfg)[0]  # noqa: E731
      return jax.grad(loss)(logp)

    rng = np.random.default_rng(100)
    for _ in range(3):
      logp, logq, adv, mask = draw_tokens(rng)
      lp, lq = np.asarray(logp, np.float64), np.asarray(logq, np.float64)
      p, q, r = np.exp(lp), np.exp(lq), np.exp(lp - lq)
      a = np.asarray(adv, np.float64)[:, None] * np.ones_like(r)
      m = np.asarray(mask)
      if cell == "ppo_tv_mc":  # PPO's clip eps = 2 delta, drawn separately for the two sides
        eps_low, eps_high = rng.uniform(0.05, 0.5, 2)
        deltas = (eps_low / 2, eps_high / 2)
        dist_low = dist_high = np.abs(r - 1)
        bound_low, bound_high = eps_low, eps_high
      elif cell == "dppo_tv_binary":  # |pi - mu| at the sampled token
        deltas = (rng.uniform(0.02, 0.3),) * 2
        dist_low = dist_high = np.abs(p - q)
        bound_low = bound_high = deltas[0]
      else:  # RIPO: |r - 1| <= sqrt(delta / q)
        deltas = (rng.uniform(0.01, 0.2),) * 2
        dist_low = dist_high = np.abs(r - 1)
        bound_low = bound_high = np.sqrt(deltas[0] / q)
      out = ((a > 0) & (r > 1) & (dist_high > bound_high)) | (
        (a < 0) & (r < 1) & (dist_low > bound_low)
      )
      assert 0.01 < np.mean(out[m]) < 0.9, cell  # both kinds of token occur
      g = np.asarray(grad(logp, logq, adv, mask, *(jnp.float32(d) for d in deltas)), np.float64)
      want = np.where(m & ~out, -r * a / m.sum(), 0.0)
      # Tokens within float32 rounding of the boundary may fall either way: skip them.
      near = np.minimum(
        np.abs(dist_low - bound_low) / bound_low, np.abs(dist_high - bound_high) / bound_high
      )
      sure = near > 1e-4
      np.testing.assert_allclose(g[sure], want[sure], rtol=1e-5, atol=1e-30)
      np.testing.assert_array_equal(g[~m], 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_loss_finite_at_extreme_log_ratios_and_bf16(self):
    # Log-ratios +-50 and +-80 (q or p at e^-80), p = 0, q near 1; advantage +1 and -1 (two rows).
    lp = np.asarray([0.0, -50.0, 0.0, -80.0, -1e-7, -0.7, -1e4, -np.inf])
    lq = np.asarray([-50.0, 0.0, -80.0, 0.0, -0.7, -1e-7, -0.5, -0.5])
    lp, lq = np.stack([lp, lp]), np.stack([lq, lq])
    adv, mask = jnp.asarray([1.0, -1.0]), jnp.ones(lp.shape, bool)
    # Every divergence and every estimator once, the presets' cells among them.
    cells = [
      ("tv", "mc"),
      ("tv", "binary"),
      ("kl", "binary"),
      ("kl", "atomic"),
      ("chi2", "atomic"),
      ("hellinger", "mc"),
    ]

    @self.variant
    def values_and_grads(logp, logq):
      def loss(x, div, est):
        cfg = objective.LossConfig(divergence=div, estimator=est, delta_low=0.05)
        return objective.policy_loss(x, logq, adv, mask, cfg)[0].astype(jnp.float32)

      return [jax.value_and_grad(loss)(logp, d, e) for d, e in cells]

    for dtype in (jnp.float32, jnp.bfloat16):
      out = values_and_grads(jnp.asarray(lp, dtype), jnp.asarray(lq, dtype))
      for cell, (val, g) in zip(cells, out, strict=True):
        assert np.isfinite(float(val)), (cell, dtype)
        assert np.all(np.isfinite(np.asarray(g, np.float32))), (cell, dtype)


def test_loss_finite_when_log_ratio_overflows_float32():
  """q < 1e-38 (log q = -100): the ratio would be inf in float32; a masked token must not NaN."""
  lp = jnp.asarray([[0.0, -0.5]], jnp.float32)
  lq = jnp.asarray([[-100.0, -0.5]], jnp.float32)
  fn = lambda x: objective.policy_loss(  # noqa: E731
    x,
    lq,
    jnp.asarray([1.0]),
    jnp.ones((1, 2), bool),
    objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.02),
  )[0]
  val, g = jax.value_and_grad(fn)(lp)
  assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(g)))


def test_register_estimates_the_limits_of_a_new_generator(monkeypatch):
  """Without f_at_zero / slope_at_inf, register estimates them: the slope at infinity of a
  generator that squares t (triangular discrimination, (t - 1)^2 / (t + 1): slope 1) stays finite,
  slowly converging ones (squared Hellinger: 1) are found, and super-linear ones are inf."""
  import math

  import pytest

  from gppo_jax.algorithm import divergences

  # The registrations below are undone after the test.
  monkeypatch.setattr(divergences._REGISTRY, "_items", dict(divergences._REGISTRY._items))
  cases = {
    "triangular": (lambda t: (t - 1) ** 2 / (t + 1), 1.0),
    "hellinger_sq": (lambda t: (jnp.sqrt(t) - 1) ** 2, 1.0),
    "tv_half": (lambda t: 0.5 * jnp.abs(t - 1), 0.5),
    "kl_like": (lambda t: t * jnp.log(t) - t + 1, math.inf),
    "chi2_like": (lambda t: (t - 1) ** 2, math.inf),
  }
  for name, (f, slope) in cases.items():
    div = divergences.register(f"_test_{name}", f, validate=False, overwrite=True)
    if math.isinf(slope):
      assert math.isinf(div.slope_at_inf), name
    else:
      assert div.slope_at_inf == pytest.approx(slope, rel=2e-3), name
  assert divergences.get("_test_triangular").f_at_zero == pytest.approx(1.0)
