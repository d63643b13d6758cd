"""Verifiable rewards (plain Python and subprocesses; no JAX).

- `math_reward`: answer extraction and math-verify in killable worker processes.
- `code_reward`: code scoring through the sandbox.
- `sandbox/`: `host.py` starts isolated runs; `runner.py` is the in-sandbox program.
- `pass_at_k`: unbiased pass@k and avg@k estimators and the evaluation report.
"""
