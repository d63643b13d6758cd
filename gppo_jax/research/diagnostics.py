"""Estimator diagnostics: every per-token estimator against the exact divergence.

The figures and what they mean: docs/math.md#diagnostics.

For the response tokens of a rollout batch, with the behaviour policy mu and the current policy pi
(in rollout.logprobs_mode "sampled" both renormalised over each token's recorded kept set, the
distributions the loss compares):

  exact        D_f(pi || mu) = sum_a mu(a) f(pi(a) / mu(a)) over the full vocabulary (the kept
               set), per state (`estimators.exact_from_logits`), for the loss's divergence and
               optionally others;
  estimators   mc, binary, atomic (topk when the batch carries mu's top-K ids, and any other
               registered per-token estimator) on the same sampled tokens; per estimator the bias
               (mean of estimate - exact), the variance of that error, the correlation with exact,
               and how often its mask decision (`objective.trust_region_out`) agrees with the mask
               the exact divergence would give;
  masks        masked fraction by advantage side and by behaviour-probability bucket
               (q < 0.1, 0.1-0.5, 0.5-0.9, >= 0.9) for every estimator and for exact;
  policy       mean entropy of pi (and of mu) and a histogram of log r over fixed bins.

`token_stats_chunked` walks the sequence in chunks (as `heads.chunked_logprob_stats` does), so
the [B, T, V] logits never exist at once; `summarize` turns per-token arrays into the flat dict of
metrics; `make_diagnostics_fn` composes both with the model forward into one jitted
fn(params_behaviour, params_current, batch) -> {"diag/...": value}.

`python -m gppo_jax.research.diagnostics plot WORKDIR --out FILE.png` draws estimate vs exact per
estimator from the diag/* rows of WORKDIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gppo_jax import cli, errors
from gppo_jax.algorithm import divergences as divs
from gppo_jax.algorithm import estimators as ests
from gppo_jax.algorithm import objective
from gppo_jax.data import readers
from gppo_jax.models import attention as attention_lib
from gppo_jax.models import heads

Array = jax.Array

PAPER_DIVERGENCES = ("tv", "kl", "hellinger", "chi2")
# Behaviour-probability buckets [lo, hi): together they partition (0, 1].
Q_BUCKETS = (
  ("q<0.1", 0.0, 0.1),
  ("q0.1-0.5", 0.1, 0.5),
  ("q0.5-0.9", 0.5, 0.9),
  ("q>=0.9", 0.9, math.inf),
)
# Inner edges of the log-ratio histogram; bin i holds edges[i-1] <= log r < edges[i], with the
# first and last bins open (so len(LOG_RATIO_EDGES) + 1 bins).
LOG_RATIO_EDGES = (-2.0, -1.0, -0.5, -0.2, -0.1, -0.05, -0.02, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# Estimators that are not per-token functions of (logp, logq) and are handled apart.
_SPECIAL = ("exact", "topk")


# --- Per-token statistics from logits ----------------------------------------------------------


def token_stats_from_logits(
  logits_p: Array,
  logits_q: Array,
  targets: Array,
  *,
  divergences: Sequence[str | divs.Divergence] = ("kl",),
  temperature: float = 1.0,
  gather_ids: Array | None = None,
  kept_ids: Array | None = None,
) -> dict[str, Array]:
  """Per-token statistics of pi = softmax(logits_p / T) and mu = softmax(logits_q / T).

  Args:
    logits_p, logits_q: [B, T, V] logits of the current and the behaviour policy.
    targets: int [B, T] the sampled tokens.
    divergences: the divergences whose exact value is computed.
    gather_ids: optional int [B, T, K] (mu's top-K ids) whose log-probs are gathered.
    kept_ids: optional int [B, T, W], the behaviour's kept set of each token (-1 = no id;
      rollout.logprobs_mode "sampled"): both policies are then renormalised over that set, the
      distributions the loss compares (`train_step.truncate_to_kept`); positions with no id keep
      the full vocabulary.

  Returns float32 arrays: "logp", "logq", "entropy" (of pi), "entropy_behaviour" (of mu) [B, T];
  "exact/<name>" [B, T] per divergence; with gather_ids, "topk_logp", "topk_logq" [B, T, K]
  (-inf for ids outside the kept set).
  """
  zp = jnp.asarray(logits_p, jnp.float32) / temperature
  zq = jnp.asarray(logits_q, jnp.float32) / temperature
  if kept_ids is not None:
    in_set = kept_set_mask(kept_ids, zp.shape[-1])
    zp = jnp.where(in_set, zp, -jnp.inf)
    zq = jnp.where(in_set, zq, -jnp.inf)
  lp = jax.nn.log_softmax(zp, axis=-1)
  lq = jax.nn.log_softmax(zq, axis=-1)
  ids = jnp.asarray(targets)[..., None]
  # 0 log 0 = 0 outside a kept set (exp(-inf) * -inf would be NaN).
  plogp = lambda l: jnp.where(l > -jnp.inf, jnp.exp(l) * l, 0.0)
  out = {
    "logp": jnp.take_along_axis(lp, ids, axis=-1)[..., 0],
    "logq": jnp.take_along_axis(lq, ids, axis=-1)[..., 0],
    "entropy": -jnp.sum(plogp(lp), axis=-1),
    "entropy_behaviour": -jnp.sum(plogp(lq), axis=-1),
  }
  for div in divergences:
    div = divs.get(div)
    out[f"exact/{div.name}"] = ests.exact_from_logits(div, zp, zq)
  if gather_ids is not None:
    out["topk_logp"] = jnp.take_along_axis(lp, gather_ids, axis=-1)
    out["topk_logq"] = jnp.take_along_axis(lq, gather_ids, axis=-1)
  return out


def kept_set_mask(kept_ids: Array, vocab: int) -> Array:
  """bool [..., V]: True on the ids of kept_ids [..., W] (-1 = no id); a position with no id at
  all (a padding token) is True everywhere, i.e. keeps the full vocabulary."""
  kept_ids = jnp.asarray(kept_ids)
  valid = kept_ids >= 0
  lead = kept_ids.shape[:-1]
  flat_ids = jnp.where(valid, kept_ids, 0).reshape(-1, kept_ids.shape[-1])
  rows = jnp.arange(flat_ids.shape[0])[:, None]
  # Scatter-max, so that the -1 placeholders (sent to id 0) never clear a kept id 0.
  hits = jnp.zeros((flat_ids.shape[0], vocab), jnp.int32)
  hits = hits.at[rows, flat_ids].max(valid.reshape(flat_ids.shape).astype(jnp.int32))
  return (hits > 0).reshape(*lead, vocab) | ~jnp.any(valid, axis=-1)[..., None]


def token_stats_chunked(
  hidden_p: Array,
  w_p: Array,
  hidden_q: Array,
  w_q: Array,
  targets: Array,
  *,
  tied: bool = False,
  temperature: float = 1.0,
  divergences: Sequence[str | divs.Divergence] = ("kl",),
  chunk_size: int = 16,
  gather_ids: Array | None = None,
  kept_ids: Array | None = None,
  softcap: float | None = None,
) -> dict[str, Array]:
  """`token_stats_from_logits` from final hidden states and unembeddings, chunk by chunk
  (logits soft-capped at `softcap`, the model's final_softcap, as its head does).

  hidden_p, hidden_q [B, T, D]; w_p, w_q [D, V] ([V, D] if tied); targets int [B, T]; gather_ids
  int [B, T, K]; kept_ids int [B, T, W] (see there). The sequence is cut into chunks of
  `chunk_size` positions; each chunk's [B, chunk, V] logits of both policies are built and
  dropped inside one `lax.scan` step.
  """
  if hidden_p.shape != hidden_q.shape or hidden_p.shape[:2] != jnp.shape(targets):
    raise ValueError(
      f"hidden states {hidden_p.shape} / {hidden_q.shape} and targets {jnp.shape(targets)} "
      "must be [B, T, D] and [B, T]"
    )
  B, T = jnp.shape(targets)
  C = max(1, min(chunk_size, T))
  n = -(-T // C)
  pad = n * C - T

  def chunks(x: Array) -> Array:
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(B, n, C, *x.shape[2:]).swapaxes(0, 1)

  xs = {"hp": chunks(hidden_p), "hq": chunks(hidden_q), "t": chunks(jnp.asarray(targets))}
  if gather_ids is not None:
    xs["g"] = chunks(jnp.asarray(gather_ids))
  if kept_ids is not None:
    xs["k"] = jnp.pad(jnp.asarray(kept_ids), ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    xs["k"] = xs["k"].reshape(B, n, C, -1).swapaxes(0, 1)

  def step(_, x):
    stats = token_stats_from_logits(
      # as the model's head computes them
      attention_lib.soft_cap(heads.head_logits(x["hp"], w_p, tied), softcap),
      attention_lib.soft_cap(heads.head_logits(x["hq"], w_q, tied), softcap),
      x["t"],
      divergences=divergences,
      temperature=temperature,
      gather_ids=x.get("g"),
      kept_ids=x.get("k"),
    )
    return None, stats

  _, outs = jax.lax.scan(step, None, xs)
  return {k: a.swapaxes(0, 1).reshape(B, n * C, *a.shape[3:])[:, :T] for k, a in outs.items()}


# --- Estimators on the sampled tokens ----------------------------------------------------------


def per_token_estimator_names(divergence: str | divs.Divergence = "kl") -> list[str]:
  """Registered estimators computable from (logp, logq) alone (not exact, not topk).

  Each candidate is traced once on dummy inputs; one that needs more arguments is left out.
  """
  div = divs.get(divergence)
  zero = jax.ShapeDtypeStruct((1,), jnp.float32)
  names = []
  for name in ests.names():
    if name in _SPECIAL:
      continue
    fn = ests.get(name)
    try:
      jax.eval_shape(lambda a, b, fn=fn: fn(div, a, b), zero, zero)
    except TypeError:
      continue
    names.append(name)
  return names


def estimator_values(
  divergence: str | divs.Divergence,
  logp: Array,
  logq: Array,
  names: Sequence[str | ests.EstimatorFn],
  *,
  topk: Mapping[str, Array] | None = None,
) -> dict[str, Array]:
  """{name: [B, T] estimate} of D_f(pi || mu) on the sampled tokens, per estimator.

  topk: topk_logp, topk_logq, topk_ids [B, T, K] and tokens [B, T]; with it, "topk" is added.
  A callable in `names` is keyed by its __name__.
  """
  div = divs.get(divergence)
  out = {}
  for name in names:
    key = name if isinstance(name, str) else getattr(name, "__name__", "estimator")
    if key == "topk":
      continue
    out[key] = ests.get(name)(div, logp, logq)
  if topk is not None:
    out["topk"] = ests.topk(div, logp, logq, **topk)
  return out


# --- From per-token arrays to metrics ----------------------------------------------------------


def _frac(x: Array, among: Array) -> Array:
  return jnp.sum(x & among) / jnp.maximum(jnp.sum(among), 1.0)


def _mean(x: Array, valid: Array, n: Array) -> Array:
  return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n, 1.0)


def bucket_masks(logq: Array, valid: Array) -> dict[str, Array]:
  """{bucket name: bool [B, T]}: the valid tokens whose q = exp(logq) lies in each Q_BUCKETS
  interval [lo, hi); every valid token is in exactly one."""
  q = jnp.exp(jnp.asarray(logq, jnp.float32))
  return {name: valid & (q >= lo) & (q < hi) for name, lo, hi in Q_BUCKETS}


def ratio_histogram(log_ratio: Array, valid: Array) -> Array:
  """float32 [len(LOG_RATIO_EDGES) + 1] counts of the valid tokens' log r per bin."""
  edges = jnp.asarray(LOG_RATIO_EDGES, jnp.float32)
  idx = jnp.searchsorted(edges, log_ratio.ravel(), side="right")
  return (
    jnp.zeros(len(LOG_RATIO_EDGES) + 1, jnp.float32).at[idx].add(valid.ravel().astype(jnp.float32))
  )


def summarize(
  estimates: Mapping[str, Array],
  exact: Array,
  logp: Array,
  logq: Array,
  advantages: Array,
  mask: Array,
  *,
  delta_low: float | Array,
  delta_high: float | Array | None = None,
  loss_estimator: str | None = None,
  prefix: str = "diag",
) -> dict[str, Array]:
  """The estimator and mask figures of one batch.

  Args:
    estimates: {name: [B, T]} per-token estimates (`estimator_values`).
    exact: [B, T] the exact D_f(pi || mu) of each token's state.
    logp, logq: [B, T] the sampled tokens' log-probs under pi and mu.
    advantages: [B] or [B, T]; mask: [B, T], True for response tokens.
    delta_low, delta_high: the trust region's radii (delta_high None: delta_low).
    loss_estimator: the estimator the loss uses; its mask figures are repeated as
      "<prefix>/masked_frac...".

  Returns {key: scalar} with, for every estimator e: <prefix>/<e>/{mean, bias, err_var, corr,
  mask_agree, overmask, undermask}; for every e and for "exact": <prefix>/<e>/masked_frac and
  /masked_frac/{pos, neg, <bucket>}; <prefix>/exact/{mean, max}; <prefix>/tokens/{count, pos, neg,
  <bucket>} (fractions of the valid tokens); <prefix>/log_ratio/{mean, min, max, sum, sum_sq} and
  <prefix>/ratio_hist (counts, [len(LOG_RATIO_EDGES) + 1]). corr is NaN when either side has
  zero variance (e.g. pi = mu).
  """
  delta_high = delta_low if delta_high is None else delta_high
  valid = jnp.asarray(mask).astype(bool)
  logp = jnp.asarray(logp, jnp.float32)
  logq = jnp.maximum(jnp.asarray(logq, jnp.float32), ests.LOG_PROB_FLOOR)
  exact = jnp.asarray(exact, jnp.float32)
  adv = jnp.asarray(advantages, jnp.float32)
  if adv.shape == logp.shape[:1]:
    adv = adv[:, None]
  adv = jnp.broadcast_to(adv, logp.shape)
  # The loss's ratio (objective.policy_loss): the same float32 exp, so ties at r = 1 agree.
  log_ratio = logp - logq
  ratio = jnp.exp(log_ratio)
  n = jnp.sum(valid.astype(jnp.float32))
  sides = {"pos": valid & (adv > 0), "neg": valid & (adv < 0)}
  buckets = bucket_masks(logq, valid)

  def masked(est: Array) -> Array:
    low, high = objective.trust_region_out(est, ratio, adv, valid, delta_low, delta_high)
    return low | high

  out_exact = masked(exact)
  m: dict[str, Array] = {
    f"{prefix}/tokens/count": n,
    f"{prefix}/exact/mean": _mean(exact, valid, n),
    f"{prefix}/exact/max": jnp.max(jnp.where(valid, exact, 0.0)),
  }
  for name, sel in {**sides, **buckets}.items():
    m[f"{prefix}/tokens/{name}"] = jnp.sum(sel) / jnp.maximum(n, 1.0)

  def mask_figures(name: str, out: Array) -> None:
    m[f"{prefix}/{name}/masked_frac"] = _frac(out, valid)
    for sel_name, sel in {**sides, **buckets}.items():
      m[f"{prefix}/{name}/masked_frac/{sel_name}"] = _frac(out, sel)

  mask_figures("exact", out_exact)
  mx = m[f"{prefix}/exact/mean"]
  var_x = _mean((exact - mx) ** 2, valid, n)
  for name, est in estimates.items():
    est = jnp.asarray(est, jnp.float32)
    err = est - exact
    bias = _mean(err, valid, n)
    me = _mean(est, valid, n)
    var_e = _mean((est - me) ** 2, valid, n)
    cov = _mean((est - me) * (exact - mx), valid, n)
    denom = var_e * var_x
    out = masked(est)
    m[f"{prefix}/{name}/mean"] = me
    m[f"{prefix}/{name}/bias"] = bias
    m[f"{prefix}/{name}/err_var"] = _mean((err - bias) ** 2, valid, n)
    m[f"{prefix}/{name}/corr"] = jnp.where(
      denom > 0, cov / jnp.sqrt(jnp.where(denom > 0, denom, 1.0)), jnp.nan
    )
    m[f"{prefix}/{name}/mask_agree"] = _frac(out == out_exact, valid)
    m[f"{prefix}/{name}/overmask"] = _frac(out & ~out_exact, valid)
    m[f"{prefix}/{name}/undermask"] = _frac(~out & out_exact, valid)
    mask_figures(name, out)
  if loss_estimator is not None and loss_estimator in estimates:
    head = f"{prefix}/{loss_estimator}/masked_frac"
    for key in [k for k in m if k.startswith(head)]:
      m[f"{prefix}/masked_frac" + key[len(head) :]] = m[key]
  big = jnp.finfo(jnp.float32).max
  m[f"{prefix}/log_ratio/mean"] = _mean(log_ratio, valid, n)
  m[f"{prefix}/log_ratio/min"] = jnp.where(n > 0, jnp.min(jnp.where(valid, log_ratio, big)), 0.0)
  m[f"{prefix}/log_ratio/max"] = jnp.where(n > 0, jnp.max(jnp.where(valid, log_ratio, -big)), 0.0)
  m[f"{prefix}/log_ratio/sum"] = jnp.sum(jnp.where(valid, log_ratio, 0.0))
  m[f"{prefix}/log_ratio/sum_sq"] = jnp.sum(jnp.where(valid, log_ratio**2, 0.0))
  m[f"{prefix}/ratio_hist"] = ratio_histogram(log_ratio, valid)
  return m


def diagnostics_from_stats(
  stats: Mapping[str, Array],
  advantages: Array,
  mask: Array,
  loss: objective.LossConfig,
  *,
  estimator_names: Sequence[str | ests.EstimatorFn] | None = None,
  tokens: Array | None = None,
  topk_ids: Array | None = None,
  prefix: str = "diag",
) -> dict[str, Array]:
  """`summarize` of the statistics of `token_stats_from_logits` / `token_stats_chunked`.

  Computes every estimator in `estimator_names` (default: every registered per-token one, plus
  the loss's own) for the loss's divergence; "topk" is added when stats carry "topk_logp" (then
  `tokens` [B, T] and `topk_ids` [B, T, K] are needed). Adds <prefix>/entropy,
  <prefix>/entropy_behaviour and <prefix>/exact/<div>/mean for every exact divergence in stats.
  """
  div = divs.get(loss.divergence)
  names = list(per_token_estimator_names(div) if estimator_names is None else estimator_names)
  loss_est = loss.estimator
  if loss_est not in names and not (isinstance(loss_est, str) and loss_est in _SPECIAL):
    names.append(loss_est)
  topk = None
  if "topk_logp" in stats:
    if tokens is None or topk_ids is None:
      raise ValueError("the top-K statistics need tokens [B, T] and topk_ids [B, T, K]")
    topk = dict(
      topk_logp=stats["topk_logp"], topk_logq=stats["topk_logq"], topk_ids=topk_ids, tokens=tokens
    )
  estimates = estimator_values(div, stats["logp"], stats["logq"], names, topk=topk)
  key = f"exact/{div.name}"
  if key not in stats:
    raise ValueError(f"stats lack {key!r}: pass the loss's divergence to the token statistics")
  loss_name = loss_est if isinstance(loss_est, str) else getattr(loss_est, "__name__", None)
  if loss.ratio_level != "token":
    # The per-token masks here are not the loss's own, which masks whole responses by their
    # sequence ratio (its masked share is the update's trust/masked_frac).
    loss_name = None
  delta_low, delta_high = loss.radii
  m = summarize(
    estimates,
    stats[key],
    stats["logp"],
    stats["logq"],
    advantages,
    mask,
    delta_low=delta_low,
    delta_high=delta_high,
    loss_estimator=loss_name,
    prefix=prefix,
  )
  valid = jnp.asarray(mask).astype(bool)
  n = jnp.sum(valid.astype(jnp.float32))
  for name in ("entropy", "entropy_behaviour"):
    m[f"{prefix}/{name}"] = _mean(stats[name], valid, n)
  for k, v in stats.items():
    if k.startswith("exact/"):
      m[f"{prefix}/{k}/mean"] = _mean(v, valid, n)
  return m


# --- The jitted entry point --------------------------------------------------------------------


def _field(batch: Any, name: str) -> Any:
  """batch[name] of a dict batch or batch.name of a dataclass batch; None when absent."""
  if isinstance(batch, Mapping):
    return batch.get(name)
  return getattr(batch, name, None)


def make_diagnostics_fn(
  graphdef: nnx.GraphDef,
  *,
  prompt_len: int,
  temperature: float,
  loss_config: objective.LossConfig,
  divergences: Sequence[str] = (),
  estimator_names: Sequence[str] | None = None,
  chunk_size: int = 16,
  prefix: str = "diag",
) -> Callable[[Any, Any, Mapping[str, Array]], dict[str, Array]]:
  """jit(params_behaviour, params_current, batch) -> {"<prefix>/...": metric} for a rollout batch.

  batch: the update's rollout batch (`train_step`; a dict or a dataclass with these fields):
  inputs, targets, positions, attn [N, L], mask [N, R], adv [N]; optional topk_ids [N, R, K]
  (adds the topk estimator), kept_ids [N, R, W] (rollout.logprobs_mode "sampled": both policies
  renormalised over each token's kept set, as in the loss, so "exact" is D_f between the
  truncated distributions and the entropies are theirs) and logq [N, R] (the sampler's record,
  compared with the recomputed one as <prefix>/behaviour_logq_gap).
  mu is recomputed from params_behaviour with the trainer's forward pass, so the exact divergence
  and every estimate see the same behaviour distribution. `divergences`: extra divergences whose
  exact mean is logged (e.g. PAPER_DIVERGENCES). `chunk_size`: response positions per chunk of
  [N, chunk, V] logits. Keys: see `summarize` and `diagnostics_from_stats`.
  """
  div = divs.get(loss_config.divergence)
  all_divs = [div.name] + [d for d in (divs.get(x).name for x in divergences) if d != div.name]
  names = list(per_token_estimator_names(div) if estimator_names is None else estimator_names)

  def response_hidden(params, batch):
    model = nnx.merge(graphdef, params)
    hidden = model(
      _field(batch, "inputs"), _field(batch, "positions"), attn_mask=_field(batch, "attn")
    ).hidden
    w, tied = model.unembedding()
    return hidden[:, prompt_len - 1 :], w, (tied, model.cfg.final_softcap)

  @jax.jit
  def diagnostics(params_behaviour, params_current, batch):
    hq, w_q, (tied, softcap) = response_hidden(params_behaviour, batch)
    hp, w_p, _ = response_hidden(params_current, batch)
    targets = _field(batch, "targets")[:, prompt_len - 1 :]
    topk_ids = _field(batch, "topk_ids")
    stats = token_stats_chunked(
      jax.lax.stop_gradient(hp),
      jax.lax.stop_gradient(w_p),
      jax.lax.stop_gradient(hq),
      jax.lax.stop_gradient(w_q),
      targets,
      tied=tied,
      temperature=temperature,
      divergences=all_divs,
      chunk_size=chunk_size,
      gather_ids=topk_ids,
      kept_ids=_field(batch, "kept_ids"),
      softcap=softcap,
    )
    m = diagnostics_from_stats(
      stats,
      _field(batch, "adv"),
      _field(batch, "mask"),
      loss_config,
      estimator_names=names,
      tokens=targets,
      topk_ids=topk_ids,
      prefix=prefix,
    )
    if _field(batch, "logq") is not None:
      valid = jnp.asarray(_field(batch, "mask")).astype(bool)
      gap = jnp.abs(stats["logq"] - jnp.asarray(_field(batch, "logq"), jnp.float32))
      m[f"{prefix}/behaviour_logq_gap"] = jnp.max(jnp.where(valid, gap, 0.0))
    return m

  return diagnostics


def tensorboard_histogram(metrics: Mapping[str, Any], prefix: str = "diag") -> dict[str, Any]:
  """Keyword arguments of tensorboardX's `SummaryWriter.add_histogram_raw` for the log-ratio
  histogram in `metrics` (the output of a diagnostics fn, fetched to host)."""
  counts = np.asarray(metrics[f"{prefix}/ratio_hist"], np.float64)
  lo = float(metrics[f"{prefix}/log_ratio/min"])
  hi = float(metrics[f"{prefix}/log_ratio/max"])
  # The open outer bins end at the observed extremes (bucket limits are right edges).
  limits = list(LOG_RATIO_EDGES) + [max(hi, LOG_RATIO_EDGES[-1] + 1.0)]
  return {
    "min": lo,
    "max": hi,
    "num": float(counts.sum()),
    "sum": float(metrics[f"{prefix}/log_ratio/sum"]),
    "sum_squares": float(metrics[f"{prefix}/log_ratio/sum_sq"]),
    "bucket_limits": limits,
    "bucket_counts": counts.tolist(),
  }


# --- Plot from a run's logs --------------------------------------------------------------------


def read_diag_rows(path: str, prefix: str = "diag") -> list[dict[str, float]]:
  """The rows of a metrics.jsonl (or a workdir holding one) that carry <prefix>/exact/mean, with
  values as floats ("nan" / "inf" strings included); a torn last line is skipped."""
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  if not os.path.isfile(path):
    raise errors.MissingFileError(f"no metrics file at {path}")
  rows = []
  for row in readers.metric_rows(path):
    if f"{prefix}/exact/mean" not in row:
      continue
    clean = {}
    for k, v in row.items():
      try:
        clean[k] = float(v)
      except (TypeError, ValueError):
        continue
    rows.append(clean)
  if not rows:
    raise errors.UserError(
      f"{path} has no rows with {prefix}/exact/mean: was the run logged with diagnostics on?"
    )
  return rows


def logged_estimators(rows: Sequence[Mapping[str, float]], prefix: str = "diag") -> list[str]:
  """Estimator names with a <prefix>/<name>/bias figure in any row, in first-seen order."""
  names: list[str] = []
  for row in rows:
    for k in row:
      parts = k.split("/")
      if len(parts) == 3 and parts[0] == prefix and parts[2] == "bias" and parts[1] not in names:
        names.append(parts[1])
  return names


def plot_estimate_vs_exact(
  rows: Sequence[Mapping[str, float]], out: str, prefix: str = "diag"
) -> list[str]:
  """One panel per estimator (its batch-mean estimate against the exact batch mean, one point per
  logged row, coloured by step, with the line y = x) and one of mask agreement over steps.
  Writes a PNG to `out`; returns the estimators drawn."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = logged_estimators(rows, prefix)
  if not names:
    raise errors.UserError(f"no {prefix}/<estimator>/bias figures in the rows")
  cols = len(names) + 1
  fig, axes = plt.subplots(1, cols, figsize=(4.2 * cols, 4.0), squeeze=False)
  steps = np.array([row.get("step", i) for i, row in enumerate(rows)], np.float64)
  exact = np.array([row.get(f"{prefix}/exact/mean", np.nan) for row in rows])
  for ax, name in zip(axes[0], names, strict=False):
    est = np.array([row.get(f"{prefix}/{name}/mean", np.nan) for row in rows])
    ok = np.isfinite(est) & np.isfinite(exact)
    sc = ax.scatter(exact[ok], est[ok], c=steps[ok], cmap="viridis", s=14)
    top = max(float(np.max(exact[ok], initial=0.0)), float(np.max(est[ok], initial=0.0)), 1e-12)
    ax.plot([0.0, top], [0.0, top], color="0.5", lw=1, ls="--", label="y = x")
    bias = np.nanmean([row.get(f"{prefix}/{name}/bias", np.nan) for row in rows])
    agree = np.nanmean([row.get(f"{prefix}/{name}/mask_agree", np.nan) for row in rows])
    ax.set_title(f"{name}: mean bias {bias:.3g}, mask agreement {agree:.3f}", fontsize=9)
    ax.set_xlabel("exact D_f, batch mean")
    ax.set_ylabel(f"{name} estimate, batch mean")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.colorbar(sc, ax=ax, label="step")
  ax = axes[0][-1]
  for i, name in enumerate(names):
    agree = np.array([row.get(f"{prefix}/{name}/mask_agree", np.nan) for row in rows])
    ax.plot(steps, agree, marker=".", color=f"C{i}", label=name)
  ax.set_xlabel("step")
  ax.set_ylabel("mask agreement with exact")
  ax.set_title("mask decision agreement with the exact divergence", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return names


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m gppo_jax.research.diagnostics",
    description="Estimator diagnostics of a run's logs.",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  plot = sub.add_parser("plot", help="draw estimate vs exact per estimator from metrics.jsonl")
  plot.add_argument("workdir", help="a run's workdir (or its metrics.jsonl)")
  plot.add_argument("--out", default=None, help="PNG path (default WORKDIR/diagnostics.png)")
  plot.add_argument("--prefix", default="diag", help="the metrics' key prefix (default diag)")
  args = parser.parse_args(argv)
  out = args.out or os.path.join(
    args.workdir if os.path.isdir(args.workdir) else os.path.dirname(args.workdir) or ".",
    "diagnostics.png",
  )
  try:
    rows = read_diag_rows(args.workdir, args.prefix)
    names = plot_estimate_vs_exact(rows, out, args.prefix)
  except errors.UserError as err:
    cli.fail(str(err))
  print(f"wrote {os.path.abspath(out)} ({len(rows)} rows; estimators: {', '.join(names)})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
