#!/usr/bin/env bash
# A single-node SLURM cluster on loopback, for trying `cluster=slurm` on a workstation and for the tests.
#
#   sudo bash launch/slurm-local.sh up       # install (Debian 12: slurm-wlm, slurmdbd, munge, mariadb), configure, start
#   sudo bash launch/slurm-local.sh status   # daemons, sinfo, squeue
#   sudo bash launch/slurm-local.sh down     # stop the daemons this script started (by their pid files)
#
# Runs as root, without systemd: munged, mariadbd, slurmdbd, slurmctld and slurmd are started directly.
# Idempotent: `up` rewrites the same config, starts only what is not running, and waits until the node
# is idle and accounting answers (`sacct`); accounting is needed to see cancelled jobs end.
set -euo pipefail

CLUSTER=llmexp
HOST=$(hostname -s)
ETC=/etc/slurm
LOG=/var/log/slurm
DB_PASS=llmexp-local-slurm          # loopback-only test database; not a secret worth protecting
PIDS=/run/slurm-local
MYSQL_SOCK=/run/mysqld/mysqld.sock

log() { echo "slurm-local: $*" >&2; }
die() { log "error: $*"; exit 1; }
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurm-wlm)
  command -v slurmdbd >/dev/null || missing+=(slurmdbd)
  command -v munged >/dev/null || missing+=(munge)
  command -v mariadbd >/dev/null || missing+=(mariadb-server)
  ((${#missing[@]} == 0)) && return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

ensure_hosts_entry() {
  getent hosts "$HOST" >/dev/null && return 0
  log "adding $HOST to /etc/hosts"
  echo "127.0.0.1 $HOST" >>/etc/hosts
}

write_if_changed() {  # write stdin to $1 (mode $2) only when the content differs; atomic
  local path=$1 mode=$2 tmp
  tmp=$(mktemp "$path.XXXXXX")
  cat >"$tmp"
  chmod "$mode" "$tmp"
  if [[ -f $path ]] && cmp -s "$tmp" "$path"; then rm -f "$tmp"; else mv -f "$tmp" "$path"; CONFIG_CHANGED=1; fi
}
CONFIG_CHANGED=0

write_configs() {
  mkdir -p "$ETC" "$LOG" "$PIDS" /var/spool/slurmctld /var/spool/slurmd
  local cpus mem_kb real_mb
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys both: a test's OMP_NUM_THREADS=1 is not the node
  mem_kb=$(awk '/MemTotal/ {print $2}' /proc/meminfo)
  real_mb=$((mem_kb * 9 / 10 / 1024))   # above ~90% of MemTotal slurmd reports low memory and the node drains
  write_if_changed "$ETC/slurm.conf" 644 <<CONF
# Written by launch/slurm-local.sh: one node on loopback.
ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Short credential lifetime and scheduler intervals: a requeued job restarts in ~12-17 s, not minutes.
AuthInfo=cred_expire=10
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
# No cgroups in containers: track processes through /proc and bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Consumable cores and memory; DefMemPerCPU keeps a job from taking the whole node's memory (else jobs run one at a time).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
JobRequeue=1
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$PIDS/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
# Accounting through slurmdbd: without it sacct knows nothing and submitit never sees a cancelled job end.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mb State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
  write_if_changed "$ETC/slurmdbd.conf" 600 <<CONF
# Written by launch/slurm-local.sh.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$PIDS/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$DB_PASS
CONF
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  log "starting munged"
  [[ -s /etc/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  wait_for "munge" bash -c 'munge -n | unmunge >/dev/null'
}

start_mariadb() {
  if mysqladmin --socket="$MYSQL_SOCK" ping >/dev/null 2>&1; then return 0; fi
  log "starting mariadbd"
  mkdir -p /run/mysqld /var/log/mysql && chown mysql:mysql /run/mysqld /var/log/mysql
  [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  setsid nohup /usr/sbin/mariadbd --user=mysql --socket="$MYSQL_SOCK" --pid-file=/run/mysqld/mysqld.pid \
    --log-error=/var/log/mysql/error.log </dev/null >/dev/null 2>&1 &
  wait_for "mariadb" mysqladmin --socket="$MYSQL_SOCK" ping
  mysql --socket="$MYSQL_SOCK" -u root <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
}

start_slurm() {
  if ! alive "$PIDS/slurmdbd.pid"; then log "starting slurmdbd"; /usr/sbin/slurmdbd; fi
  wait_for "slurmdbd" sacctmgr -n list cluster
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
  if ((CONFIG_CHANGED)); then  # a node's CPUs or memory changed: slurmctld takes that only on a restart
    log "config changed: restarting slurmctld and slurmd"
    stop_pidfile slurmd "$PIDS/slurmd.pid"; stop_pidfile slurmctld "$PIDS/slurmctld.pid"
  fi
  if ! alive "$PIDS/slurmctld.pid"; then log "starting slurmctld"; /usr/sbin/slurmctld; fi
  wait_for "slurmctld" scontrol ping
  if ! alive "$PIDS/slurmd.pid"; then log "starting slurmd"; /usr/sbin/slurmd; fi
}

wait_for() {  # wait_for NAME CMD...: retry CMD for up to 60 s
  local name=$1; shift
  for _ in $(seq 120); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  die "$name did not come up; see $LOG/ and /var/log/mysql/"
}

node_state() { sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -1; }

wait_idle() {
  local state
  for _ in $(seq 120); do
    state=$(node_state)
    case $state in
      idle|mixed|allocated) sacct -n -X -S now-1minutes >/dev/null 2>&1 && { log "up: node $HOST $state"; return 0; } ;;
      down*|drain*|fail*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node $HOST is '${state:-unknown}', not idle; see $LOG/slurmd.log and \`scontrol show node $HOST\`"
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE: SIGTERM, then wait up to 20 s
  local name=$1 pidfile=$2 pid
  alive "$pidfile" || return 0
  pid=$(cat "$pidfile")
  log "stopping $name ($pid)"
  kill "$pid"
  for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  log "$name ($pid) still running after 20 s"
}

cmd_up() {
  [[ $EUID -eq 0 ]] || die "run as root (it installs packages and starts system daemons)"
  install_packages
  ensure_hosts_entry
  write_configs
  start_munge
  start_mariadb
  start_slurm
  wait_idle
}

cmd_down() {
  stop_pidfile slurmd "$PIDS/slurmd.pid"
  stop_pidfile slurmctld "$PIDS/slurmctld.pid"
  stop_pidfile slurmdbd "$PIDS/slurmdbd.pid"
  stop_pidfile mariadbd /run/mysqld/mysqld.pid
  stop_pidfile munged /run/munge/munged.pid
}

cmd_status() {
  local name pidfile
  for name in slurmd slurmctld slurmdbd mariadbd munged; do
    case $name in
      mariadbd) pidfile=/run/mysqld/mysqld.pid ;;
      munged) pidfile=/run/munge/munged.pid ;;
      *) pidfile=$PIDS/$name.pid ;;
    esac
    if alive "$pidfile"; then echo "$name: running ($(cat "$pidfile"))"; else echo "$name: stopped"; fi
  done
  sinfo 2>/dev/null || echo "sinfo: controller not reachable"
  squeue 2>/dev/null || true
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
