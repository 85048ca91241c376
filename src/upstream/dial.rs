//! Opening one backend connection: TCP, then TLS for an `https://` backend, then the HTTP/1.1
//! handshake, all within `connect_timeout`. The task that drives the connection owns the
//! connection's permit of the pool's bound, so the permit comes back when the connection ends,
//! whoever ends it: the backend, an error, or fencegate dropping its last handle to it.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Body;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio_rustls::TlsConnector;

use super::pool::SendError;

/// Where and how connections to the backend are opened.
pub(super) struct Dialer {
    pub(super) host: String,
    pub(super) port: u16,
    tls: Option<(TlsConnector, ServerName<'static>)>,
    timeout: Duration,
}

impl Dialer {
    /// Connections to `host:port`, speaking TLS when `tls` is given.
    pub(super) fn new(
        host: String,
        port: u16,
        tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
        timeout: Duration,
    ) -> Self {
        let tls = tls.map(|(config, name)| (TlsConnector::from(config), name));
        Dialer { host, port, tls, timeout }
    }

    /// Opens a connection that holds `permit` for as long as it is open. On failure the permit
    /// is dropped here, and with it the room for another connection comes back.
    pub(super) async fn dial<B>(&self, permit: OwnedSemaphorePermit) -> Result<SendRequest<B>, SendError>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        match tokio::time::timeout(self.timeout, self.open(permit)).await {
            Ok(opened) => opened,
            Err(_) => Err(SendError::Connect(format!("connect: timed out after {:?}", self.timeout))),
        }
    }

    async fn open<B>(&self, permit: OwnedSemaphorePermit) -> Result<SendRequest<B>, SendError>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let failed = |what: &str, e: &dyn std::fmt::Display| SendError::Connect(format!("{what}: {e}"));
        let tcp = TcpStream::connect((self.host.as_str(), self.port)).await.map_err(|e| failed("connect", &e))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => handshake(tcp, permit).await,
            Some((connector, name)) => {
                let stream = connector.connect(name.clone(), tcp).await.map_err(|e| failed("TLS handshake", &e))?;
                handshake(stream, permit).await
            }
        }
    }
}

/// The HTTP/1.1 handshake (no I/O of its own), and the task that drives the connection.
async fn handshake<I, B>(io: I, permit: OwnedSemaphorePermit) -> Result<SendRequest<B>, SendError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (sender, conn) = http1::Builder::new()
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| SendError::Connect(format!("HTTP/1.1 handshake: {e}")))?;
    tokio::spawn(async move {
        // Ends when the backend closes the connection, it fails, or every handle to it is
        // dropped while it is idle; only then is there room for another one.
        let _permit = permit;
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "backend connection ended with an error");
        }
    });
    Ok(sender)
}
