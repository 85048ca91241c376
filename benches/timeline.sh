#!/usr/bin/env bash
# Where one connection's request spends its time, leg by leg: nginx as a reverse proxy and
# fencegate, PUT (fenced, durable) and GET, each under `wrk -t1 -c1` while `perf record` takes
# the serving process's syscall tracepoints; benches/timeline.py cuts each
# request at its system calls (read, wake of the store's writer, pwrite, fdatasync, wake of the
# serving thread, forward, backend's answer, response). Run by hand, as root (tracepoints), not
# by CI; tracing adds a few microseconds to every system call it sees, alike for both.
#
#   benches/timeline.sh                                   # D=4 seconds a run
#   FG_BIN=/path/to/fencegate STORE_LINES='writer_scheduling = "normal"' benches/timeline.sh
#   PIN_CPU=1 benches/timeline.sh      # fencegate's serving and writer threads both on CPU 1
#
# All on loopback: the backend nginx (WebDAV on tmpfs) on 18081, the nginx proxy on 18082,
# fencegate on 18083 with its data dir on disk and store.sync = "always".
set -euo pipefail
source "$(dirname "$0")/common.sh" timeline
BIN=${FG_BIN:-$TARGET_DIR/release/fencegate}
D=${D:-4}
command -v perf >/dev/null || { echo "needs perf (apt-get install linux-perf)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "build first: cargo build --release --bin fencegate" >&2; exit 1; }
bench_ports_free 18081 18082 18083
bench_backend
bench_proxy
bench_fencegate fencegate "$BIN" 18083 "${STORE_LINES:-}"
WRITER=$(grep -l '^fencegate-log$' /proc/"$FG_PID"/task/*/comm | cut -d/ -f5 || true)
[ -n "$WRITER" ] || { echo "fencegate has no thread named fencegate-log (its store writer)" >&2; exit 1; }
if [ -n "${PIN_CPU:-}" ]; then
    taskset -p -c "$PIN_CPU" "$FG_PID" >/dev/null && taskset -p -c "$PIN_CPU" "$WRITER" >/dev/null
fi
EVENTS=
for call in recvfrom writev write futex pwrite64 fdatasync; do EVENTS+=syscalls:sys_enter_$call,; done
EVENTS+=syscalls:sys_exit_recvfrom,syscalls:sys_exit_fdatasync,syscalls:sys_exit_epoll_wait

# The server's fds for its client connection and its backend connections, from ss.
fds_of() { # PID PORT_FILTER
    { ss -tnpH state established "$2" | grep -o "pid=$1,fd=[0-9]*" || true; } | cut -d= -f3 | paste -sd, -
}

for workload in put get; do
    for target in nginx fencegate; do
        port=18082 pid=$PROXY_PID writer=
        [ $target = fencegate ] && { port=18083 pid=$FG_PID; [ $workload = put ] && writer=$WRITER; }
        url=http://127.0.0.1:$port/get/file lua=()
        [ $workload = put ] && { url=http://127.0.0.1:$port/; lua=(-s "$SHM/put.lua"); }
        wrk -t1 -c1 -d$((D + 2))s --latency "${lua[@]}" "$url" >"$SHM/wrk.out" &
        wrk_pid=$!
        PIDS+=($wrk_pid)
        sleep 1 # past the connection's set-up
        client=$(fds_of "$pid" "( sport = :$port )")
        [ -n "$client" ] || { echo "no connection from wrk to $target found" >&2; exit 1; }
        perf record -q -e "$EVENTS" -p "$pid" -o "$SHM/perf.data" -- sleep "$D" 2>"$SHM/perf.err" ||
            { echo "perf record failed (root and tracefs needed):" >&2; cat "$SHM/perf.err" >&2; exit 1; }
        # Backend connections outlive the run in the pool, so one opened during it is seen here.
        backend=$(fds_of "$pid" "( dport = :18081 )")
        wait "$wrk_pid"
        bench_waited "$wrk_pid"
        perf script -i "$SHM/perf.data" -F tid,cpu,time,event,trace 2>/dev/null >"$SHM/events.txt"
        echo "== $workload, $target: wrk p50 $(awk '$1 == "50%" {print $2}' "$SHM/wrk.out"), $(awk '/^Requests/ {print $2}' "$SHM/wrk.out") req/s under tracing"
        python3 "$ROOT/benches/timeline.py" "$SHM/events.txt" "$pid" "$client" "$backend" $writer
    done
done
