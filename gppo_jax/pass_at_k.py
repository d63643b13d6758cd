"""Evaluation statistics: the unbiased pass@k estimator, avg@n, and aggregation over seeds.

pass@k for one problem with n samples of which c are correct is 1 - C(n - c, k) / C(n, k)
(Chen et al. 2021), computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the
huge binomials. avg@n (what reasoning-RL papers report as pass@1) is the mean correctness.
Benchmarks such as AIME have 30 problems (one problem is 3.3 points), so results are reported as
mean and spread over evaluation seeds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased estimate of P(at least one of k samples is correct) from c correct out of n."""
  if not 0 <= c <= n:
    raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
  if not 1 <= k <= n:
    raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def problem_pass_at_k(correct: Sequence[Sequence[bool]] | np.ndarray, k: int) -> np.ndarray:
  """pass@k of each problem from a [num_problems][n] correctness table (n may vary per row)."""
  return np.array([pass_at_k(len(row), int(np.sum(row)), k) for row in correct], np.float64)


def mean_pass_at_k(correct: Sequence[Sequence[bool]] | np.ndarray, k: int) -> float:
  """Benchmark pass@k: the mean over problems of each problem's unbiased pass@k."""
  return float(np.mean(problem_pass_at_k(correct, k)))


def avg_at_n(correct: Sequence[Sequence[bool]] | np.ndarray) -> float:
  """avg@n: mean correctness over all samples of each problem, then over problems."""
  return float(np.mean([np.mean(np.asarray(row, np.float64)) for row in correct]))


@dataclasses.dataclass(frozen=True)
class SeedStats:
  """Mean, sample standard deviation (ddof=1, 0 for one seed), min and max over seeds."""

  mean: float
  std: float
  min: float
  max: float
  num_seeds: int


def over_seeds(values: Sequence[float]) -> SeedStats:
  """Summary of one metric measured under several evaluation seeds."""
  v = np.asarray(values, np.float64)
  if v.size == 0:
    raise ValueError("no values to aggregate")
  std = float(np.std(v, ddof=1)) if v.size > 1 else 0.0
  return SeedStats(float(v.mean()), std, float(v.min()), float(v.max()), int(v.size))


def benchmark_report(
  correct_by_seed: Mapping[str, Sequence[Sequence[Sequence[bool]]]],
  ks: Sequence[int] = (1,),
) -> dict[str, float]:
  """Flat metrics per benchmark: avg@n and pass@k, each as mean and std over seeds.

  correct_by_seed: benchmark name -> [seed][problem][sample] correctness. Keys of the result:
  "<bench>/avg@<n>/mean", "<bench>/avg@<n>/std", "<bench>/pass@<k>/mean", "<bench>/pass@<k>/std",
  "<bench>/num_seeds". k larger than the per-problem sample count is skipped.
  """
  report: dict[str, float] = {}
  for bench, seeds in correct_by_seed.items():
    if len(seeds) == 0:
      raise ValueError(f"benchmark {bench!r} has no seeds")
    n = min(len(row) for seed in seeds for row in seed)
    avg = over_seeds([avg_at_n(seed) for seed in seeds])
    report[f"{bench}/avg@{n}/mean"] = avg.mean
    report[f"{bench}/avg@{n}/std"] = avg.std
    for k in ks:
      if k > n:
        continue
      stats = over_seeds([mean_pass_at_k(seed, k) for seed in seeds])
      report[f"{bench}/pass@{k}/mean"] = stats.mean
      report[f"{bench}/pass@{k}/std"] = stats.std
    report[f"{bench}/num_seeds"] = float(len(seeds))
  return report
