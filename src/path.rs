//! Canonical resource paths and fence keys.
//!
//! A fence keyed on the path is bypassed the moment fencegate and the backend disagree about
//! which resource a request names. So a fenced request's path is canonicalised once, here; the
//! fence key is derived from that canonical path, and the canonical path (not the client's
//! spelling) is what gets forwarded. Spellings we cannot canonicalise safely are refused.
//!
//! Order matters: refuse what is ambiguous (`%2F`, `%5C`, `%00`, backslashes, control bytes),
//! merge repeated slashes (as nginx does before resolving `..`), then apply RFC 3986
//! normalisation (dot segments, also percent-encoded; unreserved characters decoded; hex
//! upper-cased), refusing paths that climb above the root.

use fluent_uri::Uri;
use fluent_uri::normalize::Normalizer;

use crate::config::Scope;

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
    /// Anything else RFC 3986 does not accept as a path.
    #[error("not a valid RFC 3986 path: {0}")]
    Unparseable(String),
}

/// Returns the canonical form of an absolute path (no query).
pub fn canonicalize(raw: &str) -> Result<String, PathError> {
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolutePath);
    }
    refuse_ambiguous(raw.as_bytes())?;
    let merged = merge_slashes(raw);
    let uri = Uri::parse(format!("http://fencegate.invalid{merged}"))
        .map_err(|(e, _)| PathError::Unparseable(e.to_string()))?;
    let normal = Normalizer::new().allow_path_underflow(false).normalize(&uri).map_err(|_| PathError::AboveRoot)?;
    // Dot-segment removal cannot join two slashes once they are merged, but the key's
    // properties (no `//`, idempotence) must not depend on that argument alone.
    Ok(decode_literal_safe(&merge_slashes(normal.path().as_str())))
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

fn refuse_ambiguous(bytes: &[u8]) -> Result<(), PathError> {
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

/// Version of the canonicalisation rules: bump it whenever any path's canonical form changes.
pub const CANONICAL_VERSION: u32 = 1;

/// A description of every rule that maps paths to fence keys. A data directory remembers the
/// one it was written with: if it changes, existing `max_seen` values would sit under keys no
/// request maps to any more, and stale writes would pass.
pub fn keying(scopes: &[Scope]) -> String {
    let mut text = format!("canonical paths v{CANONICAL_VERSION}\n");
    for s in scopes {
        match s.segments {
            Some(n) => text.push_str(&format!("scope {} segments {n}\n", s.prefix)),
            None => text.push_str(&format!("scope {}\n", s.prefix)),
        }
    }
    text
}

/// The fence key of a canonical path: the path itself, or the part of it that the first
/// matching scope names.
pub fn resource_key<'a>(path: &'a str, scopes: &'a [Scope]) -> &'a str {
    let Some(scope) = scopes.iter().find(|s| in_scope(path, &s.prefix)) else {
        return path;
    };
    match scope.segments {
        // The (n+1)-th slash starts the first segment past the key.
        Some(n) => path.match_indices('/').nth(n).map_or(path, |(i, _)| &path[..i]),
        None => scope.prefix.strip_suffix('/').filter(|p| !p.is_empty()).unwrap_or(&scope.prefix),
    }
}

/// Prefix match on segment boundaries, so `/db` covers `/db/x` but not `/dbx`.
fn in_scope(path: &str, prefix: &str) -> bool {
    path.starts_with(prefix)
        && (prefix.ends_with('/') || path.len() == prefix.len() || path.as_bytes()[prefix.len()] == b'/')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn aliases_of_one_resource_share_a_canonical_form() {
        for alias in [
            "/accounts/42",
            "/accounts//42",
            "//accounts/42",
            "/accounts/./42",
            "/accounts/x/../42",
            "/accounts/x/%2e%2e/42",
            "/accounts/x/%2E%2E/42",
            "/accounts/x/.%2e/42",
            "/accounts/%2e/42",
            "/%61ccounts/%34%32",
            "/accounts/x//..//42",
        ] {
            assert_eq!(canonicalize(alias).as_deref(), Ok("/accounts/42"), "{alias}");
        }
    }

    #[test]
    fn escapes_of_characters_safe_as_literals_are_decoded() {
        assert_eq!(canonicalize("/a%21").as_deref(), Ok("/a!"));
        assert_eq!(canonicalize("/a%3ab%40c%3B").as_deref(), Ok("/a:b@c;"));
        assert_eq!(canonicalize("/a!").as_deref(), Ok("/a!"));
    }

    #[test]
    fn hex_is_upper_cased_and_structural_escapes_kept() {
        assert_eq!(canonicalize("/a%3fb%7e%23%25%20%c3%a9").as_deref(), Ok("/a%3Fb~%23%25%20%C3%A9"));
        assert_eq!(canonicalize("/a%2541").as_deref(), Ok("/a%2541"), "decoded once, like a backend");
        assert_eq!(canonicalize("/a/").as_deref(), Ok("/a/"));
        assert_eq!(canonicalize("/A").as_deref(), Ok("/A"));
    }

    #[test]
    fn ambiguous_spellings_are_refused() {
        for (raw, err) in [
            ("/a%2Fb", PathError::EscapedSlash),
            ("/a%2fb", PathError::EscapedSlash),
            ("/a%5cb", PathError::EscapedSlash),
            ("/a%00b", PathError::EncodedNul),
            ("/a%0ab", PathError::ControlCharacter),
            ("/a\\b", PathError::Backslash),
            ("/a#b", PathError::Fragment),
            ("/a%zz", PathError::BadPercentEncoding),
            ("/a%4", PathError::BadPercentEncoding),
            ("/..", PathError::AboveRoot),
            ("/a/../../b", PathError::AboveRoot),
            ("/a/%2e%2e/%2e%2e/b", PathError::AboveRoot),
            ("*", PathError::NotAbsolutePath),
            ("", PathError::NotAbsolutePath),
            ("/é", PathError::NonAscii),
        ] {
            assert_eq!(canonicalize(raw), Err(err), "{raw:?}");
        }
    }

    #[test]
    fn scopes_map_paths_to_keys_on_segment_boundaries() {
        let scopes = vec![
            Scope { prefix: "/buckets/".into(), segments: Some(2) },
            Scope { prefix: "/db".into(), segments: None },
        ];
        assert_eq!(resource_key("/buckets/b1/obj/x", &scopes), "/buckets/b1");
        assert_eq!(resource_key("/buckets/b1", &scopes), "/buckets/b1");
        assert_eq!(resource_key("/buckets/b1/", &scopes), "/buckets/b1");
        assert_eq!(resource_key("/db/t/1", &scopes), "/db");
        assert_eq!(resource_key("/db", &scopes), "/db");
        assert_eq!(resource_key("/dbx/1", &scopes), "/dbx/1");
        assert_eq!(resource_key("/other", &scopes), "/other");
    }

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-zA-Z0-9_~-]{1,4}",
            Just(".".to_string()),
            Just("..".to_string()),
            Just("%2e".to_string()),
            Just("%2E%2e".to_string()),
            Just("".to_string()),
            "%[0-9a-fA-F]{2}",
            "[!$&'()*+,;=:@]{1,2}",
        ]
    }

    proptest! {
        #[test]
        fn canonical_form_is_a_fixed_point_with_no_ambiguity(segs in prop::collection::vec(segment(), 0..8)) {
            let raw = format!("/{}", segs.join("/"));
            if let Ok(c) = canonicalize(&raw) {
                prop_assert_eq!(canonicalize(&c), Ok(c.clone()));
                prop_assert!(c.starts_with('/'));
                prop_assert!(!c.contains("//"), "{}", c);
                let lower = c.to_ascii_lowercase();
                prop_assert!(!lower.contains("%2f") && !lower.contains("%5c") && !lower.contains("%2e"));
                prop_assert!(c.split('/').all(|s| s != "." && s != ".."), "{}", c);
            }
        }
    }
}
