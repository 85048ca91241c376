//! Where `max_seen` starts: a proxy refuses a data dir that is missing or empty (it may be a
//! lost one), `fencegate init` makes one (with a floor after a loss), and a directory an
//! earlier build started by use still opens. The binary's `init` is tested in `binary.rs`.

use crate::common;

use common::{Harness, config_for};
use fencegate::app::{Proxy, init_data_dir};
use fencegate::store::StoreError;

/// What opening a proxy on `dir` says.
async fn refusal(dir: &std::path::Path) -> (bool, String) {
    match Proxy::open(config_for("http://127.0.0.1:9", dir)).await {
        Err(fencegate::Error::Store(e @ StoreError::NotInitialised { missing, .. })) => (missing, e.to_string()),
        Err(e) => panic!("{}: refused for another reason: {e}", dir.display()),
        Ok(_) => panic!("{}: opened", dir.display()),
    }
}

#[tokio::test]
async fn a_missing_data_dir_is_refused_not_created() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("data");
    let (missing, msg) = refusal(&dir).await;
    assert!(missing, "{msg}");
    let d = dir.display();
    assert!(msg.contains(&format!("`fencegate init --dir {d}`")), "{msg}");
    assert!(msg.contains(&format!("`fencegate init --dir {d} --floor <that token>`")), "{msg}");
    assert!(!dir.exists(), "the proxy created the data dir");
}

#[tokio::test]
async fn an_empty_data_dir_is_refused_and_left_as_it_was() {
    // A volume's mount point: empty but for lost+found.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("lost+found")).unwrap();
    let (missing, msg) = refusal(dir.path()).await;
    assert!(!missing && msg.contains("holds no fence state") && msg.contains("lock service"), "{msg}");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["lost+found"]);
    // Once initialised, it opens.
    init_data_dir(dir.path(), 0).unwrap();
    Proxy::open(config_for("http://127.0.0.1:9", dir.path())).await.unwrap();
}

#[tokio::test]
async fn after_init_with_a_floor_every_resource_starts_at_it() {
    let mut h = Harness::start_with_floor(500, |_| {}).await;
    h.put("/never/written", 400, "zombie").await.assert_refused(409, "stale_token");
    h.put("/never/written", 500, "equal is not above").await.assert_refused(409, "stale_token");
    let del = h.send("DELETE", "/d/", &[("fencing-token", "450")], "").await;
    del.assert_refused(409, "stale_token");
    assert_eq!(h.put("/never/written", 501, "locked again").await.status, 200);
    assert_eq!(h.put("/another", 501, "another lock's new holder").await.status, 200);
    assert_eq!(h.applied_tokens("/never/written"), [501]);
    // The floor is durable state, not a setting: it holds after a restart.
    h.restart().await;
    h.put("/a/third", 499, "zombie").await.assert_refused(409, "stale_token");
    assert_eq!(h.put("/a/third", 502, "").await.status, 200);
}

#[tokio::test]
async fn init_refuses_a_live_data_dir() {
    let mut h = Harness::start().await;
    assert_eq!(h.put("/a", 900, "").await.status, 200);
    let busy = init_data_dir(h.dir.path(), 1000).unwrap_err();
    assert!(busy.to_string().contains("in use by another fencegate"), "{busy}");
    h.shutdown().await;
    let live = init_data_dir(h.dir.path(), 1000).unwrap_err();
    assert!(live.to_string().contains("already holds fence state"), "{live}");
    h.restart().await;
    assert_eq!(h.proxy.max_seen("/a"), Some(900));
    assert_eq!(h.put("/b", 5, "").await.status, 200, "no floor was added");
}

#[tokio::test]
async fn a_data_dir_an_earlier_build_started_still_opens() {
    let mut h = Harness::start().await;
    assert_eq!(h.put("/a", 42, "").await.status, 200);
    h.shutdown().await;
    // As an earlier build leaves it: LOCK, KEYING and the log, without INIT.
    std::fs::remove_file(h.dir.path().join("INIT")).unwrap();
    assert!(
        std::fs::read_dir(h.dir.path()).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".log"))
    );
    h.restart().await;
    assert_eq!(h.proxy.max_seen("/a"), Some(42));
    h.put("/a", 42, "").await.assert_refused(409, "stale_token");
}

/// Deletes the segments and snapshots of `dir`, as a clean-up of `*.log` or a backup that
/// skipped them would, and leaves `INIT`, `KEYING` and `LOCK`.
fn lose_the_log(dir: &std::path::Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".log") || name.ends_with(".snap") {
            std::fs::remove_file(&path).unwrap();
        }
    }
}

/// What opening a proxy on `dir`, whose log was lost, says.
async fn lost_log(dir: &std::path::Path) -> String {
    match Proxy::open(config_for("http://127.0.0.1:9", dir)).await {
        Err(fencegate::Error::Store(e @ StoreError::LogMissing { .. })) => e.to_string(),
        Err(e) => panic!("{}: refused for another reason: {e}", dir.display()),
        Ok(_) => panic!("{}: opened with its log lost", dir.display()),
    }
}

#[tokio::test]
async fn a_data_dir_that_lost_its_log_is_refused_not_opened_empty() {
    // Initialised with a floor and never run: the floor is in segment 1 only.
    let dir = tempfile::tempdir().unwrap();
    init_data_dir(dir.path(), 1000).unwrap();
    lose_the_log(dir.path());
    let msg = lost_log(dir.path()).await;
    assert!(msg.contains("no segment and no snapshot") && msg.contains("floor 1000 at /"), "{msg}");
    assert!(msg.contains("--floor <that token>") && msg.contains("Recovering from a lost volume"), "{msg}");

    // Used: it served writes, then lost its segments (and snapshots).
    let mut h = Harness::start_with_floor(1000, |_| {}).await;
    assert_eq!(h.put("/acct", 1001, "").await.status, 200);
    h.shutdown().await;
    lose_the_log(h.dir.path());
    let msg = lost_log(h.dir.path()).await;
    assert!(msg.contains("KEYING") && msg.contains("INIT"), "{msg}");
}

#[test]
fn run_exits_naming_the_lost_log() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::builder::write_config(dir.path(), "http://127.0.0.1:9", "");
    let data = dir.path().join("data");
    init_data_dir(&data, 1000).unwrap();
    lose_the_log(&data);
    let mut child = std::process::Command::new(common::process::BIN)
        .args(["run", "--config", config.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A run that opened the directory serves until stopped: give it a minute to exit.
    let mut status = None;
    for _ in 0..600 {
        status = child.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    if status.is_none() {
        child.kill().unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(status.is_some_and(|s| !s.success()), "run started on a lost log: {stderr}");
    assert!(stderr.contains("no segment and no snapshot") && stderr.contains("fencegate init --dir"), "{stderr}");
    // `check` says so before `run` is tried.
    let out = std::process::Command::new(common::process::BIN)
        .args(["check", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("no segment and no snapshot"), "{stderr}");
}
