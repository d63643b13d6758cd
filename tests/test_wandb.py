"""Weights & Biases logging (config.logging.wandb): what the metric writer logs reaches a W&B run
(offline, read back from its .wandb file), a resumed run continues the same run id, a run started
afresh gets a new one; bad settings and a missing package are clear errors."""

import glob
import json
import math
import os
import struct
import sys
import time

import pytest
from conftest import load_config

from gppo_jax import config_lib, errors, train
from gppo_jax.trainer import metric_writers

SKIP_REASON = "wandb is not installed (requirements-test.txt has it): pip install wandb"


def _offline(monkeypatch, tmp_path):
  """The wandb package, W&B offline with its files under tmp_path/wandb_dir (no network, no
  account); skips the test when wandb is not installed."""
  wandb = pytest.importorskip("wandb", reason=SKIP_REASON)
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed port, should it go online
  os.makedirs(tmp_path / "wandb_dir")
  return wandb


def _records(path: str):
  """The records of a .wandb file: a header (':W&B', 0xBEE1, version), then LevelDB-log blocks of
  32 KiB holding chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) of serialized
  wandb_internal_pb2.Record messages."""
  from wandb.proto import wandb_internal_pb2

  data = open(path, "rb").read()
  ident, magic, _ = struct.unpack("<4sHB", data[:7])
  assert (ident, magic) == (b":W&B", 0xBEE1), (ident, magic)
  pos, block, pending = 7, 32768, b""
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # a block's tail too short for a chunk header is padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if kind == 0:
      pos += left
      continue
    pending += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      yield record


def _finished_records(path: str, timeout_s: float = 30.0) -> list:
  """The records of a finished run's .wandb file. W&B's service process writes the file on its
  own: it may still be writing when `finish()` has returned, so wait for the run's exit record."""
  deadline = time.monotonic() + timeout_s
  while True:
    records = list(_records(path))
    if any(r.WhichOneof("record_type") == "exit" for r in records):
      return records
    assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s"
    time.sleep(0.1)


def read_run(wandb_dir: str, run_id: str) -> tuple[dict, dict[int, dict]]:
  """(config, {step: {key: value}}) of every offline file of W&B run `run_id` under wandb_dir."""
  paths = glob.glob(os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}*", "*.wandb"))
  assert paths, os.listdir(os.path.join(wandb_dir, "wandb"))
  config, rows = {}, {}
  for path in paths:
    for r in _finished_records(path):
      kind = r.WhichOneof("record_type")
      if kind == "run":
        assert r.run.run_id == run_id
        config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
      elif kind == "config":  # the config again, or what reached W&B after the run record
        config.update({u.key: json.loads(u.value_json) for u in r.config.update})
      elif kind == "history":
        row = {"/".join(i.nested_key or [i.key]): json.loads(i.value_json) for i in r.history.item}
        rows.setdefault(int(row["_step"]), {}).update(row)
  return config, rows


def _writer(log_dir, resume_step, config=None):
  options = metric_writers.WandbOptions(project="gppo-tests", mode="offline", config=config)
  return metric_writers.MetricWriter(
    str(log_dir), total_steps=9, resume_step=resume_step, progress=False, enabled=True,
    wandb=options,
  )  # fmt: skip


def test_metric_writer_logs_to_wandb_and_a_resumed_run_keeps_the_run_id(tmp_path, monkeypatch):
  _offline(monkeypatch, tmp_path)
  monkeypatch.delenv("WANDB_MODE")  # logging.wandb_mode="offline" alone keeps it offline
  wandb_dir, logs = str(tmp_path / "wandb_dir"), tmp_path / "run"
  config = {"loss": {"delta_high": 0.1, "estimator": "atomic"}, "eval": {"k": [1, 4]}}
  w = _writer(logs, resume_step=-1, config=config)  # a run started afresh
  first = w.wandb_run_id
  w.write(0, {"eval/accuracy": 0.25})
  w.write(1, {"reward/mean": 0.5, "eval/pass@4": 0.75, "note": "not a number"})
  hist = {
    "min": -0.3,
    "max": 0.4,
    "num": 6.0,
    "sum": 0.2,
    "sum_squares": 0.5,
    "bucket_limits": [-0.1, 0.0, 0.1, 0.5],
    "bucket_counts": [1.0, 2.0, 2.0, 1.0],
  }
  w.histogram(1, "diag/log_ratio", hist)
  w.write(2, {"reward/mean": 0.625})
  w.close()
  assert (logs / metric_writers.WANDB_ID_FILE).read_text().strip() == first
  got_config, rows = read_run(wandb_dir, first)
  assert got_config["loss"] == config["loss"] and got_config["eval"] == {"k": [1, 4]}
  assert rows[0]["eval/accuracy"] == 0.25 and rows[2]["reward/mean"] == 0.625
  assert rows[1]["reward/mean"] == 0.5 and rows[1]["eval/pass@4"] == 0.75
  assert "note" not in rows[1]  # only what metrics.jsonl holds as numbers
  assert rows[1]["diag/log_ratio/values"] == [1, 2, 2, 1]
  assert rows[1]["diag/log_ratio/bins"] == [-0.3, -0.1, 0.0, 0.1, 0.5]
  assert [json.loads(x)["step"] for x in open(logs / "metrics.jsonl")] == [0, 1, 2]

  # Resumed at step 2 (the restart of a preempted run): the same W&B run goes on.
  monkeypatch.setenv("WANDB_MODE", "offline")
  w = _writer(logs, resume_step=2, config=config)
  assert w.wandb_run_id == first
  w.write(3, {"reward/mean": 0.75})
  w.close()
  assert read_run(wandb_dir, first)[1][3]["reward/mean"] == 0.75
  w = _writer(logs, resume_step=None)  # appending, as a direct use does
  assert w.wandb_run_id == first
  w.close()
  # Started afresh in the same folder (no checkpoint to resume): a new W&B run, and its id kept.
  w = _writer(logs, resume_step=-1)
  assert w.wandb_run_id != first
  w.close()
  assert (logs / metric_writers.WANDB_ID_FILE).read_text().strip() == w.wandb_run_id


def test_a_writer_of_another_process_logs_nothing_to_wandb(tmp_path, monkeypatch):
  _offline(monkeypatch, tmp_path)
  w = metric_writers.MetricWriter(
    str(tmp_path / "run"), total_steps=3, enabled=False, wandb=metric_writers.WandbOptions("p")
  )
  w.write(1, {"a": 1.0})
  w.close()
  assert not (tmp_path / "run").exists() and os.listdir(tmp_path / "wandb_dir") == []


def test_wandb_options_come_from_the_config_and_are_validated():
  c = load_config("kl_atomic", "smoke")
  assert c.logging.wandb is False and metric_writers.WandbOptions.from_config(c) is None
  c.logging.wandb, c.logging.wandb_mode, c.logging.wandb_entity = True, "offline", "team"
  options = metric_writers.WandbOptions.from_config(c)
  assert (options.project, options.entity, options.mode) == ("gppo_jax", "team", "offline")
  assert options.config == json.loads(c.to_json_best_effort())  # what config.json holds
  config_lib.validate(c)
  for field, value, words in [
    ("wandb_mode", "onlin", "logging.wandb_mode='onlin': must be one of online, offline"),
    ("wandb_project", "a/b", "logging.wandb_project='a/b': must be a W&B project name"),
    ("wandb_project", "", "logging.wandb_project='': must be a W&B project name"),
    ("wandb", 1, "logging.wandb=1: must be True or False"),
    ("wandb_entity", None, "logging.wandb_entity=None: must be a string"),
  ]:
    bad = load_config("kl_atomic", "smoke")
    with bad.ignore_type():
      bad.logging[field] = value
    with pytest.raises(errors.ConfigError, match=words):
      config_lib.validate(bad)
  older = load_config("kl_atomic", "smoke")  # a config built before the section existed
  del older["logging"]
  config_lib.validate(older)
  assert metric_writers.WandbOptions.from_config(older) is None


def test_without_the_wandb_package_training_stops_before_any_work(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
  with pytest.raises(errors.ConfigError, match="needs the wandb package.*pip install wandb"):
    metric_writers.import_wandb()
  c = load_config("kl_atomic", "smoke")
  c.logging.wandb = True
  c.warmstart.cache_dir = str(tmp_path / "cache")
  with pytest.raises(errors.ConfigError, match="pip install wandb"):
    train.train_and_evaluate(c, str(tmp_path / "run"))
  assert os.listdir(tmp_path) == []  # no workdir, no warm start


def test_a_training_run_logs_to_wandb_and_its_resume_continues_the_run(tmp_path, monkeypatch):
  """train with logging.wandb: the rows of metrics.jsonl and the config reach W&B; a longer run
  in the same workdir resumes the same W&B run."""
  _offline(monkeypatch, tmp_path)
  c = load_config("kl_atomic", "smoke")
  c.iterations, c.diagnostics.every = 2, 0
  c.logging.wandb, c.logging.wandb_mode, c.logging.wandb_project = True, "offline", "gppo-tests"
  wd = str(tmp_path / "run")
  train.train_and_evaluate(c, wd)
  run_id = open(os.path.join(wd, metric_writers.WANDB_ID_FILE)).read().strip()
  c.iterations = 3
  train.train_and_evaluate(c, wd)
  assert open(os.path.join(wd, metric_writers.WANDB_ID_FILE)).read().strip() == run_id
  config, rows = read_run(str(tmp_path / "wandb_dir"), run_id)
  assert config["loss"]["estimator"] == "atomic" and config["logging"]["wandb"] is True
  for line in open(os.path.join(wd, "metrics.jsonl")):
    row = json.loads(line)
    logged = rows[row["step"]]
    for k, v in row.items():
      if k not in ("step", "time"):
        a, b = float(v), float(logged[k])  # metrics.jsonl writes nan and inf as strings
        assert a == b or (math.isnan(a) and math.isnan(b)), (row["step"], k, v, logged[k])
  assert sorted(rows) == [0, 1, 2, 3]
