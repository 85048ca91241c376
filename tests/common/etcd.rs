//! A small etcd v3 client over etcd's JSON gateway (`POST /v3/...` on the client URL), enough
//! to take a lock and read its fencing token: leases, the lock service, and reads of keys.
//!
//! Why the gateway rather than a gRPC crate: the gRPC clients (`etcd-client`, on tonic) run
//! `protoc` at build time, which a machine with only a Rust toolchain lacks, and `cargo test`
//! must pass there. The gateway is part of etcd itself (3.4 serves it on the client URL), takes
//! the same requests as JSON, and needs nothing beyond hyper, which fencegate already uses. Its
//! JSON has protobuf's mapping: bytes are base64, 64-bit integers are strings, and fields at
//! their zero value are left out.
//!
//! `examples/etcd_lock.rs` uses this file as it is.
#![allow(dead_code)]

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

pub type Error = Box<dyn std::error::Error + Send + Sync>;
pub type Result<T> = std::result::Result<T, Error>;

/// A lock held through etcd's lock service (`/v3/lock/lock`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The holder's key (`NAME/<lease id in hex>`): it exists, attached to the holder's lease,
    /// for as long as the lock is held. `etcdctl lock` exports it as `ETCD_LOCK_KEY`.
    pub key: Vec<u8>,
    /// The revision in the lock response's header: the revision at which the holder saw the
    /// lock become its own. `etcdctl lock` exports this as `ETCD_LOCK_REV`. Not the token: see
    /// [`Gateway::create_revision`].
    pub acquired_revision: i64,
}

/// One key as a range read returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub key: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub lease: i64,
}

/// A client of one etcd member's JSON gateway.
#[derive(Debug, Clone)]
pub struct Gateway {
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Gateway {
    /// `url` is the member's client URL, `http://HOST:PORT`.
    pub fn new(url: &str) -> Gateway {
        Gateway {
            base: url.trim_end_matches('/').to_owned(),
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// POSTs `body` to `path` and returns the JSON answer; an error for any status but 200 (the
    /// gateway answers errors with `{"error": ..., "code": ...}`).
    async fn call(&self, path: &str, body: Value) -> Result<Value> {
        let req = http::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        let resp = self.client.request(req).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        if status != http::StatusCode::OK {
            return Err(format!("{path}: {status}: {}", String::from_utf8_lossy(&bytes)).into());
        }
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// Grants a lease of `ttl` (whole seconds; etcd raises very short ones to its minimum, 2 s
    /// with its default election timeout) and returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64> {
        let answer = self.call("/v3/lease/grant", json!({ "TTL": ttl.as_secs() })).await?;
        int(&answer["ID"]).filter(|id| *id != 0).ok_or_else(|| format!("no lease id in {answer}").into())
    }

    /// Renews `lease` once; returns its TTL from now, 0 once it has expired.
    pub async fn keep_alive_once(&self, lease: i64) -> Result<i64> {
        // A streaming call in gRPC; through the gateway, one request is one renewal.
        let answer = self.call("/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        Ok(int(&answer["result"]["TTL"]).unwrap_or(0))
    }

    /// Renews `lease` every third of `ttl` on a task of its own until the task is aborted (a
    /// holder that stops renewing: a pause, a crash, a partition) or the lease is gone.
    pub fn keep_alive(&self, lease: i64, ttl: Duration) -> JoinHandle<()> {
        let gateway = self.clone();
        tokio::spawn(async move {
            while gateway.keep_alive_once(lease).await.is_ok_and(|left| left > 0) {
                tokio::time::sleep(ttl / 3).await;
            }
        })
    }

    /// Revokes `lease`, deleting every key attached to it (a held lock's key too).
    pub async fn revoke(&self, lease: i64) -> Result<()> {
        self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(drop)
    }

    /// Takes the lock `name` for `lease`, waiting as long as other holders are ahead. Dropping
    /// the future closes the request, and etcd withdraws the waiting key.
    pub async fn lock(&self, name: &str, lease: i64) -> Result<Held> {
        let answer =
            self.call("/v3/lock/lock", json!({ "name": BASE64.encode(name), "lease": lease.to_string() })).await?;
        let key = answer["key"].as_str().ok_or_else(|| format!("no key in {answer}"))?;
        let acquired_revision = int(&answer["header"]["revision"]).ok_or_else(|| format!("no revision in {answer}"))?;
        Ok(Held { key: BASE64.decode(key)?, acquired_revision })
    }

    /// Releases a lock by deleting its key.
    pub async fn unlock(&self, held: &Held) -> Result<()> {
        self.call("/v3/lock/unlock", json!({ "key": BASE64.encode(&held.key) })).await.map(drop)
    }

    /// The create revision of `key`, `None` if it does not exist (a lock key whose lease
    /// expired). For a lock's key this is the fencing token: etcd orders a lock's waiters by
    /// it, so each new holder's is higher than every earlier holder's, and anyone can read it
    /// from the key at any time.
    pub async fn create_revision(&self, key: &[u8]) -> Result<Option<i64>> {
        Ok(self.range(key, None).await?.first().map(|kv| kv.create_revision))
    }

    /// The keys that start with `prefix` (a lock's holder and waiters under `NAME/`), in key
    /// order.
    pub async fn prefixed(&self, prefix: &[u8]) -> Result<Vec<Kv>> {
        self.range(prefix, Some(prefix_end(prefix))).await
    }

    async fn range(&self, key: &[u8], range_end: Option<Vec<u8>>) -> Result<Vec<Kv>> {
        let mut body = json!({ "key": BASE64.encode(key) });
        if let Some(end) = range_end {
            body["range_end"] = Value::String(BASE64.encode(end));
        }
        let answer = self.call("/v3/kv/range", body).await?;
        // Left out, like every empty field, when nothing matched.
        let Some(kvs) = answer["kvs"].as_array() else { return Ok(Vec::new()) };
        kvs.iter()
            .map(|kv| {
                Ok(Kv {
                    key: BASE64.decode(kv["key"].as_str().unwrap_or(""))?,
                    create_revision: int(&kv["create_revision"]).unwrap_or(0),
                    mod_revision: int(&kv["mod_revision"]).unwrap_or(0),
                    lease: int(&kv["lease"]).unwrap_or(0),
                })
            })
            .collect()
    }

    /// Puts `value` at `key`; returns the revision of the write.
    pub async fn put(&self, key: &str, value: &str) -> Result<i64> {
        let answer =
            self.call("/v3/kv/put", json!({ "key": BASE64.encode(key), "value": BASE64.encode(value) })).await?;
        int(&answer["header"]["revision"]).ok_or_else(|| format!("no revision in {answer}").into())
    }
}

/// A 64-bit integer as the gateway writes it: a string (or a number).
fn int(v: &Value) -> Option<i64> {
    v.as_str().and_then(|s| s.parse().ok()).or_else(|| v.as_i64())
}

/// The end of the range of keys that start with `prefix`: `prefix` with its last byte below
/// 0xff raised by one (what `etcdctl get --prefix` sends).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): to the end of the key space.
    vec![0]
}
