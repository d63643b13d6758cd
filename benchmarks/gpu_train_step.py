"""The update step on an accelerator: model-FLOPs utilisation (MFU) and long-context memory.

One prepared run for a GPU (or TPU) session, on whatever backend jax finds:

  python benchmarks/gpu_train_step.py                         # Qwen2.5-0.5B shape, bf16,
                                                              # remat attention and dots
  python benchmarks/gpu_train_step.py --variants dots/auto,dots/auto/unroll --batch 16 \
    --long 8192,16384,32768                                   # docs/performance.md's H200 figures
  python benchmarks/gpu_train_step.py --variants dots/auto/unroll,dots/auto/unroll/one,\
dots/auto/unroll/c512 --batch 16 --long ''                  # the head: chunks or one piece
  python benchmarks/gpu_train_step.py --arch tiny --batch 2 --length 128 --long 256 --steps 2
                                                              # a CPU smoke run of the script

0. Ceiling and parity. XLA's own bf16 matmul rate on the device (an n^3 `jnp.dot`, the best
   MFU a step of matmuls could reach here), and the backend's "auto" attention (cuDNN on GPU,
   splash on TPU) and `blockwise` against the dense float32 reference on padded rows: relative
   error of the output and of the q, k, v gradients.
1. Timing. The trainer's own update (`train_step.make_update_fn`: forward with `model.attention`
   and `model.remat`, the chunked log-prob head on the response tokens, the KL-Atomic loss,
   gradient clipping, AdamW; jitted, state donated) takes `--steps` optimizer steps on a fixed
   batch of `--batch` x `--length` tokens (the last `--length - --prompt` carry the loss) of a
   named architecture (`--arch`, models/architectures.py) with random weights. Compute dtype
   `--dtype` (bf16), parameters and optimizer state in `--param-dtype` (float32: the usual mixed
   precision). Per variant remat/attention[/scan|unroll[/head]] (`model.remat`,
   `model.attention`, `model.scan_layers`, and how the log-prob head walks the response:
   `head_chunking`, e.g. dots/auto/unroll/one) it reports the median step time, tokens/s,
   achieved model TFLOP/s (`plan.update_flops`: no credit for recomputation) and MFU against
   the chip's dense bf16 peak (`plan.PLATFORM_BF16_TFLOPS`, from the device kind;
   `--peak-tflops` to set it) and against XLA's matmul rate. `--profile DIR` traces the first
   variant (or `--profile-variant`) and prints its top kernels.
2. Long context. For each of `--long` T: XLA's compiled temporaries of one update on one sequence
   of T tokens, and where it fits, one executed step with the device's peak bytes in use
   (`memory_stats`, where the backend reports it; "peak_gib_at_most" where an earlier part of
   the run had already reached a higher peak).

Prints a table and ends with one JSON line (also written to `--json`). A part that fails is
reported with its error and the run goes on. Nothing here is a test: figures go in the README's
Performance section with the command, the device and the date.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gppo_jax import plan
from gppo_jax.algorithm import objective
from gppo_jax.models import architectures, attention
from gppo_jax.models import heads as heads_lib
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import train_step

GIB = 2**30


def peak_tflops(device) -> float | None:
  """Dense bf16 peak of `device` from its kind ('NVIDIA H200', 'TPU v5p' ...), or None."""
  kind = device.device_kind.lower().replace(" ", "")
  for name in sorted(plan.PLATFORM_BF16_TFLOPS, key=len, reverse=True):
    if name in kind or (name == "v5e" and "v5lite" in kind):
      return float(plan.PLATFORM_BF16_TFLOPS[name])
  return None


def matmul_tflops(n: int, chain: int = 10, repeats: int = 5) -> float:
  """XLA's bf16 matmul rate on the default device, TFLOP/s: `chain` dependent n^3 products of
  random (not zero) operands in one compiled call, the median of `repeats` calls after two
  warm-ups (one product per call would leave launch and dispatch gaps in the figure)."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = (jax.random.normal(kb, (n, n), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
  run = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda i, x: x @ b, a))
  for _ in range(2):
    run(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    run(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 * chain / statistics.median(times) / 1e12


def attention_parity(cfg: architectures.ModelConfig, length: int, name: str, rows: int = 2) -> dict:
  """Attention implementation `name` in `cfg.dtype` against the dense reference in float32 on
  the same (rounded) inputs, with `cfg`'s heads: row 0 left- and right-padded, row 1 full.
  Relative L2 error over real tokens of the output, and of the gradients of a random linear
  function of the real outputs with respect to q, k and v."""
  keys = jax.random.split(jax.random.key(1), 4)
  H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q = jax.random.normal(keys[0], (rows, length, H, Dh), cfg.dtype)
  k = jax.random.normal(keys[1], (rows, length, K, Dh), cfg.dtype)
  v = jax.random.normal(keys[2], (rows, length, K, Dh), cfg.dtype)
  w = jax.random.normal(keys[3], (rows, length, H, Dh), jnp.float32)
  pos = jnp.arange(length)
  mask = jnp.ones((rows, length), bool).at[0].set((pos >= length // 8) & (pos < length - 16))
  real = mask[:, :, None, None]

  def loss(impl, q, k, v):
    out = attention.attention(q, k, v, mask, impl=impl).astype(jnp.float32)
    return jnp.sum(jnp.where(real, out * w, 0.0)), out

  def run(impl, *qkv):
    (_, out), grads = jax.jit(
      jax.value_and_grad(functools.partial(loss, impl), (0, 1, 2), has_aux=True)
    )(*qkv)
    return out, grads

  out, grads = run(name, q, k, v)
  ref, ref_grads = run("dense", *(x.astype(jnp.float32) for x in (q, k, v)))
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  result = {"out": rel(jnp.where(real, out, 0.0), jnp.where(real, ref, 0.0))}
  for label, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
    result[label] = rel(g.astype(jnp.float32), r)
  return {key: (float(f"{x:.3g}") if isinstance(x, float) else x) for key, x in result.items()}


LAYERS = {"scan": True, "unroll": False}  # a variant's third field: model.scan_layers


def head_chunking(variant: str) -> str:
  """A variant's fourth field, how the log-prob head walks the response: "auto" (the model's
  rule: one piece up to heads.ONE_CHUNK_BYTES of float32 logits, else checkpointed chunks of
  heads.CHUNK_SIZE positions), "one" (one piece at any size: no recomputed head, all the logits
  in memory at once) or "c<N>" (chunks of N positions). ValueError for anything else."""
  parts = variant.split("/")
  head = parts[3] if len(parts) > 3 else "auto"
  if head not in ("auto", "one") and not (
    head[:1] == "c" and head[1:].isdigit() and head[1:] != "0"
  ):
    raise ValueError(f"head {head!r}: auto, one or c<positions> (e.g. c512)")
  return head


@contextlib.contextmanager
def head_setting(head: str):
  """model's head chunking set to `head` (`head_chunking`) while a variant's update traces."""
  saved = heads_lib.ONE_CHUNK_BYTES, heads_lib.CHUNK_SIZE
  if head == "one":
    heads_lib.ONE_CHUNK_BYTES = 1 << 62
  elif head != "auto":
    heads_lib.ONE_CHUNK_BYTES, heads_lib.CHUNK_SIZE = 0, int(head[1:])
  try:
    yield
  finally:
    heads_lib.ONE_CHUNK_BYTES, heads_lib.CHUNK_SIZE = saved


def model_config(args, variant: str) -> architectures.ModelConfig:
  """The model of variant "remat/attention[/scan|unroll[/head]]"; ValueError for a bad one."""
  remat, attn, *rest = variant.split("/")
  layers = rest[0] if rest else "scan"
  if len(rest) > 2 or layers not in LAYERS:
    raise ValueError(f"expected remat/attention[/scan|unroll[/head]], got {variant!r}")
  head_chunking(variant)
  base = architectures.ARCHITECTURES[args.arch]
  return dataclasses.replace(
    base,
    dtype=args.dtype,
    param_dtype=args.param_dtype,
    remat=remat,
    attention=attn,
    scan_layers=LAYERS[layers],
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
  with head_setting(head_chunking(variant)):
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
  top = None
  if args.profile and variant == args.profile_variant:

    def one_step(i):  # the state is donated: each step takes the last one's
      nonlocal state
      state, out = exe(state, batch, jax.random.key(i))
      return out

    top = profile_kernels(one_step, args.profile, step)
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
    **({"profile": top} if top else {}),
  )


def profile_kernels(step, logdir: str, step_s: float, steps: int = 3, top: int = 25) -> dict:
  """Trace `steps` calls of step(i) with jax.profiler (a Perfetto trace under `logdir`) and
  print where the device's time goes: busy time per step and the `top` kernels (or, on a CPU,
  host ops) by total time, each as a share of the step. Returns that table."""
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for i in range(steps):
      jax.block_until_ready(step(100 + i))
  path = sorted(glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True))
  with gzip.open(path[-1]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs = {
    e["pid"]: e["args"]["name"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  threads = {
    (e["pid"], e["tid"]): e["args"]["name"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  device = {pid for pid, name in procs.items() if "/device:" in name}
  wanted = device or set(procs)  # a CPU backend has host threads only
  # A GPU's device rows repeat each kernel under "XLA Ops" / "XLA Modules": count the streams.
  streams = {key for key, name in threads.items() if key[0] in device and "Stream" in name}
  total = collections.Counter()
  for e in events:
    if (
      e.get("ph") == "X"
      and e.get("pid") in wanted
      and (not streams or (e["pid"], e.get("tid")) in streams)
    ):
      total[e["name"][:90]] += e.get("dur", 0.0) / 1e6 / steps  # s per step
  busy = sum(total.values()) if device else None
  print(
    f"    profile: {f'device busy {busy:.4f} s of a {step_s:.4f} s step; ' if busy else ''}"
    f"top {top} by time per step (trace in {logdir}"
    f"{'; rows ' + ', '.join(sorted({threads[k] for k in streams})) if streams else ''})",
    flush=True,
  )
  rows = total.most_common(top)
  for name, sec in rows:
    print(f"    {sec * 1e3:9.2f} ms {100 * sec / step_s:5.1f}%  {name}", flush=True)
  return {"busy_s": busy, "top_ms": {name: round(sec * 1e3, 3) for name, sec in rows}}


def long_context(args, variant: str, length: int) -> dict:
  cfg = model_config(args, variant)
  fn, tx, spec = make_update(cfg, args.prompt)
  state = train_step.abstract_train_state(cfg, tx)
  batch = train_step.abstract_batch(1, args.prompt, length + 1 - args.prompt, spec)
  with head_setting(head_chunking(variant)):
    exe = fn.lower(state, batch, jax.random.key(0)).compile()
  mem = exe.memory_analysis()
  out = {"temp_gib": round(mem.temp_size_in_bytes / GIB, 3) if mem is not None else None}
  device = jax.devices()[0]
  capacity = (device.memory_stats() or {}).get("bytes_limit")
  if args.run_long and (capacity is None or mem is None or mem.temp_size_in_bytes < capacity):
    real = init_state(cfg, tx)
    real_batch = random_batch(cfg.vocab_size, 1, length, args.prompt)
    # The device's peak is the process's so far (it cannot be reset): it is this step's only
    # where the step raises it; else the step stayed below it ("peak_gib_at_most").
    before = (device.memory_stats() or {}).get("peak_bytes_in_use")
    t = time.perf_counter()
    real, metrics = exe(real, real_batch, jax.random.key(0))
    jax.block_until_ready(metrics)
    out["step_s"] = round(time.perf_counter() - t, 3)
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    if peak is not None:
      out["peak_gib" if before is None or peak > before else "peak_gib_at_most"] = round(
        peak / GIB, 3
      )
    del real
  return out


def guarded(label: str, fn, *args) -> dict:
  """fn(*args), or {"error": ...} with the traceback printed: one failing part of a prepared
  accelerator run must not cost the others."""
  try:
    return fn(*args)
  except Exception as e:  # noqa: BLE001 - reported, and the run goes on
    traceback.print_exc()
    print(f"  {label}: FAILED: {type(e).__name__}: {e}"[:2000], flush=True)
    return {"error": f"{type(e).__name__}: {e}"[:2000]}


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
    "--variants",
    default="attention/auto,dots/auto,dots/auto/unroll",
    help="remat/attention[/scan|unroll[/head]] variants, comma-separated (head: auto, one, c<N>)",
  )
  ap.add_argument("--long", default="8192", help="long-context lengths (batch 1), '' for none")
  ap.add_argument(
    "--no-run-long", dest="run_long", action="store_false", help="compile the long steps only"
  )
  ap.add_argument("--peak-tflops", type=float, default=None, help="the chip's bf16 peak")
  ap.add_argument(
    "--matmul-n", type=int, default=None, help="n of the n^3 matmul (8192; 1024 on CPU); 0: skip"
  )
  ap.add_argument(
    "--no-parity", dest="parity", action="store_false", help="skip the attention parity check"
  )
  ap.add_argument("--profile", default=None, help="trace 3 steps into this folder, print the top")
  ap.add_argument("--profile-variant", default=None, help="the variant to trace (the first)")
  ap.add_argument("--json", default=None, help="also write the JSON line to this file")
  args = ap.parse_args()
  args.long = [int(x) for x in args.long.split(",") if x.strip()]
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  if args.prompt >= args.length:
    ap.error(f"--prompt {args.prompt} must be shorter than --length {args.length}")
  args.profile_variant = args.profile_variant or variants[0]
  for v in variants:  # a typo fails now, not after minutes of device time
    try:
      model_config(args, v)
    except ValueError as e:
      ap.error(f"--variants entry {v!r} (remat/attention[/scan|unroll[/head]]): {e}")

  device = jax.devices()[0]
  peak = args.peak_tflops or peak_tflops(device)
  cfg = model_config(args, variants[0])
  params = model_lib.param_count(
    nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  )
  print(
    f"{args.arch} ({params / 1e6:.1f}M params), {args.dtype} compute / {args.param_dtype} "
    f"params, batch {args.batch} x {args.length} tokens; {device.device_kind} "
    f"({jax.default_backend()}, jax {jax.__version__}, flax {flax.__version__}), bf16 peak "
    f"{f'{peak:g} TFLOP/s' if peak else 'unknown (--peak-tflops)'}",
    flush=True,
  )
  n = args.matmul_n if args.matmul_n is not None else (1024 if device.platform == "cpu" else 8192)
  matmul = (
    guarded("matmul", lambda: {"n": n, "tflops": float(f"{matmul_tflops(n):.4g}")}) if n else {}
  )
  if "tflops" in matmul:
    print(f"  XLA bf16 matmul {n}^3: {matmul['tflops']:.1f} TFLOP/s", flush=True)
  parity = {}
  auto = attention.resolve("auto", seq_len=args.length, dtype=cfg.dtype, head_dim=cfg.head_dim)
  for name in dict.fromkeys((auto, "blockwise")) if args.parity else ():
    parity[name] = guarded(f"{name} parity", attention_parity, cfg, args.length, name)
    print(f"  {name} attention vs dense float32, relative L2 error: {parity[name]}", flush=True)
  timing = {}
  for v in variants:
    r = timing[v] = guarded(v, time_variant, args, v)
    if "error" in r:
      continue
    if peak:
      r["mfu"] = round(r["tflops"] / peak, 4)
    if matmul.get("tflops"):
      r["of_matmul"] = round(r["tflops"] / matmul["tflops"], 4)
    mfu = f"{100 * r['mfu']:.1f}%" if peak else "n/a"
    print(
      f"  {v:<16} [{r['attention']}] step {r['step_s']:.4f} s, {r['tokens_per_s']:,.0f} tok/s, "
      f"{r['tflops']:.1f} TFLOP/s, MFU {mfu} (compile {r['compile_s']} s)",
      flush=True,
    )
  memory = {}
  for T in args.long:
    memory[T] = guarded(f"T = {T}", long_context, args, variants[0], T)
    print(f"  T = {T:>6}, batch 1, {variants[0]}: {memory[T]}", flush=True)
  line = json.dumps(
    dict(
      arch=args.arch,
      params_m=round(params / 1e6, 1),
      device=device.device_kind,
      backend=jax.default_backend(),
      jax=jax.__version__,
      flax=flax.__version__,
      dtype=args.dtype,
      param_dtype=args.param_dtype,
      batch=[args.batch, args.length],
      peak_tflops=peak,
      matmul=matmul,
      attention_parity=parity,
      timing=timing,
      long_context=memory,
    )
  )
  print(line)
  if args.json:
    with open(args.json, "w") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
