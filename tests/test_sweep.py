"""python -m gppo_jax.sweep and gppo_jax.research.stats: statistics on known cases, the commands a
sweep launches, reading run folders back, the outputs, resuming, and one real tiny sweep."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import warnings

import conftest
import numpy as np
import pytest

from gppo_jax import errors, sweep
from gppo_jax.algorithm import presets, theory
from gppo_jax.research import report as report
from gppo_jax.research import stats as st

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- Statistics ---------------------------------------------------------------------------------


def test_auc_is_the_mean_height_of_the_curve():
  assert st.auc([0, 50, 100], [0.3, 0.3, 0.3]) == pytest.approx(0.3)
  assert st.auc([0, 400], [0.2, 0.6]) == pytest.approx(0.4)  # a straight line: the midpoint
  # Unequal spacing weighs each segment by its length: (0.5 * 10 + 1.0 * 30) / 40.
  assert st.auc([0, 10, 40], [0.0, 1.0, 1.0]) == pytest.approx(35 / 40)
  assert st.auc([7], [0.25]) == 0.25
  with pytest.raises(ValueError):
    st.auc([0, 0], [1, 1])


def test_interval_of_a_constant_sample_is_a_point_and_one_seed_has_none():
  assert st.mean_ci([0.4] * 6) == pytest.approx((0.4, 0.4, 0.4))
  mean, lo, hi = st.mean_ci([0.4])
  assert mean == 0.4 and math.isnan(lo) and math.isnan(hi)
  d, dlo, dhi = st.paired_difference_ci([0.5, 0.6, 0.9], [0.4, 0.5, 0.8])
  assert (d, dlo, dhi) == pytest.approx((0.1, 0.1, 0.1))  # a constant difference: a point


def test_bootstrap_interval_covers_a_normal_mean_about_95_percent():
  rng = np.random.default_rng(7)
  draws, n, mu = 400, 40, 0.5
  hits = 0
  for i in range(draws):
    _, lo, hi = st.mean_ci(rng.normal(mu, 0.1, n), n_boot=1000, seed=i)
    hits += lo <= mu <= hi
  # Percentile bootstrap at 40 seeds: about 0.94 (2000 draws); the binomial sd here is 0.012.
  assert 0.90 <= hits / draws <= 0.98, hits / draws


def test_paired_interval_is_narrower_on_correlated_data():
  rng = np.random.default_rng(0)
  seed_effect = rng.normal(0.5, 0.1, 12)  # what both cells share through the seed
  a = seed_effect + 0.03 + rng.normal(0, 0.01, 12)
  b = seed_effect + rng.normal(0, 0.01, 12)
  d, lo, hi = st.paired_difference_ci(a, b)
  du, ulo, uhi = st.unpaired_difference_ci(a, b)
  assert d == pytest.approx(du)
  assert (hi - lo) < 0.3 * (uhi - ulo), (hi - lo, uhi - ulo)
  assert lo > 0 and ulo < 0  # pairing resolves a difference the unpaired interval cannot


def test_paired_interval_is_scipys_and_skips_resamples_where_the_statistic_is_undefined():
  from scipy import stats as sp

  rng = np.random.default_rng(3)
  shared = rng.normal(size=12)  # what two cells share through a seed
  a, b = shared + rng.normal(0.5, 0.3, 12), shared + rng.normal(0.0, 0.3, 12)
  point, lo, hi = st.paired_difference_ci(a, b)
  ref = sp.bootstrap(
    (a, b), lambda x, y, axis: np.mean(x - y, axis=axis), paired=True, vectorized=True,
    method="percentile", n_resamples=st.N_BOOT, rng=np.random.default_rng(0),
  ).confidence_interval  # fmt: skip
  width = hi - lo
  assert point == pytest.approx(np.mean(a - b))
  assert abs(lo - ref.low) < 0.05 * width and abs(hi - ref.high) < 0.05 * width
  # A relative gain over a baseline whose mean is 0 on some resamples: scipy's interval is NaN,
  # ours leaves those resamples out.
  x = np.array([[0.3, 0.0], [0.4, 0.0], [0.5, 0.2], [0.2, 0.1], [0.6, 0.3]])
  _, lo, hi = st.relative_gain_ci(x, [(0, 1)])
  assert np.isfinite(lo) and np.isfinite(hi) and lo < hi
  gain = lambda p, q, axis: st.relative_gain(np.stack([p.mean(axis), q.mean(axis)], -1), [(0, 1)])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # scipy warns that the interval cannot be computed
    ref = sp.bootstrap(
      (x[:, 0], x[:, 1]), gain, paired=True, vectorized=True, method="percentile",
      rng=np.random.default_rng(0),
    ).confidence_interval  # fmt: skip
  assert np.isnan(ref.low) or np.isnan(ref.high)


def test_relative_gains_average_over_pairs():
  means = np.array([0.6, 0.5, 0.3, 0.2])  # cells 0 over 1: +20%; cell 2 over 3: +50%
  assert st.relative_gain(means, [(0, 1), (2, 3)]) == pytest.approx(0.35)
  x = np.array([[0.6, 0.5, 0.3, 0.2], [0.6, 0.5, 0.3, 0.2]])
  assert st.relative_gain_ci(x, [(0, 1), (2, 3)]) == pytest.approx((0.35, 0.35, 0.35))
  assert math.isnan(float(st.relative_gain(np.array([0.5, 0.0]), [(0, 1)])))


def test_curve_band_brackets_the_mean():
  curves = np.array([[0.1, 0.2, 0.5], [0.1, 0.4, 0.6], [0.1, 0.3, 0.4]])
  mean, lo, hi = st.curve_band(curves, n_boot=500)
  np.testing.assert_allclose(mean, [0.1, 0.3, 0.5])
  assert lo[0] == hi[0] == pytest.approx(0.1)  # every seed equal there
  assert np.all(lo <= mean) and np.all(mean <= hi) and hi[1] - lo[1] > 0


# --- Axes and commands --------------------------------------------------------------------------


def _settings(tmp_path, **kw) -> sweep.Settings:
  return sweep.Settings(out=str(tmp_path), **kw)


def _arg(cmd, name):
  hits = [c.split("=", 1)[1] for c in cmd if c.startswith(f"--config.{name}=")]
  assert len(hits) == 1, (name, cmd)
  return hits[0]


def test_parse_axes():
  assert sweep.parse_cells("grid,none,dppo,kl_atomic") == [*sweep.GRID, "none", "dppo"]
  assert sweep.parse_seeds("0-2,5,1") == [0, 1, 2, 5]
  assert sweep.parse_scales("0.5,1,1") == [0.5, 1.0]
  assert sweep.parse_overrides(["optim.lr=3e-4", "--config.iterations=2"]) == (
    "optim.lr=3e-4",
    "iterations=2",
  )
  for bad in (
    lambda: sweep.parse_cells("kl_atomc"),
    lambda: sweep.parse_seeds("3-1"),
    lambda: sweep.parse_rules("equal_kl"),
    lambda: sweep.parse_scales("0"),
    lambda: sweep.parse_overrides(["optim.lrr=1"]),
    lambda: sweep.parse_overrides(["optim.lr"]),
  ):
    with pytest.raises(errors.ConfigError):
      bad()


def test_runs_are_seed_major_and_none_and_presets_are_not_repeated():
  runs = sweep.expand(["kl_atomic", "none", "dppo"], ["f_eps", "equal_tv"], [1.0, 0.5], [0, 1])
  names = [r.name for r in runs]
  assert len(names) == len(set(names)) == 2 * (4 + 1 + 2)  # kl_atomic 2x2, none 1, dppo 2 scales
  assert [r.seed for r in runs] == sorted(r.seed for r in runs)
  assert "none__inf__s0" in names and "dppo__own_x0.5__s1" in names
  assert "kl_atomic__equal_tv_x0.5__s0" in names


def test_commands_state_the_cell_the_radius_the_seeds_and_the_overrides(tmp_path):
  s = _settings(tmp_path, overrides=("optim.lr=1e-3",))
  cmd = sweep.command(sweep.Run(3, "f_eps", 1.0, "kl_atomic"), s)
  assert cmd[1:3] == ["-m", "gppo_jax.train"] and cmd[3].endswith(
    os.path.join("configs", "base.py")
  )
  assert _arg(cmd, "seed") == "3" and _arg(cmd, "warmstart.seed") == "3"  # per-seed start
  assert (_arg(cmd, "loss.divergence"), _arg(cmd, "loss.estimator")) == ("kl", "atomic")
  assert (
    float(_arg(cmd, "loss.delta_low"))
    == presets.default_delta("kl")
    == pytest.approx(0.0231, rel=1e-2)
  )
  assert cmd[-1] == "--config.optim.lr=1e-3"  # the sweep's overrides come last
  assert f"--workdir={tmp_path / 'runs' / 'kl_atomic__f_eps_x1__s3'}" in cmd
  shared = sweep.command(
    sweep.Run(3, "f_eps", 1.0, "kl_atomic"), _settings(tmp_path, start="shared")
  )
  assert _arg(shared, "seed") == "3" and _arg(shared, "warmstart.seed") == "0"
  # none: PPO's clip with an infinite radius; a preset: its loss and advantage.
  none = sweep.command(sweep.Run(0, sweep.INF, 1.0, "none"), s)
  assert (_arg(none, "loss.divergence"), _arg(none, "loss.estimator")) == ("tv", "mc")
  assert float(_arg(none, "loss.delta_low")) == float(_arg(none, "loss.delta_high")) == math.inf
  dppo = sweep.command(sweep.Run(0, sweep.OWN, 2.0, "dppo"), s)
  assert float(_arg(dppo, "loss.delta_low")) == pytest.approx(0.3)  # 2 x its own 0.15
  assert _arg(dppo, "loss.aggregation") == "seq-mean-token-sum-norm"
  assert _arg(dppo, "advantage.name") == "dr_grpo"
  assert not any("aggregation" in c or "advantage" in c for c in cmd)  # the base's already


def test_equal_tv_radii_match_the_reference_cells_tv_radius(tmp_path):
  for scale in (1.0, 0.5):
    ref = float(theory.tv_radius("tv", scale * presets.default_delta("tv")))
    assert ref == pytest.approx(0.1 * scale)
    for cell in ("tv_mc", "kl_atomic", "hellinger_binary", "chi2_mc"):
      low, high = sweep.radii(sweep.Run(0, "equal_tv", scale, cell))
      assert low == high
      assert theory.tv_radius(cell.split("_")[0], low) == pytest.approx(ref, rel=1e-6)
  # TV and chi^2 share f(0.8)'s TV radius (0.1); KL and Hellinger get smaller radii than f(0.8).
  assert sweep.radii(sweep.Run(0, "equal_tv", 1.0, "tv_mc"))[0] == pytest.approx(0.1)
  assert sweep.radii(sweep.Run(0, "equal_tv", 1.0, "chi2_mc"))[0] == pytest.approx(0.04)
  assert sweep.radii(sweep.Run(0, "equal_tv", 1.0, "kl_mc"))[0] == pytest.approx(0.02004, rel=1e-3)
  assert sweep.radii(sweep.Run(0, "f_eps", 0.5, "kl_mc"))[0] == pytest.approx(
    0.5 * presets.default_delta("kl")
  )


def test_bad_command_line_is_one_error_line_and_exit_2():
  p = subprocess.run(
    [sys.executable, "-m", "gppo_jax.sweep", "--dry-run", "--cells", "kl_atomc"],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip().splitlines() == [p.stderr.strip()]
  assert p.stderr.startswith("error: unknown sweep cell 'kl_atomc'") and "kl_atomic" in p.stderr


# --- Run folders: fakes -------------------------------------------------------------------------


def fake_run(
  out,
  run: sweep.Run,
  curve,
  masked,
  *,
  settings=None,
  finished=True,
  seconds=9.0,
  diag=None,
  start=None,
  sampled=None,
):
  """A run folder as train and the sweep leave it: record, config, metrics, summary; `diag`
  ({metric: value}) is logged as diag/<metric> every 10 steps; `start` is the summary's
  warm_start (the warm start's info); `sampled` an eval/avg@4 curve beside the greedy one."""
  settings = settings or sweep.Settings(out=str(out))
  path = sweep.run_dir(str(out), run)
  os.makedirs(path, exist_ok=True)
  record = {
    "run": {"seed": run.seed, "rule": run.rule, "scale": run.scale, "cell": run.cell},
    "start_seed": settings.start_seed(run.seed),
    "train_args": sweep.train_args(run, settings),
    "attempts": 1,
    "wall_s": seconds,
    "exit": 0,
  }
  if run.rule == sweep.EQUAL_MASK:
    record["calibration"] = settings.calibration[run.cell, run.scale]
  json.dump(record, open(os.path.join(path, sweep.RECORD), "w"))
  preset = sweep._preset(run.cell)
  low, high = sweep.radii(run, settings.eps, settings.calibration)
  config = {
    "seed": run.seed,
    "iterations": 50 * (len(curve) - 1),
    "task": {"name": "addsub3"},
    "loss": {"divergence": preset.loss.divergence, "estimator": preset.loss.estimator},
    "rollout": {"prompts_per_iter": 64, "group_size": 8},
    "train": {"epochs": 2, "minibatches": 4},
    "optim": {"lr": 3e-4},
    "eval": {"every": 50, "num_problems": 512},
    "warmstart": {"seed": settings.start_seed(run.seed), "target_accuracy": 0.3},
  }
  config["loss"].update(delta_low=low, delta_high=high)
  json.dump(config, open(os.path.join(path, "config.json"), "w"))

  def evals(i):
    out = {"eval/accuracy": curve[i]}
    if sampled is not None:
      out.update({"eval/avg@4": sampled[i], "eval/avg@4_se": 0.01, "eval/pass@4": 0.9})
    return out

  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, **evals(0)}) + "\n")
    for step in range(1, config["iterations"] + 1):
      line = {"step": step, "trust/masked_frac_late": masked, "trust/masked_frac": 2 * masked}
      if step % 50 == 0:
        line.update(evals(step // 50))
      if diag and step % 10 == 0:
        line.update({k if k.startswith("diag_start/") else f"diag/{k}": v for k, v in diag.items()})
        line["diag/ratio_hist"] = [1, 2, 3]  # a histogram: not a figure to average
      f.write(json.dumps(line) + "\n")
  if finished:
    summary = {
      "preempted": False,
      "initial_eval": evals(0),
      "final_eval": evals(-1),
      "seconds": seconds,
      "warm_start": start or {},
    }
    json.dump(summary, open(os.path.join(path, "summary.json"), "w"))
  return path


def test_a_run_folder_reads_back(tmp_path):
  run = sweep.Run(1, "f_eps", 1.0, "kl_atomic")
  path = fake_run(tmp_path, run, [0.3, 0.5, 0.9], 0.06, seconds=12.5)
  r = report.read_run(path)
  assert (r["cell"], r["divergence"], r["estimator"], r["seed"], r["status"]) == (
    "kl_atomic",
    "kl",
    "atomic",
    1,
    "done",
  )
  assert (r["initial"], r["final"], r["best"]) == (0.3, 0.9, 0.9)
  assert r["auc"] == pytest.approx((0.4 + 0.7) / 2)  # trapezoids over 0-50-100
  assert r["masked_late"] == pytest.approx(0.06) and r["wall_s"] == 12.5
  assert r["curve_steps"] == [0, 50, 100] and len(r["masked"]) == 100
  assert r["delta_low"] == pytest.approx(presets.default_delta("kl"))
  unfinished = report.read_run(
    fake_run(tmp_path, sweep.Run(2, "f_eps", 1.0, "kl_atomic"), [0.3, 0.4], 0.05, finished=False)
  )
  assert unfinished["status"] == "unfinished" and math.isnan(unfinished["final"])


def _fake_grid(out, seeds=(0, 1, 2, 3), starts=None):
  """12 cells + none: tv_mc varies by seed; every other cell is tv_mc plus a fixed offset, so
  paired differences are exact and unpaired intervals are wide. starts: {seed: warm_start}."""
  base = {0: 0.40, 1: 0.50, 2: 0.60, 3: 0.70}
  offsets = {c: 0.01 * i for i, c in enumerate(sweep.GRID)}
  offsets["kl_atomic"] = 0.05
  offsets["none"] = -0.2
  for seed in seeds:
    for cell in [*sweep.GRID, "none"]:
      run = (
        sweep.Run(seed, sweep.INF, 1.0, cell)
        if cell == "none"
        else sweep.Run(seed, "f_eps", 1.0, cell)
      )
      final = base[seed] + offsets[cell]
      curve = [0.33, (0.33 + final) / 2, final]
      start = (starts or {}).get(seed)
      fake_run(out, run, curve, 0.0 if cell == "none" else 0.05, start=start)


def test_outputs_from_run_folders(tmp_path):
  _fake_grid(tmp_path)
  paths = report.write_outputs(str(tmp_path), {"overrides": [], "start": "per_seed", "eps": 0.2})
  assert paths["runs"] == paths["finished"] == 13 * 4
  rows = list(csv.DictReader(open(paths["runs_csv"])))
  assert len(rows) == 52 and set(report.CSV_FIELDS) == set(rows[0])
  kl = [r for r in rows if r["cell"] == "kl_atomic"]
  assert sorted(float(r["final"]) for r in kl) == pytest.approx([0.45, 0.55, 0.65, 0.75])
  assert all(r["status"] == "done" and float(r["wall_s"]) == 9.0 for r in rows)
  text = open(paths["results_md"]).read()
  # kl_atomic: mean 60.0, its seeds spread the unpaired interval; the paired one is a point.
  kl_line = next(x for x in text.splitlines() if x.startswith("| kl_atomic |"))
  cols = [c.strip() for c in kl_line.strip("|").split("|")]
  assert cols[2] == "4" and cols[3].startswith("60.0 [") and cols[3] != "60.0 [60.0, 60.0]"
  assert cols[5] == "+5.0 [+5.0, +5.0] (n=4)" and cols[7] == "5.0%"
  none_line = next(x for x in text.splitlines() if x.startswith("| none |"))
  assert "-20.0 [-20.0, -20.0] (n=4)" in none_line and "| inf |" in none_line
  # The paper's comparisons: KL-Atomic over TV-MC is the ratio of mean finals 0.60 / 0.55.
  claim = next(x for x in text.splitlines() if x.startswith("| KL-Atomic vs TV-MC"))
  assert "+49.8% / +13.9%" in claim and "| 4 |" in claim
  gain = 0.60 / 0.55 - 1
  assert f"{100 * gain:+.1f}%" in claim and "higher" in claim
  for name in ("Atomic vs MC, averaged", "Binary vs MC, averaged", "KL vs TV under MC"):
    assert f"| {name}" in text
  assert "| atomic vs MC (4 divergences) |" in text and "| kl vs TV (3 estimators) |" in text
  assert "Wall time: 7 min 48 s summed over runs" in text  # 52 x 9 s
  for p in paths["plots"]:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 10_000


def test_a_scale_sweep_reports_accuracy_against_masked_share(tmp_path):
  """--scales: each cell's final accuracy beside its masked share at each scale (mean over
  seeds of each run's mean over all updates), in a table and one plot; a single scale has none."""
  masked = {0.5: 0.02, 1.0: 0.01, 2.0: 0.005}
  for seed in (0, 1, 2):
    for cell, offset in (("tv_mc", 0.0), ("kl_atomic", 0.1)):
      for scale, m in masked.items():
        final = 0.3 + offset + 0.1 * scale + 0.01 * seed
        fake_run(tmp_path, sweep.Run(seed, "f_eps", scale, cell), [0.3, final], m)
  paths = report.write_outputs(str(tmp_path), {"start": "per_seed"})
  text = open(paths["results_md"]).read()
  assert "## Accuracy against masked share across scales (f_eps)" in text
  rows = [x for x in text.splitlines() if x.startswith("| kl_atomic | x")]
  assert [r.split("|")[2].strip() for r in rows] == ["x0.5", "x1", "x2"]
  # kl_atomic at x2: final 0.3 + 0.1 + 0.2 + mean seed 0.01 = 61.0%; masked 2 x 0.005 whole run.
  cols = [c.strip() for c in rows[2].strip("|").split("|")]
  assert cols[3] == "3" and cols[4] == "1.00%" and cols[5] == "0.50%"
  assert cols[6].startswith("61.0 [")
  # Paired by seed with tv_mc at x1 (0.4 + 0.01 seed): +0.2 exactly on every seed.
  assert cols[7] == "+20.0 [+20.0, +20.0] (n=3)"
  points = report.scale_points(report.collect(str(tmp_path)))
  assert [p["masked_mean"] for p in points["f_eps"]["tv_mc"]] == pytest.approx([0.04, 0.02, 0.01])
  plot = os.path.join(str(tmp_path), "plots", "f_eps_scales.png")
  assert plot in paths["plots"] and os.path.getsize(plot) > 10_000
  # One scale: no such section or plot.
  _fake_grid(tmp_path / "one")
  one = report.write_outputs(str(tmp_path / "one"), {"start": "per_seed"})
  assert "across scales" not in open(one["results_md"]).read()
  assert not any(p.endswith("_scales.png") for p in one["plots"])


def test_diagnostics_table_pools_a_divergences_runs_and_pairs_mc_with_atomic(tmp_path):
  for seed in range(4):
    for cell in ("kl_mc", "kl_atomic", "none"):
      diag = {
        "mc/masked_frac/q<0.1": 0.50 + 0.01 * seed,
        "mc/mask_agree": 0.90,
        "atomic/masked_frac/q<0.1": 0.20,
        "atomic/mask_agree": 0.95,
        "exact/masked_frac/q<0.1": 0.25,
      }
      if seed < 2:  # stale rollouts: the same figures before the update
        diag["diag_start/mc/mask_agree"] = 0.8
        diag["diag_start/atomic/mask_agree"] = 0.7
      if cell == "none":  # an infinite radius masks nothing: not pooled with the KL cells
        diag = {k: 0.0 for k in diag}
      rule = sweep.INF if cell == "none" else "f_eps"
      fake_run(tmp_path, sweep.Run(seed, rule, 1.0, cell), [0.3, 0.5, 0.6], 0.05, diag=diag)
  row = report.read_run(sweep.run_dir(str(tmp_path), sweep.Run(2, "f_eps", 1.0, "kl_mc")))
  assert row["diag"]["mc/masked_frac/q<0.1"] == pytest.approx(0.52)
  assert "ratio_hist" not in row["diag"]
  text = report.results_markdown(report.collect(str(tmp_path)))
  assert "KL, 8 runs:" in text and "TV," not in text
  lines = text.splitlines()
  mc = [c.strip() for c in next(x for x in lines if x.startswith("| mc |")).strip("|").split("|")]
  assert mc[2] == "51.50%" and mc[6] == "90.00%"  # q < 0.1 (mean of 0.50-0.53), agreement
  exact = next(x for x in lines if x.startswith("| exact |"))
  assert "| 25.00% |" in exact
  paired = next(x for x in lines if x.startswith("MC - Atomic"))
  assert "q < 0.1 +31.5 [" in paired  # 51.5 - 20.0 points, paired over the 8 runs
  assert row["diag_start"] == {} and "diag_start/mc/mask_agree" not in row["diag"]
  before = text[
    text.index("### Why: each estimator's mask against the exact divergence's, before") :
  ]
  assert "KL, 4 runs:" in before  # the runs that logged it
  assert [x for x in before.splitlines() if x.startswith("| mc |")][0].split("|")[7] == " 80.00% "
  plot = os.path.join(tmp_path, "plots", "f_eps_x1_masked_by_q.png")
  assert plot in report.write_plots(os.path.join(tmp_path, "plots"), report.collect(str(tmp_path)))
  with open(plot, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_diagnostics_under_equal_mask_pool_each_radius_apart(tmp_path):
  """equal_mask gives each cell its own delta, and a run's diagnostics evaluate every estimator
  at its own radius: the report pools a divergence's runs per radius, one table each."""
  found = {
    (cell, 1.0): {"delta": delta, "share": 0.01, "target": 0.01, "matched": True}
    for cell, delta in (("tv_mc", 0.1), ("kl_mc", 0.02), ("kl_atomic", 0.08))
  }
  settings = dataclasses.replace(sweep.Settings(out=str(tmp_path)), calibration=found)
  for seed in range(3):
    for cell, share in (("kl_mc", 0.30), ("kl_atomic", 0.10)):
      diag = {"mc/masked_frac": share, "mc/mask_agree": 0.9, "atomic/masked_frac": share / 2,
              "atomic/mask_agree": 0.9, "exact/masked_frac": share}  # fmt: skip
      run = sweep.Run(seed, sweep.EQUAL_MASK, 1.0, cell)
      fake_run(tmp_path, run, [0.3, 0.5], 0.01, settings=settings, diag=diag)
  text = report.results_markdown(report.collect(str(tmp_path)))
  assert "KL, 6 runs:" not in text
  small = text.index("KL at delta 0.02 (kl_mc), 3 runs:")
  large = text.index("KL at delta 0.08 (kl_atomic), 3 runs:")
  mc = lambda at: text[at:].split("| mc |", 1)[1].split("|")[0].strip()
  assert mc(small) == "30.00%" and mc(large) == "10.00%"  # each radius's own runs


def _table_line(text, cell):
  line = next(x for x in text.splitlines() if x.startswith(f"| {cell} |"))
  return [c.strip() for c in line.strip("|").split("|")]


def test_a_seed_whose_warm_start_missed_its_target_is_listed_and_left_out(tmp_path):
  """Seed 1's start ended below its target: listed apart, out of every statistic unless asked.
  Seed 3's summary predates the missed_target field: judged from its accuracy and the config's
  target (0.3), and in time."""
  ok = {"accuracy": 0.32, "steps": 900, "target_accuracy": 0.3, "missed_target": False}
  missed = {"accuracy": 0.086, "steps": 3000, "target_accuracy": 0.3, "missed_target": True}
  starts = {0: ok, 1: missed, 2: ok, 3: {"accuracy": 0.31, "steps": 1000}}
  _fake_grid(tmp_path, starts=starts)
  rows = report.collect(str(tmp_path))
  assert {r["seed"] for r in rows if r["start_missed"]} == {1}
  assert [r["seed"] for r in report.counted(rows)] == [s for s in (0, 2, 3) for _ in range(13)]
  assert len(report.counted(rows, include_missed=True)) == 52

  paths = report.write_outputs(str(tmp_path), {"start": "per_seed"})
  assert paths["missed_starts"] == ["1"]
  csv_rows = list(csv.DictReader(open(paths["runs_csv"])))
  assert {r["seed"] for r in csv_rows if r["start_missed"] == "True"} == {"1"}
  text = open(paths["results_md"]).read()
  section = text[text.index("## Warm starts that missed their target") :]
  assert "| 1 | 8.6% | 30.0% | 1 | 13 |" in section and "**left out**" in section
  # kl_atomic - tv_mc is +5 on every seed; kl_atomic's mean over seeds 0, 2, 3 is 0.616...
  kl = _table_line(text, "kl_atomic")
  assert kl[2] == "3 of 4" and kl[5] == "+5.0 [+5.0, +5.0] (n=3)"
  assert kl[3].startswith(f"{100 * np.mean([0.45, 0.65, 0.75]):.1f} [")
  claim = next(x for x in text.splitlines() if x.startswith("| KL-Atomic vs TV-MC"))
  assert "| 3 |" in claim

  text = report.results_markdown(rows, include_missed=True)
  assert "**counted**" in text
  kl = _table_line(text, "kl_atomic")
  assert kl[2] == "4" and kl[5] == "+5.0 [+5.0, +5.0] (n=4)"
  assert kl[3].startswith("60.0 [")

  # Every start made its target: no section, every seed counted.
  _fake_grid(tmp_path, starts=dict.fromkeys(range(4), ok))
  text = report.results_markdown(report.collect(str(tmp_path)))
  assert "missed their target" not in text and _table_line(text, "kl_atomic")[2] == "4"


def test_the_sweep_counts_missed_starts_when_asked(tmp_path):
  missed = {"accuracy": 0.1, "steps": 3000, "target_accuracy": 0.3, "missed_target": True}
  _fake_grid(tmp_path, seeds=(0, 1, 2), starts={2: missed})
  assert sweep.main(["--report-only", "--out", str(tmp_path)]) == 0
  assert _table_line((tmp_path / "results.md").read_text(), "kl_atomic")[2] == "2 of 3"
  args = ["--report-only", "--include-missed-starts", "--out", str(tmp_path)]
  assert sweep.main(args) == 0
  assert _table_line((tmp_path / "results.md").read_text(), "kl_atomic")[2] == "3"


def test_report_only_rebuilds_outputs(tmp_path):
  _fake_grid(tmp_path, seeds=(0, 1))
  assert sweep.main(["--report-only", "--out", str(tmp_path)]) == 0
  for name in ("runs.csv", "results.md", "plots/f_eps_x1_heatmap.png", "plots/f_eps_x1_curves.png"):
    assert os.path.exists(tmp_path / name), name
  assert "| KL-Atomic vs TV-MC" in (tmp_path / "results.md").read_text()


def _two_cells(out):
  """kl_atomic and tv_mc, seeds 0-1: kl_atomic is 10 points ahead in greedy accuracy and 10
  behind in avg@4 (eval/avg@4, sampled), so the two statistics rank the cells oppositely."""
  for seed in (0, 1):
    for cell, greedy, avg in (("kl_atomic", 0.7, 0.3), ("tv_mc", 0.6, 0.4)):
      g, a = greedy + 0.1 * seed, avg + 0.1 * seed
      run = sweep.Run(seed, "f_eps", 1.0, cell)
      fake_run(out, run, [0.2, g - 0.1, g], 0.05, sampled=[0.1, a - 0.1, a])


def test_the_report_ranks_cells_by_the_chosen_metric(tmp_path):
  _two_cells(tmp_path)
  # The default: greedy accuracy, as before --metric.
  assert sweep.main(["--report-only", "--out", str(tmp_path)]) == 0
  text = (tmp_path / "results.md").read_text()
  assert "Accuracy is greedy held-out accuracy in percent;" in text
  assert _table_line(text, "kl_atomic")[3].startswith("75.0 [")
  assert _table_line(text, "kl_atomic")[5] == "+10.0 [+10.0, +10.0] (n=2)"
  # avg@4: every figure is the sampled accuracy's, and the ranking turns around.
  assert sweep.main(["--report-only", "--metric", "avg@4", "--out", str(tmp_path)]) == 0
  text = (tmp_path / "results.md").read_text()
  assert "Accuracy is held-out avg@4 (`eval/avg@4`: mean correctness of 4 sampled" in text
  assert "greedy held-out accuracy" not in text
  assert _table_line(text, "kl_atomic")[3].startswith("35.0 [")
  assert _table_line(text, "tv_mc")[3].startswith("45.0 [")
  assert _table_line(text, "kl_atomic")[5] == "-10.0 [-10.0, -10.0] (n=2)"
  rows = {(r["cell"], r["seed"]): r for r in csv.DictReader(open(tmp_path / "runs.csv"))}
  r = rows["kl_atomic", "1"]
  assert (float(r["initial"]), float(r["final"]), float(r["best"])) == (0.1, 0.4, 0.4)
  assert float(r["auc"]) == pytest.approx((0.2 + 0.35) / 2)
  # The same through the key as logged, and through sweep.json's metric.
  assert report.read_run(sweep.run_dir(str(tmp_path), sweep.Run(1, "f_eps", 1.0, "kl_atomic")),
                         report.parse_metric("eval/avg@4"))["final"] == 0.4  # fmt: skip
  json.dump({"metric": "avg@4"}, open(tmp_path / "sweep.json", "w"))
  assert sweep.main(["--report-only", "--out", str(tmp_path)]) == 0
  assert _table_line((tmp_path / "results.md").read_text(), "tv_mc")[3].startswith("45.0 [")


def test_a_metric_the_runs_did_not_log_is_a_clear_error(tmp_path):
  _two_cells(tmp_path)
  with pytest.raises(errors.ConfigError, match="kl_atomic__f_eps_x1__s0") as e:
    sweep.main(["--report-only", "--metric", "avg@16", "--out", str(tmp_path)])
  assert "eval/avg@16" in str(e.value) and "accuracy, avg@4, pass@4" in str(e.value)
  with pytest.raises(errors.ConfigError, match="--metric"):
    report.parse_metric("reward")
  assert report.parse_metric("") == report.parse_metric(None) == "accuracy"
  assert report.parse_metric("eval/math500/pass@8") == "math500/pass@8"
  # An unfinished run is read with what it has; the greedy default never raises.
  fake_run(tmp_path, sweep.Run(2, "f_eps", 1.0, "kl_atomic"), [0.3, 0.4], 0.05, finished=False)
  assert math.isnan(report.read_run(sweep.run_dir(str(tmp_path), sweep.Run(2, "f_eps", 1.0,
                                                   "kl_atomic")), "avg@16")["final"])  # fmt: skip


def test_a_metric_the_runs_will_not_log_is_refused_at_launch(tmp_path, capsys):
  """Before any run: avg@N needs eval.n = N, pass@K a K in eval.k (the task's, or --set's)."""
  launch = lambda *args: sweep.main(
    ["--dry-run", "--cells", "tv_mc", "--seeds", "0", "--out", str(tmp_path), *args]
  )
  for metric in ("avg@8", "pass@2", "math500/avg@16"):
    with pytest.raises(errors.ConfigError, match=rf"--metric {metric}: .* logs accuracy, avg@4"):
      launch("--metric", metric)
  for args in (
    ("--metric", "avg@4"), ("--metric", "level1/pass@4"), ("--metric", "accuracy"),
    ("--task", "wordchain", "--metric", "avg@4"),
    ("--metric", "avg@8", "--set", "eval.k=1,8"), ("--metric", "pass@1", "--set", "eval.k=1,8"),
    ("--metric", "avg@6", "--set", "eval.n=6"),
  ):  # fmt: skip
    assert launch(*args) == 0, args
  assert "gppo_jax.train" in capsys.readouterr().out
  assert not os.listdir(tmp_path)  # refused before the folder was touched


def test_a_sweep_folder_keeps_its_metric(tmp_path):
  """Like --task: recorded in sweep.json when not the default, and resuming the folder with
  another statistic (or without it) is refused."""
  settings = _settings(tmp_path, metric="avg@4")
  state = sweep.check_sweep_folder(settings)
  assert state["metric"] == "avg@4"
  assert "metric" not in sweep.check_sweep_folder(_settings(tmp_path))  # the default: unrecorded
  json.dump(state, open(tmp_path / "sweep.json", "w"))
  for other in (_settings(tmp_path), _settings(tmp_path, metric="pass@4")):
    with pytest.raises(errors.ConfigError, match="--metric"):
      sweep.check_sweep_folder(other)
  assert sweep.check_sweep_folder(settings)["metric"] == "avg@4"
  json.dump({"overrides": [], "start": "per_seed", "eps": 0.2}, open(tmp_path / "sweep.json", "w"))
  with pytest.raises(errors.ConfigError, match="other shared settings"):
    sweep.check_sweep_folder(settings)  # a greedy sweep resumed with --metric avg@4
  with pytest.raises(errors.ConfigError, match="--metric"):
    sweep.main(["--metric", "avg@4", "--cells", "kl_atomic", "--seeds", "0", "--out",
                str(tmp_path)])  # fmt: skip


# --- Running: a fake launcher -------------------------------------------------------------------


class FakeProcess:
  """Stands in for a train process: finishes after `polls` polls, leaving a finished run folder
  (or exiting with `code`)."""

  def __init__(self, cmd, out, log, *, polls=2, code=0):
    self.cmd, self.code, self.polls = cmd, code, polls
    self.workdir = next(c.split("=", 1)[1] for c in cmd if c.startswith("--workdir="))
    self.out = out

  def poll(self):
    self.polls -= 1
    if self.polls > 0:
      return None
    if self.code == 0:
      rec = json.load(open(os.path.join(self.workdir, sweep.RECORD)))
      run = sweep.Run(**rec["run"])
      fake_run(self.out, run, [0.3, 0.5], 0.05, settings=self.settings)
      # the sweep rewrites its record when the process ends
    return self.code

  def send_signal(self, sig):
    self.code = 0

  def wait(self, timeout=None):
    return self.code


def launcher(tmp_path, settings, log, **kw):
  def launch(cmd, _log):
    proc = FakeProcess(cmd, str(tmp_path), _log, **kw)
    proc.settings = settings
    log.append(cmd)
    return proc

  return launch


def _names(cmds):
  return [
    os.path.basename(next(c.split("=", 1)[1] for c in cmd if c.startswith("--workdir=")))
    for cmd in cmds
  ]


def test_first_run_of_each_start_goes_first_and_finished_runs_are_reused(tmp_path):
  s = _settings(tmp_path)
  runs = sweep.expand(["kl_atomic", "tv_mc"], ["f_eps"], [1.0], [0, 1])
  launched, lines = [], []
  status = sweep.execute(
    runs, s, jobs=2, launch=launcher(tmp_path, s, launched), echo=lines.append, poll_s=0
  )
  assert set(status.values()) == {"done"}
  # per-seed starts: the two leaders (one per seed) run together, then the rest.
  assert _names(launched) == [
    "kl_atomic__f_eps_x1__s0",
    "kl_atomic__f_eps_x1__s1",
    "tv_mc__f_eps_x1__s0",
    "tv_mc__f_eps_x1__s1",
  ]
  assert lines[0].startswith("[1/4] kl_atomic f_eps_x1 s0: done in ") and "final 50.0%" in lines[0]
  assert "ETA" in lines[0] and "ETA" not in lines[-1]
  # The same sweep again: everything is reused, nothing launched.
  again, lines = [], []
  sweep.execute(runs, s, jobs=2, launch=launcher(tmp_path, s, again), echo=lines.append, poll_s=0)
  assert again == [] and lines == ["reusing 4 finished runs of 4 under " + str(tmp_path)]
  # One shared start: its first run goes alone.
  shared = _settings(tmp_path / "shared", start="shared")
  order = []
  sweep.execute(
    runs, shared, jobs=2, launch=launcher(tmp_path / "shared", shared, order), echo=print, poll_s=0
  )
  assert _names(order)[0] == "kl_atomic__f_eps_x1__s0"


def test_an_unfinished_run_is_rerun_with_the_same_command(tmp_path):
  s = _settings(tmp_path)
  run = sweep.Run(0, "f_eps", 1.0, "kl_atomic")
  fake_run(tmp_path, run, [0.3, 0.4], 0.05, finished=False, seconds=30.0)  # preempted or killed
  launched = []
  sweep.execute([run], s, launch=launcher(tmp_path, s, launched), echo=print, poll_s=0)
  assert launched == [sweep.command(run, s)]  # same workdir: train resumes from its checkpoint
  record = json.load(open(os.path.join(sweep.run_dir(str(tmp_path), run), sweep.RECORD)))
  assert record["attempts"] == 2 and record["wall_s"] >= 30.0 and record["exit"] == 0


def test_a_folder_started_with_other_settings_is_refused(tmp_path):
  run = sweep.Run(0, "f_eps", 1.0, "kl_atomic")
  fake_run(tmp_path, run, [0.3, 0.4], 0.05, finished=False)
  other = _settings(tmp_path, overrides=("optim.lr=1e-3",))
  with pytest.raises(errors.ConfigError, match="other settings"):
    sweep.execute([run], other, launch=launcher(tmp_path, other, []), echo=print, poll_s=0)
  sweep.check_sweep_folder(_settings(tmp_path))  # nothing recorded yet: fine
  json.dump({"overrides": [], "start": "per_seed", "eps": 0.2}, open(tmp_path / "sweep.json", "w"))
  with pytest.raises(errors.ConfigError, match="other shared settings"):
    sweep.check_sweep_folder(other)


def test_a_user_error_in_a_run_stops_the_sweep(tmp_path):
  s = _settings(tmp_path)
  runs = sweep.expand(["kl_atomic", "tv_mc"], ["f_eps"], [1.0], [0])
  launched = []
  with pytest.raises(errors.ConfigError, match="kl_atomic__f_eps_x1__s0 stopped on a user error"):
    sweep.execute(runs, s, launch=launcher(tmp_path, s, launched, code=2), echo=print, poll_s=0)
  assert len(launched) == 1
  assert report.read_run(sweep.run_dir(str(tmp_path), runs[0]))["status"] == "failed (exit 2)"


def test_a_stop_is_passed_on_to_the_running_runs(tmp_path):
  s = _settings(tmp_path)
  runs = sweep.expand(["kl_atomic"], ["f_eps"], [1.0], [0, 1])
  signals = []

  class Stopped(FakeProcess):
    def poll(self):
      raise KeyboardInterrupt  # Ctrl-C reaches the sweep while both runs train

    def send_signal(self, sig):
      signals.append(sig)

  def launch(cmd, _log):
    return Stopped(cmd, str(tmp_path), _log)

  with pytest.raises(sweep.SweepStopped):
    sweep.execute(runs, s, jobs=2, launch=launch, echo=print, poll_s=0)
  assert signals == [signal.SIGTERM, signal.SIGTERM]  # each run saves and exits 0
  for run in runs:
    assert report.read_run(sweep.run_dir(str(tmp_path), run))["status"] == "unfinished"


# --- One real sweep -----------------------------------------------------------------------------

TINY = [
  "iterations=2",
  "task.name=add1",
  "rollout.prompts_per_iter=8",
  "rollout.group_size=4",
  "rollout.max_new_tokens=6",
  "train.minibatches=2",
  "warmstart.enabled=False",
  "eval.num_problems=16",
  "eval.k=0",
  "checkpoint.every=100",
]


def test_a_real_tiny_sweep_runs_reports_and_resumes(tmp_path):
  """2 cells x 2 seeds, 2 iterations each, 2 at a time."""
  cmd = [sys.executable, "-m", "gppo_jax.sweep", "--cells", "kl_atomic,none", "--seeds", "0,1"]
  cmd += ["--jobs", "2", "--out", str(tmp_path)] + [x for o in TINY for x in ("--set", o)]
  env = conftest.one_device_env()  # one CPU device per run
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout + p.stderr
  assert sum(line.startswith("[") for line in p.stdout.splitlines()) == 4  # one line per run
  rows = list(csv.DictReader(open(tmp_path / "runs.csv")))
  assert sorted(r["run"] for r in rows) == [
    "kl_atomic__f_eps_x1__s0",
    "kl_atomic__f_eps_x1__s1",
    "none__inf__s0",
    "none__inf__s1",
  ]
  assert all(r["status"] == "done" and r["iterations"] == "2" for r in rows)
  assert all(0 <= float(r["final"]) <= 1 and float(r["wall_s"]) > 0 for r in rows)
  assert {r["delta_low"] for r in rows if r["cell"] == "none"} == {"inf"}
  config = json.load(open(tmp_path / "runs" / "none__inf__s1" / "config.json"))
  assert config["seed"] == config["warmstart"]["seed"] == 1 and config["task"]["name"] == "add1"
  # Common random numbers: under one seed both cells start from the same policy and sample the
  # same first rollout (same prompts, same keys, same parameters), whatever their loss.
  for seed in (0, 1):
    first = [
      [json.loads(x) for x in open(tmp_path / "runs" / name / "metrics.jsonl")][:2]
      for name in (f"kl_atomic__f_eps_x1__s{seed}", f"none__inf__s{seed}")
    ]
    assert first[0][0] == {**first[1][0], "time": first[0][0]["time"]}  # the initial eval
    for key in ("reward/mean", "response/length_mean", "response/truncated_frac"):
      assert first[0][1][key] == first[1][1][key], key
  text = (tmp_path / "results.md").read_text()
  assert "| kl_atomic | 0.02314 | 2 |" in text and "Wall time:" in text
  assert (tmp_path / "plots" / "f_eps_x1_curves.png").exists()
  # The same command again reuses every run.
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0 and "reusing 4 finished runs of 4" in p.stdout, p.stdout + p.stderr
  record = json.load(open(tmp_path / "runs" / "none__inf__s1" / sweep.RECORD))
  assert record["attempts"] == 1


# --- equal_mask: radii calibrated on the first update -------------------------------------------


def test_the_delta_search_reaches_the_band_or_says_why_not():
  """On known share curves: non-increasing in delta, with a plateau, a jump and bounds."""
  calls = []

  def smooth(d):  # 40% of tokens masked at delta 0, half as many every doubling of delta
    calls.append(d)
    return 0.4 * 2 ** (-d / 0.01)

  found = sweep.search_delta(smooth, 0.05, 0.1)
  assert found["matched"] and abs(found["share"] - 0.05) <= 0.1 * 0.05
  assert found["delta"] == pytest.approx(0.03, rel=0.1) and found["evaluations"] == len(calls)
  assert sweep.search_delta(smooth, 0.05, 0.001)["matched"]  # from the other side too
  # Already within the band: the start is kept, after one evaluation.
  assert sweep.search_delta(smooth, 0.2, 0.01) == dict(
    delta=0.01, share=0.2, matched=True, evaluations=1, note=""
  )
  # A jump across the band (tokens with equal estimates cross together): the closest side.
  step = lambda d: 0.3 if d < 0.02 else 0.1
  found = sweep.search_delta(step, 0.18, 0.1)
  assert not found["matched"] and found["share"] == 0.1 and found["delta"] >= 0.02
  assert found["note"].startswith("no delta reaches it: the share jumps from 30% at delta 0.02")
  # Bounded shares: never 50% at any delta, never below 1% at any delta.
  found = sweep.search_delta(lambda d: min(0.3, 0.001 / d), 0.5, 0.1)
  # The closest share, first reached at 0.1 / 4^3: the largest delta that masks the most.
  assert not found["matched"] and (found["share"], found["delta"]) == (0.3, 0.1 / 4**3)
  assert found["note"] == f"unreachable: masks less than the target even at delta {0.1 / 4**12:.3g}"
  found = sweep.search_delta(lambda d: max(0.01, 0.1 - d), 0.001, 0.1)
  assert not found["matched"] and found["share"] == 0.01
  assert found["note"].startswith("unreachable: masks more than the target even at delta")


# TINY with its warm start: the warm-started add1 policy answers most prompts right, so the first
# update has signal (advantages) and its trust region masks a few percent of tokens.
TINY_WARM = [o for o in TINY if not o.startswith("warmstart.")]


def test_equal_mask_radii_match_tv_mcs_first_update_and_are_cached(tmp_path, monkeypatch):
  """Calibrated at scale 0.5 (tv_mc at delta 0.05): every cell's first-update masked share lies
  within 10% of tv_mc's, a real training run at a found delta logs that share for its first
  iteration, and a second call reads the folder's cache without computing anything."""
  from gppo_jax import train

  settings = _settings(tmp_path, overrides=tuple(TINY_WARM))
  need = {0.5: ["kl_atomic", "tv_mc", "tv_binary"]}
  lines = []
  found = sweep.calibrate(settings, need, echo=lines.append)
  target = found["tv_mc", 0.5]["share"]
  assert target > 0.01 and found["tv_mc", 0.5]["delta"] == pytest.approx(0.05)
  for cell in need[0.5]:
    c = found[cell, 0.5]
    assert c["matched"] and c["target"] == target, c
    assert abs(c["share"] - target) <= sweep.MASK_TOLERANCE * target, c
  # At its f_eps delta x 0.5 TV-Binary masks less than TV-MC: the search moved its radius.
  binary = found["tv_binary", 0.5]
  assert binary["evaluations"] > 1 and binary["delta"] < 0.5 * presets.default_delta("tv")
  table = "\n".join(lines)
  assert f"saved to {tmp_path / sweep.CALIBRATION_FILE}" in table
  assert f"| tv_binary | {binary['delta']:.4g} | {100 * binary['share']:.3f}% |" in table
  # The run's own first update, through train's compiled update, at the radius found.
  s = dataclasses.replace(settings, calibration=found)
  config = sweep.run_config(sweep.Run(0, sweep.EQUAL_MASK, 0.5, "tv_binary"), s)
  assert config.loss.delta_low == config.loss.delta_high == binary["delta"]
  config.iterations, config.eval.every = 1, 100
  train.train_and_evaluate(config, str(tmp_path / "run"))
  first = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")][1]
  assert abs(first["trust/masked_frac"] - target) <= sweep.MASK_TOLERANCE * target
  assert first["trust/masked_frac"] == pytest.approx(binary["share"], abs=1e-6)
  # Again: the cache answers, nothing is set up or computed.
  monkeypatch.setattr(train, "first_update", lambda *a, **k: pytest.fail("recomputed"))
  lines.clear()
  assert sweep.calibrate(settings, need, echo=lines.append) == found
  assert f"cached in {tmp_path / sweep.CALIBRATION_FILE}" in lines[0]
  # Another setting is another calibration (here: the scale).
  assert sweep.cached_calibration(settings, {1.0: ["tv_binary"]}) == {}
  assert sweep.cached_calibration(settings, {0.5: ["tv_binary"]}) == {("tv_binary", 0.5): binary}


def test_a_preset_with_a_finite_radius_is_matched_too(tmp_path):
  """Under equal_mask GSPO runs at its own radii and at matched ones (both scaled together,
  keeping its 3:4 ratio), calibrated on the same first update; CISPO (an infinite radius: it
  caps weights, masks nothing) only at its own; the report keeps the two GSPO rows apart."""
  runs = sweep.expand(["tv_mc", "gspo", "cispo"], [sweep.EQUAL_MASK], [1.0], [0])
  assert [(r.cell, r.rule) for r in runs] == [
    ("tv_mc", sweep.EQUAL_MASK), ("gspo", sweep.OWN), ("gspo", sweep.EQUAL_MASK),
    ("cispo", sweep.OWN),
  ]  # fmt: skip
  assert sweep.calibration_needs(runs) == {1.0: ["tv_mc", "gspo"]}
  assert sweep.matchable("gspo") and sweep.matchable("dapo") and sweep.matchable("kl_atomic")
  assert not any(map(sweep.matchable, ("cispo", "dppo", "none")))
  settings = _settings(tmp_path, overrides=tuple(TINY_WARM))
  found = sweep.calibrate(settings, {1.0: ["tv_mc", "gspo"]}, echo=lambda _: None)
  gspo = found["gspo", 1.0]
  assert gspo["evaluations"] >= 1 and gspo["target"] == found["tv_mc", 1.0]["share"]
  assert gspo["delta_high"] == pytest.approx(gspo["delta"] * 4 / 3)
  if gspo["matched"]:
    assert abs(gspo["share"] - gspo["target"]) <= sweep.MASK_TOLERANCE * gspo["target"]
  else:  # whole responses are masked at once: the share may jump across the band
    assert gspo["note"]
  s = dataclasses.replace(settings, calibration=found)
  config = sweep.run_config(sweep.Run(0, sweep.EQUAL_MASK, 1.0, "gspo"), s)
  assert (config.loss.delta_low, config.loss.delta_high) == (gspo["delta"], gspo["delta_high"])
  assert config.loss.ratio_level == "sequence"
  own = sweep.run_config(sweep.Run(0, sweep.OWN, 1.0, "gspo"), s)
  assert (own.loss.delta_low, own.loss.delta_high) == (1.5e-4, 2e-4)
  for run in runs:
    fake_run(tmp_path, run, [0.3, 0.5], 0.01, settings=s)
  text = report.results_markdown(report.collect(str(tmp_path)))
  assert _table_line(text, "gspo")[1] == "0.00015 / 0.0002"
  matched = _table_line(text, "gspo (matched)")[1]
  assert matched.startswith(f"{gspo['delta']:.4g} / {gspo['delta_high']:.4g}")
  assert matched.endswith("(**not matched**)") is not gspo["matched"]


def test_an_unreachable_share_is_reported_and_the_cell_runs_at_the_closest_delta(tmp_path):
  """No trust region masks 90% of a first update's tokens (the first optimizer step masks none):
  the table and the sweep's results say so, and the run takes the closest delta found."""
  settings = _settings(tmp_path, overrides=tuple(TINY_WARM))
  lines = []
  found = sweep.calibrate(settings, {1.0: ["kl_atomic"]}, echo=lines.append, target=0.9)
  cal = found["kl_atomic", 1.0]
  assert not cal["matched"] and cal["target"] == 0.9 and 0 < cal["share"] < 0.5
  assert cal["note"].startswith("unreachable: masks less than the target even at delta")
  assert cal["delta"] < presets.default_delta("kl")  # the tiniest radii mask the most
  assert lines[0] == "equal_mask: calibrating 1 radius on the first update of seed 0"
  assert "NOT MATCHED: kl_atomic" in lines[2]
  assert any(x.startswith("| kl_atomic |") and "**NO**: unreachable" in x for x in lines)
  # The sweep's results: the runs of that radius under the fake launcher, then the report.
  s = dataclasses.replace(settings, calibration=found)
  runs = sweep.expand(["kl_atomic"], [sweep.EQUAL_MASK], [1.0], [0, 1])
  sweep.execute(runs, s, launch=launcher(tmp_path, s, []), echo=print, poll_s=0)
  for run in runs:
    args = sweep.train_args(run, s)
    assert f"--config.loss.delta_low={cal['delta']!r}" in args
  sweep.write_outputs(str(tmp_path), {})
  text = (tmp_path / "results.md").read_text()
  assert "## Radius equal_mask_x1" in text and "**not matched: kl_atomic**" in text
  assert _table_line(text, "kl_atomic")[1] == f"{cal['delta']:.4g} (**not matched**)"
  rows = list(csv.DictReader(open(tmp_path / "runs.csv")))
  assert {r["calibration_matched"] for r in rows} == {"False"}
  assert {float(r["calibration_target"]) for r in rows} == {0.9}


def test_equal_mask_commands_come_from_the_folders_calibration(tmp_path, capsys):
  """--dry-run and --calibrate-only read the cache of --out; without one the dry run says the
  radius is calibrated at launch, and other settings (--set) are another calibration."""
  args = ["--rules", "equal_mask", "--cells", "tv_mc,kl_mc,none", "--seeds", "0"]
  args += ["--out", str(tmp_path)]
  assert sweep.main(["--dry-run", *args]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("# tv_mc__equal_mask_x1__s0: its equal_mask delta is calibrated at")
  assert "none__inf__s0" in out[2] and not os.listdir(tmp_path)
  settings = _settings(tmp_path)
  key = sweep.calibration_key(settings, 1.0)
  cells = {
    c: dict(cell=c, delta=d, share=0.031, target=0.03, matched=True, note="", tolerance=0.1)
    for c, d in (("tv_mc", 0.1), ("kl_mc", 0.0123))
  }
  entry = dict(key=key, cells=cells, task_name="addsub3", reference_delta=0.1, target=0.03)
  json.dump({"calibrations": [entry]}, open(tmp_path / sweep.CALIBRATION_FILE, "w"))
  assert sweep.main(["--dry-run", *args]) == 0
  out = capsys.readouterr().out.splitlines()
  assert "--config.loss.delta_low=0.0123" in out[1] and "kl_mc__equal_mask_x1__s0" in out[1]
  assert sweep.main(["--calibrate-only", *args]) == 0  # cached: nothing computed
  out = capsys.readouterr().out
  assert "equal_mask radii (task addsub3, seed 0, scale 1; cached in" in out
  assert "| kl_mc | 0.0123 | 3.100% | 3.000% | yes |" in out
  assert sweep.main(["--dry-run", *args, "--set", "optim.lr=1e-3"]) == 0
  assert "calibrated at launch" in capsys.readouterr().out.splitlines()[1]
  with pytest.raises(errors.ConfigError, match="no grid cell under --rules equal_mask"):
    sweep.main(["--calibrate-only", "--cells", "kl_mc", "--out", str(tmp_path)])
  # The child the sweep launches calibrates under the sweep's own settings (its sweep.json).
  settings = sweep.Settings(
    str(tmp_path), ("optim.lr=1e-3",), "shared", 0.3, "wordchain", "avg@4"
  )  # fmt: skip
  need = {1.0: ["tv_mc", "kl_mc"], 0.5: ["tv_mc", "kl_mc"]}
  a = sweep.parser().parse_args(sweep.calibration_argv(settings, need, 3))
  assert a.calibrate_only and a.calibration_batches == 3 and a.out == str(tmp_path)
  assert (tuple(a.set), a.start, a.eps, a.task, a.metric) == settings_fields(settings)
  runs = sweep.expand(sweep.parse_cells(a.cells), sweep.parse_rules(a.rules),
                      sweep.parse_scales(a.scales), [0])  # fmt: skip
  assert sweep.calibration_needs(runs) == need


def settings_fields(s: sweep.Settings):
  return s.overrides, s.start, s.eps, s.task, s.metric


def test_a_real_equal_mask_sweep_calibrates_in_a_child_then_trains(tmp_path):
  """The command line: the calibration runs in a child process before the run, its radius is the
  run's, results.md reports it, and the same command again reuses the cached calibration."""
  cmd = [sys.executable, "-m", "gppo_jax.sweep", "--cells", "kl_atomic", "--seeds", "0"]
  cmd += ["--rules", "equal_mask", "--out", str(tmp_path)]
  cmd += [x for o in TINY_WARM for x in ("--set", o)]
  env = conftest.one_device_env()
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout + p.stderr
  assert "equal_mask: calibrating 1 radius on the first update of seed 0" in p.stdout
  cal = json.load(open(tmp_path / sweep.CALIBRATION_FILE))["calibrations"][0]["cells"]["kl_atomic"]
  assert f"| kl_atomic | {cal['delta']:.4g} |" in p.stdout
  name = "kl_atomic__equal_mask_x1__s0"
  config = json.load(open(tmp_path / "runs" / name / "config.json"))
  assert config["loss"]["delta_low"] == config["loss"]["delta_high"] == cal["delta"]
  record = json.load(open(tmp_path / "runs" / name / sweep.RECORD))
  assert record["calibration"] == cal
  first = [json.loads(x) for x in open(tmp_path / "runs" / name / "metrics.jsonl")][1]
  assert first["trust/masked_frac"] == pytest.approx(cal["share"], abs=1e-6)  # the run's own
  text = (tmp_path / "results.md").read_text()
  assert "## Radius equal_mask_x1" in text and "Radii calibrated (equal_mask)" in text
  assert '"not_matched": []' in p.stdout or not cal["matched"]
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stdout + p.stderr
  assert (
    "calibrating" not in p.stdout and f"cached in {tmp_path / sweep.CALIBRATION_FILE}" in p.stdout
  )
  assert "reusing 1 finished runs of 1" in p.stdout
