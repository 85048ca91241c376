//! A write's turn: from its authoritative check until the backend has answered it (or what it
//! touches is quarantined), no write that overlaps it runs (see `acquire.rs` for how it is
//! taken).
//!
//! [`Turn::finish`] owns the sequence a fenced write goes through once its turn has come, and
//! [`Turn::raise`] the one an operator's raise goes through, so that no caller can reorder
//! them: each runs in a task of its own, which finishes even if whoever waits for it leaves.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::acquire::{Held, Registered};
use super::tree::{Coverage, Touch, level, node};
use super::{EqualToken, Fence, FenceError, QuarantineCause, admit, quarantine_end};
use crate::store::{MarkKind, StoreError};

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
    /// Set while a forwarded write's outcome is open: a turn dropped then (its task panicked)
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
    /// `max_seen`: no quarantine over what it touches, and `token` above every level.
    pub fn check(&mut self, token: u64, equal: EqualToken) -> Result<(), FenceError> {
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
            admit(&touch.key, token, level(&fence.max_seen, &fence.tree, touch), equal)?;
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

    /// Makes the write's marks durable (one batch), then raises the tree.
    async fn advance(&self, token: u64) -> Result<(), StoreError> {
        let store = &self.fence.store;
        match self.touches.as_slice() {
            [Touch { key, coverage: Coverage::Key }] => store.advance(key, token).await?,
            touches => store.advance_all(marks(touches), token).await?,
        }
        for touch in &self.touches {
            self.fence.tree.raise(touch.mark().1, token);
        }
        Ok(())
    }

    /// Notes that the backend answered the write of `token`.
    fn answered(&self, token: u64) {
        let store = &self.fence.store;
        match self.touches.as_slice() {
            [Touch { key, coverage: Coverage::Key }] => store.answered(key, token),
            touches => store.answered_all(&marks(touches), token),
        }
    }

    /// Runs a fenced write to its end, in this order: the authoritative check of `token`, the
    /// durable advance of everything it touches, `write` (the forward), then marking it
    /// answered or, when `outcome` says the backend may still apply it, quarantining what it
    /// touches for `quarantine`. Only then does the next overlapping write get its turn.
    pub async fn finish<T, E, W>(
        self,
        token: u64,
        equal: EqualToken,
        quarantine: Duration,
        write: W,
        outcome: fn(&Result<T, E>) -> Outcome,
    ) -> Result<T, E>
    where
        W: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: From<FenceError> + From<StoreError> + Send + 'static,
    {
        // In a task of its own: were it cancelled mid-forward, the backend could still apply
        // the write after the next one was sent.
        let task = tokio::spawn(async move {
            let mut turn = self;
            turn.check(token, equal)?;
            // Durable, and the table raised, before the write goes anywhere.
            turn.advance(token).await?;
            turn.unsettled = Some(quarantine);
            let result = write.await;
            turn.unsettled = None;
            match outcome(&result) {
                Outcome::Answered => turn.answered(token),
                // It stays in flight in the log too, so a restart quarantines it again.
                Outcome::Unknown => turn.quarantine(quarantine),
            }
            result
            // `turn` drops here: the next overlapping writes may go.
        });
        task.await.unwrap_or_else(|e| Err(FenceError::TaskFailed(e.to_string()).into()))
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
            let previous = fence.max_seen.entry(key);
            if let Some((max_seen, _)) = previous.filter(|(m, _)| *m > to) {
                return Err(FenceError::WouldLower { resource: key.to_string(), max_seen, to }.into());
            }
            if previous.map(|(m, _)| m) != Some(to) {
                fence.store.advance(key, to).await?;
                fence.tree.raise(key, to);
                // Nothing was forwarded for this advance. But a write that is still in flight
                // (its answer never came) must stay marked, or a restart would not quarantine it.
                if !previous.is_some_and(|(_, in_flight)| in_flight) {
                    fence.store.answered(key, to);
                }
                tracing::warn!(resource = %key, previous = ?previous.map(|(m, _)| m), max_seen = to,
                    "max_seen raised by an operator: every holder of a lower token is cut off");
            }
            Ok(Raised { previous: previous.map(|(m, _)| m) })
        });
        task.await.unwrap_or_else(|e| Err(FenceError::TaskFailed(e.to_string()).into()))
    }
}

/// The durable marks a write with `touches` raises, owned, for the store's multi-mark calls.
fn marks(touches: &[Touch]) -> Vec<(MarkKind, String)> {
    touches.iter().map(|t| t.mark()).map(|(kind, m)| (kind, m.to_owned())).collect()
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
pub(super) mod tests {
    use std::pin::pin;
    use std::task::{Context, Waker};

    use super::*;
    use crate::store::{FileStore, Store, StoreOptions, SyncMode};

    const STRICT: EqualToken = EqualToken::Reject;

    fn key(k: &str) -> Vec<Touch> {
        vec![Touch { key: k.into(), coverage: Coverage::Key }]
    }

    /// A fence whose store is a real one, in a directory removed when the test drops it.
    pub(in crate::fence) fn fence() -> (Arc<Fence>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open(dir.path(), StoreOptions { sync: SyncMode::Never, ..StoreOptions::default() });
        let store = store.unwrap();
        store.table().raise("/a", 34);
        (Arc::new(Fence::new(Arc::new(store))), dir)
    }

    #[tokio::test]
    async fn a_higher_token_that_took_its_turn_first_makes_a_waiter_stale() {
        let (t, _dir) = fence();
        let mut first = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        first.check(40, STRICT).unwrap();
        let waiter = {
            let t = Arc::clone(&t);
            tokio::spawn(async move {
                let mut turn = t.acquire(key("/a"), Duration::from_secs(5)).await.unwrap();
                turn.check(35, STRICT)
            })
        };
        while t.queue_len("/a") < 2 {
            tokio::task::yield_now().await;
        }
        t.max_seen.raise("/a", 40); // what the store does once the advance is durable
        drop(first);
        assert!(matches!(waiter.await.unwrap(), Err(FenceError::Stale { max_seen: 40, .. })));
        assert_eq!(t.active_gates(), 0, "gates of idle resources are dropped");
    }

    #[tokio::test]
    async fn waiting_longer_than_the_bound_is_a_queue_timeout() {
        let (t, _dir) = fence();
        let _held = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        let err = t.acquire(key("/a"), Duration::from_millis(20)).await.unwrap_err();
        assert!(matches!(err, FenceError::QueueTimeout { .. }));
        let _other = t.acquire(key("/b"), Duration::from_millis(20)).await.expect("other resources never wait");
    }

    #[tokio::test]
    async fn a_waiter_dropped_after_the_holder_left_releases_the_gate() {
        let (t, _dir) = fence();
        let held = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        {
            let mut waiting = pin!(t.acquire(key("/a"), Duration::from_secs(60)));
            let poll = waiting.as_mut().poll(&mut Context::from_waker(Waker::noop()));
            assert!(poll.is_pending(), "the turn is held");
            assert_eq!(t.queue_len("/a"), 2);
            drop(held); // hands the turn to the waiter, which is never polled again
        } // the waiter is dropped, as a reset HTTP/2 stream's request would be
        assert_eq!(t.active_gates(), 0, "no gate is left behind for a resource nobody writes");
    }

    #[tokio::test]
    async fn quarantine_closes_the_resource_until_it_expires() {
        let (t, _dir) = fence();
        let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        turn.quarantine(Duration::from_millis(50));
        drop(turn);
        assert_eq!(t.active_gates(), 1, "a quarantined gate is kept");
        let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        assert!(matches!(turn.check(99, STRICT), Err(FenceError::Quarantined { .. })));
        drop(turn);
        // The quarantine's own length is what is tested here: wait it out.
        tokio::time::sleep(Duration::from_millis(60)).await;
        let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        assert!(turn.check(99, STRICT).is_ok());
        drop(turn);
        assert_eq!(t.active_gates(), 0);
    }

    #[derive(Debug, PartialEq)]
    pub(in crate::fence) enum Failed {
        Fence(FenceError),
        Store,
        Backend,
    }

    impl From<FenceError> for Failed {
        fn from(e: FenceError) -> Self {
            Failed::Fence(e)
        }
    }

    impl From<StoreError> for Failed {
        fn from(_: StoreError) -> Self {
            Failed::Store
        }
    }

    fn outcome(r: &Result<u64, Failed>) -> Outcome {
        if r.is_ok() { Outcome::Answered } else { Outcome::Unknown }
    }

    #[tokio::test]
    async fn finish_advances_before_the_write_and_releases_the_turn_after_it() {
        let (t, _dir) = fence();
        let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        let seen = Arc::clone(&t);
        let write = async move { Ok(seen.max_seen("/a").unwrap()) };
        assert_eq!(turn.finish(35, STRICT, Duration::from_secs(9), write, outcome).await, Ok(35), "durable first");
        assert_eq!(t.active_gates(), 0);
        // The store clears the in-flight mark when its writer takes the answer in.
        for _ in 0..5000 {
            if t.max_seen.entry("/a") == Some((35, false)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(t.max_seen.entry("/a"), Some((35, false)), "answered, no longer in flight");

        let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        let refused = turn.finish(35, STRICT, Duration::from_secs(9), async { Ok(0) }, outcome).await;
        assert!(matches!(refused, Err(Failed::Fence(FenceError::Stale { max_seen: 35, .. }))));
    }

    #[tokio::test]
    async fn a_write_with_an_unknown_outcome_stays_in_flight_and_quarantines_the_resource() {
        let (t, _dir) = fence();
        let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        let lost = turn.finish(36, STRICT, Duration::from_secs(60), async { Err(Failed::Backend) }, outcome).await;
        assert_eq!(lost, Err(Failed::Backend));
        assert_eq!(t.max_seen.entry("/a"), Some((36, true)), "a restart would quarantine it again");
        let mut next = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        assert!(matches!(next.check(99, STRICT), Err(FenceError::Quarantined { .. })));
    }

    #[tokio::test]
    async fn a_write_whose_task_panics_at_the_backend_quarantines_the_resource() {
        let (t, _dir) = fence();
        let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        let panics = async { panic!("a bug while forwarding") };
        let failed: Result<u64, Failed> = turn.finish(37, STRICT, Duration::from_secs(60), panics, outcome).await;
        assert!(matches!(failed, Err(Failed::Fence(FenceError::TaskFailed(_)))));
        let mut next = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
        assert!(matches!(next.check(99, STRICT), Err(FenceError::Quarantined { .. })), "its outcome is unknown");
    }

    #[tokio::test]
    async fn raise_never_lowers_and_keeps_an_unanswered_write_in_flight() {
        let (t, _dir) = fence();
        t.max_seen.advance("/flying", 7); // a write the backend never answered
        let fence = &t;
        let raise = |to| async move {
            fence.acquire(key("/flying"), Duration::from_secs(1)).await.unwrap().raise::<Failed>(to).await
        };
        let lower = raise(6).await;
        assert!(matches!(lower, Err(Failed::Fence(FenceError::WouldLower { max_seen: 7, to: 6, .. }))));
        assert_eq!(raise(7).await, Ok(Raised { previous: Some(7) }), "the same value changes nothing");
        assert_eq!(raise(9).await, Ok(Raised { previous: Some(7) }));
        assert_eq!(t.max_seen.entry("/flying"), Some((9, true)), "still in flight: a restart quarantines it");
        assert_eq!(raise(10).await, Ok(Raised { previous: Some(9) }));
        assert_eq!(t.max_seen.entry("/a"), Some((34, false)));
        t.max_seen.answered("/flying", 10);
        assert_eq!(t.max_seen.entry("/flying"), Some((10, false)));
    }
}
