"""Evaluation statistics: unbiased pass@k, avg@n, standard errors, per-benchmark and macro reports.

pass@k for one problem with n samples of which c are correct is 1 - C(n - c, k) / C(n, k)
(Chen et al. 2021), computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the
huge binomials. avg@n (what reasoning-RL papers report as pass@1) is the mean correctness.

A benchmark figure is a mean over problems. Its standard error is taken over problems (each
problem's value averaged over evaluation seeds first: sd / sqrt(P)); the spread over seeds (sample
sd of the per-seed figure) is reported beside it, since AIME-sized benchmarks (30 problems, one
problem = 3.3 points) move visibly with the seed. Papers report the macro-average: the plain mean
of the benchmark figures of one kind (math, code), not a mean pooled over all problems; its
standard error combines the benchmarks' as independent, sqrt(sum se_b^2) / B.

`score_benchmark` turns correctness tables into a `BenchmarkResult`; `make_report` adds the pooled
and macro rows; `EvalReport.metrics()` is the flat dict the trainer logs, `.as_dict()` the JSON
and `to_markdown` the table that `python -m gppo_jax.evaluate` writes. Plain numpy: no jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

MACRO_PREFIX = "macro_"  # flat keys of the macro rows: eval/macro_math/avg@16, ...


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


def normalize_ks(k: int | Sequence[int]) -> tuple[int, ...]:
  """eval.k as a sorted tuple of distinct k >= 1: a single int k is (k,), and 0 is () (no pass@k;
  the old configs' way to switch the sampled evaluation off). ValueError for anything else."""
  if isinstance(k, bool) or not isinstance(k, (int, np.integer, Sequence)) or isinstance(k, str):
    raise ValueError(f"k must be an integer or a list of integers, got {k!r}")
  if isinstance(k, (int, np.integer)):
    if k < 0:
      raise ValueError(f"k must be >= 0 (0 = no pass@k), got {k}")
    return (int(k),) if k else ()
  ks = list(k)
  bad = [x for x in ks if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1]
  if bad:
    raise ValueError(f"every k must be an integer >= 1, got {list(k)!r}")
  return tuple(sorted({int(x) for x in ks}))


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


@dataclasses.dataclass(frozen=True)
class Estimate:
  """One figure of a benchmark: the mean, its standard error over problems, the per-seed values.

  se is NaN for fewer than two problems (undefined); seed_std is 0 for one seed."""

  mean: float
  se: float
  per_seed: tuple[float, ...]

  @property
  def seed_std(self) -> float:
    return over_seeds(self.per_seed).std if self.per_seed else float("nan")


def estimate(values: np.ndarray) -> Estimate:
  """Estimate of a [seeds, problems] table of per-problem values (correctness, pass@k, ...)."""
  v = np.asarray(values, np.float64)
  if v.ndim != 2 or v.shape[0] < 1:
    raise ValueError(f"values must be [seeds >= 1, problems], got shape {v.shape}")
  if v.shape[1] == 0:
    nan = float("nan")
    return Estimate(nan, nan, (nan,) * v.shape[0])
  per_problem = v.mean(axis=0)  # seeds first: the problem is the sampling unit
  p = per_problem.size
  se = float(per_problem.std(ddof=1) / math.sqrt(p)) if p > 1 else float("nan")
  return Estimate(float(per_problem.mean()), se, tuple(float(x) for x in v.mean(axis=1)))


def macro_estimate(parts: Sequence[Estimate]) -> Estimate:
  """The plain mean of several benchmarks' figures, with se sqrt(sum se_b^2) / B (independent
  benchmarks) and the per-seed macro-averages (every part must have the same number of seeds)."""
  if not parts:
    raise ValueError("no benchmarks to average")
  seeds = {len(e.per_seed) for e in parts}
  if len(seeds) != 1:
    raise ValueError(f"benchmarks have different numbers of seeds: {sorted(seeds)}")
  b = len(parts)
  per_seed = np.mean([e.per_seed for e in parts], axis=0)
  se = math.sqrt(sum(e.se**2 for e in parts)) / b
  return Estimate(float(np.mean([e.mean for e in parts])), se, tuple(float(x) for x in per_seed))


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
  """Greedy accuracy, avg@n and pass@k of one benchmark (or of a pooled or macro row).

  kind: "math", "code" or "" (unknown); n: samples per problem and seed (0: none drawn);
  num_problems: problems scored (a macro row: summed over its benchmarks, which `members` names).
  """

  name: str
  kind: str
  num_problems: int
  n: int
  num_seeds: int
  accuracy: Estimate
  avg: Estimate | None
  pass_at: dict[int, Estimate]
  members: tuple[str, ...] = ()

  def estimates(self) -> list[tuple[str, Estimate]]:
    """[(figure name, Estimate)]: accuracy, avg@n, pass@k for each k."""
    out = [("accuracy", self.accuracy)]
    if self.avg is not None:
      out.append((f"avg@{self.n}", self.avg))
    out += [(f"pass@{k}", e) for k, e in sorted(self.pass_at.items())]
    return out


def score_benchmark(
  name: str,
  kind: str,
  greedy: np.ndarray,
  greedy_valid: np.ndarray,
  correct: np.ndarray | None,
  ks: Sequence[int],
) -> BenchmarkResult:
  """One benchmark's figures.

  greedy: [P] reward of each problem's greedy response; greedy_valid: [P] bool, False where the
  scorer failed (infrastructure, not the policy): those problems are left out of the accuracy.
  correct: [S, P, n] bool, sample j of problem p under evaluation seed s correct (None or n = 0:
  no sampled evaluation). ks: the k of pass@k, each <= n.
  """
  greedy = np.asarray(greedy, np.float64)
  ok = np.asarray(greedy_valid, bool)
  if greedy.shape != ok.shape or greedy.ndim != 1:
    raise ValueError(f"greedy {greedy.shape} and greedy_valid {ok.shape} must both be [P]")
  accuracy = estimate(greedy[ok][None])
  if correct is None or np.shape(correct)[-1] == 0:
    if ks:
      raise ValueError(f"pass@k for k={list(ks)} needs sampled responses")
    return BenchmarkResult(name, kind, greedy.size, 0, 0, accuracy, None, {})
  c = np.asarray(correct, bool)
  if c.ndim != 3 or c.shape[1] != greedy.size:
    raise ValueError(f"correct must be [seeds, {greedy.size} problems, n], got {c.shape}")
  s, p, n = c.shape
  too_big = [k for k in ks if not 1 <= k <= n]
  if too_big:
    raise ValueError(f"pass@k needs 1 <= k <= n = {n} samples per problem, got k={too_big}")
  avg = estimate(c.mean(axis=2))
  pass_at = {
    int(k): estimate(np.array([problem_pass_at_k(c[i], k) for i in range(s)]).reshape(s, p))
    for k in ks
  }
  return BenchmarkResult(name, kind, p, n, s, accuracy, avg, pass_at)


def macro_average(kind: str, results: Sequence[BenchmarkResult]) -> BenchmarkResult:
  """The macro row of `results` (benchmarks of one kind, same n, seeds and ks)."""
  if not results:
    raise ValueError("no benchmarks to average")
  first = results[0]
  shapes = {(r.n, r.num_seeds, tuple(sorted(r.pass_at))) for r in results}
  if len(shapes) != 1:
    raise ValueError(f"benchmarks evaluated with different (n, seeds, ks): {sorted(shapes)}")
  avg = macro_estimate([r.avg for r in results]) if first.avg is not None else None
  return BenchmarkResult(
    name=MACRO_PREFIX + kind,
    kind=kind,
    num_problems=sum(r.num_problems for r in results),
    n=first.n,
    num_seeds=first.num_seeds,
    accuracy=macro_estimate([r.accuracy for r in results]),
    avg=avg,
    pass_at={k: macro_estimate([r.pass_at[k] for r in results]) for k in first.pass_at},
    members=tuple(r.name for r in results),
  )


@dataclasses.dataclass(frozen=True)
class EvalReport:
  """An evaluation: the pooled row (every problem alike), one row per benchmark and one macro row
  per benchmark kind (benchmarks of unknown kind are in no macro row)."""

  pooled: BenchmarkResult
  benchmarks: tuple[BenchmarkResult, ...]
  macro: tuple[BenchmarkResult, ...]

  def metrics(self) -> dict[str, float]:
    """The flat dict the trainer logs.

    eval/<figure> is pooled over all problems (eval/accuracy, eval/avg@4, eval/pass@4: the
    meaning these keys always had); eval/<bench>/<figure> per benchmark when there are several;
    eval/macro_<kind>/<figure> per kind. Each figure also has <figure>_se (over problems) and,
    with several seeds, <figure>_seed_std.
    """
    out: dict[str, float] = {}
    rows = [("eval", self.pooled)]
    if len(self.benchmarks) > 1:
      rows += [(f"eval/{r.name}", r) for r in self.benchmarks]
    rows += [(f"eval/{r.name}", r) for r in self.macro]
    for prefix, row in rows:
      for figure, e in row.estimates():
        out[f"{prefix}/{figure}"] = e.mean
        out[f"{prefix}/{figure}_se"] = e.se
        if len(e.per_seed) > 1:
          out[f"{prefix}/{figure}_seed_std"] = e.seed_std
    return out

  def as_dict(self) -> dict:
    """JSON-able rows: per figure mean, se, seed_std and the per-seed values."""

    def row(r: BenchmarkResult) -> dict:
      figures = {
        name: {"mean": e.mean, "se": e.se, "seed_std": e.seed_std, "per_seed": list(e.per_seed)}
        for name, e in r.estimates()
      }
      out = {
        "name": r.name,
        "kind": r.kind,
        "num_problems": r.num_problems,
        "n": r.n,
        "num_seeds": r.num_seeds,
        "figures": figures,
      }
      if r.members:
        out["benchmarks"] = list(r.members)
      return out

    return {
      "benchmarks": [row(r) for r in self.benchmarks],
      "macro": [row(r) for r in self.macro],
      "pooled": row(self.pooled),
    }


def make_report(pooled: BenchmarkResult, benchmarks: Sequence[BenchmarkResult]) -> EvalReport:
  """The report of `benchmarks` (and their `pooled` row), with a macro row per known kind."""
  names = [r.name for r in benchmarks]
  if len(set(names)) != len(names):
    raise ValueError(f"benchmark names must be unique, got {names}")
  reserved = [x for x in names if x.startswith(MACRO_PREFIX)]
  if reserved:
    raise ValueError(f"benchmark names starting with {MACRO_PREFIX!r} are reserved: {reserved}")
  kinds = sorted({r.kind for r in benchmarks if r.kind})
  macro = tuple(macro_average(k, [r for r in benchmarks if r.kind == k]) for k in kinds)
  return EvalReport(pooled, tuple(benchmarks), macro)


def _cell(e: Estimate, num_seeds: int) -> str:
  if math.isnan(e.mean):
    return "-"
  text = f"{100 * e.mean:.1f}"
  if not math.isnan(e.se):
    text += f" ± {100 * e.se:.1f}"
  if num_seeds > 1:
    text += f" (sd {100 * e.seed_std:.1f})"
  return text


def to_markdown(report: EvalReport) -> str:
  """A table in percent: one row per benchmark, then the macro rows and the pooled row. Cells are
  `mean ± se over problems`, plus `(sd x)` over seeds when there are several."""
  first = report.pooled
  figures = [name for name, _ in first.estimates()]
  head = ["benchmark", "kind", "problems", "greedy", *figures[1:]]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

  def add(label: str, r: BenchmarkResult) -> None:
    seeds = r.num_seeds
    cells = [_cell(e, seeds if name != "accuracy" else 1) for name, e in r.estimates()]
    lines.append(f"| {label} | {r.kind or '-'} | {r.num_problems} | " + " | ".join(cells) + " |")

  for r in report.benchmarks:
    add(r.name, r)
  for r in report.macro:
    add(f"**{r.kind} (macro, {len(r.members)} benchmarks)**", r)
  add("all problems (pooled)", report.pooled)
  return "\n".join(lines) + "\n"
