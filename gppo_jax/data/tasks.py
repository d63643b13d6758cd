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
import functools
import hashlib
from collections.abc import Sequence

import numpy as np

from gppo_jax import errors

# --- Character tokenizer ------------------------------------------------------------------------

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = "0123456789+-*=() ?"


class _FixedVocabulary:
  """A vocabulary fixed in code: ids 0..2 are pad, bos, eos, then `symbols` in order. Subclasses
  say how text splits into symbols (`_split`) and how decoded symbols join (`joiner`)."""

  joiner = ""

  def __init__(self, symbols: Sequence[str]):
    self.specials = [PAD, BOS, EOS]
    self.symbols = tuple(symbols)
    self._to_id = {c: i + len(self.specials) for i, c in enumerate(self.symbols)}
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self.vocab_size = len(self.specials) + len(self.symbols)
    self.chat_template = None

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  def _split(self, text: str) -> Sequence[str]:
    raise NotImplementedError

  def _unknown(self, bad: list[str]) -> str:
    """The error for symbols of a text that are not in the vocabulary."""
    raise NotImplementedError

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    parts = self._split(text)
    bad = sorted({c for c in parts if c not in self._to_id})
    if bad:
      raise ValueError(self._unknown(bad))
    ids = [self._to_id[c] for c in parts]
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    out = []
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
      if i < len(self.specials):
        if i == self.eos_id and skip_special:
          break
        if not skip_special:
          out.append(self.specials[i])
        continue
      out.append(self.symbols[i - len(self.specials)])
    return self.joiner.join(out)

  def apply_chat_template(self, messages: list[dict]) -> str:
    """The built-in tasks have no chat format: the user turn is the prompt."""
    return self.joiner.join(m["content"] for m in messages if m.get("role", "user") == "user")


class CharTokenizer(_FixedVocabulary):
  """A fixed character vocabulary for the built-in tasks: ids 0..2 are pad, bos, eos."""

  def __init__(self, chars: str = CHARS):
    super().__init__(chars)
    self.chars = chars

  def _split(self, text: str) -> Sequence[str]:
    return text

  def _unknown(self, bad: list[str]) -> str:
    return f"characters {bad!r} are not in the task vocabulary {self.chars!r}"


# --- Problems ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str
  answer: str
  level: int = 0
  # A worked response the warm start imitates (word tasks); "" = the answer itself.
  solution: str = ""


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

  def tokenizer(self) -> CharTokenizer:
    return CharTokenizer()

  @staticmethod
  def reward(response: str, problem: Problem) -> float:
    """1 for an exactly correct answer (surrounding spaces ignored), else 0."""
    return float(response.strip() == problem.answer)


def _mixture(name, comps, weights, description):
  return Task(name, tuple(comps), tuple(weights), description=description)


# --- Word-level tasks ---------------------------------------------------------------------------
#
# The arithmetic tasks above have a 21-token vocabulary and answers of at most 6 tokens: every
# sampled token is likely, and no token is rare enough for the estimators' treatment of rare tokens
# to matter. `WordChain` is a task in the regime of reasoning LLMs instead: a word vocabulary of
# thousands, responses of about 70 tokens, and most sampled tokens unlikely under the policy.
#
# The problem is a short state-tracking program: a start digit and `steps` labelled operations
# (add or subtract 1 or 2, modulo 10). The response works through the program one step at a
# time in a synthetic language and ends with the final state:
#
#   prompt:    start 4 s1 +2 s2 -1 ... s6 +1 ?
#   response:  <phrase> s1 +2 4 gives 6 <phrase> s2 -1 6 gives 5 ... <phrase> answer 7 <eos>
#
# Each step's content (its label and operation, copied from the prompt, the state before, `gives`,
# the state after) is five determined tokens. Every <phrase> is a run of optional filler slots,
# each slot's word drawn from its own class of hundreds of interchangeable synonyms with Zipfian
# frequencies: a policy that models the language well is still uncertain over many
# low-probability words, as an LLM is over its phrasing. The reward reads only the final answer:
# the response must end with `answer` and the right digit. The words a greedy decoder must get
# right are single tokens, never a class of synonyms: a class of hundreds would lose the argmax to
# a single wrong token of lower total probability.

VERB, ANSWER = "gives", "answer"  # the two fixed words of a response besides its content
# Synthetic words: consonant-vowel syllables, two per word (70 x 70 = 4900 distinct words).
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)
_NUM_WORDS = len(_SYLLABLES) ** 2
# A fixed bijection of [0, _NUM_WORDS) (the stride is coprime to 4900), so that neighbouring
# synonyms and classes do not share their first syllable.
_WORD_STRIDE = 1021


def synthetic_word(index: int) -> str:
  """The index-th synthetic two-syllable word (0 <= index < 4900), the same on every machine."""
  if not 0 <= index < _NUM_WORDS:
    raise ValueError(f"word index {index} is outside [0, {_NUM_WORDS})")
  k = (index * _WORD_STRIDE + 7) % _NUM_WORDS
  return _SYLLABLES[k // len(_SYLLABLES)] + _SYLLABLES[k % len(_SYLLABLES)]


class WordTokenizer(_FixedVocabulary):
  """A fixed word-level vocabulary built in code: ids 0..2 are pad, bos, eos, then `words` in
  order. Text is words separated by whitespace; decoding joins them with single spaces."""

  joiner = " "

  def __init__(self, words: Sequence[str]):
    words = tuple(words)
    specials = (PAD, BOS, EOS)
    bad = [w for w in words if not w or w != w.strip() or len(w.split()) != 1 or w in specials]
    if bad:
      raise ValueError(f"vocabulary words must be non-empty, without whitespace: {bad[:5]!r}")
    if len(set(words)) != len(words):
      dup = sorted({w for w in words if words.count(w) > 1})
      raise ValueError(f"vocabulary words must be distinct, repeated: {dup[:5]!r}")
    super().__init__(words)
    self.words = words

  def _split(self, text: str) -> Sequence[str]:
    return text.split()

  def _unknown(self, bad: list[str]) -> str:
    more = " ..." if len(bad) > 5 else ""
    return f"words {bad[:5]!r}{more} are not in the task vocabulary ({len(self.words)} words)"


@dataclasses.dataclass(frozen=True)
class WordChain:
  """A state-tracking program written out step by step in a synthetic word language (above).

  steps: operations per problem, each adding or subtracting 1..max_operand; class_size: synonyms
  per word class; zipf: the exponent s of the synonyms' frequencies (rank r, from 1, has weight
  r^-s); phrase_slots: for each optional slot of a filler phrase, the probability that it is
  present (each slot has its own class of words).
  """

  name: str
  steps: int = 6
  max_operand: int = 2
  class_size: int = 512
  zipf: float = 1.0
  phrase_slots: tuple[float, ...] = (0.8, 0.7, 0.7, 0.6, 0.8, 0.6, 0.7, 0.6)
  eval_fraction: float = 0.1
  level: int = 1
  description: str = ""

  modulus = 10  # states are the digits

  def __post_init__(self):
    problems = []
    if not (isinstance(self.steps, int) and 1 <= self.steps <= 99):
      problems.append(f"steps={self.steps!r} must be an integer in [1, 99]")
    if not (isinstance(self.max_operand, int) and 1 <= self.max_operand < self.modulus):
      problems.append(f"max_operand={self.max_operand!r} must be an integer in [1, 9]")
    if not (isinstance(self.class_size, int) and self.class_size >= 1):
      problems.append(f"class_size={self.class_size!r} must be an integer >= 1")
    elif len(self.phrase_slots) * self.class_size > _NUM_WORDS:
      problems.append(
        f"{len(self.phrase_slots)} word classes of class_size={self.class_size} need more "
        f"than the {_NUM_WORDS} synthetic words"
      )
    if not self.zipf >= 0:
      problems.append(f"zipf={self.zipf!r} must be >= 0")
    if not all(0 < p <= 1 for p in self.phrase_slots):
      problems.append(f"phrase_slots={self.phrase_slots!r}: each probability must be in (0, 1]")
    if problems:
      raise ValueError(f"WordChain {self.name!r}: " + "; ".join(problems))

  # Vocabulary -----------------------------------------------------------------------------------

  @property
  def num_classes(self) -> int:
    """Word classes: one per phrase slot."""
    return len(self.phrase_slots)

  def word_class(self, c: int) -> tuple[str, ...]:
    """The synonyms of class c, most frequent first."""
    return _word_classes(self.class_size, self.num_classes)[c]

  def content_words(self) -> tuple[str, ...]:
    digits = tuple(str(d) for d in range(self.modulus))
    ops = tuple(f"{s}{d}" for s in "+-" for d in range(1, self.max_operand + 1))
    labels = tuple(f"s{k}" for k in range(1, self.steps + 1))
    return (*digits, *ops, *labels, "start", "?", VERB, ANSWER)

  def tokenizer(self) -> WordTokenizer:
    return _word_tokenizer(self.content_words(), self.class_size, self.num_classes)

  # Problems -------------------------------------------------------------------------------------

  @property
  def max_prompt_len(self) -> int:
    """Prompt words: `start d`, a label and an operation per step, `?`."""
    return 3 + 2 * self.steps

  @property
  def max_answer_len(self) -> int:
    """Response words without the end token, at most: every phrase slot filled."""
    phrase = len(self.phrase_slots)
    return self.steps * (phrase + 5) + phrase + 2

  @property
  def mean_answer_len(self) -> float:
    """Expected response words without the end token."""
    return (self.steps + 1) * sum(self.phrase_slots) + 5 * self.steps + 2

  def _cdf(self) -> np.ndarray:
    weights = np.arange(1, self.class_size + 1, dtype=np.float64) ** -float(self.zipf)
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]

  def _solution(self, rng: np.random.Generator, start: int, ops: Sequence[int]) -> str:
    """A response in the synthetic language: every step, then the answer (the final state)."""
    cdf = self._cdf()
    slots = len(self.phrase_slots)
    present = rng.random((self.steps + 1, slots)) < np.asarray(self.phrase_slots)
    picks = np.minimum(
      cdf.searchsorted(rng.random((self.steps + 1, slots)), side="right"), self.class_size - 1
    )
    classes = _word_classes(self.class_size, self.num_classes)

    def phrase(k):
      return [classes[c][picks[k, c]] for c in range(slots) if present[k, c]]

    words, state = [], start
    for k, op in enumerate(ops):
      new = (state + op) % self.modulus
      words += phrase(k)
      words += [f"s{k + 1}", f"{op:+d}", str(state), VERB, str(new)]
      state = new
    words += phrase(self.steps)
    words += [ANSWER, str(state)]
    return " ".join(words)

  def _problem(self, rng: np.random.Generator) -> tuple[str, str, int, list[int]]:
    start = int(rng.integers(self.modulus))
    signs = rng.integers(2, size=self.steps)
    amounts = rng.integers(1, self.max_operand + 1, size=self.steps)
    ops = [int(a) if s else -int(a) for s, a in zip(signs, amounts, strict=True)]
    prompt = " ".join(
      ["start", str(start)] + [w for k, op in enumerate(ops) for w in (f"s{k + 1}", f"{op:+d}")]
    )
    prompt += " ?"
    answer = (start + sum(ops)) % self.modulus
    return prompt, str(answer), start, ops

  def sample(self, rng: np.random.Generator, n: int, split: str = "train") -> list[Problem]:
    """n problems of the split ("train" or "eval"), each with a sampled worked solution (the
    warm start's target); the split is decided by a hash of the prompt, as in `Task`."""
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    want_eval = split == "eval"
    out: list[Problem] = []
    while len(out) < n:
      prompt, answer, start, ops = self._problem(rng)
      if _is_eval(prompt, self.eval_fraction) == want_eval:
        solution = self._solution(rng, start, ops)
        out.append(Problem(prompt, answer, self.level, solution))
    return out

  def eval_set(self, n: int, seed: int = 12345) -> list[Problem]:
    """A fixed held-out set: the same n problems for every run with this seed."""
    return self.sample(np.random.default_rng(seed), n, split="eval")

  def reward(self, response: str, problem: Problem) -> float:
    """1 if the response ends with `answer` and the right final state, else 0."""
    words = response.split()
    return float(len(words) >= 2 and words[-2] == ANSWER and words[-1] == problem.answer)

  def states(self, response: str) -> list[int] | None:
    """The states a well-formed response writes after each step (the last one being its answer),
    or None where the response does not follow the language (checks every word's class)."""
    sets = _class_sets(self.class_size, self.num_classes)
    slots = len(self.phrase_slots)
    words, i, out = response.split(), 0, []

    def skip_phrase(i):
      c = 0
      while i < len(words) and c < slots:
        if words[i] in sets[c]:
          i += 1
        c += 1
      return i

    digits = {str(d) for d in range(self.modulus)}
    state = None
    for k in range(self.steps):
      i = skip_phrase(i)
      step = words[i : i + 5]
      if len(step) < 5 or step[0] != f"s{k + 1}" or step[2] not in digits:
        return None
      if (state is not None and int(step[2]) != state) or step[4] not in digits:
        return None
      ops = {f"{s}{d}" for s in "+-" for d in range(1, self.max_operand + 1)}
      if step[1] not in ops:
        return None
      if step[3] != VERB:
        return None
      state = int(step[4])
      out.append(state)
      i += 5
    i = skip_phrase(i)
    if len(words) - i != 2 or words[i] != ANSWER:
      return None
    if words[-1] not in digits or int(words[-1]) != state:
      return None
    return out


@functools.lru_cache(maxsize=8)
def _word_classes(class_size: int, num_classes: int) -> tuple[tuple[str, ...], ...]:
  return tuple(
    tuple(synthetic_word(c * class_size + r) for r in range(class_size)) for c in range(num_classes)
  )


@functools.lru_cache(maxsize=8)
def _class_sets(class_size: int, num_classes: int) -> tuple[frozenset[str], ...]:
  return tuple(frozenset(c) for c in _word_classes(class_size, num_classes))


@functools.lru_cache(maxsize=8)
def _word_tokenizer(content: tuple[str, ...], class_size: int, num_classes: int) -> WordTokenizer:
  return WordTokenizer([*content, *(w for c in _word_classes(class_size, num_classes) for w in c)])


TASKS: dict[str, Task | WordChain] = {
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
  "wordchain": WordChain(
    "wordchain",
    description="a 6-step state-tracking program worked through in a synthetic word language "
    "(4,123 words, responses of about 71 tokens): most sampled tokens are rare, as in an LLM; "
    "configs/base.py:task=wordchain sets its model and run",
  ),
}


def get(name: str) -> Task | WordChain:
  if name not in TASKS:
    raise errors.unknown_name("built-in task", name, TASKS)
  return TASKS[name]
