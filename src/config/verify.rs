//! `[verify]` and the rules that ask for it: what a token must prove, the signature header,
//! the clock skew, and the HMAC keys, whose secret files are read here, so that `check`,
//! start-up and every reload read them (a rotated key is honoured after a reload) and refuse
//! one that cannot be used, naming it.

use std::path::PathBuf;
use std::time::Duration;

use http::header::HeaderName;
use serde::Serialize;

use super::raw::RawVerify;
use super::validate::{duration, invalid};
use super::{ConfigError, Rule, ser_display_header, ser_duration};
use crate::fence::signature::{KeyError, Secret, valid_kid};

/// What a token must prove beyond being a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// Nothing: any number is taken (the default).
    None,
    /// A signature by one of `[[verify.hmac_keys]]` in the `verify.signature_header` header.
    Hmac,
    /// The create revision of the current holder of the rule's etcd lock (`lock`).
    Etcd,
}

impl VerifyConfig {
    /// The keys whose files are gone: revoked.
    pub fn revoked_keys(&self) -> impl Iterator<Item = &HmacKey> {
        self.hmac_keys.iter().filter(|k| k.secret.is_none())
    }
}

impl Verify {
    /// The name the config file gives it.
    pub fn name(self) -> &'static str {
        match self {
            Verify::None => "none",
            Verify::Hmac => "hmac",
            Verify::Etcd => "etcd",
        }
    }
}

/// `[verify]`: how signed tokens are checked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VerifyConfig {
    /// The request header that carries a token's signature.
    #[serde(serialize_with = "ser_display_header")]
    pub signature_header: HeaderName,
    /// How long past its expiry a signature is still accepted (clocks disagree).
    #[serde(serialize_with = "ser_duration")]
    pub clock_skew: Duration,
    /// How old the proof that the view of etcd's locks is complete may be before verified
    /// writes are refused (`verify = "etcd"`).
    #[serde(serialize_with = "ser_duration")]
    pub max_lag: Duration,
    /// Refused proofs one client address may have in a row before its verified writes wait
    /// (`429 too_many_refusals`); 0 for no limit.
    pub client_refusal_burst: u32,
    /// The time one of a client's refused proofs takes to be forgiven.
    #[serde(serialize_with = "ser_duration")]
    pub client_refusal_refill: Duration,
    /// The same per fence key, counting every client's refusals.
    pub key_refusal_burst: u32,
    /// The time one of a key's refused proofs takes to be forgiven.
    #[serde(serialize_with = "ser_duration")]
    pub key_refusal_refill: Duration,
    /// The keys signatures may be made with; several may be valid at once.
    pub hmac_keys: Vec<HmacKey>,
}

/// One `[[verify.hmac_keys]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HmacKey {
    /// The id a signature names it by.
    pub id: String,
    /// The file its secret was read from.
    pub secret_file: PathBuf,
    /// The secret (never printed); `None` when the file is gone, which revokes the key:
    /// signatures naming it are refused as if it were unknown.
    #[serde(skip)]
    pub secret: Option<Secret>,
}

/// Validates `[verify]`; `token_header` is `fence.header`, which the signature may not share.
pub(super) fn verify(raw: RawVerify, token_header: &HeaderName) -> Result<VerifyConfig, ConfigError> {
    let signature_header = HeaderName::from_bytes(raw.signature_header.as_bytes()).map_err(|_| {
        invalid("verify.signature_header", format!("{:?} is not a valid header name", raw.signature_header))
    })?;
    if signature_header == *token_header {
        return Err(invalid("verify.signature_header", "must differ from fence.header, which carries the token"));
    }
    let clock_skew = duration("verify.clock_skew", &raw.clock_skew)?;
    let mut hmac_keys: Vec<HmacKey> = Vec::with_capacity(raw.hmac_keys.len());
    for (index, key) in raw.hmac_keys.into_iter().enumerate() {
        let at = |field: &str| format!("verify.hmac_keys[{index}].{field}");
        if !valid_kid(&key.id) {
            return Err(invalid(&at("id"), format!("{:?}: 1 to 64 characters of A-Z, a-z, 0-9, '_' and '-'", key.id)));
        }
        if hmac_keys.iter().any(|k| k.id == key.id) {
            return Err(invalid(&at("id"), format!("{:?} is the id of another key already", key.id)));
        }
        // A deleted file revokes its key, at start-up as on a reload, so that a restart after
        // the revocation still starts. Any other fault refuses the config, and a reload that
        // is refused leaves the key in force: the message says how to revoke it.
        let secret = match Secret::from_file(&key.secret_file) {
            Ok(secret) => Some(secret),
            Err(KeyError::Missing { .. }) => None,
            Err(e) => {
                return Err(invalid(
                    &at("secret_file"),
                    format!(
                        "key {:?} ({}): {e}; a running proxy keeps accepting the key it read before: to revoke \
                        it, delete the file or the [[verify.hmac_keys]] entry and reload",
                        key.id,
                        key.secret_file.display()
                    ),
                ));
            }
        };
        hmac_keys.push(HmacKey { id: key.id, secret_file: key.secret_file, secret });
    }
    let max_lag = duration("verify.max_lag", &raw.max_lag)?;
    Ok(VerifyConfig {
        signature_header,
        clock_skew,
        max_lag,
        client_refusal_burst: raw.client_refusal_burst,
        client_refusal_refill: duration("verify.client_refusal_refill", &raw.client_refusal_refill)?,
        key_refusal_burst: raw.key_refusal_burst,
        key_refusal_refill: duration("verify.key_refusal_refill", &raw.key_refusal_refill)?,
        hmac_keys,
    })
}

/// Refuses a rule that asks for a proof nothing could give.
pub(super) fn rules_can_verify(rules: &[Rule], verify: &VerifyConfig) -> Result<(), ConfigError> {
    for (index, rule) in rules.iter().enumerate() {
        if rule.verify == Some(Verify::Hmac) && verify.hmac_keys.is_empty() {
            return Err(invalid(
                &format!("fence.rules[{index}].verify"),
                "\"hmac\" needs at least one [[verify.hmac_keys]] entry to check signatures with",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, Verify};

    const MINIMAL: &str = "[backend]\nurl = \"http://127.0.0.1:9000\"\n";

    /// A config whose one key `id` has `secret`, in a file of its own.
    fn with_key(dir: &std::path::Path, id: &str, secret: &str, extra: &str) -> String {
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let file = dir.join(format!("{n}.key"));
        std::fs::write(&file, secret).unwrap();
        format!(
            "{MINIMAL}[[fence.rules]]\nprefix = \"/signed/\"\nverify = \"hmac\"\nmax_jump = 1000\n{extra}\
             [[verify.hmac_keys]]\nid = \"{id}\"\nsecret_file = {:?}\n",
            file.display().to_string()
        )
    }

    #[test]
    fn keys_are_read_at_load_and_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let c =
            Config::from_toml_str(&with_key(dir.path(), "2026-12", "a-secret-of-32-bytes-for-tests!!\n", "")).unwrap();
        assert_eq!(c.verify.signature_header.as_str(), "fencing-token-signature");
        assert_eq!(c.verify.clock_skew, std::time::Duration::from_secs(30));
        assert_eq!(
            (c.verify.hmac_keys[0].id.as_str(), c.verify.hmac_keys[0].secret.as_ref().map(|s| s.len())),
            ("2026-12", Some(32))
        );
        assert_eq!((c.fence.rules[0].verify, c.fence.rules[0].max_jump), (Some(Verify::Hmac), Some(1000)));
        let shown = c.to_toml();
        assert!(shown.contains("2026-12") && shown.contains("verify = \"hmac\"") && shown.contains("max_jump = 1000"));
        assert!(!shown.contains("a-secret"), "check must not print a secret: {shown}");
        assert!(!format!("{c:?}").contains("a-secret"), "nor Debug");
        assert_eq!(Config::from_toml_str(&shown).unwrap(), c, "the effective settings load again");
        let defaults = Config::from_toml_str(MINIMAL).unwrap();
        assert!(defaults.verify.hmac_keys.is_empty() && defaults.fence.rules.is_empty());
    }

    #[test]
    fn what_cannot_verify_is_refused_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let good = "a-secret-of-32-bytes-for-tests!!";
        for (text, error) in [
            (with_key(dir.path(), "k1", "short\n", ""), "verify.hmac_keys[0].secret_file: key \"k1\""),
            (with_key(dir.path(), "k1", "\n\n", ""), "the key is empty"),
            (with_key(dir.path(), "k.1", good, ""), "verify.hmac_keys[0].id: \"k.1\""),
            (with_key(dir.path(), "k1", good, "[verify]\nclock_skew = \"soon\"\n"), "verify.clock_skew"),
            (with_key(dir.path(), "k1", good, "[verify]\nsignature_header = \"Fencing-Token\"\n"), "must differ"),
            (with_key(dir.path(), "k1", good, "[verify]\nsecret = \"x\"\n"), "secret"),
            (
                format!(
                    "{}[[verify.hmac_keys]]\nid = \"k1\"\nsecret_file = \"/x\"\n",
                    with_key(dir.path(), "k1", good, "")
                ),
                "verify.hmac_keys[1].id: \"k1\" is the id of another key",
            ),
            (
                format!("{MINIMAL}[[fence.rules]]\nprefix = \"/s/\"\nverify = \"hmac\"\n"),
                "fence.rules[0].verify: \"hmac\" needs",
            ),
            (
                format!("{MINIMAL}[[fence.rules]]\nprefix = \"/s/\"\nverify = \"etcd\"\n"),
                "fence.rules[0].lock: verify = \"etcd\" needs the lock",
            ),
            (format!("{MINIMAL}[[fence.rules]]\nprefix = \"/s/\"\nmax_jump = 0\n"), "fence.rules[0].max_jump"),
            (with_key(dir.path(), "k1", "", ""), "to revoke it, delete the file"),
        ] {
            let err = Config::from_toml_str(&text).map(drop).unwrap_err().to_string();
            assert!(err.contains(error), "{text:?} gave {err}");
        }
    }

    #[test]
    fn a_deleted_key_file_revokes_the_key_and_the_config_still_loads() {
        let dir = tempfile::tempdir().unwrap();
        let text = with_key(dir.path(), "k1", "a-secret-of-32-bytes-for-tests!!", "");
        let file = std::fs::read_dir(dir.path()).unwrap().next().unwrap().unwrap().path();
        std::fs::remove_file(&file).unwrap();
        let c = Config::from_toml_str(&text).unwrap();
        assert!(c.verify.hmac_keys[0].secret.is_none(), "revoked");
        assert_eq!(c.verify.revoked_keys().map(|k| k.id.as_str()).collect::<Vec<_>>(), ["k1"]);
        assert_eq!(c.fence.rules[0].verify, Some(Verify::Hmac), "the rule stands: every signature is refused");
        assert_eq!(Config::from_toml_str(&c.to_toml()).unwrap(), c, "the effective settings load again");
    }

    #[test]
    fn the_refusal_limits_are_read_and_a_zero_refill_is_refused() {
        let c = Config::from_toml_str(MINIMAL).unwrap();
        let v = &c.verify;
        assert_eq!((v.client_refusal_burst, v.client_refusal_refill), (10, std::time::Duration::from_secs(1)));
        assert_eq!((v.key_refusal_burst, v.key_refusal_refill), (100, std::time::Duration::from_millis(100)));
        let text = format!("{MINIMAL}[verify]\nclient_refusal_burst = 0\nkey_refusal_refill = \"2s\"\n");
        let c = Config::from_toml_str(&text).unwrap();
        assert_eq!(
            (c.verify.client_refusal_burst, c.verify.key_refusal_refill),
            (0, std::time::Duration::from_secs(2))
        );
        let err = Config::from_toml_str(&format!("{MINIMAL}[verify]\nclient_refusal_refill = \"0s\"\n")).unwrap_err();
        assert!(err.to_string().contains("verify.client_refusal_refill"), "{err}");
    }

    #[test]
    fn the_environment_reaches_verify_and_an_unknown_key_there_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f.toml");
        std::fs::write(&file, with_key(dir.path(), "k1", "a-secret-of-32-bytes-for-tests!!", "")).unwrap();
        let env = |k: &str, v: &str| Some([(k.to_owned(), v.to_owned())].into_iter().collect());
        let c = Config::load(&file, env("FENCEGATE_VERIFY__CLOCK_SKEW", "5s")).unwrap();
        assert_eq!(c.verify.clock_skew, std::time::Duration::from_secs(5));
        let err = Config::load(&file, env("FENCEGATE_VERIFY__SKEW", "5s")).unwrap_err().to_string();
        assert!(err.contains("FENCEGATE_VERIFY__SKEW"), "{err}");
    }
}
