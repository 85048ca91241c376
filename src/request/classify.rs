//! Classification: what a request asks of the fence, decided from its head and the settings
//! alone, without I/O. Everything a request may be refused for before it waits or touches the
//! store is refused here.

use std::borrow::Cow;

use http::header::{CONNECTION, HeaderName, UPGRADE};
use http::uri::PathAndQuery;
use http::{Method, Request};
use hyper::body::Body;

use super::destination::{DESTINATION, Destination, destination};
use super::rules;
use super::verify::{self, Proof};
use crate::config::{Config, LimitsConfig, MissingToken};
use crate::fence::token::{self, TokenError};
pub use crate::fence::{Coverage, EqualToken, Touch};
use crate::fence::{keys, path};
use crate::refusal::Refusal;

/// What is done with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
// Lives on the stack of one request for its classification and is moved once: boxing the
// write would cost an allocation per fenced write for no saving.
#[allow(clippy::large_enum_variant)]
pub enum Plan {
    /// Not a fenced method: forwarded as sent, unchecked.
    Pass {
        /// The request target as the client sent it.
        target: PathAndQuery,
    },
    /// A fenced method without a token under `fence.missing_token = "forward"`: forwarded
    /// unchecked, but at its canonical target and within the body limit.
    Unchecked {
        /// The canonical request target.
        target: PathAndQuery,
        /// Most body bytes forwarded.
        body_limit: Option<u64>,
    },
    /// A fenced write: checked against, and advancing, every key it touches.
    Write(Write),
}

/// A fenced write, as the fence sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The token the write carries.
    pub token: u64,
    /// Every fence key the backend may change with it.
    pub touches: Vec<Touch>,
    /// The canonical `Destination` (WebDAV MOVE and COPY), when the write has one.
    pub destination: Option<Destination>,
    /// The canonical request target that is forwarded (path and query).
    pub target: PathAndQuery,
    /// Most body bytes forwarded.
    pub body_limit: Option<u64>,
    /// What a token equal to `max_seen` gets: the strictest setting among the keys it touches.
    pub equal: EqualToken,
    /// The etcd locks whose current holder the token must be (`verify = "etcd"`), one per
    /// key; empty when the write's tokens are not verified.
    pub locks: Vec<String>,
    /// How far above a key's level the token may be: the smallest bound among its keys.
    pub max_jump: Option<u64>,
    /// What the token must prove, checked before the write waits for its turn.
    pub proof: Proof,
}

/// Headers with which web frameworks let a request claim another method than its own. A
/// backend that honours one turns a `GET` into a write, so the method they name is fenced as if
/// it were the request's. Overrides in the query string or the body are not seen here.
static METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// Decides what to do with a request, from its method, target, headers and declared body size.
pub fn classify<B: Body>(req: &Request<B>, config: &Config) -> Result<Plan, Refusal> {
    check_limits(req, &config.limits)?;
    check_connection(req, config)?;
    let overridden = method_override(req)?;
    let unfenced = |m: &[u8]| listed(&config.fence.unfenced_methods, m);
    if unfenced(req.method().as_str().as_bytes()) && overridden.is_none_or(unfenced) {
        let target = req.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        return Ok(Plan::Pass { target });
    }
    let body_limit = check_fenced(req, &config.limits)?;

    // The key and the forwarded path come from the same canonical string.
    let canonical = path::canonicalize(req.uri().path(), &config.paths)?;
    let key = keys::resource_key(&canonical, &config.fence.scopes).to_owned();
    // The backend may act on the request's own method or on the one an override names (web
    // frameworks upper-case both the method and override values; WebDAV servers ignore
    // overrides): fence what either may change, in any spelling.
    let real = upper(req.method().as_str().as_bytes());
    let claimed = overridden.map(upper);
    let methods = || std::iter::once(real.as_ref()).chain(claimed.as_deref());
    let subtree = methods().any(|m| listed(&config.fence.subtree_methods, m));
    let touch = |key: String, path: &str| {
        // A key a scope shortened already holds the whole subtree of the path.
        let coverage = if subtree && key == path { Coverage::Subtree } else { Coverage::Key };
        Touch { key, coverage }
    };
    let source = touch(key, &canonical);
    let destination = match methods().any(|m| m == b"MOVE" || m == b"COPY") {
        true => Some(destination(req, config)?.ok_or_else(|| Refusal::InvalidHeader {
            name: DESTINATION.to_string(),
            reason: "MOVE and COPY need one".into(),
        })?),
        false => None,
    };
    let mut touches = Vec::with_capacity(2);
    // COPY only reads its source: fencing it would refuse other locks' holders copying from it.
    // Only as spelled exactly: a backend may read another spelling as a write to the path, and
    // spellings only ever add keys here.
    let spelled = || std::iter::once(req.method().as_str().as_bytes()).chain(claimed.as_deref());
    if !spelled().all(|m| m == b"COPY") {
        touches.push(source);
    }
    if let Some(d) = &destination {
        touches.push(touch(keys::resource_key(&d.path, &config.fence.scopes).to_owned(), &d.path));
    }
    let governed = rules::govern(&touches, &config.fence)?;
    let target = forwarded_target(req, canonical)?;

    let values = req.headers().get_all(&config.fence.header).iter().map(|v| v.as_bytes());
    let token = match token::from_values(values) {
        Ok(token) => token,
        Err(TokenError::Missing) if config.fence.missing_token == MissingToken::Forward => {
            return Ok(Plan::Unchecked { target, body_limit });
        }
        Err(TokenError::Missing) => return Err(Refusal::MissingToken { header: config.fence.header.to_string() }),
        Err(e) => return Err(e.into()),
    };
    let locks = super::locks::lock_names(&touches, &config.fence).map_err(Refusal::Lock)?;
    let proof = verify::read(req.headers(), &config.verify, governed.verify, governed.domain)?;
    // Only the verified holder of a lock can present its own revision: equal passes there.
    let equal = if locks.is_empty() { governed.equal } else { EqualToken::Accept };
    let max_jump = governed.max_jump;
    Ok(Plan::Write(Write { token, touches, destination, target, body_limit, equal, max_jump, proof, locks }))
}

/// The request target forwarded for a write: the canonical path and the query as sent. A
/// target already canonical is the client's own, shared rather than built and parsed again.
fn forwarded_target<B>(req: &Request<B>, canonical: String) -> Result<PathAndQuery, Refusal> {
    let query = req.uri().query();
    if let Some(sent) = req.uri().path_and_query()
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

/// `method` in upper case; borrowed when it is already, as nearly every method is.
fn upper(method: &[u8]) -> Cow<'_, [u8]> {
    match method.iter().any(u8::is_ascii_lowercase) {
        true => Cow::Owned(method.to_ascii_uppercase()),
        false => Cow::Borrowed(method),
    }
}

/// The one method a request's override headers name, if they name any; more than one value,
/// or one that is not a method name, is refused: the backend's reading of it is unknowable.
fn method_override<B>(req: &Request<B>) -> Result<Option<&[u8]>, Refusal> {
    // Most requests carry no `x-` header at all: one pass over the names spares them three
    // hashed lookups.
    if !req.headers().keys().any(|name| name.as_str().starts_with("x-")) {
        return Ok(None);
    }
    let mut found: Option<(&HeaderName, &[u8])> = None;
    for name in &METHOD_OVERRIDES {
        for value in req.headers().get_all(name) {
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
fn check_connection<B>(req: &Request<B>, config: &Config) -> Result<(), Refusal> {
    for value in req.headers().get_all(CONNECTION) {
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

/// Refuses what no request may carry: tunnels, and heads beyond the configured limits.
fn check_limits<B>(req: &Request<B>, limits: &LimitsConfig) -> Result<(), Refusal> {
    // In any spelling: a backend that reads method names without regard to case could open a
    // tunnel for `connect`.
    if req.method().as_str().eq_ignore_ascii_case("CONNECT") {
        return Err(Refusal::MethodNotAllowed(req.method().to_string()));
    }
    // The authority counts too (absolute form, HTTP/2's :authority): it becomes Host upstream.
    let authority = req.uri().authority().map_or(0, |a| a.as_str().len());
    let uri = authority + req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri > limits.max_uri_bytes {
        return Err(Refusal::UriTooLong { size: uri, limit: limits.max_uri_bytes });
    }
    // As it was sent: request line, then "name: value\r\n" per field.
    let head = req.method().as_str().len() + uri + 12;
    let size = head + req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum::<usize>();
    if size > limits.max_header_bytes {
        return Err(Refusal::HeadersTooLarge { size, limit: limits.max_header_bytes });
    }
    Ok(())
}

/// Refuses a fenced write that asks to switch protocols or declares a body over the limit,
/// before it can touch `max_seen`; returns the body limit to enforce while forwarding.
fn check_fenced<B: Body>(req: &Request<B>, limits: &LimitsConfig) -> Result<Option<u64>, Refusal> {
    if let Some(upgrade) = req.headers().get(UPGRADE) {
        return Err(Refusal::UpgradeRefused(String::from_utf8_lossy(upgrade.as_bytes()).into_owned()));
    }
    let limit = (limits.max_body_bytes > 0).then_some(limits.max_body_bytes);
    let declared = req.body().size_hint().upper();
    if let (Some(limit), Some(declared)) = (limit, declared)
        && declared > limit
    {
        return Err(Refusal::BodyTooLarge { limit });
    }
    Ok(limit)
}

#[cfg(test)]
#[path = "classify_tests.rs"]
pub(super) mod tests;
