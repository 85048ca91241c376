#!/usr/bin/env bash
# Load benchmark: fencegate against nginx as a plain reverse proxy, and against the backend
# reached directly. Run by hand, not by CI (at its defaults it needs about 25 minutes of a quiet
# machine):
#
#   benches/load.sh                      # 3 rounds of 10 s, at 1, 32, 64, 128 and 256 connections
#   ROUNDS=5 SECONDS_PER_RUN=10 CONNS="32 64" WORKLOADS="get" benches/load.sh
#   FLOOR=1 benches/load.sh              # and a bare hyper proxy beside them (below)
#   DURABLE_FLOOR=1 benches/load.sh      # and a bare hyper proxy that makes each PUT durable (below)
#   BASE_BIN=/path/to/old/fencegate CONNS="32 256" benches/load.sh   # and another build (below)
#
# What runs, all on loopback:
#   backend   nginx serving WebDAV (PUT, DELETE) from tmpfs, 1 worker          127.0.0.1:18081
#   nginx     nginx as a reverse proxy to it, 1 worker, upstream keepalive pool 127.0.0.1:18082
#   fencegate the release binary, store.sync = "always", data dir on disk      127.0.0.1:18083
# and wrk with one thread (-t1 --latency), in interleaved rounds (direct, nginx, fencegate,
# direct, ...) so that the machine's noise falls on every target alike. Workloads:
#   get  GET of a 1 KiB file: pass-through, nothing fenced
#   put  PUT of 100 bytes over 1,000 resources, tokens strictly increasing per resource: through
#        fencegate each is a fenced write made durable (fdatasync, group commit) before it is
#        forwarded; nginx and direct just write the file.
# It prints, per workload and connection count, the median req/s, p50 and p99 of the rounds,
# the ratios to direct and to nginx, CPU time per request of the backend's nginx worker (for
# direct), of the proxy's worker and of fencegate (all its threads, and its serving thread), the
# machine's idle CPU during each target's runs, and fencegate's mean batch and sync time (from
# its metrics); then fencegate's idle RSS and its peak RSS under load. Everything it starts, it
# stops, by pid. The pieces it shares with the other bench scripts (scratch dirs, the backend,
# the proxy, put.lua, cleanup) are benches/common.sh's; it stops at once if one of its ports
# (its targets' below and above, and the admin ports 18183 and, with BASE_BIN, 18185) is taken.
#
# FLOOR=1 adds a target, examples/hyper_floor/ on 127.0.0.1:18084: the least a hyper
# reverse proxy does (hyper's HTTP/1 server and client connections on one current-thread
# runtime, a list of idle backend connections), without anything else fencegate does: no
# fencing, timeouts, HTTP/2 detection, header rewriting, metrics or logging. Against it,
# fencegate's own share of the cost shows. A PUT through it is forwarded unfenced, unsynced.
#
# DURABLE_FLOOR=1 adds the same floor with a log on fencegate's data disk, on 127.0.0.1:18086:
# each PUT appends a record and waits for its group commit (a writer thread, one pwrite and one
# fdatasync a batch, answers back with one wake-up a batch) before it is forwarded, and nothing
# else; its writer is scheduled as fencegate's (SCHED_BATCH under load). It is about the least
# a durable proxy built on hyper pays on this disk; fencegate against it is what fencing costs,
# with fencegate's own log upkeep (segments, answered records). With OPEN_LOOP=1 it runs
# open-loop beside fencegate too.
#
# BASE_BIN=PATH adds another target on 127.0.0.1:18085: another fencegate binary (an earlier
# commit's, say), configured alike with a data dir of its own, measured in the same
# interleaved rounds, so that a change is compared with its baseline under the same noise.
#
# OPEN_LOOP=1 then runs PUTs open-loop (examples/open_loop.rs: requests at a fixed rate, each
# one's latency from when it was due, so a stall is charged for every request it held up) at
# 50% and 80% of the highest PUT rate nginx reached in the closed-loop runs (OPEN_RATES="0.5
# 0.8"), over OPEN_CONNS connections (64; a request due while all are busy waits for one, and
# that wait counts), against nginx and fencegate in turn; and it measures
# one fdatasync on fencegate's data disk (a 100-byte write and its sync, 2,000 times), so that
# fencegate's latency over nginx's can be read against the sync it must wait for.
#
# FG_EXTRA_CONFIG and BASE_EXTRA_CONFIG are TOML merged into fencegate's and the baseline's
# config (a key given there replaces the script's; the script's own is [server] listen,
# [backend] url, [store] dir and sync = "always", [log] level = "warn", [admin] listen), so
# the two can differ by config as well as by binary (merging needs Python 3.11's tomllib).
# No access log against the access log, with the same binary (at level "warn" it writes
# nothing, so the level goes with it):
#   FG_EXTRA_CONFIG=$'[log]\nlevel = "info"' BASE_BIN=target/release/fencegate \
#   BASE_EXTRA_CONFIG=$'[log]\nlevel = "info"\naccess = true' benches/load.sh
# SIGNED=1 signs every PUT's token (`verify = "hmac"`, docs/tokens.md): fencegate checks the
# signature under a rule for "/" it adds (so FG_EXTRA_CONFIG must have no rule of its own over
# /put/; tokens are signed for the domain "default"); the other targets get the same requests
# and ignore it. A run's n-th request goes to resource n % 1000 with token base + n / 1000
# (rounded down; base: the time just before the run, in ms), so each token is signed once,
# ahead of the run (Python's hmac), and put.lua's variant ($SHM/signed.lua) reads the
# signatures from $SHM/sigs.lua. With BASE_BIN the same binary, this is verification on
# against off:
#   SIGNED=1 BASE_BIN=target/release/fencegate WORKLOADS=put benches/load.sh
# Each fencegate's stderr goes to a file on the data disk (/var/tmp/fencegate-load.*/logs/,
# removed at the end), as an operator's log file would; at the end the script prints each
# file's lines and size, and the lines its log's queue dropped (from /metrics).
set -euo pipefail

ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
CONNS=${CONNS:-"1 32 64 128 256"}
WORKLOADS=${WORKLOADS:-"get put"}

# ROOT, TARGET_DIR, NGINX; SHM (the backend's files: tmpfs) and DISK (fencegate's data dirs and
# logs: a real disk); PIDS, stopped at exit; the backend, the proxy and put.lua.
source "$(dirname "$0")/common.sh" load
bench_tools
BIN=${FG_BIN:-$TARGET_DIR/release/fencegate}
if [ -z "${FG_BIN:-}" ]; then
    (cd "$ROOT" && cargo build --release --quiet)
fi
TARGETS=(direct nginx fencegate)
if [ "${FLOOR:-0}" = 1 ] || [ "${DURABLE_FLOOR:-0}" = 1 ]; then
    (cd "$ROOT" && cargo build --release --quiet --example hyper_floor)
fi
if [ "${FLOOR:-0}" = 1 ]; then TARGETS+=(hyper); fi
if [ "${DURABLE_FLOOR:-0}" = 1 ]; then TARGETS+=(durable); fi
if [ "${OPEN_LOOP:-0}" = 1 ]; then
    (cd "$ROOT" && cargo build --release --quiet --example open_loop)
fi
if [ -n "${BASE_BIN:-}" ]; then
    [ -x "$BASE_BIN" ] || { echo "BASE_BIN=$BASE_BIN is not an executable" >&2; exit 1; }
    TARGETS+=(baseline)
fi
declare -A PORT=([direct]=18081 [nginx]=18082 [fencegate]=18083 [hyper]=18084 [baseline]=18085 [durable]=18086)

ports=()
for target in "${TARGETS[@]}"; do ports+=("${PORT[$target]}"); done
bench_ports_free "${ports[@]}" 18183 ${BASE_BIN:+18185} # and the admin ports

mkdir -p "$DISK/logs" "$DISK/data" "$DISK/base"
# A new deployment's data dir, as `fencegate init` makes it (`run` refuses an empty one);
# builds from before `init` existed start an empty one themselves.
init_data_dir() { # BINARY DIR
    if "$1" help init >/dev/null 2>&1; then "$1" init --dir "$2" >/dev/null; fi
}
init_data_dir "$BIN" "$DISK/data"
if [ -n "${BASE_BIN:-}" ]; then init_data_dir "$BASE_BIN" "$DISK/base"; fi
# Writes $SHM/NAME.toml: the script's config for a fencegate on PORT (admin on ADMIN) with its
# data in DIR, EXTRA (TOML) merged over it, table by table.
fg_config() { # NAME PORT ADMIN DIR EXTRA
    python3 - "$2" "$3" "$4" "$5" >"$SHM/$1.toml" <<'EOF'
import json, re, sys
port, admin, data, extra = sys.argv[1:]
conf = {"server": {"listen": f"127.0.0.1:{port}"}, "backend": {"url": "http://127.0.0.1:18081"},
        "store": {"dir": data, "sync": "always"}, "log": {"level": "warn"},
        "admin": {"listen": f"127.0.0.1:{admin}"}}
def merge(into, over):
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict): merge(into[k], v)
        else: into[k] = v
if extra.strip():
    import tomllib  # Python 3.11
    merge(conf, tomllib.loads(extra))
key = lambda k: k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)
def value(v):
    if isinstance(v, list): return "[" + ", ".join(map(value, v)) + "]"
    if isinstance(v, dict): return "{" + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v) if isinstance(v, (str, bool, int, float)) else v.isoformat()
tables = lambda v: isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
def emit(table, path, header):
    if header: print(header)
    for k, v in table.items():
        if not isinstance(v, dict) and not tables(v): print(f"{key(k)} = {value(v)}")
    for k, v in table.items():
        name = ".".join(map(key, path + [k]))
        if isinstance(v, dict): emit(v, path + [k], f"[{name}]")
        elif tables(v):
            for item in v: emit(item, path + [k], f"[[{name}]]")
emit(conf, [], None)
EOF
}
FG_EXTRA_CONFIG=${FG_EXTRA_CONFIG:-}
if [ "${SIGNED:-0}" = 1 ]; then
    [ "${OPEN_LOOP:-0}" = 1 ] && { echo "SIGNED=1 with OPEN_LOOP=1: open_loop sends no signatures" >&2; exit 1; }
    head -c 32 /dev/urandom | base64 | tr -d '\n' >"$SHM/hmac.key"
    FG_EXTRA_CONFIG+=$'\n[[fence.rules]]\nprefix = "/"\nverify = "hmac"\n[[verify.hmac_keys]]\nid = "bench"\n'
    FG_EXTRA_CONFIG+="secret_file = \"$SHM/hmac.key\""
    cat >"$SHM/signed.lua" <<LUA
local n = 0
local body = string.rep("v", 100)
dofile("$SHM/sigs.lua") -- base, and sigs[k]: the signature of token base + k
request = function()
    n = n + 1
    local k = math.floor(n / 1000)
    return wrk.format("PUT", "/put/r" .. (n % 1000),
        { ["Fencing-Token"] = string.format("%.0f", base + k),
          ["Fencing-Token-Signature"] = sigs[k] or error("no signature for token base + " .. k) }, body)
end
LUA
fi
# Before each signed run: $SHM/sigs.lua with a new base (above every earlier run's tokens) and
# the signatures of base + 0 ... base + 4,999 (5,000,000 PUTs).
sign_tokens() {
    python3 - "$SHM/hmac.key" >"$SHM/sigs.lua" <<'PY'
import base64, hashlib, hmac, sys, time
key = open(sys.argv[1], "rb").read().rstrip(b" \t\r\n\f")
base, expiry = time.time_ns() // 1_000_000, int(time.time()) + 3600
print(f"base = {base}\nsigs = {{}}")
for k in range(5000):
    mac = hmac.new(key, f"v1\nbench\ndefault\n{base + k}\n{expiry}".encode(), hashlib.sha256).digest()
    print(f'sigs[{k}] = "v1.bench.{expiry}.{base64.urlsafe_b64encode(mac).rstrip(b"=").decode()}"')
PY
}
fg_config fencegate 18083 18183 "$DISK/data" "$FG_EXTRA_CONFIG"
fg_config baseline 18085 18185 "$DISK/base" "${BASE_EXTRA_CONFIG:-}"

bench_backend
bench_proxy
"$BIN" run --config "$SHM/fencegate.toml" 2>"$DISK/logs/fencegate.log" & FG=$!; PIDS+=($FG)
bench_wait "$FG" "${PORT[fencegate]}" "$DISK/logs/fencegate.log"
declare -A PID=([fencegate]=$FG)
if [ -n "${BASE_BIN:-}" ]; then
    "$BASE_BIN" run --config "$SHM/baseline.toml" 2>"$DISK/logs/baseline.log" & PID[baseline]=$!; PIDS+=($!)
    bench_wait "${PID[baseline]}" "${PORT[baseline]}" "$DISK/logs/baseline.log"
fi
if [ "${FLOOR:-0}" = 1 ]; then
    "$TARGET_DIR/release/examples/hyper_floor" 127.0.0.1:18084 127.0.0.1:18081 2>"$SHM/logs/hyper.log" &
    PID[hyper]=$!; PIDS+=($!)
    bench_wait "${PID[hyper]}" "${PORT[hyper]}" "$SHM/logs/hyper.log"
fi
if [ "${DURABLE_FLOOR:-0}" = 1 ]; then
    "$TARGET_DIR/release/examples/hyper_floor" 127.0.0.1:18086 127.0.0.1:18081 "$DISK/durable.log" 2>"$SHM/logs/durable.log" &
    PID[durable]=$!; PIDS+=($!)
    bench_wait "${PID[durable]}" "${PORT[durable]}" "$SHM/logs/durable.log"
fi
sleep 1
kill -0 "$FG" 2>/dev/null || { echo "fencegate did not start:" >&2; cat "$DISK/logs/fencegate.log" >&2; exit 1; }
# nginx's CPU is its worker's (the master only watches it): the proxy's for the nginx target,
# the backend's for direct, where the backend is the server under test.
bench_worker "$BACKEND_PID"
PID[nginx]=$PROXY_PID PID[direct]=$WORKER
idle_rss=$(awk '/VmRSS/ {print $2}' /proc/$FG/status)

# A process's CPU ticks (user + system), then its user ticks alone: what the server's own code
# costs, apart from the kernel's share (system calls, wake-ups, the network stack).
cpu_ticks() { awk '{print $14 + $15, $14}' "/proc/$1/stat"; }
# The same of a process's first thread alone: fencegate's serving thread (its event loop) with
# server.workers = 1, the default; with more workers the column reads the main thread only.
main_ticks() { awk '{print $14 + $15, $14}' "/proc/$1/task/$1/stat"; }
# The machine's idle ticks (idle + iowait), all CPUs.
idle_ticks() { awk '/^cpu / {print $5 + $6}' /proc/stat; }
# fencegate's batches so far, from its metrics: "count advances sync_seconds".
batches() {
    { exec 3<>/dev/tcp/127.0.0.1/18183 && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 && cat <&3; } 2>/dev/null | awk '
        /^fencegate_store_batch_advances_count/ { c = $2 } /^fencegate_store_batch_advances_sum/ { a = $2 }
        /^fencegate_store_sync_duration_seconds_sum/ { t = $2 } END { printf "%d %d %.6f\n", c, a, t }'
}
RESULTS="$SHM/results.tsv"
: >"$RESULTS"

run_wrk() { # workload conns target seconds -> "req/s p50_us p99_us non2xx"
    local workload=$1 conns=$2 target=$3 secs=$4 url script=()
    url="http://127.0.0.1:${PORT[$target]}"
    if [ "$workload" = get ]; then
        url="$url/get/file"
    elif [ "${SIGNED:-0}" = 1 ]; then
        sign_tokens
        script=(-s "$SHM/signed.lua") url="$url/"
    else
        script=(-s "$SHM/put.lua") url="$url/"
    fi
    wrk -t1 -c"$conns" -d"${secs}s" --latency "${script[@]}" "$url" | awk '
        function us(v) { if (v ~ /us$/) return v + 0; if (v ~ /ms$/) return v * 1000; if (v ~ /s$/) return v * 1000000; return v }
        /^ +50%/ { p50 = us($2) } /^ +99%/ { p99 = us($2) }
        /Requests\/sec/ { rps = $2 } /Non-2xx/ { bad = $NF }
        END { printf "%s %s %s %s\n", rps, p50, p99, bad + 0 }'
}

peak_rss=0
echo "fencegate load benchmark: $(nproc) CPUs, $(uname -r), rounds=$ROUNDS x ${SECONDS_PER_RUN}s" >&2
for workload in $WORKLOADS; do
    for conns in $CONNS; do
        for target in "${TARGETS[@]}"; do run_wrk "$workload" "$conns" "$target" 2 >/dev/null; done # warm-up
        for round in $(seq "$ROUNDS"); do
            for target in "${TARGETS[@]}"; do
                pid=${PID[$target]:-$FG} # CPU of the server under test
                read -r before user_before < <(cpu_ticks "$pid")
                read -r main_before main_user_before < <(main_ticks "$pid")
                idle_before=$(idle_ticks)
                read -r b_count b_adv b_secs < <(batches)
                read -r rps p50 p99 bad < <(run_wrk "$workload" "$conns" "$target" "$SECONDS_PER_RUN")
                read -r after user_after < <(cpu_ticks "$pid")
                read -r main_after main_user_after < <(main_ticks "$pid")
                idle=$(( $(idle_ticks) - idle_before ))
                cpu=$((after - before)) user=$((user_after - user_before))
                main=$((main_after - main_before)) main_user=$((main_user_after - main_user_before))
                read -r a_count a_adv a_secs < <(batches)
                sync_us=$(awk -v a="$a_secs" -v b="$b_secs" -v n=$((a_count - b_count)) 'BEGIN { print n ? (a - b) / n * 1e6 : 0 }')
                rss=$(awk '/VmHWM/ {print $2}' /proc/$FG/status)
                [ "$rss" -gt "$peak_rss" ] && peak_rss=$rss
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
                    "$workload" "$conns" "$round" "$target" "$rps" "$p50" "$p99" "$bad" "$cpu" "$idle" \
                    "$((a_count - b_count))" "$((a_adv - b_adv))" "$sync_us" "$main" "$user" "$main_user" >>"$RESULTS"
                printf '  %-4s c=%-3s round %s %-9s %9.0f req/s  p50 %7.0f us  p99 %7.0f us  non-2xx %s\n' \
                    "$workload" "$conns" "$round" "$target" "$rps" "$p50" "$p99" "$bad" >&2
            done
        done
    done
done

OPEN="$SHM/open.tsv"
: >"$OPEN"
if [ "${OPEN_LOOP:-0}" = 1 ] && grep -q '^put' "$RESULTS"; then
    # The highest closed-loop PUT rate nginx reached, over every connection count.
    nginx_max=$(awk -F'\t' '$1 == "put" && $4 == "nginx" && $5 > m { m = $5 } END { printf "%.0f", m }' "$RESULTS")
    for share in ${OPEN_RATES:-0.5 0.8}; do
        rate=$(awk -v m="$nginx_max" -v s="$share" 'BEGIN { printf "%.0f", m * s }')
        for round in $(seq "$ROUNDS"); do
            for target in nginx fencegate ${BASE_BIN:+baseline} ${PID[durable]:+durable}; do
                pid=${PID[$target]:-$FG} # CPU of the server under test
                read -r before _ < <(cpu_ticks "$pid")
                # A run that printed nothing (the generator failed) is reported, not fatal: the
                # closed-loop tables below still print.
                read -r sent ok non2xx errors achieved p50 p90 p99 max queued late < <("$TARGET_DIR/release/examples/open_loop" \
                    "http://127.0.0.1:${PORT[$target]}" "$rate" "$SECONDS_PER_RUN" "${OPEN_CONNS:-64}" put || true) ||
                    { echo "  open loop against $target printed nothing" >&2; continue; }
                read -r after _ < <(cpu_ticks "$pid")
                cpu=$((after - before))
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$share" "$rate" "$target" "$sent" "$ok" \
                    "$((non2xx + errors))" "$achieved" "$p50" "$p90" "$p99" "$max" "$queued" "$late" "$cpu" >>"$OPEN"
                printf '  open loop %s x %s = %s PUT/s round %s %-9s p50 %6s us  p99 %7s us  queued p50 %s us  failed %s\n' \
                    "$share" "$nginx_max" "$rate" "$round" "$target" "$p50" "$p99" "$queued" "$((non2xx + errors))" >&2
            done
        done
    done
    # One fdatasync of a small append on the data disk, as fencegate's log does it.
    python3 - "$DISK/sync-probe" >"$SHM/sync.txt" <<'EOF'
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"\0" * (4 << 20), 0); os.fsync(fd)  # written ahead, as the log's zeros are
times = []
for i in range(2000):
    t = time.perf_counter(); os.pwrite(fd, b"r" * 100, i * 100); os.fdatasync(fd); times.append(time.perf_counter() - t)
times.sort()
print(f"{times[len(times) // 2] * 1e6:.0f} {times[int(len(times) * 0.99)] * 1e6:.0f}")
EOF
fi

python3 - "$RESULTS" "$(getconf CLK_TCK)" "$idle_rss" "$peak_rss" "$SECONDS_PER_RUN" "$(nproc)" <<'EOF'
import sys, statistics
from collections import defaultdict
path, hz, idle, peak, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
ncpu = int(sys.argv[6])
runs = defaultdict(list)
for line in open(path):
    w, c, r, t, rps, p50, p99, bad, cpu, idle_ticks, batches, advances, sync_us, main, user, main_user = line.split("\t")
    runs[(w, int(c), t)].append((float(rps), float(p50), float(p99), int(bad), int(cpu), int(idle_ticks),
                                 int(batches), int(advances), float(sync_us), int(main), int(user), int(main_user)))
med = lambda xs: statistics.median(xs)
# CPU µs per request over a target's rounds, from field i (4: all threads, 9: the first thread;
# 10 and 11: their user time alone).
per_req = lambda r, i=4: sum(x[i] for x in r) / hz / max(1.0, sum(x[0] for x in r) * secs) * 1e6
print("| workload | conns | direct req/s | nginx req/s | fencegate req/s | fg/direct | fg/nginx | nginx/direct "
      "| p50 direct / nginx / fg (µs) | p99 direct / nginx / fg (µs) | CPU µs/req backend (direct) / nginx / fg (serving thread) | fg − nginx CPU "
      "| of it user µs/req nginx / fg (serving thread) | machine idle % direct / nginx / fg | fg batch (advances) / sync (µs) | non-2xx |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for w, c in sorted({(w, c) for (w, c, _) in runs}, key=lambda k: (k[0], k[1])):
    d, n, f = (runs[(w, c, t)] for t in ("direct", "nginx", "fencegate"))
    rps = [med([x[0] for x in r]) for r in (d, n, f)]
    p50 = [med([x[1] for x in r]) for r in (d, n, f)]
    p99 = [med([x[2] for x in r]) for r in (d, n, f)]
    bad = sum(x[3] for r in (d, n, f) for x in r)
    cpu_direct, cpu_nginx, cpu_fg, cpu_serving = per_req(d), per_req(n), per_req(f), per_req(f, 9)
    # Idle share of all CPUs during the runs (100% = every CPU idle the whole time).
    idle_pct = [med([x[5] / hz / secs / ncpu * 100 for x in r]) for r in (d, n, f)]
    n_batches = sum(x[6] for x in f)
    batch = f"{sum(x[7] for x in f) / n_batches:.1f} / {med([x[8] for x in f if x[6]]):.0f}" if n_batches else "–"
    print(f"| {w} | {c} | {rps[0]:,.0f} | {rps[1]:,.0f} | {rps[2]:,.0f} | {rps[2]/rps[0]:.2f} | {rps[2]/rps[1]:.2f} "
          f"| {rps[1]/rps[0]:.2f} | {p50[0]:.0f} / {p50[1]:.0f} / {p50[2]:.0f} | {p99[0]:.0f} / {p99[1]:.0f} / {p99[2]:.0f} "
          f"| {cpu_direct:.1f} / {cpu_nginx:.1f} / {cpu_fg:.1f} ({cpu_serving:.1f}) | {cpu_fg - cpu_nginx:+.1f} "
          f"| {per_req(n, 10):.1f} / {per_req(f, 10):.1f} ({per_req(f, 11):.1f}) "
          f"| {idle_pct[0]:.0f} / {idle_pct[1]:.0f} / {idle_pct[2]:.0f} | {batch} | {bad} |")
for w in sorted({w for (w, _, _) in runs}):
    if (w, 1, "direct") in runs:
        d, n, f = (med([x[1] for x in runs[(w, 1, t)]]) for t in ("direct", "nginx", "fencegate"))
        print(f"\n{w}, 1 connection: latency added over direct (p50): nginx {n - d:.0f} µs, fencegate {f - d:.0f} µs")
floors = [t for t in ("hyper", "durable") if any(t == u for (_, _, u) in runs)]
if floors:
    print("\n| workload | conns | floor | floor req/s | fg/floor | floor/nginx | p50 floor / fg (µs) | p99 floor / fg (µs) "
          "| CPU µs/req nginx / floor / fg | floor − nginx CPU | fg − floor CPU | user µs/req nginx / floor / fg | floor non-2xx |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w, c, t in sorted({(w, c, t) for (w, c, t) in runs if t in floors}):
        n, f, h = (runs[(w, c, u)] for u in ("nginx", "fencegate", t))
        rps = [med([x[0] for x in r]) for r in (n, f, h)]
        cpu = [per_req(r) for r in (n, h, f)]
        user = [per_req(r, 10) for r in (n, h, f)]
        p50, p99 = ([med([x[i] for x in r]) for r in (h, f)] for i in (1, 2))
        name = "hyper" if t == "hyper" else "hyper + log"
        print(f"| {w} | {c} | {name} | {rps[2]:,.0f} | {rps[1]/rps[2]:.2f} | {rps[2]/rps[0]:.2f} | {p50[0]:.0f} / {p50[1]:.0f} "
              f"| {p99[0]:.0f} / {p99[1]:.0f} | {cpu[0]:.1f} / {cpu[1]:.1f} / {cpu[2]:.1f} | {cpu[1] - cpu[0]:+.1f} "
              f"| {cpu[2] - cpu[1]:+.1f} | {user[0]:.1f} / {user[1]:.1f} / {user[2]:.1f} | {sum(x[3] for x in h)} |")
if any(t == "baseline" for (_, _, t) in runs):
    print("\n| workload | conns | baseline req/s | fencegate req/s | fg/baseline | p50 baseline / fg (µs) "
          "| p99 baseline / fg (µs) | CPU µs/req baseline / fg | machine idle % baseline / fg | baseline non-2xx |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w, c in sorted({(w, c) for (w, c, t) in runs if t == "baseline"}):
        b, f = (runs[(w, c, t)] for t in ("baseline", "fencegate"))
        rps = [med([x[0] for x in r]) for r in (b, f)]
        cpu = [per_req(r) for r in (b, f)]
        p50, p99 = ([med([x[i] for x in r]) for r in (b, f)] for i in (1, 2))
        idle_pct = [med([x[5] / hz / secs / ncpu * 100 for x in r]) for r in (b, f)]
        print(f"| {w} | {c} | {rps[0]:,.0f} | {rps[1]:,.0f} | {rps[1]/rps[0]:.2f} | {p50[0]:.0f} / {p50[1]:.0f} "
              f"| {p99[0]:.0f} / {p99[1]:.0f} | {cpu[0]:.1f} / {cpu[1]:.1f} | {idle_pct[0]:.0f} / {idle_pct[1]:.0f} "
              f"| {sum(x[3] for x in b)} |")
print(f"\nfencegate RSS: idle {idle / 1024:.1f} MB, peak under load {peak / 1024:.1f} MB")
EOF
if [ -s "$OPEN" ]; then
    python3 - "$OPEN" "$SHM/sync.txt" "$(getconf CLK_TCK)" <<'EOF'
import sys, statistics
from collections import defaultdict
hz = int(sys.argv[3])
runs = defaultdict(list)
for line in open(sys.argv[1]):
    share, rate, target, sent, ok, failed, achieved, p50, p90, p99, mx, queued, late, cpu = line.split("\t")
    runs[(float(share), int(rate), target)].append([float(x) for x in (achieved, p50, p90, p99, mx, queued, failed, late, cpu, sent)])
sync_p50, sync_p99 = map(float, open(sys.argv[2]).read().split())
print(f"\nOpen loop (examples/open_loop.rs, latency from each request's due time); one fdatasync on the "
      f"data disk: p50 {sync_p50:.0f} µs, p99 {sync_p99:.0f} µs")
print("\n| share of nginx's max | PUT/s | target | achieved | p50 (µs) | p90 (µs) | p99 (µs) | max (µs) "
      "| queued p50 (µs) | schedule late p50 (µs) | failed | p50 − nginx's (µs) | p50 budget: sync p50 + 50 (µs) "
      "| CPU µs/req (all threads) |")
print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
med = lambda r, i: statistics.median(x[i] for x in r)
for (share, rate, target) in sorted(runs, key=lambda k: (k[0], k[2] != "nginx", k[2])):
    r, n = runs[(share, rate, target)], runs[(share, rate, "nginx")]
    gap = "" if target == "nginx" else f"{med(r, 1) - med(n, 1):+.0f}"
    budget = "" if target == "nginx" else f"{sync_p50 + 50:.0f}"
    print(f"| {share:.0%} | {rate:,} | {target} | {med(r, 0):,.0f} | {med(r, 1):.0f} | {med(r, 2):.0f} | {med(r, 3):.0f} "
          f"| {med(r, 4):.0f} | {med(r, 5):.0f} | {med(r, 7):.0f} | {sum(x[6] for x in r):.0f} | {gap} | {budget} "
          f"| {sum(x[8] for x in r) / hz / max(1.0, sum(x[9] for x in r)) * 1e6:.1f} |")
EOF
fi
# What each fencegate wrote to its log, and what its log's queue dropped (a dropped line is a
# line's cost not paid, so a run that drops many understates the access log's).
for target in fencegate baseline; do
    [ -n "${PID[$target]:-}" ] || continue
    log="$DISK/logs/$target.log"
    dropped=$({ exec 3<>/dev/tcp/127.0.0.1/$((PORT[$target] + 100)) && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 &&
        cat <&3; } 2>/dev/null | awk '/^fencegate_log_lines_dropped/ { print $2 }')
    awk -v t="$target" -v n="$(wc -l <"$log")" -v b="$(stat -c %s "$log")" -v d="${dropped:-?}" \
        'BEGIN { printf "%s log: %d lines, %.1f MB, %s lines dropped\n", t, n, b / 1048576, d }'
done
