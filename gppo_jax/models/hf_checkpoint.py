"""Hugging Face checkpoints in and out: config.json + (sharded) safetensors <-> Transformer.

Reads a local folder as transformers writes it (config.json, model.safetensors or shards with
model.safetensors.index.json, tokenizer files) and writes a trained policy back in the same
layout, so transformers and vLLM load it unchanged. Weights stream tensor by tensor through
numpy; with a mesh each parameter goes straight to its sharded layout. The weight mapping is
here; the config.json <-> ModelConfig mapping is in `architectures.py`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from gppo_jax import errors, files
from gppo_jax.models import lora as lora_lib
from gppo_jax.models import model as model_lib
from gppo_jax.models import partitioning
from gppo_jax.models import tokenizer as tokenizer_lib
from gppo_jax.models.architectures import (
  ModelConfig,
  config_from_hf,
  config_to_hf,
  hf_rope_parameters,
)
from gppo_jax.models.model import Transformer

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
  "chat_template.jinja",
  "chat_template.json",
  "generation_config.json",
)
# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# Checkpoint dtypes (config.json torch_dtype / dtype) that have no ModelConfig dtype: loaded as
# float32 (exact) with a warning, and written back in their own dtype by save_model(source=...).
_WIDENED_DTYPES = ("float16",)

log = logging.getLogger("gppo_jax")


@dataclasses.dataclass(frozen=True)
class _Spec:
  """How one of our parameters maps to Hugging Face tensor(s).

  `hf` is the tensor name (with "{i}" for per-layer tensors, which we stack on axis 0, and
  "{e}" for per-expert ones, stacked on the axis after it); `hf_shape(cfg)` its shape;
  `to_ours` / `to_hf` convert one tensor between layouts. `layers(cfg)`: the layers that have
  the tensor where only some do (a mixture of experts' dense or expert layers); the others'
  slices are zeros, never written.
  """

  hf: str
  hf_shape: Callable[[ModelConfig], tuple[int, ...]]
  to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
  to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
  layers: Callable[[ModelConfig], tuple[int, ...]] | None = None


_same = lambda x, c: x
_T = lambda x, c: x.T
_L = "model.layers.{i}."


def _proj_in(heads: Callable[[ModelConfig], int]) -> tuple:
  """q/k/v_proj [heads*Dh, D] <-> ours [D, heads, Dh]."""
  return (
    lambda c: (heads(c) * c.head_dim, c.hidden_size),
    lambda x, c: x.T.reshape(c.hidden_size, heads(c), c.head_dim),
    lambda x, c: x.reshape(c.hidden_size, -1).T,
  )


def _bias(heads: Callable[[ModelConfig], int]) -> tuple:
  return (
    lambda c: (heads(c) * c.head_dim,),
    lambda x, c: x.reshape(heads(c), c.head_dim),
    lambda x, c: x.reshape(-1),
  )


_H = lambda c: c.num_heads
_K = lambda c: c.num_kv_heads
_D = lambda c: (c.hidden_size,)


def param_specs(cfg: ModelConfig) -> dict[tuple[str, ...], _Spec]:
  """Our parameter paths (as in nnx.state) -> how each maps to Hugging Face tensors."""
  specs = {
    ("embed",): _Spec(
      "model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size), _same, _same
    ),
    ("final_norm",): _Spec("model.norm.weight", _D, _same, _same),
    ("layers", "attn_norm"): _Spec(_L + "input_layernorm.weight", _D, _same, _same),
    ("layers", "wq"): _Spec(_L + "self_attn.q_proj.weight", *_proj_in(_H)),
    ("layers", "wk"): _Spec(_L + "self_attn.k_proj.weight", *_proj_in(_K)),
    ("layers", "wv"): _Spec(_L + "self_attn.v_proj.weight", *_proj_in(_K)),
    ("layers", "wo"): _Spec(
      _L + "self_attn.o_proj.weight",
      lambda c: (c.hidden_size, c.num_heads * c.head_dim),
      lambda x, c: x.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
      lambda x, c: x.reshape(-1, c.hidden_size).T,
    ),
    # Llama's post_attention_layernorm is the MLP's input norm; Gemma names that one
    # pre_feedforward_layernorm and its post_attention_layernorm is the attention output's.
    ("layers", "mlp_norm"): _Spec(
      _L + ("pre_feedforward" if cfg.post_norms else "post_attention") + "_layernorm.weight",
      _D,
      _same,
      _same,
    ),
  }
  if cfg.has_dense_mlp:
    dense = _dense_layers if cfg.is_moe else None
    specs[("layers", "w_gate")] = _Spec(
      _L + "mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), _T, _T, dense
    )
    specs[("layers", "w_up")] = _Spec(
      _L + "mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), _T, _T, dense
    )
    specs[("layers", "w_down")] = _Spec(
      _L + "mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size), _T, _T, dense
    )
  if cfg.is_moe:  # Qwen3-MoE: the router mlp.gate [E, D], each expert's own projections
    e = _L + "mlp.experts.{e}."
    up = lambda c: (c.moe_intermediate_size, c.hidden_size)
    down = lambda c: (c.hidden_size, c.moe_intermediate_size)
    specs[("layers", "router")] = _Spec(
      _L + "mlp.gate.weight", lambda c: (c.num_experts, c.hidden_size), _T, _T, _moe_layers
    )
    specs[("layers", "moe_gate")] = _Spec(e + "gate_proj.weight", up, _T, _T, _moe_layers)
    specs[("layers", "moe_up")] = _Spec(e + "up_proj.weight", up, _T, _T, _moe_layers)
    specs[("layers", "moe_down")] = _Spec(e + "down_proj.weight", down, _T, _T, _moe_layers)
  if cfg.attention_bias:
    specs[("layers", "bq")] = _Spec(_L + "self_attn.q_proj.bias", *_bias(_H))
    specs[("layers", "bk")] = _Spec(_L + "self_attn.k_proj.bias", *_bias(_K))
    specs[("layers", "bv")] = _Spec(_L + "self_attn.v_proj.bias", *_bias(_K))
  if cfg.qk_norm:
    hd = lambda c: (c.head_dim,)
    specs[("layers", "q_norm")] = _Spec(_L + "self_attn.q_norm.weight", hd, _same, _same)
    specs[("layers", "k_norm")] = _Spec(_L + "self_attn.k_norm.weight", hd, _same, _same)
  if cfg.post_norms:
    specs[("layers", "attn_post_norm")] = _Spec(
      _L + "post_attention_layernorm.weight", _D, _same, _same
    )
    specs[("layers", "mlp_post_norm")] = _Spec(
      _L + "post_feedforward_layernorm.weight", _D, _same, _same
    )
  if not cfg.tie_word_embeddings:
    specs[("lm_head",)] = _Spec("lm_head.weight", lambda c: (c.vocab_size, c.hidden_size), _T, _T)
  return specs


def _dense_layers(cfg: ModelConfig) -> tuple[int, ...]:
  return tuple(l for l in range(cfg.num_layers) if not cfg.layer_is_moe(l))


def _moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
  return tuple(l for l in range(cfg.num_layers) if cfg.layer_is_moe(l))


def _spec_layers(spec: _Spec, cfg: ModelConfig) -> tuple[int, ...]:
  """The layers that have the (per-layer) tensor."""
  return tuple(range(cfg.num_layers)) if spec.layers is None else spec.layers(cfg)


def _hf_names(spec: _Spec, cfg: ModelConfig) -> list[str]:
  if "{e}" in spec.hf:
    experts = range(cfg.num_experts)
    return [spec.hf.format(i=i, e=e) for i in _spec_layers(spec, cfg) for e in experts]
  if "{i}" in spec.hf:
    return [spec.hf.format(i=i) for i in _spec_layers(spec, cfg)]
  return [spec.hf]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_config(path: str | Path) -> dict[str, Any]:
  """The parsed config.json of a checkpoint folder (a UserError naming the file if bad)."""
  path = Path(path)
  if not path.is_dir():
    raise errors.MissingFileError(f"{path}: no such folder (a Hugging Face checkpoint folder)")
  f = path / CONFIG_FILE
  if not f.is_file():
    raise errors.MissingFileError(
      f"{f}: missing; a Hugging Face checkpoint folder needs config.json"
    )
  return tokenizer_lib.read_json_object(f)


def source_dtype(hf_config: dict[str, Any]) -> str | None:
  """The weights' dtype a config.json states (torch_dtype, or transformers 5's dtype)."""
  dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
  return str(dtype) if dtype else None


def model_config(path: str | Path, **overrides) -> ModelConfig:
  """The ModelConfig of a checkpoint folder; unsupported settings name its config.json.

  A float16 checkpoint has no dtype of ours: unless `overrides` set both dtypes it is loaded as
  float32 (every float16 value is exact in float32) and a warning says so."""
  hf = read_config(path)
  try:
    cfg = config_from_hf(hf, **overrides)
  except (ValueError, KeyError, TypeError) as e:
    what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
    what = what.removeprefix(f"{CONFIG_FILE}: ")
    raise errors.CheckpointError(f"{Path(path) / CONFIG_FILE}: {what}") from e
  stored = source_dtype(hf)
  if stored in _WIDENED_DTYPES and not {"dtype", "param_dtype"} <= set(overrides):
    log.warning(
      "%s: %s weights are loaded as dtype=%s, param_dtype=%s (%s is not a dtype of ours; "
      "model.dtype / model.param_dtype pick float32 or bfloat16); an export with this folder "
      "as source writes %s again",
      Path(path) / CONFIG_FILE,
      stored,
      cfg.dtype,
      cfg.param_dtype,
      stored,
      stored,
    )
  return cfg


class SafetensorsReader:
  """Tensors by name from one or several safetensors files of a checkpoint folder."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    index = self.path / INDEX_FILE
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise errors.CheckpointError(
          f"{index}: not a safetensors index (needs 'weight_map'): {e}"
        ) from e
      files = sorted(set(weight_map.values()))
    else:
      files = [SINGLE_FILE] if (self.path / SINGLE_FILE).is_file() else []
      files = files or sorted(p.name for p in self.path.glob("*.safetensors"))
      if not files:
        raise errors.MissingFileError(
          f"{self.path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files"
        )
      weight_map = None
    self._handles = {}
    for name in files:
      f = self.path / name
      if not f.is_file():
        raise errors.MissingFileError(f"{f}: listed in {INDEX_FILE} but missing")
      try:
        self._handles[name] = safe_open(str(f), framework="numpy")
      except (SafetensorError, OSError) as e:
        raise _unreadable(f, e) from e
    if weight_map is None:
      weight_map = {k: name for name, h in self._handles.items() for k in h.keys()}
    self.weight_map: dict[str, str] = weight_map

  def names(self) -> list[str]:
    return list(self.weight_map)

  def file_of(self, name: str) -> str:
    return self.weight_map[name]

  def shape(self, name: str) -> tuple[int, ...]:
    file = self._file(name)
    try:
      return tuple(self._handles[file].get_slice(name).get_shape())
    except (SafetensorError, OSError) as e:
      raise _unreadable(self.path / file, e, name) from e

  def get(self, name: str) -> np.ndarray:
    file = self._file(name)
    try:
      return self._handles[file].get_tensor(name)
    except (SafetensorError, OSError) as e:
      raise _unreadable(self.path / file, e, name) from e

  def _file(self, name: str) -> str:
    if name not in self.weight_map:
      files = ", ".join(sorted(self._handles))
      raise errors.CheckpointError(f"{self.path}: tensor {name!r} not found in {files}")
    return self.weight_map[name]


def _unreadable(f: Path, e: Exception, tensor: str | None = None) -> errors.CheckpointError:
  """The error for a safetensors file the library cannot read (truncated, corrupt)."""
  what = f" (tensor {tensor!r})" if tensor else ""
  return errors.CheckpointError(
    f"{f}: unreadable safetensors file{what}: {e}; it may be truncated or corrupt (re-download it)"
  )


def _load_param(reader: SafetensorsReader, spec: _Spec, cfg: ModelConfig, dtype) -> np.ndarray:
  want = spec.hf_shape(cfg)
  parts = []
  for name in _hf_names(spec, cfg):
    got = reader.shape(name)
    if got != want:
      raise errors.CheckpointError(
        f"{reader.path / reader.file_of(name)}: tensor {name!r} has shape {got}, "
        f"expected {want} from {CONFIG_FILE}"
      )
    parts.append(spec.to_ours(reader.get(name), cfg).astype(dtype))
  if "{i}" not in spec.hf:
    return parts[0]
  if "{e}" in spec.hf:  # [layers * experts] -> per layer [E, ...]
    E = cfg.num_experts
    parts = [np.stack(parts[j : j + E]) for j in range(0, len(parts), E)]
  layers = _spec_layers(spec, cfg)
  if len(layers) == cfg.num_layers:
    return np.stack(parts)
  out = np.zeros((cfg.num_layers, *parts[0].shape), dtype)  # the layers without it: zeros
  for l, part in zip(layers, parts, strict=True):
    out[l] = part
  return out


def _check_unexpected(reader: SafetensorsReader, cfg: ModelConfig) -> None:
  expected = {n for s in param_specs(cfg).values() for n in _hf_names(s, cfg)}
  if cfg.tie_word_embeddings:
    expected.add("lm_head.weight")  # some exporters write the tied head anyway
  extra = [n for n in reader.names() if n not in expected and not _IGNORED.match(n)]
  if extra:
    shown = ", ".join(f"{n} ({reader.file_of(n)})" for n in sorted(extra)[:5])
    raise errors.CheckpointError(
      f"{reader.path}: {len(extra)} tensor(s) not used by a {cfg.family} model with "
      f"{cfg.num_layers} layers: {shown}"
    )


def load_model(
  path: str | Path,
  *,
  mesh: Mesh | None = None,
  rules: partitioning.Rules = partitioning.DEFAULT_RULES,
  lora_seed: int = 0,
  **overrides,
) -> Transformer:
  """A Transformer with the weights of a Hugging Face checkpoint folder.

  `overrides` replace ModelConfig fields (e.g. dtype="bfloat16", param_dtype="float32").
  With `mesh`, each parameter is placed in its sharded layout as it is read. With LoRA
  (overrides lora_rank > 0) the folder's weights are the base and fresh adapters (seeded by
  lora_seed) are added.
  """
  path = Path(path)
  cfg = model_config(path, **overrides)
  if cfg.lora_rank:
    base = load_model(path, mesh=mesh, rules=rules, **{**overrides, "lora_rank": 0})
    graphdef, params = model_lib.with_lora(cfg, nnx.state(base), lora_seed)
    if mesh is not None:
      params = jax.device_put(params, partitioning.state_shardings(params, mesh, rules))
    return nnx.merge(graphdef, params)
  reader = SafetensorsReader(path)
  _check_unexpected(reader, cfg)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  shardings = partitioning.state_shardings(state, mesh, rules) if mesh is not None else None
  specs = param_specs(cfg)
  flat = dict(nnx.to_flat_state(state))
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  if set(flat) != set(specs):
    raise RuntimeError(f"model parameters {sorted(flat)} != mapped {sorted(specs)}")
  for key, var in flat.items():
    target = var.get_value()
    arr = _load_param(reader, specs[key], cfg, target.dtype)
    assert arr.shape == target.shape, (key, arr.shape, target.shape)
    if mesh is None:
      value = jnp.asarray(arr)
    else:
      sharding = flat_shardings[key].get_value()
      value = jax.make_array_from_callback(arr.shape, sharding, lambda idx, a=arr: a[idx])
    var.set_value(value)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_pretrained(path: str | Path, **kwargs):
  """(model, tokenizer) from a Hugging Face folder; kwargs go to load_model."""
  from gppo_jax.models.tokenizer import load_tokenizer

  return load_model(path, **kwargs), load_tokenizer(path)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _parse_size(size: int | str) -> int:
  if isinstance(size, int):
    return size
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
  if not m:
    raise ValueError(f"max_shard_size={size!r}; use bytes or e.g. '5GB', '500MB'")
  unit = (m.group(2) or "B").upper()
  mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
  mult["GIB"] = 2**30
  return int(float(m.group(1)) * mult[unit])


def hf_tensors(model: Transformer, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
  """(Hugging Face name, numpy tensor) pairs of the model's weights, in checkpoint order. LoRA
  adapters are merged into their weights (`lora.merge_lora_weights`)."""
  cfg = model.cfg
  np_dtype = jnp.dtype(dtype or cfg.param_dtype)
  flat = {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  if cfg.lora_rank:
    merged = lora_lib.merge_lora_weights(cfg, model.layers.arrays())
    flat.update({("layers", name): merged[name] for name in cfg.lora_weights})
  for key, spec in param_specs(cfg).items():
    arr = np.asarray(jax.device_get(flat[key]))
    if "{e}" in spec.hf:
      for i in _spec_layers(spec, cfg):
        for e in range(cfg.num_experts):
          tensor = spec.to_hf(arr[i, e], cfg).astype(np_dtype)
          yield spec.hf.format(i=i, e=e), np.ascontiguousarray(tensor)
    elif "{i}" in spec.hf:
      for i in _spec_layers(spec, cfg):
        yield spec.hf.format(i=i), np.ascontiguousarray(spec.to_hf(arr[i], cfg).astype(np_dtype))
    else:
      yield spec.hf, np.ascontiguousarray(spec.to_hf(arr, cfg).astype(np_dtype))


def _hf_config(cfg: ModelConfig, dtype: str, base: dict[str, Any] | None) -> dict[str, Any]:
  out = dict(base or {})
  ours = config_to_hf(cfg)
  ours["torch_dtype"] = dtype
  if base is not None and base.get("pad_token_id") is None:
    # The source has no pad token (null or absent); ours is a stand-in (eos or 0) for padding
    # our own batches, not a setting to hand to transformers or vLLM.
    ours.pop("pad_token_id")
  out.update(ours)
  out.pop("dtype", None)
  if "rope_parameters" in out:  # transformers>=5 layout: keep it consistent with ours
    out["rope_parameters"] = hf_rope_parameters(cfg)
  return out


def save_model(
  model: Transformer,
  path: str | Path,
  *,
  source: str | Path | None = None,
  dtype: str | None = None,
  max_shard_size: int | str = "5GB",
) -> Path:
  """Writes the model as a Hugging Face folder loadable by transformers and vLLM.

  config.json is generated from the model (on top of `source`'s config.json when given, so
  unrelated fields survive); weights go to model.safetensors, or to numbered shards with
  model.safetensors.index.json above `max_shard_size`; tokenizer files are copied from `source`.
  dtype: of the written weights; default the model's param_dtype, or a float16 source's float16.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  cfg = model.cfg
  base = read_config(source) if source is not None else None
  if dtype is None and base is not None and source_dtype(base) in _WIDENED_DTYPES:
    dtype = source_dtype(base)  # loaded widened to float32: written back as it came
  dtype = dtype or cfg.param_dtype
  limit = _parse_size(max_shard_size)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, arr in hf_tensors(model, dtype):
    if shards[-1] and size + arr.nbytes > limit:
      shards.append({})
      size = 0
    shards[-1][name] = arr
    size += arr.nbytes
  meta = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], str(path / SINGLE_FILE), metadata=meta)
  else:
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
      save_file(shard, str(path / fname), metadata=meta)
      weight_map.update({k: fname for k in shard})
    total = sum(a.nbytes for s in shards for a in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    files.write_atomic(str(path / INDEX_FILE), json.dumps(index, indent=2) + "\n")
  hf_config = json.dumps(_hf_config(cfg, dtype, base), indent=2) + "\n"
  files.write_atomic(str(path / CONFIG_FILE), hf_config)
  if source is not None:
    for fname in TOKENIZER_FILES:
      src = Path(source) / fname
      if src.is_file() and src.resolve() != (path / fname).resolve():
        shutil.copyfile(src, path / fname)
  if not (path / "generation_config.json").is_file():  # so generate() and vLLM stop on eos
    pad = cfg.pad_token_id if base is None or base.get("pad_token_id") is not None else None
    gen = {"bos_token_id": cfg.bos_token_id, "pad_token_id": pad}
    eos = list(cfg.eos_token_ids)
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    files.write_atomic(str(path / "generation_config.json"), json.dumps(gen, indent=2) + "\n")
  return path


# --------------------------------------------------------------------------------------------
# LoRA adapters in PEFT's format
# --------------------------------------------------------------------------------------------

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
# Our adapted layer weights -> the Hugging Face module each one is (PEFT's target_modules).
_PEFT_MODULES = {
  "wq": "self_attn.q_proj",
  "wk": "self_attn.k_proj",
  "wv": "self_attn.v_proj",
  "wo": "self_attn.o_proj",
  "w_gate": "mlp.gate_proj",
  "w_up": "mlp.up_proj",
  "w_down": "mlp.down_proj",
}


def peft_tensors(model: Transformer) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT name, float32 tensor) of each LoRA adapter: base_model.model.model.layers.{i}.
  <module>.lora_A.weight [r, in] and .lora_B.weight [out, r], in/out flattened as the Hugging
  Face weight [out, in] of that module is."""
  cfg = model.cfg
  stacked = model.layers.arrays()
  for i in range(cfg.num_layers):
    for name in cfg.lora_weights:
      a = np.asarray(jax.device_get(stacked[name + lora_lib.LORA_A][i]), np.float32)
      b = np.asarray(jax.device_get(stacked[name + lora_lib.LORA_B][i]), np.float32)
      prefix = f"base_model.model.model.layers.{i}.{_PEFT_MODULES[name]}"
      yield prefix + ".lora_A.weight", np.ascontiguousarray(a.reshape(-1, cfg.lora_rank).T)
      yield prefix + ".lora_B.weight", np.ascontiguousarray(b.reshape(cfg.lora_rank, -1).T)


def save_peft_adapter(model: Transformer, path: str | Path, *, base_model: str | None = None):
  """Writes the model's LoRA adapters as a PEFT adapter folder (adapter_config.json +
  adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base model
  (`base_model`: its folder or hub name, recorded in the config). Returns the folder."""
  cfg = model.cfg
  if not cfg.lora_rank:
    raise ValueError("save_peft_adapter: the model has no LoRA adapters (lora_rank=0)")
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(dict(peft_tensors(model)), str(path / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
  config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": None if base_model is None else str(base_model),
    "r": cfg.lora_rank,
    "lora_alpha": cfg.lora_alpha,
    "lora_dropout": cfg.lora_dropout,
    "target_modules": sorted(_PEFT_MODULES[w].split(".")[-1] for w in cfg.lora_weights),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "modules_to_save": None,
  }
  files.write_atomic(str(path / PEFT_CONFIG_FILE), json.dumps(config, indent=2) + "\n")
  return path
