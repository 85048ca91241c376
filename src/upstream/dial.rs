//! Opening one backend connection: TCP, then TLS for an `https://` backend, or a Unix socket
//! for a `unix:` one, then the HTTP/1.1 handshake, all within `connect_timeout`. The task that drives the connection owns the
//! connection's permit of the pool's bound, so the permit comes back when the connection ends,
//! whoever ends it: the backend, an error, or fencegate dropping its last handle to it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Body;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio_rustls::TlsConnector;

use super::pool::SendError;

/// Where the backend is.
#[derive(Debug)]
pub(crate) enum Target {
    /// `host:port` over TCP, speaking TLS when `tls` is given.
    Tcp { host: String, port: u16, tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)> },
    /// A Unix socket, plain HTTP.
    Unix(PathBuf),
}

/// Where and how connections to the backend are opened.
pub(super) struct Dialer {
    to: To,
    timeout: Duration,
    /// How long the kernel may keep retransmitting what a TCP connection sent before it gives
    /// the connection up (`TCP_USER_TIMEOUT`; see [`bound_retransmission`]).
    unacked: Duration,
}

/// A [`Target`] with its TLS connector made once.
enum To {
    Tcp { host: String, port: u16, tls: Option<(TlsConnector, ServerName<'static>)> },
    Unix(PathBuf),
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.to {
            To::Tcp { host, port, tls } => write!(f, "{host}:{port}{}", if tls.is_some() { " (TLS)" } else { "" }),
            To::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

impl Dialer {
    /// Connections to `target`, each opened within `timeout`, whose bytes stop travelling
    /// `unacked` after they were sent if the backend has not acknowledged them.
    pub(super) fn new(target: Target, timeout: Duration, unacked: Duration) -> Self {
        let to = match target {
            Target::Tcp { host, port, tls } => {
                To::Tcp { host, port, tls: tls.map(|(config, name)| (TlsConnector::from(config), name)) }
            }
            Target::Unix(path) => To::Unix(path),
        };
        Dialer { to, timeout, unacked }
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
        let (host, port, tls) = match &self.to {
            To::Tcp { host, port, tls } => (host, *port, tls),
            To::Unix(path) => {
                let what = format!("connect to unix:{}", path.display());
                let unix = UnixStream::connect(path).await.map_err(|e| failed(&what, &e))?;
                return handshake(unix, permit).await;
            }
        };
        let tcp = TcpStream::connect((host.as_str(), port)).await.map_err(|e| failed("connect", &e))?;
        let _ = tcp.set_nodelay(true);
        bound_retransmission(&tcp, self.unacked).map_err(|e| failed("TCP_USER_TIMEOUT", &e))?;
        match tls {
            None => handshake(tcp, permit).await,
            Some((connector, name)) => {
                let stream = connector.connect(name.clone(), tcp).await.map_err(|e| failed("TLS handshake", &e))?;
                handshake(stream, permit).await
            }
        }
    }
}

/// Bounds how long the kernel retransmits what `tcp` sent and the backend did not acknowledge
/// to `unacked`, after which it drops the connection (`TCP_USER_TIMEOUT`). Without it Linux
/// retransmits for many minutes (`tcp_retries2`), also after fencegate closed the socket, so
/// a write's bytes abandoned on a link that failed could reach the backend long after the
/// quarantine meant to cover them ended (docs/faults.md, Network partitions).
pub(crate) fn bound_retransmission(tcp: &TcpStream, unacked: Duration) -> std::io::Result<()> {
    let ms = u32::try_from(unacked.as_millis()).unwrap_or(u32::MAX).max(1);
    rustix::net::sockopt::set_tcp_user_timeout(tcp, ms).map_err(std::io::Error::from)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_backend_connection_bounds_how_long_its_bytes_are_retransmitted() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tcp = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        assert_eq!(rustix::net::sockopt::tcp_user_timeout(&tcp).unwrap(), 0, "the kernel's default: no bound");
        bound_retransmission(&tcp, Duration::from_millis(22_500)).unwrap();
        assert_eq!(rustix::net::sockopt::tcp_user_timeout(&tcp).unwrap(), 22_500);
    }
}
