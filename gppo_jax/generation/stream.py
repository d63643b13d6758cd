"""Continuous batching that never drains: prompts flow in, finished groups flow out, and the
policy's weights change between decode chunks (`rollout.mode="stream"`).

  engine = StreamEngine(graphdef, sampling, EngineConfig(slots=64), group_size=G,
                        capacity=2 * n, prompt_len=P, key=key)
  engine.set_params(params, version=0)   # any thread; the next chunk runs with them
  engine.add(prompt_token_ids, prompt_ids)   # while engine.room >= len(prompts)
  done = engine.step()   # one scheduler turn: admit, dispatch a chunk, read the last one
  for group in done: group.out, group.versions   # [G, N] each, versions per token

It is the continuous engine's scheduler (`continuous._Rollout`: admit, reserve or preempt, decode,
collect) over a ring of `capacity` prompts instead of one call's prompts. What changes:

- prompts are added while others decode; a prompt's G rows use the buffer rows of its place in
  the ring, and its row keys its global `prompt_id` (`sampler.row_keys`), so a response depends
  on its prompt id, its sample id and the weights that drew each token, never on its companions
  or on when it was admitted;
- `set_params` leaves new weights for the scheduler, which takes the newest before its next
  prefill or chunk. A row keeps its KV cache across the change (as PipelineRL's in-flight weight
  updates do): each token's recorded log-prob is the log-prob under the weights that drew it,
  and `StreamGroup.versions` says which weights those were, token by token. A row that was
  preempted is prefilled again under the weights of its readmission;
- a group whose G rows have finished is gathered from the device output rows in one dispatch
  and handed out on the next turn (by then its gather has landed), and its place in the ring is
  freed one turn after that (the chunk in flight when it finished still names its rows).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from gppo_jax.generation import continuous
from gppo_jax.generation import sampler as sampler_lib
from gppo_jax.models import sharding


@dataclasses.dataclass
class StreamGroup:
  """The G responses to one prompt, host side. out: `sampler.SampleOutput` fields [G, N];
  versions: int32 [G, N], the policy version that drew each response token (-1 past its end)."""

  prompt_id: int
  prompt: list[int]
  out: sampler_lib.SampleOutput
  versions: np.ndarray


@jax.jit
def _gather_rows(outputs: dict, rows: jax.Array) -> dict:
  return {name: buf[rows] for name, buf in outputs.items()}


class _StreamRollout(continuous._Rollout):
  """`_Rollout` over a ring of prompt places (StreamEngine's module doc)."""

  def __init__(self, engine: continuous.ContinuousSampler, params, capacity: int, group_size: int,
               prompt_len: int, key: jax.Array):  # fmt: skip
    if capacity < 1:
      raise ValueError(f"capacity={capacity} must be >= 1 prompt")
    if group_size < 1:
      raise ValueError(f"group_size={group_size} must be >= 1")
    ps = engine.engine.page_size
    P = -(-max(1, prompt_len) // ps) * ps
    self.key = key
    key_shape = jax.random.key_data(sampler_lib.row_keys(key, np.zeros(1), np.zeros(1))).shape[1:]
    self._lay_out(engine, params, group_size, P, capacity, key_shape)
    self.capacity = capacity
    self.prompts = [[] for _ in range(capacity)]
    self.prompt_id = np.full(capacity, -1, np.int64)
    self.tokens = np.full((capacity, P), self.sp.pad_id, np.int32)
    self.mask = np.zeros((capacity, P), bool)
    self.ends = np.zeros(capacity, np.int64)
    self.key_data = np.zeros((self.num_rows, *key_shape), np.uint32)
    self.versions = np.full((self.num_rows, self.N), -1, np.int32)
    self.finished = np.zeros(self.num_rows, bool)
    self.free_places = list(range(capacity))
    self.gathering: list[tuple[list[int], dict]] = []  # (places, their rows' gather in flight)
    self.cooling: list[int] = []  # places handed out, freed after the next chunk is read
    self.inflight: continuous._Chunk | None = None

  def add(self, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int],
          limits: np.ndarray | None = None) -> None:  # fmt: skip
    if len(prompts) != len(prompt_ids):
      raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt ids")
    G, N = self.G, self.N
    if limits is None:
      limits = np.full(len(prompts) * G, N, np.int32)
    limits = np.asarray(limits, np.int32).reshape(-1)
    if limits.shape != (len(prompts) * G,) or (
      len(limits) and (limits.min() < 1 or limits.max() > N)
    ):
      raise ValueError(f"limits: one limit in [1, {N}] per row ({len(prompts) * G} rows)")
    if len(prompts) > len(self.free_places):
      raise ValueError(
        f"{len(prompts)} prompts added but only {len(self.free_places)} of the stream's "
        f"{self.capacity} places are free (add while StreamEngine.room allows)"
      )
    prompts = [[int(t) for t in p] for p in prompts]
    for tokens, pid in zip(prompts, prompt_ids, strict=True):
      if not 0 < len(tokens) <= self.P:
        raise ValueError(f"prompt {pid} has {len(tokens)} tokens; the stream takes 1..{self.P}")
    ids = np.repeat(np.asarray(prompt_ids, np.int64), G)
    keys = sampler_lib.row_keys(self.key, ids, np.tile(np.arange(G), len(prompts)))
    key_data = np.asarray(jax.random.key_data(keys))
    for k, (tokens, pid) in enumerate(zip(prompts, prompt_ids, strict=True)):
      place = self.free_places.pop(0)
      rows = slice(place * G, (place + 1) * G)
      self.prompts[place], self.prompt_id[place] = tokens, int(pid)
      self.tokens[place], self.mask[place] = (
        x[0] for x in sampler_lib.left_pad([tokens], pad_id=self.sp.pad_id, length=self.P)
      )
      self.ends[place] = len(tokens) if self.shifted else self.P
      self.key_data[rows] = key_data[k * G : (k + 1) * G]
      self.row_step[rows], self.finished[rows], self.versions[rows] = 0, False, -1
      self.limits[rows] = limits[k * G : (k + 1) * G]
      self._queue(place)

  # -- one turn ------------------------------------------------------------------------------

  def turn(self) -> list[StreamGroup]:
    """Admits, dispatches a chunk on the running rows, reads the chunk before it; returns the
    groups whose gather was dispatched on the turn before (their rows have landed since)."""
    ready, self.gathering = self.gathering, []
    self.admit()
    chunk = self.decode() if (self.slot_row >= 0).any() else None
    freed, self.cooling = self.cooling, []
    finished = []
    if self.inflight is not None:
      finished = self.collect(self.inflight)
      self.free_places.extend(freed)  # no chunk in flight names their rows any more
    else:
      if chunk is None and self.pending:
        raise RuntimeError("stream engine: pending prompts but nothing admitted or running")
      self.free_places.extend(freed)
    self.inflight = chunk
    self._gather(finished)
    return self._hand_out(ready)

  @property
  def busy(self) -> bool:
    """Whether a turn has work: rows to admit, decode or read, or groups to hand out."""
    return bool(
      self.pending or self.waiting or (self.slot_row >= 0).any() or self.inflight is not None
      or self.gathering or self.cooling
    )  # fmt: skip

  def _prefill(self, units, resume: bool) -> None:
    super()._prefill(units, resume)
    for unit, _ in units:  # the prefill drew each row's token `unit.drawn`
      for j in unit.samples:
        self.versions[unit.prompt * self.G + j, unit.drawn] = self.version

  def collect(self, chunk: continuous._Chunk) -> list[int]:
    before = self.row_step[chunk.rows].copy()
    finished = super().collect(chunk)
    for row, start, end in zip(chunk.rows, before, self.row_step[chunk.rows], strict=True):
      self.versions[row, start:end] = chunk.version
    return finished

  def _gather(self, finished: list[int]) -> None:
    """Marks the rows finished; dispatches one gather of the groups that now have all G."""
    G = self.G
    fresh = [r for r in finished if not self.finished[r]]
    self.finished[fresh] = True
    places = sorted({r // G for r in fresh if self.finished[(r // G) * G : (r // G + 1) * G].all()})
    if not places:
      return
    rows = np.concatenate([np.arange(p * G, (p + 1) * G) for p in places]).astype(np.int32)
    self.gathering = [(places, _gather_rows(self.outputs, rows))]

  def _hand_out(self, ready: list[tuple[list[int], dict]]) -> list[StreamGroup]:
    groups = []
    for places, gathered in ready:
      host = {k: np.asarray(v) for k, v in sharding.to_host(gathered).items()}
      for i, place in enumerate(places):
        rows = slice(place * self.G, (place + 1) * self.G)
        lengths = self.row_step[rows].astype(np.int32)
        mask = np.arange(self.N)[None] < lengths[:, None]
        # Past its end a row holds what an earlier prompt in its place left: the padding.
        fields = {}
        for name, shape, fill, _ in continuous._record_fields(self.model_cfg, self.sp):
          mine = host[name][i * self.G : (i + 1) * self.G]
          keep = mask.reshape(mask.shape + (1,) * len(shape))
          fields[name] = np.where(keep, mine, np.asarray(fill, mine.dtype))
        out = sampler_lib.SampleOutput(mask=mask, lengths=lengths, **fields)
        versions = np.where(mask, self.versions[rows], -1)
        groups.append(
          StreamGroup(int(self.prompt_id[place]), list(self.prompts[place]), out, versions)
        )
        self.cooling.append(place)
    return groups

  def window_stats(self) -> dict[str, float]:
    """The counters since the last call (`_Rollout.stats`), then starts a new window."""
    stats = self.stats()
    self.counters.clear()
    self.sizes.clear()
    self.peak_pages, self.host_wait = self.pages.in_use, 0.0
    return stats


class StreamEngine:
  """Continuous batching as a stream (module doc). Not thread-safe but for `set_params`: one
  thread adds prompts and turns the scheduler; any thread may leave new weights.

  capacity: prompts held at once (admitted, waiting or finished and not yet handed out);
  prompt_len: the longest prompt, in tokens; key: the stream's key (row keys fold in each
  prompt's id and sample id). With `mesh`, on its batch shards (`ContinuousSampler`).
  EngineConfig.slots=0 (a pool given by memory): the slots the pool holds for the capacity's
  rows (`EngineSampler.slots_for`), sized when the first params arrive."""

  def __init__(self, graphdef: nnx.GraphDef, sampling: sampler_lib.SamplingParams,
               engine: continuous.EngineConfig, *, group_size: int, capacity: int,
               prompt_len: int, key: jax.Array, mesh: jax.sharding.Mesh | None = None):  # fmt: skip
    self._graphdef, self._sampling, self._engine, self._mesh = graphdef, sampling, engine, mesh
    self._sampler: continuous.ContinuousSampler | None = None
    self.group_size = group_size
    self._args = (capacity, group_size, prompt_len, key)
    self._rollout: _StreamRollout | None = None
    self._lock = threading.Lock()
    self._new: tuple[nnx.State, int] | None = None

  @property
  def attention(self) -> str | None:
    return None if self._sampler is None else self._sampler.attention

  def _make_sampler(self, params: nnx.State) -> continuous.ContinuousSampler:
    engine, free = self._engine, None
    if not engine.slots:  # the pool given by memory: as many slots as it holds
      capacity, group_size, prompt_len, _ = self._args
      sizer = continuous.EngineSampler(self._graphdef, engine, self._mesh)
      slots = sizer.slots_for(params, self._sampling, prompt_len, group_size, capacity * group_size)
      engine, free = dataclasses.replace(engine, slots=slots), sizer.free_bytes
    return continuous.ContinuousSampler(self._graphdef, self._sampling, engine, self._mesh, free)

  def set_params(self, params: nnx.State, version: int) -> None:
    """Leaves `params` (policy version `version`) for the scheduler: the next prefill or chunk
    runs with them. Cast to the compute dtype here, on the caller's thread."""
    rollout = self._rollout
    dtype = rollout.model_cfg.compute_dtype if rollout else None
    if dtype is None:
      dtype = nnx.merge(self._graphdef, params).cfg.compute_dtype
    cast = continuous.in_compute_dtype(params, dtype)
    with self._lock:
      self._new = (cast, int(version))

  def _take_params(self) -> None:
    """Takes the newest params left, once they have landed (until then the chunks go on with
    the current ones; the first are waited for)."""
    with self._lock:
      new = self._new
      if new is None:
        return
      landed = all(x.is_ready() for x in jax.tree.leaves(new[0]))
      if self._rollout is not None and not landed:
        return
      self._new = None
    if self._rollout is None:
      self._sampler = self._make_sampler(new[0])
      self._rollout = _StreamRollout(self._sampler, new[0], *self._args)
    self._rollout.params, self._rollout.version = new

  def _ready(self) -> _StreamRollout:
    self._take_params()
    if self._rollout is None:
      raise RuntimeError("StreamEngine: call set_params before adding prompts or turning")
    return self._rollout

  @property
  def room(self) -> int:
    """Prompts `add` takes now."""
    return self._args[0] if self._rollout is None else len(self._rollout.free_places)

  @property
  def version(self) -> int | None:
    """The policy version the engine runs (None before the first set_params is taken)."""
    return None if self._rollout is None else self._rollout.version

  def add(self, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int],
          limits: np.ndarray | None = None) -> None:  # fmt: skip
    """Queues prompts (token-id lists, each with its global id) for G samples each; limits:
    int32 [len(prompts) * G], each row's own max_new_tokens (None: the sampling's)."""
    self._ready().add(prompts, prompt_ids, limits)

  def step(self) -> list[StreamGroup]:
    """One scheduler turn (`_StreamRollout.turn`): the groups handed out by it."""
    return self._ready().turn()

  @property
  def busy(self) -> bool:
    return self._rollout is not None and self._rollout.busy

  def stats(self) -> dict[str, float]:
    """The engine's counters since the last call (`continuous._Rollout.stats`)."""
    return {} if self._rollout is None else self._rollout.window_stats()
