"""`python -m gppo_jax.evaluate`: says at once when there is nothing to evaluate, writes nothing but
its report, evaluates a Hugging Face folder without training; the eval protocol's config fields and
the real-run configs' `cell=` argument."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import conftest
import jax
import pytest
from conftest import load_config

from gppo_jax import config_lib, errors, evaluate
from gppo_jax.algorithm import presets
from gppo_jax.data import envs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke_config(tmp_path):
  c = load_config("kl_atomic", "smoke")
  c.warmstart.cache_dir = str(tmp_path / "cache")  # a warm start would create it
  return c


def test_a_wrong_workdir_or_checkpoint_is_reported_before_any_work(tmp_path, monkeypatch):
  c = smoke_config(tmp_path)
  monkeypatch.setattr(
    evaluate.experiment, "build_policy", lambda *a, **k: pytest.fail("built a policy")
  )
  missing = tmp_path / "no_such_run"
  with pytest.raises(errors.UserError, match="has no checkpoints folder"):
    evaluate.evaluate_checkpoint(c, str(missing))
  with pytest.raises(errors.UserError, match="--checkpoint=.*no_such_run"):
    evaluate.evaluate_checkpoint(c, str(tmp_path), which=str(missing))
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  with pytest.raises(errors.UserError, match="no checkpoint in .*--checkpoint=init"):
    evaluate.evaluate_checkpoint(c, str(tmp_path / "empty"))
  assert not missing.exists() and not (tmp_path / "cache").exists()  # nothing was created
  assert os.listdir(tmp_path / "empty" / "checkpoints") == []


def test_the_command_line_prints_one_line_and_exits_2(tmp_path):
  env = conftest.one_device_env()
  env["JAX_PLATFORMS"] = "cpu"
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "gppo_jax.evaluate",
      f"--config={REPO}/configs/kl_atomic.py:smoke",
      f"--workdir={tmp_path / 'nothing_here'}",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
  )
  assert p.returncode == 2, p.stderr[-2000:]
  lines = [x for x in p.stderr.splitlines() if x.strip()]
  assert lines[-1].startswith("error: --workdir=") and "Traceback" not in p.stderr
  assert not (tmp_path / "nothing_here").exists()


def _evaluate_cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
  env = conftest.one_device_env()
  env["JAX_PLATFORMS"] = "cpu"
  # From another folder the package is found on the path (CI installs no editable package).
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
  return subprocess.run(
    [sys.executable, "-m", "gppo_jax.evaluate", *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    cwd=cwd,
  )


def test_workdir_alone_evaluates_with_the_config_the_run_saved(tmp_path):
  """`--workdir=RUN` without --config: RUN/config.json as train writes it, rebuilt with the
  base's field types (tuples, and None fields that --config.* overrides still parse); a given
  --config wins; without either, or without the file, one line says what to give."""
  c = load_config("qwen25_math_7b", "gpu8,cell=dapo")
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(c.to_json_best_effort(indent=2, sort_keys=True))
  saved = evaluate.run_config(["evaluate", f"--workdir={run}"])
  resolved = c.copy_and_resolve_references().to_dict()
  assert saved.copy_and_resolve_references().to_dict() == resolved  # (1, 4) == [1, 4] is False
  assert evaluate.run_config(["evaluate", "--workdir", str(run)]).eval.k == (1, 4)
  assert evaluate.run_config(["evaluate", "--config=configs/ppo.py", f"--workdir={run}"]) is None
  assert evaluate.run_config(["evaluate", "--config.eval.n=3"]) is None
  # --config.* overrides on the saved config, as on a config file (eval.n was saved as None).
  from absl import flags
  from ml_collections import config_flags

  builtin = smoke_config(tmp_path)
  builtin.eval.n = None
  (run / "config.json").write_text(builtin.to_json_best_effort())
  argv = ["evaluate", f"--workdir={run}", "--config.eval.n=16", "--config.eval.k=1,8,16"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_dict(
    "config", evaluate.run_config(argv), "", flag_values=fv, sys_argv=argv, lock_config=True
  )
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  fv(argv)
  config_lib.validate(fv.config, evaluating=True)
  assert (fv.config.eval.n, fv.config.eval.k, fv.config.iterations) == (16, (1, 8, 16), 3)
  (run / "config.json").write_text("{not json")
  with pytest.raises(errors.ConfigError, match="config.json: not a config written by train"):
    evaluate.run_config(argv)
  with pytest.raises(errors.MissingFileError, match=r"no config.json .*--config=CONFIG_FILE"):
    evaluate.run_config(["evaluate", f"--workdir={tmp_path / 'none'}"])


def test_the_command_line_reads_the_run_config_before_any_work(tmp_path):
  """`python -m gppo_jax.evaluate --workdir=RUN --config.eval.n=16`: the saved config loads and
  takes the override (the command gets as far as finding no checkpoint); a missing config.json
  and a missing --config and --workdir are one line each, exit 2."""
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(smoke_config(tmp_path).to_json_best_effort())
  for args, words in [
    ([f"--workdir={run}", "--config.eval.n=16"], "has no checkpoints folder"),
    ([f"--workdir={run}", "--config.eval.nn=16"], "config.eval has no field 'nn'"),
    ([f"--workdir={tmp_path / 'none'}"], "has no config.json"),
    ([], "no config: give --config=CONFIG_FILE"),
  ]:
    p = _evaluate_cli(*args, cwd=tmp_path)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and words in lines[-1], (args, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
  assert sorted(os.listdir(tmp_path)) == ["run"] and os.listdir(run) == ["config.json"]


def parse_flags(*argv):
  """The config as `--config=... --config.eval.k=...` on a command line builds it."""
  from absl import flags
  from ml_collections import config_flags

  fv = flags.FlagValues()
  argv = ["prog", *argv]
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def test_eval_protocol_overrides_from_the_command_line():
  base = f"--config={REPO}/configs/kl_atomic.py"
  c = parse_flags(base, "--config.eval.k=8")  # an old single-k override still works
  config_lib.validate(c)
  assert c.eval.k == 8 and c.eval.n is None  # n follows the largest k
  c = parse_flags(base, "--config.eval.k=1,8,16", "--config.eval.n=16", "--config.eval.seeds=0,1,2")
  config_lib.validate(c)
  assert (c.eval.k, c.eval.n, c.eval.seeds) == ((1, 8, 16), 16, (0, 1, 2))
  c = parse_flags(base, "--config.eval.k=1,8", "--config.eval.n=4")
  with pytest.raises(errors.ConfigError, match=r"pass@8 but eval.n=4 .*set eval.n >= 8"):
    config_lib.validate(c)
  for flag, words in [
    ("--config.eval.seeds=0,0", "eval.seeds=(0, 0): must be None, an integer or a non-empty list"),
    ("--config.eval.k=0,2", "eval.k=(0, 2): must be an integer >= 0 or a list of integers >= 1"),
    ("--config.eval.max_new_tokens=0", "eval.max_new_tokens=0: must be an integer >= 1"),
  ]:
    with pytest.raises(errors.ConfigError, match=re.escape(words)):
      config_lib.validate(parse_flags(base, flag))


def test_real_run_configs_take_the_cell_as_an_argument():
  c = load_config("qwen25_math_7b", "gpu8,cell=tv_mc")
  config_lib.validate(c)
  assert (c.loss.divergence, c.loss.estimator) == ("tv", "mc") and c.mesh.fsdp == 8
  assert c.loss.delta_low == pytest.approx(0.1) and c.advantage.name == "grpo"
  assert load_config("qwen25_math_7b").loss.estimator == "atomic"  # default kl_atomic
  dppo = load_config("qwen3_8b", "cell=dppo")
  assert (dppo.loss.aggregation, dppo.advantage.name) == ("seq-mean-token-sum-norm", "dr_grpo")
  for name in [*config_lib.GRID_CELLS, *presets.names()]:
    config_lib.validate(load_config("qwen25_math_7b", f"cell={name},smoke"))
  with pytest.raises(errors.UnknownNameError, match=r"'kl_atomc'.*did you mean 'kl_atomic'"):
    load_config("qwen25_math_7b", "cell=kl_atomc")
  with pytest.raises(
    errors.ConfigError,
    match="valid: smoke, task=NAME, v5p64, gpu8, v5e8_lora, gpu1_lora, cell=NAME",
  ):
    load_config("qwen25_math_7b", "cel=kl_mc")
  # Math and code configs evaluate their recipe's benchmarks, each named, with a kind.
  math = load_config("qwen25_math_7b")
  assert [n for n, _ in envs.parse_eval_paths(math.data.eval_path)][:2] == ["math500", "aime24"]
  code = load_config("qwen25_coder_7b", "gpu8,cell=kl_atomic")
  config_lib.validate(code)
  assert code.data.kind == "code" and code.data.train_path == "/data/train/taco.jsonl"
  assert [n for n, _ in envs.parse_eval_paths(code.data.eval_path)] == [
    "livecodebench",
    "humaneval_plus",
  ]


def test_plan_sizes_the_code_config():
  from gppo_jax import plan

  c = load_config("qwen25_coder_7b", "gpu8")
  result = plan.plan(c, device_memory_gb=141, compile=False, devices=jax.devices()[:8])
  assert "FITS" in plan.format_plan(result)


def test_default_checkpoint_evaluates_model_path_only_without_a_run(tmp_path):
  c = load_config("qwen25_math_7b", "smoke")
  run = tmp_path / "run"
  assert evaluate.default_checkpoint(c, str(run), workdir_given=False) == "init"
  assert evaluate.default_checkpoint(c, str(run), workdir_given=True) == "latest"
  (run / "checkpoints").mkdir(parents=True)
  assert evaluate.default_checkpoint(c, str(run), workdir_given=False) == "latest"
  builtin = smoke_config(tmp_path)
  assert evaluate.default_checkpoint(builtin, str(tmp_path / "x"), workdir_given=False) == "latest"


def test_evaluating_a_hugging_face_folder_needs_no_training_data_or_run(tmp_path):
  """The command a TPU run uses on a model as it is: no checkpoint, no workdir, no training
  file; report.json and report.md land in <default workdir>/eval/<model folder>/ and nothing
  else is written."""
  spec = importlib.util.spec_from_file_location("hf", f"{REPO}/tests/test_train_hf.py")
  hf = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hf)
  model = tmp_path / "inputs" / "Tiny-Math"
  hf.make_hf_folder(str(model))
  rows = [
    {"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6)]
  ]
  for name, part in (("a", rows[:2]), ("b", rows[2:])):
    (tmp_path / "inputs" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
  env = conftest.one_device_env()
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  inputs = tmp_path / "inputs"
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "gppo_jax.evaluate",
      f"--config={REPO}/configs/qwen25_math_7b.py:gpu8,smoke",
      f"--config.model.path={model}",
      f"--config.data.eval_path=a={inputs}/a.jsonl,b={inputs}/b.jsonl",
      "--config.model.dtype=float32",
      "--config.mesh.fsdp=1",
      "--config.data.verifier_workers=1",
      "--config.rollout.max_new_tokens=16",
      "--config.eval.max_new_tokens=8",
      "--config.eval.n=2",
      "--config.eval.k=1,2",
      "--config.eval.seeds=0,1",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  out = tmp_path / "workdirs" / "qwen25_math_7b_gpu8_smoke" / "eval" / "Tiny-Math"
  assert sorted(os.listdir(tmp_path)) == ["inputs", "workdirs"]
  assert sorted(os.listdir(out)) == ["report.json", "report.md"]
  report = json.loads((out / "report.json").read_text())
  assert report["source"]["kind"] == "init" and report["source"]["path"] == str(model)
  proto = report["protocol"]
  assert (proto["n"], proto["k"], proto["seeds"], proto["max_new_tokens"]) == (2, [1, 2], [0, 1], 8)
  assert (proto["temperature"], proto["top_p"]) == (0.6, 0.95)  # the eval's own, not the rollout's
  assert [b["name"] for b in report["benchmarks"]] == ["a", "b"]
  assert [b["num_problems"] for b in report["benchmarks"]] == [2, 1]
  (macro,) = report["macro"]
  assert macro["name"] == "macro_math" and macro["benchmarks"] == ["a", "b"]
  assert len(macro["figures"]["pass@2"]["per_seed"]) == 2
  assert {"eval/accuracy", "eval/a/pass@2_se", "eval/macro_math/avg@2_seed_std"} <= set(
    report["metrics"]
  )
  table = (out / "report.md").read_text()
  assert "| benchmark | kind | problems | greedy | avg@2 | pass@1 | pass@2 |" in table
  assert "**math (macro, 2 benchmarks)**" in table
  assert "| **math (macro, 2 benchmarks)** |" in p.stdout and "report.md" in p.stdout  # printed
