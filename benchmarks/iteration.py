"""Where one RL iteration's wall time goes, for any training config.

  python benchmarks/iteration.py --config=configs/kl_atomic.py            # 30 iterations
  python benchmarks/iteration.py --config=configs/dapo.py --config.iterations=10 \
      --config.rollout.max_new_tokens=16

Trains the config for `config.iterations` (default here: 30) in a temporary workdir (the warm start
comes from its cache, as in a normal run) with evaluation only at the end, then reads the `time/*`
entries the trainer writes to metrics.jsonl for every iteration and prints, per phase, the median
seconds and its share of the iteration, without the first iteration (it compiles):

  sample    the sampler (prefill + decode), including rounds DAPO's refill adds
  reward    decoding the texts and scoring them (math-verify, the code sandbox)
  logprobs  the optional log-prob passes (rollout.recompute_logprobs, the KL reference)
  update    epochs x mini-batches of optimizer steps, one compiled call
  io        the previous iteration's metric row and checkpoint call
  eval      the periodic evaluation (only at the end here)
  other     the rest: batch assembly, host transfers, the finiteness check

With --against=COMMIT it compares instead: the same command line's config trained in a copy of
that commit's tree (`git archive`) and in this working tree, each in its own process and
workdir, alternating which goes first, and prints each pair's median iteration and the ratio
(old / new: above 1 is faster here). This machine's speed drifts between minutes, so only
interleaved pairs are comparable:

  python benchmarks/iteration.py --against=5449bea --pairs=3 --iterations=40
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

PHASES = ("sample", "reward", "logprobs", "update", "io")

config_flags.DEFINE_config_file("config", "configs/kl_atomic.py", "Training config file.")
flags.DEFINE_integer("iterations", 30, "Iterations to time (overrides config.iterations).")
flags.DEFINE_string("out", None, "Also write the figures as JSON to this file.")
flags.DEFINE_string(
  "against", None, "A commit of this repository: time the iteration there and here, interleaved."
)
flags.DEFINE_integer("pairs", 3, "With --against: how many (old, new) pairs of runs.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def split(rows: list[dict]) -> dict[str, float]:
  """Median seconds per phase over `rows` (metrics.jsonl rows of iterations 2..N)."""
  med = lambda key: float(np.median([r.get(key, 0.0) for r in rows]))
  out = {p: med(f"time/{p}_s") for p in PHASES}
  out["iteration"] = med("time/iteration_s")
  out["other"] = max(0.0, out["iteration"] - sum(out[p] for p in PHASES))
  return out


def timed_rows(metrics_path: str) -> list[dict]:
  """The metrics.jsonl rows of a run that carry `time/iteration_s` (one per iteration)."""
  with open(metrics_path) as f:
    rows = [r for r in map(json.loads, f) if "time/iteration_s" in r]
  if len(rows) < 2:
    raise SystemExit(
      f"{metrics_path}: {len(rows)} iterations with time/iteration_s; need at least 2 (the first "
      "one compiles; a commit older than that metric cannot be timed this way)"
    )
  return rows


def config_args(argv: list[str]) -> list[str]:
  """The --config flags of a command line as given (file, argument and overrides), with the config
  file's path made relative to the repository (so that it names the same file in either tree)."""
  out, i = [], 1
  while i < len(argv):
    arg = argv[i]
    value_next = i + 1 < len(argv) and not argv[i + 1].startswith("--")
    if arg.startswith("--config") and "=" not in arg and value_next:  # `--config.x 3`
      arg, i = f"{arg}={argv[i + 1]}", i + 1
    if arg.startswith("--config="):
      path, colon, rest = arg[len("--config=") :].partition(":")
      path = os.path.abspath(path)  # the runs start in the trees, not in this folder
      if path.startswith(REPO + os.sep):
        path = os.path.relpath(path, REPO)
      arg = f"--config={path}{colon}{rest}"
    if arg.startswith("--config"):
      out.append(arg)
    i += 1
  if not any(a.startswith("--config=") for a in out):
    out.insert(0, "--config=configs/kl_atomic.py")
  return out


def export_commit(commit: str, dest: str) -> str:
  """Writes the tree of `commit` (any ref git accepts) into dest; returns its full hash."""
  git = lambda *a: subprocess.run(["git", "-C", REPO, *a], capture_output=True)
  found = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
  if found.returncode:
    raise SystemExit(f"--against={commit}: not a commit of the git repository at {REPO}")
  sha = found.stdout.decode().strip()
  archive = git("archive", "--format=tar", sha)
  if archive.returncode:
    raise SystemExit(f"git archive {sha} failed: {archive.stderr.decode().strip()}")
  with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
    if hasattr(tarfile, "data_filter"):
      tar.extractall(dest, filter="data")
    else:  # Python without extraction filters (3.10 before 3.10.12): our own repository's files
      tar.extractall(dest)
  return sha


def timed_run(tree: str, args: list[str], iterations: int) -> float:
  """Trains `args` for `iterations` in tree's own package (a fresh process and workdir) and
  returns its median iteration in seconds."""
  with tempfile.TemporaryDirectory() as workdir:
    cmd = [sys.executable, "-m", "gppo_jax.train", *args]
    cmd += [f"--config.iterations={iterations}", f"--workdir={workdir}"]
    env = dict(os.environ, PYTHONPATH=tree)  # that tree's gppo_jax, whatever is installed
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode:
      raise SystemExit(f"{' '.join(cmd)} failed in {tree}:\n{p.stderr[-3000:]}")
    return split(timed_rows(os.path.join(workdir, "metrics.jsonl"))[1:])["iteration"]


def compare(commit: str, pairs: int, iterations: int, out: str | None) -> None:
  args = config_args(sys.argv)
  with tempfile.TemporaryDirectory() as old_tree:
    sha = export_commit(commit, old_tree)
    if not os.path.isfile(os.path.join(old_tree, args[0][len("--config=") :].partition(":")[0])):
      raise SystemExit(f"{args[0]}: no such config file in commit {sha[:12]}")
    print(f"iteration of {' '.join(args)}: commit {sha[:12]} vs this tree, {iterations} each")
    print(f"{'pair':<6}{'old s':>9}{'new s':>9}{'old/new':>9}")
    rows = []
    for i in range(pairs):
      order = ("old", "new") if i % 2 == 0 else ("new", "old")
      t = {k: timed_run(old_tree if k == "old" else REPO, args, iterations) for k in order}
      rows.append({"old_s": t["old"], "new_s": t["new"], "ratio": t["old"] / t["new"]})
      print(f"{i + 1:<6}{t['old']:>9.4f}{t['new']:>9.4f}{rows[-1]['ratio']:>8.2f}x", flush=True)
  ratio = float(np.median([r["ratio"] for r in rows]))
  print(f"median ratio over {pairs} pairs: {ratio:.2f}x (above 1: this tree is faster)")
  if out:
    with open(out, "w") as f:
      json.dump({"against": sha, "args": args, "pairs": rows, "median_ratio": ratio}, f, indent=2)


def main(argv) -> None:
  del argv
  if flags.FLAGS.against:
    if flags.FLAGS.iterations < 2 or flags.FLAGS.pairs < 1:
      raise SystemExit("--against needs --iterations >= 2 and --pairs >= 1")
    return compare(flags.FLAGS.against, flags.FLAGS.pairs, flags.FLAGS.iterations, flags.FLAGS.out)
  from gppo_jax import train
  from gppo_jax.trainer import experiment

  experiment.keep_cpu_memory()  # as `python -m gppo_jax.train` runs
  experiment.quiet_libraries(flags.FLAGS)
  config = flags.FLAGS.config
  config.iterations = flags.FLAGS.iterations
  config.eval.every = config.iterations  # one evaluation, at the end
  config.checkpoint.every = config.iterations
  with tempfile.TemporaryDirectory() as workdir:
    summary = train.train_and_evaluate(config, workdir)
    rows = timed_rows(os.path.join(workdir, "metrics.jsonl"))
  eval_s = [r["time/eval_s"] for r in rows if "time/eval_s" in r]
  first = rows[0]["time/iteration_s"]
  figures = split(rows[1:])
  total = figures["iteration"]
  print(
    f"\n{config.loss.divergence}-{config.loss.estimator}, {len(rows)} iterations, "
    f"{config.rollout.prompts_per_iter} x {config.rollout.group_size} rollouts, "
    f"{config.train.epochs} x {config.train.minibatches} optimizer steps per iteration"
  )
  print(f"{'phase':<10}{'median s':>10}{'share':>8}")
  for phase in (*PHASES, "other"):
    print(f"{phase:<10}{figures[phase]:>10.4f}{figures[phase] / total:>8.1%}")
  print(f"{'iteration':<10}{total:>10.4f}{1:>8.0%}")
  print(
    f"first iteration (compiles): {first:.2f} s; evaluation: {eval_s[-1] if eval_s else 0:.2f} s"
  )
  print(f"whole run: {summary['seconds']:.1f} s")
  if flags.FLAGS.out:
    with open(flags.FLAGS.out, "w") as f:
      json.dump({"median_s": figures, "first_s": first, "eval_s": eval_s}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
