//! What the listeners, every request and the admin API share, below all of them: the settings
//! in force and what is built from them ([`settings`]), the fence and its store, the metrics
//! ([`metrics`]), the refusal log's throttle, the limits on guessed tokens, the views of
//! etcd's locks, and a follower's client to the leader. `app` makes one [`State`] per proxy.

pub(crate) mod metrics;
mod process;
pub(crate) mod settings;

use std::sync::Arc;

use crate::etcd_client::Mirrors;
use crate::fence::{Fence, Guesses};
use crate::refusal::throttle::RefusalThrottle;
use crate::store::Store;
use crate::upstream::leader::Peers;
pub(crate) use metrics::Metrics;
pub(crate) use settings::{Settings, SettingsError, SettingsSlot};

/// What the listener, every request and the admin API share.
#[derive(Debug)]
pub(crate) struct State {
    /// The settings in force; a request reads them once, when it arrives.
    pub(crate) settings: SettingsSlot,
    pub(crate) fence: Arc<Fence>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) refusals: RefusalThrottle,
    /// Refused proofs per client and per key, which slow down guessed tokens.
    pub(crate) guesses: Guesses,
    pub(crate) metrics: Arc<Metrics>,
    /// The mirrors of etcd's locks that verified rules check tokens against: apart from the
    /// settings, which listeners and connections hold on to, so that a reload that drops a
    /// rule stops its watch.
    pub(crate) locks: arc_swap::ArcSwap<Mirrors>,
    /// With the etcd store: the client a follower sends fenced writes to the leader with.
    pub(crate) peers: Option<Peers>,
    /// The runtime that serves requests, which `/livez` hands a task to; `None` when the
    /// proxy was opened outside a tokio runtime.
    pub(crate) serving: Option<tokio::runtime::Handle>,
}
