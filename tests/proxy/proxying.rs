//! Proxying: what reaches the backend and what comes back, over HTTP/1.1 and HTTP/2.

use crate::common;

use bytes::Bytes;
use common::backend::{Reply, StubBackend};
use common::{Harness, Resp, poll_until, send_with};
use http::{Method, Request};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[tokio::test]
async fn a_ten_mib_body_streams_intact_both_ways() {
    let h = Harness::start().await;
    let body: Vec<u8> = (0..10 * 1024 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    let body = Bytes::from(body);
    let r = h.send("PUT", "/blob", &[("fencing-token", "1")], body.clone()).await;
    assert_eq!(r.status, 200);
    assert_eq!(h.backend.object("/blob").unwrap(), body, "the backend stored every byte");
    let r = h.get("/blob").await;
    assert_eq!(r.body.len(), body.len());
    assert!(r.body == body, "the read came back intact");
}

#[tokio::test]
async fn backend_down_is_502_json_for_reads_and_writes() {
    let dead = common::dead_address().await;
    let h = Harness::start_with(|c| c.backend.url = format!("http://{dead}").parse().unwrap()).await;
    h.get("/doc").await.assert_refused(502, "backend_unreachable");
    h.put("/doc", 1, "x").await.assert_refused(502, "backend_unreachable");
}

#[tokio::test]
async fn hop_by_hop_headers_are_removed_and_end_to_end_headers_pass() {
    let h = Harness::start().await;
    let r = h
        .raw(
            "PUT /doc HTTP/1.1\r\nHost: app.example\r\nFencing-Token: 3\r\nX-End: kept\r\n\
             Keep-Alive: timeout=5\r\nX-Hop: dropped\r\nConnection: X-Hop\r\nProxy-Authorization: Basic eA==\r\n\
             Content-Type: text/plain",
            "body",
        )
        .await;
    assert_eq!(r.status, 200);
    let got = &h.backend.applied()[0].headers;
    assert_eq!(got["host"], "app.example", "the client's Host passes through");
    assert_eq!(got["x-end"], "kept");
    assert_eq!(got["content-type"], "text/plain");
    assert_eq!(got["fencing-token"], "3");
    assert_eq!(got["x-forwarded-for"], "127.0.0.1");
    for hop in ["x-hop", "keep-alive", "proxy-authorization"] {
        assert!(!got.contains_key(hop), "{hop} reached the backend");
    }
}

async fn h2(h: &Harness, method: Method, path: &str, token: Option<&str>, body: &'static str) -> Resp {
    let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
    let mut req = Request::builder().method(method).uri(h.url(path));
    if let Some(t) = token {
        req = req.header("fencing-token", t);
    }
    send_with(&client, req.body(Full::new(Bytes::from_static(body.as_bytes()))).unwrap()).await
}

#[tokio::test]
async fn http2_clients_are_fenced_and_relayed_to_an_http1_backend() {
    let h = Harness::start().await;
    assert_eq!(h2(&h, Method::PUT, "/doc", Some("8"), "over h2").await.status, 200);
    let r = h2(&h, Method::PUT, "/doc", Some("7"), "zombie").await;
    r.assert_refused(409, "stale_token");
    h2(&h, Method::PUT, "/doc", None, "x").await.assert_refused(428, "missing_token");
    let r = h2(&h, Method::GET, "/doc", None, "").await;
    assert_eq!((r.status, r.body), (200, Bytes::from_static(b"over h2")));
    let applied = h.backend.applied();
    assert_eq!(applied.len(), 1);
    assert_eq!(applied[0].headers["host"], h.addr.to_string(), "the :authority becomes Host");
}

#[tokio::test]
async fn backend_connections_are_reused_and_one_the_backend_closed_is_replaced() {
    // Closes its first connection right after the first response, without announcing it.
    let backend = StubBackend::start_with(|seen| match seen.connection {
        0 => Reply::AnswerThenClose(200, "ok"),
        _ => Reply::Answer(200, "ok"),
    })
    .await;
    let h = Harness::start_with(|c| c.backend.url = backend.url().parse().unwrap()).await;
    for i in 0..4 {
        let r = h.get("/x").await;
        assert_eq!((r.status, &r.body[..]), (200, &b"ok"[..]));
        if i == 0 {
            // The close itself, not a guess at it; from here on the pool must notice it
            // rather than send a request into the closed connection.
            poll_until("the backend closes its first connection", || backend.closed() == 1).await;
        }
    }
    assert_eq!(backend.connections(), 2, "one replacement, then reuse");
}

#[tokio::test]
async fn a_request_without_host_gets_the_backends_authority() {
    let h = Harness::start().await;
    let r = h.raw("GET /doc HTTP/1.0", "").await;
    assert_eq!(r.status, 404);
    let got = &h.backend.requests()[0].headers;
    assert_eq!(got["host"], h.backend.addr().to_string().as_str());
}

#[tokio::test]
async fn a_connection_header_naming_host_does_not_drop_host() {
    let h = Harness::start().await;
    let r = h.raw("GET /doc HTTP/1.1\r\nHost: example.test\r\nConnection: host", "").await;
    assert_eq!(r.status, 404);
    assert_eq!(h.backend.requests()[0].headers["host"], "example.test");
}

/// What a client claims in forwarded headers reaches the backend only from a trusted proxy;
/// anyone else's claims are replaced with what fencegate saw.
#[tokio::test]
async fn forwarded_headers_are_believed_from_trusted_proxies_only() {
    let forged = "PUT /doc HTTP/1.1\r\nHost: app.example\r\nFencing-Token: 3\r\nX-Forwarded-For: 6.6.6.6\r\n\
                  X-Forwarded-Proto: https\r\nForwarded: for=6.6.6.6";
    let untrusted = Harness::start_with(|c| c.headers.forwarded = fencegate::config::Forwarding::Append).await;
    assert_eq!(untrusted.raw(forged, "x").await.status, 200);
    let got = &untrusted.backend.applied()[0].headers;
    assert_eq!(got["x-forwarded-for"], "127.0.0.1", "the client's own claim is dropped");
    assert_eq!(got["x-forwarded-proto"], "http");
    assert_eq!(got["forwarded"], "for=127.0.0.1;proto=http;host=app.example");

    let trusted = Harness::start_with(|c| {
        c.headers.forwarded = fencegate::config::Forwarding::Append;
        c.headers.trusted_proxies = vec!["127.0.0.0/8".parse().unwrap()];
    })
    .await;
    assert_eq!(trusted.raw(forged, "x").await.status, 200);
    let got = &trusted.backend.applied()[0].headers;
    assert_eq!(got["x-forwarded-for"], "6.6.6.6, 127.0.0.1", "a trusted proxy's chain is appended to");
    assert_eq!(got["x-forwarded-proto"], "https", "and its scheme kept");
    assert_eq!(got["forwarded"], "for=6.6.6.6, for=127.0.0.1;proto=http;host=app.example");
}

/// `[headers.request]` and `[headers.response]` rules, changed by a reload.
#[tokio::test]
async fn header_rules_reach_the_backend_and_the_client_and_follow_a_reload() {
    let h = Harness::start_with(|c| {
        c.headers.request.set = vec![("x-env".parse().unwrap(), "prod".parse().unwrap())];
        c.headers.request.remove = vec!["x-debug".parse().unwrap()];
        c.headers.response.add = vec![("x-served-by".parse().unwrap(), "fencegate".parse().unwrap())];
    })
    .await;
    let sent = h.send("PUT", "/doc", &[("fencing-token", "1"), ("x-env", "dev"), ("x-debug", "1")], "a").await;
    assert_eq!(sent.headers["x-served-by"], "fencegate");
    let got = &h.backend.applied()[0].headers;
    assert_eq!((got["x-env"].to_str().unwrap(), got.get("x-debug")), ("prod", None));

    let mut config = h.config.clone();
    config.headers.request.set = vec![("x-env".parse().unwrap(), "staging".parse().unwrap())];
    config.headers.response.add.clear();
    h.proxy.reload(config).unwrap();
    let sent = h.put("/doc", 2, "b").await;
    assert!(sent.headers.get("x-served-by").is_none(), "the reload dropped the response rule");
    assert_eq!(h.backend.applied()[1].headers["x-env"], "staging");
}

/// `X-Forwarded-Host` and `Forwarded`'s `host=` name what the client named: for a request
/// without `Host` (HTTP/1.0), nothing, never the backend's host fencegate sends it with.
#[tokio::test]
async fn forwarded_hosts_name_the_clients_host_never_the_backends() {
    use fencegate::config::Forwarding;
    let h = Harness::start_with(|c| {
        c.headers.x_forwarded_host = Forwarding::Replace;
        c.headers.forwarded = Forwarding::Replace;
    })
    .await;
    assert_eq!(h.raw("PUT /a HTTP/1.0\r\nFencing-Token: 1", "x").await.status, 200);
    assert_eq!(h.raw("PUT /b HTTP/1.1\r\nHost: app.example\r\nFencing-Token: 1", "x").await.status, 200);
    let applied = h.backend.applied();
    let (without, with) = (&applied[0].headers, &applied[1].headers);
    assert!(without.get("x-forwarded-host").is_none(), "{without:?}");
    assert_eq!(without["forwarded"], "for=127.0.0.1;proto=http");
    assert_eq!(with["x-forwarded-host"], "app.example");
    assert_eq!(with["forwarded"], "for=127.0.0.1;proto=http;host=app.example");
}
