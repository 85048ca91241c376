//! How the writer thread is scheduled. By default it is an ordinary thread while fenced writes
//! come one at a time, and a batch thread (Linux `SCHED_BATCH`) once they come several to a
//! batch: a batch thread's wake-ups never preempt a running thread of the normal class.
//!
//! Why: the writer wakes several times a batch (for the first advance, then at each step of
//! the sync), and each wake-up, as an ordinary thread, preempts whatever runs on that CPU. On a
//! machine with every CPU busy, that is the thread serving requests, which then pays two context
//! switches for the writer's few microseconds, and the writer commits as soon as the first
//! advance arrives, so batches stay small. As a batch thread it runs once the serving thread
//! yields the CPU (it waits for I/O, or its time slice ends) or on an idle CPU: batches hold
//! what the serving thread produced meanwhile, and the sync's cost is spread over more writes.
//! A lone write has no company to wait for, and as a batch thread it would wait for whatever
//! holds the CPU its wake-up lands on: after `LONE_BATCHES` batches of one write each, the
//! writer is an ordinary thread again. The price is on a machine whose every CPU is kept busy by
//! other work (a flood of pass-through reads, other processes): each wake-up of the writer may
//! then wait for a time slice, which delays fenced writes by up to a few milliseconds.
//! docs/benchmarks.md ("The writer as a batch thread") has both.
//!
//! `SCHED_BATCH` and back need no privilege and keep the thread's nice value. A thread started
//! under another policy than the default (`chrt`, systemd's `CPUSchedulingPolicy=`) is left as
//! it is. rustix has no `sched_setscheduler`, and thread-priority sets a policy only together
//! with a nice value (it would reset one an operator gave the process): these calls are made
//! here, in `sys`.

use std::io;

/// The writer thread's scheduling (`store.writer_scheduling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WriterScheduling {
    /// A batch thread while batches hold several writes, an ordinary one for lone writes (the
    /// default).
    #[default]
    Batch,
    /// Never changed: the policy the process started with, as every other thread.
    Normal,
}

/// Lone batches (one write each) in a row after which a batch thread becomes ordinary again:
/// a few, so that a load between one and two writes a batch does not switch at every batch.
const LONE_BATCHES: u32 = 8;

/// The writer thread's policy as its batches go.
#[derive(Debug)]
pub(super) struct Scheduler {
    /// Whether the policy follows the batches (`Batch`, on a thread under the default policy).
    adapts: bool,
    /// Whether the thread is a batch thread now.
    batch: bool,
    /// Batches of one write in a row.
    lone: u32,
}

impl Scheduler {
    /// The calling thread's scheduler under `setting`: an ordinary thread to begin with.
    pub(super) fn new(setting: WriterScheduling) -> Scheduler {
        let adapts = setting == WriterScheduling::Batch
            && match sys::is_default() {
                Ok(true) => true,
                Ok(false) => {
                    tracing::info!("the store's writer keeps the scheduling policy the process was started with");
                    false
                }
                Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                    tracing::debug!(error = %e, "the store's writer keeps its scheduling policy");
                    false
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the store's writer cannot read its scheduling policy and keeps it");
                    false
                }
            };
        Scheduler { adapts, batch: false, lone: 0 }
    }

    /// Before a batch of `writes` (advances and resets; 0 for answers only) is committed: its
    /// sync's wake-ups are the ones a batch thread lets wait.
    pub(super) fn committing(&mut self, writes: usize) {
        if !self.adapts || writes == 0 {
            return;
        }
        self.lone = if writes == 1 { self.lone.saturating_add(1) } else { 0 };
        let batch = match (self.batch, writes) {
            (false, 2..) => true,
            (true, _) if self.lone >= LONE_BATCHES => false,
            (now, _) => now,
        };
        if batch == self.batch {
            return;
        }
        match sys::set(batch) {
            Ok(()) => self.batch = batch,
            Err(e) => {
                // Refused (a seccomp profile, say): the policy stays as it is from now on.
                let now = if self.batch { "a batch thread" } else { "an ordinary thread" };
                tracing::warn!(
                    error = %e,
                    "store.writer_scheduling = \"batch\": changing the writer's policy was refused; it stays {now}"
                );
                self.adapts = false;
            }
        }
    }

    /// Whether the thread is a batch thread now.
    #[cfg(test)]
    pub(super) fn is_batch(&self) -> bool {
        self.batch
    }
}

/// The system calls, on Linux with glibc (musl's `sched_setscheduler` always fails, by design;
/// elsewhere there is no `SCHED_BATCH`): [`io::ErrorKind::Unsupported`] anywhere else.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)] // two system calls, on no memory but a parameter on this stack
mod sys {
    use std::io;

    /// Whether the calling thread is under the default policy (`SCHED_OTHER`).
    pub(super) fn is_default() -> io::Result<bool> {
        // SAFETY: takes no pointer; pid 0 is the calling thread.
        match unsafe { libc::sched_getscheduler(0) } {
            -1 => Err(io::Error::last_os_error()),
            policy => Ok(policy == libc::SCHED_OTHER),
        }
    }

    /// Makes the calling thread a batch thread (`SCHED_BATCH`), or an ordinary one again.
    pub(super) fn set(batch: bool) -> io::Result<()> {
        // Both take static priority 0, the only one a normal policy has. Pid 0 is the calling
        // thread: Linux applies the policy per thread (POSIX would say per process).
        let param = libc::sched_param { sched_priority: 0 };
        let policy = if batch { libc::SCHED_BATCH } else { libc::SCHED_OTHER };
        // SAFETY: `param` is a valid, initialised sched_param for the duration of the call,
        // which only reads it.
        match unsafe { libc::sched_setscheduler(0, policy, &param) } {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod sys {
    use std::io;

    fn unsupported() -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, "SCHED_BATCH is set on Linux with glibc only")
    }

    pub(super) fn is_default() -> io::Result<bool> {
        Err(unsupported())
    }

    pub(super) fn set(_batch: bool) -> io::Result<()> {
        Err(unsupported())
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// The calling thread's policy, from /proc (field 41 of `stat`, after the command name).
    fn policy() -> u32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(38).unwrap().parse().unwrap()
    }

    const OTHER: u32 = libc::SCHED_OTHER as u32;
    const BATCH: u32 = libc::SCHED_BATCH as u32;

    #[test]
    fn the_writer_is_a_batch_thread_from_a_batch_of_two_until_eight_lone_ones() {
        assert_eq!(policy(), OTHER, "the test runs under the default policy");
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut scheduler = Scheduler::new(WriterScheduling::Batch);
                let mut seen = Vec::new();
                // A batch of answers only (0) changes nothing, not even the count of lone ones.
                for writes in [1, 1, 0, 2, 1, 5, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 3] {
                    scheduler.committing(writes);
                    assert_eq!(scheduler.is_batch(), policy() == BATCH, "the thread is what the scheduler says");
                    seen.push(scheduler.is_batch());
                }
                let want = [
                    false, false, false, true, true, true, true, true, true, true, true, true, true, true, true, false,
                    false, true,
                ];
                assert_eq!(seen, want);
            });
        });
        assert_eq!(policy(), OTHER, "only the writer's own thread is changed");
    }

    #[test]
    fn normal_and_a_thread_started_under_another_policy_are_never_changed() {
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut normal = Scheduler::new(WriterScheduling::Normal);
                normal.committing(10);
                assert_eq!((normal.is_batch(), policy()), (false, OTHER));
            });
            s.spawn(|| {
                sys::set(true).unwrap();
                let mut started_batch = Scheduler::new(WriterScheduling::Batch);
                // What would make an adapting writer a batch thread, then an ordinary one.
                started_batch.committing(2);
                for _ in 0..LONE_BATCHES + 1 {
                    started_batch.committing(1);
                }
                assert_eq!(policy(), BATCH, "left as it was started");
            });
        });
    }
}
