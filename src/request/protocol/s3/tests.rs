//! What S3 classification makes of requests: which object or bucket, read or write, the
//! target forwarded unchanged, and refusals as S3's XML.

use http::StatusCode;
use http_body_util::BodyExt;

use super::*;
use crate::config::Config;
use crate::request::protocol::http::tests::request;

pub(super) fn config(extra: &str) -> Config {
    let text = format!(
        "[backend]\nurl = \"http://127.0.0.1:9\"\nprotocol = \"s3\"\n[store]\ndir = \"/tmp/x\"\n\
         [s3]\nvirtual_host_suffixes = [\"s3.example.com\"]\n{extra}"
    );
    Config::from_toml_str(&text).unwrap()
}

/// The plan of `method target` with `headers` and the token 7.
fn plan(method: &str, target: &str, headers: &[(&str, &str)]) -> Result<Plan, Refusal> {
    let mut all = vec![("fencing-token", "7")];
    all.extend_from_slice(headers);
    let req = request(method, target, &all, "");
    S3.classify(&Head::of(&req), &config(""))
}

/// The one key a write touches and its coverage.
fn touched(method: &str, target: &str, headers: &[(&str, &str)]) -> (String, Coverage) {
    match plan(method, target, headers) {
        Ok(Plan::Write(w)) => {
            assert_eq!(w.touches.len(), 1, "{method} {target}");
            assert_eq!(w.target.as_str(), target, "forwarded as sent");
            assert!(w.set_headers.is_empty(), "nothing set on a signed request");
            (w.touches[0].key.clone(), w.touches[0].coverage)
        }
        other => panic!("{method} {target}: {other:?}"),
    }
}

fn object(key: &str) -> (String, Coverage) {
    (key.to_owned(), Coverage::Key)
}

fn bucket(key: &str) -> (String, Coverage) {
    (key.to_owned(), Coverage::Subtree)
}

#[test]
fn keys_are_decoded_once_and_nothing_else() {
    assert_eq!(touched("PUT", "/bk1/a/b", &[]), object("/bk1/a/b"));
    assert_eq!(touched("PUT", "/bk1/a%2Fb", &[]), object("/bk1/a/b"), "S3 reads %2F as /");
    assert_eq!(touched("PUT", "/bk1/a//b", &[]), object("/bk1/a//b"), "no slash merged");
    assert_eq!(touched("PUT", "/bk1/a/./b", &[]), object("/bk1/a/./b"), "no dot segment resolved");
    assert_eq!(touched("PUT", "/bk1/a/../b", &[]), object("/bk1/a/../b"));
    assert_eq!(touched("PUT", "/bk1/a+b", &[]), object("/bk1/a+b"), "+ is literal in a path");
    assert_eq!(touched("PUT", "/bk1/%2541", &[]), object("/bk1/%41"), "decoded once");
    assert_eq!(touched("PUT", "/bk1/caf%C3%A9", &[]), object("/bk1/café"));
    assert!(plan("PUT", "/bk1/%C3", &[]).is_err(), "not UTF-8");
    assert!(plan("PUT", "/bk1/%zz", &[]).is_err(), "malformed");
}

#[test]
fn path_and_virtual_host_style_name_one_key() {
    let host = |h: &'static str| [("host", h)];
    assert_eq!(touched("PUT", "/a/b", &host("bk1.s3.example.com")), object("/bk1/a/b"));
    // s3s matches its domains case-sensitively: there BK1.S3.Example.com is the bucket
    // bk1.s3.example.com, so a write naming a host in capitals is refused.
    assert!(plan("PUT", "/a/b", &host("BK1.S3.Example.com:9000")).is_err());
    assert_eq!(touched("PUT", "/bk1/a/b", &host("s3.example.com")), object("/bk1/a/b"), "path style at the suffix");
    assert_eq!(touched("PUT", "/bk1/a/b", &host("127.0.0.1:9000")), object("/bk1/a/b"));
    assert_eq!(touched("PUT", "/bk2/k", &host("bk1.s3.example.com")), object("/bk1/bk2/k"), "the host's bucket wins");
    assert!(plan("PUT", "/", &host("my.bk1.s3.example.com")).is_err(), "a bucket with dots, by host");
    assert_eq!(touched("PUT", "/my.bk1/k", &[]), object("/my.bk1/k"), "a bucket with dots, by path");
    let two = request("PUT", "/k", &[("fencing-token", "7"), ("host", "bk1.s3.example.com"), ("host", "x")], "");
    assert!(S3.classify(&Head::of(&two), &config("")).is_err(), "two hosts");
}

#[test]
fn bucket_names_s3_refuses_are_refused() {
    for target in ["/B1/k", "/b_1/k", "/ab/k", "/b%31x/k"] {
        let got = plan("PUT", target, &[]);
        assert!(matches!(got, Err(Refusal::BadRequest(_))) || target == "/b%31x/k", "{target}: {got:?}");
    }
    assert_eq!(touched("PUT", "/b%31x/k", &[]), object("/b1x/k"), "the bucket decodes too");
}

#[test]
fn operations_fence_their_object_or_their_bucket() {
    let copy = [("x-amz-copy-source", "/other/src")];
    assert_eq!(touched("PUT", "/bk1/k", &copy), object("/bk1/k"), "CopyObject fences the destination only");
    assert_eq!(touched("PUT", "/bk1/k?x-id=PutObject", &[]), object("/bk1/k"));
    assert_eq!(touched("DELETE", "/bk1/k", &[]), object("/bk1/k"));
    assert_eq!(touched("DELETE", "/bk1/k?versionId=3", &[]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k?tagging", &[]), object("/bk1/k"));
    assert_eq!(touched("DELETE", "/bk1/k?tagging", &[]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k?acl", &[]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k?retention", &[]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k?legal-hold", &[]), object("/bk1/k"));
    assert_eq!(touched("POST", "/bk1/k?restore", &[]), object("/bk1/k"));
    assert_eq!(touched("POST", "/bk1/k?uploads", &[]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k?partNumber=1&uploadId=u", &[]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k?partNumber=1&uploadId=u", &copy), object("/bk1/k"));
    assert_eq!(touched("POST", "/bk1/k?uploadId=u", &[]), object("/bk1/k"));
    assert_eq!(touched("DELETE", "/bk1/k?uploadId=u", &[]), object("/bk1/k"));
    // Over the bucket: its own writes, DeleteObjects, form uploads, and the unknown.
    assert!(matches!(plan("POST", "/bk1?delete", &[]), Ok(Plan::ReadBody { .. })), "DeleteObjects reads its body");
    assert_eq!(touched("POST", "/bk1/", &[]), bucket("/bk1"));
    assert_eq!(touched("PUT", "/bk1", &[]), bucket("/bk1"));
    assert_eq!(touched("DELETE", "/bk1", &[]), bucket("/bk1"));
    for q in ["lifecycle", "replication", "versioning", "policy", "acl", "tagging", "object-lock"] {
        assert_eq!(touched("PUT", &format!("/bk1?{q}"), &[]), bucket("/bk1"), "{q}");
    }
    assert_eq!(touched("PUT", "/bk1/k?newthing", &[]), bucket("/bk1"), "unknown: the whole bucket");
    assert_eq!(touched("PUT", "/bk1/k?tagging&acl", &[]), bucket("/bk1"));
    assert_eq!(touched("PATCH", "/bk1/k", &[]), bucket("/bk1"));
    assert_eq!(touched("POST", "/bk1/k?%75ploads&x", &[]), bucket("/bk1"), "names decode before they are known");
    assert_eq!(touched("POST", "/", &[]), bucket("/"), "no bucket: everything");
}

#[test]
fn parts_and_completions_accept_the_token_that_created_the_upload() {
    let equal = |method, target| match plan(method, target, &[]) {
        Ok(Plan::Write(w)) => w.equal,
        other => panic!("{other:?}"),
    };
    assert_eq!(equal("PUT", "/bk1/k?partNumber=1&uploadId=u"), EqualToken::Accept);
    assert_eq!(equal("POST", "/bk1/k?uploadId=u"), EqualToken::Accept);
    assert_eq!(equal("PUT", "/bk1/k"), EqualToken::Reject);
    assert_eq!(equal("POST", "/bk1/k?uploads"), EqualToken::Reject);
}

#[test]
fn each_step_of_an_upload_names_its_object_and_id() {
    let step = |method, target| match plan(method, target, &[]) {
        Ok(Plan::Write(w)) => w.upload.map(|u| *u),
        other => panic!("{other:?}"),
    };
    let object = "/bk1/a b".to_owned();
    assert_eq!(step("POST", "/bk1/a%20b?uploads"), Some(UploadStep::Create { object: object.clone() }));
    let id = "x/y+z=".to_owned();
    assert_eq!(
        step("PUT", "/bk1/a%20b?partNumber=2&uploadId=x%2Fy%2Bz%3D"),
        Some(UploadStep::Part { object: object.clone(), id: id.clone() })
    );
    assert_eq!(step("POST", "/bk1/a%20b?uploadId=x%2Fy%2Bz%3D"), Some(UploadStep::End { object: object.clone(), id }));
    // A `+` in the query is a space to the servers.
    let spaced = UploadStep::End { object: object.clone(), id: "x y".into() };
    assert_eq!(step("POST", "/bk1/a%20b?uploadId=x+y"), Some(spaced));
    assert_eq!(step("DELETE", "/bk1/a%20b?uploadId=u"), Some(UploadStep::End { object, id: "u".into() }));
    assert_eq!(step("PUT", "/bk1/k"), None);
    let twice = plan("POST", "/bk1/k?uploadId=u&uploadId=v", &[]).unwrap_err();
    assert!(twice.to_string().contains("more than once"), "{twice}");
}

#[test]
fn the_id_of_a_created_upload_is_read_from_the_answer() {
    let answer = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<InitiateMultipartUploadResult \
        xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Bucket>bk1</Bucket><Key>k</Key>\
        <UploadId>VXBsb2FkIElE&amp;x</UploadId></InitiateMultipartUploadResult>";
    assert_eq!(S3.upload_id(answer).as_deref(), Some("VXBsb2FkIElE&x"));
    assert_eq!(S3.upload_id(b"<InitiateMultipartUploadResult><Key>k</Key></InitiateMultipartUploadResult>"), None);
    assert_eq!(S3.upload_id(b"<Error><Code>SlowDown</Code></Error>"), None);
    assert_eq!(S3.upload_id(b"\xff"), None);
}

#[test]
fn a_completion_that_failed_after_its_200_is_told_from_one_that_did_not() {
    let failed = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\n   <Error><Code>InternalError</Code>\
        <Message>We encountered an internal error. Please try again.</Message></Error>";
    assert!(S3.failed_late(failed));
    assert!(S3.failed_late(b"  \n <Error/>"), "after S3's keep-alive whitespace");
    let done = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CompleteMultipartUploadResult \
        xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Key>k</Key><ETag>\"e-1\"</ETag></CompleteMultipartUploadResult>";
    assert!(!S3.failed_late(done));
    assert!(!S3.failed_late(b""), "an abort's empty answer");
    assert!(!S3.failed_late(b"\xff<"));
}

#[test]
fn reads_pass_as_sent() {
    for (method, target) in [
        ("GET", "/bk1/k"),
        ("HEAD", "/bk1/k"),
        ("GET", "/bk1?list-type=2&prefix=a%2F"),
        ("GET", "/"),
        ("GET", "/bk1/k?uploadId=u"),
        ("OPTIONS", "/bk1/k"),
        ("POST", "/bk1/k?select&select-type=2"),
    ] {
        let req = request(method, target, &[], "");
        match S3.classify(&Head::of(&req), &config("")) {
            Ok(Plan::Pass { target: sent }) => assert_eq!(sent.as_str(), target),
            other => panic!("{method} {target}: {other:?}"),
        }
    }
}

#[test]
fn a_write_without_a_token_is_refused() {
    let req = request("PUT", "/bk1/k", &[], "");
    assert!(matches!(S3.classify(&Head::of(&req), &config("")), Err(Refusal::MissingToken { .. })));
}

#[tokio::test]
async fn refusals_are_s3_error_documents() {
    let req = request("PUT", "/bk1/k", &[], "");
    let refusal = S3.classify(&Head::of(&req), &config("")).unwrap_err();
    let resp = S3.refuse(&refusal, false);
    assert_eq!(resp.status(), StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(resp.headers()["content-type"], "application/xml");
    assert_eq!(resp.headers()["fencegate-error"], "missing_token");
    assert!(resp.headers().contains_key("x-amz-request-id"));
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let text = std::str::from_utf8(&body).unwrap();
    assert!(text.starts_with("<?xml"), "{text}");
    assert!(text.contains("<Code>MissingToken</Code>"), "{text}");
    assert!(text.contains("<Message>this method is fenced"), "{text}");
}

#[test]
fn keys_a_file_system_would_resolve_are_refused_where_the_server_stores_files() {
    let paths = config("flat_keys = false");
    let plan = |target: &str| {
        let req = request("PUT", target, &[("fencing-token", "7")], "");
        S3.classify(&Head::of(&req), &paths)
    };
    for target in ["/bk1/a//b", "/bk1/a/./b", "/bk1/a/../b", "/bk1//a", "/bk1/a/%2e%2e/b", "/bk1/a%2F%2Fb"] {
        assert!(matches!(plan(target), Err(Refusal::BadRequest(_))), "{target}");
    }
    for target in ["/bk1/a/b", "/bk1/a/b/", "/bk1/a.b/..c", "/bk1/%2e%2ex"] {
        assert!(matches!(plan(target), Ok(Plan::Write(_))), "{target}");
    }
    assert!(matches!(plan_flat("/bk1/a//b"), Ok(Plan::Write(_))), "flat keys take it");
}

fn plan_flat(target: &str) -> Result<Plan, Refusal> {
    plan("PUT", target, &[])
}

#[test]
fn a_scope_makes_a_prefix_of_objects_one_fence() {
    let scoped = config("[[fence.scopes]]\nprefix = \"/bk1/db\"");
    let key = |target: &str| {
        let req = request("PUT", target, &[("fencing-token", "7")], "");
        match S3.classify(&Head::of(&req), &scoped) {
            Ok(Plan::Write(w)) => w.touches[0].key.clone(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(key("/bk1/db/wal/0001.sst"), "/bk1/db");
    assert_eq!(key("/bk1/db/manifest/2"), "/bk1/db");
    assert_eq!(key("/bk1/dbx/k"), "/bk1/dbx/k", "on a segment boundary only");
    assert_eq!(key("/bk1/other"), "/bk1/other");
}

#[test]
fn delete_objects_fences_every_key_its_body_names() {
    let req = request("POST", "/bk1?delete", &[("fencing-token", "7")], "");
    let body =
        b"<Delete><Object><Key>a//b</Key></Object><Object><Key>c</Key></Object><Object><Key>c</Key></Object></Delete>";
    match S3.classify_read(&Head::of(&req), body, &config("")) {
        Ok(Plan::Write(w)) => {
            let keys: Vec<_> = w.touches.iter().map(|t| (t.key.as_str(), t.coverage)).collect();
            assert_eq!(keys, [("/bk1/a//b", Coverage::Key), ("/bk1/c", Coverage::Key)]);
            assert_eq!(w.target.as_str(), "/bk1?delete");
        }
        other => panic!("{other:?}"),
    }
    let paths = config("flat_keys = false");
    assert!(S3.classify_read(&Head::of(&req), body, &paths).is_err(), "a//b on a file-system server");
    assert!(S3.classify_read(&Head::of(&req), b"<Delete/>", &config("")).is_err());
}

#[test]
fn a_write_to_a_host_the_server_may_read_a_bucket_from_is_refused() {
    // Path style through an IP literal or a suffix itself; virtual-host style under a suffix.
    assert_eq!(touched("PUT", "/bk1/k", &[("host", "127.0.0.1:8080")]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k", &[("host", "[::1]:8080")]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/bk1/k", &[("host", "s3.example.com")]), object("/bk1/k"));
    assert_eq!(touched("PUT", "/k", &[("host", "bk1.s3.example.com")]), object("/bk1/k"));
    // moto reads bucket bk1 from bk1.other.test, s3s and AWS bucket bk1.other.test: either
    // way not the path's bucket.
    for host in ["bk1.other.test", "bk1.other.test:9000", "fencegate", "BK1.S3.EXAMPLE.COM"] {
        assert!(plan("PUT", "/bk2/k", &[("host", host)]).is_err(), "{host}");
    }
    let two =
        request("PUT", "/bk2/k", &[("fencing-token", "7"), ("host", "127.0.0.1"), ("host", "bk1.other.test")], "");
    let no_suffixes = Config::from_toml_str(
        "[backend]\nurl = \"http://127.0.0.1:9\"\nprotocol = \"s3\"\n[store]\ndir = \"/tmp/x\"\n",
    )
    .unwrap();
    assert!(S3.classify(&Head::of(&two), &no_suffixes).is_err(), "two hosts, no suffixes");
    assert!(plan("PUT", "/bk2/k", &[("host", "bk1.other.test")]).is_err());
    // Reads pass whatever the host.
    assert!(matches!(plan("GET", "/bk2/k", &[("host", "bk1.other.test")]), Ok(Plan::Pass { .. })));
}
