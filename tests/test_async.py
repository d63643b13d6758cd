"""rollout.mode="async" and mesh.rollout_devices: the next rollout drawn beside the update, on the
sampler's own devices, computing exactly what the synchronous run with the same staleness does."""

import json
import os
import signal

import jax
import numpy as np
import pytest
from conftest import load_config

from gppo_jax import config_lib, errors, train
from gppo_jax.models import sharding
from gppo_jax.trainer import async_rollout, rollout


def config(*, mode="sync", staleness=1, rollout_devices=0, iterations=3, eval_every=2):
  c = load_config("kl_atomic.py", "smoke,task=add1")
  c.rollout.staleness = staleness
  c.rollout.mode = mode
  c.mesh.rollout_devices = rollout_devices
  c.iterations = iterations
  c.checkpoint.every = 1
  c.eval.every = eval_every  # an evaluation while the next rollout is in flight
  return c


def rows(workdir, drop=("time", "time/", "async/")):
  out = []
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    row = json.loads(line)
    out.append({k: v for k, v in row.items() if not k.startswith(drop)})
  return out


def test_async_equals_sync_with_the_same_staleness(tmp_path):
  sync, asynchronous = str(tmp_path / "sync"), str(tmp_path / "async")
  train.train_and_evaluate(config(staleness=2), sync)
  summary = train.train_and_evaluate(config(mode="async", staleness=2), asynchronous)
  assert not summary.get("preempted")
  got = rows(asynchronous)
  # Same keys, prompts, behaviour policies and updates: row for row, bit for bit.
  assert got == rows(sync)
  assert [r["rollout/policy_version"] for r in got[1:]] == [0, 0, 0]  # theta_{t-2}, theta_0
  waited = [r for r in rows(asynchronous, drop=()) if "async/wait_s" in r]
  assert len(waited) == 2  # iterations 2 and 3 take the rollout drawn during the one before


def test_split_devices_move_the_policy_and_match_sync(tmp_path):
  sync, asynchronous = str(tmp_path / "sync"), str(tmp_path / "async")
  train.train_and_evaluate(config(rollout_devices=4), sync)
  train.train_and_evaluate(config(mode="async", rollout_devices=4), asynchronous)
  assert rows(asynchronous) == rows(sync)
  full = rows(asynchronous, drop=())[1:]
  # Every rollout's policy moved to the sampler: the whole policy (no LoRA), in float32.
  assert all(r["async/sync_gib"] > 0 and r["async/sync_s"] >= 0 for r in full)
  assert len({r["async/sync_gib"] for r in full}) == 1
  assert [r["rollout/policy_version"] for r in full] == [0, 0, 1]  # theta_{t-1}, theta_0


def test_sigterm_mid_rollout_saves_and_resumes_exactly(tmp_path, monkeypatch):
  whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
  # Evaluated every iteration: a run's last iteration is, in each run compared.
  train.train_and_evaluate(config(mode="async", iterations=4, eval_every=1), whole)

  real, calls = rollout.collect, []

  def collect(*args, **kwargs):
    out = real(*args, **kwargs)
    calls.append(1)
    if len(calls) == 2:  # the first rollout drawn ahead, on the rollout thread, has drawn
      os.kill(os.getpid(), signal.SIGTERM)
    return out

  monkeypatch.setattr(rollout, "collect", collect)
  stopped = train.train_and_evaluate(config(mode="async", iterations=4, eval_every=1), parts)
  # The update in progress finished and was saved, with a rollout drawn ahead of it: the
  # checkpoint holds the environment before that rollout drew, so the resume draws it again.
  assert stopped["preempted"] and 1 <= stopped["iterations_done"] < 4, stopped
  monkeypatch.setattr(rollout, "collect", real)
  train.train_and_evaluate(config(mode="async", iterations=4, eval_every=1), parts)
  assert rows(parts) == rows(whole)


def test_a_sampler_error_stops_the_run_with_that_error(tmp_path, monkeypatch):
  real = rollout.collect
  calls = []

  def collect(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:  # the first rollout drawn on the rollout thread
      raise RuntimeError("sampler exploded")
    return real(*args, **kwargs)

  monkeypatch.setattr(rollout, "collect", collect)
  with pytest.raises(RuntimeError, match="sampler exploded"):
    train.train_and_evaluate(config(mode="async"), str(tmp_path / "run"))


def test_async_needs_staleness_and_split_needs_a_trainer():
  c = config(mode="async", staleness=0)
  with pytest.raises(errors.ConfigError, match=r"rollout.mode='async' needs rollout.staleness"):
    config_lib.validate(c)
  c = config(mode="overlap")
  with pytest.raises(errors.ConfigError, match="rollout.mode"):
    config_lib.validate(c)
  c = config(rollout_devices=-1)
  with pytest.raises(errors.ConfigError, match="mesh.rollout_devices"):
    config_lib.validate(c)
  c = config(rollout_devices=2)
  c.mesh.rollout.data = 0
  with pytest.raises(errors.ConfigError, match=r"mesh.rollout.data=0"):
    config_lib.validate(c)
  n = jax.device_count()
  with pytest.raises(errors.ConfigError, match="leaves no device to train on"):
    sharding.make_meshes(dict(config(rollout_devices=n).mesh))


def test_meshes_split_the_devices():
  c = config(rollout_devices=2).mesh
  train_mesh, sampler_mesh = sharding.make_meshes(dict(c))
  devices = jax.devices()
  assert list(train_mesh.devices.flat) == devices[:-2]
  assert list(sampler_mesh.devices.flat) == devices[-2:]
  assert dict(sampler_mesh.shape)["data"] == 2
  shared = sharding.make_meshes(dict(config().mesh))
  assert shared[0] is shared[1] and shared[0].devices.size == len(devices)


def test_param_sync_moves_only_lora_adapters_and_casts():
  from gppo_jax.models import architectures
  from gppo_jax.models import model as model_lib
  from gppo_jax.trainer import experiment, train_step

  from flax import nnx

  cfg = architectures.get("tiny", lora_rank=2, lora_alpha=4.0)
  _, base = nnx.split(model_lib.create(cfg.without_lora(), 0))
  _, params = model_lib.with_lora(cfg, base, seed=0)
  train_mesh, sampler_mesh = sharding.make_meshes({"data": -1, "rollout_devices": 2})
  tx = train_step.make_optimizer(lr=1e-3, total_steps=10)
  _, state = experiment.init_state(params, tx, train_mesh)
  sync = async_rollout.ParamSync(state, sampler_mesh, np.dtype("bfloat16"))
  moved = sync(state.params, version=3)
  moved.wait()
  adapters = sum(x.size for x in jax.tree.leaves(state.params))
  assert moved.version == 3
  assert moved.gib == pytest.approx(adapters * 2 / 2**30)  # bfloat16: two bytes each
  for leaf in jax.tree.leaves(moved.policy):
    assert set(leaf.devices()) <= set(sampler_mesh.devices.flat)
    if np.issubdtype(leaf.dtype, np.floating) or leaf.dtype == np.dtype("bfloat16"):
      assert leaf.dtype == np.dtype("bfloat16")
