"""The evaluation protocol on a tiny random policy: seeds, n and k, response length, macro rows."""

import jax
import numpy as np
import pytest
from flax import nnx

from gppo_jax import config_lib, errors
from gppo_jax.data.envs import Prompt
from gppo_jax.models import architectures
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import experiment, policy_eval

P = 5  # prompt tokens


class _LengthEnv:
  """Two benchmarks of 6 and 3 prompts; a response is correct when it has an even, non-zero
  number of tokens, so the score depends on the samples and on the response length."""

  kind = "math"

  class tokenizer:  # noqa: N801
    eos_ids, pad_id = (2,), 0

    @staticmethod
    def decode(ids):
      return ",".join(map(str, ids))

  max_prompt_len, max_new_tokens = P, 6

  def __init__(self, vocab: int):
    rng = np.random.default_rng(0)
    self.prompts = [
      Prompt([int(t) for t in rng.integers(3, vocab, P)], gold="", benchmark=b)
      for b in ["alpha"] * 6 + ["beta"] * 3
    ]

  def eval_prompts(self):
    return self.prompts

  def score(self, responses, prompts):
    n = [len(r.split(",")) if r else 0 for r in responses]
    r = np.array([float(k > 0 and k % 2 == 0) for k in n], np.float32)
    return r, np.ones(len(r), bool), {}

  def close(self):
    pass


@pytest.fixture(scope="module")
def policy():
  cfg = architectures.get("tiny", remat="none")
  graphdef, params = nnx.split(model_lib.create(cfg, seed=0))
  return graphdef, params, _LengthEnv(cfg.vocab_size)


def _report(policy, **settings):
  graphdef, params, env = policy
  s = policy_eval.EvalSettings(**{"batch_size": 16, **settings})
  return policy_eval.evaluate_benchmarks(graphdef, params, env, s)


def test_each_seed_of_a_multi_seed_evaluation_reproduces_its_single_seed_run(policy):
  both = _report(policy, n=4, ks=(1, 4), seeds=(3, 7))
  alone = [_report(policy, n=4, ks=(1, 4), seeds=(s,)) for s in (3, 7)]
  for i, row in enumerate([both.pooled, *both.benchmarks]):
    singles = [[a.pooled, *a.benchmarks][i] for a in alone]
    for j, (name, e) in enumerate(row.estimates()):
      got_alone = [r.estimates()[j][1] for r in singles]
      if name == "accuracy":  # greedy: one run, whatever the seeds
        assert e.per_seed == got_alone[0].per_seed == got_alone[1].per_seed
        continue
      assert e.per_seed == tuple(x.mean for x in got_alone), (row.name, name)
      assert e.mean == pytest.approx(np.mean(e.per_seed))
  assert both.pooled.avg.per_seed[0] != both.pooled.avg.per_seed[1]  # the seeds do differ
  m = both.metrics()
  assert m["eval/avg@4_seed_std"] == pytest.approx(np.std(both.pooled.avg.per_seed, ddof=1))


def test_pass_at_k_over_n_samples(policy):
  r = _report(policy, n=8, ks=(1, 2, 8), seeds=(0,))
  m = r.metrics()
  assert m["eval/pass@1"] == pytest.approx(m["eval/avg@8"])  # pass@1 is avg@n
  assert m["eval/pass@1"] <= m["eval/pass@2"] <= m["eval/pass@8"]
  assert 0 < m["eval/avg@8"] < 1  # not a constant policy
  with pytest.raises(errors.ConfigError, match="pass@8 but eval.n=4"):
    policy_eval.EvalSettings(n=4, ks=(1, 8))


def test_the_eval_response_length_is_its_own(policy):
  short = _report(policy, n=2, ks=(), max_new_tokens=1)
  long = _report(policy, n=2, ks=(), max_new_tokens=6)
  # One token is never an even non-zero count: everything is wrong at length 1.
  assert short.pooled.accuracy.mean == 0 and short.pooled.avg.mean == 0
  assert long.pooled.avg.mean > 0


def test_macro_rows_average_benchmarks_and_eval_accuracy_stays_pooled(policy):
  r = _report(policy, n=2, ks=(2,), seeds=(0,))
  m = r.metrics()
  alpha, beta = m["eval/alpha/accuracy"], m["eval/beta/accuracy"]
  assert m["eval/accuracy"] == pytest.approx((6 * alpha + 3 * beta) / 9)
  assert m["eval/macro_math/accuracy"] == pytest.approx((alpha + beta) / 2)
  assert m["eval/macro_math/pass@2"] == pytest.approx(
    (m["eval/alpha/pass@2"] + m["eval/beta/pass@2"]) / 2
  )
  se = np.hypot(m["eval/alpha/avg@2_se"], m["eval/beta/avg@2_se"]) / 2
  assert m["eval/macro_math/avg@2_se"] == pytest.approx(se)
  assert [x.name for x in r.macro] == ["macro_math"] and r.macro[0].members == ("alpha", "beta")


def test_the_default_config_is_the_old_single_k_evaluation(policy):
  """config.eval's defaults (n None, k (4,), seeds None) draw exactly what evaluate_policy(k=4)
  with the run's evaluation key draws: the numbers of earlier runs stay comparable."""
  graphdef, params, env = policy
  c = config_lib.base("smoke")
  c.eval.k, c.eval.batch_size, c.seed = (4,), 16, 5
  got = experiment.evaluate(c, graphdef, params, env, max_new_tokens=6, sample_fn=None)
  key = jax.random.fold_in(jax.random.PRNGKey(5), 10**9)  # the run's fixed evaluation key
  want = policy_eval.evaluate_policy(
    graphdef, params, env, key, k=4, max_new_tokens=6, batch_size=16
  )
  assert got == want and "eval/pass@4" in got and "eval/avg@4_seed_std" not in got
  settings = policy_eval.EvalSettings.from_config(c.eval, max_new_tokens=6, run_seed=5)
  assert (settings.n, settings.ks, settings.seeds) == (4, (4,), (5,))
  c.eval.k = 0  # the old way to skip the sampled evaluation
  greedy_only = experiment.evaluate(c, graphdef, params, env, max_new_tokens=6, sample_fn=None)
  assert set(greedy_only) == {k for k in got if "accuracy" in k}


def test_decoded_responses_keep_the_masked_tokens_without_stops():
  tokens = np.array([[5, 7, 2, 0], [9, 3, 4, 6], [2, 2, 0, 0]], np.int32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]], bool)
  texts = policy_eval.decode_responses(_LengthEnv.tokenizer, tokens, mask, stop_ids=(2, 3))
  assert texts == ["5,7", "9,4,6", ""]
  assert policy_eval.decode_responses(_LengthEnv.tokenizer, tokens, mask, ()) == [
    "5,7,2",
    "9,3,4,6",
    "2",
  ]
