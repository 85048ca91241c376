//! Model-based test of the file store's durability.
//!
//! Random programs of advances (of keys, of floors, and of several marks at once, as one write
//! does), resets (of one or several marks to one token, often below their value), bindings of
//! uploads and their drops, answers,
//! commits, unsynced writes, rotations, compactions interrupted at any stage, and crashes run
//! against the real `Log` and recovery on a real directory. A crash keeps what was synced; of
//! the bytes written since, it may cut any suffix, lose any subset of 64-byte sectors (pages
//! land in any order), and leave zeros or garbage behind.
//!
//! The model: recovery applies whole batches in log order (an advance raises a mark, a reset
//! sets it, a drop removes a binding), and of the batches written since the last sync it keeps
//! a prefix. It stops at the
//! first damaged one, and no later one can prove the damage (a commit marker names only what
//! was synced before it was written), so the rest is a torn tail. With `n` such batches a crash
//! leaves one of `n + 1` states: the synced one, then each batch applied on top of the one
//! before; what was only buffered is lost. What recovery found is synced before appending goes
//! on: it is the next synced state. Advances go above their marks' values in log order (after
//! a crash, the recovered ones), as under the fence: after a reset, usually below the value it
//! lowered. After every restart:
//! - each mark (key or floor) lies between its lowest and highest value in those states, and
//!   is one of them: an acknowledged reset is never undone (taking the highest of the log would
//!   bring the older value back), and what was acknowledged after it survives;
//! - all marks together are one of those states: a batch (an advance or a reset of several
//!   marks) survived whole or not at all, and if every byte written survived, the last state;
//! - each mark whose last acknowledged advance, of token `t`, no answer can have cleared is
//!   still reported in flight, at its value: a reset leaves the flag as it was. An answer
//!   clears the flag only if it names the mark's value when applied: one appended after the
//!   advance (durable or not) may have if it names `t`, or any token once a reset follows the
//!   advance (a snapshot holds the reset's value ahead of its place in the log);
//! - a mark never advanced, only reset, is never in flight, and a binding never is.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;

use proptest::prelude::*;

use super::format::HEADER_LEN;
use super::log::Log;
use super::recovery::{self, Mode, Recovered, snapshot_name};
use super::*;
use super::{MarkKind, MarkRef};
use crate::store::SyncMode;

const NAMES: [&str; 5] = ["/a", "/b", "/c/d", "/accounts/42", "/e/f/g"];
/// Every name is a key, a floor and a binding: marks `0..5` are keys, `5..10` the floors of
/// the same names, `10..15` their bindings.
const MARKS: usize = 3 * NAMES.len();
/// The keys and floors: the marks that advance, reset and are answered.
const LEVELS: usize = 2 * NAMES.len();
/// The kinds of mark, in the order of their ranges.
const KINDS: [MarkKind; 3] = [MarkKind::Key, MarkKind::Floor, MarkKind::Upload];
const SECTOR: u64 = 64;

/// A key or a floor.
type Mark = MarkRef<'static>;
/// The value of every mark that has one.
type State = BTreeMap<Mark, u64>;

fn mark(i: usize) -> Mark {
    MarkRef::new(KINDS[i / NAMES.len()], NAMES[i % NAMES.len()])
}

/// The model's mark for one a batch holds.
fn known(m: MarkRef<'_>) -> Mark {
    let at = NAMES.iter().position(|n| *n == m.name).expect("a name of the model");
    let kind = KINDS.iter().position(|k| *k == m.kind).expect("a kind of the model");
    mark(kind * NAMES.len() + at)
}

/// The binding of the name `i`.
fn binding(i: usize) -> usize {
    LEVELS + i
}

#[derive(Debug, Clone)]
enum Op {
    /// Buffer one write's advances of `marks` (the same mark twice counts once) to one token,
    /// `step` above the highest of their values.
    Advance { marks: Vec<usize>, step: u64 },
    /// Buffer one reset of `marks` (the same mark twice counts once) to one token: the highest
    /// of their values plus `shift` (at least 0), so below some or all of them when negative.
    Reset { marks: Vec<usize>, shift: i8 },
    /// Buffer the backend's answer to `mark`'s last acknowledged advance.
    Answered { mark: usize },
    /// Buffer the binding of an upload of the name `name`, `step` above its value.
    Bind { name: usize, step: u64 },
    /// Buffer the drop of the bindings of `names`.
    Drop { names: Vec<usize> },
    /// Write buffered records without syncing: at risk until the next sync.
    Write,
    /// Write and sync: every buffered advance and reset is acknowledged.
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
        6 => (0..LEVELS, 1..5u64).prop_map(|(mark, step)| Op::Advance { marks: vec![mark], step }),
        3 => (prop::collection::vec(0..LEVELS, 2..5), 1..5u64).prop_map(|(marks, step)| Op::Advance { marks, step }),
        3 => (prop::collection::vec(0..LEVELS, 1..4), -12..4i8).prop_map(|(marks, shift)| Op::Reset { marks, shift }),
        3 => (0..LEVELS).prop_map(|mark| Op::Answered { mark }),
        2 => (0..NAMES.len(), 1..5u64).prop_map(|(name, step)| Op::Bind { name, step }),
        2 => prop::collection::vec(0..NAMES.len(), 1..3).prop_map(|names| Op::Drop { names }),
        4 => Just(Op::Write),
        4 => Just(Op::Commit),
        1 => Just(Op::Rotate),
        1 => (0..3u8, any::<u16>()).prop_map(|(stage, cut)| Op::Compact { stage, cut }),
        2 => (any::<u16>(), prop_oneof![Just(0u64), any::<u64>()], tail)
            .prop_map(|(cut, holes, tail)| Op::Crash { cut, holes, tail }),
    ]
}

/// One record that moves a mark: an advance raises it, a reset sets it, a drop removes it.
#[derive(Debug, Clone, Copy)]
struct Change {
    mark: Mark,
    token: u64,
    what: super::Change,
    /// The record's place among all the records appended, answers included: log order.
    at: u64,
}

impl Change {
    fn apply(&self, state: &mut State) {
        if self.what == super::Change::Drop {
            state.remove(&self.mark);
            return;
        }
        let v = state.entry(self.mark).or_insert(self.token);
        *v = if self.what == super::Change::Reset { self.token } else { (*v).max(self.token) };
    }
}

/// What the model knows.
#[derive(Default)]
struct Model {
    /// Every mark as the synced batches leave it: what every crash keeps.
    synced: State,
    /// The batches written since the last sync, in log order: a crash keeps a prefix of them.
    written: Vec<Vec<Change>>,
    /// Changes appended since the last write: every crash loses them.
    buffered: Vec<Change>,
    /// Every mark as all the records appended leave it, were they all to survive.
    latest: State,
    /// Records appended so far: the place of the next one.
    appended: u64,
    /// Per mark, the last acknowledged advance: its place and its token.
    last_acked: HashMap<Mark, (u64, u64)>,
    /// Per mark, the place of the last answer appended for it (durable or not), whatever its
    /// token; and per mark and token, that of the last answer naming that token.
    last_answer: HashMap<Mark, u64>,
    last_answer_of: HashMap<(Mark, u64), u64>,
    /// Per mark, the place of the last reset appended (durable or not).
    last_reset: HashMap<Mark, u64>,
    /// Marks advanced at least once: the others can never be in flight.
    advanced: HashSet<Mark>,
}

impl Model {
    /// Buffers one write's advances, one reset, or one drop, of `marks` (each once, in the
    /// order a store logs them) to one token, `to` the highest of their values: appended
    /// together, they share the next commit marker.
    fn append(&mut self, log: &mut Log, marks: Vec<usize>, to: impl Fn(u64) -> u64, change: super::Change) {
        // Through the store's own batch, as the writer takes it: checked (a mark named twice
        // counts once), then logged by `append_batch`.
        let mut named = MarkBatch::new(change, marks.into_iter().map(|i| mark(i).to_mark()), 0);
        assert!(named.check().unwrap(), "a batch of known names is never refused nor empty");
        let marks: Vec<Mark> = named.marks().iter().map(|m| known(m.borrowed())).collect();
        let token = to(marks.iter().map(|k| self.latest.get(k).copied().unwrap_or(0)).max().unwrap_or(0));
        log.append_batch(&MarkBatch::new(change, marks.iter().map(|m| m.to_mark()), token));
        for mark in marks {
            let change = Change { mark, token, what: change, at: self.place() };
            change.apply(&mut self.latest);
            self.buffered.push(change);
            match change.what {
                super::Change::Reset => {
                    self.last_reset.insert(mark, change.at);
                }
                super::Change::Advance => {
                    self.advanced.insert(mark);
                }
                _ => {}
            }
        }
    }

    fn place(&mut self) -> u64 {
        self.appended += 1;
        self.appended - 1
    }

    /// The states a crash may leave: the synced one, then each written batch in turn on top.
    fn outcomes(&self) -> Vec<State> {
        let mut state = self.synced.clone();
        let mut all = vec![state.clone()];
        for batch in &self.written {
            batch.iter().for_each(|c| c.apply(&mut state));
            all.push(state.clone());
        }
        all
    }

    /// Whether `mark`'s last acknowledged advance must still be in flight: no answer appended
    /// after it can have cleared its flag. Returns its token.
    fn must_fly(&self, mark: Mark) -> Option<u64> {
        let &(at, token) = self.last_acked.get(&mark)?;
        let after = |place: Option<&u64>| place.is_some_and(|&p| p > at);
        let named = after(self.last_answer_of.get(&(mark, token)));
        let any = after(self.last_answer.get(&mark)) && after(self.last_reset.get(&mark));
        (!named && !any).then_some(token)
    }
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

    fn get(&self, mark: Mark) -> Option<u64> {
        self.table.level(mark)
    }

    /// Checks what recovery found against the states `outcomes` a crash may leave; returns it.
    fn check(&self, m: &Model, outcomes: &[State]) -> Result<State, TestCaseError> {
        let mut found = State::new();
        for k in (0..MARKS).map(mark) {
            let got = self.get(k);
            let can: Vec<Option<u64>> = outcomes.iter().map(|s| s.get(&k).copied()).collect();
            let (lo, hi) = (can.iter().min().copied().flatten(), can.iter().max().copied().flatten());
            prop_assert!(got >= lo, "{k:?}: recovered {got:?}, below the lowest it can be, {lo:?} (of {can:?})");
            prop_assert!(got <= hi, "{k:?}: recovered {got:?}, above the highest it can be, {hi:?} (of {can:?})");
            prop_assert!(can.contains(&got), "{k:?}: recovered {got:?}, none of the values it can have, {can:?}");
            found.extend(got.map(|g| (k, g)));
            let reported = match k.kind {
                MarkKind::Key => &self.found.in_flight,
                MarkKind::Floor => &self.found.floors_in_flight,
                MarkKind::Upload => {
                    let bound = self.table.entry(k).map(|(_, flying)| flying);
                    prop_assert!(bound != Some(true), "{k:?}: a binding in flight");
                    continue;
                }
            };
            let flying = reported.iter().find(|(n, _)| n == k.name).map(|(_, t)| *t);
            if let Some(token) = m.must_fly(k) {
                prop_assert!(
                    flying.is_some() && flying == got,
                    "{k:?}: write {token} unanswered, in flight {flying:?}, value {got:?}"
                );
            }
            if !m.advanced.contains(&k) {
                prop_assert_eq!(flying, None, "{:?}: never advanced, only reset, yet in flight", k);
            }
        }
        prop_assert!(
            outcomes.contains(&found),
            "recovered {found:?}, which no prefix of the {} batches written since the last sync leaves: {outcomes:?}",
            outcomes.len() - 1
        );
        Ok(found)
    }

    /// The writer's bookkeeping once a sync has made the written and buffered records durable:
    /// the table changed in log order.
    fn acknowledge(&mut self, m: &mut Model) {
        let written = std::mem::take(&mut m.written);
        for c in written.into_iter().flatten().chain(std::mem::take(&mut m.buffered)) {
            c.apply(&mut m.synced);
            self.table.apply(&MarkBatch::new(c.what, [c.mark.to_mark()], c.token));
            if c.what == super::Change::Advance && c.mark.kind != MarkKind::Upload {
                m.last_acked.insert(c.mark, (c.at, c.token));
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
            Op::Advance { marks, step } => m.append(&mut w.log, marks, |top| top + step, super::Change::Advance),
            Op::Reset { marks, shift } => {
                m.append(&mut w.log, marks, |top| top.saturating_add_signed(shift.into()), super::Change::Reset)
            }
            Op::Bind { name, step } => {
                m.append(&mut w.log, vec![binding(name)], |top| top + step, super::Change::Advance)
            }
            Op::Drop { names } => {
                m.append(&mut w.log, names.into_iter().map(binding).collect(), |_| 0, super::Change::Drop)
            }
            Op::Answered { mark: i } => {
                let k = mark(i);
                if let Some(&(_, t)) = m.last_acked.get(&k) {
                    let answered = MarkBatch::answered([k.to_mark()], t);
                    w.log.append_batch(&answered);
                    let at = m.place();
                    m.last_answer.insert(k, at);
                    m.last_answer_of.insert((k, t), at);
                    w.table.apply(&answered);
                }
            }
            Op::Write => {
                w.log.write().unwrap();
                if !m.buffered.is_empty() {
                    m.written.push(std::mem::take(&mut m.buffered));
                }
            }
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
                m.buffered.clear();
                let outcomes = m.outcomes();
                let records = w.log.len();
                let intact = crash(&w, cut, holes, &tail);
                w = World::start(dir.path());
                let found = w.check(&m, &outcomes)?;
                if intact {
                    // Every record written survived and only zeros follow them (a kill -9, or
                    // a power loss that kept the writes): nothing is torn, nothing set aside,
                    // and appending resumes exactly where the records ended.
                    prop_assert_eq!(w.found.torn, None);
                    prop_assert_eq!(w.log.len(), records);
                    prop_assert_eq!(Some(&found), outcomes.last(), "every batch written survived");
                }
                // Recovery synced what it found: the next crash keeps it, and nothing else.
                m.written.clear();
                m.synced = found.clone();
                m.latest = found;
            }
        }
    }
    // A final clean restart sees everything buffered and written.
    w.log.flush().unwrap();
    w.acknowledge(&mut m);
    let records = w.log.len();
    drop(w);
    let w = World::start(dir.path());
    prop_assert_eq!(w.found.torn, None, "a clean shutdown leaves no torn tail");
    prop_assert_eq!(w.log.len(), records, "and appending resumes where the records end");
    w.check(&m, &m.outcomes()).map(drop)
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
    fn every_acknowledged_change_and_unanswered_write_survives_any_crash(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
