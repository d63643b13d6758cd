"""Where metrics go: a JSONL file, TensorBoard event files and a progress bar (process 0 only).

A resumed run replays the iterations after its checkpoint, so `MetricWriter(resume_step=S)` first
drops what the logs hold past step S (rows a crashed run wrote after its last checkpoint, and a
half-written last line): each iteration appears once in metrics.jsonl and in TensorBoard.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import re
import struct
import sys
import time
from typing import Any

import jax
import numpy as np

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
    import tensorboardX.record_writer
    import tensorboardX.summary
  finally:
    if hide and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return tensorboardX


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
  """Writes flat dicts of scalars; `log_dir` gets metrics.jsonl and TensorBoard events."""

  def __init__(
    self,
    log_dir: str,
    *,
    total_steps: int,
    initial_step: int = 0,
    resume_step: int | None = None,
    enabled: bool | None = None,
    progress: bool = True,
  ):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.latest: dict[str, float] = {}
    self._jsonl = None
    self._tb = None
    self._bar = None
    if not self.enabled:
      return
    os.makedirs(log_dir, exist_ok=True)
    self.jsonl_path = os.path.join(log_dir, "metrics.jsonl")
    if resume_step is not None:
      truncate_jsonl(self.jsonl_path, resume_step)
      truncate_tensorboard(os.path.join(log_dir, "tensorboard"), resume_step)
    self._jsonl = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115 (closed in close())
    # One event per step holding every scalar: an event per scalar (SummaryWriter.add_scalar) is
    # a queue hand-off for each of dozens of values, a visible part of a short iteration.
    self._tbx = tensorboardx()
    self._tb = self._tbx.FileWriter(os.path.join(log_dir, "tensorboard"))
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

  def histogram(self, step: int, tag: str, histogram: dict[str, Any]) -> None:
    """A histogram to TensorBoard: the keyword arguments of tensorboardX.summary.histogram_raw
    (min, max, num, sum, sum_squares, bucket_limits, bucket_counts)."""
    if self._tb is not None:
      summary = self._tbx.summary.histogram_raw(_tb_name(tag), **histogram)
      self._tb.add_summary(summary, int(step))

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


# --- Resume: drop what lies past the restored step ----------------------------------------------


def truncate_jsonl(path: str, max_step: int) -> int:
  """Keeps the rows of `path` with step <= max_step (and only whole lines); returns rows dropped."""
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path, "rb") as f:
    for line in f:
      try:
        row = json.loads(line)
        ok = line.endswith(b"\n") and int(row["step"]) <= max_step
      except (ValueError, KeyError, TypeError):
        ok = False  # a half-written last line
      if ok:
        kept.append(line)
      else:
        dropped += 1
  if dropped:
    _replace(path, b"".join(kept))
  return dropped


def _records(data: bytes):
  """The payloads of a TFRecord stream (length, crc, payload, crc), stopping at a torn tail."""
  pos = 0
  while pos + 12 <= len(data):
    (length,) = struct.unpack_from("<Q", data, pos)
    end = pos + 12 + length + 4
    if end > len(data):
      return
    yield data[pos + 12 : pos + 12 + length]
    pos = end


def truncate_tensorboard(log_dir: str, max_step: int) -> int:
  """Rewrites each event file under `log_dir` without events past `max_step`; returns the count
  dropped. TensorBoard would otherwise show both the crashed run's and the replayed values."""
  tbx = tensorboardx()
  event_pb2, masked_crc32c = tbx.proto.event_pb2, tbx.record_writer.masked_crc32c
  dropped = 0
  for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    out, n = [], 0
    for payload in _records(data):
      event = event_pb2.Event()
      try:
        event.ParseFromString(payload)
      except Exception:  # noqa: BLE001 (protobuf's DecodeError moves between versions)
        n += 1
        continue
      if event.HasField("summary") and event.step > max_step:
        n += 1
        continue
      header = struct.pack("<Q", len(payload))
      out += [
        header,
        struct.pack("<I", masked_crc32c(header)),
        payload,
        struct.pack("<I", masked_crc32c(payload)),
      ]
    rewritten = b"".join(out)
    if n or len(rewritten) != len(data):
      _replace(path, rewritten)
      dropped += n
  return dropped


def _replace(path: str, data: bytes) -> None:
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
