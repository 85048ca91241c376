//! The fence: keys, tokens, and the turns that serialise writes.
//!
//! [`Fence`] reads `max_seen` and the floors from the store's [`Table`], and composes parts
//! that each own their state and its invariants in a file of their own: the highest token
//! below each directory (`Tree`, `tree.rs`); a FIFO gate only for resources that have a write
//! waiting, in flight, or quarantined, counted in the table's bytes (`Gates`, `gates.rs`), so
//! memory follows what is happening; the registry of subtree writes and quarantined subtrees
//! (`Subtrees`, `subtree.rs`); and each token domain's highest token (`HighWater`,
//! [`domains`]). A gate leaves the map with the last task that touches it.
//!
//! A write's life: [`Fence::precheck`] (cheap, lock-free, may refuse early) →
//! [`Fence::acquire`] (`turn.rs`; the turns are taken in `acquire.rs`: the subtree registry
//! for a write that covers subtrees, then the turn of every key it touches from the gates, in
//! one global order) → [`Turn::finish_after`], which owns the rest in this order: the
//! authoritative check, which reads the store's term once ([`Checked`]); the backend
//! connection; the durable advance in that term; the forward, sent under the store's permit
//! for that term; then "answered" in that term, or quarantine; and only then the next
//! overlapping write's turn. It runs to its end even if its caller leaves (`detach.rs`);
//! [`Turn::finish`] is the same with nothing to get before the advance. An operator's raise is
//! [`Turn::raise`], a reset or lift `operator.rs`. The fence knows nothing of HTTP: the forward
//! is a future it is handed, made for the permit of the write's term.
//!
//! A token is judged by a [`Policy`]: whether one equal to the level passes, and how far above
//! it (or above its token domain's highest token, [`domains`]) it may be. Signed tokens are
//! checked by [`signature`] before any of this, by the request module, which reads them.

mod acquire;
mod detach;
pub mod domains;
mod error;
mod gates;
pub mod guesses;
pub mod keys;
pub mod lock_names;
mod operator;
pub mod path;
mod pins;
pub mod signature;
mod subtree;
pub mod token;
mod tree;
mod turn;
pub mod uploads;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use serde::Serialize;

use crate::store::{Store, Table, TableBytes};
use domains::HighWater;
pub use domains::{DEFAULT_DOMAIN, Domains};
pub use error::{FenceError, QuarantineCause};
pub use gates::GATE_BYTES;
use gates::Gates;
pub use guesses::Guesses;
pub use keys::Scope;
pub use operator::{Lifted, Reset};
use pins::Pins;
pub use pins::{MAX_PINS, Pin};
use subtree::Subtrees;
use tree::Tree;
pub use tree::{Coverage, NODE_BYTES, Touch};
pub(crate) use tree::{covers, node};
pub use turn::{Checked, Outcome, PinSlot, Raised, Turn};
pub use uploads::BindError;

/// What to do with a token equal to `max_seen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EqualToken {
    /// Refuse it: each lock holder's token admits exactly one accepted write (the default).
    Reject,
    /// Accept it: the current holder may write many times with the same token.
    Accept,
}

/// How a token is judged against the level of each key it touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// What a token equal to the level gets.
    pub equal: EqualToken,
    /// How far above the level (or, for a key without one, above the highest token of its
    /// token domain) a token may be; unbounded when `None`.
    pub max_jump: Option<u64>,
    /// The write is sent pinned (docs/pins.md) and cannot leave its key absent: it may pass a
    /// quarantine that a pinned write's unknown outcome left, since that write can then only
    /// apply while the backend is in the state it was pinned to.
    pub pinned: bool,
}

impl From<EqualToken> for Policy {
    fn from(equal: EqualToken) -> Policy {
        Policy { equal, max_jump: None, pinned: false }
    }
}

/// `max_seen` for every resource, and the turns of resources with writes in progress.
///
/// Composed of parts that each own their state and its invariants, in a file of their own:
/// the gates (`gates.rs`), the tree (`tree.rs`), the subtree registry (`subtree.rs`) and the
/// token domains' highest tokens (`domains.rs`). Each part that reads the store's table or
/// counts its memory in the table's bytes holds the table itself.
#[derive(Debug)]
pub struct Fence {
    /// The store's table: what the queries and an operator's changes read.
    max_seen: Arc<Table>,
    store: Arc<dyn Store>,
    /// The turns of resources with writes waiting, in flight or quarantined.
    gates: Gates,
    /// The highest token below each node, for subtree checks.
    tree: Tree,
    /// Subtree writes queued and active, and quarantined subtrees.
    subtrees: Subtrees,
    /// The highest token of each token domain, for `max_jump`.
    high_water: HighWater,
    /// What the backend's state of each pinned key was when last learnt (docs/pins.md).
    pins: Pins,
}

impl Fence {
    /// Fences against the table `store` keeps current, and advances through `store`, with
    /// every key in the default token domain.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Fence::with_domains(store, Domains::default())
    }

    /// Like [`Fence::new`], with keys in the token domains `domains` names, whose highest
    /// tokens are counted from the table before this returns.
    pub fn with_domains(store: Arc<dyn Store>, domains: Domains) -> Self {
        let max_seen = Arc::clone(store.table());
        let tree = Tree::build(Arc::clone(&max_seen));
        let high_water = HighWater::counted(domains, Arc::clone(&max_seen));
        let gates = Gates::new(Arc::clone(&max_seen));
        Fence { max_seen, store, gates, tree, subtrees: Subtrees::default(), high_water, pins: Pins::default() }
    }

    /// The highest token `key` has accepted, if any.
    pub fn max_seen(&self, key: &str) -> Option<u64> {
        self.max_seen.get(key)
    }

    /// At most `limit` keys starting with `prefix` and sorting after `after`, in byte order,
    /// as `(key, max_seen, in_flight)`.
    pub fn page(&self, prefix: &str, after: Option<&str>, limit: usize) -> Vec<crate::store::Listed> {
        self.max_seen.page(prefix, after, limit)
    }

    /// The store the fence advances through.
    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Number of resources with a recorded `max_seen`.
    pub fn len(&self) -> usize {
        self.max_seen.len()
    }

    /// Whether no resource has a recorded `max_seen`.
    pub fn is_empty(&self) -> bool {
        self.max_seen.is_empty()
    }

    /// Number of resources that currently hold a gate (writes waiting, in flight or quarantined).
    pub fn active_gates(&self) -> usize {
        self.gates.len()
    }

    /// Approximate bytes of memory the table's keys and floors and the gates take now, and
    /// their limit (`store.max_table_bytes`).
    pub fn table_bytes(&self) -> (TableBytes, u64) {
        (self.max_seen.bytes(), self.max_seen.max_bytes())
    }

    /// Number of writes holding or waiting for `key`'s turn.
    pub fn queue_len(&self, key: &str) -> usize {
        self.gates.queue_len(key)
    }

    /// Refuses a stale token, or one that jumps too far, without waiting for the turn. Never
    /// wrong to refuse a stale one: `max_seen` and floors only climb, so a token stale now is
    /// stale when its turn would come. `policy` is that of the request's settings, so a reload
    /// never changes it midway.
    pub fn precheck(&self, touches: &[Touch], token: u64, policy: impl Into<Policy>) -> Result<(), FenceError> {
        let policy = policy.into();
        touches.iter().try_for_each(|t| self.judge(t, token, policy))
    }

    /// Refuses `token` for `touch` unless it is above the level (or equal to it, if the policy
    /// accepts that) and no further above it than `max_jump`.
    fn judge(&self, touch: &Touch, token: u64, policy: Policy) -> Result<(), FenceError> {
        let (level, floor) = self.tree.level_and_floor(touch);
        admit(&touch.key, token, level, floor, policy.equal)?;
        match policy.max_jump {
            Some(max_jump) => self.high_water.jump(touch, token, level, max_jump),
            None => Ok(()),
        }
    }

    /// Notes that the marks of `touches` now stand at `token`, made durable by the store: the
    /// tree and the token domains' highest tokens are raised with them.
    #[inline]
    fn raised(&self, touches: &[Touch], token: u64) {
        for touch in touches {
            self.tree.raise(touch.mark().name, token);
        }
        self.high_water.raise(touches, token);
    }

    /// Counts the tree and the token domains' highest tokens again from the table, after a
    /// change that may have lowered marks (a reset, a takeover's new table).
    fn recounted(&self) {
        self.tree.rebuild();
        self.high_water.recount();
    }

    /// Maps keys to token domains by `domains` from now on. When that changes the mapping, each
    /// domain's highest token is counted again from the table on a thread of its own (a pass
    /// over every key); until it is done, keys without a level of their own are bounded by the
    /// highest token of the old mapping over every domain, and advances made meanwhile are
    /// counted too. Returns whether a count started.
    pub fn set_domains(&self, domains: Domains) -> bool {
        self.high_water.set_domains(domains)
    }

    /// The highest token accepted in `domain`, if it has one and it has been counted (while a
    /// count runs, `max_jump` measures from the old mapping's highest token instead).
    pub fn domain_max(&self, domain: &str) -> Option<u64> {
        self.high_water.domain_max(domain)
    }

    /// Resources and subtrees quarantined now. A gate whose turn is held is not counted: its
    /// state belongs to its holder.
    pub fn quarantined(&self) -> usize {
        self.gates.quarantined_len() + self.subtrees.quarantined_len()
    }

    /// Nodes in the tree: directories with keys or floors below them.
    pub fn tree_nodes(&self) -> usize {
        self.tree.len()
    }

    /// Closes `key` to writes for `period` from now, without taking its turn: for writes that
    /// were in flight when the previous process (or leader) stopped. A gate someone holds is
    /// never replaced.
    pub(crate) fn quarantine(&self, key: &str, period: Duration) {
        let (until, cause) = (quarantine_end(period), QuarantineCause::InFlightAtStart);
        // A turn holds it (a write of an earlier term of a shared fence, at a takeover): its
        // state is the holder's, so the key is closed as a subtree instead, which the next
        // write's check sees as well (closing what lies below the key too, which only refuses
        // more).
        if !self.gates.try_quarantine(key, until, cause) {
            self.subtrees.quarantine(node(key), until, cause);
        }
    }

    /// Closes the subtree at `node` to writes for `period` from now: for subtree writes that
    /// were in flight when the previous process stopped. Called before serving starts.
    pub(crate) fn quarantine_subtree(&self, node: &str, period: Duration) {
        self.subtrees.quarantine(node, quarantine_end(period), QuarantineCause::InFlightAtStart);
    }

    /// Takes in a table the store loaded anew (a takeover of the shared fence): the tree and
    /// the domains' highest tokens are counted again from it, and what `adopted` says was in
    /// flight is quarantined for `period`. Called before this instance leads: writes of an
    /// earlier term may still hold turns, but none of them can advance any more.
    pub(crate) fn adopt(&self, adopted: &crate::store::Adopted, period: Duration) {
        self.recounted();
        // Another leader may have written meanwhile: every pin is learnt again.
        self.pins.clear();
        for (key, token) in &adopted.in_flight {
            tracing::warn!(resource = %key, token, quarantine = %humantime::format_duration(period),
                "a write was in flight when fencegate stopped or stepped down: resource quarantined");
            self.quarantine(key, period);
        }
        for (node, token) in &adopted.floors_in_flight {
            tracing::warn!(subtree = %node, token, quarantine = %humantime::format_duration(period),
                "a write covering a subtree was in flight when fencegate stopped or stepped down: subtree quarantined");
            self.quarantine_subtree(node, period);
        }
    }
}

/// When a quarantine of `period` that starts now ends (a day, should `period` overflow).
fn quarantine_end(period: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(period).unwrap_or(now + Duration::from_secs(86_400))
}

/// Refuses `token` unless it is above `level` (or equal to it, if `equal` accepts that);
/// `floor` is the node of the floor that sets the level, if one does.
fn admit(key: &str, token: u64, level: Option<u64>, floor: Option<&str>, equal: EqualToken) -> Result<(), FenceError> {
    match (level, equal) {
        (Some(m), EqualToken::Reject) if token <= m => Err(stale(key, token, m, floor)),
        (Some(m), EqualToken::Accept) if token < m => Err(stale(key, token, m, floor)),
        _ => Ok(()),
    }
}

fn stale(key: &str, token: u64, max_seen: u64, floor: Option<&str>) -> FenceError {
    // A floor covers its node's subtree: named as the collection, `/dav/` for node `/dav`.
    let floor = floor.map(|n| if n == "/" { n.to_owned() } else { format!("{n}/") });
    FenceError::Stale { resource: key.to_owned(), token, max_seen, floor }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tokens_follow_the_policy() {
        let (t, _dir) = turn::tests::fence();
        let strict = EqualToken::Reject;
        let key = |k: &str| [Touch { key: k.into(), coverage: Coverage::Key }];
        assert!(matches!(t.precheck(&key("/a"), 34, strict), Err(FenceError::Stale { max_seen: 34, .. })));
        assert!(t.precheck(&key("/a"), 35, strict).is_ok());
        assert!(t.precheck(&key("/new"), 0, strict).is_ok());
        assert!(t.precheck(&key("/a"), 34, EqualToken::Accept).is_ok());
        assert!(t.precheck(&key("/a"), 33, EqualToken::Accept).is_err());
        // Only a refusal of an equal token names the setting that decides it.
        let equal = t.precheck(&key("/a"), 34, strict).unwrap_err().to_string();
        assert!(equal.contains("equal_token = \"accept\""), "{equal}");
        let below = t.precheck(&key("/a"), 33, strict).unwrap_err().to_string();
        assert!(!below.contains("equal_token"), "{below}");
    }

    #[tokio::test]
    async fn a_quarantine_of_a_key_whose_turn_is_held_closes_it_all_the_same() {
        let (t, _dir) = turn::tests::fence();
        let key = |k: &str| vec![Touch { key: k.into(), coverage: Coverage::Key }];
        // A write of an earlier term holds the turn when a takeover quarantines the key.
        let held = t.acquire(key("/busy"), Duration::from_secs(1)).await.unwrap();
        t.quarantine("/busy", Duration::from_secs(60));
        drop(held);
        let mut next = t.acquire(key("/busy"), Duration::from_secs(1)).await.unwrap();
        let err = next.check(99, EqualToken::Reject).unwrap_err();
        assert!(matches!(err, FenceError::Quarantined { cause: QuarantineCause::InFlightAtStart, .. }), "{err}");
    }

    #[tokio::test]
    async fn a_quarantine_says_what_left_the_outcome_unknown() {
        let (t, _dir) = turn::tests::fence();
        let key = |k: &str| vec![Touch { key: k.into(), coverage: Coverage::Key }];
        t.quarantine("/flying", Duration::from_secs(60));
        let mut turn = t.acquire(key("/flying"), Duration::from_secs(1)).await.unwrap();
        let err = turn.check(99, EqualToken::Reject).unwrap_err();
        assert!(matches!(err, FenceError::Quarantined { cause: QuarantineCause::InFlightAtStart, .. }));
        assert!(err.to_string().contains("in flight when fencegate last stopped"), "{err}");
        turn.quarantine(Duration::from_secs(60));
        drop(turn);
        let mut turn = t.acquire(key("/flying"), Duration::from_secs(1)).await.unwrap();
        let err = turn.check(99, EqualToken::Reject).unwrap_err();
        assert!(err.to_string().contains("did not answer an earlier write"), "{err}");
    }
}
