"""Evaluates a policy on the config's held-out set(s) and prints a JSON report.

  python -m gppo_jax.evaluate --config=configs/kl_atomic.py --workdir=workdirs/kl_atomic

--checkpoint picks the policy: `latest` (the workdir's newest readable checkpoint, the default),
`init` (the initial, warm-started policy), another run's workdir, or a Hugging Face folder (e.g. a
run's hf_export). Evaluation is read-only: it creates no folder and writes nothing into any run,
so it may run beside the trainer of the workdir it reads, and it finds what it evaluates before
it builds or warm-starts anything.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
from flax import nnx

from gppo_jax import (
  checkpointing,
  experiment,
  partitioning,
  sampler,
  sharding,
  train_step,
)
from gppo_jax.errors import UserError

log = logging.getLogger("gppo_jax")


def _is_hf_folder(path: str) -> bool:
  # A run's workdir has a config.json too, but no weights beside it.
  return (
    "://" not in path
    and os.path.isdir(path)
    and any(f.endswith(".safetensors") for f in os.listdir(path))
  )


def find_source(workdir: str, which: str) -> tuple[str, str]:
  """("init" | "hf" | "checkpoint", path) for --checkpoint, checked without writing anything."""
  if which == "init":
    return "init", ""
  source = workdir if which == "latest" else which
  if _is_hf_folder(source):
    return "hf", source
  ckpt_dir = experiment.split_workdir(source)[1]
  if "://" not in ckpt_dir and not os.path.isdir(ckpt_dir):
    what = "--workdir" if which == "latest" else "--checkpoint"
    raise UserError(
      f"{what}={source!r} has no checkpoints folder ({ckpt_dir}) and no *.safetensors; "
      "--checkpoint takes latest (the --workdir's newest), init, a run's workdir or a Hugging "
      "Face folder"
    )
  return "checkpoint", ckpt_dir


def evaluate_checkpoint(config, workdir: str, which: str = "latest") -> dict[str, Any]:
  """Evaluates a policy on the config's held-out set(s); returns the report as a dict.

  which: "latest" (the workdir's newest readable checkpoint), "init" (the initial / warm-started
  policy), the path of another run's workdir, or a Hugging Face folder (e.g. a run's hf_export).
  """
  from gppo_jax import config_lib

  config_lib.validate(config)
  experiment.check_inputs(config)
  kind, path = find_source(workdir, which)
  mngr = None
  if kind == "checkpoint":
    mngr = checkpointing.make_manager(path, read_only=True)
    if mngr.latest_step() is None:
      raise UserError(
        f"no checkpoint in {path} yet; --checkpoint=init evaluates the initial policy"
      )
  mesh = sharding.make_mesh(config.mesh)
  graphdef, params, _, env, _ = experiment.build_policy(
    config, say=lambda t: log.info(t), mesh=mesh, warm_start=kind == "init"
  )
  try:
    if kind == "hf":
      from gppo_jax import hf_checkpoint

      model = hf_checkpoint.load_model(
        path, mesh=mesh, dtype=config.model.dtype, param_dtype=config.model.param_dtype
      )
      graphdef, params = nnx.split(model)
    elif kind == "checkpoint":
      tx = train_step.optimizer_from_config(config)
      # Restored straight onto the mesh: a policy too big for one device never lands on one.
      abstract = experiment.abstract_state(params, tx, mesh)
      _, restored, _ = checkpointing.restore_latest(mngr, abstract, set_aside=False)
      params = restored.params
    param_sh = partitioning.state_shardings(params, mesh, partitioning.DEFAULT_RULES)
    params = jax.device_put(params, param_sh)
    max_new = experiment.sampling_params(config, env, stop_ids=(), pad_id=0).max_new_tokens
    sample_fn = sampler.MeshSampler(graphdef, param_sh)
    metrics = experiment.evaluate(
      config, graphdef, params, env, max_new_tokens=max_new, sample_fn=sample_fn
    )
    num_problems = len(env.eval_prompts())
  finally:
    env.close()
  return {
    "checkpoint": which,
    "num_problems": num_problems,
    "decoding": {
      "greedy": True,
      "k": config.eval.k,
      "temperature": config.eval.temperature,
      "top_p": config.eval.top_p,
      "max_new_tokens": max_new,
    },
    **metrics,
  }


def main(argv):
  del argv
  from absl import flags
  from ml_collections import config_flags

  experiment.quiet_libraries(flags.FLAGS)
  cfg = flags.FLAGS.config
  workdir = flags.FLAGS.workdir or experiment.default_workdir(
    config_flags.get_config_filename(flags.FLAGS["config"])
  )
  report = evaluate_checkpoint(cfg, workdir, which=flags.FLAGS.checkpoint)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  from absl import flags
  from ml_collections import config_flags

  from gppo_jax import cli

  sharding.maybe_initialize_distributed()  # multi-host: before the config file runs any jax code
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
  flags.DEFINE_string("workdir", None, "Run folder holding checkpoints/.")
  flags.DEFINE_string(
    "checkpoint",
    "latest",
    "'latest' (in --workdir), 'init' (initial policy), another run's workdir, or an HF folder.",
  )
  flags.mark_flags_as_required(["config"])
  cli.run(main)
