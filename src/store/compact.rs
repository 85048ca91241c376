//! Compaction: a snapshot of the table that replaces every segment below a sequence number,
//! the removal of the files it covers, and the thread the writer hands each rotation to.
//!
//! `write_snapshot` and `remove_covered` do no threading of their own, so the model-based tests
//! call them directly and crash between them.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use super::format::{self, FileKind, Header, Kind};
use super::log::{create_durably, sync_dir};
use super::recovery::{file_seq, snapshot_name};
use super::{MarkKind, Table};

/// Writes the snapshot that replaces every segment below `seq`, from `table` (its keys, then its
/// floors). Returns its size.
///
/// `table` may already hold advances from segment `seq` onwards; replay takes the maximum,
/// so those are harmless. It must hold every record of the segments below `seq`, which the
/// store guarantees by raising the table before it acknowledges or rotates.
pub(crate) fn write_snapshot(dir: &Path, seq: u64, table: &Table) -> io::Result<u64> {
    let header = Header::new(seq);
    let seed = header.seed(FileKind::Snapshot);
    let mut size = 0u64;
    create_durably(dir, &snapshot_name(seq), |w| {
        w.write_all(&header.encode(FileKind::Snapshot))?;
        let mut buf = Vec::with_capacity(64 * 1024);
        let mut count = 0u64;
        let mut result = Ok(());
        let mut put = |kind: Kind, key: &str, token: u64| {
            format::encode(&mut buf, seed, kind, key, token);
            count += 1;
            if buf.len() >= 60 * 1024 && result.is_ok() {
                result = w.write_all(&buf);
                buf.clear();
            }
        };
        // An unanswered write must stay in flight across the compaction.
        table.for_each(MarkKind::Key, |key, token, in_flight| {
            put(if in_flight { Kind::Advance } else { Kind::State }, key, token)
        });
        table.for_each(MarkKind::Upload, |name, token, _| put(Kind::BindingState, name, token));
        table.for_each(MarkKind::Floor, |p, token, in_flight| {
            put(if in_flight { Kind::FloorAdvance } else { Kind::FloorState }, p, token)
        });
        result?;
        w.write_all(&buf)?;
        format::write_trailer(w, seed, count)?;
        size = w.get_ref().metadata()?.len() + w.buffer().len() as u64;
        Ok(())
    })?;
    Ok(size)
}

/// Deletes the segments and snapshots that the snapshot `seq` made obsolete.
pub(crate) fn remove_covered(dir: &Path, seq: u64) -> io::Result<usize> {
    let mut removed = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if file_seq(&name).is_some_and(|s| s < seq) {
            fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    if removed > 0 {
        sync_dir(dir)?;
    }
    Ok(removed)
}

/// Starts the compaction thread: for each sequence number it receives, it writes that snapshot
/// from `table`, notes its size in `size`, and removes what it covers. It holds the directory's
/// lock too (a duplicate of the writer's open file description), so a writer that ends never
/// hands the directory over while a snapshot is still being written.
pub(super) fn spawn(
    dir: PathBuf,
    table: &Arc<Table>,
    size: &Arc<AtomicU64>,
    lock: Option<&File>,
    rx: mpsc::Receiver<u64>,
) -> Option<JoinHandle<()>> {
    let (table, size) = (Arc::clone(table), Arc::clone(size));
    let lock = match lock.map(File::try_clone) {
        Some(Ok(lock)) => lock,
        _ => {
            tracing::error!("cannot share the directory lock with the compaction thread: no compaction");
            return None;
        }
    };
    let spawned = std::thread::Builder::new().name("fencegate-compact".into()).spawn(move || {
        let _lock = lock;
        while let Ok(seq) = rx.recv() {
            let started = Instant::now();
            let written = write_snapshot(&dir, seq, &table).and_then(|bytes| {
                size.store(bytes, Ordering::Relaxed);
                remove_covered(&dir, seq).map(|removed| (bytes, removed))
            });
            match written {
                Ok((bytes, removed)) => tracing::info!(seq, bytes, removed, elapsed = %humantime::format_duration(super::recovery::round_ms(started.elapsed())),
                    "snapshot written; covered log segments removed"),
                // The segments are still there, so nothing is lost; the next rotation retries.
                Err(e) => tracing::error!(seq, error = %e, "snapshot failed; keeping the log segments"),
            }
        }
    });
    spawned.map_err(|e| tracing::error!(error = %e, "cannot start the compaction thread")).ok()
}
