"""Per-token estimators of D_f(pi || mu) at the sampled token (docs/math.md#estimators).

All estimators take log-probabilities of the sampled token under the current policy (`logp`) and the
behaviour policy (`logq`) and are elementwise, so they broadcast over leading [batch, token] axes
exactly like `jax.vmap` of the per-token function. Every estimator is a sum of perspective terms
b * f(a / b) (see `gppo_jax.algorithm.divergences`):

  mc      f(r)                                    single sample, unbiased, high variance
  binary  q f(p/q) + (1-q) f((1-p)/(1-q))         two outcomes {a_t, rest}; <= D_f
  atomic  q f(p/q)                                exact contribution of a_t to D_f's sum
  topk    sum over mu's top-K tokens (+ the sampled token) + one "rest" bucket (DPPO's variant)
  exact   full-vocabulary D_f from hidden states and unembeddings, chunked over the vocabulary

Inputs are cast to float32; complements 1 - p come from log1mexp so nothing divides by a vanishing
1 - q. Values and gradients are finite for p, q in [1e-30, 1 - 1e-7] and for bf16 inputs.

New estimators: `register("name", fn)` (or `@register("name")` on fn) with
fn(divergence, logp, logq, **kwargs) -> estimate; the name then works in the loss and configs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gppo_jax import registry
from gppo_jax.algorithm import divergences as divs

Array = jax.Array
EstimatorFn = Callable[..., Array]

# Log-probabilities are floored here (e^-80 ~ 1.8e-35 is still a normal float32), so that 1 / q and
# q * f(p / q) stay finite for probabilities that underflowed to zero.
LOG_PROB_FLOOR = -80.0
# log p is capped just below 0 before forming log(1 - p): p = 1 exactly would give log(0).
_LOG_ONE = -1e-8


def log1mexp(x: Array) -> Array:
  """log(1 - exp(x)) for x < 0, stable at both ends (x is capped at -1e-8)."""
  x = jnp.minimum(x, _LOG_ONE)
  return jnp.where(
    x > -math.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(jnp.minimum(x, -math.log(2.0))))
  )


def _prep(logp: Array, logq: Array) -> tuple[Array, Array]:
  logp = jnp.asarray(logp)
  logq = jnp.asarray(logq)
  if logp.shape != logq.shape:
    raise ValueError(f"logp and logq must have the same shape, got {logp.shape} and {logq.shape}")
  # float32 math for bf16 / float32 inputs; float64 stays float64 (x64 mode, e.g. the theory).
  dtype = jnp.promote_types(jnp.promote_types(logp.dtype, logq.dtype), jnp.float32)
  logp = jnp.maximum(logp.astype(dtype), LOG_PROB_FLOOR)
  logq = jnp.maximum(logq.astype(dtype), LOG_PROB_FLOOR)
  return logp, logq


def mc(div: divs.Divergence, logp: Array, logq: Array) -> Array:
  """Single-sample Monte Carlo estimate f(r), r = p / q."""
  logp, logq = _prep(logp, logq)
  return div.mc(logp - logq)


def atomic(div: divs.Divergence, logp: Array, logq: Array) -> Array:
  """The sampled action's exact term of D_f: q f(p / q)."""
  logp, logq = _prep(logp, logq)
  return div.perspective(logp, logq)


def binary(div: divs.Divergence, logp: Array, logq: Array) -> Array:
  """D_f between the two-outcome distributions {sampled token, everything else}."""
  logp, logq = _prep(logp, logq)
  return div.perspective(logp, logq) + div.perspective(log1mexp(logp), log1mexp(logq))


def topk(
  div: divs.Divergence,
  logp: Array,
  logq: Array,
  *,
  topk_logp: Array,
  topk_logq: Array,
  topk_ids: Array,
  tokens: Array,
) -> Array:
  """D_f over the partition {mu's top-K tokens} + {sampled token if outside} + {rest}.

  Args:
    logp, logq: [...] log-probs of the sampled token under pi and mu.
    topk_logp: [..., K] log-probs under pi of mu's top-K token ids.
    topk_logq: [..., K] mu's top-K log-probs (stored by the sampler).
    topk_ids: [..., K] their token ids; tokens: [...] the sampled token ids.
  """
  logp, logq = _prep(logp, logq)
  topk_logp = jnp.maximum(jnp.asarray(topk_logp, jnp.float32), LOG_PROB_FLOOR)
  topk_logq = jnp.maximum(jnp.asarray(topk_logq, jnp.float32), LOG_PROB_FLOOR)
  if topk_logp.shape != topk_logq.shape or topk_ids.shape != topk_logq.shape:
    raise ValueError(
      "topk_logp, topk_logq and topk_ids must share one shape, got "
      f"{topk_logp.shape}, {topk_logq.shape}, {topk_ids.shape}"
    )
  if topk_logq.shape[:-1] != logq.shape or jnp.shape(tokens) != logq.shape:
    raise ValueError(
      f"top-K arrays must be logq.shape + (K,) and tokens logq.shape; got {topk_logq.shape}, "
      f"tokens {jnp.shape(tokens)}, logq {logq.shape}"
    )
  in_topk = jnp.any(topk_ids == jnp.asarray(tokens)[..., None], axis=-1)
  total = jnp.sum(div.perspective(topk_logp, topk_logq), axis=-1)
  total = total + jnp.where(in_topk, 0.0, div.perspective(logp, logq))
  # The rest bucket: everything outside the buckets above.
  extra_p = jnp.where(in_topk, LOG_PROB_FLOOR, logp)[..., None]
  extra_q = jnp.where(in_topk, LOG_PROB_FLOOR, logq)[..., None]
  mass_p = jax.nn.logsumexp(jnp.concatenate([topk_logp, extra_p], axis=-1), axis=-1)
  mass_q = jax.nn.logsumexp(jnp.concatenate([topk_logq, extra_q], axis=-1), axis=-1)
  rest_p = jnp.maximum(log1mexp(mass_p), LOG_PROB_FLOOR)
  rest_q = jnp.maximum(log1mexp(mass_q), LOG_PROB_FLOOR)
  return total + div.perspective(rest_p, rest_q)


def exact_from_logits(div: divs.Divergence, logits_p: Array, logits_q: Array) -> Array:
  """Full-vocabulary D_f(pi || mu) per position from dense logits [..., V] (small vocabularies)."""
  logp = jax.nn.log_softmax(jnp.asarray(logits_p, jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(jnp.asarray(logits_q, jnp.float32), axis=-1)
  logp = jnp.maximum(logp, LOG_PROB_FLOOR)
  logq = jnp.maximum(logq, LOG_PROB_FLOOR)
  return jnp.sum(div.perspective(logp, logq), axis=-1)


def exact(
  div: divs.Divergence,
  logp: Array | None = None,
  logq: Array | None = None,
  *,
  hidden_p: Array,
  w_p: Array,
  hidden_q: Array,
  w_q: Array,
  temperature: float = 1.0,
  vocab_chunk: int = 8192,
) -> Array:
  """Full-vocabulary D_f per token from final hidden states and unembedding matrices.

  logits = hidden @ w / temperature with hidden [..., D] and w [D, V]. The vocabulary is processed
  in chunks of `vocab_chunk` columns (two passes: log-normalisers, then the perspective sum), so at
  most [tokens, vocab_chunk] logits exist at once. A diagnostic: no gradient flows through it.
  `logp` and `logq` are accepted for signature compatibility with `estimate` and ignored.
  """
  del logp, logq
  lead = hidden_p.shape[:-1]
  if hidden_q.shape[:-1] != lead or w_p.shape[1] != w_q.shape[1]:
    raise ValueError(
      f"exact: hidden states {hidden_p.shape} / {hidden_q.shape} and unembeddings "
      f"{w_p.shape} / {w_q.shape} do not match"
    )
  hp = jax.lax.stop_gradient(hidden_p.reshape(-1, hidden_p.shape[-1]).astype(jnp.float32))
  hq = jax.lax.stop_gradient(hidden_q.reshape(-1, hidden_q.shape[-1]).astype(jnp.float32))
  vocab = w_p.shape[1]
  chunk = min(vocab_chunk, vocab)
  num_chunks = -(-vocab // chunk)
  pad = num_chunks * chunk - vocab

  def split(w: Array) -> Array:
    w = jax.lax.stop_gradient(w.astype(jnp.float32))
    w = jnp.pad(w, ((0, 0), (0, pad)))
    return w.reshape(w.shape[0], num_chunks, chunk).transpose(1, 0, 2)

  wp_chunks, wq_chunks = split(w_p), split(w_q)
  valid = (jnp.arange(num_chunks * chunk) < vocab).reshape(num_chunks, chunk)

  def chunk_logits(h: Array, w: Array, ok: Array) -> Array:
    return jnp.where(ok, (h @ w) / temperature, -jnp.inf)

  def lse_step(carry, xs):
    lse_p, lse_q = carry
    wp, wq, ok = xs
    lse_p = jnp.logaddexp(lse_p, jax.nn.logsumexp(chunk_logits(hp, wp, ok), axis=-1))
    lse_q = jnp.logaddexp(lse_q, jax.nn.logsumexp(chunk_logits(hq, wq, ok), axis=-1))
    return (lse_p, lse_q), None

  init = (jnp.full(hp.shape[:1], -jnp.inf), jnp.full(hq.shape[:1], -jnp.inf))
  (lse_p, lse_q), _ = jax.lax.scan(lse_step, init, (wp_chunks, wq_chunks, valid))

  def sum_step(total, xs):
    wp, wq, ok = xs
    lp = jnp.maximum((hp @ wp) / temperature - lse_p[:, None], LOG_PROB_FLOOR)
    lq = jnp.maximum((hq @ wq) / temperature - lse_q[:, None], LOG_PROB_FLOOR)
    return total + jnp.sum(jnp.where(ok, div.perspective(lp, lq), 0.0), axis=-1), None

  total, _ = jax.lax.scan(sum_step, jnp.zeros(hp.shape[:1]), (wp_chunks, wq_chunks, valid))
  return total.reshape(lead)


_REGISTRY: registry.Registry[EstimatorFn] = registry.Registry("estimator")
for _name, _fn in (("mc", mc), ("binary", binary), ("atomic", atomic), ("topk", topk)):
  _REGISTRY.register(_name, _fn)
del _name, _fn
# A diagnostic: `estimate(..., "exact", ...)` works, but config validation rejects it as a loss.
_REGISTRY.register("exact", exact)


def register(name: str, fn: EstimatorFn | None = None, *, overwrite: bool = False):
  """Registers fn(divergence, logp, logq, **kwargs) -> per-token estimate under `name` and returns
  fn; without fn, a decorator: `@estimators.register("name")`."""
  if fn is None:
    return _REGISTRY.register(name, overwrite=overwrite)
  return _REGISTRY.register(name, fn, overwrite=overwrite)


def names() -> list[str]:
  return _REGISTRY.names()


def get(name: str | EstimatorFn) -> EstimatorFn:
  """Looks up an estimator by name; passes callables through."""
  if callable(name):
    return name
  return _REGISTRY.get(name)


def estimate(
  divergence: str | divs.Divergence,
  estimator: str | EstimatorFn,
  logp: Array,
  logq: Array,
  **kwargs,
) -> Array:
  """Per-token estimate of D_f(pi || mu); names are resolved outside any jit trace.

  Example: `estimate("kl", "atomic", logp, logq)` for logp, logq of shape [batch, tokens].
  `topk` needs topk_logp/topk_logq/topk_ids/tokens; `exact` needs hidden_p/w_p/hidden_q/w_q.
  """
  return get(estimator)(divs.get(divergence), logp, logq, **kwargs)
