"""Data and environments (plain Python; no JAX).

- `tasks`: the built-in synthetic tasks (`addsub3`, ...).
- `readers`: the JSONL / JSON / Parquet reader, and prompt/answer datasets.
- `envs`: a built-in task or a dataset plus its reward, behind one `Env` interface.
"""

import importlib as _importlib
import types as _types
import warnings as _warnings


def __getattr__(name: str):
  # Before the layer folders `gppo_jax.data` was the readers module; its names still resolve.
  if name.startswith("_") or name in ("tasks", "envs", "readers"):
    raise AttributeError(f"module 'gppo_jax.data' has no attribute {name!r}")
  value = getattr(_importlib.import_module("gppo_jax.data.readers"), name, None)
  if value is None or isinstance(value, _types.ModuleType):
    raise AttributeError(f"module 'gppo_jax.data' has no attribute {name!r}")
  _warnings.warn(
    f"gppo_jax.data.{name} moved to gppo_jax.data.readers.{name}", DeprecationWarning, 2
  )
  return value
