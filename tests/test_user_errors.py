"""Bad user input ends in one clear error: its type, field or file, and the valid choices.

Library level: every registry, config argument, config field range, data file and model folder
problem raises a UserError (a ValueError) whose one-line message names what is wrong. Command
line: `gppo_jax.cli.run` turns those (and absl / ml_collections flag errors) into
`error: <message>` on stderr and exit status 2, with the traceback only under --verbose.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import save_file

from gppo_jax import cli, config_lib, errors
from gppo_jax.algorithm import advantages, divergences, estimators
from gppo_jax.data import envs, tasks
from gppo_jax.data import readers as data
from gppo_jax.models import hf_checkpoint, tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- Error types ---------------------------------------------------------------------------------


def test_error_types_are_value_errors_built_from_the_message_alone():
  for cls in (
    errors.UserError,
    errors.ConfigError,
    errors.UnknownNameError,
    errors.DataError,
    errors.CheckpointError,
    errors.MissingFileError,
  ):
    e = cls("what is wrong")  # ml_collections rebuilds config-file errors as type(e)(text)
    assert isinstance(e, ValueError) and isinstance(e, errors.UserError)
    assert str(e) == "what is wrong"
  assert isinstance(errors.MissingFileError("x"), FileNotFoundError)
  assert data.DataError is errors.DataError


@pytest.mark.parametrize(
  "lookup, name, words",
  [
    (divergences.get, "kll", ["unknown divergence 'kll'", "kl, hellinger", "alpha:<a>"]),
    (estimators.get, "atom", ["unknown estimator 'atom'", "mc, binary, atomic"]),
    (advantages.get, "gpro", ["unknown advantage estimator 'gpro'", "grpo, dr_grpo"]),
    (tasks.get, "add9", ["unknown built-in task 'add9'", "addsub3"]),
  ],
)
def test_registries_name_the_valid_choices(lookup, name, words):
  with pytest.raises(errors.UnknownNameError) as info:
    lookup(name)
  for w in words:
    assert w in str(info.value)
  assert info.value.name == name and len(info.value.choices) >= 2
  with pytest.raises(errors.ConfigError, match="alpha:0.5"):
    divergences.get("alpha:half")


# --- Config-file arguments ------------------------------------------------------------------------


def test_config_arguments_are_checked():
  assert config_lib.parse_arg("smoke, task=add1") == {"smoke": "1", "task": "add1"}
  assert config_lib.parse_arg(None) == config_lib.parse_arg("") == {}
  with pytest.raises(errors.ConfigError, match=r"'smok' \(did you mean 'smoke'\?\); valid: smoke"):
    config_lib.cell("kl", "atomic", "smok")
  with pytest.raises(errors.ConfigError, match="'bogus' in 'smoke,bogus'"):
    config_lib.base("smoke,bogus")
  with pytest.raises(errors.UnknownNameError, match="built-in task 'zzz'.*addsub3"):
    config_lib.base("task=zzz")
  with pytest.raises(errors.ConfigError, match="needs a value: task=NAME"):
    config_lib.base("task")
  with pytest.raises(errors.ConfigError, match="takes no value"):
    config_lib.base("smoke=0")  # used to mean smoke *on*
  with pytest.raises(errors.ConfigError, match="'gpu8'; valid: smoke, task=NAME$"):
    config_lib.base("gpu8")  # a real-run variant is not a base argument
  kw = dict(preset="qwen3-8b", path="/m", max_prompt_tokens=64, max_new_tokens=128)
  assert config_lib.real_run("gpu8,smoke", **kw).mesh.fsdp == 8
  with pytest.raises(errors.ConfigError, match="valid: smoke, task=NAME, v5p64, gpu8"):
    config_lib.real_run("gpu9", **kw)
  with pytest.raises(errors.ConfigError, match="pick one hardware variant"):
    config_lib.real_run("gpu8,v5p64", **kw)


# --- Config values --------------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
BAD_VALUES = [
  ("iterations", 0),
  ("log_every", 0),
  ("rollout.prompts_per_iter", 0),  # used to fail only after the warm start
  ("rollout.max_new_tokens", 0),
  ("rollout.group_size", 1),
  ("rollout.temperature", 0.0),
  ("rollout.temperature", NAN),
  ("rollout.top_p", 0.0),
  ("rollout.top_p", 1.5),
  ("rollout.top_k", -1),
  ("rollout.num_topk", -1),
  ("rollout.kv_memory_fraction", 1.5),  # a share of the free memory
  ("rollout.kv_memory_fraction", -0.1),
  ("loss.delta_low", -0.1),
  ("loss.delta_high", NAN),
  ("loss.ratio_cap", 0.5),
  ("loss.dual_clip", 1.0),
  ("loss.kl_coef", NAN),
  ("loss.entropy_coef", -0.01),
  ("loss.max_len", 0),
  ("reward.overlong_buffer", -1),
  ("reward.overlong_buffer", 100),  # longer than the response
  ("reward.format_coef", NAN),
  ("advantage.eps", 0.0),  # all-equal groups divide by std + eps
  ("advantage.ddof", 2),
  ("optim.lr", NAN),  # `lr <= 0` is False for NaN
  ("optim.lr", INF),
  ("optim.lr", 0.0),
  ("optim.b1", 1.0),
  ("optim.b2", 1.5),
  ("optim.weight_decay", -1.0),
  ("optim.grad_clip", -1.0),
  ("optim.warmup_steps", -1),
  ("optim.schedule", "cosin"),
  ("train.epochs", 0),
  ("train.minibatches", 0),  # used to be a bare ZeroDivisionError
  ("train.microbatches", 0),
  ("eval.every", 0),
  ("eval.k", -1),
  ("eval.num_problems", 0),
  ("eval.temperature", -1.0),
  ("eval.top_p", NAN),
  ("checkpoint.every", 0),
  ("checkpoint.keep", 0),
  ("profile.start", -1),
  ("profile.iterations", 0),
  ("warmstart.lr", NAN),
  ("warmstart.target_accuracy", 1.5),
  ("warmstart.batch_size", 0),
  ("warmstart.eval_every", 0),
  ("data.kind", "text"),
  ("data.max_prompt_tokens", 0),
  ("data.verifier_workers", 0),
  ("data.verifier_timeout_s", 0.0),
  ("model.dtype", "fp16"),
  ("model.param_dtype", "float16"),
  ("model.remat", "partial"),
  ("model.attention", "flash"),
  ("model.cpu_matmul", "eigen"),
  ("model.scan_layers", "no"),
  ("mesh.data", 0),
  ("mesh.tensor", -2),
]


def _set(c, field, value):
  *path, last = field.split(".")
  node = c
  for p in path:
    node = node[p]
  with node.ignore_type():
    node[last] = value


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_validate_names_the_field_value_and_range(field, value):
  c = config_lib.base("smoke")
  config_lib.validate(c)
  _set(c, field, value)
  with pytest.raises(errors.ConfigError) as info:
    config_lib.validate(c)
  msg = str(info.value)
  assert f"{field}={value!r}: must be" in msg, msg
  assert "\n" not in msg


def test_validate_reports_every_bad_field_at_once_and_keeps_valid_edge_values():
  c = config_lib.base("smoke")
  c.optim.lr, c.train.minibatches, c.mesh.fsdp = NAN, 0, -1
  with pytest.raises(errors.ConfigError) as info:
    config_lib.validate(c)
  msg = str(info.value)
  assert "optim.lr=nan" in msg and "train.minibatches=0" in msg and "mesh.fsdp" not in msg
  c = config_lib.base("smoke")
  c.mesh.data, c.mesh.fsdp = -1, -1
  with pytest.raises(errors.ConfigError, match="at most one axis may be -1"):
    config_lib.validate(c)
  # Valid edges: an infinite radius (no trust region), grad_clip None or 0 (off), b = 0, k = 0.
  c = config_lib.base("smoke")
  c.loss.delta_low = c.loss.delta_high = INF
  c.optim.grad_clip, c.optim.b1, c.eval.k, c.loss.dual_clip = None, 0.0, 0, 3.0
  config_lib.validate(c)
  c.optim.grad_clip = 0.0
  config_lib.validate(c)


def test_validate_names_unknown_registry_entries_with_their_field():
  for field, value, words in [
    ("loss.divergence", "kll", "loss.divergence: unknown divergence 'kll'"),
    ("loss.estimator", "atom", "loss.estimator: unknown estimator 'atom'"),
    ("advantage.name", "gpro", "advantage.name: unknown advantage estimator"),
    ("task.name", "add9", "task.name: unknown built-in task 'add9'"),
    ("model.preset", "gpt9", "model.preset: unknown model architecture 'gpt9'"),
  ]:
    c = config_lib.base("smoke")
    _set(c, field, value)
    with pytest.raises(errors.UnknownNameError, match=words):
      config_lib.validate(c)
  c = config_lib.base("smoke")
  c.loss.aggregation = "mean"
  with pytest.raises(
    errors.ConfigError, match="loss.aggregation='mean': must be one of token-mean"
  ):
    config_lib.validate(c)
  c = config_lib.base("smoke")
  c.train.minibatches = 3
  with pytest.raises(errors.ConfigError, match="must be divisible"):
    config_lib.validate(c)
  c = config_lib.base("smoke")
  c.data.eval_path = "a=x.jsonl"
  with pytest.raises(errors.ConfigError, match="data.eval_path is set but data.train_path is not"):
    config_lib.validate(c)
  c = config_lib.base("smoke")  # 3 iterations
  c.profile.start = 4
  with pytest.raises(errors.ConfigError, match="profile.start=4 is past iterations=3"):
    config_lib.validate(c)
  c.profile.start = 3  # the last one: valid
  config_lib.validate(c)


# --- Data files -----------------------------------------------------------------------------------


def test_data_errors_name_the_file_and_line(tmp_path):
  def load(name, text=None, raw=None, **kw):
    f = tmp_path / name
    if raw is not None:
      f.write_bytes(raw)
    elif text is not None:
      f.write_text(text)
    return data.load_dataset(str(f), **kw)

  cases = [
    (dict(name="none.jsonl"), "none.jsonl: no such file"),
    (dict(name="bad.jsonl", text='{"prompt": "a", "answer": "1"}\n{"prompt": \n'), "bad.jsonl:2:"),
    (dict(name="field.jsonl", text='{"question": "a", "answer": "1"}\n'), "missing field 'prompt'"),
    (dict(name="empty.jsonl", text="\n\n"), "empty.jsonl: file has no rows"),
    (dict(name="bin.jsonl", raw=b'{"prompt": "a", "answer": "1"}\n\xff\xfe\n'), "bin.jsonl:2: not"),
    (
      dict(name="long.jsonl", text='{"prompt": "abcdef", "answer": "1"}\n'),
      "raise data.max_prompt_tokens",
    ),
  ]
  for kw, words in cases:
    extra = dict(encode=lambda s: list(range(len(s))), max_prompt_tokens=3)
    with pytest.raises(errors.DataError) as info:
      load(**kw, **extra)
    assert words in str(info.value), str(info.value)
  (tmp_path / "folder.jsonl").mkdir()
  with pytest.raises(errors.DataError, match="is a folder"):
    data.load_dataset(str(tmp_path / "folder.jsonl"))
  with pytest.raises(errors.ConfigError, match="unknown data kind 'text'; valid: math, code"):
    data.load_dataset(str(tmp_path / "bad.jsonl"), task="text")
  with pytest.raises(errors.ConfigError, match="expected NAME=PATH"):
    envs.parse_eval_paths("=x.jsonl")


# --- Model folders --------------------------------------------------------------------------------

_LLAMA = dict(
  architectures=["LlamaForCausalLM"],
  model_type="llama",
  vocab_size=16,
  hidden_size=8,
  intermediate_size=16,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=1,
)


def test_model_folder_errors_name_the_file(tmp_path):
  with pytest.raises(errors.MissingFileError, match="no_such_model: no such folder"):
    hf_checkpoint.load_model(tmp_path / "no_such_model")
  with pytest.raises(FileNotFoundError, match="config.json: missing"):
    hf_checkpoint.load_model(tmp_path)
  cfg = tmp_path / "config.json"
  cfg.write_text("{not json")
  with pytest.raises(errors.CheckpointError, match="config.json: invalid JSON"):
    hf_checkpoint.load_model(tmp_path)
  cfg.write_text(json.dumps(dict(_LLAMA, architectures=["GPT2LMHeadModel"], model_type="gpt2")))
  with pytest.raises(errors.CheckpointError) as info:
    hf_checkpoint.load_model(tmp_path)
  assert str(cfg) in str(info.value) and "unsupported architecture" in str(info.value)
  cfg.write_text(json.dumps(dict(_LLAMA, hidden_act="gelu")))
  with pytest.raises(errors.CheckpointError, match=r"config.json: unsupported settings.*gelu"):
    hf_checkpoint.load_model(tmp_path)
  cfg.write_text(json.dumps(_LLAMA))
  with pytest.raises(errors.MissingFileError, match="no model.safetensors"):
    hf_checkpoint.load_model(tmp_path)


def test_truncated_safetensors_is_reported_with_its_path(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(_LLAMA))
  weights = tmp_path / "model.safetensors"
  save_file({"model.norm.weight": np.ones((8,), np.float32)}, str(weights))
  blob = weights.read_bytes()
  weights.write_bytes(blob[: len(blob) - 8])
  with pytest.raises(errors.CheckpointError) as info:
    hf_checkpoint.load_model(tmp_path)
  msg = str(info.value)
  assert str(weights) in msg and "truncated" in msg and "\n" not in msg


def test_tokenizer_folder_errors_name_the_file(tmp_path):
  with pytest.raises(errors.MissingFileError, match="tokenizer.json: missing"):
    tokenizer.load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{broken")
  with pytest.raises(errors.CheckpointError, match="tokenizer.json: cannot be read"):
    tokenizer.load_tokenizer(tmp_path)


# --- Command line ---------------------------------------------------------------------------------


def test_verbose_is_read_from_the_raw_command_line():
  assert cli.verbose_requested(["p", "--verbose"])
  assert cli.verbose_requested(["p", "--verbose=true", "--x=1"])
  assert not cli.verbose_requested(["p", "--verbose", "--noverbose"])
  assert not cli.verbose_requested(["p", "--verbose=false"])
  assert not cli.verbose_requested(["p", "--", "--verbose"])
  assert cli.one_line("a\n\n  b  \n") == "a b"


_SCRIPT = """
from absl import flags
from ml_collections import config_flags

from gppo_jax import cli, errors

config_flags.DEFINE_config_file("config", None, "config file")
flags.DEFINE_string("fail", "", "user | bug")


def main(argv):
  if flags.FLAGS.fail == "user":
    raise errors.DataError("train.jsonl:3: missing field 'answer'")
  if flags.FLAGS.fail == "bug":
    raise RuntimeError("a real bug")
  print("lr", flags.FLAGS.config.optim.lr)


cli.run(main)
"""

_CONFIG = """
import ml_collections


def get_config(arg=None):
  from gppo_jax import config_lib

  config_lib.parse_arg(arg)  # smoke, task=NAME
  return ml_collections.ConfigDict({"optim": {"lr": 0.1, "b1": 0.9}})
"""


def _run(args, cwd, env=None):
  """`python *args` in cwd; env: the whole environment (default: this one on JAX's CPU)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu") if env is None else env
  return subprocess.run(
    [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
  )


def _one_error_line(p, *words):
  assert p.returncode == 2, (p.returncode, p.stderr)
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
  for w in words:
    assert w in lines[0], lines[0]


def test_cli_reports_user_errors_in_one_line(tmp_path):
  (tmp_path / "prog.py").write_text(textwrap.dedent(_SCRIPT))
  (tmp_path / "cfg.py").write_text(textwrap.dedent(_CONFIG))
  ok = _run(["prog.py", "--config=cfg.py:smoke", "--config.optim.lr=0.5"], tmp_path)
  assert ok.returncode == 0 and "lr 0.5" in ok.stdout, ok.stderr
  cases = [
    (["--config=nope.py"], ["no such config file 'nope.py'"]),
    (["--config=nope.py", "--config.optim.lr=1"], ["--config=nope.py: no such config file"]),
    (["--config=cfg.py:smok"], ["--config=cfg.py:smok: unknown config argument 'smok'", "smoke"]),
    (
      ["--config=cfg.py", "--config.optim.llr=1"],
      ["config.optim has no field 'llr'", "valid: b1, lr"],
    ),
    (["--config=cfg.py", "--config.optim.lr=abc"], ["--config.optim.lr=abc"]),
    (["--config=cfg.py", "--bogus"], ["Unknown command line flag 'bogus'"]),
    (["--config=cfg.py", "--fail=user"], ["train.jsonl:3: missing field 'answer'"]),
  ]
  for args, words in cases:
    _one_error_line(_run(["prog.py", *args], tmp_path), *words)
  verbose = _run(["prog.py", "--config=cfg.py", "--fail=user", "--verbose"], tmp_path)
  assert verbose.returncode == 2 and "Traceback" in verbose.stderr
  assert verbose.stderr.strip().splitlines()[-1].startswith("error: train.jsonl:3")
  bug = _run(["prog.py", "--config=cfg.py", "--fail=bug"], tmp_path)
  assert (
    bug.returncode == 1 and "Traceback" in bug.stderr and "RuntimeError: a real bug" in bug.stderr
  )


def test_train_cli_bad_value_is_one_line_after_the_host_memory_set_up(tmp_path):
  """The train command finds its platform first (experiment.keep_cpu_memory) without JAX's own
  INFO lines about absent plugins reaching the console, here without JAX_PLATFORMS (JAX then
  probes for a TPU); a bad config value is still one error line, and so is a bad
  GPPO_CPU_MEMORY."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "GPPO_CPU_MEMORY")}
  args = ["-m", "gppo_jax.train", "--config=configs/kl_atomic.py", f"--workdir={tmp_path}"]
  args += ["--config.rollout.prompts_per_iter=0"]
  run = lambda **extra: _run(args, REPO, env=dict(env, **extra))
  _one_error_line(run(), "rollout.prompts_per_iter=0: must be an integer >= 1")
  _one_error_line(run(GPPO_CPU_MEMORY="lots"), "GPPO_CPU_MEMORY='lots'; valid: keep, release")


def test_train_cli_config_errors_come_before_anything_is_written(tmp_path):
  """Every check that needs only the config, relations between fields included, runs before
  the workdir, its lock, config.json or checkpoints/ exist and before the config is printed."""
  data = tmp_path / "train.jsonl"
  data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
  workdir = tmp_path / "run"
  args = ["-m", "gppo_jax.train", "--config=configs/kl_atomic.py", f"--workdir={workdir}"]
  cases = [
    (
      [f"--config.data.train_path={data}"],
      "data.train_path is set but model.path is not: data files need the model's tokenizer",
    ),
    (["--config.train.minibatches=3"], "must be divisible by train.minibatches"),
  ]
  for extra, words in cases:
    p = _run([*args, *extra], REPO)
    _one_error_line(p, words)
    assert not p.stdout.strip(), p.stdout  # the config is not printed
    assert not workdir.exists(), sorted(os.listdir(workdir))


def test_plan_cli_rejects_bad_config_before_any_work():
  p = _run(["-m", "gppo_jax.plan", "--config=configs/kl_atomic.py:smok"], REPO)
  _one_error_line(p, "unknown config argument 'smok'", "did you mean 'smoke'")
  p = _run(
    ["-m", "gppo_jax.plan", "--config=configs/kl_atomic.py", "--config.rollout.prompts_per_iter=0"],
    REPO,
  )
  _one_error_line(p, "rollout.prompts_per_iter=0: must be an integer >= 1")
