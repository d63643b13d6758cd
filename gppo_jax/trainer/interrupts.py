"""SIGTERM and SIGINT as a request to stop a training run at the next iteration boundary.

Cloud TPU and spot GPU machines are preempted with SIGTERM, so a stop-and-resume is the common
path of a long run. The handler never interrupts the code that is running (an exception raised in
the middle of an update, a checkpoint write or a metrics write would leave half-written state):
it records the signal, and the loop, between iterations, asks `should_stop()`, saves the state of
exactly the iterations it completed, and exits. On multi-host runs the answer is reduced over all
processes, so every host stops after the same iteration and the (collective) save agrees.

Before the loop starts (`arm()`), nothing is worth saving yet: a signal then raises `Interrupted`
at once, so that a preemption during set-up does not wait for a warm start or a first evaluation.
"""

from __future__ import annotations

import os
import signal
import threading

from gppo_jax.models import sharding

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
  """A stop signal arrived during set-up, before any iteration ran.

  A BaseException, like KeyboardInterrupt: the `except Exception` of a cache reader or a
  library must not swallow it."""

  def __init__(self, signame: str):
    super().__init__(f"{signame} during set-up")
    self.signame = signame


class StopSignals:
  """Context manager: installs the handlers on enter, restores the previous ones on exit."""

  def __init__(self) -> None:
    self.received: str | None = None  # the first signal's name
    self.count = 0
    self._armed = False
    self._old: dict[int, object] = {}

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():  # signal.signal needs it
      for sig in SIGNALS:
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old.clear()

  def arm(self) -> None:
    """From now on a signal only sets the flag: the loop saves and stops at its next boundary."""
    self._armed = True
    if self.received is not None:  # arrived between set-up and arm(): treat as set-up
      raise Interrupted(self.received)

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    self.count += 1
    if not self._armed:
      self.received = name
      raise Interrupted(name)
    if self.received is None:
      self.received = name
      _tell(f"{name} received: finishing this iteration, then saving a checkpoint and exiting")
    else:  # e.g. a second Ctrl-C: the save in progress must not be cut short
      _tell(
        f"{name} received again: already stopping, the checkpoint is being written "
        "(SIGKILL aborts at once; the previous checkpoint is kept)"
      )

  def should_stop(self) -> bool:
    """True on every process once any process got a signal (a collective on multi-host runs)."""
    return bool(sharding.global_max(int(self.received is not None)))


def _tell(text: str) -> None:
  # os.write, not print: a handler can run while the main thread is inside a print to stderr,
  # and a buffered stream raises on re-entry.
  try:
    os.write(2, f"\n{text}\n".encode())
  except OSError:
    pass
