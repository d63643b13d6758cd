"""Sandbox tests: plain runs, value encoding, and an adversarial suite that must be contained.

Needs root (namespaces, distinct uids), util-linux and a python3 other users can execute, as on
the CI machine. Every test checks afterwards that no process of the sandbox uids is left.
"""

import dataclasses
import json
import math
import os
import socket
import sys
import threading
import time

import pytest

from gppo_jax.rewards import sandbox as sbx
from gppo_jax.rewards.sandbox import (
  CallCase,
  Job,
  Sandbox,
  SandboxConfig,
  SandboxUnavailableError,
  Status,
  StdioCase,
  host,
  runner,
)

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the isolated sandbox needs root")

SMALL = SandboxConfig(
  timeout_s=2.0,  # generous: CI shares two cores; tests that expect a timeout pass 0.5
  memory_bytes=256 << 20,
  max_processes=12,
  max_output_bytes=64 << 10,
  tmpfs_bytes=8 << 20,
  num_slots=2,
)


@pytest.fixture(scope="module")
def sb():
  with Sandbox(SMALL) as s:
    yield s


@pytest.fixture(autouse=True)
def host_unchanged(request):
  """After each test: no leftover process of the sandbox uids, and this process alive."""
  yield
  if "sb" not in request.fixturenames:
    return
  s = request.getfixturevalue("sb")
  deadline = time.monotonic() + 3.0
  while any(host._processes_of(u) for u in s.uids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not [p for u in s.uids for p in host._processes_of(u)], "sandbox processes left behind"


def run1(sb, program, stdin="", expected=None, **kw):
  return sb.run(Job.stdio(program, [StdioCase(stdin, expected)], **kw))


# -- encoding and judging (no sandbox) -----------------------------------------------------------


def test_encode_decode_roundtrip_keeps_types():
  v = [
    (1, 2.5, "s", None, True),
    {1: "a", (2, 3): [4]},
    {5, 6},
    frozenset({7}),
    b"\x00\xff",
    float("inf"),
    3 + 4j,
    10**30,
    [],
  ]
  back = sbx.decode_value(json.loads(json.dumps(sbx.encode_value(v))))
  assert back == v
  assert type(back[0]) is tuple and type(back[2]) is set and type(back[3]) is frozenset
  nan = sbx.decode_value(sbx.encode_value(float("nan")))
  assert math.isnan(nan)


def test_encode_rejects_subclasses_and_objects():
  class Eq(int):
    def __eq__(self, other):
      return True

  for bad in (Eq(3), object(), [1, {2: object()}], print):
    with pytest.raises(TypeError):
      sbx.encode_value(bad)
  for bad in ({"$x": 1}, {"a": 1, "b": 2}, {"$t": 5}, {"$d": [[1]]}, {"$f": "1e5"}):
    with pytest.raises(ValueError):
      sbx.decode_value(bad)


def test_judges():
  assert sbx.outputs_match("1 2  \n3\n\n", "1 2\n3")
  assert not sbx.outputs_match("1 2\n3", "1 2 3")
  assert sbx.values_match((1, [2.0, 3]), [1, (2, 3)])
  assert sbx.values_match(0.1 + 0.2, 0.3) and not sbx.values_match(0.31, 0.3)
  assert not sbx.values_match(True, 1) and not sbx.values_match("1", 1)
  assert not sbx.values_match({1: 2}, {1: 3}) and not sbx.values_match([1], [1, 2])
  assert sbx.call_result_matches(3, [3], accept_unwrapped=True)
  assert not sbx.call_result_matches(3, [3]) and not sbx.call_result_matches([3], 3, True)


# -- plain runs -----------------------------------------------------------------------------------


@needs_root
def test_stdio_cases_judged_in_parent(sb):
  prog = "import sys\nprint(sum(map(int, sys.stdin.read().split())))"
  cases = [StdioCase("1 2", "3"), StdioCase("2 2", "5"), StdioCase("5 5\n", "10\n")]
  r = sb.run(Job.stdio(prog, cases))
  assert [c.status for c in r.cases] == [Status.OK, Status.WRONG_ANSWER, Status.OK]
  assert r.status == Status.WRONG_ANSWER and r.num_passed == 2
  assert r.cases[1].stdout == "4\n"
  r = sb.run(Job.stdio(prog, cases, stop_on_failure=True))
  assert len(r.cases) == 2


@needs_root
def test_call_and_check_modes(sb):
  prog = "def f(a, b=0):\n  return (a + b, {a: [b]}, {a})\n"
  cases = [CallCase((1,), {"b": 2}, (3, {1: [2]}, {1})), CallCase((1, 1), {}, (3, {}, set()))]
  r = sb.run(Job.call(prog, "f", cases))
  assert [c.status for c in r.cases] == [Status.OK, Status.WRONG_ANSWER]
  assert r.cases[1].value == (2, {1: [1]}, {1})
  missing = sb.run(Job.call(prog, "g", [CallCase((1,), {}, 1)]))
  assert missing.status == Status.RUNTIME_ERROR and "no function 'g'" in missing.cases[0].detail
  test = "def check(candidate):\n  assert candidate(1, 2)[0] == 3\n  assert f(2)[2] == {2}\n"
  assert sb.run(Job.check(prog, "f", test)).status == Status.OK
  bad = sb.run(Job.check(prog.replace("a + b", "a - b"), "f", test))
  assert bad.status == Status.WRONG_ANSWER
  # A candidate exception reaches the test as the same builtin type (tests may expect it).
  raising = "def f(x):\n  raise ValueError('no')\n"
  expects = "def check(c):\n  try:\n    c(1)\n  except ValueError:\n    return\n  assert False\n"
  assert sb.run(Job.check(raising, "f", expects)).status == Status.OK
  # Broken trusted test code or arguments that cannot be sent are the data's fault: infra.
  for test in ("def check(c):\n  assert c(1\n", "def check(c):\n  c(object())\n"):
    r = sb.run(Job.check(prog, "f", test))
    assert r.status == Status.INFRA_ERROR, r
  assert sb.run(Job.check(prog, "f", test, check_fn="nope")).status == Status.INFRA_ERROR


@needs_root
def test_runs_as_slot_uid_without_privileges(sb):
  prog = (
    "import os\n"
    "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
    "print(os.getuid(), os.getgid(), os.getgroups(), caps[0], os.getcwd(), sorted(os.environ))\n"
  )
  out = run1(sb, prog).cases[0].stdout.split(" ", 2)
  assert int(out[0]) in sb.program_uids and out[0] == out[1]
  assert out[2].startswith("[] 0000000000000000 /tmp/case0")
  assert "'HOME', 'LANG', 'LC_ALL', 'PATH'" in out[2]


@needs_root
def test_concurrent_slots_use_distinct_uids(sb):
  prog = "import os, time\ntime.sleep(0.3)\nprint(os.getuid())"
  runs = sb.run_many([Job.stdio(prog, [StdioCase()])] * 4)
  assert all(r.status == Status.OK for r in runs)
  assert {int(r.cases[0].stdout) for r in runs} == set(sb.program_uids)
  assert len(set(sb.program_uids)) == 2 and len(set(sb.uids)) == 4  # a runner uid per slot too


# -- the adversarial suite --------------------------------------------------------------------


@needs_root
def test_infinite_loop_times_out_in_every_mode(sb):
  t = time.monotonic()
  assert run1(sb, "while True: pass", timeout_s=0.5).status == Status.TIMEOUT
  loop = "def f(x):\n  while True: x += 1\n"
  r = sb.run(Job.call(loop, "f", [CallCase((1,), {}, 1)] * 3, timeout_s=0.5))
  assert [c.status for c in r.cases] == [Status.TIMEOUT] * 3  # dead after the first, no rerun
  test = "def check(c):\n  try:\n    c(1)\n  except Exception:\n    pass\n"
  assert sb.run(Job.check(loop, "f", test, timeout_s=0.5)).status == Status.TIMEOUT
  sleeper = "import time\ntime.sleep(100)"  # no CPU used: only the wall clock catches it
  assert run1(sb, sleeper, timeout_s=0.5).status == Status.TIMEOUT
  assert time.monotonic() - t < 30


@needs_root
def test_host_deadline_kills_the_whole_namespace():
  """A runner that hangs (here in trusted test code: the program cannot stop it) is stopped by
  the parent's own deadline (SIGKILL of the namespace's PID 1), leaving nothing behind."""
  cfg = dataclasses.replace(SMALL, num_slots=1, startup_s=1.0, timeout_s=0.5)
  with Sandbox(cfg) as s:
    freeze = "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(60)"
    r = run1(s, freeze)  # the program may not stop its runner (another uid): its own failure
    assert r.status == Status.RUNTIME_ERROR and "PermissionError" in r.cases[0].detail, r
    hang = "import time\ntime.sleep(60)\ndef check(c):\n  pass\n"
    r = s.run(Job.check("def f():\n  return 1\n", "f", hang))
    assert r.status == Status.TIMEOUT and "overall time budget" in r.detail, r
    deadline = time.monotonic() + 3.0
    while any(host._processes_of(u) for u in s.uids) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not [p for u in s.uids for p in host._processes_of(u)]


@needs_root
def test_fork_bomb_is_contained(sb):
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  r = run1(sb, bomb, timeout_s=1.0)
  assert r.status in (Status.TIMEOUT, Status.RUNTIME_ERROR)
  daemon = "import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\nprint('bye')"
  r = run1(sb, daemon, expected="bye")  # the orphan must be killed with the namespace
  assert r.status == Status.OK
  assert run1(sb, "print(1)", expected="1").status == Status.OK  # the slot still works


@needs_root
def test_memory_bomb(sb):
  r = run1(sb, "x = bytearray(2 * 1024**3)", timeout_s=3.0)
  assert r.status == Status.MEMORY
  grow = "def f():\n  a = []\n  while True:\n    a.append(bytearray(50 * 2**20))\n"
  r = sb.run(Job.call(grow, "f", [CallCase((), {}, 1)], timeout_s=3.0))
  assert r.status == Status.MEMORY


@needs_root
def test_huge_output(sb):
  r = run1(sb, "while True: print('x' * 1000)")
  assert r.status == Status.OUTPUT_LIMIT
  big = "def f():\n  return 'y' * 10**6\n"
  assert sb.run(Job.call(big, "f", [CallCase((), {}, "")])).status == Status.OUTPUT_LIMIT
  spam = "import sys\nwhile True: sys.stderr.write('z' * 10000)"  # stderr is drained, bounded
  assert run1(sb, spam, timeout_s=0.5).status == Status.TIMEOUT
  fill = "f = open('big', 'wb')\nwhile True: f.write(b'0' * 10**6)"  # RLIMIT_FSIZE / tmpfs size
  assert run1(sb, fill).status == Status.RUNTIME_ERROR


@needs_root
def test_output_near_the_cap_survives_escaping(sb):
  n = SMALL.max_output_bytes - 10
  r = run1(sb, f"import sys\nsys.stdout.write(chr(1) * {n} + 'é')")  # JSON: 6 bytes per char
  assert r.status == Status.OK and r.cases[0].stdout == "\x01" * n + "é"


def test_call_jobs_get_cpu_time_for_every_case():
  s = Sandbox.__new__(Sandbox)  # only the spec builder, no slots
  s.config, s.isolated = SMALL, True
  spec = s._spec(Job.call("p", "f", [CallCase()] * 7), 2.0)
  assert spec["cpu_s"] == 2.0 * 8 + 1 and spec["nonce"] != s._spec(Job.stdio("p", []), 2.0)["nonce"]
  assert s._spec(Job.stdio("p", [StdioCase()] * 7), 2.0)["cpu_s"] == 3.0


@needs_root
def test_writes_stay_inside_the_sandbox(sb, tmp_path):
  import tempfile

  open_dir = tempfile.mkdtemp(prefix="gppo_canary_", dir="/tmp")  # world-writable on the host
  try:
    os.chmod(open_dir, 0o777)
    canary = os.path.join(open_dir, "canary.txt")
    with open(canary, "w") as f:
      f.write("intact")
    os.chmod(canary, 0o666)
    private = tmp_path / "private_canary.txt"
    private.write_text("intact")
    escape = f"/tmp/gppo_escape_{os.getpid()}"
    targets = [canary, os.path.join(open_dir, "new.txt"), str(private), escape,
               "/var/tmp/gppo_escape", "/dev/shm/gppo_escape", "/etc/gppo_escape",
               os.path.join(os.getcwd(), "gppo_escape")]  # fmt: skip
    prog = (
      "import json\nres = {}\n"
      f"for t in {targets!r}:\n"
      "  try:\n"
      "    with open(t, 'w') as f:\n"
      "      f.write('pwned')\n"
      "    res[t] = 'written'\n"
      "  except OSError as e:\n"
      "    res[t] = type(e).__name__\n"
      "print(json.dumps(res))\n"
    )
    r = run1(sb, prog)
    assert r.status == Status.OK
    res = json.loads(r.cases[0].stdout)
    # Inside, /tmp is a private tmpfs: the write "works" but lands nowhere on the host.
    assert res[escape] == "written" and res[canary] == "FileNotFoundError"
    with open(canary) as f:
      assert f.read() == "intact"
    assert private.read_text() == "intact"
    assert os.listdir(open_dir) == ["canary.txt"]
    for t in targets[3:]:
      assert not os.path.exists(t), t
  finally:
    import shutil

    shutil.rmtree(open_dir)


@needs_root
def test_no_network(sb):
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("127.0.0.1", 0))
  server.listen(4)
  server.settimeout(0.2)
  port = server.getsockname()[1]
  accepted = []
  stop = threading.Event()

  def serve():
    while not stop.is_set():
      try:
        accepted.append(server.accept()[0])
      except OSError:
        pass

  th = threading.Thread(target=serve)
  th.start()
  try:
    probe = socket.create_connection(("127.0.0.1", port), timeout=2)  # reachable from here
    probe.close()
    time.sleep(0.3)
    n_before = len(accepted)
    prog = (
      "import socket\n"
      "try:\n"
      f"  socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
      "  print('connected')\n"
      "except OSError as e:\n"
      "  print('blocked', type(e).__name__)\n"
    )
    r = run1(sb, prog)
    assert r.status == Status.OK and r.cases[0].stdout.startswith("blocked")
    time.sleep(0.3)
    assert len(accepted) == n_before == 1
  finally:
    stop.set()
    th.join()
    server.close()
    for c in accepted:
      c.close()


@needs_root
def test_parent_environment_secrets_do_not_leak(sb, monkeypatch):
  secret = "gppo-fake-secret-" + os.urandom(8).hex()
  monkeypatch.setenv("GPPO_FAKE_SECRET", secret)
  prog = (
    "import os, glob\n"
    "print(dict(os.environ))\n"
    f"for p in ['/proc/1/environ', '/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ']"
    " + glob.glob('/proc/*/environ'):\n"
    "  try:\n"
    "    print(p, open(p, 'rb').read())\n"
    "  except OSError as e:\n"
    "    print(p, type(e).__name__)\n"
  )
  r = run1(sb, prog)
  assert r.status == Status.OK
  assert secret not in r.cases[0].stdout and "GPPO_FAKE_SECRET" not in r.cases[0].stdout
  assert "/proc/1/environ PermissionError" in r.cases[0].stdout


@needs_root
def test_cannot_kill_the_parent(sb):
  me = os.getpid()
  attempts = (
    "import os, signal\n"
    f"for pid in (1, {me}, {os.getppid()}):\n"
    "  try:\n"
    "    os.kill(pid, signal.SIGKILL)\n"
    "    print('killed', pid)\n"
    "  except OSError as e:\n"
    "    print('denied', pid, type(e).__name__)\n"
  )
  r = run1(sb, attempts)
  assert r.status == Status.OK and "killed" not in r.cases[0].stdout
  # Its parent is the in-sandbox runner, another uid: out of reach. kill -9 -1 reaches only the
  # program's own processes (and kills the program if it is among them).
  outcomes = {
    "import os\nos.kill(os.getppid(), 9)\nprint('alive')": Status.RUNTIME_ERROR,
    "import os\nos.kill(-1, 9)\nprint('alive')": Status.OK,
    "import os\nos.system('kill -9 -1')\nprint('alive')": Status.RUNTIME_ERROR,
  }
  for prog, status in outcomes.items():
    r = run1(sb, prog, expected="alive")
    assert r.status == status, (prog, r)
  assert run1(sb, "print(2)", expected="2").status == Status.OK
  os.kill(me, 0)  # still here


@needs_root
def test_reward_hacks_fail(sb):
  add = "def check(candidate):\n  assert candidate(1, 2) == 3\n  assert candidate(5, 5) == 10\n"
  cases = [CallCase((1, 2), {}, 3), CallCase((5, 5), {}, 10)]
  hacks = {
    "eq_true": "class A:\n  def __eq__(self, o): return True\n  __hash__ = None\n"
    "def add(a, b):\n  return A()\n",
    "int_subclass": "class I(int):\n  def __eq__(self, o): return True\n"
    "def add(a, b):\n  return I(0)\n",
    "exit_at_import": "import sys\nsys.exit(0)\ndef add(a, b):\n  return 0\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n  os._exit(0)\n",
    "exit_in_call": "import sys\ndef add(a, b):\n  sys.exit(0)\n",
    "forge_marker": (
      "import os, sys, glob\n"
      "line = '\\n' + '0' * 32 + ' ' + '{\"cases\": [{\"status\": \"ok\"}]}\\n'\n"
      f"print({runner.STARTED!r})\n"
      "for p in ['/dev/stdout', '/proc/1/fd/1'] + glob.glob('/proc/*/fd/*'):\n"
      "  try:\n"
      "    with open(p, 'w') as f:\n"
      "      f.write(line)\n"
      "  except OSError:\n"
      "    pass\n"
      "for p in glob.glob('/proc/*/mem') + glob.glob('/proc/*/fd/0'):\n"
      "  try:\n"
      "    open(p, 'rb').read(10)\n"
      "    print('READ', p, file=sys.stderr)\n"
      "  except OSError:\n"
      "    pass\n"
      "os.write(1, line.encode())\n"
      "def add(a, b):\n  print(line)\n  return None\n"
    ),
    "monkeypatch_builtins": (
      "import builtins, json, sys\n"
      "builtins.AssertionError = type('AE', (BaseException,), {})\n"
      "builtins.isinstance = lambda *a: True\n"
      "json.dumps = lambda *a, **k: '{\"ok\": 3}'\n"
      "sys.modules['json'] = None\n"
      "def add(a, b):\n  return a - b\n"
    ),
  }
  for name, prog in hacks.items():
    check = sb.run(Job.check(prog, "add", add))
    call = sb.run(Job.call(prog, "add", cases))
    assert check.status != Status.OK and check.status != Status.INFRA_ERROR, (name, check)
    assert call.num_passed < len(cases) and call.status != Status.INFRA_ERROR, (name, call)
  stdio = run1(sb, hacks["forge_marker"], expected="3")
  assert stdio.status == Status.WRONG_ANSWER and "READ" not in stdio.cases[0].detail


@needs_root
def test_fail_closed_and_explicit_unsafe_opt_out():
  no_uid = SandboxConfig(uid_base=0, uid_count=1, timeout_s=2.0)  # uid 0 exists: never leased
  with pytest.raises(SandboxUnavailableError, match="allow_unsafe"):
    Sandbox(no_uid)
  unsafe_cfg = SandboxConfig(uid_base=0, uid_count=1, timeout_s=2.0, allow_unsafe=True)
  with pytest.warns(RuntimeWarning, match="UNSAFE"), Sandbox(unsafe_cfg) as unsafe:
    assert not unsafe.isolated
    assert run1(unsafe, "print(6 * 7)", expected="42").status == Status.OK
    assert run1(unsafe, "while True: pass", timeout_s=0.5).status == Status.TIMEOUT


@needs_root
def test_host_files_are_not_visible(sb, tmp_path):
  """Only a minimal read-only root: no /work, /home, /root, no dataset with expected outputs."""
  dataset = tmp_path / "train.jsonl"
  dataset.write_text('{"tests": {"outputs": ["the answer"]}}')
  os.chmod(tmp_path, 0o755)
  prog = (
    "import os\n"
    "print(sorted(os.listdir('/')))\n"
    f"for p in [{__file__!r}, {str(dataset)!r}, '/root', '/work', '/home', '/etc/shadow']:\n"
    "  try:\n"
    "    print(p, os.listdir(p) if os.path.isdir(p) else open(p).read()[:20])\n"
    "  except OSError as e:\n"
    "    print(p, type(e).__name__)\n"
    "for p in ['/x', '/usr/x', '/etc/x']:\n"
    "  try:\n"
    "    open(p, 'w')\n"
    "    print(p, 'written')\n"
    "  except OSError as e:\n"
    "    print(p, e.errno)\n"
  )
  out = run1(sb, prog).cases[0].stdout.splitlines()
  top = set(eval(out[0]))
  allowed = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "etc", "proc", "tmp", "usr"}
  assert top <= allowed | {"gppo"}  # /gppo: the runner and the program, read-only
  assert {"dev", "proc", "tmp", "usr"} <= top
  assert out[1] == f"{__file__} FileNotFoundError" and out[2] == f"{dataset} FileNotFoundError"
  assert [ln.split()[1] for ln in out[3:6]] == ["FileNotFoundError"] * 3
  assert out[6] == "/etc/shadow PermissionError"
  assert all(ln.split()[1] in ("30", "13") for ln in out[7:]), out[7:]  # EROFS / EACCES


@needs_root
def test_interpreter_outside_usr_gets_its_prefix_bound():
  """The trainer's own interpreter (a venv under /root here) works: its prefix is bound."""
  with Sandbox(SandboxConfig(python=sys.executable, num_slots=1, timeout_s=5.0)) as s:
    r = run1(s, "import sys\nprint(sys.version_info[:2], 'jax' in sys.modules)")
  assert r.status == Status.OK and r.cases[0].stdout == f"{tuple(sys.version_info[:2])} False\n"
  with pytest.raises(SandboxUnavailableError, match="probe run failed"):
    Sandbox(SandboxConfig(python="/nonexistent/python3"))


def test_not_root_fails_closed(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(SandboxUnavailableError, match="not running as root"):
    Sandbox(SandboxConfig())


@needs_root
def test_missing_tools_fail_closed(monkeypatch):
  real = host._which
  monkeypatch.setattr(host, "_which", lambda t: None if t == "unshare" else real(t))
  with pytest.raises(SandboxUnavailableError, match="missing tools.*unshare"):
    Sandbox(SandboxConfig())


@needs_root
def test_broken_interpreter_is_an_infra_error(sb):
  good = sb.python
  try:
    sb.python = "/nonexistent/python3"
    r = run1(sb, "print(1)", expected="1")
  finally:
    sb.python = good
  assert r.status == Status.INFRA_ERROR and r.cases == []
