"""The repository's own conventions, checked where CI has the history."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Commits from here on follow the convention (CONTRIBUTING.md, "Commit style"); older ones
# predate it and are left as they are.
FIRST = "3431e6ada94772c2f9d4ef73aad5a4106f1061c3"


def _git(*args):
  return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def test_commit_subjects_fit_in_72_columns():
  if shutil.which("git") is None or _git("cat-file", "-e", FIRST).returncode:
    pytest.skip("no git history here (or a shallow clone without the convention's start)")
  log = _git("log", "--format=%H %s", f"{FIRST}^..HEAD")
  assert log.returncode == 0, log.stderr
  long = [line for line in log.stdout.splitlines() if len(line.split(" ", 1)[1]) > 72]
  assert not long, "commit subjects over 72 characters (details go in the body):\n" + "\n".join(
    long
  )
