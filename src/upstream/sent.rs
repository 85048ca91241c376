//! Knowing when the backend has a request's whole body.
//!
//! A backend may answer before it has read the body (an early `201`, an error page). For a
//! fenced write that is not the end: until the last byte has been handed to the backend's
//! connection, the write is still arriving, and the next write to the resource must wait. The
//! body is wrapped so that its end (or its failure) is reported when the connection takes it.
//! Bytes still in the kernel's socket buffers at that moment are beyond what a proxy can see.

use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body_util::LengthLimitError;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;

use super::{BoxError, caused_by};

/// How a request body ended, as the backend's connection saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Every byte was taken.
    Whole,
    /// The body failed: it was longer than its limit (`true`), or its client failed or left.
    Failed { too_large: bool },
}

/// A request body that reports its end to whoever waits for it.
pub(super) struct Sent<B> {
    body: B,
    /// Taken when the end is reported; dropped unsent (the connection dropped the body) it
    /// tells the waiter the body did not arrive whole. Behind a lock (never contended), so that
    /// `is_end_stream`, which takes `&self`, can report an empty body hyper never polls.
    done: Mutex<Option<oneshot::Sender<Ended>>>,
}

impl<B> Sent<B> {
    pub(super) fn new(body: B, done: oneshot::Sender<Ended>) -> Self {
        Sent { body, done: Mutex::new(Some(done)) }
    }

    fn report(&self, ended: Ended) {
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(done) = done {
            let _ = done.send(ended);
        }
    }
}

impl<B> Body for Sent<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = ready!(Pin::new(&mut self.body).poll_frame(cx));
        match &polled {
            None => self.report(Ended::Whole),
            Some(Err(e)) => self.report(Ended::Failed { too_large: caused_by::<LengthLimitError>(e.as_ref()) }),
            Some(Ok(_)) => {}
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        let end = self.body.is_end_stream();
        if end {
            self.report(Ended::Whole);
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
