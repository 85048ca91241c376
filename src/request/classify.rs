//! Classification: what a request asks of the fence, decided from its head and the settings
//! alone, without I/O. Everything a request may be refused for before it waits or touches the
//! store is refused here.
//!
//! How a request names its resources is the backend's protocol's to say ([`super::protocol`]);
//! what follows from the names is the same for every protocol and lives here: the limits every
//! request is held to, the body limit of a fenced write, and [`fenced_write`], which reads the
//! token and its proof and settles the rules a write is fenced under.

use http::header::{HeaderName, HeaderValue, UPGRADE};
use http::uri::PathAndQuery;
use http::{HeaderMap, Method, Request, Uri};
use hyper::body::Body;

use super::proof::{self, Proof};
use super::rules;
use crate::config::{BackendProtocol, Config, LimitsConfig, MissingToken, PinMode};
use crate::fence::token::{self, TokenError};
pub use crate::fence::{Coverage, EqualToken, Touch};
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
    /// unchecked, but at the target the protocol forwards for a write and within the body limit.
    Unchecked {
        /// The request target forwarded.
        target: PathAndQuery,
        /// Most body bytes forwarded.
        body_limit: Option<u64>,
    },
    /// A fenced write: checked against, and advancing, every key it touches.
    Write(Write),
    /// A request that names its resources in its body (S3's DeleteObjects): read the body
    /// whole, at most `limit` bytes, then classify it with the body
    /// ([`super::protocol::Protocol::classify_read`]).
    ReadBody {
        /// Most bytes read.
        limit: usize,
    },
}

/// A fenced write, as the fence sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The token the write carries.
    pub token: u64,
    /// Every fence key the backend may change with it.
    pub touches: Vec<Touch>,
    /// The request target that is forwarded (path and query): the one whose resources were
    /// named, in the form the protocol forwards.
    pub target: PathAndQuery,
    /// Headers set on the forwarded request, replacing the client's: those that name a
    /// resource, in the form that was fenced (WebDAV's canonical `Destination`).
    pub set_headers: Vec<(HeaderName, HeaderValue)>,
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
    /// Its part in a multipart upload (S3), if it has one: boxed, as most writes have none.
    pub upload: Option<Box<UploadStep>>,
    /// How it is pinned to the backend's state of its one key (docs/pins.md), if it is.
    pub pin: Option<Pinned>,
}

/// A pinned write (docs/pins.md): one that changes one key alone, with a method whose
/// preconditions the backend honours, under a rule with `pin = "etag"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pinned {
    /// Leaves the key in place (`PUT`): its answer's `ETag` is the key's next pin.
    Put,
    /// Leaves the key absent (`DELETE`).
    Delete,
}

/// A write's part in a multipart upload, which the fence binds or checks beside its keys
/// (`fence::uploads`): an S3-like server finds an upload by its id alone, so what the id was
/// created for is checked, not only the object the request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadStep {
    /// Creates an upload of `object`: the id the backend answers with is bound to the token
    /// before the client hears it ([`super::protocol::Protocol::upload_id`]).
    Create {
        /// The object, as fenced (`/bucket/key`).
        object: String,
    },
    /// Adds a part to upload `id`, which must be bound to `object` and the token.
    Part {
        /// The object the request names.
        object: String,
        /// The upload id it carries.
        id: String,
    },
    /// Completes or aborts upload `id`: checked as a part, and its binding dropped once the
    /// backend accepts.
    End {
        /// The object the request names.
        object: String,
        /// The upload id it carries.
        id: String,
    },
}

/// What classification reads of a request: its head, and the body size it declares.
#[derive(Debug, Clone, Copy)]
pub struct Head<'a> {
    /// The method as sent.
    pub method: &'a Method,
    /// The request target (with its authority, in absolute form or HTTP/2).
    pub uri: &'a Uri,
    /// The header fields.
    pub headers: &'a HeaderMap,
    /// The most body bytes the request declares, if it declares a bound.
    pub declared_body: Option<u64>,
}

impl<'a> Head<'a> {
    /// The head of `req`.
    #[inline]
    pub fn of<B: Body>(req: &'a Request<B>) -> Self {
        Head {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            declared_body: req.body().size_hint().upper(),
        }
    }

    /// The request target as sent (`/` when it has none: an authority-form target).
    pub fn target(&self) -> PathAndQuery {
        self.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"))
    }
}

/// What a protocol names of a fenced write: everything else [`fenced_write`] settles.
#[derive(Debug)]
pub struct Named {
    /// Every fence key the backend may change with it.
    pub touches: Vec<Touch>,
    /// The request target forwarded.
    pub target: PathAndQuery,
    /// Headers set on the forwarded request.
    pub set_headers: Vec<(HeaderName, HeaderValue)>,
    /// Most body bytes forwarded ([`check_fenced`]).
    pub body_limit: Option<u64>,
    /// How the write would be pinned where a rule pins its key (docs/pins.md): set by the
    /// protocol for an operation on one resource whose preconditions the backend honours,
    /// `None` for every other.
    pub pin: Option<Pinned>,
}

/// The plan of a fenced write whose resources a protocol named: its token (or, for a tokenless
/// one under `fence.missing_token = "forward"`, an unchecked pass), the rules its keys are
/// fenced under, the etcd locks and the proof its token must show.
#[inline]
pub fn fenced_write(head: &Head<'_>, config: &Config, named: Named) -> Result<Plan, Refusal> {
    let Named { touches, target, set_headers, body_limit, pin } = named;
    let governed = rules::govern(&touches, &config.fence)?;
    let values = head.headers.get_all(&config.fence.header).iter().map(|v| v.as_bytes());
    let token = match token::from_values(values) {
        Ok(token) => token,
        Err(TokenError::Missing) if config.fence.missing_token == MissingToken::Forward => {
            return Ok(Plan::Unchecked { target, body_limit });
        }
        Err(TokenError::Missing) => return Err(Refusal::MissingToken { header: config.fence.header.to_string() }),
        Err(e) => return Err(e.into()),
    };
    let locks = super::holders::lock_names(&touches, &config.fence).map_err(Refusal::Lock)?;
    let proof = proof::read(head.headers, &config.verify, governed.verify, governed.domain)?;
    // Only the verified holder of a lock can present its own revision: equal passes there.
    let equal = if locks.is_empty() { governed.equal } else { EqualToken::Accept };
    let max_jump = governed.max_jump;
    let upload = None;
    let pin = pinned(pin, &touches, &set_headers, config);
    Ok(Plan::Write(Write {
        token,
        touches,
        target,
        set_headers,
        body_limit,
        equal,
        max_jump,
        proof,
        locks,
        upload,
        pin,
    }))
}

/// How a write the protocol names as `pin` is pinned: only one that touches one key alone,
/// naming no other resource (a `Destination`), under a rule with `pin = "etag"` (the default in
/// S3 mode, where every server honours the preconditions of the operations it names). The
/// protocol names a write's pin only when its key is the resource it writes, not a scope's key
/// over many resources, each with a state of its own.
fn pinned(
    pin: Option<Pinned>,
    touches: &[Touch],
    set_headers: &[(HeaderName, HeaderValue)],
    config: &Config,
) -> Option<Pinned> {
    let [touch] = touches else { return None };
    let default = match config.backend.protocol {
        BackendProtocol::S3 => PinMode::Etag,
        BackendProtocol::Http => PinMode::Off,
    };
    let mode = rules::pin(&touch.key, &config.fence, default);
    (touch.coverage == Coverage::Key && set_headers.is_empty() && mode == PinMode::Etag).then_some(pin?)
}

/// Refuses what no request may carry: tunnels, and heads beyond the configured limits.
pub fn check_limits(head: &Head<'_>, limits: &LimitsConfig) -> Result<(), Refusal> {
    // In any spelling: a backend that reads method names without regard to case could open a
    // tunnel for `connect`.
    if head.method.as_str().eq_ignore_ascii_case("CONNECT") {
        return Err(Refusal::MethodNotAllowed(head.method.to_string()));
    }
    // The authority counts too (absolute form, HTTP/2's :authority): it becomes Host upstream.
    let authority = head.uri.authority().map_or(0, |a| a.as_str().len());
    let uri = authority + head.uri.path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri > limits.max_uri_bytes {
        return Err(Refusal::UriTooLong { size: uri, limit: limits.max_uri_bytes });
    }
    // As it was sent: request line, then "name: value\r\n" per field.
    let line = head.method.as_str().len() + uri + 12;
    let size = line + head.headers.iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum::<usize>();
    if size > limits.max_header_bytes {
        return Err(Refusal::HeadersTooLarge { size, limit: limits.max_header_bytes });
    }
    Ok(())
}

/// Refuses a fenced write that asks to switch protocols or declares a body over the limit,
/// before it can touch `max_seen`; returns the body limit to enforce while forwarding.
pub fn check_fenced(head: &Head<'_>, limits: &LimitsConfig) -> Result<Option<u64>, Refusal> {
    if let Some(upgrade) = head.headers.get(UPGRADE) {
        return Err(Refusal::UpgradeRefused(String::from_utf8_lossy(upgrade.as_bytes()).into_owned()));
    }
    let limit = (limits.max_body_bytes > 0).then_some(limits.max_body_bytes);
    if let (Some(limit), Some(declared)) = (limit, head.declared_body)
        && declared > limit
    {
        return Err(Refusal::BodyTooLarge { limit });
    }
    Ok(limit)
}
