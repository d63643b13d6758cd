"""Stopping and resuming: real signals to real training processes, crashes, locks, bad checkpoints.

The property throughout: however a run is stopped (SIGTERM, Ctrl-C, a second signal during the
save, SIGKILL), rerunning the same command ends with exactly the metrics and parameters of an
uninterrupted run with the same seed, and the logs hold each iteration once.
"""

import concurrent.futures
import glob
import json
import os
import subprocess
import sys
import time
import types

import conftest
import jax
import numpy as np
import pytest

from gppo_jax import train
from gppo_jax.trainer import checkpointing, experiment, metric_writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "preemption_child.py")
ITERATIONS = 7
OVERRIDES = [
  f"--config.iterations={ITERATIONS}",
  "--config.checkpoint.every=2",
  "--config.checkpoint.keep=10",
  "--config.eval.every=3",
  "--config.eval.k=0",
  "--config.eval.num_problems=16",
  "--config.rollout.prompts_per_iter=4",
  "--config.warmstart.max_steps=10",
]


def run_child(workdir, plan=(), timeout=300):
  env = conftest.one_device_env()  # the child is an ordinary single-device run
  env.pop("GPPO_TEST_SIGNALS", None)
  env.update(JAX_PLATFORMS="cpu", GPPO_TEST_SIGNALS=json.dumps(list(plan)))
  cmd = [
    sys.executable,
    CHILD,
    "--config=" + os.path.join(REPO, "configs", "kl_atomic.py") + ":smoke",
    f"--workdir={workdir}",
    *OVERRIDES,
  ]
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def rows(workdir):
  out = []
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    row = json.loads(line)
    out.append({k: v for k, v in row.items() if k != "time" and not k.startswith("time/")})
  return out


def tb_scalars(workdir):
  """{tag: [(step, value)]} as TensorBoard shows the run: read by its own loader, which drops
  what a resumed run's SessionLog.START event purges."""
  from tensorboard.backend.event_processing import event_accumulator as ea

  acc = ea.EventAccumulator(os.path.join(workdir, "tensorboard"), size_guidance={ea.SCALARS: 0})
  acc.Reload()
  return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def tb_events(workdir):
  """(tag, step) of every scalar TensorBoard shows for the run."""
  return [(t, step) for t, points in tb_scalars(workdir).items() for step, _ in points]


def final_state(workdir, step=ITERATIONS):
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  return jax.tree.leaves(conftest.read_checkpoint_item(path))


def assert_same_run(got_dir, want_dir):
  got, want = rows(got_dir), rows(want_dir)
  assert [r["step"] for r in got] == list(range(ITERATIONS + 1))  # each iteration once
  assert got == want
  for a, b in zip(final_state(got_dir), final_state(want_dir), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  events = tb_events(got_dir)
  assert len(events) == len(set(events))  # each (tag, step) once in TensorBoard
  assert set(events) == set(tb_events(want_dir))
  assert not glob.glob(os.path.join(got_dir, "checkpoints", "*tmp*"))


def test_signals_at_every_moment_resume_to_the_uninterrupted_run(tmp_path):
  """SIGTERM mid-rollout, Ctrl-C mid-update of the first iteration after a resume, SIGKILL after
  a save (logs hold iterations past the checkpoint), SIGTERM plus a second signal during a
  periodic save, then a clean finish: equal to one uninterrupted run."""
  ref, wd = str(tmp_path / "ref"), str(tmp_path / "chain")
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    reference = pool.submit(run_child, ref)
    # 1. SIGTERM while iteration 2 samples: it completes, is saved (periodic), the run exits 0.
    p = run_child(wd, [{"at": "rollout", "call": 2, "signals": ["SIGTERM"]}])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "preempted after iteration 2; rerun the same command to resume" in p.stdout
    assert "Traceback" not in p.stderr
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["2"]
    # 2. Ctrl-C during the first update after the resume: iteration 3 is saved on the way out.
    p = run_child(wd, [{"at": "update", "call": 1, "signals": ["SIGINT"]}])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stderr and "at iteration 2/7" in p.stderr
    assert "preempted after iteration 3" in p.stdout
    assert rows(wd)[-1]["step"] == 3
    # 3. SIGKILL while iteration 6 samples: iterations 4 and 5 ran and were logged; the async
    # save of iteration 4 may or may not have completed before the kill.
    p = run_child(wd, [{"at": "rollout", "call": 3, "signals": ["SIGKILL"]}])
    assert p.returncode == -9
    assert rows(wd)[-1]["step"] == 5
    saved = max(int(x) for x in os.listdir(os.path.join(wd, "checkpoints")) if x.isdigit())
    assert saved in (3, 4)
    # 4. SIGTERM, then SIGINT, while the next periodic checkpoint (iteration 4 or 6) is written.
    p = run_child(wd, [{"at": "save", "call": 1, "signals": ["SIGTERM", "SIGINT"]}])
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"at iteration {saved}/7" in p.stderr
    stopped = 4 if saved == 3 else 6
    assert f"preempted after iteration {stopped}" in p.stdout
    assert "already stopping" in p.stderr
    assert rows(wd)[-1]["step"] == stopped  # the rows past the checkpoint were replayed once
    # 5. The rest.
    p = run_child(wd)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "finished 7 iterations" in p.stdout
    r = reference.result()
    assert r.returncode == 0, r.stderr[-3000:]
  assert_same_run(wd, ref)


def test_signal_during_set_up_exits_cleanly(tmp_path):
  """Before the first iteration there is nothing to save: exit 0 at once, no checkpoint."""
  wd = str(tmp_path / "run")
  env = conftest.one_device_env()
  env["JAX_PLATFORMS"] = "cpu"
  code = (
    "import os, signal, sys\n"
    f"sys.argv = ['train', '--config={REPO}/configs/kl_atomic.py:smoke', '--workdir={wd}']\n"
    "from gppo_jax import train\n"
    "from gppo_jax.trainer import experiment\n"
    "real = experiment.build_policy\n"
    "def build(*a, **k):\n"
    "  os.kill(os.getpid(), signal.SIGTERM)\n"
    "  return real(*a, **k)\n"
    "experiment.build_policy = build\n"
    "from absl import app, flags\n"
    "from ml_collections import config_flags\n"
    "config_flags.DEFINE_config_file('config', None, '')\n"
    "flags.DEFINE_string('workdir', None, '')\n"
    "app.run(train.main)\n"
  )
  p = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
  )
  assert p.returncode == 0, p.stderr[-3000:]
  assert "preempted during set-up; rerun the same command to resume" in p.stdout
  assert "Traceback" not in p.stderr
  assert not glob.glob(os.path.join(wd, "checkpoints", "[0-9]*"))


# --- In-process: locks, non-finite states, unreadable checkpoints, log truncation ---------------


def _config(iterations=3):
  import importlib.util

  spec = importlib.util.spec_from_file_location("kl_atomic", f"{REPO}/configs/kl_atomic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  c.iterations = iterations
  c.checkpoint.every = 1
  c.checkpoint.keep = 10
  c.eval.every = 100
  c.eval.k = 0
  c.eval.num_problems = 16
  c.rollout.prompts_per_iter = 4
  c.warmstart.max_steps = 10
  return c


def test_a_second_trainer_on_a_workdir_is_refused_and_a_stale_lock_is_taken_over(tmp_path, caplog):
  wd = str(tmp_path / "run")
  with experiment.WorkdirLock(wd):
    with pytest.raises(experiment.WorkdirBusyError, match=f"pid {os.getpid()} on host"):
      train.train_and_evaluate(_config(1), wd)
    with pytest.raises(experiment.WorkdirBusyError):
      experiment.WorkdirLock(wd).acquire()
  assert not os.path.exists(os.path.join(wd, "config.json"))  # refused before writing anything
  # A lock file left by a process that died (the OS lock went with it) is taken over.
  with open(os.path.join(wd, "lock"), "w") as f:
    json.dump({"pid": 999999, "host": "elsewhere", "command": "train"}, f)
  with caplog.at_level("WARNING", logger="gppo_jax"):
    lock = experiment.WorkdirLock(wd).acquire()
  assert "stale lock of pid 999999 on host elsewhere" in caplog.text
  assert json.load(open(os.path.join(wd, "lock")))["pid"] == os.getpid()
  lock.release()


def test_a_non_finite_update_is_never_saved(tmp_path, monkeypatch):
  """Parameters made NaN by an iteration's update: the run stops before saving that iteration."""
  # Wraps the run's update as the trainer gets it: one built by an earlier run of the same
  # settings in this process (sharding.reuse) is poisoned too.
  real = train._jit_update
  calls = []

  def poisoned(*args, **kwargs):
    update = real(*args, **kwargs)

    def wrapped(state, batch, rng):
      state, metrics = update(state, batch, rng)
      calls.append(1)
      if len(calls) == 2:  # the second iteration's update ends with NaN parameters
        params = jax.tree.map(lambda x: x * np.nan, state.params)
        state = state.replace(params=params)
      return state, metrics

    return wrapped

  monkeypatch.setattr(train, "_jit_update", poisoned)
  wd = str(tmp_path / "run")
  with pytest.raises(train.NonFiniteError, match="non-finite parameters after iteration 2") as e:
    train.train_and_evaluate(_config(3), wd)
  assert "the newest checkpoint is step 1" in str(e.value)
  assert "optim.lr" in str(e.value)
  assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["1"]
  assert [r["step"] for r in rows(wd)] == [0, 1]


def test_check_finite_names_each_non_finite_part():
  """Parameters and optimizer state are checked together (one device call); each one that holds
  NaN or inf is named, integer leaves are ignored, and a finite state passes."""
  ok = {"w": np.ones(3, np.float32), "n": np.int32(7)}
  bad = {"w": np.array([1.0, np.inf], np.float32), "n": np.int32(7)}
  state = lambda p, o: types.SimpleNamespace(params=p, opt_state=o)
  adv = np.zeros(4)
  train.check_finite(state(ok, ok), {}, adv, iteration=1, newest=None)
  for p, o, want in ((bad, ok, "parameters after"), (ok, bad, "optimizer state after")):
    with pytest.raises(train.NonFiniteError, match=f"non-finite {want} iteration 5"):
      train.check_finite(state(p, o), {}, adv, iteration=5, newest=None)
  with pytest.raises(train.NonFiniteError, match="non-finite parameters, optimizer state"):
    train.check_finite(state(bad, bad), {}, adv, iteration=5, newest=None)


def test_an_unreadable_latest_checkpoint_is_skipped_and_the_run_resumes(tmp_path, caplog):
  wd = str(tmp_path / "run")
  want = str(tmp_path / "ref")
  train.train_and_evaluate(_config(3), want)
  train.train_and_evaluate(_config(2), wd)
  # Step 2 looks complete but its array data is gone (a lost shard, a truncated copy).
  for path in glob.glob(
    os.path.join(wd, "checkpoints", "2", "state", "**", "manifest.ocdbt"), recursive=True
  ):
    os.remove(path)
  with caplog.at_level("WARNING", logger="gppo_jax"):
    summary = train.train_and_evaluate(_config(3), wd)
  assert "checkpoint step 2" in caplog.text and "unreadable" in caplog.text
  assert "resuming from step 1" in caplog.text
  assert summary["iterations_done"] == 3
  assert os.listdir(os.path.join(wd, "checkpoints", checkpointing.UNREADABLE))
  assert rows(wd) == rows(want)  # iteration 2 logged once: the replay replaced the first one
  for a, b in zip(final_state(wd, 3), final_state(want, 3), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
  wd = str(tmp_path / "run")
  train.train_and_evaluate(_config(1), wd)
  for path in glob.glob(
    os.path.join(wd, "checkpoints", "1", "state", "**", "manifest.ocdbt"), recursive=True
  ):
    os.remove(path)
  with pytest.raises(checkpointing.CheckpointError, match="no readable checkpoint in .*step 1"):
    train.train_and_evaluate(_config(2), wd)


def test_resume_truncation_drops_rows_and_events_past_the_step(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "w") as f:
    for step in range(6):
      f.write(json.dumps({"step": step, "x": step}) + "\n")
    f.write('{"step": 6, "x"')  # torn by a kill
  assert metric_writers.truncate_jsonl(path, 3) == 3
  assert [json.loads(x)["step"] for x in open(path)] == [0, 1, 2, 3]
  # A whole last row without its newline is kept, and the file ends on a whole line again.
  with open(path, "a") as f:
    f.write('{"step": 4, "x": 1e-05}')
  assert metric_writers.truncate_jsonl(path, 4) == 0
  assert open(path).read().endswith('{"step": 4, "x": 1e-05}\n')
  # TensorBoard: a run logs steps 0-5 and is killed; resumed from step 2 it logs 3-5 again.
  logs = str(tmp_path / "tb")
  w = metric_writers.MetricWriter(logs, total_steps=6, enabled=True, progress=False)
  for step in range(6):
    w.write(step, {"a/b": float(step), "c": 1.0})
  w.close()
  time.sleep(1.05 - time.time() % 1)  # event files are named by the second they start in
  w = metric_writers.MetricWriter(logs, total_steps=6, resume_step=2, enabled=True, progress=False)
  for step in range(3, 6):
    w.write(step, {"a/b": 10.0 * step, "c": 1.0})
  w.close()
  assert len(glob.glob(os.path.join(logs, "tensorboard", "events.*"))) == 2  # nothing rewritten
  assert tb_scalars(logs)["a/b"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
  assert sorted(tb_events(logs)) == sorted((t, s) for t in ("a/b", "c") for s in range(6))


def test_metric_writer_loads_tensorboardx_without_torch_and_torch_still_imports(tmp_path):
  """tensorboardX would import an installed torch (seconds of every command's start-up)."""
  pytest.importorskip("torch")
  script = f"""
import sys
from gppo_jax.trainer import metric_writers
w = metric_writers.MetricWriter({str(tmp_path)!r}, total_steps=3, resume_step=0, progress=False)
w.write(1, {{"a": 1.0}})
w.close()
assert "torch" not in sys.modules, "tensorboardX imported torch"
import torch
assert float(torch.ones(3).sum()) == 3.0
"""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  p = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=REPO
  )
  assert p.returncode == 0, p.stderr[-3000:]
  assert tb_events(str(tmp_path)) == [("a", 1)]
