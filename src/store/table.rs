//! [`Table`]: the in-memory image of every durable mark: each key's `max_seen`, and each
//! floor (the highest token a write covering everything under a string was accepted with).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry as Slot;

use super::{Change, MarkBatch, MarkKind, MarkRef};

/// One mark in the [`Table`].
#[derive(Debug, Clone, Copy)]
struct Entry {
    token: u64,
    /// The write that raised `token` is on its way to the backend, not yet answered. (Under
    /// the fence a mark's latest advance is also its maximum, so one flag per mark suffices.)
    in_flight: bool,
}

/// What one mark costs in memory beside its string's bytes, for `store.max_table_bytes`: its
/// slot in the map (the boxed string's pointer and length, the token, the in-flight flag: 32
/// bytes), the map's control byte and spare capacity, and the allocator's rounding of the
/// string. Measured with `benches/memory.rs`: see docs/store.md (Memory).
pub const MARK_BYTES: u64 = 96;

/// What the mark `name` counts for against `store.max_table_bytes`.
pub(crate) fn mark_bytes(name: &str) -> u64 {
    name.len() as u64 + MARK_BYTES
}

/// One kind of mark: a map from the string to its entry, how many there are, and their bytes
/// ([`mark_bytes`]). Keys and floors are never removed, bindings are ([`Marks::remove`]);
/// keeping the counts saves visiting every shard to count.
#[derive(Debug, Default)]
struct Marks {
    map: DashMap<Box<str>, Entry, foldhash::quality::RandomState>,
    len: AtomicUsize,
    bytes: AtomicU64,
    /// Whether a mark of this kind is in flight after an advance: a key's or a floor's, not a
    /// binding's, which no write waits on.
    flies: bool,
}

impl Marks {
    fn with_capacity(capacity: usize) -> Marks {
        Marks { map: DashMap::with_capacity_and_hasher(capacity, Default::default()), ..Marks::levels() }
    }

    /// An empty map of levels (keys or floors), whose advances are in flight.
    fn levels() -> Marks {
        Marks { flies: true, ..Marks::default() }
    }

    fn entry(&self, name: &str) -> Option<(u64, bool)> {
        self.map.get(name).map(|e| (e.token, e.in_flight))
    }

    fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Applies `f` to `name`'s entry, creating it at `token` if new.
    fn update(&self, name: &str, token: u64, f: impl FnOnce(&mut Entry)) {
        // Look up before inserting so a known mark costs no allocation.
        if let Some(mut e) = self.map.get_mut(name) {
            f(&mut e);
            return;
        }
        self.load_with(name, Entry { token, in_flight: false }, f);
    }

    /// Applies `f` to `name`'s entry, inserting `new` first if it is missing: one probe.
    fn load_with(&self, name: &str, new: Entry, f: impl FnOnce(&mut Entry)) {
        match self.map.entry(name.into()) {
            Slot::Occupied(mut e) => f(e.get_mut()),
            Slot::Vacant(v) => {
                self.len.fetch_add(1, Ordering::Relaxed);
                self.bytes.fetch_add(mark_bytes(name), Ordering::Relaxed);
                f(&mut v.insert(new));
            }
        }
    }

    fn load(&self, name: &str, token: u64, in_flight: bool) {
        let in_flight = in_flight && self.flies;
        self.load_with(name, Entry { token, in_flight }, |e| {
            e.token = e.token.max(token);
            e.in_flight |= in_flight;
        });
    }

    fn raise(&self, name: &str, token: u64) {
        self.update(name, token, |e| e.token = e.token.max(token));
    }

    fn advance(&self, name: &str, token: u64) {
        let flies = self.flies;
        self.update(name, token, |e| {
            e.token = e.token.max(token);
            e.in_flight |= flies;
        });
    }

    /// Removes `name` (a binding's drop).
    fn remove(&self, name: &str) {
        if self.map.remove(name).is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
            self.bytes.fetch_sub(mark_bytes(name), Ordering::Relaxed);
        }
    }

    /// Removes every mark (the bindings, before a takeover reads them again).
    fn clear(&self) {
        self.map.retain(|name, _| {
            self.len.fetch_sub(1, Ordering::Relaxed);
            self.bytes.fetch_sub(mark_bytes(name), Ordering::Relaxed);
            false
        });
    }

    /// Sets `name` to `token`, lowering it if need be (an operator's reset). Whether a write
    /// is in flight is left as it was: a reset does not settle a write's unknown outcome.
    fn reset(&self, name: &str, token: u64) {
        self.update(name, token, |e| e.token = token);
    }

    fn answered(&self, name: &str, token: u64) {
        if let Some(mut e) = self.map.get_mut(name)
            && e.token == token
        {
            e.in_flight = false;
        }
    }

    fn for_each(&self, mut f: impl FnMut(&str, u64, bool)) {
        for e in self.map.iter() {
            f(e.key(), e.value().token, e.value().in_flight);
        }
    }

    fn in_flight(&self) -> Vec<(String, u64)> {
        let mut flying = Vec::new();
        self.for_each(|k, t, f| {
            if f {
                flying.push((k.to_owned(), t));
            }
        });
        flying
    }
}

/// Approximate bytes of memory held for marks, by what holds them (see [`Table::bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableBytes {
    /// The keys: their strings plus [`MARK_BYTES`] each.
    pub keys: u64,
    /// The floors, counted like the keys.
    pub floors: u64,
    /// What the table's users hold for marks outside it, by [`Table::try_hold`] and
    /// [`Table::hold`]: the fence's per-resource gates and the nodes of its tree.
    pub held: u64,
}

impl TableBytes {
    /// Everything together: what `store.max_table_bytes` bounds.
    pub fn total(&self) -> u64 {
        self.keys.saturating_add(self.floors).saturating_add(self.held)
    }
}

/// The in-memory image of every durable mark (each key's `max_seen`, each floor), and of which
/// writes are in flight. Keys and floors are separate maps: a floor and a key spelled alike are
/// different marks.
///
/// Hashed with foldhash rather than SipHash: recovery hashes every key at least once per
/// record, and SipHash was a third of its time. Its per-process random seed keeps clients
/// from precomputing colliding paths.
///
/// It also keeps an account of its memory in bytes ([`TableBytes`]) against a limit
/// (`store.max_table_bytes`), which the store's writer checks before it admits a new mark and
/// the fence before it makes a gate for a resource the table does not hold.
#[derive(Debug)]
pub struct Table {
    keys: Marks,
    floors: Marks,
    /// The bindings of open multipart uploads, bounded by count at the fence
    /// (`s3.max_uploads`), not in [`TableBytes`].
    uploads: Marks,
    held: AtomicU64,
    max_bytes: u64,
}

impl Default for Table {
    fn default() -> Self {
        Table {
            keys: Marks::levels(),
            floors: Marks::levels(),
            uploads: Marks::default(),
            held: AtomicU64::new(0),
            max_bytes: u64::MAX,
        }
    }
}

impl Table {
    /// An empty table, without a limit in bytes.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table with room for `capacity` keys, so loading them never rehashes.
    pub fn with_capacity(capacity: usize) -> Self {
        Table { keys: Marks::with_capacity(capacity), ..Table::default() }
    }

    /// The same table, bounded to `max_bytes` ([`TableBytes::total`]): new marks, and what is
    /// held for marks the table does not have, are refused past it. Marks already in the
    /// table (recovered ones included) stay whatever their total.
    pub fn with_max_bytes(self, max_bytes: u64) -> Self {
        Table { max_bytes, ..self }
    }

    /// Approximate bytes of memory held for marks now: read from counters kept on every insert,
    /// so it costs three atomic loads.
    pub fn bytes(&self) -> TableBytes {
        TableBytes {
            keys: self.keys.bytes.load(Ordering::Relaxed),
            floors: self.floors.bytes.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
        }
    }

    /// The bound on [`Table::bytes`] (`store.max_table_bytes`; `u64::MAX` when unbounded).
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Whether `more` bytes fit beside everything counted now.
    pub(crate) fn fits(&self, more: u64) -> bool {
        self.bytes().total().saturating_add(more) <= self.max_bytes
    }

    /// Counts `bytes` held outside the table for a mark it does not have, if they fit; returns
    /// whether they did. Racing holders may refuse each other early, never let both past.
    pub(crate) fn try_hold(&self, bytes: u64) -> bool {
        let before = self.held.fetch_add(bytes, Ordering::Relaxed);
        let marks = self.keys.bytes.load(Ordering::Relaxed).saturating_add(self.floors.bytes.load(Ordering::Relaxed));
        if marks.saturating_add(before).saturating_add(bytes) <= self.max_bytes {
            return true;
        }
        self.held.fetch_sub(bytes, Ordering::Relaxed);
        false
    }

    /// Counts `bytes` held outside the table for a mark it has (or must be served whatever the
    /// limit), without refusing.
    pub(crate) fn hold(&self, bytes: u64) {
        self.held.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Gives back `bytes` counted by [`Table::try_hold`] or [`Table::hold`].
    pub(crate) fn release(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// The map of one kind of mark: the one place the table tells the kinds apart.
    fn marks(&self, kind: MarkKind) -> &Marks {
        match kind {
            MarkKind::Key => &self.keys,
            MarkKind::Floor => &self.floors,
            MarkKind::Upload => &self.uploads,
        }
    }

    /// The highest durable token of `mark`.
    pub fn level(&self, mark: MarkRef<'_>) -> Option<u64> {
        self.marks(mark.kind).map.get(mark.name).map(|e| e.token)
    }

    /// The highest durable token of the key `key`: [`Table::level`] of a key.
    pub fn get(&self, key: &str) -> Option<u64> {
        self.level(MarkRef::key(key))
    }

    /// The highest durable token of `mark`, and whether the write that raised it is still in
    /// flight.
    pub fn entry(&self, mark: MarkRef<'_>) -> Option<(u64, bool)> {
        self.marks(mark.kind).entry(mark.name)
    }

    /// Number of marks of `kind`.
    pub fn count(&self, kind: MarkKind) -> usize {
        self.marks(kind).len()
    }

    /// Number of keys (resources): [`Table::count`] of keys.
    pub fn len(&self) -> usize {
        self.count(MarkKind::Key)
    }

    /// Whether no key has been seen.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Loads a snapshot entry. Snapshot marks are unique, so this goes straight to the entry:
    /// one probe instead of a lookup and then an insert.
    pub(crate) fn load(&self, mark: MarkRef<'_>, token: u64, in_flight: bool) {
        self.marks(mark.kind).load(mark.name, token, in_flight);
    }

    /// Raises `mark` to `token` (never lowers it). Only stores call this, once it is durable.
    pub(crate) fn raise(&self, mark: MarkRef<'_>, token: u64) {
        self.marks(mark.kind).raise(mark.name, token);
    }

    /// Raises `mark` to `token` and marks its write in flight.
    pub(crate) fn advance(&self, mark: MarkRef<'_>, token: u64) {
        self.marks(mark.kind).advance(mark.name, token);
    }

    /// Notes that the backend answered the write of `token` that raised `mark`.
    pub(crate) fn answered(&self, mark: MarkRef<'_>, token: u64) {
        self.marks(mark.kind).answered(mark.name, token);
    }

    /// Sets `mark` to `token`, lowering it if need be: an operator's reset, once durable.
    pub(crate) fn reset(&self, mark: MarkRef<'_>, token: u64) {
        self.marks(mark.kind).reset(mark.name, token);
    }

    /// Removes `mark`: a binding's drop, once durable.
    pub(crate) fn drop_mark(&self, mark: MarkRef<'_>) {
        self.marks(mark.kind).remove(mark.name);
    }

    /// Removes every binding, which keys and floors never are: a new etcd leader reads them
    /// again as etcd holds them, and a binding another leader dropped must not come back from
    /// this instance's earlier leadership.
    pub(crate) fn clear_bindings(&self) {
        self.uploads.clear();
    }

    /// Makes `batch`'s change to every mark of it, once it is durable (an answer need not be):
    /// the one place a [`Change`] is applied to the table.
    pub(crate) fn apply(&self, batch: &MarkBatch) {
        let (token, marks) = (batch.token(), batch.marks().iter());
        match batch.change() {
            Change::Advance => marks.for_each(|mark| self.advance(mark.borrowed(), token)),
            Change::Reset => marks.for_each(|mark| self.reset(mark.borrowed(), token)),
            Change::Answered => marks.for_each(|mark| self.answered(mark.borrowed(), token)),
            Change::Drop => marks.for_each(|mark| self.drop_mark(mark.borrowed())),
        }
    }

    /// Visits every mark of `kind` as `(name, token, in_flight)`, in no particular order.
    pub fn for_each(&self, kind: MarkKind, f: impl FnMut(&str, u64, bool)) {
        self.marks(kind).for_each(f);
    }

    /// The marks of `kind` whose write is still in flight, as `(name, token)`.
    pub fn in_flight(&self, kind: MarkKind) -> Vec<(String, u64)> {
        self.marks(kind).in_flight()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> MarkRef<'_> {
        MarkRef::key(name)
    }

    fn floor(name: &str) -> MarkRef<'_> {
        MarkRef::floor(name)
    }

    #[test]
    fn table_only_climbs_and_ranks_its_top_entries() {
        let t = Table::new();
        t.raise(key("/a"), 5);
        t.raise(key("/a"), 3);
        t.raise(key("/b"), 9);
        t.raise(key("/c"), 7);
        assert_eq!(t.get("/a"), Some(5));
        t.advance(key("/a"), 6);
        t.answered(key("/a"), 5);
        assert_eq!(t.entry(MarkRef::key("/a")), Some((6, true)), "an answer for an older token clears nothing");
        t.answered(key("/a"), 6);
        assert_eq!(t.entry(MarkRef::key("/a")), Some((6, false)));
        assert_eq!(t.top(2), vec![("/b".to_string(), 9), ("/c".to_string(), 7)]);
        assert_eq!(t.top(0), vec![]);
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn floors_are_marks_of_their_own_beside_the_keys() {
        let t = Table::new();
        t.advance(key("/a"), 5);
        assert_eq!((t.level(MarkRef::floor("/a")), t.count(MarkKind::Floor)), (None, 0), "a key is not a floor");
        t.advance(floor("/a"), 9);
        t.raise(floor("/a"), 4);
        t.load(floor("/d/"), 3, false);
        t.load(floor("/d/"), 2, true);
        assert_eq!((t.get("/a"), t.level(MarkRef::floor("/a"))), (Some(5), Some(9)), "neither touched the other");
        assert_eq!((t.level(key("/a")), t.level(floor("/a"))), (Some(5), Some(9)));
        assert_eq!(t.entry(MarkRef::floor("/d/")), Some((3, true)), "load keeps the maximum, in flight if either was");
        t.answered(floor("/a"), 8);
        assert_eq!(t.entry(MarkRef::floor("/a")), Some((9, true)), "an answer for an older token clears nothing");
        t.answered(key("/a"), 9);
        assert_eq!(t.entry(MarkRef::floor("/a")), Some((9, true)), "nor does the key's answer");
        t.answered(floor("/a"), 9);
        assert_eq!(t.entry(MarkRef::floor("/a")), Some((9, false)));
        assert_eq!(t.in_flight(MarkKind::Key), [("/a".to_string(), 5)]);
        assert_eq!(t.in_flight(MarkKind::Floor), [("/d/".to_string(), 3)]);
        let mut all = Vec::new();
        t.for_each(MarkKind::Floor, |p, token, flying| all.push((p.to_owned(), token, flying)));
        all.sort();
        assert_eq!(all, [("/a".to_string(), 9, false), ("/d/".to_string(), 3, true)]);
        assert_eq!((t.len(), t.count(MarkKind::Floor), t.top(5).len()), (1, 2, 1), "len and top are the keys'");
    }

    #[test]
    fn bindings_are_never_in_flight_and_may_be_dropped() {
        let t = Table::new();
        t.advance(MarkRef::upload("/b/k\nid"), 7);
        t.load(MarkRef::upload("/b/j\nid2"), 3, true);
        assert_eq!(t.entry(MarkRef::upload("/b/k\nid")), Some((7, false)));
        assert_eq!(t.entry(MarkRef::upload("/b/j\nid2")), Some((3, false)));
        assert_eq!((t.count(MarkKind::Upload), t.len(), t.bytes().total()), (2, 0, 0), "bound by count alone");
        t.drop_mark(MarkRef::upload("/b/k\nid"));
        t.drop_mark(MarkRef::upload("/b/k\nid"));
        assert_eq!((t.level(MarkRef::upload("/b/k\nid")), t.count(MarkKind::Upload)), (None, 1));
        assert!(t.in_flight(MarkKind::Upload).is_empty());
        t.advance(MarkRef::key("/b/k"), 9);
        t.clear_bindings();
        assert_eq!((t.count(MarkKind::Upload), t.level(MarkRef::key("/b/k"))), (0, Some(9)), "keys stay");
    }

    #[test]
    fn bytes_count_each_mark_once_and_what_is_held_beside_them() {
        let t = Table::new().with_max_bytes(3 * MARK_BYTES + 10);
        t.advance(key("/a"), 1);
        t.raise(key("/a"), 2);
        t.load(floor("/d"), 3, false);
        let bytes = TableBytes { keys: 2 + MARK_BYTES, floors: 2 + MARK_BYTES, held: 0 };
        assert_eq!(t.bytes(), bytes, "a mark counts once, however often it is raised");
        assert!(t.try_hold(MARK_BYTES + 6) && !t.try_hold(1), "held bytes fit up to the limit, and no further");
        assert_eq!(t.bytes().total(), t.max_bytes());
        t.hold(5);
        assert!(!t.fits(0), "a hold that may not be refused can pass the limit");
        t.release(11);
        assert!(t.fits(6) && !t.fits(7));
    }
}
