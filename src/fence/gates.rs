//! The gates: one FIFO turn per resource with a write waiting, in flight or quarantined, made
//! on demand and dropped when idle, and their account in the table's bytes.
//!
//! A gate is memory a client can make: a write to a resource the table does not hold makes one
//! with any token above the floors over it, before the store sees the write. So each gate
//! counts for [`gate_bytes`] in the table's [`TableBytes`](crate::store::TableBytes), and a
//! gate for a resource the table does not hold is refused once the table's bytes would pass
//! `store.max_table_bytes`. A gate for a resource it holds is never refused, so known
//! resources keep their turns however full the table is.

use std::sync::Arc;

use dashmap::mapref::entry::Entry;

use super::tree::node;
use super::{Fence, FenceError, Gate};

/// What one gate costs in memory beside its key's bytes: its map slot (the boxed key and the
/// `Arc`: 24 bytes) with the map's spare capacity, and the `Arc`'s allocation (the counts, the
/// turn's FIFO semaphore and the quarantine state: about 100 bytes, rounded up by the
/// allocator). Measured with `benches/memory.rs`: see docs/store.md (Memory).
pub const GATE_BYTES: u64 = 160;

/// What the gate of `key` counts for against `store.max_table_bytes`.
pub(crate) fn gate_bytes(key: &str) -> u64 {
    key.len() as u64 + GATE_BYTES
}

impl Fence {
    /// The gate of `key`, made if it has none. A new gate for a resource the table does not
    /// hold (as a key, or as a floor at its node) is refused with [`FenceError::Full`] when
    /// its bytes would take the table past its limit, unless `always` (a key that had a gate
    /// a moment ago, a quarantine at start).
    pub(super) fn gate(&self, key: &str, always: bool) -> Result<Gate, FenceError> {
        match self.gates.entry(key.into()) {
            Entry::Occupied(gate) => Ok(Arc::clone(gate.get())),
            Entry::Vacant(slot) => {
                let bytes = gate_bytes(key);
                // Whether the table holds the resource is looked up only once the bytes do not
                // fit: most fenced writes make a gate, and most find room.
                if always || !self.max_seen.try_hold(bytes) {
                    let known = always || self.max_seen.get(key).is_some() || self.max_seen.floor(node(key)).is_some();
                    if !known {
                        return Err(FenceError::Full {
                            resource: key.to_owned(),
                            max_bytes: self.max_seen.max_bytes(),
                        });
                    }
                    self.max_seen.hold(bytes);
                }
                Ok(Arc::clone(slot.insert(Gate::default()).value()))
            }
        }
    }

    /// Drops `key`'s gate if nobody waits on it, holds it, or needs its quarantine, and gives
    /// its bytes back. Under the shard lock no one can clone the gate, so a count of one (the
    /// map's own) means no task waits on it, and `try_lock` sees the state the last holder left.
    pub(super) fn release_gate(&self, key: &str) {
        let removed = self.gates.remove_if(key, |_, g| {
            Arc::strong_count(g) == 1 && g.try_lock().is_ok_and(|s| s.quarantined_until.is_none())
        });
        if let Some((key, _)) = removed {
            self.max_seen.release(gate_bytes(&key));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::fence::NODE_BYTES;
    use crate::fence::{Coverage, Touch};
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
