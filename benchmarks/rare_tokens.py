"""How often a warm-started policy samples unlikely tokens, on each built-in task asked for.

For each task: the run's warm-started policy (`experiment.build_policy` on
`configs/base.py:task=NAME`, from the warm-start cache where it holds that start), one rollout of
--prompts training prompts x --group samples at temperature 1 (the rollouts' settings), and over
the sampled response tokens (the end token included):

  rare_share     the share whose behaviour probability q (the full softmax) is below --below
                 (0.1): the tokens on which the per-token estimators differ most (docs/verdict.md)
  q_median       the median q
  length_mean    mean response length in tokens
  vocab          the tokenizer's vocabulary size
  entropy        the policy's mean entropy per sampled token (nats)
  reward         the rollout's mean reward; warm_acc the warm start's held-out greedy accuracy

Its last line is JSON with these figures per task.

  python benchmarks/rare_tokens.py                                  # wordchain and addsub3, seed 0
  python benchmarks/rare_tokens.py --tasks wordchain --seeds 0,1,2
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from gppo_jax import config_lib  # noqa: E402
from gppo_jax.generation import sampler  # noqa: E402
from gppo_jax.trainer import experiment, policy_eval, train_step  # noqa: E402


def measure(task: str, seed: int, prompts: int, group: int, below: float) -> dict:
  config = config_lib.base(f"task={task}")
  config.seed = seed
  config_lib.validate(config)
  graphdef, params, _, env, info = experiment.build_policy(config, say=lambda s: None)
  tok = env.tokenizer
  r = config.rollout
  sampling = sampler.SamplingParams(
    max_new_tokens=min(r.max_new_tokens, env.max_new_tokens),
    temperature=r.temperature,
    stop_ids=tok.eos_ids,
    pad_id=tok.pad_id,
    logprobs_mode=train_step.LOGPROBS_MODES["full"],
  )
  rows = [p for p in env.train_prompts(prompts) for _ in range(group)]
  out = sampler.sample_prompts(
    graphdef,
    params,
    [p.token_ids for p in rows],
    sampling,
    jax.random.PRNGKey(seed),
    prompt_len=env.max_prompt_len,
    pad_id=tok.pad_id,
    group_size=group,
  )
  mask = np.asarray(out.mask, bool)
  q = np.exp(np.asarray(out.logprobs, np.float64))[mask]
  texts = policy_eval.decode_responses(tok, out.tokens, out.mask, sampling.stop_ids)
  rewards, _, _ = env.score(texts, rows)
  return {
    "task": task,
    "seed": seed,
    "rare_share": float(np.mean(q < below)),
    "q_median": float(np.median(q)),
    "length_mean": float(np.mean(out.lengths)),
    "vocab": int(tok.vocab_size),
    "entropy": float(np.sum(np.asarray(out.entropy)[mask]) / mask.sum()),
    "reward": float(np.mean(rewards)),
    "warm_acc": float(info.get("accuracy", float("nan"))),
    "warm_steps": int(info.get("steps", 0)),
    "warm_s": float(info.get("seconds", float("nan"))),
    "tokens": int(mask.sum()),
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tasks", default="wordchain,addsub3", help="built-in tasks, comma-separated")
  ap.add_argument("--seeds", default="0", help="warm-start seeds, e.g. 0,1,2")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--group", type=int, default=8, help="samples per prompt")
  ap.add_argument("--below", type=float, default=0.1, help="the behaviour-probability threshold")
  args = ap.parse_args()
  results = []
  for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
    for seed in [int(s) for s in args.seeds.split(",")]:
      res = measure(task, seed, args.prompts, args.group, args.below)
      results.append(res)
      print(
        f"{task:>10} seed {seed}: {100 * res['rare_share']:5.1f}% of {res['tokens']} sampled "
        f"response tokens have q < {args.below:g} (median q {res['q_median']:.3f}); mean "
        f"length {res['length_mean']:.1f} tokens; vocabulary {res['vocab']}; entropy "
        f"{res['entropy']:.2f} nats; reward {res['reward']:.3f}; warm start {res['warm_acc']:.3f} "
        f"after {res['warm_steps']} steps ({res['warm_s']:.0f} s)",
        flush=True,
      )
  print(json.dumps(results))


if __name__ == "__main__":
  main()
