//! etcd's v3 API messages (etcd's `rpc.proto`, `kv.proto` and `v3lock.proto`), written out as
//! prost messages so that no build step runs `protoc`: only the fields the client sends or
//! reads, under their field numbers (prost skips the fields an answer has beyond these). Each
//! gRPC method the client calls is a [`Method`] naming its request and answer.
//!
//! Proto3 leaves a field at its zero value out of the wire, so an answer's missing field reads
//! as zero. Two are never zero in an answer that did what was asked, and their absence is an
//! error ([`EtcdError::Malformed`]): a granted lease's `ID` and a held lock's `key`; so is an
//! empty authentication token.

use super::EtcdError;

/// One gRPC method: its path, and the types of its request and answer.
pub(crate) trait Method {
    /// `/package.Service/Method`.
    const PATH: &'static str;
    type Request: prost::Message + Clone + Send + Sync + 'static;
    type Answer: prost::Message + Default + Send + Sync + 'static;
}

macro_rules! methods {
    ($($name:ident: $path:literal, $request:ty => $answer:ty;)*) => {$(
        pub(crate) struct $name;
        impl Method for $name {
            const PATH: &'static str = $path;
            type Request = $request;
            type Answer = $answer;
        }
    )*};
}

methods! {
    RangeCall: "/etcdserverpb.KV/Range", RangeRequest => RangeResponse;
    PutCall: "/etcdserverpb.KV/Put", PutRequest => Headed;
    TxnCall: "/etcdserverpb.KV/Txn", TxnRequest => TxnResponse;
    GrantCall: "/etcdserverpb.Lease/LeaseGrant", LeaseGrantRequest => LeaseGrantResponse;
    RevokeCall: "/etcdserverpb.Lease/LeaseRevoke", LeaseRevokeRequest => Headed;
    AuthenticateCall: "/etcdserverpb.Auth/Authenticate", AuthenticateRequest => AuthenticateResponse;
    LockCall: "/v3lockpb.Lock/Lock", LockRequest => LockResponse;
    UnlockCall: "/v3lockpb.Lock/Unlock", UnlockRequest => Headed;
}

/// The bidirectional streams: renewals of a lease, and watches.
pub(crate) const KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";
pub(crate) const WATCH: &str = "/etcdserverpb.Watch/Watch";

/// Every answer's `header`; the client reads only its revision.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ResponseHeader {
    #[prost(int64, tag = "3")]
    pub(crate) revision: i64,
}

/// An answer the client reads only the header of: a put's, a revoke's, an unlock's.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Headed {
    #[prost(message, optional, tag = "1")]
    pub(crate) header: Option<ResponseHeader>,
}

/// The revision in an answer's header; 0 without one.
pub(crate) fn revision(header: Option<&ResponseHeader>) -> i64 {
    header.map_or(0, |h| h.revision)
}

/// One key as etcd returns it (`mvccpb.KeyValue`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
    #[prost(int64, tag = "2")]
    pub(crate) create_revision: i64,
    #[prost(int64, tag = "3")]
    pub(crate) mod_revision: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub(crate) value: Vec<u8>,
    #[prost(int64, tag = "6")]
    pub(crate) lease: i64,
}

impl From<KeyValue> for super::Kv {
    fn from(kv: KeyValue) -> super::Kv {
        let KeyValue { key, create_revision, mod_revision, value, lease } = kv;
        super::Kv { key, create_revision, mod_revision, lease, value }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) range_end: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub(crate) limit: i64,
    #[prost(int64, tag = "4")]
    pub(crate) revision: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RangeResponse {
    #[prost(message, optional, tag = "1")]
    pub(crate) header: Option<ResponseHeader>,
    #[prost(message, repeated, tag = "2")]
    pub(crate) kvs: Vec<KeyValue>,
    #[prost(bool, tag = "3")]
    pub(crate) more: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) value: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub(crate) lease: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct DeleteRangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
}

/// One comparison of a transaction's guard.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Compare {
    #[prost(enumeration = "CompareResult", tag = "1")]
    pub(crate) result: i32,
    #[prost(enumeration = "CompareTarget", tag = "2")]
    pub(crate) target: i32,
    #[prost(bytes = "vec", tag = "3")]
    pub(crate) key: Vec<u8>,
    #[prost(oneof = "TargetUnion", tags = "5, 7")]
    pub(crate) target_union: Option<TargetUnion>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub(crate) enum CompareResult {
    Equal = 0,
    Greater = 1,
    Less = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub(crate) enum CompareTarget {
    Version = 0,
    Create = 1,
    Mod = 2,
    Value = 3,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub(crate) enum TargetUnion {
    #[prost(int64, tag = "5")]
    CreateRevision(i64),
    #[prost(bytes = "vec", tag = "7")]
    Value(Vec<u8>),
}

/// One operation of a transaction's branch.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RequestOp {
    #[prost(oneof = "Request", tags = "1, 2, 3")]
    pub(crate) request: Option<Request>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub(crate) enum Request {
    #[prost(message, tag = "1")]
    Range(RangeRequest),
    #[prost(message, tag = "2")]
    Put(PutRequest),
    #[prost(message, tag = "3")]
    DeleteRange(DeleteRangeRequest),
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    pub(crate) compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    pub(crate) success: Vec<RequestOp>,
    #[prost(message, repeated, tag = "3")]
    pub(crate) failure: Vec<RequestOp>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TxnResponse {
    #[prost(message, optional, tag = "1")]
    pub(crate) header: Option<ResponseHeader>,
    #[prost(bool, tag = "2")]
    pub(crate) succeeded: bool,
    #[prost(message, repeated, tag = "3")]
    pub(crate) responses: Vec<ResponseOp>,
}

/// One operation's answer in a transaction; only reads give anything to read.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ResponseOp {
    #[prost(oneof = "Response", tags = "1")]
    pub(crate) response: Option<Response>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub(crate) enum Response {
    #[prost(message, tag = "1")]
    Range(RangeResponse),
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LeaseGrantRequest {
    #[prost(int64, tag = "1")]
    pub(crate) ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LeaseGrantResponse {
    #[prost(int64, tag = "2")]
    pub(crate) id: i64,
    #[prost(string, tag = "4")]
    pub(crate) error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LeaseRevokeRequest {
    #[prost(int64, tag = "1")]
    pub(crate) id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LeaseKeepAliveRequest {
    #[prost(int64, tag = "1")]
    pub(crate) id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LeaseKeepAliveResponse {
    /// 0 once the lease has expired.
    #[prost(int64, tag = "3")]
    pub(crate) ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct AuthenticateRequest {
    #[prost(string, tag = "1")]
    pub(crate) name: String,
    #[prost(string, tag = "2")]
    pub(crate) password: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct AuthenticateResponse {
    #[prost(string, tag = "2")]
    pub(crate) token: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LockRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) name: Vec<u8>,
    #[prost(int64, tag = "2")]
    pub(crate) lease: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LockResponse {
    #[prost(message, optional, tag = "1")]
    pub(crate) header: Option<ResponseHeader>,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) key: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct UnlockRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WatchRequest {
    #[prost(message, optional, tag = "1")]
    pub(crate) create_request: Option<WatchCreateRequest>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WatchCreateRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) range_end: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub(crate) start_revision: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WatchResponse {
    #[prost(bool, tag = "3")]
    pub(crate) created: bool,
    #[prost(bool, tag = "4")]
    pub(crate) canceled: bool,
    #[prost(int64, tag = "5")]
    pub(crate) compact_revision: i64,
    #[prost(string, tag = "6")]
    pub(crate) cancel_reason: String,
    #[prost(message, repeated, tag = "11")]
    pub(crate) events: Vec<WatchEvent>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WatchEvent {
    #[prost(enumeration = "EventType", tag = "1")]
    pub(crate) kind: i32,
    #[prost(message, optional, tag = "2")]
    pub(crate) kv: Option<KeyValue>,
}

/// An event's `type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub(crate) enum EventType {
    Put = 0,
    Delete = 1,
}

/// The error of an answer to `call` that lacks what it must hold.
pub(crate) fn malformed(call: &str, reason: impl Into<String>) -> EtcdError {
    EtcdError::Malformed { call: call.to_owned(), reason: reason.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn messages_keep_etcds_field_numbers() {
        // `value("/a") < "5"` then `put /a 6`, in the field numbers of etcd's rpc.proto.
        let txn = TxnRequest {
            compare: vec![Compare {
                result: CompareResult::Less as i32,
                target: CompareTarget::Value as i32,
                key: b"/a".to_vec(),
                target_union: Some(TargetUnion::Value(b"5".to_vec())),
            }],
            success: vec![RequestOp {
                request: Some(Request::Put(PutRequest { key: b"/a".to_vec(), value: b"6".to_vec(), lease: 0 })),
            }],
            failure: vec![],
        };
        let expected: &[u8] = &[
            0x0a, 0x0b, 0x08, 0x02, 0x10, 0x03, 0x1a, 0x02, b'/', b'a', 0x3a, 0x01, b'5', // compare
            0x12, 0x09, 0x12, 0x07, 0x0a, 0x02, b'/', b'a', 0x12, 0x01, b'6', // success: put
        ];
        assert_eq!(txn.encode_to_vec(), expected);

        // A range answer: header { revision: 7 }, kvs [{ key "/a", create 2, mod 7, value "6", lease 9 }].
        let answer: &[u8] = &[
            0x0a, 0x02, 0x18, 0x07, // header
            0x12, 0x0d, 0x0a, 0x02, b'/', b'a', 0x10, 0x02, 0x18, 0x07, 0x2a, 0x01, b'6', 0x30, 0x09,
        ];
        let range = RangeResponse::decode(answer).unwrap();
        assert_eq!(revision(range.header.as_ref()), 7);
        let kv = super::super::Kv::from(range.kvs[0].clone());
        assert_eq!(
            (kv.key, kv.create_revision, kv.mod_revision, kv.value, kv.lease),
            (b"/a".to_vec(), 2, 7, b"6".to_vec(), 9)
        );
    }
}
