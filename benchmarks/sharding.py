"""Per-device memory of the compiled, FSDP-sharded GPPO update on 1, 2, 4 and 8 devices.

Compiles (never runs) the trainer's update (`train_step.make_update_fn` through
`sharding.jit_update`) for abstract inputs on meshes data=1 x fsdp=N x tensor=1 of simulated CPU
devices and reads XLA's `memory_analysis()`: argument bytes (parameters + Adam state + batch, what
FSDP should cut to ~1/N), temporaries (activations, gathered weights, gradients), and the
temporaries a doubled batch adds (the activations alone, which the data x fsdp batch split should
also cut to ~1/N). Also the exact per-device bytes of parameters + optimizer state from the
shardings. Ratios are against N = 1 in the same run.

  python benchmarks/sharding.py [--hidden 512 --layers 4 --vocab 8192 --devices 1,2,4,8]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from gppo_jax import config_lib, plan
from gppo_jax.models import architectures, sharding
from gppo_jax.trainer import train_step


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--hidden", type=int, default=512)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--sequences", type=int, default=32)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--resp_len", type=int, default=32)
  ap.add_argument("--devices", default="1,2,4,8")
  ap.add_argument(
    "--no_activations", action="store_true", help="skip the second compile per N (batch growth)"
  )
  a = ap.parse_args()

  d = a.hidden
  cfg = architectures.ModelConfig(
    vocab_size=a.vocab, hidden_size=d, intermediate_size=3 * d, num_layers=a.layers,
    num_heads=d // 64, num_kv_heads=max(1, d // 128), head_dim=64,
  )  # fmt: skip
  config = config_lib.base()
  config.rollout.prompts_per_iter = a.sequences // 8
  config.rollout.group_size = 8
  config.train.minibatches = 2
  update_fn, state, spec = plan.update_setup(config, cfg, a.prompt_len, a.resp_len)
  batch = train_step.abstract_batch(a.sequences, a.prompt_len, a.resp_len, spec, 0)
  bigger = train_step.abstract_batch(2 * a.sequences, a.prompt_len, a.resp_len, spec, 0)
  n_params = sum(x.size for x in jax.tree.leaves(state.params))

  rows = []
  for n in (int(x) for x in a.devices.split(",")):
    mesh = sharding.make_mesh({"data": 1, "fsdp": n, "tensor": 1}, jax.devices()[:n])
    sh = sharding.state_shardings(state, mesh)
    resident = plan.per_device_bytes(state.params, sh.params)
    resident += plan.per_device_bytes(state.opt_state, sh.opt_state)
    t0 = time.time()
    stats = plan.compiled_update_memory(update_fn, state, batch, mesh)
    row = dict(
      devices=n,
      state_bytes=resident,
      argument_bytes=int(stats.argument_size_in_bytes),
      temp_bytes=int(stats.temp_size_in_bytes),
    )
    if not a.no_activations:
      # Temporaries added by doubling the batch: the activation part, which the batch split
      # (data x fsdp) should also cut to ~1/N.
      more = plan.compiled_update_memory(update_fn, state, bigger, mesh)
      row["activation_bytes"] = int(more.temp_size_in_bytes) - row["temp_bytes"]
    row["compile_s"] = round(time.time() - t0, 1)
    rows.append(row)

  base = rows[0]
  print(
    f"model: {n_params / 1e6:.1f}M params (hidden {d}, {a.layers} layers, vocab {a.vocab}); "
    f"rollout {a.sequences} x ({a.prompt_len} + {a.resp_len}); mesh data=1 x fsdp=N"
  )
  keys = ["state", "argument", "temp"] + ([] if a.no_activations else ["activation"])
  print(f"{'N':>3} " + " ".join(f"{k + ' MiB':>15} {'x N':>5}" for k in keys) + f" {'ideal':>6}")
  mib = 1024**2
  for r in rows:
    n = r["devices"]
    cells = []
    for key in keys:
      r[f"{key}_ratio"] = r[f"{key}_bytes"] / max(1, base[f"{key}_bytes"])
      cells.append(f"{r[f'{key}_bytes'] / mib:>15.2f} {r[f'{key}_ratio'] * n:>5.2f}")
    print(f"{n:>3} " + " ".join(cells) + f" {1 / n:>6.3f}")
  print("(x N = per-device bytes / N=1 bytes, times N: 1.00 is a perfect 1/N split)")
  print(json.dumps({"benchmark": "sharding", "params": n_params, "rows": rows}))


if __name__ == "__main__":
  main()
