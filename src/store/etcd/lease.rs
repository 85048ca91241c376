//! What an instance knows of its own leadership: the lease clock it fences itself with, its
//! role, and the term that every leadership change starts.
//!
//! The lease clock counts from the send time of the last keep-alive etcd acknowledged, on
//! `CLOCK_BOOTTIME`, which keeps running through a suspend (`Instant` is `CLOCK_MONOTONIC`,
//! which stops): a process that was stopped or suspended finds its lease lapsed when it wakes,
//! however long it slept. The lease is trusted until `send + ttl - margin`; `margin` covers
//! the clock-rate difference between this machine and etcd's leader.
//!
//! A term counts leadership changes. A write is checked in one term and advanced only in that
//! same term: were it let through after a change, it could have been checked against levels
//! another leader has since raised.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use super::flights::Flights;

/// Nanoseconds on `CLOCK_BOOTTIME`.
fn boottime() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

/// The clock a lease is counted on.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LeaseClock {
    /// `CLOCK_BOOTTIME` (module docs): what a store counts its lease on.
    Boot,
    /// Tokio's clock, counted from the given instant: for tests of the lease's timing on a
    /// paused clock.
    #[cfg(test)]
    Tokio(tokio::time::Instant),
}

impl LeaseClock {
    /// Nanoseconds now.
    fn now(self) -> u64 {
        match self {
            LeaseClock::Boot => boottime(),
            #[cfg(test)]
            LeaseClock::Tokio(start) => nanos(start.elapsed()),
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// What this instance is, as far as fenced writes go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Looking for etcd, a lease, or the leader.
    Seeking(String),
    /// Another instance leads, at this URL.
    Following(String),
    /// Reading the table after winning the election: not yet serving writes.
    TakingOver,
    /// Leading: writes are fenced here, in batches guarded by `epoch`, chained from `batch`.
    Leading {
        /// The create revision of this instance's leader key.
        epoch: i64,
        /// The lease the leader key is on.
        lease: i64,
    },
    /// The store was closed, or cannot serve at all (not initialised, keyed otherwise).
    Stopped(String),
}

/// Where a new leader's batches start, as its takeover read the fence.
#[derive(Debug, Clone, Default)]
pub(crate) struct Start {
    /// The batch id in `P/batch`: the first batch's guard.
    pub(crate) batch: Vec<u8>,
    /// The levels found, which the census counts on from.
    pub(crate) census: u64,
    /// The writes in flight found.
    pub(crate) flights: Flights,
}

/// Shared by the leadership task, the batch writer and every request.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Nanoseconds on `clock` until which the lease is trusted; 0: no lease.
    until: AtomicU64,
    clock: LeaseClock,
    term: AtomicU64,
    standing: Mutex<Standing>,
    /// Wakes the leadership task: the lease lapsed, or a batch found the guard gone.
    pub(crate) wake: Notify,
    margin: Duration,
    /// Why etcd refused the last batch room (its space quota, `NOSPACE`), until one commits.
    full: Mutex<Option<String>>,
    /// Where the new leader's chain starts, as the takeover read it.
    start: Mutex<Start>,
    /// The fence's key for writes sent on between instances (`P/secret`), once read.
    secret: Mutex<Option<Arc<[u8]>>>,
}

impl Shared {
    pub(crate) fn new(margin: Duration) -> Shared {
        Shared::on_clock(margin, LeaseClock::Boot)
    }

    /// [`Shared::new`], counting the lease on `clock`.
    pub(crate) fn on_clock(margin: Duration, clock: LeaseClock) -> Shared {
        Shared {
            until: AtomicU64::new(0),
            clock,
            term: AtomicU64::new(1),
            standing: Mutex::new(Standing::Seeking("starting".into())),
            wake: Notify::new(),
            margin,
            full: Mutex::new(None),
            start: Mutex::new(Start::default()),
            secret: Mutex::new(None),
        }
    }

    /// The fence's key for writes sent on between instances, once read from etcd.
    pub(crate) fn secret(&self) -> Option<Arc<[u8]>> {
        self.secret.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn set_secret(&self, secret: Arc<[u8]>) {
        *self.secret.lock().unwrap_or_else(PoisonError::into_inner) = Some(secret);
    }

    /// Nanoseconds now on the lease's clock: when a grant or keep-alive is sent.
    pub(crate) fn now(&self) -> u64 {
        self.clock.now()
    }

    /// etcd acknowledged a grant or keep-alive sent at `sent` ([`Shared::now`]) with `ttl` left.
    pub(crate) fn acknowledged(&self, sent: u64, ttl: Duration) {
        let until = sent.saturating_add(nanos(ttl.saturating_sub(self.margin)));
        self.until.fetch_max(until, Ordering::AcqRel);
    }

    /// Forgets the lease: it expired, or was lost. Never renewed after this.
    pub(crate) fn lapse(&self) {
        self.until.store(0, Ordering::Release);
    }

    /// Whether the lease is still trusted now.
    pub(crate) fn lease_valid(&self) -> bool {
        self.now() < self.until.load(Ordering::Acquire)
    }

    /// How long the lease is still trusted.
    pub(crate) fn lease_left(&self) -> Duration {
        Duration::from_nanos(self.until.load(Ordering::Acquire).saturating_sub(self.now()))
    }

    pub(crate) fn term(&self) -> u64 {
        self.term.load(Ordering::Acquire)
    }

    pub(crate) fn standing(&self) -> Standing {
        self.standing.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes the standing; every change starts a new term. So does the end of a takeover:
    /// a write checked while the takeover was still loading the table must not be advanced
    /// once it is done.
    pub(crate) fn set(&self, standing: Standing) {
        let mut current = self.standing.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*current, Standing::Stopped(_)) || *current == standing {
            return;
        }
        self.term.fetch_add(1, Ordering::AcqRel);
        *current = standing;
    }

    /// etcd refused a batch room (`Some(why)`), or committed one (`None`).
    pub(crate) fn set_full(&self, why: Option<String>) {
        *self.full.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }

    /// Why etcd refused the last batch room, if it did.
    pub(crate) fn full(&self) -> Option<String> {
        self.full.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What a takeover read, where the next batches start from.
    pub(crate) fn set_start(&self, start: Start) {
        *self.start.lock().unwrap_or_else(|e| e.into_inner()) = start;
    }

    pub(crate) fn start(&self) -> Start {
        self.start.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Steps down from leading in `epoch`, if this instance still does (a newer leadership is
    /// left alone): the lease is lapsed, and the leadership task woken to take a new one.
    /// Returns whether it stepped down.
    pub(crate) fn step_down(&self, epoch: i64, why: &str) -> bool {
        let mut current = self.standing.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(*current, Standing::Leading { epoch: e, .. } if e == epoch) {
            return false;
        }
        self.term.fetch_add(1, Ordering::AcqRel);
        *current = Standing::Seeking(why.to_owned());
        self.until.store(0, Ordering::Release);
        drop(current);
        self.wake.notify_one();
        true
    }

    /// Stops for good (close, or a state that cannot serve): a new term starts and the lease
    /// lapses, so nothing more is sent, and the keep-alive and the election end.
    pub(crate) fn stop(&self, why: &str) {
        let mut current = self.standing.lock().unwrap_or_else(|e| e.into_inner());
        self.term.fetch_add(1, Ordering::AcqRel);
        *current = Standing::Stopped(why.to_owned());
        self.until.store(0, Ordering::Release);
        drop(current);
        self.wake.notify_one();
    }

    /// Whether the store stopped for good.
    pub(crate) fn stopped(&self) -> bool {
        matches!(*self.standing.lock().unwrap_or_else(|e| e.into_inner()), Standing::Stopped(_))
    }

    /// The epoch and lease to guard a batch of `term` with, if this instance leads in it with
    /// a trusted lease.
    pub(crate) fn leading_in(&self, term: u64) -> Option<(i64, i64)> {
        let current = self.standing.lock().unwrap_or_else(|e| e.into_inner());
        match *current {
            Standing::Leading { epoch, lease } if self.term() == term && self.lease_valid() => Some((epoch, lease)),
            _ => None,
        }
    }

    /// Whether a write of `term` may still be sent: this instance leads in it and trusts its
    /// lease. Checked after the backend connection is taken and before each body chunk.
    pub(crate) fn may_send(&self, term: u64) -> bool {
        self.term() == term && self.lease_valid()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_counts_from_the_send_and_a_change_of_leadership_starts_a_term() {
        let shared = Shared::new(Duration::from_millis(500));
        assert!(!shared.lease_valid(), "no lease yet");
        let sent = boottime();
        shared.acknowledged(sent, Duration::from_secs(5));
        assert!(shared.lease_valid());
        let left = shared.lease_left();
        assert!(left <= Duration::from_millis(4500) && left > Duration::from_secs(4), "{left:?}");
        // An older acknowledgement arriving late never shortens it.
        shared.acknowledged(sent - 1_000_000_000, Duration::from_secs(5));
        assert!(shared.lease_left() > Duration::from_secs(4));
        // Counting from a send long ago: already lapsed.
        let stale = Shared::new(Duration::ZERO);
        stale.acknowledged(boottime().saturating_sub(10_000_000_000), Duration::from_secs(5));
        assert!(!stale.lease_valid());

        let t0 = shared.term();
        shared.set(Standing::Following("http://127.0.0.1:1".into()));
        shared.set(Standing::Following("http://127.0.0.1:1".into()));
        assert_eq!(shared.term(), t0 + 1, "the same standing again is no change");
        shared.set(Standing::TakingOver);
        let taking_over = shared.term();
        shared.set(Standing::Leading { epoch: 7, lease: 9 });
        let t1 = shared.term();
        assert!(t1 > taking_over, "a write checked against a table still loading is of an earlier term");
        assert_eq!(shared.leading_in(taking_over), None);
        assert_eq!(shared.leading_in(t1), Some((7, 9)));
        assert!(shared.may_send(t1));
        assert_eq!(shared.leading_in(t0), None, "a write checked in an earlier term");
        shared.lapse();
        assert_eq!(shared.leading_in(t1), None, "no trusted lease");
        assert!(!shared.may_send(t1));
        shared.set(Standing::Seeking("lost".into()));
        assert!(shared.term() > t1);

        // A writer that settles a batch of an old leadership leaves a newer one alone.
        shared.acknowledged(boottime(), Duration::from_secs(5));
        shared.set(Standing::Leading { epoch: 12, lease: 9 });
        let t2 = shared.term();
        assert!(!shared.step_down(7, "an old epoch's batch"), "epoch 7 is not the one leading");
        assert_eq!((shared.term(), shared.lease_valid()), (t2, true));
        assert!(shared.step_down(12, "its own"));
        assert!(!shared.lease_valid() && shared.term() > t2);
        shared.acknowledged(boottime(), Duration::from_secs(5));
        shared.stop("closed");
        assert!(!shared.lease_valid(), "a stopped store sends nothing more");
        shared.set(Standing::TakingOver);
        assert!(shared.stopped(), "stopped for good");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_is_trusted_from_its_send_until_ttl_less_the_margin() {
        let shared = Shared::on_clock(Duration::from_secs(2), LeaseClock::Tokio(tokio::time::Instant::now()));
        let sent = shared.now();
        // etcd takes a second to answer: the lease counts from the send all the same.
        tokio::time::advance(Duration::from_secs(1)).await;
        shared.acknowledged(sent, Duration::from_secs(10));
        assert_eq!(shared.lease_left(), Duration::from_secs(7));
        tokio::time::advance(Duration::from_millis(6_999)).await;
        assert!(shared.lease_valid(), "trusted until send + ttl - margin");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!shared.lease_valid(), "and not from then on");
        assert_eq!(shared.lease_left(), Duration::ZERO);
        // A keep-alive that etcd answers more than ttl - margin after its send gives nothing.
        // (Once lapsed, no answer is taken at all: the keep-alive task drops it.)
        let slow = shared.now();
        tokio::time::advance(Duration::from_secs(8)).await;
        shared.acknowledged(slow, Duration::from_secs(10));
        assert!(!shared.lease_valid(), "lapsed on arrival");
    }
}
