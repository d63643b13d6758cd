"""Host side of the code sandbox: jobs, slots, the isolated command line, batch runs.

Isolation (as root, the default): every run gets fresh Linux namespaces from `unshare` (network with
no interfaces up, PID with its own /proc, mount, IPC, UTS), a chroot into a minimal read-only root
with private size-limited tmpfs mounts on /tmp and /dev/shm, and a scrubbed environment. Each
concurrent slot leases two unprivileged uids of its own: the trusted runner (`runner.py`, copied
whole into the root as /gppo/runner.py, with the program as /gppo/solution.py) runs as the
*runner* uid with only CAP_SETUID/CAP_SETGID, and starts every program process as the *program*
uid under `prlimit` limits (CPU, address space, processes, file size, open files, no core dumps)
that apply to the program alone. The program therefore cannot signal, trace or limit the runner,
and shares no writable place with it; see `runner.py` for what the runner does between cases and
what it denies (kernel keyrings). The parent only ever starts a command line (no `preexec_fn`, no
Python in a forked child), so it is safe to call from a multithreaded (JAX) trainer. When PID 1
of the namespace exits or is SIGKILLed on timeout, the kernel kills everything left inside it.

Job modes:
- stdio jobs: a fresh interpreter per case runs the program as a script; its stdout is captured
  up to a cap, its stderr tail kept for the error message;
- call jobs: one program process imports the program and answers calls with serialised results,
  decoded into plain builtins and judged in the runner and again here (no `__eq__` tricks, no
  objects cross);
- check jobs (HumanEval style): trusted setup and test code run in the runner and call
  `candidate`, a proxy that forwards each call to the program's process, so the program never
  shares a process with the test and cannot patch it, exit early on its behalf or swallow its
  assertions.
The runner reports one line tagged with a per-run random nonce the program never sees.

Statuses: see `Status`. Whatever the program does is judged as the program's outcome (wrong
answer, runtime error, timeout, memory, output limit). `INFRA_ERROR` means the sandbox itself
failed (it could not start, the runner died or reported nonsense, the test data cannot be run):
such a run is neither a pass nor a fail, and each one is counted in `Sandbox.infra_errors` and
logged as a warning.

Filesystem: the program sees a minimal read-only root (/usr, /etc, the /bin and /lib links, the
interpreter's prefix, a few devices, /proc, /gppo) and a private writable /tmp and /dev/shm,
emptied between cases; /work, /home, /root and any dataset with expected outputs are not there,
so it cannot read its own tests.

Interpreter: `SandboxConfig.python`, else $GPPO_SANDBOX_PYTHON, else /usr/bin/python3 or
/usr/local/bin/python3, else the one running this; an interpreter outside /usr gets its install
prefix bound read-only (under /root it would otherwise not be executable by the slot uids: exit
126). A probe run at construction checks the whole chain.

Without root (or without util-linux) construction fails closed with `SandboxUnavailableError`
unless `allow_unsafe=True`, which runs with resource limits and a process group only, and warns.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from gppo_jax.rewards.sandbox.runner import (
  STARTED,
  Status,
  call_result_matches,
  decode_value,
  encode_value,
  outputs_match,
)

logger = logging.getLogger(__name__)

RUNNER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")


class SandboxUnavailableError(RuntimeError):
  """Isolation cannot be set up here (not root, util-linux missing, interpreter unusable...)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits and placement of sandboxed runs. Sizes are in bytes, times in seconds."""

  python: str | None = None  # sandbox interpreter; None: $GPPO_SANDBOX_PYTHON or auto-detected
  timeout_s: float = 5.0  # wall-clock per test case (check jobs: for the whole check)
  memory_bytes: int = 1 << 30  # RLIMIT_AS per process
  max_processes: int = 16  # RLIMIT_NPROC for the slot's program uid (threads count too)
  max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE
  max_open_files: int = 64  # RLIMIT_NOFILE
  max_output_bytes: int = 1 << 20  # captured stdout (or one reply) per case
  tmpfs_bytes: int = 64 << 20  # size of the private /tmp
  num_slots: int = 2  # concurrent runs, two uids each (the runner's, the program's)
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
# and starts the runner in it as the runner uid, with CAP_SETUID and CAP_SETGID only (ambient, so
# that they survive the exec; the runner clears the ambient set at once). Not via exec: the runner
# must not be PID 1, which ignores default-action signals, and when this shell exits the kernel
# kills whatever is left.
_SETUP_SCRIPT = r"""
H="$1"; U="$2"; PY="$3"; TMPFS="$4"
shift 4
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
  --inh-caps=-all,+setuid,+setgid --ambient-caps=-all,+setuid,+setgid \
  --bounding-set=-all,+setuid,+setgid -- "$PY" -I -B /gppo/runner.py run
"""
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _runner_source() -> str:
  with open(RUNNER_PATH, encoding="utf-8") as f:
    return f.read()


def _write_box(box: str, runner_src: str, program: str) -> None:
  """/gppo in the sandbox: the runner, copied whole, and the program, both read-only there."""
  os.makedirs(box, mode=0o755)
  for name, text in (("runner.py", runner_src), ("solution.py", program)):
    with open(os.path.join(box, name), "w", encoding="utf-8") as f:
      f.write(text)
    os.chmod(os.path.join(box, name), 0o644)
  os.chmod(box, 0o755)


def _make_root(root: str, runner_src: str, program: str, python: str) -> list[str]:
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
  _write_box(os.path.join(root, "gppo"), runner_src, program)
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


@dataclasses.dataclass(frozen=True)
class _Slot:
  """One concurrent slot: the uid its runner runs as and the uid its programs run as (None
  when not isolated)."""

  index: int
  runner_uid: int | None = None
  program_uid: int | None = None


class Sandbox:
  """A pool of `num_slots` sandbox slots (two uids each); `run` and `run_many` are thread-safe.

  Use as a context manager or call `close()` to release the uid leases. `infra_errors` counts
  the runs that ended in `Status.INFRA_ERROR` (each is also logged as a warning).
  """

  def __init__(self, config: SandboxConfig | None = None):
    import queue
    import tempfile
    import warnings

    self.config = cfg = config or SandboxConfig()
    self._runner_src = _runner_source()
    self._tmp = tempfile.gettempdir()
    self._leases: list[_UidLease] = []
    self._slots: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self.infra_errors = 0
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
      print("WARNING: gppo_jax.rewards.sandbox: " + msg, file=sys.stderr)
      for i in range(cfg.num_slots):
        self._slots.put(_Slot(i))

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
    for i in range(cfg.num_slots):
      uids = []
      for _ in range(2):  # the runner's, the program's
        lease = _UidLease(lock_dir, cfg.uid_base, cfg.uid_count, taken)
        taken.add(lease.uid)
        self._leases.append(lease)
        uids.append(lease.uid)
      self._slots.put(_Slot(i, *uids))

  @property
  def uids(self) -> list[int]:
    """Every uid this pool leased, runners' and programs' (empty when not isolated)."""
    return [lease.uid for lease in self._leases]

  @property
  def program_uids(self) -> list[int]:
    """The uids programs run as, one per slot (empty when not isolated)."""
    return self.uids[1::2]

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
      res = self._run_in_slot(job, slot)
    finally:
      self._slots.put(slot)
    if res.status == Status.INFRA_ERROR:
      with self._lock:
        self.infra_errors += 1
      logger.warning("code sandbox infrastructure error (%s job): %s", job.mode, res.detail)
    return res

  def run_many(self, jobs: list[Job]) -> list[RunResult]:
    """Runs jobs concurrently in all slots; results in the order of `jobs`."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=self.config.num_slots) as ex:
      return list(ex.map(self.run, jobs))

  def _spec(self, job: Job, timeout_s: float) -> dict:
    cfg = self.config
    spec = {
      "mode": job.mode,
      "fn": job.fn,
      "timeout_s": timeout_s,
      # CPU seconds of one program process; a call job's process serves every case.
      "cpu_s": timeout_s * (len(job.cases) + 1 if job.mode == "call" else 1) + 1,
      "limits": {
        "as": cfg.memory_bytes,
        "nproc": cfg.max_processes,
        "fsize": cfg.max_file_bytes,
        "nofile": cfg.max_open_files,
      },  # fmt: skip
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

  def _command(self, hostdir: str, slot: _Slot, cpu_s: int, binds: list[str]) -> list[str]:
    cfg = self.config
    if not self.isolated:  # the limits go on the runner, and so on everything it starts
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
        os.path.join(hostdir, "box", "runner.py"),
        "run",
      ]
    return [
      self.tools["unshare"], "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc",
      "--uts", "--mount-proc", "--propagation", "private", "--", "/bin/sh", "-c", _SETUP_SCRIPT,
      "gppo-sandbox", hostdir, str(slot.runner_uid), os.path.realpath(self.python),
      str(cfg.tmpfs_bytes), *binds,
    ]  # fmt: skip

  def _run_in_slot(self, job: Job, slot: _Slot) -> RunResult:
    import shutil
    import tempfile

    cfg = self.config
    t0 = time.monotonic()
    timeout_s = job.timeout_s or cfg.timeout_s
    n_units = 1 + (len(job.cases) if job.mode != "check" else 1)
    budget = cfg.startup_s + timeout_s * n_units + 1.0
    if job.mode not in ("stdio", "call", "check"):
      raise ValueError(f"unknown job mode {job.mode!r}; valid: stdio, call, check")
    try:
      spec = self._spec(job, timeout_s)
    except (TypeError, ValueError) as e:  # test data we cannot send: the data's fault
      return RunResult(Status.INFRA_ERROR, [], f"cannot encode the job's test data: {e}")
    program = _clean(job.program)
    try:
      hostdir = tempfile.mkdtemp(prefix="gppo_sbx_", dir=self._tmp)
    except OSError as e:
      return RunResult(Status.INFRA_ERROR, [], f"cannot make the sandbox's directory: {e}")
    try:
      if self.isolated:
        os.mkdir(os.path.join(hostdir, "root"))
        binds = _make_root(os.path.join(hostdir, "root"), self._runner_src, program, self.python)
        spec.update(program_path="/gppo/solution.py", program_uid=slot.program_uid)
      else:
        binds = []
        box = os.path.join(hostdir, "box")
        _write_box(box, self._runner_src, program)
        spec.update(program_path=os.path.join(box, "solution.py"), workdir=box)
      spec_path = os.path.join(hostdir, "spec.json")
      with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
      if not self.isolated:
        os.chmod(hostdir, 0o700)
      with open(spec_path, "rb") as spec_f:
        proc = subprocess.Popen(
          self._command(hostdir, slot, int(math.ceil(budget)), binds),
          stdin=spec_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          env={"PATH": _TOOL_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
          cwd=os.path.join(hostdir, "box") if not self.isolated else hostdir,
          start_new_session=True, close_fds=True,
        )  # fmt: skip
    except OSError as e:
      shutil.rmtree(hostdir, ignore_errors=True)
      return RunResult(Status.INFRA_ERROR, [], f"cannot start the sandbox: {e}")
    try:
      # JSON may escape each output byte into six (control characters).
      cap = (6 * cfg.max_output_bytes + 16384) * max(1, len(job.cases)) + (1 << 20)
      out, err, cut = _read_capped(proc, t0 + budget, cap)
    finally:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except OSError:
        pass
      proc.wait()
      proc.stdout.close()
      proc.stderr.close()
      shutil.rmtree(hostdir, ignore_errors=True)
    res = self._parse(job, spec["nonce"], out, err, cut, proc.returncode)
    res.wall_s = time.monotonic() - t0
    return res

  def _parse(self, job, nonce, out, err, cut, rc) -> RunResult:
    err_s = err.decode("utf-8", "replace")[-2000:]
    text = out.decode("utf-8", "replace")
    payload = None
    for line in text.split("\n"):
      if line.startswith(nonce + " "):
        payload = line[len(nonce) + 1 :]
    if payload is None:
      if cut == "timeout" and STARTED in text:
        # The program cannot stop or slow the runner; what ran long is the program's (many
        # cases near their limits, a mess left in /tmp to clean) or the trusted test code's.
        return RunResult(Status.TIMEOUT, [], "the run exceeded its overall time budget")
      if cut == "cap":
        return RunResult(Status.INFRA_ERROR, [], "the runner's report exceeded its size cap")
      if STARTED not in text:
        return RunResult(Status.INFRA_ERROR, [], f"sandbox did not start (rc {rc}): {err_s}")
      # The program runs as another uid than the runner and cannot kill it: a runner that died
      # (or was killed, e.g. by the OOM killer) without a report is the sandbox's failure.
      return RunResult(Status.INFRA_ERROR, [], f"sandbox runner failed (rc {rc}): {err_s}")
    try:
      raw = json.loads(payload)["cases"]
      cases = [self._judge(job, i, r) for i, r in enumerate(raw)]
    except Exception as e:  # noqa: BLE001 - the runner judged these already: our failure
      return RunResult(Status.INFRA_ERROR, [], f"malformed runner result: {type(e).__name__}: {e}")
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
