"""gppo_jax.files: a write either lands whole or leaves the old file as it was."""

import os

import pytest

from gppo_jax import errors, files


def test_atomic_write_replaces_the_file_whole(tmp_path):
  path = tmp_path / "sub" / "out.json"
  files.write_atomic(str(path), "first")
  files.write_atomic(str(path), b"second", fsync=True)
  assert path.read_bytes() == b"second"
  assert os.listdir(path.parent) == ["out.json"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file(tmp_path):
  path = tmp_path / "out.jsonl"
  path.write_text("old\n")
  with pytest.raises(RuntimeError), files.atomic_write(str(path)) as f:
    f.write("half of the new")
    raise RuntimeError("stopped mid-write")
  assert path.read_text() == "old\n"
  assert os.listdir(tmp_path) == ["out.jsonl"]


def test_the_new_file_gets_the_usual_permissions(tmp_path):
  # A temporary file made by `tempfile` would be 0600 and keep that after the rename.
  path = tmp_path / "summary.json"
  files.write_atomic(str(path), "{}")
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_did_you_mean():
  assert errors.did_you_mean("grop", ["grpo", "rloo"]) == " (did you mean 'grpo'?)"
  assert errors.did_you_mean("xyz", ["grpo", "rloo"]) == ""
