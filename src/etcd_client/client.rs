//! The client and its unary calls through the gateway: key reads and writes, leases and the
//! lock service, each tried at the members in turn.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::answer::{self, Failure};
use super::auth::Auth;
use super::transport::{self, ClientOptions, Transport, chain};
use super::wire::{self, GrantAnswer, Headed, KeepAliveAnswer, LockAnswer, RangeAnswer};
use super::{EtcdError, b64, prefix_end};

/// A lock held through etcd's lock service (`/v3/lock/lock`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLock {
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

/// Calls that do no harm made twice, and so go to the next member after one that may have
/// taken them without answering: reads, renewals, deleting a lock's key, opening a watch.
/// Others (puts, transactions, grants, revokes, taking a lock) are not sent again once a member
/// may have taken them: the caller gets the error, and decides.
const REPEATABLE: &[&str] = &[
    "/v3/kv/range",
    "/v3/lease/keepalive",
    "/v3/lease/timetolive",
    "/v3/lease/leases",
    "/v3/lock/unlock",
    "/v3/maintenance/status",
    "/v3/watch",
];

/// One kind of request, sent to one member with one token.
pub(crate) trait Exchange: Sync {
    /// What it gives when it succeeds.
    type Answer;

    /// Sends it to `endpoint`.
    fn send(
        &self,
        client: &Client,
        endpoint: &str,
        token: Option<&str>,
    ) -> impl Future<Output = Result<Self::Answer, Failure>> + Send;
}

/// A unary call: its answer, decoded as an `A`. Unbounded, it waits as long as etcd takes (a
/// lock).
struct Unary<'a, A> {
    path: &'a str,
    body: &'a Value,
    bounded: bool,
    answer: PhantomData<fn() -> A>,
}

impl<'a, A> Unary<'a, A> {
    fn new(path: &'a str, body: &'a Value, bounded: bool) -> Self {
        Unary { path, body, bounded, answer: PhantomData }
    }
}

impl<A: DeserializeOwned + Send> Exchange for Unary<'_, A> {
    type Answer = A;

    fn send(
        &self,
        client: &Client,
        endpoint: &str,
        token: Option<&str>,
    ) -> impl Future<Output = Result<A, Failure>> + Send {
        client.unary(endpoint, self.path, self.body, token, self.bounded)
    }
}

/// A client of an etcd cluster's JSON gateway: tries its endpoints in turn, moving on from one
/// that cannot be reached or cannot serve now, over plain HTTP or TLS, authenticated where
/// given credentials. Cheap to clone; clones share their token and the endpoint in use.
#[derive(Debug, Clone)]
pub struct Client {
    endpoints: Arc<[String]>,
    current: Arc<AtomicUsize>,
    timeout: Duration,
    transport: Transport,
    auth: Option<Arc<Auth>>,
}

impl Client {
    /// A client of the members at `endpoints` (client URLs, `http://HOST:PORT`), each call
    /// given up after `timeout`, without TLS or credentials ([`Client::from_options`] has
    /// both). Panics on an empty list (config validation refuses one).
    pub fn new(endpoints: &[String], timeout: Duration) -> Client {
        assert!(!endpoints.is_empty(), "an etcd client needs an endpoint");
        Client::with(endpoints, timeout, Transport::plain(timeout), None)
    }

    /// A client of one member, with a 5 s timeout.
    pub fn single(url: &str) -> Client {
        Client::new(&[url.to_owned()], Duration::from_secs(5))
    }

    /// A client as `options` say. Reads the TLS files it names (and, for `https://` endpoints
    /// without a CA, the system's roots); does not talk to etcd: the first call authenticates.
    pub fn from_options(options: &ClientOptions) -> Result<Client, EtcdError> {
        let transport = transport::transport(options)?;
        let auth = match &options.credentials {
            Some(c) if c.username.is_empty() => return Err(EtcdError::Options("an empty user name".into())),
            Some(c) => Some(Arc::new(Auth::new(c.clone()))),
            None => None,
        };
        Ok(Client::with(&options.endpoints, options.request_timeout, transport, auth))
    }

    fn with(endpoints: &[String], timeout: Duration, transport: Transport, auth: Option<Arc<Auth>>) -> Client {
        Client {
            endpoints: endpoints.iter().map(|e| e.trim_end_matches('/').to_owned()).collect(),
            current: Arc::new(AtomicUsize::new(0)),
            timeout,
            transport,
            auth,
        }
    }

    /// The endpoint calls go to now.
    pub fn endpoint(&self) -> &str {
        &self.endpoints[self.current.load(Ordering::Relaxed) % self.endpoints.len()]
    }

    /// Moves on to the next endpoint, after one could not be reached or serve.
    pub(crate) fn next_endpoint(&self) {
        self.current.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn auth(&self) -> Option<&Auth> {
        self.auth.as_deref()
    }

    /// The user calls are made as; empty without credentials.
    pub(crate) fn user(&self) -> &str {
        self.auth().map_or("", Auth::user)
    }

    /// The transport and the time a request may take, for the watch's long-lived request.
    pub(crate) fn transport(&self) -> (&Transport, Duration) {
        (&self.transport, self.timeout)
    }

    /// POSTs `body` to `path` and returns the answer, decoded as an `A` (a [`Value`] takes any
    /// JSON; an answer that does not decode is [`EtcdError::Malformed`]). Each endpoint is
    /// tried at most once, from the one in use: the next one after a member that could not be
    /// reached or answered that it cannot serve now ("no leader", a learner), and, for a call
    /// that does no harm made twice, after one that may have taken it (no answer in time,
    /// "request timed out"). A token etcd refuses is renewed once. Any other error answer is
    /// returned as it is.
    pub async fn call<A: DeserializeOwned + Send>(&self, path: &str, body: Value) -> Result<A, EtcdError> {
        self.attempt(path, &Unary::new(path, &body, true)).await
    }

    /// Makes a call with `exchange`, as [`Client::call`] says.
    pub(crate) async fn attempt<E: Exchange>(&self, path: &str, exchange: &E) -> Result<E::Answer, EtcdError> {
        let repeatable = REPEATABLE.contains(&path);
        let mut last = None;
        for _ in 0..self.endpoints.len() {
            let endpoint = self.endpoint().to_owned();
            match self.at(&endpoint, exchange).await {
                Ok(answer) => return Ok(answer),
                Err(Failure::Elsewhere(e)) => last = Some(e),
                Err(Failure::Unknown(e)) if repeatable => last = Some(e),
                Err(Failure::Unknown(e)) => {
                    // Not again, but the next call goes elsewhere.
                    self.next_endpoint();
                    return Err(e);
                }
                Err(Failure::Token(e) | Failure::Final(e)) => return Err(e),
            }
            self.next_endpoint();
        }
        Err(last.unwrap_or_else(|| EtcdError::Unreachable { endpoint: String::new(), reason: "no endpoint".into() }))
    }

    /// `exchange` at `endpoint` with the token, and once more with a new token if etcd refuses
    /// it.
    async fn at<E: Exchange>(&self, endpoint: &str, exchange: &E) -> Result<E::Answer, Failure> {
        let token = self.token(endpoint).await?;
        match exchange.send(self, endpoint, token.as_deref()).await {
            Err(Failure::Token(_)) if self.auth.is_some() => {
                let renewed = self.renew(endpoint, token).await?;
                match exchange.send(self, endpoint, renewed.as_deref()).await {
                    Err(Failure::Token(e)) => Err(Failure::Final(e)),
                    other => other,
                }
            }
            Err(Failure::Token(EtcdError::Unauthenticated { endpoint, user, message })) => {
                let message = format!("{message} (etcd has authentication enabled; the client has no credentials)");
                Err(Failure::Final(EtcdError::Unauthenticated { endpoint, user, message }))
            }
            other => other,
        }
    }

    /// One request to `endpoint`, its answer decoded as an `A`; when `bounded`, given up after
    /// the client's timeout.
    pub(crate) async fn unary<A: DeserializeOwned>(
        &self,
        endpoint: &str,
        path: &str,
        body: &Value,
        token: Option<&str>,
        bounded: bool,
    ) -> Result<A, Failure> {
        let exchange = async {
            let resp = self.transport.post(endpoint, path, body, token).await?;
            let status = resp.status();
            let body = resp.into_body().collect().await.map_err(|e| {
                Failure::Unknown(EtcdError::Unreachable { endpoint: endpoint.to_owned(), reason: chain(&e) })
            })?;
            let body = body.to_bytes();
            if status != http::StatusCode::OK {
                return Err(answer::of_body(endpoint, path, self.user(), status.as_u16(), &body));
            }
            wire::decode(path, &body).map_err(Failure::Final)
        };
        if !bounded {
            return exchange.await;
        }
        tokio::time::timeout(self.timeout, exchange).await.unwrap_or_else(|_| {
            let reason = format!("no answer to {path} within {}", humantime::format_duration(self.timeout));
            Err(Failure::Unknown(EtcdError::Unreachable { endpoint: endpoint.to_owned(), reason }))
        })
    }

    /// The keys in `[key, range_end)` (just `key` without an end), in key order, and the
    /// revision the read saw. A linearizable read: it reflects every write etcd had committed
    /// when it was asked.
    pub async fn range(&self, key: &[u8], range_end: Option<&[u8]>) -> Result<(Vec<Kv>, i64), EtcdError> {
        let mut body = json!({ "key": b64(key) });
        if let Some(end) = range_end {
            body["range_end"] = Value::String(b64(end));
        }
        let answer: RangeAnswer = self.call("/v3/kv/range", body).await?;
        Ok((answer.kvs.into_iter().map(Kv::from).collect(), answer.header.revision))
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
        let mut body = json!({ "key": b64(key), "value": b64(value) });
        if lease != 0 {
            body["lease"] = Value::String(lease.to_string());
        }
        let answer: Headed = self.call("/v3/kv/put", body).await?;
        Ok(answer.header.revision)
    }

    /// Grants a lease of `ttl` (whole seconds; etcd raises very short ones to its minimum, 2 s
    /// with its default election timeout) and returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let answer: GrantAnswer = self.call("/v3/lease/grant", json!({ "TTL": ttl.as_secs().max(1) })).await?;
        Ok(answer.id)
    }

    /// Renews `lease` once; returns its TTL from now in seconds, 0 once it has expired.
    pub async fn keep_alive_once(&self, lease: i64) -> Result<i64, EtcdError> {
        // A stream in gRPC; through the gateway, one request is one renewal.
        let answer: KeepAliveAnswer = self.call("/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        Ok(answer.result.ttl)
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
        self.call::<Headed>("/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(drop)
    }

    /// Takes the lock `name` for `lease`, waiting as long as other holders are ahead (this call
    /// is not bounded by the client's timeout; a member that cannot serve it passes it on, as
    /// [`Client::call`] says). Dropping the future closes the request, and etcd withdraws the
    /// waiting key.
    pub async fn lock(&self, name: &[u8], lease: i64) -> Result<HeldLock, EtcdError> {
        let path = "/v3/lock/lock";
        let body = json!({ "name": b64(name), "lease": lease.to_string() });
        let answer: LockAnswer = self.attempt(path, &Unary::new(path, &body, false)).await?;
        Ok(HeldLock { key: answer.key, acquired_revision: answer.header.revision })
    }

    /// Releases a lock by deleting its key.
    pub async fn unlock(&self, held: &HeldLock) -> Result<(), EtcdError> {
        self.call::<Headed>("/v3/lock/unlock", json!({ "key": b64(&held.key) })).await.map(drop)
    }
}
