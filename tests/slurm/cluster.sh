#!/usr/bin/env bash
# A real single-node SLURM cluster for the `slurm` tests: install (if missing), configure in DIR, start, stop.
#
#   tests/slurm/cluster.sh up DIR      install Debian's slurmctld/slurmd/slurm-client/munge if needed, write
#                                      DIR/slurm.conf, start munged (unless one runs), slurmctld and slurmd,
#                                      wait for the node to be idle; clients then need `source DIR/env.sh`
#   tests/slurm/cluster.sh down DIR    cancel its jobs, stop the daemons it started (by PID), wait until gone
#   tests/slurm/cluster.sh status DIR  daemons, sinfo, squeue
#
# Exit code 77 from `up`: no cluster possible here (not root, no apt-get, or apt failed); the tests skip.
#
# Accounting: there is no slurmdbd, so the real `sacct` fails. submitit always asks sacct for job states; a job
# that ends without a result file (cancelled, killed) would then never be seen to end. DIR/bin/sacct is a small
# shim answering from `squeue --states=all` (finished jobs stay visible for MinJobAge); env.sh puts DIR/bin
# first on PATH, for the tests only.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [[ -z "$cmd" || -z "$dir" ]]; then
    echo "usage: $0 up|down|status DIR" >&2
    exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
export SLURM_CONF="$dir/slurm.conf"
PKGS=(slurmctld slurmd slurm-client munge)

log() { echo "cluster.sh: $*" >&2; }

# A live process, not a zombie: this machine's PID 1 may never reap stopped daemons.
alive() {
    local pid=$1 state
    [[ -n "$pid" && -r /proc/$pid/stat ]] || return 1
    state=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

pid_of() { [[ -r "$1" ]] && tr -dc '0-9' <"$1" || true; }

install_packages() {
    local missing=0
    for bin in slurmctld slurmd sbatch srun squeue scontrol munged; do
        command -v "$bin" >/dev/null 2>&1 || [[ -x /usr/sbin/$bin ]] || missing=1
    done
    ((missing)) || return 0
    if [[ $(id -u) != 0 ]]; then
        log "SLURM is not installed and this is not root: cannot install ${PKGS[*]}"
        exit 77
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        log "SLURM is not installed and there is no apt-get to install ${PKGS[*]}"
        exit 77
    fi
    log "installing ${PKGS[*]}"
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${PKGS[@]}") >"$dir/apt.log" 2>&1; then
        log "apt-get could not install ${PKGS[*]} (see $dir/apt.log)"
        exit 77
    fi
}

free_port() {
    local port
    for _ in $(seq 50); do
        port=$((20000 + RANDOM % 20000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return
        fi
    done
    echo 6817
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        log "using the munged already running"
        return
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
            pid_of /run/munge/munged.pid >"$dir/munged.started"  # ours: `down` stops it
            return
        fi
        sleep 0.1
    done
    log "munged did not start"
    exit 1
}

write_config() {
    local host node ctld_port slurmd_port
    host=$(hostname -s)
    node=$(slurmd -C | head -n1)
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    [[ "$slurmd_port" != "$ctld_port" ]] || slurmd_port=$((ctld_port + 1))
    mkdir -p "$dir/state" "$dir/spool" "$dir/bin"
    cat >"$SLURM_CONF" <<EOF
# Written by tests/slurm/cluster.sh: a single-node test cluster, no accounting daemon.
ClusterName=asyncpipe-test
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits for its old credential to expire: 10 s instead of the default 120 s.
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# Finished jobs stay in squeue for an hour: the sacct shim answers from there.
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$dir/bin/sacct" <<'EOF'
#!/usr/bin/env bash
# sacct for a cluster without slurmdbd: job states from `squeue --states=all` (see tests/slurm/cluster.sh).
# Understands -j/--jobs, -o/--format, -n/--noheader, -P/--parsable2; other options are accepted and ignored.
jobs="" format="JobID,JobName,State" header=1
while (($#)); do
    case "$1" in
    -j | --jobs) jobs="$jobs,$2"; shift ;;
    --jobs=*) jobs="$jobs,${1#*=}" ;;
    -o | --format) format=$2; shift ;;
    --format=*) format=${1#*=} ;;
    -n | --noheader) header=0 ;;
    esac
    shift
done
squeue --states=all --array --noheader --format='%i|%T|%N|%j' 2>/dev/null | awk -F'|' \
    -v jobs="$jobs" -v format="$format" -v header="$header" '
BEGIN {
    n = split(format, fields, ",")
    nj = split(jobs, wanted, ",")
    if (header) { line = ""; for (i = 1; i <= n; i++) line = line (i > 1 ? "|" : "") fields[i]; print line }
}
{
    keep = (jobs == "")
    for (k = 1; k <= nj; k++) {
        if (wanted[k] == "") continue
        if ($1 == wanted[k] || index($1, wanted[k] "_") == 1) keep = 1
    }
    if (!keep) next
    line = ""
    for (i = 1; i <= n; i++) {
        f = tolower(fields[i]); sub(/%.*/, "", f)
        v = ""
        if (f == "jobid" || f == "jobidraw") v = $1
        else if (f == "state") v = $2
        else if (f == "nodelist") v = $3
        else if (f == "jobname") v = $4
        else if (f == "exitcode") v = "0:0"
        line = line (i > 1 ? "|" : "") v
    }
    print line
}'
EOF
    chmod +x "$dir/bin/sacct"
    cat >"$dir/env.sh" <<EOF
export SLURM_CONF=$SLURM_CONF
export PATH=$dir/bin:\$PATH
EOF
}

up() {
    if [[ $(id -u) != 0 ]]; then
        log "the test cluster runs its daemons as root (SlurmUser=root); this is not root"
        exit 77
    fi
    if alive "$(pid_of "$dir/slurmctld.pid")" && alive "$(pid_of "$dir/slurmd.pid")"; then
        log "already up in $dir"
        return
    fi
    install_packages
    start_munge
    write_config
    /usr/sbin/slurmctld -c -f "$SLURM_CONF"  # -c: clean state, no jobs from an earlier cluster
    /usr/sbin/slurmd -f "$SLURM_CONF"
    for _ in $(seq 150); do
        state=$(sinfo --noheader --format=%T 2>/dev/null | head -n1 || true)
        case "$state" in
        idle | mixed | allocated) log "up: $SLURM_CONF (node $state)"; return ;;
        drain* | down*) scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.2
    done
    log "the node did not become idle; see $dir/slurmctld.log and $dir/slurmd.log"
    status
    exit 1
}

stop_pid() {
    local pid=$1 name=$2
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        alive "$pid" || return 0
        sleep 0.1
    done
    log "$name ($pid) ignored SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

down() {
    local ctld slurmd
    ctld=$(pid_of "$dir/slurmctld.pid")
    slurmd=$(pid_of "$dir/slurmd.pid")
    if alive "$ctld"; then
        # Jobs first: their step daemons outlive slurmd otherwise.
        scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 100); do
            [[ -z "$(squeue --noheader --states=RUNNING,COMPLETING,CONFIGURING 2>/dev/null)" ]] && break
            sleep 0.1
        done
    fi
    stop_pid "$slurmd" slurmd
    stop_pid "$ctld" slurmctld
    if [[ -s "$dir/munged.started" ]]; then
        stop_pid "$(cat "$dir/munged.started")" munged
        rm -f "$dir/munged.started"
    fi
    log "down"
}

status() {
    for name in slurmctld slurmd; do
        pid=$(pid_of "$dir/$name.pid")
        if alive "$pid"; then echo "$name: running (pid $pid)"; else echo "$name: stopped"; fi
    done
    sinfo 2>/dev/null || true
    squeue --states=all 2>/dev/null || true
}

case "$cmd" in
up) up ;;
down) down ;;
status) status ;;
*)
    echo "usage: $0 up|down|status DIR" >&2
    exit 2
    ;;
esac
