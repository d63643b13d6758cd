#!/usr/bin/env bash
# Train gppo_jax on this GPU host (1..8 GPUs), or on one host of a multi-host GPU cluster.
#
#   launch/gpu_host.sh setup|run [options] [-- extra train flags]
#
# Run from the repository root on the GPU machine itself (see launch/README.md).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/gpu_host.sh COMMAND [options] [-- extra flags for gppo_jax.train]

commands
  setup    create .venv (python3.11) and install requirements.txt, jax[cuda12] and this package
  run      python -m gppo_jax.train --config=CONFIG --workdir=WORKDIR, logging to WORKDIR.log

options (or the environment variable in brackets)
  --config CONFIG          e.g. configs/qwen25_math_7b.py:gpu8 [GPPO_CONFIG]        (run)
  --workdir DIR            run folder [GPPO_WORKDIR] (default: workdirs/<config name>)
  --gpus LIST              GPUs to use, e.g. 0,1,2,3 [CUDA_VISIBLE_DEVICES] (default: all)
  --python PYTHON          interpreter for setup [PYTHON] (default: python3.11)
multi-host (every host runs the same command with its own --process_id):
  --coordinator HOST:PORT  address of process 0 [JAX_COORDINATOR_ADDRESS]
  --num_processes N        number of hosts [JAX_NUM_PROCESSES]
  --process_id I           this host's index, 0..N-1 [JAX_PROCESS_ID]
  -h, --help               this message

examples
  launch/gpu_host.sh setup
  launch/gpu_host.sh run --config configs/qwen25_math_7b.py:gpu8 --workdir /data/runs/qwen25
  # two hosts (shared /data), on host 0 and host 1 respectively:
  launch/gpu_host.sh run --config configs/qwen3_8b.py:gpu8 --workdir /data/runs/q3 \
      --coordinator 10.0.0.1:1234 --num_processes 2 --process_id 0 -- --config.mesh.fsdp=16
  launch/gpu_host.sh run --config configs/qwen3_8b.py:gpu8 --workdir /data/runs/q3 \
      --coordinator 10.0.0.1:1234 --num_processes 2 --process_id 1 -- --config.mesh.fsdp=16
EOF
}

die() {
  echo "error: $*" >&2
  echo "run 'launch/gpu_host.sh --help' for usage" >&2
  exit 2
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
COMMAND="$1"
shift
case "$COMMAND" in
  -h | --help) usage; exit 0 ;;
  setup | run) ;;
  *) die "unknown command '$COMMAND' (valid: setup run)" ;;
esac

CONFIG="${GPPO_CONFIG:-}"
WORKDIR="${GPPO_WORKDIR:-}"
GPUS="${CUDA_VISIBLE_DEVICES:-}"
PYTHON="${PYTHON:-python3.11}"
COORDINATOR="${JAX_COORDINATOR_ADDRESS:-}"
NUM_PROCESSES="${JAX_NUM_PROCESSES:-}"
PROCESS_ID="${JAX_PROCESS_ID:-}"
EXTRA=()

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "option $1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --workdir) need_value "$@"; WORKDIR="$2"; shift 2 ;;
    --gpus) need_value "$@"; GPUS="$2"; shift 2 ;;
    --python) need_value "$@"; PYTHON="$2"; shift 2 ;;
    --coordinator) need_value "$@"; COORDINATOR="$2"; shift 2 ;;
    --num_processes) need_value "$@"; NUM_PROCESSES="$2"; shift 2 ;;
    --process_id) need_value "$@"; PROCESS_ID="$2"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option '$1'" ;;
  esac
done

[[ -f gppo_jax/train.py ]] || die "run from the gppo_jax repository root"

cmd_setup() {
  command -v "$PYTHON" >/dev/null || die "$PYTHON not found (install it or pass --python)"
  command -v nvidia-smi >/dev/null || echo "warning: nvidia-smi not found; is the driver installed?" >&2
  "$PYTHON" -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
  pip install -q --upgrade pip
  pip install -q -r requirements.txt
  pip install -q -U 'jax[cuda12]'
  pip install -q -e .
  python -c 'import jax; print(jax.device_count(), "devices:", jax.devices()[0].device_kind)'
}

cmd_run() {
  [[ -n "$CONFIG" ]] || die "--config (or GPPO_CONFIG) is required to run"
  [[ -f .venv/bin/activate ]] || die "no .venv here: run 'launch/gpu_host.sh setup' first"
  local multi=0
  if [[ -n "$COORDINATOR$NUM_PROCESSES$PROCESS_ID" ]]; then
    [[ -n "$COORDINATOR" && -n "$NUM_PROCESSES" && -n "$PROCESS_ID" ]] ||
      die "multi-host needs all of --coordinator, --num_processes and --process_id"
    [[ "$PROCESS_ID" =~ ^[0-9]+$ && "$NUM_PROCESSES" =~ ^[0-9]+$ ]] ||
      die "--process_id and --num_processes must be integers"
    ((PROCESS_ID < NUM_PROCESSES)) || die "--process_id must be below --num_processes"
    multi=1
    export JAX_COORDINATOR_ADDRESS="$COORDINATOR" JAX_NUM_PROCESSES="$NUM_PROCESSES"
    export JAX_PROCESS_ID="$PROCESS_ID"
  fi
  if [[ -n "$GPUS" ]]; then export CUDA_VISIBLE_DEVICES="$GPUS"; fi
  local name
  name="$(basename "${CONFIG%%:*}" .py)"
  local workdir="${WORKDIR:-workdirs/$name}"
  mkdir -p "$(dirname "$workdir")"
  # shellcheck disable=SC1091
  . .venv/bin/activate
  # Let XLA preallocate most of each GPU (JAX defaults to 75%).
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
  export GPPO_DISTRIBUTED="$multi"
  local log="${workdir%/}.process${PROCESS_ID:-0}.log"
  echo "running $CONFIG -> $workdir (GPPO_DISTRIBUTED=$multi, log $log)"
  python -m gppo_jax.train --config="$CONFIG" --workdir="$workdir" "${EXTRA[@]}" 2>&1 | tee "$log"
}

case "$COMMAND" in
  setup) cmd_setup ;;
  run) cmd_run ;;
esac
