"""Scale-out set-up: the device mesh, state and batch shardings, the sharded update, host input.

The shell calls these in order:

  maybe_initialize_distributed()             # multi-host: before any other jax call
  mesh = make_mesh(config.mesh)              # data x fsdp x tensor [x expert] (-1 = the rest)
  shardings = state_shardings(state, mesh)   # params by logical axes, optimizer state mirrors them
  state = jax.device_put(state, shardings)
  update = jit_update(update_fn, shardings, batch_shardings(batch, mesh))
  state, metrics = update(state, shard_batch(batch_np, mesh), rng)

Parameters are placed by the logical-axis rules of `partitioning.py`; batches are split on their
leading axis over `partitioning.BATCH_AXES` (data x fsdp, x expert where the mesh has it: a
mixture of experts' expert parallelism). Meshes use Auto axes: XLA propagates the
activation shardings from parameters and batch, and `partitioning.constrain_batch` pins a
batch-major activation where propagation alone would replicate it (e.g. after the minibatch
shuffle, a gather). Sampling on the mesh is `sampler.MeshSampler`, built on the helpers here.
"""

from __future__ import annotations

import collections
import functools
import io
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gppo_jax import errors, registry
from gppo_jax.models import partitioning

log = logging.getLogger(__name__)

MESH_AXES = partitioning.MESH_AXES  # ("data", "fsdp", "tensor")
EXPERT_AXIS = partitioning.EXPERT_AXIS  # a fourth axis where the mesh config asks for it
# Set to 1/true by the launch scripts on multi-host slices (see launch/README.md).
DISTRIBUTED_ENV = "GPPO_DISTRIBUTED"
_DISTRIBUTED_VARS = (
  ("JAX_COORDINATOR_ADDRESS", "coordinator_address", str),
  ("JAX_NUM_PROCESSES", "num_processes", int),
  ("JAX_PROCESS_ID", "process_id", int),
)


# --- Mesh --------------------------------------------------------------------------------------


# The fields of config.mesh that split the devices between sampling and training, not axes.
ROLLOUT_MESH_KEYS = ("rollout_devices", "rollout")


def mesh_axes(mesh_cfg: Mapping[str, int]) -> tuple[str, ...]:
  """The mesh's axes: MESH_AXES, then `expert` when the config asks for it (a size other than 1)."""
  unknown = sorted(set(mesh_cfg) - {*MESH_AXES, EXPERT_AXIS, *ROLLOUT_MESH_KEYS})
  if unknown:
    raise ValueError(f"mesh axes {unknown}: unknown; valid: {(*MESH_AXES, EXPERT_AXIS)}")
  if int(mesh_cfg.get(EXPERT_AXIS, 1)) != 1:
    return (*MESH_AXES, EXPERT_AXIS)
  return MESH_AXES


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """(data, fsdp, tensor[, expert]) sizes (`mesh_axes`) from a config mapping; at most one size
  may be -1 (the rest)."""
  sizes = []
  axes = mesh_axes(mesh_cfg)
  for name in axes:
    size = int(mesh_cfg.get(name, 1))
    if size == 0 or size < -1:
      raise ValueError(f"mesh.{name}={size}: sizes must be positive or -1 (the rest)")
    sizes.append(size)
  named = dict(zip(axes, sizes, strict=True))
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh {named}: at most one axis may be -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"mesh {named}: {num_devices} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    named = dict(zip(axes, sizes, strict=True))
    raise ValueError(f"mesh {named} needs {math.prod(sizes)} devices, found {num_devices}")
  return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices: Any = None) -> Mesh:
  """A (data, fsdp, tensor[, expert]) mesh over `devices` (default: all) with Auto axis types."""
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  axes = mesh_axes(mesh_cfg)
  auto = (jax.sharding.AxisType.Auto,) * len(axes)
  return jax.make_mesh(shape, axes, axis_types=auto, devices=devices)


def make_meshes(
  mesh_cfg: Mapping[str, Any], devices: Any = None, *, hosts: int | None = None
) -> tuple[Mesh, Mesh]:
  """(training mesh, sampling mesh). With `rollout_devices` = n > 0 the last n devices form the
  sampler's mesh (axes from `mesh_cfg["rollout"]`, by default all data) and the others the
  trainer's; with 0 both are one mesh over every device.

  On several processes n splits evenly over them: each process's last n / processes devices form
  its own sampler mesh (every device of it on this process, so sampling runs no cross-process
  collective and each host samples its share of a rollout: `async_rollout.HostShare`), and every
  process's other devices together form the training mesh. `hosts` (planning a slice on
  simulated devices): `devices` grouped into that many equal consecutive hosts instead of by
  process; the sampler mesh returned is the first host's."""
  devices = jax.devices() if devices is None else list(devices)
  n = int(mesh_cfg.get("rollout_devices", 0) or 0)
  if not n:
    mesh = make_mesh(mesh_cfg, devices)
    return mesh, mesh
  sampler_axes = {"data": -1, **mesh_cfg.get("rollout", {})}
  host_of = {d: d.process_index for d in devices}
  me = jax.process_index()
  if hosts:
    if len(devices) % hosts:
      raise errors.ConfigError(f"{len(devices)} devices do not split over {hosts} hosts")
    host_of = {d: i * hosts // len(devices) for i, d in enumerate(devices)}
    me = 0
  processes = sorted(set(host_of.values()))
  if len(processes) > 1:
    per_host = collections.defaultdict(list)
    for d in devices:
      per_host[host_of[d]].append(d)
    fewest = min(len(v) for v in per_host.values())
    if n % len(processes) or n // len(processes) >= fewest:
      raise errors.ConfigError(
        f"mesh.rollout_devices={n} on {len(processes)} hosts of {fewest} devices each: give "
        f"each host the same share of sampling devices (a multiple of {len(processes)}) and "
        f"leave each at least one to train on (at most {(fewest - 1) * len(processes)})"
      )
    k = n // len(processes)
    sampling = {p: v[len(v) - k :] for p, v in per_host.items()}
    trainer = [d for d in devices if d not in sampling[host_of[d]]]
    return make_mesh(mesh_cfg, trainer), make_mesh(sampler_axes, sampling[me])
  if n >= len(devices):
    raise errors.ConfigError(
      f"mesh.rollout_devices={n}: leaves no device to train on ({len(devices)} devices); "
      f"give sampling at most {len(devices) - 1}, or 0 to share all of them"
    )
  return (
    make_mesh(mesh_cfg, devices[: len(devices) - n]),
    make_mesh(sampler_axes, devices[len(devices) - n :]),
  )


def spans_processes(mesh: Mesh) -> bool:
  """Whether `mesh` has devices of another process (then its programs are collective across
  processes, and every process must run them in the same order)."""
  me = jax.process_index()
  return any(d.process_index != me for d in mesh.devices.flat)


def check_experts(cfg, mesh_sizes: Mapping[str, int]) -> None:
  """ConfigError unless the mesh's expert axis (size 1 when absent) splits the model's experts
  evenly: a model without experts takes no expert axis, and its size must divide num_experts."""
  n = int(mesh_sizes.get(EXPERT_AXIS, 1))
  if n == 1:
    return
  if not cfg.num_experts:
    raise errors.ConfigError(
      f"mesh.expert={n}: the model has no experts (num_experts=0); use mesh.expert=1"
    )
  if cfg.num_experts % n:
    raise errors.ConfigError(
      f"mesh.expert={n} does not divide the model's num_experts={cfg.num_experts}"
    )


_distributed_initialized = False


def maybe_initialize_distributed(environ: Mapping[str, str] | None = None) -> bool:
  """Calls `jax.distributed.initialize()` when GPPO_DISTRIBUTED=1 is set (the launch scripts set
  it on every worker of a multi-host slice). Returns whether it did (or had already).

  Entry points call it before parsing flags: a config file may compute with jax (the default
  radii do), and the backend must not start before `jax.distributed.initialize()`.

  On Cloud TPU (and SLURM / Open MPI) the coordinator, process count and id are discovered
  automatically; elsewhere set JAX_COORDINATOR_ADDRESS (host:port of process 0),
  JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process.
  """
  global _distributed_initialized
  environ = os.environ if environ is None else environ
  flag = environ.get(DISTRIBUTED_ENV, "").strip().lower()
  if flag in ("", "0", "false", "no"):
    return False
  if flag not in ("1", "true", "yes"):
    raise ValueError(f"{DISTRIBUTED_ENV}={flag!r}; use 1 (initialize) or 0 (single process)")
  if _distributed_initialized:
    return True
  if not environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
    # CPU processes (a laptop test of the multi-host path) talk over gloo; TPU and GPU ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs: dict[str, Any] = {}
  for env, arg, cast in _DISTRIBUTED_VARS:
    if environ.get(env):
      kwargs[arg] = cast(environ[env])
  jax.distributed.initialize(**kwargs)
  _distributed_initialized = True
  log.info(
    "jax.distributed: process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  return True


# --- Shardings ---------------------------------------------------------------------------------


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def state_shardings(state: Any, mesh: Mesh, rules: partitioning.Rules | None = None) -> Any:
  """NamedSharding pytree for a `train_step.TrainState` (concrete or abstract).

  Parameters (and LoRA's frozen base) follow their logical axes; every optimizer-state subtree
  shaped like the parameters (Adam's mu and nu, ...) gets the parameters' shardings; everything
  else (step, counts) is replicated.
  """
  rules = partitioning.DEFAULT_RULES if rules is None else rules
  params = partitioning.state_shardings(state.params, mesh, rules)
  params_def = jax.tree.structure(state.params)
  rep = replicated(mesh)

  def mirror(x):
    if jax.tree.structure(x) == params_def:
      return params
    return jax.tree.map(lambda _: rep, x)

  opt = jax.tree.map(mirror, state.opt_state, is_leaf=lambda x: jax.tree.structure(x) == params_def)
  out = state.replace(params=params, opt_state=opt, step=rep)
  if getattr(state, "frozen", None) is not None:  # LoRA's frozen base: by its logical axes
    out = out.replace(frozen=partitioning.state_shardings(state.frozen, mesh, rules))
  return out


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
  """NamedSharding pytree for a batch: leading axis over data x fsdp x expert (axes that are
  absent or do not divide it are dropped), scalars replicated. `batch` may hold arrays or
  ShapeDtypeStructs."""
  return jax.tree.map(
    lambda x: NamedSharding(mesh, partitioning.batch_spec(np.shape(x), mesh)), batch
  )


def shard_batch(batch_np: Any, mesh: Mesh) -> Any:
  """Host-local numpy rows -> global arrays sharded like `batch_shardings`.

  Each process passes the rows it holds (its slice of the global batch, process_count() slices of
  equal size); the global batch is their concatenation in process order. On one process this is a
  device_put of the whole batch.
  """
  n = jax.process_count()
  if n == 1 or not spans_processes(mesh):  # one transfer call for the tree, not one per leaf
    return jax.device_put(batch_np, batch_shardings(batch_np, mesh))

  def put(x):
    x = np.asarray(x)
    global_shape = (x.shape[0] * n, *x.shape[1:]) if x.ndim else ()
    sharding = NamedSharding(mesh, partitioning.batch_spec(global_shape, mesh))
    return jax.make_array_from_process_local_data(sharding, x, global_shape)

  return jax.tree.map(put, batch_np)


def process_rows(num_rows: int, mesh: Mesh) -> slice:
  """The rows of a global batch of `num_rows` that this process's devices hold under the batch
  sharding: what this process passes to `shard_batch` when every process has the whole batch."""
  if not spans_processes(mesh):  # this process's own mesh: all of them
    return slice(0, num_rows)
  sharding = NamedSharding(mesh, partitioning.batch_spec((num_rows,), mesh))
  index = sharding.addressable_devices_indices_map((num_rows,)).values()
  starts = sorted({sl[0].indices(num_rows)[:2] for sl in index})
  lo, hi = starts[0][0], starts[-1][1]
  if sum(b - a for a, b in starts) != hi - lo or (hi - lo) * jax.process_count() != num_rows:
    raise ValueError(
      f"this process's devices hold rows {starts} of {num_rows}: not one contiguous equal slice; "
      "order the mesh so that each host's devices are adjacent on data x fsdp"
    )
  return slice(lo, hi)


def to_host(tree: Any) -> Any:
  """Global (possibly multi-host) arrays -> full numpy arrays on every process."""
  if jax.process_count() == 1 or all(
    getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)
  ):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=True)


def global_max(value: int) -> int:
  """The largest of each process's `value` (the value itself on one process)."""
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils

  return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int32))))


# Bytes per value in jax.distributed's key-value store (its messages stay far below gRPC's limits).
_EXCHANGE_CHUNK = 32 * 2**20


def _coordination_client() -> Any:
  from jax._src import distributed  # noqa: PLC0415 (the one client jax.distributed holds)

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("exchanging host arrays across processes needs jax.distributed.initialize")
  return client


def exchange_host_arrays(
  arrays: Mapping[str, np.ndarray], tag: str, *, timeout_s: float = 3600.0
) -> list[dict[str, np.ndarray]]:
  """Every process's `arrays` (numpy, any shapes), in process order, this process's own included.

  Not a device collective: the bytes go through jax.distributed's key-value store (the
  coordination service), so any thread may call it while other threads run collective programs,
  with no order to keep between them. Every process calls it once with the same `tag`, which no
  other call uses (a counter in the tag: `forget_exchange` then drops the call's values once
  every process is past it). A process that sends nothing within `timeout_s` is an error naming
  it (the coordination service also stops every process when one dies)."""
  me, count = jax.process_index(), jax.process_count()
  if count == 1:
    return [dict(arrays)]
  client = _coordination_client()
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  data = buffer.getvalue()
  parts = [data[i : i + _EXCHANGE_CHUNK] for i in range(0, len(data), _EXCHANGE_CHUNK)]
  for k, part in enumerate(parts):
    client.key_value_set_bytes(f"gppo/{tag}/{me}/{k}", part)
  client.key_value_set(f"gppo/{tag}/{me}/parts", str(len(parts)))  # last: the rest is there
  timeout_ms = int(timeout_s * 1000)
  out = []
  for p in range(count):
    if p == me:
      out.append(dict(arrays))
      continue
    try:
      n = int(client.blocking_key_value_get(f"gppo/{tag}/{p}/parts", timeout_ms))
      blob = b"".join(
        client.blocking_key_value_get_bytes(f"gppo/{tag}/{p}/{k}", timeout_ms) for k in range(n)
      )
    except Exception as e:  # noqa: BLE001 (the client raises its own status errors)
      raise RuntimeError(
        f"process {p} sent no '{tag}' arrays within {timeout_s:.0f} s ({type(e).__name__}: {e})"
      ) from e
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
      out.append({k: z[k] for k in z.files})
  return out


def forget_exchange(tag: str) -> None:
  """Deletes this process's values of the exchange `tag` (call it once every process has read
  them: e.g. after the next exchange of the same caller, which each process enters only after
  reading this one)."""
  if jax.process_count() == 1:
    return
  client = _coordination_client()
  me = jax.process_index()
  try:
    n = int(client.key_value_try_get(f"gppo/{tag}/{me}/parts"))
  except Exception:  # noqa: BLE001 (not found: nothing to delete)
    return
  for k in range(n):
    client.key_value_delete(f"gppo/{tag}/{me}/{k}")
  client.key_value_delete(f"gppo/{tag}/{me}/parts")


def abstract_like(tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying `shardings`: the target for restoring a checkpoint onto a mesh."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings
  )


# --- Jitted, sharded entry points --------------------------------------------------------------


def _key(x: Any) -> Any:
  """A hashable stand-in for an argument: itself, or its pytree structure and (hashable) leaves,
  e.g. for a pytree of shardings."""
  try:
    hash(x)
    return x
  except TypeError:
    leaves, treedef = jax.tree.flatten(x)
    return treedef, tuple(leaves)


def reuse(builder: Callable | None = None, *, maxsize: int = 8) -> Callable:
  """Decorator for functions that build jitted functions: equal arguments (compared by value,
  pytrees of shardings by structure and leaves) return the function built the first time, so its
  traces and compiled programs serve again. A second run of the same shapes in one process (the
  next seed of a notebook's loop, the tests) then neither traces, lowers nor compiles. Arguments
  must determine what is built (graph definitions, frozen specs, shardings; an optimizer from
  `train_step.make_optimizer`, which reuses equal ones). Registering a divergence, estimator,
  advantage or preset starts afresh (a name may now mean another function). The `maxsize` most
  recent are kept."""
  if builder is None:
    return functools.partial(reuse, maxsize=maxsize)
  built: collections.OrderedDict[Any, Callable] = collections.OrderedDict()
  lock = threading.Lock()

  @functools.wraps(builder)
  def wrapper(*args, **kwargs):
    key = (
      registry.generation(),
      tuple(_key(a) for a in args),
      tuple(sorted((k, _key(v)) for k, v in kwargs.items())),
    )
    with lock:
      if key in built:
        built.move_to_end(key)
        return built[key]
    fn = builder(*args, **kwargs)
    with lock:
      built[key] = fn
      while len(built) > maxsize:
        built.popitem(last=False)
    return fn

  return wrapper


# Which kernels run the update's matrix products on CPU (config `model.cpu_matmul`). XLA's CPU
# backend hands plain dots to the YNNPACK library by default; on the narrow matrices of a small
# model's update (the default run's [656, 64] x [64, 192]) XLA's own kernels run faster, on
# wider ones slower (docs/performance.md). The sampler keeps the default: its batched decode
# products run slower on XLA's kernels. Earns its place: the default run's iteration
# (benchmarks/iteration.py) ~2x against "ynnpack" (median of three interleaved pairs).
CPU_MATMULS = ("auto", "xla", "ynnpack")
CPU_XLA_MATMUL_MAX_HIDDEN = 128  # "auto": XLA's own kernels up to this hidden size
_XLA_MATMUL_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


def update_compiler_options(
  cpu_matmul: str, hidden_size: int, platform: str
) -> dict[str, str] | None:
  """XLA compiler options for the update's jit (`jit_update`): on CPU with `cpu_matmul` "xla",
  or "auto" and a hidden size up to CPU_XLA_MATMUL_MAX_HIDDEN, only reductions stay YNNPACK
  fusions and every dot is XLA's own; None (XLA's defaults) otherwise, and on GPU and TPU.
  ConfigError for an unknown `cpu_matmul`; None with a warning where this jaxlib lacks the
  option."""
  if cpu_matmul not in CPU_MATMULS:
    raise errors.ConfigError(f"model.cpu_matmul={cpu_matmul!r}; valid: {', '.join(CPU_MATMULS)}")
  narrow = hidden_size <= CPU_XLA_MATMUL_MAX_HIDDEN
  if platform != "cpu" or not (cpu_matmul == "xla" or (cpu_matmul == "auto" and narrow)):
    return None
  return dict(_XLA_MATMUL_OPTIONS) if _xla_matmul_options_supported() else None


@functools.cache
def _xla_matmul_options_supported() -> bool:
  """Whether this jaxlib's CPU compiler takes the options (they are experimental): a toy compile."""
  try:
    x = jax.device_put(np.float32(0), jax.devices("cpu")[0])  # a CPU compile whatever the default
    jax.jit(lambda x: x + 1).lower(x).compile(compiler_options=_XLA_MATMUL_OPTIONS)
  except Exception as e:  # noqa: BLE001 (whatever the compiler raises: fall back to the defaults)
    log.warning("model.cpu_matmul: this jaxlib rejects %s (%s); XLA's defaults instead",
                _XLA_MATMUL_OPTIONS, e)  # fmt: skip
    return False
  return True


def jit_update(
  update_fn: Callable,
  state_shardings: Any,
  batch_shardings: Any,
  *,
  compiler_options: Mapping[str, Any] | None = None,
) -> Callable:
  """jit(update_fn) for (state, batch, rng) -> (state, metrics), with the state donated.

  The new state keeps `state_shardings`; metrics and rng are replicated. `compiler_options`: for
  XLA (`update_compiler_options`).
  """
  mesh = jax.tree.leaves(state_shardings)[0].mesh
  rep = replicated(mesh)

  def update(state, batch, rng):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # for constrain_batch inside
      return update_fn(state, batch, rng)

  return jax.jit(
    update,
    in_shardings=(state_shardings, batch_shardings, rep),
    out_shardings=(state_shardings, rep),
    donate_argnums=0,
    compiler_options=dict(compiler_options) if compiler_options else None,
  )


def jit_logprobs(logprob_fn: Callable, param_shardings: Any, batch_shardings: Any) -> Callable:
  """jit(params, batch) -> [N, R] log-probs, the output split over the batch axes like the input.

  `logprob_fn` is the un-jitted function (train_step.make_logprob_fn's result is a jit; its
  `.__wrapped__` works too)."""
  mesh = jax.tree.leaves(param_shardings)[0].mesh
  fn = getattr(logprob_fn, "__wrapped__", logprob_fn)
  out = NamedSharding(mesh, PartitionSpec(partitioning.batch_axes(mesh)))
  return jax.jit(fn, in_shardings=(param_shardings, batch_shardings), out_shardings=out)


def batch_shards(mesh: Mesh) -> int:
  """How many ways a batch is split (data x fsdp x expert sizes): batch sizes should be
  multiples."""
  return math.prod(mesh.shape[a] for a in partitioning.batch_axes(mesh))
