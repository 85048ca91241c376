//! The gateway's answers as types: one struct per answer the client reads, decoded in one step,
//! so that an answer of the wrong shape is the decoder's error ([`EtcdError::Malformed`]).
//!
//! etcd's JSON is protobuf's proto3 mapping: a 64-bit integer is a string (a number is taken
//! too), bytes are base64, and a field at its zero value is left out, so every field that may
//! be zero is `#[serde(default)]`. Fields the client does not read are skipped. Two fields are
//! never zero in an answer that did what was asked, and their absence is an error: a granted
//! lease's ID and a held lock's key.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Deserialize;
use serde::de::{self, DeserializeOwned, Deserializer, Unexpected, Visitor};

use super::{EtcdError, Kv};

/// The malformed-answer error of `call` for a decoder's error.
pub(crate) fn malformed(call: &str, e: &serde_json::Error) -> EtcdError {
    EtcdError::Malformed { call: call.to_owned(), reason: e.to_string() }
}

/// The answer `body` to `call`, decoded.
pub(crate) fn decode<A: DeserializeOwned>(call: &str, body: &[u8]) -> Result<A, EtcdError> {
    serde_json::from_slice(body).map_err(|e| malformed(call, &e))
}

/// Every answer's `header`; the client reads only its revision.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Header {
    #[serde(default, deserialize_with = "int")]
    pub(crate) revision: i64,
}

/// An answer the client reads only the header of: a put's, a revoke's, an unlock's.
#[derive(Debug, Deserialize)]
pub(crate) struct Headed {
    #[serde(default)]
    pub(crate) header: Header,
}

/// One key of a range answer or a watch event (etcd's `mvccpb.KeyValue`).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct KeyValue {
    #[serde(default, deserialize_with = "bytes")]
    key: Vec<u8>,
    #[serde(default, deserialize_with = "int")]
    create_revision: i64,
    #[serde(default, deserialize_with = "int")]
    mod_revision: i64,
    #[serde(default, deserialize_with = "int")]
    lease: i64,
    #[serde(default, deserialize_with = "bytes")]
    value: Vec<u8>,
}

impl From<KeyValue> for Kv {
    fn from(kv: KeyValue) -> Kv {
        let KeyValue { key, create_revision, mod_revision, lease, value } = kv;
        Kv { key, create_revision, mod_revision, lease, value }
    }
}

/// `/v3/kv/range`, alone or in a transaction.
#[derive(Debug, Deserialize)]
pub(crate) struct RangeAnswer {
    #[serde(default)]
    pub(crate) header: Header,
    #[serde(default)]
    pub(crate) kvs: Vec<KeyValue>,
    #[serde(default)]
    pub(crate) more: bool,
}

/// `/v3/kv/txn`.
#[derive(Debug, Deserialize)]
pub(crate) struct TxnAnswer {
    #[serde(default)]
    pub(crate) header: Header,
    #[serde(default)]
    pub(crate) succeeded: bool,
    #[serde(default)]
    pub(crate) responses: Vec<ResponseOp>,
}

/// One operation's answer in a transaction: a `response_range`, `response_put` or
/// `response_delete_range`; only reads give anything to read.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ResponseOp {
    #[serde(default)]
    pub(crate) response_range: Option<RangeAnswer>,
}

/// `/v3/lease/grant`.
#[derive(Debug, Deserialize)]
pub(crate) struct GrantAnswer {
    #[serde(rename = "ID", deserialize_with = "lease_id")]
    pub(crate) id: i64,
}

/// `/v3/lease/keepalive`: one message of a stream, `{"result": ...}`.
#[derive(Debug, Deserialize)]
pub(crate) struct KeepAliveAnswer {
    #[serde(default)]
    pub(crate) result: KeepAliveResult,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct KeepAliveResult {
    /// 0 once the lease has expired.
    #[serde(rename = "TTL", default, deserialize_with = "int")]
    pub(crate) ttl: i64,
}

/// `/v3/lock/lock`.
#[derive(Debug, Deserialize)]
pub(crate) struct LockAnswer {
    #[serde(default)]
    pub(crate) header: Header,
    #[serde(deserialize_with = "lock_key")]
    pub(crate) key: Vec<u8>,
}

/// `/v3/auth/authenticate`.
#[derive(Debug, Deserialize)]
pub(crate) struct AuthAnswer {
    #[serde(deserialize_with = "token")]
    pub(crate) token: String,
}

/// An error answer of a unary call: `{"error": MSG, "message": MSG, "code": N}` (3.5's gateway
/// leaves out `error`).
#[derive(Debug, Deserialize)]
pub(crate) struct ErrorBody {
    #[serde(default)]
    pub(crate) error: Option<String>,
    #[serde(default)]
    pub(crate) message: Option<String>,
    #[serde(default)]
    pub(crate) code: Option<i64>,
}

/// One message of a watch's stream: `{"result": ...}`, or `{"error": ...}` when the stream
/// fails.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct WatchMessage {
    #[serde(default)]
    pub(crate) result: WatchResult,
    #[serde(default)]
    pub(crate) error: Option<StreamError>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct WatchResult {
    #[serde(default)]
    pub(crate) created: bool,
    #[serde(default)]
    pub(crate) canceled: bool,
    #[serde(default, deserialize_with = "int")]
    pub(crate) compact_revision: i64,
    #[serde(default)]
    pub(crate) cancel_reason: String,
    #[serde(default)]
    pub(crate) events: Vec<WatchEvent>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct WatchEvent {
    #[serde(rename = "type", default)]
    pub(crate) kind: EventType,
    #[serde(default)]
    pub(crate) kv: KeyValue,
}

/// An event's `type`: PUT is 0, and so left out.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(crate) enum EventType {
    #[default]
    #[serde(rename = "PUT")]
    Put,
    #[serde(rename = "DELETE")]
    Delete,
}

/// The error a stream ends with (grpc-gateway's `StreamError`).
#[derive(Debug, Deserialize)]
pub(crate) struct StreamError {
    #[serde(default)]
    pub(crate) grpc_code: Option<i64>,
    #[serde(default)]
    pub(crate) http_code: Option<i64>,
    #[serde(default)]
    pub(crate) message: Option<String>,
}

/// An int64 or uint64 as the gateway writes it: a decimal string, or a number; `null` is zero.
pub(crate) fn int<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + std::str::FromStr + TryFrom<i64> + TryFrom<u64>,
{
    struct Int<T>(std::marker::PhantomData<T>);

    impl<T: Default + std::str::FromStr + TryFrom<i64> + TryFrom<u64>> Visitor<'_> for Int<T> {
        type Value = T;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a 64-bit integer, as a string or a number")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<T, E> {
            s.parse().map_err(|_| E::invalid_value(Unexpected::Str(s), &self))
        }

        fn visit_i64<E: de::Error>(self, n: i64) -> Result<T, E> {
            T::try_from(n).map_err(|_| E::invalid_value(Unexpected::Signed(n), &self))
        }

        fn visit_u64<E: de::Error>(self, n: u64) -> Result<T, E> {
            T::try_from(n).map_err(|_| E::invalid_value(Unexpected::Unsigned(n), &self))
        }

        fn visit_unit<E: de::Error>(self) -> Result<T, E> {
            Ok(T::default())
        }
    }

    d.deserialize_any(Int(std::marker::PhantomData))
}

/// Bytes as the gateway writes them: standard base64; `null` is empty.
pub(crate) fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    struct Bytes;

    impl Visitor<'_> for Bytes {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("base64")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Vec<u8>, E> {
            BASE64.decode(s).map_err(|_| E::invalid_value(Unexpected::Str(s), &self))
        }

        fn visit_unit<E: de::Error>(self) -> Result<Vec<u8>, E> {
            Ok(Vec::new())
        }
    }

    d.deserialize_any(Bytes)
}

fn lease_id<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    match int(d)? {
        0 => Err(de::Error::invalid_value(Unexpected::Signed(0), &"a lease ID")),
        id => Ok(id),
    }
}

fn lock_key<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let key = bytes(d)?;
    if key.is_empty() {
        return Err(de::Error::invalid_length(0, &"a lock key"));
    }
    Ok(key)
}

fn token<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let token = String::deserialize(d)?;
    if token.is_empty() {
        return Err(de::Error::invalid_length(0, &"a token"));
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers of etcd 3.4's gateway, as it sent them.
    const HEADER: &str = r#""header":{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"3","raft_term":"2"}"#;

    fn answer<A: DeserializeOwned>(call: &str, body: &str) -> A {
        let body = body.replace("HEADER", HEADER);
        decode(call, body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"))
    }

    fn refused<A: DeserializeOwned + std::fmt::Debug>(body: &str) -> String {
        match decode::<A>("/v3/test", body.replace("HEADER", HEADER).as_bytes()) {
            Err(EtcdError::Malformed { call, reason }) if call == "/v3/test" => reason,
            other => panic!("{body} gave {other:?}"),
        }
    }

    #[test]
    fn ranges_puts_and_leases_decode_with_defaults_left_out() {
        let range: RangeAnswer = answer(
            "/v3/kv/range",
            r#"{HEADER,"kvs":[{"key":"YQ==","create_revision":"2","mod_revision":"2","version":"1","value":"MQ=="},
                {"key":"Yg==","create_revision":"3","mod_revision":"3","version":"1","lease":"4111120422100139016"}],
                "count":"2","more":true}"#,
        );
        assert_eq!(range.header.revision, 3);
        assert!(range.more);
        let kvs: Vec<Kv> = range.kvs.into_iter().map(Kv::from).collect();
        let a = Kv { key: b"a".to_vec(), create_revision: 2, mod_revision: 2, lease: 0, value: b"1".to_vec() };
        let b =
            Kv { key: b"b".to_vec(), create_revision: 3, mod_revision: 3, lease: 4111120422100139016, value: vec![] };
        assert_eq!(kvs, [a, b]);

        let empty: RangeAnswer = answer("/v3/kv/range", "{HEADER}");
        assert!(empty.kvs.is_empty() && !empty.more);
        // A watch's compaction message has a header without a revision: zero.
        assert_eq!(answer::<Headed>("/v3/kv/put", r#"{"header":{"raft_term":"2"}}"#).header.revision, 0);
        assert_eq!(answer::<Headed>("/v3/kv/put", "{}").header.revision, 0);

        let grant: GrantAnswer = answer("/v3/lease/grant", r#"{HEADER,"ID":"4111120422100139014","TTL":"60"}"#);
        assert_eq!(grant.id, 4111120422100139014);
        let alive: KeepAliveAnswer =
            answer("/v3/lease/keepalive", r#"{"result":{HEADER,"ID":"4111120422100139016","TTL":"60"}}"#);
        assert_eq!(alive.result.ttl, 60);
        // A lease etcd no longer has: its TTL, 0, is left out.
        let gone: KeepAliveAnswer = answer("/v3/lease/keepalive", r#"{"result":{HEADER,"ID":"12345"}}"#);
        assert_eq!(gone.result.ttl, 0);
        let lock: LockAnswer = answer("/v3/lock/lock", r#"{HEADER,"key":"bC8zOTBkYTIzZTA0MjFmYzA4"}"#);
        assert_eq!((lock.key.as_slice(), lock.header.revision), (&b"l/390da23e0421fc08"[..], 3));
        let auth: AuthAnswer = answer("/v3/auth/authenticate", r#"{HEADER,"token":"gUXFkMXRKZIUpuJt.31"}"#);
        assert_eq!(auth.token, "gUXFkMXRKZIUpuJt.31");

        let error: ErrorBody = answer(
            "/v3/lease/revoke",
            r#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#,
        );
        assert_eq!((error.message.as_deref(), error.code), (Some("etcdserver: requested lease not found"), Some(5)));
    }

    #[test]
    fn transactions_decode_with_their_responses() {
        // The failure branch ran (`succeeded` is false, so left out): a put, two reads (one of
        // a key that does not exist) and a delete.
        let failed: TxnAnswer = answer(
            "/v3/kv/txn",
            r#"{HEADER,"responses":[{"response_put":{"header":{"revision":"3"}}},
                {"response_range":{"header":{"revision":"3"},"kvs":[{"key":"YQ==","create_revision":"2","mod_revision":"2","version":"1","value":"MQ=="}],"count":"1"}},
                {"response_range":{"header":{"revision":"3"}}},
                {"response_delete_range":{"header":{"revision":"3"}}}]}"#,
        );
        assert!(!failed.succeeded);
        assert_eq!(failed.header.revision, 3);
        let ranges: Vec<Option<usize>> =
            failed.responses.iter().map(|r| r.response_range.as_ref().map(|r| r.kvs.len())).collect();
        assert_eq!(ranges, [None, Some(1), Some(0), None]);
        let done: TxnAnswer = answer(
            "/v3/kv/txn",
            r#"{HEADER,"succeeded":true,"responses":[{"response_delete_range":{"header":{"revision":"4"},"deleted":"1"}}]}"#,
        );
        assert!(done.succeeded);
    }

    #[test]
    fn watch_streams_decode_message_by_message() {
        let stream = format!(
            "{}\n{}\n{}",
            r#"{"result":{HEADER,"created":true}}"#,
            r#"{"result":{HEADER,"events":[{"kv":{"key":"YQ==","create_revision":"2","mod_revision":"2","version":"1","value":"MQ=="}},{"type":"DELETE","kv":{"key":"YQ==","mod_revision":"4"}}]}}"#,
            r#"{"result":{"header":{"cluster_id":"15118495548433857066","raft_term":"2"},"canceled":true,"compact_revision":"3"}}"#,
        )
        .replace("HEADER", HEADER);
        let messages: Vec<WatchMessage> =
            serde_json::Deserializer::from_str(&stream).into_iter().collect::<Result<_, _>>().unwrap();
        let [created, events, compacted] = &messages[..] else { panic!("{messages:?}") };
        assert!(created.result.created && created.result.events.is_empty() && created.error.is_none());
        let kinds: Vec<(EventType, &[u8], i64)> =
            events.result.events.iter().map(|e| (e.kind, &e.kv.key[..], e.kv.mod_revision)).collect();
        assert_eq!(kinds, [(EventType::Put, &b"a"[..], 2), (EventType::Delete, &b"a"[..], 4)]);
        assert!(compacted.result.canceled && compacted.result.compact_revision == 3);

        let failed: WatchMessage = answer(
            "/v3/watch",
            r#"{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader","http_status":"Service Unavailable"}}"#,
        );
        let error = failed.error.unwrap();
        assert_eq!(
            (error.grpc_code, error.http_code, error.message.as_deref()),
            (Some(14), Some(503), Some("etcdserver: no leader"))
        );

        // A message cut short waits for more (the watch reads on); it is not malformed.
        let cut = &stream[..stream.find('\n').unwrap() + 20];
        let mut partial = serde_json::Deserializer::from_str(cut).into_iter::<WatchMessage>();
        assert!(partial.next().unwrap().is_ok());
        assert!(partial.next().unwrap().unwrap_err().is_eof());
    }

    #[test]
    fn integers_are_strings_or_numbers_and_bytes_base64() {
        #[derive(Debug, Deserialize)]
        struct Ints {
            #[serde(deserialize_with = "int")]
            signed: i64,
            #[serde(deserialize_with = "int")]
            unsigned: u64,
            #[serde(default, deserialize_with = "bytes")]
            data: Vec<u8>,
        }
        let ints: Ints = answer("", r#"{"signed":"-42","unsigned":"15118495548433857066","data":null}"#);
        assert_eq!((ints.signed, ints.unsigned, ints.data), (-42, 15118495548433857066, vec![]));
        let ints: Ints = answer("", r#"{"signed":7,"unsigned":7,"data":"L2xvY2tzL2E="}"#);
        assert_eq!((ints.signed, ints.unsigned, ints.data), (7, 7, b"/locks/a".to_vec()));
        let ints: Ints = answer("", r#"{"signed":null,"unsigned":null}"#);
        assert_eq!((ints.signed, ints.unsigned), (0, 0));
        assert!(refused::<Ints>(r#"{"signed":"x","unsigned":1}"#).contains("a 64-bit integer"));
        assert!(refused::<Ints>(r#"{"signed":1,"unsigned":-1}"#).contains("integer `-1`"));
        assert!(refused::<Ints>(r#"{"signed":1.5,"unsigned":1}"#).contains("floating point"));
    }

    #[test]
    fn malformed_answers_are_the_decoders_errors() {
        // A wrong type.
        let reason = refused::<RangeAnswer>(r#"{HEADER,"kvs":{"key":"YQ=="}}"#);
        assert!(reason.starts_with("invalid type: map, expected a sequence"), "{reason}");
        assert!(refused::<RangeAnswer>(r#"{"header":{"revision":true}}"#).contains("invalid type: boolean"));
        assert!(refused::<TxnAnswer>(r#"{HEADER,"succeeded":"yes"}"#).contains("expected a boolean"));
        // Bad base64.
        let reason = refused::<RangeAnswer>(r#"{HEADER,"kvs":[{"key":"%%"}]}"#);
        assert!(reason.starts_with(r#"invalid value: string "%%", expected base64"#), "{reason}");
        let txn = r#"{HEADER,"responses":[{"response_range":{"kvs":[{"key":"YQ==","value":"MQ"}]}}]}"#;
        assert!(refused::<TxnAnswer>(txn).contains("expected base64"));
        // An event of a kind etcd does not have.
        let event = r#"{"result":{"events":[{"type":"EXPIRE","kv":{"key":"YQ=="}}]}}"#;
        assert!(refused::<WatchMessage>(event).contains("unknown variant `EXPIRE`"));
        // What a granted lease, a held lock and an authentication cannot be without.
        assert!(refused::<GrantAnswer>(r#"{HEADER,"TTL":"60"}"#).contains("missing field `ID`"));
        assert!(refused::<GrantAnswer>(r#"{HEADER,"ID":"0"}"#).contains("expected a lease ID"));
        assert!(refused::<LockAnswer>("{HEADER}").contains("missing field `key`"));
        assert!(refused::<LockAnswer>(r#"{HEADER,"key":""}"#).contains("a lock key"));
        assert!(refused::<AuthAnswer>("{HEADER}").contains("missing field `token`"));
        assert!(refused::<AuthAnswer>(r#"{"token":""}"#).contains("a token"));
        // Not JSON at all.
        assert!(refused::<Headed>("<html>").contains("expected value"));
    }
}
