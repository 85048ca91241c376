//! Token domains and `max_jump`: how far above what a key has seen a token may be.
//!
//! A key with a `max_seen` (or a floor over it) is bounded by that level. A key with none is
//! bounded by the highest token accepted anywhere in its token domain, which [`HighWater`]
//! keeps per domain: counted from the table when the fence opens and when a reload maps keys
//! to domains differently, and raised by every durable advance. A domain with no token yet has
//! no bound. The fence knows domains only as [`Domains`], prefix and name pairs that the
//! request module makes from the rules.
//!
//! [`HighWater`] owns the mapping in force and its counts (a `Mapping`), swapped whole when the
//! mapping changes or the table is counted again, and judges a token's jump from them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;

use super::FenceError;
use super::keys::in_scope;
use super::tree::Touch;
use crate::store::{MarkKind, Table};

/// The token domain of keys no rule names.
pub const DEFAULT_DOMAIN: &str = "default";

/// Which token domain each key is in: the longest prefix that names one wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domains {
    /// `(prefix, index into names)`, longest prefix first.
    prefixes: Vec<(String, usize)>,
    /// Every domain named, [`DEFAULT_DOMAIN`] first.
    names: Vec<String>,
}

impl Default for Domains {
    fn default() -> Self {
        Domains { prefixes: Vec::new(), names: vec![DEFAULT_DOMAIN.to_owned()] }
    }
}

impl Domains {
    /// The domains of `(prefix, domain)` pairs; keys under none are in [`DEFAULT_DOMAIN`].
    pub fn new(rules: impl IntoIterator<Item = (String, String)>) -> Domains {
        let mut domains = Domains::default();
        for (prefix, name) in rules {
            let index = match domains.names.iter().position(|n| *n == name) {
                Some(i) => i,
                None => {
                    domains.names.push(name);
                    domains.names.len() - 1
                }
            };
            domains.prefixes.push((prefix, index));
        }
        domains.prefixes.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        domains
    }

    fn index(&self, key: &str) -> usize {
        self.prefixes.iter().find(|(p, _)| in_scope(key, p)).map_or(0, |(_, i)| *i)
    }

    /// The domain a floor at node `p` was raised in. The write that left it was at `p` or
    /// `p/`, and a subtree write is refused unless both are in one domain (`p/` is inside the
    /// subtree), so `p/` names it.
    fn floor_index(&self, p: &str) -> usize {
        if p == "/" || self.prefixes.is_empty() { self.index(p) } else { self.index(&format!("{p}/")) }
    }

    /// The domain of `key`.
    pub fn of(&self, key: &str) -> &str {
        &self.names[self.index(key)]
    }
}

/// One domain's highest durable token.
#[derive(Debug, Default)]
struct Mark {
    seen: AtomicBool,
    token: AtomicU64,
}

impl Mark {
    fn raise(&self, token: u64) {
        self.token.fetch_max(token, Ordering::AcqRel);
        self.seen.store(true, Ordering::Release);
    }

    fn get(&self) -> Option<u64> {
        self.seen.load(Ordering::Acquire).then(|| self.token.load(Ordering::Acquire))
    }
}

/// The highest token of each domain, under one mapping of keys to domains.
#[derive(Debug)]
struct Mapping {
    domains: Domains,
    marks: Box<[Mark]>,
    /// Whether the table has been counted in.
    counted: AtomicBool,
    /// Until then, the highest token of the mapping this one replaced, over every domain: at or
    /// above what the count will find for any of them, so it bounds meanwhile without refusing
    /// anything the count would let through.
    fallback: Option<u64>,
}

impl Mapping {
    fn new(domains: Domains) -> Mapping {
        Mapping::replacing(domains, None)
    }

    /// A mapping to be counted, bounded meanwhile by `fallback`.
    fn replacing(domains: Domains, fallback: Option<u64>) -> Mapping {
        let marks = domains.names.iter().map(|_| Mark::default()).collect();
        Mapping { domains, marks, counted: AtomicBool::new(false), fallback }
    }

    /// A mapping counted from `table` now.
    fn counted(domains: Domains, table: &Table) -> Mapping {
        let mapping = Mapping::new(domains);
        mapping.count(table);
        mapping
    }

    /// The highest token over every domain (while uncounted, with the fallback).
    fn overall(&self) -> Option<u64> {
        let marks = self.marks.iter().filter_map(Mark::get).max();
        match self.counted.load(Ordering::Acquire) {
            true => marks,
            false => marks.max(self.fallback),
        }
    }

    /// Counts every key and floor of `table` in.
    fn count(&self, table: &Table) {
        table.for_each(MarkKind::Key, |key, token, _| self.marks[self.domains.index(key)].raise(token));
        table.for_each(MarkKind::Floor, |p, token, _| self.marks[self.domains.floor_index(p)].raise(token));
        self.counted.store(true, Ordering::Release);
    }

    /// Notes that the marks of `touches` now stand at `token`, durably.
    fn raise(&self, touches: &[Touch], token: u64) {
        for touch in touches {
            self.marks[self.domains.index(&touch.key)].raise(token);
        }
    }

    fn get(&self, index: usize) -> Option<u64> {
        if !self.counted.load(Ordering::Acquire) {
            return self.marks[index].get().max(self.fallback);
        }
        self.marks[index].get()
    }
}

/// The highest token of each token domain, under the mapping of keys to domains in force, over
/// the table it is counted from.
#[derive(Debug)]
pub(crate) struct HighWater {
    mapping: ArcSwap<Mapping>,
    table: Arc<Table>,
}

impl HighWater {
    /// The highest tokens of `domains`, counted from `table` before this returns.
    pub(crate) fn counted(domains: Domains, table: Arc<Table>) -> HighWater {
        let mapping = ArcSwap::from_pointee(Mapping::counted(domains, &table));
        HighWater { mapping, table }
    }

    /// Notes that the marks of `touches` now stand at `token`, durably.
    #[inline]
    pub(crate) fn raise(&self, touches: &[Touch], token: u64) {
        self.mapping.load().raise(touches, token);
    }

    /// Maps keys to token domains by `domains` from now on. When that changes the mapping, each
    /// domain's highest token is counted again from the table on a thread of its own (a pass
    /// over every key); until it is done, keys without a level of their own are bounded by the
    /// highest token of the old mapping over every domain, and advances made meanwhile are
    /// counted too. Returns whether a count started.
    pub(crate) fn set_domains(&self, domains: Domains) -> bool {
        let old = self.mapping.load();
        if old.domains == domains {
            return false;
        }
        let mapping = Arc::new(Mapping::replacing(domains, old.overall()));
        // Installed before the count reads the table: an advance raises either the table
        // before the count passes its key, or this mapping.
        self.mapping.store(Arc::clone(&mapping));
        let table = Arc::clone(&self.table);
        let counting = Arc::clone(&mapping);
        let spawned = std::thread::Builder::new().name("fencegate-count".into()).spawn(move || {
            let started = std::time::Instant::now();
            counting.count(&table);
            tracing::info!(took_ms = started.elapsed().as_millis() as u64, "token domains' highest tokens counted");
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to count the token domains' highest tokens on: counting here");
            mapping.count(&self.table);
        }
        true
    }

    /// The highest token accepted in `domain`, if it has one and it has been counted (while a
    /// count runs, `max_jump` measures from the old mapping's highest token instead).
    pub(crate) fn domain_max(&self, domain: &str) -> Option<u64> {
        let mapping = self.mapping.load();
        let index = mapping.domains.names.iter().position(|n| n == domain)?;
        mapping.counted.load(Ordering::Acquire).then(|| mapping.marks[index].get()).flatten()
    }

    /// Counts the domains again from the table, at once: after an operator's reset lowered
    /// marks, holding the turn of the whole tree, or a takeover loaded the table anew.
    pub(crate) fn recount(&self) {
        let domains = self.mapping.load().domains.clone();
        self.mapping.store(Arc::new(Mapping::counted(domains, &self.table)));
    }

    /// Refuses `token` if it is more than `max_jump` above `level`, the level of `touch`, or,
    /// when it has none, above the highest token of its domain.
    pub(crate) fn jump(&self, touch: &Touch, token: u64, level: Option<u64>, max_jump: u64) -> Result<(), FenceError> {
        let (base, domain) = match level {
            Some(level) => (level, None),
            None => {
                let mapping = self.mapping.load();
                // A write's keys are all in one domain, a subtree's with it.
                let index = mapping.domains.index(&touch.key);
                match mapping.get(index) {
                    Some(top) => (top, Some(mapping.domains.names[index].clone())),
                    None => return Ok(()),
                }
            }
        };
        if token > base.saturating_add(max_jump) {
            return Err(FenceError::Jump { resource: touch.key.clone(), token, base, max_jump, domain });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::fence::turn::tests::{Failed, fence};
    use crate::fence::{Coverage, EqualToken, Outcome, Policy};
    use crate::store::MarkRef;

    fn key(k: &str) -> Vec<Touch> {
        vec![Touch { key: k.into(), coverage: Coverage::Key }]
    }

    #[tokio::test]
    async fn a_jump_is_measured_from_the_level_or_else_the_domain_which_every_advance_raises() {
        let (t, _dir) = fence(); // "/a" at 34, counted into the default domain
        let policy = Policy { equal: EqualToken::Reject, max_jump: Some(10), pinned: false };
        assert_eq!(t.precheck(&key("/a"), 44, policy), Ok(()));
        let err = t.precheck(&key("/a"), 45, policy).unwrap_err();
        assert_eq!(err, FenceError::Jump { resource: "/a".into(), token: 45, base: 34, max_jump: 10, domain: None });
        let err = t.precheck(&key("/new"), 45, policy).unwrap_err();
        assert!(matches!(err, FenceError::Jump { base: 34, domain: Some(ref d), .. } if d == "default"), "{err:?}");
        assert_eq!(t.precheck(&key("/new"), 45, EqualToken::Reject), Ok(()), "unbounded without max_jump");
        assert!(matches!(t.precheck(&key("/a"), 34, policy), Err(FenceError::Stale { .. })), "stale comes first");

        let turn = t.acquire(key("/b"), Duration::from_secs(1)).await.unwrap();
        let done =
            turn.finish(44, policy, Duration::from_secs(1), async { Ok::<u64, Failed>(0) }, |_| Outcome::Answered);
        assert_eq!(done.await, Ok(0));
        assert_eq!(t.domain_max("default"), Some(44), "the advance raised its domain");
        assert_eq!(t.precheck(&key("/new"), 54, policy), Ok(()));
        let mut turn = t.acquire(key("/new"), Duration::from_secs(1)).await.unwrap();
        assert!(matches!(turn.check(55, policy), Err(FenceError::Jump { base: 44, .. })), "and the turn's check too");
    }

    #[test]
    fn new_domains_are_counted_on_a_thread_and_unchanged_ones_are_not_counted_again() {
        let (t, _dir) = fence();
        t.max_seen.raise(MarkRef::key("/zk/q"), 7);
        assert!(!t.set_domains(Domains::default()), "the same mapping");
        assert!(t.set_domains(Domains::new([("/zk/".to_owned(), "zk".to_owned())])));
        let start = std::time::Instant::now();
        while t.domain_max("zk").is_none() {
            assert!(start.elapsed() < Duration::from_secs(20), "the count never finished");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((t.domain_max("zk"), t.domain_max("default"), t.domain_max("nowhere")), (Some(7), Some(34), None));
    }

    #[test]
    fn the_longest_prefix_names_the_domain_and_floors_count_where_their_write_was() {
        let d = Domains::new([
            ("/consul/".to_owned(), "consul".to_owned()),
            ("/consul/etcd".to_owned(), "default".to_owned()),
            ("/zk/".to_owned(), "zk".to_owned()),
        ]);
        assert_eq!(
            (d.of("/consul/a"), d.of("/consul/etcd/x"), d.of("/zk/q"), d.of("/x")),
            ("consul", "default", "zk", "default")
        );
        assert_eq!(d.of("/consul"), "default", "prefixes match on segments");
        assert_eq!(d.names[d.floor_index("/consul")], "consul", "the floor of DELETE /consul/");
        assert_eq!(d.names[d.floor_index("/")], "default");
        assert_eq!(Domains::default(), Domains::new([]));
    }

    #[test]
    fn each_domain_counts_its_own_keys_and_floors_and_none_is_unbounded() {
        let table = Table::new();
        table.raise(MarkRef::key("/consul/a"), 7);
        table.raise(MarkRef::key("/b"), 100);
        table.raise(MarkRef::floor("/consul/d"), 9);
        let d = Domains::new([("/consul/".to_owned(), "consul".to_owned()), ("/zk/".to_owned(), "zk".to_owned())]);
        let high = Mapping::counted(d.clone(), &table);
        assert_eq!((high.get(0), high.get(1), high.get(2)), (Some(100), Some(9), None));
        let pending = Mapping::replacing(d.clone(), high.overall());
        pending.raise(&[Touch { key: "/zk/x".into(), coverage: Coverage::Key }], 5);
        assert_eq!(pending.get(2), Some(100), "until it is counted, the old mapping's highest token bounds");
        pending.count(&table);
        assert_eq!((pending.get(1), pending.get(2)), (Some(9), Some(5)), "advances made meanwhile count");
        assert_eq!(Mapping::new(d).get(2), None, "a fence with nothing counted yet has no bound");
    }
}
