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
use crate::fence::verify::{Secret, valid_kid};

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
    /// The secret (never printed).
    #[serde(skip)]
    pub secret: Secret,
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
        let secret = Secret::from_file(&key.secret_file).map_err(|e| {
            invalid(&at("secret_file"), format!("key {:?} ({}): {e}", key.id, key.secret_file.display()))
        })?;
        hmac_keys.push(HmacKey { id: key.id, secret_file: key.secret_file, secret });
    }
    let max_lag = duration("verify.max_lag", &raw.max_lag)?;
    Ok(VerifyConfig { signature_header, clock_skew, max_lag, hmac_keys })
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
        assert_eq!((c.verify.hmac_keys[0].id.as_str(), c.verify.hmac_keys[0].secret.len()), ("2026-12", 32));
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
            (
                format!("{MINIMAL}[[verify.hmac_keys]]\nid = \"k\"\nsecret_file = \"/nonexistent/k\"\n"),
                "/nonexistent/k",
            ),
        ] {
            let err = Config::from_toml_str(&text).map(drop).unwrap_err().to_string();
            assert!(err.contains(error), "{text:?} gave {err}");
        }
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
