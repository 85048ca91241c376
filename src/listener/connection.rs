//! One client connection: HTTP/1.1 or HTTP/2 (over TLS when configured), closed when its
//! first request does not arrive within the header-read timeout or when idle past the
//! keep-alive timeout, renewed after a reload that changed listener settings, and given the
//! shutdown grace to finish when the proxy stops.
//!
//! hyper's HTTP/1 header-read timeout runs only once hyper-util's `auto` builder has read
//! enough bytes to tell HTTP/1 from the HTTP/2 preface, and HTTP/2 has none: a connection
//! that sends nothing, or part of the preface, would wait for the keep-alive timeout. So the
//! first request gets its own deadline here, watched beside the keep-alive timeout and not on
//! the request path.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::{OwnedSemaphorePermit, mpsc, oneshot, watch};
// Tokio's clock, so that the deadlines can be tested on a paused one.
use tokio::time::Instant;

use super::{Handler, Remote};
use crate::state::{Settings, State};

/// One client connection and what it holds while it lives.
pub(super) struct Conn<H> {
    /// The listener settings this connection was accepted with.
    pub(super) settings: Arc<Settings>,
    /// Fires when a reload changed them: then the connection finishes its request and closes.
    pub(super) renewals: watch::Receiver<u64>,
    /// Whether this listener terminates TLS (when `server.tls` is configured).
    pub(super) tls: bool,
    pub(super) state: Arc<State>,
    pub(super) handler: H,
    pub(super) client: Remote,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) _permit: OwnedSemaphorePermit,
    pub(super) _alive: mpsc::Sender<()>,
    pub(super) _open: Open,
}

/// Counts a connection in `fencegate_open_connections` while it is open.
pub(super) struct Open(prometheus_client::metrics::gauge::Gauge);

impl Open {
    pub(super) fn new(gauge: prometheus_client::metrics::gauge::Gauge) -> Open {
        gauge.inc();
        Open(gauge)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl<H: Handler> Conn<H> {
    /// Serves the accepted `stream` (its socket options already set).
    pub(super) async fn serve<S>(self, stream: S)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        // The TLS handshake and the first request's head share one header-read timeout, from
        // the accept on: a connection that stalls in either is slowloris too.
        let first_request = Instant::now() + self.settings.config.limits.header_read_timeout;
        match self.settings.acceptor.clone().filter(|_| self.tls) {
            Some(acceptor) => match tokio::time::timeout_at(first_request, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => self.serve_io(tls, first_request).await,
                Ok(Err(e)) => tracing::debug!(client = %self.client, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(client = %self.client, "TLS handshake timed out"),
            },
            None => self.serve_io(stream, first_request).await,
        }
    }

    /// Serves HTTP on `io`; its first request's head must be in by `first_request`.
    async fn serve_io<I>(self, io: I, first_request: Instant)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let activity = Arc::new(Activity::new());
        let (handler, requests) = (self.handler.clone(), Arc::clone(&activity));
        let (client, peer) = (self.client, self.handler.client(self.client));
        let service = service_fn(move |req| {
            let (busy, bytes_out) = (requests.busy(), handler.bytes_out().cloned());
            let (handler, client) = (handler.clone(), peer.clone());
            // Written into a new box, which lets it be built in place: hyper moves the future
            // into its own slot, and moved whole, the handler's state (some 7 KiB) would be
            // copied on every request.
            Box::into_pin(Box::write(Box::new_uninit(), respond(handler, req, client, busy, bytes_out)))
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
        // Shutdown, reload, the first request's deadline and keep-alive are watched by a task
        // of their own: in this select, they would be polled again on every wake-up of the
        // connection, several per request.
        let (closing, mut asked) = oneshot::channel();
        let mut watching = deadline.is_none();
        if watching {
            let watcher = (self.stop.clone(), self.renewals.clone(), Arc::clone(&self.state));
            let limits = Limits { first_request, keepalive, grace };
            tokio::spawn(watch_connection(watcher, activity, limits, client, closing));
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

/// What a connection's watcher closes it by.
struct Limits {
    /// Its first request's head must have arrived by then.
    first_request: Instant,
    /// Without a request this long, it closes.
    keepalive: Duration,
    /// Once a reload asks it to close, it gets this long to finish.
    grace: Duration,
}

/// Waits until a connection should close: shutdown, a reload that renews connections, no
/// request by `limits.first_request`, or `limits.keepalive` without a request. Sends how long
/// it then gets to finish; ends quietly when the connection ends first.
async fn watch_connection(
    (mut stop, mut renewals, state): (watch::Receiver<bool>, watch::Receiver<u64>, Arc<State>),
    activity: Arc<Activity>,
    limits: Limits,
    client: Remote,
    mut closing: oneshot::Sender<Duration>,
) {
    let period = tokio::select! {
        () = closing.closed() => return,
        // The grace in force now: a reload may have changed it.
        _ = stop.changed() => state.settings.get().config.server.shutdown_grace,
        _ = renewals.changed() => limits.grace,
        unused = activity.unused(limits.keepalive, limits.first_request) => match unused {
            Unused::NoRequest => {
                tracing::debug!(%client, "no request within the header-read timeout");
                Duration::ZERO // it has nothing to finish
            }
            Unused::Idle => limits.keepalive,
        },
    };
    let _ = closing.send(period);
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
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
    /// Whether a request has arrived.
    requested: AtomicBool,
}

/// Marks a request as being handled until dropped.
struct Busy(Arc<Activity>);

/// Answers one request through `handler`; the connection counts as busy until the response
/// is made, and its body marks it active whenever its client takes a frame.
async fn respond<H: Handler>(
    handler: H,
    req: hyper::Request<hyper::body::Incoming>,
    client: H::Client,
    busy: Busy,
    bytes_out: Option<Counter>,
) -> Result<hyper::Response<ActiveBody<H::Body>>, Infallible> {
    let resp = handler.handle(req, client).await;
    let activity = Arc::clone(&busy.0);
    let busy = H::BUSY_UNTIL_BODY_ENDS.then_some(busy);
    Ok(resp.map(|body| ActiveBody { body, activity, bytes_out, _busy: busy }))
}

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
        Activity {
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            requested: AtomicBool::new(false),
        }
    }

    fn touch(&self) {
        self.last_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn busy(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        // A plain store: no read-modify-write on the request path.
        self.requested.store(true, Ordering::Relaxed);
        Busy(Arc::clone(self))
    }

    /// Resolves once no request has arrived by `first_request`, or the connection has done
    /// nothing (no request, no body read) for `keepalive`. One timer for both: a second one
    /// would cost every connection its own registration.
    async fn unused(&self, keepalive: Duration, first_request: Instant) -> Unused {
        loop {
            // Acquire, and first: a request that ended is seen with the touch it made.
            let busy = self.busy.load(Ordering::Acquire) > 0;
            let requested = busy || self.requested.load(Ordering::Relaxed);
            let now = Instant::now();
            if !requested && now >= first_request {
                return Unused::NoRequest;
            }
            let since = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let idle = now.saturating_duration_since(self.epoch).saturating_sub(since);
            let mut wait = if busy {
                keepalive // a request is being handled: look again a whole period later
            } else if idle >= keepalive {
                return Unused::Idle;
            } else {
                keepalive - idle
            };
            if !requested {
                wait = wait.min(first_request - now);
            }
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        }
    }
}

/// Why a connection is closed for want of requests.
enum Unused {
    /// Its first request's head did not arrive within the header-read timeout.
    NoRequest,
    /// It did nothing for the keep-alive timeout.
    Idle,
}

/// A response body that marks its connection active whenever the client takes a frame, and
/// counts the bytes it takes if its listener counts them.
struct ActiveBody<B> {
    body: B,
    activity: Arc<Activity>,
    bytes_out: Option<Counter>,
    /// The request's mark as being handled, kept until the body ends where the handler asks
    /// for it ([`Handler::BUSY_UNTIL_BODY_ENDS`]).
    _busy: Option<Busy>,
}

impl<B: Body<Data = Bytes> + Unpin> Body for ActiveBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.activity.touch();
            if let (Some(data), Some(bytes_out)) = (frame.data_ref(), &self.bytes_out) {
                bytes_out.inc_by(data.len() as u64);
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

#[cfg(test)]
mod tests {
    use super::*;

    const KEEPALIVE: Duration = Duration::from_secs(60);
    const HEADER_READ: Duration = Duration::from_secs(10);

    /// When `unused` resolves on the paused clock, counted from now, and why.
    async fn unused_after(activity: &Activity, first_request: Instant) -> (Duration, &'static str) {
        let start = Instant::now();
        let why = match activity.unused(KEEPALIVE, first_request).await {
            Unused::NoRequest => "no request",
            Unused::Idle => "idle",
        };
        (start.elapsed(), why)
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_a_request_closes_at_the_header_read_deadline() {
        let activity = Activity::new();
        let found = unused_after(&activity, Instant::now() + HEADER_READ).await;
        assert_eq!(found, (HEADER_READ, "no request"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_closes_a_keepalive_period_after_it_last_did_anything() {
        let activity = Arc::new(Activity::new());
        let first_request = Instant::now() + HEADER_READ;
        // A request at 5 s, answered at once; its body taken at 20 s.
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(activity.busy());
        let reader = Arc::clone(&activity);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(15)).await;
            reader.touch();
        });
        let (after, why) = unused_after(&activity, first_request).await;
        assert_eq!(why, "idle");
        // Idle from 20 s: closed at 80 s, 75 s after the wait began (at whole milliseconds,
        // the touch's resolution, and at most one look late by the 10 ms floor).
        assert!(after >= Duration::from_secs(75) && after <= Duration::from_millis(75_010), "{after:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_connection_is_never_idle_and_its_period_starts_when_it_ends() {
        let activity = Arc::new(Activity::new());
        let busy = activity.busy();
        let first_request = Instant::now() + HEADER_READ;
        let ends = tokio::spawn(async move {
            // A request the backend holds for five keep-alive periods.
            tokio::time::sleep(KEEPALIVE * 5).await;
            drop(busy);
        });
        let (after, why) = unused_after(&activity, first_request).await;
        ends.await.unwrap();
        assert_eq!(why, "idle", "never closed for want of a first request: one was being handled");
        assert!(after >= KEEPALIVE * 6, "idle only a whole period after the request ended: {after:?}");
        assert!(after <= KEEPALIVE * 7, "and then within one more look: {after:?}");
    }
}
