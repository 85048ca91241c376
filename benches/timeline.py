"""Legs of one connection's requests, from `perf script -F tid,cpu,time,event,trace` of the
syscall tracepoints that benches/timeline.sh records.

    timeline.py FILE SERVING_TID CLIENT_FDS BACKEND_FDS [WRITER_TID]

A request starts where the serving thread reads it from the client (a recvfrom on a client fd
that returns bytes) and ends where it writes the response (writev on a client fd). With WRITER_TID (fencegate's
store writer), the legs of a fenced write are cut at the wake-up of the writer (futex), its
pwrite and fdatasync, its wake-up of the serving thread (a write to the runtime's eventfd) and
the serving thread's return from epoll_wait; without, at the forward to the backend (writev on
a backend fd) and the backend's answer (recvfrom on a backend fd). Prints each leg's p50 and
p90 in microseconds, and the p50 of the whole.
"""

import re
import statistics
import sys

LINE = re.compile(r"\s*(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)")


def fds(arg):
    return {f"fd: 0x{int(f):08x}" for f in arg.split(",") if f}


def events(path):
    for line in open(path):
        m = LINE.match(line)
        if m:
            tid, cpu, t, event, rest = m.groups()
            yield int(tid), int(cpu), float(t) * 1e6, event.split(":")[-1], rest


def on(rest, wanted):
    return rest.split(",")[0] in wanted


def main():
    path, serving, client, backend = sys.argv[1], int(sys.argv[2]), fds(sys.argv[3]), fds(sys.argv[4])
    writer = int(sys.argv[5]) if len(sys.argv) > 5 else None
    if writer is None:
        legs = [("read", "the request read, then forwarded"), ("fwd", "the backend"), ("back", "the response written")]
    else:
        legs = [
            ("read", "read, classified, checked, turn and connection taken; the writer woken"),
            ("wake", "the writer wakes and appends (to its pwrite)"),
            ("pwrite", "pwrite"),
            ("sync", "fdatasync"),
            ("synced", "the table raised, the serving thread woken (eventfd)"),
            ("answer", "the serving thread wakes (epoll_wait returns)"),
            ("woken", "the answer reaches the write, which is forwarded"),
            ("fwd", "the backend"),
            ("back", "the response written"),
        ]
    order = [name for name, _ in legs] + ["resp"]
    done, cur = [], None
    reading = None  # the serving thread's recvfrom under way: (time, fd)
    for tid, cpu, t, event, rest in events(path):
        step = None
        if tid == serving and event == "sys_enter_recvfrom":
            reading = (t, rest.split(",")[0])
            continue
        if tid == serving and event == "sys_exit_recvfrom" and reading is not None:
            (began, fd), reading = reading, None
            ret = int(rest.split()[0], 16)
            if ret >= 1 << 63 or ret == 0:
                continue  # EAGAIN, an error or EOF: no bytes, no step
            if fd in client:
                # One connection, one request at a time: bytes from the client begin the next
                # request, whether or not every step of the one before was seen.
                if cur is not None:
                    done.append(cur)
                cur = {"read": began}
                continue
            if fd in backend:
                step, t = "back", began
        if cur is None:
            continue
        if tid == serving and step is None:
            if event == "sys_enter_futex" and "op: 0x00000081" in rest and writer is not None:  # FUTEX_WAKE_PRIVATE
                step = "wake"
            elif event == "sys_exit_epoll_wait" and writer is not None:
                step = "woken"
            elif event == "sys_enter_writev" and on(rest, backend):
                step = "fwd"
            elif event == "sys_enter_writev" and on(rest, client):
                step = "resp"
        elif tid == writer:
            step = {"sys_enter_pwrite64": "pwrite", "sys_enter_fdatasync": "sync",
                    "sys_exit_fdatasync": "synced", "sys_enter_write": "answer"}.get(event)
        # Each step counts once, in order: the first of its kind after the step before it.
        if step is not None and step not in cur:
            before = order[order.index(step) - 1]
            if before in cur:
                cur[step] = t
                cur[step + "_cpu"] = cpu
    complete = [c for c in done if all(s in c for s in order)]
    if not complete:
        print("  no complete request seen")
        return
    for (name, what), nxt in zip(legs, order[1:]):
        d = sorted(c[nxt] - c[name] for c in complete)
        print(f"  {what:72s} p50 {statistics.median(d):6.0f}  p90 {d[int(len(d) * 0.9)]:6.0f}")
    whole = statistics.median(c["resp"] - c["read"] for c in complete)
    print(f"  {'read to response, whole':72s} p50 {whole:6.0f}   ({len(complete)} requests)")
    if writer is not None:
        for same in (True, False):
            d = sorted(c["pwrite"] - c["wake"] for c in complete if (c["wake_cpu"] == c["pwrite_cpu"]) == same)
            if d:
                where = "on the serving thread's CPU" if same else "on the other CPU"
                print(f"    writer woken {where:27s} {len(d) * 100 / len(complete):3.0f}% of writes, "
                      f"futex to pwrite p50 {statistics.median(d):.0f}")


main()
