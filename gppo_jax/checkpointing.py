"""Orbax checkpoints behind three functions, so that an Orbax API move stays in this file.

A checkpoint holds the train state pytree (model parameters, optimizer state, step) plus a JSON
side-car of host values (rng key data, data-iterator position, iteration, metrics of note).
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp


def make_manager(directory: str, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
  """A manager that keeps the latest `max_to_keep` checkpoints under `directory`."""
  if "://" not in directory:  # storage URLs (gs://...) go to Orbax as they are
    directory = os.path.abspath(os.path.expanduser(directory))
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  return ocp.CheckpointManager(directory, options=options)


def save(
  manager: ocp.CheckpointManager, step: int, state: Any, meta: dict, *, wait: bool = False
) -> None:
  """Saves `state` (a pytree of arrays, sharded or not) and `meta` (JSON-able) at `step`."""
  manager.save(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    force=True,
  )
  if wait:
    manager.wait_until_finished()


def restore_latest(manager: ocp.CheckpointManager, abstract_state: Any) -> tuple[int, Any, dict]:
  """(step, state, meta) of the latest checkpoint, or (None, None, None) when there is none.

  `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with `.sharding` to restore onto a mesh,
  possibly different from the one that saved) describing the expected state.
  """
  manager.wait_until_finished()
  step = manager.latest_step()
  if step is None:
    return None, None, None
  try:
    restored = manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
      ),
    )
  except Exception as e:  # Orbax raises many types; the message below says what and where.
    raise RuntimeError(
      f"could not restore checkpoint step {step} from {manager.directory}: {e}. If the model or "
      "optimizer configuration changed since it was written, use a new --workdir."
    ) from e
  return step, restored["state"], dict(restored["meta"])
