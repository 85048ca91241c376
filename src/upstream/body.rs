//! A client's request body on its way to the backend: streamed from the client as it arrives,
//! or read whole first, for a protocol that names a request's resources in its body (S3's
//! DeleteObjects), and then sent as read.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};

/// A request body, streamed or read.
#[derive(Debug)]
pub enum RequestBody {
    /// Streamed from the client.
    Streamed(Incoming),
    /// Read whole before the request was classified.
    Read(Full<Bytes>),
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            RequestBody::Streamed(body) => Pin::new(body).poll_frame(cx),
            RequestBody::Read(body) => {
                Pin::new(body).poll_frame(cx).map(|frame| frame.map(|f| f.map_err(|e| match e {})))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Streamed(body) => body.is_end_stream(),
            RequestBody::Read(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Streamed(body) => body.size_hint(),
            RequestBody::Read(body) => body.size_hint(),
        }
    }
}
