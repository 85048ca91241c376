//! The one error type, and its one mapping to HTTP responses.
//!
//! Every response fencegate makes itself (rather than relays from the backend) comes from
//! [`Error::response`]: a JSON body whose `error` field is a stable code, and the same code in
//! the `fencegate-error` header so clients can tell it apart from a backend's answer.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};

use crate::config::ConfigError;
use crate::fence::path::PathError;
use crate::fence::token::TokenError;
use crate::store::StoreError;

/// Header naming the reason on every response fencegate makes itself.
pub const ERROR_HEADER: &str = "fencegate-error";

/// Everything that can go wrong, at start-up or while handling a request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
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
    /// A fenced write's body is larger than `limits.max_body_bytes`.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: u64,
    },
    /// An admin write without the right bearer token.
    #[error("admin writes need `Authorization: Bearer <token>` with the configured token")]
    Unauthorized,
    /// Admin writes are off because no admin token is configured.
    #[error("admin writes are disabled: set admin.token_file or FENCEGATE_ADMIN__TOKEN")]
    AdminWritesDisabled,
    /// No such admin endpoint, or no such resource.
    #[error("{0} not found")]
    NotFound(String),
    /// An admin request that cannot be understood.
    #[error("invalid request: {0}")]
    BadRequest(String),
    /// An operator asked to lower `max_seen`, which never happens.
    #[error("max_seen of {resource} is {max_seen}; it is never lowered to {to}")]
    WouldLower {
        /// The fence key.
        resource: String,
        /// Its current `max_seen`.
        max_seen: u64,
        /// The value asked for.
        to: u64,
    },
    /// The token is not above the highest one this resource has accepted.
    #[error("token {token} is stale: {resource} has already accepted {max_seen}")]
    StaleToken {
        /// The fence key.
        resource: String,
        /// The token the request carried.
        token: u64,
        /// The resource's `max_seen`.
        max_seen: u64,
    },
    /// The write waited too long behind earlier writes to the same resource.
    #[error("{resource} is busy: earlier writes were still in flight after {waited:?}")]
    QueueTimeout {
        /// The fence key.
        resource: String,
        /// How long the request waited.
        waited: Duration,
    },
    /// An earlier write's outcome is unknown, so the resource is closed for a while.
    #[error("{resource} is closed because an earlier write timed out and may still be applied")]
    Quarantined {
        /// The fence key.
        resource: String,
        /// Time until the resource reopens.
        retry_after: Duration,
    },
    /// The durable store cannot record an advance; nothing is forwarded without durability.
    #[error("the fence store is unavailable: {0}")]
    Store(StoreError),
    /// No connection to the backend could be made; the request was not sent.
    #[error("backend unreachable: {0}")]
    BackendUnreachable(String),
    /// The backend connection failed after the request may have been sent.
    #[error("backend failed: {0}")]
    BackendFailed(String),
    /// The backend did not answer within the request timeout.
    #[error("backend did not answer within {0:?}")]
    BackendTimeout(Duration),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An I/O error outside the store, such as binding the listener.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

// Written out rather than `#[from]`: the message already includes the cause, and a `source`
// would make error-chain printers (anyhow's `{:#}`) say it twice.
impl From<TokenError> for Error {
    fn from(e: TokenError) -> Self {
        Error::InvalidToken(e)
    }
}

impl From<PathError> for Error {
    fn from(e: PathError) -> Self {
        Error::InvalidPath(e)
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Store(e)
    }
}

/// A JSON response made by fencegate itself.
pub(crate) fn json_response(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

impl Error {
    /// The status fencegate answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::MissingToken { .. } => StatusCode::PRECONDITION_REQUIRED,
            Error::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Error::Unauthorized => StatusCode::UNAUTHORIZED,
            Error::AdminWritesDisabled => StatusCode::FORBIDDEN,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::BadRequest(_) => StatusCode::BAD_REQUEST,
            Error::WouldLower { .. } => StatusCode::CONFLICT,
            Error::UpgradeRefused(_) => StatusCode::BAD_REQUEST,
            Error::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Error::UriTooLong { .. } => StatusCode::URI_TOO_LONG,
            Error::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Error::InvalidToken(_) | Error::InvalidPath(_) => StatusCode::BAD_REQUEST,
            Error::StaleToken { .. } => StatusCode::CONFLICT,
            Error::QueueTimeout { .. } | Error::Quarantined { .. } | Error::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::BackendUnreachable(_) | Error::BackendFailed(_) => StatusCode::BAD_GATEWAY,
            Error::BackendTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Error::Config(_) | Error::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable machine-readable code: the `error` field and the `fencegate-error` header.
    pub fn code(&self) -> &'static str {
        match self {
            Error::MissingToken { .. } => "missing_token",
            Error::MethodNotAllowed(_) => "method_not_allowed",
            Error::Unauthorized => "unauthorized",
            Error::AdminWritesDisabled => "admin_writes_disabled",
            Error::NotFound(_) => "not_found",
            Error::BadRequest(_) => "invalid_request",
            Error::WouldLower { .. } => "would_lower",
            Error::UpgradeRefused(_) => "upgrade_refused",
            Error::HeadersTooLarge { .. } => "headers_too_large",
            Error::UriTooLong { .. } => "uri_too_long",
            Error::BodyTooLarge { .. } => "body_too_large",
            Error::InvalidToken(_) => "invalid_token",
            Error::InvalidPath(_) => "invalid_path",
            Error::StaleToken { .. } => "stale_token",
            Error::QueueTimeout { .. } => "queue_timeout",
            Error::Quarantined { .. } => "resource_quarantined",
            Error::Store(StoreError::Full(_)) => "resource_limit",
            Error::Store(_) => "store_unavailable",
            Error::BackendUnreachable(_) => "backend_unreachable",
            Error::BackendFailed(_) => "backend_error",
            Error::BackendTimeout(_) => "backend_timeout",
            Error::Config(_) | Error::Io(_) => "internal",
        }
    }

    fn body(&self) -> Value {
        let mut body = json!({ "error": self.code(), "message": self.to_string() });
        let extra = match self {
            Error::StaleToken { resource, token, max_seen } => {
                json!({ "resource": resource, "token": token, "max_seen": max_seen })
            }
            Error::QueueTimeout { resource, .. } => json!({ "resource": resource }),
            Error::WouldLower { resource, max_seen, to } => {
                json!({ "resource": resource, "max_seen": max_seen, "to": to })
            }
            Error::Quarantined { resource, retry_after } => {
                json!({ "resource": resource, "retry_after_ms": retry_after.as_millis() as u64 })
            }
            _ => return body,
        };
        if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
            body.extend(extra);
        }
        body
    }

    /// The complete response: status, JSON body, `fencegate-error`, and `Retry-After` where useful.
    pub fn response(&self) -> Response<Full<Bytes>> {
        let mut resp = json_response(self.status(), &self.body());
        let headers = resp.headers_mut();
        headers.insert(ERROR_HEADER, HeaderValue::from_static(self.code()));
        let retry = match self {
            Error::Quarantined { retry_after, .. } => Some(retry_after.as_secs_f64().ceil().max(1.0) as u64),
            // Not for Store: a failed store stays failed until restart.
            Error::QueueTimeout { .. } => Some(1),
            _ => None,
        };
        if let Some(secs) = retry {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self, Error::Unauthorized) {
            headers.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn examples() -> Vec<(Error, u16, &'static str)> {
        let d = Duration::from_secs(3);
        vec![
            (Error::MissingToken { header: "fencing-token".into() }, 428, "missing_token"),
            (Error::MethodNotAllowed("CONNECT".into()), 405, "method_not_allowed"),
            (Error::Unauthorized, 401, "unauthorized"),
            (Error::AdminWritesDisabled, 403, "admin_writes_disabled"),
            (Error::NotFound("/x".into()), 404, "not_found"),
            (Error::BadRequest("x".into()), 400, "invalid_request"),
            (Error::WouldLower { resource: "/a".into(), max_seen: 5, to: 4 }, 409, "would_lower"),
            (Error::UpgradeRefused("websocket".into()), 400, "upgrade_refused"),
            (Error::HeadersTooLarge { size: 9, limit: 8 }, 431, "headers_too_large"),
            (Error::UriTooLong { size: 9, limit: 8 }, 414, "uri_too_long"),
            (Error::BodyTooLarge { limit: 8 }, 413, "body_too_large"),
            (Error::InvalidToken(TokenError::NotDecimal), 400, "invalid_token"),
            (Error::InvalidPath(PathError::EscapedSlash), 400, "invalid_path"),
            (Error::StaleToken { resource: "/a".into(), token: 33, max_seen: 34 }, 409, "stale_token"),
            (Error::QueueTimeout { resource: "/a".into(), waited: d }, 503, "queue_timeout"),
            (Error::Quarantined { resource: "/a".into(), retry_after: d }, 503, "resource_quarantined"),
            (Error::Store(StoreError::Failed("fsync: EIO".into())), 503, "store_unavailable"),
            (Error::Store(StoreError::Full(10)), 503, "resource_limit"),
            (Error::BackendUnreachable("refused".into()), 502, "backend_unreachable"),
            (Error::BackendFailed("reset".into()), 502, "backend_error"),
            (Error::BackendTimeout(d), 504, "backend_timeout"),
            (Error::Io(std::io::Error::other("x")), 500, "internal"),
        ]
    }

    #[tokio::test]
    async fn status_and_code_mapping_is_pinned() {
        for (err, status, code) in examples() {
            let resp = err.response();
            assert_eq!(resp.status().as_u16(), status, "{err:?}");
            assert_eq!(resp.headers()[ERROR_HEADER], code);
            assert_eq!(resp.headers()[CONTENT_TYPE], "application/json");
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["error"], code);
            assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
    }

    #[tokio::test]
    async fn stale_body_names_resource_token_and_max_seen() {
        let err = Error::StaleToken { resource: "/accounts/42".into(), token: 33, max_seen: 34 };
        let body = err.response().into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["resource"], "/accounts/42");
        assert_eq!(v["token"], 33);
        assert_eq!(v["max_seen"], 34);
    }
}
