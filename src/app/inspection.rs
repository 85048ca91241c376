//! What `fencegate inspect` prints of a data directory it read.

use std::fmt::Write as _;
use std::path::Path;

use crate::store::Inspection;

/// The report of `found`, read from `dir`, with the `top` keys by `max_seen` and as many of the
/// writes that were in flight.
pub fn inspection_report(found: &Inspection, dir: &Path, top: usize) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = report(&mut out, found, dir, top);
    out
}

fn report(out: &mut String, found: &Inspection, dir: &Path, top: usize) -> std::fmt::Result {
    writeln!(out, "data dir   {}", dir.display())?;
    match found.init_floors.as_deref() {
        None => writeln!(out, "init       none recorded (started by an earlier build)")?,
        Some([]) => writeln!(out, "init       fencegate init, no floor")?,
        Some(floors) => {
            for (name, token) in floors {
                writeln!(out, "init       fencegate init, floor {token} at {name}")?;
            }
        }
    }
    writeln!(out, "resources  {}", found.table.len())?;
    writeln!(out, "floors     {}", found.floors)?;
    match found.snapshot {
        Some(seq) => writeln!(out, "snapshot   covers every segment before {seq}")?,
        None => writeln!(out, "snapshot   none")?,
    }
    let segments = match (found.segments.first(), found.segments.last()) {
        (Some(a), Some(b)) => format!("{a}..={b}"),
        _ => "none".into(),
    };
    writeln!(out, "segments   {segments} ({} records replayed)", found.records)?;
    if let Some((seq, at)) = found.torn {
        writeln!(out, "torn tail  segment {seq} at byte {at}: a proxy would set it aside and truncate it on start")?;
    }
    if !found.in_flight.is_empty() {
        writeln!(
            out,
            "in flight  {} writes unanswered when the proxy stopped (quarantined on start):",
            found.in_flight.len()
        )?;
        for (key, token) in found.in_flight.iter().take(top) {
            writeln!(out, "  {token:>20}  {key}")?;
        }
    }
    if !found.floors_in_flight.is_empty() {
        writeln!(
            out,
            "in flight  {} writes under floors unanswered when the proxy stopped (quarantined on start):",
            found.floors_in_flight.len()
        )?;
        for (p, token) in found.floors_in_flight.iter().take(top) {
            writeln!(out, "  {token:>20}  floor {p}")?;
        }
    }
    writeln!(out, "disk       {} bytes", found.bytes)?;
    if top > 0 && !found.table.is_empty() {
        writeln!(out, "top {top} by max_seen:")?;
        for (key, max) in found.table.top(top) {
            writeln!(out, "  {max:>20}  {key}")?;
        }
    }
    Ok(())
}
