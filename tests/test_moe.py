"""Qwen3-MoE: the router and experts against transformers' Qwen3MoeForCausalLM on a tiny random
model (logits, load-balancing loss, export round trip, the sampler), the two dispatches, routing
replay, expert parallelism on the 8 simulated devices."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_parity import hf_forward, padded_batch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from gppo_jax import errors
from gppo_jax.generation import sampler
from gppo_jax.models import architectures, hf_checkpoint, moe, partitioning, sharding
from gppo_jax.models import heads as heads_lib
from gppo_jax.models import lora as lora_lib
from gppo_jax.models import model as model_lib

T = 12
E, K = 8, 2

# Layer 1 keeps a dense MLP (mlp_only_layers): a mixed model, each layer's kind picked in the scan.
HF_CONFIG = dict(
  vocab_size=128,
  hidden_size=32,
  intermediate_size=48,
  moe_intermediate_size=24,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  num_experts=E,
  num_experts_per_tok=K,
  norm_topk_prob=True,
  decoder_sparse_step=1,
  mlp_only_layers=[1],
  max_position_embeddings=256,
  rope_theta=10000.0,
  bos_token_id=2,
  eos_token_id=1,
  pad_token_id=0,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, folder) of a tiny random Qwen3-MoE saved by save_pretrained."""
  torch.manual_seed(0)
  cfg = transformers.Qwen3MoeConfig(**HF_CONFIG)
  cfg._attn_implementation = "eager"
  m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():  # random everything, norms and router too, so the mappings matter
    for _, p in m.named_parameters():
      p.copy_(0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("qwen3_moe")
  m.save_pretrained(path)
  return m, path


def _batch(B=2):
  return padded_batch(128, T, rows=B, pad=3)


def _hf(m, tokens, mask, positions):
  out = hf_forward(m, tokens, mask, positions, output_router_logits=True)
  return out.logits.float().numpy(), out


@nnx.jit
def _forward(policy, tokens, mask, positions):
  out = policy(tokens, positions, attn_mask=mask)
  return policy.logits(out.hidden), out.routing


def test_config_mapping():
  m_cfg = architectures.config_from_hf({**HF_CONFIG, "architectures": ["Qwen3MoeForCausalLM"]})
  assert m_cfg.family == "qwen3_moe" and m_cfg.qk_norm and m_cfg.dense_layers == (1,)
  assert (m_cfg.num_experts, m_cfg.num_experts_per_tok, m_cfg.moe_intermediate_size) == (E, K, 24)
  assert architectures.config_from_hf(architectures.config_to_hf(m_cfg)) == m_cfg
  # decoder_sparse_step 2: layers 0 and 2 dense; transformers 5's num_local_experts spelling.
  hf = transformers.Qwen3MoeConfig(**{**HF_CONFIG, "mlp_only_layers": [], "decoder_sparse_step": 2})
  assert "num_local_experts" in hf.to_dict()
  assert architectures.config_from_hf(hf.to_dict()).dense_layers == (0, 2)
  big = architectures.get("qwen3-30b-a3b")
  assert architectures.config_from_hf(architectures.config_to_hf(big)) == big
  with pytest.raises(ValueError, match="num_experts_per_tok=9"):
    architectures.get("qwen3-30b-a3b", num_experts=8, num_experts_per_tok=9)
  with pytest.raises(ValueError, match="moe_dispatch"):
    architectures.get("qwen3-30b-a3b", moe_dispatch="capacity")
  with pytest.raises(ValueError, match="dense_layers needs num_experts"):
    architectures.get("tiny", dense_layers=(0,))
  # LoRA adapts a mixture of experts' attention only (no expert, router or dense MLP).
  assert architectures.get("char-tiny-moe", lora_rank=4).lora_weights == ("wq", "wk", "wv", "wo")


@pytest.mark.user_xla
@pytest.mark.parametrize("dispatch", ["sorted", "dense"])
def test_logits_and_aux_loss_match_transformers(saved, dispatch):
  hf, path = saved
  policy = hf_checkpoint.load_model(path, moe_dispatch=dispatch)
  assert policy.cfg.family == "qwen3_moe" and policy.cfg.dense_layers == (1,)
  batch = _batch()
  want, out = _hf(hf, *batch)
  logits, routing = _forward(policy, *batch)
  mask = batch[1]
  np.testing.assert_allclose(np.asarray(logits)[mask], want[mask], atol=1e-4, rtol=1e-4)
  # The experts chosen: transformers' top-k of its router logits, layers 0 and 2.
  ids = np.asarray(routing.expert_ids)  # [B, T, L, k]
  assert (ids[:, :, 1] == -1).all()
  for j, layer in enumerate((0, 2)):
    probs = torch.softmax(out.router_logits[j].float(), -1)
    hf_ids = torch.topk(probs, K, -1).indices.numpy().reshape(2, T, K)
    np.testing.assert_array_equal(ids[:, :, layer][mask], hf_ids[mask])
  aux = modeling_qwen3_moe.load_balancing_loss_func(
    out.router_logits, E, K, torch.tensor(mask, dtype=torch.long)
  )
  np.testing.assert_allclose(float(routing.aux_loss), float(aux), rtol=1e-5)


def test_export_round_trip(saved, tmp_path):
  hf, path = saved
  policy = hf_checkpoint.load_model(path)
  assert not policy.layers.router[...][1].any()  # the dense layer's expert weights: zeros
  out = hf_checkpoint.save_model(policy, tmp_path / "export", source=path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  batch = _batch()
  mask = batch[1]
  want = _hf(hf, *batch)[0]
  np.testing.assert_allclose(_hf(reloaded.eval(), *batch)[0][mask], want[mask], atol=1e-5)
  assert hf_checkpoint.load_model(out).cfg == policy.cfg
  names = dict(hf_checkpoint.hf_tensors(policy))
  assert "model.layers.2.mlp.experts.7.down_proj.weight" in names
  assert "model.layers.1.mlp.gate.weight" not in names
  assert "model.layers.0.mlp.up_proj.weight" not in names
  bare = hf_checkpoint.save_model(policy, tmp_path / "bare")  # no source config.json
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(bare, attn_implementation="eager")
  np.testing.assert_allclose(_hf(reloaded.eval(), *batch)[0][mask], want[mask], atol=1e-5)


def test_routing_replay_forces_experts_and_keeps_router_gradients(saved):
  _, path = saved
  policy = hf_checkpoint.load_model(path)
  tokens, mask, positions = _batch()
  graphdef, params = nnx.split(policy)
  _, routing = _forward(policy, tokens, mask, positions)
  ids = np.asarray(routing.expert_ids)

  def loss(params, forced):
    m = nnx.merge(graphdef, params)
    out = m(tokens, positions, attn_mask=mask, expert_ids=forced)
    return jnp.sum(jnp.where(mask[..., None], m.logits(out.hidden), 0.0) ** 2) * 1e-3, out.routing

  # Forcing the experts it chose changes nothing.
  (l0, _), g0 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, jnp.asarray(ids))
  (l1, _), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, None)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  np.testing.assert_allclose(g0["layers"]["router"][...], g1["layers"]["router"][...], atol=1e-6)
  # Other experts: they are used (the routing says so and the loss moves), and the router
  # still gets a gradient; -1 rows route themselves.
  other = np.where(ids >= 0, (ids + 1) % E, ids)
  other[1] = -1
  (l2, r2), g2 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, jnp.asarray(other))
  np.testing.assert_array_equal(np.asarray(r2.expert_ids)[0], other[0])
  np.testing.assert_array_equal(np.asarray(r2.expert_ids)[1], ids[1])
  assert abs(float(l2) - float(l0)) > 1e-4
  assert np.abs(np.asarray(g2["layers"]["router"][...])).max() > 1e-5


@pytest.mark.user_xla
def test_sampler_logprobs_and_routes_match_the_trainer(saved):
  """The KV-cached sampler's log-probs (unrolled decode and scan decode) equal the teacher-forced
  forward's; the experts it records are the ones the trainer's forward chooses."""
  _, path = saved
  policy = hf_checkpoint.load_model(path)
  prompts = sampler.left_pad([[5, 6, 7, 8, 9], [3, 4]], pad_id=0)
  sp = sampler.SamplingParams(
    max_new_tokens=8, temperature=0.7, stop_ids=(), pad_id=0, record_experts=True
  )
  graphdef, params = nnx.split(policy)
  run = jax.jit(sampler.sample, static_argnums=(0, 5), static_argnames=("unroll_layers",))
  key = jax.random.key(0)
  outs = [
    jax.device_get(run(graphdef, params, *prompts, key, sp, unroll_layers=unroll))
    for unroll in (True, False)
  ]
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  np.testing.assert_array_equal(outs[0].expert_ids, outs[1].expert_ids)
  tokens = jnp.concatenate([prompts[0], outs[0].tokens], axis=1)
  mask = jnp.concatenate([prompts[1], outs[0].mask], axis=1)
  P = prompts[0].shape[1]
  lp, ids = _trainer(policy, tokens, mask, 0.7)
  for out in outs:
    np.testing.assert_allclose(out.logprobs, np.asarray(lp)[:, P - 1 :], atol=3e-5, rtol=1e-5)
  # expert_ids [B, n, L, k]: the experts of the token fed to draw each response token.
  np.testing.assert_array_equal(outs[0].expert_ids, np.asarray(ids)[:, P - 1 :])
  assert outs[0].expert_ids.shape == (2, 8, 3, K) and (outs[0].expert_ids[:, :, 1] == -1).all()


def test_paged_engine_matches_the_fixed_batch_sampler(saved, monkeypatch):
  """Continuous batching over the paged cache (each layer's kind picked in its scan) draws what
  the fixed-batch sampler draws, on one device and on an expert mesh, where its decode steps
  keep each device's experts."""
  from gppo_jax.generation import continuous

  _, path = saved
  policy = hf_checkpoint.load_model(path)
  graphdef, params = nnx.split(policy)
  sp = sampler.SamplingParams(max_new_tokens=6, stop_ids=(), pad_id=0, record_experts=True)
  prompts = [[5, 6, 7, 8, 9], [3, 4], [13, 14, 15]]
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=4, page_size=4, chunk=3)
  )
  key = jax.random.key(3)
  got = engine(params, prompts, key, group_size=2)
  P = engine.stats["prompt_len"]
  tokens, mask = sampler.left_pad([p for p in prompts for _ in range(2)], pad_id=0, length=P)
  keys = sampler.row_keys(key, np.repeat(np.arange(3), 2), np.tile(np.arange(2), 3))
  want = jax.device_get(
    sampler.sample(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), keys, sp, group_size=2)
  )
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  np.testing.assert_array_equal(got.expert_ids, want.expert_ids)
  # On a mesh with an expert axis: one group of slots per batch shard (data x expert). The
  # engine's programs run under the mesh, so a decode step runs each device's own experts, as
  # the fixed sampler's does: its program gathers no layer's whole experts.
  mesh = sharding.make_mesh({"data": 2, "expert": 2}, jax.devices()[:4])
  sharded = jax.device_put(params, partitioning.state_shardings(params, mesh))
  engine = continuous.ContinuousSampler(
    graphdef, sp, continuous.EngineConfig(slots=8, page_size=4, chunk=3), mesh
  )
  decode, calls = continuous._decode, []
  record = lambda *args: calls.append(args) or decode(*args)
  monkeypatch.setattr(continuous, "_decode", record)
  got = engine(sharded, prompts, key, group_size=2)
  assert engine.groups == 4
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  np.testing.assert_array_equal(got.expert_ids, want.expert_ids)
  program = decode.lower(*calls[-1]).compile().as_text()
  gathered = re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", program)
  D, F = HF_CONFIG["hidden_size"], HF_CONFIG["moe_intermediate_size"]
  whole = {f"{E},{D},{F}", f"{E},{F},{D}"}  # a layer's experts, stacked
  # (It gathers the step's few tokens over the expert axis instead: what the pattern reads.)
  assert gathered and not whole & set(gathered), gathered


@functools.partial(nnx.jit, static_argnums=3)
def _trainer(model, tokens, mask, temperature):
  positions = model_lib.positions_from_mask(mask)
  out = model(tokens[:, :-1], positions[:, :-1], attn_mask=mask[:, :-1])
  lp = heads_lib.chunked_logprobs(model, out.hidden, tokens[:, 1:], temperature=temperature)
  return lp["logprobs"], out.routing.expert_ids


def test_shared_prompt_forward_matches_rows(saved):
  _, path = saved
  policy = hf_checkpoint.load_model(path)
  rng = np.random.default_rng(1)
  P, G = 5, 2
  prompt = rng.integers(3, 128, size=(2, P))
  tokens = np.concatenate([np.repeat(prompt, G, 0), rng.integers(3, 128, (4, 6))], 1)
  mask = np.ones(tokens.shape, bool)
  positions = np.tile(np.arange(tokens.shape[1]), (4, 1))
  rows = policy(tokens, positions, attn_mask=mask)
  shared = policy.shared_prompt_hidden(tokens, positions, mask, prompt_len=P, group_size=G)
  np.testing.assert_allclose(
    np.asarray(shared.hidden), np.asarray(rows.hidden)[:, P - 1 :], atol=1e-5
  )
  np.testing.assert_array_equal(
    np.asarray(shared.routing.expert_ids), np.asarray(rows.routing.expert_ids)
  )
  forced = policy.shared_prompt_hidden(
    tokens, positions, mask, prompt_len=P, group_size=G, expert_ids=rows.routing.expert_ids
  )
  np.testing.assert_allclose(np.asarray(forced.hidden), np.asarray(shared.hidden), atol=1e-6)


def test_under_vmap_is_an_argument_of_the_call(saved):
  """The continuous engine's mode (`under_vmap`: the sorted dispatch traced inside `jax.vmap`) is
  an argument, so one jitted forward serves both ways in one process, each compiled for its own:
  per group, then over a group axis (a flag read while tracing would reuse the first trace,
  whose ragged products do not batch). Both give the same hidden states and experts."""
  _, path = saved
  graphdef, params = nnx.split(hf_checkpoint.load_model(path))
  tokens, mask, positions = (np.stack([a[:2], a[2:]]) for a in _batch(4))  # [R=2, 2, T]

  @functools.partial(jax.jit, static_argnums=4)
  def forward(params, tokens, mask, positions, under_vmap):
    out = nnx.merge(graphdef, params)(tokens, positions, attn_mask=mask, under_vmap=under_vmap)
    return out.hidden, out.routing.expert_ids

  groups = [forward(params, tokens[r], mask[r], positions[r], False) for r in range(2)]
  over = jax.vmap(lambda t, m, p: forward(params, t, m, p, True))(tokens, mask, positions)
  for r, (hidden, ids) in enumerate(groups):
    np.testing.assert_allclose(np.asarray(over[0][r]), np.asarray(hidden), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(over[1][r]), np.asarray(ids))
  with pytest.raises(NotImplementedError, match="ragged_dot"):  # the argument is what matters
    jax.vmap(lambda t, m, p: forward(params, t, m, p, False))(tokens, mask, positions)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_bad_value_under_vmap_stays_in_its_own_token(saved, bad):
  """Under vmap the experts are broadcast over the group axis explicitly: a NaN or inf in one
  token's activations (here the first row of the sorted dispatch, which the experts were once
  made to depend on through `+ row[0, 0] * 0`) leaves every other token's output as it was."""
  _, path = saved
  policy = hf_checkpoint.load_model(path)
  cfg = policy.cfg
  w = {k: a[0] for k, a in policy.layers.arrays().items() if k.startswith("moe_")}
  rng = np.random.default_rng(0)
  R, N = 2, 6
  x = rng.normal(size=(R, N, cfg.hidden_size)).astype(np.float32)
  ids = np.stack([rng.permutation(E)[:K] for _ in range(R * N)]).reshape(R, N, K)
  ids[:, 0, 0] = 0  # token 0's pair comes first in the sorted order
  weights = rng.uniform(size=(R, N, K)).astype(np.float32)
  run = jax.jit(
    jax.vmap(lambda x, ids, weights: moe._experts_sorted(cfg, w, x, ids, weights, True))
  )
  clean = np.asarray(run(x, ids, weights))
  x[:, 0, 0] = bad
  got = np.asarray(run(x, ids, weights))
  assert np.isfinite(clean).all() and not np.isfinite(got[:, 0]).all()
  np.testing.assert_array_equal(got[:, 1:], clean[:, 1:])


def test_ragged_dot_stand_in_is_part_of_the_config():
  """The planner's stand-in for the experts' ragged products (one plain product of the same
  shapes) is a ModelConfig field: each model traces its own, in any order in one process."""
  tokens = jnp.ones((2, 8), jnp.int32)
  positions = jnp.tile(jnp.arange(8), (2, 1))
  for stand_in in (False, True, False):
    cfg = architectures.get("char-tiny-moe", ragged_dot_stand_in=stand_in)
    graphdef, state = nnx.split(
      nnx.eval_shape(lambda c=cfg: model_lib.Transformer(c, rngs=nnx.Rngs(0)))
    )
    forward = lambda s, g=graphdef: nnx.merge(g, s)(tokens, positions).hidden
    assert ("ragged_dot" in str(jax.make_jaxpr(forward)(state))) == (not stand_in)


def test_expert_parallel_equals_unsharded(saved):
  """Experts sharded over an `expert` mesh axis of 4 (x data 2): the same logits, routing and
  gradients as on one device."""
  _, path = saved
  mesh = sharding.make_mesh({"expert": 4, "data": 2})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}
  assert sharding.batch_shards(mesh) == 8 and sharding.mesh_shape({"expert": 4, "data": -1}, 8) == (
    2,
    1,
    1,
    4,
  )
  assert sharding.make_mesh({"expert": 1, "data": -1}).axis_names == ("data", "fsdp", "tensor")
  with pytest.raises(ValueError, match="unknown"):
    sharding.mesh_shape({"experts": 4}, 8)
  policy = hf_checkpoint.load_model(path, mesh=mesh)
  assert policy.layers.moe_up[...].sharding.spec[1] == "expert"
  plain = hf_checkpoint.load_model(path)
  tokens, mask, positions = _batch(8)

  def loss(params, graphdef):
    m = nnx.merge(graphdef, params)
    out = m(tokens, positions, attn_mask=mask)
    logits = m.logits(out.hidden)
    return jnp.mean(logits**2) + out.routing.aux_loss, (logits, out.routing.expert_ids)

  graphdef, params = nnx.split(policy)
  batch_sharding = sharding.batch_shardings(tokens, mesh)
  tokens, mask, positions = (jax.device_put(a, batch_sharding) for a in (tokens, mask, positions))
  grad = jax.value_and_grad(loss, has_aux=True)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    (l_s, (lg_s, ids_s)), g_s = jax.jit(grad, static_argnums=1)(params, graphdef)
    # Each device sorts its own rows (the batch split 8 ways: data x expert).
    assert "shard_map" in str(jax.make_jaxpr(grad, static_argnums=1)(params, graphdef))
  (l_p, (lg_p, ids_p)), g_p = jax.jit(grad, static_argnums=1)(*nnx.split(plain)[::-1])
  np.testing.assert_allclose(np.asarray(lg_s), np.asarray(lg_p), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(ids_s), np.asarray(ids_p))
  np.testing.assert_allclose(float(l_s), float(l_p), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_p), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  with pytest.raises(errors.ConfigError, match="mesh.expert=3 does not divide"):
    sharding.check_experts(architectures.get("qwen3-30b-a3b"), {"expert": 3})
  with pytest.raises(errors.ConfigError, match="no experts"):
    sharding.check_experts(architectures.get("tiny"), {"expert": 2})


def test_mesh_sampler_on_an_expert_mesh_equals_one_device(saved):
  """The fixed-batch sampler with the experts split over an expert axis (decode steps run each
  device's own experts) draws the single-device tokens, log-probs and experts."""
  _, path = saved
  policy = hf_checkpoint.load_model(path)
  graphdef, params = nnx.split(policy)
  mesh = sharding.make_mesh({"expert": 4, "data": 2})
  shardings = partitioning.state_shardings(params, mesh)
  sp = sampler.SamplingParams(max_new_tokens=5, stop_ids=(), pad_id=0, record_experts=True)
  rng = np.random.default_rng(2)
  prompts = [list(rng.integers(3, 128, size=rng.integers(2, 7))) for _ in range(8)]
  tokens, mask = sampler.left_pad(prompts, length=8)
  key = jax.random.key(4)
  got = sampler.MeshSampler(graphdef, shardings)(
    jax.device_put(params, shardings), tokens, mask, key, sp
  )
  run = jax.jit(sampler.sample, static_argnums=(0, 5))
  want = jax.device_get(run(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), key, sp))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)
  np.testing.assert_array_equal(got.expert_ids, want.expert_ids)


def test_lora_adapts_the_attention_of_a_mixture_of_experts(saved, tmp_path):
  """LoRA on a mixture of experts: adapters on q, k, v, o only; the merged export is the model
  the adapters compute, and the PEFT adapter names the attention modules."""
  _, path = saved
  policy = hf_checkpoint.load_model(path, lora_rank=2)
  assert policy.cfg.lora_weights == ("wq", "wk", "wv", "wo")
  graphdef, params = nnx.split(policy)
  flat = dict(nnx.to_flat_state(params))
  b = ("layers", "wq" + lora_lib.LORA_B)
  flat[b] = flat[b].replace(0.3 * jnp.ones_like(flat[b].get_value()))  # adapters that matter
  policy = nnx.merge(graphdef, nnx.from_flat_state(flat))
  batch = _batch()
  logits = np.asarray(_forward(policy, *batch)[0])
  base = np.asarray(_forward(hf_checkpoint.load_model(path), *batch)[0])
  mask = batch[1]
  assert np.abs(logits - base)[mask].max() > 1e-3
  merged = hf_checkpoint.load_model(hf_checkpoint.save_model(policy, tmp_path / "merged"))
  np.testing.assert_allclose(np.asarray(_forward(merged, *batch)[0])[mask], logits[mask], atol=1e-4)
  names = dict(hf_checkpoint.peft_tensors(policy))
  assert all(".self_attn." in n for n in names) and len(names) == 3 * 4 * 2


def test_bfloat16_stays_finite(saved):
  _, path = saved
  policy = hf_checkpoint.load_model(path, dtype="bfloat16", param_dtype="bfloat16")
  logits, routing = _forward(policy, *_batch())
  want = _forward(hf_checkpoint.load_model(path), *_batch())[0]
  mask = _batch()[1]
  assert np.isfinite(np.asarray(logits)).all() and np.isfinite(float(routing.aux_loss))
  assert np.abs(np.asarray(logits) - np.asarray(want))[mask].max() < 0.2


@pytest.mark.parametrize("engine", ["fixed", "continuous"])
def test_training_run_with_routing_replay(tmp_path, engine):
  """A smoke run of the built-in task on a mixture of experts: the sampler's experts reach the
  update, which reuses them; the load-balancing loss and the routing flips are logged."""
  import json
  import os

  from gppo_jax import config_lib, train

  c = config_lib.base("smoke")
  c.model.preset = "char-tiny-moe"
  c.warmstart.enabled = False
  c.rollout.routing_replay = True
  c.rollout.engine = engine
  c.rollout.slots = 32  # continuous: fewer slots than rows
  c.model.moe.aux_loss_coef = 0.01
  c.iterations = 2
  c.eval.every = 100
  config_lib.validate(c)
  wd = str(tmp_path / "run")
  train.train_and_evaluate(c, wd)
  lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  last = lines[-1]
  assert last["step"] == 2 and np.isfinite(last["loss/total"])
  assert 1.0 < last["moe/aux_loss"] < 4.0  # k = 2 for a uniform router, at most E = 4
  assert 0.0 <= last["moe/routing_flips"] < 0.5


def test_planner_counts_experts_and_shards_them():
  """configs/qwen3_30b_a3b.py's model: 30.5B parameters, 3.3B active per token (the counts Qwen
  publishes); over an expert axis of 8 each device holds about an eighth of the experts."""
  import importlib.util
  import pathlib

  from gppo_jax import config_lib, plan

  path = pathlib.Path(__file__).parents[1] / "configs" / "qwen3_30b_a3b.py"
  spec = importlib.util.spec_from_file_location("qwen3_30b_a3b", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("gpu8")
  config_lib.validate(c)
  assert dict(module.get_config("v5p64,cell=dapo").mesh)["fsdp"] == 4
  axes = {k: v for k, v in c.mesh.items() if k not in ("rollout", "rollout_devices")}
  assert axes == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8}
  assert c.rollout.routing_replay
  cfg, _ = plan.model_config(c)
  assert cfg.family == "qwen3_moe" and cfg.num_experts == 128
  got = plan.plan(c, dict(c.mesh), compile=False, backend="gpu")
  assert abs(got.num_params - 30.53e9) < 0.01e9
  assert any("3.35B parameters active" in n for n in got.notes)
  # float32 master weights: the 29B expert parameters split 8 ways, the other 1.5B whole.
  assert 0.9 < got.params / (4 * (29.0e9 / 8 + 1.5e9)) < 1.1
  flops = plan.update_flops(cfg, 1, 1000, 0)
  # The active layer parameters (3.35B less 0.62B of embeddings and head), not all 29B+.
  assert 1.0 < flops / (6 * 2.73e9 * 1000) < 1.1
