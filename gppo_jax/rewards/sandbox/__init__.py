"""Run untrusted (model-generated) programs in a sandbox and report what they did.

`host` is the trainer's side (jobs, slots, the isolated command line; its docstring describes the
isolation); `runner` is the standard-library-only program copied whole into each sandbox, which
runs the program's processes, and holds what both sides share (statuses, the value encoding, the
judges).
"""

from gppo_jax.rewards.sandbox.host import (
  CallCase,
  CaseResult,
  Job,
  RunResult,
  Sandbox,
  SandboxConfig,
  SandboxUnavailableError,
  StdioCase,
  find_sandbox_python,
)
from gppo_jax.rewards.sandbox.runner import (
  Status,
  call_result_matches,
  decode_value,
  encode_value,
  outputs_match,
  values_match,
)

__all__ = [
  "CallCase",
  "CaseResult",
  "Job",
  "RunResult",
  "Sandbox",
  "SandboxConfig",
  "SandboxUnavailableError",
  "Status",
  "StdioCase",
  "call_result_matches",
  "decode_value",
  "encode_value",
  "find_sandbox_python",
  "outputs_match",
  "values_match",
]
