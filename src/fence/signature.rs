//! Signed tokens: a lock service (or a signer beside it) proves that it handed out a token, so a
//! client cannot make up a large one.
//!
//! A signature is one header value, `v1.<kid>.<expiry>.<mac>`: the id of the key that signed
//! it, the UNIX time (seconds) after which it is no longer accepted, and HMAC-SHA256 with that
//! key over exactly the ASCII bytes `v1\n<kid>\n<token domain>\n<token>\n<expiry>` (numbers in
//! decimal without leading zeros), in unpadded base64url. It binds the token, its domain and
//! the expiry, not the path: whoever holds a valid signature for a token may use it on any key
//! of the domain. The grammar is as narrow as the token's: anything else is refused, never
//! repaired. Secrets are never printed ([`Secret`]'s `Debug` shows only their length).

use std::fmt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;

/// The version every signature starts with.
pub const VERSION: &str = "v1";
/// Fewest bytes a key may have.
pub const MIN_KEY_BYTES: usize = 16;
/// Most bytes read from a key file: a path to a device or a large file by mistake is refused
/// rather than read for ever.
pub const MAX_KEY_BYTES: usize = 4096;
/// Longest key id.
pub const MAX_KID_LEN: usize = 64;
/// Bytes of an HMAC-SHA256 tag.
const MAC_BYTES: usize = 32;

/// Why a key or its id cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key file does not exist: deleting it revokes the key.
    #[error("{path} does not exist")]
    Missing {
        /// The file.
        path: String,
    },
    /// The key file cannot be read.
    #[error("cannot read {path}: {message}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        message: String,
    },
    /// No bytes are left once trailing whitespace is removed.
    #[error("the key is empty")]
    Empty,
    /// Fewer than [`MIN_KEY_BYTES`] bytes.
    #[error("the key has {0} bytes; a key needs at least {MIN_KEY_BYTES}")]
    TooShort(usize),
    /// More than [`MAX_KEY_BYTES`] bytes.
    #[error("the key file holds more than {MAX_KEY_BYTES} bytes; is it the right file?")]
    TooLong,
    /// The id is not 1 to 64 of `A-Z a-z 0-9 _ -`.
    #[error("key id {0:?} must be 1 to {MAX_KID_LEN} characters of A-Z, a-z, 0-9, '_' and '-'")]
    InvalidId(String),
}

/// A key's secret bytes. Compared for config equality; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// A secret of exactly `bytes`, refused if shorter than [`MIN_KEY_BYTES`] (or longer than
    /// [`MAX_KEY_BYTES`]).
    pub fn new(bytes: Vec<u8>) -> Result<Secret, KeyError> {
        match bytes.len() {
            0 => Err(KeyError::Empty),
            n if n < MIN_KEY_BYTES => Err(KeyError::TooShort(n)),
            n if n > MAX_KEY_BYTES => Err(KeyError::TooLong),
            _ => Ok(Secret(bytes)),
        }
    }

    /// Reads a key file: the key is the file's bytes with trailing ASCII whitespace (space, tab,
    /// CR, LF, form feed) removed, so that `echo`'s newline is not part of it. Nothing else is
    /// decoded: a file holding base64 text has that text's bytes as its key.
    pub fn from_file(path: &Path) -> Result<Secret, KeyError> {
        use std::io::Read;
        let read = |e: std::io::Error| KeyError::Read { path: path.display().to_string(), message: e.to_string() };
        let mut bytes = Vec::new();
        let file = std::fs::File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => KeyError::Missing { path: path.display().to_string() },
            _ => read(e),
        })?;
        file.take(MAX_KEY_BYTES as u64 + 1).read_to_end(&mut bytes).map_err(read)?;
        if bytes.len() > MAX_KEY_BYTES {
            return Err(KeyError::TooLong);
        }
        while bytes.last().is_some_and(u8::is_ascii_whitespace) {
            bytes.pop();
        }
        Secret::new(bytes)
    }

    /// How many bytes the key has.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never true: an empty secret is refused.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Whether `kid` is a key id: 1 to 64 characters of `A-Z a-z 0-9 _ -` (no `.`, which separates
/// the signature's parts, and no `\n`, which separates the signed fields).
pub fn valid_kid(kid: &str) -> bool {
    (1..=MAX_KID_LEN).contains(&kid.len()) && kid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Why a signature header was refused before any key was tried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// The header appears more than once.
    #[error("the signature header appears more than once; send exactly one")]
    Repeated,
    /// Not `v1.<kid>.<expiry>.<mac>`.
    #[error("expected v1.<kid>.<expiry>.<mac>")]
    Shape,
    /// Another version than `v1`.
    #[error("unknown signature version {0:?}; this fencegate reads v1")]
    Version(String),
    /// The key id breaks the id grammar.
    #[error("the key id must be 1 to {MAX_KID_LEN} characters of A-Z, a-z, 0-9, '_' and '-'")]
    Kid,
    /// The expiry is not decimal digits without leading zeros that fit in 64 bits.
    #[error("the expiry must be a UNIX time in seconds: decimal digits, no leading zeros")]
    Expiry,
    /// The MAC is not unpadded base64url of 32 bytes.
    #[error("the MAC must be 32 bytes in unpadded base64url (43 characters)")]
    Mac,
}

/// Why a well-formed signature was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// No key with this id is configured (now).
    #[error("no key {kid:?} is configured")]
    UnknownKey {
        /// The key id the signature names.
        kid: String,
    },
    /// The MAC does not match.
    #[error(
        "the MAC does not match under key {kid:?}: signed with another secret, or for another token, token domain or expiry"
    )]
    WrongMac {
        /// The key id the signature names.
        kid: String,
    },
    /// The signature expired longer ago than the allowed clock skew.
    #[error("the signature expired at {expiry}; it is now {now}, beyond the allowed clock skew of {skew}s")]
    Expired {
        /// The key id the signature names.
        kid: String,
        /// Its expiry, UNIX seconds.
        expiry: u64,
        /// The time of the check, UNIX seconds.
        now: u64,
        /// The allowed clock skew, in seconds.
        skew: u64,
    },
}

impl Rejected {
    /// A stable name of the reason, for the refusal's body.
    pub fn reason(&self) -> &'static str {
        match self {
            Rejected::UnknownKey { .. } => "unknown_key",
            Rejected::WrongMac { .. } => "wrong_mac",
            Rejected::Expired { .. } => "expired",
        }
    }

    /// The key id the signature names.
    pub fn kid(&self) -> &str {
        match self {
            Rejected::UnknownKey { kid } | Rejected::WrongMac { kid } | Rejected::Expired { kid, .. } => kid,
        }
    }
}

/// A parsed signature header, not yet checked against any key.
#[derive(Clone, PartialEq, Eq)]
pub struct Signature {
    kid: Box<str>,
    expiry: u64,
    mac: [u8; MAC_BYTES],
}

impl fmt::Debug for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signature").field("kid", &self.kid).field("expiry", &self.expiry).finish_non_exhaustive()
    }
}

impl Signature {
    /// Parses the one value of a signature header.
    pub fn parse(value: &[u8]) -> Result<Signature, SignatureError> {
        let text = std::str::from_utf8(value).map_err(|_| SignatureError::Shape)?;
        let mut parts = text.split('.');
        let (Some(version), Some(kid), Some(expiry), Some(mac), None) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(SignatureError::Shape);
        };
        if version != VERSION {
            return Err(SignatureError::Version(version.chars().take(16).collect()));
        }
        if !valid_kid(kid) {
            return Err(SignatureError::Kid);
        }
        let expiry = canonical_decimal(expiry).ok_or(SignatureError::Expiry)?;
        let mut tag = [0u8; MAC_BYTES];
        // A 43-character value decodes to exactly 32 bytes; the engine refuses non-canonical
        // trailing bits, so one MAC has one spelling.
        if mac.len() != 43 || URL_SAFE_NO_PAD.decode_slice(mac, &mut tag) != Ok(MAC_BYTES) {
            return Err(SignatureError::Mac);
        }
        Ok(Signature { kid: kid.into(), expiry, mac: tag })
    }

    /// The id of the key it names.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// Its expiry, UNIX seconds.
    pub fn expiry(&self) -> u64 {
        self.expiry
    }
}

/// Decimal digits without leading zeros (`0` itself allowed) that fit in a u64.
fn canonical_decimal(text: &str) -> Option<u64> {
    if text.is_empty() || (text.len() > 1 && text.starts_with('0')) || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Exactly the bytes a signature's MAC covers.
pub fn message(kid: &str, domain: &str, token: u64, expiry: u64) -> Vec<u8> {
    format!("{VERSION}\n{kid}\n{domain}\n{token}\n{expiry}").into_bytes()
}

/// The signature header value for `token` in `domain`, valid until `expiry` (UNIX seconds),
/// made with `key` under the id `kid`.
pub fn sign(key: &Secret, kid: &str, domain: &str, token: u64, expiry: u64) -> Result<String, KeyError> {
    if !valid_kid(kid) {
        return Err(KeyError::InvalidId(kid.to_owned()));
    }
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, &key.0), &message(kid, domain, token, expiry));
    Ok(format!("{VERSION}.{kid}.{expiry}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref())))
}

/// The current UNIX time in seconds (0 for a clock before 1970).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The keys signatures are checked against, and the clock skew allowed past an expiry.
#[derive(Clone)]
pub struct HmacKeys {
    keys: Vec<(Box<str>, hmac::Key)>,
    clock_skew: Duration,
}

impl fmt::Debug for HmacKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|(id, _)| &**id).collect();
        f.debug_struct("HmacKeys").field("ids", &ids).field("clock_skew", &self.clock_skew).finish()
    }
}

impl HmacKeys {
    /// Checks against each `(id, secret)`; a signature is accepted until `clock_skew` after its
    /// expiry.
    pub fn new<'a>(keys: impl IntoIterator<Item = (&'a str, &'a Secret)>, clock_skew: Duration) -> HmacKeys {
        let keys = keys.into_iter().map(|(id, s)| (id.into(), hmac::Key::new(hmac::HMAC_SHA256, &s.0))).collect();
        HmacKeys { keys, clock_skew }
    }

    /// Whether no key is configured (every signature is then refused).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Accepts `signature` for `token` in `domain` at UNIX time `now`: its key is known, its MAC
    /// matches (compared in constant time), and it expired no more than the clock skew ago.
    pub fn verify(&self, signature: &Signature, domain: &str, token: u64, now: u64) -> Result<(), Rejected> {
        let kid = || signature.kid.to_string();
        let Some((_, key)) = self.keys.iter().find(|(id, _)| *id == signature.kid) else {
            return Err(Rejected::UnknownKey { kid: kid() });
        };
        let message = message(&signature.kid, domain, token, signature.expiry);
        hmac::verify(key, &message, &signature.mac).map_err(|_| Rejected::WrongMac { kid: kid() })?;
        let skew = self.clock_skew.as_secs();
        if signature.expiry.saturating_add(skew) < now {
            return Err(Rejected::Expired { kid: kid(), expiry: signature.expiry, now, skew });
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "signature_tests.rs"]
mod tests;
