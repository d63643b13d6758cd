"""Every benchmark runs as `python benchmarks/NAME.py` from any folder (no PYTHONPATH), and the
train-step memory benchmark reports what the attention implementations promise."""

from __future__ import annotations

import ast
import json
import os
import re
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


def _defined_flags(script: str) -> list[str]:
  """The flags a script defines, read from its source: argparse's add_argument("--name") and
  absl's flags.DEFINE_*("name") / config_flags.DEFINE_config_file("name")."""
  names = []
  for node in ast.walk(ast.parse((REPO / "benchmarks" / script).read_text())):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
      continue
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
      continue
    if node.func.attr == "add_argument" and first.value.startswith("--"):
      names.append(first.value)
    elif node.func.attr.startswith("DEFINE_"):
      names.append(f"--{first.value}")
  return names


def _uses_absl(script: str) -> bool:
  return "from absl import app" in (REPO / "benchmarks" / script).read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_benchmark_starts_from_another_folder_and_lists_its_flags(script, tmp_path):
  """`--help` from another folder (no PYTHONPATH) imports the script and prints a usage text that
  names every flag the script defines. argparse exits 0 after its help; absl's --help exits 1 by
  design (absl.app.HelpFlag), after advertising --helpfull."""
  flags = _defined_flags(script)
  assert flags, f"{script} defines no flags that this test can read"
  p = _run(tmp_path, script, "--help", timeout=120)
  out = p.stdout + p.stderr
  assert "Traceback" not in out, out[-2000:]
  if _uses_absl(script):
    assert p.returncode == 1 and "Try --helpfull" in p.stdout, out[-2000:]
  else:
    assert p.returncode == 0 and p.stdout.startswith("usage: "), out[-2000:]
  missing = [f for f in flags if f not in p.stdout]
  assert not missing, (missing, p.stdout[-2000:])


def test_estimator_variance_benchmark_measures_what_it_predicts(tmp_path):
  """A bounded run (2 pairs, 4000 tokens, vocab 16, seed 0): a row per divergence whose measured
  ratio of second moments is near the predicted one, both in (0, 1) (atomic's is smaller)."""
  p = _run(tmp_path, "estimator_variance.py", "--pairs", "2", "--samples", "4000", "--vocabs", "16")
  assert p.returncode == 0, p.stderr[-2000:]
  divergences = ("tv", "kl", "hellinger", "chi2")
  rows = {c[0]: c for c in map(str.split, p.stdout.splitlines()) if c and c[0] in divergences}
  assert set(rows) == set(divergences), p.stdout
  for cells in rows.values():
    predicted, measured = float(cells[2]), float(cells[3])
    assert 0 < predicted < 1 and 0 < measured < 1, cells
    assert abs(measured / predicted - 1) < 0.3, cells
  factor = float(re.search(r"within a factor ([0-9.]+)", p.stdout).group(1))
  assert 1 <= factor < 1.5, p.stdout


def test_logprob_memory_benchmark_chunked_head_needs_less_than_the_naive_one(tmp_path):
  """A bounded run (256 tokens, vocab 2048): the chunked log-prob head's compiled temporaries,
  with and without the entropy, are a fraction of the naive head's (its [B, T, V] logits)."""
  p = _run(
    tmp_path, "logprob_memory.py", "--vocab", "2048", "--tokens", "256", "--batch", "2",
    "--hidden", "16", "--chunk_sizes", "16",
  )  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  result = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
  assert result["tokens"] == 256 and result["naive_temp_bytes"] >= 256 * 2048 * 4
  assert 0 < result["chunked_c16_ratio"] < 0.25 and 0 < result["chunked+entropy_c16_ratio"] < 0.25
  assert result["worst_ratio"] == max(
    result["chunked_c16_ratio"], result["chunked+entropy_c16_ratio"]
  )


def test_sampler_benchmark_greedy_agrees_with_transformers_and_times_both(tmp_path):
  """The smallest run (one row, 4 new tokens, no no-cache decode): ours and HF `generate` on the
  same copied weights decode the same greedy tokens, and both are timed."""
  p = _run(
    tmp_path, "sampler.py", "--batch", "1", "--prompt", "4", "--new", "4", "--repeats", "1",
    "--nocache", "0",
  )  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  result = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
  assert result["weights_copied"] and result["greedy_agreement"] == 1.0, result
  assert set(result["tokens_per_s"]) == {"ours", "hf"} and min(result["tokens_per_s"].values()) > 0
  assert result["compile_s"]["ours"] > 0 and "greedy agreement ours vs HF (4 tokens)" in p.stdout


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


def test_update_benchmark_names_a_bad_variant_before_building_anything(tmp_path):
  """--variants remat/attention[/cpu_matmul[/scan|unroll]]: an unknown kernel or layer choice
  is a usage error."""
  p = _run(tmp_path, "train_step.py", "--shape", "tiny", "--variants", "attention/auto/eigen")
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert "'attention/auto/eigen'" in p.stderr and "auto, xla, ynnpack" in p.stderr, p.stderr
  bad = "attention/auto/xla/loop"
  p = _run(
    tmp_path, "train_step.py", "--shape", "tiny", "--variants", f"none/auto/xla/unroll,{bad}"
  )
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert f"'{bad}'" in p.stderr and "scan or unroll" in p.stderr, p.stderr


def test_attention_benchmark_times_each_tile_against_auto(tmp_path):
  """A bounded run: what "auto" runs at 130 tokens (blockwise in 64-token tiles, three, unrolled,
  on CPU) as the 1.00x baseline; every tile up to T and the chosen one, looped and unrolled (at
  most 16 tiles: not 8-token ones); dense; all agreeing (the script exits otherwise)."""
  p = _run(
    tmp_path, "attention.py", "--shapes", "2x130x2x1x8", "--tiles", "8,16,256", "--repeats", "1",
    "--inner", "1",
  )  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  result = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
  (shape,) = result["shapes"]
  assert shape["chosen_tile"] == 64 and shape["auto"] == "blockwise/64, unrolled"
  assert sorted(shape["ms"]) == [
    "auto", "dense", "loop/16", "loop/64", "loop/8", "unrolled/16", "unrolled/64"
  ]  # fmt: skip
  assert all(ms > 0 for ms in shape["ms"].values())
  rows = {ln.split()[0]: ln.split()[-1] for ln in p.stdout.splitlines() if ln.startswith("  ")}
  assert rows["auto"] == "1.00x", p.stdout


def _load(script):
  import importlib.util

  spec = importlib.util.spec_from_file_location(script[:-3], REPO / "benchmarks" / script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_train_step_pairs_each_round_with_the_baseline():
  bench = _load("train_step.py")
  times = {"ours[a]": [1.0, 2.0, 4.0], "ours[b]": [2.0, 2.0, 2.0], "hf": [2.0, 3.0, 2.0]}
  got = bench.paired_ratios(times)
  assert got == {"ours[a]": [2.0, 1.5, 0.5], "ours[b]": [1.0, 1.5, 1.0]}
  with pytest.raises(ValueError):  # rounds must pair up
    bench.paired_ratios({"ours[a]": [1.0], "hf": [1.0, 2.0]})


def test_train_step_dtype_sets_both_sides_compute(tmp_path):
  """--dtype bfloat16: our update computes in bf16 on float32 weights and HF runs under
  torch.autocast (bf16 matmuls in its graph); float32 leaves both in float32; other dtypes are
  a usage error."""
  import dataclasses

  import jax
  import torch

  from gppo_jax.models import architectures
  from gppo_jax.trainer import train_step

  bench = _load("train_step.py")
  cfg = architectures.config_from_hf(dict(bench.SHAPES["tiny"][0], model_type="qwen2"))
  for dtype, want in (("float32", False), ("bfloat16", True)):
    fn, tx, spec = bench.variant_update(cfg, "attention/auto", dtype)
    state = train_step.abstract_train_state(dataclasses.replace(cfg, dtype=dtype), tx)
    batch = train_step.abstract_batch(2, bench.PROMPT_LEN, 16, spec)
    text = fn.lower(state, batch, jax.random.key(0)).as_text()
    assert ("bf16" in text) == want, dtype
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jax.numpy.dtype("float32")}
  hf, seen = _tiny_hf(bench), []
  hook = hf.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
  rows = bench.make_batch("tiny")
  small = jax.tree.map(lambda x: x[:2], rows)
  for dtype in ("float32", "bfloat16"):
    bench.hf_step(hf, small, dtype)()
  hook.remove()
  assert seen == [torch.float32, torch.bfloat16]
  assert all(p.dtype == torch.float32 for p in hf.parameters())
  p = _run(tmp_path, "train_step.py", "--shape", "tiny", "--dtype", "float16")
  assert p.returncode == 2 and "float16" in p.stderr, p.stderr[-2000:]


def test_train_step_times_both_sides_and_reports_the_matmul_bound(tmp_path):
  """A bounded timed run: both sides step, the achieved rates stay under what the machine's
  matmuls allow, and the bound is the model FLOPs at XLA's measured 2048^3 rate, against which
  HF's time gives the largest ratio ours could reach."""
  p = _run(tmp_path, "train_step.py", "--shape", "tiny", "--rows", "2", "--length", "96",
           "--repeats", "1")  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  result = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
  (r,) = result["shapes"]
  assert r["batch"] == [2, 96] and set(r["step_s"]) == {"ours[auto/auto]", "hf"}
  xla, torch_rate = result["matmul_gflops"], result["torch_matmul_gflops"]
  assert xla > 0 and torch_rate > 0
  assert r["bound_s"] == pytest.approx(r["model_gflop_per_step"] / xla, rel=0.01, abs=1e-4)
  assert r["bound_vs_hf"] == pytest.approx(r["step_s"]["hf"] / r["bound_s"], rel=0.03)
  assert all(0 < g < 1.5 * max(xla, torch_rate) for g in r["gflops"].values()), r["gflops"]
  assert r["logprob_max_abs_diff"] < 1e-4
  assert "matmul bound:" in p.stdout and "torch" in p.stdout


def _tiny_hf(bench):
  """A randomly initialised HF Qwen2 of the benchmark's tiny shape (no download)."""
  import torch
  from transformers import Qwen2Config, Qwen2ForCausalLM

  cfg = Qwen2Config(**bench.SHAPES["tiny"][0], max_position_embeddings=512)
  return Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def test_gpu_benchmark_knows_each_chips_bf16_peak():
  gpu = _load("gpu_train_step.py")
  kind = lambda name: type("Device", (), {"device_kind": name})()
  assert gpu.peak_tflops(kind("NVIDIA H200")) == 989.0
  assert gpu.peak_tflops(kind("NVIDIA A100-SXM4-80GB")) == 312.0
  assert gpu.peak_tflops(kind("TPU v5p")) == 459.0
  assert gpu.peak_tflops(kind("TPU v5 lite")) == 197.0
  assert gpu.peak_tflops(kind("cpu")) is None


def test_gpu_benchmark_head_field_sets_how_the_head_walks_the_response():
  """A variant's head field: "c<N>" traces the log-prob head in chunks of N positions, "one" in
  one piece even past heads.ONE_CHUNK_BYTES, "auto" by the model's rule; the model's settings
  come back afterwards; a malformed field is a ValueError naming the choices."""
  import conftest
  import jax
  import jax.numpy as jnp

  from gppo_jax.models import heads as heads_lib

  gpu = _load("gpu_train_step.py")
  B, T, D, V = 2, 256, 8, 1024  # 2 MiB of float32 logits: one piece by the model's rule
  h, w = jnp.ones((B, T, D)), jnp.ones((D, V))
  ids = jnp.zeros((B, T), jnp.int32)

  def chunks(head):
    with gpu.head_setting(gpu.head_chunking(f"dots/auto/scan/{head}")):
      jaxpr = jax.make_jaxpr(lambda h: heads_lib.chunked_logprob_stats(h, w, ids)["logprobs"])(h)
    scans = [e for e in conftest.all_eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    return [e.params["length"] for e in scans]

  saved = heads_lib.ONE_CHUNK_BYTES, heads_lib.CHUNK_SIZE
  assert chunks("auto") == [1] and chunks("c16") == [T // 16]  # scan steps: pieces of the head
  heads_lib.ONE_CHUNK_BYTES = 1024  # now past the model's one-piece limit
  try:
    assert chunks("auto") == [T // heads_lib.CHUNK_SIZE] and chunks("one") == [1]
  finally:
    heads_lib.ONE_CHUNK_BYTES = saved[0]
  assert (heads_lib.ONE_CHUNK_BYTES, heads_lib.CHUNK_SIZE) == saved
  assert gpu.head_chunking("dots/auto") == "auto"
  for bad in ("c0", "cx", "two"):
    with pytest.raises(ValueError, match="auto, one or c<positions>"):
      gpu.head_chunking(f"dots/auto/scan/{bad}")


def test_gpu_benchmark_runs_on_cpu_and_reports_time_and_long_context_memory(tmp_path):
  """The accelerator script's CPU smoke run: a scanned and an unrolled variant (the first
  profiled; the second with its head in 16-position chunks), the matmul rate, attention parity,
  a long-context compile and step."""
  p = _run(
    tmp_path, "gpu_train_step.py", "--arch", "tiny", "--batch", "2", "--length", "64",
    "--prompt", "16", "--steps", "1", "--variants", "full/auto,dots/auto/unroll/c16",
    "--long", "256", "--matmul-n", "256", "--profile", str(tmp_path / "trace"),
    "--json", str(tmp_path / "o.json"),
  )  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads((tmp_path / "o.json").read_text())
  assert out == json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
  t = out["timing"]["full/auto"]
  assert t["loss_finite"] and t["step_s"] > 0 and t["tflops"] > 0
  assert out["peak_tflops"] is None and "mfu" not in t  # a CPU has no bf16 peak to divide by
  assert t["profile"]["top_ms"] and "profile" not in out["timing"]["dots/auto/unroll/c16"]
  assert out["timing"]["dots/auto/unroll/c16"]["loss_finite"] and out["matmul"]["tflops"] > 0
  # On CPU "auto" is dense: the one implementation checked against dense float32 is blockwise.
  assert set(out["attention_parity"]) == {"dense", "blockwise"}
  assert all(0 < e < 2e-2 for e in out["attention_parity"]["blockwise"].values())
  mem = out["long_context"]
  assert mem["256"]["temp_gib"] > 0 and mem["256"]["step_s"] > 0  # (growth: the test above)


def test_iteration_against_a_commit_times_that_commits_tree_and_this_one(tmp_path):
  """--against: the same config trained in the commit's exported tree and in this one, each in
  its own process, from another folder (the config path made relative to the repository)."""
  if not (REPO / ".git").exists():
    pytest.skip("not a git checkout: no commit to compare against")
  head = subprocess.run(
    ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  out = tmp_path / "against.json"
  p = _run(
    tmp_path, "iteration.py", "--against=HEAD", "--pairs=1", "--iterations=3",
    f"--config={REPO / 'configs' / 'kl_atomic.py'}:smoke", "--config.seed=3", f"--out={out}",
    timeout=600,
  )  # fmt: skip
  assert p.returncode == 0, p.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["against"] == head
  assert result["args"] == ["--config=configs/kl_atomic.py:smoke", "--config.seed=3"]
  (pair,) = result["pairs"]
  assert pair["old_s"] > 0 and pair["new_s"] > 0
  assert pair["ratio"] == pytest.approx(pair["old_s"] / pair["new_s"])
  assert f"commit {head[:12]} vs this tree" in p.stdout and "median ratio over 1 pairs" in p.stdout


def test_iteration_against_an_unknown_commit_says_so(tmp_path):
  p = _run(tmp_path, "iteration.py", "--against=no-such-ref-1234", timeout=120)
  assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert "--against=no-such-ref-1234: not a commit" in p.stderr
