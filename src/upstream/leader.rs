//! A follower's fenced writes, sent on to the instance that leads the shared fence (the etcd
//! store): as a plain reverse proxy would, with the body streamed, and with a header naming
//! this instance. The leader fences the write and forwards it to the backend; its answer, a
//! refusal included, comes back unchanged. A write that arrives with the header at an
//! instance that does not lead is refused rather than sent on again, so a write never travels
//! twice and two instances that each think the other leads cannot bounce it between them.

use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::{HeaderPolicy, Peer, RequestBody, ResponseBody, UpstreamError, strip_hop_by_hop};

/// Names the instance that sent a write on to the leader (its advertised URL).
pub static FORWARDED_BY: HeaderName = HeaderName::from_static("fencegate-forwarded-by");

/// The client a follower sends writes to the leader with.
#[derive(Debug, Clone)]
pub(crate) struct Peers {
    http: Client<HttpConnector, RequestBody>,
    /// This instance's advertised URL, for [`FORWARDED_BY`].
    me: HeaderValue,
}

impl Peers {
    /// A client for an instance that advertises `me`.
    pub(crate) fn new(me: &str, connect_timeout: Duration) -> Peers {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        Peers {
            http: Client::builder(TokioExecutor::new()).build(connector),
            me: HeaderValue::from_str(me).unwrap_or_else(|_| HeaderValue::from_static("unknown")),
        }
    }

    /// Sends `req` to the leader at `leader` and relays its answer; gives up on the answer's
    /// head after `timeout`.
    pub(crate) async fn forward(
        &self,
        leader: &str,
        mut req: Request<RequestBody>,
        client: &Peer,
        policy: &HeaderPolicy,
        timeout: Duration,
    ) -> Result<Response<ResponseBody>, UpstreamError> {
        let unavailable = UpstreamError::NoLeader;
        let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
        let uri: Uri = format!("{leader}{target}")
            .parse()
            .map_err(|e| unavailable(format!("the leader's URL {leader:?} cannot take this path: {e}")))?;
        let host = req.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok());
        *req.uri_mut() = uri;
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        // The leader fences what the client named: the same Host (an absolute-form target's
        // authority, else the client's Host header).
        if let Some(host) = host {
            headers.insert(http::header::HOST, host);
        }
        let client_host = headers.get(http::header::HOST).cloned();
        headers.insert(FORWARDED_BY.clone(), self.me.clone());
        // The leader learns the client's address from the last entry; the backend learns it
        // as it would from the leader itself.
        policy.to_leader(headers, client, client_host.as_ref());
        *req.version_mut() = http::Version::HTTP_11;
        // Once the write may have reached the leader, which runs it to its end on its own, its
        // outcome is unknown: a gateway error, not "not forwarded".
        let resp = match tokio::time::timeout(timeout, self.http.request(req)).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) if e.is_connect() => {
                return Err(unavailable(format!("the leader at {leader} cannot be reached: {e}")));
            }
            Ok(Err(e)) => {
                return Err(UpstreamError::Failed(format!("the leader at {leader} failed: {e}")));
            }
            Err(_) => return Err(UpstreamError::Timeout(timeout)),
        };
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(parts, body.map_frame(|f: hyper::body::Frame<Bytes>| f).boxed()))
    }
}

/// Whether the leader at `leader` (its advertised URL) takes a connection within `timeout`:
/// a follower that cannot reach it refuses every fenced write it is sent.
pub(crate) async fn reachable(leader: &str, timeout: Duration) -> Result<(), String> {
    let uri: Uri = leader.parse().map_err(|e| format!("the leader's URL {leader:?} is not a URL: {e}"))?;
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(super::backend_addr(&uri))).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("leader unreachable: connecting to {leader} failed: {e}; fenced writes are refused")),
        Err(_) => Err(format!(
            "leader unreachable: no connection to {leader} within {timeout:?} (backend.connect_timeout); fenced \
            writes are refused"
        )),
    }
}

/// The client a follower named when it sent this write on: the last `X-Forwarded-For` entry,
/// which it appended; `None` if there is none that is an address.
pub(crate) fn sent_on_for(headers: &http::HeaderMap) -> Option<std::net::IpAddr> {
    let last = headers.get_all(http::header::HeaderName::from_static("x-forwarded-for")).iter().next_back()?;
    last.to_str().ok()?.rsplit(',').next()?.trim().parse().ok()
}

/// Whether another instance sent this write on.
pub(crate) fn forwarded<B>(req: &Request<B>) -> bool {
    req.headers().contains_key(&FORWARDED_BY)
}
