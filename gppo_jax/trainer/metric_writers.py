"""Where metrics go: a JSONL file, TensorBoard event files, a progress bar and, with
config.logging.wandb, a Weights & Biases run (process 0 only).

A resumed run replays the iterations after its checkpoint, so `MetricWriter(resume_step=S)` drops
what the logs hold past step S (rows a crashed run wrote after its last checkpoint): it rewrites
metrics.jsonl without them (and without a half-written last line), and starts its TensorBoard
event file with a SessionLog.START event at step S + 1 (tensorboardX's `purge_step`), on which
TensorBoard discards the events of steps > S read before it. Each iteration appears once in both.

W&B: a resumed run continues the W&B run whose id the log folder keeps (WANDB_ID_FILE), logging
each row at its iteration as the step. W&B cannot drop what it holds: it ignores a step it has
already passed, so the replayed iterations up to the crashed run's last logged step keep the
first values logged for them, and the run continues from there. A run that starts afresh
(resume_step < 0: no checkpoint) starts a new W&B run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import string
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from gppo_jax import files
from gppo_jax.data import readers
from gppo_jax.errors import ConfigError, UserError

# The id of the log folder's W&B run, kept so that a resumed run continues it.
WANDB_ID_FILE = "wandb_run_id.txt"

# Figures shown on the progress bar, in this order, with short labels.
PROGRESS_KEYS = (
  ("reward/mean", "reward"),
  ("eval/accuracy", "acc"),
  ("trust/masked_frac", "masked"),
  ("div/estimate_mean", "div"),
)


def tensorboardx():
  """The tensorboardX package, imported without torch.

  tensorboardX imports torch when it is installed (to accept torch tensors, which we never pass):
  seconds of every training command's start-up on a machine that has torch. While it loads, an
  `import torch` fails as if torch were absent, and tensorboardX falls back to numpy; a torch
  imported before or after is untouched."""
  hide = "torch" not in sys.modules and "tensorboardX" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
  try:
    import tensorboardX
    import tensorboardX.proto.event_pb2
    import tensorboardX.proto.summary_pb2
    import tensorboardX.summary
  finally:
    if hide and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return tensorboardX


@dataclasses.dataclass(frozen=True)
class WandbOptions:
  """Where MetricWriter also logs, from config.logging: a W&B project, and the run's config."""

  project: str
  entity: str = ""  # "" = the account's default
  mode: str = "online"  # online | offline; the environment's WANDB_MODE, when set, wins
  config: Mapping[str, Any] | None = None

  @classmethod
  def from_config(cls, config) -> WandbOptions | None:
    """The options of config.logging, or None when W&B is off (or the config has no section)."""
    options = config.get("logging")
    if options is None or not options.wandb:
      return None
    return cls(
      project=options.wandb_project,
      entity=options.wandb_entity,
      mode=options.wandb_mode,
      config=json.loads(config.to_json_best_effort()),  # as the run's config.json holds it
    )


def import_wandb():
  """The wandb package, imported only when a config turns W&B logging on."""
  try:
    import wandb
  except ModuleNotFoundError as e:
    if e.name != "wandb":
      raise
    raise ConfigError(
      "logging.wandb=True needs the wandb package, which is not installed: pip install wandb "
      "(or set logging.wandb=False)"
    ) from None
  return wandb


def _wandb_run_id(log_dir: str, fresh: bool) -> str:
  """The id of the log folder's W&B run: the one WANDB_ID_FILE keeps, unless `fresh` or there is
  none, when a new one is made and kept (written atomically)."""
  path = os.path.join(log_dir, WANDB_ID_FILE)
  if not fresh and os.path.exists(path):
    with open(path) as f:
      kept = f.read().strip()
    if kept:
      return kept
  new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
  files.write_atomic(path, new + "\n")
  return new


def _start_wandb(options: WandbOptions, log_dir: str, fresh: bool):
  """(the wandb module, a W&B run for the log folder): the kept run resumed, or a new one. Its
  files go to <log_dir>/wandb, or $WANDB_DIR when set."""
  wandb = import_wandb()
  kwargs = dict(
    project=options.project,
    entity=options.entity or None,
    id=_wandb_run_id(log_dir, fresh),
    resume="allow",
    name=os.path.basename(os.path.normpath(log_dir)),
    dir=os.environ.get("WANDB_DIR") or log_dir,
    config=dict(options.config or {}),
    reinit="create_new",  # the writer logs to its own run object, never to wandb.run
    # W&B's own setting wins, as W&B users expect (an explicit init argument would beat it).
    mode=os.environ.get("WANDB_MODE", "").strip() or options.mode,
  )
  try:
    return wandb, wandb.init(**kwargs)
  except (wandb.errors.Error, ValueError) as e:  # no API key or network, a bad WANDB_MODE, ...
    raise UserError(
      f"Weights & Biases (logging.wandb=True, mode {kwargs['mode']!r}): {e}; "
      "logging.wandb_mode='offline' logs without an account or network (`wandb sync` uploads "
      "the run later)"
    ) from e


def _wandb_histogram(wandb, histogram: Mapping[str, Any]):
  """A wandb.Histogram of the keyword arguments MetricWriter.histogram takes. The buckets' right
  edges (bucket_limits) get a left edge for the first, open bucket: the smallest value seen or
  one bucket's width below the first limit, whichever is lower."""
  limits = [float(x) for x in histogram["bucket_limits"]]
  below = limits[0] - (limits[1] - limits[0] if len(limits) > 1 else 1.0)
  edges = [min(float(histogram["min"]), below), *limits]
  return wandb.Histogram(np_histogram=(list(histogram["bucket_counts"]), edges))


def _scalar(v: Any) -> float | None:
  try:
    x = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return x


def _tb_name(key: str) -> str:
  """TensorBoard tags allow [A-Za-z0-9_./-]: 'eval/pass@4' -> 'eval/pass_at_4'."""
  return re.sub(r"[^\w./-]", "_", key.replace("@", "_at_"))


class MetricWriter:
  """Writes flat dicts of scalars; `log_dir` gets metrics.jsonl and TensorBoard events, and with
  `wandb` options a W&B run gets the same scalars and histograms at the same steps.

  resume_step: None (append), S >= 0 (a run resumed at step S: drop what lies past it) or < 0 (a
  run started afresh: drop everything, and a new W&B run)."""

  def __init__(
    self,
    log_dir: str,
    *,
    total_steps: int,
    initial_step: int = 0,
    resume_step: int | None = None,
    enabled: bool | None = None,
    progress: bool = True,
    wandb: WandbOptions | None = None,
  ):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.latest: dict[str, float] = {}
    self._jsonl = None
    self._tb = None
    self._bar = None
    self._wandb = self._wandb_lib = None
    self.wandb_run_id = None
    if not self.enabled:
      return
    os.makedirs(log_dir, exist_ok=True)
    if wandb is not None:  # first: a W&B error leaves no file open
      fresh = resume_step is not None and resume_step < 0
      self._wandb_lib, self._wandb = _start_wandb(wandb, log_dir, fresh)
      self.wandb_run_id = self._wandb.id
    self.jsonl_path = os.path.join(log_dir, "metrics.jsonl")
    if resume_step is not None:
      truncate_jsonl(self.jsonl_path, resume_step)
    self._jsonl = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115 (closed in close())
    # One event per step holding every scalar: an event per scalar (SummaryWriter.add_scalar) is
    # a queue hand-off for each of dozens of values, a visible part of a short iteration.
    self._tbx = tensorboardx()
    self._tb = self._tbx.FileWriter(os.path.join(log_dir, "tensorboard"))
    if resume_step is not None:
      event_pb2 = self._tbx.proto.event_pb2
      start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      self._tb.add_event(event_pb2.Event(step=resume_step + 1, session_log=start))
    if progress:
      from tqdm.auto import tqdm

      self._bar = tqdm(
        total=total_steps,
        initial=initial_step,
        unit="it",
        dynamic_ncols=True,
        file=sys.stderr,
        mininterval=1.0,
      )

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    values = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
    self.latest.update(values)
    record = {
      "step": int(step),
      "time": time.time(),
      **{k: (v if math.isfinite(v) else str(v)) for k, v in values.items()},
    }
    self._jsonl.write(json.dumps(record) + "\n")
    if self._tb is not None:
      summary = self._tbx.proto.summary_pb2.Summary
      scalars = [summary.Value(tag=_tb_name(k), simple_value=v) for k, v in values.items()]
      self._tb.add_summary(summary(value=scalars), int(step))
    if self._wandb is not None:
      self._wandb.log(values, step=int(step))

  def histogram(self, step: int, tag: str, histogram: dict[str, Any]) -> None:
    """A histogram to TensorBoard (and W&B): the keyword arguments of
    tensorboardX.summary.histogram_raw (min, max, num, sum, sum_squares, bucket_limits,
    bucket_counts)."""
    if self._tb is not None:
      summary = self._tbx.summary.histogram_raw(_tb_name(tag), **histogram)
      self._tb.add_summary(summary, int(step))
    if self._wandb is not None:
      self._wandb.log({tag: _wandb_histogram(self._wandb_lib, histogram)}, step=int(step))

  def advance(self, n: int = 1) -> None:
    if self._bar is None:
      return
    shown = {label: f"{self.latest[key]:.3g}" for key, label in PROGRESS_KEYS if key in self.latest}
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(n)

  def redirect_logging(self, *loggers: logging.Logger) -> contextlib.AbstractContextManager:
    """A context in which the console handlers of `loggers` print above the progress bar
    (tqdm's logging redirection), so log lines never tear the bar."""
    if self._bar is None:
      return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=list(loggers), tqdm_class=type(self._bar))

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def flush(self) -> None:
    if self._jsonl is not None:
      self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


# --- Resume: drop what lies past the restored step ----------------------------------------------


def truncate_jsonl(path: str, max_step: int) -> int:
  """Keeps the rows of `path` with step <= max_step; returns the lines dropped (those past the
  step, and a half-written last line). The kept rows are written back as MetricWriter writes
  them, each on a whole line."""
  if not os.path.exists(path) or os.path.getsize(path) == 0:
    return 0
  kept, dropped = [], 0
  for _, row in readers.read_records(path, bad_lines="yield"):
    try:
      ok = int(row["step"]) <= max_step
    except (ValueError, KeyError, TypeError):
      ok = False  # a half-written line (readers.Unreadable) or not a row of ours
    if ok:
      kept.append(json.dumps(row) + "\n")
    else:
      dropped += 1
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    whole = f.read(1) == b"\n"  # else the next row would be appended to the last line
  if dropped or not whole:
    files.write_atomic(path, "".join(kept), fsync=True)
  return dropped
