"""Sharded update, sampler and checkpoints on 8 simulated CPU devices agree with one device."""

import dataclasses
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys

import chex
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gppo_jax import config_lib, errors, plan
from gppo_jax.algorithm import objective
from gppo_jax.data.envs import Prompt
from gppo_jax.generation import sampler
from gppo_jax.models import architectures, attention, partitioning, sharding
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import checkpointing, policy_eval, train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4)]
P, R, N = 6, 5, 16
LOSS = objective.LossConfig(divergence="kl", estimator="atomic", delta_low=0.02)
SAMPLING = sampler.SamplingParams(max_new_tokens=6, temperature=1.0, stop_ids=(2,), num_topk=2)


def mesh_of(shape):
  return sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape, strict=True)))


@pytest.fixture(scope="module")
def setup():
  cfg = architectures.get("tiny", remat="none")
  graphdef, params = nnx.split(model_lib.create(cfg, seed=0))
  tx = train_step.make_optimizer(lr=1e-2, total_steps=10)
  rng = np.random.default_rng(0)
  p_tok = rng.integers(3, cfg.vocab_size, (N, P)).astype(np.int32)
  p_mask = np.ones_like(p_tok, bool)
  p_mask[::3, :2] = False
  resp = rng.integers(3, cfg.vocab_size, (N, R)).astype(np.int32)
  resp_mask = np.arange(R)[None] < rng.integers(1, R + 1, (N, 1))
  batch = train_step.build_batch(
    p_tok,
    p_mask,
    resp,
    resp_mask,
    logq=np.log(rng.uniform(0.05, 0.9, (N, R))).astype(np.float32),
    adv=rng.normal(size=N).astype(np.float32),
  )
  spec = train_step.UpdateSpec(prompt_len=P, loss=LOSS, epochs=2, minibatches=2)
  update_fn = train_step.make_update_fn(graphdef, tx, spec)
  state = train_step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
  host_state = jax.device_get(state)
  key = jax.random.PRNGKey(3)
  want = jax.device_get(jax.jit(update_fn)(state, batch, key))
  want_sample = jax.device_get(sampler.sample_jit(graphdef, params, p_tok, p_mask, key, SAMPLING))
  return dict(
    cfg=cfg, graphdef=graphdef, update_fn=update_fn, host_state=host_state, batch=batch,
    key=key, want=want, p_tok=p_tok, p_mask=p_mask, want_sample=want_sample,
  )  # fmt: skip


def test_make_mesh_resolves_the_rest_and_rejects_bad_sizes():
  mesh = sharding.make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert sharding.mesh_shape({"data": 1, "fsdp": -1}, 8) == (1, 8, 1)
  with pytest.raises(ValueError, match="needs 6 devices, found 8"):
    sharding.mesh_shape({"data": 3, "fsdp": 2, "tensor": 1}, 8)
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    sharding.mesh_shape({"data": -1, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="not divisible by 3"):
    sharding.mesh_shape({"data": -1, "fsdp": 3}, 8)
  with pytest.raises(ValueError, match="mesh.tensor=0"):
    sharding.mesh_shape({"tensor": 0}, 8)


def test_distributed_initialize_only_when_asked(monkeypatch):
  calls, updates = [], []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
  monkeypatch.setattr(sharding, "_distributed_initialized", False)
  assert not sharding.maybe_initialize_distributed({})
  assert not sharding.maybe_initialize_distributed({"GPPO_DISTRIBUTED": "0"})
  assert calls == []
  assert sharding.maybe_initialize_distributed({"GPPO_DISTRIBUTED": "1"})
  assert sharding.maybe_initialize_distributed({"GPPO_DISTRIBUTED": "1"})  # once per process
  assert calls == [{}] and updates == [("jax_cpu_collectives_implementation", "gloo")]
  monkeypatch.setattr(sharding, "_distributed_initialized", False)
  env = {"GPPO_DISTRIBUTED": "true", "JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}
  env.update(JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
  assert sharding.maybe_initialize_distributed(env)
  want = dict(coordinator_address="10.0.0.2:1234", num_processes=2, process_id=1)
  assert calls == [{}, want]
  with pytest.raises(ValueError, match="GPPO_DISTRIBUTED='maybe'"):
    sharding.maybe_initialize_distributed({"GPPO_DISTRIBUTED": "maybe"})


def test_batches_split_over_data_and_fsdp(setup):
  mesh = mesh_of((2, 2, 2))
  batch = sharding.shard_batch(setup["batch"], mesh)
  assert batch.inputs.sharding.spec == jax.P(("data", "fsdp"), None)
  assert batch.adv.sharding.spec == jax.P(("data", "fsdp"))
  assert batch.inputs.addressable_shards[0].data.shape == (N // 4, P + R - 1)
  np.testing.assert_array_equal(np.asarray(batch.targets), setup["batch"].targets)
  # Rows that do not divide over data x fsdp fall back to the axes that do (here data only).
  odd = sharding.shard_batch({"x": np.arange(6)}, mesh)
  assert odd["x"].sharding.spec == jax.P("data")
  assert sharding.process_rows(16, mesh) == slice(0, 16)
  # constrain_batch pins inside jit on the ambient mesh and is a no-op without one.
  x = jnp.ones((8, 3))
  assert partitioning.constrain_batch(x) is x

  @jax.jit
  def f(x):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return partitioning.constrain_batch(x) * 2

  assert f(jax.device_put(x, sharding.replicated(mesh))).sharding.spec == jax.P(("data", "fsdp"))


def assert_same_step(state, metrics, want) -> None:
  """An update's (host) state and metrics equal the reference step's `want`: the metrics, and
  parameters and Adam's moments (functions of the gradients) leaf by leaf, up to float summation
  order (relative to each leaf's scale: small gradient entries cancel)."""
  want_state, want_metrics = want
  for k in ("loss/total", "optim/grad_norm", "trust/masked_frac"):
    np.testing.assert_allclose(np.asarray(metrics[k]), want_metrics[k], rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= 1e-3 * np.max(np.abs(b)) + 1e-7


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_update_matches_one_device(setup, shape):
  mesh = mesh_of(shape)
  shardings = sharding.state_shardings(setup["host_state"], mesh)
  state = jax.device_put(setup["host_state"], shardings)
  batch = sharding.shard_batch(setup["batch"], mesh)
  update = sharding.jit_update(
    setup["update_fn"], shardings, sharding.batch_shardings(setup["batch"], mesh)
  )
  wq_before = state.params["layers"]["wq"][...]
  new, metrics = update(state, batch, setup["key"])
  assert wq_before.is_deleted()  # the state was donated
  assert_same_step(jax.device_get(new), metrics, setup["want"])
  assert int(new.step) == 4
  # The new state keeps its layout: params and Adam moments by logical axes, counts replicated.
  adam = new.opt_state[1][0]
  for tree in (new.params, adam.mu, adam.nu):
    assert tree["layers"]["w_up"][...].sharding == shardings.params["layers"]["w_up"].get_value()
  shard = {(8, 1, 1): (2, 64, 128), (2, 2, 2): (2, 32, 64), (1, 2, 4): (2, 32, 32)}[shape]
  assert new.params["layers"]["w_up"][...].addressable_shards[0].data.shape == shard
  assert adam.count.sharding.is_fully_replicated and new.step.sharding.is_fully_replicated


def test_bf16_update_on_a_vocab_sharded_mesh_matches_one_device(setup):
  """bf16 compute (the head's own backward, `heads._head_with_backward`) with the tied
  embedding's vocabulary split over tensor=4: the same loss and gradient norm as on one device,
  up to bf16 rounding, and finite parameters."""
  cfg = dataclasses.replace(setup["cfg"], dtype="bfloat16")
  graphdef = model_lib.abstract_graphdef(cfg)
  tx = train_step.make_optimizer(lr=1e-2, total_steps=10)
  spec = train_step.UpdateSpec(prompt_len=P, loss=LOSS)
  update_fn = train_step.make_update_fn(graphdef, tx, spec)
  host = setup["host_state"]
  _, want = jax.device_get(jax.jit(update_fn)(host, setup["batch"], setup["key"]))
  mesh = mesh_of((1, 2, 4))
  shardings = sharding.state_shardings(host, mesh)
  update = sharding.jit_update(update_fn, shardings, sharding.batch_shardings(setup["batch"], mesh))
  new, got = update(
    jax.device_put(host, shardings), sharding.shard_batch(setup["batch"], mesh), setup["key"]
  )
  for k in ("loss/total", "optim/grad_norm"):
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=2e-2)
  assert want["optim/grad_norm"] > 0
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new.params))


def _dots_in_ynn_fusions(compiled) -> int:
  """How many dot instructions of a compiled CPU program sit inside YNNPACK library fusions."""
  text = compiled.as_text()
  called = re.findall(r"calls=(%[\w.\-]+),[^\n]*\"kind\":\"__ynn_fusion\"", text)
  bodies = {
    m.group(1): m.group(2) for m in re.finditer(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", text, re.S)
  }
  return sum(len(re.findall(r" dot\(", bodies[name])) for name in called)


def test_cpu_matmul_falls_back_to_xla_defaults_where_the_jaxlib_lacks_the_option(
  monkeypatch, caplog
):
  """The option is experimental: a jaxlib that rejects it gets XLA's defaults and a warning."""
  monkeypatch.setattr(sharding, "_XLA_MATMUL_OPTIONS", {"xla_cpu_no_such_option": "1"})
  sharding._xla_matmul_options_supported.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger="gppo_jax.models.sharding"):
      assert sharding.update_compiler_options("xla", 64, "cpu") is None
    assert "model.cpu_matmul: this jaxlib rejects" in caplog.text
  finally:
    sharding._xla_matmul_options_supported.cache_clear()


def test_cpu_matmul_routes_a_narrow_update_to_xla_kernels_with_the_same_step(setup):
  """model.cpu_matmul: "auto" gives a narrow model's update XLA's own matmul kernels on CPU only
  (sharding.update_compiler_options); so compiled, no dot is left in a YNNPACK fusion, where
  XLA's defaults put them, and the update computes the same step."""
  options = sharding.update_compiler_options
  narrow = options("auto", 64, "cpu")
  assert narrow and narrow == options("xla", 4096, "cpu")
  assert options("auto", 512, "cpu") is None and options("ynnpack", 64, "cpu") is None
  assert options("xla", 64, "gpu") is None and options("auto", 64, "tpu") is None
  with pytest.raises(errors.ConfigError, match="model.cpu_matmul='eigen'; valid: auto, xla"):
    options("eigen", 64, "cpu")

  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  shardings = sharding.state_shardings(setup["host_state"], mesh)
  batch_sh = sharding.batch_shardings(setup["batch"], mesh)
  got = {}
  for name, opts in (("default", None), ("xla", narrow)):
    update = sharding.jit_update(setup["update_fn"], shardings, batch_sh, compiler_options=opts)
    state = jax.device_put(setup["host_state"], shardings)
    batch = sharding.shard_batch(setup["batch"], mesh)
    got[name] = (_dots_in_ynn_fusions(update.lower(state, batch, setup["key"]).compile()),
                 jax.device_get(update(state, batch, setup["key"])))  # fmt: skip
  assert got["default"][0] > 0 and got["xla"][0] == 0
  assert_same_step(*got["xla"][1], setup["want"])


@pytest.mark.parametrize(
  "shape",
  [(1, 2, 4), pytest.param((2, 2, 2), marks=pytest.mark.slow)],
  ids=lambda s: "x".join(map(str, s)),
)
def test_sharded_sampler_gives_identical_tokens(setup, shape):
  mesh = mesh_of(shape)
  params = setup["host_state"].params
  shardings = sharding.state_shardings(setup["host_state"], mesh).params
  sample = sampler.jit_sampler(setup["graphdef"], SAMPLING, shardings, N)
  out = sample(jax.device_put(params, shardings), setup["p_tok"], setup["p_mask"], setup["key"])
  want = setup["want_sample"]
  np.testing.assert_array_equal(np.asarray(out.tokens), want.tokens)
  np.testing.assert_array_equal(np.asarray(out.mask), want.mask)
  np.testing.assert_array_equal(np.asarray(out.topk_ids), want.topk_ids)
  np.testing.assert_allclose(np.asarray(out.logprobs), want.logprobs, atol=1e-5)
  assert out.tokens.sharding.spec[0] == ("data", "fsdp")
  assert want.mask.sum() > N  # the comparison covers several tokens per row


def test_training_loop_compiles_the_update_and_the_sampler_once(setup, monkeypatch):
  """Iterations as the train loop runs them (sample with the current parameters, then update them)
  on new prompts, rollout batches and keys: the sharded update and the mesh sampler each trace
  once. A retrace (say an update returning parameters typed or laid out unlike those it took)
  would recompile both every iteration; chex.assert_max_traces makes it a failure."""
  chex.clear_trace_counter()
  # The sharded sampler traces `sampler.sample` by name; the update is wrapped before its jit.
  monkeypatch.setattr(sampler, "sample", chex.assert_max_traces(sampler.sample, n=1))
  mesh = mesh_of((1, 2, 4))
  shardings = sharding.state_shardings(setup["host_state"], mesh)
  update = sharding.jit_update(
    chex.assert_max_traces(setup["update_fn"], n=1),
    shardings,
    sharding.batch_shardings(setup["batch"], mesh),
  )
  mesh_sampler = sampler.MeshSampler(setup["graphdef"], shardings.params)
  state = jax.device_put(setup["host_state"], shardings)
  rng = np.random.default_rng(5)
  for i in range(3):
    key = jax.random.PRNGKey(i)
    p_tok = rng.integers(3, setup["cfg"].vocab_size, (N, P)).astype(np.int32)
    out = mesh_sampler(state.params, p_tok, setup["p_mask"], key, SAMPLING)
    assert out.tokens.shape == (N, SAMPLING.max_new_tokens)
    batch = setup["batch"].replace(adv=rng.normal(size=N).astype(np.float32))
    state, metrics = update(state, sharding.shard_batch(batch, mesh), key)
  assert int(state.step) == 12 and np.isfinite(np.asarray(metrics["loss/total"])).all()


class _ParityEnv:
  """Eval prompts from the setup batch; a response scores 1 when it has an even token count."""

  class tokenizer:  # noqa: N801
    eos_ids, pad_id = (2,), 0

    @staticmethod
    def decode(ids):
      return ",".join(map(str, ids))

  max_prompt_len, max_new_tokens = P, 6

  def __init__(self, p_tok, p_mask, n):
    self.prompts = [
      Prompt([int(t) for t, m in zip(row, keep, strict=True) if m], gold="", benchmark=f"b{i % 2}")
      for i, (row, keep) in enumerate(zip(p_tok[:n], p_mask[:n], strict=True))
    ]

  def eval_prompts(self):
    return self.prompts

  def score(self, responses, prompts):
    r = np.array([float(len(x.split(",")) % 2 == 0) for x in responses], np.float32)
    return r, np.ones(len(r), bool), {}


def test_periodic_eval_on_a_mesh_matches_one_device(setup):
  """The train loop's eval samples through a MeshSampler (each host feeds its rows): the same
  tokens and the same report as the single-device sampler, with uneven sizes padded to a multiple
  of the batch shards."""
  mesh = mesh_of((2, 2, 2))
  params = setup["host_state"].params
  shardings = sharding.state_shardings(setup["host_state"], mesh).params
  mesh_sampler = sampler.MeshSampler(setup["graphdef"], shardings)
  assert mesh_sampler.batch_multiple == 4
  placed = jax.device_put(params, shardings)
  env = _ParityEnv(setup["p_tok"], setup["p_mask"], N)
  common = dict(k=3, batch_size=8, max_new_tokens=5)
  key = jax.random.PRNGKey(1)
  want = policy_eval.evaluate_policy(setup["graphdef"], params, env, key, **common)
  got = policy_eval.evaluate_policy(
    setup["graphdef"], placed, env, key, sample_fn=mesh_sampler, **common
  )
  assert got.keys() == want.keys() and "eval/b1/pass@3" in got
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, atol=1e-6, err_msg=name)
  assert 0 < got["eval/avg@3"] < 1  # the comparison is not between two constant reports

  # 7 prompts: batches of 8 on one device, rounded up to 8 on the mesh; 6 -> batch 6 vs 8.
  for n, bs in ((7, 7), (6, 6)):
    prompts = env.prompts[:n]
    greedy = sampler.SamplingParams(5, greedy=True, stop_ids=(2,))
    args = dict(prompt_len=P, pad_id=0, batch_size=bs)
    ids = [p.token_ids for p in prompts]
    a = sampler.sample_prompts(setup["graphdef"], params, ids, greedy, key, **args)
    b = sampler.sample_prompts(
      setup["graphdef"], placed, ids, greedy, key, sample_fn=mesh_sampler, **args
    )
    assert b.tokens.shape == a.tokens.shape == (n, 5)
    np.testing.assert_array_equal(b.tokens, a.tokens)


def test_sharded_logprobs_match_one_device(setup):
  mesh = mesh_of((2, 2, 2))
  host = setup["host_state"]
  fn = train_step.make_logprob_fn(setup["graphdef"], prompt_len=P, temperature=1.0)
  want = np.asarray(fn(host.params, setup["batch"]))
  shardings = sharding.state_shardings(host, mesh).params
  sharded = sharding.jit_logprobs(fn, shardings, sharding.batch_shardings(setup["batch"], mesh))
  got = sharded(jax.device_put(host.params, shardings), sharding.shard_batch(setup["batch"], mesh))
  assert got.shape == (N, R) and got.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_checkpoint_saved_on_one_mesh_restores_on_another(setup, tmp_path):
  host = setup["host_state"]
  src_mesh, dst_mesh = mesh_of((2, 2, 2)), mesh_of((1, 2, 4))
  state = jax.device_put(host, sharding.state_shardings(host, src_mesh))
  mngr = checkpointing.make_manager(str(tmp_path / "ckpt"))
  checkpointing.save(mngr, 7, state, {"iteration": 7}, wait=True)

  for mesh in (dst_mesh, mesh_of((1, 8, 1))):
    shardings = sharding.state_shardings(host, mesh)
    target = sharding.abstract_like(host, shardings)
    step, restored, meta = checkpointing.restore_latest(mngr, target)
    assert (step, meta["iteration"]) == (7, 7)
    for a, b, s in zip(
      jax.tree.leaves(restored), jax.tree.leaves(host), jax.tree.leaves(shardings), strict=True
    ):
      assert a.sharding == s
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  wq = restored.params["layers"]["wq"][...]
  assert wq.addressable_shards[0].data.shape == (2, 64 // 8, 4, 16)


TINY_CONFIG = """
from gppo_jax import config_lib


def get_config(arg=None):
  c = config_lib.base("smoke")
  c.model.preset = "tiny"
  c.train.epochs = c.train.minibatches = 1
  return c
"""


def test_plan_reports_per_device_memory_and_fit(tmp_path):
  path = tmp_path / "tiny_plan.py"
  path.write_text(TINY_CONFIG)
  spec = importlib.util.spec_from_file_location("tiny_plan", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  mesh = {"data": 1, "fsdp": 4, "tensor": 1}
  got = plan.plan(config, mesh, device_memory_gb=95, devices=jax.devices()[:4])
  n = got.num_params
  assert n == model_lib.param_count(model_lib.create(architectures.get("tiny")))
  assert got.params == n * 4 // 4  # float32, every tiny dimension splits 4 ways
  assert 0 <= got.optimizer - 2 * got.params < 64  # Adam mu + nu, plus replicated counts
  assert got.source == "compiled" and got.activations > 0 and got.fits
  assert got.update_peak >= got.params + got.optimizer + got.activations
  small = plan.plan(config, mesh, device_memory_gb=1e-4, compile=False, devices=jax.devices()[:4])
  assert small.source == "analytic" and not small.fits
  assert (small.params, small.optimizer, small.kv_cache) == (
    got.params,
    got.optimizer,
    got.kv_cache,
  )
  assert "DOES NOT FIT" in plan.format_plan(small)
  with pytest.raises(ValueError, match="expected NAME=SIZE"):
    plan.parse_mesh("fsdp:8")

  # The CLI in a fresh process simulates the 4 devices it needs (no XLA_FLAGS given).
  env = conftest.one_device_env()
  cmd = [sys.executable, "-m", "gppo_jax.plan", f"--config={path}", "--mesh=fsdp=2,tensor=2"]
  out = subprocess.run(
    cmd + ["--analytic", "--platform=v5e"], cwd=REPO, env=env, capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
  assert report["device_memory"] == 16 * 1024**3 and report["fits"]
  assert "FITS: peak" in out.stdout
  # The time model: the asynchronous split and streaming's own; streaming decodes no more steps.
  assert report["time"]["devices"] == 4 and "streaming" in out.stdout
  assert report["time_stream"]["stream_speedup"] >= report["time"]["speedup"] > 0


def test_plan_counts_the_unrolled_attention_tiles_cpu_auto_runs():
  """A CPU target's "auto" runs blockwise's tiles unrolled up to attention.UNROLL_MAX_LEN tokens,
  holding every tile's scores: the closed form counts more there than for model.attention
  "blockwise" (loops, one block of tiles), and the same beyond that length or on a GPU."""

  def acts(tokens, attention, backend="cpu"):
    c = _qwen_config(tokens, attention)
    c.data.max_prompt_tokens = 64  # rows of 64 + tokens - 1
    c.model.dtype = "float32"  # on a GPU "auto" is then blockwise (cuDNN takes half precision)
    got = plan.plan(c, {"fsdp": 8}, compile=False, devices=jax.devices()[:8], backend=backend)
    return got.activations

  assert attention.unrolled(64 + 400 - 1, "cpu") and not attention.unrolled(64 + 500 - 1, "cpu")
  short = [acts(400, a) for a in ("auto", "blockwise")]
  assert short[0] > short[1], short
  long = [acts(500, a) for a in ("auto", "blockwise")]
  assert long[0] == long[1], long
  gpu = [acts(400, a, "gpu") for a in ("auto", "blockwise")]
  assert gpu[0] == gpu[1], gpu


def _qwen_config(tokens: int, attention: str):
  path = os.path.join(REPO, "configs", "qwen25_math_7b.py")
  spec = importlib.util.spec_from_file_location("qwen_plan", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.model.path = None  # the named architecture's shapes (no weights needed)
  config.rollout.max_new_tokens = tokens
  config.model.attention = attention
  return config


def test_plan_counts_linear_attention_memory_on_long_responses():
  """16k-token Qwen2.5-7B rollouts: the linear-memory attention the target platform resolves
  to (splash on TPU) fits a v5p; dense attention's quadratic scores would not."""
  mesh, devices = {"fsdp": 8}, jax.devices()[:8]

  def acts(tokens, attention):
    got = plan.plan(
      _qwen_config(tokens, attention), mesh, compile=False, devices=devices, backend="tpu"
    )
    return got.activations

  auto8, auto16 = acts(8192, "auto"), acts(16384, "auto")
  dense8, dense16 = acts(8192, "dense"), acts(16384, "dense")
  assert auto16 / auto8 < 2.3  # linear in the length
  assert dense16 / dense8 > 3.0  # quadratic scores dominate
  assert auto16 < 0.2 * dense16
  assert plan.attention_impl(plan.model_config(_qwen_config(16384, "auto"))[0], 16896, "tpu") == (
    "splash"
  )
  short = plan.model_config(_qwen_config(512, "auto"))[0]
  assert plan.attention_impl(short, attention.DENSE_MAX_LEN, "cpu") == "dense"
  assert plan.attention_impl(short, 600, "cpu") == "blockwise"


def test_plan_closed_form_counts_what_remat_dots_keeps():
  """remat "dots" keeps every weight matmul's output: the closed-form estimate grows with it and
  stays near XLA's compiled plan (Qwen2.5-7B, 1k-token responses, fsdp=8, a GPU target)."""
  mesh, devices = {"fsdp": 8}, jax.devices()[:8]

  def acts(remat, compile):
    config = _qwen_config(1024, "auto")
    config.model.remat = remat
    return plan.plan(config, mesh, compile=compile, devices=devices, backend="gpu").activations

  closed, compiled = acts("dots", False), acts("dots", True)
  assert closed > 4 * acts("full", False)
  assert abs(closed - compiled) < 0.15 * compiled, (closed / 2**30, compiled / 2**30)


def test_plan_compiles_a_kernels_stand_in_without_blockwise_residuals():
  """remat="attention" keeps the blockwise attention's output for the backward, which splash
  (TPU) and cuDNN (GPU) do not: planned for TPU, the blockwise stand-in compiles as remat
  "full" (the same memory); planned for CPU, where blockwise runs, the kept output counts."""
  devices = jax.devices()[:1]

  def acts(remat, backend):
    c = config_lib.base("smoke")
    c.model.preset, c.model.remat = "tiny", remat
    c.data.train_path = "never_read.jsonl"  # rows of data files: 64-token prompts here
    c.data.max_prompt_tokens, c.rollout.max_new_tokens = 64, 2 * attention.DENSE_MAX_LEN
    c.train.epochs = c.train.minibatches = 1
    return plan.plan(c, {"data": 1}, devices=devices, backend=backend).activations

  assert acts("attention", "tpu") == acts("full", "tpu")
  # [32 rows, 319 tokens, 4 heads, 16 + 1 floats] x 2 layers kept: 5.2 MB (measured 18.6 MB)
  assert acts("attention", "cpu") > acts("full", "cpu") + 4e6


def test_plan_resolves_remat_auto_as_the_target_runs_it():
  """remat "auto" (the default) is planned as the target runs it: "attention" on a TPU (closed
  form and the compiled stand-in), and on CPU, for a tiny model's 319-token update, no remat
  with the layers unrolled (the compile resolves it by the micro-batch, the closed form agrees)."""
  devices = jax.devices()[:1]

  def acts(remat, backend, compile, scan=True):
    c = config_lib.base("smoke")
    c.model.preset, c.model.remat, c.model.scan_layers = "tiny", remat, scan
    c.data.train_path = "never_read.jsonl"
    c.data.max_prompt_tokens, c.rollout.max_new_tokens = 64, 2 * attention.DENSE_MAX_LEN
    c.train.epochs = c.train.minibatches = 1
    return plan.plan(c, {"data": 1}, compile=compile, devices=devices, backend=backend).activations

  for compile in (False, True):
    assert acts("auto", "tpu", compile) == acts("attention", "tpu", compile)
  assert acts("auto", "cpu", False) == acts("none", "cpu", False) != acts("attention", "cpu", False)
  assert acts("auto", "cpu", True) == acts("none", "cpu", True, scan=False)


def test_update_flops_count_six_per_parameter_and_token_plus_causal_attention():
  """plan.update_flops: the body is 6 x the layers' matmul parameters per token (counted here
  from the model itself), the head 6 x its parameters per response token, and attention grows
  with T^2 (12 x heads x head_dim per query-key pair of the lower triangle)."""
  cfg = architectures.ARCHITECTURES["tiny"]
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  # The layers' weight matrices (stacked over layers): every parameter but embeddings and norms.
  kernels = sum(x.size for path, x in flat.items() if path[0] == "layers" and path[1][0] == "w")
  assert kernels == sum(x.size for x in flat.values()) - 2 * 64 * 64 - 64 * (1 + 2 * 2)
  q = cfg.num_heads * cfg.head_dim
  head = cfg.vocab_size * cfg.hidden_size
  for rows, T, R in ((1, 8, 0), (3, 32, 5)):
    attn = 12 * q * cfg.num_layers * rows * sum(range(1, T + 1))
    expect = 6 * kernels * rows * T + 6 * head * rows * R + attn
    assert plan.update_flops(cfg, rows, T, R) == pytest.approx(expect)


FAKE_GCLOUD = """#!/usr/bin/env bash
printf '%s\n---\n' "$*" >> "$GCLOUD_CALLS"
case "$*" in
  *"tpu-vm describe"*) echo 4 ;;
  *"queued-resources describe"*) echo ACTIVE ;;
esac
"""


def test_launch_scripts_parse_and_drive_gcloud(tmp_path):
  scripts = [os.path.join(REPO, "launch", n) for n in ("tpu_vm.sh", "gpu_host.sh")]
  for script in scripts:
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    assert "set -euo pipefail" in text
    out = subprocess.run([script], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "usage:" in out.stderr
  out = subprocess.run([scripts[1], "run", "--process_id", "1", "--config", "c.py"], cwd=REPO,
                       capture_output=True, text=True)  # fmt: skip
  assert out.returncode == 2 and "needs all of --coordinator" in out.stderr

  # A stand-in gcloud records the calls: the full create..delete cycle, no network contacted.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
  (bin_dir / "gcloud").chmod(0o755)
  calls = tmp_path / "calls.txt"
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", GCLOUD_CALLS=str(calls))
  cmd = [scripts[0], "all", "--name", "t1", "--zone", "us-east5-a", "--accelerator", "v5p-64",
         "--queued", "--config", "configs/qwen25_math_7b.py:v5p64", "--workdir", "gs://b/run",
         "--logs_dir", str(tmp_path / "logs"), "--", "--config.iterations=3"]  # fmt: skip
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  lines = calls.read_text().split("\n---\n")[:-1]
  assert lines[0].startswith("compute tpus queued-resources create t1-qr --zone=us-east5-a")
  assert "--runtime-version=v2-alpha-tpuv5" in lines[0] and "--node-id=t1" in lines[0]
  run = next(x for x in lines if "gppo_jax.train" in x)
  assert "--worker=all" in run and "GPPO_DISTRIBUTED=1" in run
  assert "--config='configs/qwen25_math_7b.py:v5p64'" in run and "--config.iterations=3" in run
  assert lines[-1].startswith("compute tpus queued-resources delete t1-qr")


def test_reuse_returns_the_same_built_function_for_equal_arguments_only():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as Spec

  from gppo_jax import registry

  built = []

  @sharding.reuse(maxsize=2)
  def build(spec, shardings, *, scale=1.0):
    built.append((spec, scale))
    return lambda x: x * scale

  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  rows = lambda: {"w": NamedSharding(mesh, Spec("data")), "b": [NamedSharding(mesh, Spec())]}
  f = build(("kl", 0.1), rows())
  assert build(("kl", 0.1), rows()) is f and len(built) == 1  # equal, not identical, shardings
  other = {"w": NamedSharding(mesh, Spec("fsdp")), "b": [NamedSharding(mesh, Spec())]}
  assert build(("kl", 0.1), other) is not f
  assert build(("kl", 0.2), rows()) is not f and build(("kl", 0.1), rows(), scale=2.0)(3) == 6
  assert len(built) == 4
  # Only the `maxsize` most recent stay; a registration (a name may now mean another function)
  # starts afresh.
  g = build(("kl", 0.1), rows(), scale=2.0)
  assert len(built) == 4
  assert build(("kl", 0.1), rows()) is not f and len(built) == 5
  reg = registry.Registry("thing")
  reg.register("x", 1)
  assert build(("kl", 0.1), rows(), scale=2.0) is not g and len(built) == 6
