"""LoRA adapters of the decoder's projections: their parameters, their term in a projection,
merging them into the base weights, and splitting a policy's state into adapters and base.

With ModelConfig.lora_rank r > 0, each targeted layer weight W [*in, *out] (stacked on the
"layers" axis, `model.Layers`) gets adapters A [*in, r] and B [r, *out] next to it, named W's
name + LORA_A / LORA_B: the projection becomes x W + (alpha / r) dropout(x) A B (`lora_delta`).
A run with LoRA trains, carries optimizer state for and checkpoints the adapters only
(`LoRAParam`, `split_lora`). Building a LoRA policy from a base model and merging the adapters
into a model's weights are in `model.py` (`with_lora`, `lora_state`, `merge_lora`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from gppo_jax.models import low_precision, partitioning
from gppo_jax.models.architectures import ModelConfig

LORA_A, LORA_B = "_lora_a", "_lora_b"  # suffixes of a weight's adapters' names in `Layers`


class LoRAParam(nnx.Param):
  """A LoRA adapter matrix (`model.Layers`): with LoRA on, the only parameters a run trains,
  carries optimizer state for and checkpoints (`split_lora`)."""


def contracted_axes(name: str) -> int:
  """How many leading axes (after "layers") of layer weight `name` a projection contracts: the
  output projection wo [heads, head_dim, embed] two, every other one."""
  return 2 if name == "wo" else 1


def add_adapters(cfg: ModelConfig, layers: nnx.Module, rngs: nnx.Rngs) -> None:
  """Gives each targeted weight W [L, *in, *out] of `layers` (cfg.lora_weights) its adapters:
  A [L, *in, r] (random, std 1/sqrt(fan-in)) and B [L, r, *out] (zeros, so that a fresh adapter
  leaves the model as it is), in float32 whatever the base's dtype (they are the trained, master
  weights), with W's logical axes and "lora" for r."""
  L, r = cfg.num_layers, cfg.lora_rank
  for name in cfg.lora_weights:
    w = getattr(layers, name)
    c = contracted_axes(name)
    shape, axes = w.shape[1:], w.get_metadata()["out_sharding"][1:]
    fan_in = math.prod(shape[:c])
    a_shape, b_shape = (L, *shape[:c], r), (L, r, *shape[c:])
    a_axes, b_axes = ("layers", *axes[:c], "lora"), ("layers", "lora", *axes[c:])
    f32 = jnp.float32
    a = partitioning.param(rngs, a_shape, a_axes, f32, std=fan_in**-0.5, kind=LoRAParam)
    b = partitioning.param(rngs, b_shape, b_axes, f32, "zeros", kind=LoRAParam)
    setattr(layers, name + LORA_A, a)
    setattr(layers, name + LORA_B, b)


def lora_delta(
  cfg: ModelConfig, w, name: str, x: jax.Array, contract: int, key=None, *, mm=low_precision.project
) -> jax.Array:
  """(alpha / r) dropout(x) A B: the LoRA adapters' term of projection `name` for x (A, B are
  w[name + LORA_A], w[name + LORA_B]); dropout (cfg.lora_dropout) only when a key is given."""
  if key is not None and cfg.lora_dropout > 0:
    keep = jax.random.bernoulli(key, 1.0 - cfg.lora_dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - cfg.lora_dropout), jnp.zeros_like(x)).astype(x.dtype)
  down = mm(x, w[name + LORA_A], contract)
  return mm(down * jnp.asarray(cfg.lora_scale, down.dtype), w[name + LORA_B])


def merge_lora_weights(cfg: ModelConfig, stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Stacked layer weights (`Layers.arrays`) with each adapted weight replaced by
  W + (alpha / r) A B (in float32, stored in W's dtype) and the adapters dropped."""
  out = {k: a for k, a in stacked.items() if not k.endswith((LORA_A, LORA_B))}
  for name in cfg.lora_weights:
    a, b, w = stacked[name + LORA_A], stacked[name + LORA_B], stacked[name]
    a2 = a.reshape(a.shape[0], -1, a.shape[-1]).astype(jnp.float32)  # [L, in, r]
    b2 = b.reshape(b.shape[0], b.shape[1], -1).astype(jnp.float32)  # [L, r, out]
    delta = jnp.einsum("lir,lro->lio", a2, b2) * cfg.lora_scale
    merged = w.astype(jnp.float32) + delta.reshape(w.shape)
    out[name] = merged.astype(w.dtype)
  return out


def split_lora(params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
  """(adapters, frozen base) of a policy state with LoRA adapters (`LoRAParam`), or
  (params, None) without: what a run trains and what it only reads."""
  adapters, base = nnx.split_state(params, LoRAParam, ...)
  if not jax.tree.leaves(adapters):
    return params, None
  return adapters, base
