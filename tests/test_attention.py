"""Every attention implementation (dense's training path too) equals the dense reference:
outputs and gradients, padding, GQA, lengths that are not a multiple of the tile, T = 1; the model
with each one equals dense; the blockwise backward's compiled memory grows linearly, the dense
one's quadratically."""

from __future__ import annotations

import dataclasses
import functools

import chex
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gppo_jax.models import architectures, heads, model, sharding
from gppo_jax.models import attention as attn

# cuDNN runs only on a GPU; elsewhere its wrapper (the rotation to right padding and the
# sequence-length mask) is checked through the same call with XLA's implementation.
ON_GPU = jax.default_backend() == "gpu"
_cudnn = functools.partial(attn.cudnn, implementation="cudnn" if ON_GPU else "xla")
IMPLS = {
  # The training path of "dense" (dense_fused, a hand-written backward) vs autodiff of dense.
  "dense": functools.partial(attn.attention, impl="dense"),
  "blockwise": functools.partial(attn.blockwise, block_size=8),  # several tiles, a ragged end
  "unrolled": functools.partial(attn.blockwise, block_size=8, unroll=True),  # the same, unrolled
  "cudnn": _cudnn,
  "splash": attn.splash,  # interpret mode off TPU
}
# Real tokens in one contiguous run per row: left pads, right pads, both; row 3 has none padded.
LAYOUTS = {"left": (5, 0), "right": (0, 7), "both": (3, 4), "none": (0, 0)}


def _inputs(B=4, T=37, H=4, K=2, Dh=16, dtype=jnp.float32, seed=0, holes=False):
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  mask = np.ones((B, T), bool)
  for row, (left, right) in enumerate(list(LAYOUTS.values())[:B]):
    mask[row, :left] = False
    mask[row, T - right :] = False
  if holes:  # pads between real tokens (not a layout the project builds; cuDNN excluded)
    mask[0, T // 2 : T // 2 + 3] = False
  return (
    draw(B, T, H, Dh),
    draw(B, T, K, Dh),
    draw(B, T, K, Dh),
    jnp.asarray(mask),
    draw(B, T, H, Dh),
  )


def _dense(q, k, v, mask):
  return attn.dense(q, k, v, attn.self_allowed(mask))


@functools.cache
def _jit_out_and_grads(fn):
  def run(q, k, v, mask, w):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
    return out, vjp(w.astype(out.dtype))

  return jax.jit(run)


def _out_and_grads(fn, q, k, v, mask, w):
  """fn's output and d/d(q, k, v) of sum(w * output), in one compiled call (cached per fn)."""
  return _jit_out_and_grads(fn)(q, k, v, mask, w)


@functools.cache
def _case(**kwargs):
  """(inputs, the dense reference's output and gradients), built once per set of arguments."""
  q, k, v, mask, w = inputs = _inputs(**kwargs)
  return inputs, _out_and_grads(_dense, q, k, v, mask, w)


def _check(name, cases, atol):
  """Each case (kwargs of _inputs): `name` equals dense in output and gradients (real queries
  only for cuDNN, whose pad outputs are unspecified: their cotangent is zero, as in training)."""
  for kwargs in cases:
    (q, k, v, mask, w), want = _case(**kwargs)
    if name == "cudnn":
      w = w * mask[:, :, None, None].astype(w.dtype)
      want = _out_and_grads(_dense, q, k, v, mask, w)
    got = _out_and_grads(IMPLS[name], q, k, v, mask, w)
    if name == "cudnn":
      sel = np.asarray(mask)
      got, want = (got[0][sel], got[1]), (want[0][sel], want[1])
    f32 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float32), t)
    chex.assert_trees_all_close(f32(got), f32(want), atol=atol, rtol=atol)


@pytest.mark.parametrize("name", list(IMPLS))
def test_float32_equals_dense(name):
  """Left / right / both / no padding with GQA (4 query heads on 2 kv heads), T = 37 (not a
  multiple of any tile); pads between real tokens (not for cuDNN); MQA at T = 9; T = 1 with MHA
  (not for splash, which pads every length to 128 anyway)."""
  cases = [dict(holes=name != "cudnn"), dict(T=9, H=2, K=1)]
  if name != "splash":
    cases.append(dict(B=1, T=1, K=4, seed=3))
  _check(name, cases, atol=2e-5)


def test_cpu_blockwise_tiles_follow_the_length_and_equal_dense():
  """On CPU `attention` tiles blockwise by length: a power of two near a quarter of it, within
  [CPU_BLOCK_MIN, CPU_BLOCK_MAX]; other backends keep BLOCK_SIZE. At 300 tokens that is five
  64-token tiles, the last one ragged, run unrolled, and the result equals dense in output and
  gradients."""
  bs = attn.block_size
  cpu = [bs(t, "cpu") for t in (129, 256, 300, 512, 1024, 2048, 4096, 16384)]
  assert cpu == [64, 64, 64, 128, 256, 512, 512, 512]
  assert bs(4096, "tpu") == bs(4096, "gpu") == attn.BLOCK_SIZE
  assert attn._tile(300, bs(300, "cpu")) == (64, 5)
  (q, k, v, mask, w), want = _case(B=2, T=300, seed=7)
  for impl in ("auto", "blockwise"):
    fn = functools.partial(attn.attention, impl=impl)
    got = _out_and_grads(fn, q, k, v, mask, w)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5, custom_message=impl)
    # The tile is what the compiled program works in: [B, K, 64, G, Dh] query blocks.
    loss = lambda q, fn=fn: jnp.sum(fn(q, k, v, mask))
    text = jax.jit(jax.grad(loss)).lower(q).as_text()
    assert "tensor<2x2x64x2x16xf32>" in text and "tensor<2x2x512x2x16xf32>" not in text
    # "auto" runs the tiles unrolled on CPU up to UNROLL_MAX_LEN tokens: no loop, forward or
    # backward; "blockwise" itself loops, as "auto" does beyond that and on other backends.
    assert ("stablehlo.while" in text) == (impl == "blockwise"), impl
  unrolled = [attn.unrolled(t, "cpu") for t in (256, 300, 512, 513, 2048)]
  assert unrolled == [True, True, True, False, False] and attn.UNROLL_MAX_LEN == 512
  assert not attn.unrolled(256, "gpu") and not attn.unrolled(256, "tpu")


@pytest.mark.parametrize(
  "name",
  ["dense", "blockwise", "unrolled", pytest.param("splash", marks=pytest.mark.slow)]
  + (["cudnn"] if ON_GPU else []),
)
def test_bfloat16_close_to_dense(name):
  """(splash in bf16 is slow to interpret on CPU: -m slow; its float32 test runs by default.)"""
  _check(name, [dict(dtype=jnp.bfloat16, seed=5)], atol=6e-2)


def test_cached_attention_equals_dense_cache_rule():
  """Queries written at a traced offset into a partly filled cache (the prefill's case)."""
  rng = np.random.default_rng(7)
  B, T, S, H, K, Dh, off = 3, 21, 40, 4, 2, 8, 6
  q, k, v, mask, _ = _inputs(B=B, T=T, H=H, K=K, Dh=Dh, seed=7)
  old = lambda: jnp.asarray(rng.standard_normal((B, off, K, Dh)), jnp.float32)
  cache = lambda new: jnp.zeros((B, S, K, Dh)).at[:, :off].set(old()).at[:, off : off + T].set(new)
  ck, cv = cache(k), cache(v)
  cmask = jnp.zeros((B, S), bool).at[:, :off].set(True).at[:, off : off + T].set(mask)
  slots, qslot = jnp.arange(S)[None], off + jnp.arange(T)[:, None]
  allowed = ((slots <= qslot)[None] & cmask[:, None]) | (slots == qslot)[None]
  want = attn.dense(q, ck, cv, allowed)
  for block in (8, 512):
    got = jax.jit(
      lambda o, block=block: attn.cached_attention(q, ck, cv, cmask, o, block_size=block)
    )(jnp.int32(off))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_cached_attention_single_query_on_stacked_cache_equals_dense():
  """The decode step: one query at every traced offset of a stacked [L, B, S, K, Dh] cache (the
  layer picked by a traced index), blocks of 1, 4 (the last one clamped: S = 18) and all S slots,
  equals dense attention over the whole cache of that layer."""
  rng = np.random.default_rng(3)
  L, B, S, H, K, Dh = 3, 2, 18, 4, 2, 8
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  ck, cv, q = draw(L, B, S, K, Dh), draw(L, B, S, K, Dh), draw(B, 1, H, Dh)
  # Row 0 left-padded by 3 slots; row 1 has a hole at slot 6 (a stopped row's step).
  cmask = jnp.ones((B, S), bool).at[0, :3].set(False).at[1, 6].set(False)
  run = jax.jit(
    lambda o, l, block: attn.cached_attention(q, ck, cv, cmask, o, block_size=block, layer=l),
    static_argnums=2,
  )
  slots = jnp.arange(S)[None]
  for off in (0, 3, 7, 12, S - 1):
    allowed = ((slots <= off) & cmask | (slots == off))[:, None]  # [B, 1, S]
    for layer in (0, 2):
      want = attn.dense(q, ck[layer], cv[layer], allowed)
      for block in (1, 4, S):
        got = run(jnp.int32(off), jnp.int32(layer), block)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"{off} {block}")


def test_resolve_picks_by_backend_and_rejects_unknown_names():
  r = functools.partial(attn.resolve, seq_len=4096, dtype=jnp.bfloat16, head_dim=128)
  assert r("auto", backend="tpu") == "splash"
  assert r("auto", backend="gpu") == "cudnn"
  assert r("auto", backend="gpu", dtype=jnp.float32) == "blockwise"  # cuDNN: half precision
  assert r("auto", backend="cpu") == "blockwise"
  assert r("auto", backend="cpu", seq_len=64) == "dense"
  assert r("auto", backend="cpu", seq_len=attn.DENSE_MAX_LEN + 1) == "blockwise"
  assert r("dense", backend="tpu") == "dense"
  with pytest.raises(ValueError, match="valid: auto, dense"):
    r("flash")
  assert architectures.ATTENTION == attn.IMPLEMENTATIONS
  with pytest.raises(ValueError, match="attention='flash'"):
    architectures.get("tiny", attention="flash")


# --- The model with each attention ------------------------------------------------------------

CFG = architectures.get("tiny", attention_bias=True, qk_norm=True, family="qwen3")


@pytest.fixture(scope="module")
def weights():
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model.Transformer(CFG, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(1)
  state = jax.tree.map(
    lambda x: jnp.asarray(0.15 * rng.standard_normal(x.shape), x.dtype), abstract
  )
  for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
    state["layers"][name].set_value(state["layers"][name].get_value() + 1.0)
  return state


def _model_batch(B=4, T=29, seed=0):
  rng = np.random.default_rng(seed)
  mask = np.ones((B, T), bool)
  mask[0, :6] = False  # left-padded prompt
  mask[1, T - 5 :] = False  # right-padded response
  mask[2, :2] = False
  mask[2, T - 3 :] = False
  tokens = np.where(mask, rng.integers(3, CFG.vocab_size, (B, T)), CFG.pad_token_id)
  positions = model.positions_from_mask(jnp.asarray(mask))
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), positions


def _model_loss(impl, tokens, mask, positions, remat="none"):
  """state -> (log-prob loss, hidden states) of the model with attention `impl`."""
  graphdef = model.abstract_graphdef(dataclasses.replace(CFG, attention=impl, remat=remat))

  def loss(state):
    m = nnx.merge(graphdef, state)
    hidden = m(tokens, positions, attn_mask=mask).hidden
    lp = heads.chunked_logprobs(m, hidden, jnp.roll(tokens, -1, 1))["logprobs"]
    return jnp.sum(jnp.where(mask, lp, 0.0)), hidden

  return loss


def _model_run(impl, state, tokens, mask, positions, grad):
  """(loss, hidden states of real tokens[, parameter gradients]) of a log-prob loss."""
  loss = _model_loss(impl, tokens, mask, positions)
  if grad:
    (value, hidden), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  else:
    (value, hidden), grads = jax.jit(loss)(state), None
  return value, np.asarray(hidden)[np.asarray(mask)], grads


@pytest.fixture(scope="module")
def dense_model(weights):
  batch = _model_batch()
  return batch, _model_run("dense", weights, *batch, grad=True)


@pytest.mark.parametrize("impl", ["blockwise", "cudnn", "splash"])
def test_model_equals_dense(impl, weights, dense_model, monkeypatch):
  """Loss and real tokens' hidden states; parameter gradients too for blockwise, and for cudnn,
  whose rows the model rotates once around all layers (splash's kernel gradients are checked
  above; a model-level compile of it would double this file's time)."""
  if impl == "cudnn" and not ON_GPU:
    xla = functools.partial(attn.cudnn_left_aligned, implementation="xla")
    monkeypatch.setattr(attn, "cudnn_left_aligned", xla)
  batch, want = dense_model
  grad = impl in ("blockwise", "cudnn")
  got = _model_run(impl, weights, *batch, grad=grad)
  if not grad:
    want = want[:2] + (None,)
  chex.assert_trees_all_close(got, want, atol=5e-5, rtol=5e-5)


def _count(jaxpr, name):
  """Occurrences of primitive `name` in a jaxpr, nested jaxprs included."""
  return sum(eqn.primitive.name == name for eqn in conftest.all_eqns(jaxpr))


@pytest.mark.parametrize("unroll", [False, True])
def test_remat_attention_keeps_the_blockwise_forward(unroll, weights, dense_model, monkeypatch):
  """remat="attention": the same gradients as every other policy, and the backward does not
  rerun the blockwise attention forward. With loops ("blockwise"): as many attention loops as
  without remat ("full" reruns it: one more). Unrolled ("auto" on CPU, here one tile): no loops,
  and the two products of the tile's forward that "full" reruns (scores, probabilities x values)
  are gone."""
  if unroll:  # "auto" resolves to blockwise at any length, unrolled (one tile here)
    monkeypatch.setattr(attn, "DENSE_MAX_LEN", 0)
  batch, (_, _, want) = dense_model
  loops, dots = {}, {}
  for remat in ("none", "full", "attention", "dots"):
    impl = "auto" if unroll else "blockwise"
    grad = jax.grad(_model_loss(impl, *batch, remat=remat), has_aux=True)
    chex.assert_trees_all_close(jax.jit(grad)(weights)[0], want, atol=5e-5, rtol=5e-5)
    jaxpr = jax.make_jaxpr(grad)(weights).jaxpr
    loops[remat], dots[remat] = _count(jaxpr, "while"), _count(jaxpr, "dot_general")
  if unroll:
    assert loops == dict.fromkeys(loops, 0), loops
    assert dots["attention"] == dots["full"] - 2, dots
  else:
    assert loops["attention"] == loops["none"] == loops["full"] - 1, loops


def test_remat_attention_keeps_the_dense_probabilities(weights, dense_model):
  """remat="attention" with dense attention: the same gradients as "none" and "full", and the
  backward reuses the saved output and probabilities: the two products "full" reruns in the
  layer scan's body (scores, probabilities x values) are gone."""
  batch, (_, _, want) = dense_model
  dots = {}
  for remat in ("none", "full", "attention"):
    grad = jax.grad(_model_loss("dense", *batch, remat=remat), has_aux=True)
    chex.assert_trees_all_close(jax.jit(grad)(weights)[0], want, atol=5e-5, rtol=5e-5)
    dots[remat] = _count(jax.make_jaxpr(grad)(weights).jaxpr, "dot_general")
  assert dots["attention"] == dots["full"] - 2, dots
  assert dots["none"] < dots["attention"], dots  # the projections are still recomputed


@pytest.mark.parametrize(
  "keys, saved", [(attn.DENSE_SAVED_MAX_KEYS, True), (attn.DENSE_SAVED_MAX_KEYS + 1, False)]
)
def test_dense_probabilities_are_kept_only_up_to_the_key_limit(keys, saved):
  """Beyond DENSE_SAVED_MAX_KEYS keys remat "attention" keeps only dense attention's output (its
  probabilities would be O(T^2) per layer): the backward reruns the scores but not the value
  product. Up to it, neither."""
  q, k, v = (jnp.ones((1, 4, 2, 8)), jnp.ones((1, keys, 1, 8)), jnp.ones((1, keys, 1, 8)))
  allowed = jnp.ones((1, 4, keys), bool)

  def count(remat):
    f = jax.checkpoint(
      lambda q, k, v: jnp.sum(attn.dense_fused(q, k, v, allowed) ** 2),
      policy=architectures.REMAT_POLICIES[remat],
    )
    return _count(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v).jaxpr, "dot_general")

  assert count("attention") == count("full") - (2 if saved else 1)


def test_model_prefill_with_blockwise_equals_dense(weights):
  """The KV-cache call with several tokens at a traced cache_index (the sampler's prefill)."""
  tokens, mask, positions = _model_batch(B=3, T=13, seed=4)

  def run(impl):
    graphdef = model.abstract_graphdef(dataclasses.replace(CFG, attention=impl))

    @jax.jit
    def prefill(state, index):
      cache = model.init_cache(CFG, 3, 24)
      m = nnx.merge(graphdef, state)
      out = m(tokens, positions, attn_mask=mask, cache=cache, cache_index=index)
      return out.hidden, out.cache

    return prefill(weights, jnp.int32(0))

  (h_block, c_block), (h_dense, c_dense) = run("blockwise"), run("dense")
  np.testing.assert_allclose(np.asarray(h_block)[mask], np.asarray(h_dense)[mask], atol=2e-5)
  chex.assert_trees_all_close(c_block, c_dense, atol=1e-5)


def test_splash_under_a_mesh_equals_dense():
  """Under a (data, fsdp, tensor) mesh the kernel runs per device in shard_map."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
  q, k, v, mask, w = _inputs(T=20, seed=9)
  with jax.set_mesh(mesh):
    got = _out_and_grads(attn.splash, q, k, v, mask, w)
  chex.assert_trees_all_close(got, _out_and_grads(_dense, q, k, v, mask, w), atol=2e-5)


# --- Memory -------------------------------------------------------------------------------------


def _grad_temp_bytes(fn, T):
  q, k, v = (jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32) for _ in range(3))
  mask = jax.ShapeDtypeStruct((1, T), jnp.bool_)
  loss = lambda q, k, v, m: jnp.sum(fn(q, k, v, m))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, mask).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_gradient_memory_is_linear_in_length():
  """Compiled (not run): doubling T at most ~doubles blockwise's temporaries, which stay below a
  quarter of one float32 score tensor [1, 2, T, T], while dense holds at least one."""
  block = functools.partial(attn.blockwise, block_size=128)
  b1, b2 = _grad_temp_bytes(block, 1024), _grad_temp_bytes(block, 2048)
  d1, d2 = _grad_temp_bytes(_dense, 1024), _grad_temp_bytes(_dense, 2048)
  scores = lambda T: 2 * T * T * 4
  assert b2 < 2.5 * b1, (b1, b2)
  assert b2 < scores(2048) / 4, b2
  assert d1 >= scores(1024) and d2 >= scores(2048), (d1, d2)


def test_config_model_fields_reach_the_model_config():
  from gppo_jax import config_lib
  from gppo_jax.trainer import experiment

  c = config_lib.base("smoke")
  c.model.attention, c.model.remat = "blockwise", "dots"
  c.warmstart.enabled = False
  config_lib.validate(c)
  _, _, cfg, _, _ = experiment.build_policy(c, say=lambda _: None)
  assert (cfg.attention, cfg.remat) == ("blockwise", "dots")
