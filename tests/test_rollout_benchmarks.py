"""The rollout benchmarks' smallest runs: benchmarks/rollout.py (continuous batching against the
fixed-batch sampler) and the CPU smoke version of benchmarks/gpu_iteration.py (whole RL
iterations with their hardware bounds). Figures are not asserted, only what each line means."""

import json
import os
import subprocess
import sys

from conftest import one_device_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _last_json(*args):
  done = subprocess.run(
    [sys.executable, *args], cwd=REPO, env=one_device_env(), capture_output=True, text=True,
    timeout=600,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_rollout_benchmark_reports_speed_memory_and_agreement():
  r = _last_json(
    "benchmarks/rollout.py", "--shape", "tiny", "--prompts", "6", "--group", "2", "--slots", "4",
    "--mean", "12", "--new", "64", "--page-size", "8", "--chunk", "8", "--repeats", "1",
  )  # fmt: skip
  assert r["speedup"] > 0 and r["fixed_s"] > 0 and r["continuous_s"] > 0
  # The pool is smaller than the fixed batch's rows x (prompt + max_new_tokens) cache, and the
  # pages in use at the peak are within the pool.
  assert 0 < r["kv_used_ratio"] <= r["kv_ratio"] < 1
  assert r["rows_identical"] == 1.0  # tiny float32 model, short rows: the same tokens
  assert 12 <= r["tokens"] <= 12 * 64 and r["max_len"] <= 64  # 6 prompts x 2 rows
  assert r["engine"]["prefilled_prompts"] >= 6


def test_gpu_iteration_smoke_run_splits_the_iteration_and_its_bounds():
  r = _last_json(
    "benchmarks/gpu_iteration.py", "--arch", "tiny", "--dtype", "float32", "--prompts", "2",
    "--group", "2", "--slots", "4", "--new", "32", "--mean", "8", "--prompt-len", "8",
    "--micro", "2", "--iterations", "2", "--bandwidth-gbs", "20", "--peak-tflops", "1",
  )  # fmt: skip
  parts = r["sample_s"] + r["logprobs_s"] + r["update_s"]
  assert min(r["sample_s"], r["logprobs_s"], r["update_s"]) > 0
  assert parts <= r["iteration_s"] * 1.01 + 1e-3
  assert 0 < r["decode_bound_frac"] and 0 < r["update_mfu"] < 1
  assert r["update_tflops"] > 0 and r["decode_steps"] >= 1 and r["rows"] == 4
  assert 1 <= r["mean_len"] <= 32
