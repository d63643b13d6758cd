"""The algorithm: GPPO's math as pure functions (jax and numpy only; no model, config or I/O).

- `divergences`: f-divergence generators (TV, KL, Hellinger, chi^2, ...) and `register`.
- `estimators`: per-token divergence estimators (MC, Binary, Atomic, top-K, exact).
- `objective`: `LossConfig` and `policy_loss`, the masked GPPO surrogate.
- `advantages`: group-relative advantage estimators.
- `theory`: bounds, radii, level sets; the default radius f(1 - eps).
- `correction`: the rollout/trainer log-prob mismatch, measured, and its tis / mis corrections.
- `presets`: PPO, GRPO, DAPO, DPPO, RIPO, GSPO, CISPO ... as a `LossConfig` plus an advantage.
"""
