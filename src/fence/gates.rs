//! The gates: one FIFO turn per resource with a write waiting, in flight or quarantined, made
//! on demand and dropped when idle, and their account in the table's bytes.
//!
//! A gate is memory a client can make: a write to a resource the table does not hold makes one
//! with any token above the floors over it, before the store sees the write. So each gate
//! counts for [`gate_bytes`] in the table's [`TableBytes`](crate::store::TableBytes), and a
//! gate for a resource the table does not hold is refused once the table's bytes would pass
//! `store.max_table_bytes`. A gate for a resource it holds is never refused, so known
//! resources keep their turns however full the table is.
//!
//! [`Gates`] owns the map and that account: a gate is made by [`Gates::take`], which waits for
//! its turn, and leaves the map, giving its bytes back, with the last task that touches it
//! ([`Gates::put_back`], or a wait that ends without the turn). Its quarantine state is read
//! and changed only by the holder of its turn, through [`KeyTurn`], or by
//! [`Gates::try_quarantine`] while nobody holds it.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio::time::Instant;

use super::tree::{covers, node};
use super::{FenceError, QuarantineCause};
use crate::store::{MarkRef, Table};

/// What one gate costs in memory beside its key's bytes: its map slot (the boxed key and the
/// `Arc`: 24 bytes) with the map's spare capacity, and the `Arc`'s allocation (the counts, the
/// turn's FIFO semaphore and the quarantine state: about 100 bytes, rounded up by the
/// allocator). Measured with `benches/memory.rs`: see docs/store.md (Memory).
pub const GATE_BYTES: u64 = 160;

/// What the gate of `key` counts for against `store.max_table_bytes`.
pub(crate) fn gate_bytes(key: &str) -> u64 {
    key.len() as u64 + GATE_BYTES
}

/// Per-gate state, only ever touched by the holder of the resource's turn.
#[derive(Debug, Default)]
struct GateState {
    quarantined_until: Option<Instant>,
    cause: QuarantineCause,
    /// While the quarantine runs: the tags that pinned writes whose outcome is unknown were
    /// sent with as `If-Match` (docs/pins.md). Boxed, one pointer in every gate's allocation
    /// (`GATE_BYTES`), as most gates never have any.
    #[allow(clippy::box_collection)]
    late: Option<Box<Vec<Box<str>>>>,
}

/// One resource's gate: its FIFO turn (the mutex) around the state its holder reads.
type ResourceGate = Arc<Mutex<GateState>>;

/// The gates of the resources with a write waiting, in flight or quarantined.
#[derive(Debug)]
pub(super) struct Gates {
    /// Hashed with foldhash, like [`Table`] and for its reasons: each fenced write hashes its
    /// key here twice, to take its turn and to give it back.
    map: DashMap<Box<str>, ResourceGate, foldhash::quality::RandomState>,
    /// The table whose bytes the gates count in.
    table: Arc<Table>,
}

/// One key's turn, held: its gate's state is this holder's until it is put back.
#[derive(Debug)]
pub(super) struct KeyTurn {
    key: Box<str>,
    state: OwnedMutexGuard<GateState>,
}

impl KeyTurn {
    /// The key whose turn this is.
    #[inline]
    pub(super) fn key(&self) -> &str {
        &self.key
    }

    /// How long the key's quarantine still runs at `now`, and what caused it, if it runs. A
    /// quarantine that has expired is ended.
    #[inline]
    pub(super) fn quarantined(&mut self, now: Instant) -> Option<(Duration, QuarantineCause)> {
        match self.state.quarantined_until {
            Some(until) if until > now => Some((until - now, self.state.cause)),
            Some(_) => {
                self.state.quarantined_until = None;
                self.state.late = None;
                None
            }
            None => None,
        }
    }

    /// When the running quarantine ends, and the tags late pinned writes were sent with
    /// (see [`KeyTurn::note_late`]), if it runs and names any.
    pub(super) fn late(&self) -> Option<(Instant, Box<[Box<str>]>)> {
        let until = self.state.quarantined_until?;
        Some((until, self.state.late.as_deref()?.clone().into_boxed_slice()))
    }

    /// Notes, for the running quarantine, that a write sent with `If-Match: <tag>` may still
    /// be applied: it applies whenever the key has that tag again.
    pub(super) fn note_late(&mut self, tag: &str) {
        let late = self.state.late.get_or_insert_default();
        if !late.iter().any(|t| **t == *tag) {
            late.push(tag.into());
        }
    }

    /// Closes the key until `until`, for `cause`, keeping a later end it already has: a write
    /// that passed a running quarantine (a pinned one, docs/pins.md) must not end it early
    /// when `fence.quarantine` was shortened meanwhile. A running quarantine that holds every
    /// write keeps its cause over one that lets pinned writes pass.
    pub(super) fn quarantine(&mut self, until: Instant, cause: QuarantineCause) {
        let running = self.state.quarantined_until.filter(|end| *end > Instant::now());
        if running.is_none() {
            self.state.late = None;
        }
        if running.is_none() || cause != QuarantineCause::UnknownPinnedOutcome {
            self.state.cause = cause;
        }
        self.state.quarantined_until = running.max(Some(until));
    }

    /// Ends the key's quarantine; whether one was running at `now`.
    pub(super) fn lift(&mut self, now: Instant) -> bool {
        self.state.late = None;
        self.state.quarantined_until.take().is_some_and(|until| until > now)
    }
}

/// Releases a resource's gate when a wait for its turn ends without one (timed out, or the
/// waiting future dropped: an HTTP/2 reset, a shutdown deadline).
struct Leaving<'a> {
    gates: &'a Gates,
    key: &'a str,
    armed: bool,
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.gates.release(self.key);
        }
    }
}

impl Gates {
    /// No gates, counting in the bytes of `table`.
    pub(super) fn new(table: Arc<Table>) -> Gates {
        Gates { map: DashMap::default(), table }
    }

    /// Waits (FIFO) until `key` is this write's, at the latest by `deadline` (then
    /// `timed_out`). A gate it would have to make is refused past the table's limit in bytes
    /// unless `always` (see [`Gates::gate`]).
    pub(super) async fn take(
        &self,
        key: &str,
        always: bool,
        deadline: Instant,
        timed_out: &impl Fn() -> FenceError,
    ) -> Result<KeyTurn, FenceError> {
        // Made first, so it is dropped last (a future's locals are dropped in reverse order),
        // after the wait that holds the gate's clone: whoever leaves last finds the count that
        // lets the gate go.
        let mut leaving = Leaving { gates: self, key, armed: true };
        let gate = self.gate(key, always)?;
        let state = tokio::time::timeout_at(deadline, gate.lock_owned()).await.map_err(|_| timed_out())?;
        leaving.armed = false; // the turn releases the gate when it is put back
        Ok(KeyTurn { key: key.into(), state })
    }

    /// Gives back the key turns in `key_turns`, emptying it.
    pub(super) fn put_back(&self, key_turns: &mut Vec<KeyTurn>) {
        for KeyTurn { key, state } in key_turns.drain(..) {
            drop(state);
            self.release(&key);
        }
    }

    /// Closes `key` until `until`, for `cause`, without taking its turn (keeping a later end
    /// it already has); false, changing nothing, when a turn holds it. Its gate is made
    /// whatever the table's bytes.
    pub(super) fn try_quarantine(&self, key: &str, until: Instant, cause: QuarantineCause) -> bool {
        // Never refused: made with `always`.
        let Ok(gate) = self.gate(key, true) else { return false };
        match gate.try_lock() {
            Ok(mut state) => {
                state.quarantined_until = state.quarantined_until.max(Some(until));
                state.cause = cause;
                true
            }
            Err(_) => false,
        }
    }

    /// Number of resources that hold a gate.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Number of writes holding or waiting for `key`'s turn.
    pub(super) fn queue_len(&self, key: &str) -> usize {
        // Each holder and each waiter holds a clone of the gate; the map holds one more.
        self.map.get(key).map_or(0, |g| Arc::strong_count(g.value()) - 1)
    }

    /// Resources quarantined now. A gate whose turn is held is not counted: its state belongs
    /// to its holder.
    pub(super) fn quarantined_len(&self) -> usize {
        let now = Instant::now();
        self.map
            .iter()
            .filter(|g| g.value().try_lock().is_ok_and(|s| s.quarantined_until.is_some_and(|until| until > now)))
            .count()
    }

    /// The keys with a gate now (a write waiting, in flight or quarantined) whose nodes lie
    /// under one of the nodes `subtrees`.
    pub(super) fn keys_under(&self, subtrees: &[Box<str>]) -> Vec<Box<str>> {
        self.map.iter().filter(|g| subtrees.iter().any(|s| covers(s, node(g.key())))).map(|g| g.key().clone()).collect()
    }

    /// The gate of `key`, made if it has none. A new gate for a resource the table does not
    /// hold (as a key, or as a floor at its node) is refused with [`FenceError::Full`] when
    /// its bytes would take the table past its limit, unless `always` (a key that had a gate
    /// a moment ago, a quarantine at start).
    fn gate(&self, key: &str, always: bool) -> Result<ResourceGate, FenceError> {
        match self.map.entry(key.into()) {
            Entry::Occupied(gate) => Ok(Arc::clone(gate.get())),
            Entry::Vacant(slot) => {
                let bytes = gate_bytes(key);
                // Whether the table holds the resource is looked up only once the bytes do not
                // fit: most fenced writes make a gate, and most find room.
                if always || !self.table.try_hold(bytes) {
                    let known = always
                        || self.table.get(key).is_some()
                        || self.table.level(MarkRef::floor(node(key))).is_some();
                    if !known {
                        return Err(FenceError::Full { resource: key.to_owned(), max_bytes: self.table.max_bytes() });
                    }
                    self.table.hold(bytes);
                }
                Ok(Arc::clone(slot.insert(ResourceGate::default()).value()))
            }
        }
    }

    /// Drops `key`'s gate if nobody waits on it, holds it, or needs its quarantine, and gives
    /// its bytes back. Under the shard lock no one can clone the gate, so a count of one (the
    /// map's own) means no task waits on it, and `try_lock` sees the state the last holder left.
    fn release(&self, key: &str) {
        let removed = self.map.remove_if(key, |_, g| {
            Arc::strong_count(g) == 1 && g.try_lock().is_ok_and(|s| s.quarantined_until.is_none())
        });
        if let Some((key, _)) = removed {
            self.table.release(gate_bytes(&key));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::fence::{Coverage, Touch};
    use crate::fence::{Fence, NODE_BYTES};
    use crate::store::MarkRef;
    use crate::store::{FileStore, MARK_BYTES, Store, StoreOptions, SyncMode};

    const WAIT: Duration = Duration::from_secs(10);

    fn put(k: &str) -> Vec<Touch> {
        vec![Touch { key: k.into(), coverage: Coverage::Key }]
    }

    /// A fence whose table holds `/known` (and its tree the root above it) and has room for
    /// `room` bytes more.
    fn fence_with_room(room: u64) -> (Arc<Fence>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let max_table_bytes = 6 + MARK_BYTES + NODE_BYTES + room;
        let options = StoreOptions { sync: SyncMode::Never, max_table_bytes, ..StoreOptions::default() };
        let store = FileStore::open(dir.path(), options).unwrap();
        store.table().raise(MarkRef::key("/known"), 1);
        (Arc::new(Fence::new(Arc::new(store))), dir)
    }

    #[tokio::test]
    async fn gates_count_in_the_table_bytes_and_new_resources_get_none_past_the_limit() {
        let (f, _dir) = fence_with_room(gate_bytes("/new"));
        let first = f.acquire(put("/new"), WAIT).await.unwrap();
        assert_eq!(f.max_seen.bytes().held, NODE_BYTES + gate_bytes("/new"));
        let refused = f.acquire(put("/odd"), WAIT).await.unwrap_err();
        assert!(matches!(&refused, FenceError::Full { resource, .. } if resource == "/odd"), "{refused:?}");
        assert!(refused.to_string().contains("store.max_table_bytes"), "{refused}");
        let known = f.acquire(put("/known"), WAIT).await.expect("a known resource gets its turn past the limit");
        assert_eq!(f.max_seen.bytes().held, NODE_BYTES + gate_bytes("/new") + gate_bytes("/known"));
        drop((first, known));
        let held = (f.active_gates(), f.max_seen.bytes().held);
        assert_eq!(held, (0, NODE_BYTES), "released gates give their bytes back");
        drop(f.acquire(put("/odd"), WAIT).await.expect("room again"));
    }
}
