//! Forwarding to the backend: pooled HTTP/1.1 connections, at most `backend.max_connections`
//! of them (`pool`), hop-by-hop headers stripped both ways, bodies streamed without buffering.
//!
//! A request first gets its [`Connection`] ([`Upstream::connection`]), then is sent on it
//! ([`Upstream::forward`]). The two are apart so that a fenced write can hold its connection
//! before its token is used up: a backend that cannot be reached, or has no connection free,
//! costs the write nothing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use rustls_pki_types::ServerName;

mod body;
mod checkout;
mod dial;
mod forwarded;
mod gated;
mod headers;
pub(crate) mod leader;
pub(crate) use leader::reachable as leader_reachable;
mod location;
mod pool;
mod sent;

use crate::config::{BackendConfig, BackendUrl};
use crate::store::Permit;
pub use body::RequestBody;
use checkout::Checkout;
use dial::Target;
pub(crate) use forwarded::HeaderPolicy;
use gated::Gated;
pub(crate) use gated::{head_may_go, lapsed};
pub use headers::{Peer, PeerAddr, append_forwarded_for, remove_held, strip_hop_by_hop};
use pool::{Bounds, Pool, SendError};
use sent::{Ended, Sent};

/// How a forwarded request holds on to the backend, and what may stop it.
#[derive(Clone, Default)]
pub struct Hold {
    /// Whether the response waits until the backend's connection has taken the whole body
    /// (a fenced write: its turn lasts that long).
    pub whole: bool,
    /// Checked before the head and each body chunk: once it answers false the request stops.
    pub permit: Option<Permit>,
}

/// Why a request did not get the backend's response head.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    /// No connection to the backend could be made; nothing was sent.
    #[error("backend unreachable: {0}")]
    Unreachable(String),
    /// Every connection `backend.max_connections` allows stayed in use this long; nothing
    /// was sent.
    #[error("no backend connection became free within {0:?}")]
    Busy(Duration),
    /// The connection failed after the request may have been (partly) sent.
    #[error("backend failed: {0}")]
    Failed(String),
    /// The backend did not answer within the request timeout.
    #[error("backend did not answer within {0:?}")]
    Timeout(Duration),
    /// The permission to send the request lapsed before anything was sent (the etcd store's
    /// leader no longer trusts its lease).
    #[error("not sent: {0}")]
    Withdrawn(String),
    /// A follower could not send a write on to the leader of the shared fence; nothing was
    /// sent (the write is not fenced here, so the backend did not get it either).
    #[error("{0}")]
    NoLeader(String),
    /// The request body was longer than its limit; what was sent of it may have arrived.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: u64,
    },
}

/// The body type of every response fencegate sends: relayed or made here.
pub type ResponseBody = BoxBody<Bytes, hyper::Error>;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every request sent to the backend: the client's, streamed, perhaps limited.
type ClientBody = BoxBody<Bytes, BoxError>;

/// Wraps a body made here into the common response body type.
pub fn full_body(body: http_body_util::Full<Bytes>) -> ResponseBody {
    body.map_err(|never| match never {}).boxed()
}

/// A backend connection held for one request, from before it is sent: an idle kept-alive one,
/// or a new one, already open. Dropped unused, it goes back to the pool.
pub struct Connection(Checkout<ClientBody>);

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("reused", &self.0.reused).finish()
    }
}

/// Sends requests to the configured backend.
#[derive(Debug, Clone)]
pub struct Upstream {
    pool: Arc<Pool<ClientBody>>,
    /// `Host` for requests that arrive without one (HTTP/1.0).
    host: HeaderValue,
    timeout: Duration,
    bytes_in: prometheus_client::metrics::counter::Counter,
    /// What is added to and taken from the headers on the way (`[headers]`).
    policy: Arc<HeaderPolicy>,
}

impl Upstream {
    /// Prepares connections to `backend` (none is opened until the first request); the error
    /// says which setting cannot be used. With `previous` (a reload), the new connections and
    /// the previous upstream's count against one `backend.max_connections`; once the new one is
    /// in force, [`Upstream::retire_for`] closes the previous one's.
    pub(crate) fn new(
        backend: &BackendConfig,
        policy: HeaderPolicy,
        bytes_in: prometheus_client::metrics::counter::Counter,
        previous: Option<&Upstream>,
        unacked: Duration,
    ) -> Result<Self, String> {
        let bounds = Bounds {
            max_connections: backend.max_connections,
            pool_timeout: backend.pool_timeout,
            idle_timeout: Duration::from_secs(60),
            unacked,
        };
        let (target, host) = match &backend.url {
            BackendUrl::Http(url) => {
                let authority = url.authority().ok_or_else(|| format!("{url}: no host"))?;
                let (host, port) = backend_addr(url);
                let tls = if url.scheme_str() == Some("https") {
                    let t = &backend.tls;
                    let config = crate::tls::client_config(t.ca.as_deref(), t.cert.as_deref(), t.key.as_deref())?;
                    let name = ServerName::try_from(host.clone()).map_err(|e| format!("{host}: {e}"))?;
                    Some((Arc::new(config), name))
                } else {
                    None
                };
                let authority = HeaderValue::from_str(authority.as_str()).map_err(|e| e.to_string())?;
                (Target::Tcp { host, port, tls }, authority)
            }
            // A socket has no host name: requests keep their own Host, and one without any
            // (HTTP/1.0) gets `localhost`, where the socket is.
            BackendUrl::Unix(path) => (Target::Unix(path.clone()), HeaderValue::from_static("localhost")),
        };
        let pool = Pool::new(target, backend.connect_timeout, bounds, previous.map(|p| &*p.pool));
        Ok(Upstream { pool, host, timeout: backend.request_timeout, bytes_in, policy: Arc::new(policy) })
    }

    /// What is added to and taken from the headers on the way.
    pub(crate) fn policy(&self) -> &HeaderPolicy {
        &self.policy
    }

    /// This upstream, with its connections, under another header policy (a reload that
    /// changed `[headers]` alone).
    pub(crate) fn with_policy(&self, policy: HeaderPolicy) -> Upstream {
        Upstream { policy: Arc::new(policy), ..self.clone() }
    }

    /// Closes this upstream's connections, idle ones now and the others when their requests
    /// end, unless `successor` is this same upstream (a reload that kept it).
    pub(crate) fn retire_for(&self, successor: &Upstream) {
        if !Arc::ptr_eq(&self.pool, &successor.pool) {
            self.pool.retire();
        }
    }

    /// Closes backend connections that are closed or have been idle for a minute; requests
    /// only drop the closed ones they pass over, so this is what ages the list out.
    pub(crate) fn prune(&self) {
        self.pool.prune();
    }

    /// A connection to send one request on: an idle one, or a new one opened within the
    /// connect timeout, waiting up to the pool timeout while all that the bound allows are in
    /// use. Fails with `Busy` or `Unreachable`, having sent nothing.
    pub async fn connection(&self) -> Result<Connection, UpstreamError> {
        match self.pool.checkout().await {
            Ok(conn) => Ok(Connection(conn)),
            Err(e) => Err(failure(e, None)),
        }
    }

    /// Sends `req` on `conn` to the backend at `path` (already canonical for fenced writes)
    /// and returns the backend's response head; its body holds the connection until it ends.
    /// A body longer than `body_limit` is cut off and the request fails. With `whole`, the
    /// response is returned only once the backend's connection has also taken the whole body,
    /// both within the request timeout, which counts from here: an early answer to a body that
    /// then fails is a failure, never the early answer. Never retries anything that may have
    /// reached the backend; a request that a reused connection, closed meanwhile, did not take
    /// is sent on another one, which may mean waiting for it or connecting.
    pub async fn forward(
        &self,
        conn: Connection,
        req: Request<RequestBody>,
        path: PathAndQuery,
        client: &Peer,
        body_limit: Option<u64>,
        hold: Hold,
    ) -> Result<Response<ResponseBody>, UpstreamError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let Hold { whole, permit } = hold;
        if !gated::head_may_go(permit.as_ref()) {
            return Err(UpstreamError::Withdrawn("the permission to send this write lapsed before it was sent".into()));
        }
        let (done, ended) = match whole {
            true => {
                let (done, ended) = tokio::sync::oneshot::channel();
                (Some(done), Some(ended))
            }
            false => (None, None),
        };
        // Checked again should a closed connection make the request wait for another.
        let resend = permit.clone();
        let bytes_in = self.bytes_in.clone();
        let mut req = req.map(|body| {
            let counted = body.map_frame(move |frame| {
                if let Some(data) = frame.data_ref() {
                    bytes_in.inc_by(data.len() as u64);
                }
                frame
            });
            let limited = |counted, limit: u64| Limited::new(counted, usize::try_from(limit).unwrap_or(usize::MAX));
            let body: ClientBody = match (body_limit, done) {
                (Some(limit), Some(done)) => Sent::new(limited(counted, limit), done).boxed(),
                (Some(limit), None) => limited(counted, limit).boxed(),
                (None, Some(done)) => Sent::new(counted.map_err(BoxError::from), done).boxed(),
                (None, None) => counted.map_err(BoxError::from).boxed(),
            };
            match permit {
                Some(permit) => Gated::new(body, permit).boxed(),
                None => body,
            }
        });
        // Origin form: the backend is reached directly, not as a proxy.
        let original = std::mem::replace(req.uri_mut(), Uri::from(path));
        // A target with an authority (HTTP/2's :authority, or HTTP/1's absolute form) names
        // the host, and RFC 9112 says it wins over Host; HTTP/1 backends read Host.
        let headers = req.headers_mut();
        // First: `Connection: host` must not take away the Host set next.
        strip_hop_by_hop(headers);
        let authority = original.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok());
        // The host the client named (none for an HTTP/1.0 request without Host), which the
        // forwarded headers name and the backend's redirects are rewritten to.
        let client_host = match self.policy.reads_client_host() {
            true => authority.clone().or_else(|| headers.get(header::HOST).cloned()),
            false => None,
        };
        self.policy.on_request(headers, client, client_host.as_ref());
        if let Some(host) = authority {
            headers.insert(header::HOST, host);
        } else if !headers.contains_key(header::HOST) {
            headers.insert(header::HOST, self.host.clone());
        }
        *req.version_mut() = Version::HTTP_11;

        let may_send = || !resend.as_ref().is_some_and(gated::lapsed);
        let resp = match tokio::time::timeout_at(deadline, self.pool.send(conn.0, req, may_send)).await {
            Err(_) => return Err(UpstreamError::Timeout(self.timeout)),
            Ok(Err(e)) => return Err(failure(e, body_limit)),
            Ok(Ok(resp)) => resp,
        };
        if let Some(ended) = ended {
            let failed = match tokio::time::timeout_at(deadline, ended).await {
                Err(_) => UpstreamError::Timeout(self.timeout),
                Ok(Ok(Ended::Whole)) => return Ok(self.relay(resp, client_host.as_ref())),
                Ok(Ok(Ended::Failed { too_large: true })) => {
                    UpstreamError::BodyTooLarge { limit: body_limit.unwrap_or_default() }
                }
                // A backend that refused the request (4xx) before taking its whole body, then
                // stopped reading it (an S3 server refusing a signature, nginx a size), applied
                // nothing: its refusal is the answer, not an unknown outcome.
                Ok(Ok(Ended::Failed { too_large: false }) | Err(_)) if resp.status().is_client_error() => {
                    return Ok(self.relay(resp, client_host.as_ref()));
                }
                Ok(Ok(Ended::Failed { too_large: false }) | Err(_)) => {
                    UpstreamError::Failed("the request body did not reach the backend whole".into())
                }
            };
            // The connection the response came on is closed, not reused: the backend is not
            // left holding half a write for the next request.
            resp.into_body().discard();
            return Err(failed);
        }
        Ok(self.relay(resp, client_host.as_ref()))
    }

    /// The backend's response as the client gets it: hop-by-hop headers dropped, then
    /// `[headers]` (redirects rewritten for the client that named `client_host`, the rules).
    fn relay(
        &self,
        resp: Response<checkout::Relayed<ClientBody>>,
        client_host: Option<&HeaderValue>,
    ) -> Response<ResponseBody> {
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        self.policy.on_response(&mut parts.headers, client_host);
        Response::from_parts(parts, body.boxed())
    }
}

/// What a failed checkout or exchange means for the request.
fn failure(e: SendError, body_limit: Option<u64>) -> UpstreamError {
    match e {
        SendError::Connect(e) => UpstreamError::Unreachable(e),
        SendError::Busy(waited) => UpstreamError::Busy(waited),
        SendError::Http(e) if caused_by::<LengthLimitError>(&e) => {
            UpstreamError::BodyTooLarge { limit: body_limit.unwrap_or_default() }
        }
        SendError::Http(e) => UpstreamError::Failed(error_chain(&e)),
        SendError::Withdrawn => UpstreamError::Withdrawn(SendError::Withdrawn.to_string()),
    }
}

/// Whether a connection to the backend at `url` opens within `timeout`; if not, what happened,
/// for people.
pub(crate) async fn reachable(url: &BackendUrl, timeout: Duration) -> Result<(), String> {
    let connect = async {
        match url {
            BackendUrl::Http(url) => tokio::net::TcpStream::connect(backend_addr(url)).await.map(drop),
            BackendUrl::Unix(path) => tokio::net::UnixStream::connect(path).await.map(drop),
        }
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("backend unreachable: connecting to {url} failed: {e}")),
        Err(_) => {
            Err(format!("backend unreachable: no connection to {url} within {timeout:?} (backend.connect_timeout)"))
        }
    }
}

/// Host and port a backend URL connects to: the scheme's port when none is written, and an
/// IPv6 literal without its brackets (`Uri` keeps them; a socket address and a TLS name do not).
pub(crate) fn backend_addr(url: &Uri) -> (String, u16) {
    let host = url.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_owned();
    let port = url.port_u16().unwrap_or(if url.scheme_str() == Some("https") { 443 } else { 80 });
    (host, port)
}

fn caused_by<E: std::error::Error + 'static>(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.is::<E>() {
            return true;
        }
        cause = c.source();
    }
    false
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_addresses_default_the_port_by_scheme_and_drop_ipv6_brackets() {
        let addr = |u: &str| backend_addr(&u.parse().unwrap());
        assert_eq!(addr("http://127.0.0.1:9000"), ("127.0.0.1".into(), 9000));
        assert_eq!(addr("http://backend.internal"), ("backend.internal".into(), 80));
        assert_eq!(addr("https://backend.internal"), ("backend.internal".into(), 443));
        assert_eq!(addr("http://[::1]"), ("::1".into(), 80));
        assert_eq!(addr("https://[::1]:8443"), ("::1".into(), 8443));
    }
}
