//! The real binary when the machine runs out of something: a full disk, no file descriptors
//! left, a log reader that stops reading. None of them fails the store or hangs a request.

use crate::common;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::builder::{Deployment, write_config};
use common::process::{BIN, Running, Unread, open_fds};
use common::raw::{fill_until_store_full, put, put_response};
use common::{RawConn, Resp, eventually, poll_until, raw_request};

/// A fenced PUT of `v` with `token` on a kept connection.
async fn put_on(conn: &mut RawConn, path: &str, token: u64) -> Resp {
    conn.send(format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\nContent-Length: 1\r\n\r\nv")).await;
    conn.read_response().await
}

/// Whether this test may mount a tmpfs in a mount namespace of its own (`unshare -rm`: as
/// root, or as a user where user namespaces are allowed). If not, the test fails saying so,
/// unless `FG_SKIP_MOUNT=1` lets it skip.
fn can_mount_tmpfs() -> bool {
    let probe = tempfile::tempdir().unwrap();
    let mount = format!("mount -t tmpfs -o size=64k tmpfs {}", probe.path().display());
    let out = Command::new("unshare").args(["-rm", "sh", "-c", &mount]).output();
    match out {
        Ok(out) if out.status.success() => true,
        out => {
            let why = match out {
                Ok(out) => String::from_utf8_lossy(&out.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            assert!(
                std::env::var("FG_SKIP_MOUNT").as_deref() == Ok("1"),
                "cannot mount a tmpfs in a namespace of its own (`unshare -rm` as root, or with user \
                 namespaces enabled): {why}; set FG_SKIP_MOUNT=1 to skip this test"
            );
            common::skips::skip(&format!("FG_SKIP_MOUNT=1 and it cannot mount a tmpfs: {}", why.trim()));
            false
        }
    }
}

/// Starts the proxy of `d` on a tmpfs of `size` mounted over its data dir and initialised
/// there, in a mount namespace of its own (the proxy alone sees it, and it goes with the
/// proxy). Returns the data dir as the test reaches it: through the proxy's root.
fn start_on_tmpfs(d: &mut Deployment, size: &str) -> PathBuf {
    let data = d.data_dir();
    let shell = format!(
        "mount -t tmpfs -o size={size} tmpfs {data} && {BIN} init --dir {data} >/dev/null && \
         exec {BIN} run --config {config}",
        data = data.display(),
        config = d.config_path.display()
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["-rm", "bash", "-c", &shell]);
    d.running = Some(Running::spawn(cmd));
    PathBuf::from(format!("/proc/{}/root{}", d.proxy().pid(), data.display()))
}

/// Writes whole pages to a new file at `path` until the disk is full; returns the file.
fn fill_disk(path: &Path) -> std::fs::File {
    let mut file = std::fs::File::create_new(path).unwrap();
    let page = [0u8; 4096];
    loop {
        match file.write(&page) {
            // A page at a page-aligned offset is written whole or not at all.
            Ok(n) => assert_eq!(n, page.len()),
            Err(e) if e.raw_os_error() == Some(28) => return file, // ENOSPC
            Err(e) => panic!("filling the disk: {e}"),
        }
    }
}

#[tokio::test]
async fn a_full_disk_refuses_fenced_writes_as_store_full_and_takes_the_same_write_once_there_is_room() {
    if !can_mount_tmpfs() {
        return;
    }
    // Segments far larger than the disk, so that no rotation or snapshot happens: only the log's
    // own room is at stake. Zeros go 64 KiB ahead of the records.
    let extra = "segment_bytes = 1048576\n[admin]\nlisten = \"127.0.0.1:0\"";
    let mut d = Deployment::builder().config_extra(extra).build().await;
    let data = start_on_tmpfs(&mut d, "512k");
    let (addr, admin) = (d.addr(), d.proxy().admin_addr().await);
    let ready = async || raw_request(admin, "GET /readyz HTTP/1.1\r\nHost: x", "").await.status;
    // Room to free later.
    let ballast = data.join("ballast");
    std::fs::write(&ballast, vec![0u8; 128 << 10]).unwrap();

    // Fill the disk with long keys until the same write is refused twice in a row.
    let long = "k".repeat(2000);
    let (acked, path) = fill_until_store_full(addr, |n| format!("/fill/{n:05}/{long}"), 1000).await;
    assert!(!acked.is_empty());
    // A known resource with a higher token needs room for its record too.
    put_response(addr, &acked[0], 6).await.unwrap().assert_refused(503, "store_full");
    // Reads still flow.
    let get = raw_request(addr, &format!("GET {} HTTP/1.1\r\nHost: x", acked[0]), "").await;
    assert_eq!((get.status, get.fencegate_error()), (200, None));
    assert!(d.backend.requests().iter().all(|r| r.path != path), "the refused write was not forwarded");
    d.proxy().wait_for_log("no room on disk for the fence log: fenced writes are refused", 1).await;
    assert!(d.proxy().log_contains("No space left on device"), "a real ENOSPC");

    assert_eq!(ready().await, 503);

    // Room again. A store nobody writes to finds out by itself (an unready pod gets no writes
    // to try with): ready again before any write.
    std::fs::remove_file(&ballast).unwrap();
    d.proxy().wait_for_log("the fence log has room again", 1).await;
    assert_eq!(ready().await, 200);
    // The very write that was refused goes through, on the same process.
    assert_eq!(put(addr, &path, 5).await, 200, "the store was not failed");
    assert_eq!(put(addr, &acked[0], 6).await, 200);
    assert_eq!(d.proxy().log_lines("no room on disk for the fence log: fenced writes are refused").len(), 1);
    assert!(!d.proxy().log_contains("refusing every fenced write"), "the store did not fail");
    for path in &acked[1..] {
        assert_eq!(put(addr, path, 5).await, 409, "{}...: an acknowledged advance was lost", &path[..12]);
    }
}

#[tokio::test]
async fn a_rotation_that_cannot_make_the_next_segment_keeps_taking_writes_and_retries_once_there_is_room() {
    if !can_mount_tmpfs() {
        return;
    }
    // Segments of 128 KiB; zeros go 8 KiB (two pages) ahead, in the current segment and in the
    // next one, made ahead.
    let mut d = Deployment::builder().config_extra("segment_bytes = 131072").build().await;
    let data = start_on_tmpfs(&mut d, "1m");
    let addr = d.addr();
    let segment = |seq: u64| data.join(format!("segment-{seq:020}.log"));
    // Keys of 1 KB: a write's batch (its advance, the previous write's answer, a commit
    // marker) takes about 2 KB.
    let long = "k".repeat(1000);
    let mut acked = Vec::new();
    let write = async |acked: &mut Vec<String>| {
        let path = format!("/r/{:05}/{long}", acked.len());
        let r = put_response(addr, &path, 5).await.unwrap();
        assert_eq!((r.status, r.fencegate_error()), (200, None), "write {}: {:?}", acked.len(), r.body);
        acked.push(path);
    };
    // Until the first segment's zeros reach its end: the records are then less than one 8 KiB
    // stretch short of it, and no rotation has happened (that needs records past the end).
    while std::fs::metadata(segment(1)).unwrap().len() < 128 << 10 {
        write(&mut acked).await;
    }
    assert!(!segment(2).exists());
    // The disk full, but for one page: enough for the records to cross the segment's end
    // (room made a page at a time when two cannot be had), not for the next segment ahead.
    let ballast = fill_disk(&data.join("ballast"));
    ballast.set_len(ballast.metadata().unwrap().len() - 4096).unwrap();
    while !segment(2).exists() {
        write(&mut acked).await;
        assert!(acked.len() < 200, "no rotation");
    }
    d.proxy().wait_for_log("cannot make the next log segment ahead; the current one grows", 1).await;
    assert!(d.proxy().log_lines("cannot make the next log segment ahead")[0].contains("No space left on device"));
    // The rotation went on without it: the new segment was made ahead at the previous one, so
    // writes go into the room it already has.
    for _ in 0..2 {
        write(&mut acked).await;
    }

    // Room again: the next rotation check, once the records reach the segment's end, makes
    // the next segment ahead and rotates into it.
    drop(ballast);
    std::fs::remove_file(data.join("ballast")).unwrap();
    let proxy = d.proxy();
    eventually("the next log segment is made ahead again", async || {
        write(&mut acked).await;
        proxy.log_contains("the next log segment is made ahead again")
    })
    .await;
    poll_until("the rotation into segment 3", || segment(3).exists()).await;
    assert_eq!(proxy.log_lines("cannot make the next log segment ahead").len(), 1, "said once");
    assert!(!proxy.log_contains("refusing every fenced write"), "the store did not fail");
    for path in &acked {
        assert_eq!(put(addr, path, 5).await, 409, "{}...: an acknowledged advance was lost", &path[..10]);
    }
}

/// A fenced write to a new resource with a token above all so far, which must be accepted;
/// `acked` gains it.
async fn next_write(conn: &mut RawConn, acked: &mut HashMap<String, u64>) {
    let token = acked.len() as u64 + 1;
    let path = format!("/f/{token}");
    let r = put_on(conn, &path, token).await;
    assert_eq!((r.status, r.fencegate_error()), (200, None), "write {token}: {:?}", r.body);
    acked.insert(path, token);
}

/// The descriptor limit of the proxy in the rotation test: low, so that clients can take
/// every descriptor it has.
const FD_LIMIT: u32 = 64;

#[tokio::test]
async fn rotations_without_a_file_descriptor_left_keep_accepting_writes_and_lose_nothing() {
    // Tiny segments: a rotation every few dozen writes. Idle connections are not closed for
    // waiting while the test holds them.
    let mut d = Deployment::builder()
        .config_extra("segment_bytes = 4096\n[limits]\nheader_read_timeout = \"5m\"\nkeepalive_timeout = \"5m\"")
        .build()
        .await;
    // bash's `ulimit -n` sets the soft and the hard limit, so the proxy cannot raise it.
    let (pid, addr) = {
        let p = d.start_in_shell(&format!("ulimit -n {FD_LIMIT}"));
        (p.pid(), p.addr)
    };
    let mut acked = HashMap::new();
    let mut conn = RawConn::open(addr).await;
    // One write first, so that a backend connection is pooled for the others.
    next_write(&mut conn, &mut acked).await;

    // Idle clients take every descriptor left; those past the limit wait in the accept queue.
    let mut idle = Vec::new();
    for _ in 0..FD_LIMIT {
        idle.push(RawConn::open(addr).await);
    }
    // The limit bounds descriptor numbers (a test runner may pass down some above it).
    let taken = || open_fds(pid).iter().filter(|&&fd| fd < FD_LIMIT).count();
    poll_until("the proxy holds every descriptor it may", || taken() == FD_LIMIT as usize).await;
    d.proxy().wait_for_log("accept failed", 1).await;

    // Enough writes for several rotations. Each puts the next segment, made ahead, in place,
    // and makes the one after it in the descriptor that closing the full one gave back.
    let data = d.data_dir();
    let segments = || {
        let names = std::fs::read_dir(&data).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap());
        names.filter(|n| n.starts_with("segment-") && n.ends_with(".log")).count()
    };
    let before = segments();
    for _ in 0..300 {
        next_write(&mut conn, &mut acked).await;
    }
    assert_eq!(taken(), FD_LIMIT as usize, "still no descriptor left");
    // The exhaustion was real: the snapshot each rotation asks for found no descriptor, so
    // every segment is kept.
    d.proxy().wait_for_log("snapshot failed", 1).await;
    assert!(d.proxy().log_lines("snapshot failed")[0].contains("Too many open files"));
    // Should another thread take the descriptor between the close and the create (the accept
    // loop retrying), the next segment is not made, and the current one grows instead.
    let deferred = d.proxy().log_contains("cannot make the next log segment ahead");
    assert!(segments() >= before + 3 || deferred, "{} segments, from {before}: no rotations", segments());
    assert!(!d.proxy().log_contains("refusing every fenced write"), "the store did not fail");

    // Descriptors free again: the next rotation's snapshot is written (and a next segment that
    // could not be made ahead is made).
    drop(idle);
    let proxy = d.proxy();
    eventually("a snapshot is written", async || {
        next_write(&mut conn, &mut acked).await;
        proxy.log_contains("snapshot written")
            && (!deferred || proxy.log_contains("the next log segment is made ahead again"))
    })
    .await;
    drop(conn);

    let addr = d.restart().addr;
    let mut conn = RawConn::open(addr).await;
    for (path, token) in &acked {
        let r = put_on(&mut conn, path, *token).await;
        assert_eq!((r.status, r.fencegate_error()), (409, Some("stale_token")), "{path}: token {token} was lost");
    }
}

#[tokio::test]
async fn a_log_reader_that_stops_reading_never_holds_up_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let backend = fencegate::demo::MemBackend::start().await.unwrap();
    // A queue of 16 lines, and an admin API for the count of the lines dropped.
    let config =
        write_config(dir.path(), &backend.url(), "[log]\nbuffer_lines = 16\n[admin]\nlisten = \"127.0.0.1:0\"");
    // Every resource starts at max_seen 1000, so a write with token 1 to any path is refused as
    // stale, logged with its (long) path: one line a resource, however many per second.
    fencegate::app::init_data_dir(&dir.path().join("data"), 1000).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "--config"]).arg(&config);
    let proxy = Unread::spawn(cmd);

    // Far more log than the pipe (64 KiB) and the queue hold: 1,000 lines of over 1 KB each.
    let long = "p".repeat(1000);
    let mut conn = RawConn::open(proxy.addr).await;
    for i in 0..1000 {
        let path = format!("/r/{i}/{long}");
        // A request held up by the log would hang: `RawConn` gives up after its DEADLINE.
        put_on(&mut conn, &path, 1).await.assert_refused(409, "stale_token");
    }
    let metrics = raw_request(proxy.admin, "GET /metrics HTTP/1.1\r\nHost: x", "").await;
    let text = String::from_utf8_lossy(&metrics.body);
    let dropped: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("fencegate_log_lines_dropped_total "))
        .unwrap_or_else(|| panic!("no fencegate_log_lines_dropped_total in\n{text}"))
        .trim()
        .parse()
        .unwrap();
    assert!(dropped > 0, "lines that did not fit were dropped and counted:\n{text}");
}
