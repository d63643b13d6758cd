"""A paged KV cache: fixed-size pages from one pool, a page table per decode slot.

The pool holds every layer's keys and values as `num_pages` pages of `page_size` cache slots.
A decode slot (one response being generated) sees a logical cache of slots 0, 1, 2, ...; its
logical slot j lives in page `page_table[slot, j // page_size]` at offset j % page_size. A
prompt's pages are written once by its prefill and shared, read-only, by the page tables of all
the samples drawn from it; each sample's response tokens go to pages of its own. So memory
follows the tokens held, not rows x max_new_tokens.

Page 0 is never handed out: slots with nothing to write (empty or finished) write there, and page
table entries past a row's pages point there, so every gather and scatter stays in bounds.

Attention over a slot's pages has two implementations (`ATTENTION`, `resolve_attention`):

- gather (`paged_attention`): walks the pages up to the longest row's last one, gathering page i
  of every slot at once, with an online softmax (a traced trip count, so the cost follows the
  filled length and one compiled step serves every length). Any layout of a row's keys: they
  may start at any slot (`start`, after a prompt's left padding) and a sliding window skips
  the pages before it.
- pallas (`pallas_attention`): JAX's TPU paged-attention kernel
  (`jax.experimental.pallas.ops.tpu.paged_attention`), which attends to slots [0, length) of
  each row's pages. So a row's keys must start at slot 0: with it the engine stores each prompt
  shifted left by its padding (`write_prefill` with `shift`), its full pages shared by its
  samples and its last, partial page copied into each sample's own first page (`tail`), where
  the sample's response continues. The kernel has no window: sliding-window layers run gather
  on the same shifted pages. It rounds keys and values to bfloat16 before its products, so it
  is exact only for a bfloat16 pool.

The pool stores each layer's pages in the kernel's layout, KV heads first ([K, L, num_pages,
page_size, Dh]): the kernel reads a layer's pages as [K, L * num_pages, page_size, Dh] (a
reshape, no copy) with its page ids offset by layer * num_pages, so no step transposes or
slices the pool.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gppo_jax.models import attention, heads
from gppo_jax.models import model as model_lib
from gppo_jax.models import moe as moe_lib
from gppo_jax.models.architectures import ModelConfig

TRASH_PAGE = 0
_NEG = -1e30  # finite: a page with no allowed slot must not make the running max -inf
ATTENTION = ("auto", "gather", "pallas")  # EngineConfig.attention = rollout.paged_attention
# The kernel's compute block: pages of this many cache slots in all (at least one page). Each
# row's page-table is padded with trash pages to a whole number of blocks; blocks past a row's
# length are skipped.
PALLAS_BLOCK_SLOTS = 512


@flax.struct.dataclass
class PagePool:
  k: jax.Array  # [num_kv_heads, num_layers, num_pages, page_size, head_dim]
  v: jax.Array  # same

  @property
  def page_size(self) -> int:
    return self.k.shape[3]

  @property
  def num_pages(self) -> int:
    return self.k.shape[2]

  @property
  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int) -> PagePool:
  """An empty pool (zeros) in the model's compute dtype."""
  shape = (cfg.num_kv_heads, cfg.num_layers, num_pages, page_size, cfg.head_dim)
  zeros = jnp.zeros(shape, cfg.compute_dtype)
  return PagePool(k=zeros, v=zeros)


def pool_bytes(cfg: ModelConfig, num_pages: int, page_size: int) -> int:
  """The bytes `init_pool` allocates."""
  return num_pages * page_size * kv_bytes_per_token(cfg)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
  """Cache bytes one token holds: its keys and values in every layer, in the compute dtype."""
  return (
    2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
  )


def write_prefill(
  pool: PagePool,
  cache: model_lib.KVCache,
  pages: jax.Array,
  shift: jax.Array | None = None,
  tail: jax.Array | None = None,
) -> PagePool:
  """The pool with a prefill's dense cache (k/v [L, M, P, K, Dh], P a multiple of the page size)
  written to `pages` int32 [M, P // page_size] (each prompt's pages in order).

  With shift int32 [M] (each prompt's left padding), each prompt's cache first moves left by
  its shift, so that its first real token lands in slot 0 (the pallas layout); then its page
  n // page_size (n = P - shift: the partial page holding the prompt's last n % page_size
  slots) also goes to each of tail int32 [M, G] (each sample's own first page; the trash page
  where there is none). Pages of `pages` past a prompt's real ones are to be the trash page."""
  L, M, P, K, Dh = cache.k.shape
  ps = pool.page_size
  if P % ps:
    raise ValueError(f"the prefill's {P} slots are not a multiple of the page size {ps}")

  def pages_of(x):  # [L, M, P, K, Dh] -> [K, L, M, P // ps, ps, Dh]
    if shift is not None:
      slots = (jnp.arange(P)[None] + shift[:, None]) % P  # [M, P]: slot j reads j + shift
      x = jnp.take_along_axis(x, slots[None, :, :, None, None], axis=2)
    return jnp.transpose(x.reshape(L, M, P // ps, ps, K, Dh), (4, 0, 1, 2, 3, 5))

  def write(buf, x):
    x = pages_of(x).astype(buf.dtype)
    buf = buf.at[:, :, pages.reshape(-1)].set(x.reshape(K, L, M * (P // ps), ps, Dh))
    if tail is None:
      return buf
    G = tail.shape[1]
    partial = jnp.minimum((P - shift) // ps, P // ps - 1)  # [M]: a whole prompt: no tail
    last = x[:, :, jnp.arange(M), partial]  # [K, L, M, ps, Dh]
    return buf.at[:, :, tail.reshape(-1)].set(jnp.repeat(last, G, axis=2))

  return PagePool(k=write(pool.k, cache.k), v=write(pool.v, cache.v))


def paged_attention(
  q: jax.Array,
  pool_k: jax.Array,
  pool_v: jax.Array,
  layer: jax.Array | int,
  page_table: jax.Array,
  start: jax.Array,
  query_slot: jax.Array,
  *,
  scale: float | None = None,
  softcap: float | None = None,
  window: jax.Array | int | None = None,
  block_pages: int = 1,
) -> jax.Array:
  """One query per decode slot over its own pages.

  q [S, 1, H, Dh]; pool_k / pool_v [K, L, num_pages, page_size, Dh] (the new keys already
  written); page_table int32 [S, max_pages]; start int32 [S]: the slot's first real cache slot
  (prompts are left-padded); query_slot int32 [S]: where the query's own key was written. The
  query attends to the cache slots start <= j <= query_slot, as the dense cache does for a
  left-padded row. -> [S, 1, H, Dh]. scale, softcap and window (an int, a traced int32 or
  None): `attention.Scores`; with a window, the query also needs j > query_slot - window, and
  each row reads its pages from the one holding its window's first slot: a local layer reads
  about window / page_size pages per row, however long the row. block_pages: pages each row
  reads per loop step (`gather_block_pages`): a loop step has a fixed cost (on CPU, most of a
  small page's), so larger blocks take fewer steps; pages past a row's last are masked out, so a
  row's result does not depend on the other rows' lengths.
  """
  S, _, H, Dh = q.shape
  K, ps = pool_k.shape[0], pool_k.shape[3]
  G = H // K
  qh = q.reshape(S, K, G, Dh).astype(jnp.float32) * (scale or Dh**-0.5)
  rows = jnp.arange(S)
  start = start if window is None else jnp.maximum(start, query_slot - window + 1)
  first = start // ps  # [S]: each row's first page
  bp = max(1, min(block_pages, page_table.shape[1]))
  n_blocks = -(-(jnp.max(query_slot // ps - first) + 1) // bp)
  last_page = page_table.shape[1] - 1

  def body(i, carry):
    m, l, acc = carry
    index = first[:, None] + i * bp + jnp.arange(bp)[None]  # [S, bp]: past a row's last: masked
    page = page_table[rows[:, None], jnp.minimum(index, last_page)]  # [S, bp]
    # [K, S, bp, ps, Dh] -> [S, K, bp * ps, Dh]: the row axis leading, as the products batch it
    rows_first = lambda x: jnp.swapaxes(x, 0, 1).astype(jnp.float32).reshape(S, K, bp * ps, Dh)
    kb, vb = rows_first(pool_k[:, layer, page]), rows_first(pool_v[:, layer, page])
    s = attention.soft_cap(jnp.einsum("skgd,skpd->skgp", qh, kb), softcap)
    slot = (index[..., None] * ps + jnp.arange(ps)).reshape(S, bp * ps)
    ok = (slot >= start[:, None]) & (slot <= query_slot[:, None])  # [S, bp * ps]
    s = jnp.where(ok[:, None, None, :], s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(ok[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum("skgp,skpd->skgd", p, vb)
    return m_new, l, acc

  init = (
    jnp.full((S, K, G), _NEG, jnp.float32),
    jnp.zeros((S, K, G), jnp.float32),
    jnp.zeros((S, K, G, Dh), jnp.float32),
  )
  _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  out = acc / jnp.maximum(l, 1e-30)[..., None]  # every live query sees its own slot: l > 0
  return out.reshape(S, 1, H, Dh).astype(q.dtype)


def pallas_attention(
  q: jax.Array,
  pool_k: jax.Array,
  pool_v: jax.Array,
  layer: jax.Array | int,
  page_table: jax.Array,
  query_slot: jax.Array,
  live: jax.Array | None = None,
  *,
  scale: float | None = None,
  softcap: float | None = None,
  shards: tuple[jax.sharding.Mesh, tuple[str, ...]] | None = None,
) -> jax.Array:
  """`paged_attention` with start 0 and no window, by JAX's TPU paged-attention kernel: each
  query attends to the cache slots 0 <= j <= query_slot of its pages. Rows not `live` (bool [S])
  read nothing and give zeros. The kernel does not scale q: q is scaled here, in float32 as the
  gather path does, and handed over in float32; it reads keys and values as bfloat16.

  shards (mesh, axes): called under a vmap over slot groups whose `spmd_axis_name` is `axes`
  (the continuous engine on several batch shards). The kernel then runs in a `jax.shard_map`
  manual over those axes, so that each shard calls it on its own group's queries and pages: a
  Pallas call is a custom call that XLA cannot split over a sharded batch axis itself."""
  from jax.experimental.pallas.ops.tpu import paged_attention as kernel  # noqa: PLC0415

  S, _, H, Dh = q.shape
  K, L, N, ps, _ = pool_k.shape
  block = max(1, min(PALLAS_BLOCK_SLOTS // ps, page_table.shape[1]))
  pad = -page_table.shape[1] % block
  # The layer's pages within the pool seen as [K, L * N, ps, Dh]; padding entries: its trash page.
  pages = jnp.pad(page_table, ((0, 0), (0, pad))) + layer * N
  lengths = query_slot + 1
  if live is not None:
    lengths = jnp.where(live, lengths, 0)
  qs = q[:, 0].astype(jnp.float32) * (scale or Dh**-0.5)
  call = functools.partial(
    kernel.paged_attention, attn_logits_soft_cap=softcap, pages_per_compute_block=block
  )
  if shards is not None:
    mesh, axes = shards
    # vmap's batching of shard_map splits the group axis over `axes` (its spmd_axis_name);
    # inside, each shard holds one group. Other mesh axes stay automatic.
    spec = jax.sharding.PartitionSpec()
    call = jax.shard_map(
      call, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=frozenset(axes),
      check_vma=False,
    )  # fmt: skip
  out = call(
    qs, pool_k.reshape(K, L * N, ps, Dh), pool_v.reshape(K, L * N, ps, Dh),
    lengths.astype(jnp.int32), pages.astype(jnp.int32),
  )  # fmt: skip
  return out[:, None].astype(q.dtype)


def _interpreting() -> bool:
  """Whether Pallas TPU kernels run interpreted here (`pltpu.force_tpu_interpret_mode`)."""
  flag = getattr(jax.config, "pallas_tpu_interpret_mode_context_manager", None)
  if flag is None:
    from jax._src import config as jax_config  # noqa: PLC0415

    flag = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
  return flag is not None and flag.value is not None


def resolve_attention(
  impl: str, cfg: ModelConfig, page_size: int, backend: str | None = None
) -> str:
  """ "gather" or "pallas": what `impl` (ATTENTION) runs for cfg's model on `backend` (default:
  jax's). "auto" is pallas on TPU where the kernel is exact and its tiles fit: a bfloat16
  pool, head_dim a multiple of 128 and page_size of 16 (the TPU's bfloat16 tile), some layer
  without a sliding window; gather elsewhere. "pallas" raises where the kernel would not be
  exact or has nothing to do."""
  if impl not in ATTENTION:
    raise ValueError(f"paged attention {impl!r}; valid: {', '.join(ATTENTION)}")
  if impl == "gather":
    return impl
  problems = []
  if jnp.dtype(cfg.compute_dtype) != jnp.dtype(jnp.bfloat16):
    problems.append(
      f"the kernel rounds keys and values to bfloat16, and this model's cache is "
      f"{jnp.dtype(cfg.compute_dtype).name} (model.dtype)"
    )
  if cfg.windowed and all(l in cfg.local_layers for l in range(cfg.num_layers)):
    problems.append("every layer has a sliding window, which the kernel cannot take")
  backend = backend or jax.default_backend()
  if backend != "tpu" and not _interpreting():
    problems.append(f"the kernel needs a TPU (backend: {backend})")
  if impl == "pallas":
    if problems:
      raise ValueError(f"paged attention 'pallas': {'; '.join(problems)}; use 'gather' or 'auto'")
    return impl
  fits = cfg.head_dim % 128 == 0 and page_size % 16 == 0
  return "pallas" if backend == "tpu" and fits and not problems else "gather"


# Cache slots the gather path reads per row and loop step (`paged_attention`'s block_pages):
# larger blocks take fewer steps, but past a few dozen slots per row the block no longer stays
# in the CPU's caches (benchmarks/rollout.py).
GATHER_BLOCK_SLOTS = 64


def gather_block_pages(page_size: int) -> int:
  """Pages per loop step of the gather path: GATHER_BLOCK_SLOTS slots' worth, at least one."""
  return max(1, GATHER_BLOCK_SLOTS // page_size)


@flax.struct.dataclass
class DecodeWeights:
  """The policy's weights as `decode_step` reads them, made once per rollout (`decode_weights`),
  in the compute dtype. layers: the decoder layers' weights stacked [num_layers, ...] (scanned
  over), or a tuple of one dict per layer (unrolled: on CPU a scan's slice of the stacked
  weights is a copy at every step). head: the output projection as [vocab, hidden]."""

  embed: jax.Array
  layers: dict[str, jax.Array] | tuple[dict[str, jax.Array], ...]
  final_norm: jax.Array
  head: jax.Array


def decode_weights(graphdef: nnx.GraphDef, params: nnx.State, unroll: bool) -> DecodeWeights:
  """The `DecodeWeights` of a policy (call it inside a jit, once per rollout). Every floating
  weight is cast to the compute dtype here, which each use would do anyway."""
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  cast = lambda x: x.astype(cfg.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  head, tied = model.unembedding()
  stacked = jax.tree.map(cast, model.layers.arrays())
  layers = (
    tuple({k: a[l] for k, a in stacked.items()} for l in range(cfg.num_layers))
    if unroll
    else stacked
  )
  return DecodeWeights(
    embed=cast(model.embed[...]),
    layers=layers,
    final_norm=cast(model.final_norm[...]),
    head=cast(head if tied else head.T),
  )


def decode_step(
  cfg: ModelConfig,
  weights: DecodeWeights,
  pool: PagePool,
  tokens: jax.Array,
  positions: jax.Array,
  page_table: jax.Array,
  start: jax.Array,
  length: jax.Array,
  live: jax.Array,
  with_routing: bool = False,
  attention_impl: str = "gather",
  shards: tuple[jax.sharding.Mesh, tuple[str, ...]] | None = None,
  under_vmap: bool = False,
) -> tuple[jax.Array, PagePool, jax.Array | None]:
  """One token per decode slot through the model over the paged cache.

  tokens, positions int32 [S]: the token each slot feeds and its position; length int32 [S]: the
  cache slot it is written to (the slot's filled length); live bool [S]: slots that step (the
  others write to the trash page and their logits are to be ignored). Returns (float32 logits
  [S, vocab], the pool with the new keys and values, and with with_routing (models with
  experts) the experts each slot's token chose, int32 [S, num_layers, k], else None). The layers
  run unrolled when weights.layers is a tuple (`DecodeWeights`), else in a scan. under_vmap:
  traced inside `jax.vmap` (`model.Transformer.__call__`).
  """
  ps = pool.page_size
  rows = jnp.arange(tokens.shape[0])
  write_page = jnp.where(live, page_table[rows, length // ps], TRASH_PAGE)
  write_off = jnp.where(live, length % ps, 0)
  x = model_lib.embed_tokens(cfg, weights.embed, tokens[:, None])
  rope = model_lib.rope_tables(positions[:, None], cfg)
  scores = model_lib.scores_of(cfg)
  block = gather_block_pages(ps)

  def layer_step(x, pk, pv, p, l, local, moe):
    """One decoder layer: its keys and values written at each live slot's cache slot."""

    def attend(q, k, v, local):
      nonlocal pk, pv
      new = lambda x: jnp.swapaxes(x[:, 0], 0, 1).astype(pk.dtype)  # [S, 1, K, Dh] -> [K, S, Dh]
      pk = pk.at[:, l, write_page, write_off].set(new(k))
      pv = pv.at[:, l, write_page, write_off].set(new(v))
      gather = lambda window: paged_attention(
        q, pk, pv, l, page_table, start, length, scale=scores.scale, softcap=scores.softcap,
        window=window, block_pages=block,
      )  # fmt: skip
      if attention_impl != "pallas":
        return gather(attention.layer_window(scores.window, local))
      kernel = lambda: pallas_attention(
        q, pk, pv, l, page_table, length, live, scale=scores.scale, softcap=scores.softcap,
        shards=shards,
      )  # fmt: skip
      if scores.window is None or local is False:
        return kernel()
      if local is None or local is True:
        return gather(scores.window)
      # A traced flag (the layer scan): a local layer runs gather with the window.
      return jax.lax.cond(local, lambda: gather(scores.window), kernel)

    x, route = model_lib.routed_decoder_layer(
      cfg, p, x, rope, attend, local, moe=moe, under_vmap=under_vmap
    )
    return x, pk, pv, (route.expert_ids[:, 0] if with_routing else None)

  if isinstance(weights.layers, tuple):  # unrolled: each layer's kind known statically
    pk, pv, routes = pool.k, pool.v, []
    for l, p in enumerate(weights.layers):
      local = (l in cfg.local_layers) if cfg.windowed else None
      x, pk, pv, route = layer_step(x, pk, pv, p, l, local, cfg.layer_is_moe(l))
      routes.append(route)
    routes = jnp.stack(routes, axis=1) if with_routing else None
  else:
    flags, kinds = model_lib.local_flags(cfg), moe_lib.moe_flags(cfg)

    def scanned(carry, xs):
      x, pk, pv = carry
      p, l = xs
      local = None if flags is None else flags[l]
      moe = None if kinds is None else kinds[l]
      x, pk, pv, route = layer_step(x, pk, pv, p, l, local, moe)
      return (x, pk, pv), route

    xs = (weights.layers, jnp.arange(cfg.num_layers))
    (x, pk, pv), routes = jax.lax.scan(scanned, (x, pool.k, pool.v), xs)
    routes = jnp.moveaxis(routes, 0, 1) if with_routing else None
  hidden = model_lib.norm(cfg, x[:, 0], weights.final_norm)
  logits = model_lib.final_softcap(cfg, heads.head_logits(hidden, weights.head, tied=True))
  return logits, PagePool(k=pk, v=pv), routes


class PageTable:
  """The host's bookkeeping of a pool: each slot's page table and the free pages.

  A prompt's pages are taken once (`take_prompt`: `prompt_pages` of them, or as many as it is
  given) and shared by the slots of its samples; they return to the free stack when the last of
  those slots is released. A slot's pages after its prompt's are its own (`grow`), returned by
  `release`.
  """

  def __init__(self, num_pages: int, slots: int, max_pages: int, prompt_pages: int, page_size: int):
    self.page_size = page_size
    self.free = list(range(num_pages - 1, TRASH_PAGE, -1))  # a stack
    self.table = np.full((slots, max_pages), TRASH_PAGE, np.int32)
    self.prompt_pages = prompt_pages
    self.num_pages = num_pages
    self._share = np.full(slots, -1)  # which prompt's pages the slot reads
    self._shared_count = np.zeros(slots, np.int64)  # how many: its own pages follow them
    self._shared: dict[int, list[int]] = {}
    self._users: collections.Counter[int] = collections.Counter()
    self._next = 0

  @property
  def in_use(self) -> int:
    return self.num_pages - 1 - len(self.free)

  def take_prompt(self, slots: Sequence[int], count: int | None = None) -> list[int]:
    """`count` pages (default prompt_pages) for one prompt, read by every slot of `slots` (whose
    tables start afresh)."""
    count = self.prompt_pages if count is None else count
    pages = [self.free.pop() for _ in range(count)]
    share, self._next = self._next, self._next + 1
    self._shared[share] = pages
    for s in slots:
      self.table[s] = TRASH_PAGE
      self.table[s, :count] = pages
      self._share[s] = share
      self._shared_count[s] = count
      self._users[share] += 1
    return pages

  def own_pages(self, slot: int) -> int:
    return int(np.count_nonzero(self.table[slot, self._shared_count[slot] :] != TRASH_PAGE))

  def wanted(self, slot: int, upto: int) -> int:
    """Pages the slot lacks for cache slots [0, upto)."""
    have = int(self._shared_count[slot]) + self.own_pages(slot)
    return max(0, -(-upto // self.page_size) - have)

  def grow(self, slot: int, upto: int) -> None:
    """Gives the slot pages (from the free stack) for cache slots [0, upto)."""
    have = int(self._shared_count[slot]) + self.own_pages(slot)
    for i in range(self.wanted(slot, upto)):
      self.table[slot, have + i] = self.free.pop()

  def release(self, slot: int) -> None:
    """Returns the slot's own pages, and its prompt's when no other slot reads them."""
    own = self.table[slot, self._shared_count[slot] :]
    self.free.extend(int(p) for p in own if p != TRASH_PAGE)
    self.table[slot] = TRASH_PAGE
    share = int(self._share[slot])
    self._share[slot], self._shared_count[slot] = -1, 0
    self._users[share] -= 1
    if self._users[share] == 0:
      self.free.extend(self._shared.pop(share))
