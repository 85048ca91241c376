//! Tokens verified against a real etcd's locks (`verify = "etcd"`): only the current holder's
//! create revision passes, a zombie is refused as soon as fencegate's view has seen its key go
//! (before any newer write), made-up numbers never pass, the write path sends etcd nothing,
//! and a stalled etcd turns verified writes away until it is back.
//!
//! Skipped with a message where etcd is not installed; `FG_REQUIRE_SERVICES=1` makes that a
//! failure (`.ci/run` sets it).

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::builder::Deployment;
use common::etcd::{Gateway, HeldLock};
use common::services::{Etcd, start_etcd};
use common::wait::DEADLINE;
use common::{Resp, eventually, raw_request};
use rustix::process::{Pid, Signal, kill_process};
use tokio::task::JoinHandle;

const MAX_LAG: Duration = Duration::from_millis(800);
const LOCK: &str = "/locks/accounts/42";
const TOKEN: &str = "an-admin-token-of-some-length";

/// A proxy whose `/accounts/` keys are verified against the locks `/locks/accounts/{2}`.
async fn deployment(etcd: &Etcd) -> (Deployment, SocketAddr) {
    deployment_with(etcd, "").await
}

/// The same with more `[verify]` settings.
async fn deployment_with(etcd: &Etcd, verify: &str) -> (Deployment, SocketAddr) {
    let extra = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\n[etcd]\nendpoints = [\"{}\"]\n[verify]\nmax_lag = \"{}ms\"\n{verify}\
         [[fence.rules]]\nprefix = \"/accounts/\"\nverify = \"etcd\"\nlock = \"/locks/accounts/{{2}}\"\n",
        etcd.url(),
        MAX_LAG.as_millis()
    );
    let d = Deployment::builder().config_extra(&extra).start().await;
    let admin = d.proxy().admin_addr().await;
    (d, admin)
}

struct Holder {
    lease: i64,
    renew: JoinHandle<()>,
    held: HeldLock,
    token: u64,
}

async fn acquire(gw: Gateway, ttl: Duration) -> Holder {
    let lease = gw.grant(ttl).await.unwrap();
    let renew = gw.keep_alive(lease, ttl);
    let held = gw.lock(LOCK.as_bytes(), lease).await.unwrap();
    let token = gw.create_revision(&held.key).await.unwrap().unwrap();
    Holder { lease, renew, held, token: u64::try_from(token).unwrap() }
}

async fn request(addr: SocketAddr, head: &str) -> Resp {
    raw_request(addr, &format!("{head}\r\nHost: x"), "v").await
}

async fn put(addr: SocketAddr, path: &str, token: u64) -> Resp {
    common::raw::put_response(addr, path, token).await.expect("a complete response")
}

/// The holder of `LOCK` as the proxy's admin API shows it, once its view is fresh.
async fn holder_seen(admin: SocketAddr) -> Option<Option<u64>> {
    let r =
        raw_request(admin, &format!("GET /locks{LOCK} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"), "").await;
    (r.status == 200).then(|| r.json()["holder"].as_u64())
}

async fn wait_holder(admin: SocketAddr, holder: Option<u64>) {
    eventually(&format!("the proxy sees {holder:?} hold {LOCK}"), async || holder_seen(admin).await == Some(holder))
        .await;
}

/// Requests etcd has served that a lookup of a lock would make (range reads, transactions).
async fn lookups(etcd: &Etcd) -> u64 {
    let r = raw_request(etcd.endpoint, "GET /metrics HTTP/1.1\r\nHost: etcd", "").await;
    let text = String::from_utf8_lossy(&r.body).into_owned();
    text.lines()
        .filter(|l| l.starts_with("grpc_server_started_total{"))
        .filter(|l| l.contains("grpc_method=\"Range\"") || l.contains("grpc_method=\"Txn\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// `fencegate_lock_view_age_seconds` of the view of `/locks/accounts/`.
async fn view_age(admin: SocketAddr) -> f64 {
    let r = raw_request(admin, "GET /metrics HTTP/1.1\r\nHost: x", "").await;
    let text = String::from_utf8_lossy(&r.body).into_owned();
    let line = text.lines().find(|l| l.starts_with("fencegate_lock_view_age_seconds{prefix=\"/locks/accounts/\"}"));
    line.and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("no view age in {text}"))
}

/// A 409 that names the lock and the token, and never the holder's revision (the token that
/// would pass); `_holder` says who holds the lock, for the reader.
fn assert_not_holder(r: &Resp, token: u64, _holder: Option<u64>) {
    r.assert_refused(409, "not_lock_holder");
    let body = r.json();
    assert_eq!((body["lock"].as_str(), body["token"].as_u64()), (Some(LOCK), Some(token)), "{body}");
    assert!(body.get("holder").is_none(), "{body}");
}

#[tokio::test]
async fn only_the_current_holders_create_revision_passes_and_a_zombie_is_refused_before_anyone_writes() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let (d, admin) = deployment(&etcd).await;
    let path = "/accounts/42";
    wait_holder(admin, None).await;
    let r = raw_request(admin, &format!("GET /locks{LOCK} HTTP/1.1\r\nHost: x"), "").await;
    r.assert_refused(401, "unauthorized");

    // Nobody holds the lock: no number passes, the largest neither.
    assert_not_holder(&put(d.addr(), path, u64::MAX).await, u64::MAX, None);

    // A holds it: its create revision passes, again and again (the verified holder alone can
    // present its revision, so a token equal to max_seen passes); anything else does not.
    let a = acquire(gw.clone(), Duration::from_secs(2)).await;
    wait_holder(admin, Some(a.token)).await;
    for _ in 0..2 {
        assert_eq!(put(d.addr(), path, a.token).await.status, 200);
    }
    assert_not_holder(&put(d.addr(), path, u64::MAX).await, u64::MAX, Some(a.token));
    assert_not_holder(&put(d.addr(), path, a.token + 1).await, a.token + 1, Some(a.token));
    // Another lock's resource: A does not hold that one.
    put(d.addr(), "/accounts/43", a.token).await.assert_refused(409, "not_lock_holder");

    // B queues; A pauses, its lease expires and B holds the lock. B has not written.
    let b = tokio::spawn(acquire(gw.clone(), Duration::from_secs(10)));
    eventually("B queues", async || gw.prefixed(format!("{LOCK}/").as_bytes()).await.unwrap().len() == 2).await;
    a.renew.abort();
    let b = tokio::time::timeout(DEADLINE, b).await.expect("B holds the lock once A's lease expires").unwrap();
    assert!(b.token > a.token, "B queued behind A: its create revision is higher");
    wait_holder(admin, Some(b.token)).await;
    // The zombie is refused although its token is max_seen and nobody has written since.
    assert_not_holder(&put(d.addr(), path, a.token).await, a.token, Some(b.token));
    let applied: Vec<u64> = d.backend.applied().iter().filter_map(|r| r.token()).collect();
    assert_eq!(applied, [a.token, a.token], "only A's writes while it held the lock");

    // B writes with the create revision of its key, though it got the lock later (queued).
    assert!(b.held.acquired_revision as u64 > b.token, "B's acquire revision is not its token");
    let before = lookups(&etcd).await;
    for _ in 0..20 {
        assert_eq!(put(d.addr(), path, b.token).await.status, 200);
    }
    assert_eq!(lookups(&etcd).await, before, "20 verified writes made no range read or transaction in etcd");

    // What verification cannot answer is refused as such.
    put(d.addr(), "/accounts/", b.token).await.assert_refused(400, "no_lock_name");
    let r = request(d.addr(), &format!("MOVE {path} HTTP/1.1\r\nFencing-Token: {}\r\nDestination: /other/x", b.token))
        .await;
    r.assert_refused(400, "cross_verify_write");
    // Keys no rule verifies take any token, as before.
    assert_eq!(put(d.addr(), "/other/x", 7).await.status, 200);
    gw.revoke(b.lease).await.unwrap();
    let _ = a.lease;
}

#[tokio::test]
async fn the_passing_token_is_neither_read_from_the_admin_api_nor_guessed() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    // Revisions well past the default burst, so that a walk from 1 has far to go.
    for n in 0..40 {
        gw.put(format!("/filler/{n}").as_bytes(), b"x").await.unwrap();
    }
    let (d, admin) = deployment(&etcd).await;
    let path = "/accounts/42";
    let a = acquire(gw.clone(), Duration::from_secs(30)).await;
    wait_holder(admin, Some(a.token)).await;
    assert_eq!(put(d.addr(), path, a.token).await.status, 200);

    // max_seen is now the holder's revision: the admin API tells it to an operator only.
    let r = raw_request(admin, &format!("GET /fences{path} HTTP/1.1\r\nHost: x"), "").await;
    r.assert_refused(401, "unauthorized");
    assert!(!String::from_utf8_lossy(&r.body).contains(&a.token.to_string()), "{:?}", r.body);
    let r = raw_request(admin, "GET /fences?prefix=/accounts/ HTTP/1.1\r\nHost: x", "").await;
    assert_eq!(r.json()["fences"][0]["withheld"], true, "{:?}", r.body);
    let r = raw_request(admin, &format!("GET /fences{path} HTTP/1.1\r\nHost: x\r\nAuthorization: bearer {TOKEN}"), "")
        .await;
    assert_eq!(r.json()["max_seen"].as_u64(), Some(a.token), "{:?}", r.body);

    // A guesser walking the revisions from 1 is stopped long before the holder's.
    assert!(a.token > 20, "revision {}", a.token);
    let mut refused = 0;
    for guess in 1..a.token {
        let r = put(d.addr(), path, guess).await;
        match r.fencegate_error() {
            Some("not_lock_holder") => refused += 1,
            _ => {
                r.assert_refused(429, "too_many_refusals");
                assert!(r.headers.contains_key("retry-after"));
                break;
            }
        }
    }
    assert_eq!(refused, 10, "verify.client_refusal_burst by default");
    let r = put(d.addr(), path, a.token).await;
    r.assert_refused(429, "too_many_refusals");
    let metrics = raw_request(admin, "GET /metrics HTTP/1.1\r\nHost: x", "").await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(text.contains("fencegate_proofs_limited_total{scope=\"client\"} 2"), "{text}");
    let applied: Vec<u64> = d.backend.applied().iter().filter_map(|r| r.token()).collect();
    assert_eq!(applied, [a.token], "no guess reached the backend");
    gw.revoke(a.lease).await.unwrap();
}

#[tokio::test]
async fn guesses_are_counted_by_lock_not_by_key_and_a_claimed_peer_is_its_client() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let a = acquire(gw.clone(), Duration::from_secs(30)).await;

    // Per lock: keys under one lock share its bucket, whichever key a guess names.
    let per_lock = "client_refusal_burst = 0\nkey_refusal_burst = 3\nkey_refusal_refill = \"1h\"\n";
    let (d, admin) = deployment_with(&etcd, per_lock).await;
    wait_holder(admin, Some(a.token)).await;
    for n in 1..=3 {
        assert_not_holder(&put(d.addr(), &format!("/accounts/42/g{n}"), a.token + n).await, a.token + n, Some(a.token));
    }
    let r = put(d.addr(), "/accounts/42/other", a.token).await;
    r.assert_refused(429, "too_many_refusals");
    assert_eq!(r.json()["lock"], LOCK, "{:?}", r.body);
    put(d.addr(), "/accounts/43", a.token).await.assert_refused(409, "not_lock_holder");
    drop(d);

    // A single instance has no peers: a write that names one is still its client's.
    let per_client = "client_refusal_burst = 3\nclient_refusal_refill = \"1h\"\nkey_refusal_burst = 0\n";
    let (d, admin) = deployment_with(&etcd, per_client).await;
    wait_holder(admin, Some(a.token)).await;
    let forged = |token: u64| {
        format!(
            "PUT /accounts/42 HTTP/1.1\r\nFencing-Token: {token}\r\nFencegate-Forwarded-By: http://x\r\nX-Forwarded-For: 10.9.9.{token}"
        )
    };
    for guess in (1..=3).map(|n| a.token + n) {
        assert_not_holder(&request(d.addr(), &forged(guess)).await, guess, Some(a.token));
    }
    request(d.addr(), &forged(a.token)).await.assert_refused(429, "too_many_refusals");
    assert!(d.backend.applied().is_empty());
    gw.revoke(a.lease).await.unwrap();
}

#[tokio::test]
async fn a_stalled_etcd_turns_verified_writes_away_within_max_lag_and_they_come_back() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let (d, admin) = deployment(&etcd).await;
    let h = acquire(gw.clone(), Duration::from_secs(30)).await;
    wait_holder(admin, Some(h.token)).await;
    assert_eq!(put(d.addr(), "/accounts/42", h.token).await.status, 200);
    assert!(view_age(admin).await.is_finite());

    let pid = Pid::from_raw(etcd.pid() as i32).unwrap();
    kill_process(pid, Signal::STOP).unwrap();
    let stopped = Instant::now();
    // Each write's instant is taken before it is sent, so a slow test cannot stretch the bound:
    // a write accepted was checked after it was sent, against a proof of freshness from before
    // the stop, at most max_lag old.
    let mut last_accepted = stopped;
    loop {
        let sent = Instant::now();
        let r = put(d.addr(), "/accounts/42", h.token).await;
        match r.status {
            200 => last_accepted = sent,
            _ => {
                r.assert_refused(503, "verify_unavailable");
                assert!(r.headers.contains_key("retry-after"));
                break;
            }
        }
        assert!(stopped.elapsed() < DEADLINE, "verified writes still accepted {:?} into the stall", stopped.elapsed());
    }
    let accepted_for = last_accepted - stopped;
    assert!(accepted_for <= MAX_LAG + Duration::from_millis(50), "accepted {accepted_for:?} into the stall");
    let age = view_age(admin).await;
    assert!(age > MAX_LAG.as_secs_f64(), "the metric shows the view's age: {age}");
    // Reads and unverified writes do not need etcd.
    assert_eq!(request(d.addr(), "GET /accounts/42 HTTP/1.1").await.status, 200);
    assert_eq!(put(d.addr(), "/other/x", 1).await.status, 200);

    kill_process(pid, Signal::CONT).unwrap();
    eventually("verified writes are accepted again", async || {
        put(d.addr(), "/accounts/42", h.token).await.status == 200
    })
    .await;
}

/// `config` with a rule verifying `/accounts/` against `etcd` (or against no etcd).
fn with_verified_rule(config: &fencegate::Config, etcd: Option<&str>) -> fencegate::Config {
    let endpoints = etcd.map_or_else(String::new, |url| format!("[etcd]\nendpoints = [\"{url}\"]\n"));
    let with = fencegate::Config::from_toml_str(&format!(
        "[backend]\nurl = \"http://127.0.0.1:9\"\n{endpoints}[verify]\nmax_lag = \"{}ms\"\n\
         [[fence.rules]]\nprefix = \"/accounts/\"\nverify = \"etcd\"\nlock = \"/locks/accounts/{{2}}\"\n",
        MAX_LAG.as_millis()
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let mut config = config.clone();
    (config.etcd, config.verify, config.fence.rules) = (with.etcd, with.verify, with.fence.rules);
    config
}

#[tokio::test]
async fn a_reload_never_starts_verification_without_etcd_and_a_rule_it_drops_stops_its_watch() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    // Started without [etcd], which needs a restart: a reload adding a verified rule and
    // endpoints is refused whole, and the proxy serves on.
    let plain = common::Harness::start().await;
    let err = plain.proxy.reload(with_verified_rule(&plain.config, Some(&etcd.url()))).unwrap_err();
    assert!(err.to_string().contains("[etcd] endpoints"), "{err}");
    assert_eq!(plain.put("/accounts/42", 5, "v").await.status, 200, "still serving, unverified");

    // Started with a verified rule: its view puts a heartbeat under the lock prefix. A reload
    // that drops the rule stops the view, and its heartbeat key goes with its lease, even while
    // a connection accepted before the reload stays open.
    let url = etcd.url();
    let h = common::Harness::start_with(move |c| *c = with_verified_rule(c, Some(&url))).await;
    let verified = h.config.clone();
    let under = || async { gw.prefixed(b"/locks/accounts/").await.unwrap().len() };
    eventually("the view's heartbeat is in etcd", async || under().await == 1).await;
    let mut old = common::RawConn::open(h.addr).await;
    old.send("GET /x HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let _ = old.read_response().await;
    let mut without = verified;
    without.fence.rules.clear();
    h.proxy.reload(without).unwrap();
    eventually("the dropped rule's heartbeat is gone", async || under().await == 0).await;
    drop(old);
}
