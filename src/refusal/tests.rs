use std::time::Duration;

use super::*;
use http_body_util::BodyExt;

fn examples() -> Vec<(Refusal, u16, &'static str)> {
    let d = Duration::from_secs(3);
    let fence = |e| Refusal::Fence(e);
    let wrong_method = Refusal::WrongMethod { method: "PUT".into(), path: "/metrics".into(), allow: "GET" };
    vec![
        (Refusal::MissingToken { header: "fencing-token".into() }, 428, "missing_token"),
        (Refusal::MethodNotAllowed("CONNECT".into()), 405, "method_not_allowed"),
        (Refusal::Unauthorized, 401, "unauthorized"),
        (Refusal::AdminWritesDisabled, 403, "admin_writes_disabled"),
        (Refusal::AdminReadsDisabled, 403, "admin_reads_disabled"),
        (Refusal::NotLeader { leader: "http://127.0.0.1:1".into() }, 421, "not_leader"),
        (
            Refusal::TooManyRefusals { by: LimitedBy::Client, lock: "/l".into(), retry_after: d },
            429,
            "too_many_refusals",
        ),
        (Refusal::NotFound("/x".into()), 404, "not_found"),
        (Refusal::BadRequest("x".into()), 400, "invalid_request"),
        (Refusal::NotImplemented("x".into()), 501, "not_implemented"),
        (fence(FenceError::WouldLower { resource: "/a".into(), max_seen: 5, to: 4 }), 409, "would_lower"),
        (fence(FenceError::WouldRaise { resource: "/a".into(), max_seen: 4, to: 5 }), 409, "would_raise"),
        (fence(FenceError::NoFence { resource: "/a".into() }), 404, "not_found"),
        (wrong_method, 405, "method_not_allowed"),
        (Refusal::UpgradeRefused("websocket".into()), 400, "upgrade_refused"),
        (Refusal::CrossDomain("x".into()), 400, "cross_domain_write"),
        (Refusal::Lock(LockError::NotHolder { lock: "/l".into(), token: 3, holder: Some(4) }), 409, "not_lock_holder"),
        (Refusal::Lock(LockError::Unavailable { lock: "/l".into(), reason: "x".into() }), 503, "verify_unavailable"),
        (Refusal::Lock(LockError::NoLockName { key: "/a".into(), template: "/l/{2}".into() }), 400, "no_lock_name"),
        (Refusal::CrossVerify("x".into()), 400, "cross_verify_write"),
        (Refusal::MissingSignature { header: "fencing-token-signature".into() }, 428, "missing_signature"),
        (Refusal::InvalidSignature(SignatureError::Shape), 400, "invalid_signature"),
        (
            Refusal::SignatureRejected { resource: "/a".into(), reason: Rejected::UnknownKey { kid: "k".into() } },
            403,
            "signature_rejected",
        ),
        (
            fence(FenceError::Jump { resource: "/a".into(), token: 9, base: 1, max_jump: 2, domain: None }),
            409,
            "token_jump",
        ),
        (Refusal::InvalidHeader { name: "destination".into(), reason: "twice".into() }, 400, "invalid_header"),
        (Refusal::HeadersTooLarge { size: 9, limit: 8 }, 431, "headers_too_large"),
        (Refusal::UriTooLong { size: 9, limit: 8 }, 414, "uri_too_long"),
        (Refusal::BodyTooLarge { limit: 8 }, 413, "body_too_large"),
        (Refusal::Upstream(UpstreamError::BodyTooLarge { limit: 8 }), 413, "body_too_large"),
        (Refusal::InvalidToken(TokenError::NotDecimal), 400, "invalid_token"),
        (Refusal::InvalidPath(PathError::EscapedSlash), 400, "invalid_path"),
        (fence(FenceError::Stale { resource: "/a".into(), token: 33, max_seen: 34, floor: None }), 409, "stale_token"),
        (fence(FenceError::QueueTimeout { resource: "/a".into(), waited: d }), 503, "queue_timeout"),
        (
            fence(FenceError::Quarantined { resource: "/a".into(), retry_after: d, cause: Default::default() }),
            503,
            "resource_quarantined",
        ),
        (fence(FenceError::TaskFailed("panic".into())), 500, "internal"),
        (Refusal::Store(StoreError::Failed("fsync: EIO".into())), 503, "store_unavailable"),
        (Refusal::Store(StoreError::Full(10)), 503, "resource_limit"),
        (Refusal::Store(StoreError::FullBytes(1 << 20)), 503, "resource_limit"),
        (fence(FenceError::Full { resource: "/new".into(), max_bytes: 1 << 20 }), 503, "resource_limit"),
        (Refusal::Store(StoreError::NoSpace("ENOSPC".into())), 503, "store_full"),
        (Refusal::Upstream(UpstreamError::Unreachable("refused".into())), 502, "backend_unreachable"),
        (Refusal::Upstream(UpstreamError::Busy(d)), 503, "backend_busy"),
        (Refusal::Upstream(UpstreamError::Failed("reset".into())), 502, "backend_error"),
        (Refusal::Upstream(UpstreamError::Timeout(d)), 504, "backend_timeout"),
        (Refusal::Upstream(UpstreamError::NoLeader("no route".into())), 503, "store_unavailable"),
        (Refusal::PinUnavailable { resource: "/a".into(), why: "HEAD 500".into() }, 503, "pin_unavailable"),
        (
            Refusal::PreconditionFailed { resource: "/a".into(), header: "If-Match", state: "absent".into() },
            412,
            "precondition_failed",
        ),
        (Refusal::BackendMoved { resource: "/a".into(), sent: "If-Match: \"t\"".into() }, 412, "backend_moved"),
    ]
}

#[tokio::test]
async fn status_and_code_mapping_is_pinned() {
    for (err, status, code) in examples() {
        let resp = err.response();
        assert_eq!(resp.status().as_u16(), status, "{err:?}");
        assert_eq!(resp.headers()[ERROR_HEADER], code);
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/json");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"], code);
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
}

#[tokio::test]
async fn jump_and_signature_bodies_say_what_was_measured() {
    let json = async |r: Refusal| -> Value {
        serde_json::from_slice(&r.response().into_body().collect().await.unwrap().to_bytes()).unwrap()
    };
    let jump = |domain: Option<&str>| FenceError::Jump {
        resource: "/a".into(),
        token: 5000,
        base: 100,
        max_jump: 10,
        domain: domain.map(str::to_owned),
    };
    let v = json(Refusal::Fence(jump(None))).await;
    assert_eq!(
        (v["token"].as_u64(), v["max_seen"].as_u64(), v["max_jump"].as_u64()),
        (Some(5000), Some(100), Some(10))
    );
    let v = json(Refusal::Fence(jump(Some("etcd")))).await;
    assert_eq!((v["token_domain"].as_str(), v["domain_max"].as_u64()), (Some("etcd"), Some(100)));
    assert!(v.get("max_seen").is_none(), "the key has none: {v}");
    assert!(v["message"].as_str().unwrap().contains("highest token accepted in token domain etcd"), "{v}");
    let expired = Rejected::Expired { kid: "k1".into(), expiry: 10, now: 50, skew: 30 };
    let v = json(Refusal::SignatureRejected { resource: "/a".into(), reason: expired }).await;
    assert_eq!(
        (v["reason"].as_str(), v["kid"].as_str(), v["expiry"].as_u64()),
        (Some("expired"), Some("k1"), Some(10))
    );
    assert!(v["message"].as_str().unwrap().contains("expired at 10"), "{v}");
}

#[test]
fn answers_that_a_retry_may_cure_say_when_to_retry() {
    let retry_after = |r: Refusal| r.response().headers().get(RETRY_AFTER).map(|v| v.to_str().unwrap().to_owned());
    let d = Duration::from_millis(100);
    assert_eq!(retry_after(Refusal::Upstream(UpstreamError::Busy(d))).as_deref(), Some("1"));
    assert_eq!(
        retry_after(Refusal::Fence(FenceError::QueueTimeout { resource: "/a".into(), waited: d })).as_deref(),
        Some("1")
    );
    assert_eq!(retry_after(Refusal::Upstream(UpstreamError::Unreachable("refused".into()))), None);
    let limited =
        |ms| Refusal::TooManyRefusals { by: LimitedBy::Key, lock: "/l".into(), retry_after: Duration::from_millis(ms) };
    assert_eq!(retry_after(limited(2_100)).as_deref(), Some("3"), "rounded up");
    assert_eq!(retry_after(limited(10)).as_deref(), Some("1"), "never 0");
}

#[tokio::test]
async fn stale_body_names_resource_token_and_max_seen() {
    let err =
        Refusal::Fence(FenceError::Stale { resource: "/accounts/42".into(), token: 33, max_seen: 34, floor: None });
    let body = err.response().into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["resource"], "/accounts/42");
    assert_eq!(v["token"], 33);
    assert_eq!(v["max_seen"], 34);
}

#[tokio::test]
async fn a_withheld_level_is_neither_in_the_body_nor_in_the_message() {
    let body = async |r: Refusal| -> String {
        String::from_utf8(r.response_withholding_levels().into_body().collect().await.unwrap().to_bytes().to_vec())
            .unwrap()
    };
    let stale = Refusal::Fence(FenceError::Stale { resource: "/a".into(), token: 33, max_seen: 4242, floor: None });
    let floor = || Some("/".to_owned());
    let under = Refusal::Fence(FenceError::Stale { resource: "/a".into(), token: 33, max_seen: 4242, floor: floor() });
    let jump = Refusal::Fence(FenceError::Jump {
        resource: "/a".into(),
        token: 9,
        base: 4242,
        max_jump: 2,
        domain: Some("d".into()),
    });
    for (refusal, code) in [(stale, "stale_token"), (under, "stale_token"), (jump, "token_jump")] {
        assert!(refusal.names_a_level());
        let text = body(refusal).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (v["error"].as_str(), v["withheld"].as_bool(), v["resource"].as_str()),
            (Some(code), Some(true), Some("/a"))
        );
        assert!(!text.contains("4242"), "{text}");
    }
    let other = Refusal::MissingToken { header: "fencing-token".into() };
    assert!(!other.names_a_level());
    assert_eq!(
        body(other).await,
        String::from_utf8(
            Refusal::MissingToken { header: "fencing-token".into() }
                .response()
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec()
        )
        .unwrap()
    );
}
