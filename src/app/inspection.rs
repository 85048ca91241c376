//! What `fencegate inspect` prints of a data directory it read.

use std::fmt::Write as _;
use std::path::Path;

use crate::store::{Inspection, MarkKind};

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
    let uploads = found.table.count(MarkKind::Upload);
    if uploads > 0 {
        writeln!(out, "uploads    {uploads} multipart uploads bound to their object and token (S3)")?;
    }
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
    in_flight(out, "writes", "", &found.in_flight, top)?;
    in_flight(out, "writes under floors", "floor ", &found.floors_in_flight, top)?;
    writeln!(out, "disk       {} bytes", found.bytes)?;
    if top > 0 && !found.table.is_empty() {
        writeln!(out, "top {top} by max_seen:")?;
        for (key, max) in found.table.top(top) {
            writeln!(out, "  {max:>20}  {key}")?;
        }
    }
    Ok(())
}

/// The writes of one kind that were unanswered when the proxy stopped, `top` of them named.
fn in_flight(out: &mut String, what: &str, kind: &str, flying: &[(String, u64)], top: usize) -> std::fmt::Result {
    if flying.is_empty() {
        return Ok(());
    }
    writeln!(out, "in flight  {} {what} unanswered when the proxy stopped (quarantined on start):", flying.len())?;
    for (name, token) in flying.iter().take(top) {
        writeln!(out, "  {token:>20}  {kind}{name}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Table;

    #[test]
    fn the_report_names_what_was_in_flight_up_to_top() {
        let table = Table::new();
        table.advance(crate::store::MarkRef::upload("/b/k\nid"), 4);
        let found = Inspection {
            table,
            snapshot: None,
            segments: vec![1, 2],
            records: 3,
            torn: None,
            in_flight: vec![("/a".into(), 7), ("/b".into(), 8)],
            floors: 1,
            floors_in_flight: vec![("/d".into(), 9)],
            bytes: 4096,
            init_floors: Some(Vec::new()),
        };
        let report = inspection_report(&found, Path::new("/data"), 1);
        assert!(report.contains("in flight  2 writes unanswered when the proxy stopped"), "{report}");
        assert!(report.contains("                   7  /a\n") && !report.contains("/b"), "{report}");
        assert!(report.contains("in flight  1 writes under floors unanswered"), "{report}");
        assert!(report.contains("                   9  floor /d\n"), "{report}");
        assert!(report.contains("segments   1..=2 (3 records replayed)"), "{report}");
        assert!(report.contains("uploads    1 multipart uploads bound"), "{report}");
        assert!(report.contains("resources  0\n"), "{report}");
    }
}
