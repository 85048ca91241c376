//! Rebuilding the table from a data directory: the newest snapshot, then every segment after
//! it, in order, applying `max` per key and per floor. Reading each file is `replay`'s.
//!
//! The last segment may end in zeros the log wrote ahead of itself: they are unused space,
//! and appending resumes where the records end. Only one kind of damage is repaired: a torn
//! tail, a bad record at the end of the *last* segment with no valid record after it, which
//! is what a crash mid-append leaves. It is copied aside and truncated. Anything else (a gap
//! in the segment sequence, a log lost whole, a bad snapshot, a bad record with valid data
//! after it) refuses to start: dropping a record silently could lower `max_seen` and let a
//! stale write through.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::format::{self, FileKind, Header, Kind};
use super::init::check_log_kept;
use super::replay::{load_snapshot, read_header, replay_segment};
use super::{MarkKind, StoreError, Table};

const SEGMENT_PREFIX: &str = "segment-";
const SEGMENT_SUFFIX: &str = ".log";
const SNAPSHOT_PREFIX: &str = "snapshot-";
const SNAPSHOT_SUFFIX: &str = ".snap";

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

/// `d` to the millisecond, for log lines (humantime would print every nanosecond).
pub(crate) fn round_ms(d: std::time::Duration) -> std::time::Duration {
    std::time::Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) fn io_err(path: &Path, e: io::Error) -> StoreError {
    StoreError::Io { path: path.to_owned(), message: e.to_string() }
}

pub(crate) fn corrupt(path: &Path, offset: u64, reason: impl Into<String>) -> StoreError {
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
    /// The last segment's header, where appending goes on.
    pub last_header: Option<Header>,
    /// Where the last segment's records end: appending goes on there. The file may go on
    /// past it with zeros written ahead of the log (see `Log::write`).
    pub last_end: u64,
    /// Records replayed from segments.
    pub records: u64,
    /// A torn tail found at (segment, offset).
    pub torn: Option<(u64, u64)>,
    /// Writes that were on their way to the backend when the process stopped: advanced, but
    /// never recorded as answered. The backend may still apply them. By key.
    pub in_flight: Vec<(String, u64)>,
    /// The same for floors: writes that raised a floor and were never answered.
    pub floors_in_flight: Vec<(String, u64)>,
    /// Files no longer needed: covered segments, older snapshots, unfinished temp files.
    pub obsolete: Vec<PathBuf>,
}

/// How many resources recovering `dir` will load, at most about: the newest snapshot's
/// record count plus a share of the live segments' bytes. Sizing the table up front saves
/// rehashing it as it grows.
pub(crate) fn size_hint(dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    let (mut snapshot, mut segment_bytes) = (None, Vec::new());
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let len = entry.metadata().map(|m| m.len()).unwrap_or(0);
        if let Some(seq) = parse_name(&name, SNAPSHOT_PREFIX, SNAPSHOT_SUFFIX) {
            snapshot = snapshot.max(Some((seq, entry.path())));
        } else if let Some(seq) = parse_name(&name, SEGMENT_PREFIX, SEGMENT_SUFFIX) {
            segment_bytes.push((seq, len));
        }
    }
    let from = snapshot.as_ref().map_or(0, |(seq, _)| *seq);
    let counted = snapshot.and_then(|(seq, path)| snapshot_count(&path, seq)).unwrap_or(0);
    // An advance and its answer take about 100 bytes of log for a short key.
    let logged: u64 = segment_bytes.iter().filter(|(seq, _)| *seq >= from).map(|(_, len)| len / 64).sum();
    usize::try_from(counted + logged).unwrap_or(usize::MAX)
}

/// The record count in a snapshot's trailer, if it reads as one.
fn snapshot_count(path: &Path, seq: u64) -> Option<u64> {
    let mut f = File::open(path).ok()?;
    let header = read_header(&mut f, FileKind::Snapshot).ok()?.ok().filter(|h| h.seq == seq)?;
    io::Seek::seek(&mut f, io::SeekFrom::End(-24)).ok()?;
    let mut tail = Vec::with_capacity(24);
    f.read_to_end(&mut tail).ok()?;
    let record = format::decode(&tail, header.seed(FileKind::Snapshot)).ok()?;
    (record.kind == Kind::Trailer).then_some(record.token)
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
    if segments.is_empty() && snapshots.is_empty() {
        // Nothing to replay: a directory whose log was never made, or one that lost it.
        check_log_kept(dir)?;
    }

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
        let (header, records, torn, end) = replay_segment(&path, seq, table, last, mode)?;
        found.records += records;
        if last {
            found.last_header = Some(header);
            found.last_end = end;
            found.torn = torn.map(|at| (seq, at));
        }
    }
    found.segments = segments;
    found.in_flight = table.in_flight(MarkKind::Key);
    found.floors_in_flight = table.in_flight(MarkKind::Floor);
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
