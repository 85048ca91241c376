//! The operator's way back: listing fences, lowering a bricked one (`:reset`), ending a
//! quarantine early (`:lift`), each authenticated, logged with the caller, and answered with
//! 405 and `Allow` when asked with the wrong method.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::builder::Deployment;
use common::raw::put;
use common::{Harness, Resp, raw_request};

const TOKEN: &str = "an-admin-token-of-some-length";

async fn admin(addr: SocketAddr, method: &str, path: &str, auth: Option<&str>, body: &str) -> Resp {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: admin");
    if let Some(token) = auth {
        head.push_str(&format!("\r\nAuthorization: Bearer {token}"));
    }
    raw_request(addr, &head, body).await
}

fn reset_body(to: u64, confirm: &str) -> String {
    format!(r#"{{"to": {to}, "confirm": "{confirm}"}}"#)
}

#[tokio::test]
async fn a_bricked_resource_is_reset_only_when_confirmed_and_stays_reset_across_a_restart() {
    let mut h = Harness::start_with(|c| c.admin.token = Some(TOKEN.into())).await;
    let a = h.start_admin().await;
    assert_eq!(h.put("/accounts/42", u64::MAX, "forged").await.status, 200);
    h.put("/accounts/42", 35, "holder").await.assert_refused(409, "stale_token");

    let path = "/fences/accounts/42:reset";
    admin(a, "POST", path, None, &reset_body(40, "/accounts/42")).await.assert_refused(401, "unauthorized");
    let r = admin(a, "POST", path, Some(TOKEN), r#"{"to": 40}"#).await;
    r.assert_refused(400, "invalid_request");
    assert!(r.json()["message"].as_str().unwrap().contains(r#""/accounts/42""#), "names the key to repeat: {r:?}");
    let r = admin(a, "POST", path, Some(TOKEN), &reset_body(40, "/accounts/4")).await;
    r.assert_refused(400, "invalid_request");
    assert_eq!(h.proxy.max_seen("/accounts/42"), Some(u64::MAX), "nothing changed");

    let r = admin(a, "POST", path, Some(TOKEN), &reset_body(40, "/accounts/42")).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!((r.json()["max_seen"].as_u64(), r.json()["previous"].as_u64()), (Some(40), Some(u64::MAX)));
    h.put("/accounts/42", 40, "equal").await.assert_refused(409, "stale_token");
    assert_eq!(h.put("/accounts/42", 41, "holder").await.status, 200);
    // A reset never raises, and needs a fence to lower.
    let r = admin(a, "POST", path, Some(TOKEN), &reset_body(99, "/accounts/42")).await;
    r.assert_refused(409, "would_raise");
    let r = admin(a, "POST", "/fences/none:reset", Some(TOKEN), &reset_body(1, "/none")).await;
    r.assert_refused(404, "not_found");

    // Lowered again, then restarted: recovery must not take the highest record (u64::MAX) back.
    let r = admin(a, "POST", path, Some(TOKEN), &reset_body(10, "/accounts/42")).await;
    assert_eq!((r.status, r.json()["previous"].as_u64()), (200, Some(41)));
    h.restart().await;
    assert_eq!(h.proxy.max_seen("/accounts/42"), Some(10));
    assert_eq!(h.put("/accounts/42", 11, "after restart").await.status, 200);
}

#[tokio::test]
async fn a_reset_lowers_the_floors_below_its_key_and_subtree_writes_above_them_pass_again() {
    let h = Harness::start_with(|c| c.admin.token = Some(TOKEN.into())).await;
    let a = h.start_admin().await;
    assert_eq!(h.put("/p/d/x", 5, "v").await.status, 200);
    let forged = [("fencing-token", "18446744073709551615")];
    assert_eq!(h.send("DELETE", "/p/d/", &forged, "").await.fencegate_error(), None);
    h.put("/p/d/y", 6, "v").await.assert_refused(409, "stale_token");
    h.send("DELETE", "/p/", &[("fencing-token", "7")], "").await.assert_refused(409, "stale_token");

    let r = admin(a, "POST", "/fences/p/d/:reset", Some(TOKEN), &reset_body(5, "/p/d/")).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["floors_lowered"][0]["node"], "/p/d");
    assert_eq!(r.json()["previous"], serde_json::Value::Null, "the collection key itself was never written");
    assert_eq!(h.put("/p/d/y", 6, "v").await.status, 200);
    // The subtree above it no longer sees the forged token below: the tree was rebuilt.
    assert_eq!(h.send("DELETE", "/p/", &[("fencing-token", "7")], "").await.fencegate_error(), None);
}

#[tokio::test]
async fn a_reset_waits_for_the_write_in_flight_instead_of_racing_it() {
    let h = Harness::start_with(|c| c.admin.token = Some(TOKEN.into())).await;
    let a = h.start_admin().await;
    assert_eq!(h.put("/doc", 1, "v").await.status, 200);
    let written = AtomicBool::new(false);
    let write = async {
        let r = h.slow_put("/doc", 1000, 500).await;
        written.store(true, Ordering::SeqCst);
        r
    };
    let reset = async {
        h.wait_received("/doc", 1000).await;
        let r = admin(a, "POST", "/fences/doc:reset", Some(TOKEN), &reset_body(5, "/doc")).await;
        (r, written.load(Ordering::SeqCst))
    };
    let (w, (r, after_write)) = tokio::join!(write, reset);
    assert_eq!(w.status, 200);
    assert!(after_write, "the reset was answered while the write it lowers was still at the backend");
    assert_eq!((r.status, r.json()["previous"].as_u64()), (200, Some(1000)), "{r:?}");
    assert_eq!(h.proxy.max_seen("/doc"), Some(5));
}

#[tokio::test]
async fn a_quarantine_can_be_lifted_early_by_an_authenticated_operator() {
    let h = Harness::start_with(|c| {
        c.admin.token = Some(TOKEN.into());
        c.backend.request_timeout = Duration::from_millis(300);
        c.fence.quarantine = Duration::from_secs(600);
    })
    .await;
    let a = h.start_admin().await;
    h.slow_put("/doc", 5, 1500).await.assert_refused(504, "backend_timeout");
    h.put("/doc", 6, "v").await.assert_refused(503, "resource_quarantined");
    admin(a, "POST", "/fences/doc:lift", None, "").await.assert_refused(401, "unauthorized");
    let quarantined = async || {
        let text = String::from_utf8(admin(a, "GET", "/metrics", None, "").await.body.to_vec()).unwrap();
        text.lines().find_map(|l| l.strip_prefix("fencegate_quarantined_resources ")).unwrap().to_owned()
    };
    assert_eq!(quarantined().await, "1");
    let r = admin(a, "POST", "/fences/doc:lift", Some(TOKEN), "").await;
    assert_eq!((r.status, r.json()["lifted"].as_bool()), (200, Some(true)), "{r:?}");
    assert_eq!(r.json()["changed"], true);
    assert_eq!(quarantined().await, "0");
    // The lift is recorded: a restart does not quarantine the resource again for the write
    // whose outcome was unknown.
    let mut h = h;
    h.restart().await;
    assert_eq!(h.put("/doc", 6, "v").await.status, 200, "a lifted quarantine stays lifted across a restart");
    let a = h.start_admin().await;
    let r = admin(a, "POST", "/fences/doc:lift", Some(TOKEN), "").await;
    assert_eq!((r.status, r.json()["lifted"].as_bool()), (200, Some(false)), "nothing left to lift");
    assert_eq!(r.json()["changed"], false);
}

#[tokio::test]
async fn fences_are_listed_a_page_at_a_time_under_a_prefix() {
    let h = Harness::start().await;
    let a = h.start_admin().await;
    for (i, path) in ["/a/3", "/a/1", "/b/1", "/a/2"].into_iter().enumerate() {
        assert_eq!(h.put(path, 10 + i as u64, "v").await.status, 200);
    }
    let r = admin(a, "GET", "/fences?prefix=%2Fa%2F&limit=2", None, "").await;
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    let names: Vec<&str> = v["fences"].as_array().unwrap().iter().map(|f| f["resource"].as_str().unwrap()).collect();
    assert_eq!(names, ["/a/1", "/a/2"]);
    assert_eq!((v["fences"][0]["max_seen"].as_u64(), v["fences"][0]["in_flight"].as_bool()), (Some(11), Some(false)));
    assert_eq!(v["next"], "/a/2");
    let r = admin(a, "GET", "/fences?prefix=/a/&limit=2&after=/a/2", None, "").await;
    assert_eq!((r.json()["fences"][0]["resource"].as_str(), r.json()["next"].as_str()), (Some("/a/3"), None));
    assert_eq!(admin(a, "GET", "/fences", None, "").await.json()["fences"].as_array().unwrap().len(), 4);
    admin(a, "GET", "/fences?limit=0", None, "").await.assert_refused(400, "invalid_request");
    admin(a, "GET", "/fences?limit=1001", None, "").await.assert_refused(400, "invalid_request");
    admin(a, "GET", "/fences?sort=token", None, "").await.assert_refused(400, "invalid_request");
}

#[tokio::test]
async fn a_wrong_method_is_405_with_the_methods_allowed() {
    let h = Harness::start().await;
    let a = h.start_admin().await;
    for (method, path, allow) in [
        ("POST", "/metrics", "GET, HEAD"),
        ("DELETE", "/healthz", "GET, HEAD"),
        ("PUT", "/fences/x", "GET, HEAD"),
        ("POST", "/fences", "GET, HEAD"),
        ("GET", "/fences/x:reset", "POST"),
        ("GET", "/fences/x:lift", "POST"),
        ("PUT", "/fences/x:advance", "POST"),
    ] {
        let r = admin(a, method, path, None, "").await;
        r.assert_refused(405, "method_not_allowed");
        assert_eq!(r.headers["allow"], allow, "{method} {path}");
    }
    admin(a, "GET", "/nothing", None, "").await.assert_refused(404, "not_found");
    // Probes may use HEAD.
    for path in ["/healthz", "/readyz", "/metrics"] {
        let r = admin(a, "HEAD", path, None, "").await;
        assert_eq!((r.status, r.body.len()), (200, 0), "HEAD {path}: {r:?}");
    }
}

#[tokio::test]
async fn failed_authentications_and_changes_are_logged_with_the_caller_and_a_reset_survives_kill_9() {
    let extra = format!("[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"");
    let mut d = Deployment::builder().config_extra(&extra).start().await;
    let (addr, a) = (d.addr(), d.proxy().admin_addr().await);
    assert_eq!(put(addr, "/doc", u64::MAX).await, 200);
    let r = admin(a, "POST", "/fences/doc:reset", Some("a-guess"), &reset_body(3, "/doc")).await;
    r.assert_refused(401, "unauthorized");
    d.proxy().wait_for_log("admin authentication failed", 1).await;
    let line = d.proxy().log_lines("admin authentication failed").remove(0);
    assert!(line.contains("caller=127.0.0.1:") && line.contains("reason=wrong_token"), "{line}");
    assert!(!line.contains(TOKEN) && !line.contains("a-guess"), "no token in the log: {line}");

    let r = admin(a, "POST", "/fences/doc:reset", Some(TOKEN), &reset_body(3, "/doc")).await;
    assert_eq!(r.status, 200, "{r:?}");
    d.proxy().wait_for_log("admin change", 1).await;
    let line = d.proxy().log_lines("admin change").remove(0);
    assert!(line.contains("caller=127.0.0.1:") && line.contains("action=reset") && line.contains("WARN"), "{line}");
    // Answered once durable: a kill -9 right after it loses nothing.
    let addr = d.restart().addr;
    assert_eq!(put(addr, "/doc", 3).await, 409);
    assert_eq!(put(addr, "/doc", 4).await, 200);
}

#[tokio::test]
async fn metrics_count_admin_changes_and_failed_authentications_and_show_the_build_and_process() {
    let h = Harness::start_with(|c| c.admin.token = Some(TOKEN.into())).await;
    let a = h.start_admin().await;
    let scrape = async || String::from_utf8(admin(a, "GET", "/metrics", None, "").await.body.to_vec()).unwrap();
    let value = |text: &str, series: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let text = scrape().await;
    assert_eq!(value(&text, r#"fencegate_admin_changes_total{action="reset"}"#), 0.0, "shown before the first");
    let build = format!(r#"fencegate_build_info{{version="{}"}}"#, env!("CARGO_PKG_VERSION"));
    assert_eq!(value(&text, &build), 1.0);
    assert!(value(&text, "fencegate_process_open_fds ") > 0.0);
    assert!(value(&text, "fencegate_process_max_fds ") >= value(&text, "fencegate_process_open_fds "));
    assert!(value(&text, "fencegate_process_resident_memory_bytes ") > 1e6);
    assert!(value(&text, "fencegate_process_cpu_seconds_total ") > 0.0);
    // The scrape's own connection is open; a held proxy connection shows too.
    assert_eq!(value(&text, r#"fencegate_open_connections{listener="admin"}"#), 1.0);
    let held = common::RawConn::open(h.addr).await;
    let connected = async || value(&scrape().await, r#"fencegate_open_connections{listener="proxy"}"#) == 1.0;
    common::eventually("the held connection is counted", connected).await;
    drop(held);
    let closed = async || value(&scrape().await, r#"fencegate_open_connections{listener="proxy"}"#) == 0.0;
    common::eventually("the closed connection is no longer counted", closed).await;

    assert_eq!(h.put("/doc", 50, "v").await.status, 200);
    admin(a, "POST", "/fences/doc:reset", Some("wrong"), &reset_body(5, "/doc"))
        .await
        .assert_refused(401, "unauthorized");
    assert_eq!(admin(a, "POST", "/fences/doc:reset", Some(TOKEN), &reset_body(5, "/doc")).await.status, 200);
    // A lift with no quarantine to end changes nothing, and is not counted as a change.
    let r = admin(a, "POST", "/fences/doc:lift", Some(TOKEN), "").await;
    assert_eq!((r.status, r.json()["changed"].as_bool()), (200, Some(false)), "{r:?}");
    let text = scrape().await;
    assert_eq!(value(&text, "fencegate_admin_auth_failures_total "), 1.0);
    assert_eq!(value(&text, r#"fencegate_admin_changes_total{action="reset"}"#), 1.0);
    assert_eq!(value(&text, r#"fencegate_admin_changes_total{action="lift"}"#), 0.0);
    assert_eq!(value(&text, r#"fencegate_admin_changes_total{action="advance"}"#), 0.0);
}
