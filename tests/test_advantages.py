"""Group-relative advantages against numpy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gppo_jax import advantages


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
