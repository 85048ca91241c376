//! What the writer is doing now, for readiness: whether a write or sync of the log is under
//! way and since when, whether the disk refused room, and whether the store failed. And, with
//! the `stall-hook` feature (tests only), a way to hold a data directory's log writes.

use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the store can do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// Advances are made durable as they come.
    Ready,
    /// A write or sync of the log has been under way this long: advances wait for it.
    Busy(Duration),
    /// No room for the last batch (a full disk, etcd's space quota); advances are refused
    /// until there is.
    Full(String),
    /// The disk failed the write that makes room for the last batch (an I/O error, not a full
    /// disk); advances are refused until such a write succeeds.
    RoomFailed(String),
    /// A write or sync failed; every advance is refused until a restart.
    Failed(String),
    /// The etcd store cannot make advances durable now (no leader, etcd unreachable); it comes
    /// back by itself.
    Unavailable(String),
}

impl Condition {
    /// Whether the store still accepts advances (false after a write or sync failure).
    pub fn healthy(&self) -> bool {
        !matches!(self, Condition::Failed(_))
    }
}

/// Shared by the writer, which sets it, and the store's owner, which reads it.
#[derive(Debug)]
pub(super) struct Status {
    /// When `busy_since` counts from.
    epoch: Instant,
    /// Microseconds from `epoch` to the start of the write under way, plus one; 0 when idle.
    busy_since: AtomicU64,
    full: AtomicBool,
    /// Whether the refusal of room was an I/O error rather than a full disk.
    room_failed: AtomicBool,
    failed: AtomicBool,
    /// Why the store is full or failed.
    reason: Mutex<String>,
}

impl Status {
    pub(super) fn new() -> Status {
        Status {
            epoch: Instant::now(),
            busy_since: AtomicU64::new(0),
            full: AtomicBool::new(false),
            room_failed: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
        }
    }

    /// A write (and sync) of the log starts.
    pub(super) fn busy(&self) {
        let since = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX - 1) + 1;
        self.busy_since.store(since, Ordering::Relaxed);
    }

    /// The write under way ended.
    pub(super) fn idle(&self) {
        self.busy_since.store(0, Ordering::Relaxed);
    }

    /// The disk refused room (`Some(why)`), or gave it (`None`). Returns whether that changed.
    pub(super) fn set_full(&self, why: Option<String>) -> bool {
        self.set_room(why, false)
    }

    /// The disk refused room (`Some(why)`), by an I/O error if `failed`, or gave it (`None`).
    /// Returns whether that changed, the cause included.
    pub(super) fn set_room(&self, why: Option<String>, failed: bool) -> bool {
        let full = why.is_some();
        if let Some(why) = why {
            *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = why;
        }
        let cause_changed = self.room_failed.swap(full && failed, Ordering::Relaxed) != (full && failed);
        let changed = self.full.swap(full, Ordering::Relaxed) != full;
        changed || (full && cause_changed)
    }

    /// Whether the last refusal of room was an I/O error.
    pub(super) fn room_failed(&self) -> bool {
        self.room_failed.load(Ordering::Relaxed)
    }

    /// Whether the disk refused the last batch room.
    pub(super) fn full(&self) -> bool {
        self.full.load(Ordering::Relaxed)
    }

    /// The store failed for good.
    pub(super) fn set_failed(&self, why: &str) {
        *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = why.to_owned();
        self.failed.store(true, Ordering::Relaxed);
    }

    pub(super) fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    pub(super) fn condition(&self) -> Condition {
        let reason = || self.reason.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if self.failed() {
            return Condition::Failed(reason());
        }
        if self.full.load(Ordering::Relaxed) {
            return match self.room_failed() {
                true => Condition::RoomFailed(reason()),
                false => Condition::Full(reason()),
            };
        }
        match self.busy_since.load(Ordering::Relaxed) {
            0 => Condition::Ready,
            since => {
                let started = Duration::from_micros(since - 1);
                Condition::Busy(self.epoch.elapsed().saturating_sub(started))
            }
        }
    }
}

/// A held directory's gate: true while held.
#[cfg(feature = "stall-hook")]
type StallGate = std::sync::Arc<(Mutex<bool>, std::sync::Condvar)>;

/// Log writes held by tests, by data directory.
#[cfg(feature = "stall-hook")]
static STALLS: Mutex<Vec<(std::path::PathBuf, StallGate)>> = Mutex::new(Vec::new());

/// Holds every write and sync of the log in `dir` (as a stalled disk would) until the returned
/// guard is dropped. For tests: compiled only with the `stall-hook` feature.
#[cfg(feature = "stall-hook")]
pub fn hold(dir: &Path) -> Stall {
    let gate: StallGate = std::sync::Arc::new((Mutex::new(true), std::sync::Condvar::new()));
    STALLS.lock().unwrap_or_else(|e| e.into_inner()).push((dir.to_owned(), std::sync::Arc::clone(&gate)));
    Stall { dir: dir.to_owned(), gate }
}

/// Log writes held in a directory; dropping it lets them go.
#[cfg(feature = "stall-hook")]
#[derive(Debug)]
pub struct Stall {
    dir: std::path::PathBuf,
    gate: StallGate,
}

#[cfg(feature = "stall-hook")]
impl Drop for Stall {
    fn drop(&mut self) {
        STALLS.lock().unwrap_or_else(|e| e.into_inner()).retain(|(d, _)| *d != self.dir);
        *self.gate.0.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.gate.1.notify_all();
    }
}

/// Waits while a test holds the log writes of `dir`; nothing without the `stall-hook` feature.
pub(super) fn stall_point(dir: &Path) {
    #[cfg(feature = "stall-hook")]
    {
        let held = STALLS.lock().unwrap_or_else(|e| e.into_inner());
        let gate = held.iter().find(|(d, _)| d == dir).map(|(_, g)| std::sync::Arc::clone(g));
        drop(held);
        if let Some(gate) = gate {
            let mut held = gate.0.lock().unwrap_or_else(|e| e.into_inner());
            while *held {
                held = gate.1.wait(held).unwrap_or_else(|e| e.into_inner());
            }
        }
    }
    #[cfg(not(feature = "stall-hook"))]
    let _ = dir;
}
