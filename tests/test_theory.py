"""Tests of gppo_jax.algorithm.theory: L_f, tv_radius, quadratic constants, level sets, the CLI."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gppo_jax.algorithm import divergences as divs
from gppo_jax.algorithm import estimators as ests
from gppo_jax.algorithm import presets
from gppo_jax.algorithm import theory as th

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NAMES = ("tv", "kl", "hellinger", "chi2", "forward_kl", "js", "alpha:0.5")
CELLS = [(d, e) for d in ("tv", "kl", "hellinger", "chi2") for e in ("mc", "binary", "atomic")]


def f_divergence(name: str, p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """D_f(P || Q) = sum_a q f(p / q) in float64 over the last axis (full-support Q)."""
  with jax.enable_x64(True):
    terms = q * np.asarray(divs.get(name).f(jnp.asarray(p / q, jnp.float64)))
  return np.sum(terms, axis=-1)


def test_lower_bound_closed_forms():
  v = np.linspace(0.0, 0.99, 67)
  np.testing.assert_allclose(th.lower_bound("tv", v), v, rtol=1e-12, atol=1e-15)
  chi2 = np.where(v <= 0.5, 4 * v**2, v / (1 - v))
  np.testing.assert_allclose(th.lower_bound("chi2", v), chi2, rtol=1e-10, atol=1e-15)
  hell = 2 * (1 - np.sqrt(1 - v**2))
  np.testing.assert_allclose(th.lower_bound("hellinger", v), hell, rtol=1e-10, atol=1e-15)
  # alpha = 1/2 is twice squared Hellinger; the endpoints V = 1.
  np.testing.assert_allclose(th.lower_bound("alpha:0.5", v), 2 * hell, rtol=1e-9, atol=1e-15)
  assert th.lower_bound("tv", 1.0) == pytest.approx(1.0)
  assert th.lower_bound("hellinger", 1.0) == pytest.approx(2.0)
  assert th.lower_bound("kl", 1.0) == math.inf and th.lower_bound("chi2", 1.0) == math.inf
  assert isinstance(th.lower_bound("kl", 0.3), float)


def test_kl_lower_bound_series_and_symmetry():
  # The series of the tight Pinsker bound (Fedotov, Harremoes, Topsoe 2003), in l1 distance
  # x = 2 V: x^2 / 2 + x^4 / 36 + x^6 / 270 + 221 x^8 / 340200 + O(x^10).
  x = 2 * np.array([0.02, 0.05, 0.1])
  series = x**2 / 2 + x**4 / 36 + x**6 / 270 + 221 * x**8 / 340200
  np.testing.assert_allclose(th.lower_bound("kl", x / 2), series, rtol=1e-9)
  grid = np.linspace(0.0, 0.98, 50)
  assert np.all(th.lower_bound("kl", grid) >= 2 * grid**2 - 1e-15)  # Pinsker
  # L_f = L_g for the conjugate g(t) = t f(1/t): KL(mu || pi) and KL(pi || mu) share the bound.
  np.testing.assert_allclose(th.lower_bound("kl", grid), th.lower_bound("forward_kl", grid), 1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_lower_bound_below_true_divergence_and_tight(name):
  rng = np.random.default_rng(0)
  k = 6
  q = rng.dirichlet(np.ones(k), size=200)
  # Mix far and near pairs so that V covers (0, 1).
  lam = rng.uniform(0.0, 1.0, size=(200, 1)) ** 2
  p = (1 - lam) * q + lam * rng.dirichlet(np.ones(k) * 0.3, size=200)
  p = np.maximum(p, 1e-12)
  p /= p.sum(-1, keepdims=True)
  v = 0.5 * np.abs(p - q).sum(-1)
  d = f_divergence(name, p, q)
  bound = th.lower_bound(name, v)
  assert np.all(bound <= d * (1 + 1e-9) + 1e-14), np.max(bound - d)
  # Equality for the optimal binary pair P = (beta + V, 1 - beta - V), Q = (beta, 1 - beta).
  vs = np.array([0.05, 0.2, 0.45, 0.7])
  value, beta = th.lower_bound(name, vs, return_beta=True)
  interior = (beta > 0) & (beta < 1 - vs)
  pb = np.stack([beta + vs, 1 - beta - vs], -1)[interior]
  qb = np.stack([beta, 1 - beta], -1)[interior]
  np.testing.assert_allclose(f_divergence(name, pb, qb), value[interior], rtol=1e-10, atol=1e-15)
  # No other binary pair with the same TV does better (brute force over a beta grid).
  betas = np.linspace(1e-6, 1 - vs - 1e-6, 2001, axis=-1)  # [4, 2001]
  pg = np.stack([betas + vs[:, None], 1 - betas - vs[:, None]], -1)
  qg = np.stack([betas, 1 - betas], -1)
  assert np.all(value <= f_divergence(name, pg, qg).min(-1) + 1e-13)


@pytest.mark.parametrize(
  "name,c_global,c_local,f2",
  [
    ("tv", 1.0, math.inf, math.inf),
    ("kl", 2.0, 2.0, 1.0),
    ("chi2", 4.0, 4.0, 2.0),
    ("hellinger", 1.0, 1.0, 0.5),
    ("forward_kl", 2.0, 2.0, 1.0),
    ("js", 1.0, 1.0, 0.5),
    ("alpha:2", 2.0, 2.0, 1.0),
  ],
)
def test_quadratic_constants(name, c_global, c_local, f2):
  assert th.quadratic_constant(name) == pytest.approx(c_global, rel=1e-7)
  assert th.local_quadratic_constant(name) == pytest.approx(c_local, rel=1e-7)
  assert th.curvature_at_one(name) == pytest.approx(f2, rel=1e-7)
  v = np.linspace(0.001, 1.0, 300)
  assert np.all(th.lower_bound(name, v) >= th.quadratic_constant(name) * v**2 * (1 - 1e-9))


@pytest.mark.parametrize("name", ["kl", "hellinger", "chi2", "js", "tv"])
def test_tv_radius_is_the_inverse_of_lower_bound(name):
  delta = np.array([1e-4, 0.01, 0.0231, 0.1, 0.3])
  radius = th.tv_radius(name, delta)
  assert np.all(np.diff(radius) > 0)
  np.testing.assert_allclose(th.lower_bound(name, radius), delta, rtol=1e-9)
  assert np.all(th.lower_bound(name, np.minimum(radius * (1 + 1e-6), 1.0)) > delta)
  c_f = th.quadratic_constant(name)
  assert np.all(radius <= np.sqrt(delta / c_f) * (1 + 1e-9))


def test_tv_radius_closed_forms():
  delta = np.array([0.01, 0.1, 0.5, 0.99, 2.0])
  np.testing.assert_allclose(th.tv_radius("tv", delta), np.minimum(delta, 1.0), rtol=1e-12)
  chi2 = np.where(delta <= 1, np.sqrt(delta) / 2, delta / (1 + delta))
  np.testing.assert_allclose(th.tv_radius("chi2", delta), chi2, rtol=1e-10)
  # Hellinger: L = 2 (1 - sqrt(1 - V^2)) reaches its maximum 2 at V = 1.
  d = np.array([0.01, 1.0, 1.9, 2.5])
  hell = np.sqrt(1 - np.minimum(1 - d / 2, 1.0).clip(0) ** 2)
  np.testing.assert_allclose(th.tv_radius("hellinger", d), hell, rtol=1e-10)
  assert isinstance(th.tv_radius("kl", 0.05), float)


def test_default_deltas():
  assert th.default_delta("tv") == pytest.approx(0.1, rel=1e-12)
  assert th.default_delta("kl") == pytest.approx(-0.2 - math.log(0.8), rel=1e-12)
  assert th.default_delta("kl") == pytest.approx(0.0231, abs=1e-4)
  assert th.default_delta("hellinger") == pytest.approx((math.sqrt(0.8) - 1) ** 2, rel=1e-12)
  assert th.default_delta("hellinger") == pytest.approx(0.0111, abs=1e-4)
  assert th.default_delta("chi2") == pytest.approx(0.04, rel=1e-12)
  assert th.default_delta("chi2", eps=0.1) == pytest.approx(0.01, rel=1e-12)
  # The MC level set at the default delta reaches down to exactly 1 - eps.
  for name in ("tv", "kl", "hellinger", "chi2"):
    r_lo, _ = th.level_set(name, "mc", th.default_delta(name), 0.5)
    assert r_lo == pytest.approx(0.8, abs=1e-6)


def test_closed_form_default_deltas_equal_the_generators():
  """presets.default_delta (plain Python, what configs use) = theory.default_delta (jax, float64)
  for every built-in divergence and some of the alpha family."""
  assert set(presets.GENERATORS) == set(th.CLI_DIVERGENCES) <= set(divs.names())
  alphas = ("alpha:0", "alpha:0.5", "alpha:1", "alpha:2", "alpha:-1")
  for name in (*th.CLI_DIVERGENCES, *alphas):
    for eps in (0.01, 0.1, 0.2, 0.28, 0.5, 0.9):
      closed, generator = presets.default_delta(name, eps), th.default_delta(name, eps)
      assert isinstance(closed, float) and closed > 0
      assert abs(closed - generator) <= 1e-12 * max(1.0, abs(generator)), (name, eps)
  assert presets.default_delta("kl") == pytest.approx(0.0231, abs=1e-4)
  with pytest.raises(ValueError, match="eps must lie in"):
    presets.default_delta("kl", eps=0.0)


def test_loading_every_config_starts_no_jax_backend():
  """Config files (and the presets and default radii they use) compile and run nothing."""
  code = """if True:
    import glob, importlib.util, os, sys
    from jax._src import xla_bridge
    paths = sorted(glob.glob(os.path.join(sys.argv[1], "configs", "*.py")))
    for path in paths:
      spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      for arg in (None, "smoke"):
        module.get_config(arg)
    assert len(paths) > 10, paths
    assert not xla_bridge._backends and not xla_bridge.backends_are_initialized()
    print("no backend after", len(paths), "configs")
  """
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run(
    [sys.executable, "-c", code, REPO], capture_output=True, text=True, cwd=REPO, env=env
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "no backend after" in proc.stdout


def test_default_delta_and_level_sets_over_random_draws():
  # delta = f(1 - eps) puts the MC level set's lower end at exactly 1 - eps, for any eps and q
  # (docs/math.md#default-delta); TV-MC at eps / 2 is PPO's [1 - eps, 1 + eps] and chi2-atomic is
  # RIPO's |r - 1| <= sqrt(delta / q) (docs/math.md#reductions), for random deltas and q.
  rng = np.random.default_rng(0)
  f = {
    "tv": lambda t: 0.5 * abs(t - 1),
    "kl": lambda t: t - 1 - math.log(t),
    "hellinger": lambda t: (math.sqrt(t) - 1) ** 2,
    "chi2": lambda t: (t - 1) ** 2,
  }
  q = np.exp(rng.uniform(np.log(1e-4), np.log(0.999), 6))
  for eps in rng.uniform(0.02, 0.6, 3):
    for name in f:
      delta = th.default_delta(name, eps)
      assert delta == pytest.approx(f[name](1 - eps), rel=1e-9)
      r_lo, r_hi = th.level_set(name, "mc", delta, q)
      np.testing.assert_allclose(r_lo, 1 - eps, rtol=1e-5)
      assert np.all(r_hi >= np.minimum(1 + eps, 1 / q) * (1 - 1e-6))  # f(1 + e) <= f(1 - e)
    r_lo, r_hi = th.level_set("tv", "mc", eps / 2, q)
    np.testing.assert_allclose(r_hi, np.minimum(1 + eps, 1 / q), rtol=1e-5)
  delta = np.exp(rng.uniform(np.log(1e-3), np.log(0.5), q.size))
  r_lo, r_hi = th.level_set("chi2", "atomic", delta, q)
  bound = np.sqrt(delta / q)
  np.testing.assert_allclose(r_lo, np.maximum(1 - bound, 0.0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(r_hi, np.minimum(1 + bound, 1 / q), rtol=1e-5)


def test_level_set_closed_forms():
  q = np.array([1e-6, 1e-3, 0.05, 0.3, 0.5, 0.9, 1 - 1e-7])
  delta = 0.1
  # TV-MC: |r - 1| / 2 <= delta, capped at 1 / q.
  r_lo, r_hi = th.level_set("tv", "mc", delta, q)
  np.testing.assert_allclose(r_lo, 1 - 2 * delta, rtol=1e-6)
  np.testing.assert_allclose(r_hi, np.minimum(1 + 2 * delta, 1 / q), rtol=1e-6)
  # TV-binary: |p - q| <= delta (DPPO); TV-atomic: |p - q| / 2 <= delta.
  for est, width in (("binary", delta), ("atomic", 2 * delta)):
    r_lo, r_hi = th.level_set("tv", est, delta, q)
    np.testing.assert_allclose(r_lo, np.maximum(1 - width / q, 0.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r_hi, np.minimum(1 + width / q, 1 / q), rtol=1e-5)
  # chi2-atomic (RIPO): |r - 1| <= sqrt(delta / q).
  d = 0.05
  r_lo, r_hi = th.level_set("chi2", "atomic", d, q)
  np.testing.assert_allclose(r_lo, np.maximum(1 - np.sqrt(d / q), 0.0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(r_hi, np.minimum(1 + np.sqrt(d / q), 1 / q), rtol=1e-5)
  # KL-MC: delta = 0.0231 gives about [0.800, 1.231], independent of q (DAPO's clip-higher shape).
  r_lo, r_hi = th.level_set("kl", "mc", 0.0231, np.array([0.01, 0.5]))
  np.testing.assert_allclose(r_lo, 0.800, atol=5e-4)
  np.testing.assert_allclose(r_hi, 1.231, atol=5e-4)
  assert isinstance(r_lo, np.ndarray) and isinstance(th.level_set("kl", "mc", 0.02, 0.5)[0], float)


@pytest.mark.parametrize("div,est", CELLS + [("forward_kl", "binary"), ("js", "atomic")])
def test_level_set_endpoints_and_monotonicity(div, est):
  q = np.array([1e-5, 3e-3, 0.04, 0.2, 0.5, 0.8, 0.97])
  deltas = (0.005, 0.02, 0.08)
  prev = None
  for delta in deltas:
    r_lo, r_hi = th.level_set(div, est, delta, q)
    assert np.all(r_lo <= 1) and np.all(r_hi >= 1) and np.all(r_hi <= 1 / q * (1 + 1e-12))
    # The endpoints sit on the level delta; just outside them the estimate exceeds delta.
    # (r_lo within 1e-6 of 0 is the boundary p = 0 itself, e.g. TV-atomic with delta = q / 2.)
    finite = np.stack([r_lo > 1e-6, r_hi < 1 / q])
    r = np.where(finite, np.stack([r_lo, r_hi]), 1.0)
    r = np.stack([r, r * np.array([1 - 1e-3, 1 + 1e-3])[:, None]])  # [2, 2, len(q)]
    value = np.asarray(ests.estimate(div, est, np.log(r * q), np.broadcast_to(np.log(q), r.shape)))
    np.testing.assert_allclose(value[0][finite], delta, rtol=2e-3)
    assert np.all(value[1][finite] > delta)
    if prev is not None:  # a larger delta gives a wider interval
      assert np.all(r_lo <= prev[0]) and np.all(r_hi >= prev[1])
      assert np.any(r_lo < prev[0]) and np.any(r_hi > prev[1])
    prev = (r_lo, r_hi)


def test_user_registered_divergence_works_by_name():
  name = "test_theory_chi2_x3"
  divs.register(name, lambda t: 3.0 * (t - 1.0) ** 2, overwrite=True)
  v = np.array([0.1, 0.3, 0.6])
  np.testing.assert_allclose(th.lower_bound(name, v), 3 * th.lower_bound("chi2", v), rtol=1e-9)
  assert th.quadratic_constant(name) == pytest.approx(12.0, rel=1e-6)
  assert th.default_delta(name) == pytest.approx(0.12, rel=1e-6)
  assert presets.default_delta(name) == pytest.approx(0.12, rel=1e-6)  # through theory
  r_lo, r_hi = th.level_set(name, "mc", 0.12, 0.5)
  assert (r_lo, r_hi) == (pytest.approx(0.8, rel=1e-5), pytest.approx(1.2, rel=1e-5))
  assert th.tv_radius(name, 0.12) == pytest.approx(math.sqrt(0.01), rel=1e-9)


def test_errors_name_the_problem():
  with pytest.raises(ValueError, match="valid names:.*kl"):
    th.lower_bound("not_a_divergence", 0.1)
  with pytest.raises(ValueError, match="valid names:.*atomic"):
    th.level_set("kl", "not_an_estimator", 0.1, 0.5)
  for bad in (0.0, -0.1):
    with pytest.raises(ValueError, match="delta must be > 0"):
      th.tv_radius("kl", bad)
    with pytest.raises(ValueError, match="delta must be > 0"):
      th.level_set("kl", "mc", [0.1, bad], 0.5)
  with pytest.raises(ValueError, match="V must lie in"):
    th.lower_bound("kl", 1.5)
  with pytest.raises(ValueError, match="q must lie in"):
    th.level_set("kl", "mc", 0.1, [0.5, 0.0])
  with pytest.raises(ValueError, match="eps must lie in"):
    th.default_delta("kl", eps=1.0)
  with pytest.raises(ValueError, match="per-token estimator"):
    th.level_set("kl", "topk", 0.1, 0.5)


def test_cli_prints_constants_and_writes_plots(tmp_path, capsys):
  out = tmp_path / "plots"
  assert th.main(["--out", str(out), "--divergences", "tv,kl", "--eps", "0.2"]) == 0
  printed = capsys.readouterr().out
  assert "C_f global" in printed and "tv_radius" in printed
  kl_row = next(line for line in printed.splitlines() if line.startswith("kl "))
  assert "0.023144" in kl_row  # default delta f(0.8)
  for png in ("level_sets.png", "lower_bounds.png"):
    path = out / png
    assert path.exists() and os.path.getsize(path) > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in printed
  with pytest.raises(ValueError, match="valid names"):
    th.main(["--out", str(out), "--divergences", "tv,nope"])
