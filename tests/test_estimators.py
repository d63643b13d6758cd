"""Properties of divergences and per-token estimators (docs/math.md#divergences, #estimators)."""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from gppo_jax.algorithm import divergences, estimators

PAPER_DIVS = ("tv", "kl", "hellinger", "chi2")
ALL_DIVS = PAPER_DIVS + ("forward_kl", "js", "alpha:0.5", "alpha:2", "alpha:-1")
PER_TOKEN = ("mc", "binary", "atomic")

NP_F = {
  "tv": lambda t: 0.5 * np.abs(t - 1),
  "kl": lambda t: t - 1 - np.log(t),
  "hellinger": lambda t: (np.sqrt(t) - 1) ** 2,
  "chi2": lambda t: (t - 1) ** 2,
  "forward_kl": lambda t: t * np.log(t) - t + 1,
  "js": lambda t: t * np.log(t) - (1 + t) * np.log((1 + t) / 2),
  "alpha:0.5": lambda t: (t**0.5 - 1 - 0.5 * (t - 1)) / (0.5 * -0.5),
  "alpha:2": lambda t: (t**2 - 1 - 2 * (t - 1)) / 2,
  "alpha:-1": lambda t: (t**-1.0 - 1 + (t - 1)) / 2,
}


def np_estimate(div, est, p, q):
  f = NP_F[div]
  if est == "mc":
    return f(p / q)
  if est == "atomic":
    return q * f(p / q)
  return q * f(p / q) + (1 - q) * f((1 - p) / (1 - q))


def random_pq(rng, n, low=1e-4):
  p = np.exp(rng.uniform(np.log(low), np.log(0.999), n))
  q = np.exp(rng.uniform(np.log(low), np.log(0.999), n))
  return p, q


def random_dists(rng, vocab, n):
  logits_p = rng.normal(size=(n, vocab)) * 2
  logits_q = logits_p + rng.normal(size=(n, vocab)) * 0.7
  p = np.exp(logits_p - logits_p.max(-1, keepdims=True))
  q = np.exp(logits_q - logits_q.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)


def log32(x):
  return jnp.asarray(np.log(np.asarray(x, np.float32)))


class ClosedFormTest(parameterized.TestCase):
  @parameterized.product(div=ALL_DIVS, est=PER_TOKEN)
  def test_matches_numpy_closed_form(self, div, est):
    rng = np.random.default_rng(0)
    p, q = random_pq(rng, 512)
    got = np.asarray(estimators.estimate(div, est, np.log(p), np.log(q)))
    want = np_estimate(div, est, p, q)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)

  @parameterized.parameters(*PAPER_DIVS)
  def test_table_closed_forms(self, div):
    # The closed-form table of docs/math.md#estimators, written independently of the generator.
    p, q = random_pq(np.random.default_rng(1), 256, low=1e-3)
    r = p / q
    table = {
      ("tv", "mc"): 0.5 * abs(r - 1),
      ("tv", "binary"): abs(p - q),
      ("tv", "atomic"): 0.5 * abs(p - q),
      ("kl", "mc"): r - 1 - np.log(r),
      ("kl", "binary"): q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p)),
      ("kl", "atomic"): q * (r - 1 - np.log(r)),
      ("hellinger", "mc"): (np.sqrt(r) - 1) ** 2,
      ("hellinger", "binary"): (np.sqrt(p) - np.sqrt(q)) ** 2
      + (np.sqrt(1 - p) - np.sqrt(1 - q)) ** 2,
      ("hellinger", "atomic"): (np.sqrt(p) - np.sqrt(q)) ** 2,
      ("chi2", "mc"): (r - 1) ** 2,
      ("chi2", "binary"): (p - q) ** 2 / (q * (1 - q)),
      ("chi2", "atomic"): (p - q) ** 2 / q,
    }
    for est in PER_TOKEN:
      got = np.asarray(estimators.estimate(div, est, np.log(p), np.log(q)))
      np.testing.assert_allclose(got, table[(div, est)], rtol=2e-4, atol=1e-6, err_msg=est)

  def test_alpha_family_contains_the_paper_divergences(self):
    p, q = random_pq(np.random.default_rng(2), 128, low=1e-2)
    lp, lq = np.log(p), np.log(q)
    for est in PER_TOKEN:
      e = lambda d: np.asarray(estimators.estimate(d, est, lp, lq))  # noqa: B023
      np.testing.assert_allclose(e("alpha:0.5"), 2 * e("hellinger"), rtol=1e-4, atol=1e-7)
      np.testing.assert_allclose(e("alpha:2"), 0.5 * e("chi2"), rtol=1e-4, atol=1e-7)
      np.testing.assert_allclose(e("alpha:0"), e("kl"), rtol=1e-6)
      np.testing.assert_allclose(e("alpha:1"), e("forward_kl"), rtol=1e-6)
      np.testing.assert_allclose(e("alpha:1e-4"), e("kl"), rtol=2e-3, atol=1e-6)


class PropertiesTest(parameterized.TestCase):
  @parameterized.product(div=ALL_DIVS, est=PER_TOKEN)
  def test_nonnegative_zero_at_q_convex_min_at_q(self, div, est):
    for q in (1e-3, 0.1, 0.5, 0.9, 0.999):
      p = np.linspace(q * 0.02, min(1.0, q * 5) - 1e-6 if q < 1 else 1, 2001)
      p = np.unique(np.append(p, q))
      vals = np.asarray(
        estimators.estimate(div, est, np.log(p), np.full_like(p, np.log(q))), np.float64
      )
      assert np.all(vals >= 0), (div, est, q)
      at_q = vals[np.argmin(abs(p - q))]
      assert at_q <= 1e-6 * max(1.0, vals.max()), (div, est, q, at_q)
      # Minimum at p = q and non-decreasing away from it on both sides (quasi-convex in p).
      left, right = vals[p <= q], vals[p >= q]
      scale = 1e-5 * max(1.0, vals.max())
      assert np.all(np.diff(left) <= scale), (div, est, q)
      assert np.all(np.diff(right) >= -scale), (div, est, q)
      # Convexity: second differences on the uniform grid are >= 0 (up to float32 noise).
      grid = np.linspace(q * 0.05, min(0.999, q * 4), 201)
      v = np.asarray(estimators.estimate(div, est, np.log(grid), np.full_like(grid, np.log(q))))
      second = v[2:] - 2 * v[1:-1] + v[:-2]
      assert np.all(second >= -1e-4 * max(1.0, np.abs(v).max())), (div, est, q, second.min())

  @parameterized.parameters(*ALL_DIVS)
  def test_mc_unbiased_and_atomic_sums_to_divergence(self, div):
    rng = np.random.default_rng(3)
    p, q = random_dists(rng, vocab=40, n=16)
    true = np.sum(q * NP_F[div](p / q), axis=-1)
    lp, lq = np.log(p), np.log(q)
    mc = np.asarray(estimators.estimate(div, "mc", lp, lq), np.float64)
    atomic = np.asarray(estimators.estimate(div, "atomic", lp, lq), np.float64)
    np.testing.assert_allclose(np.sum(q * mc, -1), true, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.sum(atomic, -1), true, rtol=1e-4, atol=1e-7)

  @parameterized.parameters(*ALL_DIVS)
  def test_binary_bounded_by_divergence_and_tight_for_two_outcomes(self, div):
    rng = np.random.default_rng(4)
    p, q = random_dists(rng, vocab=30, n=16)
    true = np.sum(q * NP_F[div](p / q), axis=-1, keepdims=True)
    bin_ = np.asarray(estimators.estimate(div, "binary", np.log(p), np.log(q)), np.float64)
    assert np.all(bin_ <= true * (1 + 1e-4) + 1e-7)
    # Two outcomes: the binary estimate of either outcome is the whole divergence.
    p2 = rng.uniform(0.01, 0.99, 64)
    q2 = rng.uniform(0.01, 0.99, 64)
    true2 = q2 * NP_F[div](p2 / q2) + (1 - q2) * NP_F[div]((1 - p2) / (1 - q2))
    got = np.asarray(estimators.estimate(div, "binary", np.log(p2), np.log(q2)))
    np.testing.assert_allclose(got, true2, rtol=2e-4, atol=1e-7)

  def test_atomic_below_binary(self):
    p, q = random_pq(np.random.default_rng(5), 256)
    for div in ALL_DIVS:
      a = np.asarray(estimators.estimate(div, "atomic", np.log(p), np.log(q)))
      b = np.asarray(estimators.estimate(div, "binary", np.log(p), np.log(q)))
      assert np.all(a <= b * (1 + 1e-5) + 1e-7), div


class TransformTest(chex.TestCase, parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(div=PAPER_DIVS, est=PER_TOKEN)
  def test_jit_and_vmap_agree(self, div, est):
    p, q = random_pq(np.random.default_rng(6), 6 * 7)
    lp = jnp.asarray(np.log(p).reshape(6, 7), jnp.float32)
    lq = jnp.asarray(np.log(q).reshape(6, 7), jnp.float32)
    fn = self.variant(lambda a, b: estimators.estimate(div, est, a, b))
    batched = fn(lp, lq)
    per_token = jax.vmap(jax.vmap(lambda a, b: estimators.estimate(div, est, a, b)))(lp, lq)
    chex.assert_trees_all_close(batched, per_token, rtol=1e-6)
    ref = np.asarray(estimators.estimate(div, est, lp, lq))
    chex.assert_trees_all_close(batched, ref, rtol=1e-6)
    chex.assert_shape(batched, (6, 7))


class ExtremesTest(parameterized.TestCase):
  @parameterized.product(div=ALL_DIVS, est=PER_TOKEN)
  def test_finite_values_and_gradients_at_extremes(self, div, est):
    probs = np.array([1e-30, 1e-12, 1e-3, 0.5, 1 - 1e-4, 1 - 1e-7])
    p, q = np.meshgrid(probs, probs)
    lp = log32(p.ravel())
    lq = log32(q.ravel())
    val, grad = jax.value_and_grad(lambda a: estimators.estimate(div, est, a, lq).sum())(lp)
    assert np.isfinite(val), (div, est)
    assert np.all(np.isfinite(np.asarray(grad))), (div, est)
    # Probability exactly 1 (log p = 0) and a float32 underflow (log p = -inf) stay finite too.
    edge = jnp.array([0.0, -jnp.inf, -1e-7])
    val2, grad2 = jax.value_and_grad(
      lambda a: estimators.estimate(div, est, a, jnp.array([-0.5, -0.5, 0.0])).sum()
    )(edge)
    assert np.isfinite(val2) and np.all(np.isfinite(np.asarray(grad2))), (div, est)

  @parameterized.product(div=PAPER_DIVS, est=PER_TOKEN)
  def test_bf16_inputs(self, div, est):
    p, q = random_pq(np.random.default_rng(7), 64, low=1e-6)
    lp = jnp.asarray(np.log(p), jnp.bfloat16)
    lq = jnp.asarray(np.log(q), jnp.bfloat16)
    val, grad = jax.value_and_grad(
      lambda a: estimators.estimate(div, est, a, lq).astype(jnp.float32).sum()
    )(lp)
    assert np.isfinite(float(val))
    assert np.all(np.isfinite(np.asarray(grad, np.float32)))
    # bf16 logits feeding log-softmax: estimates match the float32 computation on the same inputs.
    ref = estimators.estimate(div, est, lp.astype(jnp.float32), lq.astype(jnp.float32))
    got = estimators.estimate(div, est, lp, lq)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6)

  def test_near_one_precision(self):
    # q = 1 - 1e-7 (common in LLM rollouts): binary terms must not divide by a rounded 1 - q.
    lq = jnp.array([-1e-7], jnp.float32)
    lp = jnp.array([-2e-7], jnp.float32)
    p, q = np.exp(-2e-7), np.exp(-1e-7)
    want = q * NP_F["kl"](p / q) + (1 - q) * NP_F["kl"]((1 - p) / (1 - q))
    got = float(estimators.estimate("kl", "binary", lp, lq)[0])
    np.testing.assert_allclose(got, want, rtol=1e-2)


class TopKExactTest(parameterized.TestCase):
  def _setup(self, vocab=50, n=12, seed=8):
    rng = np.random.default_rng(seed)
    p, q = random_dists(rng, vocab, n)
    tokens = np.array([rng.choice(vocab, p=row) for row in q])
    return rng, p, q, tokens

  @parameterized.parameters(*PAPER_DIVS)
  def test_topk_with_full_vocabulary_is_exact(self, div):
    _, p, q, tokens = self._setup()
    order = np.argsort(-q, axis=-1)
    idx = np.arange(len(q))[:, None]
    got = estimators.estimate(
      div,
      "topk",
      np.log(p[idx[:, 0], tokens]),
      np.log(q[idx[:, 0], tokens]),
      topk_logp=np.log(p[idx, order]),
      topk_logq=np.log(q[idx, order]),
      topk_ids=order,
      tokens=tokens,
    )
    true = np.sum(q * NP_F[div](p / q), axis=-1)
    np.testing.assert_allclose(np.asarray(got), true, rtol=2e-4, atol=1e-6)

  @parameterized.parameters(*PAPER_DIVS)
  def test_topk_partition_matches_reference_and_bounds(self, div):
    _, p, q, tokens = self._setup(seed=9)
    k = 5
    order = np.argsort(-q, axis=-1)[:, :k]
    rows = np.arange(len(q))
    got = np.asarray(
      estimators.estimate(
        div,
        "topk",
        np.log(p[rows, tokens]),
        np.log(q[rows, tokens]),
        topk_logp=np.log(p[rows[:, None], order]),
        topk_logq=np.log(q[rows[:, None], order]),
        topk_ids=order,
        tokens=tokens,
      )
    )
    f = NP_F[div]
    for i in range(len(q)):
      buckets = set(order[i]) | {tokens[i]}
      idx = sorted(buckets)
      pb, qb = p[i, idx], q[i, idx]
      pr, qr = 1 - pb.sum(), 1 - qb.sum()
      want = np.sum(qb * f(pb / qb)) + qr * f(pr / qr)
      np.testing.assert_allclose(got[i], want, rtol=5e-4, atol=1e-6)
    true = np.sum(q * f(p / q), axis=-1)
    binary = np.asarray(
      estimators.estimate(div, "binary", np.log(p[rows, tokens]), np.log(q[rows, tokens]))
    )
    assert np.all(got <= true * (1 + 1e-4) + 1e-6)  # coarser partition: data processing.
    assert np.all(got >= binary * (1 - 1e-4) - 1e-6)  # finer than {a_t, rest}.

  @parameterized.parameters(*PAPER_DIVS)
  def test_exact_chunked_equals_dense(self, div):
    rng = np.random.default_rng(10)
    n, d, vocab = 10, 8, 37
    hp = jnp.asarray(rng.normal(size=(2, n // 2, d)), jnp.float32)
    hq = hp + 0.3 * jnp.asarray(rng.normal(size=(2, n // 2, d)), jnp.float32)
    wp = jnp.asarray(rng.normal(size=(d, vocab)), jnp.float32)
    wq = wp + 0.2 * jnp.asarray(rng.normal(size=(d, vocab)), jnp.float32)
    dense = estimators.exact_from_logits(divergences.get(div), (hp @ wp) / 0.7, (hq @ wq) / 0.7)
    lp = jax.nn.log_softmax(np.asarray((hp @ wp) / 0.7, np.float64), -1)
    lq = jax.nn.log_softmax(np.asarray((hq @ wq) / 0.7, np.float64), -1)
    ref = np.sum(np.exp(lq) * NP_F[div](np.exp(lp - lq)), -1)
    np.testing.assert_allclose(np.asarray(dense), ref, rtol=1e-4, atol=1e-6)
    for chunk in (5, 16, 37, 64):  # Non-dividing, dividing-ish, exact, larger than the vocab.
      got = estimators.estimate(
        div,
        "exact",
        None,
        None,
        hidden_p=hp,
        w_p=wp,
        hidden_q=hq,
        w_q=wq,
        temperature=0.7,
        vocab_chunk=chunk,
      )
      chex.assert_shape(got, (2, n // 2))
      np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-6)
    jitted = jax.jit(
      lambda a, b: estimators.exact(
        divergences.get(div), hidden_p=a, w_p=wp, hidden_q=b, w_q=wq, temperature=0.7, vocab_chunk=8
      )
    )(hp, hq)
    np.testing.assert_allclose(np.asarray(jitted), ref, rtol=1e-4, atol=1e-6)


class RegistryAndErrorsTest(parameterized.TestCase):
  def test_unknown_names_list_valid_ones(self):
    with pytest.raises(ValueError, match="unknown divergence 'kll'.*tv, kl, hellinger, chi2"):
      estimators.estimate("kll", "mc", jnp.zeros(3), jnp.zeros(3))
    with pytest.raises(ValueError, match="unknown estimator 'atom'.*mc, binary, atomic"):
      estimators.estimate("kl", "atom", jnp.zeros(3), jnp.zeros(3))

  def test_shape_mismatch(self):
    with pytest.raises(ValueError, match="same shape"):
      estimators.estimate("kl", "mc", jnp.zeros((2, 3)), jnp.zeros((3, 2)))

  def test_register_new_divergence_and_estimator(self):
    quartic = divergences.register("test_quartic", lambda t: (t - 1.0) ** 4, overwrite=True)
    p, q = random_pq(np.random.default_rng(11), 32, low=1e-2)
    got = estimators.estimate("test_quartic", "atomic", np.log(p), np.log(q))
    np.testing.assert_allclose(np.asarray(got), q * (p / q - 1) ** 4, rtol=1e-4)
    assert quartic.slope_at_inf == float("inf")
    estimators.register(
      "test_half_atomic", lambda d, lp, lq: 0.5 * estimators.atomic(d, lp, lq), overwrite=True
    )
    half = estimators.estimate("kl", "test_half_atomic", np.log(p), np.log(q))
    full = estimators.estimate("kl", "atomic", np.log(p), np.log(q))
    np.testing.assert_allclose(np.asarray(half), 0.5 * np.asarray(full), rtol=1e-6)
    with pytest.raises(ValueError, match="already registered"):
      divergences.register("kl", lambda t: t - 1 - jnp.log(t))

  def test_builtin_generators_pass_the_registration_check(self):
    # The built-ins skip the check at import (no jax backend before jax.distributed): run it here.
    for name in divergences.names():
      divergences.check_generator(name, divergences.get(name).f)
    code = (
      "import jax._src.xla_bridge as xb, gppo_jax.train, gppo_jax.evaluate; "
      "print(bool(xb._backends))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "importing the entry points started a jax backend"

  def test_register_rejects_unnormalised_generator(self):
    with pytest.raises(ValueError, match="f\\(1\\) must be 0"):
      divergences.register("test_bad", lambda t: t**2, overwrite=True)
    with pytest.raises(ValueError, match="minimum at t = 1"):
      divergences.register("test_bad2", lambda t: t * jnp.log(t), overwrite=True)
