"""Mixture-of-experts MLP (Qwen3-MoE): the top-k router, the experts' products, what the router
chose (`LayerRoute`, `Routing`) and its load-balancing loss.

An expert layer replaces the dense MLP by a router [D, E] and E SwiGLU experts stacked on an
"expert" axis (`model.Layers`: moe_gate / moe_up [E, D, F], moe_down [E, F, D]; expert
parallelism shards that axis: partitioning.py). Each token runs through its k most probable
experts (`moe_mlp`), by one of two exact dispatches (ModelConfig.moe_dispatch): "sorted" (the
token-expert pairs sorted by expert, each expert's run of rows through `jax.lax.ragged_dot`: k
experts' FLOPs per token) or "dense" (every expert on every token: the simple reference).

How the sorted dispatch is traced is explicit, so that every jit's cache key holds it:
ModelConfig.ragged_dot_stand_in (the planner's CPU compile for GPU / TPU targets) and the
`under_vmap` argument (the continuous engine, which runs the model under `jax.vmap`).
"""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp
from jax import custom_batching

from gppo_jax.models import low_precision, partitioning
from gppo_jax.models.architectures import ModelConfig


@flax.struct.dataclass
class LayerRoute:
  """What one layer's router chose (`moe_mlp`); a dense layer of a mixed model gives -1 and
  zeros (`dense_route`)."""

  expert_ids: jax.Array  # int32 [B, T, k]: each token's experts, most probable first
  router_ids: jax.Array  # int32 [B, T, k]: the router's own top k (expert_ids unless forced)
  counts: jax.Array  # float32 [E]: how many of the real tokens' k choices went to each expert
  prob_sum: jax.Array  # float32 [E]: the router's probabilities summed over the real tokens


@flax.struct.dataclass
class Routing:
  """The experts a forward pass chose (`model.ModelOutput.routing`)."""

  expert_ids: jax.Array  # int32 [B, T, num_layers, k]; -1 in dense layers
  router_ids: jax.Array  # int32 [B, T, num_layers, k]: the router's own choice (= expert_ids
  # unless forced: routing replay)
  aux_loss: jax.Array  # float32 []: the load-balancing loss (`router_aux_loss`) of the real tokens


def dense_route(cfg: ModelConfig, batch: int, length: int) -> LayerRoute:
  """The `LayerRoute` of a dense layer in a model mixing dense and expert layers: no experts
  (-1), zero statistics."""
  k, E = cfg.num_experts_per_tok, cfg.num_experts
  zeros = jnp.zeros((E,), jnp.float32)
  none = jnp.full((batch, length, k), -1, jnp.int32)
  return LayerRoute(none, none, zeros, zeros)


def moe_mlp(cfg, w, h, expert_ids=None, mask=None, *, under_vmap: bool = False):
  """The mixture-of-experts MLP of h [B, T, D] with layer weights w (`Layers`: router [D, E],
  moe_gate / moe_up [E, D, F], moe_down [E, F, D], in the compute dtype) -> (out [B, T, D],
  `LayerRoute`).

  The router: logits h @ router in the compute dtype, their softmax over the E experts in
  float32, and the k = cfg.num_experts_per_tok most probable experts, whose probabilities are
  renormalised to sum to one (cfg.norm_topk_prob) and cast to the compute dtype: each token's
  output is the sum over its k experts of weight * SwiGLU expert(h). expert_ids int [B, T, k]
  (routing replay) force the experts of each token whose first id is >= 0: their weights are
  then the current router's probabilities of those experts (renormalised likewise), so the
  router still gets gradients, while a token whose ids are -1 routes itself. mask bool [B, T]:
  the tokens `LayerRoute`'s statistics count (default: all). under_vmap: traced inside
  `jax.vmap` (`_sorted_on_shards`)."""
  B, T, D = h.shape
  E, k, dt = cfg.num_experts, cfg.num_experts_per_tok, cfg.compute_dtype
  f32 = jnp.float32
  x = h.reshape(B * T, D)
  probs = jax.nn.softmax(low_precision.project(x, w["router"]).astype(f32), axis=-1)  # [N, E]
  top_p, ids = jax.lax.top_k(probs, k)
  own = ids
  if expert_ids is not None:
    forced = expert_ids.reshape(B * T, k).astype(jnp.int32)
    ids = jnp.where(forced[:, :1] >= 0, forced, ids)
    top_p = jnp.take_along_axis(probs, ids, axis=-1)
  if cfg.norm_topk_prob:
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
  weights = top_p.astype(dt)
  if cfg.moe_dispatch == "dense" or (T == 1 and _experts_split()):
    # A decode step on an expert mesh: each device runs its own experts on the step's few
    # tokens (E / k times the FLOPs of the step's expert products, but no experts moved), where
    # the sorted dispatch would all-gather every layer's experts at every step.
    y = _experts_dense(cfg, w, x, ids, weights)
  else:
    y = _sorted_on_shards(
      cfg, w, x.reshape(B, T, D), ids.reshape(B, T, k), weights.reshape(B, T, k), under_vmap
    )
  m = jnp.ones((B * T,), f32) if mask is None else mask.reshape(B * T).astype(f32)
  counts = jnp.zeros((E,), f32).at[ids.reshape(-1)].add(jnp.repeat(m, k))
  prob_sum = jnp.sum(probs * m[:, None], axis=0)
  route = LayerRoute(ids.reshape(B, T, k), own.reshape(B, T, k), counts, prob_sum)
  return y.reshape(B, T, D).astype(h.dtype), route


def _experts_dense(cfg, w, x, ids, weights):
  """Every expert on every token x [N, D], outputs weighted by the combine weights (zero but
  for each token's k experts): exact, E / k times the FLOPs of the sorted dispatch; the simple
  reference (and fine for tiny models)."""
  f32 = jnp.float32
  gate = jnp.einsum("nd,edf->nef", x, w["moe_gate"], preferred_element_type=f32)
  up = jnp.einsum("nd,edf->nef", x, w["moe_up"], preferred_element_type=f32)
  act = (jax.nn.silu(gate) * up).astype(x.dtype)
  y = jnp.einsum("nef,efd->ned", act, w["moe_down"], preferred_element_type=f32)
  combine = jnp.sum(jax.nn.one_hot(ids, cfg.num_experts, dtype=f32) * weights[..., None], axis=1)
  return jnp.einsum("ne,ned->nd", combine, y.astype(x.dtype).astype(f32))


def _experts_split() -> bool:
  """Whether the ambient mesh splits the experts (an expert axis larger than 1)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.shape.get(partitioning.EXPERT_AXIS, 1) > 1


def _sorted_on_shards(cfg, w, x, ids, weights, under_vmap: bool = False):
  """`_experts_sorted` of x [B, T, D] (ids, weights [B, T, k]) -> [B * T, D]. On a mesh whose
  batch axes split B (`partitioning.constrain_batch`'s ambient mesh), each device sorts and runs
  its own rows (`jax.shard_map`) against the experts all-gathered for the layer, as FSDP gathers
  a dense layer's weights: a sort over the whole batch would make XLA gather every device's
  token rows instead (the sort and the ragged products have no partitioned form), which is far
  more memory for long rollouts. The experts rest sharded over the expert axis; their gradient
  is reduce-scattered back to it. under_vmap (inside `jax.vmap`, whose batch axis the mesh
  splits already): no shard_map, and ragged products that batch (`_ragged_dot`)."""
  B, T, D = x.shape
  sorted_ = lambda x, ids, weights, *experts: _experts_sorted(
    cfg, dict(zip(("moe_gate", "moe_up", "moe_down"), experts, strict=True)),
    x.reshape(-1, D), ids.reshape(-1, ids.shape[-1]), weights.reshape(-1, weights.shape[-1]),
    under_vmap,
  )  # fmt: skip
  experts = (w["moe_gate"], w["moe_up"], w["moe_down"])
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else partitioning.batch_axes(mesh)
  shards = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if shards == 1 or B % shards or under_vmap:
    return sorted_(x, ids, weights, *experts)
  rows = jax.sharding.PartitionSpec(axes)
  whole = jax.sharding.PartitionSpec()
  run = jax.shard_map(
    sorted_, mesh=mesh, in_specs=(rows, rows, rows, whole, whole, whole), out_specs=rows
  )
  return run(x, ids, weights, *experts)


def _experts_sorted(cfg, w, x, ids, weights, under_vmap: bool = False):
  """The token-expert pairs of x [N, D] sorted by expert, each expert's contiguous run of rows
  multiplied by that expert's weights only (`jax.lax.ragged_dot` with the runs' lengths), then
  put back in token order and combined: exact (no capacity, no token dropped) and k experts'
  FLOPs per token, at the cost of one gather of N * k rows and its inverse. A one-hot dispatch
  einsum would also be exact only with a capacity of every token per expert, i.e. E times the
  work; gathering each token's experts' weights would copy k weight matrices per token."""
  N, D = x.shape
  E, k = cfg.num_experts, cfg.num_experts_per_tok
  f32 = jnp.float32
  flat = ids.reshape(N * k)
  order = jnp.argsort(flat, stable=True)  # pair positions grouped by expert
  rows = jnp.take(x, order // k, axis=0)  # [N * k, D]
  sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
  mm = lambda a, b: _ragged_dot(cfg, a, b, sizes, under_vmap)
  act = (jax.nn.silu(mm(rows, w["moe_gate"])) * mm(rows, w["moe_up"])).astype(x.dtype)
  y = mm(act, w["moe_down"]).astype(x.dtype)  # [N * k, D], sorted
  y = jnp.zeros_like(y).at[order].set(y).reshape(N, k, D)  # token order
  return jnp.einsum("nkd,nk->nd", y.astype(f32), weights.astype(f32))


def _ragged_dot(cfg, lhs, rhs, group_sizes, under_vmap: bool):
  """float32 ragged_dot(lhs [M, K], rhs [E, K, N], group_sizes [E]): row run e of lhs times rhs[e].

  With cfg.ragged_dot_stand_in (the planner, compiling on CPU for GPU / TPU, which run
  ragged_dot natively; XLA's CPU lowering is dense over the groups: each expert's weights
  against every row, masked, E times the memory): one product of the same operand and result
  shapes, lhs @ rhs[0]. under_vmap: `_batched_ragged_dot`, which batches under `jax.vmap` with
  the experts unbatched."""
  if cfg.ragged_dot_stand_in:
    return jnp.dot(lhs, rhs[0], preferred_element_type=jnp.float32)
  if under_vmap:
    return _batched_ragged_dot(lhs, rhs, group_sizes)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


_ragged_dot_f32 = functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32)


@custom_batching.custom_vmap
def _batched_ragged_dot(lhs, rhs, group_sizes):
  """`jax.lax.ragged_dot` in float32, batchable whichever of its operands `jax.vmap` batches:
  ragged_dot's own batching rule needs the experts (rhs) batched too, which the model's weights
  are not. No reverse-mode derivative (custom_vmap has none): inference only."""
  return _ragged_dot_f32(lhs, rhs, group_sizes)


@_batched_ragged_dot.def_vmap
def _batched_ragged_dot_rule(axis_size, in_batched, lhs, rhs, group_sizes):
  # Every operand given the batch axis (an unbatched one broadcast along it), then ragged_dot's
  # own rule.
  args = [
    x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
    for x, batched in zip((lhs, rhs, group_sizes), in_batched, strict=True)
  ]
  return jax.vmap(_ragged_dot_f32)(*args), True


def router_aux_loss(cfg: ModelConfig, counts: jax.Array, prob_sum: jax.Array, tokens) -> jax.Array:
  """The Switch-style load-balancing loss over the expert layers, as transformers'
  load_balancing_loss_func computes it: E * sum_e f_e P_e, where f_e is the share of the real
  tokens' top-k choices that went to expert e and P_e its mean router probability, both pooled
  over the expert layers (f sums to k: a uniform router gives k). counts, prob_sum [L, E]
  (`LayerRoute`, zeros in dense layers); tokens: the real tokens per layer."""
  moe_layers = sum(cfg.layer_is_moe(l) for l in range(cfg.num_layers))
  total = jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0) * moe_layers
  f = jnp.sum(counts, axis=0) / total
  P = jnp.sum(prob_sum, axis=0) / total
  return cfg.num_experts * jnp.sum(f * P)


def moe_flags(cfg: ModelConfig) -> jax.Array | None:
  """bool [num_layers]: which layers are mixtures of experts (scanned with the weights), or
  None unless cfg mixes dense and expert layers (then every layer's kind is known statically)."""
  if not cfg.mixed_mlp:
    return None
  return jnp.asarray([cfg.layer_is_moe(l) for l in range(cfg.num_layers)])


def routing_of(cfg: ModelConfig, routes: LayerRoute, mask: jax.Array) -> Routing:
  """The `Routing` of the layers' `LayerRoute`s stacked [L, ...] and the real tokens mask."""
  return Routing(
    expert_ids=jnp.moveaxis(routes.expert_ids, 0, 2),
    router_ids=jnp.moveaxis(routes.router_ids, 0, 2),
    aux_loss=router_aux_loss(cfg, routes.counts, routes.prob_sum, jnp.sum(mask)),
  )
