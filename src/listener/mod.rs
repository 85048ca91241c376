//! The listener: accepts connections (at most `limits.max_connections`), hands each to
//! [`connection`], and on shutdown stops accepting and drains them within
//! `server.shutdown_grace`.

mod connection;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, watch};

use crate::app::State;
use connection::Conn;

/// Serves `listener` until `shutdown` resolves, then stops accepting and lets in-flight
/// requests finish within `server.shutdown_grace`.
pub(crate) async fn serve(state: Arc<State>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    let settings = state.settings.get();
    let config = &settings.config;
    let permits = Arc::new(Semaphore::new(config.limits.max_connections));
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
                    renewals: state.settings.renewals(),
                    settings: state.settings.get(),
                    state: Arc::clone(&state),
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
    let grace = state.settings.get().config.server.shutdown_grace;
    tracing::info!(?grace, "shutting down: draining connections");
    let _ = stop.send(true);
    drop(alive);
    if tokio::time::timeout(grace, drained.recv()).await.is_err() {
        tracing::warn!("shutdown grace elapsed with requests still in flight");
    }
}
