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


def test_lora_moves_only_its_adapters_and_matches_sync(tmp_path):
  runs = {}
  for mode in ("sync", "async"):
    c = config(mode=mode, rollout_devices=4, iterations=2)
    c.model.lora.rank, c.model.lora.alpha = 4, 8.0
    runs[mode] = str(tmp_path / mode)
    train.train_and_evaluate(c, runs[mode])
  assert rows(runs["async"]) == rows(runs["sync"])
  full = rows(runs["async"], drop=())[1:]
  trained = full[0]["params/trainable"]  # float32 adapters, nothing else moves
  assert all(r["async/sync_gib"] == pytest.approx(trained * 4 / 2**30) for r in full)
  assert trained < full[0]["params/total"] / 4


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
  c = config(mode="async")
  c.model.lora.rank = 4
  with pytest.raises(errors.ConfigError, match="with LoRA .* needs mesh.rollout_devices > 0"):
    config_lib.validate(c)
  c.mesh.rollout_devices = 2
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
  from flax import nnx

  from gppo_jax.models import architectures
  from gppo_jax.models import model as model_lib
  from gppo_jax.trainer import experiment, train_step

  cfg = architectures.get("tiny", lora_rank=2, lora_alpha=4.0)
  _, base = nnx.split(model_lib.create(cfg.without_lora(), 0))
  _, params = model_lib.with_lora(cfg, base, seed=0)
  train_mesh, sampler_mesh = sharding.make_meshes({"data": -1, "rollout_devices": 2})
  tx = train_step.make_optimizer(lr=1e-3, total_steps=10)
  _, state = experiment.init_state(params, tx, train_mesh)
  sync = async_rollout.ParamSync(state, sampler_mesh, np.dtype("bfloat16"))
  moved = sync(state.params, state.frozen, version=3)
  moved.wait()
  adapters = sum(x.size for x in jax.tree.leaves(state.params))
  assert moved.version == 3
  assert moved.gib == pytest.approx(adapters * 2 / 2**30)  # bfloat16: two bytes each
  for leaf in jax.tree.leaves(moved.policy):
    assert set(leaf.devices()) <= set(sampler_mesh.devices.flat)
    if np.issubdtype(leaf.dtype, np.floating) or leaf.dtype == np.dtype("bfloat16"):
      assert leaf.dtype == np.dtype("bfloat16")


def test_plan_sizes_the_sampler_and_the_trainer_apart():
  from gppo_jax import plan

  c = config(rollout_devices=2, staleness=1)
  c.model.preset = "tiny"
  shared = plan.plan(c, {"data": -1}, compile=False, devices=jax.devices()[:8])
  split = plan.plan(c, compile=False, devices=jax.devices()[:8])
  assert split.mesh["data"] == 6 and split.sampler_mesh["data"] == 2 and shared.sampler_mesh is None
  # The trainer keeps the policy, its lagging copy and the optimizer state; the sampler one copy
  # of the policy (replicated over its data axis, as the trainer's is) beside its cache.
  assert split.params == shared.params and split.optimizer == shared.optimizer
  policy = split.params // 2  # staleness 1: the policy and one lagging copy
  assert split.sample_peak - split.kv_cache < shared.sample_peak - shared.kv_cache
  assert split.sample_peak >= policy + split.kv_cache
  assert "sampler mesh data=2" in plan.format_plan(split)
  # On 2 hosts of 4 devices each samples on 1 of its own (the plan sizes one host's sampler).
  two = plan.plan(c, compile=False, devices=jax.devices()[:8], hosts=2)
  assert two.mesh["data"] == 6 and two.sampler_mesh["data"] == 1
  assert any("on each of 2 hosts" in n for n in two.notes)
  c.mesh.rollout.tensor = 2  # a host's one sampling device cannot hold a tensor axis of 2
  with pytest.raises(ValueError, match="1 devices are not divisible by 2"):
    plan.plan(c, compile=False, devices=jax.devices()[:8], hosts=2)
  with pytest.raises(errors.ConfigError, match="rollout_devices=2 on 4 hosts of 2 devices"):
    plan.plan(c, compile=False, devices=jax.devices()[:8], hosts=4)


def test_time_model_overlaps_the_phases_it_predicts():
  from gppo_jax import plan
  from gppo_jax.models import architectures

  c = config()
  c.model.preset = "tiny"
  cfg = architectures.get("tiny")
  t = plan.iteration_time(c, cfg, platform="h100", devices=8, rollout_devices=2)
  assert t.sync_s == t.sample_s + t.update_s
  assert t.async_s == max(t.sample_split_s + t.move_s, t.update_split_s)
  # The update scales with its devices; sampling on fewer devices is no faster.
  np.testing.assert_allclose(t.update_split_s * 6, t.update_s * 8, rtol=1e-12)
  assert t.sample_split_s >= t.sample_s
  params = plan.abstract_param_count(cfg)
  np.testing.assert_allclose(t.move_s, 2 * params / (plan.PLATFORM_LINK_GBPS["h100"] * 1e9))
  # Long responses make sampling the longer phase and overlapping it pays; the same split with
  # short responses and several epochs only takes devices from the update.
  c.model.path = "/no/such/model"  # no folder: the rollout shape is the config's own
  c.rollout.prompts_per_iter, c.rollout.group_size = 64, 8
  qwen = architectures.get("qwen2.5-7b")
  c.rollout.max_new_tokens, c.train.epochs = 4096, 1
  long = plan.iteration_time(c, qwen, platform="v5p", devices=64, rollout_devices=32)
  c.rollout.max_new_tokens, c.train.epochs = 64, 4
  short = plan.iteration_time(c, qwen, platform="v5p", devices=64, rollout_devices=32)
  assert long.sample_s > long.update_s and long.speedup > 1.1, long
  assert short.sample_s < short.update_s and short.speedup < 1, short
  # Streaming: the same split, the rows' decode steps the mean response, not the cap. Where every
  # response runs to the cap it is the asynchronous iteration; a long tail makes it the faster.
  capped = plan.iteration_time(
    c, qwen, platform="v5p", devices=64, rollout_devices=32, mean_response=64
  )
  assert capped.stream_split_s == capped.sample_split_s and capped.stream_s == capped.async_s
  c.rollout.max_new_tokens, c.train.epochs = 4096, 1
  tail = plan.iteration_time(
    c, qwen, platform="v5p", devices=64, rollout_devices=32, mean_response=512
  )
  assert tail.stream_s == max(tail.stream_split_s + tail.move_s, tail.update_split_s)
  weights = 2 * plan.abstract_param_count(qwen) / (plan.PLATFORM_HBM_GBPS["v5p"] * 1e9)
  np.testing.assert_allclose(tail.sample_split_s - tail.stream_split_s, (4096 - 512) * weights)
  assert tail.stream_speedup > tail.speedup > 1, tail
  text = plan.format_time(tail, "v5p", stream=tail)
  assert f"{tail.stream_speedup:.2f}x streaming" in text and f"= {tail.stream_s:8.2f} s" in text
  assert "streaming" not in plan.format_time(tail, "v5p")
  with pytest.raises(errors.ConfigError, match="rollout_devices"):
    plan.iteration_time(c, cfg, platform="h100", devices=8, rollout_devices=8)


@pytest.mark.parametrize("engine", ["fixed", "continuous"])
def test_host_share_samples_a_share_and_joins_every_hosts(policy, engine, monkeypatch):
  """Multi-host split sampling, two hosts simulated in one process: each samples a contiguous
  share of the prompts (3 prompts: 2 and 1) and the shares, joined in process order, are the
  rows of one call over every prompt with the same row keys (prompt index, sample index): a
  row's draw does not depend on which host draws it."""
  from flax import nnx

  from gppo_jax.generation import continuous, sampler
  from gppo_jax.models import partitioning

  G, N = 2, 12
  graphdef, params = nnx.split(policy)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = partitioning.state_shardings(params, mesh)
  params = jax.device_put(params, shardings)
  if engine == "fixed":
    inner = sampler.MeshSampler(graphdef, shardings)
  else:
    inner = continuous.EngineSampler(graphdef, continuous.EngineConfig(slots=2, page_size=4), mesh)
  sp = sampler.SamplingParams(max_new_tokens=N, temperature=1.0, stop_ids=(2,), pad_id=0)
  prompts = [[5, 9, 14], [7, 3], [11, 12, 13, 4]]
  tokens, mask = sampler.left_pad([p for p in prompts for _ in range(G)], pad_id=0, length=6)
  key = jax.random.key(3)

  class Sent(Exception):
    pass

  def send_only(arrays, tag):  # host 1: what it would send
    raise Sent(arrays)

  one = async_rollout.HostShare(inner)
  one.processes, one.me = 2, 1
  monkeypatch.setattr(sharding, "exchange_host_arrays", send_only)
  with pytest.raises(Sent) as sent:
    one(params, tokens, mask, key, sp, group_size=G)
  share1 = sent.value.args[0]
  assert share1["tokens"].shape == (G, N)  # one prompt's rows
  zero = async_rollout.HostShare(inner)
  zero.processes, zero.me = 2, 0
  tags = []
  monkeypatch.setattr(
    sharding, "exchange_host_arrays", lambda arrays, tag: tags.append(tag) or [arrays, share1]
  )
  got = zero(params, tokens, mask, key, sp, group_size=G)
  assert got.tokens.shape == (3 * G, N) and zero.batch_multiple == 2 * inner.batch_multiple

  if engine == "fixed":
    ids = sampler.row_keys(key, np.repeat(np.arange(3), G), np.tile(np.arange(G), 3))
    want = inner(params, tokens, mask, ids, sp, group_size=G)
  else:
    want = inner(params, tokens, mask, key, sp, group_size=G)  # the engine's own row keys
  np.testing.assert_array_equal(got.tokens, np.asarray(want.tokens))
  np.testing.assert_array_equal(got.lengths, np.asarray(want.lengths))
  np.testing.assert_allclose(got.logprobs, np.asarray(want.logprobs), atol=1e-5)
  # Each call of an instance has its own tag, and no two instances share one (a later run in
  # the same process must not read an earlier run's values).
  zero(params, tokens, mask, key, sp, group_size=G)
  assert tags == [f"{zero._tag}/0", f"{zero._tag}/1"] and zero._tag != one._tag
  # Not one key for the whole batch: the rows of a plain call with `key` differ.
  if engine == "fixed":
    plain = inner(params, tokens, mask, key, sp, group_size=G)
    assert not np.array_equal(got.tokens, np.asarray(plain.tokens))
