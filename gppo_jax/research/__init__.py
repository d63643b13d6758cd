"""Research tools: the sweep's report and statistics, and estimator diagnostics.

- `report`: a sweep's runs.csv, results.md with paired statistics, and plots.
- `stats`: learning-curve area, bootstrap intervals over seeds, relative gains (numpy only).
- `diagnostics`: every estimator against the exact divergence on a rollout batch.
"""
