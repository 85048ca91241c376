//! fencegate as Envoy's external processor (`server.mode = "ext_proc"`), behind a real Envoy
//! (`common::envoy`), each test judged by what the backend applied.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common;

use bytes::Bytes;
use common::envoy::{Envoy, EnvoyOptions};
use common::{Harness, Resp};
use fencegate::config::{EqualToken, ServerMode};

/// fencegate serving Envoy's external processor, the in-memory backend, and Envoy in front of
/// both.
struct Mesh {
    h: Harness,
    envoy: Envoy,
}

impl Mesh {
    async fn start() -> Option<Mesh> {
        Mesh::start_with(EnvoyOptions::default(), |_| {}).await
    }

    async fn start_with(options: EnvoyOptions, tweak: impl FnOnce(&mut fencegate::Config)) -> Option<Mesh> {
        let h = Harness::start_with(|c| {
            c.server.mode = ServerMode::ExtProc;
            tweak(c);
        })
        .await;
        let envoy = Envoy::start(h.addr, h.backend.addr(), &options).await?;
        Some(Mesh { h, envoy })
    }

    /// The same in front of a backend the test started itself at `backend` (the harness's own
    /// in-memory backend then sees nothing).
    async fn in_front_of(backend: std::net::SocketAddr) -> Option<Mesh> {
        let h = Harness::start_with(|c| {
            c.server.mode = ServerMode::ExtProc;
            c.backend.url = format!("http://{backend}").parse().unwrap();
        })
        .await;
        let envoy = Envoy::start(h.addr, backend, &EnvoyOptions::default()).await?;
        Some(Mesh { h, envoy })
    }

    async fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Resp {
        self.h.send_to(self.envoy.addr, method, path, headers, body).await
    }

    async fn put(&self, path: &str, token: u64, body: &str) -> Resp {
        self.send("PUT", path, &[("fencing-token", &token.to_string())], body.to_owned()).await
    }
}

#[tokio::test]
async fn the_zombie_write_is_refused_through_envoy() {
    let Some(m) = Mesh::start().await else { return };
    // t3: Client2 acquires 34 and writes.
    let r = m.put("/accounts/42", 34, "client2").await;
    assert_eq!((r.status, r.fencegate_error()), (200, None), "{r:?}");
    // t6: Client1 wakes with 33.
    let r = m.put("/accounts/42", 33, "client1").await;
    r.assert_refused(409, "stale_token");
    assert_eq!(r.json()["max_seen"], 34);
    assert_eq!(m.h.applied_tokens("/accounts/42"), [34]);
    assert_eq!(m.h.backend.object("/accounts/42").unwrap(), "client2");
    assert_eq!(m.h.proxy.max_seen("/accounts/42"), Some(34));
}

#[tokio::test]
async fn reads_are_not_sent_to_the_processor_and_writes_never_pass_without_it() {
    let Some(mut m) = Mesh::start().await else { return };
    assert_eq!(m.put("/doc", 1, "v1").await.status, 200);
    m.h.shutdown().await;
    let r = m.send("GET", "/doc", &[], "").await;
    assert_eq!((r.status, &r.body[..]), (200, &b"v1"[..]), "a GET reaches the backend without the processor");
    let r = m.put("/doc", 2, "v2").await;
    assert_eq!(r.status, 500, "Envoy fails a write it cannot ask about: {r:?}");
    assert_eq!(m.h.applied_tokens("/doc"), [1], "no write passed unfenced");
}

#[tokio::test]
async fn the_backend_receives_the_canonical_path_that_was_fenced() {
    let Some(m) = Mesh::start().await else { return };
    let r = m.put("/a//b/./c", 5, "x").await;
    assert_eq!(r.status, 200, "{r:?}");
    let paths: Vec<String> = m.h.backend.applied().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/a/b/c"]);
    m.put("/a/b/c", 5, "again").await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn a_move_is_fenced_at_its_destination_too() {
    let Some(m) = Mesh::start().await else { return };
    assert_eq!(m.put("/dst", 10, "newer").await.status, 200);
    assert_eq!(m.put("/src", 3, "old").await.status, 200);
    let destination = format!("http://{}/dst", m.envoy.addr);
    let r = m.send("MOVE", "/src", &[("fencing-token", "5"), ("destination", &destination)], "").await;
    r.assert_refused(409, "stale_token");
    assert_eq!(r.json()["resource"], "/dst");
    let r = m.send("MOVE", "/src", &[("fencing-token", "11"), ("destination", &destination)], "").await;
    assert_eq!(r.fencegate_error(), None, "the MOVE reached the backend: {r:?}");
    let moves: Vec<_> = m.h.backend.requests().into_iter().filter(|r| r.method == "MOVE").collect();
    assert_eq!(moves.len(), 1, "only the fresh MOVE reached the backend");
    assert_eq!(moves[0].token(), Some(11));
    // A MOVE covers the subtrees at both ends: neither takes 11 again.
    m.put("/dst", 11, "equal").await.assert_refused(409, "stale_token");
    m.put("/src", 11, "equal").await.assert_refused(409, "stale_token");
}

#[tokio::test]
async fn a_write_envoy_answers_itself_quarantines_its_resource() {
    let options = EnvoyOptions { route_timeout: Duration::from_millis(500), ..Default::default() };
    let Some(m) = Mesh::start_with(options, |_| {}).await else { return };
    let (token, delay) = ("7", "2000");
    let r = m.send("PUT", "/slow", &[("fencing-token", token), (common::DELAY_HEADER, delay)], "late").await;
    assert_eq!((r.status, r.fencegate_error()), (504, None), "Envoy's own timeout: {r:?}");
    // The backend still holds the write and applies it late: the resource stays closed.
    m.put("/slow", 8, "next").await.assert_refused(503, "resource_quarantined");
    common::poll_until("the backend applies the late write", || m.h.applied_tokens("/slow") == [7]).await;
    m.put("/slow", 9, "after").await.assert_refused(503, "resource_quarantined");
    assert_eq!(m.h.applied_tokens("/slow"), [7]);
}

/// Envoy in front of a backend that answers a head at once and reads the body after, and a
/// write of token 10 to `/r` of which the client has sent half the body.
async fn a_write_half_sent() -> Option<(Mesh, common::RawConn, Arc<Mutex<Vec<String>>>)> {
    a_write_half_sent_to("201 Created", "").await
}

/// [`a_write_half_sent`], to a backend that answers `status` with `body`, which it sends once it
/// has the whole request.
async fn a_write_half_sent_to(
    status: &'static str,
    body: &'static str,
) -> Option<(Mesh, common::RawConn, Arc<Mutex<Vec<String>>>)> {
    let (backend, log) = common::backend::early_answering_backend_with(status, body).await;
    let m = Mesh::in_front_of(backend).await?;
    let mut first = common::RawConn::open(m.envoy.addr).await;
    first.send(b"PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 10\r\nContent-Length: 10\r\n\r\nhalf-").await;
    common::poll_until("the backend has the first write's head", || log.lock().unwrap().len() == 1).await;
    Some((m, first, log))
}

/// Envoy ends a request whose backend answered before taking the whole body: it relays the
/// answer and resets the backend's request. The backend may hold part of it, so the resource
/// is quarantined, and the rest of the body never reaches the backend.
#[tokio::test]
async fn an_early_answer_ends_the_write_and_quarantines_its_resource() {
    let Some((m, mut first, log)) = a_write_half_sent().await else { return };
    let answer = first.read_response().await;
    assert_eq!(answer.status, 201, "the early answer is relayed: {answer:?}");
    common::poll_until("the write gives its turn back", || m.h.proxy.queue_len("/r") == 0).await;
    let _ = first.try_send(b"whole").await;
    let next = common::raw_request(m.envoy.addr, "PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 20", "v").await;
    next.assert_refused(503, "resource_quarantined");
    assert_eq!(*log.lock().unwrap(), ["head 10"], "nothing more reached the backend");
}

/// A backend that refuses a write (4xx) before it has the whole body applied nothing: its
/// refusal is the write's answer, as through the proxy, and the resource stays open. The
/// write keeps its turn until its body has been let go whole (the refusal's own body comes
/// only then), so the next write's head reaches the backend after all of it.
#[tokio::test]
async fn an_early_refusal_by_the_backend_holds_the_turn_to_the_bodys_end_without_quarantine() {
    let Some((m, mut first, log)) = a_write_half_sent_to("409 Conflict", "nope").await else { return };
    let addr = m.envoy.addr;
    let next =
        tokio::spawn(
            async move { common::raw_request(addr, "PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 20", "v").await },
        );
    common::poll_until("the next write waits for the turn, or has gone by", || {
        m.h.proxy.queue_len("/r") == 2 || log.lock().unwrap().iter().any(|l| l == "head 20")
    })
    .await;
    first.send(b"whole").await;
    let answer = first.read_response().await;
    assert_eq!((answer.status, &answer.body[..]), (409, &b"nope"[..]), "the backend's refusal is relayed");
    let next = next.await.unwrap();
    assert_eq!((next.status, next.fencegate_error()), (409, None), "not quarantined: {next:?}");
    assert_eq!(*log.lock().unwrap(), ["head 10", "body 10", "head 20", "body 20"]);
}

/// A pinned write the backend refuses by its precondition (`412`) before the body's end:
/// fencegate's `backend_moved` takes the refusal's place at once, however slow the rest of the
/// body (Envoy's `message_timeout` would answer a held head itself), and Envoy lets none of the
/// rest go on: the backend never reads it, and the next write is answered by the backend too.
#[tokio::test]
async fn an_early_412_to_a_pinned_write_is_backend_moved_at_once_and_the_rest_never_goes() {
    let (backend, log) = common::backend::early_answering_backend_with("412 Precondition Failed", "nope").await;
    let h = Harness::start_with(|c| {
        *c = common::signing::with_rules(c, "[[fence.rules]]\nprefix = \"/\"\npin = \"etag\"\n");
        c.server.mode = ServerMode::ExtProc;
        c.backend.url = format!("http://{backend}").parse().unwrap();
    })
    .await;
    let Some(envoy) = Envoy::start(h.addr, backend, &EnvoyOptions::default()).await else { return };
    let m = Mesh { h, envoy };
    let mut first = common::RawConn::open(m.envoy.addr).await;
    first.send(b"PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 10\r\nContent-Length: 10\r\n\r\nhalf-").await;
    first.read_response().await.assert_refused(412, "backend_moved");
    let _ = first.try_send(b"whole").await;
    m.put("/r", 20, "v").await.assert_refused(412, "backend_moved");
    common::poll_until("the write's turn is given back", || m.h.proxy.queue_len("/r") == 0).await;
    assert_eq!(*log.lock().unwrap(), ["HEAD", "head 10", "HEAD", "head 20", "body 20"], "the rest never went on");
}

/// Envoy's own end of a write mid-body (its codec's error on a broken chunked body) is never taken for the
/// backend's refusal: the backend holds part of the write, so the resource is quarantined,
/// whether Envoy says so in `response.code_details` or fencegate cannot tell.
#[tokio::test]
async fn envoys_own_refusal_mid_body_quarantines_the_resource() {
    for code_details in [true, false] {
        let options = EnvoyOptions { code_details, ..Default::default() };
        let Some(m) = Mesh::start_with(options, |_| {}).await else { return };
        let mut first = common::RawConn::open(m.envoy.addr).await;
        let head = "PUT /c HTTP/1.1\r\nHost: x\r\nFencing-Token: 10\r\nTransfer-Encoding: chunked\r\n\r\n";
        first.send(format!("{head}5\r\nhalf-\r\n").as_bytes()).await;
        let backend = &m.h.backend;
        common::poll_until("the backend has the first chunk", || {
            backend.requests().iter().any(|r| r.path == "/c") || m.h.proxy.queue_len("/c") == 1
        })
        .await;
        first.send(b"zz-not-a-chunk-size\r\n").await;
        // Envoy answers 400 or closes the connection, as its codec decides.
        let _ = first.read_to_end_within(Duration::from_secs(5)).await;
        common::poll_until("the write gives its turn back", || m.h.proxy.queue_len("/c") == 0).await;
        let next = m.put("/c", 20, "v").await;
        assert_eq!(next.fencegate_error(), Some("resource_quarantined"), "code_details {code_details}: {next:?}");
    }
}

#[tokio::test]
async fn a_client_that_leaves_mid_body_quarantines_the_resource() {
    let Some((m, first, log)) = a_write_half_sent().await else { return };
    drop(first);
    common::poll_until("the abandoned write gives its turn back", || m.h.proxy.queue_len("/r") == 0).await;
    let next = common::raw_request(m.envoy.addr, "PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 20", "v").await;
    next.assert_refused(503, "resource_quarantined");
    assert_eq!(*log.lock().unwrap(), ["head 10"], "nothing more reached the backend");
}

#[tokio::test]
async fn writes_to_one_resource_reach_the_backend_in_token_order() {
    let Some(m) = Mesh::start().await else { return };
    let m = Arc::new(m);
    // A slow first write holds the resource's turn; the later ones wait for it, and a lower
    // token that gets its turn after a higher one is stale.
    let slow = {
        let m = Arc::clone(&m);
        tokio::spawn(async move {
            let headers = [("fencing-token", "10"), (common::DELAY_HEADER, "300")];
            m.send("PUT", "/hot", &headers, "10").await
        })
    };
    common::poll_until("the slow write holds the turn", || m.h.proxy.queue_len("/hot") == 1).await;
    let writers: Vec<_> = (11..=22u64)
        .rev()
        .map(|token| {
            let m = Arc::clone(&m);
            tokio::spawn(async move { m.put("/hot", token, &token.to_string()).await })
        })
        .collect();
    assert_eq!(slow.await.unwrap().status, 200);
    for writer in writers {
        let r = writer.await.unwrap();
        assert!(r.status == 200 || r.fencegate_error() == Some("stale_token"), "{r:?}");
    }
    let applied = m.h.applied_tokens("/hot");
    assert_eq!(applied.first(), Some(&10), "{applied:?}");
    assert!(applied.windows(2).all(|w| w[0] < w[1]), "applied out of token order: {applied:?}");
    assert!(applied.contains(&22), "{applied:?}");
}

/// The real binary as the processor, killed with SIGKILL while a write it let go is still at
/// the backend: the restarted processor finds the write in flight in its log and quarantines
/// its resource, so the next holder's write cannot land before the late one.
#[tokio::test]
async fn a_processor_killed_mid_exchange_quarantines_the_write_after_its_restart() {
    let mut d = common::builder::Deployment::builder().config_extra("[fence]\nquarantine = \"2s\"").build().await;
    let [port] = common::services::free_ports();
    let setup = format!("export FENCEGATE_SERVER__MODE=ext_proc FENCEGATE_SERVER__LISTEN=127.0.0.1:{port}");
    let processor = d.start_in_shell(&setup).addr;
    let Some(envoy) = Envoy::start(processor, d.backend.addr(), &EnvoyOptions::default()).await else { return };
    let client = common::client();
    let put = |token: u64, delay: &'static str| {
        let (client, addr) = (client.clone(), envoy.addr);
        let headers =
            [("fencing-token".to_owned(), token.to_string()), (common::DELAY_HEADER.to_owned(), delay.to_owned())];
        async move { common::send_headers(&client, addr, "PUT", "/k", &headers, token.to_string()).await }
    };
    assert_eq!(put(5, "0").await.status, 200);
    let late = tokio::spawn(put(10, "1500"));
    let backend = &d.backend;
    common::poll_until("the backend holds the write of 10", || {
        backend.requests().iter().any(|r| r.path == "/k" && r.token() == Some(10))
    })
    .await;
    d.kill9();
    d.start_in_shell(&setup);
    let _ = late.await;
    let next = put(11, "0").await;
    next.assert_refused(503, "resource_quarantined");
    common::poll_until("the backend applies the late write", || {
        d.backend.applied().iter().filter(|r| r.path == "/k").count() == 2
    })
    .await;
    common::eventually("the quarantine ends", async || put(12, "0").await.status == 200).await;
    let applied: Vec<u64> = d.backend.applied().iter().filter(|r| r.path == "/k").filter_map(|r| r.token()).collect();
    assert_eq!(applied, [5, 10, 12]);
}

#[tokio::test]
async fn metrics_the_admin_api_and_reloads_work_as_in_proxy_mode() {
    let Some(m) = Mesh::start().await else { return };
    let admin = m.h.start_admin().await;
    assert_eq!(m.put("/doc", 7, "v7").await.status, 200);
    m.put("/doc", 7, "again").await.assert_refused(409, "stale_token");
    let fence = common::raw_request(admin, "GET /fences/doc HTTP/1.1\r\nHost: a\r\nConnection: close", "").await;
    assert_eq!((fence.status, &fence.json()["max_seen"]), (200, &serde_json::json!(7)), "{fence:?}");
    let metrics = common::raw_request(admin, "GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close", "").await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let counted = |needle: &str| text.lines().any(|l| l.contains(needle) && !l.ends_with(" 0"));
    assert!(counted("outcome=\"stale_token\""), "the refusal is counted:\n{text}");
    assert!(counted("method=\"PUT\",outcome=\"forwarded\""), "the forwarded write is counted:\n{text}");
    // A reload applies to the next exchange.
    let mut config = m.h.config.clone();
    config.fence.equal_token = EqualToken::Accept;
    m.h.proxy.reload(config).unwrap();
    assert_eq!(m.put("/doc", 7, "equal").await.status, 200, "an equal token passes after the reload");
    assert_eq!(m.h.applied_tokens("/doc"), [7, 7]);
}

/// An exchange outlasting `limits.keepalive_timeout` (a slow backend) keeps its connection:
/// the watchdog closes only connections that do nothing, and one under an open stream does.
#[tokio::test]
async fn a_write_held_longer_than_the_keepalive_timeout_keeps_its_stream() {
    let tweak = |c: &mut fencegate::Config| c.limits.keepalive_timeout = Duration::from_millis(300);
    let Some(m) = Mesh::start_with(EnvoyOptions::default(), tweak).await else { return };
    let r = m.send("PUT", "/slow", &[("fencing-token", "3"), (common::DELAY_HEADER, "1500")], "v").await;
    assert_eq!((r.status, r.fencegate_error()), (200, None), "{r:?}");
    assert_eq!(m.put("/slow", 4, "next").await.status, 200, "nothing was quarantined");
    assert_eq!(m.h.applied_tokens("/slow"), [3, 4]);
}

/// A write whose client leaves while it waits for its turn stops waiting, as through the
/// proxy: it never advances, so its token is not used up.
#[tokio::test]
async fn a_write_whose_client_leaves_while_it_waits_uses_no_token() {
    let Some(m) = Mesh::start().await else { return };
    let m = Arc::new(m);
    let slow = {
        let m = Arc::clone(&m);
        tokio::spawn(
            async move { m.send("PUT", "/q", &[("fencing-token", "10"), (common::DELAY_HEADER, "800")], "").await },
        )
    };
    common::poll_until("the slow write holds the turn", || m.h.proxy.queue_len("/q") == 1).await;
    let mut waiting = common::RawConn::open(m.envoy.addr).await;
    waiting.send(b"PUT /q HTTP/1.1\r\nHost: x\r\nFencing-Token: 20\r\nContent-Length: 1\r\n\r\nw").await;
    common::poll_until("the second write waits", || m.h.proxy.queue_len("/q") == 2).await;
    drop(waiting);
    common::poll_until("the abandoned write stops waiting", || m.h.proxy.queue_len("/q") == 1).await;
    assert_eq!(slow.await.unwrap().status, 200);
    assert_eq!(m.h.proxy.max_seen("/q"), Some(10), "the abandoned write advanced nothing");
    assert_eq!(m.put("/q", 20, "again").await.status, 200, "its token is still good");
    assert_eq!(m.h.applied_tokens("/q"), [10, 20]);
}

/// Against nginx's WebDAV: a stale MOVE or COPY never replaces its destination, however it is
/// spelled, and a fresh one lands on the canonical destination that was fenced.
#[tokio::test]
async fn a_webdav_move_reaches_nginx_at_the_destination_that_was_fenced() {
    let Some(nginx) = common::nginx::start_nginx().await else { return };
    let Some(m) = Mesh::in_front_of(nginx.addr).await else { return };
    let file = |path: &str| std::fs::read_to_string(nginx.root.join(path)).ok();
    assert_eq!(m.put("/acct", 1000, "precious").await.status, 201);
    assert_eq!(m.put("/scratch0", 10, "junk").await.status, 201);
    for method in ["MOVE", "COPY"] {
        for destination in ["/acct", "/%61cct", "//acct", "/x/../acct"] {
            let r = m.send(method, "/scratch0", &[("fencing-token", "500"), ("destination", destination)], "").await;
            r.assert_refused(409, "stale_token");
        }
    }
    assert_eq!((file("acct").as_deref(), file("scratch0").as_deref()), (Some("precious"), Some("junk")));
    let r = m.send("MOVE", "/scratch0", &[("fencing-token", "2000"), ("destination", "/%61cct")], "").await;
    assert!(r.status == 201 || r.status == 204, "{r:?}");
    assert_eq!((file("acct").as_deref(), file("scratch0")), (Some("junk"), None), "moved to the canonical /acct");
    m.put("/acct", 1500, "late").await.assert_refused(409, "stale_token");
}

/// A backend that resets the connection under a write: Envoy answers `503` itself, the
/// outcome is unknown, and the resource is quarantined.
#[tokio::test]
async fn a_write_whose_backend_connection_resets_quarantines_its_resource() {
    let stub = common::backend::StubBackend::start(common::backend::Reply::Close).await;
    let Some(m) = Mesh::in_front_of(stub.addr()).await else { return };
    let r = m.put("/r", 5, "v").await;
    assert_eq!((r.status, r.fencegate_error()), (503, None), "Envoy's own answer: {r:?}");
    m.put("/r", 6, "next").await.assert_refused(503, "resource_quarantined");
    assert_eq!(stub.requests().len(), 1, "the second write never reached the backend");
}

/// S3 through Envoy against s3s-fs, a server that checks SigV4, driven by boto3 as a user
/// would (`tests/common/s3/client.py`): the signed bytes reach the server, refusals are S3's
/// XML, a multipart upload is one write, and a batch delete with one stale key deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boto3_through_envoy_against_an_s3_server_that_checks_signatures() {
    let Some(server) = common::s3::start_s3s().await else { return };
    let config = "[s3]\nvirtual_host_suffixes = [\"s3.test\"]\nflat_keys = false\n";
    let processor = common::s3::S3Proxy::start_as(&server.url, config, ServerMode::ExtProc).await;
    let backend = server.url.trim_start_matches("http://").parse().unwrap();
    let Some(envoy) = Envoy::start(processor.addr, backend, &EnvoyOptions::default()).await else { return };
    let url = format!("http://{}", envoy.addr);
    for name in ["zombie", "signatures", "multipart", "decoys", "copies", "batch_delete"] {
        common::s3::scenario_at(name, &url, &server, &[]).await;
    }
}

/// A client that stalls mid-body past `backend.request_timeout`: the write's turn is given back
/// (its resource quarantined), and the rest of its body must never reach the backend, however
/// late it comes: fencegate ends the stream with an error, and Envoy resets the request.
#[tokio::test]
async fn a_stalled_body_is_never_finished_after_its_turn_was_given_back() {
    let tweak = |c: &mut fencegate::Config| {
        c.backend.request_timeout = Duration::from_millis(800);
        c.fence.quarantine = Duration::from_millis(800);
    };
    let Some(m) = Mesh::start_with(EnvoyOptions::default(), tweak).await else { return };
    let mut first = common::RawConn::open(m.envoy.addr).await;
    first.send(b"PUT /r HTTP/1.1\r\nHost: x\r\nFencing-Token: 10\r\nContent-Length: 10\r\n\r\nhalf-").await;
    common::poll_until("the write of 10 holds the turn", || m.h.proxy.queue_len("/r") == 1).await;
    common::poll_until("the write of 10 gives the turn back", || m.h.proxy.queue_len("/r") == 0).await;
    common::eventually("the quarantine ends and 20 is applied", async || m.put("/r", 20, "twenty").await.status == 200)
        .await;
    let _ = first.try_send(b"whole").await;
    let _ = tokio::time::timeout(Duration::from_secs(3), first.try_read_response()).await;
    let late = m.put("/r", 21, "after").await;
    assert_eq!(late.status, 200, "{late:?}");
    assert_eq!(m.h.applied_tokens("/r"), [20, 21], "the stalled write of 10 never lands");
}

/// fencegate fences a GET or HEAD whose method-override header names a write (docs/writes.md);
/// the route that lets reads skip the processor must not match those.
#[tokio::test]
async fn a_read_with_a_method_override_is_decided_by_fencegate() {
    let Some(m) = Mesh::start().await else { return };
    assert_eq!(m.put("/o", 50, "v50").await.status, 200);
    for (method, header) in [("GET", "X-HTTP-Method-Override"), ("HEAD", "X-HTTP-Method"), ("GET", "X-Method-Override")]
    {
        let stale = m.send(method, "/o", &[(header, "DELETE"), ("fencing-token", "3")], "").await;
        assert_eq!((stale.status, stale.fencegate_error()), (409, Some("stale_token")), "{method} with {header}");
    }
    let overridden: Vec<_> = m.h.backend.requests().into_iter().filter(|r| r.method != "PUT").collect();
    assert!(overridden.is_empty(), "the backend received overridden writes: {overridden:?}");
}

/// The same raw requests through fencegate as a proxy and through Envoy with fencegate as its
/// processor: the same answers, and the backend receives the same path, query and key.
#[tokio::test]
async fn odd_targets_and_heads_are_decided_and_sent_as_the_proxy_does() {
    let Some(m) = Mesh::start().await else { return };
    let p = Harness::start().await;
    let targets = [
        "/a//b/./c?x=1&y=%2F",
        "/a/%2F/b",
        "/a/%2e%2e/b",
        "/a/../b",
        "/x/..%2Fy",
        "/%61bc",
        "/a%20b",
        "/a;b=c",
        "/a/b/",
        "/a?",
        "/a?x=%zz",
        "/a/b/..",
        "/%2e/z",
        "/a\\b",
    ];
    let mut heads: Vec<String> = targets
        .iter()
        .enumerate()
        .map(|(i, target)| format!("PUT {target} HTTP/1.1\r\nHost: x\r\nFencing-Token: {}", 100 + i))
        .collect();
    heads.extend(
        [
            "PUT /d1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 50\r\nFencing-Token: 5",
            "PUT /d2 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5, 50",
            "PUT /d4 HTTP/1.1\r\nHost: x\r\nFencing-Token: +7",
            "PUT /d5 HTTP/1.1\r\nHost: x\r\nFencing-Token: 07",
            "MOVE /d6 HTTP/1.1\r\nHost: x\r\nFencing-Token: 9\r\nDestination: /e1\r\nDestination: /e2",
            "MOVE /d7 HTTP/1.1\r\nHost: x\r\nFencing-Token: 9\r\nDestination: http://y/e3",
            "PUT /d10 HTTP/1.1\r\nHost: x\r\nFencing-Token: 9\r\nX-HTTP-Method-Override: DELETE",
            "GET /d11 HTTP/1.1\r\nHost: x\r\nX-HTTP-Method-Override: PUT",
            "PUT /d12 HTTP/1.1\r\nHost: x\r\nFencing-Token: 18446744073709551615",
            "PUT /d13 HTTP/1.1\r\nHost: x\r\nFencing-Token: 18446744073709551616",
        ]
        .map(str::to_owned),
    );
    let seen = |b: &fencegate::demo::MemBackend| -> Vec<String> {
        b.requests().iter().map(|r| format!("{} {} {:?} {:?}", r.method, r.path, r.query, r.token())).collect()
    };
    let mut diffs = Vec::new();
    for head in &heads {
        let answer = |r: Option<Resp>| r.map(|r| (r.status, r.fencegate_error().map(str::to_owned)));
        let via_proxy = answer(common::try_raw_request(p.addr, head, "v").await);
        let via_envoy = answer(common::try_raw_request(m.envoy.addr, head, "v").await);
        if via_proxy != via_envoy {
            diffs.push(format!("{head:?}: proxy {via_proxy:?}, envoy {via_envoy:?}"));
        }
    }
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
    assert_eq!(seen(&p.backend), seen(&m.h.backend), "the backends received different requests");
}

/// A write forwarded unchecked (`fence.missing_token = "forward"`) is held to the body limit,
/// as through the proxy: a longer body is cut off and never reaches the backend whole.
#[tokio::test]
async fn an_unchecked_write_is_held_to_the_body_limit() {
    let tweak = |c: &mut fencegate::Config| {
        c.fence.missing_token = fencegate::config::MissingToken::Forward;
        c.limits.max_body_bytes = 8;
    };
    let Some(m) = Mesh::start_with(EnvoyOptions::default(), tweak).await else { return };
    let chunked = |body: &str| {
        format!(
            "PUT /u HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        )
    };
    let mut small = common::RawConn::open(m.envoy.addr).await;
    small.send(chunked("smal")).await;
    assert_eq!(small.read_response().await.status, 200, "a body within the limit passes");
    let mut long = common::RawConn::open(m.envoy.addr).await;
    long.send(chunked("0123456789abcdef")).await;
    let r = long.try_read_response().await;
    assert_ne!(r.as_ref().map(|r| r.status), Some(200), "{r:?}");
    let applied: Vec<_> = m.h.backend.applied().into_iter().filter(|r| r.path == "/u").map(|r| r.body).collect();
    assert_eq!(applied, ["smal"], "the long body never reached the backend whole");
}

/// S3 answers a successful AbortMultipartUpload `204 No Content`: Envoy sends no body message,
/// so the answer is read whole at its head. The abort was answered: its object is not
/// quarantined, and its binding is dropped.
#[tokio::test]
async fn an_aborted_upload_leaves_its_object_writable() {
    use common::backend::{Reply, StubBackend};
    const CREATED: &str = "<InitiateMultipartUploadResult><Bucket>bk1</Bucket><Key>k</Key><UploadId>u1</UploadId></InitiateMultipartUploadResult>";
    let stub = StubBackend::start_with(move |seen| match (seen.head.split(' ').next(), seen.head.split(' ').nth(1)) {
        (_, Some("/bk1/k?uploads")) => Reply::Answer(200, CREATED),
        (Some("DELETE"), _) => Reply::Answer(204, ""),
        _ => Reply::Answer(200, ""),
    })
    .await;
    let processor = common::s3::S3Proxy::start_as(&stub.url(), "", ServerMode::ExtProc).await;
    let Some(envoy) = Envoy::start(processor.addr, stub.addr(), &EnvoyOptions::default()).await else { return };
    let send = async |line: &str, token: u64| {
        let head = format!("{line}\r\nHost: 127.0.0.1\r\nFencing-Token: {token}");
        let r = common::raw_request(envoy.addr, &head, "").await;
        (r.status, String::from_utf8_lossy(&r.body).into_owned())
    };
    assert_eq!(send("POST /bk1/k?uploads HTTP/1.1", 41).await.0, 200);
    let aborted = send("DELETE /bk1/k?uploadId=u1 HTTP/1.1", 41).await;
    assert_eq!(aborted.0, 204, "{aborted:?}");
    let next = send("PUT /bk1/k HTTP/1.1", 42).await;
    assert_eq!(next.0, 200, "the object is closed after a successful abort: {next:?}");
    assert_eq!(send("DELETE /bk1/k?uploadId=u1 HTTP/1.1", 42).await.0, 404, "the binding was dropped");
}

/// A chunked write ended by trailers (which the processor is not sent) is whole when Envoy
/// says so, and its answer ends its turn: nothing is quarantined.
#[tokio::test]
async fn a_write_ended_by_trailers_is_answered_and_leaves_its_resource_open() {
    let Some(m) = Mesh::start().await else { return };
    let mut conn = common::RawConn::open(m.envoy.addr).await;
    let head = "PUT /t HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nTransfer-Encoding: chunked\r\nTrailer: x-sum\r\n\r\n";
    conn.send(format!("{head}2\r\nv1\r\n0\r\nx-sum: 1\r\n\r\n")).await;
    let r = conn.read_response().await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(m.h.applied_tokens("/t"), [1]);
    let r = m.put("/t", 2, "v2").await;
    assert_eq!((r.status, r.fencegate_error()), (200, None), "a whole, answered write left /t closed: {r:?}");
}

/// Pins through Envoy (docs/pins.md): a write Envoy gave up on (its route timeout, so the
/// resource is quarantined) reaches Apache late, through a relay the test holds it in, after a
/// newer holder's write. It was sent with the precondition naming the state it was ordered
/// after, so Apache refuses it and the newer write stays. Once for a file that did not exist
/// (`If-None-Match: *`, learnt by fencegate's own `HEAD` to `backend.url`) and once for one
/// that did (`If-Match`). (A `412` answered as `backend_moved` through Envoy is in
/// `s3_pins.rs`: Apache names no tag in a `PUT`'s answer, so its next write learns anew.)
#[tokio::test]
async fn a_delayed_write_fails_at_the_backend_with_pins_through_envoy() {
    use common::apache::start_apache;
    use common::relay::{Relay, Request};
    let Some(apache) = start_apache().await else { return };
    let relay = Relay::start(apache.addr).await;
    let timeout = Duration::from_secs(1);
    let quarantine = Duration::from_millis(200);
    let hold = timeout + quarantine * 3;
    let url = relay.url();
    let h = Harness::start_with(|c| {
        *c = common::signing::with_rules(c, "[[fence.rules]]\nprefix = \"/\"\npin = \"etag\"\n");
        c.server.mode = ServerMode::ExtProc;
        c.backend.url = url.parse().unwrap();
        c.fence.quarantine = quarantine;
    })
    .await;
    let options = EnvoyOptions { route_timeout: timeout, ..Default::default() };
    let Some(envoy) = Envoy::start(h.addr, relay.addr(), &options).await else { return };
    let m = Mesh { h, envoy };
    let put_of = |path: &'static str, token: u64| {
        move |r: &Request| r.method == "PUT" && r.target == path && r.token() == Some(token)
    };

    assert_eq!(m.put("/old", 1, "zero").await.status, 201);
    for (path, precondition) in [("/new", "if-none-match"), ("/old", "if-match")] {
        let mut held_write = relay.hold_next_gated(put_of(path, 2), hold);
        let r = m.put(path, 2, "one").await;
        assert_eq!((r.status, r.fencegate_error()), (504, None), "{path}: Envoy's own timeout: {r:?}");
        let held = held_write.held().await;
        assert!(held.header(precondition).is_some(), "{path}: the held write is pinned: {:?}", held.headers);

        let two = match path {
            // Learnt absent by a HEAD: pinned to that, it need not wait for the quarantine.
            "/new" => m.put(path, 3, "two").await,
            // The tag the held write was pinned to: it waits the quarantine out.
            _ => {
                m.put(path, 3, "two").await.assert_refused(503, "resource_quarantined");
                common::past_quarantine(async || m.put(path, 3, "two").await).await
            }
        };
        assert!(two.status == 201 || two.status == 204, "{path}: {two:?}");
        assert_eq!(apache.file(path).as_deref(), Some(&b"two"[..]));

        held_write.release();
        let late = held_write.delivered().await;
        assert_eq!(late.response.expect("Apache answered the late write").status, 412, "{path}");
        assert_eq!(apache.file(path).as_deref(), Some(&b"two"[..]), "{path}: the newer write stays");
    }
}

/// The access log (`log.access`) has a line for each exchange, with the proxy's fields: a
/// forwarded write with the backend's status, a refusal with fencegate's, and a request
/// Envoy carried on unchecked as `passed`, with no status (Envoy reports none).
#[tokio::test]
async fn each_exchange_has_an_access_line() {
    let extra = "[log]\nformat = \"json\"\naccess = true";
    let mut d = common::builder::Deployment::builder().config_extra(extra).build().await;
    let [port] = common::services::free_ports();
    let setup = format!("export FENCEGATE_SERVER__MODE=ext_proc FENCEGATE_SERVER__LISTEN=127.0.0.1:{port}");
    let processor = d.start_in_shell(&setup).addr;
    let Some(envoy) = Envoy::start(processor, d.backend.addr(), &EnvoyOptions::default()).await else { return };
    let send = |method: &'static str, path: &'static str, headers: &[(&str, &str)]| {
        let headers: Vec<(String, String)> = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let (client, addr) = (common::client(), envoy.addr);
        async move { common::send_headers(&client, addr, method, path, &headers, "v").await }
    };
    assert_eq!(send("PUT", "/doc", &[("fencing-token", "5")]).await.status, 200);
    assert_eq!(send("PUT", "//doc", &[("fencing-token", "4")]).await.status, 409);
    // A read whose override header names a read: decided by fencegate, and passed.
    assert_eq!(send("GET", "/doc", &[("x-http-method-override", "GET")]).await.status, 200);
    d.proxy().wait_for_log("fencegate::access", 3).await;
    let lines: Vec<serde_json::Value> =
        d.proxy().log_lines("fencegate::access").iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let [put, stale, passed] = lines.as_slice() else { panic!("{lines:#?}") };
    let fields =
        |l: &serde_json::Value| serde_json::json!([l["method"], l["path"], l["keys"], l["token"], l["outcome"]]);
    assert_eq!(fields(put), serde_json::json!(["PUT", "/doc", "/doc", 5, "forwarded"]));
    assert_eq!((put["status"].as_u64(), put["backend_status"].as_u64()), (Some(200), Some(200)), "{put}");
    assert_eq!(fields(stale), serde_json::json!(["PUT", "//doc", "/doc", 4, "stale_token"]));
    assert_eq!((stale["status"].as_u64(), stale.get("backend_status")), (Some(409), None), "{stale}");
    assert_eq!(fields(passed), serde_json::json!(["GET", "/doc", "", null, "passed"]));
    assert_eq!((passed.get("status"), passed.get("backend_status")), (None, None), "{passed}");
}
