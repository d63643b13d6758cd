"""Draws docs/grid.png, the README's figure of the grid: final held-out accuracy per cell.

python docs/make_grid_figure.py [--out docs/grid.png]

The numbers are not computed here: they are the tables of docs/verdict.md, copied by hand.
Left, "The grid at the default setting (8 seeds, final held-out accuracy, %)"; right, "The
harder setting: rollouts two iterations stale" (its "final [95% CI]" column). Each is the mean
over 8 paired seeds of the held-out greedy accuracy after 400 iterations of the default run
(`python -m gppo_jax.sweep`, the built-in addsub3 task, the 0.1M-parameter policy), with its 95%
bootstrap interval over the seeds. Rerun this script after changing a table there.
"""

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (divergence, estimator) -> (mean, low, high), in percent; docs/verdict.md.
DEFAULT = {
  ("TV", "MC"): (64.6, 53.4, 75.6),
  ("TV", "Binary"): (62.7, 51.6, 73.8),
  ("TV", "Atomic"): (61.2, 46.8, 76.5),
  ("KL", "MC"): (64.4, 52.2, 77.6),
  ("KL", "Binary"): (65.4, 53.3, 78.3),
  ("KL", "Atomic"): (66.1, 53.8, 78.8),
  ("Hellinger", "MC"): (66.0, 55.0, 77.7),
  ("Hellinger", "Binary"): (63.8, 50.3, 77.7),
  ("Hellinger", "Atomic"): (64.5, 51.2, 77.1),
  ("chi^2", "MC"): (63.9, 53.1, 74.9),
  ("chi^2", "Binary"): (62.3, 50.3, 75.0),
  ("chi^2", "Atomic"): (61.2, 48.0, 75.7),
  ("none", ""): (56.3, 41.5, 72.2),
}
STALE = {  # rollout.staleness=2; only TV, KL and none were run
  ("TV", "MC"): (51.7, 39.0, 65.5),
  ("TV", "Binary"): (49.7, 38.0, 62.7),
  ("TV", "Atomic"): (45.5, 31.2, 60.9),
  ("KL", "MC"): (53.1, 40.7, 67.4),
  ("KL", "Binary"): (54.6, 43.7, 67.1),
  ("KL", "Atomic"): (48.4, 38.5, 59.3),
  ("none", ""): (26.8, 19.9, 36.3),
}
DIVERGENCES = ("TV", "KL", "Hellinger", "chi^2", "none")
ESTIMATORS = {"MC": "tab:blue", "Binary": "tab:orange", "Atomic": "tab:green", "": "tab:red"}
LABELS = {"chi^2": r"$\chi^2$", "none": "none\n(no trust\nregion)"}


def panel(ax, table, title):
  """One dot with its interval per cell, grouped by divergence, coloured by estimator."""
  divs = [d for d in DIVERGENCES if any(k[0] == d for k in table)]
  offsets = {"MC": -0.27, "Binary": 0.0, "Atomic": 0.27, "": 0.0}
  for i, d in enumerate(divs):
    for (div, est), (mean, low, high) in table.items():
      if div != d:
        continue
      x = i + offsets[est]
      ax.errorbar(
        x, mean, yerr=[[mean - low], [high - mean]], fmt="o", color=ESTIMATORS[est], capsize=3
      )
      ax.annotate(f"{mean:.1f}", (x, high), textcoords="offset points", xytext=(0, 3),
                  ha="center", fontsize=7)  # fmt: skip
  reference = table[("TV", "MC")][0]
  ax.axhline(reference, color="gray", lw=0.8, ls="--")
  ax.set_xticks(range(len(divs)), [LABELS.get(d, d) for d in divs])
  ax.set_xlim(-0.6, len(divs) - 0.4)
  ax.set_ylim(15, 85)
  ax.set_title(title, fontsize=10)
  ax.grid(axis="y", alpha=0.3)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "grid.png"))
  out = parser.parse_args().out
  fig, (left, right) = plt.subplots(
    1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [5, 3]}, sharey=True
  )
  panel(left, DEFAULT, "the default run (8 seeds)")
  panel(right, STALE, "rollouts two iterations stale (8 seeds)")
  left.set_ylabel("held-out greedy accuracy after 400 iterations, %")
  handles = [
    plt.Line2D([], [], marker="o", ls="", color=c, label=e or "none") for e, c in ESTIMATORS.items()
  ]
  handles.append(plt.Line2D([], [], color="gray", ls="--", label="TV-MC (PPO's clip)"))
  left.legend(handles=handles, loc="lower left", ncol=3, fontsize=8)
  fig.suptitle(
    "GPPO grid on addsub3 (0.1M-parameter policy): mean over seeds, 95% bootstrap interval",
    fontsize=11,
  )
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  print(out)


if __name__ == "__main__":
  main()
