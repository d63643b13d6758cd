"""A rollout at long-tailed response lengths: continuous batching against the fixed-batch sampler.

N prompts x G samples on the small Qwen2 shape (random weights, float32). Each row's response
length is drawn from a lognormal distribution (mean --mean, capped at --new) and forced on both
paths through `row_limits` (no stop token), so both generate exactly the same tokens. By default
both sides run as the trainer runs them (`rollout.engine` "fixed" or "continuous" with the
config's defaults):

- fixed: the fixed-batch sampler (`sampler.sample_jit`) on all rows at once, decoding until the
  longest row ends (--waves W: in consecutive batches of W rows instead, each until its own
  longest row ends);
- continuous: `continuous.ContinuousSampler` with a slot for every row (`rollout.slots=0`; --slots
  S: S slots), pages of 16 cache slots and the default pool (`rollout.page_size`, `kv_pages`).

Both use the same row keys (`sampler.row_keys`), so they draw the same tokens until a float
rounding difference between their attention kernels flips a draw (`rows_identical`: the share of
rows equal throughout; on long responses of a 32k vocabulary a few diverge). Each path compiles
on the benchmark's shapes first, then runs --repeats times interleaved; medians are compared.
Its last line is JSON: speedup (fixed wall / continuous wall), kv_ratio (the continuous pool's
bytes / the fixed batch's cache bytes), kv_used_ratio (peak pages in use instead of the
pool), useful_tokens_per_s (generated tokens / continuous wall), the figures behind them and the
engine's counters (busy_share: rows decoded / rows computed; batch_sizes: the running batch's
sizes).

  python benchmarks/rollout.py [--prompts 16 --group 4 --mean 256 --new 1024]
  python benchmarks/rollout.py --mean 128 --new 512
  python benchmarks/rollout.py --waves 16 --slots 16        # 16-row waves against 16 slots
  python benchmarks/rollout.py --prompts 4 --group 2 --mean 16 --new 64 --shape tiny   # seconds
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gppo_jax.generation import continuous, sampler  # noqa: E402
from gppo_jax.models import architectures  # noqa: E402
from gppo_jax.models import model as model_lib  # noqa: E402

# The small Qwen2 shape of benchmarks/sampler.py and train_step.py (~44M parameters).
SMALL_QWEN2 = architectures.ModelConfig(
  32000, 512, 1408, 4, 8, 2, 64, attention_bias=True, family="qwen2", pad_token_id=0
)
TINY = architectures.ModelConfig(512, 64, 128, 2, 4, 2, 16, family="qwen2", pad_token_id=0)


def lengths(n: int, mean: float, cap: int, sigma: float, seed: int) -> np.ndarray:
  """n lognormal lengths with mean `mean` before the cap, in [1, cap]."""
  mu = np.log(mean) - sigma**2 / 2
  draw = np.random.default_rng(seed).lognormal(mu, sigma, n)
  return np.clip(np.round(draw), 1, cap).astype(np.int32)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
  ap.add_argument("--slots", type=int, default=0, help="decode slots (0: one per row)")
  ap.add_argument("--waves", type=int, default=0, help="fixed batch rows (0: all rows at once)")
  ap.add_argument("--prompt-len", type=int, default=64)
  ap.add_argument("--new", type=int, default=1024, help="max new tokens (the length cap)")
  ap.add_argument("--mean", type=float, default=256.0, help="mean response length")
  ap.add_argument("--sigma", type=float, default=1.0, help="lognormal shape")
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--chunk", type=int, default=32)
  ap.add_argument("--pages", type=int, default=0, help="pool pages (0: the engine's default)")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--shape", choices=("small", "tiny"), default="small")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  G, N, P = args.group, args.new, args.prompt_len
  rows = args.prompts * G
  S, W = args.slots or rows, args.waves or rows
  if W % G:
    raise SystemExit(f"--waves {W} must be a multiple of --group {G} (whole groups per batch)")
  cfg = SMALL_QWEN2 if args.shape == "small" else TINY
  graphdef, params = nnx.split(model_lib.create(cfg, args.seed))
  rng = np.random.default_rng(args.seed)
  prompts = [
    list(rng.integers(3, cfg.vocab_size, int(rng.integers(P // 2, P + 1))))
    for _ in range(args.prompts)
  ]
  limits = lengths(args.prompts * G, args.mean, N, args.sigma, args.seed)
  key = jax.random.key(args.seed)
  sp = sampler.SamplingParams(max_new_tokens=N, pad_id=0)
  engine_cfg = continuous.EngineConfig(
    slots=S, page_size=args.page_size, chunk=args.chunk, num_pages=args.pages or None
  )
  engine = continuous.ContinuousSampler(graphdef, sp, engine_cfg)
  P = -(-P // args.page_size) * args.page_size  # both paths pad prompts alike
  tokens, mask = sampler.left_pad([p for p in prompts for _ in range(G)], pad_id=0, length=P)
  keys = sampler.row_keys(
    key, np.repeat(np.arange(args.prompts), G), np.tile(np.arange(G), args.prompts)
  )

  def fixed(n_rows: int):
    outs = []
    for b in range(0, n_rows, W):
      part = slice(b, b + W)
      out = sampler.sample_jit(
        graphdef, params, tokens[part], mask[part], keys[part], sp, group_size=G,
        row_limits=jnp.asarray(limits[part]),
      )  # fmt: skip
      outs.append(jax.device_get(out.tokens))
    return np.concatenate(outs)

  def cont(n_prompts: int):
    out = engine(
      params, prompts[:n_prompts], key, group_size=G, prompt_len=P,
      row_limits=limits[: n_prompts * G],
    )  # fmt: skip
    return out.tokens

  # Compile both on the benchmark's shapes (one batch of the fixed path; a few prompts through
  # the engine), then time interleaved repeats.
  t0 = time.perf_counter()
  fixed(W)
  compile_fixed = time.perf_counter() - t0
  t0 = time.perf_counter()
  engine.warm_up(params, P, G)
  compile_cont = time.perf_counter() - t0
  times = {"fixed": [], "continuous": []}
  results = {}
  for _ in range(args.repeats):
    for name, fn in (
      ("fixed", lambda: fixed(len(tokens))),
      ("continuous", lambda: cont(len(prompts))),
    ):
      t0 = time.perf_counter()
      results[name] = fn()
      times[name].append(time.perf_counter() - t0)
      print(f"{name}: {times[name][-1]:.2f} s", flush=True)
  fixed_s, cont_s = (statistics.median(times[k]) for k in ("fixed", "continuous"))
  same = float(np.mean(np.all(results["fixed"] == results["continuous"], axis=1)))
  fixed_kv = continuous.kv_bytes_fixed(cfg, W, P, N)
  st = engine.stats
  page_bytes = st["pool_bytes"] / st["num_pages"]
  report = dict(
    speedup=round(fixed_s / cont_s, 3),
    kv_ratio=round(st["pool_bytes"] / fixed_kv, 3),
    kv_used_ratio=round(st["peak_pages"] * page_bytes / fixed_kv, 3),
    useful_tokens_per_s=round(float(limits.sum()) / cont_s, 1),
    fixed_s=round(fixed_s, 3),
    continuous_s=round(cont_s, 3),
    compile_fixed_s=round(compile_fixed, 2),
    compile_continuous_s=round(compile_cont, 2),
    rows_identical=same,
    tokens=int(limits.sum()),
    mean_len=round(float(limits.mean()), 1),
    max_len=int(limits.max()),
    engine={k: v for k, v in st.items() if k != "pool_bytes"},
    shape=args.shape,
    slots=S,
    fixed_rows=W,
    page_size=args.page_size,
    backend=jax.default_backend(),
  )
  print(json.dumps(report))


if __name__ == "__main__":
  main()
