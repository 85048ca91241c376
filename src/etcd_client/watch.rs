//! A watch through the gateway: one long-lived `POST /v3/watch` whose answer is a stream of
//! JSON messages, one per batch of events, in revision order.

use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};

use super::answer::{self, Failure};
use super::client::Exchange;
use super::wire::{self, EventType, WatchMessage};
use super::{Client, EtcdError, Kv, b64};

const CALL: &str = "/v3/watch";

/// The request that creates a watch.
struct Open {
    body: Value,
}

impl Exchange for Open {
    type Answer = Watch;

    async fn send(&self, client: &Client, endpoint: &str, token: Option<&str>) -> Result<Watch, Failure> {
        let timeout = client.transport().1;
        let opened = Watch::open_at(client, endpoint, &self.body, token);
        tokio::time::timeout(timeout, opened).await.unwrap_or_else(|_| {
            let reason = format!("no watch within {}", humantime::format_duration(timeout));
            Err(Failure::Unknown(EtcdError::Unreachable { endpoint: endpoint.to_owned(), reason }))
        })
    }
}

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
    /// The member it watches at, and the user, for its errors.
    endpoint: String,
    user: String,
}

impl Watch {
    /// Watches `[key, range_end)` from `start_revision` on, at the members in turn as
    /// [`Client::call`] tries them, with the client's token (renewed once if etcd refuses it;
    /// a watch etcd has created goes on when its token expires). Resolves once etcd has created
    /// the watch; a revision already compacted is [`EtcdError::Compacted`].
    pub async fn open(client: &Client, key: &[u8], range_end: &[u8], start_revision: i64) -> Result<Watch, EtcdError> {
        let body = json!({ "create_request": {
            "key": b64(key), "range_end": b64(range_end), "start_revision": start_revision.to_string(),
        }});
        client.attempt(CALL, &Open { body }).await
    }

    async fn open_at(client: &Client, endpoint: &str, body: &Value, token: Option<&str>) -> Result<Watch, Failure> {
        let resp = client.transport().0.post(endpoint, CALL, body, token).await?;
        if resp.status() != http::StatusCode::OK {
            let status = resp.status().as_u16();
            let text = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            return Err(answer::of_body(endpoint, CALL, client.user(), status, &text));
        }
        let (endpoint, user) = (endpoint.to_owned(), client.user().to_owned());
        let mut watch = Watch { body: resp.into_body(), buf: Vec::new(), endpoint, user };
        // The first message says the watch exists (or why it does not).
        let first = watch.read().await.map_err(|e| match e {
            EtcdError::Malformed { .. } => Failure::Final(e),
            e => Failure::Unknown(e),
        })?;
        if let Some(failure) = answer::of_watch(&watch.endpoint, CALL, &watch.user, &first) {
            return Err(failure);
        }
        if !first.result.created {
            return Err(Failure::Final(EtcdError::Malformed {
                call: CALL.into(),
                reason: format!("the first message does not say the watch was created: {first:?}"),
            }));
        }
        Ok(watch)
    }

    /// The next batch of events, in revision order. Never resolves while nothing changes; an
    /// error ends the watch.
    pub async fn next(&mut self) -> Result<Vec<Event>, EtcdError> {
        loop {
            let message = self.message().await?;
            // A message without events (a progress notification): read on.
            if message.result.events.is_empty() {
                continue;
            }
            let events = message.result.events.into_iter().map(|e| {
                let kind = match e.kind {
                    EventType::Put => EventKind::Put,
                    EventType::Delete => EventKind::Delete,
                };
                Event { kind, kv: Kv::from(e.kv) }
            });
            return Ok(events.collect());
        }
    }

    /// The next message of the stream, with the ends of a watch turned into errors.
    async fn message(&mut self) -> Result<WatchMessage, EtcdError> {
        let message = self.read().await?;
        match answer::of_watch(&self.endpoint, CALL, &self.user, &message) {
            Some(failure) => Err(failure.into_error()),
            None => Ok(message),
        }
    }

    /// Reads one message off the stream, decoded: the gateway writes them one after another.
    async fn read(&mut self) -> Result<WatchMessage, EtcdError> {
        loop {
            let mut values = serde_json::Deserializer::from_slice(&self.buf).into_iter::<WatchMessage>();
            match values.next() {
                Some(Ok(value)) => {
                    let used = values.byte_offset();
                    self.buf.drain(..used);
                    return Ok(value);
                }
                Some(Err(e)) if e.is_eof() => {}
                Some(Err(e)) => return Err(wire::malformed(CALL, &e)),
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
