//! A backend connection in a caller's hands, and the response body that keeps it until the
//! backend's answer has been relayed.
//!
//! A connection taken from the pool ([`Checkout`]) belongs to one request: from before its
//! request is sent (for a fenced write, from before its advance) until the response body has
//! ended or been dropped ([`Relayed`]). Then it goes back to the pool, which wakes one request
//! waiting for a connection. A connection that failed is discarded instead.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;

use super::pool::Pool;

/// A connection checked out of the pool. Dropped unused, it goes back to the pool; dropped
/// while its request is on the way (the request timed out, say), it is discarded.
pub(crate) struct Checkout<B: Send + 'static> {
    /// Taken when the connection goes back or is discarded.
    sender: Option<SendRequest<B>>,
    /// Whether it had served a request before: the backend may have closed it meanwhile.
    pub(super) reused: bool,
    /// Set from sending a request until its response head is in.
    sending: bool,
    pool: Arc<Pool<B>>,
}

impl<B: Send + 'static> Checkout<B> {
    pub(super) fn new(pool: &Arc<Pool<B>>, sender: SendRequest<B>, reused: bool) -> Self {
        Checkout { sender: Some(sender), reused, sending: false, pool: Arc::clone(pool) }
    }

    /// The connection, to send a request on.
    pub(super) fn sender(&mut self) -> Option<&mut SendRequest<B>> {
        self.sending = true;
        self.sender.as_mut()
    }

    /// Drops the connection instead of giving it back: it failed, or it carried a request
    /// whose body did not arrive whole, and must not take another one. The connection closes
    /// once hyper has finished with it, and its permit comes back then.
    pub(super) fn discard(mut self) {
        self.sender = None;
    }
}

impl<B: Send + 'static> Drop for Checkout<B> {
    fn drop(&mut self) {
        if let Some(sender) = self.sender.take()
            && !self.sending
        {
            self.pool.give_back(sender);
        }
    }
}

/// A backend response body, holding the connection it arrives on until it ends.
pub(crate) struct Relayed<B: Send + 'static> {
    body: Incoming,
    /// Given back to the pool when the body ends, or when this is dropped first.
    conn: Option<Checkout<B>>,
}

impl<B: Send + 'static> Relayed<B> {
    pub(super) fn new(body: Incoming, mut conn: Checkout<B>) -> Self {
        conn.sending = false;
        Relayed { body, conn: Some(conn) }
    }

    /// Drops the body and discards its connection (see [`Checkout::discard`]).
    pub(super) fn discard(mut self) {
        if let Some(conn) = self.conn.take() {
            conn.discard();
        }
    }
}

impl<B: Send + 'static> Body for Relayed<B> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = ready!(Pin::new(&mut self.body).poll_frame(cx));
        if polled.is_none() {
            // The whole answer is in: the connection may take the next request.
            self.conn = None;
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
