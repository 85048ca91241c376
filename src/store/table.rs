//! [`Table`]: the in-memory image of every resource's durable `max_seen`.

use dashmap::DashMap;

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
    pub(crate) fn answered(&self, key: &str, token: u64) {
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
mod tests {
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
        t.answered("/a", 5);
        assert_eq!(t.entry("/a"), Some((6, true)), "an answer for an older token clears nothing");
        t.answered("/a", 6);
        assert_eq!(t.entry("/a"), Some((6, false)));
        assert_eq!(t.top(2), vec![("/b".to_string(), 9), ("/c".to_string(), 7)]);
        assert_eq!(t.top(0), vec![]);
        assert_eq!(t.len(), 3);
    }
}
