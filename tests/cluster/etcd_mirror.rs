//! `fencegate::etcd_client::Mirror` against a real etcd (started by `common::services`): it follows
//! lock holders as they come and go, answers only while its heartbeat proves it fresh, fails
//! closed while etcd is stopped (SIGSTOP) and comes back by itself after SIGCONT.
//!
//! Skipped with a message where etcd is not installed; `FG_REQUIRE_SERVICES=1` makes that a
//! failure (`.ci/run` sets it).

use crate::common;

use std::time::{Duration, Instant};

use common::etcd::Gateway;
use common::poll_until;
use common::services::start_etcd;
use fencegate::etcd_client::{Freshness, Mirror, MirrorOptions};
use rustix::process::{Pid, Signal, kill_process};

const MAX_LAG: Duration = Duration::from_millis(800);

fn options() -> MirrorOptions {
    MirrorOptions { max_lag: MAX_LAG, instance: format!("test-{}", std::process::id()) }
}

#[tokio::test]
async fn a_mirror_follows_lock_holders_and_fails_closed_while_etcd_is_stopped() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let mirror = Mirror::start(gw.clone(), b"/locks/".to_vec(), options());
    poll_until("the mirror catches up", || mirror.holder(b"/locks/a").is_ok()).await;
    assert_eq!(mirror.holder(b"/locks/a"), Ok(None), "nobody holds it");

    // A takes the lock, B queues behind it: the holder is the lowest create revision.
    let a_lease = gw.grant(Duration::from_secs(30)).await.unwrap();
    let a = gw.lock(b"/locks/a", a_lease).await.unwrap();
    let a_token = gw.create_revision(&a.key).await.unwrap().unwrap();
    poll_until("A is the holder", || mirror.holder(b"/locks/a") == Ok(Some(a_token))).await;
    let b_lease = gw.grant(Duration::from_secs(30)).await.unwrap();
    let b = tokio::spawn({
        let gw = gw.clone();
        async move { gw.lock(b"/locks/a", b_lease).await.unwrap() }
    });
    common::eventually("B queues", async || gw.prefixed(b"/locks/a/").await.unwrap().len() == 2).await;
    assert_eq!(mirror.holder(b"/locks/a"), Ok(Some(a_token)), "a waiter does not hold the lock");
    // A lock whose name is a prefix of another's does not see its keys.
    assert_eq!(mirror.holder(b"/locks/"), Ok(None));
    // A's lease ends: B holds the lock.
    gw.revoke(a_lease).await.unwrap();
    let b = b.await.unwrap();
    let b_token = gw.create_revision(&b.key).await.unwrap().unwrap();
    assert!(b_token > a_token);
    poll_until("B is the holder", || mirror.holder(b"/locks/a") == Ok(Some(b_token))).await;

    // etcd stops. The mirror answers only from a proof of freshness at most max_lag old, and
    // no proof can be newer than the stop: so no answer comes later than max_lag after it.
    // (Each look's instant is taken before the look, so a slow test thread cannot help it.)
    let pid = Pid::from_raw(etcd.pid() as i32).unwrap();
    kill_process(pid, Signal::STOP).unwrap();
    let stopped = Instant::now();
    let mut last_answer = stopped;
    poll_until("the mirror stops answering", || {
        let looked = Instant::now();
        match mirror.holder(b"/locks/a") {
            Ok(_) => {
                last_answer = looked;
                false
            }
            Err(e) => matches!(e, Freshness::Lagging(_)),
        }
    })
    .await;
    // 50 ms for the stop to take hold of every etcd thread after kill() returns.
    let answered_for = last_answer - stopped;
    assert!(answered_for <= MAX_LAG + Duration::from_millis(50), "answered {answered_for:?} into the stop");
    kill_process(pid, Signal::CONT).unwrap();
    poll_until("the mirror answers again", || mirror.holder(b"/locks/a") == Ok(Some(b_token))).await;

    // Changes made after the stop are there too.
    gw.revoke(b_lease).await.unwrap();
    poll_until("nobody holds the lock", || mirror.holder(b"/locks/a") == Ok(None)).await;
}

#[tokio::test]
async fn a_mirror_that_cannot_reach_etcd_never_answers() {
    // A port nothing listens on.
    let [port] = common::services::free_ports();
    let gw = Gateway::new(&[format!("http://127.0.0.1:{port}")], Duration::from_millis(200));
    let mirror = Mirror::start(gw, b"/locks/".to_vec(), options());
    for _ in 0..20 {
        assert_eq!(mirror.holder(b"/locks/a"), Err(Freshness::NotCaughtUp));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_mirror_whose_watch_is_cut_reads_the_locks_again_and_misses_nothing() {
    let Some(mut etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let mirror = Mirror::start(gw.clone(), b"/locks/".to_vec(), options());
    let lease = gw.grant(Duration::from_secs(60)).await.unwrap();
    let a = gw.lock(b"/locks/a", lease).await.unwrap();
    let token = gw.create_revision(&a.key).await.unwrap().unwrap();
    poll_until("A is the holder", || mirror.holder(b"/locks/a") == Ok(Some(token))).await;

    // etcd dies and comes back: the watch's connection is gone. A change made meanwhile (the
    // lock released before the mirror could watch again) is found by the new range read.
    etcd.restart().await;
    gw.unlock(&a).await.unwrap();
    poll_until("the mirror sees the release", || mirror.holder(b"/locks/a") == Ok(None)).await;
    // And it follows changes again.
    let b = gw.lock(b"/locks/a", lease).await.unwrap();
    let b_token = gw.create_revision(&b.key).await.unwrap().unwrap();
    poll_until("B is the holder", || mirror.holder(b"/locks/a") == Ok(Some(b_token))).await;
}

/// etcd's count of its watchers.
async fn watchers(etcd: &common::etcd_server::Etcd) -> u64 {
    etcd.metric("etcd_debugging_mvcc_watcher_total ").await
}

/// A watch dropped is a watch etcd ends: the request side of its stream ends with it, and etcd
/// cancels the watcher, which would otherwise keep receiving every change of its range.
#[tokio::test]
async fn a_dropped_watch_ends_at_etcd() {
    let Some(etcd) = start_etcd().await else { return };
    let gw = Gateway::single(&etcd.url());
    let before = watchers(&etcd).await;
    let revision = gw.put(b"/w/a", b"1").await.unwrap();
    let mut watch = fencegate::etcd_client::Watch::open(&gw, b"/w/", b"/w0", revision + 1).await.unwrap();
    assert_eq!(watchers(&etcd).await, before + 1);
    let next = gw.put(b"/w/a", b"2").await.unwrap();
    assert_eq!(watch.next().await.unwrap()[0].kv.mod_revision, next);
    drop(watch);
    common::eventually("etcd ends the watcher", async || watchers(&etcd).await == before).await;
}
