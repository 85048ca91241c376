//! A request body that stops when its gate closes: a fenced write whose permission to be sent
//! lapsed midway (the etcd store's leader whose lease lapsed) fails there, so the backend's
//! connection is broken off and the backend sees a cut-off request, never a complete one.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::BoxError;

/// Whether a request may still be sent on; checked before its head and each body chunk.
pub type Gate = Arc<dyn Fn() -> bool + Send + Sync>;

/// Why a gated body stopped.
#[derive(Debug, thiserror::Error)]
#[error("the permission to send this write lapsed before its body was sent whole")]
pub(super) struct Closed;

/// A body checked against a gate before each chunk is handed on.
pub(super) struct Gated<B> {
    body: B,
    gate: Gate,
}

impl<B> Gated<B> {
    pub(super) fn new(body: B, gate: Gate) -> Self {
        Gated { body, gate }
    }
}

impl<B> Body for Gated<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = ready!(Pin::new(&mut self.body).poll_frame(cx));
        if matches!(polled, Some(Ok(_))) && !(self.gate)() {
            return Poll::Ready(Some(Err(Box::new(Closed))));
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
