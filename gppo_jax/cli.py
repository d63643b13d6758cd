"""Command-line entry points: user errors as one line on stderr and exit status 2.

  if __name__ == "__main__":
    ...define flags...
    cli.run(main)          # instead of absl's app.run(main)

`run` is `app.run` plus a `--verbose` flag. A bad command line or config (an unknown config file,
a config file that fails to load or rejects its `:argument`, a misspelled `--config.foo.bar`
override, an unknown flag) and a `UserError` raised by `main` (bad config values, data files,
model folders) print `error: <message>` as a single line on stderr and exit with status 2; with
`--verbose` the traceback comes first. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gppo_jax import errors

EXIT_USER_ERROR = 2
VERBOSE_FLAG = "verbose"
_WRAPPED_CONFIG_ERROR = re.compile(r"flag (--\S+?=.*?): Error whilst parsing config file")
_DEFERRED_LOAD_ERROR = "Configuration is not available because of an earlier failure to load"


def one_line(text: str) -> str:
  """The non-empty lines of `text`, stripped and joined by spaces."""
  return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def fail(message: str, exc: BaseException | None = None, *, verbose: bool = False) -> NoReturn:
  """Prints `error: <message>` (after `exc`'s traceback when verbose) and exits with status 2."""
  sys.stdout.flush()
  if verbose and exc is not None:
    traceback.print_exception(exc, file=sys.stderr)
  print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
  raise SystemExit(EXIT_USER_ERROR)


def verbose_requested(argv: Sequence[str]) -> bool:
  """Whether the raw command line asks for --verbose (flags may not have parsed)."""
  on = False
  for arg in argv[1:]:
    if arg == "--":
      break
    name, eq, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-"):
      continue
    if name == VERBOSE_FLAG:
      on = not eq or value.lower() in ("1", "true", "t", "yes", "y")
    elif name == "no" + VERBOSE_FLAG:
      on = False
  return on


def flag_argument(argv: Sequence[str], name: str) -> str | None:
  """The value the raw command line gives flag `name` (`--name=V` or `--name V`, one dash too;
  the last one wins, as in absl), or None: for a choice made before the flags are defined."""
  value = None
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg == "--":
      break
    key, eq, given = arg.lstrip("-").partition("=")
    if not arg.startswith("-") or key != name:
      continue
    if eq:
      value = given
    elif i + 1 < len(args):
      value = args[i + 1]
  return value


def _chain(exc: BaseException) -> list[BaseException]:
  """`exc` and the exceptions it was raised from or while handling, outermost first."""
  out = []
  while exc is not None and exc not in out:
    out.append(exc)
    exc = exc.__cause__ or exc.__context__
  return out


def _describe(exc: BaseException) -> str:
  """A UserError's message; for anything else its type, message and the line that raised it."""
  if isinstance(exc, errors.UserError):
    return str(exc)
  text = f"{type(exc).__name__}: {one_line(str(exc))}" if str(exc) else type(exc).__name__
  if isinstance(exc, SyntaxError) and exc.filename:
    return text  # its message names the file and line already
  frames = traceback.extract_tb(exc.__traceback__)
  if frames:
    text += f" ({frames[-1].filename}, line {frames[-1].lineno})"
  return text


def _flag_being_parsed(exc: BaseException) -> tuple[str, Any] | None:
  """(name, argument) of the absl flag whose parse raised `exc`, from the traceback's frames."""
  from absl import flags

  found = None
  tb = exc.__traceback__
  while tb is not None:
    local = tb.tb_frame.f_locals
    if isinstance(local.get("self"), flags.Flag) and "argument" in local:
      found = (local["self"].name, local["argument"])
    tb = tb.tb_next
  return found


def _unknown_override(exc: BaseException, args: Sequence[str]) -> str | None:
  """For a misspelled `--config.a.b=...` override: the unknown field and the valid ones there.

  Found from the command line and the config being parsed (a local of the config flag's parse
  in the traceback), whichever ml_collections function raised."""
  from ml_collections import ConfigDict
  from ml_collections.config_flags import config_flags

  flag = found = None
  tb = exc.__traceback__
  while tb is not None:
    local = tb.tb_frame.f_locals
    config = local.get("config")
    if config_flags.is_config_flag(local.get("self")) and isinstance(config, ConfigDict):
      flag, found = local["self"], config
    tb = tb.tb_next
  if flag is None:
    return None
  for arg in args:
    m = re.match(rf"--?(?:no)?{re.escape(flag.name)}\.([^=]+)", arg)
    if not m:
      continue
    node, parts = found, m.group(1).split(".")
    for i, part in enumerate(parts):
      keys = list(node.keys()) if hasattr(node, "keys") else None
      if keys is None:
        where = ".".join([flag.name, *parts[:i]])
        return f"{arg}: {where} is not a section (it has no field {part!r})"
      if part not in keys:
        where = ".".join([flag.name, *parts[:i]])
        hint = errors.did_you_mean(part, keys)
        return f"{arg}: {where} has no field {part!r}{hint}; valid: {', '.join(map(str, keys))}"
      node = node[part]
  return None


def flag_error_message(exc: BaseException, args: Sequence[str] = ()) -> str:
  """One line for an exception raised while absl parsed the command line `args`."""
  from absl import flags

  chain = _chain(exc)
  parsing = _flag_being_parsed(exc)
  for e in chain:  # an override of a config file that failed to load: report the load error
    if str(e).startswith(_DEFERRED_LOAD_ERROR) and e.__cause__ is not None and parsing:
      return _load_error_message(parsing[0], str(parsing[1]), e.__cause__)
  first = str(exc).splitlines()[0] if str(exc) else ""
  wrapped = _WRAPPED_CONFIG_ERROR.match(first)
  if wrapped:  # ml_collections re-raised an error of the config file's get_config
    origin = chain[-1]
    what = "" if isinstance(origin, errors.UserError) else "cannot load the config file: "
    return f"{wrapped.group(1)}: {what}{_describe(origin)}"
  if isinstance(exc, flags.Error):
    return one_line(str(exc).removeprefix("flag "))
  override = _unknown_override(exc, args)
  if override:
    return override
  where = f"--{parsing[0]}={parsing[1]}: " if parsing else ""
  if parsing and (isinstance(exc, (ImportError, SyntaxError)) or ".py" in str(parsing[1])):
    where += "cannot load the config file: "
  return where + _describe(exc)


def _config_load_errors() -> tuple[str, BaseException] | None:
  """The error of a config flag whose file failed to load (ml_collections defers it)."""
  from absl import flags
  from ml_collections import config_flags

  error_config = getattr(config_flags.config_flags, "_ErrorConfig", None)
  if error_config is None:
    return None
  for name in list(flags.FLAGS):
    flag = flags.FLAGS[name]
    if not isinstance(flag.value, error_config):
      continue
    error = object.__getattribute__(flag.value, "_error")
    try:
      arg = str(flag.config_filename)
    except Exception:  # noqa: BLE001 - only used in the message
      arg = ""
    return _load_error_message(name, arg, error), error
  return None


def _load_error_message(name: str, arg: str, error: BaseException) -> str:
  """`--config=<arg>: <why the config file did not load>`."""
  path = arg.split(":", 1)[0]
  if isinstance(error, errors.UserError):
    what = str(error)
  elif path and not os.path.isfile(path):
    what = f"no such config file {path!r} (relative to {os.getcwd()})"
  else:
    what = f"cannot load the config file: {_describe(error)}"
  return f"--{name}={arg}: {what}"


def run(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> NoReturn:
  """`absl.app.run(main)` with `--verbose`; bad input ends in one line and exit status 2."""
  from absl import app, flags

  if VERBOSE_FLAG not in flags.FLAGS:
    flags.DEFINE_bool(
      VERBOSE_FLAG, False, "Show the traceback of user errors (bad config, data, model folder)."
    )
  raw = list(sys.argv if argv is None else argv)
  verbose = verbose_requested(raw)

  def parse(args: list[str]) -> list[str]:
    try:
      rest = flags.FLAGS(args)
    except Exception as e:  # noqa: BLE001 - everything here is about the command line
      try:
        message = flag_error_message(e, args)
      except Exception:  # noqa: BLE001 - never hide the error behind one in its description
        message = f"{type(e).__name__}: {e}"
      fail(message, e, verbose=verbose)
    failed = _config_load_errors()
    if failed:
      fail(failed[0], failed[1], verbose=verbose)
    return rest

  def checked_main(args: list[str]) -> Any:
    try:
      return main(args)
    except errors.UserError as e:
      fail(str(e), e, verbose=bool(flags.FLAGS[VERBOSE_FLAG].value))

  app.run(checked_main, argv=raw, flags_parser=parse)
  raise SystemExit(0)  # app.run exits itself; for type checkers
