//! Which S3 writes are pinned (docs/s3.md#pins), what a completion's answer pins, and the
//! `HEAD` that learns an object's state.

use bytes::Bytes;
use http_body_util::Full;

use super::tests::config;
use super::*;
use crate::request::protocol::http::tests::request;

/// How `method target` with `headers` is pinned under the `[s3]`/rules TOML `extra`.
fn pin_of(method: &str, target: &str, headers: &[(&str, &str)], extra: &str) -> Option<Pinned> {
    let mut all = vec![("fencing-token", "7")];
    all.extend_from_slice(headers);
    let req = request(method, target, &all, "");
    match S3.classify(&Head::of(&req), &config(extra)) {
        Ok(Plan::Write(w)) => w.pin,
        other => panic!("{method} {target}: {other:?}"),
    }
}

#[test]
fn puts_and_completions_are_pinned_by_default_and_deletes_where_the_server_honours_if_match() {
    let pin = |method: &str, target: &str, headers: &[(&str, &str)]| pin_of(method, target, headers, "");
    let copy = [("x-amz-copy-source", "/bk1/src")];
    assert_eq!(pin("PUT", "/bk1/k", &[]), Some(Pinned::Put), "PutObject");
    assert_eq!(pin("PUT", "/bk1/k?x-id=PutObject", &[]), Some(Pinned::Put), "a qualifier is no operation");
    assert_eq!(pin("PUT", "/k", &[("host", "bk1.s3.example.com")]), Some(Pinned::Put), "virtual-host style");
    assert_eq!(pin("POST", "/bk1/k?uploadId=u1", &[]), Some(Pinned::Put), "CompleteMultipartUpload");
    for (method, target, headers, what) in [
        ("PUT", "/bk1/k", &copy[..], "CopyObject"),
        ("PUT", "/bk1/k?partNumber=1&uploadId=u1", &[][..], "UploadPart"),
        ("PUT", "/bk1/k?partNumber=1&uploadId=u1", &copy[..], "UploadPartCopy"),
        ("PUT", "/bk1/k?tagging", &[][..], "PutObjectTagging"),
        ("PUT", "/bk1/k?acl", &[][..], "PutObjectAcl"),
        ("PUT", "/bk1/k?versionId=v1", &[][..], "a version's write"),
        ("POST", "/bk1/k?uploads", &[][..], "CreateMultipartUpload"),
        ("DELETE", "/bk1/k?uploadId=u1", &[][..], "AbortMultipartUpload"),
        ("DELETE", "/bk1/k", &[][..], "DeleteObject, s3.conditional_deletes off"),
        ("PUT", "/bk1", &[][..], "CreateBucket"),
    ] {
        assert_eq!(pin(method, target, headers), None, "{what}");
    }
    let honoured = "conditional_deletes = true\n";
    assert_eq!(pin_of("DELETE", "/bk1/k", &[], honoured), Some(Pinned::Delete), "DeleteObject");
    assert_eq!(pin_of("DELETE", "/bk1/k?versionId=v1", &[], honoured), None, "a version's delete");
    assert_eq!(pin_of("DELETE", "/bk1/k?tagging", &[], honoured), None, "DeleteObjectTagging");
    // AWS, moto and s3s-fs delete whatever If-None-Match says.
    let tag = Pin::Tag("\"t\"".into());
    assert!(S3.honours(Pinned::Delete, &tag) && !S3.honours(Pinned::Delete, &Pin::Absent));
    assert!(S3.honours(Pinned::Put, &tag) && S3.honours(Pinned::Put, &Pin::Absent));
}

#[test]
fn a_rule_turns_pins_off_and_a_scope_is_never_pinned() {
    let rules = "[[fence.rules]]\nprefix = \"/bk1/off/\"\npin = \"off\"\n\
                 [[fence.rules]]\nprefix = \"/bk1/off/on/\"\npin = \"etag\"\n\
                 [[fence.scopes]]\nprefix = \"/bk1/db\"\n";
    assert_eq!(pin_of("PUT", "/bk1/off/k", &[], rules), None);
    assert_eq!(pin_of("PUT", "/bk1/off/on/k", &[], rules), Some(Pinned::Put), "the longest rule");
    assert_eq!(pin_of("PUT", "/bk1/k", &[], rules), Some(Pinned::Put), "no rule: on");
    assert_eq!(pin_of("PUT", "/bk1/db/wal/1", &[], rules), None, "one fence key for many objects");
}

#[test]
fn a_completions_entity_tag_is_read_from_its_body() {
    let aws = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CompleteMultipartUploadResult \
               xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Location>https://b.s3/k</Location><Bucket>b</Bucket>\
               <Key>k</Key><ETag>&quot;3858f622-9&quot;</ETag></CompleteMultipartUploadResult>";
    let moto = "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<CompleteMultipartUploadResponse><Bucket>b</Bucket>\
                <Key>k</Key><ETag>\"cb8d-1\"</ETag></CompleteMultipartUploadResponse>";
    assert_eq!(operation::completed_tag(aws.as_bytes()).as_deref(), Some("\"3858f622-9\""));
    assert_eq!(operation::completed_tag(moto.as_bytes()).as_deref(), Some("\"cb8d-1\""));
    for none in [
        "<CompleteMultipartUploadResult><ETag>cb8d-1</ETag></CompleteMultipartUploadResult>",
        "<CompleteMultipartUploadResult><ETag>W/\"cb8d-1\"</ETag></CompleteMultipartUploadResult>",
        "<CompleteMultipartUploadResult><Key>k</Key></CompleteMultipartUploadResult>",
        "<CompleteMultipartUploadResult><ETag>\"a\"</ETag><ETag>\"b\"</ETag></CompleteMultipartUploadResult>",
        "<Error><Code>InternalError</Code><ETag>\"a\"</ETag></Error>",
        "not xml",
    ] {
        assert_eq!(operation::completed_tag(none.as_bytes()), None, "{none}");
    }
}

#[test]
fn the_learning_head_is_of_the_path_alone_to_the_writes_host_and_signed_only_with_credentials() {
    use crate::upstream::RequestBody;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "s3cret\n").unwrap();
    let signed = config(&format!(
        "[s3.credentials]\naccess_key_id = \"AKIDEXAMPLE\"\nsecret_access_key_file = {:?}\n",
        secret.display().to_string()
    ));
    let ready = |config: &Config, uri: &str, host: Option<&'static str>| {
        let mut head = Request::new(RequestBody::Read(Full::new(Bytes::new())));
        *head.uri_mut() = uri.parse().unwrap();
        let mut target =
            PathAndQuery::from_str(uri.parse::<http::Uri>().unwrap().path_and_query().unwrap().as_str()).unwrap();
        let mut client = HeaderMap::new();
        if let Some(host) = host {
            client.insert(HOST, http::HeaderValue::from_static(host));
        }
        let asked = S3.learning_head(&mut head, &mut target, &client, config);
        (asked, head, target)
    };
    let (asked, _, target) = ready(&config(""), "/bk1/k?uploadId=u1", Some("127.0.0.1:9000"));
    assert!(!asked, "without credentials");
    assert_eq!(target.as_str(), "/bk1/k?uploadId=u1", "left as it was");
    let (asked, head, target) = ready(&signed, "/bk1/a%20b?uploadId=u1&X-Amz-Signature=x", Some("127.0.0.1:9000"));
    assert!(asked);
    assert_eq!((target.as_str(), head.uri().to_string().as_str()), ("/bk1/a%20b", "/bk1/a%20b"), "no query");
    assert_eq!(head.headers()[HOST], "127.0.0.1:9000", "the client's host");
    let authorization = head.headers()[http::header::AUTHORIZATION].to_str().unwrap();
    assert!(authorization.starts_with("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/"), "{authorization}");
    assert!(authorization.contains("/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-content-sha256;x-amz-date,"));
    assert_eq!(head.headers()["x-amz-content-sha256"], sigv4::EMPTY_SHA256);
    let (_, head, _) = ready(&signed, "http://bk1.s3.example.com:9000/k", Some("elsewhere"));
    assert_eq!(head.headers()[HOST], "bk1.s3.example.com:9000", "an absolute target's authority wins");
    let (_, head, _) = ready(&signed, "/bk1/k", None);
    assert_eq!(head.headers()[HOST], "127.0.0.1:9", "else the backend's");
}

#[test]
fn a_header_is_signed_where_sigv4_names_it_in_authorization_or_a_presigned_query() {
    let name = http::header::IF_MATCH;
    let signed = |auth: Option<&'static str>, target: &str| {
        let mut headers = HeaderMap::new();
        if let Some(auth) = auth {
            headers.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static(auth));
        }
        S3.signed(&headers, &target.parse().unwrap(), &name)
    };
    let v4 = "AWS4-HMAC-SHA256 Credential=AK/20261205/us-east-1/s3/aws4_request, \
              SignedHeaders=host;if-match;x-amz-date, Signature=abc";
    assert!(signed(Some(v4), "/b/k"));
    let without = "AWS4-HMAC-SHA256 Credential=AK/x, SignedHeaders=host;x-amz-date, Signature=abc";
    assert!(!signed(Some(without), "/b/k"));
    assert!(!signed(Some("AWS AK:c2lnbmF0dXJl"), "/b/k"), "SigV2 signs no If- header");
    let v4a =
        "AWS4-ECDSA-P256-SHA256 Credential=AK/20261205/s3/aws4_request, SignedHeaders=host;if-match, Signature=ab";
    assert!(signed(Some(v4a), "/b/k"), "SigV4a");
    assert!(signed(None, "/b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-SignedHeaders=host%3BIf-Match"));
    assert!(!signed(None, "/b/k?X-Amz-SignedHeaders=host"));
    assert!(!signed(None, "/b/k"));
}
