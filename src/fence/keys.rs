//! Fence keys: the canonical path itself, or the part of it a scope names, and the record of
//! the rules that made them.

use serde::Serialize;

use super::path::{PathError, PathPolicy, canonicalize};

/// One `[[fence.scopes]]` entry: many paths share one fence key.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Scope {
    /// Canonical path prefix, matched on segment boundaries.
    pub prefix: String,
    /// Keep this many leading path segments as the key; `None` makes the whole prefix one key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub segments: Option<usize>,
}

/// Version of the canonicalisation rules: bump it whenever any path's canonical form changes.
pub const CANONICAL_VERSION: u32 = 1;

/// A description of every rule that maps paths to fence keys. A data directory remembers the
/// one it was written with: if it changes, existing `max_seen` values would sit under keys no
/// request maps to any more, and stale writes would pass.
pub fn keying(policy: &PathPolicy, scopes: &[Scope]) -> String {
    let p = policy;
    let text = format!(
        "canonical paths v{CANONICAL_VERSION}\nescaped_slashes {:?}, merge_slashes {}, case_sensitive {}, \
         trailing_slash {:?}, matrix_params {:?}\n",
        p.escaped_slashes, p.merge_slashes, p.case_sensitive, p.trailing_slash, p.matrix_params
    );
    with_scopes(text, scopes)
}

/// `text` with a line for each scope, which the keying it describes applies after the rest.
fn with_scopes(mut text: String, scopes: &[Scope]) -> String {
    for s in scopes {
        match s.segments {
            Some(n) => text.push_str(&format!("scope {} segments {n}\n", s.prefix)),
            None => text.push_str(&format!("scope {}\n", s.prefix)),
        }
    }
    text
}

/// The fence key a write to the raw request path `raw` uses: its canonical form under
/// `policy`, shortened by the first matching scope. Everything that names a resource by path
/// (the admin API, `fencegate inspect`) goes through this, so it names the key writes use.
pub fn fence_key(raw: &str, policy: &PathPolicy, scopes: &[Scope]) -> Result<String, PathError> {
    let canonical = canonicalize(raw, policy)?;
    Ok(resource_key(&canonical, scopes).to_owned())
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
pub fn in_scope(path: &str, prefix: &str) -> bool {
    path.starts_with(prefix)
        && (prefix.ends_with('/') || path.len() == prefix.len() || path.as_bytes()[prefix.len()] == b'/')
}

/// Version of the S3 object keys: bump it whenever any request's object key changes.
pub const OBJECT_VERSION: u32 = 1;

/// The keying of an object store: `/bucket/key`, the key percent-decoded once, shortened by
/// the first matching scope.
pub fn object_keying(scopes: &[Scope]) -> String {
    let text = format!(
        "s3 object keys v{OBJECT_VERSION}: /bucket/key, the key percent-decoded once, + literal, no segment resolved\n"
    );
    with_scopes(text, scopes)
}

/// The fence key of a path-style S3 path (`/bucket/key`), as an S3 request to it is keyed:
/// the bucket and key percent-decoded once, nothing else changed, shortened by the first
/// matching scope. Everything that names an object by path outside a request (the admin API)
/// goes through this.
pub fn object_key(raw: &str, scopes: &[Scope]) -> Result<String, PathError> {
    let rest = raw.strip_prefix('/').ok_or(PathError::NotAbsolutePath)?;
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    let (bucket, key) = (decode_once(bucket)?, decode_once(key)?);
    let object = match key.is_empty() {
        true => format!("/{bucket}"),
        false => format!("/{bucket}/{key}"),
    };
    Ok(resource_key(&object, scopes).to_owned())
}

/// `raw` percent-decoded once, as S3 decodes a path: `+` stays `+`, and the result must be
/// UTF-8.
pub fn decode_once(raw: &str) -> Result<String, PathError> {
    if !raw.contains('%') {
        return Ok(raw.to_owned());
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).filter(|h| h.iter().all(u8::is_ascii_hexdigit));
            let byte = hex
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or(PathError::BadPercentEncoding)?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| PathError::Unparseable("percent-encoded bytes that are not UTF-8".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn keying_names_every_rule() {
        let k = keying(&PathPolicy::default(), &[Scope { prefix: "/b/".into(), segments: Some(2) }]);
        for part in
            ["v1", "escaped_slashes Reject", "merge_slashes true", "case_sensitive true", "scope /b/ segments 2"]
        {
            assert!(k.contains(part), "{k}");
        }
        assert_ne!(k, keying(&PathPolicy { case_sensitive: false, ..PathPolicy::default() }, &[]));
    }

    #[test]
    fn an_object_key_is_its_path_decoded_once() {
        assert_eq!(object_key("/b1/a//b", &[]).unwrap(), "/b1/a//b");
        assert_eq!(object_key("/b1/a%2Fb", &[]).unwrap(), "/b1/a/b");
        assert_eq!(object_key("/b1/%2541+x", &[]).unwrap(), "/b1/%41+x");
        assert_eq!(object_key("/b1", &[]).unwrap(), "/b1");
        assert_eq!(object_key("/b1/", &[]).unwrap(), "/b1");
        assert_eq!(object_key("b1/k", &[]), Err(PathError::NotAbsolutePath));
        assert_eq!(object_key("/b1/%G1", &[]), Err(PathError::BadPercentEncoding));
        assert!(object_key("/b1/%FF", &[]).is_err());
    }
}
