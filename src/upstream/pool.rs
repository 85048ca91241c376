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
    /// Kept-alive connections, most recently listed last: idle ones, and ones whose response
    /// body is still being read (they become ready again once it has been).
    listed: Mutex<Vec<Listed<B>>>,
}

/// A connection in the list, and when it was listed.
struct Listed<B> {
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
        Arc::new(Pool { host, port, tls, connect_timeout, idle_timeout, listed: Mutex::new(Vec::new()) })
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

    /// The most recently listed connection that can take a request now. Connections whose
    /// previous response body is still being read stay listed; closed ones met on the way
    /// go. Only a candidate's age is checked (the heartbeat's `prune` ages out the rest once
    /// a second), which spares each request a time computation per listed connection.
    fn checkout(&self) -> Option<SendRequest<B>> {
        let mut listed = self.listed.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // From the end, so that what `swap_remove` moves into place was already looked at.
        for i in (0..listed.len()).rev() {
            if listed[i].sender.is_ready() {
                let candidate = listed.swap_remove(i);
                if now.duration_since(candidate.since) < self.idle_timeout {
                    return Some(candidate.sender);
                }
            } else if listed[i].sender.is_closed() {
                listed.swap_remove(i);
            }
        }
        None
    }

    /// Closes connections the backend closed or that have been idle too long.
    pub(crate) fn prune(&self) {
        self.drop_stale(&mut self.listed.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn drop_stale(&self, listed: &mut Vec<Listed<B>>) {
        let now = Instant::now();
        listed.retain(|c| !c.sender.is_closed() && now.duration_since(c.since) < self.idle_timeout);
    }

    /// Lists a connection as soon as its response head is in: it becomes ready again once the
    /// response body has been read.
    fn checkin(&self, sender: SendRequest<B>) {
        let mut listed = self.listed.lock().unwrap_or_else(|e| e.into_inner());
        if listed.len() >= MAX_IDLE {
            self.drop_stale(&mut listed); // never turn a live one away for dead or stale ones
        }
        if listed.len() < MAX_IDLE {
            listed.push(Listed { sender, since: Instant::now() });
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};

    use super::*;

    /// A backend that answers every request with an empty 200 (closing the connection after
    /// it if `close`) and counts its connections.
    async fn backend(close: bool) -> (u16, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, SeqCst);
                let answer = hyper::service::service_fn(move |_| async move {
                    let mut resp = Response::new(Empty::<Bytes>::new());
                    if close {
                        resp.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                });
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), answer));
            }
        });
        (port, accepted)
    }

    fn pool(port: u16) -> Arc<Pool<Empty<Bytes>>> {
        Pool::new("127.0.0.1".into(), port, None, Duration::from_secs(5), Duration::from_secs(60))
    }

    /// Sends a GET, reads the whole response, and waits until every listed connection is
    /// either ready for another request or closed.
    async fn get(pool: &Arc<Pool<Empty<Bytes>>>) {
        let req = Request::get("/").header("host", "backend").body(Empty::new()).unwrap();
        pool.send(req).await.unwrap().into_body().collect().await.unwrap();
        for _ in 0..1000 {
            if pool.listed.lock().unwrap().iter().all(|c| c.sender.is_ready() || c.sender.is_closed()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("a connection never settled after its response");
    }

    #[tokio::test]
    async fn an_idle_connection_is_reused_until_it_has_been_idle_longer_than_the_idle_timeout() {
        let (port, accepted) = backend(false).await;
        let pool = pool(port);
        get(&pool).await;
        get(&pool).await;
        assert_eq!(accepted.load(SeqCst), 1, "a fresh idle connection is reused");
        // Listed 61 s ago, as far as the pool can tell; the heartbeat has not pruned it.
        for c in pool.listed.lock().unwrap().iter_mut() {
            c.since = c.since.checked_sub(Duration::from_secs(61)).unwrap();
        }
        get(&pool).await;
        assert_eq!(accepted.load(SeqCst), 2, "one idle past the timeout is not");
        get(&pool).await;
        assert_eq!(accepted.load(SeqCst), 2);
    }

    #[tokio::test]
    async fn connections_the_backend_closed_do_not_pile_up_in_the_idle_list() {
        let (port, accepted) = backend(true).await;
        let pool = pool(port);
        for _ in 0..20 {
            get(&pool).await;
        }
        assert_eq!(accepted.load(SeqCst), 20, "a closed connection is never reused");
        // Each request's checkout removed the closed connections before it; only the last is left.
        assert_eq!(pool.listed.lock().unwrap().len(), 1);
    }
}
