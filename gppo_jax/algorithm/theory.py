"""Why a small f-divergence region is a trust region: bounds, radii, level sets.

The math: docs/math.md#theory.

For a normalised generator f the tight lower bound of D_f in terms of total variation V is the
binary reduction

  L_f(V) = min over beta in [0, 1 - V] of
           beta f((beta + V) / beta) + (1 - beta) f((1 - beta - V) / (1 - beta))

(0 f(x / 0) = x * slope_at_inf, f(0) = f_at_zero). Hence D_f <= delta implies TV <= tv_radius(delta)
= L_f^{-1}(delta) <= sqrt(delta / C_f), with C_f = inf_V L_f(V) / V^2 the best universal quadratic
constant, so the TRPO-style improvement bound holds for every f. `level_set` gives the interval of
ratios r = p / q a token may reach before a (divergence, estimator, delta) cell masks it.

Everything here is evaluated in float64 (jax's x64 mode, scoped to these functions) and returned as
numpy. Generators and estimators are looked up through their registries, so user-registered ones
work by name. `python -m gppo_jax.algorithm.theory` prints the constants and writes plots.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from gppo_jax.algorithm import divergences as divs
from gppo_jax.algorithm import estimators as ests

ArrayLike = float | Sequence[float] | np.ndarray

# Searches evaluate a grid of _GRID points, keep the bracket around the answer and zoom in; each
# round shrinks the bracket by a factor of 32 (minimum of a convex function, _MIN_ROUNDS rounds) or
# 64 (crossing of a monotone predicate, _CROSS_ROUNDS rounds): below float64 resolution (2^-52).
_GRID = 65
_MIN_ROUNDS = 11
_CROSS_ROUNDS = 9

CLI_DIVERGENCES = ("tv", "kl", "hellinger", "chi2", "forward_kl", "js")
CLI_ESTIMATORS = ("mc", "binary", "atomic")


def _to_f64(x: ArrayLike, name: str) -> tuple[np.ndarray, bool]:
  arr = np.asarray(x, dtype=np.float64)
  if np.isnan(arr).any():
    raise ValueError(f"{name} contains NaN")
  return arr, arr.ndim == 0


def _out(x: np.ndarray, scalar: bool) -> float | np.ndarray:
  x = np.asarray(x, dtype=np.float64)
  return float(x) if scalar else x


def _times(x: np.ndarray, s: float) -> np.ndarray:
  """x * s with 0 * inf read as 0 (a zero-mass atom contributes nothing)."""
  if math.isfinite(s):
    return x * s
  return np.where(x > 0, math.inf, 0.0)


_JITTED: dict[tuple, object] = {}
_CHUNK = 16384


def _padded_call(key: tuple, fn, *arrays: np.ndarray) -> np.ndarray:
  """fn(*arrays) elementwise in float64, jitted once per key on chunks of _CHUNK elements (so that
  the many differently shaped calls of the searches below share one compilation)."""
  shape = np.broadcast_shapes(*(a.shape for a in arrays))
  flat = [np.broadcast_to(a, shape).ravel() for a in arrays]
  n = flat[0].size
  if key not in _JITTED:
    _JITTED[key] = jax.jit(fn)
  out = np.empty(n, np.float64)
  with jax.enable_x64(True):
    for start in range(0, n, _CHUNK):
      # Padding repeats a valid input value, so no padded lane evaluates outside the domain.
      chunk = [
        np.pad(a[start : start + _CHUNK], (0, max(0, start + _CHUNK - n)), "edge") for a in flat
      ]
      value = _JITTED[key](*(jnp.asarray(c, jnp.float64) for c in chunk))
      out[start : start + _CHUNK] = np.asarray(jax.device_get(value), np.float64)[: n - start]
  return out.reshape(shape)


def _f64(div: divs.Divergence, t: ArrayLike) -> np.ndarray:
  """The generator on float64 inputs, evaluated in float64."""
  return _padded_call(("f", div), div.f, np.asarray(t, np.float64))


def _bracket_grid(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  """[..., _GRID] evenly spaced points from lo to hi (both included)."""
  w = np.linspace(0.0, 1.0, _GRID)
  return lo[..., None] + (hi - lo)[..., None] * w


def _crossing(inside, lo: np.ndarray, hi: np.ndarray, rising: bool) -> np.ndarray:
  """The boundary x in [lo, hi] of a monotone predicate: inside(lo) and not inside(hi) if rising
  (the set is [lo, x]), else not inside(lo) and inside(hi) (the set is [x, hi])."""
  idx = np.arange(_GRID)
  for _ in range(_CROSS_ROUNDS):
    x = _bracket_grid(lo, hi)
    ok = inside(x)
    if rising:  # the last inside point and the one after it
      i = np.minimum(np.max(np.where(ok, idx, 0), axis=-1), _GRID - 2)
    else:  # the point before the first inside one, and that one
      i = np.maximum(np.min(np.where(ok, idx, _GRID - 1), axis=-1), 1) - 1
    lo = np.take_along_axis(x, i[..., None], -1)[..., 0]
    hi = np.take_along_axis(x, i[..., None] + 1, -1)[..., 0]
  return 0.5 * (lo + hi)


# --- L_f(V) ------------------------------------------------------------------------------------


def _binary_value(div: divs.Divergence, v: np.ndarray, beta: np.ndarray) -> np.ndarray:
  """D_f between (beta + V, 1 - beta - V) and (beta, 1 - beta), with the boundary limits."""
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    b_pos = beta > 0
    b_safe = np.where(b_pos, beta, 1.0)
    ratio1 = np.where(b_pos, (beta + v) / b_safe, 1.0)
    c = 1.0 - beta
    a = np.maximum(c - v, 0.0)
    a_pos = a > 0
    ratio2 = np.where(a_pos, a / np.where(a_pos, c, 1.0), 1.0)
    f1, f2 = _f64(div, np.stack([ratio1, ratio2]))
    first = np.where(b_pos, beta * f1, _times(v, div.slope_at_inf))
    second = np.where(a_pos, c * f2, _times(c, div.f_at_zero))
    return first + second


def _lower_bound_search(div: divs.Divergence, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Zooming grid search of the convex beta -> binary value on [0, 1 - V] (flat v)."""
  lo, hi = np.zeros_like(v), 1.0 - v
  best = np.full_like(v, np.inf)
  arg = np.zeros_like(v)
  rows = np.arange(v.size)
  for _ in range(_MIN_ROUNDS):
    beta = _bracket_grid(lo, hi)
    g = _binary_value(div, v[:, None], beta)
    i = np.argmin(np.where(np.isnan(g), np.inf, g), axis=-1)
    better = g[rows, i] <= best
    best = np.where(better, g[rows, i], best)
    arg = np.where(better, beta[rows, i], arg)
    # A convex function's minimiser lies between the grid neighbours of the best grid point.
    lo = beta[rows, np.maximum(i - 1, 0)]
    hi = beta[rows, np.minimum(i + 1, _GRID - 1)]
  return np.maximum(best, 0.0), arg


def lower_bound(divergence: str | divs.Divergence, V: ArrayLike, *, return_beta: bool = False):
  """The tight lower bound L_f(V) of D_f(P || Q) over pairs with total variation V in [0, 1].

  With return_beta, also returns the minimising beta: the binary pair P = (beta + V, 1 - beta - V),
  Q = (beta, 1 - beta) attains D_f = L_f(V). Scalars in, floats out; arrays in, arrays out.
  """
  div = divs.get(divergence)
  v, scalar = _to_f64(V, "V")
  if ((v < 0) | (v > 1)).any():
    raise ValueError(f"total variation V must lie in [0, 1], got values in [{v.min()}, {v.max()}]")
  value, beta = _lower_bound_search(div, v.ravel())
  value, beta = value.reshape(v.shape), beta.reshape(v.shape)
  if return_beta:
    return _out(value, scalar), _out(beta, scalar)
  return _out(value, scalar)


def _check_delta(delta: ArrayLike) -> tuple[np.ndarray, bool]:
  d, scalar = _to_f64(delta, "delta")
  if (d <= 0).any():
    raise ValueError(f"delta must be > 0 (a trust-region radius), got min {d.min()}")
  return d, scalar


def tv_radius(divergence: str | divs.Divergence, delta: ArrayLike) -> float | np.ndarray:
  """The largest V with L_f(V) <= delta: D_f(P || Q) <= delta implies TV(P, Q) <= tv_radius."""
  div = divs.get(divergence)
  d, scalar = _check_delta(delta)
  flat = d.ravel()

  def inside(v: np.ndarray) -> np.ndarray:
    bound = _lower_bound_search(div, v.ravel())[0].reshape(v.shape)
    return bound <= flat.reshape(flat.shape + (1,) * (v.ndim - 1))

  v = _crossing(inside, np.zeros_like(flat), np.ones_like(flat), rising=True)
  v = np.where(inside(np.ones_like(flat)), 1.0, v)
  return _out(v.reshape(d.shape), scalar)


# --- Quadratic constants -----------------------------------------------------------------------


def curvature_at_one(divergence: str | divs.Divergence) -> float:
  """f''(1) in float64 by autodiff; inf where f has a kink at 1 (TV: the local bound is linear)."""
  div = divs.get(divergence)
  # A kink shows as second differences growing like 1/h; a smooth f gives (nearly) equal ones.
  f1 = float(_f64(div, 1.0))

  def second_difference(h: float) -> float:
    fp, fm = _f64(div, [1.0 + h, 1.0 - h])
    return float(fp + fm - 2.0 * f1) / h**2

  coarse, fine = second_difference(1e-3), second_difference(1e-4)
  if fine > 2.0 * abs(coarse) + 1e-6:
    return math.inf
  with jax.enable_x64(True):
    value = float(jax.grad(jax.grad(div.f))(jnp.asarray(1.0, jnp.float64)))
  if not math.isfinite(value):
    value = (4.0 * second_difference(5e-5) - fine) / 3.0
  return value


def local_quadratic_constant(divergence: str | divs.Divergence) -> float:
  """lim_{V -> 0} L_f(V) / V^2 = 2 f''(1) (attained at beta = 1/2); inf for TV."""
  return 2.0 * curvature_at_one(divergence)


def quadratic_constant(divergence: str | divs.Divergence) -> float:
  """C_f = inf over V in (0, 1] of L_f(V) / V^2: D_f <= delta implies TV <= sqrt(delta / C_f)."""
  return _quadratic_constant(divs.get(divergence))


@functools.lru_cache(maxsize=64)
def _quadratic_constant(div: divs.Divergence) -> float:
  grid = np.unique(np.concatenate([np.geomspace(1e-3, 1.0, 200), np.linspace(0.01, 1.0, 100)]))
  ratio = lower_bound(div, grid) / grid**2
  i = int(np.argmin(ratio))
  best = float(ratio[i])
  if 0 < i < len(grid) - 1:  # refine an interior minimum between the neighbouring grid points
    fine = np.linspace(grid[i - 1], grid[i + 1], 101)
    best = min(best, float(np.min(lower_bound(div, fine) / fine**2)))
  return min(best, local_quadratic_constant(div))


def default_delta(divergence: str | divs.Divergence, eps: float = 0.2) -> float:
  """delta_f = f(1 - eps): the radius whose contraction side matches PPO's clip.

  Evaluates the registered generator in float64 (jax, compiled), so it works for any divergence;
  `presets.default_delta` gives the same values for the built-ins in plain Python, without jax.
  See docs/math.md#default-delta.
  """
  if not 0 < eps < 1:
    raise ValueError(f"eps must lie in (0, 1), got {eps}")
  return float(_f64(divs.get(divergence), 1.0 - eps))


# --- Level sets of per-token estimates ---------------------------------------------------------


def level_set(
  divergence: str | divs.Divergence,
  estimator: str | ests.EstimatorFn,
  delta: ArrayLike,
  q: ArrayLike,
) -> tuple[float | np.ndarray, float | np.ndarray]:
  """The ratios r = p / q in [r_lo, r_hi] whose per-token estimate stays <= delta, per q.

  The estimate (from `estimators`, with logp = log(r q), logq = log q) is convex in p with
  its minimum 0 at r = 1, so the set is an interval around 1. r_hi is capped at 1 / q (p <= 1) and
  r_lo is 0 when the estimate stays <= delta down to p = 0 (the estimators' floor e^-80).
  delta and q broadcast; q in (0, 1]. The estimators compute in float32, which limits the
  endpoints to about 1e-7 relative accuracy.
  """
  div = divs.get(divergence)
  est_fn = ests.get(estimator)
  d, d_scalar = _check_delta(delta)
  qq, q_scalar = _to_f64(q, "q")
  if ((qq <= 0) | (qq > 1)).any():
    raise ValueError(f"q must lie in (0, 1], got values in [{qq.min()}, {qq.max()}]")
  d, qq = np.broadcast_arrays(d, qq)
  shape = qq.shape
  d, logq = d.ravel(), np.log(qq.ravel())

  def inside(log_ratio: np.ndarray) -> np.ndarray:
    lq = np.broadcast_to(logq.reshape(logq.shape + (1,) * (log_ratio.ndim - 1)), log_ratio.shape)
    dd = d.reshape(d.shape + (1,) * (log_ratio.ndim - 1))
    try:
      value = _padded_call(("est", div, est_fn), partial(est_fn, div), lq + log_ratio, lq)
    except TypeError as err:
      raise ValueError(
        f"level_set needs a per-token estimator of (logp, logq) only; {estimator!r} failed: {err}"
      ) from err
    return value <= dd

  zero = np.zeros_like(logq)
  l_max = -logq  # p = 1
  l_min = np.minimum(ests.LOG_PROB_FLOOR - logq, 0.0)  # p at the estimators' floor
  l_hi = _crossing(inside, zero, l_max, rising=True)
  l_lo = _crossing(inside, l_min, zero, rising=False)
  r_hi = np.where(inside(l_max), np.exp(l_max), np.exp(l_hi))
  r_lo = np.where(inside(l_min), 0.0, np.exp(l_lo))
  scalar = d_scalar and q_scalar
  return _out(r_lo.reshape(shape), scalar), _out(r_hi.reshape(shape), scalar)


# --- Command line: table and plots -------------------------------------------------------------


def constants_table(names: Sequence[str], eps: float = 0.2) -> list[dict[str, float | str]]:
  """One row of constants per divergence (the CLI's table)."""
  rows = []
  for name in names:
    delta = default_delta(name, eps)
    c_global = quadratic_constant(name)
    rows.append(
      {
        "divergence": name,
        "C_global": c_global,
        "C_local": local_quadratic_constant(name),
        "f2_at_1": curvature_at_one(name),
        "delta": delta,
        "tv_radius": tv_radius(name, delta),
        "pinsker_radius": math.sqrt(delta / c_global),
      }
    )
  return rows


def _format_table(rows: list[dict[str, float | str]], eps: float) -> str:
  f2 = 'f"(1)'
  head = (
    f"{'divergence':<12}{'C_f global':>12}{'C_f local':>12}{f2:>10}"
    f"{'delta=f(1-eps)':>16}{'tv_radius':>12}{'sqrt(d/C_f)':>13}"
  )
  lines = [f"f-divergence trust regions at eps = {eps} (delta = f(1 - eps))", head, "-" * len(head)]
  for r in rows:
    lines.append(
      f"{r['divergence']:<12}{r['C_global']:>12.5g}{r['C_local']:>12.5g}{r['f2_at_1']:>10.4g}"
      f"{r['delta']:>16.5g}{r['tv_radius']:>12.5g}{r['pinsker_radius']:>13.5g}"
    )
  return "\n".join(lines)


def plot_level_sets(path: str, names: Sequence[str], eps: float = 0.2) -> None:
  """r_lo and r_hi against q (log axes), one panel per divergence, one colour per estimator."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  q = np.geomspace(1e-6, 0.999, 160)
  cols = min(3, len(names))
  rows = -(-len(names) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
  y_min, y_max = 0.03, 30.0
  for ax, name in zip(axes.ravel(), names, strict=False):
    delta = default_delta(name, eps)
    ax.plot(q, 1.0 / q, color="0.6", lw=1, ls=":", label="cap 1/q (p = 1)")
    for est, color in zip(CLI_ESTIMATORS, ("C0", "C1", "C2"), strict=True):
      r_lo, r_hi = level_set(name, est, delta, q)
      ax.plot(q, r_hi, color=color, lw=1.8, label=f"{est}")
      ax.plot(q, np.maximum(r_lo, y_min), color=color, lw=1.8, ls="--")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(y_min, y_max)
    ax.set_xlabel("behaviour probability q = mu(a_t)")
    ax.set_ylabel("ratio r = pi / mu")
    ax.set_title(f"{name}: delta = {delta:.4g}  (solid r_hi, dashed r_lo)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 0.06), fontsize=8)
  for ax in axes.ravel()[len(names) :]:
    ax.axis("off")
  fig.suptitle(
    f"Trust-region level sets at delta = f(1 - {eps}); r_lo = 0 is drawn on the bottom edge"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_lower_bounds(path: str, names: Sequence[str]) -> None:
  """L_f(V) and L_f(V) / V^2 against V with each C_f marked."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  v = np.linspace(0.005, 0.995, 199)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  styles = ("-", "--", "-.", ":")
  for i, name in enumerate(names):
    style = {"color": f"C{i}", "lw": 1.8, "ls": styles[i % len(styles)]}
    bound = lower_bound(name, v)
    c_f = quadratic_constant(name)
    ax1.plot(v, bound, label=name, **style)
    ax2.plot(v, bound / v**2, label=f"{name} (C_f = {c_f:.3g})", **style)
    ax2.axhline(c_f, color=f"C{i}", lw=0.8, ls=":")
  ax1.set_yscale("log")
  ax1.set_ylim(1e-5, 20)
  ax1.set_xlabel("total variation V")
  ax1.set_ylabel("L_f(V) = min D_f at TV = V")
  ax1.set_title("Tight lower bound of D_f by total variation\n(f and t f(1/t) share L_f)")
  ax2.set_ylim(0, 8)
  ax2.set_xlabel("total variation V")
  ax2.set_ylabel("L_f(V) / V^2")
  ax2.set_title(
    "L_f(V) / V^2 and C_f = its infimum (dotted)\nD_f <= delta implies TV <= sqrt(delta / C_f)"
  )
  for ax in (ax1, ax2):
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m gppo_jax.algorithm.theory",
    description="Print trust-region constants of f-divergences and plot level sets and L_f(V).",
  )
  parser.add_argument("--out", default="theory_plots", help="directory for the PNG plots")
  parser.add_argument("--eps", type=float, default=0.2, help="PPO clip matched by delta = f(1-eps)")
  parser.add_argument(
    "--divergences",
    default=",".join(CLI_DIVERGENCES),
    help="comma-separated registered divergence names (alpha:<a> works too)",
  )
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.divergences.split(",") if n.strip()]
  for name in names:
    divs.get(name)  # fail early with the list of valid names
  print(_format_table(constants_table(names, args.eps), args.eps))
  os.makedirs(args.out, exist_ok=True)
  paths = [os.path.join(args.out, "level_sets.png"), os.path.join(args.out, "lower_bounds.png")]
  plot_level_sets(paths[0], names, args.eps)
  plot_lower_bounds(paths[1], names)
  print("wrote " + ", ".join(os.path.abspath(p) for p in paths))
  return 0


if __name__ == "__main__":
  sys.exit(main())
