//! Writes that change more than their own path, against real nginx WebDAV: a stale token must
//! change no file the backend holds, whatever method, Destination or collection carries it.
//! Each test checks nginx's own files, not fencegate's key sets.

use crate::common;

use std::path::Path;

use common::nginx::{Nginx, start_nginx};
use common::{Harness, Resp};

/// fencegate in front of `nginx`, with `tweak` applied to its config.
async fn proxy(nginx: &Nginx, tweak: impl FnOnce(&mut fencegate::Config)) -> Harness {
    let url = format!("http://{}", nginx.addr);
    Harness::start_with(|c| {
        c.backend.url = url.parse().unwrap();
        tweak(c);
    })
    .await
}

fn file(root: &Path, path: &str) -> Option<String> {
    std::fs::read_to_string(root.join(path.trim_start_matches('/'))).ok()
}

async fn write(h: &Harness, method: &str, path: &str, token: u64, extra: &[(&str, &str)], body: &str) -> Resp {
    let token = token.to_string();
    let mut headers = vec![("fencing-token", token.as_str())];
    headers.extend_from_slice(extra);
    h.send(method, path, &headers, body.to_owned()).await
}

#[tokio::test]
async fn a_stale_move_or_copy_never_replaces_its_destination_however_it_is_spelled() {
    let Some(nginx) = start_nginx().await else { return };
    let h = proxy(&nginx, |_| {}).await;
    assert_eq!(write(&h, "PUT", "/acct", 1000, &[], "precious").await.status, 201);
    let host = h.addr.to_string();
    let absolute = format!("http://{host}/acct");
    for (i, spelling) in ["/acct", absolute.as_str(), "/%61cct", "//acct", "/x/../acct"].into_iter().enumerate() {
        let scratch = format!("/scratch{i}");
        assert_eq!(write(&h, "PUT", &scratch, 1, &[], "junk").await.status, 201);
        for method in ["MOVE", "COPY"] {
            let r = write(&h, method, &scratch, 5, &[("destination", spelling)], "").await;
            r.assert_refused(409, "stale_token");
            assert_eq!(r.json()["resource"], "/acct", "{method} {spelling}");
        }
        assert_eq!(file(&nginx.root, "/acct").as_deref(), Some("precious"), "{spelling}");
        assert_eq!(file(&nginx.root, &scratch).as_deref(), Some("junk"), "a refused MOVE leaves its source");
    }
    let elsewhere = write(&h, "MOVE", "/scratch0", 5000, &[("destination", "http://elsewhere.example/acct")], "").await;
    elsewhere.assert_refused(400, "invalid_header");
    // A token above both goes through, and nginx moves the file to the canonical Destination.
    let r = write(&h, "MOVE", "/scratch0", 2000, &[("destination", "/%61cct")], "").await;
    assert!(r.status < 300, "{r:?}");
    assert_eq!(file(&nginx.root, "/acct").as_deref(), Some("junk"));
    assert_eq!(file(&nginx.root, "/scratch0"), None);
    write(&h, "PUT", "/acct", 1999, &[], "zombie").await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn a_stale_write_to_a_collection_changes_nothing_below_it() {
    let Some(nginx) = start_nginx().await else { return };
    let h = proxy(&nginx, |_| {}).await;
    assert_eq!(write(&h, "PUT", "/d/f", 1000, &[], "inside").await.status, 201);
    write(&h, "DELETE", "/d/", 5, &[], "").await.assert_refused(409, "stale_token");
    assert_eq!(write(&h, "MKCOL", "/z/", 1, &[], "").await.status, 201);
    let r = write(&h, "MOVE", "/z/", 5, &[("destination", "/d/")], "").await;
    r.assert_refused(409, "stale_token");
    assert_eq!(file(&nginx.root, "/d/f").as_deref(), Some("inside"), "the collection kept its file");

    // A DELETE above what is below goes through and leaves a floor over the whole subtree.
    assert!(write(&h, "DELETE", "/d/", 2000, &[], "").await.status < 300);
    assert_eq!(file(&nginx.root, "/d/f"), None);
    for path in ["/d/f", "/d/new", "/d/deep/er"] {
        write(&h, "PUT", path, 1500, &[], "zombie").await.assert_refused(409, "stale_token");
    }
    assert!(!nginx.root.join("d").exists(), "no zombie recreated the collection");
    assert_eq!(write(&h, "PUT", "/d/f", 2001, &[], "new holder").await.status, 201);
    // POST and PUT cover no subtree: another lock's lower token below them keeps working.
    assert_eq!(write(&h, "PUT", "/accounts/", 50, &[], "").await.status, 409, "nginx refuses a PUT to a collection");
    assert_eq!(write(&h, "PUT", "/accounts/42", 7, &[], "balance").await.status, 201);
}

#[tokio::test]
async fn a_subtree_write_above_a_scope_covers_the_scopes_keys() {
    let Some(nginx) = start_nginx().await else { return };
    let scope = fencegate::config::Scope { prefix: "/buckets/".into(), segments: Some(2) };
    let h = proxy(&nginx, |c| c.fence.scopes.push(scope)).await;
    assert_eq!(write(&h, "PUT", "/buckets/b1/obj", 1000, &[], "object").await.status, 201);
    let r = write(&h, "DELETE", "/buckets/", 5, &[], "").await;
    r.assert_refused(409, "stale_token");
    assert_eq!(file(&nginx.root, "/buckets/b1/obj").as_deref(), Some("object"));
    let inside = write(&h, "DELETE", "/buckets/b1/", 999, &[], "").await;
    inside.assert_refused(409, "stale_token");
    assert_eq!(inside.json()["resource"], "/buckets/b1", "inside a scope, the scope's key");
}

#[tokio::test]
async fn every_method_not_known_to_be_safe_needs_a_token() {
    let Some(nginx) = start_nginx().await else { return };
    let h = proxy(&nginx, |_| {}).await;
    for method in ["MKCOL", "PROPPATCH", "LOCK", "UNLOCK", "PURGE", "FROB", "get"] {
        let r = h.send(method, "/m/", &[], "").await;
        r.assert_refused(428, "missing_token");
    }
    assert!(!nginx.root.join("m").exists(), "nginx never saw the MKCOL");
    for connect in ["CONNECT", "connect"] {
        let r = h.raw(&format!("{connect} 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1"), "").await;
        r.assert_refused(405, "method_not_allowed");
    }
    assert_eq!(write(&h, "PUT", "/r", 1, &[], "read me").await.status, 201);
    let read = h.send("GET", "/r", &[("fencing-token", "0")], "").await;
    assert_eq!((read.status, read.fencegate_error()), (200, None), "reads pass unchecked");
}

#[tokio::test]
async fn a_method_override_is_fenced_as_the_method_it_claims() {
    let Some(nginx) = start_nginx().await else { return };
    let h = proxy(&nginx, |_| {}).await;
    assert_eq!(write(&h, "PUT", "/doc", 1000, &[], "v").await.status, 201);
    for header in ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"] {
        h.send("GET", "/doc", &[(header, "PUT")], "").await.assert_refused(428, "missing_token");
        let stale = write(&h, "GET", "/doc", 5, &[(header, "DELETE")], "").await;
        stale.assert_refused(409, "stale_token");
        let twice = h.send("GET", "/doc", &[(header, "GET"), ("x-method-override", "DELETE")], "").await;
        twice.assert_refused(400, "invalid_header");
        assert_eq!(h.send("GET", "/doc", &[(header, "HEAD")], "").await.status, 200, "a safe override is a read");
    }
    assert_eq!(file(&nginx.root, "/doc").as_deref(), Some("v"));
}

#[tokio::test]
async fn an_override_does_not_hide_what_the_real_method_changes() {
    let Some(nginx) = start_nginx().await else { return };
    let h = proxy(&nginx, |_| {}).await;
    assert_eq!(write(&h, "PUT", "/acct", 1000, &[], "precious").await.status, 201);
    assert_eq!(write(&h, "PUT", "/d/f", 1000, &[], "inside").await.status, 201);
    assert_eq!(write(&h, "PUT", "/scratch", 1, &[], "junk").await.status, 201);
    // nginx ignores overrides: it would run the MOVE and the DELETE as sent.
    let moved = [("x-http-method-override", "PUT"), ("destination", "/%61cct")];
    write(&h, "MOVE", "/scratch", 6, &moved, "").await.assert_refused(409, "stale_token");
    let deleted = [("x-http-method-override", "GET")];
    write(&h, "DELETE", "/d/", 7, &deleted, "").await.assert_refused(409, "stale_token");
    let copied = [("x-http-method-override", "COPY"), ("destination", "/elsewhere")];
    assert!(write(&h, "MOVE", "/acct", 8, &copied, "").await.status == 409, "the MOVE's source is fenced too");
    assert_eq!(file(&nginx.root, "/acct").as_deref(), Some("precious"));
    assert_eq!(file(&nginx.root, "/d/f").as_deref(), Some("inside"));
}
