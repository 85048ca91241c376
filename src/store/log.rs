//! The synchronous core of the file store: appending to the current segment, committing
//! (one write, one `fdatasync`) and rotating to the next segment (snapshots are `compact`'s).
//! No threads here, so the model-based tests can drive every step, and crash between any two.
//!
//! Only a failed write or sync of log data is fatal ([`LogError::Failed`]). Making room is not:
//! the log writes zeros ahead of its records and creates the next segment ahead of the
//! rotation, and when that fails (a full disk, no descriptor left) the batch it was for is
//! refused whole ([`LogError::NoRoom`]) or the rotation waits, and both are tried again later.
//! A record is therefore only ever written into space the file already has.
//!
//! Every file that recovery reads is created the same way: written under a temporary name,
//! fsync'd, renamed into place, and the directory fsync'd. A name that exists therefore always
//! has a complete header.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::format::{self, FileKind, Header, Kind, Says};
use super::recovery::{Recovered, segment_name};
use super::{MarkBatch, SyncMode};

/// Why the log did not take a batch or a rotation.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LogError {
    /// No room could be made for the batch: nothing of it was written and the log is as it was.
    #[error("no room for the batch: {0}")]
    NoRoom(io::Error),
    /// A write or sync of log data failed: what was written since the last sync is in doubt.
    #[error(transparent)]
    Failed(io::Error),
}

/// The current segment, open for appending.
#[derive(Debug)]
pub(crate) struct Log {
    dir: PathBuf,
    /// The directory, open: a rotation syncs it without needing a descriptor it may not get.
    dir_file: File,
    sync: SyncMode,
    seq: u64,
    file: File,
    /// Where the records end, and the next batch goes.
    len: u64,
    /// Where the file's zeros written ahead end: records up to here need no new space.
    zeroed: u64,
    /// How far ahead zeros are written at a time.
    ahead: u64,
    /// How much of the current segment is known durable: the end of the last synced batch.
    synced: u64,
    seed: u32,
    pending: Vec<u8>,
    /// The next segment, made ahead under a temporary name: a rotation only renames it.
    next: Option<Next>,
    /// Whether the last attempt to make it failed (logged once, until one succeeds).
    next_failing: bool,
    /// Where the last batch refused room would have ended (0: none refused since room was
    /// last found): what [`Log::find_room`] must take before it says there is room.
    refused_end: u64,
}

/// A segment created ahead of its rotation: header and zeros written and synced.
#[derive(Debug)]
struct Next {
    header: Header,
    file: File,
    zeroed: u64,
}

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir/name` atomically with content from `fill`, durable once this returns.
pub(crate) fn create_durably(
    dir: &Path,
    name: &str,
    fill: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
    fill(&mut w)?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// The temporary name of segment `seq` while it is made ahead; recovery removes it.
fn next_name(seq: u64) -> String {
    format!("{}.next.tmp", segment_name(seq))
}

impl Log {
    /// Continues the last recovered segment, or starts the first one. Zeros are written up to
    /// `ahead` bytes ahead of the records (see [`Log::write`]), and the next segment is made.
    pub(crate) fn open(dir: &Path, sync: SyncMode, recovered: &Recovered, ahead: u64) -> io::Result<Log> {
        // Recovery has already read and checked the last segment's header.
        let (header, len) = match recovered.last_header {
            Some(header) if header.version == format::VERSION => (header, recovered.last_end),
            // Written by an older build: closed as a rotation would close it, and the records
            // go on in a new segment of this version. An older build then refuses the directory
            // by the version it does not know, rather than meet records it cannot read.
            Some(old) => {
                let file = OpenOptions::new().write(true).open(dir.join(segment_name(old.seq)))?;
                file.set_len(recovered.last_end)?;
                file.sync_all()?;
                (create_segment(dir, old.seq + 1)?, format::HEADER_LEN as u64)
            }
            None => (create_segment(dir, recovered.snapshot.unwrap_or(1))?, format::HEADER_LEN as u64),
        };
        let file = OpenOptions::new().write(true).open(dir.join(segment_name(header.seq)))?;
        // What a crashed process left in the page cache is valid but maybe not on disk yet.
        file.sync_all()?;
        let zeroed = file.metadata()?.len().max(len);
        let mut log = Log {
            synced: len,
            dir: dir.to_owned(),
            dir_file: File::open(dir)?,
            sync,
            seq: header.seq,
            file,
            len,
            zeroed,
            ahead: ahead.max(4096),
            seed: header.seed(FileKind::Segment),
            pending: Vec::with_capacity(64 * 1024),
            next: None,
            next_failing: false,
            refused_end: 0,
        };
        log.prepare_next();
        Ok(log)
    }

    /// The current segment's sequence number.
    #[cfg(test)]
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// Bytes in the current segment, committed or written.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Path of the current segment.
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join(segment_name(self.seq))
    }

    /// The data directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Buffers one record (an advance or an answer, of a key or a floor) for the next write.
    pub(crate) fn append(&mut self, kind: Kind, key: &str, token: u64) {
        format::encode(&mut self.pending, self.seed, kind, key, token);
    }

    /// Buffers the records of `batch`, one per mark, for the next write.
    pub(crate) fn append_batch(&mut self, batch: &MarkBatch) {
        let says = Says::from(batch.change());
        for mark in batch.marks() {
            // `MarkBatch::check` refused a batch with a change no record says.
            if let Some(kind) = Kind::keyed(says, mark.kind) {
                self.append(kind, &mark.name, batch.token());
            }
        }
    }

    /// Writes the buffered records as one batch, closed by a commit marker naming where the
    /// batch starts, without syncing them (a crash may lose them). If the file has no room for
    /// them and none can be made, they are dropped unwritten: [`LogError::NoRoom`].
    pub(crate) fn write(&mut self) -> Result<(), LogError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        format::encode_commit(&mut self.pending, self.seed, self.len, self.synced);
        let end = self.len + self.pending.len() as u64;
        if let Err(e) = self.make_room(end) {
            self.refused_end = self.refused_end.max(end);
            self.pending.clear();
            return Err(LogError::NoRoom(e));
        }
        let result = self.file.write_all_at(&self.pending, self.len);
        // Count what may have reached the file even on error: it is never reused.
        self.len = end;
        self.pending.clear();
        result.map_err(LogError::Failed)
    }

    /// Whether the disk gives room now for the largest batch it refused, and at least a page
    /// past the zeros already written: takes it (zeros), as the next write would, so that a
    /// store refused room can tell when it has some again without a write to try with. It
    /// always asks the disk: room the file already had did not take the refused batch.
    pub(crate) fn find_room(&mut self) -> io::Result<()> {
        self.make_room(self.refused_end.max(self.zeroed + 1))?;
        self.refused_end = 0;
        Ok(())
    }

    /// Makes sure the file holds zeros up to `end`, writing them `ahead` bytes at a time. An
    /// append that grows the file makes the next fdatasync commit the new size to the file
    /// system's journal too, which costs about as much again as the data; the syncs between
    /// two extensions find the size unchanged and the blocks allocated. And the space a record
    /// goes into is taken before the record is written, so a full disk refuses a batch rather
    /// than fail a write of log data. Recovery reads a tail of zeros as unused.
    fn make_room(&mut self, end: u64) -> io::Result<()> {
        if end <= self.zeroed {
            return Ok(());
        }
        let to = end.div_ceil(self.ahead) * self.ahead;
        let zeros = |from: u64, to: u64| self.file.write_all_at(&vec![0; (to - from) as usize], from);
        // On a nearly full disk, settle for just the room this batch needs.
        let written = zeros(self.zeroed, to).map(|()| to).or_else(|_| {
            let page = end.div_ceil(4096) * 4096;
            zeros(self.zeroed, page).map(|()| page)
        })?;
        self.zeroed = written;
        Ok(())
    }

    /// Makes everything written durable (unless `sync = "never"`, where written counts as
    /// durable: such a store only survives process crashes anyway).
    pub(crate) fn sync(&mut self) -> Result<(), LogError> {
        // Nothing written since the last sync (a rotation that follows a commit).
        if self.synced == self.len {
            return Ok(());
        }
        if self.sync == SyncMode::Always {
            self.file.sync_data().map_err(LogError::Failed)?;
        }
        self.synced = self.len;
        Ok(())
    }

    /// Writes and syncs the buffered records: once this returns they survive a crash.
    pub(crate) fn commit(&mut self) -> Result<(), LogError> {
        self.write()?;
        self.sync()
    }

    /// Flushes to disk whatever the sync mode; used on close.
    pub(crate) fn flush(&mut self) -> Result<(), LogError> {
        self.write()?;
        self.file.sync_all().map_err(LogError::Failed)?;
        self.synced = self.len;
        Ok(())
    }

    /// Moves on to the next segment; the current one is complete. Returns the new sequence
    /// number, which is also the sequence of the snapshot that may now cover everything before
    /// it; or `None` when the next segment could not be made ahead (it is tried again here) or
    /// put in place, in which case the current segment goes on.
    pub(crate) fn rotate(&mut self) -> Result<Option<u64>, LogError> {
        self.commit()?;
        if self.next.is_none() {
            self.prepare_next();
        }
        let Some(next) = self.next.take() else { return Ok(None) };
        // A closed segment ends at its last record, so that recovery can still tell zeros in
        // a segment that is not the last from damage.
        if let Err(e) = self.file.set_len(self.len) {
            tracing::warn!(error = %e, segment = %self.path().display(), "cannot close the log segment; appending to it");
            self.next = Some(next);
            return Ok(None);
        }
        self.zeroed = self.len;
        self.file.sync_all().map_err(LogError::Failed)?;
        let seq = next.header.seq;
        if let Err(e) = fs::rename(self.dir.join(next_name(seq)), self.dir.join(segment_name(seq))) {
            tracing::warn!(error = %e, segment = seq, "cannot put the next log segment in place; appending to the current one");
            return Ok(None);
        }
        // Once the rename is durable, records go to the new segment; if it were lost, they
        // would be too.
        self.dir_file.sync_all().map_err(LogError::Failed)?;
        self.file = next.file;
        self.seq = seq;
        self.seed = next.header.seed(FileKind::Segment);
        self.len = format::HEADER_LEN as u64;
        self.zeroed = next.zeroed;
        self.refused_end = 0;
        self.synced = self.len;
        self.prepare_next();
        Ok(Some(seq))
    }

    /// Makes the segment after the current one under its temporary name, with its header and
    /// a first stretch of zeros, synced. Failing only delays a rotation: it is logged and left
    /// for the next one to try again.
    fn prepare_next(&mut self) {
        let seq = self.seq + 1;
        let path = self.dir.join(next_name(seq));
        let header = Header::new(seq);
        let made = File::create(&path).and_then(|file| {
            file.write_all_at(&header.encode(FileKind::Segment), 0)?;
            let zeroed = self.ahead.max(format::HEADER_LEN as u64);
            let len = format::HEADER_LEN as u64;
            file.write_all_at(&vec![0; (zeroed - len) as usize], len)?;
            file.sync_all()?;
            Ok(Next { header, file, zeroed })
        });
        match made {
            Ok(next) => {
                if std::mem::take(&mut self.next_failing) {
                    tracing::info!(segment = seq, "the next log segment is made ahead again");
                }
                self.next = Some(next);
            }
            Err(e) => {
                if !std::mem::replace(&mut self.next_failing, true) {
                    tracing::warn!(error = %e, segment = seq,
                        "cannot make the next log segment ahead; the current one grows until it can be");
                }
                let _ = fs::remove_file(&path);
            }
        }
    }
}

fn create_segment(dir: &Path, seq: u64) -> io::Result<Header> {
    let header = Header::new(seq);
    create_durably(dir, &segment_name(seq), |w| w.write_all(&header.encode(FileKind::Segment)))?;
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::recovery;
    use crate::store::{Table, format::Kind};

    #[test]
    fn a_look_for_room_takes_what_the_refused_batch_needed_and_always_asks_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let found = recovery::recover(dir.path(), &Table::new(), recovery::Mode::Repair).unwrap();
        let mut log = Log::open(dir.path(), SyncMode::Never, &found, 4096).unwrap();
        log.append(Kind::Advance, "/a", 1);
        log.commit().unwrap();
        // A batch far past the zeros was refused, as on a full disk.
        let zeroed = log.zeroed;
        log.refused_end = zeroed + 40_000;
        log.find_room().unwrap();
        assert!(
            log.zeroed >= zeroed + 40_000,
            "the room the refused batch needed: {} < {}",
            log.zeroed,
            zeroed + 40_000
        );
        assert!(log.file.metadata().unwrap().len() >= zeroed + 40_000);
        assert_eq!(log.refused_end, 0);
        // With nothing refused, a look still writes past the zeros the file has.
        let zeroed = log.zeroed;
        log.find_room().unwrap();
        assert!(log.zeroed > zeroed, "a look that touched no new space proves nothing");
    }
}
