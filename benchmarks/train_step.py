"""One RL update step: our compiled update vs Hugging Face transformers Qwen2 + torch (CPU).

Both sides take one optimizer step on the same fixed batch of the same Qwen2 shape (random
weights, copied from the HF model into ours so both compute the same function), float32 (or with
`--dtype bfloat16` bf16 compute on float32 weights: ours `model.dtype`, HF under
`torch.autocast`), 2 CPU threads each, in this one process:

- ours: `train_step.make_update_fn` as training runs it (forward with `model.attention` and
  `model.remat`, the chunked log-prob head on the response tokens, the GPPO loss kl/atomic,
  gradient clipping, AdamW), jitted with the state donated;
- HF: `Qwen2ForCausalLM` (sdpa attention) forward of the body, LM head on the response tokens,
  log-softmax, a PPO clipped loss on the same behaviour log-probs and advantages, backward,
  `clip_grad_norm_`, `torch.optim.AdamW.step`.

Repeats are interleaved (this machine's speed drifts), each timed step right after an untimed one
of the same method (as in a training loop; the two share the process's heap), compile excluded,
medians compared; "per round" is the range of the ratios of the rounds (each HF run against ours
of the same round), how far a single pair could mislead. Achieved GFLOP/s counts model FLOPs
(`plan.update_flops`: 6 x (layer parameters) per token, 6 x (LM head) per response token, plus
causal attention, 6 x T x heads x head_dim per token and layer: the lower triangle only); it is
compared with XLA's own matmul rate on this machine in the compute dtype (a 2048^3 `jnp.dot`,
float32 accumulation, timed in the same run), and torch's rate for the same product is printed
beside it. The "matmul bound" is the fastest our step could be on this machine: its model FLOPs
alone, every one at XLA's 2048^3 rate; HF's time over it is the largest ratio ours could reach
against HF with XLA's CPU kernels. Ends with one JSON line.

  python benchmarks/train_step.py                          # both shapes, the shipped defaults
  python benchmarks/train_step.py --shape small --repeats 7
  python benchmarks/train_step.py --shape small --rows 1 --length 4096   # a long sequence
  python benchmarks/train_step.py --shape small --dtype bfloat16           # bf16 compute
  python benchmarks/train_step.py --shape tiny --variants full/dense,dots/dense,none/dense
  python benchmarks/train_step.py --shape tiny --variants attention/auto/xla,attention/auto/ynnpack

  python benchmarks/train_step.py --shape small --memory 2048,4096,8192 \
      --variants full/auto,full/dense                       # compiled memory, nothing timed

`--variants` times several of our configurations (remat/attention[/cpu_matmul[/scan|unroll]],
the config's `model.remat`, `model.attention`, `model.cpu_matmul` ("auto" when left out) and
`model.scan_layers` ("scan" when left out)) in the same run; the first one is the one the ratio
and JSON line's "ours" refer to.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from gppo_jax.algorithm import objective
from gppo_jax.models import hf_checkpoint, sharding
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import experiment, train_step

# name -> (HF Qwen2 config fields, batch rows, sequence length)
SHAPES = {
  "small": (
    dict(
      vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
    ),
    8, 256,
  ),
  "tiny": (
    dict(
      vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    16, 256,
  ),
}  # fmt: skip
PROMPT_LEN = 32  # the response (the loss' tokens) is the rest of the sequence
LR = 1e-5
CLIP_EPS = 0.2


def build(shape: str, seed: int = 0):
  """(hf_model, our_model) of one shape with the same random weights."""
  from transformers import Qwen2Config, Qwen2ForCausalLM

  fields, _, length = SHAPES[shape]
  torch.manual_seed(seed)
  cfg = Qwen2Config(
    **fields, max_position_embeddings=max(4096, length), rope_theta=10000.0, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
  )  # fmt: skip
  hf = Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
  with tempfile.TemporaryDirectory() as tmp:
    hf.save_pretrained(tmp)
    ours = hf_checkpoint.load_model(tmp)
  hf.train()
  return hf, ours


def make_batch(shape: str, seed: int = 0) -> train_step.Batch:
  """A fixed rollout batch: rows x (prompt + response), every token real."""
  fields, rows, length = SHAPES[shape]
  rs = np.random.RandomState(seed)
  R = length + 1 - PROMPT_LEN
  prompt = rs.randint(3, fields["vocab_size"], size=(rows, PROMPT_LEN))
  resp = rs.randint(3, fields["vocab_size"], size=(rows, R))
  ones = lambda n: np.ones((rows, n), bool)
  # Behaviour log-probs near the random policy's (-log V) so ratios are ~1, some clipped.
  logq = -np.log(fields["vocab_size"]) + 0.3 * rs.randn(rows, R)
  adv = rs.randn(rows)
  return train_step.build_batch(prompt, ones(PROMPT_LEN), resp, ones(R), logq=logq, adv=adv)


def model_flops(shape: str) -> float:
  """Model FLOPs of one update step (forward + backward) on the shape's batch (plan.py)."""
  from gppo_jax import plan
  from gppo_jax.models import architectures

  fields, rows, T = SHAPES[shape]
  cfg = architectures.config_from_hf(dict(fields, model_type="qwen2"))
  return plan.update_flops(cfg, rows, T, T + 1 - PROMPT_LEN)


def variant_update(cfg, variant: str, dtype: str = "float32"):
  """(jitted update with the state donated, optimizer, spec) of our trainer for a model config
  and a variant 'remat/attention[/cpu_matmul[/scan|unroll]]' in compute `dtype`: the step both
  the timing and the memory figures use, compiled with the trainer's options
  (`sharding.update_compiler_options`)."""
  remat, attention, cpu_matmul, layers = parse_variant(variant)
  cfg = dataclasses.replace(
    cfg, remat=remat, attention=attention, scan_layers=layers == "scan", dtype=dtype
  )
  tx = train_step.make_optimizer(lr=LR, total_steps=1000, grad_clip=1.0)
  loss = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.0231)
  spec = train_step.UpdateSpec(prompt_len=PROMPT_LEN, loss=loss)
  update = train_step.make_update_fn(model_lib.abstract_graphdef(cfg), tx, spec)
  options = sharding.update_compiler_options(cpu_matmul, cfg.hidden_size, jax.default_backend())
  return jax.jit(update, donate_argnums=0, compiler_options=options), tx, spec


def parse_variant(variant: str) -> tuple[str, str, str, str]:
  """(remat, attention, cpu_matmul, layers) of 'remat/attention[/cpu_matmul[/scan|unroll]]'
  (cpu_matmul "auto" and layers "scan" when left out); ValueError for a malformed one."""
  parts = variant.split("/")
  if not 2 <= len(parts) <= 4:
    raise ValueError(f"expected remat/attention[/cpu_matmul[/scan|unroll]], got {variant!r}")
  remat, attention, cpu_matmul, layers = parts + ["auto", "scan"][len(parts) - 2 :]
  if cpu_matmul not in sharding.CPU_MATMULS or layers not in ("scan", "unroll"):
    raise ValueError(
      f"{variant!r}: cpu_matmul one of {', '.join(sharding.CPU_MATMULS)}; layers scan or unroll"
    )
  return remat, attention, cpu_matmul, layers


def ours_step(
  model: model_lib.Transformer, variant: str, batch: train_step.Batch, dtype: str = "float32"
):
  """run() -> one update step of our trainer, for a variant (`variant_update`)."""
  fn, tx, _ = variant_update(model.cfg, variant, dtype)
  _, params = nnx.split(model)
  state = train_step.TrainState(
    params=jax.tree.map(jnp.array, params), opt_state=tx.init(params), step=jnp.int32(0)
  )
  jbatch = jax.tree.map(jnp.asarray, batch)
  holder = {"state": state}
  t = time.perf_counter()
  exe = fn.lower(state, jbatch, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t

  def run():
    holder["state"], metrics = exe(holder["state"], jbatch, jax.random.key(1))
    jax.block_until_ready(metrics)

  return run, compile_s


def hf_step(hf, batch: train_step.Batch, dtype: str = "float32"):
  """run() -> one PPO step of the HF model: forward, loss on the response, backward, AdamW; the
  forward and backward under torch.autocast for a bfloat16 `dtype`."""
  opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0)
  inputs = torch.from_numpy(np.asarray(batch.inputs)).long()
  targets = torch.from_numpy(np.asarray(batch.targets[:, PROMPT_LEN - 1 :])).long()
  positions = torch.from_numpy(np.asarray(batch.positions)).long()
  attn = torch.from_numpy(np.asarray(batch.attn)).long()
  logq = torch.from_numpy(np.asarray(batch.logq))
  adv = torch.from_numpy(np.asarray(batch.adv))[:, None]
  mask = torch.from_numpy(np.asarray(batch.mask)).float()

  def run():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
      hidden = hf.model(input_ids=inputs, attention_mask=attn, position_ids=positions)[0]
      logits = hf.lm_head(hidden[:, PROMPT_LEN - 1 :])
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    ratio = torch.exp(logp - logq)
    per_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv)
    loss = (per_tok * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)

  return run


def logprob_agreement(hf, ours, batch) -> float:
  """Max |log-prob difference| of the response tokens, ours vs HF, same weights (sanity)."""
  fn = train_step.make_logprob_fn(nnx.graphdef(ours), prompt_len=PROMPT_LEN, temperature=1.0)
  mine = np.asarray(fn(nnx.state(ours), jax.tree.map(jnp.asarray, batch)))
  with torch.no_grad():
    logits = hf(input_ids=torch.from_numpy(np.asarray(batch.inputs)).long()).logits
    lp = torch.log_softmax(logits[:, PROMPT_LEN - 1 :], -1)
    t = torch.from_numpy(np.asarray(batch.targets[:, PROMPT_LEN - 1 :])).long()
    theirs = lp.gather(-1, t[..., None])[..., 0].numpy()
  return float(np.max(np.abs(mine - theirs)))


def matmul_gflops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
  """XLA's matmul rate on this machine for `dtype` operands, float32 accumulation (best of
  `repeats` n^3 products), GFLOP/s."""
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  return _best_gflops(lambda: dot(a, b).block_until_ready(), n, repeats)


def torch_matmul_gflops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
  """The same n^3 product in torch (its CPU BLAS), GFLOP/s: the rate HF's matmuls start from."""
  g = torch.Generator().manual_seed(0)
  a, b = (torch.randn(n, n, generator=g).to(getattr(torch, dtype)) for _ in range(2))
  return _best_gflops(lambda: torch.mm(a, b), n, repeats)


def _best_gflops(product, n: int, repeats: int) -> float:
  product()  # compile / warm up
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    product()
    best = min(best, time.perf_counter() - t)
  return 2 * n**3 / best / 1e9


def update_memory(shape: str, variants: list[str], lengths: list[int], dtype="float32") -> dict:
  """GiB of temporaries XLA's memory analysis reports for one update (compiled, never run) of
  the shape's model on one sequence of each length, per variant (`variant_update`)."""
  from gppo_jax.models import architectures

  fields, _, _ = SHAPES[shape]
  hf = dict(fields, model_type="qwen2", max_position_embeddings=max(lengths) + 1)
  base = architectures.config_from_hf(hf)
  out = {}
  for v in variants:
    fn, tx, spec = variant_update(base, v, dtype)
    state = train_step.abstract_train_state(base, tx)
    row = {}
    for T in lengths:
      batch = train_step.abstract_batch(1, PROMPT_LEN, T + 1 - PROMPT_LEN, spec)
      mem = fn.lower(state, batch, jax.random.key(0)).compile().memory_analysis()
      row[T] = round(mem.temp_size_in_bytes / 2**30, 4)
    out[v] = row
  return out


def paired_ratios(times: dict[str, list[float]], base: str = "hf") -> dict[str, list[float]]:
  """Per repeat round, base's time / each method's (above 1: faster than base). The rounds are
  interleaved, so each ratio compares two runs of the same minute; their spread shows how much
  of a median ratio is this machine's drift."""
  return {
    k: [b / t for b, t in zip(times[base], v, strict=True)] for k, v in times.items() if k != base
  }


def bench_shape(shape: str, variants: list[str], repeats: int, dtype: str = "float32") -> dict:
  hf, ours = build(shape)
  batch = make_batch(shape)
  agree = logprob_agreement(hf, ours, batch)
  methods, compile_s = {}, {}
  for v in variants:
    methods[f"ours[{v}]"], compile_s[v] = ours_step(ours, v, batch, dtype)
  methods["hf"] = hf_step(hf, batch, dtype)
  times = {k: [] for k in methods}
  for _ in range(repeats):
    for name, fn in methods.items():
      # Each timed step follows an untimed one of its own, as in a training loop: not straight
      # after the other side's step, whose allocations the two share this process' heap with.
      fn()
      t = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t)
  _, rows, T = SHAPES[shape]
  med = {k: statistics.median(v) for k, v in times.items()}
  tps = {k: rows * T / v for k, v in med.items()}
  gflops = {k: model_flops(shape) / v / 1e9 for k, v in med.items()}
  first = f"ours[{variants[0]}]"
  rounds = paired_ratios(times)
  return dict(
    shape=shape, batch=[rows, T], dtype=dtype, params_m=round(model_lib.param_count(ours) / 1e6, 2),
    logprob_max_abs_diff=agree, model_gflop_per_step=round(model_flops(shape) / 1e9, 2),
    step_s={k: round(v, 4) for k, v in med.items()},
    spread_s={k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
    tokens_per_s={k: round(v, 1) for k, v in tps.items()},
    gflops={k: round(v, 1) for k, v in gflops.items()},
    compile_s={k: round(v, 1) for k, v in compile_s.items()},
    ratio={k: round(tps[k] / tps["hf"], 3) for k in tps if k != "hf"},
    ratio_rounds={k: [round(min(v), 3), round(max(v), 3)] for k, v in rounds.items()},
    ours_vs_hf=round(tps[first] / tps["hf"], 3),
  )  # fmt: skip


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shape", default="both", choices=["both", *SHAPES])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--rows", type=int, default=0, help="batch rows (default: the shape's)")
  ap.add_argument(
    "--length", type=int, default=0, help=f"tokens per row, > {PROMPT_LEN} (default: the shape's)"
  )
  ap.add_argument(
    "--variants",
    default="",
    help="comma-separated remat/attention[/cpu_matmul] of ours (default: the trainer's)",
  )
  ap.add_argument(
    "--dtype",
    default="float32",
    choices=["float32", "bfloat16"],
    help="compute dtype of both sides (weights stay float32; HF: torch.autocast)",
  )
  ap.add_argument(
    "--memory",
    default="",
    help="comma-separated sequence lengths: instead of timing, print the compiled temporary "
    "memory of one update at batch 1 for each (e.g. 2048,4096,8192)",
  )
  args = ap.parse_args()
  # The trainer's host-memory setting (experiment.keep_cpu_memory), for both sides of the
  # comparison: they share this process. GPPO_CPU_MEMORY=release: glibc's and JAX's defaults.
  kept = experiment.keep_cpu_memory()
  torch.set_num_threads(2)
  defaults = model_lib.ModelConfig(1, 1, 1, 1, 1, 1, 2)
  variants = [v for v in args.variants.split(",") if v] or [
    f"{defaults.remat}/{defaults.attention}"
  ]
  for v in variants:
    try:
      parse_variant(v)
    except ValueError as e:
      ap.error(f"--variants entry: {e}")
  shapes = list(SHAPES) if args.shape == "both" else [args.shape]
  if args.length and args.length <= PROMPT_LEN:
    ap.error(f"--length {args.length}: rows are a {PROMPT_LEN}-token prompt + the response")
  for shape in shapes:  # a batch of another size for this run (e.g. --rows 1 --length 4096)
    fields, rows, length = SHAPES[shape]
    SHAPES[shape] = (fields, args.rows or rows, args.length or length)
  if args.memory:
    lengths = [int(t) for t in args.memory.split(",")]
    for shape in shapes:
      mem = update_memory(shape, variants, lengths, args.dtype)
      print(f"\n{shape}: compiled temporary memory of one update, batch 1, GiB")
      print(f"  {'variant':<20}" + "".join(f"{'T=' + str(t):>10}" for t in lengths))
      for v, row in mem.items():
        print(f"  {v:<20}" + "".join(f"{row[t]:>10.3f}" for t in lengths))
      print(json.dumps(dict(benchmark="train_step_memory", shape=shape, gib=mem)))
    return
  peak = matmul_gflops(dtype=args.dtype)
  torch_peak = torch_matmul_gflops(dtype=args.dtype)
  results = []
  for shape in shapes:
    r = bench_shape(shape, variants, args.repeats, args.dtype)
    results.append(r)
    print(
      f"\n{shape}: Qwen2 shape {r['params_m']}M params, batch {r['batch']}, {args.dtype}, "
      f"2 threads, {r['model_gflop_per_step']} model GFLOP/step; log-prob |ours - HF| <= "
      f"{r['logprob_max_abs_diff']:.1e}"
    )
    print(
      f"  {'method':<28}{'step s':>9}{'tok/s':>10}{'GFLOP/s':>9}{'of matmul':>10}{'vs HF':>7}"
      f"{'per round':>14}"
    )
    for k in r["step_s"]:
      ratio = r["ratio"].get(k, 1.0)
      lo_hi = r["ratio_rounds"].get(k)
      spread = f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}x" if lo_hi else ""  # none for HF itself
      print(
        f"  {k:<28}{r['step_s'][k]:>9.4f}{r['tokens_per_s'][k]:>10.0f}{r['gflops'][k]:>9.1f}"
        f"{r['gflops'][k] / peak:>10.1%}{ratio:>6.2f}x{spread:>14}"
      )
    print(f"  compile s (excluded): {r['compile_s']}")
    # The fastest ours could be: nothing but the model FLOPs, all at XLA's 2048^3 matmul rate.
    r["bound_s"] = round(r["model_gflop_per_step"] / peak, 6)
    r["bound_vs_hf"] = round(r["step_s"]["hf"] / r["bound_s"], 3)
    print(
      f"  matmul bound: the model FLOPs alone at XLA's matmul rate take {r['bound_s']:.4g} s, "
      f"at most {r['bound_vs_hf']:.2f}x HF"
    )
  print(
    f"\n{args.dtype} matmul (2048^3) on this machine: XLA {peak:.1f} GFLOP/s, torch "
    f"{torch_peak:.1f} GFLOP/s ({torch_peak / peak:.2f}x XLA's)"
  )
  print(f"host memory: {'kept for reuse' if kept else 'glibc and JAX defaults'} (GPPO_CPU_MEMORY)")
  summary = dict(
    benchmark="train_step",
    dtype=args.dtype,
    matmul_gflops=round(peak, 1),
    torch_matmul_gflops=round(torch_peak, 1),
    cpu_memory_kept=kept,
    shapes=results,
  )
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
