//! Resets: an operator lowering marks, recorded so that a restart, a snapshot, and the later
//! advances all keep the lowered value in the right order.

use std::collections::HashMap;

use super::tests::{advance, answered, contents, map, note, open, options};
use super::*;

fn key(name: &str) -> Mark {
    Mark::key(name)
}

fn floor(name: &str) -> Mark {
    Mark::floor(name)
}

fn floors(table: &Table) -> HashMap<String, u64> {
    let mut all = HashMap::new();
    table.for_each(MarkKind::Floor, |p, t, _| {
        all.insert(p.to_owned(), t);
    });
    all
}

#[tokio::test]
async fn a_reset_lowers_marks_and_a_restart_does_not_take_the_highest_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    advance(&store, "/a", u64::MAX).await.unwrap();
    answered(&store, "/a", u64::MAX);
    store.commit(0, MarkBatch::advance(vec![floor("/d"), key("/b")], 1 << 60)).await.unwrap();
    note(&store, MarkBatch::answered([floor("/d"), key("/b")], 1 << 60));
    store.commit(0, MarkBatch::reset(vec![key("/a"), floor("/d")], 40)).await.unwrap();
    let table = store.table();
    assert_eq!(
        (table.get("/a"), table.level(MarkRef::floor("/d")), table.get("/b")),
        (Some(40), Some(40), Some(1 << 60))
    );
    assert_eq!(table.entry(MarkRef::key("/a")), Some((40, false)), "an answered write stays answered");
    store.close().await.unwrap();
    drop(store);

    let store = open(dir.path());
    assert_eq!(contents(&store), map(&[("/a", 40), ("/b", 1 << 60)]), "the reset counts after the advance it follows");
    assert_eq!(floors(store.table()), map(&[("/d", 40)]));
    assert!(store.in_flight_at_start().is_empty());
    // Advances after a reset raise the mark again, and a restart keeps the later value.
    advance(&store, "/a", 41).await.unwrap();
    store.close().await.unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.table().get("/a"), Some(41));
}

#[tokio::test]
async fn a_reset_survives_snapshots_of_the_log_that_held_the_advance_it_overrules() {
    let dir = tempfile::tempdir().unwrap();
    // Small segments: the advances below rotate the log several times, each rotation asking
    // for a snapshot, so the reset and the advance it overrules end up in different files.
    let store = FileStore::open(dir.path(), options(4096)).unwrap();
    advance(&store, "/bricked", u64::MAX).await.unwrap();
    for t in 0..300u64 {
        advance(&store, &format!("/other/{}", t % 7), t).await.unwrap();
    }
    store.commit(0, MarkBatch::reset(vec![key("/bricked")], 9)).await.unwrap();
    for t in 300..600u64 {
        advance(&store, &format!("/other/{}", t % 7), t).await.unwrap();
    }
    store.close().await.unwrap();
    drop(store);
    let snapshots = std::fs::read_dir(dir.path()).unwrap().flatten();
    assert!(snapshots.filter(|e| e.file_name().to_string_lossy().ends_with(".snap")).count() > 0);
    let store = FileStore::open(dir.path(), options(4096)).unwrap();
    assert_eq!(store.table().get("/bricked"), Some(9));
    assert_eq!(store.table().get("/other/0"), Some(595));
}

#[tokio::test]
async fn a_reset_leaves_a_write_in_flight_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    advance(&store, "/a", 1000).await.unwrap();
    store.commit(0, MarkBatch::reset(vec![key("/a")], 10)).await.unwrap();
    assert_eq!(store.table().entry(MarkRef::key("/a")), Some((10, true)));
    store.close().await.unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.in_flight_at_start(), [("/a".to_owned(), 10)], "still quarantined on start");
}
