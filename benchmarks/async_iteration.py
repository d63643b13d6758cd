"""Synchronous against asynchronous RL iterations, at long-tailed response lengths.

  python benchmarks/async_iteration.py                      # 2 CPU devices, mean 128, cap 512
  python benchmarks/async_iteration.py --epochs 1 --minibatches 8   # the real-run configs' update
  python benchmarks/async_iteration.py --iterations 4 --mean 16 --new 64 --prompts 4   # seconds

Trains `--config` (default configs/kl_atomic.py, the built-in policy) in this process with
rollout.staleness=1, interleaving `--repeats` runs of each mode:

- sync:  rollout.mode="sync" on one mesh over every device (sample, then update, in turns);
- async: rollout.mode="async" with mesh.rollout_devices=1: the rollout of iteration t + 1 is
  drawn on the last device while iteration t updates on the others (trainer/async_rollout.py);
- sync_split (--modes sync,async,sync_split): the async run's split, taking turns;
- async_shared: rollout.mode="async" on one mesh over every device (the rollout thread's work
  interleaves with the update's on the same devices);
- stream (--modes ...,stream): rollout.mode="stream" with rollout.max_staleness=--max-staleness
  on the async run's split: the engine never drains, loads each update's weights between decode
  chunks, and the update takes groups as they finish (trainer/stream_rollout.py); stream_shared
  on one mesh. Its rows run to lengths drawn alike (seeded by each prompt's id), its groups'
  lags vary, and groups older than the bound are dropped (`dropped`: per iteration).

Both compute the same iterations (same keys, prompts, behaviour policies; tests/test_async.py
checks the metrics are equal). Each rollout row's length is forced (`row_limits`, stop tokens
off) to a lognormal draw with mean --mean, capped at --new, seeded by the rollout's key, so both
modes decode the same lengths. The figures are per-iteration medians of metrics.jsonl's
`time/iteration_s` without the first two iterations (they compile) and the last (it evaluates).
On CPU the devices share the host's cores: the asynchronous run gains where one phase leaves
cores idle (a decode step of a small model is mostly serial), not by doubling the compute.

The last line is JSON: speedup (sync iteration / async iteration), sample_share (the rollout's
share of a synchronous iteration), lag_mean (updates between the behaviour and the learner, as
rollout/behaviour_lag), the medians behind them and async/sync_s, async/wait_s of the async run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _devices_flag(argv: list[str]) -> int:
  for i, a in enumerate(argv):
    if a.startswith("--devices="):
      return int(a.split("=", 1)[1])
    if a == "--devices" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 2


if os.environ.get("JAX_PLATFORMS") == "cpu":  # before jax starts: N CPU devices
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={_devices_flag(sys.argv)}"
  )

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from gppo_jax import train  # noqa: E402
from gppo_jax.generation import continuous, stream  # noqa: E402
from gppo_jax.trainer import experiment  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LongTailed:
  """A continuous-engine sampler whose rollout rows run to lognormal lengths (stop tokens off);
  evaluations (greedy) run as they are."""

  def __init__(self, engine: continuous.EngineSampler, mean: float, cap: int, sigma: float):
    self.engine, self.mean, self.cap, self.sigma = engine, mean, cap, sigma
    self.batch_multiple = engine.batch_multiple

  def __call__(self, params, prompt_tokens, prompt_mask, rng, sampling, **kwargs):
    if sampling.greedy or sampling.max_new_tokens < self.cap:  # an evaluation
      return self.engine(params, prompt_tokens, prompt_mask, rng, sampling, **kwargs)
    seed = int(np.asarray(jax.random.key_data(rng) if _typed(rng) else rng).sum())
    limits = _lengths(seed, len(prompt_tokens), self.mean, self.cap, self.sigma)
    sampling = dataclasses.replace(sampling, stop_ids=())
    return self.engine(
      params, prompt_tokens, prompt_mask, rng, sampling, row_limits=limits.astype(np.int32),
      **kwargs,
    )  # fmt: skip

  def metrics(self):
    return self.engine.metrics()


def _lengths(seed: int, rows: int, mean: float, cap: int, sigma: float) -> np.ndarray:
  """rows lognormal lengths with the given mean, rounded and clipped to [1, cap]."""
  draw = np.random.default_rng(seed).lognormal(0.0, sigma, rows)
  return np.clip(np.round(draw * mean / np.exp(sigma**2 / 2)), 1, cap)


def _typed(key) -> bool:
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def make_config(args, mode: str):
  spec = importlib.util.spec_from_file_location("config", os.path.join(REPO, args.config))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(None)
  c.iterations = args.iterations
  c.rollout.prompts_per_iter = args.prompts
  c.rollout.group_size = args.group
  c.rollout.max_new_tokens = args.new
  c.rollout.engine = "continuous"
  c.rollout.staleness = 0 if mode.startswith("stream") else 1
  c.rollout.mode = mode.split("_")[0]
  c.rollout.max_staleness = args.max_staleness
  c.mesh.rollout_devices = 1 if mode in ("async", "sync_split", "stream") else 0
  c.train.shuffle = "rows"
  if args.epochs:
    c.train.epochs = args.epochs
  if args.minibatches:
    c.train.minibatches = args.minibatches
  c.train.trim_bucket = 0  # one update shape: the longest row varies with every rollout
  c.eval.every = args.iterations  # only at the end (the last iteration is left out)
  c.eval.num_problems = 8
  c.eval.k = 0
  c.checkpoint.every = args.iterations
  c.log_every = 1
  return c


def run_once(args, mode: str) -> dict:
  real, real_build = experiment.sample_fn, experiment.build_policy

  def sample_fn(*a, **k):
    return LongTailed(real(*a, **k), args.mean, args.new, args.sigma)

  def build_policy(*a, **k):  # a built-in task's answers are short: let the rows run long
    # (after the warm start, which stays the task's own: the cached one users run from)
    graphdef, params, model_cfg, env, info = real_build(*a, **k)
    env.max_new_tokens = args.new
    return graphdef, params, model_cfg, env, info

  real_engine, real_add = stream.StreamEngine.__init__, stream.StreamEngine.add

  def engine_init(self, graphdef, sampling, *a, **k):  # the stream's rows run to their limits
    real_engine(self, graphdef, dataclasses.replace(sampling, stop_ids=()), *a, **k)

  def add(self, prompts, prompt_ids, limits=None):
    draws = [_lengths(int(i), self.group_size, args.mean, args.new, args.sigma) for i in prompt_ids]
    real_add(self, prompts, prompt_ids, np.concatenate(draws).astype(np.int32))

  experiment.sample_fn, experiment.build_policy = sample_fn, build_policy
  stream.StreamEngine.__init__, stream.StreamEngine.add = engine_init, add
  try:
    with tempfile.TemporaryDirectory() as workdir:
      train.train_and_evaluate(make_config(args, mode), workdir)
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "time/iteration_s" in r]
  finally:
    experiment.sample_fn, experiment.build_policy = real, real_build
    stream.StreamEngine.__init__, stream.StreamEngine.add = real_engine, real_add
  steady = rows[2:-1] or rows[-1:]
  med = lambda k: float(np.median([r.get(k, 0.0) for r in steady]))
  return {
    "iteration_s": med("time/iteration_s"),
    "rollout_s": med("time/rollout_s"),
    "update_s": med("time/update_s"),
    "sync_s": med("async/sync_s"),
    "wait_s": med("async/wait_s"),
    "lag_mean": float(np.mean([r["rollout/behaviour_lag"] for r in steady])),
    "dropped": float(np.mean([r.get("rollout/dropped", 0.0) for r in steady])),
    "length_mean": med("response/length_mean"),
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default="configs/kl_atomic.py")
  p.add_argument("--devices", type=int, default=2, help="CPU devices (JAX_PLATFORMS=cpu)")
  p.add_argument("--iterations", type=int, default=8)
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--mean", type=float, default=128)
  p.add_argument("--new", type=int, default=512)
  p.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of the lengths")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--epochs", type=int, default=0, help="train.epochs (0: the config's)")
  p.add_argument("--minibatches", type=int, default=0, help="train.minibatches (0: the config's)")
  p.add_argument("--modes", default="sync,async")
  p.add_argument("--max-staleness", type=int, default=2, help="rollout.max_staleness (stream)")
  args = p.parse_args()
  if args.iterations < 4:
    raise SystemExit("--iterations must be >= 4 (two compile, the last evaluates)")
  modes = args.modes.split(",")
  print(f"{jax.device_count()} devices ({jax.devices()[0].platform}); {args}", flush=True)
  results: dict[str, list[dict]] = {m: [] for m in modes}
  for rep in range(args.repeats):
    for mode in modes:
      r = run_once(args, mode)
      results[mode].append(r)
      print(f"[{rep + 1}/{args.repeats}] {mode:10s} " + json.dumps(r), flush=True)
  med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
  sync, asy = med["sync"], med.get("async")
  out = {
    "speedup": sync["iteration_s"] / asy["iteration_s"] if asy else None,
    "sample_share": sync["rollout_s"] / sync["iteration_s"],
    "lag_mean": asy["lag_mean"] if asy else None,
    **(
      {"stream_speedup": sync["iteration_s"] / med["stream"]["iteration_s"]}
      if "stream" in med
      else {}
    ),
    "medians": med,
    "devices": jax.device_count(),
    "mean": args.mean,
    "new": args.new,
    "rows": args.prompts * args.group,
  }
  print(json.dumps(out))


if __name__ == "__main__":
  main()
