"""The flat module names used before the package had layer folders, kept as aliases.

`from gppo_jax import sampler`, `import gppo_jax.sampler` and `python -m gppo_jax.theory` keep
working and warn with the new name. An alias is the module itself, not a second copy, so the
registries of divergences, estimators and presets stay single.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
  **{
    m: f"algorithm.{m}"
    for m in ("divergences", "estimators", "objective", "advantages", "theory", "presets")
  },
  **{
    m: f"models.{m}"
    for m in (
      "architectures",
      "attention",
      "low_precision",
      "model",
      "partitioning",
      "sharding",
      "hf_checkpoint",
      "tokenizer",
    )
  },
  "sampler": "generation.sampler",
  **{m: f"rewards.{m}" for m in ("math_reward", "code_reward", "pass_at_k", "sandbox")},
  "tasks": "data.tasks",
  "envs": "data.envs",
  **{
    m: f"trainer.{m}"
    for m in (
      "train_step",
      "rollout",
      "policy_eval",
      "warmstart",
      "checkpointing",
      "metric_writers",
      "interrupts",
      "experiment",
    )
  },
  "diagnostics": "research.diagnostics",
  "sweep_report": "research.report",
  "sweep_stats": "research.stats",
}


class _AliasLoader(importlib.abc.Loader):
  """Loads an old name as the new module; `get_code` lets `python -m OLD` run the new one."""

  def __init__(self, target: str):
    self.target = target

  def create_module(self, spec):
    return importlib.import_module(self.target)

  def exec_module(self, module):
    pass

  def get_code(self, fullname):
    return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path=None, target=None):
    head, _, name = fullname.partition(".")
    if head != "gppo_jax" or name not in MOVED:
      return None
    new = "gppo_jax." + MOVED[name]
    warnings.warn(f"{fullname} moved to {new}; import it from there", DeprecationWarning, 2)
    return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
  if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.append(_AliasFinder())
