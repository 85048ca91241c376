//! fencegate with fencing tokens from a real etcd (started by `common::services`): the
//! article's t0–t6 trace with real leases, through the JSON gateway client
//! (`common::etcd`, as in `examples/etcd_lock.rs`) and through `etcdctl lock` with curl
//! (`examples/etcdctl-lock.sh`). The token is the create revision of the holder's lock key;
//! docs/tokens.md says why, and the last tests here show the trap it avoids and the
//! `equal_token = "accept"` tenure.
//!
//! Skipped with a message where etcd is not installed; `FG_REQUIRE_SERVICES=1` makes that a
//! failure (`.ci/run` sets it).

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::builder::Deployment;
use common::etcd::{Gateway, HeldLock};
use common::services::{Group, installed, start_etcd};
use common::wait::DEADLINE;
use common::{Resp, eventually, poll_until, raw_request};
use rustix::process::Signal;
use tokio::task::JoinHandle;

/// The lease of a holder that will stop renewing: etcd's shortest, so that it expires within
/// about two seconds of the last renewal.
const SHORT_LEASE: Duration = Duration::from_secs(2);
/// The lease of a holder that renews for as long as the test runs.
const LONG_LEASE: Duration = Duration::from_secs(10);

/// A lock holder: its lease (renewed by `renew` until that task is aborted), its key and token.
struct Holder {
    lease: i64,
    renew: JoinHandle<()>,
    held: HeldLock,
    /// The create revision of `held.key`.
    token: u64,
}

impl Holder {
    /// The holder stops renewing its lease, as a process does in a long GC pause or a
    /// partition: it still believes it holds the lock and keeps its token.
    fn pause(&self) {
        self.renew.abort();
    }
}

/// Grants a lease of `ttl`, renews it, takes `lock` with it (waiting behind earlier holders)
/// and reads the token: the create revision of the lock's key.
async fn acquire(gw: Gateway, lock: String, ttl: Duration) -> Holder {
    let lease = gw.grant(ttl).await.unwrap();
    let renew = gw.keep_alive(lease, ttl);
    let held = gw.lock(lock.as_bytes(), lease).await.unwrap();
    let token = gw.create_revision(&held.key).await.unwrap().expect("a held lock's key exists");
    Holder { lease, renew, held, token: u64::try_from(token).unwrap() }
}

/// Waits until `n` keys (holder and waiters) are under `lock/`.
async fn wait_queued(gw: &Gateway, lock: &str, n: usize) {
    let prefix = format!("{lock}/");
    let what = format!("{n} keys under {prefix}");
    eventually(&what, async || gw.prefixed(prefix.as_bytes()).await.unwrap().len() == n).await;
}

/// t1–t3 of the trace: B queues behind A, A stops renewing, its lease expires (its key goes),
/// and B holds the lock. Returns B.
async fn lose_lock_to_next_holder(gw: &Gateway, lock: &str, a: &Holder) -> Holder {
    let b = tokio::spawn(acquire(gw.clone(), lock.to_owned(), LONG_LEASE));
    wait_queued(gw, lock, 2).await;
    a.pause();
    let a_key = String::from_utf8_lossy(&a.held.key).into_owned();
    eventually(&format!("A's lease expires and its key {a_key} goes"), async || {
        gw.create_revision(&a.held.key).await.unwrap().is_none()
    })
    .await;
    let b = tokio::time::timeout(DEADLINE, b).await.expect("B holds the lock once A's key is gone").unwrap();
    assert!(b.token > a.token, "B's token {} is above A's {}", b.token, a.token);
    b
}

/// A fenced PUT of `body` to `path` with `token`, on its own connection.
async fn put(addr: std::net::SocketAddr, path: &str, token: u64, body: &str) -> Resp {
    raw_request(addr, &format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}"), body).await
}

/// Asserts the 409 fencegate gives a stale token, naming `token` and `max_seen`.
fn assert_stale(r: &Resp, token: u64, max_seen: u64) {
    r.assert_refused(409, "stale_token");
    let body = r.json();
    assert_eq!((body["token"].as_u64(), body["max_seen"].as_u64()), (Some(token), Some(max_seen)), "{body}");
}

/// Sends the zombie's write straight to the backend, skipping fencegate, and checks the
/// backend takes it: so the 409 through fencegate was fencegate's check and nothing else.
async fn backend_alone_would_take(d: &Deployment, path: &str, token: u64, body: &str) {
    let r = put(d.backend.addr(), path, token, body).await;
    assert_eq!(r.status, 200, "the backend does no fencing of its own: {:?}", r.body);
    assert_eq!(d.backend.object(path).as_deref(), Some(body.as_bytes()), "the zombie's write would have landed");
}

/// The max_seen the admin API reports for `key`.
async fn max_seen(admin: std::net::SocketAddr, key: &str) -> Option<u64> {
    let r = raw_request(admin, &format!("GET /fences{key} HTTP/1.1\r\nHost: x"), "").await;
    r.json()["max_seen"].as_u64()
}

#[tokio::test]
async fn a_holder_whose_lease_expired_is_fenced_with_create_revisions_over_the_gateway() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let d = Deployment::builder().config_extra("[admin]\nlisten = \"127.0.0.1:0\"").start().await;
    let admin = d.proxy().admin_addr().await;
    let path = "/accounts/42";

    // t0: A takes the lock and writes.
    let a = acquire(gw.clone(), "acct-42".into(), SHORT_LEASE).await;
    assert_eq!(put(d.addr(), path, a.token, "balance=100 (A)").await.status, 200);
    // t1–t3: A pauses, its lease expires, B (queued behind it) holds the lock.
    let b = lose_lock_to_next_holder(&gw, "acct-42", &a).await;
    // t4: B writes.
    assert_eq!(put(d.addr(), path, b.token, "balance=200 (B)").await.status, 200);
    assert_eq!(max_seen(admin, path).await, Some(b.token));
    // t5–t6: A wakes up, still believing it holds the lock, and writes with its old token.
    let r = put(d.addr(), path, a.token, "balance=50 (A, the zombie)").await;
    assert_stale(&r, a.token, b.token);

    assert_eq!(d.backend.object(path).as_deref(), Some(&b"balance=200 (B)"[..]));
    let applied: Vec<u64> = d.backend.applied().iter().filter_map(|r| r.token()).collect();
    assert_eq!(applied, [a.token, b.token]);
    backend_alone_would_take(&d, path, a.token, "balance=50 (A, the zombie)").await;
    gw.unlock(&b.held).await.unwrap();
    gw.revoke(b.lease).await.unwrap();
}

/// Holder A under `etcdctl lock`: reads its token as examples/etcdctl-lock.sh does, writes,
/// then stands for a paused process (it polls for the file `wake` while the test has stopped
/// its etcdctl), and writes again with the same token. Each write leaves `NAME.status`,
/// `NAME.headers` and `NAME.body` in `$OUT`.
const HOLDER_A: &str = r#"
set -eu
token=$(etcdctl get "$ETCD_LOCK_KEY" -w fields | sed -n 's/^"CreateRevision" : //p')
printf '%s\n' "$ETCD_LOCK_KEY" > "$OUT/a.key"
printf '%s\n' "$token" > "$OUT/a.token"
put() {
  curl -sS -o "$OUT/$1.body" -D "$OUT/$1.headers" -w '%{http_code}' -X PUT "$URL" \
    -H "Fencing-Token: $token" --data-binary "$2" > "$OUT/$1.tmp"
  mv "$OUT/$1.tmp" "$OUT/$1.status"
}
put a1 'balance=100 (A)'
n=0
while [ ! -e "$OUT/wake" ]; do n=$((n + 1)); [ "$n" -lt 1200 ] || exit 3; sleep 0.05; done
put a2 'balance=50 (A, the zombie)'
"#;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Waits until A's write `name` has been answered (`dir/NAME.status` exists). Panics with A's
/// output if A ends without it.
async fn answered(a: &mut Group, dir: &Path, name: &str) {
    let status = dir.join(format!("{name}.status"));
    poll_until(&format!("A's write {name} is answered"), || status.exists() || a.exited().is_some()).await;
    assert!(status.exists(), "A ended: {:?}\n{}", a.exited(), read(&dir.join("a.out")));
}

/// `cmd` with its output in `dir/NAME.out`.
fn logged(mut cmd: Command, dir: &Path, name: &str) -> Command {
    let out = std::fs::File::create(dir.join(format!("{name}.out"))).unwrap();
    cmd.stdin(Stdio::null()).stdout(out.try_clone().unwrap()).stderr(out);
    cmd
}

#[tokio::test]
async fn a_stopped_etcdctl_lock_holder_is_fenced_when_holders_write_with_curl() {
    if !installed("curl", "curl", &["/usr/bin/curl"]) {
        return;
    }
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let d = Deployment::builder().start().await;
    let path = "/accounts/42";
    let url = format!("http://{}{path}", d.addr());
    let out = tempfile::tempdir().unwrap();
    let dir = out.path();

    // t0: A takes the lock with a 2 s session lease and writes.
    let mut a = etcd.etcdctl();
    a.args(["lock", "--ttl", "2", "acct-42", "--", "sh", "-c", HOLDER_A]).env("OUT", dir).env("URL", &url);
    let mut a = Group::spawn("etcdctl lock (A)", logged(a, dir, "a"));
    answered(&mut a, dir, "a1").await;
    assert_eq!(read(&dir.join("a1.status")), "200", "{}", read(&dir.join("a.out")));
    let a_token: u64 = read(&dir.join("a.token")).trim().parse().unwrap();
    let a_key = read(&dir.join("a.key")).trim().to_owned();

    // B queues behind A, through the example script.
    let mut b = Command::new("sh");
    b.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/etcdctl-lock.sh"))
        .args(["acct-42", &url, "--data-binary", "balance=200 (B)"])
        .envs(etcd.client_env());
    let mut b = Group::spawn("etcdctl-lock.sh (B)", logged(b, dir, "b"));
    wait_queued(&gw, "acct-42", 2).await;

    // t1: A pauses: SIGSTOP of its etcdctl stops the lease's keep-alive (its command runs on).
    a.signal_leader(Signal::STOP);
    // t2–t4: A's lease expires, B holds the lock and writes.
    let status = b.wait().await;
    let b_out = read(&dir.join("b.out"));
    assert!(status.success(), "B: {status}: {b_out}");
    assert!(gw.create_revision(a_key.as_bytes()).await.unwrap().is_none(), "A's key {a_key} went with its lease");
    let applied: Vec<u64> = d.backend.applied().iter().filter_map(|r| r.token()).collect();
    let [first, b_token] = applied[..] else { panic!("two writes applied: {applied:?}; B: {b_out}") };
    assert_eq!(first, a_token);
    assert!(b_token > a_token, "B's token {b_token} is above A's {a_token}");
    assert!(b_out.contains(&format!("fencing token {b_token}")), "{b_out}");

    // t5–t6: A wakes up and writes with its old token.
    std::fs::write(dir.join("wake"), "").unwrap();
    answered(&mut a, dir, "a2").await;
    assert_eq!(read(&dir.join("a2.status")), "409", "{}", read(&dir.join("a.out")));
    let headers = read(&dir.join("a2.headers")).to_ascii_lowercase();
    assert!(headers.contains("fencegate-error: stale_token"), "{headers}");
    let body: serde_json::Value = serde_json::from_str(&read(&dir.join("a2.body"))).unwrap();
    assert_eq!((body["token"].as_u64(), body["max_seen"].as_u64()), (Some(a_token), Some(b_token)), "{body}");

    assert_eq!(d.backend.object(path).as_deref(), Some(&b"balance=200 (B)"[..]));
    backend_alone_would_take(&d, path, a_token, "balance=50 (A, the zombie)").await;
    drop(a); // SIGKILL to A's whole group, stopped etcdctl included.
}

#[tokio::test]
async fn the_acquire_revision_of_a_queued_holder_can_pass_the_next_holders_create_revision() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let d = Deployment::builder().start().await;

    // X holds the lock; A and then B queue behind it.
    let x = acquire(gw.clone(), "mix".into(), LONG_LEASE).await;
    let a = tokio::spawn(acquire(gw.clone(), "mix".into(), LONG_LEASE));
    wait_queued(&gw, "mix", 2).await;
    let b = tokio::spawn(acquire(gw.clone(), "mix".into(), LONG_LEASE));
    wait_queued(&gw, "mix", 3).await;
    // Any write anywhere in the cluster moves the revision on.
    gw.put(b"unrelated", b"1").await.unwrap();
    gw.unlock(&x.held).await.unwrap();
    let a = tokio::time::timeout(DEADLINE, a).await.expect("A holds the lock once X let go").unwrap();

    // B's key was made before X let go, so B's create revision is below the revision at which
    // A acquired (what `etcdctl lock` exports as ETCD_LOCK_REV).
    let waiting = gw.prefixed(b"mix/").await.unwrap();
    let b_create = waiting.iter().find(|kv| kv.key != a.held.key).expect("B's key").create_revision as u64;
    let a_acquired = a.held.acquired_revision as u64;
    assert!(a.token < b_create && b_create < a_acquired, "A: create {}, acquired {a_acquired}; B: {b_create}", a.token);

    // A writes under both conventions; B, the next legitimate holder, then uses create revisions.
    assert_eq!(put(d.addr(), "/mixed", a_acquired, "A").await.status, 200);
    assert_eq!(put(d.addr(), "/consistent", a.token, "A").await.status, 200);
    gw.unlock(&a.held).await.unwrap();
    let b = tokio::time::timeout(DEADLINE, b).await.expect("B holds the lock once A let go").unwrap();
    assert_eq!(b.token, b_create);
    // Mixed conventions: the legitimate holder is refused.
    assert_stale(&put(d.addr(), "/mixed", b.token, "B").await, b.token, a_acquired);
    // One convention (create revisions): it writes.
    assert_eq!(put(d.addr(), "/consistent", b.token, "B").await.status, 200);
}

#[tokio::test]
async fn with_equal_token_accept_a_holder_writes_all_through_its_tenure_and_the_zombie_is_still_refused() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let d = Deployment::builder()
        .config_extra("[[fence.rules]]\nprefix = \"/tenure/\"\nequal_token = \"accept\"")
        .start()
        .await;

    let a = acquire(gw.clone(), "tenure".into(), SHORT_LEASE).await;
    for n in 1..=3 {
        let r = put(d.addr(), "/tenure/doc", a.token, &format!("A{n}")).await;
        assert_eq!(r.status, 200, "write {n} of A's tenure: {:?}", r.body);
    }
    // Outside the rule, equal is stale (the default), and the refusal names the setting.
    assert_eq!(put(d.addr(), "/once/doc", a.token, "A1").await.status, 200);
    let r = put(d.addr(), "/once/doc", a.token, "A2").await;
    assert_stale(&r, a.token, a.token);
    let message = r.json()["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("equal_token"), "the 409 for a token equal to max_seen names the setting: {message}");

    let b = lose_lock_to_next_holder(&gw, "tenure", &a).await;
    for n in 1..=2 {
        assert_eq!(put(d.addr(), "/tenure/doc", b.token, &format!("B{n}")).await.status, 200, "write {n} of B's");
    }
    assert_stale(&put(d.addr(), "/tenure/doc", a.token, "A, the zombie").await, a.token, b.token);

    assert_eq!(d.backend.object("/tenure/doc").as_deref(), Some(&b"B2"[..]));
    let applied: Vec<u64> =
        d.backend.applied().iter().filter(|r| r.path == "/tenure/doc").filter_map(|r| r.token()).collect();
    assert_eq!(applied, [a.token, a.token, a.token, b.token, b.token]);
    backend_alone_would_take(&d, "/tenure/doc", a.token, "A, the zombie").await;
}
