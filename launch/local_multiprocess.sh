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
# Exit status: 0 if every process succeeded, else the status of the first process to fail (in time).
set -uo pipefail

N=${NUM_PROCESSES:-2}
D=${DEVICES_PER_PROCESS:-2}
PY=${PYTHON:-python}
MODULE=${MODULE:-launch.train}
PORT=${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# One line per process as it ends, in the order they end: "INDEX PID STATUS".
order=$(mktemp "${TMPDIR:-/tmp}/local_multiprocess.XXXXXX")
trap 'rm -f "$order"' EXIT

# Process $1 (the command follows), in a subshell that appends its end to $order. The command
# runs in the background there so that the forwarded SIGTERM reaches it at once (bash runs a
# trap only after a foreground child ends, but interrupts `wait` for it). A terminal's Ctrl-C
# sends SIGINT to every process of the job: this subshell and the output filter ignore it (the
# filter SIGTERM too; it ends when the process closes its output), so that they outlive the
# process and its last lines ("stopped by a signal ... run the same command to resume") reach
# the terminal; the script forwards the stop to the process as SIGTERM.
run() {
  local i=$1 rc child
  shift
  trap '' INT
  "$@" > >(trap '' INT TERM; exec grep --line-buffered -v '^\[Gloo\]') &  # gloo's per-connection lines (stdout) say nothing to a user
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null' TERM
  echo "local_multiprocess: process $i of $N is pid $child (coordinator 127.0.0.1:$PORT)"
  while :; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break  # else `wait` was interrupted by the trap: wait again
  done
  echo "$i $child $rc" >>"$order"
}

runners=()
forward() { kill -TERM "${runners[@]}" 2>/dev/null || true; }
trap forward TERM INT
for ((i = 0; i < N; i++)); do
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$D" JAX_PLATFORMS=cpu \
    run "$i" "$PY" -m "$MODULE" --coordinator "127.0.0.1:$PORT" --num-processes "$N" --process-id "$i" "$@" &
  runners+=($!)
done

# Report each process as it ends, the first to end first (it is usually the cause); portable to bash 3.
status=0
reported=0
while ((reported < N)); do
  ended=$(wc -l <"$order")
  while ((reported < ended)); do
    reported=$((reported + 1))
    read -r i pid rc <<<"$(sed -n "${reported}p" "$order")"
    echo "local_multiprocess: process $i (pid $pid) exited with status $rc$( ((rc > 128)) && echo " (signal $((rc - 128)))")"
    ((rc != 0 && status == 0)) && status=$rc
  done
  ((reported < N)) && sleep 0.1
done
wait
exit "$status"
