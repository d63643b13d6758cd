"""Logical-axis sharding rules: model parameters name their axes, a rules table places them.

Parameters (`param`: model.py's and lora.py's) carry logical axis names ("embed", "vocab",
"mlp", "heads", "kv_heads", "head_dim", "layers", LoRA's "lora", a mixture of experts' "expert",
"expert_mlp" and "router") as `out_sharding` metadata on their `nnx.Param`. A rules table maps
each name to mesh axes (`data`, `fsdp`, `tensor`, and `expert` where the mesh has it: expert
parallelism), so a new mesh shape is a config change only.
A mesh axis that does not divide a dimension, is absent from the mesh, or was already used by an
earlier dimension of the same array is dropped (that dimension is then replicated over it), so
tiny test models and odd head counts never fail to shard. Batches are not named by rules: their
leading axis is split over `BATCH_AXES` (data x fsdp x expert); `batch_spec` is that
PartitionSpec and `constrain_batch` pins activations to it inside a jit.

Meshes must use `jax.sharding.AxisType.Auto` axes: the model pins no activation shardings and
lets XLA propagate them from the parameters and the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

MESH_AXES = ("data", "fsdp", "tensor")
# Expert parallelism: the experts' stacked axis is split over this mesh axis, which also splits
# the batch. The experts rest sharded over it (memory), but the dispatch does not exchange
# tokens: each device routes and sorts its own tokens and runs them against every expert of the
# layer, gathered for the layer as FSDP gathers a dense layer's weights (`moe._sorted_on_shards`;
# the gradient is reduce-scattered back). Meshes have it only when it is larger than 1
# (`sharding.make_mesh`).
EXPERT_AXIS = "expert"

# FSDP over the embedding dimension, tensor parallelism over heads / mlp / vocab.
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("layers", None),
  # LoRA's rank dimension: FSDP where the adapter's other dimensions do not take it already
  # (B [r, heads, head_dim] of q, k, v has no embed dimension).
  ("lora", "fsdp"),
  # A mixture of experts: each expert whole on the devices of the expert axis that hold it, its
  # weights split like the dense MLP's otherwise (embed over fsdp, its intermediate over tensor);
  # the small router [embed, experts] is replicated over the expert axis.
  ("expert", EXPERT_AXIS),
  ("expert_mlp", "tensor"),
  ("router", None),
)
# Batches (rollouts, mini-batches, prompts and every batch-major activation) split their leading
# axis over these mesh axes; `batch_spec` is the one place that turns this into a PartitionSpec.
# Absent mesh axes are skipped (`batch_axes`): meshes without experts have no expert axis.
BATCH_AXES = ("data", "fsdp", EXPERT_AXIS)


def batch_axes(mesh: Mesh | jax.sharding.AbstractMesh) -> tuple[str, ...]:
  """The BATCH_AXES that `mesh` has."""
  return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def param(
  rngs: nnx.Rngs | None,
  shape: Sequence[int],
  axes: Sequence[str],
  dtype,
  init: str = "normal",
  std: float = 0.02,
  kind: type[nnx.Param] = nnx.Param,
) -> nnx.Param:
  """An nnx.Param (or `kind`) of `shape` named by logical `axes` (its `out_sharding`), initialised
  "normal" (std, from rngs.params()), "ones" or "zeros" in float32, stored in `dtype`; placement
  is decided later by the rules table (`state_shardings`)."""
  if init == "normal":
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "ones":
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  return kind(value.astype(dtype), out_sharding=tuple(axes), eager_sharding=False)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
  logical: Sequence[str | None],
  rules: Rules = DEFAULT_RULES,
  *,
  shape: Sequence[int] | None = None,
  mesh: Mesh | None = None,
) -> PartitionSpec:
  """PartitionSpec for an array whose dimensions have the given logical names.

  With `mesh` (and `shape`), mesh axes absent from the mesh or not dividing the dimension are
  dropped. Unknown logical names raise, listing the names the rules know.
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(logical):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
    chosen = []
    size = 1
    for ax in _as_tuple(table[name]):
      if ax in used:
        continue
      if mesh is not None:
        if ax not in mesh.shape:
          continue
        n = mesh.shape[ax]
        if shape is not None and shape[dim] % (size * n):
          continue
        size *= n
      chosen.append(ax)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return PartitionSpec(*spec)


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def state_shardings(state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """NamedSharding pytree matching `state` (a model state from nnx.split / nnx.state).

  Works on concrete and abstract (nnx.eval_shape) states; Variables without logical names are
  replicated. The result can be passed to jax.jit in/out_shardings or jax.device_put.
  """

  def sharding(v):
    value = v.get_value()
    axes = v.get_metadata().get("out_sharding")
    if not axes:
      return v.replace(NamedSharding(mesh, PartitionSpec()))
    if len(axes) != np.ndim(value):
      raise ValueError(f"logical axes {axes} do not match shape {np.shape(value)}")
    spec = logical_to_spec(axes, rules, shape=np.shape(value), mesh=mesh)
    return v.replace(NamedSharding(mesh, spec))

  return jax.tree.map(sharding, state, is_leaf=_is_var)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """Places the model's arrays on `mesh` per `rules` (in place) and returns it."""
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
  return model


def create_sharded(make_model, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """Builds `make_model()` with every parameter created directly in its sharded layout."""
  abstract = nnx.eval_shape(make_model)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, rules)

  state = jax.jit(lambda: nnx.state(make_model()), out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def batch_spec(shape: Sequence[int], mesh: Mesh | jax.sharding.AbstractMesh) -> PartitionSpec:
  """PartitionSpec of a [batch, ...] array: the leading axis over BATCH_AXES, dropping the mesh
  axes that are absent or do not divide it; a scalar is replicated. Works on abstract meshes."""
  if not len(shape):
    return PartitionSpec()
  logical = ("batch",) + (None,) * (len(shape) - 1)
  return logical_to_spec(logical, (("batch", BATCH_AXES),), shape=shape, mesh=mesh)


def constrain_batch(tree: Any) -> Any:
  """Pins batch-major activations (leading axis) to data x fsdp (x expert) on the ambient mesh.

  A no-op without an ambient mesh (`jax.set_mesh` / `jax.sharding.use_abstract_mesh`), so model
  and training code call it unconditionally; the sharded jits of `gppo_jax.models.sharding` and
  `generation.sampler` set the mesh. Without it XLA lets FSDP-sharded weights pull activations off
  the batch split, and every device computes the whole mini-batch.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not {"data", "fsdp"} <= set(mesh.axis_names):
    return tree

  def pin(x):
    return jax.lax.with_sharding_constraint(x, batch_spec(x.shape, mesh)) if x.ndim else x

  return jax.tree.map(pin, tree)
