//! Tokens verified against etcd's locks (`verify = "etcd"` in a `[[fence.rules]]` entry): a
//! write is accepted only if its token is the create revision of the current holder of the
//! lock that guards each key it may change, as fencegate's [`Mirror`] of the locks shows them.
//! Such a token still has to pass the `max_seen` check, and a token equal to `max_seen` passes
//! it, since only the verified holder can present its own revision.
//!
//! The mirrors answer without a request to etcd; they refuse to answer, and verified writes
//! get `503 verify_unavailable`, while their proof of freshness is older than
//! `verify.max_lag` (docs/tokens.md says what window remains).

use crate::config::{Config, FenceConfig, Rule, Verify};
use crate::etcd_client::{Client, MirrorOptions, Mirrors};
use crate::fence::Touch;
use crate::fence::lock_names::LockError;

/// The verification setting of `key`: that of the longest rule over it that sets one.
fn rule_of<'a>(key: &str, rules: &'a [Rule]) -> Option<&'a Rule> {
    Rule::verifying(rules, key).filter(|r| r.verify == Some(Verify::Etcd))
}

/// The locks whose holder a write of `touches` must be, one per key; empty if the write is not
/// verified against etcd. Its keys are all under one `verify` setting: `rules::govern` has
/// refused the write otherwise.
pub fn lock_names(touches: &[Touch], fence: &FenceConfig) -> Result<Vec<String>, LockError> {
    if !fence.rules.iter().any(|r| r.lock.is_some()) {
        return Ok(Vec::new());
    }
    let verified = touches.iter().filter_map(|t| Some((t, rule_of(&t.key, &fence.rules)?.lock.as_ref()?)));
    verified
        .map(|(touch, template)| {
            template
                .name(&touch.key)
                .ok_or_else(|| LockError::NoLockName { key: touch.key.clone(), template: template.as_str().into() })
        })
        .collect()
}

/// The mirrors of etcd's locks that the rules in force verify against, one per template's
/// literal prefix, started on the current runtime; those `previous` has are kept (`[etcd]` and
/// `verify.max_lag` need a restart, so a mirror kept is still right).
pub(crate) fn mirrors(config: &Config, previous: Option<&Mirrors>) -> Result<Mirrors, String> {
    let templates = config.fence.rules.iter().filter_map(|r| r.lock.as_ref());
    let mut prefixes: Vec<Vec<u8>> = templates.map(|t| t.literal_prefix().into_bytes()).collect();
    prefixes.sort();
    prefixes.dedup();
    if prefixes.is_empty() {
        return Ok(Mirrors::default());
    }
    if config.etcd.endpoints.is_empty() {
        return Err(
            "rules verify tokens against etcd, and [etcd] endpoints names no member (it needs a restart)".into()
        );
    }
    let client = Client::from_options(&config.etcd.client_options()).map_err(|e| e.to_string())?;
    let options = MirrorOptions { max_lag: config.verify.max_lag, instance: instance() };
    Ok(Mirrors::build(&client, &prefixes, &options, previous))
}

/// Whether `token` is the holder's of every lock in `names`.
pub fn check(mirrors: &Mirrors, names: &[String], token: u64) -> Result<(), LockError> {
    for name in names {
        let holder = mirrors
            .holder(name.as_bytes())
            .map_err(|f| LockError::Unavailable { lock: name.clone(), reason: f.to_string() })?;
        if holder.and_then(|h| u64::try_from(h).ok()) != Some(token) {
            return Err(LockError::NotHolder { lock: name.clone(), token, holder });
        }
    }
    Ok(())
}

/// Names this process's heartbeat keys: its pid and start time.
fn instance() -> String {
    static INSTANCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    INSTANCE
        .get_or_init(|| {
            let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            format!("{}-{}", std::process::id(), started.as_nanos())
        })
        .clone()
}
