//! What the writer does when the disk lets it down: a batch refused room (the store stays
//! sound and tries again, also on a timer, so that a store nobody writes to can tell it has
//! room again and become ready), a failed write or sync (final), and a thread that unwinds.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use super::FileWriter;
use crate::store::StoreError;
use crate::store::log::LogError;

/// How often a store refused room looks for some while no batch comes to try.
pub(super) const ROOM_RETRY: Duration = Duration::from_secs(1);

impl FileWriter {
    /// Looks for room on a disk that refused the last batch; says so once there is some.
    pub(super) fn retry_room(&mut self) {
        if self.failed.is_none() && self.status.full() && self.log.find_room().is_ok() {
            self.room_again();
        }
    }

    /// The disk gave room again: says so, naming what it refused before.
    pub(super) fn room_again(&mut self) {
        let failed = self.status.room_failed();
        if self.status.set_full(None) {
            match failed {
                true => tracing::info!("the disk makes room for the fence log again: advances are accepted"),
                false => tracing::info!("the fence log has room again: advances are accepted"),
            }
        }
    }

    /// Refuses a batch the disk gave no room for. Nothing of it was written, so nothing is in
    /// doubt: the next batch tries again. A full disk (ENOSPC, a quota, a file size limit) is
    /// told apart from an I/O error (EIO, a read-only file system) in the write of zeros that
    /// makes the room: the operator needs to know which to fix.
    pub(super) fn no_room(&mut self, e: std::io::Error) -> StoreError {
        use std::io::ErrorKind::{FileTooLarge, QuotaExceeded, StorageFull};
        let reason = format!("{}: {e}", self.log.path().display());
        if matches!(e.kind(), StorageFull | QuotaExceeded | FileTooLarge) {
            if self.status.set_room(Some(format!("no room on disk for the fence log ({reason})")), false) {
                tracing::error!(error = %reason,
                    "no room on disk for the fence log: fenced writes are refused until there is");
            }
            return StoreError::NoSpace(reason);
        }
        let why = format!("the disk failed to make room for the fence log, an I/O error, not a full disk ({reason})");
        if self.status.set_room(Some(why), true) {
            tracing::error!(error = %reason,
                "the disk failed the write of zeros that makes room for the fence log (an I/O error, not a full \
                disk): fenced writes are refused until it succeeds; check the device (dmesg)");
        }
        StoreError::RoomFailed(reason)
    }

    /// Fails the store for good: after a failed write or sync the kernel may have dropped
    /// dirty pages, so nothing written since the last good sync can be trusted to a later one.
    pub(super) fn fail(&mut self, e: std::io::Error) -> StoreError {
        let reason = format!("{}: {e}", self.log.path().display());
        tracing::error!(error = %reason,
            "fence log write or fsync failed: refusing every fenced write until fencegate is restarted");
        self.failed = Some(reason.clone());
        self.status.set_failed(&reason);
        StoreError::Failed(reason)
    }

    /// Moves to the next segment once the current one is full, and asks for a snapshot unless
    /// one is still being written. A next segment that could not be made ahead only delays this.
    pub(super) fn maybe_rotate(&mut self, compact: &mpsc::SyncSender<u64>) {
        let threshold = self.options.segment_bytes.max(self.snapshot_bytes.load(Ordering::Relaxed));
        if self.failed.is_some() || self.log.len() < threshold {
            return;
        }
        self.status.busy();
        let rotated = self.log.rotate();
        self.status.idle();
        match rotated {
            Ok(Some(seq)) => {
                let _ = compact.try_send(seq);
            }
            Ok(None) | Err(LogError::NoRoom(_)) => {}
            // Rotation syncs the segment it closes and the directory: a failure is a sync failure.
            Err(LogError::Failed(e)) => {
                self.fail(e);
            }
        }
    }
}

/// A writer whose thread unwinds (a panic) still writes what it was given, unsynced. Logged
/// answers spare their resources a quarantine after a restart. Advances nobody was answered
/// for (so never forwarded) are logged too: they only raise `max_seen` and quarantine their
/// resources.
impl Drop for FileWriter {
    fn drop(&mut self) {
        if self.finished || self.failed.is_some() {
            return;
        }
        self.take_answers();
        if !self.batch.is_empty()
            && let Err(e) = self.log.write()
        {
            tracing::warn!(error = %e, "could not log the last answered writes of a dropped store");
        }
    }
}
