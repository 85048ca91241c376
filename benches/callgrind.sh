#!/usr/bin/env bash
# Callgrind instructions per request: a pass-through GET of a 1 KiB file and a fenced 100-byte
# PUT (put.lua), each binary in BINS (default: the release build) in a process of its own per
# workload, `wrk -t1 -c8` for SECONDS_PER_RUN seconds, minus a run of the same binary that
# serves nothing (start-up and shutdown). Instructions are the machine's least noisy measure:
# two builds compared here differ by their code, not by the load on the machine.
#
#   BINS="target/release/fencegate /path/to/old/fencegate" benches/callgrind.sh
set -euo pipefail
# shellcheck source=benches/common.sh
source "$(dirname "$0")/common.sh" callgrind
trap bench_cleanup EXIT

bench_tools
command -v valgrind >/dev/null || {
    echo "installing valgrind with apt" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
}
if [ -z "${BINS:-}" ]; then
    (cd "$ROOT" && cargo build --release --bin fencegate)
    BINS=$TARGET_DIR/release/fencegate
fi
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
PORT=18085
bench_ports_free 18081 "$PORT"
mkdir -p "$SHM/logs" "$SHM/www/get"
head -c 1024 /dev/zero >"$SHM/www/get/file"
bench_backend

# Runs BIN under callgrind for WORKLOAD (get, put or idle); prints "INSTRUCTIONS REQUESTS".
measure() { # BIN WORKLOAD
    local name="cg-$2-$RANDOM" pid requests=0 total
    "$1" init --dir "$DISK/$name" >/dev/null
    printf '[server]\nlisten = "127.0.0.1:%s"\n[backend]\nurl = "http://127.0.0.1:18081"\n[store]\ndir = "%s"\nsync = "always"\n[log]\nlevel = "warn"\n' \
        "$PORT" "$DISK/$name" >"$SHM/$name.toml"
    valgrind --tool=callgrind --callgrind-out-file="$SHM/$name.out" "$1" run --config "$SHM/$name.toml" \
        2>"$SHM/logs/$name.log" &
    pid=$!
    PIDS+=("$pid")
    # Under valgrind start-up takes seconds, not milliseconds.
    for _ in $(seq 600); do
        (echo >/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null && break
        kill -0 "$pid" 2>/dev/null || { cat "$SHM/logs/$name.log" >&2; exit 1; }
        sleep 0.1
    done
    case $2 in
    get) requests=$(wrk -t1 -c8 -d"${SECONDS_PER_RUN}s" "http://127.0.0.1:$PORT/get/file" | awk '/requests in/ {print $1}') ;;
    put) requests=$(wrk -t1 -c8 -d"${SECONDS_PER_RUN}s" -s "$SHM/put.lua" "http://127.0.0.1:$PORT" | awk '/requests in/ {print $1}') ;;
    esac
    kill -INT "$pid"
    wait "$pid" || true
    total=$(callgrind_annotate "$SHM/$name.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
    echo "$total $requests"
}

printf '%-50s %14s %14s\n' binary "GET instr/req" "PUT instr/req"
for bin in $BINS; do
    read -r idle _ < <(measure "$bin" idle)
    read -r get_total get_requests < <(measure "$bin" get)
    read -r put_total put_requests < <(measure "$bin" put)
    printf '%-50s %14d %14d   (%d GETs, %d PUTs; idle run %d)\n' "$bin" \
        $(((get_total - idle) / get_requests)) $(((put_total - idle) / put_requests)) \
        "$get_requests" "$put_requests" "$idle"
done
