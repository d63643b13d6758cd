"""Helpers of the parity tests against Hugging Face transformers (test_hf_checkpoint, test_gemma,
test_moe, test_lora): a left-padded batch in the project's position convention, and the torch
model's forward on it."""

import numpy as np


def padded_batch(vocab: int, length: int, rows: int = 2, pad: int = 5, seed: int = 0):
  """(tokens, mask, positions) of `rows` random sequences of `length` ids in [3, vocab), the first
  left-padded by `pad` pad (0) tokens; positions count real tokens from 0 (pads at 0)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, size=(rows, length)).astype(np.int32)
  mask = np.ones((rows, length), bool)
  mask[0, :pad] = False
  tokens[0, :pad] = 0
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def hf_forward(model, tokens, mask, positions, **kwargs):
  """The transformers model's output on a batch (no gradients); kwargs go to its forward."""
  import torch  # noqa: PLC0415

  as_long = lambda x: torch.tensor(np.asarray(x), dtype=torch.long)
  with torch.no_grad():
    return model(
      input_ids=as_long(tokens), attention_mask=as_long(mask), position_ids=as_long(positions),
      **kwargs,
    )  # fmt: skip


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
  """Its float32 logits [B, T, V] as numpy."""
  return hf_forward(model, tokens, mask, positions).logits.float().numpy()
