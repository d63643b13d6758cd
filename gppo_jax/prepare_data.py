"""Convert the field's public datasets to this project's JSONL layout (docs/guide.md "Data files").

  python -m gppo_jax.prepare_data NAME --out data/eval/aime24.jsonl [--limit N]
  python -m gppo_jax.prepare_data --list
  python -m gppo_jax.prepare_data livecodebench --source ~/lcb/ --out data/eval/lcb.jsonl \
      [--release release_v5 --start_date 2024-08-01 --end_date 2025-01-31]

Without `--source` the release is read from the Hugging Face hub (the `datasets` package, or
`huggingface_hub` for LiveCodeBench's JSONL files); `--source` points at a local copy instead: a
.jsonl / .json / .parquet file, a folder of them (read in name order), or a downloaded release
folder (`huggingface-cli download --repo-type dataset ID`), of which only the registered
configuration's and split's files are read (for LiveCodeBench the release's `test*.jsonl` files).

Each output row is {id, benchmark, prompt, answer | tests, metadata}. `prompt` is the problem
statement only (the math instruction comes from the config); code prompts say where the program
reads its input or which function to write, and ask for one ```python block (what
`gppo_jax.rewards.code_reward` extracts). Math gold answers are plain strings without `$...$` or
`\\boxed{}` (integers without leading zeros), and by default every gold is checked with the same
math-verify parse the trainer applies at load (`MathVerifier.check_golds`), so the file loads.

Rows that cannot be used (no answer, tests that do not decode or do not fit the project's three
test forms) are skipped and counted per reason; rows outside the benchmark (another year, outside
the release window, repeated problems) are counted as not selected. A summary line ends the run.

Field names and encodings follow each release: each converter's docstring lists the fields it
reads, and says where a name could not be confirmed (Minerva Math's).
"""

from __future__ import annotations

import ast
import base64
import collections
import dataclasses
import datetime
import glob
import io
import json
import logging
import math
import os
import pickle
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from gppo_jax import cli, errors, files
from gppo_jax.data import readers

logger = logging.getLogger(__name__)

KINDS = ("math", "code")
# LiveCodeBench code_generation_lite: one JSONL file per release increment; release_vN is the
# first N files, "vN" the N-th alone.
LCB_FILES = (
  "test.jsonl",
  "test2.jsonl",
  "test3.jsonl",
  "test4.jsonl",
  "test5.jsonl",
  "test6.jsonl",
)
MAX_DECOMPRESSED_BYTES = 1 << 30  # one problem's private tests, decompressed


class SkipRow(Exception):
  """A row that cannot be used; the message is the reason (counted per reason)."""


class NotSelected(Exception):
  """A row that is not part of the benchmark (other year, outside the window, a repeat)."""


@dataclasses.dataclass(frozen=True)
class Options:
  """Per-run choices that some converters read (LiveCodeBench's release window)."""

  release: str | None = None
  start_date: datetime.date | None = None
  end_date: datetime.date | None = None


@dataclasses.dataclass
class Context:
  """What a converter sees besides the row: the options and the state of this run."""

  options: Options
  seen: set = dataclasses.field(default_factory=set)  # problem keys, for de-duplication


@dataclasses.dataclass(frozen=True)
class Spec:
  """One dataset: where it lives, how a row converts, what it is for."""

  name: str
  kind: str  # "math" | "code"
  role: str  # "train" | "eval"
  hub_id: str
  config: str | None
  split: str
  convert: Callable[[dict, int, Context], dict]
  description: str
  # Read these files of the hub repo (format, glob) instead of the dataset's builder: TACO's repo
  # also holds a loading script, which recent `datasets` versions refuse.
  hub_data_files: tuple[str, str] | None = None
  defaults: Options = Options()


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def _text(row: dict, *names: str) -> str:
  """The first of `names` present as a non-empty string in the row."""
  for name in names:
    value = row.get(name)
    if isinstance(value, str) and value.strip():
      return value.strip()
  raise SkipRow(f"no {' or '.join(repr(n) for n in names)} text")


def _strip_math_delimiters(s: str) -> str:
  s = s.strip()
  while len(s) > 1 and s.startswith("$") and s.endswith("$") and "$" not in s.strip("$"):
    s = s.strip("$").strip()
  for start, end in (("\\(", "\\)"), ("\\[", "\\]")):
    if s.startswith(start) and s.endswith(end):
      s = s[len(start) : -len(end)].strip()
  m = re.fullmatch(r"\\boxed\s*\{(.*)\}", s, re.S)
  if m:
    s = m.group(1).strip()
  return s


def gold_answer(value: Any) -> str:
  """A gold answer as the math reward expects it: a string without `$...$` or `\\boxed{}`,
  integers without leading zeros or a trailing `.0`."""
  if value is None or isinstance(value, bool):
    raise SkipRow("missing answer")
  if isinstance(value, int):
    return str(value)
  if isinstance(value, float):
    if not math.isfinite(value):
      raise SkipRow(f"answer is {value}")
    return str(int(value)) if value.is_integer() else repr(value)
  if not isinstance(value, str):
    raise SkipRow(f"answer is a {type(value).__name__}, not a string or number")
  s = _strip_math_delimiters(value)
  if re.fullmatch(r"[+-]?\d+", s):
    s = str(int(s))
  if not s:
    raise SkipRow("missing answer")
  return s


def _last_boxed(text: str) -> str | None:
  from gppo_jax.rewards import math_reward

  return math_reward.last_boxed(text)


def _first_new(ctx: Context, key: object) -> None:
  if key in ctx.seen:
    raise NotSelected("repeated problem")
  ctx.seen.add(key)


def _loads_json(value: Any, what: str) -> Any:
  if not isinstance(value, str):
    return value
  try:
    return json.loads(value)
  except (json.JSONDecodeError, RecursionError) as e:
    raise SkipRow(f"{what} is not JSON ({type(e).__name__})") from None


# ---------------------------------------------------------------------------------------------
# Math converters
# ---------------------------------------------------------------------------------------------

# DAPO-Math-17k wraps every problem in its own instruction (answer on an `Answer:` line). The
# wrapper is removed so that the config's instruction applies; rows without it are kept as-is.
_DAPO_PREFIX = (
  "Solve the following math problem step by step. The last line of your response should be of "
  "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def convert_dapo(row: dict, index: int, ctx: Context) -> dict:
  """BytedTsinghua-SIA/DAPO-Math-17k: {data_source, prompt: [{role, content}], ability,
  reward_model: {ground_truth, style}, extra_info: {index}}. The release repeats each problem
  many times (1.79M rows for ~17k problems): repeats of a problem text are not selected."""
  messages = row.get("prompt")
  if not (isinstance(messages, list) and messages):
    raise SkipRow("'prompt' is not a list of messages")
  user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
  if not user or not isinstance(user[-1].get("content"), str):
    raise SkipRow("'prompt' has no user message")
  problem = user[-1]["content"].strip()
  if problem.startswith(_DAPO_PREFIX):
    problem = problem[len(_DAPO_PREFIX) :].strip()
  if problem.endswith(_DAPO_SUFFIX):
    problem = problem[: -len(_DAPO_SUFFIX)].strip()
  if not problem:
    raise SkipRow("empty problem")
  reward = row.get("reward_model")
  answer = gold_answer(reward.get("ground_truth") if isinstance(reward, dict) else None)
  _first_new(ctx, problem)
  extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
  row_id = extra.get("index")
  return {
    "id": str(row_id) if row_id not in (None, "") else f"dapo-{index}",
    "prompt": problem,
    "answer": answer,
    "metadata": {"data_source": row.get("data_source")},
  }


def convert_math500(row: dict, index: int, ctx: Context) -> dict:
  """HuggingFaceH4/MATH-500: {problem, solution, answer, subject, level, unique_id}."""
  return {
    "id": str(row.get("unique_id") or f"math500-{index}"),
    "prompt": _text(row, "problem"),
    "answer": gold_answer(row.get("answer")),
    "metadata": {"subject": row.get("subject"), "level": row.get("level")},
  }


_AIME_URL_RE = re.compile(r"(\d{4})_AIME_(I{1,2})_Problems/Problem_(\d+)")


def convert_aime24(row: dict, index: int, ctx: Context) -> dict:
  """HuggingFaceH4/aime_2024: {id, problem, solution, answer, url, year}; the id becomes
  "2024-I-1" when the AoPS url says which paper and problem."""
  m = _AIME_URL_RE.search(str(row.get("url") or ""))
  row_id = f"{m.group(1)}-{m.group(2)}-{m.group(3)}" if m else str(row.get("id", index))
  return {
    "id": row_id,
    "prompt": _text(row, "problem"),
    "answer": gold_answer(row.get("answer")),
    "metadata": {"url": row.get("url")},
  }


def convert_aime25(row: dict, index: int, ctx: Context) -> dict:
  """MathArena/aime_2025: {problem_idx, problem, answer, problem_type}."""
  idx = row.get("problem_idx")
  return {
    "id": f"2025-{idx}" if idx is not None else f"aime25-{index}",
    "prompt": _text(row, "problem"),
    "answer": gold_answer(row.get("answer")),
    "metadata": {"problem_type": row.get("problem_type")},
  }


def convert_amc23(row: dict, index: int, ctx: Context) -> dict:
  """AI-MO/aimo-validation-amc: {id, problem, answer (float), url}, AMC 12 2022 and 2023; the
  2023 problems (the url names the year) are the usual 40-problem "AMC 2023" set."""
  url = str(row.get("url") or "")
  if "2023" not in url:
    raise NotSelected("not from 2023")
  return {
    "id": str(row.get("id", index)),
    "prompt": _text(row, "problem"),
    "answer": gold_answer(row.get("answer")),
    "metadata": {"url": url},
  }


def convert_minerva(row: dict, index: int, ctx: Context) -> dict:
  """math-ai/minervamath: {question, answer} as most users read it. Unconfirmed: one script
  reads {problem, solution} instead, so those names are accepted too (answer = the solution's
  last \\boxed{})."""
  answer = row.get("answer")
  if answer in (None, "") and isinstance(row.get("solution"), str):
    answer = _last_boxed(row["solution"])
  return {
    "id": str(row.get("id", f"minerva-{index}")),
    "prompt": _text(row, "question", "problem"),
    "answer": gold_answer(answer),
    "metadata": {},
  }


def convert_olympiadbench(row: dict, index: int, ctx: Context) -> dict:
  """Hothan/OlympiadBench, config OE_TO_maths_en_COMP: {id, question, solution, final_answer:
  [str], context, is_multiple_answer, unit, answer_type, subfield, ...}. Several final answers
  are joined with ", "; the unit (rare in this subset) goes to metadata."""
  finals = row.get("final_answer")
  if isinstance(finals, str):
    finals = [finals]
  if not (isinstance(finals, list) and finals and all(isinstance(a, str) for a in finals)):
    raise SkipRow("'final_answer' is not a list of strings")
  answer = ", ".join(gold_answer(a) for a in finals)
  question = _text(row, "question")
  context = row.get("context")
  if isinstance(context, str) and context.strip():
    question = f"{context.strip()}\n\n{question}"
  return {
    "id": str(row.get("id", f"olympiadbench-{index}")),
    "prompt": question,
    "answer": answer,
    "metadata": {
      "subfield": row.get("subfield"),
      "answer_type": row.get("answer_type"),
      "unit": row.get("unit") or None,
    },
  }


# ---------------------------------------------------------------------------------------------
# Code: prompts, tests
# ---------------------------------------------------------------------------------------------

_STDIO_INSTRUCTION = (
  "Write a Python 3 program that reads the input from standard input and prints the answer to "
  "standard output. Give the complete program in a single ```python code block."
)
_METHOD_RE = re.compile(
  r"def[ \t]+(\w+)[ \t]*\(\s*self\s*,?\s*(.*?)\)\s*(->\s*[^:\n]+?)?\s*:", re.S
)


def top_level_starter(starter: str, fn_name: str) -> str:
  """LeetCode-style starter code (`class Solution: def f(self, ...)`) as a top-level function:
  the sandbox calls `fn_name` at module level. Other starter code is returned unchanged."""
  if "class Solution" not in starter:
    return starter
  for m in _METHOD_RE.finditer(starter):
    if m.group(1) == fn_name:
      args = " ".join(m.group(2).split())
      ret = f" {' '.join(m.group(3).split())}" if m.group(3) else ""
      typing = "from typing import *\n\n" if ":" in args or ret else ""
      return f"{typing}def {fn_name}({args}){ret}:\n    "
  return starter


def code_prompt(statement: str, fn_name: str | None, starter: str = "") -> str:
  """The statement and how to answer: a stdin/stdout program, or the function `fn_name`."""
  statement = statement.strip()
  if not fn_name:
    return f"{statement}\n\n{_STDIO_INSTRUCTION}"
  starter = top_level_starter(starter or "", fn_name).rstrip()
  text = (
    f"{statement}\n\nWrite the function `{fn_name}` as a top-level Python function (not a method "
    "of a class) and give the complete code, with the imports it needs, in a single ```python "
    "code block."
  )
  return f"{text}\n\n```python\n{starter}\n```" if starter.strip() else text


def _stdio_text(x: Any, what: str) -> str:
  if isinstance(x, str):
    return x
  if isinstance(x, list) and all(isinstance(e, str) for e in x):
    return "\n".join(x) + "\n"
  raise SkipRow(f"stdin/stdout {what} is not text")


def io_tests(inputs: Any, outputs: Any, fn_name: Any) -> dict:
  """{inputs, outputs[, fn_name]} checked against what `gppo_jax.rewards.code_reward` runs."""
  if not (isinstance(inputs, list) and isinstance(outputs, list)):
    raise SkipRow("tests have no 'inputs' and 'outputs' lists")
  if not inputs or len(inputs) != len(outputs):
    raise SkipRow(f"tests have {len(inputs)} inputs and {len(outputs)} outputs")
  if fn_name in (None, ""):
    return {
      "inputs": [_stdio_text(i, "input") for i in inputs],
      "outputs": [_stdio_text(o, "output") for o in outputs],
    }
  if not (isinstance(fn_name, str) and fn_name.isidentifier()):
    raise SkipRow(f"function name {fn_name!r} is not an identifier")
  if not all(isinstance(a, list) for a in inputs):
    raise SkipRow("function-call inputs are not argument lists")
  return {"fn_name": fn_name, "inputs": inputs, "outputs": outputs}


# ---------------------------------------------------------------------------------------------
# LiveCodeBench
# ---------------------------------------------------------------------------------------------


class _NoGlobalsUnpickler(pickle.Unpickler):
  """Unpickles plain data only: no class, function or module can be named, so nothing runs.
  LiveCodeBench's private tests are a pickled `str` (a JSON document), which needs nothing more."""

  def find_class(self, module: str, name: str):  # noqa: ARG002
    raise pickle.UnpicklingError(f"refusing to load {module}.{name}: plain data only")


def decode_lcb_private(value: Any) -> list:
  """LiveCodeBench's `private_test_cases`: a JSON list, or (newer releases) base64 of zlib of a
  pickled JSON string. Decoded with a no-globals unpickler and a size cap."""
  if isinstance(value, list):
    return value
  if not isinstance(value, str):
    raise SkipRow("private tests are neither a string nor a list")
  try:
    return _as_case_list(json.loads(value))
  except (json.JSONDecodeError, RecursionError):
    pass  # the compressed form
  try:
    packed = base64.b64decode(value.encode("ascii"), validate=True)
    inflater = zlib.decompressobj()
    raw = inflater.decompress(packed, MAX_DECOMPRESSED_BYTES)
    too_big = bool(inflater.unconsumed_tail)
    text = None if too_big else _NoGlobalsUnpickler(io.BytesIO(raw)).load()
  except Exception as e:  # noqa: BLE001 - any failure means the row cannot be used
    raise SkipRow(f"private tests do not decode ({type(e).__name__})") from None
  if too_big:
    raise SkipRow(f"private tests decompress to more than {MAX_DECOMPRESSED_BYTES} bytes")
  if isinstance(text, bytes):
    text = text.decode("utf-8", "replace")
  if not isinstance(text, str):
    raise SkipRow(f"private tests unpickle to a {type(text).__name__}, not a JSON string")
  return _as_case_list(_loads_json(text, "decoded private tests"))


def _as_case_list(decoded: Any) -> list:
  if not isinstance(decoded, list):
    raise SkipRow("private tests are not a list")
  return decoded


def _lcb_call_args(text: str) -> list:
  """A functional case's input: one JSON value per line, the call's arguments in order."""
  try:
    return [json.loads(line) for line in text.split("\n")]
  except (json.JSONDecodeError, RecursionError):
    raise SkipRow("functional test input is not one JSON value per line") from None


def convert_livecodebench(row: dict, index: int, ctx: Context) -> dict:
  """livecodebench/code_generation_lite: {question_title, question_content, platform,
  question_id, contest_id, contest_date, starter_code, difficulty, public_test_cases (JSON),
  private_test_cases (JSON, or base64/zlib/pickle of JSON), metadata (JSON: func_name)}; each case
  is {input, output, testtype: "stdin" | "functional"}. Public and private cases are merged."""
  opts = ctx.options
  try:
    date = datetime.datetime.fromisoformat(str(row.get("contest_date"))).date()
  except ValueError:
    raise SkipRow(f"contest_date {row.get('contest_date')!r} is not a date") from None
  if (opts.start_date and date < opts.start_date) or (opts.end_date and date > opts.end_date):
    raise NotSelected("outside the release window")
  public = _loads_json(row.get("public_test_cases") or "[]", "public tests")
  if not isinstance(public, list):
    raise SkipRow("public tests are not a list")
  cases = public + decode_lcb_private(row.get("private_test_cases") or "[]")
  meta = _loads_json(row.get("metadata") or "{}", "metadata")
  if not isinstance(meta, dict):
    raise SkipRow("metadata is not an object")
  if not cases or not all(isinstance(c, dict) for c in cases):
    raise SkipRow("no test cases")
  kinds = {c.get("testtype") for c in cases}
  if len(kinds) != 1 or not kinds <= {"stdin", "functional"}:
    raise SkipRow(f"test types {sorted(map(str, kinds))}, expected all stdin or all functional")
  if not all(isinstance(c.get("input"), str) and isinstance(c.get("output"), str) for c in cases):
    raise SkipRow("a test case has no input or output text")
  fn_name = None
  if kinds == {"functional"}:
    fn_name = meta.get("func_name")
    inputs = [_lcb_call_args(c["input"]) for c in cases]
    outputs = [_loads_json(c["output"], "functional test output") for c in cases]
  else:
    inputs = [c["input"] for c in cases]
    outputs = [c["output"] for c in cases]
  tests = io_tests(inputs, outputs, fn_name)
  starter = row.get("starter_code") or ""
  return {
    "id": _text(row, "question_id"),
    "prompt": code_prompt(_text(row, "question_content"), fn_name, starter),
    "tests": tests,
    "metadata": {
      "title": row.get("question_title"),
      "platform": row.get("platform"),
      "contest_id": row.get("contest_id"),
      "contest_date": date.isoformat(),
      "difficulty": row.get("difficulty"),
      "num_public_tests": len(public),
      "starter_code": starter or None,
    },
  }


def lcb_release_files(release: str) -> list[str]:
  """The code_generation_lite files of a version tag: release_vN (cumulative), release_latest,
  vN (the N-th increment alone) or vN_vM (increments N to M)."""
  n = len(LCB_FILES)
  if release == "release_latest":
    return list(LCB_FILES)
  m = re.fullmatch(r"release_v(\d+)", release)
  if m and 1 <= int(m.group(1)) <= n:
    return list(LCB_FILES[: int(m.group(1))])
  m = re.fullmatch(r"v(\d+)(?:_v(\d+))?", release)
  if m:
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if 1 <= lo <= hi <= n:
      return list(LCB_FILES[lo - 1 : hi])
  raise errors.ConfigError(
    f"--release={release!r}; valid: release_v1 .. release_v{n}, release_latest, v1 .. v{n}, vN_vM"
  )


# ---------------------------------------------------------------------------------------------
# TACO
# ---------------------------------------------------------------------------------------------


def convert_taco(row: dict, index: int, ctx: Context) -> dict:
  """BAAI/TACO (config ALL): {question, solutions, starter_code, input_output (JSON: {inputs,
  outputs[, fn_name]}), difficulty, source, name, url, tags, skill_types, picture_num, ...}, the
  APPS format: stdin/stdout cases, or function calls whose expected values are wrapped in a list
  (the call judge accepts either)."""
  io_spec = _loads_json(row.get("input_output"), "input_output")
  if not isinstance(io_spec, dict):
    raise SkipRow("input_output is not an object")
  fn_name = io_spec.get("fn_name")
  tests = io_tests(io_spec.get("inputs"), io_spec.get("outputs"), fn_name)
  return {
    "id": f"taco-{index}",
    "prompt": code_prompt(_text(row, "question"), fn_name, row.get("starter_code") or ""),
    "tests": tests,
    "metadata": {key: row.get(key) for key in ("name", "source", "difficulty", "url")},
  }


# ---------------------------------------------------------------------------------------------
# EvalPlus: HumanEval+ and MBPP+
# ---------------------------------------------------------------------------------------------

# EvalPlus's test helpers import numpy for `np.allclose` (float answers; files written by older
# EvalPlus versions call `np.testing.assert_allclose` instead) and dtype checks; the sandbox's
# interpreter need not have numpy, so the tests get this standard-library stand-in.
NUMPY_STAND_IN = '''\
class _NumpyStandIn:
    """The numpy that EvalPlus's assertion helpers use: allclose, testing.assert_allclose and
    dtype names."""

    class ndarray:
        pass

    float32 = float64 = float

    @classmethod
    def _pairs(cls, a, b):
        seq = (list, tuple)
        if isinstance(a, seq) and isinstance(b, seq):
            if len(a) != len(b):
                raise ValueError("operands could not be broadcast together")
            for x, y in zip(a, b):
                yield from cls._pairs(x, y)
        elif isinstance(a, seq):
            for x in a:
                yield from cls._pairs(x, b)
        elif isinstance(b, seq):
            for y in b:
                yield from cls._pairs(a, y)
        else:
            yield a, b

    @staticmethod
    def _close(x, y, rtol, atol):
        """numpy's |x - y| <= atol + rtol * |y|; equal values (infinities too) are close, NaN and
        an unequal infinity are not."""
        if x == y:
            return True
        if x != x or y != y or abs(x) == float("inf") or abs(y) == float("inf"):
            return False
        return abs(x - y) <= atol + rtol * abs(y)

    @classmethod
    def allclose(cls, a, b, rtol=1e-05, atol=1e-08):
        return all(cls._close(x, y, rtol, atol) for x, y in cls._pairs(a, b))

    class testing:
        @staticmethod
        def assert_allclose(
            actual, desired, rtol=1e-07, atol=0, equal_nan=True, err_msg="", verbose=True
        ):
            """numpy's defaults: a relative tolerance of 1e-7 and NaN equal to NaN."""
            try:
                pairs = list(_NumpyStandIn._pairs(actual, desired))
            except ValueError:
                raise AssertionError(f"shapes differ: {actual!r} vs {desired!r} {err_msg}")
            for x, y in pairs:
                if equal_nan and x != x and y != y:
                    continue
                if not _NumpyStandIn._close(x, y, rtol, atol):
                    raise AssertionError(f"not close: {x!r} vs {y!r} {err_msg}")


np = _NumpyStandIn
'''
_NUMPY_IMPORT_RE = re.compile(r"^[ \t]*import numpy as np[ \t]*$", re.M)
_NUMPY_NAMES = {"allclose", "testing.assert_allclose", "ndarray", "float32", "float64"}


def without_numpy(test: str) -> str:
  """EvalPlus test code with `import numpy as np` replaced by the stand-in (SkipRow if the code
  uses numpy for more than the stand-in offers)."""
  code = _NUMPY_IMPORT_RE.sub("", test)
  if re.search(r"^\s*(import|from)\s+numpy\b", code, re.M):
    raise SkipRow("test code imports numpy in another way")
  used = set(re.findall(r"\bnp\.(testing\.\w+|\w+)", code))
  if used - _NUMPY_NAMES:
    raise SkipRow(f"test code uses numpy's {sorted(used - _NUMPY_NAMES)}")
  return NUMPY_STAND_IN + "\n" + code if used else code


def convert_humaneval_plus(row: dict, index: int, ctx: Context) -> dict:
  """evalplus/humanevalplus: {task_id, prompt, canonical_solution, entry_point, test}; `test`
  defines `check(candidate)` (HumanEval style). The prompt (signature and docstring, sometimes
  helpers the tests call) is the setup code."""
  entry = _text(row, "entry_point")
  if not entry.isidentifier():
    raise SkipRow(f"entry_point {entry!r} is not an identifier")
  test = _text(row, "test")
  if "def check(" not in test:
    raise SkipRow("test code defines no check(candidate)")
  stub = _text(row, "prompt")
  prompt = (
    f"Complete the Python function `{entry}` below. Give the complete function, with the imports "
    f"and helpers it needs, in a single ```python code block.\n\n```python\n{stub.rstrip()}\n```"
  )
  return {
    "id": _text(row, "task_id"),
    "prompt": prompt,
    "tests": {"test_code": without_numpy(test), "entry_point": entry, "setup_code": stub + "\n"},
    "metadata": {},
  }


def _mbpp_entry_point(code: str, first_test: str) -> str:
  """The function under test: the first function the first assert calls that the reference
  solution defines (or the solution's only function)."""
  try:
    defined = [n.name for n in ast.parse(code).body if isinstance(n, ast.FunctionDef)]
  except SyntaxError:
    raise SkipRow("reference code does not parse") from None
  try:
    calls = [
      n.func.id
      for n in ast.walk(ast.parse(first_test))
      if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    ]
  except SyntaxError:
    calls = []
  for name in calls:
    if name in defined:
      return name
  if len(defined) == 1:
    return defined[0]
  raise SkipRow("cannot tell which function is under test")


def convert_mbpp_plus(row: dict, index: int, ctx: Context) -> dict:
  """evalplus/mbppplus: {task_id, code, prompt, source_file, test_imports: [str], test_list:
  [str], test}; `test` is module-level code calling the function by name, so it runs inside
  `check(candidate)` with that name bound to the candidate."""
  tests_shown = row.get("test_list") or []
  if not (isinstance(tests_shown, list) and tests_shown and isinstance(tests_shown[0], str)):
    raise SkipRow("no 'test_list'")
  entry = _mbpp_entry_point(_text(row, "code"), tests_shown[0])
  imports = [s for s in row.get("test_imports") or [] if isinstance(s, str)]
  inner = "\n".join(imports + [without_numpy(_text(row, "test"))])
  test_code = (
    f"_MBPP_PLUS_TEST = {inner!r}\n\n\n"
    "def check(candidate):\n"
    "    namespace = {'__name__': '__mbpp_plus_test__', " + repr(entry) + ": candidate}\n"
    "    exec(compile(_MBPP_PLUS_TEST, '<mbpp+ test>', 'exec'), namespace)\n"
  )
  prompt = (
    f"{_text(row, 'prompt')}\n\nYour code should pass this test:\n\n{tests_shown[0].strip()}\n\n"
    "Give the complete Python code, with its imports, in a single ```python code block."
  )
  return {
    "id": f"Mbpp/{row.get('task_id', index)}",
    "prompt": prompt,
    "tests": {"test_code": test_code, "entry_point": entry, "setup_code": ""},
    "metadata": {"source_file": row.get("source_file")},
  }


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

_SPECS = [
  Spec("dapo_math_17k", "math", "train", "BytedTsinghua-SIA/DAPO-Math-17k", None, "train",
       convert_dapo, "DAPO-Math-17k, ~17k integer-answer problems (repeats removed)"),
  Spec("math500", "math", "eval", "HuggingFaceH4/MATH-500", None, "test", convert_math500,
       "MATH-500, 500 problems of the MATH test set"),
  Spec("aime24", "math", "eval", "HuggingFaceH4/aime_2024", None, "train", convert_aime24,
       "AIME 2024 I and II, 30 problems"),
  Spec("aime25", "math", "eval", "MathArena/aime_2025", None, "train", convert_aime25,
       "AIME 2025 I and II, 30 problems"),
  Spec("amc23", "math", "eval", "AI-MO/aimo-validation-amc", None, "train", convert_amc23,
       "AMC 12 2023, 40 problems (the 2023 rows of the AIMO validation set)"),
  Spec("minerva_math", "math", "eval", "math-ai/minervamath", None, "test", convert_minerva,
       "Minerva Math (OCWCourses), 272 problems"),
  Spec("olympiadbench", "math", "eval", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train",
       convert_olympiadbench, "OlympiadBench, English text-only open-ended math, 675 problems"),
  Spec("taco", "code", "train", "BAAI/TACO", None, "train", convert_taco,
       "TACO train split, ~25k APPS-style problems with stdin/stdout or call tests",
       hub_data_files=("parquet", "ALL/train-*.parquet")),
  Spec("livecodebench", "code", "eval", "livecodebench/code_generation_lite", None, "test",
       convert_livecodebench,
       "LiveCodeBench code generation, public + private tests; --release and "
       "--start_date/--end_date pick the window",
       defaults=Options("release_v5", datetime.date(2024, 8, 1), datetime.date(2025, 1, 31))),
  Spec("humaneval_plus", "code", "eval", "evalplus/humanevalplus", None, "test",
       convert_humaneval_plus, "HumanEval+, 164 problems with EvalPlus's extended tests"),
  Spec("mbpp_plus", "code", "eval", "evalplus/mbppplus", None, "test", convert_mbpp_plus,
       "MBPP+, 378 problems with EvalPlus's extended tests"),
]  # fmt: skip
REGISTRY: dict[str, Spec] = {s.name: s for s in _SPECS}


def get_spec(name: str) -> Spec:
  if name not in REGISTRY:
    raise errors.unknown_name("dataset", name, REGISTRY, "; --list describes them")
  return REGISTRY[name]


def format_registry() -> str:
  rows = [("NAME", "KIND", "ROLE", "HUB ID (CONFIG) SPLIT", "DESCRIPTION")]
  for s in REGISTRY.values():
    hub = f"{s.hub_id}{f' ({s.config})' if s.config else ''} {s.split}"
    rows.append((s.name, s.kind, s.role, hub, s.description))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  return "\n".join(
    "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows
  )


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

SOURCE_SUFFIXES = readers.SUFFIXES


def read_file(path: str) -> Iterator[tuple[str, Any]]:
  """(location, record) of a .jsonl, .json (an array, or JSON lines) or .parquet file; a line
  that is not JSON comes as a `readers.Unreadable`, skipped and counted like any bad row."""
  return readers.read_records(path, bad_lines="yield")


# A downloaded Hugging Face dataset repo (`huggingface-cli download --repo-type dataset ID`) holds
# every configuration and split of the release; only the Spec's own are read from it. Which files
# those are follows the hub's conventions: the dataset card's `configs:` list (README.md's YAML
# header) if it names the configuration, else file and folder names (`<config>/<split>-*`,
# `data/<split>-*`, `<split>.jsonl`, a split name between delimiters anywhere in the path).
SPLIT_WORDS = {  # the names the hub reads as each split, as words of a path
  "train": ("train", "training"),
  "validation": ("validation", "valid", "dev", "val"),
  "test": ("test", "testing", "eval", "evaluation"),
}
_SHARD_RE = re.compile(r"-\d{5}-of-\d{5}")  # the hub's shard names: train-00000-of-00003.parquet


def _dataset_card_header(folder: str) -> str | None:
  """The YAML header of the folder's dataset card (README.md between `---` lines), if any."""
  try:
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError):
    return None
  m = re.match(r"---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.S)
  return m.group(1) if m else None


def _dataset_card_configs(folder: str) -> list | None:
  """The `configs:` list of the folder's dataset card, if any."""
  text = _dataset_card_header(folder)
  if text is None:
    return None
  try:
    import yaml  # a dependency of `datasets`

    header = yaml.safe_load(text)
  except Exception:  # noqa: BLE001 - no yaml, or a header that does not parse: use the names
    return None
  configs = header.get("configs") if isinstance(header, dict) else None
  return configs if isinstance(configs, list) else None


def _card_patterns(spec: Spec, configs: list) -> list[str] | None:
  """The data_files globs the card gives the Spec's configuration and split (None if it does not
  name the configuration; [] if it names it without that split)."""
  entries = [c for c in configs if isinstance(c, dict)]
  if spec.config is not None:
    chosen = [c for c in entries if c.get("config_name") == spec.config]
  else:
    chosen = [c for c in entries if c.get("default") is True] or [
      c for c in entries if c.get("config_name") == "default"
    ]
    if not chosen and len(entries) == 1:
      chosen = entries
  if not chosen:
    return None
  data_files = chosen[0].get("data_files")
  if isinstance(data_files, dict):  # {split: path or paths}
    data_files = [{"split": k, "path": v} for k, v in data_files.items()]
  elif isinstance(data_files, str):
    data_files = [data_files]
  out: list[str] = []
  for d in data_files if isinstance(data_files, list) else []:
    if isinstance(d, str):  # a path without a split: the train split
      split, paths = "train", d
    elif isinstance(d, dict):
      split, paths = d.get("split", "train"), d.get("path")
    else:
      continue
    if split == spec.split:
      out += [paths] if isinstance(paths, str) else [p for p in paths or [] if isinstance(p, str)]
  return out


def _glob_data_files(folder: str, patterns: Iterable[str]) -> list[str]:
  found = {
    p
    for pattern in patterns
    for p in glob.glob(os.path.join(glob.escape(folder), pattern), recursive=True)
    if os.path.isfile(p) and p.endswith(SOURCE_SUFFIXES)
  }
  return sorted(found)


def _data_files_under(folder: str) -> list[str]:
  """The data files under `folder` in name order, hidden folders (`.cache`, `.git`) left out."""
  out = []
  for root, dirs, names in os.walk(folder):
    dirs[:] = [d for d in dirs if not d.startswith(".")]
    out += [os.path.join(root, n) for n in names if n.endswith(SOURCE_SUFFIXES)]
  return sorted(out)


def _in_split(relpath: str, split: str) -> bool | None:
  """Whether a path's name puts a file in `split` (the hub's rule: a split's name between
  delimiters); None if it names no split at all."""
  words = {**SPLIT_WORDS, split: SPLIT_WORDS.get(split, (split,))}
  named = [
    s
    for s, ws in words.items()
    if re.search(rf"(^|[-._ 0-9/])({'|'.join(ws)})([-._ 0-9/]|$)", relpath.lower())
  ]
  return (named[0] == split) if named else None


def is_release_folder(spec: Spec, folder: str) -> bool:
  """Whether `folder` is a copy of a hub dataset repo (its .gitattributes, the download's
  .cache/huggingface, a dataset card with a YAML header, a folder named after the Spec's
  configuration, or shard-named files) rather than a folder of plain files."""
  if os.path.isfile(os.path.join(folder, ".gitattributes")):
    return True
  if os.path.isdir(os.path.join(folder, ".cache", "huggingface")):
    return True
  if spec.config and os.path.isdir(os.path.join(folder, spec.config)):
    return True
  if _dataset_card_header(folder) is not None:
    return True
  return any(_SHARD_RE.search(os.path.basename(p)) for p in _data_files_under(folder))


def release_files(spec: Spec, folder: str) -> list[str]:
  """The files of the Spec's configuration and split in a downloaded release folder (DataError,
  naming what was looked for, if there are none)."""
  looked: list[str] = []
  base = os.path.basename(os.path.normpath(folder))
  if spec.hub_data_files:  # the files the hub is read for, and nothing else (TACO's ALL/train-*)
    pattern = spec.hub_data_files[1]
    head, _, rest = pattern.partition("/")
    looked.append(pattern)
    if files := _glob_data_files(folder, [pattern] + ([rest] if rest and base == head else [])):
      return files
    raise _no_release_files(spec, folder, looked)
  configs = _dataset_card_configs(folder)
  patterns = _card_patterns(spec, configs) if configs is not None else None
  if patterns:
    looked += [f"{p} (README.md configs)" for p in patterns]
    if files := _glob_data_files(folder, patterns):
      return files
  # The file names. A configuration's files are in its folder (or this is that folder).
  if spec.config:
    roots = [os.path.join(folder, spec.config)]
    if base == spec.config:
      roots.append(folder)
  else:
    roots = [folder]
  for root in roots:
    if not os.path.isdir(root):
      continue
    files = _data_files_under(root)
    in_split = {p: _in_split(os.path.relpath(p, root), spec.split) for p in files}
    if all(v is None for v in in_split.values()) and spec.split == "train":
      chosen = files  # no split named anywhere: the hub reads it all as train
    else:
      chosen = [p for p in files if in_split[p]]
    if chosen:
      return chosen
  words = ", ".join(SPLIT_WORDS.get(spec.split, (spec.split,)))
  under = f"{spec.config}/" if spec.config else "the folder"
  looked.append(f"files under {under} whose path names the split ({words})")
  raise _no_release_files(spec, folder, looked)


def _no_release_files(spec: Spec, folder: str, looked: list[str]) -> errors.DataError:
  where = f"{spec.hub_id}{f' config {spec.config}' if spec.config else ''} split {spec.split!r}"
  return errors.DataError(
    f"--source={folder}: a Hugging Face release folder without files of {where}; looked for "
    f"{'; '.join(looked)} ({'/'.join(SOURCE_SUFFIXES)} files)"
  )


def source_files(spec: Spec, source: str, options: Options) -> list[str]:
  """The files of a local `--source`: the file itself; in a downloaded release folder, the files
  of the Spec's configuration and split (for LiveCodeBench, the release's files, which must all
  be there); in any other folder, all its data files in name order."""
  if not os.path.exists(source):
    raise errors.MissingFileError(f"--source={source}: no such file or folder")
  if not os.path.isdir(source):
    return [source]
  if spec.name == "livecodebench" and options.release:
    wanted = lcb_release_files(options.release)
    missing = [f for f in wanted if not os.path.isfile(os.path.join(source, f))]
    if missing:
      raise errors.DataError(
        f"--source={source}: {options.release} needs {', '.join(missing)}, not in the folder"
      )
    return [os.path.join(source, f) for f in wanted]
  if is_release_folder(spec, source):
    return release_files(spec, source)
  files = sorted(
    os.path.join(root, name)
    for root, _, names in os.walk(source)
    for name in names
    if name.endswith(SOURCE_SUFFIXES)
  )
  if not files:
    raise errors.DataError(f"--source={source}: no {'/'.join(SOURCE_SUFFIXES)} files")
  return files


def local_rows(files: Sequence[str]) -> Iterator[tuple[str, Any]]:
  for path in files:
    yield from read_file(path)


def hub_rows(spec: Spec, options: Options) -> Iterator[tuple[str, Any]]:
  """Rows of the release on the Hugging Face hub."""
  where = f"{spec.hub_id}{f' ({spec.config})' if spec.config else ''}"
  hint = "; on a machine without hub access pass --source=<a local copy of the release>"
  if spec.name == "livecodebench":
    try:
      from huggingface_hub import hf_hub_download
    except ImportError:
      raise errors.UserError(
        f"reading {where} needs huggingface_hub (pip install datasets){hint}"
      ) from None
    files = []
    for name in lcb_release_files(options.release or "release_latest"):
      try:
        files.append(hf_hub_download(spec.hub_id, name, repo_type="dataset"))
      except Exception as e:  # noqa: BLE001 - network, auth, missing file
        raise errors.UserError(f"cannot download {name} of {where} ({e}){hint}") from None
    yield from local_rows(files)
    return
  try:
    import datasets
  except ImportError:
    raise errors.UserError(
      f"reading {where} needs the `datasets` package (pip install datasets){hint}"
    ) from None
  try:
    if spec.hub_data_files:
      fmt, pattern = spec.hub_data_files
      files = f"hf://datasets/{spec.hub_id}/{pattern}"
      ds = datasets.load_dataset(fmt, data_files={spec.split: files}, split=spec.split)
    else:
      ds = datasets.load_dataset(spec.hub_id, spec.config, split=spec.split)
  except Exception as e:  # noqa: BLE001 - network, auth, renamed configs
    raise errors.UserError(f"cannot load {where} split {spec.split!r} ({e}){hint}") from None
  for i, row in enumerate(ds, start=1):
    yield f"{where}:{spec.split}:row {i}", row


# ---------------------------------------------------------------------------------------------
# Converting and writing
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Summary:
  """Counts of one conversion: rows read, written, not selected and skipped (per reason)."""

  read: int = 0
  written: int = 0
  not_selected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first_skipped: dict = dataclasses.field(default_factory=dict)  # reason -> location

  def skip(self, reason: str, loc: str) -> None:
    self.skipped[reason] += 1
    self.first_skipped.setdefault(reason, loc)

  def line(self, name: str, out: str) -> str:
    n_sel, n_skip = sum(self.not_selected.values()), sum(self.skipped.values())
    text = f"{name}: wrote {self.written} rows to {out} (read {self.read}, skipped {n_skip}"
    return text + f", not selected {n_sel})" if n_sel else text + ")"


def convert_rows(
  spec: Spec,
  rows: Iterable[tuple[str, Any]],
  options: Options | None = None,
  *,
  limit: int | None = None,
  check_answers: Callable[[Sequence[str]], Sequence[str | None]] | None = None,
) -> tuple[list[dict], Summary]:
  """Convert (location, raw row) pairs; returns the output rows and the counts.

  limit: stop after this many converted rows. check_answers: for math, returns None or a reason
  per gold answer (e.g. `MathVerifier.check_golds`); rows it rejects are skipped.
  """
  ctx = Context(options or spec.defaults)
  summary = Summary()
  out: list[dict] = []
  locs: list[str] = []
  ids: set[str] = set()
  for loc, raw in rows:
    if limit is not None and len(out) >= limit:
      break
    summary.read += 1
    try:
      if isinstance(raw, readers.Unreadable):
        raise SkipRow(raw.reason)
      if not isinstance(raw, dict):
        raise SkipRow(f"row is a {type(raw).__name__}, not an object")
      row = spec.convert(raw, summary.read - 1, ctx)
      if row["id"] in ids:
        raise NotSelected("repeated id")
    except NotSelected as e:
      summary.not_selected[str(e)] += 1
      continue
    except SkipRow as e:
      summary.skip(str(e), loc)
      continue
    ids.add(row["id"])
    gold = {"answer": row["answer"]} if spec.kind == "math" else {"tests": row["tests"]}
    metadata = {k: v for k, v in row["metadata"].items() if v is not None}
    out.append(
      {
        "id": row["id"],
        "benchmark": spec.name,
        "prompt": row["prompt"],
        **gold,
        "metadata": metadata,
      }
    )
    locs.append(loc)
  if check_answers is not None and spec.kind == "math" and out:
    reasons = check_answers([r["answer"] for r in out])
    kept = []
    for r, loc, reason in zip(out, locs, reasons, strict=True):
      if reason is None:
        kept.append(r)
      else:
        summary.skip(f"gold answer rejected by math-verify ({reason.split(':')[0]})", loc)
    out = kept
  summary.written = len(out)
  return out, summary


def write_jsonl(rows: Sequence[dict], path: str) -> None:
  """Writes the rows as JSON lines, atomically (a temporary file renamed into place)."""
  with files.atomic_write(path, encoding="utf-8") as f:
    for row in rows:
      line = json.dumps(row, ensure_ascii=False)
      try:
        line.encode("utf-8")
      except UnicodeEncodeError:  # a lone surrogate in the release's text: escape it
        line = json.dumps(row)
      f.write(line + "\n")


def log_summary(spec: Spec, summary: Summary) -> None:
  for reason, n in summary.skipped.most_common():
    logger.warning(
      "%s: skipped %d rows: %s (first at %s)", spec.name, n, reason, summary.first_skipped[reason]
    )
  for reason, n in summary.not_selected.most_common():
    logger.info("%s: %d rows not selected: %s", spec.name, n, reason)


def _parse_date(flag: str, value: str | None, default: datetime.date | None):
  if value is None:
    return default
  if value == "":
    return None
  try:
    return datetime.date.fromisoformat(value)
  except ValueError:
    raise errors.ConfigError(f"--{flag}={value!r}: expected YYYY-MM-DD (or '' for none)") from None


def options_from_flags(
  spec: Spec, release: str | None, start: str | None, end: str | None
) -> Options:
  d = spec.defaults
  if spec.name != "livecodebench" and (release or start or end):
    raise errors.ConfigError("--release, --start_date and --end_date apply to livecodebench only")
  opts = Options(
    release or d.release,
    _parse_date("start_date", start, d.start_date),
    _parse_date("end_date", end, d.end_date),
  )
  if opts.release:
    lcb_release_files(opts.release)  # validates
  return opts


def main(argv: Sequence[str]) -> None:
  from absl import flags

  f = flags.FLAGS
  if f.list:
    print(format_registry())
    return
  names = list(argv[1:])
  if len(names) != 1:
    raise errors.ConfigError(
      f"expected one dataset NAME, got {len(names)}; valid names: {', '.join(REGISTRY)}"
    )
  spec = get_spec(names[0])
  if not f.out:
    raise errors.ConfigError("--out is required (the .jsonl file to write)")
  if not f.out.endswith(".jsonl"):
    raise errors.ConfigError(f"--out={f.out}: the output is JSON lines; name it *.jsonl")
  if f.limit is not None and f.limit < 1:
    raise errors.ConfigError(f"--limit={f.limit}: must be >= 1")
  options = options_from_flags(spec, f.release, f.start_date, f.end_date)
  if f.source:
    rows = local_rows(source_files(spec, f.source, options))
  else:
    rows = hub_rows(spec, options)
  if spec.kind == "math" and f.check_answers:
    from gppo_jax.rewards import math_reward

    with math_reward.MathVerifier(num_workers=f.verifier_workers) as verifier:
      out, summary = convert_rows(
        spec, rows, options, limit=f.limit, check_answers=verifier.check_golds
      )
  else:
    out, summary = convert_rows(spec, rows, options, limit=f.limit)
  log_summary(spec, summary)
  if not out:
    raise errors.DataError(
      f"{spec.name}: no usable rows ({summary.read} read; skipped {dict(summary.skipped)}, "
      f"not selected {dict(summary.not_selected)})"
    )
  write_jsonl(out, f.out)
  print(summary.line(spec.name, f.out), flush=True)


if __name__ == "__main__":
  from absl import flags

  flags.DEFINE_string("out", None, "Output .jsonl file.")
  flags.DEFINE_string(
    "source",
    None,
    "Local copy of the release instead of the Hugging Face hub: a file, a folder of files, or a "
    "downloaded release folder (its registered configuration and split are read).",
  )
  flags.DEFINE_integer("limit", None, "Write at most this many rows.")
  flags.DEFINE_bool("list", False, "List the datasets and exit.")
  flags.DEFINE_string("release", None, "livecodebench: version tag (default release_v5).")
  flags.DEFINE_string(
    "start_date",
    None,
    "livecodebench: first contest date, YYYY-MM-DD (default 2024-08-01; '' for none).",
  )
  flags.DEFINE_string(
    "end_date",
    None,
    "livecodebench: last contest date, YYYY-MM-DD (default 2025-01-31; '' for none).",
  )
  flags.DEFINE_bool(
    "check_answers",
    True,
    "Math: skip rows whose gold answer math-verify cannot parse (the trainer refuses such files).",
  )
  flags.DEFINE_integer("verifier_workers", 4, "Math-verify worker processes for --check_answers.")
  cli.run(main)
