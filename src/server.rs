//! The listener: accepts connections, serves HTTP/1.1 and HTTP/2 on them, drains on shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::config::{Config, MissingToken};
use crate::error::Error;
use crate::fence::FenceTable;
use crate::handler::{self, Shared};
use crate::path;
use crate::proxy::Forwarder;
use crate::store::{FileStore, StoreOptions};

/// An opened proxy: store recovered and locked, ready to serve.
#[derive(Debug, Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

impl Proxy {
    /// Locks the data directory, recovers `max_seen` from disk and prepares the backend client.
    pub async fn open(config: Config) -> Result<Self, Error> {
        let options = StoreOptions {
            sync: config.store.sync,
            segment_bytes: config.store.segment_bytes,
            max_resources: config.store.max_resources,
            keying: path::keying(&config.fence.scopes),
        };
        if config.fence.missing_token == MissingToken::Forward {
            tracing::warn!(
                "fence.missing_token = \"forward\": writes without a token pass unchecked, so a zombie \
                that omits the header is not fenced; use this only while clients migrate"
            );
        }
        let store = FileStore::open(&config.store.dir, options)?;
        let table = Arc::new(FenceTable::new(Arc::clone(store.table()), config.fence.equal_token));
        // The backend may still apply writes the previous process had in flight.
        for (key, token) in store.in_flight_at_start() {
            tracing::warn!(resource = %key, token, quarantine = ?config.fence.quarantine,
                "a write was in flight when fencegate stopped: resource quarantined");
            table.quarantine(key, config.fence.quarantine);
        }
        let forwarder = Forwarder::new(&config.backend);
        let shared = Shared { config, table, store: Arc::new(store), forwarder };
        Ok(Proxy { shared: Arc::new(shared) })
    }

    /// The highest token the resource `key` has accepted (keys are canonical paths).
    pub fn max_seen(&self, key: &str) -> Option<u64> {
        self.shared.table.max_seen(key)
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// Serves `listener` until `shutdown` resolves, then stops accepting, lets in-flight
    /// requests finish within `server.shutdown_grace`, and closes the store.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let config = &self.shared.config;
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).header_read_timeout(config.server.header_read_timeout);
        builder.http2().timer(TokioTimer::new());
        let graceful = GracefulShutdown::new();
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, backend = %config.backend.url, "fencegate listening");
        }
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, client)) => {
                        let _ = stream.set_nodelay(true);
                        let shared = Arc::clone(&self.shared);
                        let service = service_fn(move |req| {
                            let shared = Arc::clone(&shared);
                            async move { Ok::<_, Infallible>(handler::handle(shared, req, client).await) }
                        });
                        let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                        let conn = graceful.watch(conn);
                        tokio::spawn(async move {
                            if let Err(e) = conn.await {
                                tracing::debug!(%client, error = %e, "connection ended with an error");
                            }
                        });
                    }
                    Err(e) => {
                        // Typically EMFILE: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
        drop(listener);
        tracing::info!(grace = ?config.server.shutdown_grace, "shutting down: draining connections");
        if tokio::time::timeout(config.server.shutdown_grace, graceful.shutdown()).await.is_err() {
            tracing::warn!("shutdown grace elapsed with requests still in flight");
        }
        self.shared.store.close().await?;
        tracing::info!("fence store closed");
        Ok(())
    }
}

/// Opens the proxy for `config` and serves `listener` until `shutdown` resolves.
pub async fn run(listener: TcpListener, config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    Proxy::open(config).await?.serve(listener, shutdown).await
}
