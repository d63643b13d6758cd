"""Every benchmark runs as `python benchmarks/NAME.py` from any folder (no PYTHONPATH), and the
train-step memory benchmark reports what the attention implementations promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py"))


def _run(tmp_path, script, *args, timeout=300):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  cmd = [sys.executable, str(REPO / "benchmarks" / script), *args]
  return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_benchmarks_folder_is_not_empty():
  assert "train_step.py" in SCRIPTS and "iteration.py" in SCRIPTS and len(SCRIPTS) >= 7


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_benchmark_starts_from_another_folder(script, tmp_path):
  p = _run(tmp_path, script, "--help", timeout=120)
  out = p.stdout + p.stderr
  # argparse exits 0 after --help, absl (iteration.py) 1; neither with a traceback.
  assert p.returncode in (0, 1) and "Traceback" not in out, out[-2000:]
  assert "usage" in out.lower() or "flags" in out.lower(), out[-2000:]


def test_update_memory_benchmark_blockwise_grows_slower_than_dense(tmp_path):
  """The compiled temporaries of one update: doubling T at most ~doubles blockwise's (linear),
  while dense's grow faster (its float32 [T, T] scores per head)."""
  p = _run(
    tmp_path, "train_step.py", "--shape", "tiny", "--memory", "1024,2048",
    "--variants", "full/blockwise,full/dense",
  )  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1]
  gib = json.loads(line)["gib"]
  block, dense = gib["full/blockwise"], gib["full/dense"]
  assert block["2048"] <= 2.2 * block["1024"], block
  assert dense["2048"] >= 3.0 * dense["1024"], dense
  assert block["2048"] < dense["2048"] / 2, gib
