//! Rebuilding the table from a data directory: the newest snapshot, then every segment after
//! it, in order, applying `max`.
//!
//! Only one kind of damage is repaired: a torn tail, a bad record at the end of the *last*
//! segment with no valid record after it, which is what a crash mid-append leaves. It is
//! copied aside and truncated. Anything else (a gap in the segment sequence, a bad snapshot, a
//! bad record with valid data after it) refuses to start: dropping a record silently could
//! lower `max_seen` and let a stale write through.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::format::{self, Bad, Decoded, HEADER_LEN, Kind};
use super::{StoreError, Table};

const SEGMENT_PREFIX: &str = "segment-";
const SEGMENT_SUFFIX: &str = ".log";
const SNAPSHOT_PREFIX: &str = "snapshot-";
const SNAPSHOT_SUFFIX: &str = ".snap";
const CHUNK: usize = 1 << 20;

/// File name of segment `seq`.
pub(crate) fn segment_name(seq: u64) -> String {
    format!("{SEGMENT_PREFIX}{seq:020}{SEGMENT_SUFFIX}")
}

/// File name of the snapshot that covers every segment below `seq`.
pub(crate) fn snapshot_name(seq: u64) -> String {
    format!("{SNAPSHOT_PREFIX}{seq:020}{SNAPSHOT_SUFFIX}")
}

fn parse_name(name: &str, prefix: &str, suffix: &str) -> Option<u64> {
    name.strip_prefix(prefix)?.strip_suffix(suffix)?.parse().ok()
}

/// The sequence number of a segment or snapshot file name.
pub(crate) fn file_seq(name: &str) -> Option<u64> {
    parse_name(name, SEGMENT_PREFIX, SEGMENT_SUFFIX).or_else(|| parse_name(name, SNAPSHOT_PREFIX, SNAPSHOT_SUFFIX))
}

pub(crate) fn io_err(path: &Path, e: io::Error) -> StoreError {
    StoreError::Io { path: path.to_owned(), message: e.to_string() }
}

fn corrupt(path: &Path, offset: u64, reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt { path: path.to_owned(), offset, reason: reason.into() }
}

/// Whether recovery may change files (the proxy) or only read them (`fencegate inspect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Repair,
    ReadOnly,
}

/// What recovery found.
#[derive(Debug, Default)]
pub(crate) struct Recovered {
    /// The snapshot loaded, by the segment it starts from.
    pub snapshot: Option<u64>,
    /// Live segments, in order.
    pub segments: Vec<u64>,
    /// Valid length of the last segment (after any truncation).
    pub last_len: u64,
    /// Records replayed from segments.
    pub records: u64,
    /// A torn tail found at (segment, offset).
    pub torn: Option<(u64, u64)>,
    /// Files no longer needed: covered segments, older snapshots, unfinished temp files.
    pub obsolete: Vec<PathBuf>,
}

/// Replays `dir` into `table`. In [`Mode::Repair`] a torn tail is set aside and truncated and
/// obsolete files are removed.
pub(crate) fn recover(dir: &Path, table: &Table, mode: Mode) -> Result<Recovered, StoreError> {
    let mut found = Recovered::default();
    let mut segments = Vec::new();
    let mut snapshots = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(seq) = parse_name(&name, SEGMENT_PREFIX, SEGMENT_SUFFIX) {
            segments.push(seq);
        } else if let Some(seq) = parse_name(&name, SNAPSHOT_PREFIX, SNAPSHOT_SUFFIX) {
            snapshots.push(seq);
        } else if name.ends_with(".tmp") {
            found.obsolete.push(entry.path());
        }
    }
    segments.sort_unstable();
    snapshots.sort_unstable();

    if let Some(&snap) = snapshots.last() {
        load_snapshot(&dir.join(snapshot_name(snap)), snap, table)?;
        found.snapshot = Some(snap);
        found.obsolete.extend(snapshots[..snapshots.len() - 1].iter().map(|s| dir.join(snapshot_name(*s))));
        found.obsolete.extend(segments.iter().filter(|s| **s < snap).map(|s| dir.join(segment_name(*s))));
        segments.retain(|s| *s >= snap);
    }
    // The live segments must run without a gap from the snapshot's start (or from 1).
    let mut expect = found.snapshot.unwrap_or(1);
    for &seq in &segments {
        if seq != expect {
            break;
        }
        expect += 1;
    }
    let missing = match (segments.first(), segments.last()) {
        (None, None) if found.snapshot.is_some() => Some(expect),
        (Some(_), Some(&last)) if last + 1 != expect => Some(expect),
        _ => None,
    };
    if let Some(seq) = missing {
        let path = dir.join(segment_name(seq));
        return Err(corrupt(&path, 0, "this segment is missing from the log; records in it may be lost"));
    }

    for (i, &seq) in segments.iter().enumerate() {
        let path = dir.join(segment_name(seq));
        let last = i + 1 == segments.len();
        let (len, records, torn) = replay_segment(&path, seq, table, last, mode)?;
        found.records += records;
        if last {
            found.last_len = len;
            found.torn = torn.map(|at| (seq, at));
        }
    }
    found.segments = segments;
    if mode == Mode::Repair {
        for path in &found.obsolete {
            fs::remove_file(path).map_err(|e| io_err(path, e))?;
        }
        if !found.obsolete.is_empty() {
            File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_err(dir, e))?;
        }
    }
    Ok(found)
}

/// Reads a file record by record in fixed-size chunks, so recovery's memory does not grow
/// with file size. Calls `on` for each valid record; stops at the first trailer or bad record.
struct Scan {
    /// Offset just past the last valid record.
    end: u64,
    /// What stopped the scan before the end of the file, and where.
    stop: Option<(u64, Result<u64, Bad>)>,
}

fn scan(path: &Path, seed: u32, mut on: impl FnMut(&str, u64)) -> Result<(Scan, u64), StoreError> {
    let mut file = File::open(path).map_err(|e| io_err(path, e))?;
    let size = file.metadata().map_err(|e| io_err(path, e))?.len();
    let mut buf = vec![0u8; HEADER_LEN];
    file.read_exact(&mut buf).map_err(|e| io_err(path, e))?;
    let mut offset = HEADER_LEN as u64;
    buf.clear();
    let mut pos = 0;
    let mut eof = false;
    loop {
        match format::decode(&buf[pos..], seed) {
            Ok(Decoded::Record { key, token, used }) => {
                on(key, token);
                pos += used;
                offset += used as u64;
            }
            Ok(Decoded::Trailer { count }) => return Ok((Scan { end: offset, stop: Some((offset, Ok(count))) }, size)),
            Err(Bad::Truncated) if !eof => {
                buf.drain(..pos);
                pos = 0;
                // Appends into spare capacity: no zero-filling of a chunk per read.
                let n = (&mut file).take(CHUNK as u64).read_to_end(&mut buf).map_err(|e| io_err(path, e))?;
                eof = n == 0;
            }
            Err(_) if pos == buf.len() => return Ok((Scan { end: offset, stop: None }, size)),
            Err(bad) => return Ok((Scan { end: offset, stop: Some((offset, Err(bad))) }, size)),
        }
    }
}

fn read_full(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn check_header(path: &Path, kind: Kind, seq: u64) -> Result<(), StoreError> {
    let mut h = [0u8; HEADER_LEN];
    let mut f = File::open(path).map_err(|e| io_err(path, e))?;
    let n = read_full(&mut f, &mut h).map_err(|e| io_err(path, e))?;
    let found = format::parse_header(kind, &h[..n]).map_err(|reason| corrupt(path, 0, reason))?;
    if found != seq {
        return Err(corrupt(path, 16, format!("header says sequence {found}, the file name says {seq}")));
    }
    Ok(())
}

fn load_snapshot(path: &Path, seq: u64, table: &Table) -> Result<(), StoreError> {
    check_header(path, Kind::Snapshot, seq)?;
    let mut loaded = 0u64;
    let (scan, size) = scan(path, format::seed(Kind::Snapshot, seq), |k, t| {
        table.raise(k, t);
        loaded += 1;
    })?;
    // A snapshot is synced before it is renamed into place, so it must be whole.
    match scan.stop {
        Some((at, Ok(count))) if count == loaded && at + 16 == size => Ok(()),
        Some((at, Ok(count))) if count != loaded => {
            Err(corrupt(path, at, format!("trailer counts {count} records, the file holds {loaded}")))
        }
        Some((at, Ok(_))) => Err(corrupt(path, at + 16, "data after the trailer")),
        Some((at, Err(bad))) => Err(corrupt(path, at, bad.to_string())),
        None => Err(corrupt(path, scan.end, "snapshot ends without its trailer")),
    }
}

/// Replays one segment; returns its valid length, records replayed and a torn-tail offset.
fn replay_segment(
    path: &Path,
    seq: u64,
    table: &Table,
    last: bool,
    mode: Mode,
) -> Result<(u64, u64, Option<u64>), StoreError> {
    check_header(path, Kind::Segment, seq)?;
    let seed = format::seed(Kind::Segment, seq);
    let mut records = 0u64;
    let (scan, size) = scan(path, seed, |k, t| {
        table.raise(k, t);
        records += 1;
    })?;
    let Some((at, why)) = scan.stop else { return Ok((scan.end, records, None)) };
    let what = match why {
        Ok(_) => "a snapshot trailer inside a log segment".to_string(),
        Err(bad) => bad.to_string(),
    };
    let tail = read_tail(path, at)?;
    // Records are 8-byte aligned, so only aligned offsets can start one.
    let valid_after = (8..tail.len()).step_by(8).find(|&p| format::decode(&tail[p..], seed).is_ok());
    if let Some(p) = valid_after {
        return Err(corrupt(path, at, format!("{what}, with a valid record at byte {} after it", at + p as u64)));
    }
    if !last {
        return Err(corrupt(path, at, format!("{what} at the end of a segment that is not the last")));
    }
    if mode == Mode::Repair {
        set_aside_and_truncate(path, &tail, at)?;
    }
    tracing::warn!(file = %path.display(), offset = at, bytes = size - at, "torn write at the end of the log (a crash mid-append)");
    Ok((at, records, Some(at)))
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

/// What `fencegate inspect` reports about a data directory.
#[derive(Debug)]
pub struct Inspection {
    /// The recovered table.
    pub table: Table,
    /// Snapshot in use, by the segment it starts from.
    pub snapshot: Option<u64>,
    /// Live segments.
    pub segments: Vec<u64>,
    /// Records replayed from segments.
    pub records: u64,
    /// A torn tail that a proxy would truncate on start, as (segment, offset).
    pub torn: Option<(u64, u64)>,
    /// Bytes used by the data directory's files.
    pub bytes: u64,
}

/// Reads a data directory without changing it. Refuses while a proxy holds its lock, since
/// the files may be changing underneath.
pub fn inspect(dir: &Path) -> Result<Inspection, StoreError> {
    let _lock = super::file::lock(dir, false)?;
    let table = Table::new();
    let found = recover(dir, &table, Mode::ReadOnly)?;
    let mut bytes = 0;
    for entry in fs::read_dir(dir).map_err(|e| io_err(dir, e))?.flatten() {
        bytes += entry.metadata().map(|m| m.len()).unwrap_or(0);
    }
    Ok(Inspection {
        table,
        snapshot: found.snapshot,
        segments: found.segments,
        records: found.records,
        torn: found.torn,
        bytes,
    })
}
