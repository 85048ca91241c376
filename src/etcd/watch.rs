//! A watch through the gateway: one long-lived `POST /v3/watch` whose answer is a stream of
//! JSON messages, one per batch of events, in revision order.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{Value, json};

use super::{Client, EtcdError, Kv, b64, int};

const CALL: &str = "/v3/watch";

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Created or changed.
    Put,
    /// Deleted (by a delete, or with its lease).
    Delete,
}

/// One change of a key. A deletion's `kv` holds only the key and the deleting revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Put or delete.
    pub kind: EventKind,
    /// The key as it is after the change.
    pub kv: Kv,
}

/// A watch of a range of keys, delivering every change from a revision on.
#[derive(Debug)]
pub struct Watch {
    body: Incoming,
    buf: Vec<u8>,
}

impl Watch {
    /// Watches `[key, range_end)` from `start_revision` on. Resolves once etcd has created the
    /// watch; a revision already compacted is [`EtcdError::Compacted`].
    pub async fn open(client: &Client, key: &[u8], range_end: &[u8], start_revision: i64) -> Result<Watch, EtcdError> {
        let endpoint = client.endpoint().to_owned();
        let unreachable = |reason: String| EtcdError::Unreachable { endpoint: endpoint.clone(), reason };
        let body = json!({ "create_request": {
            "key": b64(key), "range_end": b64(range_end), "start_revision": start_revision.to_string(),
        }});
        let req = http::Request::post(format!("{endpoint}{CALL}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| unreachable(e.to_string()))?;
        let (http, timeout) = client.http();
        let opened = async {
            let resp = http.request(req).await.map_err(|e| unreachable(e.to_string()))?;
            if resp.status() != http::StatusCode::OK {
                let status = resp.status().as_u16();
                let text = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                let message = String::from_utf8_lossy(&text).into_owned();
                return Err(EtcdError::Refused { endpoint: endpoint.clone(), call: CALL.into(), status, message });
            }
            let mut watch = Watch { body: resp.into_body(), buf: Vec::new() };
            // The first message says the watch exists (or why it does not).
            let first = watch.message().await?;
            if first["result"]["created"].as_bool() != Some(true) {
                return Err(EtcdError::Malformed { call: CALL.into(), reason: format!("not created: {first}") });
            }
            Ok(watch)
        };
        match tokio::time::timeout(timeout, opened).await {
            Ok(result) => result,
            Err(_) => {
                client.next_endpoint();
                Err(unreachable(format!("no watch within {}", humantime::format_duration(timeout))))
            }
        }
    }

    /// The next batch of events, in revision order. Never resolves while nothing changes; an
    /// error ends the watch.
    pub async fn next(&mut self) -> Result<Vec<Event>, EtcdError> {
        loop {
            let message = self.message().await?;
            let events = match &message["result"]["events"] {
                Value::Null => continue,
                Value::Array(events) => events,
                _ => return Err(malformed(&message)),
            };
            let events = events
                .iter()
                .map(|e| {
                    let kind = match e["type"].as_str() {
                        None | Some("PUT") => EventKind::Put,
                        Some("DELETE") => EventKind::Delete,
                        Some(_) => return None,
                    };
                    Some(Event { kind, kv: Kv::parse(&e["kv"])? })
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| malformed(&message))?;
            if !events.is_empty() {
                return Ok(events);
            }
        }
    }

    /// The next message of the stream, with the ends of a watch turned into errors.
    async fn message(&mut self) -> Result<Value, EtcdError> {
        let message = self.read().await?;
        if !message["error"].is_null() {
            let error = &message["error"];
            let text = error["message"].as_str().unwrap_or("an error");
            return Err(EtcdError::WatchEnded(text.to_owned()));
        }
        let result = &message["result"];
        if result["canceled"].as_bool() == Some(true) {
            let compacted = int(&result["compact_revision"]).unwrap_or(0);
            if compacted > 0 {
                return Err(EtcdError::Compacted(compacted));
            }
            let reason = result["cancel_reason"].as_str().unwrap_or("cancelled by etcd");
            return Err(EtcdError::WatchEnded(reason.to_owned()));
        }
        Ok(message)
    }

    /// Reads one JSON value off the stream: the gateway writes them one after another.
    async fn read(&mut self) -> Result<Value, EtcdError> {
        loop {
            let mut values = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
            match values.next() {
                Some(Ok(value)) => {
                    let used = values.byte_offset();
                    self.buf.drain(..used);
                    return Ok(value);
                }
                Some(Err(e)) if e.is_eof() => {}
                Some(Err(e)) => {
                    return Err(EtcdError::Malformed { call: CALL.into(), reason: e.to_string() });
                }
                None => self.buf.clear(),
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Err(EtcdError::WatchEnded(e.to_string())),
                None => return Err(EtcdError::WatchEnded("etcd closed the stream".into())),
            }
        }
    }
}

fn malformed(message: &Value) -> EtcdError {
    EtcdError::Malformed { call: CALL.into(), reason: format!("unexpected message {message}") }
}
