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
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
A_BIN=${A_BIN:-$TARGET_DIR/release/fencegate}
B_BIN=${B_BIN:-$A_BIN}
GET_CONNS=${GET_CONNS:-128}
PUT_CONNS=${PUT_CONNS:-16}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-6}
ROUNDS=${ROUNDS:-3}
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
for port in 18081 18083 18085; do
    if (echo >/dev/tcp/127.0.0.1/$port) 2>/dev/null; then
        echo "127.0.0.1:$port is taken: stop what listens there first" >&2
        exit 1
    fi
done
PIDS=()
SHM=
DISK=
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$SHM" "$DISK"
}
trap cleanup EXIT
SHM=$(mktemp -d /dev/shm/fencegate-mixed.XXXX)
DISK=$(mktemp -d /var/tmp/fencegate-mixed.XXXX)
mkdir -p "$SHM/www/get" "$SHM/body" "$SHM/logs"
head -c 1024 /dev/zero | tr '\0' 'x' >"$SHM/www/get/file"
chmod -R 777 "$SHM" # nginx's worker runs as nobody when started by root
{
    echo "worker_processes 1; pid $SHM/backend.pid; error_log $SHM/logs/backend.log warn;"
    echo "events { worker_connections 4096; }"
    echo "http { access_log off; keepalive_requests 10000000; client_body_temp_path $SHM/body; sendfile on;"
    echo "  server { listen 127.0.0.1:18081 backlog=4096; root $SHM/www; dav_methods PUT DELETE;"
    echo "           create_full_put_path on; dav_access user:rw group:rw all:r; } }"
} >"$SHM/backend.conf"
# 1,000 resources in turn, every resource's tokens climbing (as load.sh's put.lua).
{
    echo 'local n = 0'
    echo 'local base = os.time() * 1000000'
    echo 'local body = string.rep("v", 100)'
    echo 'request = function()'
    echo '    n = n + 1'
    echo '    return wrk.format("PUT", "/put/r" .. (n % 1000), { ["Fencing-Token"] = string.format("%.0f", base + n) }, body)'
    echo 'end'
} >"$SHM/put.lua"
"$NGINX" -c "$SHM/backend.conf" -g 'daemon off;' &
PIDS+=($!)
declare -A PORT=([A]=18083 [B]=18085) BIN=([A]=$A_BIN [B]=$B_BIN) EXTRA=([A]=${A_EXTRA:-} [B]=${B_EXTRA:-})
for t in A B; do
    "${BIN[$t]}" init --dir "$DISK/$t" >/dev/null
    printf '[server]\nlisten = "127.0.0.1:%s"\n[backend]\nurl = "http://127.0.0.1:18081"\n[store]\ndir = "%s"\nsync = "always"\n%s\n[log]\nlevel = "warn"\n' \
        "${PORT[$t]}" "$DISK/$t" "${EXTRA[$t]}" >"$SHM/$t.toml"
    "${BIN[$t]}" run --config "$SHM/$t.toml" 2>"$SHM/logs/$t.log" &
    pid=$!
    PIDS+=($pid)
    for _ in $(seq 100); do
        (echo >/dev/tcp/127.0.0.1/"${PORT[$t]}") 2>/dev/null && break
        sleep 0.05
    done
    if ! kill -0 $pid 2>/dev/null || ! (echo >/dev/tcp/127.0.0.1/"${PORT[$t]}") 2>/dev/null; then
        echo "fencegate $t did not start:" >&2
        cat "$SHM/logs/$t.log" >&2
        exit 1
    fi
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
        echo "$put" | awk -v t="$t" -v r="$round" -v g="$(awk '/^Requests/ {print $2}' "$SHM/get.out")" '
            /^Requests/ { rps = $2 } /^ +50%/ { p50 = $2 } /^ +99%/ { p99 = $2 } /Non-2xx/ { bad = $NF }
            END { printf "round %d %s: PUT %8.0f/s p50 %8s p99 %8s non-2xx %d   GET %8.0f/s\n", r, t, rps, p50, p99, bad, g }'
    done
done
