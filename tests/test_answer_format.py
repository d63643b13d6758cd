"""reward.answer_format: where a math response's final answer is read (docs/guide.md "Rewards").

"boxed" reads the last \\boxed{}, "answer_line" DAPO's last `Answer: ...` line, "either" the box
and else the line; with data.instruction unset the prompts ask for the same format. The trainer's
rollouts and `python -m gppo_jax.evaluate` both score through the environment built here.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gppo_jax import config_lib, errors
from gppo_jax.data import envs
from gppo_jax.data import readers as data_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (response, gold "5"): which formats score it 1.
RESPONSES = {
  "boxed": ("So the sum is \\boxed{5}.", {"boxed", "either"}),
  "line": ("So the sum is 5.\nAnswer: 5", {"answer_line", "either"}),
  "both_disagree": ("First \\boxed{4}, then\nAnswer: $5$", {"answer_line"}),
  "neither": ("The sum is 5.", set()),
}


class CharCodes:
  """The smallest tokenizer DataEnv needs: code points as ids, no chat template."""

  def encode(self, text):
    return [ord(ch) % 256 for ch in text]


def math_env(tmp_path, answer_format, instruction=None):
  rows = [{"prompt": f"What is {i} + {5 - i}?", "answer": "5"} for i in range(8)]
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  c = config_lib.base("smoke")
  c.data.train_path = str(path)
  c.data.verifier_workers = 1
  c.data.instruction = instruction
  c.reward.answer_format = answer_format
  config_lib.validate(c, evaluating=True)
  return envs.make_env(c, tokenizer=CharCodes())


@pytest.mark.parametrize("answer_format", ["boxed", "answer_line", "either"])
def test_the_format_decides_which_responses_score_and_what_the_prompt_asks(tmp_path, answer_format):
  env = math_env(tmp_path, answer_format)
  try:
    prompts = env.train_prompts(8)[: len(RESPONSES)]
    texts = [text for text, _ in RESPONSES.values()]
    rewards, valid, metrics = env.score(texts, prompts)
  finally:
    env.close()
  want = [float(answer_format in formats) for _, formats in RESPONSES.values()]
  np.testing.assert_array_equal(rewards, want)
  assert valid.all()
  # Nothing to read in the format (the disagreeing response has both, so is "wrong" there).
  assert metrics["reward/status_no_answer"] == (1 if answer_format == "either" else 2)
  asks = data_lib.ANSWER_LINE_INSTRUCTION if answer_format == "answer_line" else None
  asks = asks or data_lib.MATH_INSTRUCTION
  assert all(p.text.endswith(asks) for p in prompts)
  # The format bonus of reward shaping follows the same format.
  shaped, m = envs.shape_rewards(
    np.zeros(len(texts)), texts, np.ones(len(texts)), max_len=8, format_coef=0.5,
    answer_format=answer_format,
  )  # fmt: skip
  extractable = {"boxed": [1, 0, 1, 0], "answer_line": [0, 1, 1, 0], "either": [1, 1, 1, 0]}
  np.testing.assert_array_equal(shaped, 0.5 * np.array(extractable[answer_format]))


def test_an_explicit_instruction_is_kept_whatever_the_format(tmp_path):
  env = math_env(tmp_path, "answer_line", instruction="End with Answer: followed by the number.")
  try:
    (prompt,) = env.train_prompts(8)[:1]
  finally:
    env.close()
  assert prompt.text.endswith("End with Answer: followed by the number.")


def test_bad_values_are_one_line_errors():
  c = config_lib.base("smoke")
  c.reward.answer_format = "dapo"
  with pytest.raises(errors.ConfigError) as info:
    config_lib.validate(c)
  msg = str(info.value)
  assert "reward.answer_format='dapo': must be one of boxed, answer_line, either" in msg
  assert "\n" not in msg
  env = subprocess.run(
    [
      sys.executable,
      "-m",
      "gppo_jax.train",
      "--config=configs/kl_atomic.py:smoke",
      "--config.reward.answer_format=Answer:",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert env.returncode == 2
  (line,) = env.stderr.strip().splitlines()
  assert line.startswith("error: ") and "reward.answer_format='Answer:'" in line
  assert "boxed, answer_line, either" in line
