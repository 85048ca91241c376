//! The leader's batches in flight to a real etcd (`store.batches_in_flight`), through a relay
//! that holds a transaction and delivers it late with its answer lost: etcd taking a batch
//! before the one sent ahead of it, a lost answer settled by a barrier that finds the chain
//! past it, and a lost batch cancelled while the one behind it is sent again
//! (tests/cluster/pipeline_model.rs checks the protocol; these check the code).

use crate::common;

use std::time::Duration;

use common::cluster::Cluster;
use common::etcd_server::{Etcd, start_etcd};
use common::eventually;
use common::grpc_relay::{Call, GrpcRelay};
use fencegate::store::{EtcdStore, Mark, MarkBatch, MarkKind, Store, StoreFuture};
use prost::Message as _;

/// How long the store's etcd client waits for an answer: a held transaction's outcome is
/// unknown after this.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// A `max_txn_ops` that one advance fills (two operations, and two for the batch id and the
/// census): beside a batch in flight only a full one goes, so each write here is one.
const ONE_WRITE: usize = 4;

fn is_txn(c: &Call) -> bool {
    c.path == "/etcdserverpb.KV/Txn"
}

/// What the tests read of a transaction's answer (etcd's `TxnResponse`).
#[derive(Clone, PartialEq, prost::Message)]
struct TxnResponse {
    #[prost(bool, tag = "2")]
    succeeded: bool,
}

fn advance<'a>(store: &'a EtcdStore, key: &str, token: u64) -> StoreFuture<'a> {
    store.commit(store.term(), MarkBatch::advance([Mark::key(key)], token))
}

/// An etcd, a cluster's prefix on it, a relay in front of it, and a store leading that prefix
/// through the relay; `None` without etcd (skipped).
async fn leading_world() -> Option<(Etcd, Cluster, GrpcRelay, EtcdStore)> {
    let etcd = start_etcd().await?;
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let relay = GrpcRelay::start(etcd.client).await;
    let store = leading_through(&c, &relay).await;
    Some((etcd, c, relay, store))
}

/// A store on an initialised prefix of `c`, leading, that reaches etcd through `relay`.
async fn leading_through(c: &Cluster, relay: &GrpcRelay) -> EtcdStore {
    c.init().await;
    let client = fencegate::etcd_client::Client::new(&[relay.url()], ANSWER_WITHIN);
    let store = c.open_store_with(client, |o| o.max_txn_ops = ONE_WRITE).await.unwrap();
    store.start(std::sync::Arc::new(|_| {}));
    eventually("it leads", async || store.leading()).await;
    store
}

/// Both advances, `/a` to 10 and `/b` to 20, committed, `overtaken` batches having been sent
/// again on the way.
async fn both_commit(c: &Cluster, store: &EtcdStore, a: StoreFuture<'_>, b: StoreFuture<'_>, overtaken: u64) {
    a.await.unwrap();
    b.await.unwrap();
    assert_eq!(store.batches_overtaken(), overtaken);
    assert_eq!(c.max_seen_in_etcd("/a").await, Some(10));
    assert_eq!(c.max_seen_in_etcd("/b").await, Some(20));
}

/// etcd takes the second batch first: its guard names the first batch's id, which `P/batch`
/// does not hold yet, so the compare fails. The first then commits (late, its answer lost: a
/// barrier finds it committed), and the second is sent again under a new id and commits.
#[tokio::test]
async fn a_batch_etcd_takes_before_the_one_sent_ahead_of_it_is_sent_again() {
    let Some((_etcd, c, relay, store)) = leading_world().await else { return };
    // The transactions of the election are sent before these.
    let before = relay.sent().into_iter().filter(is_txn).count();
    let mut first = relay.hold_next_gated(is_txn);
    let a = advance(&store, "/a", 10);
    first.held().await;
    let b = advance(&store, "/b", 20);
    // The second batch went on at once, and etcd has answered it.
    eventually("etcd answers the second batch", async || {
        let second = relay.sent().into_iter().filter(is_txn).nth(before);
        second.as_ref().is_some_and(|r| relay.answered(r))
    })
    .await;
    first.release();
    assert!(first.delivered().await.answer.is_some_and(|a| a.grpc_status == Some(0)));
    both_commit(&c, &store, a, b, 1).await;
    store.close().await.unwrap();
}

/// Both batches are held and delivered in order, both answers lost. The barrier settling the
/// first finds `P/batch` holding the second's id: the chain got past the first, so both
/// committed, and both writes go.
#[tokio::test]
async fn a_lost_answer_is_settled_by_walking_the_chain_to_the_batch_after_it() {
    let Some((_etcd, c, relay, store)) = leading_world().await else { return };
    let txns = || relay.sent().into_iter().filter(is_txn).count();
    let before = txns();
    let mut first = relay.hold_next_gated(is_txn);
    let mut second = relay.hold_next_gated(is_txn);
    let a = advance(&store, "/a", 10);
    first.held().await;
    let b = advance(&store, "/b", 20);
    second.held().await;
    first.release();
    assert!(first.delivered().await.answer.is_some_and(|a| a.grpc_status == Some(0)));
    second.release();
    assert!(second.delivered().await.answer.is_some_and(|a| a.grpc_status == Some(0)));
    both_commit(&c, &store, a, b, 0).await;
    assert_eq!(txns() - before - 2, 1, "one barrier settled both");
    store.close().await.unwrap();
}

/// The first batch is held past its answer's time: a barrier commits ahead of it, so it can
/// never apply, and its write is refused. The second, whose guard named the first, is sent
/// again behind the barrier and commits; the first, delivered at last, changes nothing.
#[tokio::test]
async fn a_lost_batch_is_cancelled_and_the_one_behind_it_is_sent_again() {
    let Some((_etcd, c, relay, store)) = leading_world().await else { return };
    let mut first = relay.hold_next_gated(is_txn);
    let a = advance(&store, "/a", 10);
    first.held().await;
    let b = advance(&store, "/b", 20);
    let refused = a.await.unwrap_err().to_string();
    assert!(refused.contains("the batch was cancelled and nothing was sent"), "{refused}");
    b.await.unwrap();
    first.release();
    let late = first.delivered().await.answer.expect("etcd answers the late batch");
    assert!(!TxnResponse::decode(late.message).unwrap().succeeded, "the late batch's guard failed");
    assert_eq!(c.max_seen_in_etcd("/a").await, None, "the cancelled batch never applied");
    assert_eq!(c.max_seen_in_etcd("/b").await, Some(20));
    store.close().await.unwrap();
}

/// Each new key of the batches in flight takes room against `max_resources` once: with room
/// for three keys, three new keys in three batches in flight together all commit (counting the
/// first batch's key once more for each batch behind it refused the third with `Full`).
#[tokio::test]
async fn new_keys_of_batches_in_flight_count_once_against_max_resources() {
    let Some(etcd) = start_etcd().await else { return };
    let c = Cluster::build(&[etcd.url()], 1, "").await;
    let relay = GrpcRelay::start(etcd.client).await;
    c.init().await;
    let client = fencegate::etcd_client::Client::new(&[relay.url()], ANSWER_WITHIN);
    let store = c
        .open_store_with(client, |o| {
            o.max_resources = 3;
            o.max_txn_ops = ONE_WRITE;
        })
        .await
        .unwrap();
    store.start(std::sync::Arc::new(|_| {}));
    eventually("it leads", async || store.leading()).await;
    let table = store.table();
    assert_eq!(table.len() + table.count(MarkKind::Floor), 0, "room for three keys");
    let txns = || relay.sent().into_iter().filter(is_txn).count();
    let before = txns();
    let mut first = relay.hold_next_gated(is_txn);
    let a = advance(&store, "/a", 10);
    first.held().await;
    let b = advance(&store, "/b", 20);
    // The second batch is in flight behind the held one before the third is made.
    eventually("the second batch goes out", async || txns() > before).await;
    let c3 = advance(&store, "/c", 30);
    first.release();
    first.delivered().await;
    a.await.unwrap();
    b.await.unwrap();
    c3.await.unwrap();
    assert_eq!(c.max_seen_in_etcd("/a").await, Some(10));
    assert_eq!(c.max_seen_in_etcd("/b").await, Some(20));
    assert_eq!(c.max_seen_in_etcd("/c").await, Some(30));
    store.close().await.unwrap();
}
