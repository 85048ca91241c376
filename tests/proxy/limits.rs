//! Limits: slow, huge and malformed requests are refused with a tagged answer, never
//! forwarded, and never change `max_seen`; and they cannot starve well-behaved clients.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Harness, RawConn, poll_until, raw_request, send_with};
use http::{Method, Request};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[tokio::test]
async fn headers_over_the_limit_get_431_and_are_not_forwarded() {
    let h = Harness::start_with(|c| c.limits.max_header_bytes = 4096).await;
    let big = "x".repeat(5000);
    let r = h.send("PUT", "/doc", &[("fencing-token", "1"), ("x-big", &big)], "v").await;
    r.assert_refused(431, "headers_too_large");
    let r = h.send("GET", "/doc", &[("x-big", &big)], "").await;
    r.assert_refused(431, "headers_too_large");
    assert!(h.backend.requests().is_empty());
    assert_eq!(h.proxy.max_seen("/doc"), None);
    assert_eq!(h.put("/doc", 1, "v").await.status, 200, "normal requests still pass");
}

#[tokio::test]
async fn a_target_over_the_limit_gets_414() {
    let h = Harness::start_with(|c| c.limits.max_uri_bytes = 256).await;
    let long = format!("/{}", "a".repeat(300));
    h.put(&long, 1, "v").await.assert_refused(414, "uri_too_long");
    h.get(&format!("/doc?{}", "q".repeat(300))).await.assert_refused(414, "uri_too_long");
    assert!(h.backend.requests().is_empty());
}

#[tokio::test]
async fn a_declared_body_over_the_limit_gets_413_before_max_seen_moves() {
    let h = Harness::start_with(|c| c.limits.max_body_bytes = 1024).await;
    h.put("/doc", 1, &"x".repeat(2048)).await.assert_refused(413, "body_too_large");
    assert!(h.backend.requests().is_empty());
    assert_eq!(h.proxy.max_seen("/doc"), None, "refused before the advance");
    assert_eq!(h.put("/doc", 1, &"x".repeat(1024)).await.status, 200, "at the limit is fine");
    let r = h.send("GET", "/doc", &[], "x".repeat(4096)).await;
    assert_eq!(r.status, 200, "reads are not limited");
}

#[tokio::test]
async fn a_chunked_body_that_overruns_the_limit_is_cut_off_and_never_applied() {
    let h = Harness::start_with(|c| c.limits.max_body_bytes = 1024).await;
    let chunk = "x".repeat(800);
    let body = format!("320\r\n{chunk}\r\n320\r\n{chunk}\r\n0\r\n\r\n");
    let head =
        "PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    let mut conn = RawConn::open(h.addr).await;
    conn.send(format!("{head}{body}")).await;
    conn.read_response().await.assert_refused(413, "body_too_large");
    // An observation window, not a guess at a state: no state signals that an apply will
    // never come, so a late one gets this long to show.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(h.backend.applied().is_empty(), "a cut-off body is never applied");
    // Part of it may have reached the backend: the resource is quarantined like any write
    // with an unknown outcome.
    h.put("/doc", 2, "v").await.assert_refused(503, "resource_quarantined");
}

#[tokio::test]
async fn hundreds_of_half_open_connections_do_not_delay_a_normal_request_and_are_closed() {
    let h = Harness::start_with(|c| c.limits.header_read_timeout = Duration::from_millis(800)).await;
    let mut slow = Vec::new();
    for _ in 0..300 {
        let mut s = RawConn::open(h.addr).await;
        s.send(b"PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\n").await;
        slow.push(s);
    }
    assert_eq!(h.put("/doc", 1, "v").await.status, 200, "served despite 300 slowloris connections");
    // The server closes every one (EOF, or a 408 then EOF): 10 s is ample past the 800 ms
    // header-read timeout, and short of the 60 s keep-alive timeout that would also close them.
    for s in &mut slow {
        s.read_to_end_within(Duration::from_secs(10)).await;
    }
    assert_eq!(h.applied_tokens("/doc"), [1]);
}

#[tokio::test]
async fn beyond_max_connections_new_connections_wait_for_a_free_slot() {
    let h = Harness::start_with(|c| c.limits.max_connections = 2).await;
    let mut first = RawConn::open(h.addr).await;
    let _second = RawConn::open(h.addr).await;
    // The first is accepted (it has been served once); the second, queued before the third,
    // takes the other slot.
    first.send(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").await;
    first.read_response().await;
    let mut third = RawConn::open(h.addr).await;
    third.send(b"GET /y HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
    // An observation window, not a guess at a state: that the request is not served has no
    // state to poll for, so it gets this long to be served wrongly.
    let answer = third.read_some_within(Duration::from_millis(300), &mut [0u8; 256]).await;
    assert_eq!(answer, None, "a third connection is not served while two are open");
    drop(first);
    assert_eq!(third.read_response().await.status, 404, "served once a slot is free");
}

#[tokio::test]
async fn idle_keep_alive_connections_are_closed_but_busy_ones_are_not() {
    let h = Harness::start_with(|c| c.limits.keepalive_timeout = Duration::from_millis(300)).await;
    // A request the backend holds for three idle periods is answered, and its connection
    // is still good for the next request.
    let mut busy = RawConn::open(h.addr).await;
    let slow = format!(
        "PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\n{}: 900\r\nContent-Length: 1\r\n\r\nv",
        common::DELAY_HEADER
    );
    busy.send(slow).await;
    let r = busy.read_response().await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    busy.send(b"GET /doc HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(busy.read_response().await.status, 200, "the busy connection was kept");
    // Then, left idle, it is closed by the server: within 5 s, short of the 10 s header-read
    // timeout that would also close it.
    let rest = busy.read_to_end_within(Duration::from_secs(5)).await;
    assert!(rest.is_empty(), "the idle connection was closed by the server: {rest:?}");
}

/// A proxy with a single connection slot and a short idle limit.
async fn one_slot() -> Harness {
    Harness::start_with(|c| {
        c.limits.max_connections = 1;
        c.limits.keepalive_timeout = Duration::from_millis(300);
    })
    .await
}

/// The only slot must come free without the help of whoever holds it.
async fn assert_a_new_client_is_served(h: &Harness) {
    let r = tokio::time::timeout(Duration::from_secs(15), h.get("/missing")).await;
    assert_eq!(r.expect("a new client was served").status, 404);
}

#[tokio::test]
async fn a_client_that_stops_reading_a_response_loses_its_slot() {
    let h = one_slot().await;
    let big = "x".repeat(16 << 20);
    assert_eq!(h.put("/big", 1, &big).await.status, 200);
    let mut stalled = RawConn::open(h.addr).await;
    stalled.send(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n").await;
    stalled.read_some(&mut [0u8; 4096]).await; // then never read again
    assert_a_new_client_is_served(&h).await;
}

#[tokio::test]
async fn a_slow_but_steady_download_is_not_cut_off() {
    // The download lasts about 2.5 s, well past the keep-alive timeout; 1 s leaves the reader's
    // 40 ms pauses room to stretch on a loaded machine.
    let h = Harness::start_with(|c| c.limits.keepalive_timeout = Duration::from_secs(1)).await;
    let big = "y".repeat(16 << 20); // more than the socket buffers hold
    assert_eq!(h.put("/big", 1, &big).await.status, 200);
    let mut reader = RawConn::open(h.addr).await;
    reader.send(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
    // Take 256 KiB every 40 ms: about 2.5 s in all, many idle periods long. The pauses are
    // the slow client under test, not a wait for anything.
    let (mut got, mut buf) = (0usize, vec![0u8; 256 << 10]);
    loop {
        let n = reader.read_some(&mut buf).await;
        if n == 0 {
            break;
        }
        got += n;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert!(got > 16 << 20, "the download was cut off after {got} bytes");
}

#[tokio::test]
async fn a_trickled_http2_preface_does_not_hold_a_slot() {
    let h = one_slot().await;
    let mut trickle = RawConn::open(h.addr).await;
    trickle.send(b"PRI * HTTP/2.0\r\n").await;
    assert_a_new_client_is_served(&h).await;
}

#[tokio::test]
async fn http2_streams_beyond_the_limit_wait_for_their_turn() {
    let h = Arc::new(Harness::start_with(|c| c.limits.h2_max_concurrent_streams = 1).await);
    let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http::<Full<Bytes>>();
    let put = |path: &str, delay: &str| {
        Request::builder()
            .method(Method::PUT)
            .uri(h.url(path))
            .header("fencing-token", "1")
            .header(common::DELAY_HEADER, delay)
            .body(Full::new(Bytes::from_static(b"v")))
            .unwrap()
    };
    let (a, b) = (put("/a", "1000"), put("/b", "0"));
    let (c1, c2) = (client.clone(), client.clone());
    let first = tokio::spawn(async move { send_with(&c1, a).await });
    h.wait_received("/a", 1).await;
    let second = tokio::spawn(async move { send_with(&c2, b).await });
    // /b may reach the backend only once /a's stream is over, and so /a applied: the backend
    // holds /a for a second, far longer than it takes to see /b arrive.
    poll_until("the backend receives /b", || h.backend.requests().iter().any(|r| r.path == "/b")).await;
    assert_eq!(h.applied_tokens("/a"), [1], "a second stream opened while /a's was open");
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(second.await.unwrap().status, 200);
}

#[tokio::test]
async fn connect_is_refused_and_fenced_writes_cannot_upgrade() {
    let h = Harness::start().await;
    let r = raw_request(h.addr, "CONNECT backend.test:443 HTTP/1.1\r\nHost: backend.test:443", "").await;
    r.assert_refused(405, "method_not_allowed");
    let r = h
        .raw("PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nConnection: upgrade\r\nUpgrade: websocket", "v")
        .await;
    r.assert_refused(400, "upgrade_refused");
    assert!(h.backend.requests().is_empty());
    assert_eq!(h.proxy.max_seen("/doc"), None);
    // An unfenced request is forwarded without the hop-by-hop Upgrade.
    let r = h.raw("GET /doc HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket", "").await;
    assert_eq!((r.status, r.fencegate_error()), (404, None));
    assert!(!h.backend.requests()[0].headers.contains_key("upgrade"));
}

#[tokio::test]
async fn content_length_with_transfer_encoding_never_reaches_the_backend_as_two_framings() {
    let h = Harness::start().await;
    let head = "PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked";
    let mut conn = RawConn::open(h.addr).await;
    conn.send(format!("{head}\r\n\r\n5\r\nhello\r\n0\r\n\r\n")).await;
    let r = conn.read_response().await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // hyper lets Transfer-Encoding win and drops Content-Length (RFC 9112 §6.3).
    let got = h.backend.requests();
    assert_eq!(got.len(), 1);
    let framings = ["content-length", "transfer-encoding"].iter().filter(|k| got[0].headers.contains_key(**k)).count();
    assert_eq!(framings, 1, "both framings reached the backend: {:?}", got[0].headers);
    assert_eq!(got[0].body, "hello", "the body is the chunked one, not 3 bytes of it");
}

#[tokio::test]
async fn ended_connections_leave_no_task_behind() {
    let h = Harness::start().await;
    // The warm-up opens the backend connection, whose tasks stay. It returns once the proxy
    // has closed the client connection, which the proxy does as that connection's task ends.
    let _ = raw_request(h.addr, "GET /warm HTTP/1.1\r\nHost: x", "").await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    for i in 0..200 {
        let _ = raw_request(h.addr, &format!("GET /x{i} HTTP/1.1\r\nHost: x"), "").await;
    }
    let what = format!("at most {before} + 2 tasks alive after 200 connections");
    poll_until(&what, || metrics.num_alive_tasks() <= before + 2).await;
}

#[tokio::test]
async fn shutdown_closes_an_idle_keep_alive_connection_without_waiting_out_the_grace() {
    let mut h = Harness::start_with(|c| {
        c.limits.keepalive_timeout = Duration::from_secs(60);
        c.server.shutdown_grace = Duration::from_secs(30);
    })
    .await;
    let mut idle = RawConn::open(h.addr).await;
    idle.send(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(idle.read_response().await.status, 404);
    // Both within 5 s: far short of the 30 s grace, the 60 s keep-alive and the 10 s
    // header-read timeouts, which would also end it.
    tokio::time::timeout(Duration::from_secs(5), h.shutdown()).await.expect("drained without waiting out the grace");
    let rest = idle.read_to_end_within(Duration::from_secs(5)).await;
    assert!(rest.is_empty(), "the server closed it with nothing more to say: {rest:?}");
}

/// A proxy with a short header-read timeout, the keep-alive timeout left at its 60 s default,
/// and `tweak` applied on top.
async fn short_header_timeout(tweak: impl FnOnce(&mut fencegate::Config)) -> Harness {
    Harness::start_with(|c| {
        c.limits.header_read_timeout = Duration::from_millis(300);
        tweak(c);
    })
    .await
}

/// Long past the 300 ms header-read timeout and far short of the 60 s keep-alive timeout,
/// which would also close a connection.
const CLOSED_WITHIN: Duration = Duration::from_secs(10);

#[tokio::test]
async fn connections_that_send_nothing_are_closed_after_the_header_read_timeout() {
    let h = short_header_timeout(|c| c.limits.max_connections = 2).await;
    let mut silent = [RawConn::open(h.addr).await, RawConn::open(h.addr).await];
    // Both slots are held by connections that never send a byte; they must not lock a new
    // client out until the keep-alive timeout.
    assert_a_new_client_is_served(&h).await;
    for s in &mut silent {
        let rest = s.read_to_end_within(CLOSED_WITHIN).await;
        assert!(rest.is_empty(), "closed with nothing to say: {rest:?}");
    }
}

#[tokio::test]
async fn an_http2_preface_that_stops_or_a_connection_without_a_request_is_closed_after_the_header_read_timeout() {
    let h = short_header_timeout(|_| {}).await;
    let mut partial = RawConn::open(h.addr).await;
    partial.send(b"PRI * HTTP/2.0\r\n").await;
    let mut preface_only = RawConn::open(h.addr).await;
    preface_only.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    let mut one_byte = RawConn::open(h.addr).await;
    one_byte.send(b"G").await;
    partial.read_to_end_within(CLOSED_WITHIN).await;
    // The server may have sent its SETTINGS and a GOAWAY first.
    preface_only.read_to_end_within(CLOSED_WITHIN).await;
    let rest = one_byte.read_to_end_within(CLOSED_WITHIN).await;
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.is_empty() || rest.starts_with("HTTP/1.1 408"), "closed, perhaps with a 408: {rest:?}");
}

#[tokio::test]
async fn a_first_request_that_takes_longer_than_the_header_read_timeout_is_not_cut_off() {
    let h = short_header_timeout(|_| {}).await;
    // The backend holds the write for three header-read timeouts; the head came in time.
    let mut conn = RawConn::open(h.addr).await;
    let slow = format!(
        "PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\n{}: 900\r\nContent-Length: 1\r\n\r\nv",
        common::DELAY_HEADER
    );
    conn.send(slow).await;
    let r = conn.read_response().await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    conn.send(b"GET /doc HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(conn.read_response().await.status, 200, "the connection is still good");
    // Over HTTP/2 too: the first stream's head came in time.
    let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(Method::PUT)
        .uri(h.url("/h2"))
        .header("fencing-token", "1")
        .header(common::DELAY_HEADER, "900")
        .body(Full::new(Bytes::from_static(b"v")))
        .unwrap();
    assert_eq!(send_with(&client, req).await.status, 200);
}
