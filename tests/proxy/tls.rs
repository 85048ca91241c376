//! TLS on both sides, with certificates made at test time: an HTTPS listener (HTTP/1.1 and h2
//! by ALPN), client-certificate verification, and an `https://` backend with mTLS.

use crate::common;

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use common::{Harness, eventually};
use fencegate::config::{BackendTls, ServerTls};
use fencegate::demo::MemBackend;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};

/// A CA, a server certificate for localhost and 127.0.0.1, and a client certificate, as PEM
/// files in a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca_cert.pem()).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        for (name, sans) in [("server", vec!["localhost".to_string()]), ("client", vec!["client".to_string()])] {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(sans).unwrap();
            if name == "server" {
                params.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
            }
            let cert = params.signed_by(&key, &issuer).unwrap();
            std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.path().join(format!("{name}-key.pem")), key.serialize_pem()).unwrap();
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn server_tls(&self, client_ca: bool) -> ServerTls {
        ServerTls {
            cert: self.path("server.pem"),
            key: self.path("server-key.pem"),
            client_ca: client_ca.then(|| self.path("ca.pem")),
        }
    }
}

fn client_config(pki: &Pki, with_cert: bool) -> rustls::ClientConfig {
    let cert = with_cert.then(|| pki.path("client.pem"));
    let key = with_cert.then(|| pki.path("client-key.pem"));
    fencegate::tls::client_config(Some(&pki.path("ca.pem")), cert.as_deref(), key.as_deref()).unwrap()
}

async fn https_get(pki: &Pki, with_cert: bool, url: String) -> Result<(u16, Bytes), String> {
    let connector =
        HttpsConnectorBuilder::new().with_tls_config(client_config(pki, with_cert)).https_only().enable_http1().build();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let req = Request::get(url).body(Full::new(Bytes::new())).unwrap();
    let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    Ok((status, resp.into_body().collect().await.unwrap().to_bytes()))
}

#[tokio::test]
async fn the_https_listener_serves_http1_and_negotiates_h2() {
    let pki = Pki::new();
    let h = Harness::start_with(|c| c.server.tls = Some(pki.server_tls(false))).await;
    // HTTP/1.1 over TLS.
    let port = h.addr.port();
    let (status, _) = https_get(&pki, false, format!("https://localhost:{port}/missing")).await.unwrap();
    assert_eq!(status, 404);
    // h2 by ALPN, on a raw TLS connection.
    let mut tls = client_config(&pki, false);
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let stream = tokio_rustls::TlsConnector::from(Arc::new(tls)).connect(name, tcp).await.unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let req = Request::put(format!("https://localhost:{port}/doc"))
        .header("fencing-token", "3")
        .body(Full::new(Bytes::from_static(b"over h2 and TLS")))
        .unwrap();
    assert_eq!(sender.send_request(req).await.unwrap().status(), 200);
    assert_eq!(h.applied_tokens("/doc"), [3]);
}

#[tokio::test]
async fn with_a_client_ca_only_clients_holding_its_certificates_get_in() {
    let pki = Pki::new();
    let h = Harness::start_with(|c| c.server.tls = Some(pki.server_tls(true))).await;
    let url = format!("https://localhost:{}/missing", h.addr.port());
    assert!(https_get(&pki, false, url.clone()).await.is_err(), "no client certificate, no connection");
    assert_eq!(https_get(&pki, true, url).await.unwrap().0, 404);
}

#[tokio::test]
async fn an_https_backend_is_reached_with_mtls() {
    let pki = Pki::new();
    let backend_tls =
        fencegate::tls::server_config(&pki.path("server.pem"), &pki.path("server-key.pem"), Some(&pki.path("ca.pem")))
            .unwrap();
    let backend = MemBackend::start_tls(backend_tls).await.unwrap();
    let url: http::Uri = format!("https://localhost:{}", backend.addr().port()).parse().unwrap();
    let with = |cert: bool| {
        let url = url.clone();
        let pki = &pki;
        move |c: &mut fencegate::Config| {
            c.backend.url = fencegate::config::BackendUrl::Http(url);
            c.backend.tls = BackendTls {
                ca: Some(pki.path("ca.pem")),
                cert: cert.then(|| pki.path("client.pem")),
                key: cert.then(|| pki.path("client-key.pem")),
            };
        }
    };
    let h = Harness::start_with(with(true)).await;
    assert_eq!(h.put("/doc", 1, "over mTLS").await.status, 200);
    assert_eq!(backend.object("/doc").unwrap(), "over mTLS");

    // With TLS 1.3 the backend refuses a missing client certificate only after the client's
    // side of the handshake, when the request may already be on its way: a 502 either way.
    let h = Harness::start_with(with(false)).await;
    let r = h.put("/doc", 2, "no client cert").await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert!(matches!(r.fencegate_error(), Some("backend_unreachable" | "backend_error")));
    assert_eq!(backend.object("/doc").unwrap(), "over mTLS", "nothing was applied without the certificate");
}

#[test]
fn check_refuses_tls_files_that_do_not_parse() {
    let pki = Pki::new();
    std::fs::write(pki.path("broken.pem"), "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    let text = |cert: &Path| {
        format!(
            "[backend]\nurl = \"http://127.0.0.1:9000\"\n[server.tls]\ncert = {:?}\nkey = {:?}\n",
            cert.display().to_string(),
            pki.path("server-key.pem").display().to_string()
        )
    };
    assert!(fencegate::Config::from_toml_str(&text(&pki.path("server.pem"))).is_ok());
    let err = fencegate::Config::from_toml_str(&text(&pki.path("broken.pem"))).unwrap_err();
    assert!(err.to_string().contains("server.tls"), "{err}");
    let err = fencegate::Config::from_toml_str(
        "[backend]\nurl = \"http://127.0.0.1:9000\"\n[backend.tls]\nca = \"/nonexistent\"\n",
    )
    .unwrap_err();
    assert!(err.to_string().contains("only applies to an https://"), "{err}");
}

#[tokio::test]
async fn a_reload_reads_rotated_certificates_and_a_broken_rotation_changes_nothing() {
    let (old, new) = (Pki::new(), Pki::new());
    let h = Harness::start_with(|c| c.server.tls = Some(old.server_tls(false))).await;
    let url = format!("https://localhost:{}/missing", h.addr.port());
    assert_eq!(https_get(&old, false, url.clone()).await.unwrap().0, 404);
    assert!(https_get(&new, false, url.clone()).await.is_err(), "not yet rotated");

    // The files change under the same paths, as cert-manager or certbot rotate them.
    for name in ["server.pem", "server-key.pem"] {
        std::fs::copy(new.path(name), old.path(name)).unwrap();
    }
    h.proxy.reload(h.config.clone()).unwrap();
    assert_eq!(https_get(&new, false, url.clone()).await.unwrap().0, 404, "new connections get the new certificate");
    assert!(https_get(&old, false, url.clone()).await.is_err());

    // A rotation caught half-way (key missing) is refused; the certificate in force stays.
    std::fs::remove_file(old.path("server-key.pem")).unwrap();
    assert!(h.proxy.reload(h.config.clone()).is_err());
    assert_eq!(https_get(&new, false, url).await.unwrap().0, 404);
}

#[tokio::test]
async fn a_reload_closes_connections_made_under_the_old_client_ca() {
    let (a, b) = (Pki::new(), Pki::new());
    let h = Harness::start_with(|c| c.server.tls = Some(a.server_tls(true))).await;
    let url = format!("https://localhost:{}/missing", h.addr.port());
    let connector =
        HttpsConnectorBuilder::new().with_tls_config(client_config(&a, true)).https_only().enable_http1().build();
    // Reuses its connection while the proxy keeps it open.
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let get = || async {
        let resp = client.request(Request::get(url.clone()).body(Full::new(Bytes::new())).unwrap()).await?;
        let status = resp.status().as_u16();
        let _ = resp.into_body().collect().await;
        Ok::<_, hyper_util::client::legacy::Error>(status)
    };
    assert_eq!(get().await.unwrap(), 404);
    // Only clients of CA b may connect from now on: a's client is revoked.
    let mut config = h.config.clone();
    config.server.tls = Some(ServerTls { client_ca: Some(b.path("ca.pem")), ..a.server_tls(false) });
    assert!(h.proxy.reload(config).unwrap().renew_connections);
    // Until the proxy closes the old connection the client reuses it, so this fails only if
    // it is never closed (requests every few ms keep the keep-alive timeout from closing it).
    let what = "the revoked client's old connection is closed, and it cannot make a new one";
    eventually(what, async || get().await.is_err()).await;
}

#[tokio::test]
async fn a_connection_that_sends_nothing_after_the_handshake_is_closed_after_the_header_read_timeout() {
    let pki = Pki::new();
    let h = Harness::start_with(|c| {
        c.server.tls = Some(pki.server_tls(false));
        c.limits.header_read_timeout = std::time::Duration::from_millis(300);
    })
    .await;
    let tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls =
        tokio_rustls::TlsConnector::from(Arc::new(client_config(&pki, false))).connect(name, tcp).await.unwrap();
    // Within 10 s: long past the 300 ms header-read timeout, far short of the 60 s keep-alive
    // timeout that would also close it.
    let mut rest = Vec::new();
    let read = tokio::io::AsyncReadExt::read_to_end(&mut tls, &mut rest);
    let closed = tokio::time::timeout(std::time::Duration::from_secs(10), read).await;
    assert!(closed.is_ok(), "the server did not close the connection within 10 s");
    assert!(rest.is_empty(), "closed with nothing to say: {rest:?}");
}
