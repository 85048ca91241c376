//! Turns over whole subtrees.
//!
//! A write that covers a subtree must not run at the backend beside any write under it, nor
//! beside another subtree write that overlaps it. Subtree writes are rare, so they take their
//! turns here, in one small registry, first come first served: a subtree write waits while an
//! overlapping one is active or queued ahead of it, then becomes active on all its nodes at
//! once (so two of them can never hold part of what the other needs). Writes to single keys
//! pay for this only while the registry is not empty: after taking their key turns they look
//! for an active or queued subtree covering one of their keys, and if there is one they give
//! their turns back and wait for it (see `acquire.rs`). A subtree whose write has an unknown
//! outcome is quarantined here, and refuses writes under it until it expires.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::time::Instant;

use tokio::sync::Notify;

use super::QuarantineCause;
use super::tree::covers;

/// Where a subtree write stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Queued,
    Active,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    /// The subtrees the write covers.
    nodes: Vec<Box<str>>,
    /// The nodes of the single keys it also touches (a MOVE whose one side a scope shortened
    /// to a key): they conflict with another write's subtree above them.
    points: Vec<Box<str>>,
    stage: Stage,
}

#[derive(Debug, Default)]
struct Registry {
    next_id: u64,
    entries: Vec<Entry>,
    quarantined: Vec<(Box<str>, Instant, QuarantineCause)>,
}

/// The subtree writes queued and active, and the quarantined subtrees.
#[derive(Debug, Default)]
pub(crate) struct Subtrees {
    registry: Mutex<Registry>,
    /// Entries plus quarantines: zero means writes to single keys need not look.
    count: AtomicUsize,
    changed: Notify,
}

/// Whether two sets of nodes share a key: one node is at or below another.
fn overlap(a: &[Box<str>], b: &[Box<str>]) -> bool {
    a.iter().any(|x| b.iter().any(|y| covers(x, y) || covers(y, x)))
}

/// Whether two subtree writes may change a key in common: their subtrees overlap, or a key one
/// of them touches lies in a subtree of the other. (Two writes' single keys meet at the keys'
/// own turns.)
fn conflict(a: &Entry, b: &Entry) -> bool {
    let under = |points: &[Box<str>], nodes: &[Box<str>]| points.iter().any(|p| nodes.iter().any(|n| covers(n, p)));
    overlap(&a.nodes, &b.nodes) || under(&a.points, &b.nodes) || under(&b.points, &a.nodes)
}

impl Subtrees {
    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        // A poisoned lock means a panic while editing a Vec; its entries are still whole.
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn recount(&self, r: &Registry) {
        self.count.store(r.entries.len() + r.quarantined.len(), Ordering::Release);
    }

    /// Whether the registry holds anything at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Queues a write that covers the subtrees at `nodes` (and touches single keys at
    /// `points`) and returns its id; it is active once `try_activate` says so.
    pub(crate) fn enqueue(&self, nodes: Vec<Box<str>>, points: Vec<Box<str>>) -> u64 {
        let mut r = self.lock();
        let id = r.next_id;
        r.next_id += 1;
        r.entries.push(Entry { id, nodes, points, stage: Stage::Queued });
        self.recount(&r);
        id
    }

    /// Makes `id` active if nothing that overlaps it is active or queued ahead of it.
    pub(crate) fn try_activate(&self, id: u64) -> bool {
        let mut r = self.lock();
        let Some(at) = r.entries.iter().position(|e| e.id == id) else { return false };
        let blocked = r.entries[..at]
            .iter()
            .chain(&r.entries[at + 1..])
            .any(|e| (e.stage == Stage::Active || e.id < id) && conflict(e, &r.entries[at]));
        if !blocked {
            r.entries[at].stage = Stage::Active;
        }
        !blocked
    }

    /// Removes `id` (done, timed out or dropped) and wakes everyone who waits for a change.
    pub(crate) fn remove(&self, id: u64) {
        let mut r = self.lock();
        r.entries.retain(|e| e.id != id);
        self.recount(&r);
        drop(r);
        self.changed.notify_waiters();
    }

    /// Whether a subtree write queued or active covers `node`: a write there must wait for it.
    pub(crate) fn blocks(&self, node: &str) -> bool {
        self.lock().entries.iter().any(|e| e.nodes.iter().any(|n| covers(n, node)))
    }

    /// Closes everything under `node` until `until`.
    pub(crate) fn quarantine(&self, node: &str, until: Instant, cause: QuarantineCause) {
        let mut r = self.lock();
        r.quarantined.push((node.into(), until, cause));
        self.recount(&r);
    }

    /// Subtrees quarantined now.
    pub(crate) fn quarantined_len(&self) -> usize {
        let now = Instant::now();
        self.lock().quarantined.iter().filter(|(_, until, _)| *until > now).count()
    }

    /// Ends every quarantine of exactly the subtree at `node`; whether one was running.
    pub(crate) fn lift(&self, node: &str) -> bool {
        let now = Instant::now();
        let mut r = self.lock();
        let running = r.quarantined.iter().any(|(q, until, _)| **q == *node && *until > now);
        r.quarantined.retain(|(q, _, _)| **q != *node);
        self.recount(&r);
        running
    }

    /// When the latest quarantine covering `node`, or covered by it when `subtree`, ends, if
    /// one still runs. Expired ones are dropped on the way.
    #[inline]
    pub(crate) fn quarantined(&self, node: &str, subtree: bool) -> Option<(Instant, QuarantineCause)> {
        // Without a look at the registry while it is empty, as it is for nearly every write.
        if self.is_empty() {
            return None;
        }
        self.quarantined_in_registry(node, subtree)
    }

    fn quarantined_in_registry(&self, node: &str, subtree: bool) -> Option<(Instant, QuarantineCause)> {
        let now = Instant::now();
        let mut r = self.lock();
        let before = r.quarantined.len();
        r.quarantined.retain(|(_, until, _)| *until > now);
        if r.quarantined.len() != before {
            self.recount(&r);
        }
        r.quarantined
            .iter()
            .filter(|(q, _, _)| covers(q, node) || (subtree && covers(node, q)))
            .map(|(_, until, cause)| (*until, *cause))
            .max_by_key(|(until, _)| *until)
    }

    /// A future that resolves at the next change; enable it before looking, so that no change
    /// between the look and the wait is missed.
    pub(crate) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: &[&str]) -> Vec<Box<str>> {
        n.iter().map(|s| (*s).into()).collect()
    }

    #[test]
    fn overlapping_subtree_writes_take_turns_in_arrival_order() {
        let s = Subtrees::default();
        let a = s.enqueue(nodes(&["/d"]), vec![]);
        let b = s.enqueue(nodes(&["/d/e", "/x"]), vec![]);
        let c = s.enqueue(nodes(&["/y"]), vec![]);
        assert!(!s.try_activate(b), "b overlaps a, which came first");
        assert!(s.try_activate(c), "disjoint writes are independent");
        assert!(s.try_activate(a));
        assert!(s.blocks("/d/e/f") && s.blocks("/y") && !s.blocks("/z"));
        s.remove(a);
        assert!(s.try_activate(b));
        let late = s.enqueue(nodes(&["/x/1"]), vec![]);
        assert!(!s.try_activate(late), "b is active on /x");
        s.remove(b);
        s.remove(c);
        s.remove(late);
        assert!(s.is_empty());
    }

    #[test]
    fn a_key_one_subtree_write_touches_conflicts_with_another_subtree_above_it() {
        let s = Subtrees::default();
        let delete = s.enqueue(nodes(&["/buckets"]), vec![]);
        assert!(s.try_activate(delete));
        // MOVE /tmp/x -> /buckets/b1/obj under a scope keeping two segments: key /buckets/b1.
        let moving = s.enqueue(nodes(&["/tmp/x"]), nodes(&["/buckets/b1"]));
        assert!(!s.try_activate(moving), "its key lies in the active DELETE's subtree");
        s.remove(delete);
        assert!(s.try_activate(moving));
        let keys_only = s.enqueue(nodes(&["/z"]), nodes(&["/buckets/b2"]));
        assert!(s.try_activate(keys_only), "two writes' single keys meet at the keys' own turns");
    }

    #[test]
    fn a_quarantine_closes_its_subtree_and_expires() {
        let s = Subtrees::default();
        let until = Instant::now() + std::time::Duration::from_secs(60);
        let lost = QuarantineCause::UnknownOutcome;
        s.quarantine("/d", until, lost);
        assert_eq!(s.quarantined("/d/f", false), Some((until, lost)));
        assert_eq!(s.quarantined("/", false), None, "a key above is not closed");
        assert_eq!(s.quarantined("/", true), Some((until, lost)), "a subtree above is");
        s.quarantine("/e", Instant::now(), lost);
        assert_eq!(s.quarantined("/e", false), None);
        assert!(!s.is_empty());
    }
}
