//! What an operator changes by hand besides raising a fence ([`Turn::raise`](super::Turn::raise)):
//! lowering one ([`Fence::reset`]) and ending a quarantine early ([`Fence::lift`]).
//!
//! A reset is the way back from a resource bricked by a huge token (any client can send
//! `u64::MAX`). It lowers the key's `max_seen` and every floor at or below its node, never
//! raises anything, and is written as reset records, which recovery applies in log order. The
//! tree's `below` values only climb as writes raise them, so after lowering marks they are
//! recomputed from the table, and so is each token domain's highest token (`max_jump`); for that no write may raise the tree meanwhile, so a reset takes
//! the turn of the whole tree: it waits for every write in flight, and fenced writes wait for it
//! (one batch and one pass over the table). Resets are rare and made by people; a write
//! refused because a reset was slow is a cheap price for a tree that is exact again.

use std::sync::Arc;
use std::time::Duration;

use super::tree::{Coverage, Touch, covers, node};
use super::{Fence, FenceError};
use crate::store::{Mark, MarkBatch, MarkKind, MarkRef, StoreError};

/// What a reset changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reset {
    /// The key's `max_seen` before, if it had one.
    pub previous: Option<u64>,
    /// The floors at or below the key that were lowered, with their values before.
    pub floors: Vec<(String, u64)>,
    /// Floors above the key that stay above the new value: writes to the key stay refused
    /// below them until they are reset too.
    pub floors_above: Vec<(String, u64)>,
}

/// What a lift ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifted {
    /// A quarantine of the key itself.
    pub key: bool,
    /// A quarantine of the subtree at the key's node.
    pub subtree: bool,
}

impl Fence {
    /// Sets `max_seen` of `key` to `to`, and every floor at or below its node that is above
    /// `to` to `to`, durably, once every write in flight has been answered. Refuses a `to`
    /// above the key's `max_seen` (raising is [`Turn::raise`](super::Turn::raise)'s job) and
    /// a key with neither a `max_seen` nor a floor below it.
    pub async fn reset<E>(self: &Arc<Self>, key: &str, to: u64, wait: Duration) -> Result<Reset, E>
    where
        E: From<FenceError> + From<StoreError> + Send + 'static,
    {
        let everything = vec![Touch { key: "/".into(), coverage: Coverage::Subtree }];
        let turn = self.acquire(everything, wait).await?;
        let (fence, key) = (Arc::clone(self), key.to_owned());
        // In a task of its own, holding the turn: a caller that leaves cannot cut the reset
        // between its durable records and the tree's rebuild, nor lose its audit line.
        let task = tokio::spawn(async move {
            let done = fence.reset_holding(&key, to).await;
            drop(turn);
            done
        });
        task.await.unwrap_or_else(|e| Err(FenceError::TaskFailed(e.to_string()).into()))
    }

    async fn reset_holding<E>(&self, key: &str, to: u64) -> Result<Reset, E>
    where
        E: From<FenceError> + From<StoreError>,
    {
        let table = &self.max_seen;
        // What is read below belongs to this term of the store: the reset is made in it or not.
        let term = self.store.term();
        let here = node(key);
        let previous = table.get(key);
        if let Some(max_seen) = previous.filter(|m| *m < to) {
            return Err(FenceError::WouldRaise { resource: key.to_owned(), max_seen, to }.into());
        }
        let (mut floors, mut floors_above, mut any_floor) = (Vec::new(), Vec::new(), false);
        table.for_each(MarkKind::Floor, |p, token, _| {
            if covers(here, p) {
                any_floor = true;
                if token > to {
                    floors.push((p.to_owned(), token));
                }
            } else if covers(p, here) && token > to {
                floors_above.push((p.to_owned(), token));
            }
        });
        if previous.is_none() && !any_floor {
            return Err(FenceError::NoFence { resource: key.to_owned() }.into());
        }
        floors.sort_unstable();
        floors_above.sort_unstable();
        let mut marks: Vec<Mark> = floors.iter().map(|(p, _)| Mark::floor(p.as_str())).collect();
        if previous.is_some_and(|m| m > to) {
            marks.push(Mark::key(key));
        }
        if !marks.is_empty() {
            // Nothing changes if the store cannot record it: the operator may try again.
            self.store.commit(term, MarkBatch::reset(marks, to)).await?;
            self.recounted();
            let lowered: Vec<String> = floors.iter().map(|(p, t)| format!("{p} (was {t})")).collect();
            tracing::warn!(resource = %key, previous = %previous.map_or_else(|| "none".to_owned(), |m| m.to_string()),
                max_seen = to, floors = %lowered.join(", "),
                "max_seen lowered by an operator's reset: a holder of a token above it that was refused may write again");
        }
        Ok(Reset { previous, floors, floors_above })
    }

    /// Ends the quarantine of `key`, and of the subtree at its node, now rather than when it
    /// expires: for an operator who knows the backend will not apply the write whose outcome
    /// was unknown. Takes the key's turn, so it never cuts in before a write in flight.
    pub async fn lift(self: &Arc<Self>, key: &str, wait: Duration) -> Result<Lifted, FenceError> {
        // The answer below is of this term of the store: a later one's marker is left alone.
        let term = self.store.term();
        let mut turn = self.acquire(vec![Touch { key: key.into(), coverage: Coverage::Key }], wait).await?;
        let lifted = Lifted { key: turn.lift_quarantine(), subtree: self.subtrees.lift(node(key)) };
        // The write whose outcome was unknown is still in flight in the log, so without an
        // answer recorded for it a restart would quarantine the resource again. Holding the
        // key's turn, no write of the key is in flight now; a subtree that was quarantined had
        // none running at its node either.
        if let Some((token, true)) = self.max_seen.entry(MarkRef::key(key)) {
            let _ = self.store.commit(term, MarkBatch::answered([Mark::key(key)], token)).await;
        }
        if lifted.subtree
            && let Some((token, true)) = self.max_seen.entry(MarkRef::floor(node(key)))
        {
            let _ = self.store.commit(term, MarkBatch::answered([Mark::floor(node(key))], token)).await;
        }
        if lifted.key || lifted.subtree {
            tracing::warn!(resource = %key, key = lifted.key, subtree = lifted.subtree,
                "quarantine lifted by an operator: writes are accepted again");
        }
        Ok(lifted)
    }
}
