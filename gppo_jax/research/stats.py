"""Statistics of a sweep: area under a learning curve and bootstrap intervals over seeds.

All functions are pure numpy. Intervals are percentile bootstraps over seeds: resample the seeds
with replacement, recompute the statistic, take the 2.5% and 97.5% quantiles. *Paired* intervals
resample the seed indices once for every cell involved, so that what two cells share through a
seed (the starting policy, the prompt order, the sampling keys: common random numbers) cancels in
their difference. Every statistic here is a function of per-cell means over seeds, which keeps the
resampling vectorised: `paired_ci(x, fn)` with x [seeds, cells] and fn(means [..., cells]) -> [...].

The percentile bootstrap is approximate for few seeds: on normal samples its 95% interval for a
mean covers the true mean about 94% of the time at 40 seeds, 93% at 16, 89% at 8 and 81% at 4
(2000 simulated samples each, measured with this module; tests/test_sweep.py checks 40 seeds), so
read an 8-seed interval as roughly a 90% one. With fewer than 2 seeds
there is no interval (NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

LEVEL = 0.95
N_BOOT = 10_000


def auc(steps: Sequence[float], values: Sequence[float]) -> float:
  """Normalised area under a curve: the trapezoid integral of values over steps divided by the
  step span, i.e. the curve's mean height over the run. One point: its value.

  steps [n] increasing, values [n]; for held-out accuracy evaluated at iterations 0, 50, ..., 400
  this is the run's average accuracy (a constant curve gives that constant, a straight line from
  a to b gives (a + b) / 2)."""
  s = np.asarray(steps, np.float64)
  v = np.asarray(values, np.float64)
  if s.shape != v.shape or s.ndim != 1 or s.size == 0:
    raise ValueError(f"need equal-length, non-empty 1-D steps and values, got {s.shape}, {v.shape}")
  if s.size == 1:
    return float(v[0])
  if np.any(np.diff(s) <= 0):
    raise ValueError(f"steps must increase, got {s.tolist()}")
  return float(np.sum(np.diff(s) * (v[1:] + v[:-1]) / 2.0) / (s[-1] - s[0]))


def resample_indices(n: int, n_boot: int = N_BOOT, seed: int = 0) -> np.ndarray:
  """[n_boot, n] seed indices drawn with replacement (the bootstrap's resamples)."""
  return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
  """(lo, hi): the (1 - level) / 2 and (1 + level) / 2 quantiles over axis 0 of samples."""
  if not 0 < level < 1:
    raise ValueError(f"level must lie in (0, 1), got {level}")
  lo, hi = np.nanquantile(samples, [(1 - level) / 2, (1 + level) / 2], axis=0)
  return lo, hi


def paired_ci(
  x: np.ndarray | Sequence[Sequence[float]],
  fn: Callable[[np.ndarray], np.ndarray],
  *,
  level: float = LEVEL,
  n_boot: int = N_BOOT,
  seed: int = 0,
) -> tuple[float, float, float]:
  """(point, lo, hi) of fn(per-cell means) with a paired percentile bootstrap over seeds.

  Not scipy.stats.bootstrap(paired=True, method="percentile"): its interval is NaN when the
  statistic is on any resample (a relative gain over a zero baseline mean); this one skips those.

  x [seeds, cells]: row i holds every cell's value under seed i. fn maps means [..., cells] to
  [...] (vectorised over leading axes). point = fn(x.mean(0)); lo, hi are NaN under 2 seeds."""
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or x.shape[0] == 0:
    raise ValueError(f"need a [seeds, cells] array with at least one seed, got shape {x.shape}")
  with np.errstate(divide="ignore", invalid="ignore"):
    point = float(fn(x.mean(axis=0)))
    if x.shape[0] < 2:
      return point, float("nan"), float("nan")
    means = x[resample_indices(x.shape[0], n_boot, seed)].mean(axis=1)  # [n_boot, cells]
    lo, hi = percentile_interval(np.asarray(fn(means), np.float64), level)
  return point, float(lo), float(hi)


def mean_ci(values: Sequence[float], **kw) -> tuple[float, float, float]:
  """(mean, lo, hi): the mean over seeds with its bootstrap interval (a constant: a point)."""
  return paired_ci(np.asarray(values, np.float64)[:, None], lambda m: m[..., 0], **kw)


def paired_difference_ci(
  a: Sequence[float], b: Sequence[float], **kw
) -> tuple[float, float, float]:
  """(mean(a - b), lo, hi) with a and b measured under the same seeds, in the same order."""
  return paired_ci(_columns(a, b), lambda m: m[..., 0] - m[..., 1], **kw)


def unpaired_difference_ci(
  a: Sequence[float],
  b: Sequence[float],
  *,
  level: float = LEVEL,
  n_boot: int = N_BOOT,
  seed: int = 0,
) -> tuple[float, float, float]:
  """(mean(a) - mean(b), lo, hi) resampling a and b independently (what pairing improves on)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  point = float(a.mean() - b.mean())
  if min(a.size, b.size) < 2:
    return point, float("nan"), float("nan")
  ma = a[resample_indices(a.size, n_boot, seed)].mean(axis=1)
  mb = b[resample_indices(b.size, n_boot, seed + 1)].mean(axis=1)
  lo, hi = percentile_interval(ma - mb, level)
  return point, float(lo), float(hi)


def relative_gain(means: np.ndarray, pairs: Sequence[tuple[int, int]]) -> np.ndarray:
  """Mean over `pairs` (i, j) of means[..., i] / means[..., j] - 1: the relative gain of cell i
  over cell j, averaged over the pairs (e.g. Atomic over MC, one pair per divergence). NaN where a
  baseline mean is 0."""
  means = np.asarray(means, np.float64)
  num = np.stack([means[..., i] for i, _ in pairs], axis=-1)
  den = np.stack([means[..., j] for _, j in pairs], axis=-1)
  with np.errstate(divide="ignore", invalid="ignore"):
    ratio = np.where(den != 0, num / np.where(den != 0, den, 1.0), np.nan)
  return np.mean(ratio - 1.0, axis=-1)


def relative_gain_ci(
  x: np.ndarray | Sequence[Sequence[float]], pairs: Sequence[tuple[int, int]], **kw
) -> tuple[float, float, float]:
  """(gain, lo, hi): `relative_gain` of the per-cell means of x [seeds, cells], paired bootstrap."""
  if not pairs:
    raise ValueError("relative_gain_ci needs at least one (cell, baseline) pair")
  return paired_ci(x, lambda m: relative_gain(m, pairs), **kw)


def curve_band(curves: np.ndarray | Sequence[Sequence[float]], **kw) -> tuple[np.ndarray, ...]:
  """(mean, lo, hi) per point of curves [seeds, points]: a learning curve's pointwise interval
  band (each point's percentile bootstrap over the same resampled seeds). NaN band under 2."""
  c = np.asarray(curves, np.float64)
  if c.ndim != 2 or c.shape[0] == 0:
    raise ValueError(f"need a [seeds, points] array, got shape {c.shape}")
  mean = c.mean(axis=0)
  if c.shape[0] < 2:
    nan = np.full_like(mean, np.nan)
    return mean, nan, nan.copy()
  idx = resample_indices(c.shape[0], kw.get("n_boot", N_BOOT), kw.get("seed", 0))
  lo, hi = percentile_interval(c[idx].mean(axis=1), kw.get("level", LEVEL))
  return mean, lo, hi


def _columns(*cols: Sequence[float]) -> np.ndarray:
  arrays = [np.asarray(c, np.float64) for c in cols]
  if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
    raise ValueError(
      f"paired samples need one value per seed each, got {[a.shape for a in arrays]}"
    )
  return np.stack(arrays, axis=1)
