"""Run untrusted (model-generated) programs in a sandbox and report what they did.

Isolation (as root, the default): every run gets fresh Linux namespaces from `unshare` (network with
no interfaces up, PID with its own /proc, mount, IPC, UTS), a chroot into a minimal read-only root
with a private size-limited tmpfs on /tmp, a scrubbed environment, resource
limits from `prlimit` (CPU, address space, processes, file size, open files, no core dumps) and a
dropped, unprivileged uid from `setpriv`, distinct per concurrent slot because RLIMIT_NPROC counts
per user. The parent only ever starts a command line (no `preexec_fn`, no Python in a forked
child), so it is safe to call from a multithreaded (JAX) trainer. When PID 1 of the namespace exits
or is SIGKILLed on timeout, the kernel kills everything left inside it.

Inside the namespace a trusted runner (the top part of this file, copied into the private /tmp
and run by the sandbox interpreter as the slot uid) runs the program in a separate process:
- stdio jobs: a fresh interpreter per case runs the program as a script; its stdout is captured
  up to a cap, its stderr tail kept for the error message;
- call jobs: a process forked from the runner *before* the runner reads its spec (so it holds no
  secret) imports the program once and answers calls with serialised results, decoded into plain
  builtins and judged again in the parent (no `__eq__` tricks, no objects cross);
- check jobs (HumanEval style): trusted setup and test code run in the runner and call
  `candidate`, a proxy that forwards each call to that process, so the program never shares a
  process with the test and cannot patch it, exit early on its behalf or swallow its assertions.
The runner makes itself non-dumpable (the program runs as the same uid and could otherwise read
its memory or its file descriptors via /proc), kills every other process of its uid after each
case, and reports one line tagged with a per-run random nonce the program never sees. Statuses:
see `Status`; `INFRA_ERROR` means the sandbox failed and must be neither a pass nor a fail.

Filesystem: the program sees a minimal read-only root (/usr, /etc, the /bin and /lib links, the
interpreter's prefix, a few devices, /proc) and a private writable /tmp; /work, /home, /root and
any dataset with expected outputs are not there, so it cannot read its own tests.

Interpreter: `SandboxConfig.python`, else $GPPO_SANDBOX_PYTHON, else /usr/bin/python3 or
/usr/local/bin/python3, else the one running this; an interpreter outside /usr gets its install
prefix bound read-only (under /root it would otherwise not be executable by the slot uid: exit
126). A probe run at construction checks the whole chain.

Without root (or without util-linux) construction fails closed with `SandboxUnavailableError`
unless `allow_unsafe=True`, which runs with resource limits and a process group only, and warns.
"""

from __future__ import annotations

import enum
import json
import math
import os
import selectors
import signal
import sys
import time

# ----------------------------------------------------------------------------------------------
# Shared by the parent and the runner (the runner is this file executed by the sandbox python,
# which may be a different interpreter: keep this part stdlib-only).
# ----------------------------------------------------------------------------------------------


class Status(str, enum.Enum):
  """Outcome of one test case or one whole run."""

  OK = "ok"
  WRONG_ANSWER = "wrong_answer"
  TIMEOUT = "timeout"
  MEMORY = "memory"
  RUNTIME_ERROR = "runtime_error"
  OUTPUT_LIMIT = "output_limit"
  INFRA_ERROR = "infra_error"  # the sandbox failed: never count as a pass or a fail


_STARTED = "gppo-sandbox-runner-started"
_MAX_DEPTH = 100


def encode_value(x: object, _depth: int = 0) -> object:
  """Encodes plain Python data as JSON-able data; tuples, sets, bytes, non-str keys survive.

  Only exact builtin types are accepted (subclasses could carry `__eq__` tricks).
  """
  if _depth > _MAX_DEPTH:
    raise ValueError("value nested too deeply to serialise")
  t = type(x)
  if x is None or t is bool or t is str:
    return x
  if t is int:
    return x if abs(x) < 2**53 else {"$i": str(x)}
  if t is float:
    return x if math.isfinite(x) else {"$f": repr(x)}
  d = _depth + 1
  if t is list:
    return [encode_value(v, d) for v in x]
  if t is tuple:
    return {"$t": [encode_value(v, d) for v in x]}
  if t is dict:
    return {"$d": [[encode_value(k, d), encode_value(v, d)] for k, v in x.items()]}
  if t is set or t is frozenset:
    return {"$s" if t is set else "$fs": [encode_value(v, d) for v in x]}
  if t is bytes:
    return {"$b": x.hex()}
  if t is complex:
    return {"$c": [encode_value(x.real, d), encode_value(x.imag, d)]}
  raise TypeError(f"cannot serialise a value of type {t.__name__}")


def decode_value(obj: object, _depth: int = 0) -> object:
  """Inverse of `encode_value`; rejects anything it did not produce."""
  if _depth > _MAX_DEPTH:
    raise ValueError("value nested too deeply to decode")
  t = type(obj)
  if obj is None or t in (bool, int, float, str):
    return obj
  d = _depth + 1
  if t is list:
    return [decode_value(v, d) for v in obj]
  if t is not dict or len(obj) != 1:
    raise ValueError(f"malformed encoded value of type {t.__name__}")
  ((tag, v),) = obj.items()
  if tag == "$i" and type(v) is str:
    return int(v)
  if tag == "$f" and v in ("nan", "inf", "-inf"):
    return float(v)
  if tag == "$b" and type(v) is str:
    return bytes.fromhex(v)
  if type(v) is not list:
    raise ValueError(f"malformed encoded value with tag {tag!r}")
  if tag == "$t":
    return tuple(decode_value(e, d) for e in v)
  if tag == "$s":
    return {decode_value(e, d) for e in v}
  if tag == "$fs":
    return frozenset(decode_value(e, d) for e in v)
  if tag == "$c" and len(v) == 2:
    return complex(decode_value(v[0], d), decode_value(v[1], d))
  if tag == "$d" and all(type(p) is list and len(p) == 2 for p in v):
    return {decode_value(k, d): decode_value(e, d) for k, e in v}
  raise ValueError(f"malformed encoded value with tag {tag!r}")


def outputs_match(actual: str, expected: str) -> bool:
  """Stdout judge: equal up to trailing whitespace on each line and trailing blank lines."""

  def norm(s: str) -> list[str]:
    lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
      lines.pop()
    return lines

  return norm(actual) == norm(expected)


def values_match(actual: object, expected: object, float_tol: float = 1e-9) -> bool:
  """Return-value judge on decoded plain data: lists equal tuples, floats within `float_tol`."""
  if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
    return len(actual) == len(expected) and all(
      values_match(a, e, float_tol) for a, e in zip(actual, expected, strict=True)
    )
  if type(actual) is dict and type(expected) is dict:
    return actual.keys() == expected.keys() and all(
      values_match(actual[k], expected[k], float_tol) for k in actual
    )
  if type(actual) is float or type(expected) is float:
    if type(actual) in (int, float) and type(expected) in (int, float):
      if math.isnan(actual) or math.isnan(expected):
        return math.isnan(actual) and math.isnan(expected)
      return math.isclose(actual, expected, rel_tol=float_tol, abs_tol=float_tol)
    return False
  if (type(actual) is bool) != (type(expected) is bool):
    return False
  return (
    type(actual) is type(expected)
    and actual == expected
    or (type(actual) in (int, float) and type(expected) in (int, float) and actual == expected)
  )


def call_result_matches(value: object, expected: object, accept_unwrapped: bool = False) -> bool:
  """Call judge; `accept_unwrapped` also accepts `expected[0]` for a one-element list `expected`
  (the APPS/TACO convention of wrapping each expected return value in a list)."""
  if values_match(value, expected):
    return True
  return (accept_unwrapped and type(expected) is list and len(expected) == 1
          and values_match(value, expected[0]))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The runner and the child: executed inside the sandbox by the sandbox interpreter.
# ----------------------------------------------------------------------------------------------

_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _set_nondumpable() -> None:
  import ctypes

  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _kill_tree(pid: int) -> None:
  """SIGKILLs a process and the process group it leads (it may not have called setsid yet)."""
  for kill, target in ((os.killpg, pid), (os.kill, pid)):
    try:
      kill(target, signal.SIGKILL)
    except OSError:
      pass


class _Child:
  """One program process started by the runner, with a deadline and capped reads."""

  def __init__(self, proc, spec: dict):
    import resource

    c = max(1, int(math.ceil(spec["cpu_s"])))
    try:
      resource.prlimit(proc.pid, resource.RLIMIT_CPU, (c, c + 1))
    except OSError:
      pass  # already gone
    self.spec = spec
    self.proc = proc
    self.sel = selectors.DefaultSelector()
    for f in (self.proc.stdout, self.proc.stderr):
      os.set_blocking(f.fileno(), False)
      self.sel.register(f, selectors.EVENT_READ)
    self.err = bytearray()
    self.buf = bytearray()

  def _drain(self, f, data: bytes) -> None:
    if f is self.proc.stderr:
      self.err += data
      del self.err[: max(0, len(self.err) - 4096)]
    else:
      self.buf += data

  def pump(self, deadline: float, cap: int, until_line: bool, stdin: bytes = b"") -> str:
    """Feeds stdin and reads stdout until EOF (or one line); returns "", "timeout" or "cap".

    Output is also complete shortly after the child exits, even if something it left behind
    still holds the pipes open (that leftover is killed with the child).
    """
    pending = memoryview(stdin)
    exited_at = None
    if self.proc.stdin is not None:
      if pending:
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.sel.register(self.proc.stdin, selectors.EVENT_WRITE)
      elif not until_line:
        self.proc.stdin.close()
        self.proc.stdin = None
    try:
      while True:
        if until_line and b"\n" in self.buf:
          return ""
        if not any(k.events & selectors.EVENT_READ for k in self.sel.get_map().values()):
          return ""
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
          return "timeout"
        if exited_at is None and self.proc.poll() is not None:
          exited_at = now
        if exited_at is not None and now - exited_at > 0.1:
          return ""
        for key, _ in self.sel.select(min(left, 0.05)):
          f = key.fileobj
          if f is self.proc.stdin:
            try:
              n = os.write(f.fileno(), pending[:65536])
            except (BrokenPipeError, BlockingIOError) as e:
              n = len(pending) if isinstance(e, BrokenPipeError) else 0
            pending = pending[n:]
            if not pending:
              self.sel.unregister(f)
              if not until_line:
                f.close()
                self.proc.stdin = None
              else:
                os.set_blocking(f.fileno(), True)
            continue
          data = os.read(f.fileno(), 65536)
          if not data:
            self.sel.unregister(f)
            continue
          self._drain(f, data)
          if len(self.buf) > cap:
            return "cap"
    finally:
      if self.proc.stdin is not None and self.proc.stdin in self.sel.get_map():
        self.sel.unregister(self.proc.stdin)

  def wait(self, deadline: float) -> str:
    """Waits for the child to exit; returns "" or "timeout"."""
    while self.proc.poll() is None:
      if time.monotonic() > deadline:
        return "timeout"
      time.sleep(0.002)
    return ""

  def kill(self) -> None:
    """Kills the child, its process group and (isolated) all other processes of this uid."""
    _kill_tree(self.proc.pid)
    if self.spec["isolated"]:
      try:  # every other process of this uid in the namespace, e.g. daemonised forks
        os.kill(-1, signal.SIGKILL)
      except OSError:
        pass
    self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
      if f is not None:
        try:
          f.close()
        except OSError:
          pass

  def failure(self, why: str) -> dict:
    """Classifies a child that stopped early (`why` is "", "timeout" or "cap")."""
    if why == "timeout":
      return {"status": Status.TIMEOUT.value, "detail": "wall-clock timeout"}
    if why == "cap":
      return {"status": Status.OUTPUT_LIMIT.value, "detail": "output limit exceeded"}
    rc = self.proc.returncode
    tail = self.err.decode("utf-8", "replace")
    if rc == -signal.SIGXCPU:
      return {"status": Status.TIMEOUT.value, "detail": "CPU time limit exceeded"}
    if "MemoryError" in tail[-300:]:
      return {"status": Status.MEMORY.value, "detail": tail[-1000:]}
    return {"status": Status.RUNTIME_ERROR.value, "detail": f"exit code {rc}\n{tail[-1000:]}"}


def _run_stdio(spec: dict, forked: _Forked) -> list[dict]:
  forked.kill()
  argv0 = [sys.executable, "-I", "-B"]
  results = []
  for i, case in enumerate(spec["cases"]):
    cwd = os.path.join(spec["workdir"], f"case{i}")
    os.makedirs(cwd)
    with open(os.path.join(cwd, "solution.py"), "w", encoding="utf-8") as f:
      f.write(spec["program"])
    t0 = time.monotonic()
    import subprocess

    proc = subprocess.Popen(
      argv0 + ["solution.py"],
      cwd=cwd,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      env=dict(_CHILD_ENV, HOME=cwd),
      start_new_session=True,
      close_fds=True,
    )
    child = _Child(proc, spec)
    deadline = t0 + spec["timeout_s"]
    why = child.pump(deadline, spec["max_output_bytes"], False, case["stdin"].encode("utf-8"))
    why = why or child.wait(deadline)
    child.kill()
    if why or child.proc.returncode != 0:
      res = child.failure(why)
    else:
      out = child.buf.decode("utf-8", "replace")
      exp = case.get("expected")
      ok = exp is None or outputs_match(out, exp)
      res = {"status": (Status.OK if ok else Status.WRONG_ANSWER).value, "stdout": out}
    res["time_s"] = time.monotonic() - t0
    results.append(res)
    if spec["stop_on_failure"] and res["status"] != Status.OK.value:
      break
  return results


class _CandidateFailure(Exception):
  def __init__(self, res: dict):
    super().__init__(res.get("detail", ""))
    self.res = res


class _Channel:
  """Runner side of the call protocol: one child process serving function calls."""

  def __init__(self, spec: dict, forked: _Forked, deadline: float):
    cwd = os.path.join(spec["workdir"], "call")
    os.makedirs(cwd)
    with open(os.path.join(cwd, "solution.py"), "w", encoding="utf-8") as f:
      f.write(spec["program"])
    self.spec = spec
    self.dead: dict | None = None
    self.child = _Child(forked, spec)
    self._request({"load": "solution.py", "cwd": cwd}, deadline)

  def _request(self, msg: dict, deadline: float) -> object:
    if self.dead is not None:
      raise _CandidateFailure(self.dead)
    child = self.child
    child.buf.clear()
    why = child.pump(
      deadline, self.spec["max_output_bytes"], True, (json.dumps(msg) + "\n").encode("utf-8")
    )
    if not why and b"\n" not in child.buf:
      why = "eof"
    if why:
      child.kill()
      self.dead = child.failure("" if why == "eof" else why)
      if why == "eof" and self.dead["status"] == Status.RUNTIME_ERROR.value:
        self.dead["detail"] = "program exited without returning a result; " + self.dead["detail"]
      raise _CandidateFailure(self.dead)
    line = bytes(child.buf).split(b"\n", 1)[0]
    try:
      reply = json.loads(line)
      if "ok" in reply:
        return decode_value(reply["ok"])
      err, etype = str(reply["error"]), str(reply.get("type", ""))
    except (ValueError, KeyError, TypeError) as e:
      err, etype = f"malformed reply from the program: {e}", ""
    status = Status.MEMORY if etype == "MemoryError" else Status.RUNTIME_ERROR
    raise _CandidateFailure({"status": status.value, "detail": err[-1000:], "type": etype})

  def call(self, fn: str, args: tuple, kwargs: dict, deadline: float) -> object:
    return self._request(
      {"fn": fn, "args": encode_value(tuple(args)), "kwargs": encode_value(dict(kwargs))}, deadline
    )

  def close(self) -> None:
    self.child.kill()


def _run_calls(spec: dict, forked: _Forked) -> list[dict]:
  results = []
  t0 = time.monotonic()
  try:
    chan = _Channel(spec, forked, t0 + spec["timeout_s"])
  except _CandidateFailure as e:
    return [dict(e.res, time_s=time.monotonic() - t0)]
  try:
    for case in spec["cases"]:
      t0 = time.monotonic()
      try:
        args, kwargs = decode_value(case["args"]), decode_value(case["kwargs"])
        value = chan.call(spec["fn"], args, kwargs, t0 + spec["timeout_s"])
        ok = "expected" not in case or call_result_matches(
          value, decode_value(case["expected"]), case["unwrap"]
        )
        res = {
          "status": (Status.OK if ok else Status.WRONG_ANSWER).value,
          "value": encode_value(value),
        }
      except _CandidateFailure as e:
        res = dict(e.res)
      res["time_s"] = time.monotonic() - t0
      results.append(res)
      if spec["stop_on_failure"] and res["status"] != Status.OK.value:
        break
  finally:
    chan.close()
  return results


def _run_check(spec: dict, forked: _Forked) -> list[dict]:
  t0 = time.monotonic()
  deadline = t0 + spec["timeout_s"]
  first_failure: list[dict] = []
  chan: _Channel | None = None

  def candidate(*args: object, **kwargs: object) -> object:
    if chan is None:
      raise RuntimeError("the test code called the candidate while being loaded")
    try:
      return chan.call(spec["fn"], args, kwargs, deadline)
    except (TypeError, ValueError) as e:  # arguments we cannot send: the test's problem
      first_failure.append({"status": Status.INFRA_ERROR.value, "detail": f"test arguments: {e}"})
      raise
    except _CandidateFailure as e:
      if chan.dead is not None:  # crash, timeout, memory: sticky even if the test swallows it
        first_failure.append(e.res)
        raise
      exc = __builtins__ if isinstance(__builtins__, dict) else vars(__builtins__)
      cls = exc.get(e.res.get("type", ""))
      if isinstance(cls, type) and issubclass(cls, Exception):
        raise cls(e.res["detail"]) from None  # the test may expect the candidate to raise
      raise RuntimeError(e.res["detail"]) from None

  candidate.__name__ = spec["fn"]
  ns: dict = {"__name__": "__gppo_check__"}
  try:  # trusted code first: a broken test is the data's fault, never the program's
    exec(compile(spec["setup_code"], "<setup>", "exec"), ns)
    ns[spec["fn"]] = candidate  # tests may call the function by name as well
    exec(compile(spec["test_code"], "<test>", "exec"), ns)
    check = ns[spec["check_fn"]]
  except Exception as e:  # noqa: BLE001
    forked.kill()
    detail = f"setup/test code failed: {type(e).__name__}: {e}"[:1000]
    return [{"status": Status.INFRA_ERROR.value, "detail": detail, "time_s": 0.0}]
  try:
    chan = _Channel(spec, forked, deadline)
  except _CandidateFailure as e:
    return [dict(e.res, time_s=time.monotonic() - t0)]
  try:
    check(candidate)
    res = {"status": Status.OK.value}
  except _CandidateFailure as e:
    res = dict(e.res)
  except AssertionError as e:
    res = {"status": Status.WRONG_ANSWER.value, "detail": f"AssertionError: {e}"[:1000]}
  except Exception as e:  # noqa: BLE001 - an exception escaping the test fails it
    res = {"status": Status.RUNTIME_ERROR.value, "detail": f"{type(e).__name__}: {e}"[:1000]}
  finally:
    chan.close()
  if first_failure:
    res = dict(first_failure[0])
  res["time_s"] = time.monotonic() - t0
  return [res]


class _Forked:
  """A child forked from the runner before the runner read its spec, so that it holds no secret;
  it serves function calls of the program (see `_child_serve`). Quacks like a Popen."""

  def __init__(self):
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    err_r, err_w = os.pipe()
    self.pid = os.fork()
    if self.pid == 0:
      code = 1
      try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for src, dst in ((devnull, 0), (devnull, 1), (err_w, 2)):
          os.dup2(src, dst)
        for fd in os.listdir("/proc/self/fd"):
          if int(fd) > 2 and int(fd) not in (req_r, resp_w):
            try:
              os.close(int(fd))
            except OSError:
              pass
        _child_serve(os.fdopen(req_r, "rb"), os.fdopen(resp_w, "wb"))
        code = 0
      finally:
        os._exit(code)
    for fd in (req_r, resp_w, err_w):
      os.close(fd)
    self.stdin = os.fdopen(req_w, "wb", buffering=0)
    self.stdout = os.fdopen(resp_r, "rb", buffering=0)
    self.stderr = os.fdopen(err_r, "rb", buffering=0)
    self.returncode: int | None = None

  def poll(self) -> int | None:
    if self.returncode is None:
      pid, status = os.waitpid(self.pid, os.WNOHANG)
      if pid:
        self.returncode = os.waitstatus_to_exitcode(status)
    return self.returncode

  def wait(self) -> int:
    if self.returncode is None:
      self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
    return self.returncode

  def kill(self) -> None:
    _kill_tree(self.pid)
    self.wait()
    for f in (self.stdin, self.stdout, self.stderr):
      f.close()


def _runner_main() -> None:
  out = os.fdopen(os.dup(1), "w", encoding="utf-8")
  out.write(_STARTED + "\n")
  out.flush()
  _set_nondumpable()  # the program runs as our uid: it must not read our memory (nonce, tests)
  forked = _Forked()  # before reading the spec
  spec = json.loads(sys.stdin.buffer.read())
  if spec["isolated"] and os.getuid() == 0:
    raise RuntimeError("the sandbox runner must not run as root")
  devnull = os.open(os.devnull, os.O_RDWR)
  os.dup2(devnull, 0)
  os.dup2(2, 1)  # trusted test code that prints must not reach the result channel
  os.chdir(spec["workdir"])  # the private /tmp
  run = {"stdio": _run_stdio, "call": _run_calls, "check": _run_check}[spec["mode"]]
  results = run(spec, forked)
  out.write("\n" + spec["nonce"] + " " + json.dumps({"cases": results}, ensure_ascii=False) + "\n")
  out.flush()


def _child_serve(chan_in, chan_out) -> None:
  """The program's side of the call protocol: load the program, then answer calls."""
  sys.setrecursionlimit(10000)  # recursive solutions; the runner itself keeps the default
  send, recv = chan_out.write, chan_in.readline
  dumps, loads, enc, dec = json.dumps, json.loads, encode_value, decode_value

  def reply(msg: dict) -> None:
    send((dumps(msg) + "\n").encode("utf-8"))
    chan_out.flush()

  ns: dict = {"__name__": "__solution__"}
  first = recv()
  if not first:
    return
  first = loads(first)
  try:
    os.chdir(first["cwd"])
    os.environ["HOME"] = first["cwd"]
    with open(first["load"], encoding="utf-8") as f:
      code = compile(f.read(), first["load"], "exec")
    exec(code, ns)
    reply({"ok": None})
  except BaseException as e:  # noqa: BLE001 - SystemExit at import time fails too
    reply({"error": f"{type(e).__name__}: {e}", "type": type(e).__name__})
    return
  while True:
    line = recv()
    if not line:
      return
    req = loads(line)
    fn = ns.get(req["fn"])
    if not callable(fn):
      reply({"error": f"the program defines no function {req['fn']!r}", "type": "NameError"})
      continue
    try:
      msg = {"ok": enc(fn(*dec(req["args"]), **dec(req["kwargs"])))}
    except BaseException as e:  # noqa: BLE001
      msg = {"error": f"{type(e).__name__}: {e}"[:2000], "type": type(e).__name__}
    reply(msg)


# The part of this file above the next banner is copied into the sandbox as the runner.
if __name__ == "__main__" and sys.argv[1:] == ["runner"]:
  _runner_main()
  sys.exit(0)


# ----------------------------------------------------------------------------------------------
# The parent side: jobs, slots, the isolated command line, batch runs.
# ----------------------------------------------------------------------------------------------

import dataclasses  # noqa: E402 - parent-only imports: the runner starts faster without them
import subprocess  # noqa: E402
from typing import Any  # noqa: E402


class SandboxUnavailableError(RuntimeError):
  """Isolation cannot be set up here (not root, util-linux missing, interpreter unusable...)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits and placement of sandboxed runs. Sizes are in bytes, times in seconds."""

  python: str | None = None  # sandbox interpreter; None: $GPPO_SANDBOX_PYTHON or auto-detected
  timeout_s: float = 5.0  # wall-clock per test case (check jobs: for the whole check)
  memory_bytes: int = 1 << 30  # RLIMIT_AS per process
  max_processes: int = 16  # RLIMIT_NPROC for the slot's uid (threads count too)
  max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE
  max_open_files: int = 64  # RLIMIT_NOFILE
  max_output_bytes: int = 1 << 20  # captured stdout (or one reply) per case
  tmpfs_bytes: int = 64 << 20  # size of the private /tmp
  num_slots: int = 2  # concurrent runs, one uid each
  uid_base: int = 64100  # slot uids are leased from [uid_base, uid_base + uid_count)
  uid_count: int = 400
  lock_dir: str | None = None  # where uid leases are locked; None: <tempdir>/gppo_sandbox_uids
  allow_unsafe: bool = False  # run without isolation when it is unavailable (warns loudly)
  startup_s: float = 10.0  # slack for starting the namespace and interpreters


@dataclasses.dataclass(frozen=True)
class StdioCase:
  stdin: str = ""
  expected: str | None = None  # None: only run, do not judge


@dataclasses.dataclass(frozen=True)
class CallCase:
  args: tuple = ()
  kwargs: dict = dataclasses.field(default_factory=dict)
  expected: Any = None
  judge: bool = True  # False: only return the value
  accept_unwrapped: bool = False  # see `call_result_matches`


@dataclasses.dataclass(frozen=True)
class Job:
  """One program and its test cases. Build with `Job.stdio`, `Job.call` or `Job.check`."""

  program: str
  mode: str
  cases: tuple = ()
  fn: str = ""
  test_code: str = ""
  setup_code: str = ""
  check_fn: str = "check"
  stop_on_failure: bool = False
  timeout_s: float | None = None

  @classmethod
  def stdio(cls, program: str, cases, stop_on_failure: bool = False, timeout_s=None) -> Job:
    """Runs `program` as a script once per case, feeding `stdin` and judging stdout."""
    return cls(program, "stdio", tuple(cases), stop_on_failure=stop_on_failure, timeout_s=timeout_s)

  @classmethod
  def call(cls, program: str, fn: str, cases, stop_on_failure: bool = False, timeout_s=None) -> Job:
    """Imports `program` once and calls `fn(*args, **kwargs)` per case; results judged here."""
    return cls(
      program, "call", tuple(cases), fn=fn, stop_on_failure=stop_on_failure, timeout_s=timeout_s
    )

  @classmethod
  def check(
    cls,
    program: str,
    entry_point: str,
    test_code: str,
    setup_code: str = "",
    check_fn: str = "check",
    timeout_s=None,
  ) -> Job:
    """HumanEval style: trusted `setup_code` + `test_code` call `check_fn(candidate)`, where
    `candidate` forwards to `entry_point` of `program` in a separate process."""
    return cls(
      program,
      "check",
      (),
      fn=entry_point,
      test_code=test_code,
      setup_code=setup_code,
      check_fn=check_fn,
      timeout_s=timeout_s,
    )


@dataclasses.dataclass
class CaseResult:
  status: Status
  stdout: str | None = None  # stdio jobs
  value: Any = None  # call jobs: the decoded return value
  detail: str = ""
  time_s: float = 0.0


@dataclasses.dataclass
class RunResult:
  """`status` is OK when every case ran OK, else the first non-OK case status (or infra error)."""

  status: Status
  cases: list[CaseResult]
  detail: str = ""
  wall_s: float = 0.0

  @property
  def num_passed(self) -> int:
    return sum(c.status == Status.OK for c in self.cases)


_TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")

# Runs as root, PID 1 of fresh namespaces, on the skeleton root `_make_root` built: binds the
# directories named in its arguments (/usr, /etc, the interpreter's prefix...) read-only and a few
# device nodes, mounts a private size-limited /tmp, /dev/shm and /proc, makes the root read-only,
# and starts the runner in it as the slot uid. Not via exec: the runner must not be PID 1, which
# ignores default-action signals, and when this shell exits the kernel kills whatever is left.
_SETUP_SCRIPT = r"""
H="$1"; U="$2"; PY="$3"; CPU="$4"; AS="$5"; NPROC="$6"; FSIZE="$7"; NOFILE="$8"; TMPFS="$9"
shift 9
fail() { echo "gppo-sandbox-setup: $1" >&2; exit 97; }
R="$H/root"
mount --bind "$R" "$R" || fail "bind the new root"
for d in "$@"; do
  mount --bind "$d" "$R$d" && mount -o remount,bind,ro,nosuid,nodev "$R$d" || fail "bind $d"
done
for n in null zero full random urandom; do
  mount --bind "/dev/$n" "$R/dev/$n" || fail "bind /dev/$n"
done
mount -t tmpfs -o "size=$TMPFS,mode=1777,nosuid,nodev" gppo-tmp "$R/tmp" || fail "mount /tmp"
mount -t tmpfs -o size=1048576,mode=1777,nosuid,nodev gppo-shm "$R/dev/shm" || fail "/dev/shm"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc" || fail "mount /proc"
mount -o remount,bind,ro,nosuid,nodev "$R" || fail "remount the new root read-only"
chroot "$R" /usr/bin/setpriv --reuid="$U" --regid="$U" --clear-groups --no-new-privs \
  --inh-caps=-all --bounding-set=-all -- /usr/bin/prlimit --cpu="$CPU" --as="$AS" \
  --nproc="$NPROC" --fsize="$FSIZE" --nofile="$NOFILE" --core=0 -- \
  "$PY" -I -B /gppo_runner.py runner
"""
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _make_root(root: str, runner_src: str, python: str) -> list[str]:
  """Builds the skeleton of the sandbox's root filesystem in `root` (plain directories, links
  and files made here, so the namespace set-up needs few commands); returns the host
  directories to bind into it read-only."""
  binds = ["/usr", "/etc"]
  for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
    host = "/" + d
    if os.path.islink(host):
      os.symlink(os.readlink(host), os.path.join(root, d))
    elif os.path.isdir(host):
      binds.append(host)
  binds += [d for d in _interpreter_dirs(python) if d not in binds]
  for d in ("tmp", "proc", "dev/shm", *(b.lstrip("/") for b in binds)):
    os.makedirs(os.path.join(root, d), mode=0o755, exist_ok=True)
  for n in _DEVICES:
    open(os.path.join(root, "dev", n), "w").close()
  for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
    os.symlink("/proc/self/fd" + target, os.path.join(root, "dev", name))
  with open(os.path.join(root, "gppo_runner.py"), "w", encoding="utf-8") as f:
    f.write(runner_src)
  os.chmod(root, 0o755)
  return binds


def _other_executable(path: str) -> bool:
  """Whether other users may execute `path` once its prefix is bound into the sandbox (the file
  and its directory need the x bit for others; the parents outside the prefix do not matter)."""
  import stat

  real = os.path.realpath(path)
  try:
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in (real, os.path.dirname(real)))
  except OSError:
    return False


def _interpreter_dirs(python: str) -> list[str]:
  """Directories to bind into the sandbox's root for `python` (its prefix, outside /usr)."""
  real = os.path.realpath(python)
  prefix = os.path.dirname(os.path.dirname(real))
  if real.startswith("/usr/") or prefix in ("", "/"):
    return []
  return [prefix]


def find_sandbox_python(configured: str | None = None) -> str | None:
  """The interpreter for sandboxed code: configured, $GPPO_SANDBOX_PYTHON, a system python3, or
  the one running this (its install prefix is bound read-only into the sandbox; -I keeps any
  venv's packages out)."""
  if configured:
    return configured
  env = os.environ.get("GPPO_SANDBOX_PYTHON")
  if env:
    return env
  for p in (*_PYTHON_CANDIDATES, sys.executable):
    if os.path.exists(p) and _other_executable(p):
      return p
  return None


class _UidLease:
  """Exclusive use of one uid across processes on this machine, via an flock'ed file."""

  def __init__(self, lock_dir: str, lo: int, count: int, taken: set[int]):
    import fcntl
    import pwd

    self.fd = -1
    for uid in range(lo, lo + count):
      if uid in taken:
        continue
      try:
        pwd.getpwuid(uid)
        continue  # a real account: its files would be reachable
      except KeyError:
        pass
      fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        os.close(fd)
        continue
      if _processes_of(uid):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        continue
      self.fd, self.uid = fd, uid
      return
    raise SandboxUnavailableError(
      f"no free sandbox uid in [{lo}, {lo + count}); raise SandboxConfig.uid_count"
    )

  def release(self) -> None:
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1


def _processes_of(uid: int) -> list[int]:
  """Pids of processes with `uid` as real or effective uid (from /proc/PID/status, which is
  right for non-dumpable processes too, unlike the owner of /proc/PID)."""
  pids = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/status") as f:
          uids = next(ln for ln in f if ln.startswith("Uid:")).split()[1:3]
      except (OSError, StopIteration):
        continue
      if str(uid) in uids:
        pids.append(int(name))
  return pids


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
  """Reads stdout (up to `cap`) and the last 8 KiB of stderr until EOF or the deadline;
  returns them and why reading stopped early ("", "timeout" or "cap")."""
  sel = selectors.DefaultSelector()
  for f in (proc.stdout, proc.stderr):
    os.set_blocking(f.fileno(), False)
    sel.register(f, selectors.EVENT_READ)
  out, err = bytearray(), bytearray()
  try:
    while sel.get_map():
      left = deadline - time.monotonic()
      if left <= 0:
        return bytes(out), bytes(err), "timeout"
      for key, _ in sel.select(min(left, 1.0)):
        data = os.read(key.fileobj.fileno(), 65536)
        if not data:
          sel.unregister(key.fileobj)
        elif key.fileobj is proc.stdout:
          out += data
          if len(out) > cap:
            return bytes(out), bytes(err), "cap"
        else:
          err += data
          del err[: max(0, len(err) - 8192)]
    return bytes(out), bytes(err), ""
  finally:
    sel.close()


class Sandbox:
  """A pool of `num_slots` sandbox slots (one uid each); `run` and `run_many` are thread-safe.

  Use as a context manager or call `close()` to release the uid leases.
  """

  def __init__(self, config: SandboxConfig | None = None):
    import queue
    import tempfile
    import warnings

    self.config = cfg = config or SandboxConfig()
    src = open(os.path.abspath(__file__), encoding="utf-8").read()
    self._runner_src = src[: src.index("# " + "-" * 94 + "\n# The parent side")]
    self._tmp = tempfile.gettempdir()
    self._leases: list[_UidLease] = []
    self._slots: queue.Queue = queue.Queue()
    self.python = find_sandbox_python(cfg.python)
    self.tools = {t: _which(t) for t in ("unshare", "setpriv", "prlimit", "mount", "chroot")}
    for t in ("setpriv", "prlimit"):  # run from inside the new root
      if self.tools[t] and not os.path.realpath(self.tools[t]).startswith("/usr/bin/"):
        self.tools[t] = None
    problem = self._isolation_problem()
    self.isolated = problem is None
    if self.isolated:
      try:
        self._lease_uids()
        probe = self.run(Job.stdio("print('ok')", [StdioCase("", "ok")]))
        if probe.status != Status.OK:
          problem = f"probe run failed ({probe.status.value}): {probe.detail}"
      except SandboxUnavailableError as e:
        problem = str(e)
      if problem is not None:
        self.close()
        self.isolated = False
    if problem is not None:
      if not cfg.allow_unsafe:
        raise SandboxUnavailableError(
          f"code sandbox unavailable: {problem}. Run as root with util-linux (unshare, setpriv, "
          "prlimit) and a python3 other users can execute (SandboxConfig.python or "
          "$GPPO_SANDBOX_PYTHON), or pass allow_unsafe=True to run untrusted code WITHOUT isolation"
        )
      self.python = cfg.python or sys.executable
      msg = (
        f"UNSAFE: running untrusted code WITHOUT namespace/uid isolation ({problem}); "
        "only resource limits and a process group protect this machine"
      )
      warnings.warn(msg, RuntimeWarning, stacklevel=2)
      print("WARNING: gppo_jax.sandbox: " + msg, file=sys.stderr)
      for i in range(cfg.num_slots):
        self._slots.put(i)

  def _isolation_problem(self) -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
      return "not running as root (needed for namespaces and distinct uids)"
    missing = [t for t, p in self.tools.items() if p is None]
    if missing:
      return f"missing tools {missing} (Debian package util-linux / mount)"
    if self.python is None:
      return f"no python3 other users can execute among {(*_PYTHON_CANDIDATES, sys.executable)}"
    if not os.path.exists("/bin/sh"):
      return "no /bin/sh"
    return None

  def _lease_uids(self) -> None:
    import tempfile

    cfg = self.config
    lock_dir = cfg.lock_dir or os.path.join(tempfile.gettempdir(), "gppo_sandbox_uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    st = os.lstat(lock_dir)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not os.path.isdir(lock_dir):
      raise SandboxUnavailableError(f"lock dir {lock_dir} must be a directory owned by us, 0700")
    taken: set[int] = set()
    for _ in range(cfg.num_slots):
      lease = _UidLease(lock_dir, cfg.uid_base, cfg.uid_count, taken)
      taken.add(lease.uid)
      self._leases.append(lease)
      self._slots.put(lease.uid)

  @property
  def uids(self) -> list[int]:
    """The uids this pool runs programs as (empty when not isolated)."""
    return [lease.uid for lease in self._leases]

  def close(self) -> None:
    for lease in self._leases:
      lease.release()
    self._leases.clear()
    import queue

    self._slots = queue.Queue()

  def __del__(self) -> None:
    try:
      self.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown
      pass

  def __enter__(self) -> Sandbox:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def run(self, job: Job) -> RunResult:
    """Runs one job in a free slot (blocks until one is free)."""
    slot = self._slots.get()
    try:
      return self._run_in_slot(job, slot)
    finally:
      self._slots.put(slot)

  def run_many(self, jobs: list[Job]) -> list[RunResult]:
    """Runs jobs concurrently in all slots; results in the order of `jobs`."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=self.config.num_slots) as ex:
      return list(ex.map(self.run, jobs))

  def _spec(self, job: Job, timeout_s: float) -> dict:
    cfg = self.config
    spec = {
      "mode": job.mode,
      "program": _clean(job.program),
      "fn": job.fn,
      "timeout_s": timeout_s,
      # CPU seconds of one program process; a call job's process serves every case.
      "cpu_s": timeout_s * (len(job.cases) + 1 if job.mode == "call" else 1) + 1,
      "max_output_bytes": cfg.max_output_bytes,
      "stop_on_failure": job.stop_on_failure,
      "isolated": self.isolated,
      "nonce": os.urandom(16).hex(),
    }
    if job.mode == "stdio":
      spec["cases"] = [{"stdin": _clean(c.stdin), "expected": c.expected} for c in job.cases]
    elif job.mode == "call":
      spec["cases"] = []
      for c in job.cases:
        d = {"args": encode_value(tuple(c.args)), "kwargs": encode_value(dict(c.kwargs)),
             "unwrap": c.accept_unwrapped}  # fmt: skip
        if c.judge:
          d["expected"] = encode_value(c.expected)
        spec["cases"].append(d)
    elif job.mode == "check":
      spec.update(test_code=job.test_code, setup_code=job.setup_code, check_fn=job.check_fn)
    else:
      raise ValueError(f"unknown job mode {job.mode!r}; valid: stdio, call, check")
    return spec

  def _command(self, hostdir: str, slot: int, cpu_s: int, binds: list[str]) -> list[str]:
    cfg = self.config
    limits = [str(cpu_s), str(cfg.memory_bytes)]
    if not self.isolated:
      return [
        self.tools["prlimit"] or "prlimit",
        f"--cpu={cpu_s}",
        f"--as={cfg.memory_bytes}",
        f"--fsize={cfg.max_file_bytes}",
        f"--nofile={cfg.max_open_files}",
        "--core=0",
        "--",
        self.python,
        "-I",
        "-B",
        os.path.join(hostdir, "box", "gppo_runner.py"),
        "runner",
      ]
    return [
      self.tools["unshare"], "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc",
      "--uts", "--mount-proc", "--propagation", "private", "--", "/bin/sh", "-c", _SETUP_SCRIPT,
      "gppo-sandbox", hostdir, str(slot), os.path.realpath(self.python), *limits,
      str(cfg.max_processes), str(cfg.max_file_bytes), str(cfg.max_open_files),
      str(cfg.tmpfs_bytes), *binds,
    ]  # fmt: skip

  def _run_in_slot(self, job: Job, slot: int) -> RunResult:
    import shutil
    import tempfile

    cfg = self.config
    t0 = time.monotonic()
    timeout_s = job.timeout_s or cfg.timeout_s
    n_units = 1 + (len(job.cases) if job.mode != "check" else 1)
    budget = cfg.startup_s + timeout_s * n_units + 1.0
    spec = self._spec(job, timeout_s)
    hostdir = tempfile.mkdtemp(prefix="gppo_sbx_", dir=self._tmp)
    try:
      if self.isolated:
        os.mkdir(os.path.join(hostdir, "root"))
        binds = _make_root(os.path.join(hostdir, "root"), self._runner_src, self.python)
      else:
        binds = []
        os.mkdir(os.path.join(hostdir, "box"))
        with open(os.path.join(hostdir, "box", "gppo_runner.py"), "w", encoding="utf-8") as f:
          f.write(self._runner_src)
      spec["workdir"] = "/tmp" if self.isolated else os.path.join(hostdir, "box")
      spec_path = os.path.join(hostdir, "spec.json")
      with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
      if not self.isolated:
        os.chmod(hostdir, 0o700)
      try:
        with open(spec_path, "rb") as spec_f:
          proc = subprocess.Popen(
            self._command(hostdir, slot, int(math.ceil(budget)), binds),
            stdin=spec_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={"PATH": _TOOL_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
            cwd=os.path.join(hostdir, "box") if not self.isolated else hostdir,
            start_new_session=True, close_fds=True,
          )  # fmt: skip
      except OSError as e:
        return RunResult(Status.INFRA_ERROR, [], f"cannot start the sandbox: {e}")
      try:
        # JSON may escape each output byte into six (control characters).
        cap = (6 * cfg.max_output_bytes + 8192) * max(1, len(job.cases)) + (1 << 20)
        out, err, cut = _read_capped(proc, t0 + budget, cap)
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
          pass
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    finally:
      shutil.rmtree(hostdir, ignore_errors=True)
    res = self._parse(job, spec["nonce"], out, err, cut, proc.returncode, time.monotonic() - t0)
    res.wall_s = time.monotonic() - t0
    return res

  def _parse(self, job, nonce, out, err, cut, rc, elapsed) -> RunResult:
    err_s = err.decode("utf-8", "replace")[-2000:]
    text = out.decode("utf-8", "replace")
    payload = None
    for line in text.split("\n"):
      if line.startswith(nonce + " "):
        payload = line[len(nonce) + 1 :]
    if payload is None:
      if cut == "timeout" and _STARTED in text:
        return RunResult(Status.TIMEOUT, [], "the run exceeded its overall time budget")
      if cut == "cap":
        return RunResult(Status.INFRA_ERROR, [], "the runner's report exceeded its size cap")
      if _STARTED not in text:
        return RunResult(Status.INFRA_ERROR, [], f"sandbox did not start (rc {rc}): {err_s}")
      if rc is not None and rc > 128 or rc is not None and rc < 0:
        return RunResult(
          Status.RUNTIME_ERROR,
          [],
          f"the sandbox runner was killed (rc {rc}), presumably by the program",
        )
      return RunResult(Status.INFRA_ERROR, [], f"sandbox runner failed (rc {rc}): {err_s}")
    try:
      raw = json.loads(payload)["cases"]
      cases = [self._judge(job, i, r) for i, r in enumerate(raw)]
    except (ValueError, KeyError, TypeError) as e:
      return RunResult(Status.INFRA_ERROR, [], f"malformed runner result: {e}")
    bad = [c.status for c in cases if c.status != Status.OK]
    return RunResult(bad[0] if bad else Status.OK, cases)

  def _judge(self, job: Job, i: int, r: dict) -> CaseResult:
    """Re-judges a case here in the parent from the data the runner sent back."""
    status = Status(r["status"])
    c = CaseResult(status, detail=str(r.get("detail", "")), time_s=float(r.get("time_s", 0.0)))
    if status in (Status.OK, Status.WRONG_ANSWER) and job.mode == "stdio":
      c.stdout = str(r["stdout"])
      exp = job.cases[i].expected
      c.status = Status.OK if exp is None or outputs_match(c.stdout, exp) else Status.WRONG_ANSWER
    elif status in (Status.OK, Status.WRONG_ANSWER) and job.mode == "call":
      c.value = decode_value(r["value"])
      case = job.cases[i]
      ok = not case.judge or call_result_matches(c.value, case.expected, case.accept_unwrapped)
      c.status = Status.OK if ok else Status.WRONG_ANSWER
    return c


def _clean(text: str) -> str:
  """Text the runner can write as UTF-8 (model output may hold lone surrogates)."""
  return text.encode("utf-8", "replace").decode("utf-8")


def _which(tool: str) -> str | None:
  import shutil

  return shutil.which(tool, path=_TOOL_PATH)
