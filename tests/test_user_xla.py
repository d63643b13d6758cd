"""The suite compiles with cheaper XLA settings than users' commands get (conftest.py: no LLVM
optimisation, the legacy fusion emitter). The tests marked `user_xla` (model parity against
transformers and the naive forward, the sampler's core, the bounded learning test's default cell)
are run again here in a child pytest under the build users run (GPPO_TEST_XLA_OPT=1), so a
miscompile or a numerical difference that only the optimised build shows fails the default run.
The child shares the session's compilation cache, whose keys include XLA_FLAGS: it reuses no
program compiled under the test-only flags.

`python -m pytest -q -m user_xla` with GPPO_TEST_XLA_OPT=1 runs the same subset by hand."""

import os
import re
import subprocess
import sys

import conftest
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INNER = "GPPO_TEST_USER_XLA_CHILD"  # set in the child: it never starts another child
# Each area the subset covers, by the file of its tests.
AREAS = {
  "tests/test_hf_checkpoint.py": "parity with transformers",
  "tests/test_model.py": "the KV cache and the chunked head against the naive forward",
  "tests/test_sampler.py": "the sampler",
  "tests/test_train.py": "learning",
  "tests/test_user_xla.py": "the child's own flags",
}


def _users_xla_flags() -> str:
  """The session's XLA_FLAGS without the suite's compile flags (the simulated devices stay)."""
  test_only = {f.split("=")[0] for f in (conftest.FAST_COMPILE, conftest.LEGACY_EMITTER)}
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in test_only]
  return " ".join(kept)


@pytest.mark.user_xla
def test_this_session_compiles_with_the_flags_it_claims():
  """Under GPPO_TEST_XLA_OPT=1 (the child below) no test-only compile flag is set; otherwise the
  fast-compile flag is; the 8 simulated devices in both."""
  import jax

  flags = os.environ["XLA_FLAGS"]
  assert "--xla_force_host_platform_device_count=8" in flags and len(jax.devices("cpu")) == 8
  if os.environ.get("GPPO_TEST_XLA_OPT"):
    assert conftest.COMPILE_FLAGS == ""
    assert "xla_backend_optimization_level" not in flags and "fusion_emitters" not in flags
  else:
    assert "--xla_backend_optimization_level=" in flags  # the suite's, or the user's own


def test_the_user_xla_tests_pass_under_users_xla_build():
  if os.environ.get(INNER):
    pytest.skip("this is the child run")
  if os.environ.get("GPPO_TEST_XLA_OPT"):
    pytest.skip("this session already compiles as users do: the user_xla tests ran above")
  env = dict(os.environ, GPPO_TEST_XLA_OPT="1", XLA_FLAGS=_users_xla_flags(), **{INNER: "1"})
  for name in list(env):
    if name in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST") or name.startswith("PYTEST_XDIST_"):
      env.pop(name)
  # One process: the session's other xdist worker already has the second core.
  cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-n", "0"]
  cmd += ["-m", "user_xla and not slow"]
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  out = p.stdout + p.stderr
  assert p.returncode == 0, out[-6000:]
  summary = re.search(r"(\d+) passed", out.strip().splitlines()[-1])
  assert summary and int(summary.group(1)) > 0, out[-3000:]
  passed = set(re.findall(r"^PASSED (tests/\S+?\.py)::", out, re.M))
  missing = {f"{AREAS[f]} ({f})" for f in AREAS if f not in passed}
  assert not missing, (missing, out[-3000:])
