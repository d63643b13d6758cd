"""The policy: a decoder-only transformer (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2/3) in
Flax NNX.

The decoder: its weights (`Layers`), the decoder layer, the forward pass (`Transformer`, which
returns a `ModelOutput`), its KV caches, and building a model (`create`; LoRA policies:
`with_lora`, `merge_lora`). Its configuration (`ModelConfig`, the named architectures, the
Hugging Face config.json mapping) is in `architectures.py`; the LoRA adapters' parameters and
term in `lora.py`; the mixture-of-experts MLP in `moe.py`; the output head and the chunked
log-probs training reads in `heads.py`.

One module covers the Hugging Face families: RoPE (with Llama-3 frequency scaling),
grouped-query attention, SwiGLU MLP, RMSNorm, optional q/k/v bias (Qwen2) and per-head q/k RMSNorm
(Qwen3), tied or untied embeddings. Gemma is a configuration of the same layer (ModelConfig's
Gemma fields): GeGLU, (1 + w) RMSNorm, norms on the attention's and MLP's outputs too, the
sqrt(hidden) embedding scale, its attention scale and soft caps, sliding-window layers (their
window and, for Gemma 3, their own RoPE base picked per layer inside the scan). Qwen3-MoE is
Qwen3 with the MLP replaced by a top-k router over experts stacked [E, ...] (`moe.moe_mlp`), some
layers optionally keeping a dense MLP (picked per layer inside the scan). Layer weights
are stacked on a leading "layers" axis and the forward pass is a `lax.scan`, so a 32-layer model
compiles as fast as a 1-layer one.

Every parameter carries logical axis names (`partitioning.param`); the rules table in
`partitioning.py` maps them to mesh axes, so sharding never touches this file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from gppo_jax.models import attention as attention_lib
from gppo_jax.models import heads, low_precision, partitioning
from gppo_jax.models import lora as lora_lib
from gppo_jax.models import moe as moe_lib
from gppo_jax.models.architectures import (
  REMAT_POLICIES,
  ModelConfig,
  layer_plan,
  resolve_attention,
)

# --------------------------------------------------------------------------------------------
# Weights and caches
# --------------------------------------------------------------------------------------------


class Layers(nnx.Module):
  """All decoder layers' weights, stacked on a leading "layers" axis (one scan step each), with
  the LoRA adapters of the targeted ones (`lora.add_adapters`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    H, K, Dh, dt = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.params_dtype
    std = cfg.initializer_range
    p = lambda shape, axes, init="normal": partitioning.param(
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
    lora_lib.add_adapters(cfg, self, rngs)

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


def decoder_layer(cfg, p, x, rope, attend, local=None, lora_key=None, *, moe=None):
  """One pre-norm decoder layer (`routed_decoder_layer` without what its router chose)."""
  return routed_decoder_layer(cfg, p, x, rope, attend, local, lora_key, moe=moe)[0]


def routed_decoder_layer(
  cfg, p, x, rope, attend, local=None, lora_key=None, *, moe=None, expert_ids=None, mask=None,
  under_vmap=False,
):  # fmt: skip
  """One pre-norm decoder layer -> (x, `moe.LayerRoute` or None without experts). attend(q, k,
  v, local) -> [B, T, H, Dh] handles cache / no cache; local: whether this is a sliding-window
  layer (a bool, traced inside the layer scan; None when the model has none), which also picks
  its RoPE tables (`rope_tables`). Weights with LoRA adapters in p (`Layers`) add their term;
  lora_key (training only) draws the adapters' dropout. moe: whether this layer is a mixture of
  experts, needed (a bool, traced in a scan) only where cfg mixes dense and expert layers
  (`moe.moe_flags`); expert_ids int [B, T, k] force the tokens' experts (`moe.moe_mlp`); mask
  bool [B, T]: the real tokens the router's statistics count; under_vmap: traced inside
  `jax.vmap` (`Transformer.__call__`)."""
  dt = cfg.compute_dtype
  w = {k: a.astype(dt) for k, a in p.items()}
  # remat "dots" keeps the projections' products, which a custom VJP would hide from it.
  plain = functools.partial(low_precision.project, custom_vjp=cfg.remat != "dots")

  def mm(h, name, contract=1):
    y = plain(h, w[name], contract)
    if name + lora_lib.LORA_A in w:
      key = None
      if lora_key is not None:
        key = jax.random.fold_in(lora_key, cfg.lora_weights.index(name))
      y = y + lora_lib.lora_delta(cfg, w, name, h, contract, key, mm=plain)
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
    return out, (moe_lib.dense_route(cfg, *h.shape[:2]) if cfg.is_moe else None)

  sparse = lambda h: moe_lib.moe_mlp(cfg, w, h, expert_ids, mask, under_vmap=under_vmap)
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
class ModelOutput:
  """What the model's forward passes return (`Transformer.__call__`, `shared_prompt_hidden`,
  `decode_step`): one type whatever the call computes; the fields a call does not give are None.
  """

  hidden: jax.Array | None = None  # [B, T, hidden_size] after the final norm (not decode_step)
  logits: jax.Array | None = None  # float32 [B, vocab]: the next token's (decode_step only)
  cache: KVCache | LayerCache | None = None  # the updated cache, when the call was given one
  routing: moe_lib.Routing | None = None  # models with experts: what the routers chose


class Transformer(nnx.Module):
  """Decoder-only causal LM. `__call__` returns final-norm hidden states (in a `ModelOutput`);
  `logits` projects."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = cfg.params_dtype
    std = cfg.initializer_range
    param = partitioning.param
    self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt, std=std)
    self.layers = Layers(cfg, rngs)
    self.final_norm = param(rngs, (cfg.hidden_size,), ("embed",), dt, "ones")
    if not cfg.tie_word_embeddings:
      self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt, std=std)

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
    under_vmap: bool = False,
  ) -> ModelOutput:
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
    expert layer (routing replay; a token whose ids are -1 routes itself: `moe.moe_mlp`).
    under_vmap: this call is traced inside `jax.vmap` (the continuous engine runs its slot
    groups so); the expert layers then batch their ragged products themselves and leave the
    rows' split over the mesh to the vmap (`moe._sorted_on_shards`). A Python bool: like the
    shapes, part of what a jit compiles for.
    Returns a `ModelOutput`: hidden [B, T, hidden_size] after the final norm, the new cache
    (None without one) and, for models with experts, the `moe.Routing` (the experts chosen, the
    load-balancing loss of the real tokens).
    """
    cfg = self.cfg
    B, T = tokens.shape
    attn_mask = jnp.ones((B, T), bool) if attn_mask is None else attn_mask.astype(bool)
    if expert_ids is not None and not cfg.is_moe:
      raise ValueError("expert_ids: the model has no experts (num_experts=0)")
    forced = None if expert_ids is None else jnp.moveaxis(expert_ids, 2, 0)  # [L, B, T, k]
    new_cache = None
    if cache is not None:
      x, routes, new_cache = self._cached_layers(
        tokens, positions, attn_mask, cache, cache_index, cache_block, forced, under_vmap
      )
    elif self._attention(T) == "cudnn":
      x, routes = self._left_aligned_layers(
        tokens, positions, attn_mask, lora_key, forced, under_vmap
      )
    else:
      attend = self._self_attend(attn_mask)
      x, routes = self._layer_scan(
        self._embed(tokens), positions, attend, lora_key, forced, attn_mask, under_vmap
      )
    hidden = norm(cfg, x, self.final_norm[...])
    routing = None if routes is None else moe_lib.routing_of(cfg, routes, attn_mask)
    return ModelOutput(hidden=hidden, cache=new_cache, routing=routing)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    return embed_tokens(self.cfg, self.embed[...], tokens)

  def _left_aligned_layers(self, tokens, positions, attn_mask, lora_key, forced, under_vmap):
    """`_layer_scan` under cuDNN attention, which takes padding as sequence lengths: each row
    rotated once so that its real tokens come first (positions and forced experts travel with
    their tokens), every layer run on the rotated rows, and the hidden states and the experts
    chosen rotated back. Rotating q, k, v and the output in each layer instead
    (`attention.cudnn`) costs a scatter-add for each in the backward."""
    scores = scores_of(self.cfg)
    fwd, back, length = attention_lib.left_align(attn_mask)
    rotate = lambda a, idx: jnp.take_along_axis(a, idx, axis=1)
    attend = lambda q, k, v, local: attention_lib.per_layer_kernel(
      lambda w: attention_lib.cudnn_left_aligned(q, k, v, length, scale=scores.scale, window=w),
      scores.window,
      local,
    )
    if forced is not None:
      forced = jax.vmap(lambda a: rotate(a, fwd[:, :, None]))(forced)
    x, routes = self._layer_scan(
      self._embed(rotate(tokens, fwd)), rotate(positions, fwd), attend, lora_key, forced,
      rotate(attn_mask, fwd), under_vmap,
    )  # fmt: skip
    x = rotate(x, back[:, :, None])
    if routes is not None:
      unrotate = jax.vmap(lambda a: rotate(a, back[:, :, None]))
      routes = routes.replace(
        expert_ids=unrotate(routes.expert_ids), router_ids=unrotate(routes.router_ids)
      )
    return x, routes

  def _cached_layers(
    self, tokens, positions, attn_mask, cache, cache_index, cache_block, forced, under_vmap
  ) -> tuple[jax.Array, moe_lib.LayerRoute | None, KVCache]:
    """The layers over a KV cache (`__call__` with one): a scan whose steps write their keys and
    values into the cache's slots [cache_index, cache_index + T) and attend over it. Returns
    (x, the layers' routes as `_layer_scan`, the new cache)."""
    if cache_index is None:
      raise ValueError("cache_index is required together with cache")
    cfg = self.cfg
    T = tokens.shape[1]
    scores, flags, kinds = scores_of(cfg), local_flags(cfg), moe_lib.moe_flags(cfg)
    idx = jnp.asarray(cache_index, jnp.int32)
    S = cache.mask.shape[1]
    mask = jax.lax.dynamic_update_slice(cache.mask, attn_mask, (0, idx))
    query_slot = idx + jnp.arange(T)[:, None]
    slots = jnp.arange(S)[None, :]
    # Blockwise over the filled cache blocks, read in place; a prefill attends densely over
    # the whole cache when the attention resolves to dense for this cache length.
    blockwise = cache_block is not None or T == 1 or self._attention(S) != "dense"
    if cache_block is None:
      cache_block = attention_lib.DECODE_BLOCK if T == 1 else attention_lib.BLOCK_SIZE
    causal = (slots <= query_slot)[None] & mask[:, None, :]
    zero = jnp.zeros((), jnp.int32)
    rope = rope_tables(positions, cfg)

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
        cfg, p, x, rope, attend, local, moe=moe, expert_ids=ids, mask=attn_mask,
        under_vmap=under_vmap,
      )  # fmt: skip
      return (x, ck, cv), route

    xs = (self.layers.arrays(), jnp.arange(cfg.num_layers), forced)
    (x, ck, cv), routes = jax.lax.scan(step, (self._embed(tokens), cache.k, cache.v), xs)
    return x, routes, KVCache(k=ck, v=cv, mask=mask)

  def decode_step(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    attn_mask: jax.Array,
    cache: LayerCache,
    cache_index: jax.Array | int,
    weights: tuple[Sequence[dict[str, jax.Array]], jax.Array],
  ) -> ModelOutput:
    """One token per row through the layers unrolled on `weights` (`decode_weights`, made once
    outside the decode loop: a scan would slice the stacked weights at every step, on CPU a copy
    of each layer). tokens, positions int32 [B, 1]; attn_mask bool [B, 1].

    Writes the new keys / values into slot `cache_index` and attends, as `__call__` with a
    cache does, to the real slots <= cache_index and to its own slot
    (`attention.decode_attention`, over all the cache's slots: the sampler grows the cache in a
    few phases so that a step costs about what the filled length costs).
    Returns a `ModelOutput`: float32 logits [B, vocab] of the next token, the new cache and, for
    models with experts, the `moe.Routing` of the step's tokens (expert_ids [B, 1, layers, k]).
    """
    layer_weights, head = weights
    cfg = self.cfg
    scores = scores_of(cfg)
    x = embed_tokens(cfg, self.embed[...], tokens)
    rope = rope_tables(positions, cfg)
    idx = jnp.asarray(cache_index, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    attn_mask = attn_mask.astype(bool)
    mask = jax.lax.dynamic_update_slice(cache.mask, attn_mask, (zero, idx))
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
      x, route = routed_decoder_layer(
        cfg, p, x, rope, attend, local, moe=cfg.layer_is_moe(l), mask=attn_mask
      )
      routes.append(route)
    hidden = norm(cfg, x[:, 0], self.final_norm[...])
    routing = None
    if cfg.is_moe:
      stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *routes)
      routing = moe_lib.routing_of(cfg, stacked, attn_mask)
    return ModelOutput(
      logits=final_softcap(cfg, heads.head_logits(hidden, head, tied=True)),
      cache=LayerCache(k=tuple(keys), v=tuple(values), mask=mask),
      routing=routing,
    )

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
    under_vmap: bool = False,
  ) -> tuple[jax.Array, moe_lib.LayerRoute | None]:
    """The decoder layers (no cache) on x [B, T, D]: a scan over the stacked layer weights,
    each step rematerialised, as `architectures.layer_plan` says for cfg and this shape.
    lora_key: one dropout key per layer for the LoRA adapters (`decoder_layer`). Returns (x,
    the layers' `moe.LayerRoute`s stacked [L, ...], None without experts); forced int
    [L, B, T, k]: the experts to use (routing replay); mask bool [B, T]: the real tokens;
    under_vmap as in `__call__`."""
    cfg = self.cfg
    rope = rope_tables(positions, cfg)  # outside the scan (and its remat): once per forward
    remat, scan = layer_plan(cfg, *x.shape[:2])
    dropout = lora_key is not None and cfg.lora_rank > 0 and cfg.lora_dropout > 0
    keys = jax.random.split(lora_key, cfg.num_layers) if dropout else None

    def step(x, xs):
      p, local, key, moe, ids = xs
      x = partitioning.constrain_batch(x)
      return routed_decoder_layer(
        cfg, p, x, rope, attend, local, key, moe=moe, expert_ids=ids, mask=mask,
        under_vmap=under_vmap,
      )  # fmt: skip

    if REMAT_POLICIES[remat] is not None:
      step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=False)
    xs = (self.layers.arrays(), local_flags(cfg), keys, moe_lib.moe_flags(cfg), forced)
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
  ) -> ModelOutput:
    """Hidden states of the response part of rows that come in groups sharing one prompt,
    running each prompt through the layers once instead of once per row.

    tokens, positions: int32 [N, L]; attn_mask: bool [N, L], as `__call__`, with N a multiple of
    G = group_size and rows g*G .. g*G + G - 1 identical in their first P = prompt_len columns
    (a group's G responses to one left-padded prompt). Returns a `ModelOutput` whose hidden is
    [N, L - P + 1, hidden_size], equal to `self(tokens, positions, attn_mask=attn_mask)
    .hidden[:, P - 1:]` (the last prompt position onwards: what predicts the response tokens).

    Each group is packed into one row of P + G * (L - P) tokens (the prompt, then its G
    continuations), so the projections and the MLP see each prompt token once. Attention runs
    on the packed group itself where dense attention suits it (`_shared_prefix_attend`); else
    it unpacks q, k and v into the N rows of L tokens (each prompt broadcast to its G rows),
    runs cfg.attention's causal self-attention on them (the prompt's queries are computed G
    times there, a small share of a layer), and packs the result back, reading each prompt's
    outputs from its group's first row. The backward sums each prompt's gradients over its G
    rows through the broadcast.
    expert_ids [N, L, num_layers, k] as in `__call__` (each prompt's forced experts read from
    its group's first row); the routing's expert_ids come back [N, L, ...] and its
    load-balancing loss counts each prompt token once.
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

    if expert_ids is not None and not self.cfg.is_moe:
      raise ValueError("expert_ids: the model has no experts (num_experts=0)")
    forced = None if expert_ids is None else jnp.moveaxis(pack(expert_ids), 2, 0)
    x = self._embed(pack(tokens))
    packed_mask = pack(attn_mask.astype(bool))
    x, routes = self._layer_scan(x, pack(positions), attend, lora_key, forced, packed_mask)
    x = norm(self.cfg, x, self.final_norm[...])
    last = jnp.broadcast_to(x[:, None, P - 1 : P], (ngroups, G, 1, x.shape[-1]))
    conts = x[:, P:].reshape(ngroups, G, R, x.shape[-1])
    hidden = jnp.concatenate([last, conts], axis=2).reshape(N, R + 1, x.shape[-1])
    if routes is None:
      return ModelOutput(hidden=hidden)
    routing = moe_lib.routing_of(self.cfg, routes, packed_mask)
    routing = routing.replace(
      expert_ids=unpack(routing.expert_ids), router_ids=unpack(routing.router_ids)
    )
    return ModelOutput(hidden=hidden, routing=routing)

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
    return final_softcap(self.cfg, heads.head_logits(hidden, w, tied))


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


# --------------------------------------------------------------------------------------------
# Building models: from a config, LoRA policies, merged adapters
# --------------------------------------------------------------------------------------------


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
  merged = lora_lib.merge_lora_weights(cfg, model.layers.arrays())
  flat = dict(nnx.to_flat_state(lora_lib.split_lora(nnx.state(model))[1]))
  for name in cfg.lora_weights:
    flat[("layers", name)] = flat[("layers", name)].replace(merged[name])
  return nnx.merge(abstract_graphdef(cfg.without_lora()), nnx.from_flat_state(flat))


def lora_state(cfg: ModelConfig, seed: int = 0) -> nnx.State:
  """Fresh LoRA adapters (A random, B zeros) for a model of `cfg`, seeded by `seed`."""
  return _init_lora(cfg, jnp.int32(seed))


@functools.partial(jax.jit, static_argnums=0)
def _init_lora(cfg: ModelConfig, seed: jax.Array):
  # Only the adapters are outputs: XLA drops the base weights' initialisation.
  return nnx.state(Transformer(cfg, rngs=nnx.Rngs(jax.random.key(seed))), lora_lib.LoRAParam)


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


def abstract_state(cfg: ModelConfig) -> nnx.State:
  """The parameters of Transformer(cfg) as jax.ShapeDtypeStructs, without allocating them."""
  return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def abstract_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
  """The module structure of Transformer(cfg), without allocating parameters."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  return graphdef


def positions_from_mask(attn_mask: jax.Array) -> jax.Array:
  """Positions for a left-padded batch: max(cumsum(mask) - 1, 0), int32 [B, T]."""
  return jnp.maximum(jnp.cumsum(attn_mask.astype(jnp.int32), axis=-1) - 1, 0)


def param_count(model: Transformer) -> int:
  """Number of parameters (elements) in the model."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
