"""The GPPO grid on the embedded default task: held-out accuracy per cell, from one starting policy.

Runs `python -m gppo_jax.train` once per (cell, seed) in subprocesses (`--jobs` at a time), every
run starting from the same cached warm start (`warmstart.seed` fixed, the RL seed varied), then
prints a table: greedy held-out accuracy before and after (and its best along the run), avg@k, the
share of tokens the trust region masked in the later mini-batches, and wall time. Beside the 12
cells it runs `none`: the same objective with an infinite radius (importance-weighted policy
gradient, no trust region) as the baseline a trust region has to beat.

  python benchmarks/grid.py                                   # 12 cells + none, seed 0
  python benchmarks/grid.py --cells kl_atomic,tv_mc,none --seeds 0,1,2 --jobs 2 \
      --set optim.lr=3e-4 --set iterations=200

Every run's workdir (metrics.jsonl, summary.json, TensorBoard) stays under --out; results.json holds
the table's numbers. The first run alone warms the cache; the rest reuse it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLS = [f"{d}_{e}" for d in ("tv", "kl", "hellinger", "chi2") for e in ("mc", "binary", "atomic")]
NO_TRUST_REGION = "none"  # tv_mc with an infinite radius: nothing is ever masked


def command(cell: str, seed: int, workdir: str, overrides: list[str]) -> list[str]:
  config = "tv_mc" if cell == NO_TRUST_REGION else cell
  cmd = [
    sys.executable,
    "-m",
    "gppo_jax.train",
    f"--config={os.path.join(REPO, 'configs', config + '.py')}",
    f"--workdir={workdir}",
    f"--config.seed={seed}",
    "--config.warmstart.seed=0",
  ]
  if cell == NO_TRUST_REGION:
    cmd += ["--config.loss.delta_low=1e30", "--config.loss.delta_high=1e30"]
  return cmd + [f"--config.{o}" for o in overrides]


def run_one(cell: str, seed: int, out: str, overrides: list[str], reuse: bool = False) -> dict:
  workdir = os.path.join(out, f"{cell}_s{seed}")
  done = os.path.join(workdir, "summary.json")
  if reuse and os.path.exists(done):
    row = {"cell": cell, "seed": seed, "returncode": 0, "reused": True}
    row["seconds"] = json.load(open(done)).get("seconds", float("nan"))
  else:
    t0 = time.time()
    with open(workdir + ".log", "w") as log:
      proc = subprocess.run(
        command(cell, seed, workdir, overrides), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
      )
    row = {"cell": cell, "seed": seed, "seconds": time.time() - t0, "returncode": proc.returncode}
    if proc.returncode:
      row["error"] = f"exit {proc.returncode}; see {workdir}.log"
      return row
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  lines = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [x["eval/accuracy"] for x in lines if "eval/accuracy" in x]
  late = [x["trust/masked_frac_late"] for x in lines if "trust/masked_frac_late" in x]
  tail = late[len(late) // 2 :]
  final = summary["final_eval"]
  row.update(
    before=summary["initial_eval"]["eval/accuracy"],
    after=final["eval/accuracy"],
    best=max(evals),
    # Mean held-out accuracy over the evals after the first: the area under the learning curve,
    # steadier across seeds than the last point alone.
    mean_curve=sum(evals[1:]) / max(len(evals) - 1, 1),
    curve=evals,
    curve_steps=[x["step"] for x in lines if "eval/accuracy" in x],
    masked_late=sum(tail) / max(len(tail), 1),
    levels={
      k.split("/")[1]: v
      for k, v in final.items()
      if k.endswith("/accuracy") and k != "eval/accuracy"
    },
    avg_at_k={k: v for k, v in final.items() if k.startswith("eval/avg@")},
  )
  return row


def _mean_sd(v: list[float]) -> str:
  m = sum(v) / len(v)
  sd = (sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0
  return f"{100 * m:.1f} ± {100 * sd:.1f}"


def table(rows: list[dict]) -> str:
  lines = [
    "| cell | seed | before | after | gain | best | curve mean | masked (late) | seconds |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['cell']} | {r['seed']} | {r['error']} ||||||")
      continue
    lines.append(
      f"| {r['cell']} | {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | "
      f"{100 * (r['after'] - r['before']):+.1f} | {r['best']:.3f} | {r['mean_curve']:.3f} | "
      f"{100 * r['masked_late']:.2f}% | {r['seconds']:.0f} |"
    )
  by_cell: dict[str, list[dict]] = {}
  for r in rows:
    if "error" not in r:
      by_cell.setdefault(r["cell"], []).append(r)
  if any(len(v) > 1 for v in by_cell.values()):
    lines += [
      "",
      "| cell | after (mean ± sd, %) | min | max | curve mean (mean ± sd, %) | seeds |",
      "|---|---|---|---|---|---|",
    ]
    for cell, rs in by_cell.items():
      after = [r["after"] for r in rs]
      lines.append(
        f"| {cell} | {_mean_sd(after)} | {100 * min(after):.1f} | {100 * max(after):.1f} | "
        f"{_mean_sd([r['mean_curve'] for r in rs])} | {len(rs)} |"
      )
    lines += _curve_table(by_cell)
  return "\n".join(lines)


def _curve_table(by_cell: dict[str, list[dict]]) -> list[str]:
  """Held-out accuracy at each eval, averaged over seeds: where the cells part ways."""
  n = min(len(r.get("curve", [])) for rs in by_cell.values() for r in rs)
  if n < 2:
    return []
  steps = next(r for rs in by_cell.values() for r in rs).get("curve_steps", list(range(n)))
  lines = ["", "| iteration | " + " | ".join(str(x) for x in steps[:n]) + " |"]
  lines.append("|---" * (n + 1) + "|")
  for cell, rs in by_cell.items():
    means = [sum(r["curve"][i] for r in rs) / len(rs) for i in range(n)]
    lines.append(f"| {cell} | " + " | ".join(f"{100 * m:.1f}" for m in means) + " |")
  return lines


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--cells", default=",".join(CELLS + [NO_TRUST_REGION]))
  p.add_argument("--seeds", default="0")
  p.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses ~1.5 cores)")
  p.add_argument("--set", action="append", default=[], help="config override, e.g. optim.lr=3e-4")
  p.add_argument("--out", default=os.path.join(REPO, "workdirs", "grid"))
  p.add_argument(
    "--reuse", action="store_true", help="read runs whose summary.json exists instead of rerunning"
  )
  a = p.parse_args()
  cells = [c.strip() for c in a.cells.split(",") if c.strip()]
  unknown = [
    c
    for c in cells
    if c not in CELLS
    and c != NO_TRUST_REGION
    and not os.path.exists(os.path.join(REPO, "configs", c + ".py"))
  ]
  if unknown:
    p.error(f"unknown cells {unknown}: use configs/<name>.py names or {NO_TRUST_REGION!r}")
  seeds = [int(s) for s in a.seeds.split(",")]
  os.makedirs(a.out, exist_ok=True)
  jobs = [(c, s) for s in seeds for c in cells]
  print(f"{len(jobs)} runs, {a.jobs} at a time; overrides {a.set}; logs under {a.out}", flush=True)
  rows = [run_one(*jobs[0], a.out, a.set, a.reuse)]  # alone: it trains and caches the warm start
  print(table(rows[-1:]).splitlines()[-1], flush=True)
  with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
    futures = [pool.submit(run_one, c, s, a.out, a.set, a.reuse) for c, s in jobs[1:]]
    for f in concurrent.futures.as_completed(futures):
      rows.append(f.result())
      print(table(rows[-1:]).splitlines()[-1], flush=True)
  order = {j: i for i, j in enumerate(jobs)}
  rows.sort(key=lambda r: order[(r["cell"], r["seed"])])
  print("\n" + table(rows))
  with open(os.path.join(a.out, "results.json"), "w") as f:
    json.dump({"overrides": a.set, "rows": rows}, f, indent=2)
  print(json.dumps({"results": os.path.join(a.out, "results.json"), "runs": len(rows)}))


if __name__ == "__main__":
  main()
