//! Refusals as S3 writes its errors: an `<Error>` document with a `Code`, a `Message`, the
//! `Resource` and a `RequestId`, so the SDKs read the code. The status is the one pinned
//! mapping's ([`Refusal::status_and_code`]); a refusal worth retrying later (a quarantine, a
//! store or backend that is unavailable) is `SlowDown`, which the SDKs back off on, while a
//! stale token's 409 is not retried.

use bytes::Bytes;
use http::Response;
use http::StatusCode;
use http_body_util::Full;
use quick_xml::escape::escape;

use crate::refusal::Refusal;

/// The S3 `<Error>` answer to `refusal`; with `withhold`, without the levels it would name.
pub(super) fn response(refusal: &Refusal, withhold: bool) -> Response<Full<Bytes>> {
    let code = match refusal.status() {
        StatusCode::SERVICE_UNAVAILABLE => "SlowDown".to_owned(),
        StatusCode::PAYLOAD_TOO_LARGE => "EntityTooLarge".to_owned(),
        _ => camel(refusal.code()),
    };
    let request_id = request_id();
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{}</Message>\
         <Resource>{}</Resource><RequestId>{request_id}</RequestId></Error>",
        escape(refusal.message(withhold).as_str()),
        escape(refusal.resource().unwrap_or_default()),
    );
    let mut resp = refusal.response_with(Bytes::from(body), "application/xml");
    if let Ok(id) = http::HeaderValue::from_str(&request_id) {
        resp.headers_mut().insert("x-amz-request-id", id);
    }
    resp
}

/// `stale_token` as S3 spells codes: `StaleToken`.
fn camel(code: &str) -> String {
    code.split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map(|first| first.to_ascii_uppercase().to_string() + chars.as_str()).unwrap_or_default()
        })
        .collect()
}

/// An id for one answer, as S3 gives every answer one: 16 hex digits, random.
fn request_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = foldhash::quality::RandomState::default().build_hasher();
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    format!("{:016X}", hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_spelled_as_s3_spells_them() {
        assert_eq!(camel("stale_token"), "StaleToken");
        assert_eq!(camel("missing_token"), "MissingToken");
        assert_eq!(camel("invalid_request"), "InvalidRequest");
    }
}
