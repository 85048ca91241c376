//! Forwarding to the backend: one pooled HTTP/1.1 client, hop-by-hop headers stripped both
//! ways, bodies streamed without buffering.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::BackendConfig;
use crate::error::{ERROR_HEADER, Error};

/// The body type of every response fencegate sends: relayed or made here.
pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every request sent to the backend: the client's, streamed, perhaps limited.
type ClientBody = BoxBody<Bytes, BoxError>;

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus the
/// legacy ones proxies have always stripped.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove(header::UPGRADE);
}

/// Wraps a body made here into the common response body type.
pub fn full_body(body: http_body_util::Full<Bytes>) -> ProxyBody {
    body.map_err(|never| match never {}).boxed()
}

/// Sends requests to the configured backend.
#[derive(Debug, Clone)]
pub struct Forwarder {
    client: Client<HttpsConnector<HttpConnector>, ClientBody>,
    scheme: Scheme,
    authority: Authority,
    timeout: Duration,
    bytes_in: prometheus_client::metrics::counter::Counter,
}

impl Forwarder {
    /// Builds the pooled client for `backend`.
    pub fn new(backend: &BackendConfig, bytes_in: prometheus_client::metrics::counter::Counter) -> Result<Self, Error> {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(backend.connect_timeout));
        http.set_nodelay(true);
        http.enforce_http(false);
        let t = &backend.tls;
        let tls = match backend.url.scheme_str() {
            Some("https") => crate::tls::client_config(t.ca.as_deref(), t.cert.as_deref(), t.key.as_deref()),
            _ => crate::tls::unused_client_config(),
        }
        .map_err(|e| Error::Io(std::io::Error::other(e)))?;
        let connector =
            HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http().enable_http1().wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        let parts = backend.url.clone().into_parts();
        Ok(Forwarder {
            client,
            scheme: parts.scheme.unwrap_or(Scheme::HTTP),
            authority: parts.authority.unwrap_or_else(|| Authority::from_static("127.0.0.1")),
            timeout: backend.request_timeout,
            bytes_in,
        })
    }

    /// Sends `req` to the backend at `path` (already canonical for fenced writes) and returns
    /// the backend's response head. A body longer than `body_limit` is cut off and the request
    /// fails. Never retries anything that may have reached the backend.
    pub async fn forward(
        &self,
        req: Request<Incoming>,
        path: PathAndQuery,
        client_addr: SocketAddr,
        body_limit: Option<u64>,
    ) -> Result<Response<ProxyBody>, Error> {
        let bytes_in = self.bytes_in.clone();
        let mut req = req.map(|body| {
            let counted = body.map_frame(move |frame| {
                if let Some(data) = frame.data_ref() {
                    bytes_in.inc_by(data.len() as u64);
                }
                frame
            });
            match body_limit {
                Some(limit) => Limited::new(counted, usize::try_from(limit).unwrap_or(usize::MAX)).boxed(),
                None => counted.map_err(BoxError::from).boxed(),
            }
        });
        let original = std::mem::take(req.uri_mut());
        *req.uri_mut() = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|e| Error::InvalidPath(crate::path::PathError::Unparseable(e.to_string())))?;
        // A target with an authority (HTTP/2's :authority, or HTTP/1's absolute form) names
        // the host, and RFC 9112 says it wins over Host; HTTP/1 backends read Host.
        if let Some(host) = original.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()) {
            req.headers_mut().insert(header::HOST, host);
        }
        *req.version_mut() = Version::HTTP_11;
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        append_forwarded_for(headers, client_addr);

        let resp = match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => return Err(Error::BackendTimeout(self.timeout)),
            Ok(Err(e)) if e.is_connect() => return Err(Error::BackendUnreachable(error_chain(&e))),
            Ok(Err(e)) if caused_by::<LengthLimitError>(&e) => {
                return Err(Error::BodyTooLarge { limit: body_limit.unwrap_or_default() });
            }
            Ok(Err(e)) => return Err(Error::BackendFailed(error_chain(&e))),
            Ok(Ok(resp)) => resp,
        };
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        // Only fencegate may say a response is fencegate's own.
        parts.headers.remove(ERROR_HEADER);
        Ok(Response::from_parts(parts, body.boxed()))
    }
}

fn append_forwarded_for(headers: &mut HeaderMap, client: SocketAddr) {
    let ip = client.ip().to_string();
    let value = match headers.get("x-forwarded-for") {
        Some(prev) => format!("{}, {ip}", prev.to_str().unwrap_or_default()),
        None => ip,
    };
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert(HeaderName::from_static("x-forwarded-for"), v);
    }
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
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-secret-hop"),
            ("keep-alive", "timeout=5"),
            ("x-secret-hop", "1"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic x"),
            ("content-type", "text/plain"),
            ("fencing-token", "34"),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        let left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["content-type", "fencing-token"]);
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut h = HeaderMap::new();
        let addr: SocketAddr = "127.0.0.9:1".parse().unwrap();
        append_forwarded_for(&mut h, addr);
        assert_eq!(h["x-forwarded-for"], "127.0.0.9");
        append_forwarded_for(&mut h, addr);
        assert_eq!(h["x-forwarded-for"], "127.0.0.9, 127.0.0.9");
    }
}
