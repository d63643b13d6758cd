"""Continuous batching over the paged KV cache: paged attention against the dense reference, the
engine against the fixed-batch sampler, batch invariance over slot counts and prompt orders,
preemption, row limits and bad settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gppo_jax.generation import continuous, paged, sampler
from gppo_jax.models import architectures, attention
from gppo_jax.models import model as model_lib

G = 3
N = 24


@pytest.fixture(scope="module")
def policy():
  cfg = architectures.get("char-tiny", vocab_size=40)
  graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 40, rng.integers(2, 12))] for _ in range(7)]
  return cfg, graphdef, params, prompts


def _fixed(graphdef, params, prompts, key, sp, P, limits=None):
  """The fixed-batch sampler with the engine's row keys: the reference."""
  tokens, mask = sampler.left_pad([p for p in prompts for _ in range(G)], pad_id=0, length=P)
  keys = sampler.row_keys(
    key, np.repeat(np.arange(len(prompts)), G), np.tile(np.arange(G), len(prompts))
  )
  out = sampler.sample(
    graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), keys, sp, group_size=G,
    row_limits=None if limits is None else jnp.asarray(limits),
  )  # fmt: skip
  return jax.device_get(out)


def test_paged_attention_matches_dense_attention():
  rng = np.random.default_rng(0)
  S, H, K, Dh, ps, L, pages_per_row = 5, 4, 2, 8, 4, 2, 6
  num_pages = 1 + S * pages_per_row
  pool_k = jnp.asarray(rng.normal(size=(K, L, num_pages, ps, Dh)), jnp.float32)
  pool_v = jnp.asarray(rng.normal(size=(K, L, num_pages, ps, Dh)), jnp.float32)
  table = 1 + rng.permutation(S * pages_per_row).reshape(S, pages_per_row)  # scattered pages
  start = jnp.asarray(rng.integers(0, 5, S), jnp.int32)
  query_slot = jnp.asarray(rng.integers(5, ps * pages_per_row, S), jnp.int32)
  q = jnp.asarray(rng.normal(size=(S, 1, H, Dh)), jnp.float32)
  layer = 1
  got = paged.paged_attention(q, pool_k, pool_v, layer, jnp.asarray(table), start, query_slot)
  # Dense reference: each row's logical cache gathered whole, masked to [start, query_slot].
  rows = lambda x: jnp.moveaxis(x[:, layer][:, table], 0, -2)  # [S, pages, ps, K, Dh]
  keys = rows(pool_k).reshape(S, pages_per_row * ps, K, Dh)
  values = rows(pool_v).reshape(S, pages_per_row * ps, K, Dh)
  slots = jnp.arange(pages_per_row * ps)
  allowed = (slots[None] >= start[:, None]) & (slots[None] <= query_slot[:, None])
  want = attention.dense(q, keys, values, allowed[:, None, :])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [0, 5])
def test_engine_matches_the_fixed_batch_sampler(policy, top_k):
  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, stop_ids=(1, 2), pad_id=0, top_k=top_k)
  key = jax.random.key(3)
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=6, page_size=4, chunk=5)
  )
  got = engine(params, prompts, key, group_size=G)
  want = _fixed(graphdef, params, prompts, key, sp, engine.stats["prompt_len"])
  assert got.lengths.min() < got.lengths.max() == N  # stops and the cap both occur
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  np.testing.assert_allclose(got.entropy, want.entropy, atol=1e-5)


@pytest.mark.parametrize(
  "settings",
  [dict(num_topk=3), dict(top_k=4, top_p=0.8, logprobs_mode="truncated", num_topk=2)],
)
def test_engine_records_top_k_and_kept_sets_as_the_fixed_sampler(policy, settings):
  """The trainer's topk estimator and logprobs_mode="sampled" read these records."""
  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, stop_ids=(1,), pad_id=0, **settings)
  key = jax.random.key(4)
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=4, page_size=4, chunk=4)
  )
  got = engine(params, prompts, key, group_size=G)
  want = _fixed(graphdef, params, prompts, key, sp, engine.stats["prompt_len"])
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
  np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, atol=1e-5)
  if sp.kept_width:
    np.testing.assert_array_equal(got.kept_ids, want.kept_ids)
    assert (got.kept_ids[got.mask] >= 0).any() and (got.kept_ids[~got.mask] == -1).all()
  else:
    assert got.kept_ids is None
  assert np.isneginf(got.topk_logprobs[~got.mask]).all()  # padding as the fixed sampler pads


def test_samples_do_not_depend_on_slots_order_or_preemption(policy):
  """The same rollout with three slot counts (one with a pool small enough to preempt rows) and
  shuffled prompt order: identical tokens, log-probs within 1e-5, every prompt answered G times,
  through every compaction of the running batch and every preemption."""
  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, stop_ids=(1,), pad_id=0)
  key = jax.random.key(11)
  ref = None
  rng = np.random.default_rng(1)
  preempted = resumed = 0
  sizes = set()
  for slots, pages in ((3, None), (7, None), (12, 16)):
    order = rng.permutation(len(prompts))
    engine = continuous.ContinuousSampler(
      graphdef, sp, continuous.EngineConfig(slots=slots, page_size=4, chunk=3, num_pages=pages)
    )
    out = engine(
      params, [prompts[i] for i in order], key, group_size=G, prompt_ids=order, prompt_len=12
    )
    st = engine.stats
    preempted += st.get("preempted", 0)
    resumed += st.get("resumed_rows", 0)
    sizes |= set(st["batch_sizes"])
    # No token is drawn twice: a preempted row goes on from the tokens it has (one prefill of
    # prompt and response), so decode steps + one prefill draw per admission = the tokens.
    assert st["row_steps"] + st["admitted_rows"] == out.lengths.sum()
    # Back to the original prompt order: row i * G + j is sample j of prompt i.
    rows = np.concatenate(
      [np.arange(G) + G * np.flatnonzero(order == i)[0] for i in range(len(prompts))]
    )
    out = jax.tree.map(lambda x, rows=rows: x[rows], out)
    assert out.tokens.shape == (len(prompts) * G, N) and out.lengths.min() >= 1
    if ref is None:
      ref = out
      continue
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  # The small pool did preempt and resume rows (a preempted row that finished in the chunk
  # it was still running is not resumed), the running batch shrank through several compiled
  # sizes as rows finished, and the rows are the same throughout.
  assert 0 < resumed <= preempted
  assert len(sizes) >= 3 and min(sizes) <= 2


def test_more_samples_per_prompt_than_slots_are_served_as_asked(policy):
  """G = 5 samples per prompt on 4 slots: each prompt's samples are admitted in parts (each
  prefilling the prompt), and the rows are the ones the fixed sampler draws with the same keys."""
  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=8, stop_ids=(1,), pad_id=0)
  key = jax.random.key(2)
  engine = continuous.ContinuousSampler(graphdef, sp, continuous.EngineConfig(slots=4, page_size=4))
  got = engine(params, prompts[:3], key, group_size=5)
  P = engine.stats["prompt_len"]
  tokens, mask = sampler.left_pad([p for p in prompts[:3] for _ in range(5)], pad_id=0, length=P)
  keys = sampler.row_keys(key, np.repeat(np.arange(3), 5), np.tile(np.arange(5), 3))
  want = sampler.sample(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), keys, sp)
  np.testing.assert_array_equal(got.tokens, np.asarray(want.tokens))
  np.testing.assert_allclose(got.logprobs, np.asarray(want.logprobs), atol=1e-5)
  assert engine.stats["prefilled_prompts"] == 6  # 3 prompts x 2 parts


def test_row_limits_end_rows_on_both_paths(policy):
  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, pad_id=0)  # no stop token: only the limits end rows
  key = jax.random.key(5)
  limits = np.random.default_rng(2).integers(1, N + 1, len(prompts) * G).astype(np.int32)
  engine = continuous.ContinuousSampler(graphdef, sp, continuous.EngineConfig(slots=5, page_size=8))
  got = engine(params, prompts, key, group_size=G, row_limits=limits)
  np.testing.assert_array_equal(got.lengths, limits)
  want = _fixed(graphdef, params, prompts, key, sp, engine.stats["prompt_len"], limits)
  np.testing.assert_array_equal(np.asarray(want.lengths), limits)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_memory_follows_the_tokens_held_and_programs_compile_once(policy):
  """Short rows in a long budget: the pool the engine sizes is a fraction of the fixed batch's
  rows x (prompt + max_new_tokens) cache, its peak use smaller still, and a second call with
  another number of prompts compiles no new decode program."""
  cfg, graphdef, params, prompts = policy
  n = 256
  sp = sampler.SamplingParams(max_new_tokens=n, pad_id=0)
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=6, page_size=8, chunk=8)
  )
  limits = np.random.default_rng(0).integers(1, 40, len(prompts) * G)
  engine(params, prompts, jax.random.key(0), group_size=G, row_limits=limits, prompt_len=16)
  fixed = continuous.kv_bytes_fixed(cfg, 6, 16, n)
  assert engine.stats["pool_bytes"] < 0.7 * fixed
  page_bytes = engine.stats["pool_bytes"] / engine.stats["num_pages"]
  assert engine.stats["peak_pages"] * page_bytes < 0.3 * fixed
  assert "preempted" not in engine.stats
  compiled = continuous._decode._cache_size()
  engine(
    params, prompts[:4], jax.random.key(1), group_size=G, row_limits=limits[: 4 * G], prompt_len=16
  )
  assert continuous._decode._cache_size() == compiled


def test_bad_settings_are_named(policy):
  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, pad_id=0)
  with pytest.raises(ValueError, match="EngineConfig.slots must be >= 1"):
    continuous.EngineConfig(slots=0)
  small = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(page_size=4, num_pages=3)
  )
  with pytest.raises(ValueError, match="holds fewer than the"):
    small(params, prompts, jax.random.key(0), group_size=G)
  engine = continuous.ContinuousSampler(graphdef, sp, continuous.EngineConfig(slots=4))
  with pytest.raises(ValueError, match="group_size=0 must be >= 1"):
    engine(params, prompts, jax.random.key(0), group_size=0)
  with pytest.raises(ValueError, match="give num_pages or kv_memory_gib, not both"):
    continuous.EngineConfig(num_pages=10, kv_memory_gib=1.0)
  tiny = continuous.ContinuousSampler(graphdef, sp, continuous.EngineConfig(kv_memory_gib=1e-6))
  with pytest.raises(ValueError, match=r"kv_memory_gib=1e-06 \(\d+ pages\) holds fewer than"):
    tiny(params, prompts, jax.random.key(0), group_size=G)
  sampler_call = continuous.EngineSampler(graphdef, continuous.EngineConfig(slots=4))
  rows = np.ones((6, 5), np.int32)
  with pytest.raises(ValueError, match="rows do not come in runs of 3 identical prompts"):
    sampler_call(params, rows * np.arange(6)[:, None], rows > 0, jax.random.key(0), sp,
                 group_size=3)  # fmt: skip
  with pytest.raises(ValueError, match="row_limits: one limit in"):
    engine(params, prompts, jax.random.key(0), group_size=G, row_limits=np.zeros(len(prompts) * G))


@pytest.mark.parametrize("mesh_shape", [{"data": 4}, {"data": 2, "fsdp": 2}])
def test_engine_on_a_mesh_matches_one_device(policy, mesh_shape):
  """On a mesh the slots split into one group per batch shard, each with a pool of its own on its
  devices, the parameters sharded as the trainer shards them: the same samples as on one device
  (batch invariance), every prompt answered G times, with a pool small enough to preempt."""
  from gppo_jax.models import partitioning, sharding

  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, stop_ids=(1,), pad_id=0, num_topk=2)
  key = jax.random.key(5)
  one = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=8, page_size=4, chunk=3)
  )
  want = one(params, prompts, key, group_size=G)
  mesh = sharding.make_mesh(mesh_shape, jax.devices()[:4])
  sharded = jax.device_put(params, partitioning.state_shardings(params, mesh))
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=16, page_size=4, chunk=3, num_pages=4 * 10), mesh
  )
  got = engine(sharded, prompts, key, group_size=G)
  assert engine.groups == 4 and engine.stats["preempted"] > 0
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, atol=1e-5)
  with pytest.raises(ValueError, match="multiple of the mesh's 4 batch shards"):
    continuous.ContinuousSampler(graphdef, sp, continuous.EngineConfig(slots=6), mesh)


def test_training_with_the_continuous_engine(tmp_path):
  """`python -m gppo_jax.train` with rollout.engine="continuous": a smoke run end to end
  (rollouts and evaluations) with fewer slots than rows, on one device and on a mesh of two."""
  import json
  import os
  import subprocess
  import sys

  from conftest import one_device_env

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [
    sys.executable, "-m", "gppo_jax.train", "--config=configs/kl_atomic.py:smoke",
    "--config.iterations=2", "--config.eval.every=2", "--config.eval.num_problems=8",
    "--config.rollout.engine=continuous", "--config.rollout.slots=16",
    "--config.rollout.page_size=4", "--config.rollout.decode_chunk=4",
  ]  # fmt: skip
  wd = str(tmp_path / "run")
  done = subprocess.run(
    [*cmd, f"--workdir={wd}"], cwd=repo, env=one_device_env(), capture_output=True, text=True,
    timeout=600,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert all(np.isfinite(r["loss/total"]) for r in rows[1:])
  assert 0 <= rows[-1]["eval/accuracy"] <= 1
  # The engine's figures reach the run's metrics every iteration.
  for r in rows[1:]:
    assert 0 < r["rollout/engine/busy_share"] <= 1 and r["rollout/engine/decode_steps"] >= 1
    assert 1 <= r["rollout/engine/batch_min"] <= r["rollout/engine/batch_max"] <= 16
    assert r["rollout/engine/peak_pages"] <= r["rollout/engine/pool_pages"]
    assert r["rollout/engine/host_wait_s"] >= 0 and r["rollout/engine/preempted"] >= 0
  env = dict(one_device_env())
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
  wd = str(tmp_path / "run2")
  two = subprocess.run(
    [*cmd, f"--workdir={wd}"], cwd=repo, env=env, capture_output=True, text=True, timeout=600
  )
  assert two.returncode == 0, two.stderr[-3000:]
  rows = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert all(np.isfinite(r["loss/total"]) for r in rows[1:])


def test_page_table_shares_prompt_pages_and_frees_them_with_the_last_reader():
  pages = paged.PageTable(num_pages=12, slots=3, max_pages=5, prompt_pages=2, page_size=4)
  assert pages.in_use == 0 and len(pages.free) == 11  # page 0 is never handed out
  shared = pages.take_prompt([0, 2])
  assert (pages.table[0, :2] == shared).all() and (pages.table[2, :2] == shared).all()
  pages.grow(0, upto=13)  # slots [0, 13): 4 pages, 2 of them the prompt's
  pages.grow(2, upto=9)
  assert pages.own_pages(0) == 2 and pages.own_pages(2) == 1 and pages.in_use == 5
  assert pages.wanted(0, 13) == 0 and pages.wanted(0, 17) == 1
  assert len({*pages.table[0], *pages.table[2]} - {paged.TRASH_PAGE}) == 5  # no page twice
  pages.release(0)
  assert pages.in_use == 3 and (pages.table[0] == paged.TRASH_PAGE).all()  # prompt still read
  pages.release(2)
  assert pages.in_use == 0 and sorted(pages.free) == list(range(1, 12))


def test_auto_engine_picks_continuous_batching_at_real_response_lengths():
  """rollout.engine="auto" (the default): fixed batches for the built-in task's few-token
  answers, continuous batching from AUTO_MIN_NEW_TOKENS on, on one device or a mesh; explicit
  choices win; an unknown one is a config error naming the choices."""
  from gppo_jax import config_lib, errors
  from gppo_jax.models import partitioning, sharding
  from gppo_jax.trainer import experiment

  cfg = architectures.get("char-tiny", vocab_size=40)
  graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  config = config_lib.base()
  assert config.rollout.engine == "auto"
  n = continuous.AUTO_MIN_NEW_TOKENS
  assert continuous.engine_for("auto", n - 1) == "fixed"
  assert continuous.engine_for("auto", n) == "continuous"
  assert continuous.engine_for("continuous", 8) == "continuous"
  assert continuous.engine_for("fixed", 10 * n) == "fixed"
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  shardings = partitioning.state_shardings(params, mesh)
  for max_new, want in ((8, sampler.MeshSampler), (n, continuous.EngineSampler)):
    config.rollout.max_new_tokens = max_new
    got = experiment.sample_fn(config, graphdef, shardings, mesh)
    assert type(got) is want
  assert got.engine.slots % 2 == 0
  config.rollout.slots = 3
  with pytest.raises(errors.ConfigError, match="multiple of the mesh's 2 batch shards"):
    experiment.sample_fn(config, graphdef, shardings, mesh)
  config.rollout.slots = 0
  config.rollout.engine = "paged"
  with pytest.raises(errors.ConfigError, match="rollout.engine"):
    config_lib.validate(config)


def test_pool_sized_from_memory(policy):
  """rollout.kv_memory_gib sizes the pool from memory (its pages over the shards' pools), is
  handed to the engine by the trainer's sample_fn, and cannot be set beside rollout.kv_pages."""
  from gppo_jax import config_lib, errors
  from gppo_jax.models import partitioning, sharding
  from gppo_jax.trainer import experiment

  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, stop_ids=(1,), pad_id=0)
  gib = 200 * paged.pool_bytes(cfg, 1, 4) / 2**30  # 200 pages of 4 slots
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=6, page_size=4, kv_memory_gib=gib)
  )
  out = engine(params, prompts, jax.random.key(0), group_size=G)
  assert engine.stats["num_pages"] == 200 and out.lengths.min() >= 1
  config = config_lib.base()
  config.rollout.engine = "continuous"
  config.rollout.kv_memory_gib = 0.5
  config_lib.validate(config)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  got = experiment.sample_fn(config, graphdef, partitioning.state_shardings(params, mesh), mesh)
  assert got.engine.kv_memory_gib == 0.5 and got.engine.num_pages is None
  config.rollout.kv_pages = 100
  with pytest.raises(errors.ConfigError, match="the pool is sized by one of them"):
    config_lib.validate(config)


def test_slots_follow_a_pool_given_by_memory(policy, monkeypatch):
  """With the pool given by memory (kv_memory_gib, or kv_memory_fraction of the devices' free
  memory) and slots=0, each call takes as many slots as the pool holds rows at the expected
  footprint (1 reserved page, a prompt's pages per G rows, a third of max_new_tokens and two
  chunks per row), at most the call's rows, times the batch shards: every row is served, the
  same rows as with a set slot count, and rollout/engine/slots says how many it took. A backend
  without memory figures (CPU) is told to use kv_memory_gib."""
  from gppo_jax import config_lib, errors
  from gppo_jax.models import partitioning, sharding
  from gppo_jax.trainer import experiment

  cfg, graphdef, params, prompts = policy
  sp = sampler.SamplingParams(max_new_tokens=N, stop_ids=(1,), pad_id=0)
  ps, chunk, P, rows = 4, 3, 12, len(prompts) * G
  page = paged.pool_bytes(cfg, 1, ps)
  footprint = lambda n: 1 + -(-n // min(G, n)) * (P // ps) + n * -(-(N // 3 + 2 * chunk) // ps)
  fits = lambda pages: max(n for n in range(1, rows + 1) if footprint(n) <= pages)
  pages = 40
  assert 1 < fits(pages) < rows  # served in waves
  tokens, mask = sampler.left_pad([p for p in prompts for _ in range(G)], pad_id=0, length=P)
  key = jax.random.key(7)
  sized = lambda **memory: continuous.EngineConfig(slots=0, page_size=ps, chunk=chunk, **memory)
  call = continuous.EngineSampler(graphdef, sized(kv_memory_gib=pages * page / 2**30))
  got = call(params, tokens, mask, key, sp, group_size=G)
  metrics = call.metrics()
  assert metrics["rollout/engine/slots"] == fits(pages) == 7
  assert metrics["rollout/engine/pool_pages"] == pages
  fixed_slots = continuous.EngineSampler(
    graphdef, continuous.EngineConfig(slots=4, page_size=ps, chunk=chunk)
  )
  want = fixed_slots(params, tokens, mask, key, sp, group_size=G)
  assert got.tokens.shape == (rows, N) and got.lengths.min() >= 1
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  # A pool for every row: as many slots as rows, no more.
  big = continuous.EngineSampler(graphdef, sized(kv_memory_gib=1000 * page / 2**30))
  assert big.slots_for(params, sp, P, G, rows) == rows

  # kv_memory_fraction: a share of the least free memory of the sampler's devices, the same on
  # every batch shard (faked: CPU devices report none).
  in_use = {d.id: (20 + 10 * d.id) * page for d in jax.devices()}
  fake = lambda device: {"bytes_limit": 100 * page, "bytes_in_use": in_use[device.id]}
  with monkeypatch.context() as patch:
    patch.setattr(type(jax.devices()[0]), "memory_stats", fake)
    assert continuous.free_memory_bytes(0.5) == 80 * page
    call = continuous.EngineSampler(graphdef, sized(kv_memory_fraction=0.5))
    got = call(params, tokens, mask, key, sp, group_size=G)  # 0.5 x 80 pages: as above
    assert call.free_bytes == 80 * page
    sized_as_before = ("rollout/engine/slots", "rollout/engine/pool_pages")
    assert all(call.metrics()[k] == metrics[k] for k in sized_as_before)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])  # device 1: 70 pages free
    on_mesh = continuous.EngineSampler(graphdef, sized(kv_memory_fraction=0.5), mesh)
    assert on_mesh.slots_for(params, sp, P, G, rows) == 2 * fits(35)
    engine = continuous.ContinuousSampler(
      graphdef, sp, continuous.EngineConfig(slots=2, page_size=ps, kv_memory_fraction=0.5), mesh
    )
    assert engine.pool_pages(P, G, model_cfg=cfg) == 35
  with pytest.raises(errors.ConfigError, match=r"rollout.kv_memory_fraction=0.5: the cpu devices "
                     r"report no memory figures.*use.*rollout.kv_memory_gib"):  # fmt: skip
    continuous.EngineSampler(graphdef, sized(kv_memory_fraction=0.5))

  # The trainer's config: slots=0 with the pool given by memory leaves the slots to the pool;
  # one way of sizing the pool at a time.
  config = config_lib.base()
  config.rollout.engine = "continuous"
  config.rollout.kv_memory_gib = 0.5
  config_lib.validate(config)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = partitioning.state_shardings(params, mesh)
  assert experiment.sample_fn(config, graphdef, shardings, mesh).engine.slots == 0
  config.rollout.kv_memory_gib = 0.0
  config.rollout.kv_memory_fraction = 0.9
  config_lib.validate(config)
  with pytest.raises(errors.ConfigError, match="rollout.kv_memory_fraction=0.9: the cpu"):
    experiment.sample_fn(config, graphdef, shardings, mesh)
  config.rollout.kv_memory_gib = 0.5
  with pytest.raises(errors.ConfigError, match="rollout.kv_memory_gib=0.5 and rollout."
                     r"kv_memory_fraction=0.9: the pool is sized by one of them"):  # fmt: skip
    config_lib.validate(config)
  config.rollout.kv_memory_gib, config.rollout.kv_pages = 0.0, 100
  with pytest.raises(errors.ConfigError, match="rollout.kv_pages=100 and rollout."
                     r"kv_memory_fraction=0.9: the pool is sized by one of them"):  # fmt: skip
    config_lib.validate(config)
  with pytest.raises(ValueError, match="give one of num_pages, kv_memory_gib, kv_memory_fraction"):
    continuous.EngineConfig(kv_memory_gib=1.0, kv_memory_fraction=0.5)
  with pytest.raises(ValueError, match=r"slots must be >= 1, got 0 \(0: from a pool given by"):
    continuous.EngineConfig(slots=0, num_pages=10)
