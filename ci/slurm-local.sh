#!/usr/bin/env bash
# A one-node Slurm on this machine, for the hil test's `reach: srun` case: munged, slurmctld and
# slurmd (Debian's packages, installed if missing; needs root), configured in DIR with this
# host's short name as the only node. Prints the SLURM_CONF line to export.
#   ci/slurm-local.sh start DIR     install if needed, configure, start, wait until srun runs
#   ci/slurm-local.sh stop DIR      stop what start started
set -euo pipefail
cmd=${1:?usage: ci/slurm-local.sh start|stop DIR}
dir=${2:?usage: ci/slurm-local.sh start|stop DIR}

# slurmd and the slurmstepd it forks for each step, of this configuration only (their
# environment names it), never another Slurm on the machine.
ours() {
  local p comm
  for p in /proc/[0-9]*; do
    comm=$(cat "$p/comm" 2> /dev/null) || continue
    [[ $comm == slurmd || $comm == slurmstepd ]] || continue
    if tr '\0' '\n' 2> /dev/null < "$p/environ" | grep -Fx "SLURM_CONF=$dir/slurm.conf" > /dev/null; then
      echo "${p#/proc/}"
    fi
  done
}

stop() {
  # Steps still ending report to the controller first: a slurmstepd whose controller is gone
  # retries for ever and outlives slurmd.
  if [[ -s $dir/ctld.pid && -f $dir/slurm.conf ]]; then
    for _ in $(seq 1 10); do
      [[ -z $(SLURM_CONF=$dir/slurm.conf squeue -h 2> /dev/null || true) ]] && break
      sleep 1
    done
  fi
  local f p pids=() left
  # A pid file outlives its daemon: only a pid that is still a Slurm daemon is ours.
  for f in "$dir"/ctld.pid "$dir"/d.pid; do
    [[ -s $f ]] || continue
    p=$(cat "$f")
    case $(cat "/proc/$p/comm" 2> /dev/null) in slurmctld | slurmd) pids+=("$p") ;; esac
  done
  [[ ${#pids[@]} -eq 0 ]] || kill "${pids[@]}" 2> /dev/null || true
  # Wait until they are gone: a daemon still shutting down holds its port and pid file.
  for _ in $(seq 1 20); do
    left=()
    for p in "${pids[@]}" $(ours); do
      kill -0 "$p" 2> /dev/null && left+=("$p")
    done
    [[ ${#left[@]} -eq 0 ]] && return 0
    kill "${left[@]}" 2> /dev/null || true
    sleep 0.5
  done
  kill -9 "${left[@]}" 2> /dev/null || true
}

case $cmd in
  stop) stop; exit 0 ;;
  start) ;;
  *) echo "usage: ci/slurm-local.sh start|stop DIR" >&2; exit 2 ;;
esac

[[ $(id -u) == 0 ]] || { echo "ci/slurm-local.sh: needs root (slurmd runs jobs as their user)" >&2; exit 1; }
if ! command -v slurmctld > /dev/null || ! command -v slurmd > /dev/null || ! command -v srun > /dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmd slurmctld \
      slurm-client munge > /dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
           --no-install-recommends slurmd slurmctld slurm-client munge > /dev/null; }
fi

mkdir -p "$dir"/state "$dir"/spool
host=$(hostname -s)
cpus=$(nproc)
cat > "$dir/slurm.conf" << CONF
ClusterName=omnirig-ci
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SlurmctldPort=16817
SlurmdPort=16818
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/ctld.pid
SlurmdPidFile=$dir/d.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmUser=root
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

# munged: the package made its key; it wants its run directory and to run as munge.
if ! pgrep -x munged > /dev/null; then
  mkdir -p /run/munge && chown munge:munge /run/munge
  su -s /bin/sh munge -c /usr/sbin/munged 2> /dev/null || /usr/sbin/munged --force
fi
stop
export SLURM_CONF=$dir/slurm.conf
slurmctld -c
slurmd -c
for _ in $(seq 1 60); do
  if timeout 20 srun -N1 -n1 -w "$host" true 2> /dev/null; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "ci/slurm-local.sh: srun never ran a step; logs in $dir" >&2
tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd.log >&2 || true
exit 1
