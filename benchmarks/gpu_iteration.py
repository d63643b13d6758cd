"""Whole RL iterations on an accelerator: where the time goes, and how close each part runs to
its hardware bound.

One prepared run for a GPU (or TPU) session, on whatever backend jax finds:

  python benchmarks/gpu_iteration.py                       # Qwen2.5-0.5B shape, bf16, 256 slots
  python benchmarks/gpu_iteration.py --arch tiny --dtype float32 --prompts 2 --group 2 \
    --slots 4 --new 32 --mean 8 --prompt-len 8 --micro 2 --iterations 2   # CPU smoke (a test)

Each iteration, as the trainer runs it (random weights, synthetic prompts):
1. sampling: `--prompts` x `--group` responses through continuous batching
   (`continuous.ContinuousSampler`, `--slots` slots, pages of `--page-size`), each row's length
   drawn from a lognormal distribution (mean `--mean`, capped at `--new`) and forced through
   `row_limits`;
2. log-probs: the trainer's recomputation of the behaviour log-probs (`make_logprob_fn`);
3. update: one optimizer step of the KL-Atomic loss on the batch cut to its longest response,
   in `--micro` rows per micro-batch (`make_update_fn`).
The first iteration compiles; the medians of the others are reported.

Bounds. Decode is bound by memory bandwidth: every step reads the weights once and each live
row's filled cache, so the rollout cannot beat (steps x weight bytes + sum over rows and steps of
the KV bytes held) / peak bandwidth; `decode_bound_frac` is that time over the measured sampling
time (prefills included). The update is bound by compute: `update_mfu` is `plan.update_flops`
over the update time and the chip's dense bf16 peak (`plan.PLATFORM_BF16_TFLOPS`). Peak
bandwidth comes from the device kind (`--bandwidth-gbs` to set it; None on CPU).

Ends with one JSON line (also written to `--json`).
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

from gppo_jax import plan  # noqa: E402
from gppo_jax.algorithm import objective  # noqa: E402
from gppo_jax.generation import continuous, paged, sampler  # noqa: E402
from gppo_jax.models import architectures  # noqa: E402
from gppo_jax.models import model as model_lib  # noqa: E402
from gppo_jax.trainer import train_step  # noqa: E402

# Peak HBM bandwidth, GB/s, by device kind (vendor figures).
BANDWIDTH_GBS = {
  "h200": 4800,
  "h100": 3350,
  "a100": 2039,
  "l4": 300,
  "v6e": 1640,
  "v5p": 2765,
  "v5e": 819,
  "v4": 1200,
}


def device_figure(table: dict, device) -> float | None:
  kind = device.device_kind.lower().replace(" ", "")
  for name in sorted(table, key=len, reverse=True):
    if name in kind or (name == "v5e" and "v5lite" in kind):
      return float(table[name])
  return None


def lengths(n: int, mean: float, cap: int, sigma: float, rng) -> np.ndarray:
  mu = np.log(mean) - sigma**2 / 2
  return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int32)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--arch", default="qwen2.5-0.5b")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--slots", type=int, default=256)
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--new", type=int, default=4096, help="max new tokens (the length cap)")
  ap.add_argument("--mean", type=float, default=1024.0, help="mean response length")
  ap.add_argument("--sigma", type=float, default=1.0)
  ap.add_argument("--page-size", type=int, default=64)
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--micro", type=int, default=8, help="rows per update micro-batch")
  ap.add_argument("--iterations", type=int, default=3)
  ap.add_argument("--bandwidth-gbs", type=float, default=0.0)
  ap.add_argument("--peak-tflops", type=float, default=0.0)
  ap.add_argument("--json", default="")
  args = ap.parse_args()

  device = jax.devices()[0]
  base = architectures.ARCHITECTURES[args.arch]
  P, N, G = args.prompt_len, args.new, args.group
  cfg = dataclasses.replace(
    base,
    dtype=args.dtype,
    param_dtype="float32",
    max_position_embeddings=max(base.max_position_embeddings, P + N),
  )
  graphdef, params = nnx.split(model_lib.create(cfg, 0))
  rng = np.random.default_rng(0)
  rows = args.prompts * G
  if rows % args.micro:
    raise SystemExit(f"--micro {args.micro} must divide the {rows} rows")
  sp = sampler.SamplingParams(max_new_tokens=N, pad_id=0)
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(args.slots, args.page_size, chunk=args.chunk)
  )
  P = -(-P // args.page_size) * args.page_size
  tx = train_step.make_optimizer(lr=1e-6, total_steps=10_000, grad_clip=1.0)
  loss = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.0231)
  spec = train_step.UpdateSpec(
    prompt_len=P, loss=loss, microbatches=rows // args.micro, group_size=G
  )
  update = jax.jit(train_step.make_update_fn(graphdef, tx, spec), donate_argnums=0)
  logprob_fn = jax.jit(
    train_step.make_logprob_fn(graphdef, prompt_len=P, temperature=1.0, group_size=G)
  )
  state = train_step.TrainState(params=params, opt_state=tx.init(params), step=jnp.int32(0))

  t = time.perf_counter()
  engine.warm_up(params, P, G)
  warm_s = time.perf_counter() - t
  kv_per_token = paged.kv_bytes_per_token(cfg)
  # The engine casts the weights to the compute dtype once per rollout; a step reads that copy.
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  weight_bytes = sum(x.size * itemsize for x in jax.tree.leaves(params))
  split = {k: [] for k in ("sample_s", "logprobs_s", "update_s", "iteration_s")}
  figures = []
  for it in range(args.iterations + 1):
    prompts = [
      list(rng.integers(3, cfg.vocab_size, int(rng.integers(P // 2, P + 1))))
      for _ in range(args.prompts)
    ]
    limits = lengths(rows, args.mean, N, args.sigma, rng)
    t0 = time.perf_counter()
    out = engine(
      state.params, prompts, jax.random.key(it), group_size=G, prompt_len=P, row_limits=limits
    )
    t1 = time.perf_counter()
    p_tok, p_mask = sampler.left_pad([p for p in prompts for _ in range(G)], pad_id=0, length=P)
    batch = train_step.build_batch(
      p_tok, p_mask, out.tokens, out.mask, logq=out.logprobs,
      adv=rng.standard_normal(rows).astype(np.float32),
    )  # fmt: skip
    keep = -(-int(out.lengths.max()) // 256) * 256  # bucketed, as train.trim_bucket does
    batch = train_step.trim_responses(batch, P, min(keep, N))
    batch = jax.tree.map(jnp.asarray, batch)
    logq = jax.block_until_ready(logprob_fn(state.params, batch))
    batch = batch.replace(logq=logq)
    t2 = time.perf_counter()
    state, metrics = update(state, batch, jax.random.key(it))
    jax.block_until_ready(metrics)
    t3 = time.perf_counter()
    if it == 0:
      compile_iteration_s = t3 - t0
      continue
    for k, v in zip(split, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
      split[k].append(v)
    L = out.lengths.astype(np.float64)
    kv_read = kv_per_token * float(np.sum((L - 1) * P + L * (L - 1) / 2))
    steps = engine.stats["decode_steps"]
    R = batch.logq.shape[1]
    figures.append(
      dict(
        tokens=float(L.sum()),
        decode_bytes=steps * weight_bytes + kv_read,
        flops=plan.update_flops(cfg, rows, P + R - 1, R),
        steps=steps,
        preempted=engine.stats.get("preempted", 0),
      )
    )

  med = {k: statistics.median(v) for k, v in split.items()}
  bw = (args.bandwidth_gbs or device_figure(BANDWIDTH_GBS, device) or 0) * 1e9
  peak = args.peak_tflops or device_figure(plan.PLATFORM_BF16_TFLOPS, device) or 0
  fig = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
  report = dict(
    device=device.device_kind,
    backend=jax.default_backend(),
    arch=args.arch,
    dtype=args.dtype,
    slots=args.slots,
    rows=rows,
    **{k: round(v, 3) for k, v in med.items()},
    rollout_tokens_per_s=round(fig["tokens"] / med["sample_s"], 1),
    decode_bound_frac=round(fig["decode_bytes"] / bw / med["sample_s"], 3) if bw else None,
    update_mfu=round(fig["flops"] / med["update_s"] / (peak * 1e12), 3) if peak else None,
    update_tflops=round(fig["flops"] / med["update_s"] / 1e12, 3),
    decode_steps=fig["steps"],
    preempted=fig["preempted"],
    mean_len=round(fig["tokens"] / rows, 1),
    warm_up_s=round(warm_s, 2),
    first_iteration_s=round(compile_iteration_s, 2),
  )
  for k, v in report.items():
    print(f"{k:>22}: {v}")
  line = json.dumps(report)
  if args.json:
    with open(args.json, "w") as f:
      f.write(line + "\n")
  print(line)


if __name__ == "__main__":
  main()
