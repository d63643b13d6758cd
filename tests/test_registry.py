"""gppo_jax.registry: the one table behind the divergence, estimator, advantage and preset names."""

import jax.numpy as jnp
import numpy as np
import pytest

from gppo_jax import errors, registry
from gppo_jax.algorithm import advantages, divergences, estimators, presets


def test_register_get_names_and_errors():
  r = registry.Registry("widget", hint=" or 'w:<n>'")
  assert r.register("a", 1) == 1

  @r.register("b")
  def b():
    return 2

  assert r.get("b") is b and r.names() == ["a", "b"] == list(r) and len(r) == 2
  assert "a" in r and "c" not in r and ["a"] not in r
  with pytest.raises(ValueError, match="widget 'a' is already registered"):
    r.register("a", 3)
  assert r.register("a", 3, overwrite=True) == 3 and r.get("a") == 3
  with pytest.raises(ValueError, match="non-empty string"):
    r.register("", 4)
  with pytest.raises(errors.UnknownNameError) as info:
    r.get("c")
  assert str(info.value) == "unknown widget 'c'; valid names: a, b or 'w:<n>'"
  assert (info.value.kind, info.value.name, info.value.choices) == ("widget", "c", ("a", "b"))


def test_the_package_registries_share_it():
  for module, kind in (
    (divergences, "divergence"),
    (estimators, "estimator"),
    (advantages, "advantage estimator"),
  ):
    assert isinstance(module._REGISTRY, registry.Registry) and module._REGISTRY.kind == kind
  assert presets.PRESETS.kind == "preset" and "ppo" in presets.names()
  assert divergences.names()[:4] == ["tv", "kl", "hellinger", "chi2"]
  assert estimators.names()[:3] == ["mc", "binary", "atomic"]


def test_decorator_registration_of_estimators_and_advantages():
  @estimators.register("test_double_mc", overwrite=True)
  def double_mc(div, logp, logq):
    return 2.0 * estimators.mc(div, logp, logq)

  lp, lq = jnp.log(jnp.asarray([0.3, 0.6])), jnp.log(jnp.asarray([0.4, 0.5]))
  np.testing.assert_allclose(
    estimators.estimate("kl", "test_double_mc", lp, lq),
    2.0 * estimators.estimate("kl", "mc", lp, lq),
    rtol=1e-6,
  )
  assert estimators.get("test_double_mc") is double_mc

  @advantages.register("test_sign", overwrite=True)
  def sign(rewards):
    return jnp.sign(rewards - 0.5)

  try:
    assert advantages.get("test_sign") is sign
  finally:  # tests/test_advantages.py checks identities over every registered advantage
    advantages._REGISTRY._items.pop("test_sign")
