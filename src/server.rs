//! The listener: accepts connections (at most `limits.max_connections`), serves HTTP/1.1 and
//! HTTP/2 on them, closes idle ones, and drains them on shutdown.

use std::convert::Infallible;
use std::future::Future;
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
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};

use crate::admin;
use crate::config::{Config, MissingToken};
use crate::error::Error;
use crate::fence::FenceTable;
use crate::handler::{self, Shared};
use crate::live::{self, Live, Reload, Slot};
use crate::metrics::Metrics;
use crate::path;
use crate::proxy::{Peer, ProxyBody};
use crate::refusals::RefusalLog;
use crate::store::{FileStore, StoreOptions};

/// An opened proxy: store recovered and locked, ready to serve.
#[derive(Debug, Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

impl Proxy {
    /// Locks the data directory, recovers `max_seen` from disk and prepares the backend client.
    /// Serve it on the runtime that opened it: the store's writer is a task there.
    pub async fn open(config: Config) -> Result<Self, Error> {
        let metrics = Arc::new(Metrics::default());
        let observed = Arc::clone(&metrics);
        let options = StoreOptions {
            sync: config.store.sync,
            segment_bytes: config.store.segment_bytes,
            max_resources: config.store.max_resources,
            keying: path::keying(&config.paths, &config.fence.scopes),
            on_commit: Some(Arc::new(move |took, advances| observed.commit(took, advances))),
        };
        if config.fence.missing_token == MissingToken::Forward {
            warn_forwarding_tokenless();
        }
        tracing::info!(dir = %config.store.dir.display(), "opening the fence store");
        let store = FileStore::open(&config.store.dir, options)?;
        let table = Arc::new(FenceTable::new(Arc::clone(store.table())));
        // The backend may still apply writes the previous process had in flight.
        for (key, token) in store.in_flight_at_start() {
            tracing::warn!(resource = %key, token, quarantine = ?config.fence.quarantine,
                "a write was in flight when fencegate stopped: resource quarantined");
            table.quarantine(key, config.fence.quarantine);
        }
        let refusals = RefusalLog::new();
        let live = Slot::new(Live::build(config, metrics.bytes_in.clone(), None)?);
        let shared = Shared { live, table, store: Arc::new(store), refusals, metrics };
        Ok(Proxy { shared: Arc::new(shared) })
    }

    /// Applies `config` as far as a running proxy can: fence policy, timeouts, limits, log
    /// level, backend and TLS certificates (read anew even if their paths did not change).
    /// Settings in [`live::RESTART_ONLY`] keep their running values and are reported. If anything
    /// fails to build, nothing changes.
    pub fn reload(&self, config: Config) -> Result<Reload, Error> {
        let _one_at_a_time = self.shared.live.lock();
        let current = self.shared.live.get();
        let (config, report) = live::merge(&current.config, config);
        let next = Live::build(config, self.shared.metrics.bytes_in.clone(), Some(&current))?;
        let (old, new) = (&current.config.fence, &next.config.fence);
        let unfenced: Vec<&str> = old.methods.iter().filter(|m| !new.methods.contains(m)).map(|m| m.as_str()).collect();
        if !unfenced.is_empty() {
            tracing::warn!(methods = ?unfenced, "reload: these methods are no longer fenced; their writes pass unchecked");
        }
        if new.missing_token == MissingToken::Forward
            && (old.missing_token != MissingToken::Forward || old.header != new.header)
        {
            warn_forwarding_tokenless();
        }
        let (old_level, new_level) = (current.config.log.level.clone(), next.config.log.level.clone());
        self.shared.live.set(next, report.renew_connections);
        crate::logging::change_level(&old_level, &new_level, || live::log(&report));
        Ok(report)
    }

    /// The highest token the resource `key` has accepted (keys are canonical paths).
    pub fn max_seen(&self, key: &str) -> Option<u64> {
        self.shared.table.max_seen(key)
    }

    /// Serves the admin API on `listener` until `shutdown` resolves.
    pub async fn serve_admin(self, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        admin::serve(self.shared, listener, shutdown).await
    }

    /// The configuration in force.
    pub fn config(&self) -> Config {
        self.shared.live.get().config.clone()
    }

    /// Serves `listener` until `shutdown` resolves, then stops accepting, lets in-flight
    /// requests finish within `server.shutdown_grace`, and closes the store.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let live = self.shared.live.get();
        let config = &live.config;
        let permits = Arc::new(Semaphore::new(config.limits.max_connections));
        let heartbeat = tokio::spawn(heartbeat(Arc::clone(&self.shared)));
        let (stop, stopping) = watch::channel(false);
        // Every connection holds a sender; the receiver ends once all are gone.
        let (alive, mut drained) = mpsc::channel::<()>(1);
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, backend = %config.backend.url, "fencegate listening");
        }
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break,
                permit = Arc::clone(&permits).acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let accepted = tokio::select! {
                biased;
                () = &mut shutdown => break,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, client)) => {
                    let conn = Conn {
                        renewals: self.shared.live.renewals(),
                        live: self.shared.live.get(),
                        shared: Arc::clone(&self.shared),
                        client,
                        stop: stopping.clone(),
                        _permit: permit,
                        _alive: alive.clone(),
                    };
                    tokio::spawn(conn.serve(stream));
                }
                Err(e) => {
                    // Typically EMFILE: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        drop(listener);
        heartbeat.abort();
        let grace = self.shared.live.get().config.server.shutdown_grace;
        tracing::info!(?grace, "shutting down: draining connections");
        let _ = stop.send(true);
        drop(alive);
        if tokio::time::timeout(grace, drained.recv()).await.is_err() {
            tracing::warn!("shutdown grace elapsed with requests still in flight");
        }
        self.shared.store.close().await?;
        tracing::info!("fence store closed");
        Ok(())
    }
}

/// One client connection and what it holds while it lives.
struct Conn {
    /// The listener settings this connection was accepted with.
    live: Arc<Live>,
    /// Fires when a reload changed them: then the connection finishes its request and closes.
    renewals: watch::Receiver<u64>,
    shared: Arc<Shared>,
    client: SocketAddr,
    stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
    _alive: mpsc::Sender<()>,
}

impl Conn {
    async fn serve(self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        match self.live.acceptor.clone() {
            // The handshake counts against the header-read timeout: a stalled handshake is
            // slowloris too.
            Some(acceptor) => {
                let timeout = self.live.config.limits.header_read_timeout;
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
        let (shared, requests) = (Arc::clone(&self.shared), Arc::clone(&activity));
        let (client, peer) = (self.client, Peer::new(self.client));
        let service = service_fn(move |req| {
            let (shared, busy, client) = (Arc::clone(&shared), requests.busy(), peer.clone());
            async move {
                let bytes_out = shared.metrics.bytes_out.clone();
                let resp = handler::handle(shared, req, client).await;
                let activity = Arc::clone(&busy.0);
                drop(busy);
                Ok::<_, Infallible>(resp.map(|body| ActiveBody { body, activity, bytes_out }))
            }
        });
        let conn = self.live.http.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let config = &self.live.config;
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
            let watcher = (self.stop.clone(), self.renewals.clone(), Arc::clone(&self.shared));
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
    (mut stop, mut renewals, shared): (watch::Receiver<bool>, watch::Receiver<u64>, Arc<Shared>),
    activity: Arc<Activity>,
    keepalive: Duration,
    grace: Duration,
    mut closing: oneshot::Sender<Duration>,
) {
    let period = tokio::select! {
        () = closing.closed() => return,
        // The grace in force now: a reload may have changed it.
        _ = stop.changed() => shared.live.get().config.server.shutdown_grace,
        _ = renewals.changed() => grace,
        () = activity.idle(keepalive) => keepalive,
    };
    let _ = closing.send(period);
}

/// Once a second: closes stale idle backend connections, and keeps the timer wheel's next
/// deadline within a second. Every request sets timers (header read, backend response) seconds
/// away; when one is earlier than the wheel's next deadline, tokio wakes its own driver with an
/// `eventfd` write, one system call per request for nothing. With this tick that happens only
/// for timeouts configured under a second.
async fn heartbeat(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.live.get().forwarder.prune();
    }
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
    body: ProxyBody,
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

/// Opens the proxy for `config` and serves `listener` (and the admin API, if configured)
/// until `shutdown` resolves.
pub async fn run(listener: TcpListener, config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    Proxy::open(config).await?.run(listener, shutdown).await
}

impl Proxy {
    /// Serves `listener`, and the admin API if `admin.listen` is set, until `shutdown` resolves.
    pub async fn run(self, listener: TcpListener, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let (stop, stopped) = watch::channel(false);
        let admin = match self.shared.live.get().config.admin.listen {
            Some(addr) => {
                let admin_listener = TcpListener::bind(addr).await?;
                let mut stopped = stopped.clone();
                let until = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                Some(tokio::spawn(self.clone().serve_admin(admin_listener, until)))
            }
            None => None,
        };
        let result = self
            .serve(listener, async move {
                shutdown.await;
                let _ = stop.send(true);
            })
            .await;
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        result
    }
}

fn warn_forwarding_tokenless() {
    tracing::warn!(
        "fence.missing_token = \"forward\": writes without a token pass unchecked, so a zombie \
        that omits the header is not fenced; use this only while clients migrate"
    );
}
