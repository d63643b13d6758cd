"""The word-level built-in task `wordchain`: tokenizer, problems, reward, config, smoke run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_train import load_config

from gppo_jax import config_lib, errors, sweep, train
from gppo_jax.data import envs, tasks

TASK = tasks.get("wordchain")


def test_the_vocabulary_is_word_level_large_and_fixed():
  tok = TASK.tokenizer()
  assert tok.vocab_size >= 4096
  assert tok.vocab_size == 3 + len(set(tok.words))  # distinct words after pad, bos, eos
  assert all(len(w.split()) == 1 for w in tok.words)
  # Built in code, the same on every machine and in every process: pinned words.
  assert [tasks.synthetic_word(i) for i in range(3)] == ["badi", "furo", "lugu"]
  assert tasks.WordChain("other").tokenizer().words == tok.words
  # Every word class has class_size distinct synonyms, no word in two classes.
  classes = [set(TASK.word_class(c)) for c in range(TASK.num_classes)]
  assert all(len(c) == TASK.class_size for c in classes)
  assert len(set().union(*classes)) == TASK.class_size * TASK.num_classes


def test_the_tokenizer_round_trips_and_rejects_bad_input():
  tok = TASK.tokenizer()
  for p in TASK.sample(np.random.default_rng(0), 50):
    for text in (p.prompt, p.solution):
      ids = tok.encode(text)
      assert min(ids) >= 3 and tok.decode(ids) == text
    assert tok.encode(p.prompt, add_bos=True)[0] == tok.bos_id
  ids = tok.encode("start 4")
  assert tok.decode([tok.pad_id, tok.bos_id, *ids, tok.eos_id, *ids]) == "start 4"
  assert tok.decode([tok.bos_id, *ids, tok.eos_id], skip_special=False) == "<bos> start 4 <eos>"
  assert tok.encode("  start \n 4 ") == ids  # any whitespace separates words
  with pytest.raises(ValueError, match=r"\['zzz'\] are not in the task vocabulary"):
    tok.encode("start zzz 4")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="distinct"):
    tasks.WordTokenizer(["a", "b", "a"])
  with pytest.raises(ValueError, match="without whitespace"):
    tasks.WordTokenizer(["a b"])


def _chain(prompt: str) -> list[int]:
  """The states of a prompt's program, computed from its text alone."""
  words = prompt.split()
  assert words[0] == "start" and words[-1] == "?"
  state, out = int(words[1]), []
  for k, (label, op) in enumerate(zip(words[2:-1:2], words[3:-1:2], strict=True)):
    assert label == f"s{k + 1}"
    state = (state + int(op)) % 10
    out.append(state)
  return out


def test_problems_are_deterministic_split_and_solved_by_their_solutions():
  a = TASK.sample(np.random.default_rng(3), 200)
  assert a == TASK.sample(np.random.default_rng(3), 200)  # prompts, answers and solutions
  assert [p.prompt for p in a] != [p.prompt for p in TASK.sample(np.random.default_rng(4), 200)]
  ev = TASK.eval_set(200)
  assert ev == TASK.eval_set(200) and not {p.prompt for p in ev} & {p.prompt for p in a}
  for p in a + ev:
    states = _chain(p.prompt)
    assert len(states) == TASK.steps and p.answer == str(states[-1])
    assert TASK.states(p.solution) == states  # the worked steps are the program's states
    assert TASK.reward(p.solution, p) == 1.0
    assert len(p.prompt.split()) == TASK.max_prompt_len
    assert len(p.solution.split()) <= TASK.max_answer_len
  with pytest.raises(ValueError, match="split must be"):
    TASK.sample(np.random.default_rng(0), 1, split="test")


def test_responses_average_at_least_64_tokens():
  lengths = [len(p.solution.split()) + 1 for p in TASK.sample(np.random.default_rng(0), 1000)]
  assert np.mean(lengths) >= 64 and TASK.mean_answer_len + 1 >= 64  # the end token included
  assert abs(np.mean(lengths) - (TASK.mean_answer_len + 1)) < 1.0


def test_the_reward_checks_the_final_answer():
  p = TASK.sample(np.random.default_rng(1), 1)[0]
  wrong = str((int(p.answer) + 1) % 10)
  marker, verb = tasks.ANSWER, tasks.VERB
  assert TASK.reward(f"{marker} {p.answer}", p) == 1.0  # only the final answer is read
  assert TASK.reward(f" {marker}  {p.answer} ", p) == 1.0
  assert TASK.reward(p.solution[: -len(p.answer)] + wrong, p) == 0.0  # the wrong state
  assert TASK.reward(f"{verb} {p.answer}", p) == 0.0  # not the answer marker
  assert TASK.reward(f"{TASK.word_class(0)[0]} {p.answer}", p) == 0.0
  assert TASK.reward(f"{marker} {p.answer} {marker}", p) == 0.0  # not at the end
  assert TASK.reward(p.answer, p) == 0.0 and TASK.reward("", p) == 0.0
  # A response that breaks the language scores on its answer, but does not parse.
  assert TASK.states(p.solution.replace(" s2 ", " s3 ", 1)) is None
  assert TASK.states(f"{marker} {p.answer}") is None


def test_bad_task_parameters_are_named():
  with pytest.raises(ValueError, match="steps=0"):
    tasks.WordChain("bad", steps=0)
  with pytest.raises(ValueError, match="need more than the 4900 synthetic words"):
    tasks.WordChain("bad", class_size=700)
  with pytest.raises(ValueError, match="phrase_slots"):
    tasks.WordChain("bad", phrase_slots=(0.5, 0.0))
  with pytest.raises(ValueError, match="outside"):
    tasks.synthetic_word(4900)


def test_the_env_serves_word_prompts():
  env = envs.BuiltinEnv("wordchain", seed=0, eval_size=8)
  assert isinstance(env.tokenizer, tasks.WordTokenizer)
  assert env.max_new_tokens == TASK.max_answer_len + 1
  prompts = env.train_prompts(4)
  assert all(len(p.token_ids) == env.max_prompt_len for p in prompts)
  texts = [f"{tasks.ANSWER} {p.gold}" for p in prompts]
  rewards, valid, _ = env.score(texts + ["nothing"] * 4, prompts + prompts)
  assert rewards.tolist() == [1.0] * 4 + [0.0] * 4 and valid.all()


def test_task_argument_sets_the_run_and_a_bare_task_name_is_refused():
  c = load_config("kl_atomic.py", "task=wordchain")
  config_lib.validate(c)
  assert c.rollout.max_new_tokens == TASK.max_answer_len + 1
  for field, value in config_lib.TASK_RUNS["wordchain"].items():
    section, key = field.split(".") if "." in field else (None, field)
    assert (c if section is None else c[section])[key] == value
  smoke = load_config("kl_atomic.py", "smoke,task=wordchain")
  assert smoke.rollout.max_new_tokens == TASK.max_answer_len + 1 and smoke.iterations == 3
  assert load_config("kl_atomic.py", "task=addsub3").rollout.max_new_tokens == 8  # unchanged
  bare = load_config("kl_atomic.py")
  bare.task.name = "wordchain"  # `--config.task.name=wordchain`: the base's 8-token responses
  with pytest.raises(errors.ConfigError, match="task=wordchain"):
    config_lib.validate(bare)


def test_the_sweep_runs_the_grid_on_the_task(tmp_path, capsys):
  out = str(tmp_path / "sw")
  assert sweep.main(["--task", "wordchain", "--cells", "kl_atomic,none", "--seeds", "0",
                     "--out", out, "--dry-run"]) == 0  # fmt: skip
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2 and all("configs/base.py:task=wordchain" in line for line in lines)
  with pytest.raises(errors.UnknownNameError, match="wordchian"):
    sweep.main(["--task", "wordchian", "--out", out, "--dry-run"])
  # A folder's task is part of its shared settings: resuming it without --task is refused.
  settings = sweep.Settings(out, task="wordchain")
  os.makedirs(out)
  with open(os.path.join(out, "sweep.json"), "w") as f:
    json.dump(sweep.check_sweep_folder(settings), f)
  with pytest.raises(errors.ConfigError, match="--task"):
    sweep.check_sweep_folder(sweep.Settings(out))
  assert sweep.check_sweep_folder(settings)["task"] == "wordchain"


def test_a_smoke_run_trains_on_the_task(tmp_path):
  c = load_config("kl_atomic.py", "smoke,task=wordchain")
  c.iterations = 2
  c.rollout.prompts_per_iter = 4
  c.train.minibatches = 2
  c.warmstart.max_steps = 4
  c.warmstart.eval_every = 4
  c.warmstart.eval_size = 8
  c.warmstart.batch_size = 8
  c.eval.every = 2
  c.eval.num_problems = 8
  c.eval.k = 0  # greedy only: one sampler program fewer to compile
  c.diagnostics.every = 1
  summary = train.train_and_evaluate(c, str(tmp_path / "run"))
  assert summary["iterations_done"] == 2
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  lengths = [r["response/length_mean"] for r in rows if "response/length_mean" in r]
  # Word-level responses: far longer than the base's 8 tokens, never beyond the task's longest.
  assert len(lengths) == 2 and all(8 < n <= TASK.max_answer_len + 1 for n in lengths)
  assert any(k.startswith("diag/") for r in rows for k in r)
