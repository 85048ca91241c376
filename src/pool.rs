//! Connections to the backend: HTTP/1.1 over TCP or TLS, kept alive and reused, one request at
//! a time each.
//!
//! hyper-util's general-purpose pooled client keys its pool by scheme and authority, hashed
//! byte by byte with SipHash, several times per request; a sidecar has exactly one backend, so
//! its pool is a list. Profiles of pass-through GETs put the general client at about a sixth
//! of fencegate's own instructions per request.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Idle connections kept at most; more are closed once their response is read.
const MAX_IDLE: usize = 1024;

/// Why a request did not get a response head.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could be made (refused, timed out, TLS handshake failed).
    #[error("{0}")]
    Connect(String),
    /// The exchange failed after the request may have been (partly) sent.
    #[error(transparent)]
    Http(#[from] hyper::Error),
}

/// One backend's connections.
pub(crate) struct Pool<B> {
    host: String,
    port: u16,
    tls: Option<(TlsConnector, ServerName<'static>)>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<Vec<Idle<B>>>,
}

struct Idle<B> {
    sender: SendRequest<B>,
    since: Instant,
}

impl<B> std::fmt::Debug for Pool<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("host", &self.host).field("port", &self.port).finish_non_exhaustive()
    }
}

impl<B> Pool<B>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// A pool for `host:port`, speaking TLS when `tls` is given.
    pub(crate) fn new(
        host: String,
        port: u16,
        tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
        connect_timeout: Duration,
        idle_timeout: Duration,
    ) -> Arc<Self> {
        let tls = tls.map(|(config, name)| (TlsConnector::from(config), name));
        Arc::new(Pool { host, port, tls, connect_timeout, idle_timeout, idle: Mutex::new(Vec::new()) })
    }

    /// Sends `req` (origin-form target, `Host` set) and returns the response head. A request
    /// is sent again, on a new connection, only if a reused connection closed before any of it
    /// was written; nothing that may have reached the backend is ever retried.
    pub(crate) async fn send(self: &Arc<Self>, mut req: Request<B>) -> Result<Response<Incoming>, SendError> {
        loop {
            let (mut sender, reused) = match self.checkout() {
                Some(s) => (s, true),
                // Boxed: a TLS handshake's state is kilobytes, and every request's future
                // would otherwise carry room for it and be copied with it.
                None => (Box::pin(self.connect()).await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    self.checkin(sender);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(SendError::Http(e.into_error())),
                },
            }
        }
    }

    /// The most recently used connection that can take a request now. Connections whose
    /// previous response body is still being read stay listed; closed or stale ones go.
    fn checkout(&self) -> Option<SendRequest<B>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.drop_stale(&mut idle);
        let ready = idle.iter().rposition(|c| c.sender.is_ready())?;
        Some(idle.swap_remove(ready).sender)
    }

    /// Closes connections the backend closed or that have been idle too long.
    pub(crate) fn prune(&self) {
        self.drop_stale(&mut self.idle.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn drop_stale(&self, idle: &mut Vec<Idle<B>>) {
        let now = Instant::now();
        idle.retain(|c| !c.sender.is_closed() && now.duration_since(c.since) < self.idle_timeout);
    }

    /// Lists a connection as soon as its response head is in: it becomes ready again once the
    /// response body has been read.
    fn checkin(&self, sender: SendRequest<B>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(Idle { sender, since: Instant::now() });
        }
    }

    /// TCP connect and TLS handshake together get `connect_timeout`.
    async fn connect(&self) -> Result<SendRequest<B>, SendError> {
        match tokio::time::timeout(self.connect_timeout, self.open()).await {
            Ok(opened) => opened,
            Err(_) => Err(SendError::Connect(format!("connect: timed out after {:?}", self.connect_timeout))),
        }
    }

    async fn open(&self) -> Result<SendRequest<B>, SendError> {
        let failed = |what: &str, e: &dyn std::fmt::Display| SendError::Connect(format!("{what}: {e}"));
        let tcp = TcpStream::connect((self.host.as_str(), self.port)).await.map_err(|e| failed("connect", &e))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => self.handshake(tcp).await,
            Some((connector, name)) => {
                let stream = connector.connect(name.clone(), tcp).await.map_err(|e| failed("TLS handshake", &e))?;
                self.handshake(stream).await
            }
        }
    }

    async fn handshake<I>(&self, io: I) -> Result<SendRequest<B>, SendError>
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) = http1::Builder::new().handshake(TokioIo::new(io)).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "backend connection ended with an error");
            }
        });
        Ok(sender)
    }
}
