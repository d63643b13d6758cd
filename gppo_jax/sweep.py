"""The GPPO grid as a sweep: cells x radii x seeds, one training process per run, paired statistics.

  python -m gppo_jax.sweep                                           # the default sweep (below)
  python -m gppo_jax.sweep --cells kl_atomic,tv_mc,none --set rollout.staleness=2 --out w/stale
  python -m gppo_jax.sweep --cells grid --rules f_eps,equal_tv --scales 0.5,1,2 --seeds 0-3
  python -m gppo_jax.sweep --cells grid,none --rules equal_mask --calibrate-only  # its radii only
  python -m gppo_jax.sweep --report-only --out workdirs/sweep       # rebuild the outputs only
  python -m gppo_jax.sweep --dry-run ...                             # print the commands only

Axes (their cross product; each run is one `python -m gppo_jax.train` subprocess, --jobs at a time):
  cells   `<divergence>_<estimator>` for tv/kl/hellinger/chi2 x mc/binary/atomic (`grid` = all 12),
          the presets of algorithm/presets.py (ppo, grpo, dapo, dapo_kl, dppo, dppo_kl, ripo, gspo,
          cispo) with their own radii and advantage, and `none`: tv_mc with an infinite radius
          (importance-weighted policy gradient, nothing is ever masked), the baseline a trust
          region must beat.
  radius  --rules: how a grid cell's delta is calibrated. `f_eps`: delta_f = f(1 - eps) (theory.
          default_delta, PPO's contraction side; eps = --eps). `equal_tv`: delta_f = L_f(V), the
          radius whose TV radius (theory.tv_radius) is V, the TV radius of the reference cell tv_mc
          at that scale, so that all divergences are compared at the same geometric size.
          `equal_mask`: the delta whose first update masks the same share of tokens as tv_mc's at
          its f_eps delta, so that all cells are compared at the same effective size (below).
          --scales multiplies the delta (under equal_tv and equal_mask: tv_mc's delta, and the
          others follow its TV radius or its masked share). Presets scale their own radii under
          every rule (under equal_mask also matched ones where possible, below); `none` has none.
  seeds   --seeds 0-7 or 0,3,5. Common random numbers: config.seed fixes the prompt order
          (envs.BuiltinEnv draws its k-th batch of prompts from rng([seed, k]); a dataset's
          PromptIterator shuffles with the seed), the rollout and update keys (fold_in(PRNGKey(
          seed), iteration)) and the evaluation's sampling key; the held-out problems are the same
          for every run (eval seed 12345). warmstart.seed fixes the starting policy (initial
          weights, the warm start's batches and keys). --start per_seed (default) sets
          warmstart.seed = seed: each seed has its own start, shared by every cell; --start shared
          sets it to 0: one start for all. Either way, runs with the same seed share the starting
          policy, the prompts of every iteration and the random keys, so cells are compared paired
          by seed. (The prompts stay shared while every iteration draws one batch: DAPO refills,
          advantage.filter_zero_signal with rollout.refill_rounds > 0, draw as many as the policy
          needs, and the prompt streams of two cells part after the first refill.)
  --set   any config override, `--set optim.lr=5e-4` -> `--config.optim.lr=5e-4` (applied last).
  --task  a built-in task with its run settings: `--task wordchain` runs every cell on
          `configs/base.py:task=wordchain` (config_lib.TASK_RUNS; the default is the base's task).
  --metric the held-out figure the report ranks by (curves, final, AUC, best): `accuracy`, greedy
          (the default), or one the evaluation logs as eval/<figure>: `avg@4` (sampled accuracy,
          4 samples per problem with the default eval.k), `pass@4`. Recorded in sweep.json like
          --task; `--report-only --metric avg@4` rebuilds a finished sweep's report on it.

equal_mask, calibrated before the grid runs: the share is trust/masked_frac, what the runs log for
the share of tokens whose gradient the trust region masks, averaged over the optimizer steps of
the first update (iteration 1). train.first_update sets up seed 0's run as train does (its warm
start, prompts and keys; warmstart.seed 0 under either --start), draws its first rollout batch
once and reruns the first update from the same state at any radius (the run's compiled update,
the radii an argument). The target is tv_mc's share at f(1 - eps) x scale; each other cell's
delta starts at its own f_eps delta x scale and is multiplied or divided by 4 until the share
crosses the target, then bisected on log delta (the share falls as delta grows) until it lies
within 10% (relative) of the target; its time goes mostly to compiling each cell's update once
(--calibration-batches N averages the first updates of N rollout batches of the starting policy:
smoother shares on small batches, N times the updates). It runs in a child process
(`--calibrate-only`, which also runs alone: compute and print, train nothing), is printed as a
table (cell, delta found, share reached, target, matched) and cached in <out>/equal_mask.json,
keyed by task, overrides, seed, batches, eps and scale: a rerun or an extended sweep computes only
the cells it lacks, and every equal_mask run's sweep_run.json records its cell's calibration. A
share no delta reaches (the estimator never masks that much even at a tiny delta, or masks too
much even at a huge one, or the share jumps across the band at one delta: tokens with equal
estimates, such as those of identical responses, cross a radius together) is not hidden: the cell
runs at the closest delta found and is marked NOT MATCHED in the table, in results.md (beside its
delta and in the calibration table of its radius), runs.csv (calibration_matched) and the sweep's
final summary (not_matched). --dry-run prints the cached radii (a cell not yet calibrated: a
comment line). Presets run at their own radii (scaled by --scales) under every rule and, under
equal_mask, also at matched radii where that is possible (`matchable`): ppo, grpo, dapo,
dapo_kl, ripo and gspo (one factor on both radii, which keeps dapo's clip-higher and gspo's 3:4
ratio; gspo's mask drops whole responses, so its share counts every token of a masked response
and may jump across the band), reported as "<preset> (matched)". Not dppo and dppo_kl (their
Dr. GRPO advantages differ from the batch the calibration reruns) nor cispo, which masks nothing
(infinite radius; its cap bounds the weight instead): its share is 0 at any radius.

The default budget: the 12 cells and `none` x seeds 0-7 (104 runs, 8 paired seeds: what the
comparisons in docs/verdict.md rest on) of the default config (configs/base.py: 400 iterations of
64 prompts x 8 samples, 2 epochs x 4 mini-batches, evals every 50 iterations on 512 held-out
problems), 2 runs at a time (`--jobs`, default min(2, CPU count)); docs/performance.md has its
wall time on a 2-core machine (the compiled programs are cached on disk after the first run).

Folder (--out, default workdirs/sweep): `runs/<cell>__<radius>__s<seed>/` is each run's train
workdir, with `sweep_run.json` (what it is, its train arguments, exit status and wall time) and
`train.log`; `runs.csv` has one row per run, `results.md` the statistics (research/stats.py:
means with 95% bootstrap intervals over seeds, paired differences to tv_mc, the paper's summary
comparisons as relative gains) and `plots/` the PNGs (divergence x estimator heatmap, learning
curves with interval bands, masked fraction over training). A seed whose warm start ended below
warmstart.target_accuracy (its summary's warm_start.missed_target) is listed apart in results.md
and left out of every statistic and plot; --include-missed-starts counts it. Rerunning the same
command reuses every finished run (summary.json present) and resumes unfinished ones from their
checkpoints; a folder started with other settings is refused. The first run of each starting
policy runs before the other runs of that start, so that it alone warms the cache.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gppo_jax import errors, files
from gppo_jax.algorithm import presets
from gppo_jax.research.report import (
  CALIBRATION_FILE,
  DEFAULT_METRIC,
  EQUAL_MASK,
  GRID,
  INF,
  NONE,
  OWN,
  RECORD,
  REFERENCE,
  RULES,
  SWEEP_FILE,
  calibration_table,
  duration,
  now,
  parse_metric,
  read_json,
  read_run,
  write_outputs,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_CONFIG = os.path.join(REPO, "configs", "base.py")
STARTS = ("per_seed", "shared")
DEFAULT_CELLS = "grid,none"
DEFAULT_SEEDS = "0-7"
DEFAULT_JOBS = min(2, os.cpu_count() or 1)  # two runs at a time where there are two cores
LOG = "train.log"


# --- Axes ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Run:
  """One training run of the sweep: a cell at a radius (rule, scale) under a seed."""

  seed: int
  rule: str  # f_eps | equal_tv | equal_mask for grid cells, OWN for presets, INF for none
  scale: float
  cell: str

  @property
  def radius(self) -> str:
    return INF if self.rule == INF else f"{self.rule}_x{self.scale:g}"

  @property
  def name(self) -> str:
    return f"{self.cell}__{self.radius}__s{self.seed}"


@dataclasses.dataclass(frozen=True)
class Settings:
  """What every run of a sweep shares."""

  out: str
  overrides: tuple[str, ...] = ()
  start: str = "per_seed"
  eps: float = 0.2
  task: str = ""  # a built-in task selected with the config argument task=NAME ("" = the base's)
  metric: str = DEFAULT_METRIC  # the held-out figure the report ranks by (report.parse_metric)
  # equal_mask: {(cell, scale): its calibration (`calibrate`), whose "delta" the runs use}
  calibration: Mapping[tuple[str, float], dict] = dataclasses.field(default_factory=dict)

  @property
  def config(self) -> str:
    """The `--config=` value of every run: configs/base.py, with `:task=NAME` for a task."""
    return f"{BASE_CONFIG}:task={self.task}" if self.task else BASE_CONFIG

  def start_seed(self, seed: int) -> int:
    return seed if self.start == "per_seed" else 0


def _split(text: str) -> list[str]:
  return [p.strip() for p in str(text).split(",") if p.strip()]


def parse_cells(text: str) -> list[str]:
  """`grid,none,dppo` -> the cell names, in order, without repeats; ConfigError for unknown ones."""
  out: list[str] = []
  for name in _split(text):
    for cell in GRID if name == "grid" else (name,):
      if cell not in GRID and cell != NONE and cell not in presets.names():
        choices = ["grid", *GRID, NONE, *presets.names()]
        raise errors.UnknownNameError(
          f"unknown sweep cell {cell!r}{errors.did_you_mean(cell, choices)}; valid names: "
          f"{', '.join(choices)} (--cells)",
          kind="sweep cell",
          name=cell,
          choices=choices,
        )
      if cell not in out:
        out.append(cell)
  if not out:
    raise errors.ConfigError("--cells is empty")
  return out


def parse_seeds(text: str) -> list[int]:
  """`0-3,7` -> [0, 1, 2, 3, 7]."""
  seeds: list[int] = []
  for part in _split(text):
    m = re.fullmatch(r"(-?\d+)(?:-(-?\d+))?", part)
    if not m:
      raise errors.ConfigError(f"--seeds: {part!r} is not an integer or a range like 0-7")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if hi < lo:
      raise errors.ConfigError(f"--seeds: empty range {part!r}")
    seeds += [s for s in range(lo, hi + 1) if s not in seeds]
  if not seeds:
    raise errors.ConfigError("--seeds is empty")
  return seeds


def parse_rules(text: str) -> list[str]:
  rules = list(dict.fromkeys(_split(text)))
  for r in rules:
    if r not in RULES:
      raise errors.unknown_name("radius rule", r, RULES, " (--rules)")
  if not rules:
    raise errors.ConfigError("--rules is empty")
  return rules


def parse_scales(text: str) -> list[float]:
  scales = []
  for part in _split(text):
    try:
      s = float(part)
    except ValueError:
      raise errors.ConfigError(f"--scales: {part!r} is not a number") from None
    if not (math.isfinite(s) and s > 0):
      raise errors.ConfigError(f"--scales: {part!r} must be a finite number > 0")
    if s not in scales:
      scales.append(s)
  if not scales:
    raise errors.ConfigError("--scales is empty")
  return scales


def parse_overrides(items: Iterable[str]) -> tuple[str, ...]:
  """`KEY=VALUE` config overrides, each KEY a field of the base config (e.g. optim.lr)."""
  base = _base_config()
  out = []
  for item in items:
    key, eq, value = item.partition("=")
    key = key.strip().removeprefix("--").removeprefix("config.")
    if not eq or not key:
      raise errors.ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    node = base
    for i, part in enumerate(key.split(".")):
      fields = list(node.keys()) if hasattr(node, "keys") else []
      if part not in fields:
        where = ".".join(key.split(".")[:i]) or "the config"
        raise errors.ConfigError(
          f"--set {item!r}: {where} has no field {part!r}; valid: {', '.join(map(str, fields))}"
        )
      node = node[part]
    out.append(f"{key}={value.strip()}")
  return tuple(out)


def expand(
  cells: Sequence[str], rules: Sequence[str], scales: Sequence[float], seeds: Sequence[int]
) -> list[Run]:
  """The runs of the cross product, seed-major (all cells of one seed before the next seed, so
  that paired comparisons fill in early), without repeats: presets have their own radius per
  scale and, under equal_mask where their radius is finite (`matchable`), the matched one too;
  `none` has one in all."""
  runs: list[Run] = []
  for seed in seeds:
    for scale in scales:
      for rule in rules:
        for cell in cells:
          if cell == NONE:
            these = [Run(seed, INF, 1.0, cell)]
          elif cell in GRID:
            these = [Run(seed, rule, scale, cell)]
          else:
            these = [Run(seed, OWN, scale, cell)]
            if rule == EQUAL_MASK and matchable(cell):
              these.append(Run(seed, EQUAL_MASK, scale, cell))
          runs += [run for run in these if run not in runs]
  return runs


def matchable(cell: str) -> bool:
  """Whether a cell's trust region can be sized by equal_mask: every grid cell, and a preset with
  finite radii (both scaled by one factor, keeping their ratio) whose runs differ from tv_mc's in
  the loss only (the calibration reruns tv_mc's first update, advantages included, under each
  cell's loss). Not cispo (an infinite radius: it caps weights instead of masking, so its share
  is 0 at any setting), nor dppo / dppo_kl (Dr. GRPO's advantages, not the batch's)."""
  if cell in GRID or cell == NONE:
    return cell in GRID
  preset = presets.get(cell)
  low, high = preset.loss.radii
  finite = 0 < low < math.inf and 0 < high < math.inf
  return finite and preset.advantage == _base_config().advantage.name


# --- Radii --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def equal_tv_delta(divergence: str, tv: float) -> float:
  """The delta of `divergence` whose TV radius (theory.tv_radius) is `tv`.

  tv_radius(delta) is the largest V with L_f(V) <= delta, L_f the tight lower bound of D_f by total
  variation (docs/math.md#theory), increasing in V; its inverse is delta = L_f(V). The solve is
  checked back through tv_radius."""
  from gppo_jax.algorithm import theory

  if not 0 < tv < 1:
    raise errors.ConfigError(
      f"the TV radius to match must lie in (0, 1), got {tv:g}: lower --scales or --eps"
    )
  delta = float(theory.lower_bound(divergence, tv))
  back = float(theory.tv_radius(divergence, delta))
  if not (math.isfinite(delta) and delta > 0 and abs(back - tv) <= 1e-6 * max(1.0, tv)):
    raise ValueError(f"no delta of {divergence} has TV radius {tv:g} (L_f = {delta}, back {back})")
  return delta


def radii(
  run: Run, eps: float = 0.2, calibration: Mapping[tuple[str, float], dict] | None = None
) -> tuple[float, float]:
  """(delta_low, delta_high) of a run; under equal_mask the delta of `calibration` (`calibrate`)."""
  if run.cell == NONE:
    return math.inf, math.inf
  if run.rule == EQUAL_MASK:
    found = (calibration or {}).get((run.cell, run.scale))
    if found is None:
      raise ValueError(
        f"{run.name}: the {EQUAL_MASK} delta of {run.cell} at scale {run.scale:g} is not "
        "calibrated (sweep.calibrate)"
      )
    low = float(found["delta"])
    return low, float(found.get("delta_high", low))
  if run.cell not in GRID:
    low, high = presets.get(run.cell).loss.radii
    return run.scale * low, run.scale * high
  divergence = run.cell.split("_")[0]
  if run.rule == "f_eps":
    delta = run.scale * presets.default_delta(divergence, eps)
  else:
    from gppo_jax.algorithm import theory

    ref_divergence = REFERENCE.split("_")[0]
    tv = float(
      theory.tv_radius(ref_divergence, run.scale * presets.default_delta(ref_divergence, eps))
    )
    delta = equal_tv_delta(divergence, tv)
  return delta, delta


@functools.lru_cache(maxsize=1)
def _base_config(task: str = ""):
  """configs/base.py's config, with `task=NAME` for a task (ml_collections only, no jax)."""
  from gppo_jax import config_lib

  return config_lib.base(f"task={task}" if task else None)


def _preset(cell: str) -> presets.Preset:
  if cell == NONE:
    return presets.cell(*REFERENCE.split("_"))
  if cell in GRID:
    return presets.cell(*cell.split("_"))
  return presets.get(cell)


def _value(v: Any) -> str:
  if isinstance(v, float):
    return "inf" if v == math.inf else repr(v)
  return str(v)


def _check_task(name: str) -> None:
  from gppo_jax.data import tasks

  if name not in tasks.TASKS:
    raise errors.unknown_name("built-in task", name, tasks.TASKS, " (--task)")


def check_metric(settings: Settings) -> None:
  """ConfigError at launch for a --metric the runs' evaluation will not log: avg@N needs N
  samples per problem (eval.n, default the largest k), pass@K a K in eval.k (with the task's
  config and the sweep's eval.* overrides), rather than an error after the first run."""
  from gppo_jax.rewards import pass_at_k  # noqa: PLC0415

  figure = settings.metric.rsplit("/", 1)[-1]
  if figure == DEFAULT_METRIC:
    return
  e = _base_config(settings.task).eval
  values = {"k": e.k, "n": e.get("n")}
  for item in settings.overrides:
    key, _, value = item.partition("=")
    if key in ("eval.k", "eval.n"):
      try:
        values[key[5:]] = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        values[key[5:]] = value
  try:
    ks = pass_at_k.normalize_ks(values["k"])
    n = max(ks, default=0) if values["n"] is None else int(values["n"])
  except (TypeError, ValueError):
    return  # the runs' own validation names a bad eval.k or eval.n
  logged = [DEFAULT_METRIC] + ([f"avg@{n}"] if n else []) + [f"pass@{k}" for k in ks]
  if figure not in logged:
    raise errors.ConfigError(
      f"--metric {settings.metric}: the runs' evaluation (eval.n={n}, eval.k={list(ks)}) logs "
      f"{', '.join(logged)}; choose one of them or set eval.n / eval.k with --set"
    )


def train_args(run: Run, settings: Settings) -> list[str]:
  """The `python -m gppo_jax.train` arguments of a run, without --workdir: the base config, the
  seeds, the cell's loss (every field that differs from the base config's, and always the
  divergence, estimator and radii), its advantage, then the sweep's overrides."""
  preset = _preset(run.cell)
  base = _base_config(settings.task)
  low, high = radii(run, settings.eps, settings.calibration)
  args = [
    f"--config={settings.config}",
    f"--config.seed={run.seed}",
    f"--config.warmstart.seed={settings.start_seed(run.seed)}",
    f"--config.loss.divergence={preset.loss.divergence}",
    f"--config.loss.estimator={preset.loss.estimator}",
    f"--config.loss.delta_low={_value(low)}",
    f"--config.loss.delta_high={_value(high)}",
  ]
  for field in dataclasses.fields(preset.loss):
    if field.name in ("divergence", "estimator", "delta_low", "delta_high"):
      continue
    value = getattr(preset.loss, field.name)
    if value != base.loss.get(field.name):
      if value is None:
        raise ValueError(f"cannot override loss.{field.name} to None from the command line")
      args.append(f"--config.loss.{field.name}={_value(value)}")
  if preset.advantage != base.advantage.name:
    args.append(f"--config.advantage.name={preset.advantage}")
  return args + [f"--config.{o}" for o in settings.overrides]


def command(run: Run, settings: Settings) -> list[str]:
  """The full command line of a run: `python -m gppo_jax.train --config=... --workdir=... ...`."""
  args = train_args(run, settings)
  workdir = os.path.abspath(run_dir(settings.out, run))
  return [sys.executable, "-m", "gppo_jax.train", args[0], f"--workdir={workdir}", *args[1:]]


def run_dir(out: str, run: Run) -> str:
  return os.path.join(out, "runs", run.name)


# --- equal_mask: radii calibrated on the first update --------------------------------------------

MASK_METRIC = "trust/masked_frac"  # the first update's share of tokens the trust region masks
MASK_TOLERANCE = 0.1  # relative: a cell matches when |share - target| <= 10% of the target
CALIBRATION_SEED = 0  # the run seed (prompts, keys) and warm start the calibration draws on
CALIBRATION_BATCHES = 1  # the rollout batches whose first updates it averages


def calibration_needs(runs: Iterable[Run]) -> dict[float, list[str]]:
  """{scale: the cells to calibrate} of the equal_mask runs (grid cells and matchable presets),
  tv_mc (the target) first."""
  need: dict[float, list[str]] = {}
  for run in runs:
    if run.rule == EQUAL_MASK and matchable(run.cell):
      need.setdefault(run.scale, [])
      if run.cell not in need[run.scale]:
        need[run.scale].append(run.cell)
  return {s: sorted(c, key=lambda c: c != REFERENCE) for s, c in need.items()}


def calibration_key(
  settings: Settings,
  scale: float,
  *,
  seed: int = CALIBRATION_SEED,
  batches: int = CALIBRATION_BATCHES,
  target: float | None = None,
) -> dict[str, Any]:
  """What a calibration depends on: the task and overrides (the runs' config), the seed and its
  starting policy, the rollout batches, the reference radius (eps, scale), the metric and the
  tolerance; an explicit `target` share in place of tv_mc's too."""
  key = {
    "task": settings.task,
    "overrides": list(settings.overrides),
    "seed": seed,
    "warmstart_seed": settings.start_seed(seed),
    "batches": batches,
    "eps": settings.eps,
    "scale": scale,
    "metric": MASK_METRIC,
    "tolerance": MASK_TOLERANCE,
  }
  if target is not None:
    key["target"] = target
  return key


def _calibration_entry(entries: list[dict], key: dict[str, Any]) -> dict:
  """The entry of `key` in the cache's list, appended empty if it has none."""
  for entry in entries:
    if entry.get("key") == key:
      return entry
  entry = {"key": key, "cells": {}}
  entries.append(entry)
  return entry


def cached_calibration(
  settings: Settings, need: Mapping[float, Sequence[str]], **key: Any
) -> dict[tuple[str, float], dict]:
  """{(cell, scale): calibration} of the cells of `need` that the sweep folder's cache holds
  (`key`: calibration_key's keyword arguments)."""
  entries = (read_json(os.path.join(settings.out, CALIBRATION_FILE)) or {}).get("calibrations", [])
  out = {}
  for scale, cells in need.items():
    entry = _calibration_entry(list(entries), calibration_key(settings, scale, **key))
    out.update({(c, scale): entry["cells"][c] for c in cells if c in entry["cells"]})
  return out


def search_delta(
  share: Callable[[float], float],
  target: float,
  start: float,
  *,
  tolerance: float = MASK_TOLERANCE,
  factor: float = 4.0,
  max_widen: int = 12,
  max_halve: int = 30,
) -> dict[str, Any]:
  """The delta whose `share(delta)` lies within `tolerance` (relative) of `target`.

  The share of tokens a trust region masks falls as its radius grows (at a fixed policy exactly;
  along an update nearly: the policy's path depends on what was masked before). From `start`,
  delta is multiplied or divided by `factor` until the share crosses the target's band (at most
  `max_widen` times), then the bracket is bisected on log delta (at most `max_halve` times).
  Returns {delta, share, matched, evaluations, note}: the first delta within the band, or else
  the closest one tried, with `note` saying why none matched (the share stays on one side of the
  band even at the widest delta tried, or jumps across it between two deltas: tokens whose
  estimates are equal, such as those of identical responses, cross a radius together)."""
  tried: list[tuple[float, float]] = []
  band = (target * (1 - tolerance), target * (1 + tolerance))

  def measure(delta: float) -> float:
    value = float(share(delta))
    tried.append((delta, value))
    return value

  def within(value: float) -> bool:
    return band[0] <= value <= band[1]

  def result(note: str = "") -> dict[str, Any]:
    i = min(range(len(tried)), key=lambda i: (abs(tried[i][1] - target), i))
    delta, value = tried[i]
    return dict(delta=delta, share=value, matched=within(value), evaluations=len(tried), note=note)

  value = measure(start)
  if within(value):
    return result()
  wider = value > band[1]  # masks too much: a larger radius
  low, high = (start, None) if wider else (None, start)  # masks too much / too little
  delta = start
  for _ in range(max_widen):
    delta = delta * factor if wider else delta / factor
    value = measure(delta)
    if within(value):
      return result()
    if value > band[1]:
      low = delta
    else:
      high = delta
    if low is not None and high is not None:
      break
  else:
    side = "more" if wider else "less"
    return result(f"unreachable: masks {side} than the target even at delta {delta:.3g}")
  for _ in range(max_halve):
    if high / low < 1 + 1e-6:
      break
    mid = math.sqrt(low * high)
    value = measure(mid)
    if within(value):
      return result()
    if value > band[1]:
      low = mid
    else:
      high = mid
  shares = dict(tried)
  return result(
    f"no delta reaches it: the share jumps from {100 * shares[low]:.3g}% at delta {low:.6g} "
    f"to {100 * shares[high]:.3g}% at {high:.6g}"
  )


def run_config(run: Run, settings: Settings):
  """The training config the run's command line builds (train's own flag parsing)."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  argv = ["gppo_jax.train", *train_args(run, settings)]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def calibrate(
  settings: Settings,
  need: Mapping[float, Sequence[str]],
  *,
  echo: Callable[[str], None] = print,
  seed: int = CALIBRATION_SEED,
  batches: int = CALIBRATION_BATCHES,
  target: float | None = None,
) -> dict[tuple[str, float], dict]:
  """The equal_mask delta of every (cell, scale) of `need`: returns {(cell, scale): {delta,
  share, target, matched, note, ...}} and prints a table per scale.

  The target is the masked share (MASK_METRIC) of tv_mc's first update at its f_eps delta times
  the scale (or `target`, given). A cell's share at a delta is that of the first update of
  `seed`'s run (its warm start, prompts and keys; with `batches` > 1 the mean over the first
  updates of that many rollout batches of the starting policy), computed by train.first_update:
  the trainer's own set-up, rollout and compiled update, under the cell's loss; the same rollouts
  serve every cell. `search_delta` finds the delta within MASK_TOLERANCE of the target, starting
  from the cell's f_eps delta times the scale. Results are cached in the sweep folder
  (CALIBRATION_FILE, under `calibration_key`) and reused: only missing cells are computed, each
  saved as soon as it is found."""
  path = os.path.join(settings.out, CALIBRATION_FILE)
  state = read_json(path) or {}
  entries = state.setdefault("calibrations", [])
  keys = {
    scale: calibration_key(settings, scale, seed=seed, batches=batches, target=target)
    for scale in need
  }
  todo = {
    scale: [c for c in cells if c not in _calibration_entry(entries, keys[scale])["cells"]]
    for scale, cells in need.items()
  }
  if any(todo.values()):
    _calibrate_cells(settings, todo, keys, entries, state, path, echo=echo, target=target)
  found = {}
  for scale, cells in need.items():
    entry = _calibration_entry(entries, keys[scale])
    results = [entry["cells"][c] for c in cells]
    found.update({(c, scale): entry["cells"][c] for c in cells})
    missed = [r["cell"] for r in results if not r["matched"]]
    echo(
      f"{EQUAL_MASK} radii (task {entry['task_name']}, seed {seed}"
      + (f", {batches} rollout batches" if batches > 1 else "")
      + f", scale {scale:g}; {'saved to' if todo[scale] else 'cached in'} {path}): target = "
      + (
        "given"
        if target is not None
        else f"{REFERENCE}'s first-update masked share at delta {entry['reference_delta']:.4g}"
      )
      + (f"; NOT MATCHED: {', '.join(missed)} (run at the closest delta)" if missed else "")
    )
    for line in calibration_table(results):
      echo(line)
  return found


def _calibrate_cells(settings, todo, keys, entries, state, path, *, echo, target) -> None:
  """Computes the cells of `todo` ({scale: cells}) into their `entries` (keys[scale]) and saves
  `state` (the cache file's content) to `path` after each."""
  from gppo_jax import train  # noqa: PLC0415 (JAX only when calibrating)
  from gppo_jax.algorithm import objective  # noqa: PLC0415

  t0 = time.time()
  key = next(iter(keys.values()))
  seed, batches = key["seed"], key["batches"]
  reference = run_config(Run(seed, "f_eps", 1.0, REFERENCE), settings)
  n = sum(map(len, todo.values()))
  echo(
    f"{EQUAL_MASK}: calibrating {n} {'radius' if n == 1 else 'radii'} on the first update of "
    f"seed {seed}" + (f" ({batches} rollout batches)" if batches > 1 else "")
  )
  with train.first_update(reference, batches) as first:
    max_len = first.run.spec.loss.max_len

    def loss_of(cell: str, scale: float) -> objective.LossConfig:
      config = run_config(Run(seed, "f_eps", scale, cell), settings)
      if {**config.to_dict(), "loss": None} != {**reference.to_dict(), "loss": None}:
        raise ValueError(f"{cell}: its runs differ from {REFERENCE}'s outside the loss")
      return objective.LossConfig.from_config(config.loss, max_len)

    def share_at(loss: objective.LossConfig) -> Callable[[float], float]:
      # A preset's two radii move together (GSPO's 1.5e-4 / 2e-4 keep their ratio).
      ratio = loss.radii[1] / loss.radii[0]
      return lambda d: first.metrics(loss.replace(delta_low=d, delta_high=d * ratio))[MASK_METRIC]

    for scale, cells in todo.items():
      entry = _calibration_entry(entries, keys[scale])
      ref_loss = loss_of(REFERENCE, scale)
      ref_delta = float(ref_loss.delta_low)
      if "target" not in entry:
        entry["task_name"] = reference.task.name
        entry["reference_delta"] = ref_delta
        entry["target"] = share_at(ref_loss)(ref_delta) if target is None else target
      for cell in cells:
        t = time.time()
        loss = loss_of(cell, scale)
        if cell == REFERENCE and target is None:  # the target itself
          found = dict(delta=ref_delta, share=entry["target"], matched=True, evaluations=1)
        else:
          found = search_delta(share_at(loss), entry["target"], float(loss.delta_low))
        if loss.radii[1] != loss.radii[0]:
          found["delta_high"] = found["delta"] * loss.radii[1] / loss.radii[0]
        entry["cells"][cell] = {
          "cell": cell,
          "note": "",
          **found,
          "target": entry["target"],
          "tolerance": MASK_TOLERANCE,
          "seconds": round(time.time() - t, 2),
        }
        _write_json(path, state)  # each cell as it is found: a stop keeps what was done
  echo(f"{EQUAL_MASK}: calibrated in {duration(time.time() - t0)}")


# --- Run folders --------------------------------------------------------------------------------


def _write_json(path: str, value: Any) -> None:
  with files.atomic_write(path) as f:
    json.dump(value, f, indent=2, default=str)


def is_done(path: str) -> bool:
  """A run folder holds a finished run: train wrote summary.json (it does so only at the end)."""
  summary = read_json(os.path.join(path, "summary.json"))
  return isinstance(summary, dict) and not summary.get("preempted", False)


def check_run_folder(path: str, args: Sequence[str]) -> dict | None:
  """The folder's record, after checking that it was started with the same train arguments."""
  record = read_json(os.path.join(path, RECORD))
  if record is not None and list(record.get("train_args", [])) != list(args):
    theirs, ours = set(record.get("train_args", [])), set(args)
    raise errors.ConfigError(
      f"{path} holds a run started with other settings ({sorted(theirs - ours)} there, "
      f"{sorted(ours - theirs)} now): use another --out, or the same settings to resume"
    )
  return record


def check_sweep_folder(settings: Settings) -> dict:
  """sweep.json of --out, created or checked: one folder, one set of shared settings."""
  path = os.path.join(settings.out, SWEEP_FILE)
  shared = {"overrides": list(settings.overrides), "start": settings.start, "eps": settings.eps}
  if settings.task:  # only then: the folders of sweeps from before --task keep their settings
    shared["task"] = settings.task
  if settings.metric != DEFAULT_METRIC:  # likewise for --metric
    shared["metric"] = settings.metric
  state = read_json(path) or {}
  old = {k: state[k] for k in shared if k in state}
  if state and state.get("task", "") != settings.task:  # a task's sweep, resumed without it
    old["task"] = state.get("task", "")
  if state and state.get("metric", DEFAULT_METRIC) != settings.metric:  # or without its metric
    old["metric"] = state.get("metric", DEFAULT_METRIC)
  if old and old != shared:
    raise errors.ConfigError(
      f"{settings.out} holds a sweep with other shared settings {old} (now {shared}): use another "
      "--out, or the same --set, --start, --eps, --task and --metric to extend or resume it "
      "(--report-only --metric rebuilds its report on another statistic)"
    )
  return {**state, **shared}


def launch_process(cmd: Sequence[str], log: Any) -> subprocess.Popen:
  """Starts one training run in its own session (the sweep forwards stop signals itself)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
  return subprocess.Popen(
    list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
  )


@dataclasses.dataclass
class _Job:
  run: Run
  args: list[str]
  record: dict
  proc: Any
  log: Any
  started: float


class SweepStopped(Exception):
  """A stop signal reached the sweep; the running runs saved their progress."""


def _raise_stop(signum, frame):
  raise SweepStopped(signal.Signals(signum).name)


def execute(
  runs: Sequence[Run],
  settings: Settings,
  *,
  jobs: int = 1,
  launch: Callable[[Sequence[str], Any], Any] = launch_process,
  echo: Callable[[str], None] = print,
  poll_s: float = 0.5,
) -> dict[Run, str]:
  """Trains every run that is not finished, `jobs` at a time; returns {run: status}.

  Finished runs are reused, unfinished ones rerun with the same arguments (train resumes from the
  workdir). The first run of each starting policy (warmstart.seed) without a finished run goes
  before the others of that start, so that only it warms the cache. One line per finished run,
  with the total and an ETA. A run that exits 2 (a user error: every run would fail alike) stops
  the sweep with a ConfigError; a stop signal (SIGTERM, Ctrl-C) is passed on to the running runs,
  which save their progress, and raises SweepStopped."""
  if jobs < 1:
    raise errors.ConfigError(f"--jobs must be >= 1, got {jobs}")
  os.makedirs(os.path.join(settings.out, "runs"), exist_ok=True)
  status: dict[Run, str] = {}
  todo: list[tuple[Run, list[str], dict]] = []
  for run in runs:
    args = train_args(run, settings)
    path = run_dir(settings.out, run)
    record = check_run_folder(path, args) or {}
    if is_done(path):
      status[run] = "done"
    else:
      todo.append((run, args, record))
  warm = {settings.start_seed(r.seed) for r, s in status.items() if s == "done"}
  total, finished = len(runs), len(status)
  if status:
    echo(f"reusing {len(status)} finished runs of {total} under {settings.out}")
  t0, walls = time.time(), []
  running: list[_Job] = []
  leaders: set[int] = set()  # start seeds whose first run is under way

  def ready(run: Run) -> bool:
    start = settings.start_seed(run.seed)
    return start in warm or start not in leaders

  def start(run: Run, args: list[str], record: dict) -> None:
    path = run_dir(settings.out, run)
    os.makedirs(path, exist_ok=True)
    cmd = command(run, settings)
    record = {
      **record,
      "run": dataclasses.asdict(run),
      "name": run.name,
      "start_seed": settings.start_seed(run.seed),
      "train_args": args,
      "command": cmd,
      "attempts": int(record.get("attempts", 0)) + 1,
      "wall_s": float(record.get("wall_s", 0.0)),
      "exit": None,
      "started": now(),
    }
    if run.rule == EQUAL_MASK:  # how its radius was found, for the report
      record["calibration"] = settings.calibration[run.cell, run.scale]
    _write_json(os.path.join(path, RECORD), record)
    log = open(os.path.join(path, LOG), "a")
    log.write(f"\n# {now()} attempt {record['attempts']}: {' '.join(cmd)}\n")
    log.flush()
    leaders.add(settings.start_seed(run.seed))
    running.append(_Job(run, args, record, launch(cmd, log), log, time.time()))

  def finish(job: _Job, code: int) -> None:
    nonlocal finished
    job.log.close()
    wall = time.time() - job.started
    job.record.update(wall_s=job.record["wall_s"] + wall, exit=code, finished=now())
    path = run_dir(settings.out, job.run)
    _write_json(os.path.join(path, RECORD), job.record)
    done = code == 0 and is_done(path)
    status[job.run] = "done" if done else ("unfinished" if code == 0 else f"failed (exit {code})")
    warm.add(settings.start_seed(job.run.seed))
    finished += 1
    if done:
      walls.append(wall)
    echo(
      _progress_line(
        job.run, path, status[job.run], wall, finished, total, t0, walls, jobs, settings.metric
      )
    )

  main_thread = threading.current_thread() is threading.main_thread()
  old_term = signal.signal(signal.SIGTERM, _raise_stop) if main_thread else None
  try:
    while todo or running:
      while len(running) < jobs:
        nxt = next((t for t in todo if ready(t[0])), None)
        if nxt is None:
          break
        todo.remove(nxt)
        start(*nxt)
      time.sleep(poll_s if running else 0)
      for job in list(running):
        code = job.proc.poll()
        if code is None:
          continue
        running.remove(job)
        finish(job, code)
        if code == 2:
          raise errors.ConfigError(
            f"run {job.run.name} stopped on a user error: "
            f"{_last_error(os.path.join(run_dir(settings.out, job.run), LOG))} "
            f"(log: {os.path.join(run_dir(settings.out, job.run), LOG)})"
          )
        if status[job.run] == "done":  # a --metric the runs do not log stops the sweep here
          read_run(run_dir(settings.out, job.run), settings.metric)
  except (KeyboardInterrupt, SweepStopped, errors.UserError) as e:
    for job in running:
      job.proc.send_signal(signal.SIGTERM)  # each saves its completed iterations and exits 0
    for job in running:
      try:
        code = job.proc.wait(timeout=600)
      except subprocess.TimeoutExpired:
        job.proc.kill()
        code = job.proc.wait()
      finish(job, code)
    if isinstance(e, errors.UserError):
      raise
    raise SweepStopped(str(e) or type(e).__name__) from None
  finally:
    if main_thread:
      signal.signal(signal.SIGTERM, old_term)
  return status


def _last_error(log_path: str) -> str:
  try:
    lines = [x.strip() for x in open(log_path, errors="replace") if x.strip()]
  except OSError:
    return "(no log)"
  errs = [x for x in lines if x.startswith("error:")]
  return (errs or lines or ["(empty log)"])[-1]


def _progress_line(
  run: Run,
  path: str,
  state: str,
  wall: float,
  finished: int,
  total: int,
  t0,
  walls,
  jobs,
  metric: str = DEFAULT_METRIC,
) -> str:
  width = len(str(total))
  head = f"[{finished:>{width}}/{total}] {run.cell} {run.radius} s{run.seed}: {state}"
  head += f" in {duration(wall)}"
  if state == "done":
    try:
      row = read_run(path, metric)
    except errors.UserError as e:
      head += f" ({e})"
    else:
      figure = "" if metric == DEFAULT_METRIC else f" {metric}"
      head += (
        f", final{figure} {100 * row['final']:.1f}%, auc {100 * row['auc']:.1f}%, "
        f"masked {100 * row['masked_late']:.1f}%"
      )
  elapsed = time.time() - t0
  left = total - finished
  eta = f", ETA {duration(np.mean(walls) * left / jobs)}" if walls and left else ""
  return f"{head} | elapsed {duration(elapsed)}{eta}"


# --- Command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m gppo_jax.sweep",
    description=__doc__.split("\n\n", 1)[0],
    epilog=__doc__.split("\n\n", 1)[1],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--cells", default=DEFAULT_CELLS, help="cells: grid, <div>_<est>, presets, none")
  p.add_argument("--seeds", default=DEFAULT_SEEDS, help="seeds, e.g. 0-7 or 0,2,5")
  p.add_argument("--rules", default="f_eps", help=f"radius calibration rules: {', '.join(RULES)}")
  p.add_argument("--scales", default="1", help="scales of each cell's delta, e.g. 0.5,1,2")
  p.add_argument("--eps", type=float, default=0.2, help="delta = f(1 - eps); tv_mc: eps / 2")
  p.add_argument("--start", choices=STARTS, default="per_seed", help="starting policy per seed")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="config override for every run, e.g. optim.lr=3e-4 (repeatable)",
  )
  p.add_argument(
    "--jobs", type=int, default=DEFAULT_JOBS, help=f"runs at a time (default {DEFAULT_JOBS})"
  )
  p.add_argument(
    "--task",
    default="",
    help="a built-in task with its run settings (config argument task=NAME, e.g. wordchain)",
  )
  p.add_argument(
    "--metric",
    default=None,
    help="the held-out figure the report ranks cells by: accuracy (greedy, the default), avg@N "
    "(sampled: mean correctness of N samples per problem, e.g. avg@4 with the default eval.k), "
    "pass@K, as logged under eval/; checked at launch against the runs' eval.n and eval.k; "
    "recorded in sweep.json (with --report-only: the folder's unless given)",
  )
  p.add_argument("--out", default=os.path.join("workdirs", "sweep"), help="the sweep folder")
  p.add_argument(
    "--report-only",
    action="store_true",
    help="rebuild runs.csv, results.md and plots from the run folders; run nothing",
  )
  p.add_argument(
    "--include-missed-starts",
    action="store_true",
    help="count the runs whose warm start missed its target in the statistics (by default they "
    "are listed apart in results.md and left out)",
  )
  p.add_argument("--dry-run", action="store_true", help="print each run's command; run nothing")
  p.add_argument(
    "--calibrate-only",
    action="store_true",
    help=f"compute (or read from --out's {CALIBRATION_FILE}) and print the {EQUAL_MASK} radii of "
    "the grid cells in --cells at each --scales; train nothing",
  )
  p.add_argument(
    "--calibration-batches",
    type=int,
    default=CALIBRATION_BATCHES,
    help=f"{EQUAL_MASK}: the rollout batches of the starting policy whose first updates the "
    f"calibration averages (default {CALIBRATION_BATCHES}: seed {CALIBRATION_SEED}'s first update)",
  )
  return p


def calibration_argv(
  settings: Settings, need: Mapping[float, Sequence[str]], batches: int = CALIBRATION_BATCHES
) -> list[str]:
  """The `python -m gppo_jax.sweep` arguments that calibrate `need` under `settings`: the same
  folder, task, overrides, start, eps and metric (what sweep.json checks), --calibrate-only."""
  cells = list(dict.fromkeys(c for cs in need.values() for c in cs))
  argv = ["--calibrate-only", "--rules", EQUAL_MASK, "--cells", ",".join(cells)]
  argv += ["--scales", ",".join(f"{s!r}" for s in need), "--eps", repr(settings.eps)]
  argv += ["--start", settings.start, "--out", settings.out, "--calibration-batches", str(batches)]
  argv += ["--task", settings.task] if settings.task else []
  argv += ["--metric", settings.metric] if settings.metric != DEFAULT_METRIC else []
  return argv + [x for o in settings.overrides for x in ("--set", o)]


def launch_calibration(
  settings: Settings, need: Mapping[float, Sequence[str]], batches: int = CALIBRATION_BATCHES
) -> None:
  """Runs `calibrate` for `need` in a child process (`--calibrate-only`), as a run's JAX is kept
  out of the sweep's own process: its table goes to this process's output, its results to the
  folder's cache. ConfigError naming the failure when it does not finish."""
  argv = calibration_argv(settings, need, batches)
  sys.stdout.flush()
  proc = launch_process([sys.executable, "-m", "gppo_jax.sweep", *argv], None)
  try:
    code = proc.wait()
  except BaseException:  # Ctrl-C or a stop signal: the child runs in its own session
    proc.terminate()
    proc.wait()
    raise
  if code != 0:
    raise errors.ConfigError(
      f"the {EQUAL_MASK} calibration stopped with exit status {code} (its output is above; "
      f"rerun it alone: python -m gppo_jax.sweep {' '.join(argv)})"
    )


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  out = os.path.abspath(a.out)
  metric = parse_metric(a.metric) if a.metric is not None else None
  if a.report_only:
    paths = write_outputs(out, include_missed=a.include_missed_starts, metric=metric)
    print(json.dumps(paths, indent=2))
    return 0
  if not 0 < a.eps < 1:
    raise errors.ConfigError(f"--eps must lie in (0, 1), got {a.eps}")
  if a.task:
    _check_task(a.task)
  settings = Settings(out, parse_overrides(a.set), a.start, a.eps, a.task, metric or DEFAULT_METRIC)
  check_metric(settings)
  runs = expand(
    parse_cells(a.cells), parse_rules(a.rules), parse_scales(a.scales), parse_seeds(a.seeds)
  )
  need = calibration_needs(runs)
  if a.calibration_batches < 1:
    raise errors.ConfigError(f"--calibration-batches must be >= 1, got {a.calibration_batches}")
  batches = a.calibration_batches
  if a.calibrate_only and not need:
    raise errors.ConfigError(
      f"--calibrate-only: no grid cell under --rules {EQUAL_MASK} (--cells {a.cells}, "
      f"--rules {a.rules}): nothing to calibrate"
    )
  if a.dry_run:
    cached = cached_calibration(settings, need, batches=batches)
    settings = dataclasses.replace(settings, calibration=cached)
    for run in runs:
      if run.rule == EQUAL_MASK and (run.cell, run.scale) not in settings.calibration:
        print(f"# {run.name}: its {EQUAL_MASK} delta is calibrated at launch (--calibrate-only)")
        continue
      print(" ".join(command(run, settings)))
    return 0
  sweep = check_sweep_folder(settings)
  os.makedirs(out, exist_ok=True)
  _write_json(os.path.join(out, SWEEP_FILE), sweep)
  complete = len(cached_calibration(settings, need, batches=batches)) == sum(
    map(len, need.values())
  )
  if a.calibrate_only:
    if not complete:  # this process computes it: set up JAX as train's main does
      from gppo_jax.trainer import experiment  # noqa: PLC0415

      experiment.keep_cpu_memory()  # before anything starts a JAX backend
      experiment.use_compilation_cache()
    calibrate(settings, need, echo=lambda s: print(s, flush=True), batches=batches)
    return 0
  if need:
    if complete:  # the cached tables
      calibrate(settings, need, echo=lambda s: print(s, flush=True), batches=batches)
    else:
      launch_calibration(settings, need, batches)  # prints its tables
    cached = cached_calibration(settings, need, batches=batches)
    settings = dataclasses.replace(settings, calibration=cached)
  print(
    f"{len(runs)} runs ({len({r.cell for r in runs})} cells, {len({r.seed for r in runs})} seeds, "
    f"radii {sorted({r.radius for r in runs})}), {a.jobs} at a time, start {a.start}; overrides "
    f"{list(settings.overrides)}; under {out}",
    flush=True,
  )
  t0 = time.time()
  stopped = None
  try:
    status = execute(runs, settings, jobs=a.jobs, echo=lambda s: print(s, flush=True))
  except SweepStopped as e:
    stopped, status = str(e), {}
  finally:
    sweep["elapsed_s"] = [*sweep.get("elapsed_s", []), time.time() - t0]
    _write_json(os.path.join(out, SWEEP_FILE), sweep)
  paths = write_outputs(out, sweep, include_missed=a.include_missed_starts)
  if stopped:
    print(f"stopped ({stopped}); rerun the same command to resume", flush=True)
    return 130
  bad = {r.name: s for r, s in status.items() if s != "done"}
  result = {**paths, "elapsed_s": round(time.time() - t0, 1), "not_done": bad}
  if need:  # equal_mask cells whose calibration missed its target, said again at the end
    result["not_matched"] = sorted(
      f"{cell} x{scale:g}" for (cell, scale), c in settings.calibration.items() if not c["matched"]
    )
  print(json.dumps(result, indent=2))
  return 1 if bad else 0


if __name__ == "__main__":
  from gppo_jax import cli

  try:
    sys.exit(main())
  except errors.UserError as e:
    cli.fail(str(e), e, verbose="--verbose" in sys.argv)
