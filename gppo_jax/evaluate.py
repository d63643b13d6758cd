"""Evaluates a policy on the config's held-out set(s): a JSON report and a Markdown table.

  python -m gppo_jax.evaluate --config=configs/kl_atomic.py --workdir=workdirs/kl_atomic
  python -m gppo_jax.evaluate --workdir=workdirs/kl_atomic --config.eval.n=16  # the run's config
  python -m gppo_jax.evaluate --config=configs/qwen25_math_7b.py:gpu8 \\
      --config.model.path=/models/Qwen2.5-Math-7B --config.eval.n=16 --config.eval.k=1,8,16 \\
      --config.eval.seeds=0,1,2                   # the model itself: no training, no workdir

Without --config, the config is the one the run saved (<workdir>/config.json, written by train),
and --config.* overrides apply to it.

--checkpoint picks the policy: `latest` (the workdir's newest readable checkpoint), `init` (the
initial policy: config.model.path as it is, or the warm-started built-in policy), another run's
workdir, or a Hugging Face folder (e.g. a run's hf_export). Without --checkpoint and --workdir, a
config with model.path whose default workdir holds no checkpoints evaluates the model itself. With
model.path set, evaluation reads only data.eval_path (never the training data).

The protocol is config.eval (docs/guide.md "Evaluation"): greedy accuracy, avg@n and pass@k per
benchmark with standard errors, and the macro-average per benchmark kind. The report goes to
--out (default <run folder>/eval/<step>/, or eval/init/ or eval/<folder name>/): report.json and
report.md, written once the evaluation has succeeded; the Markdown table is also printed.
Nothing else is written: no lock is taken and the checkpoints are only read, so it may run beside
the trainer of the workdir it reads, and it finds what it evaluates before it builds or
warm-starts anything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from typing import Any

import jax
from flax import nnx

from gppo_jax import cli, config_lib, files
from gppo_jax.errors import UserError
from gppo_jax.models import partitioning, sharding
from gppo_jax.rewards import pass_at_k
from gppo_jax.trainer import checkpointing, experiment, policy_eval, train_step

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
      "--checkpoint takes latest (the --workdir's newest), init (model.path as it is, or the "
      "built-in initial policy), a run's workdir or a Hugging Face folder"
    )
  return "checkpoint", ckpt_dir


def run_config(argv):
  """--config when the command line `argv` gives none but a --workdir: the config that run saved
  (experiment.read_run_config); None otherwise."""
  if cli.flag_argument(argv, "config") is not None:
    return None
  workdir = cli.flag_argument(argv, "workdir")
  return experiment.read_run_config(workdir) if workdir else None


def default_checkpoint(config, workdir: str, workdir_given: bool) -> str:
  """--checkpoint when it is not given: `latest`, except for a config with model.path whose
  default workdir (no --workdir) has no checkpoints: then the model itself (`init`)."""
  if workdir_given or config.model.path is None:
    return "latest"
  ckpt_dir = experiment.split_workdir(workdir)[1]
  if "://" in ckpt_dir or os.path.isdir(ckpt_dir):
    return "latest"
  log.info("no checkpoints in %s: evaluating model.path=%s as it is", workdir, config.model.path)
  return "init"


def for_evaluation(config):
  """A copy of `config` for evaluation: with model.path, the training data is dropped (the
  evaluation reads data.eval_path only, so a missing training file does not matter)."""
  c = config.copy_and_resolve_references()
  if c.model.path is not None:
    c.data.train_path = None
  return c


def protocol(settings: policy_eval.EvalSettings) -> dict[str, Any]:
  """The resolved evaluation settings, as the report states them."""
  out = dataclasses.asdict(settings)
  out["k"] = list(out.pop("ks"))
  out["seeds"] = list(out["seeds"])
  return {"greedy": True, **out}


def evaluate_checkpoint(config, workdir: str, which: str = "latest") -> dict[str, Any]:
  """Evaluates a policy on the config's held-out set(s); returns the report as a dict.

  which: "latest" (the workdir's newest readable checkpoint), "init" (model.path as it is, or the
  initial / warm-started built-in policy), the path of another run's workdir, or a Hugging Face
  folder (e.g. a run's hf_export). The report: `source` (what was evaluated and the run folder
  its report belongs in), `num_problems`, `protocol`, `metrics` (the flat keys the trainer logs)
  and the rows of `pass_at_k.EvalReport.as_dict` (benchmarks, macro, pooled).
  """

  config_lib.validate(config, evaluating=True)
  config = for_evaluation(config)
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
  step = None
  try:
    if kind == "hf":
      from gppo_jax.models import hf_checkpoint

      model = hf_checkpoint.load_model(path, mesh=mesh, **config_lib.model_overrides(config))
      graphdef, params = nnx.split(model)
    elif kind == "checkpoint":
      tx = train_step.optimizer_from_config(config)
      # Restored straight onto the mesh: a policy too big for one device never lands on one.
      abstract = experiment.abstract_state(params, tx, mesh)
      step, restored, _ = checkpointing.restore_latest(mngr, abstract, set_aside=False)
      # The trained parameters over the initial policy: with LoRA the checkpoint holds only
      # the adapters, and the base is the initial policy's.
      params = nnx.merge_state(params, restored.params)
    param_sh = partitioning.state_shardings(params, mesh, partitioning.DEFAULT_RULES)
    params = jax.device_put(params, param_sh)
    max_new = experiment.sampling_params(config, env, stop_ids=(), pad_id=0).max_new_tokens
    settings = policy_eval.EvalSettings.from_config(
      config.eval, max_new_tokens=max_new, run_seed=config.seed
    )
    sample_fn = experiment.sample_fn(config, graphdef, param_sh, mesh)
    result = experiment.evaluate(
      config, graphdef, params, env, max_new_tokens=max_new, sample_fn=sample_fn, report=True
    )
    num_problems = len(env.eval_prompts())
  finally:
    env.close()
  if kind == "checkpoint":
    run, label = experiment.split_workdir(workdir if which == "latest" else which)[0], str(step)
  else:
    named = path or config.model.path
    run = experiment.split_workdir(workdir)[0]
    label = os.path.basename(os.path.normpath(named)) if named else "init"
  rows = result.as_dict() if result is not None else {}
  return {
    "checkpoint": which,
    "source": {"kind": kind, "path": path or config.model.path, "step": step, "run": run},
    "label": label,
    "num_problems": num_problems,
    "protocol": protocol(settings),
    "metrics": result.metrics() if result is not None else {},
    **rows,
    "markdown": pass_at_k.to_markdown(result) if result is not None else "",
  }


def _finite(x):
  """NaN and inf (a standard error of one problem, an empty benchmark) as null: strict JSON."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  return x


def write_report(report: dict[str, Any], out: str) -> tuple[str, str]:
  """Writes report.json and report.md into `out` (created); returns their paths."""
  os.makedirs(out, exist_ok=True)
  p = report["protocol"]
  src = report["source"]
  what = src["path"] or "the built-in initial policy"
  if src["kind"] == "checkpoint":
    what = f"{src['run']}, checkpoint {src['step']}"
  lines = [
    f"# Evaluation: {what}",
    "",
    f"Greedy, then n = {p['n']} samples per problem at temperature {p['temperature']}, top-p "
    f"{p['top_p']}, up to {p['max_new_tokens']} new tokens, seeds {p['seeds']}; pass@k for k = "
    f"{p['k']}. Cells: percent, mean ± standard error over problems"
    + (", (sd over seeds)" if len(p["seeds"]) > 1 else "")
    + "; macro rows average the benchmarks of one kind.",
    "",
    report["markdown"],
  ]
  json_path, md_path = os.path.join(out, "report.json"), os.path.join(out, "report.md")
  body = _finite({k: v for k, v in report.items() if k != "markdown"})
  with files.atomic_write(json_path) as f:
    json.dump(body, f, indent=2, default=str, allow_nan=False)
  files.write_atomic(md_path, "\n".join(lines))
  return json_path, md_path


def main(argv):
  del argv
  from absl import flags
  from ml_collections import config_flags

  experiment.keep_cpu_memory()  # before anything starts a JAX backend
  experiment.quiet_libraries(flags.FLAGS)
  experiment.use_compilation_cache()
  f = flags.FLAGS
  cfg = f.config
  if cfg is None:
    raise UserError(
      "no config: give --config=CONFIG_FILE (configs/NAME.py[:ARG]), or --workdir=RUN to "
      "evaluate a training run with the config it saved (RUN/config.json)"
    )
  workdir = f.workdir or experiment.default_workdir(config_flags.get_config_filename(f["config"]))
  which = f.checkpoint or default_checkpoint(cfg, workdir, workdir_given=bool(f.workdir))
  report = evaluate_checkpoint(cfg, workdir, which=which)
  if jax.process_index() != 0:
    return
  out = f.out or os.path.join(report["source"]["run"], "eval", report["label"])
  json_path, md_path = write_report(report, out)
  print(report["markdown"], end="")
  print(f"report: {json_path} and {md_path}", flush=True)


if __name__ == "__main__":
  from absl import flags
  from ml_collections import config_flags

  sharding.maybe_initialize_distributed()  # multi-host: before the config file runs any jax code
  try:
    saved = run_config(sys.argv)
  except UserError as e:
    cli.fail(str(e), e, verbose=cli.verbose_requested(sys.argv))
  if saved is None:
    config_flags.DEFINE_config_file(
      "config", None, "Config file (default: the config.json of --workdir).", lock_config=True
    )
  else:  # --config.* overrides apply to the run's config, parsed here, as the flag is defined
    try:
      config_flags.DEFINE_config_dict(
        "config", saved, "The run's config (--workdir's config.json).", lock_config=True
      )
    except Exception as e:  # noqa: BLE001 - a bad override: one line, as cli.run reports it
      cli.fail(cli.flag_error_message(e, sys.argv), e, verbose=cli.verbose_requested(sys.argv))
  flags.DEFINE_string("workdir", None, "Run folder holding checkpoints/ (and config.json).")
  flags.DEFINE_string(
    "checkpoint",
    None,
    "'latest' (in --workdir), 'init' (model.path as it is / the initial policy), another run's "
    "workdir, or an HF folder. Default: latest, or init for a model.path config with no run.",
  )
  flags.DEFINE_string("out", None, "Report folder (default <run folder>/eval/<step>/).")
  cli.run(main)
