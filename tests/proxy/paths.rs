//! Resource keys: every spelling of one resource shares one fence, and the backend is sent the
//! canonical path that was fenced.

use crate::common;

use common::Harness;
use fencegate::config::Scope;

fn put_head(target: &str, token: u64) -> String {
    format!("PUT {target} HTTP/1.1\r\nHost: backend.test\r\nFencing-Token: {token}")
}

#[tokio::test]
async fn each_alias_of_a_resource_is_fenced_and_forwarded_as_one_path() {
    let h = Harness::start().await;
    let aliases = [
        "/accounts/42",
        "//accounts/42",
        "/accounts//42",
        "/accounts/./42",
        "/accounts/x/../42",
        "/accounts/x/%2e%2e/42",
        "/accounts/x/%2E%2E/42",
        "/accounts/x/.%2e/42",
        "/%61ccounts/%34%32",
        "http://elsewhere.test/accounts/42",
    ];
    for (i, alias) in aliases.iter().enumerate() {
        let token = 10 + i as u64;
        let r = h.raw(&put_head(alias, token), "v").await;
        assert_eq!(r.status, 200, "{alias} with a fresh token");
        // The previous holder's token, spelled this way, is refused.
        let r = h.raw(&put_head(alias, token - 1), "zombie").await;
        r.assert_refused(409, "stale_token");
        assert_eq!(r.json()["resource"], "/accounts/42", "{alias}");
    }
    let applied = h.backend.applied();
    assert_eq!(applied.len(), aliases.len());
    assert!(
        applied.iter().all(|r| r.path == "/accounts/42"),
        "{:?}",
        applied.iter().map(|r| &r.path).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn the_backend_gets_the_canonical_path_and_the_original_query() {
    let h = Harness::start().await;
    let r = h.raw(&put_head("/a/./b/../c?x=1&y=%2F&z=a/../b", 1), "v").await;
    assert_eq!(r.status, 200);
    let got = &h.backend.applied()[0];
    assert_eq!(got.path, "/a/c");
    assert_eq!(got.query.as_deref(), Some("x=1&y=%2F&z=a/../b"));
}

#[tokio::test]
async fn ambiguous_paths_are_refused_with_400_and_never_forwarded() {
    let h = Harness::start().await;
    for target in
        ["/a%2Fb", "/a%2fb", "/a%5Cb", "/a%00b", "/a%0Db", "/..", "/a/../../etc", "/a/%2e%2e/%2E%2E/x", "/a%zz"]
    {
        let r = h.raw(&put_head(target, 1), "v").await;
        r.assert_refused(400, "invalid_path");
        assert!(r.json()["message"].as_str().is_some_and(|m| m.contains("path")), "{target}");
    }
    assert!(h.backend.requests().is_empty());
}

#[tokio::test]
async fn non_path_request_targets_are_never_forwarded_as_a_write() {
    let h = Harness::start().await;
    for target in ["*", "/a\\b", "backend.test:80"] {
        h.raw(&put_head(target, 1), "v").await.assert_refused(400, "invalid_path");
    }
    assert!(h.backend.requests().is_empty());
}

#[tokio::test]
async fn a_fragment_is_dropped_before_fencing_so_key_and_forwarded_path_agree() {
    let h = Harness::start().await;
    assert_eq!(h.raw(&put_head("/a/b#frag/../../c", 3), "v").await.status, 200);
    assert_eq!(h.proxy.max_seen("/a/b"), Some(3));
    assert_eq!(h.backend.applied()[0].path, "/a/b");
    h.raw(&put_head("/a/b#x", 3), "v").await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn a_prefix_scope_with_segments_fences_a_whole_bucket_as_one_resource() {
    let h = Harness::start_with(|c| c.fence.scopes.push(Scope { prefix: "/buckets/".into(), segments: Some(2) })).await;
    assert_eq!(h.put("/buckets/b1/obj/x", 5, "x").await.status, 200);
    let r = h.put("/buckets/b1/other/y", 5, "y").await;
    r.assert_refused(409, "stale_token");
    assert_eq!(r.json()["resource"], "/buckets/b1");
    assert_eq!(h.put("/buckets/b2/obj/x", 1, "b2").await.status, 200, "another bucket is another resource");
    assert_eq!(h.put("/elsewhere", 1, "e").await.status, 200, "outside the scope, the path is the key");
    assert_eq!(h.proxy.max_seen("/buckets/b1"), Some(5));
    assert_eq!(
        h.backend.applied().iter().map(|r| r.path.as_str()).collect::<Vec<_>>(),
        ["/buckets/b1/obj/x", "/buckets/b2/obj/x", "/elsewhere"]
    );
}

#[tokio::test]
async fn a_prefix_scope_without_segments_is_one_resource_and_matches_whole_segments() {
    let h = Harness::start_with(|c| c.fence.scopes.push(Scope { prefix: "/db".into(), segments: None })).await;
    assert_eq!(h.put("/db/t1/row", 9, "x").await.status, 200);
    h.put("/db/t2", 8, "y").await.assert_refused(409, "stale_token");
    assert_eq!(h.put("/dbx", 1, "z").await.status, 200, "/dbx is not under /db");
    assert_eq!(h.proxy.max_seen("/db"), Some(9));
}

#[tokio::test]
async fn escaped_and_literal_sub_delimiters_name_one_resource() {
    let h = Harness::start().await;
    assert_eq!(h.raw(&put_head("/files/a!b:c@d", 5), "v").await.status, 200);
    for alias in ["/files/a%21b%3Ac%40d", "/files/a%21b:c@d", "/files/a!b%3ac@d"] {
        let r = h.raw(&put_head(alias, 5), "zombie").await;
        r.assert_refused(409, "stale_token");
        assert_eq!(r.json()["resource"], "/files/a!b:c@d", "{alias}");
    }
    assert_eq!(h.raw(&put_head("/files/a%21b%3Ac%40d", 6), "v").await.status, 200);
    assert!(h.backend.applied().iter().all(|r| r.path == "/files/a!b:c@d"));
}
