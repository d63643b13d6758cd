"""The multi-host path for real: two CPU processes joined by jax.distributed train the smoke config.

Each process has 2 CPU devices (4 in the global mesh) and runs the very command a TPU worker runs
(`python -m gppo_jax.train` with GPPO_DISTRIBUTED=1), collectives over gloo. The run must match one
process holding all 4 devices: the same rollouts and updates, only process 0 writing logs, Orbax
checkpoints written jointly and resumed jointly.
"""

import json
import os
import socket
import subprocess
import sys

import conftest
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = [
  "--config.iterations=2",
  "--config.eval.every=2",
  "--config.eval.num_problems=16",
  "--config.checkpoint.every=1",
  "--config.warmstart.max_steps=10",
  "--config.warmstart.eval_every=5",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
  # A clean environment for jax.distributed, but the session's compilation cache (conftest).
  cache = ("JAX_COMPILATION_CACHE_", "JAX_PERSISTENT_CACHE_")
  env = {
    k: v
    for k, v in os.environ.items()
    if k.startswith(cache) or not k.startswith(("JAX_", "GPPO_"))
  }
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {conftest.COMPILE_FLAGS}",
    # No warm-start cache: the pair and the one-process reference run at once and would race to
    # write the same entry (a save failing on one process of the pair mid-collective would hang
    # the other). warmstart's agreement across processes is tested in test_train.
    GPPO_WARMSTART_CACHE="off",
  )
  env.update(extra)
  return env


def _train(workdir: str, env: dict, *extra: str) -> subprocess.Popen:
  # With GPPO_TEST_SIGNALS the command is the real one sending itself signals (preemption_child).
  entry = ["-m", "gppo_jax.train"]
  if "GPPO_TEST_SIGNALS" in env:
    entry = [os.path.join(REPO, "tests", "preemption_child.py")]
  cmd = [
    sys.executable,
    *entry,
    f"--config={os.path.join(REPO, 'configs', 'kl_atomic.py')}:smoke",
    f"--workdir={workdir}",
    *OVERRIDES,
    *extra,
  ]
  return subprocess.Popen(
    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )


def _two_processes(workdir: str, *extra: str, signals: dict | None = None) -> list[str]:
  """Runs both processes to the end; `signals` = {process id: GPPO_TEST_SIGNALS plan}."""
  port = _free_port()
  plans = {}
  if signals is not None:
    plans = {i: dict(GPPO_TEST_SIGNALS=json.dumps(signals.get(i, []))) for i in range(2)}
  procs = [
    _train(
      workdir,
      _env(
        2,
        GPPO_DISTRIBUTED="1",
        JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID=str(i),
        **plans.get(i, {}),
      ),
      *extra,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
  return outs


def _metrics(workdir: str) -> list[dict]:
  return [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multihost")
  one = _train(str(root / "one"), _env(4))  # the reference: one process, 4 devices
  outs = _two_processes(str(root / "two"))
  out_one = one.communicate(timeout=900)[0]
  assert one.returncode == 0, out_one[-4000:]
  return root, outs, out_one


def test_command_line_shows_our_logs_not_orbax_info(runs):
  *_, out_one = runs
  assert "resolved config:" in out_one and "held-out greedy accuracy" in out_one
  # absl turns an unset --verbosity into INFO after parsing; Orbax's per-save INFO lines must not
  # interleave with the progress bar.
  assert "checkpoint_manager.py" not in out_one, out_one[-3000:]


def test_two_processes_match_one(runs):
  root, outs, _ = runs
  one, two = _metrics(str(root / "one")), _metrics(str(root / "two"))
  assert [x["step"] for x in two] == [x["step"] for x in one] == [0, 1, 2]
  for a, b in zip(one, two, strict=True):
    for key in ("reward/mean", "eval/accuracy", "eval/pass@2", "response/length_mean"):
      if key in a:
        assert b[key] == a[key], (key, a["step"], a[key], b[key])  # same rollouts exactly
    for key in ("loss/total", "optim/grad_norm", "div/estimate_mean"):
      if key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
  # Only process 0 reports: one summary on its stdout, none from process 1.
  assert "held-out greedy accuracy" in outs[0] and "held-out greedy accuracy" not in outs[1]
  assert sorted(os.listdir(root / "two" / "checkpoints")) == ["1", "2"]


def test_two_processes_resume_jointly_and_stop_together_when_one_is_signalled(runs):
  """Only process 1 gets SIGTERM, during iteration 3's rollout: the stop flag is reduced over the
  processes, so both finish iteration 3, save it jointly and exit 0 (no hang, no lost step)."""
  root, *_ = runs
  signal = [{"at": "rollout", "call": 1, "signals": ["SIGTERM"]}]
  outs = _two_processes(str(root / "two"), "--config.iterations=4", signals={1: signal})
  for out in outs:
    assert "preempted after iteration 3; rerun the same command to resume" in out, out[-3000:]
  steps = [x["step"] for x in _metrics(str(root / "two"))]
  assert steps == [0, 1, 2, 3]  # resumed at 2: no iteration repeated, none lost
  assert "3" in os.listdir(root / "two" / "checkpoints")


def test_two_processes_run_the_continuous_engine_as_one(tmp_path):
  """The continuous engine across two processes (each feeding its own slot groups, the host
  bookkeeping run alike on the gathered flags): the same rollouts and evaluation as one process
  holding all 4 devices, and its figures logged."""
  engine = (
    "--config.iterations=1", "--config.eval.every=1",
    "--config.rollout.engine=continuous", "--config.rollout.decode_chunk=4",
    "--config.rollout.page_size=4",
  )  # fmt: skip
  one = _train(str(tmp_path / "one"), _env(4), *engine)
  outs = _two_processes(str(tmp_path / "two"), *engine)
  out_one = one.communicate(timeout=900)[0]
  assert one.returncode == 0, out_one[-4000:]
  a, b = _metrics(str(tmp_path / "one")), _metrics(str(tmp_path / "two"))
  assert [x["step"] for x in b] == [x["step"] for x in a] == [0, 1]
  for key in ("reward/mean", "response/length_mean", "eval/accuracy", "rollout/engine/busy_share"):
    assert b[1][key] == a[1][key], (key, a[1][key], b[1][key])
  assert b[1]["rollout/engine/decode_steps"] >= 1
  np.testing.assert_allclose(b[1]["loss/total"], a[1]["loss/total"], rtol=1e-4, atol=1e-6)
  assert "held-out greedy accuracy" in outs[0]


def test_two_processes_sample_apart_and_update_together_in_async_mode(tmp_path):
  """mesh.rollout_devices on two processes: each process samples its half of the prompts on its
  own device beside the update (rollout.mode=async: no collective on the rollout thread) and the
  halves are exchanged through the coordination service. With the continuous engine, whose rows
  are keyed by prompt and sample, the rollouts and evaluations equal one process's synchronous
  run with the same lag, and the updates (on a 2-device trainer mesh in both) agree to float
  tolerance; the parameter moves are logged."""
  common = (
    "--config.iterations=3", "--config.eval.every=3", "--config.rollout.staleness=1",
    "--config.rollout.engine=continuous", "--config.rollout.decode_chunk=4",
    "--config.rollout.page_size=4",
  )  # fmt: skip
  one = _train(str(tmp_path / "one"), _env(2), *common)
  split = ("--config.rollout.mode=async", "--config.mesh.rollout_devices=2")
  outs = _two_processes(str(tmp_path / "two"), *common, *split)
  out_one = one.communicate(timeout=900)[0]
  assert one.returncode == 0, out_one[-4000:]
  a, b = _metrics(str(tmp_path / "one")), _metrics(str(tmp_path / "two"))
  assert [x["step"] for x in b] == [x["step"] for x in a] == [0, 1, 2, 3]
  for x, y in zip(a[1:], b[1:], strict=True):
    for key in ("reward/mean", "response/length_mean", "rollout/policy_version"):
      assert y[key] == x[key], (key, x["step"], x[key], y[key])  # the same rollouts exactly
    for key in ("loss/total", "optim/grad_norm", "div/estimate_mean"):
      np.testing.assert_allclose(y[key], x[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert y["async/sync_gib"] > 0
    # Each process's engine has slots for its half of the rows: it samples that half alone.
    assert 2 * y["rollout/engine/slots"] == x["rollout/engine/slots"]
  assert all("async/wait_s" in y for y in b[2:])  # iterations 2 and 3 were drawn ahead
  assert b[3]["eval/accuracy"] == a[3]["eval/accuracy"]
  assert "held-out greedy accuracy" in outs[0]
  # Resumed, and stopped by a SIGTERM to process 1 alone during its first update (the rollout of
  # the next iteration in flight): both finish iteration 4, save it and exit 0.
  signal = [{"at": "update", "call": 1, "signals": ["SIGTERM"]}]
  outs = _two_processes(
    str(tmp_path / "two"), *common, *split, "--config.iterations=6", signals={1: signal}
  )
  for out in outs:
    assert "preempted after iteration 4; rerun the same command to resume" in out, out[-3000:]
  assert [x["step"] for x in _metrics(str(tmp_path / "two"))] == [0, 1, 2, 3, 4]
  assert "4" in os.listdir(tmp_path / "two" / "checkpoints")


def test_multihost_refuses_what_it_cannot_order(tmp_path):
  """Streaming, an asynchronous rollout on the trainer's own mesh and sampling devices that do
  not split evenly over the processes stop at set-up with a line that says why and what to use
  (no hang)."""
  for extra, says in (
    (("--config.rollout.mode=stream",), "rollout.mode='stream' runs on one process"),
    (
      ("--config.rollout.mode=async", "--config.rollout.staleness=1"),
      "needs mesh.rollout_devices > 0",
    ),
    (("--config.mesh.rollout_devices=1",), "give each host the same share"),
  ):
    port = _free_port()
    procs = [
      _train(
        str(tmp_path / f"w{i}"),
        _env(2, GPPO_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
             JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
        *extra,
      )
      for i in range(2)
    ]  # fmt: skip
    for p in procs:
      out = p.communicate(timeout=600)[0]
      assert p.returncode != 0 and says in out, out[-3000:]
