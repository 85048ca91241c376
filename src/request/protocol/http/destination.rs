//! The `Destination` of WebDAV's MOVE and COPY (RFC 4918 §10.3): the second resource such a
//! write changes. It must name this server, and it is made canonical under the same `[paths]`
//! rules as a request path, fenced as such, and forwarded in its canonical form, so that what
//! the backend changes is what was fenced.

use http::Uri;
use http::header::{HOST, HeaderName, HeaderValue};

use crate::config::Config;
use crate::fence::path;
use crate::refusal::Refusal;
use crate::request::classify::Head;

/// The `Destination` header.
pub static DESTINATION: HeaderName = HeaderName::from_static("destination");

/// A Destination made canonical.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// Its canonical path, from which its fence key comes.
    pub path: String,
    /// What is forwarded in its place: the canonical path, in the form the client used.
    pub forwarded: HeaderValue,
}

fn invalid(reason: impl Into<String>) -> Refusal {
    Refusal::InvalidHeader { name: DESTINATION.to_string(), reason: reason.into() }
}

/// The request's Destination, if it has one.
pub fn destination(head: &Head<'_>, config: &Config) -> Result<Option<Destination>, Refusal> {
    let mut values = head.headers.get_all(&DESTINATION).iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(invalid("sent more than once; send exactly one"));
    }
    let text = value.to_str().map_err(|_| invalid("not ASCII"))?;
    // A path, or an absolute URI naming this server (RFC 4918 allows both).
    let (origin, raw_path) = if text.starts_with('/') {
        (None, text)
    } else {
        let uri: Uri = text.parse().map_err(|_| invalid("neither an absolute path nor an absolute URI"))?;
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return Err(invalid("neither an absolute path nor an absolute URI"));
        };
        if !matches!(scheme, "http" | "https") || authority.as_str().contains('@') {
            return Err(invalid("must be an http or https URI without user information"));
        }
        let host = head.uri.authority().map(|a| a.as_str()).or_else(|| head.headers.get(HOST)?.to_str().ok());
        if !host.is_some_and(|h| h.eq_ignore_ascii_case(authority.as_str())) {
            return Err(invalid("names another server than the request's Host"));
        }
        // `scheme://authority`, as the client spelled it, then the path.
        let start = (scheme.len() + "://".len() + authority.as_str().len()).min(text.len());
        (Some(&text[..start]), &text[start..])
    };
    if raw_path.contains(['?', '#']) {
        return Err(invalid("must not carry a query or a fragment"));
    }
    let raw_path = if raw_path.is_empty() { "/" } else { raw_path };
    let canonical = path::canonicalize(raw_path, &config.paths).map_err(|e| invalid(format!("its path: {e}")))?;
    let forwarded = format!("{}{canonical}", origin.unwrap_or_default());
    let forwarded = HeaderValue::from_str(&forwarded).map_err(|_| invalid("cannot be forwarded"))?;
    Ok(Some(Destination { path: canonical, forwarded }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn config() -> Config {
        Config::from_toml_str("[backend]\nurl = \"http://127.0.0.1:9\"\n[store]\ndir = \"/tmp/x\"\n").unwrap()
    }

    fn parse(values: &[&str]) -> Result<Option<Destination>, Refusal> {
        let mut req = Request::builder().method("MOVE").uri("/scratch").header("host", "files.example:8080");
        for v in values {
            req = req.header("destination", *v);
        }
        destination(&Head::of(&req.body(http_body_util::Empty::<bytes::Bytes>::new()).unwrap()), &config())
    }

    #[test]
    fn every_spelling_of_a_path_on_this_server_becomes_one_canonical_path() {
        for spelling in [
            "/acct",
            "/%61cct",
            "//acct",
            "/x/../acct",
            "http://files.example:8080/acct",
            "http://FILES.example:8080/%61cct",
        ] {
            let d = parse(&[spelling]).unwrap().unwrap();
            assert_eq!(d.path, "/acct", "{spelling}");
        }
        assert_eq!(parse(&["/%61cct"]).unwrap().unwrap().forwarded, "/acct");
        assert_eq!(
            parse(&["http://files.example:8080/%61cct"]).unwrap().unwrap().forwarded,
            "http://files.example:8080/acct"
        );
        assert_eq!(parse(&[]).unwrap(), None);
    }

    #[test]
    fn a_destination_elsewhere_or_ambiguous_is_refused() {
        for bad in [
            &["http://other.example/acct"][..],
            &["http://files.example/acct"],
            &["http://user@files.example:8080/acct"],
            &["ftp://files.example:8080/acct"],
            &["acct"],
            &["/acct?x=1"],
            &["/a%2Fb"],
            &["/acct", "/other"],
        ] {
            assert_eq!(parse(bad).unwrap_err().code(), "invalid_header", "{bad:?}");
        }
    }
}
