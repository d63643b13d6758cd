"""Scoring a policy on an environment's prompts: greedy accuracy, avg@k, pass@k.

Pure functions of (graphdef, params, env): used by the trainer's periodic evaluation, the
supervised warm start and the `python -m gppo_jax.evaluate` command line (gppo_jax/evaluate.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from gppo_jax import pass_at_k, sampler
from gppo_jax.envs import Prompt


def decode_responses(tokenizer, tokens: np.ndarray, mask: np.ndarray, stop_ids: Sequence[int]):
  """Response texts: the masked tokens without the stop token."""
  stops = set(int(s) for s in stop_ids)
  out = []
  for row, m in zip(np.asarray(tokens), np.asarray(mask), strict=True):
    ids = [int(t) for t, keep in zip(row, m, strict=True) if keep and int(t) not in stops]
    out.append(tokenizer.decode(ids))
  return out


def evaluate_policy(
  graphdef: nnx.GraphDef,
  params,
  env,
  key: jax.Array,
  *,
  k: int = 4,
  temperature: float = 1.0,
  top_p: float = 1.0,
  batch_size: int = 256,
  max_new_tokens: int | None = None,
  prompts: Sequence[Prompt] | None = None,
  sample_fn: sampler.MeshSampler | None = None,
) -> dict[str, float]:
  """Greedy accuracy plus avg@k and unbiased pass@k (k samples at `temperature`) on env's eval set
  (or on `prompts`). `sample_fn`: a `sampler.MeshSampler` to sample on a mesh (multi-host safe:
  every process gets the same metrics)."""
  prompts = env.eval_prompts() if prompts is None else prompts
  if not prompts:
    return {}
  tok = env.tokenizer
  stop_ids = tuple(getattr(tok, "eos_ids", ()) or ())
  max_new = max_new_tokens or env.max_new_tokens
  pad_id = getattr(tok, "pad_id", 0)
  common = dict(
    prompt_len=env.max_prompt_len,
    pad_id=pad_id,
    batch_size=min(batch_size, len(prompts)),
    sample_fn=sample_fn,
  )
  greedy = sampler.SamplingParams(max_new, greedy=True, stop_ids=stop_ids, pad_id=pad_id)
  ids = [p.token_ids for p in prompts]
  out = sampler.sample_prompts(graphdef, params, ids, greedy, key, **common)
  rewards, valid, _ = env.score(decode_responses(tok, out.tokens, out.mask, stop_ids), prompts)
  benches = [getattr(p, "benchmark", "") for p in prompts]
  groups = {"": np.ones(len(prompts), bool)}  # "" = all prompts; then one group per benchmark
  if len(set(benches)) > 1:
    groups.update({b: np.array([x == b for x in benches]) for b in sorted(set(benches))})

  def key_of(group: str, name: str) -> str:
    return f"eval/{group}/{name}" if group else f"eval/{name}"

  metrics = {}
  for g, sel in groups.items():
    ok = valid & sel
    metrics[key_of(g, "accuracy")] = float(np.mean(rewards[ok])) if ok.any() else float("nan")
  if k > 0:
    sampling = sampler.SamplingParams(
      max_new, temperature=temperature, top_p=top_p, stop_ids=stop_ids, pad_id=pad_id
    )
    rep = [p for p in prompts for _ in range(k)]
    common["batch_size"] = min(batch_size, len(rep))
    rep_ids = [p.token_ids for p in rep]
    out = sampler.sample_prompts(
      graphdef, params, rep_ids, sampling, jax.random.fold_in(key, 1), **common
    )
    r, _, _ = env.score(decode_responses(tok, out.tokens, out.mask, stop_ids), rep)
    correct = r.reshape(len(prompts), k) > 0.5
    for g, sel in groups.items():
      metrics[key_of(g, f"avg@{k}")] = float(pass_at_k.avg_at_n(correct[sel]))
      metrics[key_of(g, f"pass@{k}")] = pass_at_k.mean_pass_at_k(correct[sel], k)
  return metrics
