#!/usr/bin/env bash
# CPU time and context switches per request, thread by thread, of two fencegate builds under
# the same PUT load (wrk -t1, nginx WebDAV backend on tmpfs, data dirs on disk), in turn:
#   NEW=target/release/fencegate OLD=/path/to/old/fencegate C=64 D=8 ROUNDS=2 benches/threads.sh
set -euo pipefail
source "$(dirname "$0")/common.sh" threads
NEW=${NEW:-$TARGET_DIR/release/fencegate}; OLD=${OLD:?OLD=path of the build to compare with}; C=${C:-64}; D=${D:-8}
bench_ports_free 18081 18083 18085
bench_backend
bench_fencegate new "$NEW" 18083; PID_new=$FG_PID
bench_fencegate old "$OLD" 18085; PID_old=$FG_PID
snap() { # pid -> lines: tid name utime stime vcs nvcs
  for t in /proc/$1/task/*; do
    tid=${t##*/}; comm=$(cat $t/comm)
    read -r ut st < <(awk '{print $14, $15}' $t/stat)
    v=$(awk '/^voluntary_ctxt/ {print $2}' $t/status); nv=$(awk '/^nonvoluntary_ctxt/ {print $2}' $t/status)
    echo "$tid $comm $ut $st $v $nv"
  done
}
for round in $(seq "${ROUNDS:-2}"); do
for name in new old; do
  port=18083; [ $name = old ] && port=18085; eval "pid=\$PID_$name"
  snap $pid > $SHM/before
  out=$(wrk -t1 -c$C -d${D}s -s $SHM/put.lua http://127.0.0.1:$port/ | awk '/^Requests/ {print $2}')
  snap $pid > $SHM/after
  reqs=$(python3 -c "print(int(float('$out')*$D))")
  echo "== $name round $round: $out req/s (~$reqs reqs)"
  python3 - $SHM/before $SHM/after $reqs <<'PY'
import sys
b={l.split()[0]:l.split() for l in open(sys.argv[1])}
a={l.split()[0]:l.split() for l in open(sys.argv[2])}
n=int(sys.argv[3]); tot=0
for tid,r in a.items():
    p=b.get(tid,[tid,r[1],'0','0','0','0'])
    ut=int(r[2])-int(p[2]); st=int(r[3])-int(p[3]); v=int(r[4])-int(p[4]); nv=int(r[5])-int(p[5])
    tot+=ut+st
    if ut+st+v+nv>0: print(f"  {r[1]:18s} user {ut*10000/n:6.1f}us sys {st*10000/n:6.1f}us  vcs/req {v/n:5.2f} nvcs/req {nv/n:5.2f}")
print(f"  TOTAL cpu/req {tot*10000/n:6.1f}us")
PY
done; done
