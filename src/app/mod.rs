//! The running application: opens the store, starts the listener and the admin API, applies
//! reloads, and drains on shutdown.

mod bind;
mod check;
mod cluster;
mod envoy_check;
mod inspection;
pub mod notify;
mod processing;
mod proxying;
pub mod supervised;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::admin;
use crate::config::ConfigError;
use crate::config::reload::{self, Reload};
use crate::config::{Config, MissingToken};
use crate::config::{ServerMode, StoreKind};
use crate::fence::Fence;
pub use crate::listener::{BindError, Listener};
use crate::refusal::throttle::RefusalThrottle;
use crate::request::rules;
use crate::state::{Metrics, Settings, SettingsError, SettingsSlot, State};
use crate::store::{self, Adopted, FileStore, Store, StoreError, StoreOptions};
use crate::upstream::leader::Peers;
pub use bind::bind;
pub use check::check;
pub use cluster::{RulesReport, init_etcd, migrate_to_etcd, rules_etcd};
pub use envoy_check::{EnvoyCheck, check_envoy};
pub use inspection::inspection_report;
pub use supervised::{Reloading, Supervisor};

/// Why the proxy could not start, apply a reload, or close its store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The store could not be opened, recovered or closed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The backend settings cannot be used (`backend.url`, `backend.tls`).
    #[error("backend: {0}")]
    Backend(String),
    /// The listener's certificate files cannot be used (`server.tls`).
    #[error("server.tls: {0}")]
    ServerTls(String),
    /// A listener could not be bound.
    #[error("cannot listen on {addr} ({setting}): {message}")]
    Listen {
        /// The setting that names the address.
        setting: &'static str,
        /// The address, as the setting writes it.
        addr: String,
        /// The OS error.
        message: String,
    },
    /// Settings that cannot work together (two listeners on one address).
    #[error("{0}")]
    Conflict(String),
    /// An Envoy bootstrap (`check --envoy`) cannot be read.
    #[error("the Envoy configuration {0}")]
    Envoy(String),
    /// Other I/O outside the store failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Whether the data directory's file system is read-only: restarting cannot help until an
    /// operator repairs it (the binary exits with its own status for it).
    pub fn read_only(&self) -> bool {
        matches!(self, Error::Store(StoreError::ReadOnly { .. }))
    }
}

impl From<SettingsError> for Error {
    fn from(e: SettingsError) -> Self {
        match e {
            SettingsError::Backend(why) => Error::Backend(why),
            SettingsError::ServerTls(why) => Error::ServerTls(why),
        }
    }
}

/// An opened proxy: store recovered and locked, ready to serve.
#[derive(Debug, Clone)]
pub struct Proxy {
    state: Arc<State>,
    supervisor: Supervisor,
}

impl Proxy {
    /// Locks the data directory, recovers `max_seen` from disk and prepares the backend client.
    /// Serve it on the runtime that opened it (the backend connections belong to it). A data
    /// directory that is missing or holds no state is refused: [`init_data_dir`] makes one.
    pub async fn open(config: Config) -> Result<Self, Error> {
        let metrics = Arc::new(Metrics::default());
        let observed = Arc::clone(&metrics);
        let options = StoreOptions {
            sync: config.store.sync,
            segment_bytes: config.store.segment_bytes,
            max_resources: config.store.max_resources,
            max_table_bytes: config.store.max_table_bytes,
            keying: String::new(),
            on_commit: Some(Arc::new(move |took, advances| observed.commit(took, advances))),
            writer_scheduling: config.store.writer_scheduling,
        };
        if config.fence.missing_token == MissingToken::Forward {
            warn_forwarding_tokenless();
        }
        for key in config.verify.revoked_keys() {
            tracing::warn!(id = %key.id, file = %key.secret_file.display(),
                "verify.hmac_keys: this key is revoked (its secret file does not exist); signatures naming it are refused");
        }
        let keying = crate::request::protocol::keying(&config);
        let quarantine = config.fence.quarantine;
        let domains = rules::domains(&config.fence.rules);
        let fence = match (&config.store.kind, &config.store.etcd) {
            (StoreKind::Etcd, Some(settings)) => {
                cluster::open(&config, settings, keying, options.on_commit, domains, quarantine).await?
            }
            _ => {
                let options = StoreOptions { keying, ..options };
                tracing::info!(dir = %config.store.dir.display(), "opening the fence store");
                // A missing or empty directory may be a lost one: only `fencegate init` starts one.
                store::check_initialised(&config.store.dir)?;
                let store = FileStore::open(&config.store.dir, options)?;
                let in_flight = store.in_flight_at_start().to_vec();
                let floors_in_flight = store.floors_in_flight_at_start().to_vec();
                let store: Arc<dyn Store> = Arc::new(store);
                let fence = Arc::new(Fence::with_domains(store, domains));
                // The backend may still apply writes the previous process had in flight.
                fence.adopt(&Adopted { in_flight, floors_in_flight, marks: 0 }, quarantine);
                fence
            }
        };
        let store = Arc::clone(fence.store());
        let peers = match &config.store.etcd {
            Some(e) => {
                // A leader whose listener asks clients for a certificate (they share the config)
                // is shown this instance's own.
                let tls = config.server.tls.as_ref().filter(|t| t.client_ca.is_some());
                let identity = tls.map(|t| (t.cert.as_path(), t.key.as_path()));
                Some(
                    Peers::new(&e.advertise, config.backend.connect_timeout, e.peer_ca.as_deref(), identity)
                        .map_err(Error::Conflict)?,
                )
            }
            None => None,
        };
        let refusals = RefusalThrottle::new();
        let locks =
            arc_swap::ArcSwap::from_pointee(crate::request::holders::mirrors(&config, None).map_err(Error::Conflict)?);
        let settings = SettingsSlot::new(Settings::build(config, metrics.bytes_in.clone(), None)?);
        let guesses = crate::fence::Guesses::default();
        // The runtime that opens the proxy serves it: /livez hands it a task.
        let serving = tokio::runtime::Handle::try_current().ok();
        let state = State { settings, fence, store, refusals, guesses, metrics, locks, peers, serving };
        Ok(Proxy { state: Arc::new(state), supervisor: Supervisor::default() })
    }

    /// Tells `supervisor`, the service manager, when the proxy is ready, reloads and stops
    /// ([`supervised`]).
    pub fn supervised(mut self, supervisor: Supervisor) -> Self {
        self.supervisor = supervisor;
        self
    }

    /// Tells the service manager that a reload starts; dropping what it returns says that it
    /// is over. Without a service manager it does nothing.
    pub fn reloading(&self) -> Reloading {
        self.supervisor.reloading()
    }

    /// Applies `config` as far as a running proxy can: fence policy, timeouts, limits, log
    /// level, backend and TLS certificates (read anew even if their paths did not change).
    /// Settings in [`reload::RESTART_ONLY`] keep their running values and are reported. If anything
    /// fails to build, nothing changes.
    pub fn reload(&self, config: Config) -> Result<Reload, Error> {
        let result = self.apply(config);
        self.state.metrics.reload(result.is_ok());
        result
    }

    /// Counts a reload refused before it reached [`Proxy::reload`]: a config file that could not
    /// be read or is invalid.
    pub fn reload_rejected(&self) {
        self.state.metrics.reload(false);
    }

    fn apply(&self, config: Config) -> Result<Reload, Error> {
        let _one_at_a_time = self.state.settings.lock();
        let current = self.state.settings.get();
        let (config, report) = reload::merge(&current.config, config);
        // A shared fence's instances decide writes alike: this one's rules are the fence's
        // recorded ones (checked when it started and whenever it takes the lead).
        if config.store.kind == StoreKind::Etcd {
            let (running, configured) = (current.config.fence_record(), config.fence_record());
            let differences = crate::store::etcd::differences(("running", &running), ("configured", &configured));
            if !differences.is_empty() {
                return Err(Error::Conflict(format!(
                    "reload refused: the fence's instances share its rules, and this config decides writes otherwise \
                    ({}). To change them: stop every instance on the prefix, run `fencegate rules --config FILE --set`, \
                    and start them all with the new config",
                    differences.join("; ")
                )));
            }
        }
        // `[etcd]` needs a restart: a rule that verifies against etcd added by a reload to a
        // proxy started without endpoints is refused here, not started without a cluster.
        let locks =
            crate::request::holders::mirrors(&config, Some(&self.state.locks.load())).map_err(Error::Conflict)?;
        let next = Settings::build(config, self.state.metrics.bytes_in.clone(), Some(&current))?;
        let (old, new) = (&current.config.fence, &next.config.fence);
        let unfenced: Vec<&str> =
            new.unfenced_methods.iter().filter(|m| !old.unfenced_methods.contains(m)).map(|m| m.as_str()).collect();
        if !unfenced.is_empty() {
            tracing::warn!(methods = %unfenced.join(","), "reload: these methods are no longer fenced; their writes pass unchecked");
        }
        if new.missing_token == MissingToken::Forward
            && (old.missing_token != MissingToken::Forward || old.header != new.header)
        {
            warn_forwarding_tokenless();
        }
        let (old_level, new_level) = (current.config.log.level.clone(), next.config.log.level.clone());
        let domains = rules::domains(&next.config.fence.rules);
        self.state.settings.set(next, report.renew_connections);
        self.state.locks.store(Arc::new(locks));
        if self.state.fence.set_domains(domains) {
            tracing::info!("reload: token domains changed; counting each domain's highest token for max_jump");
        }
        current.upstream.retire_for(&self.state.settings.get().upstream);
        crate::logging::change_level(&old_level, &new_level, || reload::log(&report));
        Ok(report)
    }

    /// The highest token the resource `key` has accepted (keys are canonical paths).
    pub fn max_seen(&self, key: &str) -> Option<u64> {
        self.state.fence.max_seen(key)
    }

    /// The highest token accepted in the token domain `domain`, the bound `max_jump` measures
    /// from for keys without a `max_seen`; `None` for a domain without tokens, or while a
    /// reload's count of it runs.
    pub fn domain_max(&self, domain: &str) -> Option<u64> {
        self.state.fence.domain_max(domain)
    }

    /// Number of writes holding or waiting for the turn of the resource `key`.
    pub fn queue_len(&self, key: &str) -> usize {
        self.state.fence.queue_len(key)
    }

    /// Serves the admin API on `listener` until `shutdown` resolves, on a thread and runtime of
    /// its own: liveness probes and scrapes are answered even while the proxy's threads are
    /// saturated or blocked. [`AdminThread::stopped`] waits for it to finish.
    pub fn serve_admin(
        &self,
        listener: impl Into<Listener>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<AdminThread, Error> {
        let listener = listener.into().detach()?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let state = Arc::clone(&self.state);
        let (done, stopped) = tokio::sync::oneshot::channel();
        std::thread::Builder::new().name("fencegate-admin".into()).spawn(move || {
            runtime.block_on(async move {
                match listener.attach() {
                    Ok(listener) => admin::serve(state, listener, shutdown).await,
                    Err(e) => tracing::error!(error = %e, "cannot serve the admin API"),
                }
            });
            let _ = done.send(());
        })?;
        Ok(AdminThread { stopped })
    }

    /// The configuration in force.
    pub fn config(&self) -> Config {
        self.state.settings.get().config.clone()
    }

    /// Serves `listener` until `shutdown` resolves, then stops accepting, lets in-flight
    /// requests finish within `server.shutdown_grace`, and closes the store.
    pub async fn serve(self, listener: impl Into<Listener>, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let heartbeat = tokio::spawn(heartbeat(Arc::clone(&self.state)));
        // On this runtime, so that a wedged serving loop stops the pings.
        let watchdog = self.supervisor.watchdog().map(tokio::spawn);
        let mode = self.state.settings.get().config.server.mode;
        match mode {
            ServerMode::Proxy => proxying::serve(Arc::clone(&self.state), listener.into(), shutdown).await,
            ServerMode::ExtProc => processing::serve(Arc::clone(&self.state), listener.into(), shutdown).await,
        }
        heartbeat.abort();
        if let Some(watchdog) = watchdog {
            watchdog.abort();
        }
        self.state.store.close().await?;
        tracing::info!("fence store closed");
        Ok(())
    }
}

/// The admin API's thread, as [`Proxy::serve_admin`] started it.
#[derive(Debug)]
pub struct AdminThread {
    stopped: tokio::sync::oneshot::Receiver<()>,
}

impl AdminThread {
    /// Resolves once the admin API has stopped (its shutdown came and its requests drained).
    pub async fn stopped(self) {
        let _ = self.stopped.await;
    }
}

/// Once a second: closes stale idle backend connections, and keeps the timer wheel's next
/// deadline within a second. Every request sets timers (header read, backend response) seconds
/// away; when one is earlier than the wheel's next deadline, tokio wakes its own driver with an
/// `eventfd` write, one system call per request for nothing. With this tick that happens only
/// for timeouts configured under a second.
async fn heartbeat(state: Arc<State>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        state.settings.get().upstream.prune();
    }
}

/// The fence tree's root: a floor there is part of the level of every key (`fence::tree`).
const ROOT: &str = "/";

/// Makes `dir` a data directory for [`Proxy::open`] (`fencegate init`). With `floor` above 0,
/// every resource starts at `max_seen = floor`: a floor at the root covers every key, written
/// or not, so only writes with a token above `floor` pass. Use 0 for a new deployment, and
/// after losing a data directory the lock service's current token (or above). Refuses a
/// directory that already holds state.
pub fn init_data_dir(dir: &std::path::Path, floor: u64) -> Result<(), Error> {
    Ok(store::init(dir, &[(ROOT, floor)])?)
}

/// Opens the proxy for `config` and serves `listener` (and the admin API, if configured)
/// until `shutdown` resolves.
pub async fn run(
    listener: impl Into<Listener>,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    Proxy::open(config).await?.run(listener, shutdown).await
}

impl Proxy {
    /// Serves `listener`, and the admin API if `admin.listen` is set, until `shutdown` resolves.
    pub async fn run(self, listener: impl Into<Listener>, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let (stop, stopped) = watch::channel(false);
        let listener = listener.into();
        let mut serving = format!("serving on {}", listener.describe());
        let admin = self.state.settings.get().config.admin.clone();
        let admin = match &admin.listen {
            Some(addr) => {
                let admin_listener = bind("admin.listen", addr, admin.listen_mode).await?;
                serving.push_str(&format!(", admin API on {}", admin_listener.describe()));
                let mut stopped = stopped.clone();
                let until = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                Some(self.serve_admin(admin_listener, until)?)
            }
            None => None,
        };
        self.supervisor.ready(serving);
        let (supervisor, state) = (self.supervisor.clone(), Arc::clone(&self.state));
        let result = self
            .serve(listener, async move {
                shutdown.await;
                supervisor.stopping(state.settings.get().config.server.shutdown_grace);
                let _ = stop.send(true);
            })
            .await;
        if let Some(admin) = admin {
            admin.stopped().await;
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
