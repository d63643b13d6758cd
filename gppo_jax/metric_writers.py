"""Where metrics go: a JSONL file, TensorBoard event files and a progress bar (process 0 only)."""

from __future__ import annotations

import json
import math
import os
import re
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
    self._jsonl = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115 (closed in close())
    try:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
    except ImportError:  # pragma: no cover - tensorboardX is in requirements.txt
      self._tb = None
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
      for k, v in values.items():
        self._tb.add_scalar(_tb_name(k), v, int(step))

  def advance(self, n: int = 1) -> None:
    if self._bar is None:
      return
    shown = {label: f"{self.latest[key]:.3g}" for key, label in PROGRESS_KEYS if key in self.latest}
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(n)

  def print(self, text: str) -> None:
    """A line above the progress bar (or on stderr without one)."""
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(text)
    else:
      print(text, file=sys.stderr, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()
