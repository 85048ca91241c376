//! The store's behaviour under load, at its limits, and when its runtime or its owner goes
//! away: group commit, answered writes, the bound on resources, closing and dropping.

use std::fs;
use std::sync::Arc;
use std::time::Duration;

use super::tests::{as_a_crash_would_leave, contents, open, open_when_free, options, write};
use super::*;

#[tokio::test]
async fn concurrent_advances_share_syncs_and_are_all_durable() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(dir.path()));
    let tasks: Vec<_> = (0..64u64)
        .map(|i| {
            let s = Arc::clone(&store);
            tokio::spawn(async move { s.advance(&format!("/r{}", i % 8), i).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(store.table().get("/r7"), Some(63), "the table is raised before advance returns");
    store.close().await.unwrap();
    assert!(matches!(store.advance("/x", 1).await, Err(StoreError::Closed)));
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
    assert!(matches!(store.advance("/c", 1).await, Err(StoreError::Full(2))));
    store.advance("/a", 2).await.unwrap();
    assert!(store.healthy(), "a full table is not a failed store");
    assert_eq!(store.table().get("/c"), None);
}

#[tokio::test]
async fn keys_a_record_cannot_hold_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let long = "/".repeat(format::MAX_KEY_LEN + 1);
    assert!(matches!(store.advance(&long, 1).await, Err(StoreError::KeyTooLong(_))));
}

#[tokio::test]
async fn writes_in_flight_at_a_crash_are_reported_and_answered_ones_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    write(&store, &[("/answered", 1), ("/pending", 2), ("/old", 3)]).await;
    store.answered("/answered", 1);
    store.answered("/old", 2); // an answer for an earlier token does not clear a later write
    store.close().await.unwrap();
    drop(store);
    let store = open(dir.path());
    let mut flying = store.in_flight_at_start().to_vec();
    flying.sort();
    assert_eq!(flying, [("/old".to_string(), 3), ("/pending".to_string(), 2)]);
}

#[tokio::test]
async fn an_answer_reaches_the_log_soon_even_when_no_advance_follows() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    write(&store, &[("/a", 1), ("/b", 2)]).await;
    store.answered("/a", 1);
    // Read the log as it is, while the store still runs, until the answer is there.
    let logged = async {
        loop {
            let (_, found) = as_a_crash_would_leave(dir.path());
            if found.in_flight == [("/b".to_string(), 2)] {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), logged).await.expect("the answer to /a was logged on its own");
    drop(store);
}

#[tokio::test]
async fn an_earlier_answer_does_not_clear_a_later_write_with_the_same_token() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.advance("/a", 6).await.unwrap(); // write A
    store.answered("/a", 6); // A answered; its turn is released after this
    store.advance("/a", 6).await.unwrap(); // write B, an equal token accepted, now at the backend
    assert_eq!(store.table().entry("/a"), Some((6, true)), "B is in flight in memory");
    // Closing writes every answer still pending: one logged after B would clear it.
    store.close().await.unwrap();
    drop(store);
    let (_, found) = as_a_crash_would_leave(dir.path());
    assert_eq!(found.in_flight, [("/a".to_string(), 6)], "and in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_multi_thread_runtime_the_writer_commits_rotates_and_closes() {
    let dir = tempfile::tempdir().unwrap();
    // Small segments: rotation and compaction run inside block_in_place too.
    let store = Arc::new(FileStore::open(dir.path(), options(4096)).unwrap());
    let tasks: Vec<_> = (0..32u64)
        .map(|w| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for t in 1..=20u64 {
                    let key = format!("/k{w}");
                    store.advance(&key, t).await.unwrap();
                    assert_eq!(store.table().get(&key), Some(t), "raised before the answer");
                    if t < 20 {
                        store.answered(&key, t);
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    store.close().await.unwrap();
    assert!(store.advance("/k0", 99).await.is_err(), "closed stays closed");
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
fn a_store_whose_runtime_shut_down_fails_closed_and_keeps_its_answers() {
    let dir = tempfile::tempdir().unwrap();
    let opener = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let user = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = opener.block_on(async { FileStore::open(dir.path(), options(64 << 20)).unwrap() });
    user.block_on(store.advance("/a", 1)).unwrap();
    user.block_on(store.advance("/b", 1)).unwrap();
    store.answered("/a", 1);
    drop(opener);
    let after = user.block_on(async { tokio::time::timeout(Duration::from_secs(5), store.advance("/a", 2)).await });
    assert!(matches!(after, Ok(Err(StoreError::Closed))), "fails closed, does not hang: {after:?}");
    drop(store);
    // The compaction thread, which shares the directory's lock, ends on its own once the writer is gone.
    let store = open_when_free(dir.path());
    assert_eq!(store.table().get("/a"), Some(1));
    assert_eq!(store.in_flight_at_start(), [("/b".to_string(), 1)], "the answer to /a was logged on the way out");
}

#[tokio::test]
async fn a_store_dropped_without_close_keeps_its_directory_until_its_last_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let keys: Vec<String> = (0..8).map(|i| format!("/old/{i:02}")).collect();
    for k in &keys {
        store.advance(k, 1).await.unwrap();
    }
    for k in &keys {
        store.answered(k, 1); // answers the writer logs when it notices the drop
    }
    drop(store);
    // The old writer has not run yet (one thread, no await since the drop): the lock is its.
    assert!(matches!(FileStore::open(dir.path(), options(64 << 20)), Err(StoreError::Locked { .. })));
    let reopen = async {
        loop {
            tokio::time::sleep(Duration::from_millis(1)).await;
            match FileStore::open(dir.path(), options(64 << 20)) {
                Err(StoreError::Locked { .. }) => continue,
                other => break other.unwrap(),
            }
        }
    };
    let again = tokio::time::timeout(Duration::from_secs(10), reopen).await.expect("the old writer let go");
    assert!(again.in_flight_at_start().is_empty(), "the old writer logged every answer");
    again.advance("/new", 7).await.unwrap();
    again.close().await.unwrap();
    drop(again);
    let (table, found) = as_a_crash_would_leave(dir.path());
    assert_eq!(table.get("/new"), Some(7), "an acknowledged advance survives");
    assert_eq!(found.torn, None, "a clean close leaves no torn tail");
}
