"""Test set-up (before jax is imported anywhere): 8 simulated CPU devices, unoptimised (fast)
compiles, and one JAX persistent compilation cache for the whole session, its subprocesses and its
xdist workers.

Most of a tiny training run's time on CPU is XLA compiling the same programs again: the preemption
chain runs one config six times in six processes, the sweep four runs of one shape, the learning
tests one sampler four times. With the cache, each program compiles once per session (a smoke
child then spends most of its time running rather than compiling). Tracing is unchanged, so
chex.assert_max_traces and trace counts still see every retrace.

The folder is a fresh temporary one per session (never a cache left by another checkout or
version), removed at exit. A subprocess inherits it through the environment; a test that builds its
child's environment from scratch passes these variables on (test_multihost). Set
GPPO_TEST_JAX_CACHE=off to run without it, or to a folder to keep one across sessions.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# The suite compiles far more than it runs: hundreds of programs, most executed a few times on
# tiny shapes. Two XLA settings make compiling cheaper without changing what a program computes
# (the same operations, emitted and optimised differently; users' commands never set them):
# - no LLVM optimisation passes: ~2/3 of the compile time (the gradient-accumulation and
#   trust-region tests 69 s -> 43 s);
# - fusions emitted by XLA's older elemental emitter instead of its fusion emitters: a further
#   ~1/4 of the suite's CPU time (the staleness, reuse and preemption-chain tests 239 s -> 183 s
#   of CPU, 176 s -> 144 s wall). Recent XLA may drop this flag, and an unknown XLA flag aborts
#   the process, so it is used only where a child process accepts it (probed once per session).
# GPPO_TEST_XLA_OPT=1 tests the optimised build, as users run it, instead.
FAST_COMPILE = "--xla_backend_optimization_level=0"
LEGACY_EMITTER = "--xla_cpu_use_fusion_emitters=false"


def _compile_flags() -> str:
  if os.environ.get("GPPO_TEST_XLA_OPT"):
    return ""
  if "GPPO_TEST_COMPILE_FLAGS" not in os.environ:  # probed by this session's first process
    probe = subprocess.run(
      [sys.executable, "-c", "import jax; jax.devices()"],
      env=dict(os.environ, XLA_FLAGS=LEGACY_EMITTER, JAX_PLATFORMS="cpu"),
      capture_output=True,
    )
    flags = FAST_COMPILE + (" " + LEGACY_EMITTER if probe.returncode == 0 else "")
    os.environ["GPPO_TEST_COMPILE_FLAGS"] = flags  # inherited by xdist workers and children
  return os.environ["GPPO_TEST_COMPILE_FLAGS"]


COMPILE_FLAGS = _compile_flags()


def all_eqns(jaxpr):
  """The equations of a jaxpr and of every jaxpr nested in them (scan, remat, pjit ...)."""
  from jax.extend.core import jaxprs_in_params  # not at import: jax must come after XLA_FLAGS

  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jaxprs_in_params(eqn.params):
      yield from all_eqns(sub)


def load_config(name: str, arg: str | None = None):
  """configs/<name>'s config (name with or without .py), as `--config=configs/<name>:<arg>`
  builds it."""
  import importlib.util  # noqa: PLC0415

  name = name.removesuffix(".py")
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
  spec = importlib.util.spec_from_file_location(name, os.path.join(path, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def read_checkpoint_item(path: str):
  """A saved checkpoint item (e.g. `<workdir>/checkpoints/<step>/state`) read back as host numpy
  arrays: what a test compares, with no device placement (so no sharding to infer)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415

  checkpointer = ocp.PyTreeCheckpointer()
  meta = checkpointer.metadata(path)
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return checkpointer.restore(path, restore_args=args)


def one_device_env() -> dict[str, str]:
  """The environment for a child command on one CPU device (no simulated devices), with the
  session's compile flags and compilation cache."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=COMPILE_FLAGS, JAX_PLATFORMS="cpu")
  return env


os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
for flag in COMPILE_FLAGS.split():
  if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:  # a user's own setting wins
    os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _session_folder(prefix: str) -> str:
  """A fresh temporary folder for this session, removed at exit by the process that made it only
  (xdist workers and children inherit its name through the environment)."""
  path = tempfile.mkdtemp(prefix=prefix)
  pid = os.getpid()
  atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))
  return path


def _set_up_compilation_cache():
  choice = os.environ.get("GPPO_TEST_JAX_CACHE", "")
  if choice == "off":
    os.environ["GPPO_XLA_CACHE"] = "off"  # nor the commands' own cache in ~/.cache
    return
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return  # already set: by the user, or by the xdist controller for its workers
  if choice:
    path = os.path.abspath(os.path.expanduser(choice))
  else:
    path = _session_folder("gppo_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  # Programs that take over half a second to compile (the updates, samplers, warm-start steps:
  # nearly all of the compile time); caching every tiny jit costs more in writes than it saves.
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
  # A size limit turns on JAX's file lock around each read and write, so processes that fill
  # the cache at the same moment (the sweep's jobs, the multi-host pair) never read a half-written
  # entry. 4 GiB is far above a session's use (~100 MB).
  os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(4 << 30)


_set_up_compilation_cache()


def _set_up_warmstart_cache():
  """One warm-start cache for the session, its workers and its children (the folder's name in
  GPPO_WARMSTART_CACHE, the default of every config's warmstart.cache_dir): the many smoke runs of
  one config train its warm start once (~3 s each time on 2 cores) instead of once per run. Fresh
  per session, so no entry made by other code is ever loaded; a GPPO_WARMSTART_CACHE set by the
  user wins ("off": every run trains its own)."""
  if "GPPO_WARMSTART_CACHE" not in os.environ:
    os.environ["GPPO_WARMSTART_CACHE"] = _session_folder("gppo_jax_test_warmstart_")


_set_up_warmstart_cache()


# The files that take longest (their tests' durations summed in a `--durations` run of the whole
# suite), longest first. xdist hands each worker whole files in collection order
# (`--no-loadscope-reorder` in pyproject.toml; its default order, most tests first, leaves these
# few-but-long files to the end, where one worker can end up running them alone: a guard on the
# session's tail; a session bound by its CPU time on two cores ends no sooner for it).
LONGEST_FILES = (
  "test_multihost.py",
  "test_continuous.py",
  "test_train.py",
  "test_sweep.py",
  "test_user_xla.py",
  "test_benchmarks.py",
  "test_paged_pallas.py",
  "test_stream.py",
  "test_lora.py",
  "test_recipe_e2e.py",
  "test_async.py",
  "test_preemption.py",
  "test_moe.py",
  "test_staleness.py",
)


def pytest_collection_modifyitems(items):
  """Longest files first (`LONGEST_FILES`), the rest after them in their usual order: with two
  workers taking whole files, the session ends on short files."""
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's in-memory compiled programs after each test file. Each CPU executable keeps its
  own LLVM code mappings, and one process running many files (the whole suite as CI runs it, or
  an xdist worker's share with `-n 2`) otherwise ends past the kernel's limit on memory mappings
  (vm.max_map_count, 65530 by default), where LLVM aborts with "Unable to allocate section
  memory". Programs a later file needs again come back from the session's persistent compilation
  cache."""
  yield
  if "jax" in sys.modules:
    import gc

    sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def policy():
  """The "tiny" architecture with Qwen3's extras (q/k biases, qk-norm) and random weights drawn on
  the host (no init compile), every norm near 1 so that biases and norms are non-trivial too."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from gppo_jax.models import architectures, model

  cfg = architectures.get("tiny", attention_bias=True, qk_norm=True, family="qwen3")
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(1)
  draw = lambda x: jnp.asarray(0.15 * rng.standard_normal(x.shape), x.dtype)
  state = jax.tree.map(draw, abstract)
  for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
    state["layers"][name].set_value(state["layers"][name].get_value() + 1.0)
  state["final_norm"].set_value(state["final_norm"].get_value() + 1.0)
  return nnx.merge(graphdef, state)
