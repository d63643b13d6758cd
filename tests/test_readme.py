"""The README and the docs it points to: length, links, the quick-start commands, and the
custom-divergence example (configs/custom_divergence.py) loaded, validated and trained."""

import glob
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gppo_jax import config_lib, errors, train
from gppo_jax.algorithm import divergences, estimators

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
EXAMPLE = os.path.join(REPO, "configs", "custom_divergence.py")
# The documents whose relative links must resolve: the README, what it sends users to, and the
# campaign logs that docs/performance.md links to.
DOCS = [
  "README.md",
  "CONTRIBUTING.md",
  "docs/guide.md",
  "docs/verdict.md",
  "docs/performance.md",
  "docs/architecture.md",
  "docs/math.md",
  "launch/README.md",
  *sorted(
    os.path.relpath(path, REPO).replace(os.sep, "/")
    for path in glob.glob(os.path.join(REPO, "docs", "results", "*.md"))
  ),
]


def read(path: str) -> str:
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    return f.read()


def code_blocks(text: str, language: str) -> list[str]:
  return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.S | re.M)


def heading_anchors(text: str) -> set[str]:
  """GitHub's anchors for a Markdown file's headings (outside code blocks)."""
  text = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
  anchors = set()
  for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
    slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    anchors.add(slug)
  return anchors


def relative_links(text: str) -> list[str]:
  text = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
  targets = re.findall(r"\]\(([^)\s]+)\)", text)
  return [t for t in targets if not re.match(r"[a-z]+:", t)]  # not http:, https:, mailto:


# The README's two fresh-machine commands (test_quick_start_commands_are_the_ones_ci_runs).
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt"
QUICK_START = (
  f"{SETUP} && python -m gppo_jax.train --config=configs/kl_atomic.py",
  f"{SETUP} -r requirements-test.txt && python -m pytest -q",
)


def test_readme_is_at_most_330_lines():
  lines = read("README.md").splitlines()
  assert 50 < len(lines) <= 330, len(lines)


def test_readme_lines_are_at_most_100_columns():
  """Every line, tables and code blocks included, except the two quick-start commands: each is
  one line so that it copies as it is, and it is the command .ci/run runs."""
  lines = read("README.md").splitlines()
  assert sum(line in QUICK_START for line in lines) == 2  # the exception is these two lines only
  wide = [
    (n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 100 and line not in QUICK_START
  ]
  assert not wide, f"README lines over 100 columns (line, width): {wide}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(doc):
  text = read(doc)
  links = relative_links(text)
  if doc == "README.md":
    assert len(links) >= 10, links  # the parser found the links
  broken = []
  for link in links:
    path, _, anchor = link.partition("#")
    target = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
    if not os.path.exists(os.path.join(REPO, target)):
      broken.append(f"{link}: no file {target}")
    elif anchor and target.endswith(".md") and anchor not in heading_anchors(read(target)):
      broken.append(f"{link}: no heading #{anchor} in {target}")
  assert not broken, f"{doc}: " + "; ".join(broken)


def test_heading_anchors_follow_github():
  text = "# Warm starts: what one run's outcome depends on\n## Using the math (a shell)\n"
  assert heading_anchors(text) == {
    "warm-starts-what-one-runs-outcome-depends-on",
    "using-the-math-a-shell",
  }


def test_quick_start_commands_are_the_ones_ci_runs():
  """The README's two fresh-machine commands: the main job, and the tests exactly as .ci/run
  runs them (only pip's -q differs)."""
  commands = [b.strip() for b in code_blocks(read("README.md"), "bash")]
  main, tests = QUICK_START
  assert commands[0] == main and commands[1] == tests, commands[:2]
  ci = [
    line.strip()
    for line in read(".ci/run").splitlines()
    if line.strip() and not line.startswith(("#", "set ", "cd "))
  ]
  assert " && ".join(ci).replace("pip install -q ", "pip install ") == tests, ci
  assert os.path.exists(os.path.join(REPO, "configs", "kl_atomic.py"))


def test_the_readme_example_is_the_config_file():
  blocks = [b for b in code_blocks(read("README.md"), "python") if "divergences.register(" in b]
  assert len(blocks) == 1, "the README shows configs/custom_divergence.py once"
  assert blocks[0] == read("configs/custom_divergence.py")


def load_with_config_flag(*args: str):
  """The config as the commands get it: ml_collections' --config flag and its overrides."""
  from absl import flags
  from ml_collections import config_flags

  argv = ["prog", *args]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def test_custom_divergence_config_loads_validates_and_is_registered():
  c = load_with_config_flag(f"--config={EXAMPLE}")
  config_lib.validate(c)
  assert (c.loss.divergence, c.loss.estimator) == ("le_cam", "atomic")
  f = lambda t: (t - 1.0) ** 2 / (t + 1.0)  # Le Cam's triangular discrimination
  assert c.loss.delta_low == c.loss.delta_high == pytest.approx(f(0.8))  # 0.0222
  div = divergences.get("le_cam")
  # The check the file skips at load, and the limits it states.
  divergences.check_generator("le_cam", div.f)
  assert div.f(1e-30) == pytest.approx(div.f_at_zero) == 1.0  # in float64: (1e30)^2 is finite
  assert div.f(1e30) / 1e30 == pytest.approx(div.slope_at_inf) == 1.0
  # Every estimator of the loss sees it: Atomic is q f(p / q) on the sampled token.
  rng = np.random.default_rng(0)
  p, q = rng.uniform(0.01, 0.99, 64), rng.uniform(0.01, 0.99, 64)
  got = estimators.estimate("le_cam", "atomic", np.log(p), np.log(q))
  np.testing.assert_allclose(np.asarray(got), q * f(p / q), rtol=1e-4)


def test_a_name_nobody_registered_is_a_clear_config_error():
  c = load_with_config_flag(f"--config={EXAMPLE}:smoke", "--config.loss.divergence=le_camm")
  with pytest.raises(errors.UnknownNameError) as info:
    config_lib.validate(c)
  message = str(info.value)
  assert message.startswith("loss.divergence: unknown divergence 'le_camm'; valid names: ")
  assert {"le_cam", "kl"} <= set(info.value.choices)  # the registered names, this one included
  assert "le_cam" in message.split("valid names: ")[1]


def test_the_name_exists_only_where_the_file_was_loaded(tmp_path):
  """The README's error line, from a fresh process that never loaded the example."""
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "gppo_jax.train",
      "--config=configs/kl_atomic.py:smoke",
      "--config.loss.divergence=le_cam",
      f"--workdir={tmp_path / 'run'}",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 2, out.stderr
  error = out.stderr.strip().splitlines()[-1]
  assert error.startswith("error: loss.divergence: unknown divergence 'le_cam'; valid names: ")
  assert " ".join(read("README.md").split()).count(error) == 1, error  # quoted as printed
  assert not os.path.exists(tmp_path / "run")  # stopped before any work


def test_custom_divergence_trains(tmp_path):
  """Two iterations on add1 from a short warm start: the update's second mini-batch is off-policy,
  so the trust region measures the moved policy with le_cam."""
  c = load_with_config_flag(
    f"--config={EXAMPLE}:smoke,task=add1",
    "--config.iterations=2",
    "--config.warmstart.max_steps=60",
    "--config.warmstart.target_accuracy=1.0",
    "--config.warmstart.eval_every=60",
    "--config.warmstart.lr=3e-4",
    "--config.optim.lr=1e-3",
    "--config.eval.every=2",
    "--config.eval.num_problems=8",
    "--config.eval.k=0",
  )
  wd = str(tmp_path / "run")
  summary = train.train_and_evaluate(c, wd)
  assert summary["iterations"] == 2
  with open(os.path.join(wd, "config.json")) as f:
    assert json.load(f)["loss"]["divergence"] == "le_cam"
  rows = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  updates = [x for x in rows if "loss/total" in x]
  assert len(updates) == 2
  assert all(math.isfinite(x["loss/total"]) for x in updates)
  assert any(x["reward/mean"] > 0 for x in updates)  # a signal to learn from
  assert max(x["div/estimate_mean"] for x in updates) > 1e-6  # the policy moved, measured
