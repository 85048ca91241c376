//! Canonical resource paths (the rules are written out in `docs/paths.md`).
//!
//! A fence keyed on the path is bypassed the moment fencegate and the backend disagree about
//! which resource a request names (Envoy's CVE-2019-9901 and CVE-2021-29492, Apache's
//! CVE-2021-41773). So a fenced request's path is canonicalised once, here: the fence key
//! comes from the canonical path, and the canonical path, not the client's spelling, is what
//! gets forwarded. Spellings that backends read differently are refused.
//!
//! Order matters: refuse what is ambiguous, decode escaped slashes if configured, merge
//! repeated slashes (as nginx does before it resolves `..`), apply RFC 3986 normalisation
//! (fluent-uri: dot segments, also percent-encoded; unreserved characters decoded; hex
//! upper-cased; no climbing above the root), decode escapes of characters that are safe as
//! literals, then the policies: matrix parameters, case, trailing slash.

use fluent_uri::Uri;
use fluent_uri::normalize::Normalizer;
use serde::Serialize;

/// Why a request target cannot be fenced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// `*`, an authority, or anything else that is not an absolute path.
    #[error("the request target must be an absolute path starting with '/'")]
    NotAbsolutePath,
    /// A raw backslash, which some backends read as a separator.
    #[error("backslashes are not allowed in paths")]
    Backslash,
    /// `%2F` or `%5C`, which some backends decode into a separator and others do not.
    #[error("escaped slashes (%2F, %5C) are not allowed in paths")]
    EscapedSlash,
    /// `%00`, which truncates paths in C-based backends.
    #[error("encoded NUL (%00) is not allowed in paths")]
    EncodedNul,
    /// A control byte, raw or percent-encoded.
    #[error("control characters are not allowed in paths")]
    ControlCharacter,
    /// A byte outside ASCII that is not percent-encoded.
    #[error("non-ASCII bytes must be percent-encoded")]
    NonAscii,
    /// A `#` in the request target: fragments are never sent to servers.
    #[error("fragments ('#') are not allowed in request targets")]
    Fragment,
    /// A `%` not followed by two hex digits.
    #[error("malformed percent-encoding")]
    BadPercentEncoding,
    /// `..` segments that climb above `/`.
    #[error("the path climbs above the root")]
    AboveRoot,
    /// `;`, which Java servlet containers cut off as path parameters and others keep.
    #[error("matrix parameters (';') are not allowed in paths (paths.matrix_params)")]
    MatrixParameters,
    /// Escaped bytes outside ASCII where case is ignored: how a backend folds the case of
    /// non-ASCII letters (`%C3%A4` and `%C3%84`) is not knowable, so such paths are refused.
    #[error("paths.case_sensitive = false only supports ASCII paths")]
    NonAsciiCaseFold,
    /// Longer than a fence key may be.
    #[error("the path is longer than {0} bytes")]
    TooLong(usize),
    /// Anything else RFC 3986 does not accept as a path.
    #[error("not a valid RFC 3986 path: {0}")]
    Unparseable(String),
}

/// What to do with `%2F` and `%5C` in a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EscapedSlashes {
    /// Refuse the request (the default): backends disagree on what these mean.
    Reject,
    /// Decode `%2F` into a separator, as nginx does (`%5C` is still refused).
    Decode,
}

/// What a trailing slash means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TrailingSlash {
    /// `/a` and `/a/` are different resources (the default).
    Distinct,
    /// `/a/` is `/a`: the slash is removed from key and forwarded path.
    Strip,
}

/// Whether `;` may appear in a fenced path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MatrixParams {
    /// Refuse the request (the default).
    Reject,
    /// Keep `;` as an ordinary character of the path.
    Allow,
}

/// How the backend resolves paths; fencegate must resolve them the same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathPolicy {
    /// `%2F` and `%5C`.
    pub escaped_slashes: EscapedSlashes,
    /// Whether `//` is one separator.
    pub merge_slashes: bool,
    /// Whether `/A` and `/a` differ.
    pub case_sensitive: bool,
    /// Whether `/a/` is `/a`.
    pub trailing_slash: TrailingSlash,
    /// Whether `;` is allowed.
    pub matrix_params: MatrixParams,
}

impl Default for PathPolicy {
    fn default() -> Self {
        PathPolicy {
            escaped_slashes: EscapedSlashes::Reject,
            merge_slashes: true,
            case_sensitive: true,
            trailing_slash: TrailingSlash::Distinct,
            matrix_params: MatrixParams::Reject,
        }
    }
}

/// Longest canonical path fenced (the store's record limit is 64 KiB).
pub const MAX_PATH_LEN: usize = 16 * 1024;

/// Returns the canonical form of an absolute path (no query) under `policy`.
pub fn canonicalize(raw: &str, policy: &PathPolicy) -> Result<String, PathError> {
    if already_canonical(raw, policy) {
        return Ok(raw.to_owned());
    }
    canonicalize_fully(raw, policy)
}

/// Whether every step below would leave `raw` as it is: only unreserved characters (lower-case
/// ones where case is folded) between single slashes, no dot segment, no trailing slash. Most
/// paths are like that, and the full route costs several microseconds. A property test checks
/// that both routes agree under every policy.
fn already_canonical(raw: &str, policy: &PathPolicy) -> bool {
    let bytes = raw.as_bytes();
    if bytes.first() != Some(&b'/') || bytes.len() > MAX_PATH_LEN || (bytes.len() > 1 && bytes.ends_with(b"/")) {
        return false;
    }
    let allowed = |b: u8| match b {
        b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'~' | b'.' => true,
        b'A'..=b'Z' => policy.case_sensitive,
        _ => false,
    };
    // One pass over the bytes after the leading slash: every segment is non-empty, neither
    // `.` nor `..`, and of allowed bytes only.
    let dot_segment = |len: usize, dots: usize| dots == len && len <= 2;
    let (mut len, mut dots) = (0, 0);
    for &b in &bytes[1..] {
        if b == b'/' {
            if len == 0 || dot_segment(len, dots) {
                return false;
            }
            (len, dots) = (0, 0);
        } else if allowed(b) {
            len += 1;
            dots += usize::from(b == b'.');
        } else {
            return false;
        }
    }
    bytes.len() == 1 || !dot_segment(len, dots)
}

/// The full route of [`canonicalize`], which the fast check bypasses.
pub(crate) fn canonicalize_fully(raw: &str, policy: &PathPolicy) -> Result<String, PathError> {
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolutePath);
    }
    if raw.len() > MAX_PATH_LEN {
        return Err(PathError::TooLong(MAX_PATH_LEN));
    }
    refuse_ambiguous(raw.as_bytes(), policy.escaped_slashes)?;
    let mut path = match policy.escaped_slashes {
        EscapedSlashes::Reject => raw.to_owned(),
        EscapedSlashes::Decode => raw.replace("%2F", "/").replace("%2f", "/"),
    };
    if policy.merge_slashes {
        path = merge_slashes(&path);
    }
    let uri = Uri::parse(format!("http://fencegate.invalid{path}"))
        .map_err(|(e, _)| PathError::Unparseable(e.to_string()))?;
    let normal = Normalizer::new().allow_path_underflow(false).normalize(&uri).map_err(|_| PathError::AboveRoot)?;
    let mut path = decode_literal_safe(normal.path().as_str());
    // Dot-segment removal cannot join two slashes once they are merged, but the key's
    // properties (no `//`, idempotence) must not depend on that argument alone.
    if policy.merge_slashes {
        path = merge_slashes(&path);
    }
    if policy.matrix_params == MatrixParams::Reject && path.contains(';') {
        return Err(PathError::MatrixParameters);
    }
    if !policy.case_sensitive {
        if path.as_bytes().windows(2).any(|w| w[0] == b'%' && matches!(w[1], b'8'..=b'9' | b'A'..=b'F')) {
            return Err(PathError::NonAsciiCaseFold);
        }
        path = lowercase_outside_escapes(&path);
    }
    if policy.trailing_slash == TrailingSlash::Strip {
        let trimmed = path.trim_end_matches('/');
        path = if trimmed.is_empty() { "/".to_owned() } else { trimmed.to_owned() };
    }
    Ok(path)
}

fn refuse_ambiguous(bytes: &[u8], escaped_slashes: EscapedSlashes) -> Result<(), PathError> {
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).ok_or(PathError::BadPercentEncoding)?;
                let decoded = std::str::from_utf8(hex)
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or(PathError::BadPercentEncoding)?;
                match decoded {
                    b'/' if escaped_slashes == EscapedSlashes::Decode => {}
                    b'/' | b'\\' => return Err(PathError::EscapedSlash),
                    0 => return Err(PathError::EncodedNul),
                    c if c < 0x20 || c == 0x7f => return Err(PathError::ControlCharacter),
                    _ => {}
                }
                i += 3;
                continue;
            }
            b'\\' => return Err(PathError::Backslash),
            b'#' => return Err(PathError::Fragment),
            c if c < 0x20 || c == 0x7f => return Err(PathError::ControlCharacter),
            c if c >= 0x80 => return Err(PathError::NonAscii),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

fn merge_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if !(c == '/' && out.ends_with('/')) {
            out.push(c);
        }
    }
    out
}

/// Characters RFC 3986 allows literally in a path segment but does not call unreserved.
const LITERAL_SAFE: &[u8] = b"!$&'()*+,;=:@";

/// Decodes `%XX` escapes of [`LITERAL_SAFE`] characters. RFC 3986 says `/a%21` and `/a!` may
/// differ, but a backend that decodes paths (nginx does) serves both from one file, so they
/// must share a key. Escapes that would change the path's structure (`/`, `?`, `#`, `%`)
/// or are not allowed literally stay encoded.
fn decode_literal_safe(path: &str) -> String {
    let b = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        let decoded = (b[i] == b'%')
            .then(|| b.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok())
            .filter(|c| LITERAL_SAFE.contains(c));
        match decoded {
            Some(c) => {
                out.push(char::from(c));
                i += 3;
            }
            None => {
                out.push(char::from(b[i]));
                i += 1;
            }
        }
    }
    out
}

/// Lower-cases ASCII letters, leaving the hex digits of `%XX` escapes upper case.
fn lowercase_outside_escapes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut escape = 0;
    for c in path.chars() {
        if c == '%' {
            escape = 2;
            out.push(c);
        } else if escape > 0 {
            escape -= 1;
            out.push(c);
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

#[cfg(test)]
mod tests;
