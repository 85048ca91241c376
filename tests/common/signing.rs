//! Signed tokens for the tests: key files in a temporary directory, rules and `[verify]` put
//! into a harness's config (loaded from TOML, so the secret files are read as `run` reads
//! them), and signatures made with the library's `sign`.

use std::path::PathBuf;

use fencegate::Config;
use fencegate::fence::signature::{self, Secret};

use super::{Harness, Resp};

/// The default signature header.
pub const SIGNATURE: &str = "fencing-token-signature";

/// A directory of key files, removed when dropped.
pub struct KeyFiles {
    pub dir: tempfile::TempDir,
}

impl KeyFiles {
    pub fn new() -> KeyFiles {
        KeyFiles { dir: tempfile::tempdir().unwrap() }
    }

    /// (Re)writes the key file of `id` with `secret` and a trailing newline, as `echo` would.
    pub fn write(&self, id: &str, secret: &str) -> PathBuf {
        let path = self.path(id);
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        path
    }

    pub fn path(&self, id: &str) -> PathBuf {
        self.dir.path().join(format!("{id}.key"))
    }

    /// `[[verify.hmac_keys]]` entries for `ids`, whose files must have been written.
    pub fn toml(&self, ids: &[&str]) -> String {
        ids.iter()
            .map(|id| {
                format!(
                    "[[verify.hmac_keys]]\nid = \"{id}\"\nsecret_file = {:?}\n",
                    self.path(id).display().to_string()
                )
            })
            .collect()
    }
}

/// `config` with the `[[fence.rules]]` and `[verify]` of `toml` (which may set only those),
/// loaded as a file would be: secret files are read now.
pub fn with_rules(config: &Config, toml: &str) -> Config {
    let parsed = Config::from_toml_str(&format!("[backend]\nurl = \"http://127.0.0.1:9\"\n{toml}"))
        .unwrap_or_else(|e| panic!("test config: {e}\n{toml}"));
    let mut config = config.clone();
    config.fence.rules = parsed.fence.rules;
    config.verify = parsed.verify;
    config
}

/// The UNIX time now, in seconds.
pub fn now() -> u64 {
    signature::unix_now()
}

/// The signature header value for `token` in `domain` with the key `kid` whose secret is
/// `secret`, valid until `expiry`.
pub fn sign(secret: &str, kid: &str, domain: &str, token: u64, expiry: u64) -> String {
    signature::sign(&Secret::new(secret.as_bytes().to_vec()).unwrap(), kid, domain, token, expiry).unwrap()
}

impl Harness {
    /// A fenced PUT of `token` with `signature` in the default signature header.
    pub async fn signed_put(&self, path: &str, token: u64, signature: &str) -> Resp {
        let token = token.to_string();
        self.send("PUT", path, &[("fencing-token", &token), (SIGNATURE, signature)], token.clone()).await
    }
}
