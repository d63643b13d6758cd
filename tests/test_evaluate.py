"""`python -m gppo_jax.evaluate` is read-only and says at once when there is nothing to evaluate."""

import importlib.util
import os
import subprocess
import sys

import pytest

from gppo_jax import errors, evaluate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke_config(tmp_path):
  spec = importlib.util.spec_from_file_location("kl_atomic", f"{REPO}/configs/kl_atomic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  c.warmstart.cache_dir = str(tmp_path / "cache")  # a warm start would create it
  return c


def test_a_wrong_workdir_or_checkpoint_is_reported_before_any_work(tmp_path, monkeypatch):
  c = smoke_config(tmp_path)
  monkeypatch.setattr(
    evaluate.experiment, "build_policy", lambda *a, **k: pytest.fail("built a policy")
  )
  missing = tmp_path / "no_such_run"
  with pytest.raises(errors.UserError, match="has no checkpoints folder"):
    evaluate.evaluate_checkpoint(c, str(missing))
  with pytest.raises(errors.UserError, match="--checkpoint=.*no_such_run"):
    evaluate.evaluate_checkpoint(c, str(tmp_path), which=str(missing))
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  with pytest.raises(errors.UserError, match="no checkpoint in .*--checkpoint=init"):
    evaluate.evaluate_checkpoint(c, str(tmp_path / "empty"))
  assert not missing.exists() and not (tmp_path / "cache").exists()  # nothing was created
  assert os.listdir(tmp_path / "empty" / "checkpoints") == []


def test_the_command_line_prints_one_line_and_exits_2(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "gppo_jax.evaluate",
      f"--config={REPO}/configs/kl_atomic.py:smoke",
      f"--workdir={tmp_path / 'nothing_here'}",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
  )
  assert p.returncode == 2, p.stderr[-2000:]
  lines = [x for x in p.stderr.splitlines() if x.strip()]
  assert lines[-1].startswith("error: --workdir=") and "Traceback" not in p.stderr
  assert not (tmp_path / "nothing_here").exists()
