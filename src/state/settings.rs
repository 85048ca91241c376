//! The settings in force, and everything built from them: swapped whole on reload (SIGHUP).
//!
//! A request takes one snapshot when it arrives and keeps it to the end, so it never sees half
//! of an old config and half of a new one. A connection keeps the listener settings (TLS,
//! HTTP limits, keep-alive) it was accepted with; connections accepted after a reload get the
//! new ones. What decides a resource's key, or where and how `max_seen` lives, cannot change
//! under a running proxy: a reload reports such changes and leaves them alone.

use std::sync::Arc;

use arc_swap::ArcSwap;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus_client::metrics::counter::Counter;
use tokio_rustls::TlsAcceptor;

use crate::config::{BackendProtocol, Config, VerifyConfig};
use crate::fence::signature::HmacKeys;
use crate::tls;
use crate::upstream::{HeaderPolicy, Upstream};

/// Why settings could not be built from a config.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SettingsError {
    /// The backend settings cannot be used (`backend.url`, `backend.tls`).
    #[error("backend: {0}")]
    Backend(String),
    /// The listener's certificate files cannot be used (`server.tls`).
    #[error("server.tls: {0}")]
    ServerTls(String),
}

/// A config and what is built from it.
pub(crate) struct Settings {
    pub(crate) config: Config,
    pub(crate) upstream: Upstream,
    pub(crate) acceptor: Option<TlsAcceptor>,
    pub(crate) http: auto::Builder<TokioExecutor>,
    /// What signed tokens are checked against, from the secrets this config read.
    pub(crate) hmac: HmacKeys,
}

impl Settings {
    /// Builds the backend client, TLS acceptor and HTTP settings; reads certificate files anew.
    /// The backend client of `previous` is kept, with its pool, if nothing about it changed.
    pub(crate) fn build(config: Config, bytes_in: Counter, previous: Option<&Settings>) -> Result<Self, SettingsError> {
        let (tls, backend) = (config.server.tls.is_some(), &config.backend);
        // An S3 server checks the signatures that may cover forwarded headers.
        let signed = backend.protocol == BackendProtocol::S3;
        let policy = HeaderPolicy::new(&config.headers, tls, &backend.url, signed);
        // A write's bytes the backend has not acknowledged stop travelling within three quarters
        // of the quarantine that covers them once its outcome is unknown: the rest leaves room
        // for the last copy's way and the timers' grain.
        let unacked = config.fence.quarantine * 3 / 4;
        let upstream = match previous {
            Some(p)
                if !reads_files(&config)
                    && p.config.backend == config.backend
                    && p.config.fence.quarantine == config.fence.quarantine =>
            {
                p.upstream.with_policy(policy)
            }
            _ => Upstream::new(&config.backend, policy, bytes_in, previous.map(|p| &p.upstream), unacked)
                .map_err(SettingsError::Backend)?,
        };
        let acceptor = match &config.server.tls {
            Some(t) => Some(TlsAcceptor::from(
                tls::server_config(&t.cert, &t.key, t.client_ca.as_deref()).map_err(SettingsError::ServerTls)?,
            )),
            None => None,
        };
        let limits = &config.limits;
        let mut http = auto::Builder::new(TokioExecutor::new());
        // hyper's own limits sit above ours, so that what we refuse gets our tagged answer.
        http.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size((limits.max_header_bytes * 2).max(8192));
        http.http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.h2_max_concurrent_streams)
            // HTTP/2 counts 32 bytes of overhead per header field (RFC 9113 §6.5.2).
            .max_header_list_size(u32::try_from(limits.max_header_bytes * 2 + 32 * 100).unwrap_or(u32::MAX));
        let hmac = hmac_keys(&config.verify);
        Ok(Settings { config, upstream, acceptor, http, hmac })
    }
}

/// The keys signatures are checked against. A revoked key (its file gone) is left out: its
/// signatures name an unknown key.
pub(crate) fn hmac_keys(config: &VerifyConfig) -> HmacKeys {
    let keys = config.hmac_keys.iter().filter_map(|k| Some((k.id.as_str(), k.secret.as_ref()?)));
    HmacKeys::new(keys, config.clock_skew)
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings").field("config", &self.config).field("tls", &self.acceptor.is_some()).finish()
    }
}

/// Whether the backend client reads certificate files, which a reload must read again.
fn reads_files(config: &Config) -> bool {
    config.backend.url.is_https()
}

/// The settings in force: readers take the current `Arc` without a lock, a reload swaps it.
#[derive(Debug)]
pub(crate) struct SettingsSlot {
    current: ArcSwap<Settings>,
    /// Bumped when connections accepted earlier should close; each connection watches it.
    renew: tokio::sync::watch::Sender<u64>,
    /// Reloads run one at a time.
    reloading: std::sync::Mutex<()>,
}

impl SettingsSlot {
    pub(crate) fn new(settings: Settings) -> Self {
        SettingsSlot {
            current: ArcSwap::from_pointee(settings),
            renew: tokio::sync::watch::Sender::new(0),
            reloading: std::sync::Mutex::new(()),
        }
    }

    /// The settings in force now.
    pub(crate) fn get(&self) -> Arc<Settings> {
        self.current.load_full()
    }

    /// Holds off other reloads while alive.
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        // A poisoned lock only means a reload panicked; the settings it guards are whole.
        self.reloading.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts `settings` in force; with `renew`, connections accepted before are asked to close.
    pub(crate) fn set(&self, settings: Settings, renew: bool) {
        self.current.store(Arc::new(settings));
        if renew {
            self.renew.send_modify(|generation| *generation += 1);
        }
    }

    /// Fires when connections accepted before now should close.
    pub(crate) fn renewals(&self) -> tokio::sync::watch::Receiver<u64> {
        self.renew.subscribe()
    }
}
