"""rollout.staleness: rollouts from a policy that lags the learner, resumed exactly."""

import glob
import json
import os
import shutil

import conftest
import jax
import numpy as np
import pytest
from test_train import load_config

from gppo_jax import config_lib, errors, evaluate, train

LAG = 2


def stale_config(iterations):
  c = load_config("kl_atomic.py", "smoke,task=add1")
  c.rollout.staleness = LAG
  c.iterations = iterations
  c.checkpoint.every = 1
  c.checkpoint.keep = 10
  c.eval.every = 1  # a run's last iteration is evaluated: so is every one, in each run compared
  c.diagnostics.every = 1
  return c


def rows(workdir):
  out = []
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    row = json.loads(line)
    out.append({k: v for k, v in row.items() if k != "time" and not k.startswith("time/")})
  return out


def saved(workdir, step, item):
  path = os.path.join(workdir, "checkpoints", str(step), item)
  return conftest.read_checkpoint_item(path)


def assert_same(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b) > 0
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)


def test_stale_rollouts_lag_the_learner_and_resume_exactly(tmp_path):
  whole = str(tmp_path / "whole")
  train.train_and_evaluate(stale_config(3), whole)
  got = rows(whole)[1:]  # row 0 is the initial evaluation
  assert [r["rollout/behaviour_lag"] for r in got] == [0, 1, 2]
  first = [r["div/estimate_mean_first"] for r in got]
  # Iteration 0 samples with the learner itself: its first step is on-policy, the divergence is
  # float noise. From iteration 1 on the behaviour is an earlier policy: even the first step is
  # off-policy, by what the updates in between moved it.
  assert first[0] < 1e-9 and min(first[1:]) > 1e3 * max(first[0], 1e-9), first
  assert got[0]["trust/masked_frac_first"] == 0.0
  # The diagnostics at the start of each update see the same lag: the exact divergence between
  # the behaviour and the learner before its first step is float noise at iteration 0 only.
  start = [r["diag_start/exact/mean"] for r in got]
  assert start[0] < 1e-6 and min(start[1:]) > 1e-6, start
  assert all(r["diag/exact/mean"] > r["diag_start/exact/mean"] for r in got[:1])
  assert "diag_start/ratio_hist" not in got[1] and "diag_start/mc/mask_agree" in got[1]

  # The checkpoint holds the lagging policies: at step 3 the parameters before updates 2 and 3,
  # i.e. the learner's parameters saved at steps 1 and 2, oldest first.
  behaviour = saved(whole, 3, "behaviour")
  assert len(behaviour) == LAG
  for lagging, step in zip(behaviour, (1, 2), strict=True):
    assert_same(lagging, saved(whole, step, "state")["params"])

  # Stopped after 1 iteration and resumed: the same run, row for row and bit for bit (a resume
  # that sampled with the resumed learner instead of the saved lagging policies would differ).
  parts = str(tmp_path / "parts")
  train.train_and_evaluate(stale_config(1), parts)
  train.train_and_evaluate(stale_config(3), parts)
  assert rows(parts) == rows(whole)
  assert_same(saved(parts, 3, "state"), saved(whole, 3, "state"))
  assert_same(saved(parts, 3, "behaviour"), behaviour)

  # Evaluation reads the train state alone; the lagging policies do not get in its way.
  report = evaluate.evaluate_checkpoint(stale_config(3), whole)
  assert report["source"]["step"] == 3

  # Checkpoints without the lagging policies (a run trained with another rollout.staleness)
  # are not silently resumed with the learner standing in for them.
  shutil.copytree(whole, tmp_path / "other")
  for step in glob.glob(str(tmp_path / "other" / "checkpoints" / "*" / "behaviour")):
    shutil.rmtree(step)
  with pytest.raises(errors.CheckpointError, match="rollout.staleness"):
    train.train_and_evaluate(stale_config(4), str(tmp_path / "other"))


def test_staleness_is_validated():
  c = stale_config(3)
  c.rollout.staleness = -1
  with pytest.raises(errors.ConfigError, match="rollout.staleness"):
    config_lib.validate(c)


def test_plan_counts_the_lagging_copies():
  from gppo_jax import plan

  c = stale_config(3)
  c.rollout.staleness = 0
  on_policy = plan.plan(c, compile=False, backend="cpu")
  c.rollout.staleness = LAG
  stale = plan.plan(c, compile=False, backend="cpu")
  assert stale.params == (1 + LAG) * on_policy.params > 0
  assert any("rollout.staleness" in note for note in stale.notes)


def test_recomputed_anchor_is_the_learner_at_the_start_of_the_update(tmp_path):
  """rollout.recompute_logprobs with stale rollouts: the trust region is centred on the learner
  before each update (decoupled PPO), not on the lagging policy that sampled, and the correction
  weights pi_old / mu carry the lag."""
  c = stale_config(3)
  c.rollout.recompute_logprobs = True
  c.rollout.correction = "tis"
  c.diagnostics.every = 0
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  got = rows(workdir)[1:]
  # Every update starts at its anchor: the first step's ratios are 1 up to the two programs'
  # numerics, so nothing is masked, though from iteration 1 on the sampler lagged (the
  # uncentred run's first-step divergence is > 1e3 x float noise there: the test above).
  first = [r["div/estimate_mean_first"] for r in got]
  assert max(first) < 1e-6 and all(r["trust/masked_frac_first"] == 0.0 for r in got), first
  # The gap between the anchor and the sampler: numerics at iteration 0 (mu is the learner),
  # the updates in between from iteration 1 on; the weights move off 1 with it.
  gap = [r["mismatch/abs_log_ratio_mean"] for r in got]
  assert gap[0] < 1e-4 and min(gap[1:]) > 100 * max(gap[0], 1e-7), gap
  weights = [r["correction/weight_mean"] for r in got]
  assert abs(weights[0] - 1) < 1e-4 and min(abs(w - 1) for w in weights[1:]) > 1e-4, weights
