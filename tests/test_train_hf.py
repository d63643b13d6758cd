"""The training loop on a local Hugging Face folder and JSONL math data, exported back to HF."""

import importlib.util
import json
import os

import jax
import numpy as np
import torch
import transformers

from gppo_jax import evaluate, train
from gppo_jax.models import hf_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = (
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_hf_folder(path):
  """A tiny random Qwen2 model with a BPE tokenizer trained here, saved as a Hugging Face folder."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(["What is 12 + 30? The answer is \\boxed{42}."] * 20, trainer)
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=True,
  )
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(
      {
        "chat_template": CHATML,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
      },
      f,
    )


def test_train_on_hf_folder_and_jsonl_math(tmp_path):
  model_dir = str(tmp_path / "model")
  make_hf_folder(model_dir)
  rows = [
    {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
    for a, b in [(12, 30), (1, 2), (7, 5), (20, 22), (3, 3), (9, 9), (11, 1), (4, 8)]
  ]
  train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  train_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  eval_path.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
  eval2 = tmp_path / "other.jsonl"
  eval2.write_text("".join(json.dumps(r) + "\n" for r in rows[4:7]))

  spec = importlib.util.spec_from_file_location("cfg", os.path.join(REPO, "configs", "ppo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  c.model.path = model_dir
  c.model.export_hf = True
  c.data.train_path = str(train_path)
  c.data.eval_path = f"easy={eval_path},{eval2}"  # NAME=PATH, or a path named by its stem
  c.data.verifier_workers = 1
  c.rollout.prompts_per_iter = 4
  c.rollout.max_new_tokens = 8
  c.iterations = 2
  c.eval.k = 2
  wd = str(tmp_path / "run")
  summary = train.train_and_evaluate(c, wd)
  assert summary["iterations"] == 2
  lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  assert [x["step"] for x in lines] == [0, 1, 2]
  # Math rewards come from the verifier, with a count per status.
  statuses = {k for k in lines[1] if k.startswith("reward/status_")}
  assert {"reward/status_ok", "reward/status_wrong", "reward/status_no_answer"} <= statuses
  assert sum(lines[1][k] for k in statuses) == c.rollout.prompts_per_iter * c.rollout.group_size
  # One report per benchmark besides the overall figures.
  ev = summary["initial_eval"]
  for name in ("eval", "eval/easy", "eval/other"):
    assert {f"{name}/accuracy", f"{name}/avg@2", f"{name}/pass@2"} <= set(ev), ev.keys()
  n_easy, n_other = 4, 3
  np.testing.assert_allclose(
    ev["eval/accuracy"],
    (n_easy * ev["eval/easy/accuracy"] + n_other * ev["eval/other/accuracy"]) / 7,
  )
  # The trained policy is written back as a Hugging Face folder that our loader and
  # transformers both read, with the tokenizer files alongside.
  from flax import nnx

  exported = nnx.state(hf_checkpoint.load_model(os.path.join(wd, "hf_export")))
  initial = nnx.state(hf_checkpoint.load_model(model_dir))
  shapes = lambda s: [np.shape(x) for x in jax.tree.leaves(s)]
  assert shapes(exported) == shapes(initial)
  assert os.path.exists(os.path.join(wd, "hf_export", "tokenizer.json"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(wd, "hf_export"))
  # `python -m gppo_jax.evaluate --checkpoint=...`: the exported folder scores like the checkpoint.
  from_ckpt = evaluate.evaluate_checkpoint(c, wd, "latest")
  from_hf = evaluate.evaluate_checkpoint(c, wd, os.path.join(wd, "hf_export"))
  assert from_ckpt["metrics"]["eval/easy/accuracy"] == from_hf["metrics"]["eval/easy/accuracy"]
  assert from_hf["protocol"]["k"] == [2] and "eval/other/pass@2" in from_hf["metrics"]
  assert reloaded.config.vocab_size == 300
