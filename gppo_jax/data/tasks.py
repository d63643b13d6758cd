"""Built-in synthetic tasks with verifiable rewards: the embedded default of gppo_jax.

Arithmetic problems written as characters ("47+85=") with the answer expected as characters
followed by an end-of-sequence token. Answers may be written with their digits reversed (least
significant first), which makes carries local and the task learnable by a tiny decoder.

A task is a weighted mixture of `Arithmetic` components (difficulty levels); the held-out evaluation
set is disjoint from training problems by construction (a hash of the problem text decides its
split), so no amount of training data ever leaks an evaluation problem. Everything is generated here
from a seed: no downloads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from gppo_jax import errors

# --- Character tokenizer ------------------------------------------------------------------------

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = "0123456789+-*=() ?"


class CharTokenizer:
  """A fixed character vocabulary for the built-in tasks: ids 0..2 are pad, bos, eos."""

  def __init__(self, chars: str = CHARS):
    self.specials = [PAD, BOS, EOS]
    self.chars = chars
    self._to_id = {c: i + len(self.specials) for i, c in enumerate(chars)}
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self.vocab_size = len(self.specials) + len(chars)
    self.chat_template = None

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    bad = sorted({c for c in text if c not in self._to_id})
    if bad:
      raise ValueError(f"characters {bad!r} are not in the task vocabulary {self.chars!r}")
    ids = [self._to_id[c] for c in text]
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    out = []
    for i in ids:
      i = int(i)
      if i < len(self.specials):
        if i == self.eos_id and skip_special:
          break
        if not skip_special:
          out.append(self.specials[i])
        continue
      out.append(self.chars[i - len(self.specials)])
    return "".join(out)

  def apply_chat_template(self, messages: list[dict]) -> str:
    """The built-in tasks have no chat format: the user turn is the prompt."""
    return "".join(m["content"] for m in messages if m.get("role", "user") == "user")


# --- Problems ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str
  answer: str
  level: int = 0


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  """num_operands integers with `digits` digits joined by ops drawn from `ops`, answer reversed.

  Subtraction results are kept non-negative by ordering operands; "*" multiplies by a 1-digit
  number. The answer has no leading zeros in normal order (so its reversal may end in zeros only
  when the value itself does).
  """

  digits: int = 3
  num_operands: int = 2
  ops: str = "+"
  reverse: bool = True
  level: int = 0
  pad: bool = False  # zero-pad operands to `digits` ("123-045="): one prompt length per level

  def sample(self, rng: np.random.Generator) -> Problem:
    lo, hi = 10 ** (self.digits - 1), 10**self.digits
    if self.digits == 1:
      lo = 0
    nums = [int(rng.integers(lo, hi)) for _ in range(self.num_operands)]
    ops = [self.ops[int(rng.integers(len(self.ops)))] for _ in range(self.num_operands - 1)]
    width = self.digits if self.pad else 0
    value = nums[0]
    text = str(nums[0]).zfill(width)
    for op, n in zip(ops, nums[1:], strict=True):
      if op == "-" and n > value:
        n = int(rng.integers(0, value + 1))
      if op == "*":
        n = int(rng.integers(2, 10))
      value = value + n if op == "+" else value - n if op == "-" else value * n
      text += f"{op}{str(n).zfill(width if op != '*' else 0)}"
    answer = str(value)
    return Problem(
      prompt=text + "=", answer=answer[::-1] if self.reverse else answer, level=self.level
    )


def _is_eval(prompt: str, eval_fraction: float) -> bool:
  h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")
  return (h % 10_000) < eval_fraction * 10_000


@dataclasses.dataclass(frozen=True)
class Task:
  """A weighted mixture of difficulty levels with a hash-disjoint held-out split."""

  name: str
  components: tuple[Arithmetic, ...]
  weights: tuple[float, ...]
  eval_fraction: float = 0.1
  description: str = ""

  @property
  def max_prompt_len(self) -> int:
    return max(c.num_operands * (c.digits + 1) for c in self.components)

  @property
  def max_answer_len(self) -> int:
    out = 0
    for c in self.components:
      if "*" in c.ops:
        out = max(out, c.digits + c.num_operands)
      else:
        out = max(out, c.digits + 1 + (c.num_operands > 2))
    return out

  def sample(self, rng: np.random.Generator, n: int, split: str = "train") -> list[Problem]:
    """n problems of the given split ("train" or "eval"), drawn by rejection on the hash split."""
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    want_eval = split == "eval"
    cdf = np.cumsum(np.asarray(self.weights, np.float64))
    cdf /= cdf[-1]
    out: list[Problem] = []
    while len(out) < n:
      # = rng.choice(len(components), p=weights / sum): the same draw from the same stream
      # (tests/test_train.py), without choice's per-call validation (half this loop's time).
      comp = self.components[int(cdf.searchsorted(rng.random(), side="right"))]
      problem = comp.sample(rng)
      if _is_eval(problem.prompt, self.eval_fraction) == want_eval:
        out.append(problem)
    return out

  def eval_set(self, n: int, seed: int = 12345) -> list[Problem]:
    """A fixed held-out set: the same n problems for every run with this seed."""
    return self.sample(np.random.default_rng(seed), n, split="eval")

  @staticmethod
  def reward(response: str, problem: Problem) -> float:
    """1 for an exactly correct answer (surrounding spaces ignored), else 0."""
    return float(response.strip() == problem.answer)


def _mixture(name, comps, weights, description):
  return Task(name, tuple(comps), tuple(weights), description=description)


TASKS: dict[str, Task] = {
  "add1": _mixture(
    "add1",
    [Arithmetic(1, 2, "+", True, 1)],
    [1.0],
    "1-digit addition, answer reversed (tiny: for tests and quick checks)",
  ),
  "add_rev3": _mixture(
    "add_rev3",
    [Arithmetic(3, 2, "+", True, 1)],
    [1.0],
    "3-digit addition, answer reversed (easy: RL saturates in about a minute)",
  ),
  "addsub3": _mixture(
    "addsub3",
    [
      Arithmetic(3, 2, "+", True, 1, pad=True),
      Arithmetic(3, 2, "-", True, 2, pad=True),
    ],
    [0.5, 0.5],
    "3-digit addition and subtraction (zero-padded operands), answers reversed: two difficulty "
    "levels, subtraction the harder (the default)",
  ),
  "ops3": _mixture(
    "ops3",
    [
      Arithmetic(3, 2, "+", True, 1, pad=True),
      Arithmetic(3, 2, "-", True, 2, pad=True),
      Arithmetic(3, 2, "*", True, 3, pad=True),
    ],
    [1 / 3, 1 / 3, 1 / 3],
    "3-digit addition, subtraction and multiplication by a digit, answers reversed (harder)",
  ),
  "add3": _mixture(
    "add3",
    [Arithmetic(3, 2, "+", False, 1)],
    [1.0],
    "3-digit addition, normal order",
  ),
  "add_rev34": _mixture(
    "add_rev34",
    [Arithmetic(3, 2, "+", True, 1), Arithmetic(4, 2, "+", True, 2)],
    [0.5, 0.5],
    "3- and 4-digit addition, answers reversed (two lengths: slow to warm-start at 0.1M)",
  ),
  "add_mix": _mixture(
    "add_mix",
    [
      Arithmetic(2, 2, "+", True, 1),
      Arithmetic(3, 2, "+", True, 2),
      Arithmetic(4, 2, "+", True, 3),
      Arithmetic(2, 3, "+", True, 4),
    ],
    [0.25, 0.25, 0.25, 0.25],
    "mixed difficulty: 2-4 digit addition and 3-operand 2-digit sums, answers reversed",
  ),
  "arith_mix": _mixture(
    "arith_mix",
    [
      Arithmetic(2, 2, "+-", True, 1),
      Arithmetic(3, 2, "+-", True, 2),
      Arithmetic(2, 3, "+-", True, 3),
      Arithmetic(3, 3, "+-", True, 4),
    ],
    [0.2, 0.3, 0.25, 0.25],
    "mixed difficulty: 2-3 digit addition/subtraction with 2 or 3 operands, answers reversed",
  ),
}


def get(name: str) -> Task:
  if name not in TASKS:
    raise errors.unknown_name("built-in task", name, TASKS)
  return TASKS[name]
