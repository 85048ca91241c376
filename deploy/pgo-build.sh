#!/usr/bin/env bash
# Builds fencegate with profile-guided optimisation: an instrumented release build serves a
# training load on loopback (fenced PUTs at 1, 64 and 256 connections, stale PUTs refused,
# pass-through GETs; nginx's WebDAV module as the backend and wrk as the client, as in
# benches/load.sh), and the release build is made again with the profile it recorded, so that
# the compiler lays the request path out as it runs. docs/benchmarks.md ("Profile-guided
# optimisation") has what it is worth. From the repository root:
#
#   deploy/pgo-build.sh                   # the binary: target/pgo/<host>/release/fencegate
#   PGO_OUT=/usr/local/bin/fencegate deploy/pgo-build.sh
#   PGO_SECONDS=20 deploy/pgo-build.sh    # a longer training (8 s a phase by default)
#
# It needs the toolchain's llvm-profdata (`rustup component add llvm-tools`; it asks rustup
# if the file is missing), and nginx and wrk (installed with apt if missing, as load.sh
# does). The two builds go to target/pgo-generate and target/pgo, so target/release is left as
# it was; each is a whole-program release build (minutes on two cores), for the host's target
# named explicitly, so that build scripts and procedural macros are neither instrumented nor
# optimised with the profile. The raw profiles go to target/pgo-generate/profiles, emptied
# first; the training's processes and data dir live in scratch directories removed at exit.
# RUSTFLAGS already set are kept, the profile's flag added to them. A profile recorded by one
# toolchain is used with the same one: the script builds both halves with whatever `cargo`
# runs here.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
SECONDS_EACH=${PGO_SECONDS:-8}
GEN_DIR=$ROOT/target/pgo-generate
USE_DIR=$ROOT/target/pgo

sysroot=$(rustc --print sysroot)
host=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA=$sysroot/lib/rustlib/$host/bin/llvm-profdata
if [ ! -x "$PROFDATA" ]; then
    echo "llvm-profdata is missing: rustup component add llvm-tools" >&2
    rustup component add llvm-tools >&2 || true
    [ -x "$PROFDATA" ] || { echo "no $PROFDATA: install the toolchain's llvm-tools component" >&2; exit 1; }
fi

# SHM and DISK (scratch, removed at exit), PIDS (stopped at exit), the backend, put.lua.
source "$ROOT/benches/common.sh" pgo
bench_tools
bench_ports_free 18081 18087
RAW=$GEN_DIR/profiles
rm -rf "$RAW"
mkdir -p "$RAW"

echo "pgo: the instrumented build (target/pgo-generate)" >&2
CARGO_TARGET_DIR=$GEN_DIR RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-Cprofile-generate=$RAW" \
    cargo build --release --locked --quiet --target "$host" --bin fencegate

echo "pgo: training, ${SECONDS_EACH} s a phase" >&2
bench_backend
bench_fencegate train "$GEN_DIR/$host/release/fencegate" 18087
# Stale holders: a token below every resource's max_seen, refused with 409.
cat >"$SHM/stale.lua" <<'EOF'
local n = 0
request = function()
    n = n + 1
    return wrk.format("PUT", "/put/r" .. (n % 1000), { ["Fencing-Token"] = "1" }, "stale")
end
EOF
url=http://127.0.0.1:18087
for conns in 64 256 1; do
    wrk -t1 -c"$conns" -d"${SECONDS_EACH}s" -s "$SHM/put.lua" "$url/" >/dev/null
done
wrk -t1 -c64 -d"$((SECONDS_EACH / 4 + 1))s" -s "$SHM/stale.lua" "$url/" >/dev/null
wrk -t1 -c64 -d"${SECONDS_EACH}s" "$url/get/file" >/dev/null
# The profile is written as the process exits, so it must exit, not be killed.
kill -TERM "$FG_PID"
wait "$FG_PID" || { echo "the instrumented fencegate did not exit cleanly:" >&2; cat "$SHM/logs/train.log" >&2; exit 1; }
bench_waited "$FG_PID"
"$PROFDATA" merge -o "$DISK/fencegate.profdata" "$RAW"

echo "pgo: the optimised build (target/pgo)" >&2
CARGO_TARGET_DIR=$USE_DIR RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-Cprofile-use=$DISK/fencegate.profdata" \
    cargo build --release --locked --quiet --target "$host" --bin fencegate
if [ -n "${PGO_OUT:-}" ]; then
    install -D -m 0755 "$USE_DIR/$host/release/fencegate" "$PGO_OUT"
fi
echo "pgo: built ${PGO_OUT:-$USE_DIR/$host/release/fencegate}" >&2
