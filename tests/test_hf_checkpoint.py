"""Parity with transformers: tiny random Llama 3 / Qwen2 / Qwen3 models, loaded and exported."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_parity import hf_logits, padded_batch
from safetensors.numpy import load_file, save_file

from gppo_jax import errors
from gppo_jax.models import architectures, hf_checkpoint, model, tokenizer

torch.manual_seed(0)

_COMMON = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
  rms_norm_eps=1e-5,
  bos_token_id=1,
  eos_token_id=2,
  pad_token_id=0,
)
_LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 8,
}

CASES = {
  "llama3-rope-scaling": (
    transformers.LlamaConfig,
    dict(rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, head_dim=8),
  ),
  "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
  "qwen2-bias": (transformers.Qwen2Config, dict(rope_theta=1e6)),
  "qwen3-qknorm": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
}


def _hf_model(kind: str):
  config_cls, extra = CASES[kind]
  cfg = config_cls(**_COMMON, **extra)
  cfg._attn_implementation = "eager"
  m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():  # random everything (norm weights and biases too) so mappings matter
    for name, p in m.named_parameters():
      p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn_like(p))
  return m


def _batch():
  """Two sequences, the first left-padded, with positions per the project convention."""
  return padded_batch(96, 21)


@nnx.jit
def _forward(policy, tokens, mask, positions):
  hidden = policy(tokens, positions, attn_mask=mask).hidden
  return policy.logits(hidden)


def _our_logits(policy, tokens, mask, positions):
  return np.asarray(_forward(policy, tokens, mask, positions))


def _assert_close_on(mask, got, want, atol=1e-4):
  np.testing.assert_allclose(got[mask], want[mask], atol=atol, rtol=1e-4)


# Tied embeddings are covered by qwen3 here and by the tied Llama of the mesh test below.
PARITY_CASES = ["llama3-rope-scaling", "qwen2-bias", "qwen3-qknorm"]


@pytest.fixture(scope="module", params=PARITY_CASES)
def saved(request, tmp_path_factory):
  """(kind, HF model, folder) with the model saved by save_pretrained."""
  kind = request.param
  m = _hf_model(kind)
  path = tmp_path_factory.mktemp(kind)
  # One family saved in shards, so the index file path is covered too.
  m.save_pretrained(path, max_shard_size="40KB" if kind == "qwen2-bias" else "5GB")
  return kind, m, path


@pytest.mark.user_xla
def test_logits_match_transformers_with_left_padding(saved):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  tokens, mask, positions = _batch()
  if kind == "qwen2-bias":
    assert (path / hf_checkpoint.INDEX_FILE).is_file()
  _assert_close_on(mask, _our_logits(policy, tokens, mask, positions), hf_logits(hf, *_batch()))


def test_export_reloads_in_transformers(saved, tmp_path):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  out = hf_checkpoint.save_model(policy, tmp_path / "export", source=path, max_shard_size="30KB")
  assert (out / hf_checkpoint.INDEX_FILE).is_file()  # small limit forces shards
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  tokens, mask, positions = _batch()
  _assert_close_on(
    mask, hf_logits(reloaded.eval(), tokens, mask, positions), hf_logits(hf, *_batch())
  )
  # And our own loader reads the export back to the same config.
  assert hf_checkpoint.load_model(out).cfg == policy.cfg


def test_kv_cache_prefill_and_steps_match_full_forward(saved):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  tokens, mask, positions = _batch()
  want = hf_logits(hf, tokens, mask, positions)
  P, T = 12, tokens.shape[1]
  cache = model.init_cache(policy.cfg, 2, T + 3)
  graphdef, state = nnx.split(policy)

  @jax.jit
  def run(state, tokens, mask, positions, cache):
    m = nnx.merge(graphdef, state)
    prefill = (tokens[:, :P], positions[:, :P])
    out = m(*prefill, attn_mask=mask[:, :P], cache=cache, cache_index=0)
    hidden, cache = out.hidden, out.cache

    def step(cache, i):
      tok = jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
      pos = jax.lax.dynamic_slice_in_dim(positions, i, 1, axis=1)
      out = m(tok, pos, cache=cache, cache_index=i)
      return out.cache, out.hidden[:, 0]

    cache, hs = jax.lax.scan(step, cache, jnp.arange(P, T))
    return m.logits(jnp.concatenate([hidden, hs.swapaxes(0, 1)], axis=1)), cache

  got, cache = run(state, tokens, mask, positions, cache)
  got = np.asarray(got)
  _assert_close_on(mask, got, want)
  np.testing.assert_array_equal(np.asarray(cache.mask[:, :T]), mask)
  assert not np.asarray(cache.mask[:, T:]).any()


@pytest.mark.parametrize("kind", ["llama3-rope-scaling", "qwen3-qknorm"])
def test_bfloat16_loads_and_runs(kind, tmp_path):
  hf, path = _hf_model(kind), tmp_path / kind
  hf.save_pretrained(path)
  policy = hf_checkpoint.load_model(path, dtype="bfloat16", param_dtype="bfloat16")
  assert policy.layers.wq[...].dtype == jnp.bfloat16
  tokens, mask, positions = _batch()
  got = _our_logits(policy, tokens, mask, positions)
  assert np.isfinite(got).all()
  want = hf_logits(hf, tokens, mask, positions)
  assert np.abs(got - want)[mask].mean() < 0.1 * np.abs(want).mean()


def test_bf16_checkpoint_round_trip(tmp_path):
  m = _hf_model("qwen3-qknorm").to(torch.bfloat16)
  m.save_pretrained(tmp_path / "bf16")
  policy = hf_checkpoint.load_model(tmp_path / "bf16")
  assert policy.cfg.param_dtype == "bfloat16"
  out = hf_checkpoint.save_model(policy, tmp_path / "out")
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
  gen = transformers.GenerationConfig.from_pretrained(out)
  assert gen.eos_token_id == 2 and gen.pad_token_id == 0
  a = load_file(str(tmp_path / "bf16" / "model.safetensors"))
  b = load_file(str(out / "model.safetensors"))
  assert set(b) <= set(a)
  for name in b:  # bit-exact weights after a load/export round trip
    np.testing.assert_array_equal(a[name].view(np.uint16), b[name].view(np.uint16))


# -- errors name the file and the tensor ------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path):
  _hf_model("llama-tied").save_pretrained(tmp_path / "m")
  return tmp_path / "m"


def test_missing_config_names_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf_checkpoint.load_model(tmp_path)


def test_missing_weights_named(llama_dir):
  (llama_dir / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="safetensors"):
    hf_checkpoint.load_model(llama_dir)


def test_unknown_architecture(llama_dir):
  cfg = json.loads((llama_dir / "config.json").read_text())
  cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
  (llama_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
    hf_checkpoint.load_model(llama_dir)


def test_shape_mismatch_names_file_and_tensor(llama_dir):
  cfg = json.loads((llama_dir / "config.json").read_text())
  cfg["intermediate_size"] = 40
  (llama_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"model\.safetensors.*mlp\.\w+_proj\.weight.*shape"):
    hf_checkpoint.load_model(llama_dir)


def test_missing_tensor_named(llama_dir):
  f = llama_dir / "model.safetensors"
  tensors = load_file(str(f))
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  save_file(tensors, str(f), metadata={"format": "pt"})
  with pytest.raises(errors.CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
    hf_checkpoint.load_model(llama_dir)


def test_config_from_hf_reads_both_rope_layouts():
  new = {
    "architectures": ["LlamaForCausalLM"],
    **_COMMON,
    "num_hidden_layers": 2,
    "rope_parameters": {"rope_theta": 500000.0, **_LLAMA3_ROPE},
  }
  old = {**new, "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "type": "llama3"}}
  del old["rope_parameters"]
  a, b = architectures.config_from_hf(new), architectures.config_from_hf(old)
  assert a == b and a.rope_theta == 500000.0 and a.rope_params["factor"] == 8.0
  assert a.family == "llama" and not a.attention_bias and a.eos_token_ids == (2,)


# -- tokenizer ----------------------------------------------------------------------------------

CHATML = (
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A byte-level BPE tokenizer trained here on a few lines, saved as HF tokenizer files."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  corpus = ["What is 12 + 30? The answer is 42.", "def f(x):\n    return x * 2", "hello world"]
  tok.train_from_iterator(corpus * 20, trainer)
  path = tmp_path_factory.mktemp("tok")
  tok.save(str(path / "tokenizer.json"))
  config = {
    "chat_template": CHATML,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
    "tokenizer_class": "PreTrainedTokenizerFast",
  }
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  return path


MESSAGES = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "What is 12 + 30? ünïcødé ✓"},
]


def test_tokenizer_round_trip_and_special_ids(tokenizer_dir):
  tok = tokenizer.load_tokenizer(tokenizer_dir)
  text = "def f(x):\n    return 12 + 30  # ünïcødé ✓"
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.eos_id == tok.token_to_id("<|im_end|>") == 2
  assert tok.pad_id == tok.token_to_id("<|endoftext|>") == 0
  assert tok.eos_ids == (2, 0)
  assert tok.encode("<|im_start|>user")[0] == tok.token_to_id("<|im_start|>")


def test_chat_template_matches_transformers(tokenizer_dir):
  tok = tokenizer.load_tokenizer(tokenizer_dir)
  prompt = tok.apply_chat_template(MESSAGES)
  assert prompt.endswith("<|im_start|>assistant\n") and "Be brief." in prompt
  hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  assert prompt == want
  assert tok.encode(prompt) == hf.encode(want, add_special_tokens=False)
  assert tok.decode(tok.encode(prompt), skip_special=False) == prompt
  assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_missing_tokenizer_file_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    tokenizer.load_tokenizer(tmp_path)


def test_export_copies_tokenizer_and_load_pretrained(tokenizer_dir, tmp_path):
  src = tmp_path / "src"
  _hf_model("llama-tied").save_pretrained(src)
  for f in tokenizer_dir.iterdir():
    (src / f.name).write_bytes(f.read_bytes())
  policy, tok = hf_checkpoint.load_pretrained(src)
  out = hf_checkpoint.save_model(policy, tmp_path / "out", source=src)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert (out / name).read_bytes() == (src / name).read_bytes()
  assert tokenizer.load_tokenizer(out).apply_chat_template(MESSAGES) == tok.apply_chat_template(
    MESSAGES
  )


def test_load_onto_mesh_shards_parameters_and_keeps_logits(llama_dir):
  from gppo_jax.models import partitioning

  auto = (jax.sharding.AxisType.Auto,) * 3
  mesh = jax.make_mesh((2, 2, 2), partitioning.MESH_AXES, axis_types=auto)
  policy = hf_checkpoint.load_model(llama_dir, mesh=mesh)
  assert policy.layers.w_up[...].sharding.spec == jax.P(None, "fsdp", "tensor")
  assert policy.embed[...].sharding.spec == jax.P("tensor", "fsdp")
  tokens, mask, positions = _batch()
  hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager")
  want = hf_logits(hf.eval(), tokens, mask, positions)
  _assert_close_on(mask, _our_logits(policy, tokens, mask, positions), want)


def test_export_writes_back_a_null_pad_token_and_float16(tmp_path, monkeypatch):
  """A source without a pad token comes back without one (not as 0 or the eos id), and float16
  weights are loaded as float32 with a warning, then written back as float16, bit for bit."""
  config_cls, extra = CASES["qwen2-bias"]
  cfg = config_cls(**{**_COMMON, "pad_token_id": None}, **extra)
  hf = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(torch.float16)
  src = tmp_path / "fp16"
  hf.save_pretrained(src)
  source_cfg = json.loads((src / "config.json").read_text())
  assert source_cfg.get("pad_token_id") is None
  seen = []
  monkeypatch.setattr(hf_checkpoint.log, "warning", lambda msg, *a: seen.append(msg % a))
  policy = hf_checkpoint.load_model(src)
  assert policy.cfg.param_dtype == "float32" and policy.cfg.pad_token_id == 2  # eos stands in
  (msg,) = seen
  assert "float16 weights are loaded as dtype=float32" in msg and str(src) in msg
  out = hf_checkpoint.save_model(policy, tmp_path / "out", source=src)
  written = json.loads((out / "config.json").read_text())
  assert written.get("pad_token_id") is None and written["torch_dtype"] == "float16"
  assert transformers.AutoConfig.from_pretrained(out).pad_token_id is None
  assert transformers.GenerationConfig.from_pretrained(out).pad_token_id is None
  a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
  assert set(b) <= set(a) and all(b[n].dtype == np.float16 for n in b)
  for name in b:
    np.testing.assert_array_equal(a[name].view(np.uint16), b[name].view(np.uint16))
  # An explicit choice of both dtypes is no surprise: no warning; the export dtype stays ours.
  seen.clear()
  bf16 = hf_checkpoint.load_model(src, dtype="bfloat16", param_dtype="bfloat16")
  assert not seen and bf16.cfg.param_dtype == "bfloat16"
  # Without a source there is nothing to be faithful to: the model's pad id is written.
  assert (
    json.loads((hf_checkpoint.save_model(policy, tmp_path / "plain") / "config.json").read_text())[
      "pad_token_id"
    ]
    == 2
  )
