"""The package's import graph: every import points down the layers, and no cycles.

Read from the source (every `import` statement, including those inside functions), so a lazy
import cannot hide an upward dependency. The layers are the folders of docs/architecture.md:
a folder (or top-level module) imports only from its own layer or the layers listed before it.
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "gppo_jax")

LAYERS = [
  ("foundations", {"errors", "files", "registry", "cli"}),
  ("algorithm", {"algorithm"}),
  ("models", {"models"}),
  ("generation", {"generation"}),
  ("rewards", {"rewards"}),
  ("data", {"data"}),
  ("config", {"config_lib"}),
  ("trainer", {"trainer"}),
  ("research", {"research"}),
  ("entry points", {"train", "evaluate", "plan", "prepare_data", "sweep"}),
]


def _imports(path: str, module: str) -> set[str]:
  """The package modules (dotted, without `gppo_jax.`) that the file at `path` imports."""
  package = module.rsplit(".", 1)[0] if "." in module else ""
  deps = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.ImportFrom) and node.level > 0:
      base = package.split(".")[: len(package.split(".")) - node.level + 1]
      deps.add(".".join(p for p in [*base, node.module or ""] if p))
    elif isinstance(node, ast.ImportFrom) and node.module == "gppo_jax":
      deps |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gppo_jax."):
      sub = node.module[len("gppo_jax.") :]
      # `from gppo_jax.models import model` imports the module models.model
      for a in node.names:
        is_module = os.path.exists(os.path.join(PACKAGE, *sub.split("."), a.name + ".py"))
        deps.add(f"{sub}.{a.name}" if is_module else sub)
    elif isinstance(node, ast.Import):
      deps |= {a.name[len("gppo_jax.") :] for a in node.names if a.name.startswith("gppo_jax.")}
  return {d for d in deps if d and d != "__version__"}


def modules() -> dict[str, set[str]]:
  """{dotted module: the package modules it imports}, for every file of the package."""
  graph = {}
  for root, _, files in os.walk(PACKAGE):
    for name in sorted(files):
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, name), PACKAGE)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        if rel:
          module = ".".join(rel)
          graph[module] = _imports(os.path.join(root, name), module) - {module}
  return graph


def _layer(module: str) -> int:
  top = module.split(".")[0]
  for i, (_, members) in enumerate(LAYERS):
    if top in members:
      return i
  raise AssertionError(f"{module}: add gppo_jax/{top} to LAYERS (and docs/architecture.md)")


def test_every_module_is_in_a_layer():
  for m in modules():
    _layer(m)


def test_imports_point_down_only():
  upward = [
    f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
    for m, deps in modules().items()
    for d in deps
    if _layer(d) > _layer(m)
  ]
  assert not upward, upward


def test_no_import_cycles():
  graph = modules()
  state: dict[str, int] = {}
  cycles = []

  def visit(m, path):
    state[m] = 1
    for d in sorted(graph.get(m, ())):
      if d not in graph:
        continue
      if state.get(d) == 1:
        cycles.append(path[path.index(d) :] + [d] if d in path else [m, d])
      elif d not in state:
        visit(d, path + [d])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not cycles, cycles


def _sources(folder: str):
  for root, _, files in os.walk(os.path.join(PACKAGE, folder)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        yield os.path.relpath(path, PACKAGE), open(path).read()


def test_the_algorithm_imports_no_model_config_or_io():
  for name, source in _sources("algorithm"):
    for banned in ("flax", "orbax", "ml_collections", "open("):
      assert banned not in source, f"{name} uses {banned}"


def test_rewards_and_data_run_without_jax():
  # Reward workers and data preparation run in processes that never import JAX.
  for folder in ("rewards", "data"):
    for name, source in _sources(folder):
      tree = ast.parse(source)
      imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
      }
      imported |= {
        (n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
      }
      assert not imported & {"jax", "flax", "optax", "orbax"}, f"{name} imports JAX"


def test_the_graph_resolves_submodules():
  # The rules above would pass vacuously if the graph came back empty or folder-blind.
  graph = modules()
  assert "trainer.train_step" in graph and "algorithm.objective" in graph["trainer.train_step"]
  assert _layer("algorithm.objective") < _layer("trainer.train_step")


def _moves() -> list[tuple[str, str]]:
  """(old module, new module) for each name in docs/architecture.md's "Module moves" table."""
  text = open(os.path.join(REPO, "docs", "architecture.md")).read()
  table = text.split("## Module moves", 1)[1].split("\n## ", 1)[0]
  moves = []
  for line in table.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 2 or not cells[0].startswith("`gppo_jax."):
      continue
    old = [n.strip(" `") for n in cells[0].split("(")[0].split(",")]
    new = cells[1].strip("`")
    prefix = old[0].rsplit(".", 1)[0]
    names = [old[0]] + [f"{prefix}.{n}" for n in old[1:]]
    moves += [(o, new.replace("<same>", o.rsplit(".", 1)[1])) for o in names]
  return moves


def test_the_old_flat_module_names_are_gone():
  """No alias keeps a name from before the layer folders: each old name in the architecture's
  table fails to import, and its new name is a module."""
  import importlib
  import importlib.util

  import gppo_jax.data

  moves = _moves()
  assert ("gppo_jax.sampler", "gppo_jax.generation.sampler") in moves and len(moves) > 30, moves
  for old, new in moves:
    if "<name>" in old:  # the readers were the names of the package gppo_jax.data itself
      assert not hasattr(gppo_jax.data, "read_records") and "<name>" in new
      continue
    with pytest.raises(ModuleNotFoundError):
      importlib.import_module(old)
    assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no module {new}"
