"""GSPO and CISPO as cells of the GPPO loss (docs/math.md#gspo, #cispo): losses and gradients
against plain numpy versions of the published formulas, edge cases, selection by config, cell=,
the sweep, and a few training iterations of each."""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config

from gppo_jax import config_lib, errors, sweep, train
from gppo_jax.algorithm import objective, presets

GSPO_EPS = (3e-4, 4e-4)  # (eps_low, eps_high) of the published GSPO runs
CISPO_EPS_HIGH = 0.28


def lengths_mask(rng, b, t):
  """[b, t] response masks of lengths 1..t, row 2 empty (a response with no counted token)."""
  mask = np.arange(t)[None] < rng.integers(1, t + 1, (b, 1))
  mask[2] = False
  return mask


# --- numpy references of the published formulas (float64) ----------------------------------------


def gspo_reference(logp, logq, adv, mask, eps_low, eps_high):
  """GSPO-token (Zheng et al. 2025) over the G rows with tokens:

    loss = -(1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it)

  s_it has the value s_i = exp(mean_t log(p_t / q_t)) and the gradient s_i grad log p_t; with one
  advantage per response it is GSPO's sequence loss -(1/G) sum_i min(s_i A_i, clip(s_i) A_i).
  Returns (loss, the analytic gradient by log p, s, the clipped tokens)."""
  logp, logq = np.asarray(logp, np.float64), np.asarray(logq, np.float64)
  m = np.asarray(mask, bool)
  a = np.broadcast_to(np.asarray(adv, np.float64).reshape(len(m), -1), m.shape)
  n = m.sum(1)
  has = n > 0
  s = np.exp(np.where(m, logp - logq, 0.0).sum(1) / np.maximum(n, 1))[:, None]
  clipped_s = np.clip(s, 1 - eps_low, 1 + eps_high)
  per_token = np.minimum(s * a, clipped_s * a)
  per_seq = np.where(m, per_token, 0.0).sum(1) / np.maximum(n, 1)
  loss = -per_seq[has].sum() / has.sum()
  # min picks the constant clip(s) A exactly when A pushes s further beyond its bound.
  clipped = m & (((a > 0) & (s > 1 + eps_high)) | ((a < 0) & (s < 1 - eps_low)))
  grad = np.where(m & ~clipped, -s * a / np.maximum(n, 1)[:, None], 0.0) / has.sum()
  return loss, grad, s[:, 0], clipped


def gspo_sequence_loss(logp, logq, adv, mask, eps_low, eps_high):
  """GSPO's sequence-level loss, float64, without any stop-gradient: finite differences of it are
  an independent reference gradient."""
  m = np.asarray(mask, bool)
  n = m.sum(1)
  has = n > 0
  s = np.exp(np.where(m, logp - logq, 0.0).sum(1) / np.maximum(n, 1))
  a = np.asarray(adv, np.float64)
  obj = np.minimum(s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a)
  return -obj[has].sum() / has.sum()


def cispo_reference(logp, logq, adv, mask, eps_high):
  """CISPO (MiniMax-M1, no lower clip), token-mean over the N counted tokens:

    loss = -(1/N) sum_{i,t} sg[min(r_t, 1 + eps_high)] A_i log p_t

  Returns (that loss, its gradient by log p, the weights min(r, 1 + eps_high))."""
  logp, logq = np.asarray(logp, np.float64), np.asarray(logq, np.float64)
  m = np.asarray(mask, bool)
  a = np.broadcast_to(np.asarray(adv, np.float64).reshape(len(m), -1), m.shape)
  w = np.minimum(np.exp(logp - logq), 1 + eps_high)
  n = max(m.sum(), 1)
  loss = -np.where(m, w * a * logp, 0.0).sum() / n
  return loss, np.where(m, -w * a / n, 0.0), w


def numeric_grad(fn, x, mask, h=1e-6):
  """Central differences of fn (float64) by each counted entry of x."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for idx in zip(*np.nonzero(mask), strict=True):
    up, down = x.copy(), x.copy()
    up[idx] += h
    down[idx] -= h
    g[idx] = (fn(up) - fn(down)) / (2 * h)
  return g


def gspo_batch(seed, b=24, t=12, per_token_adv=False):
  """Log-probs whose sequence ratios fall on both sides of GSPO's tiny clip range, each at least
  2e-6 from either bound (so float32 and float64 agree on every clip decision; a draw with a
  ratio nearer a bound is replaced by the generator's next one)."""
  rng = np.random.default_rng(seed)
  edges = np.array([1 - GSPO_EPS[0], 1 + GSPO_EPS[1]])
  while True:
    mask = lengths_mask(rng, b, t)
    logq = np.log(rng.uniform(0.02, 0.98, (b, t)))
    offset = rng.uniform(-2e-3, 2e-3, (b, 1))
    logp = np.minimum(logq + offset + rng.normal(0, 2e-3, (b, t)), -1e-6)
    adv = rng.normal(size=(b, t) if per_token_adv else (b,))
    logp, logq = logp.astype(np.float32), logq.astype(np.float32)
    _, _, s, _ = gspo_reference(logp, logq, adv, mask, *GSPO_EPS)
    if np.min(np.abs(s[mask.any(1), None] - edges)) > 2e-6:
      return logp, logq, adv.astype(np.float32), mask


def ours(preset, logp, logq, adv, mask, **kw):
  loss = presets.get(preset).loss
  return objective.policy_loss(logp, logq, adv, mask, loss, **kw)


def loss_and_grad(preset, logp, logq, adv, mask):
  fn = lambda lp: ours(preset, lp, logq, adv, mask)[0]
  value, grad = jax.value_and_grad(fn)(jnp.asarray(logp))
  return float(value), np.asarray(grad)


# --- GSPO ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_published_sequence_loss(seed):
  logp, logq, adv, mask = gspo_batch(seed)
  ref_loss, ref_grad, s, clipped = gspo_reference(logp, logq, adv, mask, *GSPO_EPS)
  # The batch has clipped responses on each side and free ones, so the test tells them apart.
  a = adv[:, None] * np.ones(mask.shape)
  assert np.any(clipped & (a > 0)) and np.any(clipped & (a < 0)) and np.any(mask & ~clipped)
  value, grad = loss_and_grad("gspo", logp, logq, adv, mask)
  # The gradient of the published loss, by finite differences (no stop-gradient anywhere).
  fd = numeric_grad(
    lambda lp: gspo_sequence_loss(lp, logq.astype(np.float64), adv, mask, *GSPO_EPS), logp, mask
  )
  np.testing.assert_allclose(ref_grad, fd, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(grad, ref_grad, rtol=2e-5, atol=1e-9)
  assert np.all(grad[~mask] == 0)
  # The value: the published loss less the clipped responses' constants clip(s) A (zero gradient).
  has = mask.any(1)
  const = (
    np.sum(
      np.where(clipped, np.clip(s[:, None], 1 - GSPO_EPS[0], 1 + GSPO_EPS[1]) * a, 0.0).sum(1)
      / np.maximum(mask.sum(1), 1)
    )
    / has.sum()
  )
  assert value == pytest.approx(ref_loss + const, rel=1e-5, abs=1e-7)
  # A response is masked as a whole: each row's tokens are all kept or all stopped.
  for i in np.nonzero(has)[0]:
    g = grad[i][mask[i]]
    assert np.all(g == 0) or np.all(g != 0), i


def test_gspo_token_with_per_token_advantages():
  logp, logq, adv, mask = gspo_batch(3, per_token_adv=True)
  ref_loss, ref_grad, s, clipped = gspo_reference(logp, logq, adv, mask, *GSPO_EPS)
  value, grad = loss_and_grad("gspo", logp, logq, adv, mask)
  np.testing.assert_allclose(grad, ref_grad, rtol=2e-5, atol=1e-9)
  # Here the clip is per token (the sign of each A_it), so rows are partly clipped.
  partly = [i for i in range(len(mask)) if clipped[i].any() and (mask[i] & ~clipped[i]).any()]
  assert partly
  n = np.maximum(mask.sum(1), 1)
  const = np.sum(
    np.where(clipped, np.clip(s[:, None], 1 - GSPO_EPS[0], 1 + GSPO_EPS[1]) * adv, 0.0).sum(1) / n
  )
  assert value == pytest.approx(ref_loss + const / mask.any(1).sum(), rel=1e-5, abs=1e-7)


def test_gspo_ratio_is_length_normalised_and_ignores_padding():
  """The same tokens give the same loss and gradient whatever padding follows them, even padding
  with -inf or positive log-probs; and s_i is the geometric mean of the token ratios."""
  logp, logq, adv, mask = gspo_batch(4)
  value, grad = loss_and_grad("gspo", logp, logq, adv, mask)
  pad = np.array([[-np.inf, 0.0, 5.0]] * len(mask), np.float32)
  logp2 = np.where(mask, logp, -np.inf)
  logp2 = np.concatenate([logp2, pad], 1)
  logq2 = np.concatenate([logq, pad[:, ::-1]], 1)
  mask2 = np.concatenate([mask, np.zeros(pad.shape, bool)], 1)
  value2, grad2 = loss_and_grad("gspo", logp2, logq2, adv, mask2)
  assert value2 == pytest.approx(value, rel=1e-6) and np.all(np.isfinite(grad2))
  np.testing.assert_allclose(grad2[:, : mask.shape[1]], grad, rtol=1e-6)
  assert np.all(grad2[:, mask.shape[1] :] == 0)
  # Every token of row i carries s_i: the logged ratio range is that of the rows' geometric means.
  _, m = ours("gspo", logp, logq, adv, mask)
  _, _, s, _ = gspo_reference(logp, logq, adv, mask, *GSPO_EPS)
  has = mask.any(1)
  assert float(m["ratio/max"]) == pytest.approx(s[has].max(), rel=1e-6)
  assert float(m["ratio/min"]) == pytest.approx(s[has].min(), rel=1e-6)


def test_gspo_gradient_accumulation_is_exact():
  """Micro-batches split by rows, each with the whole batch's normaliser, add up to the batch."""
  logp, logq, adv, mask = gspo_batch(5)
  loss = presets.get("gspo").loss
  full = lambda lp, sl: objective.policy_loss(
    lp, logq[sl], adv[sl], mask[sl], loss, normalizer=count
  )[0]
  _, count = objective.aggregate_terms(jnp.zeros(mask.shape), mask, loss.aggregation)
  whole = jax.grad(lambda lp: full(lp, slice(None)))(jnp.asarray(logp))
  parts = [
    jax.grad(lambda lp, sl=sl: full(lp, sl))(jnp.asarray(logp[sl]))
    for sl in (slice(0, 8), slice(8, None))
  ]
  np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-6, atol=1e-12)


def test_sequence_level_works_for_any_divergence_with_mc():
  """ratio_level="sequence" is a row of the grid: KL-MC masks a response when
  s - 1 - log s > delta on the side A pushes it to."""
  logp, logq, adv, mask = gspo_batch(6)
  delta = 2e-7  # KL-MC of s = 1 +- 6.3e-4
  cfg = objective.LossConfig(
    divergence="kl", estimator="mc", delta_low=delta, ratio_level="sequence"
  )
  grad = np.asarray(
    jax.grad(lambda lp: objective.policy_loss(lp, logq, adv, mask, cfg)[0])(jnp.asarray(logp))
  )
  _, _, s, _ = gspo_reference(logp, logq, adv, mask, *GSPO_EPS)
  a = adv[:, None]
  kl = (s - 1 - np.log(s))[:, None]
  assert np.min(np.abs(kl[mask.any(1)] - delta)) > 1e-2 * delta  # no decision on a knife edge
  out = mask & (kl > delta) & (a * (s[:, None] - 1) > 0)
  assert out.any() and (mask & ~out).any()
  assert np.all(grad[out] == 0) and np.all(grad[mask & ~out] != 0)


# --- CISPO ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_the_published_loss_gradient(seed):
  rng = np.random.default_rng(seed)
  b, t = 8, 20
  mask = lengths_mask(rng, b, t)
  logq = np.log(rng.uniform(0.02, 0.98, (b, t))).astype(np.float32)
  logp = np.minimum(logq + rng.normal(0, 0.6, (b, t)), -1e-6).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  ref_loss, ref_grad, w = cispo_reference(logp, logq, adv, mask, CISPO_EPS_HIGH)
  value, grad = loss_and_grad("cispo", logp, logq, adv, mask)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-9)

  # The published loss written with jax's stop_gradient has the same gradient, though its value
  # carries log p: ours is the importance-weighted advantage, -(1/N) sum w A.
  def literal(lp):
    r = jnp.exp(lp - logq)
    w = jax.lax.stop_gradient(jnp.minimum(r, 1 + CISPO_EPS_HIGH))
    return -jnp.sum(jnp.where(mask, w * adv[:, None] * lp, 0.0)) / jnp.sum(mask)

  np.testing.assert_allclose(grad, np.asarray(jax.grad(literal)(jnp.asarray(logp))), rtol=1e-5)
  assert float(literal(jnp.asarray(logp))) == pytest.approx(ref_loss, rel=1e-5)
  want = -np.sum(np.where(mask, w * adv[:, None], 0.0)) / mask.sum()
  assert value == pytest.approx(want, rel=1e-5, abs=1e-7)
  # No token is masked: the ones PPO's clip would stop keep their capped gradient.
  r = np.exp(logp.astype(np.float64) - logq)
  a = adv[:, None]
  ppo_out = mask & (((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8)))
  assert ppo_out.sum() > 5
  assert np.all(grad[mask & (a != 0)] != 0)
  np.testing.assert_allclose(
    grad[ppo_out & (r > 1.28)], (-1.28 * a / mask.sum() * mask)[ppo_out & (r > 1.28)], rtol=1e-5
  )
  _, m = ours("cispo", logp, logq, adv, mask)
  assert float(m["trust/masked_frac"]) == 0.0


# --- Edge cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["gspo", "cispo"])
def test_empty_masks_give_zero_loss_and_gradient(preset):
  logp = jnp.full((3, 5), -0.5)
  mask = np.zeros((3, 5), bool)
  adv = jnp.ones((3,))
  value, grad = loss_and_grad(preset, logp, logp - 0.3, adv, mask)
  assert value == 0.0 and np.all(grad == 0)
  _, m = ours(preset, logp, logp - 0.3, adv, mask)
  assert all(np.all(np.isfinite(np.asarray(v))) for v in m.values()), m
  assert float(m["tokens/count"]) == 0.0 and float(m["trust/masked_frac"]) == 0.0


@pytest.mark.parametrize("preset", ["gspo", "cispo"])
@pytest.mark.parametrize("bf16", [False, True])
def test_extreme_ratios_and_bf16_stay_finite(preset, bf16):
  """Log-probs of -inf, -1e4, 0 and ratios up to e^80 under either policy: finite loss, metrics
  and gradients; bf16 inputs are computed in float32, so they give the float32 result."""
  extremes = np.array([-np.inf, -1e4, -200.0, -80.0, -30.0, -1e-6, 0.0], np.float32)
  lp, lq = np.meshgrid(extremes, extremes)
  logp = np.concatenate([lp, np.full((2, lp.shape[1]), -0.7, np.float32)])
  logq = np.concatenate([lq, np.full((2, lq.shape[1]), -0.7, np.float32)])
  mask = np.ones(logp.shape, bool)
  mask[-1, 3:] = False
  adv = np.linspace(-2, 2, len(logp)).astype(np.float32)
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  logp_d, logq_d = jnp.asarray(logp, dtype), jnp.asarray(logq, dtype)
  fn = lambda x: ours(preset, x, logq_d, adv, mask)[0]
  value, grad = jax.value_and_grad(fn)(logp_d)
  _, m = ours(preset, logp_d, logq_d, adv, mask)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad, np.float32)))
  assert all(np.all(np.isfinite(np.asarray(v))) for v in m.values()), m
  assert float(m["ratio/max"]) <= math.exp(80) * 1.001
  if bf16:
    f32 = ours(preset, logp_d.astype(jnp.float32), logq_d.astype(jnp.float32), adv, mask)[0]
    assert float(value) == float(f32)


def test_bad_ratio_level_settings_are_named():
  with pytest.raises(ValueError, match="unknown ratio_level 'seq'; valid: token, sequence"):
    objective.LossConfig(divergence="tv", estimator="mc", delta_low=0.1, ratio_level="seq")
  with pytest.raises(ValueError, match="ratio_level='sequence' needs estimator='mc', got 'atomic'"):
    presets.get("gspo").loss.replace(estimator="atomic")
  c = config_lib.cell("kl", "atomic")
  c.loss.ratio_level = "sequence"
  with pytest.raises(errors.ConfigError, match="loss.ratio_level='sequence' needs estimator='mc'"):
    config_lib.validate(c)
  c.loss.ratio_level = "seq"
  with pytest.raises(errors.ConfigError, match=r"loss.ratio_level='seq': must be one of"):
    config_lib.validate(c)
  c = config_lib.cell("kl", "mc")
  c.loss.ratio_level = "sequence"
  config_lib.validate(c)


# --- Selection: presets, config files, cell=, the sweep -----------------------------------------


def test_presets_and_configs_hold_the_published_settings():
  gspo = presets.get("gspo")
  assert (gspo.loss.divergence, gspo.loss.estimator, gspo.loss.ratio_level) == (
    "tv",
    "mc",
    "sequence",
  )
  assert gspo.loss.radii == (GSPO_EPS[0] / 2, GSPO_EPS[1] / 2)  # TV-MC delta = eps / 2
  assert gspo.loss.aggregation == "seq-mean-token-mean" and gspo.advantage == "grpo"
  cispo = presets.get("cispo")
  assert cispo.loss.radii == (math.inf, math.inf) and cispo.loss.ratio_cap == 1 + CISPO_EPS_HIGH
  assert cispo.loss.ratio_level == "token" and cispo.loss.aggregation == "token-mean"
  for name in ("gspo", "cispo"):
    for c in (load_config(f"{name}.py", "smoke"), load_config("qwen3_8b.py", f"cell={name}")):
      config_lib.validate(c)
      assert objective.LossConfig.from_config(c.loss) == presets.get(name).loss.replace(
        delta_high=presets.get(name).loss.radii[1]
      )


def test_sweep_accepts_gspo_and_cispo(tmp_path, capsys):
  assert sweep.parse_cells("gspo,cispo,kl_atomic") == ["gspo", "cispo", "kl_atomic"]
  assert (
    sweep.main(
      [
        "--dry-run",
        "--cells",
        "gspo,cispo",
        "--seeds",
        "0-1",
        "--scales",
        "1,2",
        "--out",
        str(tmp_path),
      ]
    )
    == 0
  )
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2 * 2 * 2  # cells x scales x seeds
  gspo = [x for x in lines if "runs/gspo__own_x2__s1" in x]
  assert len(gspo) == 1
  for flag in (
    "loss.divergence=tv",
    "loss.estimator=mc",
    "loss.delta_low=0.0003",
    "loss.delta_high=0.0004",
    "loss.ratio_level=sequence",
    "loss.aggregation=seq-mean-token-mean",
  ):
    assert f"--config.{flag} " in gspo[0] + " ", flag
  (cispo,) = [x for x in lines if "runs/cispo__own_x1__s0" in x]
  for flag in ("loss.delta_low=inf", "loss.delta_high=inf", "loss.ratio_cap=1.28"):
    assert f"--config.{flag} " in cispo + " ", flag
  assert "ratio_level" not in cispo
  for typo, want in (("gspoo", "gspo"), ("cipso", "cispo"), ("kl_atomc", "kl_atomic")):
    with pytest.raises(errors.UnknownNameError, match=f"did you mean '{want}'"):
      sweep.main(["--dry-run", "--cells", f"tv_mc,{typo}", "--out", str(tmp_path)])


def parse_train_flags(args):
  """The config a `python -m gppo_jax.train` command line builds."""
  from absl import flags
  from ml_collections import config_flags

  fv = flags.FlagValues()
  argv = ["prog", *args]
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_a_sweep_command_trains_a_few_iterations(name, tmp_path):
  """The sweep's command line for the cell builds its loss in train's config, and two training
  iterations of the smoke config on the built-in add1 task run with it."""
  args = sweep.train_args(sweep.Run(0, sweep.OWN, 1.0, name), sweep.Settings(out=str(tmp_path)))
  args[0] += ":smoke,task=add1"
  c = parse_train_flags(args)
  loss = objective.LossConfig.from_config(c.loss)
  assert loss == presets.get(name).loss.replace(delta_high=presets.get(name).loss.radii[1])
  c.iterations = 2
  c.eval.every = 100  # the first and last evaluations only
  c.checkpoint.every = 100
  c.diagnostics.every = 2
  wd = str(tmp_path / "run")
  summary = train.train_and_evaluate(c, wd)
  assert summary["iterations"] == 2
  rows = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))][1:]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert all(math.isfinite(r[k]) for k in ("loss/total", "ratio/max", "optim/grad_norm"))
  saved = json.load(open(os.path.join(wd, "config.json")))["loss"]
  if name == "gspo":
    assert saved["ratio_level"] == "sequence"
    # The loss masks whole responses, so diagnostics report no per-token "loss mask" of their own.
    assert "diag/masked_frac" not in rows[-1] and "diag/mc/masked_frac" in rows[-1]
  else:
    assert saved["ratio_cap"] == 1.28
    assert all(r["trust/masked_frac"] == 0.0 for r in rows)
    assert rows[-1]["diag/masked_frac"] == 0.0
