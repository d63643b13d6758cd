"""Registry of normalised f-divergence generators (docs/math.md#divergences).

D_f(pi || mu) = E_{a ~ mu} f(pi(a) / mu(a)), with f(1) = 0 and f'(1) = 0 so that every per-token
estimate built from f is >= 0 and minimal at ratio 1.

Every estimator in `estimators` is a sum of *perspective* terms b * f(a / b) for two
probabilities a (under pi) and b (under mu). A `Divergence` therefore carries, besides f itself,
`perspective(log_a, log_b)`: that term computed from log-probabilities, written per divergence so
that it stays finite and accurate when b -> 0, a / b -> 1 or both probabilities are close to 1.

Adding a divergence is one call:

    divergences.register("my_div", lambda t: (t - 1.0) ** 4)

after which `"my_div"` works by name in estimators, the objective, theory and configs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gppo_jax import errors, registry

Array = jax.Array

# Log-ratios are clipped here before exponentiation in generic code paths: e^40 ~ 2.4e17, so even a
# quadratic generator stays finite in float32. Only far out-of-region tokens are affected.
MAX_LOG_RATIO = 40.0


@dataclasses.dataclass(frozen=True)
class Divergence:
  """A normalised f-divergence.

  Attributes:
    name: registry key.
    f: the generator on ratios t > 0 (jnp-traceable, elementwise).
    perspective: (log_a, log_b) -> b * f(a / b), elementwise and numerically stable.
    f_at_zero: lim_{t -> 0} f(t) (may be inf); used by the theory module.
    slope_at_inf: lim_{t -> inf} f(t) / t (may be inf); gives 0 * f(x / 0) = x * slope.
    description: one line for tables and error messages.
  """

  name: str
  f: Callable[[Array], Array]
  perspective: Callable[[Array, Array], Array]
  f_at_zero: float
  slope_at_inf: float
  description: str = ""

  def mc(self, log_ratio: Array) -> Array:
    """f(r) from the log-ratio l = log p - log q (the single-sample estimate)."""
    return self.perspective(log_ratio, jnp.zeros_like(log_ratio))


def _ratio_terms(log_a: Array, log_b: Array) -> tuple[Array, Array, Array]:
  """Returns (b, d, b * (a / b - 1)) with d = log a - log b, stable for every a, b in (0, 1]."""
  b = jnp.exp(log_b)
  d = log_a - log_b
  # b * expm1(d) is exact near d = 0; for large d it would overflow, and a - b is then exact.
  small = d < 20.0
  b_expm1 = jnp.where(small, b * jnp.expm1(jnp.minimum(d, 20.0)), jnp.exp(log_a) - b)
  return b, d, b_expm1


def generic_perspective(f: Callable[[Array], Array]) -> Callable[[Array, Array], Array]:
  """b * f(a / b) for a user-supplied f, with the ratio clipped to e^(+-MAX_LOG_RATIO)."""

  def perspective(log_a: Array, log_b: Array) -> Array:
    d = jnp.clip(log_a - log_b, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.exp(log_b) * f(jnp.exp(d))

  return perspective


# --- The paper's four --------------------------------------------------------------------------


def _tv_perspective(log_a: Array, log_b: Array) -> Array:
  _, _, b_expm1 = _ratio_terms(log_a, log_b)
  return 0.5 * jnp.abs(b_expm1)


def _kl_perspective(log_a: Array, log_b: Array) -> Array:
  # b f(a/b) with f(t) = t - 1 - log t:  (a - b) - b * d.
  b, d, b_expm1 = _ratio_terms(log_a, log_b)
  # (a - b) - b d = b (expm1(d) - d); for small |d| use the series to avoid cancellation.
  series = b * d * d * (0.5 + d * (1.0 / 6.0 + d / 24.0))
  return jnp.where(jnp.abs(d) < 1e-2, series, b_expm1 - b * d)


def _hellinger_perspective(log_a: Array, log_b: Array) -> Array:
  # (sqrt a - sqrt b)^2 = b * expm1(d / 2)^2, or directly when d is large.
  b = jnp.exp(log_b)
  d = log_a - log_b
  small = d < 20.0
  e = jnp.expm1(0.5 * jnp.minimum(d, 20.0))
  direct = jnp.exp(0.5 * log_a) - jnp.exp(0.5 * log_b)
  return jnp.where(small, b * e * e, direct * direct)


def _chi2_perspective(log_a: Array, log_b: Array) -> Array:
  # (a - b)^2 / b = b * expm1(d)^2. For d >= 20, expm1(d)^2 = e^(2d) to float precision, so the term
  # is evaluated in log space and saturates at e^80 (~5.5e34) instead of overflowing.
  b = jnp.exp(log_b)
  d = log_a - log_b
  e = jnp.expm1(jnp.minimum(d, 20.0))
  large = jnp.exp(jnp.minimum(log_b + 2.0 * jnp.maximum(d, 20.0), 80.0))
  return jnp.where(d < 20.0, b * e * e, large)


def _forward_kl_perspective(log_a: Array, log_b: Array) -> Array:
  # b f(a/b) with f(t) = t log t - t + 1:  a d - (a - b).
  b, d, b_expm1 = _ratio_terms(log_a, log_b)
  a = jnp.exp(log_a)
  # For small |d|: b ((1 + x) log(1 + x) - x) with x = expm1(d) ~ b (d^2/2 + d^3/3! * 2 ...).
  series = b * d * d * (0.5 + d * (1.0 / 3.0 + d / 8.0))
  return jnp.where(jnp.abs(d) < 1e-2, series, a * d - b_expm1)


def _js_perspective(log_a: Array, log_b: Array) -> Array:
  # f(t) = t log t - (1 + t) log((1 + t) / 2):  a log(2a / (a + b)) + b log(2b / (a + b)),
  # written with log1p / expm1 of d = log a - log b so that it is exactly 0 at a = b.
  d = jnp.clip(log_a - log_b, -2.0 * MAX_LOG_RATIO, 2.0 * MAX_LOG_RATIO)
  value = -jnp.exp(log_a) * jnp.log1p(0.5 * jnp.expm1(-d)) - jnp.exp(log_b) * jnp.log1p(
    0.5 * jnp.expm1(d)
  )
  return jnp.maximum(value, 0.0)


def _alpha_f(alpha: float) -> Callable[[Array], Array]:
  if alpha == 0.0:
    return lambda t: t - 1.0 - jnp.log(t)
  if alpha == 1.0:
    return lambda t: t * jnp.log(t) - t + 1.0
  c = 1.0 / (alpha * (alpha - 1.0))
  return lambda t: c * (t**alpha - 1.0 - alpha * (t - 1.0))


def _alpha_perspective(alpha: float) -> Callable[[Array, Array], Array]:
  if alpha == 0.0:
    return _kl_perspective
  if alpha == 1.0:
    return _forward_kl_perspective
  c = 1.0 / (alpha * (alpha - 1.0))

  def perspective(log_a: Array, log_b: Array) -> Array:
    # b f(a/b) = c (a^alpha b^(1-alpha) - b - alpha (a - b)).
    b, d, b_expm1 = _ratio_terms(log_a, log_b)
    d_c = jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    value = c * (b * jnp.expm1(alpha * d_c) - alpha * b_expm1)
    return jnp.maximum(value, 0.0)

  return perspective


def _alpha_limits(alpha: float) -> tuple[float, float]:
  """(f(0), lim f(t)/t) for the alpha family."""
  f0 = 1.0 / alpha if alpha > 0 else math.inf
  slope = 1.0 / (1.0 - alpha) if alpha < 1 else math.inf
  return f0, slope


# --- Registry ----------------------------------------------------------------------------------

_REGISTRY: registry.Registry[Divergence] = registry.Registry("divergence", hint=" or 'alpha:<a>'")


def check_generator(name: str, f: Callable[[Array], Array]) -> None:
  """Raises ValueError unless f(1) = 0 and f >= 0 around its minimum at 1 (a numerical probe)."""
  probe = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
  values = jax.device_get(f(probe))
  if abs(float(values[1])) > 1e-5:
    raise ValueError(f"divergence {name!r}: f(1) must be 0 (normalised generator), got {values[1]}")
  if float(values[0]) < -1e-6 or float(values[2]) < -1e-6:
    raise ValueError(
      f"divergence {name!r}: f must be >= 0 with its minimum at t = 1 (add c * (t - 1) to make "
      f"f'(1) = 0); got f(0.5) = {values[0]}, f(2) = {values[2]}"
    )


def _estimate_slope_at_inf(f: Callable[[Array], Array]) -> float:
  """lim f(t) / t as t -> inf, from f(t) / t at t = 1e6 and 1e12: their common value when they
  agree to 1%, else inf (f grows faster than t, as t log t or t^2 do). Moderate t keeps f finite
  in float32 where a generator squares t (t^2 at t = 1e30 overflows)."""
  lo, hi = (float(f(jnp.asarray(t, jnp.float32))) / t for t in (1e6, 1e12))
  if math.isfinite(hi) and math.isfinite(lo) and abs(hi - lo) <= 0.01 * max(1.0, abs(hi)):
    return hi
  return math.inf


def register(
  name: str,
  f: Callable[[Array], Array],
  *,
  perspective: Callable[[Array, Array], Array] | None = None,
  f_at_zero: float | None = None,
  slope_at_inf: float | None = None,
  description: str = "",
  overwrite: bool = False,
  validate: bool = True,
) -> Divergence:
  """Registers a normalised generator f under `name` and returns the Divergence.

  f must satisfy f(1) = 0 and be convex with its minimum at 1 (checked numerically unless
  `validate=False`: the built-ins skip it so that importing this module starts no jax backend,
  which multi-host runs need; their tests run the check). Without a hand-written `perspective`,
  b * f(a / b) is evaluated directly from the clipped ratio. The limits f(0) and f(t)/t at
  infinity default to numerical estimates.
  """
  _REGISTRY.check_free(name, overwrite=overwrite)  # before f is evaluated below
  if validate:
    check_generator(name, f)
  if f_at_zero is None:
    f_at_zero = float(f(jnp.asarray(1e-30, jnp.float32)))
  if slope_at_inf is None:
    slope_at_inf = _estimate_slope_at_inf(f)
  div = Divergence(
    name=name,
    f=f,
    perspective=perspective or generic_perspective(f),
    f_at_zero=f_at_zero,
    slope_at_inf=slope_at_inf,
    description=description,
  )
  return _REGISTRY.register(name, div, overwrite=overwrite)


def alpha(alpha_value: float) -> Divergence:
  """The alpha family f_a(t) = (t^a - 1 - a (t - 1)) / (a (a - 1)), normalised with f''(1) = 1.

  a -> 0 is KL(mu || pi), a = 1/2 is 2 x squared Hellinger, a -> 1 is KL(pi || mu), a = 2 is
  chi^2 / 2. Registered on first use as "alpha:<a>".
  """
  alpha_value = float(alpha_value)
  name = f"alpha:{alpha_value:g}"
  if name not in _REGISTRY:
    f0, slope = _alpha_limits(alpha_value)
    _REGISTRY.register(
      name,
      Divergence(
        name=name,
        f=_alpha_f(alpha_value),
        perspective=_alpha_perspective(alpha_value),
        f_at_zero=f0,
        slope_at_inf=slope,
        description=f"alpha-divergence, alpha = {alpha_value:g}",
      ),
    )
  return _REGISTRY.get(name)


def get(name: str | Divergence) -> Divergence:
  """Looks up a divergence by name ("kl", "alpha:0.5", ...); passes Divergence objects through."""
  if isinstance(name, Divergence):
    return name
  if name not in _REGISTRY and isinstance(name, str) and name.startswith("alpha:"):
    try:
      value = float(name.split(":", 1)[1])
    except ValueError:
      raise errors.ConfigError(
        f"bad alpha divergence name {name!r}; expected e.g. 'alpha:0.5'"
      ) from None
    return alpha(value)
  return _REGISTRY.get(name)  # UnknownNameError naming the registered divergences


def names() -> list[str]:
  """Registered divergence names, the paper's four first."""
  return _REGISTRY.names()


register(
  "tv",
  lambda t: 0.5 * jnp.abs(t - 1.0),
  perspective=_tv_perspective,
  f_at_zero=0.5,
  slope_at_inf=0.5,
  description="total variation, 1/2 sum |pi - mu|",
  validate=False,
)
register(
  "kl",
  lambda t: t - 1.0 - jnp.log(t),
  perspective=_kl_perspective,
  f_at_zero=math.inf,
  slope_at_inf=1.0,
  description="KL(mu || pi), per sample Schulman's k3",
  validate=False,
)
register(
  "hellinger",
  lambda t: (jnp.sqrt(t) - 1.0) ** 2,
  perspective=_hellinger_perspective,
  f_at_zero=1.0,
  slope_at_inf=1.0,
  description="squared Hellinger, sum (sqrt pi - sqrt mu)^2",
  validate=False,
)
register(
  "chi2",
  lambda t: (t - 1.0) ** 2,
  perspective=_chi2_perspective,
  f_at_zero=1.0,
  slope_at_inf=math.inf,
  description="Pearson chi^2(pi || mu)",
  validate=False,
)
register(
  "forward_kl",
  lambda t: t * jnp.log(t) - t + 1.0,
  perspective=_forward_kl_perspective,
  f_at_zero=1.0,
  slope_at_inf=math.inf,
  description="KL(pi || mu)",
  validate=False,
)
register(
  "js",
  lambda t: t * jnp.log(t) - (1.0 + t) * jnp.log((1.0 + t) / 2.0),
  perspective=_js_perspective,
  f_at_zero=math.log(2.0),
  slope_at_inf=math.log(2.0),
  description="Jensen-Shannon (unscaled: sum of both KLs to the midpoint)",
  validate=False,
)
