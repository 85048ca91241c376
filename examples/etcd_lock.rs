//! A lock holder that writes through fencegate with a token from etcd: it takes the lock
//! `LOCK` with a lease it keeps alive, reads the fencing token (the create revision of its lock
//! key), sends one `PUT PATH` with the token through fencegate, and lets the lock go.
//!
//! ```sh
//! cargo run --example etcd_lock -- http://127.0.0.1:2379 http://127.0.0.1:8080 accounts-42 /accounts/42 'balance=200'
//! ```
//!
//! It speaks etcd's gRPC API through `fencegate::etcd_client::Client`, the client fencegate
//! uses (docs/tokens.md says why not a gRPC crate's). The response body goes to stdout, what
//! happened to stderr; the exit status is 0 for a 2xx answer.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use fencegate::etcd_client;

/// The lease behind the lock: while this process runs it renews it, and if the process dies
/// the lock is free again this long after the last renewal.
const LEASE: Duration = Duration::from_secs(10);

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [etcd_url, fencegate, lock, path, body] = args.as_slice() else {
        eprintln!("usage: etcd_lock ETCD_URL FENCEGATE_URL LOCK PATH BODY");
        std::process::exit(2);
    };
    let gateway = etcd_client::Client::single(etcd_url);
    let lease = gateway.grant(LEASE).await?;
    let renew = gateway.keep_alive(lease, LEASE);
    let held = gateway.lock(lock.as_bytes(), lease).await?;
    let key = String::from_utf8_lossy(&held.key).into_owned();
    let token = gateway.create_revision(&held.key).await?.ok_or("the lock's key is gone: its lease expired")?;
    eprintln!("holding {key}, fencing token {token} (acquired at revision {})", held.acquired_revision);

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = http::Request::put(format!("{}{path}", fencegate.trim_end_matches('/')))
        .header("fencing-token", token.to_string())
        .body(Full::new(Bytes::from(body.clone())))?;
    let resp = client.request(req).await?;
    let status = resp.status();
    let answer = resp.into_body().collect().await?.to_bytes();
    println!("{}", String::from_utf8_lossy(&answer));
    eprintln!("PUT {path} with token {token} -> {status}");

    renew.abort();
    gateway.unlock(&held).await?;
    gateway.revoke(lease).await?;
    if !status.is_success() {
        std::process::exit(1);
    }
    Ok(())
}
