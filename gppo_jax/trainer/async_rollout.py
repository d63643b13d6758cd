"""Rollouts beside the update: the sampler's own devices, the parameter moves, the rollout drawn
one iteration ahead.

  sync = ParamSync(state, sampler_mesh, dtype)   # the sampler's copy of the policy
  moved = sync(state.params, state.frozen, version=t)   # dispatched; moved.wait() -> seconds
  ahead = Ahead()                                # one rollout in flight on a worker thread
  ahead.submit(t + 1, draw, env_state)           # runs draw() while the caller updates
  batch, metrics = ahead.take(t + 1)             # its result (its exception, re-raised)

`rollout.mode` (config_lib.ROLLOUT_MODES): "sync" draws each iteration's rollout when the
iteration starts; "async" (with `rollout.staleness` = k >= 1) draws the rollout of iteration
t + 1 during the update of iteration t, with the policy of iteration t + 1 - k. That policy is
known before update t starts (it is theta_t, or an older copy the trainer keeps anyway), so the
asynchronous run computes exactly what the synchronous run with the same staleness computes: the
same keys, prompts, behaviour policies and updates, in another order in time.

With `mesh.rollout_devices` > 0 (sharding.make_meshes) sampling has its own devices: each
rollout's policy moves there from the trainer's shardings (with LoRA only the adapters move; the
frozen base moves once), in the compute dtype where the sampler casts to it anyway (the
continuous engine), so that half the bytes travel.

On several processes (multi-host) each process's sampler mesh is its own devices
(`sharding.make_meshes`): the rollout thread then runs no cross-process collective, which two
threads could otherwise enter in a different order on each host. `HostShare` has each process
sample its share of a rollout's prompts and exchanges the shares through the coordination
service, so every process ends with the whole rollout, as a synchronous multi-host run does;
`ParamSync` gathers the policy on the trainer's mesh (on the main thread, ordered like every
other collective) and moves this process's copy to its sampler devices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from gppo_jax.generation import continuous
from gppo_jax.generation import sampler as sampler_lib
from gppo_jax.models import partitioning, sharding


def _gib(tree: Any) -> float:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / 2**30


@dataclasses.dataclass
class Moved:
  """A policy state on the sampler's devices (what the sampler takes), as of `version` updates."""

  policy: Any
  version: int
  gib: float  # what moved (0 on a shared mesh)
  started: float  # time.perf_counter() when the move was dispatched

  def wait(self) -> float:
    """Blocks until the move has landed; returns the seconds since it was dispatched."""
    jax.block_until_ready(self.policy)
    return time.perf_counter() - self.started


class ParamSync:
  """Moves the trainer's parameters to the sampler's mesh (`__call__`), by the same logical-axis
  rules the trainer's shardings follow. On a shared mesh (`sampler_mesh` None) nothing moves: the
  policy state is the trainer's own.

  `state`: the TrainState (concrete: LoRA's frozen base moves once, here). `dtype`: the floating
  parameters are cast to it before they move (None: as they are). On several processes, where
  the trainer's arrays span processes and the sampler's mesh is this process's own, each move
  first gathers the arrays whole onto every trainer device (a collective: call it on the
  thread that runs the updates) and moves this process's copy."""

  def __init__(self, state: Any, sampler_mesh: Any | None, dtype: Any = None):
    self.mesh, self.dtype = sampler_mesh, dtype
    self.frozen = None  # the sampler's copy of LoRA's frozen base
    self.gather = None  # several processes: the trainer's arrays, whole on each trainer device
    if sampler_mesh is None:
      return
    trainer_mesh = jax.tree.leaves(state.params)[0].sharding.mesh
    if sharding.spans_processes(trainer_mesh) and not sharding.spans_processes(sampler_mesh):
      self.gather = jax.jit(lambda tree: tree, out_shardings=sharding.replicated(trainer_mesh))
    self.shardings = partitioning.state_shardings(state.params, sampler_mesh)
    if state.frozen is not None:
      shardings = partitioning.state_shardings(state.frozen, sampler_mesh)
      self.frozen = self._move(state.frozen, shardings)

  @property
  def split(self) -> bool:
    return self.mesh is not None

  def _move(self, tree: Any, shardings: Any) -> Any:
    if self.dtype is not None:
      tree = continuous.in_compute_dtype(tree, self.dtype)  # the engine's own cast
    if self.gather is not None:  # this process's whole copy, from one of its trainer devices
      tree = jax.tree.map(lambda x: x.addressable_data(0), self.gather(tree))
    return jax.device_put(tree, shardings)

  def __call__(self, params: Any, frozen: Any, *, version: int) -> Moved:
    """The policy state of the trainable `params` (with LoRA's frozen base `frozen`, the
    trainer's current one: an update donates the state's buffers) on the sampler's devices,
    dispatched (not waited for): call it before dispatching an update that follows, so the move
    does not queue behind it on the trainer's devices."""
    t0 = time.perf_counter()
    if not self.split:
      moved, gib = params, 0.0
    else:
      moved, frozen = self._move(params, self.shardings), self.frozen
      gib = _gib(moved)
    policy = moved if frozen is None else nnx.merge_state(frozen, moved)
    return Moved(policy=policy, version=version, gib=gib, started=t0)


class Ahead:
  """At most one rollout in flight, on a worker thread. `take` returns its result or re-raises
  the exception it ended with (the run stops with the sampler's error, never waits forever)."""

  def __init__(self):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gppo-rollout")
    self._iteration: int | None = None
    self._future: concurrent.futures.Future | None = None
    self._env_state: dict | None = None

  def submit(self, iteration: int, draw: Callable[[], Any], env_state: dict) -> None:
    """Starts `draw()`, the rollout of `iteration`; `env_state` is the environment's state before
    it draws any prompt (what a checkpoint taken meanwhile must hold)."""
    if self._future is not None:
      raise RuntimeError(f"the rollout of iteration {self._iteration + 1} is still in flight")
    self._iteration, self._env_state = iteration, env_state
    self._future = self._pool.submit(draw)

  def take(self, iteration: int) -> Any | None:
    """The result of the rollout of `iteration` (waiting for it), or None if none was started."""
    if self._future is None or self._iteration != iteration:
      return None
    future, self._future, self._iteration, self._env_state = self._future, None, None, None
    return future.result()

  def wait(self) -> None:
    """Waits for the rollout in flight, if any (its result stays for `take`)."""
    if self._future is not None:
      concurrent.futures.wait([self._future])

  def env_state(self) -> dict | None:
    """The environment's state before the rollout in flight drew from it, or None if none is."""
    return self._env_state

  def close(self) -> None:
    """Lets the rollout in flight finish (a thread cannot be stopped) and ends the worker."""
    self._pool.shutdown(wait=True, cancel_futures=True)


class HostShare:
  """A sampler (`sampler.MeshSampler` or `continuous.EngineSampler` on this process's own
  sampler mesh) serving a multi-host run's calls: each process samples a contiguous share of
  the call's prompts (np.array_split of its groups, in process order) and the shares are
  exchanged through the coordination service (`sharding.exchange_host_arrays`, no device
  collective), so every process returns the whole output, as `MeshSampler` does.

  A row's draw does not depend on which process samples it: the continuous engine keys each
  row by its prompt's index in the call and its sample index (`sampler.row_keys`, the keys it
  uses on one process), and the fixed sampler gets those row keys in place of one key for the
  batch. The engine's rows are thus those of a one-process run; the fixed sampler's are drawn
  by other keys than a one-process run's (equally valid draws). Calls are numbered: every
  process calls in the same order (the rollout thread and an evaluation never overlap:
  `Run.evaluate` waits for the rollout in flight), and so are the instances (every process
  builds its runs in the same order), so that a later instance never reads an earlier one's
  values."""

  _instances = 0  # in this process; the same sequence on every process

  def __init__(self, inner: Any):
    self.inner = inner
    self.processes, self.me = jax.process_count(), jax.process_index()
    self._calls = 0
    self._lock = threading.Lock()
    self._tag = f"rollout/{HostShare._instances}"
    HostShare._instances += 1

  @property
  def batch_multiple(self) -> int:
    """What `sampler.sample_prompts` rounds its batches to: whole shares of whole batch shards."""
    return self.inner.batch_multiple * self.processes

  def __getattr__(self, name: str) -> Any:  # metrics, stats, ...: this process's share's
    return getattr(self.inner, name)

  def __call__(self, params, prompt_tokens, prompt_mask, rng, sampling, *, group_size=None):
    tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask, bool)
    G = sampler_lib.call_group_size(tokens, mask, group_size)
    shares = np.array_split(np.arange(len(tokens) // G), self.processes)
    mine = shares[self.me]
    with self._lock:
      call, self._calls = self._calls, self._calls + 1
    local = {}
    if len(mine):
      rows = slice(int(mine[0]) * G, (int(mine[-1]) + 1) * G)
      if isinstance(self.inner, continuous.EngineSampler):
        out = self.inner(
          params, tokens[rows], mask[rows], rng, sampling, group_size=G, prompt_ids=mine
        )
      else:
        keys = sampler_lib.row_keys(rng, np.repeat(mine, G), np.tile(np.arange(G), len(mine)))
        out = self.inner(params, tokens[rows], mask[rows], keys, sampling, group_size=G)
      fields = (f.name for f in dataclasses.fields(out))
      local = {f: np.asarray(getattr(out, f)) for f in fields if getattr(out, f) is not None}
    parts = sharding.exchange_host_arrays(local, f"{self._tag}/{call}")
    if call:  # every process has read the previous call's shares (it is in this one)
      sharding.forget_exchange(f"{self._tag}/{call - 1}")
    full = {k: np.concatenate([p[k] for p in parts if p]) for k in next(p for p in parts if p)}
    return sampler_lib.SampleOutput(**full)
