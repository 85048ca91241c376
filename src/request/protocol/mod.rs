//! The protocol seam: what differs between the kinds of backend fencegate fronts.
//!
//! A [`Protocol`] knows how a request names the resources it may change and how a refusal is
//! written for the client; everything between (the proof, the precheck, the turn, the durable
//! advance, the forward, the answer) is the same for every protocol and knows none of this.
//! [`for_backend`] chooses the one `backend.protocol` names (restart-only: the keys of the
//! fence follow it).
//!
//! [`Http`] implements it for resources named by canonical path and WebDAV's `Destination`,
//! with JSON refusals; [`S3`] for objects named by bucket and key, forwarding the client's
//! bytes unchanged (its [`Plan`]'s target the one sent, no headers set) and writing refusals
//! as S3's XML from the same [`Refusal`], whose status and code stay the one pinned mapping.

pub mod http;
pub mod s3;

use ::http::Request;
use ::http::header::{
    CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, EXPECT, HeaderMap, HeaderName, RANGE, TE, TRAILER,
    TRANSFER_ENCODING,
};
use ::http::uri::PathAndQuery;
use bytes::Bytes;
use http_body_util::Full;

pub use self::http::Http;
pub use self::s3::S3;
use super::classify::{Head, Pinned, Plan};
use super::pinned::is_condition;
use crate::config::{BackendConfig, BackendProtocol, Config};
use crate::fence::{Pin, keys};
use crate::refusal::Refusal;
use crate::upstream::RequestBody;

/// How requests to one kind of backend name resources, and how refusals are written for its
/// clients.
pub trait Protocol: Send + Sync + std::fmt::Debug {
    /// The name `backend.protocol` gives it.
    fn name(&self) -> &'static str;

    /// What `head` asks of the fence, from the head and the settings alone (no I/O): a pass, or
    /// a fenced write with every key the backend may change with it and what is forwarded.
    /// Everything a request can be refused for before it waits is refused here.
    fn classify(&self, head: &Head<'_>, config: &Config) -> Result<Plan, Refusal>;

    /// What `head` asks of the fence, now that its `body` has been read whole: for a request
    /// [`Protocol::classify`] answered with [`Plan::ReadBody`].
    fn classify_read(&self, head: &Head<'_>, body: &[u8], config: &Config) -> Result<Plan, Refusal> {
        let _ = (head, body, config);
        Err(Refusal::BadRequest(format!("{} names no resources in a body", self.name())))
    }

    /// The answer to a refused request, in the client's protocol; with `withhold`, without the
    /// levels the refusal would name (`FenceConfig::withholds`).
    fn refuse(&self, refusal: &Refusal, withhold: bool) -> ::http::Response<Full<Bytes>>;

    /// The upload id in the backend's answer `body` to a write that creates a multipart upload
    /// ([`super::classify::UploadStep::Create`]); `None` if it names none.
    fn upload_id(&self, body: &[u8]) -> Option<String> {
        let _ = body;
        None
    }

    /// Readies `head`, a `HEAD` of the key a pinned write changes (docs/pins.md), to be sent
    /// to `target` (the write's own, which the protocol may change), as fencegate's own
    /// request, from the headers of the `client`'s write: those that let the backend answer
    /// it as it would answer the client. `false` when this backend cannot be asked, so that
    /// the write is sent unpinned and its answer pins the key.
    fn learning_head(
        &self,
        head: &mut Request<RequestBody>,
        target: &mut PathAndQuery,
        client: &HeaderMap,
        config: &Config,
    ) -> bool {
        let _ = (config, target);
        // Every header but those about the write's body or its conditions: a backend that
        // authenticates by a header of its own (`X-Api-Key`) answers the HEAD as the client.
        for (name, value) in client {
            if !HEAD_DROPS.contains(name) && !is_condition(name) {
                head.headers_mut().append(name.clone(), value.clone());
            }
        }
        true
    }

    /// Whether the backend honours the precondition naming `pin` (`If-Match: <tag>`, or
    /// `If-None-Match: *` for absent) on a pinned write of `kind`; where it does not, the write
    /// is sent as without pins, and an unknown outcome of it quarantines as without pins.
    fn honours(&self, kind: Pinned, pin: &Pin) -> bool {
        let _ = (kind, pin);
        true
    }

    /// Whether the client signed its header `name` on the request to `uri` with `headers`, so
    /// that the backend refuses it changed.
    fn signed(&self, headers: &HeaderMap, uri: &::http::Uri, name: &HeaderName) -> bool {
        let _ = (headers, uri, name);
        false
    }

    /// Whether `body`, of a success answer to a write that ends a multipart upload
    /// ([`super::classify::UploadStep::End`]), says that it failed all the same (S3's `200`
    /// with an `<Error>`), so the upload is still open.
    fn failed_late(&self, body: &[u8]) -> bool {
        let _ = body;
        false
    }

    /// The strong entity tag that `body`, of a success answer to a write that ends a multipart
    /// upload, names for the object it completed (S3's `CompleteMultipartUploadResult` has
    /// its `ETag` there, not in the header), with its quotes; `None` when it names none.
    fn completed_tag(&self, body: &[u8]) -> Option<Box<str>> {
        let _ = body;
        None
    }
}

/// The protocol `backend.protocol` names: each request's one call through the seam is a
/// `match`, which the compiler inlines, not a call through a vtable.
#[derive(Debug, Clone, Copy)]
pub enum Chosen {
    /// [`Http`].
    Http(Http),
    /// [`S3`].
    S3(S3),
}

impl Protocol for Chosen {
    fn name(&self) -> &'static str {
        match self {
            Chosen::Http(p) => p.name(),
            Chosen::S3(p) => p.name(),
        }
    }

    #[inline]
    fn classify(&self, head: &Head<'_>, config: &Config) -> Result<Plan, Refusal> {
        match self {
            Chosen::Http(p) => p.classify(head, config),
            Chosen::S3(p) => p.classify(head, config),
        }
    }

    fn classify_read(&self, head: &Head<'_>, body: &[u8], config: &Config) -> Result<Plan, Refusal> {
        match self {
            Chosen::Http(p) => p.classify_read(head, body, config),
            Chosen::S3(p) => p.classify_read(head, body, config),
        }
    }

    fn refuse(&self, refusal: &Refusal, withhold: bool) -> ::http::Response<Full<Bytes>> {
        match self {
            Chosen::Http(p) => p.refuse(refusal, withhold),
            Chosen::S3(p) => p.refuse(refusal, withhold),
        }
    }

    fn upload_id(&self, body: &[u8]) -> Option<String> {
        match self {
            Chosen::Http(p) => p.upload_id(body),
            Chosen::S3(p) => p.upload_id(body),
        }
    }

    fn failed_late(&self, body: &[u8]) -> bool {
        match self {
            Chosen::Http(p) => p.failed_late(body),
            Chosen::S3(p) => p.failed_late(body),
        }
    }

    fn honours(&self, kind: Pinned, pin: &Pin) -> bool {
        match self {
            Chosen::Http(p) => p.honours(kind, pin),
            Chosen::S3(p) => p.honours(kind, pin),
        }
    }

    fn completed_tag(&self, body: &[u8]) -> Option<Box<str>> {
        match self {
            Chosen::Http(p) => p.completed_tag(body),
            Chosen::S3(p) => p.completed_tag(body),
        }
    }

    fn signed(&self, headers: &HeaderMap, uri: &::http::Uri, name: &HeaderName) -> bool {
        match self {
            Chosen::Http(p) => p.signed(headers, uri, name),
            Chosen::S3(p) => p.signed(headers, uri, name),
        }
    }

    fn learning_head(
        &self,
        head: &mut Request<RequestBody>,
        target: &mut PathAndQuery,
        client: &HeaderMap,
        config: &Config,
    ) -> bool {
        match self {
            Chosen::Http(p) => p.learning_head(head, target, client, config),
            Chosen::S3(p) => p.learning_head(head, target, client, config),
        }
    }
}

/// Headers of a client's write that the `HEAD` learning its key's state leaves out, where the
/// protocol sends one as the client would ([`Protocol::learning_head`]): those about the
/// write's body, and (with every `If-…` and WebDAV's `If`) its conditions. Hop-by-hop ones go
/// on the way out.
const HEAD_DROPS: [HeaderName; 9] =
    [CONTENT_LENGTH, TRANSFER_ENCODING, CONTENT_TYPE, CONTENT_ENCODING, CONTENT_RANGE, EXPECT, RANGE, TRAILER, TE];

/// The protocol of `backend`.
pub fn for_backend(backend: &BackendConfig) -> Chosen {
    match backend.protocol {
        BackendProtocol::Http => Chosen::Http(Http),
        BackendProtocol::S3 => Chosen::S3(S3),
    }
}

/// What a data directory records of how requests map to fence keys: if it changes, existing
/// `max_seen` values would sit under keys no request maps to any more.
pub fn keying(config: &Config) -> String {
    match config.backend.protocol {
        BackendProtocol::Http => keys::keying(&config.paths, &config.fence.scopes),
        BackendProtocol::S3 => keys::object_keying(&config.fence.scopes),
    }
}
