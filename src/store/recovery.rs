//! Rebuilding the table from a data directory: the newest snapshot, then every segment after
//! it, in order, applying `max`.
//!
//! The last segment may end in zeros the log wrote ahead of itself: they are unused space,
//! and appending resumes where the records end. Only one kind of damage is repaired: a torn
//! tail, a bad record at the end of the *last* segment with no valid record after it, which
//! is what a crash mid-append leaves. It is copied aside and truncated. Anything else (a gap
//! in the segment sequence, a bad snapshot, a bad record with valid data after it) refuses to
//! start: dropping a record silently could lower `max_seen` and let a stale write through.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::format::{self, Bad, FileKind, HEADER_LEN, Header, Kind, Record};
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
    /// never recorded as answered. The backend may still apply them.
    pub in_flight: Vec<(String, u64)>,
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
    found.in_flight = table.in_flight();
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
fn read_header(file: &mut File, kind: FileKind) -> io::Result<Result<Header, String>> {
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
    match kind {
        Kind::State => table.raise(key, token),
        Kind::Advance => table.advance(key, token),
        Kind::Answered => table.answered(key, token),
        Kind::Commit | Kind::Trailer => {}
    }
}

fn load_snapshot(path: &Path, seq: u64, table: &Table) -> Result<(), StoreError> {
    let seed = check_header(path, FileKind::Snapshot, seq)?.seed(FileKind::Snapshot);
    let mut loaded = 0u64;
    let mut trailer = None;
    let stop = scan(path, seed, |r, at| match r.kind {
        Kind::State | Kind::Advance => {
            table.load(r.key, r.token, r.kind == Kind::Advance);
            loaded += 1;
            Ok(true)
        }
        Kind::Trailer => {
            trailer = Some((at, r.token));
            Ok(false)
        }
        _ => Err(corrupt(path, at, "a log record inside a snapshot")),
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
fn replay_segment(
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
        match r.kind {
            Kind::Advance | Kind::Answered => {
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
            Kind::State | Kind::Trailer => return Err(corrupt(path, at, "a snapshot record inside a log segment")),
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
