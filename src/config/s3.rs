//! `[s3]`: how S3 requests name buckets and objects, which operations are pinned
//! (docs/pins.md), and the credentials fencegate signs its own `HEAD`s with, whose secret is
//! read here from `secret_access_key_file` (never written in the config), so that `check` and
//! start-up refuse one that cannot be read.

use std::path::PathBuf;

use serde::Serialize;

use super::raw::{RawS3, RawS3Credentials};
use super::validate::invalid;
use super::{BackendProtocol, ConfigError};

/// `[s3]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct S3Config {
    /// Host name suffixes under which a request's host names its bucket (virtual-host style):
    /// with `s3.example.com`, `b1.s3.example.com` is bucket `b1`. Lower case, no leading dot.
    pub virtual_host_suffixes: Vec<String>,
    /// Whether the server keeps keys as flat strings, as S3 does (`a//b` and `a/b` are two
    /// objects); `false` for a server that stores objects as files and resolves a key's empty,
    /// `.` and `..` segments as a path, whose keys with such segments are refused.
    pub flat_keys: bool,
    /// Most multipart uploads whose binding fencegate keeps at once (docs/s3.md).
    pub max_uploads: usize,
    /// Whether the server honours `If-Match` on DeleteObject, so that a DeleteObject is pinned
    /// (AWS and moto do; s3s-fs deletes all the same).
    pub conditional_deletes: bool,
    /// What fencegate signs the `HEAD` that learns an object's state with; unset, a pinned
    /// write to an object whose state is unknown goes unpinned, and its answer pins it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credentials: Option<S3Credentials>,
}

/// `s3.max_uploads` by default.
pub const DEFAULT_MAX_UPLOADS: usize = 10_000;

/// `s3.credentials.region` by default.
pub const DEFAULT_REGION: &str = "us-east-1";

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            virtual_host_suffixes: Vec::new(),
            flat_keys: true,
            max_uploads: DEFAULT_MAX_UPLOADS,
            conditional_deletes: false,
            credentials: None,
        }
    }
}

/// `[s3.credentials]`: an access key of the S3 server, for AWS Signature V4.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct S3Credentials {
    /// The access key id.
    pub access_key_id: String,
    /// The file the secret access key was read from.
    pub secret_access_key_file: PathBuf,
    /// The secret access key (never printed).
    #[serde(skip)]
    pub secret_access_key: SecretKey,
    /// The region the signature is scoped to.
    pub region: String,
}

/// A secret access key, which `Debug` does not show.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretKey(String);

impl SecretKey {
    /// Wraps `secret`.
    pub fn new(secret: impl Into<String>) -> SecretKey {
        SecretKey(secret.into())
    }

    /// The key itself, to sign with.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

/// Validates `[s3]`, refusing what S3 mode alone takes under another protocol, and reads the
/// secret access key's file.
pub(super) fn s3(raw: RawS3, protocol: BackendProtocol) -> Result<S3Config, ConfigError> {
    let key = "s3.virtual_host_suffixes";
    if protocol != BackendProtocol::S3 {
        let defaults = S3Config::default();
        let only = |key: &str, what: &str| Err(invalid(key, format!("only backend.protocol = \"s3\" {what}")));
        if !raw.virtual_host_suffixes.is_empty() {
            return only(key, "names buckets by host");
        }
        if !raw.flat_keys {
            return only("s3.flat_keys", "names objects by key");
        }
        if raw.max_uploads != defaults.max_uploads {
            return only("s3.max_uploads", "has multipart uploads");
        }
        if raw.conditional_deletes {
            return only("s3.conditional_deletes", "has DeleteObject");
        }
        if raw.credentials.is_some() {
            return only("s3.credentials", "signs its HEADs");
        }
        return Ok(defaults);
    }
    if raw.max_uploads == 0 {
        return Err(invalid("s3.max_uploads", "must be at least 1: with 0 no multipart upload could start"));
    }
    let mut suffixes = Vec::with_capacity(raw.virtual_host_suffixes.len());
    for suffix in raw.virtual_host_suffixes {
        let lower = suffix.trim_start_matches('.').trim_end_matches('.').to_ascii_lowercase();
        let ok = !lower.is_empty()
            && lower.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
        if !ok {
            return Err(invalid(key, format!("{suffix:?} is not a host name")));
        }
        suffixes.push(lower);
    }
    Ok(S3Config {
        virtual_host_suffixes: suffixes,
        flat_keys: raw.flat_keys,
        max_uploads: raw.max_uploads,
        conditional_deletes: raw.conditional_deletes,
        credentials: raw.credentials.map(credentials).transpose()?,
    })
}

/// `[s3.credentials]`, its secret read from its file (trimmed, as `echo` leaves a newline).
fn credentials(raw: RawS3Credentials) -> Result<S3Credentials, ConfigError> {
    // What a signature's `Credential=` may hold: its parts are split at `/`, the header at `,`.
    let plain =
        |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_graphic() && !matches!(b, b'/' | b',' | b'='));
    if !plain(&raw.access_key_id) {
        return Err(invalid(
            "s3.credentials.access_key_id",
            "must be printable ASCII without spaces, '/', ',' or '=', as it is written into each signature",
        ));
    }
    if !plain(&raw.region) {
        return Err(invalid("s3.credentials.region", format!("{:?} is not a region name", raw.region)));
    }
    let file_key = "s3.credentials.secret_access_key_file";
    let file = &raw.secret_access_key_file;
    let text = std::fs::read_to_string(file).map_err(|e| invalid(file_key, format!("{}: {e}", file.display())))?;
    let secret = text.trim();
    if secret.is_empty() {
        return Err(invalid(file_key, format!("{} is empty", file.display())));
    }
    Ok(S3Credentials {
        access_key_id: raw.access_key_id,
        secret_access_key_file: raw.secret_access_key_file,
        secret_access_key: SecretKey::new(secret),
        region: raw.region,
    })
}
