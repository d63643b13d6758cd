"""Environments: where prompts come from and how responses are scored.

An `Env` hands out tokenized training prompts with their gold answers, holds a fixed held-out
evaluation set, and turns decoded responses into rewards. Two kinds:

  BuiltinEnv  a synthetic task from gppo_jax.data.tasks (no files, no downloads; the CPU default)
  DataEnv     JSONL / Parquet files (`readers`) scored by the math verifier or the code sandbox

Both are deterministic given (seed, position), and expose their position as a JSON-able dict so a
resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from gppo_jax import errors
from gppo_jax.data import tasks


@dataclasses.dataclass
class Prompt:
  token_ids: list[int]
  gold: Any  # answer string (math / built-in) or tests (code)
  text: str = ""
  level: int = 0
  benchmark: str = ""  # eval sets: the benchmark it belongs to (per-benchmark reports)


def parse_eval_paths(spec: str | None) -> list[tuple[str, str]]:
  """'aime24=a.jsonl,math500=b.jsonl' (or plain paths, named by file stem) -> [(name, path)]."""
  out = []
  for item in (spec or "").split(","):
    item = item.strip()
    if not item:
      continue
    name, sep, path = item.partition("=")
    if not sep:
      path, name = item, os.path.splitext(os.path.basename(item))[0]
    if not name or not path:
      raise errors.ConfigError(f"data.eval_path item {item!r}: expected NAME=PATH or PATH")
    out.append((name, path))
  names = [n for n, _ in out]
  if len(set(names)) != len(names):
    raise errors.ConfigError(f"data.eval_path names must be unique, got {names}")
  return out


class Env(Protocol):
  tokenizer: Any
  max_prompt_len: int
  max_new_tokens: int

  def train_prompts(self, n: int) -> list[Prompt]: ...
  def eval_prompts(self) -> list[Prompt]: ...
  def score(
    self, responses: Sequence[str], prompts: Sequence[Prompt]
  ) -> tuple[np.ndarray, np.ndarray, dict]:
    """(rewards float32 [n], valid bool [n], metrics): invalid = infrastructure error, excluded."""

  def state(self) -> dict: ...
  def restore(self, state: dict) -> None: ...
  def close(self) -> None: ...


class BuiltinEnv:
  """A built-in synthetic task with its tokenizer (characters, or words for word tasks)."""

  def __init__(self, task_name: str, *, seed: int, eval_size: int, eval_seed: int = 12345):
    self.task = tasks.get(task_name)
    self.tokenizer = self.task.tokenizer()
    self.seed = seed
    self.draws = 0
    self._eval = [self._prompt(p) for p in self.task.eval_set(eval_size, seed=eval_seed)]
    # BOS + prompt tokens; answers (worked responses on word tasks) end with EOS.
    self.max_prompt_len = self.task.max_prompt_len + 1
    self.max_new_tokens = self.task.max_answer_len + 1

  def _prompt(self, p: tasks.Problem) -> Prompt:
    # Difficulty levels are reported apart (eval/level<k>/...) on tasks that have several.
    return Prompt(
      self.tokenizer.encode(p.prompt, add_bos=True),
      p.answer,
      p.prompt,
      p.level,
      benchmark=f"level{p.level}",
    )

  def train_prompts(self, n: int) -> list[Prompt]:
    rng = np.random.default_rng([self.seed, self.draws])
    self.draws += 1
    return [self._prompt(p) for p in self.task.sample(rng, n, split="train")]

  def eval_prompts(self) -> list[Prompt]:
    return self._eval

  def score(self, responses, prompts):
    rewards = np.array(
      [
        self.task.reward(r, tasks.Problem(p.text, p.gold, p.level))
        for r, p in zip(responses, prompts, strict=True)
      ],
      np.float32,
    )
    return rewards, np.ones(len(rewards), bool), {}

  def state(self) -> dict:
    return {"draws": self.draws}

  def restore(self, state: dict) -> None:
    self.draws = int(state["draws"])

  def close(self) -> None:
    pass


class DataEnv:
  """Prompts from local files, scored by math-verify (kind="math") or the code sandbox ("code").

  answer_format (config.reward.answer_format, math only): where a response's final answer is read,
  `math_reward.ANSWER_FORMATS`; with data.instruction None it also picks the instruction the
  prompts end with (\\boxed{} for "boxed" and "either", DAPO's `Answer:` line for "answer_line").
  """

  def __init__(
    self,
    data_cfg,
    tokenizer,
    *,
    seed: int,
    batch_size: int,
    max_new_tokens: int,
    answer_format: str = "boxed",
  ):
    from gppo_jax.data import readers as data_lib

    self.tokenizer = tokenizer
    self.kind = data_cfg.kind
    if self.kind not in ("math", "code"):
      raise errors.ConfigError(f"data.kind={self.kind!r}; valid: math, code")
    fields = data_lib.Fields(
      prompt=data_cfg.prompt_field, answer=data_cfg.answer_field, tests=data_cfg.tests_field
    )
    self._scorer = None
    check = None
    if self.kind == "math":
      from gppo_jax.rewards import math_reward

      if answer_format not in math_reward.ANSWER_FORMATS:
        raise errors.ConfigError(
          f"reward.answer_format={answer_format!r}; valid: {', '.join(math_reward.ANSWER_FORMATS)}"
        )
      self._scorer = math_reward.MathVerifier(
        num_workers=data_cfg.verifier_workers,
        timeout_s=data_cfg.verifier_timeout_s,
        mode=math_reward.ANSWER_FORMATS[answer_format],
      )
      check = self._scorer.check_golds
    instruction = data_cfg.instruction
    if instruction is None and self.kind == "math":
      instruction = (
        data_lib.ANSWER_LINE_INSTRUCTION
        if answer_format == "answer_line"
        else data_lib.MATH_INSTRUCTION
      )
    load = dict(
      task=self.kind,
      fields=fields,
      apply_template=_template_fn(tokenizer),
      encode=tokenizer.encode,
      system_prompt=data_cfg.system_prompt,
      instruction=instruction,
      max_prompt_tokens=data_cfg.max_prompt_tokens,
      check_answers=check,
    )
    # No data.train_path: an evaluation-only env (`python -m gppo_jax.evaluate` on a model).
    train_examples, self._iter = [], None
    if data_cfg.train_path is not None:
      train_examples = data_lib.load_dataset(data_cfg.train_path, **load).examples
      if len(train_examples) < batch_size:
        raise errors.DataError(
          f"{data_cfg.train_path}: {len(train_examples)} usable prompts, fewer than "
          f"rollout.prompts_per_iter={batch_size} drawn per iteration"
        )
      self._iter = data_lib.PromptIterator(train_examples, batch_size, seed=seed)
    self._eval = []
    for name, path in parse_eval_paths(data_cfg.eval_path):
      evals = data_lib.load_dataset(path, **load)
      self._eval += [dataclasses.replace(self._prompt(e), benchmark=name) for e in evals.examples]
    lengths = [len(e.token_ids) for e in train_examples] + [len(p.token_ids) for p in self._eval]
    if not lengths:
      raise errors.ConfigError("no data: set data.train_path or data.eval_path")
    longest = max(lengths)
    self.max_prompt_len = -(-longest // 64) * 64  # one compiled sampler per 64-token bucket
    self.max_new_tokens = max_new_tokens
    if self.kind == "code":
      from gppo_jax.rewards import code_reward

      self._scorer = code_reward.CodeScorer()

  @staticmethod
  def _prompt(e) -> Prompt:
    return Prompt(list(e.token_ids), e.answer if e.answer is not None else e.tests, e.text)

  def train_prompts(self, n: int) -> list[Prompt]:
    if self._iter is None:
      raise errors.ConfigError("no data.train_path: this environment only evaluates")
    batch = next(self._iter)
    if len(batch) != n:
      raise ValueError(f"data iterator returned {len(batch)} prompts, expected {n}")
    return [self._prompt(e) for e in batch]

  def eval_prompts(self) -> list[Prompt]:
    return self._eval

  def score(self, responses, prompts):
    golds = [p.gold for p in prompts]
    if self.kind == "math":
      from gppo_jax.rewards import math_reward

      results = self._scorer.score_batch(list(responses), golds)
      counts = math_reward.status_counts(results)
      rewards = np.array([r.score for r in results], np.float32)
      valid = np.ones(len(results), bool)
    else:
      from gppo_jax.rewards import code_reward

      results = self._scorer.score_batch(list(responses), golds)
      counts = code_reward.status_counts(results)
      scores, ok = code_reward.rewards_and_mask(results)
      rewards, valid = np.asarray(scores, np.float32), np.asarray(ok, bool)
    return rewards, valid, {f"reward/status_{k}": v for k, v in counts.items()}

  def state(self) -> dict:
    return {"iterator": None if self._iter is None else self._iter.state()}

  def restore(self, state: dict) -> None:
    self._iter.restore(state["iterator"])

  def close(self) -> None:
    if self._scorer is not None:
      self._scorer.close()


def shape_rewards(
  rewards: np.ndarray,
  texts: Sequence[str],
  lengths: np.ndarray,
  *,
  max_len: int,
  overlong_buffer: int = 0,
  format_coef: float = 0.0,
  answer_format: str = "boxed",
) -> tuple[np.ndarray, dict[str, float]]:
  """Optional reward shaping on top of correctness (both off by default).

  overlong_buffer > 0: DAPO's soft overlong penalty over the last `overlong_buffer` of `max_len`
  response tokens. format_coef > 0: + format_coef for a response whose final answer can be
  extracted in `answer_format` (`math_reward.ANSWER_FORMATS`: a closed \\boxed{...} by default).
  """
  from gppo_jax.rewards import math_reward

  out = np.asarray(rewards, np.float32).copy()
  metrics = {}
  if overlong_buffer > 0:
    pen = np.array(
      [math_reward.overlong_penalty(int(n), max_len, overlong_buffer) for n in lengths], np.float32
    )
    out += pen
    metrics["reward/overlong_penalty_mean"] = float(pen.mean())
  if format_coef > 0:
    mode = math_reward.ANSWER_FORMATS[answer_format]
    fmt = np.array(
      [math_reward.format_reward(t, mode, reward=format_coef) for t in texts], np.float32
    )
    out += fmt
    metrics["reward/format_frac"] = float(np.mean(fmt > 0))
  return out, metrics


def _template_fn(tokenizer):
  apply = getattr(tokenizer, "apply_chat_template", None)
  if apply is None:
    logging.warning("tokenizer has no chat template: prompts are used as plain text")
    return None
  return apply


def make_env(config, tokenizer=None) -> Env:
  """The environment a config describes: data files if data.train_path is set, else a task."""
  if config.data.train_path is None and config.model.path is None:
    return BuiltinEnv(config.task.name, seed=config.seed, eval_size=config.eval.num_problems)
  if tokenizer is None:
    raise errors.ConfigError(
      "data.train_path is set but model.path is not: data files need the model's tokenizer"
    )
  return DataEnv(
    config.data,
    tokenizer,
    seed=config.seed,
    batch_size=config.rollout.prompts_per_iter,
    max_new_tokens=config.rollout.max_new_tokens,
    answer_format=config.reward.get("answer_format", "boxed"),
  )
