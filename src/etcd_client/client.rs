//! The client and its unary calls: key reads and writes, leases and the lock service, each
//! tried at the members in turn.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;

use super::answer::{self, Failure};
use super::auth::Auth;
use super::transport::{self, ClientOptions, Transport};
use super::wire::{self, Method};
use super::{EtcdError, prefix_end};

/// A lock held through etcd's lock service (`v3lockpb.Lock/Lock`).
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
const REPEATABLE: &[&str] = &[wire::RangeCall::PATH, wire::KEEP_ALIVE, wire::UnlockCall::PATH, wire::WATCH];

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

/// A unary call of `M`. Unbounded, it waits as long as etcd takes (a lock).
struct Unary<M: Method> {
    request: M::Request,
    bounded: bool,
}

impl<M: Method> Exchange for Unary<M> {
    type Answer = M::Answer;

    fn send(
        &self,
        client: &Client,
        endpoint: &str,
        token: Option<&str>,
    ) -> impl Future<Output = Result<M::Answer, Failure>> + Send {
        client.unary::<M>(endpoint, self.request.clone(), token, self.bounded)
    }
}

/// A client of an etcd cluster: tries its endpoints in turn, moving on from one
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

    /// The transport, for the calls that are streams.
    pub(crate) fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Calls `M` and returns its answer. Each endpoint is tried at most once, from the one in
    /// use: the next one after a member that could not be reached or answered that it cannot
    /// serve now ("no leader", a learner), and, for a call that does no harm made twice, after
    /// one that may have taken it (no answer in time, "request timed out"). A token etcd
    /// refuses is renewed once. Any other error answer is returned as it is.
    pub(crate) async fn call<M: Method>(&self, request: M::Request) -> Result<M::Answer, EtcdError> {
        self.attempt(M::PATH, &Unary::<M> { request, bounded: true }).await
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

    /// One call of `M` to `endpoint`; when `bounded`, given up after the client's timeout.
    pub(crate) async fn unary<M: Method>(
        &self,
        endpoint: &str,
        request: M::Request,
        token: Option<&str>,
        bounded: bool,
    ) -> Result<M::Answer, Failure> {
        let exchange = async {
            let answer = self.transport.unary::<M>(endpoint, request, token).await;
            answer.map_err(|status| answer::of_status(endpoint, M::PATH, self.user(), &status))
        };
        match bounded {
            true => self.bounded(endpoint, M::PATH, exchange).await,
            false => exchange.await,
        }
    }

    /// `exchange`, a call of `path` to `endpoint`, given up after the client's timeout: then
    /// it may have been taken.
    pub(crate) async fn bounded<T>(
        &self,
        endpoint: &str,
        path: &str,
        exchange: impl Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        tokio::time::timeout(self.timeout, exchange).await.unwrap_or_else(|_| {
            let reason = format!("no answer to {path} within {}", humantime::format_duration(self.timeout));
            Err(Failure::Unknown(EtcdError::Unreachable { endpoint: endpoint.to_owned(), reason }))
        })
    }

    /// The keys in `[key, range_end)` (just `key` without an end), in key order, and the
    /// revision the read saw. A linearizable read: it reflects every write etcd had committed
    /// when it was asked.
    pub async fn range(&self, key: &[u8], range_end: Option<&[u8]>) -> Result<(Vec<Kv>, i64), EtcdError> {
        let request = wire::RangeRequest {
            key: key.to_vec(),
            range_end: range_end.map(<[u8]>::to_vec).unwrap_or_default(),
            ..Default::default()
        };
        let answer = self.call::<wire::RangeCall>(request).await?;
        Ok((answer.kvs.into_iter().map(Kv::from).collect(), wire::revision(answer.header.as_ref())))
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
        let request = wire::PutRequest { key: key.to_vec(), value: value.to_vec(), lease };
        let answer = self.call::<wire::PutCall>(request).await?;
        Ok(wire::revision(answer.header.as_ref()))
    }

    /// Grants a lease of `ttl` (whole seconds; etcd raises very short ones to its minimum, 2 s
    /// with its default election timeout) and returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let ttl = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let answer = self.call::<wire::GrantCall>(wire::LeaseGrantRequest { ttl }).await?;
        match answer.id {
            0 => Err(wire::malformed(wire::GrantCall::PATH, format!("no lease granted: {:?}", answer.error))),
            id => Ok(id),
        }
    }

    /// Renews `lease` once; returns its TTL from now in seconds, 0 once it has expired.
    pub async fn keep_alive_once(&self, lease: i64) -> Result<i64, EtcdError> {
        self.attempt(wire::KEEP_ALIVE, &KeepAlive { lease }).await
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
        self.call::<wire::RevokeCall>(wire::LeaseRevokeRequest { id: lease }).await.map(drop)
    }

    /// Takes the lock `name` for `lease`, waiting as long as other holders are ahead (this call
    /// is not bounded by the client's timeout; a member that cannot serve it passes it on, as
    /// [`Client::call`] says). Dropping the future cancels the call, and etcd withdraws the
    /// waiting key.
    pub async fn lock(&self, name: &[u8], lease: i64) -> Result<HeldLock, EtcdError> {
        let request = wire::LockRequest { name: name.to_vec(), lease };
        let exchange = Unary::<wire::LockCall> { request, bounded: false };
        let answer = self.attempt(wire::LockCall::PATH, &exchange).await?;
        if answer.key.is_empty() {
            return Err(wire::malformed(wire::LockCall::PATH, "no key for the lock held"));
        }
        Ok(HeldLock { key: answer.key, acquired_revision: wire::revision(answer.header.as_ref()) })
    }

    /// Releases a lock by deleting its key.
    pub async fn unlock(&self, held: &HeldLock) -> Result<(), EtcdError> {
        self.call::<wire::UnlockCall>(wire::UnlockRequest { key: held.key.clone() }).await.map(drop)
    }
}

/// One renewal of a lease: a stream in gRPC, opened for one request and its answer.
struct KeepAlive {
    lease: i64,
}

impl Exchange for KeepAlive {
    type Answer = i64;

    async fn send(&self, client: &Client, endpoint: &str, token: Option<&str>) -> Result<i64, Failure> {
        let request = wire::LeaseKeepAliveRequest { id: self.lease };
        let failed = |status: tonic::Status| answer::of_status(endpoint, wire::KEEP_ALIVE, client.user(), &status);
        let renewed = async {
            let mut answers = client
                .transport()
                .stream::<_, wire::LeaseKeepAliveResponse>(endpoint, wire::KEEP_ALIVE, request, None, token)
                .await
                .map_err(failed)?;
            match answers.message().await.map_err(failed)? {
                Some(answer) => Ok(answer.ttl),
                None => Err(Failure::Unknown(EtcdError::Unreachable {
                    endpoint: endpoint.to_owned(),
                    reason: "etcd ended the renewal without an answer".into(),
                })),
            }
        };
        client.bounded(endpoint, wire::KEEP_ALIVE, renewed).await
    }
}
