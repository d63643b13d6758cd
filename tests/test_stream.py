"""rollout.mode="stream": an engine that never drains (generation/stream.py) and the trainer's
stream of finished groups (trainer/stream_rollout.py).

The engine's rows are checked against the batch engine (the same row keys give the same tokens
whatever the companions, the ring's reuse or preemption), and a change of weights between
chunks against both policies; the trainer's stream for its bounded lag, its drops, its resume
(no iteration skipped, no prompt taken twice) and its errors."""

import os
import signal

import jax
import numpy as np
import pytest
from conftest import load_config
from flax import nnx

from gppo_jax import config_lib, errors, train
from gppo_jax.generation import continuous, paged, sampler, stream
from gppo_jax.models import architectures
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import stream_rollout

G = 3
N = 20


@pytest.fixture(scope="module")
def policy():
  cfg = architectures.get("char-tiny", vocab_size=40)
  graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
  # Another policy of the same shape: the weights a stream switches to.
  other = jax.tree.map(lambda x: x * 1.5, params)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 40, rng.integers(2, 12))] for _ in range(9)]
  return graphdef, params, other, prompts


SP = sampler.SamplingParams(max_new_tokens=N, stop_ids=(1,), pad_id=0)
KEY = jax.random.key(5)


def _batch(graphdef, params, prompts, ids, limits=None):
  """The batch engine's answer to `prompts` with prompt ids `ids`: the reference."""
  engine = continuous.ContinuousSampler(
    graphdef, SP, continuous.EngineConfig(slots=8, page_size=4, chunk=3)
  )
  return engine(
    params, prompts, KEY, group_size=G, prompt_ids=ids, prompt_len=12, row_limits=limits
  )


def _drain(engine, prompts, ids, *, swap=None, limits=None):
  """Feeds `prompts` as room allows and turns until every group is out: {id: StreamGroup}.
  swap=(params, version): left for the engine once the first group is out; limits: int32
  [len(prompts) * G], each row's max new tokens."""
  if limits is None:
    limits = np.full(len(prompts) * G, N, np.int32)
  out, turns = {}, 0
  rows = [limits[k * G : (k + 1) * G] for k in range(len(prompts))]
  queue = list(zip(prompts, ids, rows, strict=True))
  while queue or engine.busy or turns == 0:
    take = min(engine.room, len(queue))
    if take:
      part, queue = queue[:take], queue[take:]
      engine.add(
        [p for p, _, _ in part], [i for _, i, _ in part], np.concatenate([x for *_, x in part])
      )
    for group in engine.step():
      assert group.prompt_id not in out  # each prompt handed out once
      out[group.prompt_id] = group
    turns += 1
    if swap is not None and out:
      engine.set_params(*swap)
      swap = None
    assert turns < 500
  return out


@pytest.mark.parametrize("slots,pages,capacity", [(4, None, 3), (6, 10, 4), (0, "memory", 4)])
def test_stream_rows_equal_the_batch_engine(policy, slots, pages, capacity):
  """A ring of `capacity` prompts, reused as groups finish, with or without a pool small enough
  to preempt, rows with their own length limits: every prompt's rows are the batch engine's
  (tokens equal, log-probs within 1e-5), drawn by version 0 throughout, and no token is drawn
  twice."""
  graphdef, params, _, prompts = policy
  ids = list(range(100, 100 + len(prompts)))
  limits = np.random.default_rng(slots).integers(1, N + 1, len(prompts) * G).astype(np.int32)
  sizes = dict(num_pages=pages)
  if pages == "memory":  # slots 0: as many as a pool of 30 pages holds
    page = paged.pool_bytes(nnx.merge(graphdef, params).cfg, 1, 4)
    sizes = dict(kv_memory_gib=30 * page / 2**30)
  engine = stream.StreamEngine(
    graphdef, SP, continuous.EngineConfig(slots=slots, page_size=4, chunk=3, **sizes),
    group_size=G, capacity=capacity, prompt_len=12, key=KEY,
  )  # fmt: skip
  engine.set_params(params, version=0)
  got = _drain(engine, prompts, ids, limits=limits)
  ref = _batch(graphdef, params, prompts, ids, limits)
  assert sorted(got) == ids
  for i, pid in enumerate(ids):
    rows = slice(i * G, (i + 1) * G)
    np.testing.assert_array_equal(got[pid].out.tokens, ref.tokens[rows])
    np.testing.assert_array_equal(got[pid].out.lengths, ref.lengths[rows])
    np.testing.assert_allclose(got[pid].out.logprobs, ref.logprobs[rows], atol=1e-5)
    v = got[pid].versions
    assert (v[got[pid].out.mask] == 0).all() and (v[~got[pid].out.mask] == -1).all()
  st = engine.stats()
  assert st["row_steps"] + st["admitted_rows"] == sum(g.out.lengths.sum() for g in got.values())
  if pages == "memory":
    assert 1 < st["slots"] < capacity * G  # what 30 pages hold at the expected footprint
  elif pages is not None:
    assert st.get("preempted", 0) > 0


def test_weights_change_between_chunks_each_token_records_its_version(policy):
  """New weights left once the first group is out: rows running then span both versions (0s,
  then 1s, never back), rows admitted later are the batch engine's under the new weights and
  rows that finished before are its rows under the old ones."""
  graphdef, params, other, prompts = policy
  ids = list(range(len(prompts)))
  engine = stream.StreamEngine(
    graphdef, SP, continuous.EngineConfig(slots=6, page_size=4, chunk=3),
    group_size=G, capacity=2, prompt_len=12, key=KEY,
  )  # fmt: skip
  engine.set_params(params, version=0)
  got = _drain(engine, prompts, ids, swap=(other, 1))
  old, new = _batch(graphdef, params, prompts, ids), _batch(graphdef, other, prompts, ids)
  spans = olds = news = 0
  for i in ids:
    g, rows = got[i], slice(i * G, (i + 1) * G)
    for v, m in zip(g.versions, g.out.mask, strict=True):
      drawn = v[m]
      assert set(drawn) <= {0, 1} and (np.diff(drawn) >= 0).all()
    drawn = g.versions[g.out.mask]
    if (drawn == 0).all():
      olds += 1
      np.testing.assert_array_equal(g.out.tokens, old.tokens[rows])
    elif (drawn == 1).all():
      news += 1
      np.testing.assert_array_equal(g.out.tokens, new.tokens[rows])
      np.testing.assert_allclose(g.out.logprobs, new.logprobs[rows], atol=1e-5)
    else:
      spans += 1
  assert olds and news and spans, (olds, news, spans)
  assert engine.version == 1


def test_bad_stream_input_is_named(policy):
  graphdef, params, _, _ = policy
  engine = stream.StreamEngine(
    graphdef, SP, continuous.EngineConfig(slots=4, page_size=4),
    group_size=G, capacity=2, prompt_len=8, key=KEY,
  )  # fmt: skip
  with pytest.raises(RuntimeError, match="set_params"):
    engine.step()
  engine.set_params(params, version=0)
  with pytest.raises(ValueError, match="only 2 of the stream's 2 places are free"):
    engine.add([[3]] * 3, [0, 1, 2])
  with pytest.raises(ValueError, match="prompt 7 has 9 tokens"):
    engine.add([[3] * 9], [7])
  with pytest.raises(ValueError, match=r"limits: one limit in \[1, 20\] per row \(3 rows\)"):
    engine.add([[3]], [8], limits=np.asarray([1, 2, 21]))


# --- The trainer's stream -----------------------------------------------------------------------


def config(iterations=4, **rollout):
  c = load_config("kl_atomic.py", "smoke,task=add1")
  c.rollout.mode = "stream"
  c.rollout.engine = "continuous"
  c.rollout.decode_chunk = 2
  c.rollout.page_size = 4
  c.iterations = iterations
  c.checkpoint.every = 1
  c.eval.every = 2  # an evaluation with the stream running
  for k, v in rollout.items():
    c.rollout[k] = v
  return c


def _rows(workdir):
  import json

  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _taken(monkeypatch):
  """Records the prompt id of every group the learner takes, by iteration."""
  real, taken = stream_rollout.Stream._next, []

  def _next(self):
    group = real(self)
    taken.append(group.prompt_id)
    return group

  monkeypatch.setattr(stream_rollout.Stream, "_next", _next)
  return taken


@pytest.mark.parametrize("rollout_devices", [0, 4])
def test_stream_trains_with_a_bounded_lag(tmp_path, monkeypatch, rollout_devices):
  taken = _taken(monkeypatch)
  c = config(max_staleness=1)
  c.mesh.rollout_devices = rollout_devices
  summary = train.train_and_evaluate(c, str(tmp_path / "run"))
  assert not summary.get("preempted")
  rows = [r for r in _rows(tmp_path / "run") if "rollout/lag_mean" in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for r in rows:
    assert 0 <= r["rollout/lag_mean"] <= r["rollout/lag_max"] <= 1
    assert r["rollout/dropped"] >= 0 and np.isfinite(r["loss/total"])
    assert r["rollout/engine/decode_steps"] >= 0 and "rollout/policy_version" in r
  assert rows[0]["rollout/lag_max"] == 0  # nothing is older than the initial policy
  n = c.rollout.prompts_per_iter
  dropped = sum(r["rollout/dropped"] for r in rows)
  assert len(taken) == len(set(taken)) == 4 * n + dropped  # each prompt taken once


def test_stream_resumes_without_skipping_or_retraining(tmp_path, monkeypatch):
  """SIGTERM during a streaming run: the update in progress finishes, is saved, the run exits;
  the rerun goes on from the next iteration and never takes a prompt the first run took."""
  taken = _taken(monkeypatch)
  real = train._publish

  def publish(run, state, version):
    real(run, state, version)
    if version == 2:  # after the second update
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(train, "_publish", publish)
  workdir = str(tmp_path / "run")
  stopped = train.train_and_evaluate(config(), workdir)
  assert stopped["preempted"] and stopped["iterations_done"] == 2, stopped
  first = list(taken)
  monkeypatch.setattr(train, "_publish", real)
  train.train_and_evaluate(config(), workdir)
  second = taken[len(first) :]
  steps = [r["step"] for r in _rows(workdir) if "rollout/lag_mean" in r]
  assert steps == [1, 2, 3, 4]
  assert first and second and not set(first) & set(second)
  # The prompts in flight at the stop are drawn again: the rerun starts at the oldest prompt
  # not yet taken, so nothing between is skipped.
  assert min(second) <= max(first) + 1


def test_a_stream_error_stops_the_run_with_that_error(tmp_path, monkeypatch):
  real, turns = stream.StreamEngine.step, []

  def step(self):
    turns.append(1)
    if len(turns) == 30:
      raise RuntimeError("stream engine exploded")
    return real(self)

  monkeypatch.setattr(stream.StreamEngine, "step", step)
  with pytest.raises(RuntimeError, match="stream engine exploded"):
    train.train_and_evaluate(config(iterations=50), str(tmp_path / "run"))


def test_stream_settings_are_checked():
  for change, message in (
    (dict(staleness=1), "bounded by rollout.max_staleness"),
    (dict(engine="fixed"), "runs the continuous engine"),
    (dict(max_staleness=0), "rollout.max_staleness"),
  ):
    c = config()
    for k, v in change.items():
      c.rollout[k] = v
    with pytest.raises(errors.ConfigError, match=message):
      config_lib.validate(c)
