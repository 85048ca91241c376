//! Where a data directory's state begins. [`init`] makes a directory (`fencegate init`), with
//! floors if asked; [`check_initialised`] refuses one that is missing or holds no state, and
//! [`check_log_kept`] one that shows it held a log (`KEYING`, floors in `INIT`) but has no
//! segment or snapshot left.
//!
//! An empty directory and a lost one look alike: a volume that was not mounted, a wiped disk.
//! Opening either as if it were new would forget every `max_seen` and let every stale lock
//! holder write again, so only [`init`] may start a directory's state, and only an operator
//! runs it, knowing which case it is. A directory an earlier build wrote has no `INIT` file; its
//! `KEYING`, segments or snapshots show it was started by use.
//!
//! The floors go into the log as an ordinary batch (FloorAdvance and FloorAnswered records of
//! one committed batch in segment 1), so every reader of the format, older builds included,
//! sees them and none is in flight. The segment is created whole (temp file, fsync, rename),
//! then `INIT`: a crash between the two leaves a directory that holds its floors and opens;
//! a crash before leaves one that holds nothing and is refused until `init` runs again.

use std::fs;
use std::io::Write;
use std::path::Path;

use super::StoreError;
use super::file::{KEYING_FILE, create_dir_durably, lock};
use super::format::{self, FileKind, HEADER_LEN, Header, Kind, MAX_KEY_LEN};
use super::log::create_durably;
use super::recovery::{file_seq, io_err, segment_name};

/// Name of the file `init` leaves in a data directory it made.
pub(crate) const INIT_FILE: &str = "INIT";

/// What a data directory holds, as far as starting a store on it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DirState {
    /// The directory does not exist.
    Missing,
    /// No `INIT`, `KEYING`, segment or snapshot (other files, `LOCK` or `lost+found` say, do
    /// not count).
    Empty,
    /// State, named by the first file found that holds it.
    Holds(String),
}

fn dir_state(dir: &Path) -> Result<DirState, StoreError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(DirState::Missing),
        Err(e) => return Err(io_err(dir, e)),
    };
    let mut found: Option<String> = None;
    for entry in entries {
        let name = entry.map_err(|e| io_err(dir, e))?.file_name().to_string_lossy().into_owned();
        // INIT first, so that the message names it when it is there.
        if name == INIT_FILE {
            return Ok(DirState::Holds(name));
        }
        if found.is_none() && (name == KEYING_FILE || file_seq(&name).is_some()) {
            found = Some(name);
        }
    }
    Ok(found.map_or(DirState::Empty, DirState::Holds))
}

/// Refuses a data directory that does not exist or holds no state: it must be made by
/// [`init`], or have been written by an earlier build.
pub fn check_initialised(dir: &Path) -> Result<(), StoreError> {
    match dir_state(dir)? {
        DirState::Holds(_) => Ok(()),
        DirState::Missing => Err(StoreError::NotInitialised { dir: dir.to_owned(), missing: true }),
        DirState::Empty => Err(StoreError::NotInitialised { dir: dir.to_owned(), missing: false }),
    }
}

/// Makes `dir` a data directory: creates it (durably) if missing, and records in it each of
/// `floors`, `(name, token)`, as a floor durably raised to `token` and answered (a token of 0
/// raises nothing). Refuses a directory that already holds state, or that a running store
/// holds: starting it anew could lower `max_seen`.
pub fn init(dir: &Path, floors: &[(&str, u64)]) -> Result<(), StoreError> {
    if let Some((name, _)) = floors.iter().find(|(name, _)| name.is_empty() || name.len() > MAX_KEY_LEN) {
        return Err(StoreError::KeyTooLong(name.len()));
    }
    create_dir_durably(dir)?;
    let _lock = lock(dir, true)?;
    if let DirState::Holds(found) = dir_state(dir)? {
        return Err(StoreError::AlreadyInitialised { dir: dir.to_owned(), found });
    }
    let floors: Vec<(&str, u64)> = floors.iter().copied().filter(|(_, token)| *token > 0).collect();
    if !floors.is_empty() {
        let path = dir.join(segment_name(1));
        create_durably(dir, &segment_name(1), |w| w.write_all(&floor_segment(&floors)))
            .map_err(|e| io_err(&path, e))?;
    }
    let mut text =
        String::from("# Made by `fencegate init`. The floors below are in the log; this copy is for reading.\n");
    for (name, token) in &floors {
        text.push_str(&format!("floor {token} {name}\n"));
    }
    let path = dir.join(INIT_FILE);
    create_durably(dir, INIT_FILE, |w| w.write_all(text.as_bytes())).map_err(|e| io_err(&path, e))
}

/// Segment 1 holding one committed batch: each floor advanced and answered, so that it counts
/// and nothing is in flight.
fn floor_segment(floors: &[(&str, u64)]) -> Vec<u8> {
    let header = Header::new(1);
    let seed = header.seed(FileKind::Segment);
    let mut bytes = header.encode(FileKind::Segment).to_vec();
    for (name, token) in floors {
        format::encode(&mut bytes, seed, Kind::FloorAdvance, name, *token);
        format::encode(&mut bytes, seed, Kind::FloorAnswered, name, *token);
    }
    // The batch starts right after the header, and only the header was durable before it.
    format::encode_commit(&mut bytes, seed, HEADER_LEN as u64, HEADER_LEN as u64);
    bytes
}

/// Refuses `dir` if it has no segment and no snapshot yet shows that it held a log: `KEYING`,
/// which a store records only once its log exists, or floors in `INIT`, which `init` wrote into
/// segment 1. Its records were lost, and opening it would start every `max_seen` afresh. A
/// directory whose log was never made (`init` with no floor) passes.
pub(crate) fn check_log_kept(dir: &Path) -> Result<(), StoreError> {
    for entry in fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        if file_seq(&entry.map_err(|e| io_err(dir, e))?.file_name().to_string_lossy()).is_some() {
            return Ok(());
        }
    }
    let mut evidence = Vec::new();
    let keying = dir.join(KEYING_FILE);
    match fs::symlink_metadata(&keying) {
        Ok(_) => evidence.push(format!("{KEYING_FILE}, which a store records only once its log exists")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&keying, e)),
    }
    let floors = init_floors(dir)?.unwrap_or_default();
    if !floors.is_empty() {
        let floors: Vec<String> = floors.iter().map(|(name, token)| format!("floor {token} at {name}")).collect();
        evidence.push(format!("{INIT_FILE} lists {}, which init wrote into segment 1", floors.join(", ")));
    }
    if evidence.is_empty() {
        return Ok(());
    }
    Err(StoreError::LogMissing { dir: dir.to_owned(), evidence: evidence.join("; ") })
}

/// The floors `init` recorded in `dir`'s `INIT` file, as `(name, token)`; `None` if `dir` has
/// no `INIT` file (an earlier build wrote it). The log, not this file, is what a store reads.
pub(crate) fn init_floors(dir: &Path) -> Result<Option<Vec<(String, u64)>>, StoreError> {
    let path = dir.join(INIT_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path, e)),
    };
    let floor = |line: &str| {
        let (token, name) = line.strip_prefix("floor ")?.split_once(' ')?;
        Some((name.to_owned(), token.parse().ok()?))
    };
    Ok(Some(text.lines().filter_map(floor).collect()))
}
