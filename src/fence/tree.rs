//! The tree of fence keys: what a write must be above, and how a write raises it.
//!
//! Keys are canonical paths (or the prefixes scopes make of them). A *node* is a key without
//! its trailing slash, so the file `/d` and the collection `/d/` share node `/d`: a backend
//! serves both from one name. A write that covers a subtree (a collection's DELETE, MOVE or
//! COPY) leaves a *floor* at its node, kept durably by the store beside the keys; every key at
//! or below a floor must then be above it. To check a subtree write against everything under
//! it in O(depth) rather than O(resources), each node above some key keeps `below`: the highest
//! token of any key or floor strictly below it. It is rebuilt from the store when the fence
//! starts and raised as writes are made durable.
//!
//! A node is kept by a 64-bit hash of its path (keyed per process), not by the path itself:
//! a key `d` segments deep has `d` nodes above it, and their paths together take about `d`
//! times the key's length, so a client could make one 8 KB key cost megabytes. By hash, each
//! node costs [`NODE_BYTES`], which counts against `store.max_table_bytes` with the gates. Two
//! paths that hash alike share one `below`, the higher of the two: a subtree write could then
//! be refused for a token it is above (about one chance in 2^64 per pair of nodes), never
//! admitted below one.
//!
//! [`Tree`] owns the nodes and their account in the table's bytes, and answers what a write
//! must be above ([`Tree::level`]) from the table and its nodes together.

use std::hash::BuildHasher;
use std::sync::Arc;

use dashmap::DashMap;

use crate::store::{MarkKind, MarkRef, Table};

/// How much of the tree at a key a write may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coverage {
    /// The key itself.
    Key,
    /// The key's node and everything below it: the key, the key with a trailing slash, and
    /// every key under it.
    Subtree,
}

/// One fence key a write touches, and how much of the tree below it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Touch {
    /// The fence key.
    pub key: String,
    /// What the write may change there.
    pub coverage: Coverage,
}

impl Touch {
    /// The durable mark a write with this touch raises: the key itself, or a floor at its node.
    pub(crate) fn mark(&self) -> MarkRef<'_> {
        match self.coverage {
            Coverage::Key => MarkRef::key(&self.key),
            Coverage::Subtree => MarkRef::floor(node(&self.key)),
        }
    }
}

/// The node of a key: the key without a trailing slash (the root stays `/`).
pub(crate) fn node(key: &str) -> &str {
    match key.strip_suffix('/') {
        Some(rest) if !rest.is_empty() => rest,
        _ => key,
    }
}

/// The nodes strictly above `node`, root first: `/`, `/a`, `/a/b` for `/a/b/c`.
pub(crate) fn ancestors(node: &str) -> impl Iterator<Item = &str> {
    let root = (node.len() > 1 && node.starts_with('/')).then_some("/");
    let inner = node.match_indices('/').skip(1).map(move |(i, _)| &node[..i]);
    root.into_iter().chain(inner)
}

/// Whether node `a` is `b` or above it.
pub(crate) fn covers(a: &str, b: &str) -> bool {
    a == "/" || b == a || b.strip_prefix(a).is_some_and(|rest| rest.starts_with('/'))
}

/// What one node of the tree costs in memory, for `store.max_table_bytes`: its slot (two
/// `u64`s), the map's control byte and spare capacity, rounded up.
pub const NODE_BYTES: u64 = 40;

/// The highest token below each node that has keys or floors below it, over the table whose
/// keys and floors it counts and in whose bytes its nodes count.
#[derive(Debug)]
pub(crate) struct Tree {
    /// By the hash of the node's path (see the module's notes).
    below: DashMap<u64, u64, foldhash::fast::RandomState>,
    /// Hashes the paths, with a per-process key, so clients cannot aim for a collision.
    paths: foldhash::quality::RandomState,
    table: Arc<Table>,
}

impl Tree {
    /// The tree of everything `table` holds, counted in its bytes.
    pub(crate) fn build(table: Arc<Table>) -> Tree {
        let tree = Tree { below: DashMap::default(), paths: Default::default(), table };
        tree.count();
        tree
    }

    /// Recomputes every node from the table, after marks were lowered (a reset) or the table
    /// was loaded anew (a takeover). The caller must keep every write from raising the tree
    /// meanwhile (the turn of the whole tree), or know that none can.
    pub(crate) fn rebuild(&self) {
        let nodes = self.below.len() as u64;
        self.below.clear();
        self.table.release(nodes * NODE_BYTES);
        self.count();
    }

    fn count(&self) {
        self.table.for_each(MarkKind::Key, |key, token, _| self.raise(key, token));
        self.table.for_each(MarkKind::Floor, |path, token, _| self.raise(path, token));
    }

    /// Notes that `mark`, a key or a floor, now stands at `token` (made durable by the store):
    /// both raise the nodes above them alike. New nodes count in the table's bytes.
    pub(crate) fn raise(&self, mark: &str, token: u64) {
        for above in ancestors(node(mark)) {
            let hash = self.paths.hash_one(above);
            if let Some(mut below) = self.below.get_mut(&hash) {
                *below = (*below).max(token);
                continue;
            }
            let mut below = self.below.entry(hash).or_insert_with(|| {
                self.table.hold(NODE_BYTES);
                token
            });
            *below = (*below).max(token);
        }
    }

    /// The highest token of any key or floor strictly below `node`.
    fn below(&self, node: &str) -> Option<u64> {
        self.below.get(&self.paths.hash_one(node)).map(|b| *b)
    }

    /// Nodes with something below them.
    pub(crate) fn len(&self) -> usize {
        self.below.len()
    }

    /// The highest token `touch` must be above (or, by the equal-token policy, not below): the
    /// key's own `max_seen`, every floor at or above its node, and for a subtree everything in
    /// it.
    #[cfg(test)]
    pub(crate) fn level(&self, touch: &Touch) -> Option<u64> {
        self.level_and_floor(touch).0
    }

    /// [`Tree::level`], and the node of the floor it is, when a floor is all that sets it (a
    /// key or subtree at the same token is named instead), for a refusal to name.
    pub(crate) fn level_and_floor<'t>(&self, touch: &'t Touch) -> (Option<u64>, Option<&'t str>) {
        let table = &*self.table;
        let here = node(&touch.key);
        let mut level = table.get(&touch.key);
        let mut floor = None;
        if table.count(MarkKind::Floor) > 0 {
            for n in ancestors(here).chain(std::iter::once(here)) {
                let at = table.level(MarkRef::floor(n));
                if at > level {
                    (level, floor) = (at, Some(n));
                }
            }
        }
        if touch.coverage == Coverage::Subtree {
            let mut inside = table.get(here).max(self.below(here));
            if here != "/" {
                inside = inside.max(table.get(&format!("{here}/")));
            }
            if inside > level {
                (level, floor) = (inside, None);
            }
        }
        (level, floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_and_their_ancestors() {
        assert_eq!(node("/d/"), "/d");
        assert_eq!(node("/d"), "/d");
        assert_eq!(node("/"), "/");
        assert_eq!(ancestors("/a/b/c").collect::<Vec<_>>(), ["/", "/a", "/a/b"]);
        assert_eq!(ancestors("/a").collect::<Vec<_>>(), ["/"]);
        assert_eq!(ancestors("/").count(), 0);
        assert!(covers("/", "/x") && covers("/a", "/a") && covers("/a", "/a/b"));
        assert!(!covers("/a", "/ab") && !covers("/a/b", "/a"));
    }

    fn touch(key: &str, coverage: Coverage) -> Touch {
        Touch { key: key.into(), coverage }
    }

    #[test]
    fn a_subtree_sees_every_key_below_it_and_a_key_every_floor_above_it() {
        let table = Arc::new(Table::new());
        table.raise(MarkRef::key("/d/f"), 1000);
        table.raise(MarkRef::key("/d"), 7);
        table.raise(MarkRef::key("/e/"), 9);
        let tree = Tree::build(Arc::clone(&table));
        let level = |t: Touch| tree.level(&t);
        assert_eq!(level(touch("/d/", Coverage::Key)), None, "a key alone sees only itself");
        assert_eq!(level(touch("/d/", Coverage::Subtree)), Some(1000));
        assert_eq!(level(touch("/d", Coverage::Subtree)), Some(1000), "with or without the slash");
        assert_eq!(level(touch("/e", Coverage::Subtree)), Some(9), "the collection key counts");
        assert_eq!(level(touch("/", Coverage::Subtree)), Some(1000));
        assert_eq!(level(touch("/dx", Coverage::Subtree)), None, "segments, not prefixes");

        table.raise(MarkRef::floor("/d"), 2000);
        tree.raise("/d", 2000);
        assert_eq!(level(touch("/d/g/h", Coverage::Key)), Some(2000), "a floor covers new keys too");
        assert_eq!(level(touch("/d/", Coverage::Key)), Some(2000));
        assert_eq!(level(touch("/dx", Coverage::Key)), None);
        assert_eq!(level(touch("/", Coverage::Subtree)), Some(2000), "and the subtrees above it");
        let new = touch("/d/g/h", Coverage::Key);
        assert_eq!(tree.level_and_floor(&new), (Some(2000), Some("/d")), "the floor is named");
        let own = touch("/e/", Coverage::Key);
        assert_eq!(tree.level_and_floor(&own), (Some(9), None), "a key's own level is no floor");
        let above = touch("/", Coverage::Subtree);
        assert_eq!(tree.level_and_floor(&above), (Some(2000), None), "what lies inside a subtree is no floor over it");
    }

    #[test]
    fn a_node_costs_the_same_however_long_its_path_and_counts_in_the_table_bytes() {
        let tree = Tree::build(Arc::new(Table::new()));
        let table = Arc::clone(&tree.table);
        // 1,000 segments of 8 bytes: the paths of the nodes above it would take about 4 MB.
        let deep: String = (0..1000).map(|i| format!("/seg{i:04}")).collect();
        tree.raise(&deep, 5);
        assert_eq!(tree.len(), 1000);
        assert_eq!(table.bytes().held, 1000 * NODE_BYTES);
        tree.raise(&deep, 6);
        assert_eq!(table.bytes().held, 1000 * NODE_BYTES, "known nodes cost nothing more");
        let above = &deep[..deep.len() - "/seg0999".len()];
        assert_eq!(tree.below(above), Some(6));
        assert_eq!(tree.below("/seg0000"), Some(6));
        assert_eq!(tree.below("/other"), None);
    }
}
