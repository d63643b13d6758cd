"""Hugging Face tokenizers from a local folder: tokenizer.json plus the chat template.

`Tokenizer` wraps the `tokenizers` library (fast, no transformers needed at run time) and renders
the chat template from tokenizer_config.json (or chat_template.jinja) with a sandboxed jinja2
environment configured like transformers' own. Its interface matches `tasks.CharTokenizer`
(pad_id, bos_id, eos_id, eos_ids, vocab_size, encode, decode, apply_chat_template), so the
built-in char tasks and real checkpoints are interchangeable.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gppo_jax import errors

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"


def _token_text(value: Any) -> str | None:
  """Special tokens appear as "text" or {"content": "text", ...} in tokenizer_config.json."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def compile_chat_template(source: str) -> jinja2.Template:
  """A chat template compiled in a sandbox with the helpers HF templates expect."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


class Tokenizer:
  """A `tokenizers.Tokenizer` with its special tokens and chat template."""

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    *,
    chat_template: str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    extra_eos_ids: Sequence[int] = (),
    add_bos: bool = False,
  ):
    self.tokenizer = tokenizer
    self.chat_template = chat_template
    self._template = compile_chat_template(chat_template) if chat_template else None
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self.bos_id = self._id(bos_token, "bos_token")
    self.eos_id = self._id(eos_token, "eos_token")
    pad_id = self._id(pad_token, "pad_token")
    self.pad_id = pad_id if pad_id is not None else (self.eos_id or 0)
    self.add_bos = add_bos
    eos = [self.eos_id] if self.eos_id is not None else []
    self._eos_ids = tuple(dict.fromkeys([*eos, *map(int, extra_eos_ids)]))

  def _id(self, token: str | None, what: str) -> int | None:
    if token is None:
      return None
    i = self.tokenizer.token_to_id(token)
    if i is None:
      raise ValueError(f"{what} {token!r} is not in the tokenizer vocabulary")
    return i

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a generation (eos_token plus generation_config's eos_token_id)."""
    return self._eos_ids

  def token_to_id(self, token: str) -> int | None:
    return self.tokenizer.token_to_id(token)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of text; special-token strings in text (e.g. <|im_start|>) map to their ids."""
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    add_bos = self.add_bos if add_bos is None else add_bos
    if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def apply_chat_template(
    self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs
  ) -> str:
    """The prompt text of a conversation; extra kwargs reach the template (e.g. tools)."""
    if self._template is None:
      raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
    return self._template.render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token or "",
      eos_token=self.eos_token or "",
      pad_token=self.pad_token or "",
      **kwargs,
    )


def load_tokenizer(path: str | Path) -> Tokenizer:
  """The tokenizer of a Hugging Face folder (tokenizer.json, tokenizer_config.json, ...)."""
  path = Path(path)
  tok_file = path / TOKENIZER_FILE
  if not tok_file.is_file():
    raise errors.MissingFileError(
      f"{tok_file}: missing (only fast tokenizers, tokenizer.json, load)"
    )
  try:
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
  except Exception as e:  # tokenizers raises a bare Exception on bad JSON
    raise errors.CheckpointError(
      f"{tok_file}: cannot be read by the tokenizers library: {e}"
    ) from e
  config: dict[str, Any] = read_json_object(path / TOKENIZER_CONFIG_FILE)
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: use "default"
    named = {t["name"]: t["template"] for t in template}
    template = named.get("default") or next(iter(named.values()), None)
  if (path / CHAT_TEMPLATE_FILE).is_file():
    template = (path / CHAT_TEMPLATE_FILE).read_text()
  eos = read_json_object(path / GENERATION_CONFIG_FILE).get("eos_token_id")
  extra_eos: list[int] = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
  try:
    return Tokenizer(
      tok,
      chat_template=template,
      bos_token=_token_text(config.get("bos_token")),
      eos_token=_token_text(config.get("eos_token")),
      pad_token=_token_text(config.get("pad_token")),
      extra_eos_ids=extra_eos,
      add_bos=bool(config.get("add_bos_token", False)),
    )
  except ValueError as e:  # a special token missing from the vocabulary
    raise errors.CheckpointError(f"{path}: {e}") from e


def read_json_object(f: Path) -> dict[str, Any]:
  """The JSON object in `f`, {} if there is no such file; CheckpointError naming it if bad."""
  if not f.is_file():
    return {}
  try:
    out = json.loads(f.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise errors.CheckpointError(f"{f}: invalid JSON ({e})") from e
  if not isinstance(out, dict):
    raise errors.CheckpointError(f"{f}: expected a JSON object, got {type(out).__name__}")
  return out
