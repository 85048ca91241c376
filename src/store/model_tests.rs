//! Model-based test of the file store's durability.
//!
//! Random programs of advances (of keys, of floors, and of several marks at once, as one write
//! does), answers, commits, unsynced writes, rotations, compactions interrupted at any stage,
//! and crashes run against the real `Log` and recovery on a real directory. A crash keeps what
//! was synced; of the bytes written since, it may cut any suffix, lose any subset of 64-byte
//! sectors (pages land in any order), and leave zeros or garbage behind. After every restart:
//! - each mark (key or floor) is at least its highest acknowledged token and at most its
//!   highest written one, and a key never takes a floor's token or the other way round;
//! - each mark whose last acknowledged advance was never answered is still reported in flight;
//! - an advance of several marks survived whole or not at all.

use std::collections::{HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;

use proptest::prelude::*;

use super::MarkKind;
use super::format::{HEADER_LEN, Kind};
use super::log::Log;
use super::recovery::{self, Mode, Recovered, snapshot_name};
use super::*;
use crate::store::SyncMode;

const NAMES: [&str; 5] = ["/a", "/b", "/c/d", "/accounts/42", "/e/f/g"];
/// Every name is a key and a floor: marks `0..5` are keys, `5..10` the floors of the same names.
const MARKS: usize = 2 * NAMES.len();
const SECTOR: u64 = 64;

/// A key or a floor.
type Mark = (MarkKind, &'static str);

fn mark(i: usize) -> Mark {
    (if i < NAMES.len() { MarkKind::Key } else { MarkKind::Floor }, NAMES[i % NAMES.len()])
}

#[derive(Debug, Clone)]
enum Op {
    /// Buffer one write's advances of `marks` (the same mark twice counts once) to one token,
    /// above each one's last.
    Advance { marks: Vec<usize>, step: u64 },
    /// Buffer the backend's answer to `mark`'s latest advance.
    Answered { mark: usize },
    /// Write buffered records without syncing: at risk until the next sync.
    Write,
    /// Write and sync: every buffered advance is acknowledged.
    Commit,
    /// Close the segment and start the next.
    Rotate,
    /// Snapshot up to the current segment, interrupted after `stage` steps (0: a partial temp
    /// file, 1: renamed into place, 2: covered files removed too).
    Compact { stage: u8, cut: u16 },
    /// Crash: keep what was synced plus `cut` of what was written since, minus the sectors
    /// chosen by `holes`, followed by `tail`.
    Crash { cut: u16, holes: u64, tail: Vec<u8> },
}

fn op() -> impl Strategy<Value = Op> {
    let tail =
        prop_oneof![Just(vec![]), prop::collection::vec(Just(0u8), 1..64), prop::collection::vec(any::<u8>(), 1..64)];
    prop_oneof![
        6 => (0..MARKS, 1..5u64).prop_map(|(mark, step)| Op::Advance { marks: vec![mark], step }),
        3 => (prop::collection::vec(0..MARKS, 2..5), 1..5u64).prop_map(|(marks, step)| Op::Advance { marks, step }),
        3 => (0..MARKS).prop_map(|mark| Op::Answered { mark }),
        2 => Just(Op::Write),
        4 => Just(Op::Commit),
        1 => Just(Op::Rotate),
        1 => (0..3u8, any::<u16>()).prop_map(|(stage, cut)| Op::Compact { stage, cut }),
        2 => (any::<u16>(), prop_oneof![Just(0u64), any::<u64>()], tail)
            .prop_map(|(cut, holes, tail)| Op::Crash { cut, holes, tail }),
    ]
}

/// What the model knows.
#[derive(Default)]
struct Model {
    /// Highest token ever written (buffered) per mark, acknowledged or not.
    written: HashMap<Mark, u64>,
    /// Highest acknowledged token per mark.
    acked: HashMap<Mark, u64>,
    /// Per mark, the last acknowledged advance, and whether an answer for it was ever written.
    last_acked: HashMap<Mark, (u64, bool)>,
    /// Answers written for (mark, token), durable or not.
    answered: HashSet<(Mark, u64)>,
    /// Buffered and written-but-unsynced advances.
    unacked: Vec<(Mark, u64)>,
    /// Advances of several marks written since the last restart. Every token is above all the
    /// earlier ones of its marks, and the log only loses a suffix of batches, so after a crash
    /// a mark at or above such a token shows that its batch survived, and with it every mark.
    groups: Vec<(Vec<Mark>, u64)>,
}

struct World<'a> {
    dir: &'a Path,
    log: Log,
    table: Table,
    /// Length of the current segment that a crash cannot lose.
    durable: u64,
    found: Recovered,
}

impl<'a> World<'a> {
    fn start(dir: &'a Path) -> World<'a> {
        let table = Table::new();
        let found = recovery::recover(dir, &table, Mode::Repair).expect("recovery after a crash");
        // A small write-ahead of zeros, so that runs cross it often.
        let log = Log::open(dir, SyncMode::Never, &found, 256).unwrap();
        let durable = log.len();
        World { dir, log, table, durable, found }
    }

    fn get(&self, (kind, name): Mark) -> Option<u64> {
        match kind {
            MarkKind::Key => self.table.get(name),
            MarkKind::Floor => self.table.floor(name),
        }
    }

    fn check(&self, m: &Model) -> Result<(), TestCaseError> {
        for key in (0..MARKS).map(mark) {
            let got = self.get(key);
            if let Some(&acked) = m.acked.get(&key) {
                prop_assert!(got.is_some_and(|g| g >= acked), "{key:?}: acknowledged {acked}, recovered {got:?}");
            }
            match (got, m.written.get(&key)) {
                (Some(g), Some(&w)) => prop_assert!(g <= w, "{key:?}: recovered {g} but never wrote above {w}"),
                (Some(g), None) => prop_assert!(false, "{key:?}: recovered {g} but never written"),
                (None, _) => {}
            }
            if let Some(&(token, answered)) = m.last_acked.get(&key)
                && !answered
            {
                let reported = match key.0 {
                    MarkKind::Key => &self.found.in_flight,
                    MarkKind::Floor => &self.found.floors_in_flight,
                };
                let flying = reported.iter().find(|(k, _)| k == key.1).map(|(_, t)| *t);
                prop_assert!(
                    flying.is_some_and(|f| f >= token),
                    "{key:?}: write {token} unanswered, in flight {flying:?}"
                );
            }
        }
        for (marks, token) in &m.groups {
            let reached: Vec<bool> = marks.iter().map(|&k| self.get(k).is_some_and(|g| g >= *token)).collect();
            prop_assert!(
                reached.iter().all(|&r| r) || !reached.iter().any(|&r| r),
                "the advance of {marks:?} to {token} survived in part: {reached:?}"
            );
        }
        Ok(())
    }

    /// The writer's bookkeeping once a sync has made the buffered advances durable.
    fn acknowledge(&mut self, m: &mut Model) {
        for (k, t) in m.unacked.drain(..) {
            let v = m.acked.entry(k).or_insert(t);
            *v = (*v).max(t);
            m.last_acked.insert(k, (t, m.answered.contains(&(k, t))));
            match k {
                (MarkKind::Key, name) => self.table.advance(name, t),
                (MarkKind::Floor, name) => self.table.advance_floor(name, t),
            }
        }
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::default();
    let mut w = World::start(dir.path());
    for op in ops {
        match op {
            Op::Advance { marks, step } => {
                let mut marks: Vec<Mark> = marks.into_iter().map(mark).collect();
                marks.sort_unstable();
                marks.dedup();
                let t = marks.iter().map(|k| m.written.get(k).copied().unwrap_or(0)).max().unwrap_or(0) + step;
                // One write's records, appended together: they share the next commit marker.
                for &k in &marks {
                    w.log.append(Kind::advance(k.0), k.1, t);
                    m.unacked.push((k, t));
                    m.written.insert(k, t);
                }
                if marks.len() > 1 {
                    m.groups.push((marks, t));
                }
            }
            Op::Answered { mark: i } => {
                let k = mark(i);
                if let Some(&(t, _)) = m.last_acked.get(&k) {
                    w.log.append(Kind::answered(k.0), k.1, t);
                    m.answered.insert((k, t));
                    m.last_acked.insert(k, (t, true));
                    match k.0 {
                        MarkKind::Key => w.table.answered(k.1, t),
                        MarkKind::Floor => w.table.answered_floor(k.1, t),
                    }
                }
            }
            Op::Write => w.log.write().unwrap(),
            Op::Commit | Op::Rotate => {
                if matches!(op, Op::Commit) {
                    w.log.commit().unwrap();
                } else {
                    w.log.rotate().unwrap();
                }
                w.acknowledge(&mut m);
                w.durable = w.log.len();
            }
            Op::Compact { stage, cut } => compact(&w, stage, cut),
            Op::Crash { cut, holes, tail } => {
                m.unacked.clear();
                let records = w.log.len();
                let intact = crash(&w, cut, holes, &tail);
                w = World::start(dir.path());
                w.check(&m)?;
                // Later tokens may raise part of a group lost here: only this restart can tell.
                m.groups.clear();
                if intact {
                    // Every record written survived and only zeros follow them (a kill -9, or
                    // a power loss that kept the writes): nothing is torn, nothing set aside,
                    // and appending resumes exactly where the records ended.
                    prop_assert_eq!(w.found.torn, None);
                    prop_assert_eq!(w.log.len(), records);
                }
            }
        }
    }
    // A final clean restart sees everything acknowledged.
    w.log.flush().unwrap();
    let records = w.log.len();
    drop(w);
    let w = World::start(dir.path());
    prop_assert_eq!(w.found.torn, None, "a clean shutdown leaves no torn tail");
    prop_assert_eq!(w.log.len(), records, "and appending resumes where the records end");
    w.check(&m)
}

fn compact(w: &World, stage: u8, cut: u16) {
    let seq = w.log.seq();
    if stage == 0 {
        // The crash hit while the temp file was being written.
        let elsewhere = tempfile::tempdir().unwrap();
        compact::write_snapshot(elsewhere.path(), seq, &w.table).unwrap();
        let full = fs::read(elsewhere.path().join(snapshot_name(seq))).unwrap();
        let tmp = w.dir.join(format!("{}.tmp", snapshot_name(seq)));
        fs::write(tmp, &full[..usize::from(cut) % full.len()]).unwrap();
        return;
    }
    compact::write_snapshot(w.dir, seq, &w.table).unwrap();
    if stage == 2 {
        compact::remove_covered(w.dir, seq).unwrap();
    }
}

/// Returns whether every record written survived with only zeros after it.
fn crash(w: &World, cut: u16, holes: u64, tail: &[u8]) -> bool {
    let path = w.log.path();
    let before = fs::read(&path).unwrap();
    let mut data = before.clone();
    let len = data.len() as u64;
    let records = w.log.len();
    // Half the crashes cut among the records written since the last sync, half anywhere up
    // to the end of the zeros written ahead (which would otherwise take most of the cuts).
    let end = if cut & 1 == 0 { records } else { len };
    let keep = w.durable + u64::from(cut >> 1) % (end - w.durable + 1);
    data.truncate(keep.max(HEADER_LEN as u64) as usize);
    // Unsynced sectors are lost in any combination: only the synced prefix is safe.
    let first = w.durable.div_ceil(SECTOR);
    for (i, sector) in (first..(keep.div_ceil(SECTOR))).enumerate() {
        if holes >> (i % 64) & 1 == 1 {
            let from = (sector * SECTOR).max(w.durable) as usize;
            let to = ((sector + 1) * SECTOR).min(keep) as usize;
            data[from..to].fill(0);
        }
    }
    data.extend_from_slice(tail);
    let mut f = OpenOptions::new().write(true).truncate(true).open(&path).unwrap();
    f.write_all(&data).unwrap();
    let r = records as usize;
    data.len() >= r && data[..r] == before[..r] && data[r..].iter().all(|&b| b == 0)
}

proptest! {
    #[test]
    fn every_acknowledged_advance_and_unanswered_write_survives_any_crash(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
