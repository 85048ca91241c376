//! The fence itself: who gets through, who is refused, and what the refusal looks like.

use crate::common;

use common::Harness;
use fencegate::config::{EqualToken, MissingToken};

#[tokio::test]
async fn canonical_race_zombie_write_is_refused_and_never_reaches_the_backend() {
    let h = Harness::start().await;
    // t0: Client1 gets 33 and pauses; t3: Client2 gets 34 and writes.
    let r = h.put("/accounts/42", 34, "client2").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.fencegate_error(), None, "a relayed backend answer carries no fencegate-error");
    assert_eq!(h.proxy.max_seen("/accounts/42"), Some(34));
    // t6: Client1 wakes and writes with 33.
    let r = h.put("/accounts/42", 33, "client1").await;
    r.assert_refused(409, "stale_token");
    let v = r.json();
    assert_eq!(v["resource"], "/accounts/42");
    assert_eq!(v["token"], 33);
    assert_eq!(v["max_seen"], 34);
    assert_eq!(h.applied_tokens("/accounts/42"), [34]);
    assert_eq!(h.backend.object("/accounts/42").unwrap(), "client2");
    assert_eq!(h.proxy.max_seen("/accounts/42"), Some(34));
}

#[tokio::test]
async fn reads_pass_through_without_a_token() {
    let h = Harness::start().await;
    h.put("/doc", 1, "hello").await;
    let r = h.get("/doc").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "hello");
    let r = h.get("/missing").await;
    assert_eq!((r.status, r.fencegate_error()), (404, None), "the backend's own 404 is relayed");
}

#[tokio::test]
async fn unfenced_methods_are_never_checked_even_with_a_stale_token() {
    let h = Harness::start().await;
    h.put("/doc", 10, "v10").await;
    let r = h.send("GET", "/doc", &[("fencing-token", "1")], "").await;
    assert_eq!(r.status, 200);
    let r = h.send("OPTIONS", "/doc", &[("fencing-token", "garbage")], "").await;
    assert_eq!((r.status, r.fencegate_error()), (405, None));
}

#[tokio::test]
async fn missing_token_is_428_and_not_forwarded() {
    let h = Harness::start().await;
    for method in ["PUT", "POST", "PATCH", "DELETE", "put", "Delete"] {
        let r = h.send(method, "/doc", &[], "x").await;
        r.assert_refused(428, "missing_token");
    }
    assert!(h.backend.requests().is_empty(), "nothing reached the backend");
}

#[tokio::test]
async fn missing_token_forward_mode_passes_tokenless_writes_unchecked() {
    let h = Harness::start_with(|c| c.fence.missing_token = MissingToken::Forward).await;
    h.put("/doc", 10, "v10").await;
    let r = h.send("PUT", "/doc/./", &[], "no token").await;
    assert_eq!(r.status, 200);
    assert_eq!(h.backend.applied().last().unwrap().path, "/doc/", "still forwarded by canonical path");
    assert_eq!(h.proxy.max_seen("/doc"), Some(10), "an unchecked write does not move max_seen");
    h.put("/doc", 9, "stale").await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn each_kind_of_malformed_token_is_400_and_not_forwarded() {
    let h = Harness::start().await;
    for bad in ["", "+34", "-1", "0x22", "3 4", "34,35", "3.4", "34a", "18446744073709551616"] {
        let r = h.send("PUT", "/doc", &[("fencing-token", bad)], "x").await;
        r.assert_refused(400, "invalid_token");
        assert!(r.json()["message"].as_str().unwrap().contains("token"), "{bad:?}");
    }
    // Two header lines, even with equal values, are ambiguous.
    let r = h.send("PUT", "/doc", &[("fencing-token", "5"), ("fencing-token", "5")], "x").await;
    r.assert_refused(400, "invalid_token");
    // The same through a raw request, so no client library merges anything.
    let r = h.raw("PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nFencing-Token: 6", "x").await;
    r.assert_refused(400, "invalid_token");
    assert!(h.backend.requests().is_empty());
    assert_eq!(h.proxy.max_seen("/doc"), None, "bad input never changes state");
}

#[tokio::test]
async fn the_largest_u64_is_a_valid_token() {
    let h = Harness::start().await;
    let r = h.send("PUT", "/doc", &[("fencing-token", "18446744073709551615")], "x").await;
    assert_eq!(r.status, 200);
    assert_eq!(h.proxy.max_seen("/doc"), Some(u64::MAX));
}

#[tokio::test]
async fn a_write_refused_by_a_floor_names_the_floor_and_its_level() {
    let h = Harness::start_with_floor(10, |_| {}).await;
    let del = h.send("DELETE", "/dav/", &[("fencing-token", "20")], "").await;
    assert_eq!(del.fencegate_error(), None, "forwarded: {del:?}");
    let r = h.put("/dav/new.txt", 15, "v").await;
    r.assert_refused(409, "stale_token");
    let body = r.json();
    assert_eq!((body["floor"].as_str(), body["level"].as_u64()), (Some("/dav/"), Some(20)), "{body}");
    let message = body["message"].as_str().unwrap();
    assert!(message.contains("floor /dav/ at 20") && !message.contains("has already accepted"), "{message}");
    // The root's floor, from `init --floor`, is named too.
    let r = h.put("/elsewhere", 10, "v").await;
    assert_eq!((r.json()["floor"].as_str(), r.json()["level"].as_u64()), (Some("/"), Some(10)), "{:?}", r.body);
    // A key's own level is no floor.
    assert_eq!(h.put("/dav/new.txt", 21, "v").await.status, 200);
    let r = h.put("/dav/new.txt", 21, "v").await;
    assert!(r.json().get("floor").is_none(), "{:?}", r.body);
    assert!(r.json()["message"].as_str().unwrap().contains("/dav/new.txt has already accepted 21"), "{:?}", r.body);
}

#[tokio::test]
async fn equal_token_is_refused_by_default() {
    let h = Harness::start().await;
    assert_eq!(h.put("/doc", 7, "first").await.status, 200);
    h.put("/doc", 7, "again").await.assert_refused(409, "stale_token");
    assert_eq!(h.applied_tokens("/doc"), [7]);
}

#[tokio::test]
async fn equal_token_is_accepted_when_configured() {
    let h = Harness::start_with(|c| c.fence.equal_token = EqualToken::Accept).await;
    assert_eq!(h.put("/doc", 7, "first").await.status, 200);
    assert_eq!(h.put("/doc", 7, "second").await.status, 200);
    h.put("/doc", 6, "stale").await.assert_refused(409, "stale_token");
    assert_eq!(h.applied_tokens("/doc"), [7, 7]);
}

#[tokio::test]
async fn independent_resources_keep_independent_max_seen() {
    let h = Harness::start().await;
    assert_eq!(h.put("/a", 100, "a").await.status, 200);
    assert_eq!(h.put("/b", 5, "b").await.status, 200, "a high token on /a does not fence /b");
    h.put("/a", 99, "a-stale").await.assert_refused(409, "stale_token");
    assert_eq!(h.put("/b", 6, "b2").await.status, 200);
    assert_eq!((h.proxy.max_seen("/a"), h.proxy.max_seen("/b")), (Some(100), Some(6)));
}

#[tokio::test]
async fn max_seen_stays_advanced_whatever_the_backend_answers() {
    // MKCOL is fenced (it is not a method known to be safe) but the dumb backend answers 405 to it.
    let h = Harness::start().await;
    let r = h.send("MKCOL", "/dir", &[("fencing-token", "5")], "").await;
    assert_eq!((r.status, r.fencegate_error()), (405, None));
    assert_eq!(h.proxy.max_seen("/dir"), Some(5));
    h.put("/dir", 5, "same token").await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn the_token_header_is_forwarded_so_the_backend_may_check_it_too() {
    let h = Harness::start().await;
    h.put("/doc", 41, "x").await;
    assert_eq!(h.backend.applied()[0].headers["fencing-token"], "41");
}

#[tokio::test]
async fn a_custom_token_header_is_honoured() {
    let h = Harness::start_with(|c| c.fence.header = http::HeaderName::from_static("x-lock-epoch")).await;
    h.put("/doc", 41, "x").await.assert_refused(428, "missing_token");
    let r = h.send("PUT", "/doc", &[("x-lock-epoch", "41")], "x").await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn past_max_resources_new_resources_get_503_and_known_ones_keep_working() {
    let h = Harness::start_with(|c| c.store.max_resources = 2).await;
    assert_eq!(h.put("/a", 1, "a").await.status, 200);
    assert_eq!(h.put("/b", 1, "b").await.status, 200);
    h.put("/c", 1, "c").await.assert_refused(503, "resource_limit");
    assert_eq!(h.put("/a", 2, "a2").await.status, 200, "known resources keep working");
    let r = h.get("/c").await;
    assert_eq!((r.status, r.fencegate_error()), (404, None), "reads are not limited");
    assert!(h.backend.applied().iter().all(|r| r.path != "/c"));
}

#[tokio::test]
async fn past_max_table_bytes_long_new_resources_get_503_and_known_ones_keep_working() {
    // The smallest limit `check` accepts, and keys near the longest target the proxy takes:
    // about 130 of them fill it.
    let h = Harness::start_with(|c| c.store.max_table_bytes = 1 << 20).await;
    assert_eq!(h.put("/short", 1, "s").await.status, 200);
    let long = |i: usize| format!("/{i:04}-{}", "k".repeat(8000));
    let mut accepted = 0;
    let refused = loop {
        let r = h.put(&long(accepted), 1, "x").await;
        if r.status != 200 {
            break r;
        }
        accepted += 1;
        assert!(accepted < 200, "{accepted} keys of 8 KB were accepted under a limit of 1 MiB");
    };
    refused.assert_refused(503, "resource_limit");
    assert!(refused.json()["message"].as_str().unwrap().contains("store.max_table_bytes"), "{:?}", refused.body);
    assert!(accepted > 100, "only {accepted} keys of 8 KB fit in 1 MiB");
    h.put(&long(accepted + 1), 1, "x").await.assert_refused(503, "resource_limit");
    assert_eq!(h.put(&long(0), 2, "x2").await.status, 200, "known resources keep working");
    assert_eq!(h.put("/short", 2, "s2").await.status, 200);
    let r = h.get(&long(accepted)).await;
    assert_eq!((r.status, r.fencegate_error()), (404, None), "reads are not limited");
    assert!(h.backend.applied().iter().all(|r| r.path != long(accepted)), "the refused write was never forwarded");
}

#[tokio::test]
async fn max_seen_survives_a_graceful_restart_and_answered_writes_leave_nothing_quarantined() {
    let mut h = Harness::start().await;
    assert_eq!(h.put("/doc", 5, "five").await.status, 200);
    h.restart().await;
    h.put("/doc", 5, "again").await.assert_refused(409, "stale_token");
    // The write was answered before the restart, so nothing is in flight and no quarantine
    // (30 s by default) holds the next holder back.
    assert_eq!(h.put("/doc", 6, "six").await.status, 200);
}

#[tokio::test]
async fn whitespace_around_the_token_is_http_s_and_whitespace_inside_is_refused() {
    let h = Harness::start().await;
    let r = h.raw("PUT /ows HTTP/1.1\r\nHost: x\r\nFencing-Token: \t 34 \t", "v").await;
    assert_eq!((r.status, r.fencegate_error()), (200, None), "the parser removes optional whitespace");
    assert_eq!(h.proxy.max_seen("/ows"), Some(34));
    h.raw("PUT /ows HTTP/1.1\r\nHost: x\r\nFencing-Token: 3 5", "v").await.assert_refused(400, "invalid_token");
}
