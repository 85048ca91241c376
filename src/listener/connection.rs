//! One client connection: HTTP/1.1 or HTTP/2 (over TLS when configured), closed when idle
//! past the keep-alive timeout, renewed after a reload that changed listener settings, and
//! given the shutdown grace to finish when the proxy stops.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, mpsc, oneshot, watch};

use crate::app::{Settings, State};
use crate::request::{self, ResponseBody};
use crate::upstream::Peer;

/// One client connection and what it holds while it lives.
pub(super) struct Conn {
    /// The listener settings this connection was accepted with.
    pub(super) settings: Arc<Settings>,
    /// Fires when a reload changed them: then the connection finishes its request and closes.
    pub(super) renewals: watch::Receiver<u64>,
    pub(super) state: Arc<State>,
    pub(super) client: SocketAddr,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) _permit: OwnedSemaphorePermit,
    pub(super) _alive: mpsc::Sender<()>,
}

impl Conn {
    pub(super) async fn serve(self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        match self.settings.acceptor.clone() {
            // The handshake counts against the header-read timeout: a stalled handshake is
            // slowloris too.
            Some(acceptor) => {
                let timeout = self.settings.config.limits.header_read_timeout;
                match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => self.serve_io(tls).await,
                    Ok(Err(e)) => tracing::debug!(client = %self.client, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(client = %self.client, "TLS handshake timed out"),
                }
            }
            None => self.serve_io(stream).await,
        }
    }

    async fn serve_io<I>(self, io: I)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let activity = Arc::new(Activity::new());
        let (state, requests) = (Arc::clone(&self.state), Arc::clone(&activity));
        let (client, peer) = (self.client, Peer::new(self.client));
        let service = service_fn(move |req| {
            let (state, busy, client) = (Arc::clone(&state), requests.busy(), peer.clone());
            async move {
                let bytes_out = state.metrics.bytes_out.clone();
                let resp = request::handle(state, req, client).await;
                let activity = Arc::clone(&busy.0);
                drop(busy);
                Ok::<_, Infallible>(resp.map(|body| ActiveBody { body, activity, bytes_out }))
            }
        });
        let conn = self.settings.http.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let config = &self.settings.config;
        let (keepalive, grace) = (config.limits.keepalive_timeout, config.server.shutdown_grace);
        // Once asked to close, a connection gets this long to finish what it is doing; a
        // client that stops reading must not keep its slot forever.
        let mut deadline = None;
        if *self.stop.borrow() {
            conn.as_mut().graceful_shutdown();
            deadline = Some(Instant::now() + grace);
        }
        // Shutdown, reload and keep-alive are watched by a task of their own: in this select,
        // they would be polled again on every wake-up of the connection, several per request.
        let (closing, mut asked) = oneshot::channel();
        let mut watching = deadline.is_none();
        if watching {
            let watcher = (self.stop.clone(), self.renewals.clone(), Arc::clone(&self.state));
            tokio::spawn(watch_connection(watcher, activity, keepalive, grace, closing));
        }
        loop {
            tokio::select! {
                biased;
                done = conn.as_mut() => {
                    if let Err(e) = done {
                        tracing::debug!(%client, error = %e, "connection ended with an error");
                    }
                    return;
                }
                period = &mut asked, if watching => {
                    watching = false;
                    if let Ok(period) = period {
                        conn.as_mut().graceful_shutdown();
                        deadline = Some(Instant::now() + period);
                    }
                }
                () = sleep_until_some(deadline) => {
                    tracing::debug!(%client, "closing a connection that did not finish in time");
                    return;
                }
            }
        }
    }
}

/// Waits until a connection should close: shutdown, a reload that renews connections, or
/// `keepalive` without a request. Sends how long it then gets to finish; ends quietly when
/// the connection ends first.
async fn watch_connection(
    (mut stop, mut renewals, state): (watch::Receiver<bool>, watch::Receiver<u64>, Arc<State>),
    activity: Arc<Activity>,
    keepalive: Duration,
    grace: Duration,
    mut closing: oneshot::Sender<Duration>,
) {
    let period = tokio::select! {
        () = closing.closed() => return,
        // The grace in force now: a reload may have changed it.
        _ = stop.changed() => state.settings.get().config.server.shutdown_grace,
        _ = renewals.changed() => grace,
        () = activity.idle(keepalive) => keepalive,
    };
    let _ = closing.send(period);
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// Whether a connection is doing anything: handling a request, or delivering a response
/// body that its client is reading. Bytes the client sends (HTTP/2 PINGs, a preface trickled
/// in) do not count, so they cannot keep a connection slot forever.
struct Activity {
    epoch: Instant,
    last_ms: AtomicU64,
    busy: AtomicUsize,
}

/// Marks a request as being handled until dropped.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        // Release: whoever sees the count drop (the watcher, perhaps on another worker) sees
        // the touch before it.
        self.0.busy.fetch_sub(1, Ordering::Release);
    }
}

impl Activity {
    fn new() -> Self {
        Activity { epoch: Instant::now(), last_ms: AtomicU64::new(0), busy: AtomicUsize::new(0) }
    }

    fn touch(&self) {
        self.last_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn busy(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        Busy(Arc::clone(self))
    }

    /// Resolves once the connection has done nothing (no request, no body read) for `limit`.
    async fn idle(&self, limit: Duration) {
        loop {
            // Acquire, and first: a request that ended is seen with the touch it made.
            let busy = self.busy.load(Ordering::Acquire) > 0;
            let since = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let idle = self.epoch.elapsed().saturating_sub(since);
            let wait = if busy {
                limit // a request is being handled: look again a whole period later
            } else if idle >= limit {
                return;
            } else {
                limit - idle
            };
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        }
    }
}

/// A response body that marks its connection active whenever the client takes a frame.
struct ActiveBody {
    body: ResponseBody,
    activity: Arc<Activity>,
    bytes_out: prometheus_client::metrics::counter::Counter,
}

impl Body for ActiveBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.activity.touch();
            if let Some(data) = frame.data_ref() {
                self.bytes_out.inc_by(data.len() as u64);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
