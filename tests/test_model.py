"""Transformer properties: chunked heads equal naive ones, padding, causality, cache, sharding."""

import dataclasses

import chex
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gppo_jax import errors
from gppo_jax.models import architectures, attention, heads, low_precision, model, partitioning

CFG = architectures.get("tiny", attention_bias=True, qk_norm=True, family="qwen3")


# `policy` (conftest.py): this CFG with random weights.


def _batch(B=3, T=13, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, size=(B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[0, :4] = False
  mask[1, :1] = False
  tokens[~mask] = CFG.pad_token_id
  positions = np.asarray(model.positions_from_mask(jnp.asarray(mask)))
  targets = np.roll(tokens, -1, axis=1)
  return tokens, mask, positions, targets


@nnx.jit
def _hidden(m, tokens, mask, positions):
  return m(tokens, positions, attn_mask=mask).hidden


def _naive(m, hidden, targets, temperature):
  logp = jax.nn.log_softmax(m.logits(hidden) / temperature, axis=-1)
  return logp, jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


@pytest.mark.parametrize(
  "x_shape, w_shape, contract, spec",
  [
    ((2, 3, 5), (5, 7), 1, "btd,df->btf"),  # MLP
    ((2, 3, 5), (5, 4, 6), 1, "btd,dhe->bthe"),  # q/k/v heads
    ((2, 3, 4, 6), (4, 6, 5), 2, "bthe,hed->btd"),  # output projection
    ((3, 5), (5, 7), 1, "bd,df->bf"),  # a decode step's single token
  ],
)
def test_project_equals_the_einsum_in_values_and_gradients(x_shape, w_shape, contract, spec):
  kx, kw = jax.random.split(jax.random.key(0))
  x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
  got = low_precision.project(x, w, contract)
  want = jnp.einsum(spec, x, w)
  chex.assert_shape(got, want.shape)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  cot = jax.random.normal(jax.random.key(1), want.shape)
  g_got = jax.grad(lambda x, w: jnp.sum(low_precision.project(x, w, contract) * cot), (0, 1))(x, w)
  g_want = jax.grad(lambda x, w: jnp.sum(jnp.einsum(spec, x, w) * cot), (0, 1))(x, w)
  for a, b in zip(g_got, g_want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# padded multi-chunk; one capped chunk; the default (these logits are small: one plain piece)
@pytest.mark.user_xla
@pytest.mark.parametrize("chunk_size", [5, 64, None])
def test_chunked_stats_equal_naive(policy, chunk_size):
  tokens, mask, positions, targets = _batch()
  hidden = _hidden(policy, tokens, mask, positions)
  ids = np.stack([targets, (targets * 7 + 3) % CFG.vocab_size], -1)
  stats = jax.jit(
    lambda h, t, i: heads.chunked_logprobs(
      policy, h, t, temperature=0.7, chunk_size=chunk_size, gather_ids=i, entropy=True, top_k=4
    )
  )(hidden, targets, ids)
  logp, want = _naive(policy, hidden, targets, 0.7)
  chex.assert_trees_all_close(stats["logprobs"], want, atol=1e-5)
  chex.assert_trees_all_close(
    stats["gathered_logprobs"], jnp.take_along_axis(logp, jnp.asarray(ids), -1), atol=1e-5
  )
  ent = -jnp.sum(jnp.exp(logp) * logp, -1)
  chex.assert_trees_all_close(stats["entropy"], ent, atol=1e-5)
  top_vals, top_ids = jax.lax.top_k(logp, 4)
  chex.assert_trees_all_close(stats["topk_logprobs"], top_vals, atol=1e-5)
  np.testing.assert_array_equal(stats["topk_ids"], top_ids)


@pytest.mark.parametrize("chunk_size", [3, None])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_gradients_equal_naive(tied, chunk_size):
  """d/d(hidden, W) of log-prob + entropy terms: the chunked scan under remat is exact, and so
  is the default's single plain piece."""
  rng = np.random.default_rng(2)
  B, T, D, V = 2, 11, 16, 40
  hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((V, D) if tied else (D, V)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)))
  weights = jnp.asarray(rng.random((B, T)), jnp.float32)

  def chunked(h, w):
    s = heads.chunked_logprob_stats(
      h, w, targets, tied=tied, temperature=0.8, chunk_size=chunk_size, entropy=True
    )
    return jnp.sum(weights * (s["logprobs"] + 0.3 * s["entropy"]))

  def naive(h, w):
    logits = jnp.einsum("btd,vd->btv" if tied else "btd,dv->btv", h, w) / 0.8
    logp = jax.nn.log_softmax(logits, -1)
    lp = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(weights * (lp - 0.3 * jnp.sum(jnp.exp(logp) * logp, -1)))

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, w)
  chex.assert_trees_all_close(grad(chunked), grad(naive), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [3, None])
@pytest.mark.parametrize("tied", [False, True])
def test_bf16_head_backward_multiplies_bf16_operands_and_matches_float32(tied, chunk_size):
  """With bf16 hidden states the head's backward runs its two matmuls on bf16 operands (autodiff
  would multiply the float32 logits cotangent by bf16 W: a float32 matmul, TF32 on a GPU), and
  its gradients stay within bf16 rounding of the float32 head's; W's gradient keeps W's dtype."""
  rng = np.random.default_rng(3)
  B, T, D, V = 2, 11, 32, 96
  hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  w = jnp.asarray(0.3 * rng.standard_normal((V, D) if tied else (D, V)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)))
  weights = jnp.asarray(rng.random((B, T)), jnp.float32)

  def loss(h, w):
    s = heads.chunked_logprob_stats(h, w, targets, tied=tied, chunk_size=chunk_size, entropy=True)
    return jnp.sum(weights * (s["logprobs"] + 0.3 * s["entropy"]))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  dh, dw = grad(hidden.astype(jnp.bfloat16), w)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  ref_dh, ref_dw = grad(hidden.astype(jnp.bfloat16).astype(jnp.float32), w)
  for got, want in ((dh, ref_dh), (dw, ref_dw)):
    err = jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want)
    assert err < 2e-2, err
  jaxpr = jax.make_jaxpr(grad)(hidden.astype(jnp.bfloat16), w).jaxpr
  dots = [e for e in conftest.all_eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) >= 3  # the forward, then dh and dW
  assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), [
    [v.aval.dtype for v in e.invars] for e in dots
  ]


def test_default_head_chunks_and_rematerialises_only_large_logits(monkeypatch):
  """chunk_size None: logits within ONE_CHUNK_BYTES run as one piece without remat; past it the
  head walks CHUNK_SIZE-position chunks under jax.checkpoint, as an explicit chunk_size does."""
  B, T, D, V = 2, 300, 8, 64
  h, w = jnp.zeros((B, T, D)), jnp.zeros((D, V))
  targets = jnp.zeros((B, T), jnp.int32)

  def program(**kw):
    loss = lambda h: jnp.sum(heads.chunked_logprob_stats(h, w, targets, **kw)["logprobs"])
    return str(jax.make_jaxpr(jax.grad(loss))(h))

  assert B * T * V * 4 <= heads.ONE_CHUNK_BYTES
  assert "checkpoint" not in program() and "remat" not in program()
  assert "checkpoint" in program(chunk_size=128) or "remat" in program(chunk_size=128)
  monkeypatch.setattr(heads, "ONE_CHUNK_BYTES", B * T * V * 4 - 1)
  big = program()
  assert "checkpoint" in big or "remat" in big
  assert f"{B},{heads.CHUNK_SIZE},{V}" in big.replace(" ", "")  # [B, 128, V] chunk logits


def test_left_padding_and_causality(policy):
  tokens, mask, positions, _ = _batch()
  hidden = np.asarray(_hidden(policy, tokens, mask, positions))
  # Row 0 without its 4 pads (padded on the right instead) gives the same real-token states.
  unpadded = np.concatenate([tokens[:1, 4:], np.full((1, 4), 5, np.int32)], axis=1)
  alone = np.asarray(
    _hidden(policy, unpadded, np.ones_like(mask[:1]), np.arange(13, dtype=np.int32)[None])
  )
  np.testing.assert_allclose(alone[0, :9], hidden[0, 4:], atol=1e-5)
  # Changing a later token never changes earlier states.
  changed = tokens.copy()
  changed[:, 8] = (changed[:, 8] + 1) % CFG.vocab_size
  hidden2 = np.asarray(_hidden(policy, changed, mask, positions))
  np.testing.assert_allclose(hidden2[:, :8], hidden[:, :8], atol=1e-6)
  assert np.abs(hidden2[:, 8:] - hidden[:, 8:]).max() > 1e-3


@pytest.mark.user_xla
def test_kv_cache_matches_full_forward(policy):
  tokens, mask, positions, _ = _batch()
  want = np.asarray(_hidden(policy, tokens, mask, positions))
  graphdef, state = nnx.split(policy)

  @jax.jit
  def decode(state):
    m = nnx.merge(graphdef, state)
    cache = model.init_cache(CFG, 3, 16)
    out = m(tokens[:, :6], positions[:, :6], attn_mask=mask[:, :6], cache=cache, cache_index=0)
    h0, cache = out.hidden, out.cache
    out = m(tokens[:, 6:9], positions[:, 6:9], cache=cache, cache_index=6)  # 3-token chunk
    h1, cache = out.hidden, out.cache

    def step(cache, i):
      tok = jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
      pos = jax.lax.dynamic_slice_in_dim(positions, i, 1, axis=1)
      out = m(tok, pos, cache=cache, cache_index=i)
      return out.cache, out.hidden[:, 0]

    cache, hs = jax.lax.scan(step, cache, jnp.arange(9, 13))
    return jnp.concatenate([h0, h1, hs.swapaxes(0, 1)], axis=1), cache

  got, cache = decode(state)
  np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=1e-5)
  assert cache.k.shape == (CFG.num_layers, 3, 16, CFG.num_kv_heads, CFG.head_dim)
  np.testing.assert_array_equal(np.asarray(cache.mask), np.pad(mask, ((0, 0), (0, 3))))


def test_decode_step_matches_full_forward(policy):
  """The unrolled decode step (`decode_weights`, a `LayerCache` made from a prefill's stacked
  cache and grown on the way, as the sampler's phases do) gives the full forward's logits."""
  tokens, mask, positions, _ = _batch()
  want = np.asarray(policy.logits(_hidden(policy, tokens, mask, positions)))
  graphdef, state = nnx.split(policy)

  @jax.jit
  def decode(state):
    m = nnx.merge(graphdef, state)
    first = (tokens[:, :9], positions[:, :9])
    prefill = m(*first, attn_mask=mask[:, :9], cache=model.init_cache(CFG, 3, 9), cache_index=0)
    cache = model.LayerCache.from_stacked(prefill.cache).grow(11)
    weights = model.decode_weights(m)
    out = []
    for i in range(9, 13):
      cache = cache.grow(16) if i == 11 else cache
      step = m.decode_step(
        tokens[:, i : i + 1], positions[:, i : i + 1], mask[:, i : i + 1], cache, i, weights
      )
      cache = step.cache
      out.append(step.logits)
    return jnp.stack(out, axis=1), cache

  got, cache = decode(state)
  np.testing.assert_allclose(np.asarray(got), want[:, 9:13], atol=1e-4)
  K, Dh = CFG.num_kv_heads, CFG.head_dim
  assert [k.shape for k in cache.k] == [(3, K, Dh, 16)] * CFG.num_layers  # keys transposed
  assert [v.shape for v in cache.v] == [(3, K, 16, Dh)] * CFG.num_layers
  np.testing.assert_array_equal(np.asarray(cache.mask), np.pad(mask, ((0, 0), (0, 3))))


def test_bfloat16_compute_is_finite_and_close(policy):
  tokens, mask, positions, targets = _batch()
  bf = nnx.merge(
    model.abstract_graphdef(dataclasses.replace(CFG, dtype="bfloat16")), nnx.state(policy)
  )

  def logprobs(m):
    return heads.chunked_logprobs(m, m(tokens, positions, attn_mask=mask).hidden, targets)[
      "logprobs"
    ]

  both = nnx.jit(lambda m, bf: [logprobs(x) for x in (m, bf)])
  lp, lp_bf = both(policy, bf)
  assert lp_bf.dtype == jnp.float32 and np.isfinite(np.asarray(lp_bf)).all()
  assert float(jnp.abs(lp_bf - lp)[mask].max()) < 0.1


def _abstract_count(cfg):
  return model.param_count(nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0))))


@pytest.mark.parametrize(
  "name, billions",
  [("qwen2.5-0.5b", 0.494), ("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19), ("llama3.1-8b", 8.03)],
)
def test_architectures_have_published_parameter_counts(name, billions):
  assert abs(_abstract_count(architectures.get(name)) / 1e9 - billions) < 0.01


def test_char_architectures_are_small_and_bad_names_list_choices():
  for name in ("char-tiny", "char-small"):
    n = _abstract_count(architectures.get(name))
    assert 1e5 <= n <= 1e6 and architectures.get(name).vocab_size == 64
  with pytest.raises(errors.UnknownNameError, match="unknown model architecture 'qwen9'.*qwen3-8b"):
    architectures.get("qwen9")
  with pytest.raises(ValueError, match="num_kv_heads"):
    architectures.get("tiny", num_kv_heads=3)
  with pytest.raises(ValueError, match="rope_scaling type"):
    architectures.get("tiny", rope_scaling=(("rope_type", "yarn"),))
  assert hash(architectures.get("llama3.1-8b"))  # usable as a static jit argument


def test_sharding_rules_place_parameters_and_keep_outputs(policy):
  mesh = jax.make_mesh(
    (2, 2, 2), partitioning.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
  )
  shardings = partitioning.state_shardings(nnx.state(policy), mesh)
  assert shardings["layers"]["wq"].get_value().spec == jax.P(None, "fsdp", "tensor", None)
  assert shardings["embed"].get_value().spec == jax.P("tensor", "fsdp")
  assert shardings["layers"]["w_down"].get_value().spec == jax.P(None, "tensor", "fsdp")
  # head_dim=16 is not divisible by a 3-way axis, so it would be dropped, never an error:
  spec = partitioning.logical_to_spec(
    ("layers", "kv_heads"), (("layers", None), ("kv_heads", "tensor")), shape=(2, 3), mesh=mesh
  )
  assert spec == jax.P(None, None)
  with pytest.raises(ValueError, match="no sharding rule"):
    partitioning.logical_to_spec(("nope",))

  # rbg keys compile far faster than threefry on CPU; the init is otherwise the model's own.
  make = lambda: model.Transformer(CFG, rngs=nnx.Rngs(params=jax.random.key(0, impl="rbg")))
  sharded = partitioning.create_sharded(make, mesh)
  assert sharded.layers.w_gate[...].sharding.spec == jax.P(None, "fsdp", "tensor")
  assert abs(float(jnp.std(sharded.layers.w_gate[...])) - 0.02) < 2e-3
  np.testing.assert_array_equal(np.asarray(sharded.final_norm[...]), 1.0)

  tokens, mask, positions, _ = _batch(B=4)
  want = _hidden(policy, tokens, mask, positions)
  placed = partitioning.shard_model(nnx.clone(policy), mesh)
  assert placed.layers.wo[...].sharding.spec == jax.P(None, "tensor", None, "fsdp")
  batch = jax.NamedSharding(mesh, partitioning.batch_spec(tokens.shape, mesh))
  assert batch.spec == jax.P(("data", "fsdp"), None)
  got = _hidden(placed, *(jax.device_put(x, batch) for x in (tokens, mask, positions)))
  chex.assert_trees_all_close(got, want, atol=1e-5)


def _hidden_loss(base, T, seed):
  """(random weights of `base`, loss_of(cfg)): loss_of gives the sum of squares of the real
  hidden states of a [2, T] batch under `base`'s weights with cfg's settings (remat, scan)."""
  _, abstract = nnx.split(nnx.eval_shape(lambda: model.Transformer(base, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)
  state = jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), abstract)
  tokens, mask, positions, _ = _batch(B=2, T=T)

  def loss_of(cfg):
    graphdef = model.abstract_graphdef(cfg)

    def loss(state):
      hidden = nnx.merge(graphdef, state)(tokens, positions, attn_mask=mask).hidden
      return jnp.sum(jnp.where(mask[..., None], hidden, 0.0) ** 2)

    return loss

  return state, loss_of


def test_remat_keeps_gradients_and_saves_memory():
  base = architectures.get("tiny", intermediate_size=64)
  state, loss_of = _hidden_loss(base, T=48, seed=3)
  results = {}
  for remat in ("none", "full"):
    loss = loss_of(dataclasses.replace(base, remat=remat))
    compiled = jax.jit(jax.grad(loss)).lower(state).compile()
    results[remat] = (compiled(state), compiled.memory_analysis().temp_size_in_bytes)
  chex.assert_trees_all_close(results["full"][0], results["none"][0], atol=1e-3, rtol=1e-3)
  assert results["full"][1] < results["none"][1]
  with pytest.raises(ValueError, match="remat"):
    architectures.get("tiny", remat="some")


@pytest.mark.parametrize("remat, scan", [("none", False), ("attention", True), ("full", True)])
def test_bf16_layers_take_the_gradients_of_plain_products_under_remat(remat, scan, monkeypatch):
  """The bf16 layers' custom-VJP projections (`project`) inside remat and the layer scan give
  the gradients of the same model built from plain products."""
  base = architectures.get("tiny", intermediate_size=64, dtype="bfloat16")
  state, loss_of = _hidden_loss(base, T=48, seed=5)
  loss = loss_of(dataclasses.replace(base, remat=remat, scan_layers=scan))
  got = jax.jit(jax.grad(loss))(state)
  monkeypatch.setattr(low_precision, "applies", lambda x: False)
  want = jax.jit(jax.grad(loss))(state)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype == jnp.float32 and np.isfinite(np.asarray(g)).all()
    assert float(jnp.linalg.norm(g - w)) <= 2e-2 * float(jnp.linalg.norm(w)) + 1e-6


def test_remat_auto_plan_follows_backend_length_and_size():
  """remat "auto" (the default): on CPU no remat and unrolled layers where the sequences are
  longer than dense attention's kept probabilities reach and the activations without remat are
  small; "attention" with cfg.scan_layers otherwise, and always on GPU and TPU. A named policy
  keeps cfg.scan_layers."""
  cfg = architectures.get("tiny")
  assert cfg.remat == "auto" and cfg.scan_layers
  plan = architectures.layer_plan
  long = attention.DENSE_SAVED_MAX_KEYS + 1
  assert plan(cfg, 8, long, "cpu") == ("none", False)
  assert plan(cfg, 8, attention.DENSE_SAVED_MAX_KEYS, "cpu") == ("attention", True)
  too_many = 1 + architectures.CPU_NO_REMAT_MAX_BYTES // architectures.no_remat_bytes(
    cfg, 1, long, "cpu"
  )
  assert plan(cfg, too_many, long, "cpu") == ("attention", True)
  assert plan(cfg, too_many - 1, long, "cpu") == ("none", False)
  unscanned = dataclasses.replace(cfg, scan_layers=False)
  for backend in ("gpu", "tpu"):
    assert plan(cfg, 8, long, backend) == ("attention", True)
    assert plan(unscanned, 8, long, backend) == ("attention", False)
  assert plan(dataclasses.replace(cfg, remat="dots"), 8, long, "cpu") == ("dots", True)
  # Forced blockwise at few tokens keeps no probabilities: no remat there either.
  forced = dataclasses.replace(cfg, attention="blockwise")
  assert plan(forced, 8, 64, "cpu") == ("none", False)
  # Bytes grow with rows, tokens and depth.
  nb = architectures.no_remat_bytes
  assert nb(cfg, 2, long, "cpu") == 2 * nb(cfg, 1, long, "cpu")
  assert nb(dataclasses.replace(cfg, num_layers=4), 1, long) == 2 * nb(cfg, 1, long)
  with pytest.raises(ValueError, match="remat"):
    architectures.get("tiny", remat="automatic")


@pytest.mark.parametrize("T", [24, attention.DENSE_SAVED_MAX_KEYS + 8])
def test_remat_auto_runs_its_plan_with_the_same_gradients(T):
  """The model under remat "auto" runs what `layer_plan` says for its batch: past
  DENSE_SAVED_MAX_KEYS tokens no checkpoint and no loop over the layers, at 24 tokens the layer
  scan under remat "attention"; gradients equal those of remat "none" either way."""
  base = architectures.get("tiny", intermediate_size=64)
  state, loss_of = _hidden_loss(base, T=T, seed=5)
  grads, checkpoints, loops = {}, {}, {}
  for remat in ("auto", "none"):
    loss = loss_of(dataclasses.replace(base, remat=remat))
    grad = jax.jit(jax.grad(loss))
    grads[remat] = grad(state)
    program = str(jax.make_jaxpr(jax.grad(loss))(state))
    checkpoints[remat] = "checkpoint" in program or "remat" in program
    loops[remat] = grad.lower(state).compile().as_text().count(" while(")
  chex.assert_trees_all_close(grads["auto"], grads["none"], atol=1e-4, rtol=1e-4)
  long = T > attention.DENSE_SAVED_MAX_KEYS
  assert architectures.layer_plan(base, 2, T) == (("none", False) if long else ("attention", True))
  assert checkpoints["auto"] == (not long) and not checkpoints["none"]
  # Unrolled layers: the loop over them is gone (the scan of "none", scan_layers=True, stays).
  assert (loops["auto"] < loops["none"]) == long, loops


def test_unrolled_layers_equal_the_scan():
  """model.scan_layers=False: the same hidden states and gradients, the layers compiled one by
  one (no loop over them in the compiled update)."""
  base = architectures.get("tiny", intermediate_size=64, num_layers=3)
  state, loss_of = _hidden_loss(base, T=16, seed=4)
  results, loops = {}, {}
  for scan in (True, False):
    grad = jax.jit(jax.value_and_grad(loss_of(dataclasses.replace(base, scan_layers=scan))))
    results[scan] = grad(state)
    loops[scan] = grad.lower(state).compile().as_text().count(" while(")
  chex.assert_trees_all_close(results[False], results[True], atol=1e-4, rtol=1e-4)
  assert loops[False] < loops[True], loops
