//! What an error answer from etcd means for the client: try another member, authenticate
//! again, or hand the caller the refusal as it is.
//!
//! etcd's messages are those of its `rpctypes` (3.4), sent as a gRPC status (code and message);
//! a cancelled watch's `cancel_reason` reads "rpc error: code = NAME desc = MSG". A status
//! with a source error is the transport's, not an answer of etcd's: the connection failed.

use std::error::Error as _;

use tonic::Status;

use super::EtcdError;
use super::transport::chain;
use super::wire::WatchResponse;

/// gRPC's codes that decide something here.
const UNKNOWN: i64 = 2;
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
/// A read at a revision compaction removed (`mvcc: required revision has been compacted`).
const COMPACTED: &str = "required revision has been compacted";
/// What `Authenticate` answers where etcd has authentication off.
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

/// The failure a call's error status comes to.
pub(crate) fn of_status(endpoint: &str, call: &str, user: &str, status: &Status) -> Failure {
    if let Some(source) = status.source() {
        let error = EtcdError::Unreachable { endpoint: endpoint.to_owned(), reason: chain(source) };
        // A connection never made sent nothing; any other failure may have come after etcd
        // took the request.
        return match connect_failed(source) {
            true => Failure::Elsewhere(error),
            false => Failure::Unknown(error),
        };
    }
    classify(endpoint, call, user, status.code() as i64, status.message().to_owned())
}

/// Whether the client's connection to the member was never made (no TCP connection, a
/// refused TLS handshake): hyper-util's error says so, wherever in the chain it is.
fn connect_failed(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |&e| e.source())
        .find_map(|e| e.downcast_ref::<hyper_util::client::legacy::Error>())
        .is_some_and(hyper_util::client::legacy::Error::is_connect)
}

/// The failure a watch's cancellation comes to; `None` for a message that does not end it.
pub(crate) fn of_cancel(endpoint: &str, call: &str, user: &str, message: &WatchResponse) -> Option<Failure> {
    if !message.canceled {
        return None;
    }
    if message.compact_revision > 0 {
        return Some(Failure::Final(EtcdError::Compacted(message.compact_revision)));
    }
    let reason = if message.cancel_reason.is_empty() { "cancelled by etcd" } else { &message.cancel_reason };
    // "rpc error: code = Unauthenticated desc = etcdserver: invalid auth token"
    let (code, text) = match reason.split_once(" desc = ") {
        Some((head, text)) => (grpc_code(head.trim_start_matches("rpc error: code = ")), text),
        None => (UNKNOWN, reason),
    };
    match classify(endpoint, call, user, code, text.to_owned()) {
        // A cancel for another reason ends the watch as it always has.
        Failure::Final(EtcdError::Refused { message, .. }) => Some(Failure::Final(EtcdError::WatchEnded(message))),
        other => Some(other),
    }
}

fn grpc_code(name: &str) -> i64 {
    match name {
        "PermissionDenied" => PERMISSION_DENIED,
        "Unavailable" => UNAVAILABLE,
        "Unauthenticated" => UNAUTHENTICATED,
        _ => UNKNOWN,
    }
}

fn classify(endpoint: &str, call: &str, user: &str, code: i64, message: String) -> Failure {
    let (endpoint, call, user) = (endpoint.to_owned(), call.to_owned(), user.to_owned());
    let has = |list: &[&str]| list.iter().any(|m| message.contains(m));
    if message.contains(NO_SPACE) {
        return Failure::Final(EtcdError::NoSpace { endpoint, call });
    }
    if has(RENEW) || code == UNAUTHENTICATED {
        return Failure::Token(EtcdError::Unauthenticated { endpoint, user, message });
    }
    if message.contains(AUTH_FAILED) {
        return Failure::Final(EtcdError::Unauthenticated { endpoint, user, message });
    }
    if message.contains(PERMISSION) || code == PERMISSION_DENIED {
        return Failure::Final(EtcdError::PermissionDenied { endpoint, call, user });
    }
    if has(NOT_SERVED) {
        return Failure::Elsewhere(EtcdError::Unavailable { endpoint, call, message });
    }
    // Any other Unavailable (a member shutting down its connections, say) may come after the
    // member took the request.
    if has(UNFINISHED) || code == UNAVAILABLE {
        return Failure::Unknown(EtcdError::Unavailable { endpoint, call, message });
    }
    if message.contains(COMPACTED) {
        return Failure::Final(EtcdError::RevisionCompacted);
    }
    Failure::Final(EtcdError::Refused { endpoint, call, code, message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn unary(code: i32, message: &str) -> Failure {
        of_status("http://m", "/etcdserverpb.KV/Put", "u", &Status::new(Code::from_i32(code), message))
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
    fn a_status_the_connection_made_is_unreachable_and_may_have_been_taken() {
        // What tonic makes of a stream the connection lost: the status carries its source.
        let mut lost = Status::new(Code::Unknown, "connection reset");
        lost.set_source(std::sync::Arc::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset)));
        let failure = of_status("http://m", "/etcdserverpb.KV/Txn", "", &lost);
        assert!(
            matches!(failure, Failure::Unknown(EtcdError::Unreachable { ref reason, .. }) if reason.contains("reset"))
        );
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
        assert!(matches!(other, Failure::Final(EtcdError::Refused { code: 3, .. })), "{other:?}");
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
        let cancelled = |reason: &str| WatchResponse {
            created: true,
            canceled: true,
            cancel_reason: reason.to_owned(),
            ..WatchResponse::default()
        };
        let watch = |m: &WatchResponse| of_cancel("http://m", "/etcdserverpb.Watch/Watch", "u", m);
        let token = cancelled("rpc error: code = Unauthenticated desc = etcdserver: invalid auth token");
        assert!(matches!(watch(&token), Some(Failure::Token(_))));
        let denied = cancelled("rpc error: code = PermissionDenied desc = etcdserver: permission denied");
        assert!(matches!(watch(&denied), Some(Failure::Final(EtcdError::PermissionDenied { .. }))));
        let compacted = WatchResponse { canceled: true, compact_revision: 9, ..WatchResponse::default() };
        assert!(matches!(watch(&compacted), Some(Failure::Final(EtcdError::Compacted(9)))));
        let other = cancelled("some other reason");
        assert!(
            matches!(watch(&other), Some(Failure::Final(EtcdError::WatchEnded(ref m))) if m == "some other reason")
        );
        assert!(watch(&WatchResponse { created: true, ..WatchResponse::default() }).is_none());
    }
}
