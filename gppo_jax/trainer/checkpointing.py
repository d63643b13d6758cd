"""Orbax checkpoints behind a few functions, so that an Orbax API move stays in this file.

A checkpoint holds the train state pytree (model parameters, optimizer state, step) plus a JSON
side-car of host values (data-iterator position, iteration, evaluation history), and optionally
named extra pytrees (`extras`: the lagging behaviour policies of `rollout.staleness`), each its own
item, so that a reader of the train state alone (evaluation) never needs to know about them.

Orbax writes each step into a temporary folder and renames it when complete, so a process killed
mid-save leaves a `*.orbax-checkpoint-tmp*` folder that is never read and that the next writer
removes. A step that is complete on disk but unreadable (a truncated file, a lost shard) is
skipped by `restore_latest` with a warning, and the run resumes from the newest readable step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import orbax.checkpoint as ocp

from gppo_jax.errors import CheckpointError

log = logging.getLogger("gppo_jax")

UNREADABLE = "unreadable"  # sub-folder that unreadable steps are moved into (Orbax ignores it)


def make_manager(
  directory: str, *, max_to_keep: int = 3, read_only: bool = False
) -> ocp.CheckpointManager:
  """A manager that keeps the latest `max_to_keep` checkpoints under `directory`.

  read_only: create nothing and write nothing (evaluation of another run's checkpoints). A writer
  first removes the temporary folders of saves that a killed process left unfinished."""
  if "://" not in directory:  # storage URLs (gs://...) go to Orbax as they are
    directory = os.path.abspath(os.path.expanduser(directory))
  if not read_only:
    remove_unfinished(directory)
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep, create=not read_only, read_only=read_only
  )
  return ocp.CheckpointManager(directory, options=options)


def remove_unfinished(directory: str) -> list[str]:
  """Deletes `<step>.orbax-checkpoint-tmp*` folders (process 0; synchronously, unlike Orbax's own
  background clean-up, which races with an early exit). Returns what it removed."""
  import jax
  from etils import epath

  root = epath.Path(directory)
  if jax.process_index() != 0 or not root.exists():
    return []
  removed = []
  for path in root.glob("*.orbax-checkpoint-tmp*"):
    path.rmtree()
    removed.append(str(path))
    log.warning("removed the unfinished checkpoint %s (a save cut short by a crash)", path)
  return removed


def save(
  manager: ocp.CheckpointManager,
  step: int,
  state: Any,
  meta: dict,
  *,
  wait: bool = False,
  extras: dict[str, Any] | None = None,
) -> None:
  """Saves `state` (a pytree of arrays, sharded or not) and `meta` (JSON-able) at `step`, plus
  each pytree of `extras` as an item of its own name."""
  items = {name: ocp.args.StandardSave(tree) for name, tree in (extras or {}).items()}
  if {"state", "meta"} & items.keys():
    raise ValueError(f"extras may not be named 'state' or 'meta', got {sorted(items)}")
  manager.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta), **items
    ),
    force=True,
  )
  if wait:
    manager.wait_until_finished()


def restore_latest(
  manager: ocp.CheckpointManager,
  abstract_state: Any,
  *,
  set_aside: bool = True,
  extras: dict[str, Any] | None = None,
) -> tuple[int, Any, dict]:
  """(step, state, meta) of the newest readable checkpoint, or (None, None, None) when there is
  none. With `extras` (name -> abstract pytree, as saved by `save(..., extras=...)`) the returned
  state is `{"state": state, **restored_extras}`; a step without those items counts as unreadable.

  `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with `.sharding` to restore onto a mesh,
  possibly different from the one that saved) describing the expected state. Unreadable newer
  steps are logged and, with `set_aside` (a trainer; not a read-only evaluation), moved to
  `<directory>/unreadable/` so
  that the resumed run can write those step numbers again. When no step is readable the error
  says why the newest one failed.
  """
  manager.wait_until_finished()
  steps = sorted(manager.all_steps(), reverse=True)
  failures: list[tuple[int, Exception]] = []
  for step in steps:
    try:
      restored = manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          meta=ocp.args.JsonRestore(),
          **{name: ocp.args.StandardRestore(tree) for name, tree in (extras or {}).items()},
        ),
      )
    except Exception as e:  # Orbax raises many types; the message below says what and where.
      log.warning(
        "checkpoint step %d in %s is unreadable (%s: %s); trying the one before it",
        step,
        manager.directory,
        type(e).__name__,
        _short(e),
      )
      failures.append((step, e))
      continue
    if failures and set_aside:
      _set_aside(manager, [s for s, _ in failures])
      log.warning(
        "resuming from step %d; unreadable newer step(s) %s were skipped",
        step,
        ", ".join(str(s) for s, _ in failures),
      )
    state = restored["state"]
    if extras:
      state = {"state": state, **{name: restored[name] for name in extras}}
    return step, state, dict(restored["meta"])
  if not failures:
    return None, None, None
  step, e = failures[0]
  raise CheckpointError(
    f"no readable checkpoint in {manager.directory} (steps {', '.join(str(s) for s in steps)}); "
    f"step {step}: {type(e).__name__}: {_short(e)}. If the model or optimizer configuration "
    "changed since they were written (or rollout.staleness, whose lagging policies are saved "
    "with them), train into a new --workdir"
  ) from e


def _short(e: Exception, limit: int = 300) -> str:
  text = " ".join(str(e).split())
  return text if len(text) <= limit else text[:limit] + " ..."


def _set_aside(manager: ocp.CheckpointManager, steps: list[int]) -> None:
  """Moves unreadable step folders out of the manager's sight (kept for a post-mortem)."""
  import jax

  if jax.process_index() == 0:
    aside = manager.directory / UNREADABLE
    aside.mkdir(parents=True, exist_ok=True)
    for step in steps:
      src = manager.directory / str(step)
      dst = aside / f"{step}-{int(time.time())}"
      src.rename(dst)
      log.warning("moved unreadable checkpoint %s to %s", src, dst)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("gppo_jax: unreadable checkpoints set aside")
  manager.reload()
