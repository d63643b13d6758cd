"""Group-relative advantage estimators (docs/math.md#advantages).

Rewards come as a [num_groups, group_size] array: row g holds the rewards of the G responses
sampled for prompt g. Every estimator returns advantages of the same shape (one per response; all
tokens of a response share it) and is jit-able.

  grpo        (R - mean_g) / (std_g + eps), std with ddof=1 by default (named in the config)
  dr_grpo     R - mean_g (no std normalisation; Dr.GRPO and DPPO)
  rloo        R - mean of the other G - 1 rewards (leave-one-out baseline)
  batch_std   (R - mean_g) / (std over the whole batch + eps)

A group whose rewards are all equal carries no signal (all advantages 0): `zero_signal_groups`
counts them and `signal_mask` selects the others (DAPO's dynamic sampling).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gppo_jax import registry

Array = jax.Array
AdvantageFn = Callable[..., Array]


def _check(rewards: Array) -> Array:
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 2:
    raise ValueError(
      f"rewards must be [num_groups, group_size], got shape {rewards.shape}; reshape flat rewards "
      "with rewards.reshape(-1, group_size)"
    )
  return rewards


def grpo(rewards: Array, *, eps: float = 1e-6, ddof: int = 1) -> Array:
  """Group-normalised advantages (R - mean) / (std + eps); ddof=1 is the unbiased std."""
  rewards = _check(rewards)
  if ddof >= rewards.shape[1]:
    raise ValueError(f"group_size {rewards.shape[1]} too small for std with ddof={ddof}")
  centred = rewards - jnp.mean(rewards, axis=1, keepdims=True)
  std = jnp.std(rewards, axis=1, keepdims=True, ddof=ddof)
  return centred / (std + eps)


def dr_grpo(rewards: Array) -> Array:
  """Mean-centred rewards without std normalisation."""
  rewards = _check(rewards)
  return rewards - jnp.mean(rewards, axis=1, keepdims=True)


def rloo(rewards: Array) -> Array:
  """Leave-one-out baseline: R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean)."""
  rewards = _check(rewards)
  g = rewards.shape[1]
  if g < 2:
    raise ValueError("rloo needs group_size >= 2")
  return (rewards - jnp.mean(rewards, axis=1, keepdims=True)) * (g / (g - 1))


def batch_std(rewards: Array, *, eps: float = 1e-6, ddof: int = 1) -> Array:
  """Group-centred rewards divided by the std of all rewards in the batch."""
  rewards = _check(rewards)
  centred = rewards - jnp.mean(rewards, axis=1, keepdims=True)
  return centred / (jnp.std(rewards, ddof=ddof) + eps)


def signal_mask(rewards: Array, *, atol: float = 1e-6) -> Array:
  """bool [num_groups]: True where the group's rewards are not all equal."""
  rewards = _check(rewards)
  return (jnp.max(rewards, axis=1) - jnp.min(rewards, axis=1)) > atol


def zero_signal_groups(rewards: Array, *, atol: float = 1e-6) -> Array:
  """Number of groups whose rewards are all equal (no learning signal)."""
  return jnp.sum(~signal_mask(rewards, atol=atol))


_REGISTRY: registry.Registry[AdvantageFn] = registry.Registry("advantage estimator")
for _name, _fn in (("grpo", grpo), ("dr_grpo", dr_grpo), ("rloo", rloo), ("batch_std", batch_std)):
  _REGISTRY.register(_name, _fn)
del _name, _fn


def register(name: str, fn: AdvantageFn | None = None, *, overwrite: bool = False):
  """Registers fn(rewards [num_groups, G], **kwargs) -> advantages [num_groups, G] under `name`
  and returns fn (written in jax.numpy: the trainer compiles it with jax.jit); without fn, a
  decorator: `@advantages.register("name")`."""
  if fn is None:
    return _REGISTRY.register(name, overwrite=overwrite)
  return _REGISTRY.register(name, fn, overwrite=overwrite)


def names() -> list[str]:
  return _REGISTRY.names()


def get(name: str) -> AdvantageFn:
  return _REGISTRY.get(name)


def compute(name: str | AdvantageFn, rewards: Array, **kwargs) -> tuple[Array, dict[str, Array]]:
  """Advantages by registry name (or the estimator itself) plus metrics (zero-signal group count
  and fraction)."""
  adv = (name if callable(name) else get(name))(rewards, **kwargs)
  zero = zero_signal_groups(rewards)
  return adv, {
    "adv/zero_signal_groups": zero,
    "adv/zero_signal_frac": zero / jnp.asarray(rewards).shape[0],
    "adv/abs_mean": jnp.mean(jnp.abs(adv)),
  }
