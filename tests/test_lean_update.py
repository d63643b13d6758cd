"""The update's work cuts, each leaving its result unchanged.

Shared prompts (train.shuffle="groups"): each group's prompt runs through the model once; hidden
states, log-probs and gradients equal the row-by-row forward, every epoch keeps the groups whole,
and the config refuses a batch that does not split into whole groups. Trimmed padding
(train.trim_bucket): the columns that are padding in every row are cut, and the update's
parameters and metrics stay the same."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gppo_jax import config_lib, errors
from gppo_jax.algorithm import objective
from gppo_jax.models import architectures, attention, model
from gppo_jax.trainer import train_step

CFG = architectures.get("tiny", attention_bias=True, qk_norm=True, family="qwen3")
G, P, R = 4, 6, 5  # group size, prompt slots, response slots


@pytest.fixture(scope="module")
def state(policy):
  """conftest's `policy` weights (this CFG)."""
  return nnx.state(policy)


def _batch(groups=3, seed=0, longest=R) -> train_step.Batch:
  """Groups of G responses to one left-padded prompt (prompt lengths differ between groups),
  responses of every length from 1 to `longest` (right-padded to R; the first row is that long)."""
  rng = np.random.default_rng(seed)
  n = groups * G
  prompt_len = rng.integers(1, P + 1, groups)
  prompt_mask = np.arange(P)[None] >= (P - prompt_len)[:, None]
  prompts = np.where(prompt_mask, rng.integers(3, CFG.vocab_size, (groups, P)), CFG.pad_token_id)
  resp_len = np.minimum(rng.integers(1, R + 1, n), longest)
  resp_len[0] = longest
  resp_mask = np.arange(R)[None] < resp_len[:, None]
  resp = np.where(resp_mask, rng.integers(3, CFG.vocab_size, (n, R)), CFG.pad_token_id)
  return train_step.build_batch(
    np.repeat(prompts, G, 0),
    np.repeat(prompt_mask, G, 0),
    resp,
    resp_mask,
    logq=np.where(resp_mask, rng.uniform(-3.0, -0.5, (n, R)), 0.0),
    adv=rng.standard_normal(n),
  )


def _graphdef(attention):
  return model.abstract_graphdef(dataclasses.replace(CFG, attention=attention))


def _spy_packed(monkeypatch):
  """Counts the packed-group masks shared_prompt_hidden builds (its packed attention path)."""
  calls = []
  real = attention.shared_prefix_allowed
  monkeypatch.setattr(attention, "shared_prefix_allowed", lambda *a: calls.append(a) or real(*a))
  return calls


@pytest.mark.parametrize("attention_impl", ["dense", "blockwise"])
def test_hidden_states_equal_the_row_forward(state, attention_impl, monkeypatch):
  b = _batch()
  m = nnx.merge(_graphdef(attention_impl), state)
  rows = m(b.inputs, b.positions, attn_mask=b.attn).hidden[:, P - 1 :]
  packed = _spy_packed(monkeypatch)
  shared = m.shared_prompt_hidden(b.inputs, b.positions, b.attn, prompt_len=P, group_size=G).hidden
  # Dense attends on the packed groups (22 tokens, scores 484 per group against the rows'
  # 4 x 100); blockwise on the rows.
  assert len(packed) == (attention_impl == "dense")
  assert shared.shape == rows.shape == (b.num_rows, R, CFG.hidden_size)
  # Position 0 (the last prompt token) and every real response input; pads are ignorable.
  real = np.concatenate([np.ones((b.num_rows, 1), bool), b.attn[:, P:]], axis=1)
  chex.assert_trees_all_close(
    np.where(real[..., None], shared, 0), np.where(real[..., None], rows, 0), atol=2e-5
  )


@pytest.mark.parametrize("attention_impl", ["dense", "blockwise"])
def test_loss_and_gradients_equal_the_row_forward(state, attention_impl):
  """The update's loss through the chunked head: same value, same gradient for every parameter
  (the prompt's gradient is summed over its G rows through the broadcast)."""
  b = jax.tree.map(jnp.asarray, _batch(seed=1))
  graphdef = _graphdef(attention_impl)
  loss_cfg = objective.LossConfig(
    divergence="kl", estimator="atomic", delta_low=0.2, delta_high=0.25
  )

  def loss(params, group_size):
    stats = train_step._response_stats(
      nnx.merge(graphdef, params), b, prompt_len=P, temperature=0.9, group_size=group_size
    )
    value, _ = objective.policy_loss(stats["logprobs"], b.logq, b.adv, b.mask, loss_cfg)
    return value, stats["logprobs"]

  (v_rows, logp_rows), g_rows = jax.value_and_grad(loss, has_aux=True)(state, 1)
  (v_shared, logp_shared), g_shared = jax.value_and_grad(loss, has_aux=True)(state, G)
  np.testing.assert_allclose(
    np.where(b.mask, logp_shared, 0), np.where(b.mask, logp_rows, 0), atol=2e-5
  )
  np.testing.assert_allclose(v_shared, v_rows, rtol=1e-5, atol=1e-7)
  assert float(optax_norm(g_rows)) > 0
  chex.assert_trees_all_close(g_shared, g_rows, atol=2e-5, rtol=1e-4)


def test_packed_group_mask_is_each_rows_own_mask():
  """shared_prefix_allowed on a packed group equals, token for token, the causal padding mask of
  the row each token belongs to (a prefix token: any row; nothing across continuations)."""
  rng = np.random.default_rng(3)
  prefix, copies, cont = 5, 3, 4
  prompt_real = np.arange(prefix) >= 2  # left padding
  cont_real = np.arange(cont)[None] < rng.integers(1, cont + 1, copies)[:, None]
  packed_mask = np.concatenate([prompt_real, cont_real.reshape(-1)])[None]
  got = np.asarray(attention.shared_prefix_allowed(jnp.asarray(packed_mask), prefix, copies))[0]
  rows = np.asarray(
    attention.self_allowed(
      jnp.asarray(
        np.concatenate([np.broadcast_to(prompt_real, (copies, prefix)), cont_real], axis=1)
      )
    )
  )  # [copies, L, L]
  where = [(None, a) for a in range(prefix)]  # packed index -> (row or None for prefix, column)
  where += [(c, prefix + r) for c in range(copies) for r in range(cont)]
  for a, (row_a, col_a) in enumerate(where):
    for b, (row_b, col_b) in enumerate(where):
      row = row_a if row_a is not None else row_b
      if row_a is not None and row_b is not None and row_a != row_b:
        want = a == b  # never across continuations
      elif row_a is None and row_b is not None:
        want = False  # a prefix query never sees a continuation
      else:
        want = rows[0 if row is None else row][col_a, col_b]
      assert got[a, b] == want, (a, b)
  with pytest.raises(ValueError, match="equal parts"):
    attention.shared_prefix_allowed(jnp.asarray(packed_mask[:, :-1]), prefix, copies)


def test_packed_attention_only_where_its_scores_are_few(state, monkeypatch):
  """Long responses after a short prompt make the packed group's scores (P + G R)^2 more than
  twice the rows' G (P + R)^2: dense attention then runs on the rows, with the same result."""
  rng = np.random.default_rng(5)
  n, p_len, r_len = 2 * G, 1, 12
  prompts = np.repeat(rng.integers(3, CFG.vocab_size, (2, p_len)), G, 0)
  resp_mask = np.arange(r_len)[None] < rng.integers(1, r_len + 1, n)[:, None]
  b = train_step.build_batch(
    prompts, np.ones_like(prompts, bool), rng.integers(3, CFG.vocab_size, (n, r_len)),
    resp_mask, logq=np.zeros((n, r_len)), adv=np.zeros(n),
  )  # fmt: skip
  m = nnx.merge(_graphdef("dense"), state)
  rows = m(b.inputs, b.positions, attn_mask=b.attn).hidden[:, p_len - 1 :]
  packed = _spy_packed(monkeypatch)
  shared = m.shared_prompt_hidden(
    b.inputs, b.positions, b.attn, prompt_len=p_len, group_size=G
  ).hidden
  assert not packed  # 45^2 = 2025 > 2 * 4 * 12^2 = 1152
  real = np.concatenate([np.ones((n, 1), bool), b.attn[:, p_len:]], axis=1)
  chex.assert_trees_all_close(
    np.where(real[..., None], shared, 0), np.where(real[..., None], rows, 0), atol=2e-5
  )


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(tree)))


def test_shapes_that_do_not_make_groups_are_refused(state):
  b = _batch()
  m = nnx.merge(_graphdef("dense"), state)
  with pytest.raises(ValueError, match="groups of 5"):
    m.shared_prompt_hidden(b.inputs, b.positions, b.attn, prompt_len=P, group_size=5)


@pytest.mark.parametrize("group_size", [1, 4])
def test_epoch_permutation_keeps_groups_whole(group_size):
  key = jax.random.key(7)
  perm = np.asarray(train_step.epoch_permutation(key, 32, group_size))
  assert sorted(perm) == list(range(32))
  blocks = perm.reshape(-1, group_size)
  # Each block of group_size is one group, in order.
  assert np.all(blocks % group_size == np.arange(group_size))
  assert np.all(blocks // group_size == blocks[:, :1] // group_size)
  assert len({tuple(b) for b in blocks}) == 32 // group_size
  if group_size == 1:  # the row shuffle of train.shuffle="rows", as before groups existed
    np.testing.assert_array_equal(perm, np.asarray(jax.random.permutation(key, 32)))


def test_update_with_groups_trains_like_rows(state):
  """One update (2 epochs x 2 mini-batches) of each shuffle on the same batch: both finite, both
  move the parameters, and the groups update's mini-batches hold whole groups (each reports
  the loss over exactly half the groups' tokens)."""
  b = jax.tree.map(jnp.asarray, _batch(groups=4, seed=2))
  graphdef = _graphdef("dense")
  tx = train_step.make_optimizer(lr=1e-2, total_steps=4)
  loss_cfg = objective.LossConfig(
    divergence="kl", estimator="atomic", delta_low=0.2, delta_high=0.25
  )
  results = {}
  for g in (1, G):
    spec = train_step.UpdateSpec(prompt_len=P, loss=loss_cfg, epochs=2, minibatches=2, group_size=g)
    update = jax.jit(train_step.make_update_fn(graphdef, tx, spec))
    st = train_step.TrainState(params=state, opt_state=tx.init(state), step=jnp.int32(0))
    new, metrics = update(st, b, jax.random.key(0))
    results[g] = (new, metrics)
    assert int(new.step) == 4
    assert np.all(np.isfinite(np.asarray(metrics["loss/total"])))
    assert float(optax_norm(jax.tree.map(jnp.subtract, new.params, state))) > 1e-4
  counts = np.asarray(results[G][1]["loss/count"]).reshape(2, 2)
  group_tokens = np.asarray(b.mask).reshape(4, G, R).sum(axis=(1, 2))
  pair_sums = {group_tokens[i] + group_tokens[j] for i in range(4) for j in range(i + 1, 4)}
  np.testing.assert_array_equal(counts.sum(1), group_tokens.sum())  # each epoch: every token
  assert all(c in pair_sums for c in counts.reshape(-1))
  with pytest.raises(ValueError, match="whole groups of 4"):
    spec = train_step.UpdateSpec(prompt_len=P, loss=loss_cfg, minibatches=3, group_size=G)
    train_step.make_update_fn(graphdef, tx, spec)(st, b, jax.random.key(0))


def test_config_shuffle_field():
  c = config_lib.base()
  assert c.train.shuffle == "groups"
  spec = train_step.update_spec_from_config(c, 9, 8)
  assert spec.group_size == c.rollout.group_size
  c.train.shuffle = "rows"
  assert train_step.update_spec_from_config(c, 9, 8).group_size == 1
  config_lib.validate(c)
  c.train.shuffle = "prompts"
  with pytest.raises(errors.ConfigError, match="train.shuffle"):
    config_lib.validate(c)
  c = config_lib.base()
  c.rollout.prompts_per_iter, c.rollout.group_size, c.train.minibatches = 6, 8, 4
  with pytest.raises(errors.ConfigError, match="keeps groups whole"):
    config_lib.validate(c)
  c.train.shuffle = "rows"
  config_lib.validate(c)  # 48 rows do split into 4 mini-batches of single rows


def test_response_extent_and_trim(state):
  b = _batch(groups=2, seed=3)  # one row has all R tokens
  assert train_step.response_extent(b, P) == R
  assert train_step.trim_responses(b, P, R) is b
  # Rows of at most 3 tokens: 3 columns hold real tokens; the cut keeps every real token.
  short = _batch(groups=2, seed=3, longest=3)
  assert train_step.response_extent(short, P) == 3
  cut = train_step.trim_responses(short, P, 3)
  assert cut.inputs.shape == (short.num_rows, P + 2) and cut.logq.shape == (short.num_rows, 3)
  assert int(np.asarray(cut.mask).sum()) == int(np.asarray(short.mask).sum())
  np.testing.assert_array_equal(cut.targets, np.asarray(short.targets)[:, : P + 2])
  # Only padding (one token per row, the extent is 1) still leaves one column.
  one = np.arange(R)[None] < 1
  tiny = train_step.build_batch(
    np.asarray(short.inputs)[:, :P], np.asarray(short.attn)[:, :P],
    np.where(one, 5, 0).repeat(short.num_rows, 0), one.repeat(short.num_rows, 0),
    logq=np.zeros((short.num_rows, R)), adv=np.asarray(short.adv),
  )  # fmt: skip
  assert train_step.response_extent(tiny, P) == 1
  # Cut to that one column, the inputs are the prompt alone: both forwards still give the hidden
  # state that predicts the first token.
  one_col = jax.tree.map(jnp.asarray, train_step.trim_responses(tiny, P, 1))
  assert one_col.inputs.shape == (short.num_rows, P)
  m = nnx.merge(_graphdef("dense"), state)
  rows = m(one_col.inputs, one_col.positions, attn_mask=one_col.attn).hidden[:, P - 1 :]
  shared = m.shared_prompt_hidden(
    one_col.inputs, one_col.positions, one_col.attn, prompt_len=P, group_size=G
  ).hidden
  assert shared.shape == rows.shape == (short.num_rows, 1, CFG.hidden_size)
  chex.assert_trees_all_close(shared, rows, atol=2e-5)


@pytest.mark.parametrize("group_size", [1, G])
def test_trimmed_update_equals_the_full_one(state, group_size):
  """The same update on the batch and on its trimmed copy: parameters and every metric agree."""
  full = _batch(groups=4, seed=4, longest=3)
  cut = train_step.trim_responses(full, P, train_step.response_extent(full, P))
  assert cut.logq.shape[1] == 3
  graphdef = _graphdef("dense")
  # Plain SGD: the parameters move linearly in the gradients (Adam would blow float noise in
  # near-zero gradients up to whole steps).
  tx = optax.sgd(0.5)
  loss_cfg = objective.LossConfig(
    divergence="kl", estimator="atomic", delta_low=0.2, delta_high=0.25
  )
  spec = train_step.UpdateSpec(
    prompt_len=P, loss=loss_cfg, epochs=2, minibatches=2, group_size=group_size
  )
  update = jax.jit(train_step.make_update_fn(graphdef, tx, spec))
  out = {}
  for name, b in (("full", full), ("cut", cut)):
    st = train_step.TrainState(params=state, opt_state=tx.init(state), step=jnp.int32(0))
    out[name] = update(st, jax.tree.map(jnp.asarray, b), jax.random.key(1))
  moved = lambda p: np.concatenate(
    [np.ravel(a - b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(state), strict=True)]
  )
  step_full, step_cut = moved(out["full"][0].params), moved(out["cut"][0].params)
  assert np.abs(step_full).max() > 1e-3
  assert np.abs(step_cut - step_full).max() < 1e-3 * np.abs(step_full).max()
  chex.assert_trees_all_close(out["cut"][1], out["full"][1], atol=1e-5, rtol=1e-3)


def test_trainer_warns_when_groups_do_not_split_over_the_devices(caplog):
  from gppo_jax import train
  from gppo_jax.models import sharding

  c = config_lib.base()
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})  # the 8 simulated devices
  spec = train_step.update_spec_from_config(c, 9, 8)
  with caplog.at_level("WARNING", logger="gppo_jax"):
    train._check_group_split(c, spec, mesh)  # 64 prompts / 4 mini-batches: 16 groups over 8
  assert not caplog.records
  c.rollout.prompts_per_iter = 12  # 3 groups per mini-batch
  with caplog.at_level("WARNING", logger="gppo_jax"):
    train._check_group_split(c, train_step.update_spec_from_config(c, 9, 8), mesh)
  assert "3 groups, which do not split over the 8" in caplog.text
  c.train.shuffle = "rows"  # rows split however they come: no warning
  caplog.clear()
  with caplog.at_level("WARNING", logger="gppo_jax"):
    train._check_group_split(c, train_step.update_spec_from_config(c, 9, 8), mesh)
  assert not caplog.records
