"""Math answer reward: strict final-answer extraction and math-verify checks in a killable pool.

Extraction is ours and strict: the last `\\boxed{...}` / `\\fbox{...}` (brace matched, escaped
braces skipped) in the text after the last `</think>`, or optionally DAPO's last `Answer:` line.
There is never a fallback to "any number in the text".

Equivalence: a cheap normalised string match first, then math-verify (`parse` + `verify`, gold
first). math-verify can hang or exhaust memory on adversarial input (power towers, huge powers) and
its own `signal.alarm` timeouts only work in a main thread, so it runs in worker processes:
- workers are fresh interpreters started with `subprocess` (fork+exec, no `preexec_fn`, a minimal
  environment, `python -I` on this file): they never copy the multithreaded JAX parent and, unlike
  multiprocessing's spawn/forkserver, never re-import the trainer's `__main__` (and jax with it);
- each worker imports math-verify once, caps its address space with RLIMIT_AS, arms a soft
  per-item interval timer (a clean `timeout` reply) and exits when its parent disappears;
- the parent enforces a hard wall-clock limit per item, SIGKILLs and replaces overrunning or dead
  workers, and returns a status per item.
Messages are JSON lines over the worker's stdin/stdout.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# Result statuses. Only "ok" scores 1.
OK = "ok"  # answer equivalent to the gold
WRONG = "wrong"  # answer extracted and compared, not equivalent
NO_ANSWER = "no_answer"  # no final answer found (no box, unfinished thinking, empty box)
TIMEOUT = "timeout"  # comparison overran the per-item limit (soft timer or parent kill)
MEMORY = "memory"  # comparison hit the worker's memory limit
ERROR = "error"  # math-verify raised, or the worker died
BAD_GOLD = "bad_gold"  # the gold answer does not parse (should have been rejected at load)
STATUSES = (OK, WRONG, NO_ANSWER, TIMEOUT, MEMORY, ERROR, BAD_GOLD)

EXTRACT_MODES = ("boxed", "answer", "boxed_or_answer")
# config.reward.answer_format -> extraction mode: the last \boxed{}, DAPO's last `Answer:` line, or
# the box with the line as a fallback.
ANSWER_FORMATS = {"boxed": "boxed", "answer_line": "answer", "either": "boxed_or_answer"}


@dataclasses.dataclass(frozen=True)
class MathResult:
  """Outcome of checking one response: score in {0, 1}, a status from STATUSES, the answer."""

  score: float
  status: str
  extracted: str | None
  detail: str = ""


# ---------------------------------------------------------------------------------------------
# Extraction (pure)
# ---------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_LINE_RE = re.compile(r"(?im)^[ \t*#]*answer[ \t*]*:[ \t]*(.*\S)[ \t]*$")


def _match_braces(text: str, open_pos: int) -> int | None:
  """Index of the `}` closing the `{` at open_pos, skipping `\\{` and `\\}`; None if unclosed."""
  depth = 0
  i = open_pos
  n = len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return None


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` or `\\fbox{...}` in text (also `\\boxed 5`).

  Returns None when there is no box, when the last box is unclosed (a truncated response: an
  earlier box is an intermediate result, not the answer) or empty.
  """
  matches = list(_BOX_RE.finditer(text))
  if not matches:
    return None
  end = matches[-1].end()
  rest = text[end:]
  stripped = rest.lstrip()
  if stripped.startswith("{"):
    open_pos = end + (len(rest) - len(stripped))
    close = _match_braces(text, open_pos)
    if close is None:
      return None
    content = text[open_pos + 1 : close].strip()
  elif rest[:1] in (" ", "\t"):
    token = re.match(r"[ \t]+([^\s$]+)", rest)
    content = token.group(1) if token else ""
  else:
    return None
  return content or None


def answer_line(text: str) -> str | None:
  """Content of the last `Answer: ...` line (DAPO's format), without surrounding `$`."""
  matches = _ANSWER_LINE_RE.findall(text)
  if not matches:
    return None
  content = matches[-1].strip().strip("*").strip()
  if content.startswith("$") and content.endswith("$") and len(content) > 1:
    content = content.strip("$").strip()
  return content or None


def final_text(response: str, require_think_close: bool = False) -> str | None:
  """The part of a response that may hold the final answer: the text after the last `</think>`.

  A response that opens `<think>` and never closes it is unfinished: None. With
  require_think_close (templates that open `<think>` in the prompt), a missing `</think>` is too.
  """
  close = response.rfind("</think>")
  if close >= 0:
    return response[close + len("</think>") :]
  if require_think_close or "<think>" in response:
    return None
  return response


def extract_answer(
  response: str, mode: str = "boxed", require_think_close: bool = False
) -> str | None:
  """Strict final answer of a response, or None. mode: one of EXTRACT_MODES."""
  if mode not in EXTRACT_MODES:
    raise ValueError(f"unknown extraction mode {mode!r}; valid: {EXTRACT_MODES}")
  text = final_text(response, require_think_close)
  if text is None:
    return None
  if mode == "answer":
    return answer_line(text)
  boxed = last_boxed(text)
  if boxed is None and mode == "boxed_or_answer":
    return answer_line(text)
  return boxed


_SPACING_RE = re.compile(r"\\[,;:! ]|\\left(?![A-Za-z])|\\right(?![A-Za-z])|\s+")


def normalize_answer(answer: str) -> str:
  """Cheap canonical form for the string-match shortcut (never decides 'wrong' on its own)."""
  s = answer.strip().strip("$")
  s = _SPACING_RE.sub("", s)
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = s.rstrip(".")
  return s


# ---------------------------------------------------------------------------------------------
# Shaping terms (pure)
# ---------------------------------------------------------------------------------------------


def overlong_penalty(length: int, max_length: int, buffer_length: int) -> float:
  """DAPO's soft overlong penalty: min(-(L - (Lmax - Lbuf)) / Lbuf, 0), down to -1 at L = Lmax.

  Zero up to Lmax - Lbuf tokens, then linear; lengths past Lmax keep growing the penalty.
  """
  if buffer_length <= 0 or buffer_length > max_length:
    raise ValueError(f"need 0 < buffer_length <= max_length, got {buffer_length}, {max_length}")
  return min(-(length - (max_length - buffer_length)) / buffer_length, 0.0)


def format_reward(
  response: str,
  mode: str = "boxed",
  require_think_close: bool = False,
  reward: float = 1.0,
) -> float:
  """`reward` when a final answer can be extracted in the expected format, else 0."""
  return reward if extract_answer(response, mode, require_think_close) is not None else 0.0


def status_counts(results: Sequence[MathResult]) -> dict[str, int]:
  """Count of results per status, every status present (zeros included) for stable metrics."""
  counts = dict.fromkeys(STATUSES, 0)
  for r in results:
    counts[r.status] += 1
  return counts


# ---------------------------------------------------------------------------------------------
# The worker (runs in a fresh interpreter: `python -I math_reward.py --worker ...`)
# ---------------------------------------------------------------------------------------------


class _SoftTimeout(BaseException):
  """Raised by the worker's interval timer; BaseException so math-verify cannot swallow it."""


def _worker_main(memory_mb: int, parent_pid: int) -> None:
  import resource
  import signal

  if memory_mb > 0:
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; it closes us.
  # The protocol owns the real stdout; anything the libraries print goes to stderr.
  proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
  os.dup2(2, 1)

  def watch_parent() -> None:
    while os.getppid() == parent_pid:
      time.sleep(0.5)
    os._exit(3)

  threading.Thread(target=watch_parent, daemon=True).start()

  logging.basicConfig(level=logging.ERROR)
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)
  import math_verify
  from sympy import Basic, MatrixBase

  config = [math_verify.LatexExtractionConfig(boxed_match_priority=0)]

  def parse(answer: str) -> list:
    return math_verify.parse("\\boxed{" + answer + "}", config, parsing_timeout=None)

  def parsed_gold(gold: str) -> list | None:
    if gold not in gold_cache:
      if len(gold_cache) > 4096:
        gold_cache.clear()
      parsed = parse(gold)
      ok = any(isinstance(p, (Basic, MatrixBase)) for p in parsed)
      gold_cache[gold] = parsed if ok else None
    return gold_cache[gold]

  gold_cache: dict[str, list | None] = {}

  def on_alarm(signum, frame):
    raise _SoftTimeout()

  signal.signal(signal.SIGALRM, on_alarm)

  def handle(msg: dict) -> tuple[str, str]:
    gold = parsed_gold(msg["gold"])
    if gold is None:
      return BAD_GOLD, "gold answer does not parse to a math expression"
    if msg["op"] == "check_gold":
      return OK, ""
    pred = parse(msg["pred"])
    if not pred:
      return WRONG, "answer does not parse"
    return (OK if math_verify.verify(gold, pred, timeout_seconds=None) else WRONG), ""

  # Warm up lazy imports and sympy caches so the first real item is not charged for them.
  warmup = [("x^2+2x+1", "(x+1)^2"), ("(1,2]", "\\{1,2\\}"), ("\\frac{1}{2}", "0.5"), ("x=5", "y")]
  for gold, pred in warmup:
    math_verify.verify(parse(gold), parse(pred), timeout_seconds=None)
  proto_out.write('{"ready": true}\n')
  proto_out.flush()
  for line in sys.stdin:
    msg = json.loads(line)
    try:
      if msg["soft_timeout_s"] > 0:
        signal.setitimer(signal.ITIMER_REAL, msg["soft_timeout_s"])
      try:
        status, detail = handle(msg)
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
      status, detail = TIMEOUT, "soft timer"
    except MemoryError:
      status, detail = MEMORY, "MemoryError"
      gold_cache.clear()
    except Exception as e:  # noqa: BLE001 - any library failure is an 'error' result
      status, detail = ERROR, f"{type(e).__name__}: {str(e)[:200]}"
    proto_out.write(json.dumps({"status": status, "detail": detail}) + "\n")
    proto_out.flush()
  os._exit(0)  # stdin closed: the parent is done with us; skip interpreter teardown


# ---------------------------------------------------------------------------------------------
# The pool (parent side)
# ---------------------------------------------------------------------------------------------


class _Worker:
  """One worker process and its line buffer."""

  def __init__(self, args: list[str]):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    self.proc = subprocess.Popen(
      args,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=None,
      env=env,
      close_fds=True,
    )
    self.fd = self.proc.stdout.fileno()
    os.set_blocking(self.fd, False)
    self.buffer = b""
    self.ready = False
    self.task: int | None = None  # index of the unique item it is working on
    self.deadline = 0.0
    self.started = time.monotonic()

  def send(self, msg: dict) -> None:
    self.proc.stdin.write((json.dumps(msg) + "\n").encode())
    self.proc.stdin.flush()

  def read_lines(self) -> list[dict] | None:
    """Complete messages available now; None once the worker's stdout is closed (it died)."""
    try:
      chunk = os.read(self.fd, 1 << 16)
    except BlockingIOError:
      chunk = None
    if chunk == b"":
      return None
    if chunk:
      self.buffer += chunk
    *lines, self.buffer = self.buffer.split(b"\n")
    return [json.loads(line) for line in lines if line.strip()]

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass


class MathVerifier:
  """Pool of math-verify workers with per-item hard timeouts; a context manager.

  score_batch(responses, golds) extracts answers here, settles string matches here, and sends
  the rest (deduplicated) to the workers. A worker that overruns `timeout_s` on an item is killed
  and replaced and the item scores 0 with status `timeout`. Cumulative counts per status are in
  `self.counts` and logged per batch.
  """

  def __init__(
    self,
    num_workers: int = 4,
    timeout_s: float = 5.0,
    memory_mb: int = 2048,
    *,
    mode: str = "boxed",
    require_think_close: bool = False,
    soft_timeout: bool = True,
    startup_timeout_s: float = 120.0,
  ):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if mode not in EXTRACT_MODES:
      raise ValueError(f"unknown extraction mode {mode!r}; valid: {EXTRACT_MODES}")
    self.num_workers = num_workers
    self.timeout_s = float(timeout_s)
    self.memory_mb = int(memory_mb)
    self.mode = mode
    self.require_think_close = require_think_close
    self.startup_timeout_s = startup_timeout_s
    # The worker's own timer fires a little before the parent's kill, so the common slow case
    # ends with a reply and the worker survives; C-level hangs that ignore signals get killed.
    # Public so it can be changed between batches (0 disables it).
    self.soft_timeout_s = 0.8 * self.timeout_s if soft_timeout else 0.0
    self._args = [
      sys.executable,
      "-I",
      os.path.abspath(__file__),
      "--worker",
      str(self.memory_mb),
      str(os.getpid()),
    ]
    self.counts: collections.Counter[str] = collections.Counter()
    self.num_restarts = 0
    self._lock = threading.Lock()
    self._workers: list[_Worker] = []
    self._closed = False
    for _ in range(num_workers):
      self._workers.append(_Worker(self._args))

  # -- lifecycle --------------------------------------------------------------------------------

  def __enter__(self) -> MathVerifier:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self) -> None:
    try:
      self.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown
      pass

  def close(self) -> None:
    """Stop every worker (EOF first, then SIGKILL) and reap them; idempotent."""
    if self._closed:
      return
    self._closed = True
    for w in self._workers:
      try:
        w.proc.stdin.close()
      except OSError:
        pass
    deadline = time.monotonic() + 1.0
    for w in self._workers:
      try:
        w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
      w.kill()
    self._workers = []

  @property
  def pids(self) -> list[int]:
    """Process ids of the current workers (for tests and monitoring)."""
    return [w.proc.pid for w in self._workers]

  # -- public API -------------------------------------------------------------------------------

  def score_batch(self, responses: Sequence[str], golds: Sequence[str]) -> list[MathResult]:
    """Score each response against its gold answer (gold strings, as in the dataset)."""
    if len(responses) != len(golds):
      raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
    results: list[MathResult | None] = [None] * len(responses)
    jobs: dict[tuple[str, str], list[int]] = {}
    extracted: list[str | None] = []
    for i, (response, gold) in enumerate(zip(responses, golds, strict=True)):
      answer = extract_answer(response, self.mode, self.require_think_close)
      extracted.append(answer)
      if answer is None:
        results[i] = MathResult(0.0, NO_ANSWER, None)
      elif normalize_answer(answer) == normalize_answer(gold):
        results[i] = MathResult(1.0, OK, answer, "string match")
      else:
        jobs.setdefault((gold, answer), []).append(i)
    keys = list(jobs)
    outcomes = self._run([{"op": "verify", "gold": g, "pred": p} for g, p in keys])
    for key, (status, detail) in zip(keys, outcomes, strict=True):
      for i in jobs[key]:
        results[i] = MathResult(1.0 if status == OK else 0.0, status, extracted[i], detail)
    counts = status_counts(results)
    self.counts.update(counts)
    logger.info(
      "math reward: %s", ", ".join(f"{k}={v}" for k, v in counts.items() if v) or "empty batch"
    )
    return results  # type: ignore[return-value]

  def check_golds(self, golds: Sequence[str]) -> list[str | None]:
    """For each gold answer, None if math-verify parses it to a math expression, else why not."""
    unique = sorted({g for g in golds if g.strip()})
    outcomes = self._run([{"op": "check_gold", "gold": g} for g in unique])
    why = {
      g: None if status == OK else f"{status}: {detail}"
      for g, (status, detail) in zip(unique, outcomes, strict=True)
    }
    return [why[g] if g.strip() else "empty answer" for g in golds]

  # -- scheduling -------------------------------------------------------------------------------

  def _replace(self, w: _Worker) -> None:
    w.kill()
    self._workers[self._workers.index(w)] = _Worker(self._args)
    self.num_restarts += 1

  def _run(self, tasks: list[dict]) -> list[tuple[str, str]]:
    """Run tasks on the pool; returns (status, detail) per task, in order."""
    if not tasks:
      return []
    with self._lock:
      if self._closed:
        raise RuntimeError("MathVerifier is closed")
      for w in list(self._workers):  # died between batches (killed from outside, OOM...)
        if w.proc.poll() is not None:
          self._replace(w)
      out: list[tuple[str, str] | None] = [None] * len(tasks)
      queue = collections.deque(range(len(tasks)))
      deaths = [0] * len(tasks)
      failed_starts = 0
      while queue or any(w.task is not None for w in self._workers):
        now = time.monotonic()
        for w in list(self._workers):
          if w.ready and w.task is None and queue:
            if w.proc.poll() is not None:  # died while idle
              self._replace(w)
              continue
            w.task = queue.popleft()
            w.deadline = now + self.timeout_s
            try:
              w.send({**tasks[w.task], "soft_timeout_s": self.soft_timeout_s})
            except (BrokenPipeError, OSError):
              pass  # it died; its EOF is seen below
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
        wait = max(0.0, min(deadlines) - now) if deadlines else 0.0
        select.select([w.fd for w in self._workers], [], [], wait)
        now = time.monotonic()
        for w in list(self._workers):
          messages = w.read_lines()
          if messages is None:  # died: memory blow-up in C code, killed from outside...
            if w.task is not None:
              # Retry once: the worker may have died of something else than this item.
              deaths[w.task] += 1
              if deaths[w.task] < 2:
                queue.appendleft(w.task)
              else:
                out[w.task] = (ERROR, f"worker died (exit code {w.proc.poll()})")
              w.task = None
            elif not w.ready:
              failed_starts += 1
              if failed_starts > 2 * self.num_workers:
                raise RuntimeError(
                  f"math-verify workers keep dying at start-up (exit code {w.proc.poll()}); "
                  f"command: {' '.join(self._args)}"
                )
            self._replace(w)
            continue
          for msg in messages:
            if msg.get("ready"):
              w.ready = True
            elif w.task is not None:
              out[w.task] = (msg["status"], msg["detail"])
              w.task = None
          if w.task is not None and now >= w.deadline:
            out[w.task] = (TIMEOUT, f"killed after {self.timeout_s:g}s")
            w.task = None
            self._replace(w)
          elif not w.ready and now - w.started > self.startup_timeout_s:
            raise RuntimeError(
              f"math-verify worker not ready after {self.startup_timeout_s:g}s; "
              f"command: {' '.join(self._args)}"
            )
      return out  # type: ignore[return-value]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
  _worker_main(int(sys.argv[2]), int(sys.argv[3]))
