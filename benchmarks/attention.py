"""Causal self-attention, forward + backward, by implementation and blockwise tile (CPU).

For each shape it times the gradient of one attention call (what one layer of a training step
runs): what `model.attention="auto"` runs there (the training default on this backend), dense
attention, and blockwise attention at several tiles, looping over the tiles and, up to
UNROLLED_MAX_TILES tiles, unrolled (`attention.UNROLL_MAX_LEN`); repeats interleaved (this
machine's speed drifts), medians compared, each one's time relative to "auto". Ends with one
JSON line.

  python benchmarks/attention.py                                   # the default shapes
  python benchmarks/attention.py --shapes 16x256x4x2x32,2x1024x8x4x64 --tiles 64,128,256,512

A shape is BxTxHxKxDh: rows, tokens, query heads, key/value heads, head size. The defaults are
the tiny and small shapes of benchmarks/train_step.py and a 1k / 2k-token row of the small one.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gppo_jax.models import attention

SHAPES = "16x256x4x2x32,8x256x8x4x64,4x512x8x4x64,2x1024x8x4x64,1x2048x8x4x64"
DENSE_MAX_T = 1024  # dense's [T, T] scores per head: skipped beyond this length
UNROLLED_MAX_TILES = 16  # unrolled blockwise: one program piece per tile, skipped beyond


def grad_fn(impl: str, tile: int | None = None, unroll: bool = False):
  """jit(q, k, v, mask) -> d/d(q, k, v) of sum(sin(attention)) for `impl` ("auto", "dense" or
  "blockwise" with a tile, looped or unrolled)."""

  def attend(q, k, v, mask):
    if impl in ("auto", "dense"):
      return attention.attention(q, k, v, mask, impl=impl)
    return attention.blockwise(q, k, v, mask, block_size=tile, unroll=unroll)

  loss = lambda q, k, v, mask: jnp.sum(jnp.sin(attend(q, k, v, mask)))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def bench_shape(shape: tuple[int, ...], tiles: list[int], repeats: int, inner: int) -> dict:
  B, T, H, K, Dh = shape
  rng = np.random.default_rng(0)
  draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = draw(B, T, H, Dh), draw(B, T, K, Dh), draw(B, T, K, Dh)
  mask = jnp.ones((B, T), bool)
  chosen = attention.block_size(T)
  auto = attention.resolve("auto", seq_len=T, dtype=jnp.float32, head_dim=Dh)
  if auto == "blockwise":
    auto += f"/{chosen}, {'unrolled' if attention.unrolled(T) else 'loops'}"
  # Tiles longer than T are one tile of T, as the chosen one may be.
  timed = sorted({t for t in tiles if t <= T} | {chosen})
  methods = {"auto": grad_fn("auto")}
  for t in timed:
    methods[f"loop/{t}"] = grad_fn("blockwise", t)
    if -(-T // t) <= UNROLLED_MAX_TILES:
      methods[f"unrolled/{t}"] = grad_fn("blockwise", t, unroll=True)
  if T <= DENSE_MAX_T:
    methods["dense"] = grad_fn("dense")
  ref = None
  for name, fn in methods.items():  # compile, and check that all agree
    g = jax.block_until_ready(fn(q, k, v, mask))
    ref = g if ref is None else ref
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g, ref, strict=True))
    if err > 1e-3:
      raise SystemExit(f"{name} differs from {next(iter(methods))} by {err} at shape {shape}")
  times = {name: [] for name in methods}
  for _ in range(repeats):
    for name, fn in methods.items():
      t0 = time.perf_counter()
      for _ in range(inner):
        jax.block_until_ready(fn(q, k, v, mask))
      times[name].append((time.perf_counter() - t0) / inner)
  med = {name: statistics.median(ts) for name, ts in times.items()}
  base = med["auto"]
  backend = jax.default_backend()
  print(f"\n[B={B}, T={T}, H={H}, K={K}, Dh={Dh}]  auto on {backend}: {auto}")
  print(f"  {'method':<18}{'ms':>10}{'vs auto':>11}")
  for name, s in med.items():
    print(f"  {name:<18}{s * 1e3:>10.2f}{s / base:>10.2f}x")
  ms = {n: s * 1e3 for n, s in med.items()}
  return {"shape": list(shape), "auto": auto, "chosen_tile": chosen, "ms": ms}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shapes", default=SHAPES, help="comma-separated BxTxHxKxDh")
  ap.add_argument("--tiles", default="64,128,256,512", help="blockwise tiles to time")
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--inner", type=int, default=3, help="calls per timed repeat")
  args = ap.parse_args()
  tiles = [int(t) for t in args.tiles.split(",")]
  shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
  for s in shapes:
    if len(s) != 5:
      raise SystemExit(f"--shapes: {s} is not BxTxHxKxDh")
  results = [bench_shape(s, tiles, args.repeats, args.inner) for s in shapes]
  print(json.dumps({"benchmark": "attention", "backend": jax.default_backend(), "shapes": results}))


if __name__ == "__main__":
  main()
