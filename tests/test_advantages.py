"""Group-relative advantages against numpy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gppo_jax.algorithm import advantages


def rewards():
  rng = np.random.default_rng(0)
  r = rng.integers(0, 2, size=(6, 8)).astype(np.float32)
  r[0] = 1.0  # all correct: no signal
  r[1] = 0.0  # all wrong: no signal
  r[2] = rng.normal(size=8)
  return r


def test_grpo_unbiased_std():
  r = rewards()
  got = np.asarray(advantages.grpo(r))
  want = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(got[:2] == 0)  # constant groups give exactly zero, not nan
  got0 = np.asarray(advantages.grpo(r, ddof=0, eps=1e-4))
  want0 = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)
  np.testing.assert_allclose(got0, want0, rtol=1e-5, atol=1e-6)


def test_dr_grpo_rloo_batch_std():
  r = rewards()
  np.testing.assert_allclose(advantages.dr_grpo(r), r - r.mean(1, keepdims=True), atol=1e-6)
  g = r.shape[1]
  loo = np.stack([r[:, i] - np.delete(r, i, axis=1).mean(1) for i in range(g)], axis=1)
  np.testing.assert_allclose(advantages.rloo(r), loo, rtol=1e-5, atol=1e-6)
  want = (r - r.mean(1, keepdims=True)) / (r.std(ddof=1) + 1e-6)
  np.testing.assert_allclose(advantages.batch_std(r), want, rtol=1e-5, atol=1e-6)


def test_zero_signal_groups_and_registry():
  r = rewards()
  sig = np.asarray(advantages.signal_mask(r))
  assert not sig[0] and not sig[1] and sig[2]
  want = sum(1 for row in r if np.all(row == row[0]))
  assert int(advantages.zero_signal_groups(r)) == want
  adv, m = advantages.compute("grpo", r)
  assert int(m["adv/zero_signal_groups"]) == want
  chex.assert_shape(adv, r.shape)
  jitted = jax.jit(lambda x: advantages.compute("rloo", x)[0])(jnp.asarray(r))
  np.testing.assert_allclose(jitted, advantages.rloo(r), rtol=1e-6)


def test_errors():
  with pytest.raises(ValueError, match="valid names: grpo, dr_grpo, rloo, batch_std"):
    advantages.get("gae")
  with pytest.raises(ValueError, match=r"\[num_groups, group_size\]"):
    advantages.grpo(np.zeros(8))
  with pytest.raises(ValueError, match="group_size 1 too small"):
    advantages.grpo(np.zeros((4, 1)))


class RandomRewardsTest(chex.TestCase):
  """Identities of every estimator over random reward draws, with and without jit."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_identities_over_random_rewards(self):
    rng = np.random.default_rng(1)
    fns = {name: self.variant(advantages.get(name)) for name in advantages.names()}
    for group_size in (2, 8):
      r = rng.normal(size=(64, group_size)) * rng.uniform(0.1, 10.0, (64, 1))
      r[::5] = np.round(r[::5])  # ties
      r[::9] = 3.0  # constant groups: no signal
      r = r.astype(np.float32)
      adv = {name: np.asarray(fn(jnp.asarray(r)), np.float64) for name, fn in fns.items()}
      centred = r - r.mean(1, keepdims=True)
      std = r.std(1, ddof=1, keepdims=True)
      for name, a in adv.items():
        chex.assert_shape(a, r.shape)
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a.sum(1), 0.0, atol=1e-4, err_msg=name)  # centred per group
        np.testing.assert_array_equal(a[::9], 0.0, err_msg=name)  # constant group: exactly 0
      np.testing.assert_allclose(adv["dr_grpo"], centred, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(adv["grpo"], centred / (std + 1e-6), rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(
        adv["rloo"], centred * group_size / (group_size - 1), rtol=1e-5, atol=1e-5
      )
      np.testing.assert_allclose(
        adv["batch_std"], centred / (r.std(ddof=1) + 1e-6), rtol=1e-4, atol=1e-5
      )
      # grpo is invariant to a positive affine map of the rewards (up to eps).
      shifted = np.asarray(fns["grpo"](jnp.asarray(2.5 * r - 7.0)), np.float64)
      signal = np.asarray(advantages.signal_mask(r))
      np.testing.assert_allclose(shifted[signal], adv["grpo"][signal], rtol=1e-3, atol=1e-3)
