"""Routing flips between the sampler and the trainer on a tiny mixture of experts, and what
routing replay does to the log-ratio log(pi / mu) of the sampled tokens.

A random Qwen3-MoE-shaped model (bfloat16 compute: the KV-cached decode and the teacher-forced
forward round differently, which is what flips a near-tied router) samples responses with
`SamplingParams.record_experts`; the trainer's forward then scores them twice: routing itself
(as without rollout.routing_replay) and reusing the sampler's experts (with it). Prints the share
of (response token, expert layer) pairs whose trainer router picks another top-k set
(moe/routing_flips), and |log pi - log mu| over all response tokens and over those with a flip in
some layer, for both forwards; ends with one JSON line. Same parameters, same tokens: the only
difference between the two rows is the routing.

  python benchmarks/moe_routing.py [--batch 32 --prompt 16 --new 32 --experts 16 --top-k 2]
  python benchmarks/moe_routing.py --dtype float32      # float32: far fewer flips
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gppo_jax.generation import sampler  # noqa: E402
from gppo_jax.models import architectures  # noqa: E402
from gppo_jax.models import heads as heads_lib  # noqa: E402
from gppo_jax.models import model as model_lib  # noqa: E402
from gppo_jax.trainer import train_step  # noqa: E402


@functools.partial(nnx.jit, static_argnums=(3,))
def _score(model, tokens, mask, temperature, forced):
  positions = model_lib.positions_from_mask(mask)
  out = model(tokens[:, :-1], positions[:, :-1], attn_mask=mask[:, :-1], expert_ids=forced)
  lp = heads_lib.chunked_logprobs(model, out.hidden, tokens[:, 1:], temperature=temperature)
  return lp["logprobs"], out.routing.router_ids


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--prompt", type=int, default=16)
  ap.add_argument("--new", type=int, default=32)
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--top-k", type=int, default=2)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--dtype", default="bfloat16", choices=sorted(architectures.DTYPES))
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  cfg = architectures.ModelConfig(
    256, 128, 256, a.layers, 4, 2, 32, qk_norm=True, family="qwen3_moe", num_experts=a.experts,
    num_experts_per_tok=a.top_k, moe_intermediate_size=64, dtype=a.dtype,
    initializer_range=0.1, remat="none",
  )  # fmt: skip
  model = model_lib.create(cfg, a.seed)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(a.seed)
  prompts = [list(rng.integers(3, 256, size=rng.integers(4, a.prompt + 1))) for _ in range(a.batch)]
  p_tok, p_mask = sampler.left_pad(prompts, pad_id=0, length=a.prompt)
  sp = sampler.SamplingParams(max_new_tokens=a.new, stop_ids=(), pad_id=0, record_experts=True)
  run = jax.jit(sampler.sample, static_argnums=(0, 5))
  out = jax.device_get(run(graphdef, params, p_tok, p_mask, jax.random.key(a.seed), sp))
  tokens = jnp.concatenate([p_tok, out.tokens], axis=1)
  mask = jnp.concatenate([p_mask, out.mask], axis=1)
  P = a.prompt
  recorded = jnp.asarray(out.expert_ids)
  forced = jnp.concatenate(
    [jnp.full((a.batch, P - 1, *recorded.shape[2:]), -1, jnp.int32), recorded], axis=1
  )
  resp_mask = np.asarray(out.mask)
  rows = {}
  for name, ids in (("own routing", None), ("routing replay", forced)):
    lp, router_ids = _score(model, tokens, mask, 1.0, ids)
    gap = np.abs(np.asarray(lp)[:, P - 1 :] - out.logprobs)[resp_mask]
    own = router_ids[:, P - 1 :]
    flips = float(train_step.routing_flips(own, recorded, out.mask))
    same = np.asarray(jnp.sort(own, -1) == jnp.sort(recorded, -1)).all(-1).all(-1)
    flipped = ~same[resp_mask]
    rows[name] = dict(
      routing_flips=flips,
      tokens_with_a_flip=float(flipped.mean()),
      abs_log_ratio_mean=float(gap.mean()),
      abs_log_ratio_max=float(gap.max()),
      abs_log_ratio_mean_flipped=float(gap[flipped].mean()) if flipped.any() else 0.0,
      abs_log_ratio_mean_unflipped=float(gap[~flipped].mean()),
    )
  print(f"{a.batch} x {a.new} response tokens, {a.layers} layers of {a.experts} experts, "
        f"top-{a.top_k}, {a.dtype}")  # fmt: skip
  print(f"{'':16s} {'flips':>7s} {'tok w/ flip':>11s} {'|lr| mean':>10s} {'max':>8s} "
        f"{'flipped':>8s} {'other':>8s}")  # fmt: skip
  for name, r in rows.items():
    print(
      f"{name:16s} {r['routing_flips']:7.4f} {r['tokens_with_a_flip']:11.4f} "
      f"{r['abs_log_ratio_mean']:10.2e} {r['abs_log_ratio_max']:8.2e} "
      f"{r['abs_log_ratio_mean_flipped']:8.2e} {r['abs_log_ratio_mean_unflipped']:8.2e}"
    )
  result = dict(config=vars(a), **rows)
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
