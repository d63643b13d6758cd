"""Peak temporary memory of chunked vs naive log-prob + gradient, from XLA's memory analysis.

Compiles (never runs) value_and_grad of sum(weights * log softmax(h @ W / T)[targets]) w.r.t. the
hidden states h and the unembedding W, once materialising all [tokens, vocab] float32 logits and
once through `heads.chunked_logprob_stats`, and reads `compiled.memory_analysis()`.

  python benchmarks/logprob_memory.py [--vocab 151936 --tokens 16384 --hidden 256 --batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gppo_jax.models.heads import chunked_logprob_stats  # noqa: E402


def naive_loss(h, w, targets, weights, temperature):
  logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32) / temperature
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], -1)[..., 0]
  return jnp.sum(weights * lp)


def chunked_loss(h, w, targets, weights, temperature, chunk_size, entropy):
  stats = chunked_logprob_stats(
    h, w, targets, temperature=temperature, chunk_size=chunk_size, entropy=entropy
  )
  loss = jnp.sum(weights * stats["logprobs"])
  if entropy:
    loss = loss + 0.01 * jnp.sum(weights * stats["entropy"])
  return loss


def peak_bytes(loss_fn, args) -> dict[str, int]:
  compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(*args).compile()
  m = compiled.memory_analysis()
  return {
    "temp": int(m.temp_size_in_bytes),
    "args": int(m.argument_size_in_bytes),
    "out": int(m.output_size_in_bytes),
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--chunk_sizes", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  a = p.parse_args()
  B, T = a.batch, a.tokens // a.batch
  dt = jnp.dtype(a.dtype)
  args = (
    jax.ShapeDtypeStruct((B, T, a.hidden), dt),
    jax.ShapeDtypeStruct((a.hidden, a.vocab), dt),
    jax.ShapeDtypeStruct((B, T), jnp.int32),
    jax.ShapeDtypeStruct((B, T), jnp.float32),
  )
  temperature = 0.9
  rows = [("naive", None, peak_bytes(lambda h, w, t, m: naive_loss(h, w, t, m, temperature), args))]
  for c in a.chunk_sizes:
    for ent in (False, True):
      fn = lambda h, w, t, m, c=c, ent=ent: chunked_loss(h, w, t, m, temperature, c, ent)
      rows.append((f"chunked{'+entropy' if ent else ''}", c, peak_bytes(fn, args)))
  naive = rows[0][2]["temp"]
  logits_gib = B * T * a.vocab * 4 / 2**30
  print(
    f"log-prob + grad(h, W): batch {B} x seq {T} = {B * T} tokens, vocab {a.vocab}, "
    f"hidden {a.hidden}, {a.dtype}; full f32 logits = {logits_gib:.2f} GiB"
  )
  print(f"{'variant':<18}{'chunk':>7}{'temp GiB':>11}{'vs naive':>10}")
  result = {"tokens": B * T, "vocab": a.vocab, "hidden": a.hidden, "naive_temp_bytes": naive}
  for name, c, m in rows:
    ratio = m["temp"] / naive
    print(f"{name:<18}{c or '-':>7}{m['temp'] / 2**30:>11.3f}{ratio:>10.4f}")
    if c is not None:
      result[f"{name}_c{c}_temp_bytes"] = m["temp"]
      result[f"{name}_c{c}_ratio"] = round(ratio, 5)
  worst = max(m["temp"] / naive for name, c, m in rows[1:])
  result["worst_ratio"] = round(worst, 5)
  result["goal_met"] = worst <= 1 / 8
  verdict = "met" if worst <= 1 / 8 else "NOT met"
  print(f"worst chunked/naive ratio {worst:.4f} (goal <= 0.125: {verdict})")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
