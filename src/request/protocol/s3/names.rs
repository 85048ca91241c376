//! Where an S3 request points: its bucket (from the path, or from `Host` under a virtual-host
//! suffix) and its object key, decoded as S3 decodes it.
//!
//! S3 keys are flat byte strings: the key is the rest of the path percent-decoded once, with
//! `+` literal and no dot segment resolved or slash merged, so `a//b`, `a/./b` and `a/b` are
//! three objects, and `a%2Fb` is `a/b`. The fence key is `/bucket/key`, the same for a path
//! style and a virtual-host style request.

use http::header::HOST;

use crate::config::S3Config;
use crate::fence::keys::decode_once as decode;
use crate::refusal::Refusal;
use crate::request::classify::Head;

/// What a request names: the service, a bucket, or an object in one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Named {
    /// No bucket: the service itself (`ListBuckets`).
    Service,
    /// A bucket, without a key.
    Bucket(String),
    /// An object: its bucket and its key, decoded.
    Object {
        /// The bucket.
        bucket: String,
        /// The key, as S3 reads it.
        key: String,
    },
}

impl Named {
    /// The bucket it names, if any.
    pub fn bucket(&self) -> Option<&str> {
        match self {
            Named::Service => None,
            Named::Bucket(bucket) | Named::Object { bucket, .. } => Some(bucket),
        }
    }
}

/// The fence key of an object: `/bucket/key`, with the key's bytes as S3 reads them.
pub fn object_key(bucket: &str, key: &str) -> String {
    let mut out = String::with_capacity(bucket.len() + key.len() + 2);
    out.push('/');
    out.push_str(bucket);
    out.push('/');
    out.push_str(key);
    out
}

/// The fence key of a bucket: `/bucket`, whose subtree holds every object in it.
pub fn bucket_key(bucket: &str) -> String {
    format!("/{bucket}")
}

/// What `head` names, under `s3`: its virtual-host suffixes (`s3.example.com` makes
/// `b1.s3.example.com` bucket `b1`), and whether keys are flat.
pub fn named(head: &Head<'_>, s3: &S3Config) -> Result<Named, Refusal> {
    let named = locate(head, &s3.virtual_host_suffixes)?;
    if let (false, Named::Object { key, .. }) = (s3.flat_keys, &named) {
        check_path_key(key)?;
    }
    Ok(named)
}

/// Refuses a key that a server storing objects as files reads as another key's path: one with
/// an empty, `.` or `..` segment (`a//b`, `a/./b` and `b/../a/b` are all the file `a/b`). A
/// trailing slash, a directory marker, is kept.
pub(super) fn check_path_key(key: &str) -> Result<(), Refusal> {
    let inner = key.strip_suffix('/').unwrap_or(key);
    match inner.split('/').any(|segment| matches!(segment, "" | "." | "..")) {
        true => Err(Refusal::BadRequest(format!(
            "the key {key:?} has an empty, \".\" or \"..\" segment, which this server resolves as a file path \
             (s3.flat_keys = false): it would write another key's object"
        ))),
        false => Ok(()),
    }
}

/// What `head` names, with `suffixes` the virtual-host suffixes.
fn locate(head: &Head<'_>, suffixes: &[String]) -> Result<Named, Refusal> {
    let path = head.uri.path();
    if !path.starts_with('/') {
        return Err(Refusal::InvalidPath(crate::fence::path::PathError::NotAbsolutePath));
    }
    let rest = &path[1..];
    if let Some(bucket) = virtual_host_bucket(head, suffixes)? {
        check_bucket(&bucket)?;
        return Ok(match rest.is_empty() {
            true => Named::Bucket(bucket),
            false => Named::Object { key: decode(rest)?, bucket },
        });
    }
    if rest.is_empty() {
        return Ok(Named::Service);
    }
    let (bucket, key) = match rest.split_once('/') {
        Some((bucket, key)) => (bucket, key),
        None => (rest, ""),
    };
    let bucket = decode(bucket)?;
    check_bucket(&bucket)?;
    Ok(match key.is_empty() {
        true => Named::Bucket(bucket),
        false => Named::Object { key: decode(key)?, bucket },
    })
}

/// The bucket a virtual-host style request names in its authority, if its host is a bucket
/// under one of `suffixes`.
fn virtual_host_bucket(head: &Head<'_>, suffixes: &[String]) -> Result<Option<String>, Refusal> {
    if suffixes.is_empty() {
        return Ok(None);
    }
    let host = match head.uri.authority() {
        Some(authority) => authority.host().to_owned(),
        None => {
            let mut hosts = head.headers.get_all(HOST).iter();
            let Some(value) = hosts.next() else { return Ok(None) };
            if hosts.next().is_some() {
                return Err(bad_host("sent more than once"));
            }
            let text = value.to_str().map_err(|_| bad_host("not text"))?;
            strip_port(text).to_owned()
        }
    };
    // DNS names are case-insensitive; a trailing dot names the same host.
    let host = host.to_ascii_lowercase();
    let host = host.strip_suffix('.').unwrap_or(&host);
    for suffix in suffixes {
        if let Some(bucket) = host.strip_suffix(suffix.as_str()).and_then(|b| b.strip_suffix('.'))
            && !bucket.is_empty()
        {
            return Ok(Some(bucket.to_owned()));
        }
    }
    Ok(None)
}

/// `host[:port]` without the port (an IPv6 literal keeps its brackets).
fn strip_port(host: &str) -> &str {
    match host.starts_with('[') {
        true => host.find(']').map_or(host, |i| &host[..=i]),
        false => host.split(':').next().unwrap_or(host),
    }
}

/// Refuses what S3 does not take as a bucket name, so that no two spellings of one bucket
/// reach two fence keys: S3's rules for bucket names (3 to 63 of `a-z`, `0-9`, `.`, `-`).
fn check_bucket(bucket: &str) -> Result<(), Refusal> {
    let ok = (3..=63).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    match ok {
        true => Ok(()),
        false => Err(Refusal::BadRequest(format!(
            "{bucket:?} is not an S3 bucket name (3 to 63 of a-z, 0-9, \".\" and \"-\")"
        ))),
    }
}

fn bad_host(reason: &str) -> Refusal {
    Refusal::InvalidHeader { name: HOST.to_string(), reason: reason.to_owned() }
}
