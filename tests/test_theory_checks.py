"""The theory module's claims, checked on small exactly solvable problems (docs/math.md#theory).

The problems are tabular: a bandit (one softmax choice over K tokens) and a token tree (H tokens
in a row, each from K, the state being the prefix; discount gamma; rewards on every step), whose
returns, advantages and discounted state visitations are computed exactly in float64. A policy
pi is kept in a divergence's level set D_f(pi(.|s) || mu(.|s)) <= delta at every state, and
checked against:

  - tv_radius:  max_s TV(pi(.|s), mu(.|s)) <= tv_radius(f, delta) <= sqrt(delta / C_f);
  - the improvement guarantee (TRPO's Theorem 1 with V_max bounded by tv_radius):
      |J(pi) - J(mu) - G(pi)| <= 4 eps gamma / (1 - gamma)^2 V_max^2,
      G(pi) = sum_s rho_mu(s) sum_a pi(a|s) A_mu(s, a),  eps = max |A_mu|,
    so J(pi) - J(mu) >= G(pi) - 4 eps gamma / (1 - gamma)^2 tv_radius(f, delta)^2, and this bound
    is positive (monotonic improvement) for small delta along the trust-region update;
  - level sets: inside the region every token's atomic and binary estimate is <= D_f <= delta,
    so its ratio lies in level_set(f, est, delta, q); MC has no such guarantee.
On the bandit the surrogate is exact: J(pi) - J(mu) = G(pi).
"""

from __future__ import annotations

import numpy as np
import pytest

from gppo_jax.algorithm import theory

DIVS = ("tv", "kl", "hellinger", "chi2")
NP_F = {
  "tv": lambda t: 0.5 * np.abs(t - 1),
  "kl": lambda t: t - 1 - np.log(t),
  "hellinger": lambda t: (np.sqrt(t) - 1) ** 2,
  "chi2": lambda t: (t - 1) ** 2,
}


def softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def d_f(name, pi, mu):
  """[..., K] -> [...]: D_f(pi || mu) = sum_a mu f(pi / mu)."""
  return np.sum(mu * NP_F[name](pi / mu), axis=-1)


def tv(pi, mu):
  return 0.5 * np.sum(np.abs(pi - mu), axis=-1)


class TokenTree:
  """H steps of choosing one of K tokens; depth h has K^h states (prefixes), rewards r[h] [K^h, K]
  for each (state, token), discount gamma; the state after H tokens is terminal. Policies are
  lists of [K^h, K] arrays."""

  def __init__(self, rng, K, H, gamma):
    self.K, self.H, self.gamma = K, H, gamma
    self.r = [rng.normal(size=(K**h, K)) for h in range(H)]

  def values(self, pi):
    """(J, Q per depth): exact returns by backward induction."""
    v_next = np.zeros(self.K**self.H)
    qs = [None] * self.H
    for h in reversed(range(self.H)):
      qs[h] = self.r[h] + self.gamma * v_next.reshape(self.K**h, self.K)
      v_next = np.sum(pi[h] * qs[h], axis=-1)
    return float(v_next[0]), qs

  def visitation(self, mu):
    """rho_mu per depth: sum_t gamma^t P(s_t = s) (unnormalised), from the root."""
    p, rho = np.ones(1), []
    for h in range(self.H):
      rho.append(self.gamma**h * p)
      p = (p[:, None] * mu[h]).reshape(-1)
    return rho

  def random_policy(self, rng, scale=1.5):
    return [softmax(scale * rng.normal(size=(self.K**h, self.K))) for h in range(self.H)]


def advantages(tree, mu):
  j, qs = tree.values(mu)
  return j, [q - np.sum(mu[h] * q, -1, keepdims=True) for h, q in enumerate(qs)]


def surrogate_gain(tree, mu, pi, adv):
  rho = tree.visitation(mu)
  return float(sum(np.sum(rho[h] * np.sum(pi[h] * adv[h], -1)) for h in range(tree.H)))


def tilt_to_boundary(name, mu, direction, delta, iters=100):
  """Per row, the largest t with D_f(softmax(log mu + t z) || mu) <= delta (bisection; t found by
  doubling first, capped at 1e6). Returns t [rows]."""
  logmu = np.log(mu)
  div = lambda t: d_f(name, softmax(logmu + t[:, None] * direction), mu)
  lo = np.zeros(mu.shape[0])
  hi = np.full(mu.shape[0], 1e-3)
  for _ in range(60):
    grow = (div(hi) <= delta) & (hi < 1e6)
    hi = np.where(grow, hi * 2, hi)
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    inside = div(mid) <= delta
    lo, hi = np.where(inside, mid, lo), np.where(inside, hi, mid)
  return lo


def region_policy(name, mu, directions, delta, fraction):
  """pi(.|s) = softmax(log mu + fraction * t*(s) z(s)), t* the level-set boundary per state."""
  out = []
  for m, z in zip(mu, directions, strict=True):
    t = tilt_to_boundary(name, m, z, delta) * fraction
    out.append(softmax(np.log(m) + t[:, None] * z))
  return out


def trpo_penalty(tree, adv, v_max):
  eps = max(float(np.max(np.abs(a))) for a in adv)
  return 4 * eps * tree.gamma / (1 - tree.gamma) ** 2 * v_max**2


@pytest.mark.parametrize("name", DIVS)
def test_bandit_surrogate_is_exact_and_the_update_improves(name):
  """One state, K = 6 tokens with exact expected rewards: J(pi) - J(mu) = sum_a pi(a) A(a) for
  every pi, and the trust-region update (mu tilted along A to the level set D_f = delta) improves
  the return for every delta, more for a larger region, with TV within tv_radius."""
  rng = np.random.default_rng(0)
  tree = TokenTree(rng, K=6, H=1, gamma=0.0)
  deltas = theory.default_delta(name) * np.array([1e-3, 1e-2, 1e-1, 1.0])
  radii = np.atleast_1d(theory.tv_radius(name, deltas))
  for _ in range(5):
    mu = tree.random_policy(rng)
    j_mu, adv = advantages(tree, mu)
    gains = []
    for delta, radius in zip(deltas, radii, strict=True):
      pi = region_policy(name, mu, adv, delta, 1.0)
      assert d_f(name, pi[0], mu[0])[0] <= delta * (1 + 1e-9)
      assert d_f(name, pi[0], mu[0])[0] >= delta * (1 - 1e-6)  # on the boundary
      assert tv(pi[0], mu[0])[0] <= radius + 1e-12
      j_pi, _ = tree.values(pi)
      gain = surrogate_gain(tree, mu, pi, adv)
      np.testing.assert_allclose(j_pi - j_mu, gain, rtol=1e-12, atol=1e-14)
      assert gain > 0
      gains.append(gain)
    assert np.all(np.diff(gains) > 0), gains


@pytest.mark.parametrize("gamma", [0.5, 0.9])
@pytest.mark.parametrize("name", DIVS)
def test_improvement_bound_holds_in_every_level_set(name, gamma):
  """Token tree (K = 3, H = 3): random policies inside D_f <= delta at every state have
  max TV <= tv_radius(f, delta) <= sqrt(delta / C_f) and |J(pi) - J(mu) - G| <= the TRPO
  penalty, so J(pi) - J(mu) >= G - penalty(tv_radius)."""
  rng = np.random.default_rng(1)
  tree = TokenTree(rng, K=3, H=3, gamma=gamma)
  deltas = theory.default_delta(name) * np.array([0.01, 0.1, 1.0, 4.0])
  radii = np.atleast_1d(theory.tv_radius(name, deltas))
  pinsker = np.sqrt(deltas / theory.quadratic_constant(name))
  assert np.all(radii <= pinsker * (1 + 1e-9))
  checked = 0
  for _ in range(4):
    mu = tree.random_policy(rng)
    j_mu, adv = advantages(tree, mu)
    for delta, radius in zip(deltas, radii, strict=True):
      dirs = [rng.normal(size=m.shape) for m in mu]
      pi = region_policy(name, mu, dirs, delta, rng.uniform(0.2, 1.0))
      assert max(float(np.max(d_f(name, p, m))) for p, m in zip(pi, mu, strict=True)) <= delta * (
        1 + 1e-9
      )
      v_max = max(float(np.max(tv(p, m))) for p, m in zip(pi, mu, strict=True))
      assert v_max <= radius + 1e-12, (v_max, radius)
      j_pi, _ = tree.values(pi)
      gain = surrogate_gain(tree, mu, pi, adv)
      slack = 1e-12 * (1 + abs(gain))
      assert abs(j_pi - j_mu - gain) <= trpo_penalty(tree, adv, v_max) + slack
      assert j_pi - j_mu >= gain - trpo_penalty(tree, adv, radius) - slack
      checked += 1
  assert checked == 16


@pytest.mark.parametrize("name", DIVS)
def test_trust_region_update_improves_monotonically_for_small_delta(name):
  """The trust-region update (each state's mu tilted along its advantages to the level set):
  the exact improvement is >= the guaranteed bound G - penalty(tv_radius) at every step inside
  the region, and for the smaller radii the bound is positive, so the return improves."""
  rng = np.random.default_rng(2)
  tree = TokenTree(rng, K=3, H=3, gamma=0.5)
  deltas = theory.default_delta(name) * np.logspace(-6, 0, 7)
  radii = np.atleast_1d(theory.tv_radius(name, deltas))
  positive = 0
  for _ in range(3):
    mu = tree.random_policy(rng)
    j_mu, adv = advantages(tree, mu)
    for delta, radius in zip(deltas, radii, strict=True):
      for fraction in (0.25, 0.5, 1.0):  # steps inside the region, up to its boundary
        pi = region_policy(name, mu, adv, delta, fraction)
        j_pi, _ = tree.values(pi)
        bound = surrogate_gain(tree, mu, pi, adv) - trpo_penalty(tree, adv, radius)
        assert j_pi - j_mu >= bound - 1e-12, (delta, fraction, j_pi - j_mu, bound)
        if bound > 0:
          positive += 1
          assert j_pi > j_mu
  # The guarantee is not vacuous here: the bound is positive at the small radii.
  assert positive >= 3 * 3 * 2, positive


@pytest.mark.parametrize("name", DIVS)
def test_atomic_and_binary_never_mask_inside_the_exact_region(name):
  """Inside D_f(pi(.|s) || mu(.|s)) <= delta, each token's atomic and binary estimate is <= D_f
  (non-negative parts of its sum), so every ratio lies in level_set(f, est, delta, q); MC's
  level set is narrower for the rare tokens and excludes some of them."""
  rng = np.random.default_rng(3)
  tree = TokenTree(rng, K=8, H=2, gamma=0.5)
  delta = theory.default_delta(name)
  mu = tree.random_policy(rng, scale=2.5)
  pi = region_policy(name, mu, [rng.normal(size=m.shape) * 2 for m in mu], delta, 1.0)
  q = np.concatenate([m.ravel() for m in mu])
  r = np.concatenate([(p / m).ravel() for p, m in zip(pi, mu, strict=True)])
  tol = 1e-5  # level_set's endpoints come from float32 estimators
  for est in ("atomic", "binary"):
    lo, hi = theory.level_set(name, est, delta, q)
    assert np.all(r >= lo * (1 - tol)) and np.all(r <= hi * (1 + tol)), est
  lo, hi = theory.level_set(name, "mc", delta, q)
  assert np.any((r < lo) | (r > hi))  # MC would mask some tokens of an in-region policy


def test_estimator_variance_benchmark_measures_its_prediction(capsys):
  """benchmarks/estimator_variance.py runs, and its sampled second-moment ratio of atomic to MC
  matches the predicted sum_a w(a) mu(a)^2 (at 5000 tokens per pair, within 25%)."""
  import importlib.util
  import os

  path = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "benchmarks", "estimator_variance.py"
  )
  spec = importlib.util.spec_from_file_location("estimator_variance", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  assert bench.main(["--pairs", "2", "--samples", "5000", "--vocabs", "2,64"]) == 0
  out = capsys.readouterr().out
  factor = float(out.split("within a factor ")[1].split()[0])
  assert 1.0 <= factor < 1.25, out
  rng = np.random.default_rng(0)
  pi, mu = bench.random_pair(rng, 16)
  ex = bench.exact_moments("kl", pi, mu)
  # The prediction is mu^2 averaged under MC's second moment: within [min mu^2, max mu^2].
  assert mu.min() ** 2 <= ex["predicted"] <= mu.max() ** 2
  np.testing.assert_allclose(ex["d_f"], d_f("kl", pi, mu), rtol=1e-12)
