"""The policy: a decoder-only transformer (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2/3) in
Flax NNX.

The forward pass and the log-prob heads; its configuration (`ModelConfig`, the named
architectures, the Hugging Face config.json mapping) is in `architectures.py`.

One module covers the Hugging Face families: RoPE (with Llama-3 frequency scaling),
grouped-query attention, SwiGLU MLP, RMSNorm, optional q/k/v bias (Qwen2) and per-head q/k RMSNorm
(Qwen3), tied or untied embeddings. Gemma is a configuration of the same layer (ModelConfig's
Gemma fields): GeGLU, (1 + w) RMSNorm, norms on the attention's and MLP's outputs too, the
sqrt(hidden) embedding scale, its attention scale and soft caps, sliding-window layers (their
window and, for Gemma 3, their own RoPE base picked per layer inside the scan). Qwen3-MoE is
Qwen3 with the MLP replaced by a top-k router over experts stacked [E, ...] (`moe_mlp`), some
layers optionally keeping a dense MLP (picked per layer inside the scan). Layer weights
are stacked on a leading "layers" axis and the forward pass is a `lax.scan`, so a 32-layer model
compiles as fast as a 1-layer one.

Every parameter carries logical axis names (`out_sharding` metadata on `nnx.Param`); the rules
table in `partitioning.py` maps them to mesh axes, so sharding never touches this file.

Training reads log-probs through `chunked_logprobs`, which walks the sequence in chunks under
`jax.checkpoint` so the [B, T, vocab] float32 logits never exist at once, not even under grad
(unless they are small: `ONE_CHUNK_BYTES`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Sequence

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from gppo_jax.models import attention as attention_lib
from gppo_jax.models import low_precision, partitioning
from gppo_jax.models.architectures import (
  REMAT_POLICIES,
  ModelConfig,
  layer_plan,
  resolve_attention,
)

# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


class LoRAParam(nnx.Param):
  """A LoRA adapter matrix (`Layers`): with LoRA on, the only parameters a run trains, carries
  optimizer state for and checkpoints (`split_lora`)."""


def _param(
  rngs: nnx.Rngs | None,
  shape,
  axes,
  dtype,
  init: str = "normal",
  std: float = 0.02,
  kind: type[nnx.Param] = nnx.Param,
) -> nnx.Param:
  """An nnx.Param (or `kind`) with logical axis names; placement is decided later by
  partitioning.py."""
  if init == "normal":
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "ones":
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  return kind(value.astype(dtype), out_sharding=tuple(axes), eager_sharding=False)


LORA_A, LORA_B = "_lora_a", "_lora_b"  # suffixes of a weight's adapters' names in `Layers`


def contracted_axes(name: str) -> int:
  """How many leading axes (after "layers") of layer weight `name` a projection contracts: the
  output projection wo [heads, head_dim, embed] two, every other one."""
  return 2 if name == "wo" else 1


class Layers(nnx.Module):
  """All decoder layers' weights, stacked on a leading "layers" axis (one scan step each)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    H, K, Dh, dt = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.params_dtype
    std = cfg.initializer_range
    p = lambda shape, axes, init="normal": _param(
      rngs, (L, *shape), ("layers", *axes), dt, init, std
    )
    norm = "zeros" if cfg.norm_plus_one else "ones"  # a (1 + w) norm starts at w = 0
    self.attn_norm = p((D,), ("embed",), norm)
    self.wq = p((D, H, Dh), ("embed", "heads", "head_dim"))
    self.wk = p((D, K, Dh), ("embed", "kv_heads", "head_dim"))
    self.wv = p((D, K, Dh), ("embed", "kv_heads", "head_dim"))
    self.wo = p((H, Dh, D), ("heads", "head_dim", "embed"))
    if cfg.attention_bias:
      self.bq = p((H, Dh), ("heads", "head_dim"), "zeros")
      self.bk = p((K, Dh), ("kv_heads", "head_dim"), "zeros")
      self.bv = p((K, Dh), ("kv_heads", "head_dim"), "zeros")
    if cfg.qk_norm:
      self.q_norm = p((Dh,), ("head_dim",), norm)
      self.k_norm = p((Dh,), ("head_dim",), norm)
    if cfg.post_norms:
      self.attn_post_norm = p((D,), ("embed",), norm)
      self.mlp_post_norm = p((D,), ("embed",), norm)
    self.mlp_norm = p((D,), ("embed",), norm)
    if cfg.has_dense_mlp:
      self.w_gate = p((D, F), ("embed", "mlp"))
      self.w_up = p((D, F), ("embed", "mlp"))
      self.w_down = p((F, D), ("mlp", "embed"))
    if cfg.is_moe:
      # The router [D, E] and the experts stacked on an "expert" axis (expert parallelism
      # shards it: partitioning.py).
      E, Fe = cfg.num_experts, cfg.moe_intermediate_size
      self.router = p((D, E), ("embed", "router"))
      self.moe_gate = p((E, D, Fe), ("expert", "embed", "expert_mlp"))
      self.moe_up = p((E, D, Fe), ("expert", "embed", "expert_mlp"))
      self.moe_down = p((E, Fe, D), ("expert", "expert_mlp", "embed"))
    # LoRA adapters of the targeted weights W [*in, *out]: A [*in, r] (random, std
    # 1/sqrt(fan-in)) and B [r, *out] (zeros, so that a fresh adapter leaves the model as it is),
    # in float32 whatever the base's dtype (they are the trained, master weights).
    r = cfg.lora_rank
    for name in cfg.lora_weights:
      w = getattr(self, name)
      c = contracted_axes(name)
      shape, axes = w.shape[1:], w.get_metadata()["out_sharding"][1:]
      fan_in = math.prod(shape[:c])
      a_shape, b_shape = (L, *shape[:c], r), (L, r, *shape[c:])
      a_axes, b_axes = ("layers", *axes[:c], "lora"), ("layers", "lora", *axes[c:])
      f32 = jnp.float32
      setattr(
        self, name + LORA_A, _param(rngs, a_shape, a_axes, f32, std=fan_in**-0.5, kind=LoRAParam)
      )
      setattr(self, name + LORA_B, _param(rngs, b_shape, b_axes, f32, "zeros", kind=LoRAParam))

  def arrays(self) -> dict[str, jax.Array]:
    return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer for B sequences of up to S slots, and which slots are real."""

  k: jax.Array  # [num_layers, B, S, num_kv_heads, head_dim], compute dtype
  v: jax.Array  # same
  mask: jax.Array  # bool [B, S]: slot holds a real (non-pad) token

  def grow(self, slots: int) -> KVCache:
    """The cache padded with empty slots (zeros, mask False) to `slots` slots."""
    extra = slots - self.mask.shape[1]
    if extra <= 0:
      return self
    return KVCache(
      k=_pad_axis(self.k, 2, extra),
      v=_pad_axis(self.v, 2, extra),
      mask=_pad_axis(self.mask, 1, extra),
    )


def _pad_axis(x: jax.Array, axis: int, extra: int) -> jax.Array:
  """x with `extra` zeros (False) appended along `axis`."""
  return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


@flax.struct.dataclass
class LayerCache:
  """A KV cache as each layer's own arrays, in the layout a one-token decode step reads fastest.

  Built once from a prefill's stacked `KVCache` (`from_stacked`) for `Transformer.decode_step`
  with unrolled layers: reading a layer of the stacked cache is a copy of that layer on CPU, and
  keys stored transposed make the score product a plain matrix product over the slots (keys
  stored [slot, head, dim] XLA first transposes, a copy of the whole cache each step).
  """

  k: tuple[jax.Array, ...]  # per layer [B, num_kv_heads, head_dim, S]: keys transposed
  v: tuple[jax.Array, ...]  # per layer [B, num_kv_heads, S, head_dim]
  mask: jax.Array  # bool [B, S]: slot holds a real (non-pad) token

  @classmethod
  def from_stacked(cls, cache: KVCache) -> LayerCache:
    layers = range(cache.k.shape[0])
    return cls(
      k=tuple(cache.k[l].transpose(0, 2, 3, 1) for l in layers),
      v=tuple(cache.v[l].transpose(0, 2, 1, 3) for l in layers),
      mask=cache.mask,
    )

  def grow(self, slots: int) -> LayerCache:
    """The cache padded with empty slots (zeros, mask False) to `slots` slots."""
    extra = slots - self.mask.shape[1]
    if extra <= 0:
      return self
    return LayerCache(
      k=tuple(_pad_axis(x, 3, extra) for x in self.k),
      v=tuple(_pad_axis(x, 2, extra) for x in self.v),
      mask=_pad_axis(self.mask, 1, extra),
    )


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> KVCache:
  """An empty cache (zeros, mask all False) for `batch_size` sequences of `max_len` slots."""
  shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
  zeros = jnp.zeros(shape, cfg.compute_dtype)
  return KVCache(k=zeros, v=zeros, mask=jnp.zeros((batch_size, max_len), bool))


# --------------------------------------------------------------------------------------------
# Forward pass
# --------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
  """RMSNorm over the last axis in float32, returned in x's dtype (as Llama/Qwen do). plus_one:
  scaled by (1 + weight) in float32, then cast (as Gemma does)."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if plus_one:
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
  return _in_float32(jnp.multiply, xf.astype(x.dtype), weight.astype(x.dtype))


def norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
  """The model's RMSNorm of x with `weight` (cfg's eps and weight convention)."""
  return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_plus_one)


def embed_tokens(cfg: ModelConfig, table: jax.Array, tokens: jax.Array) -> jax.Array:
  """The rows of the embedding `table` for `tokens`, in the compute dtype; with cfg.embed_scale
  times sqrt(hidden_size) rounded to that dtype (as transformers' Gemma does)."""
  x = jnp.take(table, tokens, axis=0).astype(cfg.compute_dtype)
  if cfg.embed_scale:
    x = x * jnp.asarray(cfg.hidden_size**0.5, cfg.compute_dtype)
  return x


def scores_of(cfg: ModelConfig) -> attention_lib.Scores:
  """How cfg's attention forms its scores: scale, soft cap, sliding window."""
  scale = cfg.attn_scale if cfg.query_pre_attn_scalar else None
  window = cfg.sliding_window if cfg.windowed else None
  return attention_lib.Scores(scale=scale, softcap=cfg.attn_softcap, window=window)


def local_flags(cfg: ModelConfig) -> jax.Array | None:
  """bool [num_layers]: which layers are sliding-window ones (scanned with the weights), or
  None when none is."""
  if not cfg.windowed:
    return None
  return jnp.asarray([l in cfg.local_layers for l in range(cfg.num_layers)])


def final_softcap(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
  """Logits soft-capped at cfg.final_softcap (cap * tanh(logits / cap)); unchanged without."""
  return attention_lib.soft_cap(logits, cfg.final_softcap)


def _in_float32(op: Callable, a: jax.Array, b: jax.Array) -> jax.Array:
  """op(a, b) in a's dtype, computed in float32 where `low_precision.applies` (16-bit on one CPU
  device): the values XLA's CPU backend computes anyway, but the gradient of a broadcast operand
  (a norm's weight, a bias) then sums over the tokens in float32. That backend sums bf16 in
  bf16, through slow reduce-windows: over long sequences such gradients drift far from the
  float32 ones (some elements off by more than their own size). Elsewhere plain op(a, b): on
  every backend the float32 ops would add float32 temporaries to the planner's compiled plans
  (CPU devices standing in for TPUs)."""
  if not low_precision.applies(a):
    return op(a, b)
  f32 = jnp.float32
  return op(a.astype(f32), b.astype(f32)).astype(a.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> jax.Array:
  """float32 [head_dim // 2] inverse frequencies, with linear or Llama-3 scaling applied; local:
  the local layers' (cfg.rope_local_theta, unscaled)."""
  d = cfg.head_dim
  theta = cfg.rope_local_theta if local else cfg.rope_theta
  inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  p = {} if local else cfg.rope_params
  kind = p.get("rope_type", "default")
  if kind == "linear":
    inv = inv / p["factor"]
  elif kind == "llama3":
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    inv = jnp.where(medium, smoothed, scaled)
  return inv


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) float32 [B, T, 1, head_dim] of positions [B, T] (half-split layout, as HF),
  computed once per forward (each distinct angle once) and shared by every layer: inside the
  layer scan they would be computed per layer and again in each remat recompute. With
  cfg.rope_local_theta each is [2, B, T, 1, head_dim]: the global layers' and the local ones'
  (`decoder_layer` picks)."""
  twice = lambda a: jnp.concatenate([a, a], -1)[:, :, None, :]

  def tables(local):
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg, local)  # [B,T,Dh/2]
    return twice(jnp.cos(angles)), twice(jnp.sin(angles))

  if cfg.rope_local_theta is None:
    return tables(False)
  return tuple(jnp.stack(pair) for pair in zip(tables(False), tables(True), strict=True))


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotates x [B, T, heads, head_dim] by `rope_tables`' (cos, sin) of its positions."""
  cos, sin = rope
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)


def project(x: jax.Array, w: jax.Array, contract: int = 1, *, custom_vjp: bool = True) -> jax.Array:
  """x [..., *in] @ w [*in, *out] over the `contract` trailing axes of x, as one 2-D matmul.

  Flattening the token axes first (x as [tokens, in]) gives XLA plain matrix products in the
  forward and the backward: the same contraction written as a batched einsum
  ("btd,df->btf") makes XLA's CPU backend transpose the activation gradient of every weight
  gradient (a copy of each layer's activations). In a
  16-bit dtype on CPU the product is `low_precision.matmul` unless custom_vjp is False (remat
  "dots" must see a plain product to save it)."""
  lead, inner = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :]
  out = w.shape[contract:]
  x2, w2 = x.reshape(math.prod(lead), math.prod(inner)), w.reshape(math.prod(inner), math.prod(out))
  y = low_precision.matmul(x2, w2) if custom_vjp and low_precision.applies(x2) else x2 @ w2
  return y.reshape(*lead, *out)


def lora_delta(cfg, w, name: str, x: jax.Array, contract: int, key=None, *, mm=project):
  """(alpha / r) dropout(x) A B: the LoRA adapters' term of projection `name` for x (A, B are
  w[name + LORA_A], w[name + LORA_B]); dropout (cfg.lora_dropout) only when a key is given."""
  if key is not None and cfg.lora_dropout > 0:
    keep = jax.random.bernoulli(key, 1.0 - cfg.lora_dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - cfg.lora_dropout), jnp.zeros_like(x)).astype(x.dtype)
  down = mm(x, w[name + LORA_A], contract)
  return mm(down * jnp.asarray(cfg.lora_scale, down.dtype), w[name + LORA_B])


def decoder_layer(cfg, p, x, rope, attend, local=None, lora_key=None, *, moe=None):
  """One pre-norm decoder layer (`routed_decoder_layer` without what its router chose)."""
  return routed_decoder_layer(cfg, p, x, rope, attend, local, lora_key, moe=moe)[0]


def routed_decoder_layer(
  cfg, p, x, rope, attend, local=None, lora_key=None, *, moe=None, expert_ids=None, mask=None
):
  """One pre-norm decoder layer -> (x, `LayerRoute` or None without experts). attend(q, k, v,
  local) -> [B, T, H, Dh] handles cache / no cache; local: whether this is a sliding-window
  layer (a bool, traced inside the layer scan; None when the model has none), which also picks
  its RoPE tables (`rope_tables`). Weights with LoRA adapters in p (`Layers`) add their term;
  lora_key (training only) draws the adapters' dropout. moe: whether this layer is a mixture of
  experts, needed (a bool, traced in a scan) only where cfg mixes dense and expert layers
  (`moe_flags`); expert_ids int [B, T, k] force the tokens' experts (`moe_mlp`); mask bool
  [B, T]: the real tokens the router's statistics count."""
  dt = cfg.compute_dtype
  w = {k: a.astype(dt) for k, a in p.items()}
  # remat "dots" keeps the projections' products, which a custom VJP would hide from it.
  plain = functools.partial(project, custom_vjp=cfg.remat != "dots")

  def mm(h, name, contract=1):
    y = plain(h, w[name], contract)
    if name + LORA_A in w:
      key = None
      if lora_key is not None:
        key = jax.random.fold_in(lora_key, cfg.lora_weights.index(name))
      y = y + lora_delta(cfg, w, name, h, contract, key, mm=plain)
    return y

  if cfg.rope_local_theta is not None:
    pick = jnp.asarray(False if local is None else local, jnp.int32)
    rope = tuple(jax.lax.dynamic_index_in_dim(t, pick, keepdims=False) for t in rope)
  h = norm(cfg, x, w["attn_norm"])
  q = mm(h, "wq")
  k = mm(h, "wk")
  v = mm(h, "wv")
  if cfg.attention_bias:
    q, k, v = (_in_float32(jnp.add, a, w[b]) for a, b in ((q, "bq"), (k, "bk"), (v, "bv")))
  if cfg.qk_norm:
    q = norm(cfg, q, w["q_norm"])
    k = norm(cfg, k, w["k_norm"])
  q = apply_rope(q, rope)
  k = apply_rope(k, rope)
  attn = mm(attend(q, k, v, local), "wo", contract=2)
  if cfg.post_norms:
    attn = norm(cfg, attn, w["attn_post_norm"])
  x = x + attn
  h = norm(cfg, x, w["mlp_norm"])

  def dense(h):
    gate = mm(h, "w_gate")
    up = mm(h, "w_up")
    act = jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    out = mm(act * up, "w_down")
    if not cfg.is_moe:
      return out, None
    B, T, _ = h.shape
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    zeros = jnp.zeros((E,), jnp.float32)
    none = jnp.full((B, T, k), -1, jnp.int32)
    return out, LayerRoute(none, none, zeros, zeros)

  sparse = lambda h: moe_mlp(cfg, w, h, expert_ids, mask)
  if not cfg.is_moe:
    out, route = dense(h)
  elif not cfg.mixed_mlp:
    out, route = sparse(h)
  elif moe is None:
    raise ValueError("a model mixing dense and expert layers needs each layer's moe flag")
  elif isinstance(moe, bool):
    out, route = sparse(h) if moe else dense(h)
  else:
    out, route = jax.lax.cond(moe, sparse, dense, h)
  if cfg.post_norms:
    out = norm(cfg, out, w["mlp_post_norm"])
  return x + out, route


@flax.struct.dataclass
class LayerRoute:
  """What one layer's router chose (`moe_mlp`); a dense layer of a mixed model gives -1 and
  zeros."""

  expert_ids: jax.Array  # int32 [B, T, k]: each token's experts, most probable first
  router_ids: jax.Array  # int32 [B, T, k]: the router's own top k (expert_ids unless forced)
  counts: jax.Array  # float32 [E]: how many of the real tokens' k choices went to each expert
  prob_sum: jax.Array  # float32 [E]: the router's probabilities summed over the real tokens


@flax.struct.dataclass
class Routing:
  """The experts a forward pass chose (`Transformer.__call__(..., with_routing=True)`)."""

  expert_ids: jax.Array  # int32 [B, T, num_layers, k]; -1 in dense layers
  router_ids: jax.Array  # int32 [B, T, num_layers, k]: the router's own choice (= expert_ids
  # unless forced: routing replay)
  aux_loss: jax.Array  # float32 []: the load-balancing loss (`router_aux_loss`) of the real tokens


def moe_mlp(cfg, w, h, expert_ids=None, mask=None):
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
  the tokens `LayerRoute`'s statistics count (default: all)."""
  B, T, D = h.shape
  E, k, dt = cfg.num_experts, cfg.num_experts_per_tok, cfg.compute_dtype
  f32 = jnp.float32
  x = h.reshape(B * T, D)
  probs = jax.nn.softmax(project(x, w["router"]).astype(f32), axis=-1)  # [N, E]
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
      cfg, w, x.reshape(B, T, D), ids.reshape(B, T, k), weights.reshape(B, T, k)
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


def _sorted_on_shards(cfg, w, x, ids, weights):
  """`_experts_sorted` of x [B, T, D] (ids, weights [B, T, k]) -> [B * T, D]. On a mesh whose
  batch axes split B (`partitioning.constrain_batch`'s ambient mesh), each device sorts and runs
  its own rows (`jax.shard_map`) against the experts all-gathered for the layer, as FSDP gathers
  a dense layer's weights: a sort over the whole batch would make XLA gather every device's
  token rows instead (the sort and the ragged products have no partitioned form), which is far
  more memory for long rollouts. The experts rest sharded over the expert axis; their gradient
  is reduce-scattered back to it."""
  B, T, D = x.shape
  sorted_ = lambda x, ids, weights, *experts: _experts_sorted(
    cfg, dict(zip(("moe_gate", "moe_up", "moe_down"), experts, strict=True)),
    x.reshape(-1, D), ids.reshape(-1, ids.shape[-1]), weights.reshape(-1, weights.shape[-1]),
  )  # fmt: skip
  experts = (w["moe_gate"], w["moe_up"], w["moe_down"])
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else partitioning.batch_axes(mesh)
  shards = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if shards == 1 or B % shards or getattr(_TRACING, "vmapped", False):
    return sorted_(x, ids, weights, *experts)
  rows = jax.sharding.PartitionSpec(axes)
  whole = jax.sharding.PartitionSpec()
  run = jax.shard_map(
    sorted_, mesh=mesh, in_specs=(rows, rows, rows, whole, whole, whole), out_specs=rows
  )
  return run(x, ids, weights, *experts)


def _experts_sorted(cfg, w, x, ids, weights):
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

  def mm(a, b):
    if getattr(_TRACING, "vmapped", False):
      # Under vmap (`experts_under_vmap`) ragged_dot batches only with its experts batched too:
      # make them so, by a zero derived from the (batched, finite) rows.
      b = b + jax.lax.stop_gradient(a[0, 0]).astype(b.dtype) * jnp.zeros((), b.dtype)
    return _ragged_dot(a, b, sizes, preferred_element_type=f32)

  act = (jax.nn.silu(mm(rows, w["moe_gate"])) * mm(rows, w["moe_up"])).astype(x.dtype)
  y = mm(act, w["moe_down"]).astype(x.dtype)  # [N * k, D], sorted
  y = jnp.zeros_like(y).at[order].set(y).reshape(N, k, D)  # token order
  return jnp.einsum("nkd,nk->nd", y.astype(f32), weights.astype(f32))


# XLA runs ragged_dot natively on GPU and TPU; its CPU lowering is dense over the groups (each
# expert's weights against every row, masked: E times the memory). The planner, which compiles
# on CPU for those targets, traces under `ragged_dot_stand_in`: one product of the same operand
# and result shapes (the first expert's weights), as a native ragged_dot holds them. Both flags
# here are read while tracing (`ragged_dot_stand_in`, `experts_under_vmap`).
_TRACING = threading.local()


@contextlib.contextmanager
def ragged_dot_stand_in():
  """Within: the sorted dispatch's ragged products traced as `_ragged_dot` describes."""
  _TRACING.on = True
  try:
    yield
  finally:
    _TRACING.on = False


@contextlib.contextmanager
def experts_under_vmap():
  """Within: the sorted dispatch is traced to run under `jax.vmap` (the continuous engine's
  leading shard axis), which batches ragged_dot only when its experts are batched as well."""
  _TRACING.vmapped = True
  try:
    yield
  finally:
    _TRACING.vmapped = False


def _ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None):
  if getattr(_TRACING, "on", False):
    return jnp.dot(lhs, rhs[0], preferred_element_type=preferred_element_type)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


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


def _routing(cfg: ModelConfig, routes: LayerRoute, mask: jax.Array) -> Routing:
  """A `Routing` from the layer scan's stacked `LayerRoute`s ([L, ...]) and the real tokens."""
  return Routing(
    expert_ids=jnp.moveaxis(routes.expert_ids, 0, 2),
    router_ids=jnp.moveaxis(routes.router_ids, 0, 2),
    aux_loss=router_aux_loss(cfg, routes.counts, routes.prob_sum, jnp.sum(mask)),
  )


class Transformer(nnx.Module):
  """Decoder-only causal LM. `__call__` returns final-norm hidden states; `logits` projects."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = cfg.params_dtype
    std = cfg.initializer_range
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt, std=std)
    self.layers = Layers(cfg, rngs)
    self.final_norm = _param(rngs, (cfg.hidden_size,), ("embed",), dt, "ones")
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(
        rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt, std=std
      )

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    attn_mask: jax.Array | None = None,
    cache: KVCache | None = None,
    cache_index: jax.Array | int | None = None,
    cache_block: int | None = None,
    lora_key: jax.Array | None = None,
    expert_ids: jax.Array | None = None,
    with_routing: bool = False,
  ) -> tuple[jax.Array, KVCache | None] | tuple[jax.Array, KVCache | None, Routing]:
    """tokens, positions: int32 [B, T]; attn_mask: bool [B, T] (False = padding).

    Without cache: causal attention over the T tokens, ignoring keys whose attn_mask is False;
    a padding query attends only to itself (finite, ignorable output). The implementation is
    cfg.attention (`attention.py`: dense, blockwise, cudnn, splash or auto).
    With cache and scalar cache_index: writes the new K/V into slots [cache_index,
    cache_index + T), marks them with attn_mask, and token i attends to every real slot
    j <= cache_index + i and to its own slot, reading only the cache blocks up to the last query
    (`attention.cached_attention`, a traced trip count: one compiled step serves every
    cache_index). Blocks of `cache_block` slots; by default a single token (the decode step)
    uses `attention.DECODE_BLOCK` and several tokens (a prefill) `attention.BLOCK_SIZE`, or
    attend densely over the whole cache when cfg.attention resolves to dense for its length.
    lora_key (without cache only: training) draws the LoRA adapters' dropout
    (cfg.lora_dropout); without it there is none.
    Mixtures of experts: expert_ids int [B, T, num_layers, k] force each token's experts in each
    expert layer (routing replay; a token whose ids are -1 routes itself: `moe_mlp`).
    Returns (hidden [B, T, hidden_size] after the final norm, new cache or None), and with
    with_routing (models with experts only) a third item, the `Routing` (the experts chosen,
    the load-balancing loss of the real tokens).
    """
    cfg = self.cfg
    B, T = tokens.shape
    if attn_mask is None:
      attn_mask = jnp.ones((B, T), bool)
    attn_mask = attn_mask.astype(bool)
    embed = lambda tokens: embed_tokens(cfg, self.embed[...], tokens)
    params = self.layers.arrays()
    layer_ids = jnp.arange(cfg.num_layers)
    scores, flags = scores_of(cfg), local_flags(cfg)
    if (with_routing or expert_ids is not None) and not cfg.is_moe:
      raise ValueError("with_routing / expert_ids: the model has no experts (num_experts=0)")
    forced = None if expert_ids is None else jnp.moveaxis(expert_ids, 2, 0)  # [L, B, T, k]

    if cache is None and self._attention(T) == "cudnn":
      # cuDNN takes padding as sequence lengths: rotate each row once so that its real tokens
      # come first (positions travel with their tokens), run every layer on the rotated rows,
      # and rotate the hidden states back. Rotating q, k, v and the output in each layer
      # instead (`attention.cudnn`) costs a scatter-add for each in the backward.
      fwd, back, length = attention_lib.left_align(attn_mask)
      rotate = lambda a, idx: jnp.take_along_axis(a, idx, axis=1)
      x = embed(rotate(tokens, fwd))
      attend = lambda q, k, v, local: attention_lib.per_layer_kernel(
        lambda w: attention_lib.cudnn_left_aligned(q, k, v, length, scale=scores.scale, window=w),
        scores.window,
        local,
      )
      if forced is not None:
        forced = jax.vmap(lambda a: rotate(a, fwd[:, :, None]))(forced)
      x, routes = self._layer_scan(
        x, rotate(positions, fwd), attend, lora_key, forced, rotate(attn_mask, fwd)
      )
      x = rotate(x, back[:, :, None])
      if routes is not None:
        unrotate = jax.vmap(lambda a: rotate(a, back[:, :, None]))
        routes = routes.replace(
          expert_ids=unrotate(routes.expert_ids), router_ids=unrotate(routes.router_ids)
        )
      new_cache = None
    elif cache is None:
      x, routes = self._layer_scan(
        embed(tokens), positions, self._self_attend(attn_mask), lora_key, forced, attn_mask
      )
      new_cache = None
    else:
      if cache_index is None:
        raise ValueError("cache_index is required together with cache")
      x = embed(tokens)
      idx = jnp.asarray(cache_index, jnp.int32)
      S = cache.mask.shape[1]
      mask = jax.lax.dynamic_update_slice(cache.mask, attn_mask, (0, idx))
      query_slot = idx + jnp.arange(T)[:, None]
      slots = jnp.arange(S)[None, :]
      # Blockwise over the filled cache blocks, read in place; a prefill attends densely over
      # the whole cache when the attention resolves to dense for this cache length.
      blockwise = cache_block is not None or T == 1
      blockwise = blockwise or self._attention(S) != "dense"
      if cache_block is None:
        cache_block = attention_lib.DECODE_BLOCK if T == 1 else attention_lib.BLOCK_SIZE
      causal = (slots <= query_slot)[None] & mask[:, None, :]
      zero = jnp.zeros((), jnp.int32)
      rope = rope_tables(positions, cfg)
      kinds = moe_flags(cfg)

      def step(carry, xs):
        x, ck, cv = carry
        p, l, ids = xs
        local = None if flags is None else flags[l]
        moe = None if kinds is None else kinds[l]

        def attend(q, k, v, local):
          nonlocal ck, cv
          at = (l, zero, idx, zero, zero)
          ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), at)
          cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), at)
          window = attention_lib.layer_window(scores.window, local)
          if blockwise:
            return attention_lib.cached_attention(
              q, ck, cv, mask, idx, block_size=cache_block, layer=l, scale=scores.scale,
              softcap=scores.softcap, window=window,
            )  # fmt: skip
          keys = jax.lax.dynamic_index_in_dim(ck, l, keepdims=False)
          values = jax.lax.dynamic_index_in_dim(cv, l, keepdims=False)
          ok = causal if window is None else causal & ((query_slot - slots) < window)[None]
          allowed = ok | (slots == query_slot)[None]
          return attention_lib.dense(q, keys, values, allowed, scores.scale, scores.softcap)

        x, route = routed_decoder_layer(
          cfg, p, x, rope, attend, local, moe=moe, expert_ids=ids, mask=attn_mask
        )
        return (x, ck, cv), route

      xs = (params, layer_ids, forced)
      (x, ck, cv), routes = jax.lax.scan(step, (x, cache.k, cache.v), xs)
      new_cache = KVCache(k=ck, v=cv, mask=mask)

    hidden = norm(cfg, x, self.final_norm[...])
    if with_routing:
      return hidden, new_cache, _routing(cfg, routes, attn_mask)
    return hidden, new_cache

  def decode_step(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    attn_mask: jax.Array,
    cache: LayerCache,
    cache_index: jax.Array | int,
    weights: tuple[Sequence[dict[str, jax.Array]], jax.Array],
    with_routing: bool = False,
  ) -> tuple[jax.Array, LayerCache] | tuple[jax.Array, LayerCache, jax.Array]:
    """One token per row through the layers unrolled on `weights` (`decode_weights`, made once
    outside the decode loop: a scan would slice the stacked weights at every step, on CPU a copy
    of each layer). tokens, positions int32 [B, 1]; attn_mask bool [B, 1].

    Writes the new keys / values into slot `cache_index` and attends, as `__call__` with a
    cache does, to the real slots <= cache_index and to its own slot
    (`attention.decode_attention`, over all the cache's slots: the sampler grows the cache in a
    few phases so that a step costs about what the filled length costs).
    Returns (float32 logits [B, vocab] of the next token, new cache), and with with_routing
    (models with experts) the experts each row's token chose, int32 [B, num_layers, k].
    """
    layer_weights, head = weights
    cfg = self.cfg
    scores = scores_of(cfg)
    x = embed_tokens(cfg, self.embed[...], tokens)
    rope = rope_tables(positions, cfg)
    idx = jnp.asarray(cache_index, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    mask = jax.lax.dynamic_update_slice(cache.mask, attn_mask.astype(bool), (zero, idx))
    keys, values = list(cache.k), list(cache.v)
    routes = []
    for l, p in enumerate(layer_weights):

      def attend(q, k, v, local, l=l):
        # k, v [B, 1, K, Dh] -> slot idx of keys [B, K, Dh, S] / values [B, K, S, Dh]
        new_k = k.transpose(0, 2, 3, 1).astype(keys[l].dtype)
        keys[l] = jax.lax.dynamic_update_slice(keys[l], new_k, (zero, zero, zero, idx))
        new_v = v.transpose(0, 2, 1, 3).astype(values[l].dtype)
        values[l] = jax.lax.dynamic_update_slice(values[l], new_v, (zero, zero, idx, zero))
        return attention_lib.decode_attention(
          q, keys[l], values[l], mask, idx, scale=scores.scale, softcap=scores.softcap,
          window=cfg.layer_window(l),
        )  # fmt: skip

      local = (l in cfg.local_layers) if cfg.windowed else None
      x, route = routed_decoder_layer(cfg, p, x, rope, attend, local, moe=cfg.layer_is_moe(l))
      routes.append(route)
    new_cache = LayerCache(k=tuple(keys), v=tuple(values), mask=mask)
    hidden = norm(cfg, x[:, 0], self.final_norm[...])
    logits = final_softcap(cfg, head_logits(hidden, head, tied=True))
    if with_routing:
      return logits, new_cache, jnp.stack([r.expert_ids[:, 0] for r in routes], axis=1)
    return logits, new_cache

  def _attention(self, seq_len: int) -> str:
    """The attention implementation cfg.attention resolves to for `seq_len` tokens."""
    return resolve_attention(self.cfg, seq_len)

  def _self_attend(self, attn_mask: jax.Array) -> Callable:
    """attend(q, k, v, local) for causal self-attention over [B, T] rows with padding mask
    attn_mask."""
    impl = self._attention(attn_mask.shape[1])
    scores = scores_of(self.cfg)
    if impl == "dense":  # the masks built once, outside the layer scan
      allowed = _layer_allowed(lambda w: attention_lib.self_allowed(attn_mask, w), scores.window)
      return lambda q, k, v, local: attention_lib.dense_fused(
        q, k, v, allowed(local), scores.scale, scores.softcap
      )
    # cfg.attention itself, not what it resolves to: "auto" may run blockwise's tiles unrolled.
    return lambda q, k, v, local: attention_lib.attention(
      q, k, v, attn_mask, self.cfg.attention, scores=scores, local=local
    )

  def _layer_scan(
    self,
    x: jax.Array,
    positions: jax.Array,
    attend: Callable,
    lora_key: jax.Array | None = None,
    forced: jax.Array | None = None,
    mask: jax.Array | None = None,
  ) -> tuple[jax.Array, LayerRoute | None]:
    """The decoder layers (no cache) on x [B, T, D]: a scan over the stacked layer weights,
    each step rematerialised, as `architectures.layer_plan` says for cfg and this shape.
    lora_key: one dropout key per layer for the LoRA adapters (`decoder_layer`). Returns (x,
    the layers' `LayerRoute`s stacked [L, ...], None without experts); forced int [L, B, T, k]:
    the experts to use (routing replay); mask bool [B, T]: the real tokens."""
    cfg = self.cfg
    rope = rope_tables(positions, cfg)  # outside the scan (and its remat): once per forward
    remat, scan = layer_plan(cfg, *x.shape[:2])
    dropout = lora_key is not None and cfg.lora_rank > 0 and cfg.lora_dropout > 0
    keys = jax.random.split(lora_key, cfg.num_layers) if dropout else None

    def step(x, xs):
      p, local, key, moe, ids = xs
      x = partitioning.constrain_batch(x)
      return routed_decoder_layer(
        cfg, p, x, rope, attend, local, key, moe=moe, expert_ids=ids, mask=mask
      )

    if REMAT_POLICIES[remat] is not None:
      step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=False)
    xs = (self.layers.arrays(), local_flags(cfg), keys, moe_flags(cfg), forced)
    return jax.lax.scan(step, x, xs, unroll=not scan)

  def shared_prompt_hidden(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    attn_mask: jax.Array,
    *,
    prompt_len: int,
    group_size: int,
    lora_key: jax.Array | None = None,
    expert_ids: jax.Array | None = None,
    with_routing: bool = False,
  ) -> jax.Array | tuple[jax.Array, Routing]:
    """Hidden states of the response part of rows that come in groups sharing one prompt,
    running each prompt through the layers once instead of once per row.

    tokens, positions: int32 [N, L]; attn_mask: bool [N, L], as `__call__`, with N a multiple of
    G = group_size and rows g*G .. g*G + G - 1 identical in their first P = prompt_len columns
    (a group's G responses to one left-padded prompt). Returns [N, L - P + 1, hidden_size], equal
    to `self(tokens, positions, attn_mask=attn_mask)[0][:, P - 1:]` (the last prompt position
    onwards: what predicts the response tokens).

    Each group is packed into one row of P + G * (L - P) tokens (the prompt, then its G
    continuations), so the projections and the MLP see each prompt token once. Attention runs
    on the packed group itself where dense attention suits it (`_shared_prefix_attend`); else
    it unpacks q, k and v into the N rows of L tokens (each prompt broadcast to its G rows),
    runs cfg.attention's causal self-attention on them (the prompt's queries are computed G
    times there, a small share of a layer), and packs the result back, reading each prompt's
    outputs from its group's first row. The backward sums each prompt's gradients over its G
    rows through the broadcast.
    expert_ids [N, L, num_layers, k] and with_routing as in `__call__` (each prompt's forced
    experts read from its group's first row; the routing's expert_ids come back [N, L, ...]
    and its load-balancing loss counts each prompt token once).
    """
    N, L = tokens.shape
    G, P = group_size, prompt_len
    if N % G or not 0 < P <= L:
      raise ValueError(
        f"shared_prompt_hidden: {N} rows of {L} tokens do not make groups of {G} with a "
        f"{P}-token prompt"
      )
    ngroups, R = N // G, L - P

    def pack(a):  # [N, L, ...] -> [ngroups, P + G * R, ...]
      a = a.reshape(ngroups, G, L, *a.shape[2:])
      conts = a[:, :, P:].reshape(ngroups, G * R, *a.shape[3:])
      return jnp.concatenate([a[:, 0, :P], conts], axis=1)

    def unpack(a):  # [ngroups, P + G * R, ...] -> [N, L, ...]
      tail = a.shape[2:]
      prompt = jnp.broadcast_to(a[:, None, :P], (ngroups, G, P, *tail))
      conts = a[:, P:].reshape(ngroups, G, R, *tail)
      return jnp.concatenate([prompt, conts], axis=2).reshape(N, L, *tail)

    attend = self._shared_prefix_attend(attn_mask.astype(bool), pack, unpack, P, G)

    if (with_routing or expert_ids is not None) and not self.cfg.is_moe:
      raise ValueError("with_routing / expert_ids: the model has no experts (num_experts=0)")
    forced = None if expert_ids is None else jnp.moveaxis(pack(expert_ids), 2, 0)
    x = embed_tokens(self.cfg, self.embed[...], pack(tokens))
    packed_mask = pack(attn_mask.astype(bool))
    x, routes = self._layer_scan(x, pack(positions), attend, lora_key, forced, packed_mask)
    x = norm(self.cfg, x, self.final_norm[...])
    last = jnp.broadcast_to(x[:, None, P - 1 : P], (ngroups, G, 1, x.shape[-1]))
    conts = x[:, P:].reshape(ngroups, G, R, x.shape[-1])
    hidden = jnp.concatenate([last, conts], axis=2).reshape(N, R + 1, x.shape[-1])
    if not with_routing:
      return hidden
    routing = _routing(self.cfg, routes, packed_mask)
    return hidden, routing.replace(
      expert_ids=unpack(routing.expert_ids), router_ids=unpack(routing.router_ids)
    )

  def _shared_prefix_attend(self, attn_mask, pack, unpack, P, G) -> Callable:
    """attend(q, k, v) on packed groups (`shared_prompt_hidden`). Where the packed sequence is
    short enough for dense attention and its scores are not much more than the rows' (at most
    twice), attention runs on it directly under `attention.shared_prefix_allowed`: no copies
    of the prompt's keys and values into every row and back, and G times fewer, larger score
    products. Otherwise it unpacks q, k and v into the rows and runs cfg.attention there."""
    if attends_packed_groups(self.cfg, attn_mask.shape[1], P, G):
      scores = scores_of(self.cfg)
      packed = pack(attn_mask)
      allowed = _layer_allowed(
        lambda w: attention_lib.shared_prefix_allowed(packed, P, G, w), scores.window
      )
      return lambda q, k, v, local: attention_lib.dense_fused(
        q, k, v, allowed(local), scores.scale, scores.softcap
      )
    row_attend = self._self_attend(attn_mask)
    return lambda q, k, v, local: pack(row_attend(unpack(q), unpack(k), unpack(v), local))

  def unembedding(self) -> tuple[jax.Array, bool]:
    """(W, tied): the output projection, [vocab, hidden] when tied else [hidden, vocab]."""
    if self.cfg.tie_word_embeddings:
      return self.embed[...], True
    return self.lm_head[...], False

  def logits(self, hidden: jax.Array) -> jax.Array:
    """float32 [..., vocab] logits of hidden states (tied or untied head, soft-capped where
    cfg.final_softcap says)."""
    w, tied = self.unembedding()
    return final_softcap(self.cfg, head_logits(hidden, w, tied))


def _layer_allowed(build: Callable, window: int | None) -> Callable:
  """allowed(local) for a dense mask build(window): with a sliding window both masks are built
  once, outside the layer scan, and each layer selects its own."""
  full = build(None)
  if window is None:
    return lambda local: full
  windowed = build(window)
  return lambda local: full if local is None else jnp.where(local, windowed, full)


def packed_group_len(row_len: int, prompt_len: int, group_size: int) -> int:
  """Tokens of one group packed by `Transformer.shared_prompt_hidden`: the prompt once, then
  the group's continuations."""
  return prompt_len + group_size * (row_len - prompt_len)


def attends_packed_groups(
  cfg: ModelConfig, row_len: int, prompt_len: int, group_size: int, backend: str | None = None
) -> bool:
  """Whether `Transformer.shared_prompt_hidden` attends on the packed groups of
  S = prompt_len + group_size * (row_len - prompt_len) tokens: when cfg.attention resolves to
  dense for S on `backend` (default: jax's) and the group's S^2 scores are at most twice its
  rows' group_size * row_len^2."""
  S = packed_group_len(row_len, prompt_len, group_size)
  impl = resolve_attention(cfg, S, backend)
  return group_size > 1 and impl == "dense" and S * S <= 2 * group_size * row_len**2


def decode_weights(model: Transformer) -> tuple[list[dict[str, jax.Array]], jax.Array]:
  """The weights of `Transformer.decode_step`, made once per sampler call: each decoder layer's
  weights as separate arrays (a copy of the layer weights) and the output projection as
  [vocab, hidden] (an untied head transposed: XLA's CPU matmul of a few rows reads the weight
  faster as the product's transposed right operand)."""
  stacked = model.layers.arrays()
  layers = [{k: a[l] for k, a in stacked.items()} for l in range(model.cfg.num_layers)]
  w, tied = model.unembedding()
  return layers, (w if tied else w.T)


# Whether the sampler runs a LoRA policy as its base model with the adapters merged into the
# weights (W + s A B, once per sampler call: `merge_lora`) rather than applying them at every
# step, as the trainer does. Off: merging measured no faster (benchmarks/sampler.py --lora-rank,
# docs/performance.md), and it costs a copy of the adapted weights while sampling and, with a
# 16-bit base, a rounding of W + s A B the trainer's log-probs do not share.
SAMPLER_MERGES_LORA = False


def merge_lora(model: Transformer) -> Transformer:
  """The base model of a LoRA policy with its adapters merged into their weights (a new copy of
  those weights; the rest shared), computing what the policy computes up to rounding in the
  weights' dtype. A model without adapters comes back as it is."""
  cfg = model.cfg
  if not cfg.lora_rank:
    return model
  merged = merge_lora_weights(cfg, model.layers.arrays())
  flat = dict(nnx.to_flat_state(split_lora(nnx.state(model))[1]))
  for name in cfg.lora_weights:
    flat[("layers", name)] = flat[("layers", name)].replace(merged[name])
  return nnx.merge(abstract_graphdef(cfg.without_lora()), nnx.from_flat_state(flat))


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


def lora_state(cfg: ModelConfig, seed: int = 0) -> nnx.State:
  """Fresh LoRA adapters (A random, B zeros) for a model of `cfg`, seeded by `seed`."""
  return _init_lora(cfg, jnp.int32(seed))


@functools.partial(jax.jit, static_argnums=0)
def _init_lora(cfg: ModelConfig, seed: jax.Array):
  # Only the adapters are outputs: XLA drops the base weights' initialisation.
  return nnx.state(Transformer(cfg, rngs=nnx.Rngs(jax.random.key(seed))), LoRAParam)


def with_lora(cfg: ModelConfig, base: nnx.State, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, params) of a model of `cfg` (LoRA on) from the state of its base model
  (`cfg.without_lora()`) and fresh adapters: the base's arrays are shared, not copied."""
  return abstract_graphdef(cfg), nnx.merge_state(base, lora_state(cfg, seed))


@functools.partial(jax.jit, static_argnums=0)
def _init_state(cfg: ModelConfig, seed: jax.Array):
  return nnx.state(Transformer(cfg, rngs=nnx.Rngs(jax.random.key(seed))))


def create(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """Transformer(cfg, rngs=nnx.Rngs(seed)) built in one compiled call (cached per config),
  much faster than the op-by-op eager constructor."""
  return nnx.merge(abstract_graphdef(cfg), _init_state(cfg, jnp.int32(seed)))


def abstract_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
  """The module structure of Transformer(cfg), without allocating parameters."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  return graphdef


def head_logits(hidden, w, tied, w_low=None):
  """float32 logits hidden @ W (W [D, V], or [V, D] when tied) from operands in hidden's dtype,
  accumulated in float32. In a low-precision compute dtype through `_head_with_backward`; w_low,
  W already in hidden's dtype, saves casting it again (the chunked head casts it once for all
  chunks)."""
  if jnp.dtype(hidden.dtype).itemsize < 4:
    w_low = w.astype(hidden.dtype) if w_low is None else w_low
    return _head_with_backward(tied, hidden, w, jax.lax.stop_gradient(w_low))
  return _head_matmul(hidden, w.astype(hidden.dtype), tied)


def _head_matmul(hidden, w, tied):
  spec = "...d,vd->...v" if tied else "...d,dv->...v"
  return jnp.einsum(spec, hidden, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head_with_backward(tied, hidden, w, w_low):
  """`_head_matmul` of hidden and w_low (W in hidden's dtype; only W gets a gradient) with a
  hand-written backward. In a low-precision dtype both backward matmuls run on low-precision
  operands (the float32 logits cotangent rounded to hidden's dtype) with float32 accumulation,
  as the layers' own backward does: autodiff would multiply the float32 cotangent by the
  low-precision W, i.e. a float32 matmul (on GPU at TF32 rate: a large vocab makes it a sizeable
  part of the step). dW comes back in W's dtype, summed in float32 (not rounded to bf16 on its
  way)."""
  return _head_matmul(hidden, w_low, tied)


def _head_with_backward_fwd(tied, hidden, w, w_low):
  # The zero-size array carries W's dtype to the backward.
  return _head_matmul(hidden, w_low, tied), (hidden, w_low, jnp.zeros((0,), w.dtype))


def _head_with_backward_bwd(tied, residuals, g):
  hidden, w, w_dtype = residuals
  g = g.astype(hidden.dtype)
  f32 = jnp.float32
  dh = jnp.einsum("...v,vd->...d" if tied else "...v,dv->...d", g, w, preferred_element_type=f32)
  g2, h2 = g.reshape(-1, g.shape[-1]), hidden.reshape(-1, hidden.shape[-1])
  # Products on row-major operands, which XLA's CPU backend multiplies in bf16 (low_precision).
  if tied:
    dw = jnp.dot(low_precision.transposed(g2), h2, preferred_element_type=f32)  # [V, D]
  else:
    dw = jnp.dot(low_precision.transposed(h2), g2, preferred_element_type=f32)  # [D, V]
  return dh.astype(hidden.dtype), dw.astype(w_dtype.dtype), None


_head_with_backward.defvjp(_head_with_backward_fwd, _head_with_backward_bwd)


# --------------------------------------------------------------------------------------------
# Chunked log-prob heads (training)
# --------------------------------------------------------------------------------------------


# `chunked_logprob_stats` with chunk_size None: logits of at most this many bytes ([B, T, V]
# float32) are built in one piece, without the checkpointed chunk loop (no padding to whole
# chunks, no head recomputed in the backward: a third of the head's FLOPs), for up to ~3x these
# bytes of temporary memory. Larger logits go in chunks of CHUNK_SIZE positions: memory then
# stays O(CHUNK_SIZE).
ONE_CHUNK_BYTES = 256 << 20
CHUNK_SIZE = 128


def chunked_logprob_stats(
  hidden: jax.Array,
  w: jax.Array,
  targets: jax.Array,
  *,
  tied: bool = False,
  temperature: float = 1.0,
  chunk_size: int | None = None,
  gather_ids: jax.Array | None = None,
  entropy: bool = False,
  top_k: int = 0,
  softcap: float | None = None,
) -> dict[str, jax.Array]:
  """Statistics of softmax(hidden @ W / temperature), walking the sequence in chunks.

  hidden [B, T, D]; w [D, V] ([V, D] if tied); targets int [B, T]; gather_ids int [B, T, K].
  Each chunk's float32 logits [B, chunk, V] are built and dropped inside a `jax.checkpoint`ed
  scan step, so neither the forward nor the gradient ever holds all [B, T, V] logits. chunk_size
  None: one plain piece when those logits take at most ONE_CHUNK_BYTES, else CHUNK_SIZE.
  softcap: the logits soft cap (`ModelConfig.final_softcap`), before the temperature.
  Returns float32 arrays: "logprobs" [B, T]; with entropy, "entropy" [B, T]; with gather_ids,
  "gathered_logprobs" [B, T, K]; with top_k > 0, "topk_logprobs" [B, T, k] and "topk_ids".
  """
  B, T, _ = hidden.shape
  ids = targets[..., None]
  n_target = 1
  if gather_ids is not None:
    ids = jnp.concatenate([ids, gather_ids.astype(ids.dtype)], axis=-1)
  vocab = w.shape[0] if tied else w.shape[1]
  whole = chunk_size is None and B * T * vocab * 4 <= ONE_CHUNK_BYTES
  C = T if whole else max(1, min(CHUNK_SIZE if chunk_size is None else chunk_size, T))
  n = -(-T // C)
  pad = n * C - T
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    ids = jnp.pad(ids, ((0, 0), (0, pad), (0, 0)))
  h_chunks = hidden.reshape(B, n, C, -1).swapaxes(0, 1)
  id_chunks = ids.reshape(B, n, C, -1).swapaxes(0, 1)
  # W in the compute dtype, cast once here: XLA casts it again in every chunk otherwise.
  w_low = w.astype(hidden.dtype) if jnp.dtype(hidden.dtype).itemsize < 4 else None

  def chunk(w, h, i):
    logits = attention_lib.soft_cap(head_logits(h, w, tied, w_low), softcap) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    out = {"lp": jnp.take_along_axis(logits, i, axis=-1) - lse[..., None]}
    if entropy:
      probs = jnp.exp(logits - lse[..., None])
      out["entropy"] = lse - jnp.sum(probs * logits, axis=-1)
    if top_k:
      vals, top_ids = jax.lax.top_k(logits, top_k)
      out["topk_logprobs"] = vals - lse[..., None]
      out["topk_ids"] = top_ids
    return out

  if not whole:
    chunk = jax.checkpoint(chunk)
  _, outs = jax.lax.scan(lambda c, x: (c, chunk(w, *x)), None, (h_chunks, id_chunks))
  unchunk = lambda a: a.swapaxes(0, 1).reshape(B, n * C, *a.shape[3:])[:, :T]
  outs = {k: unchunk(a) for k, a in outs.items()}
  result = {"logprobs": outs["lp"][..., 0]}
  if gather_ids is not None:
    result["gathered_logprobs"] = outs["lp"][..., n_target:]
  for key in ("entropy", "topk_logprobs", "topk_ids"):
    if key in outs:
      result[key] = outs[key]
  return result


def chunked_logprobs(model: Transformer, hidden: jax.Array, targets: jax.Array, **kwargs):
  """`chunked_logprob_stats` with the model's own head, for hidden states already computed."""
  w, tied = model.unembedding()
  kwargs.setdefault("softcap", model.cfg.final_softcap)
  return chunked_logprob_stats(hidden, w, targets, tied=tied, **kwargs)


def positions_from_mask(attn_mask: jax.Array) -> jax.Array:
  """Positions for a left-padded batch: max(cumsum(mask) - 1, 0), int32 [B, T]."""
  return jnp.maximum(jnp.cumsum(attn_mask.astype(jnp.int32), axis=-1) - 1, 0)


def param_count(model: Transformer) -> int:
  """Number of parameters (elements) in the model."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
