//! AWS Signature Version 4 for the one request fencegate makes of an S3 server on its own: the
//! `HEAD` that learns an object's state for a pinned write (docs/pins.md), signed with
//! `[s3.credentials]`. Only what that request needs: no query, no body (the empty body's hash
//! as `x-amz-content-sha256`), the path signed exactly as it is sent (S3 does not encode a
//! path a second time), and `host`, `x-amz-content-sha256` and `x-amz-date` signed.

use std::fmt::Write as _;
use std::time::SystemTime;

use http::header::{AUTHORIZATION, HOST, HeaderMap, HeaderName, HeaderValue};
use ring::{digest, hmac};

use crate::config::S3Credentials;

/// The SHA-256 of an empty body, hex: `x-amz-content-sha256` of a request without one.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

static CONTENT_SHA256: HeaderName = HeaderName::from_static("x-amz-content-sha256");
static AMZ_DATE: HeaderName = HeaderName::from_static("x-amz-date");

/// Sets on `headers` what makes a bodiless `method` of `path` (sent as it is, no query) to
/// `host` signed by `credentials` at `at`: `Host`, `x-amz-content-sha256`, `x-amz-date` and
/// `Authorization`. `None` when a value cannot be a header (a host with control bytes).
pub fn sign_bodiless(
    headers: &mut HeaderMap,
    credentials: &S3Credentials,
    method: &str,
    host: &str,
    path: &str,
    at: SystemTime,
) -> Option<()> {
    let amz_date = amz_date(at);
    let signed = [("host", host), ("x-amz-content-sha256", EMPTY_SHA256), ("x-amz-date", amz_date.as_str())];
    let request = Canonical { method, uri: path, query: "", headers: &signed, payload_hash: EMPTY_SHA256 };
    let authorization = authorization(credentials, &request, &amz_date);
    headers.insert(HOST, HeaderValue::from_str(host).ok()?);
    headers.insert(CONTENT_SHA256.clone(), HeaderValue::from_static(EMPTY_SHA256));
    headers.insert(AMZ_DATE.clone(), HeaderValue::from_str(&amz_date).ok()?);
    headers.insert(AUTHORIZATION, HeaderValue::from_str(&authorization).ok()?);
    Some(())
}

/// What SigV4 signs of a request, each part already in its canonical form.
struct Canonical<'a> {
    method: &'a str,
    uri: &'a str,
    query: &'a str,
    /// The signed headers, names in lower case, sorted by name, values trimmed.
    headers: &'a [(&'a str, &'a str)],
    payload_hash: &'a str,
}

impl Canonical<'_> {
    fn signed_headers(&self) -> String {
        self.headers.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(";")
    }

    /// The canonical request: method, URI, query, headers, signed headers and payload hash,
    /// one a line.
    fn text(&self) -> String {
        let mut text = format!("{}\n{}\n{}\n", self.method, self.uri, self.query);
        for (name, value) in self.headers {
            let _ = writeln!(text, "{name}:{value}");
        }
        let _ = write!(text, "\n{}\n{}", self.signed_headers(), self.payload_hash);
        text
    }
}

/// The `Authorization` value signing `request` at `amz_date` (`YYYYMMDDTHHMMSSZ`).
fn authorization(credentials: &S3Credentials, request: &Canonical<'_>, amz_date: &str) -> String {
    let date = &amz_date[..8.min(amz_date.len())];
    let scope = format!("{date}/{}/s3/aws4_request", credentials.region);
    let hashed = hex(digest::digest(&digest::SHA256, request.text().as_bytes()).as_ref());
    let to_sign = format!("AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashed}");
    let secret = format!("AWS4{}", credentials.secret_access_key.expose());
    let mut key = mac(secret.as_bytes(), date.as_bytes());
    for part in [credentials.region.as_bytes(), b"s3", b"aws4_request"] {
        key = mac(&key, part);
    }
    let signature = hex(&mac(&key, to_sign.as_bytes()));
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={}, Signature={signature}",
        credentials.access_key_id,
        request.signed_headers()
    )
}

fn mac(key: &[u8], data: &[u8]) -> Vec<u8> {
    hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data).as_ref().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `at` as SigV4 writes it: `YYYYMMDDTHHMMSSZ`, UTC.
fn amz_date(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string().chars().filter(|c| !matches!(c, '-' | ':')).collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::config::SecretKey;

    /// The example credentials of AWS's SigV4 documentation.
    fn example() -> S3Credentials {
        S3Credentials {
            access_key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_access_key_file: PathBuf::new(),
            secret_access_key: SecretKey::new("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
            region: "us-east-1".into(),
        }
    }

    /// 2013-05-24T00:00:00Z, the time of AWS's examples.
    fn may_24() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_369_353_600)
    }

    #[test]
    fn the_get_object_example_of_aws_s3_docs_is_signed_as_published() {
        // "Signature Calculations for the Authorization Header: Transferring Payload in a Single
        // Chunk", example GET Object.
        let headers = [
            ("host", "examplebucket.s3.amazonaws.com"),
            ("range", "bytes=0-9"),
            ("x-amz-content-sha256", EMPTY_SHA256),
            ("x-amz-date", "20130524T000000Z"),
        ];
        let request =
            Canonical { method: "GET", uri: "/test.txt", query: "", headers: &headers, payload_hash: EMPTY_SHA256 };
        assert_eq!(
            authorization(&example(), &request, &amz_date(may_24())),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    #[test]
    fn a_head_of_an_escaped_path_is_signed_as_botocore_signs_it() {
        // botocore 1.43's S3SigV4Auth on HEAD http://127.0.0.1:9000/bkt/caf%C3%A9%20x%2Bp%21 with
        // x-amz-content-sha256 set to EMPTY_SHA256, its clock at 2013-05-24T00:00:00Z: the path is
        // signed as sent, its escapes not escaped again.
        let mut headers = HeaderMap::new();
        let path = "/bkt/caf%C3%A9%20x%2Bp%21";
        sign_bodiless(&mut headers, &example(), "HEAD", "127.0.0.1:9000", path, may_24()).unwrap();
        assert_eq!(
            headers[AUTHORIZATION],
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;x-amz-content-sha256;x-amz-date, \
             Signature=2a39c30754d2aaedbe604433f021e609a40574564ceead2cd805f21cff9fb4f8"
        );
        assert_eq!(
            (&headers[HOST], &headers["x-amz-date"]),
            (&HeaderValue::from_static("127.0.0.1:9000"), &HeaderValue::from_static("20130524T000000Z"))
        );
        assert_eq!(headers["x-amz-content-sha256"], EMPTY_SHA256);
    }

    #[test]
    fn a_host_that_cannot_be_a_header_is_not_signed() {
        let mut headers = HeaderMap::new();
        assert_eq!(sign_bodiless(&mut headers, &example(), "HEAD", "a\nb", "/b/k", may_24()), None);
    }
}
