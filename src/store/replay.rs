//! Reading one file of a data directory: a snapshot, which must be whole, or a log segment,
//! replayed batch by batch, whose unsynced tail may be torn (see `recovery` for the directory).
//!
//! A batch's records are applied only once its commit marker is read, so the records of one
//! batch (several marks advanced by one write, say) count all together or not at all.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::format::{self, Bad, FileKind, HEADER_LEN, Header, Kind, Record, Says};
use super::recovery::{Mode, corrupt, io_err};
use super::{MarkRef, StoreError, Table};

const CHUNK: usize = 1 << 20;

/// Reads a file record by record in fixed-size chunks, so recovery's memory does not grow
/// with file size. Calls `on` with each valid record and its offset until `on` says stop;
/// returns where reading stopped and why, if not at the end of the file.
fn scan(
    path: &Path,
    seed: u32,
    mut on: impl FnMut(&Record, u64) -> Result<bool, StoreError>,
) -> Result<Option<(u64, Bad)>, StoreError> {
    let mut file = File::open(path).map_err(|e| io_err(path, e))?;
    io::Seek::seek(&mut file, io::SeekFrom::Start(HEADER_LEN as u64)).map_err(|e| io_err(path, e))?;
    let mut offset = HEADER_LEN as u64;
    let mut buf = Vec::new();
    let mut pos = 0;
    let mut eof = false;
    loop {
        match format::decode(&buf[pos..], seed) {
            Ok(record) => {
                if !on(&record, offset)? {
                    return Ok(None);
                }
                pos += record.used;
                offset += record.used as u64;
            }
            Err(Bad::Truncated) if !eof => {
                buf.drain(..pos);
                pos = 0;
                // Appends into spare capacity: no zero-filling of a chunk per read.
                let n = (&mut file).take(CHUNK as u64).read_to_end(&mut buf).map_err(|e| io_err(path, e))?;
                eof = n == 0;
            }
            Err(_) if pos == buf.len() => return Ok(None),
            Err(bad) => return Ok(Some((offset, bad))),
        }
    }
}

/// Reads and checks the header at the start of `file`.
pub(super) fn read_header(file: &mut File, kind: FileKind) -> io::Result<Result<Header, String>> {
    let mut bytes = Vec::with_capacity(HEADER_LEN);
    file.take(HEADER_LEN as u64).read_to_end(&mut bytes)?;
    Ok(Header::parse(kind, &bytes))
}

fn check_header(path: &Path, kind: FileKind, seq: u64) -> Result<Header, StoreError> {
    let mut f = File::open(path).map_err(|e| io_err(path, e))?;
    let header = read_header(&mut f, kind).map_err(|e| io_err(path, e))?.map_err(|reason| corrupt(path, 0, reason))?;
    if header.seq != seq {
        return Err(corrupt(path, 16, format!("header says sequence {}, the file name says {seq}", header.seq)));
    }
    Ok(header)
}

fn file_len(path: &Path) -> Result<u64, StoreError> {
    fs::metadata(path).map(|m| m.len()).map_err(|e| io_err(path, e))
}

/// Applies one state-bearing record to the table.
fn apply(table: &Table, kind: Kind, key: &str, token: u64) {
    let Some((says, mark)) = kind.says() else { return };
    let mark = MarkRef::new(mark, key);
    match says {
        Says::State => table.raise(mark, token),
        Says::Advance => table.advance(mark, token),
        Says::Answered => table.answered(mark, token),
        Says::Reset => table.reset(mark, token),
        Says::Drop => table.drop_mark(mark),
    }
}

/// Refuses a valid record of a kind its file's format version cannot hold: no build ever wrote
/// it, so it is not a torn write.
fn check_version(path: &Path, header: &Header, r: &Record, at: u64) -> Result<(), StoreError> {
    if r.kind.since() > header.version {
        let reason = format!("a {:?} record in a version {} file", r.kind, header.version);
        return Err(corrupt(path, at, reason));
    }
    Ok(())
}

pub(super) fn load_snapshot(path: &Path, seq: u64, table: &Table) -> Result<(), StoreError> {
    let header = check_header(path, FileKind::Snapshot, seq)?;
    let seed = header.seed(FileKind::Snapshot);
    let mut loaded = 0u64;
    let mut trailer = None;
    let stop = scan(path, seed, |r, at| {
        check_version(path, &header, r, at)?;
        match (r.kind, r.kind.says()) {
            (_, Some((says @ (Says::State | Says::Advance), kind))) => {
                table.load(MarkRef::new(kind, r.key), r.token, says == Says::Advance)
            }
            (Kind::Trailer, _) => {
                trailer = Some((at, r.token));
                return Ok(false);
            }
            _ => return Err(corrupt(path, at, "a log record inside a snapshot")),
        }
        loaded += 1;
        Ok(true)
    })?;
    // A snapshot is synced before it is renamed into place, so it must be whole.
    if let Some((at, bad)) = stop {
        return Err(corrupt(path, at, bad.to_string()));
    }
    match trailer {
        Some((at, count)) if count != loaded => {
            Err(corrupt(path, at, format!("trailer counts {count} records, the file holds {loaded}")))
        }
        Some((at, _)) if at + 24 != file_len(path)? => Err(corrupt(path, at + 24, "data after the trailer")),
        Some(_) => Ok(()),
        None => Err(corrupt(path, HEADER_LEN as u64, "snapshot ends without its trailer")),
    }
}

/// Replays one segment batch by batch: a batch's records count only once its commit marker is
/// read. Returns its header, the records applied, where a torn tail was cut off, and where its
/// records end.
pub(super) fn replay_segment(
    path: &Path,
    seq: u64,
    table: &Table,
    last: bool,
    mode: Mode,
) -> Result<(Header, u64, Option<u64>, u64), StoreError> {
    let header = check_header(path, FileKind::Segment, seq)?;
    let seed = header.seed(FileKind::Segment);
    let mut batch_start = HEADER_LEN as u64;
    // The batch being read: its records, with their keys in one reused arena (no allocation
    // per record: recovery of a million resources must stay well under a second).
    let mut pending: Vec<(Kind, u64, usize, usize)> = Vec::new();
    let mut keys: Vec<u8> = Vec::new();
    let mut records = 0u64;
    let stop = scan(path, seed, |r, at| {
        check_version(path, &header, r, at)?;
        match r.kind {
            Kind::Advance
            | Kind::Answered
            | Kind::FloorAdvance
            | Kind::FloorAnswered
            | Kind::Reset
            | Kind::FloorReset
            | Kind::Bound
            | Kind::Dropped => {
                // In log order: a reset or a drop overrules what came before it and nothing
                // after.
                pending.push((r.kind, r.token, keys.len(), r.key.len()));
                keys.extend_from_slice(r.key.as_bytes());
            }
            Kind::Commit if r.token == batch_start => {
                records += pending.len() as u64;
                for (kind, token, from, len) in pending.drain(..) {
                    if let Ok(key) = std::str::from_utf8(&keys[from..from + len]) {
                        apply(table, kind, key, token);
                    }
                }
                keys.clear();
                batch_start = at + r.used as u64;
            }
            Kind::Commit => return Err(corrupt(path, at, format!("commit marker for a batch at {}", r.token))),
            Kind::State | Kind::FloorState | Kind::BindingState | Kind::Trailer => {
                return Err(corrupt(path, at, "a snapshot record inside a log segment"));
            }
        }
        Ok(true)
    })?;
    let len = file_len(path)?;
    if stop.is_none() && batch_start == len {
        return Ok((header, records, None, len));
    }
    // Everything after the last complete batch, read once: unused zeros, or a torn tail.
    let tail = read_tail(path, batch_start)?;
    let what = match stop {
        None => "a batch without its commit marker".to_string(),
        // Nothing but zeros after the last batch of the last segment: the space the log
        // writes ahead of itself, not yet used (or a batch none of whose bytes reached the
        // disk). Appending resumes at the batch boundary; there is nothing to set aside.
        // Rotation cuts a segment to its records, so elsewhere zeros are damage.
        Some(_) if last && tail.iter().all(|&b| b == 0) => return Ok((header, records, None, batch_start)),
        Some((at, bad)) => {
            // Everything written after the last completed sync can reach the disk in any
            // order, so valid records may follow the damage. Only a later commit marker that
            // says this batch was already durable when it was written proves real damage.
            let after = &tail[usize::try_from(at - batch_start).unwrap_or(usize::MAX).min(tail.len())..];
            let proof = (8..after.len()).step_by(8).find_map(|p| {
                let r = format::decode(&after[p..], seed).ok()?;
                (r.kind == Kind::Commit && r.durable > batch_start).then_some(p)
            });
            if let Some(p) = proof {
                let at_marker = at + p as u64;
                return Err(corrupt(
                    path,
                    at,
                    format!("{bad}, but a batch committed at byte {at_marker} says this data had been synced"),
                ));
            }
            bad.to_string()
        }
    };
    if !last {
        return Err(corrupt(path, batch_start, format!("{what} at the end of a segment that is not the last")));
    }
    tracing::warn!(file = %path.display(), offset = batch_start, bytes = len - batch_start, reason = %what,
        "torn write at the end of the log (a crash mid-append): dropping the unfinished batch");
    if mode == Mode::Repair {
        set_aside_and_truncate(path, &tail, batch_start)?;
    }
    Ok((header, records, Some(batch_start), batch_start))
}

fn read_tail(path: &Path, from: u64) -> Result<Vec<u8>, StoreError> {
    let mut f = File::open(path).map_err(|e| io_err(path, e))?;
    io::Seek::seek(&mut f, io::SeekFrom::Start(from)).map_err(|e| io_err(path, e))?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).map_err(|e| io_err(path, e))?;
    Ok(tail)
}

fn set_aside_and_truncate(path: &Path, tail: &[u8], at: u64) -> Result<(), StoreError> {
    let aside = PathBuf::from(format!("{}.torn-at-{at}", path.display()));
    let work = || -> io::Result<()> {
        fs::write(&aside, tail)?;
        File::open(&aside)?.sync_all()?;
        let f = OpenOptions::new().write(true).open(path)?;
        f.set_len(at)?;
        f.sync_all()
    };
    work().map_err(|e| io_err(path, e))?;
    tracing::warn!(aside = %aside.display(), "kept a copy of the torn tail and truncated the segment");
    Ok(())
}
