"""benchmarks/grid.py: the commands it launches and the tables it reads back from run folders."""

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def grid():
  spec = importlib.util.spec_from_file_location("grid", os.path.join(REPO, "benchmarks", "grid.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _fake_run(out, cell, seed, curve, masked):
  wd = os.path.join(out, f"{cell}_s{seed}")
  os.makedirs(wd)
  with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    for i, acc in enumerate(curve):
      f.write(json.dumps({"step": 50 * i, "eval/accuracy": acc}) + "\n")
      f.write(json.dumps({"step": 50 * i + 1, "trust/masked_frac_late": masked}) + "\n")
  final = {"eval/accuracy": curve[-1], "eval/level1/accuracy": 1.0, "eval/avg@4": 0.5}
  summary = {"initial_eval": {"eval/accuracy": curve[0]}, "final_eval": final, "seconds": 9.0}
  json.dump(summary, open(os.path.join(wd, "summary.json"), "w"))


def test_none_is_the_clip_with_an_infinite_radius(grid):
  cmd = grid.command("none", 3, "/w", ["optim.lr=1e-3"])
  assert any(c.endswith("configs/tv_mc.py") for c in cmd)
  assert "--config.loss.delta_low=1e30" in cmd and "--config.loss.delta_high=1e30" in cmd
  assert "--config.seed=3" in cmd and "--config.warmstart.seed=0" in cmd  # one shared start
  assert cmd[-1] == "--config.optim.lr=1e-3"
  assert not any("delta" in c for c in grid.command("kl_atomic", 0, "/w", []))


def test_reused_runs_aggregate_across_seeds(grid, tmp_path):
  out = str(tmp_path)
  _fake_run(out, "kl_atomic", 0, [0.3, 0.5, 0.9], 0.06)
  _fake_run(out, "kl_atomic", 1, [0.3, 0.4, 0.7], 0.04)
  _fake_run(out, "none", 0, [0.3, 0.2, 0.4], 0.0)
  rows = [grid.run_one(c, s, out, [], reuse=True) for c, s in [("kl_atomic", 0), ("kl_atomic", 1)]]
  rows.append(grid.run_one("none", 0, out, [], reuse=True))
  assert all(r["reused"] for r in rows)  # read back, nothing launched
  r = rows[0]
  assert (r["before"], r["after"], r["best"]) == (0.3, 0.9, 0.9)
  assert r["mean_curve"] == pytest.approx(0.7)  # the evals after the first
  assert r["curve_steps"] == [0, 50, 100] and r["levels"] == {"level1": 1.0}
  assert r["masked_late"] == pytest.approx(0.06)
  text = grid.table(rows)
  # kl_atomic after 0.9 and 0.7: mean 80.0, sample sd 14.1; curve means 0.7 and 0.55.
  assert "| kl_atomic | 80.0 ± 14.1 | 70.0 | 90.0 | 62.5 ± 10.6 | 2 |" in text
  assert "| iteration | 0 | 50 | 100 |" in text
  assert "| kl_atomic | 30.0 | 45.0 | 80.0 |" in text and "| none | 30.0 | 20.0 | 40.0 |" in text


def test_a_failed_run_is_reported_not_read(grid, tmp_path, monkeypatch):
  class Failed:
    returncode = 2

  monkeypatch.setattr(grid.subprocess, "run", lambda *a, **k: Failed())
  row = grid.run_one("kl_atomic", 0, str(tmp_path), [])
  assert row["error"].startswith("exit 2") and "kl_atomic_s0.log" in row["error"]
  assert "exit 2" in grid.table([row])
