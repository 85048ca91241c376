//! A dumb in-memory HTTP object store: the backend of the demo and of the integration tests.
//!
//! It does what a naive blob store does (no fencing at all) and records every write in the
//! order it applied them, so tests can check what fencegate let through and in which order.
//! A request header `x-memstore-delay-ms: N` makes it wait N ms after reading the body and
//! before applying the write, to simulate a slow backend. Like many stores, it tags each
//! object with a strong `ETag` (a version: it never comes back) on reads and on the answer to
//! a write, and honours `If-Match` and `If-None-Match` on writes, evaluated when the write is
//! applied: a write whose precondition fails gets `412` and is not applied. Not for production
//! use.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Request header that delays applying a request, in milliseconds.
pub const DELAY_HEADER: &str = "x-memstore-delay-ms";

/// One request as the backend received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// Method as sent.
    pub method: Method,
    /// Path as sent (what fencegate forwarded).
    pub path: String,
    /// Query string, if any.
    pub query: Option<String>,
    /// All request headers.
    pub headers: HeaderMap,
    /// The body.
    pub body: Bytes,
    /// When it was received whole; among [`MemBackend::applied`], when it was applied.
    pub at: std::time::Instant,
}

impl Received {
    /// The value of the `fencing-token` header parsed as a number, when there is one.
    pub fn token(&self) -> Option<u64> {
        self.headers.get("fencing-token")?.to_str().ok()?.parse().ok()
    }
}

#[derive(Debug, Default)]
struct State {
    /// Each object with the version its `ETag` names.
    objects: HashMap<String, (Bytes, u64)>,
    /// The last version given out.
    version: u64,
    requests: Vec<Received>,
    applied: Vec<Received>,
}

/// A running in-memory store on a port of its own (loopback unless `start_on` says otherwise);
/// stops when dropped.
#[derive(Debug)]
pub struct MemBackend {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: watch::Sender<bool>,
}

impl MemBackend {
    /// Binds `127.0.0.1:0` and starts serving plain HTTP.
    pub async fn start() -> std::io::Result<MemBackend> {
        MemBackend::start_with(None).await
    }

    /// Binds `addr` and starts serving plain HTTP: an address other than loopback, for a backend
    /// that clients in other network namespaces reach.
    pub async fn start_on(addr: SocketAddr) -> std::io::Result<MemBackend> {
        MemBackend::serve_on(TcpListener::bind(addr).await?, None)
    }

    /// Binds `127.0.0.1:0` and starts serving HTTPS with `tls`.
    pub async fn start_tls(tls: Arc<rustls::ServerConfig>) -> std::io::Result<MemBackend> {
        MemBackend::start_with(Some(tokio_rustls::TlsAcceptor::from(tls))).await
    }

    async fn start_with(acceptor: Option<tokio_rustls::TlsAcceptor>) -> std::io::Result<MemBackend> {
        MemBackend::serve_on(TcpListener::bind("127.0.0.1:0").await?, acceptor)
    }

    fn serve_on(listener: TcpListener, acceptor: Option<tokio_rustls::TlsAcceptor>) -> std::io::Result<MemBackend> {
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, mut stopped) = watch::channel(false);
        let shared = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = stopped.changed() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(_) => continue,
                    },
                };
                let state = Arc::clone(&shared);
                let mut stopped = stopped.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| serve(Arc::clone(&state), req));
                    let mut builder = auto::Builder::new(TokioExecutor::new());
                    // A request that arrived whole is applied even if the client's FIN came
                    // right behind it, as nginx and Apache do.
                    builder.http1().half_close(true);
                    match acceptor {
                        Some(acceptor) => {
                            let Ok(tls) = acceptor.accept(stream).await else { return };
                            let conn = builder.serve_connection(TokioIo::new(tls), service);
                            tokio::select! {
                                _ = conn => {}
                                _ = stopped.changed() => {}
                            }
                        }
                        None => {
                            let conn = builder.serve_connection(TokioIo::new(stream), service);
                            tokio::select! {
                                _ = conn => {}
                                _ = stopped.changed() => {}
                            }
                        }
                    }
                });
            }
        });
        Ok(MemBackend { addr, state, stop })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, for a fencegate config.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Every request received, reads included, in arrival order (recorded on arrival, before
    /// any delay).
    pub fn requests(&self) -> Vec<Received> {
        self.lock().requests.clone()
    }

    /// Writes (PUT, POST, PATCH, DELETE) in the order they were applied.
    pub fn applied(&self) -> Vec<Received> {
        self.lock().applied.clone()
    }

    /// Every request received since the last take, in arrival order, and forgets them and
    /// the applied order: for runs too long to keep a record of everything.
    pub fn take_requests(&self) -> Vec<Received> {
        let mut state = self.lock();
        state.applied.clear();
        std::mem::take(&mut state.requests)
    }

    /// The stored object at `path`.
    pub fn object(&self, path: &str) -> Option<Bytes> {
        self.lock().objects.get(path).map(|(body, _)| body.clone())
    }

    /// All stored objects, sorted by path.
    pub fn objects(&self) -> Vec<(String, Bytes)> {
        let mut all: Vec<_> = self.lock().objects.iter().map(|(k, (v, _))| (k.clone(), v.clone())).collect();
        all.sort();
        all
    }
}

impl Drop for MemBackend {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn serve(state: Arc<Mutex<State>>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, "body read failed")),
    };
    let delay = parts.headers.get(DELAY_HEADER).and_then(|v| v.to_str().ok()?.parse().ok());
    let received = Received {
        method: parts.method,
        path: parts.uri.path().to_owned(),
        query: parts.uri.query().map(str::to_owned),
        headers: parts.headers,
        body,
        at: std::time::Instant::now(),
    };
    lock(&state).requests.push(received.clone());
    // Like a real server, finish applying a request even if the caller hangs up meanwhile.
    let applying = tokio::spawn(async move {
        if let Some(ms) = delay {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        apply(&mut lock(&state), received)
    });
    Ok(applying.await.unwrap_or_else(|_| reply(StatusCode::INTERNAL_SERVER_ERROR, "apply failed")))
}

fn apply(s: &mut State, mut received: Received) -> Response<Full<Bytes>> {
    received.at = std::time::Instant::now();
    let path = received.path.clone();
    let current = s.objects.get(&path).map(|(_, version)| etag(*version));
    let write = !matches!(received.method, Method::GET | Method::HEAD);
    if write && !preconditions_hold(&received.headers, current.as_deref()) {
        return reply(StatusCode::PRECONDITION_FAILED, "precondition failed");
    }
    let mut resp = match received.method {
        Method::GET | Method::HEAD => match s.objects.get(&path) {
            Some((obj, _)) => Response::new(Full::new(obj.clone())),
            None => return reply(StatusCode::NOT_FOUND, "not found"),
        },
        Method::PUT | Method::POST => {
            s.version += 1;
            s.objects.insert(path.clone(), (received.body.clone(), s.version));
            s.applied.push(received);
            reply(StatusCode::OK, "stored")
        }
        Method::PATCH => {
            let mut joined = s.objects.get(&path).map(|(b, _)| b.to_vec()).unwrap_or_default();
            joined.extend_from_slice(&received.body);
            s.version += 1;
            s.objects.insert(path.clone(), (joined.into(), s.version));
            s.applied.push(received);
            reply(StatusCode::OK, "appended")
        }
        Method::DELETE => {
            let existed = s.objects.remove(&path).is_some();
            s.applied.push(received);
            return if existed { reply(StatusCode::NO_CONTENT, "") } else { reply(StatusCode::NOT_FOUND, "not found") };
        }
        _ => return reply(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
    };
    if let Some((_, version)) = s.objects.get(&path)
        && let Ok(value) = http::HeaderValue::from_str(&etag(*version))
    {
        resp.headers_mut().insert(http::header::ETAG, value);
    }
    resp
}

/// The strong entity tag of `version`.
fn etag(version: u64) -> String {
    format!("\"v{version}\"")
}

/// Whether a write's `If-Match` and `If-None-Match` hold for the object's `current` tag
/// (`None`: there is no object): strong comparison for `If-Match`, weak for `If-None-Match`.
fn preconditions_hold(headers: &HeaderMap, current: Option<&str>) -> bool {
    let listed = |name| {
        let values: Vec<&str> = headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).collect();
        (!values.is_empty())
            .then(|| values.iter().flat_map(|v| v.split(',')).map(str::trim).map(str::to_owned).collect::<Vec<_>>())
    };
    if let Some(tags) = listed(http::header::IF_MATCH) {
        let holds = current.is_some_and(|c| tags.iter().any(|t| t == "*" || t == c));
        if !holds {
            return false;
        }
    }
    if let Some(tags) = listed(http::header::IF_NONE_MATCH) {
        let weak = |t: &str| t.trim_start_matches("W/").to_owned();
        let matched = current.is_some_and(|c| tags.iter().any(|t| t == "*" || weak(t) == weak(c)));
        if matched {
            return false;
        }
    }
    true
}

fn reply(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *resp.status_mut() = status;
    resp
}
