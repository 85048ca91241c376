//! How a client reaches the members: its options (endpoints, timeout, TLS, credentials), the
//! connector they make (plain TCP for `http://` endpoints, rustls for `https://` ones, with
//! fencegate's TLS setup from `crate::tls`), and one POST to one member.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::ServerName;
use serde_json::Value;

use super::EtcdError;
use super::answer::Failure;

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

/// A user and its password, for etcd's `/v3/auth/authenticate`.
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

/// The HTTP client of one scheme. Both are hyper-util's pooling client; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) enum Transport {
    Plain(HttpClient<HttpConnector, Full<Bytes>>),
    Tls(HttpClient<HttpsConnector<HttpConnector>, Full<Bytes>>),
}

fn tcp(timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(timeout));
    connector
}

impl Transport {
    /// Plain HTTP, each connection attempt given up after `timeout`.
    pub(crate) fn plain(timeout: Duration) -> Transport {
        Transport::Plain(HttpClient::builder(TokioExecutor::new()).build(tcp(timeout)))
    }

    /// TLS only, as `tls` says. Reads the PEM files (and, without a CA, the system's roots).
    pub(crate) fn tls(tls: &TlsOptions, timeout: Duration) -> Result<Transport, EtcdError> {
        let config =
            crate::tls::client_config(tls.ca_file.as_deref(), tls.cert_file.as_deref(), tls.key_file.as_deref())
                .map_err(EtcdError::Options)?;
        let builder = HttpsConnectorBuilder::new().with_tls_config(config).https_only();
        let builder = match &tls.server_name {
            Some(name) => {
                let name = ServerName::try_from(name.clone())
                    .map_err(|e| EtcdError::Options(format!("server name {name:?}: {e}")))?;
                builder.with_server_name_resolver(FixedServerNameResolver::new(name))
            }
            None => builder,
        };
        let mut tcp = tcp(timeout);
        // The TLS layer takes the https:// URLs the plain connector would refuse.
        tcp.enforce_http(false);
        let connector = builder.enable_http1().wrap_connector(tcp);
        Ok(Transport::Tls(HttpClient::builder(TokioExecutor::new()).build(connector)))
    }

    /// POSTs `body` to `path` at `endpoint`, with `token` in the `Authorization` header. A
    /// failure to connect (TCP or TLS) sent nothing; any later one may have been after etcd
    /// took the request.
    pub(crate) async fn post(
        &self,
        endpoint: &str,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<http::Response<Incoming>, Failure> {
        let unreachable = |reason: String| EtcdError::Unreachable { endpoint: endpoint.to_owned(), reason };
        let mut req =
            http::Request::post(format!("{endpoint}{path}")).header(http::header::CONTENT_TYPE, "application/json");
        if let Some(token) = token {
            req = req.header(http::header::AUTHORIZATION, token);
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| Failure::Final(unreachable(e.to_string())))?;
        let sent = match self {
            Transport::Plain(client) => client.request(req).await,
            Transport::Tls(client) => client.request(req).await,
        };
        sent.map_err(|e| {
            let error = unreachable(chain(&e));
            if e.is_connect() { Failure::Elsewhere(error) } else { Failure::Unknown(error) }
        })
    }
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
