"""Parity with transformers: tiny random Llama 3 / Qwen2 / Qwen3 models, loaded and exported."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from gppo_jax import hf_checkpoint, model

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
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 96, size=(2, 21)).astype(np.int32)
  mask = np.ones((2, 21), bool)
  mask[0, :5] = False
  tokens[0, :5] = 0
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def _hf_logits(m, tokens, mask, positions):
  with torch.no_grad():
    out = m(
      input_ids=torch.tensor(tokens, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
      position_ids=torch.tensor(positions, dtype=torch.long),
    )
  return out.logits.float().numpy()


def _our_logits(policy, tokens, mask, positions):
  hidden, _ = policy(jnp.asarray(tokens), jnp.asarray(positions), attn_mask=jnp.asarray(mask))
  return np.asarray(policy.logits(hidden))


def _assert_close_on(mask, got, want, atol=1e-4):
  np.testing.assert_allclose(got[mask], want[mask], atol=atol, rtol=1e-4)


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
  """(kind, HF model, folder) with the model saved by save_pretrained."""
  kind = request.param
  m = _hf_model(kind)
  path = tmp_path_factory.mktemp(kind)
  # One family saved in shards, so the index file path is covered too.
  m.save_pretrained(path, max_shard_size="40KB" if kind == "qwen2-bias" else "5GB")
  return kind, m, path


def test_logits_match_transformers_with_left_padding(saved):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  tokens, mask, positions = _batch()
  if kind == "qwen2-bias":
    assert (path / hf_checkpoint.INDEX_FILE).is_file()
  _assert_close_on(mask, _our_logits(policy, tokens, mask, positions), _hf_logits(hf, *_batch()))


def test_export_reloads_in_transformers(saved, tmp_path):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  out = hf_checkpoint.save_model(policy, tmp_path / "export", source=path, max_shard_size="30KB")
  assert (out / hf_checkpoint.INDEX_FILE).is_file()  # small limit forces shards
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  tokens, mask, positions = _batch()
  _assert_close_on(
    mask, _hf_logits(reloaded.eval(), tokens, mask, positions), _hf_logits(hf, *_batch())
  )
  # And our own loader reads the export back to the same config.
  assert hf_checkpoint.load_model(out).cfg == policy.cfg


def test_kv_cache_prefill_and_steps_match_full_forward(saved):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path)
  tokens, mask, positions = _batch()
  want = _hf_logits(hf, tokens, mask, positions)
  P, T = 12, tokens.shape[1]
  cache = model.init_cache(policy.cfg, 2, T + 3)
  step = jax.jit(lambda tok, pos, c, i: policy(tok, pos, cache=c, cache_index=i))
  hidden, cache = policy(
    jnp.asarray(tokens[:, :P]),
    jnp.asarray(positions[:, :P]),
    attn_mask=jnp.asarray(mask[:, :P]),
    cache=cache,
    cache_index=0,
  )
  hiddens = [hidden]
  for i in range(P, T):
    h, cache = step(tokens[:, i : i + 1], positions[:, i : i + 1], cache, jnp.int32(i))
    hiddens.append(h)
  got = np.asarray(policy.logits(jnp.concatenate(hiddens, axis=1)))
  _assert_close_on(mask, got, want)
  np.testing.assert_array_equal(np.asarray(cache.mask[:, :T]), mask)
  assert not np.asarray(cache.mask[:, T:]).any()


def test_bfloat16_loads_and_runs(saved):
  kind, hf, path = saved
  policy = hf_checkpoint.load_model(path, dtype="bfloat16", param_dtype="bfloat16")
  assert policy.layers.wq[...].dtype == jnp.bfloat16
  tokens, mask, positions = _batch()
  got = _our_logits(policy, tokens, mask, positions)
  assert np.isfinite(got).all()
  want = _hf_logits(hf, tokens, mask, positions)
  assert np.abs(got - want)[mask].mean() < 0.1 * np.abs(want).mean()


def test_bf16_checkpoint_round_trip(tmp_path):
  m = _hf_model("qwen3-qknorm").to(torch.bfloat16)
  m.save_pretrained(tmp_path / "bf16")
  policy = hf_checkpoint.load_model(tmp_path / "bf16")
  assert policy.cfg.param_dtype == "bfloat16"
  out = hf_checkpoint.save_model(policy, tmp_path / "out")
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
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
  with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
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
  a, b = model.config_from_hf(new), model.config_from_hf(old)
  assert a == b and a.rope_theta == 500000.0 and a.rope_params["factor"] == 8.0
  assert a.family == "llama" and not a.attention_bias and a.eos_token_ids == (2,)
