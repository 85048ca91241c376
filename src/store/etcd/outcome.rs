//! What an etcd error means for a batch: certain that it did not apply, or unknown (then a
//! barrier settles it, `batch`).

use crate::etcd_client::EtcdError;
use crate::store::StoreError;

/// What a refusal means for the batch when it is certain the batch did not apply; `None` when
/// its outcome is unknown. Only refusals etcd makes before a transaction is proposed, or that
/// it applies as a failure, count as certain; anything else (a member shutting down, a proxy's
/// 502, a message not known here) may have come back from a transaction that still commits,
/// and is settled by a barrier.
pub(super) fn refusal(e: &EtcdError) -> Option<StoreError> {
    match e {
        EtcdError::NoSpace { .. } => {
            return Some(StoreError::NoSpace(format!("etcd is out of space (its quota, NOSPACE): {e}")));
        }
        EtcdError::PermissionDenied { .. } | EtcdError::Unauthenticated { .. } | EtcdError::Options(_) => {
            return Some(StoreError::Unavailable(format!("etcd refused the batch: {e}")));
        }
        _ => {}
    }
    let EtcdError::Refused { message, .. } = e else { return None };
    const DEFINITE: [&str; 5] = [
        "too many operations in txn request",
        "duplicate key given in txn request",
        "request is too large",
        "requested lease not found",
        // gRPC's own refusal of a request above etcd's `--max-request-bytes`, before etcd sees it.
        "received message larger than max",
    ];
    DEFINITE
        .iter()
        .any(|m| message.contains(m))
        .then(|| StoreError::Unavailable(format!("etcd refused the batch: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(message: &str) -> EtcdError {
        EtcdError::Refused {
            endpoint: "e".into(),
            call: "/etcdserverpb.KV/Txn".into(),
            code: 3,
            message: message.into(),
        }
    }

    #[test]
    fn only_refusals_known_to_be_definite_skip_the_barrier() {
        let definite = [
            EtcdError::NoSpace { endpoint: "e".into(), call: "c".into() },
            EtcdError::PermissionDenied { endpoint: "e".into(), call: "c".into(), user: "u".into() },
            refused("etcdserver: too many operations in txn request"),
            refused("etcdserver: duplicate key given in txn request"),
            refused("etcdserver: request is too large"),
            refused("grpc: received message larger than max (2000000 vs. 1572864)"),
        ];
        for e in &definite {
            assert!(refusal(e).is_some(), "{e}");
        }
        assert!(matches!(refusal(&definite[0]), Some(StoreError::NoSpace(_))));
        let unknown = [
            refused("grpc: the client connection is closing"),
            refused("transport is closing"),
            refused("504 Gateway Time-out"),
            refused("something etcd says one day"),
            EtcdError::Unavailable {
                endpoint: "e".into(),
                call: "c".into(),
                message: "etcdserver: request timed out".into(),
            },
            EtcdError::Unreachable { endpoint: "e".into(), reason: "no answer".into() },
        ];
        for e in &unknown {
            assert!(refusal(e).is_none(), "{e} may come back from a transaction that commits");
        }
    }
}
