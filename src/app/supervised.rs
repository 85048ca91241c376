//! What fencegate tells the service manager that started it, and when ([`super::notify`] is
//! how): `READY=1` once every listener is bound and the store is open; `RELOADING=1` with
//! `MONOTONIC_USEC=` when a reload starts and `READY=1` when it is over, applied or refused;
//! `STOPPING=1` when the drain starts; `STATUS=` with each, for `systemctl status`; and
//! `WATCHDOG=1` every half of `$WATCHDOG_USEC` from a task on the runtime that serves
//! requests, so that pings stop when the serving loop is wedged and the manager restarts it.
//! Without `$NOTIFY_SOCKET` every call does nothing.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::notify::{self, Notifier, NotifyError};

/// The service manager, as far as fencegate talks to it.
#[derive(Debug, Clone, Default)]
pub struct Supervisor {
    notifier: Option<Arc<Notifier>>,
    /// Between two watchdog pings.
    watchdog: Option<Duration>,
    /// What `STATUS=` says while serving, set once the proxy is ready.
    serving: Arc<OnceLock<String>>,
}

impl Supervisor {
    /// The service manager that `$NOTIFY_SOCKET` and `$WATCHDOG_USEC` name, or none.
    pub fn from_environment() -> Result<Supervisor, NotifyError> {
        let Some(notifier) = Notifier::from_env()? else { return Ok(Supervisor::default()) };
        let watchdog = notify::watchdog_interval()?;
        tracing::info!(socket = notifier.name(), watchdog = ?watchdog, "notifying the service manager");
        Ok(Supervisor { notifier: Some(Arc::new(notifier)), watchdog, serving: Arc::default() })
    }

    /// Every listener is bound and the store is open; `status` says where it serves.
    pub(crate) fn ready(&self, status: String) {
        self.send(&format!("READY=1\nSTATUS={status}"));
        let _ = self.serving.set(status);
    }

    /// A reload starts: the manager waits for the `READY=1` that [`Reloading`] sends when it
    /// is dropped.
    pub fn reloading(&self) -> Reloading {
        let now = notify::monotonic_usec();
        self.send(&format!("RELOADING=1\nMONOTONIC_USEC={now}\nSTATUS=reloading the configuration"));
        Reloading { supervisor: self.clone(), outcome: "reload finished" }
    }

    /// The drain starts.
    pub(crate) fn stopping(&self, grace: Duration) {
        self.send(&format!("STOPPING=1\nSTATUS=draining: in-flight requests get up to {grace:?}"));
    }

    /// The watchdog's pings, to run on the runtime that serves requests; `None` without a
    /// watchdog.
    pub(crate) fn watchdog(&self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let (notifier, every) = (self.notifier.clone()?, self.watchdog?);
        Some(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = notifier.send("WATCHDOG=1") {
                    tracing::warn!(error = %e, socket = notifier.name(), "cannot ping the service manager's watchdog");
                }
            }
        })
    }

    fn send(&self, message: &str) {
        let Some(notifier) = &self.notifier else { return };
        if let Err(e) = notifier.send(message) {
            tracing::warn!(error = %e, socket = notifier.name(), message, "cannot notify the service manager");
        }
    }
}

/// A reload under way, as [`Supervisor::reloading`] announced it: dropping it tells the
/// manager that the proxy serves again.
#[derive(Debug)]
pub struct Reloading {
    supervisor: Supervisor,
    outcome: &'static str,
}

impl Reloading {
    /// Says whether the reload was applied, in the status sent when it ends.
    pub fn finished(mut self, applied: bool) {
        self.outcome = if applied { "configuration reloaded" } else { "reload refused, configuration unchanged" };
    }
}

impl Drop for Reloading {
    fn drop(&mut self) {
        let serving = self.supervisor.serving.get().map_or("serving", String::as_str);
        self.supervisor.send(&format!("READY=1\nSTATUS={serving}; {}", self.outcome));
    }
}
