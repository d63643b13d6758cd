"""The output head: float32 logits of hidden states, and the chunked log-prob statistics training
reads (`chunked_logprobs`).

`chunked_logprob_stats` walks the sequence in chunks under `jax.checkpoint`, so the [B, T, vocab]
float32 logits never exist at once, not even under grad (unless they are small:
`ONE_CHUNK_BYTES`). In a 16-bit compute dtype the head's products run on 16-bit operands with
float32 accumulation, forward and backward (`head_logits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gppo_jax.models import attention as attention_lib
from gppo_jax.models import low_precision


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


def chunked_logprobs(model, hidden: jax.Array, targets: jax.Array, **kwargs):
  """`chunked_logprob_stats` with the model's own head (a `model.Transformer`: its
  `unembedding` and cfg.final_softcap), for hidden states already computed."""
  w, tied = model.unembedding()
  kwargs.setdefault("softcap", model.cfg.final_softcap)
  return chunked_logprob_stats(hidden, w, targets, tied=tied, **kwargs)
