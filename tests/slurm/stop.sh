#!/usr/bin/env bash
# Stop exactly the daemons start.sh started, by pid file (never by name). Cancels the test cluster's jobs first:
# job processes outlive slurmd otherwise.
set -uo pipefail
BASE=${SCALETRAIN_SLURM_DIR:-/tmp/scaletrain-slurm}
RUN=$BASE/run

alive() {
  local p
  [ -s "$1" ] && p=$(cat "$1") && [ -d "/proc/$p" ] && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ]
}
stop_one() {   # stop_one NAME: pid file $RUN/NAME.pid, /proc/PID/comm must be NAME
  local name=$1 pf=$RUN/$1.pid p
  [ -s "$pf" ] || { echo "$name: not started by start.sh, left alone"; return 0; }
  p=$(cat "$pf")
  if alive "$pf" "$name"; then
    kill -TERM "$p"
    for _ in $(seq 1 100); do [ -d "/proc/$p" ] || break; sleep 0.1; done
    if [ -d "/proc/$p" ]; then echo "$name ($p) ignored SIGTERM for 10 s, SIGKILL"; kill -KILL "$p"; fi
    echo "stopped $name (pid $p)"
  else
    echo "$name: pid $p not running (stale pid file)"
  fi
  rm -f "$pf"
}

if alive "$RUN/slurmctld.pid" slurmctld && alive "$RUN/slurmd.pid" slurmd; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    echo "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs
    for _ in $(seq 1 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi
stop_one slurmd
stop_one slurmctld
stop_one munged
exit 0
