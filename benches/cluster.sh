#!/usr/bin/env bash
# Cluster benchmark (issues 18 and 38): fenced PUTs through the etcd store against the file
# store, and against the baseline of one compare-and-put transaction per write. Run by hand, not
# by CI:
#
#   benches/cluster.sh                           # 3 rounds of 8 s at 64 connections
#   ROUNDS=5 SECONDS_PER_RUN=10 CONNS="16 64 256" benches/cluster.sh
#   MAX_TXN_OPS=1024 benches/cluster.sh       # etcd's --max-txn-ops and store.max_txn_ops raised
#   WINDOWS="4 1" benches/cluster.sh          # a trio per store.batches_in_flight, interleaved
#   ETCD_DATA=shm benches/cluster.sh          # etcd's members on tmpfs: the no-disk limit
#   OLD_BIN=/tmp/old/fencegate OLD_CAS=/tmp/old/etcd_cas benches/cluster.sh
#                                             # and another build beside this one: its trio
#                                             # (window: the first of WINDOWS) and its cas
#
# What runs, all on loopback:
#   etcd      three members, data on disk (/var/tmp; tmpfs with ETCD_DATA=shm), the Debian
#             package's defaults                                                   18201-18203
#   backend   nginx serving WebDAV PUTs from tmpfs, 1 worker                         127.0.0.1:18091
#   file      fencegate with the file store, sync = "always", data on disk           127.0.0.1:18093
#   trios     for each W of WINDOWS (default "4"), three fencegates sharing one fence (a prefix
#             of their own) in the etcd cluster, store.batches_in_flight = W  127.0.0.1:18094-18105
# Targets, in interleaved rounds so that the machine's noise falls on each alike:
#   cas       examples/etcd_cas: CONNS clients, each write one If(value < token) Then(put)
#             transaction against etcd, and nothing else: the per-write design's floor
#   file      wrk against the file store's fencegate
#   etcd-1/W  wrk against the leader of trio W
#   etcd-f/W  wrk against a follower of trio W, which forwards every write to the leader
#   etcd-3/W  three wrk at once, one per instance of trio W, CONNS/3 connections each; req/s
#             summed, p50 and p99 the worst of the three
#   cas-old, etcd-1/old, etcd-f/old   with OLD_BIN: the same through the other build (its trio
#             on the prefix /bench-old/, ports after the last trio's)
# Every PUT is 100 bytes to one of 333 resources of the wrk's own (999 for etcd-3's three), with
# tokens climbing per resource. It prints each run, then per target and connection count the
# median req/s, p50 and p99, the ratios to cas and to file, and the CPU a request cost etcd's
# three members, the target's fencegates and the backend (from /proc, over the run). Everything it starts, it stops,
# by pid. The scratch dirs, the backend, put.lua and the cleanup are benches/common.sh's; it
# stops at once if one of its ports (those above, etcd's peers on 18211-18213 and the
# fencegates' admin ports 19093-19105) is taken.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-8}
CONNS=${CONNS:-64}
MAX_TXN_OPS=${MAX_TXN_OPS:-128}
read -r -a WINDOWS <<<"${WINDOWS:-4}"
# Trio k: its name (its window, or "old"), window and binary.
TRIO_NAME=("${WINDOWS[@]}"); TRIO_W=("${WINDOWS[@]}"); TRIO_BIN=()
for k in "${!WINDOWS[@]}"; do TRIO_BIN[k]=""; done
if [ -n "${OLD_BIN:-}" ]; then
    TRIO_NAME+=(old); TRIO_W+=("${WINDOWS[0]}"); TRIO_BIN+=("$OLD_BIN")
fi
ETCD_DATA=${ETCD_DATA:-disk}
# ROOT, TARGET_DIR, NGINX; SHM (the backend's files: tmpfs) and DISK (the data dirs and logs of
# etcd and fencegate: a real disk); PIDS, stopped at exit; the backend and put.lua.
source "$(dirname "$0")/common.sh" cluster
BIN=${FG_BIN:-$TARGET_DIR/release/fencegate}
CAS=$TARGET_DIR/release/examples/etcd_cas
ETCD=/usr/bin/etcd

for tool in wrk "$NGINX" "$ETCD"; do
    command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install wrk nginx-light etcd-server)" >&2; exit 1; }
done
[ -x "$BIN" ] && [ -x "$CAS" ] || { echo "build first: cargo build --release --bin fencegate --example etcd_cas" >&2; exit 1; }
[ -z "${OLD_BIN:-}" ] || [ -x "${OLD_CAS:-}" ] || { echo "OLD_BIN needs OLD_CAS, that build's etcd_cas" >&2; exit 1; }

# The backend, the fencegates (and their admin ports), etcd's clients and peers.
ports=(18091 18093 19093 18201 18202 18203 18211 18212 18213)
for k in "${!TRIO_NAME[@]}"; do
    for i in 0 1 2; do ports+=($((18094 + 3 * k + i)) $((19094 + 3 * k + i))); done
done
bench_ports_free "${ports[@]}"
case $ETCD_DATA in
    disk) ETCD_DIR=$DISK ;;
    shm) ETCD_DIR=$SHM ;;
    *) echo "ETCD_DATA is disk or shm" >&2; exit 1 ;;
esac

# etcd: three members.
ETCD_PIDS=()
cluster="m0=http://127.0.0.1:18211,m1=http://127.0.0.1:18212,m2=http://127.0.0.1:18213"
for i in 0 1 2; do
    "$ETCD" --name "m$i" --data-dir "$ETCD_DIR/etcd-$i" \
        --listen-client-urls "http://127.0.0.1:1820$((i + 1))" --advertise-client-urls "http://127.0.0.1:1820$((i + 1))" \
        --listen-peer-urls "http://127.0.0.1:1821$((i + 1))" --initial-advertise-peer-urls "http://127.0.0.1:1821$((i + 1))" \
        --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token fg-bench \
        --max-txn-ops "$MAX_TXN_OPS" \
        >"$DISK/etcd-$i.log" 2>&1 &
    PIDS+=($!); ETCD_PIDS+=($!)
done
ENDPOINTS='"http://127.0.0.1:18201", "http://127.0.0.1:18202", "http://127.0.0.1:18203"'
for _ in $(seq 200); do
    curl -sf http://127.0.0.1:18201/health | grep -q '"true"' && break
    sleep 0.1
done

# The backend.
bench_backend 18091
bench_worker "$BACKEND_PID"
NGINX_WORKER=$WORKER

common() { # PORT ADMIN
    printf '[server]\nlisten = "127.0.0.1:%s"\n[backend]\nurl = "http://127.0.0.1:18091"\n[log]\nlevel = "warn"\n[admin]\nlisten = "127.0.0.1:%s"\n' "$1" "$2"
}
{ common 18093 19093; printf '[store]\ndir = "%s"\nsync = "always"\n' "$DISK/file"; } >"$SHM/file.toml"
"$BIN" init --dir "$DISK/file" >/dev/null
"$BIN" run --config "$SHM/file.toml" 2>"$DISK/file.log" & FG_FILE=$!; PIDS+=($FG_FILE)
bench_wait "$FG_FILE" 18093 "$DISK/file.log"
# Trio k (window W): instances on 18094+3k..18096+3k, prefix /bench-W/. LEADER[k] and
# FOLLOWER[k] are the ports of its leader and of one follower.
LEADER=(); FOLLOWER=(); TRIO_PIDS=()
for k in "${!TRIO_NAME[@]}"; do
    w=${TRIO_W[$k]} name=${TRIO_NAME[$k]} bin=${TRIO_BIN[$k]:-$BIN}
    pids=()
    for i in 0 1 2; do
        port=$((18094 + 3 * k + i))
        { common "$port" $((19094 + 3 * k + i))
          printf '[store]\nkind = "etcd"\nprefix = "/bench-%s/"\nadvertise = "http://127.0.0.1:%s"\nmax_txn_ops = %s\nbatches_in_flight = %s\n[etcd]\nendpoints = [%s]\n' \
              "$name" "$port" "$MAX_TXN_OPS" "$w" "$ENDPOINTS"
        } >"$SHM/etcd-$k-$i.toml"
    done
    "$bin" init --config "$SHM/etcd-$k-0.toml" >/dev/null
    for i in 0 1 2; do "$bin" run --config "$SHM/etcd-$k-$i.toml" 2>"$DISK/fg-etcd-$k-$i.log" & pids+=($!); PIDS+=($!); done
    # The leader: the instance whose metrics say it is the writer.
    leader=""
    for _ in $(seq 200); do
        for i in 0 1 2; do
            curl -sf "http://127.0.0.1:$((19094 + 3 * k + i))/metrics" 2>/dev/null | grep -q '^fencegate_store_role{role="writer"} 1' && leader=$i
        done
        [ -n "$leader" ] && break
        sleep 0.1
    done
    [ -n "$leader" ] || { echo "no instance of trio $name leads:" >&2; for f in "$DISK"/fg-etcd-$k-*.log "$DISK"/etcd-0.log; do tail -n 5 "$f" >&2; done; exit 1; }
    for i in 0 1 2; do bench_wait "${pids[$i]}" $((18094 + 3 * k + i)) "$DISK/fg-etcd-$k-$i.log"; done
    TRIO_PIDS[k]="${pids[*]}"
    LEADER[k]=$((18094 + 3 * k + leader))
    FOLLOWER[k]=$((18094 + 3 * k + (leader + 1) % 3))
done

# put.lua over 333 resources of the part PART, so that each concurrent wrk has resources of its
# own; the tokens, from the clock and a counter, climb per resource across runs.
wrk_run() { # PORT CONNS SECONDS PART -> "req/s p50_us p99_us non2xx"
    wrk -t1 -c"$2" -d"${3}s" --latency -s "$SHM/put.lua" "http://127.0.0.1:$1/" -- "$4" 333 | awk '
        function us(v) { if (v ~ /us$/) return v + 0; if (v ~ /ms$/) return v * 1000; if (v ~ /s$/) return v * 1000000; return v }
        /^ +50%/ { p50 = us($2) } /^ +99%/ { p99 = us($2) }
        /Requests\/sec/ { rps = $2 } /Non-2xx/ { bad = $NF }
        END { printf "%s %s %s %s\n", rps, p50, p99, bad + 0 }'
}

# CPU time (user + system, in clock ticks) the processes PIDS... have used so far.
ticks() {
    local p total=0
    for p in "$@"; do
        total=$((total + $(awk '{ print $14 + $15 }' "/proc/$p/stat")))
    done
    echo "$total"
}

# What etcd has done so far: "transactions puts+deletes", the transactions its members were
# sent (each by one) and the key operations its first member applied (every member applies
# every one).
applied() {
    local i
    for i in 1 2 3; do curl -sf "http://127.0.0.1:1820$i/metrics"; done | awk '
        /^grpc_server_handled_total.*grpc_method="Txn"/ { t += $2 }
        /^etcd_mvcc_put_total / && !p { o += $2; p = 1 } /^etcd_mvcc_delete_total / && !d { o += $2; d = 1 }
        END { printf "%d %d\n", t, o }'
}

# The fencegates a target runs through: none for cas, the file store's, or a trio's three.
target_pids() { # TARGET
    case $1 in
        cas|cas-old) ;;
        file) echo "$FG_FILE" ;;
        etcd-*) echo "${TRIO_PIDS[$(window_index "${1#*/}")]}" ;;
    esac
}

run() { # TARGET CONNS SECONDS -> "req/s p50 p99 failures"
    local k
    case $1 in
        cas) "$CAS" "http://127.0.0.1:18201,http://127.0.0.1:18202,http://127.0.0.1:18203" "$2" "$3" ;;
        cas-old) "$OLD_CAS" "http://127.0.0.1:18201,http://127.0.0.1:18202,http://127.0.0.1:18203" "$2" "$3" ;;
        file) wrk_run 18093 "$2" "$3" 0 ;;
        etcd-*)
            k=$(window_index "${1#*/}")
            case ${1%/*} in
                etcd-1) wrk_run "${LEADER[$k]}" "$2" "$3" 1 ;;
                etcd-f) wrk_run "${FOLLOWER[$k]}" "$2" "$3" 1 ;;
                etcd-3)
                    per=$(( ($2 + 2) / 3 ))
                    parts=()
                    for i in 0 1 2; do wrk_run $((18094 + 3 * k + i)) "$per" "$3" "$((i + 2))" >"$SHM/part-$i" & parts+=($!); done
                    for j in "${parts[@]}"; do wait "$j"; done
                    cat "$SHM"/part-* | awk '{ r += $1; if ($2 > p50) p50 = $2; if ($3 > p99) p99 = $3; b += $4 }
                        END { printf "%.0f %s %s %d\n", r, p50, p99, b }' ;;
            esac ;;
    esac
}

window_index() { # NAME -> its trio's index
    local k
    for k in "${!TRIO_NAME[@]}"; do [ "${TRIO_NAME[$k]}" = "$1" ] && { echo "$k"; return; }; done
}

TARGETS=(cas file)
for w in "${WINDOWS[@]}"; do TARGETS+=("etcd-1/$w" "etcd-f/$w" "etcd-3/$w"); done
[ -z "${OLD_BIN:-}" ] || TARGETS+=(cas-old etcd-1/old etcd-f/old)
RESULTS="$SHM/results.tsv"
: >"$RESULTS"
echo "cluster benchmark: $(nproc) CPUs, $(uname -r), rounds=$ROUNDS x ${SECONDS_PER_RUN}s, max_txn_ops=$MAX_TXN_OPS, windows ${WINDOWS[*]}, etcd data on $ETCD_DATA" >&2
for conns in $CONNS; do
    for target in "${TARGETS[@]}"; do run "$target" "$conns" 2 >/dev/null; done # warm-up
    for round in $(seq "$ROUNDS"); do
        for target in "${TARGETS[@]}"; do
            read -r -a fgs < <(target_pids "$target") || true
            read -r t0 o0 < <(applied)
            e0=$(ticks "${ETCD_PIDS[@]}"); f0=$(ticks "${fgs[@]}"); n0=$(ticks "$NGINX_WORKER")
            read -r rps p50 p99 bad < <(run "$target" "$conns" "$SECONDS_PER_RUN")
            # CPU µs per request: ticks / (req/s * seconds) * 1e6 / ticks per second.
            per() { awk -v t="$1" -v r="$rps" -v s="$SECONDS_PER_RUN" -v hz="$(getconf CLK_TCK)" \
                'BEGIN { printf "%.0f", (r > 0 ? t / (r * s) * 1e6 / hz : 0) }'; }
            ecpu=$(per $(($(ticks "${ETCD_PIDS[@]}") - e0)))
            fcpu=$(per $(($(ticks "${fgs[@]}") - f0)))
            ncpu=$(per $(($(ticks "$NGINX_WORKER") - n0)))
            read -r t1 o1 < <(applied)
            # etcd transactions and key operations (puts, deletes) per 100 requests.
            txns=$(awk -v n=$((t1 - t0)) -v r="$rps" -v s="$SECONDS_PER_RUN" 'BEGIN { printf "%.1f", (r > 0 ? n * 100 / (r * s) : 0) }')
            ops=$(awk -v n=$((o1 - o0)) -v r="$rps" -v s="$SECONDS_PER_RUN" 'BEGIN { printf "%.0f", (r > 0 ? n * 100 / (r * s) : 0) }')
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$target" "$conns" "$round" "$rps" "$p50" "$p99" "$bad" \
                "$ecpu" "$fcpu" "$ncpu" "$txns" "$ops" >>"$RESULTS"
            printf '  c=%-3s round %s %-9s %8.0f req/s  p50 %7.0f us  p99 %7.0f us  failed %s  CPU us/req etcd %s fencegate %s nginx %s  etcd txns/ops per 100 req %s/%s\n' \
                "$conns" "$round" "$target" "$rps" "$p50" "$p99" "$bad" "$ecpu" "$fcpu" "$ncpu" "$txns" "$ops" >&2
        done
    done
done

# Each trio's leader: its batches, the advances per batch, and the batches etcd took out of order.
for k in "${!TRIO_NAME[@]}"; do
    curl -sf "http://127.0.0.1:$((LEADER[k] + 1000))/metrics" | awk -v w="${TRIO_NAME[$k]}" '
        /^fencegate_store_batch_advances_sum/ { sum = $2 } /^fencegate_store_batch_advances_count/ { n = $2 }
        /^fencegate_store_batches_overtaken_total/ { over = $2 }
        END { printf "trio %s: %d batches, %.1f advances each, %d overtaken\n", w, n, (n ? sum / n : 0), over }' >&2
done
# etcd's members over the whole run: WAL fsyncs (count and mean), and proposals committed per
# fsync, which says how many transactions one Raft round carried.
for i in 0 1 2; do
    curl -sf "http://127.0.0.1:1820$((i + 1))/metrics" | awk -v m="$i" '
        /^etcd_disk_wal_fsync_duration_seconds_sum/ { sum = $2 } /^etcd_disk_wal_fsync_duration_seconds_count/ { n = $2 }
        /^etcd_server_proposals_committed_total/ { p = $2 }
        END { printf "etcd member %s: %d WAL fsyncs, %.2f ms each, %.1f proposals committed per fsync\n", m, n, (n ? sum / n * 1000 : 0), (n ? p / n : 0) }' >&2
done
echo
printf '| conns | target | req/s (median) | p50 µs | p99 µs | failed | × cas | × file | CPU µs/req etcd / fencegate / nginx | etcd txns / ops per 100 req |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n'
python3 - "$RESULTS" "${TARGETS[@]}" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = {}
for target, conns, _round, rps, p50, p99, bad, ecpu, fcpu, ncpu, txns, ops in rows:
    by.setdefault((int(conns), target), []).append(
        (float(rps), float(p50), float(p99), int(float(bad)), float(ecpu), float(fcpu), float(ncpu), float(txns), float(ops)))
for conns in sorted({c for c, _ in by}):
    cas = statistics.median(r[0] for r in by[(conns, "cas")])
    file = statistics.median(r[0] for r in by[(conns, "file")])
    for target in sys.argv[2:]:
        runs = by.get((conns, target), [])
        if not runs: continue
        rps = statistics.median(r[0] for r in runs)
        p50 = statistics.median(r[1] for r in runs)
        p99 = statistics.median(r[2] for r in runs)
        bad = sum(r[3] for r in runs)
        cpu = " / ".join(f"{statistics.median(r[i] for r in runs):,.0f}" for i in (4, 5, 6))
        etcd = f"{statistics.median(r[7] for r in runs):.1f} / {statistics.median(r[8] for r in runs):.0f}"
        print(f"| {conns} | {target} | {rps:,.0f} | {p50:,.0f} | {p99:,.0f} | {bad} | {rps / cas:.2f} | {rps / file:.2f} | {cpu} | {etcd} |")
EOF
