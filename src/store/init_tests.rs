//! Starting a data directory: `init` makes one, with floors; `check_initialised` refuses a
//! missing or empty one and accepts one an earlier build started by use.

use std::fs;

use super::recovery::{segment_name, snapshot_name};
use super::tests::{advance, answered, open, write_and_close};
use super::*;

fn refused(dir: &std::path::Path) -> (bool, String) {
    match check_initialised(dir) {
        Err(e @ StoreError::NotInitialised { missing, .. }) => (missing, e.to_string()),
        other => panic!("{}: {other:?}", dir.display()),
    }
}

#[test]
fn a_missing_or_empty_dir_is_refused_with_the_command_to_run() {
    let parent = tempfile::tempdir().unwrap();
    let missing = parent.path().join("data");
    let (is_missing, msg) = refused(&missing);
    assert!(is_missing, "{msg}");
    let d = missing.display();
    assert!(msg.contains(&format!("data dir {d} does not exist")), "{msg}");
    assert!(msg.contains(&format!("`fencegate init --dir {d}`")), "{msg}");
    assert!(msg.contains(&format!("`fencegate init --dir {d} --floor <that token>`")), "{msg}");
    assert!(msg.contains("current revision"), "{msg}");

    // An empty volume's mount point, say: files that are not fence state do not count.
    let empty = parent.path();
    fs::create_dir(empty.join("lost+found")).unwrap();
    fs::write(empty.join("LOCK"), "").unwrap();
    fs::write(empty.join("segment-00000000000000000001.log.tmp"), "half").unwrap();
    let (is_missing, msg) = refused(empty);
    assert!(!is_missing && msg.contains("holds no fence state"), "{msg}");
}

#[tokio::test]
async fn init_with_floor_zero_makes_a_dir_that_opens_empty() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("a/b");
    init(&dir, &[("/", 0)]).unwrap();
    check_initialised(&dir).unwrap();
    assert!(dir.join("INIT").exists() && !dir.join(segment_name(1)).exists(), "floor 0 writes no log");
    assert_eq!(init::init_floors(&dir).unwrap(), Some(vec![]));
    let store = open(&dir);
    assert!(store.table().is_empty() && store.table().count(MarkKind::Floor) == 0);
    store.close().await.unwrap();
    let found = inspect(&dir).unwrap();
    assert_eq!(found.init_floors, Some(vec![]));
}

#[tokio::test]
async fn init_floors_are_in_the_log_answered_and_survive_compaction() {
    let dir = tempfile::tempdir().unwrap();
    init(dir.path(), &[("/", 500), ("/zero", 0)]).unwrap();
    assert_eq!(init::init_floors(dir.path()).unwrap(), Some(vec![("/".to_owned(), 500)]));
    // Read as recovery reads it: one floor, not in flight, so nothing starts quarantined.
    let store = FileStore::open(dir.path(), tests::options(4096)).unwrap();
    assert_eq!(store.table().entry(MarkRef::floor("/")), Some((500, false)));
    assert_eq!(store.table().level(MarkRef::floor("/zero")), None, "a floor of 0 raises nothing");
    assert!(store.floors_in_flight_at_start().is_empty());
    // The proxy appends to segment 1; rotations and snapshots keep the floor.
    for i in 0..200u64 {
        let key = format!("/k/{i:0>40}");
        advance(&store, &key, 501 + i).await.unwrap();
        answered(&store, &key, 501 + i);
    }
    store.close().await.unwrap();
    let found = inspect(dir.path()).unwrap();
    assert!(found.snapshot.is_some(), "compacted: {:?}", found.segments);
    assert_eq!(found.table.level(MarkRef::floor("/")), Some(500));
    assert_eq!(found.init_floors, Some(vec![("/".to_owned(), 500)]));
    assert!(found.floors_in_flight.is_empty());
}

#[tokio::test]
async fn init_refuses_a_dir_that_holds_state_or_is_in_use() {
    let dir = tempfile::tempdir().unwrap();
    init(dir.path(), &[("/", 7)]).unwrap();
    let err = init(dir.path(), &[("/", 9)]).unwrap_err();
    assert!(matches!(&err, StoreError::AlreadyInitialised { found, .. } if found == "INIT"), "{err:?}");
    assert!(err.to_string().contains("already holds fence state (INIT)"), "{err}");

    // Started by an earlier build (KEYING and segments, no INIT), or by an init that crashed
    // after writing its floors (segment 1 alone): live either way.
    let used = tempfile::tempdir().unwrap();
    write_and_close(used.path(), &[("/a", 5)]).await;
    assert!(matches!(init(used.path(), &[]), Err(StoreError::AlreadyInitialised { .. })));
    fs::remove_file(used.path().join("KEYING")).unwrap();
    assert!(matches!(init(used.path(), &[]), Err(StoreError::AlreadyInitialised { .. })));
    assert_eq!(open(used.path()).table().get("/a"), Some(5), "nothing was changed");

    let held = tempfile::tempdir().unwrap();
    let store = open(held.path());
    assert!(matches!(init(held.path(), &[]), Err(StoreError::Locked { .. })));
    store.close().await.unwrap();
}

#[tokio::test]
async fn a_dir_an_earlier_build_started_opens_without_an_init_marker() {
    let dir = tempfile::tempdir().unwrap();
    write_and_close(dir.path(), &[("/a", 5)]).await;
    assert!(!dir.path().join("INIT").exists());
    check_initialised(dir.path()).unwrap();
    assert_eq!(inspect(dir.path()).unwrap().init_floors, None);
    // Any one of KEYING, a segment or a snapshot shows a store ran there.
    for name in ["KEYING".to_owned(), segment_name(3), snapshot_name(3)] {
        let only = tempfile::tempdir().unwrap();
        fs::write(only.path().join(&name), "").unwrap();
        check_initialised(only.path()).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// Deletes every segment and snapshot of `dir`, as a clean-up of `*.log` or a backup that
/// skipped them would.
fn lose_the_log(dir: &std::path::Path) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".log") || name.ends_with(".snap") {
            fs::remove_file(&path).unwrap();
        }
    }
}

fn log_missing(dir: &std::path::Path) -> (String, String) {
    // `fencegate inspect` first: it only reads.
    let inspected = inspect(dir).map(|found| found.table.len());
    let opened = FileStore::open(dir, tests::options(4096)).map(|store| store.table().len());
    match (inspected, opened) {
        (Err(e @ StoreError::LogMissing { .. }), Err(StoreError::LogMissing { evidence, .. })) => {
            (evidence, e.to_string())
        }
        other => panic!("{}: {other:?}", dir.display()),
    }
}

#[tokio::test]
async fn a_dir_whose_log_was_lost_is_refused_naming_what_shows_it_had_one() {
    // Initialised with a floor, never run: the floor is in segment 1 only.
    let dir = tempfile::tempdir().unwrap();
    init(dir.path(), &[("/", 1000)]).unwrap();
    lose_the_log(dir.path());
    check_initialised(dir.path()).unwrap();
    let (evidence, msg) = log_missing(dir.path());
    assert!(evidence.contains("INIT") && evidence.contains("floor 1000 at /"), "{evidence}");
    let d = dir.path().display();
    assert!(msg.contains(&format!("data dir {d} has no segment and no snapshot")), "{msg}");
    assert!(msg.contains("--floor <that token>") && msg.contains("Recovering from a lost volume"), "{msg}");
    assert!(!dir.path().join(segment_name(1)).exists(), "the refusal made no log");

    // The same after a run: KEYING and INIT with a floor.
    let ran = tempfile::tempdir().unwrap();
    init(ran.path(), &[("/", 1000)]).unwrap();
    write_and_close(ran.path(), &[("/a", 1001)]).await;
    lose_the_log(ran.path());
    let (evidence, _) = log_missing(ran.path());
    assert!(evidence.contains("KEYING") && evidence.contains("INIT"), "{evidence}");

    // Used and compacted (snapshots and segments both gone), initialised with no floor.
    let used = tempfile::tempdir().unwrap();
    init(used.path(), &[]).unwrap();
    let store = FileStore::open(used.path(), tests::options(4096)).unwrap();
    for i in 0..200u64 {
        advance(&store, &format!("/k/{i:0>40}"), 1 + i).await.unwrap();
    }
    store.close().await.unwrap();
    assert!(fs::read_dir(used.path()).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".snap")));
    lose_the_log(used.path());
    let (evidence, msg) = log_missing(used.path());
    assert!(evidence.contains("KEYING") && !evidence.contains("INIT"), "{evidence}");
    assert!(msg.contains("KEYING"), "{msg}");

    // Started by use, with no INIT: KEYING alone shows the log.
    let old = tempfile::tempdir().unwrap();
    write_and_close(old.path(), &[("/a", 5)]).await;
    fs::remove_file(old.path().join("INIT")).ok();
    lose_the_log(old.path());
    let (evidence, _) = log_missing(old.path());
    assert!(evidence.contains("KEYING"), "{evidence}");
}

#[tokio::test]
async fn keying_is_recorded_only_once_the_log_exists() {
    // A fresh init with no floor holds INIT alone, and opens.
    let dir = tempfile::tempdir().unwrap();
    init(dir.path(), &[]).unwrap();
    let store = FileStore::open(dir.path(), tests::options(4096)).unwrap();
    assert!(dir.path().join("KEYING").exists() && dir.path().join(segment_name(1)).exists());
    store.close().await.unwrap();
    // A mismatch is refused before anything is made.
    let other = tempfile::tempdir().unwrap();
    fs::write(other.path().join("KEYING"), "other rules").unwrap();
    let err = FileStore::open(other.path(), tests::options(4096)).unwrap_err();
    assert!(matches!(err, StoreError::KeyingChanged { .. }), "{err:?}");
    assert!(!other.path().join(segment_name(1)).exists(), "a refused directory got a log");
}
