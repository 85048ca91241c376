//! The store's behaviour under load, at its limits, and when the runtime that opened it or its
//! owner goes away: group commit, answered writes, the bound on resources, closing and dropping.

use std::fs;
use std::sync::Arc;
use std::time::Duration;

use super::tests::{advance, answered, as_a_crash_would_leave, contents, open, open_when_free, options, write};
use super::*;

#[tokio::test]
async fn concurrent_advances_share_syncs_and_are_all_durable() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(dir.path()));
    let tasks: Vec<_> = (0..64u64)
        .map(|i| {
            let s = Arc::clone(&store);
            tokio::spawn(async move { advance(&*s, &format!("/r{}", i % 8), i).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(store.table().get("/r7"), Some(63), "the table is raised before advance returns");
    store.close().await.unwrap();
    assert!(matches!(advance(&*store, "/x", 1).await, Err(StoreError::Closed)));
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.table().len(), 8);
    assert_eq!(store.table().get("/r7"), Some(63));
}

#[tokio::test]
async fn past_max_resources_new_keys_are_refused_and_known_ones_still_advance() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), StoreOptions { max_resources: 2, ..options(4096) }).unwrap();
    write(&store, &[("/a", 1), ("/b", 1)]).await;
    assert!(matches!(advance(&store, "/c", 1).await, Err(StoreError::Full(2))));
    advance(&store, "/a", 2).await.unwrap();
    assert!(store.condition().healthy(), "a full table is not a failed store");
    assert_eq!(store.table().get("/c"), None);
}

#[tokio::test]
async fn past_max_table_bytes_new_marks_are_refused_and_known_ones_still_advance() {
    let dir = tempfile::tempdir().unwrap();
    let long = |i: u32| format!("/{i}{}", "k".repeat(8 << 10));
    // Exactly room for two long keys and a short one, filled one batch at a time: what a
    // committed batch counted for must not count again in the next.
    let max_table_bytes = 2 * table::mark_bytes(&long(1)) + table::mark_bytes("/s");
    let store = FileStore::open(dir.path(), StoreOptions { max_table_bytes, ..options(4096) }).unwrap();
    write(&store, &[(&long(1), 1), (&long(2), 1), ("/s", 1)]).await;
    assert_eq!(store.table().bytes(), TableBytes { keys: max_table_bytes, floors: 0, held: 0 });
    let full = StoreError::FullBytes(max_table_bytes);
    assert!(matches!(advance(&store, &long(3), 1).await, Err(e) if e.to_string() == full.to_string()));
    assert!(matches!(advance(&store, "/t", 1).await, Err(StoreError::FullBytes(_))), "however short");
    let with_a_floor = vec![Mark::key(long(1)), Mark::floor("/f")];
    assert!(
        matches!(store.commit(0, MarkBatch::advance(with_a_floor, 2)).await, Err(StoreError::FullBytes(_))),
        "refused whole"
    );
    assert_eq!((store.table().get(&long(1)), store.table().level(MarkRef::floor("/f"))), (Some(1), None));
    advance(&store, &long(1), 2).await.expect("a known key advances past the limit");
    store.commit(0, MarkBatch::advance(vec![Mark::key(long(2)), Mark::key("/s")], 3)).await.unwrap();
    assert!(store.condition().healthy(), "a full table is not a failed store");
    assert_eq!(store.table().bytes().total(), max_table_bytes);
    assert!(full.to_string().contains("store.max_table_bytes"), "{full}");
}

#[tokio::test]
async fn new_marks_in_one_batch_count_together_against_max_table_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let max_table_bytes = table::mark_bytes("/a");
    let store = FileStore::open(dir.path(), StoreOptions { max_table_bytes, ..options(4096) }).unwrap();
    // Both are sent before either is committed: each fits alone, not both.
    let (a, b) = (advance(&store, "/a", 1), advance(&store, "/b", 1));
    let (a, b) = tokio::join!(a, b);
    assert!(matches!((&a, &b), (Ok(()), Err(StoreError::FullBytes(_))) | (Err(StoreError::FullBytes(_)), Ok(()))));
    assert_eq!(store.table().bytes().keys, max_table_bytes);
}

#[tokio::test]
async fn keys_a_record_cannot_hold_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let long = "/".repeat(format::MAX_KEY_LEN + 1);
    assert!(matches!(advance(&store, &long, 1).await, Err(StoreError::KeyTooLong(_))));
}

#[tokio::test]
async fn writes_in_flight_at_a_crash_are_reported_and_answered_ones_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    write(&store, &[("/answered", 1), ("/pending", 2), ("/old", 3)]).await;
    answered(&store, "/answered", 1);
    answered(&store, "/old", 2); // an answer for an earlier token does not clear a later write
    store.close().await.unwrap();
    drop(store);
    let store = open(dir.path());
    let mut flying = store.in_flight_at_start().to_vec();
    flying.sort();
    assert_eq!(flying, [("/old".to_string(), 3), ("/pending".to_string(), 2)]);
}

/// Polls `done` every 5 ms until it holds; fails, saying `what`, after 10 s.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let polled = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), polled).await.unwrap_or_else(|_| panic!("{what}"));
}

/// Whether the log, read as a crash would leave it while the store runs, has the write of `key`
/// at `token` alone in flight.
fn only_in_flight(dir: &std::path::Path, (key, token): (&str, u64)) -> bool {
    as_a_crash_would_leave(dir).1.in_flight == [(key.to_string(), token)]
}

#[tokio::test]
async fn an_answer_soon_after_its_advance_wakes_nobody_and_is_logged() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let began = std::time::Instant::now();
    write(&store, &[("/a", 1), ("/b", 2)]).await;
    answered(&store, "/a", 1);
    // The batch was committed after `began`, so before ANSWER_FLUSH from it the writer still
    // expected answers; a test thread held up longer than that cannot tell.
    let expected = began.elapsed() < super::writer::ANSWER_FLUSH * 3 / 4;
    until("the answer to /a was logged on its own", || only_in_flight(dir.path(), ("/b", 2))).await;
    if expected {
        assert_eq!(store.reminders_sent(), 0, "an answer the writer expected reminded it");
    }
    drop(store);
}

#[tokio::test]
async fn an_answer_reminds_a_writer_that_stopped_expecting_one() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    write(&store, &[("/a", 1), ("/b", 2)]).await;
    // ANSWER_FLUSH after its last batch the writer sleeps until an answer tells it.
    until("the writer stopped expecting answers", || store.writer_awaits_reminder()).await;
    answered(&store, "/a", 1);
    assert_eq!(store.reminders_sent(), 1);
    until("the answer to /a reminded the writer", || only_in_flight(dir.path(), ("/b", 2))).await;
    drop(store);
}

#[tokio::test]
async fn after_an_operators_reset_the_writer_expects_no_answer() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::reset(vec![Mark::key("/a")], 5)).await.unwrap();
    until("the writer sleeps until reminded", || store.writer_awaits_reminder()).await;
    assert_eq!(store.empty_commits(), 0, "the writer waited for an answer a reset never gets");
    // An answer then reminds it, and is logged.
    write(&store, &[("/b", 6)]).await;
    until("the writer stopped expecting answers", || store.writer_awaits_reminder()).await;
    answered(&store, "/b", 6);
    assert_eq!(store.reminders_sent(), 1);
    until("the answer to /b was logged", || as_a_crash_would_leave(dir.path()).1.in_flight.is_empty()).await;
    drop(store);
}

#[tokio::test]
async fn an_earlier_answer_does_not_clear_a_later_write_with_the_same_token() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    advance(&store, "/a", 6).await.unwrap(); // write A
    answered(&store, "/a", 6); // A answered; its turn is released after this
    advance(&store, "/a", 6).await.unwrap(); // write B, an equal token accepted, now at the backend
    assert_eq!(store.table().entry(MarkRef::key("/a")), Some((6, true)), "B is in flight in memory");
    // Closing writes every answer still pending: one logged after B would clear it.
    store.close().await.unwrap();
    drop(store);
    let (_, found) = as_a_crash_would_leave(dir.path());
    assert_eq!(found.in_flight, [("/a".to_string(), 6)], "and in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_multi_thread_runtime_the_writer_commits_rotates_and_closes() {
    let dir = tempfile::tempdir().unwrap();
    // Small segments: rotations and compactions run while the writers wait on both workers.
    let store = Arc::new(FileStore::open(dir.path(), options(4096)).unwrap());
    let tasks: Vec<_> = (0..32u64)
        .map(|w| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for t in 1..=20u64 {
                    let key = format!("/k{w}");
                    advance(&*store, &key, t).await.unwrap();
                    assert_eq!(store.table().get(&key), Some(t), "raised before the answer");
                    if t < 20 {
                        answered(&*store, &key, t);
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    store.close().await.unwrap();
    assert!(advance(&*store, "/k0", 99).await.is_err(), "closed stays closed");
    drop(store);
    let snapshots =
        fs::read_dir(dir.path()).unwrap().filter(|e| e.as_ref().unwrap().path().extension() == Some("snap".as_ref()));
    assert!(snapshots.count() > 0, "segments rotated and were compacted");
    let store = open(dir.path());
    let all = contents(&store);
    assert_eq!(all.len(), 32);
    assert!(all.values().all(|&t| t == 20));
    assert_eq!(store.in_flight_at_start().len(), 32, "each key's last write was never answered");
}

#[test]
fn the_writer_outlives_the_runtime_that_opened_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let opener = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let user = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = opener.block_on(async { FileStore::open(dir.path(), options(64 << 20)).unwrap() });
    user.block_on(advance(&store, "/a", 1)).unwrap();
    drop(opener);
    user.block_on(advance(&store, "/a", 2)).unwrap();
    assert_eq!(store.table().get("/a"), Some(2));
}

#[test]
fn a_store_dropped_without_close_keeps_its_answers_and_frees_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let user = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = FileStore::open(dir.path(), options(64 << 20)).unwrap();
    user.block_on(advance(&store, "/a", 1)).unwrap();
    user.block_on(advance(&store, "/b", 1)).unwrap();
    answered(&store, "/a", 1);
    drop(store);
    // The writer, and the compaction thread that shares the directory's lock, end on their own.
    let store = open_when_free(dir.path());
    assert_eq!(store.table().get("/a"), Some(1));
    assert_eq!(store.in_flight_at_start(), [("/b".to_string(), 1)], "the answer to /a was logged on the way out");
}
