//! How S3 bodies travel through fencegate, and a client other than boto3, against moto and
//! s3s-fs (`tests/common/s3/streams.py`): boto3's aws-chunked bodies, which it sends over TLS;
//! its `Expect: 100-continue`; and rclone with the token in `--header`. Each is judged by what
//! the server holds afterwards; a tap (`tests/common/s3/tap.rs`) shows what the server, or
//! fencegate, received.

use std::net::SocketAddr;
use std::path::Path;

use crate::common::pki::Pki;
use crate::common::raw::{RawConn, dead_address};
use crate::common::s3::tap::Tap;
use crate::common::s3::{S3Proxy, S3Server, python, start_moto, start_s3s, succeeded};
use crate::common::services::installed;

/// The config every proxy here starts with: s3s-fs stores objects as files (tests/proxy/s3.rs).
fn s3_config(server: &S3Server) -> String {
    format!("[s3]\nflat_keys = {}\n", server.kind != "s3s")
}

fn addr(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Runs the scenario `name` of streams.py with the client at `fencegate` (`https://` with
/// `ca`).
async fn scenario(name: &str, server: &S3Server, fencegate: &str, ca: Option<&Path>) {
    let mut args =
        [name, server.kind, fencegate, &server.url, &server.access_key, &server.secret].map(str::to_owned).to_vec();
    args.extend(ca.map(|p| p.display().to_string()));
    succeeded(name, server, &python("streams.py", args).await);
}

/// boto3 over https to fencegate, fencegate to the server through a tap.
async fn aws_chunked_against(server: Option<S3Server>) {
    let Some(server) = server else { return };
    let pki = Pki::new();
    let tap = Tap::start(addr(&server.url)).await;
    let tls = format!(
        "[server.tls]\ncert = {:?}\nkey = {:?}\n",
        pki.path("server.pem").display().to_string(),
        pki.path("server-key.pem").display().to_string()
    );
    let proxy = S3Proxy::start(&tap.url(), &format!("{}{tls}", s3_config(&server))).await;
    scenario("aws_chunked", &server, &format!("https://{}", proxy.addr), Some(&pki.path("ca.pem"))).await;
    let received = tap.text().to_ascii_lowercase();
    for (what, seen) in [
        ("an aws-chunked body", "content-encoding: aws-chunked"),
        ("its unsigned streaming payload", "x-amz-content-sha256: streaming-unsigned-payload-trailer"),
        ("its trailer", "\r\nx-amz-checksum-crc32:"),
        ("the fresh body", "fresh-chunked-body"),
    ] {
        assert!(received.contains(seen), "{} did not receive {what} ({seen:?})", server.kind);
    }
    for stale in ["stale-chunked-body", "overtaken-part-body"] {
        assert!(!received.contains(stale), "{} received a refused body ({stale})", server.kind);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_chunked_bodies_reach_the_server_as_sent_and_stale_ones_never() {
    aws_chunked_against(start_moto().await).await;
    aws_chunked_against(start_s3s().await).await;
}

/// boto3 to fencegate through a tap, which shows that the SDK asked for a 100.
async fn expect_against(server: Option<S3Server>) {
    let Some(server) = server else { return };
    let proxy = S3Proxy::start(&server.url, &s3_config(&server)).await;
    let tap = Tap::start(proxy.addr).await;
    scenario("expect_continue", &server, &tap.url(), None).await;
    assert!(tap.text().to_ascii_lowercase().contains("\r\nexpect: 100-continue\r\n"), "boto3 sent no Expect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_expecting_100_continue_land_fresh_and_are_refused_stale() {
    expect_against(start_moto().await).await;
    expect_against(start_s3s().await).await;
}

async fn rclone_against(server: Option<S3Server>) {
    let Some(server) = server else { return };
    let proxy = S3Proxy::start(&server.url, &s3_config(&server)).await;
    scenario("rclone", &server, &proxy.url(), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rclone_copies_with_a_fresh_token_land_and_stale_ones_are_refused() {
    if !installed("rclone", "rclone", &["/usr/bin/rclone"]) {
        return;
    }
    rclone_against(start_moto().await).await;
    rclone_against(start_s3s().await).await;
}

/// A refusal of a write that asked for `Expect: 100-continue` ends the connection (the body
/// never comes, and hyper closes an HTTP/1 connection whose request body is left unread) and
/// says so with `Connection: close`, so that a client that pools connections opens a new one
/// for its next request instead of sending it on one that is closing, which boto3 reports as
/// a 409 with no headers that no server sent. A refusal of a request without a body, or with
/// one sent whole, keeps the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_of_a_write_that_expects_100_continue_says_the_connection_closes() {
    let proxy = S3Proxy::start(&format!("http://{}", dead_address().await), "").await;
    let mut conn = RawConn::open(proxy.addr).await;
    for (what, request) in [
        ("without a body", "DELETE /bkt/k HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
        ("with a body sent whole", "PUT /bkt/k HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\n\r\nv"),
    ] {
        conn.send(request).await;
        let resp = conn.read_response().await;
        assert_eq!((resp.status, resp.headers.get("connection")), (428, None), "a refusal {what}: {:?}", resp.body);
    }
    conn.send("PUT /bkt/k HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n").await;
    let resp = conn.read_response().await;
    assert_eq!(resp.status, 428, "{:?}", resp.body);
    assert_eq!(resp.headers.get("connection").map(|v| v.as_bytes()), Some(&b"close"[..]), "{:?}", resp.headers);
    assert!(conn.read_to_end().await.is_empty(), "the connection ends after the refusal");
}
