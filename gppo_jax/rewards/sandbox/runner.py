"""The in-sandbox runner, and the data format and judges it shares with the host.

This file is a standalone program for the sandbox's interpreter (which may differ from the
trainer's): it imports only the standard library, and the host copies it whole into the sandbox's
read-only root as /gppo/runner.py. The host (`sandbox.host`) imports it for `Status`,
the value encoding and the judges, so both sides read and judge results with the same code.

Two entry points, both run with `-I -B`:
- `runner.py run`: the trusted runner, started by the sandbox set-up as the slot's *runner* uid
  with exactly CAP_SETUID and CAP_SETGID. It reads its job spec on stdin, runs the program's
  processes as the slot's separate *program* uid and writes one report line, tagged with a
  per-run nonce, on stdout.
- `runner.py serve PROGRAM`: the program's side of the call protocol, started by the runner as
  the program uid: it loads PROGRAM and answers function calls with encoded results.

Why two uids: a process can signal, ptrace, read /proc of, and lower the resource limits of
any process of its own uid. The program runs as a uid of its own, so it cannot reach the runner
in any of those ways. The runner touches the program's processes and files only with the
program's own permissions (its effective uid switched to the program's for the duration):
between cases it kills every process of the program uid and empties /tmp and /dev/shm, so each
case starts with a fresh private working directory, and nothing the runner needs lives anywhere
the program can write. Resource limits (CPU, address space, processes, file size, open files,
no core dumps) are set by `prlimit` on each program process only, never on the runner. A seccomp
filter installed by the runner, inherited by everything it starts, denies the kernel keyring
system calls, the one per-uid kernel state that would otherwise outlive a run (a slot's uids
serve many runs; SysV IPC and POSIX message queues live in the run's own IPC namespace, /tmp
and /dev/shm in its own tmpfs mounts).

Anything the program sends that the runner cannot read, decode or judge fails the program's case
(runtime error or wrong answer); the runner reports `infra_error` only for its own trusted
inputs (broken test code, test arguments that cannot be sent).
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import selectors
import signal
import stat
import subprocess
import sys
import time


class Status(str, enum.Enum):
  """Outcome of one test case or one whole run."""

  OK = "ok"
  WRONG_ANSWER = "wrong_answer"
  TIMEOUT = "timeout"
  MEMORY = "memory"
  RUNTIME_ERROR = "runtime_error"
  OUTPUT_LIMIT = "output_limit"
  INFRA_ERROR = "infra_error"  # the sandbox failed: never count as a pass or a fail


STARTED = "gppo-sandbox-runner-started"  # first line the runner writes, before anything else
MAX_DEPTH = 100  # nesting of values from the program
REQUEST_DEPTH = 2 * MAX_DEPTH + 2  # test arguments may nest values the program returned


# -- encoding and judging (shared with the host) -----------------------------------------------


def encode_value(x: object, max_depth: int = MAX_DEPTH, _depth: int = 0) -> object:
  """Encodes plain Python data as JSON-able data; tuples, sets, bytes, non-str keys survive.

  Only exact builtin types are accepted (subclasses could carry `__eq__` tricks). Integers of any
  size survive (hexadecimal, which has no digit limit); so do inf and nan. Raises TypeError or
  ValueError for anything else, or for nesting deeper than `max_depth`.
  """
  if _depth > max_depth:
    raise ValueError("value nested too deeply to serialise")
  t = type(x)
  if x is None or t is bool or t is str:
    return x
  if t is int:
    return x if abs(x) < 2**53 else {"$i": hex(x)}
  if t is float:
    return x if math.isfinite(x) else {"$f": repr(x)}
  d = _depth + 1
  if t is list:
    return [encode_value(v, max_depth, d) for v in x]
  if t is tuple:
    return {"$t": [encode_value(v, max_depth, d) for v in x]}
  if t is dict:
    return {"$d": [[encode_value(k, max_depth, d), encode_value(v, max_depth, d)]
                   for k, v in x.items()]}  # fmt: skip
  if t is set or t is frozenset:
    return {"$s" if t is set else "$fs": [encode_value(v, max_depth, d) for v in x]}
  if t is bytes:
    return {"$b": x.hex()}
  if t is complex:
    return {"$c": [encode_value(x.real, max_depth, d), encode_value(x.imag, max_depth, d)]}
  raise TypeError(f"cannot serialise a value of type {t.__name__}")


def decode_value(obj: object, max_depth: int = MAX_DEPTH, _depth: int = 0) -> object:
  """Inverse of `encode_value`; rejects anything it did not produce (ValueError or TypeError)."""
  if _depth > max_depth:
    raise ValueError("value nested too deeply to decode")
  t = type(obj)
  if obj is None or t in (bool, int, float, str):
    return obj
  d = _depth + 1
  if t is list:
    return [decode_value(v, max_depth, d) for v in obj]
  if t is not dict or len(obj) != 1:
    raise ValueError(f"malformed encoded value of type {t.__name__}")
  ((tag, v),) = obj.items()
  if tag == "$i" and type(v) is str:
    return int(v, 16)
  if tag == "$f" and v in ("nan", "inf", "-inf"):
    return float(v)
  if tag == "$b" and type(v) is str:
    return bytes.fromhex(v)
  if type(v) is not list:
    raise ValueError(f"malformed encoded value with tag {tag!r}")
  if tag == "$t":
    return tuple(decode_value(e, max_depth, d) for e in v)
  if tag == "$s":
    return {decode_value(e, max_depth, d) for e in v}
  if tag == "$fs":
    return frozenset(decode_value(e, max_depth, d) for e in v)
  if tag == "$c" and len(v) == 2:
    re, im = (decode_value(e, max_depth, d) for e in v)
    if type(re) not in (int, float) or type(im) not in (int, float):
      raise ValueError("malformed complex value")
    try:
      return complex(re, im)
    except OverflowError as e:
      raise ValueError(f"malformed complex value: {e}") from None
  if tag == "$d" and all(type(p) is list and len(p) == 2 for p in v):
    return {decode_value(k, max_depth, d): decode_value(e, max_depth, d) for k, e in v}
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
      values_match(a, e, float_tol)
      for a, e in zip(actual, expected)  # noqa: B905 - lengths checked; runs on python < 3.10
    )
  if type(actual) is dict and type(expected) is dict:
    return actual.keys() == expected.keys() and all(
      values_match(actual[k], expected[k], float_tol) for k in actual
    )
  if type(actual) is float or type(expected) is float:
    if type(actual) in (int, float) and type(expected) in (int, float):
      try:
        a, e = float(actual), float(expected)
      except OverflowError:  # an int beyond the float range is close to no float
        return False
      if math.isnan(a) or math.isnan(e):
        return math.isnan(a) and math.isnan(e)
      return math.isclose(a, e, rel_tol=float_tol, abs_tol=float_tol)
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


# -- kernel interfaces (ctypes) -----------------------------------------------------------------

_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
_PRLIMIT = "/usr/bin/prlimit"
_CAP_SETGID, _CAP_SETUID = 6, 7


def _libc():
  import ctypes

  return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(ctypes, ret: int, what: str) -> None:
  if ret != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _set_nondumpable() -> None:
  """No core dumps, and /proc/PID of the runner owned by root (its memory holds the nonce)."""
  ctypes, libc = _libc()
  _check(ctypes, libc.prctl(4, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0)")


def _drop_inheritable_caps() -> None:
  """Empties the inheritable (hence ambient) capability set, so that nothing the runner executes
  gets a capability; checks that the runner holds CAP_SETUID and CAP_SETGID itself."""
  ctypes, libc = _libc()

  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Data(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]

  hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
  _check(ctypes, libc.capget(ctypes.byref(hdr), data), "capget")
  need = (1 << _CAP_SETUID) | (1 << _CAP_SETGID)
  if data[0].effective & need != need:
    raise RuntimeError("the sandbox runner lacks CAP_SETUID/CAP_SETGID (setpriv too old?)")
  data[0].inheritable = data[1].inheritable = 0
  _check(ctypes, libc.capset(ctypes.byref(hdr), data), "capset")
  with open("/proc/self/status") as f:
    amb = [ln.split()[1] for ln in f if ln.startswith("CapAmb:")]
  if amb and int(amb[0], 16):
    raise RuntimeError("ambient capabilities survived clearing the inheritable set")


# machine -> (AUDIT_ARCH_*, syscall numbers of add_key, request_key, keyctl, x32 bit or 0)
_KEYRING_SYSCALLS = {
  "x86_64": (0xC000003E, (248, 249, 250), 0x40000000),
  "aarch64": (0xC00000B7, (217, 218, 219), 0),
}


def _deny_keyrings() -> None:
  """Seccomp filter (inherited over fork and exec): the kernel keyring system calls fail with
  EPERM, and so does every system call made through another ABI (i386, x32), where the numbers
  differ. Keyrings are per uid and outlive processes: without this, a program could leave state
  (or use up the uid's key quota) for the next run in its slot."""
  ctypes, libc = _libc()
  machine = os.uname().machine
  if machine not in _KEYRING_SYSCALLS:
    raise RuntimeError(f"no keyring seccomp filter for {machine}: cannot isolate runs")
  arch, numbers, x32 = _KEYRING_SYSCALLS[machine]
  ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JMP|JGE|K, RET|K
  deny, allow = 0x00050000 | 1, 0x7FFF0000  # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
  prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0)]
  if x32:
    prog += [(jge, 0, 1, x32), (ret, 0, 0, deny)]
  for nr in numbers:
    prog += [(jeq, 0, 1, nr), (ret, 0, 0, deny)]
  prog.append((ret, 0, 0, allow))

  class Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]  # fmt: skip

  class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

  insns = (Insn * len(prog))(*(Insn(*i) for i in prog))
  fprog = Prog(len(prog), insns)
  _check(ctypes, libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
  _check(ctypes, libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _kill_tree(pid: int) -> None:
  """SIGKILLs a process and the process group it leads (it may not have called setsid yet)."""
  for kill, target in ((os.killpg, pid), (os.kill, pid)):
    try:
      kill(target, signal.SIGKILL)
    except OSError:
      pass


def _live_processes_of(uid: int) -> list[int]:
  """Pids (in this PID namespace) of processes with `uid` as real, effective or saved uid,
  zombies and this process excepted (zombies hold nothing and go when reaped)."""
  pids, me = [], str(os.getpid())
  for name in os.listdir("/proc"):
    if not name.isdigit() or name == me:
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        fields = dict(ln.split(":", 1) for ln in f if ":" in ln)
    except (OSError, ValueError):
      continue
    if fields.get("State", "").split()[:1] != ["Z"] and str(uid) in fields["Uid"].split()[:3]:
      pids.append(int(name))
  return pids


def _remove_tree(path: str) -> None:
  """Removes `path` whatever the program did to its modes (run with the program's uid)."""
  st = os.lstat(path)
  if stat.S_ISDIR(st.st_mode):
    os.chmod(path, 0o700)
    for name in os.listdir(path):
      _remove_tree(os.path.join(path, name))
    os.rmdir(path)
  else:
    os.unlink(path)


# -- the program's side of the sandbox, as the runner manages it ---------------------------------


class _Box:
  """Where, as whom and under which limits program processes run.

  Isolated: the program has a uid of its own; the runner keeps CAP_SETUID/CAP_SETGID to start
  processes as that uid and to act with its permissions (`_as_program`), and nothing else. Not
  isolated (`allow_unsafe`): everything runs as the caller, with the limits the host put on the
  runner.
  """

  def __init__(self, spec: dict):
    self.spec = spec
    self.isolated = bool(spec["isolated"])
    self.uid = spec.get("program_uid")
    if self.isolated:
      self.ruid, self.rgid = os.getuid(), os.getgid()
      if self.ruid == 0 or self.uid in (None, 0, self.ruid):
        raise RuntimeError(f"bad sandbox uids: runner {self.ruid}, program {self.uid}")
      _drop_inheritable_caps()
      _deny_keyrings()
    _set_nondumpable()

  @contextlib.contextmanager
  def _as_program(self):
    """Acts with the program uid's permissions: files made are its own, signals reach only its
    processes (and our real uid's: nothing else runs as the runner uid). Our real and saved uid
    stay the runner's, so meanwhile the program still cannot signal or inspect us."""
    os.setegid(self.uid)
    os.seteuid(self.uid)
    try:
      yield
    finally:
      os.seteuid(self.ruid)
      os.setegid(self.rgid)
      _set_nondumpable()  # an effective uid change resets the flag

  def kill_all(self) -> bool:
    """Kills every process of the program uid; False if some could not be stopped."""
    if not self.isolated:
      return True
    with self._as_program():
      for _ in range(500):
        try:
          os.kill(-1, signal.SIGKILL)  # everything we may signal, but PID 1 and ourselves
        except OSError:
          pass
        if not _live_processes_of(self.uid):
          return True
        time.sleep(0.002)
    return False

  def fresh_dir(self, name: str) -> tuple[str | None, str]:
    """A new, empty working directory for one program process, after every earlier program
    process is gone and /tmp and /dev/shm are emptied; (None, why) when the program left them
    in a state that prevents it (its own failure)."""
    if not self.isolated:
      path = os.path.join(self.spec["workdir"], name)
      try:
        os.makedirs(path)
      except OSError as e:  # the program runs as us here: it may have taken the name
        return None, f"cannot make the working directory: {e}"
      return path, ""
    if not self.kill_all():
      return None, "processes of the program could not be stopped"
    with self._as_program():
      try:
        for top in ("/tmp", "/dev/shm"):
          for entry in os.listdir(top):
            _remove_tree(os.path.join(top, entry))
        path = os.path.join("/tmp", name)
        os.mkdir(path, 0o755)  # the runner enters it (as its own uid) to start the process
        return path, ""
      except Exception as e:  # noqa: BLE001 - only the program writes there
        return None, f"the program left /tmp or /dev/shm unusable: {type(e).__name__}: {e}"

  def spawn(self, argv: list[str], cwd: str) -> subprocess.Popen:
    """Starts one program process in `cwd` with its limits, in a session of its own."""
    c = max(1, int(math.ceil(self.spec["cpu_s"])))
    kw: dict = {}
    if self.isolated:
      lim = self.spec["limits"]
      limits = [f"--cpu={c}:{c + 1}", f"--as={lim['as']}", f"--nproc={lim['nproc']}",
                f"--fsize={lim['fsize']}", f"--nofile={lim['nofile']}", "--core=0"]  # fmt: skip
      argv = [_PRLIMIT, *limits, "--", *argv]
      kw = {"user": self.uid, "group": self.uid, "extra_groups": []}
    proc = subprocess.Popen(
      argv,
      cwd=cwd,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      env=dict(_CHILD_ENV, HOME=cwd),
      start_new_session=True,
      close_fds=True,
      **kw,
    )
    if not self.isolated:  # the host's limits are on the runner already; CPU is per process
      import resource

      try:
        resource.prlimit(proc.pid, resource.RLIMIT_CPU, (c, c + 1))
      except OSError:
        pass  # already gone
    return proc

  def kill(self, proc: subprocess.Popen) -> None:
    """Kills a program process, its group and (isolated) every other process of the program."""
    if self.isolated:
      self.kill_all()
    else:
      _kill_tree(proc.pid)
    proc.wait()


class _Child:
  """One program process started by the runner, with a deadline and capped reads."""

  def __init__(self, box: _Box, proc: subprocess.Popen, spec: dict):
    self.box = box
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
          try:
            data = os.read(f.fileno(), 65536)
          except BlockingIOError:
            continue
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
    self.box.kill(self.proc)
    self.sel.close()
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


def _program_failure(detail: str) -> dict:
  return {"status": Status.RUNTIME_ERROR.value, "detail": detail[-1000:]}


# -- the three job modes ---------------------------------------------------------------------


def _run_stdio(spec: dict, box: _Box) -> list[dict]:
  results = []
  for i, case in enumerate(spec["cases"]):
    t0 = time.monotonic()
    cwd, why = box.fresh_dir(f"case{i}")
    if cwd is None:
      res = _program_failure(why)
    else:
      proc = box.spawn([sys.executable, "-I", "-B", spec["program_path"]], cwd)
      child = _Child(box, proc, spec)
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
  """Runner side of the call protocol: one program process (`serve`) answering calls."""

  def __init__(self, spec: dict, box: _Box, deadline: float):
    self.spec = spec
    self.dead: dict | None = None
    cwd, why = box.fresh_dir("call")
    if cwd is None:
      self.dead = _program_failure(why)
      raise _CandidateFailure(self.dead)
    argv = [sys.executable, "-I", "-B", os.path.abspath(__file__), "serve", spec["program_path"]]
    self.child = _Child(box, box.spawn(argv, cwd), spec)
    self._request(None, deadline)  # the program's import: {"ok": null} or an error

  def _request(self, msg: dict | None, deadline: float) -> object:
    if self.dead is not None:
      raise _CandidateFailure(self.dead)
    child = self.child
    child.buf.clear()
    data = b"" if msg is None else (json.dumps(msg) + "\n").encode("utf-8")
    why = child.pump(deadline, self.spec["max_output_bytes"], True, data)
    if not why and b"\n" not in child.buf:
      why = "eof"
    if why:
      child.kill()
      self.dead = child.failure("" if why == "eof" else why)
      if why == "eof" and self.dead["status"] == Status.RUNTIME_ERROR.value:
        self.dead["detail"] = "program exited without returning a result; " + self.dead["detail"]
      raise _CandidateFailure(self.dead)
    line = bytes(child.buf).split(b"\n", 1)[0]
    try:  # whatever the program sent that we cannot read is its failure, never ours
      reply = json.loads(line)
      if type(reply) is not dict:
        raise ValueError("the reply is not an object")
      if "ok" in reply:
        return decode_value(reply["ok"])
      err, etype = str(reply["error"])[-1000:], str(reply.get("type", ""))[:100]
    except Exception as e:  # noqa: BLE001 - RecursionError, OverflowError, MemoryError...
      err, etype = f"malformed reply from the program: {type(e).__name__}: {str(e)[:300]}", ""
    status = Status.MEMORY if etype == "MemoryError" else Status.RUNTIME_ERROR
    raise _CandidateFailure({"status": status.value, "detail": err, "type": etype})

  def call(self, fn: str, args: tuple, kwargs: dict, deadline: float) -> object:
    msg = {
      "fn": fn,
      "args": encode_value(tuple(args), REQUEST_DEPTH),
      "kwargs": encode_value(dict(kwargs), REQUEST_DEPTH),
    }
    return self._request(msg, deadline)

  def close(self) -> None:
    self.child.kill()


def _judge_call(value: object, case: dict) -> dict:
  """Judges a decoded return value; a value we cannot judge or report fails the case."""
  try:
    ok = "expected" not in case or call_result_matches(
      value, decode_value(case["expected"]), case["unwrap"]
    )
    status = Status.OK if ok else Status.WRONG_ANSWER
    return {"status": status.value, "value": encode_value(value)}
  except Exception as e:  # noqa: BLE001 - e.g. a comparison the value makes fail
    return _program_failure(f"cannot judge the returned value: {type(e).__name__}: {e}")


def _run_calls(spec: dict, box: _Box) -> list[dict]:
  results = []
  t0 = time.monotonic()
  try:
    chan = _Channel(spec, box, t0 + spec["timeout_s"])
  except _CandidateFailure as e:
    return [dict(e.res, time_s=time.monotonic() - t0)]
  try:
    for case in spec["cases"]:
      t0 = time.monotonic()
      try:
        args, kwargs = decode_value(case["args"]), decode_value(case["kwargs"])
        res = _judge_call(chan.call(spec["fn"], args, kwargs, t0 + spec["timeout_s"]), case)
      except _CandidateFailure as e:
        res = dict(e.res)
      res["time_s"] = time.monotonic() - t0
      results.append(res)
      if spec["stop_on_failure"] and res["status"] != Status.OK.value:
        break
  finally:
    chan.close()
  return results


def _as_builtin_exception(res: dict) -> Exception:
  """The program's exception as the builtin type it named (tests may expect it), else a
  RuntimeError; never a BaseException that is not an Exception."""
  names = __builtins__ if isinstance(__builtins__, dict) else vars(__builtins__)
  cls = names.get(res.get("type", ""))
  if isinstance(cls, type) and issubclass(cls, Exception):
    try:
      return cls(res["detail"])
    except Exception:  # noqa: BLE001 - needs other arguments (UnicodeError, ExceptionGroup...)
      pass
  return RuntimeError(res["detail"])


def _run_check(spec: dict, box: _Box) -> list[dict]:
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
      raise _as_builtin_exception(e.res) from None

  candidate.__name__ = spec["fn"]
  ns: dict = {"__name__": "__gppo_check__"}
  try:  # trusted code first: a broken test is the data's fault, never the program's
    exec(compile(spec["setup_code"], "<setup>", "exec"), ns)
    ns[spec["fn"]] = candidate  # tests may call the function by name as well
    exec(compile(spec["test_code"], "<test>", "exec"), ns)
    check = ns[spec["check_fn"]]
  except Exception as e:  # noqa: BLE001
    detail = f"setup/test code failed: {type(e).__name__}: {e}"[:1000]
    return [{"status": Status.INFRA_ERROR.value, "detail": detail, "time_s": 0.0}]
  try:
    chan = _Channel(spec, box, deadline)
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


# -- entry points ------------------------------------------------------------------------------


def _run() -> None:
  """The trusted runner: spec on stdin, one nonce-tagged report line on stdout."""
  out = os.fdopen(os.dup(1), "w", encoding="utf-8")
  out.write(STARTED + "\n")
  out.flush()
  spec = json.loads(sys.stdin.buffer.read())
  box = _Box(spec)
  devnull = os.open(os.devnull, os.O_RDWR)
  os.dup2(devnull, 0)
  os.dup2(2, 1)  # trusted test code that prints must not reach the report channel
  os.chdir("/")  # nowhere the program can write
  run = {"stdio": _run_stdio, "call": _run_calls, "check": _run_check}[spec["mode"]]
  results = run(spec, box)
  box.kill_all()
  report = json.dumps({"cases": results}, separators=(",", ":"))  # ASCII: lone surrogates too
  out.write("\n" + spec["nonce"] + " " + report + "\n")
  out.flush()


def _serve(path: str) -> None:
  """The program's side of the call protocol: load the program, then answer calls. Requests
  come on stdin, replies go to stdout; the program itself sees /dev/null on both."""
  sys.setrecursionlimit(10000)  # recursive solutions; the runner itself keeps the default
  chan_in = os.fdopen(os.dup(0), "rb")
  chan_out = os.fdopen(os.dup(1), "wb")
  devnull = os.open(os.devnull, os.O_RDWR)
  os.dup2(devnull, 0)
  os.dup2(devnull, 1)
  send, recv = chan_out.write, chan_in.readline
  dumps, loads, enc, dec = json.dumps, json.loads, encode_value, decode_value

  def reply(msg: dict) -> None:
    send((dumps(msg) + "\n").encode("utf-8"))
    chan_out.flush()

  ns: dict = {"__name__": "__solution__"}
  try:
    with open(path, encoding="utf-8") as f:
      code = compile(f.read(), path, "exec")
    exec(code, ns)
    reply({"ok": None})
  except BaseException as e:  # noqa: BLE001 - SystemExit at import time fails too
    reply({"error": f"{type(e).__name__}: {e}"[:2000], "type": type(e).__name__})
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
      args, kwargs = dec(req["args"], REQUEST_DEPTH), dec(req["kwargs"], REQUEST_DEPTH)
      msg = {"ok": enc(fn(*args, **kwargs))}
    except BaseException as e:  # noqa: BLE001
      msg = {"error": f"{type(e).__name__}: {e}"[:2000], "type": type(e).__name__}
    reply(msg)


if __name__ == "__main__":
  if sys.argv[1:] == ["run"]:
    _run()
  elif len(sys.argv) == 3 and sys.argv[1] == "serve":
    _serve(sys.argv[2])
  else:
    sys.exit(f"usage: {sys.argv[0]} run | serve PROGRAM")
