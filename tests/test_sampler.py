"""Tests for the KV-cached sampler on the tiny architecture.

All tests share one model, one prompt batch and one max_new_tokens, so each distinct SamplingParams
compiles once (module-scoped fixtures cache the outputs).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gppo_jax.generation import sampler
from gppo_jax.models import architectures
from gppo_jax.models import heads as heads_lib
from gppo_jax.models import model as model_lib

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5], [13, 14, 15, 16, 17]]  # left-padded to P = 8
N = 12
TEMPERATURE = 0.7
TRUNCATED = dict(temperature=TEMPERATURE, top_k=5, top_p=0.5, num_topk=5, logprobs_mode="truncated")


@pytest.fixture(scope="module")
def model():
  cfg = architectures.get("tiny")
  return model_lib.Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
  return sampler.left_pad(PROMPTS, pad_id=0)


@pytest.fixture(scope="module")
def outputs(model, prompts):
  """Generates each sampling setting once; tests read from this cache."""
  cache = {}

  def get(name, **kw):
    if name not in cache:
      kw = dict(max_new_tokens=N, stop_ids=(), pad_id=0) | kw
      rng = kw.pop("rng", jax.random.key(0))
      cache[name] = jax.device_get(sampler.generate(model, *prompts, rng, **kw))
    return cache[name]

  return get


def _tempered(get):
  return get("tempered", temperature=TEMPERATURE, num_topk=4)


def _greedy(get):
  return get("greedy", greedy=True)


@nnx.jit
def _full_logits(model, tokens, mask):
  """No-cache forward over a whole (left-padded prompt + response) sequence: logits [B, T, V]."""
  hidden = model(tokens, model_lib.positions_from_mask(mask), attn_mask=mask).hidden
  return model.logits(hidden)


@nnx.jit
def _trainer_logprobs(model, tokens, mask, temperature):
  """The trainer's log-probs of tokens[:, 1:] given the prefix: a forward pass, then the chunked
  head `heads.chunked_logprobs`, as train_step does."""
  positions = model_lib.positions_from_mask(mask)
  hidden = model(tokens[:, :-1], positions[:, :-1], attn_mask=mask[:, :-1]).hidden
  lp = heads_lib.chunked_logprobs(model, hidden, tokens[:, 1:], temperature=temperature)
  return lp["logprobs"]


def count_traces(monkeypatch) -> list:
  """Records every trace of `sampler.sample`: the compiled samplers (`sample_jit` and the sharded
  `jit_sampler`) call it by name while tracing, and never while a compiled version fits."""
  traces = []
  real = sampler.sample

  def counted(*args, **kwargs):
    traces.append(args[-1])  # the SamplingParams
    return real(*args, **kwargs)

  monkeypatch.setattr(sampler, "sample", counted)
  return traces


def test_left_pad():
  tokens, mask = sampler.left_pad([[1, 2, 3], [4]], pad_id=9, multiple=4)
  np.testing.assert_array_equal(tokens, [[9, 1, 2, 3], [9, 9, 9, 4]])
  np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
  # Rows of any lengths (lists or arrays) keep their tokens in order, right-aligned.
  rows = [[5, 6], np.array([7, 8, 9], np.int64), [3], [1, 2, 3, 4, 5]]
  tokens, mask = sampler.left_pad(rows, length=6)
  assert tokens.dtype == np.int32 and tokens.shape == (4, 6)
  for row, t, m in zip(rows, tokens, mask, strict=True):
    assert t[m].tolist() == list(row) and m.tolist() == [False] * (6 - len(row)) + [True] * len(row)
    assert (t[~m] == 0).all()
  with pytest.raises(ValueError, match="shorter than the longest"):
    sampler.left_pad([[1, 2, 3]], length=2)
  with pytest.raises(ValueError, match="at least one token"):
    sampler.left_pad([[1], []])


def test_params_validation():
  with pytest.raises(ValueError, match="top_p"):
    sampler.SamplingParams(max_new_tokens=4, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    sampler.SamplingParams(max_new_tokens=4, temperature=0.0)
  with pytest.raises(ValueError, match="logprobs_mode"):
    sampler.SamplingParams(max_new_tokens=4, logprobs_mode="bogus")
  sampler.SamplingParams(max_new_tokens=4, temperature=0.0, greedy=True)  # greedy ignores T


def test_generate_input_errors(model, prompts):
  tokens, mask = prompts
  with pytest.raises(ValueError, match="left-padded"):
    sampler.generate(model, tokens[:, ::-1], mask[:, ::-1], jax.random.key(0), max_new_tokens=N)
  with pytest.raises(ValueError, match="must both be"):
    sampler.generate(model, tokens[0], mask[0], jax.random.key(0), max_new_tokens=N)
  with pytest.raises(ValueError, match="exceeds the vocabulary"):
    sampler.generate(model, tokens, mask, jax.random.key(0), max_new_tokens=N, num_topk=10_000)


def test_categorical_law():
  """The two-level inverse-CDF draw follows softmax(logits) and never picks -inf entries."""
  n, vocab = 40_000, 50  # 50 is not a multiple of the block size: exercises the padding
  logits = jax.random.normal(jax.random.key(0), (vocab,)) * 2.0
  logits = logits.at[jnp.array([0, 7, 8, 49])].set(-jnp.inf)
  draws = np.asarray(jax.jit(sampler.categorical)(jax.random.key(1), jnp.tile(logits, (n, 1))))
  freq = np.bincount(draws, minlength=vocab) / n
  p = np.asarray(jax.nn.softmax(logits))
  assert freq[[0, 7, 8, 49]].sum() == 0
  assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-4).all(), np.abs(freq - p).max()
  one_hot = jnp.full((2, vocab), -jnp.inf).at[0, 49].set(0.0).at[1, 0].set(3.0)
  np.testing.assert_array_equal(sampler.categorical(jax.random.key(2), one_hot), [49, 0])


@pytest.mark.user_xla
def test_logprobs_match_trainer(model, prompts, outputs):
  """Behaviour log-probs == the trainer's log-probs on prompt + response at the same temperature."""
  out = _tempered(outputs)
  ptoks, pmask = prompts
  tokens = jnp.concatenate([ptoks, out.tokens], axis=1)
  mask = jnp.concatenate([pmask, out.mask], axis=1)
  assert out.mask.all()  # no stop ids: every row runs to max_new_tokens
  response = slice(ptoks.shape[1] - 1, None)
  lp = np.asarray(_trainer_logprobs(model, tokens, mask, TEMPERATURE))[:, response]
  np.testing.assert_allclose(out.logprobs, lp, atol=2e-5, rtol=1e-5)
  # Not trivially satisfied: a different temperature moves them.
  lp_t1 = np.asarray(_trainer_logprobs(model, tokens, mask, 1.0))[:, response]
  assert np.abs(lp_t1 - out.logprobs).max() > 1e-3


def test_entropy_is_the_tempered_distributions_at_each_step(model, prompts, outputs):
  """The sampler's per-token entropy == that of softmax(logits / T) from a no-cache forward over
  prompt + response; greedy's is softmax(logits)'s; 0 past the stop token."""
  ptoks, pmask = prompts
  P = ptoks.shape[1]
  for out, temperature in ((_tempered(outputs), TEMPERATURE), (_greedy(outputs), 1.0)):
    tokens = jnp.concatenate([ptoks, out.tokens], axis=1)
    mask = jnp.concatenate([pmask, out.mask], axis=1)
    logits = np.asarray(_full_logits(model, tokens, mask), np.float64)[:, P - 1 : -1] / temperature
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    want = -(np.exp(logp) * logp).sum(-1)
    assert (want > 0.05).all()  # a real distribution, not a point mass: the check is not trivial
    np.testing.assert_allclose(out.entropy, want, rtol=1e-4, atol=1e-5)
  stopped = outputs("stopped_entropy", stop_ids=(int(_greedy(outputs).tokens[0, 1]),), greedy=True)
  assert (~stopped.mask).any() and (stopped.entropy[~stopped.mask] == 0).all()
  assert (stopped.entropy[stopped.mask] > 0).all()


def test_entropy_ignores_minus_infinity_logits():
  """A -inf logit (an excluded token) has probability 0 and adds nothing: finite entropy."""
  logits = jnp.array([[1.0, -jnp.inf, 0.5, -jnp.inf], [0.0, 0.0, 0.0, 0.0]])
  params = sampler.SamplingParams(max_new_tokens=1, temperature=0.7)
  entropy = np.asarray(sampler._sample_token(logits, jax.random.key(0), params)[-1])
  p = np.asarray(jax.nn.softmax(jnp.array([1.0, 0.5]) / 0.7))
  np.testing.assert_allclose(entropy, [-(p * np.log(p)).sum(), np.log(4)], rtol=1e-5)


@pytest.mark.user_xla
def test_topk_sorted_and_consistent(outputs):
  out = _tempered(outputs)
  vals, ids = out.topk_logprobs, out.topk_ids
  assert vals.shape == ids.shape == (len(PROMPTS), N, 4)
  assert (np.diff(vals, axis=-1) <= 0).all()
  assert (np.exp(vals).sum(-1) <= 1 + 1e-5).all()
  hit = ids == out.tokens[..., None]
  assert hit.sum(-1).max() <= 1  # ids are distinct from each other at a position
  # Where the sampled token is in the top-K, its log-prob is the same number.
  np.testing.assert_allclose(vals[hit], np.broadcast_to(out.logprobs[..., None], hit.shape)[hit])
  # A sampled token outside the top-K is at most as likely as the K-th.
  miss = ~hit.any(-1)
  assert (out.logprobs[miss] <= vals[..., -1][miss] + 1e-6).all()


@pytest.mark.user_xla
def test_deterministic_given_rng(outputs):
  a = _tempered(outputs)
  b = outputs("tempered_again", temperature=TEMPERATURE, num_topk=4)
  c = outputs("tempered_rng1", temperature=TEMPERATURE, num_topk=4, rng=jax.random.key(1))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert (a.tokens != c.tokens).mean() > 0.5


@pytest.mark.user_xla
def test_greedy_matches_uncached_argmax(model, prompts, outputs):
  """Step by step: the argmax of a full no-cache forward over prompt + tokens so far."""
  out = _greedy(outputs)
  ptoks, pmask = prompts
  P, rows = ptoks.shape[1], np.arange(len(PROMPTS))
  # One fixed shape [B, P + N]: slots not generated yet are masked out (and causally invisible).
  tokens = np.concatenate([ptoks, np.zeros_like(out.tokens)], axis=1)
  mask = np.concatenate([pmask, np.zeros_like(out.mask)], axis=1)
  for step in range(N):
    logits = np.asarray(_full_logits(model, jnp.asarray(tokens), jnp.asarray(mask)))
    logits = logits[:, P + step - 1]
    np.testing.assert_array_equal(out.tokens[:, step], logits.argmax(-1), err_msg=f"step {step}")
    # Greedy log-probs are under softmax(logits) (T = 1).
    expected = jax.nn.log_softmax(logits)[rows, out.tokens[:, step]]
    np.testing.assert_allclose(out.logprobs[:, step], expected, atol=2e-5)
    tokens[:, P + step], mask[:, P + step] = logits.argmax(-1), True


def test_top_k_one_equals_greedy(outputs):
  np.testing.assert_array_equal(outputs("top_k1", top_k=1).tokens, _greedy(outputs).tokens)


def test_tiny_top_p_equals_greedy(outputs):
  out = outputs("top_p_tiny", temperature=1.5, top_p=1e-6, rng=jax.random.key(3))
  np.testing.assert_array_equal(out.tokens, _greedy(outputs).tokens)


def test_stop_token_and_padding(outputs):
  greedy = _greedy(outputs)
  row0 = list(greedy.tokens[0])
  stop = next(t for j, t in enumerate(row0) if j >= 2 and t not in row0[:j])
  out = outputs("greedy_stop", greedy=True, stop_ids=(int(stop), 10_000), pad_id=7)
  for r in range(len(PROMPTS)):
    row = list(greedy.tokens[r])
    length = row.index(stop) + 1 if stop in row else N
    assert out.lengths[r] == length
    np.testing.assert_array_equal(out.tokens[r, :length], row[:length])
    assert (out.tokens[r, length:] == 7).all()
    np.testing.assert_array_equal(out.mask[r], np.arange(N) < length)
    np.testing.assert_allclose(out.logprobs[r, :length], greedy.logprobs[r, :length], atol=1e-6)
    assert (out.logprobs[r, length:] == 0).all()
  assert out.lengths[0] < N


@pytest.mark.user_xla
def test_shapes_mask_and_lengths(outputs):
  for out in (_tempered(outputs), _greedy(outputs)):
    assert out.tokens.shape == out.logprobs.shape == out.mask.shape == (len(PROMPTS), N)
    assert out.tokens.dtype == np.int32 and out.lengths.dtype == np.int32
    np.testing.assert_array_equal(out.lengths, out.mask.sum(-1))
    # The mask is a prefix: True then False.
    np.testing.assert_array_equal(out.mask, np.arange(N)[None] < out.lengths[:, None])
    assert (out.logprobs[out.mask] <= 0).all()
  assert _greedy(outputs).topk_ids is None


@pytest.mark.user_xla
def test_truncated_logprobs(model, prompts, outputs):
  """top-k + top-p: tokens come from the truncated set and the option returns its log-probs."""
  out = outputs("truncated", **TRUNCATED)
  ptoks, pmask = prompts
  tokens = jnp.concatenate([ptoks, out.tokens], axis=1)
  mask = jnp.concatenate([pmask, out.mask], axis=1)
  tempered = np.asarray(_trainer_logprobs(model, tokens, mask, TEMPERATURE))[
    :, ptoks.shape[1] - 1 :
  ]
  assert (out.logprobs >= tempered - 1e-5).all()  # renormalised over fewer tokens
  assert (out.logprobs > tempered + 1e-3).all()  # and the cut-off mass is visible
  # The sampled token is one of the kept (finite) truncated top-K entries, which sum to 1.
  finite = np.isfinite(out.topk_logprobs)
  assert ((out.topk_ids == out.tokens[..., None]) & finite).any(-1).all()
  np.testing.assert_allclose(np.where(finite, np.exp(out.topk_logprobs), 0).sum(-1), 1, atol=1e-5)
  assert (finite.sum(-1) < 5).any()  # top-p cut some of the top-5


def test_tempered_topk_is_softmax_topk(model, prompts, outputs):
  """Default top-K: the K largest entries of log softmax(logits / T) (checked at the first step)."""
  ptoks, pmask = prompts
  logits = _full_logits(model, jnp.asarray(ptoks), jnp.asarray(pmask))
  first = np.asarray(jax.nn.log_softmax(logits[:, -1] / TEMPERATURE))
  out = _tempered(outputs)
  np.testing.assert_allclose(out.topk_logprobs[:, 0], -np.sort(-first, axis=-1)[:, :4], atol=2e-5)
  np.testing.assert_array_equal(out.topk_ids[:, 0], np.argsort(-first, axis=-1)[:, :4])


def test_functional_form_inside_user_jit(model, prompts, outputs):
  """`sample(graphdef, state, ...)` runs inside a caller's jit and equals `generate`."""
  graphdef, state = nnx.split(model)
  params = sampler.SamplingParams(max_new_tokens=N, greedy=True, stop_ids=(), pad_id=0)

  @jax.jit
  def step(state, tokens, mask, rng):
    return sampler.sample(graphdef, state, tokens, mask, rng, params).tokens

  tokens = step(state, *prompts, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(tokens), _greedy(outputs).tokens)


def test_sampler_compiles_once_for_new_params_prompts_and_keys(model, monkeypatch):
  """Batches of one shape under one setting trace the decode once, whatever the parameters (here
  rescaled by a jit, as an update returns them), prompts and keys: a silent retrace (a weak-typed,
  re-typed or re-laid-out argument, an unhashable setting) would recompile it on every call."""
  traces = count_traces(monkeypatch)
  settings = dict(max_new_tokens=5, temperature=0.9, top_k=7, stop_ids=(2,))  # only this test's
  sampling = sampler.SamplingParams(**settings)
  graphdef, params = nnx.split(model)
  rescale = jax.jit(lambda p, c: jax.tree.map(lambda x: x * c, p))
  rng = np.random.default_rng(0)
  for i in range(3):
    prompts = [list(rng.integers(3, 64, size=rng.integers(1, 9))) for _ in range(3)]
    tokens, mask = sampler.left_pad(prompts, pad_id=0, length=8)
    params = rescale(params, 1.0 + 0.1 * i)
    out = sampler.sample_jit(graphdef, params, tokens, mask, jax.random.key(i), sampling)
    assert out.tokens.shape == (3, 5)
  # `generate` builds the same graphdef and SamplingParams, so it reuses that compile too.
  sampler.generate(model, tokens, mask, jax.random.key(9), **settings)
  assert traces == [sampling], f"{len(traces)} traces: {traces}"


# --- Blockwise decode, shared prefill, early stop, the mesh path ---------------------------------

GROUPED = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5], [13, 14, 15, 16, 17], [40, 41]]  # 4 x G = 4
G = 4


_SAMPLE_KW = ("group_size", "decode_block", "unroll_layers")


def _sample(model, tokens, mask, sampling, key=0, fresh=False, **kw):
  """`sampler.sample` compiled with the keywords static: unroll_layers=False is the scan decode
  (blockwise over `decode_block`-slot cache blocks), True (the CPU default) the unrolled one.
  fresh: traced anew (jit shares traces between wrappers of one function: a test that patches a
  module constant must not reuse, or leave behind, a trace made under another value)."""
  graphdef, params = nnx.split(model)
  fun = functools.partial(sampler.sample) if fresh else sampler.sample
  fn = jax.jit(fun, static_argnums=(0, 5), static_argnames=_SAMPLE_KW)
  return jax.device_get(fn(graphdef, params, tokens, mask, jax.random.key(key), sampling, **kw))


def _assert_same(a, b, atol=1e-6):
  """Equal tokens, mask and top-K ids; log-probs equal up to float rounding."""
  for name in ("tokens", "mask", "lengths", "topk_ids"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol, rtol=0)
  if a.topk_logprobs is not None:
    np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=atol, rtol=0)


def test_detect_group_size():
  rows = [p for p in GROUPED for _ in range(G)]
  assert sampler.detect_group_size(*sampler.left_pad(rows, length=8)) == G
  assert sampler.detect_group_size(*sampler.left_pad(GROUPED, length=8)) == 1
  # Runs of 4, 4 and 8 (two equal prompts side by side): groups of 4 hold.
  assert sampler.detect_group_size(*sampler.left_pad(rows[:8] + rows[4:8] + rows[4:12])) == 4
  assert sampler.detect_group_size(*sampler.left_pad(rows[1:])) == 1  # runs 3, 4, 4, 4
  # Same tokens but a different mask (one more pad-id token of prompt) is another prompt.
  tokens, mask = sampler.left_pad([[0, 3], [3]], length=2)
  assert sampler.detect_group_size(tokens, mask) == 1


@pytest.mark.parametrize("name", ["greedy", "tempered", "truncated"])
def test_blockwise_decode_equals_whole_cache_attention(model, prompts, outputs, name):
  """The scan decode (TPU / GPU) attending over the filled cache blocks only (blocks of 2 or 5 of
  the P + N - 1 = 19 slots: a traced number of blocks, the last one clamped to overlap its
  neighbour) draws the same tokens, log-probs and top-K under the same key as attention over the
  whole cache at once (one block of 19 slots, and `generate`'s unrolled decode on CPU)."""
  kw = {"greedy": dict(greedy=True), "tempered": dict(temperature=TEMPERATURE, num_topk=4)}
  kw = kw.get(name, TRUNCATED)
  one = outputs(name, **kw)  # through `generate`: the unrolled decode, one phase
  assert sampler.DECODE_BLOCK >= prompts[0].shape[1] + N - 1
  assert len(sampler.phase_ends(prompts[0].shape[1], N)) == 1
  sampling = sampler.SamplingParams(max_new_tokens=N, stop_ids=(), pad_id=0, **kw)
  for block in (2, 5, sampler.DECODE_BLOCK):
    _assert_same(one, _sample(model, *prompts, sampling, decode_block=block, unroll_layers=False))
  assert one.mask.all()


@pytest.mark.parametrize("name", ["greedy", "tempered", "truncated"])
def test_phased_decode_equals_one_phase(model, prompts, outputs, name, monkeypatch):
  """The unrolled decode with its cache grown in 4 phases (the N - 1 = 11 feed-back steps cut
  3 + 3 + 3 + 2) draws what one phase over the whole cache draws, and stops in a later phase's
  loop as soon as every row has stopped."""
  kw = {"greedy": dict(greedy=True), "tempered": dict(temperature=TEMPERATURE, num_topk=4)}
  kw = kw.get(name, TRUNCATED)
  one = outputs(name, **kw)
  monkeypatch.setattr(sampler, "DECODE_PHASE_MIN", 2)
  P = prompts[0].shape[1]
  assert sampler.phase_ends(P, N) == [P + 3, P + 6, P + 9, P + 11]
  sampling = sampler.SamplingParams(max_new_tokens=N, stop_ids=(), pad_id=0, **kw)
  _assert_same(one, _sample(model, *prompts, sampling, unroll_layers=True, fresh=True))
  # Stop at the tokens drawn at step 7 (third phase): each row ends at its first one, padded after
  # in every later phase.
  stop = {int(t) for t in one.tokens[:, 7]}
  first = [next(j for j, t in enumerate(row) if int(t) in stop) for row in one.tokens]
  early = sampler.SamplingParams(max_new_tokens=N, stop_ids=tuple(stop), pad_id=0, **kw)
  out = _sample(model, *prompts, early, unroll_layers=True, fresh=True)
  np.testing.assert_array_equal(out.lengths, np.array(first) + 1)
  for r, n in enumerate(first):
    np.testing.assert_array_equal(out.tokens[r, : n + 1], one.tokens[r, : n + 1])
    assert (out.tokens[r, n + 1 :] == 0).all()


@pytest.mark.parametrize("tied", [True, False])
def test_unrolled_decode_equals_scan_decode(prompts, tied):
  """The CPU decode (layers unrolled, cache per layer with keys transposed, an untied head
  transposed once per call) draws what the scan decode draws, for a tied and an untied head."""
  cfg = architectures.get("tiny", tie_word_embeddings=tied)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(1))
  sampling = sampler.SamplingParams(max_new_tokens=N, temperature=TEMPERATURE, num_topk=3)
  scan = _sample(model, *prompts, sampling, unroll_layers=False)
  _assert_same(scan, _sample(model, *prompts, sampling, unroll_layers=True))
  assert len({tuple(r) for r in scan.tokens}) == len(PROMPTS)


def test_shared_prefill_equals_per_row_prefill(model):
  """Each prompt's prefill runs once for its G rows (here with the scan decode reading blocks of 4
  slots): the same output as one prefill per row and the unrolled decode, and the G samples of a
  prompt still differ (every row draws its own uniforms)."""
  tokens, mask = sampler.left_pad([p for p in GROUPED for _ in range(G)], length=8)
  sampling = sampler.SamplingParams(max_new_tokens=N, temperature=1.0, num_topk=2, pad_id=0)
  shared = _sample(model, tokens, mask, sampling, group_size=G, decode_block=4, unroll_layers=False)
  per_row = _sample(model, tokens, mask, sampling, group_size=1)
  _assert_same(shared, per_row, atol=2e-6)
  for g in range(len(GROUPED)):
    rows = shared.tokens[g * G : (g + 1) * G]
    assert len({tuple(r) for r in rows}) == G, rows  # 64-token vocabulary, T = 1: all distinct
  with pytest.raises(ValueError, match="group_size"):
    _sample(model, tokens, mask, sampling, group_size=3)


def test_decode_stops_when_every_row_has_stopped(model, prompts, outputs, monkeypatch):
  """The decode loop stops at the step where the last row meets a stop token: the number of
  tokens drawn is the longest response, not max_new_tokens."""
  greedy = _greedy(outputs)
  draws = []
  real = sampler._sample_token

  def counted(logits, key, p):
    jax.debug.callback(lambda: draws.append(1))
    return real(logits, key, p)

  monkeypatch.setattr(sampler, "_sample_token", counted)
  stop = tuple(sorted({int(t) for t in greedy.tokens[:, 4]}))  # each row stops by step 4
  sampling = sampler.SamplingParams(max_new_tokens=N, greedy=True, stop_ids=stop, pad_id=11)
  out = _sample(model, *prompts, sampling, fresh=True)
  longest = int(out.lengths.max())
  assert longest <= 5 < N and (out.lengths < N).all()
  jax.effects_barrier()
  assert len(draws) == longest, (len(draws), out.lengths)
  # Every row stopping at its first token: no decode step at all.
  draws.clear()
  everything = sampler.SamplingParams(max_new_tokens=N, greedy=True, stop_ids=tuple(range(64)))
  out = _sample(model, *prompts, everything, fresh=True)
  jax.effects_barrier()
  assert len(draws) == 1 and (out.lengths == 1).all()


def test_decode_program_does_not_grow_with_the_length(model, prompts):
  """The scan decode is one traced program for every max_new_tokens: the same operations for 12,
  300 and 5000 new tokens (only buffer shapes differ). The unrolled decode adds one decode loop
  per phase, up to DECODE_PHASES: the same program from 4 x DECODE_PHASE_MIN steps on (600,
  5000, 50000 new tokens), so compile time does not grow with the length; each of its loops
  carries the cache of its own phase, up to `phase_ends`."""
  graphdef, params = nnx.split(model)

  def lowered(n, unroll, **kw):
    sampling = sampler.SamplingParams(max_new_tokens=n, **kw)
    fun = functools.partial(sampler.sample)  # traced anew (see `_sample`)
    fn = jax.jit(fun, static_argnums=(0, 5), static_argnames="unroll_layers")
    key = jax.random.key(0)
    return fn.lower(graphdef, params, *prompts, key, sampling, unroll_layers=unroll).as_text()

  def ops(n, unroll, **kw):
    return re.findall(r"= (?:\"?)(\w+\.\w+)", lowered(n, unroll, **kw))

  for kw in (dict(temperature=TEMPERATURE), dict(greedy=True, stop_ids=(2,)), TRUNCATED):
    short = ops(N, False, **kw)
    assert len(short) > 100 and "stablehlo.while" in short
    assert ops(300, False, **kw) == short == ops(5000, False, **kw), kw
    one_phase = ops(N, True, **kw)
    longest = ops(50_000, True, **kw)
    assert ops(600, True, **kw) == longest == ops(5000, True, **kw), kw
    extra = longest.count("stablehlo.while") - one_phase.count("stablehlo.while")
    assert extra == sampler.DECODE_PHASES - 1, (extra, kw)
  # The keys the decode loops carry, [B, K, Dh, S] per layer: S is each phase's end in turn.
  (B, P), cfg = prompts[0].shape, model.cfg
  keys = re.compile(rf"tensor<{B}x{cfg.num_kv_heads}x{cfg.head_dim}x(\d+)xf32>")
  lines = lowered(5000, True, greedy=True).splitlines()
  slots = [{int(s) for s in keys.findall(line)} for line in lines if "stablehlo.while" in line]
  assert [s for s in slots if s] == [{end} for end in sampler.phase_ends(P, 5000)], slots


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)])
def test_mesh_sampler_shares_prefill_and_compiles_once(model, mesh_shape, monkeypatch):
  """On the 8-device mesh, grouped prompts (detected) give the single-device per-row output, with
  groups cut to fit a batch shard; new prompts and keys of the same layout trace nothing new."""
  import chex

  from gppo_jax.models import partitioning, sharding

  graphdef, params = nnx.split(model)
  mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, mesh_shape, strict=True)))
  shardings = partitioning.state_shardings(params, mesh, partitioning.DEFAULT_RULES)
  mesh_sampler = sampler.MeshSampler(graphdef, shardings)
  dev_params = jax.device_put(params, shardings)
  sampling = sampler.SamplingParams(max_new_tokens=N, temperature=1.0, stop_ids=(2,), pad_id=0)
  rng = np.random.default_rng(1)
  calls = []
  for i in range(2):
    prompts = [list(rng.integers(3, 64, size=rng.integers(1, 9))) for _ in range(4)]
    tokens, mask = sampler.left_pad([p for p in prompts for _ in range(G)], length=8)
    want = _sample(model, tokens, mask, sampling, key=i, group_size=1)
    calls.append((tokens, mask, jax.random.key(i), want))
  chex.clear_trace_counter()
  monkeypatch.setattr(sampler, "sample", chex.assert_max_traces(sampler.sample, n=1))
  for tokens, mask, key, want in calls:
    _assert_same(mesh_sampler(dev_params, tokens, mask, key, sampling), want, atol=2e-6)
  ((_, _, group),) = mesh_sampler._compiled  # one compiled sampler
  assert group == (2 if mesh_shape == (8, 1, 1) else 4)  # 2 or 4 rows per batch shard
