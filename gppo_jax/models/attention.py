"""Causal grouped-query attention: a dense reference and three linear-memory implementations.

Every implementation computes, for q [B, T, H, Dh], k / v [B, T, K, Dh] (H a multiple of K) and
`mask` bool [B, T] (False = padding), softmax(q k^T / sqrt(Dh)) v per head in float32, where a
real query i attends to the real keys j <= i and a padding query attends only to itself (finite,
ignorable output; nothing real ever attends to it). Real tokens may sit anywhere in a row (left
padding for prompts, right padding after a response) unless an implementation says otherwise.

- `dense`: the reference; builds the float32 [B, K, G, T, T] scores (quadratic memory).
- `blockwise`: flash-style online softmax over key blocks with causal block skipping, and a
  `jax.custom_vjp` backward that recomputes each block from the saved log-sum-exp: memory O(T)
  in the forward and the backward. Pure JAX: runs (and shards) on every backend. On CPU "auto"
  runs the query tiles of short sequences (`UNROLL_MAX_LEN`) unrolled instead, each against its
  whole key prefix (faster there; not linear in memory).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` on GPU (bf16 / fp16 only).
  cuDNN takes padding as sequence lengths, so each row is rotated to put its real tokens first;
  this needs the real tokens of a row to be one contiguous run (left-padded prompt +
  right-padded response, as every batch of this project is). Pad outputs are unspecified.
- `splash`: the Pallas splash-attention kernel on TPU (a static causal mask plus segment ids:
  real tokens share segment 0, each pad is its own segment), wrapped in `shard_map` under a mesh.

`attention(q, k, v, mask, impl)` picks one; "auto" is cudnn on GPU for half precision, splash on
TPU, and on CPU dense up to `DENSE_MAX_LEN` tokens (faster when the scores are small) and
blockwise above. `cached_attention` is the blockwise forward for queries written into a KV cache
at a traced offset (the sampler's prefill, and its scan decode step on TPU / GPU): it reads only
the cache blocks up to the last query, so one compiled step serves every cache length.
`decode_attention` is the CPU decode step's: one query over a layer's whole cache, stored with
the keys transposed (`model.LayerCache`), in two matrix products that read the cache in place.

Gemma's variations (`Scores`), in every implementation: the scale on q k^T (Gemma's
query_pre_attn_scalar instead of 1/sqrt(Dh)), tanh soft-capping of the scores (cap * tanh(s /
cap), before the mask), and a sliding window: a local layer's query i attends only to the keys
j > i - window (cache slots in the cached paths; the real tokens of a row are contiguous, so this
is a distance in positions, as transformers' sliding_window). The window of a layer inside the
layer scan is traced (`layer_window`: the window on local layers, NO_WINDOW on global ones):
blockwise and the cached paths skip the key tiles wholly outside it, dense masks it; cuDNN and
splash take a static window, so there a traced layer picks one of the two kernels with
`lax.cond`. cuDNN has no soft-capping: a soft-capped model runs blockwise there (`resolve`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gppo_jax.models import partitioning

IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash")  # = ModelConfig's choices
# CPU: dense attention up to this many tokens (few scores: one fused product is cheapest),
# blockwise beyond (at 256 tokens its causal tiles skip work dense does).
DENSE_MAX_LEN = 128
BLOCK_SIZE = 512  # blockwise tile (queries and keys) on GPU / TPU; CPU: `block_size`
# CPU blockwise tile: about a quarter of the sequence, within these bounds: smaller tiles skip
# more of the work above the diagonal and stay in cache, larger ones cost less per-tile loop
# overhead and run XLA's CPU matmuls nearer their large-matrix rate (docs/performance.md).
# Earns its place: benchmarks/train_step.py tiny shape ~1.2x against BLOCK_SIZE on CPU.
CPU_BLOCK_MIN, CPU_BLOCK_MAX = 64, 512
# CPU, up to this many tokens: "auto" runs blockwise's query tiles as straight-line code, each
# tile against its whole key prefix in one product (`_unrolled_forward`): no loops, dynamic
# slices or online rescaling, and larger matmuls. Longer sequences loop: XLA holds every
# unrolled tile's scores at once (about half of dense's [T, T] per head), and beyond the caches
# that costs more than the loops save.
# Earns its place: benchmarks/train_step.py tiny shape ~1.6x against the loops.
UNROLL_MAX_LEN = 512
# Key block of the scan decode step over a KV cache (`cached_attention` with T = 1).
DECODE_BLOCK = 256
SPLASH_BLOCK = 512
_NEG_INF = -jnp.inf
# Attention residuals named for remat policies (remat "attention" keeps them; without them the
# backward first reruns the whole attention forward): the output (blockwise and dense), the
# blockwise log-sum-exp (O(T) per layer) and dense attention's probabilities, named only where
# there are at most DENSE_SAVED_MAX_KEYS keys (O(T) per layer too: at most that many per query).
SAVED_NAMES = ("attention_out", "attention_lse", "attention_probs")
DENSE_SAVED_MAX_KEYS = DENSE_MAX_LEN
# The window of a global layer where a layer's window is traced (`layer_window`): no key is that
# far back.
NO_WINDOW = 1 << 30

log = logging.getLogger("gppo_jax")


@dataclasses.dataclass(frozen=True)
class Scores:
  """How a model forms its attention scores (hashable: a static argument)."""

  scale: float | None = None  # the factor on q k^T; None: head_dim ** -0.5
  softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
  window: int | None = None  # the sliding window of its local layers (None: none)


def layer_window(window: int | None, local) -> jax.Array | int | None:
  """A layer's window: None without sliding window; `window` where local is None or True (a
  local layer); with local a traced bool, int32 window or NO_WINDOW."""
  if window is None or local is None or local is True:
    return window
  if local is False:
    return None
  return jnp.where(local, jnp.int32(window), jnp.int32(NO_WINDOW))


def soft_cap(s: jax.Array, cap: float | None) -> jax.Array:
  """s soft-capped: cap * tanh(s / cap) (s itself where cap is None)."""
  return s if cap is None else cap * jnp.tanh(s / cap)


def _softcap_grad(capped: jax.Array, cap: float) -> jax.Array:
  """d capped / d s of capped = cap * tanh(s / cap): 1 - tanh^2."""
  return 1.0 - jnp.square(capped / cap)


def _in_window(qpos, kpos, window):
  """bool: key position kpos is within `window` (None: no window) of query position qpos."""
  return True if window is None else (qpos - kpos) < window


_warned: set[str] = set()


def resolve(
  impl: str,
  *,
  seq_len: int,
  dtype,
  head_dim: int,
  backend: str | None = None,
  softcap: float | None = None,
) -> str:
  """The implementation `impl` ("auto" or a name in IMPLEMENTATIONS) stands for on `backend`
  (default: jax's default backend) for sequences of `seq_len` tokens in `dtype`. cuDNN's kernel
  has no score soft-capping: with `softcap`, "cudnn" runs blockwise (logged once)."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention={impl!r}; valid: {', '.join(IMPLEMENTATIONS)}")
  if impl == "cudnn" and softcap is not None:
    if impl not in _warned:
      _warned.add(impl)
      log.warning(
        "attention='cudnn': cuDNN's kernel has no attention-logit soft-capping "
        "(attn_softcap=%s); running blockwise attention instead",
        softcap,
      )
    return "blockwise"
  if impl != "auto":
    return impl
  backend = backend or jax.default_backend()
  if backend in ("gpu", "cuda", "rocm"):
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = half and head_dim % 8 == 0 and head_dim <= 128 and softcap is None
    return "cudnn" if fits else "blockwise"
  if backend == "tpu":
    return "splash"
  return "dense" if seq_len <= DENSE_MAX_LEN else "blockwise"


def block_size(seq_len: int, backend: str | None = None) -> int:
  """The blockwise tile `attention` uses for `seq_len` tokens on `backend` (default: jax's)."""
  if (backend or jax.default_backend()) != "cpu":
    return BLOCK_SIZE
  quarter = 1 << max(0, (seq_len // 4).bit_length() - 1)  # a power of two <= seq_len / 4
  return min(CPU_BLOCK_MAX, max(CPU_BLOCK_MIN, quarter))


def unrolled(seq_len: int, backend: str | None = None) -> bool:
  """Whether `attention` with impl "auto", where it resolves to blockwise, runs the tiles
  unrolled for `seq_len` tokens on `backend` (default: jax's): on CPU up to `UNROLL_MAX_LEN`
  tokens. Elsewhere, and for impl "blockwise" itself, loops (linear memory)."""
  return (backend or jax.default_backend()) == "cpu" and seq_len <= UNROLL_MAX_LEN


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  impl: str = "auto",
  *,
  scores: Scores = Scores(),
  local=None,
) -> jax.Array:
  """Causal self-attention of one layer: q [B,T,H,Dh], k/v [B,T,K,Dh], mask bool [B,T]
  -> [B,T,H,Dh] in q's dtype (the mask rule is the module docstring's). `scores`: the scale,
  soft cap and window; local: whether this layer is a sliding-window one (`layer_window`)."""
  name = resolve(
    impl, seq_len=q.shape[1], dtype=q.dtype, head_dim=q.shape[-1], softcap=scores.softcap
  )
  scale, cap = scores.scale, scores.softcap
  if name == "dense":
    allowed = self_allowed(mask, layer_window(scores.window, local))
    return dense_fused(q, k, v, allowed, scale, cap)
  if name == "blockwise":
    T = q.shape[1]
    # "auto" on CPU unrolls short sequences' tiles (faster); "blockwise" loops (linear memory).
    unroll = impl == "auto" and unrolled(T)
    window = layer_window(scores.window, local)
    return blockwise(
      q, k, v, mask, block_size=block_size(T), unroll=unroll, scale=scale, softcap=cap,
      window=window,
    )  # fmt: skip
  if name == "cudnn":
    return per_layer_kernel(
      lambda w: cudnn(q, k, v, mask, scale=scale, window=w), scores.window, local
    )
  return per_layer_kernel(
    lambda w: splash(q, k, v, mask, scale=scale, softcap=cap, window=w), scores.window, local
  )


def per_layer_kernel(fn, window: int | None, local):
  """fn(static window or None) for a kernel that takes its window as a static argument (cuDNN,
  splash): the local or the global kernel, by `lax.cond` where `local` is traced (both
  compiled, one runs per layer)."""
  if window is None or local is None or local is True:
    return fn(window)
  if local is False:
    return fn(None)
  return jax.lax.cond(local, lambda: fn(window), lambda: fn(None))


# --------------------------------------------------------------------------------------------
# Dense reference
# --------------------------------------------------------------------------------------------


def self_allowed(mask: jax.Array, window=None) -> jax.Array:
  """bool [B, T, T]: query i may attend key j (the module's rule) for mask bool [B, T], within
  `window` (an int, a traced int32 or None: `layer_window`)."""
  T = mask.shape[1]
  pos = jnp.arange(T)
  causal = (pos[None, :] <= pos[:, None]) & _in_window(pos[:, None], pos[None, :], window)
  return (causal[None] & mask[:, :, None] & mask[:, None, :]) | jnp.eye(T, dtype=bool)[None]


def shared_prefix_allowed(mask: jax.Array, prefix_len: int, copies: int, window=None) -> jax.Array:
  """bool [B, S, S] for rows packed as one prefix then `copies` continuations of equal length
  (S = prefix_len + copies * C; mask bool [B, S]): each token attends as it would in its own
  row of prefix + continuation under the module's rule. A prefix query sees the real prefix keys
  up to itself; a continuation query sees the whole real prefix and its own continuation's real
  keys up to itself, never another continuation; a padding query sees only itself. `window`:
  as `self_allowed`'s, over the positions in the row."""
  S = mask.shape[1]
  C = (S - prefix_len) // copies
  if prefix_len + copies * C != S:
    raise ValueError(f"{S} tokens are not a {prefix_len}-token prefix + {copies} equal parts")
  idx = jnp.arange(S)
  segment = jnp.where(idx < prefix_len, 0, 1 + (idx - prefix_len) // max(C, 1))
  row_pos = jnp.where(idx < prefix_len, idx, prefix_len + (idx - prefix_len) % max(C, 1))
  visible = (row_pos[None, :] <= row_pos[:, None]) & (
    (segment[None, :] == 0) | (segment[None, :] == segment[:, None])
  )
  visible = visible & _in_window(row_pos[:, None], row_pos[None, :], window)
  return (visible[None] & mask[:, :, None] & mask[:, None, :]) | jnp.eye(S, dtype=bool)[None]


def dense(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  allowed: jax.Array,
  scale: float | None = None,
  softcap: float | None = None,
) -> jax.Array:
  """q [B,T,H,Dh], k/v [B,S,K,Dh], allowed bool [B,T,S] -> [B,T,H,Dh]: float32 scores (times
  `scale`, default Dh ** -0.5, soft-capped at `softcap`) and softmax, probabilities cast to v's
  dtype for the value product. Every row needs one True."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  q = q.reshape(B, T, K, H // K, Dh)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = soft_cap(scores * (scale or Dh**-0.5), softcap)
  scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(B, T, H, Dh).astype(q.dtype)


def dense_fused(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  allowed: jax.Array,
  scale: float | None = None,
  softcap: float | None = None,
) -> jax.Array:
  """`dense` with a hand-written backward, the training path of impl "dense": same arguments and
  result. The backward needs no mask: a key that is not allowed has probability 0, hence a zero
  score gradient p * (dp - delta); autodiff of `dense` instead selects through the broadcast
  [B, K, G, T, S] mask (and materialises it) on every layer's backward. With `softcap` the
  backward recomputes the scores for the cap's derivative (one more q k^T product)."""
  return _dense_fused(q, k, v, allowed, scale or q.shape[-1] ** -0.5, softcap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dense_fused(q, k, v, allowed, scale, softcap):
  return _dense_fused_fwd(q, k, v, allowed, scale, softcap)[0]


def _dense_fused_fwd(q, k, v, allowed, scale, softcap):
  B, T, H, Dh = q.shape
  K = k.shape[2]
  # Head-major [B, K, G, T, .]: each (b, k, g) is one contiguous [T, Dh] x [Dh, S] product, the
  # layout XLA's CPU matmuls take without copies (scores ordered [B, K, T, G, S], q's own order,
  # cost more than the transposes of q, k, v and the output here).
  qh = q.reshape(B, T, K, H // K, Dh).transpose(0, 2, 3, 1, 4)
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, Dh]
  s = jnp.einsum("bkgtd,bksd->bkgts", qh, kh, preferred_element_type=jnp.float32)
  s = soft_cap(s * scale, softcap) + _mask_bias(allowed)[:, None, None]  # each row allows one key
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  oh = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), vh)
  out = oh.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q.dtype)
  # Under remat "attention" the backward reuses these instead of recomputing the scores, the
  # softmax and the value product.
  out = checkpoint_name(out, SAVED_NAMES[0])
  if k.shape[1] <= DENSE_SAVED_MAX_KEYS:
    p = checkpoint_name(p, SAVED_NAMES[2])
  return out, (qh, kh, vh, p, out)


def _dense_fused_bwd(scale, softcap, res, dout):
  qh, kh, vh, p, out = res
  B, K, G, T, Dh = qh.shape
  f32 = jnp.float32
  doh = dout.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4)
  dp = jnp.einsum("bkgtd,bksd->bkgts", doh, vh, preferred_element_type=f32)
  delta = jnp.einsum("bthd,bthd->bth", dout.astype(f32), out.astype(f32))
  delta = delta.reshape(B, T, K, G).transpose(0, 2, 3, 1)
  # The softmax scale multiplies dq and dk, not the [.., T, S] ds: a scalar times a tensor that
  # size became a materialised broadcast of the scalar in XLA CPU's matmul fusions.
  ds = p * (dp - delta[..., None])
  if softcap is not None:
    s = jnp.einsum("bkgtd,bksd->bkgts", qh, kh, preferred_element_type=f32)
    ds = ds * _softcap_grad(soft_cap(s * scale, softcap), softcap)
  ds = ds.astype(qh.dtype)
  dq = jnp.einsum("bkgts,bksd->bkgtd", ds, kh, preferred_element_type=f32) * scale
  # The key and value gradients come out transposed, [B, K, Dh, S] ((queries or output gradient)^T
  # x (score gradient or probabilities)): the other way round, XLA's CPU backend copied each
  # [T, S] block into the transposed layout its matmul takes (as in the blockwise backward).
  dk = jnp.einsum("bkgtd,bkgts->bkds", qh, ds, preferred_element_type=f32) * scale
  dv = jnp.einsum("bkgtd,bkgts->bkds", doh, p.astype(doh.dtype), preferred_element_type=f32)
  dq = dq.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, Dh)
  dk, dv = (x.transpose(0, 3, 1, 2) for x in (dk, dv))
  return dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None


_dense_fused.defvjp(_dense_fused_fwd, _dense_fused_bwd)


# --------------------------------------------------------------------------------------------
# Blockwise (flash-style) attention with a recomputing backward
# --------------------------------------------------------------------------------------------


def _tile(seq_len: int, block_size: int) -> tuple[int, int]:
  """(tile, number of tiles): tiles of at most block_size covering seq_len with little padding."""
  n = -(-seq_len // block_size)
  tile = -(-seq_len // n)
  if tile > 8:
    tile = -(-tile // 8) * 8
  return tile, n


def _block_allowed(qpos, kpos, qreal, kreal, window=None):
  """bool [B, bq, bk] for positions qpos [bq], kpos [bk] and real flags [B, bq], [B, bk]."""
  causal = kpos[None, None, :] <= qpos[None, :, None]
  causal = causal & _in_window(qpos[None, :, None], kpos[None, None, :], window)
  both = qreal[:, :, None] & kreal[:, None, :]
  return (causal & both) | (kpos[None, None, :] == qpos[None, :, None])


def _merge_rows(x):
  """x [B,K,bq,G,...] -> [B,K,bq*G,...]: a tile's query rows (each query's G heads) as one
  matrix dimension, contiguous in the [B,K,T,G,Dh] layout (a free reshape). The blockwise
  products take them this way: one [bq * G, Dh] matrix per (B, K) rather than G [bq, Dh] ones,
  a batch dimension of G between the tile's rows: fewer, larger products. The backward's
  elementwise work and key gradients use the merged rows too."""
  return x.reshape(*x.shape[:2], x.shape[2] * x.shape[3], *x.shape[4:])


def _merged_dot(x, y, y_layout):
  """float32 [B,K,m,n]: merged rows x [B,K,m,d] times y per (B, K), y laid out "nd"
  (y [B,K,n,d]: x y^T, e.g. scores q k^T) or "dn" (y [B,K,d,n]: x y, e.g. probabilities times
  values)."""
  spec = {"nd": "bkmd,bknd->bkmn", "dn": "bkmd,bkdn->bkmn"}[y_layout]
  return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)


def _rows_dot(x, y, y_layout):
  """float32 [B,K,bq,G,n]: `_merged_dot` of x [B,K,bq,G,d] on its merged rows (`_merge_rows`),
  the rows split back."""
  out = _merged_dot(_merge_rows(x), y, y_layout)
  return out.reshape(*x.shape[:4], out.shape[-1])


def _scores(qi, kj, allowed, scale, softcap=None):
  """float32 [B,K,bq,G,bk] scaled (and soft-capped) scores of qi [B,K,bq,G,Dh], kj [B,K,bk,Dh],
  -inf where not allowed [B,bq,bk]."""
  s = soft_cap(_rows_dot(qi, kj, "nd") * scale, softcap)
  return s + _mask_bias(allowed)[:, None, :, None]


def _mask_bias(allowed):
  """float32 0 where allowed, -inf elsewhere: added to the scores (a select against a broadcast
  -inf constant the shape of the scores was materialised on CPU, on every call)."""
  return jnp.where(allowed, 0.0, _NEG_INF).astype(jnp.float32)


def _key_grad(x, p):
  """float32 [B,K,Dh,bk]: the key-side gradient sum over the rows of x [B,K,bq*G,Dh] times
  p [B,K,bq*G,bk], transposed. Written as p^T x, XLA (CPU) first copies the [.., bq, bk] block
  into the transposed layout its matmul takes (a copy of every score block); as x^T p only the
  Dh-wide operand is transposed, bk/Dh times less data."""
  dims = (((2,), (2,)), ((0, 1), (0, 1)))
  return jax.lax.dot_general(x, p, dims, preferred_element_type=jnp.float32)


def _online_step(carry, s, vj):
  """One key block of the online softmax: carry (m, l, acc) float32 [B,K,bq,G(,Dh)]."""
  m, l, acc = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with nothing allowed yet
  p = jnp.exp(s - m_safe[..., None])
  alpha = jnp.exp(m - m_safe)
  l = alpha * l + jnp.sum(p, axis=-1)
  return m_new, l, alpha[..., None] * acc + _rows_dot(p.astype(vj.dtype), vj, "dn")


def _first_key_tile(i, tile, window):
  """The first key tile query tile i reaches within `window` (0 without one)."""
  if window is None:
    return 0
  return jnp.maximum(0, (i * tile - window + 1) // tile)


def _flash_forward(q, k, v, mask, window, tile, scale, softcap):
  """Grouped q [B,K,Tp,G,Dh], k/v [B,K,Tp,Dh], mask [B,Tp] -> (out like q, lse f32
  [B,K,Tp,G]). Query tile i visits key tiles 0..i only (causal block skipping), from the first
  within the window."""
  B, K, Tp, G, Dh = q.shape
  n = Tp // tile
  ar = jnp.arange(tile)

  def q_tile(carry, i):
    out, lse = carry
    qi = jax.lax.dynamic_slice_in_dim(q, i * tile, tile, axis=2)
    qreal = jax.lax.dynamic_slice_in_dim(mask, i * tile, tile, axis=1)
    qpos = i * tile + ar

    def k_tile(j, c):
      kj = jax.lax.dynamic_slice_in_dim(k, j * tile, tile, axis=2)
      vj = jax.lax.dynamic_slice_in_dim(v, j * tile, tile, axis=2)
      kreal = jax.lax.dynamic_slice_in_dim(mask, j * tile, tile, axis=1)
      allowed = _block_allowed(qpos, j * tile + ar, qreal, kreal, window)
      return _online_step(c, _scores(qi, kj, allowed, scale, softcap), vj)

    shape = (B, K, tile, G)
    init = (
      jnp.full(shape, _NEG_INF, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros((*shape, Dh), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(_first_key_tile(i, tile, window), i + 1, k_tile, init)
    o = (acc / l[..., None]).astype(q.dtype)
    out = jax.lax.dynamic_update_slice_in_dim(out, o, i * tile, axis=2)
    lse = jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(l), i * tile, axis=2)
    return (out, lse), None

  init = (jnp.zeros_like(q), jnp.zeros((B, K, Tp, G), jnp.float32))
  (out, lse), _ = jax.lax.scan(q_tile, init, jnp.arange(n))
  return out, lse


def _block_grads(qi, kj, vj, doi, lsei, di, allowed, scale, softcap=None):
  """One block's gradients, its probabilities recomputed from the saved log-sum-exp: query rows
  qi [B,K,bq,G,Dh] (output gradient doi, lsei and delta di [B,K,bq,G]) against keys kj and
  values vj [B,K,bk,Dh] under allowed [B,bq,bk] -> (dq float32 like qi, dk and dv float32
  [B,K,Dh,bk], transposed: see _key_grad)."""
  dt, shape = qi.dtype, qi.shape
  if softcap is None:
    p = jnp.exp(_scores(qi, kj, allowed, scale) - lsei[..., None])  # [B,K,bq,G,bk]
  else:
    capped = soft_cap(_rows_dot(qi, kj, "nd") * scale, softcap)
    p = jnp.exp(capped + _mask_bias(allowed)[:, None, :, None] - lsei[..., None])
  p, qi, doi, di = (_merge_rows(x) for x in (p, qi, doi, di))  # [B,K,bq*G(,.)]
  dv = _key_grad(doi, p.astype(dt))
  dp = _merged_dot(doi, vj, "nd")
  ds = p * (dp - di[..., None])  # the scale goes on dk, dq (see dense_fused)
  if softcap is not None:
    ds = ds * _softcap_grad(_merge_rows(capped), softcap)
  ds = ds.astype(dt)
  dk = _key_grad(qi, ds) * scale
  dq = _merged_dot(ds, kj, "dn") * scale
  return dq.reshape(shape), dk, dv


def _flash_backward(q, k, v, mask, window, out, lse, dout, tile, scale, softcap):
  """Gradients (dq, dk, dv) of _flash_forward, recomputing each block's probabilities from lse.
  Key tile j visits query tiles j..n-1 (those within the window); dq is accumulated in one
  float32 buffer."""
  B, K, Tp, G, Dh = q.shape
  n = Tp // tile
  ar = jnp.arange(tile)
  dt = q.dtype
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,K,Tp,G]

  def k_tile(dq, j):
    kj = jax.lax.dynamic_slice_in_dim(k, j * tile, tile, axis=2)
    vj = jax.lax.dynamic_slice_in_dim(v, j * tile, tile, axis=2)
    kreal = jax.lax.dynamic_slice_in_dim(mask, j * tile, tile, axis=1)
    kpos = j * tile + ar

    def q_tile(i, c):
      dq, dk, dv = c
      sl = lambda x, axis=2: jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=axis)
      qi, doi, lsei, di = sl(q), sl(dout), sl(lse), sl(delta)
      allowed = _block_allowed(i * tile + ar, kpos, sl(mask, 1), kreal, window)
      dqi, dki, dvi = _block_grads(qi, kj, vj, doi, lsei, di, allowed, scale, softcap)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, sl(dq) + dqi, i * tile, axis=2)
      return dq, dk + dki, dv + dvi

    zeros = jnp.zeros((B, K, Dh, tile), jnp.float32)  # dk, dv transposed (see _key_grad)
    # The last query tile whose queries reach this key tile within the window.
    end = n if window is None else jnp.minimum(n, ((j + 1) * tile + window - 2) // tile + 1)
    dq, dk, dv = jax.lax.fori_loop(j, end, q_tile, (dq, zeros, zeros))
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(k_tile, jnp.zeros(q.shape, jnp.float32), jnp.arange(n))
  # [n, B, K, Dh, tile] -> [B, K, Tp, Dh]
  unstack = lambda x: jnp.moveaxis(x, 0, 2).swapaxes(3, 4).reshape(B, K, Tp, Dh)
  return dq.astype(dt), unstack(dk).astype(k.dtype), unstack(dv).astype(v.dtype)


def _prefix_block(q, mask, i, tile, window):
  """(query tile i [B,K,tile,G,Dh], allowed [B,tile,(i+1)*tile]): the tile against every key up
  to its end (the keys after it are causally excluded; those outside a window masked)."""
  end = (i + 1) * tile
  pos = jnp.arange(end)
  allowed = _block_allowed(pos[i * tile :], pos, mask[:, i * tile : end], mask[:, :end], window)
  return q[:, :, i * tile : end], allowed


def _unrolled_forward(q, k, v, mask, window, tile, scale, softcap):
  """_flash_forward with the query tiles unrolled: tile i's softmax over its key prefix at once
  (no online rescaling; a traced window is masked, not skipped)."""
  n = q.shape[2] // tile
  outs, lses = [], []
  for i in range(n):
    end = (i + 1) * tile
    qi, allowed = _prefix_block(q, mask, i, tile, window)
    s = _scores(qi, k[:, :, :end], allowed, scale, softcap)
    m = jnp.max(s, axis=-1)  # finite: every query is allowed itself
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    pv = _rows_dot(p.astype(v.dtype), v[:, :, :end], "dn")
    outs.append((pv / l[..., None]).astype(q.dtype))
    lses.append(m + jnp.log(l))
  return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


def _unrolled_backward(q, k, v, mask, window, out, lse, dout, tile, scale, softcap):
  """_flash_backward with the query tiles unrolled: tile i's gradients against its whole key
  prefix (`_block_grads`); the prefix's key and value gradients are summed over tiles
  (zero-padded to Tp)."""
  B, K, Tp, G, Dh = q.shape
  n = Tp // tile
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,K,Tp,G]
  dqs = []
  dk = dv = jnp.zeros((B, K, Dh, Tp), jnp.float32)  # transposed (see _key_grad)
  for i in range(n):
    end = (i + 1) * tile
    rows = slice(i * tile, end)
    qi, allowed = _prefix_block(q, mask, i, tile, window)
    dqi, dki, dvi = _block_grads(
      qi, k[:, :, :end], v[:, :, :end], dout[:, :, rows], lse[:, :, rows], delta[:, :, rows],
      allowed, scale, softcap,
    )  # fmt: skip
    widths = ((0, 0), (0, 0), (0, 0), (0, Tp - end))
    dk, dv = dk + jnp.pad(dki, widths), dv + jnp.pad(dvi, widths)
    dqs.append(dqi)
  dq = jnp.concatenate(dqs, axis=2).astype(q.dtype)
  return dq, dk.swapaxes(2, 3).astype(k.dtype), dv.swapaxes(2, 3).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, mask, window, tile, unroll, scale, softcap):
  return _flash_fwd(q, k, v, mask, window, tile, unroll, scale, softcap)[0]


def _flash_fwd(q, k, v, mask, window, tile, unroll, scale, softcap):
  forward = _unrolled_forward if unroll else _flash_forward
  out, lse = forward(q, k, v, mask, window, tile, scale, softcap)
  out, lse = checkpoint_name(out, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])
  return out, (q, k, v, mask, window, out, lse)


def _flash_bwd(tile, unroll, scale, softcap, res, dout):
  backward = _unrolled_backward if unroll else _flash_backward
  grads = backward(*res, dout, tile, scale, softcap)
  return (*grads, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  *,
  block_size: int = BLOCK_SIZE,
  unroll: bool = False,
  scale: float | None = None,
  softcap: float | None = None,
  window=None,
) -> jax.Array:
  """Flash-style attention, O(T) memory in the forward and backward: q [B,T,H,Dh], k/v
  [B,T,K,Dh], mask bool [B,T] -> [B,T,H,Dh]. T is padded up to whole tiles of <= block_size.
  scale (default Dh ** -0.5), softcap and window (int, traced int32 or None): `Scores`; the
  loops skip the key tiles wholly outside the window.
  `unroll`: the query tiles as straight-line code, each against its whole key prefix, for short
  sequences (`UNROLL_MAX_LEN`): XLA's CPU schedule then holds every tile's scores at once, about
  the causal half of dense's [T, T] per head (its memory is not linear in T); else loops."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  tile, n = _tile(T, block_size)
  pad = n * tile - T
  mask = mask.astype(bool)
  if pad:
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    mask = jnp.pad(mask, ((0, 0), (0, pad)))
  Tp = T + pad
  qh = q.reshape(B, Tp, K, H // K, Dh).transpose(0, 2, 1, 3, 4)
  kh, vh = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [B,K,Tp,Dh]
  window = None if window is None else jnp.asarray(window, jnp.int32)
  out = _flash(qh, kh, vh, mask, window, tile, unroll, scale or Dh**-0.5, softcap)
  return out.transpose(0, 2, 1, 3, 4).reshape(B, Tp, H, Dh)[:, :T]


def cached_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  offset: jax.Array | int,
  *,
  block_size: int = BLOCK_SIZE,
  layer: jax.Array | int | None = None,
  scale: float | None = None,
  softcap: float | None = None,
  window=None,
) -> jax.Array:
  """Forward-only blockwise attention of T queries written at cache slots [offset, offset + T).

  q [B,T,H,Dh]; k/v [B,S,K,Dh] the whole cache (new keys already written), or with `layer` the
  stacked cache of every layer [L,B,S,K,Dh] and the index of this one; mask bool [B,S] (real
  slots); offset int32 scalar, may be traced. Query i attends to the real slots j <= offset + i
  and to its own slot (the KV-cache rule of `model.Transformer`). Only the key blocks of
  `block_size` slots that hold a slot <= offset + T - 1 are read, each sliced from the cache where
  it lies (no copy of the whole cache or layer): a traced trip count, so one compiled call serves
  every offset and costs what the filled length costs (hence not reverse-differentiable). The
  prefill (T > 1) and the decode step (T = 1, `DECODE_BLOCK`) both attend this way.
  Memory: one [B, H, tile, block] float32 block at a time. scale, softcap and window:
  `Scores` (window: an int, traced int32 or None); a windowed query reads only the key blocks
  from its window's first slot on.
  """
  B, T, H, Dh = q.shape
  S, K = k.shape[-3], k.shape[-2]
  G = H // K
  offset = jnp.asarray(offset, jnp.int32)
  tq, nq = _tile(T, block_size)
  tk = min(block_size, S)
  nk = -(-S // tk)
  scale = scale or Dh**-0.5

  def slot_block(x, start):  # [B,tk,K,Dh]: slots [start, start + tk) of this layer, as stored
    if layer is None:
      return jax.lax.dynamic_slice_in_dim(x, start, tk, axis=1)
    return jax.lax.dynamic_slice(x, (layer, 0, start, 0, 0), (1, B, tk, K, Dh))[0]

  if T == 1:
    qg = q.reshape(B, K, G, Dh)
    return _decode_query(qg, k, v, mask, offset, tk, nk, scale, softcap, window, slot_block)
  if nq * tq > T:
    q = jnp.pad(q, ((0, 0), (0, nq * tq - T), (0, 0), (0, 0)))
  qh = q.reshape(B, nq * tq, K, G, Dh).transpose(0, 2, 1, 3, 4)  # [B,K,Tq,G,Dh]
  key_block = lambda x, start: slot_block(x, start).transpose(0, 2, 1, 3)  # [B,K,tk,Dh]

  def q_tile(i):
    qi = jax.lax.dynamic_slice_in_dim(qh, i * tq, tq, axis=2)
    qpos = offset + i * tq + jnp.arange(tq)  # cache slot of each query
    last = jnp.minimum(offset + jnp.minimum((i + 1) * tq, T) - 1, S - 1)

    def k_tile(j, c):
      # The last tile may overlap the one before it (start clamped to S - tk): slots already
      # seen are masked out, so no padding of the cache is needed.
      start = jnp.minimum(j * tk, S - tk)
      kpos = start + jnp.arange(tk)
      kj, vj = key_block(k, start), key_block(v, start)
      kreal = jax.lax.dynamic_slice_in_dim(mask, start, tk, axis=1) & (kpos >= j * tk)[None]
      allowed = (kpos[None, None, :] <= qpos[None, :, None]) & kreal[:, None, :]
      allowed = allowed & _in_window(qpos[None, :, None], kpos[None, None, :], window)
      allowed = allowed | (kpos[None, None, :] == qpos[None, :, None])
      return _online_step(c, _scores(qi, kj, allowed, scale, softcap), vj)

    shape = (B, K, tq, G)
    init = (
      jnp.full(shape, _NEG_INF, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros((*shape, Dh), jnp.float32),
    )
    first = _first_key_tile(offset + i * tq, 1, window) // tk  # the window's first block
    _, l, acc = jax.lax.fori_loop(first, jnp.minimum(last // tk + 1, nk), k_tile, init)
    return (acc / jnp.maximum(l, 1e-30)[..., None]).astype(q.dtype)

  if nq == 1:
    out = q_tile(0)[None]
  else:
    out = jax.lax.map(q_tile, jnp.arange(nq))  # [nq, B, K, tq, G, Dh]
  out = out.transpose(1, 0, 3, 2, 4, 5).reshape(B, nq * tq, H, Dh)
  return out[:, :T]


def _decode_query(q, k, v, mask, offset, tk, nk, scale, softcap, window, slot_block):
  """`cached_attention` of one query per row, q [B,K,G,Dh] at cache slot `offset` -> [B,1,H,Dh].

  Products and sums instead of dots: the step is G-row matrix-vector products, bound by reading
  the cache, not by arithmetic, and XLA (CPU) would first copy each key and value block into the
  dot's operand layout (a transpose), while a multiply-reduce takes the block as stored.
  """
  B, K, G, Dh = q.shape
  qf = q.astype(jnp.float32)

  def k_tile(j, c):
    m, l, acc = c  # [B,K,G], [B,K,G], [B,K,G,Dh]
    start = jnp.minimum(j * tk, S - tk)
    kpos = start + jnp.arange(tk)
    kreal = jax.lax.dynamic_slice_in_dim(mask, start, tk, axis=1) & (kpos >= j * tk)[None]
    ok = (kpos <= offset) & _in_window(offset, kpos, window)
    allowed = (ok[None] & kreal) | (kpos == offset)[None]  # [B, tk]
    kj = slot_block(k, start).astype(jnp.float32)  # [B,tk,K,Dh]
    s = jnp.sum(kj[:, :, :, None, :] * qf[:, None], axis=-1) * scale  # [B,tk,K,G]
    s = soft_cap(s, softcap)
    s = jnp.where(allowed[:, :, None, None], s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with nothing allowed yet
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m - m_safe)
    vj = slot_block(v, start).astype(jnp.float32)
    pv = jnp.sum(p[..., None] * vj[:, :, :, None, :], axis=1)  # [B,K,G,Dh]
    return m_new, alpha * l + jnp.sum(p, axis=1), alpha[..., None] * acc + pv

  S = mask.shape[1]
  init = (
    jnp.full((B, K, G), _NEG_INF, jnp.float32),
    jnp.zeros((B, K, G), jnp.float32),
    jnp.zeros((B, K, G, Dh), jnp.float32),
  )
  first = _first_key_tile(offset, 1, window) // tk  # the window's first block
  _, l, acc = jax.lax.fori_loop(first, jnp.minimum(offset // tk + 1, nk), k_tile, init)
  out = acc / jnp.maximum(l, 1e-30)[..., None]
  return out.reshape(B, 1, K * G, Dh).astype(q.dtype)


def decode_attention(
  q: jax.Array,
  k_t: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  offset: jax.Array | int,
  *,
  scale: float | None = None,
  softcap: float | None = None,
  window: int | None = None,
) -> jax.Array:
  """One query per row over a layer's whole cache in `model.LayerCache`'s layout.

  q [B,1,H,Dh] written at slot `offset` (may be traced); k_t [B,K,Dh,S] (keys transposed);
  v [B,K,S,Dh]; mask bool [B,S] (real slots). The query attends to the real slots <= offset and
  to its own slot (the KV-cache rule of `cached_attention`). Two plain matrix products per
  (row, KV head), read as stored: on CPU no key or value block is copied, which a loop over
  blocks (`cached_attention`) cannot avoid, since XLA's CPU backend copies every dynamic slice
  that feeds a matrix product. -> [B,1,H,Dh]. scale, softcap: `Scores`; a static `window`
  shorter than the cache reads only the `window` slots up to the query (one slice of the cache:
  a copy of the window, not of the cache).
  """
  B, _, H, Dh = q.shape
  K, S = k_t.shape[1], k_t.shape[3]
  offset = jnp.asarray(offset, jnp.int32)
  slots = jnp.arange(S)
  if window is not None and window < S:
    start = jnp.clip(offset - window + 1, 0, S - window)
    k_t = jax.lax.dynamic_slice_in_dim(k_t, start, window, axis=3)
    v = jax.lax.dynamic_slice_in_dim(v, start, window, axis=2)
    mask = jax.lax.dynamic_slice_in_dim(mask, start, window, axis=1)
    slots = start + jnp.arange(window)
  qh = q.reshape(B, K, H // K, Dh) * jnp.asarray(scale or Dh**-0.5, q.dtype)
  s = jnp.einsum("bkgd,bkds->bkgs", qh, k_t, preferred_element_type=jnp.float32)
  s = soft_cap(s, softcap)
  ok = (slots <= offset) & _in_window(offset, slots, window)
  allowed = (ok[None] & mask) | (slots == offset)[None]  # [B, S]
  s = jnp.where(allowed[:, None, None], s, _NEG_INF)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))  # its own slot is always allowed
  out = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = out / jnp.sum(p, axis=-1)[..., None]
  return out.reshape(B, 1, H, Dh).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# cuDNN (GPU)
# --------------------------------------------------------------------------------------------


def cudnn(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  *,
  implementation: str = "cudnn",
  scale: float | None = None,
  window: int | None = None,
) -> jax.Array:
  """jax.nn.dot_product_attention with cuDNN's fused causal kernel.

  cuDNN masks padding by sequence length (keys j >= length), so each row is rotated left by its
  number of leading pads (`left_align`), attended (`cudnn_left_aligned`) and rotated back.
  Exact for real tokens when each row's real tokens form one contiguous run; pad outputs are
  unspecified. `implementation="xla"` runs the same rotation on any backend (tests). The model
  rotates its rows once around all layers instead (`Transformer.__call__`).
  """
  fwd, back, length = left_align(mask)
  rot = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
  out = cudnn_left_aligned(
    rot(q, fwd), rot(k, fwd), rot(v, fwd), length, implementation=implementation, scale=scale,
    window=window,
  )  # fmt: skip
  return rot(out, back)


def left_align(mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(fwd, back, length) for mask bool [B, T] whose rows hold one contiguous run of real tokens:
  take_along_axis(x, fwd, 1) rotates each row left so that its real tokens come first, `back`
  rotates it back, and length int32 [B] counts the real tokens (at least 1)."""
  T = mask.shape[1]
  mask = mask.astype(bool)
  start = jnp.argmax(mask, axis=1).astype(jnp.int32)  # first real token (0 if none)
  length = jnp.maximum(jnp.sum(mask, axis=1, dtype=jnp.int32), 1)
  ar = jnp.arange(T, dtype=jnp.int32)[None]
  return (ar + start[:, None]) % T, (ar - start[:, None]) % T, length


def cudnn_left_aligned(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  length: jax.Array,
  *,
  implementation: str = "cudnn",
  scale: float | None = None,
  window: int | None = None,
) -> jax.Array:
  """Causal attention of rows whose first length[b] tokens are real and the rest padding
  (`left_align`): cuDNN's kernel with key_value_seq_lengths, and a static sliding `window`
  (local_window_size: keys j > i - window). Pad outputs are unspecified."""
  return jax.nn.dot_product_attention(
    q, k, v, scale=scale, is_causal=True, key_value_seq_lengths=length,
    local_window_size=None if window is None else (window - 1, 0),
    implementation=implementation,
  )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Splash attention (TPU)
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _splash_kernel(
  seq_len: int, groups: int, block: int, interpret: bool, window: int | None, softcap: float | None
):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  shape = (seq_len, seq_len)
  if window is None:
    one = lambda: sa.CausalMask(shape)
  else:  # keys j with i - window < j <= i
    one = lambda: sa.LocalMask(shape, window_size=(window - 1, 0), offset=0)
  mask = sa.MultiHeadMask([one() for _ in range(groups)])
  sizes = sa.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  with jax.ensure_compile_time_eval():  # concrete mask tables, safe to cache across traces
    return sa.make_splash_mqa_single_device(
      mask, block_sizes=sizes, interpret=interpret, attn_logits_soft_cap=softcap
    )


def splash(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  *,
  block_size: int = SPLASH_BLOCK,
  interpret: bool | None = None,
  scale: float | None = None,
  softcap: float | None = None,
  window: int | None = None,
) -> jax.Array:
  """The Pallas splash-attention kernel (TPU; `interpret=True` runs it on any backend, slowly).
  scale, softcap and a static window: `Scores` (the window as splash's LocalMask).

  Per example and kv head an MQA kernel over the head's G query heads: a static causal mask
  and segment ids (real tokens 0, pad t gets t + 1, so it sees only itself). T is padded to a
  multiple of the block (128 lanes at least). Under a mesh with the batch axes (data x fsdp),
  the kernel runs per device in `jax.shard_map` (batch split; kv heads over `tensor`).
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  if interpret is None:
    interpret = jax.default_backend() != "tpu"
  B, T, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  block = min(block_size, -(-T // 128) * 128)
  Tp = -(-T // block) * block
  mask = mask.astype(bool)
  if Tp > T:
    widths = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    mask = jnp.pad(mask, ((0, 0), (0, Tp - T)))
  segments = jnp.where(mask, 0, jnp.arange(1, Tp + 1, dtype=jnp.int32)[None])
  qh = q * jnp.asarray(scale or Dh**-0.5, q.dtype)
  qh = qh.reshape(B, Tp, K, G, Dh).transpose(0, 2, 3, 1, 4)
  kh, vh = (x.transpose(0, 2, 1, 3) for x in (k, v))
  kernel = _splash_kernel(Tp, G, block, bool(interpret), window, softcap)

  def per_device(qh, kh, vh, segments):
    def one(qg, kk, vv, seg):
      return kernel(qg, kk, vv, segment_ids=sa.SegmentIds(q=seg, kv=seg))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    return jax.vmap(per_head)(qh, kh, vh, segments)

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and math.prod(mesh.shape.values()) > 1:
    P = jax.sharding.PartitionSpec
    batch = partitioning.batch_spec((B,), mesh)[0]
    heads = "tensor" if "tensor" in mesh.axis_names and K % mesh.shape["tensor"] == 0 else None
    spec4 = P(batch, heads)
    per_device = jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(spec4, spec4, spec4, P(batch)),
      out_specs=spec4,
      check_vma=False,
    )
  out = per_device(qh, kh, vh, segments)  # [B, K, G, Tp, Dh]
  return out.transpose(0, 3, 1, 2, 4).reshape(B, Tp, H, Dh)[:, :T].astype(q.dtype)
