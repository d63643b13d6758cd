"""The update step on an accelerator: model-FLOPs utilisation (MFU) and long-context memory.

One prepared run for a GPU (or TPU) session, on whatever backend jax finds:

  python benchmarks/gpu_train_step.py                         # Qwen2.5-0.5B shape, bf16
  python benchmarks/gpu_train_step.py --variants full/auto,dots/auto,none/auto --long 8192,16384
  python benchmarks/gpu_train_step.py --arch tiny --batch 2 --length 128 --long 256 --steps 2
                                                              # a CPU smoke run of the script

1. Timing. The trainer's own update (`train_step.make_update_fn`: forward with `model.attention`
   and `model.remat`, the chunked log-prob head on the response tokens, the KL-Atomic loss,
   gradient clipping, AdamW; jitted, state donated) takes `--steps` optimizer steps on a fixed
   batch of `--batch` x `--length` tokens (the last `--length - --prompt` carry the loss) of a
   named architecture (`--arch`, gppo_jax/architectures.py) with random weights. Compute dtype
   `--dtype` (bf16), parameters and optimizer state in `--param-dtype` (float32: the usual mixed
   precision). Per variant remat/attention it reports the median step time, tokens/s, achieved
   model TFLOP/s (`plan.update_flops`: no credit for recomputation) and MFU against the chip's
   dense bf16 peak (`plan.PLATFORM_BF16_TFLOPS`, from the device kind; `--peak-tflops` to set it).
2. Long context. For each of `--long` T: XLA's compiled temporaries of one update on one sequence
   of T tokens, and where it fits, one executed step with the device's peak bytes in use
   (`memory_stats`, where the backend reports it).

Prints a table and ends with one JSON line. Nothing here is a test: figures go in the README's
Performance section with the command, the device and the date.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gppo_jax import architectures, attention, objective, plan, train_step  # noqa: E402
from gppo_jax import model as model_lib  # noqa: E402

GIB = 2**30


def peak_tflops(device) -> float | None:
  """Dense bf16 peak of `device` from its kind ('NVIDIA H200', 'TPU v5p' ...), or None."""
  kind = device.device_kind.lower().replace(" ", "")
  for name in sorted(plan.PLATFORM_BF16_TFLOPS, key=len, reverse=True):
    if name in kind or (name == "v5e" and "v5lite" in kind):
      return float(plan.PLATFORM_BF16_TFLOPS[name])
  return None


def model_config(args, variant: str) -> architectures.ModelConfig:
  remat, attn = variant.split("/")
  base = architectures.ARCHITECTURES[args.arch]
  return dataclasses.replace(
    base,
    dtype=args.dtype,
    param_dtype=args.param_dtype,
    remat=remat,
    attention=attn,
    max_position_embeddings=max(base.max_position_embeddings, args.length, *args.long),
  )


def make_update(cfg: architectures.ModelConfig, prompt: int):
  tx = train_step.make_optimizer(lr=1e-6, total_steps=10_000, grad_clip=1.0)
  loss = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.0231)
  spec = train_step.UpdateSpec(prompt_len=prompt, loss=loss)
  fn = train_step.make_update_fn(model_lib.abstract_graphdef(cfg), tx, spec)
  return jax.jit(fn, donate_argnums=0), tx, spec


def random_batch(vocab: int, rows: int, length: int, prompt: int, seed: int = 0):
  """A fixed batch of `rows` sequences of `length` real tokens; behaviour log-probs near the
  random policy's so that ratios are about 1 (some masked), advantages standard normal."""
  rs = np.random.RandomState(seed)
  R = length + 1 - prompt
  ones = lambda n: np.ones((rows, n), bool)
  batch = train_step.build_batch(
    rs.randint(3, vocab, size=(rows, prompt)),
    ones(prompt),
    rs.randint(3, vocab, size=(rows, R)),
    ones(R),
    logq=-np.log(vocab) + 0.3 * rs.randn(rows, R),
    adv=rs.randn(rows),
  )
  return jax.tree.map(jnp.asarray, batch)


def init_state(cfg, tx, seed: int = 0) -> train_step.TrainState:
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(seed))
  params = nnx.state(model)
  return train_step.TrainState(params=params, opt_state=tx.init(params), step=jnp.int32(0))


def time_variant(args, variant: str) -> dict:
  cfg = model_config(args, variant)
  fn, tx, _ = make_update(cfg, args.prompt)
  state = init_state(cfg, tx)
  batch = random_batch(cfg.vocab_size, args.batch, args.length, args.prompt)
  t = time.perf_counter()
  exe = fn.lower(state, batch, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t
  times = []
  for i in range(args.steps + 1):  # the first step is a warm-up
    t = time.perf_counter()
    state, metrics = exe(state, batch, jax.random.key(i))
    jax.block_until_ready(metrics)
    if i:
      times.append(time.perf_counter() - t)
  step = statistics.median(times)
  flops = plan.update_flops(cfg, args.batch, args.length, args.length + 1 - args.prompt)
  loss = float(np.mean(np.asarray(metrics["loss/total"])))
  return dict(
    attention=attention.resolve(
      cfg.attention, seq_len=args.length, dtype=cfg.dtype, head_dim=cfg.head_dim
    ),
    compile_s=round(compile_s, 1),
    step_s=round(step, 4),
    spread_s=[round(min(times), 4), round(max(times), 4)],
    tokens_per_s=round(args.batch * args.length / step, 1),
    tflops=float(f"{flops / step / 1e12:.4g}"),  # 4 significant digits: tiny CPU runs too
    loss_finite=bool(np.isfinite(loss)),
  )


def long_context(args, variant: str, length: int) -> dict:
  cfg = model_config(args, variant)
  fn, tx, spec = make_update(cfg, args.prompt)
  state = train_step.abstract_train_state(cfg, tx)
  batch = train_step.abstract_batch(1, args.prompt, length + 1 - args.prompt, spec)
  exe = fn.lower(state, batch, jax.random.key(0)).compile()
  mem = exe.memory_analysis()
  out = {"temp_gib": round(mem.temp_size_in_bytes / GIB, 3) if mem is not None else None}
  device = jax.devices()[0]
  capacity = (device.memory_stats() or {}).get("bytes_limit")
  if args.run_long and (capacity is None or mem is None or mem.temp_size_in_bytes < capacity):
    real = init_state(cfg, tx)
    real_batch = random_batch(cfg.vocab_size, 1, length, args.prompt)
    t = time.perf_counter()
    real, metrics = exe(real, real_batch, jax.random.key(0))
    jax.block_until_ready(metrics)
    out["step_s"] = round(time.perf_counter() - t, 3)
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      out["peak_gib"] = round(stats["peak_bytes_in_use"] / GIB, 3)
    del real
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--arch", default="qwen2.5-0.5b", choices=sorted(architectures.ARCHITECTURES))
  ap.add_argument("--dtype", default="bfloat16", choices=sorted(architectures.DTYPES))
  ap.add_argument("--param-dtype", default="float32", choices=sorted(architectures.DTYPES))
  ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
  ap.add_argument("--length", type=int, default=2048, help="tokens per sequence")
  ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (no loss)")
  ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
  ap.add_argument(
    "--variants", default="full/auto,dots/auto", help="remat/attention pairs, comma-separated"
  )
  ap.add_argument("--long", default="8192", help="long-context lengths (batch 1), '' for none")
  ap.add_argument(
    "--no-run-long", dest="run_long", action="store_false", help="compile the long steps only"
  )
  ap.add_argument("--peak-tflops", type=float, default=None, help="the chip's bf16 peak")
  args = ap.parse_args()
  args.long = [int(x) for x in args.long.split(",") if x.strip()]
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  if args.prompt >= args.length:
    ap.error(f"--prompt {args.prompt} must be shorter than --length {args.length}")

  device = jax.devices()[0]
  peak = args.peak_tflops or peak_tflops(device)
  cfg = model_config(args, variants[0])
  params = model_lib.param_count(
    nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  )
  print(
    f"{args.arch} ({params / 1e6:.1f}M params), {args.dtype} compute / {args.param_dtype} "
    f"params, batch {args.batch} x {args.length} tokens; {device.device_kind} "
    f"({jax.default_backend()}, jax {jax.__version__}), bf16 peak "
    f"{f'{peak:g} TFLOP/s' if peak else 'unknown (--peak-tflops)'}",
    flush=True,
  )
  timing = {}
  for v in variants:
    r = time_variant(args, v)
    if peak:
      r["mfu"] = round(r["tflops"] / peak, 4)
    timing[v] = r
    mfu = f"{100 * r['mfu']:.1f}%" if peak else "n/a"
    print(
      f"  {v:<16} [{r['attention']}] step {r['step_s']:.4f} s, {r['tokens_per_s']:,.0f} tok/s, "
      f"{r['tflops']:.1f} TFLOP/s, MFU {mfu} (compile {r['compile_s']} s)",
      flush=True,
    )
  memory = {}
  for T in args.long:
    memory[T] = long_context(args, variants[0], T)
    print(f"  T = {T:>6}, batch 1, {variants[0]}: {memory[T]}", flush=True)
  print(
    json.dumps(
      dict(
        arch=args.arch,
        params_m=round(params / 1e6, 1),
        device=device.device_kind,
        backend=jax.default_backend(),
        jax=jax.__version__,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        batch=[args.batch, args.length],
        peak_tflops=peak,
        timing=timing,
        long_context=memory,
      )
    )
  )


if __name__ == "__main__":
  main()
