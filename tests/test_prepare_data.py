"""prepare_data: each converter on a fixture in its release's schema, the LiveCodeBench decoding
(and its refusal of anything but plain data), skipped-row counts, the hub wiring (faked: nothing
downloads), the command line, and the converted code tests run through the sandbox.

The fixtures (tests/fixtures/prepare_data/) are toy problems written for these tests, with the
field names, nesting and encodings of each published release."""

import base64
import json
import os
import pickle
import subprocess
import sys
import types
import zlib

import pytest

from gppo_jax import errors
from gppo_jax import prepare_data as pd
from gppo_jax.data import readers as data_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "prepare_data")
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def convert(name, fixture, options=None, **kw):
  spec = pd.get_spec(name)
  path = os.path.join(FIXTURES, fixture)
  opts = options or spec.defaults
  return pd.convert_rows(spec, pd.local_rows(pd.source_files(spec, path, opts)), opts, **kw)


def by_id(rows):
  return {r["id"]: r for r in rows}


# -- registry -------------------------------------------------------------------------------------


def test_registry_entries_are_complete():
  assert {
    "dapo_math_17k",
    "math500",
    "aime24",
    "aime25",
    "amc23",
    "minerva_math",
    "olympiadbench",
    "taco",
    "livecodebench",
    "humaneval_plus",
    "mbpp_plus",
  } <= set(pd.REGISTRY)
  for spec in pd.REGISTRY.values():
    assert spec.kind in pd.KINDS and spec.role in ("train", "eval")
    assert "/" in spec.hub_id and spec.split and callable(spec.convert)
  listing = pd.format_registry()
  assert all(name in listing for name in pd.REGISTRY)
  with pytest.raises(errors.UnknownNameError, match="valid names: dapo_math_17k"):
    pd.get_spec("aime2024")


# -- math converters ------------------------------------------------------------------------------


def test_dapo_strips_its_instruction_removes_repeats_and_skips_missing_answers():
  rows, s = convert("dapo_math_17k", "dapo_math_17k.jsonl")
  assert [(r["id"], r["prompt"], r["answer"]) for r in rows] == [
    ("7f0c-0001", "What is the sum of the first ten positive integers?", "55"),
    ("7f0c-0003", "If $3x + 5 = 20$, what is $x$?", "5"),
  ]
  assert all(r["benchmark"] == "dapo_math_17k" and "tests" not in r for r in rows)
  assert (s.read, s.written) == (4, 2)
  assert s.not_selected == {"repeated problem": 1}
  assert s.skipped == {"missing answer": 1}
  assert s.first_skipped["missing answer"].endswith("dapo_math_17k.jsonl:4")


def test_dapo_reads_the_release_parquet_with_nested_fields(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  src = [json.loads(line) for line in open(os.path.join(FIXTURES, "dapo_math_17k.jsonl"))]
  pq.write_table(pa.Table.from_pylist(src), tmp_path / "dapo-math-17k.parquet")
  rows, s = convert("dapo_math_17k", str(tmp_path))
  assert rows == convert("dapo_math_17k", "dapo_math_17k.jsonl")[0]
  assert s.skipped == {"missing answer": 1} and s.first_skipped["missing answer"].endswith("row 4")


@pytest.mark.parametrize(
  "name, fixture, expected",
  [
    ("math500", "math500.jsonl", {
      "test/prealgebra/9001.json": ("\\frac{3}{4}", {"subject": "Prealgebra", "level": 1}),
      "test/precalculus/9002.json": ("\\left( 3, \\frac{\\pi}{2} \\right)",
                                     {"subject": "Precalculus", "level": 2})}),
    ("aime24", "aime24.jsonl", {"2024-I-1": ("33", None), "2024-II-15": ("204", None)}),
    ("aime25", "aime25.jsonl", {"2025-1": ("70", {"problem_type": ["Number Theory"]}),
                                "2025-16": ("27", {"problem_type": ["Algebra"]})}),
    ("amc23", "amc.jsonl", {"0": ("27", None), "1": ("3.5", None)}),
    ("minerva_math", "minerva.jsonl", {"minerva-0": ("45", {}),
                                        "minerva-1": ("2 \\times 10^{3}", {})}),
    ("olympiadbench", "olympiadbench.jsonl", {
      "2001": ("\\frac{1}{2}", {"subfield": "Algebra", "answer_type": "Numerical"}),
      "2002": ("1, 2", {"subfield": "Algebra", "answer_type": "Numerical"})}),
  ],
)  # fmt: skip
def test_math_converters(name, fixture, expected):
  rows, s = convert(name, fixture)
  got = by_id(rows)
  assert set(got) == set(expected) and s.written == len(expected) and not s.skipped
  for row_id, (answer, metadata) in expected.items():
    row = got[row_id]
    assert row["answer"] == answer and row["benchmark"] == name
    assert isinstance(row["prompt"], str) and row["prompt"] and "$$" not in row["answer"]
    if metadata is not None:
      assert row["metadata"] == metadata
  if name == "amc23":
    assert s.not_selected == {"not from 2023": 1}


def test_gold_answer_normalisation():
  assert pd.gold_answer("033") == "33"
  assert (
    pd.gold_answer(70) == "70" and pd.gold_answer(27.0) == "27" and pd.gold_answer(0.5) == "0.5"
  )
  assert pd.gold_answer(" $\\frac{1}{2}$ ") == "\\frac{1}{2}"
  assert pd.gold_answer("\\boxed{(1,2]}") == "(1,2]"
  assert pd.gold_answer("$a$ and $b$") == "$a$ and $b$"  # not one delimited expression
  for bad in (None, "", "  ", "$$", float("nan"), True, ["1"]):
    with pytest.raises(pd.SkipRow):
      pd.gold_answer(bad)


def test_gold_answers_math_verify_rejects_are_skipped_and_counted():
  def check(golds):
    return [None if g != "204" else "bad_gold: does not parse" for g in golds]

  rows, s = convert("aime24", "aime24.jsonl", check_answers=check)
  assert [r["id"] for r in rows] == ["2024-I-1"]
  assert s.skipped == {"gold answer rejected by math-verify (bad_gold)": 1}


def test_limit_stops_after_n_rows():
  rows, s = convert("dapo_math_17k", "dapo_math_17k.jsonl", limit=1)
  assert len(rows) == 1 and s.read == 1


# -- code converters ------------------------------------------------------------------------------


def lcb_options(**kw):
  return pd.Options(**{"release": "release_v2", "start_date": None, "end_date": None, **kw})


def test_livecodebench_merges_public_and_decoded_private_tests():
  rows, s = convert("livecodebench", "livecodebench", lcb_options())
  got = by_id(rows)
  assert set(got) == {"toy001_a", "9001", "toy000_a", "toy003_b"}
  assert got["toy001_a"]["tests"] == {
    "inputs": ["3\n", "10\n", "0\n"],
    "outputs": ["6\n", "20\n", "0\n"],
  }
  assert got["toy003_b"]["tests"] == {"inputs": ["abc\n", "xy\n"], "outputs": ["cba\n", "yx\n"]}
  # LeetCode problem: each input line is one JSON argument; private tests in the older JSON form.
  assert got["9001"]["tests"] == {
    "fn_name": "addPair",
    "inputs": [[[1, 2], 3], [[], 0]],
    "outputs": [6, 0],
  }
  assert "def addPair(nums: List[int], k: int) -> int:" in got["9001"]["prompt"]
  assert "class Solution" not in got["9001"]["prompt"]
  assert got["9001"]["metadata"]["starter_code"].startswith("class Solution")
  assert got["toy001_a"]["metadata"]["contest_date"] == "2024-08-03"
  assert "standard input" in got["toy001_a"]["prompt"]
  # The row whose private tests are a pickle naming os.system is refused, not loaded.
  assert s.skipped == {"private tests do not decode (UnpicklingError)": 1}
  assert s.first_skipped["private tests do not decode (UnpicklingError)"].endswith("test2.jsonl:1")


def test_livecodebench_release_and_window():
  rows, _ = convert("livecodebench", "livecodebench", lcb_options(release="release_v1"))
  assert {r["id"] for r in rows} == {"toy001_a", "9001", "toy000_a"}  # test.jsonl only
  spec = pd.get_spec("livecodebench")
  opts = pd.options_from_flags(spec, "release_v2", "2024-09-01", "")
  rows, s = convert("livecodebench", "livecodebench", opts)
  assert {r["id"] for r in rows} == {"9001", "toy003_b"}
  assert s.not_selected == {"outside the release window": 2}
  # The default window (release_v5) needs files this folder does not have.
  with pytest.raises(errors.DataError, match="test3.jsonl, test4.jsonl, test5.jsonl"):
    pd.source_files(spec, os.path.join(FIXTURES, "livecodebench"), spec.defaults)
  assert pd.lcb_release_files("release_v3") == ["test.jsonl", "test2.jsonl", "test3.jsonl"]
  assert pd.lcb_release_files("v2_v3") == ["test2.jsonl", "test3.jsonl"]
  assert pd.lcb_release_files("v1") == ["test.jsonl"]
  for bad in ("release_v0", "v9", "latest"):
    with pytest.raises(errors.ConfigError, match="valid: release_v1"):
      pd.lcb_release_files(bad)
  with pytest.raises(errors.ConfigError, match="YYYY-MM-DD"):
    pd.options_from_flags(spec, None, "01/08/2024", None)
  with pytest.raises(errors.ConfigError, match="livecodebench only"):
    pd.options_from_flags(pd.get_spec("aime24"), "release_v5", None, None)


def test_livecodebench_private_test_decoding_accepts_plain_data_only(monkeypatch):
  def pack(obj, raw=None):
    return base64.b64encode(zlib.compress(raw or pickle.dumps(obj))).decode()

  cases = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
  assert pd.decode_lcb_private(pack(json.dumps(cases))) == cases
  assert pd.decode_lcb_private(json.dumps(cases)) == cases
  assert pd.decode_lcb_private(pack(json.dumps(cases).encode())) == cases  # pickled bytes
  refused = {
    "a pickle naming a callable": pack(None, b"cposix\nsystem\n(S'true'\ntR."),
    "a pickled list instead of a JSON string": pack(cases),
    "not base64": "%%% not base64 %%%",
    "base64 of no zlib stream": base64.b64encode(b"plain").decode(),
    "a JSON string of no list": pack(json.dumps({"input": "1"})),
  }
  for what, value in refused.items():
    with pytest.raises(pd.SkipRow):
      pd.decode_lcb_private(value)
      pytest.fail(what)
  monkeypatch.setattr(pd, "MAX_DECOMPRESSED_BYTES", 1000)
  with pytest.raises(pd.SkipRow, match="more than 1000 bytes"):
    pd.decode_lcb_private(pack("x" * 5000))


def test_taco_stdio_and_call_tests():
  rows, s = convert("taco", "taco.jsonl")
  got = by_id(rows)
  assert got["taco-0"]["tests"] == {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
  assert got["taco-1"]["tests"] == {
    "fn_name": "double",
    "inputs": [[2], [5]],
    "outputs": [[4], [10]],
  }
  assert "def double(x: int) -> int:" in got["taco-1"]["prompt"]
  assert got["taco-0"]["metadata"] == {
    "name": "sum2",
    "source": "toy",
    "difficulty": "EASY",
    "url": "https://example.org/sum2",
  }
  assert s.skipped == {"input_output is not JSON (JSONDecodeError)": 1}


def test_io_tests_reject_what_the_sandbox_cannot_run():
  assert pd.io_tests([["a", "b"]], ["c"], None) == {"inputs": ["a\nb\n"], "outputs": ["c"]}
  for inputs, outputs, fn in [
    ([], [], None),
    (["1"], [], None),
    ([1], ["1"], None),
    ([1], [2], "f"),
    ([[1]], [2], "not a name"),
    ("1", "1", None),
  ]:
    with pytest.raises(pd.SkipRow):
      pd.io_tests(inputs, outputs, fn)


def test_top_level_starter():
  cls = "class Solution:\n    def maxSum(self, nums: List[int],\n               k: int) -> int:\n"
  assert pd.top_level_starter(cls, "maxSum") == (
    "from typing import *\n\ndef maxSum(nums: List[int], k: int) -> int:\n    "
  )
  assert pd.top_level_starter("class Solution:\n    def f(self):\n", "f") == "def f():\n    "
  assert pd.top_level_starter("def g(a, b):\n", "g") == "def g(a, b):\n"
  assert pd.top_level_starter("class Solution:\n    def other(self, x):\n", "f").startswith("class")


def run_check(tests, fn):
  """Runs a converted check-style test in this process (trusted fixture code) against `fn`."""
  ns = {"__name__": "__check__"}
  exec(tests["setup_code"], ns)
  ns[tests["entry_point"]] = fn
  exec(tests["test_code"], ns)
  ns["check"](fn)


def test_humaneval_plus_check_runs_without_numpy():
  rows, s = convert("humaneval_plus", "humanevalplus.jsonl")
  (row,) = rows
  tests = row["tests"]
  assert row["id"] == "HumanEval/9000" and tests["entry_point"] == "mean_of" and not s.skipped
  assert "import numpy" not in tests["test_code"] and "def mean_of" in tests["setup_code"]
  assert "```python\nfrom typing import List" in row["prompt"]
  run_check(tests, lambda xs: sum(xs) / len(xs))
  run_check(tests, lambda xs: sum(xs) / len(xs) + 1e-9)  # within the float tolerance
  for wrong in (lambda xs: sum(xs) / len(xs) + 1e-3, lambda xs: 0.0, lambda xs: "2.0"):
    with pytest.raises((AssertionError, TypeError)):
      run_check(tests, wrong)


def test_humaneval_plus_accepts_tests_written_with_assert_allclose():
  """HumanEval+ files written before EvalPlus changed its float check to `assert np.allclose`
  call `np.testing.assert_allclose`: converted, and run on the stand-in."""
  rows, s = convert("humaneval_plus", "humanevalplus_assert_allclose.jsonl")
  (row,) = rows
  assert not s.skipped and row["id"] == "HumanEval/9001"
  tests = row["tests"]
  assert (
    "import numpy" not in tests["test_code"]
    and "np.testing.assert_allclose" in (tests["test_code"])
  )
  run_check(tests, lambda xs: [x / 2 for x in xs])
  run_check(tests, lambda xs: [x / 2 + 1e-9 for x in xs])  # within the float tolerance
  for wrong in (
    lambda xs: [x / 2 + 1e-3 for x in xs],
    lambda xs: [x / 3 for x in xs],
    lambda xs: [x / 2 for x in xs] + [0.0],
    lambda xs: None,
  ):
    with pytest.raises((AssertionError, TypeError)):
      run_check(tests, wrong)


def test_numpy_stand_in_assert_allclose_agrees_with_numpy():
  import numpy

  ns = {}
  exec(pd.NUMPY_STAND_IN, ns)
  stand_in = ns["np"].testing.assert_allclose
  nan, inf = float("nan"), float("inf")
  cases = [
    ((1.0, 1.0), {}),
    ((1.0, 1.0 + 1e-8), {}),
    ((1.0, 1.0 + 1e-6), {}),
    ((1.0, 1.0 + 1e-6), {"atol": 1e-5}),
    (([1.0, 2.0], [1.0, 2.0 + 1e-9]), {"atol": 1e-6}),
    (([1.0, 2.0], [1.0, 2.1]), {"atol": 1e-6}),
    (([1.0, 2.0], [1.0, 2.0, 3.0]), {}),
    ((3.0, [3.0, 3.0]), {}),
    (([[1.0, 2.0]], [[1.0, 2.0]]), {}),
    ((nan, nan), {}),
    ((nan, nan), {"equal_nan": False}),
    ((nan, 1.0), {}),
    ((inf, inf), {}),
    ((inf, -inf), {}),
    ((inf, 1e308), {}),
    ((100.0, 100.5), {"rtol": 1e-2}),
    ((100.0, 102.0), {"rtol": 1e-2}),
  ]
  for args, kw in cases:
    try:
      numpy.testing.assert_allclose(*args, **kw)
      expected = True
    except AssertionError:
      expected = False
    try:
      stand_in(*args, **kw)
      got = True
    except AssertionError:
      got = False
    assert got == expected, (args, kw)


def test_numpy_stand_in():
  ns = {}
  exec(pd.NUMPY_STAND_IN, ns)
  np = ns["np"]
  assert np.allclose([1.0, 2.0], (1.0, 2.0 + 1e-9)) and np.allclose(3, [3.0, 3.0])
  assert not np.allclose([1.0, 2.0], [1.0, 2.1]) and not np.allclose(float("nan"), float("nan"))
  assert np.allclose(float("inf"), float("inf")) and not np.allclose(float("inf"), 1e308)
  assert not np.allclose(float("inf"), float("-inf"))
  with pytest.raises(ValueError):
    np.allclose([1.0], [1.0, 2.0])
  with pytest.raises(pd.SkipRow, match="mean"):
    pd.without_numpy("import numpy as np\nx = np.mean([1])\n")
  with pytest.raises(pd.SkipRow, match="another way"):
    pd.without_numpy("from numpy import allclose\n")
  assert pd.without_numpy("def check(candidate):\n    pass\n") == (
    "def check(candidate):\n    pass\n"
  )


def test_mbpp_plus_module_level_test_runs_inside_check():
  rows, s = convert("mbpp_plus", "mbppplus.jsonl")
  (row,) = rows
  tests = row["tests"]
  assert row["id"] == "Mbpp/9002" and tests["entry_point"] == "shared_items" and not s.skipped
  assert "assert set(shared_items((3, 4, 5), (5, 4, 9)))" in row["prompt"]
  run_check(tests, lambda a, b: tuple(sorted(set(a) & set(b))))
  with pytest.raises(AssertionError):
    run_check(tests, lambda a, b: tuple(sorted(set(a) | set(b))))


# -- reading --------------------------------------------------------------------------------------


def test_unreadable_lines_and_json_arrays(tmp_path):
  bad = tmp_path / "aime.jsonl"
  good = json.loads(open(os.path.join(FIXTURES, "aime24.jsonl")).readline())
  bad.write_text(json.dumps(good) + "\n{not json\n[1, 2]\n")
  rows, s = convert("aime24", str(bad))
  assert len(rows) == 1 and s.read == 3
  assert s.skipped == {
    "invalid JSON (Expecting property name enclosed in double quotes)": 1,
    "row is a list, not an object": 1,
  }
  array = tmp_path / "aime.json"
  array.write_text(json.dumps([good]))
  assert convert("aime24", str(array))[0] == rows
  with pytest.raises(errors.MissingFileError):
    convert("aime24", str(tmp_path / "missing.jsonl"))


def fixture_rows(name):
  return [json.loads(line) for line in open(os.path.join(FIXTURES, name))]


def write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq

  os.makedirs(os.path.dirname(path), exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path)


def convert_folder(name, folder):
  spec = pd.get_spec(name)
  return pd.convert_rows(spec, pd.local_rows(pd.source_files(spec, str(folder), spec.defaults)))


def taco_release(folder, shards):
  """A TACO release folder as `huggingface-cli download` leaves it: the loading script, the card
  and one Parquet file per shard (rows named after their shard)."""
  (folder / ".gitattributes").parent.mkdir(parents=True, exist_ok=True)
  (folder / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
  (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# TACO\n")
  (folder / "TACO.py").write_text("# the release's loading script\n")
  (sum2,) = fixture_rows("taco.jsonl")[:1]
  for shard in shards:
    rows = [dict(sum2, name=f"{shard}#{i}") for i in range(2)]
    write_parquet(str(folder / f"{shard}.parquet"), rows)


def test_taco_release_folder_reads_only_the_train_shards(tmp_path):
  train = ["ALL/train-00000-of-00002", "ALL/train-00001-of-00002"]
  taco_release(tmp_path / "TACO", train + ["ALL/test-00000-of-00001", "EASY/train-00000-of-00001"])
  expected = [f"{shard}#{i}" for shard in train for i in range(2)]
  rows, s = convert_folder("taco", tmp_path / "TACO")
  assert [r["metadata"]["name"] for r in rows] == expected and s.read == 4
  # The configuration's folder alone: its shards' names still tell train from test.
  rows, _ = convert_folder("taco", tmp_path / "TACO" / "ALL")
  assert [r["metadata"]["name"] for r in rows] == expected
  # Without ALL's train shards, nothing else is taken for them (another configuration's either).
  taco_release(tmp_path / "no_all_train", ["ALL/test-00000-of-00001", "EASY/train-00000-of-00001"])
  with pytest.raises(errors.DataError, match=r"BAAI/TACO split 'train'; looked for ALL/train-\*"):
    convert_folder("taco", tmp_path / "no_all_train")


OLYMPIAD_CARD = """---
license: apache-2.0
configs:
- config_name: OE_MM_maths_en_COMP
  data_files:
  - split: train
    path: OE_MM_maths_en_COMP/part-*
- config_name: OE_TO_maths_en_COMP
  data_files:
  - split: train
    path: OE_TO_maths_en_COMP/part-*
- config_name: OE_TO_physics_en_COMP
  data_files: OE_TO_physics_en_COMP/part-*
---
# OlympiadBench
"""


@pytest.mark.parametrize("card", [False, True], ids=["file names", "dataset card"])
def test_olympiadbench_release_folder_reads_only_its_configuration(tmp_path, card):
  """Three configurations of one release; only OE_TO_maths_en_COMP's rows are converted, found by
  the hub's file names (<config>/train-*) or, where the names say nothing, by the card."""
  rows = fixture_rows("olympiadbench.jsonl")
  for offset, config in [(1000, "OE_MM_maths_en_COMP"), (0, "OE_TO_maths_en_COMP"),
                         (5000, "OE_TO_physics_en_COMP")]:  # fmt: skip
    shard = "part-0.parquet" if card else "train-00000-of-00001.parquet"
    write_parquet(str(tmp_path / config / shard), [dict(r, id=r["id"] + offset) for r in rows])
  if card:
    (tmp_path / "README.md").write_text(OLYMPIAD_CARD)
  got, s = convert_folder("olympiadbench", tmp_path)
  assert [r["id"] for r in got] == ["2001", "2002"] and s.read == 2
  if not card:  # the configuration's own folder
    got, _ = convert_folder("olympiadbench", tmp_path / "OE_TO_maths_en_COMP")
    assert [r["id"] for r in got] == ["2001", "2002"]
  os.rename(tmp_path / "OE_TO_maths_en_COMP", tmp_path / "elsewhere")
  with pytest.raises(errors.DataError, match="config OE_TO_maths_en_COMP split 'train'") as e:
    convert_folder("olympiadbench", tmp_path)
  assert "files under OE_TO_maths_en_COMP/ whose path names the split (train" in str(e.value)
  if card:
    assert "OE_TO_maths_en_COMP/part-* (README.md configs)" in str(e.value)


def test_default_configuration_release_folders_follow_the_split_names(tmp_path):
  # aime24 reads the train split of data/; the test shard and the card's own files are left out.
  aime = fixture_rows("aime24.jsonl")
  write_parquet(str(tmp_path / "aime" / "data" / "train-00000-of-00001.parquet"), aime[:1])
  write_parquet(str(tmp_path / "aime" / "data" / "test-00000-of-00001.parquet"), aime[1:])
  rows, _ = convert_folder("aime24", tmp_path / "aime")
  assert [r["id"] for r in rows] == ["2024-I-1"]
  # humaneval_plus reads the test split.
  (he,) = fixture_rows("humanevalplus.jsonl")
  write_parquet(str(tmp_path / "he" / "data" / "test-00000-of-00001.parquet"), [he])
  write_parquet(
    str(tmp_path / "he" / "data" / "train-00000-of-00001.parquet"), [dict(he, task_id="X/1")]
  )
  rows, _ = convert_folder("humaneval_plus", tmp_path / "he")
  assert [r["id"] for r in rows] == ["HumanEval/9000"]
  # A release whose file names name no split is all train, as the hub reads it (DAPO's layout).
  dapo = tmp_path / "dapo"
  write_parquet(str(dapo / "data" / "dapo-math-17k.parquet"), fixture_rows("dapo_math_17k.jsonl"))
  (dapo / ".gitattributes").write_text("")
  rows, s = convert_folder("dapo_math_17k", dapo)
  assert len(rows) == 2 and s.read == 4
  with pytest.raises(errors.DataError, match="whose path names the split \\(test, testing"):
    convert_folder("math500", dapo)


def test_a_folder_of_plain_files_is_read_whole_as_before(tmp_path):
  """Not a release (no card, .gitattributes, shard names or configuration folder): every data
  file is read, whatever its name."""
  aime = fixture_rows("aime24.jsonl")
  (tmp_path / "train.jsonl").write_text(json.dumps(aime[0]) + "\n")
  (tmp_path / "test.jsonl").write_text(json.dumps(aime[1]) + "\n")
  (tmp_path / "README.md").write_text("# my copy of AIME 2024\n")
  assert not pd.is_release_folder(pd.get_spec("aime24"), str(tmp_path))
  rows, _ = convert_folder("aime24", tmp_path)
  assert sorted(r["id"] for r in rows) == ["2024-I-1", "2024-II-15"]
  # What `huggingface-cli download --local-dir` leaves next to the files, or a dataset card's
  # YAML header, makes it a release: its train split is read.
  for marker in ("card", "download"):
    if marker == "card":
      (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# AIME 2024\n")
    else:
      (tmp_path / "README.md").unlink()
      (tmp_path / ".cache" / "huggingface").mkdir(parents=True)
    rows, _ = convert_folder("aime24", tmp_path)
    assert [r["id"] for r in rows] == ["2024-I-1"], marker


def test_hub_loading_is_wired_to_the_registered_ids(monkeypatch):
  calls = []

  def load_dataset(*args, **kwargs):
    calls.append((args, kwargs))
    return [{"problem": "Find $1+1$.", "answer": "2", "url": "x/2024_AIME_I_Problems/Problem_1"}]

  monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
  spec = pd.get_spec("aime24")
  rows, _ = pd.convert_rows(spec, pd.hub_rows(spec, spec.defaults))
  assert rows[0]["id"] == "2024-I-1"
  olymp = pd.get_spec("olympiadbench")
  list(pd.hub_rows(olymp, olymp.defaults))
  taco = pd.get_spec("taco")
  list(pd.hub_rows(taco, taco.defaults))
  assert calls == [
    (("HuggingFaceH4/aime_2024", None), {"split": "train"}),
    (("Hothan/OlympiadBench", "OE_TO_maths_en_COMP"), {"split": "train"}),
    (
      ("parquet",),
      {"data_files": {"train": "hf://datasets/BAAI/TACO/ALL/train-*.parquet"}, "split": "train"},
    ),
  ]

  downloads = []

  def hf_hub_download(repo_id, filename, repo_type):
    downloads.append((repo_id, filename, repo_type))
    return os.path.join(FIXTURES, "livecodebench", filename)

  monkeypatch.setitem(
    sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download)
  )
  lcb = pd.get_spec("livecodebench")
  rows, _ = pd.convert_rows(lcb, pd.hub_rows(lcb, lcb_options()), lcb_options())
  assert len(rows) == 4
  assert downloads == [
    ("livecodebench/code_generation_lite", f, "dataset") for f in ("test.jsonl", "test2.jsonl")
  ]

  def failing(*args, **kwargs):
    raise ConnectionError("no network")

  monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=failing))
  with pytest.raises(errors.UserError, match="pass --source"):
    list(pd.hub_rows(spec, spec.defaults))


# -- the command line and the project's loader ----------------------------------------------------


def run_cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "gppo_jax.prepare_data", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_cli_writes_a_file_the_trainer_loads(tmp_path):
  out = tmp_path / "eval" / "aime24.jsonl"
  res = run_cli("aime24", f"--source={FIXTURES}/aime24.jsonl", f"--out={out}")
  assert res.returncode == 0, res.stderr
  assert res.stdout.strip() == f"aime24: wrote 2 rows to {out} (read 2, skipped 0)"
  ds = data_lib.load_dataset(str(out), task="math")
  assert [(e.id, e.answer) for e in ds.examples] == [("2024-I-1", "33"), ("2024-II-15", "204")]
  assert all(json.loads(line)["benchmark"] == "aime24" for line in open(out))


def test_code_outputs_load_with_the_projects_reader(tmp_path):
  for name, fixture, options in [
    ("livecodebench", "livecodebench", lcb_options()),
    ("taco", "taco.jsonl", None),
    ("humaneval_plus", "humanevalplus.jsonl", None),
    ("mbpp_plus", "mbppplus.jsonl", None),
  ]:
    rows, _ = convert(name, fixture, options)
    path = str(tmp_path / f"{name}.jsonl")
    pd.write_jsonl(rows, path)
    ds = data_lib.load_dataset(path, task="code")
    assert [e.tests for e in ds.examples] == [r["tests"] for r in rows]


def test_written_files_survive_text_utf8_cannot_encode(tmp_path):
  rows = [{"id": "a", "prompt": "caf\u00e9 \ud800", "answer": "1"}]
  pd.write_jsonl(rows, str(tmp_path / "x.jsonl"))
  assert [r for _, r in data_lib.read_rows(str(tmp_path / "x.jsonl"))] == rows
  assert os.listdir(tmp_path) == ["x.jsonl"]


def test_cli_unknown_name_and_bad_flags_are_one_line_errors(tmp_path):
  res = run_cli("aime2024", f"--out={tmp_path}/x.jsonl")
  assert res.returncode == 2
  lines = res.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: unknown dataset 'aime2024'; valid names:")
  assert all(name in lines[0] for name in pd.REGISTRY)
  res = run_cli("aime24", f"--source={FIXTURES}/aime24.jsonl", f"--out={tmp_path}/x.parquet")
  assert res.returncode == 2 and "name it *.jsonl" in res.stderr


# -- the converted code tests run in the sandbox --------------------------------------------------


@pytest.mark.skipif(not ROOT, reason="the isolated sandbox needs root")
def test_converted_code_tests_run_in_the_sandbox():
  from gppo_jax.rewards import code_reward as cr
  from gppo_jax.rewards.sandbox import Sandbox, SandboxConfig

  rows = by_id(convert("livecodebench", "livecodebench", lcb_options())[0])
  rows.update(by_id(convert("taco", "taco.jsonl")[0]))
  rows.update(by_id(convert("humaneval_plus", "humanevalplus.jsonl")[0]))
  rows.update(by_id(convert("humaneval_plus", "humanevalplus_assert_allclose.jsonl")[0]))
  rows.update(by_id(convert("mbpp_plus", "mbppplus.jsonl")[0]))
  solutions = {  # id: (right, wrong)
    "toy001_a": ("print(2 * int(input()))", "print(int(input()))"),
    "9001": ("from typing import *\ndef addPair(nums: List[int], k: int) -> int:\n"
             "    return sum(nums) + k", "def addPair(nums, k):\n    return k"),
    "taco-0": ("a, b = map(int, input().split())\nprint(a + b)", "print(3)"),
    "taco-1": ("def double(x):\n    return 2 * x", "def double(x):\n    return x"),
    "HumanEval/9000": ("from typing import List\ndef mean_of(xs: List[float]) -> float:\n"
                       "    return sum(xs) / len(xs)", "def mean_of(xs):\n    return xs[0]"),
    "HumanEval/9001": ("def halves(xs):\n    return [x * 3 / 6 for x in xs]",  # off by rounding
                       "def halves(xs):\n    return [x / 3 for x in xs]"),
    "Mbpp/9002": ("def shared_items(a, b):\n    return tuple(sorted(set(a) & set(b)))",
                  "def shared_items(a, b):\n    return tuple(a)"),
  }  # fmt: skip
  ids = list(solutions)
  responses = [f"```python\n{solutions[i][k]}\n```" for k in (0, 1) for i in ids]
  with Sandbox(SandboxConfig(timeout_s=5.0, memory_bytes=512 << 20, num_slots=2)) as sandbox:
    results = cr.CodeScorer(sandbox).score_batch(responses, [rows[i]["tests"] for i in ids] * 2)
  right, wrong = results[: len(ids)], results[len(ids) :]
  assert [(i, r.status, r.detail) for i, r in zip(ids, right, strict=True) if r.score != 1.0] == []
  assert [i for i, r in zip(ids, wrong, strict=True) if not (r.valid and r.score < 1.0)] == []
