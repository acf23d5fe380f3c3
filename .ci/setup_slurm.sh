#!/usr/bin/env bash
# Single-node, localhost-only SLURM for the `slurm` tests (Debian's slurm-wlm + munge).
#
# Installs the packages, writes a cgroup-free slurm.conf (containers and microVMs here have no
# systemd and no writable cgroup tree), starts munged, slurmctld and slurmd directly (no
# systemd), and waits until the node is idle. Idempotent: a second run finds the daemons up and
# only re-checks. Needs root. Everything it does is logged to /var/log/slurm/.
#
# Exits non-zero with the reason when SLURM cannot be brought up; the tests then skip with the
# reason they find themselves (tests/test_slurm.py probes `sinfo`/`srun`). The tests never run
# this script: .ci/run does, before the tests, and `--stop` after them.
#
#   bash .ci/setup_slurm.sh          install if needed, configure, start, wait until idle
#   bash .ci/setup_slurm.sh --stop   stop slurmd, slurmctld and munged again
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm/slurmctld
SPOOL_DIR=/var/lib/slurm/slurmd
WAIT_S=${SLURM_SETUP_WAIT_S:-60}

say() { echo "[setup_slurm] $*"; }
die() { echo "[setup_slurm] ERROR: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (installs packages, starts daemons)"

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v srun >/dev/null; then
    say "slurm-wlm and munge already installed ($(slurmd -V))"
    return
  fi
  say "installing slurm-wlm and munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # --no-install-recommends: no mail server, no docs; the daemons and clients are all we need.
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
  say "installed $(slurmd -V)"
}

write_config() {
  local node cpus mem_mib tmp
  node=$(hostname -s)
  cpus=$(nproc)
  # Leave 5% (at least 256 MiB) of memory to the OS, or slurmd may find less than configured
  # and drain the node ("Low RealMemory").
  mem_mib=$(free -m | awk '/^Mem:/ {m = int($2 * 0.95); if ($2 - m < 256) m = $2 - 256; print m}')
  mkdir -p "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# Written by moe_perf .ci/setup_slurm.sh: one node, localhost only, no cgroups.
ClusterName=moeperf
SlurmctldHost=${node}(127.0.0.1)
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroup plugins: process tracking by parent pid, no task binding or confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
# Schedule on submit, not on a timer: tests wait for jobs.
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the numbers below over what slurmd detects (a VM may report sockets oddly).
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
NodeName=${node} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem_mib} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  if [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; then
    rm -f "$tmp"
    CONFIG_CHANGED=0
  else
    mv "$tmp" "$CONF"
    chmod 644 "$CONF"
    CONFIG_CHANGED=1
    say "wrote $CONF (node ${node}, CPUs=${cpus}, RealMemory=${mem_mib} MiB)"
  fi
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged already running"
    return
  fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating munge key"
    mungekey --create --keyfile=/etc/munge/munge.key
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  # munged refuses to run as root; run it as its own user like the packaged service does.
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 1 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && { say "munged started"; return; }
    sleep 0.1
  done
  die "munged did not come up (see /var/log/munge/munged.log)"
}

daemon_running() {  # $1 = pid file: true when it names a live process
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_slurm() {
  if daemon_running /run/slurmctld.pid; then
    say "slurmctld already running"
    if [[ $CONFIG_CHANGED == 1 ]]; then say "config changed: scontrol reconfigure"; scontrol reconfigure; fi
  else
    slurmctld || die "slurmctld failed to start (see $LOG_DIR/slurmctld.log)"
    say "slurmctld started"
  fi
  if daemon_running /run/slurmd.pid; then
    say "slurmd already running"
  else
    slurmd || die "slurmd failed to start (see $LOG_DIR/slurmd.log)"
    say "slurmd started"
  fi
}

wait_idle() {
  local node state
  node=$(hostname -s)
  for _ in $(seq 1 $((WAIT_S * 2))); do
    state=$(sinfo -h -n "$node" -o '%T' 2>/dev/null | head -1 || true)
    case $state in
      idle|mixed|allocated|completing)
        say "node $node is $state; partition: $(sinfo -h -o '%P %a %D %T')"
        return ;;
      drain*|down*)
        # A node that went down with the previous slurmd (restart, stale state) comes back here.
        scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  sinfo -N -l >&2 || true
  tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
  die "node $node not idle after ${WAIT_S}s (state: '${state:-none}')"
}

stop_all() {
  local pidfile
  for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
    if daemon_running "$pidfile"; then
      kill "$(cat "$pidfile")"
      say "stopped $(basename "$pidfile" .pid)"
    fi
  done
}

if [[ ${1:-} == --stop ]]; then
  stop_all
  exit 0
fi
install_packages
write_config
start_munge
start_slurm
wait_idle
