"""Estimator diagnostics (research/diagnostics.py, docs/math.md#diagnostics): the exact divergence
against numpy, MC's unbiasedness, mask agreement, the q buckets, chunking, the model path and
the plot command."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from gppo_jax.algorithm import estimators, objective
from gppo_jax.research import diagnostics as dg
from gppo_jax.trainer import metric_writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Compiled once per input structure: op-by-op dispatch of its many small reductions is slower.
summarize = jax.jit(dg.summarize, static_argnames=("loss_estimator", "prefix"))

NP_F = {
  "tv": lambda t: 0.5 * np.abs(t - 1),
  "kl": lambda t: t - 1 - np.log(t),
  "hellinger": lambda t: (np.sqrt(t) - 1) ** 2,
  "chi2": lambda t: (t - 1) ** 2,
}


def np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def random_logits(rng, shape, vocab, shift=0.6):
  lq = rng.normal(size=shape + (vocab,)) * 1.5
  lp = lq + rng.normal(size=shape + (vocab,)) * shift
  return lp.astype(np.float32), lq.astype(np.float32)


def test_token_stats_equal_a_brute_force_numpy_computation():
  rng = np.random.default_rng(0)
  lp, lq = random_logits(rng, (3, 5), 9)
  targets = rng.integers(0, 9, (3, 5))
  temp = 0.7
  stats = dg.token_stats_from_logits(
    lp, lq, targets, divergences=dg.PAPER_DIVERGENCES, temperature=temp
  )
  logp = np_log_softmax(lp.astype(np.float64) / temp)
  logq = np_log_softmax(lq.astype(np.float64) / temp)
  p, q = np.exp(logp), np.exp(logq)
  for name, f in NP_F.items():
    want = np.sum(q * f(p / q), axis=-1)
    np.testing.assert_allclose(stats[f"exact/{name}"], want, rtol=1e-4, atol=1e-6, err_msg=name)
  pick = lambda x: np.take_along_axis(x, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(stats["logp"], pick(logp), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stats["logq"], pick(logq), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stats["entropy"], -np.sum(p * logp, -1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stats["entropy_behaviour"], -np.sum(q * logq, -1), rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_unchunked(tied):
  rng = np.random.default_rng(1)
  B, T, D, V, K = 2, 7, 8, 11, 3
  hp = rng.normal(size=(B, T, D)).astype(np.float32)
  hq = hp + 0.3 * rng.normal(size=(B, T, D)).astype(np.float32)
  wp = rng.normal(size=(V, D) if tied else (D, V)).astype(np.float32)
  wq = wp + 0.2 * rng.normal(size=wp.shape).astype(np.float32)
  targets = rng.integers(0, V, (B, T))
  gather = rng.integers(0, V, (B, T, K))
  proj = "btd,vd->btv" if tied else "btd,dv->btv"
  want = dg.token_stats_from_logits(
    np.einsum(proj, hp, wp),
    np.einsum(proj, hq, wq),
    targets,
    divergences=("kl", "chi2"),
    temperature=0.8,
    gather_ids=gather,
  )
  for chunk in (3, 50):  # padded (3 does not divide 7) and longer than the sequence
    got = jax.jit(
      lambda hp, wp, hq, wq, c=chunk: dg.token_stats_chunked(
        hp,
        wp,
        hq,
        wq,
        targets,
        tied=tied,
        temperature=0.8,
        divergences=("kl", "chi2"),
        chunk_size=c,
        gather_ids=gather,
      )
    )(hp, wp, hq, wq)
    assert set(got) == set(want)
    for k in want:
      assert got[k].shape == want[k].shape, k
      np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"{k} @ {chunk}")


def sampled_tokens(rng, n, vocab, shift):
  """n states with their own (pi, mu) over `vocab` actions, one action a ~ mu per state;
  returns float64 probabilities [n, vocab] and the sampled action [n]."""
  lp, lq = random_logits(rng, (n,), vocab, shift)
  p, q = (
    np.exp(np_log_softmax(lp.astype(np.float64))),
    np.exp(np_log_softmax(lq.astype(np.float64))),
  )
  u = rng.uniform(size=(n, 1))
  a = np.minimum((np.cumsum(q, -1) < u).sum(-1), vocab - 1)
  return p, q, a


def test_mc_bias_is_near_zero_on_a_large_sample_and_atomic_bias_is_not():
  """mc is unbiased (E_{a ~ mu} f(r) = D_f): over 40000 sampled tokens its bias lies within
  5 standard errors of 0; atomic = q f(r) has mean sum_a mu^2 f(r) < D_f, clearly negative."""
  rng = np.random.default_rng(2)
  n = 40000
  p, q, a = sampled_tokens(rng, n, vocab=6, shift=0.5)
  exact = np.sum(q * NP_F["kl"](p / q), -1)
  logp = np.log(p[np.arange(n), a])[None].astype(np.float32)
  logq = np.log(q[np.arange(n), a])[None].astype(np.float32)
  est = dg.estimator_values("kl", logp, logq, ["mc", "atomic", "binary"])
  m = summarize(est, exact[None], logp, logq, np.ones(1), np.ones((1, n), bool), delta_low=0.02)
  se = lambda e: np.sqrt(float(m[f"diag/{e}/err_var"]) / n)
  assert abs(float(m["diag/mc/bias"])) < 5 * se("mc"), (float(m["diag/mc/bias"]), se("mc"))
  assert float(m["diag/atomic/bias"]) < -20 * se("atomic")
  assert float(m["diag/binary/bias"]) < 0  # binary <= D_f token by token
  assert float(m["diag/mc/corr"]) > 0.1
  np.testing.assert_allclose(float(m["diag/exact/mean"]), exact.mean(), rtol=1e-4)


def random_tokens(rng, b=6, t=40, scale=0.3):
  logq = np.log(rng.uniform(0.01, 1.0, (b, t))).astype(np.float32)
  logp = np.minimum(logq + scale * rng.normal(size=(b, t)), 0.0).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  adv[0] = 0.0  # a zero-advantage sequence is never masked
  mask = np.arange(t)[None] < rng.integers(5, t + 1, (b, 1))
  return logp, logq, adv, mask


def test_mask_agreement_is_one_when_the_estimator_equals_exact():
  rng = np.random.default_rng(3)
  logp, logq, adv, mask = random_tokens(rng)
  mc = np.asarray(estimators.estimate("kl", "mc", logp, logq))
  # A stand-in for the exact divergence that differs from mc on many tokens.
  exact = np.asarray(estimators.estimate("kl", "binary", logp, logq)) * 1.5
  delta = float(np.median(exact[mask]))
  m = summarize(
    {"same": exact, "mc": mc}, exact, logp, logq, adv, mask, delta_low=delta, delta_high=delta
  )
  assert float(m["diag/same/mask_agree"]) == 1.0
  assert float(m["diag/same/overmask"]) == 0.0 and float(m["diag/same/undermask"]) == 0.0
  assert float(m["diag/same/bias"]) == 0.0 and float(m["diag/same/err_var"]) == 0.0
  np.testing.assert_allclose(float(m["diag/same/corr"]), 1.0, atol=1e-5)
  for k in [k for k in m if k.startswith("diag/exact/masked_frac")]:
    assert float(m[k.replace("/exact/", "/same/")]) == float(m[k]), k
  assert 0 < float(m["diag/exact/masked_frac"]) < 1
  # A different estimator disagrees somewhere; the three outcomes add up to 1.
  assert float(m["diag/mc/mask_agree"]) < 1.0
  total = sum(float(m[f"diag/mc/{k}"]) for k in ("mask_agree", "overmask", "undermask"))
  np.testing.assert_allclose(total, 1.0, atol=1e-6)


def test_q_buckets_partition_the_tokens():
  rng = np.random.default_rng(4)
  logp, logq, adv, mask = random_tokens(rng, b=4, t=30)
  # Exact bucket edges, certainty and tiny probabilities included.
  edges = np.log(np.array([0.1, 0.5, 0.9, 1.0, 1e-30, 0.0999999, 0.9000001], np.float32))
  logq[1, : len(edges)] = edges
  mask[1, : len(edges)] = True
  buckets = dg.bucket_masks(logq, mask)
  count = sum(np.asarray(b, int) for b in buckets.values())
  np.testing.assert_array_equal(count, mask.astype(int))  # each valid token in exactly one
  delta = 0.01
  m = summarize(
    {"atomic": estimators.estimate("kl", "atomic", logp, logq)},
    estimators.estimate("kl", "mc", logp, logq),
    logp,
    logq,
    adv,
    mask,
    delta_low=delta,
    loss_estimator="atomic",
  )
  names = [b[0] for b in dg.Q_BUCKETS]
  np.testing.assert_allclose(sum(float(m[f"diag/tokens/{b}"]) for b in names), 1.0, atol=1e-6)
  assert float(m["diag/tokens/count"]) == mask.sum()
  for est in ("atomic", "exact"):
    # The per-bucket masked fractions, weighted by the bucket sizes, give the total.
    total = sum(
      float(m[f"diag/{est}/masked_frac/{b}"]) * float(m[f"diag/tokens/{b}"]) for b in names
    )
    np.testing.assert_allclose(total, float(m[f"diag/{est}/masked_frac"]), atol=1e-6)
    sides = sum(float(m[f"diag/{est}/masked_frac/{s}"]) * float(m[f"diag/tokens/{s}"])
                for s in ("pos", "neg"))  # fmt: skip
    np.testing.assert_allclose(sides, float(m[f"diag/{est}/masked_frac"]), atol=1e-6)
  assert float(m["diag/masked_frac/q<0.1"]) == float(m["diag/atomic/masked_frac/q<0.1"])
  np.testing.assert_allclose(float(np.sum(m["diag/ratio_hist"])), mask.sum())


@pytest.mark.parametrize(
  "loss",
  [
    objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.002),
    objective.LossConfig(divergence="tv", estimator="mc", delta_low=0.05, delta_high=0.08),
    objective.LossConfig(divergence="chi2", estimator="binary", delta_low=0.01),
  ],
)
def test_masked_fractions_are_the_losses(loss):
  """The loss estimator's mask is the one objective.policy_loss applies."""
  rng = np.random.default_rng(5)
  logp, logq, adv, mask = random_tokens(rng)
  _, lm = objective.policy_loss(logp, logq, adv, mask, loss)
  est = dg.estimator_values(loss.divergence, logp, logq, [loss.estimator])
  lo, hi = loss.radii
  m = summarize(
    est, est[loss.estimator], logp, logq, adv, mask, delta_low=lo, delta_high=hi,
    loss_estimator=loss.estimator,
  )  # fmt: skip
  assert float(lm["trust/masked_frac"]) > 0
  np.testing.assert_allclose(float(m["diag/masked_frac"]), float(lm["trust/masked_frac"]))
  high = float(m["diag/masked_frac/pos"]) * float(m["diag/tokens/pos"])
  low = float(m["diag/masked_frac/neg"]) * float(m["diag/tokens/neg"])
  np.testing.assert_allclose(high, float(lm["trust/masked_frac_high"]), atol=1e-6)
  np.testing.assert_allclose(low, float(lm["trust/masked_frac_low"]), atol=1e-6)


def tiny_policy_batch(n=8, prompt_len=5, resp_len=6, k=4, seed=0):
  from flax import nnx

  from gppo_jax.models import architectures
  from gppo_jax.models import model as model_lib

  cfg = architectures.get("char-tiny", vocab_size=32)
  graphdef, params = nnx.split(model_lib.create(cfg, seed=seed))
  rng = np.random.default_rng(seed)
  full = rng.integers(3, 32, (n, prompt_len + resp_len)).astype(np.int32)
  attn = np.ones_like(full, bool)
  attn[::2, :2] = False  # left padding
  resp_mask = np.arange(resp_len)[None] < rng.integers(2, resp_len + 1, (n, 1))
  attn[:, prompt_len:] = resp_mask
  pos = np.maximum(np.cumsum(attn, 1) - 1, 0).astype(np.int32)
  batch = {
    "inputs": full[:, :-1],
    "targets": full[:, 1:],
    "positions": pos[:, :-1],
    "attn": attn[:, :-1],
    "mask": resp_mask,
    "adv": rng.normal(size=n).astype(np.float32),
    "topk_ids": rng.integers(0, 32, (n, resp_len, k)).astype(np.int32),
  }
  moved = jax.tree.map(lambda x: x + 0.3 * rng.normal(size=x.shape).astype(x.dtype), params)
  return graphdef, params, moved, batch, prompt_len


def test_make_diagnostics_fn_on_a_tiny_policy(tmp_path):
  from flax import nnx

  graphdef, params, moved, batch, prompt_len = tiny_policy_batch()
  temp = 0.9
  loss = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.002)
  fn = dg.make_diagnostics_fn(
    graphdef,
    prompt_len=prompt_len,
    temperature=temp,
    loss_config=loss,
    divergences=dg.PAPER_DIVERGENCES,
    chunk_size=4,
  )

  @jax.jit
  def dense_stats(params_p, params_q):
    out = []
    for prm in (params_p, params_q):
      model = nnx.merge(graphdef, prm)
      hidden = model(batch["inputs"], batch["positions"], attn_mask=batch["attn"]).hidden
      out.append(model.logits(hidden[:, prompt_len - 1 :]))
    targets = batch["targets"][:, prompt_len - 1 :]
    return dg.token_stats_from_logits(
      *out, targets, divergences=dg.PAPER_DIVERGENCES, temperature=temp
    )

  # pi = mu: every divergence and estimate is 0, nothing is masked, correlation is undefined.
  same = dense_stats(params, params)
  m0 = fn(params, params, {**batch, "logq": same["logq"]})
  for key in ("exact/mean", "mc/mean", "atomic/mean", "binary/mean", "topk/mean", "masked_frac"):
    assert abs(float(m0[f"diag/{key}"])) < 1e-6, key
  assert np.isnan(float(m0["diag/mc/corr"]))
  assert float(m0["diag/behaviour_logq_gap"]) < 1e-5
  assert float(m0["diag/atomic/mask_agree"]) == 1.0

  m = fn(params, moved, {**batch, "logq": same["logq"]})
  want = dense_stats(moved, params)
  valid = batch["mask"]
  for name in dg.PAPER_DIVERGENCES:
    np.testing.assert_allclose(
      float(m[f"diag/exact/{name}/mean"]), want[f"exact/{name}"][valid].mean(), rtol=1e-4
    )
  np.testing.assert_allclose(float(m["diag/entropy"]), want["entropy"][valid].mean(), rtol=1e-5)
  assert float(m["diag/exact/mean"]) > 1e-3
  assert float(m["diag/exact/mean"]) == float(m["diag/exact/kl/mean"])
  # atomic <= binary <= topk <= exact token by token, so their biases are ordered and <= 0.
  biases = [float(m[f"diag/{e}/bias"]) for e in ("atomic", "binary", "topk")]
  assert biases[0] <= biases[1] <= biases[2] <= 1e-6, biases
  for e in ("mc", "binary", "atomic", "topk"):
    for suffix in ("corr", "err_var", "mask_agree", "masked_frac/q<0.1", "masked_frac/neg"):
      assert f"diag/{e}/{suffix}" in m
  assert float(np.sum(m["diag/ratio_hist"])) == valid.sum()
  # The histogram's fields are what tensorboardX's histogram_raw takes: the trainer's writer
  # puts it in an event file, and the event read back holds it.
  from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

  hist = dg.tensorboard_histogram(jax.device_get(m))
  assert len(hist["bucket_limits"]) == len(hist["bucket_counts"]) and hist["num"] == valid.sum()
  w = metric_writers.MetricWriter(str(tmp_path), total_steps=1, enabled=True, progress=False)
  w.histogram(3, "diag/log_ratio", hist)
  w.close()
  (path,) = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
  got = []
  for event in LegacyEventFileLoader(path).Load():  # the events as written
    got += [(event.step, v.tag, v.histo.num) for v in event.summary.value]
  assert got == [(3, "diag/log_ratio", valid.sum())]


def fake_metrics(path, rows=6):
  rng = np.random.default_rng(6)
  with open(path, "w") as fh:
    fh.write(json.dumps({"step": 0, "reward/mean": 0.3}) + "\n")
    for step in range(1, rows + 1):
      exact = 0.01 * step
      row = {"step": step, "diag/exact/mean": exact}
      for e, scale in (("mc", 1.0), ("binary", 0.6), ("atomic", 0.3)):
        row[f"diag/{e}/mean"] = exact * scale + 1e-3 * rng.normal()
        row[f"diag/{e}/bias"] = exact * (scale - 1)
        row[f"diag/{e}/mask_agree"] = 0.9 + 0.01 * rng.uniform()
        row[f"diag/{e}/corr"] = "nan" if step == 1 else 0.8
      fh.write(json.dumps(row) + "\n")
    fh.write('{"step": 99, "diag/exact/me')  # a torn last line


def test_plot_command_draws_every_estimator(tmp_path, capsys):
  fake_metrics(tmp_path / "metrics.jsonl")
  rows = dg.read_diag_rows(str(tmp_path))
  assert len(rows) == 6 and np.isnan(rows[0]["diag/mc/corr"])
  assert dg.logged_estimators(rows) == ["mc", "binary", "atomic"]
  out = tmp_path / "plots" / "diag.png"
  assert dg.main(["plot", str(tmp_path), "--out", str(out)]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
  assert "mc, binary, atomic" in capsys.readouterr().out


def test_plot_command_line(tmp_path, capsys):
  fake_metrics(tmp_path / "metrics.jsonl")
  env = {**os.environ, "PYTHONPATH": REPO}
  ok = subprocess.run(
    [sys.executable, "-m", "gppo_jax.research.diagnostics", "plot", str(tmp_path)],
    capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
  )  # fmt: skip
  assert ok.returncode == 0, ok.stderr
  assert (tmp_path / "diagnostics.png").stat().st_size > 10_000
  # A workdir without diagnostics rows, or none at all, is a user error: one line, exit 2.
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
  for path, words in ((tmp_path, "diag/exact/mean"), (tmp_path / "missing", "no metrics file")):
    with pytest.raises(SystemExit) as exc:
      dg.main(["plot", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error:") and words in err, err
