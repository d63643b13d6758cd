"""Memory plan: will a config fit a mesh of devices? Sized before paying for the pod.

  python -m gppo_jax.plan --config=configs/qwen25_math_7b.py:v5p64 [--mesh=fsdp=32,tensor=1]
      [--platform=v5p | --device_memory_gb=95] [--analytic]

Prints per-device memory of parameters, optimizer state, rollout batch, sampler KV cache and the
update's activations (XLA's temporaries), and whether the peak fits the device memory. The numbers
come from compiling the real jitted update for abstract inputs (`jax.ShapeDtypeStruct`, nothing is
allocated) on simulated CPU devices, one per mesh position: XLA's CPU buffer assignment stands in
for the accelerator's, so treat activations as an estimate (+-30%). `--analytic` skips the compile
and uses a closed-form activation estimate instead (also the fallback if compiling fails).
Parameters, optimizer state and KV cache are exact from the shardings either way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gppo_jax import cli, config_lib, errors
from gppo_jax.generation import sampler
from gppo_jax.models import architectures, attention, partitioning, sharding
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import train_step

log = logging.getLogger(__name__)

# HBM per chip / GPU, GiB (what jax reports as usable is slightly less).
PLATFORM_MEMORY_GB = {
  "v4": 32,
  "v5e": 16,
  "v5p": 95,
  "v6e": 32,
  "a100": 80,
  "h100": 80,
  "h200": 141,
  "b200": 180,
  "cpu": 16,
}
# Dense bfloat16 matmul peak per chip / GPU, TFLOP/s (vendor figures, no sparsity): the
# denominator of model-FLOPs utilisation (benchmarks/gpu_train_step.py).
PLATFORM_BF16_TFLOPS = {
  "v4": 275,
  "v5e": 197,
  "v5p": 459,
  "v6e": 918,
  "a100": 312,
  "h100": 989,
  "h200": 989,
  "b200": 2250,
}
# Memory bandwidth per chip / GPU, GB/s (vendor figures): what bounds a decode step.
PLATFORM_HBM_GBPS = {
  "v4": 1228,
  "v5e": 819,
  "v5p": 2765,
  "v6e": 1640,
  "a100": 2039,
  "h100": 3350,
  "h200": 4800,
  "b200": 8000,
}
# Chip-to-chip bandwidth per chip / GPU, GB/s, all links (vendor figures: ICI, NVLink): what
# bounds moving the parameters from the trainer's devices to the sampler's.
PLATFORM_LINK_GBPS = {
  "v4": 300,
  "v5e": 200,
  "v5p": 600,
  "v6e": 448,
  "a100": 600,
  "h100": 900,
  "h200": 900,
  "b200": 1800,
}
# The backend each platform's "auto" attention resolves for (attention.resolve).
PLATFORM_BACKEND = {name: "tpu" for name in ("v4", "v5e", "v5p", "v6e")}
PLATFORM_BACKEND.update({name: "gpu" for name in ("a100", "h100", "h200", "b200")}, cpu="cpu")
GIB = 1024**3
_REEXEC = "_GPPO_PLAN_SIMULATED"


@dataclasses.dataclass
class MemoryPlan:
  """Per-device bytes of each part of a training step on one mesh."""

  mesh: dict[str, int]
  num_params: int
  params: int
  optimizer: int
  batch: int
  kv_cache: int
  activations: int  # the update's temporaries (XLA temp_size) or the analytic estimate
  update_peak: int  # resident state + batch + activations while updating
  sample_peak: int  # resident state + KV cache + decode logits while sampling
  device_memory: int
  source: str  # "compiled" | "analytic"
  notes: tuple[str, ...] = ()
  trainable_params: int | None = None  # with LoRA the adapters' count (None: all num_params)
  # mesh.rollout_devices > 0: the sampler's own mesh; sample_peak is then one of its devices'
  # (its copy of the policy, the KV cache, the decode logits), the rest the trainer's.
  sampler_mesh: dict[str, int] | None = None

  @property
  def peak(self) -> int:
    return max(self.update_peak, self.sample_peak)

  @property
  def fits(self) -> bool:
    return self.peak <= self.device_memory

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(peak=self.peak, fits=self.fits, notes=list(self.notes))
    return d


# --- Shapes from a config ----------------------------------------------------------------------


def model_config(config) -> tuple[architectures.ModelConfig, str]:
  """(ModelConfig, where from): model.path's config.json if the folder exists, else the named
  architecture `model.preset`."""
  overrides = config_lib.model_overrides(config)
  path = config.model.get("path")
  if path and os.path.isfile(os.path.join(path, "config.json")):
    from gppo_jax.models import hf_checkpoint

    return hf_checkpoint.model_config(path, **overrides), f"{path}/config.json"
  name = config.model.preset
  return architectures.get(name, **overrides), f"architecture {name!r}"


def micro_batch_rows(n: int, train) -> int:
  """Rows of one gradient micro-batch (all devices) of an n-row rollout under `train` (the
  config's train section or an UpdateSpec: minibatches x microbatches per epoch)."""
  return max(1, n // (train.minibatches * train.microbatches))


def rollout_shape(config) -> tuple[int, int, int]:
  """(sequences N, prompt length P, response length R) of one rollout batch."""
  r = config.rollout
  n = r.prompts_per_iter * r.group_size
  if config.data.get("train_path") is None and config.model.get("path") is None:
    from gppo_jax.data import tasks

    task = tasks.get(config.task.name)
    return n, task.max_prompt_len + 1, min(r.max_new_tokens, task.max_answer_len + 1)
  p = -(-config.data.max_prompt_tokens // 64) * 64  # DataEnv's bucket
  return n, p, r.max_new_tokens


def update_setup(config, model_cfg: architectures.ModelConfig, prompt_len: int, resp_len: int):
  """(update_fn, abstract TrainState, UpdateSpec) exactly as the trainer builds them."""
  graphdef = model_lib.abstract_graphdef(model_cfg)
  tx = train_step.optimizer_from_config(config)
  state = train_step.abstract_train_state(model_cfg, tx)
  spec = train_step.update_spec_from_config(config, prompt_len, resp_len, model_cfg)
  return train_step.make_update_fn(graphdef, tx, spec), state, spec


# --- Accounting --------------------------------------------------------------------------------


def active_layer_params(cfg: architectures.ModelConfig) -> int:
  """The parameters of the decoder layers one token's matmuls use: attention, and the dense MLP
  or, in an expert layer, the router and num_experts_per_tok experts (sum over the layers)."""
  D, F = cfg.hidden_size, cfg.intermediate_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  attn = D * (q + 2 * kv) + q * D + (q + 2 * kv if cfg.attention_bias else 0)
  total = 0
  for l in range(cfg.num_layers):
    if cfg.layer_is_moe(l):
      mlp = D * cfg.num_experts + 3 * D * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    else:
      mlp = 3 * D * F
    total += attn + mlp
  return total


def update_flops(cfg: architectures.ModelConfig, rows: int, length: int, response: int) -> float:
  """Model FLOPs of one optimizer step (forward + backward, no recomputation) on `rows`
  sequences of `length` tokens whose last `response` tokens carry the loss: 6 x (layer
  parameters a token uses: `active_layer_params`) per token, 6 x (LM head) per response token
  (the head runs on those only), and causal attention's two matmuls: 12 x heads x head_dim per
  query and key, forward and backward, over the lower triangle (token t attends to t keys), i.e.
  6 x T x heads x head_dim per token and layer on average."""
  D, L = cfg.hidden_size, cfg.num_layers
  q = cfg.num_heads * cfg.head_dim
  body = 6 * active_layer_params(cfg) * rows * length
  head = 6 * D * cfg.vocab_size * rows * response
  attn = 6 * q * L * rows * length * (length + 1)
  return float(body + head + attn)


def per_device_bytes(tree: Any, shardings: Any) -> int:
  """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) under `shardings`."""
  total = 0
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
    shard = s.shard_shape(tuple(x.shape))
    total += math.prod(shard) * np.dtype(x.dtype).itemsize
  return total


def kv_cache_bytes(config, cfg: architectures.ModelConfig, mesh, rows: int, prompt_len: int,
                   resp_len: int) -> tuple[int, str]:  # fmt: skip
  """Per-device bytes of the rollout's KV cache and which sampler holds it, both from
  `paged.kv_bytes_per_token` (the engine's formula): where `rollout.engine` runs continuous
  batching, one shard's page pool (`ContinuousSampler.pool_pages`, the pool the engine sizes);
  else the fixed batch's cache, its rows over data x fsdp (x expert), kv heads over tensor."""
  from gppo_jax.generation import continuous, paged  # noqa: PLC0415

  r = config.rollout
  per_token = paged.kv_bytes_per_token(cfg)
  if continuous.engine_for(r.get("engine", "auto"), resp_len) == "continuous":
    shards = sharding.batch_shards(mesh)
    slots = r.get("slots", 0) or -(-rows // shards) * shards
    engine = continuous.ContinuousSampler(
      None,
      sampler.SamplingParams(max_new_tokens=resp_len),
      continuous.EngineConfig(
        slots=slots, page_size=r.page_size, num_pages=r.get("kv_pages") or None,
        chunk=r.decode_chunk, kv_memory_gib=r.get("kv_memory_gib") or None,
      ),
      mesh,
    )  # fmt: skip
    prompt = -(-prompt_len // r.page_size) * r.page_size
    pages = engine.pool_pages(prompt, r.group_size, model_cfg=cfg)
    return pages * r.page_size * per_token, "engine page pool, one shard's"
  dp = sharding.batch_shards(mesh)
  per_device = -(-rows // dp) if rows % dp == 0 else rows
  heads = cfg.num_kv_heads
  split = mesh.shape["tensor"] if heads % mesh.shape["tensor"] == 0 else 1
  return per_device * (prompt_len + resp_len) * per_token // split, "fixed-batch cache"


def attention_impl(cfg: architectures.ModelConfig, seq: int, backend: str) -> str:
  """The attention implementation cfg.attention resolves to for `seq` tokens on `backend`."""
  return attention.resolve(
    cfg.attention, seq_len=seq, dtype=cfg.compute_dtype, head_dim=cfg.head_dim, backend=backend
  )


def analytic_activation_bytes(
  cfg: architectures.ModelConfig,
  mesh,
  spec,
  n: int,
  seq: int,
  num_params: int,
  backend: str = "tpu",
) -> int:
  """Closed-form estimate of the update's temporaries per device (remat-aware, chunked head).

  One micro-batch of rows split over data x fsdp: the saved layer inputs (and the attention's
  residuals with remat "attention"; every weight matmul's output with "dots"; every
  intermediate without remat), one layer's forward and backward working set, the chunked
  log-prob head, and gradient-sized buffers. Attention: dense keeps float32 scores,
  probabilities and their gradient ([rows, heads, seq, seq] each, or [groups, heads, S, S] where
  shared prompts attend on packed groups of S tokens); the linear-memory implementations
  (blockwise, cudnn, splash) one such block of tiles (all the causal tiles where CPU runs them
  unrolled, `attention.unrolled`) plus float32 per-token accumulators.
  Calibrated against the compiled plan of 7-8B models with ~3k-token responses to within ~20%.
  It undercounts long sequences, where XLA's temporaries grow past the logical residuals: the
  7B math config with 16k-token responses on a v5p-64 estimates 35.7 GiB against the compiled
  57.3 GiB. Prefer the compiled figure (the default) for long responses.
  """
  dp = sharding.batch_shards(mesh)
  tp = mesh.shape["tensor"]
  micro = micro_batch_rows(n, spec)
  rows = max(1, micro // dp)
  remat = architectures.layer_plan(cfg, micro, seq, backend)[0]  # "auto" as the model runs it
  item = np.dtype(cfg.compute_dtype).itemsize
  d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  if cfg.is_moe:  # per token: its k experts' intermediates, the dispatch's k copies of its row
    f = max(f if cfg.has_dense_mlp else 0, cfg.num_experts_per_tok * cfg.moe_intermediate_size)
    f += cfg.num_experts_per_tok * d // 3
  heads = cfg.num_heads // tp if cfg.num_heads % tp == 0 else cfg.num_heads
  kv = cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads
  tokens = rows * seq
  layer_work = 2 * tokens * (4 * d + 3 * f // tp + 2 * (heads + 2 * kv) * dh) * item
  G, P = spec.group_size, spec.prompt_len
  impl = attention_impl(cfg, seq, backend)
  keys = 0  # of each dense attention product (0: none, blockwise, cuDNN or splash)
  if model_lib.attends_packed_groups(cfg, seq, P, G, backend):
    keys = model_lib.packed_group_len(seq, P, G)
    attn = 3 * max(1, rows // G) * heads * keys * keys * 4
  elif impl == "dense":
    keys = seq
    attn = 3 * rows * heads * seq * seq * 4
  else:
    block = min(seq, attention.block_size(seq, backend))
    # Unrolled tiles (CPU "auto", short rows) hold every tile's scores, each against its prefix.
    unroll = cfg.attention == "auto" and attention.unrolled(seq, backend)
    tiles = -(-seq // block) if unroll else 1
    attn = 3 * rows * heads * block * block * tiles * (tiles + 1) // 2 * 4
    attn += rows * heads * seq * (dh + 2) * 4
  saved = tokens * d * item * cfg.num_layers
  if remat == "attention" and (keys or impl == "blockwise"):  # attention.SAVED_NAMES
    lse = 0 if keys else 4  # blockwise's log-sum-exp; dense's probabilities if few keys
    probs = attn // 3 if 0 < keys <= attention.DENSE_SAVED_MAX_KEYS else 0
    saved += (tokens * heads * (dh * item + lse) + probs) * cfg.num_layers
  if remat == "dots":
    # Every weight matmul's output (q, k, v, o, gate, up, down), twice: XLA's compiled plan of
    # the Qwen2.5-7B math config on fsdp=8 holds 131.6 / 306.9 GiB more than remat "full" at 1k /
    # 3k response tokens, against 63.7 / 148 GiB of these outputs in bf16.
    outputs = (heads + 2 * kv) * dh + 2 * d + 2 * f // tp
    saved += 2 * tokens * outputs * item * cfg.num_layers
  if remat == "none":
    saved = cfg.num_layers * (layer_work + attn) // 2
  head = rows * min(128, seq) * cfg.vocab_size * 4 * 3
  # num_params: the trained ones (with LoRA the adapters, float32 whatever the base's dtype).
  item = 4 if cfg.lora_rank else np.dtype(cfg.params_dtype).itemsize
  grads = num_params * item // (mesh.size // mesh.shape["data"])
  return int(saved + layer_work + attn + head + 2 * grads)


def compiled_update_memory(update_fn, state, batch, mesh) -> Any:
  """XLA's memory analysis of the sharded update compiled for abstract inputs on `mesh`."""
  shardings = sharding.state_shardings(state, mesh)
  batch_sh = sharding.batch_shardings(batch, mesh)
  jitted = sharding.jit_update(update_fn, shardings, batch_sh)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  return jitted.lower(state, batch, key).compile().memory_analysis()


def plan(
  config,
  mesh_cfg: Mapping[str, int] | None = None,
  *,
  device_memory_gb: float = PLATFORM_MEMORY_GB["v5p"],
  compile: bool = True,
  devices: Any = None,
  backend: str = "tpu",
  hosts: int = 1,
) -> MemoryPlan:
  """The memory plan of `config` on a mesh (default: config.mesh over `devices` / all devices)
  for devices of `backend` (tpu, gpu, cpu: what model.attention="auto" resolves to there).
  With `rollout_devices` > 0 in the mesh config, the update is planned on the trainer's devices
  and the rollout on the sampler's (`sharding.make_meshes`): on `hosts` > 1 hosts, one host's
  share of them (each host samples on rollout_devices / hosts of its own devices)."""
  mesh, sampler_mesh = sharding.make_meshes(
    dict(mesh_cfg or config.mesh), devices, hosts=hosts if hosts > 1 else None
  )
  split = sampler_mesh is not mesh
  cfg, _ = model_config(config)
  sharding.check_experts(cfg, mesh.shape)
  if split:
    sharding.check_experts(cfg, sampler_mesh.shape)
  n, p, r = rollout_shape(config)
  notes = []
  if cfg.is_moe:
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    active = active_layer_params(cfg) + embeddings
    notes.append(
      f"mixture of experts: {cfg.num_experts} experts, {cfg.num_experts_per_tok} per token "
      f"({active / 1e9:.2f}B parameters active per token)"
    )
  impl = attention_impl(cfg, p + r - 1, backend)
  # remat "auto" as the target resolves it, for the stand-ins below (a CPU target's compile
  # resolves it itself, the same way).
  remat, scan = architectures.layer_plan(cfg, micro_batch_rows(n, config.train), p + r - 1, backend)
  # A compiled blockwise attention (the target's own, or the stand-in below) has CPU's tiles,
  # `attention.block_size`: at most 256 tokens against 512 on a GPU or TPU, a small share of the
  # memory next to the O(T) terms.
  if compile and impl not in ("dense", "blockwise"):
    # The compile runs here (CPU): the target's fused kernel is compiled as blockwise, the
    # pure-JAX kernel of the same linear memory class, keeping nothing the target would not:
    # remat "attention" keeps blockwise's residuals, which cuDNN and splash recompute ("full").
    notes.append(f"attention: {impl} on {backend}; compiled here as blockwise (same O(T) memory)")
    remat = "full" if remat == "attention" else remat
    cfg = dataclasses.replace(cfg, attention="blockwise", remat=remat, scan_layers=scan)
  elif compile and backend != "cpu":  # a CPU target's "auto"s resolve here as they would there
    cfg = dataclasses.replace(cfg, attention=impl, remat=remat, scan_layers=scan)
  if compile and cfg.is_moe:  # the experts' products compiled as GPU / TPU run them
    cfg = dataclasses.replace(cfg, ragged_dot_stand_in=True)
  update_fn, state, spec = update_setup(config, cfg, p, r)
  batch = train_step.abstract_batch(n, p, r, spec, config.rollout.num_topk)
  sh = sharding.state_shardings(state, mesh)
  params = per_device_bytes(state.params, sh.params)
  optimizer = per_device_bytes(state.opt_state, sh.opt_state)
  batch_bytes = per_device_bytes(batch, sharding.batch_shardings(batch, mesh))
  copies = 1 + (config.loss.kl_coef > 0) + config.rollout.get("staleness", 0)
  # LoRA: the frozen base once, in its dtype; the copies below (KL reference, lagging policies)
  # and the optimizer state are of the adapters only.
  frozen = per_device_bytes(state.frozen, sh.frozen) if state.frozen is not None else 0
  if frozen:
    notes.append(
      f"LoRA rank {cfg.lora_rank}: the frozen base ({cfg.param_dtype}) once; optimizer state "
      "and parameter copies of the adapters only"
    )
  if config.loss.kl_coef > 0:
    notes.append("kl_coef > 0: a frozen reference copy of the parameters is counted in params")
  if config.rollout.get("staleness", 0):
    notes.append(
      f"rollout.staleness={config.rollout.staleness}: the lagging parameter copies are counted "
      "in params"
    )
  params = params * copies + frozen
  resident = params + optimizer
  kv, kv_kind = kv_cache_bytes(config, cfg, sampler_mesh, n, p, r)
  notes.append(f"sampler KV cache: the {kv_kind}")
  dp = sharding.batch_shards(sampler_mesh)
  decode_logits = max(1, n // dp) * cfg.vocab_size * 4 * 3
  sampler_resident = resident
  if split:  # the sampler holds one copy of the policy (in its own shardings), nothing else
    policy = state.params if state.frozen is None else nnx.merge_state(state.frozen, state.params)
    sampler_resident = per_device_bytes(policy, partitioning.state_shardings(policy, sampler_mesh))
    per_host = f" on each of {hosts} hosts" if hosts > 1 else ""
    notes.append(
      f"mesh.rollout_devices={sampler_mesh.devices.size}{per_host}: sampling on its own "
      f"{dict(sampler_mesh.shape)} (its copy of the policy, KV cache and decode logits in the "
      "sampling peak); the update on the other devices"
    )
  source = "analytic"
  trainable = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
  num_params = trainable + sum(math.prod(x.shape) for x in jax.tree.leaves(state.frozen))
  activations = analytic_activation_bytes(cfg, mesh, spec, n, p + r - 1, trainable, backend)
  update_peak = resident + batch_bytes + activations
  if compile:
    try:
      stats = compiled_update_memory(update_fn, state, batch, mesh)
      activations = int(stats.temp_size_in_bytes)
      live_args = (
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
      )
      update_peak = (resident - per_device_bytes(state, sh)) + int(live_args) + activations
      source = "compiled"
    except Exception as e:  # a compile failure still leaves the analytic plan useful
      notes.append(f"compile failed ({type(e).__name__}: {str(e)[:200]}); analytic estimate")
  return MemoryPlan(
    mesh=dict(mesh.shape),
    num_params=num_params,
    params=params,
    optimizer=optimizer,
    batch=batch_bytes,
    kv_cache=kv,
    activations=activations,
    update_peak=update_peak,
    sample_peak=sampler_resident + kv + decode_logits,
    device_memory=int(device_memory_gb * GIB),
    source=source,
    notes=tuple(notes),
    trainable_params=trainable if frozen else None,
    sampler_mesh=dict(sampler_mesh.shape) if split else None,
  )


@dataclasses.dataclass
class TimePlan:
  """Predicted seconds of one iteration's phases (`iteration_time`)."""

  sample_s: float  # the rollout on all devices (synchronous)
  update_s: float  # the update on all devices (synchronous)
  sample_split_s: float  # the rollout on the sampler's devices
  update_split_s: float  # the update on the trainer's devices
  move_s: float  # the policy from the trainer's devices to the sampler's
  stream_split_s: float  # one update's worth of streamed rows on the sampler's devices
  rollout_devices: int
  devices: int

  @property
  def sync_s(self) -> float:
    return self.sample_s + self.update_s

  @property
  def async_s(self) -> float:
    return max(self.sample_split_s + self.move_s, self.update_split_s)

  @property
  def stream_s(self) -> float:
    return max(self.stream_split_s + self.move_s, self.update_split_s)

  @property
  def speedup(self) -> float:
    return self.sync_s / self.async_s

  @property
  def stream_speedup(self) -> float:
    return self.sync_s / self.stream_s

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(sync_s=self.sync_s, async_s=self.async_s, speedup=self.speedup)
    d.update(stream_s=self.stream_s, stream_speedup=self.stream_speedup)
    return d


def iteration_time(
  config,
  cfg: architectures.ModelConfig,
  *,
  platform: str,
  devices: int,
  rollout_devices: int,
  mean_response: float | None = None,
  mfu: float = 0.4,
) -> TimePlan:
  """A roofline estimate of one iteration, synchronous (every device samples, then every device
  updates) against asynchronous (`rollout_devices` sample while the rest update, the next
  rollout beside the current update) and streaming (`rollout.mode=stream` on the same split: the
  engine never drains). What it assumes:

  - the update runs at `mfu` of the chips' bf16 peak on its model FLOPs (`update_flops`, times
    train.epochs) and scales linearly with its devices;
  - sampling decodes for as many steps as the longest response (the cap R: a long tail has one),
    each step reading every weight once per data-parallel replica (the sampler's copy is
    replicated over its devices, split over none) from HBM, plus the live rows' KV cache: mean
    response `mean_response` (default R / 2), so the cache read is the rows' tokens at the mean
    context; each step's compute (2 x active parameters per row) at `mfu` of peak if that is
    slower; the prefill is compute at `mfu`. Data parallelism splits the rows, not the steps;
  - the parameters move once per iteration over the chip links (bf16: 2 bytes each; each sampler
    device receives a whole copy, the trainer's shards sending in parallel), and the
    asynchronous iteration is the slower of the two groups (the host's scoring, the engine's
    scheduling and the optimizer's host work are left out);
  - streaming keeps the rollout's rows in flight, a new row starting as one finishes, so one
    update's worth of rows takes as many decode steps as the mean response, not the longest
    (the same cache reads, compute and prefill as a drained rollout; the weights are read fewer
    times), and overlaps the update as the asynchronous iteration does.
  """
  if platform not in PLATFORM_BF16_TFLOPS:
    raise errors.ConfigError(f"--platform={platform!r}: no peak figures; valid: "
                             f"{', '.join(PLATFORM_BF16_TFLOPS)}")  # fmt: skip
  if not 0 < rollout_devices < devices:
    raise errors.ConfigError(
      f"rollout_devices={rollout_devices}: needs 0 < rollout_devices < devices ({devices})"
    )
  from gppo_jax.generation import paged  # noqa: PLC0415

  peak = PLATFORM_BF16_TFLOPS[platform] * 1e12 * mfu
  hbm = PLATFORM_HBM_GBPS[platform] * 1e9
  n, p, r = rollout_shape(config)
  mean = r / 2 if mean_response is None else mean_response
  embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
  active = active_layer_params(cfg) + embeddings
  total = abstract_param_count(cfg)
  weight_bytes = 2 * total  # the sampler's copy in bf16
  kv_token = paged.kv_bytes_per_token(cfg)
  update_flops_all = config.train.epochs * update_flops(cfg, n, p + r, r)

  def sample(d: int, steps: float = r) -> float:
    rows = n / d
    read = steps * weight_bytes / hbm + rows * mean * (p + mean / 2) * kv_token / hbm
    compute = 2 * active * rows * mean / peak
    prefill = 2 * active * rows * p / peak
    return max(read, compute) + prefill

  update = lambda d: update_flops_all / (d * peak)
  link = PLATFORM_LINK_GBPS[platform] * 1e9
  return TimePlan(
    sample_s=sample(devices),
    update_s=update(devices),
    sample_split_s=sample(rollout_devices),
    update_split_s=update(devices - rollout_devices),
    move_s=weight_bytes / link,  # every sampler device receives a whole copy
    stream_split_s=sample(rollout_devices, steps=mean),
    rollout_devices=rollout_devices,
    devices=devices,
  )


@functools.lru_cache(maxsize=8)
def abstract_param_count(cfg: architectures.ModelConfig) -> int:
  """Every parameter of the model, counted on its abstract state (nothing allocated)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(model_lib.abstract_state(cfg)))


def format_time(t: TimePlan, platform: str, stream: TimePlan | None = None) -> str:
  """The time model's lines: synchronous and asynchronous from `t`, streaming from `stream` (its
  own best split; None leaves streaming out: one process only for now)."""

  def split(label: str, x: TimePlan, sample_s: float, total_s: float) -> str:
    return (f"  {label:<13} sample {sample_s:8.2f} s on {x.rollout_devices} + move "
            f"{x.move_s:.2f} s | update {x.update_split_s:8.2f} s on "
            f"{x.devices - x.rollout_devices} = {total_s:8.2f} s")  # fmt: skip

  lines = [
    f"time model ({platform}, {t.devices} devices; assumptions: plan.iteration_time):",
    f"  synchronous   sample {t.sample_s:8.2f} s + update {t.update_s:8.2f} s = {t.sync_s:8.2f} s",
    split("asynchronous", t, t.sample_split_s, t.async_s),
  ]
  speed = f"  predicted speedup {t.speedup:.2f}x asynchronous"
  if stream is not None:
    lines.append(split("streaming", stream, stream.stream_split_s, stream.stream_s))
    speed += f", {stream.stream_speedup:.2f}x streaming"
  return "\n".join([*lines, speed])


def format_plan(p: MemoryPlan, title: str = "") -> str:
  def g(b: int) -> str:
    return f"{b / GIB:8.2f} GiB" if b >= GIB // 10 else f"{b / 1024**2:8.2f} MiB"

  rows = [
    ("parameters", p.params),
    ("optimizer state", p.optimizer),
    ("rollout batch", p.batch),
    ("sampler KV cache", p.kv_cache),
    (f"update activations ({p.source})", p.activations),
    ("peak while updating", p.update_peak),
    ("peak while sampling", p.sample_peak),
  ]
  mesh = " x ".join(f"{k}={v}" for k, v in p.mesh.items())
  lines = [title] if title else []
  trained = ""
  if p.trainable_params is not None:
    trained = f" ({p.trainable_params / 1e6:.1f}M trained: LoRA)"
  lines.append(
    f"mesh {mesh} ({math.prod(p.mesh.values())} devices), {p.num_params / 1e9:.3f}B params"
    + trained
  )
  if p.sampler_mesh:
    sampler = " x ".join(f"{k}={v}" for k, v in p.sampler_mesh.items())
    lines.append(f"sampler mesh {sampler} ({math.prod(p.sampler_mesh.values())} devices)")
  lines += [f"  {name:<34}{g(b)}" for name, b in rows]
  verdict = "FITS" if p.fits else "DOES NOT FIT"
  lines.append(
    f"  {verdict}: peak {g(p.peak).strip()} of {p.device_memory / GIB:.0f} GiB per device"
  )
  lines += [f"  note: {n}" for n in p.notes]
  return "\n".join(lines)


def parse_mesh(text: str) -> dict[str, int]:
  """'fsdp=8,tensor=1' -> {'fsdp': 8, 'tensor': 1, 'data': 1, 'expert': 1} (unnamed axes are
  1)."""
  out = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
  for part in filter(None, (s.strip() for s in text.split(","))):
    name, eq, value = part.partition("=")
    if not eq or name not in out:
      raise errors.ConfigError(f"--mesh part {part!r}: expected NAME=SIZE with NAME in {list(out)}")
    try:
      out[name] = int(value)
    except ValueError:
      raise errors.ConfigError(f"--mesh part {part!r}: SIZE must be an integer") from None
  return out


def main(argv) -> None:
  from absl import flags

  f = flags.FLAGS
  config = f.config
  config_lib.validate(config)
  # --mesh names the trainer's axes; the split (mesh.rollout_devices) stays the config's.
  mesh_cfg = {**dict(config.mesh), **parse_mesh(f.mesh)} if f.mesh else dict(config.mesh)
  if f.device_memory_gb is not None:
    memory = f.device_memory_gb
  elif f.platform in PLATFORM_MEMORY_GB:
    memory = PLATFORM_MEMORY_GB[f.platform]
  else:
    raise errors.ConfigError(f"--platform={f.platform!r}; valid: {', '.join(PLATFORM_MEMORY_GB)}")
  axes = {k: v for k, v in mesh_cfg.items() if k not in sharding.ROLLOUT_MESH_KEYS}
  split = int(mesh_cfg.get("rollout_devices", 0) or 0)
  needed = f.num_devices or math.prod(v for v in axes.values() if v > 0) + split
  if -1 in axes.values() and not f.num_devices:
    needed = len(jax.devices())
  devices = jax.devices()
  if len(devices) < needed:
    if os.environ.get(_REEXEC) or jax.default_backend() != "cpu":
      raise errors.ConfigError(
        f"mesh {mesh_cfg} needs {needed} devices but jax sees {len(devices)}"
      )
    # Simulated CPU devices must be requested before jax starts: rerun this command with them.
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_REEXEC: "1"})
    env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={needed}"
    )
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "gppo_jax.plan", *sys.argv[1:]], env)
  devices = devices[:needed]
  cfg, source = model_config(config)
  backend = PLATFORM_BACKEND.get(f.platform, "tpu")
  result = plan(
    config,
    mesh_cfg,
    device_memory_gb=memory,
    compile=not f.analytic,
    devices=devices,
    backend=backend,
    hosts=f.hosts,
  )
  n, p, r = rollout_shape(config)
  impl = attention_impl(cfg, p + r - 1, backend)
  micro = micro_batch_rows(n, config.train)
  remat = architectures.layer_plan(cfg, micro, p + r - 1, backend)[0]  # what "auto" runs
  title = (
    f"{source}: dtype {cfg.dtype}/{cfg.param_dtype}, remat {remat}, attention {impl}; "
    f"rollout {n} x ({p} + {r})"
    f" tokens; {config.train.minibatches} minibatches x {config.train.microbatches} micro; "
    f"{f.platform} {memory} GiB"
  )
  print(format_plan(result, title))
  out = result.as_dict()
  if f.platform in PLATFORM_BF16_TFLOPS and len(devices) > 1:
    # The config's split, or the best of the power-of-two ones.
    powers = [2**i for i in range(len(devices).bit_length()) if 2**i < len(devices)]
    tried = [split] if split else powers
    predict = lambda n: iteration_time(
      config, cfg, platform=f.platform, devices=len(devices), rollout_devices=n, mfu=f.mfu
    )
    plans = [predict(n) for n in tried]
    times = max(plans, key=lambda t: t.speedup)
    # Streaming overlaps the same way but decodes fewer steps: its best split may differ.
    stream = max(plans, key=lambda t: t.stream_speedup) if f.hosts == 1 else None
    print(format_time(times, f.platform, stream))
    out["time"] = times.as_dict()
    if stream is not None:
      out["time_stream"] = stream.as_dict()
  print(json.dumps(out))


if __name__ == "__main__":
  from absl import flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py[:arg]).")
  flags.DEFINE_string("mesh", None, "Mesh sizes, e.g. fsdp=8,tensor=1 (default: config.mesh).")
  flags.DEFINE_integer("num_devices", None, "Devices to simulate when the mesh has a -1.")
  flags.DEFINE_string("platform", "v5p", f"Device kind: {', '.join(PLATFORM_MEMORY_GB)}.")
  flags.DEFINE_float("device_memory_gb", None, "Memory per device (default: the platform's).")
  flags.DEFINE_bool("analytic", False, "Skip compiling; closed-form activation estimate.")
  flags.DEFINE_float("mfu", 0.4, "The time model's share of the chips' peak FLOP/s.")
  flags.DEFINE_integer(
    "hosts", 1, "Hosts of the slice: with mesh.rollout_devices each samples on its own share."
  )
  flags.mark_flags_as_required(["config"])
  cli.run(main)
