//! Writes a backend applies late (docs/pins.md): fencegate in front of Apache with mod_dav
//! (`common::apache`), through a relay the test controls (`common::relay`) that holds a chosen
//! write past fencegate's timeout and quarantine and then delivers it: without pins it
//! overwrites the newer write, with `pin = "etag"` Apache refuses it. Also the checks of the
//! parts: a held request reaches the backend later, byte for byte, and Apache does what the
//! pins rely on.

use crate::common;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::apache::{Apache, ETags, start_apache, start_apache_with};
use common::backend::{Reply, StubBackend};
use common::relay::{Relay, Request, method_with_token};
use common::signing::with_rules;
use common::{Harness, RawConn, Resp, raw_request};

/// fencegate's bound on the backend's answer: the held write's `504`. Every other write must
/// be answered within it, by an Apache on a machine other tests load too (200 ms is not
/// always enough).
const TIMEOUT: Duration = Duration::from_secs(1);
/// How long the resource refuses writes after that `504`.
const QUARANTINE: Duration = Duration::from_millis(200);
/// How long the relay holds the write at least: until three times the quarantine has passed
/// since fencegate gave up on it.
const HOLD: Duration = TIMEOUT.saturating_add(QUARANTINE.saturating_mul(3));
/// The relay's own test holds for this long.
const RELAY_HOLD: Duration = Duration::from_millis(300);

/// fencegate in front of `relay`, with the short timeout and quarantine above, and every key
/// under `pin = "etag"` when `pinned`.
async fn proxy_through(relay: &Relay, pinned: bool) -> Harness {
    let url = relay.url();
    Harness::start_with(|c| {
        if pinned {
            *c = with_rules(c, "[[fence.rules]]\nprefix = \"/\"\npin = \"etag\"\n");
        }
        c.backend.url = url.parse().unwrap();
        c.backend.request_timeout = TIMEOUT;
        c.fence.quarantine = QUARANTINE;
    })
    .await
}

/// A PUT of `path` with `token`.
fn put_of(path: &'static str, token: u64) -> impl Fn(&Request) -> bool + Send + Sync + 'static {
    move |r| r.method == "PUT" && r.target == path && r.token() == Some(token)
}

/// Sends `token`'s PUT of `body` to `path` until the resource's quarantine lets it through;
/// returns the first answer that is not `503 resource_quarantined`.
async fn put_after_quarantine(h: &Harness, path: &str, token: u64, body: &str) -> Resp {
    common::past_quarantine(async || h.put(path, token, body).await).await
}

/// The gap pins close, shown as it is without them: a write fencegate gave up on (`504`, then
/// quarantine) reaches the backend after the quarantine, when a newer holder's write has been
/// accepted and applied, and overwrites it. This test passes by demonstrating the failure:
/// the file ends holding the older token's "one". The hold is gated so the order is the
/// test's, not the machine's speed. With pins the same sequence ends holding "two"
/// (`a_delayed_write_fails_at_the_backend_with_pins`).
#[tokio::test]
async fn a_delayed_write_lands_after_the_newer_one_without_pins() {
    let Some(apache) = start_apache().await else { return };
    let relay = Relay::start(apache.addr).await;
    let h = proxy_through(&relay, false).await;
    let mut hold = relay.hold_next_gated(put_of("/doc", 1), HOLD);

    h.put("/doc", 1, "one").await.assert_refused(504, "backend_timeout");
    let held = hold.held().await;
    assert_eq!(held.body, b"one");
    assert_eq!(apache.file("/doc"), None, "the held write has not reached Apache");
    assert_eq!(h.proxy.max_seen("/doc"), Some(1), "token 1 was used up before it was sent");

    // The newer holder's write, once the quarantine is over: accepted and applied.
    let two = put_after_quarantine(&h, "/doc", 2, "two").await;
    assert_eq!(two.status, 201, "Apache created the file: {:?}", two.body);
    assert_eq!(apache.file("/doc").as_deref(), Some(&b"two"[..]));

    // Then the held write arrives, as from a buffer nobody can see into.
    hold.release();
    let late = hold.delivered().await;
    assert!(late.sent_at - late.held_at >= HOLD, "held {:?}", late.sent_at - late.held_at);
    let answer = late.response.expect("Apache answered the late write");
    assert_eq!(answer.status, 204, "Apache replaced the file with the older write");

    // The writes to /doc in the order Apache received them: token 2, then token 1.
    let order: Vec<u64> =
        relay.sent().iter().filter(|r| r.method == "PUT" && r.target == "/doc").filter_map(|r| r.token()).collect();
    assert_eq!(order, [2, 1], "the older token reached Apache last");
    assert_eq!(
        apache.file("/doc").as_deref(),
        Some(&b"one"[..]),
        "without pins the older token's write is the one that stays"
    );
}

/// The same delay with pins (docs/pins.md): the held write was sent with the precondition
/// naming the state it was ordered after, so when it arrives late, after a newer write changed
/// the file, Apache refuses it (`412`) and the newer write stays. Once for a file that did not
/// exist (the held write carries `If-None-Match: *`) and once for one that did (`If-Match`
/// with the tag a `HEAD` learnt, since Apache's `PUT` answers name none). A pinned `PUT` to the
/// absent file needs no wait for the quarantine: it learns the state by a `HEAD` and is pinned
/// to it. One to the existing file finds the very tag the held write was pinned to, which a
/// digest ETag gives again for the same bytes (docs/pins.md): it waits out the quarantine.
#[tokio::test]
async fn a_delayed_write_fails_at_the_backend_with_pins() {
    let Some(apache) = start_apache().await else { return };
    let relay = Relay::start(apache.addr).await;
    let h = proxy_through(&relay, true).await;
    assert_eq!(h.put("/old", 1, "zero").await.status, 201);
    for (path, precondition) in [("/new", "if-none-match"), ("/old", "if-match")] {
        let mut hold = relay.hold_next_gated(put_of(path, 2), HOLD);
        h.put(path, 2, "one").await.assert_refused(504, "backend_timeout");
        let held = hold.held().await;
        assert!(held.header(precondition).is_some(), "{path}: the held write is pinned: {:?}", held.headers);

        let two = if path == "/new" {
            h.put(path, 3, "two").await
        } else {
            h.put(path, 3, "two").await.assert_refused(503, "resource_quarantined");
            put_after_quarantine(&h, path, 3, "two").await
        };
        assert!(two.status == 201 || two.status == 204, "{path}: {two:?}");
        assert_eq!(apache.file(path).as_deref(), Some(&b"two"[..]));

        hold.release();
        let late = hold.delivered().await;
        assert!(late.sent_at - late.held_at >= HOLD);
        assert_eq!(late.request.raw, held.raw, "delivered as fencegate sent it");
        assert_eq!(late.response.expect("Apache answered the late write").status, 412, "{path}");
        let order: Vec<u64> = relay
            .sent()
            .iter()
            .filter(|r| r.method == "PUT" && r.target == path)
            .filter_map(|r| r.token())
            .filter(|&t| t > 1)
            .collect();
        assert_eq!(order, [3, 2], "{path}: the older token still reached Apache last");
        assert_eq!(apache.file(path).as_deref(), Some(&b"two"[..]), "{path}: the newer write stays");
    }
    // What the pins cost: every write here learnt its key by a HEAD, Apache's PUT answers naming
    // no ETag: /old absent, then /new absent twice (its held create has not landed), then /old
    // tagged once for the held write and once for each try of token 3 in the quarantine.
    let admin = h.start_admin().await;
    let metrics = raw_request(admin, "GET /metrics HTTP/1.1\r\nHost: x", "").await;
    let text = String::from_utf8_lossy(&metrics.body);
    let heads = |found: &str| {
        let name = format!("fencegate_pin_heads_total{{found=\"{found}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(name.as_str())).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
    };
    assert_eq!((heads("absent"), heads("unavailable")), (3, 0), "{text}");
    assert!(heads("tag") >= 3, "{text}");
}

/// A write refused because its `HEAD` found the very tag a late write was pinned to keeps no
/// pin of it: the late write may land at any moment and move the state. Here it lands, the
/// quarantine ends, and the refused write sent again learns the state anew and lands. Kept,
/// that tag would pin it to a state the backend left (`412 backend_moved`), and should that
/// write's own outcome be unknown, a write of the tag's bytes could bring the tag back under
/// it (docs/pins.md; `pin_model`'s `forgets_late`).
#[tokio::test]
async fn a_state_found_under_a_late_writes_tag_is_not_kept() {
    let Some(apache) = start_apache().await else { return };
    let relay = Relay::start(apache.addr).await;
    let h = proxy_through(&relay, true).await;
    assert_eq!(h.put("/k", 1, "zero").await.status, 201);
    let mut hold = relay.hold_next_gated(put_of("/k", 2), HOLD);
    h.put("/k", 2, "one").await.assert_refused(504, "backend_timeout");
    let held = hold.held().await;
    assert!(held.header("if-match").is_some(), "the held write is pinned: {:?}", held.headers);
    // The key still has the held write's tag: refused, as without pins.
    h.put("/k", 3, "two").await.assert_refused(503, "resource_quarantined");
    hold.release();
    assert_eq!(hold.delivered().await.response.expect("Apache answered the late write").status, 204);
    assert_eq!(apache.file("/k").as_deref(), Some(&b"one"[..]), "the late write landed first");
    let two = put_after_quarantine(&h, "/k", 3, "two").await;
    assert_eq!(two.status, 204, "pinned to the state the late write left: {two:?}");
    assert_eq!(apache.file("/k").as_deref(), Some(&b"two"[..]));
}

/// The relay itself: a request before the held one on the same connection passes; the held
/// one gets no answer on its connection and reaches the backend only after the hold, on a
/// connection of its own, byte for byte; a gated hold waits for its release, and a chunked
/// body is recognised whole.
#[tokio::test]
async fn the_relay_delivers_a_held_request_later_byte_for_byte() {
    let stub = StubBackend::start(Reply::Answer(201, "made")).await;
    // A second relay records exactly what reaches the backend.
    let recorder = Relay::start(stub.addr()).await;
    let relay = Relay::start(recorder.addr()).await;

    let mut hold = relay.hold_next(method_with_token("PUT", 7), RELAY_HOLD);
    let mut conn = RawConn::open(relay.addr()).await;
    conn.send("GET /a HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(conn.read_response().await.status, 201, "a request that does not match passes");
    let put = "PUT /a HTTP/1.1\r\nHost: x\r\nFencing-Token: 7\r\nContent-Length: 5\r\n\r\nhello";
    conn.send(put).await;
    let held = hold.held().await;
    assert_eq!(held.raw, put.as_bytes());
    assert_eq!((held.method.as_str(), held.target.as_str(), held.body.as_slice()), ("PUT", "/a", &b"hello"[..]));

    let late = hold.delivered().await;
    assert!(late.sent_at - late.held_at >= RELAY_HOLD, "delivered after {:?}", late.sent_at - late.held_at);
    assert_eq!(late.response.expect("the stub answered").status, 201);
    let reached = recorder.requests();
    assert_eq!(reached.len(), 2, "{reached:?}");
    assert_eq!(reached[1].raw, put.as_bytes(), "delivered byte for byte");
    assert_ne!(reached[1].connection, reached[0].connection, "on a connection of the relay's own");
    let mut buf = [0u8; 64];
    assert_eq!(
        conn.read_some_within(Duration::from_millis(50), &mut buf).await,
        None,
        "the held request's connection never gets an answer"
    );

    // Gated, and chunked: nothing is delivered before the release.
    let mut gated = relay.hold_next_gated(method_with_token("PUT", 8), Duration::ZERO);
    let chunked = "PUT /b HTTP/1.1\r\nHost: x\r\nFencing-Token: 8\r\nTransfer-Encoding: chunked\r\n\r\n\
                   3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
    let mut other = RawConn::open(relay.addr()).await;
    other.send(chunked).await;
    assert_eq!(gated.held().await.raw, chunked.as_bytes());
    assert!(!gated.is_delivered(), "a gated hold waits for its release");
    assert_eq!(recorder.requests().len(), 2, "nothing more reached the backend");
    gated.release();
    assert_eq!(gated.delivered().await.response.expect("the stub answered").status, 201);
    assert_eq!(recorder.requests().last().unwrap().raw, chunked.as_bytes());

    // A client that stops sending after its request still gets the answer.
    let mut half = tokio::net::TcpStream::connect(relay.addr()).await.unwrap();
    half.write_all(b"GET /c HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    half.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(common::wait::DEADLINE, half.read_to_end(&mut answer)).await.unwrap().unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 201"), "{:?}", String::from_utf8_lossy(&answer));
}

/// The `ETag` of `path` as a `HEAD` to Apache answers it.
async fn etag(apache: &Apache, path: &str) -> Option<String> {
    let r = raw_request(apache.addr, &format!("HEAD {path} HTTP/1.1\r\nHost: x"), "").await;
    r.headers.get("etag").map(|v| v.to_str().unwrap().to_owned())
}

/// `method` of `path` straight to Apache, with `headers` (each `Name: value`) and `body`.
async fn to_apache(apache: &Apache, method: &str, path: &str, headers: &[&str], body: &str) -> Resp {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x");
    for h in headers {
        head.push_str("\r\n");
        head.push_str(h);
    }
    raw_request(apache.addr, &head, body).await
}

/// What the pins rely on in Apache with mod_dav and `FileETag Digest` (common::apache's notes):
/// no `ETag` in a `PUT`'s answer, a strong one from `HEAD` that comes back with the same
/// bytes, and `If-Match` and `If-None-Match: *` honoured on `PUT` and `DELETE`.
#[tokio::test]
async fn apache_with_digest_tags_honours_preconditions_and_names_no_tag_on_a_put() {
    let Some(apache) = start_apache().await else { return };
    let created = to_apache(&apache, "PUT", "/a", &[], "A").await;
    assert_eq!(created.status, 201);
    assert_eq!(created.headers.get("etag"), None, "a PUT's answer names no tag");
    let tag_a = etag(&apache, "/a").await.expect("HEAD names a tag");
    assert!(!tag_a.starts_with("W/"), "Digest tags are strong from the first moment: {tag_a}");

    let if_match = |tag: &str| format!("If-Match: {tag}");
    assert_eq!(to_apache(&apache, "PUT", "/a", &[&if_match("\"other\"")], "B").await.status, 412);
    assert_eq!(to_apache(&apache, "PUT", "/a", &["If-None-Match: *"], "B").await.status, 412);
    assert_eq!(apache.file("/a").as_deref(), Some(&b"A"[..]), "a failed precondition changes nothing");
    let replaced = to_apache(&apache, "PUT", "/a", &[&if_match(&tag_a)], "B").await;
    assert_eq!(replaced.status, 204);
    assert_eq!(replaced.headers.get("etag"), None);
    let tag_b = etag(&apache, "/a").await.unwrap();
    assert_ne!(tag_b, tag_a);
    assert_eq!(to_apache(&apache, "DELETE", "/a", &[&if_match(&tag_a)], "").await.status, 412);
    assert_eq!(to_apache(&apache, "DELETE", "/a", &["If-None-Match: *"], "").await.status, 412);
    assert_eq!(to_apache(&apache, "PUT", "/a", &[&if_match(&tag_b)], "A").await.status, 204);
    assert_eq!(etag(&apache, "/a").await.as_ref(), Some(&tag_a), "the same bytes, the same tag (A, B, A)");
    assert_eq!(to_apache(&apache, "DELETE", "/a", &[&if_match(&tag_a)], "").await.status, 204);

    let missing = to_apache(&apache, "HEAD", "/a", &[], "").await;
    assert_eq!(missing.status, 404);
    assert_eq!(to_apache(&apache, "PUT", "/a", &[&if_match(&tag_a)], "C").await.status, 412, "no file matches");
    assert_eq!(to_apache(&apache, "PUT", "/a", &["If-None-Match: *"], "C").await.status, 201);
    assert_eq!(apache.file("/a").as_deref(), Some(&b"C"[..]));
}

/// Apache's default `FileETag` (`MTime Size`) makes a weak tag while the file's modification
/// time is less than a second before the request, which `If-Match` never matches, and a strong
/// one after. The file's time is set on disk, so the test waits for no second to pass.
#[tokio::test]
async fn apache_default_tags_are_weak_within_a_second_of_a_write() {
    let Some(apache) = start_apache_with(ETags::MTimeSize).await else { return };
    let path = apache.root.join("m");
    std::fs::write(&path, "one").unwrap();
    let file = std::fs::File::options().write(true).open(&path).unwrap();
    let now = std::time::SystemTime::now();

    file.set_modified(now + Duration::from_secs(3600)).unwrap();
    let weak = etag(&apache, "/m").await.unwrap();
    assert!(weak.starts_with("W/"), "{weak}");
    assert_eq!(to_apache(&apache, "PUT", "/m", &[&format!("If-Match: {weak}")], "two").await.status, 412);

    file.set_modified(now - Duration::from_secs(3600)).unwrap();
    let strong = etag(&apache, "/m").await.unwrap();
    assert!(!strong.starts_with("W/"), "{strong}");
    assert_eq!(to_apache(&apache, "PUT", "/m", &[&format!("If-Match: {strong}")], "two").await.status, 204);
    assert_eq!(apache.file("/m").as_deref(), Some(&b"two"[..]));
}
