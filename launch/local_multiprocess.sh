#!/usr/bin/env bash
# A multi-process job on one machine: N processes of launch.train (or of MODULE), each with D
# simulated CPU devices, one global mesh of N*D devices, the coordinator on 127.0.0.1. This is
# how tests/test_multiprocess.py runs its 2-process jobs; use it to try pod code paths on a
# laptop. Run it from the repository root, like every launch command.
#
#   launch/local_multiprocess.sh --workdir runs/mp steps=50       # any launch.train arguments
#   NUM_PROCESSES=4 DEVICES_PER_PROCESS=1 launch/local_multiprocess.sh --workdir runs/mp4
#   MODULE=launch.eval launch/local_multiprocess.sh --workdir runs/mp  # launch.eval, launch.passkey
#
# Environment: NUM_PROCESSES (2), DEVICES_PER_PROCESS (2), PORT (default: a free one),
# PYTHON (python), MODULE (launch.train). FIBJAX_HEARTBEAT_TIMEOUT / FIBJAX_INIT_TIMEOUT pass
# through to every process.
# SIGTERM or SIGINT to this script reaches every process: they save a checkpoint and stop.
# Exit status: 0 if every process succeeded, else the status of the first process that failed.
set -uo pipefail

N=${NUM_PROCESSES:-2}
D=${DEVICES_PER_PROCESS:-2}
PY=${PYTHON:-python}
MODULE=${MODULE:-launch.train}
PORT=${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

pids=()
forward() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap forward TERM INT
for ((i = 0; i < N; i++)); do
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$D" JAX_PLATFORMS=cpu \
    "$PY" -m "$MODULE" --coordinator "127.0.0.1:$PORT" --num-processes "$N" --process-id "$i" "$@" \
    > >(grep --line-buffered -v '^\[Gloo\]') &  # gloo's per-connection lines (stdout) say nothing to a user
  pids+=($!)
  echo "local_multiprocess: process $i of $N is pid $! (coordinator 127.0.0.1:$PORT)"
done

# Report each process as it ends (the first to die is usually the cause); portable to bash 3.
status=0
finished=()
while ((${#finished[@]} < N)); do
  for ((i = 0; i < N; i++)); do
    pid=${pids[i]}
    [[ -n ${finished[i]:-} ]] && continue
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"
    rc=$?
    finished[i]=1
    echo "local_multiprocess: process $i (pid $pid) exited with status $rc$( ((rc > 128)) && echo " (signal $((rc - 128)))")"
    ((rc != 0 && status == 0)) && status=$rc
  done
  sleep 0.2
done
exit "$status"
