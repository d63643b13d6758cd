"""Gemma 2 and Gemma 3 (text): the attention's window, soft cap and scale in every path, and
parity with transformers on tiny random models whose sequences are longer than the window."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_parity import hf_logits, padded_batch

from gppo_jax.generation import continuous, paged, sampler
from gppo_jax.models import architectures, attention, hf_checkpoint, tokenizer
from gppo_jax.models import heads as heads_lib
from gppo_jax.models import model as model_lib

WINDOW = 8
T = 29  # longer than the window: several windows, and tiles of 8 with a padded last one

# -- the attention paths against the dense reference -------------------------------------------


def _qkv(seed=0, B=2, H=4, K=2, Dh=16):
  rng = np.random.default_rng(seed)
  q, k, v = (
    jnp.asarray(rng.normal(size=(B, T, n, Dh)), jnp.float32) for n in (H, K, K)
  )  # fmt: skip
  mask = np.ones((B, T), bool)
  mask[0, :5] = False  # a left-padded row
  return q, k, v, jnp.asarray(mask)


def _reference(q, k, v, mask, window, scale, cap):
  """Plain autodiff of the dense reference: the module's mask rule, within the window."""
  return attention.dense(q, k, v, attention.self_allowed(mask, window), scale, cap)


@pytest.mark.parametrize("impl", ["dense", "blockwise-loop", "blockwise-unrolled"])
@pytest.mark.parametrize("traced", [False, True])
def test_window_softcap_and_scale_forward_and_gradients(impl, traced):
  q, k, v, mask = _qkv()
  scale, cap = 0.6, 2.0  # a cap small enough to bend the scores

  def run(fn, q, k, v, window):
    out = fn(q, k, v, window)
    return jnp.sum(jnp.where(mask[:, :, None, None], out, 0.0) * jnp.cos(out)), out

  def ours(q, k, v, window):
    if impl == "dense":
      return attention.dense_fused(q, k, v, attention.self_allowed(mask, window), scale, cap)
    unroll = impl == "blockwise-unrolled"
    return attention.blockwise(
      q, k, v, mask, block_size=8, unroll=unroll, scale=scale, softcap=cap, window=window
    )

  ref = lambda q, k, v, window: _reference(q, k, v, mask, window, scale, cap)
  window = jnp.int32(WINDOW) if traced else WINDOW

  def grad(fn):  # a traced window is an argument of the compiled function, a static one is not
    g = jax.grad(lambda q, k, v, w: run(fn, q, k, v, w if traced else window), (0, 1, 2), True)
    return jax.jit(g)(q, k, v, window if traced else 0)

  (g_ours, out), (g_ref, want) = grad(ours), grad(ref)
  m = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(out)[m], np.asarray(want)[m], atol=2e-5)
  for a, b in zip(g_ours, g_ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)
  # The window and the cap both matter here.
  no_window = _reference(q, k, v, mask, None, scale, cap)
  no_cap = _reference(q, k, v, mask, window, scale, None)
  assert np.abs(np.asarray(no_window - want)[m]).max() > 1e-2
  assert np.abs(np.asarray(no_cap - want)[m]).max() > 1e-2


def _poisoned(k, v, upto):
  """k, v with NaN in slots [0, upto): any read of them that reaches an output makes it NaN."""
  bad = jnp.arange(T)[None, :, None, None] < upto
  return jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.nan, v)


def test_windowed_paths_read_only_the_window():
  """Keys before the window of the last queries are NaN: blockwise (loops), the cached prefill
  and decode, the CPU decode step and paged attention skip them (a masked read would still give
  NaN), and match the dense reference on the queries whose window excludes them."""
  q, k, v, mask = _qkv(1)
  kp, vp = _poisoned(k, v, 8)
  late = slice(8 + WINDOW + 7, T)  # queries whose window's first tile starts at slot >= 8
  want = np.asarray(_reference(q, k, v, mask, WINDOW, None, None))[:, late]
  got = attention.blockwise(q, kp, vp, mask, block_size=8, window=jnp.int32(WINDOW))
  np.testing.assert_allclose(np.asarray(got)[:, late], want, atol=2e-5)
  cached = attention.cached_attention(q, kp, vp, mask, 0, block_size=8, window=WINDOW)
  np.testing.assert_allclose(np.asarray(cached)[:, late], want, atol=2e-5)
  for i in range(late.start, T):  # one query at a time: the decode step's paths
    qi = q[:, i : i + 1]
    step = attention.cached_attention(qi, kp, vp, mask, i, block_size=4, window=WINDOW)
    k_t, v_t = kp.transpose(0, 2, 3, 1), vp.transpose(0, 2, 1, 3)
    whole = attention.decode_attention(qi, k_t, v_t, mask, i, window=WINDOW)
    for got in (step, whole):
      np.testing.assert_allclose(np.asarray(got)[:, 0], want[:, i - late.start], atol=2e-5)
  # Paged: each row's logical slots laid out page by page in a shuffled pool.
  ps, B = 4, q.shape[0]
  pages = T // ps + 1
  pad = lambda x: jnp.pad(x, ((0, 0), (0, pages * ps - T), (0, 0), (0, 0)))
  table = 1 + np.random.default_rng(0).permutation(B * pages).reshape(B, pages)
  pool = lambda x: jnp.moveaxis(
    jnp.zeros((1 + B * pages, ps, *x.shape[2:])).at[table.reshape(-1)].set(
      pad(x).reshape(B * pages, ps, *x.shape[2:])
    ), 2, 0
  )[:, None]  # [K, 1 layer, pages, ps, Dh]  # fmt: skip
  start = jnp.asarray(np.argmax(np.asarray(mask), axis=1), jnp.int32)
  i = T - 1
  got = paged.paged_attention(
    q[:, i : i + 1], pool(kp), pool(vp), 0, jnp.asarray(table, jnp.int32), start,
    jnp.full((B,), i, jnp.int32), window=jnp.int32(WINDOW),
  )  # fmt: skip
  np.testing.assert_allclose(np.asarray(got)[:, 0], want[:, -1], atol=2e-5)


def test_cudnn_and_splash_take_the_window_and_cap():
  """cuDNN's wrapper (run through XLA here) passes the window; splash (interpreted) the window
  and the cap; and cuDNN falls back to blockwise for a soft-capped model."""
  q, k, v, _ = _qkv(2)
  mask = jnp.ones((2, T), bool).at[0, :5].set(False).at[1, 25:].set(False)  # contiguous runs
  m = np.asarray(mask)
  want = np.asarray(_reference(q, k, v, mask, WINDOW, 0.3, None))
  got = attention.cudnn(q, k, v, mask, implementation="xla", scale=0.3, window=WINDOW)
  np.testing.assert_allclose(np.asarray(got)[m], want[m], atol=2e-5)
  want = np.asarray(_reference(q, k, v, mask, WINDOW, 0.3, 2.0))
  got = attention.splash(q, k, v, mask, block_size=128, scale=0.3, softcap=2.0, window=WINDOW)
  np.testing.assert_allclose(np.asarray(got)[m], want[m], atol=2e-5)
  kw = dict(seq_len=T, dtype=jnp.bfloat16, head_dim=16)
  assert attention.resolve("cudnn", **kw, softcap=50.0) == "blockwise"
  assert attention.resolve("auto", **kw, backend="gpu", softcap=50.0) == "blockwise"
  assert attention.resolve("auto", **kw, backend="gpu") == "cudnn"


# -- parity with transformers --------------------------------------------------------------------

_COMMON = dict(
  vocab_size=256,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=256,
  bos_token_id=2,
  eos_token_id=1,
  pad_token_id=0,
  sliding_window=WINDOW,
  query_pre_attn_scalar=24,  # not head_dim: the scale is read from the config
)
CASES = {
  # Soft caps small enough to bend these logits and scores.
  "gemma2": lambda: transformers.Gemma2Config(
    **_COMMON, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
  ),
  # Layers local, local, global, local; its own local RoPE base; linear scaling on the global.
  "gemma3": lambda: transformers.Gemma3TextConfig(
    **_COMMON,
    sliding_window_pattern=3,
    rope_theta=10000.0,
    rope_local_base_freq=100.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
  ),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
  """(kind, HF model, folder) of a tiny random Gemma saved by save_pretrained."""
  torch.manual_seed(0)
  cfg = CASES[request.param]()
  cfg._attn_implementation = "eager"
  m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():  # random everything, norm weights too, so the mappings matter
    for _, p in m.named_parameters():
      p.copy_(0.15 * torch.randn_like(p))
  path = tmp_path_factory.mktemp(request.param)
  m.save_pretrained(path)
  return request.param, m, path


_batch = functools.partial(padded_batch, 256, T)


def _our_logits(policy, tokens, mask, positions):
  @nnx.jit  # a fresh trace: tests patch attention's module constants
  def forward(policy, tokens, mask, positions):
    hidden = policy(tokens, positions, attn_mask=mask).hidden
    return policy.logits(hidden)

  return np.asarray(forward(policy, tokens, mask, positions))


@pytest.mark.parametrize("impl", ["dense", "blockwise"])
def test_logits_match_transformers(saved, impl, monkeypatch):
  kind, hf, path = saved
  monkeypatch.setattr(attention, "CPU_BLOCK_MIN", 8)  # blockwise in 4 tiles of 8
  monkeypatch.setattr(attention, "CPU_BLOCK_MAX", 8)
  policy = hf_checkpoint.load_model(path, attention=impl)
  cfg = policy.cfg
  assert cfg.family == kind and cfg.sliding_window == WINDOW
  assert cfg.local_layers == ((0, 2) if kind == "gemma2" else (0, 1, 3))
  batch = _batch()
  want = hf_logits(hf, *batch)
  mask = batch[1]
  got = _our_logits(policy, *batch)
  np.testing.assert_allclose(got[mask], want[mask], atol=1e-4, rtol=1e-4)
  # The window matters on these sequences: without it the logits move.
  policy.cfg = architectures.dataclasses.replace(cfg, local_layers=())
  assert np.abs(_our_logits(policy, *batch) - want)[mask].max() > 1e-2


def test_export_round_trip(saved, tmp_path):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  out = hf_checkpoint.save_model(policy, tmp_path / "export", source=path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  batch = _batch()
  mask = batch[1]
  want = hf_logits(hf, *batch)
  np.testing.assert_allclose(hf_logits(reloaded.eval(), *batch)[mask], want[mask], atol=1e-5)
  assert hf_checkpoint.load_model(out).cfg == policy.cfg
  # Written from scratch (no source config.json), transformers reads the same model.
  bare = hf_checkpoint.save_model(policy, tmp_path / "bare")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(bare, attn_implementation="eager")
  np.testing.assert_allclose(hf_logits(reloaded.eval(), *batch)[mask], want[mask], atol=1e-5)
  assert hf_checkpoint.load_model(bare).cfg == policy.cfg


def test_kv_cache_prefill_and_steps_match_transformers(saved):
  """A prefill of 12 tokens, then one token at a time, through the cache read in blocks of 4
  slots (the window's first block onwards): the logits transformers computes."""
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  tokens, mask, positions = _batch()
  want = hf_logits(hf, tokens, mask, positions)
  P = 12
  graphdef, state = nnx.split(policy)

  @jax.jit
  def run(state, tokens, mask, positions):
    m = nnx.merge(graphdef, state)
    cache = model_lib.init_cache(m.cfg, 2, T + 3)
    prefill = (tokens[:, :P], positions[:, :P])
    out = m(*prefill, attn_mask=mask[:, :P], cache=cache, cache_index=0, cache_block=4)
    hidden, cache = out.hidden, out.cache

    def step(cache, i):
      tok = jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
      pos = jax.lax.dynamic_slice_in_dim(positions, i, 1, axis=1)
      out = m(tok, pos, cache=cache, cache_index=i, cache_block=4)
      return out.cache, out.hidden[:, 0]

    _, hs = jax.lax.scan(step, cache, jnp.arange(P, T))
    return m.logits(jnp.concatenate([hidden, hs.swapaxes(0, 1)], axis=1))

  got = np.asarray(run(state, tokens, mask, positions))
  np.testing.assert_allclose(got[mask], want[mask], atol=1e-4, rtol=1e-4)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4, 5], [13, 14, 15, 16, 17]]
N = 20  # prompt + response: 29 slots, over three windows


def test_sampler_logprobs_match_the_trainer(saved):
  """The KV-cached sampler's log-probs (the CPU decode reading a window-long slice of each local
  layer's cache, and the scan decode reading blocks of 4 slots) equal a teacher-forced forward's
  (dense and blockwise attention), at a temperature."""
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  prompts = sampler.left_pad(PROMPTS, pad_id=0)
  sp = sampler.SamplingParams(max_new_tokens=N, temperature=0.7, stop_ids=(), pad_id=0)
  graphdef, params = nnx.split(policy)
  run = jax.jit(
    sampler.sample, static_argnums=(0, 5), static_argnames=("unroll_layers", "decode_block")
  )
  key = jax.random.key(0)
  outs = [
    jax.device_get(run(graphdef, params, *prompts, key, sp, unroll_layers=True)),
    jax.device_get(run(graphdef, params, *prompts, key, sp, unroll_layers=False, decode_block=4)),
  ]
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  tokens = jnp.concatenate([prompts[0], outs[0].tokens], axis=1)
  mask = jnp.concatenate([prompts[1], outs[0].mask], axis=1)
  assert tokens.shape[1] > 3 * WINDOW and outs[0].mask.all()
  response = slice(prompts[0].shape[1] - 1, None)
  for impl in ("dense", "blockwise"):
    trainer = nnx.merge(graphdef, params)
    trainer.cfg = architectures.dataclasses.replace(policy.cfg, attention=impl)
    lp = np.asarray(_trainer_logprobs(trainer, tokens, mask, 0.7))[:, response]
    for out in outs:
      np.testing.assert_allclose(out.logprobs, lp, atol=3e-5, rtol=1e-5)


@functools.partial(nnx.jit, static_argnums=3)
def _trainer_logprobs(model, tokens, mask, temperature):
  positions = model_lib.positions_from_mask(mask)
  hidden = model(tokens[:, :-1], positions[:, :-1], attn_mask=mask[:, :-1]).hidden
  return heads_lib.chunked_logprobs(model, hidden, tokens[:, 1:], temperature=temperature)[
    "logprobs"
  ]


def test_paged_engine_matches_the_fixed_batch_sampler(saved):
  """Continuous batching over the paged cache (local layers reading the pages of their window)
  draws what the fixed-batch sampler draws."""
  kind, hf, path = saved
  if kind != "gemma2":
    pytest.skip("one family suffices: the paged path is shared")
  policy = hf_checkpoint.load_model(path)
  graphdef, params = nnx.split(policy)
  sp = sampler.SamplingParams(max_new_tokens=N, stop_ids=(), pad_id=0)
  key = jax.random.key(3)
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=4, page_size=4, chunk=5)
  )
  got = engine(params, PROMPTS, key, group_size=2)
  P = engine.stats["prompt_len"]
  tokens, mask = sampler.left_pad([p for p in PROMPTS for _ in range(2)], pad_id=0, length=P)
  keys = sampler.row_keys(key, np.repeat(np.arange(3), 2), np.tile(np.arange(2), 3))
  want = jax.device_get(
    sampler.sample(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), keys, sp, group_size=2)
  )
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


# -- config.json ---------------------------------------------------------------------------------


def test_gemma3_config_layouts_agree():
  """Hub config.json (rope_theta, rope_local_base_freq, sliding_window_pattern) and
  transformers 5's (rope_parameters per layer type, layer_types) give one ModelConfig."""
  legacy = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 12,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "query_pre_attn_scalar": 16, "sliding_window": 512, "sliding_window_pattern": 6,
    "rope_theta": 1e6, "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
  }  # fmt: skip
  cfg = architectures.config_from_hf(legacy)
  assert cfg.local_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and cfg.qk_norm
  assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
  assert cfg.rope_params == {"rope_type": "linear", "factor": 8.0}
  assert cfg.attn_softcap is None and cfg.final_softcap is None and cfg.tie_word_embeddings
  hf = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "architectures"})
  assert architectures.config_from_hf(hf.to_dict()) == cfg
  assert architectures.config_from_hf(architectures.config_to_hf(cfg)) == cfg


def test_unsupported_gemma_configs_are_named():
  multimodal = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
  with pytest.raises(ValueError, match="only the text model"):
    architectures.config_from_hf(multimodal)
  gemma2 = transformers.Gemma2Config(**_COMMON, hidden_activation="gelu").to_dict()
  with pytest.raises(ValueError, match="hidden_activation='gelu'"):
    architectures.config_from_hf(gemma2)
  with pytest.raises(ValueError, match="local_layers needs a sliding_window"):
    architectures.get("tiny", local_layers=(0,))


# -- chat template ------------------------------------------------------------------------------

# Gemma's turn format: <start_of_turn>{user|model}\n ... <end_of_turn>\n after <bos>; a system
# message goes in front of the first user turn (Gemma has no system role).
GEMMA_TEMPLATE = (
  "{{ bos_token }}{% set first = 0 %}{% set sys = '' %}"
  "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] + '\n\n' %}"
  "{% set first = 1 %}{% endif %}"
  "{% for m in messages[first:] %}"
  "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
  "{{ raise_exception('roles must alternate user/model') }}{% endif %}"
  "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
  "{{ (sys if loop.first else '') + m['content'] | trim }}<end_of_turn>\n"
  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_gemma_chat_template_matches_transformers(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(["What is 12 + 30? The answer is 42.", "user model"] * 20, trainer)
  tok.save(str(tmp_path / "tokenizer.json"))
  config = {
    "chat_template": GEMMA_TEMPLATE, "bos_token": "<bos>", "eos_token": "<eos>",
    "pad_token": "<pad>", "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast",
  }  # fmt: skip
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
  ours = tokenizer.load_tokenizer(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 1 + 1?"},
  ]
  prompt = ours.apply_chat_template(messages)
  assert prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\nWhat is 12 + 30?<end_of_turn>")
  assert prompt.endswith("<start_of_turn>model\n")
  ids = ours.encode(prompt)
  assert ids[0] == ours.bos_id and ids[1] != ours.bos_id  # the template's <bos>, not twice
  assert ours.eos_ids == (1, 4)  # <eos> and generation_config's <end_of_turn>
  with pytest.raises(Exception, match="alternate"):
    ours.apply_chat_template(messages[:2] + messages[1:2])
