# Sourced by the benchmark scripts (load.sh, callgrind.sh, cluster.sh, envoy.sh, mixed.sh,
# threads.sh, timeline.sh): the pieces they share, all on loopback. After
# `source benches/common.sh NAME`:
#   $ROOT $TARGET_DIR $NGINX   the repository, cargo's target directory, nginx's binary
#   $SHM $DISK                 scratch directories on tmpfs (the backend's files) and on disk
#                              (fencegate's data dirs), /dev/shm/fencegate-NAME.* and
#                              /var/tmp/fencegate-NAME.*, removed at exit
#   PIDS+=(pid)                stopped at exit, by pid; `bench_waited PID` once waited for
#   bench_ports_free PORT...   exits unless every port is free
#   bench_tools                installs nginx-light and wrk with apt unless both are there
#   bench_wait PID PORT LOG    waits until PID listens on PORT; exits with LOG if it never does
#   bench_nginx NAME PORT      an nginx of one worker on PORT, its http block's lines from stdin
#                              ($SHM/NAME.conf, log $SHM/logs/NAME.log); sets STARTED (master)
#   bench_worker MASTER        sets WORKER to the pid of nginx's worker under MASTER
#   bench_backend [PORT]       nginx WebDAV (PUT, DELETE) from $SHM/www on 127.0.0.1:PORT (18081),
#                              one worker, with a 1 KiB file at /get/file; sets BACKEND_PID
#                              (the master)
#   bench_proxy                nginx reverse proxy to the backend on 18081 from 127.0.0.1:18082,
#                              keepalive pool of 128; sets PROXY_PID to its worker (the master
#                              only watches it)
#   $SHM/put.lua               100-byte PUTs over 1,000 resources, every resource's tokens
#                              climbing, the base from the clock (a later run's are higher);
#                              `wrk ... -s $SHM/put.lua URL -- PART COUNT` PUTs to /put/pPART-i
#                              over COUNT resources instead, so that concurrent wrks each have
#                              resources of their own
#   bench_fencegate_config NAME BIN PORT [STORE_LINES [BACKEND_LINES [TABLES]]]
#                              inits $DISK/NAME and writes $SHM/NAME.toml as bench_fencegate
#                              runs with; BACKEND_LINES replace [backend]'s url of the
#                              backend on 18081 (s3.sh: another url and protocol = "s3"),
#                              TABLES (whole TOML tables) go at the end
#   bench_fencegate NAME BIN PORT [STORE_LINES [BACKEND_LINES [TABLES]]]
#                              inits a data dir, starts `BIN run` on PORT with the backend on
#                              18081 (or BACKEND_LINES'), store.sync = "always", log level
#                              warn (stderr to $SHM/logs/NAME.log), STORE_LINES added to
#                              [store]; waits until it listens; sets FG_PID

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
PIDS=()
SHM=$(mktemp -d "/dev/shm/fencegate-${1:-bench}.XXXX")
DISK=$(mktemp -d "/var/tmp/fencegate-${1:-bench}.XXXX")
bench_cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$SHM" "$DISK"
}
trap bench_cleanup EXIT
trap 'exit 130' INT TERM
# Forgets a pid that was waited for, so that cleanup never kills whoever has it since.
bench_waited() {
    local keep=() p
    for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}
mkdir -p "$SHM/www/get" "$SHM/body" "$SHM/logs"
head -c 1024 /dev/zero | tr '\0' 'x' >"$SHM/www/get/file"
chmod -R 777 "$SHM" # nginx's worker runs as nobody when started by root

bench_tools() {
    local t
    for t in nginx wrk; do
        command -v "$t" >/dev/null 2>&1 || [ -x "/usr/sbin/$t" ] || {
            echo "installing nginx-light and wrk with apt" >&2
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light wrk >/dev/null
            return
        }
    done
}

bench_ports_free() {
    for port in "$@"; do
        if (echo >/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then
            echo "127.0.0.1:$port is taken: stop what listens there first" >&2
            exit 1
        fi
    done
}

# Waits until PID listens on PORT; exits with its log if it never does.
bench_wait() { # PID PORT LOG
    for _ in $(seq 100); do
        (echo >/dev/tcp/127.0.0.1/"$2") 2>/dev/null && return 0
        kill -0 "$1" 2>/dev/null || break
        sleep 0.05
    done
    echo "what should listen on 127.0.0.1:$2 did not start:" >&2
    cat "$3" >&2
    exit 1
}

# Writes $SHM/NAME.conf (one worker, no access log, connections never closed for their request
# count; the http block's own lines from stdin) and starts it; sets STARTED to the master's pid.
bench_nginx() { # NAME PORT
    {
        echo "worker_processes 1; pid $SHM/$1.pid; error_log $SHM/logs/$1.log warn;"
        echo "events { worker_connections 4096; }"
        echo "http { access_log off; keepalive_requests 10000000; client_body_temp_path $SHM/body;"
        cat
        echo "}"
    } >"$SHM/$1.conf"
    "$NGINX" -c "$SHM/$1.conf" -g 'daemon off;' &
    STARTED=$!
    PIDS+=("$STARTED")
    bench_wait "$STARTED" "$2" "$SHM/logs/$1.log"
}

bench_worker() { # MASTER
    WORKER=
    for _ in $(seq 100); do
        WORKER=$(pgrep -P "$1" | head -1 || true)
        [ -n "$WORKER" ] && return 0
        sleep 0.05
    done
    echo "nginx's worker (of master $1) did not start" >&2
    exit 1
}

bench_backend() { # [PORT]
    local port=${1:-18081} etag=""
    # BACKEND_ETAG=1: each answer names a strong ETag of its own (nginx's request id), as an
    # S3 server's PutObject answer names the object's: a pinned write then learns its key's
    # next tag from the answer and needs no HEAD (docs/benchmarks.md, "Pins").
    if [ "${BACKEND_ETAG:-0}" = 1 ]; then etag='add_header ETag "\"$request_id\"";'; fi
    bench_nginx backend "$port" <<EOF
  sendfile on;
  server { listen 127.0.0.1:$port backlog=4096; root $SHM/www; dav_methods PUT DELETE;
           create_full_put_path on; dav_access user:rw group:rw all:r; $etag }
EOF
    BACKEND_PID=$STARTED
}

bench_proxy() {
    bench_nginx proxy 18082 <<EOF
  upstream backend { server 127.0.0.1:18081; keepalive 128; keepalive_requests 10000000; }
  server { listen 127.0.0.1:18082 backlog=4096;
           location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; } }
EOF
    bench_worker "$STARTED"
    PROXY_PID=$WORKER
}

cat >"$SHM/put.lua" <<'EOF'
local n = 0
local base = os.time() * 1000000
local body = string.rep("v", 100)
local prefix, count = "/put/r", 1000
init = function(args) -- wrk's arguments after `--`: PART COUNT
    if args[1] then prefix, count = "/put/p" .. args[1] .. "-", tonumber(args[2] or count) end
end
request = function()
    n = n + 1
    return wrk.format("PUT", prefix .. (n % count), { ["Fencing-Token"] = string.format("%.0f", base + n) }, body)
end
EOF

bench_fencegate_config() { # NAME BIN PORT [STORE_LINES [BACKEND_LINES [TABLES]]]
    "$2" init --dir "$DISK/$1" >/dev/null
    printf '[server]\nlisten = "127.0.0.1:%s"\n[backend]\n%s\n[store]\ndir = "%s"\nsync = "always"\n%s\n[log]\nlevel = "warn"\n%s\n' \
        "$3" "${5:-url = \"http://127.0.0.1:18081\"}" "$DISK/$1" "${4:-}" "${6:-}" >"$SHM/$1.toml"
}

bench_fencegate() { # NAME BIN PORT [STORE_LINES [BACKEND_LINES [TABLES]]]
    bench_fencegate_config "$@"
    "$2" run --config "$SHM/$1.toml" 2>"$SHM/logs/$1.log" &
    FG_PID=$!
    PIDS+=("$FG_PID")
    bench_wait "$FG_PID" "$3" "$SHM/logs/$1.log"
}
