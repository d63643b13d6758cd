"""Paged attention by JAX's TPU paged-attention kernel (`paged.pallas_attention`), run on CPU in
Pallas's TPU interpret mode: the kernel against the gather path, the shifted prompt layout it
needs, the engine's tokens and log-probs against the gather engine's, and the choice of path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from gppo_jax.generation import continuous, paged, sampler
from gppo_jax.models import architectures
from gppo_jax.models import model as model_lib


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_kernel_matches_the_gather_path(softcap):
  """GQA (4 query heads over 2 KV heads), a scale, rows of different lengths over scattered
  pages of one layer of several, a row not live (zeros, not read)."""
  rng = np.random.default_rng(0)
  S, H, K, Dh, ps, L, per_row = 5, 4, 2, 16, 4, 3, 6
  num_pages = 1 + S * per_row
  shape = (K, L, num_pages, ps, Dh)
  pool_k = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # the kernel reads bfloat16
  pool_v = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  table = jnp.asarray(1 + rng.permutation(S * per_row).reshape(S, per_row), jnp.int32)
  query_slot = jnp.asarray([0, 3, 9, 23, 17], jnp.int32)  # 1 to 24 keys, page edges included
  live = jnp.asarray([True, True, True, True, False])
  q = jnp.asarray(rng.normal(size=(S, 1, H, Dh)), jnp.float32)
  args = (q, pool_k, pool_v, 1, table)
  want = paged.paged_attention(
    *args, jnp.zeros(S, jnp.int32), query_slot, scale=0.3, softcap=softcap
  )
  with pltpu.force_tpu_interpret_mode():
    got = paged.pallas_attention(*args, query_slot, live, scale=0.3, softcap=softcap)
  np.testing.assert_allclose(np.asarray(got)[:4], np.asarray(want)[:4], atol=1e-5)
  assert (np.asarray(got)[4] == 0).all()


def test_shifted_prefill_puts_each_prompt_at_slot_zero():
  """write_prefill with shift: a prompt's real slots start at logical slot 0 of its samples'
  page tables (its full pages shared, its partial last page copied to each sample's own first
  page); without: the dense cache's slots as they are. Float32, exact."""
  rng = np.random.default_rng(1)
  L, M, P, K, Dh, ps, G = 2, 3, 12, 2, 4, 4, 2
  n = np.array([12, 5, 8])  # real tokens: a whole prompt, a partial last page, two full pages
  cache = model_lib.KVCache(
    k=jnp.asarray(rng.normal(size=(L, M, P, K, Dh)), jnp.float32),
    v=jnp.asarray(rng.normal(size=(L, M, P, K, Dh)), jnp.float32),
    mask=jnp.asarray(np.arange(P)[None] >= (P - n)[:, None]),
  )
  pool = paged.PagePool(k=jnp.zeros((K, L, 40, ps, Dh)), v=jnp.zeros((K, L, 40, ps, Dh)))
  pages = np.zeros((M, P // ps), np.int32)
  tail = np.zeros((M, G), np.int32)
  free = iter(range(1, 40))
  tables = []
  for m in range(M):
    shared = [next(free) for _ in range(n[m] // ps)]
    pages[m, : len(shared)] = shared
    for g in range(G):
      own = [next(free)] if n[m] % ps else []
      tail[m, g] = own[0] if own else paged.TRASH_PAGE
      tables.append((m, shared + own))
  out = paged.write_prefill(
    pool, cache, jnp.asarray(pages), shift=jnp.asarray(P - n, jnp.int32), tail=jnp.asarray(tail)
  )
  for m, table in tables:
    logical = np.asarray(out.k)[:, :, table].reshape(K, L, -1, Dh)[:, :, : n[m]]
    want = np.moveaxis(np.asarray(cache.k)[:, m, P - n[m] :], 2, 0)  # [K, L, n, Dh]
    np.testing.assert_array_equal(logical, want)
  # Unshifted: the gather path's layout, the whole padded row in the prompt's pages.
  plain = paged.write_prefill(pool, cache, jnp.asarray(np.arange(1, 10).reshape(M, P // ps)))
  got = np.asarray(plain.v)[:, :, 1:10].reshape(K, L, M, P, Dh)
  np.testing.assert_array_equal(got, np.moveaxis(np.asarray(cache.v), 3, 0))


def _engine_pair(cfg, prompts, sp, G, **engine):
  graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  key = jax.random.key(3)
  outs = {}
  for impl in ("gather", "pallas"):
    config = continuous.EngineConfig(attention=impl, **engine)
    eng = continuous.ContinuousSampler(graphdef, sp, config)
    with pltpu.force_tpu_interpret_mode():
      outs[impl] = eng(params, prompts, key, group_size=G)
    assert eng.attention == impl
  return outs["gather"], outs["pallas"]


@pytest.mark.parametrize(
  "overrides",
  [
    dict(attn_softcap=2.0),  # every layer on the kernel, soft-capped
    dict(sliding_window=3, local_layers=(0,), query_pre_attn_scalar=24),  # a local layer: gather
  ],
)
def test_engine_on_the_kernel_draws_what_the_gather_engine_draws(overrides):
  """bfloat16 cache (the kernel's), GQA, left-padded prompts of different lengths (a partial
  last page, a whole one, one shorter than a page), samples sharing their prompt's pages, rows
  stopping at different steps."""
  cfg = architectures.get("char-tiny", vocab_size=40, dtype="bfloat16", **overrides)
  assert cfg.num_heads > cfg.num_kv_heads
  prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [13, 14]]
  sp = sampler.SamplingParams(max_new_tokens=7, stop_ids=(1, 2), pad_id=0)
  want, got = _engine_pair(cfg, prompts, sp, G=2, slots=4, page_size=4, chunk=4)
  assert want.lengths.min() < want.lengths.max()
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_choice_of_path(monkeypatch):
  """auto: pallas on TPU only where the kernel is exact and fits; pallas refuses a float32
  cache, a model whose every layer slides, a CPU outside interpret mode;
  an unknown name is named; several batch shards take it too."""
  bf16 = architectures.get("char-tiny", dtype="bfloat16", head_dim=128)
  resolve = paged.resolve_attention
  assert resolve("auto", bf16, 16, backend="tpu") == "pallas"
  assert resolve("auto", bf16, 16, backend="cpu") == "gather"
  assert resolve("auto", bf16, 8, backend="tpu") == "gather"  # page below the bf16 tile
  assert resolve("gather", bf16, 16, backend="tpu") == "gather"
  f32 = architectures.get("char-tiny", head_dim=128)
  assert resolve("auto", f32, 16, backend="tpu") == "gather"
  with pytest.raises(ValueError, match="rounds keys and values to bfloat16"):
    resolve("pallas", f32, 16, backend="tpu")
  sliding = architectures.get(
    "char-tiny", dtype="bfloat16", head_dim=128, sliding_window=4, local_layers=(0, 1)
  )
  with pytest.raises(ValueError, match="every layer has a sliding window"):
    resolve("pallas", sliding, 16, backend="tpu")
  with pytest.raises(ValueError, match="needs a TPU"):
    resolve("pallas", bf16, 16, backend="cpu")
  with pltpu.force_tpu_interpret_mode():
    assert resolve("pallas", bf16, 16, backend="cpu") == "pallas"
  with pytest.raises(ValueError, match="valid: auto, gather, pallas"):
    continuous.EngineConfig(attention="flash")
  from gppo_jax.models import sharding

  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  graphdef, _ = nnx.split(model_lib.Transformer(bf16, rngs=nnx.Rngs(0)))
  sp = sampler.SamplingParams(max_new_tokens=4, pad_id=0)
  engine = lambda impl: continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=4, page_size=16, attention=impl), mesh
  )
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert engine("auto")._attention(bf16) == "pallas"  # per batch shard
  assert engine("gather")._attention(bf16) == "gather"


def _kernel_stand_in(seen):
  """The TPU kernel's contract (`paged_attention(q [B, H, Dh], k/v pages [K, pages, ps, Dh],
  lengths [B], page_indices [B, n])`: each query over the first `lengths` slots of its pages) in
  plain JAX; records each call's query shape and the mesh axes manual where it runs."""

  def paged_attention(q, k_pages, v_pages, lengths, page_indices, *, attn_logits_soft_cap=None,
                      pages_per_compute_block, **unused):  # fmt: skip
    seen.append((q.shape, tuple(sorted(jax.sharding.get_abstract_mesh().manual_axes))))
    B, H, Dh = q.shape
    K = k_pages.shape[0]
    keys = lambda pages: pages[:, page_indices].reshape(K, B, -1, Dh).astype(jnp.float32)
    s = jnp.einsum("bkgd,kbtd->bkgt", q.reshape(B, K, H // K, Dh), keys(k_pages))
    if attn_logits_soft_cap:
      s = jnp.tanh(s / attn_logits_soft_cap) * attn_logits_soft_cap
    ok = (jnp.arange(s.shape[-1])[None] < lengths[:, None])[:, None, None]
    p = jax.nn.softmax(jnp.where(ok, s, -1e30), axis=-1) * ok
    return jnp.einsum("bkgt,kbtd->bkgd", p, keys(v_pages)).reshape(B, H, Dh)

  return paged_attention


def test_kernel_runs_per_batch_shard(monkeypatch):
  """On a mesh of 4 batch shards (data 2 x fsdp 2) the kernel is called inside a shard_map manual
  over them, once per shard on its own group (8 slots / 4 = 2 queries), and the engine draws what
  the gather engine draws. The kernel is a plain-JAX stand-in here: Pallas's TPU interpret mode
  runs callbacks that vmap (the engine's over groups) cannot batch."""
  from jax.experimental.pallas.ops.tpu import paged_attention as kernel

  from gppo_jax.models import partitioning, sharding

  seen = []
  monkeypatch.setattr(kernel, "paged_attention", _kernel_stand_in(seen))
  cfg = architectures.get("char-tiny", vocab_size=40, dtype="bfloat16", attn_softcap=2.0)
  graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2}, jax.devices()[:4])
  params = jax.device_put(params, partitioning.state_shardings(params, mesh))
  prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [13, 14], [7, 8, 9], [4]]
  sp = sampler.SamplingParams(max_new_tokens=7, stop_ids=(1, 2), pad_id=0)
  outs = {}
  for impl in ("gather", "pallas"):
    config = continuous.EngineConfig(slots=8, page_size=4, chunk=4, attention=impl)
    eng = continuous.ContinuousSampler(graphdef, sp, config, mesh)
    with pltpu.force_tpu_interpret_mode():  # lets "pallas" resolve on CPU
      outs[impl] = eng(params, prompts, jax.random.key(3), group_size=2)
    assert eng.attention == impl and eng.groups == 4
  want, got = outs["gather"], outs["pallas"]
  assert seen and set(seen) == {((2, cfg.num_heads, cfg.head_dim), ("data", "fsdp"))}
  assert want.lengths.min() < want.lengths.max()
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_config_field_reaches_the_engine():
  """rollout.paged_attention: validated by name and against model.dtype, and handed to the
  engine by the trainer's sample_fn."""
  from gppo_jax import config_lib, errors
  from gppo_jax.trainer import experiment

  config = config_lib.base()
  assert config.rollout.paged_attention == "auto"
  config.rollout.paged_attention = "flash"
  with pytest.raises(errors.ConfigError, match="rollout.paged_attention='flash'"):
    config_lib.validate(config)
  config.rollout.paged_attention = "pallas"
  with pytest.raises(errors.ConfigError, match="rounds keys and values to bfloat16"):
    config_lib.validate(config)
  config.model.dtype = "bfloat16"
  config_lib.validate(config)
  config.rollout.engine = "continuous"
  cfg = architectures.get("char-tiny", vocab_size=40)
  graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  from gppo_jax.models import partitioning, sharding

  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  got = experiment.sample_fn(config, graphdef, partitioning.state_shardings(params, mesh), mesh)
  assert got.engine.attention == "pallas"
