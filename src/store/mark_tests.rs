//! Floors, advances of several marks in one batch, and the format versions that hold them.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::format::{self, FileKind, HEADER_LEN, Header, Kind};
use super::recovery::{segment_name, snapshot_name};
use super::tests::{
    advance, answered, as_a_crash_would_leave, contents, map, note, open, options, records_end, segment,
};
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

fn sorted(mut v: Vec<(String, u64)>) -> Vec<(String, u64)> {
    v.sort();
    v
}

fn pairs(entries: &[(&str, u64)]) -> Vec<(String, u64)> {
    sorted(entries.iter().map(|(k, t)| (k.to_string(), *t)).collect())
}

#[tokio::test]
async fn floors_and_keys_spelled_alike_are_separate_marks_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance(vec![floor("/d/"), key("/d/x")], 5)).await.unwrap();
    store.commit(0, MarkBatch::advance(vec![floor("/a")], 7)).await.unwrap();
    advance(&store, "/a", 3).await.unwrap();
    let table = store.table();
    assert_eq!((table.level(MarkRef::floor("/a")), table.get("/a")), (Some(7), Some(3)), "raised before it resolved");
    assert_eq!(table.entry(MarkRef::floor("/d/")), Some((5, true)));
    assert_eq!((table.level(MarkRef::floor("/d/x")), table.get("/d/")), (None, None));
    note(&store, MarkBatch::answered([floor("/a")], 7));
    store.close().await.unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(floors(store.table()), map(&[("/d/", 5), ("/a", 7)]));
    assert_eq!(contents(&store), map(&[("/d/x", 5), ("/a", 3)]));
    assert_eq!(store.floors_in_flight_at_start(), pairs(&[("/d/", 5)]));
    assert_eq!(sorted(store.in_flight_at_start().to_vec()), pairs(&[("/a", 3), ("/d/x", 5)]));
}

#[tokio::test]
async fn an_acknowledged_advance_of_several_marks_is_on_disk_when_it_resolves() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance(vec![key("/src"), key("/dst"), floor("/dst/")], 11)).await.unwrap();
    // A crash now: the directory as it is, the store still running.
    let (table, found) = as_a_crash_would_leave(dir.path());
    assert_eq!(
        (table.get("/src"), table.get("/dst"), table.level(MarkRef::floor("/dst/"))),
        (Some(11), Some(11), Some(11))
    );
    assert_eq!(found.floors_in_flight, pairs(&[("/dst/", 11)]));
    assert_eq!(sorted(found.in_flight), pairs(&[("/dst", 11), ("/src", 11)]));
}

#[tokio::test]
async fn an_advance_of_several_marks_is_recovered_whole_or_not_at_all_wherever_a_crash_cuts_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance(vec![key("/a"), floor("/keep/")], 1)).await.unwrap();
    store.commit(0, MarkBatch::advance(vec![key("/a"), floor("/a"), key("/b"), floor("/c/")], 2)).await.unwrap();
    store.close().await.unwrap();
    drop(store);
    let end = records_end(dir.path()) as usize;
    let data = fs::read(segment(dir.path(), 1)).unwrap()[..end].to_vec();
    // Where the last batch starts: what recovery drops when that batch's last byte is missing.
    let start = {
        let cut = tempfile::tempdir().unwrap();
        fs::write(segment(cut.path(), 1), &data[..end - 1]).unwrap();
        as_a_crash_would_leave(cut.path()).1.torn.unwrap().1 as usize
    };
    assert!(start > HEADER_LEN && end - start == 4 * 24 + 32, "the batch holds four records and its commit");
    let survived = |bytes: &[u8]| {
        let at = tempfile::tempdir().unwrap();
        fs::write(segment(at.path(), 1), bytes).unwrap();
        let (t, _) = as_a_crash_would_leave(at.path());
        assert_eq!(t.level(MarkRef::floor("/keep/")), Some(1), "the earlier batch survives");
        let marks = [
            t.get("/a") == Some(2),
            t.level(MarkRef::floor("/a")) == Some(2),
            t.get("/b") == Some(2),
            t.level(MarkRef::floor("/c/")) == Some(2),
        ];
        assert!(marks.iter().all(|&m| m) || !marks.iter().any(|&m| m), "part of the batch survived: {marks:?}");
        marks[0]
    };
    assert!(survived(&data), "the whole batch");
    let mut dropped = 0;
    for at in start..end {
        assert!(!survived(&data[..at]), "cut at {at}");
        // Damage anywhere in the batch (a padding byte is no damage: no checksum covers it).
        let mut flipped = data.clone();
        flipped[at] ^= 0x5a;
        dropped += usize::from(!survived(&flipped));
    }
    assert!(dropped > (end - start) / 2, "damage dropped the batch only {dropped} times");
    // A proxy starting on a torn tail sets it aside, keeps the floors before it, and goes on.
    fs::write(segment(dir.path(), 1), &data[..end - 5]).unwrap();
    let store = open(dir.path());
    assert_eq!(
        (store.table().level(MarkRef::floor("/keep/")), store.table().level(MarkRef::floor("/a"))),
        (Some(1), None)
    );
    store.commit(0, MarkBatch::advance(vec![floor("/a"), floor("/c/")], 3)).await.unwrap();
    store.close().await.unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(floors(store.table()), map(&[("/keep/", 1), ("/a", 3), ("/c/", 3)]));
    assert_eq!(contents(&store), map(&[("/a", 1)]));
}

#[tokio::test]
async fn an_advance_of_more_marks_than_a_batch_holds_is_never_split() {
    let dir = tempfile::tempdir().unwrap();
    let batches = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&batches);
    let hook: CommitHook = Arc::new(move |_, advances| seen.lock().unwrap().push(advances));
    let opts = StoreOptions { max_resources: 10_000, on_commit: Some(hook), ..options(64 << 20) };
    let store = FileStore::open(dir.path(), opts).unwrap();
    let marks: Vec<_> = (0..5000).map(|i| floor(&format!("/f/{i}/"))).collect();
    store.commit(0, MarkBatch::advance(marks, 3)).await.unwrap();
    assert_eq!(*batches.lock().unwrap(), [5000], "one batch, one sync");
    assert_eq!(store.table().count(MarkKind::Floor), 5000);
    store.close().await.unwrap();
    drop(store);
    let (table, found) = as_a_crash_would_leave(dir.path());
    assert_eq!((table.count(MarkKind::Floor), found.floors_in_flight.len()), (5000, 5000));
}

#[test]
fn a_snapshot_keeps_floors_and_the_writes_in_flight_under_them() {
    let dir = tempfile::tempdir().unwrap();
    let table = Table::new();
    table.raise(MarkRef::floor("/p/"), 4);
    table.advance(MarkRef::floor("/q/"), 6);
    table.advance(MarkRef::key("/q/"), 2);
    compact::write_snapshot(dir.path(), 3, &table).unwrap();
    fs::write(segment(dir.path(), 3), Header::new(3).encode(FileKind::Segment)).unwrap();
    let (t, found) = as_a_crash_would_leave(dir.path());
    assert_eq!(found.snapshot, Some(3));
    assert_eq!(
        (t.entry(MarkRef::floor("/p/")), t.entry(MarkRef::floor("/q/")), t.entry(MarkRef::key("/q/"))),
        (Some((4, false)), Some((6, true)), Some((2, true)))
    );
    assert_eq!((found.floors_in_flight, found.in_flight), (pairs(&[("/q/", 6)]), pairs(&[("/q/", 2)])));
}

#[tokio::test]
async fn floors_survive_rotation_snapshots_and_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), options(4096)).unwrap();
    for t in 1..=600u64 {
        let marks = vec![floor(&format!("/d{}/", t % 7)), key(&format!("/d{}/x", t % 7))];
        store.commit(0, MarkBatch::advance(marks.clone(), t)).await.unwrap();
        if t < 598 {
            note(&store, MarkBatch::answered(marks.clone(), t));
        }
    }
    store.close().await.unwrap();
    drop(store);
    let mut snaps: Vec<u64> = fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str()?.strip_prefix("snapshot-")?.strip_suffix(".snap")?.parse().ok())
        .collect();
    snaps.sort();
    let newest = *snaps.last().expect("segments rotated and were compacted");
    let in_snapshot = Table::new();
    replay::load_snapshot(&dir.path().join(snapshot_name(newest)), newest, &in_snapshot).unwrap();
    assert_eq!((in_snapshot.count(MarkKind::Floor), in_snapshot.len()), (7, 7), "the snapshot holds the floors");
    let store = open(dir.path());
    let expect: HashMap<String, u64> = (594..=600u64).map(|t| (format!("/d{}/", t % 7), t)).collect();
    assert_eq!(floors(store.table()), expect);
    assert_eq!(
        sorted(store.floors_in_flight_at_start().to_vec()),
        pairs(&[("/d3/", 598), ("/d4/", 599), ("/d5/", 600)])
    );
    assert_eq!(store.in_flight_at_start().len(), 3);
}

#[tokio::test]
async fn max_resources_counts_keys_and_floors_and_refuses_a_batch_whole() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), StoreOptions { max_resources: 3, ..options(4096) }).unwrap();
    advance(&store, "/a", 1).await.unwrap();
    store.commit(0, MarkBatch::advance(vec![floor("/a"), key("/b")], 2)).await.unwrap();
    let refused = store.commit(0, MarkBatch::advance(vec![key("/a"), floor("/c")], 3)).await;
    assert!(matches!(refused, Err(StoreError::Full(3))), "{refused:?}");
    assert_eq!(
        (store.table().get("/a"), store.table().level(MarkRef::floor("/c"))),
        (Some(1), None),
        "nothing of it was applied"
    );
    assert!(matches!(advance(&store, "/new", 1).await, Err(StoreError::Full(3))), "floors count against new keys");
    store.commit(0, MarkBatch::advance(vec![key("/a"), floor("/a"), floor("/a")], 4)).await.unwrap();
    assert!(store.condition().healthy());
    store.close().await.unwrap();
    drop(store);
    let (table, found) = as_a_crash_would_leave(dir.path());
    assert_eq!(found.records, 5, "the refused batch logged nothing, the repeated floor once");
    assert_eq!(
        (table.get("/a"), table.level(MarkRef::floor("/a")), table.level(MarkRef::floor("/c"))),
        (Some(4), Some(4), None)
    );
}

#[tokio::test]
async fn an_answer_clears_the_marks_of_its_own_token_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance(vec![floor("/d/"), key("/d/x"), floor("/e/"), floor("/f/")], 5)).await.unwrap();
    note(&store, MarkBatch::answered([floor("/d/"), key("/d/x")], 5));
    note(&store, MarkBatch::answered([floor("/e/")], 4)); // an earlier write's answer
    answered(&store, "/f/", 5); // the key /f/, not the floor
    store.close().await.unwrap(); // logs and applies every answer still waiting
    assert_eq!(store.table().entry(MarkRef::floor("/d/")), Some((5, false)));
    assert_eq!(store.table().entry(MarkRef::key("/d/x")), Some((5, false)));
    assert_eq!(store.table().in_flight(MarkKind::Floor).len(), 2);
    drop(store);
    let store = open(dir.path());
    assert_eq!(sorted(store.floors_in_flight_at_start().to_vec()), pairs(&[("/e/", 5), ("/f/", 5)]));
    assert!(store.in_flight_at_start().is_empty());
}

#[tokio::test]
async fn an_empty_advance_resolves_at_once_and_an_unloggable_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance(Vec::new(), 1)).await.unwrap();
    let long = "/".repeat(format::MAX_KEY_LEN + 1);
    let too_long = store.commit(0, MarkBatch::advance(vec![key("/ok"), floor(&long)], 1)).await;
    assert!(matches!(too_long, Err(StoreError::KeyTooLong(n)) if n == long.len()), "{too_long:?}");
    assert!(matches!(store.commit(0, MarkBatch::advance(vec![floor("")], 1)).await, Err(StoreError::KeyTooLong(0))));
    note(&store, MarkBatch::answered([], 1));
    store.close().await.unwrap();
    let (table, found) = as_a_crash_would_leave(dir.path());
    assert_eq!((found.records, table.get("/ok")), (0, None), "nothing was logged");
}

#[tokio::test]
async fn inspect_counts_floors_and_the_writes_in_flight_under_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance(vec![floor("/a/"), floor("/b/"), key("/a/1")], 8)).await.unwrap();
    note(&store, MarkBatch::answered([floor("/a/")], 8));
    store.close().await.unwrap();
    drop(store);
    let found = inspect(dir.path()).unwrap();
    assert_eq!((found.floors, found.table.len()), (2, 1));
    assert_eq!(found.floors_in_flight, pairs(&[("/b/", 8)]));
}

/// A segment as a version 1 build wrote it: a v1 header, committed batches, zeros ahead.
fn v1_segment(dir: &Path, seq: u64, batches: &[&[(Kind, &str, u64)]]) {
    let header = Header { version: 1, ..Header::new(seq) };
    let seed = header.seed(FileKind::Segment);
    let mut data = header.encode(FileKind::Segment).to_vec();
    for batch in batches {
        let start = data.len() as u64;
        let mut buf = Vec::new();
        for (kind, key, token) in *batch {
            format::encode(&mut buf, seed, *kind, key, *token);
        }
        format::encode_commit(&mut buf, seed, start, start);
        data.extend_from_slice(&buf);
    }
    data.resize(4096, 0);
    fs::write(dir.join(segment_name(seq)), data).unwrap();
}

fn version_of(path: &Path) -> u32 {
    let data = fs::read(path).unwrap();
    u32::from_le_bytes(data[8..12].try_into().unwrap())
}

#[tokio::test]
async fn a_version_1_directory_opens_keeps_its_keys_and_goes_on_in_a_segment_of_this_version() {
    let dir = tempfile::tempdir().unwrap();
    let old = Header { version: 1, ..Header::new(2) };
    let seed = old.seed(FileKind::Snapshot);
    let mut snap = old.encode(FileKind::Snapshot).to_vec();
    format::encode(&mut snap, seed, Kind::State, "/old", 3);
    format::encode(&mut snap, seed, Kind::Advance, "/flying", 4);
    format::write_trailer(&mut snap, seed, 2).unwrap();
    fs::write(dir.path().join(snapshot_name(2)), snap).unwrap();
    v1_segment(dir.path(), 2, &[&[(Kind::Advance, "/a", 5), (Kind::Advance, "/b", 7)], &[(Kind::Answered, "/a", 5)]]);
    let store = open(dir.path());
    assert_eq!(contents(&store), map(&[("/old", 3), ("/flying", 4), ("/a", 5), ("/b", 7)]));
    assert_eq!(sorted(store.in_flight_at_start().to_vec()), pairs(&[("/b", 7), ("/flying", 4)]));
    assert!(segment(dir.path(), 3).exists(), "new records go to a new segment");
    store.commit(0, MarkBatch::advance(vec![floor("/f/"), key("/a")], 9)).await.unwrap();
    store.close().await.unwrap();
    drop(store);
    let old_end = 40 + 2 * 24 + 32 + 24 + 32;
    assert_eq!(fs::metadata(segment(dir.path(), 2)).unwrap().len(), old_end, "closed at its records, as rotation does");
    assert_eq!((version_of(&segment(dir.path(), 2)), version_of(&segment(dir.path(), 3))), (1, format::VERSION));
    let store = open(dir.path());
    assert_eq!(contents(&store), map(&[("/old", 3), ("/flying", 4), ("/a", 9), ("/b", 7)]));
    assert_eq!(floors(store.table()), map(&[("/f/", 9)]));
    assert!(!segment(dir.path(), 4).exists(), "a segment of this version is continued");
}

#[tokio::test]
async fn a_floor_record_in_a_version_1_file_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    v1_segment(dir.path(), 1, &[&[(Kind::Advance, "/a", 5)], &[(Kind::FloorAdvance, "/d/", 6)]]);
    let err = FileStore::open(dir.path(), options(4096)).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { offset: 96, .. }), "{err}");
    assert!(err.to_string().contains("a FloorAdvance record in a version 1 file"), "{err}");
}

#[tokio::test]
async fn a_file_of_an_unknown_version_refuses_to_start_and_names_the_version() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance(vec![floor("/d/"), key("/a")], 5)).await.unwrap();
    store.close().await.unwrap();
    drop(store);
    let path = segment(dir.path(), 1);
    let mut data = fs::read(&path).unwrap();
    let mut header = Header::parse(FileKind::Segment, &data).unwrap();
    header.version = 5;
    data[..HEADER_LEN].copy_from_slice(&header.encode(FileKind::Segment));
    fs::write(&path, &data).unwrap();
    let err = FileStore::open(dir.path(), options(4096)).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { offset: 0, .. }), "{err}");
    let message = err.to_string();
    assert!(message.contains(&segment_name(1)), "{message}");
    assert!(message.contains("format version 5 is not supported (this build reads 1 to 4)"), "{message}");
    assert_eq!(fs::read(&path).unwrap(), data, "nothing was truncated or set aside");
    assert!(inspect(dir.path()).unwrap_err().to_string().contains("format version 5"));
    // A snapshot of an unknown version is refused the same way.
    let snap = tempfile::tempdir().unwrap();
    let table = Table::new();
    table.raise(MarkRef::floor("/d/"), 5);
    compact::write_snapshot(snap.path(), 2, &table).unwrap();
    let path = snap.path().join(snapshot_name(2));
    let mut data = fs::read(&path).unwrap();
    data[..HEADER_LEN].copy_from_slice(&Header { version: 5, ..Header::new(2) }.encode(FileKind::Snapshot));
    fs::write(&path, &data).unwrap();
    let err = FileStore::open(snap.path(), options(4096)).unwrap_err();
    assert!(err.to_string().contains("format version 5 is not supported"), "{err}");
}

#[tokio::test]
async fn bindings_and_their_drops_survive_a_restart_and_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.commit(0, MarkBatch::advance([Mark::upload("/b/k\nid1")], 41)).await.unwrap();
    store.commit(0, MarkBatch::advance([Mark::upload("/b/j\nid2")], 43)).await.unwrap();
    store.commit(0, MarkBatch::drop_bindings([Mark::upload("/b/k\nid1")])).await.unwrap();
    let refused = store.commit(0, MarkBatch::drop_bindings([key("/b/k")])).await;
    assert!(matches!(refused, Err(StoreError::Unsupported(_))), "a key is never dropped: {refused:?}");
    let refused = store.commit(0, MarkBatch::reset([Mark::upload("/b/j\nid2")], 1)).await;
    assert!(matches!(refused, Err(StoreError::Unsupported(_))), "nor a binding reset: {refused:?}");
    store.close().await.unwrap();
    drop(store);
    let store = open(dir.path());
    let bound = |t: &Table| (t.level(MarkRef::upload("/b/k\nid1")), t.entry(MarkRef::upload("/b/j\nid2")));
    assert_eq!(bound(store.table()), (None, Some((43, false))), "replayed from the log");
    assert!(store.table().is_empty(), "a binding is not a key");
    let snap = tempfile::tempdir().unwrap();
    compact::write_snapshot(snap.path(), 2, store.table()).unwrap();
    let loaded = Table::new();
    replay::load_snapshot(&snap.path().join(snapshot_name(2)), 2, &loaded).unwrap();
    assert_eq!(bound(&loaded), (None, Some((43, false))), "loaded from a snapshot");
}
