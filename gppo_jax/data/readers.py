"""Prompt datasets: read JSONL/Parquet rows, validate them, render and tokenize prompts, iterate.

A row is {prompt, answer} (math) or {prompt, tests} (code), with an optional id and metadata; the
field names are configurable (`Fields`). `prompt` is a string (one user turn) or a list of chat
messages {role, content}. Rendering goes through callables passed in (the tokenizer lives in the
model layer): `apply_template(messages) -> str` and `encode(str) -> list[int]`.

Every malformed row fails loudly with the file and line (JSONL) or row number (Parquet).
`PromptIterator` walks shuffled epochs in batches and exposes its position (epoch, index) so a
restored run continues with exactly the batch it would have drawn next.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gppo_jax import errors

logger = logging.getLogger(__name__)

TASKS = ("math", "code")
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# The instruction of DAPO-Math-17k's prompts (answer on an `Answer:` line), after the problem: the
# default for reward.answer_format="answer_line".
ANSWER_LINE_INSTRUCTION = (
  "Solve the problem step by step. The last line of your response should be of the form "
  "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
  'Remember to put your answer on its own line after "Answer:".'
)
ROLES = ("system", "user", "assistant")


# A dataset file or row is malformed; the message names the file and line (a UserError).
DataError = errors.DataError


@dataclasses.dataclass(frozen=True)
class Fields:
  """Names of the row fields to read."""

  prompt: str = "prompt"
  answer: str = "answer"
  tests: str = "tests"
  id: str = "id"
  metadata: str = "metadata"


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt ready for sampling. `source` is "file:line" for error messages and logs."""

  id: str
  messages: tuple[dict, ...]
  text: str
  token_ids: tuple[int, ...]
  answer: str | None
  tests: dict | None
  metadata: dict
  source: str


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Examples kept after filtering, with how many rows were read and dropped as too long."""

  path: str
  examples: list[Example]
  num_rows: int
  num_dropped_too_long: int

  def __len__(self) -> int:
    return len(self.examples)


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------


SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class Unreadable:
  """A line of a JSON-lines file that is not JSON (or not UTF-8), in place of its record.
  `reason` is the same for every line with the same fault (it is counted); `message` adds where
  on the line."""

  reason: str
  message: str


def read_records(path: str, *, bad_lines: str = "raise") -> Iterator[tuple[str, Any]]:
  """(location, record) for every record of a file, streamed; the one reader of the package's
  JSON lines, JSON arrays and Parquet files (datasets, prepare_data's sources, metrics.jsonl).

  .parquet: one record per row, read a batch of rows at a time; location "path:row N".
  .json: a JSON array, one record per item ("path:item N"), or else JSON lines.
  Any other name: JSON lines, one JSON value per line, blank lines skipped ("path:N").
  bad_lines: what a line that is not JSON or not UTF-8 does: "raise" a DataError naming
    path:line, "yield" an `Unreadable` as its record, or "skip" it (a torn last line of a
    metrics.jsonl that a killed run was writing).
  Records are yielded as parsed (not only dicts); the callers check their shape.
  """
  if bad_lines not in ("raise", "yield", "skip"):
    raise ValueError(f"bad_lines must be 'raise', 'yield' or 'skip', got {bad_lines!r}")
  if not os.path.exists(path):
    raise DataError(f"{path}: no such file")
  if os.path.isdir(path):
    raise DataError(f"{path}: is a folder; expected a .jsonl, .json or .parquet file")
  if path.endswith(".parquet"):
    yield from _parquet_records(path)
    return
  if path.endswith(".json"):
    doc = _json_document(path)
    if isinstance(doc, list):
      for i, record in enumerate(doc, start=1):
        yield f"{path}:item {i}", record
      return
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      loc = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        bad = Unreadable(
          "not UTF-8 text", f"not UTF-8 text ({e.reason}); expected JSON lines or a .parquet file"
        )
      else:
        if not line.strip():
          continue
        try:
          yield loc, json.loads(line)
          continue
        except json.JSONDecodeError as e:
          bad = Unreadable(f"invalid JSON ({e.msg})", f"invalid JSON ({e.msg} at column {e.colno})")
      if bad_lines == "raise":
        raise DataError(f"{loc}: {bad.message}")
      if bad_lines == "yield":
        yield loc, bad


def _json_document(path: str) -> Any:
  """The whole .json file parsed, or None when it holds JSON lines (several values)."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    doc = json.loads(data.decode("utf-8"))
  except UnicodeDecodeError:
    return None  # the line reader names the line
  except json.JSONDecodeError as e:
    if e.msg != "Extra data":
      raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    return None
  if isinstance(doc, list) or (isinstance(doc, dict) and b"\n" not in data.strip()):
    return doc  # an array, or one object on one line: JSON lines with one row
  raise DataError(f"{path}: expected a JSON array of objects or JSON lines")


def _parquet_records(path: str) -> Iterator[tuple[str, dict]]:
  import pyarrow.parquet as pq

  try:
    batches = pq.ParquetFile(path).iter_batches(batch_size=256)
    n = 0
    while True:
      try:
        batch = next(batches)
      except StopIteration:
        return
      for row in batch.to_pylist():
        n += 1
        yield f"{path}:row {n}", row
  except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
    raise DataError(f"{path}: cannot read Parquet file ({e})") from None


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
  """Yield (location, row) of a dataset file (`read_records`), every record a JSON object;
  a bad line, a record that is not an object, or a file without rows is a DataError."""
  found = False
  for loc, row in read_records(path):
    if not isinstance(row, dict):
      raise DataError(f"{loc}: expected a JSON object per line, got {type(row).__name__}")
    found = True
    yield loc, row
  if not found:
    raise DataError(f"{path}: file has no rows")


def metric_rows(path: str) -> Iterator[dict]:
  """The rows of a metrics.jsonl: JSON objects, skipping lines that are not (the torn last line
  of a run killed while writing it)."""
  for _, row in read_records(path, bad_lines="skip"):
    if isinstance(row, dict):
      yield row


# ---------------------------------------------------------------------------------------------
# Validating and rendering rows
# ---------------------------------------------------------------------------------------------


def _messages(
  prompt: Any, loc: str, field: str, system_prompt: str | None, instruction: str | None
) -> tuple[dict, ...]:
  """Chat messages of a prompt field, with the system prompt and instruction suffix added."""
  if isinstance(prompt, str):
    if not prompt.strip():
      raise DataError(f"{loc}: field {field!r} is an empty string")
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, list) and prompt:
    messages = []
    for j, m in enumerate(prompt):
      if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES):
        raise DataError(
          f"{loc}: field {field!r} message {j} must be {{'role': one of {ROLES}, "
          f"'content': str}}, got {m!r:.200}"
        )
      messages.append({"role": m["role"], "content": m["content"]})
    if messages[-1]["role"] != "user":
      raise DataError(f"{loc}: field {field!r} must end with a user message")
  else:
    raise DataError(
      f"{loc}: field {field!r} must be a non-empty string or list of chat messages, "
      f"got {type(prompt).__name__}"
    )
  if instruction:
    last = messages[-1]
    messages[-1] = {"role": "user", "content": f"{last['content'].rstrip()}\n\n{instruction}"}
  if system_prompt and messages[0]["role"] != "system":
    messages.insert(0, {"role": "system", "content": system_prompt})
  return tuple(messages)


def _answer(value: Any, loc: str, field: str) -> str:
  if isinstance(value, bool) or not isinstance(value, str | int | float):
    raise DataError(
      f"{loc}: field {field!r} must be a string or number, got {type(value).__name__}"
    )
  answer = str(value).strip()
  if not answer:
    raise DataError(f"{loc}: field {field!r} is empty")
  return answer


def _tests(value: Any, loc: str, field: str) -> dict:
  """Code tests, one of three forms (a JSON string holding one is accepted too):
  {inputs: [...], outputs: [...]}            stdin/stdout cases;
  {fn_name, inputs: [[args]...], outputs}    function-call cases;
  {test_code, entry_point, setup_code?}      HumanEval-style check code calling `candidate`.
  """
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as e:
      raise DataError(f"{loc}: field {field!r} is a string but not JSON ({e.msg})") from None
  if not isinstance(value, dict):
    raise DataError(f"{loc}: field {field!r} must be a dict, got {type(value).__name__}")
  if "test_code" in value:
    code, entry = value.get("test_code"), value.get("entry_point")
    if not (isinstance(code, str) and code.strip()):
      raise DataError(f"{loc}: field {field!r}: 'test_code' must be a non-empty string")
    if not (isinstance(entry, str) and entry.isidentifier()):
      raise DataError(f"{loc}: field {field!r}: 'entry_point' must be a Python identifier")
    if not isinstance(value.get("setup_code", ""), str):
      raise DataError(f"{loc}: field {field!r}: 'setup_code' must be a string")
    return value
  inputs, outputs = value.get("inputs"), value.get("outputs")
  if not isinstance(inputs, list) or not isinstance(outputs, list):
    raise DataError(
      f"{loc}: field {field!r} needs list fields 'inputs' and 'outputs' (or 'test_code')"
    )
  if not inputs or len(inputs) != len(outputs):
    raise DataError(
      f"{loc}: field {field!r} needs as many outputs as inputs (and at least one), "
      f"got {len(inputs)} inputs and {len(outputs)} outputs"
    )
  fn_name = value.get("fn_name")
  if fn_name is not None and not (isinstance(fn_name, str) and fn_name.isidentifier()):
    raise DataError(f"{loc}: field {field!r}: 'fn_name' must be a Python identifier")
  return value


def load_dataset(
  path: str,
  *,
  task: str = "math",
  fields: Fields = Fields(),
  apply_template: Callable[[list[dict]], str] | None = None,
  encode: Callable[[str], list[int]] | None = None,
  system_prompt: str | None = None,
  instruction: str | None = None,
  max_prompt_tokens: int | None = None,
  check_answers: Callable[[Sequence[str]], Sequence[str | None]] | None = None,
  limit: int | None = None,
) -> Dataset:
  """Read, validate, render and length-filter a dataset file.

  task: "math" rows need `fields.answer`, "code" rows need `fields.tests`.
  apply_template: renders chat messages to the prompt text; without it the user content is used
    as-is (base models) and list prompts with more than one message are rejected.
  encode: tokenizer; required when max_prompt_tokens is set. Rows whose prompt has more than
    max_prompt_tokens tokens are dropped, and the count is logged.
  check_answers: validates all gold answers at once, returning None or a reason per answer
    (e.g. `MathVerifier.check_golds`); the first bad one raises with its file and line.
  limit: keep only the first `limit` rows (before length filtering).
  """
  if task not in TASKS:
    raise errors.ConfigError(f"unknown data kind {task!r}; valid: {', '.join(TASKS)}")
  if max_prompt_tokens is not None and encode is None:
    raise ValueError("max_prompt_tokens needs an encode function")
  examples: list[Example] = []
  seen_ids: dict[str, str] = {}
  num_rows = 0
  for loc, row in read_rows(path):
    if limit is not None and num_rows >= limit:
      break
    num_rows += 1
    if fields.prompt not in row:
      raise DataError(f"{loc}: missing field {fields.prompt!r} (row has {sorted(row)})")
    messages = _messages(row[fields.prompt], loc, fields.prompt, system_prompt, instruction)
    answer = tests = None
    if task == "math":
      if fields.answer not in row:
        raise DataError(f"{loc}: missing field {fields.answer!r} (row has {sorted(row)})")
      answer = _answer(row[fields.answer], loc, fields.answer)
    else:
      if fields.tests not in row:
        raise DataError(f"{loc}: missing field {fields.tests!r} (row has {sorted(row)})")
      tests = _tests(row[fields.tests], loc, fields.tests)
    row_id = row.get(fields.id)
    row_id = str(num_rows - 1) if row_id is None else str(row_id)
    if row_id in seen_ids:
      raise DataError(f"{loc}: duplicate id {row_id!r} (first at {seen_ids[row_id]})")
    seen_ids[row_id] = loc
    metadata = row.get(fields.metadata) or {}
    if not isinstance(metadata, dict):
      raise DataError(f"{loc}: field {fields.metadata!r} must be a dict")
    if apply_template is not None:
      text = apply_template([dict(m) for m in messages])
      if not isinstance(text, str):
        raise TypeError(f"apply_template returned {type(text).__name__}, expected str")
    else:
      if len(messages) != 1:
        raise DataError(f"{loc}: a multi-message prompt needs apply_template (a chat template)")
      text = messages[0]["content"]
    token_ids = tuple(encode(text)) if encode is not None else ()
    examples.append(Example(row_id, messages, text, token_ids, answer, tests, dict(metadata), loc))

  if check_answers is not None and task == "math":
    reasons = check_answers([e.answer for e in examples])
    bad = [(e, r) for e, r in zip(examples, reasons, strict=True) if r is not None]
    if bad:
      e, reason = bad[0]
      raise DataError(
        f"{e.source}: gold answer {e.answer!r} rejected ({reason}); "
        f"{len(bad)} bad answer(s) in {path}"
      )

  num_dropped = 0
  if max_prompt_tokens is not None:
    kept = [e for e in examples if len(e.token_ids) <= max_prompt_tokens]
    num_dropped = len(examples) - len(kept)
    examples = kept
    logger.info(
      "%s: dropped %d of %d rows with prompts over %d tokens",
      path,
      num_dropped,
      num_rows,
      max_prompt_tokens,
    )
  if not examples:
    why = ""
    if num_dropped:
      why = (
        f"; all {num_dropped} prompts are over max_prompt_tokens={max_prompt_tokens} tokens "
        "(raise data.max_prompt_tokens)"
      )
    raise DataError(f"{path}: no rows left after filtering ({num_rows} read{why})")
  return Dataset(path, examples, num_rows, num_dropped)


# ---------------------------------------------------------------------------------------------
# Iteration
# ---------------------------------------------------------------------------------------------


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
  """The example order of one epoch: a permutation that depends only on (seed, epoch)."""
  order = list(range(num_examples))
  if shuffle:
    random.Random(f"gppo_jax.data.readers/{seed}/{epoch}").shuffle(order)
  return order


class PromptIterator:
  """Endless batches of examples over shuffled epochs; `state()`/`restore()` resume exactly.

  The position is (epoch, index): index counts examples already drawn from the epoch's order.
  An epoch's tail shorter than batch_size is skipped (each batch is full and examples are
  never repeated within a batch).
  """

  def __init__(
    self, examples: Sequence[Example], batch_size: int, seed: int = 0, shuffle: bool = True
  ):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(examples) < batch_size:
      raise ValueError(f"batch_size {batch_size} exceeds the {len(examples)} examples")
    self.examples = list(examples)
    self.batch_size = batch_size
    self.seed = seed
    self.shuffle = shuffle
    self.epoch = 0
    self.index = 0
    self._order = epoch_order(len(self.examples), seed, 0, shuffle)

  def __iter__(self) -> PromptIterator:
    return self

  def __next__(self) -> list[Example]:
    if self.index + self.batch_size > len(self._order):
      self.epoch += 1
      self.index = 0
      self._order = epoch_order(len(self.examples), self.seed, self.epoch, self.shuffle)
    batch = [self.examples[i] for i in self._order[self.index : self.index + self.batch_size]]
    self.index += self.batch_size
    return batch

  def state(self) -> dict[str, int]:
    """Position to save with a checkpoint (plain ints; the seed guards against mix-ups)."""
    return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
            "num_examples": len(self.examples)}  # fmt: skip

  def restore(self, state: dict[str, int]) -> None:
    """Continue from a saved position; the dataset and seed must be the ones it was saved with."""
    if state.get("seed", self.seed) != self.seed:
      raise ValueError(f"iterator state has seed {state['seed']}, this iterator {self.seed}")
    n = state.get("num_examples", len(self.examples))
    if n != len(self.examples):
      raise ValueError(f"iterator state is for {n} examples, this dataset has {len(self.examples)}")
    if not 0 <= state["index"] <= len(self.examples) or state["epoch"] < 0:
      raise ValueError(f"invalid iterator state {state}")
    self.epoch = int(state["epoch"])
    self.index = int(state["index"])
    self._order = epoch_order(len(self.examples), self.seed, self.epoch, self.shuffle)
