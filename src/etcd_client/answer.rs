//! What an error answer from etcd means for the client: try another member, authenticate
//! again, or hand the caller the refusal as it is.
//!
//! etcd's messages are those of its `rpctypes` (3.4); the gateway passes them on with the gRPC
//! code: `{"error": MSG, "message": MSG, "code": N}` for a unary call, `{"error": {"grpc_code":
//! N, "message": MSG, ...}}` on a watch's stream, and a cancelled watch's `cancel_reason` reads
//! "rpc error: code = NAME desc = MSG".

use super::EtcdError;
use super::wire::{ErrorBody, WatchMessage};

/// gRPC's codes that decide something here.
const PERMISSION_DENIED: i64 = 7;
const UNAVAILABLE: i64 = 14;
const UNAUTHENTICATED: i64 = 16;

/// Answers of a member that did not take the request, which another member may serve: most
/// are gRPC's Unavailable, some not ("not leader" is FailedPrecondition, "too many requests"
/// ResourceExhausted, a dropped proposal Unknown).
const NOT_SERVED: &[&str] = &[
    "etcdserver: no leader",
    "etcdserver: not leader",
    "etcdserver: leader changed",
    "etcdserver: rpc not supported for learner",
    "etcdserver: too many requests",
    "etcdserver: unhealthy cluster",
    "etcdserver: not capable",
    "raft proposal dropped",
];

/// Answers of a member that may have taken the request and not finished it: "etcdserver:
/// request timed out" (and its variants "…, possibly due to previous leader failure", "…,
/// possibly due to connection lost"), "etcdserver: server stopped".
const UNFINISHED: &[&str] = &["etcdserver: request timed out", "etcdserver: server stopped"];

/// Answers that say the token must be renewed: expired or revoked ("invalid auth token"),
/// older than the auth store's last change (3.5's "revision of auth store is old"), or none
/// sent where one is needed now (auth was enabled since the client asked: "user name is
/// empty").
const RENEW: &[&str] =
    &["etcdserver: invalid auth token", "etcdserver: revision of auth store is old", "etcdserver: user name is empty"];

const NO_SPACE: &str = "etcdserver: mvcc: database space exceeded";
const PERMISSION: &str = "etcdserver: permission denied";
const AUTH_FAILED: &str = "etcdserver: authentication failed";
/// What etcd's gateway answers (in plain text) to every request over a client certificate that
/// has a Common Name, when it requires client certificates and has authentication on: it
/// cannot pass the name on as the user, so it will not seem to.
const COMMON_NAME: &str = "CommonName of client sending a request against gateway";
/// A read at a revision compaction removed (`mvcc: required revision has been compacted`).
const COMPACTED: &str = "required revision has been compacted";
/// What `/v3/auth/authenticate` answers where etcd has authentication off.
pub(crate) const AUTH_NOT_ENABLED: &str = "etcdserver: authentication is not enabled";

/// Why one request to one member did not give its answer, and so what the client does next.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The member never took the request (no connection, a refused TLS handshake, "no
    /// leader", a learner): try the next.
    Elsewhere(EtcdError),
    /// The member may have taken it (no answer in time, "request timed out"): try the next
    /// only if the call may be made twice.
    Unknown(EtcdError),
    /// etcd refused the token: authenticate again, then try once more.
    Token(EtcdError),
    /// The answer, an error: return it.
    Final(EtcdError),
}

impl Failure {
    /// The error, whatever the client would do next.
    pub(crate) fn into_error(self) -> EtcdError {
        match self {
            Failure::Elsewhere(e) | Failure::Unknown(e) | Failure::Token(e) | Failure::Final(e) => e,
        }
    }
}

/// The failure an error answer with HTTP `status` and `body` comes to.
pub(crate) fn of_body(endpoint: &str, call: &str, user: &str, status: u16, body: &[u8]) -> Failure {
    // Not etcd's error body (a proxy's page, a plain-text refusal): its text is the message.
    let parsed = serde_json::from_slice::<ErrorBody>(body).ok();
    let code = parsed.as_ref().and_then(|b| b.code);
    let message = parsed
        .and_then(|b| b.message.or(b.error))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim_end().to_owned());
    classify(endpoint, call, user, status, code, message)
}

/// The failure a watch's error message or cancel reason comes to.
pub(crate) fn of_watch(endpoint: &str, call: &str, user: &str, message: &WatchMessage) -> Option<Failure> {
    if let Some(error) = &message.error {
        let text = error.message.clone().unwrap_or_else(|| "an error".to_owned());
        let status = error.http_code.and_then(|s| u16::try_from(s).ok()).unwrap_or(0);
        return Some(classify(endpoint, call, user, status, error.grpc_code, text));
    }
    let result = &message.result;
    if !result.canceled {
        return None;
    }
    if result.compact_revision > 0 {
        return Some(Failure::Final(EtcdError::Compacted(result.compact_revision)));
    }
    let reason = if result.cancel_reason.is_empty() { "cancelled by etcd" } else { &result.cancel_reason };
    // "rpc error: code = Unauthenticated desc = etcdserver: invalid auth token"
    let (code, text) = match reason.split_once(" desc = ") {
        Some((head, text)) => (grpc_code(head.trim_start_matches("rpc error: code = ")), text),
        None => (None, reason),
    };
    match classify(endpoint, call, user, 0, code, text.to_owned()) {
        // A cancel for another reason ends the watch as it always has.
        Failure::Final(EtcdError::Refused { message, .. }) => Some(Failure::Final(EtcdError::WatchEnded(message))),
        other => Some(other),
    }
}

fn grpc_code(name: &str) -> Option<i64> {
    match name {
        "PermissionDenied" => Some(PERMISSION_DENIED),
        "Unavailable" => Some(UNAVAILABLE),
        "Unauthenticated" => Some(UNAUTHENTICATED),
        _ => None,
    }
}

fn classify(endpoint: &str, call: &str, user: &str, status: u16, code: Option<i64>, message: String) -> Failure {
    let (endpoint, call, user) = (endpoint.to_owned(), call.to_owned(), user.to_owned());
    let has = |list: &[&str]| list.iter().any(|m| message.contains(m));
    if message.contains(NO_SPACE) {
        return Failure::Final(EtcdError::NoSpace { endpoint, call });
    }
    if has(RENEW) || code == Some(UNAUTHENTICATED) {
        return Failure::Token(EtcdError::Unauthenticated { endpoint, user, message });
    }
    if message.contains(AUTH_FAILED) {
        return Failure::Final(EtcdError::Unauthenticated { endpoint, user, message });
    }
    if message.contains(PERMISSION) || code == Some(PERMISSION_DENIED) {
        return Failure::Final(EtcdError::PermissionDenied { endpoint, call, user });
    }
    if has(NOT_SERVED) {
        return Failure::Elsewhere(EtcdError::Unavailable { endpoint, call, message });
    }
    // Any other Unavailable (the gateway's own connection to the member breaking, say) may
    // come after the member took the request.
    if has(UNFINISHED) || code == Some(UNAVAILABLE) {
        return Failure::Unknown(EtcdError::Unavailable { endpoint, call, message });
    }
    if message.contains(COMPACTED) {
        return Failure::Final(EtcdError::RevisionCompacted);
    }
    if message.contains(COMMON_NAME) {
        let message = format!("{message}: give the client a certificate without a Common Name");
        return Failure::Final(EtcdError::Refused { endpoint, call, status, message });
    }
    Failure::Final(EtcdError::Refused { endpoint, call, status, message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn unary(code: i64, message: &str) -> Failure {
        let body = json!({ "error": message, "message": message, "code": code }).to_string();
        of_body("http://m", "/v3/kv/put", "u", 503, body.as_bytes())
    }

    #[test]
    fn a_read_at_a_compacted_revision_says_so() {
        let failure = unary(11, "etcdserver: mvcc: required revision has been compacted");
        assert!(matches!(failure, Failure::Final(EtcdError::RevisionCompacted)));
    }

    #[test]
    fn answers_of_a_member_that_cannot_serve_go_elsewhere_or_are_unknown() {
        for (code, message) in [
            (14, "etcdserver: no leader"),
            (14, "etcdserver: leader changed"),
            (14, "etcdserver: rpc not supported for learner"),
            (9, "etcdserver: not leader"),
            (8, "etcdserver: too many requests"),
            (2, "raft proposal dropped"),
        ] {
            assert!(matches!(unary(code, message), Failure::Elsewhere(EtcdError::Unavailable { .. })), "{message}");
        }
        for message in [
            "etcdserver: request timed out",
            "etcdserver: request timed out, possibly due to previous leader failure",
            "etcdserver: request timed out, possibly due to connection lost",
            "etcdserver: server stopped",
            "grpc: the client connection is closing",
        ] {
            assert!(matches!(unary(14, message), Failure::Unknown(EtcdError::Unavailable { .. })), "{message}");
        }
    }

    #[test]
    fn refusals_are_returned_as_they_are() {
        let no_space = unary(8, "etcdserver: mvcc: database space exceeded");
        assert!(matches!(no_space, Failure::Final(EtcdError::NoSpace { .. })), "{no_space:?}");
        let denied = unary(7, "etcdserver: permission denied");
        assert!(matches!(denied, Failure::Final(EtcdError::PermissionDenied { ref user, .. }) if user == "u"));
        let failed = unary(3, "etcdserver: authentication failed, invalid user ID or password");
        assert!(matches!(failed, Failure::Final(EtcdError::Unauthenticated { .. })), "{failed:?}");
        let other = unary(3, "etcdserver: key is not provided");
        assert!(matches!(other, Failure::Final(EtcdError::Refused { status: 503, .. })), "{other:?}");
        let text = of_body("http://m", "/v3/kv/put", "", 502, b"Bad Gateway");
        assert!(matches!(text, Failure::Final(EtcdError::Refused { ref message, .. }) if message == "Bad Gateway"));
    }

    #[test]
    fn token_refusals_renew_in_calls_and_watches() {
        for (code, message) in [
            (16, "etcdserver: invalid auth token"),
            (3, "etcdserver: user name is empty"),
            (3, "etcdserver: revision of auth store is old"),
        ] {
            assert!(matches!(unary(code, message), Failure::Token(EtcdError::Unauthenticated { .. })), "{message}");
        }
        let cancelled =
            |reason: &str| json!({ "result": { "created": true, "canceled": true, "cancel_reason": reason } });
        let watch = |m: &Value| {
            let message: WatchMessage = serde_json::from_value(m.clone()).unwrap();
            of_watch("http://m", "/v3/watch", "u", &message)
        };
        let token = cancelled("rpc error: code = Unauthenticated desc = etcdserver: invalid auth token");
        assert!(matches!(watch(&token), Some(Failure::Token(_))));
        let denied = cancelled("rpc error: code = PermissionDenied desc = etcdserver: permission denied");
        assert!(matches!(watch(&denied), Some(Failure::Final(EtcdError::PermissionDenied { .. }))));
        let learner = json!({ "error": { "grpc_code": 14, "http_code": 503,
            "message": "etcdserver: rpc not supported for learner", "http_status": "Service Unavailable" } });
        assert!(matches!(watch(&learner), Some(Failure::Elsewhere(_))));
        let compacted = json!({ "result": { "canceled": true, "compact_revision": "9" } });
        assert!(matches!(watch(&compacted), Some(Failure::Final(EtcdError::Compacted(9)))));
        let other = cancelled("some other reason");
        assert!(
            matches!(watch(&other), Some(Failure::Final(EtcdError::WatchEnded(ref m))) if m == "some other reason")
        );
        assert!(watch(&json!({ "result": { "created": true } })).is_none());
    }
}
