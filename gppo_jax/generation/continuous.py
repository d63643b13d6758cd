"""Continuous batching: a pool of decode slots, refilled as responses finish, over a paged cache.

    engine = ContinuousSampler(graphdef, sampling, EngineConfig(slots=64, page_size=16))
    out = engine(params, prompts, key, group_size=8)   # SampleOutput, rows prompt-major

A fixed batch decodes until its longest row stops, so with long-tailed response lengths most of
its rows idle most of the time, each holding a cache of max_new_tokens slots. Here S decode slots
run in chunks of `chunk` steps (one jitted call each; the host does no per-token work). Between
chunks the host collects the rows that stopped, frees their slots and pages, and prefills the next
pending prompts into the free slots: each prompt once, its G samples sharing its prompt pages
(`paged`). Pages are handed out ahead of each chunk, so memory follows the tokens held.

Batch-invariant samples: the response of sample j of prompt i is drawn with the row key
fold_in(fold_in(key, prompt_ids[i]), j) (`sampler.row_keys`), token s with fold_in(row key, s),
so it depends on (params, prompt, key, i, j) only, not on the slot, the slot count or the prompt
order, and equals what `sampler.sample` draws with the same row keys (up to float rounding).

When the free pages cannot cover the next chunk, the most recently admitted running rows are
preempted: their pages are freed and they are queued again, to be regenerated from the start
(batch invariance makes the regenerated response the same one).

Compiled shapes: the decode chunk once per (sampling, slots, pages, prompt length); the prefill
once per power-of-two count of prompts up to `prefill_rows`. Neither grows with max_new_tokens
or the number of prompts.

On a mesh the slots split into one group per batch shard (data x fsdp): each group has a pool of
pages of its own, on its shard's devices, and the device programs run the groups side by side (a
leading shard axis, vmapped), so a slot only ever reads pages held where it runs. A prompt's G
samples share one group (and its prompt pages). Every process runs the same host bookkeeping on
the same gathered values, so it serves several hosts as `sampler.MeshSampler` does.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gppo_jax.generation import paged
from gppo_jax.generation import sampler as sampler_lib
from gppo_jax.models import model as model_lib
from gppo_jax.models import partitioning, sharding

ENGINES = ("auto", "fixed", "continuous")  # config rollout.engine
# "auto": continuous batching from this many max new tokens on, fixed batches below. At real
# response lengths the engine wins (benchmarks/rollout.py: mean 256, cap 1,024 tokens); on the
# built-in task's few-token answers its host round trips between chunks cost more than the
# idle rows it saves (benchmarks/iteration.py --config.rollout.engine=...; docs/performance.md).
AUTO_MIN_NEW_TOKENS = 256


def engine_for(engine: str, max_new_tokens: int) -> str:
  """ "fixed" or "continuous": what `engine` (ENGINES) means for responses of up to
  max_new_tokens tokens."""
  if engine not in ENGINES:
    raise ValueError(f"rollout.engine={engine!r}; valid: {', '.join(ENGINES)}")
  if engine == "auto":
    return "continuous" if max_new_tokens >= AUTO_MIN_NEW_TOKENS else "fixed"
  return engine


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """slots: responses decoded at once. page_size: cache slots per page. num_pages: the pool's
  pages (page 0 is reserved); None sizes it for every slot holding its prompt's share and a third
  of max_new_tokens (rollouts whose responses run longer on average preempt and regenerate rows,
  counted in `ContinuousSampler.stats`: then raise it). chunk: decode steps per call (a finished
  row idles until its chunk ends). prefill_rows: the most prompts prefilled in one call.
  attention: how decode steps attend over the pages (`paged.ATTENTION`, `paged.resolve_attention`):
  "gather", "pallas" (JAX's TPU kernel) or "auto" (pallas on TPU where it is exact and fits)."""

  slots: int = 64
  page_size: int = 16
  num_pages: int | None = None
  chunk: int = 32
  prefill_rows: int = 8
  attention: str = "auto"

  def __post_init__(self):
    for name in ("slots", "page_size", "chunk", "prefill_rows"):
      if getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.attention not in paged.ATTENTION:
      raise ValueError(
        f"EngineConfig.attention={self.attention!r}; valid: {', '.join(paged.ATTENTION)}"
      )
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(
        f"EngineConfig.num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}"
      )


@flax.struct.dataclass
class SlotState:
  """The decode slots of one shard's group on device (the engine holds R groups stacked on a
  leading axis). length: cache slots filled (where the next fed token goes); start: the first
  real cache slot (after the prompt's left padding; 0 in the pallas layout, `paged`); step:
  response tokens drawn; keys: the row keys' data."""

  pool: paged.PagePool
  last_token: jax.Array  # int32 [S]
  position: jax.Array  # int32 [S]
  length: jax.Array  # int32 [S]
  start: jax.Array  # int32 [S]
  step: jax.Array  # int32 [S]
  limit: jax.Array  # int32 [S]: the row's max new tokens
  done: jax.Array  # bool [S]
  keys: jax.Array  # uint32 [S, ...]: jax.random.key_data of each row's key
  tokens: jax.Array  # int32 [S, N]
  logprobs: jax.Array  # float32 [S, N]
  entropy: jax.Array  # float32 [S, N]
  topk_logprobs: jax.Array | None = None  # float32 [S, N, num_topk]
  topk_ids: jax.Array | None = None  # int32 [S, N, num_topk]
  kept_ids: jax.Array | None = None  # int32 [S, N, kept_width]
  expert_ids: jax.Array | None = None  # int16 [S, N, num_layers, k] (record_experts)


def _pages(n: int, page_size: int) -> int:
  return -(-n // page_size)


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

  @property
  def in_use(self) -> int:
    return sum(t.in_use for t in self.tables)

  @property
  def table(self) -> np.ndarray:
    """int32 [R, slots per group, max_pages]: each group's page ids in its own pool."""
    return np.stack([t.table for t in self.tables])


class ContinuousSampler:
  """Samples G responses for each of a list of prompts with continuous batching (module doc).

  Rows of the output are prompt-major (row i * G + j: sample j of prompt i), right-padded with
  pad_id after the stop token, like `sampler.SampleOutput`. On the default device, or with `mesh`
  on its batch shards (data x fsdp: `slots` must be a multiple of their count), the parameters
  as they come (e.g. the trainer's shardings).
  """

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    sampling: sampler_lib.SamplingParams,
    engine: EngineConfig = EngineConfig(),
    mesh: jax.sharding.Mesh | None = None,
  ):
    self.graphdef = graphdef
    self.sampling = sampling
    self.engine = engine
    self.mesh = mesh
    self.groups = sharding.batch_shards(mesh) if mesh is not None else 1
    if engine.slots % self.groups:
      raise ValueError(
        f"EngineConfig.slots={engine.slots} must be a multiple of the mesh's {self.groups} batch "
        f"shards ({dict(mesh.shape)}): each shard decodes slots / {self.groups} of them"
      )
    self.per_group = engine.slots // self.groups
    # The state's and the host inputs' placement: the leading group axis over the batch shards.
    self._spread = (
      None
      if mesh is None
      else jax.sharding.NamedSharding(mesh, partitioning.batch_spec((self.groups,), mesh))
    )
    self.stats: dict[str, float] = {}
    self.attention: str | None = None  # what EngineConfig.attention resolved to, once called

  def _attention(self, model_cfg) -> str:
    """What EngineConfig.attention runs (`paged.resolve_attention`). On several batch shards the
    kernel runs per shard on its own slot group (`_decode`)."""
    e = self.engine
    impl = paged.resolve_attention(e.attention, model_cfg, e.page_size)
    self.attention = impl
    return impl

  def pool_pages(self, prompt_len: int, group_size: int, attention: str = "gather") -> int:
    """Pages of each group's pool: EngineConfig.num_pages split over the groups, or enough for
    each slot's prompt share and a third of max_new_tokens (with attention "pallas", one more
    page per slot: its copy of its prompt's partial last page), and never fewer than one whole
    row needs."""
    e, n = self.engine, self.sampling.max_new_tokens
    row = _pages(prompt_len + n - 1, e.page_size)
    if e.num_pages is not None:
      pages = 1 + (e.num_pages - 1) // self.groups
      if pages - 1 < row:
        raise ValueError(
          f"EngineConfig.num_pages={e.num_pages} holds fewer than the {row} pages one response "
          f"of prompt {prompt_len} + {n} new tokens needs (plus the reserved page 0)"
          + (f" in each of the {self.groups} shards' pools" if self.groups > 1 else "")
        )
      return pages
    S = self.per_group
    prompts = _pages(S, group_size) * (prompt_len // e.page_size)
    own = _pages(n // 3 + e.chunk, e.page_size) + (attention == "pallas")
    return 1 + max(row, prompts + S * own)

  def _put(self, tree):
    """Host arrays with a leading group axis -> device arrays placed like the state (each
    process passes every group; it feeds those its devices hold)."""
    if self._spread is None:
      return tree
    rows = sharding.process_rows(self.groups, self.mesh)
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(self._spread, np.asarray(x)[rows]), tree
    )

  def _admit_units(self, params, state, units, pages, tokens, mask, key_data, limits, G, ends):
    """Prefills `units` ((prompt, sample ids, slots) each; a unit's slots in one group) in one
    call, each group's padded to the same power of two of prompts (dummy prompts write to the
    trash page and start no slot). ends: each prompt's last cache slot + 1 (P, or its length in
    the pallas layout: then its full pages are shared and each slot gets its own first page,
    which takes the prompt's partial last page)."""
    sp, R, Sg, ps = self.sampling, self.groups, self.per_group, self.engine.page_size
    P = tokens.shape[1]
    by_group = [[u for u in units if pages.group(u[2][0]) == r] for r in range(R)]
    m = 1 << (max(map(len, by_group)) - 1).bit_length()
    p_tok = np.full((R, m, P), sp.pad_id, np.int32)
    p_mask = np.zeros((R, m, P), bool)
    p_mask[..., -1] = True  # dummy prompts: one real token
    p_pages = np.full((R, m, pages.prompt_pages), paged.TRASH_PAGE, np.int32)
    slot_ids = np.full((R, m, G), Sg, np.int32)  # Sg: out of range, dropped
    row_keys = np.zeros((R, m, G, *key_data.shape[1:]), key_data.dtype)
    lim = np.ones((R, m, G), np.int32)
    p_tail = np.full((R, m, G), paged.TRASH_PAGE, np.int32)
    for r, group_units in enumerate(by_group):
      for u, (prompt, samples, slots) in enumerate(group_units):
        p_tok[r, u], p_mask[r, u] = tokens[prompt], mask[prompt]
        end = int(ends[prompt])
        p_pages[r, u, : end // ps] = pages.take_prompt(slots, end // ps)
        if end % ps:
          for j, slot in enumerate(slots):
            pages.grow(slot, end)
            p_tail[r, u, j] = pages.page(slot, end // ps)
        rows = [prompt * G + j for j in samples]
        slot_ids[r, u, : len(slots)] = [s % Sg for s in slots]
        row_keys[r, u, : len(slots)] = key_data[rows]
        lim[r, u, : len(slots)] = limits[rows]
    inputs = self._put((p_tok, p_mask, p_pages, slot_ids, row_keys, lim, p_tail))
    return _admit(self.graphdef, sp, self._spread, self.attention, params, state, *inputs)

  def _init(self, model_cfg, num_pages, key_shape) -> SlotState:
    e, sp = self.engine, self.sampling
    return _init_state(
      model_cfg, self.groups, self.per_group, num_pages, e.page_size, key_shape, sp, self._spread
    )

  def warm_up(self, params: nnx.State, prompt_len: int, group_size: int = 1) -> None:
    """Compiles every program a call with these shapes may run (the decode chunk and the
    prefill of each power-of-two prompt count), on dummy inputs whose writes go to the trash
    page: what a benchmark or a first rollout would otherwise compile as it goes."""
    e, sp, R = self.engine, self.sampling, self.groups
    P = -(-prompt_len // e.page_size) * e.page_size
    cfg = _model_cfg(self.graphdef, params)
    impl = self._attention(cfg)
    num_pages = self.pool_pages(P, group_size, impl)
    max_pages = _pages(P + sp.max_new_tokens - 1, e.page_size)
    params = _in_compute_dtype(params, cfg.compute_dtype)
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    state = self._init(cfg, num_pages, key_shape)
    m = 1
    while True:
      inputs = self._put((
        np.zeros((R, m, P), np.int32), np.ones((R, m, P), bool),
        np.zeros((R, m, P // e.page_size), np.int32),
        np.full((R, m, group_size), self.per_group, np.int32),
        np.zeros((R, m, group_size, *key_shape), np.uint32), np.ones((R, m, group_size), np.int32),
        np.zeros((R, m, group_size), np.int32),
      ))  # fmt: skip
      state = _admit(self.graphdef, sp, self._spread, impl, params, state, *inputs)
      if m >= e.prefill_rows:
        break
      m *= 2
    table, active = self._put(
      (np.zeros((R, self.per_group, max_pages), np.int32), np.zeros((R, self.per_group), bool))
    )
    jax.block_until_ready(
      _decode(self.graphdef, sp, e.chunk, self._spread, impl, params, state, table, active)
    )

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
    """prompts: token-id lists; group_size: samples per prompt; prompt_len: the padded prompt
    length (rounded up to the page size; None: the longest prompt); prompt_ids: each prompt's
    id in the row keys (default 0, 1, ...); row_limits: int32 [num_prompts * G], each row's own
    max_new_tokens (as `sampler.sample`'s)."""
    e, sp = self.engine, self.sampling
    S, ps, N, G, R = e.slots, e.page_size, sp.max_new_tokens, group_size, self.groups
    if G < 1 or G > self.per_group:
      raise ValueError(
        f"group_size={G} must be in [1, slots per shard={self.per_group}] (slots={S} over "
        f"{R} batch shards)"
      )
    longest = max(map(len, prompts))
    P = -(-max(prompt_len or 0, longest) // ps) * ps
    tokens, mask = sampler_lib.left_pad(prompts, pad_id=sp.pad_id, length=P)
    ids = np.arange(len(prompts)) if prompt_ids is None else np.asarray(prompt_ids)
    keys = sampler_lib.row_keys(
      key, np.repeat(ids, G), np.tile(np.arange(G), len(prompts))
    )  # [num_prompts * G], prompt-major
    key_data = np.asarray(jax.random.key_data(keys))
    limits = np.full(len(prompts) * G, N, np.int32)
    if row_limits is not None:
      limits = np.asarray(row_limits, np.int32).reshape(-1)
      if limits.shape != (len(prompts) * G,) or limits.min() < 1 or limits.max() > N:
        raise ValueError(f"row_limits: one limit in [1, {N}] per row ({len(prompts) * G} rows)")
    model_cfg = _model_cfg(self.graphdef, params)
    impl = self._attention(model_cfg)
    num_pages = self.pool_pages(P, G, impl)
    max_pages = _pages(P + N - 1, ps)
    # Each prompt's last cache slot + 1: P (left-padded), or its length in the pallas layout.
    ends = mask.sum(axis=1).astype(np.int64) if impl == "pallas" else np.full(len(prompts), P)
    params = _in_compute_dtype(params, model_cfg.compute_dtype)
    state = self._init(model_cfg, num_pages, key_data.shape[1:])

    out_tokens = np.full((len(prompts) * G, N), sp.pad_id, np.int32)
    out_logprobs = np.zeros((len(prompts) * G, N), np.float32)
    out_entropy = np.zeros((len(prompts) * G, N), np.float32)
    # Per-token records of some settings (SampleOutput's): name -> the rows' buffer.
    routes = (model_cfg.num_layers, model_cfg.num_experts_per_tok) if sp.record_experts else ()
    extras = {
      name: np.full((len(prompts) * G, N, *shape), fill, dtype)
      for name, shape, fill, dtype in (
        ("topk_logprobs", (sp.num_topk,), -np.inf, np.float32),
        ("topk_ids", (sp.num_topk,), sp.pad_id, np.int32),
        ("kept_ids", (sp.kept_width,), -1, np.int32),
        ("expert_ids", routes, -1, sampler_lib.EXPERT_ID_DTYPE),
      )
      if all(shape) and shape
    }
    out_len = np.zeros(len(prompts) * G, np.int32)

    pages = _GroupPages(R, num_pages, S, max_pages, P // ps, ps)
    active = np.zeros(S, bool)  # global slot ids: group * slots per group + local slot
    done = np.ones(S, bool)  # the device's done flags as of the last chunk (no host syncs)
    length = np.zeros(S, np.int32)  # cache slots filled
    slot_end = np.zeros(S, np.int64)  # cache slots a slot may ever fill
    slot_row = np.full(S, -1)  # the output row a slot generates
    slot_order = np.zeros(S, np.int64)  # admission order: the latest are preempted first
    pending = collections.deque((i, list(range(G))) for i in range(len(prompts)))
    counters = collections.Counter()
    peak_pages = 0
    chunk_end = lambda slot: min(int(length[slot]) + e.chunk, int(slot_end[slot]))  # may write
    # A new row's own pages for its first chunk (after its prompt's shared ones).
    first = lambda end: -(-min(end + e.chunk, end + N - 1) // ps) - end // ps
    group_slots = lambda r: range(r * self.per_group, (r + 1) * self.per_group)
    flat = lambda x: np.asarray(x).reshape(S, *np.shape(x)[2:])  # [R, S/R, ...] -> [S, ...]

    def release(slot: int) -> None:
      pages.release(slot)
      active[slot], slot_row[slot] = False, -1

    while pending or active.any():
      # 1. Admit pending prompts into free slots, each prompt prefilled once for its rows in one
      # group, keeping the pages the running rows' next chunk needs (admitting into them would
      # only preempt them). Each prompt goes to the group with the most free slots.
      free_slots = [[s for s in group_slots(r) if not active[s]] for r in range(R)]
      budget = [
        pages.free(r)
        - sum(pages.wanted(s, chunk_end(s)) for s in group_slots(r) if active[s] and not done[s])
        for r in range(R)
      ]
      units, admitted = [], [0] * R
      while pending:
        prompt, samples = pending[0]
        end = int(ends[prompt])
        need = end // ps + len(samples) * first(end)
        fits = [
          r for r in range(R)
          if len(samples) <= len(free_slots[r]) and need <= budget[r]
          and admitted[r] < e.prefill_rows
        ]  # fmt: skip
        if not fits:
          break
        r = max(fits, key=lambda r: (len(free_slots[r]), -r))
        pending.popleft()
        budget[r] -= need
        admitted[r] += 1
        units.append((prompt, samples, [int(free_slots[r].pop(0)) for _ in samples]))
      if units:
        state = self._admit_units(
          params, state, units, pages, tokens, mask, key_data, limits, G, ends
        )
        for prompt, samples, slots in units:
          for sample, slot in zip(samples, slots, strict=True):
            active[slot], done[slot], length[slot] = True, False, ends[prompt]
            slot_end[slot] = ends[prompt] + N - 1
            slot_row[slot], slot_order[slot] = prompt * G + sample, counters["admitted"]
            counters["admitted"] += 1
        counters["prefill_calls"] += 1
        counters["prefilled_prompts"] += len(units)

      # 2. Pages for the next chunk; in each group, preempt its latest-admitted rows when its
      # pool runs short (they are regenerated from the start: the same response, by batch
      # invariance).
      for r in range(R):
        running = [s for s in group_slots(r) if active[s] and not done[s]]
        while sum(pages.wanted(s, chunk_end(s)) for s in running) > pages.free(r):
          victim = max(running, key=lambda s: slot_order[s])
          row = int(slot_row[victim])
          pending.appendleft((row // G, [row % G]))
          release(victim)
          running.remove(victim)
          counters["preempted"] += 1
        for s in running:
          pages.grow(s, chunk_end(s))
      peak_pages = max(peak_pages, pages.in_use)

      # 3. Decode a chunk, then collect the rows that stopped.
      table, live = self._put((pages.table, active.reshape(R, -1)))
      state, steps = _decode(
        self.graphdef, sp, e.chunk, self._spread, impl, params, state, table, live
      )
      done, filled, steps = sharding.to_host((state.done, state.length, steps))
      done, length[:] = flat(done).copy(), flat(filled)
      counters["decode_calls"] += 1
      counters["decode_steps"] += int(np.max(steps))
      finished = np.flatnonzero(active & done)
      if finished.size:
        # Whole [S, N] buffers: a gather of the finished rows would compile per count.
        toks, lps, ents, steps, ext = jax.tree.map(flat, sharding.to_host(
          (state.tokens, state.logprobs, state.entropy, state.step,
           {k: getattr(state, k) for k in extras})
        ))  # fmt: skip
        rows = slot_row[finished]
        out_tokens[rows], out_logprobs[rows] = toks[finished], lps[finished]
        out_entropy[rows], out_len[rows] = ents[finished], steps[finished]
        for k, buf in extras.items():
          buf[rows] = ext[k][finished]
        for s in finished:
          release(int(s))

    counters.pop("admitted", None)
    self.stats = dict(
      counters,
      num_pages=num_pages * R,
      peak_pages=peak_pages,
      pool_bytes=R * paged.pool_bytes(model_cfg, num_pages, ps),
      prompt_len=P,
    )
    out_mask = np.arange(N)[None] < out_len[:, None]
    return sampler_lib.SampleOutput(
      tokens=out_tokens,
      logprobs=np.where(out_mask, out_logprobs, 0.0).astype(np.float32),
      mask=out_mask,
      lengths=out_len,
      entropy=np.where(out_mask, out_entropy, 0.0).astype(np.float32),
      **extras,
    )


def _model_cfg(graphdef: nnx.GraphDef, params: nnx.State):
  return nnx.merge(graphdef, params).cfg


@functools.partial(jax.jit, static_argnums=1)
def _in_compute_dtype(params: nnx.State, dtype) -> nnx.State:
  """The floating parameters cast to the compute dtype once per call: each decode step then
  reads 16-bit weights instead of casting float32 ones again (every use casts them to this
  dtype anyway, so the results are the same)."""
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, params)


def _spread_over(spread, tree):
  """tree with its leading (group) axis placed by `spread` (None: left to XLA)."""
  return tree if spread is None else jax.lax.with_sharding_constraint(tree, spread)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _init_state(cfg, R, S, num_pages, page_size, key_shape, sp, spread) -> SlotState:
  """R groups' empty states, S slots and a pool of num_pages pages each, stacked."""
  zi = jnp.zeros((S,), jnp.int32)
  N, K, W, pad_id = sp.max_new_tokens, sp.num_topk, sp.kept_width, sp.pad_id
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
    tokens=jnp.full((S, N), pad_id, jnp.int32),
    logprobs=jnp.zeros((S, N), jnp.float32),
    entropy=jnp.zeros((S, N), jnp.float32),
    topk_logprobs=jnp.full((S, N, K), -jnp.inf, jnp.float32) if K else None,
    topk_ids=jnp.full((S, N, K), pad_id, jnp.int32) if K else None,
    kept_ids=jnp.full((S, N, W), -1, jnp.int32) if W else None,
    expert_ids=(
      jnp.full((S, N, cfg.num_layers, cfg.num_experts_per_tok), -1, sampler_lib.EXPERT_ID_DTYPE)
      if sp.record_experts
      else None
    ),
  )
  return _spread_over(spread, jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *x.shape)), one))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
def _admit(graphdef, sp, spread, impl, params, state, *inputs) -> SlotState:
  """`_admit_group` in every group at once (inputs with a leading group axis)."""
  admit = lambda state, *inputs: _admit_group(graphdef, sp, impl, params, state, *inputs)
  with model_lib.experts_under_vmap():
    return _spread_over(spread, jax.vmap(admit)(state, *inputs))


def _admit_group(
  graphdef, sp, impl, params, state, p_tok, p_mask, p_pages, slot_ids, row_keys, limits, p_tail
) -> SlotState:
  """Prefills m prompts into one group's pages and starts their rows (slot_ids [m, G],
  out-of-range ids dropped): the first token of each row drawn from the prompt's last logits.
  impl "pallas": the pallas layout (`paged`), each row's first own page in p_tail [m, G]."""
  model = nnx.merge(graphdef, params)
  m, P = p_tok.shape
  G = slot_ids.shape[1]
  N = sp.max_new_tokens
  positions = model_lib.positions_from_mask(p_mask)
  cache = model_lib.init_cache(model.cfg, m, P)
  out = model(
    p_tok, positions, attn_mask=p_mask, cache=cache, cache_index=jnp.int32(0),
    with_routing=sp.record_experts,
  )  # fmt: skip
  hidden, cache = out[:2]
  # The experts of each row's last prompt token: what drew its first response token.
  route = jnp.repeat(out[2].expert_ids[:, -1], G, axis=0) if sp.record_experts else None
  logits = jnp.repeat(model.logits(hidden[:, -1]).astype(jnp.float32), G, axis=0)  # [m G, V]
  pad = P - jnp.sum(p_mask, axis=1, dtype=jnp.int32)  # [m]
  if impl == "pallas":  # each prompt moved to slot 0
    pool = paged.write_prefill(state.pool, cache, p_pages, shift=pad, tail=p_tail)
    start, length = jnp.zeros_like(pad), P - pad
  else:
    pool = paged.write_prefill(state.pool, cache, p_pages)
    start, length = pad, jnp.full_like(pad, P)
  key_data = row_keys.reshape(m * G, *row_keys.shape[2:])
  keys = jax.random.wrap_key_data(key_data)
  token, logprob, topk, kept, entropy = sampler_lib._sample_token(
    logits, sampler_lib.step_keys(keys, 0), sp
  )
  slots = slot_ids.reshape(-1)
  rep = lambda x: jnp.repeat(x, G, axis=0)
  stop = jnp.isin(token, jnp.asarray(sp.stop_ids, jnp.int32)) if sp.stop_ids else False
  first = lambda x, fill: jnp.full((m * G, N, *x.shape[1:]), fill, x.dtype).at[:, 0].set(x)
  put = lambda buf, val: buf.at[slots].set(val.astype(buf.dtype), mode="drop")
  return state.replace(
    pool=pool,
    last_token=put(state.last_token, token),
    position=put(state.position, rep(positions[:, -1] + 1)),
    length=put(state.length, rep(length)),
    start=put(state.start, rep(start)),
    step=put(state.step, jnp.ones((m * G,), jnp.int32)),
    limit=put(state.limit, limits.reshape(-1)),
    done=put(state.done, stop | (limits.reshape(-1) <= 1)),
    keys=put(state.keys, key_data),
    tokens=put(state.tokens, first(token, sp.pad_id)),
    logprobs=put(state.logprobs, first(logprob, 0.0)),
    entropy=put(state.entropy, first(entropy, 0.0)),
    **_records(state, topk, kept, lambda buf, val, fill: put(buf, first(val, fill)), sp, route),
  )


def _records(state: SlotState, topk, kept, write, sp, route=None) -> dict:
  """The top-K, kept-set and experts buffers with a step's values written by
  `write(buf, val, fill)` (none where the setting records none)."""
  out = {}
  if route is not None:
    out["expert_ids"] = write(state.expert_ids, route, -1)
  if topk is not None:
    out["topk_logprobs"] = write(state.topk_logprobs, topk[0], -jnp.inf)
    out["topk_ids"] = write(state.topk_ids, topk[1], sp.pad_id)
  if kept is not None:
    out["kept_ids"] = write(state.kept_ids, kept, -1)
  return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,))
def _decode(graphdef, sp, chunk, spread, impl, params, state, page_table, active):
  """`_decode_group` in every group at once (a leading group axis): (state, steps [R])."""
  decode = lambda state, table, active: _decode_group(
    graphdef, sp, chunk, impl, params, state, table, active
  )
  with model_lib.experts_under_vmap():
    if impl == "pallas":
      R = state.done.shape[0]
      if R == 1:  # one group: called on it directly
        out = decode(*jax.tree.map(lambda x: x[0], (state, page_table, active)))
        return _spread_over(spread, jax.tree.map(lambda x: x[None], out))
      # Several groups over the batch shards: the kernel runs per shard (`paged.pallas_attention`).
      axes = _group_axes(spread)
      decode = lambda state, table, active: _decode_group(
        graphdef, sp, chunk, impl, params, state, table, active, shards=(spread.mesh, axes)
      )
      out = jax.vmap(decode, spmd_axis_name=axes)(state, page_table, active)
      return _spread_over(spread, out)
    return _spread_over(spread, jax.vmap(decode)(state, page_table, active))


def _group_axes(spread: jax.sharding.NamedSharding | None) -> tuple[str, ...]:
  """The mesh axes the group axis is split over (`batch_spec` of R groups: their product is R)."""
  first = None if spread is None or not len(spread.spec) else spread.spec[0]
  if first is None:
    raise ValueError("several slot groups, but their axis is not split over the mesh")
  return (first,) if isinstance(first, str) else tuple(first)


def _decode_group(graphdef, sp, chunk, impl, params, state, page_table, active, shards=None):
  """Up to `chunk` decode steps of every live slot of one group (active and not done); also
  returns the steps taken. shards: `paged.decode_step`'s."""
  S, N = state.tokens.shape
  rows = jnp.arange(S)
  stop_ids = jnp.asarray(sp.stop_ids, jnp.int32)

  def body(carry):
    i, s = carry
    live = active & ~s.done
    out = paged.decode_step(
      graphdef, params, s.pool, s.last_token, s.position, page_table, s.start, s.length, live,
      with_routing=sp.record_experts, attention_impl=impl, shards=shards,
    )  # fmt: skip
    logits, pool = out[:2]
    route = out[2] if sp.record_experts else None
    keys = sampler_lib.step_keys(jax.random.wrap_key_data(s.keys), s.step)
    token, logprob, topk, kept, entropy = sampler_lib._sample_token(logits, keys, sp)
    col = jnp.minimum(s.step, N - 1)

    def put(buf, val):
      keep = live.reshape(-1, *([1] * (val.ndim - 1)))
      return buf.at[rows, col].set(jnp.where(keep, val.astype(buf.dtype), buf[rows, col]))

    step = s.step + live
    stopped = jnp.isin(token, stop_ids) if sp.stop_ids else False
    return i + 1, s.replace(
      pool=pool,
      last_token=jnp.where(live, token, s.last_token),
      position=s.position + live,
      length=s.length + live,
      step=step,
      done=s.done | (live & (stopped | (step >= s.limit))),
      tokens=put(s.tokens, token),
      logprobs=put(s.logprobs, logprob),
      entropy=put(s.entropy, entropy),
      **_records(s, topk, kept, lambda buf, val, fill: put(buf, val), sp, route),
    )

  cond = lambda carry: (carry[0] < chunk) & jnp.any(active & ~carry[1].done)
  steps, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
  return state, steps


def kv_bytes_fixed(cfg, rows: int, prompt_len: int, max_new_tokens: int) -> int:
  """The KV cache bytes the fixed-batch sampler holds for `rows` rows (`model.init_cache` of
  prompt + max_new_tokens slots)."""
  return rows * (prompt_len + max_new_tokens) * paged.kv_bytes_per_token(cfg)


class EngineSampler:
  """`sampler.MeshSampler`'s call, served by continuous batching: what the trainer's rollouts
  and evaluations call with `rollout.engine="continuous"`.

  Takes the same left-padded rows (runs of `group_size` identical prompts); prompt b / G of the
  call gets id b / G in the row keys. One engine (one compiled set) per sampling setting. With
  `mesh`, on its batch shards (`ContinuousSampler`).
  """

  def __init__(self, graphdef: nnx.GraphDef, engine: EngineConfig,
               mesh: jax.sharding.Mesh | None = None):  # fmt: skip
    self.graphdef = graphdef
    self.engine = engine
    self.mesh = mesh
    self.batch_multiple = 1
    self._engines: dict[sampler_lib.SamplingParams, ContinuousSampler] = {}
    self.stats: dict[str, float] = {}

  def __call__(
    self,
    params,
    prompt_tokens: np.ndarray,
    prompt_mask: np.ndarray,
    rng: jax.Array,
    sampling: sampler_lib.SamplingParams,
    *,
    group_size: int | None = None,
  ) -> sampler_lib.SampleOutput:
    tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask, bool)
    if group_size is None:
      group_size = sampler_lib.detect_group_size(tokens, mask)
    if sampling not in self._engines:
      self._engines[sampling] = ContinuousSampler(self.graphdef, sampling, self.engine, self.mesh)
    engine = self._engines[sampling]
    G = math.gcd(group_size, engine.per_group)
    prompts = [row[m].tolist() for row, m in zip(tokens[::G], mask[::G], strict=True)]
    out = engine(params, prompts, rng, group_size=G, prompt_len=tokens.shape[1])
    self.stats = engine.stats
    return out
