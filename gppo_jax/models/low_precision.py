"""16-bit matrix products that XLA's CPU backend keeps in 16 bits.

XLA's CPU backend multiplies bf16 (or f16) operands in that dtype, with float32 accumulation (on
CPUs with bf16 matrix units), only where it sees both operands of the product as untransposed
row-major arrays; it decides this before assigning layouts. A transposed operand (`a.T`,
`k.transpose(...)`, and the transposed weights and activations autodiff hands the backward of
`x @ w`) makes it convert both operands to float32 and multiply at the float32 rate, several
times slower than the bf16 one. The helpers here give it operands it takes as they are, and
change nothing in float32, on other backends (their matmuls read transposed operands in place)
or across a mesh of devices (`applies`). docs/performance.md has the measurements.

Earns its place: benchmarks/train_step.py --shape small --dtype bfloat16 ~1.25x against plain
products (the tied head's `transposed` operands alone ~1.1x).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def applies(x: jax.Array) -> bool:
  """x is 16-bit and traced for one CPU device: the case the helpers below change. Not across a
  mesh (an ambient mesh of more than one device, as the sharded jits set): there XLA's
  partitioner would gather whole arrays to join halves split over devices (the 7B memory plan
  grew several times over), and the planner stands CPU devices in for other chips."""
  return jnp.dtype(x.dtype).itemsize == 2 and one_cpu_device()


def one_cpu_device() -> bool:
  """Tracing for one CPU device: the CPU backend, outside any mesh of more than one device."""
  if jax.default_backend() != "cpu":
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or math.prod(mesh.shape.values()) == 1


def row_major(x: jax.Array) -> jax.Array:
  """x itself, or where `applies` a row-major copy of it (x may carry a transposed layout); its
  gradient passes straight through."""
  if not applies(x) or x.shape[-1] < 2:
    return x
  return _row_major_copy(x)


@jax.custom_vjp
def _row_major_copy(x):
  # The two halves of x's last axis joined as 16-bit integers: XLA folds no-op copies away (or
  # keeps the operand's layout through them) and would convert a bf16 concatenation to float32
  # and back; the barrier stops its simplifier from folding the join back into the transpose
  # (and the product then meeting it as a transposed operand after all).
  bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
  half = x.shape[-1] // 2
  joined = jnp.concatenate([bits[..., :half], bits[..., half:]], axis=-1)
  return jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(joined, x.dtype))


_row_major_copy.defvjp(lambda x: (_row_major_copy(x), None), lambda _, g: (g,))


def transposed(a: jax.Array) -> jax.Array:
  """a.T of a 2-D a as a matrix product's operand (`row_major`)."""
  return row_major(a.T)


def project(x: jax.Array, w: jax.Array, contract: int = 1, *, custom_vjp: bool = True) -> jax.Array:
  """x [..., *in] @ w [*in, *out] over the `contract` trailing axes of x, as one 2-D matmul: the
  model's projections (the decoder's, LoRA's, the router's).

  Flattening the token axes first (x as [tokens, in]) gives XLA plain matrix products in the
  forward and the backward: the same contraction written as a batched einsum
  ("btd,df->btf") makes XLA's CPU backend transpose the activation gradient of every weight
  gradient (a copy of each layer's activations). Where `applies` (16-bit on one CPU device) the
  product is `matmul` unless custom_vjp is False (remat "dots" must see a plain product to save
  it)."""
  lead, inner = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :]
  out = w.shape[contract:]
  x2, w2 = x.reshape(math.prod(lead), math.prod(inner)), w.reshape(math.prod(inner), math.prod(out))
  y = matmul(x2, w2) if custom_vjp and applies(x2) else x2 @ w2
  return y.reshape(*lead, *out)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [N, K] @ w [K, M] in their 16-bit dtype, float32 accumulation, rounded to that dtype: the
  values of `x @ w`, with the forward and both backward products written so that XLA's CPU
  backend keeps them in 16 bits (a 16-bit output, and autodiff's transposed operands, make it
  convert to float32). Hidden from remat's `dots` policy, which must see plain products."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _matmul_fwd(x, w):
  return matmul(x, w), (x, w)


def _matmul_bwd(residuals, dy):
  x, w = residuals
  f32 = jnp.float32
  dx = jnp.dot(dy, transposed(w), preferred_element_type=f32).astype(x.dtype)
  dw = jnp.dot(transposed(x), dy, preferred_element_type=f32).astype(w.dtype)
  return dx, dw


matmul.defvjp(_matmul_fwd, _matmul_bwd)
