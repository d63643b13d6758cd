"""Scoring a policy on an environment's prompts: greedy accuracy, avg@n, pass@k, per benchmark.

The evaluation protocol (`EvalSettings`, from `config.eval`) is separate from the rollout's: its
own response length, temperature and top-p, n samples per problem, a list of k, and several
evaluation seeds. `evaluate_benchmarks` returns a `pass_at_k.EvalReport` (per-benchmark rows with
standard errors, macro rows per benchmark kind); `evaluate_policy` its flat metric dict. Pure
functions of (graphdef, params, env): used by the trainer's periodic evaluation, the supervised
warm start and `python -m gppo_jax.evaluate` (gppo_jax/evaluate.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from gppo_jax import errors
from gppo_jax.data.envs import Prompt
from gppo_jax.generation import sampler
from gppo_jax.rewards import pass_at_k


def decode_responses(tokenizer, tokens: np.ndarray, mask: np.ndarray, stop_ids: Sequence[int]):
  """Response texts: the masked tokens without the stop token."""
  tokens = np.asarray(tokens)
  keep = np.asarray(mask, bool) & ~np.isin(tokens, np.asarray(list(stop_ids), tokens.dtype))
  return [tokenizer.decode(row[k].tolist()) for row, k in zip(tokens, keep, strict=True)]


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """How a policy is evaluated (the fields of config.eval, resolved).

  n: samples per problem and seed (0: greedy only); ks: the k of pass@k (each <= n); seeds: one
  sampled evaluation per seed (the greedy one runs once); max_new_tokens: None = the env's.
  """

  n: int = 4
  ks: tuple[int, ...] = (4,)
  seeds: tuple[int, ...] = (0,)
  temperature: float = 1.0
  top_p: float = 1.0
  max_new_tokens: int | None = None
  batch_size: int = 256

  def __post_init__(self):
    if self.n < 0:
      raise errors.ConfigError(f"eval.n={self.n}: must be >= 0 (0 = greedy only)")
    too_big = [k for k in self.ks if k > self.n]
    if too_big:
      raise errors.ConfigError(
        f"eval.k={list(self.ks)} asks for pass@{max(too_big)} but eval.n={self.n} samples per "
        f"problem: set eval.n >= {max(too_big)} or drop k > {self.n}"
      )
    if not self.seeds or len(set(self.seeds)) != len(self.seeds):
      raise errors.ConfigError(f"eval.seeds={list(self.seeds)}: must be distinct, at least one")

  @classmethod
  def from_config(cls, e, *, max_new_tokens: int, run_seed: int) -> EvalSettings:
    """From config.eval: n None = the largest k (one draw serves every k), seeds None = the run's
    seed, max_new_tokens None = the rollout's (`max_new_tokens`)."""
    try:
      ks = pass_at_k.normalize_ks(e.k)
    except ValueError as err:
      raise errors.ConfigError(f"eval.k={e.k!r}: {err}") from None
    n = e.get("n")
    seeds = e.get("seeds")
    return cls(
      n=max(ks, default=0) if n is None else int(n),
      ks=ks,
      seeds=(int(run_seed),) if seeds is None else normalize_seeds(seeds),
      temperature=float(e.temperature),
      top_p=float(e.top_p),
      max_new_tokens=e.get("max_new_tokens") or max_new_tokens,
      batch_size=int(e.get("batch_size", 256)),
    )


def normalize_seeds(seeds) -> tuple[int, ...]:
  """eval.seeds: an int or a list of ints -> a tuple (ConfigError otherwise)."""
  items = [seeds] if isinstance(seeds, (int, np.integer)) else seeds
  if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
    raise errors.ConfigError(f"eval.seeds={seeds!r}: must be an integer or a list of integers")
  if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in items):
    raise errors.ConfigError(f"eval.seeds={seeds!r}: must be an integer or a list of integers")
  return tuple(int(s) for s in items)


def seed_key(seed: int) -> jax.Array:
  """The evaluation key of one seed (the key the periodic evaluation always used for the run's
  seed, so that one seed reproduces earlier runs' numbers)."""
  return jax.random.fold_in(jax.random.PRNGKey(seed), 10**9)


def benchmark_kinds(env, prompts: Sequence[Prompt]) -> dict[str, str]:
  """Benchmark name -> kind ("math", "code", "" unknown): a prompt's own `kind` if it has one,
  else the env's (`DataEnv.kind`). ConfigError if one benchmark mixes kinds."""
  kinds: dict[str, set] = {}
  default = getattr(env, "kind", "") or ""
  for p in prompts:
    kinds.setdefault(p.benchmark, set()).add(getattr(p, "kind", "") or default)
  mixed = {b: sorted(k) for b, k in kinds.items() if len(k) > 1}
  if mixed:
    raise errors.ConfigError(f"a benchmark mixes kinds: {mixed}")
  return {b: k.pop() for b, k in kinds.items()}


def solved(rewards: np.ndarray) -> np.ndarray:
  """Correct responses: reward 1 (math: verified; built-in: exact; code: every test passed, not
  the partial credit that the "fraction" reward gives in training)."""
  return np.asarray(rewards, np.float64) >= 1.0 - 1e-6


def _sample_correct(
  graphdef, params, env, prompts, sampling, key, n, batch_size, common
) -> np.ndarray:
  """[P, n] bool: n responses per prompt (rows p*n ... p*n + n - 1), each `solved`."""
  tok = env.tokenizer
  rep = [p for p in prompts for _ in range(n)]
  out = sampler.sample_prompts(
    graphdef,
    params,
    [p.token_ids for p in rep],
    sampling,
    key,
    **{**common, "batch_size": min(batch_size, len(rep))},
  )
  texts = decode_responses(tok, out.tokens, out.mask, sampling.stop_ids)
  r, _, _ = env.score(texts, rep)
  return solved(r).reshape(len(prompts), n)


def evaluate_benchmarks(
  graphdef: nnx.GraphDef,
  params,
  env,
  settings: EvalSettings,
  *,
  keys: Sequence[jax.Array] | None = None,
  prompts: Sequence[Prompt] | None = None,
  sample_fn: sampler.MeshSampler | None = None,
) -> pass_at_k.EvalReport | None:
  """Greedy accuracy, avg@n and pass@k of every benchmark of env's eval set (or of `prompts`),
  with standard errors over problems and the spread over `settings.seeds`; None without prompts.

  Seed s draws from `seed_key(s)` (or from `keys`, one per seed, when given): its samples with
  fold_in(key, 1), in batches of `settings.batch_size` prompts with each prompt's n samples side
  by side, so that a setting reproduces the same numbers however it is reached.

  `sample_fn`: a `sampler.MeshSampler` to sample on a mesh (multi-host safe: every process gets
  the same report). A response is correct when `solved` (reward 1). Sampled responses the scorer
  could not judge count as wrong; greedy ones are left out of the accuracy (as in training, where
  they carry no reward).
  """
  prompts = env.eval_prompts() if prompts is None else list(prompts)
  if not prompts:
    return None
  s = settings
  tok = env.tokenizer
  stop_ids = tuple(getattr(tok, "eos_ids", ()) or ())
  max_new = s.max_new_tokens or env.max_new_tokens
  pad_id = getattr(tok, "pad_id", 0)
  common = dict(
    prompt_len=env.max_prompt_len,
    pad_id=pad_id,
    batch_size=min(s.batch_size, len(prompts)),
    sample_fn=sample_fn,
  )
  keys = [seed_key(seed) for seed in s.seeds] if keys is None else list(keys)
  if len(keys) != len(s.seeds):
    raise ValueError(f"{len(keys)} keys for {len(s.seeds)} seeds")
  greedy = sampler.SamplingParams(max_new, greedy=True, stop_ids=stop_ids, pad_id=pad_id)
  out = sampler.sample_prompts(
    graphdef, params, [p.token_ids for p in prompts], greedy, keys[0], **common
  )
  rewards, valid, _ = env.score(decode_responses(tok, out.tokens, out.mask, stop_ids), prompts)
  correct = None
  if s.n > 0:
    sampling = sampler.SamplingParams(
      max_new, temperature=s.temperature, top_p=s.top_p, stop_ids=stop_ids, pad_id=pad_id
    )
    correct = np.stack(
      [
        _sample_correct(
          graphdef,
          params,
          env,
          prompts,
          sampling,
          jax.random.fold_in(key, 1),
          s.n,
          s.batch_size,
          common,
        )
        for key in keys
      ]
    )  # [seeds, P, n]
  kinds = benchmark_kinds(env, prompts)
  names = np.array([p.benchmark for p in prompts], object)

  def score(name: str, kind: str, sel: np.ndarray) -> pass_at_k.BenchmarkResult:
    return pass_at_k.score_benchmark(
      name,
      kind,
      solved(rewards)[sel].astype(np.float64),
      np.asarray(valid, bool)[sel],
      None if correct is None else correct[:, sel],
      s.ks,
    )

  benches = [score(b or "all", kinds[b], names == b) for b in sorted(kinds)]
  pooled_kind = next(iter(set(kinds.values()))) if len(set(kinds.values())) == 1 else ""
  pooled = score("all", pooled_kind, np.ones(len(prompts), bool))
  try:
    return pass_at_k.make_report(pooled, benches)
  except ValueError as err:
    raise errors.ConfigError(f"eval sets: {err}") from None


def evaluate_policy(
  graphdef: nnx.GraphDef,
  params,
  env,
  key: jax.Array | None = None,
  *,
  k: int | Sequence[int] = 4,
  n: int | None = None,
  seeds: Sequence[int] | None = None,
  temperature: float = 1.0,
  top_p: float = 1.0,
  batch_size: int = 256,
  max_new_tokens: int | None = None,
  prompts: Sequence[Prompt] | None = None,
  sample_fn: sampler.MeshSampler | None = None,
) -> dict[str, float]:
  """The flat metrics of `evaluate_benchmarks` (see `pass_at_k.EvalReport.metrics`).

  k: an int (k samples per problem, pass@k; 0 = greedy only) or a list of k; n: samples per
  problem (None = the largest k). The sampled evaluation draws from `key` (one seed) or from
  `seed_key(s)` for each of `seeds`."""
  ks = pass_at_k.normalize_ks(k)
  settings = EvalSettings(
    n=max(ks, default=0) if n is None else n,
    ks=ks,
    seeds=tuple(seeds) if seeds is not None else (0,),
    temperature=temperature,
    top_p=top_p,
    max_new_tokens=max_new_tokens,
    batch_size=batch_size,
  )
  keys = [key] if seeds is None and key is not None else None
  report = evaluate_benchmarks(
    graphdef, params, env, settings, keys=keys, prompts=prompts, sample_fn=sample_fn
  )
  return {} if report is None else report.metrics()
