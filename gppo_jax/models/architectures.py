"""The policy's architecture: `ModelConfig`, the named architectures, the config.json mapping.

`ModelConfig` is the frozen, hashable shape and numerics of the transformer in `model.py`.
`ARCHITECTURES` names ready-made configurations (the config field `model.preset` picks one;
`get(name, **overrides)` returns it). `config_from_hf` / `config_to_hf` translate a Hugging Face
config.json (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 text) to and from a
`ModelConfig`; the weight mapping lives in `hf_checkpoint.py`. Imports jax, never flax: nothing
here builds a model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gppo_jax import errors
from gppo_jax.models import attention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3")
# How a mixture-of-experts layer runs its experts (ModelConfig.moe_dispatch): "sorted" sorts the
# token-expert pairs by expert and runs each expert on its own tokens only (`jax.lax.ragged_dot`:
# k experts' FLOPs per token); "dense" runs every expert on every token and weights the outputs
# by the (mostly zero) combine weights: E experts' FLOPs, the simple reference. Both are exact.
MOE_DISPATCH = ("sorted", "dense")
HIDDEN_ACTS = ("silu", "gelu_tanh")  # the MLP gate: SwiGLU, or GeGLU (tanh-approximated GELU)
ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION = attention.IMPLEMENTATIONS  # ModelConfig.attention: attention.py's implementations
# Rematerialisation of each layer under grad: "full" keeps only the layer input (least memory);
# "attention" also keeps the attention's output and what its backward needs (attention.SAVED_NAMES:
# blockwise's log-sum-exp, dense's probabilities up to attention.DENSE_SAVED_MAX_KEYS keys; O(T)
# per layer), so the backward does not rerun the attention forward (with cuDNN or splash
# attention it is "full"); "dots" keeps the layer input and weight-matmul outputs; "none" keeps
# everything (most memory). "auto" (REMAT_CHOICES) picks one per update shape: `layer_plan`.
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "attention": jax.checkpoint_policies.save_only_these_names(*attention.SAVED_NAMES),
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_CHOICES = ("auto", *REMAT_POLICIES)  # = ModelConfig.remat's values
# remat "auto" on CPU: no remat, layers unrolled, while the update's activations without remat
# (`no_remat_bytes`) stay within this (docs/performance.md, Rematerialisation).
# Earns its place: benchmarks/train_step.py tiny shape ~1.9x against "attention" scanned.
CPU_NO_REMAT_MAX_BYTES = 1 << 30
# LoRA: the projections an adapter may wrap (ModelConfig.lora_targets names them) -> the layer
# weight each one is (model.Layers), in the order their dropout keys are folded in.
LORA_PROJECTIONS = {
  "q": "wq",
  "k": "wk",
  "v": "wv",
  "o": "wo",
  "gate": "w_gate",
  "up": "w_up",
  "down": "w_down",
}
LORA_ALL = "|".join(LORA_PROJECTIONS)


def lora_targets_problem(targets) -> str | None:
  """Why `targets` is not a LoRA target pattern (a regular expression fully matching at least
  one of LORA_PROJECTIONS), or None when it is one."""
  if not isinstance(targets, str):
    return f"a regular expression over {', '.join(LORA_PROJECTIONS)}"
  try:
    pattern = re.compile(targets)
  except re.error as e:
    return f"a valid regular expression ({e})"
  if not any(pattern.fullmatch(name) for name in LORA_PROJECTIONS):
    return f"a regular expression fully matching one or more of {', '.join(LORA_PROJECTIONS)}"
  return None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the transformer. Frozen and hashable: usable as a static jit arg."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None  # sorted (key, value) pairs of HF's rope_scaling dict
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # q/k/v bias (Qwen2 / Qwen2.5)
  qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int = 0
  family: str = "llama"  # Hugging Face architecture written on export: one of FAMILIES
  remat: str = "auto"  # what a layer keeps for the backward pass: REMAT_CHOICES (`layer_plan`)
  # Attention of the training forward and the prefill (attention.py): "auto" (cuDNN on GPU,
  # splash on TPU, dense or blockwise on CPU by length), "dense", "blockwise", "cudnn", "splash".
  attention: str = "auto"
  # The decoder layers as one scanned layer (compiles once, however deep the model) or unrolled
  # (each layer compiled separately: a longer compile for a somewhat faster update step;
  # docs/performance.md).
  scan_layers: bool = True
  # Std of the normal init (HF's initializer_range). 0.02 suits wide models; the tiny char
  # architectures use a larger one, without which attention stays uniform for hundreds of steps.
  initializer_range: float = 0.02
  # Gemma's pieces (defaults: Llama / Qwen). hidden_act: the MLP gate (HIDDEN_ACTS).
  hidden_act: str = "silu"
  norm_plus_one: bool = False  # RMSNorm scales by (1 + w), in float32 (Gemma)
  post_norms: bool = False  # also an RMSNorm on the attention's and the MLP's outputs (Gemma)
  embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the compute dtype (Gemma)
  # Attention scores q k^T * query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
  query_pre_attn_scalar: float | None = None
  attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
  final_softcap: float | None = None  # the same on the output logits (before any temperature)
  # Sliding-window (local) attention: the layers in `local_layers` attend to the keys at most
  # sliding_window - 1 positions back (as transformers' sliding_window); the others globally.
  sliding_window: int | None = None
  local_layers: tuple[int, ...] = ()
  # RoPE base of the local layers (Gemma 3: rope_local_base_freq, no scaling); None: rope_theta
  # and rope_scaling as the global layers.
  rope_local_theta: float | None = None
  # LoRA (config model.lora): rank 0 = off. With rank r > 0 each projection whose name
  # (LORA_PROJECTIONS: q, k, v, o, gate, up, down) fully matches the regular expression
  # lora_targets gets adapters A [in, r] and B [r, out]: y = x W + (alpha / r) dropout(x) A B.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: str = LORA_ALL
  lora_dropout: float = 0.0
  # Mixture of experts (Qwen3-MoE): num_experts > 0 replaces the MLP of every layer not in
  # dense_layers by num_experts SwiGLU experts of moe_intermediate_size, stacked [E, ...], and a
  # router: softmax over the experts in float32, the num_experts_per_tok most probable per token,
  # their probabilities renormalised to sum to one when norm_topk_prob (`moe.moe_mlp`).
  # dense_layers keep the dense MLP of intermediate_size (HF's mlp_only_layers and
  # decoder_sparse_step). LoRA adapts only the attention of such a model.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  dense_layers: tuple[int, ...] = ()
  moe_dispatch: str = "sorted"  # MOE_DISPATCH
  # The planner only (plan.py compiles on CPU for GPU / TPU targets): the sorted dispatch's
  # ragged products traced as one product of the same shapes (`moe._ragged_dot`), as a native
  # ragged_dot holds them; not for running a model.
  ragged_dot_stand_in: bool = False

  def __post_init__(self):
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; valid: {sorted(DTYPES)}")
    if self.remat not in REMAT_CHOICES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; valid: {REMAT_CHOICES}")
    if self.attention not in ATTENTION:
      raise ValueError(f"ModelConfig.attention={self.attention!r}; valid: {ATTENTION}")
    if self.family not in FAMILIES:
      raise ValueError(f"ModelConfig.family={self.family!r}; valid: {FAMILIES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.hidden_act not in HIDDEN_ACTS:
      raise ValueError(f"ModelConfig.hidden_act={self.hidden_act!r}; valid: {HIDDEN_ACTS}")
    if self.local_layers and not self.sliding_window:
      raise ValueError("ModelConfig.local_layers needs a sliding_window")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"ModelConfig.sliding_window={self.sliding_window} must be at least 1")
    if any(not 0 <= l < self.num_layers for l in self.local_layers):
      raise ValueError(f"ModelConfig.local_layers={self.local_layers} not all in [0, num_layers)")
    for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
      if getattr(self, name) is not None and not getattr(self, name) > 0:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be positive (or None)")
    rope_type = self.rope_params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
      raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f"ModelConfig.lora_rank={self.lora_rank!r}: must be an integer >= 0")
    if not 0 <= self.lora_dropout < 1:
      raise ValueError(f"ModelConfig.lora_dropout={self.lora_dropout!r}: must be in [0, 1)")
    if problem := lora_targets_problem(self.lora_targets):
      raise ValueError(f"ModelConfig.lora_targets={self.lora_targets!r}: must be {problem}")
    if self.moe_dispatch not in MOE_DISPATCH:
      raise ValueError(f"ModelConfig.moe_dispatch={self.moe_dispatch!r}; valid: {MOE_DISPATCH}")
    if self.num_experts < 0:
      raise ValueError(f"ModelConfig.num_experts={self.num_experts} must be >= 0 (0: no experts)")
    if self.num_experts:
      if not 0 < self.num_experts_per_tok <= self.num_experts:
        raise ValueError(
          f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
          f"[1, num_experts={self.num_experts}]"
        )
      if self.moe_intermediate_size < 1:
        raise ValueError("ModelConfig.moe_intermediate_size must be positive with num_experts > 0")
      if any(not 0 <= l < self.num_layers for l in self.dense_layers):
        raise ValueError(f"ModelConfig.dense_layers={self.dense_layers} not all in [0, num_layers)")
    elif self.dense_layers:
      raise ValueError("ModelConfig.dense_layers needs num_experts > 0")

  @property
  def lora_weights(self) -> tuple[str, ...]:
    """The layer weights (model.Layers names) that carry LoRA adapters; () when LoRA is off."""
    if not self.lora_rank:
      return ()
    pattern = re.compile(self.lora_targets)
    # A mixture of experts adapts its attention only (not its experts, router or dense MLPs).
    has = lambda w: not self.is_moe or not w.startswith("w_")
    return tuple(w for name, w in LORA_PROJECTIONS.items() if pattern.fullmatch(name) and has(w))

  @property
  def is_moe(self) -> bool:
    """Whether some layers are mixtures of experts."""
    return self.num_experts > 0

  @property
  def has_dense_mlp(self) -> bool:
    """Whether some layers have the dense MLP (every layer of a model without experts)."""
    return not self.is_moe or bool(self.dense_layers)

  @property
  def mixed_mlp(self) -> bool:
    """Whether the layers mix dense MLPs and experts: each layer then holds both kinds of
    weights (the unused kind zero, never exported) and picks its own by a flag in the scan."""
    return self.is_moe and bool(self.dense_layers)

  def layer_is_moe(self, layer: int) -> bool:
    return self.is_moe and layer not in self.dense_layers

  @property
  def lora_scale(self) -> float:
    """alpha / rank: the adapters' factor (0 when LoRA is off)."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  def without_lora(self) -> ModelConfig:
    """This configuration with LoRA off: the frozen base model's."""
    return dataclasses.replace(self, lora_rank=0, lora_dropout=0.0)

  @property
  def attn_scale(self) -> float:
    """The factor on the attention scores q k^T."""
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  @property
  def windowed(self) -> bool:
    """Whether some layers attend through a sliding window."""
    return bool(self.local_layers)

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of decoder layer `layer` (None: global attention)."""
    return self.sliding_window if layer in self.local_layers else None

  @property
  def rope_params(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  @property
  def compute_dtype(self) -> jnp.dtype:
    return DTYPES[self.dtype]

  @property
  def params_dtype(self) -> jnp.dtype:
    return DTYPES[self.param_dtype]


def resolve_attention(cfg: ModelConfig, seq: int, backend: str | None = None) -> str:
  """The attention implementation cfg.attention stands for on seq tokens (`attention.resolve`)."""
  return attention.resolve(
    cfg.attention,
    seq_len=seq,
    dtype=cfg.compute_dtype,
    head_dim=cfg.head_dim,
    backend=backend,
    softcap=cfg.attn_softcap,
  )


def no_remat_bytes(cfg: ModelConfig, rows: int, seq: int, backend: str | None = None) -> int:
  """About what an update without remat holds for its backward on rows x seq tokens (all rows,
  one device): per layer and token the residual stream, norms, q/k/v, rotated q/k, attention
  output, MLP gate/up/product in the compute dtype, and the attention's float32 probabilities
  where dense or unrolled blockwise attention builds them ([T, T] per head, or about its causal
  half)."""
  d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  H, K = cfg.num_heads, cfg.num_kv_heads
  per_token = (4 * d + 3 * f + (2 * H + 3 * K) * dh) * jnp.dtype(cfg.compute_dtype).itemsize
  impl = resolve_attention(cfg, seq, backend)
  if impl == "dense":
    per_token += H * seq * 4
  elif impl == "blockwise" and cfg.attention == "auto" and attention.unrolled(seq, backend):
    per_token += H * (seq + attention.block_size(seq, backend)) // 2 * 4
  return cfg.num_layers * rows * seq * per_token


def layer_plan(cfg: ModelConfig, rows: int, seq: int, backend: str | None = None):
  """(remat policy, scan the layers?) of the training forward on rows x seq tokens on `backend`
  (default: jax's) for cfg.remat and cfg.scan_layers. A named policy keeps cfg.scan_layers.
  "auto" is, on CPU, "none" with the layers unrolled where `no_remat_bytes` is within
  CPU_NO_REMAT_MAX_BYTES, unless the attention is dense over at most DENSE_SAVED_MAX_KEYS keys
  (nothing recomputed, and no per-layer scan bookkeeping; a scan of "none" would stack every
  activation); otherwise "attention" with cfg.scan_layers: over few keys it keeps dense
  attention's probabilities, so the backward recomputes little anyway; on GPU and TPU long
  sequences' activations are what limits a batch."""
  if cfg.remat != "auto":
    return cfg.remat, cfg.scan_layers
  impl = resolve_attention(cfg, seq, backend)
  keeps_probs = impl == "dense" and seq <= attention.DENSE_SAVED_MAX_KEYS
  if (backend or jax.default_backend()) != "cpu" or keeps_probs:
    return "attention", cfg.scan_layers
  if no_remat_bytes(cfg, rows, seq, backend) <= CPU_NO_REMAT_MAX_BYTES:
    return "none", False
  return "attention", cfg.scan_layers


def rope_scaling_tuple(rope_scaling: Mapping[str, Any] | None) -> tuple | None:
  """HF's rope_scaling dict as the hashable sorted tuple ModelConfig stores (None stays None)."""
  if not rope_scaling:
    return None
  d = dict(rope_scaling)
  if "type" in d and "rope_type" not in d:  # pre-4.45 spelling
    d["rope_type"] = d.pop("type")
  d.pop("type", None)
  d.pop("rope_theta", None)  # transformers>=5 keeps theta inside rope_parameters
  if d.get("rope_type", "default") == "default" and len(d) <= 1:
    return None
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


_LLAMA31_ROPE = rope_scaling_tuple(
  {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
  }
)
_LLAMA32_ROPE = rope_scaling_tuple(dict(dict(_LLAMA31_ROPE), factor=32.0))
_QWEN = dict(
  rope_theta=1_000_000.0,
  rms_norm_eps=1e-6,
  bos_token_id=151643,
  eos_token_ids=(151645, 151643),
  pad_token_id=151643,
)
_LLAMA = dict(
  rope_theta=500_000.0,
  rms_norm_eps=1e-5,
  max_position_embeddings=131072,
  bos_token_id=128000,
  eos_token_ids=(128001, 128008, 128009),
  pad_token_id=128004,
  family="llama",
)


def _qwen2(vocab, d, f, layers, heads, kv, tie):
  return ModelConfig(
    vocab, d, f, layers, heads, kv, d // heads, tie_word_embeddings=tie, attention_bias=True,
    max_position_embeddings=32768, family="qwen2", **_QWEN,
  )  # fmt: skip


def _qwen3(d, f, layers, heads, kv, tie):
  return ModelConfig(
    151936, d, f, layers, heads, kv, 128, tie_word_embeddings=tie, qk_norm=True,
    max_position_embeddings=40960, family="qwen3", **_QWEN,
  )  # fmt: skip


# The named architectures (config field `model.preset`). The char-* ones are the built-in task
# policies, whose vocabulary the run replaces with its tokenizer's.
ARCHITECTURES: dict[str, ModelConfig] = {
  # Test-sized; loads nothing, compiles in seconds on CPU.
  "tiny": ModelConfig(64, 64, 128, 2, 4, 2, 16, max_position_embeddings=512, eos_token_ids=(2,)),
  # The embedded CPU default: char-level task policies (vocab 64, ~0.1M and ~0.8M params).
  "char-tiny": ModelConfig(
    64,
    64,
    192,
    2,
    4,
    2,
    16,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=0,
    initializer_range=0.1,
    remat="none",  # tiny: recomputing activations only costs time
  ),  # fmt: skip
  "char-small": ModelConfig(
    64,
    128,
    384,
    4,
    4,
    2,
    32,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=0,
    initializer_range=0.1,
    remat="none",  # tiny: recomputing activations only costs time
  ),  # fmt: skip
  # char-tiny's attention with 4 SwiGLU experts of 96, 2 per token (the mixture-of-experts
  # code path on the built-in tasks).
  "char-tiny-moe": ModelConfig(
    64,
    64,
    192,
    2,
    4,
    2,
    16,
    tie_word_embeddings=True,
    qk_norm=True,
    family="qwen3_moe",
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=0,
    initializer_range=0.1,
    remat="none",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
  ),  # fmt: skip
  "qwen2.5-0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, True),
  "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, True),
  "qwen2.5-3b": _qwen2(151936, 2048, 11008, 36, 16, 2, True),
  "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False),
  "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
  "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
  "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
  "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
  # 128 experts of 768, 8 active per token (3.3B of 30.5B parameters).
  "qwen3-30b-a3b": dataclasses.replace(
    _qwen3(2048, 6144, 48, 32, 4, False),
    family="qwen3_moe",
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
  ),  # fmt: skip
  "llama3.1-8b": ModelConfig(
    128256, 4096, 14336, 32, 32, 8, 128, rope_scaling=_LLAMA31_ROPE, **_LLAMA
  ),
  "llama3.2-1b": ModelConfig(
    128256,
    2048,
    8192,
    16,
    32,
    8,
    64,
    rope_scaling=_LLAMA32_ROPE,
    tie_word_embeddings=True,
    **_LLAMA,
  ),  # fmt: skip
  "llama3.2-3b": ModelConfig(
    128256,
    3072,
    8192,
    28,
    24,
    8,
    128,
    rope_scaling=_LLAMA32_ROPE,
    tie_word_embeddings=True,
    **_LLAMA,
  ),  # fmt: skip
}


def get(name: str, **overrides) -> ModelConfig:
  """The named architecture with field overrides (e.g. dtype="bfloat16").

  An unknown name raises `errors.UnknownNameError` listing the valid ones; a bad override raises
  ModelConfig's ValueError.
  """
  if name not in ARCHITECTURES:
    raise errors.unknown_name("model architecture", name, ARCHITECTURES)
  return dataclasses.replace(ARCHITECTURES[name], **overrides)


_HF_FAMILIES = {
  "LlamaForCausalLM": "llama",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "Qwen3MoeForCausalLM": "qwen3_moe",
  "Gemma2ForCausalLM": "gemma2",
  "Gemma3ForCausalLM": "gemma3",
}
# config.json's model_type of each family (Gemma 3's text model is "gemma3_text"; "gemma3" is
# the multimodal Gemma3ForConditionalGeneration, whose text part is not loaded here).
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2"}
_MODEL_TYPES["qwen3_moe"] = "qwen3_moe"
_MODEL_TYPES["gemma3"] = "gemma3_text"
_GEMMA = ("gemma2", "gemma3")
# HF's hidden_activation names of the tanh-approximated GELU (Gemma's GeGLU).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def hf_family(hf_config: Mapping[str, Any]) -> str:
  """The family (one of FAMILIES) named by a config.json; ValueError otherwise."""
  for arch in hf_config.get("architectures") or ():
    if arch in _HF_FAMILIES:
      return _HF_FAMILIES[arch]
  model_type = hf_config.get("model_type")
  by_type = {v: k for k, v in _MODEL_TYPES.items()}
  if model_type in by_type:
    return by_type[model_type]
  hint = ""
  if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in (
    hf_config.get("architectures") or ()
  ):
    hint = " (multimodal Gemma 3: only the text model, Gemma3ForCausalLM / gemma3_text, loads)"
  raise ValueError(
    f"unsupported architecture: architectures={hf_config.get('architectures')}, "
    f"model_type={model_type!r}; supported: {sorted(_HF_FAMILIES)}{hint}"
  )


def _gemma_fields(c: dict[str, Any], family: str, unsupported: list[str]) -> dict[str, Any]:
  """ModelConfig fields of a Gemma 2 / Gemma 3 text config.json (layer types, windows, soft
  caps, the local RoPE base), appending what we cannot run to `unsupported`."""
  act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in _GELU_TANH:
    unsupported.append(f"hidden_activation={act!r}")
  if c.get("use_bidirectional_attention"):
    unsupported.append("use_bidirectional_attention=true")
  L = int(c["num_hidden_layers"])
  types = c.get("layer_types")
  if types is None:  # older config.json: Gemma 2 alternates, Gemma 3 has a period
    period = 2 if family == "gemma2" else int(c.get("sliding_window_pattern", 6))
    types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(L)]
  if len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
    unsupported.append(f"layer_types={types}")
  window = c.get("sliding_window")
  local = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
  out = dict(
    hidden_act="gelu_tanh",
    norm_plus_one=True,
    post_norms=True,
    embed_scale=True,
    query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or 256),  # HF's default
    attn_softcap=c.get("attn_logit_softcapping"),
    final_softcap=c.get("final_logit_softcapping"),
    sliding_window=int(window) if window else None,
    local_layers=local,
  )
  rope = c.get("rope_parameters") or {}
  if family == "gemma3":
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers>=5 layout
      full, sliding = dict(rope.get("full_attention") or {}), rope.get("sliding_attention") or {}
      if sliding.get("rope_type", "default") != "default":
        unsupported.append(f"rope scaling on the sliding layers ({sliding})")
      out["rope_theta"] = float(full.get("rope_theta", 1_000_000.0))
      out["rope_scaling"] = rope_scaling_tuple(full)
      out["rope_local_theta"] = float(sliding.get("rope_theta", 10_000.0))
    else:
      out["rope_theta"] = float(c.get("rope_theta", 1_000_000.0))
      out["rope_scaling"] = rope_scaling_tuple(c.get("rope_scaling"))
      out["rope_local_theta"] = float(c.get("rope_local_base_freq", 10_000.0))
  return out


def _moe_fields(c: dict[str, Any], unsupported: list[str]) -> dict[str, Any]:
  """ModelConfig fields of a Qwen3-MoE config.json: the experts, the router's top-k and which
  layers keep a dense MLP (mlp_only_layers, and those whose (index + 1) is no multiple of
  decoder_sparse_step)."""
  E = int(c.get("num_experts", c.get("num_local_experts")) or 0)  # transformers 5 writes the latter
  step = int(c.get("decoder_sparse_step", 1) or 1)
  only = set(c.get("mlp_only_layers") or ())
  L = int(c["num_hidden_layers"])
  dense = tuple(i for i in range(L) if i in only or not E or (i + 1) % step)
  if E and len(dense) == L:
    E = 0  # every layer dense: a plain decoder
  if E == 0:
    unsupported.append("num_experts=0 (a dense model: use Qwen3ForCausalLM)")
  return dict(
    num_experts=E,
    num_experts_per_tok=int(c.get("num_experts_per_tok", 8)),
    moe_intermediate_size=int(c.get("moe_intermediate_size", 768)),
    norm_topk_prob=bool(c.get("norm_topk_prob", False)),  # HF's default
    dense_layers=dense,
  )


def config_from_hf(hf_config: Mapping[str, Any], **overrides) -> ModelConfig:
  """A ModelConfig from the contents of a Hugging Face config.json (Llama, Qwen2, Qwen3,
  Gemma 2, Gemma 3 text)."""
  c = dict(hf_config)
  family = hf_family(c)
  unsupported = []
  if family not in _GEMMA and c.get("hidden_act", "silu") != "silu":
    unsupported.append(f"hidden_act={c['hidden_act']!r}")
  if c.get("mlp_bias"):
    unsupported.append("mlp_bias=true")
  if c.get("use_sliding_window"):
    unsupported.append("use_sliding_window=true")
  if family != "qwen2" and c.get("attention_bias"):
    unsupported.append(f"attention_bias=true for {family} (bias on o_proj)")
  if c.get("partial_rotary_factor", 1.0) != 1.0:
    unsupported.append("partial_rotary_factor")
  gemma = _gemma_fields(c, family, unsupported) if family in _GEMMA else {}
  moe = _moe_fields(c, unsupported) if family == "qwen3_moe" else {}
  if unsupported:
    raise ValueError(f"config.json: unsupported settings for {family}: {', '.join(unsupported)}")
  rope = dict(c.get("rope_parameters") or {})
  rope_theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
  if c.get("rope_scaling"):
    rope = dict(c["rope_scaling"])
  eos = c.get("eos_token_id")
  eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
  num_heads = int(c["num_attention_heads"])
  pad = c.get("pad_token_id")
  if pad is None:
    pad = eos_ids[0] if eos_ids else 0
  dtype = {"bfloat16": "bfloat16"}.get(c.get("torch_dtype") or c.get("dtype"), "float32")
  kwargs = dict(
    vocab_size=int(c["vocab_size"]),
    hidden_size=int(c["hidden_size"]),
    intermediate_size=int(c["intermediate_size"]),
    num_layers=int(c["num_hidden_layers"]),
    num_heads=num_heads,
    num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
    head_dim=int(c.get("head_dim") or c["hidden_size"] // num_heads),
    rope_theta=float(rope_theta),
    rope_scaling=rope_scaling_tuple(rope),
    rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
    tie_word_embeddings=bool(c.get("tie_word_embeddings", family in _GEMMA)),
    attention_bias=family == "qwen2",
    qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
    dtype=dtype,
    param_dtype=dtype,
    max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
    bos_token_id=c.get("bos_token_id"),
    eos_token_ids=eos_ids,
    pad_token_id=int(pad),
    family=family,
    initializer_range=float(c.get("initializer_range", 0.02)),
  )
  kwargs.update(gemma)
  kwargs.update(moe)
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json contents that transformers and vLLM read for this model."""
  arch = {v: k for k, v in _HF_FAMILIES.items()}[cfg.family]
  eos = list(cfg.eos_token_ids)
  out: dict[str, Any] = {
    "architectures": [arch],
    "model_type": _MODEL_TYPES[cfg.family],
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_position_embeddings,
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "attention_dropout": 0.0,
    "initializer_range": cfg.initializer_range,
    "use_cache": True,
    "bos_token_id": cfg.bos_token_id,
    "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    "pad_token_id": cfg.pad_token_id,
    "torch_dtype": cfg.param_dtype,
  }
  if cfg.family == "llama":
    out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  elif cfg.family in _GEMMA:
    if not (cfg.norm_plus_one and cfg.post_norms and cfg.embed_scale):
      raise ValueError(f"family={cfg.family!r} needs Gemma's norms and embedding scale")
    act = {"gelu_tanh": "gelu_pytorch_tanh", "silu": "silu"}[cfg.hidden_act]
    local = set(cfg.local_layers)
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    types = ["sliding_attention" if i in local else "full_attention" for i in range(cfg.num_layers)]
    out.update(
      hidden_act=act,
      hidden_activation=act,
      attention_bias=False,
      query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,  # an int in HF
      attn_logit_softcapping=cfg.attn_softcap,
      final_logit_softcapping=cfg.final_softcap,
      sliding_window=cfg.sliding_window,
      layer_types=types,
    )
    if cfg.family == "gemma3":
      out["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
  else:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
  if cfg.family in ("qwen3", "qwen3_moe"):
    out["attention_bias"] = False
  if cfg.family == "qwen3_moe":
    if not cfg.is_moe:
      raise ValueError("family='qwen3_moe' needs num_experts > 0")
    out.update(
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_intermediate_size,
      norm_topk_prob=cfg.norm_topk_prob,
      decoder_sparse_step=1,
      mlp_only_layers=list(cfg.dense_layers),
      output_router_logits=False,
    )
  elif cfg.is_moe:
    raise ValueError(f"family={cfg.family!r} has no experts; mixtures of experts are qwen3_moe")
  return out


def hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
  """transformers>=5's rope_parameters of this model: one dict, or Gemma 3's per layer type."""
  full = {"rope_type": "default", **dict(cfg.rope_scaling or ()), "rope_theta": cfg.rope_theta}
  if cfg.family != "gemma3":
    return full
  local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
  return {"full_attention": full, "sliding_attention": local}
