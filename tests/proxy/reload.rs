//! Reloading the configuration of a running proxy: in-process through `Proxy::reload`, and
//! through the binary with SIGHUP. TLS certificate rotation is tested in `tls.rs`.

use crate::common;

use common::Harness;
use common::builder::Deployment;
use common::process::Running;
use common::raw::{put, put_response};
use fencegate::config::EqualToken;
use fencegate::demo::MemBackend;

#[tokio::test]
async fn a_reload_changes_the_fence_policy_for_the_next_write() {
    let h = Harness::start().await;
    assert_eq!(h.put("/doc", 5, "a").await.status, 200);
    h.put("/doc", 5, "again").await.assert_refused(409, "stale_token");
    let mut config = h.config.clone();
    config.fence.equal_token = EqualToken::Accept;
    let report = h.proxy.reload(config).unwrap();
    assert!(report.applied.iter().any(|l| l.starts_with("fence.equal_token: \"reject\" -> \"accept\"")), "{report:?}");
    assert!(report.kept.is_empty(), "{report:?}");
    assert_eq!(h.put("/doc", 5, "again").await.status, 200, "an equal token is now accepted");
    h.put("/doc", 4, "zombie").await.assert_refused(409, "stale_token");
    assert_eq!(h.applied_tokens("/doc"), [5, 5]);
}

#[tokio::test]
async fn a_reload_changes_limits_and_the_token_header() {
    let h = Harness::start().await;
    let mut config = h.config.clone();
    config.limits.max_body_bytes = 4;
    config.fence.header = http::HeaderName::from_static("x-lock-token");
    h.proxy.reload(config).unwrap();
    h.send("PUT", "/doc", &[("x-lock-token", "1")], "too long").await.assert_refused(413, "body_too_large");
    h.put("/doc", 2, "v").await.assert_refused(428, "missing_token");
    assert_eq!(h.send("PUT", "/doc", &[("x-lock-token", "3")], "ok").await.status, 200);
    assert_eq!(h.backend.applied().iter().filter(|r| r.path == "/doc").count(), 1);
}

#[tokio::test]
async fn a_reload_keeps_key_rules_and_storage_and_reports_them() {
    let h = Harness::start().await;
    assert_eq!(h.put("/Doc", 5, "a").await.status, 200);
    let mut config = h.config.clone();
    let elsewhere = tempfile::tempdir().unwrap();
    config.paths.case_sensitive = false;
    config.store.dir = elsewhere.path().to_owned();
    config.limits.max_connections = 3;
    let report = h.proxy.reload(config).unwrap();
    let kept: Vec<&str> = report.kept.iter().map(|l| l.split(':').next().unwrap()).collect();
    assert_eq!(kept, ["limits.max_connections", "paths.case_sensitive", "store.dir"], "{report:?}");
    assert!(report.applied.is_empty(), "{report:?}");
    // Still case-sensitive, still the same store: /doc is another resource, /Doc still at 5.
    assert_eq!(h.put("/doc", 1, "b").await.status, 200);
    h.put("/Doc", 5, "zombie").await.assert_refused(409, "stale_token");
    assert_eq!(h.proxy.config().store.dir, h.config.store.dir);
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
}

#[tokio::test]
async fn a_reload_rotates_the_admin_token() {
    const OLD: &str = "the-old-admin-token-value";
    const NEW: &str = "the-new-admin-token-value";
    let h = Harness::start_with(|c| c.admin.token = Some(OLD.into())).await;
    let admin = h.start_admin().await;
    let advance = |token: &'static str| async move {
        let head = format!(
            "POST /fences/doc:advance HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: 9"
        );
        common::raw_request(admin, &head, "{\"to\":10}").await
    };
    let mut config = h.config.clone();
    config.admin.token = Some(NEW.into());
    let report = h.proxy.reload(config).unwrap();
    assert_eq!(report.applied, ["admin.token: (changed)"]);
    advance(OLD).await.assert_refused(401, "unauthorized");
    assert_eq!(advance(NEW).await.status, 200);
    assert_eq!(h.proxy.max_seen("/doc"), Some(10));
}

/// The operator's path: edit the file, send SIGHUP, read what changed in the log.
#[tokio::test]
async fn sighup_reloads_the_file_applies_what_it_can_and_refuses_a_broken_one() {
    let d = Deployment::builder().config_extra("[admin]\nlisten = \"127.0.0.1:0\"").start().await;
    let (config, proxy) = (&d.config_path, d.proxy());
    let admin = proxy.admin_addr().await;
    let reloads = async |outcome: &str| -> String {
        let text = common::raw_request(admin, "GET /metrics HTTP/1.1\r\nHost: x", "").await.body;
        let series = format!("fencegate_reloads_total{{outcome=\"{outcome}\"}} ");
        let text = String::from_utf8(text.to_vec()).unwrap();
        text.lines().find_map(|l| l.strip_prefix(&series)).unwrap_or("missing").to_owned()
    };
    let original = std::fs::read_to_string(config).unwrap();
    assert_eq!(put(proxy.addr, "/doc", 5).await, 200);
    assert_eq!(put(proxy.addr, "/doc", 5).await, 409);

    // A file that does not load changes nothing.
    std::fs::write(config, format!("{original}[fence]\nequal_token = \"sometimes\"\n")).unwrap();
    hangup(proxy, "reload refused", 1).await;
    assert_eq!(put(proxy.addr, "/doc", 5).await, 409);
    assert_eq!((reloads("rejected").await, reloads("applied").await), ("1".into(), "0".into()));

    // Accept equal tokens, log only warnings, and ask for a new listen address (needs a restart).
    let edited = original.replace("listen = \"127.0.0.1:0\"", "listen = \"127.0.0.1:1\"");
    std::fs::write(config, format!("{edited}[fence]\nequal_token = \"accept\"\n[log]\nlevel = \"warn\"\n")).unwrap();
    hangup(proxy, "configuration reloaded", 1).await;
    assert!(proxy.log_contains(r#"fence.equal_token: "reject" -> "accept""#), "{:?}", proxy.log_lines("reload"));
    assert!(proxy.log_contains(r#"log.level: "info" -> "warn""#));
    assert!(proxy.log_lines("needs a restart").iter().any(|l| l.contains("server.listen")));
    assert_eq!(put(proxy.addr, "/doc", 5).await, 200, "still listening where it was, equal tokens now accepted");
    assert_eq!((reloads("rejected").await, reloads("applied").await), ("1".into(), "1".into()));

    // At "warn", a refused tokenless write (logged at info) leaves no line; a stale one (warn) does.
    let before = proxy.log_lines("refused request").len();
    let head = "PUT /doc HTTP/1.1\r\nHost: x";
    assert_eq!(common::raw_request(proxy.addr, head, "v").await.status, 428);
    assert_eq!(put_response(proxy.addr, "/doc", 4).await.unwrap().status, 409);
    proxy.wait_for_log("refused stale token", 1).await;
    assert_eq!(proxy.log_lines("refused request").len(), before, "info lines are off");
}

/// Sends SIGHUP to the proxy and waits until `needle` has appeared `count` more times.
async fn hangup(proxy: &Running, needle: &str, count: usize) {
    let before = proxy.log_lines(needle).len();
    proxy.signal("HUP");
    proxy.wait_for_log(needle, before + count).await;
}

#[tokio::test]
async fn a_waiting_write_keeps_the_equal_token_policy_it_arrived_under() {
    let h = Harness::start_with(|c| c.fence.equal_token = EqualToken::Accept).await;
    let slow = h.slow_put("/doc", 6, 800);
    let equal = async {
        h.wait_received("/doc", 6).await;
        h.put("/doc", 6, "second").await
    };
    let reload = async {
        h.wait_received("/doc", 6).await;
        h.wait_queue_len("/doc", 2).await; // 6 at the backend, the equal write queued behind it
        let mut c = h.config.clone();
        c.fence.equal_token = EqualToken::Reject;
        h.proxy.reload(c).unwrap();
    };
    let (first, second, ()) = tokio::join!(slow, equal, reload);
    assert_eq!(first.status, 200);
    assert_eq!(second.status, 200, "{:?}", second.fencegate_error());
    h.put("/doc", 6, "third").await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn a_refused_reload_applies_nothing() {
    let h = Harness::start().await;
    assert_eq!(h.put("/doc", 5, "a").await.status, 200);
    let mut config = h.config.clone();
    config.fence.equal_token = EqualToken::Accept;
    config.backend.url = format!("https://{}", h.backend.addr()).parse().unwrap();
    config.backend.tls.ca = Some(h.dir.path().join("no-such-ca.pem"));
    assert!(h.proxy.reload(config).is_err());
    h.put("/doc", 5, "again").await.assert_refused(409, "stale_token");
    assert_eq!(h.proxy.config().fence.equal_token, EqualToken::Reject);
    assert_eq!(h.put("/doc", 6, "b").await.status, 200, "still forwarded to the plain-HTTP backend");
}

#[tokio::test]
async fn a_reload_can_move_the_backend() {
    let h = Harness::start().await;
    assert_eq!(h.put("/doc", 5, "a").await.status, 200);
    let other = MemBackend::start().await.unwrap();
    let mut config = h.config.clone();
    config.backend.url = other.url().parse().unwrap();
    let report = h.proxy.reload(config).unwrap();
    assert!(report.applied.iter().any(|l| l.starts_with("backend.url:")), "{report:?}");
    assert_eq!(h.put("/doc", 6, "b").await.status, 200);
    h.put("/doc", 5, "zombie").await.assert_refused(409, "stale_token");
    assert_eq!(h.applied_tokens("/doc"), [5]);
    assert_eq!(other.applied().iter().filter_map(|r| r.token()).collect::<Vec<_>>(), [6]);
}

/// SIGHUP's default action is to end the process; `systemctl reload` right after start must
/// not do that while the store is still being recovered.
#[tokio::test]
async fn sighup_during_start_up_is_applied_once_the_proxy_is_up() {
    let mut d = Deployment::builder().build().await;
    let mut sent = false;
    // Spawning waits until the proxy listens: it fails if the signal ended the process.
    d.start_with(move |line, pid| {
        if !sent && line.contains("opening the fence store") {
            sent = true;
            common::process::signal(pid, "HUP");
        }
    });
    let proxy = d.running.as_mut().unwrap();
    proxy.wait_for_log("configuration reloaded", 1).await;
    assert_eq!(proxy.exited(), None);
}
