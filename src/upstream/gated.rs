//! A request body that stops when its permit lapses: a fenced write whose permission to be sent
//! lapsed midway (the etcd store's leader whose lease lapsed) fails there, so the backend's
//! connection is broken off and the backend sees a cut-off request, never a complete one.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::BoxError;
use crate::store::Permit;

/// Why a gated body stopped.
#[derive(Debug, thiserror::Error)]
#[error("the permission to send this write lapsed before its body was sent whole")]
pub(super) struct Closed;

/// A body checked against a permit before each chunk is handed on.
pub(super) struct Gated<B> {
    body: B,
    permit: Permit,
    /// Chunks seen so far (for the fail point between chunks).
    chunks: u64,
}

impl<B> Gated<B> {
    pub(super) fn new(body: B, permit: Permit) -> Self {
        Gated { body, permit, chunks: 0 }
    }
}

/// Whether sends check their permit (the self-fence). The `failpoints` feature's
/// `upstream::no_self_fence` (action `return`) turns the check off, for the fault tests that
/// show what else keeps a paused leader's write out (tests/cluster/cluster_faults.rs, pins).
fn self_fenced() -> bool {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("upstream::no_self_fence", |_| false);
    true
}

/// Whether `permit` lapsed, where sends check it: the self-fence's one check, before the head,
/// before a head sent again, and before each body chunk, whether fencegate sends them or lets
/// Envoy send them (its external processor).
pub(crate) fn lapsed(permit: &Permit) -> bool {
    self_fenced() && !permit()
}

/// Whether a write's head may go, under `permit` (none: always): the self-fence's check before
/// the head, at the fail point where the fault tests stop a leader (`upstream::before_head`),
/// whether fencegate sends the head or lets Envoy send it.
pub(crate) fn head_may_go(permit: Option<&Permit>) -> bool {
    let Some(permit) = permit else { return true };
    crate::store::failpoint("upstream::before_head");
    !lapsed(permit)
}

impl<B> Body for Gated<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = ready!(Pin::new(&mut self.body).poll_frame(cx));
        if matches!(polled, Some(Ok(_))) {
            self.chunks += 1;
            // After the first chunk: the head and that chunk have gone to the backend.
            if self.chunks > 1 {
                crate::store::failpoint("upstream::mid_body");
            }
            if lapsed(&self.permit) {
                return Poll::Ready(Some(Err(Box::new(Closed))));
            }
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
