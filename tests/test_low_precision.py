"""16-bit products on CPU (`low_precision`): XLA keeps them in 16 bits, values and gradients are
those of the plain products, and every configuration of the bf16 update compiles and runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gppo_jax.algorithm import objective
from gppo_jax.models import architectures, heads, low_precision, model, sharding
from gppo_jax.trainer import train_step


def _compiled_dot_operands(fn, *args) -> list[tuple[str, str]]:
  """The operand dtypes ("bf16", "f32" ...) of every matrix product in fn's compiled program."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
  products = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", text)
  return [(dtypes[a], dtypes[b]) for a, b in products]


def _xla_multiplies_bf16_natively() -> bool:
  x = jnp.ones((64, 96), jnp.bfloat16)
  plain = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
  return _compiled_dot_operands(plain, x, x.T.copy()) == [("bf16", "bf16")]


def test_row_major_copies_16_bit_arrays_on_cpu_and_passes_others_through():
  x = jax.random.normal(jax.random.key(0), (3, 5, 8), jnp.bfloat16).transpose(0, 2, 1)
  got = jax.jit(low_precision.row_major)(x)
  assert got.dtype == jnp.bfloat16 and got.shape == x.shape
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x, np.float32))
  assert low_precision.applies(x) and not low_precision.applies(x.astype(jnp.float32))
  f32 = x.astype(jnp.float32)
  assert low_precision.row_major(f32) is f32
  one = x[..., :1]  # nothing to split: left as it is
  assert low_precision.row_major(one) is one
  np.testing.assert_array_equal(low_precision.transposed(x[0]), x[0].T)


def test_bf16_projection_multiplies_in_bf16_forward_and_backward():
  """On CPU, XLA runs a bf16 product in bf16 (not converted to float32) only on untransposed
  row-major operands, and autodiff's backward of x @ w hands it transposed ones. `project` in
  bf16 keeps all three products in bf16 wherever XLA does so for a plain one, with the values
  and gradients of the plain product (remat "dots" gets that plain product: custom_vjp=False)."""
  if not _xla_multiplies_bf16_natively():
    pytest.skip("XLA multiplies bf16 in float32 on this CPU even for a plain product")
  kx, kw, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (2, 64, 96), jnp.bfloat16)
  w = (0.1 * jax.random.normal(kw, (96, 160))).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (2, 64, 160))

  def grad(custom_vjp):
    loss = lambda x, w: jnp.sum(
      jnp.sin(low_precision.project(x, w, custom_vjp=custom_vjp).astype(jnp.float32)) * cot
    )
    return jax.grad(loss, argnums=(0, 1))

  assert _compiled_dot_operands(grad(True), x, w) == [("bf16", "bf16")] * 3
  y, y_ref = low_precision.project(x, w), low_precision.project(x, w, custom_vjp=False)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=2e-2, atol=2e-2
  )
  for got, want in zip(grad(True)(x, w), grad(False)(x, w), strict=True):
    assert got.dtype == want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("hidden_size", [96, 32])
def test_bf16_tied_head_multiplies_in_bf16(hidden_size):
  """The tied head's forward and both backward products (`heads._head_with_backward`) in bf16,
  its weight gradient over a row-major copy of the logits' gradient, with fewer or more rows
  than the hidden size."""
  if not _xla_multiplies_bf16_natively():
    pytest.skip("XLA multiplies bf16 in float32 on this CPU even for a plain product")
  kh, kw = jax.random.split(jax.random.key(4))
  hidden = jax.random.normal(kh, (2, 64, hidden_size), jnp.bfloat16)
  w = 0.1 * jax.random.normal(kw, (256, hidden_size))
  targets = jnp.arange(2 * 64).reshape(2, 64) % 256

  def loss(h, w):
    return jnp.sum(heads.chunked_logprob_stats(h, w, targets, tied=True)["logprobs"])

  dots = _compiled_dot_operands(jax.grad(loss, argnums=(0, 1)), hidden, w)
  assert len(dots) == 3 and all(d == ("bf16", "bf16") for d in dots), dots


def test_bf16_norm_and_bias_gradients_sum_in_float32():
  """A norm's weight and a bias act on bf16 activations through `model._in_float32`: the values
  of the bf16 product and sum, but their gradients sum over the tokens in float32. XLA's CPU
  backend sums bf16 in bf16: over these 2,048 tokens the plain ops' gradients are ~8x further
  from the float32 ones, some elements off by more than their own size."""
  kx, kw, kc = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(kx, (8, 256, 64), jnp.bfloat16)
  w = (1 + 0.1 * jax.random.normal(kw, (64,))).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, x.shape)
  f32 = jnp.float32
  for op in (jnp.multiply, jnp.add):
    got = model._in_float32(op, x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(op(x, w), np.float32))
    grad = jax.grad(lambda w, op=op: jnp.sum(model._in_float32(op, x, w).astype(f32) * cot))(w)
    want = jax.grad(lambda w, op=op: jnp.sum(op(x.astype(f32), w) * cot))(w.astype(f32))
    assert grad.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(grad, np.float32) - want) / np.linalg.norm(want)
    assert err < 6e-3, err  # seeds 0-5: 0.0017-0.0029; the plain ops 0.013-0.023


P = 8  # prompt tokens of the update batches below


def _update_metrics(cfg, rows, length, seed=0, mesh=None):
  """One bf16 training update of cfg's random model on rows x length tokens: its metrics; on
  `mesh` the trainer's sharded jit (`sharding.jit_update`)."""
  rng = np.random.default_rng(seed)
  R = length - P
  batch = train_step.build_batch(
    rng.integers(3, cfg.vocab_size, (rows, P)).astype(np.int32),
    np.ones((rows, P), bool),
    rng.integers(3, cfg.vocab_size, (rows, R)).astype(np.int32),
    np.arange(R)[None] < rng.integers(R // 2, R + 1, (rows, 1)),
    logq=np.log(rng.uniform(0.05, 0.9, (rows, R))).astype(np.float32),
    adv=rng.normal(size=rows).astype(np.float32),
  )
  graphdef, params = nnx.split(model.create(cfg, seed=seed))
  tx = train_step.make_optimizer(lr=1e-3, total_steps=10)
  loss = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.05)
  update = train_step.make_update_fn(graphdef, tx, train_step.UpdateSpec(prompt_len=P, loss=loss))
  state = train_step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
  if mesh is None:
    new, metrics = jax.jit(update)(state, batch, jax.random.key(seed))
  else:
    shardings = sharding.state_shardings(state, mesh)
    update = sharding.jit_update(update, shardings, sharding.batch_shardings(batch, mesh))
    new, metrics = update(
      jax.device_put(state, shardings), sharding.shard_batch(batch, mesh), jax.random.key(seed)
    )
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new.params))
  return jax.device_get(metrics)


@pytest.mark.parametrize(
  "remat, attention_impl, scan, tied, rows, length",
  [
    ("auto", "auto", True, True, 4, 64),  # dense attention (auto: remat attention, scanned)
    ("none", "auto", False, False, 2, 200),  # blockwise, tiles unrolled
    ("attention", "auto", True, True, 2, 200),
    ("dots", "auto", True, False, 2, 200),  # plain products for the policy to save
    ("full", "blockwise", True, True, 1, 600),  # blockwise loops (past UNROLL_MAX_LEN)
  ],
)
def test_bf16_update_runs_and_matches_plain_products(
  remat, attention_impl, scan, tied, rows, length, monkeypatch
):
  """Every kind of layer plan and attention compiles and runs in bf16 on CPU (XLA's CPU backend
  refuses a bf16 product it planned for its library and then could not give it), with the
  loss and gradient norm of the same update built from plain products."""
  cfg = architectures.get(
    "tiny", dtype="bfloat16", remat=remat, attention=attention_impl, scan_layers=scan,
    tie_word_embeddings=tied, max_position_embeddings=1024,
  )  # fmt: skip
  got = _update_metrics(cfg, rows, length)
  monkeypatch.setattr(low_precision, "applies", lambda x: False)
  want = _update_metrics(cfg, rows, length)
  for key in ("loss/total", "optim/grad_norm"):
    np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=3e-2, atol=1e-4)
  assert float(np.asarray(want["optim/grad_norm"]).max()) > 0


def test_rewrites_stay_off_across_a_mesh(monkeypatch):
  """Across a mesh of devices (the ambient mesh the sharded jits set) the products stay plain:
  joining halves of an axis split over devices would make XLA gather whole arrays (and the
  planner compiles on CPU devices for other chips); on a mesh of one device they apply. The
  norms' and biases' float32 ops (`model._in_float32`) likewise."""
  x = jnp.ones((4, 6), jnp.bfloat16)
  assert low_precision.applies(x)
  for devices, want in ((8, False), (1, True)):
    mesh = sharding.make_mesh({"fsdp": devices}, jax.devices()[:devices])
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      assert low_precision.applies(x) is want
      # The norms' and biases' float32 ops follow the same rule.
      jaxpr = str(jax.make_jaxpr(model._in_float32, static_argnums=0)(jnp.multiply, x, x))
      assert ("convert_element_type" in jaxpr) is want
  seen = []
  real = low_precision.matmul
  monkeypatch.setattr(low_precision, "matmul", lambda a, b: seen.append(a.shape) or real(a, b))
  cfg = architectures.get("tiny", dtype="bfloat16", remat="none")
  _update_metrics(cfg, 8, 32, mesh=sharding.make_mesh({"fsdp": 8}))
  assert seen == []
  _update_metrics(cfg, 8, 32, mesh=sharding.make_mesh({"fsdp": 1}, jax.devices()[:1]))
  assert seen
