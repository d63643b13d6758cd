"""The recipe end to end, through the commands a TPU run uses (launch/README.md), on a CPU:

  python -m gppo_jax.prepare_data NAME --source=FIXTURE --out data/{train,eval}/NAME.jsonl
  python -m gppo_jax.train --config=configs/qwen25_{math,coder}_7b.py:gpu8,smoke ...
  python -m gppo_jax.evaluate --config=<the same> --workdir=<the run>

on offline fixtures in each release's schema (tests/fixtures/prepare_data) and tiny Hugging Face
Qwen2 folders, with the math reward (math-verify workers) and the code reward (programs run in
the sandbox). Each command runs as a user would run it, in its own process; the test reads what
they leave behind: the prepared files, metrics.jsonl, checkpoints, the exported model, and the
evaluation's report.json and report.md.

The default runs are bounded (one iteration of 2 prompts x 2 responses of up to 8 tokens, about
a minute of CPU per recipe); the `slow` version trains three iterations and evaluates over two
seeds. The code recipe needs root (the sandbox's isolation) and is skipped without it.
"""

import importlib.util
import json
import os
import subprocess
import sys

import conftest
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "prepare_data")
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
GROUP = 2  # rollout.group_size

# What each kind prepares: (NAME, fixture, extra prepare_data flags) for training and evaluation.
RECIPES = {
  "math": dict(
    config="qwen25_math_7b.py",
    train=("dapo_math_17k", "dapo_math_17k.jsonl", ()),
    eval=[("math500", "math500.jsonl", ()), ("aime24", "aime24.jsonl", ())],
  ),
  "code": dict(
    config="qwen25_coder_7b.py",
    train=("taco", "taco.jsonl", ()),
    eval=[
      ("livecodebench", "livecodebench", ("--release=release_v2", "--start_date=", "--end_date=")),
      ("humaneval_plus", "humanevalplus.jsonl", ()),
    ],
  ),
}


def make_hf_folder(path):
  """tests/test_train_hf.py's tiny random Qwen2 folder with a BPE tokenizer (loaded here, so that
  collecting this file imports no torch)."""
  spec = importlib.util.spec_from_file_location("train_hf", f"{REPO}/tests/test_train_hf.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.make_hf_folder(path)


# The code model's three programs, one token each: the answers to taco-0 (stdin a + b), taco-1
# (double(x)) and LiveCodeBench's toy001_a (print twice the input).
PROGRAMS = (
  "```python\na, b = map(int, input().split())\nprint(a + b)\n```\n",
  "```python\ndef double(x):\n    return 2 * x\n```\n",
  "```python\nprint(2 * int(input()))\n```\n",
)


def make_code_hf_folder(path):
  """A tiny Qwen2 folder whose policy writes programs: make_hf_folder's tokenizer plus one added
  token per program in PROGRAMS, and weights that ignore the context and put nearly all the
  probability on those tokens (about 30% each at T = 1) and the end of turn (about 10%), so that
  responses are sequences of fenced programs whose last one the code reward runs.

  The residual stream is the token embedding alone (attention and MLP outputs zeroed), whose
  first coordinate is large and positive for every token; the untied head reads only that
  coordinate, for the four favoured tokens."""
  import torch
  import transformers
  from tokenizers import AddedToken, Tokenizer

  make_hf_folder(path)
  tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  tok.add_tokens([AddedToken(p, normalized=False) for p in PROGRAMS])
  tok.save(os.path.join(path, "tokenizer.json"))
  ids = [tok.token_to_id(p) for p in PROGRAMS]
  cfg = transformers.AutoConfig.from_pretrained(path)
  cfg.tie_word_embeddings = False
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(cfg)
  with torch.no_grad():
    model.model.embed_tokens.weight[:, 0] = 10.0
    for layer in model.model.layers:
      layer.self_attn.o_proj.weight.zero_()
      layer.mlp.down_proj.weight.zero_()
    model.lm_head.weight.zero_()
    model.lm_head.weight[ids, 0] = 1.5
    model.lm_head.weight[ids[0], 0] = 1.55  # greedy decoding writes taco-0's program
    model.lm_head.weight[cfg.eos_token_id, 0] = 1.3  # about 1 in 10: most responses hold code
  model.save_pretrained(path)
  assert max(ids) < cfg.vocab_size


def run(module, *args, cwd, timeout=600):
  """`python -m gppo_jax.<module> ARGS` in `cwd`, as a user runs it (one CPU device)."""
  env = conftest.one_device_env()
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  # JAX's persistent compilation cache, shared by the commands of one test: the evaluation
  # reuses the samplers the trainer's evaluations compiled.
  env.update(JAX_COMPILATION_CACHE_DIR=str(cwd / "jax_cache"))
  env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  p = subprocess.run(
    [sys.executable, "-m", f"gppo_jax.{module}", *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert p.returncode == 0, f"{module} {args}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
  return p


def prepare(name, fixture, flags, out, cwd):
  """prepare_data on a fixture; returns the written rows (read back from the file)."""
  source = os.path.join(FIXTURES, fixture)
  p = run("prepare_data", name, f"--source={source}", f"--out={out}", "--verifier_workers=1",
          *flags, cwd=cwd, timeout=180)  # fmt: skip
  rows = [json.loads(line) for line in open(out)]
  assert p.stdout.strip().startswith(f"{name}: wrote {len(rows)} rows to {out}"), p.stdout
  assert rows and all(r["benchmark"] == name for r in rows)
  return rows


def recipe(kind, tmp_path, *, iterations, eval_args):
  """prepare -> train -> evaluate for one kind; returns (run folder, the prepared evaluation rows
  per benchmark, metrics.jsonl rows, report.json, report.md, the evaluate command's stdout)."""
  spec = RECIPES[kind]
  data = tmp_path / "data"
  name, fixture, flags = spec["train"]
  train_file = data / "train" / f"{name}.jsonl"
  train_rows = prepare(name, fixture, flags, train_file, tmp_path)
  eval_rows = {}
  for name, fixture, flags in spec["eval"]:
    eval_rows[name] = prepare(name, fixture, flags, data / "eval" / f"{name}.jsonl", tmp_path)
  model = tmp_path / "models" / ("Tiny-Math" if kind == "math" else "Tiny-Coder")
  (make_hf_folder if kind == "math" else make_code_hf_folder)(str(model))
  eval_path = ",".join(f"{n}={data}/eval/{n}.jsonl" for n in eval_rows)
  config = [
    f"--config={REPO}/configs/{spec['config']}:gpu8,smoke",
    f"--config.model.path={model}",
    "--config.model.dtype=float32",
    "--config.mesh.fsdp=1",
    f"--config.data.train_path={train_file}",
    f"--config.data.eval_path={eval_path}",
    "--config.data.verifier_workers=1",
    f"--config.rollout.prompts_per_iter={len(train_rows)}",
    f"--config.rollout.group_size={GROUP}",
    "--config.rollout.max_new_tokens=8",
    "--config.train.minibatches=2",
    f"--config.iterations={iterations}",
    "--config.eval.n=2",
    "--config.eval.k=1,2",
  ]
  workdir = tmp_path / "runs" / kind
  run("train", *config, f"--workdir={workdir}", cwd=tmp_path)
  p = run("evaluate", *config, *eval_args, f"--workdir={workdir}", cwd=tmp_path)
  out = workdir / "eval" / str(iterations)
  assert sorted(os.listdir(out)) == ["report.json", "report.md"]
  metrics = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  report = json.loads((out / "report.json").read_text())
  return workdir, eval_rows, metrics, report, (out / "report.md").read_text(), p.stdout


def check_run(kind, workdir, eval_rows, metrics, report, table, stdout, *, iterations, seeds):
  """What every recipe run must leave: a metric row per iteration with its reward statuses, a
  checkpoint and an exported policy, and a report with one row per benchmark, the kind's macro
  row over them and every figure a fraction."""
  assert [m["step"] for m in metrics] == list(range(iterations + 1))
  for m in metrics[1:]:
    # The reward scored every response of the batch, with one status each.
    statuses = [v for k, v in m.items() if k.startswith("reward/status_")]
    assert sum(statuses) == m["rollout/groups_sampled"] / m["rollout/rounds"] * GROUP
    assert np.isfinite(m["loss/total"]) and np.isfinite(m["optim/grad_norm"])
    assert 0 <= m["reward/correct_mean"] <= 1
  for key in ("eval/accuracy", f"eval/macro_{kind}/avg@2", f"eval/{next(iter(eval_rows))}/pass@2"):
    assert key in metrics[0] and key in metrics[-1]  # the trainer's initial and final evaluations
  assert str(iterations) in os.listdir(workdir / "checkpoints")
  assert os.path.exists(workdir / "hf_export" / "config.json")
  names = list(eval_rows)
  assert report["source"]["kind"] == "checkpoint" and report["source"]["step"] == iterations
  assert sorted(b["name"] for b in report["benchmarks"]) == sorted(names)
  assert {b["name"]: b["num_problems"] for b in report["benchmarks"]} == {
    n: len(rows) for n, rows in eval_rows.items()
  }
  assert all(b["kind"] == kind for b in report["benchmarks"])
  (macro,) = report["macro"]
  assert macro["name"] == f"macro_{kind}" and sorted(macro["benchmarks"]) == sorted(names)
  proto = report["protocol"]
  assert (proto["n"], proto["k"], proto["seeds"]) == (2, [1, 2], list(seeds))
  one_problem = {n for n, rows in eval_rows.items() if len(rows) == 1}
  for key, value in report["metrics"].items():
    if value is None:  # a standard error over one problem is undefined (NaN, written as null)
      bench = key.split("/")[1]
      assert key.endswith("_se") and (bench in one_problem or bench == f"macro_{kind}"), key
    else:
      assert 0.0 <= value <= 1.0, (key, value)
  for fig in ("accuracy", "avg@2", "pass@1", "pass@2"):
    assert f"eval/{fig}" in report["metrics"] and f"eval/macro_{kind}/{fig}" in report["metrics"]
    for n in names:
      assert f"eval/{n}/{fig}_se" in report["metrics"]
  # pass@1 is avg@n, and pass@2 >= pass@1, benchmark by benchmark.
  for n in names:
    m = report["metrics"]
    assert m[f"eval/{n}/pass@1"] == pytest.approx(m[f"eval/{n}/avg@2"], abs=1e-9)
    assert m[f"eval/{n}/pass@2"] >= m[f"eval/{n}/pass@1"] - 1e-9
  assert "| benchmark | kind | problems | greedy | avg@2 | pass@1 | pass@2 |" in table
  for n in names:
    assert f"| {n} | {kind} | {len(eval_rows[n])} |" in table
  assert f"**{kind} (macro, {len(names)} benchmarks)**" in table
  assert "report.md" in stdout


# bounded: what CI runs; full (-m slow): three iterations, the evaluation over two seeds.
SIZES = {
  "bounded": dict(iterations=1, seeds=(0,)),
  "full": dict(iterations=3, seeds=(0, 1)),
}
size_param = pytest.mark.parametrize(
  "size", ["bounded", pytest.param("full", marks=pytest.mark.slow)]
)


def run_recipe(kind, tmp_path, size):
  iterations, seeds = SIZES[size]["iterations"], SIZES[size]["seeds"]
  eval_args = [f"--config.eval.seeds={','.join(map(str, seeds))}"]
  args = recipe(kind, tmp_path, iterations=iterations, eval_args=eval_args)
  check_run(kind, *args, iterations=iterations, seeds=seeds)
  report = args[3]
  if len(seeds) > 1:
    assert f"eval/macro_{kind}/avg@2_seed_std" in report["metrics"]
    assert all(len(b["figures"]["pass@2"]["per_seed"]) == 2 for b in report["benchmarks"])
  return args[2]


@size_param
def test_math_recipe_prepare_train_evaluate(tmp_path, size):
  metrics = run_recipe("math", tmp_path, size)
  statuses = {k for k in metrics[-1] if k.startswith("reward/status_")}
  assert {"reward/status_ok", "reward/status_no_answer", "reward/status_timeout"} <= statuses


@pytest.mark.skipif(not ROOT, reason="the isolated code sandbox needs root")
@size_param
def test_code_recipe_prepare_train_evaluate(tmp_path, size):
  metrics = run_recipe("code", tmp_path, size)
  for m in metrics[1:]:
    statuses = {
      k[len("reward/status_") :]: v for k, v in m.items() if k.startswith("reward/status_")
    }
    # Programs really ran in the sandbox (not only "no code"), and none failed for the host's sake.
    ran = sum(v for s, v in statuses.items() if s not in ("no_code", "bad_tests"))
    assert ran > 0, statuses
    assert statuses["infra_error"] == 0
