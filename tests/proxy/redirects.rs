//! Redirects that would name the backend, and forwarded headers a client claims, against
//! backends that answer with them: what reaches the client, and what the backend believes.

use crate::common;

use std::net::SocketAddr;

use common::nginx::start_nginx;
use common::{Harness, raw_request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A backend that answers every request with `extra` header lines (each ending in CRLF) and
/// 201; `{addr}` in `extra` is replaced with its own address.
async fn location_backend(extra: &'static str) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let extra = extra.replace("{addr}", &addr.to_string());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16384];
                let mut got = Vec::new();
                loop {
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if got.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let resp = format!("HTTP/1.1 201 Created\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n");
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

async fn locations_for(extra: &'static str) -> (SocketAddr, Vec<String>) {
    let backend = location_backend(extra).await;
    let h = Harness::start_with(|c| c.backend.url = format!("http://{backend}").parse().unwrap()).await;
    let r = h.raw("GET /x HTTP/1.1\r\nHost: app.example", "").await;
    let all = r.headers.get_all("location").iter().map(|v| v.to_str().unwrap().to_owned()).collect();
    (backend, all)
}

/// nginx builds an absolute Location from the request's Host and its own port. fencegate
/// forwards the client's Host, so nginx names `app.example:<nginx's port>`: the backend too.
#[tokio::test]
async fn a_location_at_the_clients_host_and_the_backends_port_is_rewritten() {
    let Some(nginx) = start_nginx().await else { return };
    let backend = format!("http://{}", nginx.addr);
    let h = Harness::start_with(|c| c.backend.url = backend.parse().unwrap()).await;
    let r = raw_request(h.addr, "PUT /loc/a HTTP/1.1\r\nHost: app.example:8080\r\nFencing-Token: 1", "a").await;
    assert_eq!(r.status, 201, "{r:?}");
    let location = r.headers["location"].to_str().unwrap();
    eprintln!("nginx at {backend}, Location relayed: {location}");
    assert!(!location.contains(&nginx.addr.port().to_string()), "the backend's port leaks: {location}");
}

/// Every Location line is rewritten, not the first alone.
#[tokio::test]
async fn every_location_line_is_rewritten() {
    let (backend, all) = locations_for("Location: /x\r\nLocation: http://{addr}/x\r\n").await;
    eprintln!("relayed: {all:?}");
    assert!(all.iter().all(|l| !l.contains(&backend.to_string())), "backend address leaks: {all:?}");
}

/// Spellings browsers read as the backend's origin (WHATWG URL: `\` is `/` for http(s)).
#[tokio::test]
async fn spellings_browsers_read_as_the_backend_are_rewritten() {
    for extra in ["Location: http:\\\\{addr}/x\r\n", "Location: /\\{addr}/x\r\n", "Location: http://u@{addr}/x\r\n"] {
        let (backend, all) = locations_for(extra).await;
        eprintln!("{extra:?} relayed as {all:?}");
        assert!(all.iter().all(|l| !l.contains(&backend.to_string())), "backend address leaks: {all:?}");
    }
}

/// With the default `[headers]`, a client's own `Forwarded` and `X-Forwarded-Host` (both off)
/// never reach the backend: off passes only a trusted proxy's.
#[tokio::test]
async fn forwarded_headers_that_are_off_are_not_passed_from_a_client() {
    let h = Harness::start().await;
    let head = "PUT /doc HTTP/1.1\r\nHost: app.example\r\nFencing-Token: 1\r\nForwarded: for=6.6.6.6;proto=https;host=bank.example\r\n\
                X-Forwarded-Host: bank.example\r\nX_Forwarded_Proto: https\r\nX-Forwarded-Port: 443";
    assert_eq!(h.raw(head, "x").await.status, 200);
    let got = &h.backend.applied()[0].headers;
    eprintln!("backend got: {got:?}");
    assert!(got.get("forwarded").is_none(), "forged Forwarded reached the backend: {:?}", got.get("forwarded"));
    assert!(got.get("x-forwarded-host").is_none(), "forged X-Forwarded-Host reached the backend");
}
