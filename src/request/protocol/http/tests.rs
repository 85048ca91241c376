//! What classification makes of requests: keys, coverage, targets, refusals.

use bytes::Bytes;
use http_body_util::Full;

use http::Request;
use http::uri::PathAndQuery;

use super::*;
use crate::config::Config;
use crate::fence::{EqualToken, Scope};
use crate::request::classify::Write;
use crate::request::proof::Proof;

pub(in crate::request) fn config(extra: &str) -> Config {
    let text = format!("[backend]\nurl = \"http://127.0.0.1:9\"\n[store]\ndir = \"/tmp/x\"\n{extra}");
    Config::from_toml_str(&text).unwrap()
}

pub(in crate::request) fn request(
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &'static str,
) -> Request<Full<Bytes>> {
    let mut req = Request::builder().method(method).uri(target);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.body(Full::new(Bytes::from_static(body.as_bytes()))).unwrap()
}

fn write(token: u64, key: &str, target: &'static str) -> Plan {
    touching(token, &[(key, Coverage::Key)], target)
}

fn touching(token: u64, touches: &[(&str, Coverage)], target: &'static str) -> Plan {
    Plan::Write(Write {
        token,
        touches: touches.iter().map(|(k, coverage)| Touch { key: (*k).into(), coverage: *coverage }).collect(),
        target: PathAndQuery::from_static(target),
        set_headers: Vec::new(),
        body_limit: None,
        equal: EqualToken::Reject,
        max_jump: None,
        proof: Proof::None,
        locks: Vec::new(),
        upload: None,
        pin: None,
    })
}

/// The touches of a write plan, and its forwarded Destination.
fn touches(plan: Plan) -> (Vec<(String, Coverage)>, Option<String>) {
    let Plan::Write(w) = plan else { panic!("not a write: {plan:?}") };
    let forwarded =
        w.set_headers.iter().find(|(name, _)| name == DESTINATION).map(|(_, v)| v.to_str().unwrap().to_owned());
    (w.touches.into_iter().map(|t| (t.key, t.coverage)).collect(), forwarded)
}

#[test]
fn a_fenced_write_touches_its_canonical_key_and_forwards_the_canonical_target() {
    let c = config("");
    let put = request("PUT", "/a/./b//c?x=1", &[("fencing-token", "34")], "v");
    assert_eq!(classify(&put, &c).unwrap(), write(34, "/a/b/c", "/a/b/c?x=1"));
    let delete = request("DELETE", "/d/", &[("fencing-token", "7")], "");
    assert_eq!(classify(&delete, &c).unwrap(), touching(7, &[("/d/", Coverage::Subtree)], "/d/"));
}

#[test]
fn the_forwarded_target_is_the_canonical_path_and_the_query_as_sent_whether_shared_or_rebuilt() {
    let c = config("");
    let target = |uri: &str| match classify(&request("PUT", uri, &[("fencing-token", "34")], "v"), &c).unwrap() {
        Plan::Write(w) => w.target.as_str().to_owned(),
        plan => panic!("not a write: {plan:?}"),
    };
    // Already canonical: the client's own target.
    assert_eq!(target("/a/b?x=1&y"), "/a/b?x=1&y");
    assert_eq!(target("/a/b"), "/a/b");
    assert_eq!(target("/a/b?"), "/a/b?");
    assert_eq!(target("http://h/a/b?x=1"), "/a/b?x=1");
    // A fragment never reaches the request's target (the URI parser drops it).
    assert_eq!(target("/a/b#frag"), "/a/b");
    assert_eq!(target("/a/b?x=1#frag"), "/a/b?x=1");
    // Not canonical: rebuilt from the canonical path, the query kept.
    assert_eq!(target("/a//b?x=1"), "/a/b?x=1");
    // Its canonical path a prefix of what was sent: still rebuilt.
    assert_eq!(target("/a/b/."), "/a/b/");
    assert_eq!(target("/a/b/.?x=1"), "/a/b/?x=1");
}

#[test]
fn a_method_is_fenced_whatever_its_case() {
    let c = config("");
    let token = ("fencing-token", "5");
    // A lower-case MOVE is still a move: its Destination is fenced too (and required).
    let moved = request("move", "/a", &[token, ("destination", "/b"), ("host", "h")], "");
    let (keys, _) = touches(classify(&moved, &c).unwrap());
    assert_eq!(keys.into_iter().map(|(k, _)| k).collect::<Vec<_>>(), ["/a", "/b"]);
    assert_eq!(classify(&request("Move", "/a", &[token], ""), &c).unwrap_err().code(), "invalid_header");
}

#[test]
fn move_changes_its_source_and_destination_subtrees_and_copy_only_its_destination() {
    let c = config("");
    let token = ("fencing-token", "5");
    let sub = |k: &str| (k.to_owned(), Coverage::Subtree);
    let moved = request("MOVE", "/scratch", &[token, ("destination", "/%61cct"), ("host", "h")], "");
    assert_eq!(touches(classify(&moved, &c).unwrap()), (vec![sub("/scratch"), sub("/acct")], Some("/acct".into())));
    let copied = request("COPY", "/template/", &[token, ("destination", "http://h/d//x/"), ("host", "h")], "");
    assert_eq!(touches(classify(&copied, &c).unwrap()), (vec![sub("/d/x/")], Some("http://h/d/x/".into())));
    let code = |req: Request<Full<Bytes>>| classify(&req, &c).unwrap_err().code();
    assert_eq!(code(request("MOVE", "/a", &[token], "")), "invalid_header", "a MOVE needs a Destination");
    assert_eq!(
        code(request("COPY", "/a", &[token, ("destination", "http://elsewhere/a"), ("host", "h")], "")),
        "invalid_header"
    );
    let overridden = request("POST", "/a", &[token, ("x-http-method-override", "MOVE"), ("destination", "/b")], "");
    assert_eq!(touches(classify(&overridden, &c).unwrap()).0, [sub("/a"), sub("/b")], "fenced as the method it claims");
    let put = request("PUT", "/a", &[token, ("destination", "/b")], "v");
    assert_eq!(classify(&put, &c).unwrap(), write(5, "/a", "/a"), "only MOVE and COPY name a second resource");
}

#[test]
fn a_write_is_fenced_for_what_its_own_method_and_its_override_may_change() {
    let c = config("");
    let token = ("fencing-token", "5");
    let sub = |k: &str| (k.to_owned(), Coverage::Subtree);
    let plan = |method: &str, claimed: &str| {
        let headers = [token, ("x-http-method-override", claimed), ("destination", "/%61cct")];
        touches(classify(&request(method, "/scratch", &headers, ""), &c).unwrap())
    };
    // nginx ignores the override and moves /scratch onto /acct: both are fenced.
    assert_eq!(plan("MOVE", "PUT"), (vec![sub("/scratch"), sub("/acct")], Some("/acct".into())));
    assert_eq!(plan("DELETE", "GET").0, [sub("/scratch")], "a DELETE under a safe claim is still a DELETE");
    assert_eq!(plan("MOVE", "COPY").0, [sub("/scratch"), sub("/acct")], "the MOVE's source is fenced");
    assert_eq!(plan("COPY", "COPY").0, [sub("/acct")]);
    // Frameworks upper-case override values before they act on them, and the method itself.
    assert_eq!(plan("POST", "delete").0, [sub("/scratch")]);
    assert_eq!(plan("POST", "move"), (vec![sub("/scratch"), sub("/acct")], Some("/acct".into())));
    assert_eq!(plan("delete", "PUT").0, [sub("/scratch")], "a lower-case DELETE covers its subtree");
    assert_eq!(plan("move", "PUT"), (vec![sub("/scratch"), sub("/acct")], Some("/acct".into())));
    assert_eq!(plan("copy", "COPY").0, [sub("/scratch"), sub("/acct")], "a lower-case COPY may write its path");
    let code = classify(&request("move", "/a", &[token], ""), &c).unwrap_err().code();
    assert_eq!(code, "invalid_header", "a lower-case MOVE needs a Destination too");
}

#[test]
fn subtrees_follow_the_configured_methods_and_compose_with_scopes() {
    let mut c = config("[fence]\nsubtree_methods = [\"DELETE\"]\n");
    c.fence.scopes.push(Scope { prefix: "/buckets/".into(), segments: Some(2) });
    let token = ("fencing-token", "5");
    let plan = |method: &str, path: &str| {
        touches(classify(&request(method, path, &[token, ("destination", "/z")], ""), &c).unwrap()).0
    };
    assert_eq!(plan("DELETE", "/buckets/"), [("/buckets/".to_owned(), Coverage::Subtree)], "above the scope's keys");
    assert_eq!(plan("DELETE", "/buckets/b1/dir/"), [("/buckets/b1".to_owned(), Coverage::Key)], "inside one key");
    assert_eq!(plan("MOVE", "/a"), [("/a".to_owned(), Coverage::Key), ("/z".to_owned(), Coverage::Key)]);
}

#[test]
fn every_method_not_known_to_be_safe_is_fenced_and_method_names_are_case_sensitive() {
    let c = config("");
    for method in ["PUT", "POST", "PATCH", "DELETE", "MKCOL", "PROPPATCH", "LOCK", "UNLOCK", "PURGE", "FROB", "get"] {
        let tokenless = request(method, "/a", &[], "");
        assert_eq!(classify(&tokenless, &c).unwrap_err().code(), "missing_token", "{method}");
        let with_token = request(method, "/a", &[("fencing-token", "3")], "");
        let coverage = if method == "DELETE" { Coverage::Subtree } else { Coverage::Key };
        assert_eq!(classify(&with_token, &c).unwrap(), touching(3, &[("/a", coverage)], "/a"), "{method}");
    }
    for method in ["GET", "HEAD", "OPTIONS", "TRACE", "PROPFIND"] {
        assert!(matches!(classify(&request(method, "/a", &[], ""), &c), Ok(Plan::Pass { .. })), "{method}");
    }
    for connect in ["CONNECT", "connect", "Connect"] {
        let code = classify(&request(connect, "/a", &[("fencing-token", "3")], ""), &c).unwrap_err().code();
        assert_eq!(code, "method_not_allowed", "{connect}");
    }
}

#[test]
fn a_method_override_is_fenced_as_the_method_it_names() {
    let c = config("");
    for header in ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"] {
        let tokenless = request("GET", "/a", &[(header, "PUT")], "");
        assert_eq!(classify(&tokenless, &c).unwrap_err().code(), "missing_token", "{header}");
        let delete = request("GET", "/a", &[(header, "DELETE"), ("fencing-token", "9")], "");
        assert_eq!(classify(&delete, &c).unwrap(), touching(9, &[("/a", Coverage::Subtree)], "/a"), "{header}");
        let safe = request("POST", "/a", &[(header, "GET")], "");
        assert_eq!(classify(&safe, &c).unwrap_err().code(), "missing_token", "POST stays a write: {header}");
        let read = request("GET", "/a", &[(header, "HEAD")], "");
        assert!(matches!(classify(&read, &c), Ok(Plan::Pass { .. })), "{header}");
    }
    let code = |headers: &[(&str, &str)]| classify(&request("GET", "/a", headers, ""), &c).unwrap_err().code();
    assert_eq!(code(&[("X-HTTP-Method-Override", "PUT"), ("X-HTTP-Method-Override", "GET")]), "invalid_header");
    assert_eq!(code(&[("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method", "GET")]), "invalid_header");
    assert_eq!(code(&[("X-HTTP-Method-Override", "GET, PUT")]), "invalid_header");
    assert_eq!(code(&[("X-Method-Override", "")]), "invalid_header");
}

#[test]
fn a_connection_header_may_not_drop_a_header_the_check_read() {
    let c = config("");
    let token = ("fencing-token", "5");
    for named in ["Fencing-Token", "destination", "x-http-method-override", "keep-alive, X-Method-Override"] {
        let req = request("PUT", "/a", &[token, ("connection", named)], "");
        assert_eq!(classify(&req, &c).unwrap_err().code(), "invalid_header", "{named}");
        let read = request("GET", "/a", &[("connection", named)], "");
        assert_eq!(classify(&read, &c).unwrap_err().code(), "invalid_header", "reads too: {named}");
    }
    let fine = request("PUT", "/a", &[token, ("connection", "keep-alive, x-trace")], "");
    assert_eq!(classify(&fine, &c).unwrap(), write(5, "/a", "/a"));
}

#[test]
fn a_scope_names_the_key_while_the_target_keeps_the_whole_path() {
    let mut c = config("");
    c.fence.scopes.push(Scope { prefix: "/buckets/".into(), segments: Some(2) });
    let put = request("PUT", "/buckets/b1/obj", &[("fencing-token", "5")], "v");
    assert_eq!(classify(&put, &c).unwrap(), write(5, "/buckets/b1", "/buckets/b1/obj"));
}

#[test]
fn reads_pass_as_sent_and_tokenless_writes_follow_the_missing_token_policy() {
    let c = config("");
    let get = request("GET", "/a/../b", &[], "");
    assert_eq!(classify(&get, &c).unwrap(), Plan::Pass { target: PathAndQuery::from_static("/a/../b") });
    let put = request("PUT", "/a", &[], "v");
    assert_eq!(classify(&put, &c).unwrap_err().code(), "missing_token");
    let forward = config("[fence]\nmissing_token = \"forward\"\n[limits]\nmax_body_bytes = 10\n");
    let unchecked = Plan::Unchecked { target: PathAndQuery::from_static("/b"), body_limit: Some(10) };
    assert_eq!(classify(&request("PUT", "/a/../b", &[], "v"), &forward).unwrap(), unchecked);
}

#[test]
fn what_cannot_be_fenced_is_refused_before_anything_waits() {
    let c = config("[limits]\nmax_body_bytes = 4\nmax_uri_bytes = 64\n");
    let token = [("fencing-token", "1")];
    let code = |req: Request<Full<Bytes>>| classify(&req, &c).unwrap_err().code();
    assert_eq!(code(request("CONNECT", "127.0.0.1:1", &[], "")), "method_not_allowed");
    assert_eq!(code(request("PUT", "/a", &[("fencing-token", "1"), ("fencing-token", "2")], "")), "invalid_token");
    assert_eq!(code(request("PUT", "/a", &[("fencing-token", "-1")], "")), "invalid_token");
    assert_eq!(code(request("PUT", "/a%2Fb", &token, "")), "invalid_path");
    assert_eq!(code(request("PUT", "/a", &token, "too long")), "body_too_large");
    assert_eq!(code(request("PUT", "/a", &[("fencing-token", "1"), ("upgrade", "h2c")], "")), "upgrade_refused");
    assert_eq!(code(request("PUT", &format!("/{}", "a".repeat(64)), &token, "")), "uri_too_long");
}

#[test]
fn only_a_put_or_delete_of_its_own_key_under_a_pin_rule_is_pinned() {
    use crate::request::classify::Pinned;
    let rules = "[[fence.rules]]\nprefix = \"/p/\"\npin = \"etag\"\n";
    let mut c = config(&format!("[fence]\nsubtree_methods = [\"MOVE\"]\n{rules}"));
    c.fence.scopes.push(Scope { prefix: "/p/scoped/".into(), segments: Some(3) });
    let pin = |method: &str, path: &str| {
        let req = request(method, path, &[("fencing-token", "5"), ("destination", "/p/other")], "");
        let Plan::Write(w) = classify(&req, &c).unwrap() else { panic!("{method} {path}") };
        w.pin
    };
    assert_eq!(pin("PUT", "/p/a"), Some(Pinned::Put));
    assert_eq!(pin("DELETE", "/p/a"), Some(Pinned::Delete));
    assert_eq!(pin("MOVE", "/p/a/"), None, "a subtree");
    assert_eq!(pin("MOVE", "/p/a"), None, "a Destination");
    assert_eq!(pin("PROPPATCH", "/p/a"), None);
    assert_eq!(pin("PUT", "/elsewhere"), None, "HTTP mode: off where no rule says");
    // Under a scope, the key /p/scoped/db holds every resource below it: the state of one is
    // not the state of the others.
    assert_eq!(pin("PUT", "/p/scoped/db/wal/1"), None, "a scope's key");
    assert_eq!(pin("PUT", "/p/scoped/db"), Some(Pinned::Put), "the scope's own path is its key");
}
