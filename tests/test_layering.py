"""The package's import graph: every import points down the documented layers, and no cycles.

Read from the source (every `import` statement, including those inside functions), so a lazy
import cannot hide an upward dependency. The layers are the README's "Layout" section.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "gppo_jax")

LAYERS = [
  ("errors", {"errors", "registry"}),
  (
    "math",
    {"divergences", "estimators", "objective", "theory", "advantages", "presets", "sweep_stats"},
  ),
  (
    "model",
    {
      "architectures",
      "attention",
      "low_precision",
      "model",
      "partitioning",
      "sharding",
      "sampler",
      "tokenizer",
      "hf_checkpoint",
    },
  ),
  (
    "rewards and data",
    {"tasks", "math_reward", "sandbox", "code_reward", "data", "pass_at_k"},
  ),
  (
    "shell",
    {
      "envs",
      "train_step",
      "policy_eval",
      "rollout",
      "warmstart",
      "checkpointing",
      "metric_writers",
      "interrupts",
      "config_lib",
      "experiment",
      "cli",
      "diagnostics",
    },
  ),
  ("entry points", {"train", "evaluate", "plan", "prepare_data", "sweep", "sweep_report"}),
]


def modules() -> dict[str, set[str]]:
  """{module: the package modules it imports}; a subpackage counts as its top-level name."""
  graph = {}
  for root, _, files in os.walk(PACKAGE):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(root, name)
      rel = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
      mod = rel[0] if rel[-1] != "__init__" or len(rel) > 1 else "__init__"
      deps = set()
      for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
          if node.module == "gppo_jax":
            deps |= {a.name for a in node.names}
          elif node.module.startswith("gppo_jax."):
            deps.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
          deps.add(mod)  # relative imports stay inside a subpackage
        elif isinstance(node, ast.Import):
          deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("gppo_jax.")}
      graph.setdefault(mod, set()).update(deps - {mod})
  graph.pop("__init__", None)
  return graph


def test_every_module_is_in_a_layer():
  placed = set().union(*(mods for _, mods in LAYERS))
  assert set(modules()) == placed, "add new modules to LAYERS (and the README's Layout)"


def test_imports_point_down_only():
  level = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
  upward = [
    f"{m} ({LAYERS[level[m]][0]}) imports {d} ({LAYERS[level[d]][0]})"
    for m, deps in modules().items()
    for d in deps
    if level[d] > level[m]
  ]
  assert not upward, upward


def test_no_import_cycles():
  graph = modules()
  state: dict[str, int] = {}
  cycles = []

  def visit(m, path):
    state[m] = 1
    for d in sorted(graph.get(m, ())):
      if state.get(d) == 1:
        cycles.append(path[path.index(d) :] + [d] if d in path else [m, d])
      elif d not in state:
        visit(d, path + [d])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not cycles, cycles


def test_the_math_imports_no_model_config_or_io():
  math = LAYERS[1][1]
  for m in math:
    source = open(os.path.join(PACKAGE, m + ".py")).read()
    for banned in ("flax", "orbax", "ml_collections", "open("):
      assert banned not in source, f"{m} uses {banned}"
