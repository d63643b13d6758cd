"""Continuous batching: a pool of decode slots, refilled as responses finish, over a paged cache.

    engine = ContinuousSampler(graphdef, sampling, EngineConfig(slots=64, page_size=16))
    out = engine(params, prompts, key, group_size=8)   # SampleOutput, rows prompt-major

A fixed batch decodes until its longest row stops, so with long-tailed response lengths most of
its rows idle most of the time, each holding a cache of max_new_tokens slots. Here up to S rows
decode at once, in chunks of `chunk` steps (one jitted call each; the host does no per-token
work), and a small host scheduler (`_Rollout`) runs between chunks:

- admit: pending prompts are prefilled into free slots, each prompt once for its samples, which
  share its prompt pages (`paged`);
- reserve or preempt: each running row gets the pages its next chunks may write; where a pool
  runs short, the most recently admitted rows give theirs up. A preempted row keeps the tokens it
  drew: when it is admitted again, its prompt and response so far are prefilled in one call and
  it goes on from there (vLLM's recompute preemption);
- decode: the chunk runs on the running rows only, gathered into a batch of a few compiled sizes
  (`ContinuousSampler.batch_sizes`: powers of two and 1.5 times them): as rows finish and no
  prompt is left to take their slots, the batch shrinks, so the tail of a long-tailed rollout
  costs what its live rows cost;
- collect: the chunk's tokens are written, on the device, into the rollout's output rows by row
  id, fetched once at the end. The host reads only each chunk's small done / length flags, and
  reads them one chunk late: chunk k + 1 is dispatched before chunk k's flags are read, so the
  device never waits for the host's scheduling (a finished row costs at most one more chunk).

Batch-invariant samples: the response of sample j of prompt i is drawn with the row key
fold_in(fold_in(key, prompt_ids[i]), j) (`sampler.row_keys`), token s with fold_in(row key, s),
so it depends on (params, prompt, key, i, j) only, not on the slot, the batch it decodes in, the
slot count or the prompt order, and equals what `sampler.sample` draws with the same row keys (up
to float rounding; a resumed row's cache is its prefill's, not its decode's, which rounds alike).

Compiled shapes: the decode chunk once per batch size used; the prefill once per power-of-two
count of prompts up to `prefill_rows` (and, for preempted rows, per power-of-two count of pages
of prompt and response). None grows with max_new_tokens or the number of prompts.

On a mesh the slots split into one group per batch shard (data x fsdp): each group has a pool of
pages of its own, on its shard's devices, and the device programs run the groups side by side (a
leading shard axis, vmapped), so a slot only ever reads pages held where it runs. A prompt's
samples share one group (and its prompt pages). Every process runs the same host bookkeeping on
the same gathered flags, so it serves several hosts as `sampler.MeshSampler` does. The programs
are traced under the mesh, as the fixed sampler's are: a decode step on an expert axis runs each
device's own experts (`moe.moe_mlp`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gppo_jax import errors
from gppo_jax.generation import paged
from gppo_jax.generation import sampler as sampler_lib
from gppo_jax.models import model as model_lib
from gppo_jax.models import partitioning, sharding

ENGINES = ("auto", "fixed", "continuous")  # config rollout.engine
# "auto": continuous batching from this many max new tokens on, fixed batches below. With 64
# long-tailed rows (benchmarks/rollout.py, docs/performance.md) the engine was 1.3x faster at a
# cap of 256 tokens and 0.7x at 128: with rows about a chunk long, rows that finished within a
# chunk or the one before (the host reads flags a chunk late) and the padding to the batch
# sizes are much of what it computes. On the built-in tasks' few-token answers a fixed batch
# samples ~5x faster (benchmarks/iteration.py --config.rollout.engine=...).
AUTO_MIN_NEW_TOKENS = 256


def engine_for(engine: str, max_new_tokens: int) -> str:
  """ "fixed" or "continuous": what `engine` (ENGINES) means for responses of up to
  max_new_tokens tokens."""
  if engine not in ENGINES:
    raise ValueError(f"rollout.engine={engine!r}; valid: {', '.join(ENGINES)}")
  if engine == "auto":
    return "continuous" if max_new_tokens >= AUTO_MIN_NEW_TOKENS else "fixed"
  return engine


def _sampler_devices(mesh: jax.sharding.Mesh | None) -> list:
  """This process's devices of the sampler: the mesh's, or the default device."""
  if mesh is None:
    return jax.local_devices()[:1]
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _local_free_bytes(fraction: float, mesh: jax.sharding.Mesh | None) -> int:
  """The least free memory (bytes_limit - bytes_in_use, `Device.memory_stats`) of this process's
  sampler devices; a ConfigError where the backend reports none (CPU)."""
  free = []
  for device in _sampler_devices(mesh):
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats or "bytes_in_use" not in stats:
      raise errors.ConfigError(
        f"rollout.kv_memory_fraction={fraction}: the {device.platform} devices report no memory "
        "figures (device.memory_stats() has no bytes_limit / bytes_in_use), so there is no free "
        "memory to take a share of; size the pool in GiB with rollout.kv_memory_gib instead"
      )
    free.append(int(stats["bytes_limit"]) - int(stats["bytes_in_use"]))
  return min(free)


def free_memory_bytes(fraction: float, mesh: jax.sharding.Mesh | None = None) -> int:
  """The bytes EngineConfig.kv_memory_fraction (`fraction`, named in errors) takes its share of:
  the least free memory of any of the sampler's devices (the mesh's over every process, or the
  default device) as they are now, so call it with the parameters placed. Each shard's pool
  lives on its own devices, so the fraction of this is each shard's pool."""
  least = _local_free_bytes(fraction, mesh)
  # Every process of a mesh that spans several sizes the same pools (each runs the same scheduler).
  if jax.process_count() > 1 and (mesh is None or sharding.spans_processes(mesh)):
    from jax.experimental import multihost_utils  # noqa: PLC0415

    least = int(np.min(multihost_utils.process_allgather(np.int64(least))))
  return least


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """slots: the most responses decoding at once; 0 (with the pool given by memory, through
  `EngineSampler` only): as many as the pool holds at the expected footprint
  (`EngineSampler.slots_for`).
  page_size: cache slots per page. num_pages: the pool's pages (page 0 is reserved); None sizes
  it from kv_memory_gib or kv_memory_fraction, or else for every slot holding its prompt's share
  and a third of max_new_tokens (rollouts whose responses run longer on average preempt rows,
  counted in `ContinuousSampler.stats`: then raise it).
  kv_memory_gib: the pool's size in GiB (all shards together), as serving engines size theirs.
  kv_memory_fraction: the pool takes this share of the sampler devices' free memory, measured
  at the first call with the parameters placed (`free_memory_bytes`), as vLLM's
  gpu_memory_utilization sizes its cache; on every batch shard alike.
  chunk: decode steps per call. prefill_rows: the most prompts prefilled in one call.
  attention: how decode steps attend over the pages (`paged.ATTENTION`, `paged.resolve_attention`):
  "gather", "pallas" (JAX's TPU kernel) or "auto" (pallas on TPU where it is exact and fits).
  unroll: decode steps run the layers unrolled (`paged.DecodeWeights`); None: on CPU only."""

  slots: int = 64
  page_size: int = 16
  num_pages: int | None = None
  chunk: int = 32
  prefill_rows: int = 8
  attention: str = "auto"
  kv_memory_gib: float | None = None
  unroll: bool | None = None
  kv_memory_fraction: float | None = None

  def __post_init__(self):
    for name in ("slots", "page_size", "chunk", "prefill_rows"):
      if getattr(self, name) < 1 and not (name == "slots" and self.slots == 0 and self.by_memory):
        raise ValueError(
          f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}"
          + (" (0: from a pool given by kv_memory_gib or kv_memory_fraction)" * (name == "slots"))
        )
    if self.attention not in paged.ATTENTION:
      raise ValueError(
        f"EngineConfig.attention={self.attention!r}; valid: {', '.join(paged.ATTENTION)}"
      )
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(
        f"EngineConfig.num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}"
      )
    if self.kv_memory_gib is not None and not self.kv_memory_gib > 0:
      raise ValueError(f"EngineConfig.kv_memory_gib must be > 0, got {self.kv_memory_gib}")
    if self.kv_memory_gib is not None and self.num_pages is not None:
      raise ValueError("EngineConfig: give num_pages or kv_memory_gib, not both")
    f = self.kv_memory_fraction
    if f is not None and not 0 < f <= 1:
      raise ValueError(f"EngineConfig.kv_memory_fraction must be in (0, 1], got {f}")
    if f is not None and (self.kv_memory_gib is not None or self.num_pages is not None):
      raise ValueError("EngineConfig: give one of num_pages, kv_memory_gib, kv_memory_fraction")

  @property
  def by_memory(self) -> bool:
    """Whether the pool is sized from memory (kv_memory_gib or kv_memory_fraction)."""
    return self.kv_memory_gib is not None or self.kv_memory_fraction is not None


@flax.struct.dataclass
class SlotState:
  """The decode slots of one shard's group on device (the engine holds R groups stacked on a
  leading axis). length: cache slots filled (where the next fed token goes); start: the first
  real cache slot (after the prompt's left padding; 0 in the shifted layout, `paged`); step:
  response tokens drawn; limit: the row's max new tokens; keys: the row keys' data."""

  pool: paged.PagePool
  last_token: jax.Array  # int32 [S]
  position: jax.Array  # int32 [S]
  length: jax.Array  # int32 [S]
  start: jax.Array  # int32 [S]
  step: jax.Array  # int32 [S]
  limit: jax.Array  # int32 [S]
  done: jax.Array  # bool [S]
  keys: jax.Array  # uint32 [S, ...]: jax.random.key_data of each row's key


_ROW_FIELDS = ("last_token", "position", "length", "start", "step", "limit", "done", "keys")


def _pages(n: int, page_size: int) -> int:
  return -(-n // page_size)


def _pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


class _GroupPages:
  """The host's page tables of R slot groups, one `paged.PageTable` (over a pool of its own) per
  group, addressed by global slot id g = group * slots_per_group + local slot."""

  def __init__(self, groups: int, num_pages: int, slots: int, max_pages: int, prompt_pages: int,
               page_size: int):  # fmt: skip
    self.per_group = slots // groups
    self.tables = [
      paged.PageTable(num_pages, self.per_group, max_pages, prompt_pages, page_size)
      for _ in range(groups)
    ]
    self.prompt_pages = prompt_pages

  def _at(self, slot: int) -> tuple[paged.PageTable, int]:
    return self.tables[slot // self.per_group], slot % self.per_group

  def group(self, slot: int) -> int:
    return slot // self.per_group

  def free(self, group: int) -> int:
    return len(self.tables[group].free)

  def take_prompt(self, slots: Sequence[int], count: int | None = None) -> list[int]:
    table, _ = self._at(slots[0])
    return table.take_prompt([self._at(s)[1] for s in slots], count)

  def page(self, slot: int, index: int) -> int:
    table, local = self._at(slot)
    return int(table.table[local, index])

  def wanted(self, slot: int, upto: int) -> int:
    table, local = self._at(slot)
    return table.wanted(local, upto)

  def grow(self, slot: int, upto: int) -> None:
    table, local = self._at(slot)
    table.grow(local, upto)

  def release(self, slot: int) -> None:
    table, local = self._at(slot)
    table.release(local)

  def rows(self, slot: int) -> np.ndarray:
    table, local = self._at(slot)
    return table.table[local]

  @property
  def in_use(self) -> int:
    return sum(t.in_use for t in self.tables)


@dataclasses.dataclass
class _Unit:
  """Rows admitted together: samples of one prompt (resume=False: prefilled from the prompt,
  first token 0) or one preempted row (resume=True: prefilled from its prompt and the `drawn`
  tokens it already has, first token `drawn`)."""

  prompt: int
  samples: list[int]
  resume: bool = False
  drawn: int = 0


@dataclasses.dataclass
class _Chunk:
  """A dispatched decode chunk: its flags (read one chunk later) and who ran in it."""

  flags: jax.Array  # int32 [3, R, S/R]: done, step, length of every slot after the chunk
  slots: np.ndarray  # global slot ids that ran
  rows: np.ndarray  # the row each of them held
  batch: int  # rows computed per step: the batch size times the groups
  version: int = 0  # the policy version that ran it (`_Rollout.version`)


class ContinuousSampler:
  """Samples G responses for each of a list of prompts with continuous batching (module doc).

  Rows of the output are prompt-major (row i * G + j: sample j of prompt i), right-padded with
  pad_id after the stop token, like `sampler.SampleOutput`. On the default device, or with `mesh`
  on its batch shards (data x fsdp: `slots` must be a multiple of their count), the parameters
  as they come (e.g. the trainer's shardings). `stats` holds the last call's counters
  (`_Rollout.stats`). free_bytes: what EngineConfig.kv_memory_fraction takes its share of
  (`free_memory_bytes`; None: measured at the first call).
  """

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    sampling: sampler_lib.SamplingParams,
    engine: EngineConfig = EngineConfig(),
    mesh: jax.sharding.Mesh | None = None,
    free_bytes: int | None = None,
  ):
    self.graphdef = graphdef
    self.sampling = sampling
    self.engine = engine
    self.mesh = mesh
    if engine.slots < 1:
      raise ValueError(
        f"ContinuousSampler needs EngineConfig.slots >= 1, got {engine.slots} (slots from the "
        "pool, 0, are sized per call by EngineSampler)"
      )
    self.free_bytes = free_bytes
    if engine.kv_memory_fraction is not None and free_bytes is None:
      _local_free_bytes(engine.kv_memory_fraction, mesh)  # a backend without figures: now
    self.groups = sharding.batch_shards(mesh) if mesh is not None else 1
    if engine.slots % self.groups:
      raise ValueError(
        f"EngineConfig.slots={engine.slots} must be a multiple of the mesh's {self.groups} batch "
        f"shards ({dict(mesh.shape)}): each shard decodes slots / {self.groups} of them"
      )
    self.per_group = engine.slots // self.groups
    # The state's and the host inputs' placement: the leading group axis over the batch shards;
    # the output rows whole on every device.
    self._spread = (
      None
      if mesh is None
      else jax.sharding.NamedSharding(mesh, partitioning.batch_spec((self.groups,), mesh))
    )
    self._whole = None if mesh is None else sharding.replicated(mesh)
    self.unroll = jax.default_backend() == "cpu" if engine.unroll is None else engine.unroll
    self.stats: dict[str, float] = {}
    self.attention: str | None = None  # what EngineConfig.attention resolved to, once called

  def _attention(self, model_cfg) -> str:
    """What EngineConfig.attention runs (`paged.resolve_attention`). On several batch shards the
    kernel runs per shard on its own slot group (`_decode`)."""
    impl = paged.resolve_attention(self.engine.attention, model_cfg, self.engine.page_size)
    self.attention = impl
    return impl

  def batch_sizes(self) -> list[int]:
    """The decode batch sizes (per group) a call may compile: the powers of two and, from 12
    on, three times the powers of two (which cut the padding of large batches by about half),
    below the slots per group, and the slots per group."""
    sizes = {1 << i for i in range(self.per_group.bit_length())}
    sizes |= {3 << i for i in range(2, self.per_group.bit_length())}
    return sorted(n for n in sizes if n < self.per_group) + [self.per_group]

  def pool_pages(self, prompt_len: int, group_size: int, attention: str = "gather",
                 model_cfg=None) -> int:  # fmt: skip
    """Pages of each group's pool: EngineConfig.num_pages split over the groups, or
    kv_memory_gib's or kv_memory_fraction's worth (model_cfg needed), or the expected footprint
    of its slots (`expected_pages`), and never fewer than one whole row needs."""
    e, n = self.engine, self.sampling.max_new_tokens
    row = _pages(prompt_len + n - 1, e.page_size)
    if e.num_pages is not None or e.by_memory:
      if e.num_pages is not None:
        pages, what = 1 + (e.num_pages - 1) // self.groups, f"EngineConfig.num_pages={e.num_pages}"
      else:
        pages, what = self._memory_pages(model_cfg)
      if pages - 1 < row:
        raise ValueError(
          f"{what} holds fewer than the {row} pages one response of prompt {prompt_len} + {n} "
          "new tokens needs (plus the reserved page 0)"
          + (f" in each of the {self.groups} shards' pools" if self.groups > 1 else "")
        )
      return pages
    return max(1 + row, self.expected_pages(self.per_group, prompt_len, group_size, attention))

  def expected_pages(self, slots: int, prompt_len: int, group_size: int,
                     attention: str = "gather") -> int:  # fmt: skip
    """The pages (page 0 included) a group's pool needs for `slots` rows at the footprint a
    rollout is expected to have: each prompt's pages once for the samples that share them on
    the group, and each row's own pages for a third of max_new_tokens and the two chunks it may
    run ahead (with attention "pallas", one more page: its copy of its prompt's partial last
    page)."""
    e, n = self.engine, self.sampling.max_new_tokens
    prompts = _pages(slots, min(group_size, slots)) * (prompt_len // e.page_size)
    own = _pages(n // 3 + 2 * e.chunk, e.page_size) + (attention == "pallas")
    return 1 + prompts + slots * own

  def _memory_pages(self, model_cfg) -> tuple[int, str]:
    """(pages of each group's pool, what gave them) from EngineConfig.kv_memory_gib (all shards
    together) or kv_memory_fraction (of each device's free memory, on every shard)."""
    e = self.engine
    if e.kv_memory_gib is not None:
      total, what = e.kv_memory_gib * 2**30, f"EngineConfig.kv_memory_gib={e.kv_memory_gib}"
    else:
      if self.free_bytes is None:
        self.free_bytes = free_memory_bytes(e.kv_memory_fraction, self.mesh)
      total = e.kv_memory_fraction * self.free_bytes * self.groups
      what = (
        f"EngineConfig.kv_memory_fraction={e.kv_memory_fraction} of "
        f"{self.free_bytes / 2**30:.3g} GiB free per device"
      )
    pages = int(total // paged.pool_bytes(model_cfg, 1, e.page_size)) // self.groups
    return pages, f"{what} ({pages * self.groups} pages)"

  def _put(self, tree, whole: bool = False):
    """Host arrays with a leading group axis -> device arrays placed like the state (each
    process passes every group; it feeds those its devices hold); whole: on every device."""
    if self._spread is None:
      return tree
    if whole:
      return jax.device_put(tree, self._whole)
    rows = sharding.process_rows(self.groups, self.mesh)
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(self._spread, np.asarray(x)[rows]), tree
    )

  def warm_up(self, params: nnx.State, prompt_len: int, group_size: int = 1) -> None:
    """Compiles the programs a call with these shapes runs (the decode chunk at each batch size,
    the prefill of each power-of-two prompt count, the writes of their tokens) by a call on
    dummy prompts that keeps every batch size busy: what a benchmark or a first rollout would
    otherwise compile as it goes."""
    e, sp = self.engine, self.sampling
    rows = self.per_group * self.groups
    # Row i runs 1 + stage(i) chunks, stage(i) = how many batch sizes (but the largest) exceed
    # i / groups: as stages end, the rows left step down through every size.
    prompts = -(-rows // group_size)
    sizes = np.asarray(self.batch_sizes()[:-1]) * self.groups
    stage = (sizes[None] > np.arange(prompts * group_size)[:, None]).sum(axis=1)
    limits = np.minimum(1 + e.chunk * (1 + stage), sp.max_new_tokens).astype(np.int32)
    self(
      params, [[1] * prompt_len] * prompts, jax.random.key(0), group_size=group_size,
      prompt_len=prompt_len, row_limits=limits,
    )  # fmt: skip

  def __call__(
    self,
    params: nnx.State,
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    *,
    group_size: int = 1,
    prompt_len: int | None = None,
    prompt_ids: Sequence[int] | None = None,
    row_limits: np.ndarray | None = None,
  ) -> sampler_lib.SampleOutput:
    """prompts: token-id lists; group_size: samples per prompt (more than a group's slots: its
    samples are admitted in parts, each prefilling the prompt); prompt_len: the padded prompt
    length (rounded up to the page size; None: the longest prompt); prompt_ids: each prompt's
    id in the row keys (default 0, 1, ...); row_limits: int32 [num_prompts * G], each row's own
    max_new_tokens (as `sampler.sample`'s)."""
    run = _Rollout(self, params, prompts, key, group_size, prompt_len, prompt_ids, row_limits)
    out = run.run()
    self.stats = run.stats()
    return out


class _Rollout:
  """One call of a `ContinuousSampler`: the host's scheduler (admit, reserve or preempt, decode,
  collect; module doc) and the device arrays it drives."""

  def __init__(self, engine: ContinuousSampler, params, prompts, key, group_size, prompt_len,
               prompt_ids, row_limits):  # fmt: skip
    G, N, ps = group_size, engine.sampling.max_new_tokens, engine.engine.page_size
    if G < 1:
      raise ValueError(f"group_size={G} must be >= 1")
    if not len(prompts):
      raise ValueError("no prompts given")
    longest = max(map(len, prompts))
    P = -(-max(prompt_len or 0, longest) // ps) * ps
    ids = np.arange(len(prompts)) if prompt_ids is None else np.asarray(prompt_ids)
    keys = sampler_lib.row_keys(key, np.repeat(ids, G), np.tile(np.arange(G), len(prompts)))
    key_data = np.asarray(jax.random.key_data(keys))  # [rows, ...], prompt-major
    self._lay_out(engine, params, G, P, len(prompts), key_data.shape[1:])
    self.key_data = key_data
    self.prompts = [list(map(int, p)) for p in prompts]
    self.tokens, self.mask = sampler_lib.left_pad(self.prompts, pad_id=self.sp.pad_id, length=P)
    if row_limits is not None:
      limits = np.asarray(row_limits, np.int32).reshape(-1)
      if limits.shape != (self.num_rows,) or limits.min() < 1 or limits.max() > N:
        raise ValueError(f"row_limits: one limit in [1, {N}] per row ({self.num_rows} rows)")
      self.limits = limits
    # Each prompt's last cache slot + 1: P (left-padded), or its length when shifted.
    self.ends = self.mask.sum(axis=1) if self.shifted else np.full(len(prompts), P)
    for prompt in range(len(prompts)):
      self._queue(prompt)

  def _lay_out(self, engine: ContinuousSampler, params, G: int, P: int, num_prompts: int,
               key_shape: tuple[int, ...]) -> None:  # fmt: skip
    """The device state and the host's bookkeeping of num_prompts prompts' G rows each, prompts
    padded to P tokens (a multiple of the page size), row keys' data of key_shape; every row's
    limit max_new_tokens."""
    cfg, sp = engine.engine, engine.sampling
    self.engine, self.cfg, self.sp = engine, cfg, sp
    self.G, self.N, self.ps, self.P = G, sp.max_new_tokens, cfg.page_size, P
    self.num_rows = num_prompts * G
    self.limits = np.full(self.num_rows, self.N, np.int32)
    self.model_cfg = nnx.merge(engine.graphdef, params).cfg
    self.impl = engine._attention(self.model_cfg)
    self.shifted = self.impl == "pallas"  # the prompt layout (`paged`)
    R, S = engine.groups, engine.per_group * engine.groups
    self.R, self.S, self.per_group = R, S, engine.per_group
    self.num_pages = engine.pool_pages(P, G, self.impl, self.model_cfg)
    self.max_pages = _pages(P + self.N - 1, self.ps)
    self.pages = _GroupPages(R, self.num_pages, S, self.max_pages, P // self.ps, self.ps)
    self.params = in_compute_dtype(params, self.model_cfg.compute_dtype)
    self.version = 0  # the policy version of self.params (what each chunk records)
    self.state = _init_state(
      self.model_cfg, R, engine.per_group, self.num_pages, self.ps, tuple(key_shape),
      engine._spread,
    )  # fmt: skip
    self.outputs = _init_outputs(self.model_cfg, sp, self.num_rows, engine._whole)

    # Host bookkeeping. Slots: global ids, group * slots per group + local slot.
    self.slot_row = np.full(S, -1)  # the row a slot holds
    self.length = np.zeros(S, np.int64)  # cache slots filled, as last read
    self.slot_end = np.zeros(S, np.int64)  # cache slots the slot may ever fill
    self.order = np.zeros(S, np.int64)  # admission order: the latest are preempted first
    self.ahead = np.zeros(S, np.int64)  # chunks dispatched since its flags were last read
    self.row_step = np.zeros(self.num_rows, np.int32)  # tokens drawn, as last read
    self.pending: collections.deque[_Unit] = collections.deque()
    self.waiting: set[int] = set()  # preempted rows whose last chunk is not read yet
    self.counters: collections.Counter = collections.Counter()
    self.sizes: set[int] = set()
    self.peak_pages = 0
    self.host_wait = 0.0

  def _queue(self, prompt: int) -> None:
    """Queues a prompt's G samples for admission, in parts that fit a slot group."""
    per_unit = min(self.G, self.per_group)
    for first in range(0, self.G, per_unit):
      self.pending.append(_Unit(prompt, list(range(first, min(self.G, first + per_unit)))))

  # -- the loop ------------------------------------------------------------------------------

  def run(self) -> sampler_lib.SampleOutput:
    inflight = None
    while self.pending or self.waiting or (self.slot_row >= 0).any() or inflight is not None:
      self.admit()
      chunk = self.decode() if (self.slot_row >= 0).any() else None
      if inflight is not None:
        self.collect(inflight)  # the device runs `chunk` meanwhile
      elif chunk is None and self.pending:
        raise RuntimeError("continuous engine: pending prompts but nothing admitted or running")
      inflight = chunk
    out = sharding.to_host(self.outputs)
    lengths = self.row_step.astype(np.int32)
    mask = np.arange(self.N)[None] < lengths[:, None]
    return sampler_lib.SampleOutput(mask=mask, lengths=lengths, **out)

  def stats(self) -> dict[str, float]:
    """The call's counters: admitted prompts and prefill calls, decode calls and steps,
    row_steps (tokens decoded) against batch_steps (rows computed, live or not: busy_share is
    their ratio), the batch sizes used, preempted rows, pages (peak and pool) and the host's
    wait for each chunk's flags."""
    c = self.counters
    return dict(
      c,
      slots=self.S,
      busy_share=c["row_steps"] / max(1, c["batch_steps"]),
      batch_sizes=sorted(self.sizes),
      num_pages=self.num_pages * self.R,
      peak_pages=self.peak_pages,
      pool_bytes=self.R * paged.pool_bytes(self.model_cfg, self.num_pages, self.ps),
      prompt_len=self.P,
      host_wait_s=self.host_wait,
      host_wait_per_chunk_s=self.host_wait / max(1, c["decode_calls"]),
    )

  # -- admit ---------------------------------------------------------------------------------

  def _reach(self, slot: int) -> int:
    """Cache slots [0, reach) the slot may have written by the end of the next chunk: its
    length as last read plus a chunk for each one dispatched since and the next."""
    reach = self.length[slot] + self.cfg.chunk * (1 + self.ahead[slot])
    return int(min(reach, self.slot_end[slot]))

  def _group_slots(self, r: int) -> range:
    return range(r * self.per_group, (r + 1) * self.per_group)

  def _unit_shape(self, unit: _Unit) -> tuple[int, int]:
    """(end, first): a unit's prefilled cache slots (its last + 1) and the pages each of its
    rows takes for its first chunks beyond the shared ones."""
    ps, chunk = self.ps, self.cfg.chunk
    if unit.resume:
      end = len(self.prompts[unit.prompt]) + unit.drawn
    else:
      end = int(self.ends[unit.prompt])
    row = unit.prompt * self.G + unit.samples[0]
    last = end + int(self.limits[row]) - unit.drawn - 1
    first = _pages(min(end + 2 * chunk, last), ps) - end // ps
    return end, max(first, int(end % ps > 0))

  def admit(self) -> None:
    """Prefills pending units into free slots, keeping the pages the running rows' next chunks
    need (admitting into them would only preempt them). A unit goes to the group with the most
    free slots; new prompts and resumed rows are prefilled in separate calls."""
    R = self.R
    running = [[s for s in self._group_slots(r) if self.slot_row[s] >= 0] for r in range(R)]
    free_slots = [[s for s in self._group_slots(r) if self.slot_row[s] < 0] for r in range(R)]
    budget = [
      self.pages.free(r) - sum(self.pages.wanted(s, self._reach(s)) for s in running[r])
      for r in range(R)
    ]
    admitted = {False: [], True: []}
    count = [0] * R
    idle = not any(running)
    while self.pending:
      unit = self.pending[0]
      end, first = self._unit_shape(unit)
      need = end // self.ps + len(unit.samples) * first
      fits = [
        r for r in range(R)
        if len(unit.samples) <= len(free_slots[r]) and need <= budget[r]
        and count[r] < self.cfg.prefill_rows
      ]  # fmt: skip
      if not fits:
        if idle and not any(admitted.values()) and len(unit.samples) > 1:
          # Nothing runs and a whole unit does not fit the pool: admit its samples in halves.
          half = len(unit.samples) // 2
          self.pending.popleft()
          self.pending.extendleft([
            dataclasses.replace(unit, samples=unit.samples[half:]),
            dataclasses.replace(unit, samples=unit.samples[:half]),
          ])  # fmt: skip
          continue
        break
      r = max(fits, key=lambda r: (len(free_slots[r]), -r))
      self.pending.popleft()
      budget[r] -= need
      count[r] += 1
      slots = [int(free_slots[r].pop(0)) for _ in unit.samples]
      admitted[unit.resume].append((unit, slots))
    for resume, units in admitted.items():
      if units:
        self._prefill(units, resume)

  def _prefill(self, units: list[tuple[_Unit, list[int]]], resume: bool) -> None:
    """One prefill call for `units` (each with its slots, in one group), each group's padded to
    the same power of two of prompts (dummy prompts write to the trash page and start no
    slot)."""
    R, G, ps, sp = self.R, self.G, self.ps, self.sp
    by_group = [[(u, s) for u, s in units if self.pages.group(s[0]) == r] for r in range(R)]
    m = _pow2(max(map(len, by_group)))
    width = 1 if resume else min(G, self.per_group)
    shifted = self.shifted or resume
    if resume:  # prompt + response so far, in a power of two of pages
      tokens = {id(u): self.prompts[u.prompt] + self._drawn(u) for u, _ in units}
      P = ps * _pow2(max(_pages(len(t), ps) for t in tokens.values()))
    else:
      P = self.P
    p_tok = np.full((R, m, P), sp.pad_id, np.int32)
    p_mask = np.zeros((R, m, P), bool)
    p_mask[..., -1] = True  # dummy prompts: one real token
    p_pages = np.full((R, m, P // ps), paged.TRASH_PAGE, np.int32)
    slot_ids = np.full((R, m, width), self.per_group, np.int32)  # out of range: dropped
    rows = np.full((R, m, width), self.num_rows, np.int32)  # out of range: dropped
    row_keys = np.zeros((R, m, width, *self.key_data.shape[1:]), self.key_data.dtype)
    limits = np.ones((R, m, width), np.int32)
    first_step = np.zeros((R, m, width), np.int32)
    p_tail = np.full((R, m, width), paged.TRASH_PAGE, np.int32)
    for r, group_units in enumerate(by_group):
      for u, (unit, slots) in enumerate(group_units):
        if resume:
          t = tokens[id(unit)]
          p_tok[r, u, P - len(t) :], p_mask[r, u] = t, np.arange(P) >= P - len(t)
          end = len(t)
        else:
          p_tok[r, u], p_mask[r, u] = self.tokens[unit.prompt], self.mask[unit.prompt]
          end = int(self.ends[unit.prompt])
        p_pages[r, u, : end // ps] = self.pages.take_prompt(slots, end // ps)
        unit_rows = [unit.prompt * G + j for j in unit.samples]
        for j, (slot, row) in enumerate(zip(slots, unit_rows, strict=True)):
          if shifted and end % ps:
            self.pages.grow(slot, end)
            p_tail[r, u, j] = self.pages.page(slot, end // ps)
          self.slot_row[slot], self.length[slot], self.ahead[slot] = row, end, 0
          self.row_step[row] = unit.drawn + 1  # the prefill draws one token
          self.slot_end[slot] = end + int(self.limits[row]) - unit.drawn - 1
          self.order[slot] = self.counters["admitted_rows"]
          self.counters["admitted_rows"] += 1
        k = len(slots)
        slot_ids[r, u, :k] = [s % self.per_group for s in slots]
        rows[r, u, :k] = unit_rows
        row_keys[r, u, :k] = self.key_data[unit_rows]
        limits[r, u, :k] = self.limits[unit_rows]
        first_step[r, u, :k] = unit.drawn
    inputs = self.engine._put((p_tok, p_mask, p_pages, slot_ids, row_keys, limits, p_tail,
                               first_step))  # fmt: skip
    e = self.engine
    self.state, records, cols = _admit(
      e.graphdef, sp, e._spread, shifted, self.params, self.state, *inputs
    )
    self.outputs = _write(self.outputs, records, e._put(rows.reshape(R, -1)), cols, e._whole)
    self.counters["prefill_calls"] += 1
    self.counters["resumed_rows" if resume else "prefilled_prompts"] += len(units)

  def _drawn(self, unit: _Unit) -> list[int]:
    """The tokens a preempted row has drawn (fetched from the output rows on the device)."""
    row = unit.prompt * self.G + unit.samples[0]
    got = np.asarray(sharding.to_host(self.outputs["tokens"][row, : unit.drawn]))
    return [int(t) for t in got]

  # -- reserve or preempt, decode ------------------------------------------------------------

  def decode(self) -> _Chunk:
    """Reserves each running row's pages for the next chunk, preempting the latest-admitted rows
    of a group whose pool runs short, then dispatches the chunk on the running rows."""
    R, e = self.R, self.engine
    running = []
    for r in range(R):
      group = [s for s in self._group_slots(r) if self.slot_row[s] >= 0]
      while sum(self.pages.wanted(s, self._reach(s)) for s in group) > self.pages.free(r):
        # Rows that have run since their admission (admission keeps the pages of a new row's
        # first chunk, so the others suffice).
        ran = [s for s in group if self.ahead[s]]
        if not ran:
          raise RuntimeError(
            f"continuous engine: shard {r}'s pool ({self.pages.free(r)} pages free) cannot hold "
            "the first chunk of the rows just admitted (a scheduler bug: please report it)"
          )
        victim = max(ran, key=lambda s: self.order[s])
        self._preempt(victim)
        group.remove(victim)
      for s in group:
        self.pages.grow(s, self._reach(s))
      running.append(group)
    self.peak_pages = max(self.peak_pages, self.pages.in_use)
    busiest = max(map(len, running))
    B = min(n for n in self.engine.batch_sizes() if n >= busiest)
    slots = np.full((R, B), self.per_group, np.int32)  # out of range: no row
    table = np.full((R, B, self.max_pages), paged.TRASH_PAGE, np.int32)
    rows = np.full((R, B), self.num_rows, np.int32)
    for r, group in enumerate(running):
      for b, s in enumerate(group):
        slots[r, b], rows[r, b] = s % self.per_group, self.slot_row[s]
        table[r, b] = self.pages.rows(s)
    ran = np.asarray([s for group in running for s in group], np.int64)
    self.ahead[ran] += 1
    self.sizes.add(B)
    self.state, records, cols, flags = _decode(
      e.graphdef, self.sp, self.cfg.chunk, e._spread, self.impl, e.unroll, self.params,
      self.state, *e._put((slots, table)),
    )  # fmt: skip
    self.outputs = _write(self.outputs, records, e._put(rows), cols, e._whole)
    self.counters["decode_calls"] += 1
    return _Chunk(
      flags=flags, slots=ran, rows=self.slot_row[ran].copy(), batch=B * R, version=self.version
    )

  def _preempt(self, slot: int) -> None:
    """Frees a running row's slot and pages; it is admitted again once its progress is read."""
    row = int(self.slot_row[slot])
    self.pages.release(slot)
    self.slot_row[slot] = -1
    self.waiting.add(row)
    self.counters["preempted"] += 1

  # -- collect -------------------------------------------------------------------------------

  def collect(self, chunk: _Chunk) -> list[int]:
    """Reads a chunk's flags: releases the rows that finished, queues the preempted rows it
    last ran (at the front, with the tokens they drew) and counts its steps. Returns the rows
    the flags show finished (a row that finished in a chunk is shown again by the next one,
    dispatched before its flags were read)."""
    t0 = time.perf_counter()
    done, step, length = (
      np.asarray(x).reshape(-1) for x in sharding.to_host(chunk.flags)
    )  # [S] each
    self.host_wait += time.perf_counter() - t0
    slots, rows = chunk.slots, chunk.rows
    drawn = step[slots] - self.row_step[rows]
    self.counters["row_steps"] += int(drawn.sum())
    taken = int(drawn.max(initial=0))
    self.counters["decode_steps"] += taken
    self.counters["batch_steps"] += taken * chunk.batch
    self.row_step[rows] = step[slots]
    resumed, finished = [], []
    for s, row, is_done in zip(slots, rows, done[slots], strict=True):
      here = self.slot_row[s] == row
      if here:
        self.length[s], self.ahead[s] = length[s], self.ahead[s] - 1
      if is_done:
        if here:
          self.pages.release(int(s))
          self.slot_row[s] = -1
        self.waiting.discard(int(row))
        finished.append(int(row))
      elif row in self.waiting:
        self.waiting.discard(int(row))
        resumed.append(_Unit(int(row) // self.G, [int(row) % self.G], True, int(step[s])))
    self.pending.extendleft(reversed(resumed))
    return finished


@functools.partial(jax.jit, static_argnums=1)
def in_compute_dtype(params: nnx.State, dtype) -> nnx.State:
  """The floating parameters cast to the compute dtype once per call: each decode step then
  reads 16-bit weights instead of casting float32 ones again (every use casts them to this
  dtype anyway, so the results are the same)."""
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, params)


def _spread_over(spread, tree):
  """tree with its leading (group) axis placed by `spread` (None: left to XLA)."""
  return tree if spread is None else jax.lax.with_sharding_constraint(tree, spread)


def _under_mesh(spread):
  """The ambient mesh of a device program traced with `spread` (its mesh; none without one),
  as the fixed sampler traces its program (`sampler.jit_sampler`): model code that reads it
  then runs as there, e.g. a decode step on an expert axis runs each device's own experts
  (`moe.moe_mlp`) instead of gathering every layer's experts at every step."""
  if spread is None:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(spread.mesh.abstract_mesh)


def _traced_on_mesh(index: int):
  """A device program traced under the mesh of its sharding argument `index` (`_under_mesh`)."""

  def wrap(fn):
    @functools.wraps(fn)
    def traced(*args):
      with _under_mesh(args[index]):
        return fn(*args)

    return traced

  return wrap


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _init_state(cfg, R, S, num_pages, page_size, key_shape, spread) -> SlotState:
  """R groups' empty states, S slots and a pool of num_pages pages each, stacked."""
  zi = jnp.zeros((S,), jnp.int32)
  one = SlotState(
    pool=paged.init_pool(cfg, num_pages, page_size),
    last_token=zi,
    position=zi,
    length=zi,
    start=zi,
    step=zi,
    limit=zi,
    done=jnp.ones((S,), bool),
    keys=jnp.zeros((S, *key_shape), jnp.uint32),
  )
  return _spread_over(spread, jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *x.shape)), one))


def _record_fields(cfg, sp) -> list[tuple[str, tuple[int, ...], float, jnp.dtype]]:
  """(name, shape per token, padding, dtype) of what a rollout records per response token
  (`sampler.token_records`'s fields)."""
  fields = [
    ("tokens", (), sp.pad_id, jnp.int32),
    ("logprobs", (), 0.0, jnp.float32),
    ("entropy", (), 0.0, jnp.float32),
  ]
  if sp.num_topk:
    fields.append(("topk_logprobs", (sp.num_topk,), -jnp.inf, jnp.float32))
    fields.append(("topk_ids", (sp.num_topk,), sp.pad_id, jnp.int32))
  if sp.kept_width:
    fields.append(("kept_ids", (sp.kept_width,), -1, jnp.int32))
  if sp.record_experts:
    routes = (cfg.num_layers, cfg.num_experts_per_tok)
    fields.append(("expert_ids", routes, -1, sampler_lib.EXPERT_ID_DTYPE))
  return fields


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init_outputs(cfg, sp, rows, whole) -> dict[str, jax.Array]:
  """The rollout's output rows on the device, by `SampleOutput` field, filled with its padding."""
  N = sp.max_new_tokens
  out = {
    name: jnp.full((rows, N, *shape), fill, dtype)
    for name, shape, fill, dtype in _record_fields(cfg, sp)
  }
  return out if whole is None else jax.lax.with_sharding_constraint(out, whole)


@functools.partial(jax.jit, static_argnums=(4,), donate_argnums=(0,))
@_traced_on_mesh(4)
def _write(outputs, records, rows, cols, whole) -> dict[str, jax.Array]:
  """The output rows with records [R, B, T, ...] written at rows [R, B] (out of range: none) and
  response indices cols [R, B, T] (out of range: not written)."""
  at = (rows[..., None], cols)
  out = {
    name: buf.at[at].set(records[name].astype(buf.dtype), mode="drop")
    for name, buf in outputs.items()
  }
  return out if whole is None else jax.lax.with_sharding_constraint(out, whole)


def _group_axes(spread: jax.sharding.NamedSharding | None) -> tuple[str, ...]:
  """The mesh axes the group axis is split over (`batch_spec` of R groups: their product is R)."""
  first = None if spread is None or not len(spread.spec) else spread.spec[0]
  if first is None:
    raise ValueError("several slot groups, but their axis is not split over the mesh")
  return (first,) if isinstance(first, str) else tuple(first)


def _over_groups(fn, spread, impl, *args):
  """fn(*args) in every group at once (args with a leading group axis). The Pallas kernel on
  several groups runs per shard (`paged.pallas_attention`): then fn gets shards=(mesh, axes).
  fn traces the model as under `jax.vmap` (under_vmap=True) in every case."""
  R = jax.tree.leaves(args)[0].shape[0]
  if impl == "pallas" and R > 1:
    axes = _group_axes(spread)
    run = functools.partial(fn, shards=(spread.mesh, axes))
    return _spread_over(spread, jax.vmap(run, spmd_axis_name=axes)(*args))
  if impl == "pallas":  # one group: called on it directly
    out = fn(*jax.tree.map(lambda x: x[0], args))
    return jax.tree.map(lambda x: x[None], out)
  return _spread_over(spread, jax.vmap(fn)(*args))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
@_traced_on_mesh(2)
def _admit(graphdef, sp, spread, shifted, params, state, *inputs):
  """`_admit_group` in every group at once (inputs with a leading group axis): (state, records
  [R, m G, 1, ...], cols [R, m G, 1])."""
  admit = lambda state, *inputs: _admit_group(graphdef, sp, shifted, params, state, *inputs)
  return _spread_over(spread, jax.vmap(admit)(state, *inputs))


def _admit_group(graphdef, sp, shifted, params, state, p_tok, p_mask, p_pages, slot_ids, row_keys,
                 limits, p_tail, first_step):  # fmt: skip
  """Prefills m prompts [m, P] into one group's pages and starts their rows (slot_ids [m, G],
  out-of-range ids dropped): each row's token `first_step` drawn from its prompt's last logits.
  shifted: the shifted layout (`paged`), each row's first own page in p_tail [m, G]."""
  model = nnx.merge(graphdef, params)
  m, P = p_tok.shape
  G = slot_ids.shape[1]
  N = sp.max_new_tokens
  positions = model_lib.positions_from_mask(p_mask)
  cache, logits, route = sampler_lib.prefill_prompts(
    model, p_tok, p_mask, positions, sp.record_experts, under_vmap=True
  )
  rep = lambda x: jnp.repeat(x, G, axis=0)  # per prompt -> per row [m G]
  pad = P - jnp.sum(p_mask, axis=1, dtype=jnp.int32)  # [m]
  if shifted:  # each prompt moved to slot 0
    pool = paged.write_prefill(state.pool, cache, p_pages, shift=pad, tail=p_tail)
    start, length = jnp.zeros_like(pad), P - pad
  else:
    pool = paged.write_prefill(state.pool, cache, p_pages)
    start, length = pad, jnp.full_like(pad, P)
  key_data = row_keys.reshape(m * G, *row_keys.shape[2:])
  step = first_step.reshape(-1)
  token, logprob, topk, kept, entropy = sampler_lib._sample_token(
    rep(logits), sampler_lib.step_keys(jax.random.wrap_key_data(key_data), step), sp
  )
  slots = slot_ids.reshape(-1)
  valid = slots < state.done.shape[0]
  values = sampler_lib.token_records(
    token, logprob, topk, kept, entropy, valid, sp, None if route is None else rep(route)
  )
  limit = limits.reshape(-1)
  put = lambda buf, val: buf.at[slots].set(val.astype(buf.dtype), mode="drop")
  state = state.replace(
    pool=pool,
    last_token=put(state.last_token, token),
    position=put(state.position, rep(positions[:, -1] + 1)),
    length=put(state.length, rep(length)),
    start=put(state.start, rep(start)),
    step=put(state.step, step + 1),
    limit=put(state.limit, limit),
    done=put(state.done, sampler_lib.stops(token, step, limit, sp)),
    keys=put(state.keys, key_data),
  )
  records = {name: val[:, None] for name, val in values.items()}
  return state, records, jnp.where(valid, step, N)[:, None]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(7,))
@_traced_on_mesh(3)
def _decode(graphdef, sp, chunk, spread, impl, unroll, params, state, slots, table):
  """Up to `chunk` decode steps of every group's running rows (a leading group axis), gathered
  from their slots (slots [R, B]: out-of-range ids are no row) into a batch of B, then written
  back. Returns (state, records [R, B, chunk, ...] of the steps' tokens, cols [R, B, chunk]: the
  response index each record is of, N where the row did not step, flags int32 [3, R, S]: done,
  step and length of every slot).

  The loop runs over all groups at once and only its step is vmapped over them: a loop under
  vmap whose condition differs per group would select between old and new carry at each step,
  a copy of the whole page pool."""
  weights = paged.decode_weights(graphdef, params, unroll)
  cfg = nnx.merge(graphdef, params).cfg
  S, N = state.done.shape[1], sp.max_new_tokens
  valid = slots < S
  take = jax.vmap(lambda x, i: x[i])
  rows = {name: take(getattr(state, name), jnp.minimum(slots, S - 1)) for name in _ROW_FIELDS}
  rows["done"] = rows["done"] | ~valid
  records = {
    name: jnp.full((*slots.shape, chunk, *shape), fill, dtype)
    for name, shape, fill, dtype in _record_fields(cfg, sp)
  }
  cols = jnp.full((*slots.shape, chunk), N, jnp.int32)
  step = lambda pool, rows, table, shards=None: _decode_step(
    cfg, sp, impl, weights, pool, rows, table, shards
  )

  def body(carry):
    i, pool, rows, records, cols = carry
    pool, rows, values, col = _over_groups(step, spread, impl, pool, rows, table)
    put = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val.astype(buf.dtype), i, 2)
    records = {name: put(buf, values[name]) for name, buf in records.items()}
    return i + 1, pool, rows, records, put(cols, col)

  cond = lambda carry: (carry[0] < chunk) & jnp.any(~carry[2]["done"])
  _, pool, rows, records, cols = jax.lax.while_loop(
    cond, body, (jnp.int32(0), state.pool, rows, records, cols)
  )
  put = jax.vmap(lambda x, i, v: x.at[i].set(v, mode="drop"))
  state = state.replace(
    pool=pool, **{name: put(getattr(state, name), slots, rows[name]) for name in _ROW_FIELDS}
  )
  flags = jnp.stack([state.done.astype(jnp.int32), state.step, state.length])
  return _spread_over(spread, state), records, cols, flags


def _decode_step(cfg, sp, impl, weights, pool, rows, table, shards=None):
  """One decode step of one group's batch of rows (`_ROW_FIELDS` [B] each, table [B, pages]):
  (pool, rows advanced, the step's `sampler.token_records`, cols [B]: the response index each
  row drew, N where it did not step)."""
  live = ~rows["done"]
  logits, pool, route = paged.decode_step(
    cfg, weights, pool, rows["last_token"], rows["position"], table, rows["start"],
    rows["length"], live, with_routing=sp.record_experts, attention_impl=impl, shards=shards,
    under_vmap=True,
  )  # fmt: skip
  keys = sampler_lib.step_keys(jax.random.wrap_key_data(rows["keys"]), rows["step"])
  drawn = sampler_lib._sample_token(logits, keys, sp)
  values = sampler_lib.token_records(*drawn, live, sp, route)
  stopped = sampler_lib.stops(values["tokens"], rows["step"], rows["limit"], sp)
  col = jnp.where(live, rows["step"], sp.max_new_tokens)
  rows = dict(
    rows,
    last_token=jnp.where(live, drawn[0], rows["last_token"]),
    position=rows["position"] + live,
    length=rows["length"] + live,
    step=rows["step"] + live,
    done=rows["done"] | (live & stopped),
  )
  return pool, rows, values, col


def kv_bytes_fixed(cfg, rows: int, prompt_len: int, max_new_tokens: int) -> int:
  """The KV cache bytes the fixed-batch sampler holds for `rows` rows (`model.init_cache` of
  prompt + max_new_tokens slots)."""
  return rows * (prompt_len + max_new_tokens) * paged.kv_bytes_per_token(cfg)


class EngineSampler:
  """`sampler.MeshSampler`'s call, served by continuous batching: what the trainer's rollouts
  and evaluations call with `rollout.engine="continuous"`.

  Takes the same left-padded rows (runs of `group_size` identical prompts); prompt b / G of the
  call gets id b / G in the row keys. One engine (one compiled set) per sampling setting and
  slot count. With `mesh`, on its batch shards (`ContinuousSampler`). EngineConfig.slots=0 (the
  pool given by memory): each call's slot count follows from the pool (`slots_for`);
  kv_memory_fraction is measured once, at the first call, for every engine.
  """

  def __init__(self, graphdef: nnx.GraphDef, engine: EngineConfig,
               mesh: jax.sharding.Mesh | None = None):  # fmt: skip
    self.graphdef = graphdef
    self.engine = engine
    self.mesh = mesh
    self.batch_multiple = 1
    self._engines: dict[tuple[sampler_lib.SamplingParams, int], ContinuousSampler] = {}
    self.stats: dict[str, float] = {}
    self.free_bytes: int | None = None  # what kv_memory_fraction takes its share of
    if engine.kv_memory_fraction is not None:
      _local_free_bytes(engine.kv_memory_fraction, mesh)  # a backend without figures: now

  def __call__(
    self,
    params,
    prompt_tokens: np.ndarray,
    prompt_mask: np.ndarray,
    rng: jax.Array,
    sampling: sampler_lib.SamplingParams,
    *,
    group_size: int | None = None,
    row_limits: np.ndarray | None = None,
    prompt_ids: Sequence[int] | None = None,
  ) -> sampler_lib.SampleOutput:
    """`MeshSampler`'s call; row_limits: int32 [rows], each row's own max_new_tokens (benchmarks
    force long-tailed lengths with it); prompt_ids: each prompt's id in the row keys (default
    0, 1, ...: a share of a larger call passes its prompts' ids there, and draws their rows)."""
    tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask, bool)
    G = sampler_lib.call_group_size(tokens, mask, group_size)
    if self.engine.kv_memory_fraction is not None and self.free_bytes is None:
      self.free_bytes = free_memory_bytes(self.engine.kv_memory_fraction, self.mesh)
    slots = self.engine.slots or self.slots_for(params, sampling, tokens.shape[1], G, len(tokens))
    if (sampling, slots) not in self._engines:
      self._engines[sampling, slots] = ContinuousSampler(
        self.graphdef, sampling, dataclasses.replace(self.engine, slots=slots), self.mesh,
        self.free_bytes,
      )  # fmt: skip
    engine = self._engines[sampling, slots]
    runs = (tokens.reshape(-1, G, tokens.shape[1]), mask.reshape(-1, G, mask.shape[1]))
    if not all((x == x[:, :1]).all() for x in runs):
      raise ValueError(f"group_size={G}: rows do not come in runs of {G} identical prompts")
    prompts = [row[m].tolist() for row, m in zip(tokens[::G], mask[::G], strict=True)]
    out = engine(
      params, prompts, rng, group_size=G, prompt_len=tokens.shape[1], row_limits=row_limits,
      prompt_ids=prompt_ids,
    )  # fmt: skip
    self.stats = engine.stats
    return out

  def slots_for(self, params, sampling: sampler_lib.SamplingParams, prompt_len: int,
                group_size: int, rows: int) -> int:  # fmt: skip
    """The slot count for a call of `rows` rows when the pool is given by memory and slots=0:
    as many slots per batch shard as its pool holds rows at the footprint a rollout is expected
    to have (`ContinuousSampler.expected_pages`: its prompt's share, a third of max_new_tokens
    and two chunks; the default pool's estimate, reversed), at most the call's rows split over
    the shards, at least one, times the shards. It assumes responses a third of max_new_tokens
    long on average: longer ones preempt rows (`rollout/engine/preempted`), shorter ones leave
    pages idle (`rollout/engine/peak_pages`)."""
    cfg = nnx.merge(self.graphdef, params).cfg
    # The slot count does not change a pool given by memory: size it on a probe of one slot
    # per shard (which also says when the pool holds no whole row).
    shards = sharding.batch_shards(self.mesh) if self.mesh is not None else 1
    probe = ContinuousSampler(
      self.graphdef, sampling, dataclasses.replace(self.engine, slots=shards), self.mesh,
      self.free_bytes,
    )  # fmt: skip
    ps = self.engine.page_size
    P = _pages(prompt_len, ps) * ps  # as the engine pads prompts
    impl = paged.resolve_attention(self.engine.attention, cfg, ps)
    pages = probe.pool_pages(P, group_size, impl, cfg)
    fits = [
      n for n in range(1, -(-rows // shards) + 1)
      if probe.expected_pages(n, P, group_size, impl) <= pages
    ]  # fmt: skip
    return max(fits, default=1) * shards

  def metrics(self) -> dict[str, float]:
    """The last call's engine figures as run metrics (`rollout/engine/*`, `_Rollout.stats`):
    the slots, busy_share (rows decoded over rows computed), decode steps and calls, the
    smallest and largest batch used and how many sizes, preempted and resumed rows, peak and
    pool pages, the host's wait for a chunk's flags."""
    return engine_metrics(self.stats)


def engine_metrics(st: dict) -> dict[str, float]:
  """`_Rollout.stats` as run metrics (`EngineSampler.metrics`); {} for no stats."""
  if not st:
    return {}
  sizes = st["batch_sizes"] or [0]
  figures = dict(
    slots=st["slots"],
    busy_share=st["busy_share"],
    decode_steps=st.get("decode_steps", 0),
    decode_calls=st.get("decode_calls", 0),
    prefill_calls=st.get("prefill_calls", 0),
    batch_min=min(sizes),
    batch_max=max(sizes),
    batch_sizes=len(st["batch_sizes"]),
    preempted=st.get("preempted", 0),
    resumed=st.get("resumed_rows", 0),
    peak_pages=st["peak_pages"],
    pool_pages=st["num_pages"],
    host_wait_s=st["host_wait_per_chunk_s"],
  )
  return {f"rollout/engine/{k}": float(v) for k, v in figures.items()}
