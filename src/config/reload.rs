//! What a reload changes: the differences between the running config and a new one, split
//! into what a running proxy applies and what needs a restart.

use std::collections::BTreeMap;

use super::Config;

/// A setting a reload cannot apply, and how to keep its running value in a new config.
type Keep = fn(&mut Config, &Config);

/// Settings a reload cannot apply: they decide keys, storage or sockets already bound. Each
/// entry is a dotted key or a whole section (`store`), with what puts the running value back.
pub const RESTART_ONLY: [(&str, Keep); 16] = [
    ("server.listen", |new, old| new.server.listen = old.server.listen.clone()),
    ("server.listen_mode", |new, old| new.server.listen_mode = old.server.listen_mode),
    ("server.workers", |new, old| new.server.workers = old.server.workers),
    ("server.mode", |new, old| new.server.mode = old.server.mode),
    ("admin.listen", |new, old| new.admin.listen = old.admin.listen.clone()),
    ("admin.listen_mode", |new, old| new.admin.listen_mode = old.admin.listen_mode),
    ("store", |new, old| new.store = old.store.clone()),
    ("paths", |new, old| new.paths = old.paths.clone()),
    ("fence.scopes", |new, old| new.fence.scopes = old.fence.scopes.clone()),
    ("log.format", |new, old| new.log.format = old.log.format),
    ("log.buffer_lines", |new, old| new.log.buffer_lines = old.log.buffer_lines),
    ("limits.max_connections", |new, old| new.limits.max_connections = old.limits.max_connections),
    ("backend.max_connections", |new, old| new.backend.max_connections = old.backend.max_connections),
    ("backend.protocol", |new, old| new.backend.protocol = old.backend.protocol),
    ("etcd", |new, old| new.etcd = old.etcd.clone()),
    ("verify.max_lag", |new, old| new.verify.max_lag = old.verify.max_lag),
];

/// What a reload did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reload {
    /// Changed settings now in force, as `key: old -> new`.
    pub applied: Vec<String>,
    /// Changed settings that need a restart, left as they were, as `key: old -> new`.
    pub kept: Vec<String>,
    /// Whether connections accepted before the reload are asked to close (after the request
    /// they are serving), because their listener settings (TLS, limits) changed.
    pub renew_connections: bool,
}

/// Splits the differences between `old` and `new` into what a reload applies and what it
/// keeps, and returns the config to run with: `new`, with every restart-only setting of `old`.
pub(crate) fn merge(old: &Config, new: Config) -> (Config, Reload) {
    let (before, after) = (flatten(old), flatten(&new));
    let mut report = Reload::default();
    let keys: std::collections::BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    for key in keys {
        let (was, now) = (before.get(key), after.get(key));
        if was == now {
            continue;
        }
        let show = |v: Option<&String>| v.map_or_else(|| "(unset)".to_owned(), Clone::clone);
        let line = format!("{key}: {} -> {}", show(was), show(now));
        if restart_only(key) { report.kept.push(line) } else { report.applied.push(line) }
    }
    // Never printed, so compared apart from the rest.
    if old.admin.token != new.admin.token {
        report.applied.push("admin.token: (changed)".to_owned());
    }
    if old.admin.read_token != new.admin.read_token {
        report.applied.push("admin.read_token: (changed)".to_owned());
    }
    // Secrets, likewise: read again from their files, a rotated one under the same id counts.
    for key in &new.verify.hmac_keys {
        let before = old.verify.hmac_keys.iter().find(|k| k.id == key.id);
        match (before.map(|k| k.secret.is_some()), key.secret.is_some()) {
            (Some(true), false) => report.applied.push(format!(
                "verify.hmac_keys: key {:?} revoked: its secret file {} is gone",
                key.id,
                key.secret_file.display()
            )),
            (None, false) => report.applied.push(format!(
                "verify.hmac_keys: key {:?} is not in force: its secret file {} does not exist",
                key.id,
                key.secret_file.display()
            )),
            (Some(false), true) => report.applied.push(format!("verify.hmac_keys: key {:?} restored", key.id)),
            (Some(true), true) if before.is_some_and(|k| k.secret != key.secret) => {
                report.applied.push(format!("verify.hmac_keys: the secret of key {:?} changed", key.id))
            }
            _ => {}
        }
    }
    let s3_secret = |c: &Config| c.s3.credentials.as_ref().map(|k| k.secret_access_key.clone());
    if s3_secret(old) != s3_secret(&new) {
        report.applied.push("s3.credentials.secret_access_key: (changed)".to_owned());
    }
    if old.etcd.password != new.etcd.password {
        report.kept.push("etcd.password: (changed)".to_owned());
    }
    // Certificate files are read again even when their paths are the same: rotation in place.
    if new.server.tls.is_some() && !report.applied.iter().any(|l| l.starts_with("server.tls.")) {
        report.applied.push("server.tls: certificate files read again".to_owned());
    }
    if new.backend.url.is_https() && !report.applied.iter().any(|l| l.starts_with("backend.")) {
        report.applied.push("backend.tls: certificate files read again (new connection pool)".to_owned());
    }
    report.renew_connections = report
        .applied
        .iter()
        .any(|l| ["server.", "limits."].iter().any(|p| l.starts_with(p)) && !l.starts_with("server.shutdown_grace"));
    let mut merged = new;
    for (_, keep) in RESTART_ONLY {
        keep(&mut merged, old);
    }
    (merged, report)
}

fn restart_only(key: &str) -> bool {
    RESTART_ONLY.iter().any(|(r, _)| key == *r || key.strip_prefix(r).is_some_and(|rest| rest.starts_with('.')))
}

/// Dotted key → value, as `fencegate check` names them. Lists (methods, scopes) stay whole
/// under their key. JSON rather than TOML: TOML has no integers above `i64::MAX`.
fn flatten(config: &Config) -> BTreeMap<String, String> {
    fn walk(prefix: &str, value: &serde_json::Value, out: &mut BTreeMap<String, String>) {
        match value {
            serde_json::Value::Object(table) => {
                for (k, v) in table {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_owned(), other.to_string());
            }
        }
    }
    let mut out = BTreeMap::new();
    match serde_json::to_value(config) {
        Ok(value) => walk("", &value, &mut out),
        Err(e) => tracing::warn!(error = %e, "cannot list the settings to compare them"),
    }
    out
}

/// Logs a reload: one line per change, so each can be found and audited on its own.
pub(crate) fn log(report: &Reload) {
    for change in &report.applied {
        tracing::info!(%change, "reload: applied");
    }
    for change in &report.kept {
        tracing::warn!(%change, "reload: needs a restart; the running value is kept");
    }
    tracing::info!(
        applied = report.applied.len(),
        kept = report.kept.len(),
        renew_connections = report.renew_connections,
        "configuration reloaded"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        Config::from_toml_str(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"http://127.0.0.1:9\"\n[store]\ndir = \"/tmp/x\"\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn reload_applies_policy_and_keeps_what_decides_keys_or_storage() {
        let old = config("[fence]\nequal_token = \"reject\"\n");
        let new = config(
            "[fence]\nequal_token = \"accept\"\nqueue_timeout = \"1s\"\n[[fence.scopes]]\nprefix = \"/t\"\nsegments = 1\n\
             [paths]\ncase_sensitive = false\n[limits]\nmax_connections = 7\nmax_body_bytes = 10\n",
        );
        let (merged, report) = merge(&old, new.clone());
        let keys = |lines: &[String]| lines.iter().map(|l| l.split(':').next().unwrap().to_owned()).collect::<Vec<_>>();
        assert_eq!(keys(&report.applied), ["fence.equal_token", "fence.queue_timeout", "limits.max_body_bytes"]);
        assert_eq!(keys(&report.kept), ["fence.scopes", "limits.max_connections", "paths.case_sensitive"]);
        assert_eq!(merged.fence.equal_token, new.fence.equal_token);
        assert_eq!(merged.limits.max_body_bytes, 10);
        assert_eq!(merged.limits.max_connections, old.limits.max_connections);
        assert_eq!(merged.paths.case_sensitive, old.paths.case_sensitive);
        assert!(merged.fence.scopes.is_empty());
        assert!(report.applied[0].contains("\"reject\" -> \"accept\""), "{:?}", report.applied);
    }

    #[test]
    fn an_unchanged_config_reports_nothing_and_a_new_token_is_named_not_shown() {
        let old = config("");
        assert_eq!(merge(&old, old.clone()).1, Reload::default());
        let mut new = old.clone();
        new.limits.max_body_bytes = u64::MAX; // beyond TOML's integers
        let report = merge(&old, new).1;
        assert_eq!(report.applied, [format!("limits.max_body_bytes: 0 -> {}", u64::MAX)]);
        assert!(report.renew_connections && report.kept.is_empty());
        let mut new = old.clone();
        new.admin.token = Some("a-new-secret-of-enough-length".into());
        let report = merge(&old, new).1;
        assert_eq!(report.applied, ["admin.token: (changed)"]);
    }

    #[test]
    fn every_restart_only_setting_keeps_its_value() {
        let old = config("");
        let new = config(
            "[log]\nformat = \"json\"\nbuffer_lines = 9\n[admin]\nlisten = \"127.0.0.1:7\"\n[[fence.scopes]]\nprefix = \"/t\"\n\
             [paths]\nmerge_slashes = false\ncase_sensitive = false\n[limits]\nmax_connections = 7\n",
        );
        let mut new = new;
        new.backend.max_connections = 3;
        new.server.listen = "127.0.0.1:1".parse().unwrap();
        new.server.workers = 3;
        (new.server.listen_mode, new.admin.listen_mode) = (0o600, 0o600);
        new.store.dir = "/tmp/elsewhere".into();
        new.store.segment_bytes += 4096;
        let (merged, report) = merge(&old, new);
        let (before, after) = (flatten(&old), flatten(&merged));
        let kept: Vec<&String> = after.keys().filter(|k| restart_only(k)).collect();
        assert!(kept.len() >= RESTART_ONLY.len(), "{kept:?}");
        for key in kept {
            assert_eq!(before.get(key), after.get(key), "{key} changed under a running proxy");
        }
        assert_eq!(report.kept.len(), 14, "{:?}", report.kept);
    }

    #[test]
    fn restart_only_matches_whole_keys_and_sections() {
        assert!(restart_only("store.dir") && restart_only("store") && restart_only("server.listen"));
        assert!(!restart_only("server.listener") && !restart_only("storex.a") && !restart_only("fence.header"));
    }
}
