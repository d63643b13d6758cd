"""The GPPO trust-region policy loss (docs/math.md#loss).

A token is out of the trust region when its divergence estimate exceeds delta; its gradient is
stopped only when the update would push it further out (A (r - 1) > 0):

  out_t = (A_t > 0 and r_t > 1 and D_t > delta_high) or (A_t < 0 and r_t < 1 and D_t > delta_low)
  loss  = - aggregate_t( stop_gradient(1 - out_t) * r_t * A_t )

With divergence="tv", estimator="mc" and delta = eps / 2 this is PPO's clipped objective (identical
gradients). With ratio_level="sequence" every token of a response uses the response's
length-normalised ratio s_i = exp(mean_t l_t) in place of r_t (GSPO, docs/math.md#gspo). The
per-token loss is aggregated as a (sum, count) pair so that gradient accumulation over
micro-batches reproduces the full-batch loss exactly (pass the full count as `normalizer`).

`LossConfig` holds every setting of the loss in one frozen value: presets, config files
(`config.loss` has the same fields), the update step and `policy_loss` all use it.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gppo_jax.algorithm import divergences as divs
from gppo_jax.algorithm import estimators as ests

Array = jax.Array

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Where the importance ratio is formed: per token (r_t), or per response (GSPO's geometric mean of
# the token ratios, shared by all the response's tokens; docs/math.md#gspo).
RATIO_LEVELS = ("token", "sequence")


def aggregate_terms(
  values: Array, mask: Array, aggregation: str, max_len: int | None = None
) -> tuple[Array, Array]:
  """(sum, count) of per-token values [B, T] such that sum / count is the aggregated mean.

  token-mean: sum over valid tokens / number of valid tokens (DAPO).
  seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO).
  seq-mean-token-sum-norm: mean over sequences of each sequence's token sum / max_len (Dr.GRPO).
  Sequences without valid tokens do not count. Sums over micro-batches split along the batch axis
  add up to the full batch's (sum, count).
  """
  mask = mask.astype(jnp.float32)
  values = values.astype(jnp.float32) * mask
  if aggregation == "token-mean":
    return jnp.sum(values), jnp.sum(mask)
  tokens_per_seq = jnp.sum(mask, axis=-1)
  has_tokens = (tokens_per_seq > 0).astype(jnp.float32)
  if aggregation == "seq-mean-token-mean":
    per_seq = jnp.sum(values, axis=-1) / jnp.maximum(tokens_per_seq, 1.0)
  elif aggregation == "seq-mean-token-sum-norm":
    norm = float(max_len if max_len is not None else values.shape[-1])
    per_seq = jnp.sum(values, axis=-1) / norm
  else:
    raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
  return jnp.sum(per_seq * has_tokens), jnp.sum(has_tokens)


def _check_delta(name: str, value: Any) -> None:
  if isinstance(value, numbers.Real) and not value > 0:
    raise ValueError(f"{name} must be > 0 (a trust-region radius), got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """Everything that defines the loss, in one frozen, hashable value (a static argument of jit).

  Its fields are exactly those of a training config's `config.loss`: config files write a preset's
  LossConfig there (`config_lib.use_settings`) and the trainer reads it back with `from_config`.

    LossConfig(divergence="kl", estimator="atomic", delta_low=0.0231)
    presets.get("dppo").loss.replace(ratio_cap=2.0)

  Attributes:
    divergence, estimator: registry names (or objects) of the trust region's geometry
      (docs/math.md#divergences, #estimators).
    delta_low, delta_high: radii for tokens pushed below / above ratio 1; delta_high None means
      delta_low. Both must be > 0 (inf = no trust region). Deltas may also be traced arrays (then
      the LossConfig is not hashable and cannot be a static argument).
    aggregation: one of AGGREGATIONS; max_len is the Dr.GRPO normaliser (None: the batch's T).
    ratio_cap: if set, the importance weight in the gradient is stop_gradient(min(r, C)) (DPPO;
      with an infinite radius, CISPO).
    ratio_level: "token" (r_t) or "sequence": r_t is replaced by the response's s_i, computed from
      the mean log-ratio of its valid tokens, with the gradient s_i grad log p_t (GSPO-token);
      needs estimator "mc", the only estimator that is a function of the ratio alone.
    dual_clip: if set (PPO uses 3), tokens with A < 0 and r > dual_clip are also stopped.
    kl_coef: penalty kl_coef * k3(pi || ref) per token; > 0 needs `ref_logp` in `policy_loss`.
    entropy_coef: bonus entropy_coef * H per token; > 0 needs `entropy` in `policy_loss`.
  """

  divergence: str | divs.Divergence = "kl"
  estimator: str | ests.EstimatorFn = "atomic"
  delta_low: float | Array
  delta_high: float | Array | None = None
  aggregation: str = "token-mean"
  max_len: int | None = None
  ratio_cap: float | None = None
  ratio_level: str = "token"
  dual_clip: float | None = None
  kl_coef: float = 0.0
  entropy_coef: float = 0.0

  def __post_init__(self):
    _check_delta("delta_low", self.delta_low)
    _check_delta("delta_high", self.delta_high)
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(
        f"unknown aggregation {self.aggregation!r}; valid: {', '.join(AGGREGATIONS)}"
      )
    if self.ratio_level not in RATIO_LEVELS:
      raise ValueError(
        f"unknown ratio_level {self.ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}"
      )
    if self.ratio_level == "sequence" and self.estimator not in ("mc", ests.mc):
      raise ValueError(sequence_estimator_problem(self.estimator))

  @property
  def radii(self) -> tuple[float | Array, float | Array]:
    """(delta_low, delta_high) with delta_high None read as delta_low."""
    return self.delta_low, self.delta_low if self.delta_high is None else self.delta_high

  def replace(self, **changes) -> LossConfig:
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_config(cls, section: Mapping[str, Any], response_len: int | None = None) -> LossConfig:
    """The LossConfig of a training config's `loss` section (fields it lacks keep their
    defaults); `loss.max_len` None becomes `response_len`, the padded response length."""
    values = {f.name: section[f.name] for f in dataclasses.fields(cls) if f.name in section}
    if values.get("max_len") is None:
      values["max_len"] = response_len
    return cls(**values)


def sequence_estimator_problem(estimator: Any) -> str:
  """Why ratio_level="sequence" refuses `estimator` (shared with config validation)."""
  name = estimator if isinstance(estimator, str) else getattr(estimator, "__name__", estimator)
  return (
    f"ratio_level='sequence' needs estimator='mc', got {name!r}: the sequence ratio s_i has "
    "no per-token probabilities p and q for binary, atomic or topk to weigh (docs/math.md#gspo)"
  )


def sequence_log_ratio(log_ratio: Array, valid: Array) -> Array:
  """[B] mean of the per-token log-ratios [B, T] over each row's valid tokens (0 for a row with
  none): log s_i, the log of GSPO's length-normalised sequence ratio."""
  valid = valid.astype(bool)
  n = jnp.sum(valid.astype(log_ratio.dtype), axis=-1)
  total = jnp.sum(jnp.where(valid, log_ratio, 0.0), axis=-1)
  return total / jnp.maximum(n, 1.0)


def trust_region_out(
  estimate: Array,
  ratio: Array,
  advantages: Array,
  valid: Array,
  delta_low: float | Array,
  delta_high: float | Array,
) -> tuple[Array, Array]:
  """(out_low, out_high), bool [B, T]: the tokens the trust region masks (docs/math.md#loss).

  out_high = A > 0 and r > 1 and estimate > delta_high; out_low = A < 0 and r < 1 and
  estimate > delta_low; both only where `valid`. `advantages` broadcasts against [B, T].
  """
  pos = advantages > 0
  neg = advantages < 0
  out_high = pos & (ratio > 1.0) & (estimate > delta_high) & valid
  out_low = neg & (ratio < 1.0) & (estimate > delta_low) & valid
  return out_low, out_high


def _masked_mean(x: Array, mask: Array, count: Array) -> Array:
  return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(count, 1.0)


def policy_loss(
  logp: Array,
  logq: Array,
  advantages: Array,
  mask: Array,
  loss: LossConfig,
  *,
  ref_logp: Array | None = None,
  entropy: Array | None = None,
  normalizer: Array | float | None = None,
  estimator_kwargs: dict[str, Any] | None = None,
  token_weight: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """GPPO's clipped surrogate loss and its metrics.

    policy_loss(logp, logq, adv, mask, LossConfig(divergence="kl", estimator="atomic",
                                                  delta_low=0.0231))

  Args:
    logp: [B, T] log pi(a_t | s_t) under the policy being optimised (carries the gradient).
    logq: [B, T] behaviour log-probs mu(a_t | s_t) recorded at rollout time.
    advantages: [B] (one per sequence) or [B, T].
    mask: [B, T] bool/0-1, True for response tokens that count.
    loss: the LossConfig (divergence, estimator, radii, aggregation, options, coefficients).
    ref_logp: [B, T] log-probs of the frozen reference policy (used when loss.kl_coef > 0).
    entropy: [B, T] per-token entropies (used when loss.entropy_coef > 0).
    normalizer: if given, loss = sum / normalizer (use the full batch's count under gradient
      accumulation); otherwise loss = sum / count of this batch.
    estimator_kwargs: the per-token inputs of estimators such as "topk" or "exact".
    token_weight: [B, T] constant weights of the policy term (the rollout correction's truncated
      importance weights, `correction.correct`); the KL and entropy terms are not weighted.

  Returns:
    (loss, metrics): metrics is a flat dict of scalars, including "loss/sum" and "loss/count".
  """
  logp, logq, mask, advantages = _checked_inputs(
    logp, logq, advantages, mask, loss, ref_logp, entropy, token_weight
  )
  aggregation, max_len = loss.aggregation, loss.max_len
  valid = mask.astype(bool)
  logp32 = logp.astype(jnp.float32)
  # The behaviour log-prob is floored as in the estimators: log p <= 0, so log r <= 80 and r stays a
  # finite float32 (an unfloored q < 1e-38 gives r = inf, and a masked token 0 * inf = NaN).
  logq32 = jnp.maximum(logq.astype(jnp.float32), ests.LOG_PROB_FLOOR)
  log_ratio, seq_log_ratio = _log_ratio(logp32, logq32, valid, loss.ratio_level)
  ratio = jnp.exp(log_ratio)
  ratio_sg = jax.lax.stop_gradient(ratio)
  estimate = _divergence_estimate(logp32, logq32, seq_log_ratio, loss, estimator_kwargs)
  trust = _trust_region(estimate, ratio_sg, advantages, valid, loss)
  per_token_policy = _policy_term(log_ratio, ratio, trust["keep"], advantages, loss, token_weight)
  per_token = per_token_policy

  metrics: dict[str, Array] = {}
  if loss.kl_coef:
    # k3 estimate of KL(pi || ref) on samples from (approximately) pi.
    log_ref_ratio = jnp.asarray(ref_logp, jnp.float32) - logp32
    kl_ref = jnp.expm1(log_ref_ratio) - log_ref_ratio
    per_token = per_token + loss.kl_coef * kl_ref
    metrics["loss/kl_ref"] = aggregate_terms(kl_ref, valid, aggregation, max_len)
  if loss.entropy_coef:
    ent = jnp.asarray(entropy, jnp.float32)
    per_token = per_token - loss.entropy_coef * ent
    metrics["loss/entropy"] = aggregate_terms(ent, valid, aggregation, max_len)

  total_sum, count = aggregate_terms(per_token, valid, aggregation, max_len)
  denom = jnp.maximum(count, 1.0) if normalizer is None else jnp.asarray(normalizer, jnp.float32)
  value = total_sum / denom

  policy_sum, _ = aggregate_terms(per_token_policy, valid, aggregation, max_len)
  out_metrics = {
    "loss/total": value,
    "loss/policy": jax.lax.stop_gradient(policy_sum / jnp.maximum(count, 1.0)),
    "loss/sum": jax.lax.stop_gradient(total_sum),
    "loss/count": count,
    **_trust_metrics(trust, estimate, ratio_sg, valid),
  }
  for key, (s, c) in metrics.items():
    out_metrics[key] = jax.lax.stop_gradient(s / jnp.maximum(c, 1.0))
  return value, out_metrics


def _checked_inputs(logp, logq, advantages, mask, loss, ref_logp, entropy, token_weight):
  """(logp, logq, mask, advantages [B, 1] or [B, T] float32) as arrays, after checking that
  `policy_loss`'s inputs agree with each other and with `loss` (ValueError / TypeError)."""
  if not isinstance(loss, LossConfig):
    raise TypeError(
      f"policy_loss takes a LossConfig, got {type(loss).__name__}: "
      "policy_loss(logp, logq, adv, mask, LossConfig(divergence=..., estimator=..., delta_low=...))"
    )
  if loss.kl_coef and ref_logp is None:
    raise ValueError(f"kl_coef = {loss.kl_coef} needs ref_logp (the reference policy's log-probs)")
  if loss.entropy_coef and entropy is None:
    raise ValueError(f"entropy_coef = {loss.entropy_coef} needs entropy (per-token entropies)")
  logp = jnp.asarray(logp)
  logq = jnp.asarray(logq)
  mask = jnp.asarray(mask)
  if logp.ndim != 2 or logp.shape != logq.shape or logp.shape != mask.shape:
    raise ValueError(
      "logp, logq and mask must all be [batch, tokens]; got "
      f"{logp.shape}, {jnp.shape(logq)}, {jnp.shape(mask)}"
    )
  advantages = jnp.asarray(advantages, jnp.float32)
  if advantages.shape == logp.shape[:1]:
    advantages = advantages[:, None]
  elif advantages.shape != logp.shape:
    raise ValueError(
      f"advantages must be [batch] or [batch, tokens] = {logp.shape}, got {advantages.shape}"
    )
  for name, arr in (("ref_logp", ref_logp), ("entropy", entropy), ("token_weight", token_weight)):
    if arr is not None and jnp.shape(arr) != logp.shape:
      raise ValueError(f"{name} must have shape {logp.shape}, got {jnp.shape(arr)}")
  return logp, logq, mask, advantages


def _log_ratio(logp32, logq32, valid, ratio_level: str) -> tuple[Array, Array | None]:
  """(log r [B, T], which carries the gradient of log p; the sequence log-ratio [B, 1] at
  ratio_level "sequence", else None)."""
  log_ratio = logp32 - jax.lax.stop_gradient(logq32)
  if ratio_level != "sequence":
    return log_ratio, None
  # GSPO-token: the value s_i = exp(mean_t l_t) on every token of response i, the gradient
  # s_i grad log p_t of the token's own log-prob. log p is floored like log q, so every l_t and
  # their mean lie in [-80, 80] and s_i is a finite float32; padding enters neither (its log p
  # may be -inf, and -inf - -inf would be NaN).
  logp_valid = jnp.where(valid, jnp.maximum(logp32, ests.LOG_PROB_FLOOR), 0.0)
  seq_log_ratio = jax.lax.stop_gradient(sequence_log_ratio(logp_valid - logq32, valid)[:, None])
  return seq_log_ratio + logp_valid - jax.lax.stop_gradient(logp_valid), seq_log_ratio


def _divergence_estimate(logp32, logq32, seq_log_ratio, loss, estimator_kwargs) -> Array:
  """The per-token divergence estimate [B, T] the trust region compares with its radii (no
  gradient)."""
  div = divs.get(loss.divergence)
  est_fn = ests.get(loss.estimator)
  if seq_log_ratio is not None:
    # The estimate of the whole response: f(s_i), MC on the sequence ratio (log q = 0 stands for
    # "log p - log q is the sequence's log-ratio"; the estimator floors it at -80 like any other).
    seq_l = jnp.broadcast_to(seq_log_ratio, logp32.shape)
    return jax.lax.stop_gradient(est_fn(div, seq_l, jnp.zeros_like(seq_l)))
  return jax.lax.stop_gradient(
    est_fn(div, jax.lax.stop_gradient(logp32), logq32, **(estimator_kwargs or {}))
  )


def _trust_region(estimate, ratio_sg, advantages, valid, loss) -> dict[str, Array]:
  """The tokens the trust region (and the dual clip) mask: bool [B, T] "out_low", "out_high",
  "out" (all masked), "out_dual" (with loss.dual_clip), and "keep", float32 1 - out."""
  delta_low, delta_high = loss.radii
  out_low, out_high = trust_region_out(estimate, ratio_sg, advantages, valid, delta_low, delta_high)
  trust = {"out_low": out_low, "out_high": out_high}
  out = out_high | out_low
  if loss.dual_clip is not None:
    trust["out_dual"] = (advantages < 0) & (ratio_sg > loss.dual_clip) & valid
    out = out | trust["out_dual"]
  trust["out"] = out
  trust["keep"] = jax.lax.stop_gradient(1.0 - out.astype(jnp.float32))
  return trust


def _policy_term(log_ratio, ratio, keep, advantages, loss, token_weight) -> Array:
  """The surrogate's per-token policy term -keep * w * A [B, T], w the ratio (capped at
  loss.ratio_cap), times the constant token_weight where given."""
  if loss.ratio_cap is not None:
    # Value min(r, C), gradient min(r, C) * grad log p (r is s_i at the sequence level). The
    # carrier of the gradient is floored so that p = 0 (log r = -inf) gives 0, not -inf - -inf.
    carrier = jnp.maximum(log_ratio, 2.0 * ests.LOG_PROB_FLOOR)
    ratio_sg = jax.lax.stop_gradient(ratio)
    weight = jnp.minimum(ratio_sg, loss.ratio_cap) * jnp.exp(
      carrier - jax.lax.stop_gradient(carrier)
    )
  else:
    weight = ratio
  per_token = -keep * weight * advantages
  if token_weight is not None:
    per_token = per_token * jax.lax.stop_gradient(jnp.asarray(token_weight, jnp.float32))
  return per_token


def _trust_metrics(trust, estimate, ratio_sg, valid) -> dict[str, Array]:
  """The trust region's, the estimate's and the ratio's metrics over the valid tokens."""
  n_tok = jnp.sum(valid.astype(jnp.float32))
  share = lambda x: jnp.sum(x) / jnp.maximum(n_tok, 1.0)
  metrics = {
    "trust/masked_frac": share(trust["out"] & valid),
    "trust/masked_frac_high": share(trust["out_high"]),
    "trust/masked_frac_low": share(trust["out_low"]),
    "div/estimate_mean": _masked_mean(estimate, valid, n_tok),
    "div/estimate_max": jnp.max(jnp.where(valid, estimate, 0.0)),
    "ratio/mean": _masked_mean(ratio_sg, valid, n_tok),
    "ratio/max": jnp.max(jnp.where(valid, ratio_sg, 0.0)),
    "ratio/min": jnp.where(n_tok > 0, jnp.min(jnp.where(valid, ratio_sg, jnp.inf)), 1.0),
    "tokens/count": n_tok,
  }
  if "out_dual" in trust:
    metrics["trust/dual_clip_frac"] = share(trust["out_dual"])
  return metrics
