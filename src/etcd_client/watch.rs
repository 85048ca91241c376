//! A watch: one `Watch/Watch` stream, its request side held open, whose answers are batches of
//! events in revision order.

use tokio::sync::oneshot;
use tonic::codec::Streaming;

use super::answer::{self, Failure};
use super::client::Exchange;
use super::wire::{self, EventType, WatchCreateRequest, WatchRequest, WatchResponse};
use super::{Client, EtcdError, Kv};

const CALL: &str = wire::WATCH;

/// The request that creates a watch.
struct Open {
    request: WatchRequest,
}

impl Exchange for Open {
    type Answer = Watch;

    async fn send(&self, client: &Client, endpoint: &str, token: Option<&str>) -> Result<Watch, Failure> {
        let opened = Watch::open_at(client, endpoint, self.request.clone(), token);
        client.bounded(endpoint, CALL, opened).await
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

/// A watch of a range of keys, delivering every change from a revision on. Dropping it ends
/// the stream, and etcd the watch.
pub struct Watch {
    answers: Streaming<WatchResponse>,
    /// Holds the request side open; dropped, it ends it.
    _open: oneshot::Sender<()>,
    /// The member it watches at, and the user, for its errors.
    endpoint: String,
    user: String,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch").field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

impl Watch {
    /// Watches `[key, range_end)` from `start_revision` on, at the members in turn as
    /// [`Client::call`] tries them, with the client's token (renewed once if etcd refuses it;
    /// a watch etcd has created goes on when its token expires). Resolves once etcd has created
    /// the watch. A revision already compacted ends it with [`EtcdError::Compacted`]: etcd 3.4
    /// creates the watch first and cancels it in its next message, so the first
    /// [`Watch::next`] says so.
    pub async fn open(client: &Client, key: &[u8], range_end: &[u8], start_revision: i64) -> Result<Watch, EtcdError> {
        let create = WatchCreateRequest { key: key.to_vec(), range_end: range_end.to_vec(), start_revision };
        client.attempt(CALL, &Open { request: WatchRequest { create_request: Some(create) } }).await
    }

    async fn open_at(
        client: &Client,
        endpoint: &str,
        request: WatchRequest,
        token: Option<&str>,
    ) -> Result<Watch, Failure> {
        let user = client.user();
        let (open, until) = oneshot::channel();
        let answers = client.transport().stream(endpoint, CALL, request, Some(until), token).await;
        let answers = answers.map_err(|status| answer::of_status(endpoint, CALL, user, &status))?;
        let mut watch = Watch { answers, _open: open, endpoint: endpoint.to_owned(), user: user.to_owned() };
        // The first message says the watch exists (or why it does not).
        let first = watch.read().await?;
        if let Some(failure) = answer::of_cancel(&watch.endpoint, CALL, &watch.user, &first) {
            return Err(failure);
        }
        if !first.created {
            return Err(Failure::Final(wire::malformed(
                CALL,
                format!("the first message does not say the watch was created: {first:?}"),
            )));
        }
        Ok(watch)
    }

    /// The next batch of events, in revision order. Never resolves while nothing changes; an
    /// error ends the watch.
    pub async fn next(&mut self) -> Result<Vec<Event>, EtcdError> {
        loop {
            let message = self.read().await.map_err(Failure::into_error)?;
            if let Some(failure) = answer::of_cancel(&self.endpoint, CALL, &self.user, &message) {
                return Err(failure.into_error());
            }
            // A message without events (a progress notification): read on.
            if message.events.is_empty() {
                continue;
            }
            let events = message.events.into_iter().map(|e| {
                let kind = match EventType::try_from(e.kind) {
                    Ok(EventType::Delete) => EventKind::Delete,
                    Ok(EventType::Put) | Err(_) => EventKind::Put,
                };
                Event { kind, kv: Kv::from(e.kv.unwrap_or_default()) }
            });
            return Ok(events.collect());
        }
    }

    /// The next message of the stream; its end, or its error status, is a failure.
    async fn read(&mut self) -> Result<WatchResponse, Failure> {
        match self.answers.message().await {
            Ok(Some(message)) => Ok(message),
            Ok(None) => Err(Failure::Unknown(EtcdError::WatchEnded("etcd closed the stream".into()))),
            Err(status) => Err(answer::of_status(&self.endpoint, CALL, &self.user, &status)),
        }
    }
}
