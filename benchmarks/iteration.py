"""Where one RL iteration's wall time goes, for any training config.

  python benchmarks/iteration.py --config=configs/kl_atomic.py            # 30 iterations
  python benchmarks/iteration.py --config=configs/dapo.py --config.iterations=10 \
      --config.rollout.max_new_tokens=16

Trains the config for `config.iterations` (default here: 30) in a temporary workdir (the warm start
comes from its cache, as in a normal run) with evaluation only at the end, then reads the `time/*`
entries the trainer writes to metrics.jsonl for every iteration and prints, per phase, the median
seconds and its share of the iteration, without the first iteration (it compiles):

  sample    the sampler (prefill + decode), including rounds DAPO's refill adds
  reward    decoding the texts and scoring them (math-verify, the code sandbox)
  logprobs  the optional log-prob passes (rollout.recompute_logprobs, the KL reference)
  update    epochs x mini-batches of optimizer steps, one compiled call
  io        the previous iteration's metric row and checkpoint call
  eval      the periodic evaluation (only at the end here)
  other     the rest: batch assembly, host transfers, the finiteness check
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

PHASES = ("sample", "reward", "logprobs", "update", "io")

config_flags.DEFINE_config_file("config", "configs/kl_atomic.py", "Training config file.")
flags.DEFINE_integer("iterations", 30, "Iterations to time (overrides config.iterations).")
flags.DEFINE_string("out", None, "Also write the figures as JSON to this file.")


def split(rows: list[dict]) -> dict[str, float]:
  """Median seconds per phase over `rows` (metrics.jsonl rows of iterations 2..N)."""
  med = lambda key: float(np.median([r.get(key, 0.0) for r in rows]))
  out = {p: med(f"time/{p}_s") for p in PHASES}
  out["iteration"] = med("time/iteration_s")
  out["other"] = max(0.0, out["iteration"] - sum(out[p] for p in PHASES))
  return out


def main(argv) -> None:
  del argv
  from gppo_jax import experiment, train

  experiment.quiet_libraries(flags.FLAGS)
  config = flags.FLAGS.config
  config.iterations = flags.FLAGS.iterations
  config.eval.every = config.iterations  # one evaluation, at the end
  config.checkpoint.every = config.iterations
  with tempfile.TemporaryDirectory() as workdir:
    summary = train.train_and_evaluate(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
  rows = [r for r in rows if "time/iteration_s" in r]
  if len(rows) < 2:
    raise SystemExit("need at least 2 iterations (the first one compiles)")
  eval_s = [r["time/eval_s"] for r in rows if "time/eval_s" in r]
  first = rows[0]["time/iteration_s"]
  figures = split(rows[1:])
  total = figures["iteration"]
  print(
    f"\n{config.loss.divergence}-{config.loss.estimator}, {len(rows)} iterations, "
    f"{config.rollout.prompts_per_iter} x {config.rollout.group_size} rollouts, "
    f"{config.train.epochs} x {config.train.minibatches} optimizer steps per iteration"
  )
  print(f"{'phase':<10}{'median s':>10}{'share':>8}")
  for phase in (*PHASES, "other"):
    print(f"{phase:<10}{figures[phase]:>10.4f}{figures[phase] / total:>8.1%}")
  print(f"{'iteration':<10}{total:>10.4f}{1:>8.0%}")
  print(
    f"first iteration (compiles): {first:.2f} s; evaluation: {eval_s[-1] if eval_s else 0:.2f} s"
  )
  print(f"whole run: {summary['seconds']:.1f} s")
  if flags.FLAGS.out:
    with open(flags.FLAGS.out, "w") as f:
      json.dump({"median_s": figures, "first_s": first, "eval_s": eval_s}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
