"""Rollouts as a stream (`rollout.mode="stream"`): the continuous engine never drains, and the
update takes finished groups as they come.

  stream = Stream(config, env, engine, sampling, prompt_len=P, pad_id=0)
  stream.publish(policy, version=t)   # after each update; loaded between decode chunks
  stream.start()
  batch, metrics = stream.take(iteration)   # prompts_per_iter groups (or more, refilling)
  with stream.paused(): ...   # evaluation and checkpoints: the stream holds still meanwhile
  stream.state() / stream.restore(state)   # what a checkpoint holds; stream.close()

A worker thread draws prompts from the environment prompts_per_iter at a time and feeds them to the
engine (`generation.stream.StreamEngine`) one by one, keeping prompts_per_iter of them outstanding
(fed and not yet taken): as the update takes a group, the next prompt goes in. It turns the engine's
scheduler and scores each group as it finishes. The engine loads each published policy between two
decode chunks, so a response may span several versions; every token records the version that drew
it. `take(t)` (the learner has had t updates) drops a group whose oldest token is more than
max_staleness versions old (`rollout/dropped`) and logs the lag of the tokens it keeps
(`rollout/lag_mean`, `rollout/lag_max`). GPPO needs nothing else: each token's behaviour log-prob is
the one recorded by the weights that drew it.

Nothing is lost or trained twice across a restart: prompt ids are global (draw * n + index, and
the row keys fold them in), the checkpoint holds the environment's state before the oldest draw
with a prompt not yet taken and the prompts taken (or dropped) from it on; a resumed stream draws
those draws again and skips what was taken. What was in flight is drawn again, by the new policy.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np

from gppo_jax.generation import continuous
from gppo_jax.generation import sampler as sampler_lib
from gppo_jax.generation import stream as stream_lib
from gppo_jax.trainer import rollout

# Folded into the run's seed key: the key the stream's row keys fold each prompt id into.
STREAM_KEY = 0x5354524D


@dataclasses.dataclass
class _Draw:
  """One draw of prompts from the environment: its state before the draw, the prompts, and which
  of them have been taken (or dropped) by the learner."""

  env_state: dict
  prompts: list
  taken: set


@dataclasses.dataclass
class _Scored:
  """One finished group, scored."""

  prompt_id: int
  groups: rollout.Groups  # the one group
  versions: np.ndarray  # int32 [G, N], -1 past each response's end
  metrics: dict
  reward_s: float  # its share of the scoring time


def capacity(config) -> int:
  """Prompts outstanding at once (fed, not yet taken): one update's worth. The prompts of update
  t + 1 go in as update t takes its groups, so while t trains the engine draws t + 1's (a lag of
  one update where sampling keeps up, as with rollout.mode="async"); more would run further
  ahead of the learner, so that the groups it takes are older, not sooner."""
  return config.rollout.prompts_per_iter


class Stream:
  """The rollout stream of a run (module doc). use_topk: the batch carries the sampler's top-k;
  device: where the worker's small host-side jax ops run (a sampler device), or None."""

  def __init__(self, config, env, engine: stream_lib.StreamEngine,
               sampling: sampler_lib.SamplingParams, *, prompt_len: int, pad_id: int,
               use_topk: bool = False, device: Any = None):  # fmt: skip
    self.config, self.env, self.engine, self.sampling = config, env, engine, sampling
    self.prompt_len, self.pad_id, self.device = prompt_len, pad_id, device
    self.use_topk = use_topk  # the update reads the sampler's top-k log-probs
    self.n = config.rollout.prompts_per_iter
    self.capacity = capacity(config)
    self._cond = threading.Condition()
    self._engine_lock = threading.Lock()  # a scheduler turn, or reading the engine's counters
    self._ready: collections.deque[_Scored] = collections.deque()
    self._draws: dict[int, _Draw] = {}
    self._next_draw = 0
    self._skip: dict[int, set] = {}  # restored: prompts of draws to come already taken
    self._unfed: collections.deque[tuple[int, int]] = collections.deque()  # (draw, index)
    self._env_after: dict | None = None  # the environment's state after the last draw
    self._outstanding = 0  # prompts fed and not yet taken
    self._pause = 0  # callers holding `paused`
    self._is_paused = False
    self._stop = False
    self._error: BaseException | None = None
    self._thread: threading.Thread | None = None

  # -- the learner's side ---------------------------------------------------------------------

  def publish(self, policy: Any, version: int) -> None:
    """The policy after `version` updates, for the engine's next chunk. It must stay valid
    while the engine reads it (not a buffer an update will donate)."""
    self.engine.set_params(policy, version)

  def start(self) -> None:
    if self._thread is not None:
      raise RuntimeError("the rollout stream is already running")
    if self._env_after is None:
      self._env_after = self.env.state()
    self._thread = threading.Thread(target=self._run, name="gppo-stream", daemon=True)
    self._thread.start()

  def take(self, iteration: int) -> tuple[Any, dict[str, float]]:
    """The batch of the update after `iteration` updates (`rollout.assemble`), from the groups
    that finish next: groups older than max_staleness versions are dropped; with
    advantage.filter_zero_signal, up to (1 + refill_rounds) x prompts_per_iter groups are taken
    to fill the batch with groups that carry signal. Raises the worker's error if it failed."""
    r, a = self.config.rollout, self.config.advantage
    limit = self.n * (1 + (r.refill_rounds if a.filter_zero_signal else 0))
    t0 = time.perf_counter()
    kept: list[_Scored] = []
    signal: list[bool] = []
    lags: list[np.ndarray] = []
    dropped = 0
    while len(kept) < limit and (len(kept) < self.n if not a.filter_zero_signal else
                                 sum(signal) < self.n):  # fmt: skip
      group = self._next()
      versions = group.versions[group.versions >= 0]
      lag = iteration - versions
      if lag.max() > r.max_staleness:
        dropped += 1
        continue
      kept.append(group)
      lags.append(lag)
      signal.append(bool(rollout.has_signal(group.groups)[0]))
    wait = time.perf_counter() - t0
    with self._engine_lock:
      engine = continuous.engine_metrics(self.engine.stats())
    metrics = rollout.mean_rows([g.metrics for g in kept])
    lag = np.concatenate(lags)
    metrics.update(engine)
    metrics.update(
      {
        "rollout/lag_mean": float(lag.mean()),
        "rollout/lag_max": float(lag.max()),
        "rollout/dropped": float(dropped),
        "rollout/rounds": float(-(-len(kept) // self.n)),
        "rollout/policy_version": iteration - float(lag.mean()),
        "time/sample_s": wait,
        "time/reward_s": float(sum(g.reward_s for g in kept)),
      }
    )
    pool = rollout.Groups.concat([g.groups for g in kept])
    return rollout.assemble(self.config, pool, np.asarray(signal), metrics, self.use_topk)

  @contextlib.contextmanager
  def paused(self):
    """Holds the worker between two scheduler turns (no prompt drawn, no group scored) while
    the caller uses the environment or saves."""
    with self._cond:
      self._pause += 1
      self._cond.notify_all()
      while self._alive() and not self._is_paused:
        self._cond.wait(0.05)
    try:
      yield
    finally:
      with self._cond:
        self._pause -= 1
        self._cond.notify_all()

  def state(self) -> dict:
    """What a checkpoint holds: {"env": the environment's state before the oldest draw with a
    prompt not yet taken, "draw": that draw, "taken": [[draw, [prompt index, ...]], ...] from
    it on}."""
    with self._cond:
      open_draws = [d for d, x in self._draws.items() if len(x.taken) < len(x.prompts)]
      if open_draws:
        first = min(open_draws)
        env = self._draws[first].env_state
      else:
        first, env = self._next_draw, self._env_after
      taken = {d: x.taken for d, x in self._draws.items() if d >= first and x.taken}
      for d, skip in self._skip.items():  # restored draws not drawn again yet
        if d >= first:
          taken[d] = taken.get(d, set()) | skip
      return {
        "env": env,
        "draw": first,
        "taken": [[d, sorted(int(i) for i in s)] for d, s in sorted(taken.items())],
      }

  def restore(self, state: dict | None) -> None:
    """Goes on from a checkpoint's `state()` (the environment restored to state["env"])."""
    if self._thread is not None:
      raise RuntimeError("restore the rollout stream before starting it")
    if not state:
      return
    self._next_draw = int(state["draw"])
    self._skip = {int(d): set(map(int, idx)) for d, idx in state.get("taken", [])}

  def close(self) -> None:
    """Stops the worker after its current turn."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join()

  def _alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive() and self._error is None

  def _next(self) -> _Scored:
    """The next finished group, marked taken (waiting for one)."""
    with self._cond:
      while not self._ready:
        if self._error is not None:
          raise self._error
        if not self._alive():
          raise RuntimeError("the rollout stream has stopped")
        self._cond.wait(0.1)
      group = self._ready.popleft()
      draw, index = divmod(group.prompt_id, self.n)
      self._draws[draw].taken.add(index)
      self._outstanding -= 1
      # The draws before the oldest one with a prompt not taken are no longer needed.
      open_draws = [d for d, x in self._draws.items() if len(x.taken) < len(x.prompts)]
      oldest = min(open_draws, default=self._next_draw)
      for d in [d for d in self._draws if d < oldest]:
        del self._draws[d]
      self._cond.notify_all()
      return group

  # -- the worker -----------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      with jax.default_device(self.device) if self.device else contextlib.nullcontext():
        while self._hold():
          self._feed()
          with self._engine_lock:
            finished = self.engine.step()
            busy = self.engine.busy
          if finished:
            scored = self._score(finished)
            with self._cond:
              self._ready.extend(scored)
              self._cond.notify_all()
          elif not busy:
            with self._cond:  # nothing to do until the learner takes groups (room to feed)
              self._cond.wait(0.05)
    except BaseException as e:  # re-raised by the learner's take
      with self._cond:
        self._error = e
        self._cond.notify_all()

  def _hold(self) -> bool:
    """Waits while paused; False once stopped."""
    with self._cond:
      while self._pause and not self._stop:
        self._is_paused = True
        self._cond.notify_all()
        self._cond.wait(0.05)
      self._is_paused = False
      return not self._stop

  def _feed(self) -> None:
    """Feeds prompts while fewer than `capacity` are outstanding, drawing from the environment
    prompts_per_iter at a time."""
    while True:
      with self._cond:
        room = self.capacity - self._outstanding
      room = min(room, self.engine.room)
      if room <= 0:
        return
      if not self._unfed:
        self._draw()
        continue
      fed = [self._unfed.popleft() for _ in range(min(room, len(self._unfed)))]
      with self._cond:
        self._outstanding += len(fed)
        prompts = [self._draws[d].prompts[i].token_ids for d, i in fed]
      with self._engine_lock:
        self.engine.add(prompts, [d * self.n + i for d, i in fed])

  def _draw(self) -> None:
    """Draws prompts_per_iter prompts from the environment (those of a restored draw that were
    taken are skipped)."""
    draw = self._next_draw
    before = self.env.state()
    prompts = self.env.train_prompts(self.n)
    skip = self._skip.pop(draw, set())
    with self._cond:
      self._draws[draw] = _Draw(before, prompts, set(skip))
      self._next_draw = draw + 1
      self._env_after = self.env.state()
    self._unfed.extend((draw, i) for i in range(len(prompts)) if i not in skip)

  def _score(self, finished: list[stream_lib.StreamGroup]) -> list[_Scored]:
    """Scores finished groups in one env.score call; one `_Scored` per group."""
    t0 = time.perf_counter()
    G = self.config.rollout.group_size
    rows = []
    for g in finished:
      draw, index = divmod(g.prompt_id, self.n)
      with self._cond:
        prompt = self._draws[draw].prompts[index]
      rows += [prompt] * G
    p_tok, p_mask = sampler_lib.left_pad(
      [p.token_ids for p in rows], pad_id=self.pad_id, length=self.prompt_len
    )
    out = jax.tree.map(lambda *xs: np.concatenate(xs), *[g.out for g in finished])
    groups, metrics = rollout.score(self.config, self.env, rows, p_tok, p_mask, out, self.sampling)
    share = (time.perf_counter() - t0) / len(finished)
    return [
      _Scored(g.prompt_id, groups.take(np.asarray([i])), g.versions, metrics, share)
      for i, g in enumerate(finished)
    ]
