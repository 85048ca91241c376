//! Model-based test of the file store's durability.
//!
//! Random programs of appends, commits, unsynced writes, rotations, compactions interrupted at
//! any stage, and crashes that cut the log at any byte past the last sync (and leave zeros or
//! garbage behind) run against the real `Log` and recovery on a real directory. After every
//! restart, each key must be at least its highest acknowledged token and at most its highest
//! written one.

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;

use proptest::prelude::*;

use super::format::HEADER_LEN;
use super::log::{self, Log};
use super::recovery::{self, Mode, snapshot_name};
use super::*;
use crate::config::SyncMode;

const KEYS: [&str; 5] = ["/a", "/b", "/c/d", "/accounts/42", "/e/f/g"];

#[derive(Debug, Clone)]
enum Op {
    /// Buffer an advance.
    Append { key: usize, token: u64 },
    /// Write buffered advances without syncing: at risk until the next sync.
    Write,
    /// Write and sync: every buffered advance is acknowledged.
    Commit,
    /// Close the segment and start the next.
    Rotate,
    /// Snapshot up to the current segment, interrupted after `stage` steps (0: a partial temp
    /// file, 1: renamed into place, 2: covered files removed too).
    Compact { stage: u8, cut: u16 },
    /// Crash: the current segment keeps what was synced plus `cut` of the unsynced bytes,
    /// followed by `tail` (zeros or garbage a crash can leave).
    Crash { cut: u16, tail: Vec<u8> },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..KEYS.len(), 0..1000u64).prop_map(|(key, token)| Op::Append { key, token }),
        2 => Just(Op::Write),
        4 => Just(Op::Commit),
        1 => Just(Op::Rotate),
        1 => (0..3u8, any::<u16>()).prop_map(|(stage, cut)| Op::Compact { stage, cut }),
        2 => (any::<u16>(), prop_oneof![Just(vec![]), prop::collection::vec(Just(0u8), 1..64), prop::collection::vec(any::<u8>(), 1..64)])
            .prop_map(|(cut, tail)| Op::Crash { cut, tail }),
    ]
}

/// What the model knows: acknowledged and written maxima per key.
#[derive(Default)]
struct Model {
    acked: HashMap<&'static str, u64>,
    written: HashMap<&'static str, u64>,
    buffered: Vec<(&'static str, u64)>,
    unsynced: Vec<(&'static str, u64)>,
}

fn raise(map: &mut HashMap<&'static str, u64>, key: &'static str, token: u64) {
    let v = map.entry(key).or_insert(token);
    *v = (*v).max(token);
}

struct World<'a> {
    dir: &'a Path,
    log: Log,
    table: Table,
    /// Length of the current segment that a crash cannot lose.
    durable: u64,
}

impl<'a> World<'a> {
    fn start(dir: &'a Path) -> World<'a> {
        let table = Table::new();
        let found = recovery::recover(dir, &table, Mode::Repair).expect("recovery after a crash");
        let log = Log::open(dir, SyncMode::Never, &found).unwrap();
        let durable = log.len();
        World { dir, log, table, durable }
    }

    fn check(&self, m: &Model) -> Result<(), TestCaseError> {
        for key in KEYS {
            let got = self.table.get(key);
            if let Some(&acked) = m.acked.get(key) {
                prop_assert!(got.is_some_and(|g| g >= acked), "{key}: acknowledged {acked}, recovered {got:?}");
            }
            match (got, m.written.get(key)) {
                (Some(g), Some(&w)) => prop_assert!(g <= w, "{key}: recovered {g} but never wrote above {w}"),
                (Some(g), None) => prop_assert!(false, "{key}: recovered {g} but never written"),
                (None, _) => {}
            }
        }
        Ok(())
    }
}

fn acknowledge(m: &mut Model, w: &World) {
    for (k, t) in m.unsynced.drain(..) {
        raise(&mut m.acked, k, t);
        w.table.raise(k, t); // the writer raises the table after the sync
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::default();
    let mut w = World::start(dir.path());
    for op in ops {
        match op {
            Op::Append { key, token } => {
                w.log.append(KEYS[key], token);
                m.buffered.push((KEYS[key], token));
                raise(&mut m.written, KEYS[key], token);
            }
            Op::Write => {
                w.log.write().unwrap();
                m.unsynced.append(&mut m.buffered);
            }
            Op::Commit => {
                w.log.commit().unwrap();
                m.unsynced.append(&mut m.buffered);
                acknowledge(&mut m, &w);
                w.durable = w.log.len();
            }
            Op::Rotate => {
                w.log.rotate().unwrap();
                m.unsynced.append(&mut m.buffered);
                acknowledge(&mut m, &w);
                w.durable = w.log.len();
            }
            Op::Compact { stage, cut } => compact(&w, stage, cut),
            Op::Crash { cut, tail } => {
                m.buffered.clear();
                m.unsynced.clear();
                crash(&w, cut, &tail);
                w = World::start(dir.path());
                w.check(&m)?;
            }
        }
    }
    // A final clean restart sees everything acknowledged.
    w.log.flush().unwrap();
    drop(w);
    World::start(dir.path()).check(&m)
}

fn compact(w: &World, stage: u8, cut: u16) {
    let seq = w.log.seq();
    if stage == 0 {
        // The crash hit while the temp file was being written.
        let elsewhere = tempfile::tempdir().unwrap();
        log::write_snapshot(elsewhere.path(), seq, &w.table).unwrap();
        let full = fs::read(elsewhere.path().join(snapshot_name(seq))).unwrap();
        let tmp = w.dir.join(format!("{}.tmp", snapshot_name(seq)));
        fs::write(tmp, &full[..usize::from(cut) % full.len()]).unwrap();
        return;
    }
    log::write_snapshot(w.dir, seq, &w.table).unwrap();
    if stage == 2 {
        log::remove_covered(w.dir, seq).unwrap();
    }
}

fn crash(w: &World, cut: u16, tail: &[u8]) {
    let path = w.log.path();
    let len = fs::metadata(&path).unwrap().len();
    let unsynced = len - w.durable;
    let keep = w.durable + u64::from(cut) % (unsynced + 1);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(keep.max(HEADER_LEN as u64)).unwrap();
    drop(f);
    OpenOptions::new().append(true).open(&path).unwrap().write_all(tail).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_acknowledged_advance_survives_any_crash(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
