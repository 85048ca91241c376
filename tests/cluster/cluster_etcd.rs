//! Several fencegate processes sharing one fence through a real etcd (`store.kind = "etcd"`):
//! the fence outlives its instances, followers send fenced writes to the leader, a new leader
//! quarantines what the old one left in flight, writes fail closed without etcd and come back
//! with it, and `fencegate migrate` copies a file store in without lowering anything.
//!
//! Skipped with a message where etcd is not installed; `FG_REQUIRE_SERVICES=1` makes that a
//! failure (`.ci/run` sets it).

use crate::common;

use std::io::Read;
use std::net::SocketAddr;
use std::process::Stdio;

use common::cluster::{Cluster, PREFIX};
use common::etcd_server::{Etcd, start_etcd};
use common::{Resp, eventually, poll_until, raw_request, try_raw_request};
use fencegate::store::{Mark, MarkBatch, MarkKind, Store, StoreFuture};

async fn put(addr: SocketAddr, path: &str, token: u64) -> Resp {
    common::raw::put_response(addr, path, token).await.expect("a complete response")
}

/// Advances the key `key` to `token` in the store's term now.
fn advance<'a>(store: &'a dyn Store, key: &str, token: u64) -> StoreFuture<'a> {
    store.commit(store.term(), MarkBatch::advance([Mark::key(key)], token))
}

/// Notes that the write that advanced the key `key` to `token` was answered: at once.
fn answered(store: &dyn Store, key: &str, token: u64) {
    drop(store.commit(store.term(), MarkBatch::answered([Mark::key(key)], token)));
}

fn ok(r: &Resp) -> bool {
    (200..300).contains(&r.status)
}

async fn get(addr: SocketAddr, path: &str) -> Resp {
    raw_request(addr, &format!("GET {path} HTTP/1.1\r\nHost: x"), "").await
}

#[tokio::test]
async fn the_fence_in_etcd_outlives_its_instance() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::start(&[etcd.url()], 1, "").await;
    c.wait_leader().await;
    let addr = c.instances[0].addr;
    assert!(ok(&put(addr, "/a", 5).await));
    put(addr, "/a", 5).await.assert_refused(409, "stale_token");
    put(addr, "/a", 4).await.assert_refused(409, "stale_token");
    assert_eq!(c.max_seen_in_etcd("/a").await, Some(5), "committed in etcd before it was forwarded");
    eventually("the answer spends and deletes its flight record", async || !c.in_flight_in_etcd("/a").await).await;
    // Idle, with nothing spent, the leader sends etcd nothing: no sweep goes for a batch that
    // put no record. (A leader that swept for ever moved the batch id every 100 ms.)
    let batch_key = format!("{PREFIX}batch");
    let moved = async || c.gateway.range(batch_key.as_bytes(), None).await.unwrap().0[0].mod_revision;
    let before = moved().await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(moved().await, before, "an idle leader commits nothing");

    c.instances[0].kill9();
    c.instances[0].start();
    c.wait_leader().await;
    put(addr, "/a", 5).await.assert_refused(409, "stale_token");
    assert!(ok(&put(addr, "/a", 6).await));
    assert_eq!(c.applied_tokens("/a"), [5, 6]);
}

#[tokio::test]
async fn an_uninitialised_prefix_is_refused() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let out = std::process::Command::new(common::process::BIN)
        .arg("run")
        .arg("--config")
        .arg(&c.instances[0].config)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it must not start on an empty prefix");
    assert!(err.contains("holds no fence state") && err.contains(PREFIX), "{err}");
    // Once initialised, it starts; a second init is refused.
    c.init().await;
    let config = fencegate::Config::load(&c.instances[0].config, None).unwrap();
    let again = fencegate::app::init_etcd(&config, 0).await.unwrap_err().to_string();
    assert!(again.contains("already holds fence state"), "{again}");
}

#[tokio::test]
async fn followers_send_fenced_writes_to_the_leader() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::start(&[etcd.url()], 3, "").await;
    let leader = c.wait_leader().await;
    let followers: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
    for i in &followers {
        eventually("the follower knows the leader", async || {
            c.instances[*i].proxy().log_contains("following the fence's leader")
        })
        .await;
    }
    // Each instance in turn, tokens climbing: every write is fenced once, by the leader.
    let mut token = 10;
    for round in 0..2 {
        for i in [followers[0], leader, followers[1]] {
            token += 1;
            let r = put(c.instances[i].addr, "/shared", token).await;
            assert!(ok(&r), "round {round} through {i}: {r:?}");
        }
    }
    // A zombie is refused through every instance, the leader's refusal relayed as it is.
    for i in 0..3 {
        let r = put(c.instances[i].addr, "/shared", token).await;
        r.assert_refused(409, "stale_token");
        assert_eq!(r.json()["resource"], "/shared", "{:?}", r.json());
    }
    assert_eq!(c.applied_tokens("/shared"), (11..=token).collect::<Vec<_>>());
    assert_eq!(c.max_seen_in_etcd("/shared").await, Some(token));
    // Reads stay local: a follower serves them even with the leader gone.
    assert_eq!(get(c.instances[followers[0]].addr, "/shared").await.status, 200);
}

#[tokio::test]
async fn a_new_leader_quarantines_what_the_old_one_left_in_flight() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::start(&[etcd.url()], 2, "").await;
    let leader = c.wait_leader().await;
    let other = 1 - leader;
    let addr = c.instances[leader].addr;
    assert!(ok(&put(addr, "/done", 3).await));
    // A write the backend holds for a while: forwarded, not answered, when the leader dies.
    let slow = tokio::spawn(async move {
        try_raw_request(addr, "PUT /slow HTTP/1.1\r\nHost: x\r\nFencing-Token: 10\r\nx-memstore-delay-ms: 3000", "v")
            .await
    });
    eventually("the slow write reaches the backend", async || c.backend.requests().iter().any(|r| r.path == "/slow"))
        .await;
    assert!(c.in_flight_in_etcd("/slow").await, "its marker is committed before it is sent");
    c.instances[leader].kill9();
    let _ = slow.await;

    eventually("the other instance takes over", async || c.instances[other].proxy().log_contains("leading the fence"))
        .await;
    assert!(c.instances[other].proxy().log_contains("in flight when fencegate stopped or stepped down"));
    let addr = c.instances[other].addr;
    // What the old leader committed holds; the resource it left in flight is closed for now.
    put(addr, "/done", 3).await.assert_refused(409, "stale_token");
    put(addr, "/slow", 10).await.assert_refused(409, "stale_token");
    let r = put(addr, "/slow", 11).await;
    if r.status == 503 {
        r.assert_refused(503, "resource_quarantined");
    }
    eventually("the quarantine ends and a newer write passes", async || ok(&put(addr, "/slow", 11).await)).await;
    assert_eq!(c.applied_tokens("/slow"), [10, 11], "the old leader's write first, as its token says");
}

#[tokio::test]
async fn without_etcd_fenced_writes_fail_closed_and_come_back() {
    let Some(mut etcd) = start_etcd().await else { return };
    let c = Cluster::start(&[etcd.url()], 1, "").await;
    c.wait_leader().await;
    let addr = c.instances[0].addr;
    let admin = c.instances[0].proxy().admin_addr().await;
    assert!(ok(&put(addr, "/a", 1).await));

    common::process::signal(etcd.pid(), "STOP");
    eventually("fenced writes are refused while etcd does not answer", async || {
        let r = put(addr, "/a", 2).await;
        r.status == 503 && r.fencegate_error() == Some("store_unavailable")
    })
    .await;
    assert_eq!(get(addr, "/a").await.status, 200, "reads go on");
    let ready = raw_request(admin, "GET /readyz HTTP/1.1\r\nHost: x", "").await;
    assert_eq!(ready.status, 503);
    assert!(String::from_utf8_lossy(&ready.body).contains("store unavailable"), "{ready:?}");

    common::process::signal(etcd.pid(), "CONT");
    eventually("writes come back with etcd", async || ok(&put(addr, "/a", 3).await)).await;
    etcd.restart().await;
    eventually("and after etcd restarts", async || ok(&put(addr, "/b", 4).await)).await;
    put(addr, "/a", 3).await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn migrate_copies_a_file_store_without_lowering_anything() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    // A file store with two keys, one of them ahead in etcd already.
    let dir = c.dir.path().join("old");
    fencegate::app::init_data_dir(&dir, 0).unwrap();
    let keying = fencegate::fence::keys::keying(&Default::default(), &[]);
    {
        let options = fencegate::store::StoreOptions { keying, ..Default::default() };
        let store = fencegate::store::FileStore::open(&dir, options).unwrap();
        advance(&store, "/a", 7).await.unwrap();
        answered(&store, "/a", 7);
        advance(&store, "/b", 9).await.unwrap();
        answered(&store, "/b", 9);
        // A write whose answer never came.
        advance(&store, "/c", 3).await.unwrap();
        store.close().await.unwrap();
    }
    c.init().await;
    c.gateway.put(format!("{PREFIX}k//b").as_bytes(), b"00000000000000000012").await.unwrap();
    // No rules recorded yet: the migration records them, saying how writes in flight are kept,
    // before it writes a flight record that a build without records would not read.
    c.gateway.delete(format!("{PREFIX}rules").as_bytes()).await.unwrap();
    let config = fencegate::Config::load(&c.instances[0].config, None).unwrap();
    let migrated = fencegate::app::migrate_to_etcd(&config, &dir).await.unwrap();
    assert_eq!((migrated.raised, migrated.kept, migrated.in_flight), (2, 1, 1), "{migrated:?}");
    assert_eq!(c.max_seen_in_etcd("/a").await, Some(7));
    assert_eq!(c.max_seen_in_etcd("/b").await, Some(12), "never lowered");
    assert_eq!(c.in_flight_token("/c").await, Some(3), "the write in flight, in a flight record");
    let (kvs, _) = c.gateway.range(format!("{PREFIX}rules").as_bytes(), None).await.unwrap();
    let recorded = kvs.first().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
    assert_eq!(recorded, Some(fencegate::store::etcd::stored_rules(&config.fence_record())));
    // Migrating again changes nothing.
    let again = fencegate::app::migrate_to_etcd(&config, &dir).await.unwrap();
    assert_eq!((again.raised, again.kept), (0, 3));
}

/// Self-fencing: a leader stopped mid-body past its lease wakes with its lease lapsed on its
/// own clock (CLOCK_BOOTTIME runs on while it is stopped), and cuts the write off instead of
/// sending the rest; the new leader has the resource quarantined meanwhile.
#[tokio::test]
async fn a_leader_stopped_past_its_lease_cuts_its_write_off() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::start(&[etcd.url()], 2, "").await;
    let leader = c.wait_leader().await;
    let other = 1 - leader;
    let mut conn = common::RawConn::open(c.instances[leader].addr).await;
    conn.send("PUT /x HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nContent-Length: 10\r\n\r\nfirst").await;
    eventually("the advance is committed, marker and all", async || c.in_flight_in_etcd("/x").await).await;

    let pid = c.instances[leader].proxy().pid();
    common::process::signal(pid, "STOP");
    eventually("the other instance takes over", async || c.instances[other].proxy().log_contains("leading the fence"))
        .await;
    common::process::signal(pid, "CONT");
    conn.send("-rest").await;
    let answer = conn.read_to_end().await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.starts_with("HTTP/1.1 2"), "the stopped leader must not complete the write: {answer}");
    eventually("the stopped leader steps down", async || {
        c.instances[leader].proxy().log_contains("stepping down")
            || c.instances[leader].proxy().log_contains("lease lapsed")
            || c.instances[leader].proxy().log_contains("following the fence's leader")
    })
    .await;
    assert!(c.applied_tokens("/x").is_empty(), "the backend never had the whole write");

    // The new leader: the token was used up, and a newer one passes after the quarantine.
    let addr = c.instances[other].addr;
    put(addr, "/x", 5).await.assert_refused(409, "stale_token");
    eventually("a newer write passes once the quarantine ends", async || ok(&put(addr, "/x", 6).await)).await;
    assert_eq!(c.applied_tokens("/x"), [6]);
}

/// A leader whose key is deleted by hand (a forced failover) steps down at once, rather than
/// at its next batch, and does not send what it committed meanwhile.
#[tokio::test]
async fn a_leader_whose_key_is_deleted_steps_down_at_once() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::start(&[etcd.url()], 2, "").await;
    let leader = c.wait_leader().await;
    let key = format!("{PREFIX}leader");
    c.gateway.delete(key.as_bytes()).await.unwrap();
    eventually("the leader steps down without a batch", async || {
        c.instances[leader].proxy().log_contains("the leader key was deleted or replaced in etcd")
    })
    .await;
    c.wait_leader().await;
    eventually("writes go on through whichever instance leads now", async || {
        ok(&put(c.instances[0].addr, "/k", 1).await)
    })
    .await;
}

/// An etcd store on `c`'s prefix, initialised, opened in this process and leading, with a lease
/// of 30 s.
async fn leading_store(c: &Cluster, etcd: &Etcd) -> fencegate::store::EtcdStore {
    c.init().await;
    leading_store_on(c, etcd).await
}

/// An etcd store on `c`'s prefix, opened in this process (not campaigning yet), with a lease
/// of 30 s.
async fn open_store(c: &Cluster, etcd: &Etcd) -> Result<fencegate::store::EtcdStore, fencegate::store::StoreError> {
    c.open_store(fencegate::etcd_client::Client::single(&etcd.url())).await
}

/// A store dropped without `close` (an open that failed later) resigns and gives its lease up,
/// so that it never holds the leadership with no writer behind it.
#[tokio::test]
async fn a_store_dropped_without_close_gives_the_leadership_up() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let store = leading_store(&c, &etcd).await;
    assert!(c.leader_url().await.is_some());
    drop(store);
    // Well before its 30 s lease would expire.
    eventually("the leader key is gone", async || c.leader_url().await.is_none()).await;
}

/// The writer never lowers a level, whatever its callers checked: a change whose caller
/// stopped waiting can still be queued ahead of a later, lower one.
#[tokio::test]
async fn the_writer_never_lowers_a_level_in_etcd() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let store = leading_store(&c, &etcd).await;
    // Both queued before either is answered: in one batch, or the lower one in the next.
    let (higher, lower) = (advance(&store, "/a", 10), advance(&store, "/a", 8));
    assert!(higher.await.is_ok());
    let refused = lower.await.unwrap_err().to_string();
    assert!(refused.contains("a higher level"), "{refused}");
    assert_eq!(c.max_seen_in_etcd("/a").await, Some(10));
    // And against a committed level too.
    assert!(advance(&store, "/a", 9).await.is_err());
    assert!(advance(&store, "/a", 11).await.is_ok());
    assert_eq!(c.max_seen_in_etcd("/a").await, Some(11));
}

/// The census of levels `P/census` holds, if any.
async fn census_in_etcd(c: &Cluster) -> Option<u64> {
    census_under(c, PREFIX).await
}

/// The census of levels under `prefix`, if any.
async fn census_under(c: &Cluster, prefix: &str) -> Option<u64> {
    let key = format!("{prefix}census");
    let (kvs, _) = c.gateway.range(key.as_bytes(), None).await.unwrap();
    kvs.first().map(|kv| std::str::from_utf8(&kv.value).unwrap().parse().unwrap())
}

/// Levels deleted from a live prefix (by hand, a clean-up, a restore that skipped them) while
/// its batch id and key rules survive: the census says how many it must hold, and no instance
/// leads it with fewer.
#[tokio::test]
async fn a_prefix_that_lost_levels_is_refused_naming_what_is_missing() {
    use fencegate::store::Condition;
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let store = leading_store(&c, &etcd).await;
    advance(&store, "/a", 5).await.unwrap();
    store.commit(store.term(), MarkBatch::advance(vec![Mark::key("/b"), Mark::floor("/d/")], 6)).await.unwrap();
    advance(&store, "/c", 7).await.unwrap();
    store.close().await.unwrap();

    // A restart with every level in place leads.
    let again = leading_store_on(&c, &etcd).await;
    again.close().await.unwrap();

    for key in ["k//a", "k//c"] {
        c.gateway.delete(format!("{PREFIX}{key}").as_bytes()).await.unwrap();
    }
    let store = open_store(&c, &etcd).await.unwrap();
    store.start(std::sync::Arc::new(|_| {}));
    let mut refusal = String::new();
    eventually("the takeover refuses the prefix", async || match store.condition() {
        Condition::Failed(why) => {
            refusal = why;
            true
        }
        _ => false,
    })
    .await;
    assert!(!store.leading());
    assert!(refusal.contains("holds 2 fence levels") && refusal.contains("records 4"), "{refusal}");
    assert!(refusal.contains("2 were deleted") && refusal.contains("--floor <that token>"), "{refusal}");
    assert!(advance(&store, "/b", 100).await.is_err(), "no write is fenced from what is left");
    drop(store);
    eventually("it gave the leadership up", async || c.leader_url().await.is_none()).await;

    // The real binary: it does not serve fenced writes, and says why.
    let mut c = c;
    c.instances[0].start();
    let log = "holds 2 fence levels";
    eventually("the instance names what is missing", async || c.instances[0].proxy().log_contains(log)).await;
    put(c.instances[0].addr, "/b", 100).await.assert_refused(503, "store_unavailable");
}

/// `init` writes the census, and every batch that creates levels counts each of them once, in
/// the same transaction: an advance, several marks at once, a reset of a mark never written.
#[tokio::test]
async fn the_census_counts_every_level_created() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let store = leading_store(&c, &etcd).await;
    assert_eq!(census_in_etcd(&c).await, Some(0), "init with no floor: no level");
    advance(&store, "/a", 5).await.unwrap();
    assert_eq!(census_in_etcd(&c).await, Some(1));
    let (both, again) = (
        store.commit(store.term(), MarkBatch::advance(vec![Mark::key("/b"), Mark::floor("/d/")], 6)),
        store.commit(store.term(), MarkBatch::advance(vec![Mark::key("/b"), Mark::key("/a")], 7)),
    );
    both.await.unwrap();
    again.await.unwrap();
    assert_eq!(census_in_etcd(&c).await, Some(3), "/b counted once, /a not again");
    store.commit(store.term(), MarkBatch::reset(vec![Mark::key("/b"), Mark::key("/c")], 3)).await.unwrap();
    assert_eq!(census_in_etcd(&c).await, Some(4), "a reset that makes a level counts it");
    store.close().await.unwrap();

    // The floor `init` writes, and the levels a migration creates.
    let client = fencegate::etcd_client::Client::single(&etcd.url());
    let keying = fencegate::fence::keys::keying(&Default::default(), &[]);
    fencegate::store::etcd::init(&client, "/fg-floor/", &keying, "", 500).await.unwrap();
    assert_eq!(census_under(&c, "/fg-floor/").await, Some(1));
    let dir = c.dir.path().join("old");
    fencegate::app::init_data_dir(&dir, 0).unwrap();
    let options = fencegate::store::StoreOptions { keying: keying.clone(), ..Default::default() };
    let file = fencegate::store::FileStore::open(&dir, options).unwrap();
    for (key, token) in [("/a", 7), ("/b", 9)] {
        advance(&file, key, token).await.unwrap();
        answered(&file, key, token);
    }
    file.close().await.unwrap();
    fencegate::store::etcd::migrate(&client, "/fg-floor/", &keying, "", &dir).await.unwrap();
    assert_eq!(census_under(&c, "/fg-floor/").await, Some(3), "the floor, /a and /b");
    fencegate::store::etcd::migrate(&client, "/fg-floor/", &keying, "", &dir).await.unwrap();
    assert_eq!(census_under(&c, "/fg-floor/").await, Some(3), "nothing created again");
}

/// A prefix an earlier build initialised has no census: its next takeover counts what it holds
/// and writes it, and batches keep it from then on.
#[tokio::test]
async fn a_prefix_without_a_census_gets_one_at_its_takeover() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    c.init().await;
    c.gateway.put(format!("{PREFIX}k//old").as_bytes(), b"00000000000000000009").await.unwrap();
    c.gateway.delete(format!("{PREFIX}census").as_bytes()).await.unwrap();
    let store = leading_store_on(&c, &etcd).await;
    assert_eq!(census_in_etcd(&c).await, Some(1), "counted at the takeover");
    assert_eq!(store.table().get("/old"), Some(9));
    advance(&store, "/new", 10).await.unwrap();
    store.close().await.unwrap();
    assert_eq!(census_in_etcd(&c).await, Some(2));
}

/// [`leading_store`] on a prefix already initialised.
async fn leading_store_on(c: &Cluster, etcd: &Etcd) -> fencegate::store::EtcdStore {
    let store = open_store(c, etcd).await.unwrap();
    store.start(std::sync::Arc::new(|_| {}));
    eventually("it leads", async || store.leading()).await;
    store
}

/// The leader of a two-instance cluster and its follower, once the follower knows the leader.
async fn leader_and_follower(c: &Cluster) -> (usize, usize) {
    let leader = c.wait_leader().await;
    let follower = 1 - leader;
    eventually("the follower knows the leader", async || {
        c.instances[follower].proxy().log_contains("following the fence's leader")
    })
    .await;
    (leader, follower)
}

#[tokio::test]
async fn a_followers_admin_api_says_it_does_not_lead_and_names_the_leader() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::start(&[etcd.url()], 2, "").await;
    let (leader, follower) = leader_and_follower(&c).await;
    assert!(ok(&put(c.instances[follower].addr, "/r", 7).await), "sent on to the leader");
    let admin = async |i: usize, head: &str, body: &str| {
        let addr = c.instances[i].proxy().admin_addr().await;
        let auth = common::cluster::ADMIN_TOKEN;
        raw_request(addr, &format!("{head} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {auth}"), body).await
    };
    let r = admin(leader, "GET /fences/r", "").await;
    assert_eq!((r.status, r.json()["max_seen"].as_u64()), (200, Some(7)), "{:?}", r.body);
    // The follower holds no levels: it says so rather than answering 404 or "nothing to reset".
    for (head, body) in [
        ("GET /fences/r", ""),
        ("GET /fences?prefix=/", ""),
        ("POST /fences/r:reset", r#"{"to": 1, "confirm": "/r"}"#),
        ("POST /fences/r:advance", r#"{"to": 100}"#),
        ("POST /fences/r:lift", ""),
    ] {
        let r = admin(follower, head, body).await;
        r.assert_refused(421, "not_leader");
        assert_eq!(r.json()["leader"].as_str(), Some(c.instances[leader].url().as_str()), "{head}: {:?}", r.body);
    }
    assert_eq!(c.max_seen_in_etcd("/r").await, Some(7), "nothing changed");
}

/// A client that reaches a follower from an untrusted address cannot
/// forge `X-Forwarded-Proto`, `X-Forwarded-Host` or `Forwarded` for the backend, though the
/// operator lists the instances in `trusted_proxies` as docs/configuration.md asks.
#[tokio::test]
async fn a_client_cannot_forge_forwarded_headers_through_a_follower() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(etcd) = start_etcd().await else { return };
    let extra = "[headers]\ntrusted_proxies = [\"127.0.0.1\"]\nx_forwarded_host = \"append\"\nforwarded = \"append\"\n";
    let c = Cluster::start(&[etcd.url()], 2, extra).await;
    let (leader, follower) = leader_and_follower(&c).await;
    // The client comes from 127.0.0.2: not a trusted proxy.
    let send = async |addr: SocketAddr, path: &str, token: u64| {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut s = socket.connect(addr).await.unwrap();
        let req = format!(
            "PUT {path} HTTP/1.1\r\nHost: app.example\r\nFencing-Token: {token}\r\nX-Forwarded-Proto: https\r\n\
             X-Forwarded-Host: bank.example\r\nForwarded: for=6.6.6.6;proto=https\r\nContent-Length: 1\r\nConnection: close\r\n\r\nv"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        assert!(out.starts_with(b"HTTP/1.1 2"), "{}", String::from_utf8_lossy(&out));
    };
    send(c.instances[leader].addr, "/direct", 1).await;
    send(c.instances[follower].addr, "/via-follower", 1).await;
    let applied = c.backend.applied();
    let seen = |path: &str| {
        let r = applied.iter().find(|r| r.path == path).unwrap();
        let h = |n: &str| r.headers.get_all(n).iter().map(|v| v.to_str().unwrap().to_owned()).collect::<Vec<_>>();
        (h("x-forwarded-for"), h("x-forwarded-proto"), h("x-forwarded-host"), h("forwarded"))
    };
    let direct = seen("/direct");
    eprintln!("direct:       {direct:?}");
    let via = seen("/via-follower");
    eprintln!("via follower: {via:?}");
    assert_eq!(direct.1, ["http"], "direct: the forged proto is replaced");
    assert_eq!(via.0, ["127.0.0.2, 127.0.0.1"]);
    assert_eq!(via.1, ["http"], "via a follower: the client's forged X-Forwarded-Proto reached the backend");
    assert_eq!(via.2, ["app.example"], "via a follower: the client's forged X-Forwarded-Host reached the backend");
    assert!(!via.3[0].contains("6.6.6.6"), "via a follower: the client's forged Forwarded reached the backend");
}

/// Two instances in S3 mode in front of `server`, sharing the fence through `etcd`: a
/// multipart upload created through a follower is bound by the leader in etcd, so after the
/// leader dies the next one still refuses the overtaken upload (under its key and a decoy) and
/// completes the other.
async fn uploads_outlive_their_leader(etcd: &Etcd, server: Option<common::s3::S3Server>) {
    let Some(server) = server else { return };
    let flat = server.kind != "s3s";
    let mut c = Cluster::build(&[etcd.url()], 2, &format!("[s3]\nflat_keys = {flat}")).await;
    let mem = c.backend.url();
    for i in &c.instances {
        let text = std::fs::read_to_string(&i.config).unwrap();
        let text = text.replace(&format!("url = \"{mem}\""), &format!("url = \"{}\"\nprotocol = \"s3\"", server.url));
        std::fs::write(&i.config, text).unwrap();
    }
    c.init().await;
    for i in &mut c.instances {
        i.start();
    }
    let leader = c.wait_leader().await;
    let follower = 1 - leader;
    let state = c.dir.path().join(format!("uploads-{}.json", server.kind));
    let env = [("FG_S3_STATE", state.to_str().unwrap())];
    let url = c.instances[follower].url();
    common::s3::scenario_at("uploads_before_kill", &url, &server, &env).await;
    c.instances[leader].kill9();
    assert_eq!(c.wait_leader().await, follower);
    common::s3::scenario_at("uploads_after_kill", &url, &server, &env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_uploads_keep_their_bindings_in_etcd_across_a_new_leader() {
    let Some(etcd) = start_etcd().await else { return };
    uploads_outlive_their_leader(&etcd, common::s3::start_moto().await).await;
    // A new prefix for each server: each run starts its fence afresh.
    let etcd = start_etcd().await.expect("etcd ran a moment ago");
    uploads_outlive_their_leader(&etcd, common::s3::start_s3s().await).await;
}

/// A drop of bindings need not be atomic, and the fence drops every binding that can never
/// complete at once when `s3.max_uploads` is reached, however many: more than one etcd
/// transaction takes are dropped in several, rather than refused (which would refuse every new
/// multipart upload from then on, each after the server created it).
#[tokio::test]
async fn a_drop_of_more_bindings_than_one_transaction_takes_is_made_whole() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let store = leading_store(&c, &etcd).await;
    let bound: Vec<Mark> = (0..300).map(|i| Mark::upload(format!("/b/k{i}\nid{i}"))).collect();
    // 300 is more than one transaction of the default 128 operations holds.
    for some in bound.chunks(50) {
        store.commit(store.term(), MarkBatch::advance(some.to_vec(), 5)).await.unwrap();
    }
    let under = format!("{PREFIX}u/");
    let in_etcd = async || {
        let end = fencegate::etcd_client::prefix_end(under.as_bytes());
        c.gateway.range(under.as_bytes(), Some(&end)).await.unwrap().0.len()
    };
    assert_eq!((store.table().count(MarkKind::Upload), in_etcd().await), (300, 300));
    store.commit(store.term(), MarkBatch::drop_bindings(bound)).await.unwrap();
    assert_eq!((store.table().count(MarkKind::Upload), in_etcd().await), (0, 0));
}

/// A leader that leads again reads the bindings as etcd holds them, not as it left them: one
/// another leader dropped meanwhile (here, by hand) is gone from its table too, and neither
/// counts against `s3.max_uploads` nor lets its upload go on.
#[tokio::test]
async fn a_leader_that_leads_again_forgets_the_bindings_dropped_meanwhile() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let store = leading_store(&c, &etcd).await;
    let (kept, dropped) = (Mark::upload("/b/k\nkept"), Mark::upload("/b/k\ndropped"));
    store.commit(store.term(), MarkBatch::advance([kept.clone(), dropped.clone()], 5)).await.unwrap();
    let term = store.term();
    c.gateway.delete(format!("{PREFIX}u//b/k\ndropped").as_bytes()).await.unwrap();
    c.gateway.delete(format!("{PREFIX}leader").as_bytes()).await.unwrap();
    eventually("it leads again", async || store.leading() && store.term() != term).await;
    assert_eq!(store.table().level(kept.borrowed()), Some(5));
    assert_eq!(store.table().level(dropped.borrowed()), None, "a binding etcd no longer holds");
}

/// The instances of one fence decide writes alike: the fence records its rules, an instance
/// whose config decides otherwise is refused at start and a reload that would is refused,
/// each naming the difference; `fencegate rules --set` changes the record only while no
/// instance leads, and then the old config is the one refused.
#[tokio::test]
async fn an_instance_that_would_fence_otherwise_is_refused_naming_the_difference() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::build(&[etcd.url()], 2, "[[fence.rules]]\nprefix = \"/a\"\nmax_jump = 100\n").await;
    c.init().await;
    let (first, second) = (c.instances[0].config.clone(), c.instances[1].config.clone());
    let original = std::fs::read_to_string(&first).unwrap();
    let other = std::fs::read_to_string(&second).unwrap().replace("max_jump = 100", "max_jump = 5");
    std::fs::write(&second, other).unwrap();
    // An instance that disagrees exits at once, saying why.
    let refused = async |config: &std::path::Path| -> String {
        let mut cmd = std::process::Command::new(common::process::BIN);
        cmd.arg("run").arg("--config").arg(config).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let exited = || child.try_wait().unwrap().is_some();
        common::poll_until("the instance exits, refused", exited).await;
        let mut err = String::new();
        child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        err
    };
    let rules = |config: &std::path::Path, set: bool| {
        let mut cmd = std::process::Command::new(common::process::BIN);
        cmd.arg("rules").arg("--config").arg(config);
        if set {
            cmd.arg("--set");
        }
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let err = refused(&second).await;
    assert!(err.contains("fence.rules./a.max_jump: recorded 100, configured 5"), "{err}");
    let (_, said) = rules(&second, false);
    assert!(said.contains("fence.rules./a.max_jump: recorded 100, configured 5"), "{said}");

    // A running instance refuses a reload that would fence otherwise, and applies one that
    // changes what is not the fence's.
    c.instances[0].start();
    c.wait_leader().await;
    let proxy = c.instances[0].proxy();
    std::fs::write(&first, original.replace("max_jump = 100", "max_jump = 100\nequal_token = \"accept\"")).unwrap();
    proxy.signal("HUP");
    proxy.wait_for_log("reload refused", 1).await;
    let said = proxy.log_lines("reload refused").join("\n");
    assert!(said.contains("fence.rules./a.equal_token: running unset, configured \\\"accept\\\""), "{said}");
    std::fs::write(&first, format!("{original}[log]\nlevel = \"warn\"\n")).unwrap();
    proxy.signal("HUP");
    proxy.wait_for_log("configuration reloaded", 1).await;

    // The record changes only with no instance leading; then the old config is refused.
    let (set, said) = rules(&second, true);
    assert!(!set && said.contains("an instance leads"), "{said}");
    c.instances[0].kill9();
    eventually("the leader key is gone", async || c.leader_url().await.is_none()).await;
    let (set, said) = rules(&second, true);
    assert!(set, "{said}");
    let err = refused(&first).await;
    assert!(err.contains("fence.rules./a.max_jump: recorded 5, configured 100"), "{err}");
    c.instances[1].start();
    c.wait_leader().await;
    assert!(ok(&put(c.instances[1].addr, "/b/x", 1).await));
}

/// A prefix whose rules were never recorded (an older build's) gets the first instance's.
#[tokio::test]
async fn a_prefix_without_recorded_rules_gets_the_first_instances() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::build(&[etcd.url()], 1, "").await;
    c.init().await;
    let key = format!("{PREFIX}rules");
    assert!(c.gateway.delete(key.as_bytes()).await.is_ok());
    c.instances[0].start();
    c.wait_leader().await;
    let (kvs, _) = c.gateway.range(key.as_bytes(), None).await.unwrap();
    let config = fencegate::Config::load(&c.instances[0].config, None).unwrap();
    let recorded = kvs.first().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
    assert_eq!(recorded, Some(fencegate::store::etcd::stored_rules(&config.fence_record())));
}

/// A prefix an earlier build wrote: its rules lack the line that says writes in flight are
/// kept as flight records, and its write in flight is a marker of its own. The new leader
/// quarantines the marker's resource, records the line (which earlier builds refuse to lead
/// by), and deletes the marker once a newer write to the resource is answered.
#[tokio::test]
async fn a_prefix_an_earlier_build_wrote_is_read_and_upgraded() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::build_with(&[etcd.url()], 1, "2s", "").await;
    c.init().await;
    let config = fencegate::Config::load(&c.instances[0].config, None).unwrap();
    let (rules, marker) = (format!("{PREFIX}rules"), format!("{PREFIX}i//old"));
    let seven = b"00000000000000000007";
    c.gateway.put(rules.as_bytes(), config.fence_record().as_bytes()).await.unwrap();
    c.gateway.put(format!("{PREFIX}k//old").as_bytes(), seven).await.unwrap();
    c.gateway.put(marker.as_bytes(), seven).await.unwrap();
    c.instances[0].start();
    c.wait_leader().await;
    let addr = c.instances[0].addr;
    put(addr, "/old", 7).await.assert_refused(409, "stale_token");
    put(addr, "/old", 8).await.assert_refused(503, "resource_quarantined");
    let (kvs, _) = c.gateway.range(rules.as_bytes(), None).await.unwrap();
    let recorded = kvs.first().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
    assert_eq!(recorded, Some(fencegate::store::etcd::stored_rules(&config.fence_record())));
    let (kvs, _) = c.gateway.range(marker.as_bytes(), None).await.unwrap();
    assert_eq!(kvs.len(), 1, "the marker stays while its write may be in flight");
    eventually("the quarantine ends and a newer write passes", async || ok(&put(addr, "/old", 8).await)).await;
    eventually("the spent marker is deleted", async || {
        c.gateway.range(marker.as_bytes(), None).await.is_ok_and(|(kvs, _)| kvs.is_empty())
    })
    .await;
    assert!(!c.in_flight_in_etcd("/old").await, "answered: no flight record names it");
}

/// Two instances advertising one URL are told apart: the one that comes second neither leads
/// nor follows (a write it sent to the leader's URL could reach itself), and says why in its
/// log, its `/readyz` and its refusals.
#[tokio::test]
async fn an_instance_advertising_anothers_url_says_so_and_never_leads() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::build(&[etcd.url()], 2, "").await;
    c.init().await;
    let (own, theirs) =
        (format!("advertise = \"{}\"", c.instances[1].url()), format!("advertise = \"{}\"", c.instances[0].url()));
    let twin = std::fs::read_to_string(&c.instances[1].config).unwrap().replace(&own, &theirs);
    std::fs::write(&c.instances[1].config, twin).unwrap();
    c.instances[0].start();
    assert_eq!(c.wait_leader().await, 0);
    c.instances[1].start();
    let twin = c.instances[1].proxy();
    twin.wait_for_log("another instance advertises", 1).await;
    let ready = raw_request(twin.admin_addr().await, "GET /readyz HTTP/1.1\r\nHost: x", "").await;
    let said = String::from_utf8_lossy(&ready.body).into_owned();
    assert!(ready.status == 503 && said.contains("another instance advertises"), "{} {said}", ready.status);
    put(c.instances[1].addr, "/a", 1).await.assert_refused(503, "store_unavailable");
    assert!(ok(&put(c.instances[0].addr, "/a", 1).await), "the instance that claimed its URL first goes on");
}

/// A follower that cannot reach the leader (here: the leader advertises a URL nothing listens
/// at) is not ready for fenced writes, and its `/readyz` says so; reads go on.
#[tokio::test]
async fn a_follower_that_cannot_reach_the_leader_is_not_ready() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::build(&[etcd.url()], 2, "").await;
    c.init().await;
    let nowhere = format!("http://{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap());
    let own = format!("advertise = \"{}\"", c.instances[0].url());
    let lost =
        std::fs::read_to_string(&c.instances[0].config).unwrap().replace(&own, &format!("advertise = \"{nowhere}\""));
    std::fs::write(&c.instances[0].config, lost).unwrap();
    c.instances[0].start();
    eventually("the leader key names the unreachable URL", async || c.leader_url().await.as_deref() == Some(&nowhere))
        .await;
    c.instances[1].start();
    let follower = c.instances[1].proxy();
    let admin = follower.admin_addr().await;
    let mut said = String::new();
    eventually("the follower's readiness names the leader", async || {
        let ready = raw_request(admin, "GET /readyz HTTP/1.1\r\nHost: x", "").await;
        said = String::from_utf8_lossy(&ready.body).into_owned();
        ready.status == 503 && said.contains("leader unreachable")
    })
    .await;
    assert!(said.contains(&nowhere), "{said}");
    put(c.instances[1].addr, "/a", 1).await.assert_refused(503, "store_unavailable");
}

/// A takeover reads the fence page by page at one revision; a compaction past that revision
/// meanwhile makes it read again at the current one, and the instance leads on the same
/// lease, without a new election.
#[tokio::test]
async fn a_takeover_that_meets_a_compaction_reads_again_and_leads() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::build(&[etcd.url()], 2, "").await;
    c.init().await;
    // More levels than one page of the takeover's read (1,000).
    for i in 0..1200 {
        let key = format!("{PREFIX}k//x{i}");
        c.gateway.put(key.as_bytes(), format!("{:020}", 100 + i).as_bytes()).await.unwrap();
    }
    c.instances[0].start();
    assert_eq!(c.wait_leader().await, 0);
    c.instances[1].start();
    assert!(c.failpoint(1, "store::takeover_page", "1*return(300)").await);
    let pid = c.instances[1].proxy().pid();
    c.instances[0].kill9();
    // The follower takes over once the lease lapses, and is stopped after its first page.
    poll_until("the new leader is stopped between two pages", || c.instances[1].stopped.lock().unwrap().contains(&pid))
        .await;
    // Past the read's revision: a compaction keeps the revision it is made at.
    let revision = c.gateway.put(b"compaction", b"past the takeover's revision").await.unwrap();
    let compact = std::process::Command::new("etcdctl")
        .args(["--endpoints", &etcd.url(), "compact", &revision.to_string()])
        .output()
        .expect("etcdctl runs (Debian's etcd-client, beside etcd)");
    assert!(compact.status.success(), "{}", String::from_utf8_lossy(&compact.stderr));
    c.instances[1].stopped.lock().unwrap().retain(|p| *p != pid);
    common::process::signal(pid, "CONT");
    assert_eq!(c.wait_leader().await, 1);
    let leader = c.instances[1].proxy();
    assert!(leader.log_contains("reading the fence again"), "{:?}", leader.log_lines("takeover"));
    assert!(!leader.log_contains("the takeover could not read the fence"), "{:?}", leader.log_lines("takeover"));
    put(c.instances[1].addr, "/x1199", 1299).await.assert_refused(409, "stale_token");
    assert!(ok(&put(c.instances[1].addr, "/x1199", 1300).await));
}

/// A client's claim to be an instance of the fence (`fencegate-forwarded-by`, with or without a
/// made-up proof) is not believed: a follower sends its write on as any other, the leader takes
/// it as the client's own, and neither header reaches the backend. Instances prove the writes
/// they send on with the fence's key in etcd.
#[tokio::test]
async fn a_clients_claim_to_be_an_instance_is_not_believed() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::start(&[etcd.url()], 2, "").await;
    let (leader, follower) = leader_and_follower(&c).await;
    let claim = |path: &str, token: u64| {
        format!(
            "PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\nfencegate-forwarded-by: {}\r\n\
             fencegate-forwarded-proof: 1700000000.bm90IGEgcHJvb2Y\r\nContent-Length: 1",
            c.instances[leader].url()
        )
    };
    let via_follower = raw_request(c.instances[follower].addr, &claim("/claimed-at-follower", 1), "v").await;
    assert!(ok(&via_follower), "sent on as any write: {} {:?}", via_follower.status, via_follower.body);
    let at_leader = raw_request(c.instances[leader].addr, &claim("/claimed-at-leader", 1), "v").await;
    assert!(ok(&at_leader), "{} {:?}", at_leader.status, at_leader.body);
    for r in c.backend.applied() {
        assert!(
            !r.headers.contains_key("fencegate-forwarded-by") && !r.headers.contains_key("fencegate-forwarded-proof")
        );
    }
    // Each applied once, as the clients sent them.
    assert_eq!(c.backend.applied().len(), 2);
}

/// Instances that advertise `https://` URLs send fenced writes on to the leader over TLS,
/// checking its certificate against `store.peer_ca`.
#[tokio::test]
async fn instances_with_https_urls_send_writes_on_over_tls() {
    let Some(etcd) = start_etcd().await else { return };
    let pki = common::pki::Pki::new();
    let (cert, key, ca) = (pki.path("server.pem"), pki.path("server-key.pem"), pki.path("ca.pem"));
    let tls = format!("[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n", cert.display(), key.display());
    let mut c = Cluster::build(&[etcd.url()], 2, &tls).await;
    let urls: Vec<String> = c.instances.iter().map(|i| i.url().replace("http://", "https://")).collect();
    let https = |i: usize| urls[i].clone();
    for i in 0..2 {
        let text = std::fs::read_to_string(&c.instances[i].config).unwrap().replace(
            &format!("advertise = \"{}\"", c.instances[i].url()),
            &format!("advertise = \"{}\"\npeer_ca = \"{}\"", https(i), ca.display()),
        );
        std::fs::write(&c.instances[i].config, text).unwrap();
    }
    c.init().await;
    c.instances[0].start();
    let leader = https(0);
    eventually("the first instance leads", async || c.leader_url().await.as_deref() == Some(leader.as_str())).await;
    c.instances[1].start();
    eventually("the second follows", async || c.instances[1].proxy().log_contains("following the fence's leader"))
        .await;
    // curl on a thread of its own: the backend serves on this test's runtime.
    let (ca, url) = (ca.display().to_string(), format!("{}/a", https(1)));
    let put = async |token: u64| {
        let (ca, url) = (ca.clone(), url.clone());
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new("curl")
                .args(["-sS", "--cacert", &ca, "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT"])
                .args(["-H", &format!("Fencing-Token: {token}"), "--data", "v", &url])
                .output()
                .expect("curl runs")
        });
        let out = out.await.unwrap();
        // The status, and curl's word on a failure.
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (status, why) = put(2).await;
    assert!(status.starts_with('2'), "a write through the follower, sent on over TLS: {status} {why}");
    let (status, why) = put(1).await;
    assert_eq!(status, "409", "the leader fenced it: {why}");
    assert_eq!(c.applied_tokens("/a"), [2]);
}

/// Instances whose listener asks clients for a certificate (`server.tls.client_ca`) and that
/// advertise `https://` URLs: a follower sends a fenced write on to the leader as any client
/// of the leader, so the leader must take it.
#[tokio::test]
async fn a_follower_sends_writes_on_to_a_leader_that_asks_for_client_certificates() {
    let Some(etcd) = start_etcd().await else { return };
    let pki = common::pki::Pki::new();
    let (cert, key, ca) = (pki.path("server.pem"), pki.path("server-key.pem"), pki.path("ca.pem"));
    let tls = format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n",
        cert.display(),
        key.display(),
        ca.display()
    );
    let mut c = Cluster::build(&[etcd.url()], 2, &tls).await;
    let urls: Vec<String> = c.instances.iter().map(|i| i.url().replace("http://", "https://")).collect();
    for (i, url) in urls.iter().enumerate() {
        let text = std::fs::read_to_string(&c.instances[i].config).unwrap().replace(
            &format!("advertise = \"{}\"", c.instances[i].url()),
            &format!("advertise = \"{url}\"\npeer_ca = \"{}\"", ca.display()),
        );
        std::fs::write(&c.instances[i].config, text).unwrap();
    }
    c.init().await;
    c.instances[0].start();
    let leader = urls[0].clone();
    eventually("the first instance leads", async || c.leader_url().await.as_deref() == Some(leader.as_str())).await;
    c.instances[1].start();
    eventually("the second follows", async || c.instances[1].proxy().log_contains("following the fence's leader"))
        .await;
    // The client holds a certificate the CA signed; curl on a thread of its own.
    let args: Vec<String> = [
        "-sS",
        "--cacert",
        &ca.display().to_string(),
        "--cert",
        &pki.path("client.pem").display().to_string(),
        "--key",
        &pki.path("client-key.pem").display().to_string(),
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-X",
        "PUT",
        "-H",
        "Fencing-Token: 2",
        "--data",
        "v",
        &format!("{}/a", urls[1]),
    ]
    .map(str::to_owned)
    .to_vec();
    let out = tokio::task::spawn_blocking(move || std::process::Command::new("curl").args(&args).output().unwrap());
    let status = String::from_utf8_lossy(&out.await.unwrap().stdout).into_owned();
    assert!(status.starts_with('2'), "a write through the follower, sent on over TLS: {status}");
    assert_eq!(c.applied_tokens("/a"), [2]);
}

/// An instance that opened while etcd did not answer has not been checked against the fence's
/// rules: it is once etcd answers, before it follows (a follower passes unchecked what its own
/// rules leave unfenced) or leads.
#[tokio::test]
async fn an_instance_that_opened_without_etcd_is_held_to_the_fences_rules() {
    let Some(etcd) = start_etcd().await else { return };
    let mut c = Cluster::build(&[etcd.url()], 2, "").await;
    let mut text = std::fs::read_to_string(&c.instances[1].config).unwrap();
    text.push_str("[[fence.rules]]\nprefix = \"/x\"\nmax_jump = 5\n");
    std::fs::write(&c.instances[1].config, text).unwrap();
    c.init().await;
    c.instances[0].start();
    c.wait_leader().await;
    common::process::signal(etcd.pid(), "STOP");
    c.instances[1].start();
    eventually("the second opens while etcd does not answer", async || {
        c.instances[1].proxy().log_contains("etcd does not answer")
    })
    .await;
    common::process::signal(etcd.pid(), "CONT");
    let (following, differs) = ("following the fence's leader", "otherwise than the fence's recorded rules");
    eventually("the second follows or is refused", async || {
        let log = c.instances[1].proxy();
        log.log_contains(following) || log.log_contains(differs)
    })
    .await;
    assert!(!c.instances[1].proxy().log_contains(following), "it followed under rules of its own");
    assert!(c.instances[1].proxy().log_contains(differs));
}

/// `n` instances as Envoy's external processor on one shared fence, started, with a leader,
/// and an Envoy with all of them in its processor cluster (deploy/envoy/envoy.yaml), once its
/// health checks found one serving; `None` where Envoy or etcd is missing.
async fn processors_behind_envoy(etcd: &Etcd, n: usize) -> Option<(Cluster, common::envoy::Envoy, usize)> {
    use common::envoy::{Envoy, EnvoyOptions};
    let mut c = Cluster::build(&[etcd.url()], n, "").await;
    for i in &c.instances {
        let text = std::fs::read_to_string(&i.config).unwrap();
        std::fs::write(&i.config, text.replacen("[server]\n", "[server]\nmode = \"ext_proc\"\n", 1)).unwrap();
    }
    c.init().await;
    for i in &mut c.instances {
        i.start();
    }
    let leader = c.wait_leader().await;
    let processors: Vec<SocketAddr> = c.instances.iter().map(|i| i.addr).collect();
    let envoy = Envoy::start_for(&processors, c.backend.addr(), &EnvoyOptions::default()).await?;
    let healthy = "cluster.fencegate.membership_healthy";
    eventually("Envoy finds one instance serving", async || envoy.stat(healthy).await == 1).await;
    Some((c, envoy, leader))
}

/// Two instances as Envoy's external processor on one shared fence, both in Envoy's processor
/// cluster: only the leader answers gRPC health checks `SERVING`, so Envoy sends every write to
/// it and none gets a follower's `503`; once the leader is killed and the other instance takes
/// over, Envoy's checks move the writes there.
#[tokio::test]
async fn envoy_sends_every_write_to_the_leader_by_its_health_checks() {
    let Some(etcd) = start_etcd().await else { return };
    let Some((mut c, envoy, leader)) = processors_behind_envoy(&etcd, 2).await else { return };
    for token in 1..=20 {
        let r = put(envoy.addr, "/k", token).await;
        assert!(ok(&r), "write {token} went to a follower: {r:?}");
    }

    c.instances[leader].kill9();
    let next = c.wait_leader().await;
    assert_ne!(next, leader);
    let serving = || async {
        let answer = raw_request(envoy.admin, "GET /clusters HTTP/1.1\r\nHost: admin\r\nConnection: close", "").await;
        let text = String::from_utf8_lossy(&answer.body).into_owned();
        let at = format!("fencegate::{}::health_flags::healthy", c.instances[next].addr);
        text.lines().any(|l| l == at)
    };
    // And the killed one gone: two failed checks in a row.
    let healthy = "cluster.fencegate.membership_healthy";
    eventually("Envoy's checks find the new leader alone", async || serving().await && envoy.stat(healthy).await == 1)
        .await;
    // The killed leader's last write may have had no durable answer: the new leader
    // quarantines the key until `fence.quarantine` has passed.
    let r = common::past_quarantine(async || put(envoy.addr, "/k", 21).await).await;
    assert!(ok(&r), "write 21: {r:?}");
    for token in 22..=30 {
        let r = put(envoy.addr, "/k", token).await;
        assert!(ok(&r), "write {token} after the takeover: {r:?}");
    }
    let applied = c.applied_tokens("/k");
    assert!(applied.windows(2).all(|w| w[0] < w[1]) && applied.ends_with(&[30]), "{applied:?}");
}

/// A leader behind Envoy stopped past its lease after a DELETE's advance and before the head is
/// let go refuses the write on waking, with its own `503`, and the backend never sees it: a
/// write without a body is sent whole by its head, so only the check before the head keeps it
/// out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_refuses_a_write_whose_lease_lapsed_before_its_head() {
    let Some(etcd) = start_etcd().await else { return };
    let Some((c, envoy, leader)) = processors_behind_envoy(&etcd, 1).await else { return };
    assert!(ok(&put(envoy.addr, "/k", 1).await));
    assert!(c.failpoint(leader, "upstream::before_head", "1*return(400)").await);
    let addr = envoy.addr;
    let delete =
        tokio::spawn(async move { raw_request(addr, "DELETE /k HTTP/1.1\r\nHost: x\r\nFencing-Token: 2", "").await });
    let stopped = &c.instances[leader].stopped;
    eventually("the leader stops at the fail point", async || !stopped.lock().unwrap().is_empty()).await;
    // Past the lease (`lease_ttl = 3s` in these clusters), on etcd's clock and the leader's.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    for pid in std::mem::take(&mut *stopped.lock().unwrap()) {
        common::process::signal(pid, "CONT");
    }
    let r = delete.await.unwrap();
    // fencegate's own refusal, not Envoy's answer to a processor that failed.
    r.assert_refused(503, "store_unavailable");
    let deletes = c.backend.requests().iter().filter(|r| r.method == http::Method::DELETE).count();
    assert_eq!(deletes, 0, "the backend never sees the write");
}

/// One leader among three: below Envoy's default panic threshold (50% healthy), which would
/// spread writes over the followers; the shipped cluster sets it to 0.
#[tokio::test]
async fn envoy_sends_every_write_to_the_leader_of_three() {
    let Some(etcd) = start_etcd().await else { return };
    let Some((_c, envoy, _)) = processors_behind_envoy(&etcd, 3).await else { return };
    let mut refused = Vec::new();
    for token in 1..=20 {
        let r = put(envoy.addr, "/k", token).await;
        if !ok(&r) {
            refused.push((token, r.status, r.fencegate_error().map(str::to_owned)));
        }
    }
    assert!(refused.is_empty(), "writes sent to a follower: {refused:?}");
}
