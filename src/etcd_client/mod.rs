//! A small etcd v3 client over etcd's gRPC API: reads and writes of keys, transactions, leases,
//! the lock service, and watches ([`Client`]); and a [`Mirror`], a watched copy of the keys under
//! a prefix that proves how fresh it is.
//!
//! Why this client rather than a gRPC crate's: the etcd clients on crates.io (`etcd-client`, on
//! tonic) run `protoc` at build time, which a machine with only a Rust toolchain lacks, and
//! `cargo build` must work there. The few messages the client sends and reads are written out
//! as prost structs instead (`wire.rs`), and tonic, which fencegate serves Envoy with, carries
//! them. Not etcd's JSON gateway: a transaction through it costs etcd 2.3 times the CPU of the
//! same transaction over gRPC (docs/benchmarks.md, "The shared fence through etcd").
//!
//! A client speaks HTTP/2 in plain or over TLS ([`TlsOptions`]: a CA, a client certificate for
//! etcd's `--client-cert-auth`) and, given [`Credentials`], authenticates and sends its token
//! with every call and watch, renewing it when etcd refuses it (`auth.rs`). Which answers send
//! it to another member and which it returns is `answer.rs`.
//!
//! This module knows etcd, gRPC and TLS, and nothing of fences, tokens or config.

mod answer;
mod auth;
mod client;
mod mirror;
mod transport;
mod txn;
mod watch;
mod wire;

pub use client::{Client, HeldLock, Kv};
pub use mirror::{Freshness, Mirror, MirrorOptions, Mirrors};
pub use transport::{ClientOptions, Credentials, Password, TlsOptions};
pub use txn::{Compare, Op, Page, TxnResult};
pub use watch::{Event, EventKind, Watch};

/// What can go wrong talking to etcd.
///
/// For a call that changes something (a put, a transaction, a grant, a lock), an
/// [`EtcdError::Unreachable`] or [`EtcdError::Unavailable`] does not say whether etcd applied
/// it, unless the connection was never made: the client does not send such a call again
/// ([`Client::call`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EtcdError {
    /// No member could be reached (no connection, a TLS handshake refused), or none answered
    /// in time.
    #[error("etcd at {endpoint} is unreachable: {reason}")]
    Unreachable {
        /// The client URL tried last.
        endpoint: String,
        /// What failed.
        reason: String,
    },
    /// The member answered that it cannot serve now ("etcdserver: no leader", "etcdserver:
    /// request timed out", a learner), and no other member could either.
    #[error("etcd at {endpoint} cannot serve {call} now: {message}")]
    Unavailable {
        /// The client URL tried last.
        endpoint: String,
        /// The gRPC method (`/etcdserverpb.KV/Range`).
        call: String,
        /// etcd's message.
        message: String,
    },
    /// The cluster is out of space (etcd's NOSPACE alarm, "etcdserver: mvcc: database space
    /// exceeded"): it takes no writes until an operator compacts, defragments and disarms it.
    #[error("etcd at {endpoint} refused {call}: its database is out of space (NOSPACE alarm)")]
    NoSpace {
        /// The client URL.
        endpoint: String,
        /// The gRPC method.
        call: String,
    },
    /// The user may not do this ("etcdserver: permission denied"): its roles lack the key's
    /// permission.
    #[error("etcd at {endpoint} refused {call}: permission denied (user {user:?})")]
    PermissionDenied {
        /// The client URL.
        endpoint: String,
        /// The gRPC method.
        call: String,
        /// The user the client authenticates as; empty without credentials.
        user: String,
    },
    /// etcd refused the credentials, asked for credentials the client does not have, or
    /// refused a token it had just given.
    #[error("etcd at {endpoint} did not authenticate user {user:?}: {message}")]
    Unauthenticated {
        /// The client URL.
        endpoint: String,
        /// The user the client authenticates as; empty without credentials.
        user: String,
        /// etcd's message.
        message: String,
    },
    /// etcd answered with another error.
    #[error("etcd at {endpoint} refused {call}: gRPC code {code}: {message}")]
    Refused {
        /// The client URL.
        endpoint: String,
        /// The gRPC method (`/etcdserverpb.KV/Range`).
        call: String,
        /// gRPC's status code.
        code: i64,
        /// etcd's message.
        message: String,
    },
    /// The answer lacks what etcd sends when it did what was asked.
    #[error("etcd sent an answer to {call} that cannot be read: {reason}")]
    Malformed {
        /// The gRPC method.
        call: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A watch ended because the revision it wanted has been compacted away.
    #[error("etcd compacted the history the watch needed (up to revision {0})")]
    Compacted(i64),
    /// A read at a revision etcd has compacted away since.
    #[error("etcd compacted the revision the read asked for")]
    RevisionCompacted,
    /// A watch was cancelled or its stream ended.
    #[error("the etcd watch ended: {0}")]
    WatchEnded(String),
    /// [`ClientOptions`] that make no client: no endpoint, an endpoint that is not
    /// `http(s)://HOST:PORT`, both schemes at once, a TLS file that cannot be used.
    #[error("etcd client options: {0}")]
    Options(String),
}

/// The end of the range of keys that start with `prefix`: `prefix` with its last byte below
/// 0xff raised by one (what `etcdctl get --prefix` sends).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): to the end of the key space.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/locks/"), b"/locks0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }
}
