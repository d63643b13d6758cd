"""A name -> object table, the one shape of the divergence, estimator, advantage and preset
registries:

    ESTIMATORS = Registry("estimator")

    @ESTIMATORS.register("half_atomic")          # as a decorator, or
    def half_atomic(div, logp, logq): ...
    ESTIMATORS.register("mc", mc)                # as a call; both return the object

    ESTIMATORS.get("atom")  # UnknownNameError: unknown estimator 'atom'; valid names: mc, ...

Names keep their registration order (the built-ins first). This module imports only `errors`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from gppo_jax import errors

T = TypeVar("T")
_MISSING: Any = object()
_generation = 0  # registrations so far, in every registry


def generation() -> int:
  """A counter that every registration (in any registry) advances: functions compiled while it
  had one value may have looked up a name whose object has since been replaced."""
  return _generation


class Registry(Generic[T]):
  """Named objects of one kind; `get` raises an UnknownNameError listing the valid names."""

  def __init__(self, kind: str, *, hint: str = ""):
    """`kind` names the objects in messages ("divergence"); `hint` is appended to the list of
    valid names in the unknown-name error (e.g. " or 'alpha:<a>'")."""
    self.kind = kind
    self.hint = hint
    self._items: dict[str, T] = {}

  def register(self, name: str, obj: T = _MISSING, *, overwrite: bool = False):
    """Stores `obj` under `name` and returns it; without `obj`, returns a decorator that does.

    A name that is taken raises ValueError unless `overwrite=True`.
    """
    self.check_free(name, overwrite=overwrite)
    if obj is _MISSING:
      return lambda fn: self.register(name, fn, overwrite=overwrite)
    global _generation
    self._items[name] = obj
    _generation += 1
    return obj

  def check_free(self, name: str, *, overwrite: bool = False) -> None:
    """The checks of `register` without registering: ValueError unless `name` is a non-empty
    string that is not taken (or `overwrite`)."""
    if not isinstance(name, str) or not name:
      raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
    if name in self._items and not overwrite:
      raise ValueError(
        f"{self.kind} {name!r} is already registered (pass overwrite=True to replace)"
      )

  def get(self, name: str) -> T:
    """The object registered under `name`; UnknownNameError (a ConfigError) otherwise."""
    if isinstance(name, str) and name in self._items:
      return self._items[name]
    raise errors.unknown_name(self.kind, name, self.names(), self.hint)

  def names(self) -> list[str]:
    """Registered names in registration order."""
    return list(self._items)

  def __contains__(self, name: object) -> bool:
    return isinstance(name, str) and name in self._items

  def __iter__(self) -> Iterator[str]:
    return iter(list(self._items))

  def __len__(self) -> int:
    return len(self._items)

  def __repr__(self) -> str:
    return f"Registry({self.kind!r}: {', '.join(self._items)})"
