"""Code reward: extract the program from a model response, run its tests in the sandbox, score.

Extraction is strict: the last ```python (or ```py / ```python3) fenced block, looked for after
the last `</think>` when there is one; an unclosed block (a truncated response) does not count.
Tests come in the three forms `data.readers` reads (stdin/stdout cases, function-call cases with
`fn_name`, HumanEval-style `test_code` + `entry_point`) and run through `rewards.sandbox`.

The reward is the fraction of cases passed or all-or-nothing (`REWARD_MODES`). A run the sandbox
itself failed (status `infra_error`) is neither a pass nor a fail: its score is None and
`rewards_and_mask` masks it out, so a broken machine never teaches the policy anything.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from collections.abc import Callable, Sequence

from gppo_jax.rewards.sandbox import CallCase, Job, Sandbox, SandboxConfig, Status, StdioCase

logger = logging.getLogger(__name__)

NO_CODE = "no_code"  # no closed ```python block in the response
BAD_TESTS = "bad_tests"  # the problem's tests are malformed (a data error, not the policy's fault)
STATUSES = (*(s.value for s in Status), NO_CODE, BAD_TESTS)

REWARD_MODES: dict[str, Callable[[int, int], float]] = {
  "fraction": lambda passed, total: passed / total if total else 0.0,
  "all_or_nothing": lambda passed, total: 1.0 if total and passed == total else 0.0,
}

_FENCE_RE = re.compile(
  r"^[ \t]*```[ \t]*(?:python3?|py)[ \t]*\n(.*?)^[ \t]*```[ \t]*$",
  re.IGNORECASE | re.MULTILINE | re.DOTALL,
)


@dataclasses.dataclass(frozen=True)
class CodeResult:
  """Outcome of one response. `score` is None when the sandbox failed (exclude the sample)."""

  score: float | None
  status: str  # from STATUSES: "ok" when every case passed, else the first failing status
  passed: int
  total: int
  counts: dict[str, int]  # case statuses
  code: str | None
  detail: str = ""

  @property
  def valid(self) -> bool:
    return self.score is not None


def extract_code(response: str) -> str | None:
  """The last closed ```python fenced block (after the last </think> if any), else None."""
  text = response.rsplit("</think>", 1)[-1]
  blocks = _FENCE_RE.findall(text)
  if not blocks or not blocks[-1].strip():
    return None
  return blocks[-1]


def build_job(
  code: str,
  tests: dict,
  *,
  stop_at_first_failure: bool = False,
  max_cases: int | None = None,
  prepend_setup: bool = False,
  timeout_s: float | None = None,
) -> Job:
  """A sandbox job for `code` and a `tests` dict in one of the `gppo_jax.data.readers` forms."""
  if "test_code" in tests:
    setup = str(tests.get("setup_code", ""))
    program = setup + "\n" + code if prepend_setup and setup else code
    return Job.check(program, str(tests["entry_point"]), str(tests["test_code"]), setup,
                     timeout_s=timeout_s)  # fmt: skip
  inputs, outputs = list(tests["inputs"]), list(tests["outputs"])
  if len(inputs) != len(outputs) or not inputs:
    raise ValueError(f"tests need as many outputs as inputs (>= 1): {len(inputs)}/{len(outputs)}")
  pairs = list(zip(inputs, outputs, strict=True))[:max_cases]
  if tests.get("fn_name"):
    cases = [
      CallCase(tuple(a) if isinstance(a, list) else (a,), expected=o, accept_unwrapped=True)
      for a, o in pairs
    ]
    return Job.call(code, str(tests["fn_name"]), cases, stop_at_first_failure, timeout_s)
  cases = [StdioCase(_text(i), _text(o)) for i, o in pairs]
  return Job.stdio(code, cases, stop_at_first_failure, timeout_s)


def _text(x: object) -> str:
  if isinstance(x, str):
    return x
  if isinstance(x, list) and all(isinstance(e, str) for e in x):
    return "\n".join(x) + "\n"
  raise ValueError(f"stdin/stdout test data must be a string or a list of lines, got {x!r:.80}")


def status_counts(results: Sequence[CodeResult]) -> dict[str, int]:
  """Count of results per status, every status present (zeros included) for stable metrics."""
  counts = dict.fromkeys(STATUSES, 0)
  for r in results:
    counts[r.status] += 1
  return counts


def rewards_and_mask(results: Sequence[CodeResult]) -> tuple[list[float], list[bool]]:
  """Rewards (0.0 where invalid) and a validity mask: drop masked samples from the update."""
  return [r.score if r.score is not None else 0.0 for r in results], [r.valid for r in results]


class CodeScorer:
  """Scores responses against code tests in a sandbox pool; a context manager.

  Owns (and closes) its sandbox unless one is passed in. Cumulative counts per response status
  are in `self.counts`.
  """

  def __init__(
    self,
    sandbox: Sandbox | None = None,
    *,
    reward_mode: str = "fraction",
    stop_at_first_failure: bool = False,
    max_cases: int | None = None,
    prepend_setup: bool = False,
    timeout_s: float | None = None,
    config: SandboxConfig | None = None,
  ):
    if reward_mode not in REWARD_MODES:
      raise ValueError(f"unknown reward_mode {reward_mode!r}; valid: {sorted(REWARD_MODES)}")
    self._owns = sandbox is None
    self.sandbox = sandbox if sandbox is not None else Sandbox(config)
    self.reward_fn = REWARD_MODES[reward_mode]
    self.stop_at_first_failure = stop_at_first_failure
    self.max_cases = max_cases
    self.prepend_setup = prepend_setup
    self.timeout_s = timeout_s
    self.counts: collections.Counter[str] = collections.Counter()

  def __enter__(self) -> CodeScorer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    if self._owns:
      self.sandbox.close()

  def score(self, response: str, tests: dict) -> CodeResult:
    return self.score_batch([response], [tests])[0]

  def score_batch(self, responses: Sequence[str], tests: Sequence[dict]) -> list[CodeResult]:
    """Scores each response against its tests; the sandbox runs them concurrently."""
    if len(responses) != len(tests):
      raise ValueError(f"{len(responses)} responses but {len(tests)} test sets")
    results: list[CodeResult | None] = [None] * len(responses)
    jobs, where = [], []
    for i, (response, t) in enumerate(zip(responses, tests, strict=True)):
      code = extract_code(response)
      if code is None:
        results[i] = CodeResult(0.0, NO_CODE, 0, _num_cases(t, self.max_cases), {}, None)
        continue
      try:
        jobs.append(build_job(code, t, stop_at_first_failure=self.stop_at_first_failure,
                              max_cases=self.max_cases, prepend_setup=self.prepend_setup,
                              timeout_s=self.timeout_s))  # fmt: skip
        where.append(i)
      except (KeyError, TypeError, ValueError) as e:
        results[i] = CodeResult(None, BAD_TESTS, 0, 0, {}, code, f"malformed tests: {e}")
    for i, job, run in zip(where, jobs, self.sandbox.run_many(jobs), strict=True):
      total = 1 if job.mode == "check" else len(job.cases)
      counts = dict(collections.Counter(c.status.value for c in run.cases))
      if run.status == Status.INFRA_ERROR:
        results[i] = CodeResult(None, run.status.value, 0, total, counts, job.program, run.detail)
        continue
      passed = run.num_passed
      detail = run.detail or next((c.detail for c in run.cases if c.status != Status.OK), "")
      results[i] = CodeResult(self.reward_fn(passed, total), run.status.value, passed, total,
                              counts, job.program, detail)  # fmt: skip
    counts = status_counts(results)  # type: ignore[arg-type]
    self.counts.update(counts)
    logger.info("code reward: %s", ", ".join(f"{k}={v}" for k, v in counts.items() if v) or "-")
    return results  # type: ignore[return-value]


def _num_cases(tests: dict, max_cases: int | None) -> int:
  if "test_code" in tests:
    return 1
  return len(list(tests.get("inputs", ()))[:max_cases])
