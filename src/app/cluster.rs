//! The etcd store from the configuration: opening it for a proxy, and `fencegate init` and
//! `fencegate migrate` for a prefix (docs/cluster.md).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::Error;
use crate::config::{Config, EtcdStoreConfig, StoreKind};
use crate::etcd_client::Client;
use crate::fence::{Domains, Fence};
use crate::store::{CommitHook, EtcdOptions, EtcdStore, Migrated, Store, etcd};

/// The client of the configuration's etcd cluster, with its TLS and credentials.
fn client(config: &Config) -> Result<Client, Error> {
    Client::from_options(&config.etcd.client_options()).map_err(|e| Error::Conflict(format!("etcd: {e}")))
}

/// The etcd store's settings, or why `config` has none.
fn settings(config: &Config) -> Result<&EtcdStoreConfig, Error> {
    match (&config.store.kind, &config.store.etcd) {
        (StoreKind::Etcd, Some(settings)) => Ok(settings),
        _ => Err(Error::Conflict("the config's store is not in etcd (store.kind = \"etcd\")".into())),
    }
}

/// Opens the etcd store and the fence over it, and starts campaigning: each takeover's writes
/// in flight are quarantined for `quarantine` before this instance leads.
pub(super) async fn open(
    config: &Config,
    settings: &EtcdStoreConfig,
    keying: String,
    on_commit: Option<CommitHook>,
    domains: Domains,
    quarantine: Duration,
) -> Result<Arc<Fence>, Error> {
    let options = EtcdOptions {
        prefix: settings.prefix.clone(),
        advertise: settings.advertise.clone(),
        lease_ttl: settings.lease_ttl,
        lease_margin: settings.lease_margin,
        max_resources: config.store.max_resources,
        max_table_bytes: config.store.max_table_bytes,
        keying,
        rules: config.fence_record(),
        max_txn_ops: settings.max_txn_ops,
        batches_in_flight: settings.batches_in_flight,
        on_commit,
    };
    tracing::info!(prefix = %options.prefix, endpoints = %config.etcd.endpoints.join(","), advertise = %options.advertise,
        "opening the fence store in etcd");
    let store = Arc::new(EtcdStore::open(client(config)?, options).await?);
    let fence = Arc::new(Fence::with_domains(Arc::clone(&store) as Arc<dyn Store>, domains));
    let adopting = Arc::downgrade(&fence);
    store.start(Arc::new(move |adopted| {
        if let Some(fence) = adopting.upgrade() {
            fence.adopt(adopted, quarantine);
        }
    }));
    Ok(fence)
}

/// `fencegate init` for the etcd store of `config`: starts its prefix, with every resource at
/// `floor` (none for 0). Refuses a prefix that holds a fence, or one an instance leads.
pub async fn init_etcd(config: &Config, floor: u64) -> Result<(), Error> {
    let settings = settings(config)?;
    let keying = crate::request::protocol::keying(config);
    Ok(etcd::init(&client(config)?, &settings.prefix, &keying, &config.fence_record(), floor).await?)
}

/// `fencegate migrate`: copies the `max_seen` of the data directory `from` into the etcd store
/// of `config`, never lowering a key, while no instance runs on the prefix.
pub async fn migrate_to_etcd(config: &Config, from: &Path) -> Result<Migrated, Error> {
    let settings = settings(config)?;
    let keying = crate::request::protocol::keying(config);
    Ok(etcd::migrate(&client(config)?, &settings.prefix, &keying, &config.fence_record(), from).await?)
}

/// `fencegate rules`: the fence's rules as etcd records them, and what `config` would decide
/// otherwise, one setting a line; with `set`, `config`'s rules recorded in their place, while
/// no instance leads the prefix.
pub async fn rules_etcd(config: &Config, set: bool) -> Result<RulesReport, Error> {
    let settings = settings(config)?;
    let configured = etcd::stored_rules(&config.fence_record());
    let recorded = etcd::rules(&client(config)?, &settings.prefix, &configured, set).await?;
    let differences = match recorded.as_deref().map(|recorded| etcd::agreement(recorded, &configured)) {
        Some(etcd::Agreement::Differ(differences)) => differences,
        // An earlier build's record is shared: this build's instances take (and complete) it.
        Some(etcd::Agreement::Same | etcd::Agreement::LacksLayout) | None => Vec::new(),
    };
    Ok(RulesReport { recorded, differences, set })
}

/// What `fencegate rules` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesReport {
    /// The fence's rules before the command; `None` where none are recorded yet (the first
    /// instance to start records its own).
    pub recorded: Option<String>,
    /// Each setting the config decides otherwise, `name: recorded X, configured Y`.
    pub differences: Vec<String>,
    /// Whether the config's rules were recorded.
    pub set: bool,
}
