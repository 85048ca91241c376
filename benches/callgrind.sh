#!/usr/bin/env bash
# Callgrind instructions per request: a pass-through GET of a 1 KiB file and a fenced 100-byte
# PUT (put.lua), each binary in BINS (default: the release build) in a process of its own per
# workload, `wrk -t1 -c8` (-c CONNS) for SECONDS_PER_RUN seconds, minus a run of the same
# binary that serves nothing (start-up and shutdown). Instructions are the machine's least noisy measure:
# two builds compared here differ by their code, not by the load on the machine.
#
#   BINS="target/release/fencegate /path/to/old/fencegate" benches/callgrind.sh
#   FG_EXTRA_CONFIG=$'[[fence.rules]]\nprefix = "/"\npin = "etag"' benches/callgrind.sh   # TOML appended to the config
#   CONNS=1 benches/callgrind.sh   # one request at a time: each PUT syncs alone, so the counts
#                                  # do not depend on how the machine's load batched them
#   PUT_KEYS=20 benches/callgrind.sh   # PUTs over 20 resources instead of 1,000: with pins,
#                                      # a resource's first write learns its tag by a HEAD
#   S3=1 benches/callgrind.sh   # S3 mode in front of s3s-fs (S3S_FS), as benches/s3.sh runs it
#   FLOOR=1 benches/callgrind.sh   # and the least durable proxy (examples/hyper_floor/ with a log
#                                  # on disk, as load.sh's DURABLE_FLOOR=1) measured the same way
#   KEEP=/tmp/cg benches/callgrind.sh   # and keep the profiles there, N-BINARY-WORKLOAD.out, to
#                                       # compare with callgrind_annotate
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
if [ "${FLOOR:-0}" = 1 ]; then
    (cd "$ROOT" && cargo build --release --quiet --example hyper_floor)
    BINS="$BINS $TARGET_DIR/release/examples/hyper_floor"
fi
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
CONNS=${CONNS:-8}
PUT_KEYS=${PUT_KEYS:-1000}
PORT=18085
bench_ports_free 18081 "$PORT"
mkdir -p "$SHM/logs" "$SHM/www/get"
head -c 1024 /dev/zero >"$SHM/www/get/file"
BACKEND_LINES="" TABLES=""
if [ "${S3:-0}" = 1 ]; then
    # The same requests in S3 mode: /get/file is object `file` of bucket `get`, put.lua's
    # PUTs are PutObjects to bucket `put`.
    S3S_FS=${S3S_FS:-$HOME/.cargo/bin/s3s-fs}
    mkdir -p "$SHM/s3"
    RUST_LOG=error "$S3S_FS" --host 127.0.0.1 --port 18081 "$SHM/s3" >"$SHM/logs/s3s.log" 2>&1 &
    PIDS+=("$!")
    bench_wait "$!" 18081 "$SHM/logs/s3s.log"
    curl -sSf -X PUT http://127.0.0.1:18081/get >/dev/null
    curl -sSf -X PUT http://127.0.0.1:18081/put >/dev/null
    curl -sSf -T "$SHM/www/get/file" http://127.0.0.1:18081/get/file >/dev/null
    BACKEND_LINES=$'url = "http://127.0.0.1:18081"\nprotocol = "s3"'
    TABLES=$'[s3]\nflat_keys = false'
else
    bench_backend
fi

# Runs BIN under callgrind for WORKLOAD (get, put or idle); sets TOTAL (instructions) and
# REQUESTS (what wrk counted, all answered 2xx).
measure() { # BIN WORKLOAD
    local name="cg-$2-$RANDOM" pid out
    if [ "$(basename "$1")" = hyper_floor ]; then
        rm -f "$DISK/floor.log"
        valgrind --tool=callgrind --callgrind-out-file="$SHM/$name.out" "$1" "127.0.0.1:$PORT" \
            127.0.0.1:18081 "$DISK/floor.log" 2>"$SHM/logs/$name.log" &
    else
        bench_fencegate_config "$name" "$1" "$PORT" "" "$BACKEND_LINES" "$TABLES"$'\n'"${FG_EXTRA_CONFIG:-}"
        valgrind --tool=callgrind --callgrind-out-file="$SHM/$name.out" "$1" run --config "$SHM/$name.toml" \
            2>"$SHM/logs/$name.log" &
    fi
    pid=$!
    PIDS+=("$pid")
    # Serving, not only bound: under valgrind start-up takes seconds, and the signal handlers
    # are installed once the proxy runs.
    for _ in $(seq 1200); do
        curl -s -o /dev/null "http://127.0.0.1:$PORT/get/file" && break
        kill -0 "$pid" 2>/dev/null || { cat "$SHM/logs/$name.log" >&2; exit 1; }
        sleep 0.1
    done
    curl -sf -o /dev/null "http://127.0.0.1:$PORT/get/file" || { echo "$1 did not serve" >&2; exit 1; }
    REQUESTS=0
    case $2 in
    get) out=$(wrk -t1 -c"$CONNS" -d"${SECONDS_PER_RUN}s" "http://127.0.0.1:$PORT/get/file") ;;
    put) out=$(wrk -t1 -c"$CONNS" -d"${SECONDS_PER_RUN}s" -s "$SHM/put.lua" "http://127.0.0.1:$PORT" -- 0 "$PUT_KEYS") ;;
    idle) out="0 requests in" ;;
    esac
    if grep -qE "Non-2xx|Socket errors" <<<"$out"; then
        echo "$1 $2: not every request was answered 2xx:" >&2
        echo "$out" >&2
        exit 1
    fi
    REQUESTS=$(awk '/requests in/ {print $1; exit}' <<<"$out")
    kill -TERM "$pid"
    timeout 120 tail --pid="$pid" -f /dev/null || { echo "$1 did not stop" >&2; exit 1; }
    TOTAL=$(awk -F'[: ]+' '/^(summary|totals):/ {print $2; exit}' "$SHM/$name.out")
    if [ -n "${KEEP:-}" ]; then
        mkdir -p "$KEEP"
        cp "$SHM/$name.out" "$KEEP/$BIN_INDEX-$(basename "$1")-$2.out"
    fi
    [[ $TOTAL =~ ^[0-9]+$ && $REQUESTS =~ ^[0-9]+$ ]] || { echo "$1 $2: no count ($TOTAL, $REQUESTS)" >&2; exit 1; }
}

printf '%-50s %14s %14s\n' binary "GET instr/req" "PUT instr/req"
BIN_INDEX=0
for bin in $BINS; do
    BIN_INDEX=$((BIN_INDEX + 1))
    measure "$bin" idle
    idle=$TOTAL
    measure "$bin" get
    get=$(((TOTAL - idle) / REQUESTS)) gets=$REQUESTS
    measure "$bin" put
    put=$(((TOTAL - idle) / REQUESTS)) puts=$REQUESTS
    printf '%-50s %14d %14d   (%d GETs, %d PUTs; idle run %d)\n' "$bin" "$get" "$put" "$gets" "$puts" "$idle"
done
