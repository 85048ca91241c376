//! One test per recovery case, and the helpers the other store tests share (the writer's
//! behaviour is `writer_tests`', floors and batches of several marks `mark_tests`').

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::format::{FileKind, Header, Kind};
use super::recovery::{segment_name, snapshot_name};
use super::*;
use crate::store::SyncMode;

pub(super) fn options(segment_bytes: u64) -> StoreOptions {
    StoreOptions { segment_bytes, max_resources: 1_000, ..StoreOptions::default() }
}

pub(super) fn open(dir: &Path) -> FileStore {
    FileStore::open(dir, options(64 << 20)).unwrap()
}

/// Opens `dir` once whoever holds its lock lets go (within 10 s).
pub(super) fn open_when_free(dir: &Path) -> FileStore {
    for _ in 0..10_000 {
        match FileStore::open(dir, options(64 << 20)) {
            Err(StoreError::Locked { .. }) => std::thread::sleep(Duration::from_millis(1)),
            other => return other.unwrap(),
        }
    }
    panic!("{} stayed locked", dir.display());
}

/// Advances the key `key` to `token`, in the store's term now.
pub(super) fn advance<'a>(store: &'a dyn Store, key: &str, token: u64) -> StoreFuture<'a> {
    store.commit(store.term(), MarkBatch::advance([Mark::key(key)], token))
}

/// Hands an answer to `store`, in its term now. It resolves at once: nothing waits for it.
pub(super) fn note(store: &dyn Store, answered: MarkBatch) {
    drop(store.commit(store.term(), answered));
}

/// Notes that the write that advanced the key `key` to `token` was answered.
pub(super) fn answered(store: &dyn Store, key: &str, token: u64) {
    note(store, MarkBatch::answered([Mark::key(key)], token));
}

pub(super) fn contents(store: &FileStore) -> HashMap<String, u64> {
    let mut all = HashMap::new();
    store.table().for_each(MarkKind::Key, |k, t, _| {
        all.insert(k.to_owned(), t);
    });
    all
}

pub(super) async fn write(store: &FileStore, entries: &[(&str, u64)]) {
    for (k, t) in entries {
        advance(store, k, *t).await.unwrap();
    }
}

pub(super) async fn write_and_close(dir: &Path, entries: &[(&str, u64)]) {
    let store = open(dir);
    write(&store, entries).await;
    store.close().await.unwrap();
}

pub(super) fn segment(dir: &Path, seq: u64) -> PathBuf {
    dir.join(segment_name(seq))
}

/// What a crash now would leave: the directory read as it is (nothing repaired), and the
/// table rebuilt from it.
pub(super) fn as_a_crash_would_leave(dir: &Path) -> (Table, recovery::Recovered) {
    let table = Table::new();
    let found = recovery::recover(dir, &table, recovery::Mode::ReadOnly).unwrap();
    (table, found)
}

/// Where the last segment's records end: the log writes zeros ahead of itself, so not where
/// the file ends.
pub(super) fn records_end(dir: &Path) -> u64 {
    as_a_crash_would_leave(dir).1.last_end
}

pub(super) fn map(entries: &[(&str, u64)]) -> HashMap<String, u64> {
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
        advance(&store, &key, t).await.unwrap();
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
    table.raise(MarkRef::key("/a"), 5);
    compact::write_snapshot(dir.path(), 3, &table).unwrap();
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

#[tokio::test]
async fn the_next_segment_is_made_ahead_and_a_rotation_puts_it_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let table = Table::new();
    let found = recovery::recover(dir.path(), &table, recovery::Mode::Repair).unwrap();
    let mut log = log::Log::open(dir.path(), SyncMode::Always, &found, 4096).unwrap();
    let ahead = |seq: u64| dir.path().join(format!("{}.next.tmp", segment_name(seq)));
    assert!(ahead(2).exists() && !segment(dir.path(), 2).exists(), "made ahead under a temporary name");
    log.append(Kind::Advance, "/a", 1);
    assert_eq!(log.rotate().unwrap(), Some(2));
    assert!(segment(dir.path(), 2).exists() && !ahead(2).exists() && ahead(3).exists());
    log.append(Kind::Advance, "/a", 2);
    log.commit().unwrap();
    drop(log);
    // A crash leaves the one made ahead behind: recovery removes it and reads the rest.
    let store = FileStore::open(dir.path(), options(4096)).unwrap();
    assert_eq!(store.table().get("/a"), Some(2));
    assert!(!ahead(4).exists(), "only the segment after the current one is made ahead");
}
