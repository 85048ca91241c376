//! HTTP and WebDAV backends that name resources by path: a file server, a REST API, nginx or
//! Apache with WebDAV. A request names the resource at its canonical path (under `[paths]`,
//! shortened by `[[fence.scopes]]`), and a MOVE or COPY the one at its `Destination` as well;
//! a method in `fence.subtree_methods` covers the subtree. What is forwarded is the canonical
//! form that was fenced, so the backend cannot read another resource into the same request.
//! Refusals are fencegate's JSON.

mod destination;

use std::borrow::Cow;

use bytes::Bytes;
use http::Method;
use http::Response;
use http::header::{CONNECTION, HeaderName};
use http::uri::PathAndQuery;
use http_body_util::Full;

use super::Protocol;
use crate::config::Config;
use crate::fence::{keys, path};
use crate::refusal::Refusal;
use crate::request::classify::{Coverage, Head, Named, Pinned, Plan, Touch, check_fenced, check_limits, fenced_write};
pub use destination::{DESTINATION, Destination, destination};

/// Path-named HTTP and WebDAV (module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Http;

impl Protocol for Http {
    fn name(&self) -> &'static str {
        "http"
    }

    // Inline, as the one call a request makes here: its plan is then built where it is used
    // rather than returned through a copy.
    #[inline]
    fn classify(&self, head: &Head<'_>, config: &Config) -> Result<Plan, Refusal> {
        check_limits(head, &config.limits)?;
        check_connection(head, config)?;
        let overridden = method_override(head)?;
        // The request's own method compared as a `Method`: a GET or a PUT is told from the list
        // without comparing spellings byte by byte.
        let unfenced = &config.fence.unfenced_methods;
        if unfenced.contains(head.method) && overridden.is_none_or(|m| listed(unfenced, m)) {
            return Ok(Plan::Pass { target: head.target() });
        }
        let body_limit = check_fenced(head, &config.limits)?;

        // The key and the forwarded path come from the same canonical string.
        let canonical = path::canonicalize(head.uri.path(), &config.paths)?;
        let key = keys::resource_key(&canonical, &config.fence.scopes).to_owned();
        // The backend may act on the request's own method or on the one an override names (web
        // frameworks upper-case both the method and override values; WebDAV servers ignore
        // overrides): fence what either may change, in any spelling.
        let real = upper(head.method.as_str().as_bytes());
        let claimed = overridden.map(upper);
        let claimed = claimed.as_deref();
        let subtree = either(&real, claimed, |m| listed(&config.fence.subtree_methods, m));
        let touch = |key: String, path: &str| {
            // A key a scope shortened already holds the whole subtree of the path.
            let coverage = if subtree && key == path { Coverage::Subtree } else { Coverage::Key };
            Touch { key, coverage }
        };
        let source = touch(key, &canonical);
        let destination = match either(&real, claimed, |m| m == b"MOVE" || m == b"COPY") {
            true => Some(destination(head, config)?.ok_or_else(|| Refusal::InvalidHeader {
                name: DESTINATION.to_string(),
                reason: "MOVE and COPY need one".into(),
            })?),
            false => None,
        };
        let mut touches = Vec::with_capacity(2);
        // COPY only reads its source: fencing it would refuse other locks' holders copying from
        // it. Only as spelled exactly: a backend may read another spelling as a write to the
        // path, and spellings only ever add keys here.
        if !(head.method.as_str() == "COPY" && claimed.is_none_or(|m| m == b"COPY")) {
            touches.push(source);
        }
        let mut set_headers = Vec::with_capacity(usize::from(destination.is_some()));
        if let Some(d) = destination {
            touches.push(touch(keys::resource_key(&d.path, &config.fence.scopes).to_owned(), &d.path));
            // What the backend is told to change is what was fenced.
            set_headers.push((DESTINATION.clone(), d.forwarded));
        }
        // Cannot fail for a path canonicalised from a parsed target; were it to, this refusal
        // would come before those of the rules over the keys.
        // A PUT or DELETE of its own key, not of a scope's (which holds many resources: one
        // resource's state would pin writes to the others).
        let pin = match *head.method {
            Method::PUT if touches.len() == 1 && touches[0].key == canonical => Some(Pinned::Put),
            Method::DELETE if touches.len() == 1 && touches[0].key == canonical => Some(Pinned::Delete),
            _ => None,
        };
        let target = forwarded_target(head, canonical)?;
        // A pin is chosen by the request's own method, and a backend may act on the one an
        // override names: a PUT that a framework runs as a DELETE would pass a quarantine only
        // writes that leave the key in place may pass (docs/pins.md). Such a write is not pinned.
        let pin = if overridden.is_some() { None } else { pin };
        fenced_write(head, config, Named { touches, target, set_headers, body_limit, pin })
    }

    fn refuse(&self, refusal: &Refusal, withhold: bool) -> Response<Full<Bytes>> {
        match withhold {
            true => refusal.response_withholding_levels(),
            false => refusal.response(),
        }
    }
}

/// [`Http`]'s classification of `req`.
pub fn classify<B: hyper::body::Body>(req: &http::Request<B>, config: &Config) -> Result<Plan, Refusal> {
    Http.classify(&Head::of(req), config)
}

/// Headers with which web frameworks let a request claim another method than its own. A
/// backend that honours one turns a `GET` into a write, so the method they name is fenced as if
/// it were the request's. Overrides in the query string or the body are not seen here.
static METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// The request target forwarded for a write: the canonical path and the query as sent. A
/// target already canonical is the client's own, shared rather than built and parsed again.
fn forwarded_target(head: &Head<'_>, canonical: String) -> Result<PathAndQuery, Refusal> {
    let query = head.uri.query();
    if let Some(sent) = head.uri.path_and_query()
        && sent.as_str().strip_prefix(canonical.as_str()).is_some_and(|rest| match query {
            Some(q) => rest.strip_prefix('?') == Some(q),
            None => rest.is_empty(),
        })
    {
        return Ok(sent.clone());
    }
    let target = match query {
        Some(q) => format!("{canonical}?{q}"),
        None => canonical,
    };
    PathAndQuery::try_from(target).map_err(|e| Refusal::InvalidPath(path::PathError::Unparseable(e.to_string())))
}

/// Whether `method` is one of `methods`, compared exactly: method names are case-sensitive.
fn listed(methods: &[Method], method: &[u8]) -> bool {
    methods.iter().any(|m| m.as_str().as_bytes() == method)
}

/// Whether `test` holds for the request's own method or for the one its override claims.
fn either(real: &[u8], claimed: Option<&[u8]>, test: impl Fn(&[u8]) -> bool) -> bool {
    test(real) || claimed.is_some_and(test)
}

/// `method` in upper case; borrowed when it is already, as nearly every method is.
fn upper(method: &[u8]) -> Cow<'_, [u8]> {
    match method.iter().any(u8::is_ascii_lowercase) {
        true => Cow::Owned(method.to_ascii_uppercase()),
        false => Cow::Borrowed(method),
    }
}

/// The one method a request's override headers name, if they name any; more than one value,
/// or one that is not a method name, is refused: the backend's reading of it is unknowable.
fn method_override<'a>(head: &Head<'a>) -> Result<Option<&'a [u8]>, Refusal> {
    // Most requests carry no `x-` header at all: one pass over the names spares them three
    // hashed lookups.
    if !head.headers.keys().any(|name| name.as_str().starts_with("x-")) {
        return Ok(None);
    }
    let mut found: Option<(&HeaderName, &[u8])> = None;
    for name in &METHOD_OVERRIDES {
        for value in head.headers.get_all(name) {
            let bad = |reason: &str| Refusal::InvalidHeader { name: name.to_string(), reason: reason.to_owned() };
            if let Some((first, _)) = found {
                let reason = format!("a method override is already given in {first}; send one value in one header");
                return Err(bad(&reason));
            }
            let method = value.as_bytes();
            if method.is_empty() || Method::from_bytes(method).is_err() || method.contains(&b',') {
                return Err(bad("not one method name"));
            }
            found = Some((name, method));
        }
    }
    Ok(found.map(|(_, method)| method))
}

/// Refuses a `Connection` header that names a header fencegate reads (the token, a method
/// override, the Destination): hop-by-hop headers are dropped on the way to the backend, after
/// the check that read them, so the backend would act on another request than the one checked.
fn check_connection(head: &Head<'_>, config: &Config) -> Result<(), Refusal> {
    for value in head.headers.get_all(CONNECTION) {
        // A value that is not text names nothing: nothing is dropped for it either.
        let Ok(text) = value.to_str() else { continue };
        for name in text.split(',').map(str::trim) {
            let read = |h: &HeaderName| name.eq_ignore_ascii_case(h.as_str());
            let signature = &config.verify.signature_header;
            if read(&config.fence.header) || read(signature) || read(&DESTINATION) || METHOD_OVERRIDES.iter().any(read)
            {
                return Err(Refusal::InvalidHeader {
                    name: CONNECTION.to_string(),
                    reason: format!("names {name}, which fencegate reads: the header would be dropped after the check"),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
pub(in crate::request) mod tests;
