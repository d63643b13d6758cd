"""Tests for gppo_jax.pass_at_k against brute-force enumeration and exact combinatorics."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from gppo_jax.pass_at_k import (
  avg_at_n,
  benchmark_report,
  mean_pass_at_k,
  over_seeds,
  pass_at_k,
  problem_pass_at_k,
)


def brute_force(n, c, k):
  """Fraction of all k-subsets of n samples (the first c correct) holding a correct sample."""
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_matches_brute_force_on_small_n():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_stable_for_large_n():
  # Exact rational reference; the binomials here have hundreds of digits.
  for n, c, k in [(1000, 1, 1), (1000, 3, 100), (512, 10, 64), (1024, 0, 8), (300, 299, 2)]:
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
  assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)


def test_properties_and_errors():
  assert pass_at_k(16, 4, 1) == pytest.approx(4 / 16)  # pass@1 is the success rate
  assert pass_at_k(16, 0, 8) == 0.0 and pass_at_k(16, 16, 1) == 1.0
  assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples: every k-subset hits
  values = [pass_at_k(16, 3, k) for k in range(1, 17)]
  assert all(a <= b for a, b in itertools.pairwise(values))  # non-decreasing in k
  for bad in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
    with pytest.raises(ValueError):
      pass_at_k(*bad)


def test_table_helpers():
  correct = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
  assert avg_at_n(correct) == pytest.approx((0.25 + 0.5 + 0) / 3)
  assert mean_pass_at_k(correct, 1) == pytest.approx(avg_at_n(correct))
  np.testing.assert_allclose(problem_pass_at_k(correct, 2), [0.5, 5 / 6, 0.0])
  ragged = [[True], [False, True, True]]  # n may differ per problem
  assert avg_at_n(ragged) == pytest.approx((1 + 2 / 3) / 2)


def test_over_seeds_and_report():
  s = over_seeds([0.2, 0.4, 0.6])
  assert (s.mean, s.min, s.max, s.num_seeds) == (pytest.approx(0.4), 0.2, 0.6, 3)
  assert s.std == pytest.approx(0.2)  # sample std (ddof=1)
  assert over_seeds([0.5]).std == 0.0
  with pytest.raises(ValueError):
    over_seeds([])
  aime = [  # [seed][problem][sample]
    [[1, 1, 0, 0], [0, 0, 0, 0]],
    [[1, 0, 0, 0], [1, 0, 0, 0]],
  ]
  report = benchmark_report({"aime24": aime}, ks=(1, 2, 8))
  assert report["aime24/avg@4/mean"] == pytest.approx((0.25 + 0.25) / 2)
  assert report["aime24/avg@4/std"] == pytest.approx(0.0)
  seed_p2 = [(5 / 6 + 0) / 2, (0.5 + 0.5) / 2]
  assert report["aime24/pass@2/mean"] == pytest.approx(np.mean(seed_p2))
  assert report["aime24/pass@2/std"] == pytest.approx(np.std(seed_p2, ddof=1))
  assert "aime24/pass@8/mean" not in report  # k above n is skipped
  assert report["aime24/num_seeds"] == 2
