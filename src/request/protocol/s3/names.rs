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

/// The host a request names, as sent and without its port: its target's authority, or its one
/// `Host` header; `None` for a request without either (path style).
fn sent_host(head: &Head<'_>) -> Result<Option<String>, Refusal> {
    if let Some(authority) = head.uri.authority() {
        return Ok(Some(authority.host().to_owned()));
    }
    let mut hosts = head.headers.get_all(HOST).iter();
    let Some(value) = hosts.next() else { return Ok(None) };
    if hosts.next().is_some() {
        return Err(bad_host("sent more than once"));
    }
    let text = value.to_str().map_err(|_| bad_host("not text"))?;
    Ok(Some(strip_port(text).to_owned()))
}

/// `host` as DNS reads it: case-insensitive, and a trailing dot names the same host.
fn dns_name(host: &str) -> String {
    let host = host.to_ascii_lowercase();
    match host.strip_suffix('.') {
        Some(name) => name.to_owned(),
        None => host,
    }
}

/// The bucket a virtual-host style request names in its authority, if its host is a bucket
/// under one of `suffixes`.
fn virtual_host_bucket(head: &Head<'_>, suffixes: &[String]) -> Result<Option<String>, Refusal> {
    if suffixes.is_empty() {
        return Ok(None);
    }
    match sent_host(head)? {
        Some(host) => bucket_under(&dns_name(&host), suffixes),
        None => Ok(None),
    }
}

/// The bucket `host` (a DNS name) names under one of `suffixes`, if any.
fn bucket_under(host: &str, suffixes: &[String]) -> Result<Option<String>, Refusal> {
    for suffix in suffixes {
        if let Some(bucket) = host.strip_suffix(suffix.as_str()).and_then(|b| b.strip_suffix('.'))
            && !bucket.is_empty()
        {
            // Servers disagree where a dotted bucket ends in a host (moto reads the first
            // label), so its objects are named by path only.
            if bucket.contains('.') {
                return Err(bad_host(&format!(
                    "names the bucket {bucket:?}, whose dots S3 servers read differently in a host; name it by path"
                )));
            }
            return Ok(Some(bucket.to_owned()));
        }
    }
    Ok(None)
}

/// Refuses a write whose host names no bucket fencegate can read, yet may name one to the
/// server: a host that is neither an IP literal, nor one of `suffixes` itself (a path-style
/// endpoint), nor a bucket under one. S3 servers read such a host as a bucket: AWS and s3s
/// take the whole host as a bucket (a CNAME), moto its first label; fencegate would key the
/// write as path style, under another bucket's fence. A request without a host is path style.
///
/// A host in capitals is refused too: fencegate reads `BK1.S3.TEST` as bucket `bk1`, s3s matches
/// its domains case-sensitively and reads the whole host as the bucket `bk1.s3.test`.
pub fn check_path_style_host(head: &Head<'_>, suffixes: &[String]) -> Result<(), Refusal> {
    let Some(sent) = sent_host(head)? else { return Ok(()) };
    if sent.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(bad_host("has capitals, which S3 servers do not all read as the lowercase name"));
    }
    let host = dns_name(&sent);
    if bucket_under(&host, suffixes)?.is_some() {
        return Ok(());
    }
    let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().is_ok();
    if literal || suffixes.contains(&host) {
        return Ok(());
    }
    Err(bad_host(&format!(
        "{host:?} is not an IP address, nor one of s3.virtual_host_suffixes or a bucket under one: the \
         server may read a bucket from it (virtual-host or CNAME style) where fencegate would key the \
         write path style; list the host in s3.virtual_host_suffixes"
    )))
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
