//! A recording WebDAV stub: a real HTTP/1.1 server on loopback that keeps files in memory
//! with nginx-like WebDAV semantics and records, for every request, which files it changed
//! and which other writes were at the backend at the same time.
//!
//! Files are a flat map from path to content; collections are implicit, so `/a` and `/a/x` may
//! both be files (nginx would refuse that, but it changes nothing about which files a write
//! touches). What a write may touch is computed from the request alone ([`regions`]), not from
//! fencegate's keys, so the record can be checked against WebDAV's meaning of each method:
//!
//! - `PUT /p` creates or replaces the file `/p` (parents are implicit);
//! - `DELETE /p` or `/p/` removes `/p` and every file below `/p/` (the subtree at `/p`);
//! - `MOVE /s` to `/d` removes the subtree at `/s` and replaces the subtree at `/d` with it;
//! - `COPY /s` to `/d` replaces the subtree at `/d` with a copy of the subtree at `/s`.
//!
//! Each write is marked in flight for a short hold (0–3 ms) before it is applied. A write that
//! arrives while an in-flight write's regions overlap its own is recorded as a [`Violation`]:
//! fencegate promises that never happens.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

/// The header the test tags each operation with, so a record can be matched to its answer.
pub const OP_HEADER: &str = "x-model-op";

/// Part of the tree a write may change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Region {
    /// One path, exactly as sent.
    Path(String),
    /// The subtree at a path: the path itself, `path/`, and everything below `path/`. Held
    /// without a trailing slash (`/p/` and `/p` have the same subtree).
    Subtree(String),
}

impl Region {
    fn subtree(path: &str) -> Region {
        Region::Subtree(path.trim_end_matches('/').to_owned())
    }

    /// Whether `path` lies in this region.
    pub fn contains(&self, path: &str) -> bool {
        match self {
            Region::Path(p) => p == path,
            Region::Subtree(root) => in_subtree(root, path),
        }
    }

    /// Whether the two regions share a path: one is at or below the other.
    pub fn overlaps(&self, other: &Region) -> bool {
        match (self, other) {
            (Region::Path(a), b) | (b, Region::Path(a)) => b.contains(a),
            (Region::Subtree(a), Region::Subtree(b)) => in_subtree(a, b) || in_subtree(b, a),
        }
    }
}

/// Whether `path` is `root`, or below it (`root/` included); `root` has no trailing slash.
fn in_subtree(root: &str, path: &str) -> bool {
    path.strip_prefix(root).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The path a `Destination` names: an absolute path, or the path of an `http(s)://` URI.
pub fn destination_path(value: &str) -> String {
    let rest = value.strip_prefix("http://").or_else(|| value.strip_prefix("https://"));
    match rest {
        Some(rest) => rest.find('/').map_or("/", |i| &rest[i..]).to_owned(),
        None => value.to_owned(),
    }
}

/// What a request may change, from the request alone (WebDAV's meaning, not fencegate's keys):
/// PUT its path; DELETE the subtree at its path; MOVE the subtrees at its path and at its
/// Destination; COPY the subtree at its Destination. Reads change nothing.
pub fn regions(method: &str, path: &str, destination: Option<&str>) -> Vec<Region> {
    let dest = destination.map(|d| Region::subtree(&destination_path(d)));
    match method {
        "GET" | "HEAD" | "OPTIONS" | "PROPFIND" => Vec::new(),
        "DELETE" => vec![Region::subtree(path)],
        "MOVE" => std::iter::once(Region::subtree(path)).chain(dest).collect(),
        "COPY" => dest.into_iter().collect(),
        _ => vec![Region::Path(path.to_owned())],
    }
}

/// One request as the stub received and answered it.
#[derive(Debug, Clone)]
pub struct Record {
    pub method: String,
    pub path: String,
    /// The `Destination` header, as received.
    pub destination: Option<String>,
    /// The `fencing-token` header, as received.
    pub token: Option<String>,
    /// The [`OP_HEADER`] value, as received.
    pub op: Option<String>,
    /// What the stub answered.
    pub status: u16,
    /// Files created, replaced or removed.
    pub changed: BTreeSet<String>,
    /// Sequence number when it was marked in flight; every start and end draws from one counter.
    pub start: u64,
    /// Sequence number when it was applied and left flight.
    pub end: u64,
}

impl Record {
    pub fn token(&self) -> Option<u64> {
        self.token.as_deref()?.parse().ok()
    }

    pub fn regions(&self) -> Vec<Region> {
        regions(&self.method, &self.path, self.destination.as_deref())
    }

    /// `METHOD /path -> /dest (op N, token T)`, for messages.
    pub fn describe(&self) -> String {
        let dest = self.destination.as_deref().map(|d| format!(" -> {d}")).unwrap_or_default();
        let op = self.op.as_deref().unwrap_or("-");
        let token = self.token.as_deref().unwrap_or("-");
        format!("{} {}{dest} (op {op}, token {token})", self.method, self.path)
    }
}

/// Two writes with overlapping regions at the backend at once.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The write that arrived.
    pub arriving: String,
    /// The write that was still in flight.
    pub in_flight: String,
}

#[derive(Debug)]
struct InFlight {
    id: u64,
    regions: Vec<Region>,
    describe: String,
}

#[derive(Debug, Default)]
struct State {
    files: BTreeMap<String, Bytes>,
    seq: u64,
    in_flight: Vec<InFlight>,
    records: Vec<Record>,
    violations: Vec<Violation>,
    /// Requests whose head has arrived and that are not yet applied and recorded.
    busy: usize,
}

/// Counts a request in [`State::busy`] from its head's arrival until it is dropped: once it is
/// applied, or when its body never arrives whole.
struct Busy(Arc<Mutex<State>>);

impl Busy {
    fn new(state: &Arc<Mutex<State>>) -> Busy {
        lock(state).busy += 1;
        Busy(Arc::clone(state))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        lock(&self.0).busy -= 1;
    }
}

/// The stub on a loopback port; stops accepting (and drops its connections) when dropped.
pub struct WebDavStub {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl WebDavStub {
    pub async fn start() -> WebDavStub {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            // Aborted with the accept loop, when the stub is dropped.
            let mut connections = JoinSet::new();
            while let Ok((sock, _)) = listener.accept().await {
                let state = Arc::clone(&shared);
                connections.spawn(async move {
                    let service = service_fn(move |req| serve(Arc::clone(&state), req));
                    let _ =
                        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(sock), service).await;
                });
            }
        });
        WebDavStub { addr, state, task }
    }

    /// `http://ADDR`, for a fencegate config.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Puts a file in place before the test, unrecorded: what the backend held before any
    /// fenced write.
    pub fn seed(&self, path: &str, content: &str) {
        lock(&self.state).files.insert(path.to_owned(), Bytes::from(content.to_owned()));
    }

    /// Every request answered, in the order they were applied (by `end`).
    pub fn records(&self) -> Vec<Record> {
        lock(&self.state).records.clone()
    }

    /// The records from the `first`th on: for a long run that reads them as they come.
    pub fn records_from(&self, first: usize) -> Vec<Record> {
        lock(&self.state).records.get(first..).unwrap_or_default().to_vec()
    }

    pub fn violations(&self) -> Vec<Violation> {
        lock(&self.state).violations.clone()
    }

    /// The files held now.
    pub fn files(&self) -> BTreeMap<String, Bytes> {
        lock(&self.state).files.clone()
    }

    /// Requests that have arrived (their head at least) and are not yet applied and recorded:
    /// 0 once every write a killed proxy had sent in full is in [`WebDavStub::records`].
    pub fn busy(&self) -> usize {
        lock(&self.state).busy
    }
}

impl Drop for WebDavStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// 0–3 ms, spread by `seed` (splitmix64), so holds differ without a shared random source.
fn hold_for(seed: u64) -> Duration {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    Duration::from_micros((z ^ (z >> 31)) % 3001)
}

async fn serve(state: Arc<Mutex<State>>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let busy = Busy::new(&state);
    let (parts, body) = req.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return Ok(reply(StatusCode::BAD_REQUEST));
    };
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut record = Record {
        method: parts.method.as_str().to_owned(),
        path: parts.uri.path().to_owned(),
        destination: header("destination"),
        token: header("fencing-token"),
        op: header(OP_HEADER),
        status: 0,
        changed: BTreeSet::new(),
        start: 0,
        end: 0,
    };
    // Like a real server, finish a write even if the caller hangs up meanwhile.
    let handled = tokio::spawn(async move {
        let regions = record.regions();
        let holds = !regions.is_empty();
        let id = {
            let mut s = lock(&state);
            s.seq += 1;
            record.start = s.seq;
            let describe = record.describe();
            let found: Vec<Violation> = s
                .in_flight
                .iter()
                .filter(|w| w.regions.iter().any(|r| regions.iter().any(|own| own.overlaps(r))))
                .map(|w| Violation { arriving: describe.clone(), in_flight: w.describe.clone() })
                .collect();
            s.violations.extend(found);
            if holds {
                s.in_flight.push(InFlight { id: record.start, regions, describe });
            }
            record.start
        };
        // Held while marked in flight, so a write that overlaps it meanwhile is caught.
        if holds {
            tokio::time::sleep(hold_for(id)).await;
        }
        let mut s = lock(&state);
        let content = apply(&mut s.files, &mut record, body);
        s.seq += 1;
        record.end = s.seq;
        s.in_flight.retain(|w| w.id != id);
        let status = StatusCode::from_u16(record.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        s.records.push(record);
        drop(s);
        drop(busy);
        (status, content)
    });
    Ok(match handled.await {
        Ok((status, content)) => {
            let mut resp = Response::new(Full::new(content.unwrap_or_default()));
            *resp.status_mut() = status;
            resp
        }
        Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR),
    })
}

fn reply(status: StatusCode) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = status;
    resp
}

/// The files in the subtree at `root`, with their paths relative to it (`""` for `root` itself).
fn subtree_of(files: &BTreeMap<String, Bytes>, root: &str) -> Vec<(String, Bytes)> {
    files.iter().filter(|(p, _)| in_subtree(root, p)).map(|(p, c)| (p[root.len()..].to_owned(), c.clone())).collect()
}

/// Removes the subtree at `root`, noting each removed file in `changed`.
fn remove_subtree(files: &mut BTreeMap<String, Bytes>, root: &str, changed: &mut BTreeSet<String>) {
    let doomed: Vec<String> = files.keys().filter(|p| in_subtree(root, p)).cloned().collect();
    for p in doomed {
        files.remove(&p);
        changed.insert(p);
    }
}

/// Applies `record`'s request to `files`, filling in its `status` and `changed`; returns the
/// body to answer with, for reads.
fn apply(files: &mut BTreeMap<String, Bytes>, record: &mut Record, body: Bytes) -> Option<Bytes> {
    let path = record.path.clone();
    let root = path.trim_end_matches('/');
    let changed = &mut record.changed;
    let status = match record.method.as_str() {
        "GET" | "HEAD" => {
            let found = files.get(&path).cloned();
            record.status = if found.is_some() { 200 } else { 404 };
            return found;
        }
        "PUT" => {
            changed.insert(path.clone());
            match files.insert(path.clone(), body) {
                Some(_) => StatusCode::NO_CONTENT,
                None => StatusCode::CREATED,
            }
        }
        "DELETE" => {
            remove_subtree(files, root, changed);
            if changed.is_empty() { StatusCode::NOT_FOUND } else { StatusCode::NO_CONTENT }
        }
        "MOVE" | "COPY" => match record.destination.as_deref().map(destination_path) {
            None => StatusCode::BAD_REQUEST,
            // RFC 4918 §9.8.5: the Destination may not be the source or inside it.
            Some(dest) if in_subtree(root, dest.trim_end_matches('/')) => StatusCode::FORBIDDEN,
            Some(dest) => {
                let dest = dest.trim_end_matches('/');
                let source = subtree_of(files, root);
                if source.is_empty() {
                    StatusCode::NOT_FOUND
                } else {
                    if record.method == "MOVE" {
                        remove_subtree(files, root, changed);
                    }
                    let mut replaced = BTreeSet::new();
                    remove_subtree(files, dest, &mut replaced);
                    for (rel, content) in source {
                        let to = format!("{dest}{rel}");
                        files.insert(to.clone(), content);
                        changed.insert(to);
                    }
                    changed.extend(replaced.iter().cloned());
                    if replaced.is_empty() { StatusCode::CREATED } else { StatusCode::NO_CONTENT }
                }
            }
        },
        _ => StatusCode::METHOD_NOT_ALLOWED,
    };
    record.status = status.as_u16();
    None
}
