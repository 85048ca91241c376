//! Durable `max_seen`: the [`Store`] trait, the in-memory [`Table`] it keeps current, and
//! [`FileStore`], a log-structured store in the tradition of etcd's WAL.
//!
//! The proxy calls [`Store::advance`] and waits for it before forwarding. An implementation
//! must resolve only once the advance would survive a crash, and must have raised the
//! [`Table`] by then. Because the store itself raises the table, and only after the advance is
//! durable, the table is always an image of durable state: a snapshot taken from it can never
//! miss a record of the segments it replaces. A store shared through etcd can be added behind
//! the same trait.

mod file;
pub(crate) mod format;
mod log;
pub(crate) mod recovery;
mod writer;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use dashmap::DashMap;

pub use file::{CommitHook, FileStore, StoreOptions};
pub use recovery::{Inspection, inspect};

/// A boxed future returned by [`Store`] methods.
pub type StoreFuture<'a> = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

/// Durable memory of `max_seen`.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Records that `key` accepted `token`; resolves once a crash can no longer lose it, with
    /// the store's [`Table`] already raised.
    fn advance(&self, key: &str, token: u64) -> StoreFuture<'_>;
    /// Notes that the write that advanced `key` to `token` has been answered by the backend,
    /// so it is no longer in flight. Need not be durable: if lost, a restart quarantines the
    /// resource once more than needed.
    fn done(&self, key: &str, token: u64);
    /// Flushes everything and stops; later advances fail with [`StoreError::Closed`].
    fn close(&self) -> StoreFuture<'_>;
    /// Whether the store still accepts advances (false after a write or sync failure).
    fn healthy(&self) -> bool;
}

/// Store failures. All of them keep fenced writes from being forwarded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Another process holds the data directory's lock.
    #[error("data dir {} is in use by another fencegate (lock held on {})", .dir.display(), .dir.join(file::LOCK_FILE).display())]
    Locked {
        /// The data directory.
        dir: PathBuf,
    },
    /// An I/O error while opening, recovering or compacting.
    #[error("{}: {message}", .path.display())]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// Damage that is not a torn tail: starting would risk lowering `max_seen`.
    #[error("{}: corrupt at byte {offset}: {reason}; refusing to start (a dropped record could lower max_seen)", .path.display())]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// Byte offset of the damage.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A write or sync failed; the store accepts no more advances until restarted.
    #[error("store failed and refuses further advances until restart: {0}")]
    Failed(String),
    /// The table holds `store.max_resources` resources; new ones are refused.
    #[error("the fence table is full ({0} resources, store.max_resources); only known resources accept writes")]
    Full(usize),
    /// The data directory's keys were made under other key rules (scopes, canonicalisation).
    #[error("{}: its fence keys were made under other key rules (recorded: {recorded:?}; configured: {configured:?}); \
        resources would get new keys without their max_seen and stale writes would pass. Restore the previous \
        [[fence.scopes]], or, once every lock holder has taken a new token, start with an empty data dir", .dir.display())]
    KeyingChanged {
        /// The data directory.
        dir: PathBuf,
        /// Rules recorded in the directory.
        recorded: String,
        /// Rules in the configuration.
        configured: String,
    },
    /// The key is longer than a record can hold.
    #[error("resource key of {0} bytes is too long")]
    KeyTooLong(usize),
    /// The store was closed.
    #[error("store is closed")]
    Closed,
}

/// One resource in the [`Table`].
#[derive(Debug, Clone, Copy)]
struct Entry {
    token: u64,
    /// The write that raised `token` is on its way to the backend, not yet answered. (Under
    /// the fence a key's latest advance is also its maximum, so one flag per key suffices.)
    in_flight: bool,
}

/// The in-memory image of every resource's durable `max_seen`, and of which writes are in
/// flight.
///
/// Hashed with foldhash rather than SipHash: recovery hashes every key at least once per
/// record, and SipHash was a third of its time. Its per-process random seed keeps clients
/// from precomputing colliding paths.
#[derive(Debug, Default)]
pub struct Table {
    map: DashMap<Box<str>, Entry, foldhash::quality::RandomState>,
}

impl Table {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table with room for `capacity` resources, so loading them never rehashes.
    pub fn with_capacity(capacity: usize) -> Self {
        Table { map: DashMap::with_capacity_and_hasher(capacity, Default::default()) }
    }

    /// The highest durable token of `key`.
    pub fn get(&self, key: &str) -> Option<u64> {
        self.map.get(key).map(|e| e.token)
    }

    /// The highest durable token of `key`, and whether its write is still in flight.
    pub fn entry(&self, key: &str) -> Option<(u64, bool)> {
        self.map.get(key).map(|e| (e.token, e.in_flight))
    }

    /// Number of resources.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no resource has been seen.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Applies `f` to `key`'s entry, creating it at `token` if new.
    fn update(&self, key: &str, token: u64, f: impl FnOnce(&mut Entry)) {
        // Look up before inserting so a known key costs no allocation.
        if let Some(mut e) = self.map.get_mut(key) {
            f(&mut e);
            return;
        }
        f(&mut self.map.entry(key.into()).or_insert(Entry { token, in_flight: false }));
    }

    /// Loads a snapshot entry. Snapshot keys are unique, so this goes straight to the entry:
    /// one probe instead of a lookup and then an insert.
    pub(crate) fn load(&self, key: &str, token: u64, in_flight: bool) {
        let mut e = self.map.entry(key.into()).or_insert(Entry { token, in_flight });
        e.token = e.token.max(token);
        e.in_flight |= in_flight;
    }

    /// Raises `key` to `token` (never lowers it). Only stores call this, once it is durable.
    pub(crate) fn raise(&self, key: &str, token: u64) {
        self.update(key, token, |e| e.token = e.token.max(token));
    }

    /// Raises `key` to `token` and marks its write in flight.
    pub(crate) fn advance(&self, key: &str, token: u64) {
        self.update(key, token, |e| {
            e.token = e.token.max(token);
            e.in_flight = true;
        });
    }

    /// Notes that the backend answered the write of `token` to `key`.
    pub(crate) fn answer(&self, key: &str, token: u64) {
        if let Some(mut e) = self.map.get_mut(key)
            && e.token == token
        {
            e.in_flight = false;
        }
    }

    /// Visits every entry as `(key, max_seen, in_flight)`, in no particular order.
    pub fn for_each(&self, mut f: impl FnMut(&str, u64, bool)) {
        for e in self.map.iter() {
            f(e.key(), e.value().token, e.value().in_flight);
        }
    }

    /// Writes still in flight, as `(key, token)`.
    pub fn in_flight(&self) -> Vec<(String, u64)> {
        let mut flying = Vec::new();
        self.for_each(|k, t, f| {
            if f {
                flying.push((k.to_owned(), t));
            }
        });
        flying
    }

    /// The `n` entries with the highest tokens, highest first.
    pub fn top(&self, n: usize) -> Vec<(String, u64)> {
        let mut heap = std::collections::BinaryHeap::new();
        self.for_each(|k, t, _| {
            if heap.len() < n || heap.peek().is_some_and(|std::cmp::Reverse((min, _))| t > *min) {
                heap.push(std::cmp::Reverse((t, k.to_owned())));
                if heap.len() > n {
                    heap.pop();
                }
            }
        });
        let mut top: Vec<_> = heap.into_iter().map(|std::cmp::Reverse((t, k))| (k, t)).collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top
    }
}

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod table_tests {
    use super::*;

    #[test]
    fn table_only_climbs_and_ranks_its_top_entries() {
        let t = Table::new();
        t.raise("/a", 5);
        t.raise("/a", 3);
        t.raise("/b", 9);
        t.raise("/c", 7);
        assert_eq!(t.get("/a"), Some(5));
        t.advance("/a", 6);
        t.answer("/a", 5);
        assert_eq!(t.entry("/a"), Some((6, true)), "an answer for an older token clears nothing");
        t.answer("/a", 6);
        assert_eq!(t.entry("/a"), Some((6, false)));
        assert_eq!(t.top(2), vec![("/b".to_string(), 9), ("/c".to_string(), 7)]);
        assert_eq!(t.top(0), vec![]);
        assert_eq!(t.len(), 3);
    }
}
