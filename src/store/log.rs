//! The synchronous core of the file store: appending to the current segment, committing
//! (one write, one `fdatasync`) and rotating to a new segment (snapshots are `compact`'s). No
//! threads here, so the model-based tests can drive every step, and crash between any two.
//!
//! Every file is created the same way: write a temp file, fsync it, rename it into place,
//! fsync the directory. A name that exists therefore always has a complete header.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::SyncMode;
use super::format::{self, FileKind, Header, Kind};
use super::recovery::{Recovered, segment_name};

/// The current segment, open for appending.
#[derive(Debug)]
pub(crate) struct Log {
    dir: PathBuf,
    sync: SyncMode,
    seq: u64,
    file: File,
    /// Where the records end, and the next batch goes.
    len: u64,
    /// Where the file ends: from `len` to here it holds zeros written ahead.
    zeroed: u64,
    /// How far ahead zeros are written, at most; 0 once that failed.
    ahead: u64,
    /// How much of the current segment is known durable: the end of the last synced batch.
    synced: u64,
    seed: u32,
    pending: Vec<u8>,
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

impl Log {
    /// Continues the last recovered segment, or starts the first one. Zeros are written up to
    /// `ahead` bytes ahead of the records (see [`Log::write`]).
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
        Ok(Log {
            synced: len,
            dir: dir.to_owned(),
            sync,
            seq: header.seq,
            file,
            len,
            zeroed,
            ahead,
            seed: header.seed(FileKind::Segment),
            pending: Vec::with_capacity(64 * 1024),
        })
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

    /// Buffers one record (an advance or an answer, of a key or a floor) for the next write.
    pub(crate) fn append(&mut self, kind: Kind, key: &str, token: u64) {
        format::encode(&mut self.pending, self.seed, kind, key, token);
    }

    /// Writes the buffered records as one batch, closed by a commit marker naming where the
    /// batch starts, without syncing them (a crash may lose them).
    pub(crate) fn write(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        format::encode_commit(&mut self.pending, self.seed, self.len, self.synced);
        let end = self.len + self.pending.len() as u64;
        let result = self.file.write_all_at(&self.pending, self.len);
        // Count what may have reached the file even on error: it is never reused.
        self.len = end;
        self.pending.clear();
        result?;
        // An append that grows the file makes the next fdatasync commit the new size to the
        // file system's journal too, which costs about as much again as the data. So the log
        // writes zeros ahead of itself once per `ahead` bytes: the syncs in between find the
        // size unchanged and the blocks allocated. Recovery reads a tail of zeros as unused.
        if end > self.zeroed && self.ahead > 0 {
            let to = end.div_ceil(self.ahead) * self.ahead;
            match self.file.write_all_at(&vec![0; (to - end) as usize], end) {
                Ok(()) => self.zeroed = to,
                // Only speed is lost (a full disk, a file size limit): the records are written.
                Err(e) => {
                    tracing::warn!(error = %e, "cannot write zeros ahead of the log; appending from now on");
                    self.ahead = 0;
                }
            }
        }
        Ok(())
    }

    /// Makes everything written durable (unless `sync = "never"`, where written counts as
    /// durable: such a store only survives process crashes anyway).
    pub(crate) fn sync(&mut self) -> io::Result<()> {
        if self.sync == SyncMode::Always {
            self.file.sync_data()?;
        }
        self.synced = self.len;
        Ok(())
    }

    /// Writes and syncs the buffered records: once this returns they survive a crash.
    pub(crate) fn commit(&mut self) -> io::Result<()> {
        self.write()?;
        self.sync()
    }

    /// Flushes to disk whatever the sync mode; used on close.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.write()?;
        self.file.sync_all()?;
        self.synced = self.len;
        Ok(())
    }

    /// Starts the next segment; the current one is complete. Returns the new sequence number,
    /// which is also the sequence of the snapshot that may now cover everything before it.
    pub(crate) fn rotate(&mut self) -> io::Result<u64> {
        self.commit()?;
        // A closed segment ends at its last record, so that recovery can still tell zeros in
        // a segment that is not the last from damage.
        self.file.set_len(self.len)?;
        self.file.sync_all()?;
        let header = create_segment(&self.dir, self.seq + 1)?;
        self.file = OpenOptions::new().write(true).open(self.dir.join(segment_name(header.seq)))?;
        self.seq = header.seq;
        self.seed = header.seed(FileKind::Segment);
        self.len = format::HEADER_LEN as u64;
        self.zeroed = self.len;
        self.synced = self.len;
        Ok(header.seq)
    }
}

fn create_segment(dir: &Path, seq: u64) -> io::Result<Header> {
    let header = Header::new(seq);
    create_durably(dir, &segment_name(seq), |w| w.write_all(&header.encode(FileKind::Segment)))?;
    Ok(header)
}
