#!/usr/bin/env bash
# A real SLURM cluster on this machine for the `slurm` tests: install (if missing), configure in DIR, start, stop.
#
#   tests/slurm/cluster.sh up DIR [N]  install Debian's slurmctld/slurmd/slurm-client/munge if needed, write
#                                      DIR/slurm.conf, start munged (unless one runs), slurmctld and the slurmds,
#                                      wait for the nodes to be idle; clients then need `source DIR/env.sh`.
#                                      N=1 (default): one node, this host. N>=2: nodes node1..nodeN, each slurmd
#                                      in a network namespace of its own (see "Multi-node" below).
#   tests/slurm/cluster.sh down DIR    cancel its jobs, stop the daemons it started (by PID), remove the
#                                      namespaces, links and bridge it made, wait until gone
#   tests/slurm/cluster.sh status DIR  daemons, sinfo, squeue
#   tests/slurm/cluster.sh kill-node DIR NODE   a crashed node: SIGKILL every process in NODE's namespace
#                                      (its slurmd, step daemons and tasks)
#   tests/slurm/cluster.sh start-node DIR NODE  start NODE's slurmd again and wait until the node is idle
#
# Exit code 77 from `up`: no cluster possible here (not root, no apt-get, apt failed, or for N>=2 no network
# namespaces); the tests skip.
#
# Multi-node: a bridge `aps<ID>` holding 10.213.<ID>.1 (slurmctld's address), and per node a namespace
# `ap<ID>n<i>` whose `eth0` (one end of a veth pair on the bridge) holds 10.213.<ID>.<10+i>, its loopback up,
# no route anywhere else. slurmctld reaches each slurmd by NodeAddr. Each slurmd starts in its namespace with
# /etc/netns/<ns>/hosts bound on /etc/hosts (in a mount namespace of its own): it names every node, and this
# host's name resolves, inside a node, to that node's own address, as on a real cluster. munged's socket is a file: every node shares it. Per node:
# DIR/nodes/<node>/{spool,slurmd.log,slurmd.pid}. ID is free when chosen, kept in DIR/cluster.env.
#
# Accounting: real. Debian's slurmdbd over a MariaDB server of the cluster's own (DIR/db, TCP on 127.0.0.1 only,
# a fresh database each `up`; about 7 s), so `sacct` (which submitit asks for job states) answers from the
# accounting database. Where slurmdbd or mariadb-server cannot be installed, a small shim DIR/bin/sacct answers
# from `squeue --states=all` instead (finished jobs then stay in squeue for MinJobAge=3600 s); env.sh puts DIR/bin
# first on PATH, for the tests only. DIR/cluster.env says which (ACCOUNTING=slurmdbd or shim).
set -euo pipefail

usage() {
    echo "usage: $0 up DIR [NODES] | down DIR | status DIR | kill-node DIR NODE | start-node DIR NODE" >&2
    exit 2
}
cmd=${1:-}
dir=${2:-}
arg=${3:-}
[[ -n "$cmd" && -n "$dir" ]] || usage
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
export SLURM_CONF="$dir/slurm.conf"
PKGS=(slurmctld slurmd slurm-client munge)
ACCT_PKGS=(slurmdbd mariadb-server)

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

accounting_available() {
    # slurmdbd and MariaDB, installed now if missing and possible (else the cluster uses the sacct shim).
    [[ -x /usr/sbin/slurmdbd && -x /usr/sbin/mariadbd ]] && command -v mariadb-install-db >/dev/null && return 0
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1 || return 1
    log "installing ${ACCT_PKGS[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${ACCT_PKGS[@]}" \
        >>"$dir/apt.log" 2>&1 || return 1
    [[ -x /usr/sbin/slurmdbd && -x /usr/sbin/mariadbd ]]
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

# --- multi-node networking -----------------------------------------------------------------------------

NET_PREFIX=10.213

load_net() {
    # NET_ID and NODES of this cluster (NODES=1: single-node mode, no namespaces).
    NET_ID="" NODES=1 ACCOUNTING=shim
    [[ -r "$dir/cluster.env" ]] && source "$dir/cluster.env"
    return 0
}

ns_of() { echo "ap${NET_ID}n${1#node}"; }          # node3 -> ap<ID>n3 (namespace, and the veth's host end)
addr_of() { echo "$NET_PREFIX.$NET_ID.$((10 + ${1#node}))"; }
ctld_addr() { echo "$NET_PREFIX.$NET_ID.1"; }

check_netns() {
    # Namespaces, veth pairs and bridges must work here, else the multi-node tests skip.
    command -v ip >/dev/null 2>&1 || { log "no iproute2 (ip): cannot make network namespaces"; exit 77; }
    local probe="approbe$$"
    if ! ip netns add "$probe" 2>/dev/null; then
        log "cannot create network namespaces here (ip netns add failed)"
        exit 77
    fi
    ip netns del "$probe" 2>/dev/null || true
    if ! ip link add "${probe}b" type bridge 2>/dev/null; then
        log "cannot create a bridge here (ip link add type bridge failed)"
        exit 77
    fi
    ip link del "${probe}b" 2>/dev/null || true
}

pick_net_id() {
    local id
    for _ in $(seq 100); do
        id=$((1 + RANDOM % 250))
        ip link show "aps$id" >/dev/null 2>&1 && continue
        [[ -e /run/netns/ap${id}n1 ]] && continue
        ip -o addr 2>/dev/null | grep -q " $NET_PREFIX\.$id\." && continue
        echo "$id"
        return
    done
    log "no free network id for the test cluster"
    exit 1
}

make_network() {
    local bridge="aps$NET_ID" i node ns
    ip link add "$bridge" type bridge
    ip addr add "$(ctld_addr)/24" dev "$bridge"
    ip link set "$bridge" up
    for i in $(seq "$NODES"); do
        node=node$i ns=$(ns_of node$i)
        ip netns add "$ns"
        ip link add "$ns" type veth peer name "$ns-p"
        ip link set "$ns-p" netns "$ns"
        ip link set "$ns" master "$bridge"
        ip link set "$ns" up
        ip netns exec "$ns" ip link set lo up
        ip netns exec "$ns" ip link set "$ns-p" name eth0
        ip netns exec "$ns" ip addr add "$(addr_of "$node")/24" dev eth0
        ip netns exec "$ns" ip link set eth0 up
        mkdir -p "/etc/netns/$ns"
        {
            echo "127.0.0.1 localhost"
            echo "$(addr_of "$node") $(hostname -s)"  # this host's name is, inside a node, the node's own address
            for j in $(seq "$NODES"); do echo "$(addr_of node$j) node$j"; done
        } >"/etc/netns/$ns/hosts"
    done
}

remove_network() {
    local i ns pid
    [[ -n "$NET_ID" ]] || return 0
    for i in $(seq "$NODES"); do
        ns=$(ns_of node$i)
        if [[ -e /run/netns/$ns ]]; then
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
            ip netns del "$ns" 2>/dev/null || true
        fi
        ip link del "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    ip link del "aps$NET_ID" 2>/dev/null || true
}

# --- configuration ----------------------------------------------------------------------------------------

write_config() {
    local host hw ctld_port slurmd_port nodes_conf ctld spool pidf logf i timeout accounting_conf min_job_age
    if [[ $ACCOUNTING == slurmdbd ]]; then
        accounting_conf="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT"
        min_job_age=300
    else
        accounting_conf="AccountingStorageType=accounting_storage/none"
        min_job_age=3600  # finished jobs stay in squeue for an hour: the sacct shim answers from there
    fi
    host=$(hostname -s)
    hw=$(/usr/sbin/slurmd -C | head -n1 | sed 's/^NodeName=[^ ]* //')
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    [[ "$slurmd_port" != "$ctld_port" ]] || slurmd_port=$((ctld_port + 1))
    mkdir -p "$dir/state" "$dir/bin"
    if ((NODES == 1)); then
        ctld=$host spool=$dir/spool pidf=$dir/slurmd.pid logf=$dir/slurmd.log timeout=60
        mkdir -p "$dir/spool"
        nodes_conf="NodeName=$host $hw State=UNKNOWN"$'\n'
    else
        # %n: the node's name, so each slurmd has its own spool, PID file and log.
        ctld="$host($(ctld_addr))" spool=$dir/nodes/%n/spool pidf=$dir/nodes/%n/slurmd.pid
        logf=$dir/nodes/%n/slurmd.log timeout=15  # a killed node is DOWN within ~15 s
        nodes_conf=""
        for i in $(seq "$NODES"); do
            mkdir -p "$dir/nodes/node$i/spool"
            nodes_conf+="NodeName=node$i NodeAddr=$(addr_of node$i) $hw State=UNKNOWN"$'\n'
        done
    fi
    cat >"$SLURM_CONF" <<EOF
# Written by tests/slurm/cluster.sh: a $NODES-node test cluster, accounting: $ACCOUNTING.
ClusterName=asyncpipe-test
SlurmctldHost=$ctld
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits for its old credential to expire: 5 s (SLURM's minimum) instead of the default 120 s.
AuthInfo=cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$pidf
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$logf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
$accounting_conf
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=$min_job_age
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=$timeout
${nodes_conf}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$dir/env.sh" <<EOF
export SLURM_CONF=$SLURM_CONF
export PATH=$dir/bin:\$PATH
EOF
    [[ $ACCOUNTING == shim ]] || return 0
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
}

# --- daemons ----------------------------------------------------------------------------------------------

start_accounting() {
    # MariaDB on 127.0.0.1 with a fresh data dir, a `slurm` user for slurmdbd, then slurmdbd itself.
    local db_port
    db_port=$(free_port)
    [[ "$db_port" != "$DBD_PORT" ]] || db_port=$((DBD_PORT + 1))
    rm -rf "$dir/db"
    mariadb-install-db --no-defaults --datadir="$dir/db" --user=root --auth-root-authentication-method=normal \
        --skip-test-db --innodb-log-file-size=8M >"$dir/db-install.log" 2>&1 ||
        { log "mariadb-install-db failed; see $dir/db-install.log"; exit 1; }
    setsid /usr/sbin/mariadbd --no-defaults --datadir="$dir/db" --user=root --socket="$dir/mysql.sock" \
        --port="$db_port" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$dir/mariadb.pid" \
        --log-error="$dir/mariadb.log" --innodb-buffer-pool-size=32M --innodb-log-file-size=8M \
        --innodb-flush-log-at-trx-commit=0 \
        </dev/null >/dev/null 2>&1 &
    for _ in $(seq 300); do
        mariadb --no-defaults --socket="$dir/mysql.sock" -uroot -e "select 1" >/dev/null 2>&1 && break
        sleep 0.1
    done
    mariadb --no-defaults --socket="$dir/mysql.sock" -uroot -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY \
        'asyncpipe-test'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || { log "MariaDB did not start"; exit 1; }
    (
        umask 077  # slurmdbd refuses a readable config (it holds the password)
        cat >"$dir/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$dir/slurmdbd.pid
LogFile=$dir/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=asyncpipe-test
StorageLoc=slurm_acct_db
EOF
    )
    /usr/sbin/slurmdbd  # reads slurmdbd.conf next to $SLURM_CONF
    for _ in $(seq 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$DBD_PORT") 2>/dev/null && return 0
        sleep 0.1
    done
    log "slurmdbd did not start; see $dir/slurmdbd.log"
    exit 1
}

node_names() {
    if ((NODES == 1)); then hostname -s; else for i in $(seq "$NODES"); do echo "node$i"; done; fi
}

slurmd_pidfile() { if ((NODES == 1)); then echo "$dir/slurmd.pid"; else echo "$dir/nodes/$1/slurmd.pid"; fi; }

start_slurmd() {
    local node=$1
    if ((NODES == 1)); then
        /usr/sbin/slurmd -f "$SLURM_CONF"
    else
        # Only the network namespace changes (`ip netns exec` would also remount /sys, hiding the cgroup
        # filesystems slurmd needs), plus a private mount namespace in which the node's hosts file is bound.
        local ns
        ns=$(ns_of "$node")
        nsenter --net="/run/netns/$ns" unshare --mount --propagation private \
            sh -c 'mount --bind "$1" /etc/hosts && exec /usr/sbin/slurmd -f "$2" -N "$3"' \
            slurmd "/etc/netns/$ns/hosts" "$SLURM_CONF" "$node"
    fi
}

wait_idle() {
    # Wait until every node named is idle (resuming any that come up drained or down).
    local state node pending
    for _ in $(seq 300); do
        pending=0
        for node in "$@"; do
            state=$(sinfo --noheader --node="$node" --format=%T 2>/dev/null | head -n1 || true)
            case "$state" in
            idle | mixed | allocated) ;;
            drain* | down*) pending=1; scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
            *) pending=1 ;;
            esac
        done
        ((pending)) || return 0
        sleep 0.2
    done
    return 1
}

up() {
    local nodes=${1:-1} node
    [[ "$nodes" =~ ^[0-9]+$ && "$nodes" -ge 1 && "$nodes" -le 16 ]] || { log "NODES must be 1..16, got $nodes"; exit 2; }
    if [[ $(id -u) != 0 ]]; then
        log "the test cluster runs its daemons as root (SlurmUser=root); this is not root"
        exit 77
    fi
    load_net
    if alive "$(pid_of "$dir/slurmctld.pid")"; then
        log "already up in $dir ($NODES nodes)"
        return
    fi
    install_packages
    NODES=$nodes NET_ID="" ACCOUNTING=shim
    accounting_available && ACCOUNTING=slurmdbd
    if ((NODES > 1)); then
        check_netns
        NET_ID=$(pick_net_id)
    fi
    DBD_PORT=$(free_port)
    printf 'NET_ID=%s\nNODES=%s\nACCOUNTING=%s\n' "$NET_ID" "$NODES" "$ACCOUNTING" >"$dir/cluster.env"
    ((NODES == 1)) || make_network
    start_munge
    write_config
    [[ $ACCOUNTING == shim ]] || start_accounting
    /usr/sbin/slurmctld -c -f "$SLURM_CONF"  # -c: clean state, no jobs from an earlier cluster
    mapfile -t names < <(node_names)
    for node in "${names[@]}"; do start_slurmd "$node"; done
    if wait_idle "${names[@]}"; then
        log "up: $SLURM_CONF ($NODES node(s): ${names[*]}; accounting: $ACCOUNTING)"
        return
    fi
    log "the nodes did not become idle; see $dir/slurmctld.log and the slurmd logs"
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
    local ctld node
    load_net
    ctld=$(pid_of "$dir/slurmctld.pid")
    if alive "$ctld"; then
        # Jobs first: their step daemons outlive slurmd otherwise.
        scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 100); do
            [[ -z "$(squeue --noheader --states=RUNNING,COMPLETING,CONFIGURING 2>/dev/null)" ]] && break
            sleep 0.1
        done
    fi
    for node in $(node_names); do stop_pid "$(pid_of "$(slurmd_pidfile "$node")")" "slurmd $node"; done
    stop_pid "$ctld" slurmctld
    stop_pid "$(pid_of "$dir/slurmdbd.pid")" slurmdbd
    stop_pid "$(pid_of "$dir/mariadb.pid")" mariadbd
    rm -rf "$dir/db"  # ~20 MB of database files
    remove_network  # also kills whatever is left inside the namespaces
    if [[ -s "$dir/munged.started" ]]; then
        stop_pid "$(cat "$dir/munged.started")" munged
        rm -f "$dir/munged.started"
    fi
    log "down"
}

kill_node() {
    local node=$1 ns pid
    load_net
    ((NODES > 1)) || { log "kill-node needs a multi-node cluster"; exit 2; }
    ns=$(ns_of "$node")
    [[ -e /run/netns/$ns ]] || { log "no node $node"; exit 2; }
    for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do
        [[ -z "$(ip netns pids "$ns")" ]] && break
        sleep 0.1
    done
    log "killed every process of $node"
}

start_node() {
    local node=$1
    load_net
    ((NODES > 1)) || { log "start-node needs a multi-node cluster"; exit 2; }
    [[ -e /run/netns/$(ns_of "$node") ]] || { log "no node $node"; exit 2; }
    alive "$(pid_of "$(slurmd_pidfile "$node")")" || start_slurmd "$node"
    wait_idle "$node" || { log "$node did not become idle"; exit 1; }
    log "$node is back"
}

status() {
    local node pid
    load_net
    for name in slurmctld slurmdbd mariadb; do
        pid=$(pid_of "$dir/$name.pid")
        if alive "$pid"; then echo "$name: running (pid $pid)"; else echo "$name: stopped"; fi
    done
    echo "accounting: $ACCOUNTING"
    for node in $(node_names); do
        pid=$(pid_of "$(slurmd_pidfile "$node")")
        if alive "$pid"; then echo "slurmd $node: running (pid $pid)"; else echo "slurmd $node: stopped"; fi
    done
    sinfo 2>/dev/null || true
    squeue --states=all 2>/dev/null || true
}

case "$cmd" in
up) up "$arg" ;;
down) down ;;
status) status ;;
kill-node) [[ -n "$arg" ]] || usage; kill_node "$arg" ;;
start-node) [[ -n "$arg" ]] || usage; start_node "$arg" ;;
*) usage ;;
esac
