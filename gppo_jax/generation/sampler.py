"""KV-cached autoregressive sampler: one prefill per prompt, then a `lax.while_loop` decode.

Every way of drawing responses lives here:

  sample(graphdef, params, tokens, mask, rng, sampling)    # pure: call it inside your own jit
  sample_jit(...)                                          # the same, compiled, default device
  generate(model, tokens, mask, rng, max_new_tokens=...)   # convenience on a module
  MeshSampler(graphdef, param_shardings)(params, ...)      # on a device mesh, host numpy in/out
  jit_sampler(graphdef, sampling, param_shardings, n)      # the sharded jit MeshSampler compiles
  sample_prompts(graphdef, params, token_ids, ...)         # a prompt list in fixed-size batches

Behaviour log-probs. By default (`logprobs_mode="tempered"`) the sampler returns, for every
generated token, log softmax(logits / T)[token]: exactly what the trainer recomputes with
`heads.chunked_logprobs(..., temperature=T)`, so the importance ratio pi_theta / mu is 1 at the
start of an update (a mismatch here silently biases RL). With top-k / top-p the tokens are actually
drawn from the *truncated* renormalised distribution, which differs from softmax(logits / T); pass
`logprobs_mode="truncated"` to get log-probs (and top-K) under the distribution really sampled from.
With top_k > 0 that mode also records the kept set itself (`SampleOutput.kept_ids`, the top_k ids
with -1 for those top-p cut), so that the trainer can renormalise the current policy over the same
set (`train_step`); the set is then exactly the first ranks of `lax.top_k` (a tie with the last
kept logit is broken by the lower token id, not kept as well). Greedy decoding ignores T; its
log-probs (and top-K) are under softmax(logits), i.e. T = 1.

What a call costs. The prompt is run once per group of identical consecutive rows (`group_size`:
the trainer's G samples of a prompt) and its KV cache and first-token logits are broadcast to the
group's rows; the rows still draw different tokens (each row has its own uniform per step). The
decode then takes one of two forms, both with a step whose cost follows the filled length and a
compile that does not grow with max_new_tokens:

- scan decode (TPU, GPU): one `lax.while_loop` over a cache of prompt + max_new_tokens - 1 slots;
  a step scans the stacked layers and attends over the filled cache blocks only (`decode_block`
  slots each, an online softmax with a traced trip count: `attention.cached_attention`).
- unrolled decode (CPU, `unroll_layers`): the layers run unrolled on a copy of each layer's
  weights, over a cache held per layer with the keys transposed (`model.LayerCache`), and a step
  attends over the whole cache in two plain matrix products (`attention.decode_attention`): XLA's
  CPU backend copies every block a blockwise loop slices, which cost more than the attention.
  The cache grows in up to DECODE_PHASES phases (`phase_ends`), one while loop each.

Either stops as soon as every row has met a stop token.

Padding follows the project convention: prompts are left-padded (mask False on pads), positions are
max(cumsum(mask) - 1, 0), and the response is right-padded with `pad_id` after the stop token.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from gppo_jax.models import attention as attention_lib
from gppo_jax.models import model as model_lib
from gppo_jax.models import partitioning, sharding

LOGPROBS_MODES = ("tempered", "truncated")
# Cache slots per key block of the decode step's attention (blocks past the filled length skipped).
DECODE_BLOCK = attention_lib.DECODE_BLOCK
# The unrolled (CPU) decode grows its cache in up to this many phases of at least
# DECODE_PHASE_MIN steps each; a step attends over its phase's whole cache.
DECODE_PHASES = 4
DECODE_PHASE_MIN = 128


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable, so one compiled sampler per distinct setting).

  temperature / top_k / top_p: logits / T, then top-k, then top-p on the top-k renormalised (the
  Hugging Face order); tokens tied with the last kept logit are kept too (not when the kept set is
  recorded, `kept_width`: see the module docstring). top_p < 1 without top_k sorts the whole
  vocabulary every step. greedy=True ignores all three (argmax of the logits).
  stop_ids: token ids that end a row (the stop token itself is kept and masked True).
  num_topk: if > 0, also return the top-`num_topk` log-probs and ids at every generated position,
  under the same distribution as the behaviour log-probs (see the module docstring).
  logprobs_mode: "tempered" (log softmax(logits / T)) or "truncated" (the renormalised kept set
  actually sampled from; with top_k > 0 the set is recorded as `SampleOutput.kept_ids`).
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  stop_ids: tuple[int, ...] = ()
  pad_id: int = 0
  num_topk: int = 0
  logprobs_mode: str = "tempered"
  # Mixtures of experts (routing replay): also return the experts each response token's step
  # routed its input token to (`SampleOutput.expert_ids`), for the trainer to reuse.
  record_experts: bool = False

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if not self.greedy and not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 (or use greedy=True), got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if self.num_topk < 0:
      raise ValueError(f"num_topk must be >= 0 (0 = off), got {self.num_topk}")
    if self.logprobs_mode not in LOGPROBS_MODES:
      raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
    object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))

  @property
  def kept_width(self) -> int:
    """Ids per token of the recorded kept set (`SampleOutput.kept_ids`): top_k in "truncated" mode
    with top_k > 0, else 0 (nothing recorded)."""
    truncated = self.logprobs_mode == "truncated" and not self.greedy
    return self.top_k if truncated and self.top_k > 0 else 0


# The recorded experts' ids (`SampleOutput.expert_ids`): a rollout holds [rows, response tokens,
# layers, k] of them on the host (Qwen3-30B-A3B: 384 per token).
EXPERT_ID_DTYPE = jnp.int16


@flax.struct.dataclass
class SampleOutput:
  """Sampled responses, right-padded with pad_id after the stop token.

  tokens: int32 [B, N]; logprobs: float32 [B, N] behaviour log-probs (0 where mask is False);
  mask: bool [B, N], True for generated tokens up to and including the stop token;
  lengths: int32 [B] = mask.sum(-1); topk_logprobs / topk_ids: [B, N, K] sorted descending
  (None unless num_topk > 0; -inf / pad_id where mask is False); kept_ids: int32 [B, N, top_k],
  the kept set each token was drawn from, -1 for ranks cut by top-p, every rank where mask is False
  and past the vocabulary (None unless `SamplingParams.kept_width`); entropy: float32 [B, N], the
  entropy of the full tempered distribution softmax(logits / T) (T = 1 when greedy) at each
  token's step (0 where mask is False), so that the policy's entropy is logged with every rollout.
  expert_ids: int16 [B, N, num_layers, k] (`SamplingParams.record_experts`, models with experts:
  EXPERT_ID_DTYPE, half the host memory of int32 for up to 32767 experts):
  the experts chosen in each layer for the token fed at the step that drew response token n (the
  last prompt token for n = 0, else response token n - 1: the teacher-forced input whose hidden
  state gives token n's log-prob); -1 in dense layers and where mask is False.
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  topk_logprobs: jax.Array | None = None
  topk_ids: jax.Array | None = None
  kept_ids: jax.Array | None = None
  entropy: jax.Array | None = None
  expert_ids: jax.Array | None = None


@flax.struct.dataclass
class SamplerState:
  """Carry of the decode loop. `step` is the index of the next response token to write."""

  step: jax.Array  # int32 []
  cache: model_lib.KVCache | model_lib.LayerCache
  last_token: jax.Array  # int32 [B]: token fed to the model in the next step
  position: jax.Array  # int32 [B]: position of last_token
  done: jax.Array  # bool [B]
  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  topk_logprobs: jax.Array | None
  topk_ids: jax.Array | None
  kept_ids: jax.Array | None = None
  entropy: jax.Array | None = None
  limit: jax.Array | None = None  # int32 [B]: each row's own max_new_tokens (row_limits)
  expert_ids: jax.Array | None = None  # int16 [B, N, num_layers, k] (record_experts)


def left_pad(
  prompts: Sequence[Sequence[int]], *, pad_id: int = 0, length: int | None = None, multiple: int = 1
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token-id lists into (tokens int32 [B, P], mask bool [B, P]).

  P is `length` if given, else the longest prompt rounded up to `multiple` (bucketing prompt lengths
  bounds the number of compiled samplers).
  """
  if not prompts:
    raise ValueError("left_pad: no prompts given")
  lengths = np.fromiter(map(len, prompts), np.int64, len(prompts))
  longest = int(lengths.max())
  if lengths.min() == 0:
    raise ValueError("left_pad: every prompt needs at least one token")
  if length is None:
    length = -(-longest // multiple) * multiple
  elif length < longest:
    raise ValueError(f"left_pad: length={length} is shorter than the longest prompt ({longest})")
  # One flat copy of all rows, not a copy per row.
  mask = np.arange(length)[None, :] >= (length - lengths)[:, None]
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  tokens[mask] = np.fromiter(itertools.chain.from_iterable(prompts), np.int32, int(lengths.sum()))
  return tokens, mask


def detect_group_size(prompt_tokens: np.ndarray, prompt_mask: np.ndarray) -> int:
  """The largest G such that rows come in runs of G identical (tokens, mask) rows from row 0: the
  layout of G samples per prompt (`[p for p in prompts for _ in range(G)]`); 1 if none. Host
  numpy only (a gcd of run lengths, O(B P))."""
  tokens = np.asarray(prompt_tokens)
  mask = np.asarray(prompt_mask, bool)
  same = np.all((tokens[1:] == tokens[:-1]) & (mask[1:] == mask[:-1]), axis=-1)  # [B - 1]
  starts = np.flatnonzero(np.concatenate([[True], ~same, [True]]))  # run boundaries
  return int(functools.reduce(math.gcd, np.diff(starts).tolist(), 0)) or 1


def call_group_size(
  prompt_tokens: np.ndarray, prompt_mask: np.ndarray, group_size: int | None
) -> int:
  """A sampler call's group size: `group_size`, checked to be >= 1 and to divide the rows, or
  with None the one the rows show (`detect_group_size`)."""
  if group_size is None:
    return detect_group_size(prompt_tokens, prompt_mask)
  rows = int(np.shape(prompt_tokens)[0])
  if group_size < 1 or rows % group_size:
    raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch ({rows} rows)")
  return group_size


def _truncation_threshold(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array | None:
  """Smallest logit kept by top-k then top-p (HF order, top-p on the top-k renormalised), [B, 1]."""
  if top_k <= 0 and top_p >= 1.0:
    return None
  vocab = scaled.shape[-1]
  k = min(top_k, vocab) if top_k > 0 else vocab
  vals, _ = jax.lax.top_k(scaled, k)  # sorted descending
  if top_p >= 1.0:
    return vals[:, -1:]
  keep = _top_p_ranks(vals, top_p)
  return jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1, keepdims=True)


def _top_p_ranks(vals: jax.Array, top_p: float) -> jax.Array:
  """bool [B, k]: the ranks top-p keeps of logits sorted descending (renormalised over the k)."""
  if top_p >= 1.0:
    return jnp.ones(vals.shape, bool)
  probs = jax.nn.softmax(vals, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  return mass_before < top_p  # the most likely token is always kept


def _last_positive(x: jax.Array) -> jax.Array:
  """Index of the last entry > 0 along the last axis (0 if none)."""
  n = x.shape[-1]
  return n - 1 - jnp.argmax(jnp.flip(x > 0, axis=-1), axis=-1)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
  """One draw per row from softmax(logits) [B, V] (-inf = excluded) by a two-level inverse CDF.

  Same law as `jax.random.categorical`, but one uniform per row instead of V Gumbel variates:
  far cheaper than V threefry-generated values per row for a large vocabulary, which would be a
  sizeable part of a small model's decode step.
  """
  return _draw(key, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)))


def row_keys(key: jax.Array, prompt_ids: np.ndarray, sample_ids: np.ndarray) -> jax.Array:
  """Typed key array [B]: row b's key fold_in(fold_in(key, prompt_ids[b]), sample_ids[b]).

  A response drawn with its row key depends only on (params, prompt, key, prompt id, sample id):
  not on the row's batch, slot or neighbours (batch-invariant sampling)."""
  if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
  fold = jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(key, p), s))
  return fold(jnp.asarray(prompt_ids, jnp.uint32), jnp.asarray(sample_ids, jnp.uint32))


def is_row_keys(key: jax.Array) -> bool:
  """Whether `key` is a [B] typed key array (one key per row) rather than one key."""
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1


def step_keys(key: jax.Array, step: jax.Array) -> jax.Array:
  """The key of token `step` (a scalar, or [B] with row keys): fold_in(key, step), per row for
  row keys."""
  if is_row_keys(key):
    step = jnp.broadcast_to(jnp.asarray(step, jnp.uint32), key.shape)
    return jax.vmap(jax.random.fold_in)(key, step)
  return jax.random.fold_in(key, step)


def _uniforms(key: jax.Array, batch: int) -> jax.Array:
  """float32 [B, 1] uniforms in [0, 1): from one key for the whole batch, or one per row key."""
  if is_row_keys(key):
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)[:, None]
  return jax.random.uniform(key, (batch, 1), jnp.float32)


def _draw(key: jax.Array, weights: jax.Array) -> jax.Array:
  """Inverse-CDF draw from unnormalised weights >= 0 [B, V] (some positive in every row).

  The vocabulary is cut into ~sqrt(V) blocks: pick a block by its mass, then a token inside it,
  each by a short cumulative sum, so no length-V scan is needed.
  """
  batch, vocab = weights.shape
  block = 1 << max(0, (int(np.ceil(np.sqrt(vocab))) - 1).bit_length())
  n = -(-vocab // block)
  if n * block != vocab:
    weights = jnp.pad(weights, ((0, 0), (0, n * block - vocab)))
  w = weights.reshape(batch, n, block)
  mass = w.sum(-1)  # [B, n]
  cum = jnp.cumsum(mass, axis=-1)
  u = _uniforms(key, batch) * cum[:, -1:]
  # Rounding can push u to the end of the range: clamp to the last block / token with mass.
  j = jnp.minimum(jnp.sum(cum <= u, axis=-1), _last_positive(mass))
  before = jnp.where(j > 0, jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[:, None], -1)[:, 0], 0)
  rest = u[:, 0] - before  # >= 0: mass still to walk inside block j
  row = jnp.take_along_axis(w, j[:, None, None], axis=1)[:, 0]  # [B, block]
  i = jnp.minimum(jnp.sum(jnp.cumsum(row, axis=-1) <= rest[:, None], axis=-1), _last_positive(row))
  return (j * block + i).astype(jnp.int32)


def _sample_token(logits: jax.Array, key: jax.Array, p: SamplingParams):
  """Draws one token per row from float32 logits [B, V]; returns (token, logprob, topk or None,
  kept ids or None, entropy).

  One exp pass serves the draw and the log-normaliser: logprob = x[token] - logsumexp(x) for the
  tempered logits x (or the truncated ones, -inf outside the kept set), and the entropy of
  softmax(x): log sum(e) - sum(e (x - max x)) / sum(e) with e = exp(x - max x).
  """
  x = logits if p.greedy else logits / p.temperature
  top = jnp.max(x, axis=-1, keepdims=True)  # always kept by truncation, so shared by both
  e = jnp.exp(x - top)
  total = jnp.sum(e, axis=-1)
  # (where e = 0 the term is 0, also for a -inf logit, whose product would be NaN)
  entropy = jnp.log(total) - jnp.sum(jnp.where(e > 0, e * (x - top), 0.0), axis=-1) / total
  kept_ids = None
  if p.greedy:
    token = jnp.argmax(x, axis=-1).astype(jnp.int32)
    dist, norm = x, e
  elif p.kept_width:
    # The kept set by rank (recorded, so the trainer renormalises over exactly this set), drawn
    # with the same inverse CDF over the vocabulary as below: equal draws when no logits tie.
    vals, ids = jax.lax.top_k(x, min(p.top_k, x.shape[-1]))
    keep = _top_p_ranks(vals, p.top_p)
    rows = jnp.arange(x.shape[0])[:, None]
    norm = jnp.zeros_like(e).at[rows, ids].set(jnp.where(keep, jnp.exp(vals - top), 0.0))
    dist = jnp.full_like(x, -jnp.inf).at[rows, ids].set(jnp.where(keep, vals, -jnp.inf))
    token = _draw(key, norm)
    kept_ids = jnp.where(keep, ids, -1)
    if kept_ids.shape[-1] < p.top_k:  # top_k past the vocabulary
      kept_ids = jnp.pad(kept_ids, ((0, 0), (0, p.top_k - kept_ids.shape[-1])), constant_values=-1)
  else:
    threshold = _truncation_threshold(x, p.top_k, p.top_p)
    kept = x if threshold is None else jnp.where(x >= threshold, x, -jnp.inf)
    w = e if threshold is None else jnp.where(x >= threshold, e, 0.0)
    token = _draw(key, w)
    dist, norm = (kept, w) if p.logprobs_mode == "truncated" else (x, e)
  lse = top + jnp.log(jnp.sum(norm, axis=-1, keepdims=True))
  logprob = jnp.take_along_axis(dist, token[:, None], axis=-1)[:, 0] - lse[:, 0]
  topk = None
  if p.num_topk > 0:
    vals, ids = jax.lax.top_k(dist, p.num_topk)
    topk = (vals - lse, ids)
  return token, logprob, topk, kept_ids, entropy


def token_records(token, logprob, topk, kept, entropy, live, p: SamplingParams, route=None):
  """A step's values per row as `SampleOutput` records them, by field name: the token drawn
  (`_sample_token`'s outputs), its log-prob and entropy, and what the setting also records
  (top-K, the kept set, `route`: int [B, L, k], the experts of the step's input token), with
  the padding of `SampleOutput` in rows not `live`. The fixed-batch sampler and the continuous
  engine both write these."""
  out = dict(
    tokens=jnp.where(live, token, p.pad_id),
    logprobs=jnp.where(live, logprob, 0.0),
    entropy=jnp.where(live, entropy, 0.0),
  )
  if topk is not None:
    vals, ids = topk
    out["topk_logprobs"] = jnp.where(live[:, None], vals, -jnp.inf)
    out["topk_ids"] = jnp.where(live[:, None], ids, p.pad_id)
  if kept is not None:
    out["kept_ids"] = jnp.where(live[:, None], kept, -1)
  if route is not None:
    out["expert_ids"] = jnp.where(live[:, None, None], route, -1)
  return out


def stops(token: jax.Array, step: jax.Array, limit: jax.Array | None, p: SamplingParams):
  """bool [B]: rows whose token `step` (0-based) ends them: a stop token, or their limit."""
  stopped = jnp.isin(token, jnp.asarray(p.stop_ids, jnp.int32)) if p.stop_ids else False
  if limit is not None:
    stopped = stopped | (step + 1 >= limit)
  return stopped


def _record(
  state: SamplerState, token, logprob, topk, kept, entropy, p: SamplingParams, route=None
) -> SamplerState:
  """Writes the token drawn for response index `state.step` (and `route`, int [B, L, k], the
  experts of the step's input token) and advances the done flags."""
  live = ~state.done
  values = token_records(token, logprob, topk, kept, entropy, live, p, route)
  col = state.step

  def put(buf, val):
    return jax.lax.dynamic_update_index_in_dim(buf, val.astype(buf.dtype), col, axis=1)

  updates = {name: put(getattr(state, name), val) for name, val in values.items()}
  return state.replace(
    step=state.step + 1,
    last_token=values["tokens"],
    position=state.position + 1,
    done=state.done | (live & stops(values["tokens"], state.step, state.limit, p)),
    mask=put(state.mask, live),
    **updates,
  )


def _prefill(model, tokens, mask, positions, group_size: int, with_routing: bool = False):
  """Runs each group's prompt once: (cache of B rows x P slots, first-token logits f32 [B, V],
  with_routing the experts of each row's last prompt token, int32 [B, L, k], else None).

  tokens / mask / positions [B, P] hold B / group_size groups of identical consecutive rows; the
  first row of each group is run and its cache and last logits are repeated over the group.
  """
  batch, prompt_len = tokens.shape
  if group_size > 1:
    first = lambda x: x.reshape(batch // group_size, group_size, *x.shape[1:])[:, 0]
    tokens, mask, positions = first(tokens), first(mask), first(positions)
  tokens, mask, positions = partitioning.constrain_batch((tokens, mask, positions))
  cache, logits, route = prefill_prompts(model, tokens, mask, positions, with_routing)
  if group_size > 1:
    rep = lambda x, axis: jnp.repeat(x, group_size, axis=axis, total_repeat_length=batch)
    cache = model_lib.KVCache(k=rep(cache.k, 1), v=rep(cache.v, 1), mask=rep(cache.mask, 0))
    logits = rep(logits, 0)
    route = None if route is None else rep(route, 0)
  return cache, logits, route


def prefill_prompts(
  model, tokens, mask, positions, with_routing: bool = False, *, under_vmap: bool = False
):
  """Runs prompts [M, P] (left-padded) through the model once: (their dense cache of P slots,
  float32 logits [M, V] of each one's next token, and with_routing the experts of each one's last
  token, int32 [M, L, k], else None). What both samplers prefill with; under_vmap as
  `Transformer.__call__`'s (the continuous engine)."""
  cache = model_lib.init_cache(model.cfg, tokens.shape[0], tokens.shape[1])
  out = model(
    tokens, positions, attn_mask=mask, cache=cache, cache_index=jnp.int32(0),
    under_vmap=under_vmap,
  )  # fmt: skip
  route = out.routing.expert_ids[:, -1] if with_routing else None
  return out.cache, model.logits(out.hidden[:, -1]).astype(jnp.float32), route


def phase_ends(prompt_len: int, max_new_tokens: int) -> list[int]:
  """Cache slots of each phase of the unrolled decode: the feed-back steps (max_new_tokens - 1)
  cut into up to DECODE_PHASES equal parts of at least DECODE_PHASE_MIN steps. A step attends
  over its phase's whole cache, so the cost follows the filled length to within a phase, and
  the compiled program holds at most DECODE_PHASES decode loops, whatever the length."""
  steps = max_new_tokens - 1
  phases = min(DECODE_PHASES, max(1, steps // DECODE_PHASE_MIN))
  return [prompt_len + -(-steps * j // phases) for j in range(1, phases + 1)]


def sample(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  rng: jax.Array,
  sampling: SamplingParams,
  *,
  group_size: int = 1,
  decode_block: int = DECODE_BLOCK,
  unroll_layers: bool | None = None,
  row_limits: jax.Array | None = None,
) -> SampleOutput:
  """Pure functional sampler: jit it with `graphdef`, `sampling` and the keywords static, or call
  it inside jit.

  prompt_tokens int32 [B, P] and prompt_mask bool [B, P] are left-padded; every row needs at least
  one real token. rng is one key, or one key per row (`row_keys`, a [B] typed key array): then
  row b's response depends on its own key only, not on its batch (batch-invariant sampling).
  Token s is drawn with key fold_in(rng, s): equal rngs give equal output, and the
  output does not depend on `group_size` or `decode_block` (up to float rounding).
  group_size: G when rows come in B / G runs of G identical prompts (`detect_group_size`): each
  prompt's prefill runs once. Rows that differ within a run would get the run's first prompt.
  decode_block (scan decode): cache slots per key block of the decode step's attention, which
  reads the blocks up to the filled length only; >= P + max_new_tokens - 1 attends over the whole
  cache at once.
  row_limits: int32 [B], each row's own max_new_tokens (<= sampling.max_new_tokens): a row ends
  after that many tokens, as if it had drawn a stop token (a per-prompt budget; the rollout
  benchmark forces long-tailed lengths this way).
  unroll_layers: the unrolled decode (module docstring): layers unrolled on a copy of each layer's
  weights (and of an untied head, transposed) made once per call (a scan's per-layer slice of the
  stacked weights is a copy at every step on CPU: up to a third of a small model's step), the
  cache per layer and grown in phases (`model.decode_weights`, `Transformer.decode_step`). Costs
  that copy's memory while sampling and a decode body per layer and phase in the compile;
  None = on CPU only. Earns its place: benchmarks/sampler.py --batch 64 --scan 1 ~1.7x
  against the scan decode.
  """
  model = nnx.merge(graphdef, params)
  if model.cfg.lora_rank and model_lib.SAMPLER_MERGES_LORA:  # the adapters merged, once
    model = model_lib.merge_lora(model)
  batch, prompt_len = prompt_tokens.shape
  _check_sample_args(model.cfg, sampling, batch, group_size, decode_block)
  n = sampling.max_new_tokens
  prompt_tokens = prompt_tokens.astype(jnp.int32)
  prompt_mask = prompt_mask.astype(bool)
  positions = model_lib.positions_from_mask(prompt_mask)

  record = sampling.record_experts
  cache, logits, route = _prefill(model, prompt_tokens, prompt_mask, positions, group_size, record)
  if unroll_layers is None:
    unroll_layers = jax.default_backend() == "cpu"
  if unroll_layers:
    weights = model_lib.decode_weights(model)
    cache = model_lib.LayerCache.from_stacked(cache)
    ends = phase_ends(prompt_len, n)
  else:
    ends = [prompt_len + n - 1]  # the last token drawn is never fed back
  state = _initial_state(model.cfg, sampling, cache, positions[:, -1], row_limits)
  state = _record(state, *_sample_token(logits, step_keys(rng, 0), sampling), sampling, route)

  def body(s: SamplerState) -> SamplerState:
    # Feeds the token written at step - 1 (cache slot P + step - 1) and draws the token at `step`.
    args = (s.last_token[:, None], s.position[:, None])
    slot = prompt_len + s.step - 1
    if unroll_layers:
      out = model.decode_step(*args, ~s.done[:, None], s.cache, slot, weights)
      logits = out.logits
    else:
      out = model(
        *args, attn_mask=~s.done[:, None], cache=s.cache, cache_index=slot,
        cache_block=decode_block,
      )  # fmt: skip
      logits = model.logits(out.hidden[:, 0])
    route = out.routing.expert_ids[:, 0] if record else None
    drawn = _sample_token(logits, step_keys(rng, s.step), sampling)
    return _record(s.replace(cache=out.cache), *drawn, sampling, route)

  s = state
  for end in ends:  # steps up to end - P write the slots < end
    s = s.replace(cache=s.cache.grow(end))
    s = jax.lax.while_loop(lambda s, e=end: (s.step <= e - prompt_len) & ~jnp.all(s.done), body, s)
  return SampleOutput(
    tokens=s.tokens,
    logprobs=s.logprobs,
    mask=s.mask,
    lengths=s.mask.sum(axis=-1).astype(jnp.int32),
    topk_logprobs=s.topk_logprobs,
    topk_ids=s.topk_ids,
    kept_ids=s.kept_ids,
    entropy=s.entropy,
    expert_ids=s.expert_ids,
  )


def _check_sample_args(cfg, sampling: SamplingParams, batch: int, group_size: int, block: int):
  """Raises ValueError for `sample` arguments that do not fit the model or the batch."""
  if sampling.num_topk > cfg.vocab_size:
    raise ValueError(f"num_topk={sampling.num_topk} exceeds the vocabulary ({cfg.vocab_size})")
  if group_size < 1 or batch % group_size:
    raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch ({batch} rows)")
  if block < 1:
    raise ValueError(f"decode_block must be >= 1, got {block}")
  if sampling.record_experts and not cfg.is_moe:
    raise ValueError("SamplingParams.record_experts: the model has no experts (num_experts=0)")


def _initial_state(cfg, sampling: SamplingParams, cache, position, row_limits) -> SamplerState:
  """The decode loop's state before the first token: the prefilled cache, each row's last
  prompt position [B], empty records of sampling.max_new_tokens tokens."""
  batch, n, k = position.shape[0], sampling.max_new_tokens, sampling.num_topk
  return SamplerState(
    step=jnp.int32(0),
    cache=cache,
    last_token=jnp.zeros((batch,), jnp.int32),
    position=position,
    done=jnp.zeros((batch,), bool),
    tokens=jnp.full((batch, n), sampling.pad_id, jnp.int32),
    logprobs=jnp.zeros((batch, n), jnp.float32),
    mask=jnp.zeros((batch, n), bool),
    topk_logprobs=jnp.full((batch, n, k), -jnp.inf, jnp.float32) if k else None,
    topk_ids=jnp.full((batch, n, k), sampling.pad_id, jnp.int32) if k else None,
    kept_ids=jnp.full((batch, n, kw), -1, jnp.int32) if (kw := sampling.kept_width) else None,
    entropy=jnp.zeros((batch, n), jnp.float32),
    limit=None if row_limits is None else jnp.asarray(row_limits, jnp.int32),
    expert_ids=(
      jnp.full((batch, n, cfg.num_layers, cfg.num_experts_per_tok), -1, EXPERT_ID_DTYPE)
      if sampling.record_experts
      else None
    ),
  )


def sample_jit(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  rng: jax.Array,
  sampling: SamplingParams,
  *,
  group_size: int = 1,
  decode_block: int = DECODE_BLOCK,
  row_limits: jax.Array | None = None,
) -> SampleOutput:
  """`sample` compiled for the default device: one compile per (graphdef, sampling, group_size,
  decode_block, shapes), however the keywords are spelled."""
  return _sample_jit(
    graphdef, params, prompt_tokens, prompt_mask, rng, sampling, group_size, decode_block,
    row_limits,
  )  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
def _sample_jit(graphdef, params, prompt_tokens, prompt_mask, rng, sampling, group_size, block,
                row_limits):  # fmt: skip
  return sample(
    graphdef, params, prompt_tokens, prompt_mask, rng, sampling,
    group_size=group_size, decode_block=block, row_limits=row_limits,
  )  # fmt: skip


def generate(
  model: nnx.Module,
  prompt_tokens: jax.Array | np.ndarray,
  prompt_mask: jax.Array | np.ndarray,
  rng: jax.Array,
  *,
  max_new_tokens: int,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  greedy: bool = False,
  stop_ids: Sequence[int] | None = None,
  pad_id: int | None = None,
  num_topk: int = 0,
  logprobs_mode: str = "tempered",
  group_size: int | None = None,
) -> SampleOutput:
  """Samples up to `max_new_tokens` per left-padded prompt with a jitted KV-cached decode.

  stop_ids=None stops on the model config's eos_token_ids; pad_id=None uses its pad_token_id.
  group_size=None detects runs of identical prompts (`detect_group_size`) on concrete inputs.
  """
  cfg = model.cfg
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_mask = jnp.asarray(prompt_mask, bool)
  if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
    raise ValueError(
      f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} must both be [B, P]"
    )
  concrete = not isinstance(prompt_mask, jax.core.Tracer)
  if concrete and not bool(jnp.all(prompt_mask[:, -1])):
    raise ValueError("prompts must be left-padded: prompt_mask[:, -1] must be True in every row")
  if group_size is None:
    concrete = concrete and not isinstance(prompt_tokens, jax.core.Tracer)
    group_size = detect_group_size(prompt_tokens, prompt_mask) if concrete else 1
  sampling = SamplingParams(
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    top_p=top_p,
    top_k=top_k,
    greedy=greedy,
    stop_ids=tuple(cfg.eos_token_ids) if stop_ids is None else tuple(stop_ids),
    pad_id=cfg.pad_token_id if pad_id is None else pad_id,
    num_topk=num_topk,
    logprobs_mode=logprobs_mode,
  )
  graphdef, params = nnx.split(model)
  return sample_jit(
    graphdef, params, prompt_tokens, prompt_mask, rng, sampling, group_size=group_size
  )


class MeshSampler:
  """Samples on the mesh from host prompts: what the rollouts and the periodic eval call.

  Every process passes the same full prompt arrays (left-padded numpy); each feeds its own rows,
  the sampler runs sharded over data x fsdp, and every process gets the full outputs back as numpy.
  One compiled sampler (and this process's row slice) is kept per (sampling params, batch size,
  group size).
  """

  def __init__(self, graphdef: nnx.GraphDef, param_shardings: Any):
    self.graphdef = graphdef
    self.param_shardings = param_shardings
    self.mesh = jax.tree.leaves(param_shardings)[0].mesh
    self.batch_multiple = sharding.batch_shards(self.mesh)
    self._compiled: dict[tuple[SamplingParams, int, int], tuple[Callable, slice]] = {}

  def __call__(
    self,
    params: Any,
    prompt_tokens: np.ndarray,
    prompt_mask: np.ndarray,
    rng: jax.Array,
    sampling: SamplingParams,
    *,
    group_size: int | None = None,
  ) -> SampleOutput:
    """group_size: rows come in runs of this many identical prompts (the rollout's samples per
    prompt), whose prefill then runs once; None detects it from the prompts (`detect_group_size`).
    It is lowered to divide each batch shard's rows, so a group never spans two shards."""
    n = int(np.shape(prompt_tokens)[0])
    if n % self.batch_multiple and sharding.spans_processes(self.mesh):
      raise ValueError(
        f"{n} prompts do not split over the {self.batch_multiple} batch shards of mesh "
        f"{dict(self.mesh.shape)}; use a multiple"
      )
    group_size = call_group_size(prompt_tokens, prompt_mask, group_size)
    spec = partitioning.batch_spec((n,), self.mesh)[0] or ()
    shards = math.prod(self.mesh.shape[a] for a in ((spec,) if isinstance(spec, str) else spec))
    group_size = math.gcd(group_size, n // shards)
    key = (sampling, n, group_size)
    if key not in self._compiled:
      fn = jit_sampler(self.graphdef, sampling, self.param_shardings, n, group_size=group_size)
      self._compiled[key] = fn, sharding.process_rows(n, self.mesh)
    fn, rows = self._compiled[key]
    dev = sharding.shard_batch(
      {"t": np.asarray(prompt_tokens)[rows], "m": np.asarray(prompt_mask)[rows]}, self.mesh
    )
    return sharding.to_host(fn(params, dev["t"], dev["m"], rng))


@sharding.reuse
def jit_sampler(
  graphdef: nnx.GraphDef,
  sampling: SamplingParams,
  param_shardings: Any,
  batch_size: int,
  *,
  group_size: int = 1,
) -> Callable:
  """jit(params, prompt_tokens, prompt_mask, rng) -> SampleOutput with every array split over
  data x fsdp along the batch axis (the KV cache follows). Nothing is donated: the parameters are
  reused by the update, and no output has an input's shape. group_size: as in `sample`; keep
  batch_size / group_size a multiple of the batch shards so that groups stay on one shard.
  Equal arguments return the same function (`sharding.reuse`)."""
  mesh = jax.tree.leaves(param_shardings)[0].mesh
  rows = NamedSharding(mesh, partitioning.batch_spec((batch_size,), mesh))  # a prefix: any rank
  rep = sharding.replicated(mesh)
  k = sampling.num_topk
  out = SampleOutput(
    tokens=rows,
    logprobs=rows,
    mask=rows,
    lengths=rows,
    topk_logprobs=rows if k else None,
    topk_ids=rows if k else None,
    kept_ids=rows if sampling.kept_width else None,
    entropy=rows,
    expert_ids=rows if sampling.record_experts else None,
  )

  def sample_on_mesh(params, prompt_tokens, prompt_mask, rng):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return sample(
        graphdef, params, prompt_tokens, prompt_mask, rng, sampling, group_size=group_size
      )

  return jax.jit(sample_on_mesh, in_shardings=(param_shardings, rows, rows, rep), out_shardings=out)


def sample_prompts(
  graphdef: nnx.GraphDef,
  params: Any,
  prompts: Sequence[Sequence[int]],
  sampling: SamplingParams,
  key: jax.Array,
  *,
  prompt_len: int,
  pad_id: int,
  batch_size: int | None = None,
  sample_fn: MeshSampler | None = None,
  group_size: int | None = None,
) -> SampleOutput:
  """One response per prompt (token-id lists), as numpy arrays in prompt order.

  Prompts are left-padded to `prompt_len` and, with `batch_size`, sampled in equal batches (the
  last one padded by repetition) so one compiled sampler serves every call; batch b draws with
  fold_in(key, first row of b). With `sample_fn` (a `MeshSampler`) the batches run on its mesh,
  one host or many, the batch size rounded up to a multiple of its batch shards; without it, on
  the default device through `sample_jit`. group_size: runs of identical prompts share one
  prefill; None detects them in each batch (`detect_group_size`).
  """
  tokens, mask = left_pad(prompts, pad_id=pad_id, length=prompt_len)
  n = len(prompts)
  bs = batch_size or n
  if sample_fn is not None:
    bs = -(-bs // sample_fn.batch_multiple) * sample_fn.batch_multiple
  outs = []
  for start in range(0, n, bs):
    idx = np.arange(start, start + bs) % n
    sub_key = jax.random.fold_in(key, start)
    t, m = tokens[idx], mask[idx]
    g = detect_group_size(t, m) if group_size is None else math.gcd(group_size, bs, n)
    if sample_fn is None:
      out = sample_jit(graphdef, params, t, m, sub_key, sampling, group_size=g)
    else:
      out = sample_fn(params, t, m, sub_key, sampling, group_size=g)
    take = min(bs, n - start)
    outs.append(jax.tree.map(lambda x, take=take: np.asarray(x)[:take], out))
  return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *outs)
