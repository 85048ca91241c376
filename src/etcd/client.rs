//! Unary calls through the gateway: key reads and writes, leases and the lock service.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::{EtcdError, b64, bytes, int, prefix_end};

/// A lock held through etcd's lock service (`/v3/lock/lock`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The holder's key (`NAME/<lease id in hex>`): it exists, attached to the holder's lease,
    /// for as long as the lock is held. `etcdctl lock` exports it as `ETCD_LOCK_KEY`.
    pub key: Vec<u8>,
    /// The revision in the lock response's header: the revision at which the holder saw the
    /// lock become its own (`ETCD_LOCK_REV` under `etcdctl lock`). Not the fencing token: that
    /// is the key's create revision ([`Client::create_revision`], docs/tokens.md).
    pub acquired_revision: i64,
}

/// One key as a range read returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: Vec<u8>,
    /// The revision that created it (the fencing token of a lock key).
    pub create_revision: i64,
    /// The revision of its last change.
    pub mod_revision: i64,
    /// Its lease, 0 if none.
    pub lease: i64,
    /// Its value.
    pub value: Vec<u8>,
}

impl Kv {
    pub(crate) fn parse(kv: &Value) -> Option<Kv> {
        Some(Kv {
            key: bytes(&kv["key"])?,
            create_revision: int(&kv["create_revision"])?,
            mod_revision: int(&kv["mod_revision"])?,
            lease: int(&kv["lease"])?,
            value: bytes(&kv["value"])?,
        })
    }
}

/// A client of an etcd cluster's JSON gateway: tries its endpoints in turn, moving on from one
/// that cannot be reached. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    endpoints: Arc<[String]>,
    current: Arc<AtomicUsize>,
    timeout: Duration,
    http: HttpClient<HttpConnector, Full<Bytes>>,
}

impl Client {
    /// A client of the members at `endpoints` (client URLs, `http://HOST:PORT`), each call
    /// given up after `timeout`. Panics on an empty list (config validation refuses one).
    pub fn new(endpoints: &[String], timeout: Duration) -> Client {
        assert!(!endpoints.is_empty(), "an etcd client needs an endpoint");
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        Client {
            endpoints: endpoints.iter().map(|e| e.trim_end_matches('/').to_owned()).collect(),
            current: Arc::new(AtomicUsize::new(0)),
            timeout,
            http: HttpClient::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// A client of one member, with a 5 s timeout.
    pub fn single(url: &str) -> Client {
        Client::new(&[url.to_owned()], Duration::from_secs(5))
    }

    /// The endpoint calls go to now.
    pub fn endpoint(&self) -> &str {
        &self.endpoints[self.current.load(Ordering::Relaxed) % self.endpoints.len()]
    }

    /// Moves on to the next endpoint, after one could not be reached.
    pub(crate) fn next_endpoint(&self) {
        self.current.fetch_add(1, Ordering::Relaxed);
    }

    /// The HTTP client and the time a call may take, for the watch's long-lived request.
    pub(crate) fn http(&self) -> (&HttpClient<HttpConnector, Full<Bytes>>, Duration) {
        (&self.http, self.timeout)
    }

    /// POSTs `body` to `path` and returns the JSON answer. Each endpoint is tried at most once;
    /// an answer that is an error is returned as such, not retried elsewhere.
    pub async fn call(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let mut last = None;
        for _ in 0..self.endpoints.len() {
            let endpoint = self.endpoint().to_owned();
            match tokio::time::timeout(self.timeout, self.call_at(&endpoint, path, &body)).await {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(e @ (EtcdError::Refused { .. } | EtcdError::Malformed { .. }))) => return Err(e),
                Ok(Err(e)) => last = Some(e),
                Err(_) => {
                    let reason = format!("no answer to {path} within {}", humantime::format_duration(self.timeout));
                    last = Some(EtcdError::Unreachable { endpoint, reason });
                }
            }
            self.next_endpoint();
        }
        Err(last.unwrap_or_else(|| EtcdError::Unreachable { endpoint: String::new(), reason: "no endpoint".into() }))
    }

    async fn call_at(&self, endpoint: &str, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let unreachable = |reason: String| EtcdError::Unreachable { endpoint: endpoint.to_owned(), reason };
        let malformed = |reason: String| EtcdError::Malformed { call: path.to_owned(), reason };
        let req = http::Request::post(format!("{endpoint}{path}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| unreachable(e.to_string()))?;
        let resp = self.http.request(req).await.map_err(|e| unreachable(e.to_string()))?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| unreachable(e.to_string()))?.to_bytes();
        if status != http::StatusCode::OK {
            let message = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v["message"].as_str().or(v["error"].as_str()).map(str::to_owned))
                .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
            return Err(EtcdError::Refused {
                endpoint: endpoint.to_owned(),
                call: path.to_owned(),
                status: status.as_u16(),
                message,
            });
        }
        serde_json::from_slice(&body).map_err(|e| malformed(e.to_string()))
    }

    fn malformed(path: &str, answer: &Value) -> EtcdError {
        EtcdError::Malformed { call: path.to_owned(), reason: format!("unexpected answer {answer}") }
    }

    /// The keys in `[key, range_end)` (just `key` without an end), in key order, and the
    /// revision the read saw. A linearizable read: it reflects every write etcd had committed
    /// when it was asked.
    pub async fn range(&self, key: &[u8], range_end: Option<&[u8]>) -> Result<(Vec<Kv>, i64), EtcdError> {
        let mut body = json!({ "key": b64(key) });
        if let Some(end) = range_end {
            body["range_end"] = Value::String(b64(end));
        }
        let path = "/v3/kv/range";
        let answer = self.call(path, body).await?;
        let revision = int(&answer["header"]["revision"]).ok_or_else(|| Client::malformed(path, &answer))?;
        let kvs = match &answer["kvs"] {
            Value::Null => Vec::new(),
            Value::Array(kvs) => {
                kvs.iter().map(Kv::parse).collect::<Option<_>>().ok_or_else(|| Client::malformed(path, &answer))?
            }
            _ => return Err(Client::malformed(path, &answer)),
        };
        Ok((kvs, revision))
    }

    /// The keys that start with `prefix` (a lock's holder and waiters under `NAME/`), in key
    /// order.
    pub async fn prefixed(&self, prefix: &[u8]) -> Result<Vec<Kv>, EtcdError> {
        Ok(self.range(prefix, Some(&prefix_end(prefix))).await?.0)
    }

    /// The create revision of `key`, `None` if it does not exist. For a lock's key this is the
    /// fencing token: etcd orders a lock's waiters by it, so each new holder's is higher than
    /// every earlier holder's, and anyone can read it from the key at any time.
    pub async fn create_revision(&self, key: &[u8]) -> Result<Option<i64>, EtcdError> {
        Ok(self.range(key, None).await?.0.first().map(|kv| kv.create_revision))
    }

    /// Puts `value` at `key`; returns the revision of the write.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<i64, EtcdError> {
        self.put_with_lease(key, value, 0).await
    }

    /// Puts `value` at `key`, attached to `lease` (0: none); returns the revision of the write.
    pub async fn put_with_lease(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        let path = "/v3/kv/put";
        let mut body = json!({ "key": b64(key), "value": b64(value) });
        if lease != 0 {
            body["lease"] = Value::String(lease.to_string());
        }
        let answer = self.call(path, body).await?;
        int(&answer["header"]["revision"]).ok_or_else(|| Client::malformed(path, &answer))
    }

    /// Grants a lease of `ttl` (whole seconds; etcd raises very short ones to its minimum, 2 s
    /// with its default election timeout) and returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let path = "/v3/lease/grant";
        let answer = self.call(path, json!({ "TTL": ttl.as_secs().max(1) })).await?;
        int(&answer["ID"]).filter(|id| *id != 0).ok_or_else(|| Client::malformed(path, &answer))
    }

    /// Renews `lease` once; returns its TTL from now in seconds, 0 once it has expired.
    pub async fn keep_alive_once(&self, lease: i64) -> Result<i64, EtcdError> {
        // A stream in gRPC; through the gateway, one request is one renewal.
        let answer = self.call("/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        Ok(int(&answer["result"]["TTL"]).unwrap_or(0))
    }

    /// Renews `lease` every third of `ttl` on a task of its own until the task is aborted (a
    /// holder that stops renewing: a pause, a crash, a partition) or the lease is gone.
    pub fn keep_alive(&self, lease: i64, ttl: Duration) -> JoinHandle<()> {
        let client = self.clone();
        tokio::spawn(async move {
            while client.keep_alive_once(lease).await.is_ok_and(|left| left > 0) {
                tokio::time::sleep(ttl / 3).await;
            }
        })
    }

    /// Revokes `lease`, deleting every key attached to it (a held lock's key too).
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(drop)
    }

    /// Takes the lock `name` for `lease`, waiting as long as other holders are ahead (this call
    /// is not bounded by the client's timeout). Dropping the future closes the request, and
    /// etcd withdraws the waiting key.
    pub async fn lock(&self, name: &[u8], lease: i64) -> Result<Held, EtcdError> {
        let path = "/v3/lock/lock";
        let endpoint = self.endpoint().to_owned();
        let answer = self.call_at(&endpoint, path, &json!({ "name": b64(name), "lease": lease.to_string() })).await?;
        let key = bytes(&answer["key"]).filter(|k| !k.is_empty()).ok_or_else(|| Client::malformed(path, &answer))?;
        let acquired_revision = int(&answer["header"]["revision"]).ok_or_else(|| Client::malformed(path, &answer))?;
        Ok(Held { key, acquired_revision })
    }

    /// Releases a lock by deleting its key.
    pub async fn unlock(&self, held: &Held) -> Result<(), EtcdError> {
        self.call("/v3/lock/unlock", json!({ "key": b64(&held.key) })).await.map(drop)
    }
}
