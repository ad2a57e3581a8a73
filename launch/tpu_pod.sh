#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: the same command on every worker, one process per host.
#
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a launch/tpu_pod.sh --config configs/paper/fib_stagger_w12.py \
#       --workdir /mnt/shared/runs/fib_stagger_w12
#
# No coordinator flags: fibjax.distributed recognises the TPU VM and JAX reads the workers and
# this host's index from the TPU metadata (process 0 is worker 0). Before the first run, on
# every worker (same ssh command): the repository at $REPO and `pip install -e ".[tpu]"`, e.g.
#   gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all \
#       --command 'git clone <your fibjax remote> fibjax && cd fibjax && pip install -e ".[tpu]"'
# The workdir must be storage every worker sees (Filestore/NFS, or a gcsfuse mount): Orbax writes
# each host's shards of a checkpoint there, process 0 the config, metrics and TensorBoard.
# Maintenance events send SIGTERM: every host saves and stops; run the same command to resume.
# A host that dies ends the others within FIBJAX_HEARTBEAT_TIMEOUT seconds (default 100).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
REPO=${REPO:-fibjax}  # relative to the home directory on each worker
PROJECT_FLAG=()
[[ -n ${PROJECT:-} ]] && PROJECT_FLAG=(--project "$PROJECT")
ARGS=$(printf ' %q' "$@")  # re-quoted for the remote shell
ENV="FIBJAX_HEARTBEAT_TIMEOUT=${FIBJAX_HEARTBEAT_TIMEOUT:-100} FIBJAX_INIT_TIMEOUT=${FIBJAX_INIT_TIMEOUT:-300}"

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" ${PROJECT_FLAG[@]+"${PROJECT_FLAG[@]}"} --worker=all \
  --command "cd $REPO && $ENV python -m launch.train$ARGS"
