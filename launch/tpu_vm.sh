#!/usr/bin/env bash
# Train gppo_jax on a Cloud TPU VM slice (v5e / v5p / v6e, single- or multi-host).
#
#   launch/tpu_vm.sh create|setup|run|fetch|delete|all [options] [-- extra train flags]
#
# Run from the repository root on a machine with an authenticated gcloud (see launch/README.md).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/tpu_vm.sh COMMAND [options] [-- extra flags for gppo_jax.train]

commands
  create   create the TPU VM (or a queued resource with --queued) and wait until it is ready
  setup    copy this repository (git HEAD) to every worker, install python3.11, a venv and jax[tpu]
  run      run `python -m gppo_jax.train --config=CONFIG --workdir=WORKDIR` on every worker at once
           (GPPO_DISTRIBUTED=1 when the slice has more than one host); logs to ~/gppo_logs/
  fetch    copy every worker's logs (and a local workdir of worker 0) to LOGS_DIR/NAME/
  delete   delete the TPU VM (or the queued resource)
  all      create, setup, run, fetch, delete (delete also runs if run fails)

options (or the environment variable in brackets)
  --name NAME            TPU name [TPU_NAME]                                     (required)
  --zone ZONE            zone, e.g. us-east5-a [TPU_ZONE]                        (required)
  --accelerator TYPE     v5p-64, v5litepod-16, v6e-8, ... [TPU_ACCELERATOR]      (create)
  --version VERSION      runtime version [TPU_VERSION]; default from the type:
                         v5p -> v2-alpha-tpuv5, v5e -> v2-alpha-tpuv5-lite, v6e -> v2-alpha-tpuv6e
  --project PROJECT      gcloud project [TPU_PROJECT] (default: gcloud's configured project)
  --queued               use a queued resource (waits for capacity) [TPU_QUEUED=1]
  --spot                 spot capacity [TPU_SPOT=1]
  --config CONFIG        e.g. configs/qwen25_math_7b.py:v5p64 [GPPO_CONFIG]      (run)
  --workdir DIR          run folder; multi-host slices need shared storage, e.g.
                         gs://BUCKET/runs/NAME [GPPO_WORKDIR] (default: workdirs/NAME on each worker)
  --remote_dir DIR       checkout folder on the workers [GPPO_REMOTE_DIR] (default: gppo_jax)
  --logs_dir DIR         where fetch puts logs [GPPO_LOGS_DIR] (default: tpu_logs)
  -h, --help             this message

example
  launch/tpu_vm.sh all --name gppo-v5p --zone us-east5-a --accelerator v5p-64 --queued \
      --config configs/qwen25_math_7b.py:v5p64 --workdir gs://my-bucket/runs/qwen25-kl-atomic
EOF
}

die() {
  echo "error: $*" >&2
  echo "run 'launch/tpu_vm.sh --help' for usage" >&2
  exit 2
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
COMMAND="$1"
shift
case "$COMMAND" in
  -h | --help) usage; exit 0 ;;
  create | setup | run | fetch | delete | all) ;;
  *) die "unknown command '$COMMAND' (valid: create setup run fetch delete all)" ;;
esac

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
ACCELERATOR="${TPU_ACCELERATOR:-}"
VERSION="${TPU_VERSION:-}"
PROJECT="${TPU_PROJECT:-}"
QUEUED="${TPU_QUEUED:-0}"
SPOT="${TPU_SPOT:-0}"
CONFIG="${GPPO_CONFIG:-}"
WORKDIR="${GPPO_WORKDIR:-}"
REMOTE_DIR="${GPPO_REMOTE_DIR:-gppo_jax}"
LOGS_DIR="${GPPO_LOGS_DIR:-tpu_logs}"
EXTRA=()

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "option $1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$@"; NAME="$2"; shift 2 ;;
    --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --accelerator) need_value "$@"; ACCELERATOR="$2"; shift 2 ;;
    --version) need_value "$@"; VERSION="$2"; shift 2 ;;
    --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --spot) SPOT=1; shift ;;
    --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --workdir) need_value "$@"; WORKDIR="$2"; shift 2 ;;
    --remote_dir) need_value "$@"; REMOTE_DIR="$2"; shift 2 ;;
    --logs_dir) need_value "$@"; LOGS_DIR="$2"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option '$1'" ;;
  esac
done

[[ -n "$NAME" ]] || die "--name (or TPU_NAME) is required"
[[ -n "$ZONE" ]] || die "--zone (or TPU_ZONE) is required"
command -v gcloud >/dev/null || die "gcloud is not installed (https://cloud.google.com/sdk/docs/install)"

GCLOUD_FLAGS=(--zone="$ZONE")
if [[ -n "$PROJECT" ]]; then GCLOUD_FLAGS+=(--project="$PROJECT"); fi
QR_ID="${NAME}-qr"

default_version() {
  case "$1" in
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    v4-* | v3-* | v2-*) echo tpu-ubuntu2204-base ;;
    *) die "no default runtime version for accelerator '$1'; pass --version" ;;
  esac
}

tpu_ssh() {  # tpu_ssh WORKER COMMAND
  gcloud compute tpus tpu-vm ssh "$NAME" "${GCLOUD_FLAGS[@]}" --worker="$1" --command="$2"
}

num_workers() {
  gcloud compute tpus tpu-vm describe "$NAME" "${GCLOUD_FLAGS[@]}" \
    --format='value(networkEndpoints.len())'
}

cmd_create() {
  [[ -n "$ACCELERATOR" ]] || die "--accelerator (or TPU_ACCELERATOR) is required to create"
  local version="${VERSION:-$(default_version "$ACCELERATOR")}"
  local spot=()
  if [[ "$SPOT" == 1 ]]; then spot=(--spot); fi
  if [[ "$QUEUED" == 1 ]]; then
    echo "requesting queued resource $QR_ID ($ACCELERATOR, $version) in $ZONE"
    gcloud compute tpus queued-resources create "$QR_ID" "${GCLOUD_FLAGS[@]}" \
      --node-id="$NAME" --accelerator-type="$ACCELERATOR" --runtime-version="$version" "${spot[@]}"
    local state=""
    while [[ "$state" != "ACTIVE" ]]; do
      state="$(gcloud compute tpus queued-resources describe "$QR_ID" "${GCLOUD_FLAGS[@]}" \
        --format='value(state.state)')"
      case "$state" in
        FAILED | SUSPENDED) die "queued resource $QR_ID is $state" ;;
        ACTIVE) ;;
        *) echo "  $(date +%H:%M:%S) $QR_ID: ${state:-unknown}; waiting"; sleep 60 ;;
      esac
    done
  else
    echo "creating TPU VM $NAME ($ACCELERATOR, $version) in $ZONE"
    gcloud compute tpus tpu-vm create "$NAME" "${GCLOUD_FLAGS[@]}" \
      --accelerator-type="$ACCELERATOR" --version="$version" "${spot[@]}"
  fi
}

cmd_setup() {
  git rev-parse --show-toplevel >/dev/null 2>&1 || die "run from the gppo_jax git checkout"
  local tarball
  tarball="$(mktemp -d)/gppo_jax.tar.gz"
  git archive --format=tar.gz -o "$tarball" HEAD
  echo "copying $(git rev-parse --short HEAD) to every worker of $NAME"
  gcloud compute tpus tpu-vm scp "$tarball" "$NAME":gppo_jax.tar.gz "${GCLOUD_FLAGS[@]}" --worker=all
  tpu_ssh all "set -euo pipefail
    mkdir -p '$REMOTE_DIR' && tar -xzf gppo_jax.tar.gz -C '$REMOTE_DIR'
    if ! command -v python3.11 >/dev/null; then
      sudo apt-get update -qq && sudo apt-get install -y -qq python3.11 python3.11-venv
    fi
    cd '$REMOTE_DIR'
    python3.11 -m venv .venv && . .venv/bin/activate
    pip install -q --upgrade pip
    pip install -q -r requirements.txt && pip install -q -U 'jax[tpu]' && pip install -q -e .
    python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.devices()[0].device_kind)'"
}

cmd_run() {
  [[ -n "$CONFIG" ]] || die "--config (or GPPO_CONFIG) is required to run"
  local workers distributed=0
  workers="$(num_workers)"
  if [[ "${workers:-1}" -gt 1 ]]; then distributed=1; fi
  local workdir="${WORKDIR:-workdirs/$NAME}"
  if [[ "$distributed" == 1 && "$workdir" != gs://* ]]; then
    echo "warning: $workers hosts write checkpoints to '$workdir' on their own disks; use a" >&2
    echo "         shared --workdir (gs://...) so Orbax can save and restore the sharded state" >&2
  fi
  local extra=""
  if [[ ${#EXTRA[@]} -gt 0 ]]; then extra="$(printf ' %q' "${EXTRA[@]}")"; fi
  echo "running $CONFIG on $workers worker(s) of $NAME (GPPO_DISTRIBUTED=$distributed)"
  tpu_ssh all "set -euo pipefail
    cd '$REMOTE_DIR' && . .venv/bin/activate && mkdir -p ~/gppo_logs
    GPPO_DISTRIBUTED=$distributed python -m gppo_jax.train --config='$CONFIG' \
      --workdir='$workdir'$extra 2>&1 | tee ~/gppo_logs/train_\$(hostname).log"
}

cmd_fetch() {
  local dest="$LOGS_DIR/$NAME"
  mkdir -p "$dest"
  gcloud compute tpus tpu-vm scp --recurse "$NAME":gppo_logs "$dest/" "${GCLOUD_FLAGS[@]}" \
    --worker=all
  local workdir="${WORKDIR:-workdirs/$NAME}"
  if [[ "$workdir" != gs://* ]]; then
    gcloud compute tpus tpu-vm scp --recurse "$NAME":"$REMOTE_DIR/$workdir" "$dest/" \
      "${GCLOUD_FLAGS[@]}" --worker=0 || echo "warning: no workdir $workdir on worker 0" >&2
  else
    echo "the run folder is $workdir (gsutil -m cp -r $workdir $dest/ to copy it)"
  fi
  echo "logs in $dest/"
}

cmd_delete() {
  if [[ "$QUEUED" == 1 ]]; then
    gcloud compute tpus queued-resources delete "$QR_ID" "${GCLOUD_FLAGS[@]}" --force --quiet
  else
    gcloud compute tpus tpu-vm delete "$NAME" "${GCLOUD_FLAGS[@]}" --quiet
  fi
}

case "$COMMAND" in
  create) cmd_create ;;
  setup) cmd_setup ;;
  run) cmd_run ;;
  fetch) cmd_fetch ;;
  delete) cmd_delete ;;
  all)
    cmd_create
    trap 'echo "deleting $NAME"; cmd_delete' EXIT  # never leave a paid slice running
    cmd_setup
    status=0
    cmd_run || status=$?
    cmd_fetch || true
    exit "$status"
    ;;
esac
