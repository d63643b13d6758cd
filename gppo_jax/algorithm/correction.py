"""The rollout/trainer mismatch and its corrections (docs/math.md#rollout-correction).

The sampler's log-probs log mu(a_t) and the trainer's log-probs of the same policy, log pi_old(a_t),
differ by numerics (other kernels, batch shapes, precision). With `rollout.recompute_logprobs` the
update anchors its ratio on pi_old; the tokens were still drawn from mu, so the surrogate is off by
the importance weight rho_t = pi_old(a_t) / mu(a_t). The corrections, per token or per sequence
(rho_seq = prod_t rho_t over the response's counted tokens), all computed in log space:

  none  no correction (the metrics are still reported);
  tis   truncated importance sampling: the policy term of each token is weighted by min(rho, C);
  mis   masked importance sampling: tokens (or whole sequences) whose rho leaves [1/C, C] drop out
        of the loss.

Pure numpy: the correction is decided once per rollout batch, on the host, before the update.
"""

from __future__ import annotations

import numpy as np

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


def log_ratio(logq_trainer: np.ndarray, logq_sampler: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """log rho_t = log pi_old(a_t) - log mu(a_t) [B, T], 0 where `mask` is False (padding may hold
  -inf or garbage log-probs)."""
  mask = np.asarray(mask, bool)
  diff = np.asarray(logq_trainer, np.float64) - np.asarray(logq_sampler, np.float64)
  return np.where(mask, np.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0), 0.0)


def mismatch_metrics(
  logq_trainer: np.ndarray, logq_sampler: np.ndarray, mask: np.ndarray, threshold: float
) -> dict[str, float]:
  """mismatch/* scalars over the counted tokens: mean and max |log rho|, the share of tokens with
  |log rho| > `threshold`, and the mean and max |log rho_seq| of the sequences."""
  mask = np.asarray(mask, bool)
  lr = log_ratio(logq_trainer, logq_sampler, mask)
  absl = np.abs(lr)
  n = max(int(mask.sum()), 1)
  seq = np.abs(lr.sum(axis=-1))[mask.any(axis=-1)]
  return {
    "mismatch/abs_log_ratio_mean": float(absl.sum() / n),
    "mismatch/abs_log_ratio_max": float(absl.max(initial=0.0)),
    "mismatch/frac_beyond": float((absl > threshold).sum() / n),
    "mismatch/seq_abs_log_ratio_mean": float(seq.mean()) if seq.size else 0.0,
    "mismatch/seq_abs_log_ratio_max": float(seq.max(initial=0.0)),
  }


def _level_log_ratio(lr: np.ndarray, mask: np.ndarray, level: str) -> np.ndarray:
  if level == "token":
    return lr
  if level == "sequence":
    return np.broadcast_to(lr.sum(axis=-1, keepdims=True), lr.shape)
  raise ValueError(f"unknown correction level {level!r}; valid: {', '.join(LEVELS)}")


def correct(
  logq_trainer: np.ndarray,
  logq_sampler: np.ndarray,
  mask: np.ndarray,
  *,
  method: str,
  level: str = "token",
  cap: float = 2.0,
) -> tuple[np.ndarray, np.ndarray | None, dict[str, float]]:
  """(mask, weight, metrics) of a correction.

  mask [B, T] bool: the loss mask after `mis` (unchanged otherwise); weight [B, T] float32: the
  truncated importance weights min(rho, C) of `tis` on counted tokens (0 elsewhere), None for the
  other methods; metrics: correction/* (the share of counted tokens masked or truncated, the mean
  weight).
  """
  if method not in CORRECTIONS:
    raise ValueError(f"unknown rollout correction {method!r}; valid: {', '.join(CORRECTIONS)}")
  if not cap > 1.0:
    raise ValueError(f"the correction's cap C must be > 1, got {cap}")
  mask = np.asarray(mask, bool)
  n = max(int(mask.sum()), 1)
  if method == "none":
    return mask, None, {}
  lr = _level_log_ratio(log_ratio(logq_trainer, logq_sampler, mask), mask, level)
  log_cap = float(np.log(cap))
  if method == "tis":
    weight = np.where(mask, np.exp(np.minimum(lr, log_cap)), 0.0).astype(np.float32)
    return (
      mask,
      weight,
      {
        "correction/truncated_frac": float(((lr > log_cap) & mask).sum() / n),
        "correction/weight_mean": float(weight.sum() / n),
      },
    )
  keep = mask & (np.abs(lr) <= log_cap)
  return keep, None, {"correction/masked_frac": float((mask & ~keep).sum() / n)}
