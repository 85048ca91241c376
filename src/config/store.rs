//! `[store]` validated: the settings of the kind of store chosen (a data directory, or the
//! fence shared through etcd), and none of the other kind's.

use std::time::Duration;

use super::raw;
use super::validate::{choice, duration, invalid};
use super::{ConfigError, EtcdStoreConfig, StoreConfig, StoreKind, SyncMode, WriterScheduling};

/// The least `store.max_table_bytes`: 1 MiB.
const MIN_TABLE_BYTES: u64 = 1 << 20;
/// `[store]`: the settings of the kind chosen, and none of the other's.
pub(super) fn store(raw: raw::RawStore) -> Result<StoreConfig, ConfigError> {
    let kind = choice("store.kind", &raw.kind, [("file", StoreKind::File), ("etcd", StoreKind::Etcd)])?;
    let file_keys = [
        ("store.dir", raw.dir.is_some()),
        ("store.sync", raw.sync.is_some()),
        ("store.segment_bytes", raw.segment_bytes.is_some()),
        ("store.stall_after", raw.stall_after.is_some()),
        ("store.writer_scheduling", raw.writer_scheduling.is_some()),
    ];
    let etcd_keys = [
        ("store.prefix", raw.prefix.is_some()),
        ("store.advertise", raw.advertise.is_some()),
        ("store.lease_ttl", raw.lease_ttl.is_some()),
        ("store.lease_margin", raw.lease_margin.is_some()),
        ("store.max_txn_ops", raw.max_txn_ops.is_some()),
        ("store.batches_in_flight", raw.batches_in_flight.is_some()),
    ];
    let (other, why): (&[(&str, bool)], _) = match kind {
        StoreKind::File => (&etcd_keys, "an etcd store's setting: only with store.kind = \"etcd\""),
        StoreKind::Etcd => (&file_keys, "a file store's setting: with store.kind = \"etcd\" the fence is kept in etcd"),
    };
    if let Some((key, _)) = other.iter().find(|(_, set)| *set) {
        return Err(invalid(key, why));
    }
    let dir = raw.dir.unwrap_or_else(|| "data".into());
    if dir.as_os_str().is_empty() {
        return Err(invalid("store.dir", "must not be empty"));
    }
    let sync_text = raw.sync.unwrap_or_else(|| "always".into());
    let sync = choice("store.sync", &sync_text, [("always", SyncMode::Always), ("never", SyncMode::Never)])?;
    let segment_bytes = raw.segment_bytes.unwrap_or(64 << 20);
    if segment_bytes < 4096 {
        return Err(invalid("store.segment_bytes", "must be at least 4096"));
    }
    if raw.max_resources == 0 {
        return Err(invalid("store.max_resources", "must be at least 1"));
    }
    if raw.max_table_bytes < MIN_TABLE_BYTES {
        return Err(invalid("store.max_table_bytes", format!("must be at least {MIN_TABLE_BYTES} (1 MiB)")));
    }
    let stall_after = duration("store.stall_after", raw.stall_after.as_deref().unwrap_or("2s"))?;
    let scheduling_text = raw.writer_scheduling.unwrap_or_else(|| "batch".into());
    let writer_scheduling = choice(
        "store.writer_scheduling",
        &scheduling_text,
        [("batch", WriterScheduling::Batch), ("normal", WriterScheduling::Normal)],
    )?;
    let etcd = match kind {
        StoreKind::File => None,
        StoreKind::Etcd => {
            let mut settings = etcd_store(raw.prefix, raw.advertise, raw.lease_ttl, raw.lease_margin)?;
            settings.peer_ca = raw.peer_ca;
            settings.max_txn_ops = match raw.max_txn_ops.unwrap_or(crate::store::etcd::DEFAULT_MAX_TXN_OPS) {
                n @ 8..=1_000_000 => n,
                n => {
                    return Err(invalid(
                        "store.max_txn_ops",
                        format!("{n}: between 8 and 1000000, as etcd's --max-txn-ops"),
                    ));
                }
            };
            settings.batches_in_flight =
                match raw.batches_in_flight.unwrap_or(crate::store::etcd::DEFAULT_BATCHES_IN_FLIGHT) {
                    n @ 1..=64 => n,
                    n => return Err(invalid("store.batches_in_flight", format!("{n}: between 1 and 64"))),
                };
            Some(settings)
        }
    };
    Ok(StoreConfig {
        kind,
        dir,
        sync,
        segment_bytes,
        max_resources: raw.max_resources,
        max_table_bytes: raw.max_table_bytes,
        stall_after,
        writer_scheduling,
        etcd,
    })
}

/// The etcd store's settings: a prefix, the URL peers forward to, and a lease etcd can grant.
fn etcd_store(
    prefix: Option<String>,
    advertise: Option<String>,
    ttl: Option<String>,
    margin: Option<String>,
) -> Result<EtcdStoreConfig, ConfigError> {
    let prefix = prefix.unwrap_or_else(|| "/fencegate/".into());
    if prefix == "/" {
        return Err(invalid("store.prefix", "\"/\" is the whole key space: give the fence a prefix of its own"));
    }
    if !prefix.ends_with('/') {
        return Err(invalid(
            "store.prefix",
            format!("{prefix:?}: must end with \"/\", so that no other application's keys start with it"),
        ));
    }
    let Some(advertise) = advertise else {
        return Err(invalid(
            "store.advertise",
            "store.kind = \"etcd\" needs the URL the other instances forward fenced writes to while this one \
            leads, e.g. \"http://10.0.0.5:8080\"",
        ));
    };
    match advertise.parse::<http::Uri>() {
        Ok(uri)
            if matches!(uri.scheme_str(), Some("http" | "https"))
                && uri.authority().is_some()
                && uri.path_and_query().is_none_or(|p| p.as_str() == "/") => {}
        _ => {
            return Err(invalid(
                "store.advertise",
                format!(
                    "{advertise:?}: expected http://HOST:PORT or https://HOST:PORT, with no path (forwarded writes \
                    keep their own)"
                ),
            ));
        }
    }
    let lease_ttl = duration("store.lease_ttl", ttl.as_deref().unwrap_or("5s"))?;
    if lease_ttl < Duration::from_secs(2) || lease_ttl.subsec_nanos() != 0 {
        return Err(invalid(
            "store.lease_ttl",
            "must be whole seconds, at least 2s (etcd grants leases in seconds, 2 s at least)",
        ));
    }
    let lease_margin = duration("store.lease_margin", margin.as_deref().unwrap_or("1s"))?;
    if lease_margin * 2 > lease_ttl {
        return Err(invalid("store.lease_margin", "must be at most half of store.lease_ttl"));
    }
    let advertise = advertise.trim_end_matches('/').to_owned();
    Ok(EtcdStoreConfig {
        prefix,
        advertise,
        peer_ca: None,
        lease_ttl,
        lease_margin,
        max_txn_ops: crate::store::etcd::DEFAULT_MAX_TXN_OPS,
        batches_in_flight: crate::store::etcd::DEFAULT_BATCHES_IN_FLIGHT,
    })
}
