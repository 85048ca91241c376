//! The fence: `max_seen` per resource, and the per-resource turn that serialises writes.
//!
//! Two maps keep memory proportional to what is happening: the store's [`Table`] holds one
//! integer for every resource ever written, while `gates` holds a FIFO mutex only for resources
//! that have a write waiting, in flight, or quarantined. A gate is dropped from the map by the last task to
//! leave it, which the map's shard lock makes race-free (see [`Turn`]'s `Drop`).
//!
//! A write's life: [`Fence::precheck`] (cheap, lock-free, may refuse early) →
//! [`Fence::acquire`] (wait for the resource's turn) → [`Turn::check`] (the authoritative
//! check, quarantine included) → the store persists and raises the table → forward → drop the turn.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::config::EqualToken;
use crate::request::refusal::Error;
use crate::store::Table;

pub mod path;
pub mod token;

/// Per-gate state, only ever touched by the holder of the resource's turn.
#[derive(Debug, Default)]
struct GateState {
    quarantined_until: Option<Instant>,
}

type Gate = Arc<Mutex<GateState>>;

/// `max_seen` for every resource, plus the turns of resources with writes in progress.
#[derive(Debug)]
pub struct Fence {
    max_seen: Arc<Table>,
    /// Hashed with foldhash, like [`Table`] and for its reasons: each fenced write hashes its
    /// key here twice, to take its turn and to give it back.
    gates: DashMap<Box<str>, Gate, foldhash::quality::RandomState>,
}

impl Fence {
    /// Fences against `max_seen`, the table a store keeps current.
    pub fn new(max_seen: Arc<Table>) -> Self {
        Fence { max_seen, gates: DashMap::default() }
    }

    /// The highest token `key` has accepted, if any.
    pub fn max_seen(&self, key: &str) -> Option<u64> {
        self.max_seen.get(key)
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

    /// Number of writes holding or waiting for `key`'s turn.
    pub fn queue_len(&self, key: &str) -> usize {
        // Each holder and each waiter holds a clone of the gate; the map holds one more.
        self.gates.get(key).map_or(0, |g| Arc::strong_count(g.value()) - 1)
    }

    /// Refuses a stale token without waiting for the resource's turn. Never wrong to refuse:
    /// `max_seen` only climbs, so a token stale now is stale when its turn would come.
    /// `equal` is the policy of the request's settings, so a reload never changes it midway.
    pub fn precheck(&self, key: &str, token: u64, equal: EqualToken) -> Result<(), Error> {
        admit(key, token, self.max_seen(key), equal)
    }

    /// `max_seen` of `key` and whether a write to it is still in flight.
    pub fn entry(&self, key: &str) -> Option<(u64, bool)> {
        self.max_seen.entry(key)
    }

    /// Closes `key` to writes for `period` from now, without taking its turn: for writes that
    /// were in flight when the previous process stopped. Called before serving starts; a gate
    /// someone holds is never replaced.
    pub(crate) fn quarantine(&self, key: &str, period: Duration) {
        let until = quarantine_end(period);
        let gate = self.gates.entry(key.into()).or_default().clone();
        if let Ok(mut state) = gate.try_lock() {
            state.quarantined_until = state.quarantined_until.max(Some(until));
        }
    }

    /// Drops `key`'s gate if nobody waits on it, holds it, or needs its quarantine. Under the
    /// shard lock no one can clone the gate, so a count of one (the map's own) means no task
    /// waits on it, and `try_lock` sees the state the last holder left.
    fn release_gate(&self, key: &str) {
        self.gates.remove_if(key, |_, g| {
            Arc::strong_count(g) == 1 && g.try_lock().is_ok_and(|s| s.quarantined_until.is_none())
        });
    }

    /// Waits (FIFO, at most `wait`) until no earlier write to `key` is in flight.
    pub async fn acquire(self: &Arc<Self>, key: &str, wait: Duration) -> Result<Turn, Error> {
        let gate = self.gates.entry(key.into()).or_default().clone();
        match tokio::time::timeout(wait, gate.lock_owned()).await {
            Ok(guard) => Ok(Turn { table: Arc::clone(self), key: key.into(), guard: Some(guard) }),
            Err(_) => {
                // Our clone is gone with the future; if we were the last, clean up.
                self.release_gate(key);
                Err(Error::QueueTimeout { resource: key.to_owned(), waited: wait })
            }
        }
    }
}

/// When a quarantine of `period` that starts now ends (a day, should `period` overflow).
fn quarantine_end(period: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(period).unwrap_or(now + Duration::from_secs(86_400))
}

/// Refuses `token` unless it is above `max_seen` (or equal to it, if `equal` accepts that).
fn admit(key: &str, token: u64, max_seen: Option<u64>, equal: EqualToken) -> Result<(), Error> {
    match (max_seen, equal) {
        (Some(m), EqualToken::Reject) if token <= m => Err(stale(key, token, m)),
        (Some(m), EqualToken::Accept) if token < m => Err(stale(key, token, m)),
        _ => Ok(()),
    }
}

fn stale(key: &str, token: u64, max_seen: u64) -> Error {
    Error::StaleToken { resource: key.to_owned(), token, max_seen }
}

/// Exclusive right to check, advance and forward one write to a resource. Dropping it lets
/// the next waiting write proceed.
#[derive(Debug)]
pub struct Turn {
    table: Arc<Fence>,
    key: Box<str>,
    guard: Option<OwnedMutexGuard<GateState>>,
}

impl Turn {
    /// The fence key this turn is for.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The authoritative check, made while no other write to the resource can move `max_seen`.
    pub fn check(&mut self, token: u64, equal: EqualToken) -> Result<(), Error> {
        if let Some(state) = self.guard.as_mut() {
            match state.quarantined_until {
                Some(until) if until > Instant::now() => {
                    return Err(Error::Quarantined {
                        resource: self.key.to_string(),
                        retry_after: until - Instant::now(),
                    });
                }
                Some(_) => state.quarantined_until = None,
                None => {}
            }
        }
        admit(&self.key, token, self.table.max_seen(&self.key), equal)
    }

    /// Closes the resource to writes for `period`: an earlier write may still be applied late.
    pub fn quarantine(&mut self, period: Duration) {
        if let Some(state) = self.guard.as_mut() {
            state.quarantined_until = Some(quarantine_end(period));
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.table.release_gate(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRICT: EqualToken = EqualToken::Reject;

    fn table() -> Arc<Fence> {
        let max_seen = Arc::new(Table::new());
        max_seen.raise("/a", 34);
        Arc::new(Fence::new(max_seen))
    }

    #[test]
    fn equal_tokens_follow_the_policy() {
        let t = table();
        assert!(matches!(t.precheck("/a", 34, STRICT), Err(Error::StaleToken { max_seen: 34, .. })));
        assert!(t.precheck("/a", 35, STRICT).is_ok());
        assert!(t.precheck("/new", 0, STRICT).is_ok());
        assert!(t.precheck("/a", 34, EqualToken::Accept).is_ok());
        assert!(t.precheck("/a", 33, EqualToken::Accept).is_err());
    }

    #[tokio::test]
    async fn a_higher_token_that_took_its_turn_first_makes_a_waiter_stale() {
        let t = table();
        let mut first = t.acquire("/a", Duration::from_secs(1)).await.unwrap();
        first.check(40, STRICT).unwrap();
        let waiter = {
            let t = Arc::clone(&t);
            tokio::spawn(async move {
                let mut turn = t.acquire("/a", Duration::from_secs(5)).await.unwrap();
                turn.check(35, STRICT)
            })
        };
        tokio::task::yield_now().await;
        t.max_seen.raise("/a", 40); // what the store does once the advance is durable
        drop(first);
        assert!(matches!(waiter.await.unwrap(), Err(Error::StaleToken { max_seen: 40, .. })));
        assert_eq!(t.active_gates(), 0, "gates of idle resources are dropped");
    }

    #[tokio::test]
    async fn waiting_longer_than_the_bound_is_a_queue_timeout() {
        let t = table();
        let _held = t.acquire("/a", Duration::from_secs(1)).await.unwrap();
        let err = t.acquire("/a", Duration::from_millis(20)).await.unwrap_err();
        assert!(matches!(err, Error::QueueTimeout { .. }));
        let _other = t.acquire("/b", Duration::from_millis(20)).await.expect("other resources never wait");
    }

    #[tokio::test]
    async fn quarantine_closes_the_resource_until_it_expires() {
        let t = table();
        let mut turn = t.acquire("/a", Duration::from_secs(1)).await.unwrap();
        turn.quarantine(Duration::from_millis(50));
        drop(turn);
        assert_eq!(t.active_gates(), 1, "a quarantined gate is kept");
        let mut turn = t.acquire("/a", Duration::from_secs(1)).await.unwrap();
        assert!(matches!(turn.check(99, STRICT), Err(Error::Quarantined { .. })));
        drop(turn);
        tokio::time::sleep(Duration::from_millis(60)).await;
        let mut turn = t.acquire("/a", Duration::from_secs(1)).await.unwrap();
        assert!(turn.check(99, STRICT).is_ok());
        drop(turn);
        assert_eq!(t.active_gates(), 0);
    }
}
