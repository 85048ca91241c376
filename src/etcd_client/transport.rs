//! How a client reaches the members: its options (endpoints, timeout, TLS, credentials), the
//! connector they make (plain TCP for `http://` endpoints, rustls for `https://` ones, with
//! fencegate's TLS setup from `crate::tls`), and one gRPC call or stream to one member.

use std::path::PathBuf;
use std::time::Duration;

use std::future::Future as _;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::ServerName;
use tokio::sync::oneshot;
use tokio_stream::StreamExt as _;
use tonic::Status;
use tonic::body::Body;
use tonic::client::Grpc;
use tonic::codec::Streaming;
use tonic::metadata::MetadataValue;
use tonic_prost::ProstCodec;

use super::EtcdError;
use super::wire::Method;

/// Everything a [`super::Client`] is made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Client URLs of the members, all `http://HOST:PORT` or all `https://HOST:PORT`.
    pub endpoints: Vec<String>,
    /// How long one request may take before the next member is tried.
    pub request_timeout: Duration,
    /// How `https://` endpoints are verified and what the client presents to them; `None`:
    /// the system's roots and no client certificate. Only with `https://` endpoints.
    pub tls: Option<TlsOptions>,
    /// The user calls are made as, where etcd has authentication enabled.
    pub credentials: Option<Credentials>,
}

impl ClientOptions {
    /// Options of a client of `endpoints` with neither TLS settings nor credentials.
    pub fn new(endpoints: Vec<String>, request_timeout: Duration) -> ClientOptions {
        ClientOptions { endpoints, request_timeout, tls: None, credentials: None }
    }
}

/// TLS to `https://` members.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// The CA (PEM) that signed the members' certificates; the system's roots when unset.
    pub ca_file: Option<PathBuf>,
    /// A client certificate (PEM) to present, for members started with `--client-cert-auth`.
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    pub key_file: Option<PathBuf>,
    /// The name the members' certificates must hold, instead of each endpoint's host.
    pub server_name: Option<String>,
}

/// A user and its password, for etcd's `Authenticate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user name.
    pub username: String,
    /// Its password.
    pub password: Password,
}

/// A password, which `Debug` does not show.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl Password {
    /// Wraps `password`.
    pub fn new(password: impl Into<String>) -> Password {
        Password(password.into())
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(..)")
    }
}

/// The HTTP/2 client of one scheme. Both are hyper-util's pooling client (one connection per
/// member, every call a stream on it); cheap to clone.
#[derive(Debug, Clone)]
pub(crate) enum Transport {
    Plain(HttpClient<HttpConnector, Body>),
    Tls(HttpClient<HttpsConnector<HttpConnector>, Body>),
}

/// Most bytes of one answer the client decodes (tonic's default is 4 MiB, which a range of
/// many keys could pass; etcd pages nothing on its own).
const MAX_ANSWER: usize = 256 * 1024 * 1024;

/// TCP to a member: each connection attempt given up after half `timeout`, so that a member
/// that does not answer is passed over for the next before the call's own timeout makes its
/// outcome unknown; and a connection closed by the kernel once what it sent has gone
/// unacknowledged for `timeout` (`TCP_USER_TIMEOUT`), so that a member cut off is dialled
/// afresh instead of every call on the connection waiting out its timeout.
fn tcp(timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(timeout / 2));
    connector.set_tcp_user_timeout(Some(timeout));
    connector
}

/// How often a connection with a call or watch open is pinged, and how long a ping may go
/// unanswered before the connection is closed: what notices a member gone while only a watch
/// waits on it. etcd closes a connection pinged more often than its
/// `--grpc-keepalive-min-time` (5 s), or pinged with nothing open.
const PING: Duration = Duration::from_secs(10);

/// HTTP/2 only (gRPC): calls share one connection per member.
fn builder() -> hyper_util::client::legacy::Builder {
    let mut builder = HttpClient::builder(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .http2_only(true)
        .http2_keep_alive_interval(PING)
        .http2_keep_alive_timeout(PING)
        .http2_keep_alive_while_idle(false);
    builder
}

impl Transport {
    /// Plain HTTP/2 (prior knowledge), as [`tcp`] says.
    pub(crate) fn plain(timeout: Duration) -> Transport {
        Transport::Plain(builder().build(tcp(timeout)))
    }

    /// TLS only, as `tls` says. Reads the PEM files (and, without a CA, the system's roots).
    pub(crate) fn tls(tls: &TlsOptions, timeout: Duration) -> Result<Transport, EtcdError> {
        let config =
            crate::tls::client_config(tls.ca_file.as_deref(), tls.cert_file.as_deref(), tls.key_file.as_deref())
                .map_err(EtcdError::Options)?;
        let builder_tls = HttpsConnectorBuilder::new().with_tls_config(config).https_only();
        let builder_tls = match &tls.server_name {
            Some(name) => {
                let name = ServerName::try_from(name.clone())
                    .map_err(|e| EtcdError::Options(format!("server name {name:?}: {e}")))?;
                builder_tls.with_server_name_resolver(FixedServerNameResolver::new(name))
            }
            None => builder_tls,
        };
        let mut tcp = tcp(timeout);
        // The TLS layer takes the https:// URLs the plain connector would refuse.
        tcp.enforce_http(false);
        let connector = builder_tls.enable_http2().wrap_connector(tcp);
        Ok(Transport::Tls(builder().build(connector)))
    }

    /// Calls `M` at `endpoint` with `token` in the `token` metadata, as etcd's own client sends
    /// it. A failure to connect (TCP or TLS) sent nothing; any later one may have been after
    /// etcd took the request (`answer::of_status` tells them apart).
    pub(crate) async fn unary<M: Method>(
        &self,
        endpoint: &str,
        request: M::Request,
        token: Option<&str>,
    ) -> Result<M::Answer, Status> {
        let request = with_token(tonic::Request::new(request), token)?;
        let path = PathAndQuery::from_static(M::PATH);
        let codec = ProstCodec::<M::Request, M::Answer>::default();
        let answer = match self {
            Transport::Plain(c) => grpc(c.clone(), endpoint)?.unary(request, path, codec).await,
            Transport::Tls(c) => grpc(c.clone(), endpoint)?.unary(request, path, codec).await,
        };
        answer.map(tonic::Response::into_inner)
    }

    /// Opens the bidirectional stream `path` at `endpoint`, sending `first`, and ending the
    /// request side after it, or, given `open_until`, once that resolves or is dropped: etcd
    /// keeps a watch for as long as its request side is open, and cancels it when the stream
    /// ends.
    pub(crate) async fn stream<Q, A>(
        &self,
        endpoint: &str,
        path: &'static str,
        first: Q,
        open_until: Option<oneshot::Receiver<()>>,
        token: Option<&str>,
    ) -> Result<Streaming<A>, Status>
    where
        Q: prost::Message + Send + Sync + 'static,
        A: prost::Message + Default + Send + Sync + 'static,
    {
        let once = tokio_stream::once(first);
        let requests: Pin<Box<dyn tokio_stream::Stream<Item = Q> + Send>> = match open_until {
            None => Box::pin(once),
            Some(until) => Box::pin(once.chain(Until { until, item: PhantomData })),
        };
        let request = with_token(tonic::Request::new(requests), token)?;
        let path = PathAndQuery::from_static(path);
        let codec = ProstCodec::<Q, A>::default();
        let answer = match self {
            Transport::Plain(c) => grpc(c.clone(), endpoint)?.streaming(request, path, codec).await,
            Transport::Tls(c) => grpc(c.clone(), endpoint)?.streaming(request, path, codec).await,
        };
        answer.map(tonic::Response::into_inner)
    }
}

/// A stream of no items that ends when `until` resolves or its sender is dropped.
struct Until<Q> {
    until: oneshot::Receiver<()>,
    item: PhantomData<fn() -> Q>,
}

impl<Q> tokio_stream::Stream for Until<Q> {
    type Item = Q;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Q>> {
        Pin::new(&mut self.until).poll(cx).map(|_| None)
    }
}

fn with_token<T>(mut request: tonic::Request<T>, token: Option<&str>) -> Result<tonic::Request<T>, Status> {
    if let Some(token) = token {
        let value = MetadataValue::try_from(token)
            .map_err(|_| Status::unauthenticated("etcd gave a token that is not a header value"))?;
        request.metadata_mut().insert("token", value);
    }
    Ok(request)
}

/// A gRPC client of `inner` at `endpoint` (checked by [`transport`]).
fn grpc<T>(inner: T, endpoint: &str) -> Result<Grpc<T>, Status> {
    let origin: http::Uri =
        endpoint.parse().map_err(|e| Status::invalid_argument(format!("endpoint {endpoint:?}: {e}")))?;
    Ok(Grpc::with_origin(inner, origin).max_decoding_message_size(MAX_ANSWER))
}

/// An error and its sources, which say what failed ("client error (Connect)" alone does not:
/// "invalid peer certificate: UnknownIssuer" is in a source).
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let part = e.to_string();
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = e.source();
    }
    text
}

/// Checks `endpoints` and makes the transport their scheme needs.
pub(crate) fn transport(options: &ClientOptions) -> Result<Transport, EtcdError> {
    let Some(first) = options.endpoints.first() else {
        return Err(EtcdError::Options("no endpoint".into()));
    };
    let scheme = |url: &str| -> Result<bool, EtcdError> {
        let uri: http::Uri = url.parse().map_err(|e| EtcdError::Options(format!("endpoint {url:?}: {e}")))?;
        match (uri.scheme_str(), uri.authority(), uri.path()) {
            (Some(s @ ("http" | "https")), Some(_), "" | "/") => Ok(s == "https"),
            _ => Err(EtcdError::Options(format!("endpoint {url:?}: expected http://HOST:PORT or https://HOST:PORT"))),
        }
    };
    let https = scheme(first)?;
    for url in &options.endpoints[1..] {
        if scheme(url)? != https {
            return Err(EtcdError::Options(format!(
                "endpoints {first:?} and {url:?}: all must be http:// or all https://"
            )));
        }
    }
    match (&options.tls, https) {
        (Some(_), false) => Err(EtcdError::Options("TLS settings apply only to https:// endpoints".into())),
        (tls, true) => Transport::tls(&tls.clone().unwrap_or_default(), options.request_timeout),
        (None, false) => Ok(Transport::plain(options.request_timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd_client::Client;

    fn refused(options: &ClientOptions) -> String {
        match Client::from_options(options) {
            Err(EtcdError::Options(why)) => why,
            other => panic!("{options:?} made {other:?}"),
        }
    }

    #[test]
    fn options_that_make_no_client_are_refused_and_secrets_are_not_shown() {
        let timeout = Duration::from_secs(1);
        let with = |endpoints: &[&str]| ClientOptions::new(endpoints.iter().map(|e| e.to_string()).collect(), timeout);
        assert_eq!(refused(&with(&[])), "no endpoint");
        assert!(refused(&with(&["127.0.0.1:2379"])).contains("expected http://HOST:PORT"));
        assert!(refused(&with(&["http://127.0.0.1:2379/v3"])).contains("expected http://HOST:PORT"));
        assert!(refused(&with(&["https://a:2379", "http://b:2379"])).contains("all must be http:// or all https://"));
        let tls = ClientOptions { tls: Some(TlsOptions::default()), ..with(&["http://a:2379"]) };
        assert!(refused(&tls).contains("only to https://"));
        let name = TlsOptions { server_name: Some("not a name".into()), ..TlsOptions::default() };
        assert!(refused(&ClientOptions { tls: Some(name), ..with(&["https://a:2379"]) }).contains("server name"));
        let ca = TlsOptions { ca_file: Some("/nonexistent/ca.pem".into()), ..TlsOptions::default() };
        assert!(refused(&ClientOptions { tls: Some(ca), ..with(&["https://a:2379"]) }).contains("/nonexistent/ca.pem"));
        let nobody = Credentials { username: String::new(), password: Password::new("pw") };
        assert!(
            refused(&ClientOptions { credentials: Some(nobody), ..with(&["http://a:2379"]) }).contains("user name")
        );

        let credentials = Credentials { username: "u".into(), password: Password::new("hunter2") };
        let options = ClientOptions { credentials: Some(credentials), ..with(&["https://a:2379", "https://b:2379/"]) };
        let client = Client::from_options(&options).unwrap();
        assert_eq!(client.endpoint(), "https://a:2379");
        assert!(!format!("{options:?}{client:?}").contains("hunter2"));
    }
}
