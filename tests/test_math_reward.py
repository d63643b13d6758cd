"""Tests for rewards.math_reward: strict extraction, golden pairs, timeouts, pool hygiene."""

import json
import os
import threading
import time

import pytest

from gppo_jax.data import readers as data
from gppo_jax.rewards import math_reward
from gppo_jax.rewards.math_reward import (
  BAD_GOLD,
  NO_ANSWER,
  OK,
  TIMEOUT,
  WRONG,
  MathVerifier,
  extract_answer,
  format_reward,
  last_boxed,
  normalize_answer,
  overlong_penalty,
  status_counts,
)

TOWER = r"\boxed{9^{9^{9^{9^{9}}}}}"


def _alive(pid: int) -> bool:
  return os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def verifier():
  with MathVerifier(num_workers=2, timeout_s=3.0, memory_mb=1024) as v:
    yield v


# --- extraction (pure) -------------------------------------------------------------------------


@pytest.mark.parametrize(
  "text, expected",
  [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
    (r"first \boxed{1} then \boxed{2}", "2"),  # last wins
    (r"\fbox{7}", "7"),
    (r"\boxed {x+1}", "x+1"),
    (r"\boxed 5 is it", "5"),
    (r"\boxed{ }", None),  # empty box
    (r"\boxed{3} and then \boxed{4", None),  # last box unclosed (truncated): no answer
    ("The answer is 42.", None),  # never any-number fallback
    (r"\boxeddots{3}", None),
    ("**17**", None),  # markdown bold is not an answer format here
  ],
)
def test_last_boxed(text, expected):
  assert last_boxed(text) == expected


def test_think_handling():
  thinking = r"<think>maybe \boxed{1}</think> final \boxed{2}"
  assert extract_answer(thinking) == "2"
  assert extract_answer(r"<think>maybe \boxed{1}</think> no box here") is None
  assert extract_answer(r"<think>unfinished \boxed{1}") is None
  # Templates that open <think> in the prompt: the response only closes it.
  assert extract_answer(r"I think \boxed{1}</think>\boxed{3}", require_think_close=True) == "3"
  assert extract_answer(r"\boxed{3}", require_think_close=True) is None
  assert extract_answer(r"\boxed{3}") == "3"


def test_answer_line_modes():
  text = "Work...\nAnswer: 12\nmore\nAnswer: $\\frac{3}{4}$\n"
  assert extract_answer(text, mode="answer") == r"\frac{3}{4}"
  assert extract_answer(text, mode="boxed") is None
  assert extract_answer(text, mode="boxed_or_answer") == r"\frac{3}{4}"
  assert extract_answer(r"\boxed{5}" + "\nAnswer: 6", mode="boxed_or_answer") == "5"
  assert extract_answer("the answer: is below", mode="answer") is None  # not at line start
  with pytest.raises(ValueError, match="valid"):
    extract_answer("x", mode="any_number")


def test_normalize_answer():
  assert normalize_answer(r"\dfrac{1}{2}") == normalize_answer(r"\frac{1}{2}")
  assert normalize_answer(r"\left( 1,\ 2 \right)") == "(1,2)"
  assert normalize_answer(" 5. ") == "5"
  assert normalize_answer("12") != normalize_answer("21")


def test_overlong_penalty():
  # Lmax = 100, Lbuf = 20: free up to 80 tokens, then linear down to -1 at 100.
  assert overlong_penalty(50, 100, 20) == 0.0
  assert overlong_penalty(80, 100, 20) == 0.0
  assert overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
  assert overlong_penalty(100, 100, 20) == pytest.approx(-1.0)
  with pytest.raises(ValueError):
    overlong_penalty(10, 100, 0)


def test_format_reward():
  assert format_reward(r"\boxed{1}") == 1.0
  assert format_reward("1", reward=0.5) == 0.0
  assert format_reward("Answer: 1", mode="answer", reward=0.5) == 0.5


# --- golden pairs through the pool -------------------------------------------------------------

# (response, gold, expected status). Comments note where our pipeline differs from plain
# math-verify on free text (the known false positives/negatives listed in FACTS.md).
GOLDEN = [
  (r"\boxed{\frac{1}{2}}", "0.5", OK),
  (r"\boxed{0.5}", r"\frac{1}{2}", OK),
  (r"\boxed{\dfrac12}", r"\frac{1}{2}", OK),
  (r"\boxed{1/2}", r"\frac12", OK),
  (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", WRONG),
  (r"\boxed{0.333333}", r"\frac{1}{3}", OK),  # math-verify rounds to 6 places
  (r"\boxed{0.3333}", r"\frac{1}{3}", WRONG),
  (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", OK),
  (r"\boxed{(x+1)^2}", "x^2+2x+1", OK),
  (r"\boxed{(1,2]}", "(1,2]", OK),
  (r"\boxed{(1,2)}", "(1,2]", WRONG),
  (r"\boxed{[0,1)}", "[0,1]", WRONG),
  (r"\boxed{\{2,1\}}", r"\{1,2\}", OK),  # sets are unordered
  (r"\boxed{\{1,2,3\}}", r"\{1,2\}", WRONG),
  (r"\boxed{(2,1)}", "(1,2)", WRONG),  # tuples are ordered
  (r"\boxed{1,000}", "1000", OK),
  (r"\boxed{3 \text{ cm}}", "3", OK),
  (r"\boxed{\text{(B)}}", "B", OK),  # boxed choice letters work (free-text letters do not)
  (r"\boxed{C}", "B", WRONG),
  (r"\boxed{x = 5}", "5", OK),  # equation compared by its right-hand side (accepted)
  (r"\boxed{y = 5}", "x = 5", WRONG),  # different variable: rejected by this math-verify
  (r"\boxed{2021}", r"\pm 2021", WRONG),  # FACTS lists +-2021 vs 2021 as a false positive:
  (r"\boxed{\pm 2021}", "2021", WRONG),  # on boxed answers this math-verify rejects both ways
  ("The answer is **17**.", "17", NO_ANSWER),  # markdown bold: strict extraction finds nothing
  (r"\boxed{**17**}", "17", WRONG),  # ...and bold inside a box does not parse as 17
  (r"\boxed{2} then \boxed{3}", "3", OK),  # the last box wins
  (r"\boxed{3} then \boxed{2}", "3", WRONG),
  (r"<think>\boxed{3}</think> so \boxed{4}", "3", WRONG),  # the box while thinking is ignored
  (r"<think>it is \boxed{3}</think> I am unsure.", "3", NO_ANSWER),
  ("The answer is 3", "3", NO_ANSWER),  # no box, no fallback to numbers in the text
  (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", OK),
  (r"\boxed{10^{10}}", "10000000000", OK),
]


def test_golden_pairs(verifier):
  responses = [r for r, _, _ in GOLDEN]
  golds = [g for _, g, _ in GOLDEN]
  results = verifier.score_batch(responses, golds)
  got = [(r, g, res.status) for (r, g, _), res in zip(GOLDEN, results, strict=True)]
  assert got == GOLDEN
  for res in results:
    assert res.score == (1.0 if res.status == OK else 0.0)
  assert results[0].extracted == r"\frac{1}{2}"
  assert status_counts(results)[OK] == sum(s == OK for _, _, s in GOLDEN)


def test_duplicates_counts_and_bad_gold(verifier):
  before = verifier.counts[OK]
  results = verifier.score_batch(
    [r"\boxed{0.5}"] * 4 + [r"\boxed{1}", "no box"], [r"\frac12"] * 4 + [r"\frac{1}{", "1"]
  )
  assert [r.status for r in results] == [OK] * 4 + [BAD_GOLD, NO_ANSWER]
  assert verifier.counts[OK] - before == 4
  assert verifier.score_batch([], []) == []
  with pytest.raises(ValueError, match="gold"):
    verifier.score_batch(["a"], [])


def test_check_golds(verifier):
  reasons = verifier.check_golds(["3", r"\frac{1}{", "", r"(-\infty, 2]", r"\text{Evelyn}"])
  assert reasons[0] is None and reasons[3] is None and reasons[4] is None
  assert "bad_gold" in reasons[1]
  assert reasons[2] == "empty answer"


def test_dataset_rejects_unparsable_gold(verifier, tmp_path):
  path = tmp_path / "bad.jsonl"
  rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "half?", "answer": r"\frac{1}{"}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  with pytest.raises(data.DataError, match=r"bad\.jsonl:2.*rejected"):
    data.load_dataset(str(path), check_answers=verifier.check_golds)


# --- adversarial input, timeouts, process hygiene ----------------------------------------------


def test_power_tower_times_out_and_pool_recovers(verifier):
  start = time.monotonic()
  results = verifier.score_batch([TOWER, r"\boxed{4}"], ["5", "4.0"])
  elapsed = time.monotonic() - start
  assert [r.status for r in results] == [TIMEOUT, OK]
  assert elapsed < verifier.timeout_s + 1.5
  assert [r.status for r in verifier.score_batch([r"\boxed{6/4}"], ["1.5"])] == [OK]


def test_hard_kill_path(verifier):
  """With the worker's soft timer off, the parent must kill the hung worker and replace it."""
  restarts = verifier.num_restarts
  verifier.soft_timeout_s = 0.0
  try:
    start = time.monotonic()
    res = verifier.score_batch([TOWER, r"\boxed{3}"], ["5", "3.0"])
    elapsed = time.monotonic() - start
  finally:
    verifier.soft_timeout_s = 0.8 * verifier.timeout_s
  assert [r.status for r in res] == [TIMEOUT, OK]
  assert "killed" in res[0].detail
  assert elapsed < verifier.timeout_s + 1.5
  assert verifier.num_restarts == restarts + 1
  assert [r.status for r in verifier.score_batch([r"\boxed{1.25}"], ["5/4"])] == [OK]


def test_memory_limit_and_no_leaks_after_close():
  with MathVerifier(num_workers=1, timeout_s=5.0, memory_mb=768) as v:
    assert v.score_batch([r"\boxed{2.0}"], ["2"])[0].status == OK
    pids = v.pids
    limits = open(f"/proc/{pids[0]}/limits").read()
    line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
    assert str(768 * 1024 * 1024) in line
  assert not any(_alive(p) for p in pids)
  with pytest.raises(RuntimeError, match="closed"):
    v.score_batch([r"\boxed{1.5}"], ["2"])


def test_worker_killed_from_outside_is_replaced(verifier):
  victim = verifier.pids[0]
  os.kill(victim, 9)
  verifier._workers[0].proc.wait(timeout=30)  # the kill is asynchronous; let it land
  results = verifier.score_batch([r"\boxed{0.25}", r"\boxed{0.75}"], [r"\frac14", r"\frac34"])
  assert [r.status for r in results] == [OK, OK]
  assert victim not in verifier.pids


def test_usable_from_a_non_main_thread(verifier):
  """math-verify's own timeouts fail off the main thread; the pool does not care."""
  out = []
  t = threading.Thread(target=lambda: out.extend(verifier.score_batch([r"\boxed{0.2}"], ["1/5"])))
  t.start()
  t.join(30)
  assert [r.status for r in out] == [OK]


def test_constructor_validation():
  with pytest.raises(ValueError, match="num_workers"):
    MathVerifier(num_workers=0)
  with pytest.raises(ValueError, match="valid"):
    MathVerifier(num_workers=1, mode="numbers")
  assert math_reward.STATUSES[0] == OK
