"""LoRA: config checks, the adapters in the decoder, training only them, the sampler, export."""

import dataclasses
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hf_parity import hf_logits

from gppo_jax import config_lib, errors, train
from gppo_jax.algorithm import objective
from gppo_jax.generation import sampler
from gppo_jax.models import architectures, hf_checkpoint
from gppo_jax.models import lora as lora_lib
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import experiment, train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _smoke_config():
  spec = importlib.util.spec_from_file_location("kl_atomic", f"{REPO}/configs/kl_atomic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("smoke")


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("rank", -1, "model.lora.rank=-1: must be an integer >= 0"),
    ("alpha", 0.0, "model.lora.alpha=0.0: must be a finite number > 0"),
    ("dropout", 1.0, r"model.lora.dropout=1.0: must be a number in \[0, 1\)"),
    ("targets", "qkv", "model.lora.targets='qkv': must be a regular expression fully matching"),
    ("targets", "q|(", "model.lora.targets='q|\\(': must be a regular expression fully matching"),
  ],
)
def test_bad_lora_fields_name_the_field(field, value, message):
  c = _smoke_config()
  c.model.lora[field] = value
  with pytest.raises(errors.ConfigError, match=message):
    config_lib.validate(c)


def test_lora_fields_reach_the_model_config_and_old_configs_have_none():
  c = _smoke_config()
  c.model.lora.rank, c.model.lora.alpha, c.model.lora.targets = 8, 32.0, "q|v|down"
  cfg = architectures.get("tiny", **config_lib.model_overrides(c))
  assert cfg.lora_weights == ("wq", "wv", "w_down") and cfg.lora_scale == 4.0
  del c.model["lora"]  # a config built before LoRA: validates, LoRA off
  config_lib.validate(c)
  assert architectures.get("tiny", **config_lib.model_overrides(c)).lora_rank == 0


def _tokens(B=2, T=9, vocab=64):
  tokens = (np.arange(B * T).reshape(B, T) * 7 + 3) % vocab
  mask = np.ones((B, T), bool)
  mask[0, :3] = False
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), model_lib.positions_from_mask(mask)


def _random_adapters(params, seed=1, scale=0.1):
  """The policy state with every adapter (A and B) random, so that the adapters matter."""
  adapters, base = lora_lib.split_lora(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  pairs = zip(keys, leaves, strict=True)
  leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in pairs]
  return nnx.merge_state(base, jax.tree.unflatten(tree, leaves))


def _merged_base(cfg, base_graphdef, params):
  """The base model (no adapters) with W + s A B in each adapted weight: the reference."""
  graphdef = model_lib.abstract_graphdef(cfg)
  merged = lora_lib.merge_lora_weights(cfg, nnx.merge(graphdef, params).layers.arrays())
  # New Variables (tree.map), so that setting them leaves `params` as it is.
  base = nnx.merge(base_graphdef, jax.tree.map(lambda x: x, lora_lib.split_lora(params)[1]))
  for name, value in merged.items():
    getattr(base.layers, name).set_value(value)
  return base


@pytest.mark.parametrize(
  "targets,remat,scan",
  [("q|k|v|o|gate|up|down", "none", True), ("o|down", "full", False), ("q|v", "dots", True)],
)
def test_adapters_add_their_low_rank_term_to_the_targeted_projections(targets, remat, scan):
  """A fresh adapter (B = 0) leaves the base's outputs unchanged; random adapters give the base
  model with W + (alpha / r) A B, under each remat plan, scanned or unrolled."""
  cfg = architectures.get(
    "tiny", lora_rank=3, lora_alpha=6.0, lora_targets=targets, remat=remat, scan_layers=scan
  )
  base_cfg = cfg.without_lora()
  base_graphdef, base_params = nnx.split(model_lib.create(base_cfg, 0))
  graphdef, params = model_lib.with_lora(cfg, base_params, seed=0)
  tokens, mask, positions = _tokens()
  fwd = lambda m: m(tokens, positions, attn_mask=mask).hidden
  base_out = fwd(nnx.merge(base_graphdef, base_params))
  np.testing.assert_array_equal(fwd(nnx.merge(graphdef, params)), base_out)
  params = _random_adapters(params)
  got = fwd(nnx.merge(graphdef, params))
  assert float(jnp.abs(got - base_out).max()) > 1e-2  # the adapters matter
  want = fwd(_merged_base(cfg, base_graphdef, params))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_dropout_draws_from_the_key_and_only_in_training():
  cfg = architectures.get("tiny", lora_rank=4, lora_dropout=0.5)
  graphdef, params = model_lib.with_lora(cfg, nnx.split(model_lib.create(cfg.without_lora()))[1])
  m = nnx.merge(graphdef, _random_adapters(params))
  tokens, mask, positions = _tokens()
  plain = m(tokens, positions, attn_mask=mask).hidden
  a = m(tokens, positions, attn_mask=mask, lora_key=jax.random.key(0)).hidden
  b = m(tokens, positions, attn_mask=mask, lora_key=jax.random.key(0)).hidden
  c = m(tokens, positions, attn_mask=mask, lora_key=jax.random.key(1)).hidden
  np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(a - c).max()) > 1e-3 and float(jnp.abs(a - plain).max()) > 1e-3


def _update_setup(kl_coef=0.0):
  cfg = architectures.get("tiny", lora_rank=4, lora_alpha=8.0)
  _, base_params = nnx.split(model_lib.create(cfg.without_lora(), 0))
  graphdef, params = model_lib.with_lora(cfg, base_params, seed=0)
  tx = optax.adam(1e-2)
  state = experiment._fresh_state(params, tx)
  N, P, R = 4, 4, 5
  rng = np.random.default_rng(0)
  batch = train_step.build_batch(
    rng.integers(3, 64, (N, P)),
    np.ones((N, P), bool),
    rng.integers(3, 64, (N, R)),
    np.ones((N, R), bool),
    logq=np.full((N, R), -4.0),
    adv=np.array([1.0, -1.0, 0.5, -0.5]),
    ref_logp=np.full((N, R), -4.0) if kl_coef else None,
  )
  loss = objective.LossConfig(
    divergence="kl", estimator="atomic", delta_low=0.5, delta_high=0.5, kl_coef=kl_coef
  )
  spec = train_step.UpdateSpec(prompt_len=P, loss=loss, epochs=1, minibatches=2)
  return cfg, graphdef, tx, state, batch, spec


def test_only_the_adapters_train_and_carry_optimizer_state():
  cfg, graphdef, tx, state, batch, spec = _update_setup()
  adapters = jax.tree.leaves(state.params)
  assert len(adapters) == 2 * len(cfg.lora_weights)
  # Adam's moments exist for the adapters only: no optimizer memory for the base.
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert moments == 2 * sum(x.size for x in adapters) + 1
  base_before = jax.tree.map(np.asarray, state.frozen)
  update = jax.jit(train_step.make_update_fn(graphdef, tx, spec))
  new, metrics = update(state, jax.tree.map(jnp.asarray, batch), jax.random.key(0))
  assert np.all(np.isfinite(metrics["loss/total"]))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new.frozen), base_before)
  pairs = zip(jax.tree.leaves(new.params), adapters, strict=True)
  moved = [float(jnp.abs(a - b).max()) for a, b in pairs]
  assert min(moved) > 0  # every adapter matrix (A and B) trained
  assert set(train_step.SavedState.__dataclass_fields__) == {"params", "opt_state", "step"}
  assert jax.tree.leaves(new.saved()) == jax.tree.leaves((new.params, new.opt_state, new.step))


def test_the_kl_reference_is_the_base_with_the_adapters_off():
  """Zero adapters beside the frozen base (train.py's reference) score like the base model."""
  cfg, graphdef, tx, state, batch, spec = _update_setup()
  trained = state.replace(params=lora_lib.split_lora(_random_adapters(state.policy()))[0])
  logprobs = train_step.make_logprob_fn(graphdef, prompt_len=spec.prompt_len, temperature=1.0)
  ref = trained.policy(train._reference(trained))
  base_graphdef = model_lib.abstract_graphdef(cfg.without_lora())
  base_lp = train_step.make_logprob_fn(base_graphdef, prompt_len=spec.prompt_len, temperature=1.0)
  b = jax.tree.map(jnp.asarray, batch)
  np.testing.assert_allclose(logprobs(ref, b), base_lp(trained.frozen, b), atol=1e-6)
  assert float(jnp.abs(logprobs(trained.policy(), b) - base_lp(trained.frozen, b)).max()) > 1e-3


@pytest.mark.parametrize("merge,unroll", [(True, True), (False, True), (True, False)])
def test_sampler_decodes_with_the_current_adapters(merge, unroll, monkeypatch):
  """Samples and their log-probs from a LoRA policy equal the merged base model's, whether the
  sampler merges the adapters or applies them at every step, in the unrolled (CPU) and the
  scanned (GPU, TPU) decode."""
  monkeypatch.setattr(model_lib, "SAMPLER_MERGES_LORA", merge)
  cfg = architectures.get("tiny", lora_rank=4, lora_alpha=8.0)
  base_graphdef, base_params = nnx.split(model_lib.create(cfg.without_lora(), 0))
  graphdef, params = model_lib.with_lora(cfg, base_params, seed=0)
  params = _random_adapters(params, scale=0.3)
  ref_graphdef, ref_params = nnx.split(_merged_base(cfg, base_graphdef, params))
  tokens, mask, _ = _tokens(B=2, T=6)
  sp = sampler.SamplingParams(max_new_tokens=5, temperature=1.0, stop_ids=(), pad_id=0)
  key = jax.random.key(0)
  run = lambda g, p: sampler.sample(g, p, tokens, mask, key, sp, unroll_layers=unroll)
  got = run(graphdef, params)
  want = run(ref_graphdef, ref_params)
  base = run(base_graphdef, base_params)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
  assert not np.array_equal(got.tokens, base.tokens)  # the adapters changed the samples


def test_continuous_engine_samples_with_the_adapters():
  """The paged engine (rollout.engine="continuous") applies the adapters too: it samples what
  the fixed-batch sampler does on the same LoRA policy."""
  from gppo_jax.generation import continuous

  cfg = architectures.get("tiny", lora_rank=4, lora_alpha=8.0)
  base_graphdef, base_params = nnx.split(model_lib.create(cfg.without_lora(), 0))
  graphdef, params = model_lib.with_lora(cfg, base_params, seed=0)
  params = _random_adapters(params, scale=0.3)
  prompts = [[5, 9, 11], [7, 3, 21, 30, 8]]
  sp = sampler.SamplingParams(max_new_tokens=6, stop_ids=(), pad_id=0)
  key = jax.random.key(2)
  engine = continuous.EngineConfig(slots=4, page_size=4, chunk=3)
  got = continuous.ContinuousSampler(graphdef, sp, engine)(params, prompts, key, group_size=2)
  base = continuous.ContinuousSampler(base_graphdef, sp, engine)(
    base_params, prompts, key, group_size=2
  )
  P = max(map(len, prompts))
  tokens, mask = sampler.left_pad([p for p in prompts for _ in range(2)], pad_id=0, length=P)
  keys = sampler.row_keys(key, np.repeat(np.arange(len(prompts)), 2), np.tile(np.arange(2), 2))
  want = sampler.sample(graphdef, params, tokens, mask, keys, sp, group_size=2)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  assert not np.array_equal(got.tokens, base.tokens)


# --- Export: the merged Hugging Face folder and the PEFT adapter folder ------------------------


def _hf_base(kind, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[kind]
  hf_cfg = config_cls(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
  )
  torch.manual_seed(0)
  m = transformers.AutoModelForCausalLM.from_config(hf_cfg)
  path = tmp_path / "base"
  m.save_pretrained(path)
  return path


@pytest.mark.parametrize("kind,targets", [("qwen2", "q|k|v|o|gate|up|down"), ("llama", "q|o|up")])
def test_peft_loads_the_exported_adapters_with_our_logits(kind, targets, tmp_path):
  peft = pytest.importorskip("peft")
  transformers = pytest.importorskip("transformers")
  base_path = _hf_base(kind, tmp_path)
  overrides = dict(lora_rank=4, lora_alpha=12.0, lora_targets=targets)
  policy = hf_checkpoint.load_model(base_path, lora_seed=3, **overrides)
  graphdef, params = nnx.split(policy)
  policy = nnx.merge(graphdef, _random_adapters(params, scale=0.2))
  tokens, mask, positions = _tokens(T=11, vocab=96)
  ours = np.asarray(policy.logits(policy(tokens, positions, attn_mask=mask).hidden))
  m = np.asarray(mask)

  adapter = hf_checkpoint.save_peft_adapter(policy, tmp_path / "adapter", base_model=base_path)
  config = json.loads((adapter / hf_checkpoint.PEFT_CONFIG_FILE).read_text())
  assert config["r"] == 4 and config["lora_alpha"] == 12.0
  base = transformers.AutoModelForCausalLM.from_pretrained(base_path, attn_implementation="eager")
  base_logits = hf_logits(base.eval(), tokens, mask, positions)
  assert np.abs(base_logits[m] - ours[m]).max() > 1e-2  # the adapters matter
  peft_model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
  np.testing.assert_allclose(
    hf_logits(peft_model, tokens, mask, positions)[m], ours[m], atol=1e-4, rtol=1e-4
  )

  merged = hf_checkpoint.save_model(policy, tmp_path / "merged", source=base_path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager")
  np.testing.assert_allclose(
    hf_logits(reloaded.eval(), tokens, mask, positions)[m], ours[m], atol=1e-4, rtol=1e-4
  )


def test_save_peft_adapter_needs_adapters():
  with pytest.raises(ValueError, match="no LoRA adapters"):
    hf_checkpoint.save_peft_adapter(model_lib.create(architectures.get("tiny")), "/nonexistent")


# --- A run: checkpoints hold only the adapters, resume and evaluate -----------------------------


def test_lora_run_checkpoints_adapters_and_resumes(tmp_path):
  from gppo_jax import evaluate

  c = _smoke_config()
  c.warmstart.cache_dir = str(tmp_path / "cache")
  c.model.lora.rank = 4
  c.model.lora.dropout = 0.1
  c.loss.kl_coef = 0.05
  c.iterations = 2
  wd = str(tmp_path / "run")
  train.train_and_evaluate(c, wd)
  lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  counted = [x for x in lines if "params/trainable" in x]
  assert len(counted) == 1  # logged once
  trainable, total = counted[0]["params/trainable"], counted[0]["params/total"]
  assert 0 < trainable < total / 5
  # The checkpoint's arrays are the adapters and their optimizer state, not the base.
  import orbax.checkpoint as ocp

  meta = ocp.StandardCheckpointer().metadata(os.path.join(wd, "checkpoints", "2", "state"))
  tree = getattr(meta, "item_metadata", meta)
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
  assert 3 * trainable <= sum(sizes) < 3 * trainable + 64, (sum(sizes), trainable)
  c.iterations = 3
  train.train_and_evaluate(c, wd)
  lines2 = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  assert [x["step"] for x in lines2[len(lines) :]] == [3]
  assert sum("params/trainable" in x for x in lines2) == 1  # not again on resuming
  assert lines2[-1]["optim/steps"] == 3 * c.train.epochs * c.train.minibatches
  assert np.isfinite(lines2[-1]["loss/total"]) and lines2[-1]["loss/kl_ref"] > 0
  report = evaluate.evaluate_checkpoint(c, wd)
  summary = json.load(open(os.path.join(wd, "summary.json")))
  np.testing.assert_allclose(
    report["metrics"]["eval/accuracy"], summary["final_eval"]["eval/accuracy"]
  )


def test_model_config_rejects_bad_lora_values():
  for bad in (dict(lora_rank=-2), dict(lora_dropout=1.5), dict(lora_targets="attn")):
    with pytest.raises(ValueError, match="lora_"):
      dataclasses.replace(architectures.get("tiny"), **bad)


# --- The planner ------------------------------------------------------------------------------


def _qwen_math_7b(variant):
  path = os.path.join(REPO, "configs", "qwen25_math_7b.py")
  spec = importlib.util.spec_from_file_location("qwen_lora_plan", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant)
  config.model.path = None  # the named architecture's shapes (no weights needed)
  return config


@pytest.mark.parametrize(
  "variant,platform,devices", [("v5e8_lora", "v5e", 8), ("gpu1_lora", "h100", 1)]
)
def test_plan_fits_qwen_math_7b_with_rank_64_lora_on_small_hardware(variant, platform, devices):
  """Qwen2.5-Math-7B with rank-64 adapters fits one 8-chip v5e host and one 80 GB GPU: the
  frozen bf16 base counted once, optimizer state for the adapters only; full fine-tuning of the
  same rollouts does not fit."""
  from gppo_jax import plan

  c = _qwen_math_7b(variant)
  assert c.model.lora.rank == 64 and c.model.param_dtype == "bfloat16"
  config_lib.validate(c)
  kw = dict(
    device_memory_gb=plan.PLATFORM_MEMORY_GB[platform],
    compile=False,
    devices=jax.devices()[:devices],
    backend=plan.PLATFORM_BACKEND[platform],
  )
  got = plan.plan(c, dict(c.mesh), **kw)
  assert got.fits, plan.format_plan(got)
  assert 0 < got.trainable_params < got.num_params / 40  # ~160M adapters of ~7.8B
  shards = devices  # fsdp over every device: the base's bf16 bytes split that many ways
  base_bytes = 2 * (got.num_params - got.trainable_params) / shards
  assert base_bytes <= got.params < 1.1 * base_bytes
  assert got.optimizer < 2 * 4 * got.trainable_params / shards * 1.1  # Adam of the adapters
  full = _qwen_math_7b(variant)
  full.model.lora.rank = 0
  full.model.param_dtype = "float32"  # full fine-tuning: float32 master weights
  assert not plan.plan(full, dict(full.mesh), **kw).fits


# --- Learning --------------------------------------------------------------------------------


def _learning_config(seed: int, lr: float, rank: int, cache_dir: str):
  """The learning test's run (tests/test_train.py `learning_config`: a 60-step supervised warm
  start, then 24 RL iterations on add1), with rank-`rank` LoRA on every projection."""
  spec = importlib.util.spec_from_file_location("chi2_atomic", f"{REPO}/configs/chi2_atomic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke,task=add1")
  c.seed = seed
  c.warmstart.cache_dir = cache_dir
  c.warmstart.target_accuracy = 1.0  # stop by steps, never by accuracy (see test_train.py)
  c.warmstart.max_steps = 60
  c.warmstart.eval_every = 60
  c.warmstart.lr = 3e-4
  c.warmstart.eval_size = 8
  c.iterations = 24
  c.rollout.prompts_per_iter = 32
  c.rollout.group_size = 8
  c.train.minibatches = 2
  c.optim.lr = lr
  c.eval.every = 24
  c.eval.k = 0
  c.eval.num_problems = 8
  c.checkpoint.every = 100
  c.model.lora.rank = rank
  c.model.lora.alpha = 2.0 * max(rank, 1)
  return c


def _rewards(c, workdir) -> list[float]:
  train.train_and_evaluate(c, str(workdir))
  lines = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  return [x["reward/mean"] for x in lines if "reward/mean" in x]


LORA_LEARNING_MARGIN = 0.1


def test_lora_policy_learns_on_a_tiny_task(tmp_path):
  """Rank-8 LoRA (alpha 16, lr 3e-3) on the warm-started char policy beats the same run with
  the policy frozen: mean reward over the last 4 iterations, paired (same prompts and sampling
  keys), by LORA_LEARNING_MARGIN.

  Measured gain (trained minus frozen, last 4 iterations), chi2-atomic, seeds 0-5, 8 host
  devices with the test suite's XLA flags: 0.25-0.38 (frozen reward 0.10-0.38); seeds 0-2 under
  users' XLA build (no test flags): 0.28-0.31. lr 1e-2 did
  not learn (seed 0: -0.04)."""
  cache = str(tmp_path / "warmstart")
  frozen_cfg = _learning_config(0, 1e-30, 0, cache)
  frozen_cfg.train.minibatches = 1  # a no-op update: only its rollouts are read
  frozen = _rewards(frozen_cfg, tmp_path / "frozen")
  trained = _rewards(_learning_config(0, 3e-3, 8, cache), tmp_path / "lora")
  assert len(trained) == len(frozen) == 24
  gain = np.mean(trained[-4:]) - np.mean(frozen[-4:])
  assert gain > LORA_LEARNING_MARGIN, (gain, trained, frozen)


def test_a_restore_gets_the_warm_started_base_back(tmp_path):
  """A checkpoint holds only the adapters, so a resume or an evaluation that skips the warm
  start (warm_start=False) still gets the warm-started base, not a random one."""
  c = _smoke_config()
  c.warmstart.cache_dir = str(tmp_path / "cache")
  c.model.lora.rank = 4
  _, warm, *_ = experiment.build_policy(c, say=lambda *_: None, warm_start=True)
  _, resumed, *_ = experiment.build_policy(c, say=lambda *_: None, warm_start=False)
  c.model.lora.rank = 0
  _, random_init, *_ = experiment.build_policy(c, say=lambda *_: None, warm_start=False)
  base = lora_lib.split_lora(warm)[1]
  jax.tree.map(np.testing.assert_array_equal, lora_lib.split_lora(resumed)[1], base)
  pairs = zip(jax.tree.leaves(random_init), jax.tree.leaves(base), strict=True)
  assert not all(np.array_equal(a, b) for a, b in pairs)


def test_lora_run_on_a_hf_folder_exports_merged_and_peft_folders(tmp_path):
  """A LoRA run on a Hugging Face folder writes both exports, and they agree: transformers on
  the merged folder and PEFT's adapters on the base give the same logits, away from the base."""
  peft = pytest.importorskip("peft")
  transformers = pytest.importorskip("transformers")
  from test_train_hf import make_hf_folder

  model_dir = str(tmp_path / "model")
  make_hf_folder(model_dir)
  rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)] * 2]
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  c = _smoke_config()
  c.model.path = model_dir
  c.model.export_hf = True
  c.model.lora.rank = 4
  c.model.lora.targets = "q|v|o|down"
  c.data.train_path = c.data.eval_path = str(data)
  c.data.verifier_workers = 1
  c.rollout.prompts_per_iter = 4
  c.rollout.max_new_tokens = 8
  c.optim.lr = 1e-2  # adapters that visibly move in two iterations ...
  c.loss.entropy_coef = 0.1  # ... even where every reward is 0 (a random policy)
  c.iterations = 2
  c.eval.k = 0
  wd = tmp_path / "run"
  train.train_and_evaluate(c, str(wd))
  tokens, mask, positions = _tokens(T=7, vocab=300)
  m = np.asarray(mask)
  load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(
    p, attn_implementation="eager"
  ).eval()
  merged = hf_logits(load(wd / "hf_export"), tokens, mask, positions)[m]
  base = load(model_dir)
  base_logits = hf_logits(base, tokens, mask, positions)[m]
  adapted = peft.PeftModel.from_pretrained(base, str(wd / "peft_adapter")).eval()
  np.testing.assert_allclose(hf_logits(adapted, tokens, mask, positions)[m], merged, atol=1e-4)
  assert np.abs(merged - base_logits).max() > 1e-3
  config = json.loads((wd / "peft_adapter" / hf_checkpoint.PEFT_CONFIG_FILE).read_text())
  assert sorted(config["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
