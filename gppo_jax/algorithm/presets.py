"""Named settings of the known algorithms as cells of the GPPO grid (docs/math.md#reductions).

A `Preset` is an `objective.LossConfig` plus the advantage estimator it is meant with and a note;
`configs/` write it into training configs (`config_lib.use_settings`). Radii for the other grid
cells default to f(1 - eps) (`default_delta`): the paper's own values are not known to us and are
a sweep axis.

Nothing here starts a JAX backend: the default radii of the built-in divergences are closed forms
in plain Python (`default_delta`), so loading a config compiles nothing (tests/test_theory.py checks
them against `theory.default_delta`; a built-in name re-registered with another generator would
need `theory.default_delta` directly).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from gppo_jax import registry
from gppo_jax.algorithm.objective import LossConfig


@dataclasses.dataclass(frozen=True)
class Preset:
  """An algorithm: its loss, the advantage estimator (`advantages.get` name) and a note."""

  loss: LossConfig
  advantage: str = "grpo"
  note: str = ""


def _preset(divergence, estimator, delta_low, delta_high, *, advantage="grpo", note="", **loss):
  return Preset(
    LossConfig(
      divergence=divergence,
      estimator=estimator,
      delta_low=delta_low,
      delta_high=delta_high,
      **loss,
    ),
    advantage=advantage,
    note=note,
  )


PRESETS: registry.Registry[Preset] = registry.Registry("preset")
PRESETS.register(
  "ppo",
  _preset(
    "tv", "mc", 0.1, 0.1, note="PPO/GRPO clip eps = 0.2: identical gradients (delta = eps / 2)"
  ),
)
PRESETS.register(
  "grpo",
  _preset(
    "tv", "mc", 0.1, 0.1, aggregation="seq-mean-token-mean", note="original GRPO aggregation"
  ),
)
PRESETS.register(
  "dapo",
  _preset("tv", "mc", 0.1, 0.14, note="DAPO clip-higher eps 0.2 / 0.28, token-mean (exact)"),
)
PRESETS.register(
  "dapo_kl",
  _preset("kl", "mc", 0.0231, 0.0231, note="KL-MC analogue of clip-higher: r in [0.800, 1.231]"),
)
PRESETS.register(
  "dppo",
  _preset(
    "tv",
    "binary",
    0.15,
    0.15,
    aggregation="seq-mean-token-sum-norm",
    advantage="dr_grpo",
    note="DPPO binary TV |pi - mu| <= 0.15, GRPO advantages without std",
  ),
)
PRESETS.register(
  "dppo_kl",
  _preset(
    "kl",
    "binary",
    0.05,
    0.05,
    aggregation="seq-mean-token-sum-norm",
    advantage="dr_grpo",
    note="DPPO binary KL(mu || pi) <= 0.05",
  ),
)
PRESETS.register(
  "ripo",
  _preset("chi2", "atomic", 0.05, 0.05, note="RIPO |r - 1| <= sqrt(delta / q), delta = 0.05"),
)

PRESETS.register(
  "gspo",
  _preset(
    "tv",
    "mc",
    1.5e-4,
    2e-4,
    aggregation="seq-mean-token-mean",
    ratio_level="sequence",
    note="GSPO: PPO's clip eps 3e-4 / 4e-4 on the sequence ratio exp(mean_t log r_t)",
  ),
)
PRESETS.register(
  "cispo",
  _preset(
    "tv",
    "mc",
    math.inf,
    math.inf,
    ratio_cap=1.28,
    note="CISPO: no token masked, weight stop_gradient(min(r, 1 + 0.28)) on grad log p",
  ),
)


def get(name: str) -> Preset:
  """The preset called `name` (ppo, grpo, dapo, dapo_kl, dppo, dppo_kl, ripo, gspo, cispo)."""
  return PRESETS.get(name)


def names() -> list[str]:
  return PRESETS.names()


# f(t) of the built-in divergences in plain Python, with the conventions of `divergences.py`.
GENERATORS: dict[str, Callable[[float], float]] = {
  "tv": lambda t: 0.5 * abs(t - 1.0),
  "kl": lambda t: t - 1.0 - math.log(t),
  "hellinger": lambda t: (math.sqrt(t) - 1.0) ** 2,
  "chi2": lambda t: (t - 1.0) ** 2,
  "forward_kl": lambda t: t * math.log(t) - t + 1.0,
  "js": lambda t: t * math.log(t) - (1.0 + t) * math.log((1.0 + t) / 2.0),
}


def _alpha_generator(name: str) -> Callable[[float], float] | None:
  """f_a of an "alpha:<a>" name (divergences.alpha), or None."""
  try:
    a = float(name.split(":", 1)[1]) if name.startswith("alpha:") else None
  except ValueError:
    return None
  if a is None:
    return None
  if a == 0.0:
    return GENERATORS["kl"]
  if a == 1.0:
    return GENERATORS["forward_kl"]
  return lambda t: (t**a - 1.0 - a * (t - 1.0)) / (a * (a - 1.0))


def default_delta(divergence: str, eps: float = 0.2) -> float:
  """delta_f = f(1 - eps), the radius whose contraction side matches PPO's clip
  (docs/math.md#default-delta).

  Closed form for the built-in divergences and the alpha family; any other (user-registered)
  divergence goes through `theory.default_delta`, which evaluates its jax generator.
  """
  if not 0 < eps < 1:
    raise ValueError(f"eps must lie in (0, 1), got {eps}")
  f = GENERATORS.get(divergence) if isinstance(divergence, str) else None
  f = f or (_alpha_generator(divergence) if isinstance(divergence, str) else None)
  if f is not None:
    return float(f(1.0 - eps))
  from gppo_jax.algorithm import theory

  return theory.default_delta(divergence, eps)


def cell(
  divergence: str,
  estimator: str,
  delta: float | None = None,
  eps: float = 0.2,
  *,
  advantage: str = "grpo",
  note: str = "",
  **loss_overrides,
) -> Preset:
  """A grid cell with the radius `delta` (both sides; default f(1 - eps)), the advantage
  estimator `advantage` and any other LossConfig field in `loss_overrides`."""
  if delta is None:
    delta = default_delta(divergence, eps)
  loss = LossConfig(
    divergence=divergence,
    estimator=estimator,
    delta_low=float(delta),
    delta_high=float(delta),
    **loss_overrides,
  )
  return Preset(loss, advantage=advantage, note=note)
