"""Tests for gppo_jax.rewards.pass_at_k against brute-force enumeration and exact combinatorics."""

import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from gppo_jax.rewards.pass_at_k import (
  avg_at_n,
  estimate,
  make_report,
  mean_pass_at_k,
  normalize_ks,
  over_seeds,
  pass_at_k,
  problem_pass_at_k,
  score_benchmark,
  to_markdown,
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


def test_over_seeds():
  s = over_seeds([0.2, 0.4, 0.6])
  assert (s.mean, s.min, s.max, s.num_seeds) == (pytest.approx(0.4), 0.2, 0.6, 3)
  assert s.std == pytest.approx(0.2)  # sample std (ddof=1)
  assert over_seeds([0.5]).std == 0.0
  with pytest.raises(ValueError):
    over_seeds([])


def test_normalize_ks_keeps_old_single_ints():
  assert normalize_ks(4) == (4,) and normalize_ks(0) == ()  # 0: the old "no sampled eval"
  assert normalize_ks([16, 1, 8, 8]) == (1, 8, 16) and normalize_ks(()) == ()
  for bad in (-1, [0, 2], [1.5], "4", True, [True]):
    with pytest.raises(ValueError):
      normalize_ks(bad)


def test_estimate_takes_the_standard_error_over_problems_after_averaging_seeds():
  # [seeds, problems]: problem means 0.5, 1.0, 0.0, 0.5; seed means 0.5 and 0.5.
  v = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
  e = estimate(v)
  per_problem = np.array([0.5, 1.0, 0.0, 0.5])
  assert e.mean == pytest.approx(0.5)
  assert e.se == pytest.approx(np.std(per_problem, ddof=1) / 2)
  assert e.per_seed == (0.5, 0.5) and e.seed_std == 0.0
  one = estimate(np.array([[1.0]]))
  assert one.mean == 1.0 and np.isnan(one.se)  # one problem: no standard error


def test_macro_average_is_the_mean_of_benchmarks_not_of_problems():
  big = score_benchmark("math500", "math", np.ones(4), np.ones(4, bool), None, ())
  small = score_benchmark("aime24", "math", np.zeros(2), np.ones(2, bool), None, ())
  pooled = score_benchmark(
    "all", "math", np.r_[np.ones(4), np.zeros(2)], np.ones(6, bool), None, ()
  )
  report = make_report(pooled, [big, small])
  (macro,) = report.macro
  assert macro.accuracy.mean == 0.5 and pooled.accuracy.mean == pytest.approx(4 / 6)
  assert macro.accuracy.se == pytest.approx(np.hypot(big.accuracy.se, small.accuracy.se) / 2)
  assert macro.members == ("math500", "aime24") and macro.num_problems == 6
  m = report.metrics()
  assert m["eval/accuracy"] == pytest.approx(4 / 6)  # eval/accuracy stays pooled
  assert m["eval/macro_math/accuracy"] == 0.5 and m["eval/aime24/accuracy"] == 0.0
  with pytest.raises(ValueError, match="reserved"):
    make_report(pooled, [dataclasses.replace(big, name="macro_x")])


def test_benchmark_report_per_seed_and_k():
  aime = np.array(  # [seed][problem][sample]
    [
      [[1, 1, 0, 0], [0, 0, 0, 0]],
      [[1, 0, 0, 0], [1, 0, 0, 0]],
    ],
    bool,
  )
  greedy, valid = np.array([1.0, 0.0]), np.ones(2, bool)
  r = score_benchmark("aime24", "math", greedy, valid, aime, (1, 2))
  assert r.n == 4 and r.num_seeds == 2
  assert r.avg.mean == pytest.approx(0.25) and r.avg.seed_std == pytest.approx(0.0)
  seed_p2 = [(5 / 6 + 0) / 2, (0.5 + 0.5) / 2]
  assert r.pass_at[2].per_seed == pytest.approx(tuple(seed_p2))
  assert r.pass_at[2].mean == pytest.approx(np.mean(seed_p2))
  assert r.pass_at[2].seed_std == pytest.approx(np.std(seed_p2, ddof=1))
  problem_p2 = [(5 / 6 + 0.5) / 2, (0 + 0.5) / 2]
  assert r.pass_at[2].se == pytest.approx(np.std(problem_p2, ddof=1) / np.sqrt(2))
  assert r.pass_at[1].mean == pytest.approx(r.avg.mean)  # pass@1 is avg@n
  with pytest.raises(ValueError, match="k <= n = 4"):
    score_benchmark("aime24", "math", greedy, valid, aime, (8,))
  # An unjudgeable greedy response leaves its problem out of the accuracy.
  assert score_benchmark("x", "", greedy, np.array([True, False]), None, ()).accuracy.mean == 1.0
  m = make_report(r, [r]).metrics()
  assert {"eval/avg@4", "eval/avg@4_se", "eval/avg@4_seed_std", "eval/pass@2_se"} <= set(m)
  assert "eval/aime24/avg@4" not in m  # one benchmark: the pooled keys only (as before)
  assert m["eval/macro_math/pass@2"] == pytest.approx(r.pass_at[2].mean)
  text = to_markdown(make_report(r, [r]))
  assert "| aime24 | math | 2 | 50.0 ± 50.0 | 25.0 ± 12.5 (sd 0.0) |" in text
  assert "**math (macro, 1 benchmarks)**" in text and text.count("\n") == 5
  d = make_report(r, [r]).as_dict()
  assert d["benchmarks"][0]["figures"]["pass@2"]["per_seed"] == pytest.approx(seed_p2)
