"""Atomic file writes: a reader sees the old file or the whole new one, never a half-written one.

The content goes to a temporary file in the target's folder (so the rename stays on one file
system), then `os.replace` puts it in place; on an error the temporary file is removed and the
target is untouched. This module imports nothing from the package.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO, Any


@contextlib.contextmanager
def atomic_write(
  path: str, mode: str = "w", *, fsync: bool = False, **open_kwargs: Any
) -> Iterator[IO]:
  """`with atomic_write(path) as f: f.write(...)`: `path` gets the content when the block ends
  without an error. mode is "w" (text; `open_kwargs` such as encoding or newline pass to `open`)
  or "wb". fsync: flush the data to disk before the rename, so a machine crash right after
  leaves the old file or the new one and not an empty one. Missing folders are created."""
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_write writes whole files: mode 'w' or 'wb', got {mode!r}")
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  # Per process, so two processes writing the same file never share a temporary file.
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, mode, **open_kwargs) as f:
      yield f
      if fsync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_atomic(path: str, data: str | bytes, *, fsync: bool = False, **open_kwargs: Any) -> None:
  """Writes `data` (str or bytes) to `path` atomically (see `atomic_write`)."""
  mode = "wb" if isinstance(data, bytes) else "w"
  with atomic_write(path, mode, fsync=fsync, **open_kwargs) as f:
    f.write(data)
