//! The listeners: the proxy's, and the admin API's on the same code, each serving a [`Handler`]
//! (`app` makes the proxy's, `admin` its own). Each accepts connections
//! (at most its own limit; `limits.max_connections` for the proxy), hands each to
//! [`connection`], and on shutdown stops accepting and drains them within
//! `server.shutdown_grace`.

mod connection;
mod socket;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body, Incoming};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::{Semaphore, mpsc, watch};

use crate::state::State;
use connection::Conn;
pub(crate) use socket::Stream;
pub use socket::{BindError, Listener, Remote};

/// What a listener's connections serve: the proxy, or the admin API.
pub(crate) trait Handler: Clone + Send + Sync + 'static {
    /// What it keeps about a connection's client, made once per connection.
    type Client: Clone + Send + Sync + 'static;
    /// The body of its responses.
    type Body: Body<Data = Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + Unpin + 'static;

    /// Makes it from where the client's connection comes from.
    fn client(&self, remote: Remote) -> Self::Client;

    /// Answers one request; takes its own clones, so that what it returns borrows nothing.
    fn handle(self, req: Request<Incoming>, client: Self::Client) -> impl Future<Output = Response<Self::Body>> + Send;

    /// Whether a request counts as being handled until its response body ends, not only until
    /// its response head is made: for the external processor, whose one response is a stream
    /// that stays open while a write holds its turn, so that the keep-alive watchdog never
    /// closes a connection under an exchange.
    const BUSY_UNTIL_BODY_ENDS: bool = false;

    /// Counts the response body bytes its clients take, if it counts them.
    fn bytes_out(&self) -> Option<&Counter> {
        None
    }
}

/// How a listener differs from another.
pub(crate) struct Listening {
    /// Names it in the log.
    pub(crate) name: &'static str,
    /// Connections served at once; more wait in the kernel's accept queue.
    pub(crate) max_connections: usize,
    /// Whether it terminates TLS when `server.tls` is configured.
    pub(crate) tls: bool,
}

/// Serves `handler` on `listener` until `shutdown` resolves, then stops accepting and lets
/// in-flight requests finish within `server.shutdown_grace`.
pub(crate) async fn serve<H: Handler>(
    handler: H,
    listening: Listening,
    state: Arc<State>,
    mut listener: Listener,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(listening.max_connections));
    let (stop, stopping) = watch::channel(false);
    // Every connection holds a sender; the receiver ends once all are gone.
    let (alive, mut drained) = mpsc::channel::<()>(1);
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
                    renewals: state.settings.renewals(),
                    settings: state.settings.get(),
                    tls: listening.tls,
                    state: Arc::clone(&state),
                    handler: handler.clone(),
                    client,
                    stop: stopping.clone(),
                    _permit: permit,
                    _alive: alive.clone(),
                    _open: connection::Open::new(state.metrics.open_connections(listening.name)),
                };
                match stream {
                    Stream::Tcp(stream) => tokio::spawn(conn.serve(stream)),
                    Stream::Unix(stream) => tokio::spawn(conn.serve(stream)),
                };
            }
            Err(e) => {
                // Typically EMFILE: back off instead of spinning.
                tracing::warn!(listener = listening.name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // Closes the sockets, and removes a Unix socket's file: new clients are refused at once.
    drop(listener);
    let grace = state.settings.get().config.server.shutdown_grace;
    tracing::info!(listener = listening.name, grace = %humantime::format_duration(grace), "shutting down: draining connections");
    let _ = stop.send(true);
    drop(alive);
    if tokio::time::timeout(grace, drained.recv()).await.is_err() {
        tracing::warn!(listener = listening.name, "shutdown grace elapsed with requests still in flight");
    }
}
