//! Backend connections: a fenced write gets its connection before its token is used up, so a
//! backend that cannot be reached, or has no connection free under `backend.max_connections`,
//! leaves `max_seen` where it was and the holder may send the write again with the same token.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::backend::{Reply, StubBackend};
use common::{Harness, poll_until};

#[tokio::test]
async fn a_write_the_unreachable_backend_never_got_may_be_sent_again_with_the_same_token() {
    let dead = common::dead_address().await;
    let h = Harness::start_with(|c| c.backend.url = format!("http://{dead}").parse().unwrap()).await;
    h.put("/doc", 5, "first try").await.assert_refused(502, "backend_unreachable");
    assert_eq!(h.proxy.max_seen("/doc"), None, "the token was not used up");
    h.get("/doc").await.assert_refused(502, "backend_unreachable");

    // The backend comes up (here: the config points to one that runs).
    let mut config = h.config.clone();
    config.backend.url = h.backend.url().parse().unwrap();
    h.proxy.reload(config).unwrap();
    assert_eq!(h.put("/doc", 5, "second try").await.status, 200, "the same token is accepted");
    assert_eq!(h.applied_tokens("/doc"), [5]);
    assert_eq!(h.backend.object("/doc").unwrap(), "second try");
    h.put("/doc", 5, "once more").await.assert_refused(409, "stale_token");
}

/// A proxy allowed one backend connection (and 250 ms to wait for it), whose backend holds its
/// answer to a `GET /slow` until released: returns once that GET holds the connection.
async fn one_connection_held() -> (StubBackend, Arc<Harness>, tokio::task::JoinHandle<common::Resp>) {
    let backend = StubBackend::start_with(|seen| match seen.head.starts_with("GET /slow ") {
        true => Reply::Hold(200, "slow"),
        false => Reply::Answer(200, "ok"),
    })
    .await;
    let h = Arc::new(
        Harness::start_with(|c| {
            c.backend.url = backend.url().parse().unwrap();
            c.backend.max_connections = 1;
            c.backend.pool_timeout = Duration::from_millis(250);
        })
        .await,
    );
    let slow = tokio::spawn({
        let h = Arc::clone(&h);
        async move { h.get("/slow").await }
    });
    poll_until("the backend holds the answer to the slow GET", || backend.requests().len() == 1).await;
    (backend, h, slow)
}

#[tokio::test]
async fn a_write_that_finds_every_backend_connection_busy_gets_503_and_may_retry_with_the_same_token() {
    let (backend, h, slow) = one_connection_held().await;

    // The only connection is busy: the write waits `pool_timeout` for it, then gives up.
    let r = h.put("/doc", 5, "five").await;
    r.assert_refused(503, "backend_busy");
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(h.proxy.max_seen("/doc"), None, "the token was not used up");
    // Reads are bounded by the same limit.
    h.get("/other").await.assert_refused(503, "backend_busy");
    assert_eq!(backend.requests().len(), 1, "nothing else reached the backend");

    backend.release();
    let r = slow.await.unwrap();
    assert_eq!((r.status, &r.body[..]), (200, &b"slow"[..]));
    assert_eq!(h.put("/doc", 5, "five").await.status, 200, "the same token is accepted");
    assert_eq!(h.proxy.max_seen("/doc"), Some(5));
    let heads: Vec<String> = backend.requests().iter().map(|s| s.head.lines().next().unwrap().to_owned()).collect();
    assert_eq!(heads, ["GET /slow HTTP/1.1", "PUT /doc HTTP/1.1"]);
    assert_eq!(backend.connections(), 1, "never more than the one connection allowed");
}

#[tokio::test]
async fn a_reload_that_renews_the_backend_connections_keeps_them_under_one_bound() {
    let (backend, h, slow) = one_connection_held().await;

    // A changed backend setting makes a new pool; the connection the old one still has in use
    // counts against the same bound.
    let mut config = h.config.clone();
    config.backend.connect_timeout += Duration::from_millis(1);
    h.proxy.reload(config).unwrap();
    h.put("/doc", 5, "five").await.assert_refused(503, "backend_busy");

    backend.release();
    assert_eq!(slow.await.unwrap().status, 200);
    // The old pool closes the connection it got back, and its permit serves the new pool.
    assert_eq!(h.put("/doc", 5, "five").await.status, 200, "the same token is accepted");
    assert_eq!(h.proxy.max_seen("/doc"), Some(5));
}
