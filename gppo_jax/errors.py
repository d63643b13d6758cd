"""Errors in what the user gave us (config, data files, model folders), as opposed to bugs.

A `UserError` says what is wrong, where, and the valid choices or the fix, in one line; the
command-line entry points (`gppo_jax.cli`) print it as `error: <message>` and exit 2 without a
traceback (`--verbose` shows it). Everything else keeps its traceback: it is a bug.

UserError subclasses ValueError, so callers that catch ValueError keep working. Every subclass
is constructible from the message alone (ml_collections rebuilds exceptions raised in a config
file as `type(e)(text)`). This module imports nothing from the package.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(ValueError):
  """Bad input: a config value, a config file, a data file or a model folder."""


class ConfigError(UserError):
  """A config field, config-file argument or command-line flag is invalid."""


class UnknownNameError(ConfigError):
  """A name that is not in a registry (divergence, estimator, advantage, task, ...)."""

  def __init__(self, message: str, *, kind: str = "", name: str = "", choices: Iterable[str] = ()):
    super().__init__(message)
    self.kind = kind
    self.name = name
    self.choices = tuple(choices)


class DataError(UserError):
  """A dataset file or row is malformed; the message names the file and line."""


class CheckpointError(UserError):
  """A model folder or checkpoint cannot be used; the message names the file."""


class MissingFileError(UserError, FileNotFoundError):
  """A file or folder the user pointed us to does not exist (also a FileNotFoundError)."""


def did_you_mean(name: object, choices: Iterable[object]) -> str:
  """` (did you mean 'x'?)` for the closest of `choices` to a mistyped `name`, or ""."""
  close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(
  kind: str, name: object, choices: Iterable[str], extra: str = ""
) -> UnknownNameError:
  """`unknown <kind> 'name'; valid names: a, b, c<extra>`, e.g. for a registry's `get`."""
  choices = tuple(choices)
  return UnknownNameError(
    f"unknown {kind} {name!r}; valid names: {', '.join(choices)}{extra}",
    kind=kind,
    name=str(name),
    choices=choices,
  )
