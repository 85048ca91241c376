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
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::acquire::Registered;
use super::detach::Detached;
use super::gates::KeyTurn;
use super::tree::{Coverage, Touch, node};
use super::{Fence, FenceError, Pin, Policy, QuarantineCause, quarantine_end};
use crate::store::{Change, Mark, MarkBatch, MarkRef, Permit, StoreError};

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

/// What a turn's authoritative check passed in: the store's term (see
/// [`Store::term`](crate::store::Store::term)). The levels it checked belong to that term, so
/// the write's advance, its permit to be sent and its answer are made in it too, or not at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    term: u64,
}

/// Exclusive right to check, advance and forward one write. Dropping it lets the next waiting
/// writes proceed.
#[derive(Debug)]
pub struct Turn {
    fence: Arc<Fence>,
    touches: Vec<Touch>,
    /// The key turns held, sorted: the touched keys, and for a subtree write every key under it
    /// that had a write waiting or in flight.
    key_turns: Vec<KeyTurn>,
    /// A subtree write's place in the registry.
    registered: Option<Registered>,
    /// Set while a forwarded write's outcome is open: a turn dropped then (its write panicked)
    /// quarantines what it touches for this long, as for any unknown outcome.
    unsettled: Option<Duration>,
    /// What the write's [`PinSlot`] did, shared with it; allocated only for a write that asked
    /// for one.
    pinned: Option<Arc<Mutex<SlotState>>>,
    /// Once the write is advanced, how many pins its slot had set by then: the pins of what it
    /// touches are forgotten when the turn ends unless the answer set the slot's since.
    advanced: Option<u32>,
    /// The check let the write pass a quarantine that a pinned write's unknown outcome left.
    passed_quarantine: bool,
}

/// The pin of a one-key write's key (docs/pins.md), read and set by the write while its turn
/// is held, so that no other write through this fence moves the backend's state meanwhile.
#[derive(Debug)]
pub struct PinSlot {
    fence: Arc<Fence>,
    key: Box<str>,
    state: Arc<Mutex<SlotState>>,
    /// The key's running quarantine's end and the tags its late pinned writes were sent with,
    /// when it names any.
    late: Option<(Instant, Box<[Box<str>]>)>,
}

/// What a [`PinSlot`] did, read by its turn.
#[derive(Debug, Default)]
struct SlotState {
    /// The pin the write was sent with, once it is sent pinned (see [`PinSlot::sent_pinned`]).
    sent: Option<Pin>,
    /// How many times the slot set its key's pin.
    sets: u32,
}

impl PinSlot {
    /// What was last learnt of the backend's state of the key, if anything is known.
    pub fn get(&self) -> Option<Pin> {
        self.fence.pins.get(&self.key)
    }

    /// Notes what the backend's state of the key is, learnt under the turn.
    pub fn set(&self, pin: Pin) {
        self.fence.pins.set(&self.key, pin);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.sets = state.sets.wrapping_add(1);
    }

    /// The key whose pin this is.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Notes that the write is sent with a precondition naming `pin`: should its outcome be
    /// unknown, it can only apply while the backend is still in that state.
    pub fn sent_pinned(&self, pin: &Pin) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).sent = Some(pin.clone());
    }

    /// How long the key's quarantine still runs, when a write whose outcome is unknown was
    /// sent pinned to `pin`: that write applies whenever the key is in that state, so a write
    /// sent pinned to it as well could be applied before it (docs/pins.md). A tag that is a
    /// digest of the content comes back with the same bytes.
    pub fn late(&self, pin: &Pin) -> Option<Duration> {
        let (Pin::Tag(tag), Some((_, late))) = (pin, &self.late) else { return None };
        if late.iter().any(|l| **l == **tag) { self.late_any() } else { None }
    }

    /// How long the key's quarantine still runs, when a write whose outcome is unknown was
    /// sent pinned to a tag: a write that cannot be pinned itself (its state cannot be learnt)
    /// could leave that very tag behind, so it waits.
    pub fn late_any(&self) -> Option<Duration> {
        let (until, _) = self.late.as_ref()?;
        let now = Instant::now();
        (*until > now).then(|| *until - now)
    }
}

impl Fence {
    /// Waits (FIFO, at most `wait`) until no earlier write that overlaps `touches` is in
    /// flight, and returns the turn for them.
    pub async fn acquire(self: &Arc<Self>, touches: Vec<Touch>, wait: Duration) -> Result<Turn, FenceError> {
        let taken = self.take(&touches, wait).await?;
        Ok(Turn {
            fence: Arc::clone(self),
            touches,
            key_turns: taken.key_turns,
            registered: taken.registered,
            unsettled: None,
            pinned: None,
            advanced: None,
            passed_quarantine: false,
        })
    }
}

impl Turn {
    /// The first fence key this turn is for.
    pub fn key(&self) -> &str {
        self.touches.first().map_or("", |t| &t.key)
    }

    /// The authoritative check, made while no write that overlaps this one can move
    /// `max_seen`: no quarantine over what it touches, `token` above every level, and no
    /// further above it than the policy's `max_jump`. Returns the store's term it was made in.
    pub fn check(&mut self, token: u64, policy: impl Into<Policy>) -> Result<Checked, FenceError> {
        // Read before the levels: what they admit is advanced in this term or not at all.
        let checked = Checked { term: self.fence.store.term() };
        let policy = policy.into();
        let now = Instant::now();
        for key_turn in &mut self.key_turns {
            if let Some((retry_after, cause)) = key_turn.quarantined(now) {
                if !(policy.pinned && cause == QuarantineCause::UnknownPinnedOutcome) {
                    return Err(FenceError::Quarantined { resource: key_turn.key().to_owned(), retry_after, cause });
                }
                self.passed_quarantine = true;
            }
        }
        let fence = &self.fence;
        for touch in &self.touches {
            let here = node(&touch.key);
            let subtree = touch.coverage == Coverage::Subtree;
            if let Some((until, cause)) = fence.subtrees.quarantined(here, subtree) {
                let (resource, retry_after) = (touch.key.clone(), until - now);
                return Err(FenceError::Quarantined { resource, retry_after, cause });
            }
            fence.judge(touch, token, policy)?;
        }
        Ok(checked)
    }

    /// The slot of this write's pin: `None` unless it touches one key alone.
    pub fn pin_slot(&mut self) -> Option<PinSlot> {
        let [touch] = self.touches.as_slice() else { return None };
        if touch.coverage != Coverage::Key {
            return None;
        }
        let late = self.key_turns.iter().find(|k| k.key() == touch.key).and_then(KeyTurn::late);
        let state = Arc::clone(self.pinned.get_or_insert_with(Default::default));
        Some(PinSlot { fence: Arc::clone(&self.fence), key: touch.key.as_str().into(), state, late })
    }

    /// Closes what this write touches for `period`: it may still be applied late.
    pub fn quarantine(&mut self, period: Duration) {
        let until = quarantine_end(period);
        let sent = self.pinned.as_ref().and_then(|s| s.lock().unwrap_or_else(PoisonError::into_inner).sent.clone());
        let cause = match sent {
            Some(_) => QuarantineCause::UnknownPinnedOutcome,
            None => QuarantineCause::UnknownOutcome,
        };
        for touch in &self.touches {
            match touch.coverage {
                Coverage::Subtree => self.fence.subtrees.quarantine(node(&touch.key), until, cause),
                Coverage::Key => {
                    if let Some(key_turn) = self.key_turns.iter_mut().find(|k| k.key() == touch.key) {
                        key_turn.quarantine(until, cause);
                        if let Some(Pin::Tag(tag)) = &sent {
                            key_turn.note_late(tag);
                        }
                    }
                }
            }
        }
    }

    /// Ends the quarantine of the keys this turn holds; whether one was running.
    pub(super) fn lift_quarantine(&mut self) -> bool {
        let now = Instant::now();
        let mut lifted = false;
        for key_turn in &mut self.key_turns {
            lifted |= key_turn.lift(now);
        }
        lifted
    }

    /// Whether the write checked as `checked` may still be sent, by the store's word for the
    /// term it was checked in; `None` when it always may.
    fn permit(&self, checked: Checked) -> Option<Permit> {
        self.fence.store.permit(checked.term)
    }

    /// Makes the write's marks durable (one batch) in the store's term it was checked in, then
    /// raises the tree.
    async fn advance(&mut self, checked: Checked, token: u64) -> Result<(), StoreError> {
        self.fence.store.commit(checked.term, self.batch(Change::Advance, token)).await?;
        self.fence.raised(&self.touches, token);
        // What the backend holds for these keys is about to change. Their pins are read only
        // under their turns, so they are forgotten when this one ends (see `Drop`), unless a
        // pinned write's answer set its key's pin by then.
        self.advanced = Some(self.slot_sets());
        Ok(())
    }

    /// How many pins this turn's slot has set.
    fn slot_sets(&self) -> u32 {
        self.pinned.as_ref().map_or(0, |s| s.lock().unwrap_or_else(PoisonError::into_inner).sets)
    }

    /// Notes that the backend answered the write of `token`, advanced in the term it was
    /// checked in.
    async fn answered(&self, checked: Checked, token: u64) {
        // An answer resolves at once, and always with Ok.
        let _ = self.fence.store.commit(checked.term, self.batch(Change::Answered, token)).await;
    }

    /// The batch making `change` to the durable marks this write raises, with `token`.
    fn batch(&self, change: Change, token: u64) -> MarkBatch {
        match self.touches.as_slice() {
            [touch] => MarkBatch::one(change, touch.mark().to_mark(), token),
            touches => MarkBatch::new(change, touches.iter().map(|t| t.mark().to_mark()), token),
        }
    }

    /// [`Turn::finish_after`] for a write that needs nothing before its advance and is sent
    /// whatever the store's permit (the file store permits every write it advanced).
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
        self.finish_after(token, policy.into(), quarantine, move |_: Option<Permit>| async move { Ok(write) }, outcome)
            .await
    }

    /// Runs a fenced write to its end, in this order: the authoritative check of `token`, which
    /// fixes the store's term; `prepare`, called with the store's permit for that term, which
    /// gets what the write needs before its token is used up (its backend connection) and
    /// returns the write, to be sent under that permit; the durable advance of everything it touches, in that term; the
    /// write (the forward); then marking it answered in that term or, when `outcome` says the
    /// backend may still apply it, quarantining what it touches for `quarantine`. Only then
    /// does the next overlapping write get its turn. A `prepare` that fails has sent nothing:
    /// its error is returned with nothing advanced and nothing quarantined, so the holder may
    /// try again with the same token.
    pub async fn finish_after<T, E, P, F, W>(
        self,
        token: u64,
        policy: impl Into<Policy>,
        quarantine: Duration,
        prepare: P,
        outcome: fn(&Result<T, E>) -> Outcome,
    ) -> Result<T, E>
    where
        P: FnOnce(Option<Permit>) -> F + Send + 'static,
        F: Future<Output = Result<W, E>> + Send + 'static,
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
            // The permit, the advance and the answer are all of the term this check was made in.
            let checked = turn.check(token, policy)?;
            // After the check, so that a stale write takes no backend connection; before the
            // advance, so that one that cannot get any has not used its token up.
            let write = prepare(turn.permit(checked)).await?;
            // Durable, and the table raised, before the write goes anywhere.
            turn.advance(checked, token).await?;
            turn.unsettled = Some(quarantine);
            let result = write.await;
            turn.unsettled = None;
            match outcome(&result) {
                // A write that passed a pinned quarantine leaves its advance in flight in the
                // log: its answer must not clear the mark of the write whose outcome is still
                // unknown, or a restart would forget to quarantine the key (tests/cluster/
                // pin_model.rs finds the trace: a late create landing after a DELETE).
                Outcome::Answered if turn.passed_quarantine => {}
                Outcome::Answered => turn.answered(checked, token).await,
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
            let previous = fence.max_seen.entry(MarkRef::key(key));
            if let Some((max_seen, _)) = previous.filter(|(m, _)| *m > to) {
                return Err(FenceError::WouldLower { resource: key.to_string(), max_seen, to }.into());
            }
            if previous.map(|(m, _)| m) != Some(to) {
                fence.store.commit(term, MarkBatch::advance([Mark::key(key)], to)).await?;
                fence.raised(&self.touches, to);
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
        // Before the gates: the next write to a key must not find the pin its state had before
        // this write.
        if self.advanced.is_some_and(|sets| sets == self.slot_sets()) {
            self.fence.pins.forget_touched(&self.touches);
        }
        self.fence.gates.put_back(&mut self.key_turns);
        // After the gates: writes that waited for the registry find them free.
        drop(self.registered.take());
    }
}

#[cfg(test)]
#[path = "turn_tests.rs"]
pub(super) mod tests;
