"""Named settings of the known algorithms as cells of the GPPO grid (docs/math.md#reductions).

Each preset is a plain `LossSettings` (loss + advantage conventions); `configs/` turns them into
training configs. Deltas for the other grid cells default to f(1 - eps) (`theory.default_delta`):
the paper's own values are not known to us and are a sweep axis.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The trust-region and advantage settings that define an algorithm."""

  divergence: str
  estimator: str
  delta_low: float
  delta_high: float
  aggregation: str = "token-mean"
  advantage: str = "grpo"
  ratio_cap: float | None = None
  dual_clip: float | None = None
  note: str = ""

  def loss_kwargs(self) -> dict:
    """Keyword arguments for `objective.policy_loss`."""
    return dict(
      divergence=self.divergence,
      estimator=self.estimator,
      delta_low=self.delta_low,
      delta_high=self.delta_high,
      aggregation=self.aggregation,
      ratio_cap=self.ratio_cap,
      dual_clip=self.dual_clip,
    )


PRESETS: dict[str, LossSettings] = {
  "ppo": LossSettings(
    "tv", "mc", 0.1, 0.1, note="PPO/GRPO clip eps = 0.2: identical gradients (delta = eps / 2)"
  ),
  "grpo": LossSettings(
    "tv", "mc", 0.1, 0.1, aggregation="seq-mean-token-mean", note="original GRPO aggregation"
  ),
  "dapo": LossSettings(
    "tv", "mc", 0.1, 0.14, note="DAPO clip-higher eps 0.2 / 0.28, token-mean (exact)"
  ),
  "dapo_kl": LossSettings(
    "kl", "mc", 0.0231, 0.0231, note="KL-MC analogue of clip-higher: r in [0.800, 1.231]"
  ),
  "dppo": LossSettings(
    "tv",
    "binary",
    0.15,
    0.15,
    aggregation="seq-mean-token-sum-norm",
    advantage="dr_grpo",
    note="DPPO binary TV |pi - mu| <= 0.15, GRPO advantages without std",
  ),
  "dppo_kl": LossSettings(
    "kl",
    "binary",
    0.05,
    0.05,
    aggregation="seq-mean-token-sum-norm",
    advantage="dr_grpo",
    note="DPPO binary KL(mu || pi) <= 0.05",
  ),
  "ripo": LossSettings(
    "chi2", "atomic", 0.05, 0.05, note="RIPO |r - 1| <= sqrt(delta / q), delta = 0.05"
  ),
}


def get(name: str) -> LossSettings:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; valid names: {', '.join(PRESETS)}")
  return PRESETS[name]


def cell(
  divergence: str, estimator: str, delta: float | None = None, eps: float = 0.2, **overrides
) -> LossSettings:
  """A grid cell with the default delta f(1 - eps) unless `delta` is given."""
  from gppo_jax import theory  # Imported here: theory is heavier and only needed for defaults.

  if delta is None:
    delta = theory.default_delta(divergence, eps)
  return dataclasses.replace(
    LossSettings(divergence, estimator, float(delta), float(delta)), **overrides
  )
