//! Attacks on pinned writes (`pin = "etag"`, docs/pins.md): ways a correct client could be
//! refused, or a late write applied, that the design's happy path does not show. The backend
//! here is the smallest one that honours `If-Match` and `If-None-Match` on `PUT` and `DELETE`
//! and names a content digest as each file's strong `ETag` (as Apache's `FileETag Digest` does),
//! lets the test write to it directly, around fencegate, and holds a write that carries
//! [`HOLD`] until the test releases it: applied late, after fencegate gave up on it.

use crate::common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

use common::{Harness, Resp};

/// A write carrying this header waits, before its preconditions are judged, until the test
/// calls [`TagBackend::release`], whatever happened to its connection meanwhile.
const HOLD: &str = "x-test-hold";

/// Files by path, whether a `PUT`'s answer names the file's new `ETag`, and the tokens of the
/// writes applied, in the order they were applied.
#[derive(Debug, Default)]
struct Files {
    files: HashMap<String, Bytes>,
    tag_on_put: bool,
    applied: Vec<u64>,
}

/// The held writes' release.
#[derive(Debug, Default)]
struct Release {
    released: std::sync::atomic::AtomicBool,
    notify: Notify,
    /// Held writes judged (applied or refused) since.
    done: std::sync::atomic::AtomicUsize,
}

/// A file's strong entity tag: a digest of its bytes (FNV-1a), so equal bytes give equal tags.
fn tag(body: &[u8]) -> String {
    let hash = body.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    format!("\"{hash:016x}\"")
}

/// The entity tags of a precondition's fields; `*` as itself.
fn listed(headers: &HeaderMap, name: &str) -> Option<Vec<String>> {
    let mut all = Vec::new();
    let mut seen = false;
    for value in headers.get_all(name) {
        seen = true;
        all.extend(value.to_str().unwrap().split(',').map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()));
    }
    seen.then_some(all)
}

/// Whether a write's preconditions hold for `current` (RFC 9110 13.1.1, 13.1.2).
fn holds(headers: &HeaderMap, current: Option<&str>) -> bool {
    if let Some(list) = listed(headers, "if-match")
        && !current.is_some_and(|c| list.iter().any(|t| t == "*" || t == c))
    {
        return false;
    }
    if let Some(list) = listed(headers, "if-none-match")
        && current.is_some_and(|c| list.iter().any(|t| t == "*" || t.trim_start_matches("W/") == c))
    {
        return false;
    }
    true
}

/// The backend: a real HTTP/1.1 server on loopback; stops when dropped.
struct TagBackend {
    addr: SocketAddr,
    files: Arc<Mutex<Files>>,
    release: Arc<Release>,
    task: JoinHandle<()>,
}

impl Drop for TagBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TagBackend {
    async fn start(tag_on_put: bool) -> TagBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let files = Arc::new(Mutex::new(Files { tag_on_put, ..Files::default() }));
        let release = Arc::new(Release::default());
        let (shared, held) = (Arc::clone(&files), Arc::clone(&release));
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let (files, release) = (Arc::clone(&shared), Arc::clone(&held));
                connections.spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let (files, release) = (Arc::clone(&files), Arc::clone(&release));
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                            // A task of its own: a held write is applied even after fencegate
                            // gave up on it and closed the connection.
                            let applied = tokio::spawn(async move {
                                // Writes only: the HEAD that learns the key carries the
                                // client's headers too.
                                let held = parts.headers.contains_key(HOLD) && parts.method != Method::HEAD;
                                if held {
                                    while !release.released.load(std::sync::atomic::Ordering::SeqCst) {
                                        let notified = release.notify.notified();
                                        if release.released.load(std::sync::atomic::Ordering::SeqCst) {
                                            break;
                                        }
                                        notified.await;
                                    }
                                }
                                let resp = answer(&files, parts, body);
                                if held {
                                    release.done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                }
                                resp
                            });
                            Ok::<_, Infallible>(applied.await.unwrap())
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        TagBackend { addr, files, release, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes `path` directly, as a client that bypasses fencegate would.
    fn write_around(&self, path: &str, body: &str) -> String {
        self.files.lock().unwrap().files.insert(path.to_owned(), Bytes::from(body.to_owned()));
        tag(body.as_bytes())
    }

    fn file(&self, path: &str) -> Option<Bytes> {
        self.files.lock().unwrap().files.get(path).cloned()
    }

    /// The tokens of the writes applied, in the order they were applied.
    fn applied(&self) -> Vec<u64> {
        self.files.lock().unwrap().applied.clone()
    }

    /// Held writes judged since their release.
    fn held_done(&self) -> usize {
        self.release.done.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets every held write (and any later one) go on.
    fn release(&self) {
        self.release.released.store(true, std::sync::atomic::Ordering::SeqCst);
        self.release.notify.notify_waiters();
    }
}

fn answer(files: &Mutex<Files>, parts: http::request::Parts, body: Bytes) -> Response<Full<Bytes>> {
    let token: Option<u64> = parts.headers.get("fencing-token").and_then(|t| t.to_str().ok()?.parse().ok());
    let path = parts.uri.path().to_owned();
    let mut files = files.lock().unwrap();
    // Paths under /keyed/ answer only requests that carry the backend's own key header.
    if path.starts_with("/keyed/") && parts.headers.get("x-api-key").is_none_or(|k| k != "s3cret") {
        return Response::builder().status(StatusCode::UNAUTHORIZED).body(Full::new(Bytes::new())).unwrap();
    }
    let current = files.files.get(&path).map(|b| tag(b));
    let reply = |status: StatusCode, etag: Option<&str>| {
        let mut resp = Response::builder().status(status);
        if let Some(etag) = etag {
            resp = resp.header("etag", etag);
        }
        resp.body(Full::new(Bytes::new())).unwrap()
    };
    // As a web framework would: the method an override names is the one run.
    let method = match parts.headers.get("x-http-method-override") {
        Some(claimed) => claimed.to_str().unwrap().to_owned(),
        None => parts.method.as_str().to_owned(),
    };
    match method.as_str() {
        "HEAD" | "GET" => match &current {
            Some(t) => reply(StatusCode::OK, Some(t)),
            None => reply(StatusCode::NOT_FOUND, None),
        },
        "PUT" | "DELETE" if !holds(&parts.headers, current.as_deref()) => reply(StatusCode::PRECONDITION_FAILED, None),
        "PUT" => {
            let new = tag(&body);
            let status = if current.is_some() { StatusCode::NO_CONTENT } else { StatusCode::CREATED };
            files.files.insert(path, body);
            files.applied.extend(token);
            let etag = files.tag_on_put.then_some(new);
            reply(status, etag.as_deref())
        }
        "DELETE" => match files.files.remove(&path) {
            Some(_) => {
                files.applied.extend(token);
                reply(StatusCode::NO_CONTENT, None)
            }
            None => reply(StatusCode::NOT_FOUND, None),
        },
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, None),
    }
}

/// fencegate in front of `backend`, with `toml` (a `[fence]` section) as its fence settings.
async fn proxy(backend: &TagBackend, toml: &str) -> Harness {
    proxy_with(backend, toml, |_| {}).await
}

/// [`proxy`], with `tweak` applied to the config last.
async fn proxy_with(backend: &TagBackend, toml: &str, tweak: impl FnOnce(&mut fencegate::Config)) -> Harness {
    let url = backend.url();
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{url}\"\n[store]\ndir = \"/nonexistent\"\n{toml}"
    );
    let fence = fencegate::Config::from_toml_str(&text).unwrap().fence;
    Harness::start_with(|c| {
        c.backend.url = url.parse().unwrap();
        c.fence = fence;
        tweak(c);
    })
    .await
}

async fn write(h: &Harness, method: &str, path: &str, token: u64, extra: &[(&str, &str)], body: &str) -> Resp {
    let token = token.to_string();
    let mut headers = vec![("fencing-token", token.as_str())];
    headers.extend_from_slice(extra);
    h.send(method, path, &headers, body.to_owned()).await
}

const PINNED: &str = "[fence]\n[[fence.rules]]\nprefix = \"/\"\npin = \"etag\"\n";

#[tokio::test]
async fn a_scope_key_over_many_files_never_pins_one_file_to_anothers_state() {
    // One key, /b/b1, for every file under it: a pin kept per key would send a write to one
    // file with the precondition another file's answer gave.
    let backend = TagBackend::start(true).await;
    let h = proxy(&backend, &format!("{PINNED}[[fence.scopes]]\nprefix = \"/b/\"\nsegments = 2\n")).await;
    assert_eq!(write(&h, "PUT", "/b/b1/one", 5, &[], "one").await.status, 201);
    let resp = write(&h, "PUT", "/b/b1/two", 6, &[], "two").await;
    assert_eq!(resp.status, 201, "a correct write to another file is applied: {:?}", resp.body);
    assert_eq!(backend.file("/b/b1/two").as_deref(), Some(&b"two"[..]));
    // And a pinned DELETE of one file leaves no "absent" that a write to another is sent with.
    let toml = "[fence]\nsubtree_methods = []\n[[fence.rules]]\nprefix = \"/\"\npin = \"etag\"\n";
    let h = proxy(&backend, &format!("{toml}[[fence.scopes]]\nprefix = \"/b/\"\nsegments = 2\n")).await;
    assert_eq!(write(&h, "DELETE", "/b/b1/one", 7, &[], "").await.status, 204);
    let resp = write(&h, "PUT", "/b/b1/two", 8, &[], "two, again").await;
    assert_eq!(resp.status, 204, "a correct write to an existing file is applied: {:?}", resp.body);
}

#[tokio::test]
async fn a_clients_own_if_match_is_judged_against_the_backend_when_the_pin_disagrees() {
    // The pin is out of date (a write around fencegate; or, in a cluster, a leader's late
    // answer setting it after another leader wrote). A client whose If-Match names the
    // backend's real state must be served, not told 412 on every retry without fencegate
    // ever looking again.
    let backend = TagBackend::start(true).await;
    let h = proxy(&backend, PINNED).await;
    assert_eq!(write(&h, "PUT", "/k", 5, &[], "fenced").await.status, 201);
    let current = backend.write_around("/k", "around");
    let resp = write(&h, "PUT", "/k", 6, &[("if-match", &current)], "mine").await;
    assert_eq!(resp.status, 204, "the client's If-Match holds at the backend: {:?}", resp.body);
    assert_eq!(backend.file("/k").as_deref(), Some(&b"mine"[..]));
    // One that does not hold is still refused by fencegate, with nothing sent.
    let resp = write(&h, "PUT", "/k", 7, &[("if-match", &current)], "stale").await;
    resp.assert_refused(412, "precondition_failed");
    assert_eq!(backend.file("/k").as_deref(), Some(&b"mine"[..]));
}

/// fencegate in front of `backend` that gives up on a write after 300 ms and then closes its
/// key for a minute.
async fn impatient(backend: &TagBackend) -> Harness {
    impatient_with(backend, PINNED).await
}

/// [`impatient`], with `toml` as its fence settings.
async fn impatient_with(backend: &TagBackend, toml: &str) -> Harness {
    proxy_with(backend, toml, |c| {
        c.backend.request_timeout = Duration::from_millis(300);
        c.fence.quarantine = Duration::from_secs(60);
    })
    .await
}

#[tokio::test]
async fn a_late_write_never_applies_after_a_write_that_passed_its_quarantine_and_kept_its_tag() {
    // A digest ETag comes back with the same bytes. The late write was sent with If-Match
    // naming the file's tag; a newer holder rewriting the same bytes, let through the
    // quarantine, leaves the file with that tag again, so the late write then applies after it.
    let backend = TagBackend::start(true).await;
    let h = impatient(&backend).await;
    assert_eq!(write(&h, "PUT", "/k", 5, &[], "A").await.status, 201);
    write(&h, "PUT", "/k", 6, &[(HOLD, "1")], "B").await.assert_refused(504, "backend_timeout");
    let newer = write(&h, "PUT", "/k", 7, &[], "A").await;
    backend.release();
    common::poll_until("the late write is applied or refused", || backend.held_done() == 1).await;
    assert_eq!(backend.applied(), [5, 6], "applied in token order, and 7 was not (answered {})", newer.status);
    newer.assert_refused(503, "resource_quarantined");
}

#[tokio::test]
async fn a_late_write_that_landed_lets_the_next_pinned_write_through_its_quarantine() {
    // The common unknown outcome: the write was applied, its answer lost. The next write's
    // HEAD finds the file moved off the tag the late write was pinned to, so it need not wait.
    let backend = TagBackend::start(true).await;
    let h = impatient(&backend).await;
    assert_eq!(write(&h, "PUT", "/k", 5, &[], "A").await.status, 201);
    write(&h, "PUT", "/k", 6, &[(HOLD, "1")], "B").await.assert_refused(504, "backend_timeout");
    backend.release();
    common::poll_until("the late write is applied", || backend.held_done() == 1).await;
    assert_eq!(write(&h, "PUT", "/k", 7, &[], "A").await.status, 204, "passes the quarantine");
    assert_eq!(backend.applied(), [5, 6, 7]);
    let delete = write(&h, "DELETE", "/k", 8, &[], "").await;
    delete.assert_refused(503, "resource_quarantined");
}

#[tokio::test]
async fn a_put_a_backend_runs_as_a_delete_never_passes_a_late_creates_quarantine() {
    // A late create (If-None-Match: *) applies whenever the key is absent again, so only
    // writes that leave the key in place may pass its quarantine. A PUT that claims DELETE
    // in an override is a DELETE to a backend that honours overrides (here one whose paths
    // are independent files, so a DELETE covers no subtree).
    let backend = TagBackend::start(true).await;
    let h =
        impatient_with(&backend, "[fence]\nsubtree_methods = []\n[[fence.rules]]\nprefix = \"/\"\npin = \"etag\"\n")
            .await;
    write(&h, "PUT", "/k", 5, &[(HOLD, "1")], "late").await.assert_refused(504, "backend_timeout");
    assert_eq!(write(&h, "PUT", "/k", 6, &[], "C").await.status, 201, "a create passes: the late one fails");
    let delete = write(&h, "PUT", "/k", 7, &[("x-http-method-override", "DELETE")], "").await;
    backend.release();
    common::poll_until("the late write is applied or refused", || backend.held_done() == 1).await;
    assert_eq!(backend.applied(), [6], "the late create never lands (the DELETE answered {})", delete.status);
    delete.assert_refused(503, "resource_quarantined");
}

#[tokio::test]
async fn the_learning_head_is_authenticated_as_the_clients_write_is() {
    // A backend that authenticates by a header of its own answers the HEAD that learns the key
    // as it answers the client: a HEAD without that header got 401, and every write 503.
    let backend = TagBackend::start(false).await;
    let h = proxy_with(&backend, PINNED, |_| {}).await;
    let key = [("x-api-key", "s3cret")];
    assert_eq!(write(&h, "PUT", "/keyed/a", 1, &key, "one").await.status, 201, "learnt absent, created");
    assert_eq!(write(&h, "PUT", "/keyed/a", 2, &key, "two").await.status, 204, "learnt its tag, replaced");
    assert_eq!(backend.applied(), [1, 2]);
    write(&h, "PUT", "/keyed/a", 3, &[], "three").await.assert_refused(503, "pin_unavailable");
}
