//! One test per recovery case, plus the store's behaviour under load and at its limits.

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::format::{FileKind, Header, Kind};
use super::recovery::{segment_name, snapshot_name};
use super::*;
use crate::store::SyncMode;

fn options(segment_bytes: u64) -> StoreOptions {
    StoreOptions { segment_bytes, max_resources: 1_000, ..StoreOptions::default() }
}

fn open(dir: &Path) -> FileStore {
    FileStore::open(dir, options(64 << 20)).unwrap()
}

/// Opens `dir` once whoever holds its lock lets go (within 10 s).
fn open_when_free(dir: &Path) -> FileStore {
    for _ in 0..10_000 {
        match FileStore::open(dir, options(64 << 20)) {
            Err(StoreError::Locked { .. }) => std::thread::sleep(Duration::from_millis(1)),
            other => return other.unwrap(),
        }
    }
    panic!("{} stayed locked", dir.display());
}

fn contents(store: &FileStore) -> HashMap<String, u64> {
    let mut all = HashMap::new();
    store.table().for_each(|k, t, _| {
        all.insert(k.to_owned(), t);
    });
    all
}

async fn write(store: &FileStore, entries: &[(&str, u64)]) {
    for (k, t) in entries {
        store.advance(k, *t).await.unwrap();
    }
}

async fn write_and_close(dir: &Path, entries: &[(&str, u64)]) {
    let store = open(dir);
    write(&store, entries).await;
    store.close().await.unwrap();
}

fn segment(dir: &Path, seq: u64) -> PathBuf {
    dir.join(segment_name(seq))
}

/// What a crash now would leave: the directory read as it is (nothing repaired), and the
/// table rebuilt from it.
fn as_a_crash_would_leave(dir: &Path) -> (Table, recovery::Recovered) {
    let table = Table::new();
    let found = recovery::recover(dir, &table, recovery::Mode::ReadOnly).unwrap();
    (table, found)
}

/// Where the last segment's records end: the log writes zeros ahead of itself, so not where
/// the file ends.
fn records_end(dir: &Path) -> u64 {
    as_a_crash_would_leave(dir).1.last_end
}

fn map(entries: &[(&str, u64)]) -> HashMap<String, u64> {
    entries.iter().map(|(k, t)| (k.to_string(), *t)).collect()
}

#[tokio::test]
async fn empty_dir_starts_empty_with_a_first_segment() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    assert!(store.table().is_empty());
    assert!(segment(dir.path(), 1).exists());
}

#[tokio::test]
async fn clean_shutdown_recovers_the_maximum_per_key() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5), ("/b", 7), ("/a", 9), ("/a", 6)]).await;
    assert_eq!(contents(&open(dir.path())), map(&[("/a", 9), ("/b", 7)]));
}

#[tokio::test]
async fn torn_tail_is_set_aside_truncated_and_the_log_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5), ("/b", 7)]).await;
    let path = segment(dir.path(), 1);
    let full = records_end(dir.path());
    OpenOptions::new().write(true).open(&path).unwrap().set_len(full - 3).unwrap();
    let store = open(dir.path());
    assert_eq!(contents(&store), map(&[("/a", 5)]), "the unfinished batch is dropped whole");
    let aside = fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().contains(".torn-at-"))
        .count();
    assert_eq!(aside, 1, "copy kept aside");
    assert!(fs::metadata(&path).unwrap().len() < full - 3);
    write(&store, &[("/b", 8)]).await;
    store.close().await.unwrap();
    drop(store);
    assert_eq!(contents(&open(dir.path())), map(&[("/a", 5), ("/b", 8)]));
}

#[tokio::test]
async fn a_half_written_record_followed_by_zeros_is_a_torn_write() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5), ("/b", 7)]).await;
    let path = segment(dir.path(), 1);
    let mut data = fs::read(&path).unwrap();
    data.truncate(records_end(dir.path()) as usize);
    let n = data.len();
    data[n - 16..].fill(0); // the end of the last batch never landed
    data.extend_from_slice(&[0; 4096]); // the file grew before its data did
    fs::write(&path, &data).unwrap();
    assert_eq!(contents(&open(dir.path())), map(&[("/a", 5)]));
}

#[tokio::test]
async fn corruption_with_valid_records_after_it_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5), ("/b", 7)]).await;
    let path = segment(dir.path(), 1);
    let mut data = fs::read(&path).unwrap();
    data[format::HEADER_LEN + 9] ^= 0xff; // inside the first record's token
    fs::write(&path, &data).unwrap();
    let err = FileStore::open(dir.path(), options(64 << 20)).unwrap_err();
    assert!(matches!(&err, StoreError::Corrupt { offset: 40, .. }), "{err}");
    assert!(err.to_string().contains(&segment_name(1)) && err.to_string().contains("had been synced"), "{err}");
}

#[tokio::test]
async fn a_missing_segment_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    // Three segments and no snapshot, as after rotations whose compaction never ran.
    let table = Table::new();
    let mut log = log::Log::open(
        dir.path(),
        SyncMode::Always,
        &recovery::recover(dir.path(), &table, recovery::Mode::Repair).unwrap(),
        4096,
    )
    .unwrap();
    for t in 0..3 {
        log.append(Kind::Advance, "/a", t);
        log.rotate().unwrap();
    }
    drop(log);
    assert!(segment(dir.path(), 4).exists());
    fs::remove_file(segment(dir.path(), 2)).unwrap();
    let err = FileStore::open(dir.path(), options(4096)).unwrap_err();
    assert!(err.to_string().contains(&segment_name(2)) && err.to_string().contains("missing"), "{err}");
}

#[tokio::test]
async fn snapshot_plus_tail_recovers_and_compaction_keeps_disk_proportional_to_resources() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), options(4096)).unwrap();
    let mut expect = HashMap::new();
    for t in 0..3000u64 {
        let key = format!("/resource/{}", t % 10);
        store.advance(&key, t).await.unwrap();
        expect.insert(key, t);
    }
    // Closing waits for the compactor to finish the snapshots it was asked for.
    store.close().await.unwrap();
    drop(store);
    let files: Vec<String> =
        fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(files.iter().any(|f| f.ends_with(".snap")), "{files:?}");
    let bytes: u64 = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert!(bytes < 64 * 1024, "3000 advances over 10 resources left {bytes} bytes: {files:?}");
    let store = FileStore::open(dir.path(), options(4096)).unwrap();
    assert_eq!(contents(&store), expect);
}

#[tokio::test]
async fn a_damaged_snapshot_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let table = Table::new();
    table.raise("/a", 5);
    log::write_snapshot(dir.path(), 3, &table).unwrap();
    fs::write(segment(dir.path(), 3), Header::new(3).encode(FileKind::Segment)).unwrap();
    let snap = dir.path().join(snapshot_name(3));
    let mut data = fs::read(&snap).unwrap();
    data.truncate(data.len() - 24); // lose the trailer
    fs::write(&snap, &data).unwrap();
    let err = FileStore::open(dir.path(), options(4096)).unwrap_err();
    assert!(err.to_string().contains("trailer"), "{err}");
}

#[tokio::test]
async fn leftovers_of_an_interrupted_compaction_are_cleaned_up() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5)]).await;
    fs::write(dir.path().join(format!("{}.tmp", snapshot_name(2))), b"half a snapshot").unwrap();
    let store = open(dir.path());
    assert_eq!(contents(&store), map(&[("/a", 5)]));
    assert!(!dir.path().join(format!("{}.tmp", snapshot_name(2))).exists());
}

#[tokio::test]
async fn a_second_store_on_the_same_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = open(dir.path());
    let err = FileStore::open(dir.path(), options(4096)).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    assert!(matches!(inspect(dir.path()), Err(StoreError::Locked { .. })), "inspect refuses too");
}

#[tokio::test]
async fn inspect_reads_without_changing_anything() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5), ("/b", 7)]).await;
    let path = segment(dir.path(), 1);
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(&[1, 2, 3]).unwrap();
    let before = fs::read(&path).unwrap();
    let found = inspect(dir.path()).unwrap();
    assert_eq!(found.table.get("/b"), Some(7));
    assert!(found.torn.is_some());
    assert_eq!(fs::read(&path).unwrap(), before, "inspect truncated nothing");
}

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
async fn a_directory_written_under_other_key_rules_refuses_to_open() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/buckets/b1/obj", 50)]).await;
    let scoped = "scope /buckets/ segments 2\n".to_owned();
    let err = FileStore::open(dir.path(), StoreOptions { keying: scoped, ..options(4096) }).unwrap_err();
    assert!(matches!(err, StoreError::KeyingChanged { .. }), "{err}");
    assert!(err.to_string().contains("scope /buckets/ segments 2"), "{err}");
    assert_eq!(contents(&open(dir.path())), map(&[("/buckets/b1/obj", 50)]), "the old rules still open it");
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

#[tokio::test]
async fn the_log_writes_zeros_ahead_and_a_restart_resumes_where_the_records_end() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5)]).await;
    let path = segment(dir.path(), 1);
    let (file, records) = (fs::metadata(&path).unwrap().len(), records_end(dir.path()));
    assert!(file > records, "zeros written ahead: file {file}, records end at {records}");
    let store = open(dir.path());
    write(&store, &[("/a", 6), ("/b", 1)]).await;
    store.close().await.unwrap();
    drop(store);
    let names: Vec<String> =
        fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.contains(".torn-at-")), "unused zeros are not a torn tail: {names:?}");
    assert_eq!(contents(&open(dir.path())), map(&[("/a", 6), ("/b", 1)]));
}

#[tokio::test]
async fn zeros_at_the_end_of_a_segment_that_is_not_the_last_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let table = Table::new();
    let found = recovery::recover(dir.path(), &table, recovery::Mode::Repair).unwrap();
    let mut log = log::Log::open(dir.path(), SyncMode::Always, &found, 4096).unwrap();
    log.append(Kind::Advance, "/a", 1);
    log.rotate().unwrap();
    log.append(Kind::Advance, "/a", 2);
    log.commit().unwrap();
    drop(log);
    // The disk lost the end of a closed segment: not the log's own zeros.
    let mut data = fs::read(segment(dir.path(), 1)).unwrap();
    let n = data.len();
    data[n - 28..n - 24].fill(0); // the last commit marker's checksum
    data.extend_from_slice(&[0; 64]);
    fs::write(segment(dir.path(), 1), &data).unwrap();
    let err = FileStore::open(dir.path(), options(4096)).unwrap_err();
    assert!(err.to_string().contains(&segment_name(1)), "{err}");
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
