//! The admin API: liveness, readiness, reading `max_seen`, and raising it by hand.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Harness, RawConn, Resp, eventually, raw_request};

const TOKEN: &str = "an-admin-token-of-some-length";
const READ_TOKEN: &str = "a-read-token-of-some-length";

async fn admin(addr: SocketAddr, method: &str, path: &str, auth: Option<&str>, body: &str) -> Resp {
    admin_as(addr, method, path, auth.map(|t| format!("Bearer {t}")).as_deref(), body).await
}

/// An admin request with `authorization` as the whole `Authorization` value, if any.
async fn admin_as(addr: SocketAddr, method: &str, path: &str, authorization: Option<&str>, body: &str) -> Resp {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: admin");
    if let Some(value) = authorization {
        head.push_str(&format!("\r\nAuthorization: {value}"));
    }
    raw_request(addr, &head, body).await
}

#[tokio::test]
async fn health_and_readiness_follow_the_backend() {
    let h = Harness::start().await;
    let a = h.start_admin().await;
    let r = admin(a, "GET", "/healthz", None, "").await;
    assert_eq!((r.status, r.json()["status"].as_str()), (200, Some("ok")));
    let r = admin(a, "GET", "/readyz", None, "").await;
    assert_eq!((r.status, r.json()["checks"]["backend"].as_bool()), (200, Some(true)));

    let dead = common::dead_address().await;
    let down = Harness::start_with(|c| c.backend.url = format!("http://{dead}").parse().unwrap()).await;
    let r = admin(down.start_admin().await, "GET", "/readyz", None, "").await;
    assert_eq!((r.status, r.json()["checks"]["backend"].as_bool()), (503, Some(false)));
    assert_eq!(r.json()["checks"]["store"], true);
    // A refusal is told from a timeout: the backend is down, not slow.
    let problem = r.json()["problems"][0].as_str().unwrap().to_owned();
    assert!(problem.contains("refused") && !problem.contains("within"), "{problem}");
}

#[tokio::test]
async fn a_fence_can_be_read_by_its_key() {
    let h = Harness::start().await;
    let a = h.start_admin().await;
    admin(a, "GET", "/fences/accounts/42", None, "").await.assert_refused(404, "not_found");
    assert_eq!(h.put("/accounts/42", 34, "v").await.status, 200);
    let r = admin(a, "GET", "/fences/accounts/42", None, "").await;
    assert_eq!(r.status, 200);
    assert_eq!((r.json()["resource"].as_str(), r.json()["max_seen"].as_u64()), (Some("/accounts/42"), Some(34)));
}

#[tokio::test]
async fn an_operator_advance_cuts_off_every_current_holder_durably() {
    let mut h = Harness::start_with(|c| c.admin.token = Some(TOKEN.into())).await;
    let a = h.start_admin().await;
    assert_eq!(h.put("/accounts/42", 34, "v").await.status, 200);
    let r = admin(a, "POST", "/fences/accounts/42:advance", Some(TOKEN), r#"{"to": 100}"#).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!((r.json()["max_seen"].as_u64(), r.json()["previous"].as_u64()), (Some(100), Some(34)));
    // The current holder (35 would have been fine a moment ago) is cut off; a new one is not.
    h.put("/accounts/42", 35, "zombie").await.assert_refused(409, "stale_token");
    assert_eq!(h.put("/accounts/42", 101, "new holder").await.status, 200);
    // Never lowered.
    let r = admin(a, "POST", "/fences/accounts/42:advance", Some(TOKEN), r#"{"to": 50}"#).await;
    r.assert_refused(409, "would_lower");
    assert_eq!(r.json()["max_seen"], 101);
    // An advance of a resource never written works too, and survives a restart.
    assert_eq!(admin(a, "POST", "/fences/new:advance", Some(TOKEN), r#"{"to": 7}"#).await.status, 200);
    h.restart().await;
    assert_eq!(h.proxy.max_seen("/new"), Some(7));
    assert_eq!(h.put("/new", 8, "v").await.status, 200, "an operator advance leaves nothing in flight");
}

#[tokio::test]
async fn admin_writes_need_the_configured_token() {
    let h = Harness::start_with(|c| c.admin.token = Some(TOKEN.into())).await;
    let a = h.start_admin().await;
    let body = r#"{"to": 5}"#;
    let r = admin(a, "POST", "/fences/x:advance", None, body).await;
    r.assert_refused(401, "unauthorized");
    assert_eq!(r.headers["www-authenticate"], "Bearer");
    admin(a, "POST", "/fences/x:advance", Some("an-admin-token-of-some-lengtX"), body)
        .await
        .assert_refused(401, "unauthorized");
    admin(a, "POST", "/fences/x:advance", Some(TOKEN), "{\"to\": -1}").await.assert_refused(400, "invalid_request");
    assert_eq!(h.proxy.max_seen("/x"), None);

    let open = Harness::start().await;
    let r = admin(open.start_admin().await, "POST", "/fences/x:advance", Some(TOKEN), body).await;
    r.assert_refused(403, "admin_writes_disabled");
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let h = Harness::start_with(|c| c.admin.token = Some(TOKEN.into())).await;
    let a = h.start_admin().await;
    for (n, scheme) in ["bearer", "BEARER", "bEaReR"].into_iter().enumerate() {
        let to = format!(r#"{{"to": {}}}"#, n + 1);
        let r = admin_as(a, "POST", "/fences/x:advance", Some(&format!("{scheme} {TOKEN}")), &to).await;
        assert_eq!(r.status, 200, "{scheme}: {:?}", r.body);
    }
    admin_as(a, "POST", "/fences/x:advance", Some(&format!("Basic {TOKEN}")), r#"{"to": 9}"#)
        .await
        .assert_refused(401, "unauthorized");
    assert_eq!(h.proxy.max_seen("/x"), Some(3));
}

/// A harness whose `/accounts/` keys are verified against etcd locks (an etcd that is not
/// there: levels are set by `:advance`), `/other/` in a token domain of its own, and whose admin
/// API has the admin token and `read_token`.
async fn verified_with_tokens(token: Option<&str>, read_token: Option<&str>) -> Harness {
    let rules = "[[fence.rules]]\nprefix = \"/accounts/\"\nverify = \"etcd\"\nlock = \"/locks/accounts/{2}\"\n\
                 [[fence.rules]]\nprefix = \"/reports/\"\nmax_jump = 10\n\
                 [[fence.rules]]\nprefix = \"/other/\"\ntoken_domain = \"other\"\n";
    let with = fencegate::Config::from_toml_str(&format!(
        "[backend]\nurl = \"http://127.0.0.1:9\"\n[etcd]\nendpoints = [\"http://127.0.0.1:9\"]\n{rules}"
    ))
    .unwrap();
    Harness::start_with(|c| {
        (c.etcd, c.fence.rules) = (with.etcd, with.fence.rules);
        c.admin.token = token.map(str::to_owned);
        c.admin.read_token = read_token.map(str::to_owned);
    })
    .await
}

async fn advance(a: SocketAddr, key: &str, to: u64) {
    let r = admin(a, "POST", &format!("/fences{key}:advance"), Some(TOKEN), &format!(r#"{{"to": {to}}}"#)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

#[tokio::test]
async fn a_level_that_may_be_a_holders_revision_is_read_only_with_a_token() {
    let h = verified_with_tokens(Some(TOKEN), Some(READ_TOKEN)).await;
    let a = h.start_admin().await;
    // A holder's create revision, once written, is its key's level; the token domain is one
    // counter, so the same number may be any key's level in it (/reports/ here).
    advance(a, "/accounts/42", 307).await;
    advance(a, "/reports/q4", 308).await;
    advance(a, "/other/b", 5).await;

    for key in ["/fences/accounts/42", "/fences/reports/q4"] {
        let r = admin(a, "GET", key, None, "").await;
        r.assert_refused(401, "unauthorized");
        assert!(!String::from_utf8_lossy(&r.body).contains("30"), "{:?}", r.body);
        admin(a, "GET", key, Some("a-wrong-token-of-some-length"), "").await.assert_refused(401, "unauthorized");
        for token in [READ_TOKEN, TOKEN] {
            assert_eq!(admin(a, "GET", key, Some(token), "").await.status, 200, "{key} {token}");
        }
    }
    let r = admin(a, "GET", "/fences/other/b", None, "").await;
    assert_eq!((r.status, r.json()["max_seen"].as_u64()), (200, Some(5)), "another domain's levels stay open");
    admin(a, "GET", "/fences/other/b", Some("a-wrong-token-of-some-length"), "")
        .await
        .assert_refused(401, "unauthorized");

    // A listing withholds those levels from anonymous callers, and refuses a wrong token.
    let r = admin(a, "GET", "/fences?prefix=/", None, "").await;
    assert_eq!(r.status, 200);
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert!(!text.contains("307") && !text.contains("308"), "{text}");
    let listed = r.json()["fences"].as_array().unwrap().clone();
    let level = |listed: &[serde_json::Value], key: &str| listed.iter().find(|f| f["resource"] == key).unwrap().clone();
    assert_eq!(level(&listed, "/accounts/42")["withheld"], true);
    assert_eq!(level(&listed, "/other/b")["max_seen"].as_u64(), Some(5));
    admin(a, "GET", "/fences?prefix=/", Some("a-wrong-token-of-some-length"), "")
        .await
        .assert_refused(401, "unauthorized");
    let r = admin(a, "GET", "/fences?prefix=/", Some(READ_TOKEN), "").await;
    assert_eq!(level(r.json()["fences"].as_array().unwrap(), "/accounts/42")["max_seen"].as_u64(), Some(307));

    // The read token reads; it changes nothing.
    admin(a, "POST", "/fences/accounts/42:advance", Some(READ_TOKEN), r#"{"to": 400}"#)
        .await
        .assert_refused(401, "unauthorized");
    assert_eq!(h.proxy.max_seen("/accounts/42"), Some(307));

    // Nor does a refusal tell it: a jump or a stale token on an unverified key of the domain.
    let jumped = h.put("/reports/q4", 1_000_000, "v").await;
    jumped.assert_refused(409, "token_jump");
    assert_eq!(jumped.json()["withheld"], true);
    assert!(!String::from_utf8_lossy(&jumped.body).contains("308"), "{:?}", jumped.body);
    let stale = h.put("/reports/q4", 1, "v").await;
    stale.assert_refused(409, "stale_token");
    assert_eq!(stale.json()["withheld"], true);
    assert!(!String::from_utf8_lossy(&stale.body).contains("308"), "{:?}", stale.body);
    let open = h.put("/other/b", 1, "v").await;
    assert_eq!(open.json()["max_seen"].as_u64(), Some(5), "another domain's refusals say the level");
}

#[tokio::test]
async fn without_any_token_withheld_levels_are_not_read_at_all() {
    let h = verified_with_tokens(None, None).await;
    let a = h.start_admin().await;
    admin(a, "GET", "/fences/accounts/42", None, "").await.assert_refused(403, "admin_reads_disabled");
    admin(a, "GET", "/locks/x", None, "").await.assert_refused(403, "admin_reads_disabled");
    let r = admin(a, "GET", "/fences", Some("any-token-of-some-length"), "").await;
    assert_eq!(r.status, 200, "no token to be wrong: the header is ignored");
}

#[tokio::test]
async fn an_operator_advance_keeps_an_unanswered_write_in_flight_across_a_restart() {
    let mut h = Harness::start_with(|c| {
        c.admin.token = Some(TOKEN.into());
        c.backend.request_timeout = std::time::Duration::from_millis(300);
        c.fence.quarantine = std::time::Duration::from_millis(2500);
    })
    .await;
    let a = h.start_admin().await;
    // The backend still applies this one after fencegate gave up on it.
    h.slow_put("/doc", 5, 1500).await.assert_refused(504, "backend_timeout");
    assert_eq!(admin(a, "POST", "/fences/doc:advance", Some(TOKEN), r#"{"to": 10}"#).await.status, 200);
    h.restart().await;
    h.put("/doc", 11, "new").await.assert_refused(503, "resource_quarantined");
    eventually("/doc reopens after the quarantine", async || h.put("/doc", 11, "new").await.status == 200).await;
    assert_eq!(h.applied_tokens("/doc"), [5, 11], "the late write was not overtaken");
}

#[tokio::test]
async fn admin_paths_name_the_key_a_write_to_them_would_use() {
    let h = Harness::start_with(|c| {
        c.admin.token = Some(TOKEN.into());
        c.fence.scopes.push(fencegate::config::Scope { prefix: "/buckets/".into(), segments: Some(2) });
    })
    .await;
    let a = h.start_admin().await;
    let r = admin(a, "POST", "/fences/buckets//b1/x/../obj:advance", Some(TOKEN), r#"{"to": 9}"#).await;
    assert_eq!((r.status, r.json()["resource"].as_str()), (200, Some("/buckets/b1")));
    h.put("/buckets/b1/other", 9, "zombie").await.assert_refused(409, "stale_token");
    let r = admin(a, "GET", "/fences/buckets/b1/anything", None, "").await;
    assert_eq!((r.status, r.json()["max_seen"].as_u64()), (200, Some(9)));
    admin(a, "GET", "/fences/a%2Fb", None, "").await.assert_refused(400, "invalid_path");
}

#[tokio::test]
async fn metrics_count_outcomes_group_commit_and_bytes() {
    let h = Harness::start().await;
    let a = h.start_admin().await;
    assert_eq!(h.put("/doc", 5, "hello").await.status, 200);
    h.put("/doc", 4, "zombie").await.assert_refused(409, "stale_token");
    h.send("PUT", "/doc", &[], "x").await.assert_refused(428, "missing_token");
    assert_eq!(h.get("/doc").await.status, 200);
    let r = admin(a, "GET", "/metrics", None, "").await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    let value = |series: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value(r#"fencegate_requests_total{method="PUT",outcome="forwarded"}"#), 1.0);
    assert_eq!(value(r#"fencegate_requests_total{method="PUT",outcome="stale_token"}"#), 1.0);
    assert_eq!(value(r#"fencegate_requests_total{method="PUT",outcome="missing_token"}"#), 1.0);
    assert_eq!(value(r#"fencegate_requests_total{method="GET",outcome="forwarded"}"#), 1.0);
    assert_eq!(value("fencegate_resources "), 1.0);
    assert_eq!(value("fencegate_writes_in_flight "), 0.0);
    assert_eq!(value("fencegate_store_batch_advances_count"), 1.0, "one durable advance, one sync");
    assert_eq!(value("fencegate_store_sync_duration_seconds_count"), 1.0);
    assert_eq!(value("fencegate_queue_wait_seconds_count"), 1.0, "only the accepted write waited for a turn");
    assert_eq!(value("fencegate_backend_request_duration_seconds_count"), 2.0);
    assert_eq!(value(r#"fencegate_backend_responses_total{class="2xx"}"#), 2.0);
    assert_eq!(value(r#"fencegate_backend_responses_total{class="4xx"}"#), 0.0);
    assert_eq!(value("fencegate_request_duration_seconds_count"), 4.0, "refusals count too");
    assert_eq!(value("fencegate_request_body_bytes_total"), 5.0, "hello");
    assert!(value("fencegate_response_body_bytes_total") >= 5.0);
}

#[tokio::test]
async fn metrics_report_the_table_bytes_by_part_and_their_limit() {
    use fencegate::fence::{GATE_BYTES, NODE_BYTES};
    use fencegate::store::MARK_BYTES;
    let h = Harness::start_with(|c| c.store.max_table_bytes = 4 << 20).await;
    let a = h.start_admin().await;
    let scrape = async || String::from_utf8(admin(a, "GET", "/metrics", None, "").await.body.to_vec()).unwrap();
    let metric = |text: &str, series: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let bytes = |marks: &[&str], each: u64| marks.iter().map(|m| m.len() as u64 + each).sum::<u64>();
    assert_eq!(h.put("/doc", 5, "hello").await.status, 200);
    assert_eq!(h.send("DELETE", "/dir/", &[("fencing-token", "6")], "").await.fencegate_error(), None);
    // While the backend holds a write, its gate counts too.
    let held = async {
        h.wait_queue_len("/slow", 1).await;
        scrape().await
    };
    let (slow, text) = tokio::join!(h.slow_put("/slow", 7, 1000), held);
    assert_eq!(slow.status, 200);
    assert_eq!(metric(&text, "fencegate_table_limit_bytes "), 4 << 20);
    assert_eq!(metric(&text, r#"fencegate_table_bytes{part="keys"}"#), bytes(&["/doc", "/slow"], MARK_BYTES));
    let floors = bytes(&["/dir"], MARK_BYTES);
    assert_eq!(metric(&text, r#"fencegate_table_bytes{part="floors"}"#), floors, "the DELETE's (init's 0 leaves none)");
    // The fence's part: the gate, and the tree's one node ("/", above every key written).
    let fence = r#"fencegate_table_bytes{part="fence"}"#;
    assert_eq!(metric(&text, fence), bytes(&["/slow"], GATE_BYTES) + NODE_BYTES);
    let text = scrape().await;
    assert_eq!(metric(&text, fence), NODE_BYTES, "a gate is given back with its turn");
}

/// The admin listener's connection limit, fixed in `src/admin`.
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// Long past the 300 ms timeouts these tests configure, and short of the 10 s header-read and
/// 60 s keep-alive defaults, which would also close a connection.
const CLOSED_WITHIN: Duration = Duration::from_secs(5);

#[tokio::test]
async fn an_admin_connection_that_sends_nothing_is_closed_after_the_header_read_timeout() {
    let h = Harness::start_with(|c| c.limits.header_read_timeout = Duration::from_millis(300)).await;
    let mut silent = RawConn::open(h.start_admin().await).await;
    let rest = silent.read_to_end_within(Duration::from_secs(10)).await;
    assert!(rest.is_empty(), "closed with nothing to say: {rest:?}");
}

#[tokio::test]
async fn an_idle_admin_connection_is_closed_after_the_keep_alive_timeout() {
    let h = Harness::start_with(|c| c.limits.keepalive_timeout = Duration::from_millis(300)).await;
    let mut conn = RawConn::open(h.start_admin().await).await;
    conn.send(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n").await;
    assert_eq!(conn.read_response().await.status, 200);
    let rest = conn.read_to_end_within(CLOSED_WITHIN).await;
    assert!(rest.is_empty(), "closed with nothing more to say: {rest:?}");
}

#[tokio::test]
async fn admin_connections_beyond_the_limit_wait_for_a_free_slot() {
    let h = Harness::start().await;
    let a = h.start_admin().await;
    // Each is served once, so each holds a slot (until the 60 s keep-alive timeout).
    let mut held = Vec::new();
    for _ in 0..ADMIN_MAX_CONNECTIONS {
        let mut conn = RawConn::open(a).await;
        conn.send(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n").await;
        assert_eq!(conn.read_response().await.status, 200);
        held.push(conn);
    }
    let mut extra = RawConn::open(a).await;
    extra.send(b"GET /healthz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").await;
    // An observation window, not a guess at a state: that the request is not served has no
    // state to poll for, so it gets this long to be served wrongly.
    let answer = extra.read_some_within(Duration::from_millis(300), &mut [0u8; 256]).await;
    assert_eq!(answer, None, "served beyond {ADMIN_MAX_CONNECTIONS} open admin connections");
    held.pop();
    assert_eq!(extra.read_response().await.status, 200, "served once a slot is free");
    // The proxy's own listener does not share the admin's slots.
    assert_eq!(h.get("/missing").await.status, 404);
}
