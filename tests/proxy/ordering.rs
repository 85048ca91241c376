//! Ordering: one resource's accepted writes reach the backend one at a time, in increasing
//! token order; different resources never wait for each other.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Harness, RawConn, Resp, eventually};
use tokio::task::JoinHandle;

/// A PUT the backend holds for `delay_ms`, sent in the background.
fn spawn_slow_put(h: &Arc<Harness>, path: &'static str, token: u64, delay_ms: u64) -> JoinHandle<Resp> {
    let h = Arc::clone(h);
    tokio::spawn(async move { h.slow_put(path, token, delay_ms).await })
}

fn strictly_increasing(tokens: &[u64]) -> bool {
    tokens.windows(2).all(|w| w[0] < w[1])
}

#[tokio::test]
async fn a_slow_first_write_is_applied_before_a_higher_one_that_arrives_meanwhile() {
    let h = Arc::new(Harness::start().await);
    let slow = spawn_slow_put(&h, "/doc", 10, 400);
    h.wait_received("/doc", 10).await;
    let fast = h.put("/doc", 11, "eleven").await;
    assert_eq!(fast.status, 200);
    assert_eq!(slow.await.unwrap().status, 200);
    assert_eq!(h.applied_tokens("/doc"), [10, 11], "the backend applied them in token order");
    assert_eq!(h.backend.object("/doc").unwrap(), "eleven");
}

#[tokio::test]
async fn a_higher_token_that_takes_its_turn_first_makes_a_waiting_lower_one_stale() {
    let h = Arc::new(Harness::start().await);
    let first = spawn_slow_put(&h, "/doc", 10, 500);
    h.wait_received("/doc", 10).await;
    let high = spawn_slow_put(&h, "/doc", 12, 0);
    h.wait_queue_len("/doc", 2).await; // 12 queued behind 10
    let low = spawn_slow_put(&h, "/doc", 11, 0);
    h.wait_queue_len("/doc", 3).await; // 11 passed the early check (11 > 10) and queued behind 12
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(high.await.unwrap().status, 200);
    let r = low.await.unwrap();
    r.assert_refused(409, "stale_token");
    assert_eq!(r.json()["max_seen"], 12);
    assert_eq!(h.applied_tokens("/doc"), [10, 12]);
}

#[tokio::test]
async fn twenty_four_writers_racing_one_resource_are_applied_in_strictly_increasing_order() {
    let h = Arc::new(Harness::start().await);
    // Distinct tokens in a scrambled order, sent all at once; the backend is slow enough
    // (5 ms a write) that they genuinely overlap.
    let tokens: Vec<u64> = (1..=24u64).map(|i| (i * 7) % 25).collect();
    let tasks: Vec<_> = tokens
        .iter()
        .map(|&t| {
            let h = Arc::clone(&h);
            tokio::spawn(async move { (t, h.slow_put("/hot", t, 5).await) })
        })
        .collect();
    let mut accepted = Vec::new();
    for task in tasks {
        let (token, r) = task.await.unwrap();
        match r.status {
            200 => accepted.push(token),
            409 => r.assert_refused(409, "stale_token"),
            other => panic!("token {token}: unexpected {other} {:?}", r.body),
        }
    }
    let applied = h.applied_tokens("/hot");
    assert!(strictly_increasing(&applied), "applied out of order: {applied:?}");
    accepted.sort_unstable();
    assert_eq!(accepted, applied, "accepted set equals applied set");
    assert_eq!(applied.last(), Some(&24), "the highest token can never be stale");
    assert_eq!(h.proxy.max_seen("/hot"), Some(24));
}

#[tokio::test]
async fn writes_to_different_resources_never_wait_for_each_other() {
    let h = Arc::new(Harness::start().await);
    let slow = spawn_slow_put(&h, "/a", 1, 3000);
    h.wait_received("/a", 1).await;
    assert_eq!(h.put("/b", 1, "b").await.status, 200);
    assert!(!slow.is_finished(), "/b completed while /a's write was still in flight");
    assert_eq!(h.applied_tokens("/b"), [1]);
    assert!(h.applied_tokens("/a").is_empty());
    assert_eq!(slow.await.unwrap().status, 200);
}

#[tokio::test]
async fn a_write_that_waits_longer_than_the_queue_bound_gets_503() {
    let h = Arc::new(Harness::start_with(|c| c.fence.queue_timeout = Duration::from_millis(150)).await);
    let slow = spawn_slow_put(&h, "/doc", 1, 1000);
    h.wait_received("/doc", 1).await;
    // A token already stale is refused at once, without queueing behind the busy resource.
    h.put("/doc", 1, "stale").await.assert_refused(409, "stale_token");
    let r = h.put("/doc", 2, "two").await;
    r.assert_refused(503, "queue_timeout");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(slow.await.unwrap().status, 200);
    assert_eq!(h.applied_tokens("/doc"), [1], "the timed-out write was never forwarded");
    assert_eq!(h.proxy.max_seen("/doc"), Some(1), "and never advanced max_seen");
}

#[tokio::test]
async fn a_backend_timeout_is_504_and_quarantines_the_resource() {
    let h = Harness::start_with(|c| {
        c.backend.request_timeout = Duration::from_millis(400);
        c.fence.quarantine = Duration::from_millis(1500);
    })
    .await;
    // The backend applies this one late, after fencegate gave up on it.
    h.slow_put("/doc", 5, 900).await.assert_refused(504, "backend_timeout");
    assert_eq!(h.proxy.max_seen("/doc"), Some(5), "max_seen advanced before forwarding");
    let r = h.put("/doc", 6, "six").await;
    r.assert_refused(503, "resource_quarantined");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(h.put("/other", 1, "x").await.status, 200, "only the timed-out resource is closed");
    eventually("/doc reopens after the quarantine", async || h.put("/doc", 6, "six").await.status == 200).await;
    assert_eq!(h.applied_tokens("/doc"), [5, 6], "the late write landed before the next one was sent");
}

#[tokio::test]
async fn a_write_abandoned_by_its_client_keeps_the_resource_until_the_backend_answers() {
    // One connection slot: the next request is served only once the proxy has seen the
    // hang-up below and closed that connection.
    let h = Harness::start_with(|c| c.limits.max_connections = 1).await;
    let mut abandoned = RawConn::open(h.addr).await;
    let head = format!("PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\n{}: 600", common::DELAY_HEADER);
    abandoned.send(format!("{head}\r\nContent-Length: 1\r\n\r\nv")).await;
    h.wait_received("/doc", 1).await;
    drop(abandoned); // the client hangs up mid-request
    assert_eq!(h.put("/doc", 2, "two").await.status, 200);
    assert_eq!(h.applied_tokens("/doc"), [1, 2], "2 was sent only after the backend answered 1");
}

#[tokio::test]
async fn shutdown_lets_a_slow_in_flight_write_finish_before_the_store_closes() {
    let mut h = Harness::start().await;
    let addr = h.addr;
    let slow = tokio::spawn(async move {
        let head = format!("PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 9\r\n{}: 600", common::DELAY_HEADER);
        common::raw_request(addr, &head, "v").await
    });
    h.wait_received("/doc", 9).await;
    h.shutdown().await; // returns once connections have drained and the store is closed
    assert_eq!(slow.await.unwrap().status, 200, "the in-flight write was answered, not cut off");
    assert_eq!(h.applied_tokens("/doc"), [9]);
    h.restart().await;
    h.put("/doc", 9, "again").await.assert_refused(409, "stale_token");
    assert_eq!(h.put("/doc", 10, "ten").await.status, 200, "answered before shutdown: not quarantined");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_multi_thread_runtime_writers_racing_one_resource_are_applied_in_order_and_survive_a_restart() {
    // The store's writer runs its syncs in block_in_place on such a runtime.
    let mut h = Harness::start().await;
    let tokens: Vec<u64> = (1..=24u64).map(|i| (i * 7) % 25).collect();
    let shared = Arc::new(h);
    let tasks: Vec<_> = tokens
        .iter()
        .map(|&t| {
            let h = Arc::clone(&shared);
            tokio::spawn(async move { h.slow_put("/hot", t, 2).await.status })
        })
        .collect();
    for task in tasks {
        assert!(matches!(task.await.unwrap(), 200 | 409));
    }
    h = Arc::into_inner(shared).expect("every request finished");
    let applied = h.applied_tokens("/hot");
    assert!(strictly_increasing(&applied), "applied out of order: {applied:?}");
    assert_eq!(applied.last(), Some(&24));
    h.restart().await;
    assert_eq!(h.proxy.max_seen("/hot"), Some(24));
    h.put("/hot", 24, "stale").await.assert_refused(409, "stale_token");
    assert_eq!(h.put("/hot", 25, "ok").await.status, 200, "nothing left quarantined");
    h.shutdown().await;
}

/// fencegate in front of an early-answering backend, and a write of token 10 to `/r` of which
/// the client has sent half the body; the backend has answered its head.
async fn a_write_half_sent() -> (Harness, RawConn, Arc<std::sync::Mutex<Vec<String>>>) {
    let (backend, log) = common::backend::early_answering_backend().await;
    let h = Harness::start_with(|c| c.backend.url = format!("http://{backend}").parse().unwrap()).await;
    let mut first = RawConn::open(h.addr).await;
    first.send(b"PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 10\r\nContent-Length: 10\r\n\r\nhalf-").await;
    common::poll_until("the backend has the first write's head", || log.lock().unwrap().len() == 1).await;
    (h, first, log)
}

#[tokio::test]
async fn an_early_answer_does_not_end_a_write_whose_body_is_still_arriving() {
    let (h, mut first, log) = a_write_half_sent().await;
    let second = tokio::spawn(common::raw_request(h.addr, "PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 20", "later"));
    common::poll_until("the second write waits, or has reached the backend", || {
        h.proxy.queue_len("/r") == 2 || log.lock().unwrap().len() > 1
    })
    .await;
    assert_eq!(*log.lock().unwrap(), ["head 10"], "the next write waits until the backend has the whole first one");
    first.send(b"whole").await;
    assert_eq!(first.read_response().await.status, 201, "the early answer is relayed once the body is in");
    assert_eq!(second.await.unwrap().status, 201);
    common::poll_until("the backend has both bodies", || log.lock().unwrap().len() == 4).await;
    assert_eq!(*log.lock().unwrap(), ["head 10", "body 10", "head 20", "body 20"]);
}

#[tokio::test]
async fn a_write_abandoned_after_an_early_answer_quarantines_its_resource() {
    let (h, first, log) = a_write_half_sent().await;
    drop(first); // the client goes away with half its body sent
    common::poll_until("the abandoned write gives its turn back", || h.proxy.queue_len("/r") == 0).await;
    let next = common::raw_request(h.addr, "PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 20", "v").await;
    next.assert_refused(503, "resource_quarantined");
    assert_eq!(*log.lock().unwrap(), ["head 10"], "nothing more reached the backend");
}

/// A backend that refuses every request with a 400 as soon as it has read the head, and ends
/// the exchange there (`Connection: close`) without waiting for the body, as S3 servers do
/// with a request they refuse.
async fn early_refusing_backend() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut chunk = [0u8; 4096];
                    match tcp.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let refusal = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 7\r\nconnection: close\r\n\r\nrefused";
                let _ = tcp.write_all(refusal).await;
                // Said and done: no more is written, and what still comes is read and dropped,
                // so the refusal is not lost to a reset.
                let _ = tcp.shutdown().await;
                let mut sink = [0u8; 65536];
                while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_refusal_the_backend_sends_before_taking_the_body_is_the_answer() {
    let backend = early_refusing_backend().await;
    let h = Harness::start_with(|c| c.backend.url = format!("http://{backend}").parse().unwrap()).await;
    // Far more than the sockets between fencegate and the backend buffer: the backend has
    // closed long before the body is through.
    let body = vec![b'x'; 16 << 20];
    let answer = h.send("PUT", "/r", &[("fencing-token", "10")], body).await;
    assert_eq!(
        (answer.status, &answer.body[..]),
        (400, &b"refused"[..]),
        "{:?}",
        String::from_utf8_lossy(&answer.body)
    );
    // It applied nothing, so nothing is quarantined: the next write reaches the backend.
    let next = common::raw_request(h.addr, "PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 20", "v").await;
    assert_eq!(next.status, 400, "{next:?}");
}
