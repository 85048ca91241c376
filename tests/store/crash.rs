//! Crash and failure tests of the real binary: whatever instant it dies at, and whatever the
//! disk does, no advance that was forwarded is ever forgotten.
//!
//! Each random-kill test runs [`DEFAULT_ROUNDS`] rounds, a few seconds in a local `cargo test`;
//! `FG_CRASH_ROUNDS=N` runs N instead (`.ci/run` sets 50; a soak, hundreds), and
//! `FG_CRASH_SEED=S` replays the kill moments (and the collection writers' choice of writes) of
//! a failed run.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::builder::Deployment;
use common::raw::{fill_until_store_full, put, put_response};
use common::rng::Rng;
use common::webdav::{OP_HEADER, Record, WebDavStub};
use common::{Resp, eventually, poll_until, raw_request, try_raw_request};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Rounds of each random-kill test without `FG_CRASH_ROUNDS`.
const DEFAULT_ROUNDS: u64 = 5;

fn rounds() -> u64 {
    env_u64("FG_CRASH_ROUNDS").unwrap_or(DEFAULT_ROUNDS)
}

#[tokio::test]
async fn sigkill_at_random_moments_never_loses_a_forwarded_advance() {
    let rounds = rounds();
    let seed = env_u64("FG_CRASH_SEED")
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
    let mut rng = Rng::new(seed);
    // Tiny segments, so kills also land in rotations and compactions.
    let mut d =
        Deployment::builder().config_extra("segment_bytes = 4096\n[fence]\nquarantine = \"100ms\"").build().await;
    let resources: Arc<Vec<String>> = Arc::new((0..32).map(|i| format!("/tenant-{}/object-{i}", i % 4)).collect());
    let mut base = 0u64;
    let mut forwarded = 0usize;
    let mut in_flight_at_kill = 0usize;
    let mut highest: HashMap<String, u64> = HashMap::new();
    for round in 0..rounds {
        let addr = d.start().addr;
        // Eight writers, each walking all resources with ever higher tokens.
        let writers: Vec<_> = (0..8u64)
            .map(|w| {
                let resources = Arc::clone(&resources);
                tokio::spawn(async move {
                    for step in 0u64.. {
                        let path = &resources[((step * 8 + w) % resources.len() as u64) as usize];
                        let token = base + 1 + step * 8 + w;
                        // 0: the proxy is gone. A 503 (a resource quarantined after the
                        // previous kill) just moves on to the next resource.
                        if put(addr, path, token).await == 0 {
                            return;
                        }
                    }
                })
            })
            .collect();
        // Random on purpose: where in the writers' work the kill lands.
        tokio::time::sleep(Duration::from_millis(20 + rng.below(300))).await;
        d.kill9();
        for w in writers {
            let _ = w.await; // each stops once the proxy is gone
        }

        // The highest token the backend ever received, per resource, applied or not; the
        // requests are taken as they come, so that a soak of thousands of rounds keeps no
        // record of them all.
        for r in d.backend.take_requests() {
            let e = highest.entry(r.path.clone()).or_default();
            *e = (*e).max(r.token().unwrap());
            forwarded += 1;
        }
        if d.start().log_contains("in flight when fencegate stopped") {
            in_flight_at_kill += 1;
        }
        for (path, max) in &highest {
            let status = put(d.addr(), path, *max).await;
            assert_eq!(status, 409, "seed {seed} round {round}: {path} forgot token {max} (got {status})");
        }
        d.kill9();
        base += 10_000_000;
    }
    eprintln!(
        "{rounds} kill -9 rounds (seed {seed}): {forwarded} writes forwarded in all; \
         {in_flight_at_kill} restarts found writes in flight"
    );
}

#[tokio::test]
async fn sigkill_while_a_write_is_at_the_backend_keeps_its_advance_and_quarantines_the_resource() {
    let mut d = Deployment::builder().config_extra("[fence]\nquarantine = \"1500ms\"").start().await;
    let addr = d.addr();
    // The backend holds the write for 1 s: the proxy dies while it is in flight, and the
    // backend applies it after the new proxy is up.
    let held = tokio::spawn(async move {
        let head = format!("PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 77\r\n{}: 1000", common::DELAY_HEADER);
        raw_request(addr, &head, "v").await
    });
    poll_until("the backend receives the held write", || !d.backend.requests().is_empty()).await;
    d.kill9();
    held.abort();
    let addr = d.start().addr;
    assert_eq!(put(addr, "/doc", 77).await, 409, "the forwarded token's advance survived kill -9");
    // 77 may still be applied: a newer write must not overtake it.
    put_response(addr, "/doc", 78).await.unwrap().assert_refused(503, "resource_quarantined");
    assert!(d.proxy().log_contains("in flight when fencegate stopped"));
    eventually("the resource reopens after its quarantine", async || put(addr, "/doc", 78).await == 200).await;
    let applied: Vec<u64> = d.backend.applied().iter().filter_map(|r| r.token()).collect();
    assert_eq!(applied, [77, 78], "the backend applied them in token order");
}

/// Sets the soft limit on the size of files that process `pid` may write (`None`: none), under
/// the hard limit this test runs with, which it inherited.
fn limit_file_size(pid: u32, soft: Option<u64>) {
    use rustix::process::{Pid, Resource, Rlimit, getrlimit, prlimit};
    let hard = getrlimit(Resource::Fsize).maximum;
    prlimit(Pid::from_raw(pid as i32), Resource::Fsize, Rlimit { current: soft, maximum: hard }).unwrap();
}

#[tokio::test]
async fn no_room_for_the_log_refuses_fenced_writes_as_store_full_until_there_is_and_loses_nothing() {
    let mut d = Deployment::builder().config_extra("[admin]\nlisten = \"127.0.0.1:0\"").build().await;
    // No room: files may not grow past 8 KiB (EFBIG, and the signal that would otherwise kill
    // the process for it is ignored, as it stays across exec). Only the soft limit, so that the
    // test can lift it again.
    let (pid, addr) = {
        let p = d.start_in_shell("trap '' XFSZ; ulimit -S -f 8");
        (p.pid(), p.addr)
    };
    let admin = d.proxy().admin_addr().await;
    // Fill the log until the same write is refused twice in a row.
    let (mut acked, path) = fill_until_store_full(addr, |n| format!("/objects/{n:05}"), 10_000).await;
    assert!(!acked.is_empty());
    // A known resource with a higher token needs room for its record too.
    put_response(addr, &acked[0], 6).await.unwrap().assert_refused(503, "store_full");
    // Reads still flow.
    let get = raw_request(addr, &format!("GET {} HTTP/1.1\r\nHost: x", acked[0]), "").await;
    assert_eq!((get.status, get.fencegate_error()), (200, None));
    let ready = raw_request(admin, "GET /readyz HTTP/1.1\r\nHost: x", "").await;
    assert_eq!(ready.status, 503);
    assert!(ready.json()["problems"][0].as_str().unwrap().starts_with("store full: no room on disk"), "{ready:?}");
    assert!(d.backend.requests().iter().all(|r| r.path != path), "the refused write was not forwarded");

    // Not failed: once there is room, the very write that was refused goes through.
    limit_file_size(pid, None);
    assert_eq!(put(addr, &path, 5).await, 200);
    // Logged after every refusal: once it is in, so is every line before it.
    d.proxy().wait_for_log("the fence log has room again", 1).await;
    assert_eq!(
        d.proxy().log_lines("no room on disk for the fence log: fenced writes are refused").len(),
        1,
        "said once"
    );
    assert!(!d.proxy().log_contains("refusing every fenced write"), "the store did not fail");
    let ready = raw_request(admin, "GET /readyz HTTP/1.1\r\nHost: x", "").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    acked.push(path);

    let addr = d.restart().addr;
    for path in &acked {
        assert_eq!(put(addr, path, 5).await, 409, "{path}: an acknowledged advance was lost");
    }
    assert_eq!(put(addr, &acked[0], 6).await, 200, "the refused advance of token 6 left nothing behind");
}

#[tokio::test]
async fn a_failed_log_write_closes_fenced_writes_keeps_reads_flowing_and_loses_nothing() {
    let mut d = Deployment::builder().build().await;
    // A write past the file size limit fails with EFBIG; the signal that would otherwise kill
    // the process for it is ignored, as it stays across exec.
    let (pid, addr) = {
        let p = d.start_in_shell("trap '' XFSZ");
        (p.pid(), p.addr)
    };
    let mut acked = Vec::new();
    for i in 0..5 {
        let path = format!("/objects/{i}");
        assert_eq!(put(addr, &path, 5).await, 200);
        acked.push(path);
    }
    // The log has written its zeros well ahead of its records, so the next batch needs no new
    // room: it goes into space the file already has.
    let segment = d.data_dir().join("segment-00000000000000000001.log");
    assert!(std::fs::metadata(&segment).unwrap().len() >= 1 << 20, "zeros 1 MiB ahead");
    // The limit applies to the offset a write starts at, not to the file's size: below the
    // 40-byte header, every write of log data fails, inside the file.
    limit_file_size(pid, Some(40));
    let refused_path = "/objects/refused";
    put_response(addr, refused_path, 5).await.unwrap().assert_refused(503, "store_unavailable");
    d.proxy().wait_for_log("refusing every fenced write until fencegate is restarted", 1).await;
    assert!(!d.proxy().log_contains("no room on disk"), "a failed write is not a full disk");
    // Failed for good: what was written since the last sync cannot be trusted to a later one,
    // so even with the limit gone, and for a known resource with a higher token, the store
    // refuses until a restart...
    limit_file_size(pid, None);
    put_response(addr, &acked[0], 6).await.unwrap().assert_refused(503, "store_unavailable");
    put_response(addr, refused_path, 5).await.unwrap().assert_refused(503, "store_unavailable");
    // ...while reads still flow.
    let get = raw_request(addr, &format!("GET {} HTTP/1.1\r\nHost: x", acked[0]), "").await;
    assert_eq!((get.status, get.fencegate_error()), (200, None));
    assert!(d.backend.requests().iter().all(|r| r.path != refused_path), "the failed write was not forwarded");

    let addr = d.restart().addr;
    for path in &acked {
        assert_eq!(put(addr, path, 5).await, 409, "{path}: an acknowledged advance was lost");
    }
    assert_eq!(put(addr, &acked[0], 6).await, 200, "after a restart the store works again");
    d.kill9();
    assert!(d.data_dir().join("LOCK").exists());
}

/// The tree the collection writers work in: nested, so that subtrees hold each other's files,
/// and small, so that writes collide.
const TREE: [&str; 6] = ["/a", "/a/x", "/a/y", "/b", "/b/x", "/c"];

/// The collections at the top of [`TREE`]. A collection is moved or copied only to one of
/// these, so no file ever lies deeper than `/top/name`: the files are at most the nine of
/// `{/a, /b, /c} x {"", /x, /y}`.
const TOP: [&str; 3] = ["/a", "/b", "/c"];

/// Writers at once in the collection test.
const WRITERS: u64 = 6;

/// Store and fence settings of the collection test: tiny segments, so kills also land in
/// rotations and compactions, and a quarantine short enough to wait out in every round.
const COLLECTION_CONFIG: &str = "segment_bytes = 4096\n[fence]\nquarantine = \"200ms\"";

fn pick(rng: &mut Rng, from: &[&'static str]) -> &'static str {
    from[rng.below(from.len() as u64) as usize]
}

/// One random write to [`TREE`]: method, request target, and Destination. Collection
/// DELETEs come with and without the trailing slash.
fn random_write(rng: &mut Rng) -> (&'static str, String, Option<&'static str>) {
    let path = pick(rng, &TREE);
    match rng.below(10) {
        0..4 => ("PUT", path.to_owned(), None),
        4 => ("DELETE", path.to_owned(), None),
        5 => ("DELETE", format!("{path}/"), None),
        n => {
            let method = if n < 8 { "MOVE" } else { "COPY" };
            // A top-level collection goes to another top-level name; a file (nothing lies
            // below `/top/name`) anywhere but onto itself.
            let to: &[&'static str] = if path.matches('/').count() == 1 { &TOP } else { &TREE };
            let dest = loop {
                let d = pick(rng, to);
                if d != path {
                    break d;
                }
            };
            (method, path.to_owned(), Some(dest))
        }
    }
}

/// A fenced write's head, tagged with `op` in [`OP_HEADER`] so that the stub's record of it can
/// be found.
fn write_head(method: &str, target: &str, token: u64, destination: Option<&str>, op: &str) -> String {
    let mut head = format!("{method} {target} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\n{OP_HEADER}: {op}");
    if let Some(dest) = destination {
        head.push_str(&format!("\r\nDestination: {dest}"));
    }
    head
}

/// The collection whose DELETE removes `file`: `/a/` for `/a/x`, `/` for `/a`.
fn parent_collection(file: &str) -> String {
    match file.rfind('/') {
        Some(0) | None => "/".to_owned(),
        Some(i) => format!("{}/", &file[..i]),
    }
}

/// What the collection test saw, for its summary.
#[derive(Debug, Default)]
struct Seen {
    /// Files checked, summed over the rounds.
    files_checked: usize,
    /// ...of which the highest token came from a DELETE, MOVE or COPY, not a PUT of the file:
    /// only a subtree's floor or a Destination's mark refuses a write to the file with it.
    by_collection_writes: usize,
    /// Answers `503 resource_quarantined` waited out.
    quarantined: usize,
    /// Restarts that found writes in flight.
    in_flight_restarts: usize,
}

/// What the recovery check knows of the stub's records, kept across rounds so that a soak of
/// thousands of rounds reads each record once.
#[derive(Debug, Default)]
struct Changes {
    /// Per file, the write with the highest token that changed it.
    highest: BTreeMap<String, Record>,
    /// Records read so far.
    read: usize,
}

impl Changes {
    /// Reads the records the stub has added since the last call.
    fn read(&mut self, stub: &WebDavStub) {
        for r in stub.records_from(self.read) {
            self.read += 1;
            for file in &r.changed {
                let e = self.highest.entry(file.clone()).or_insert_with(|| r.clone());
                if e.token() < r.token() {
                    *e = r.clone();
                }
            }
        }
    }
}

/// Sends `head` until the answer is anything but `503 resource_quarantined` (a write in flight at
/// the kill closes what it touches for `fence.quarantine` after the start), and returns it.
async fn past_quarantine(addr: SocketAddr, head: &str, body: &str, seen: &mut Seen) -> Resp {
    let mut answer = None;
    eventually(&format!("an answer other than resource_quarantined to {head:?}"), async || {
        let r = raw_request(addr, head, body).await;
        if r.status == 503 && r.fencegate_error() == Some("resource_quarantined") {
            seen.quarantined += 1;
            return false;
        }
        answer = Some(r);
        true
    })
    .await;
    answer.unwrap()
}

/// Checks the restarted proxy's keys and floors against every file the stub records as
/// changed: for each file F, with `t` the highest token of an accepted write that changed it
/// (created, replaced or removed it), a `PUT F` and a `DELETE` of F's parent collection with
/// `t` are refused as stale (after any quarantine), and neither reaches the stub. Then a `PUT F`
/// with `above`, a token above everything so far, is applied. Returns what went wrong.
async fn check_recovered(
    d: &Deployment<WebDavStub>,
    label: &str,
    above: u64,
    changes: &mut Changes,
    seen: &mut Seen,
) -> Vec<String> {
    let addr = d.addr();
    changes.read(&d.backend);
    let checked = changes.read;
    let mut problems = Vec::new();
    for (i, (file, by)) in changes.highest.iter().enumerate() {
        let Some(t) = by.token() else {
            problems.push(format!("{file} was changed by {}, which has no token", by.describe()));
            continue;
        };
        seen.files_checked += 1;
        seen.by_collection_writes += usize::from(by.method != "PUT");
        let parent = parent_collection(file);
        for (method, target, body) in [("PUT", file.as_str(), "v"), ("DELETE", parent.as_str(), "")] {
            let head = write_head(method, target, t, None, &format!("check-{label}-{i}"));
            let r = past_quarantine(addr, &head, body, seen).await;
            if (r.status, r.fencegate_error()) != (409, Some("stale_token")) {
                problems.push(format!(
                    "{method} {target} with token {t} was answered {} {:?} ({:?}), not 409 stale_token: \
                     {file} was changed by {} before the kill",
                    r.status,
                    r.fencegate_error(),
                    String::from_utf8_lossy(&r.body),
                    by.describe()
                ));
            }
        }
    }
    let leaked = d
        .backend
        .records_from(checked)
        .into_iter()
        .filter(|r| r.op.as_deref().is_some_and(|op| op.starts_with("check-")));
    problems.extend(leaked.map(|r| format!("a stale check reached the backend: {}", r.describe())));
    // Once its quarantine is over, every file takes a write with a token above all.
    for file in changes.highest.keys() {
        let head = write_head("PUT", file, above, None, &format!("live-{label}"));
        let r = past_quarantine(addr, &head, "v", seen).await;
        if !matches!(r.status, 201 | 204) || r.fencegate_error().is_some() {
            problems
                .push(format!("PUT {file} with token {above}, above every token so far, was answered {}", r.status));
        }
    }
    problems
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collection_writes_survive_kill_9_at_any_moment() {
    let rounds = rounds();
    let seed = env_u64("FG_CRASH_SEED")
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
    let mut rng = Rng::new(seed);
    let stub = WebDavStub::start().await;
    for path in TREE {
        stub.seed(path, "seeded");
    }
    let url = stub.url();
    let mut d = Deployment::builder().config_extra(COLLECTION_CONFIG).build_in_front_of(stub, &url);
    d.start();
    let mut seen = Seen::default();
    let mut changes = Changes::default();
    for round in 0..rounds {
        let base = (round + 1) * 10_000_000;
        let addr = d.addr();
        // Writers mixing PUT with collection DELETE, MOVE and COPY on one small tree, each
        // with ever higher tokens: many overlap, so floors and turns are busy.
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let mut rng = Rng::new(rng.below(u64::MAX) | 1);
                tokio::spawn(async move {
                    for step in 0u64.. {
                        let (method, target, dest) = random_write(&mut rng);
                        let token = base + 1 + step * WRITERS + w;
                        let head = write_head(method, &target, token, dest, &format!("r{round}-w{w}-{step}"));
                        let body = if method == "PUT" { "v" } else { "" };
                        // None: the proxy is gone. Refusals (stale, quarantined, a queue
                        // timeout) just move on to the next write.
                        if try_raw_request(addr, &head, body).await.is_none() {
                            return;
                        }
                    }
                })
            })
            .collect();
        // Random on purpose: where in the writers' work the kill lands.
        tokio::time::sleep(Duration::from_millis(20 + rng.below(300))).await;
        d.kill9();
        for w in writers {
            w.await.unwrap();
        }
        if d.start().log_contains("in flight when fencegate stopped") {
            seen.in_flight_restarts += 1;
        }
        // Whatever the dead proxy had sent is applied and recorded before the check reads it.
        poll_until("the stub has applied every write it received", || d.backend.busy() == 0).await;
        let problems = check_recovered(&d, &format!("r{round}"), base + 5_000_000, &mut changes, &mut seen).await;
        assert!(problems.is_empty(), "seed {seed} round {round}: after kill -9 and restart:\n{}", problems.join("\n"));
    }
    let violations = d.backend.violations();
    assert!(violations.is_empty(), "seed {seed}: overlapping writes at the backend at once: {violations:?}");
    assert!(seen.by_collection_writes > 0, "seed {seed}: no file's last change came from a collection write");
    let records = d.backend.records();
    let collection = records.iter().filter(|r| r.method != "PUT" && !r.changed.is_empty()).count();
    eprintln!(
        "{rounds} kill -9 rounds (seed {seed}): {} writes forwarded, {collection} collection writes that changed \
         files; {} files checked ({} last changed by a collection write); {} restarts found writes in flight, \
         {} quarantined answers waited out",
        records.len(),
        seen.files_checked,
        seen.by_collection_writes,
        seen.in_flight_restarts,
        seen.quarantined
    );
}

/// A known sequence of collection writes, then kill -9 and a restart: the problems
/// [`check_recovered`] finds with `fence_extra` added to the `[fence]` section.
async fn known_sequence_problems(fence_extra: &str) -> Vec<String> {
    let stub = WebDavStub::start().await;
    for path in TREE {
        stub.seed(path, "seeded");
    }
    let url = stub.url();
    let config = format!("{COLLECTION_CONFIG}\n{fence_extra}");
    let mut d = Deployment::builder().config_extra(&config).build_in_front_of(stub, &url);
    let addr = d.start().addr;
    // The DELETE removes /a/x above the PUT's token; the MOVE empties /b and fills /c.
    let writes = [("PUT", "/a/x", None, 1), ("DELETE", "/a/", None, 5), ("MOVE", "/b", Some("/c"), 7)];
    for (i, (method, target, dest, token)) in writes.into_iter().enumerate() {
        let head = write_head(method, target, token, dest, &format!("known-{i}"));
        let r = raw_request(addr, &head, if method == "PUT" { "v" } else { "" }).await;
        // Each replaces what the seeded stub holds.
        assert_eq!((r.status, r.fencegate_error()), (204, None), "{head}");
    }
    d.kill9();
    d.start();
    check_recovered(&d, "known", 1000, &mut Changes::default(), &mut Seen::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_collection_sequence_keeps_its_floors_across_kill_9() {
    let problems = known_sequence_problems("").await;
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// With `fence.subtree_methods = []` the DELETE of /a/ leaves no floor, so after the restart a
/// PUT of /a/x with the DELETE's token reaches the backend, and the check says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recovery_check_catches_a_proxy_that_leaves_no_floors() {
    let problems = known_sequence_problems("subtree_methods = []").await;
    assert!(problems.iter().any(|p| p.starts_with("PUT /a/x with token 5 was answered 2")), "{problems:#?}");
    assert!(problems.iter().any(|p| p.starts_with("a stale check reached the backend: PUT /a/x")), "{problems:#?}");
}

/// A deployment of the real binary in S3 mode in front of `server`.
fn s3_deployment(server: &common::s3::S3Server) -> Deployment<()> {
    let flat = server.kind != "s3s";
    let extra = format!("[s3]\nflat_keys = {flat}");
    let d = Deployment::builder().config_extra(&extra).build_in_front_of((), &server.url);
    let text =
        std::fs::read_to_string(&d.config_path).unwrap().replace("[backend]\n", "[backend]\nprotocol = \"s3\"\n");
    std::fs::write(&d.config_path, text).unwrap();
    d
}

/// Multipart uploads open across `kill -9`: their bindings were durable before their creators
/// heard the ids, so after a restart the upload whose holder was overtaken completes nowhere,
/// and the other one still completes.
async fn uploads_survive_kill_9(server: Option<common::s3::S3Server>) {
    let Some(server) = server else { return };
    let mut d = s3_deployment(&server);
    let state = d.dir.path().join("uploads.json");
    let env = [("FG_S3_STATE", state.to_str().unwrap())];
    let url = format!("http://{}", d.start().addr);
    common::s3::scenario_at("uploads_before_kill", &url, &server, &env).await;
    d.kill9();
    let url = format!("http://{}", d.start().addr);
    common::s3::scenario_at("uploads_after_kill", &url, &server, &env).await;
}

/// Rounds of the random-kill upload test: `FG_S3_CRASH_ROUNDS`, or 3.
fn s3_rounds() -> u64 {
    env_u64("FG_S3_CRASH_ROUNDS").unwrap_or(3)
}

/// Uploads, and writes that overtake them, under way when fencegate is killed at a random
/// moment: after each restart, no upload whose object a newer holder's write was acknowledged
/// for completes (under its key or a decoy), and one nothing overtook still completes.
async fn uploads_survive_kill_9_at_random_moments(server: Option<common::s3::S3Server>) {
    let Some(server) = server else { return };
    let mut d = s3_deployment(&server);
    let config = std::fs::read_to_string(&d.config_path).unwrap() + "\n[fence]\nquarantine = \"1s\"\n";
    std::fs::write(&d.config_path, config).unwrap();
    let seed = env_u64("FG_CRASH_SEED")
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
    let mut rng = Rng::new(seed);
    for round in 0..s3_rounds() {
        let state = d.dir.path().join(format!("journal-{round}.jsonl"));
        let base = ((round + 1) * 100_000).to_string();
        let env = [("FG_S3_STATE", state.to_str().unwrap().to_owned()), ("FG_S3_BASE", base)];
        let url = format!("http://{}", d.start().addr);
        let load = {
            let (url, env) = (url.clone(), env.clone());
            let server = (server.kind, server.url.clone(), server.access_key.clone(), server.secret.clone());
            tokio::task::spawn_blocking(move || {
                std::process::Command::new("python3")
                    .arg(common::s3::CLIENT)
                    .args(["uploads_under_load", server.0, &url, &server.1, &server.2, &server.3])
                    .envs(env)
                    .output()
                    .unwrap()
            })
        };
        // Random on purpose: where in the holders' work the kill lands (boto3 takes about a
        // second to start).
        tokio::time::sleep(Duration::from_millis(1200 + rng.below(1500))).await;
        d.kill9();
        let out = load.await.unwrap();
        assert!(out.status.success(), "seed {seed} round {round}: {}", String::from_utf8_lossy(&out.stderr));
        let url = format!("http://{}", d.start().addr);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let settled = common::s3::scenario_at("uploads_after_load", &url, &server, &env).await;
        eprintln!("{} seed {seed} round {round}: {}", server.kind, settled.trim());
        d.kill9();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_uploads_under_kill_9_at_random_moments_never_complete_once_overtaken() {
    uploads_survive_kill_9_at_random_moments(common::s3::start_moto().await).await;
    uploads_survive_kill_9_at_random_moments(common::s3::start_s3s().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_uploads_in_flight_across_kill_9_complete_only_for_their_holder() {
    uploads_survive_kill_9(common::s3::start_moto().await).await;
    uploads_survive_kill_9(common::s3::start_s3s().await).await;
}
