//! A write's turn: from its authoritative check until the backend has answered it (or what it
//! touches is quarantined), no write that overlaps it runs (see `acquire.rs` for how it is
//! taken).
//!
//! [`Turn::finish_after`] owns the sequence a fenced write goes through once its turn has come
//! (check, prepare, advance, write, answered or quarantined), and [`Turn::raise`] the one an
//! operator's raise goes through, so that no caller can reorder them: each finishes even if
//! whoever waits for it leaves (a write through [`Detached`], a raise in a task of its own).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::acquire::{Held, Registered};
use super::detach::Detached;
use super::tree::{Coverage, Touch, node};
use super::{Fence, FenceError, Policy, QuarantineCause, quarantine_end};
use crate::store::{Change, Mark, MarkBatch, StoreError};

/// How a forwarded write ended, as far as the fence is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The backend answered (with any status), or was never sent a byte: the write is over.
    Answered,
    /// The backend may hold (part of) the write and apply it late: quarantine what it touches.
    Unknown,
}

/// What an operator's raise did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised {
    /// `max_seen` before the raise, if the resource had one.
    pub previous: Option<u64>,
}

/// Exclusive right to check, advance and forward one write. Dropping it lets the next waiting
/// writes proceed.
#[derive(Debug)]
pub struct Turn {
    fence: Arc<Fence>,
    touches: Vec<Touch>,
    /// The key gates held, sorted: the touched keys, and for a subtree write every key under it
    /// that had a write waiting or in flight.
    held: Vec<Held>,
    /// A subtree write's place in the registry.
    registered: Option<Registered>,
    /// Set while a forwarded write's outcome is open: a turn dropped then (its write panicked)
    /// quarantines what it touches for this long, as for any unknown outcome.
    unsettled: Option<Duration>,
}

impl Fence {
    /// Waits (FIFO, at most `wait`) until no earlier write that overlaps `touches` is in
    /// flight, and returns the turn for them.
    pub async fn acquire(self: &Arc<Self>, touches: Vec<Touch>, wait: Duration) -> Result<Turn, FenceError> {
        let taken = self.take(&touches, wait).await?;
        Ok(Turn { fence: Arc::clone(self), touches, held: taken.held, registered: taken.registered, unsettled: None })
    }
}

impl Turn {
    /// The first fence key this turn is for.
    pub fn key(&self) -> &str {
        self.touches.first().map_or("", |t| &t.key)
    }

    /// The authoritative check, made while no write that overlaps this one can move
    /// `max_seen`: no quarantine over what it touches, `token` above every level, and no
    /// further above it than the policy's `max_jump`.
    pub fn check(&mut self, token: u64, policy: impl Into<Policy>) -> Result<(), FenceError> {
        let policy = policy.into();
        let now = Instant::now();
        for h in &mut self.held {
            if let Some(state) = h.guard.as_mut() {
                match state.quarantined_until {
                    Some(until) if until > now => {
                        let (resource, retry_after, cause) = (h.key.to_string(), until - now, state.cause);
                        return Err(FenceError::Quarantined { resource, retry_after, cause });
                    }
                    Some(_) => state.quarantined_until = None,
                    None => {}
                }
            }
        }
        let fence = &self.fence;
        for touch in &self.touches {
            let here = node(&touch.key);
            let subtree = touch.coverage == Coverage::Subtree;
            if let Some((until, cause)) =
                (!fence.subtrees.is_empty()).then(|| fence.subtrees.quarantined(here, subtree)).flatten()
            {
                let (resource, retry_after) = (touch.key.clone(), until - now);
                return Err(FenceError::Quarantined { resource, retry_after, cause });
            }
            fence.judge(touch, token, policy)?;
        }
        Ok(())
    }

    /// Closes what this write touches for `period`: it may still be applied late.
    pub fn quarantine(&mut self, period: Duration) {
        let until = quarantine_end(period);
        for touch in &self.touches {
            match touch.coverage {
                Coverage::Subtree => {
                    self.fence.subtrees.quarantine(node(&touch.key), until, QuarantineCause::UnknownOutcome)
                }
                Coverage::Key => {
                    let held = self.held.iter_mut().find(|h| *h.key == *touch.key);
                    if let Some(state) = held.and_then(|h| h.guard.as_mut()) {
                        state.quarantined_until = Some(until);
                        state.cause = QuarantineCause::UnknownOutcome;
                    }
                }
            }
        }
    }

    /// Ends the quarantine of the keys this turn holds; whether one was running.
    pub(super) fn lift_quarantine(&mut self) -> bool {
        let now = Instant::now();
        let mut lifted = false;
        for state in self.held.iter_mut().filter_map(|h| h.guard.as_mut()) {
            lifted |= state.quarantined_until.take().is_some_and(|until| until > now);
        }
        lifted
    }

    /// Makes the write's marks durable (one batch) in the store's `term`, the one it was
    /// checked in, then raises the tree.
    async fn advance(&self, term: u64, token: u64) -> Result<(), StoreError> {
        self.fence.store.commit(term, self.batch(Change::Advance, token)).await?;
        for touch in &self.touches {
            self.fence.tree.raise(touch.mark().name, token, &self.fence.max_seen);
        }
        self.fence.high_water.load().raise(&self.touches, token);
        Ok(())
    }

    /// Notes that the backend answered the write of `token`, advanced in `term`.
    async fn answered(&self, term: u64, token: u64) {
        // An answer resolves at once, and always with Ok.
        let _ = self.fence.store.commit(term, self.batch(Change::Answered, token)).await;
    }

    /// The batch making `change` to the durable marks this write raises, with `token`.
    fn batch(&self, change: Change, token: u64) -> MarkBatch {
        MarkBatch::new(change, self.touches.iter().map(|t| t.mark().to_mark()), token)
    }

    /// [`Turn::finish_after`] for a write that needs nothing before its advance.
    pub async fn finish<T, E, W>(
        self,
        token: u64,
        policy: impl Into<Policy>,
        quarantine: Duration,
        write: W,
        outcome: fn(&Result<T, E>) -> Outcome,
    ) -> Result<T, E>
    where
        W: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: From<FenceError> + From<StoreError> + Send + 'static,
    {
        self.finish_after(token, policy.into(), quarantine, async { Ok(write) }, outcome).await
    }

    /// Runs a fenced write to its end, in this order: the authoritative check of `token`;
    /// `prepare`, which gets what the write needs before its token is used up (its backend
    /// connection) and returns the write; the durable advance of everything it touches; the
    /// write (the forward); then marking it answered or, when `outcome` says the backend may
    /// still apply it, quarantining what it touches for `quarantine`. Only then does the next
    /// overlapping write get its turn. A `prepare` that fails has sent nothing: its error is
    /// returned with nothing advanced and nothing quarantined, so the holder may try again
    /// with the same token.
    pub async fn finish_after<T, E, P, W>(
        self,
        token: u64,
        policy: impl Into<Policy>,
        quarantine: Duration,
        prepare: P,
        outcome: fn(&Result<T, E>) -> Outcome,
    ) -> Result<T, E>
    where
        P: Future<Output = Result<W, E>> + Send + 'static,
        W: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: From<FenceError> + From<StoreError> + Send + 'static,
    {
        let policy = policy.into();
        // Never cancelled: were it dropped mid-forward, the backend could still apply the
        // write after the next one was sent. It moves to a task of its own if its caller
        // leaves.
        let write = Detached::new(async move {
            let mut turn = self;
            // The levels checked belong to this term of the store; the advance is made in it
            // or not at all.
            let term = turn.fence.store.term();
            turn.check(token, policy)?;
            // After the check, so that a stale write takes no backend connection; before the
            // advance, so that one that cannot get any has not used its token up.
            let write = prepare.await?;
            // Durable, and the table raised, before the write goes anywhere.
            turn.advance(term, token).await?;
            turn.unsettled = Some(quarantine);
            let result = write.await;
            turn.unsettled = None;
            match outcome(&result) {
                Outcome::Answered => turn.answered(term, token).await,
                // It stays in flight in the log too, so a restart quarantines it again.
                Outcome::Unknown => turn.quarantine(quarantine),
            }
            result
            // `turn` drops here: the next overlapping writes may go.
        });
        write.await.unwrap_or_else(|panic| Err(FenceError::TaskFailed(panic).into()))
    }

    /// Raises `max_seen` of this turn's key to `to` by hand: durable like a write's advance,
    /// without a write, and logged (in the same task, so a caller that leaves cannot lose the
    /// audit line). Never lowers it; raising it to its current value changes nothing.
    pub async fn raise<E>(self, to: u64) -> Result<Raised, E>
    where
        E: From<FenceError> + From<StoreError> + Send + 'static,
    {
        let task = tokio::spawn(async move {
            let (fence, key) = (&self.fence, self.key());
            let term = fence.store.term();
            let previous = fence.max_seen.entry(key);
            if let Some((max_seen, _)) = previous.filter(|(m, _)| *m > to) {
                return Err(FenceError::WouldLower { resource: key.to_string(), max_seen, to }.into());
            }
            if previous.map(|(m, _)| m) != Some(to) {
                fence.store.commit(term, MarkBatch::advance([Mark::key(key)], to)).await?;
                fence.tree.raise(key, to, &fence.max_seen);
                fence.high_water.load().raise(&self.touches, to);
                // Nothing was forwarded for this advance. But a write that is still in flight
                // (its answer never came) must stay marked, or a restart would not quarantine it.
                if !previous.is_some_and(|(_, in_flight)| in_flight) {
                    let _ = fence.store.commit(term, MarkBatch::answered([Mark::key(key)], to)).await;
                }
                tracing::warn!(resource = %key, previous = %previous.map_or_else(|| "none".to_owned(), |(m, _)| m.to_string()), max_seen = to,
                    "max_seen raised by an operator: every holder of a lower token is cut off");
            }
            Ok(Raised { previous: previous.map(|(m, _)| m) })
        });
        task.await.unwrap_or_else(|e| Err(FenceError::TaskFailed(e.to_string()).into()))
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(period) = self.unsettled.take() {
            self.quarantine(period);
        }
        self.fence.give_back(&mut self.held);
        // After the gates: writes that waited for the registry find them free.
        drop(self.registered.take());
    }
}

#[cfg(test)]
#[path = "turn_tests.rs"]
pub(super) mod tests;
