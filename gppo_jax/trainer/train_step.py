"""Pure training steps: the GPPO update over one rollout batch, log-prob passes, supervised step.

`make_update_fn` returns one function that runs `epochs` x `minibatches` optimizer steps (each the
sum of `microbatches` gradient pieces, exact for every aggregation) over a rollout batch inside
`lax.scan`, so the whole update compiles once. Its input is a `Batch` (see there).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gppo_jax import errors
from gppo_jax.algorithm import objective
from gppo_jax.models import heads, partitioning
from gppo_jax.models import lora as lora_lib
from gppo_jax.models import model as model_lib


@flax.struct.dataclass
class Batch:
  """One rollout batch, as the update consumes it (numpy on the host, jax.Array on devices).

  N sequences of prompt (left-padded to P) + response (right-padded to R), shifted by one token
  for teacher forcing, so L = P + R - 1. Optional fields are None when the loss does not need them.
  """

  inputs: Any  # int32 [N, L]
  targets: Any  # int32 [N, L]
  positions: Any  # int32 [N, L]
  attn: Any  # bool [N, L]: real (non-pad) token
  logq: Any  # float32 [N, R]: behaviour log-probs of the response tokens
  mask: Any  # bool [N, R]: response tokens the loss counts
  adv: Any  # float32 [N]: advantages
  ref_logp: Any = None  # float32 [N, R]: frozen reference policy (KL penalty)
  topk_logq: Any = None  # float32 [N, R, K]: behaviour top-K log-probs (topk estimator)
  topk_ids: Any = None  # int32 [N, R, K]
  # The behaviour's kept set (rollout.logprobs_mode="sampled" with top-k/top-p): ids, -1 = not kept.
  kept_ids: Any = None  # int32 [N, R, top_k]
  # rollout.correction="tis": truncated importance weights min(pi_old / mu, C) of the policy term.
  is_weight: Any = None  # float32 [N, R]
  # rollout.routing_replay (mixtures of experts): the experts the sampler routed each response
  # token's input to (`sampler.SampleOutput.expert_ids`), which the update's forward reuses.
  expert_ids: Any = None  # int16 [N, R, num_layers, k] (sampler.EXPERT_ID_DTYPE)

  @property
  def num_rows(self) -> int:
    return self.adv.shape[0]


@flax.struct.dataclass
class TrainState:
  params: Any  # nnx.State of the trained parameters: the policy's, or with LoRA its adapters
  opt_state: Any
  step: jax.Array  # int32: optimizer steps taken
  # With LoRA (`lora.split_lora`): the frozen base weights, read but never updated,
  # carried in no optimizer state and saved in no checkpoint (`saved`). None without LoRA.
  frozen: Any = None

  def policy(self, params: Any = None) -> Any:
    """The whole policy state (what `nnx.merge(graphdef, ...)` takes) of `params` (default
    self.params): with LoRA the frozen base merged with those adapters (no copy)."""
    params = self.params if params is None else params
    return params if self.frozen is None else nnx.merge_state(self.frozen, params)

  def saved(self) -> SavedState:
    """What a checkpoint holds: everything but the frozen base."""
    return SavedState(params=self.params, opt_state=self.opt_state, step=self.step)


@flax.struct.dataclass
class SavedState:
  """A TrainState as checkpoints hold it (the fields of TrainState before LoRA, by name)."""

  params: Any
  opt_state: Any
  step: jax.Array

  def with_frozen(self, frozen: Any) -> TrainState:
    return TrainState(self.params, self.opt_state, self.step, frozen)


@functools.lru_cache(maxsize=32)  # equal settings, the same object: compiled updates are reused
def make_optimizer(
  *,
  lr: float,
  total_steps: int,
  warmup_steps: int = 0,
  schedule: str = "constant",
  weight_decay: float = 0.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  grad_clip: float | None = 1.0,
) -> optax.GradientTransformation:
  """AdamW with linear warmup, then constant / cosine / linear decay, and global-norm clipping."""
  if lr <= 0:
    raise ValueError(f"optim.lr must be > 0, got {lr}")
  decay_steps = max(1, total_steps - warmup_steps)
  if schedule == "constant":
    main = optax.constant_schedule(lr)
  elif schedule == "cosine":
    main = optax.cosine_decay_schedule(lr, decay_steps)
  elif schedule == "linear":
    main = optax.linear_schedule(lr, 0.0, decay_steps)
  else:
    raise ValueError(f"unknown optim.schedule {schedule!r}; valid: constant, cosine, linear")
  if warmup_steps > 0:
    sched = optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup_steps), main], [warmup_steps]
    )
  else:
    sched = main
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
  parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  return optax.chain(*parts)


def optimizer_from_config(config) -> optax.GradientTransformation:
  """The optimizer a training config describes (config.optim, schedule over all update steps)."""
  o = config.optim
  return make_optimizer(
    lr=o.lr,
    total_steps=config.iterations * config.train.epochs * config.train.minibatches,
    warmup_steps=o.warmup_steps,
    schedule=o.schedule,
    weight_decay=o.weight_decay,
    b1=o.b1,
    b2=o.b2,
    grad_clip=o.grad_clip,
  )


def update_spec_from_config(
  config, prompt_len: int, response_len: int, model_cfg: model_lib.ModelConfig | None = None
) -> UpdateSpec:
  """The static shape of one update (epochs, mini/micro-batches) and its loss, from a config
  (and the model's, for a mixture of experts' routing replay)."""
  u = config.train
  replay = config.rollout.get("routing_replay", False)
  if replay and (model_cfg is None or not model_cfg.is_moe):
    raise errors.ConfigError(
      "rollout.routing_replay=True: the model has no experts (a mixture of experts replays "
      "the sampler's routing)"
    )
  moe = config.model.get("moe")
  return UpdateSpec(
    prompt_len=prompt_len,
    loss=objective.LossConfig.from_config(config.loss, response_len),
    epochs=u.epochs,
    minibatches=u.minibatches,
    microbatches=u.microbatches,
    temperature=config.rollout.temperature,
    kept_width=kept_width(config.rollout),
    group_size=config.rollout.group_size if u.get("shuffle", "rows") == "groups" else 1,
    is_weight=config.rollout.get("correction", "none") == "tis",
    router_aux_coef=float(moe.aux_loss_coef) if moe is not None else 0.0,
    routing_shape=(model_cfg.num_layers, model_cfg.num_experts_per_tok) if replay else (),
  )


LOGPROBS_MODES = {"full": "tempered", "sampled": "truncated"}  # config name -> the sampler's


def kept_width(rollout) -> int:
  """Ids per token of the behaviour's recorded kept set: rollout.top_k in logprobs_mode "sampled"
  (config_lib.validate asks for top_k > 0 whenever top_p < 1 there), else 0."""
  sampled = rollout.get("logprobs_mode", "full") == "sampled"
  return int(rollout.top_k) if sampled and rollout.top_k > 0 else 0


def abstract_train_state(
  cfg: model_lib.ModelConfig, tx: optax.GradientTransformation
) -> TrainState:
  """The TrainState of a fresh model of `cfg` with optimizer `tx`, as jax.ShapeDtypeStructs:
  what the update compiles for when nothing is to be allocated (plan.py, benchmarks/)."""
  params, frozen = lora_lib.split_lora(model_lib.abstract_state(cfg))
  return TrainState(
    params=params,
    opt_state=jax.eval_shape(tx.init, params),
    step=jax.ShapeDtypeStruct((), jnp.int32),
    frozen=frozen,
  )


def abstract_batch(
  num_rows: int, prompt_len: int, response_len: int, spec: UpdateSpec, num_topk: int = 0
) -> Batch:
  """The rollout batch's shapes and dtypes (jax.ShapeDtypeStruct), with the optional fields the
  loss of `spec` needs: what the update compiles for (train.py) and the planner measures."""
  s = jax.ShapeDtypeStruct
  n, R, K = num_rows, response_len, num_topk
  seq = lambda dtype: s((n, prompt_len + R - 1), dtype)
  return Batch(
    inputs=seq(jnp.int32),
    targets=seq(jnp.int32),
    positions=seq(jnp.int32),
    attn=seq(jnp.bool_),
    logq=s((n, R), jnp.float32),
    mask=s((n, R), jnp.bool_),
    adv=s((n,), jnp.float32),
    ref_logp=s((n, R), jnp.float32) if spec.use_ref_logp else None,
    topk_logq=s((n, R, K), jnp.float32) if spec.use_topk else None,
    topk_ids=s((n, R, K), jnp.int32) if spec.use_topk else None,
    kept_ids=s((n, R, spec.kept_width), jnp.int32) if spec.kept_width else None,
    is_weight=s((n, R), jnp.float32) if spec.is_weight else None,
    expert_ids=s((n, R, *spec.routing_shape), jnp.int16) if spec.routing_shape else None,
  )


def build_batch(
  prompt_tokens: np.ndarray,
  prompt_mask: np.ndarray,
  resp_tokens: np.ndarray,
  resp_mask: np.ndarray,
  *,
  logq: np.ndarray,
  adv: np.ndarray,
  loss_mask: np.ndarray | None = None,
  **optional: np.ndarray | None,
) -> Batch:
  """A `Batch` from left-padded prompts [N, P] and right-padded responses [N, R].

  The teacher-forcing arrays inputs/targets/positions/attn [N, P + R - 1] are built here;
  `loss_mask` (default: resp_mask) says which response tokens the loss counts; `optional` fills
  ref_logp / topk_logq / topk_ids / kept_ids."""
  full = np.concatenate([prompt_tokens, resp_tokens], axis=1).astype(np.int32)
  attn = np.concatenate([prompt_mask, resp_mask], axis=1).astype(bool)
  positions = np.maximum(np.cumsum(attn, axis=1) - 1, 0).astype(np.int32)
  return Batch(
    inputs=full[:, :-1],
    targets=full[:, 1:],
    positions=positions[:, :-1],
    attn=attn[:, :-1],
    logq=np.asarray(logq, np.float32),
    mask=np.asarray(resp_mask if loss_mask is None else loss_mask, bool),
    adv=np.asarray(adv, np.float32).reshape(-1),
    **optional,
  )


def response_extent(batch: Batch, prompt_len: int) -> int:
  """How many response columns hold a real token in some row (1 .. R): the batch's longest
  response, or R when a row may fill every column."""
  R = batch.logq.shape[1]
  # attn's response columns are the inputs, response tokens 0 .. R-2; a row whose R-1 inputs are
  # all real may hold a real last token too, any other row ends at its first padding input.
  longest = int(np.asarray(batch.attn)[:, prompt_len:].sum(axis=1).max(initial=0))
  return R if longest >= R - 1 else max(1, longest)


def trim_responses(batch: Batch, prompt_len: int, keep: int) -> Batch:
  """The batch with its first `keep` response columns (keep >= `response_extent`): the columns
  after them hold padding in every row, which no loss, metric or real token's attention reads, so
  the update's result is unchanged while its work shrinks. Each distinct `keep` compiles the
  update once (jit's cache; the persistent cache across runs)."""
  R = batch.logq.shape[1]
  if keep >= R:
    return batch
  seq = ("inputs", "targets", "positions", "attn")  # [N, P + R - 1]; the rest is [N, R, ...]
  cut = {}
  for f in dataclasses.fields(batch):
    x = getattr(batch, f.name)
    if x is not None and f.name != "adv":
      x = x[:, : prompt_len + keep - 1] if f.name in seq else x[:, :keep]
    cut[f.name] = x
  return Batch(**cut)


def _response_stats(
  model,
  batch,
  *,
  prompt_len,
  temperature,
  entropy=False,
  gather=False,
  group_size=1,
  lora_key=None,
  routing=None,
):
  """Log-probs of the response tokens ("logprobs" [N, R]; with gather, "gathered_logprobs" of
  batch.topk_ids [N, R, K]; with entropy, "entropy"). With batch.kept_ids (logprobs_mode "sampled")
  both log-probs are those of the policy renormalised over the behaviour's kept set
  (`truncate_to_kept`); the entropy stays that of the full tempered distribution.
  group_size > 1: the rows come in groups of that many sharing their prompt, and each prompt
  runs through the model once (`Transformer.shared_prompt_hidden`). lora_key: the LoRA
  adapters' dropout (training passes). Mixtures of experts: with batch.expert_ids the response
  tokens' inputs take the sampler's experts (routing replay; the prompt's other tokens route
  themselves), and a dict passed as `routing` receives the forward's `moe.Routing` under
  "routing"."""
  kw = dict(lora_key=lora_key)
  if model.cfg.is_moe:
    kw.update(expert_ids=_forced_experts(batch, prompt_len))
  if group_size > 1:
    out = model.shared_prompt_hidden(
      batch.inputs,
      batch.positions,
      batch.attn,
      prompt_len=prompt_len,
      group_size=group_size,
      **kw,
    )
    hidden = out.hidden
  else:
    out = model(batch.inputs, batch.positions, attn_mask=batch.attn, **kw)
    hidden = out.hidden[:, prompt_len - 1 :]
  if routing is not None and out.routing is not None:
    routing["routing"] = out.routing
  targets = batch.targets[:, prompt_len - 1 :]
  ids = []
  if gather:
    ids.append(batch.topk_ids)
  if batch.kept_ids is not None:
    ids.append(jnp.maximum(batch.kept_ids, 0))  # -1 (not kept) gathers id 0, masked below
  kwargs = {"gather_ids": jnp.concatenate(ids, axis=-1)} if ids else {}
  stats = heads.chunked_logprobs(
    model, hidden, targets, temperature=temperature, entropy=entropy, **kwargs
  )
  if batch.kept_ids is None:
    return stats
  width = batch.kept_ids.shape[-1]
  gathered = stats.pop("gathered_logprobs")
  topk = gathered[..., :-width] if gather else None
  stats["logprobs"], topk = truncate_to_kept(
    stats["logprobs"], gathered[..., -width:], batch.kept_ids, topk, batch.topk_ids
  )
  if gather:
    stats["gathered_logprobs"] = topk
  return stats


def _forced_experts(batch, prompt_len: int):
  """int32 [N, L, num_layers, k]: batch.expert_ids (response-aligned: column j is the input
  P - 1 + j) placed on the sequence, -1 (route yourself) on the prompt's first P - 1 inputs;
  None without recorded experts."""
  if batch.expert_ids is None:
    return None
  ids = batch.expert_ids.astype(jnp.int32)
  L = batch.inputs.shape[1]
  pad = jnp.full((ids.shape[0], prompt_len - 1, *ids.shape[2:]), -1, jnp.int32)
  return jnp.concatenate([pad, ids], axis=1)[:, :L]


def routing_flips(router_ids, recorded, mask):
  """The share of (response token, expert layer) pairs whose router's own top-k set differs
  from the recorded one (`sampler.SampleOutput.expert_ids`): router_ids, recorded int
  [N, R, num_layers, k] (-1 in dense layers), mask bool [N, R]."""
  same = jnp.all(jnp.sort(router_ids, -1) == jnp.sort(recorded, -1), axis=-1)  # [N, R, L]
  counted = mask[:, :, None] & (recorded[..., 0] >= 0)
  n = jnp.sum(counted)
  return jnp.sum(counted & ~same) / jnp.maximum(n, 1)


def truncate_to_kept(logp, kept_logp, kept_ids, topk_logp=None, topk_ids=None):
  """Log-probs of a policy renormalised over the behaviour's kept set S (top-k / top-p).

  logp [...]: log pi(a) of the sampled tokens (a is in S: the behaviour drew it from S);
  kept_logp [..., K]: log pi of kept_ids [..., K] (-1 = not in S). Returns log pi(a) - log pi(S),
  and with topk_logp / topk_ids [..., J] the same for those ids (-inf outside S). Positions with
  an empty S (padding) get their log-probs back unchanged, and every gradient stays finite.
  """
  valid = kept_ids >= 0
  has = jnp.any(valid, axis=-1)
  # An all-(-inf) row would give logsumexp -inf and a NaN gradient: such rows sum zeros instead.
  masked = jnp.where(valid, kept_logp, jnp.where(has[..., None], -jnp.inf, 0.0))
  log_mass = jnp.where(has, jax.nn.logsumexp(masked, axis=-1), 0.0)
  out = logp - log_mass
  if topk_logp is None:
    return out, None
  in_set = jnp.any(topk_ids[..., :, None] == jnp.where(valid, kept_ids, -2)[..., None, :], -1)
  in_set |= ~has[..., None]
  return out, jnp.where(in_set, topk_logp - log_mass[..., None], -jnp.inf)


def make_logprob_fn(
  graphdef: nnx.GraphDef, *, prompt_len: int, temperature: float, group_size: int = 1
) -> Callable:
  """jit(params, batch) -> float32 [N, R] log-probs of the response tokens under `params`
  (group_size > 1: rows in groups sharing their prompt, as UpdateSpec.group_size)."""

  @jax.jit
  def logprobs(params, batch):
    model = nnx.merge(graphdef, params)
    stats = _response_stats(
      model, batch, prompt_len=prompt_len, temperature=temperature, group_size=group_size
    )
    return stats["logprobs"]

  return logprobs


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
  """Static shape of one update: how the rollout batch is cut, and the loss."""

  prompt_len: int
  loss: objective.LossConfig
  epochs: int = 1
  minibatches: int = 1
  microbatches: int = 1
  temperature: float = 1.0
  # rollout.logprobs_mode "sampled" with truncation: the batch carries the behaviour's kept set
  # (kept_ids, this many ids per token) and the current policy is renormalised over it.
  kept_width: int = 0
  # train.shuffle "groups": the batch's rows come in groups of this many responses to one prompt
  # (consecutive rows); each epoch shuffles whole groups, every mini- and micro-batch holds whole
  # groups, and each prompt runs through the model once per step. 1: rows are shuffled singly.
  group_size: int = 1
  # rollout.correction="tis": the batch carries is_weight, which weights each token's policy term.
  is_weight: bool = False
  # Mixtures of experts: model.moe.aux_loss_coef, the weight of the router's load-balancing loss
  # (`moe.router_aux_loss`) in the loss; rollout.routing_replay: the batch carries the sampler's
  # experts, (num_layers, k) each token (`Batch.expert_ids`), and the forward reuses them.
  router_aux_coef: float = 0.0
  routing_shape: tuple[int, ...] = ()

  @property
  def use_topk(self) -> bool:
    """Whether the batch carries the behaviour top-K (topk_logq, topk_ids) for the estimator."""
    return self.loss.estimator == "topk"

  @property
  def use_ref_logp(self) -> bool:
    """Whether the batch carries the reference policy's log-probs (ref_logp) for the KL penalty."""
    return self.loss.kl_coef > 0


def epoch_permutation(key: jax.Array, num_rows: int, group_size: int = 1) -> jax.Array:
  """The order of one epoch's rows: a random permutation of the groups (consecutive runs of
  group_size rows), each group's rows kept together and in order. group_size 1 is
  jax.random.permutation(key, num_rows)."""
  groups = jax.random.permutation(key, num_rows // group_size)
  return (groups[:, None] * group_size + jnp.arange(group_size)).reshape(-1)


def make_update_fn(
  graphdef: nnx.GraphDef, tx: optax.GradientTransformation, spec: UpdateSpec
) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
  """Returns update(state, batch, rng) -> (state, metrics [epochs * minibatches] per key).

  With LoRA (state.frozen set) the gradient and the optimizer see only the adapters
  (state.params); the frozen base is read as it is."""
  loss_cfg = spec.loss

  def loss_fn(params, frozen, mb, normalizer, key):
    model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, frozen, params)
    routing = {}
    stats = _response_stats(
      model,
      mb,
      prompt_len=spec.prompt_len,
      temperature=spec.temperature,
      entropy=loss_cfg.entropy_coef > 0,
      gather=spec.use_topk,
      group_size=spec.group_size,
      lora_key=key,
      routing=routing,
    )
    extra: dict[str, Any] = {}
    moe_metrics = {}
    if "routing" in routing:
      r = routing["routing"]
      moe_metrics["moe/aux_loss"] = r.aux_loss
      if mb.expert_ids is not None:
        ids = r.router_ids[:, spec.prompt_len - 1 :]
        moe_metrics["moe/routing_flips"] = routing_flips(ids, mb.expert_ids, mb.mask)
    if spec.use_topk:
      extra["estimator_kwargs"] = dict(
        topk_logp=stats["gathered_logprobs"],
        topk_logq=mb.topk_logq,
        topk_ids=mb.topk_ids,
        tokens=mb.targets[:, spec.prompt_len - 1 :],
      )
    if spec.use_ref_logp:
      extra["ref_logp"] = mb.ref_logp
    if loss_cfg.entropy_coef > 0:
      extra["entropy"] = stats["entropy"]
    if spec.is_weight:
      extra["token_weight"] = mb.is_weight
    loss, metrics = objective.policy_loss(
      stats["logprobs"], mb.logq, mb.adv, mb.mask, loss_cfg, normalizer=normalizer, **extra
    )
    if spec.router_aux_coef and "moe/aux_loss" in moe_metrics:
      # Each micro-batch adds its share: the mini-batch's gradient is that of the mean.
      aux = moe_metrics["moe/aux_loss"] * (spec.router_aux_coef / spec.microbatches)
      loss = loss + aux
    return loss, {**metrics, **moe_metrics}

  grad_fn = jax.grad(loss_fn, has_aux=True)

  def split(x, n):
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])

  def minibatch_step(carry, xs, frozen):
    params, opt_state = carry
    mb, key = xs
    # The normaliser of the whole mini-batch, so that micro-batch gradients simply add up.
    _, count = objective.aggregate_terms(
      jnp.zeros(mb.mask.shape), mb.mask, loss_cfg.aggregation, loss_cfg.max_len
    )
    micro = jax.tree.map(lambda x: split(x, spec.microbatches), mb)

    def micro_step(acc, xs):
      piece, key = xs
      piece = partitioning.constrain_batch(piece)
      grads, metrics = grad_fn(params, frozen, piece, count, key)
      return jax.tree.map(jnp.add, acc, grads), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    keys = jax.random.split(key, spec.microbatches)
    grads, metrics = jax.lax.scan(micro_step, zeros, (micro, keys))
    summed = {k: jnp.sum(metrics.pop(k), axis=0) for k in ("loss/sum", "loss/count")}
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    metrics.update(summed)
    metrics["loss/total"] = summed["loss/sum"] / jnp.maximum(count, 1.0)
    metrics["optim/grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), metrics

  def update(state: TrainState, batch: Batch, rng: jax.Array):
    n, G = batch.num_rows, spec.group_size
    if n % (spec.minibatches * spec.microbatches * G):
      raise ValueError(
        f"rollout batch of {n} sequences does not split into {spec.minibatches} mini-batches x "
        f"{spec.microbatches} micro-batches" + (f" of whole groups of {G}" if G > 1 else "")
      )

    def epoch_step(carry, key):
      perm = epoch_permutation(key, n, G)
      shuffled = jax.tree.map(lambda x: split(x[perm], spec.minibatches), batch)
      # The mini-batches' LoRA dropout keys (unused without dropout).
      keys = jax.random.split(jax.random.fold_in(key, 1), spec.minibatches)
      step = functools.partial(minibatch_step, frozen=state.frozen)
      return jax.lax.scan(step, carry, (shuffled, keys))

    keys = jax.random.split(rng, spec.epochs)
    (params, opt_state), metrics = jax.lax.scan(epoch_step, (state.params, state.opt_state), keys)
    metrics = jax.tree.map(lambda m: m.reshape(-1), metrics)
    steps = spec.epochs * spec.minibatches
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + steps)
    return new_state, metrics

  return update


def summarize_update_metrics(metrics: dict[str, np.ndarray]) -> dict[str, float]:
  """Host-side summary: the mean over all optimizer steps of an update, plus the last half's
  masked fractions (the trust region acts on the later, off-policy mini-batches) and the first
  step's masked fraction and divergence estimate (`*_first`: 0 for on-policy rollouts, up to
  float noise; not with rollout.staleness)."""
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    out[k] = float(np.max(v)) if k.endswith("_max") or k == "ratio/max" else float(np.mean(v))
    if k == "ratio/min":
      out[k] = float(np.min(v))
  for k in ("trust/masked_frac", "trust/masked_frac_high", "trust/masked_frac_low"):
    if k in metrics:
      v = np.asarray(metrics[k])
      out[k + "_late"] = float(np.mean(v[len(v) // 2 :]))
  for k in ("trust/masked_frac", "div/estimate_mean"):  # the first step: on-policy unless stale
    if k in metrics:
      out[k + "_first"] = float(np.asarray(metrics[k]).reshape(-1)[0])
  return out


def make_sft_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Callable:
  """jit(params, opt_state, batch) -> (params, opt_state, loss): cross-entropy on masked targets.

  batch: inputs/targets/positions/attn [N, L] and loss_mask [N, L] (True on answer tokens).
  """

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    hidden = model(batch["inputs"], batch["positions"], attn_mask=batch["attn"]).hidden
    lp = heads.chunked_logprobs(model, hidden, batch["targets"])["logprobs"]
    m = batch["loss_mask"].astype(jnp.float32)
    return -jnp.sum(lp * m) / jnp.maximum(jnp.sum(m), 1.0)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step
