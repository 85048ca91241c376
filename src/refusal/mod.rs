//! Every answer fencegate makes itself, and its one mapping to HTTP.
//!
//! A [`Refusal`] is why a request (to the proxy or to the admin API) was not served as asked.
//! [`Refusal::response`] is the only place such an answer is built: a JSON body whose `error`
//! field is a stable code, and the same code in the `fencegate-error` header so clients can
//! tell it apart from a backend's answer. The modules below keep their own error types; this
//! is where they meet HTTP.

use bytes::Bytes;
use http::header::{ALLOW, CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};

use crate::fence::FenceError;
use crate::fence::guesses::LimitedBy;
use crate::fence::lock_names::LockError;
use crate::fence::path::PathError;
use crate::fence::signature::{Rejected, SignatureError};
use crate::fence::token::TokenError;
use crate::store::StoreError;
use crate::upstream::UpstreamError;

/// Header naming the reason on every response fencegate makes itself.
pub const ERROR_HEADER: &str = "fencegate-error";
/// [`ERROR_HEADER`] as a header name, made once.
pub static ERROR_NAME: HeaderName = HeaderName::from_static(ERROR_HEADER);

/// Why fencegate answered a request itself.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// A fenced write without the token header.
    #[error("this method is fenced: send the lock's fencing token in the {header} header")]
    MissingToken {
        /// The configured header name.
        header: String,
    },
    /// The token header is present but not exactly one u64 in decimal.
    #[error("invalid fencing token: {0}")]
    InvalidToken(TokenError),
    /// The request target cannot be mapped to exactly one resource.
    #[error("invalid path: {0}")]
    InvalidPath(PathError),
    /// CONNECT: fencegate is a reverse proxy, not a tunnel.
    #[error("{0} is not supported by this proxy")]
    MethodNotAllowed(String),
    /// A header fencegate reads is repeated or unreadable, so the backend's reading of it is
    /// unknowable.
    #[error("invalid {name} header: {reason}")]
    InvalidHeader {
        /// The header.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A write that changes keys whose tokens come from different counters.
    #[error("this write cannot be fenced: {0}")]
    CrossDomain(String),
    /// A write that changes keys under different `verify` settings.
    #[error("this write cannot be verified: {0}")]
    CrossVerify(String),
    /// A fenced write under `verify = "hmac"` without the signature header.
    #[error("tokens here must be signed: send the token's signature in the {header} header (docs/tokens.md)")]
    MissingSignature {
        /// The configured header name.
        header: String,
    },
    /// The signature header is repeated or not `v1.<kid>.<expiry>.<mac>`.
    #[error("invalid token signature: {0}")]
    InvalidSignature(SignatureError),
    /// A well-formed signature that does not prove the token: an unknown key, a MAC that does
    /// not match, or an expiry past the clock skew.
    #[error("token signature rejected: {reason}")]
    SignatureRejected {
        /// The first fence key the write touches.
        resource: String,
        /// Why.
        reason: Rejected,
    },
    /// A fenced write asked to switch protocols: the fence could not follow what comes next.
    #[error("fenced writes cannot upgrade the connection (Upgrade: {0})")]
    UpgradeRefused(String),
    /// The request line and headers are larger than `limits.max_header_bytes`.
    #[error("request headers of {size} bytes exceed the limit of {limit}")]
    HeadersTooLarge {
        /// Bytes sent.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The request target is longer than `limits.max_uri_bytes`.
    #[error("request target of {size} bytes exceeds the limit of {limit}")]
    UriTooLong {
        /// Bytes sent.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A fenced write's declared body is larger than `limits.max_body_bytes`.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: u64,
    },
    /// An admin change, or a read of what a verified write could use, without the right
    /// bearer token.
    #[error(
        "admin changes need `Authorization: Bearer <token>` with admin.token; reads of verified keys' levels and \
        of lock holders take admin.token or admin.read_token"
    )]
    Unauthorized,
    /// Admin writes are off because no admin token is configured.
    #[error("admin writes are disabled: set admin.token_file or FENCEGATE_ADMIN__TOKEN")]
    AdminWritesDisabled,
    /// Reads that disclose what a verified write could use are off: no token is configured.
    #[error(
        "reads of verified keys' levels and of lock holders are disabled: set admin.read_token_file (or \
        admin.token_file)"
    )]
    AdminReadsDisabled,
    /// An admin read or change of the fence on an instance that does not lead the shared fence.
    #[error("this instance does not lead the shared fence; {leader} does: ask its admin API")]
    NotLeader {
        /// The leader's advertised URL.
        leader: String,
    },
    /// Writes verified against an etcd lock were refused too often from this client, or for
    /// this lock: guessing the holder's revision is slowed down.
    #[error("too many refused proofs {}; try again in {retry_after:?}", whose(*.by, .lock))]
    TooManyRefusals {
        /// Whose refusals.
        by: LimitedBy,
        /// The lock the write's token must be the holder's of.
        lock: String,
        /// When one more proof will be checked.
        retry_after: std::time::Duration,
    },
    /// A method an admin endpoint does not serve.
    #[error("{method} is not served at {path}; allowed: {allow}")]
    WrongMethod {
        /// The method asked for.
        method: String,
        /// The endpoint.
        path: String,
        /// The methods it serves, as the `Allow` header lists them.
        allow: &'static str,
    },
    /// No such admin endpoint, or no such resource.
    #[error("{0} not found")]
    NotFound(String),
    /// A request that cannot be understood or served as asked.
    #[error("invalid request: {0}")]
    BadRequest(String),
    /// A write fencegate cannot fence where it runs (Envoy's external processor, when Envoy
    /// streams a body that names the request's resources): refused, never passed unfenced.
    #[error("{0}")]
    NotImplemented(String),
    /// The fence refused the write (stale token, busy or quarantined resource).
    #[error(transparent)]
    Fence(FenceError),
    /// The durable store cannot record an advance; nothing is forwarded without durability.
    #[error("the fence store did not record the advance, so the write was not forwarded: {0}")]
    Store(StoreError),
    /// The backend could not be reached, failed, or did not answer in time.
    #[error(transparent)]
    Upstream(UpstreamError),
    /// The token is not the holder's of the etcd lock that guards the key, or that cannot be
    /// told now.
    #[error(transparent)]
    Lock(LockError),
    /// A pinned write (docs/pins.md) whose key's state at the backend could not be learnt:
    /// nothing was advanced or sent.
    #[error("{resource} cannot be pinned at this moment, so the write was not sent: {why}")]
    PinUnavailable {
        /// The write's key.
        resource: String,
        /// What the backend answered.
        why: String,
    },
    /// The request's own `If-Match` or `If-None-Match` does not hold for the state fencegate
    /// learnt of the key: nothing was advanced or sent.
    #[error(
        "precondition failed: the request's {header} does not hold for {resource}, which is {state} at the backend"
    )]
    PreconditionFailed {
        /// The write's key.
        resource: String,
        /// The header that does not hold.
        header: &'static str,
        /// The key's state, as fencegate learnt it.
        state: String,
    },
    /// The backend refused a pinned write's precondition: its state of the key is not the one
    /// the write was ordered after.
    #[error(
        "the backend's state of {resource} is not the one this write was ordered after ({sent}): a write that \
        bypassed the fence, or a late one, changed it. The backend applied nothing; the token is used up"
    )]
    BackendMoved {
        /// The write's key.
        resource: String,
        /// The precondition the write was sent with.
        sent: String,
    },
}

// Written out rather than `#[from]`: the message already includes the cause, and a `source`
// would make error-chain printers say it twice.
impl From<TokenError> for Refusal {
    fn from(e: TokenError) -> Self {
        Refusal::InvalidToken(e)
    }
}

impl From<PathError> for Refusal {
    fn from(e: PathError) -> Self {
        Refusal::InvalidPath(e)
    }
}

impl From<FenceError> for Refusal {
    fn from(e: FenceError) -> Self {
        Refusal::Fence(e)
    }
}

impl From<StoreError> for Refusal {
    fn from(e: StoreError) -> Self {
        Refusal::Store(e)
    }
}

impl From<UpstreamError> for Refusal {
    fn from(e: UpstreamError) -> Self {
        Refusal::Upstream(e)
    }
}

/// Whose refusals hold a write back, as a refusal says it.
fn whose(by: LimitedBy, lock: &str) -> String {
    match by {
        LimitedBy::Client => "from this client".to_owned(),
        LimitedBy::Key => format!("for the lock {lock}"),
    }
}

/// A JSON response made by fencegate itself, for answers that are not refusals (health, the
/// fences API).
pub(crate) fn json_response(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

impl Refusal {
    /// The status fencegate answers with, and the stable code of the answer.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            Refusal::MissingToken { .. } => (S::PRECONDITION_REQUIRED, "missing_token"),
            Refusal::InvalidToken(_) => (S::BAD_REQUEST, "invalid_token"),
            Refusal::InvalidPath(_) => (S::BAD_REQUEST, "invalid_path"),
            Refusal::MethodNotAllowed(_) => (S::METHOD_NOT_ALLOWED, "method_not_allowed"),
            Refusal::InvalidHeader { .. } => (S::BAD_REQUEST, "invalid_header"),
            Refusal::UpgradeRefused(_) => (S::BAD_REQUEST, "upgrade_refused"),
            Refusal::CrossDomain(_) => (S::BAD_REQUEST, "cross_domain_write"),
            Refusal::CrossVerify(_) => (S::BAD_REQUEST, "cross_verify_write"),
            Refusal::MissingSignature { .. } => (S::PRECONDITION_REQUIRED, "missing_signature"),
            Refusal::InvalidSignature(_) => (S::BAD_REQUEST, "invalid_signature"),
            Refusal::SignatureRejected { .. } => (S::FORBIDDEN, "signature_rejected"),
            Refusal::HeadersTooLarge { .. } => (S::REQUEST_HEADER_FIELDS_TOO_LARGE, "headers_too_large"),
            Refusal::UriTooLong { .. } => (S::URI_TOO_LONG, "uri_too_long"),
            Refusal::BodyTooLarge { .. } | Refusal::Upstream(UpstreamError::BodyTooLarge { .. }) => {
                (S::PAYLOAD_TOO_LARGE, "body_too_large")
            }
            Refusal::Unauthorized => (S::UNAUTHORIZED, "unauthorized"),
            Refusal::AdminWritesDisabled => (S::FORBIDDEN, "admin_writes_disabled"),
            Refusal::AdminReadsDisabled => (S::FORBIDDEN, "admin_reads_disabled"),
            Refusal::NotLeader { .. } => (S::MISDIRECTED_REQUEST, "not_leader"),
            Refusal::TooManyRefusals { .. } => (S::TOO_MANY_REQUESTS, "too_many_refusals"),
            Refusal::NotFound(_) => (S::NOT_FOUND, "not_found"),
            Refusal::BadRequest(_) => (S::BAD_REQUEST, "invalid_request"),
            Refusal::NotImplemented(_) => (S::NOT_IMPLEMENTED, "not_implemented"),
            Refusal::Fence(FenceError::Stale { .. }) => (S::CONFLICT, "stale_token"),
            Refusal::Fence(FenceError::Jump { .. }) => (S::CONFLICT, "token_jump"),
            Refusal::Fence(FenceError::WouldLower { .. }) => (S::CONFLICT, "would_lower"),
            Refusal::Fence(FenceError::WouldRaise { .. }) => (S::CONFLICT, "would_raise"),
            Refusal::Fence(FenceError::NoFence { .. }) => (S::NOT_FOUND, "not_found"),
            Refusal::WrongMethod { .. } => (S::METHOD_NOT_ALLOWED, "method_not_allowed"),
            Refusal::Fence(FenceError::QueueTimeout { .. }) => (S::SERVICE_UNAVAILABLE, "queue_timeout"),
            Refusal::Fence(FenceError::Quarantined { .. }) => (S::SERVICE_UNAVAILABLE, "resource_quarantined"),
            Refusal::Fence(FenceError::TaskFailed(_)) => (S::INTERNAL_SERVER_ERROR, "internal"),
            Refusal::Fence(FenceError::UnknownUpload { .. }) => (S::NOT_FOUND, "no_such_upload"),
            Refusal::Fence(FenceError::UploadToken { .. }) => (S::CONFLICT, "upload_token"),
            Refusal::Store(StoreError::Full(_) | StoreError::FullBytes(_))
            | Refusal::Fence(FenceError::Full { .. }) => (S::SERVICE_UNAVAILABLE, "resource_limit"),
            Refusal::Store(StoreError::NoSpace(_)) => (S::SERVICE_UNAVAILABLE, "store_full"),
            Refusal::Store(_) => (S::SERVICE_UNAVAILABLE, "store_unavailable"),
            Refusal::Upstream(UpstreamError::Withdrawn(_) | UpstreamError::NoLeader(_)) => {
                (S::SERVICE_UNAVAILABLE, "store_unavailable")
            }
            Refusal::Upstream(UpstreamError::Unreachable(_)) => (S::BAD_GATEWAY, "backend_unreachable"),
            Refusal::Upstream(UpstreamError::Busy(_)) => (S::SERVICE_UNAVAILABLE, "backend_busy"),
            Refusal::Upstream(UpstreamError::Failed(_)) => (S::BAD_GATEWAY, "backend_error"),
            Refusal::Upstream(UpstreamError::Timeout(_)) => (S::GATEWAY_TIMEOUT, "backend_timeout"),
            Refusal::Lock(LockError::NotHolder { .. }) => (S::CONFLICT, "not_lock_holder"),
            Refusal::Lock(LockError::Unavailable { .. }) => (S::SERVICE_UNAVAILABLE, "verify_unavailable"),
            Refusal::Lock(LockError::NoLockName { .. }) => (S::BAD_REQUEST, "no_lock_name"),
            Refusal::PinUnavailable { .. } => (S::SERVICE_UNAVAILABLE, "pin_unavailable"),
            Refusal::PreconditionFailed { .. } => (S::PRECONDITION_FAILED, "precondition_failed"),
            Refusal::BackendMoved { .. } => (S::PRECONDITION_FAILED, "backend_moved"),
        }
    }

    /// The status fencegate answers with.
    pub fn status(&self) -> StatusCode {
        self.status_and_code().0
    }

    /// The stable machine-readable code: the `error` field and the `fencegate-error` header.
    pub fn code(&self) -> &'static str {
        self.status_and_code().1
    }

    /// The resource a refusal is about, if it is about one.
    pub fn resource(&self) -> Option<&str> {
        match self {
            Refusal::Fence(
                FenceError::Stale { resource, .. }
                | FenceError::Jump { resource, .. }
                | FenceError::QueueTimeout { resource, .. }
                | FenceError::Quarantined { resource, .. }
                | FenceError::WouldLower { resource, .. }
                | FenceError::WouldRaise { resource, .. }
                | FenceError::NoFence { resource }
                | FenceError::UnknownUpload { object: resource, .. }
                | FenceError::UploadToken { object: resource, .. },
            ) => Some(resource),
            Refusal::SignatureRejected { resource, .. } | Refusal::TooManyRefusals { lock: resource, .. } => {
                Some(resource)
            }
            Refusal::PinUnavailable { resource, .. }
            | Refusal::PreconditionFailed { resource, .. }
            | Refusal::BackendMoved { resource, .. } => Some(resource),
            _ => None,
        }
    }

    /// The JSON body; with `withhold`, without the levels a refusal would name (`max_seen`, a
    /// token domain's highest token), which may be the token that passes a key verified against
    /// etcd.
    fn body(&self, withhold: bool) -> Value {
        if let (true, Some(body)) = (withhold, self.withheld_body()) {
            return body;
        }
        let mut body = json!({ "error": self.code(), "message": self.to_string() });
        let extra = match self {
            Refusal::Fence(FenceError::Stale { resource, token, max_seen, floor: None }) => {
                json!({ "resource": resource, "token": token, "max_seen": max_seen })
            }
            // `max_seen` stays the level to be above, for clients that read it.
            Refusal::Fence(FenceError::Stale { resource, token, max_seen, floor: Some(floor) }) => {
                json!({ "resource": resource, "token": token, "max_seen": max_seen, "floor": floor, "level": max_seen })
            }
            Refusal::Fence(FenceError::Jump { resource, token, base, max_jump, domain: None }) => {
                json!({ "resource": resource, "token": token, "max_seen": base, "max_jump": max_jump })
            }
            Refusal::Fence(FenceError::Jump { resource, token, base, max_jump, domain: Some(domain) }) => {
                json!({ "resource": resource, "token": token, "token_domain": domain, "domain_max": base, "max_jump": max_jump })
            }
            Refusal::SignatureRejected { resource, reason } => {
                let mut extra = json!({ "resource": resource, "reason": reason.reason(), "kid": reason.kid() });
                if let (Rejected::Expired { expiry, now, skew, .. }, Some(fields)) = (reason, extra.as_object_mut()) {
                    fields.extend([
                        ("expiry".to_owned(), json!(expiry)),
                        ("now".to_owned(), json!(now)),
                        ("clock_skew_s".to_owned(), json!(skew)),
                    ]);
                }
                extra
            }
            Refusal::Fence(FenceError::QueueTimeout { resource, .. }) => json!({ "resource": resource }),
            Refusal::Fence(
                FenceError::WouldLower { resource, max_seen, to } | FenceError::WouldRaise { resource, max_seen, to },
            ) => json!({ "resource": resource, "max_seen": max_seen, "to": to }),
            Refusal::Fence(FenceError::NoFence { resource }) => json!({ "resource": resource }),
            Refusal::NotLeader { leader } => json!({ "leader": leader }),
            Refusal::TooManyRefusals { lock, retry_after, .. } => {
                json!({ "lock": lock, "retry_after_ms": retry_after.as_millis() as u64 })
            }
            Refusal::Fence(FenceError::Quarantined { resource, retry_after, .. }) => {
                json!({ "resource": resource, "retry_after_ms": retry_after.as_millis() as u64 })
            }
            // Never the holder's revision: it is the token that passes.
            Refusal::Lock(LockError::NotHolder { lock, token, .. }) => json!({ "lock": lock, "token": token }),
            Refusal::Lock(LockError::Unavailable { lock, .. }) => json!({ "lock": lock }),
            Refusal::PinUnavailable { resource, .. } | Refusal::PreconditionFailed { resource, .. } => {
                json!({ "resource": resource })
            }
            Refusal::BackendMoved { resource, sent } => json!({ "resource": resource, "sent": sent }),
            _ => return body,
        };
        if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
            body.extend(extra);
        }
        body
    }

    /// The body of a refusal that names a level, without it; `None` for one that names none.
    fn withheld_body(&self) -> Option<Value> {
        const WHY: &str = "the level is withheld: its token domain is verified against etcd";
        let (resource, token, message) = match self {
            Refusal::Fence(FenceError::Stale { resource, token, floor: None, .. }) => {
                (resource, token, format!("token {token} is stale: {resource} has accepted it or a higher one ({WHY})"))
            }
            Refusal::Fence(FenceError::Stale { resource, token, floor: Some(floor), .. }) => {
                let message = format!(
                    "token {token} is stale: {resource} lies under the floor {floor}, which is at it or higher ({WHY})"
                );
                let body = json!({ "error": self.code(), "message": message, "resource": resource, "token": token,
                    "floor": floor, "withheld": true });
                return Some(body);
            }
            Refusal::Fence(FenceError::Jump { resource, token, max_jump, .. }) => (
                resource,
                token,
                format!(
                    "token {token} is more than max_jump {max_jump} above what {resource} or its token domain has \
                    accepted ({WHY})"
                ),
            ),
            _ => return None,
        };
        Some(
            json!({ "error": self.code(), "message": message, "resource": resource, "token": token, "withheld": true }),
        )
    }

    /// Whether the answer names a level, which [`Refusal::response_withholding_levels`] leaves
    /// out.
    pub fn names_a_level(&self) -> bool {
        matches!(self, Refusal::Fence(FenceError::Stale { .. } | FenceError::Jump { .. }))
    }

    /// The complete response: status, JSON body, `fencegate-error`, and `Retry-After` where useful.
    pub fn response(&self) -> Response<Full<Bytes>> {
        self.respond(false)
    }

    /// The response without the levels it would name: for a key whose level is kept from
    /// clients (`FenceConfig::withholds`).
    pub fn response_withholding_levels(&self) -> Response<Full<Bytes>> {
        self.respond(true)
    }

    /// What the answer says, in words; with `withhold`, without the levels it would name.
    pub fn message(&self, withhold: bool) -> String {
        match (withhold, self.withheld_body()) {
            (true, Some(body)) => body.get("message").and_then(Value::as_str).unwrap_or_default().to_owned(),
            _ => self.to_string(),
        }
    }

    fn respond(&self, withhold: bool) -> Response<Full<Bytes>> {
        self.response_with(Bytes::from(self.body(withhold).to_string()), "application/json")
    }

    /// The answer with `body`, of `content_type`, written in a protocol's own form: the status,
    /// `fencegate-error` and the other headers are the refusal's, whatever the form.
    pub fn response_with(&self, body: Bytes, content_type: &'static str) -> Response<Full<Bytes>> {
        let mut resp = Response::new(Full::new(body));
        *resp.status_mut() = self.status();
        let headers = resp.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers.insert(ERROR_NAME.clone(), HeaderValue::from_static(self.code()));
        let retry = match self {
            Refusal::Fence(FenceError::Quarantined { retry_after, .. })
            | Refusal::TooManyRefusals { retry_after, .. } => Some(retry_after.as_secs_f64().ceil().max(1.0) as u64),
            // Not for a failed store: it stays failed until restart. A full disk may get room.
            Refusal::Fence(FenceError::QueueTimeout { .. })
            | Refusal::Upstream(UpstreamError::Busy(_))
            | Refusal::Lock(LockError::Unavailable { .. })
            | Refusal::Store(StoreError::Unavailable(_))
            | Refusal::Upstream(UpstreamError::Withdrawn(_) | UpstreamError::NoLeader(_))
            | Refusal::PinUnavailable { .. } => Some(1),
            Refusal::Store(StoreError::NoSpace(_) | StoreError::RoomFailed(_)) => Some(5),
            _ => None,
        };
        if let Some(secs) = retry {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self, Refusal::Unauthorized) {
            headers.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Refusal::WrongMethod { allow, .. } = self {
            headers.insert(ALLOW, HeaderValue::from_static(allow));
        }
        resp
    }
}

pub(crate) mod throttle;

#[cfg(test)]
mod tests;
