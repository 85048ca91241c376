//! Connections to the backend: HTTP/1.1 over TCP or TLS, kept alive and reused, one request at
//! a time each, and at most `backend.max_connections` open at once.
//!
//! hyper-util's general-purpose pooled client keys its pool by scheme and authority, hashed
//! byte by byte with SipHash, several times per request; a sidecar has exactly one backend, so
//! its pool is a list. Profiles of pass-through GETs put the general client at about a sixth
//! of fencegate's own instructions per request.
//!
//! The bound is a semaphore with one permit per open connection, held by the task that drives
//! the connection (`dial.rs`), so it comes back however the connection ends. A connection is
//! in the idle list only while it is ready for a request; in between it is a caller's
//! [`Checkout`] and then the [`Relayed`] body of its response, which gives it back when the
//! body ends. A request that finds neither an idle connection nor a permit waits for whichever
//! comes first, up to `pool_timeout`: a connection given back (each one wakes one waiter) or a
//! permit (a connection closed).

use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Body;
use hyper::client::conn::http1::SendRequest;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::checkout::{Checkout, Relayed};
use super::dial::{Dialer, Target};

/// Why a request did not get a response head.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could be made (refused, timed out, TLS handshake failed); nothing was sent.
    #[error("{0}")]
    Connect(String),
    /// Every connection the bound allows stayed in use this long; nothing was sent.
    #[error("no backend connection free within {0:?}")]
    Busy(Duration),
    /// The exchange failed after the request may have been (partly) sent.
    #[error(transparent)]
    Http(#[from] hyper::Error),
    /// A request a closed connection did not take was not sent again: `may_send` said no.
    #[error("the permission to send this request lapsed before it was sent again")]
    Withdrawn,
}

/// How many connections, and how long to wait for one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Connections open at once.
    pub(crate) max_connections: usize,
    /// How long a request waits for a free connection when all are in use.
    pub(crate) pool_timeout: Duration,
    /// An idle connection older than this is not used again.
    pub(crate) idle_timeout: Duration,
    /// How long a connection's kernel may retransmit unacknowledged bytes before it gives the
    /// connection up ([`super::dial::bound_retransmission`]).
    pub(crate) unacked: Duration,
}

/// One backend's connections.
pub(crate) struct Pool<B> {
    dialer: Dialer,
    bounds: Bounds,
    /// One permit per open connection.
    limit: Arc<Semaphore>,
    /// Set once a successor took over: connections given back are closed, not listed.
    retired: AtomicBool,
    /// Told each time a connection is listed, for requests waiting for one.
    listed: Notify,
    /// Requests waiting for a connection.
    waiting: AtomicUsize,
    /// Kept-alive connections ready for a request, most recently listed last.
    idle: Mutex<Vec<Idle<B>>>,
}

/// An idle connection, and since when.
struct Idle<B> {
    sender: SendRequest<B>,
    since: Instant,
}

/// What a waiting request got.
enum Free<B> {
    Idle(SendRequest<B>),
    Permit(OwnedSemaphorePermit),
}

impl<B> std::fmt::Debug for Pool<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("backend", &self.dialer).field("bounds", &self.bounds).finish()
    }
}

impl<B: Send + 'static> Pool<B> {
    /// Takes a connection back from a caller: listed at once if it is ready for another
    /// request, otherwise once it is (its response's end may still be on its way through
    /// hyper); dropped if it closed.
    pub(super) fn give_back(self: &Arc<Self>, mut sender: SendRequest<B>) {
        if sender.is_ready() {
            self.list(sender);
        } else if !sender.is_closed()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let pool = Arc::clone(self);
            runtime.spawn(async move {
                if sender.ready().await.is_ok() {
                    pool.list(sender);
                }
            });
        }
    }

    fn list(&self, sender: SendRequest<B>) {
        let mut idle = self.lock_idle();
        // A retired pool keeps nothing: the connection closes and its permit goes back to the
        // bound its successor shares.
        if self.retired.load(Ordering::Relaxed) {
            return;
        }
        idle.push(Idle { sender, since: Instant::now() });
        drop(idle);
        self.listed.notify_one();
    }

    /// Retires this pool for a successor that shares its bound: its idle connections close
    /// now, and the ones still in use close when their requests end.
    pub(crate) fn retire(&self) {
        let mut idle = self.lock_idle();
        self.retired.store(true, Ordering::Relaxed);
        idle.clear();
    }

    fn lock_idle(&self) -> std::sync::MutexGuard<'_, Vec<Idle<B>>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<B> Pool<B>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// A pool for `target`. With `successor_of`, it shares that pool's bound: connections of
    /// both count against one `max_connections`.
    pub(crate) fn new(
        target: Target,
        connect_timeout: Duration,
        bounds: Bounds,
        successor_of: Option<&Pool<B>>,
    ) -> Arc<Self> {
        let limit = match successor_of {
            Some(old) => Arc::clone(&old.limit),
            None => Arc::new(Semaphore::new(bounds.max_connections)),
        };
        Arc::new(Pool {
            dialer: Dialer::new(target, connect_timeout, bounds.unacked),
            retired: AtomicBool::new(false),
            limit,
            bounds,
            listed: Notify::new(),
            waiting: AtomicUsize::new(0),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// A connection for one request: an idle one, or a new one if the bound has room, waiting
    /// up to `pool_timeout` for either. Nothing is sent yet, so a failure here (`Busy`,
    /// `Connect`) leaves the backend untouched.
    pub(crate) async fn checkout(self: &Arc<Self>) -> Result<Checkout<B>, SendError> {
        if let Some(sender) = self.take_idle() {
            return Ok(Checkout::new(self, sender, true));
        }
        let permit = match Arc::clone(&self.limit).try_acquire_owned() {
            Ok(permit) => permit,
            // Boxed, as the dial below: a full pool is the exception, and the wait's timer and
            // semaphore would otherwise be room in every request's future.
            Err(_) => match Box::pin(self.wait()).await? {
                Free::Idle(sender) => return Ok(Checkout::new(self, sender, true)),
                Free::Permit(permit) => permit,
            },
        };
        // Boxed: a TLS handshake's state is kilobytes, and every request's future would
        // otherwise carry room for it and be copied with it.
        let sender = Box::pin(self.dialer.dial(permit)).await?;
        Ok(Checkout::new(self, sender, false))
    }

    /// Waits for a connection to be listed or a permit to come back, whichever is first.
    async fn wait(&self) -> Result<Free<B>, SendError> {
        let busy = SendError::Busy(self.bounds.pool_timeout);
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        // Made once: the semaphore serves its waiters in order.
        let mut permit = pin!(Arc::clone(&self.limit).acquire_owned());
        let mut timeout = pin!(tokio::time::sleep(self.bounds.pool_timeout));
        loop {
            let mut listed = pin!(self.listed.notified());
            // Enabled before looking: a connection listed after the look wakes this waiter.
            listed.as_mut().enable();
            if let Some(sender) = self.take_idle() {
                return Ok(Free::Idle(sender));
            }
            tokio::select! {
                biased;
                // The semaphore is never closed.
                permit = &mut permit => return permit.map(Free::Permit).map_err(|_| busy),
                () = &mut listed => {}
                () = &mut timeout => return Err(busy),
            }
        }
    }

    /// Sends `req` (origin-form target, `Host` set) on `conn` and returns the response head,
    /// whose body keeps the connection until it ends. A request is sent again, on another
    /// connection, only if a reused connection closed before any of it was written; nothing
    /// that may have reached the backend is ever retried.
    pub(crate) async fn send(
        self: &Arc<Self>,
        mut conn: Checkout<B>,
        mut req: Request<B>,
        may_send: impl Fn() -> bool,
    ) -> Result<Response<Relayed<B>>, SendError> {
        loop {
            let Some(sender) = conn.sender() else {
                return Err(SendError::Connect("the connection was already given back".into()));
            };
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(resp.map(|body| Relayed::new(body, conn))),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if conn.reused => {
                        req = unsent;
                        conn.discard();
                        // Boxed: the exception, whose checkout would otherwise be room in
                        // every request's future.
                        conn = Box::pin(self.checkout()).await?;
                        // The wait for another connection can outlast a permission to send
                        // (the etcd store's lease): a request without a body is sent whole
                        // by its head, which no body chunk's check would follow.
                        if !may_send() {
                            return Err(SendError::Withdrawn);
                        }
                    }
                    _ => {
                        conn.discard();
                        return Err(SendError::Http(e.into_error()));
                    }
                },
            }
        }
    }

    /// The most recently listed connection that is still open and not idle too long; closed
    /// and stale ones met on the way are dropped (the heartbeat's `prune` ages out the rest).
    fn take_idle(&self) -> Option<SendRequest<B>> {
        let mut idle = self.lock_idle();
        let now = Instant::now();
        while let Some(candidate) = idle.pop() {
            if candidate.sender.is_ready() && now.duration_since(candidate.since) < self.bounds.idle_timeout {
                return Some(candidate.sender);
            }
        }
        None
    }

    /// Closes connections the backend closed or that have been idle too long.
    pub(crate) fn prune(&self) {
        let now = Instant::now();
        let timeout = self.bounds.idle_timeout;
        self.lock_idle().retain(|c| !c.sender.is_closed() && now.duration_since(c.since) < timeout);
    }
}

/// Counts a request in `waiting` while it waits.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
