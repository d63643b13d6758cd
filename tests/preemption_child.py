"""`python -m gppo_jax.train` sending itself signals at chosen moments (tests/test_preemption.py).

GPPO_TEST_SIGNALS is a JSON list of {"at": "rollout" | "update" | "save", "call": n,
"signals": ["SIGTERM", ...]}: on the n-th call (1-based, counted in this process) of that stage,
the process sends itself each signal (a real kill(2) of its own pid) while the stage runs:
- rollout: before the rollout's sampling starts (it then runs to the end);
- update: just before the compiled update is dispatched;
- save: the first signal just before the checkpoint write starts, the others from a thread while
  it is being written.
Everything else is the real command line.
"""

import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gppo_jax import train
from gppo_jax.models import sharding
from gppo_jax.trainer import checkpointing, rollout

PLAN = json.loads(os.environ.get("GPPO_TEST_SIGNALS", "[]"))
CALLS = {"rollout": 0, "update": 0, "save": 0}


def _send(names):
  for name in names:
    os.kill(os.getpid(), getattr(signal, name))


def _due(stage):
  CALLS[stage] += 1
  return [p for p in PLAN if p["at"] == stage and p["call"] == CALLS[stage]]


def _wrap_rollout(fn):
  def wrapped(*args, **kwargs):
    for p in _due("rollout"):
      _send(p["signals"])
    return fn(*args, **kwargs)

  return wrapped


def _wrap_jit_update(fn):
  def make(*args, **kwargs):
    update = fn(*args, **kwargs)

    def wrapped(*a, **k):
      for p in _due("update"):
        _send(p["signals"])
      return update(*a, **k)

    return wrapped

  return make


def _wrap_save(fn):
  def wrapped(*args, **kwargs):
    timers = []
    for p in _due("save"):
      first, rest = p["signals"][:1], p["signals"][1:]
      _send(first)
      if rest:
        timers.append(threading.Timer(0.01, _send, args=(rest,)))
    for t in timers:
      t.start()
    out = fn(*args, **kwargs)
    for t in timers:
      t.join()
    return out

  return wrapped


rollout.collect = _wrap_rollout(rollout.collect)
sharding.jit_update = _wrap_jit_update(sharding.jit_update)
checkpointing.save = _wrap_save(checkpointing.save)

if __name__ == "__main__":
  sharding.maybe_initialize_distributed()  # GPPO_DISTRIBUTED runs (tests/test_multihost.py)
  config_flags.DEFINE_config_file("config", None, "Training config file.")
  flags.DEFINE_string("workdir", None, "Run folder.")
  app.run(train.main)
