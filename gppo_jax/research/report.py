"""The outputs of a sweep (gppo_jax/sweep.py) from its run folders: runs.csv, results.md, plots.

Each run folder is read back on its own (`read_run`: the sweep's record, train's config.json,
metrics.jsonl and summary.json), so the outputs can be rebuilt at any time from what is on disk
(`python -m gppo_jax.sweep --report-only`). Statistics come from gppo_jax/research/stats.py: means
with 95% percentile-bootstrap intervals over seeds, and differences and relative gains paired by
seed. Plots use matplotlib's Agg backend.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gppo_jax import errors, files
from gppo_jax.algorithm import presets
from gppo_jax.data import readers
from gppo_jax.research import stats as stats

DIVERGENCES = ("tv", "kl", "hellinger", "chi2")
ESTIMATORS = ("mc", "binary", "atomic")
GRID = tuple(f"{d}_{e}" for d in DIVERGENCES for e in ESTIMATORS)
NONE = "none"  # tv_mc with an infinite radius
REFERENCE = "tv_mc"  # PPO's clip: the cell every other is compared with, paired by seed
RULES = ("f_eps", "equal_tv", "equal_mask")
EQUAL_MASK = "equal_mask"  # the rule whose radii are calibrated on a first update (sweep.py)
CALIBRATION_FILE = "equal_mask.json"  # in the sweep folder: equal_mask's calibrations, reused
OWN = "own"  # the radius rule of presets (their own radii)
INF = "inf"  # the radius rule of `none`
RECORD = "sweep_run.json"  # in each run folder: what the run is, its train arguments, wall time
SWEEP_FILE = "sweep.json"  # in the sweep folder: the shared settings and the invocations' times
# The estimator diagnostics' metrics (research/diagnostics.py), averaged per run: after each
# update, and (stale rollouts) before it; row field -> metric prefix.
DIAG_FIELDS = {"diag": "diag/", "diag_start": "diag_start/"}
# The statistic of held-out evaluation the report ranks cells by: a figure of the pooled eval row
# (gppo_jax/rewards/pass_at_k.py, logged as eval/<figure>), e.g. `accuracy` (greedy, the default),
# `avg@4` (mean correctness of 4 sampled responses per problem), `pass@4`, or a benchmark's
# `<bench>/avg@4`. The sweep records a non-default one in sweep.json (`metric`).
DEFAULT_METRIC = "accuracy"
_METRIC_RE = re.compile(r"(?:[^/\s]+/)*(?:accuracy|avg@\d+|pass@\d+)")
# The paper's summary claims (math / code), as relative gains of held-out accuracy.
PAPER_CLAIMS = (
  ("KL-Atomic vs TV-MC (GRPO)", "+49.8% / +13.9%"),
  ("Atomic vs MC, averaged over divergences", "+28.3% / +7.7%"),
  ("Binary vs MC, averaged over divergences", "+21.3% / +3.2%"),
  ("KL vs TV under MC", "+24.9% / +3.6%"),
)


def read_json(path: str) -> Any:
  """The JSON value in `path`, or None if it is missing or unreadable."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def duration(seconds: float) -> str:
  """'1 h 05 min', '4 min 10 s', '37 s'."""
  seconds = max(0, int(round(seconds)))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  if h:
    return f"{h} h {m:02d} min"
  return f"{m} min {s:02d} s" if m else f"{s} s"


def now() -> str:
  return datetime.datetime.now().isoformat(timespec="seconds")


# --- The statistic -----------------------------------------------------------------------------


def parse_metric(text: str | None) -> str:
  """`avg@4`, `eval/avg@4` -> 'avg@4' (the figure under eval/); None or '' -> the default;
  ConfigError for what is not a figure of the evaluation (accuracy, avg@n, pass@k)."""
  metric = (text or "").strip().removeprefix("eval/") or DEFAULT_METRIC
  if not _METRIC_RE.fullmatch(metric):
    raise errors.ConfigError(
      f"--metric {text!r} is not a held-out figure the evaluation logs: accuracy (greedy), "
      "avg@N (mean correctness of N samples per problem), pass@K, each optionally as "
      "<benchmark>/<figure> (the eval/ prefix may be left out)"
    )
  return metric


def metric_key(metric: str) -> str:
  """The metrics.jsonl / summary.json key of a statistic: 'avg@4' -> 'eval/avg@4'."""
  return f"eval/{metric}"


def metric_label(metric: str) -> str:
  """How the report names the statistic: 'greedy held-out accuracy', 'held-out avg@4 ...'."""
  if metric == DEFAULT_METRIC:
    return "greedy held-out accuracy"
  figure = metric.rsplit("/", 1)[-1]
  m = re.fullmatch(r"(avg|pass)@(\d+)", figure)
  what = (
    {
      "avg": f"mean correctness of {m.group(2)} sampled responses per problem",
      "pass": f"share of problems solved by at least one of {m.group(2)} sampled responses",
    }[m.group(1)]
    if m
    else "greedy decoding"
  )
  where = f", benchmark {metric.rsplit('/', 1)[0]}" if "/" in metric else ""
  return f"held-out {figure} (`{metric_key(metric)}`: {what}{where})"


def _figures(keys: Iterable[str]) -> list[str]:
  """The --metric values a run's evaluation keys offer (no standard errors or seed spreads)."""
  return sorted(
    {
      k.removeprefix("eval/")
      for k in keys
      if k.startswith("eval/") and not k.endswith(("_se", "_seed_std"))
    }
  )


# --- Reading runs back --------------------------------------------------------------------------


def read_run(path: str, metric: str = DEFAULT_METRIC) -> dict[str, Any]:
  """One run folder as a row: identity, radii, curves and figures (NaN where not available).

  The curve, initial, final, AUC and best values are those of `metric` (the figure under eval/,
  parse_metric). A finished run that logged no `metric` is a ConfigError naming the run and the
  figures it has; under the default (greedy accuracy) it keeps NaN, as runs without evaluation
  always had."""
  key = metric_key(metric)
  record = read_json(os.path.join(path, RECORD)) or {}
  config = read_json(os.path.join(path, "config.json")) or {}
  summary = read_json(os.path.join(path, "summary.json"))
  ident = record.get("run") or {}
  loss = config.get("loss", {})
  nan = float("nan")
  cell = ident.get("cell", "")
  if ident.get("rule") == EQUAL_MASK and cell in presets.names():
    cell = f"{cell} (matched)"  # beside the same preset at its own radius, in the same tables
  row: dict[str, Any] = {
    "run": os.path.basename(os.path.normpath(path)),
    "cell": cell,
    "divergence": loss.get("divergence", ""),
    "estimator": loss.get("estimator", ""),
    "rule": ident.get("rule", ""),
    "scale": float(ident.get("scale", nan)),
    "delta_low": _float(loss.get("delta_low")),
    "delta_high": _float(loss.get("delta_high")),
    "seed": ident.get("seed", config.get("seed")),
    "start_seed": record.get("start_seed", (config.get("warmstart") or {}).get("seed")),
    "iterations": config.get("iterations"),
    "wall_s": float(record.get("wall_s") or (summary or {}).get("seconds") or nan),
    "budget": _budget(config),
    # equal_mask: the cell's calibration (sweep.calibrate: delta, share, target, matched, note)
    "calibration": record.get("calibration"),
  }
  steps, curve, mask_steps, masked, masked_all = [], [], [], [], []
  diag_sum: dict[str, float] = {}
  diag_n: dict[str, int] = {}
  logged: set[str] = set()
  metrics = os.path.join(path, "metrics.jsonl")
  for x in readers.metric_rows(metrics) if os.path.isfile(metrics) else ():
    for k, v in x.items():
      if k.startswith("diag") and isinstance(v, (int, float)) and math.isfinite(v):
        diag_sum[k] = diag_sum.get(k, 0.0) + float(v)
        diag_n[k] = diag_n.get(k, 0) + 1
    logged.update(k for k in x if k.startswith("eval/"))
    if key in x:
      steps.append(x["step"])
      curve.append(x[key])
    if "trust/masked_frac" in x:
      masked_all.append(x["trust/masked_frac"])
    if "trust/masked_frac_late" in x:
      mask_steps.append(x["step"])
      masked.append(x["trust/masked_frac_late"])
  done = isinstance(summary, dict) and not summary.get("preempted", False)
  code = record.get("exit")
  if done:
    row["status"] = "done"
  elif code not in (None, 0):
    row["status"] = f"failed (exit {code})"
  else:
    row["status"] = "unfinished" if record or steps else "not started"
  final_eval = (summary.get("final_eval") or {}) if done else {}
  if done and metric != DEFAULT_METRIC and key not in final_eval and not curve:
    have = _figures([*logged, *final_eval])
    raise errors.ConfigError(
      f"run {row['run']} ({path}) logged no {key} (--metric {metric}); its held-out metrics: "
      f"{', '.join(have) or 'none'}: choose one of them with --metric, or set the run's "
      "config.eval (eval.n, eval.k) to log it"
    )
  tail = masked[len(masked) // 2 :]
  row.update(
    initial=curve[0] if curve else nan,
    final=final_eval.get(key, nan) if done else nan,
    auc=stats.auc(steps, curve) if done and curve else nan,
    best=max(curve) if curve else nan,
    masked_late=float(np.mean(tail)) if tail else nan,
    masked_mean=float(np.mean(masked_all)) if masked_all else nan,
    curve_steps=steps,
    curve=curve,
    masked_steps=mask_steps,
    masked=masked,
  )
  for field, prefix in DIAG_FIELDS.items():
    row[field] = {
      k[len(prefix) :]: diag_sum[k] / diag_n[k] for k in diag_sum if k.startswith(prefix)
    }
  row.update(_start(summary if done else None, config))
  return row


def _start(summary: dict | None, config: dict) -> dict[str, Any]:
  """The run's supervised warm start: its held-out accuracy, its target and whether it ended
  below the target (summaries written before train recorded `missed_target` are judged from the
  accuracy and the config's warmstart.target_accuracy). No warm start: NaN and not missed."""
  info = (summary or {}).get("warm_start") or {}
  target = (config.get("warmstart") or {}).get("target_accuracy")
  target = _float(info.get("target_accuracy", target))
  acc = _float(info.get("accuracy"))
  if "missed_target" in info:
    missed = bool(info["missed_target"])
  else:
    missed = math.isfinite(acc) and math.isfinite(target) and acc < target
  return {"start_accuracy": acc, "start_target": target, "start_missed": missed}


def counted(rows: Iterable[dict], include_missed: bool = False) -> list[dict]:
  """The rows that enter the statistics: without `include_missed`, not those whose warm start
  missed its target (they did not start from the policy the comparison is about)."""
  return [r for r in rows if include_missed or not r["start_missed"]]


def _budget(c: dict) -> str:
  """'task addsub3, 400 iterations of 64 prompts x 8 samples, 2 epochs x 4 mini-batches, ...'."""
  try:
    r, u = c["rollout"], c["train"]
    return (
      f"task {c['task']['name']}, {c['iterations']} iterations of {r['prompts_per_iter']} "
      f"prompts x "
      f"{r['group_size']} samples, {u['epochs']} epochs x {u['minibatches']} mini-batches, "
      f"lr {c['optim']['lr']:g}, evals every {c['eval']['every']} on {c['eval']['num_problems']}"
    )
  except (KeyError, TypeError, ValueError):
    return ""


def _float(x: Any) -> float:
  try:
    return float(x)
  except (TypeError, ValueError):
    return float("nan")


def collect(out: str, metric: str = DEFAULT_METRIC) -> list[dict[str, Any]]:
  """Every run folder of a sweep (those with a sweep record), in run order, read for `metric`."""
  root = os.path.join(out, "runs")
  rows = []
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, RECORD)):
      rows.append(read_run(path, metric))

  def key(r):
    cells = [*GRID, NONE, *presets.names()]
    return (r["seed"], r["rule"], r["scale"], cells.index(r["cell"]) if r["cell"] in cells else 99)

  return sorted(rows, key=key)


# --- Outputs: runs.csv, results.md, plots ------------------------------------------------------

CSV_FIELDS = (
  "run",
  "cell",
  "divergence",
  "estimator",
  "rule",
  "scale",
  "delta_low",
  "delta_high",
  "seed",
  "start_seed",
  "start_accuracy",
  "start_missed",
  "iterations",
  "initial",
  "final",
  "auc",
  "best",
  "masked_late",
  "masked_mean",
  "wall_s",
  "status",
  "calibrated_share",
  "calibration_target",
  "calibration_matched",
)
METRICS = (("final", "final accuracy"), ("auc", "AUC (mean accuracy over the run)"))


def write_runs_csv(path: str, rows: Sequence[dict]) -> None:
  """One row per run: identity, radii, accuracies (fractions), masked share, wall time, status."""
  with files.atomic_write(path, newline="") as f:
    w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      cal = r.get("calibration") or {}
      r = {
        **r,
        "calibrated_share": cal.get("share", ""),
        "calibration_target": cal.get("target", ""),
        "calibration_matched": cal.get("matched", ""),
      }
      w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in CSV_FIELDS})


def groups(rows: Sequence[dict]) -> list[tuple[str, float]]:
  """The radius settings (rule, scale) of the grid cells present; each is reported on its own,
  with the presets at that scale and `none` beside it."""
  order = {r: i for i, r in enumerate((*RULES, OWN, INF))}
  grid = {(r["rule"], r["scale"]) for r in rows if r["cell"] in GRID}
  if not grid:
    grid = {(OWN, r["scale"]) for r in rows if r["rule"] == OWN} or {(INF, 1.0)}
  return sorted(grid, key=lambda g: (order.get(g[0], 9), g[1]))


def group_tag(group: tuple[str, float]) -> str:
  return INF if group[0] == INF else f"{group[0]}_x{group[1]:g}"


def in_group(row: dict, group: tuple[str, float]) -> bool:
  rule, scale = row["rule"], row["scale"]
  return (rule, scale) == group or rule == INF or (rule == OWN and scale == group[1])


def by_cell(rows: Iterable[dict]) -> dict[str, dict[int, dict]]:
  """{cell: {seed: row}} of the finished runs."""
  out: dict[str, dict[int, dict]] = {}
  for r in rows:
    if r["status"] == "done":
      out.setdefault(r["cell"], {})[r["seed"]] = r
  return out


def paired(cells_rows: dict[str, dict[int, dict]], cells: Sequence[str], metric: str):
  """(seeds, x [seeds, cells]): `metric` of `cells` under the seeds all of them finished."""
  if not cells or any(c not in cells_rows for c in cells):
    return [], np.zeros((0, len(cells)))
  seeds = sorted(set.intersection(*(set(cells_rows[c]) for c in cells)))
  x = np.array([[cells_rows[c][s][metric] for c in cells] for s in seeds], np.float64)
  return seeds, x.reshape(len(seeds), len(cells))


def _pct(
  p: float, lo: float = math.nan, hi: float = math.nan, *, sign: bool = False, unit=""
) -> str:
  if not math.isfinite(p):
    return "n/a"
  f = "+.1f" if sign else ".1f"
  text = f"{100 * p:{f}}{unit}"
  if math.isfinite(lo) and math.isfinite(hi):
    text += f" [{100 * lo:{f}}{unit}, {100 * hi:{f}}{unit}]"
  return text


def _reading(lo: float, hi: float) -> str:
  if not (math.isfinite(lo) and math.isfinite(hi)):
    return "no interval (1 seed)"
  return "higher" if lo > 0 else ("lower" if hi < 0 else "within noise")


def comparisons(cells_rows: dict[str, dict[int, dict]]) -> list[tuple[str, str, list, list]]:
  """The paper's summary comparisons present in a group: (name, paper figure, cells, pairs), pairs
  as (cell index, baseline index) into cells, averaged as relative gains."""
  have = set(cells_rows)
  out = []

  def add(name: str, pairs: list[tuple[str, str]]) -> None:
    pairs = [(a, b) for a, b in pairs if a in have and b in have]
    if not pairs:
      return
    cells = list(dict.fromkeys(c for pair in pairs for c in pair))
    paper = dict(PAPER_CLAIMS).get(name, "")
    out.append((name, paper, cells, [(cells.index(a), cells.index(b)) for a, b in pairs]))

  add(PAPER_CLAIMS[0][0], [("kl_atomic", REFERENCE)])
  add(PAPER_CLAIMS[1][0], [(f"{d}_atomic", f"{d}_mc") for d in DIVERGENCES])
  add(PAPER_CLAIMS[2][0], [(f"{d}_binary", f"{d}_mc") for d in DIVERGENCES])
  add(PAPER_CLAIMS[3][0], [("kl_mc", REFERENCE)])
  return out


def averages(cells_rows: dict[str, dict[int, dict]]) -> list[tuple[str, str, list, list]]:
  """Per estimator, relative gain over MC averaged over divergences; per divergence, over TV
  averaged over estimators (the same estimator on both sides)."""
  have = set(cells_rows)
  out = []
  for base, others, make in (
    ("mc", ESTIMATORS[1:], lambda o, d: (f"{d}_{o}", f"{d}_mc")),
    ("tv", DIVERGENCES[1:], lambda o, e: (f"{o}_{e}", f"tv_{e}")),
  ):
    over = DIVERGENCES if base == "mc" else ESTIMATORS
    for other in others:
      pairs = [make(other, x) for x in over]
      pairs = [(a, b) for a, b in pairs if a in have and b in have]
      if pairs:
        cells = list(dict.fromkeys(c for pair in pairs for c in pair))
        what = "divergences" if base == "mc" else "estimators"
        name = f"{other} vs {base.upper()} ({len(pairs)} {what})"
        out.append((name, base, cells, [(cells.index(a), cells.index(b)) for a, b in pairs]))
  return out


def _gain_rows(items, cells_rows) -> list[str]:
  lines = []
  for name, paper, cells, pairs in items:
    cols = [name] + ([paper] if paper not in ("mc", "tv") else [])
    n = 0
    for metric, _ in METRICS:
      seeds, x = paired(cells_rows, cells, metric)
      n = len(seeds)
      if n == 0:
        cols += ["no common seed", ""] if metric == "final" else ["no common seed"]
        continue
      g, lo, hi = stats.relative_gain_ci(x, pairs)
      cols.append(_pct(g, lo, hi, sign=True, unit="%"))
      if metric == "final":
        cols.append(_reading(lo, hi))
    lines.append("| " + " | ".join(cols[:1] + [str(n)] + cols[1:]) + " |")
  return lines


def results_markdown(
  rows: Sequence[dict], sweep: dict | None = None, *, include_missed: bool = False
) -> str:
  """results.md: settings and time, the warm starts that missed their target, then per radius
  setting the per-cell table, the paper's summary comparisons and the per-estimator /
  per-divergence averages, and the plots. The runs of a missed start are left out of every
  statistic unless `include_missed`."""
  sweep = sweep or {}
  metric = parse_metric(sweep.get("metric"))
  done = [r for r in rows if r["status"] == "done"]
  walls = [r["wall_s"] for r in rows if math.isfinite(r["wall_s"])]
  lines = [
    "# Sweep results",
    "",
    f"Written {now()} by `python -m gppo_jax.sweep`. Runs: {len(rows)} ({len(done)} finished"
    + "".join(
      f", {sum(r['status'] == s for r in rows)} {s}"
      for s in sorted({r["status"] for r in rows} - {"done"})
    )
    + ").",
    f"Shared settings: overrides {sweep.get('overrides', [])}, start {sweep.get('start', '?')} "
    f"(warmstart.seed {'= seed' if sweep.get('start') == 'per_seed' else '0'}), eps "
    f"{sweep.get('eps', '?')}.",
  ]
  if walls:
    lines.append(
      f"Wall time: {duration(sum(walls))} summed over runs ({duration(float(np.mean(walls)))} "
      f"per run on average, {duration(min(walls))} - {duration(max(walls))})"
      + (
        f"; the sweep's invocations took {duration(sum(sweep['elapsed_s']))} end to end"
        if sweep.get("elapsed_s")
        else ""
      )
      + "."
    )
  budgets = sorted({r["budget"] for r in rows if r["budget"]})
  if budgets:
    lines.append("Budget: " + "; ".join(budgets) + ".")
  lines += [
    "",
    f"Accuracy is {metric_label(metric)} in percent; final = after the last iteration, AUC = the "
    "area under the held-out curve divided by its length (the run's mean accuracy, start "
    "included). Intervals are 95% percentile bootstraps over seeds (about 90% coverage at 8 "
    "seeds); differences and relative gains are paired by seed (same start, prompts and keys) "
    "over the seeds both sides finished. Masked: share of tokens masked by the trust region in "
    "the later mini-batches, mean over the second half of the run.",
  ]
  lines += _missed_section(rows, include_missed)
  for group in groups(rows):
    every = [r for r in rows if in_group(r, group)]  # the cell table counts them all
    grows = counted(every, include_missed)
    cells_rows = by_cell(grows)
    tag = group_tag(group)
    lines += ["", f"## Radius {tag}", ""]
    lines += _cell_table(every, cells_rows)
    lines += _calibration_section(every)
    items = comparisons(cells_rows)
    if items:
      lines += [
        "",
        "### The paper's summary comparisons (relative gain of the mean accuracy)",
        "",
        "| comparison | seeds | paper (math / code) | final [95% CI] | final reads "
        "| AUC [95% CI] |",
        "|---|---|---|---|---|---|",
        *_gain_rows(items, cells_rows),
      ]
    avg = averages(cells_rows)
    if avg:
      lines += [
        "",
        "### Per estimator (vs MC) and per divergence (vs TV), averaged relative gains",
        "",
        "| comparison | seeds | final [95% CI] | final reads | AUC [95% CI] |",
        "|---|---|---|---|---|",
        *_gain_rows(avg, cells_rows),
      ]
    lines += _diagnostics_section(grows)
    by_q = (
      f", [masked share by behaviour probability](plots/{tag}_masked_by_q.png)"
      if _diag_pools(grows)
      else ""
    )
    lines += [
      "",
      f"Plots: [heatmap](plots/{tag}_heatmap.png), [learning curves](plots/{tag}_curves.png), "
      f"[masked fraction](plots/{tag}_masked.png){by_q}.",
    ]
  lines += _scales_section(counted(rows, include_missed))
  failed = [r for r in rows if r["status"].startswith("failed")]
  if failed:
    lines += [
      "",
      "Failed runs (see train.log in each folder): " + ", ".join(r["run"] for r in failed),
    ]
  return "\n".join(lines) + "\n"


def scale_points(rows: Sequence[dict]) -> dict[str, dict[str, list[dict]]]:
  """{rule: {cell: [point per scale, by scale]}} for each radius rule that the finished runs of
  a grid cell cover at two scales or more; a point holds the scale, the delta, the seeds, and
  the mean over seeds of the final accuracy (with its 95% interval) and of the masked share
  (over the whole run: `masked_mean`, and the later mini-batches': `masked_late`), and the
  paired difference of the final accuracy to tv_mc at scale 1 (`vs_reference`: difference, its
  95% interval, seeds; None without that reference)."""
  done = [r for r in rows if r["status"] == "done" and r["cell"] in GRID]
  out: dict[str, dict[str, list[dict]]] = {}
  for rule in sorted({r["rule"] for r in done}):
    ours = [r for r in done if r["rule"] == rule]
    if len({r["scale"] for r in ours}) < 2:
      continue
    cells = sorted({r["cell"] for r in ours}, key=GRID.index)
    reference = {r["seed"]: r["final"] for r in ours if r["cell"] == REFERENCE and r["scale"] == 1}
    for cell in cells:
      for scale in sorted({r["scale"] for r in ours if r["cell"] == cell}):
        runs = [r for r in ours if r["cell"] == cell and r["scale"] == scale]
        m, lo, hi = stats.mean_ci([r["final"] for r in runs])
        point = {
          "scale": scale,
          "delta": float(np.mean([r["delta_low"] for r in runs])),
          "seeds": len(runs),
          "final": m,
          "final_lo": lo,
          "final_hi": hi,
          "masked_mean": float(np.nanmean([r["masked_mean"] for r in runs])),
          "masked_late": float(np.nanmean([r["masked_late"] for r in runs])),
          "vs_reference": None,
        }
        pairs = [(r["final"], reference[r["seed"]]) for r in runs if r["seed"] in reference]
        if pairs:
          x = np.asarray(pairs, np.float64)
          point["vs_reference"] = (*stats.paired_difference_ci(x[:, 0], x[:, 1]), len(pairs))
        out.setdefault(rule, {}).setdefault(cell, []).append(point)
  return out


def _scales_section(rows: Sequence[dict]) -> list[str]:
  """Per rule swept over scales: each cell's final accuracy beside its masked share at each
  scale, and the plot of one against the other."""
  lines = []
  for rule, cells in scale_points(rows).items():
    lines += [
      "",
      f"## Accuracy against masked share across scales ({rule})",
      "",
      "Each cell at each scale of its delta: the final accuracy (mean over seeds [95% CI]) and "
      "the share of tokens the trust region masked (mean over seeds of each run's mean over "
      "all its updates, and over the later mini-batches of its second half).",
      "",
      f"| cell | scale | delta | seeds | masked, whole run | masked, late | final [95% CI] "
      f"| final - {REFERENCE} x1 (paired) |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for cell, points in cells.items():
      for p in points:
        vs = ""
        if p["vs_reference"] is not None and not (cell == REFERENCE and p["scale"] == 1):
          d, lo, hi, n = p["vs_reference"]
          vs = _pct(d, lo, hi, sign=True) + f" (n={n})"
        lines.append(
          f"| {cell} | x{p['scale']:g} | {p['delta']:.4g} | {p['seeds']} "
          f"| {100 * p['masked_mean']:.2f}% | {100 * p['masked_late']:.2f}% "
          f"| {_pct(p['final'], p['final_lo'], p['final_hi'])} | {vs} |"
        )
    lines += ["", f"Plot: [final accuracy against masked share](plots/{rule}_scales.png)."]
  return lines


def _missed_section(rows: Sequence[dict], include_missed: bool) -> list[str]:
  """The starting policies whose supervised warm start ended below its target, one line each
  with the seeds that started from it, and whether the statistics count their runs."""
  starts: dict[Any, list[dict]] = {}
  for r in rows:
    if r["start_missed"]:
      starts.setdefault(r["start_seed"], []).append(r)
  if not starts:
    return []
  how = (
    "**counted** in the statistics below (`--include-missed-starts`)"
    if include_missed
    else "**left out** of every statistic and plot below (`--include-missed-starts` counts them)"
  )
  lines = [
    "",
    "## Warm starts that missed their target",
    "",
    "These starting policies ended their supervised warm start below its target accuracy, so "
    "RL did not start from the policy the comparison assumes; their runs are listed in runs.csv "
    f"(`start_missed`) and {how}.",
    "",
    "| start seed | held-out accuracy | target | seeds | runs |",
    "|---|---|---|---|---|",
  ]
  for start, runs in sorted(starts.items(), key=lambda kv: str(kv[0])):
    seeds = ", ".join(str(s) for s in sorted({r["seed"] for r in runs}, key=str))
    lines.append(
      f"| {start} | {_pct(runs[0]['start_accuracy'], unit='%')} "
      f"| {_pct(runs[0]['start_target'], unit='%')} "
      f"| {seeds} | {len(runs)} |"
    )
  return lines


def _cell_table(grows: Sequence[dict], cells_rows: dict[str, dict[int, dict]]) -> list[str]:
  ref = REFERENCE if REFERENCE in cells_rows else None
  lines = [
    f"| cell | delta | seeds | final [95% CI] | AUC [95% CI] | final - {REFERENCE} (paired) "
    f"| AUC - {REFERENCE} (paired) | masked | wall per run |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  order = [*GRID, NONE, *presets.names()]
  cells = sorted({r["cell"] for r in grows}, key=lambda c: order.index(c) if c in order else 99)
  for cell in cells:
    runs = [r for r in grows if r["cell"] == cell]
    fin = cells_rows.get(cell, {})
    lo, hi = runs[0]["delta_low"], runs[0]["delta_high"]
    delta = f"{lo:.4g}" if lo == hi else f"{lo:.4g} / {hi:.4g}"
    if (runs[0].get("calibration") or {}).get("matched") is False:
      delta += " (**not matched**)"
    cols = [cell, delta, f"{len(fin)}" + (f" of {len(runs)}" if len(runs) != len(fin) else "")]
    for metric, _ in METRICS:
      vals = [r[metric] for r in fin.values()]
      cols.append(_pct(*stats.mean_ci(vals)) if vals else "n/a")
    for metric, _ in METRICS:
      if ref is None or cell == ref or not fin:
        cols.append("")
        continue
      seeds, x = paired(cells_rows, [cell, ref], metric)
      if not seeds:
        cols.append("no common seed")
        continue
      d, dlo, dhi = stats.paired_difference_ci(x[:, 0], x[:, 1])
      cols.append(_pct(d, dlo, dhi, sign=True) + f" (n={len(seeds)})")
    masked = [r["masked_late"] for r in fin.values() if math.isfinite(r["masked_late"])]
    walls = [r["wall_s"] for r in runs if math.isfinite(r["wall_s"])]
    cols.append(f"{100 * np.mean(masked):.1f}%" if masked else "n/a")
    cols.append(duration(float(np.mean(walls))) if walls else "n/a")
    lines.append("| " + " | ".join(cols) + " |")
  return lines


def calibration_table(results: Sequence[dict]) -> list[str]:
  """equal_mask's calibration as a markdown table: per cell the delta found, the masked share
  (trust/masked_frac) of the first update it reached, the target (tv_mc's share) and whether it
  is within the tolerance; a cell not matched says why and runs at the closest delta found."""
  lines = [
    "| cell | delta | first-update masked share | target | matched |",
    "|---|---|---|---|---|",
  ]
  for r in results:
    matched = "reference" if r["cell"] == REFERENCE else ("yes" if r["matched"] else "**NO**")
    if r.get("note"):
      matched += f": {r['note']}"
    lines.append(
      f"| {r['cell']} | {r['delta']:.4g} | {100 * r['share']:.3f}% | {100 * r['target']:.3f}% "
      f"| {matched} |"
    )
  return lines


def _calibration_section(rows: Sequence[dict]) -> list[str]:
  """The calibration of a group's equal_mask cells (from their runs' records), or nothing."""
  order = [*GRID, NONE, *presets.names()]
  found: dict[str, dict] = {}
  for r in sorted(rows, key=lambda r: order.index(r["cell"]) if r["cell"] in order else 99):
    if r["rule"] == EQUAL_MASK and r.get("calibration"):
      found.setdefault(r["cell"], {"cell": r["cell"], **r["calibration"]})
  if not found:
    return []
  missed = [c for c, r in found.items() if not r["matched"]]
  head = (
    f"Radii calibrated ({EQUAL_MASK}): each cell's delta gives the masked share of the first "
    f"update (trust/masked_frac) of {REFERENCE} at its f_eps radius times the scale, within "
    f"{100 * next(iter(found.values())).get('tolerance', 0.1):.0f}% (relative)"
  )
  head += (
    f"; **not matched: {', '.join(missed)}** (they run at the closest delta found)."
    if missed
    else "; every cell matched."
  )
  return ["", head, "", *calibration_table(list(found.values()))]


# Columns of the diagnostics table: (heading, per-estimator metric under diag/<estimator>/).
DIAG_COLUMNS = (
  ("masked", "masked_frac"),
  ("q < 0.1", "masked_frac/q<0.1"),
  ("q 0.1-0.5", "masked_frac/q0.1-0.5"),
  ("q 0.5-0.9", "masked_frac/q0.5-0.9"),
  ("q >= 0.9", "masked_frac/q>=0.9"),
  ("agrees with exact", "mask_agree"),
  ("over-masks", "overmask"),
  ("under-masks", "undermask"),
)


def _diag_estimators(runs: Sequence[dict], field: str = "diag") -> list[str]:
  """The estimators whose diagnostics the runs logged: the paper's three first, then others."""
  found = {k.split("/")[0] for r in runs for k in r[field] if k.endswith("/mask_agree")}
  return [e for e in ESTIMATORS if e in found] + sorted(found - set(ESTIMATORS))


def _diag_pools(grows: Sequence[dict], field: str = "diag") -> list[tuple[str, list[dict]]]:
  """(label, finished grid runs with diagnostics) for each divergence that has any, one pool
  per radius: every estimator of a run is evaluated at that run's radius, so runs at different
  radii (`equal_mask` gives each cell its own) are not averaged together. The label is the
  divergence, with the radius and its cells when the divergence's runs have more than one."""
  pools = []
  for div in DIVERGENCES:
    runs = [
      r
      for r in grows
      if r["cell"] in GRID and r["divergence"] == div and r["status"] == "done" and r[field]
    ]
    if not _diag_estimators(runs, field):
      continue
    radii = sorted({(r["delta_low"], r["delta_high"]) for r in runs})
    for lo, hi in radii:
      here = [r for r in runs if (r["delta_low"], r["delta_high"]) == (lo, hi)]
      label = div
      if len(radii) > 1:
        delta = f"{lo:.3g}" if lo == hi else f"{lo:.3g}/{hi:.3g}"
        cells = ", ".join(sorted({r["cell"] for r in here}))
        label = f"{div} at delta {delta} ({cells})"
      pools.append((label, here))
  return pools


def _upper_divergence(label: str) -> str:
  """A pool's label with its divergence's name in capitals (`_diag_pools`)."""
  div, _, rest = label.partition(" ")
  return div.upper() + (" " + rest if rest else "")


def _diag_mean(runs: Sequence[dict], key: str, field: str = "diag") -> float:
  vals = [r[field][key] for r in runs if math.isfinite(r[field].get(key, math.nan))]
  return float(np.mean(vals)) if vals else math.nan


def _diagnostics_section(grows: Sequence[dict]) -> list[str]:
  """Per divergence: every estimator's masked share by behaviour-probability bucket and its
  agreement with the exact divergence's mask, pooled over the divergence's grid runs (in each
  run all estimators are evaluated on the same tokens), and MC - Atomic paired by run; after the
  update, and where the runs logged it (stale rollouts), before it."""
  lines: list[str] = []
  for field in DIAG_FIELDS:
    lines += _diagnostics_tables(grows, field)
  return lines


def _diagnostics_tables(grows: Sequence[dict], field: str) -> list[str]:
  lines: list[str] = []
  for div, runs in _diag_pools(grows, field):
    names = _diag_estimators(runs, field)
    if not lines:
      when = (
        "after each update (the policy it produced against the one that sampled the batch)"
        if field == "diag"
        else "before each update (stale rollouts: the learner against the older policy that "
        "sampled the batch, where the first optimizer step's mask acts)"
      )
      lines += [
        "",
        "### Why: each estimator's mask against the exact divergence's"
        + ("" if field == "diag" else ", before the update"),
        "",
        f"From the diagnostics (`diagnostics.every`), {when}: on the tokens of the rollout "
        "batches, the share of tokens each estimator would mask at the cell's radius, overall and "
        "by the behaviour probability q of the sampled token, beside the mask of the exact "
        "divergence over the full vocabulary; `agrees` is how often the two decisions are the "
        "same, `over-masks` the share masked by the estimator but not by the exact divergence. "
        "Each run's mean over its diagnostic steps, then the mean over the runs of the "
        "divergence at one radius (all its cells there: every estimator is evaluated on the "
        "same tokens in each run; where each cell has its own radius, as under `equal_mask`, "
        "a table per radius).",
      ]
    heads = [h for h, _ in DIAG_COLUMNS]
    lines += [
      "",
      f"{_upper_divergence(div)}, {len(runs)} run{'s' if len(runs) != 1 else ''}:",
      "",
      "| estimator | " + " | ".join(heads) + " |",
      "|---|" + "---|" * len(heads),
    ]
    for name in [*names, "exact"]:
      cols = [name]
      for _, metric in DIAG_COLUMNS:
        v = _diag_mean(runs, f"{name}/{metric}", field)
        cols.append(f"{100 * v:.2f}%" if math.isfinite(v) else "")
      lines.append("| " + " | ".join(cols) + " |")
    if "mc" in names and "atomic" in names:
      parts = []
      d = [r[field] for r in runs]
      for head, metric in DIAG_COLUMNS[:5]:
        keys = (f"mc/{metric}", f"atomic/{metric}")
        pairs = [(x[keys[0]], x[keys[1]]) for x in d if keys[0] in x and keys[1] in x]
        pairs = [p for p in pairs if all(map(math.isfinite, p))]
        if pairs:
          a, b = np.array(pairs).T
          parts.append(f"{head} {_pct(*stats.paired_difference_ci(a, b), sign=True)}")
      if parts:
        lines += ["", "MC - Atomic masked share, points (paired by run): " + "; ".join(parts) + "."]
  return lines


def _aligned(runs: Sequence[dict], xs: str, ys: str, smooth: int = 1):
  """(steps [points], values [seeds, points]) of the runs' series, cut to the shortest one and
  smoothed by a trailing moving average over `smooth` points."""
  n = min(len(r[ys]) for r in runs)
  if n == 0:
    return np.zeros(0), np.zeros((len(runs), 0))
  vals = np.array([r[ys][:n] for r in runs], np.float64)
  if smooth > 1:
    kernel = np.ones(smooth) / smooth
    vals = np.array([np.convolve(v, kernel, mode="valid") for v in vals])
    return np.asarray(runs[0][xs][smooth - 1 : n], np.float64), vals
  return np.asarray(runs[0][xs][:n], np.float64), vals


def _panels(cells: Sequence[str]) -> list[tuple[str, list[str]]]:
  """(title, cells) per panel: one per divergence of the grid cells, one for the rest."""
  out = []
  for d in DIVERGENCES:
    here = [c for c in cells if c in GRID and c.startswith(d + "_")]
    if here:
      out.append((d, here))
  rest = [c for c in cells if c not in GRID and c != NONE]
  if rest or not out:
    out.append(("presets" if rest else NONE, rest))
  return out


def _color(cell: str) -> str:
  if cell == NONE:
    return "0.45"
  if cell in GRID:
    return f"C{ESTIMATORS.index(cell.split('_', 1)[1])}"
  names = presets.names()
  return f"C{3 + names.index(cell) % 7}" if cell in names else "k"


def write_plots(
  plot_dir: str,
  rows: Sequence[dict],
  *,
  include_missed: bool = False,
  metric: str = DEFAULT_METRIC,
) -> list[str]:
  """Per radius setting: `<tag>_heatmap.png` (divergence x estimator, final and AUC accuracy),
  `<tag>_curves.png` (held-out accuracy along the run, mean over seeds with its 95% band) and
  `<tag>_masked.png` (masked fraction of the later mini-batches, smoothed, with its band) and,
  where the runs logged diagnostics, `<tag>_masked_by_q.png` (each estimator's masked share by
  behaviour probability beside the exact divergence's). Runs of a warm start that missed its
  target are left out unless `include_missed`. `metric` names the statistic on the axes."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(plot_dir, exist_ok=True)
  figure = "accuracy" if metric == DEFAULT_METRIC else metric  # (`metric` is reused below)
  curve_label = f"held-out {'greedy accuracy' if metric == DEFAULT_METRIC else metric} (%)"
  paths = []
  groups_all = groups(rows)
  rows = counted(rows, include_missed)
  for group in groups_all:
    tag = group_tag(group)
    cells_rows = by_cell(r for r in rows if in_group(r, group))
    order = [*GRID, NONE, *presets.names()]
    cells = sorted(cells_rows, key=lambda c: order.index(c) if c in order else 99)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, (metric, label) in zip(axes, METRICS, strict=True):
      grid = np.full((len(DIVERGENCES), len(ESTIMATORS)), np.nan)
      for i, d in enumerate(DIVERGENCES):
        for j, e in enumerate(ESTIMATORS):
          runs = cells_rows.get(f"{d}_{e}", {})
          if runs:
            m, lo, hi = stats.mean_ci([r[metric] for r in runs.values()])
            grid[i, j] = m
            band = f"\n[{100 * lo:.1f}, {100 * hi:.1f}]" if math.isfinite(lo) else ""
            ax.text(
              j,
              i,
              f"{100 * m:.1f}{band}\nn={len(runs)}",
              ha="center",
              va="center",
              fontsize=8,
              color="w" if m < np.nanmean(grid[np.isfinite(grid)]) else "k",
            )
          else:
            ax.text(j, i, "-", ha="center", va="center", color="0.5")
      im = ax.imshow(100 * np.ma.masked_invalid(grid), cmap="viridis", aspect="auto")
      fig.colorbar(im, ax=ax, label="%")
      ax.set_xticks(range(len(ESTIMATORS)), ESTIMATORS)
      ax.set_yticks(range(len(DIVERGENCES)), DIVERGENCES)
      ax.set_title(f"{label}\nmean over seeds [95% CI]", fontsize=9)
    fig.suptitle(f"Held-out {figure} per cell, radius {tag}")
    fig.tight_layout()
    paths.append(os.path.join(plot_dir, f"{tag}_heatmap.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    for kind, xs, ys, ylabel in (
      ("curves", "curve_steps", "curve", curve_label),
      ("masked", "masked_steps", "masked", "masked fraction, later mini-batches (%)"),
    ):
      panels = _panels(cells)
      width = max(7.0, 4.2 * len(panels))
      fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.8), squeeze=False)
      for ax, (title, members) in zip(axes[0], panels, strict=True):
        for cell in [*members, *([NONE] if NONE in cells_rows else [])]:
          runs = list(cells_rows[cell].values())
          longest = max(len(r[ys]) for r in runs)
          smooth = max(1, longest // 40) if kind == "masked" else 1
          steps, vals = _aligned(runs, xs, ys, smooth)
          if not steps.size:
            continue
          mean, lo, hi = stats.curve_band(vals, n_boot=2000)
          style = {"color": _color(cell), "ls": "--" if cell == NONE else "-"}
          ax.plot(steps, 100 * mean, label=f"{cell} (n={len(runs)})", lw=1.6, **style)
          if np.isfinite(lo).all():
            ax.fill_between(steps, 100 * lo, 100 * hi, color=style["color"], alpha=0.2, lw=0)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
      what = "mean over seeds, 95% band" + (", moving average" if kind == "masked" else "")
      fig.suptitle(
        f"{'Learning curves' if kind == 'curves' else 'Masked fraction'}, radius {tag} ({what})"
      )
      fig.tight_layout()
      paths.append(os.path.join(plot_dir, f"{tag}_{kind}.png"))
      fig.savefig(paths[-1], dpi=100)
      plt.close(fig)

    pools = _diag_pools([r for r in rows if in_group(r, group)])
    if pools:
      paths.append(os.path.join(plot_dir, f"{tag}_masked_by_q.png"))
      _plot_masked_by_q(plt, paths[-1], pools, tag)
  for rule, cells in scale_points(rows).items():
    paths.append(os.path.join(plot_dir, f"{rule}_scales.png"))
    _plot_scales(plt, paths[-1], cells, rule, curve_label.replace("held-out", "final held-out"))
  return paths


def _plot_scales(plt, path: str, cells: dict[str, list[dict]], rule: str, ylabel: str) -> None:
  """Final accuracy against the masked share over the whole run, one line per cell through its
  scales in order, each point labelled with its scale: as the paired difference to tv_mc at
  scale 1 with its 95% interval where every point has that reference (seeds whose starts differ
  widely make the unpaired intervals hide the differences), else the mean with its interval."""
  from matplotlib import ticker  # noqa: PLC0415 (matplotlib loads with the plots)

  every = [p for points in cells.values() for p in points]
  relative = all(p["vs_reference"] is not None for p in every)
  fig, ax = plt.subplots(figsize=(7.0, 4.6))
  for cell, points in cells.items():
    x = np.array([100 * p["masked_mean"] for p in points])
    if relative:
      y, lo, hi = (np.array([100 * p["vs_reference"][i] for p in points]) for i in range(3))
    else:
      y, lo, hi = (
        np.array([100 * p[k] for p in points]) for k in ("final", "final_lo", "final_hi")
      )
    bars = np.where(np.isfinite(lo), [y - lo, hi - y], 0.0)
    ax.errorbar(x, y, yerr=bars, color=_color(cell), marker="o", capsize=3, lw=1.4,
                label=f"{cell} (n={max(p['seeds'] for p in points)})")  # fmt: skip
    for p, xi, yi in zip(points, x, y, strict=True):
      ax.annotate(f"x{p['scale']:g}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                  fontsize=7, color=_color(cell))  # fmt: skip
  if relative:
    ax.axhline(0.0, color="0.5", lw=0.8, ls=":")
    ylabel = f"{ylabel.split(' (')[0]} - {REFERENCE} x1, paired by seed (points)"
  ax.set_xscale("log")
  plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 0.5, 1, 2 rather than 5 x 10^-1
  ax.xaxis.set_major_formatter(plain)
  ax.xaxis.set_minor_locator(ticker.LogLocator(subs=(2.0, 5.0)))
  ax.xaxis.set_minor_formatter(plain)
  ax.tick_params(axis="x", which="minor", labelsize=7)
  ax.set_xlabel("masked share of tokens, mean over the run (%, log scale)")
  ax.set_ylabel(ylabel, fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title(f"Final accuracy against masked share, delta scaled ({rule}); 95% CI", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _plot_masked_by_q(plt, path: str, pools: Sequence[tuple[str, list[dict]]], tag: str) -> None:
  """One panel per divergence: each estimator's masked share per behaviour-probability bucket,
  beside the exact divergence's (the diagnostics, mean over the divergence's runs)."""
  buckets = [(h, m) for h, m in DIAG_COLUMNS[1:5]]
  fig, axes = plt.subplots(1, len(pools), figsize=(max(6.0, 4.2 * len(pools)), 3.8), squeeze=False)
  for ax, (div, runs) in zip(axes[0], pools, strict=True):
    names = [*_diag_estimators(runs), "exact"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
      vals = [100 * _diag_mean(runs, f"{name}/{m}") for _, m in buckets]
      xs = np.arange(len(buckets)) + (i - (len(names) - 1) / 2) * width
      color = "0.3" if name == "exact" else f"C{i}"
      ax.bar(xs, vals, width, label=name, color=color)
    ax.set_xticks(range(len(buckets)), [h for h, _ in buckets], fontsize=8)
    ax.set_title(f"{div} ({len(runs)} runs)")
    ax.set_xlabel("behaviour probability of the sampled token")
    ax.set_ylabel("masked at the cell's radius (%)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"Masked share by behaviour probability, each estimator vs exact, radius {tag}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_outputs(
  out: str,
  sweep: dict | None = None,
  *,
  include_missed: bool = False,
  metric: str | None = None,
) -> dict[str, Any]:
  """runs.csv, results.md and plots/ of the run folders under `out`; returns their paths. The
  runs of warm starts that missed their target are listed apart and counted in the statistics
  only with `include_missed`. The statistic is `metric` if given, else the sweep's (sweep.json's
  `metric`; greedy accuracy when it has none)."""
  sweep = sweep if sweep is not None else (read_json(os.path.join(out, SWEEP_FILE)) or {})
  metric = parse_metric(metric if metric is not None else sweep.get("metric"))
  if metric != parse_metric(sweep.get("metric")):
    sweep = {**sweep, "metric": metric}
  rows = collect(out, metric)
  if not rows:
    raise errors.MissingFileError(f"no sweep runs under {os.path.join(out, 'runs')}")
  write_runs_csv(os.path.join(out, "runs.csv"), rows)
  files.write_atomic(
    os.path.join(out, "results.md"), results_markdown(rows, sweep, include_missed=include_missed)
  )
  plots = write_plots(
    os.path.join(out, "plots"), rows, include_missed=include_missed, metric=metric
  )
  return {
    "runs_csv": os.path.join(out, "runs.csv"),
    "results_md": os.path.join(out, "results.md"),
    "plots": plots,
    "runs": len(rows),
    "finished": sum(r["status"] == "done" for r in rows),
    "missed_starts": sorted({str(r["start_seed"]) for r in rows if r["start_missed"]}),
  }
