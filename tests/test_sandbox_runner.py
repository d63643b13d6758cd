"""The in-sandbox runner: its shape (a standard-library module copied whole) and the routes by
which a program could make the sandbox report the program's failure as its own (an
`infra_error`, which masks the sample instead of scoring it): state the program shares with
the runner (working area, resource limits, processes of one uid), values the runner cannot
encode or decode, and per-uid kernel state that outlives a run (keyrings, IPC, /dev/shm, /tmp).

Needs root, like tests/test_sandbox.py. Every test checks afterwards that no process of the
sandbox uids is left.
"""

import ast
import ctypes
import hashlib
import json
import logging
import os
import sys
import time

import pytest

from gppo_jax.rewards.sandbox import (
  CallCase,
  Job,
  Sandbox,
  SandboxConfig,
  Status,
  StdioCase,
  host,
  runner,
)

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the isolated sandbox needs root")
log = logging.getLogger(__name__)

CFG = SandboxConfig(
  timeout_s=3.0,  # generous: CI shares two cores
  memory_bytes=256 << 20,
  max_processes=12,
  max_output_bytes=64 << 10,
  tmpfs_bytes=8 << 20,
  num_slots=1,  # one slot: consecutive runs share its uids, as the persistence tests need
)
PROGRAM_STATUSES = {Status.OK, Status.WRONG_ANSWER, Status.RUNTIME_ERROR, Status.TIMEOUT,
                    Status.MEMORY, Status.OUTPUT_LIMIT}  # fmt: skip


@pytest.fixture(scope="module")
def sb():
  with Sandbox(CFG) as s:
    yield s


@pytest.fixture(autouse=True)
def nothing_left(request):
  """After each test: no leftover process of the sandbox uids, and no infrastructure error."""
  if "sb" not in request.fixturenames:
    yield
    return
  s = request.getfixturevalue("sb")
  before = s.infra_errors
  yield
  deadline = time.monotonic() + 3.0
  while any(host._processes_of(u) for u in s.uids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not [p for u in s.uids for p in host._processes_of(u)], "sandbox processes left behind"
  assert s.infra_errors == before


def stdio(sb, program, stdins, expected=None):
  expected = expected or [None] * len(stdins)
  return sb.run(
    Job.stdio(program, [StdioCase(i, e) for i, e in zip(stdins, expected, strict=True)])
  )


def run_out(sb, prog: str, stdin: str = "") -> str:
  r = stdio(sb, prog, [stdin])
  assert r.status == Status.OK, r
  return r.cases[0].stdout.strip()


# -- shape -------------------------------------------------------------------------------------


def test_runner_imports_only_the_standard_library():
  with open(runner.__file__, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      assert node.level == 0, "relative import in the runner"
      names.add(node.module.split(".")[0])
  assert names, "no imports found"
  assert names <= set(sys.stdlib_module_names) | {"__future__"}, names - set(
    sys.stdlib_module_names
  )


@needs_root
def test_runner_is_copied_whole_and_runs_as_another_uid(sb):
  prog = (
    "import hashlib, os\n"
    "print(hashlib.sha256(open('/gppo/runner.py', 'rb').read()).hexdigest())\n"
    "status = open(f'/proc/{os.getppid()}/status').read()\n"
    "print(os.getuid(), [l.split()[1] for l in status.splitlines() if l.startswith('Uid')][0])\n"
    "import resource\n"
    "print(resource.getrlimit(resource.RLIMIT_NPROC), resource.getrlimit(resource.RLIMIT_AS))\n"
    "try:\n"
    "  open('/gppo/runner.py', 'a')\n"
    "except OSError as e:\n"
    "  print(e.errno)\n"
  )
  out = stdio(sb, prog, [""]).cases[0].stdout.splitlines()
  with open(runner.__file__, "rb") as f:
    assert out[0] == hashlib.sha256(f.read()).hexdigest()
  program_uid, runner_uid = map(int, out[1].split())
  assert program_uid in sb.program_uids and runner_uid in sb.uids and runner_uid != program_uid
  assert out[2] == f"(12, 12) ({256 << 20}, {256 << 20})"  # the limits are the program's
  assert out[3] in ("13", "30")  # EACCES / EROFS: the runner cannot be changed


# -- (a) the working area ----------------------------------------------------------------------

WRECK = r"""
import os, sys, time
if sys.stdin.read().strip() == "check":
  print(sorted(os.listdir("/tmp")), os.listdir("/dev/shm"), os.getcwd(), os.listdir("."))
  sys.exit(0)
for name in ("case1", "case2", "call", "x"):  # squat the next cases' names, locked
  os.makedirs(f"/tmp/{name}/deep/er")
  os.chmod(f"/tmp/{name}/deep", 0)
  os.chmod(f"/tmp/{name}", 0)
os.symlink("/gppo/runner.py", "/tmp/link")
os.mkfifo("/tmp/fifo")
for top in ("/tmp", "/dev/shm"):  # fill both
  try:
    with open(top + "/fill", "wb") as f:
      while True:
        f.write(b"0" * 65536)
  except OSError:
    pass
if os.fork() == 0:  # and keep squatting from a leftover process
  os.setsid()
  while True:
    for name in ("case1", "case2", "call"):
      try:
        os.mkdir(f"/tmp/{name}", 0)
      except OSError:
        pass
    time.sleep(0.001)
try:
  os.chmod(".", 0)  # its own working directory (already locked if it was a squatted name)
except OSError:
  pass
print("wrecked")
"""


@needs_root
def test_a_wrecked_working_area_does_not_reach_the_next_case(sb):
  fresh = [f"['case{i}'] [] /tmp/case{i} []" for i in (1, 2)]
  r = stdio(sb, WRECK, ["wreck", "check", "check"], ["wrecked", *fresh])
  assert [c.status for c in r.cases] == [Status.OK] * 3, r
  # Call and check jobs: the runner needs nothing the program can fill or lock.
  prog = WRECK.replace('sys.stdin.read().strip() == "check"', "False").replace("sys.exit", "print")
  prog = prog.replace('print("wrecked")', 'def f(x):\n  return sorted(os.listdir("/tmp"))[:1]')
  r = sb.run(Job.call(prog, "f", [CallCase((1,), {}, ["call"])] * 2))
  assert r.status == Status.OK, r
  r = sb.run(Job.check(prog, "f", "def check(c):\n  assert c(1) == ['call']\n"))
  assert r.status == Status.OK, r


# -- (b) resource limits -----------------------------------------------------------------------

LOWER = r"""
import os, resource
def lower():
  got = set()
  for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    if pid == os.getpid():
      continue
    for name in ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE",
                 "RLIMIT_STACK", "RLIMIT_DATA"):
      try:
        resource.prlimit(pid, getattr(resource, name), (1, 1))
        got.add(f"lowered {pid} {name}")
      except OSError as e:
        got.add(type(e).__name__)
  return sorted(got)
"""


@needs_root
def test_the_program_cannot_lower_the_runners_limits(sb):
  prog = LOWER + "import sys\nif sys.stdin.read() == 'lower':\n  print(lower())\nelse:\n  print(7)"
  r = stdio(sb, prog, ["lower", "", ""], [None, "7", "7"])
  assert [c.status for c in r.cases] == [Status.OK] * 3, r
  assert "lowered" not in r.cases[0].stdout and "PermissionError" in r.cases[0].stdout
  # Call and check jobs: every call tries again; the runner keeps serving and judging.
  call = LOWER + "def f(x):\n  return [s for s in lower() if s.startswith('lowered')] or x\n"
  r = sb.run(Job.call(call, "f", [CallCase((i,), {}, i) for i in range(3)]))
  assert r.status == Status.OK, r
  r = sb.run(Job.check(call, "f", "def check(c):\n  for i in range(3):\n    assert c(i) == i\n"))
  assert r.status == Status.OK, r


# -- (c) processes of the same uid -------------------------------------------------------------

KILLER = r"""
import os, signal, sys, time
def rampage():
  if os.fork() == 0:  # a leftover that keeps at it
    os.setsid()
    while True:
      for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
        for sig in (signal.SIGSTOP, signal.SIGKILL):
          try:
            os.kill(pid, sig)
          except OSError:
            pass
      try:
        os.kill(-1, signal.SIGKILL)
      except OSError:
        pass
  time.sleep(0.5)
"""


@needs_root
def test_the_program_killing_its_uid_does_not_reach_the_runner(sb):
  prog = KILLER + "if sys.stdin.read() == 'kill':\n  rampage()\nprint(5)"
  r = stdio(sb, prog, ["kill", "", ""], [None, "5", "5"])
  assert r.cases[0].status in PROGRAM_STATUSES  # killed by its own leftover, most likely
  assert [c.status for c in r.cases[1:]] == [Status.OK] * 2, r
  # Call and check jobs: the leftover kills the program's own process (a runtime error).
  call = KILLER + "def f(x):\n  rampage()\n  return x\n"
  r = sb.run(Job.call(call, "f", [CallCase((i,), {}, i) for i in range(3)]))
  assert r.status in PROGRAM_STATUSES, r
  r = sb.run(Job.check(call, "f", "def check(c):\n  for i in range(3):\n    assert c(i) == i\n"))
  assert r.status in PROGRAM_STATUSES, r


# -- (d) values the runner cannot encode, decode or judge --------------------------------------


@needs_root
def test_unusual_return_values_are_judged_not_infra(sb):
  prog = (
    "def f(k):\n"
    "  if k == 'deep':\n"
    "    a = []\n"
    "    for _ in range(10**4):\n"
    "      a = [a]\n"
    "    return a\n"
    "  return {'surrogate': '\\ud800x', 'inf': float('inf'), 'nan': float('nan'),\n"
    "          'huge': 10**5000, '-huge': -10**5000, 'cpx': complex(1e308, float('inf'))}[k]\n"
  )
  cases = {
    "surrogate": ("\ud800x", Status.OK),
    "inf": (float("inf"), Status.OK),
    "nan": (float("nan"), Status.OK),
    "huge": (10**5000, Status.OK),
    "-huge": (-(10**5000), Status.OK),
    "cpx": (complex(1e308, float("inf")), Status.OK),
    "deep": (None, Status.RUNTIME_ERROR),  # nested too deeply to send: the program's failure
  }
  r = sb.run(Job.call(prog, "f", [CallCase((k,), {}, v) for k, (v, _) in cases.items()]))
  assert [c.status for c in r.cases] == [s for _, s in cases.values()], r
  assert r.cases[0].value == "\ud800x" and r.cases[3].value == 10**5000
  # A huge int is close to no float (it overflows the float conversion): a wrong answer.
  r = sb.run(Job.call(prog, "f", [CallCase(("huge",), {}, 1e308), CallCase(("inf",), {}, 10**400)]))
  assert [c.status for c in r.cases] == [Status.WRONG_ANSWER] * 2, r
  # Check jobs: the test may feed a returned value back (one level deeper than it came).
  echo = (
    "def f(x=None):\n"
    "  if x is None:\n"
    "    a = []\n"
    "    for _ in range(99):\n"
    "      a = [a]\n"
    "    return a\n"
    "  return x\n"
  )
  test = "def check(c):\n  v = c()\n  assert c(v) == v and c([v]) == [v]\n"
  r = sb.run(Job.check(echo, "f", test))
  assert r.status == Status.OK, r
  r = sb.run(Job.check(prog, "f", "def check(c):\n  assert c('huge') == 10**5000\n  c('deep')\n"))
  assert r.status == Status.RUNTIME_ERROR, r


FORGE = r"""
import fcntl, os, stat
def forge(line):
  for fd in range(3, 30):  # the reply channel is one of the program's own descriptors
    try:
      if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & 3 == 1:
        os.write(fd, line + b"\n")
    except OSError:
      pass
LINES = [
  b"[" * 20000 + b"]" * 20000,
  b'{"ok": ' + b"[" * 20000 + b"]" * 20000 + b"}",
  b'{"error": ' + b"[" * 20000 + b"]" * 20000 + b"}",
  b'{"ok": ' + b"9" * 5000 + b"}",
  b'{"ok": {"$c": [{"$i": "0x' + b"f" * 400 + b'"}, 0]}}',
  b'{"ok": {"$i": "zz"}}',
  b'{"ok": {"$d": [[[1], 2]]}}',
  b'{"ok": {"$s": [[1]]}}',
  b'{"ok": 1e999}',
  b'{"ok": "\\ud800"}',
  b'{"error": "\\udfff", "type": "UnicodeDecodeError"}',
  b'{"error": "x", "type": "SystemExit"}',
  b"\xff\xfe\n",
  b"[1]",
  b"",
]
def f(k):
  forge(LINES[k])
  return 0
"""


@needs_root
def test_forged_replies_are_the_programs_failure(sb):
  n = FORGE.count("\n  b")
  r = sb.run(Job.call(FORGE, "f", [CallCase((k,), {}, 1) for k in range(n)]))
  assert len(r.cases) == n and all(c.status in PROGRAM_STATUSES - {Status.OK} for c in r.cases), r
  assert r.cases[0].status == Status.RUNTIME_ERROR and "RecursionError" in r.cases[0].detail
  for k in (0, 2, 4, 10):
    test = (
      f"def check(c):\n  try:\n    c({k})\n  except Exception:\n    pass\n  assert c(13) == 1\n"
    )
    r = sb.run(Job.check(FORGE, "f", test))
    assert r.status in PROGRAM_STATUSES - {Status.OK}, (k, r)


# -- (e, f) per-uid kernel state between runs in one slot --------------------------------------

_KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
KEYRINGS = {"thread": -1, "process": -2, "session": -3, "user": -4, "user-session": -5}


def _keyctl_usable() -> str | None:
  """Why this kernel forbids keyctl entirely (then the keyring test has nothing to check)."""
  machine = os.uname().machine
  if machine not in _KEYCTL:
    return f"no keyctl syscall numbers for {machine}"
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.syscall(_KEYCTL[machine][1], 0, KEYRINGS["user"], 1) < 0:  # KEYCTL_GET_KEYRING_ID
    return f"keyctl fails here: {os.strerror(ctypes.get_errno())}"
  return None


KEYS = r"""
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, KEYCTL = {nrs}
rings = {rings}
out = {{}}
def log(name, r):
  out[name] = errno.errorcode.get(ctypes.get_errno(), "?") if r < 0 else "ok"
for name, ring in rings.items():
  if "{step}" == "write":
    log(name, libc.syscall(ADD_KEY, b"user", b"gppo_probe", b"secret", 6, ring))
  else:
    log(name, libc.syscall(KEYCTL, 10, ring, b"user", b"gppo_probe", 0))  # KEYCTL_SEARCH
log("join", libc.syscall(KEYCTL, 1, b"gppo_ring"))  # a named session keyring: JOIN_SESSION
if "{step}" == "write":
  log("named", libc.syscall(ADD_KEY, b"user", b"gppo_probe", b"secret", 6, rings["session"]))
else:
  log("named", libc.syscall(KEYCTL, 10, rings["session"], b"user", b"gppo_probe", 0))
print(json.dumps(out))
"""


@needs_root
def test_no_keyring_state_survives_a_run(sb):
  why = _keyctl_usable()
  if why:
    log.warning("keyring test skipped: %s", why)
    pytest.skip(why)
  nrs = _KEYCTL[os.uname().machine]
  write = run_out(sb, KEYS.format(nrs=nrs, rings=KEYRINGS, step="write"))
  read = run_out(sb, KEYS.format(nrs=nrs, rings=KEYRINGS, step="read"))
  log.info("keyrings: run 1 %s; run 2 %s", write, read)
  write, read = json.loads(write), json.loads(read)
  assert set(read) == {*KEYRINGS, "join", "named"}
  assert "ok" not in [v for k, v in read.items() if k != "join"], read  # nothing found
  # Programs cannot use keyrings at all (they are per uid and would outlive the run).
  assert set(write.values()) == {"EPERM"}, write


IPC = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
write = sys.stdin.read() == "write"
flag = 0o1000 | 0o600 if write else 0  # IPC_CREAT
res = {
  "shm": libc.shmget(0x6770, 4096, flag),
  "sem": libc.semget(0x6771, 1, flag),
  "msg": libc.msgget(0x6772, flag),
}
if hasattr(libc, "mq_open"):  # POSIX message queues (glibc >= 2.34 has them in libc)
  libc.mq_open.restype = ctypes.c_int
  res["mq"] = libc.mq_open(b"/gppo_probe", os.O_RDWR | (os.O_CREAT if write else 0), 0o600, None)
for path in ("/dev/shm/gppo_probe", "/tmp/gppo_probe"):
  if write:
    open(path, "w").write("x")
  res[path] = os.path.exists(path)
print(sorted(k for k, v in res.items() if v is not False and v != -1))
"""


@needs_root
def test_no_ipc_or_file_state_survives_a_run(sb):
  ipc = ["shm", "sem", "msg"] + (["mq"] if hasattr(ctypes.CDLL(None), "mq_open") else [])
  made = run_out(sb, IPC, "write")
  assert made == str(sorted([*ipc, "/dev/shm/gppo_probe", "/tmp/gppo_probe"]))
  assert run_out(sb, IPC) == "[]"  # a new run in the same slot (same uids): none of it
  # Within one run, /tmp and /dev/shm are emptied between cases (IPC stays the run's own).
  r = stdio(sb, IPC, ["write", "read"])
  assert r.status == Status.OK and r.cases[1].stdout.strip() == str(sorted(ipc)), r


# -- infrastructure errors are counted and logged ----------------------------------------------


@needs_root
def test_infra_errors_are_counted_and_logged(caplog):
  with Sandbox(CFG) as s:
    good = s.python
    s.python = "/nonexistent/python3"
    try:
      with caplog.at_level(logging.WARNING, logger="gppo_jax.rewards.sandbox.host"):
        r = s.run(Job.stdio("print(1)", [StdioCase()]))
    finally:
      s.python = good
    assert r.status == Status.INFRA_ERROR and s.infra_errors == 1
    assert "infrastructure error" in caplog.text and "did not start" in caplog.text
    assert s.run(Job.stdio("print(1)", [StdioCase("", "1")])).status == Status.OK
    assert s.infra_errors == 1
