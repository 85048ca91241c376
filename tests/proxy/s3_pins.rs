//! Pinned writes in S3 mode (docs/s3.md#pins) against moto and s3s-fs, both of which check
//! SigV4 signatures: boto3 writes through fencegate and around it (`tests/common/s3/pins.py`),
//! and a tap between fencegate and the server shows which precondition each write carried, the
//! `HEAD`s fencegate signed, and what the server answered them.

use std::net::SocketAddr;

use fencegate::config::ServerMode;
use serde_json::Value;

use crate::common::envoy::{Envoy, EnvoyOptions};
use crate::common::s3::tap::Tap;
use crate::common::s3::{S3Proxy, S3Server, python, start_moto, start_s3s, succeeded};

/// fencegate in front of `server` through a tap, pins on (S3 mode's default), with `extra`
/// TOML under `[s3]`, and the server's key as `[s3.credentials]` when `signed`.
async fn pinned_proxy(server: &S3Server, signed: bool, extra: &str, secrets: &tempfile::TempDir) -> (S3Proxy, Tap) {
    let (proxy, tap, _) = pinned_as(server, signed, extra, secrets, ServerMode::Proxy).await;
    (proxy, tap)
}

/// [`pinned_proxy`] serving `mode`: with `ServerMode::ExtProc`, as the external processor of an
/// Envoy in front of the tap, which is returned with it (`None` where Envoy is missing).
async fn pinned_as(
    server: &S3Server,
    signed: bool,
    extra: &str,
    secrets: &tempfile::TempDir,
    mode: ServerMode,
) -> (S3Proxy, Tap, Option<Envoy>) {
    let addr: SocketAddr = server.url.trim_start_matches("http://").parse().unwrap();
    let tap = Tap::start(addr).await;
    // s3s-fs stores objects as files (tests/proxy/s3.rs).
    let mut config = format!("[s3]\nflat_keys = {}\n{extra}", server.kind != "s3s");
    if signed {
        let file = secrets.path().join("s3-secret");
        std::fs::write(&file, format!("{}\n", server.secret)).unwrap();
        config.push_str(&format!(
            "[s3.credentials]\naccess_key_id = \"{}\"\nsecret_access_key_file = {:?}\n",
            server.access_key,
            file.display().to_string()
        ));
    }
    let proxy = S3Proxy::start_as(&tap.url(), &config, mode).await;
    let envoy = match mode {
        ServerMode::ExtProc => Envoy::start(proxy.addr, tap.addr, &EnvoyOptions::default()).await,
        ServerMode::Proxy => None,
    };
    (proxy, tap, envoy)
}

/// Runs the scenario `name` of pins.py through `proxy` and returns the tags it printed.
async fn scenario(name: &str, server: &S3Server, proxy: &S3Proxy) -> Value {
    scenario_at(name, server, &proxy.url()).await
}

/// Runs the scenario `name` of pins.py with its writes sent to `url`.
async fn scenario_at(name: &str, server: &S3Server, url: &str) -> Value {
    let args = [name, server.kind, url, &server.url, &server.access_key, &server.secret].map(str::to_owned);
    let out = succeeded(name, server, &python("pins.py", args.to_vec()).await);
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{name} printed {out:?}: {e}"))
}

fn tag<'a>(tags: &'a Value, name: &str) -> &'a str {
    tags[name].as_str().unwrap_or_else(|| panic!("no {name} in {tags}"))
}

/// The head of the request whose body holds `marker`, in lower case: what the server
/// received of the write that sent it.
fn head_of(tap: &Tap, marker: &str) -> String {
    for sent in tap.sent() {
        let text = String::from_utf8_lossy(&sent).into_owned();
        let Some(at) = text.find(marker) else { continue };
        let end = text[..at].rfind("\r\n\r\n").unwrap();
        let start = text[..end].rfind("PUT /").unwrap();
        return text[start..end].to_ascii_lowercase();
    }
    panic!("the server never received {marker:?}")
}

/// What the server answered the request whose answer names `etag`, from its status line to the
/// tag, in lower case; `None` if no answer it gave through fencegate names it.
fn answer_naming(tap: &Tap, etag: &str) -> Option<String> {
    let answers = tap.answers().to_ascii_lowercase();
    let at = answers.find(&format!("etag: {}", etag.to_ascii_lowercase()))?;
    let start = answers[..at].rfind("http/1.1 ")?;
    Some(answers[start..at].to_owned())
}

/// The heads of the requests of `method` to `path` the server received, in lower case.
fn heads(tap: &Tap, method: &str, path: &str) -> Vec<String> {
    let text = tap.text();
    let line = format!("{method} {path} HTTP/1.1\r\n");
    let starts = text.match_indices(&line).map(|(at, _)| at);
    starts.map(|at| text[at..at + text[at..].find("\r\n\r\n").unwrap()].to_ascii_lowercase()).collect()
}

/// Requests of `method` to `path` the server received.
fn requests(tap: &Tap, method: &str, path: &str) -> usize {
    tap.text().matches(&format!("{method} {path} HTTP/1.1\r\n")).count()
}

/// Asserts that the write whose body holds `marker` carried `precondition`, unsigned: the
/// client's SigV4 `SignedHeaders` do not name it, and the server took the signature.
fn carried(tap: &Tap, marker: &str, precondition: &str, kind: &str) {
    let head = head_of(tap, marker);
    assert!(head.contains(&format!("\r\n{precondition}\r\n")), "{kind}: {marker} lacks {precondition:?}:\n{head}");
    let signed = head.split("signedheaders=").nth(1).and_then(|s| s.split(',').next()).unwrap_or_default();
    assert!(!signed.is_empty(), "{kind}: {marker} was not signed with SigV4:\n{head}");
    assert!(!signed.contains("if-match") && !signed.contains("if-none-match"), "{kind}: signed {signed}");
}

/// Where the scenarios' clients send in `mode`: fencegate's own address, or Envoy's; `None`
/// when Envoy is missing (skipped).
fn front(proxy: &S3Proxy, envoy: Option<&Envoy>, mode: ServerMode) -> Option<String> {
    match mode {
        ServerMode::Proxy => Some(proxy.url()),
        ServerMode::ExtProc => envoy.map(|e| format!("http://{}", e.addr)),
    }
}

async fn preconditions_against(server: Option<S3Server>, mode: ServerMode) {
    let Some(server) = server else { return };
    let secrets = tempfile::tempdir().unwrap();
    let (proxy, tap, envoy) = pinned_as(&server, true, "", &secrets, mode).await;
    let Some(url) = front(&proxy, envoy.as_ref(), mode) else { return };
    let tags = scenario_at("preconditions", &server, &url).await;
    let kind = server.kind;
    // (a) The first write learnt the object absent by a signed HEAD, which the server answered
    // 404 (a refused signature would have been 403, and the write refused 503), and was sent
    // with If-None-Match: *; the second with If-Match naming the first's tag. Both landed: the
    // server took the client's signature with the headers fencegate added.
    assert!(requests(&tap, "HEAD", "/pins/k") >= 1, "{kind}: no HEAD learnt the new object");
    carried(&tap, "first-body", "if-none-match: *", kind);
    carried(&tap, "second-body", &format!("if-match: {}", tag(&tags, "first")), kind);
    // (c) The client's own signed If-None-Match: * on the existing object never reached the
    // server: fencegate knew the object exists.
    assert!(!tap.text().contains("own-precondition-body"), "{kind}: the client's own precondition reached the server");
    // (b) The write after one around fencegate was pinned to the tag fencegate last saw, and
    // the server refused it (perhaps before its body: found by its head); the one after it
    // learnt the new state by a HEAD and landed.
    let second = format!("\r\nif-match: {}\r\n", tag(&tags, "second").to_ascii_lowercase());
    let pinned_to_second = heads(&tap, "PUT", "/pins/k").into_iter().filter(|h| h.contains(&second)).count();
    assert_eq!(pinned_to_second, 1, "{kind}: the write after the one around fencegate");
    let moved = answer_naming(&tap, tag(&tags, "around")).unwrap_or_default();
    assert!(moved.starts_with("http/1.1 200"), "{kind}: the HEAD after BackendMoved was answered {moved:?}");
    carried(&tap, "after-body", &format!("if-match: {}", tag(&tags, "around")), kind);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_puts_carry_unsigned_preconditions_and_a_write_around_fencegate_is_backend_moved() {
    preconditions_against(start_moto().await, ServerMode::Proxy).await;
    preconditions_against(start_s3s().await, ServerMode::Proxy).await;
}

/// The same through Envoy, fencegate its external processor (docs/envoy.md): the `HEAD` goes
/// from fencegate to `backend.url`, the precondition is set on the head Envoy lets go, and the
/// server's `412` to it becomes fencegate's `BackendMoved` in place of the server's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_pinned_puts_carry_unsigned_preconditions_and_a_write_around_is_backend_moved() {
    preconditions_against(start_moto().await, ServerMode::ExtProc).await;
    preconditions_against(start_s3s().await, ServerMode::ExtProc).await;
}

async fn restart_against(server: Option<S3Server>) {
    let Some(server) = server else { return };
    let secrets = tempfile::tempdir().unwrap();
    let (mut proxy, tap) = pinned_proxy(&server, true, "", &secrets).await;
    let before = scenario("before_restart", &server, &proxy).await;
    proxy.restart().await;
    let heads_before = requests(&tap, "HEAD", "/pins/r");
    scenario("after_restart", &server, &proxy).await;
    let kind = server.kind;
    // The pin fencegate had before the restart (the write through it) is gone: a HEAD signed
    // with [s3.credentials] learnt the object as the write around fencegate left it, and the
    // server answered it 200 with that write's tag, not 403.
    assert_eq!(requests(&tap, "HEAD", "/pins/r"), heads_before + 1, "{kind}: one HEAD after the restart");
    let around = tag(&before, "around");
    let answer = answer_naming(&tap, around).unwrap_or_else(|| panic!("{kind}: no answer named {around}"));
    assert!(answer.starts_with("http/1.1 200"), "{kind}: the HEAD was answered {answer:?}");
    carried(&tap, "after-restart-body", &format!("if-match: {around}"), kind);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_a_signed_head_learns_the_pin() {
    restart_against(start_moto().await).await;
    restart_against(start_s3s().await).await;
}

async fn completion_against(server: Option<S3Server>, mode: ServerMode) {
    let Some(server) = server else { return };
    let secrets = tempfile::tempdir().unwrap();
    let (proxy, tap, envoy) = pinned_as(&server, true, "", &secrets, mode).await;
    let Some(url) = front(&proxy, envoy.as_ref(), mode) else { return };
    let tags = scenario_at("completion", &server, &url).await;
    let kind = server.kind;
    // The completion learnt the new object absent (its one HEAD) and went pinned; its answer's
    // body named the object's tag, which the next write was pinned to without asking again.
    assert_eq!(requests(&tap, "HEAD", "/pins/m"), 1, "{kind}: HEADs of the object");
    let completion = tap.text().to_ascii_lowercase();
    let at = completion.find("post /pins/m?uploadid=").unwrap();
    let head = &completion[at..at + completion[at..].find("\r\n\r\n").unwrap()];
    assert!(head.contains("\r\nif-none-match: *"), "{kind}: the completion went unpinned:\n{head}");
    carried(&tap, "after-completion-body", &format!("if-match: {}", tag(&tags, "completed")), kind);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_is_pinned_and_the_tag_in_its_body_pins_the_next_write() {
    completion_against(start_moto().await, ServerMode::Proxy).await;
    completion_against(start_s3s().await, ServerMode::Proxy).await;
}

/// The same through Envoy: the completion's tag is read in the answer body fencegate asks
/// Envoy for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_a_completion_is_pinned_and_its_tag_pins_the_next_write() {
    completion_against(start_s3s().await, ServerMode::ExtProc).await;
}

/// moto honours If-Match on DeleteObject (s3s-fs deletes all the same, so it is not pinned
/// there: `s3.conditional_deletes` is off by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_conditional_deletes_a_delete_after_a_write_around_fencegate_is_backend_moved() {
    let Some(server) = start_moto().await else { return };
    let secrets = tempfile::tempdir().unwrap();
    let (proxy, tap) = pinned_proxy(&server, true, "conditional_deletes = true\n", &secrets).await;
    let tags = scenario("deletes", &server, &proxy).await;
    let deletes: Vec<String> = tap
        .text()
        .to_ascii_lowercase()
        .split("delete /pins/d http/1.1\r\n")
        .skip(1)
        .map(|rest| rest[..rest.find("\r\n\r\n").unwrap()].to_owned())
        .collect();
    assert_eq!(deletes.len(), 3, "{deletes:?}");
    let first = format!("if-match: {}", tag(&tags, "first").to_ascii_lowercase());
    assert!(deletes[0].contains(&first), "the first delete was not pinned:\n{}", deletes[0]);
    assert!(!deletes[1].contains("if-"), "a delete of an object last seen absent carried:\n{}", deletes[1]);
    let second = format!("if-match: {}", tag(&tags, "second").to_ascii_lowercase());
    assert!(deletes[2].contains(&second), "the last delete was not pinned:\n{}", deletes[2]);
}

/// A completion whose answer body names a tag no header can carry (a line feed, once the XML
/// is decoded) pins nothing: kept, it would refuse every later write to the object
/// (`pin_unavailable`) until a restart. As the proxy and through Envoy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_tag_no_header_can_carry_pins_nothing() {
    use crate::common::backend::{Reply, StubBackend};
    use crate::common::raw_request;
    const CREATED: &str = "<InitiateMultipartUploadResult><Bucket>bk1</Bucket><Key>k</Key><UploadId>u1</UploadId></InitiateMultipartUploadResult>";
    const COMPLETED: &str = "<CompleteMultipartUploadResult><Bucket>bk1</Bucket><Key>k</Key>\
        <ETag>\"caf&#10;e-1\"</ETag></CompleteMultipartUploadResult>";
    for mode in [ServerMode::Proxy, ServerMode::ExtProc] {
        let stub = StubBackend::start_with(|seen| match seen.head.split(' ').nth(1) {
            Some("/bk1/k?uploads") => Reply::Answer(200, CREATED),
            Some("/bk1/k?uploadId=u1") => Reply::Answer(200, COMPLETED),
            _ => Reply::Answer(200, ""),
        })
        .await;
        let proxy = S3Proxy::start_as(&stub.url(), "", mode).await;
        let envoy = match mode {
            ServerMode::ExtProc => match Envoy::start(proxy.addr, stub.addr(), &EnvoyOptions::default()).await {
                Some(envoy) => Some(envoy),
                None => return,
            },
            ServerMode::Proxy => None,
        };
        let front = envoy.as_ref().map_or(proxy.addr, |e| e.addr);
        let send = async |line: &str, token: u64| {
            raw_request(front, &format!("{line}\r\nHost: 127.0.0.1\r\nFencing-Token: {token}"), "").await
        };
        assert_eq!(send("POST /bk1/k?uploads HTTP/1.1", 41).await.status, 200, "{mode:?}");
        assert_eq!(send("POST /bk1/k?uploadId=u1 HTTP/1.1", 41).await.status, 200, "{mode:?}");
        for token in [42, 43] {
            let r = send("PUT /bk1/k HTTP/1.1", token).await;
            assert_eq!(r.status, 200, "{mode:?}: the write after the completion: {r:?}");
        }
    }
}

/// The client's own signed `If-Match`, against moto, which checks SigV4: one naming exactly the
/// pinned tag reaches the server as signed; `If-Match: *`, which fencegate would have to narrow
/// and so break the signature, is refused by fencegate with a reason (`InvalidRequest`), never
/// sent to fail as `SignatureDoesNotMatch`. As the proxy and through Envoy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_loose_if_match_is_refused_with_a_reason_not_rewritten() {
    for mode in [ServerMode::Proxy, ServerMode::ExtProc] {
        let Some(server) = start_moto().await else { return };
        let secrets = tempfile::tempdir().unwrap();
        let (proxy, tap, envoy) = pinned_as(&server, true, "", &secrets, mode).await;
        let Some(url) = front(&proxy, envoy.as_ref(), mode) else { return };
        scenario_at("signed_conditions", &server, &url).await;
        assert!(!tap.text().contains("loose-body"), "{mode:?}: the loose write reached the server");
    }
}
