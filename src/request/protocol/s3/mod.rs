//! S3-compatible object stores. A request names an object by bucket and key (path style, or
//! virtual-host style under `s3.virtual_host_suffixes`), decoded as S3 decodes it
//! ([`names`]); its operation, named by method, query and headers ([`operation`]), says what it
//! may change: the object, or (for bucket writes, DeleteObjects and every operation fencegate
//! does not know) the whole bucket. What is forwarded is the client's request unchanged, so
//! its signature still holds: the target as sent, no header set. Refusals are S3's `<Error>`
//! XML ([`error`]).

mod deleted;
mod error;
pub mod names;
pub mod operation;
pub mod sigv4;

use bytes::Bytes;
use std::str::FromStr as _;

use http::header::{CONNECTION, HOST, HeaderMap, HeaderName};
use http::uri::PathAndQuery;
use http::{Request, Response, Uri};
use http_body_util::Full;

use super::Protocol;
use crate::config::Config;
use crate::fence::{EqualToken, Pin, keys};
use crate::refusal::Refusal;
use crate::request::classify::{
    Coverage, Head, Named, Pinned, Plan, Touch, UploadStep, check_fenced, check_limits, fenced_write,
};
use crate::upstream::RequestBody;
use names::Named as Target;
use operation::Effect;

/// S3-compatible object storage (module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct S3;

impl Protocol for S3 {
    fn name(&self) -> &'static str {
        "s3"
    }

    fn classify(&self, head: &Head<'_>, config: &Config) -> Result<Plan, Refusal> {
        check_limits(head, &config.limits)?;
        let target = names::named(head, &config.s3)?;
        let object = matches!(target, Target::Object { .. });
        let effect = operation::effect(head.method, object, head.uri.query(), head.headers)?;
        if effect == Effect::Read {
            return Ok(Plan::Pass { target: head.target() });
        }
        names::check_path_style_host(head, &config.s3.virtual_host_suffixes)?;
        check_connection(head, config)?;
        let body_limit = check_fenced(head, &config.limits)?;
        if let (Effect::Listed, Target::Bucket(_)) = (effect, &target) {
            return Ok(Plan::ReadBody { limit: deleted::MAX_BODY });
        }
        let touch = match (&target, effect) {
            (Target::Object { bucket, key }, Effect::Object | Effect::Create | Effect::Part | Effect::End) => {
                object_touch(bucket, key, config)
            }
            (Target::Service, _) => Touch { key: "/".to_owned(), coverage: Coverage::Subtree },
            (Target::Bucket(bucket) | Target::Object { bucket, .. }, _) => {
                Touch { key: names::bucket_key(bucket), coverage: Coverage::Subtree }
            }
        };
        // Pinned only where the fence key is the object's own, not a scope's (which holds many
        // objects: one object's state would pin writes to the others).
        let pin = match &target {
            Target::Object { bucket, key } if touch.key == names::object_key(bucket, key) => {
                operation::pinned(head.method, effect, head.uri.query(), head.headers, config.s3.conditional_deletes)?
            }
            _ => None,
        };
        // The client's bytes, unchanged: the signature covers the target and the headers.
        let named = Named { touches: vec![touch], target: head.target(), set_headers: Vec::new(), body_limit, pin };
        let mut plan = fenced_write(head, config, named)?;
        if let (Plan::Write(write), Target::Object { bucket, key }) = (&mut plan, &target) {
            write.upload = upload_step(effect, bucket, key, head)?.map(Box::new);
            // A part, or the completion or abort of an upload, continues the write that its
            // CreateMultipartUpload fenced with the same token: that token is not stale for it.
            if matches!(effect, Effect::Part | Effect::End) {
                write.equal = EqualToken::Accept;
            }
        }
        Ok(plan)
    }

    fn upload_id(&self, body: &[u8]) -> Option<String> {
        operation::created_upload_id(body)
    }

    fn failed_late(&self, body: &[u8]) -> bool {
        operation::failed_late(body)
    }

    /// DeleteObjects, its body read: every key it names is fenced, so one stale key refuses the
    /// whole request and nothing is deleted.
    fn classify_read(&self, head: &Head<'_>, body: &[u8], config: &Config) -> Result<Plan, Refusal> {
        let Target::Bucket(bucket) = names::named(head, &config.s3)? else {
            return Err(Refusal::BadRequest("DeleteObjects names a bucket, not an object".into()));
        };
        let body_limit = check_fenced(head, &config.limits)?;
        let mut touches: Vec<Touch> = Vec::new();
        for key in deleted::keys(body)? {
            if !config.s3.flat_keys {
                names::check_path_key(&key)?;
            }
            let touch = object_touch(&bucket, &key, config);
            if !touches.contains(&touch) {
                touches.push(touch);
            }
        }
        // No precondition spans the keys of a batch.
        let named = Named { touches, target: head.target(), set_headers: Vec::new(), body_limit, pin: None };
        fenced_write(head, config, named)
    }

    fn refuse(&self, refusal: &Refusal, withhold: bool) -> Response<Full<Bytes>> {
        error::response(refusal, withhold)
    }

    /// An S3 server answers only a signed `HEAD`: one of the object's path alone (a
    /// completion's `uploadId` and a presigned URL's signature stay behind), to the host the
    /// write goes to, signed with `[s3.credentials]`. Without them the write goes unpinned.
    fn learning_head(
        &self,
        head: &mut Request<RequestBody>,
        target: &mut PathAndQuery,
        client: &HeaderMap,
        config: &Config,
    ) -> bool {
        let Some(credentials) = &config.s3.credentials else { return false };
        // The host the upstream names in the write's own request: the target's authority, else
        // the client's Host, else the backend's.
        let host = head
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| client.get(HOST).and_then(|h| h.to_str().ok()).map(str::to_owned))
            .or_else(|| config.backend.url.authority().map(|a| a.as_str().to_owned()));
        let (Some(host), Ok(path)) = (host, PathAndQuery::from_str(target.path())) else { return false };
        let (signed, now) = (head.headers_mut(), std::time::SystemTime::now());
        if sigv4::sign_bodiless(signed, credentials, "HEAD", &host, path.as_str(), now).is_none() {
            return false;
        }
        *head.uri_mut() = Uri::from(path.clone());
        *target = path;
        true
    }

    /// S3 servers (AWS, moto, s3s-fs) ignore `If-None-Match` on DeleteObject: a delete of an
    /// object fencegate last saw absent is sent as without pins.
    fn honours(&self, kind: Pinned, pin: &Pin) -> bool {
        !(kind == Pinned::Delete && *pin == Pin::Absent)
    }

    fn completed_tag(&self, body: &[u8]) -> Option<Box<str>> {
        operation::completed_tag(body)
    }

    /// A SigV4 (or SigV4a) signature names its headers in `Authorization`
    /// (`SignedHeaders=a;b`) or, for a presigned URL, in the query (`X-Amz-SignedHeaders`).
    /// SigV2 signs no `If-…` header.
    fn signed(&self, headers: &HeaderMap, uri: &Uri, name: &HeaderName) -> bool {
        let names = |list: &str| list.split(';').any(|n| n.trim().eq_ignore_ascii_case(name.as_str()));
        let by_header = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.starts_with("AWS4-"))
            .and_then(|v| v.split("SignedHeaders=").nth(1))
            .is_some_and(|rest| names(rest.split(',').next().unwrap_or_default()));
        let by_query = operation::pairs(uri.query())
            .filter(|(k, _)| *k == "X-Amz-SignedHeaders")
            .any(|(_, v)| crate::fence::keys::decode_once(v).is_ok_and(|v| names(&v)));
        by_header || by_query
    }
}

/// The part a write with `effect` to the object `key` in `bucket` plays in a multipart upload.
fn upload_step(effect: Effect, bucket: &str, key: &str, head: &Head<'_>) -> Result<Option<UploadStep>, Refusal> {
    let object = names::object_key(bucket, key);
    let id = || {
        operation::upload_id(head.uri.query())?.ok_or_else(|| {
            Refusal::BadRequest("a multipart upload's part, completion or abort names no uploadId".into())
        })
    };
    Ok(match effect {
        Effect::Create => Some(UploadStep::Create { object }),
        Effect::Part => Some(UploadStep::Part { object, id: id()? }),
        Effect::End => Some(UploadStep::End { object, id: id()? }),
        _ => None,
    })
}

/// What a write to the object `key` in `bucket` touches: its fence key, which a scope over its
/// prefix makes the scope's.
fn object_touch(bucket: &str, key: &str, config: &Config) -> Touch {
    let object = names::object_key(bucket, key);
    Touch { key: keys::resource_key(&object, &config.fence.scopes).to_owned(), coverage: Coverage::Key }
}

/// Refuses a `Connection` header that names a header fencegate reads: hop-by-hop headers are
/// dropped on the way to the backend, after the check that read them.
fn check_connection(head: &Head<'_>, config: &Config) -> Result<(), Refusal> {
    let read: [&HeaderName; 2] = [&config.fence.header, &config.verify.signature_header];
    for value in head.headers.get_all(CONNECTION) {
        let Ok(text) = value.to_str() else { continue };
        for name in text.split(',').map(str::trim) {
            if read.iter().any(|h| name.eq_ignore_ascii_case(h.as_str())) {
                return Err(Refusal::InvalidHeader {
                    name: CONNECTION.to_string(),
                    reason: format!("names {name}, which fencegate reads: the header would be dropped after the check"),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod pin_tests;
#[cfg(test)]
mod tests;
