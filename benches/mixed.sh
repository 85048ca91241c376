#!/usr/bin/env bash
# Fenced writes under a flood of pass-through reads: two fencegates in turn, each with a GET
# flood (wrk, GET_CONNS connections) and fenced PUTs (wrk --latency, PUT_CONNS connections) at
# once, in interleaved rounds. Run by hand, not by CI. Prints per round each one's PUT rate,
# p50 and p99, and its GET rate. The two differ by config, binary, or both:
#
#   A_EXTRA='writer_scheduling = "normal"' benches/mixed.sh        # the writer's policy
#   B_BIN=/path/to/other/fencegate ROUNDS=5 benches/mixed.sh
#
# A_EXTRA and B_EXTRA are lines added to each one's [store] section. All on loopback: the
# backend nginx (WebDAV on tmpfs, one worker) on 127.0.0.1:18081, A on 18083, B on 18085, data
# dirs on disk, store.sync = "always". Everything it starts, it stops, by pid.
set -euo pipefail
source "$(dirname "$0")/common.sh" mixed
A_BIN=${A_BIN:-$TARGET_DIR/release/fencegate}
B_BIN=${B_BIN:-$A_BIN}
GET_CONNS=${GET_CONNS:-128}
PUT_CONNS=${PUT_CONNS:-16}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-6}
ROUNDS=${ROUNDS:-3}
bench_ports_free 18081 18083 18085
bench_backend
declare -A PORT=([A]=18083 [B]=18085) BIN=([A]=$A_BIN [B]=$B_BIN) EXTRA=([A]=${A_EXTRA:-} [B]=${B_EXTRA:-})
for t in A B; do
    bench_fencegate "$t" "${BIN[$t]}" "${PORT[$t]}" "${EXTRA[$t]}"
done
echo "A: $A_BIN ${A_EXTRA:-}"
echo "B: $B_BIN ${B_EXTRA:-}"
echo "GET flood over $GET_CONNS connections, PUTs over $PUT_CONNS, ${SECONDS_PER_RUN}s a run"
for round in $(seq "$ROUNDS"); do
    for t in A B; do
        url=http://127.0.0.1:${PORT[$t]}
        wrk -t1 -c"$GET_CONNS" -d"${SECONDS_PER_RUN}s" "$url/get/file" >"$SHM/get.out" &
        get=$!
        PIDS+=($get)
        put=$(wrk -t1 -c"$PUT_CONNS" -d"${SECONDS_PER_RUN}s" --latency -s "$SHM/put.lua" "$url/")
        wait $get
        bench_waited $get
        echo "$put" | awk -v t="$t" -v r="$round" -v g="$(awk '/^Requests/ {print $2}' "$SHM/get.out")" '
            /^Requests/ { rps = $2 } /^ +50%/ { p50 = $2 } /^ +99%/ { p99 = $2 } /Non-2xx/ { bad = $NF }
            END { printf "round %d %s: PUT %8.0f/s p50 %8s p99 %8s non-2xx %d   GET %8.0f/s\n", r, t, rps, p50, p99, bad, g }'
    done
done
