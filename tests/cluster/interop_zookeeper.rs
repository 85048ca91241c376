//! fencegate with fencing tokens from a real ZooKeeper (started by `common::services`): the
//! article's t0–t6 trace with the standard lock recipe (ephemeral sequential znodes under the
//! lock's parent; the lowest sequence holds the lock, each other waiter watches the one just
//! before it) and real session expiry. The token is the czxid of the holder's own znode;
//! docs/tokens.md says why, and the second test shows why the sequence number is not one.
//!
//! Skipped with a message where ZooKeeper is not installed; `FG_REQUIRE_SERVICES=1` makes that
//! a failure (`.ci/run` sets it).

use crate::common;

use std::time::Duration;

use common::builder::Deployment;
use common::services::{ZooKeeper, start_zookeeper};
use common::wait::DEADLINE;
use common::{Resp, eventually, raw_request};
use zookeeper_client as zk;

/// The session of a holder that will go quiet: it expires about this long after the last
/// heartbeat (ZooKeeper accepts 2 to 20 ticks; see `services::ZK_TICK`).
const SHORT_SESSION: Duration = Duration::from_secs(1);

async fn connect(server: &ZooKeeper, session: Duration) -> zk::Client {
    zk::Client::connector().with_session_timeout(session).connect(&server.connect_string()).await.unwrap()
}

/// A client whose session outlives it: dropping it stops the heartbeats without closing the
/// session, which then expires on the server, as when a process pauses or is cut off.
async fn connect_detached(server: &ZooKeeper, session: Duration) -> zk::Client {
    let connector = zk::Client::connector().with_session_timeout(session).with_detached();
    connector.connect(&server.connect_string()).await.unwrap()
}

fn open_acl() -> zk::CreateOptions<'static> {
    zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all())
}

/// A lock held by the recipe: the holder's own znode, and its token.
struct Held {
    node: String,
    /// The czxid of `node`.
    token: u64,
}

/// The standard recipe: an ephemeral sequential `lock-` znode under `dir`; the lowest sequence
/// holds the lock, every other waiter watches the znode just before its own until it goes.
async fn lock(client: &zk::Client, dir: &str) -> Held {
    let mode = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let (stat, sequence) = client.create(&format!("{dir}/lock-"), b"", &mode).await.unwrap();
    let me = format!("lock-{sequence}");
    loop {
        let mut waiters = client.list_children(dir).await.unwrap();
        // One prefix and zero-padded sequences: name order is sequence order.
        waiters.sort();
        let at = waiters.iter().position(|w| *w == me).expect("a live session's ephemeral znode exists");
        if at == 0 {
            return Held { node: format!("{dir}/{me}"), token: u64::try_from(stat.czxid).unwrap() };
        }
        let before = format!("{dir}/{}", waiters[at - 1]);
        let (exists, watcher) = client.check_and_watch_stat(&before).await.unwrap();
        if exists.is_some() {
            watcher.changed().await;
        }
    }
}

/// Waits until `n` waiters (the holder among them) are under `dir`.
async fn wait_queued(client: &zk::Client, dir: &str, n: usize) {
    let what = format!("{n} lock znodes under {dir}");
    eventually(&what, async || client.list_children(dir).await.unwrap().len() == n).await;
}

async fn put(addr: std::net::SocketAddr, path: &str, token: u64, body: &str) -> Resp {
    raw_request(addr, &format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}"), body).await
}

#[tokio::test]
async fn a_holder_whose_session_expired_is_fenced_with_czxids() {
    let Some(server) = start_zookeeper().await else { return };
    let d = Deployment::builder().start().await;
    let path = "/accounts/42";
    let dir = "/locks/acct-42";
    let observer = connect(&server, Duration::from_secs(4)).await;
    observer.create("/locks", b"", &open_acl()).await.unwrap();
    observer.create(dir, b"", &open_acl()).await.unwrap();

    // t0: A takes the lock and writes.
    let a_client = connect_detached(&server, SHORT_SESSION).await;
    let a = lock(&a_client, dir).await;
    assert_eq!(put(d.addr(), path, a.token, "balance=100 (A)").await.status, 200);

    // B queues behind A (its own session lives as long as the test).
    let b_client = connect(&server, Duration::from_secs(4)).await;
    let b = tokio::spawn(async move {
        let held = lock(&b_client, dir).await;
        (held, b_client)
    });
    wait_queued(&observer, dir, 2).await;

    // t1: A pauses: its client goes quiet, still holding its token.
    drop(a_client);
    // t2: its session expires and ZooKeeper deletes its znode.
    let what = format!("A's session expires and {} goes", a.node);
    eventually(&what, async || observer.check_stat(&a.node).await.unwrap().is_none()).await;
    // t3: B, watching A's znode, holds the lock.
    let (b, _b_client) =
        tokio::time::timeout(DEADLINE, b).await.expect("B holds the lock once A's znode is gone").unwrap();
    assert!(b.token > a.token, "B's czxid {:#x} is above A's {:#x}", b.token, a.token);
    assert_eq!(observer.list_children(dir).await.unwrap().len(), 1, "B alone under {dir}");

    // t4: B writes. t5–t6: A wakes up and writes with its old token.
    assert_eq!(put(d.addr(), path, b.token, "balance=200 (B)").await.status, 200);
    let r = put(d.addr(), path, a.token, "balance=50 (A, the zombie)").await;
    r.assert_refused(409, "stale_token");
    assert_eq!((r.json()["token"].as_u64(), r.json()["max_seen"].as_u64()), (Some(a.token), Some(b.token)));

    assert_eq!(d.backend.object(path).as_deref(), Some(&b"balance=200 (B)"[..]));
    let applied: Vec<u64> = d.backend.applied().iter().filter_map(|r| r.token()).collect();
    assert_eq!(applied, [a.token, b.token]);
    // The backend alone would have taken the zombie's write: the 409 was fencegate's check.
    let direct = put(d.backend.addr(), path, a.token, "balance=50 (A, the zombie)").await;
    assert_eq!(direct.status, 200);
    assert_eq!(d.backend.object(path).as_deref(), Some(&b"balance=50 (A, the zombie)"[..]));
}

#[tokio::test]
async fn sequence_numbers_restart_when_a_container_parent_goes_but_czxids_climb() {
    let Some(server) = start_zookeeper().await else { return };
    let d = Deployment::builder().start().await;
    let client = connect(&server, Duration::from_secs(4)).await;
    // Curator makes a lock's parent a container node, which ZooKeeper deletes once it has had
    // children and has none.
    let dir = "/curator-lock";
    let container = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
    let ephemeral_sequential = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());

    let mut holders = Vec::new();
    for generation in 0..2 {
        client.create(dir, b"", &container).await.unwrap();
        let (stat, sequence) = client.create(&format!("{dir}/lock-"), b"", &ephemeral_sequential).await.unwrap();
        holders.push((sequence.into_i64(), u64::try_from(stat.czxid).unwrap()));
        // The holder writes: with its sequence number as the token, and with its czxid.
        let (seq_token, czxid) = holders[generation];
        let by_sequence = put(d.addr(), "/by-sequence", u64::try_from(seq_token).unwrap(), "x").await;
        let by_czxid = put(d.addr(), "/by-czxid", czxid, "x").await;
        assert_eq!(by_czxid.status, 200, "generation {generation}: {:?}", by_czxid.body);
        if generation == 0 {
            assert_eq!(by_sequence.status, 200);
        } else {
            // The second holder got the same sequence number: refused, though it holds the lock.
            by_sequence.assert_refused(409, "stale_token");
        }
        // The holder lets go; the empty container goes with the next check.
        client.delete(&format!("{dir}/lock-{sequence}"), None).await.unwrap();
        eventually("ZooKeeper deletes the empty container", async || client.check_stat(dir).await.unwrap().is_none())
            .await;
    }
    let [(seq0, czxid0), (seq1, czxid1)] = holders[..] else { unreachable!() };
    assert_eq!((seq0, seq1), (0, 0), "the sequence restarts with its parent");
    assert!(czxid1 > czxid0, "czxids climb: {czxid0:#x} then {czxid1:#x}");
}
