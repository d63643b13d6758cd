"""Tests for data.readers: reading, row errors, rendering, filtering, resumable iteration."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gppo_jax.data import readers as data
from gppo_jax.data.readers import DataError, Fields, PromptIterator, load_dataset


def template(messages):
  return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def encode(text):
  return [ord(c) for c in text]


def write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


MATH_ROWS = [
  {"id": "a", "prompt": "What is 1+1?", "answer": "2"},
  {"id": "b", "prompt": [{"role": "user", "content": "Half of 1?"}], "answer": r"\frac12"},
  {"prompt": "Pick.", "answer": 3, "metadata": {"source": "x"}},
]


def test_math_jsonl_render_and_fields(tmp_path):
  path = write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)
  ds = load_dataset(
    path,
    apply_template=template,
    encode=encode,
    system_prompt="Be brief.",
    instruction=data.MATH_INSTRUCTION,
  )
  assert len(ds) == 3 and ds.num_rows == 3 and ds.num_dropped_too_long == 0
  e = ds.examples[0]
  assert e.id == "a" and e.answer == "2" and e.tests is None
  assert e.messages[0] == {"role": "system", "content": "Be brief."}
  assert e.messages[1]["content"] == "What is 1+1?\n\n" + data.MATH_INSTRUCTION
  assert e.text == template(list(e.messages))
  assert list(e.token_ids) == encode(e.text)
  assert e.source.endswith("m.jsonl:1")
  assert ds.examples[1].messages[-1]["content"].startswith("Half of 1?")
  assert ds.examples[2].id == "2" and ds.examples[2].answer == "3"  # defaults to the row index
  assert ds.examples[2].metadata == {"source": "x"}


def test_no_template_uses_raw_prompt_and_custom_fields(tmp_path):
  rows = [{"question": "Q1", "solution": "5", "uid": 7}]
  path = write_jsonl(tmp_path / "c.jsonl", rows)
  ds = load_dataset(path, fields=Fields(prompt="question", answer="solution", id="uid"))
  assert ds.examples[0].text == "Q1" and ds.examples[0].id == "7"
  assert ds.examples[0].token_ids == ()
  chat = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
           "answer": "1"}]  # fmt: skip
  with pytest.raises(DataError, match="needs apply_template"):
    load_dataset(write_jsonl(tmp_path / "chat.jsonl", chat))
  # A system message in the data is kept; the configured system prompt is not added on top.
  ds = load_dataset(str(tmp_path / "chat.jsonl"), apply_template=template, system_prompt="other")
  assert [m["content"] for m in ds.examples[0].messages] == ["s", "u"]


def test_parquet(tmp_path):
  path = str(tmp_path / "m.parquet")
  table = pa.table({"prompt": ["p1", "p2"], "answer": ["1", "2"], "id": ["x", "y"]})
  pq.write_table(table, path)
  ds = load_dataset(path, encode=encode)
  assert [e.id for e in ds.examples] == ["x", "y"]
  assert ds.examples[1].source.endswith("m.parquet:row 2")
  pq.write_table(pa.table({"prompt": ["p1"], "answer": [None]}), path)
  with pytest.raises(DataError, match=r"m\.parquet:row 1: field 'answer'"):
    load_dataset(path)
  (tmp_path / "junk.parquet").write_text("not parquet")
  with pytest.raises(DataError, match="junk.parquet: cannot read Parquet"):
    load_dataset(str(tmp_path / "junk.parquet"))


def test_one_reader_for_every_format(tmp_path):
  # Parquet is streamed a batch of rows at a time: 600 rows span three batches, in order.
  table = pa.table(
    {"prompt": [f"q{i}" for i in range(600)], "answer": [str(i) for i in range(600)]}
  )
  pq.write_table(table, tmp_path / "big.parquet", row_group_size=100)
  rows = list(data.read_rows(str(tmp_path / "big.parquet")))
  assert [r["answer"] for _, r in rows] == [str(i) for i in range(600)]
  assert rows[-1][0].endswith("big.parquet:row 600")
  # A .json file holds an array (locations by item) or JSON lines.
  (tmp_path / "a.json").write_text(json.dumps(MATH_ROWS))
  assert [loc.rsplit(":", 1)[1] for loc, _ in data.read_rows(str(tmp_path / "a.json"))] == [
    "item 1", "item 2", "item 3"
  ]  # fmt: skip
  assert load_dataset(str(tmp_path / "a.json")).examples[2].answer == "3"
  write_jsonl(tmp_path / "l.json", MATH_ROWS)
  assert [r for _, r in data.read_rows(str(tmp_path / "l.json"))] == MATH_ROWS
  (tmp_path / "o.json").write_text(json.dumps({"a": 1}, indent=2))
  with pytest.raises(DataError, match="o.json: expected a JSON array"):
    list(data.read_records(str(tmp_path / "o.json")))
  # The lenient modes: a bad line comes as Unreadable (prepare_data counts it) or is skipped.
  path = write_jsonl(tmp_path / "m.jsonl", ['{"step": 1}', "{torn", "[2]"])
  got = list(data.read_records(path, bad_lines="yield"))
  assert got[1] == (f"{path}:2", data.Unreadable(
    "invalid JSON (Expecting property name enclosed in double quotes)",
    "invalid JSON (Expecting property name enclosed in double quotes at column 2)",
  ))  # fmt: skip
  assert [r for _, r in data.read_records(path, bad_lines="skip")] == [{"step": 1}, [2]]
  assert list(data.metric_rows(path)) == [{"step": 1}]
  with pytest.raises(DataError, match=r"m\.jsonl:2: invalid JSON .* at column 2"):
    list(data.read_records(path))


@pytest.mark.parametrize(
  "rows, pattern",
  [
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], r"l:2: invalid JSON"),
    (['{"prompt": "a", "answer": "1"}', "", '["list"]'], r"bad\.jsonl:3: expected a JSON object"),
    ([{"prompt": "a"}], r"bad\.jsonl:1: missing field 'answer'"),
    ([{"answer": "1"}], r"bad\.jsonl:1: missing field 'prompt'"),
    ([{"prompt": 5, "answer": "1"}], r"bad\.jsonl:1: field 'prompt' must be"),
    ([{"prompt": "  ", "answer": "1"}], r"bad\.jsonl:1: field 'prompt' is an empty"),
    ([{"prompt": "a", "answer": ["1"]}], r"bad\.jsonl:1: field 'answer' must be"),
    ([{"prompt": "a", "answer": True}], r"bad\.jsonl:1: field 'answer' must be"),
    ([{"prompt": "a", "answer": ""}], r"bad\.jsonl:1: field 'answer' is empty"),
    ([{"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}], r":1: field 'prompt' message"),
    ([{"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}], "end with a user"),
    ([{"prompt": "a", "answer": "1", "metadata": [1]}], r":1: field 'metadata' must be a dict"),
    ([{"id": 1, "prompt": "a", "answer": "1"}, {"id": 1, "prompt": "b", "answer": "2"}],
     r"bad\.jsonl:2: duplicate id '1' \(first at .*bad\.jsonl:1\)"),
    ([], r"bad\.jsonl: file has no rows"),
    (["", "   "], r"bad\.jsonl: file has no rows"),
  ],
)  # fmt: skip
def test_malformed_math_rows_name_file_and_line(tmp_path, rows, pattern):
  path = write_jsonl(tmp_path / "bad.jsonl", rows)
  with pytest.raises(DataError, match=pattern):
    load_dataset(path)


def test_missing_file_and_bad_arguments(tmp_path):
  with pytest.raises(DataError, match="no such file"):
    load_dataset(str(tmp_path / "nope.jsonl"))
  path = write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)
  with pytest.raises(ValueError, match="valid"):
    load_dataset(path, task="chess")
  with pytest.raises(ValueError, match="encode"):
    load_dataset(path, max_prompt_tokens=4)


def test_code_tests_field(tmp_path):
  stdio = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
  call = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}
  check = {"test_code": "def check(c):\n  assert c(1) == 2\n", "entry_point": "inc"}
  rows = [
    {"prompt": "Sum two ints.", "tests": stdio},
    {"prompt": "Write add.", "tests": json.dumps(call)},  # JSON-string form
    {"prompt": "def inc(x):", "tests": check},
  ]
  ds = load_dataset(write_jsonl(tmp_path / "code.jsonl", rows), task="code")
  assert [e.tests for e in ds.examples] == [stdio, call, check]
  assert ds.examples[0].answer is None
  bad_cases = [
    ({"inputs": ["1"], "outputs": []}, "as many outputs as inputs"),
    ({"inputs": [], "outputs": []}, "at least one"),
    ({"inputs": "1", "outputs": "2"}, "list fields"),
    ([1, 2], "must be a dict"),
    ("{not json", "not JSON"),
    ({"fn_name": "not valid", "inputs": [1], "outputs": [1]}, "identifier"),
    ({"test_code": "assert 1", "entry_point": "a b"}, "entry_point"),
    ({"test_code": "", "entry_point": "f"}, "test_code"),
  ]
  for tests, pattern in bad_cases:
    path = write_jsonl(tmp_path / "badcode.jsonl", [{"prompt": "p", "tests": tests}])
    with pytest.raises(DataError, match=r"badcode\.jsonl:1: field 'tests'.*" + pattern):
      load_dataset(path, task="code")
  with pytest.raises(DataError, match="missing field 'tests'"):
    load_dataset(write_jsonl(tmp_path / "m.jsonl", MATH_ROWS), task="code")


def test_length_filter_logs_dropped_count(tmp_path, caplog):
  rows = [{"prompt": "x" * n, "answer": "1"} for n in (3, 10, 30, 5)]
  path = write_jsonl(tmp_path / "len.jsonl", rows)
  with caplog.at_level(logging.INFO, logger="gppo_jax.data.readers"):
    ds = load_dataset(path, encode=encode, max_prompt_tokens=10)
  assert [len(e.token_ids) for e in ds.examples] == [3, 10, 5]
  assert ds.num_dropped_too_long == 1 and ds.num_rows == 4
  assert "dropped 1 of 4" in caplog.text
  with pytest.raises(DataError, match="no rows left"):
    load_dataset(path, encode=encode, max_prompt_tokens=2)
  assert len(load_dataset(path, limit=2)) == 2


def test_check_answers_hook(tmp_path):
  path = write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)
  seen = []

  def check(answers):
    seen.extend(answers)
    return [None if a != r"\frac12" else "does not parse" for a in answers]

  with pytest.raises(DataError, match=r"m\.jsonl:2: gold answer .* rejected \(does not parse\)"):
    load_dataset(path, check_answers=check)
  assert seen == ["2", r"\frac12", "3"]  # one call with every answer


# --- iteration --------------------------------------------------------------------------------


def _examples(n, tmp_path):
  rows = [{"id": f"r{i}", "prompt": f"p{i}", "answer": str(i)} for i in range(n)]
  return load_dataset(write_jsonl(tmp_path / "it.jsonl", rows)).examples


def _ids(batch):
  return [e.id for e in batch]


def test_iterator_epochs_are_seeded_permutations(tmp_path):
  ex = _examples(10, tmp_path)
  it = PromptIterator(ex, batch_size=3, seed=1)
  epoch0 = [_ids(next(it)) for _ in range(3)]  # 9 of 10; the tail of 1 is skipped
  assert it.state()["epoch"] == 0 and it.state()["index"] == 9
  first = _ids(next(it))
  assert it.epoch == 1 and it.index == 3
  flat = sum(epoch0, [])
  assert len(set(flat)) == 9
  assert flat != [f"r{i}" for i in range(9)]  # shuffled
  again = PromptIterator(ex, batch_size=3, seed=1)
  assert [_ids(next(again)) for _ in range(4)] == epoch0 + [first]  # deterministic
  other = PromptIterator(ex, batch_size=3, seed=2)
  assert [_ids(next(other)) for _ in range(3)] != epoch0
  assert data.epoch_order(10, 1, 0) != data.epoch_order(10, 1, 1)
  assert sorted(data.epoch_order(10, 1, 5)) == list(range(10))
  plain = PromptIterator(ex, batch_size=5, shuffle=False)
  assert _ids(next(plain)) == ["r0", "r1", "r2", "r3", "r4"]


def test_iterator_resumes_exactly(tmp_path):
  ex = _examples(7, tmp_path)
  it = PromptIterator(ex, batch_size=2, seed=3)
  for _ in range(5):  # crosses an epoch boundary
    next(it)
  state = json.loads(json.dumps(it.state()))  # survives a JSON checkpoint
  expected = [_ids(next(it)) for _ in range(6)]
  resumed = PromptIterator(ex, batch_size=2, seed=3)
  resumed.restore(state)
  assert [_ids(next(resumed)) for _ in range(6)] == expected
  with pytest.raises(ValueError, match="seed"):
    PromptIterator(ex, batch_size=2, seed=4).restore(state)
  with pytest.raises(ValueError, match="examples"):
    PromptIterator(ex[:6], batch_size=2, seed=3).restore(state)
  with pytest.raises(ValueError, match="exceeds"):
    PromptIterator(ex, batch_size=8)
