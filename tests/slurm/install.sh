#!/usr/bin/env bash
# Install the Debian packages of a single-node Slurm (slurm-wlm + munge) when they are missing.
# Run by .ci/run (as root) and by tests/slurm/start.sh; a no-op once installed. Exit 1 when it cannot install.
set -euo pipefail
have_all() {
  command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged
} >/dev/null 2>&1
have_all && exit 0
if [ "$(id -u)" != 0 ]; then echo "tests/slurm/install.sh: slurm-wlm/munge missing and not root" >&2; exit 1; fi
command -v apt-get >/dev/null || { echo "tests/slurm/install.sh: no apt-get on this host" >&2; exit 1; }
LOG=${TMPDIR:-/tmp}/scaletrain-slurm-apt.log
export DEBIAN_FRONTEND=noninteractive
echo "tests/slurm/install.sh: installing slurm-wlm munge (apt, log $LOG)" >&2
# try without refreshing the package lists first: fast when they are fresh enough
if ! apt-get install -y --no-install-recommends slurm-wlm munge >"$LOG" 2>&1; then
  apt-get update >>"$LOG" 2>&1 || true
  apt-get install -y --no-install-recommends slurm-wlm munge >>"$LOG" 2>&1 ||
    { echo "tests/slurm/install.sh: apt-get install failed; see $LOG" >&2; tail -n 20 "$LOG" >&2; exit 1; }
fi
have_all || { echo "tests/slurm/install.sh: installed, but slurm commands are still missing" >&2; exit 1; }
