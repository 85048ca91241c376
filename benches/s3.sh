#!/usr/bin/env bash
# S3 benchmark (issue 35): fencegate in S3 mode (`backend.protocol = "s3"`) in front of a real
# S3 server, against the same server reached directly, in one interleaved run. Run by hand,
# not by CI (about 7 minutes at its defaults, 10 with PROXY=1):
#
#   benches/s3.sh                                   # 2 rounds of 10 s per cell, then the table
#   S3S_FS=/opt/s3s-nodelay/bin/s3s-fs benches/s3.sh   # another s3s-fs build (below)
#   ROUNDS=3 SECONDS_PER_RUN=8 CONNS="16 64" WORKLOADS="put4k get" BIG_MIB=0 benches/s3.sh
#   PROXY=1 benches/s3.sh                           # and nginx as a plain proxy beside them
#   PIN=1 benches/s3.sh                             # s3s-fs on a CPU of its own (below)
#   FG_EXTRA_CONFIG=$'[[fence.rules]]\nprefix = "/"\npin = "off"' benches/s3.sh   # TOML appended
#                                                   # to fencegate's config: here, without pins
#
# What runs, all on loopback:
#   direct    s3s-fs (S3S_FS, default ~/.cargo/bin/s3s-fs: `cargo install s3s-fs@0.14.1
#             --locked --features binary`, a release build: .ci/run installs a debug one
#             where none is there), its objects on tmpfs, started without keys so that it
#             checks no signatures and wrk's unsigned requests pass            127.0.0.1:18091
#   fencegate the release binary (FG_BIN for another), protocol = "s3", s3.flat_keys = false
#             (s3s-fs stores keys as file paths), store.sync = "always", data dir and stderr
#             on disk, log level warn, admin API on 127.0.0.1:18093              127.0.0.1:18092
#   nginx     with PROXY=1: nginx as a reverse proxy to s3s-fs, 1 worker, upstream keepalive
#             pool of 128, request bodies streamed (proxy_request_buffering off), as
#             fencegate streams them: what any proxy costs here                  127.0.0.1:18094
# Workloads, each at CONNS connections (1 16 64), wrk with one thread (-t1 --latency), in
# interleaved rounds per cell (direct, [nginx,] fencegate, direct, ...) after a 2 s warm-up
# of each, so that the machine's noise falls on both alike:
#   put4k  PutObject of 4 KiB over 1,000 keys of bucket `bench`, every key's Fencing-Token
#          climbing (the base from the clock, so a later run's are higher): through fencegate
#          each is a fenced write made durable before it is forwarded; s3s-fs ignores the header
#   put1m  PutObject of 1 MiB over 256 keys, tokens alike
#   get    GetObject of one 4 KiB object: pass-through
# Before them, with fencegate fresh, BIG_MIB (1024) MiB are put as one object, streamed from
# `head -c` through curl (never a file in memory), once directly and once through fencegate,
# while fencegate's VmRSS is sampled every 50 ms: its VmHWM before and after and the highest
# sample show whether memory stays flat (BIG_MIB=0 skips it).
#
# It prints, per cell, the median req/s of the rounds direct and through fencegate, their ratio
# against the issue's target (PutObject >= 0.9x direct at 16 and 64 connections, GetObject >=
# 0.97x), p50 and p99, CPU time per request of s3s-fs (direct, behind nginx, behind
# fencegate) and of fencegate (all its threads; and of nginx's worker), the machine's idle
# CPU during each target's runs, fencegate's batches (advances per sync, and the mean write +
# sync of one) and the failed requests (non-2xx and socket errors); then fencegate's RSS.
#
# s3s-fs leaves Nagle's algorithm on and writes a GET's head and body apart, so each GET's
# body waits for the client's delayed ACK of its head: GETs then measure ACK timers, not CPU
# (docs/benchmarks.md#s3-benchess3sh, which says how to build it with TCP_NODELAY).
#
# PIN=1 gives s3s-fs one CPU and fencegate, nginx and wrk the other (taskset), as a server on
# machines of its own would be: a proxy's CPU then does not come out of the server's. The
# server gets the CPU that does not take the interrupts of the disk holding fencegate's log
# (read from /proc/irq), since on a machine of its own it would never run them: on a virtual
# machine whose disk interrupts all land on one CPU, each of fencegate's syncs would otherwise
# cost the server an interrupt and its softirq.
#
# Everything it starts, it stops, by pid; it stops at once if one of its ports (18091-18094)
# is taken. The scratch dirs, cleanup, nginx and the fencegate config are benches/common.sh's.
set -euo pipefail

ROUNDS=${ROUNDS:-2}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
CONNS=${CONNS:-"1 16 64"}
WORKLOADS=${WORKLOADS:-"put4k put1m get"}
BIG_MIB=${BIG_MIB:-1024}
S3S_FS=${S3S_FS:-$HOME/.cargo/bin/s3s-fs}

source "$(dirname "$0")/common.sh" s3
bench_tools
[ -x "$S3S_FS" ] || {
    echo "S3S_FS=$S3S_FS is not an executable: cargo install s3s-fs@0.14.1 --locked --features binary" >&2
    exit 1
}
BIN=${FG_BIN:-$TARGET_DIR/release/fencegate}
if [ -z "${FG_BIN:-}" ]; then
    (cd "$ROOT" && cargo build --release --quiet)
fi
declare -A PORT=([direct]=18091 [fencegate]=18092 [nginx]=18094)
ADMIN=18093
TARGETS=(direct fencegate)
if [ "${PROXY:-0}" = 1 ]; then TARGETS=(direct nginx fencegate); fi
bench_ports_free 18091 18092 "$ADMIN" 18094

# The CPUs that take the interrupts of the disk under DISK (fencegate's syncs complete there).
disk_irq_cpus() {
    local dev sys irq
    dev=$(basename "$(df --output=source "$DISK" | tail -1)")
    sys=$(readlink -f "/sys/class/block/$dev")
    [ -e "$sys/partition" ] && sys=$(dirname "$sys")
    for irq in "$sys"/device/../msi_irqs/* "$sys"/device/msi_irqs/*; do
        [ -e "$irq" ] && cat "/proc/irq/$(basename "$irq")/effective_affinity_list" 2>/dev/null
    done | tr ',' '\n' | sort -u | tr '\n' ' '
}
PIN_SERVER=() PIN_REST=() SERVER_CPU=1 REST_CPU=0
if [ "${PIN:-0}" = 1 ]; then
    # A server on a machine of its own never runs the proxy's disk interrupts: give it the
    # CPU that does not take them, where the machine says which one that is.
    case " $(disk_irq_cpus)" in *" 1 "*) if [[ " $(disk_irq_cpus)" != *" 0 "* ]]; then SERVER_CPU=0 REST_CPU=1; fi ;; esac
    PIN_SERVER=(taskset -c "$SERVER_CPU") PIN_REST=(taskset -c "$REST_CPU")
fi
mkdir -p "$SHM/s3" "$DISK/logs"
RUST_LOG=error "${PIN_SERVER[@]}" "$S3S_FS" --host 127.0.0.1 --port "${PORT[direct]}" "$SHM/s3" >"$SHM/logs/s3s.log" 2>&1 &
S3S=$!
PIDS+=("$S3S")
bench_wait "$S3S" "${PORT[direct]}" "$SHM/logs/s3s.log"
# request_timeout bounds handing the backend a fenced write's whole body: the big upload's.
bench_fencegate_config fencegate "$BIN" "${PORT[fencegate]}" "" \
    "$(printf 'url = "http://127.0.0.1:%s"\nprotocol = "s3"\nrequest_timeout = "300s"' "${PORT[direct]}")" \
    "$(printf '[s3]\nflat_keys = false\n[admin]\nlisten = "127.0.0.1:%s"\n%s' "$ADMIN" "${FG_EXTRA_CONFIG:-}")"
"${PIN_REST[@]}" "$BIN" run --config "$SHM/fencegate.toml" 2>"$DISK/logs/fencegate.log" &
FG=$!
PIDS+=("$FG")
bench_wait "$FG" "${PORT[fencegate]}" "$DISK/logs/fencegate.log"
declare -A PID=([direct]=$S3S [fencegate]=$FG)
if [ "${PROXY:-0}" = 1 ]; then
    bench_nginx proxy "${PORT[nginx]}" <<EOF
  upstream s3 { server 127.0.0.1:${PORT[direct]}; keepalive 128; keepalive_requests 10000000; }
  server { listen 127.0.0.1:${PORT[nginx]} backlog=4096; client_max_body_size 0; proxy_request_buffering off;
           location / { proxy_pass http://s3; proxy_http_version 1.1; proxy_set_header Connection "";
                        proxy_set_header Host \$http_host; } }
EOF
    bench_worker "$STARTED"
    PID[nginx]=$WORKER
    if [ "${PIN:-0}" = 1 ]; then taskset -a -cp "$REST_CPU" "$STARTED" >/dev/null && taskset -a -cp "$REST_CPU" "$WORKER" >/dev/null; fi
fi

direct="http://127.0.0.1:${PORT[direct]}"
curl -sSf -X PUT "$direct/bench" >/dev/null
head -c 4096 /dev/zero | tr '\0' 'g' | curl -sSf -T - "$direct/bench/get/object" >/dev/null

# PutObjects of SIZE bytes to PREFIX0 .. PREFIX(COUNT-1), each with a Fencing-Token above any
# the key had.
cat >"$SHM/s3put.lua" <<'EOF'
local n = 0
local base = os.time() * 1000000
local prefix, count, body
init = function(args) -- wrk's arguments after `--`: PREFIX COUNT SIZE
    prefix, count, body = args[1], tonumber(args[2]), string.rep("v", tonumber(args[3]))
end
request = function()
    n = n + 1
    return wrk.format("PUT", prefix .. (n % count), { ["Fencing-Token"] = string.format("%.0f", base + n) }, body)
end
EOF

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
idle_ticks() { awk '/^cpu / {print $5 + $6}' /proc/stat; }
rss() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; } # PID VmRSS|VmHWM, in kB
# fencegate's batches so far, from its metrics: "count advances sync_seconds".
batches() {
    { exec 3<>/dev/tcp/127.0.0.1/"$ADMIN" && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 && cat <&3; } 2>/dev/null | awk '
        /^fencegate_store_batch_advances_count/ { c = $2 } /^fencegate_store_batch_advances_sum/ { a = $2 }
        /^fencegate_store_sync_duration_seconds_sum/ { t = $2 } END { printf "%d %d %.6f\n", c, a, t }'
}

idle_rss=$(rss "$FG" VmRSS)
BIG="$SHM/big.txt"
: >"$BIG"
if [ "$BIG_MIB" -gt 0 ]; then
    hwm_before=$(rss "$FG" VmHWM)
    for target in direct fencegate; do
        token="$(date +%s)000000"
        sampled=0
        head -c "$((BIG_MIB << 20))" /dev/zero |
            curl -sS -o "$SHM/big.out" -w '%{http_code} %{time_total}\n' -T - -H 'Transfer-Encoding:' \
                -H "Content-Length: $((BIG_MIB << 20))" -H "Fencing-Token: $token" \
                "http://127.0.0.1:${PORT[$target]}/bench/big/$target" >"$SHM/big.curl" &
        CURL=$!
        PIDS+=("$CURL")
        while kill -0 "$CURL" 2>/dev/null; do
            r=$(rss "$FG" VmRSS)
            [ "$r" -gt "$sampled" ] && sampled=$r
            sleep 0.05
        done
        wait "$CURL" || true
        bench_waited "$CURL"
        read -r code secs <"$SHM/big.curl"
        [ "$code" = 200 ] || { echo "the ${BIG_MIB} MiB PutObject to $target answered $code:" >&2; cat "$SHM/big.out" >&2; exit 1; }
        echo "$target $secs $sampled $(rss "$FG" VmHWM)" >>"$BIG"
        printf '  %s MiB PutObject %-9s %6.1f s  fencegate VmRSS sampled max %s kB\n' "$BIG_MIB" "$target" "$secs" "$sampled" >&2
        curl -sSf -X DELETE "$direct/bench/big/$target" >/dev/null # back out of tmpfs
    done
fi

RESULTS="$SHM/results.tsv"
: >"$RESULTS"
run_wrk() { # workload conns target seconds -> "req/s p50_us p99_us failed"
    local url="http://127.0.0.1:${PORT[$3]}" script=() args=()
    case $1 in
    put4k) script=(-s "$SHM/s3put.lua") url="$url/" args=(-- /bench/small/k 1000 4096) ;;
    put1m) script=(-s "$SHM/s3put.lua") url="$url/" args=(-- /bench/large/k 256 1048576) ;;
    get) url="$url/bench/get/object" args=() ;;
    esac
    "${PIN_REST[@]}" wrk -t1 -c"$2" -d"$4s" --timeout 10s --latency "${script[@]}" "$url" "${args[@]}" | awk '
        function us(v) { if (v ~ /us$/) return v + 0; if (v ~ /ms$/) return v * 1000; if (v ~ /s$/) return v * 1000000; return v }
        /^ +50%/ { p50 = us($2) } /^ +99%/ { p99 = us($2) }
        /Requests\/sec/ { rps = $2 } /Non-2xx/ { bad += $NF }
        /Socket errors/ { gsub(/,/, ""); bad += $4 + $6 + $8 + $10 }
        END { printf "%s %s %s %s\n", rps, p50, p99, bad + 0 }'
}

echo "fencegate S3 benchmark: $(nproc) CPUs, $(uname -r), $S3S_FS, rounds=$ROUNDS x ${SECONDS_PER_RUN}s, PIN=${PIN:-0}${PIN_SERVER:+ (s3s-fs on CPU $SERVER_CPU, disk interrupts on CPU $(disk_irq_cpus))}" >&2
for workload in $WORKLOADS; do
    for conns in $CONNS; do
        for target in "${TARGETS[@]}"; do run_wrk "$workload" "$conns" "$target" 2 >/dev/null; done # warm-up
        for round in $(seq "$ROUNDS"); do
            for target in "${TARGETS[@]}"; do
                proxy=${PID[$target]} # fencegate's or nginx's CPU (s3s-fs's again, direct)
                s3s_before=$(cpu_ticks "$S3S") proxy_before=$(cpu_ticks "$proxy") idle_before=$(idle_ticks)
                read -r b_count b_adv b_secs < <(batches)
                read -r rps p50 p99 bad < <(run_wrk "$workload" "$conns" "$target" "$SECONDS_PER_RUN")
                read -r a_count a_adv a_secs < <(batches)
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$workload" "$conns" "$round" "$target" \
                    "$rps" "$p50" "$p99" "$bad" "$(($(cpu_ticks "$S3S") - s3s_before))" "$(($(cpu_ticks "$proxy") - proxy_before))" \
                    "$(($(idle_ticks) - idle_before))" "$((a_count - b_count))" "$((a_adv - b_adv))" \
                    "$(awk -v a="$a_secs" -v b="$b_secs" 'BEGIN { print a - b }')" >>"$RESULTS"
                printf '  %-5s c=%-3s round %s %-9s %9.0f req/s  p50 %8.0f us  p99 %8.0f us  failed %s\n' \
                    "$workload" "$conns" "$round" "$target" "$rps" "$p50" "$p99" "$bad" >&2
            done
        done
    done
done

python3 - "$RESULTS" "$BIG" "$(getconf CLK_TCK)" "$SECONDS_PER_RUN" "$(nproc)" "$idle_rss" "$(rss "$FG" VmHWM)" \
    "${hwm_before:-0}" "$BIG_MIB" <<'EOF'
import sys, statistics
from collections import defaultdict
path, big, hz, secs, ncpu, idle_rss, hwm, hwm_before, big_mib = sys.argv[1:]
hz, secs, ncpu = int(hz), float(secs), int(ncpu)
runs = defaultdict(list)
for line in open(path):
    w, c, r, t, rps, p50, p99, bad, s3s, proxy, idle, batches, advances, sync = line.split("\t")
    runs[(w, int(c), t)].append((float(rps), float(p50), float(p99), int(bad), int(s3s), int(proxy), int(idle),
                                 int(batches), int(advances), float(sync)))
med = lambda xs: statistics.median(xs)
# CPU µs per request over a target's rounds, from field i (4: s3s-fs, 5: the proxy).
per_req = lambda r, i: sum(x[i] for x in r) / hz / max(1.0, sum(x[0] for x in r) * secs) * 1e6
target = lambda w, c: (0.97 if w == "get" else 0.9 if c >= 16 else None)
order = {"put4k": 0, "put1m": 1, "get": 2}
proxied = any(t == "nginx" for (_, _, t) in runs)
print("| workload | conns | direct req/s | fenced req/s | fenced/direct | target |"
      + (" nginx/direct |" if proxied else "") + " p50 direct / fenced (µs) | p99 direct / fenced (µs) "
      "| CPU µs/req s3s-fs direct / " + ("nginx / " if proxied else "") + "fenced | CPU µs/req fencegate"
      + (" / nginx" if proxied else "")
      + " | machine idle % direct / fenced | fg batch (advances) / sync (µs) | failed |")
print("|---|---:|---:|---:|---:|---|" + ("---:|" if proxied else "") + "---:|---:|---:|---:|---:|---:|---:|")
for w, c in sorted({(w, c) for (w, c, _) in runs}, key=lambda k: (order.get(k[0], 9), k[1])):
    d, f, n = runs[(w, c, "direct")], runs[(w, c, "fencegate")], runs.get((w, c, "nginx"), [])
    rps, p50, p99 = ([med([x[i] for x in r]) for r in (d, f)] for i in (0, 1, 2))
    ratio, goal = rps[1] / rps[0], target(w, c)
    verdict = "–" if goal is None else f"≥ {goal:.2f}: {'met' if ratio >= goal else '**missed**'}"
    nginx = f" {med([x[0] for x in n]) / rps[0]:.2f} |" if proxied else ""
    nginx_cpu = f" / {per_req(n, 5):.1f}" if proxied else ""
    s3s_nginx = f"{per_req(n, 4):.1f} / " if proxied else ""
    idle = [med([x[6] / hz / secs / ncpu * 100 for x in r]) for r in (d, f)]
    n_batches = sum(x[7] for x in f)
    batch = f"{sum(x[8] for x in f) / n_batches:.1f} / {sum(x[9] for x in f) / n_batches * 1e6:,.0f}" if n_batches else "–"
    print(f"| {w} | {c} | {rps[0]:,.0f} | {rps[1]:,.0f} | {ratio:.2f} | {verdict} |{nginx} {p50[0]:,.0f} / {p50[1]:,.0f} "
          f"| {p99[0]:,.0f} / {p99[1]:,.0f} | {per_req(d, 4):.1f} / {s3s_nginx}{per_req(f, 4):.1f} | {per_req(f, 5):.1f}{nginx_cpu} "
          f"| {idle[0]:.0f} / {idle[1]:.0f} | {batch} | {sum(x[3] for x in d + f + n)} |")
for line in open(big):
    t, s, sampled, after = line.split()
    print(f"\n{big_mib} MiB PutObject {t}: {float(s):.1f} s ({int(big_mib) / float(s):,.0f} MiB/s); "
          f"fencegate VmRSS sampled max {int(sampled) / 1024:.1f} MB, VmHWM after {int(after) / 1024:.1f} MB", end="")
if int(big_mib):
    print(f"\n(fencegate VmHWM before the uploads {int(hwm_before) / 1024:.1f} MB)")
print(f"\nfencegate RSS: idle {int(idle_rss) / 1024:.1f} MB, VmHWM at the end {int(hwm) / 1024:.1f} MB")
EOF
