#!/usr/bin/env bash
# Single-node Slurm cluster on this machine, for tests and CI.
#
#   bash scripts/slurm_local.sh start    # install (if needed), configure, start, wait until idle
#   bash scripts/slurm_local.sh status   # exit 0 when the node is up and schedulable
#   bash scripts/slurm_local.sh stop     # cancel jobs, stop slurmctld, slurmd and munged
#
# Runs as root on Debian (bookworm's slurm-wlm and munge). Idempotent: `start` on a running
# cluster only checks it. No cgroups (they rarely work in containers): processes are tracked
# by /proc (proctrack/linuxproc) and tasks are not confined (task/none).
#
# Environment (all optional):
#   SLURM_LOCAL_PARTITION   partition name (default: debug)
#   SLURM_LOCAL_DIR         state, spool, logs and pid files (default: /var/lib/slurm-local)
#   SLURM_LOCAL_TIMEOUT_S   seconds to wait for the node to become idle (default: 90)
#   SLURM_LOCAL_CRED_EXPIRE_S  credential lifetime; a requeued job waits this long + 1 s
#                           before it may start again (Slurm's default 120; here 10)
set -euo pipefail

PARTITION="${SLURM_LOCAL_PARTITION:-debug}"
BASE_DIR="${SLURM_LOCAL_DIR:-/var/lib/slurm-local}"
WAIT_S="${SLURM_LOCAL_TIMEOUT_S:-90}"
CRED_EXPIRE_S="${SLURM_LOCAL_CRED_EXPIRE_S:-10}"
CLUSTER_NAME="local"
CONF_DIR=/etc/slurm
CONF_FILE="$CONF_DIR/slurm.conf"
MARKER="# written by scripts/slurm_local.sh"
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PIDFILE=/run/munge/munged.pid
CTLD_PIDFILE="$BASE_DIR/run/slurmctld.pid"
SLURMD_PIDFILE="$BASE_DIR/run/slurmd.pid"
LOG_DIR="$BASE_DIR/log"

say() { echo "[slurm_local] $*"; }
die() { echo "[slurm_local] ERROR: $*" >&2; exit 1; }

require_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts system daemons); try: sudo bash $0 $*"
}

short_hostname() { hostname -s 2>/dev/null || uname -n | cut -d. -f1; }

# pid from a pid file when that process is alive, else nothing.
live_pid() {
    local file=$1 pid
    [[ -s $file ]] || return 1
    pid=$(tr -dc '0-9' <"$file")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null 2>&1 || die "slurm-wlm/munge missing and no apt-get: this script supports Debian/Ubuntu only"
    say "installing ${missing[*]} (apt-get)"
    # Keep package scripts from starting daemons before we have configured them.
    local added_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        added_policy=1
    fi
    local rc=0
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -q &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
    } >"${TMPDIR:-/tmp}/slurm_local_apt.log" 2>&1 || rc=$?
    ((added_policy)) && rm -f /usr/sbin/policy-rc.d
    if ((rc != 0)); then
        tail -n 20 "${TMPDIR:-/tmp}/slurm_local_apt.log" >&2
        die "apt-get failed (exit $rc); full log: ${TMPDIR:-/tmp}/slurm_local_apt.log"
    fi
    command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 ||
        die "slurm-wlm installed but slurmctld/slurmd not on PATH"
}

write_config() {
    local host cpus mem_mb
    host=$(short_hostname)
    cpus=$(nproc)
    # Leave ~5% to the OS so slurmd never sees less memory than configured.
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.95)}' /proc/meminfo)
    [[ -n $host && $cpus -ge 1 && $mem_mb -ge 1 ]] || die "could not detect host name, CPUs or memory (host='$host' cpus='$cpus' mem='$mem_mb')"
    if [[ -e $CONF_FILE ]] && ! grep -qF "$MARKER" "$CONF_FILE"; then
        die "$CONF_FILE exists and was not written by this script; refusing to overwrite a real cluster's configuration"
    fi
    mkdir -p "$CONF_DIR" "$BASE_DIR"/{state,spool,run} "$LOG_DIR"
    local tmp
    tmp=$(mktemp "$CONF_DIR/.slurm.conf.XXXXXX")
    cat >"$tmp" <<EOF
$MARKER
# Single-node test cluster; regenerated on every start.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=$CRED_EXPIRE_S
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
# Rescan pending jobs every 2 s (default 60 s): a requeued job starts seconds after it is eligible.
SchedulerParameters=sched_interval=2,bf_interval=2
JobRequeue=1
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$BASE_DIR/state
SlurmdSpoolDir=$BASE_DIR/spool
SlurmctldPidFile=$CTLD_PIDFILE
SlurmdPidFile=$SLURMD_PIDFILE
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
MaxArraySize=10001
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    chmod 644 "$tmp"
    if [[ -e $CONF_FILE ]] && cmp -s "$tmp" "$CONF_FILE"; then
        rm -f "$tmp"
        return 1 # unchanged
    fi
    mv -f "$tmp" "$CONF_FILE"
    say "wrote $CONF_FILE (node $host: $cpus CPUs, ${mem_mb} MB, partition $PARTITION)"
    return 0
}

start_munge() {
    if live_pid "$MUNGE_PIDFILE" >/dev/null; then
        return 0
    fi
    getent passwd munge >/dev/null || die "user 'munge' missing; is the munge package installed correctly?"
    if [[ ! -s $MUNGE_KEY ]]; then
        say "creating munge key $MUNGE_KEY"
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        fi
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge "$MUNGE_KEY" /run/munge /var/lib/munge /var/log/munge /etc/munge
    chmod 400 "$MUNGE_KEY"
    chmod 700 /etc/munge /var/lib/munge /var/log/munge
    chmod 755 /run/munge
    runuser -u munge -- /usr/sbin/munged ||
        die "munged failed to start; see /var/log/munge/munged.log"
    for _ in $(seq 20); do
        munge -n </dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    die "munged started but credentials do not round-trip (munge -n | unmunge); see /var/log/munge/munged.log"
}

start_daemon() {
    local name=$1 pidfile=$2
    if live_pid "$pidfile" >/dev/null; then
        return 0
    fi
    "/usr/sbin/$name" || die "$name failed to start; see $LOG_DIR/$name.log"
}

node_state() {
    sinfo -h -N -o '%t' 2>/dev/null | head -n 1
}

wait_until_idle() {
    local state="" deadline=$((SECONDS + WAIT_S))
    while ((SECONDS < deadline)); do
        state=$(node_state || true)
        case $state in
        idle | mix | alloc | comp) say "node $(short_hostname) is $state; partition $PARTITION ready"; return 0 ;;
        down* | drain* | fail*)
            # ReturnToService=2 usually clears this on registration; nudge it once.
            scontrol update NodeName="$(short_hostname)" State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    sinfo -N -l >&2 || true
    tail -n 15 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
    die "node not idle after ${WAIT_S}s (state '${state:-unknown}'); logs in $LOG_DIR"
}

cmd_start() {
    require_root start
    install_packages
    local changed=0
    write_config && changed=1
    start_munge
    if ((changed)); then
        # Some settings (AuthInfo, node sizes) are read only at daemon start-up.
        # Jobs survive: slurmctld keeps its state on disk and running steps outlive slurmd.
        stop_pid slurmd "$SLURMD_PIDFILE"
        stop_pid slurmctld "$CTLD_PIDFILE"
    fi
    start_daemon slurmctld "$CTLD_PIDFILE"
    start_daemon slurmd "$SLURMD_PIDFILE"
    wait_until_idle
}

stop_pid() {
    local name=$1 pidfile=$2 pid
    pid=$(live_pid "$pidfile") || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 30); do
        kill -0 "$pid" 2>/dev/null || { say "stopped $name (pid $pid)"; return 0; }
        sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null || true
    say "killed $name (pid $pid) after 15 s"
}

cmd_stop() {
    require_root stop
    if live_pid "$CTLD_PIDFILE" >/dev/null; then
        local jobs
        jobs=$(squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            say "cancelling $(wc -w <<<"$jobs") job(s)"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 20); do
                [[ -z $(squeue -h -o '%A' 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    stop_pid slurmd "$SLURMD_PIDFILE"
    stop_pid slurmctld "$CTLD_PIDFILE"
    stop_pid munged "$MUNGE_PIDFILE"
    say "stopped"
}

cmd_status() {
    local up=1 pid
    for pair in "munged:$MUNGE_PIDFILE" "slurmctld:$CTLD_PIDFILE" "slurmd:$SLURMD_PIDFILE"; do
        if pid=$(live_pid "${pair#*:}"); then
            say "${pair%%:*} running (pid $pid)"
        else
            say "${pair%%:*} not running"
            up=0
        fi
    done
    if ((up)); then
        sinfo 2>&1 || true
        case $(node_state || true) in
        idle | mix | alloc | comp) return 0 ;;
        esac
    fi
    return 1
}

case "${1:-}" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
*) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
