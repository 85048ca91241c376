//! A turn's sequence against a real store: check, prepare, advance, write, answer or
//! quarantine, release.

use std::pin::pin;
use std::task::{Context, Waker};

use super::*;
use crate::fence::EqualToken;
use crate::store::{FileStore, MarkRef, Store, StoreOptions, SyncMode};

const STRICT: EqualToken = EqualToken::Reject;

fn key(k: &str) -> Vec<Touch> {
    vec![Touch { key: k.into(), coverage: Coverage::Key }]
}

/// A fence whose store is a real one, in a directory removed when the test drops it.
pub(in crate::fence) fn fence() -> (Arc<Fence>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), StoreOptions { sync: SyncMode::Never, ..StoreOptions::default() });
    let store = store.unwrap();
    store.table().raise(MarkRef::key("/a"), 34);
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
    t.max_seen.raise(MarkRef::key("/a"), 40); // what the store does once the advance is durable
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

#[tokio::test(start_paused = true)]
async fn quarantine_closes_the_resource_until_it_expires() {
    let (t, _dir) = fence();
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    turn.quarantine(Duration::from_millis(50));
    drop(turn);
    assert_eq!(t.active_gates(), 1, "a quarantined gate is kept");
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let Err(FenceError::Quarantined { retry_after, .. }) = turn.check(99, STRICT) else { panic!("quarantined") };
    assert_eq!(retry_after, Duration::from_millis(50), "the whole quarantine is left");
    drop(turn);
    // On tokio's clock, paused: one instant before the end it is still closed, at the end open.
    tokio::time::advance(Duration::from_millis(49)).await;
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let Err(FenceError::Quarantined { retry_after, .. }) = turn.check(99, STRICT) else { panic!("still quarantined") };
    assert_eq!(retry_after, Duration::from_millis(1));
    drop(turn);
    tokio::time::advance(Duration::from_millis(1)).await;
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
        if t.max_seen.entry(MarkRef::key("/a")) == Some((35, false)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(t.max_seen.entry(MarkRef::key("/a")), Some((35, false)), "answered, no longer in flight");

    let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let refused = turn.finish(35, STRICT, Duration::from_secs(9), async { Ok(0) }, outcome).await;
    assert!(matches!(refused, Err(Failed::Fence(FenceError::Stale { max_seen: 35, .. }))));
}

#[tokio::test]
async fn a_write_whose_preparation_fails_advances_nothing_and_may_be_sent_again_with_its_token() {
    let (t, _dir) = fence();
    let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let never = |_: Option<Permit>| async { Err::<std::future::Ready<Result<u64, Failed>>, _>(Failed::Backend) };
    let failed = turn.finish_after(35, STRICT, Duration::from_secs(60), never, outcome).await;
    assert_eq!(failed, Err(Failed::Backend));
    assert_eq!(t.max_seen.entry(MarkRef::key("/a")), Some((34, false)), "nothing advanced, nothing in flight");
    assert_eq!(t.active_gates(), 0, "released, and not quarantined");
    let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let prepared = |_: Option<Permit>| async { Ok(async { Ok(35) }) };
    assert_eq!(turn.finish_after(35, STRICT, Duration::from_secs(60), prepared, outcome).await, Ok(35));
    assert_eq!(t.max_seen("/a"), Some(35));
}

#[tokio::test]
async fn a_stale_write_is_refused_before_it_is_prepared() {
    let (t, _dir) = fence();
    let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let prepared = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = Arc::clone(&prepared);
    let prepare = move |_: Option<Permit>| async move {
        seen.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(async { Ok(0) })
    };
    let refused = turn.finish_after(34, STRICT, Duration::from_secs(9), prepare, outcome).await;
    assert!(matches!(refused, Err(Failed::Fence(FenceError::Stale { max_seen: 34, .. }))));
    assert!(!prepared.load(std::sync::atomic::Ordering::SeqCst), "no backend connection for a stale write");
}

#[tokio::test]
async fn a_write_with_an_unknown_outcome_stays_in_flight_and_quarantines_the_resource() {
    let (t, _dir) = fence();
    let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let lost = turn.finish(36, STRICT, Duration::from_secs(60), async { Err(Failed::Backend) }, outcome).await;
    assert_eq!(lost, Err(Failed::Backend));
    assert_eq!(t.max_seen.entry(MarkRef::key("/a")), Some((36, true)), "a restart would quarantine it again");
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
    t.max_seen.advance(MarkRef::key("/flying"), 7); // a write the backend never answered
    let fence = &t;
    let raise = |to| async move {
        fence.acquire(key("/flying"), Duration::from_secs(1)).await.unwrap().raise::<Failed>(to).await
    };
    let lower = raise(6).await;
    assert!(matches!(lower, Err(Failed::Fence(FenceError::WouldLower { max_seen: 7, to: 6, .. }))));
    assert_eq!(raise(7).await, Ok(Raised { previous: Some(7) }), "the same value changes nothing");
    assert_eq!(raise(9).await, Ok(Raised { previous: Some(7) }));
    assert_eq!(t.max_seen.entry(MarkRef::key("/flying")), Some((9, true)), "still in flight: a restart quarantines it");
    assert_eq!(raise(10).await, Ok(Raised { previous: Some(9) }));
    assert_eq!(t.max_seen.entry(MarkRef::key("/a")), Some((34, false)));
    t.max_seen.answered(MarkRef::key("/flying"), 10);
    assert_eq!(t.max_seen.entry(MarkRef::key("/flying")), Some((10, false)));
}

#[tokio::test]
async fn a_pinned_writes_unknown_outcome_lets_pinned_puts_pass_and_holds_the_rest() {
    let (t, _dir) = fence();
    let pinned = Policy { equal: STRICT, max_jump: None, pinned: true };
    // A pinned write, sent pinned, whose answer never comes.
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let slot = turn.pin_slot().expect("one key");
    slot.set(Pin::Tag("\"t1\"".into()));
    let lost = move |_: Option<Permit>| async move {
        assert_eq!(slot.get(), Some(Pin::Tag("\"t1\"".into())), "read before the advance");
        slot.sent_pinned(&Pin::Tag("\"t1\"".into()));
        Ok(async { Err::<u64, _>(Failed::Backend) })
    };
    assert_eq!(turn.finish_after(35, pinned, Duration::from_secs(60), lost, outcome).await, Err(Failed::Backend));
    assert_eq!(t.pins.get("/a"), None, "the advance forgot the pin, and no answer set it");
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let Err(FenceError::Quarantined { cause, .. }) = turn.check(36, STRICT) else { panic!("an unpinned write waits") };
    assert_eq!(cause, QuarantineCause::UnknownPinnedOutcome);
    assert!(turn.check(36, pinned).is_ok(), "a pinned PUT passes");
    drop(turn);
    // It passes, and is answered; the write before it is still unknown, so the log keeps the key
    // in flight, and a restart quarantines it.
    let turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    assert_eq!(turn.finish(36, pinned, Duration::from_secs(60), async { Ok(36) }, outcome).await, Ok(36));
    // A later batch is taken in after any answer committed before it.
    let turn = t.acquire(key("/z"), Duration::from_secs(1)).await.unwrap();
    assert_eq!(turn.finish(1, STRICT, Duration::from_secs(60), async { Ok(1) }, outcome).await, Ok(1));
    assert_eq!(t.max_seen.entry(MarkRef::key("/a")), Some((36, true)), "still in flight");

    // The same, not sent pinned: everything waits.
    let mut turn = t.acquire(key("/b"), Duration::from_secs(1)).await.unwrap();
    let _slot = turn.pin_slot();
    let lost = |_: Option<Permit>| async { Ok(async { Err::<u64, _>(Failed::Backend) }) };
    assert_eq!(turn.finish_after(35, pinned, Duration::from_secs(60), lost, outcome).await, Err(Failed::Backend));
    let mut turn = t.acquire(key("/b"), Duration::from_secs(1)).await.unwrap();
    let Err(FenceError::Quarantined { cause, .. }) = turn.check(36, pinned) else { panic!("a pinned PUT waits too") };
    assert_eq!(cause, QuarantineCause::UnknownOutcome);
}

#[tokio::test]
async fn a_pin_the_answer_set_outlives_the_turn_and_one_learnt_before_a_refusal_stays() {
    let (t, _dir) = fence();
    let pinned = Policy { equal: STRICT, max_jump: None, pinned: true };
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let slot = turn.pin_slot().unwrap();
    slot.set(Pin::Tag("\"t1\"".into()));
    let answered = move |_: Option<Permit>| async move {
        slot.sent_pinned(&Pin::Tag("\"t1\"".into()));
        Ok(async move {
            slot.set(Pin::Tag("\"t2\"".into()));
            Ok::<u64, Failed>(35)
        })
    };
    assert_eq!(turn.finish_after(35, pinned, Duration::from_secs(60), answered, outcome).await, Ok(35));
    assert_eq!(t.pins.get("/a"), Some(Pin::Tag("\"t2\"".into())), "set from the answer, after the advance");
    // Learnt, then refused before the advance: the backend's state did not move.
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let slot = turn.pin_slot().unwrap();
    let refused = move |_: Option<Permit>| async move {
        slot.set(Pin::Tag("\"t3\"".into()));
        Err::<std::future::Ready<Result<u64, Failed>>, _>(Failed::Backend)
    };
    assert_eq!(turn.finish_after(36, pinned, Duration::from_secs(60), refused, outcome).await, Err(Failed::Backend));
    assert_eq!(t.pins.get("/a"), Some(Pin::Tag("\"t3\"".into())));
}

#[tokio::test]
async fn a_write_forgets_the_pins_of_what_it_may_change() {
    let (t, _dir) = fence();
    for k in ["/d/x", "/d/y", "/e"] {
        t.pins.set(k, Pin::Absent);
    }
    let subtree = vec![Touch { key: "/d/".into(), coverage: Coverage::Subtree }];
    let mut turn = t.acquire(subtree, Duration::from_secs(1)).await.unwrap();
    assert!(turn.pin_slot().is_none(), "a subtree write is never pinned");
    assert_eq!(turn.finish(50, STRICT, Duration::from_secs(9), async { Ok(0) }, outcome).await, Ok(0));
    assert_eq!((t.pins.get("/d/x"), t.pins.get("/d/y"), t.pins.get("/e")), (None, None, Some(Pin::Absent)));
}

#[tokio::test(start_paused = true)]
async fn a_pinned_write_that_passed_a_quarantine_never_shortens_it() {
    let (t, _dir) = fence();
    let pinned = Policy { equal: STRICT, max_jump: None, pinned: true };
    // A pinned write pinned to "absent", lost: its create may land late for a minute.
    let lost = |slot: PinSlot| {
        move |_: Option<Permit>| async move {
            slot.sent_pinned(&Pin::Absent);
            Ok(async { Err::<u64, _>(Failed::Backend) })
        }
    };
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let slot = turn.pin_slot().unwrap();
    let failed = turn.finish_after(35, pinned, Duration::from_secs(60), lost(slot), outcome).await;
    assert_eq!(failed, Err(Failed::Backend));
    // A reload shortens fence.quarantine; a pinned PUT passes the quarantine and is lost too.
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let slot = turn.pin_slot().unwrap();
    let failed = turn.finish_after(36, pinned, Duration::from_secs(1), lost(slot), outcome).await;
    assert_eq!(failed, Err(Failed::Backend));
    tokio::time::advance(Duration::from_secs(2)).await;
    // The first write may still land: a DELETE must wait for the rest of its minute.
    let mut turn = t.acquire(key("/a"), Duration::from_secs(1)).await.unwrap();
    let Err(FenceError::Quarantined { retry_after, cause, .. }) = turn.check(37, STRICT) else {
        panic!("the first write's quarantine still runs")
    };
    assert_eq!((retry_after, cause), (Duration::from_secs(58), QuarantineCause::UnknownPinnedOutcome));
}
