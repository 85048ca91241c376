//! How the writer thread is scheduled: by default as a batch thread (Linux `SCHED_BATCH`),
//! which the kernel never lets preempt a running thread when it wakes.
//!
//! Why: the writer wakes several times a batch (for the first advance, then at each step of
//! the sync), and each wake-up, as an ordinary thread, preempts whatever runs on that CPU. On a
//! machine with every CPU busy, that is the thread serving requests, which then pays two context
//! switches for the writer's few microseconds, and the writer commits as soon as the first
//! advance arrives, so batches stay small. As a batch thread it runs once the serving thread
//! yields the CPU (it waits for I/O, or its time slice ends) or on an idle CPU: batches hold
//! what the serving thread produced meanwhile, and the sync's cost is spread over more writes.
//! With a CPU idle, nothing changes: the writer runs there at once. The price is on a machine
//! whose every CPU is kept busy by other work (a flood of pass-through reads, other processes):
//! each wake-up of the writer may then wait for a time slice, which delays fenced writes by up
//! to a few milliseconds. docs/benchmarks.md has both. `normal` keeps the kernel's default.
//!
//! `SCHED_BATCH` needs no privilege and keeps the thread's nice value. rustix has no
//! `sched_setscheduler`, and thread-priority sets a policy only together with a nice value
//! (it would reset one an operator gave the process): this is the one call, made here.

use std::io;

/// The writer thread's scheduling policy (`store.writer_scheduling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WriterScheduling {
    /// `SCHED_BATCH` (Linux): never preempts on wake-up (the default).
    #[default]
    Batch,
    /// The kernel's default policy (`SCHED_OTHER`), as every other thread.
    Normal,
}

/// Puts the calling thread under `policy`. Elsewhere than on Linux, `Batch` is unsupported.
pub(super) fn apply(policy: WriterScheduling) -> io::Result<()> {
    match policy {
        WriterScheduling::Normal => Ok(()),
        WriterScheduling::Batch => batch(),
    }
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)] // one system call, on a parameter that lives on this stack
fn batch() -> io::Result<()> {
    // SCHED_BATCH takes static priority 0, the only one a normal policy has. Pid 0 is the
    // calling thread: Linux schedules threads, not processes.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid, initialised sched_param for the duration of the call, which
    // only reads it; the call has no other memory effects.
    match unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(not(target_os = "linux"))]
fn batch() -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "SCHED_BATCH is Linux's"))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The calling thread's policy, from /proc (field 41 of `stat`, after the command name).
    fn policy() -> u32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(38).unwrap().parse().unwrap()
    }

    #[test]
    fn batch_puts_the_calling_thread_alone_under_sched_batch_and_normal_leaves_it() {
        let (batch, normal) = std::thread::scope(|s| {
            let batch = s.spawn(|| {
                apply(WriterScheduling::Batch).unwrap();
                policy()
            });
            let normal = s.spawn(|| {
                apply(WriterScheduling::Normal).unwrap();
                policy()
            });
            (batch.join().unwrap(), normal.join().unwrap())
        });
        assert_eq!((batch, normal), (libc::SCHED_BATCH as u32, libc::SCHED_OTHER as u32));
        assert_eq!(policy(), libc::SCHED_OTHER as u32, "the test's own thread is not changed");
    }
}
