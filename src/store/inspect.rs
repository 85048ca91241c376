//! `fencegate inspect`: a data directory read without a proxy and without changing it.

use std::fs;
use std::path::Path;

use super::init::{check_initialised, init_floors};
use super::recovery::{Mode, io_err, recover, size_hint};
use super::{MarkKind, StoreError, Table};

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
    /// Writes in flight when the last proxy stopped, which it will quarantine on start, by key.
    pub in_flight: Vec<(String, u64)>,
    /// Floors recovered (the table's keys are its `len()`).
    pub floors: usize,
    /// Writes that had raised a floor and were in flight when the last proxy stopped, as
    /// `(p, token)`: everything under `p` is quarantined on start.
    pub floors_in_flight: Vec<(String, u64)>,
    /// Bytes used by the data directory's files.
    pub bytes: u64,
    /// The floors `fencegate init` recorded, as `(name, token)` (empty for floor 0); `None`
    /// if the directory has no `INIT` file (an earlier build started it by use).
    pub init_floors: Option<Vec<(String, u64)>>,
}

/// Reads a data directory without changing it. Refuses while a proxy holds its lock, since
/// the files may be changing underneath, and refuses a directory that holds no state as a
/// proxy would.
pub fn inspect(dir: &Path) -> Result<Inspection, StoreError> {
    check_initialised(dir)?;
    let _lock = super::file::lock(dir, false)?;
    let table = Table::with_capacity(size_hint(dir));
    let found = recover(dir, &table, Mode::ReadOnly)?;
    let mut bytes = 0;
    for entry in fs::read_dir(dir).map_err(|e| io_err(dir, e))?.flatten() {
        bytes += entry.metadata().map(|m| m.len()).unwrap_or(0);
    }
    Ok(Inspection {
        init_floors: init_floors(dir)?,
        floors: table.count(MarkKind::Floor),
        floors_in_flight: found.floors_in_flight,
        table,
        snapshot: found.snapshot,
        segments: found.segments,
        records: found.records,
        torn: found.torn,
        in_flight: found.in_flight,
        bytes,
    })
}
